//! Top-k selection without sorting the vocabulary.

use super::Cand;

/// Writes the `k` highest logits of `logits` (`[vocab]`) into `out` as candidates sorted by
/// token id; ties rank the lower id first. `-inf` entries are never selected.
///
/// One pass over the row with a buffer of at most `2k + 256` candidates: when the buffer fills,
/// a selection (`select_nth_unstable`, expected O(len)) keeps the best `k` and raises the
/// admission threshold. Expected cost O(vocab + k log k); the vocabulary is never sorted.
pub fn select_top_k(logits: &[f32], k: usize, out: &mut Vec<Cand>) {
    out.clear();
    if k == 0 {
        return;
    }
    let cap = 2 * k + 256;
    let mut thr = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        // Later ids lose ties, so an entry equal to the threshold never enters.
        if v > thr {
            out.push(Cand::new(i as u32, v));
            if out.len() >= cap {
                out.select_nth_unstable_by(k - 1, Cand::rank);
                out.truncate(k);
                // out[k - 1] ranks last among the kept: its logit is the lowest kept.
                thr = out[k - 1].logit;
            }
        }
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, Cand::rank);
        out.truncate(k);
    }
    out.sort_unstable_by_key(|c| c.id);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(logits: &[f32], k: usize) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize] > f32::NEG_INFINITY)
            .collect();
        idx.sort_by(|&a, &b| {
            logits[b as usize]
                .partial_cmp(&logits[a as usize])
                .unwrap()
                .then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort();
        idx
    }

    #[test]
    fn matches_naive_with_ties() {
        let mut s = 12345u64;
        for trial in 0..200 {
            let n = 1 + trial * 7 % 3000;
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let v = (s >> 40) % 17;
                    if v == 0 {
                        f32::NEG_INFINITY
                    } else {
                        v as f32 * 0.5
                    }
                })
                .collect();
            for k in [1, 2, 5, 50, 300] {
                let mut out = Vec::new();
                select_top_k(&logits, k, &mut out);
                let got: Vec<u32> = out.iter().map(|c| c.id).collect();
                assert_eq!(got, naive(&logits, k), "n={n} k={k}");
            }
        }
    }
}
