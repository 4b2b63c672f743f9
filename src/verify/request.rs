//! [`VerifyRequest`] and [`SequenceState`]: one sequence's verify input, its constructor and
//! builder setters, and the shape facts the verifier derives from it (number of drafts, target
//! rows, ending nodes).

use super::DraftQ;
#[cfg(doc)]
use super::{RowCandidates, SequenceParams, StepEnd, StepOutput};
use crate::sampling::{Logit, SamplingConfig};
use crate::tree::DraftBlock;

/// What a verify step reads of one sequence besides its rows: the sampling configuration, the
/// random stream (seed and position), the context the penalties and masks see, and the
/// per-step asks (suppressed ids, row candidates).
///
/// Embedded as `state` in both [`VerifyRequest`] (one sequence) and [`SequenceParams`] (one
/// sequence of a batch), so a sequence is described the same way alone and in a batch. Build
/// one with [`SequenceState::new`] and the setters below; the same setters exist on
/// [`VerifyRequest`] and [`SequenceParams`], where they set the embedded state.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct SequenceState<'a> {
    /// Sampling configuration; the same one the proposer used.
    pub config: &'a SamplingConfig,
    /// Seed of the sequence's random stream.
    pub seed: u64,
    /// Tokens before the block (prompt + generated), for penalties and masks. May be empty when
    /// neither is used.
    pub context: &'a [u32],
    /// Absolute position of the token emitted at row 0 (keys the random stream). `None` means
    /// `context.len()`. **It must advance from step to step** (set the context or the position):
    /// draws are keyed by `(seed, position)`, so a position left at 0 reuses the same uniforms at
    /// every step, and consecutive steps are no longer independent.
    pub position: Option<u64>,
    /// Number of leading `context` tokens that are the prompt. Frequency and presence penalties
    /// count only the tokens after it (with [`crate::sampling::PenaltyScope::Generated`], the
    /// default); the repetition penalty counts all. 0 (the default) counts the whole context as
    /// generated.
    pub prompt_len: usize,
    /// Tokens banned at rows `0..suppress_rows` only (`min_tokens`: the EOS ids while fewer than
    /// `min_tokens` tokens have been generated). Empty by default. For a tree, "row `i`" means
    /// every row at depth `i` (the root's row is depth 0): the rows of a chain.
    pub suppress: &'a [u32],
    /// Number of leading rows (depths, for a tree) at which `suppress` applies.
    pub suppress_rows: usize,
    /// How many best tokens of each target row to report in [`StepOutput::row_top`] (0, the
    /// default: none, and no extra work). With `n > 0` every target row is processed once more
    /// for its `n` best ids (see [`RowCandidates`]); the verification itself is unchanged.
    /// Any `n` is valid: a row never lists more than its allowed tokens (`usize::MAX` lists
    /// them all). Cost: per row, a scan of `[vocab]` plus a sort of `min(n, vocab)` ids, and
    /// the row's path history (penalties and masks); a tree pays it for every node, rejected
    /// ones included. Only [`crate::Verifier::verify`] computes them (see
    /// [`StepOutput::row_top`]).
    pub row_top_k: usize,
}

impl<'a> SequenceState<'a> {
    /// The state of a sequence with configuration `config`: seed 0, empty context,
    /// `position = None` (the context's length), no prompt split, no suppression, no row
    /// candidates.
    pub fn new(config: &'a SamplingConfig) -> Self {
        SequenceState {
            config,
            seed: 0,
            context: &[],
            position: None,
            prompt_len: 0,
            suppress: &[],
            suppress_rows: 0,
            row_top_k: 0,
        }
    }

    /// Sets the seed ([`SequenceState::seed`]).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets the context, prompt + generated tokens before the block
    /// ([`SequenceState::context`]).
    pub fn context(mut self, context: &'a [u32]) -> Self {
        self.context = context;
        self
    }

    /// Sets the absolute position of the first emitted token ([`SequenceState::position`]).
    pub fn position(mut self, position: u64) -> Self {
        self.position = Some(position);
        self
    }

    /// Sets the prompt length within the context ([`SequenceState::prompt_len`]).
    pub fn prompt_len(mut self, prompt_len: usize) -> Self {
        self.prompt_len = prompt_len;
        self
    }

    /// Bans `tokens` at rows `0..rows` only ([`SequenceState::suppress`]).
    pub fn suppress(mut self, tokens: &'a [u32], rows: usize) -> Self {
        self.suppress = tokens;
        self.suppress_rows = rows;
        self
    }

    /// Asks for the `n` best ids of every target row ([`SequenceState::row_top_k`]).
    pub fn row_top_k(mut self, n: usize) -> Self {
        self.row_top_k = n;
        self
    }
}

impl<'a> From<&'a SamplingConfig> for SequenceState<'a> {
    /// [`SequenceState::new`].
    fn from(config: &'a SamplingConfig) -> Self {
        SequenceState::new(config)
    }
}

/// The setters of [`SequenceState`] on a type that embeds one as `self.state`: written once
/// here, so that [`VerifyRequest`] and [`SequenceParams`] set the state exactly as
/// [`SequenceState`]'s own setters do.
macro_rules! sequence_state_setters {
    () => {
        /// Replaces the whole sequence state ([`SequenceState`](crate::verify::SequenceState)).
        pub fn state(mut self, state: $crate::verify::SequenceState<'a>) -> Self {
            self.state = state;
            self
        }

        /// Sets the seed ([`SequenceState::seed`](crate::verify::SequenceState::seed)).
        pub fn seed(mut self, seed: u64) -> Self {
            self.state = self.state.seed(seed);
            self
        }

        /// Sets the context, prompt + generated tokens before the block
        /// ([`SequenceState::context`](crate::verify::SequenceState::context)).
        pub fn context(mut self, context: &'a [u32]) -> Self {
            self.state = self.state.context(context);
            self
        }

        /// Sets the absolute position of the first emitted token
        /// ([`SequenceState::position`](crate::verify::SequenceState::position)).
        pub fn position(mut self, position: u64) -> Self {
            self.state = self.state.position(position);
            self
        }

        /// Sets the prompt length within the context
        /// ([`SequenceState::prompt_len`](crate::verify::SequenceState::prompt_len)).
        pub fn prompt_len(mut self, prompt_len: usize) -> Self {
            self.state = self.state.prompt_len(prompt_len);
            self
        }

        /// Bans `tokens` at rows `0..rows` only
        /// ([`SequenceState::suppress`](crate::verify::SequenceState::suppress)).
        pub fn suppress(mut self, tokens: &'a [u32], rows: usize) -> Self {
            self.state = self.state.suppress(tokens, rows);
            self
        }

        /// Asks for the `n` best ids of every target row
        /// ([`SequenceState::row_top_k`](crate::verify::SequenceState::row_top_k)).
        pub fn row_top_k(mut self, n: usize) -> Self {
            self.state = self.state.row_top_k(n);
            self
        }
    };
}
pub(super) use sequence_state_setters;

/// One verify request: one sequence, `k >= 0` drafts.
///
/// The drafts are a [`DraftBlock`]: a chain, or a token tree with sibling schemes, and the
/// nodes whose acceptance ends the sequence ([`DraftBlock::with_ends`]). The target logits are
/// `[k + 1, vocab_size]` row-major (row 0 after the last context token, row `i + 1` after
/// node `i`), or `[k, vocab_size]` for a chain whose final draft ends the sequence (no row
/// follows the end, case C11; [`DraftBlock::verify_rows`]).
///
/// The target logits are in dtype `L` and the draft q rows in dtype `Q`, each any [`Logit`]
/// (`f32` by default; `half::f16` and `half::bf16` with the cargo feature `half`). Values are
/// widened to `f32` exactly as they are read, so the outcome (tokens, log-probabilities,
/// errors) is the one of the same request with its rows converted to `f32`, without that
/// conversion pass. From an `ndarray` view: [`VerifyRequest::from_array`].
///
/// Build one with [`VerifyRequest::new`] and the setters; the fields are public to read and
/// the type is `#[non_exhaustive]`, so new fields are not a breaking change.
///
/// ```
/// use speculative::{DraftBlock, SamplingConfig, VerifyRequest};
///
/// let cfg = SamplingConfig::greedy();
/// let logits = [0.0f32; 3 * 4];
/// let (tokens, parents) = ([1, 2], [0, 0]);
/// // Two siblings under the root; the second one ends the sequence.
/// let req = VerifyRequest::new(&cfg, &logits, 4, &tokens)
///     .draft(DraftBlock::tree(&tokens, &parents).with_ends(&[false, true]))
///     .context(&[3, 1])
///     .seed(7);
/// assert_eq!(req.draft.verify_rows(), 3);
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct VerifyRequest<'a, L = f32, Q = f32> {
    /// The sequence: configuration, seed, position, context, suppression, row candidates.
    pub state: SequenceState<'a>,
    /// Target logits `[k + 1, vocab_size]` row-major (row 0 after the last context token, row
    /// `i + 1` after node `i`), `[k, vocab_size]` for a chain whose final draft ends
    /// ([`DraftBlock::verify_rows`]).
    pub target_logits: &'a [L],
    /// Width of a target row, in tokens.
    pub vocab_size: usize,
    /// The drafts `d_1 .. d_k`: a chain, or the nodes of a tree in topological order (node `i`
    /// is checked against row [`DraftBlock::parent_row`]`(i)`), with their sibling schemes
    /// (default: that of the draft form, [`crate::TreeLimits::default_scheme`]) and ending
    /// nodes. q (when given) has one row per node, the distribution of the node's sibling
    /// group.
    pub draft: DraftBlock<'a>,
    /// The draft probabilities q: point masses, or one `[draft_vocab]` row per draft.
    pub draft_probs: DraftQ<'a, Q>,
}

impl<'a, L: Logit> VerifyRequest<'a, L> {
    /// A request with the chain `draft_tokens` of point-mass drafts and the state
    /// [`SequenceState::new`]`(config)` (empty context, seed 0, position `None`). In a decoding
    /// loop set the context or the position at every step (see [`SequenceState::position`]).
    ///
    /// `target_logits` is `[k + 1, vocab_size]` row-major, in any [`Logit`] dtype.
    pub fn new(
        config: &'a SamplingConfig,
        target_logits: &'a [L],
        vocab_size: usize,
        draft_tokens: &'a [u32],
    ) -> Self {
        VerifyRequest {
            state: SequenceState::new(config),
            target_logits,
            vocab_size,
            draft: DraftBlock::chain(draft_tokens),
            draft_probs: DraftQ::PointMass,
        }
    }
}

impl<'a, L: Logit, Q: Logit> VerifyRequest<'a, L, Q> {
    /// Sets the draft probabilities. Their dtype `R` may differ from the target's: the request
    /// becomes a `VerifyRequest<'a, L, R>`.
    pub fn draft_probs<R: Logit>(self, q: DraftQ<'a, R>) -> VerifyRequest<'a, L, R> {
        VerifyRequest {
            state: self.state,
            target_logits: self.target_logits,
            vocab_size: self.vocab_size,
            draft: self.draft,
            draft_probs: q,
        }
    }

    /// Sets the drafts: a chain or a tree, with its schemes and ending nodes
    /// ([`VerifyRequest::draft`]).
    pub fn draft(mut self, draft: DraftBlock<'a>) -> Self {
        self.draft = draft;
        self
    }

    sequence_state_setters!();
}

impl<L, Q> VerifyRequest<'_, L, Q> {
    /// Number of drafts `k`.
    pub(super) fn k(&self) -> usize {
        self.draft.len()
    }

    /// `true` when accepting node `j` ends the sequence ([`DraftBlock::ends_at`]).
    pub(super) fn ends_at(&self, j: usize) -> bool {
        self.draft.ends_at(j)
    }

    /// Number of target rows ([`DraftBlock::verify_rows`]).
    pub(super) fn target_rows(&self) -> usize {
        self.draft.verify_rows()
    }
}
