//! The crate's error type.
//!
//! Every fallible function in `speculative` returns [`Error`]. Bad user input (a malformed
//! configuration, logits of the wrong shape, a draft token outside the vocabulary, NaN logits)
//! is reported through one of these variants, never through a panic, a NaN or a token id
//! outside the vocabulary. The verifier checks shapes, token ids, q rows and raw logit values for
//! the whole input before any random draw, so whether an input is rejected never depends on the
//! seed (case C14); only [`Error::NoAllowedToken`] for a target row depends on which rows a step
//! reaches. The enum is `Send + Sync` and `'static`, so it crosses threads and boxes into
//! `Box<dyn std::error::Error + Send + Sync>`.

use crate::tree::TreeFault;
use std::fmt;

/// Which side of a verify step a row belongs to, used in error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RowKind {
    /// A row of target logits (`[k + 1, vocab]` per sequence).
    Target,
    /// A row of draft logits or draft probabilities q (`[k, draft_vocab]` per sequence).
    Draft,
}

impl fmt::Display for RowKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RowKind::Target => f.write_str("target"),
            RowKind::Draft => f.write_str("draft"),
        }
    }
}

/// Errors returned by `speculative`.
///
/// The enum is `#[non_exhaustive]`: match with a wildcard arm. `Error` is `Send + Sync` (the
/// wrapped model and proposer errors are required to be), so it crosses threads and converts
/// into `Box<dyn std::error::Error + Send + Sync>`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is out of its documented range (for example a negative
    /// temperature, `top_p > 1`, or a proposer's `min_n = 0`). `field` names the parameter.
    #[error("invalid configuration: {field} = {value} ({reason})")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// The value given, formatted.
        value: String,
        /// Which range was expected.
        reason: &'static str,
    },
    /// A buffer does not have the length its shape requires.
    #[error("shape mismatch for {what}: expected {expected} elements, got {actual}")]
    ShapeMismatch {
        /// Which input (for example `"target_logits"`).
        what: &'static str,
        /// Expected number of elements (or rows).
        expected: usize,
        /// Number found.
        actual: usize,
    },
    /// A token id is not smaller than the vocabulary size.
    #[error("token id {token} is outside the vocabulary of size {vocab_size} ({what})")]
    TokenOutOfVocab {
        /// Where the token came from (for example `"draft token"`).
        what: &'static str,
        /// The token id.
        token: u32,
        /// The vocabulary size it was checked against.
        vocab_size: usize,
    },
    /// The draft vocabulary is larger than the target vocabulary. A shorter draft vocabulary
    /// (padded embedding rows) is fine; missing draft entries count as probability 0.
    #[error("draft vocabulary ({draft}) is larger than the target vocabulary ({target})")]
    DraftVocabTooLarge {
        /// Draft vocabulary size.
        draft: usize,
        /// Target vocabulary size.
        target: usize,
    },
    /// A logit is NaN or `+inf`. (`-inf` is allowed and means "banned".)
    #[error("non-finite logit ({value}) in {kind} row {row} at token {token}")]
    NonFiniteLogits {
        /// Target or draft.
        kind: RowKind,
        /// Row index within the sequence (`0..=k`).
        row: usize,
        /// Token index of the first offending entry.
        token: usize,
        /// The offending value.
        value: f32,
    },
    /// Every token of a row was removed by masks, bans, `-inf` logits or filtering, so the row
    /// has no token to sample.
    #[error("no allowed token in {kind} row {row}: every logit is -inf after masking")]
    NoAllowedToken {
        /// Target or draft.
        kind: RowKind,
        /// Row index within the sequence.
        row: usize,
    },
    /// Draft probabilities q are not a valid distribution: a negative or non-finite entry, or
    /// probability 0 for the token the proposer claims to have sampled.
    #[error("invalid draft probabilities in row {row}: {reason}")]
    InvalidDraftProbs {
        /// Draft row index (`0..k`).
        row: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// The model adapter failed (I/O, tensor op, out of context, ...).
    #[error("model error: {0}")]
    Model(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The proposer failed.
    #[error("proposer error: {0}")]
    Proposer(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The prompt is empty: a generation needs at least one token to condition on.
    #[error("empty prompt: a generation needs at least one prompt token")]
    EmptyPrompt,
    /// The prompt does not fit the model's context. Shorten the prompt or use a model with a
    /// longer context.
    #[error("prompt of {len} tokens exceeds the model's context of {max_context} tokens")]
    PromptTooLong {
        /// Prompt length, in tokens.
        len: usize,
        /// [`crate::TargetModel::max_context`], in tokens.
        max_context: usize,
    },
    /// The draft offsets of a batch are malformed: `draft_offsets[0]` is not 0, or an offset is
    /// smaller than the one before it.
    #[error("draft_offsets[{index}] = {value} is invalid: {reason}")]
    InvalidOffsets {
        /// Index into `draft_offsets`.
        index: usize,
        /// The offending offset.
        value: usize,
        /// What was expected.
        reason: &'static str,
    },
    /// A method for one backend was called on a verifier of another backend (for example
    /// `verify_cuda` on a wgpu verifier). Call the method that matches
    /// [`crate::gpu::GpuVerifier::backend`].
    #[error("{method} called on a {backend} verifier")]
    WrongBackend {
        /// The method called.
        method: &'static str,
        /// The verifier's backend.
        backend: &'static str,
    },
    /// A batch is larger than one launch of a backend can take (a buffer over the device's
    /// binding limit, or an index over 32 bits). Split the batch into smaller ones.
    #[error(
        "batch too large for one {backend} launch: {what} is {size}, the limit is {limit}; split the batch"
    )]
    BatchTooLarge {
        /// Backend name.
        backend: &'static str,
        /// What is too large (a buffer or an index space).
        what: &'static str,
        /// Its size (bytes for buffers, elements for index spaces).
        size: u64,
        /// The limit it exceeds, in the same unit.
        limit: u64,
    },
    /// A proposer returned a draft the loop cannot use. The draft never reaches the target.
    #[error("proposer {proposer} returned an invalid draft: {fault}")]
    InvalidProposal {
        /// [`crate::Proposer::name`] of the proposer.
        proposer: &'static str,
        /// What is wrong with the draft.
        fault: ProposalFault,
    },
    /// A draft tree handed to the verifier or to a target's tree forward is malformed
    /// ([`crate::DraftBlock::validate`]).
    #[error("invalid draft tree: {0}")]
    InvalidTree(TreeFault),
    /// A proposer was asked to continue a context that does not extend the one it was started
    /// with (used directly, without [`crate::Proposer::begin`]), and it cannot rebuild its state.
    #[error(
        "proposer {proposer} was asked for a context it was not started with; call begin() with the new prompt"
    )]
    StaleProposerState {
        /// [`crate::Proposer::name`] of the proposer.
        proposer: &'static str,
    },
    /// A target model broke the loop's contract (for example a sequence length that does not
    /// match the tokens fed). `what` says which rule.
    #[error("target model broke the TargetModel contract: {what}")]
    TargetContract {
        /// The broken rule.
        what: &'static str,
    },
    /// A GPU backend ([`crate::gpu::Backend`]) cannot run. Returned by
    /// [`GpuVerifier::new`](crate::gpu::GpuVerifier::new),
    /// [`with_wgpu`](crate::gpu::GpuVerifier::with_wgpu),
    /// [`with_cuda`](crate::gpu::GpuVerifier::with_cuda) and [`crate::gpu::cuda_ptx`] when the
    /// crate was built without the backend's cargo feature (`wgpu`, `cuda`), its driver or
    /// NVRTC cannot be loaded, no device is found or its kernel does not compile; and by the
    /// `verify_*` and `read_*` methods of [`crate::gpu::GpuVerifier`] when the device fails
    /// during a call (a lost device, a failed launch, copy or map). `reason` says which. The
    /// CPU verifier ([`crate::Verifier`]) never returns it.
    #[error("backend {backend} unavailable: {reason}")]
    BackendUnavailable {
        /// Backend name.
        backend: &'static str,
        /// Why it is unavailable.
        reason: String,
    },
    /// An `ndarray` view handed over as logits or draft q is not in standard layout (contiguous
    /// and row-major): a transposed or column-major array, or one sliced with a step or along
    /// its columns. The verifier reads rows as slices and does not copy; pass
    /// `view.as_standard_layout()`, which borrows a view already in standard layout and copies
    /// any other into a contiguous array.
    #[error(
        "{what} is not a contiguous row-major (standard layout) array; pass view.as_standard_layout()"
    )]
    NonContiguous {
        /// Which input (for example `"target_logits"`).
        what: &'static str,
    },
    /// A backend does not support an input form that [`crate::Verifier`] takes (for example a
    /// GPU batch that mixes draft forms per sequence, or holds token trees). Verify that batch
    /// on the CPU, or split it.
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        /// Backend name.
        backend: &'static str,
        /// The unsupported form.
        what: &'static str,
    },
    /// A target whose state cannot be truncated ([`crate::TargetModel::rollback`] is `Some`)
    /// refused a rollback it cannot do: a [`crate::TargetModel::truncate`] to a length other
    /// than 0 or its length, a [`crate::StateSnapshot::restore_state`] without a saved state,
    /// [`crate::RowStates::keep_rows`] of more rows than it holds states of, or the batch
    /// versions of these. `what` says which; the target's state is unchanged.
    #[error("the target cannot roll its state back: {what}")]
    StateRollback {
        /// The refused call and why.
        what: &'static str,
    },
    /// A [`crate::BatchTarget`] slot is out of range, or listed twice in one
    /// [`crate::BatchTarget::forward_batch`] call.
    #[error("invalid slot {slot} ({reason}; the target has {max_slots} slots)")]
    InvalidSlot {
        /// The slot given.
        slot: usize,
        /// The target's [`crate::BatchTarget::max_slots`].
        max_slots: usize,
        /// What is wrong.
        reason: &'static str,
    },
}

/// What is wrong with a proposer's draft ([`Error::InvalidProposal`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProposalFault {
    /// More draft tokens than the request's `max_draft`.
    TooLong {
        /// Draft length returned.
        len: usize,
        /// The request's `max_draft`.
        max_draft: usize,
    },
    /// A draft token is outside the target vocabulary.
    TokenOutOfVocab {
        /// Index of the draft token.
        index: usize,
        /// The token id.
        token: u32,
        /// The target vocabulary size.
        vocab_size: usize,
    },
    /// q does not have the shape `[k, q_vocab]` with `0 < q_vocab <= vocab`.
    QShape {
        /// Expected number of elements.
        expected: usize,
        /// Number found.
        actual: usize,
    },
    /// The draft is a tree the loop cannot use (see [`TreeFault`]): malformed, over the node
    /// budget, or deeper than the step allows.
    Tree(TreeFault),
    /// A branching tree returned by [`crate::Proposer::propose`] (a chain step), or by
    /// `propose_tree` with tree drafts off: the loop asked for a chain.
    TreeNotRequested,
}

impl From<TreeFault> for ProposalFault {
    fn from(f: TreeFault) -> Self {
        ProposalFault::Tree(f)
    }
}

impl fmt::Display for ProposalFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProposalFault::TooLong { len, max_draft } => {
                write!(f, "{len} draft tokens, max_draft is {max_draft}")
            }
            ProposalFault::TokenOutOfVocab {
                index,
                token,
                vocab_size,
            } => write!(
                f,
                "draft token {index} = {token} is outside the vocabulary of size {vocab_size}"
            ),
            ProposalFault::QShape { expected, actual } => write!(
                f,
                "q must be [k, q_vocab] with 0 < q_vocab <= vocab: expected {expected} elements, got {actual}"
            ),
            ProposalFault::Tree(t) => write!(f, "{t}"),
            ProposalFault::TreeNotRequested => {
                write!(f, "a branching tree where the loop asked for a chain")
            }
        }
    }
}

/// `Ok` when `secs` (a time in seconds for the config field `field`) is finite and `>= 0`, else
/// [`Error::InvalidConfig`]. Used by the fixed cost sources of the decoding loop and of the
/// merged proposer.
pub(crate) fn check_secs(field: &'static str, secs: f64) -> Result<()> {
    if secs.is_finite() && secs >= 0.0 {
        Ok(())
    } else {
        Err(Error::config(
            field,
            secs,
            "must be finite and >= 0 (seconds)",
        ))
    }
}

impl Error {
    /// Wraps any error from a model adapter as [`Error::Model`].
    pub fn model<E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>>(e: E) -> Self {
        Error::Model(e.into())
    }

    /// Wraps any error from a proposer as [`Error::Proposer`].
    pub fn proposer<E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>>(e: E) -> Self {
        Error::Proposer(e.into())
    }

    pub(crate) fn config(
        field: &'static str,
        value: impl fmt::Display,
        reason: &'static str,
    ) -> Self {
        Error::InvalidConfig {
            field,
            value: value.to_string(),
            reason,
        }
    }
}

/// Shorthand for `Result<T, speculative::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
