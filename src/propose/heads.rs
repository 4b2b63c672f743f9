//! Heads proposer: MTP / Medusa heads on the target's last hidden state (Cai et al. 2024,
//! "Medusa: simple LLM inference acceleration framework with multiple decoding heads";
//! multi-token prediction, Gloeckle et al. 2024).

use super::sampler::DraftSampler;
use super::{Draft, ProposeRequest, Proposer};
use crate::error::{Error, Result};

/// Trained draft heads that map the target's final hidden state to next-token logits.
///
/// Head `j` (0-based) predicts the token `j + 1` positions after the token that the target's own
/// output head predicts from the same hidden state. The decoding loop passes the hidden state of
/// the row that predicted the last emitted token, so head `j` proposes draft `d_{j+1}`.
pub trait DraftHeads {
    /// Number of heads (the largest draft length the heads can propose).
    fn num_heads(&self) -> usize;

    /// Width of each head's logits, in tokens (may be smaller than the target vocabulary).
    fn vocab_size(&self) -> usize;

    /// Width of the hidden state the heads read.
    fn hidden_size(&self) -> usize;

    /// Writes the logits of the first `n <= num_heads()` heads for `hidden` (`[hidden_size]`)
    /// into `logits` (cleared first), shape `[n, vocab_size]`.
    ///
    /// # Errors
    /// Implementation defined (wrap engine errors in [`Error::Proposer`]).
    fn logits(&mut self, hidden: &[f32], n: usize, logits: &mut Vec<f32>) -> Result<()>;
}

/// Proposes with [`DraftHeads`]: draft `i` is sampled from head `i`'s processed distribution
/// (the request's configuration; penalties and masks see the context plus drafts `0..i`), with
/// uniforms from [`Stream`](crate::rng::Stream) on lane [`lane::DRAFT`](crate::rng::lane::DRAFT); q is returned (`[k, head vocab]`). Greedy
/// requests take each head's argmax and return no q. Heads are independent per position (as in
/// Medusa-1), which does not affect losslessness: the verifier only needs the q each draft was
/// really sampled from.
///
/// Without a hidden state (the target does not expose one, or the prompt had a single token) it
/// proposes nothing.
///
/// `HeadsProposer<H>` is `Send` when `H` is `Send`, and `Sync` when `H` is `Sync`.
#[derive(Debug)]
pub struct HeadsProposer<H> {
    heads: H,
    sampler: DraftSampler,
    logits: Vec<f32>,
}

impl<H: DraftHeads> HeadsProposer<H> {
    /// Wraps `heads`.
    pub fn new(heads: H) -> Self {
        HeadsProposer {
            heads,
            sampler: DraftSampler::default(),
            logits: Vec::new(),
        }
    }

    /// The wrapped heads.
    pub fn heads(&self) -> &H {
        &self.heads
    }
}

impl<H: DraftHeads> Proposer for HeadsProposer<H> {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let Some(hidden) = req.target_hidden else {
            return Ok(());
        };
        if hidden.len() != self.heads.hidden_size() {
            return Err(Error::ShapeMismatch {
                what: "target hidden state for heads",
                expected: self.heads.hidden_size(),
                actual: hidden.len(),
            });
        }
        let k = req.max_draft.min(self.heads.num_heads());
        if k == 0 {
            return Ok(());
        }
        let vocab = self.heads.vocab_size();
        self.heads.logits(hidden, k, &mut self.logits)?;
        if self.logits.len() != k * vocab {
            return Err(Error::ShapeMismatch {
                what: "head logits ([n, vocab])",
                expected: k * vocab,
                actual: self.logits.len(),
            });
        }
        let cfg = req.config;
        self.sampler.begin(req, vocab)?;
        for i in 0..k {
            let row = &self.logits[i * vocab..(i + 1) * vocab];
            let t = self.sampler.draw(cfg, req.seed, row, i, draft)?;
            // A draft ends at its own EOS: no head row after it is processed.
            if req.is_eos(t) {
                break;
            }
        }
        self.sampler.finish(cfg, vocab, draft);
        Ok(())
    }
}
