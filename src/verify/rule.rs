//! The acceptance rule of speculative sampling on one draft token: the acceptance probability
//! and the residual distribution a rejection samples from (Leviathan et al. 2023, section 2.3).

use super::DraftRow;
use crate::sampling::{Logit, TokenDist};

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
