//! The draft distribution q a request hands to the verifier ([`DraftQ`]) and one node's row
//! of it as the acceptance rule reads it ([`DraftRow`]).

use crate::sampling::{Logit, TokenDist};
#[cfg(doc)]
use crate::{error::Error, sampling::SamplingConfig};

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
#[non_exhaustive]
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
