//! The speculative decoding loop.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::metrics::Metrics;
use super::model::TargetModel;
use super::policy::{AdaptiveState, DraftLength};
use super::stop::{FinishReason, StopConditions};
use crate::error::{Error, Result};
use crate::propose::{Draft, ProposeRequest, Proposer};
use crate::sampling::SamplingConfig;
use crate::verify::{DraftProbs, TokenLogprob, Verifier, VerifyRequest};

/// Parameters of one generation request.
#[derive(Debug, Clone, Default)]
pub struct GenerationParams {
    /// Sampling configuration, used by the verifier and by sampling proposers alike.
    pub sampling: SamplingConfig,
    /// Seed of the request's random stream ([`crate::rng::Stream`]).
    pub seed: u64,
    /// Stop conditions (EOS ids, stop sequences, stop strings).
    pub stop: StopConditions,
    /// Draft length policy for this request (per-request override or opt-out).
    pub draft: DraftLength,
    /// Set to `true` from any thread to cancel; checked before each step.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl GenerationParams {
    /// Greedy decoding of at most `max_new_tokens`, fixed draft length 4.
    pub fn greedy(max_new_tokens: usize) -> Self {
        GenerationParams {
            sampling: SamplingConfig::greedy(),
            stop: StopConditions::max_tokens(max_new_tokens),
            ..Default::default()
        }
    }
}

/// The result of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The new tokens (the prompt is not included).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Counters and timings.
    pub metrics: Metrics,
    /// Per new token, when the sampling configuration asked for log-probabilities.
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// Runs speculative decoding: propose, one target forward over `[last token, d_1 .. d_k]`, verify,
/// commit, roll back the rejected part of the target's KV cache.
///
/// The target is called exactly once per step. The draft length is capped so that accepted drafts
/// plus the bonus token never exceed the token budget or the model's context; with one slot left
/// the step is a plain decoding step.
///
/// # Example
///
/// (`ToyModel` comes from the `test-util` feature; use your own [`TargetModel`].)
///
/// ```
/// use speculative::decode::{GenerationParams, Generator};
/// use speculative::propose::PromptLookup;
/// use speculative::test_util::ToyModel;
///
/// let target = ToyModel::c10();
/// let mut gen = Generator::new(target, PromptLookup::new(2, 5).unwrap());
/// let out = gen.generate(&[3; 48], &GenerationParams::greedy(32)).unwrap();
/// assert_eq!(out.tokens.len(), 32);
/// ```
pub struct Generator<T, P> {
    target: T,
    proposer: P,
    verifier: Verifier,
    adaptive: AdaptiveState,
    logits: Vec<f32>,
    draft: Draft,
    hidden: Vec<f32>,
}

impl<T: TargetModel, P: Proposer> Generator<T, P> {
    /// A generator over `target` with `proposer`.
    pub fn new(target: T, proposer: P) -> Self {
        Generator {
            target,
            proposer,
            verifier: Verifier::new(),
            adaptive: AdaptiveState::default(),
            logits: Vec::new(),
            draft: Draft::default(),
            hidden: Vec::new(),
        }
    }

    /// The target model.
    pub fn target(&self) -> &T {
        &self.target
    }

    /// The target model, mutably.
    pub fn target_mut(&mut self) -> &mut T {
        &mut self.target
    }

    /// The proposer.
    pub fn proposer(&self) -> &P {
        &self.proposer
    }

    /// The proposer, mutably.
    pub fn proposer_mut(&mut self) -> &mut P {
        &mut self.proposer
    }

    /// The adaptive policy's current estimates (acceptance per position, forward cost by length).
    pub fn adaptive_state(&self) -> &AdaptiveState {
        &self.adaptive
    }

    /// Gives back the target and the proposer.
    pub fn into_parts(self) -> (T, P) {
        (self.target, self.proposer)
    }

    /// Generates until a stop condition; returns the new tokens and metrics.
    ///
    /// # Errors
    /// See [`Generator::session`] and [`Session::step`].
    pub fn generate(&mut self, prompt: &[u32], params: &GenerationParams) -> Result<Generation> {
        self.generate_with(prompt, params, |_| ControlFlow::Continue(()))
    }

    /// Generates, calling `on_tokens` with the tokens of each verified step as soon as it is
    /// verified (streaming). Returning `ControlFlow::Break(())` cancels the generation.
    ///
    /// # Errors
    /// See [`Generator::session`] and [`Session::step`].
    pub fn generate_with(
        &mut self,
        prompt: &[u32],
        params: &GenerationParams,
        mut on_tokens: impl FnMut(&[u32]) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let mut s = self.session(prompt, params)?;
        while let Some(tokens) = s.step()? {
            if on_tokens(tokens).is_break() {
                s.cancel();
            }
        }
        Ok(s.into_generation())
    }

    /// Starts a generation: resets the target's sequence, prefills `prompt[..n - 1]` and returns
    /// a [`Session`] that advances one verify step per [`Session::step`]. The session is also an
    /// iterator over the tokens of each step.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an empty prompt or one longer than the model's context, an
    /// invalid adaptive configuration; [`Error::TokenOutOfVocab`] for a prompt, EOS, stop-sequence
    /// or configuration token outside the vocabulary; errors of the target's forward.
    pub fn session<'g>(
        &'g mut self,
        prompt: &[u32],
        params: &'g GenerationParams,
    ) -> Result<Session<'g, T, P>> {
        let start = Instant::now();
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let max_ctx = self.target.max_context();
        if prompt.len() > max_ctx {
            return Err(Error::PromptTooLong {
                len: prompt.len(),
                max_context: max_ctx,
            });
        }
        let vocab = self.target.vocab_size();
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::TokenOutOfVocab {
                what: "prompt token",
                token: t,
                vocab_size: vocab,
            });
        }
        params.sampling.check_vocab(vocab)?;
        let stop_tokens = params
            .stop
            .eos
            .iter()
            .chain(params.stop.stop_sequences.iter().flatten());
        if let Some(&t) = stop_tokens.into_iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::TokenOutOfVocab {
                what: "EOS or stop-sequence token",
                token: t,
                vocab_size: vocab,
            });
        }
        if let DraftLength::Adaptive(a) = &params.draft {
            a.validate()?;
        }
        self.target.truncate(0)?;
        self.hidden.clear();
        self.adaptive.begin_generation();
        let mut metrics = Metrics::default();
        if prompt.len() > 1 {
            let t = Instant::now();
            self.target.prefill(&prompt[..prompt.len() - 1])?;
            metrics.prefill_time = t.elapsed();
            self.capture_hidden(prompt.len() - 2);
        }
        let t = Instant::now();
        self.proposer.begin(prompt)?;
        metrics.propose_time += t.elapsed();
        let mut s = Session {
            g: self,
            params,
            context: prompt.to_vec(),
            prompt_len: prompt.len(),
            metrics,
            logprobs: params.sampling.logprobs().map(|_| Vec::new()),
            finish: None,
            cancelled: false,
            start,
        };
        if prompt.len() == max_ctx {
            s.end(FinishReason::ContextFull);
        }
        Ok(s)
    }

    /// Keeps row `row` of the target's last hidden states for a heads proposer.
    fn capture_hidden(&mut self, row: usize) {
        let h = self.target.hidden_size();
        self.hidden.clear();
        if h == 0 {
            return;
        }
        if let Some(all) = self.target.last_hidden() {
            if let Some(r) = all.get(row * h..(row + 1) * h) {
                self.hidden.extend_from_slice(r);
            }
        }
    }
}

/// One generation in progress; see [`Generator::session`].
pub struct Session<'g, T, P> {
    g: &'g mut Generator<T, P>,
    params: &'g GenerationParams,
    context: Vec<u32>,
    prompt_len: usize,
    metrics: Metrics,
    logprobs: Option<Vec<TokenLogprob>>,
    finish: Option<FinishReason>,
    cancelled: bool,
    start: Instant,
}

impl<T: TargetModel, P: Proposer> Session<'_, T, P> {
    /// The new tokens so far.
    pub fn tokens(&self) -> &[u32] {
        &self.context[self.prompt_len..]
    }

    /// The finish reason once the generation has ended.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Metrics so far.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Cancels: the next [`Session::step`] returns `None` with [`FinishReason::Cancelled`].
    pub fn cancel(&mut self) {
        self.cancelled = true;
    }

    fn end(&mut self, reason: FinishReason) {
        if self.finish.is_none() {
            self.finish = Some(reason);
            self.metrics.total_time = self.start.elapsed();
            self.g.proposer.finish(&self.context);
        }
    }

    /// Runs one speculative step and returns the tokens it emitted (1 to k + 1 of them, cut at a
    /// stop condition), or `None` once the generation has ended.
    ///
    /// # Errors
    /// Errors of the proposer, the target's forward or truncate, and the verifier (for example
    /// [`Error::NonFiniteLogits`]); [`Error::ShapeMismatch`] when the target returns logits of the
    /// wrong size or a proposer returns q of the wrong size. After an error the session should be
    /// dropped.
    pub fn step(&mut self) -> Result<Option<&[u32]>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let cancelled_flag = self
            .params
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed));
        if self.cancelled || cancelled_flag {
            self.end(FinishReason::Cancelled);
            return Ok(None);
        }
        let params = self.params;
        let generated = self.context.len() - self.prompt_len;
        let remaining = params.stop.max_new_tokens.saturating_sub(generated);
        let room = self
            .g
            .target
            .max_context()
            .saturating_sub(self.context.len());
        if remaining == 0 {
            self.end(FinishReason::MaxTokens);
            return Ok(None);
        }
        if room == 0 {
            self.end(FinishReason::ContextFull);
            return Ok(None);
        }
        // Accepted drafts plus the bonus token must fit the budget and the context.
        let cap = remaining.min(room) - 1;
        let k_req = match &params.draft {
            DraftLength::Off => 0,
            DraftLength::Fixed(k) => (*k).min(cap),
            DraftLength::Adaptive(a) => self.g.adaptive.choose(a, cap),
        };
        let g = &mut *self.g;
        let vocab = g.target.vocab_size();

        // Propose.
        let t = Instant::now();
        g.draft.clear();
        if k_req > 0 {
            let req = ProposeRequest {
                context: &self.context,
                config: &params.sampling,
                max_draft: k_req,
                seed: params.seed,
                target_hidden: (!g.hidden.is_empty()).then_some(&g.hidden[..]),
                prompt_len: self.prompt_len,
                eos: &params.stop.eos,
                suppress_eos_rows: 0,
            };
            g.proposer.propose(&req, &mut g.draft)?;
            g.draft.tokens.truncate(k_req);
        }
        let k = g.draft.tokens.len();
        let draft_probs = match &mut g.draft.q {
            None => DraftProbs::PointMass,
            Some(q) => {
                let qv = g.draft.q_vocab;
                if q.len() < k * qv {
                    return Err(Error::ShapeMismatch {
                        what: "proposer q ([k, q_vocab])",
                        expected: k * qv,
                        actual: q.len(),
                    });
                }
                q.truncate(k * qv);
                DraftProbs::Probs {
                    probs: q,
                    vocab: qv,
                }
            }
        };
        let propose_time = t.elapsed();

        // One target forward over [last token, d_1 .. d_k].
        let t = Instant::now();
        let Some(&last) = self.context.last() else {
            return Err(Error::EmptyPrompt);
        };
        let mut feed = Vec::with_capacity(k + 1);
        feed.push(last);
        feed.extend_from_slice(&g.draft.tokens);
        g.target.forward(&feed, &mut g.logits)?;
        let forward_time = t.elapsed();
        if g.logits.len() != (k + 1) * vocab {
            return Err(Error::ShapeMismatch {
                what: "target logits ([k + 1, vocab])",
                expected: (k + 1) * vocab,
                actual: g.logits.len(),
            });
        }

        // Verify.
        let t = Instant::now();
        let req = VerifyRequest {
            config: &params.sampling,
            target_logits: &g.logits,
            vocab_size: vocab,
            draft_tokens: &g.draft.tokens,
            draft_probs,
            context: &self.context,
            seed: params.seed,
            position: Some(self.context.len() as u64),
            prompt_len: self.prompt_len,
            suppress: &[],
            suppress_rows: 0,
            final_draft_ends: false,
        };
        let out = g.verifier.verify(&req)?;
        let verify_time = t.elapsed();

        // Commit: keep the context and the accepted drafts in the target's cache.
        let before = self.context.len();
        g.target.truncate(before + out.accepted)?;
        g.capture_hidden(out.accepted);

        let mut kept = 0;
        let mut reason = None;
        for &tok in &out.tokens {
            self.context.push(tok);
            kept += 1;
            if let Some(r) = params.stop.check(&self.context[self.prompt_len..]) {
                reason = Some(r);
                break;
            }
        }
        let accepted_kept = out.accepted.min(kept);
        if let (Some(all), Some(lps)) = (self.logprobs.as_mut(), out.logprobs) {
            all.extend(lps.into_iter().take(kept));
        }
        let t = Instant::now();
        g.proposer
            .observe(accepted_kept, &self.context[before..before + kept])?;
        let observe_time = t.elapsed();

        let m = &mut self.metrics;
        m.record_step(k, out.accepted, accepted_kept, kept);
        m.propose_time += propose_time + observe_time;
        m.forward_time += forward_time;
        m.verify_time += verify_time;
        if m.time_to_first_token.is_none() {
            m.time_to_first_token = Some(self.start.elapsed());
        }
        if let DraftLength::Adaptive(a) = &params.draft {
            g.adaptive.observe(
                a,
                k,
                out.accepted,
                forward_time.as_secs_f64(),
                (propose_time + observe_time).as_secs_f64(),
            );
        }

        let generated = self.context.len() - self.prompt_len;
        if let Some(r) = reason {
            self.end(r);
        } else if generated >= params.stop.max_new_tokens {
            self.end(FinishReason::MaxTokens);
        } else if self.context.len() >= self.g.target.max_context() {
            self.end(FinishReason::ContextFull);
        }
        Ok(Some(&self.context[before..before + kept]))
    }

    /// Ends the session (as cancelled if it was still running) and returns the result.
    pub fn into_generation(mut self) -> Generation {
        if self.finish.is_none() {
            self.end(FinishReason::Cancelled);
        }
        Generation {
            tokens: self.context[self.prompt_len..].to_vec(),
            finish: self.finish.unwrap_or(FinishReason::Cancelled),
            metrics: std::mem::take(&mut self.metrics),
            logprobs: self.logprobs.take(),
        }
    }

    /// Total wall time so far.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

impl<T: TargetModel, P: Proposer> Iterator for Session<'_, T, P> {
    type Item = Result<Vec<u32>>;

    /// The tokens of the next step; `None` once finished. An error ends the iteration.
    fn next(&mut self) -> Option<Self::Item> {
        match self.step() {
            Ok(Some(t)) => Some(Ok(t.to_vec())),
            Ok(None) => None,
            Err(e) => {
                self.finish = Some(FinishReason::Cancelled);
                Some(Err(e))
            }
        }
    }
}
