//! Criterion benches of the fused prefill (`TargetModel::forward_tail`, issue 30) against a
//! prefill forward followed by the verify forward, the way `Generator` starts a conversation
//! turn: a 250-token cached conversation, a new message of `m` tokens (30: a short agentic
//! tool-call turn; 80), then a verify block of 9 rows (`[last, d_1 .. d_8]`). One thread, Q8.
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo bench -p speculative-candle --bench fused_prefill
//! ```

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use speculative::TargetModel;
use speculative_candle::default_model_path;
use speculative_candle::fast::{FastFormat, FastTarget, FastWeights};

fn bench(c: &mut Criterion) {
    let w = FastWeights::load(default_model_path(), FastFormat::Q8)
        .expect("run scripts/fetch-model.sh");
    let cached = 250;
    let ctx: Vec<u32> = (0..cached as u32 + 200)
        .map(|i| (i * 7919 + 13) % 40_000)
        .collect();
    let mut target = FastTarget::new(w);
    target.prefill_tokens(&ctx[..cached]).expect("prefill");
    let mut logits = Vec::new();
    let rows = 9;
    let mut g = c.benchmark_group("fused_prefill");
    g.sample_size(20);
    g.measurement_time(std::time::Duration::from_secs(4));
    for m in [30usize, 80] {
        let feed = &ctx[cached..cached + m + rows];
        g.bench_with_input(BenchmarkId::new("prefill_then_verify", m), &m, |b, _| {
            b.iter(|| {
                target.prefill(&feed[..m]).expect("prefill");
                target.forward(&feed[m..], &mut logits).expect("forward");
                target.truncate(cached).expect("truncate");
            })
        });
        g.bench_with_input(BenchmarkId::new("fused", m), &m, |b, _| {
            b.iter(|| {
                target.forward_tail(feed, rows, &mut logits).expect("fused");
                target.truncate(cached).expect("truncate");
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
