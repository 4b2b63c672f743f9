//! Stochastic verification: speculative sampling with residual resampling.
//!
//! Leviathan, Kalman & Matias 2023 (section 2.3, algorithm 1); Chen et al. 2023 (algorithm 2).

use super::{
    acceptance_probability, residual_weights, row, DraftProbs, DraftRow, StepEnd, StepOutput,
    TokenLogprob, Verifier, VerifyRequest,
};
use crate::error::{Error, Result, RowKind};
use crate::rng::{lane, Stream};
use crate::sampling::sample_weighted;

/// Tolerance on the total of a dense q row (probabilities must sum to 1 within this).
pub(crate) const Q_SUM_TOLERANCE: f64 = 1e-3;

fn check_dense_q(q: &[f32], row: usize) -> Result<()> {
    let mut total = 0.0f64;
    for &x in q {
        if !(x.is_finite() && x >= 0.0) {
            return Err(Error::InvalidDraftProbs {
                row,
                reason: "a probability is negative or not finite",
            });
        }
        total += x as f64;
    }
    if (total - 1.0).abs() > Q_SUM_TOLERANCE {
        return Err(Error::InvalidDraftProbs {
            row,
            reason: "probabilities do not sum to 1 (tolerance 1e-3)",
        });
    }
    Ok(())
}

pub(super) fn verify(v: &mut Verifier, req: &VerifyRequest<'_>) -> Result<StepOutput> {
    let vocab = req.vocab_size;
    let k = req.draft_tokens.len();
    let cfg = req.config;
    let stream = Stream::new(req.seed);
    let pos0 = req.position.unwrap_or(req.context.len() as u64);
    let want_lp = cfg.logprobs();
    let mut tokens = Vec::with_capacity(k + 1);
    let mut logprobs: Option<Vec<TokenLogprob>> = want_lp.map(|_| Vec::with_capacity(k + 1));
    let push_lp = |lps: &mut Option<Vec<TokenLogprob>>, p: &crate::sampling::TokenDist, t: u32| {
        if let (Some(lps), Some(n)) = (lps.as_mut(), want_lp) {
            lps.push(TokenLogprob {
                token: t,
                logprob: p.logprob(t),
                top: p.top_logprobs(n),
            });
        }
    };
    for i in 0..k {
        let pos = pos0 + i as u64;
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
            DraftProbs::PointMass => DraftRow::PointMass,
            DraftProbs::Probs { probs, vocab: qv } => {
                let q = &probs[i * qv..(i + 1) * qv];
                check_dense_q(q, i)?;
                DraftRow::Dense(q)
            }
            DraftProbs::Logits { logits, vocab: qv } => {
                v.proc.distribution(
                    cfg,
                    &logits[i * qv..(i + 1) * qv],
                    &hist,
                    RowKind::Draft,
                    i,
                    &mut v.q,
                )?;
                DraftRow::Dist(&v.q)
            }
        };
        let q_x = q_row.prob(x, x);
        if q_x <= 0.0 {
            return Err(Error::InvalidDraftProbs {
                row: i,
                reason: "the drafted token has probability 0 under q",
            });
        }
        let p_x = v.p.prob(x);
        let u = stream.uniform(pos, lane::ACCEPT) as f64;
        if u < acceptance_probability(p_x, q_x) {
            tokens.push(x);
            push_lp(&mut logprobs, &v.p, x);
            v.hist.push(x, vocab)?;
            continue;
        }
        // Rejected: sample the residual normalise(max(0, p - q)). If rounding left no residual
        // mass (p == q up to float error, where rejection has probability ~0), sample p.
        residual_weights(&v.p, &q_row, x, &mut v.residual);
        let u2 = stream.uniform(pos, lane::SAMPLE);
        let t = sample_weighted(v.residual.iter().copied(), u2).unwrap_or_else(|| v.p.sample(u2));
        tokens.push(t);
        push_lp(&mut logprobs, &v.p, t);
        return Ok(StepOutput {
            accepted: i,
            tokens,
            logprobs,
            end: StepEnd::Rejected { index: i },
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
    let t = v.p.sample(stream.uniform(pos0 + k as u64, lane::SAMPLE));
    tokens.push(t);
    push_lp(&mut logprobs, &v.p, t);
    Ok(StepOutput {
        accepted: k,
        tokens,
        logprobs,
        end: if k == 0 {
            StepEnd::NoDraft
        } else {
            StepEnd::AllAccepted
        },
    })
}
