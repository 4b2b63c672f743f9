//! Proposal time of the model-free proposers ([`PromptLookup`], [`SuffixProposer`]).
//!
//! Context: a synthetic, repetitive token sequence (vocabulary 1,000; half of it random chunks,
//! half copies of earlier chunks, each chunk 8 to 32 tokens), at 1,000 and 32,000 tokens.
//!
//! - `incremental`: the steady state of a decoding loop. The proposer has seen the context;
//!   one token is appended and one proposal (`k = 8`) is made. Only the proposals are timed.
//! - `rebuild`: the baseline, measured in the same run: a proposal on the same context by a
//!   proposer that has to index it from scratch (what a rescan per step would cost).
//! - `tree`: as `incremental`, but each proposal is a tree draft (`Proposer::propose_tree`,
//!   depth at most `k = 8`) with a node budget of 16 or 64 (`BenchmarkId` `NAME/nodes-N`); the
//!   `incremental` chain of the same run is its baseline.
//!
//! Run: `cargo bench --bench proposers` (add `-- --quick` for a shorter run).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use speculative::propose::{PromptLookup, SuffixConfig, SuffixProposer};
use speculative::{Draft, ProposeRequest, Proposer, SamplingConfig};

/// Context lengths, in tokens.
const LENGTHS: [usize; 2] = [1_000, 32_000];
/// Tokens appended (one per timed proposal) before the proposer is re-primed, untimed.
const STEPS: usize = 1_024;
/// Draft length k (the depth bound of tree drafts).
const K: usize = 8;
/// Node budgets of the tree drafts.
const NODES: [usize; 2] = [16, 64];
/// Vocabulary size of the synthetic text.
const VOCAB: u64 = 1_000;

/// Deterministic xorshift64 generator, so every run benchmarks the same text.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `len` tokens of repetitive synthetic text: chunks of 8 to 32 tokens, each either fresh
/// random tokens or a copy of an earlier stretch of the text.
fn synthetic_text(len: usize, seed: u64) -> Vec<u32> {
    let mut rng = XorShift(seed | 1);
    let mut text: Vec<u32> = Vec::with_capacity(len + 32);
    while text.len() < len {
        let chunk = 8 + rng.below(25) as usize;
        if text.len() > 64 && rng.below(2) == 0 {
            let from = rng.below((text.len() - chunk) as u64) as usize;
            for i in from..from + chunk {
                text.push(text[i]);
            }
        } else {
            text.extend((0..chunk).map(|_| rng.below(VOCAB) as u32));
        }
    }
    text.truncate(len);
    text
}

/// One proposal of at most `K` tokens: a chain when `nodes <= K`, else a tree of at most
/// `nodes` nodes.
fn propose(
    p: &mut dyn Proposer,
    context: &[u32],
    config: &SamplingConfig,
    nodes: usize,
    draft: &mut Draft,
) {
    let req = ProposeRequest::new(context, config, K).max_nodes(nodes);
    if nodes <= K {
        p.propose(&req, draft).expect("propose");
    } else {
        p.propose_tree(&req, draft).expect("propose_tree");
    }
}

/// Builds a fresh proposer.
type Maker = fn() -> Box<dyn Proposer>;

fn prompt_lookup() -> Box<dyn Proposer> {
    Box::new(PromptLookup::new(1, 3).expect("valid n-gram sizes"))
}

/// A suffix proposer whose corpus holds 16 earlier generations of 512 tokens.
fn suffix() -> Box<dyn Proposer> {
    let mut p = SuffixProposer::new(SuffixConfig::default()).expect("valid config");
    for g in 0..16 {
        p.add_to_corpus(&synthetic_text(512, 1_000 + g));
    }
    Box::new(p)
}

/// Times proposals in the steady state of a decoding loop: the proposer has seen
/// `text[..len]`; one token is appended and one proposal (`nodes` as in [`propose`]) is made,
/// `STEPS` times before the proposer is re-primed (untimed).
fn steady_state(
    b: &mut criterion::Bencher<'_>,
    make: Maker,
    text: &[u32],
    len: usize,
    nodes: usize,
    config: &SamplingConfig,
) {
    let mut proposer = make();
    let mut draft = Draft::default();
    b.iter_custom(|iters| {
        let mut total = Duration::ZERO;
        let mut done = 0u64;
        while done < iters {
            // Untimed: bring the proposer back to the base context.
            proposer.begin(&text[..len]).expect("begin");
            propose(&mut *proposer, &text[..len], config, nodes, &mut draft);
            let steps = (iters - done).min(STEPS as u64) as usize;
            let start = Instant::now();
            for i in 1..=steps {
                propose(&mut *proposer, &text[..len + i], config, nodes, &mut draft);
                black_box(&draft);
            }
            total += start.elapsed();
            done += steps as u64;
        }
        total
    });
}

fn bench_proposers(c: &mut Criterion) {
    let config = SamplingConfig::greedy();
    let makers: [(&str, Maker); 2] = [("prompt_lookup", prompt_lookup), ("suffix", suffix)];

    let mut group = c.benchmark_group("incremental");
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(3));
    for &len in &LENGTHS {
        let text = synthetic_text(len + STEPS, 42);
        for (name, make) in makers {
            group.bench_function(BenchmarkId::new(name, len), |b| {
                steady_state(b, make, &text, len, K, &config);
            });
        }
    }
    group.finish();

    let mut group = c.benchmark_group("tree");
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(3));
    for &len in &LENGTHS {
        let text = synthetic_text(len + STEPS, 42);
        for (name, make) in makers {
            for nodes in NODES {
                // The tree sizes behind the times (the text decides how many candidates exist).
                let mut p = make();
                let mut draft = Draft::default();
                p.begin(&text[..len]).expect("begin");
                let total: usize = (1..=256)
                    .map(|i| {
                        propose(&mut *p, &text[..len + i], &config, nodes, &mut draft);
                        draft.len()
                    })
                    .sum();
                eprintln!(
                    "tree/{name}/nodes-{nodes}/{len}: {:.1} nodes per draft (mean of 256)",
                    total as f64 / 256.0
                );
                let id = BenchmarkId::new(format!("{name}/nodes-{nodes}"), len);
                group.bench_function(id, |b| {
                    steady_state(b, make, &text, len, nodes, &config);
                });
            }
        }
    }
    group.finish();

    let mut group = c.benchmark_group("rebuild");
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(3));
    for &len in &LENGTHS {
        let text = synthetic_text(len, 42);
        for (name, make) in makers {
            let mut proposer = make();
            let mut draft = Draft::default();
            group.bench_function(BenchmarkId::new(name, len), |b| {
                b.iter(|| {
                    // An empty prompt forgets the indexed context (the corpus stays).
                    proposer.begin(&[]).expect("begin");
                    propose(&mut *proposer, &text, &config, K, &mut draft);
                    black_box(&draft);
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_proposers);
criterion_main!(benches);
