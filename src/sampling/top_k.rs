//! Top-k selection without sorting the vocabulary.

use super::Cand;

/// Writes the `k` highest logits of `logits` (`[vocab]`) into `out` as candidates sorted by
/// token id; ties rank the lower id first. `-inf` entries are never selected.
///
/// One pass over the row (chunks of 16 entries with no entry above the current admission
/// threshold are skipped after a vectorised test) with a buffer of at most `2k + 256`
/// candidates: when the buffer fills,
/// a selection (`select_nth_unstable`, expected O(len)) keeps the best `k` and raises the
/// admission threshold. Expected cost O(vocab + k log k); the vocabulary is never sorted.
pub fn select_top_k(logits: &[f32], k: usize, out: &mut Vec<Cand>) {
    out.clear();
    if k == 0 {
        return;
    }
    let cap = 2 * k + 256;
    let mut thr = f32::NEG_INFINITY;
    let mut admit = |base: usize, part: &[f32], thr: &mut f32| {
        for (j, &v) in part.iter().enumerate() {
            // Later ids lose ties, so an entry equal to the threshold never enters.
            if v > *thr {
                out.push(Cand::new((base + j) as u32, v));
                if out.len() >= cap {
                    out.select_nth_unstable_by(k - 1, Cand::rank);
                    out.truncate(k);
                    // out[k - 1] ranks last among the kept: its logit is the lowest kept.
                    *thr = out[k - 1].logit;
                }
            }
        }
    };
    // A branch-free (vectorisable) test per chunk first: once the threshold has risen, most
    // chunks hold no entry above it and are skipped at the speed of reading them.
    const L: usize = 16;
    let chunks = logits.chunks_exact(L);
    let rem = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        let mut hit = false;
        for &v in chunk {
            hit |= v > thr;
        }
        if hit {
            admit(c * L, chunk, &mut thr);
        }
    }
    admit(logits.len() - rem.len(), rem, &mut thr);
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
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
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
