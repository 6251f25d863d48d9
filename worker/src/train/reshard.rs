//! Moving sliced state between two layouts, live: a rank's local tensor holds one or more boxes
//! of a logical tensor (a tensor-parallel slice: one box, or one per Q/K/V block),
//! concatenated along the split dimension. [`move_state`] builds each rank's tensors for its new
//! boxes from what the ranks hold now, by the redistribution plan: what a rank keeps is copied
//! in place, the rest comes point to point from a holder ([`transfer`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use ductile_comm::{CommError, Communicator, DevTensor};
use ductile_strategies::redistribute::{self, intersect, Move, Part, Region};
use ductile_strategies::tensor::{held_regions, split_of, Arch};
use tch::{Kind, Tensor};

/// A protocol error of this generation's communicator, naming the peer.
pub(super) fn protocol(
    comm: &dyn Communicator,
    peer: u32,
    op: &'static str,
    reason: String,
) -> CommError {
    CommError::Protocol {
        generation: comm.generation(),
        op,
        peer,
        reason,
    }
}

/// The view of `t` that `r` covers.
pub(super) fn region_of(t: &Tensor, r: &Region) -> Tensor {
    let mut v = t.shallow_clone();
    for (d, x) in r.iter().enumerate() {
        v = v.narrow(d as i64, x.start as i64, (x.end - x.start) as i64);
    }
    v
}

/// Whether unit `u` is in one of `chunks`.
pub(super) fn holds_unit(chunks: &[std::ops::Range<usize>], u: usize) -> bool {
    chunks.iter().any(|c| c.contains(&u))
}

/// The view of local state tensor `t` that logical region `r` covers (through the rank's
/// holdings when it holds tensor slices).
pub(super) fn state_view(
    state: &[Tensor],
    holdings: Option<&[Holding]>,
    t: usize,
    r: &Region,
) -> Tensor {
    match holdings {
        Some(h) => h[t].view(&state[t], r).expect("a region this rank holds"),
        None => region_of(&state[t], r),
    }
}

/// The header of a state transfer between two ranks, sent on the host face ahead of the state
/// itself (on the device face): magic, step, tensor count, each tensor's element count.
fn encode_head(step: u64, numels: &[usize]) -> Vec<u8> {
    let mut b = Vec::with_capacity(24 + 8 * numels.len());
    b.extend_from_slice(b"DCTH1\0\0\0");
    b.extend_from_slice(&step.to_le_bytes());
    b.extend_from_slice(&(numels.len() as u64).to_le_bytes());
    for n in numels {
        b.extend_from_slice(&(*n as u64).to_le_bytes());
    }
    b
}

/// Check a transfer's header against what this rank expects (the step, and the targets' element
/// counts from the same plan), before anything is written: a bad one leaves every target
/// untouched (a half-overwritten rank could later be chosen as the source of state).
fn check_head(b: &[u8], step: u64, numels: &[usize]) -> Result<(), String> {
    if b.len() < 24 || &b[..8] != b"DCTH1\0\0\0" {
        return Err("not a state transfer header".into());
    }
    let rd = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let (got, count) = (rd(8), rd(16));
    if got != step {
        return Err(format!("state came at step {got}, expected {step}"));
    }
    if count != numels.len() as u64 || b.len() != 24 + 8 * numels.len() {
        return Err(format!(
            "{count} tensors announced, expected {}",
            numels.len()
        ));
    }
    for (i, n) in numels.iter().enumerate() {
        if rd(24 + 8 * i) != *n as u64 {
            return Err(format!(
                "tensor {i}: {} values announced, expected {n}",
                rd(24 + 8 * i)
            ));
        }
    }
    Ok(())
}

/// The boxes of a logical tensor a rank's local tensor holds (none: an empty tensor), laid one after another along
/// `dim` (the other dimensions equal the box's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    pub boxes: Vec<Region>,
    pub dim: usize,
}

impl Holding {
    /// What tensor place `place` of a group of `tp` holds of parameter `name` (of logical
    /// `shape`): its boxes as `strategies::tensor` cuts them, laid along the split's dimension
    /// (the whole tensor where the parameter is replicated).
    pub fn of_tensor_place(arch: Arch, name: &str, shape: &[u64], tp: u32, place: u32) -> Holding {
        Holding {
            boxes: held_regions(arch, name, shape, tp, place),
            dim: split_of(arch, name).dim(),
        }
    }

    /// The shape of the local tensor.
    pub fn local_shape(&self) -> Vec<i64> {
        if self.boxes.is_empty() {
            return vec![0];
        }
        let mut shape: Vec<i64> = self.boxes[0]
            .iter()
            .map(|r| (r.end - r.start) as i64)
            .collect();
        if !shape.is_empty() {
            shape[self.dim] = self
                .boxes
                .iter()
                .map(|b| (b[self.dim].end - b[self.dim].start) as i64)
                .sum();
        }
        shape
    }

    /// Where the logical region `r` lies in the local tensor, if one box holds all of it.
    pub fn local(&self, r: &Region) -> Option<Region> {
        let mut offset = 0;
        for b in &self.boxes {
            if intersect(b, r).as_ref() == Some(r) {
                return Some(
                    r.iter()
                        .zip(b)
                        .enumerate()
                        .map(|(d, (x, bx))| {
                            let o = if d == self.dim { offset } else { 0 };
                            x.start - bx.start + o..x.end - bx.start + o
                        })
                        .collect(),
                );
            }
            offset += b[self.dim].end - b[self.dim].start;
        }
        None
    }

    /// The view of `local` that logical region `r` covers.
    pub fn view(&self, local: &Tensor, r: &Region) -> Option<Tensor> {
        self.local(r).map(|l| region_of(local, &l))
    }

    /// The local tensor this holding makes of the whole (logical) tensor `whole`: its boxes
    /// laid along the split's dimension, a copy.
    pub fn cut(&self, whole: &Tensor) -> Tensor {
        if self.boxes.is_empty() {
            return Tensor::zeros([0], (whole.kind(), whole.device()));
        }
        let parts: Vec<Tensor> = self.boxes.iter().map(|b| region_of(whole, b)).collect();
        Tensor::cat(&parts, self.dim as i64).contiguous()
    }

    /// This holding's boxes as parts of tensor `tensor` held by `rank`.
    pub fn parts(&self, rank: u32, tensor: usize) -> Vec<Part> {
        self.boxes
            .iter()
            .map(|b| Part {
                rank,
                tensor,
                region: b.clone(),
            })
            .collect()
    }
}

/// Build this rank's tensors for `new` (one holding per logical tensor) from `old` (its local
/// tensors with their holdings). `held` and `need` list every rank's old and new boxes (the
/// same lists on every rank); `elem` the element size of each logical tensor; `chunk` the most
/// elements a pair moves in one round ([`transfer`]). Returns the new tensors and what was
/// received.
///
/// `also` (one per logical tensor, or none) is a copy of another rank's state this rank holds
/// too (a buddy copy, which may live in host memory), listed in `held` as this rank's parts.
/// It serves moves the rank's own tensors do not cover, and what the rank keeps of it is copied
/// after what it keeps of its own (a copy is offered only where it is up to date; the rank's
/// own state may not be).
#[allow(clippy::too_many_arguments)]
pub fn move_state(
    comm: &Arc<dyn Communicator>,
    step: u64,
    chunk: u64,
    elem: &[u64],
    old: &[(Tensor, Holding)],
    also: &[(Tensor, Holding)],
    new: &[Holding],
    held: &[Part],
    need: &[Part],
) -> Result<(Vec<Tensor>, Received), CommError> {
    let me = comm.rank();
    let plan = redistribute::plan(elem, held, &[], need).map_err(|e| CommError::Invalid {
        op: "state transfer",
        reason: format!("plan at step {step}: {e}"),
    })?;
    let fresh: Vec<Tensor> = new
        .iter()
        .zip(old)
        .map(|(h, (t, _))| Tensor::zeros(h.local_shape().as_slice(), (t.kind(), t.device())))
        .collect();
    // what this rank keeps: its new boxes' overlap with its old ones
    tch::no_grad(|| {
        for (i, h) in new.iter().enumerate() {
            for nb in &h.boxes {
                for (t, held) in std::iter::once(&old[i]).chain(also.get(i)) {
                    for ob in &held.boxes {
                        if let Some(r) = intersect(nb, ob) {
                            let src = held.view(t, &r).expect("inside an old box");
                            h.view(&fresh[i], &r).expect("inside a new box").copy_(&src);
                        }
                    }
                }
            }
        }
    });
    let got = transfer(
        comm,
        &plan.moves,
        step,
        chunk,
        |m| {
            let (t, h) = &old[m.tensor];
            let copy = || {
                also.get(m.tensor)
                    .and_then(|(c, ch)| ch.view(c, &m.region))
                    .map(|v| v.to_device(t.device()))
            };
            // (the copy first: it is offered only up to date, the rank's own state may not be)
            copy()
                .or_else(|| h.view(t, &m.region))
                .ok_or_else(|| CommError::Invalid {
                    op: "state transfer",
                    reason: format!(
                        "the plan has rank {me} send {:?} of tensor {}, which it does not hold",
                        m.region, m.tensor
                    ),
                })
        },
        |m| {
            new[m.tensor]
                .view(&fresh[m.tensor], &m.region)
                .ok_or_else(|| {
                    protocol(
                        comm.as_ref(),
                        m.from,
                        "state transfer",
                        format!(
                            "region {:?} of tensor {} is not this rank's",
                            m.region, m.tensor
                        ),
                    )
                })
        },
    )?;
    Ok((fresh, got))
}

/// What a transfer brought this rank: bytes (headers included), and the rounds it took (every
/// rank takes the same number).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Received {
    pub bytes: usize,
    pub rounds: usize,
}

/// The most bytes one pair of ranks moves in one round of a state transfer, unless the job
/// sets `training.transfer_chunk_kib`: each round's buffers are at most this per peer.
pub const TRANSFER_CHUNK_BYTES: u64 = 64 << 20;

/// Carry out the point-to-point moves of a redistribution plan, in rounds of at most `chunk`
/// elements per pair of ranks ([`redistribute::rounds`]: a large move is cut, so no buffer
/// holds more than a chunk per peer however much state moves). In each round, per peer, this
/// rank sends what it serves (`source` of each move: a view of its state, or of a checkpoint
/// chunk it read), flattened into one tensor on the device, and receives its own from each
/// sender, written into the `target` views once checked. Each pair's header (step, sizes) goes
/// first on the host face; then every send and receive of this rank is one exchange on the
/// device face (issued together, so no two ranks wait on each other; the pairs in the order of
/// their first move, the same on every rank).
pub fn transfer(
    comm: &Arc<dyn Communicator>,
    moves: &[Move],
    step: u64,
    chunk: u64,
    source: impl Fn(&Move) -> Result<Tensor, CommError>,
    target: impl Fn(&Move) -> Result<Tensor, CommError>,
) -> Result<Received, CommError> {
    let mut got = Received::default();
    for round in redistribute::rounds(moves, chunk) {
        got.bytes += transfer_round(comm, &round, step, &source, &target)?;
        got.rounds += 1;
    }
    Ok(got)
}

/// One round of [`transfer`]: returns the bytes received.
fn transfer_round(
    comm: &Arc<dyn Communicator>,
    moves: &[Move],
    step: u64,
    source: &impl Fn(&Move) -> Result<Tensor, CommError>,
    target: &impl Fn(&Move) -> Result<Tensor, CommError>,
) -> Result<usize, CommError> {
    let me = comm.rank();
    let mut pairs: Vec<(u32, u32)> = Vec::new();
    for m in moves {
        if !pairs.contains(&(m.from, m.to)) {
            pairs.push((m.from, m.to));
        }
    }
    let of = |pair: (u32, u32)| moves.iter().filter(move |m| (m.from, m.to) == pair);
    let float = |t: &Tensor, peer: u32| {
        if t.kind() == Kind::Float {
            Ok(())
        } else {
            Err(protocol(
                comm.as_ref(),
                peer,
                "state transfer",
                format!("state moves as f32, not {:?}", t.kind()),
            ))
        }
    };
    let mut sends = Vec::new();
    for &(_, to) in pairs.iter().filter(|p| p.0 == me) {
        let ts = of((me, to))
            .map(|m| source(m).map(|t| t.contiguous().view([-1])))
            .collect::<Result<Vec<Tensor>, CommError>>()?;
        for t in &ts {
            float(t, to)?;
        }
        let numels: Vec<usize> = ts.iter().map(|t| t.numel()).collect();
        comm.host().send_msg(&encode_head(step, &numels), to)?;
        sends.push((to, comm.place(&Tensor::cat(&ts, 0))));
    }
    let mut recvs = Vec::new();
    let mut bytes = 0;
    for &(from, _) in pairs.iter().filter(|p| p.1 == me) {
        let targets = of((from, me))
            .map(target)
            .collect::<Result<Vec<Tensor>, CommError>>()?;
        for t in &targets {
            float(t, from)?;
        }
        let numels: Vec<usize> = targets.iter().map(|t| t.numel()).collect();
        let head = comm.host().recv_msg(from)?;
        check_head(&head, step, &numels)
            .map_err(|e| protocol(comm.as_ref(), from, "state transfer", e))?;
        let n: usize = numels.iter().sum();
        bytes += head.len() + 4 * n;
        recvs.push((from, comm.zeros(&[n as i64], Kind::Float), targets));
    }
    let s: Vec<(u32, &DevTensor)> = sends.iter().map(|(p, t)| (*p, t)).collect();
    let r: Vec<(u32, &DevTensor)> = recvs.iter().map(|(p, t, _)| (*p, t)).collect();
    comm.exchange(&s, &r)?;
    // the targets are views: the received state writes through into it
    tch::no_grad(|| {
        for (_, buf, targets) in &recvs {
            let mut at = 0;
            for t in targets {
                let k = t.numel() as i64;
                let mut t = t.shallow_clone();
                t.copy_(&buf.tensor().narrow(0, at, k).view(t.size().as_slice()));
                at += k;
            }
        }
    });
    Ok(bytes)
}

/// [`move_state`] for every rank of an in-process mesh at once (`comms[r]` is rank r, holding
/// `local[r]` as `old[r]`), one thread per rank: tests' and benchmarks' re-cuts.
pub fn move_state_in_process(
    comms: &[Arc<dyn Communicator>],
    step: u64,
    chunk: u64,
    elem: &[u64],
    local: &[Vec<Tensor>],
    old: &BTreeMap<u32, Vec<Holding>>,
    new: &BTreeMap<u32, Vec<Holding>>,
) -> Result<Vec<(Vec<Tensor>, Received)>, CommError> {
    let (held, need) = (all_parts(old), all_parts(new));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let r = c.rank();
                let mine: Vec<(Tensor, Holding)> = local[r as usize]
                    .iter()
                    .map(|t| t.shallow_clone())
                    .zip(old[&r].clone())
                    .collect();
                let (new, held, need) = (&new[&r], &held, &need);
                s.spawn(move || move_state(c, step, chunk, elem, &mine, &[], new, held, need))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a rank's thread"))
            .collect()
    })
}

/// A rank's holdings as parts of the state tensors, tensor by tensor.
pub fn holding_parts(rank: u32, hs: &[Holding]) -> Vec<Part> {
    hs.iter()
        .enumerate()
        .flat_map(|(t, h)| h.parts(rank, t))
        .collect()
}

/// Every rank's holdings as parts (tensor by tensor), for [`move_state`].
pub fn all_parts(holdings: &BTreeMap<u32, Vec<Holding>>) -> Vec<Part> {
    holdings
        .iter()
        .flat_map(|(rank, hs)| holding_parts(*rank, hs))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Dataset;
    use crate::model::Model;
    use tch::Device;

    async fn mesh(n: u32, generation: u64) -> Vec<Arc<dyn Communicator>> {
        ductile_comm::tcp::loopback_mesh(n, "rs", generation)
            .await
            .unwrap()
    }

    /// `cut` lays a holding's boxes of the whole tensor as the local tensor `view` reads:
    /// every box read back through the holding is that region of the whole tensor.
    #[test]
    fn a_holding_cut_from_the_whole_tensor_reads_back_each_of_its_boxes() {
        let whole = Tensor::arange(6 * 8, (tch::Kind::Float, Device::Cpu)).view([6, 8]);
        let h = Holding {
            boxes: vec![vec![0..6, 1..3], vec![0..6, 5..8]],
            dim: 1,
        };
        let local = h.cut(&whole);
        assert_eq!(local.size(), h.local_shape());
        assert_eq!(local.size(), vec![6, 5]);
        for b in &h.boxes {
            let got = h.view(&local, b).unwrap();
            assert!(got.equal(&region_of(&whole, b)), "{b:?}");
        }
        let nothing = Holding {
            boxes: vec![],
            dim: 0,
        };
        assert_eq!(nothing.cut(&whole).numel(), 0);
    }

    /// Rank `rank`'s holding of each tensor at `dp × tp` (ranks past dp·tp are spares).
    fn holdings(
        arch: Arch,
        names: &[(String, Vec<u64>)],
        dp: u32,
        tp: u32,
        rank: u32,
    ) -> Vec<Holding> {
        names
            .iter()
            .map(|(name, shape)| {
                if rank >= dp * tp {
                    return Holding {
                        boxes: Vec::new(),
                        dim: 0,
                    };
                }
                Holding::of_tensor_place(arch, name, shape, tp, rank % tp)
            })
            .collect()
    }

    /// Live moves through dp × tp layouts of 4 ranks: after each, every rank holds exactly its
    /// slices of every parameter (the bits of the full tensors), and a layout that does not
    /// change moves nothing; in rounds of a few elements (moves cut mid-row) as in one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slices_move_between_any_two_tensor_parallel_layouts() {
        let model = {
            let _turn = crate::SEEDED.lock().unwrap_or_else(|e| e.into_inner());
            let spec = serde_json::from_value(serde_json::json!({
                "model": "gpt",
                "model_config": {"d_model": 16, "n_layer": 1, "n_head": 4, "ctx": 4, "vocab": 19},
                "dataset": "file:///unused", "global_batch": 4, "seed": 2,
            }))
            .unwrap();
            let data = Dataset::Tokens {
                tokens: Vec::new(),
                header: None,
                ctx: 4,
                vocab: 19,
            };
            Model::new(&spec, &data, Device::Cpu).unwrap()
        };
        let arch = model.arch();
        let full: Vec<(String, Tensor)> = model.params();
        let names: Vec<(String, Vec<u64>)> = full
            .iter()
            .map(|(n, t)| (n.clone(), t.size().iter().map(|d| *d as u64).collect()))
            .collect();
        let elem = vec![4u64; full.len()];
        let comms = mesh(4, 1).await;
        let expect = |h: &Holding, t: &Tensor| {
            let pieces: Vec<Tensor> = h.boxes.iter().map(|b| region_of(t, b)).collect();
            if pieces.is_empty() {
                Tensor::zeros([0], (Kind::Float, Device::Cpu))
            } else {
                Tensor::cat(&pieces, h.dim as i64)
            }
        };
        // every rank starts at dp2 × tp2 with its slices
        let mut layout = (2u32, 2u32);
        let mut local: Vec<Vec<Tensor>> = (0..4)
            .map(|r| {
                holdings(arch, &names, 2, 2, r)
                    .iter()
                    .zip(&full)
                    .map(|(h, (_, t))| expect(h, t))
                    .collect()
            })
            .collect();
        let one = TRANSFER_CHUNK_BYTES / 4;
        for (step, next, chunk) in [
            (1u64, (1u32, 4u32), 7u64),
            (2, (3, 1), one),
            (3, (2, 2), 5),
            (4, (2, 2), 7),
        ] {
            let all = |(dp, tp): (u32, u32)| -> BTreeMap<u32, Vec<Holding>> {
                (0..4)
                    .map(|r| (r, holdings(arch, &names, dp, tp, r)))
                    .collect()
            };
            let (old_h, new_h) = (all(layout), all(next));
            let out =
                move_state_in_process(&comms, step, chunk, &elem, &local, &old_h, &new_h).unwrap();
            for (r, (tensors, got)) in out.iter().enumerate() {
                for (i, t) in tensors.iter().enumerate() {
                    let want = expect(&new_h[&(r as u32)][i], &full[i].1);
                    assert!(
                        t.equal(&want),
                        "{layout:?} → {next:?}: rank {r} holds the wrong {}",
                        full[i].0
                    );
                }
                if next == layout {
                    assert_eq!(
                        *got,
                        Received::default(),
                        "nothing moves when the layout stays"
                    );
                }
                assert_eq!(
                    got.rounds, out[0].1.rounds,
                    "every rank takes the same rounds"
                );
            }
            let rounds = out[0].1.rounds;
            if next != layout {
                // a chunk of a few elements: many rounds; a large one: one
                assert!(
                    if chunk == one {
                        rounds == 1
                    } else {
                        rounds > 10
                    },
                    "{rounds} rounds"
                );
            }
            if next == (3, 1) {
                assert!(out[3].0.iter().all(|t| t.numel() == 0), "rank 3 is a spare");
            }
            local = out.into_iter().map(|(t, _)| t).collect();
            layout = next;
        }
    }

    /// A copy of another rank's state (a buddy copy) serves and keeps before the rank's own,
    /// which may be stale: rank 0's own rows 0..3 are a step behind (-1s) and not offered, its
    /// copy of rows 0..6 is current; rank 1's own rows 3..6 are current. After the move to rows
    /// 0..2 and 2..6 both hold the current bits: rank 0 kept its copy's rows over its own, and
    /// rank 1's row 2 came from rank 0's copy, not its stale own rows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_copy_serves_and_keeps_before_the_rank_s_own_stale_state() {
        let whole = Tensor::arange(6 * 3, (Kind::Float, Device::Cpu)).view([6, 3]);
        let rows = |r: std::ops::Range<u64>| Holding {
            boxes: vec![vec![r, 0..3]],
            dim: 0,
        };
        let comms = mesh(2, 1).await;
        let old = [
            (
                Tensor::full([3, 3], -1.0, (Kind::Float, Device::Cpu)),
                rows(0..3),
            ),
            (whole.narrow(0, 3, 3).copy(), rows(3..6)),
        ];
        let copy = (whole.copy(), rows(0..6));
        let new = [rows(0..2), rows(2..6)];
        let held = [copy.1.parts(0, 0), old[1].1.parts(1, 0)].concat();
        let need = [new[0].parts(0, 0), new[1].parts(1, 0)].concat();
        let out: Vec<Tensor> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, c)| {
                    let mine = [(old[r].0.shallow_clone(), old[r].1.clone())];
                    let also: Vec<(Tensor, Holding)> = if r == 0 {
                        vec![(copy.0.shallow_clone(), copy.1.clone())]
                    } else {
                        Vec::new()
                    };
                    let (new, held, need) = (&new[r], &held, &need);
                    s.spawn(move || {
                        let new = std::slice::from_ref(new);
                        move_state(c, 5, 1 << 20, &[4], &mine, &also, new, held, need)
                            .unwrap()
                            .0
                            .remove(0)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(out[0].equal(&whole.narrow(0, 0, 2)), "{out:?}");
        assert!(out[1].equal(&whole.narrow(0, 2, 4)), "{out:?}");
    }

    #[test]
    fn a_logical_region_maps_into_the_local_tensor_of_concatenated_boxes() {
        // the fused QKV of 4 heads of width 2 (rows 0..24) at tp 2, member 1: rows 4..8,
        // 12..16, 20..24 laid one after another
        let h = Holding {
            boxes: vec![vec![4..8, 0..3], vec![12..16, 0..3], vec![20..24, 0..3]],
            dim: 0,
        };
        assert_eq!(h.local_shape(), vec![12, 3]);
        assert_eq!(h.local(&vec![13..15, 1..3]), Some(vec![5..7, 1..3]));
        assert_eq!(h.local(&vec![20..24, 0..3]), Some(vec![8..12, 0..3]));
        assert_eq!(h.local(&vec![7..13, 0..3]), None, "spans two boxes");
        assert_eq!(h.local(&vec![0..2, 0..3]), None, "not held");
        let cols = Holding {
            boxes: vec![vec![0..5, 2..4]],
            dim: 1,
        };
        assert_eq!(cols.local_shape(), vec![5, 2]);
        assert_eq!(cols.local(&vec![1..2, 3..4]), Some(vec![1..2, 1..2]));
    }

    #[test]
    fn a_transfer_header_is_checked_field_by_field() {
        let good = encode_head(7, &[3, 2]);
        assert_eq!(check_head(&good, 7, &[3, 2]), Ok(()));
        assert!(check_head(&good, 8, &[3, 2])
            .unwrap_err()
            .contains("step 7"));
        assert!(check_head(&good, 7, &[3, 2, 1])
            .unwrap_err()
            .contains("2 tensors"));
        assert!(check_head(&good, 7, &[3, 1])
            .unwrap_err()
            .contains("tensor 1"));
        assert!(check_head(&good[..20], 7, &[3, 2]).is_err());
        let mut bad = good.clone();
        bad[0] ^= 1;
        assert!(check_head(&bad, 7, &[3, 2]).unwrap_err().contains("header"));
    }
}
