//! Drawing draft tokens from processed rows: the step shared by every sampling proposer.

use super::{Draft, ProposeRequest};
use crate::error::{Result, RowKind};
use crate::rng::{Stream, lane};
use crate::sampling::{History, RowProcessor, SamplingConfig, TokenCounts, TokenDist};

/// Samples the drafts of one block, one row of draft logits at a time.
///
/// Row `i` is processed with the request's configuration and the history the verifier will use
/// for target row `i` (penalty counts and mask prefix over the context plus drafts `0..i`), so q
/// is exactly the distribution the verifier needs. Greedy requests take the argmax and return no
/// q; sampling requests draw with the uniform of [`Stream`] at `(context.len() + i, DRAFT)` and
/// record the processed row as q (`[k, vocab]`).
#[derive(Debug, Default)]
pub(crate) struct DraftSampler {
    proc: RowProcessor,
    dist: TokenDist,
    counts: Option<TokenCounts>,
    prefix: Vec<u32>,
    q: Vec<f32>,
    base: usize,
    suppress: Vec<u32>,
    suppress_rows: usize,
}

impl DraftSampler {
    /// Starts a block after `req.context` over a vocabulary of `vocab` tokens, with the
    /// request's prompt split and EOS suppression.
    pub(crate) fn begin(&mut self, req: &ProposeRequest<'_>, vocab: usize) -> Result<()> {
        let (cfg, context) = (req.config, req.context);
        self.counts = if cfg.has_penalties() {
            Some(TokenCounts::from_context(context, req.prompt_len, vocab)?)
        } else {
            None
        };
        // EOS ids outside a shorter draft vocabulary are impossible there anyway.
        self.suppress.clear();
        self.suppress
            .extend(req.eos.iter().filter(|&&t| (t as usize) < vocab));
        self.suppress_rows = req.suppress_eos_rows;
        self.prefix.clear();
        if cfg.mask().is_some() {
            self.prefix.extend_from_slice(context);
        }
        self.q.clear();
        self.base = context.len();
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
        let hist = History {
            counts: self.counts.as_ref(),
            prefix: &self.prefix,
            suppress: if i < self.suppress_rows {
                &self.suppress
            } else {
                &[]
            },
        };
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
        if let Some(c) = self.counts.as_mut() {
            c.add(t, vocab).map_err(|_| crate::Error::TokenOutOfVocab {
                what: "draft token",
                token: t,
                vocab_size: vocab,
            })?;
        }
        if cfg.mask().is_some() {
            self.prefix.push(t);
        }
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
