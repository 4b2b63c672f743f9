//! Shared helpers of the real-model tests.
#![allow(dead_code)]

use std::sync::OnceLock;

use speculative_llama::{ChatTurn, LlamaEngine, LlamaError, ModelOptions};

/// The real model (loaded once per test binary); fails with instructions when it is missing.
pub fn engine() -> &'static LlamaEngine {
    static E: OnceLock<LlamaEngine> = OnceLock::new();
    E.get_or_init(|| {
        let p = speculative_llama::default_model_path();
        assert!(
            p.is_file(),
            "model file {} is missing: run scripts/fetch-model.sh (or set SPECULATIVE_MODEL)",
            p.display()
        );
        LlamaEngine::load(&p, &ModelOptions::default()).expect("loading the model")
    })
}

/// The chat prompt of one user message, tokenized.
pub fn chat(message: &str) -> Vec<u32> {
    let e = engine();
    e.encode(
        &e.apply_chat_template(&[ChatTurn::user(message)], true)
            .unwrap(),
    )
    .unwrap()
}

/// The id of the largest logit of a row (ties: the lowest id).
pub fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > row[best] { i } else { best })
}

/// The largest absolute difference of two equally long rows.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The adapter's error inside a `speculative::Error::Model`.
pub fn llama_error(e: &speculative::Error) -> &LlamaError {
    match e {
        speculative::Error::Model(src) => src
            .downcast_ref::<LlamaError>()
            .unwrap_or_else(|| panic!("not a LlamaError: {src}")),
        other => panic!("expected Error::Model, got {other:?}"),
    }
}
