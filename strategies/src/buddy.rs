//! Buddy copies of sharded state (`training.buddy_copies`): in a generation where each shard of
//! the training state has one holder, every rank also keeps its *ward's* shard in host memory,
//! refreshed every step, so the loss of one rank (or of one node, where the copy lives on
//! another) re-shards from the survivors without touching the checkpoint. Gemini's in-memory
//! checkpoints place copies the same way: a ring over the ranks, shifted so a copy lands on
//! another node where one exists.
//!
//! This module says who keeps whose copy; the worker moves the bytes.

use ductile_cluster::records::Generation;

/// The keeper of each of `n` places laid out on `nodes` (place i on `nodes[i]`): place i is kept
/// by place (i + k) mod n, with k the least shift in 1..n that puts every keeper on another node
/// than its ward, or 1 when no shift does (every place on one node: a copy then survives its
/// process, not its node). A shift is a permutation, so every place keeps exactly one copy.
pub fn keepers(nodes: &[&str]) -> Vec<usize> {
    let n = nodes.len();
    if n < 2 {
        return (0..n).collect();
    }
    let k = (1..n)
        .find(|k| (0..n).all(|i| nodes[i] != nodes[(i + k) % n]))
        .unwrap_or(1);
    (0..n).map(|i| (i + k) % n).collect()
}

/// Whether generation `g`'s layout gives each shard of the state exactly one holder, so that
/// buddy copies apply: data parallel alone (no stages, no tensor groups), every data-parallel
/// rank in one shard group of at least 2, no spares.
pub fn applies(g: &Generation) -> bool {
    let l = &g.layout;
    l.pipeline_parallel <= 1
        && l.tensor_parallel <= 1
        && l.data_parallel >= 2
        && l.dp_shard == l.data_parallel
        && g.members.len() == l.data_parallel as usize
        && g.members.iter().all(|m| !m.spare)
}

/// The keeper rank of each rank of `g` (indexed by rank), where buddy copies apply.
pub fn of_generation(g: &Generation) -> Option<Vec<u32>> {
    if !applies(g) {
        return None;
    }
    let mut by_rank: Vec<(u32, &str)> = g
        .members
        .iter()
        .map(|m| (m.rank, m.node.as_str()))
        .collect();
    by_rank.sort_unstable();
    if by_rank.iter().enumerate().any(|(i, (r, _))| *r != i as u32) {
        return None;
    }
    let nodes: Vec<&str> = by_rank.iter().map(|(_, n)| *n).collect();
    Some(keepers(&nodes).into_iter().map(|k| k as u32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_cluster::records::{Layout, Member};

    fn is_permutation(k: &[usize]) -> bool {
        let mut s = k.to_vec();
        s.sort_unstable();
        s == (0..k.len()).collect::<Vec<_>>()
    }

    /// Two slots per node: each copy goes to the other node; every place keeps one copy.
    #[test]
    fn a_copy_lands_on_another_node_where_one_exists() {
        let k = keepers(&["a", "a", "b", "b"]);
        assert_eq!(k, vec![2, 3, 0, 1]);
        let k = keepers(&["a", "b", "a", "b"]);
        assert_eq!(k, vec![1, 2, 3, 0]);
        // uneven: 3 on a, 2 on b (no shift separates them all: 1 as the fallback)
        let nodes = ["a", "a", "a", "b", "b"];
        let k = keepers(&nodes);
        assert!(is_permutation(&k));
        // 3 nodes of 2
        let nodes = ["a", "a", "b", "b", "c", "c"];
        let k = keepers(&nodes);
        assert!(is_permutation(&k));
        assert!((0..6).all(|i| nodes[i] != nodes[k[i]]), "{k:?}");
    }

    #[test]
    fn one_node_falls_back_to_the_next_place() {
        assert_eq!(keepers(&["a", "a", "a"]), vec![1, 2, 0]);
        assert_eq!(keepers(&["a"]), vec![0]);
        assert!(keepers(&[]).is_empty());
    }

    fn generation(nodes: &[&str], layout: Layout) -> Generation {
        let members: Vec<Member> = nodes
            .iter()
            .enumerate()
            .map(|(r, n)| Member {
                node: n.to_string(),
                slot: r as u32,
                rank: r as u32,
                dp_rank: r as u32,
                ..Default::default()
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "job": "j", "number": 1, "members": members, "world_size": nodes.len(),
            "layout": layout, "resume_step": 0, "state_source": "seed", "desired": nodes.len(),
            "reason": "start", "detail": "", "triggered_at_ms": 0, "published_at_ms": 0,
        }))
        .unwrap()
    }

    /// Only layouts where a shard has a single holder get copies.
    #[test]
    fn copies_apply_where_each_shard_has_one_holder() {
        let g = generation(&["a", "a", "b", "b"], Layout::sharded(4, 4));
        assert_eq!(of_generation(&g), Some(vec![2, 3, 0, 1]));
        // HSDP: each shard has a replica already
        assert_eq!(
            of_generation(&generation(&["a", "b", "c", "d"], Layout::sharded(4, 2))),
            None
        );
        // unsharded
        assert_eq!(
            of_generation(&generation(&["a", "b"], Layout::data_parallel(2))),
            None
        );
        // a world of one
        assert_eq!(
            of_generation(&generation(&["a"], Layout::sharded(1, 1))),
            None
        );
        // a spare
        let mut g = generation(&["a", "b", "c"], Layout::sharded(2, 2));
        g.members[2].spare = true;
        assert_eq!(of_generation(&g), None);
    }
}
