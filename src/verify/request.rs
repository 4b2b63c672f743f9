//! [`VerifyRequest`]: one sequence's verify input, its constructor and builder setters, and the
//! shape facts the verifier derives from it (number of drafts, target rows, ending nodes).

use super::DraftQ;
#[cfg(doc)]
use super::{RowCandidates, StepEnd, StepOutput};
use crate::sampling::{Logit, SamplingConfig};
use crate::tree::{DraftBlock, SiblingScheme};

/// One verify request: one sequence, `k >= 0` drafts.
///
/// The target logits are in dtype `L` and the draft q rows in dtype `Q`, each any [`Logit`]
/// (`f32` by default; `half::f16` and `half::bf16` with the cargo feature `half`). Values are
/// widened to `f32` exactly as they are read, so the outcome (tokens, log-probabilities,
/// errors) is the one of the same request with its rows converted to `f32`, without that
/// conversion pass. From an `ndarray` view: [`VerifyRequest::from_array`].
#[derive(Debug, Clone, Copy)]
pub struct VerifyRequest<'a, L = f32, Q = f32> {
    /// Sampling configuration; the same one the proposer used.
    pub config: &'a SamplingConfig,
    /// Target logits `[k + 1, vocab_size]` row-major (row 0 after the last context token, row
    /// `i + 1` after draft `i`), `[k, vocab_size]` with [`VerifyRequest::final_draft_ends`].
    pub target_logits: &'a [L],
    /// Width of a target row, in tokens.
    pub vocab_size: usize,
    /// Draft tokens `d_1 .. d_k`: a chain, or the nodes of a tree in topological order
    /// ([`VerifyRequest::parents`]).
    pub draft_tokens: &'a [u32],
    /// The draft probabilities q: point masses, or one `[draft_vocab]` row per draft.
    pub draft_probs: DraftQ<'a, Q>,
    /// Tokens before the block (prompt + generated), for penalties and masks. May be empty when
    /// neither is used.
    pub context: &'a [u32],
    /// Seed of the request's random stream.
    pub seed: u64,
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
    /// `true` when accepting the final draft token ends the sequence (it is an EOS or completes a
    /// stop). Then nothing after it is processed: `target_logits` holds `k` rows, not `k + 1`
    /// (no row follows the end), and a step that accepts every draft ends with
    /// [`StepEnd::Ended`] and no bonus token. Requires `k >= 1` and a chain.
    pub final_draft_ends: bool,
    /// Parent row of each draft node (`[k]`; see [`crate::tree`]), or `None` for a chain. With
    /// it the drafts form a token tree: `target_logits` is `[k + 1, vocab]` (row 0 after the
    /// root, row `i + 1` after node `i`), node `i` is checked against row `parents[i]`, and
    /// q (when given) has one row per node, the distribution of the node's sibling group.
    pub parents: Option<&'a [u32]>,
    /// Sibling scheme of each node's group (`[k]`), or `None` for the default of the draft form
    /// ([`crate::TreeLimits::default_scheme`]).
    pub schemes: Option<&'a [SiblingScheme]>,
    /// Per node (`[k]`, or empty for none): `true` when accepting the node ends the sequence
    /// (an EOS, or it completes a stop). An ending node must be a leaf; its row is not read, and
    /// a step that accepts it ends with [`StepEnd::Ended`] and no bonus token. Unlike
    /// [`VerifyRequest::final_draft_ends`] it does not change the number of target rows.
    pub ends: &'a [bool],
    /// How many best tokens of each target row to report in [`StepOutput::row_top`] (0, the
    /// default: none, and no extra work). With `n > 0` every target row is processed once more
    /// for its `n` best ids (see [`RowCandidates`]); the verification itself is unchanged.
    /// Any `n` is valid: a row never lists more than its allowed tokens (`usize::MAX` lists
    /// them all). Cost: per row, a scan of `[vocab]` plus a sort of `min(n, vocab)` ids, and
    /// the row's path history (penalties and masks); a tree pays it for every node, rejected
    /// ones included.
    pub row_top_k: usize,
}

impl<'a, L: Logit> VerifyRequest<'a, L> {
    /// A request with point-mass drafts, empty context, seed 0 and position 0. In a decoding loop
    /// set [`VerifyRequest::context`] or [`VerifyRequest::position`] at every step (see
    /// [`VerifyRequest::position`] field docs).
    ///
    /// `target_logits` is `[k + 1, vocab_size]` row-major, in any [`Logit`] dtype.
    pub fn new(
        config: &'a SamplingConfig,
        target_logits: &'a [L],
        vocab_size: usize,
        draft_tokens: &'a [u32],
    ) -> Self {
        VerifyRequest {
            config,
            target_logits,
            vocab_size,
            draft_tokens,
            draft_probs: DraftQ::PointMass,
            context: &[],
            seed: 0,
            position: None,
            prompt_len: 0,
            suppress: &[],
            suppress_rows: 0,
            final_draft_ends: false,
            parents: None,
            schemes: None,
            ends: &[],
            row_top_k: 0,
        }
    }
}

impl<'a, L: Logit, Q: Logit> VerifyRequest<'a, L, Q> {
    /// Sets the draft probabilities. Their dtype `R` may differ from the target's: the request
    /// becomes a `VerifyRequest<'a, L, R>`.
    pub fn draft_probs<R: Logit>(self, q: DraftQ<'a, R>) -> VerifyRequest<'a, L, R> {
        VerifyRequest {
            config: self.config,
            target_logits: self.target_logits,
            vocab_size: self.vocab_size,
            draft_tokens: self.draft_tokens,
            draft_probs: q,
            context: self.context,
            seed: self.seed,
            position: self.position,
            prompt_len: self.prompt_len,
            suppress: self.suppress,
            suppress_rows: self.suppress_rows,
            final_draft_ends: self.final_draft_ends,
            parents: self.parents,
            schemes: self.schemes,
            ends: self.ends,
            row_top_k: self.row_top_k,
        }
    }

    /// Asks for the `n` best ids of every target row in [`StepOutput::row_top`] (see
    /// [`VerifyRequest::row_top_k`]).
    pub fn row_top(mut self, n: usize) -> Self {
        self.row_top_k = n;
        self
    }

    /// Makes the drafts a token tree with parent rows `parents` (`[k]`; see
    /// [`VerifyRequest::parents`]).
    pub fn tree(mut self, parents: &'a [u32]) -> Self {
        self.parents = Some(parents);
        self
    }

    /// Sets the sibling scheme of each node's group (see [`VerifyRequest::schemes`]).
    pub fn schemes(mut self, schemes: &'a [SiblingScheme]) -> Self {
        self.schemes = Some(schemes);
        self
    }

    /// Marks the nodes whose acceptance ends the sequence (see [`VerifyRequest::ends`]).
    pub fn node_ends(mut self, ends: &'a [bool]) -> Self {
        self.ends = ends;
        self
    }

    /// The drafts' shape: the chain `draft_tokens`, or the tree with [`VerifyRequest::parents`].
    pub fn block(&self) -> DraftBlock<'a> {
        let b = match self.parents {
            None => DraftBlock::chain(self.draft_tokens),
            Some(p) => DraftBlock::tree(self.draft_tokens, p),
        };
        match self.schemes {
            None => b,
            Some(s) => b.with_schemes(s),
        }
    }

    /// Sets the context (prompt + generated tokens before the block).
    pub fn context(mut self, context: &'a [u32]) -> Self {
        self.context = context;
        self
    }

    /// Sets the seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets the absolute position of the first emitted token.
    pub fn position(mut self, position: u64) -> Self {
        self.position = Some(position);
        self
    }

    /// Sets the prompt length within the context (see [`VerifyRequest::prompt_len`]).
    pub fn prompt_len(mut self, prompt_len: usize) -> Self {
        self.prompt_len = prompt_len;
        self
    }

    /// Bans `tokens` at rows `0..rows` only (see [`VerifyRequest::suppress`]).
    pub fn suppress(mut self, tokens: &'a [u32], rows: usize) -> Self {
        self.suppress = tokens;
        self.suppress_rows = rows;
        self
    }

    /// Marks the final draft token as an end (see [`VerifyRequest::final_draft_ends`]).
    pub fn final_draft_ends(mut self, ends: bool) -> Self {
        self.final_draft_ends = ends;
        self
    }

    /// Number of drafts `k`.
    pub(super) fn k(&self) -> usize {
        self.draft_tokens.len()
    }

    /// `true` when accepting node `j` ends the sequence ([`VerifyRequest::ends`], or the final
    /// node with [`VerifyRequest::final_draft_ends`]).
    pub(super) fn ends_at(&self, j: usize) -> bool {
        self.ends.get(j).copied().unwrap_or(false) || (self.final_draft_ends && j + 1 == self.k())
    }

    /// Number of target rows: `k + 1`, or `k` when the final draft ends the sequence.
    pub(super) fn target_rows(&self) -> usize {
        self.k() + 1 - self.final_draft_ends as usize
    }
}
