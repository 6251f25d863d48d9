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

/// The README's first command, as a newcomer runs it: `bash scripts/quickstart.sh` (not on a
/// terminal: it does not wait for Enter) trains, loses an agent, is scaled back to 4, succeeds,
/// and ends with the chart in the terminal. (Two agents on one host once shared the default
/// work root and one failed its slot with "File exists": this is the test that was missing.)
#[test]
fn training_the_quickstart_trains_survives_an_agent_s_loss_grows_back_and_shows_it() {
    let root = ductile_tests::repo_root();
    let out = std::process::Command::new("bash")
        .arg(root.join("scripts/quickstart.sh"))
        .current_dir(&root)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("bash");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    let tail = |s: &str| {
        s.chars()
            .rev()
            .take(3000)
            .collect::<String>()
            .chars()
            .rev()
            .collect::<String>()
    };
    assert!(
        out.status.success(),
        "the quickstart failed ({}):\n{}\n{}",
        out.status,
        tail(&text),
        tail(&err)
    );
    for want in [
        "failure  world 2",
        "scale    world 4",
        "training finished at step 2500",
        "loss over steps",
        "generation 2 (failure)",
    ] {
        assert!(text.contains(want), "{want:?} missing:\n{}", tail(&text));
    }
}
