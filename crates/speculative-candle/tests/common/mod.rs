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

/// The real model's fast Q8 weights (loaded once per test binary).
pub fn fast_weights() -> Arc<speculative_candle::FastWeights> {
    static W: OnceLock<Arc<speculative_candle::FastWeights>> = OnceLock::new();
    W.get_or_init(|| {
        speculative_candle::FastWeights::load(model_path(), speculative_candle::FastFormat::Q8)
            .unwrap_or_else(|e| panic!("loading the model failed: {e}"))
    })
    .clone()
}

/// `question` as a user turn in the model's chat template, tokenized.
pub fn chat(question: &str) -> Vec<u32> {
    let tok = tokenizer();
    let text = tok
        .apply_chat_template(&[speculative_candle::ChatMessage::user(question)])
        .unwrap();
    tok.encode(&text).unwrap()
}

/// A small LCG (fixed seeds, no dependency).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab) as u32).collect()
    }
}
