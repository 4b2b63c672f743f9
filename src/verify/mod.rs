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
//! With a tree in [`VerifyRequest::draft`] ([`DraftBlock::tree`]) the `k` drafts are the nodes
//! of a token tree (row convention in [`crate::tree`]: node `i` is checked against row
//! `parents[i]`, one forward gives
//! `[k + 1, vocab]` rows, row 0 after the root). The verifier walks down from the root. At row
//! `r`, at depth `d` (the number of nodes accepted so far), it processes target row `r` with the
//! history "context + tokens of the path to `r`" (the committed context and the node's
//! ancestors, never another branch) and decides among the children of `r`, its **sibling
//! group** (in node order), by the group's [`SiblingScheme`]. Accepting node `j` moves to row
//! `j + 1`; a node marked as ending ([`DraftBlock::with_ends`]) stops the step there
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
//! the ending nodes (empty or `[k]`, ending nodes are leaves), and that the siblings of
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
mod draft_q;
pub mod exact;
mod greedy;
mod output;
mod request;
mod rows;
mod rule;
mod stochastic;
#[cfg(test)]
mod tree_tests;
mod validate;
mod verifier;

pub use array::array_rows;
pub(crate) use batch::{BatchLayout, check_layout, check_tree_layout};
pub use batch::{SequenceParams, VerifyBatch};
pub use draft_q::{DraftProbs, DraftQ, DraftRow};
pub use output::{RowCandidates, StepEnd, StepOutput, TokenLogprob, leading_accepted};
pub use request::{SequenceState, VerifyRequest};
use rows::{begin_history, group_first, row, scheme_default};
pub(crate) use rule::residual_weights_of;
pub use rule::{acceptance_probability, residual_weights};
pub use verifier::Verifier;

// Names the module docs link to.
#[cfg(doc)]
use crate::error::Error;
#[cfg(doc)]
use crate::sampling::Logit;
#[cfg(doc)]
use crate::tree::{DraftBlock, SiblingScheme};
