//! A draft model proposer: a smaller model samples the draft (Leviathan et al. 2023; Chen et al.
//! 2023).

use super::sampler::DraftSampler;
use super::{Draft, ProposeRequest, Proposer};
use crate::error::{Error, Result};
use crate::model::TargetModel;

/// Wraps any [`TargetModel`] as a draft model.
///
/// At each step it samples `k` tokens one at a time from its processed distribution (the
/// request's [`crate::SamplingConfig`], penalties counting the context plus earlier drafts),
/// drawing uniforms from [`Stream`](crate::rng::Stream) keyed by the request seed on lane [`lane::DRAFT`](crate::rng::lane::DRAFT), and returns
/// the probabilities q it sampled from (`[k, draft_vocab]`). In greedy mode it proposes the
/// argmax chain and returns no q.
///
/// Its KV cache is kept in step with the context: before proposing it truncates to the longest
/// common prefix of what it has seen and the current context (rollback after a rejection) and
/// feeds the missing tokens (catch-up on the correction or bonus token). Costs `k` draft
/// forwards per step (the first one feeds every token not yet seen). The first proposal of a
/// generation feeds the context but its last token through [`TargetModel::prefill`], which lets
/// the model skip its output head for those rows; a generation in which the draft-length policy
/// never asks for drafts never runs the draft model.
///
/// The draft ends at its first EOS id ([`ProposeRequest::eos`]): no draft row after it is
/// computed or processed, so a caller's [`crate::TokenMask`] that allows nothing after an end
/// is never asked about one.
///
/// # State across requests
///
/// The model's sequence is exactly the tokens it has seen, and every call compares them in full
/// with `req.context` (a `memcmp` when the context extends them, else a scan for the longest
/// common prefix). A context from another request, or one that shrank or changed anywhere, keeps
/// only the common prefix and recomputes the rest, as [`Proposer::begin`] followed by a
/// proposal would. If the model's sequence length no longer matches what the proposer fed (the
/// model was driven from elsewhere), the proposer starts over from an empty sequence. So the
/// drafts never depend on an earlier request: they equal a fresh proposer's drafts on the same
/// context (for a model whose logits depend only on its sequence).
///
/// `DraftModelProposer<M>` is `Send` when `M` is `Send`, and `Sync` when `M` is `Sync`.
#[derive(Debug)]
pub struct DraftModelProposer<M> {
    model: M,
    seen: Vec<u32>,
    sampler: DraftSampler,
    logits: Vec<f32>,
}

impl<M: TargetModel> DraftModelProposer<M> {
    /// Wraps `model` (its sequence is reset at the start of each generation).
    pub fn new(model: M) -> Self {
        DraftModelProposer {
            model,
            seen: Vec::new(),
            sampler: DraftSampler::default(),
            logits: Vec::new(),
        }
    }

    /// The wrapped model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// Gives back the wrapped model.
    pub fn into_inner(self) -> M {
        self.model
    }

    /// Feeds `tokens` and keeps the last row of logits in `self.logits`.
    fn feed(&mut self, tokens: &[u32]) -> Result<()> {
        self.model.forward(tokens, &mut self.logits)?;
        self.seen.extend_from_slice(tokens);
        let v = self.model.vocab_size();
        let n = self.logits.len();
        if n != tokens.len() * v || n < v {
            return Err(Error::ShapeMismatch {
                what: "draft model logits ([n, vocab])",
                expected: tokens.len() * v,
                actual: n,
            });
        }
        self.logits.drain(..n - v);
        Ok(())
    }
}

impl<M: TargetModel> Proposer for DraftModelProposer<M> {
    fn begin(&mut self, _prompt: &[u32]) -> Result<()> {
        self.model.truncate(0)?;
        self.seen.clear();
        Ok(())
    }

    /// Proposes up to `req.max_draft` tokens (fewer near the model's context limit, or when a
    /// draft ends at EOS); see [`DraftModelProposer`].
    ///
    /// # Errors
    /// Errors of the model's `prefill`, `forward` and `truncate`; [`Error::ShapeMismatch`] when
    /// the model returns logits that are not `[n, vocab]`; processing errors of the request's
    /// configuration (for example [`Error::NoAllowedToken`]).
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let ctx = req.context;
        if req.max_draft == 0 || ctx.is_empty() {
            return Ok(());
        }
        let vocab = self.model.vocab_size();
        let room = self.model.max_context().saturating_sub(ctx.len());
        let k = req.max_draft.min(room);
        if k == 0 {
            return Ok(());
        }
        // Roll back to the common prefix, keeping at least one token to feed. The whole seen
        // sequence is compared (exact stale-state detection): a memcmp in the usual case where
        // the context extends it.
        let common = if self.model.seq_len() != self.seen.len() {
            0
        } else if ctx.get(..self.seen.len()) == Some(&self.seen[..]) {
            self.seen.len()
        } else {
            self.seen
                .iter()
                .zip(ctx)
                .take_while(|(a, b)| a == b)
                .count()
        }
        .min(ctx.len() - 1);
        self.model.truncate(common)?;
        self.seen.truncate(common);
        if common == 0 && ctx.len() > 1 {
            // First proposal of a generation: the prompt's rows need no logits.
            let head = &ctx[..ctx.len() - 1];
            self.model.prefill(head)?;
            self.seen.extend_from_slice(head);
            self.feed(&ctx[ctx.len() - 1..])?;
        } else {
            self.feed(&ctx[common..])?;
        }

        let cfg = req.config;
        self.sampler.begin(req, vocab)?;
        for i in 0..k {
            let t = self.sampler.draw(cfg, req.seed, &self.logits, i, draft)?;
            // A draft ends at its own EOS: no draft row after it is computed or processed.
            if i + 1 < k && !req.is_eos(t) {
                self.feed(&[t])?;
            } else {
                break;
            }
        }
        self.sampler.finish(cfg, vocab, draft);
        Ok(())
    }

    /// `"draft-model"`.
    fn name(&self) -> &'static str {
        "draft-model"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingConfig;
    use crate::test_util::{CallLog, ToyModel};

    #[test]
    fn prompt_is_prefilled_once_and_drafts_match_full_forwards() {
        let prompt = [1u32, 2, 3, 4, 5, 6, 0, 2];
        let cfg = SamplingConfig::greedy();
        let req = ProposeRequest::new(&prompt, &cfg, 3);
        let mut p = DraftModelProposer::new(CallLog::new(ToyModel::c10()));
        p.begin(&prompt).unwrap();
        assert!(
            p.model().prefills.is_empty(),
            "begin must not run the draft model"
        );
        let mut d = Draft::default();
        p.propose(&req, &mut d).unwrap();
        let calls = &p.model().prefills;
        assert_eq!(calls, &vec![prompt.len() - 1]);
        // The first forward feeds only the prompt's last token, then one per draft token.
        assert_eq!(p.model().forwards, vec![1, 1, 1]);
        // Same drafts as a model without a `prefill` of its own (one full forward).
        let mut q = DraftModelProposer::new(ToyModel::c10());
        let mut e = Draft::default();
        q.propose(&req, &mut e).unwrap();
        assert_eq!(d.tokens, e.tokens);
        assert_eq!(d.tokens.len(), 3);
    }

    /// Drafts of a fresh proposer on `ctx`.
    fn fresh(ctx: &[u32], cfg: &SamplingConfig, k: usize) -> Draft {
        let mut p = DraftModelProposer::new(ToyModel::c10());
        let mut d = Draft::default();
        p.propose(&ProposeRequest::new(ctx, cfg, k), &mut d)
            .unwrap();
        d
    }

    fn configs() -> [SamplingConfig; 2] {
        [
            SamplingConfig::greedy(),
            SamplingConfig::builder().temperature(1.0).build().unwrap(),
        ]
    }

    #[test]
    fn stale_state_unrelated_request_equals_a_fresh_proposer() {
        // The c10 model's logits depend on the sum of the whole prefix, so any stale cache
        // entry changes the drafts.
        let a: Vec<u32> = (0..60).map(|i| (i * 3 % 7) as u32).collect();
        let mut b = a.clone();
        b[30] = (b[30] + 1) % 7;
        let c: Vec<u32> = vec![6; 45];
        for cfg in configs() {
            let mut p = DraftModelProposer::new(ToyModel::c10());
            let mut d = Draft::default();
            for ctx in [&a, &b, &c, &a] {
                p.propose(&ProposeRequest::new(ctx, &cfg, 4), &mut d)
                    .unwrap();
                assert_eq!(d, fresh(ctx, &cfg, 4));
                assert_eq!(&p.model().tokens()[..ctx.len()], &ctx[..]);
            }
        }
    }

    #[test]
    fn stale_state_context_that_shrinks_or_diverges() {
        let seq: Vec<u32> = (0..80).map(|i| (i * i % 7) as u32).collect();
        for cfg in configs() {
            let mut p = DraftModelProposer::new(ToyModel::c10());
            let mut d = Draft::default();
            p.propose(&ProposeRequest::new(&seq, &cfg, 3), &mut d)
                .unwrap();
            for cut in [79, 40, 2, 1] {
                let ctx = &seq[..cut];
                p.propose(&ProposeRequest::new(ctx, &cfg, 3), &mut d)
                    .unwrap();
                assert_eq!(d, fresh(ctx, &cfg, 3), "cut {cut}");
                p.propose(&ProposeRequest::new(&seq, &cfg, 3), &mut d)
                    .unwrap();
            }
            for at in [0, 1, 40, 78, 79] {
                let mut other = seq.clone();
                other[at] = (other[at] + 3) % 7;
                other.extend_from_slice(&seq[..5]);
                p.propose(&ProposeRequest::new(&seq, &cfg, 3), &mut d)
                    .unwrap();
                p.propose(&ProposeRequest::new(&other, &cfg, 3), &mut d)
                    .unwrap();
                assert_eq!(d, fresh(&other, &cfg, 3), "diverge at {at}");
            }
        }
    }

    #[test]
    fn stale_state_model_with_a_sequence_of_its_own_starts_over() {
        let mut model = ToyModel::c10();
        model.forward(&[5, 5, 5, 5], &mut Vec::new()).unwrap();
        let ctx = [1u32, 2, 3];
        let cfg = SamplingConfig::greedy();
        let mut p = DraftModelProposer::new(model);
        let mut d = Draft::default();
        p.propose(&ProposeRequest::new(&ctx, &cfg, 3), &mut d)
            .unwrap();
        assert_eq!(d, fresh(&ctx, &cfg, 3));
        assert_eq!(&p.model().tokens()[..3], &ctx);
    }

    #[test]
    fn draft_ends_at_eos_and_computes_no_row_after_it() {
        // Greedy chain after [0]: c10 gives a fixed sequence; make its second token the EOS.
        let ctx = [0u32];
        let cfg = SamplingConfig::greedy();
        let free = fresh(&ctx, &cfg, 4).tokens;
        assert_eq!(free.len(), 4);
        let eos = [free[1]];
        let req = ProposeRequest {
            eos: &eos,
            ..ProposeRequest::new(&ctx, &cfg, 4)
        };
        let mut p = DraftModelProposer::new(CallLog::new(ToyModel::c10()));
        let mut d = Draft::default();
        p.propose(&req, &mut d).unwrap();
        assert_eq!(d.tokens, free[..2]);
        // One forward for the context's last token, one for the first draft; none after EOS.
        assert_eq!(p.model().forwards, vec![1, 1]);
        assert_eq!(p.name(), "draft-model");
    }
}
