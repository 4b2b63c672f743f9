//! The crate's error type.

use std::path::PathBuf;

/// Errors returned by `speculative-candle`.
///
/// Inside a [`speculative::TargetModel`] call these are wrapped with
/// [`speculative::Error::model`], so `err.source()` of the returned
/// [`speculative::Error::Model`] is a `CandleError`.
///
/// The enum is `#[non_exhaustive]`: match with a wildcard arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CandleError {
    /// The model file does not exist.
    #[error(
        "model file {path} not found; run `scripts/fetch-model.sh` from the repository root \
         (or set SPECULATIVE_MODEL to a llama GGUF file)"
    )]
    ModelNotFound {
        /// The path that was tried.
        path: PathBuf,
    },
    /// The model file exists but is not a readable llama GGUF file (truncated download, wrong
    /// file, unsupported tensor type, ...).
    #[error(
        "model file {path} is corrupt or unsupported: {reason}; run `scripts/fetch-model.sh` \
         to fetch a verified copy"
    )]
    CorruptModel {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A GGUF metadata key is missing or has the wrong type or an out-of-range value.
    #[error("GGUF metadata `{key}`: {reason}")]
    Metadata {
        /// The metadata key, for example `llama.block_count`.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A weight tensor is missing or has an unexpected shape.
    #[error("GGUF tensor `{name}`: {reason}")]
    Tensor {
        /// Tensor name, for example `blk.0.attn_q.weight`.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An invalid argument (empty token slice, an early-exit depth of 0, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A token id is not smaller than the vocabulary size.
    #[error("token id {token} is outside the vocabulary of size {vocab_size}")]
    TokenOutOfVocab {
        /// The token id.
        token: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// Appending tokens would exceed the model's context length.
    #[error("context overflow: {seq_len} cached + {added} new tokens > max context {max_context}")]
    ContextOverflow {
        /// Tokens already in the KV cache.
        seq_len: usize,
        /// Tokens the call tried to append.
        added: usize,
        /// The model's context length (`llama.context_length`).
        max_context: usize,
    },
    /// `truncate(len)` was called with `len` greater than the current sequence length.
    #[error("cannot truncate to {len} tokens: the sequence holds only {seq_len}")]
    TruncateBeyondEnd {
        /// Requested length.
        len: usize,
        /// Current sequence length.
        seq_len: usize,
    },
    /// Building or running the tokenizer failed.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The chat template could not be parsed or rendered.
    #[error("chat template error: {0}")]
    Template(String),
    /// A draft head and its target disagree on the feature rows: the target hands over the
    /// states of other layers than the head was trained on
    /// ([`crate::fast::DraftHeadWeights::check_target_layout`]).
    #[error("the draft head reads feature rows {head}, the target hands over {target}")]
    FeatureLayoutMismatch {
        /// The head's layout.
        head: String,
        /// The target's layout.
        target: String,
    },
    /// A candle tensor operation failed.
    #[error("candle error: {0}")]
    Candle(#[from] candle_core::Error),
    /// An I/O error while reading the model file.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl From<CandleError> for speculative::Error {
    fn from(e: CandleError) -> Self {
        speculative::Error::model(e)
    }
}

/// Shorthand for `Result<T, CandleError>`.
pub type Result<T, E = CandleError> = std::result::Result<T, E>;
