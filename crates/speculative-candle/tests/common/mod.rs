//! Shared helpers for the real-model tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use speculative_candle::{
    GgufTokenizer, LlamaWeights, LoadOptions, WeightFormat, default_model_path,
};

/// The model path; panics (fails the test) with instructions when the file is missing.
pub fn model_path() -> PathBuf {
    let p = default_model_path();
    assert!(
        p.is_file(),
        "model file {} is missing: run `scripts/fetch-model.sh` from the repository root \
         (or set SPECULATIVE_MODEL)",
        p.display()
    );
    p
}

pub fn weights(format: WeightFormat) -> Arc<LlamaWeights> {
    static Q8: OnceLock<Arc<LlamaWeights>> = OnceLock::new();
    static F32: OnceLock<Arc<LlamaWeights>> = OnceLock::new();
    let cell = match format {
        WeightFormat::F32 => &F32,
        _ => &Q8,
    };
    cell.get_or_init(|| {
        LlamaWeights::load_with(model_path(), &LoadOptions::with_format(format))
            .unwrap_or_else(|e| panic!("loading the model failed: {e}"))
    })
    .clone()
}

pub fn tokenizer() -> &'static GgufTokenizer {
    static TOK: OnceLock<GgufTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        GgufTokenizer::load(model_path())
            .unwrap_or_else(|e| panic!("loading the tokenizer failed: {e}"))
    })
}

pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}
