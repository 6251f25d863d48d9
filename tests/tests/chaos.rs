//! The chaos soak's short profile (see `ductile_tests::chaos`): at least 20 seeded faults of
//! every kind against a deterministic job with checkpoints and the exactly-once ledger.
//! `ductile-bench chaos` runs the long profile by hand.

#[test]
fn training_chaos_short_profile_loses_no_step_no_sample_and_no_bit() {
    // a fixed seed keeps CI reproducible; DUCTILE_CHAOS_SEED replays or explores another
    let seed = std::env::var("DUCTILE_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_123);
    let report = ductile_tests::chaos::run(&ductile_tests::chaos::Config {
        seed,
        faults: 20,
        steps: 20_000,
        side_faults: 3,
    });
    println!("{}", report.summary());
    assert!(report.faults.len() >= 20, "{}", report.summary());
    assert!(report.violations.is_empty(), "{}", report.summary());
}
