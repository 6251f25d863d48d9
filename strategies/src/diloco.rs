//! DiLoCo's rounds as data: a round's work is a list of global positions (the positions its
//! predecessors handed over, then fresh ones), cut into one contiguous piece per replica,
//! sized by the replicas' measured speed (or evenly). Pure functions, so every rank computes
//! the same pieces from the same inputs.

use std::ops::Range;

/// Positions, as ranges in order.
pub type Ranges = Vec<Range<u64>>;

/// How many positions `r` holds.
pub fn total(r: &[Range<u64>]) -> u64 {
    r.iter().map(|x| x.end - x.start).sum()
}

/// `n` split into shares proportional to `weights` (largest remainder; ties to the lower
/// index), summing to `n`. Weights that are not positive and finite count as the mean of the
/// others (all of them bad: even shares).
pub fn shares(n: u64, weights: &[f64]) -> Vec<u64> {
    let good: Vec<f64> = weights
        .iter()
        .copied()
        .filter(|w| w.is_finite() && *w > 0.0)
        .collect();
    let mean = if good.is_empty() {
        1.0
    } else {
        good.iter().sum::<f64>() / good.len() as f64
    };
    let w: Vec<f64> = weights
        .iter()
        .map(|x| if x.is_finite() && *x > 0.0 { *x } else { mean })
        .collect();
    let sum: f64 = w.iter().sum();
    if w.is_empty() {
        return Vec::new();
    }
    let exact: Vec<f64> = w.iter().map(|x| n as f64 * x / sum).collect();
    let mut out: Vec<u64> = exact.iter().map(|x| x.floor() as u64).collect();
    let mut left = n - out.iter().sum::<u64>().min(n);
    let mut order: Vec<usize> = (0..w.len()).collect();
    order.sort_by(|a, b| {
        let (fa, fb) = (exact[*a] - exact[*a].floor(), exact[*b] - exact[*b].floor());
        fb.partial_cmp(&fa).unwrap().then(a.cmp(b))
    });
    for i in order.into_iter().cycle() {
        if left == 0 {
            break;
        }
        out[i] += 1;
        left -= 1;
    }
    out
}

/// Cut `work` into consecutive pieces of `sizes` positions (their sum is `work`'s total).
pub fn cut(work: &[Range<u64>], sizes: &[u64]) -> Vec<Ranges> {
    let mut rest: Ranges = work.to_vec();
    sizes.iter().map(|k| take(&mut rest, *k)).collect()
}

/// Take up to `k` positions off the front of `todo`.
pub fn take(todo: &mut Ranges, k: u64) -> Ranges {
    let mut out = Vec::new();
    let mut need = k;
    while need > 0 && !todo.is_empty() {
        let r = &mut todo[0];
        let n = (r.end - r.start).min(need);
        out.push(r.start..r.start + n);
        r.start += n;
        need -= n;
        if r.start == r.end {
            todo.remove(0);
        }
    }
    out
}

/// `r` with each range that starts where the one before it ends joined to it (order kept).
pub fn coalesce(r: &[Range<u64>]) -> Ranges {
    let mut out: Ranges = Vec::new();
    for x in r.iter().filter(|x| x.end > x.start) {
        match out.last_mut() {
            Some(l) if l.end == x.start => l.end = x.end,
            _ => out.push(x.clone()),
        }
    }
    out
}

/// The positions of `r`, in order.
pub fn positions(r: &[Range<u64>]) -> impl Iterator<Item = u64> + '_ {
    r.iter().flat_map(|x| x.clone())
}

/// A round's work: the handed-over positions first, then fresh ones from `cursor` up to
/// `round_fresh` more (never past `end`); returns the work and the new cursor.
pub fn round_work(debt: &[Range<u64>], cursor: u64, round_fresh: u64, end: u64) -> (Ranges, u64) {
    let mut work: Ranges = debt.iter().filter(|r| r.end > r.start).cloned().collect();
    let next = (cursor + round_fresh).min(end).max(cursor);
    if next > cursor {
        work.push(cursor..next);
    }
    (work, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_the_weights_and_sum_to_the_whole() {
        assert_eq!(shares(10, &[1.0, 1.0, 1.0]), vec![4, 3, 3]);
        assert_eq!(shares(90, &[3.0, 3.0, 1.0]), vec![39, 38, 13]);
        // unknown speeds count as the others' mean
        assert_eq!(shares(9, &[2.0, f64::NAN, 0.0]), vec![3, 3, 3]);
        assert_eq!(shares(5, &[0.0, 0.0]), vec![3, 2]);
        for n in [0u64, 1, 7, 1000] {
            assert_eq!(shares(n, &[0.3, 1.7, 2.2, 0.01]).iter().sum::<u64>(), n);
        }
    }

    #[test]
    fn pieces_cover_the_work_once_in_order() {
        let work = vec![5..8, 20..30, 40..41];
        let pieces = cut(&work, &[4, 0, 9, 1]);
        assert_eq!(pieces[0], vec![5..8, 20..21]);
        assert!(pieces[1].is_empty());
        assert_eq!(pieces[2], vec![21..30]);
        assert_eq!(pieces[3], vec![40..41]);
        let all: Vec<u64> = pieces.iter().flat_map(|p| positions(p)).collect();
        assert_eq!(all, positions(&work).collect::<Vec<_>>());
        let (w, c) = round_work(&[3..5], 100, 50, 120);
        assert_eq!((w, c), (vec![3..5, 100..120], 120));
        assert_eq!(round_work(&[], 120, 50, 120), (vec![], 120));
        assert_eq!(
            coalesce(&[1..3, 3..5, 5..5, 7..9, 9..10]),
            vec![1..5, 7..10]
        );
    }
}
