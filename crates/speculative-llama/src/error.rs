//! The adapter's error type.

use std::path::PathBuf;

/// What went wrong in the llama.cpp adapter. Converts into [`speculative::Error::Model`] (the
/// `?` operator does it inside trait methods), so the decoding loop reports it as an engine
/// failure with this value as its source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LlamaError {
    /// llama.cpp's process-wide backend could not be initialised (see [`crate::backend`]).
    #[error("llama.cpp backend: {0}")]
    Backend(String),
    /// The GGUF file could not be loaded.
    #[error("loading {path}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// Why (llama.cpp logs the details when logging is on, see [`crate::set_logging`]).
        reason: String,
    },
    /// A configuration value is out of range.
    #[error("invalid {field} = {value}: {reason}")]
    Config {
        /// The field of [`crate::LlamaConfig`] or [`crate::ModelOptions`].
        field: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        reason: &'static str,
    },
    /// llama.cpp could not create a context (out of memory for the KV cache, most often).
    #[error("creating a llama.cpp context: {0}")]
    Context(String),
    /// An append would take a sequence past its context.
    #[error(
        "sequence {seq} holds {seq_len} tokens; {added} more exceed its context of {max_context}"
    )]
    ContextOverflow {
        /// The sequence (slot).
        seq: usize,
        /// Tokens it holds.
        seq_len: usize,
        /// Tokens the call appends.
        added: usize,
        /// Its context, in tokens.
        max_context: usize,
    },
    /// A token id is not below the vocabulary size.
    #[error("token id {token} is outside the vocabulary of {vocab_size}")]
    TokenOutOfVocab {
        /// The token id.
        token: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// An append of no tokens.
    #[error("an append needs at least one token")]
    Empty,
    /// A rollback to a length the sequence does not reach.
    #[error("truncate sequence {seq} to {len} tokens, but it holds {seq_len}")]
    TruncateBeyond {
        /// The sequence (slot).
        seq: usize,
        /// The requested length.
        len: usize,
        /// Its length.
        seq_len: usize,
    },
    /// `llama_decode` failed; the sequences were rolled back to their length before the call.
    #[error("llama_decode failed: {0}")]
    Decode(String),
    /// llama.cpp refused to remove KV entries of a sequence.
    #[error("removing KV entries of sequence {seq} from position {from}: {reason}")]
    Cache {
        /// The sequence (slot).
        seq: usize,
        /// The first position to remove.
        from: usize,
        /// llama.cpp's answer.
        reason: String,
    },
    /// llama.cpp could not save or restore a sequence's state (snapshot rollback).
    #[error("saving or restoring the state of sequence {seq}: {reason}")]
    State {
        /// The sequence (slot).
        seq: usize,
        /// llama.cpp's answer.
        reason: String,
    },
    /// A rollback the sequence cannot do (a truncation to a middle length in snapshot mode,
    /// a restore without a saved state); becomes [`speculative::Error::StateRollback`].
    #[error("the sequence cannot roll its state back: {0}")]
    StateRollback(&'static str),
    /// llama.cpp returned logits of an unexpected size.
    #[error("llama.cpp returned {got} logits for a row, the vocabulary has {vocab_size}")]
    LogitsSize {
        /// Values returned.
        got: usize,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// The model file has no chat template, or llama.cpp cannot apply it.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// llama.cpp's quantizer failed ([`crate::quantize`]).
    #[error("quantizing {path}: llama_model_quantize returned {code}")]
    Quantize {
        /// The source file.
        path: PathBuf,
        /// llama.cpp's return code.
        code: u32,
    },
    /// Text that cannot pass to llama.cpp (an interior NUL byte).
    #[error("text for llama.cpp: {0}")]
    Text(String),
}

impl From<LlamaError> for speculative::Error {
    fn from(e: LlamaError) -> Self {
        match e {
            LlamaError::StateRollback(what) => speculative::Error::StateRollback { what },
            e => speculative::Error::model(e),
        }
    }
}

/// `Result` with [`LlamaError`].
pub type Result<T, E = LlamaError> = std::result::Result<T, E>;
