//! Greedy verification: argmax comparisons only, no softmax, no random draws.

use super::{row, StepEnd, StepOutput, TokenLogprob, Verifier, VerifyRequest};
use crate::error::{Result, RowKind};

pub(super) fn verify(v: &mut Verifier, req: &VerifyRequest<'_>) -> Result<StepOutput> {
    let vocab = req.vocab_size;
    let k = req.draft_tokens.len();
    let want_lp = req.config.logprobs();
    let mut tokens = Vec::with_capacity(k + 1);
    let mut logprobs = want_lp.map(|_| Vec::with_capacity(k + 1));
    let mut end = if k == 0 {
        StepEnd::NoDraft
    } else {
        StepEnd::AllAccepted
    };
    for i in 0..=k {
        let logits = row(req.target_logits, vocab, i);
        let hist = v.hist.view();
        let best = v
            .proc
            .argmax(req.config, logits, &hist, RowKind::Target, i)?;
        let emit = if i < k {
            let d = req.draft_tokens[i];
            if d != best {
                end = StepEnd::Rejected { index: i };
            }
            best
        } else {
            best
        };
        if let (Some(lps), Some(n)) = (logprobs.as_mut(), want_lp) {
            let (lp, top) = v.proc.greedy_logprobs(req.config, logits, &hist, emit, n)?;
            lps.push(TokenLogprob {
                token: emit,
                logprob: lp,
                top,
            });
        }
        tokens.push(emit);
        if i == k || matches!(end, StepEnd::Rejected { .. }) {
            break;
        }
        v.hist.push(emit, vocab)?;
    }
    Ok(StepOutput {
        accepted: tokens.len() - 1,
        tokens,
        logprobs,
        end,
    })
}
