//! Overhead of the decoding loop per step with a zero-cost target (the target copies a fixed
//! logits row per position), so the figure is the loop's own cost: proposing, verification
//! and bookkeeping.
//!
//! Run: `cargo bench --bench decode`

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use speculative::decode::{DraftLength, GenerationParams, Generator};
use speculative::propose::PromptLookup;
use speculative::{Result, SamplingConfig, TargetModel};

/// A target whose forward costs one memcpy per position: next token = (last + 1) mod vocab.
struct ZeroCost {
    vocab: usize,
    len: usize,
    rows: Vec<Vec<f32>>,
}

impl ZeroCost {
    fn new(vocab: usize) -> Self {
        let rows = (0..vocab)
            .map(|t| {
                let mut r = vec![0.0f32; vocab];
                r[(t + 1) % vocab] = 10.0;
                r
            })
            .take(64)
            .collect();
        ZeroCost {
            vocab,
            len: 0,
            rows,
        }
    }
}

impl TargetModel for ZeroCost {
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn max_context(&self) -> usize {
        1 << 30
    }
    fn seq_len(&self) -> usize {
        self.len
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        logits.clear();
        for &t in tokens {
            logits.extend_from_slice(&self.rows[t as usize % 64]);
        }
        self.len += tokens.len();
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.len = len;
        Ok(())
    }
}

fn bench_loop(c: &mut Criterion) {
    let mut group = c.benchmark_group("loop_overhead");
    group.sample_size(20);
    // The prompt repeats the target's own cycle, so prompt lookup drafts are all accepted.
    for &vocab in &[64usize, 32_000] {
        let prompt: Vec<u32> = (0..200).map(|i| (i % 64) as u32).collect();
        for (name, sampling) in [
            ("greedy", SamplingConfig::greedy()),
            (
                "t=0.8,top_p=0.9",
                SamplingConfig::builder()
                    .temperature(0.8)
                    .top_p(0.9)
                    .build()
                    .unwrap(),
            ),
        ] {
            let steps = 64usize;
            let params = GenerationParams::greedy(steps * 5)
                .to_builder()
                .sampling(sampling)
                .seed(0)
                .draft(DraftLength::Fixed(4))
                .build()
                .unwrap();
            group.throughput(Throughput::Elements(steps as u64 * 5));
            group.bench_with_input(BenchmarkId::new(name, vocab), &vocab, |b, &v| {
                let mut g = Generator::new(ZeroCost::new(v), PromptLookup::new(1, 3).unwrap());
                b.iter(|| black_box(g.generate(&prompt, &params).unwrap().tokens.len()))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_loop);
criterion_main!(benches);
