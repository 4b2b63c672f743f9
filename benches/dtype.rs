//! Cost of verifying logits in `f16` / `bf16` against `f32`, at the same vocabulary and k.
//!
//! One criterion group per vocabulary size, `dtype_v{vocab}`. For each parameter set
//! `k{k}_b{batch}` and mode (`greedy`: temperature 0; `stochastic`: temperature 0.8, top-p 0.9,
//! top-k 50), `Verifier::verify_batch` on the same logits held as:
//!
//! - `{mode}_f32`: `f32` rows (the baseline);
//! - `{mode}_f16`, `{mode}_bf16`: the rows rounded to `half::f16` / `half::bf16`, read through
//!   the generic path (each value widened to `f32` as it is read);
//! - `{mode}_bf16_convert`: what a caller without the generic path pays: convert the `bf16`
//!   rows to an `f32` buffer (reused; `half`'s slice conversion), then verify that.
//!
//! Logits and drafts are those of `benches/verify.rs` (N(0, 2^2) noise with one leading token
//! per row; point-mass drafts, the first `ceil(k / 2)` of each sequence the argmax of its row,
//! the rest rejected), computed for each dtype from its own rounded values so that every dtype
//! accepts the same drafts.
//!
//! Run: `cargo bench --bench dtype` (filter e.g. `-- 'dtype_v151936/.*/k4_b16'`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use speculative::sampling::Logit;
use speculative::{SamplingConfig, SequenceParams, Verifier, VerifyBatch};

const VOCABS: [usize; 2] = [32_000, 151_936];
/// `(k, batch)` parameter sets.
const CELLS: [(usize, usize); 2] = [(4, 1), (4, 16)];

/// xorshift64* uniform in (0, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((x >> 40) as f32 + 0.5) / 16_777_216.0
    }
}

/// `[rows, vocab]` logits: N(0, 4) noise plus one leading token per row.
fn logits(rows: usize, vocab: usize) -> Vec<f32> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ vocab as u64);
    let mut out = Vec::with_capacity(rows * vocab);
    for _ in 0..rows {
        let start = out.len();
        for _ in 0..vocab / 2 {
            let (u1, u2) = (rng.next(), rng.next());
            let r = 2.0 * (-2.0 * u1.ln()).sqrt();
            let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
            out.push(r * c);
            out.push(r * s);
        }
        if vocab % 2 == 1 {
            out.push(0.0);
        }
        let row = &mut out[start..];
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lead = (rng.next() * vocab as f32) as usize % vocab;
        row[lead] = mx + 6.0 * rng.next();
    }
    out
}

/// Argmax of a row (ties to the lowest id), on the widened values.
fn argmax<L: Logit>(row: &[L]) -> u32 {
    let mut best = 0;
    for (i, x) in row.iter().enumerate() {
        if x.widen() > row[best].widen() {
            best = i;
        }
    }
    best as u32
}

/// Drafts for `batch` sequences of length `k`: the argmax for the first `ceil(k / 2)`
/// positions, then the token after the argmax.
fn drafts<L: Logit>(buf: &[L], vocab: usize, k: usize, batch: usize) -> Vec<u32> {
    let mut d = Vec::with_capacity(batch * k);
    for b in 0..batch {
        for i in 0..k {
            let r = b * (k + 1) + i;
            let a = argmax(&buf[r * vocab..(r + 1) * vocab]);
            d.push(if i < k.div_ceil(2) {
                a
            } else {
                (a + 1) % vocab as u32
            });
        }
    }
    d
}

fn bench_one<L: Logit>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    id: &str,
    cfg: &SamplingConfig,
    data: &[L],
    vocab: usize,
    (k, batch): (usize, usize),
) {
    let offsets: Vec<usize> = (0..=batch).map(|b| b * k).collect();
    let seqs: Vec<SequenceParams<'_>> = (0..batch)
        .map(|s| SequenceParams::new(cfg, s as u64))
        .collect();
    let d = drafts(data, vocab, k, batch);
    let vb = VerifyBatch::new(vocab, data, &d, &offsets, &seqs);
    let mut verifier = Verifier::new();
    let out = verifier.verify_batch(&vb).expect("valid batch");
    let acc: usize = out
        .iter()
        .map(|r| r.as_ref().expect("valid").accepted)
        .sum();
    eprintln!("{name}/{id}: accepted {acc} of {}", batch * k);
    c.bench_function(BenchmarkId::new(name, id), |b| {
        b.iter(|| verifier.verify_batch(black_box(&vb)))
    });
}

fn bench(c: &mut Criterion) {
    let greedy = SamplingConfig::greedy();
    let stochastic = SamplingConfig::builder()
        .temperature(0.8)
        .top_p(0.9)
        .top_k(50)
        .build()
        .expect("valid configuration");
    let modes = [("greedy", &greedy), ("stochastic", &stochastic)];
    for vocab in VOCABS {
        let mut group = c.benchmark_group(format!("dtype_v{vocab}"));
        group
            .sample_size(20)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(2000));
        let max_rows = CELLS.iter().map(|&(k, b)| b * (k + 1)).max().unwrap_or(0);
        let f32s = logits(max_rows, vocab);
        let f16s: Vec<f16> = f32s.iter().map(|&x| f16::from_f32(x)).collect();
        let bf16s: Vec<bf16> = f32s.iter().map(|&x| bf16::from_f32(x)).collect();
        for (k, batch) in CELLS {
            let n = batch * (k + 1) * vocab;
            let id = format!("k{k}_b{batch}");
            for (mode, cfg) in modes {
                bench_one(
                    &mut group,
                    &format!("{mode}_f32"),
                    &id,
                    cfg,
                    &f32s[..n],
                    vocab,
                    (k, batch),
                );
                bench_one(
                    &mut group,
                    &format!("{mode}_f16"),
                    &id,
                    cfg,
                    &f16s[..n],
                    vocab,
                    (k, batch),
                );
                bench_one(
                    &mut group,
                    &format!("{mode}_bf16"),
                    &id,
                    cfg,
                    &bf16s[..n],
                    vocab,
                    (k, batch),
                );
                // Convert first, then verify f32 (the pass the generic path saves).
                let src = &bf16s[..n];
                let offsets: Vec<usize> = (0..=batch).map(|b| b * k).collect();
                let seqs: Vec<SequenceParams<'_>> = (0..batch)
                    .map(|s| SequenceParams::new(cfg, s as u64))
                    .collect();
                let d = drafts(src, vocab, k, batch);
                let mut buf = vec![0.0f32; n];
                let mut verifier = Verifier::new();
                group.bench_function(BenchmarkId::new(format!("{mode}_bf16_convert"), &id), |b| {
                    b.iter(|| {
                        black_box(src).convert_to_f32_slice(&mut buf);
                        verifier.verify_batch(&VerifyBatch::new(vocab, &buf, &d, &offsets, &seqs))
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
