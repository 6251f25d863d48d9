//! One plan for moving state between any two layouts, live or from a checkpoint.
//!
//! State is a list of row-major tensors. What a rank holds or needs of a tensor is a *region*:
//! a box, one range per dimension (the whole tensor for a data-parallel replica or a pipeline
//! stage; a slice along one dimension for a tensor-parallel rank). A checkpoint's chunks are
//! regions too: rows of a tensor stored contiguously in an object, each under its own CRC.
//!
//! [`plan`] takes who holds what now (`held`), what the checkpoint stores (`chunks`), and who
//! needs what next (`need`), and says:
//! - which chunks each rank reads from the checkpoint: only the regions no live rank holds are
//!   read, each chunk by exactly one of the ranks that need some of it (the one that has read
//!   the fewest bytes so far), in whole, so that its CRC is checked;
//! - which regions go point to point from whom to whom: a live holder first (the one that has
//!   sent the fewest bytes so far, lowest rank on ties), the rank that read the covering chunk
//!   otherwise. A sender serves a move from its own tensors, or from the chunk it read when the
//!   move names one.
//!
//! What a rank already holds itself never moves. A region that neither a live rank nor the
//! checkpoint covers is an error naming it: the caller decides (stop, or restore everything).
//! The plan depends only on its inputs, so every rank computes the same one.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::fmt;
use std::ops::Range;

/// A box in a tensor: one range of indices per dimension (empty for a scalar).
pub type Region = Vec<Range<u64>>;

/// The whole of a tensor of `shape`.
pub fn whole(shape: &[u64]) -> Region {
    shape.iter().map(|d| 0..*d).collect()
}

/// Elements in a region.
pub fn elements(r: &Region) -> u64 {
    r.iter().map(|x| x.end.saturating_sub(x.start)).product()
}

/// The common part of two regions of one tensor, if any.
pub fn intersect(a: &Region, b: &Region) -> Option<Region> {
    let r: Region = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.start.max(y.start)..x.end.min(y.end))
        .collect();
    r.iter().all(|x| x.start < x.end).then_some(r)
}

/// `a` less `b`, as disjoint boxes (at most two per dimension).
pub fn subtract(a: &Region, b: &Region) -> Vec<Region> {
    if intersect(a, b).is_none() {
        return if elements(a) > 0 {
            vec![a.clone()]
        } else {
            Vec::new()
        };
    }
    let mut out = Vec::new();
    let mut rest = a.clone();
    for d in 0..a.len() {
        let (x, y) = (rest[d].clone(), &b[d]);
        if x.start < y.start {
            let mut lo = rest.clone();
            lo[d] = x.start..y.start;
            out.push(lo);
        }
        if y.end < x.end {
            let mut hi = rest.clone();
            hi[d] = y.end..x.end;
            out.push(hi);
        }
        rest[d] = x.start.max(y.start)..x.end.min(y.end);
    }
    out
}

/// The byte ranges of `region` in a row-major tensor of `shape` with `elem`-byte elements, in
/// order, adjacent ones merged.
pub fn byte_runs(shape: &[u64], elem: u64, region: &Region) -> Vec<Range<u64>> {
    if elements(region) == 0 {
        return Vec::new();
    }
    let n = shape.len();
    // strides in elements
    let mut stride = vec![1u64; n];
    for d in (0..n.saturating_sub(1)).rev() {
        stride[d] = stride[d + 1] * shape[d + 1];
    }
    // the innermost dimensions the region covers whole form one contiguous run with the first
    // dimension (from the inside) it covers only in part
    let mut k = n;
    while k > 0 && region[k - 1] == (0..shape[k - 1]) {
        k -= 1;
    }
    let (k, run) = if k == 0 {
        (0, elements(region) * elem)
    } else {
        let r = &region[k - 1];
        (k - 1, (r.end - r.start) * stride[k - 1] * elem)
    };
    // every index of the dimensions outside the run
    let mut out: Vec<Range<u64>> = Vec::new();
    let mut idx: Vec<u64> = region[..k].iter().map(|r| r.start).collect();
    loop {
        let mut at: u64 = idx.iter().zip(&stride).map(|(i, s)| i * s).sum();
        if k < n {
            at += region[k].start * stride[k];
        }
        let (a, b) = (at * elem, at * elem + run);
        match out.last_mut() {
            Some(l) if l.end == a => l.end = b,
            _ => out.push(a..b),
        }
        // next index, last dimension fastest
        let mut d = k;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < region[d].end {
                break;
            }
            idx[d] = region[d].start;
        }
    }
}

/// `inner`'s coordinates relative to the corner of `outer` (which contains it).
pub fn relative(inner: &Region, outer: &Region) -> Region {
    inner
        .iter()
        .zip(outer)
        .map(|(i, o)| i.start - o.start..i.end - o.start)
        .collect()
}

/// A region of a tensor at a rank: something it holds or needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    pub rank: u32,
    pub tensor: usize,
    pub region: Region,
}

/// A checkpoint chunk: a region of a tensor stored contiguously (row-major), under one CRC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub tensor: usize,
    pub region: Region,
}

/// A region sent point to point; `via` names the chunk the sender read it from (a
/// checkpoint restore), `None` when it serves it from its own tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    pub tensor: usize,
    pub region: Region,
    pub from: u32,
    pub to: u32,
    pub via: Option<usize>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// (rank, chunk index): what each rank reads from the checkpoint, every chunk at most once.
    pub reads: Vec<(u32, usize)>,
    /// What goes point to point, after the reads, in the same order on every rank.
    pub moves: Vec<Move>,
}

impl Plan {
    /// Bytes rank `r` reads from the checkpoint.
    pub fn read_bytes(&self, r: u32, chunks: &[Chunk], elem: &[u64]) -> u64 {
        self.reads
            .iter()
            .filter(|(x, _)| *x == r)
            .map(|(_, c)| elements(&chunks[*c].region) * elem[chunks[*c].tensor])
            .sum()
    }

    /// Bytes rank `r` receives point to point.
    pub fn received_bytes(&self, r: u32, elem: &[u64]) -> u64 {
        self.moves
            .iter()
            .filter(|m| m.to == r)
            .map(|m| elements(&m.region) * elem[m.tensor])
            .sum()
    }

    /// The chunks rank `r` reads, in plan order.
    pub fn reads_of(&self, r: u32) -> Vec<usize> {
        self.reads
            .iter()
            .filter(|(x, _)| *x == r)
            .map(|(_, c)| *c)
            .collect()
    }
}

/// A region nobody holds and no chunk stores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uncovered {
    pub rank: u32,
    pub tensor: usize,
    pub region: Region,
}

impl fmt::Display for Uncovered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} needs {:?} of tensor {}, which no live rank holds and no checkpoint chunk stores",
            self.rank, self.region, self.tensor
        )
    }
}

impl std::error::Error for Uncovered {}

/// The span of dimension 0 a region covers (`0..1` for a scalar's empty region): what the
/// planner's indexes sort and search by.
fn span0(r: &Region) -> (u64, u64) {
    r.first().map_or((0, 1), |x| (x.start, x.end))
}

/// Items of one tensor sorted by where their dimension-0 span starts, with the furthest end of
/// every prefix: the items whose span meets a query's are found without looking at the others
/// (for disjoint spans, as sharded rows are, only the ones that meet it and one more).
struct SpanIndex {
    /// (start, end, item), sorted by start
    spans: Vec<(u64, u64, usize)>,
    /// the furthest end among `spans[..=i]`
    reach: Vec<u64>,
}

impl SpanIndex {
    fn new(mut spans: Vec<(u64, u64, usize)>) -> SpanIndex {
        spans.sort_by_key(|s| (s.0, s.2));
        let mut reach = Vec::with_capacity(spans.len());
        let mut far = 0;
        for s in &spans {
            far = far.max(s.1);
            reach.push(far);
        }
        SpanIndex { spans, reach }
    }

    /// The items whose span meets `lo..hi`, in no particular order.
    fn meeting(&self, (lo, hi): (u64, u64), out: &mut Vec<usize>) {
        // the spans that start before `hi`, from the last back while one of them still reaches
        // past `lo`
        let mut i = self.spans.partition_point(|s| s.0 < hi);
        while i > 0 && self.reach[i - 1] > lo {
            i -= 1;
            let (s, e, item) = self.spans[i];
            if s < hi && e > lo {
                out.push(item);
            }
        }
    }
}

/// Items (tensor, region, item) indexed per tensor by their regions' dimension-0 spans.
fn index_by_tensor<'a>(
    items: impl Iterator<Item = (usize, &'a Region, usize)>,
) -> BTreeMap<usize, SpanIndex> {
    let mut of: BTreeMap<usize, Vec<(u64, u64, usize)>> = BTreeMap::new();
    for (t, r, i) in items {
        let (lo, hi) = span0(r);
        of.entry(t).or_default().push((lo, hi, i));
    }
    of.into_iter()
        .map(|(t, s)| (t, SpanIndex::new(s)))
        .collect()
}

/// The holders of one tensor's identical region: the one that serves a need is the least
/// loaded ((bytes sent, rank, input order)), found in a heap whose keys are brought up to date
/// as they come to its top (what a rank has sent only grows).
struct Holders {
    region: Region,
    heap: BinaryHeap<Reverse<(u64, u32, usize)>>,
}

impl Holders {
    /// The least loaded holder other than `not`: (sent, rank, input index).
    fn least(&mut self, sent: &BTreeMap<u32, u64>, not: u32) -> Option<(u64, u32, usize)> {
        let now = |r: u32| sent.get(&r).copied().unwrap_or(0);
        let mut aside = Vec::new();
        let found = loop {
            let Some(Reverse(top)) = self.heap.peek().copied() else {
                break None;
            };
            if top.0 != now(top.1) {
                self.heap.pop();
                self.heap.push(Reverse((now(top.1), top.1, top.2)));
            } else if top.1 == not {
                aside.push(self.heap.pop().expect("peeked"));
            } else {
                break Some(top);
            }
        };
        self.heap.extend(aside);
        found
    }
}

/// The plan (see the module's comment). `elem[t]` is tensor t's element size in bytes.
///
/// The plan is the one a scan of every part for every need would make (each need served by
/// the intersecting holders in order of (bytes sent so far, rank, input order), then by the
/// checkpoint's chunks in their order). Its work is linear in the parts, not quadratic in
/// world × tensors: each tensor's holders are grouped by region (of replicas holding the same
/// region only the least loaded can serve a need: the rest find nothing left), and holders,
/// chunks and needs are found through an index of their rows ([`SpanIndex`]), so a need looks
/// at the few parts that meet it.
pub fn plan(
    elem: &[u64],
    held: &[Part],
    chunks: &[Chunk],
    need: &[Part],
) -> Result<Plan, Uncovered> {
    let bytes = |t: usize, r: &Region| elements(r) * elem[t];
    // per tensor: its holders grouped by region, and an index of the groups' rows
    let mut groups_of: BTreeMap<usize, (Vec<Holders>, HashMap<&Region, usize>)> = BTreeMap::new();
    // what each rank holds of each tensor, in input order
    let mut own: BTreeMap<(usize, u32), Vec<&Region>> = BTreeMap::new();
    for (i, h) in held.iter().enumerate() {
        own.entry((h.tensor, h.rank)).or_default().push(&h.region);
        let (groups, by_region) = groups_of.entry(h.tensor).or_default();
        let g = *by_region.entry(&h.region).or_insert_with(|| {
            groups.push(Holders {
                region: h.region.clone(),
                heap: BinaryHeap::new(),
            });
            groups.len() - 1
        });
        groups[g].heap.push(Reverse((0, h.rank, i)));
    }
    let mut holders_of: BTreeMap<usize, Vec<Holders>> = groups_of
        .into_iter()
        .map(|(t, (groups, _))| (t, groups))
        .collect();
    let holders_index = index_by_tensor(holders_of.iter().flat_map(|(t, groups)| {
        groups
            .iter()
            .enumerate()
            .map(move |(g, h)| (*t, &h.region, g))
    }));
    let chunks_of = index_by_tensor(
        chunks
            .iter()
            .enumerate()
            .map(|(ci, c)| (c.tensor, &c.region, ci)),
    );
    let mut sent: BTreeMap<u32, u64> = BTreeMap::new();
    let mut out = Plan::default();
    let mut found = Vec::new();
    // what is left for the checkpoint, per need
    let mut rest: Vec<Vec<Region>> = Vec::with_capacity(need.len());
    for n in need {
        let mut todo = vec![n.region.clone()];
        for h in own
            .get(&(n.tensor, n.rank))
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            todo = todo.iter().flat_map(|r| subtract(r, h)).collect();
        }
        let (Some(groups), Some(index)) =
            (holders_of.get_mut(&n.tensor), holders_index.get(&n.tensor))
        else {
            rest.push(todo);
            continue;
        };
        found.clear();
        index.meeting(span0(&n.region), &mut found);
        // each group's least loaded holder, then in order of (sent, rank, input order)
        let mut serving: Vec<((u64, u32, usize), usize)> = Vec::with_capacity(found.len());
        for &g in &found {
            if intersect(&n.region, &groups[g].region).is_some() {
                if let Some(k) = groups[g].least(&sent, n.rank) {
                    serving.push((k, g));
                }
            }
        }
        serving.sort_unstable();
        for ((_, from, _), g) in serving {
            if todo.is_empty() {
                break;
            }
            let region = &groups[g].region;
            let mut next = Vec::new();
            for r in &todo {
                if let Some(x) = intersect(r, region) {
                    *sent.entry(from).or_default() += bytes(n.tensor, &x);
                    out.moves.push(Move {
                        tensor: n.tensor,
                        region: x,
                        from,
                        to: n.rank,
                        via: None,
                    });
                    next.extend(subtract(r, region));
                } else {
                    next.push(r.clone());
                }
            }
            todo = next;
        }
        rest.push(todo);
    }
    // the needs the live holders left something of, per tensor, indexed by their rows
    let open_of = index_by_tensor(
        need.iter()
            .enumerate()
            .filter(|(ni, _)| !rest[*ni].is_empty())
            .map(|(ni, n)| (n.tensor, &n.region, ni)),
    );
    // each chunk someone still needs is read, whole, by the needer that has read least
    let mut read: BTreeMap<u32, u64> = BTreeMap::new();
    let mut reader: Vec<Option<u32>> = vec![None; chunks.len()];
    for (ci, c) in chunks.iter().enumerate() {
        found.clear();
        if let Some(index) = open_of.get(&c.tensor) {
            index.meeting(span0(&c.region), &mut found);
        }
        let mut wants: Vec<u32> = found
            .iter()
            .filter(|&&ni| rest[ni].iter().any(|r| intersect(r, &c.region).is_some()))
            .map(|&ni| need[ni].rank)
            .collect();
        wants.sort_unstable();
        wants.dedup();
        if let Some(r) = wants
            .into_iter()
            .min_by_key(|r| (read.get(r).copied().unwrap_or(0), *r))
        {
            *read.entry(r).or_default() += bytes(c.tensor, &c.region);
            reader[ci] = Some(r);
            out.reads.push((r, ci));
        }
    }
    for (ni, n) in need.iter().enumerate() {
        let mut todo = std::mem::take(&mut rest[ni]);
        if todo.is_empty() {
            continue;
        }
        found.clear();
        if let Some(index) = chunks_of.get(&n.tensor) {
            index.meeting(span0(&n.region), &mut found);
        }
        // in the chunks' order
        found.sort_unstable();
        for &ci in &found {
            if todo.is_empty() {
                break;
            }
            let c = &chunks[ci];
            let mut next = Vec::new();
            for r in &todo {
                match intersect(r, &c.region) {
                    Some(x) => {
                        let from = reader[ci].expect("a chunk someone needs has a reader");
                        if from != n.rank {
                            out.moves.push(Move {
                                tensor: n.tensor,
                                region: x,
                                from,
                                to: n.rank,
                                via: Some(ci),
                            });
                        }
                        next.extend(subtract(r, &c.region));
                    }
                    None => next.push(r.clone()),
                }
            }
            todo = next;
        }
        if let Some(r) = todo.into_iter().next() {
            return Err(Uncovered {
                rank: n.rank,
                tensor: n.tensor,
                region: r,
            });
        }
    }
    Ok(out)
}

/// `r` cut into regions of at most `max` elements (at least one each), in row-major order: along
/// its outermost dimension of more than one index, whole rows at a time where a row fits, else
/// row by row, each cut the same way.
pub fn split_region(r: &Region, max: u64) -> Vec<Region> {
    let max = max.max(1);
    if elements(r) <= max {
        return vec![r.clone()];
    }
    let d = r
        .iter()
        .position(|x| x.end - x.start > 1)
        .expect("a region of more than one element has a dimension of more than one index");
    let inner: u64 = r[d + 1..].iter().map(|x| x.end - x.start).product();
    let mut out = Vec::new();
    if inner <= max {
        let step = max / inner;
        let mut at = r[d].start;
        while at < r[d].end {
            let mut piece = r.clone();
            piece[d] = at..(at + step).min(r[d].end);
            at = piece[d].end;
            out.push(piece);
        }
    } else {
        for i in r[d].clone() {
            let mut row = r.clone();
            row[d] = i..i + 1;
            out.extend(split_region(&row, max));
        }
    }
    out
}

/// A transfer's moves in rounds: each move cut into pieces of at most `max` elements, then each
/// (sender, receiver) pair's pieces, in order, packed into chunks of at most `max` elements;
/// round k holds every pair's k-th chunk, the pairs in the order of their first move. Each
/// round is one exchange, so a pair's buffers never exceed `max` elements however much it
/// moves. The same moves give the same rounds on every rank.
pub fn rounds(moves: &[Move], max: u64) -> Vec<Vec<Move>> {
    let max = max.max(1);
    // each pair's chunks, and the elements in its open (last) chunk
    let mut pairs: Vec<((u32, u32), Vec<Vec<Move>>, u64)> = Vec::new();
    let mut pair_at: HashMap<(u32, u32), usize> = HashMap::new();
    for m in moves {
        let at = *pair_at.entry((m.from, m.to)).or_insert_with(|| {
            pairs.push(((m.from, m.to), vec![Vec::new()], 0));
            pairs.len() - 1
        });
        let (_, chunks, filled) = &mut pairs[at];
        for region in split_region(&m.region, max) {
            let n = elements(&region);
            if *filled > 0 && *filled + n > max {
                chunks.push(Vec::new());
                *filled = 0;
            }
            *filled += n;
            chunks.last_mut().expect("a pair has a chunk").push(Move {
                region,
                ..m.clone()
            });
        }
    }
    let count = pairs.iter().map(|(_, c, _)| c.len()).max().unwrap_or(0);
    (0..count)
        .map(|k| {
            pairs
                .iter()
                .filter_map(|(_, c, _)| c.get(k))
                .flatten()
                .cloned()
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of `r` in `shape`, as flat indices.
    fn cells(shape: &[u64], r: &Region) -> Vec<u64> {
        byte_runs(shape, 1, r)
            .into_iter()
            .flat_map(|x| x.collect::<Vec<_>>())
            .collect()
    }

    /// Moves cut into rounds: no pair moves more than the chunk in a round, every element of
    /// every move goes exactly once, in each move's row-major order, and a pair's rounds keep
    /// its moves' order.
    #[test]
    fn a_transfer_moves_in_rounds_of_at_most_a_chunk_per_pair() {
        let shape = [5u64, 20];
        let mv = |region: Region, from: u32, to: u32| Move {
            tensor: 0,
            region,
            from,
            to,
            via: None,
        };
        let moves = vec![
            mv(vec![0..5, 0..7], 0, 1),  // 35: rows of 7
            mv(vec![0..2, 7..20], 0, 1), // rows of 13 > 8: each row cut
            mv(vec![3..4, 7..9], 2, 1),  // 2: fits
            mv(vec![4..5, 10..11], 0, 1),
        ];
        // a region cut: row-major, every piece at most 8, together the region
        let pieces = split_region(&moves[1].region, 8);
        assert_eq!(
            pieces,
            vec![
                vec![0..1, 7..15],
                vec![0..1, 15..20],
                vec![1..2, 7..15],
                vec![1..2, 15..20]
            ]
        );
        assert_eq!(split_region(&moves[0].region, 8).len(), 5);
        assert_eq!(split_region(&moves[0].region, 14), {
            vec![vec![0..2, 0..7], vec![2..4, 0..7], vec![4..5, 0..7]]
        });
        assert_eq!(split_region(&vec![2..9], 100), vec![vec![2..9]]);
        let r = rounds(&moves, 8);
        // pair (0, 1): 5 rows of 7, 4 pieces of 8/5, 1 element: packed 7 | 7 | 7 | 7 | 7 | 8 |
        // 5 | 8 | 5+1
        let of = |k: usize, p: (u32, u32)| -> Vec<Region> {
            r[k].iter()
                .filter(|m| (m.from, m.to) == p)
                .map(|m| m.region.clone())
                .collect()
        };
        assert_eq!(r.len(), 9);
        assert_eq!(of(0, (2, 1)), vec![vec![3..4, 7..9]]);
        assert!((1..9).all(|k| of(k, (2, 1)).is_empty()));
        assert_eq!(of(8, (0, 1)), vec![vec![1..2, 15..20], vec![4..5, 10..11]]);
        // the pairs in the order of their first move, in every round
        assert_eq!((r[0][0].from, r[0][1].from), (0, 2));
        for k in 0..r.len() {
            let n: u64 = of(k, (0, 1)).iter().map(elements).sum();
            assert!(n <= 8 && n > 0, "round {k}: {n}");
        }
        // every element once, in order
        let flat: Vec<u64> = (0..r.len())
            .flat_map(|k| of(k, (0, 1)))
            .flat_map(|x| cells(&shape, &x))
            .collect();
        let want: Vec<u64> = [&moves[0], &moves[1], &moves[3]]
            .iter()
            .flat_map(|m| cells(&shape, &m.region))
            .collect();
        assert_eq!(flat, want);
        // a chunk that holds everything: one round, the moves as they are, by pair
        let by_pair = vec![
            moves[0].clone(),
            moves[1].clone(),
            moves[3].clone(),
            moves[2].clone(),
        ];
        assert_eq!(rounds(&moves, 1 << 20), vec![by_pair]);
        assert!(rounds(&[], 8).is_empty());
    }

    #[test]
    fn byte_runs_are_the_region_s_elements_in_row_major_order() {
        let shape = [4u64, 5, 3];
        let r: Region = vec![1..3, 2..4, 0..3];
        let mut want = Vec::new();
        for i in 1..3 {
            for j in 2..4 {
                for k in 0..3 {
                    want.push(i * 15 + j * 3 + k);
                }
            }
        }
        assert_eq!(cells(&shape, &r), want);
        // a column slice of a matrix: one run per row
        assert_eq!(
            byte_runs(&[3, 8], 4, &vec![0..3, 2..6]),
            vec![8..24, 40..56, 72..88]
        );
        // rows: one run; the whole tensor: one run; a scalar: its bytes
        assert_eq!(byte_runs(&[6, 4], 4, &vec![2..5, 0..4]), vec![32..80]);
        assert_eq!(byte_runs(&[6, 4], 2, &whole(&[6, 4])), vec![0..48]);
        assert_eq!(byte_runs(&[], 8, &vec![]), vec![0..8]);
        assert!(byte_runs(&[6, 4], 4, &vec![2..2, 0..4]).is_empty());
    }

    #[test]
    fn subtract_leaves_exactly_the_elements_outside() {
        let shape = [6u64, 7];
        let a: Region = vec![1..6, 0..7];
        for b in [
            vec![2..4, 3..5],
            vec![0..6, 0..7],
            vec![5..9, 0..2],
            vec![0..1, 0..7],
        ] {
            let mut got: Vec<u64> = subtract(&a, &b)
                .iter()
                .flat_map(|r| cells(&shape, r))
                .collect();
            got.sort_unstable();
            let inb = cells(
                &shape,
                &b.iter()
                    .zip(&shape)
                    .map(|(r, d)| r.start.min(*d)..r.end.min(*d))
                    .collect(),
            );
            let want: Vec<u64> = cells(&shape, &a)
                .into_iter()
                .filter(|c| !inb.contains(c))
                .collect();
            assert_eq!(got, want, "{a:?} - {b:?}");
        }
    }

    /// The regions of a tensor of `shape` that `k` ranks of a layout hold: whole (replicas),
    /// rows (a column-parallel split) or columns (row-parallel).
    fn split(shape: &[u64], k: u64, i: u64, dim: usize) -> Region {
        let mut r = whole(shape);
        let n = shape[dim];
        r[dim] = i * n / k..(i + 1) * n / k;
        r
    }

    /// A layout over `world` ranks: each rank's regions of each tensor.
    #[derive(Clone, Debug)]
    struct Layout {
        dp: u32,
        pp: u32,
        tp: u32,
    }

    fn layouts(world: u32) -> Vec<Layout> {
        let mut v = Vec::new();
        for dp in 1..=world {
            for pp in 1..=world {
                for tp in 1..=world {
                    if dp * pp * tp <= world && dp * pp * tp >= world.saturating_sub(1).max(1) {
                        v.push(Layout { dp, pp, tp });
                    }
                }
            }
        }
        v
    }

    /// Tensors: per stage-able unit, a column-split weight, a row-split weight and a replicated
    /// bias; the parts rank r holds under `l` (ranks in dp-major, then pp, then tp order).
    fn parts(shapes: &[Vec<u64>], l: &Layout) -> Vec<Part> {
        let units = shapes.len() as u32 / 3;
        let mut out = Vec::new();
        for d in 0..l.dp {
            for s in 0..l.pp {
                for t in 0..l.tp {
                    let rank = (d * l.pp + s) * l.tp + t;
                    for u in (s * units / l.pp)..((s + 1) * units / l.pp) {
                        for k in 0..3 {
                            let ti = (u * 3 + k) as usize;
                            let region = match k {
                                0 => split(&shapes[ti], l.tp as u64, t as u64, 0),
                                1 => split(&shapes[ti], l.tp as u64, t as u64, 1),
                                _ => whole(&shapes[ti]),
                            };
                            out.push(Part {
                                rank,
                                tensor: ti,
                                region,
                            });
                        }
                    }
                }
            }
        }
        out
    }

    fn model() -> (Vec<Vec<u64>>, Vec<u64>) {
        let mut shapes = Vec::new();
        for u in 0..4u64 {
            shapes.push(vec![8, 6 + u]);
            shapes.push(vec![5, 8]);
            shapes.push(vec![5]);
        }
        let elem = vec![4; shapes.len()];
        (shapes, elem)
    }

    /// Carry out a plan on flat element values: each rank's tensors hold `value(t, index)`
    /// where it holds them (or what it read), and must end up so wherever it needs them.
    fn execute(
        shapes: &[Vec<u64>],
        held: &[Part],
        chunks: &[Chunk],
        need: &[Part],
        p: &Plan,
    ) -> BTreeMap<(u32, usize, u64), u64> {
        let value = |t: usize, i: u64| (t as u64) << 32 | i;
        let mut have: BTreeMap<(u32, usize, u64), u64> = BTreeMap::new();
        for h in held {
            for i in cells(&shapes[h.tensor], &h.region) {
                have.insert((h.rank, h.tensor, i), value(h.tensor, i));
            }
        }
        let mut read: BTreeMap<(u32, usize), Vec<u64>> = BTreeMap::new();
        for (r, c) in &p.reads {
            read.insert(
                (*r, *c),
                cells(&shapes[chunks[*c].tensor], &chunks[*c].region),
            );
        }
        let holds = |r: u32, t: usize, i: u64| {
            held.iter()
                .any(|h| h.rank == r && h.tensor == t && cells(&shapes[t], &h.region).contains(&i))
        };
        let mut moved = std::collections::BTreeSet::new();
        for m in &p.moves {
            for i in cells(&shapes[m.tensor], &m.region) {
                let v = match m.via {
                    None => *have
                        .get(&(m.from, m.tensor, i))
                        .unwrap_or_else(|| panic!("{m:?}: the sender does not hold {i}")),
                    Some(c) => {
                        assert!(read[&(m.from, c)].contains(&i), "{m:?}: not in its chunk");
                        value(m.tensor, i)
                    }
                };
                assert!(
                    !holds(m.to, m.tensor, i),
                    "{m:?} moves what its destination holds"
                );
                assert!(
                    moved.insert((m.to, m.tensor, i)),
                    "{m:?}: element {i} arrives twice"
                );
                have.insert((m.to, m.tensor, i), v);
            }
        }
        for (r, c) in &p.reads {
            for i in &read[&(*r, *c)] {
                have.entry((*r, chunks[*c].tensor, *i))
                    .or_insert(value(chunks[*c].tensor, *i));
            }
        }
        for n in need {
            for i in cells(&shapes[n.tensor], &n.region) {
                assert_eq!(
                    have.get(&(n.rank, n.tensor, i)),
                    Some(&value(n.tensor, i)),
                    "rank {} tensor {} element {i}",
                    n.rank,
                    n.tensor
                );
            }
        }
        have
    }

    /// The planner as it was before its parts were indexed by tensor (every need scanned
    /// every part): the indexed one must make exactly its plan.
    fn plan_scanning(
        elem: &[u64],
        held: &[Part],
        chunks: &[Chunk],
        need: &[Part],
    ) -> Result<Plan, Uncovered> {
        let bytes = |t: usize, r: &Region| elements(r) * elem[t];
        let mut sent: BTreeMap<u32, u64> = BTreeMap::new();
        let mut out = Plan::default();
        // what is left for the checkpoint, per need
        let mut rest: Vec<Vec<Region>> = Vec::with_capacity(need.len());
        for n in need {
            let mut todo = vec![n.region.clone()];
            for h in held
                .iter()
                .filter(|h| h.tensor == n.tensor && h.rank == n.rank)
            {
                todo = todo.iter().flat_map(|r| subtract(r, &h.region)).collect();
            }
            let mut holders: Vec<&Part> = held
                .iter()
                .filter(|h| h.tensor == n.tensor && h.rank != n.rank)
                .collect();
            holders.sort_by_key(|h| (sent.get(&h.rank).copied().unwrap_or(0), h.rank));
            for h in holders {
                let mut next = Vec::new();
                for r in &todo {
                    if let Some(x) = intersect(r, &h.region) {
                        *sent.entry(h.rank).or_default() += bytes(n.tensor, &x);
                        out.moves.push(Move {
                            tensor: n.tensor,
                            region: x,
                            from: h.rank,
                            to: n.rank,
                            via: None,
                        });
                        next.extend(subtract(r, &h.region));
                    } else {
                        next.push(r.clone());
                    }
                }
                todo = next;
            }
            rest.push(todo);
        }
        // each chunk someone still needs is read, whole, by the needer that has read least
        let mut read: BTreeMap<u32, u64> = BTreeMap::new();
        let mut reader: Vec<Option<u32>> = vec![None; chunks.len()];
        for (ci, c) in chunks.iter().enumerate() {
            let mut wants: Vec<u32> = need
                .iter()
                .zip(&rest)
                .filter(|(n, todo)| {
                    n.tensor == c.tensor && todo.iter().any(|r| intersect(r, &c.region).is_some())
                })
                .map(|(n, _)| n.rank)
                .collect();
            wants.sort_unstable();
            wants.dedup();
            if let Some(r) = wants
                .into_iter()
                .min_by_key(|r| (read.get(r).copied().unwrap_or(0), *r))
            {
                *read.entry(r).or_default() += bytes(c.tensor, &c.region);
                reader[ci] = Some(r);
                out.reads.push((r, ci));
            }
        }
        for (n, todo) in need.iter().zip(rest) {
            let mut todo = todo;
            for (ci, c) in chunks
                .iter()
                .enumerate()
                .filter(|(_, c)| c.tensor == n.tensor)
            {
                let mut next = Vec::new();
                for r in &todo {
                    match intersect(r, &c.region) {
                        Some(x) => {
                            let from = reader[ci].expect("a chunk someone needs has a reader");
                            if from != n.rank {
                                out.moves.push(Move {
                                    tensor: n.tensor,
                                    region: x,
                                    from,
                                    to: n.rank,
                                    via: Some(ci),
                                });
                            }
                            next.extend(subtract(r, &c.region));
                        }
                        None => next.push(r.clone()),
                    }
                }
                todo = next;
            }
            if let Some(r) = todo.into_iter().next() {
                return Err(Uncovered {
                    rank: n.rank,
                    tensor: n.tensor,
                    region: r,
                });
            }
        }
        Ok(out)
    }

    /// The indexed planner makes exactly the scanning one's plan (the same moves in the same
    /// order, the same reads, the same refusal): ranks of two releases in one job plan alike.
    /// Every pair of layouts of up to four ranks, live, from chunks, and from both (the
    /// survivors of the old world and a checkpoint), the parts given in layout order and
    /// interleaved; and rows of 40 tensors sharded over 6 ranks re-cut to 5 and 7.
    #[test]
    fn the_indexed_planner_makes_the_scanning_planner_s_plan() {
        let (shapes, elem) = model();
        let chunks: Vec<Chunk> = (0..shapes.len())
            .flat_map(|t| (0..2).map(move |k| (t, k)))
            .map(|(t, k)| Chunk {
                tensor: t,
                region: split(&shapes[t], 2, k, 0),
            })
            .collect();
        let mut compared = 0;
        for wa in 1..=4 {
            for wb in 1..=4 {
                for a in layouts(wa) {
                    for b in layouts(wb) {
                        let mut held: Vec<Part> = parts(&shapes, &a)
                            .into_iter()
                            .filter(|h| h.rank < wb)
                            .collect();
                        let need = parts(&shapes, &b);
                        for _ in 0..2 {
                            for ch in [&[][..], &chunks[..]] {
                                assert_eq!(
                                    plan(&elem, &held, ch, &need),
                                    plan_scanning(&elem, &held, ch, &need),
                                    "{a:?} -> {b:?}"
                                );
                                compared += 1;
                            }
                            // the same parts, another order
                            held.sort_by_key(|h| (h.tensor % 3, std::cmp::Reverse(h.rank)));
                        }
                    }
                }
            }
        }
        assert!(compared > 1000, "{compared}");
        let rows: Vec<Vec<u64>> = (0..40).map(|t| vec![60 + t, 8]).collect();
        let elem = vec![4; rows.len()];
        let sharded = |world: u64| -> Vec<Part> {
            (0..world)
                .flat_map(|r| {
                    rows.iter().enumerate().map(move |(t, sh)| Part {
                        rank: r as u32,
                        tensor: t,
                        region: split(sh, world, r, 0),
                    })
                })
                .collect()
        };
        for to in [5, 7] {
            let held: Vec<Part> = sharded(6)
                .into_iter()
                .filter(|h| h.rank < to as u32)
                .collect();
            let need = sharded(to);
            let p = plan(&elem, &held, &[], &need);
            assert_eq!(p, plan_scanning(&elem, &held, &[], &need), "6 -> {to}");
            // 6 -> 5: rank 5's rows have no survivor, refused naming them; 6 -> 7: every row
            // has its holder
            assert_eq!(p.is_err(), to == 5, "6 -> {to}");
        }
        // sticky ownership (several runs of rows per rank, after a walk of resizes), live and
        // with a lost place's rows read from chunks, and whole replicas of every tensor at
        // 9 ranks: the same plan
        let owners = |o: &crate::rows::RowOwners| -> Vec<Part> {
            (0..o.places())
                .flat_map(|p| {
                    rows.iter().enumerate().flat_map(move |(t, sh)| {
                        o.runs(sh[0], p).into_iter().map(move |r| Part {
                            rank: p,
                            tensor: t,
                            region: vec![r, 0..sh[1]],
                        })
                    })
                })
                .collect()
        };
        let mut o = crate::rows::RowOwners::even(crate::rows::RowOwners::chunks_for(8), 6);
        for (stay, to) in [
            (
                vec![Some(0), Some(1), None, Some(2), Some(3), Some(4)],
                5u32,
            ),
            ((0..5).map(Some).collect(), 7),
            (
                vec![Some(0), None, Some(1), Some(2), Some(3), Some(4), Some(5)],
                6,
            ),
        ] {
            let next = o.resized(&stay, to).unwrap();
            let held: Vec<Part> = owners(&o)
                .into_iter()
                .filter_map(|h| stay[h.rank as usize].map(|rank| Part { rank, ..h }))
                .collect();
            let need = owners(&next);
            let chunks: Vec<Chunk> = (0..rows.len())
                .flat_map(|t| (0..3).map(move |k| (t, k)))
                .map(|(t, k)| Chunk {
                    tensor: t,
                    region: split(&rows[t], 3, k, 0),
                })
                .collect();
            for ch in [&[][..], &chunks[..]] {
                let p = plan(&elem, &held, ch, &need);
                assert_eq!(
                    p,
                    plan_scanning(&elem, &held, ch, &need),
                    "{stay:?} -> {to}"
                );
                assert_eq!(
                    p.is_err(),
                    ch.is_empty() && stay.contains(&None),
                    "{stay:?}"
                );
            }
            o = next;
        }
        let replicas: Vec<Part> = (0..9u32)
            .flat_map(|r| {
                rows.iter().enumerate().map(move |(t, sh)| Part {
                    rank: r,
                    tensor: t,
                    region: whole(sh),
                })
            })
            .collect();
        let held: Vec<Part> = replicas
            .iter()
            .filter(|h| h.rank % 3 != 1)
            .cloned()
            .collect();
        assert_eq!(
            plan(&elem, &held, &[], &replicas),
            plan_scanning(&elem, &held, &[], &replicas)
        );
    }

    /// Every pair of layouts of up to four ranks, live: every needed element arrives, once,
    /// from a holder; nothing is read from the checkpoint.
    #[test]
    fn every_pair_of_layouts_moves_live_state_and_reads_nothing() {
        let (shapes, elem) = model();
        let mut moved_some = 0;
        for wa in 1..=4 {
            for wb in 1..=4 {
                for a in layouts(wa) {
                    for b in layouts(wb) {
                        // the ranks of the new world that are still alive hold their old parts
                        let held: Vec<Part> = parts(&shapes, &a)
                            .into_iter()
                            .filter(|h| h.rank < wb)
                            .collect();
                        let need = parts(&shapes, &b);
                        let chunks: Vec<Chunk> = Vec::new();
                        match plan(&elem, &held, &chunks, &need) {
                            Ok(p) => {
                                assert!(p.reads.is_empty());
                                execute(&shapes, &held, &chunks, &need, &p);
                                for m in &p.moves {
                                    assert_ne!(m.from, m.to);
                                }
                                // nothing moves exactly when every rank holds what it needs
                                let own = need.iter().all(|n| {
                                    let mine: Vec<u64> = held
                                        .iter()
                                        .filter(|h| h.rank == n.rank && h.tensor == n.tensor)
                                        .flat_map(|h| cells(&shapes[h.tensor], &h.region))
                                        .collect();
                                    cells(&shapes[n.tensor], &n.region)
                                        .iter()
                                        .all(|c| mine.contains(c))
                                });
                                assert_eq!(p.moves.is_empty(), own, "{a:?} -> {b:?}");
                                moved_some += !own as usize;
                            }
                            // only what no survivor holds is uncovered
                            Err(e) => assert!(
                                held.iter()
                                    .filter(|h| h.tensor == e.tensor)
                                    .all(|h| intersect(&h.region, &e.region).is_none()),
                                "{a:?} -> {b:?}: {e}"
                            ),
                        }
                    }
                }
            }
        }
        assert!(moved_some > 100, "{moved_some} pairs moved state");
    }

    /// Every pair of layouts of up to four ranks from a checkpoint written by the first: each
    /// chunk is read once, and no rank reads more than its own share and one chunk.
    #[test]
    fn every_pair_of_layouts_restores_from_chunks_reading_each_once() {
        let (shapes, elem) = model();
        for wa in 1..=4u32 {
            for a in layouts(wa) {
                // the writers' chunks: each tensor's rows split over the ranks holding it
                let mut chunks = Vec::new();
                for (t, s) in shapes.iter().enumerate() {
                    let w = parts(&shapes, &a)
                        .into_iter()
                        .filter(|p| p.tensor == t)
                        .count() as u64;
                    for i in 0..w {
                        let r = split(s, w, i, 0);
                        if elements(&r) > 0 {
                            chunks.push(Chunk {
                                tensor: t,
                                region: r,
                            });
                        }
                    }
                }
                for wb in 1..=4 {
                    for b in layouts(wb) {
                        let need = parts(&shapes, &b);
                        let p = plan(&elem, &[], &chunks, &need).unwrap();
                        execute(&shapes, &[], &chunks, &need, &p);
                        let mut once: Vec<usize> = p.reads.iter().map(|r| r.1).collect();
                        once.sort_unstable();
                        let n = once.len();
                        once.dedup();
                        assert_eq!(n, once.len(), "a chunk read twice");
                        assert_eq!(n, chunks.len(), "every chunk is needed by someone");
                        let max_chunk = chunks
                            .iter()
                            .map(|c| elements(&c.region) * 4)
                            .max()
                            .unwrap();
                        for r in 0..wb {
                            let own: u64 = need
                                .iter()
                                .filter(|n| n.rank == r)
                                .map(|n| elements(&n.region) * 4)
                                .sum();
                            let got = p.read_bytes(r, &chunks, &elem);
                            assert!(
                                got <= own + 2 * max_chunk,
                                "{a:?} -> {b:?}: rank {r} reads {got}, holds {own}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn live_holders_come_first_the_checkpoint_fills_the_rest_and_load_spreads() {
        let shapes = vec![vec![4u64, 4], vec![4, 4], vec![4, 4], vec![4, 4]];
        let elem = vec![4u64; 4];
        // ranks 0 and 1 hold everything but tensor 3; rank 2 is new
        let mut held = Vec::new();
        for r in 0..2 {
            for t in 0..3 {
                held.push(Part {
                    rank: r,
                    tensor: t,
                    region: whole(&shapes[t]),
                });
            }
        }
        let chunks: Vec<Chunk> = (0..4)
            .flat_map(|t| {
                [0..2, 2..4].map(|rows| Chunk {
                    tensor: t,
                    region: vec![rows, 0..4],
                })
            })
            .collect();
        let need: Vec<Part> = (0..3)
            .flat_map(|r| {
                (0..4).map(move |t| Part {
                    rank: r,
                    tensor: t,
                    region: vec![0..4, 0..4],
                })
            })
            .collect();
        let p = plan(&elem, &held, &chunks, &need).unwrap();
        // only tensor 3 is read, its two chunks by two different ranks
        let reads: Vec<usize> = p.reads.iter().map(|r| r.1).collect();
        assert_eq!(reads, vec![6, 7]);
        assert_ne!(p.reads[0].0, p.reads[1].0);
        // rank 2's tensors 0..3 come from ranks 0 and 1, spread
        let from: Vec<u32> = p
            .moves
            .iter()
            .filter(|m| m.to == 2 && m.via.is_none())
            .map(|m| m.from)
            .collect();
        assert_eq!(from.len(), 3);
        assert!(from.contains(&0) && from.contains(&1));
        execute(&shapes, &held, &chunks, &need, &p);
        // the same inputs, the same plan
        assert_eq!(p, plan(&elem, &held, &chunks, &need).unwrap());
        // a region nobody has is named
        let e = plan(&elem, &held, &[], &need).unwrap_err();
        assert_eq!(e.tensor, 3);
    }
}
