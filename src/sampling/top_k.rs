//! Top-k selection without sorting the vocabulary.

use super::logit::{BLOCK, SpanVisitor, visit_spans, with_widened};
use super::{Cand, Logit};

/// Writes the `k` highest logits of `logits` (`[vocab]`, any [`Logit`] dtype; candidates hold
/// the values widened to `f32`) into `out` as candidates sorted by token id; ties rank the lower
/// id first. `-inf` entries are never selected.
///
/// Two passes over the row, never sorting the vocabulary (see the private `scan_top_k`); expected cost
/// O(vocab + k log k). Allocates a buffer of `vocab / 256` floats; [`super::RowProcessor`]
/// reuses its own.
pub fn select_top_k<L: Logit>(logits: &[L], k: usize, out: &mut Vec<Cand>) {
    let mut blocks = Vec::new();
    scan_top_k(logits, k.min(logits.len()), out, &mut blocks);
}

/// The first pass of [`scan_top_k`] over whole blocks: the maximum of every block of
/// [`BLOCK`] values, the row maximum and 16 lanes of sum.
struct BlockMaxima<'b> {
    acc: [f32; 16],
    mx: f32,
    blocks: &'b mut Vec<f32>,
}

impl SpanVisitor for BlockMaxima<'_> {
    #[inline(always)]
    fn span<U: Logit>(&mut self, _start: usize, span: &[U]) {
        const L: usize = 16;
        for block in span.chunks_exact(BLOCK) {
            let mut m = [f32::NEG_INFINITY; L];
            for c in block.chunks_exact(L) {
                for j in 0..L {
                    let v = c[j].widen();
                    self.acc[j] += v;
                    m[j] = if v > m[j] { v } else { m[j] };
                }
            }
            let mut bm = f32::NEG_INFINITY;
            for &x in &m {
                bm = if x > bm { x } else { bm };
            }
            self.mx = if bm > self.mx { bm } else { self.mx };
            self.blocks.push(bm);
        }
    }
}

/// Largest float below `x` (`x` itself for NaN and `-inf`), so that `v > next_down(x)` is
/// `v >= x` for every non-NaN `v`.
fn next_down(x: f32) -> f32 {
    if x.is_nan() || x == f32::NEG_INFINITY {
        return x;
    }
    if x == 0.0 {
        return -f32::from_bits(1);
    }
    let b = x.to_bits();
    f32::from_bits(if x > 0.0 { b - 1 } else { b + 1 })
}

/// [`select_top_k`] fused with the processor's row scan; returns the row maximum and the f32
/// sum of the row (the caller's NaN / `+inf` screen). `blocks` is scratch.
///
/// 1. One vectorised pass computes the maximum, the sum and the maximum of every block of 256
///    entries.
/// 2. The k-th largest block maximum is a lower bound of the k-th largest entry (the k largest
///    block maxima are k distinct entries), so entries below it can never be selected: it is
///    the first admission threshold (inclusive).
/// 3. A second pass visits only blocks whose maximum passes the threshold; inside them a
///    vectorised test skips 16-entry chunks with no entry above it, and admitted entries are
///    appended without branches (random data would mispredict a per-entry branch). When the
///    buffer of `2k + 256` candidates fills, a selection (`select_nth_unstable`) keeps the best
///    `k` and raises the threshold (exclusive: later ids lose ties) to the k-th kept logit.
pub(crate) fn scan_top_k<T: Logit>(
    logits: &[T],
    k: usize,
    out: &mut Vec<Cand>,
    blocks: &mut Vec<f32>,
) -> (f32, f32) {
    // The last, partial block (fewer than BLOCK values) is the scalar remainder, read after the
    // full blocks.
    let full_len = logits.len() - logits.len() % BLOCK;
    let rem = &logits[full_len..];
    let (mx, sum) = block_maxima(logits, full_len, blocks);
    out.clear();
    if k == 0 {
        return (mx, sum);
    }
    let thr = block_threshold(blocks, k, out);
    let mut admit = Admit::new(out, k, thr);
    for (bi, &bm) in blocks.iter().enumerate() {
        // Neither is NaN: block maxima and thresholds come from `>` comparisons and logits.
        if bm <= admit.thr {
            continue;
        }
        let base = bi * BLOCK;
        with_widened(&logits[base..base + BLOCK], |block| {
            for (ci, chunk) in block.chunks_exact(LANE_CHUNK).enumerate() {
                if chunk_max(chunk) > admit.thr {
                    admit.push(base + ci * LANE_CHUNK, chunk);
                }
            }
        });
    }
    with_widened(rem, |rem| {
        for (ci, chunk) in rem.chunks(LANE_CHUNK).enumerate() {
            admit.push(full_len + ci * LANE_CHUNK, chunk);
        }
    });
    admit.finish();
    (mx, sum)
}

/// Entries of one chunk of a block tested at once ([`scan_top_k`], step 3).
const LANE_CHUNK: usize = 16;

/// [`scan_top_k`], step 1: one vectorised pass over the full blocks of `logits[..full_len]`
/// (the maximum of every block into `blocks`), then the scalar remainder. Returns the row
/// maximum and its f32 sum.
fn block_maxima<T: Logit>(logits: &[T], full_len: usize, blocks: &mut Vec<f32>) -> (f32, f32) {
    blocks.clear();
    let mut pass = BlockMaxima {
        acc: [0.0; LANE_CHUNK],
        mx: f32::NEG_INFINITY,
        blocks,
    };
    visit_spans(&logits[..full_len], &mut pass);
    let (acc, mut mx) = (pass.acc, pass.mx);
    let mut sum = 0.0f32;
    for x in acc {
        sum += x;
    }
    with_widened(&logits[full_len..], |rem| {
        for &v in rem {
            sum += v;
            mx = if v > mx { v } else { mx };
        }
    });
    (mx, sum)
}

/// [`scan_top_k`], step 2: the first admission threshold, just below the k-th largest block
/// maximum (`-inf` with fewer than `k` blocks). `out` is scratch, left empty.
fn block_threshold(blocks: &[f32], k: usize, out: &mut Vec<Cand>) -> f32 {
    if blocks.len() < k {
        return f32::NEG_INFINITY;
    }
    out.extend(
        blocks
            .iter()
            .enumerate()
            .map(|(i, &b)| Cand::new(i as u32, b)),
    );
    out.select_nth_unstable_by(k - 1, Cand::rank);
    let thr = next_down(out[k - 1].logit);
    out.clear();
    thr
}

/// The maximum of a 16-entry chunk in 4 lanes (a boolean "any" reduction compiles to
/// branches).
#[inline(always)]
fn chunk_max(chunk: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 4];
    for q in chunk.chunks_exact(4) {
        for t in 0..4 {
            m[t] = if q[t] > m[t] { q[t] } else { m[t] };
        }
    }
    let a = if m[0] > m[1] { m[0] } else { m[1] };
    let b = if m[2] > m[3] { m[2] } else { m[3] };
    if a > b { a } else { b }
}

/// [`scan_top_k`], step 3: the candidate buffer of `2k + 256` entries, appended to without
/// branches, and the admission threshold it raises when it fills.
struct Admit<'o> {
    out: &'o mut Vec<Cand>,
    /// Candidates held.
    n: usize,
    k: usize,
    cap: usize,
    /// Admission threshold: entries above it are candidates.
    thr: f32,
}

impl<'o> Admit<'o> {
    fn new(out: &'o mut Vec<Cand>, k: usize, thr: f32) -> Self {
        let cap = 2 * k + 256;
        // Branch-free appends write up to LANE_CHUNK entries past the count: keep room for them.
        out.resize(cap + LANE_CHUNK, Cand::new(0, 0.0));
        Admit {
            out,
            n: 0,
            k,
            cap,
            thr,
        }
    }

    /// Appends the entries of `chunk` (ids from `base`) above the threshold; when the buffer
    /// is full, keeps the best `k` and raises the threshold (exclusive: later ids lose ties) to
    /// the k-th kept logit.
    #[inline(always)]
    fn push(&mut self, base: usize, chunk: &[f32]) {
        for (j, &v) in chunk.iter().enumerate() {
            self.out[self.n] = Cand::new((base + j) as u32, v);
            self.n += (v > self.thr) as usize;
        }
        if self.n >= self.cap {
            self.out[..self.n].select_nth_unstable_by(self.k - 1, Cand::rank);
            self.n = self.k;
            // out[k - 1] ranks last among the kept: its logit is the lowest kept.
            self.thr = self.out[self.k - 1].logit;
        }
    }

    /// The best `k` candidates, by id.
    fn finish(self) {
        let (out, k) = (self.out, self.k);
        out.truncate(self.n);
        if out.len() > k {
            out.select_nth_unstable_by(k - 1, Cand::rank);
            out.truncate(k);
        }
        out.sort_unstable_by_key(|c| c.id);
    }
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
            for k in [1, 2, 5, 11, 50, 300] {
                let mut out = Vec::new();
                select_top_k(&logits, k, &mut out);
                let got: Vec<u32> = out.iter().map(|c| c.id).collect();
                assert_eq!(got, naive(&logits, k), "n={n} k={k}");
            }
        }
    }
}
