//! Greedy verification: argmax comparisons only, no softmax, no random draws.

use super::{StepEnd, StepOutput, TokenLogprob, Verifier, VerifyRequest, row};
use crate::error::{Result, RowKind};
use crate::sampling::Logit;

pub(super) fn verify<L: Logit, Q: Logit>(
    v: &mut Verifier,
    req: &VerifyRequest<'_, L, Q>,
) -> Result<StepOutput> {
    let vocab = req.vocab_size;
    let k = req.draft_tokens.len();
    let rows = req.target_rows();
    let want_lp = req.config.logprobs();
    let mut tokens = Vec::with_capacity(k + 1);
    let mut logprobs = want_lp.map(|_| Vec::with_capacity(k + 1));
    let mut end = match (k, req.final_draft_ends) {
        (0, _) => StepEnd::NoDraft,
        (_, true) => StepEnd::Ended,
        _ => StepEnd::AllAccepted,
    };
    for i in 0..rows {
        let logits = row(req.target_logits, vocab, i);
        let hist = v.hist.view();
        let best = v
            .proc
            .argmax(req.config, logits, &hist, RowKind::Target, i)?;
        if i < k && req.draft_tokens[i] != best {
            end = StepEnd::Rejected { index: i };
        }
        if let (Some(lps), Some(n)) = (logprobs.as_mut(), want_lp) {
            let (lp, top) = v.proc.greedy_logprobs(req.config, logits, &hist, best, n)?;
            lps.push(TokenLogprob {
                token: best,
                logprob: lp,
                top,
            });
        }
        tokens.push(best);
        if i + 1 == rows || matches!(end, StepEnd::Rejected { .. }) {
            break;
        }
        v.hist.push(best, vocab)?;
    }
    let accepted = match end {
        StepEnd::Ended => tokens.len(),
        _ => tokens.len() - 1,
    };
    Ok(StepOutput {
        accepted,
        path: (0..accepted as u32).collect(),
        tokens,
        logprobs,
        end,
    })
}
