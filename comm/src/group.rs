//! Groups: a subset of a generation's ranks (a tensor-parallel group, say) that run collectives
//! among themselves over the generation's communicator, point to point (one
//! [`Communicator::exchange`] per collective, its tensors placed on the communicator's device). Aborting the
//! generation's communicator aborts every group formed on it.
//!
//! A group's all-reduce sums the members' tensors in member order on every member, so every
//! member ends with the same bits whatever the arrival order (and the same bits as a single
//! rank folding the same parts in the same order). Tensor-parallel groups are small (2–8
//! ranks): each member sends its tensor to every other one, which moves (n − 1)/n more bytes
//! than a ring at n = 2..8 but needs no step ordering and keeps the sum order fixed.

use std::sync::Arc;

use tch::Tensor;

use crate::{CommError, Communicator, DevTensor, Result};

/// A subset of a communicator's ranks.
#[derive(Clone)]
pub struct Group {
    comm: Arc<dyn Communicator>,
    /// The generation's ranks of the members, in group order.
    members: Vec<u32>,
    /// This rank's place in `members`.
    me: usize,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("members", &self.members)
            .field("me", &self.me)
            .finish()
    }
}

impl Group {
    /// The group of `members` (ranks of `comm`, in group order, distinct), which must include
    /// this rank.
    pub fn new(comm: Arc<dyn Communicator>, members: Vec<u32>) -> Result<Group> {
        let invalid = |reason: String| CommError::Invalid {
            op: "group",
            reason,
        };
        if let Some(r) = members.iter().find(|r| **r >= comm.world()) {
            return Err(invalid(format!(
                "rank {r} is outside world size {}",
                comm.world()
            )));
        }
        let mut sorted = members.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != members.len() {
            return Err(invalid(format!("members {members:?} repeat a rank")));
        }
        let me = members
            .iter()
            .position(|r| *r == comm.rank())
            .ok_or_else(|| {
                invalid(format!(
                    "rank {} is not among the members {members:?}",
                    comm.rank()
                ))
            })?;
        Ok(Group { comm, members, me })
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> u32 {
        self.me as u32
    }

    pub fn size(&self) -> u32 {
        self.members.len() as u32
    }

    /// The generation's ranks of the members, in group order.
    pub fn members(&self) -> &[u32] {
        &self.members
    }

    /// Every member's `t` (same shape and kind everywhere), in group order; this rank's own is
    /// `t` itself.
    pub fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let shapes = vec![t.size(); self.members.len()];
        self.all_gather_shaped(t, &shapes)
    }

    /// Every member's `t` in group order, member i's of shape `shapes[i]` (uneven slices).
    pub fn all_gather_shaped(&self, t: &Tensor, shapes: &[Vec<i64>]) -> Result<Vec<Tensor>> {
        if shapes.len() != self.members.len() || shapes[self.me] != t.size() {
            return Err(CommError::Invalid {
                op: "group all_gather",
                reason: format!(
                    "{} shapes for {} members, this member's {:?} for a tensor of {:?}",
                    shapes.len(),
                    self.members.len(),
                    shapes.get(self.me),
                    t.size()
                ),
            });
        }
        // every member's part is its `t`
        let send = t.contiguous();
        let parts: Vec<Tensor> = (0..self.members.len())
            .map(|i| {
                if i == self.me {
                    t.shallow_clone()
                } else {
                    send.shallow_clone()
                }
            })
            .collect();
        self.all_to_all(&parts, shapes)
    }

    /// Personalised exchange: `parts[i]` goes to member i (this member's own stays); returns
    /// what each member sent this one, in group order, member i's of shape `shapes[i]` and of
    /// `parts`' kind.
    pub fn all_to_all(&self, parts: &[Tensor], shapes: &[Vec<i64>]) -> Result<Vec<Tensor>> {
        let n = self.members.len();
        if parts.len() != n || shapes.len() != n || shapes[self.me] != parts[self.me].size() {
            return Err(CommError::Invalid {
                op: "group all_to_all",
                reason: format!(
                    "{} parts and {} shapes for {} members",
                    parts.len(),
                    shapes.len(),
                    n
                ),
            });
        }
        if n == 1 {
            return Ok(vec![parts[0].shallow_clone()]);
        }
        // one exchange: every send and receive of this member issued together, the same plan
        // on every member (each member sends to and receives from every other one)
        let kind = parts[self.me].kind();
        let out: Vec<(u32, DevTensor)> = (0..n)
            .filter(|i| *i != self.me)
            .map(|i| (self.members[i], self.comm.place(&parts[i].contiguous())))
            .collect();
        let inn: Vec<(u32, DevTensor)> = (0..n)
            .filter(|i| *i != self.me)
            .map(|i| (self.members[i], self.comm.zeros(shapes[i].as_slice(), kind)))
            .collect();
        let sends: Vec<(u32, &DevTensor)> = out.iter().map(|(p, t)| (*p, t)).collect();
        let recvs: Vec<(u32, &DevTensor)> = inn.iter().map(|(p, t)| (*p, t)).collect();
        self.comm.exchange(&sends, &recvs)?;
        let mut got = inn.into_iter().map(|(_, t)| t.into_tensor());
        Ok((0..n)
            .map(|i| {
                if i == self.me {
                    self.comm.place(&parts[self.me]).into_tensor()
                } else {
                    got.next().expect("one receive per other member")
                }
            })
            .collect())
    }

    /// Sum of the members' `t`, folded in group order (the same bits on every member); `t`
    /// keeps its value, the sum is returned.
    pub fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let parts = self.all_gather(t)?;
        Ok(fold(&parts))
    }

    /// Sum of the members' `t` by a ring (reduce-scatter, then all-gather, one point-to-point
    /// exchange per round with the next and the previous member): each member sends
    /// 2 (n − 1) / n of `t`'s bytes where [`Group::all_reduce_sum`] sends (n − 1) times them,
    /// so groups of more than two (HSDP's replicas of a shard) take this one. Every member
    /// ends with the same bits (each chunk is summed once, around the ring, then copied); the
    /// order of a chunk's sum depends on the chunk, so deterministic mode keeps the member-order
    /// fold. `t` keeps its value, the sum is returned.
    pub fn ring_all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let n = self.members.len();
        let flat = t.reshape([-1]);
        let len = flat.numel() as i64;
        if n == 1 || len == 0 {
            return Ok(t.copy());
        }
        let acc = self.comm.place(&flat.copy()).into_tensor();
        // chunk c: [c·len/n, (c+1)·len/n)
        let bound = |c: usize| (c as i64 * len) / n as i64;
        let chunk = |acc: &Tensor, c: usize| acc.narrow(0, bound(c), bound(c + 1) - bound(c));
        let (next, prev) = (
            self.members[(self.me + 1) % n],
            self.members[(self.me + n - 1) % n],
        );
        let me = self.me;
        // one round: send chunk `out_c` to the next member, take the previous one's chunk
        // `in_c` and add it to this member's (`add`) or put it in place
        let round = |out_c: usize, in_c: usize, add: bool| -> Result<()> {
            let send = self.comm.place(&chunk(&acc, out_c).contiguous());
            let got = self
                .comm
                .zeros(&[bound(in_c + 1) - bound(in_c)], acc.kind());
            self.comm.exchange(&[(next, &send)], &[(prev, &got)])?;
            let mut into = chunk(&acc, in_c);
            match add {
                true => into += got.into_tensor(),
                false => into.copy_(&got.into_tensor()),
            }
            Ok(())
        };
        // reduce-scatter: in round k this member sends its partial sum of chunk (me − k) and
        // adds the previous member's of chunk (me − k − 1); after n − 1 rounds it holds the
        // whole sum of chunk (me + 1)
        for k in 0..n - 1 {
            round((me + n - k) % n, (me + 2 * n - k - 1) % n, true)?;
        }
        // all-gather: pass the whole sums on around the ring
        for k in 0..n - 1 {
            round((me + 1 + n - k) % n, (me + n - k) % n, false)?;
        }
        Ok(acc.view(t.size().as_slice()))
    }

    /// Element-wise maximum over the members.
    pub fn all_reduce_max(&self, t: &Tensor) -> Result<Tensor> {
        let parts = self.all_gather(t)?;
        let mut acc = parts[0].copy();
        for p in &parts[1..] {
            acc = acc.maximum(p);
        }
        Ok(acc)
    }

    /// Abort the generation's communicator (and with it every group on it).
    pub fn abort(&self) {
        self.comm.abort()
    }

    pub fn generation(&self) -> u64 {
        self.comm.generation()
    }
}

/// `parts[0] + parts[1] + ...`, left to right.
pub fn fold(parts: &[Tensor]) -> Tensor {
    let mut acc = parts[0].copy();
    for p in &parts[1..] {
        acc += p;
    }
    acc
}
