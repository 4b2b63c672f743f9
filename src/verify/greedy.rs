//! Greedy verification: argmax comparisons only, no softmax, no random draws.
//!
//! One walk for chains and trees: at row `r` (0 = the root's), take the argmax `best` of the
//! processed target row; descend into the first child of `r` whose token is `best`, or emit
//! `best` and stop. Every emitted token is the argmax of the target at its prefix, so the output
//! is plain greedy decoding's.

use super::{StepEnd, StepOutput, TokenLogprob, Verifier, VerifyRequest, row};
use crate::error::{Result, RowKind};
use crate::sampling::Logit;

/// Verifies one validated request by the greedy walk (module docs).
pub(super) fn verify<L: Logit, Q: Logit>(
    v: &mut Verifier,
    req: &VerifyRequest<'_, L, Q>,
) -> Result<StepOutput> {
    let vocab = req.vocab_size;
    let k = req.draft.tokens().len();
    let block = req.draft;
    let want_lp = req.state.config.logprobs();
    let cap = block.max_depth() + 1;
    let mut tokens = Vec::with_capacity(cap);
    let mut path = Vec::with_capacity(cap);
    let mut logprobs = want_lp.map(|_| Vec::with_capacity(cap));
    let mut r = 0;
    let end = loop {
        let logits = row(req.target_logits, vocab, r);
        let hist = v.hist.view();
        let best = v
            .proc
            .argmax(req.state.config, logits, &hist, RowKind::Target, r)?;
        if let (Some(lps), Some(n)) = (logprobs.as_mut(), want_lp) {
            let (lp, top) = v
                .proc
                .greedy_logprobs(req.state.config, logits, &hist, best, n)?;
            lps.push(TokenLogprob {
                token: best,
                logprob: lp,
                top,
            });
        }
        tokens.push(best);
        let mut kids = block.children(r).peekable();
        let leaf = kids.peek().is_none();
        let Some(j) = kids.find(|&j| req.draft.tokens()[j] == best) else {
            break if !leaf {
                StepEnd::Rejected { index: path.len() }
            } else if k == 0 {
                StepEnd::NoDraft
            } else {
                StepEnd::AllAccepted
            };
        };
        path.push(j as u32);
        if req.ends_at(j) {
            break StepEnd::Ended;
        }
        v.hist.push(best)?;
        r = j + 1;
    };
    Ok(StepOutput {
        accepted: path.len(),
        path,
        tokens,
        logprobs,
        end,
        row_top: Default::default(),
    })
}
