//! The conformance kit (`speculative::conformance`) on every engine of this crate: `FastTarget`
//! (random tiny weights, and the real SmolLM2-135M Q8 weights), `FastBatch`, `CandleTarget`
//! (candle's own ops: not batch invariant, so compared within a tolerance and its invariance
//! measured) and the shipped EAGLE `DraftHead` (a feature-conditioned draft model). The
//! real-model engines need `models/SmolLM2-135M-Instruct.Q4_1.gguf` (`scripts/fetch-model.sh`).

mod common;

use std::sync::Arc;

use common::{chat, fast_weights, weights};
use speculative::conformance::{self, KitConfig, Tolerance};
use speculative_candle::fast::RandomSpec;
use speculative_candle::fast::head::{DraftHead, DraftHeadWeights};
use speculative_candle::{
    CandleTarget, FastBatch, FastFormat, FastTarget, FastWeights, WeightFormat, default_head_path,
};

/// Tiny random weights with a 96-token context, so that the kit fills the context.
fn tiny() -> Arc<FastWeights> {
    let spec = RandomSpec {
        context: 96,
        ..RandomSpec::default()
    };
    FastWeights::random(&spec, FastFormat::Q8).unwrap()
}

fn tiny_target() -> FastTarget {
    FastTarget::new(tiny())
}

const TINY_PROMPTS: &[&[u32]] = &[&[1, 2, 3, 4, 5, 6, 7, 8, 9], &[200, 17, 200, 17], &[5, 300]];

// The fast forward claims batch invariance: every check is bit for bit.
speculative::conformance_tests!(fast_tiny, tiny_target, TINY_PROMPTS);
speculative::conformance_tests!(
    batch fast_batch_tiny,
    || FastBatch::new(tiny(), 3).unwrap(),
    TINY_PROMPTS
);

/// Chat prompts of the real model (and a short one).
fn real_prompts() -> Vec<Vec<u32>> {
    vec![chat("Name a river."), vec![1, 2, 3]]
}

/// Fewer samples on the real model (each is a short generation on 30 layers).
fn real_config(tolerance: Tolerance) -> KitConfig {
    KitConfig::builder()
        .tolerance(tolerance)
        .samples(200)
        .greedy_tokens(8)
        .build()
        .unwrap()
}

#[test]
fn fast_target_on_the_real_model() {
    let make = || FastTarget::new(fast_weights());
    let prompts = real_prompts();
    let cfg = real_config(Tolerance::Exact);
    let mut r = conformance::check_target(make, &prompts, &cfg);
    r.merge(conformance::check_invariance(make, &prompts, &cfg));
    r.merge(conformance::check_tree(make, &prompts, &cfg));
    r.merge(conformance::check_hidden(make, &prompts, &cfg));
    r.merge(conformance::check_lossless(make, &prompts, &cfg));
    println!("{r}");
    r.assert_passed();
    let inv = r.invariance().expect("measured");
    assert_eq!(inv.argmax_changes, 0);
}

#[test]
fn fast_batch_on_the_real_model() {
    let r = conformance::check_batch(
        || FastBatch::new(fast_weights(), 2).unwrap(),
        &real_prompts(),
        &real_config(Tolerance::Exact),
    );
    println!("{r}");
    r.assert_passed();
}

#[test]
fn candle_target_within_a_tolerance() {
    // candle's quantized matmul accumulates differently for different row counts (GUIDE.md
    // section 4: 7 of 200 argmax changes), so rows are compared within 0.05 and the invariance
    // check reports the measured differences as tolerated.
    // One short prompt: candle's ops cost several times the fast forward per row.
    let make = || CandleTarget::new(weights(WeightFormat::Q8_0));
    let prompts = vec![vec![1u32, 2, 3, 4, 5, 6]];
    let cfg = real_config(Tolerance::Abs(0.05));
    let mut r = conformance::check_target(make, &prompts, &cfg);
    r.merge(conformance::check_invariance(make, &prompts, &cfg));
    r.merge(conformance::check_tree(make, &prompts, &cfg));
    r.merge(conformance::check_hidden(make, &prompts, &cfg));
    println!("{r}");
    r.assert_passed();
    println!("CandleTarget invariance: {:?}", r.invariance());
}

#[test]
fn the_shipped_draft_head() {
    let hw: Arc<DraftHeadWeights> =
        DraftHeadWeights::load(default_head_path(), fast_weights()).unwrap();
    let make = || DraftHead::new(hw.clone());
    let prompts = real_prompts();
    let cfg = real_config(Tolerance::Exact);
    let mut r = conformance::check_target(make, &prompts, &cfg);
    r.merge(conformance::check_tree(make, &prompts, &cfg));
    r.merge(conformance::check_features(make, &prompts, &cfg));
    println!("{r}");
    r.assert_passed();
}
