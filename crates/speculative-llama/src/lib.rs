//! llama.cpp as an engine for [`speculative`], through the
//! [llama-cpp-2](https://crates.io/crates/llama-cpp-2) bindings (0.1.160, which build
//! llama.cpp from source with cmake).
//!
//! - [`LlamaEngine`]: a GGUF model loaded once and shared; its tokenizer and chat template
//!   (llama.cpp's own, from the file's metadata); a [`speculative::decode::Detokenizer`].
//! - [`LlamaTarget`]: one sequence, [`speculative::TargetModel`]: verify rows with logits of
//!   every position in one `llama_decode`, prefill without logits, KV rollback by position
//!   (`llama_memory_seq_rm`).
//! - [`LlamaBatchTarget`]: several sequences in one context, [`speculative::BatchTarget`], for
//!   continuous batching; one `llama_decode` per batch step.
//! - [`LlamaEngine::vocab_pieces`] and [`LlamaBytesEncoder`]: the vocabulary as bytes and the
//!   tokenizer as a [`speculative::propose::BytesEncoder`], for a draft model with another
//!   tokenizer ([`speculative::propose::CrossVocabProposer`]; Gemma 3 270M drafted by
//!   SmolLM2-135M in this repository, see `scripts/fetch-gemma.sh`).
//! - [`quantize`]: llama.cpp's own quantizer, to turn a file whose format has no multi-row CPU
//!   kernel (Q4_1) into one that has (Q8_0), so that verify calls are cheap.
//! - Features `cuda` and `metal` build llama.cpp's GPU backends (llama-cpp-2's features of the
//!   same names); [`ModelOptions::gpu_layers`] offloads layers.
//!
//! ```no_run
//! use speculative::decode::{GenerationParams, Generator, StopConditions};
//! use speculative::propose::PromptLookup;
//! use speculative_llama::{ChatTurn, LlamaConfig, LlamaEngine, ModelOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = LlamaEngine::load("models/SmolLM2-135M-Instruct.Q4_1.gguf", &ModelOptions::default())?;
//! let text = engine.apply_chat_template(&[ChatTurn::user("Repeat: the cat sat.")], true)?;
//! let prompt = engine.encode(&text)?;
//! let target = engine.target(&LlamaConfig::default())?;
//! // The engine is also the detokenizer (text, stop strings, streamed text); cloning shares it.
//! let mut generator =
//!     Generator::new(target, PromptLookup::new(1, 4)?).with_detokenizer(engine.clone());
//! let stop = engine.eog_ids().iter().fold(StopConditions::default(), |s, &t| s.with_eos(t));
//! let params = GenerationParams::greedy(64).with_stop(stop)?;
//! let out = generator.generate(&prompt, &params)?;
//! println!("{}", engine.decode(&out.tokens, true)?);
//! // Plain greedy decoding for comparison: the same params with `DraftLength::Off`, or the
//! // `NoProposer` proposer; with the defaults below both outputs are token-identical.
//! # Ok(()) }
//! ```
//!
//! Errors of the adapter reach the loop as [`speculative::Error::Model`]; the
//! [`LlamaError`] is its source (`err.source()` or `downcast_ref::<LlamaError>()` on the boxed
//! error).
//!
//! # Batch invariance and greedy identity
//!
//! Our loop is exact given the logits it receives: greedy speculative output equals greedy
//! decoding *of the same logits*. llama.cpp computes a row's logits with kernels chosen by the
//! number of rows in the call, so a row verified among `k + 1` rows need not carry the same
//! logits, bit for bit, as the same row decoded alone; where two candidates are nearly tied,
//! the argmax can differ, and speculative greedy output then differs from plain greedy output
//! from that position on. Both outputs are greedy decodings of the model, with different
//! rounding. The adapter's defaults remove it on the CPU backend (measured on SmolLM2, see
//! `docs/llama-cpp.md` in the repository): flash attention on ([`FlashAttention::On`]) makes
//! every row of a verify call bit-identical to the row decoded alone, and a KV cache per
//! sequence ([`LlamaConfig::unified_kv`] `false`) keeps a batched request's logits independent of
//! the other requests. Turning either off brings the differences back (about 1.5% of rows with
//! flash attention off). Calls of 64 rows or more (long prefills) are not invariant; verify calls
//! are far shorter, and plain and speculative decoding prefill the same way.
//!
//! # Building
//!
//! llama-cpp-2 compiles llama.cpp with cmake (a C++ compiler, cmake and libclang are needed). It compiles for the CPU features rustc targets: build with
//! `RUSTFLAGS="-C target-cpu=native"`, or set `GGML_AVX2=ON` and the like in the environment
//! (this repository's `.cargo/config.toml` does; a project that depends on this crate needs its
//! own, see the crate README), or llama.cpp runs without SIMD on x86_64. About 4-8 minutes on 2
//! cores, once per cargo profile.

mod batch;
mod engine;
mod error;
mod quantize;
mod repack;
mod seqs;
mod target;
mod vocab;

pub use batch::LlamaBatchTarget;
pub use engine::{ChatTurn, LlamaEngine, ModelOptions, backend, set_logging};
pub use error::{LlamaError, Result};
pub use quantize::{Quantization, quantize, quantized_copy};
pub use repack::{cpu_extra_buffer_types, cpu_weight_repacking};
pub use seqs::{FlashAttention, LlamaConfig};
pub use target::LlamaTarget;
pub use vocab::LlamaBytesEncoder;

/// The llama-cpp-2 bindings this crate is built on, for what it does not wrap.
pub use llama_cpp_2;

/// The default model path of this repository's tests and examples:
/// `$SPECULATIVE_MODEL`, else `models/SmolLM2-135M-Instruct.Q4_1.gguf` under the workspace root
/// (fetched by `scripts/fetch-model.sh`).
pub fn default_model_path() -> std::path::PathBuf {
    match std::env::var_os("SPECULATIVE_MODEL") {
        Some(p) if !p.is_empty() => p.into(),
        _ => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
