//! Logits processing: one implementation for target rows and draft rows.
//!
//! The pipeline, applied by [`RowProcessor`] to one row of logits `[vocab]`:
//!
//! 1. penalties: repetition (CTRL) over the prompt and generated tokens, frequency and presence
//!    (OpenAI) over the generated tokens only unless [`PenaltyScope::WholeContext`]; the earlier
//!    drafts of the same block count as generated ([`TokenCounts`]);
//! 2. logit bias;
//! 3. allowed / banned token sets, the row's suppressed tokens ([`History::suppress`], for
//!    `min_tokens`) and the caller's per-position [`TokenMask`];
//! 4. temperature (0 = greedy: argmax, ties to the lowest id, no softmax);
//! 5. top-k (selection, no sort);
//! 6. softmax;
//! 7. top-p (quickselect on mass, no sort);
//! 8. min-p;
//! 9. renormalise.
//!
//! Rows may arrive in any [`Logit`] dtype (`f32`; `half::f16` and `half::bf16` with the cargo
//! feature `half`): each value is converted to `f32` exactly as it is read, and steps 1-3, when
//! active, work on an `f32` copy of the row (they do for `f32` rows too).
//!
//! The verifier processes target row `i` and (when it is given draft logits) draft row `i` with
//! the same [`SamplingConfig`] and the same history, so both sides of the acceptance ratio
//! `p(x) / q(x)` obey the same rules (case C01).

mod config;
mod history;
mod logit;
#[cfg(feature = "half")]
mod logit_half;
mod penalties;
mod process;
mod top_k;
mod top_p;

pub use config::{SamplingConfig, SamplingConfigBuilder, TokenMask};
pub(crate) use history::BlockHistory;
pub use logit::Logit;
pub(crate) use logit::for_each_span;
pub use penalties::{PenaltyScope, TokenCounts, apply_penalties};
pub use process::{History, RowProcessor, TokenDist};
pub(crate) use process::{non_finite_in, sample_weighted};
pub use top_k::select_top_k;
pub use top_p::{apply_min_p, apply_top_p};

use std::cmp::Ordering;

/// One candidate token of a row: id, processed logit (the ranking key) and its unnormalised or
/// normalised probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cand {
    /// Token id.
    pub id: u32,
    /// Processed logit (after penalties, bias and masks), the ranking key.
    pub logit: f32,
    /// Probability (unnormalised until the final renormalisation).
    pub p: f32,
}

impl Cand {
    /// A candidate with probability 0 (to be filled by the softmax).
    pub fn new(id: u32, logit: f32) -> Self {
        Cand { id, logit, p: 0.0 }
    }

    /// The ranking used everywhere: higher logit first, ties to the lower id.
    /// `Less` means `self` ranks before `other`.
    ///
    /// A total order (sorts never panic on it): a NaN logit ranks after every other value, and
    /// NaNs among themselves by id. The pipeline never produces NaN logits (it rejects them);
    /// this only matters to direct callers of the processing helpers.
    #[inline]
    pub fn rank(&self, other: &Cand) -> Ordering {
        let by_logit = match (self.logit.is_nan(), other.logit.is_nan()) {
            (false, false) => other
                .logit
                .partial_cmp(&self.logit)
                .unwrap_or(Ordering::Equal),
            (a, b) => a.cmp(&b),
        };
        by_logit.then(self.id.cmp(&other.id))
    }
}
