//! Bounded fuzzing (proptest, in CI) of the manifest a restore reads: random edits of a valid
//! manifest either fail `Manifest::validate` with a message or give one whose chunks every
//! reader plan can use without a panic.

use std::collections::BTreeMap;

use ductile_checkpoint::format::*;
use ductile_checkpoint::plan;
use ductile_cluster::fuzz::mutate;
use proptest::prelude::*;

fn manifest() -> Manifest {
    let chunk = |object: &str, a: u64, row: u64, rows: u64, cols: u64| ChunkEntry {
        object: object.into(),
        key: String::new(),
        byte_range: [a, a + rows * cols * 4],
        offsets: vec![row, 0],
        shape: vec![rows, cols],
        crc32c: 1,
    };
    let mut tensors = BTreeMap::new();
    tensors.insert(
        "w".to_string(),
        TensorEntry {
            dtype: Dtype::F32,
            shape: vec![6, 3],
            kind: TensorKind::Parameter,
            chunks: vec![chunk("s0", 64, 0, 4, 3), chunk("s1", 64, 4, 2, 3)],
        },
    );
    tensors.insert(
        "b".to_string(),
        TensorEntry {
            dtype: Dtype::F32,
            shape: vec![],
            kind: TensorKind::Buffer,
            chunks: vec![ChunkEntry {
                object: "s0".into(),
                key: String::new(),
                byte_range: [112, 116],
                offsets: vec![],
                shape: vec![],
                crc32c: 2,
            }],
        },
    );
    Manifest {
        format: FORMAT.into(),
        job: "j".into(),
        step: 5,
        generation: 2,
        created_at_ms: 1,
        world_size: 2,
        layout: ductile_cluster::records::Layout::data_parallel(2),
        order: vec!["w".into(), "b".into()],
        tensors,
        objects: vec![
            ObjectEntry {
                object: "s0".into(),
                size: 116,
            },
            ObjectEntry {
                object: "s1".into(),
                size: 88,
            },
        ],
        extra: serde_json::json!({"data_cursor": {"global_batch": 8}}),
    }
}

#[test]
fn the_seed_manifest_is_valid_and_broken_ones_are_named() {
    let m = manifest();
    m.validate().unwrap();
    let mut bad = m.clone();
    bad.tensors.get_mut("w").unwrap().chunks[1].byte_range = [80, 64];
    assert!(bad
        .validate()
        .unwrap_err()
        .contains("tensor w chunk 1: byte range 80..64"));
    let mut bad = m.clone();
    bad.tensors.get_mut("w").unwrap().chunks[0].offsets = vec![5, 0];
    assert!(bad.validate().unwrap_err().contains("reach outside"));
    let mut bad = m.clone();
    bad.order.push("w".into());
    assert!(bad.validate().unwrap_err().contains("twice"));
    let mut bad = m;
    bad.tensors.get_mut("b").unwrap().chunks[0].object = "s9".into();
    assert!(bad.validate().unwrap_err().contains("not listed"));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn edited_manifests_are_refused_or_safe_to_plan(
        e in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 0..10),
        readers in 1u32..6,
    ) {
        let json = serde_json::to_vec(&manifest()).unwrap();
        if let Ok(m) = serde_json::from_slice::<Manifest>(&mutate(&json, &e)) {
            if m.validate().is_ok() {
                let shares = plan::readers(&m, readers);
                let total: usize = shares.iter().map(|s| s.len()).sum();
                let chunks: usize = m.tensors.values().map(|t| t.chunks.len()).sum();
                prop_assert_eq!(total, chunks);
                for (_, t) in m.ordered() {
                    for c in &t.chunks {
                        prop_assert!(c.byte_range[0] <= c.byte_range[1]);
                    }
                }
            }
        }
    }

}
