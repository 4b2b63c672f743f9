//! Closed-form distributions of one verify step, for proofs and tests.
//!
//! These functions use the same acceptance rule ([`super::acceptance_probability`]) and residual
//! ([`super::residual_weights`]) as the verifier, and compute in f64 the exact probability of
//! every first emitted token. The losslessness theorem (Leviathan et al. 2023, appendix A.1;
//! Chen et al. 2023, theorem 1) says the marginal over the draft equals the processed target `p`.

use super::{DraftRow, acceptance_probability, residual_weights};
use crate::error::{Error, Result};
use crate::sampling::TokenDist;

/// Exact distribution (`[vocab]`, f64 probabilities) of the first emitted token of a step whose
/// first draft token is `draft`, given the processed target row `p` and the draft row `q`.
///
/// `P(v) = a * [v == draft] + (1 - a) * r(v)`, with `a = min(1, p(draft) / q(draft))` and `r`
/// the normalised residual `max(0, p - q)` (or `p` itself when the residual has no mass).
///
/// # Errors
/// [`Error::InvalidDraftProbs`] when `q(draft) = 0`; [`Error::TokenOutOfVocab`] when `draft` is
/// outside `p`'s vocabulary.
pub fn first_token_given_draft(p: &TokenDist, q: &DraftRow<'_>, draft: u32) -> Result<Vec<f64>> {
    let vocab = p.vocab_size();
    if draft as usize >= vocab {
        return Err(Error::TokenOutOfVocab {
            what: "draft token",
            token: draft,
            vocab_size: vocab,
        });
    }
    let q_x = q.prob(draft, draft);
    if q_x <= 0.0 {
        return Err(Error::InvalidDraftProbs {
            row: 0,
            reason: "the drafted token has probability 0 under q",
        });
    }
    let a = acceptance_probability(p.prob(draft), q_x);
    let mut out = vec![0.0f64; vocab];
    out[draft as usize] += a;
    let mut res = Vec::new();
    let total = residual_weights(p, q, draft, &mut res);
    if total > 0.0 {
        for (t, w) in res {
            out[t as usize] += (1.0 - a) * w / total;
        }
    } else {
        for (&t, &pt) in p.ids().iter().zip(p.probs()) {
            out[t as usize] += (1.0 - a) * pt as f64;
        }
    }
    Ok(out)
}

/// Exact marginal distribution (`[vocab]`, f64) of the first emitted token when the draft token
/// is sampled from `q` (a processed draft distribution over at most `p`'s vocabulary):
/// `sum_x q(x) * first_token_given_draft(p, q, x)`. Equals `p` by the losslessness theorem.
///
/// # Errors
/// [`Error::DraftVocabTooLarge`] when `q` is over a larger vocabulary than `p`.
pub fn first_token_marginal(p: &TokenDist, q: &TokenDist) -> Result<Vec<f64>> {
    if q.vocab_size() > p.vocab_size() {
        return Err(Error::DraftVocabTooLarge {
            draft: q.vocab_size(),
            target: p.vocab_size(),
        });
    }
    let mut out = vec![0.0f64; p.vocab_size()];
    let row = DraftRow::Dist(q);
    for (&x, &qx) in q.ids().iter().zip(q.probs()) {
        let given = first_token_given_draft(p, &row, x)?;
        for (o, g) in out.iter_mut().zip(given) {
            *o += qx as f64 * g;
        }
    }
    Ok(out)
}
