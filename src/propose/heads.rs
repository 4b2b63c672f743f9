//! Heads proposer: MTP / Medusa heads on the target's last hidden state (Cai et al. 2024,
//! "Medusa: simple LLM inference acceleration framework with multiple decoding heads";
//! multi-token prediction, Gloeckle et al. 2024; DeepSeek-V3's MTP modules and EAGLE, Li et al.
//! 2024, which also read the last token).

use super::sampler::DraftSampler;
use super::{Draft, ProposeRequest, Proposer};
use crate::error::{Error, Result};

/// What [`DraftHeads::logits`] conditions on at one step.
///
/// For a context `c` of `L` tokens: `hidden` is the target's final hidden state of the row at
/// position `L - 2` (input `c[L - 2]`), the row whose output head predicted position `L - 1`;
/// `last_token` is `c[L - 1]`, the token really at that position; `position` is `L`, the
/// absolute position of the first drafted token.
///
/// For a generated token, `last_token` is the target's own prediction from `hidden`. For the
/// prompt's last token it need not be (the prompt is the caller's text, case C13): heads that
/// condition on `last_token` (MTP modules, EAGLE-style draft layers) stay exact there, while
/// Medusa-style heads, which read `hidden` alone and may ignore `last_token`, implicitly assume
/// the target's prediction.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct HeadsInput<'a> {
    /// The target's final hidden state (after the last norm, before the output head) of the row
    /// that predicted `last_token`, `[hidden_size]`.
    pub hidden: &'a [f32],
    /// The last token of the context (the token the first head continues from).
    pub last_token: u32,
    /// Absolute position of the first drafted token: the context length. Head `j` drafts the
    /// token at position `position + j`.
    pub position: usize,
}

impl<'a> HeadsInput<'a> {
    /// The input for a context of `position` tokens ending in `last_token`, with `hidden`
    /// (`[hidden_size]`) the hidden state of the row that predicted `last_token`.
    pub fn new(hidden: &'a [f32], last_token: u32, position: usize) -> Self {
        HeadsInput {
            hidden,
            last_token,
            position,
        }
    }
}

/// Trained draft heads that map the target's final hidden state (and the last token) to
/// next-token logits.
///
/// Head `j` (0-based) predicts the token `j + 1` positions after `input.last_token`, that is the
/// token at absolute position `input.position + j`; see [`HeadsInput`] for which hidden state
/// the heads get and why the last token matters.
///
/// Heads that keep state across calls (for example a draft layer's KV cache) must key it by
/// `input.position` and never serve a previous request's state: they rebuild it, or return
/// [`Error::StaleProposerState`] when they cannot.
pub trait DraftHeads {
    /// Number of heads (the largest draft length the heads can propose).
    fn num_heads(&self) -> usize;

    /// Width of each head's logits, in tokens (may be smaller than the target vocabulary).
    fn vocab_size(&self) -> usize;

    /// Width of the hidden state the heads read.
    fn hidden_size(&self) -> usize;

    /// Writes the logits of the first `n <= num_heads()` heads for `input` into `logits`
    /// (cleared first), shape `[n, vocab_size]`. `input.hidden` has `hidden_size()` entries.
    ///
    /// # Errors
    /// Implementation defined (wrap engine errors in [`Error::Proposer`]).
    fn logits(&mut self, input: &HeadsInput<'_>, n: usize, logits: &mut Vec<f32>) -> Result<()>;
}

/// Proposes with [`DraftHeads`]: draft `i` is sampled from head `i`'s processed distribution
/// (the request's configuration; penalties and masks see the context plus drafts `0..i`), with
/// uniforms from [`Stream`](crate::rng::Stream) on lane [`lane::DRAFT`](crate::rng::lane::DRAFT);
/// q is returned (`[k, head vocab]`). Greedy requests take each head's argmax and return no q.
/// Heads are independent per position (as in Medusa-1), which does not affect losslessness: the
/// verifier only needs the q each draft was really sampled from. The draft ends at its first EOS
/// id: no head row after it is processed.
///
/// The heads get [`HeadsInput`] built from the request: `req.target_hidden`,
/// `req.context.last()` and `req.context.len()`. Without a hidden state (the target does not
/// expose one, or the prompt had a single token) or with an empty context it proposes nothing.
///
/// # State across requests
///
/// The proposer keeps no per-request state: every proposal is a function of the request alone
/// (and of the heads), so using it directly on another request without [`Proposer::begin`] is
/// always exact. Stateful heads follow the rule on [`DraftHeads`].
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

    /// Gives back the wrapped heads.
    pub fn into_inner(self) -> H {
        self.heads
    }
}

impl<H: DraftHeads> Proposer for HeadsProposer<H> {
    /// Proposes up to `min(req.max_draft, num_heads)` tokens; see [`HeadsProposer`].
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `req.target_hidden` is not `[hidden_size]` or the heads
    /// return logits that are not `[n, vocab_size]`; errors of the heads; processing errors of
    /// the request's configuration (for example [`Error::NoAllowedToken`]).
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
        let Some(&last_token) = req.context.last() else {
            return Ok(());
        };
        let k = req.max_draft.min(self.heads.num_heads());
        if k == 0 {
            return Ok(());
        }
        let vocab = self.heads.vocab_size();
        let input = HeadsInput::new(hidden, last_token, req.context.len());
        self.heads.logits(&input, k, &mut self.logits)?;
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

    /// `"heads"`.
    fn name(&self) -> &'static str {
        "heads"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingConfig;
    use crate::test_util::{HeadsConditioning, ToyHeads};

    fn next(t: u32) -> u32 {
        (3 * t + 1) % 8
    }

    fn one_hot(t: u32) -> Vec<f32> {
        (0..8).map(|v| if v == t { 1.0 } else { 0.0 }).collect()
    }

    fn heads() -> HeadsProposer<ToyHeads> {
        HeadsProposer::new(ToyHeads::new(8, 4, HeadsConditioning::LastToken, next))
    }

    fn propose(p: &mut HeadsProposer<ToyHeads>, req: &ProposeRequest<'_>) -> Draft {
        let mut d = Draft::default();
        p.propose(req, &mut d).unwrap();
        d
    }

    #[test]
    fn heads_get_the_hidden_state_last_token_and_position() {
        let cfg = SamplingConfig::greedy();
        let hidden = one_hot(5);
        let ctx = [4u32, 5, 2];
        let req = ProposeRequest {
            target_hidden: Some(&hidden),
            ..ProposeRequest::new(&ctx, &cfg, 3)
        };
        let mut p = heads();
        assert_eq!(propose(&mut p, &req).tokens, [7, 6, 3]);
        assert_eq!(p.heads().inputs, vec![(hidden.clone(), 2, 3)]);
        assert_eq!(p.name(), "heads");
        // Medusa-style heads that ignore the last token continue from the target's own guess
        // after 5 (0), not from the real last token: the case C13 fault.
        let mut m = HeadsProposer::new(ToyHeads::new(8, 4, HeadsConditioning::HiddenOnly, next));
        assert_eq!(propose(&mut m, &req).tokens, [1, 4, 5]);
    }

    #[test]
    fn no_hidden_state_or_empty_context_proposes_nothing() {
        let cfg = SamplingConfig::greedy();
        let hidden = one_hot(1);
        let mut p = heads();
        assert!(propose(&mut p, &ProposeRequest::new(&[1, 2], &cfg, 3)).is_empty());
        let req = ProposeRequest {
            target_hidden: Some(&hidden),
            ..ProposeRequest::new(&[], &cfg, 3)
        };
        assert!(propose(&mut p, &req).is_empty());
        assert!(p.heads().inputs.is_empty());
    }

    #[test]
    fn stale_state_unrelated_request_equals_a_fresh_proposer() {
        let hidden_a = one_hot(3);
        let hidden_b = one_hot(6);
        let (a, b) = ([1u32, 3, 2], [6u32, 0]);
        for cfg in [
            SamplingConfig::greedy(),
            SamplingConfig::builder().temperature(1.0).build().unwrap(),
        ] {
            let req_a = ProposeRequest {
                target_hidden: Some(&hidden_a),
                ..ProposeRequest::new(&a, &cfg, 3)
            };
            let req_b = ProposeRequest {
                target_hidden: Some(&hidden_b),
                ..ProposeRequest::new(&b, &cfg, 3)
            };
            let shrunk = ProposeRequest {
                target_hidden: Some(&hidden_a),
                ..ProposeRequest::new(&a[..2], &cfg, 3)
            };
            let mut p = heads();
            propose(&mut p, &req_a);
            let on_b = propose(&mut p, &req_b);
            assert_eq!(on_b, propose(&mut heads(), &req_b));
            let on_shrunk = propose(&mut p, &shrunk);
            assert_eq!(on_shrunk, propose(&mut heads(), &shrunk));
            if cfg.is_greedy() {
                assert_eq!(on_b.tokens, [1, 4, 5]);
                assert_eq!(on_shrunk.tokens, [2, 7, 6]);
            }
        }
    }

    #[test]
    fn draft_ends_at_eos_even_when_nothing_is_allowed_after_it() {
        // Chain from 2: 7, 6, 3, 2. EOS 6; a caller mask that allows nothing after an EOS.
        let mask = |prefix: &[u32], logits: &mut [f32]| {
            if prefix.last() == Some(&6) {
                logits.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            }
        };
        let hidden = one_hot(5);
        let ctx = [5u32, 2];
        for temperature in [0.0, 1.0] {
            let cfg = SamplingConfig::builder()
                .temperature(temperature)
                .mask(std::sync::Arc::new(mask))
                .build()
                .unwrap();
            let mut req = ProposeRequest {
                target_hidden: Some(&hidden),
                ..ProposeRequest::new(&ctx, &cfg, 4)
            };
            // Without the EOS in the request, the row after 6 has no allowed token.
            assert!(matches!(
                heads().propose(&req, &mut Draft::default()),
                Err(Error::NoAllowedToken { row: 2, .. })
            ));
            req.eos = &[6];
            let d = propose(&mut heads(), &req);
            assert_eq!(d.tokens, [7, 6]);
            if temperature > 0.0 {
                assert_eq!(d.q.as_ref().map(Vec::len), Some(2 * 8));
            }
        }
    }
}
