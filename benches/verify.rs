//! Cost of logits processing + verification, as a ratio to reading the same logits once.
//!
//! One criterion group per vocabulary size, `verify_v{vocab}`. In each group and for each
//! parameter set `k{k}_b{batch}` (draft length k, batch size):
//!
//! - `read_once`: a vectorisable sum over the whole `[batch * (k + 1), vocab]` target buffer,
//!   the floor that any verifier must pay to look at the logits once;
//! - `greedy`: `Verifier::verify_batch`, temperature 0;
//! - `stochastic`: `Verifier::verify_batch`, temperature 0.8, top-p 0.9, top-k 50.
//!
//! Drafts are point masses: in each sequence the first `ceil(k / 2)` drafts are the target's
//! argmax (accepted in greedy mode), the rest are other tokens (rejected), so half of the
//! positions come from the argmax. The verifier reads only the rows up to the first rejection;
//! the number of rows read is printed once per parameter set (`rows read`), so the cost per row
//! read can be derived as well.
//!
//! Logits look like a language model's: N(0, 2^2) noise with one leading token per row whose
//! margin over the runner-up is uniform in [0, 6) logits.
//!
//! Filter by name, e.g. `cargo bench --bench verify -- 'verify_v151936/.*/k4_b16'`. Inputs are
//! generated lazily, only for the benchmarks that run: one `[576, vocab]` buffer per vocabulary
//! (the largest batch * (k + 1)), sliced for smaller parameter sets.
//!
//! **Trees** (groups `tree_v{vocab}`, vocabularies 49,152 and 151,936; filter `-- tree`): one
//! sequence, a token tree of `n` = 16 or 64 nodes of a common shape, 4 siblings at depth 1 and a
//! chain under each (3 or 15 nodes deep), against `read_once` of its `[n + 1, vocab]` rows:
//!
//! - `greedy`: temperature 0, point-mass (deterministic) siblings;
//! - `stochastic`: temperature 0.8, top-p 0.9, top-k 50, point-mass siblings (the position's
//!   token is drawn once per row and the child equal to it is followed);
//! - `stochastic_q`: the same configuration with dense q (siblings sampled with replacement, one
//!   `[vocab]` q row per node, the group's; q is the softmax of the checking row's logits): the
//!   verifier validates every q row and tests the siblings with `min(1, p / q)` and residuals.
//!
//! The third sibling is the argmax of row 0 and the first half of the chain under it follows the
//! argmax of each row; the other nodes are tokens after the argmax of their parent's row. The
//! number of rows the walk processed (accepted + 1) is printed once per benchmark.
//!
//! **Row candidates** (group `row_top_v32000`; filter `-- row_top`): the cost of the feedback
//! path ([`VerifyRequest::row_top_k`], what Token Recycling asks for). One sequence, vocabulary
//! 32,000, a chain of k = 4 (drafts as above) and the 16-node tree above, greedy and stochastic,
//! each verified with `row_top_k` 0 (a proposer that asks for nothing) and 8 (every target row
//! processed once more for its 8 best ids), beside `read_once` of the step's rows.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use speculative::DraftBlock;
use speculative::{
    DraftProbs, SamplingConfig, SequenceParams, Verifier, VerifyBatch, VerifyRequest,
};

const VOCABS: [usize; 5] = [32_000, 49_152, 128_256, 151_936, 262_144];
const KS: [usize; 3] = [1, 4, 8];
const BATCHES: [usize; 3] = [1, 16, 64];
const MAX_ROWS: usize = 64 * 9;

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

/// `[MAX_ROWS, vocab]` logits: N(0, 4) noise plus one leading token per row.
fn logits(vocab: usize) -> Vec<f32> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ vocab as u64);
    let mut out = Vec::with_capacity(MAX_ROWS * vocab);
    for _ in 0..MAX_ROWS {
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

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Drafts for `batch` sequences of length `k`: the argmax for the first `ceil(k / 2)`
/// positions, then the token after the argmax.
fn drafts(buf: &[f32], vocab: usize, k: usize, batch: usize) -> Vec<u32> {
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

/// Sum of the buffer with 16 independent accumulators (vectorises; one read of every float).
fn read_once(buf: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let chunks = buf.chunks_exact(16);
    let rem = chunks.remainder();
    for c in chunks {
        for j in 0..16 {
            acc[j] += c[j];
        }
    }
    acc.iter().sum::<f32>() + rem.iter().sum::<f32>()
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
        let mut group = c.benchmark_group(format!("verify_v{vocab}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1500));
        // Generated on first use only, so that filtered-out groups cost nothing.
        let mut buf: Option<Vec<f32>> = None;
        let mut draft_cache: HashMap<(usize, usize), Vec<u32>> = HashMap::new();
        for k in KS {
            for batch in BATCHES {
                let rows = batch * (k + 1);
                let id = format!("k{k}_b{batch}");
                let offsets: Vec<usize> = (0..=batch).map(|b| b * k).collect();
                group.bench_function(BenchmarkId::new("read_once", &id), |b| {
                    let buf = buf.get_or_insert_with(|| logits(vocab));
                    let data = &buf[..rows * vocab];
                    b.iter(|| read_once(black_box(data)))
                });
                for (mode, cfg) in modes {
                    let seqs: Vec<SequenceParams<'_>> = (0..batch)
                        .map(|s| SequenceParams::new(cfg, s as u64))
                        .collect();
                    let mut verifier = Verifier::new();
                    let mut reported = false;
                    group.bench_function(BenchmarkId::new(mode, &id), |b| {
                        let buf = buf.get_or_insert_with(|| logits(vocab));
                        let data = &buf[..rows * vocab];
                        let d = draft_cache
                            .entry((k, batch))
                            .or_insert_with(|| drafts(data, vocab, k, batch));
                        let vb = VerifyBatch::new(vocab, data, d, &offsets, &seqs);
                        if !reported {
                            reported = true;
                            let out = verifier.verify_batch(&vb).expect("valid batch");
                            let read: usize = out
                                .iter()
                                .map(|r| r.as_ref().expect("valid").tokens.len())
                                .sum();
                            let acc: usize = out
                                .iter()
                                .map(|r| r.as_ref().expect("valid").accepted)
                                .sum();
                            eprintln!(
                                "verify_v{vocab}/{mode}/{id}: rows read {read} of {rows}, \
                                 accepted {acc} of {}",
                                batch * k
                            );
                        }
                        b.iter(|| verifier.verify_batch(black_box(&vb)))
                    });
                }
            }
        }
        group.finish();
    }
}

/// Vocabularies and node counts of the tree benchmarks.
const TREE_VOCABS: [usize; 2] = [49_152, 151_936];
const TREE_NODES: [usize; 2] = [16, 64];

/// Parent rows of the tree shape: 4 siblings under the root, then a chain of `(n - 4) / 4`
/// nodes under each sibling, chain after chain.
fn tree_parents(n: usize) -> Vec<u32> {
    let depth = (n - 4) / 4;
    let mut p: Vec<u32> = vec![0; 4];
    for s in 0..4u32 {
        let mut row = s + 1;
        for _ in 0..depth {
            p.push(row);
            row = p.len() as u32;
        }
    }
    p
}

/// Node tokens: the argmax of the checking row for sibling 2 and the first half of the chain
/// under it, the token after the argmax elsewhere (distinct siblings).
fn tree_tokens(buf: &[f32], vocab: usize, parents: &[u32]) -> Vec<u32> {
    let n = parents.len();
    let depth = (n - 4) / 4;
    let on_path = |i: usize| i == 2 || (i >= 4 + 2 * depth && i < 4 + 2 * depth + depth / 2);
    (0..n)
        .map(|i| {
            let r = parents[i] as usize;
            let a = argmax(&buf[r * vocab..(r + 1) * vocab]);
            if on_path(i) {
                a
            } else if i < 4 {
                // Distinct siblings, none of them the argmax.
                (a + 1 + i as u32) % vocab as u32
            } else {
                (a + 1) % vocab as u32
            }
        })
        .collect()
}

/// Dense q, `[n, vocab]`: node `i` carries the softmax of its checking row (the group's q).
fn tree_q(buf: &[f32], vocab: usize, parents: &[u32]) -> Vec<f32> {
    let mut q = Vec::with_capacity(parents.len() * vocab);
    for &r in parents {
        let row = &buf[r as usize * vocab..(r as usize + 1) * vocab];
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let start = q.len();
        q.extend(row.iter().map(|&x| (x - mx).exp()));
        let s: f64 = q[start..].iter().map(|&x| x as f64).sum();
        for x in &mut q[start..] {
            *x = (*x as f64 / s) as f32;
        }
    }
    q
}

fn bench_tree(c: &mut Criterion) {
    let greedy = SamplingConfig::greedy();
    let stochastic = SamplingConfig::builder()
        .temperature(0.8)
        .top_p(0.9)
        .top_k(50)
        .build()
        .expect("valid configuration");
    for vocab in TREE_VOCABS {
        let mut group = c.benchmark_group(format!("tree_v{vocab}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1500));
        let mut buf: Option<Vec<f32>> = None;
        for n in TREE_NODES {
            let rows = n + 1;
            let id = format!("n{n}");
            let parents = tree_parents(n);
            group.bench_function(BenchmarkId::new("read_once", &id), |b| {
                let buf = buf.get_or_insert_with(|| logits(vocab));
                let data = &buf[..rows * vocab];
                b.iter(|| read_once(black_box(data)))
            });
            for (mode, cfg, dense) in [
                ("greedy", &greedy, false),
                ("stochastic", &stochastic, false),
                ("stochastic_q", &stochastic, true),
            ] {
                let mut verifier = Verifier::new();
                let mut reported = false;
                let mut inputs: Option<(Vec<u32>, Vec<f32>)> = None;
                group.bench_function(BenchmarkId::new(mode, &id), |b| {
                    let buf = buf.get_or_insert_with(|| logits(vocab));
                    let data = &buf[..rows * vocab];
                    let (tokens, q) = inputs.get_or_insert_with(|| {
                        let q = if dense {
                            tree_q(data, vocab, &parents)
                        } else {
                            Vec::new()
                        };
                        (tree_tokens(data, vocab, &parents), q)
                    });
                    let dp = if dense {
                        DraftProbs::Probs { probs: q, vocab }
                    } else {
                        DraftProbs::PointMass
                    };
                    let req = VerifyRequest::new(cfg, data, vocab, tokens)
                        .draft(DraftBlock::tree(tokens, &parents))
                        .draft_probs(dp)
                        .seed(7);
                    if !reported {
                        reported = true;
                        let out = verifier.verify(&req).expect("valid tree");
                        eprintln!(
                            "tree_v{vocab}/{mode}/{id}: rows read {} of {rows}, path {:?}",
                            out.accepted + 1,
                            out.path
                        );
                    }
                    b.iter(|| verifier.verify(black_box(&req)))
                });
            }
        }
        group.finish();
    }
}

/// `row_top_k` 0 vs 8 on a k = 4 chain and a 16-node tree, vocabulary 32,000 (module docs).
fn bench_row_top(c: &mut Criterion) {
    let vocab = 32_000;
    let greedy = SamplingConfig::greedy();
    let stochastic = SamplingConfig::builder()
        .temperature(0.8)
        .top_p(0.9)
        .top_k(50)
        .build()
        .expect("valid configuration");
    let mut group = c.benchmark_group(format!("row_top_v{vocab}"));
    let mut buf: Option<Vec<f32>> = None;
    let k = 4;
    let tree = tree_parents(16);
    for (shape, parents) in [("chain_k4", None), ("tree_n16", Some(&tree[..]))] {
        let rows = parents.map_or(k + 1, |p| p.len() + 1);
        group.bench_function(BenchmarkId::new("read_once", shape), |b| {
            let buf = buf.get_or_insert_with(|| logits(vocab));
            let data = &buf[..rows * vocab];
            b.iter(|| read_once(black_box(data)))
        });
        for (mode, cfg) in [("greedy", &greedy), ("stochastic", &stochastic)] {
            for top in [0usize, 8] {
                let mut verifier = Verifier::new();
                let mut tokens: Option<Vec<u32>> = None;
                let id = format!("{shape}/{mode}/row_top_{top}");
                group.bench_function(BenchmarkId::from_parameter(&id), |b| {
                    let buf = buf.get_or_insert_with(|| logits(vocab));
                    let data = &buf[..rows * vocab];
                    let tokens = tokens.get_or_insert_with(|| match parents {
                        Some(p) => tree_tokens(data, vocab, p),
                        None => drafts(data, vocab, k, 1),
                    });
                    let mut req = VerifyRequest::new(cfg, data, vocab, tokens)
                        .seed(7)
                        .row_top_k(top);
                    if let Some(p) = parents {
                        req = req.draft(DraftBlock::tree(tokens, p));
                    }
                    let out = verifier.verify(&req).expect("valid step");
                    assert_eq!(out.row_top.rows(), if top > 0 { rows } else { 0 });
                    b.iter(|| verifier.verify(black_box(&req)))
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, bench, bench_tree, bench_row_top);
criterion_main!(benches);
