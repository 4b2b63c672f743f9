//! Stochastic verification: speculative sampling with residual resampling.
//!
//! Leviathan, Kalman & Matias 2023 (section 2.3, algorithm 1); Chen et al. 2023 (algorithm 2).
//! Point-mass drafts use the reproducible form of the same rule (see the module docs of
//! [`crate::verify`], case C15).

use super::{
    DraftQ, DraftRow, StepEnd, StepOutput, TokenLogprob, Verifier, VerifyRequest,
    acceptance_probability, residual_weights_of, row,
};
use crate::error::{Error, Result, RowKind};
use crate::rng::{Stream, lane};
use crate::sampling::{Logit, TokenDist, sample_weighted};

pub(super) fn verify<L: Logit, Q: Logit>(
    v: &mut Verifier,
    req: &VerifyRequest<'_, L, Q>,
) -> Result<StepOutput> {
    let vocab = req.vocab_size;
    let k = req.draft_tokens.len();
    let cfg = req.config;
    let stream = Stream::new(req.seed);
    let pos0 = req.position.unwrap_or(req.context.len() as u64);
    let want_lp = cfg.logprobs();
    let mut tokens = Vec::with_capacity(k + 1);
    let mut logprobs: Option<Vec<TokenLogprob>> = want_lp.map(|_| Vec::with_capacity(k + 1));
    let push_lp = |lps: &mut Option<Vec<TokenLogprob>>, p: &TokenDist, t: u32| {
        if let (Some(lps), Some(n)) = (lps.as_mut(), want_lp) {
            lps.push(TokenLogprob {
                token: t,
                logprob: p.logprob(t),
                top: p.top_logprobs(n),
            });
        }
    };
    for i in 0..k {
        let pos = pos0.wrapping_add(i as u64);
        let x = req.draft_tokens[i];
        let hist = v.hist.view();
        v.proc.distribution(
            cfg,
            row(req.target_logits, vocab, i),
            &hist,
            RowKind::Target,
            i,
            &mut v.p,
        )?;
        let q_row = match req.draft_probs {
            DraftQ::PointMass => None,
            DraftQ::Probs { probs, vocab: qv } => {
                Some(DraftRow::Dense(&probs[i * qv..(i + 1) * qv]))
            }
            DraftQ::Logits { .. } => Some(DraftRow::Dist(&v.q_rows[i])),
        };
        let emitted = match q_row {
            // Point mass: draw the position's token as plain sampling would and accept the draft
            // iff it is that token (accepts with p(x); on rejection the draw is a sample of p
            // without x). Validation guaranteed nothing here can fail.
            None => {
                let t = draw(&v.p, stream.uniform(pos, lane::SAMPLE), i)?;
                (t != x).then_some(t)
            }
            Some(q_row) => {
                // Validation checked q(x) > 0 for every row.
                let q_x = q_row.prob(x, x);
                let u = stream.uniform(pos, lane::ACCEPT) as f64;
                if u < acceptance_probability(v.p.prob(x), q_x) {
                    None
                } else {
                    // Rejected: sample the residual normalise(max(0, p - q)). If rounding left
                    // no residual mass (p == q up to float error, where rejection has
                    // probability ~0), sample p.
                    residual_weights_of(&v.p, &q_row, x, &mut v.residual);
                    let u2 = stream.uniform(pos, lane::SAMPLE);
                    match sample_weighted(v.residual.iter().copied(), u2) {
                        Some(t) => Some(t),
                        None => Some(draw(&v.p, u2, i)?),
                    }
                }
            }
        };
        if let Some(t) = emitted {
            tokens.push(t);
            push_lp(&mut logprobs, &v.p, t);
            return Ok(StepOutput {
                accepted: i,
                path: (0..i as u32).collect(),
                tokens,
                logprobs,
                end: StepEnd::Rejected { index: i },
            });
        }
        tokens.push(x);
        push_lp(&mut logprobs, &v.p, x);
        v.hist.push(x, vocab)?;
    }
    if req.final_draft_ends {
        // The accepted final draft ends the sequence: no row after it is processed.
        return Ok(StepOutput {
            accepted: k,
            path: (0..k as u32).collect(),
            tokens,
            logprobs,
            end: StepEnd::Ended,
        });
    }
    // All k accepted (or k = 0): the bonus / plain token from row k.
    let hist = v.hist.view();
    v.proc.distribution(
        cfg,
        row(req.target_logits, vocab, k),
        &hist,
        RowKind::Target,
        k,
        &mut v.p,
    )?;
    let t = draw(
        &v.p,
        stream.uniform(pos0.wrapping_add(k as u64), lane::SAMPLE),
        k,
    )?;
    tokens.push(t);
    push_lp(&mut logprobs, &v.p, t);
    Ok(StepOutput {
        accepted: k,
        path: (0..k as u32).collect(),
        tokens,
        logprobs,
        end: if k == 0 {
            StepEnd::NoDraft
        } else {
            StepEnd::AllAccepted
        },
    })
}

/// The token of processed target row `row` at uniform `u` (a processed row is never empty; the
/// error is for completeness).
fn draw(p: &TokenDist, u: f32, row: usize) -> Result<u32> {
    p.sample(u).ok_or(Error::NoAllowedToken {
        kind: RowKind::Target,
        row,
    })
}
