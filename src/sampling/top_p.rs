//! Top-p (nucleus, Holtzman et al. 2020) and min-p (Nguyen et al. 2024) filters, sorting-free.

use super::Cand;

/// Keeps, in place and in id order, the smallest set of highest-ranked candidates whose
/// probability mass is `>= top_p` of the total (rank: logit descending, then id ascending).
///
/// `cands` holds unnormalised probabilities in [`Cand::p`]; `work` is scratch. The boundary is
/// found by quickselect on mass (`select_nth_unstable` on halving ranges, expected O(n)); the
/// vocabulary is never sorted. Masses are summed in f64.
pub fn apply_top_p(cands: &mut Vec<Cand>, top_p: f32, work: &mut Vec<Cand>) {
    if top_p >= 1.0 || cands.len() <= 1 {
        return;
    }
    let total: f64 = cands.iter().map(|c| c.p as f64).sum();
    let mut need = top_p as f64 * total;
    work.clear();
    work.extend_from_slice(cands);
    let (mut lo, mut hi) = (0usize, work.len());
    let boundary = loop {
        let n = hi - lo;
        if n <= 32 {
            let part = &mut work[lo..hi];
            part.sort_unstable_by(Cand::rank);
            let mut acc = 0.0f64;
            let mut b = part[part.len() - 1];
            for c in part.iter() {
                acc += c.p as f64;
                if acc >= need {
                    b = *c;
                    break;
                }
            }
            break b;
        }
        let mid = lo + n / 2;
        work[lo..hi].select_nth_unstable_by(n / 2, Cand::rank);
        let upper: f64 = work[lo..mid].iter().map(|c| c.p as f64).sum();
        let pivot = work[mid];
        if upper >= need {
            hi = mid;
        } else if upper + pivot.p as f64 >= need {
            break pivot;
        } else {
            need -= upper + pivot.p as f64;
            lo = mid + 1;
            if lo >= hi {
                break pivot;
            }
        }
    };
    cands.retain(|c| c.rank(&boundary) != std::cmp::Ordering::Greater);
}

/// Keeps candidates whose probability is `>= min_p * max probability`, in place, in id order.
pub fn apply_min_p(cands: &mut Vec<Cand>, min_p: f32) {
    if min_p <= 0.0 || cands.is_empty() {
        return;
    }
    let max = cands.iter().fold(0.0f32, |m, c| m.max(c.p));
    let thr = min_p * max;
    cands.retain(|c| c.p >= thr);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(ps: &[f32]) -> Vec<Cand> {
        ps.iter()
            .enumerate()
            .map(|(i, &p)| Cand {
                id: i as u32,
                logit: p.ln(),
                p,
            })
            .collect()
    }

    fn naive_top_p(ps: &[f32], top_p: f32) -> Vec<u32> {
        let mut idx: Vec<usize> = (0..ps.len()).collect();
        idx.sort_by(|&a, &b| ps[b].partial_cmp(&ps[a]).unwrap().then(a.cmp(&b)));
        let total: f64 = ps.iter().map(|&p| p as f64).sum();
        let mut acc = 0.0;
        let mut kept = Vec::new();
        for i in idx {
            kept.push(i as u32);
            acc += ps[i] as f64;
            if acc >= top_p as f64 * total {
                break;
            }
        }
        kept.sort();
        kept
    }

    #[test]
    fn top_p_matches_sorted_definition() {
        let mut s = 99u64;
        for trial in 0..300 {
            let n = 1 + (trial * 13) % 500;
            let ps: Vec<f32> = (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 40) % 50 + 1) as f32 / 64.0
                })
                .collect();
            for top_p in [0.05f32, 0.3, 0.5, 0.8, 0.95, 0.999] {
                let mut c = cands(&ps);
                let mut w = Vec::new();
                apply_top_p(&mut c, top_p, &mut w);
                let got: Vec<u32> = c.iter().map(|c| c.id).collect();
                assert_eq!(got, naive_top_p(&ps, top_p), "n={n} p={top_p}");
            }
        }
    }

    #[test]
    fn c01_top_p_example() {
        let mut c = cands(&[0.6, 0.3, 0.1]);
        apply_top_p(&mut c, 0.8, &mut Vec::new());
        assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn min_p_keeps_relative_to_max() {
        let mut c = cands(&[0.5, 0.3, 0.1, 0.05]);
        apply_min_p(&mut c, 0.2);
        assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), vec![0, 1, 2]);
    }
}
