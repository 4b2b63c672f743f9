//! Drawing draft tokens from processed rows: the step shared by every sampling proposer.

use super::{Draft, ProposeRequest};
use crate::error::{Result, RowKind};
use crate::rng::{Stream, lane};
use crate::sampling::{BlockHistory, RowProcessor, SamplingConfig, TokenDist};

/// Samples the drafts of one block, one row of draft logits at a time.
///
/// Row `i` is processed with the request's configuration and the history the verifier will use
/// for target row `i` (one [`BlockHistory`] type for both: penalty counts and mask prefix over
/// the context plus drafts `0..i`, EOS suppressed at rows `0..suppress_eos_rows`), so q is
/// exactly the distribution the verifier needs. Greedy requests take the argmax and return no
/// q; sampling requests draw with the uniform of [`Stream`] at `(context.len() + i, DRAFT)` and
/// record the processed row as q (`[k, vocab]`).
#[derive(Debug, Default)]
pub(crate) struct DraftSampler {
    proc: RowProcessor,
    dist: TokenDist,
    hist: BlockHistory,
    q: Vec<f32>,
    base: usize,
}

impl DraftSampler {
    /// Starts a block after `req.context` over a vocabulary of `vocab` tokens, with the
    /// request's prompt split and EOS suppression.
    pub(crate) fn begin(&mut self, req: &ProposeRequest<'_>, vocab: usize) -> Result<()> {
        // EOS ids outside a shorter draft vocabulary are impossible there anyway.
        self.hist.begin(
            req.config,
            req.context,
            req.prompt_len,
            vocab,
            req.eos.iter().copied().filter(|&t| (t as usize) < vocab),
            req.suppress_eos_rows,
        )?;
        self.q.clear();
        self.base = req.context.len();
        Ok(())
    }

    /// Draws draft `i` from `logits` (`[vocab]`), records q and pushes the token into `draft`.
    pub(crate) fn draw(
        &mut self,
        cfg: &SamplingConfig,
        seed: u64,
        logits: &[f32],
        i: usize,
        draft: &mut Draft,
    ) -> Result<u32> {
        let vocab = logits.len();
        let hist = self.hist.view();
        let t = if cfg.is_greedy() {
            self.proc.argmax(cfg, logits, &hist, RowKind::Draft, i)?
        } else {
            self.proc
                .distribution(cfg, logits, &hist, RowKind::Draft, i, &mut self.dist)?;
            let u = Stream::new(seed).uniform((self.base + i) as u64, lane::DRAFT);
            let row = self.q.len();
            self.q.resize(row + vocab, 0.0);
            for (&id, &p) in self.dist.ids().iter().zip(self.dist.probs()) {
                self.q[row + id as usize] = p;
            }
            self.dist.sample(u).ok_or(crate::Error::NoAllowedToken {
                kind: RowKind::Draft,
                row: i,
            })?
        };
        self.hist
            .push(t)
            .map_err(|_| crate::Error::TokenOutOfVocab {
                what: "draft token",
                token: t,
                vocab_size: vocab,
            })?;
        draft.tokens.push(t);
        Ok(t)
    }

    /// Moves the recorded q into `draft` (sampling requests only).
    pub(crate) fn finish(&mut self, cfg: &SamplingConfig, vocab: usize, draft: &mut Draft) {
        if !cfg.is_greedy() && !draft.tokens.is_empty() {
            draft.q = Some(std::mem::take(&mut self.q));
            draft.q_vocab = vocab;
        }
    }
}
