//! Criterion benches of the shipped EAGLE draft head against the target, one thread, Q8, after a
//! 128-token context: one target decode step (1 row, full 49,152-id head), one draft-head step
//! (1 row: fc, one layer, the subset head, the `[vocab]` logits row written), a draft-head
//! catch-up of 5 rows, and a 16-node head tree forward (depth 4).
//!
//! ```text
//! cargo bench -p speculative-candle --bench draft_head
//! ```

use criterion::{Criterion, criterion_group, criterion_main};
use speculative::{DraftBlock, TargetFeatures, TargetModel};
use speculative_candle::fast::head::{DraftHead, DraftHeadWeights};
use speculative_candle::fast::{FastFormat, FastTarget, FastWeights};
use speculative_candle::{default_head_path, default_model_path};

fn bench(c: &mut Criterion) {
    let w = FastWeights::load(default_model_path(), FastFormat::Q8)
        .expect("run scripts/fetch-model.sh");
    let hw = DraftHeadWeights::load(default_head_path(), w.clone()).expect("the shipped head");
    let h = w.config().hidden_size;
    let ctx: Vec<u32> = (0..128u32).map(|i| (i * 7919 + 13) % 40_000).collect();
    let mut target = FastTarget::new(w.clone());
    let mut logits = Vec::new();
    target.prefill_tokens(&ctx).expect("prefill");
    let feats = {
        use speculative::HiddenStates;
        target.last_hidden().expect("hidden").to_vec()
    };
    let mut g = c.benchmark_group("draft_head");
    g.sample_size(30);
    g.measurement_time(std::time::Duration::from_secs(3));
    g.bench_function("target_step_1_row", |b| {
        b.iter(|| {
            target.forward_logits(&[42], &mut logits).expect("forward");
            target.truncate_to(128).expect("truncate");
        })
    });
    let mut head = DraftHead::new(hw);
    head.set_target_hidden(0, &feats[..127 * h])
        .expect("features");
    head.prefill(&ctx[..127]).expect("prefill");
    g.bench_function("head_step_1_row", |b| {
        b.iter(|| {
            head.forward(&[ctx[127]], &mut logits).expect("forward");
            head.truncate(127).expect("truncate");
        })
    });
    head.set_target_hidden(127, &feats[127 * h..])
        .expect("features");
    g.bench_function("head_catch_up_5_rows", |b| {
        b.iter(|| {
            head.forward(&[ctx[127], 1, 2, 3, 4], &mut logits)
                .expect("forward");
            head.truncate(127).expect("truncate");
        })
    });
    let tokens: Vec<u32> = (0..16).map(|i| 100 + i).collect();
    let parents: Vec<u32> = (0..16u32).map(|i| if i < 4 { 0 } else { i - 3 }).collect();
    let block = DraftBlock::tree(&tokens, &parents);
    g.bench_function("head_tree_16_nodes", |b| {
        b.iter(|| {
            let t = head.tree().expect("tree support");
            t.forward_tree(ctx[127], &block, &mut logits).expect("tree");
            head.truncate(127).expect("truncate");
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
