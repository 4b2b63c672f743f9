//! Verification: accept the longest valid prefix of a draft and emit one more token.
//!
//! Given the target logits of one verify forward over `[last token, d_1 .. d_k]` (shape
//! `[k + 1, vocab]`, row `i` predicts the token after `d_i`, row 0 the token after the last
//! context token), the verifier returns the accepted drafts plus one corrected or bonus token.
//!
//! - **Greedy** (temperature 0): accept `d_i` while it equals the argmax of processed target row
//!   `i`; at the first mismatch emit that argmax; if all `k` are accepted emit the argmax of row
//!   `k` (the bonus token). Ties go to the lowest id. No softmax, no random draw.
//! - **Stochastic** (speculative sampling, Leviathan, Kalman & Matias 2023, section 2.3 and
//!   appendix A.1; Chen et al. 2023, algorithm 2): accept `d_i` with probability
//!   `min(1, p(d_i) / q(d_i))`; at the first rejection emit a sample of the residual distribution
//!   `normalise(max(0, p - q))`; after `k` acceptances emit a bonus token sampled from row `k`.
//!   `p` is the processed target row, `q` the distribution the draft was really sampled from.
//!   A proposer without `q` (prompt lookup, suffix) is a point mass: the verifier draws the
//!   position's token `t` from `p` with the uniform keyed by `(seed, position)` (inverse CDF in
//!   token-id order, exactly as plain sampling draws it) and accepts `d_i` iff `t == d_i`. That
//!   accepts with probability `p(d_i)` and on rejection emits a draw of `p` with `d_i` removed,
//!   renormalised, which is the optimal rule for a point mass; and because the emitted token is
//!   the one plain sampling with the same seed would emit at that position, **seeded output is
//!   reproducible**: the same seed, prompt and configuration give the same tokens with any
//!   point-mass proposer, any draft length, any draft-length policy, and no proposer at all
//!   (case C15).
//!
//! ## What a seed reproduces with dense q
//!
//! With a sampling draft (q given as probabilities or draft logits) the acceptance test uses its
//! own uniform (lane [`crate::rng::lane::ACCEPT`]) and the residual draw another. The emitted
//! sequence still has the target's law, and the same seed, prompt, configuration, proposer and
//! draft lengths give the same tokens, but the tokens change when the draft or its length
//! changes. No rule can do better in general: making the emitted token a fixed function of the
//! seed and `p` alone forces acceptance to depend on `q` only through the event "draft equals the
//! token plain sampling would draw", whose probability `sum_x min(p(x), q(x))` is reached only by
//! coupling the draft's own draw to the target's, which a draft sampled before `p` is known
//! cannot do.
//!
//! ## Trees
//!
//! With [`VerifyRequest::parents`] the `k` drafts are the nodes of a token tree (row convention
//! in [`crate::tree`]: node `i` is checked against row `parents[i]`, one forward gives
//! `[k + 1, vocab]` rows, row 0 after the root). The verifier walks down from the root. At row
//! `r`, at depth `d` (the number of nodes accepted so far), it processes target row `r` with the
//! history "context + tokens of the path to `r`" (the committed context and the node's
//! ancestors, never another branch) and decides among the children of `r`, its **sibling
//! group** (in node order), by the group's [`SiblingScheme`]. Accepting node `j` moves to row
//! `j + 1`; a node marked in [`VerifyRequest::ends`] stops the step there
//! ([`StepEnd::Ended`], no bonus token, its row is not read); at a leaf the leaf's own row gives
//! the bonus token; when a group rejects every sibling the step emits a token of the group's
//! final residual and stops. Random draws use the uniforms keyed by `(seed, position + d)`, so a
//! sequence's result depends only on its own tree, seed and position. A chain is the tree whose
//! groups have one node each: the same walk verifies it, with exactly the draws and arithmetic
//! of the chain rules above.
//!
//! The rules, with `p` the processed target row, `x_0 .. x_{m-1}` the group's tokens and
//! `norm(w) = w / sum(w)`:
//!
//! - **Greedy**: descend into the first child equal to the argmax of `p`, else emit the argmax.
//!   Every emitted token is the argmax at its prefix: the output is plain greedy decoding's.
//! - [`SiblingScheme::Deterministic`] (point masses: every group of a point-mass request, and
//!   the groups of a dense-q request marked deterministic, whose q rows are not read): draw
//!   `t ~ p` with the position's sampling uniform (lane [`crate::rng::lane::SAMPLE`], inverse
//!   CDF in id order, as plain sampling draws), descend into the child that carries `t`, else
//!   emit `t`.
//! - [`SiblingScheme::WithReplacement`] (SpecInfer's multi-step speculative sampling, Miao et
//!   al. 2024, "SpecInfer", algorithm 2): `p_0 = p`; sibling `j` is accepted with probability
//!   `min(1, p_j(x_j) / q(x_j))` on the uniform of lane
//!   [`crate::rng::lane::sibling_accept`]`(j)` (the chain's lane `ACCEPT` for `j = 0`); on
//!   rejection `p_{j+1} = norm(max(0, p_j - q))`. All rejected: sample `p_m` (lane `SAMPLE`).
//! - [`SiblingScheme::WithoutReplacement`] (recursive rejection sampling, Jeon et al. 2024,
//!   "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without
//!   Replacement"): as above with `q_j` in place of `q`, where
//!   `q_0 = q` and `q_j` is `q` without `x_0 .. x_{j-1}`, renormalised (divided by q's total
//!   minus their mass): accept with `min(1, p_j(x_j) / q_j(x_j))`, on rejection
//!   `p_{j+1} = norm(max(0, p_j - q_j))`.
//!
//! If a residual has no mass (`p_j = q_j` up to rounding, where rejection has probability 0 in
//! exact arithmetic), `p_j` itself is sampled, as the chain rule does.
//!
//! **Proofs.** *Lemma (one sibling).* Let `x` have law `q` given everything decided before it at
//! this row, let the acceptance uniform be independent of `x`, and let a rejection lead to an
//! emitted token whose law, given the past, `x` and the rejection, is
//! `r = norm(max(0, p - q))`, not depending on `x`. Then
//! `P(emit y) = q(y) min(1, p(y)/q(y)) + sum_x q(x) (1 - min(1, p(x)/q(x))) r(y)
//! = min(p(y), q(y)) + Z r(y) = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y)`, with
//! `Z = sum_x max(0, p(x) - q(x))` (Leviathan et al. 2023, appendix A.1; `Z = 0` means `p = q`,
//! and rejection has probability 0).
//!
//! *A group of `m` siblings emits a token of law `p`*, by induction on `m`: with no sibling the
//! step samples `p`. With `m >= 1`, apply the lemma to sibling 0 with target `p_0 = p` and its
//! law `q_0`; after a rejection the rest of the group is the same procedure on `m - 1` siblings
//! with target `p_1`, which emits a token of law `p_1` by induction, provided the remaining
//! siblings have, given the past, the laws the procedure assumes, and `p_1` does not depend on
//! `x_0`:
//! - with replacement, `x_1, ..` are independent of `x_0` with law `q`, and
//!   `p_1 = norm(max(0, p - q))` involves `q` only;
//! - without replacement, given `x_0 .. x_j` the next sibling has law `q_{j+1}` (q without them,
//!   renormalised), exactly the law the procedure uses next, and
//!   `p_{j+1} = norm(max(0, p_j - q_j))` depends on the earlier siblings through `q_j` but not
//!   on `x_j` (the argument of Jeon et al. 2024 for recursive rejection sampling);
//! - deterministic siblings are the case `q_j = δ(x_j)`: acceptance `min(1, p_j(x_j))` =
//!   `p_j(x_j)`, residual `p_j` without `x_j`, renormalised, so
//!   `p_j(x) = p(x) / (1 - S_j)` with `S_j = p(x_0) + .. + p(x_{j-1})`. That sequential rule
//!   accepts `x_j` with probability `prod_{i<j} (1 - p_i(x_i)) · p_j(x_j)`
//!   `= prod_{i<j} ((1 - S_{i+1}) / (1 - S_i)) · p(x_j) / (1 - S_j) = p(x_j)` (telescoping),
//!   and when it rejects all emits a draw of `p` without the siblings, renormalised. The single draw `t ~ p` gives the same: `P(t = x_j) = p(x_j)`, and given that
//!   `t` is no sibling, `t` has law `p` without the siblings. So both rules have the same law
//!   of (accepted node, emitted token); the draw's `t` is moreover the token plain sampling
//!   emits with the same seed and position, so **seeded output is reproducible for any
//!   point-mass tree**, as for chains (case C15).
//!
//! *The whole tree.* At every row the emitted token (the accepted child's, or the final draw)
//! has the law of the processed target at that prefix. The subtree below an accepted node was
//! drafted given that node's path only, with draws independent of the verifier's uniforms
//! (other lanes), so the next row is again a sibling group in the situation of the lemma; by
//! the chain rule of probability the emitted sequence has the law of plain sampling from the
//! processed target. A step that stops at an ending node stops where plain decoding stops.
//!
//! ## Input forms
//!
//! - Dtypes: target logits and draft q rows are slices of any [`Logit`] (`f32`; `half::f16` and
//!   `half::bf16` with the cargo feature `half`), each widened to `f32` exactly as it is read, so
//!   the outcome is the one of the rows converted to `f32` first, without that pass
//!   ([`VerifyRequest`], [`DraftQ`]).
//! - `ndarray`: `ArrayView2` of `[rows, width]` in standard layout, read in place
//!   ([`VerifyRequest::from_array`], [`VerifyBatch::from_array`], [`DraftQ::probs_array`]);
//!   other strides are refused with [`Error::NonContiguous`] ([`array_rows`]).
//! - Batches: one draft form for the batch, or each sequence its own
//!   ([`SequenceParams::draft_probs`]).
//!
//! ## Validation
//!
//! Everything a step checks on its input is checked for the whole input before any random draw,
//! so whether a request is rejected never depends on the seed (case C14): shapes, every draft
//! token against the target vocabulary and (dense q) the draft vocabulary, every q row (finite,
//! non-negative, sums to 1 within 1e-3, gives its own draft token probability > 0, in greedy
//! mode too), every draft-logit row (processed with its history; its draft token must have
//! probability > 0) and every raw target logit (no NaN or `+inf`). For a tree also its structure
//! ([`DraftBlock::validate`]: parents before children, schemes, distinct deterministic and
//! without-replacement siblings, sampled schemes only with dense q; [`Error::InvalidTree`]),
//! [`VerifyRequest::ends`] (empty or `[k]`, ending nodes are leaves), and that the siblings of
//! every sampled group carry identical q rows (the group's q; [`Error::InvalidDraftProbs`]).
//! The q rows of deterministic groups are not read, and not checked. Only [`Error::NoAllowedToken`]
//! for a target row is reported when that row is processed: whether a row is reached is part of
//! the step's outcome (a row after a draft token that the mask forbids can legitimately allow
//! nothing).
//!
//! Every emitted token is distributed exactly as plain sampling from the processed target
//! (the losslessness theorem of both papers); in greedy mode the tokens are identical to plain
//! greedy decoding. Random draws come from [`crate::rng::Stream`] keyed by the request's seed and
//! the absolute position of the token, so results never depend on batch order or composition.

mod array;
mod batch;
pub(crate) use batch::{check_layout, check_tree_layout, sequence_request};
pub mod exact;
mod greedy;
mod stochastic;
#[cfg(test)]
mod tree_tests;

pub use array::array_rows;
pub use batch::{SequenceParams, VerifyBatch};

use crate::error::{Error, Result, RowKind};
use crate::sampling::{BlockHistory, Logit, RowProcessor, SamplingConfig, TokenDist};
use crate::tree::{DraftBlock, SiblingScheme, TreeFault, TreeLimits};

/// The draft probabilities q handed to the verifier, with their rows in dtype `Q` (any
/// [`Logit`]: `f32`, or `half::f16` / `half::bf16` with the cargo feature `half`), which may
/// differ from the target logits' dtype.
///
/// [`DraftProbs`] is this type over `f32`, the name most code uses; writing
/// `DraftProbs::PointMass` (rather than `DraftQ::PointMass`) also tells type inference that a
/// point-mass request has no q dtype to choose. Values are widened to `f32` exactly as they are
/// read: results equal those of the rows converted to `f32` first. From an `ndarray` view:
/// [`DraftQ::probs_array`], [`DraftQ::logits_array`].
///
/// Probabilities in a half type keep 11 (`f16`) or 8 (`bf16`) significant bits, so a row of
/// them can miss the 1e-3 tolerance on its total ([`Error::InvalidDraftProbs`], as the same
/// values in `f32` would): a half-precision draft model should hand over its draft logits
/// ([`DraftQ::Logits`], processed by the verifier in `f32`) or `f32` probabilities.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum DraftQ<'a, Q = f32> {
    /// Deterministic proposer (prompt lookup, suffix): each draft token is a point mass.
    PointMass,
    /// Probabilities the drafts were sampled from, `[k, vocab]` row-major, already processed
    /// (the proposer applied the request's [`SamplingConfig`]). `vocab` may be smaller than the
    /// target's (padded embeddings): missing entries are probability 0. In a tree, row `i` is
    /// the q node `i` was drawn from (its sibling group's q: siblings of a sampled group carry
    /// identical rows); rows of deterministic groups are not read.
    Probs {
        /// `[k, vocab]` probabilities.
        probs: &'a [Q],
        /// Width of a row, in tokens.
        vocab: usize,
    },
    /// Raw draft-model logits `[k, vocab]`. The verifier processes row `i` with the request's
    /// configuration and the same history as the target row that checks draft `i` (the context
    /// plus drafts `0..i` in a chain; the context plus node `i`'s ancestors in a tree, without
    /// node `i` itself); the proposer must have sampled `d_i` from exactly that processed
    /// distribution. Siblings of a sampled tree group carry identical rows; rows of
    /// deterministic groups are not read.
    Logits {
        /// `[k, vocab]` logits.
        logits: &'a [Q],
        /// Width of a row, in tokens.
        vocab: usize,
    },
}

/// The draft probabilities q as `f32` rows: [`DraftQ`] over `f32`.
pub type DraftProbs<'a> = DraftQ<'a, f32>;

/// One draft row's q, as used by the acceptance rule and the residual. Dense rows are in dtype
/// `Q` (any [`Logit`], default `f32`).
#[derive(Debug, Clone, Copy)]
pub enum DraftRow<'a, Q = f32> {
    /// q is a point mass on the draft token.
    PointMass,
    /// Dense probabilities `[q_vocab]`; entries beyond the slice are 0.
    Dense(&'a [Q]),
    /// A processed draft distribution.
    Dist(&'a TokenDist),
}

impl<Q: Logit> DraftRow<'_, Q> {
    /// `q(token)`, where `draft` is the drafted token (needed for the point mass).
    #[inline]
    pub fn prob(&self, token: u32, draft: u32) -> f32 {
        match self {
            DraftRow::PointMass => (token == draft) as u8 as f32,
            DraftRow::Dense(q) => q.get(token as usize).map_or(0.0, |x| x.widen()),
            DraftRow::Dist(d) => d.prob(token),
        }
    }
}

/// The acceptance probability `min(1, p(x) / q(x))` of a draft token (Leviathan et al. 2023,
/// section 2.3). `q(x) > 0` is required (the caller checks it).
#[inline]
pub fn acceptance_probability(p_x: f32, q_x: f32) -> f64 {
    (p_x as f64 / q_x as f64).min(1.0)
}

/// Residual weights `max(0, p(v) - q(v))` over the support of `p`, in id order, unnormalised.
/// Written into `out` as `(token, weight)`; returns the total weight (f64).
pub fn residual_weights(
    p: &TokenDist,
    q: &DraftRow<'_>,
    draft: u32,
    out: &mut Vec<(u32, f64)>,
) -> f64 {
    residual_weights_of(p, q, draft, out)
}

/// [`residual_weights`] for a q row of any dtype.
pub(crate) fn residual_weights_of<Q: Logit>(
    p: &TokenDist,
    q: &DraftRow<'_, Q>,
    draft: u32,
    out: &mut Vec<(u32, f64)>,
) -> f64 {
    out.clear();
    let mut total = 0.0f64;
    for (&v, &pv) in p.ids().iter().zip(p.probs()) {
        let w = (pv as f64 - q.prob(v, draft) as f64).max(0.0);
        if w > 0.0 {
            out.push((v, w));
            total += w;
        }
    }
    total
}

/// Why a verify step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StepEnd {
    /// The drafts at depth `index + 1` were rejected (for a chain: draft `index`, 0-based; for
    /// a tree: every child of the last accepted node, or of the root); the last emitted token is
    /// the correction sampled from the residual (or the target argmax in greedy mode).
    /// `index == accepted`.
    Rejected {
        /// Number of accepted drafts before the rejection: the index of the rejected draft in a
        /// chain, the depth at which a tree walk stopped.
        index: usize,
    },
    /// The walk reached a leaf: for a chain all `k >= 1` drafts were accepted; the last emitted
    /// token is the bonus token from the leaf's row (row `k` for a chain).
    AllAccepted,
    /// The last accepted draft ends the sequence ([`VerifyRequest::final_draft_ends`], or a node
    /// marked in [`VerifyRequest::ends`]): no bonus token, `tokens.len() == accepted`.
    Ended,
    /// A no-draft step (`k = 0`, plain decoding): the one emitted token comes from row 0.
    NoDraft,
}

/// Log-probabilities of one emitted token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The emitted token.
    pub token: u32,
    /// Natural log-probability of `token` under the processed target row. For greedy rows (a
    /// point mass) it is taken under the softmax at temperature 1 of the logits after penalties,
    /// bias and masks, which is what users expect to see.
    pub logprob: f32,
    /// The most likely tokens of the same distribution, most likely first, as
    /// `(token, logprob)`; as many as [`SamplingConfig::logprobs`] asked for.
    pub top: Vec<(u32, f32)>,
}

/// The result of one verify step for one sequence.
///
/// `StepOutput` is `Send + Sync`.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// Number of accepted draft tokens (the leading run of a chain, the path length of a tree;
    /// the bonus token is not counted).
    pub accepted: usize,
    /// Emitted tokens: the accepted drafts (a tree's path) followed by one correction or bonus
    /// token, so `tokens.len() == accepted + 1`, except after [`StepEnd::Ended`] (an accepted
    /// draft that ends the sequence), where `tokens.len() == accepted`.
    pub tokens: Vec<u32>,
    /// Per emitted token, when the configuration asked for log-probabilities.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// Why the step ended.
    pub end: StepEnd,
    /// Node indices of the accepted drafts, the root's child first (`[accepted]`): for a chain
    /// `0..accepted`; for a tree the accepted path, which a target with tree support keeps
    /// ([`crate::TreeTarget::commit_tree`]).
    pub path: Vec<u32>,
    /// The best tokens of every target row of the step, when the request asked for them
    /// ([`VerifyRequest::row_top_k`]); empty otherwise. Only [`Verifier::verify`] computes
    /// them: batch verification ([`Verifier::verify_batch`], the GPU verifiers) has no
    /// `row_top_k` and always leaves this empty; an engine that batches and feeds a proposer
    /// such as [`crate::propose::TokenRecycling`] verifies that sequence with
    /// [`Verifier::verify`] and [`VerifyRequest::row_top`].
    pub row_top: RowCandidates,
}

/// The best tokens of each target row of one verify step: row 0 is the root's (its input is
/// the last committed token), row `j + 1` node `j`'s (its input is draft token `j`), so a
/// step has `k + 1` rows (`k` when the final draft of a chain ends the sequence, whose row is
/// never computed).
///
/// Each row lists up to [`VerifyRequest::row_top_k`] ids, best first, ranked by the row's
/// processed logits (the request's penalties, bias and masks along the row's own path;
/// [`crate::sampling::RowProcessor::top_ids`]): every row is processed, not only those of the
/// accepted path, so the rows of rejected nodes carry information too. A row lists fewer ids
/// when fewer tokens are allowed, and none when its mask allows none (a row off the accepted
/// path only: a row on it fails the step).
///
/// Layout: the ids of all rows in one buffer with row offsets (`[rows + 1]`), so a step
/// allocates nothing once the buffers have grown. Token Recycling (Luo et al. 2024) reads these
/// rows as "successors of the row's input token" ([`crate::Proposer::observe_rows`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowCandidates {
    ids: Vec<u32>,
    offsets: Vec<u32>,
}

impl RowCandidates {
    /// Number of rows (0 when none were asked for).
    pub fn rows(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// `true` when no row is held.
    pub fn is_empty(&self) -> bool {
        self.rows() == 0
    }

    /// The ids of row `r`, best first (empty for `r >= rows()`).
    pub fn row(&self, r: usize) -> &[u32] {
        match (self.offsets.get(r), self.offsets.get(r + 1)) {
            (Some(&a), Some(&b)) => &self.ids[a as usize..b as usize],
            _ => &[],
        }
    }

    /// Every row, row 0 first.
    pub fn iter(&self) -> impl Iterator<Item = &[u32]> + '_ {
        (0..self.rows()).map(|r| self.row(r))
    }

    /// Removes every row, keeping the allocations.
    pub fn clear(&mut self) {
        self.ids.clear();
        self.offsets.clear();
    }

    /// Appends one row (its ids, best first).
    pub fn push_row(&mut self, ids: &[u32]) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        self.ids.extend_from_slice(ids);
        self.offsets.push(self.ids.len() as u32);
    }
}

/// Number of accepted drafts given per-position acceptance flags: the length of the leading run
/// of `true`, never the count of `true` (case C06).
pub fn leading_accepted(flags: &[bool]) -> usize {
    flags.iter().take_while(|&&f| f).count()
}

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

    fn k(&self) -> usize {
        self.draft_tokens.len()
    }

    /// `true` when accepting node `j` ends the sequence ([`VerifyRequest::ends`], or the final
    /// node with [`VerifyRequest::final_draft_ends`]).
    fn ends_at(&self, j: usize) -> bool {
        self.ends.get(j).copied().unwrap_or(false) || (self.final_draft_ends && j + 1 == self.k())
    }

    /// Number of target rows: `k + 1`, or `k` when the final draft ends the sequence.
    fn target_rows(&self) -> usize {
        self.k() + 1 - self.final_draft_ends as usize
    }

    /// Checks everything that does not need processing: shapes, vocabularies, token ids, dense q
    /// rows and raw logit values, for the whole input (case C14).
    pub(crate) fn validate(&self) -> Result<()> {
        self.validate_with(true)
    }

    /// [`VerifyRequest::validate`] for target logits that live elsewhere (device memory): the
    /// same checks in the same order, without the target logits' shape and values.
    pub(crate) fn validate_inputs(&self) -> Result<()> {
        self.validate_with(false)
    }

    fn validate_with(&self, target: bool) -> Result<()> {
        let v = self.vocab_size;
        let k = self.k();
        if v == 0 {
            return Err(Error::ShapeMismatch {
                what: "vocab_size",
                expected: 1,
                actual: 0,
            });
        }
        if self.final_draft_ends && k == 0 {
            return Err(Error::ShapeMismatch {
                what: "draft_tokens (final_draft_ends needs k >= 1)",
                expected: 1,
                actual: 0,
            });
        }
        if self.final_draft_ends
            && let Some(p) = self.parents
            && !(p.len() == k && p.iter().enumerate().all(|(i, &r)| r as usize == i))
        {
            return Err(Error::config(
                "final_draft_ends",
                true,
                "a tree marks its ending leaves with `ends`; final_draft_ends is for chains",
            ));
        }
        let rows = self.target_rows();
        let expected = rows.checked_mul(v).ok_or(Error::ShapeMismatch {
            what: "target_logits",
            expected: usize::MAX,
            actual: self.target_logits.len(),
        })?;
        if target && self.target_logits.len() != expected {
            return Err(Error::ShapeMismatch {
                what: if self.final_draft_ends {
                    "target_logits ([k, vocab]: final_draft_ends)"
                } else {
                    "target_logits ([k + 1, vocab])"
                },
                expected,
                actual: self.target_logits.len(),
            });
        }
        for &t in self.draft_tokens {
            if t as usize >= v {
                return Err(Error::TokenOutOfVocab {
                    what: "draft token",
                    token: t,
                    vocab_size: v,
                });
            }
        }
        let dense = !matches!(self.draft_probs, DraftQ::PointMass);
        let block = self.block();
        block
            .validate(&TreeLimits {
                vocab_size: v,
                max_nodes: usize::MAX,
                max_depth: usize::MAX,
                max_branch: usize::MAX,
                dense_q: dense,
            })
            .map_err(Error::InvalidTree)?;
        if !self.ends.is_empty() && self.ends.len() != k {
            return Err(Error::ShapeMismatch {
                what: "ends ([k] or empty)",
                expected: k,
                actual: self.ends.len(),
            });
        }
        if let Some(node) = (0..self.ends.len())
            .find(|&i| self.ends[i] && (i + 1 < k) && block.children(i + 1).next().is_some())
        {
            return Err(Error::InvalidTree(TreeFault::EndHasChildren { node }));
        }
        self.config.check_vocab(v)?;
        // The context reaches the caller's mask (and the penalties, which check it themselves).
        if self.config.mask.is_some()
            && let Some(&t) = self.context.iter().find(|&&t| t as usize >= v)
        {
            return Err(Error::TokenOutOfVocab {
                what: "context token",
                token: t,
                vocab_size: v,
            });
        }
        if let Some(&t) = self.suppress.iter().find(|&&t| t as usize >= v) {
            return Err(Error::TokenOutOfVocab {
                what: "suppressed token",
                token: t,
                vocab_size: v,
            });
        }
        // Dense q is read for the nodes of sampled groups only (the q rows of deterministic
        // groups are not read: those nodes are point masses).
        let default = scheme_default(dense);
        let sampled = |i: usize| block.scheme(i, default) != SiblingScheme::Deterministic;
        match self.draft_probs {
            DraftQ::PointMass => {}
            DraftQ::Probs { probs: data, vocab }
            | DraftQ::Logits {
                logits: data,
                vocab,
            } => {
                if vocab > v {
                    return Err(Error::DraftVocabTooLarge {
                        draft: vocab,
                        target: v,
                    });
                }
                if vocab == 0 && k > 0 {
                    return Err(Error::ShapeMismatch {
                        what: "draft vocab",
                        expected: 1,
                        actual: 0,
                    });
                }
                let expected = k.saturating_mul(vocab);
                if data.len() != expected {
                    return Err(Error::ShapeMismatch {
                        what: "draft probabilities ([k, draft_vocab])",
                        expected,
                        actual: data.len(),
                    });
                }
                for (i, &t) in self.draft_tokens.iter().enumerate() {
                    if t as usize >= vocab && sampled(i) {
                        return Err(Error::TokenOutOfVocab {
                            what: "draft token (draft vocabulary)",
                            token: t,
                            vocab_size: vocab,
                        });
                    }
                }
            }
        }
        if let DraftQ::Probs { probs, vocab: qv } = self.draft_probs {
            for (i, &d) in self.draft_tokens.iter().enumerate() {
                if !sampled(i) {
                    continue;
                }
                let q = row(probs, qv, i);
                // A later sibling's row must equal its group's first row, which was checked
                // in full: the equality is the whole check (one pass over the row, not two).
                if group_first(&block, i) == i {
                    check_dense_q(q, i)?;
                } else {
                    check_group_row(probs, qv, &block, i)?;
                }
                if q[d as usize].widen() <= 0.0 {
                    return Err(Error::InvalidDraftProbs {
                        row: i,
                        reason: "the drafted token has probability 0 under q",
                    });
                }
            }
        }
        if let DraftQ::Logits { logits, vocab: qv } = self.draft_probs {
            for i in (0..k).filter(|&i| sampled(i)) {
                if let Some(e) =
                    crate::sampling::non_finite_in(row(logits, qv, i), RowKind::Draft, i)
                {
                    return Err(e);
                }
                check_group_row(logits, qv, &block, i)?;
            }
        }
        if target {
            check_finite(self.target_logits, v, RowKind::Target)?;
        }
        Ok(())
    }
}

/// The scheme of a group without one: [`TreeLimits::default_scheme`].
fn scheme_default(dense_q: bool) -> SiblingScheme {
    TreeLimits {
        dense_q,
        ..TreeLimits::vocab(1)
    }
    .default_scheme()
}

/// The first node of node `i`'s sibling group (the node whose q row is the group's q).
#[inline]
fn group_first(block: &DraftBlock<'_>, i: usize) -> usize {
    block.children(block.parent_row(i)).next().unwrap_or(i)
}

/// Checks that node `i`'s dense q row (`[qv]` in `data`) equals the row of its group's first
/// node: the siblings of a sampled group were drawn from one q, and each carries it.
fn check_group_row<Q: Logit>(
    data: &[Q],
    qv: usize,
    block: &DraftBlock<'_>,
    i: usize,
) -> Result<()> {
    let first = group_first(block, i);
    if first != i
        && row(data, qv, first)
            .iter()
            .zip(row(data, qv, i))
            .any(|(a, b)| a.widen() != b.widen())
    {
        return Err(Error::InvalidDraftProbs {
            row: i,
            reason: "siblings of a sampled group (with or without replacement) must carry the same q row, the distribution the group was drawn from",
        });
    }
    Ok(())
}

/// Tolerance on the total of a dense q row (probabilities must sum to 1 within this).
pub(crate) const Q_SUM_TOLERANCE: f64 = 1e-3;

/// Checks one dense q row: finite, non-negative, sums to 1 within [`Q_SUM_TOLERANCE`].
pub(crate) fn check_dense_q<Q: Logit>(q: &[Q], row: usize) -> Result<()> {
    // Eight partial sums (value `i` goes to sum `i % 8`, added in index order), so the loop
    // vectorises instead of waiting on one chain of f64 additions; the spans of buffered dtypes
    // are whole multiples of 8 values, so every dtype adds in the same order.
    // `0 <= x <= f32::MAX` is "finite and non-negative" (NaN fails both comparisons), in a form
    // the compiler vectorises (no early exit: the flags are folded at the end).
    const LANES: usize = 8;
    let mut acc = [0.0f64; LANES];
    let mut ok = [true; LANES];
    crate::sampling::for_each_span(q, |_, block| {
        let chunks = block.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for j in 0..LANES {
                let x = c[j];
                ok[j] &= (0.0..=f32::MAX).contains(&x);
                acc[j] += x as f64;
            }
        }
        for (j, &x) in rest.iter().enumerate() {
            ok[j] &= (0.0..=f32::MAX).contains(&x);
            acc[j] += x as f64;
        }
    });
    let bad = ok.iter().any(|&o| !o);
    let total: f64 = acc.iter().sum();
    if bad {
        return Err(Error::InvalidDraftProbs {
            row,
            reason: "a probability is negative or not finite",
        });
    }
    if (total - 1.0).abs() > Q_SUM_TOLERANCE {
        return Err(Error::InvalidDraftProbs {
            row,
            reason: "probabilities do not sum to 1 (tolerance 1e-3)",
        });
    }
    Ok(())
}

/// Checks every row of `[rows, width]` logits for NaN and `+inf` (`-inf` means banned).
pub(crate) fn check_finite<T: Logit>(logits: &[T], width: usize, kind: RowKind) -> Result<()> {
    if width == 0 {
        return Ok(());
    }
    for (r, row) in logits.chunks_exact(width).enumerate() {
        if let Some(e) = crate::sampling::non_finite_in(row, kind, r) {
            return Err(e);
        }
    }
    Ok(())
}

/// Starts `hist` at the request's context (penalty counts, mask prefix, suppressed rows).
fn begin_history<L, Q>(hist: &mut BlockHistory, req: &VerifyRequest<'_, L, Q>) -> Result<()> {
    hist.begin(
        req.config,
        req.context,
        req.prompt_len,
        req.vocab_size,
        req.suppress.iter().copied(),
        req.suppress_rows,
    )
}

/// The verifier. Holds reusable buffers; create one per thread and call it for every step.
///
/// The default is [`Verifier::new`]: empty buffers, grown to the vocabulary size on first use.
///
/// `Verifier` is `Send + Sync`; its methods take `&mut self`, so use one per thread (a
/// [`SamplingConfig`] can be shared between them).
///
/// # Example
///
/// ```
/// use speculative::{SamplingConfig, Verifier, VerifyRequest, StepEnd};
///
/// // vocab 4, k = 2 drafts [1, 2]; the target's argmaxes are 1, 3, 0.
/// let logits = [
///     0.0, 5.0, 1.0, 0.0, // row 0: argmax 1 (accepts d_1 = 1)
///     0.0, 0.0, 1.0, 4.0, // row 1: argmax 3 (rejects d_2 = 2)
///     9.0, 0.0, 0.0, 0.0, // row 2: would give the bonus token
/// ];
/// let cfg = SamplingConfig::greedy();
/// let mut verifier = Verifier::new();
/// let out = verifier.verify(&VerifyRequest::new(&cfg, &logits, 4, &[1, 2])).unwrap();
/// assert_eq!(out.accepted, 1);
/// assert_eq!(out.tokens, vec![1, 3]);
/// assert_eq!(out.end, StepEnd::Rejected { index: 1 });
/// ```
#[derive(Debug, Default)]
pub struct Verifier {
    proc: RowProcessor,
    p: TokenDist,
    hist: BlockHistory,
    /// Residual weights of the current sibling (`p_j`) and the next (`p_{j+1}`).
    residual: Vec<(u32, f64)>,
    residual_next: Vec<(u32, f64)>,
    /// Processed draft-logit rows (`DraftProbs::Logits`), computed before any draw: the row of
    /// the first node of each sampled group (the group's q).
    q_rows: Vec<TokenDist>,
    /// The sibling group of the current row.
    kids: Vec<usize>,
    /// Node indices and tokens of a path (draft-row histories).
    path_nodes: Vec<u32>,
    path_tokens: Vec<u32>,
}

impl Verifier {
    /// A verifier with empty buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Verifies one sequence's block: a chain, or a token tree ([`VerifyRequest::parents`]).
    ///
    /// # Errors
    /// - [`Error::ShapeMismatch`]: `target_logits` is not `[k + 1, vocab]` (`[k, vocab]` with
    ///   [`VerifyRequest::final_draft_ends`]), q is not `[k, draft_vocab]`, or
    ///   [`VerifyRequest::ends`] is neither empty nor `[k]`.
    /// - [`Error::InvalidTree`]: the tree's structure ([`DraftBlock::validate`] without node or
    ///   depth limits: parents, schemes, duplicate siblings, a sampled scheme without q), or an
    ///   ending node with children ([`TreeFault::EndHasChildren`]).
    /// - [`Error::InvalidConfig`]: `final_draft_ends` on a tree that is not a chain.
    /// - [`Error::TokenOutOfVocab`]: a draft or context token (or a token of the configuration)
    ///   is outside the vocabulary.
    /// - [`Error::DraftVocabTooLarge`]: the draft vocabulary is wider than the target's.
    /// - [`Error::NonFiniteLogits`]: a target or (read) draft logit, any row, is NaN or `+inf`.
    /// - [`Error::InvalidDraftProbs`]: a q row is not a distribution, gives its own draft token
    ///   probability 0 (any row; draft-logit rows after processing), or differs from its
    ///   siblings' in a sampled group.
    /// - [`Error::NoAllowedToken`]: a draft-logit row (any), or a target row that the step
    ///   processes, has no token left after masking.
    ///
    /// All but the last are decided before any random draw: they never depend on the seed.
    pub fn verify<L: Logit, Q: Logit>(
        &mut self,
        req: &VerifyRequest<'_, L, Q>,
    ) -> Result<StepOutput> {
        req.validate()?;
        self.prepare_draft_rows(req)?;
        begin_history(&mut self.hist, req)?;
        let mut out = if req.config.is_greedy() {
            greedy::verify(self, req)?
        } else {
            stochastic::verify(self, req)?
        };
        if req.row_top_k > 0 {
            self.fill_row_top(req, &mut out.row_top)?;
        }
        Ok(out)
    }

    /// [`StepOutput::row_top`]: the `row_top_k` best ids of every target row, each processed
    /// with its own path's history. A row whose mask allows no token (possible off the
    /// accepted path only) gets no ids.
    fn fill_row_top<L: Logit, Q: Logit>(
        &mut self,
        req: &VerifyRequest<'_, L, Q>,
        rows_out: &mut RowCandidates,
    ) -> Result<()> {
        rows_out.clear();
        let block = req.block();
        // A row lists at most `vocab` ids, whatever was asked (`usize::MAX`: all of them).
        let mut ids = Vec::with_capacity(req.row_top_k.min(req.vocab_size));
        for r in 0..req.target_rows() {
            block.row_path_tokens(r, &mut self.path_nodes, &mut self.path_tokens);
            self.hist.goto(&self.path_tokens)?;
            let hist = self.hist.view();
            let logits = row(req.target_logits, req.vocab_size, r);
            match self.proc.top_ids(
                req.config,
                logits,
                &hist,
                req.row_top_k,
                RowKind::Target,
                r,
                &mut ids,
            ) {
                Ok(()) => {}
                Err(Error::NoAllowedToken { .. }) => ids.clear(),
                Err(e) => return Err(e),
            }
            rows_out.push_row(&ids);
        }
        Ok(())
    }

    /// Processes the draft-logit row of the first node of every sampled group with its history
    /// (context plus the node's ancestors: the row the group was drawn from), before any draw,
    /// and checks that every node of the group is possible under it. Rows of deterministic
    /// groups are not read.
    fn prepare_draft_rows<L: Logit, Q: Logit>(
        &mut self,
        req: &VerifyRequest<'_, L, Q>,
    ) -> Result<()> {
        let DraftQ::Logits { logits, vocab: qv } = req.draft_probs else {
            return Ok(());
        };
        let k = req.k();
        let block = req.block();
        let default = scheme_default(true);
        begin_history(&mut self.hist, req)?;
        self.q_rows
            .resize_with(k.max(self.q_rows.len()), TokenDist::default);
        for (i, &d) in req.draft_tokens.iter().enumerate() {
            if block.scheme(i, default) == SiblingScheme::Deterministic {
                continue;
            }
            let first = group_first(&block, i);
            if first == i {
                let parent = block.parent_row(i);
                block.row_path_tokens(parent, &mut self.path_nodes, &mut self.path_tokens);
                self.hist.goto(&self.path_tokens)?;
                let row = row(logits, qv, i);
                let hist = self.hist.view();
                if req.config.is_greedy() {
                    let t = self
                        .proc
                        .argmax(req.config, row, &hist, RowKind::Draft, i)?;
                    self.q_rows[i] = TokenDist::point_mass(t, qv)?;
                } else {
                    self.proc.distribution(
                        req.config,
                        row,
                        &hist,
                        RowKind::Draft,
                        i,
                        &mut self.q_rows[i],
                    )?;
                }
            }
            if self.q_rows[first].prob(d) <= 0.0 {
                return Err(Error::InvalidDraftProbs {
                    row: i,
                    reason: "the drafted token has probability 0 under the processed draft logits",
                });
            }
        }
        Ok(())
    }
}

#[inline]
fn row<T>(logits: &[T], vocab: usize, i: usize) -> &[T] {
    &logits[i * vocab..(i + 1) * vocab]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c06_accepted_is_the_leading_run() {
        let flags = [[true, false, true], [true, true, true]];
        let accepted: Vec<usize> = flags.iter().map(|f| leading_accepted(f)).collect();
        assert_eq!(accepted, vec![1, 3]);
        let emitted: Vec<usize> = accepted.iter().map(|a| a + 1).collect();
        assert_eq!(emitted, vec![2, 4]);
    }
}
