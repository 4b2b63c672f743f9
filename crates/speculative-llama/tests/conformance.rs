//! The conformance kit (`speculative::conformance`) on llama.cpp: `LlamaTarget` and
//! `LlamaBatchTarget` with the defaults (flash attention on, a KV cache per sequence), which
//! were measured batch-invariant for verify-sized calls (docs/llama-cpp.md), so every row is
//! compared bit for bit. Needs the real GGUF (`scripts/fetch-model.sh`).

mod common;

use common::{chat, engine};
use speculative::conformance::{self, KitConfig, Tolerance};
use speculative_llama::LlamaConfig;

/// A chat prompt and a short one.
fn prompts() -> Vec<Vec<u32>> {
    vec![chat("Name a river."), vec![1, 2, 3]]
}

/// Exact rows, fewer samples (each is a short generation), a small context the kit fills.
fn config() -> KitConfig {
    KitConfig::builder()
        .tolerance(Tolerance::Exact)
        .samples(200)
        .greedy_tokens(8)
        .build()
        .unwrap()
}

#[test]
fn llama_target_meets_the_contract() {
    let make = || {
        engine()
            .target(&LlamaConfig::default().with_context(128))
            .unwrap()
    };
    let (prompts, cfg) = (prompts(), config());
    let mut r = conformance::check_target(make, &prompts, &cfg);
    r.merge(conformance::check_invariance(make, &prompts, &cfg));
    r.merge(conformance::check_lossless(make, &prompts, &cfg));
    println!("{r}");
    r.assert_passed();
    assert_eq!(r.invariance().expect("measured").argmax_changes, 0);
}

#[test]
fn llama_batch_target_meets_the_contract() {
    let make = || {
        engine()
            .batch_target(&LlamaConfig::default().with_context(128).with_slots(2))
            .unwrap()
    };
    let r = conformance::check_batch(make, &prompts(), &config());
    println!("{r}");
    r.assert_passed();
}
