//! The speculative decoding loop.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::costs::{MeasuredCosts, StepCosts};
use super::metrics::Metrics;
use super::params::GenerationParams;
use super::policy::{AdaptiveState, DraftLength, TreeShape};
use super::seed::SeedSource;
use super::stop::{Detokenizer, FinishReason, StopScan, TextMark, TextTracker};
use crate::error::{Error, ProposalFault, Result};
use crate::model::TargetModel;
use crate::propose::{Draft, ProposeRequest, Proposer, VerifiedRows};
use crate::tree::TreeLimits;
use crate::verify::{DraftProbs, StepEnd, StepOutput, TokenLogprob, Verifier, VerifyRequest};

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
    /// The text of the new tokens when the generator has a [`Detokenizer`], cut before a
    /// completed stop string (or after it with
    /// [`StopConditions::include_stop_str_in_output`](super::StopConditions::include_stop_str_in_output));
    /// see the stop rules in [`crate::decode`].
    pub text: Option<String>,
    /// The seed the generation used: [`GenerationParams::seed`], or the one drawn from the
    /// generator's [`SeedSource`] when that was `None` (pass it back to reproduce the output).
    pub seed: u64,
}

/// A generation that failed: the error, and everything emitted before it.
///
/// `partial.finish` is [`FinishReason::Error`]; `partial.tokens` (and `text`, `logprobs`) hold
/// every token the generation emitted, and streamed, before the failure. The target's KV cache
/// was rolled back to the emitted tokens, so the [`Generator`] can run the next request, which
/// gives the same output as on a fresh generator.
#[derive(Debug)]
pub struct GenerationError {
    /// What failed.
    pub error: Error,
    /// The generation up to the failure (boxed: it is large and the error path is rare).
    pub partial: Box<Generation>,
}

impl std::fmt::Display for GenerationError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (after {} generated tokens)",
            self.error,
            self.partial.tokens.len()
        )
    }
}

impl std::error::Error for GenerationError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<GenerationError> for Error {
    /// Keeps the error, drops the partial output.
    fn from(e: GenerationError) -> Self {
        e.error
    }
}

/// One streamed step: what [`Generator::generate_stream`] hands the callback.
#[derive(Debug, Clone, Copy)]
pub struct StreamChunk<'a> {
    /// The tokens this step emitted (1 to k + 1, cut at a stop).
    pub tokens: &'a [u32],
    /// Their log-probabilities, when the sampling configuration asked for them.
    pub logprobs: Option<&'a [TokenLogprob]>,
    /// New text that can no longer become part of a stop string (empty without a
    /// [`Detokenizer`]). Text that could still complete a stop string is held back until it
    /// cannot; the concatenation of every chunk's text is [`Generation::text`].
    pub text: &'a str,
    /// The step's draft: size, shape and how much of it was accepted.
    pub step: StepStats,
}

/// What one verify step drafted and accepted ([`StreamChunk::step`], [`Session::last_step`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Draft tokens verified: the draft length k of a chain, the node count of a tree.
    pub drafted: usize,
    /// Depth of the draft: k for a chain, the deepest node's depth for a tree.
    pub depth: usize,
    /// Accepted drafts kept (the accepted path length of a tree), after stop conditions.
    pub accepted: usize,
    /// `true` when the draft was a branching token tree.
    pub tree: bool,
}

/// Runs speculative decoding: propose, one target forward over `[last token, d_1 .. d_k]`, verify,
/// commit, roll back the rejected part of the target's KV cache.
///
/// The target is called exactly once per step. The draft length is capped so that accepted drafts
/// plus the bonus token never exceed the token budget or the model's context; with one slot left
/// the step is a plain decoding step. A draft that reaches an end (EOS, a stop sequence or a stop
/// string) is cut there, and the target processes no row after it (case C11).
///
/// With a target that offers [`crate::HiddenStates`], the loop keeps the target's final hidden
/// states of every context position for the generation (`[context.len() - 1, hidden]` f32, a
/// copy of `hidden` floats per emitted token; SmolLM2-135M: 2.3 KB per position) and hands them
/// to the proposer as [`ProposeRequest::target_hidden_rows`] (feature-conditioned draft models,
/// see [`crate::TargetFeatures`]).
///
/// `Generator<T, P>` is `Send` when `T` and `P` are.
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
/// let mut generator = Generator::new(target, PromptLookup::new(2, 5).unwrap());
/// let out = generator.generate(&[3; 48], &GenerationParams::greedy(32)).unwrap();
/// assert_eq!(out.tokens.len(), 32);
/// ```
pub struct Generator<T, P> {
    target: T,
    proposer: P,
    verifier: Verifier,
    adaptive: AdaptiveState,
    /// Where the adaptive policy's step costs come from.
    costs: Arc<dyn StepCosts>,
    logits: Vec<f32>,
    draft: Draft,
    hidden: Vec<f32>,
    /// The target's final hidden states of every context position but the last
    /// (`[context.len() - 1, hidden_width]`), while `hidden_rows_ok`.
    hidden_rows: Vec<f32>,
    /// `hidden_rows` is complete for the current generation (the target exposes hidden states
    /// and every forward gave rows of the documented size).
    hidden_rows_ok: bool,
    /// Width of a row of `hidden_rows`.
    hidden_width: usize,
    detokenizer: Option<Box<dyn Detokenizer>>,
    /// Seeds of requests without one.
    seeds: SeedSource,
    /// Per node of a tree draft: accepting it ends the generation.
    node_ends: Vec<bool>,
    /// Scratch for tree paths.
    path: Vec<u32>,
    /// Input token of each target row of the step (for [`Proposer::observe_rows`]).
    row_inputs: Vec<u32>,
}

impl<T: TargetModel, P: Proposer> Generator<T, P> {
    /// A generator over `target` with `proposer`.
    pub fn new(target: T, proposer: P) -> Self {
        Generator {
            target,
            proposer,
            verifier: Verifier::new(),
            adaptive: AdaptiveState::default(),
            costs: Arc::new(MeasuredCosts),
            logits: Vec::new(),
            draft: Draft::default(),
            hidden: Vec::new(),
            hidden_rows: Vec::new(),
            hidden_rows_ok: false,
            hidden_width: 0,
            detokenizer: None,
            seeds: SeedSource::default(),
            node_ends: Vec::new(),
            path: Vec::new(),
            row_inputs: Vec::new(),
        }
    }

    /// Adds a [`Detokenizer`]: generations then report their text, stream text, and may use stop
    /// strings.
    pub fn with_detokenizer(mut self, detokenizer: impl Detokenizer + 'static) -> Self {
        self.detokenizer = Some(Box::new(detokenizer));
        self
    }

    /// Sets where requests without a seed get theirs (default [`SeedSource::os`]).
    pub fn with_seed_source(mut self, seeds: SeedSource) -> Self {
        self.seeds = seeds;
        self
    }

    /// Sets where the adaptive policy ([`DraftLength::Adaptive`]) learns step costs from:
    /// [`MeasuredCosts`] (the measured forward and propose times, the default) or, for example,
    /// a [`FixedCosts`](super::FixedCosts) curve, which makes the policy's choices and so a
    /// seeded run's steps reproducible whatever the machine's load. [`Metrics`] keep the
    /// measured times either way.
    pub fn with_costs(self, costs: impl StepCosts + 'static) -> Self {
        self.with_shared_costs(Arc::new(costs))
    }

    /// [`Generator::with_costs`] with a source shared with others (the batch loop's).
    pub(crate) fn with_shared_costs(mut self, costs: Arc<dyn StepCosts>) -> Self {
        self.costs = costs;
        self
    }

    /// Where the adaptive policy learns step costs from ([`Generator::with_costs`]).
    pub fn costs(&self) -> &dyn StepCosts {
        &*self.costs
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

    /// The adaptive policy's current estimates (acceptance per position, and by depth and
    /// sibling rank for trees; forward cost by rows; the last tree shape chosen).
    pub fn adaptive_state(&self) -> &AdaptiveState {
        &self.adaptive
    }

    /// The sibling schemes of the current draft (empty: the draft form's default).
    pub(crate) fn draft_schemes(&self) -> &[crate::SiblingScheme] {
        &self.draft.schemes
    }

    /// The adaptive policy's state, mutably (the batch loop's probe schedule).
    pub(crate) fn adaptive_mut(&mut self) -> &mut AdaptiveState {
        &mut self.adaptive
    }

    /// Gives back the target and the proposer.
    pub fn into_parts(self) -> (T, P) {
        (self.target, self.proposer)
    }

    /// Generates until a stop condition; returns the new tokens and metrics.
    ///
    /// # Errors
    /// A [`GenerationError`] holding the error (see [`Generator::session`] and
    /// [`Session::step`]) and the tokens emitted before it.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &GenerationParams,
    ) -> Result<Generation, GenerationError> {
        self.generate_stream(prompt, params, |_| ControlFlow::Continue(()))
    }

    /// Generates, calling `on_tokens` with the tokens of each verified step as soon as it is
    /// verified (streaming). Returning `ControlFlow::Break(())` cancels the generation.
    ///
    /// # Errors
    /// As [`Generator::generate`].
    pub fn generate_with(
        &mut self,
        prompt: &[u32],
        params: &GenerationParams,
        mut on_tokens: impl FnMut(&[u32]) -> ControlFlow<()>,
    ) -> Result<Generation, GenerationError> {
        self.generate_stream(prompt, params, |c| on_tokens(c.tokens))
    }

    /// Generates, calling `on_chunk` after each verified step with its tokens, their
    /// log-probabilities and the text that became final ([`StreamChunk`]). Returning
    /// `ControlFlow::Break(())` cancels the generation.
    ///
    /// # Errors
    /// As [`Generator::generate`]; everything streamed before an error is also in the
    /// [`GenerationError`]'s partial generation.
    pub fn generate_stream(
        &mut self,
        prompt: &[u32],
        params: &GenerationParams,
        mut on_chunk: impl FnMut(StreamChunk<'_>) -> ControlFlow<()>,
    ) -> Result<Generation, GenerationError> {
        let mut s = match self.session(prompt, params) {
            Ok(s) => s,
            Err(error) => {
                return Err(GenerationError {
                    error,
                    partial: Box::new(Generation {
                        tokens: Vec::new(),
                        finish: FinishReason::Error,
                        metrics: Metrics::default(),
                        logprobs: None,
                        text: None,
                        seed: params.seed.unwrap_or(0),
                    }),
                });
            }
        };
        loop {
            match s.step() {
                Ok(Some(_)) => {
                    if on_chunk(s.last_chunk()).is_break() {
                        s.cancel();
                    }
                }
                Ok(None) => return Ok(s.into_generation()),
                Err(error) => {
                    return Err(GenerationError {
                        error,
                        partial: Box::new(s.into_generation()),
                    });
                }
            }
        }
    }

    /// Starts a generation: validates `params`, resets the target's sequence, prefills
    /// `prompt[..n - 1]` and returns a [`Session`] that advances one verify step per
    /// [`Session::step`]. The session is also an iterator over the tokens of each step.
    ///
    /// # Errors
    /// [`Error::EmptyPrompt`], [`Error::PromptTooLong`]; [`Error::TokenOutOfVocab`] for a prompt
    /// token; the errors of [`GenerationParams::validate`]; errors of the target's truncate and
    /// prefill and of the proposer's `begin`. Nothing reaches the target before the request is
    /// validated.
    pub fn session<'g>(
        &'g mut self,
        prompt: &[u32],
        params: &'g GenerationParams,
    ) -> Result<Session<'g, T, P>> {
        self.start(prompt, params, true)
    }

    /// [`Generator::session`], with the prompt prefill left to the caller when `prefill` is
    /// `false` (the batch loop prefills slots in chunks): the target must then hold
    /// `prompt[..n - 1]` before the first step.
    pub(crate) fn start<'g>(
        &'g mut self,
        prompt: &[u32],
        params: &'g GenerationParams,
        prefill: bool,
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
        params.validate(vocab, self.detokenizer.is_some())?;
        let seed = params.seed.unwrap_or_else(|| self.seeds.next_seed());
        self.target.truncate(0)?;
        self.hidden.clear();
        self.hidden_rows.clear();
        self.hidden_width = self.target.hidden_states().map_or(0, |hs| hs.hidden_size());
        self.hidden_rows_ok = self.hidden_width > 0;
        self.adaptive.begin_generation();
        let mut metrics = Metrics::default();
        if prefill && prompt.len() > 1 {
            let t = Instant::now();
            self.target.prefill(&prompt[..prompt.len() - 1])?;
            metrics.prefill_time = t.elapsed();
            check_seq_len(&self.target, prompt.len() - 1, "seq_len after prefill")?;
            self.capture_hidden(prompt.len() - 2);
            let n = prompt.len() - 1;
            self.append_hidden_rows(0..n, n);
        }
        let t = Instant::now();
        self.proposer.begin(prompt)?;
        metrics.propose_time += t.elapsed();
        let mut s = Session {
            g: self,
            params,
            context: prompt.to_vec(),
            prompt_len: prompt.len(),
            seed,
            metrics,
            logprobs: params.sampling.logprobs().map(|_| Vec::new()),
            suppressed: params.stop.suppressed_ids(),
            text: TextTracker::default(),
            last: LastStep::default(),
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
        self.hidden.clear();
        let Some(hs) = self.target.hidden_states() else {
            return;
        };
        let h = hs.hidden_size();
        if h == 0 {
            return;
        }
        if let Some(all) = hs.last_hidden()
            && let Some(r) = all.get(row * h..(row + 1) * h)
        {
            self.hidden.extend_from_slice(r);
        }
    }
}

impl<T: TargetModel, P> Generator<T, P> {
    /// Appends rows `rows` (indices into the rows of the target's last forward, which appended
    /// `appended` positions) to `hidden_rows`, the features of the positions just committed.
    /// Missing hidden states, a row count other than `appended` or a changed width end the
    /// buffer for the rest of the generation (proposers then get `None`); never panics.
    fn append_hidden_rows(&mut self, rows: impl Iterator<Item = usize>, appended: usize) {
        if !self.hidden_rows_ok {
            return;
        }
        let h = self.hidden_width;
        let all = self
            .target
            .hidden_states()
            .filter(|hs| hs.hidden_size() == h)
            .and_then(|hs| hs.last_hidden())
            .filter(|all| Some(all.len()) == appended.checked_mul(h));
        let Some(all) = all else {
            self.hidden_rows_ok = false;
            self.hidden_rows.clear();
            return;
        };
        for r in rows {
            match all.get(r * h..(r + 1) * h) {
                Some(row) => self.hidden_rows.extend_from_slice(row),
                None => {
                    self.hidden_rows_ok = false;
                    self.hidden_rows.clear();
                    return;
                }
            }
        }
    }
}

/// The hidden rows `rows` (of width `width`) of every position of a context of `len` tokens but
/// the last, when complete (`ok`) and of that size.
fn hidden_rows_for(rows: &[f32], ok: bool, width: usize, len: usize) -> Option<&[f32]> {
    let want = len.checked_sub(1)?.checked_mul(width)?;
    (ok && rows.len() == want).then_some(rows)
}

/// The stop scan of a request: with `params`' stops and floor, and the detokenizer when the text
/// is tracked (always at a commit; for drafts, only when stop strings need it).
fn stop_scan<'a>(
    params: &'a GenerationParams,
    detokenizer: &'a Option<Box<dyn Detokenizer>>,
    drafts: bool,
) -> StopScan<'a> {
    let text = !drafts || !params.stop.stop_strings.is_empty();
    StopScan {
        stop: &params.stop,
        min_tokens: params.min_tokens,
        detokenizer: detokenizer.as_deref().filter(|_| text),
    }
}

/// `Err(TargetContract)` unless the target holds `expected` positions.
fn check_seq_len<T: TargetModel>(target: &T, expected: usize, what: &'static str) -> Result<()> {
    if target.seq_len() != expected {
        return Err(Error::TargetContract { what });
    }
    Ok(())
}

/// Ranges of the last step's output, for [`Session::last_chunk`].
#[derive(Debug, Default, Clone, Copy)]
struct LastStep {
    tokens: (usize, usize),
    text: (usize, usize),
    stats: StepStats,
}

/// One generation in progress; see [`Generator::session`].
pub struct Session<'g, T, P> {
    g: &'g mut Generator<T, P>,
    params: &'g GenerationParams,
    context: Vec<u32>,
    prompt_len: usize,
    /// The seed in use ([`Generation::seed`]).
    seed: u64,
    metrics: Metrics,
    logprobs: Option<Vec<TokenLogprob>>,
    /// Ids banned before `min_tokens` ([`StopConditions::suppressed_ids`]).
    suppressed: Vec<u32>,
    text: TextTracker,
    last: LastStep,
    finish: Option<FinishReason>,
    cancelled: bool,
    start: Instant,
}

/// A [`Session`]'s own state without its borrows of the generator and the parameters, so that
/// the batch loop can keep many generations and resume each for one phase at a time.
pub(crate) struct Parked {
    context: Vec<u32>,
    prompt_len: usize,
    /// The seed in use ([`Generation::seed`]).
    seed: u64,
    metrics: Metrics,
    logprobs: Option<Vec<TokenLogprob>>,
    suppressed: Vec<u32>,
    text: TextTracker,
    last: LastStep,
    finish: Option<FinishReason>,
    cancelled: bool,
    start: Instant,
}

impl Parked {
    /// Tokens of the context (prompt and generated).
    pub(crate) fn len(&self) -> usize {
        self.context.len()
    }

    /// Whether the generation has ended.
    pub(crate) fn finished(&self) -> bool {
        self.finish.is_some()
    }

    /// The most drafts a step may verify now ([`draft_cap`]).
    pub(crate) fn draft_cap(&self, params: &GenerationParams, max_context: usize) -> usize {
        draft_cap(self.context.len(), self.prompt_len, params, max_context)
    }

    /// The verify request of the planned step `p` of this parked session of `g` (its target
    /// logits left empty: the batch loop passes them in the [`crate::VerifyBatch`]).
    pub(crate) fn verify_request<'s, T: TargetModel, P: Proposer>(
        &'s self,
        g: &'s Generator<T, P>,
        params: &'s GenerationParams,
        p: &Proposed,
    ) -> VerifyRequest<'s> {
        let v = SeqView {
            context: &self.context,
            prompt_len: self.prompt_len,
            seed: self.seed,
            suppressed: &self.suppressed,
        };
        build_request(g, params, v, p, &[])
    }

    /// The rows the planned step `p` of this parked session of `g` appends: the chain
    /// `[last, d_1 .. d_rows-1]` (written into `feed`), or the root and the draft tree.
    pub(crate) fn feed<'s, T, P>(
        &'s self,
        g: &'s Generator<T, P>,
        p: &Proposed,
        feed: &'s mut Vec<u32>,
    ) -> crate::SlotInput<'s> {
        let last = self.context.last().copied().unwrap_or(0);
        if p.tree {
            return crate::SlotInput::Tree {
                root: last,
                block: g.draft.block(),
            };
        }
        feed.clear();
        feed.push(last);
        feed.extend_from_slice(&g.draft.tokens[..p.rows() - 1]);
        crate::SlotInput::Chain(feed)
    }
}

/// The most drafts a step may verify with `len` context tokens of which `prompt_len` are the
/// prompt: accepted drafts plus the bonus token must fit the token budget and the context; 0
/// once either is used up.
fn draft_cap(
    len: usize,
    prompt_len: usize,
    params: &GenerationParams,
    max_context: usize,
) -> usize {
    let remaining = params.max_new_tokens.saturating_sub(len - prompt_len);
    let room = max_context.saturating_sub(len);
    remaining.min(room).saturating_sub(1)
}

/// The parts of a session a verify request reads.
struct SeqView<'s> {
    context: &'s [u32],
    prompt_len: usize,
    seed: u64,
    suppressed: &'s [u32],
}

/// The verify request of a proposed step (shared by [`Session`] and the batch loop).
fn build_request<'s, T: TargetModel, P: Proposer>(
    g: &'s Generator<T, P>,
    params: &'s GenerationParams,
    v: SeqView<'s>,
    p: &Proposed,
    target_logits: &'s [f32],
) -> VerifyRequest<'s> {
    let draft_probs = match &g.draft.q {
        None => DraftProbs::PointMass,
        Some(q) => DraftProbs::Probs {
            probs: q,
            vocab: g.draft.q_vocab,
        },
    };
    VerifyRequest {
        config: &params.sampling,
        target_logits,
        vocab_size: g.target.vocab_size(),
        draft_tokens: &g.draft.tokens,
        draft_probs,
        context: v.context,
        seed: v.seed,
        position: Some(v.context.len() as u64),
        prompt_len: v.prompt_len,
        suppress: v.suppressed,
        suppress_rows: p.suppress_rows,
        final_draft_ends: p.ends,
        parents: p.tree.then_some(&g.draft.parents[..]),
        schemes: (p.tree && !g.draft.schemes.is_empty()).then_some(&g.draft.schemes[..]),
        ends: if p.tree { &g.node_ends } else { &[] },
        row_top_k: g.proposer.row_candidates(),
    }
}

impl<'g, T, P> Session<'g, T, P> {
    /// Takes the session's own state out, releasing its borrows.
    pub(crate) fn park(self) -> Parked {
        Parked {
            context: self.context,
            prompt_len: self.prompt_len,
            seed: self.seed,
            metrics: self.metrics,
            logprobs: self.logprobs,
            suppressed: self.suppressed,
            text: self.text,
            last: self.last,
            finish: self.finish,
            cancelled: self.cancelled,
            start: self.start,
        }
    }

    /// A session over `g` and `params` with the state `p` parked by [`Session::park`] (of a
    /// session of the same generator and parameters).
    pub(crate) fn resume(
        g: &'g mut Generator<T, P>,
        params: &'g GenerationParams,
        p: Parked,
    ) -> Self {
        Session {
            g,
            params,
            context: p.context,
            prompt_len: p.prompt_len,
            seed: p.seed,
            metrics: p.metrics,
            logprobs: p.logprobs,
            suppressed: p.suppressed,
            text: p.text,
            last: p.last,
            finish: p.finish,
            cancelled: p.cancelled,
            start: p.start,
        }
    }
}

/// What the draft phase produced: draft length (nodes, for a tree), whether the final draft of
/// a chain ends the sequence, whether the draft is a tree (then `Generator::node_ends` says
/// which nodes end it), its depth, and the time spent.
pub(crate) struct Proposed {
    pub(crate) k: usize,
    pub(crate) ends: bool,
    pub(crate) tree: bool,
    depth: usize,
    time: Duration,
    /// The tree-shape policy chose the request (its observation goes to
    /// [`AdaptiveState::observe_draft`]).
    shaped: bool,
    /// Leading rows (depths) at which the EOS ids are banned (`min_tokens`).
    suppress_rows: usize,
}

impl Proposed {
    /// Target rows of the step: `k + 1`, `k` when the final draft of a chain ends the sequence.
    pub(crate) fn rows(&self) -> usize {
        self.k + 1 - self.ends as usize
    }
}

impl<T: TargetModel, P: Proposer> Session<'_, T, P> {
    /// The new tokens so far.
    pub fn tokens(&self) -> &[u32] {
        &self.context[self.prompt_len..]
    }

    /// The text of the new tokens so far (complete characters only; `None` without a
    /// [`Detokenizer`]).
    pub fn text(&self) -> Option<&str> {
        self.g.detokenizer.as_ref().map(|_| self.text.output())
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

    /// The tokens, log-probabilities and released text of the last successful
    /// [`Session::step`].
    pub fn last_chunk(&self) -> StreamChunk<'_> {
        let (a, b) = self.last.tokens;
        let (ta, tb) = self.last.text;
        StreamChunk {
            tokens: &self.tokens()[a..b],
            logprobs: self.logprobs.as_deref().map(|l| &l[a..b]),
            text: &self.text.text[ta..tb],
            step: self.last.stats,
        }
    }

    /// The draft size, depth and accepted length of the last successful [`Session::step`].
    pub fn last_step(&self) -> StepStats {
        self.last.stats
    }

    fn end(&mut self, reason: FinishReason) {
        if self.finish.is_none() {
            self.finish = Some(reason);
            self.metrics.total_time = self.start.elapsed();
            // Rule 6: unless a stop string cut it, the text is that of every emitted token
            // (best effort: the same window decoded without error at the last commit).
            if reason != FinishReason::StopString
                && let Some(d) = self.g.detokenizer.as_deref()
            {
                let _ = self.text.flush(d, &self.context[self.prompt_len..]);
            }
            if reason != FinishReason::Error {
                self.g.proposer.finish(&self.context);
            }
        }
    }

    /// Runs one speculative step and returns the tokens it emitted (1 to k + 1 of them, cut at a
    /// stop condition), or `None` once the generation has ended.
    ///
    /// # Errors
    /// Errors of the proposer, the target's forward or truncate, and the verifier (for example
    /// [`Error::NonFiniteLogits`]); [`Error::InvalidProposal`] when the proposer returns more
    /// than `max_draft` tokens, a token outside the vocabulary or q of the wrong shape (the
    /// target never sees such a draft); [`Error::ShapeMismatch`] when the target returns logits
    /// of the wrong size; [`Error::TargetContract`] when its sequence length is off. After an
    /// error the session has ended ([`FinishReason::Error`]), [`Session::tokens`] holds every
    /// token emitted by the steps before (the failed step emits nothing), and the target's KV
    /// cache is rolled back to them.
    pub fn step(&mut self) -> Result<Option<&[u32]>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let (len, text) = (self.context.len(), self.text.mark());
        match self.step_inner() {
            Ok(true) => {
                let (a, b) = self.last.tokens;
                Ok(Some(
                    &self.context[self.prompt_len + a..self.prompt_len + b],
                ))
            }
            Ok(false) => Ok(None),
            Err(e) => {
                self.fail((len, text));
                Err(e)
            }
        }
    }

    /// Where a step starts: the context length and the text mark, for [`Session::fail`].
    pub(crate) fn mark(&self) -> (usize, super::stop::TextMark) {
        (self.context.len(), self.text.mark())
    }

    /// Ends the session after a failed step that started at `mark` ([`Session::mark`]):
    /// forgets the step's tokens (they were never streamed), and leaves the target holding
    /// exactly the emitted tokens but the last (the loop's invariant), whatever the failing
    /// call left behind. Best effort: the next generation starts with truncate(0) anyway.
    pub(crate) fn fail(&mut self, (len, text): (usize, super::stop::TextMark)) {
        self.context.truncate(len);
        self.text.reset(&text);
        if let Some(l) = self.logprobs.as_mut() {
            l.truncate(len - self.prompt_len);
        }
        let _ = self.g.target.truncate(len - 1);
        let rows = (len - 1) * self.g.hidden_width;
        if self.g.hidden_rows.len() >= rows {
            self.g.hidden_rows.truncate(rows);
        } else {
            self.g.hidden_rows_ok = false;
        }
        self.end(FinishReason::Error);
    }

    /// The step's phases: budget, propose, forward, verify, commit, observe. `Ok(false)` when
    /// the generation ended before doing anything.
    fn step_inner(&mut self) -> Result<bool> {
        let Some(proposed) = self.plan(None)? else {
            return Ok(false);
        };
        let forward = self.forward(&proposed)?;
        let (out, verify) = self.verify(&proposed)?;
        self.finish_step(&proposed, out, forward, verify)?;
        Ok(true)
    }

    /// The commit and observe phases of a verified step.
    pub(crate) fn finish_step(
        &mut self,
        p: &Proposed,
        out: StepOutput,
        forward: Duration,
        verify: Duration,
    ) -> Result<()> {
        let kept = self.commit(p, &out)?;
        self.observe(p, out, kept, forward, verify)
    }

    /// The most drafts a step may verify now (accepted drafts plus the bonus token must fit
    /// the token budget and the context); 0 once the budget or the context is used up.
    /// `true` once [`Session::cancel`] was called.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled
    }

    /// Budget and propose phases: ends the session on cancellation, a used-up budget or a full
    /// context (`Ok(None)`), else chooses the draft length (or tree shape) and proposes.
    /// `k_override` replaces the adaptive policy's choice of an
    /// [`DraftLength::Adaptive`] request by a chain of that length (capped; the batch loop's
    /// goodput policy); fixed and disabled drafts ignore it.
    pub(crate) fn plan(&mut self, k_override: Option<usize>) -> Result<Option<Proposed>> {
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
        let remaining = params.max_new_tokens.saturating_sub(generated);
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
        // Tree drafts: every node holds a KV slot until the commit, so the node budget is also
        // capped by the context room (the depth, like a chain's k, by `cap`).
        let tree_room = if params.tree_nodes > 0 {
            let max = self.g.target.tree().map_or(0, |t| t.max_tree_nodes());
            params.tree_nodes.min(max).min(room)
        } else {
            0
        };
        let user_branch = match params.tree_branch {
            0 => usize::MAX,
            b => b,
        };
        let (k_req, nodes, branch, shaped) = match &params.draft {
            DraftLength::Off => (0, 0, user_branch, false),
            DraftLength::Adaptive(_) if k_override.is_some() => {
                (k_override.unwrap_or(0).min(cap), 0, user_branch, false)
            }
            DraftLength::Fixed(k) => {
                let k = (*k).min(cap);
                (k, if k > 0 { tree_room } else { 0 }, user_branch, false)
            }
            // The cost-aware tree-shape policy: node budget, depth and branching per step.
            DraftLength::Adaptive(a) if tree_room > 0 => {
                let limits = TreeShape {
                    nodes: tree_room,
                    depth: cap,
                    branch: user_branch,
                };
                let s = self.g.adaptive.choose_tree(a, limits);
                (s.depth, s.nodes, s.branch.clamp(1, user_branch), true)
            }
            DraftLength::Adaptive(a) => (self.g.adaptive.choose(a, cap), 0, user_branch, false),
        };
        let suppress_rows = params.min_tokens.saturating_sub(generated);
        let mut proposed = self.propose(k_req, nodes, branch, suppress_rows)?;
        proposed.shaped = shaped;
        Ok(Some(proposed))
    }

    /// Propose phase: asks the proposer for up to `k_req` drafts (a tree of at most `nodes`
    /// nodes, depth `k_req` and `branch` children per node when `nodes > 0`), checks them, and
    /// cuts the draft at its first end (EOS, stop sequence or stop string; case C11): a chain
    /// after the ending token, a tree below every ending node.
    fn propose(
        &mut self,
        k_req: usize,
        nodes: usize,
        branch: usize,
        suppress_rows: usize,
    ) -> Result<Proposed> {
        let t = Instant::now();
        let params = self.params;
        let g = &mut *self.g;
        g.draft.clear();
        if k_req > 0 {
            let rows = hidden_rows_for(
                &g.hidden_rows,
                g.hidden_rows_ok,
                g.hidden_width,
                self.context.len(),
            );
            let req = ProposeRequest {
                context: &self.context,
                config: &params.sampling,
                max_draft: k_req,
                max_nodes: if nodes > 0 { nodes } else { k_req },
                max_branch: branch,
                seed: self.seed,
                target_hidden: (!g.hidden.is_empty()).then_some(&g.hidden[..]),
                target_hidden_rows: rows,
                prompt_len: self.prompt_len,
                eos: &params.stop.eos,
                suppress: &self.suppressed,
                suppress_rows,
            };
            if nodes > 0 {
                g.proposer.propose_tree(&req, &mut g.draft)?;
            } else {
                g.proposer.propose(&req, &mut g.draft)?;
            }
        }
        check_proposal(
            &g.draft,
            k_req,
            nodes,
            branch,
            g.target.vocab_size(),
            g.proposer.name(),
        )?;
        if plain_chain(&g.draft) {
            g.draft.parents.clear();
            g.draft.schemes.clear();
        }
        if !g.draft.parents.is_empty() {
            self.tree_ends()?;
            let g = &mut *self.g;
            if plain_chain(&g.draft) {
                // Pruning left a chain: only its last node can end the generation.
                let ends = g.node_ends.last().copied().unwrap_or(false);
                g.draft.parents.clear();
                g.draft.schemes.clear();
                let k = g.draft.len();
                return Ok(Proposed {
                    k,
                    ends,
                    tree: false,
                    depth: k,
                    time: t.elapsed(),
                    shaped: false,
                    suppress_rows,
                });
            }
            let depth = g.draft.block().max_depth();
            return Ok(Proposed {
                k: g.draft.len(),
                ends: false,
                tree: true,
                depth,
                time: t.elapsed(),
                shaped: false,
                suppress_rows,
            });
        }
        let (k, ends) = self.draft_end()?;
        let g = &mut *self.g;
        g.draft.tokens.truncate(k);
        if let Some(q) = g.draft.q.as_mut() {
            q.truncate(k * g.draft.q_vocab);
        }
        Ok(Proposed {
            k,
            ends,
            tree: false,
            depth: k,
            time: t.elapsed(),
            shaped: false,
            suppress_rows,
        })
    }

    /// Marks the tree nodes whose acceptance ends the generation (`Generator::node_ends`) and
    /// removes every node below one (case C11 for trees: no row past an end is processed). A
    /// node's path is checked exactly as a chain's tokens are ([`Session::draft_end`]); its
    /// ancestors were checked before it (topological order), so only its own token can end it.
    fn tree_ends(&mut self) -> Result<()> {
        let n = self.g.draft.len();
        self.g.node_ends.clear();
        self.g.node_ends.resize(n, false);
        let scan = stop_scan(self.params, &self.g.detokenizer, true);
        if n == 0 || !scan.active() {
            return Ok(());
        }
        let (len, root) = (self.context.len(), self.text.mark());
        // Each node's scan starts from its parent's text (the text after the parent's token).
        let mut marks: Vec<TextMark> = Vec::with_capacity(n);
        let keep_from = root.keep();
        let mut keep = vec![true; n];
        let mut path = std::mem::take(&mut self.g.path);
        let mut res = Ok(());
        for i in 0..n {
            let block = self.g.draft.block();
            let r = block.parent_row(i);
            marks.push(TextMark::default());
            if r > 0 && (!keep[r - 1] || self.g.node_ends[r - 1]) {
                keep[i] = false;
                continue;
            }
            block.path_to(i, &mut path);
            self.context.truncate(len);
            self.context
                .extend(path.iter().map(|&j| self.g.draft.tokens[j as usize]));
            self.text.reset(if r == 0 { &root } else { &marks[r - 1] });
            match scan.token(&mut self.text, &self.context[self.prompt_len..]) {
                Ok(end) => self.g.node_ends[i] = end.is_some(),
                Err(e) => {
                    res = Err(e);
                    break;
                }
            }
            marks[i] = self.text.mark_from(keep_from);
        }
        self.context.truncate(len);
        self.text.reset(&root);
        self.g.path = path;
        res?;
        if keep.iter().all(|&k| k) {
            return Ok(());
        }
        // Remove the pruned nodes: remap parent rows, keep q rows and end flags in step.
        let g = &mut *self.g;
        let d = &mut g.draft;
        let mut new_index = vec![u32::MAX; n];
        let mut w = 0usize;
        let qv = d.q_vocab;
        for i in 0..n {
            if !keep[i] {
                continue;
            }
            new_index[i] = w as u32;
            let r = d.parents[i] as usize;
            d.parents[w] = if r == 0 { 0 } else { new_index[r - 1] + 1 };
            d.tokens[w] = d.tokens[i];
            if !d.schemes.is_empty() {
                d.schemes[w] = d.schemes[i];
            }
            g.node_ends[w] = g.node_ends[i];
            if let Some(q) = d.q.as_mut() {
                q.copy_within(i * qv..(i + 1) * qv, w * qv);
            }
            w += 1;
        }
        d.tokens.truncate(w);
        d.parents.truncate(w);
        if !d.schemes.is_empty() {
            d.schemes.truncate(w);
        }
        g.node_ends.truncate(w);
        if let Some(q) = d.q.as_mut() {
            q.truncate(w * qv);
        }
        Ok(())
    }

    /// The draft length after cutting at the first draft token that would end the generation,
    /// and whether the (new) final draft ends it: the commit's stop scan over the context plus
    /// the drafts (rule 8 of the module's stop rules).
    fn draft_end(&mut self) -> Result<(usize, bool)> {
        let k = self.g.draft.tokens.len();
        let scan = stop_scan(self.params, &self.g.detokenizer, true);
        if k == 0 || !scan.active() {
            return Ok((k, false));
        }
        // Append the drafts tentatively (no copy of the context), check, then roll back.
        let (len, mark) = (self.context.len(), self.text.mark());
        let mut end = Ok((k, false));
        for j in 0..k {
            self.context.push(self.g.draft.tokens[j]);
            match scan.token(&mut self.text, &self.context[self.prompt_len..]) {
                Ok(None) => {}
                Ok(Some(_)) => {
                    end = Ok((j + 1, true));
                    break;
                }
                Err(e) => {
                    end = Err(e);
                    break;
                }
            }
        }
        self.context.truncate(len);
        self.text.reset(&mark);
        end
    }

    /// Forward phase: one target forward over `[last, d_1 .. d_k]` (a chain, without the final
    /// draft when it ends the sequence) or over the root and every node of a tree
    /// ([`crate::TreeTarget::forward_tree`]); checks the logits' shape and the sequence length.
    fn forward(&mut self, p: &Proposed) -> Result<Duration> {
        let g = &mut *self.g;
        let vocab = g.target.vocab_size();
        let k = p.k;
        let rows = k + 1 - p.ends as usize;
        let t = Instant::now();
        let Some(&last) = self.context.last() else {
            return Err(Error::EmptyPrompt);
        };
        if p.tree {
            // One tree forward over the root and every node (each attends to its ancestors).
            let Some(tree) = g.target.tree() else {
                return Err(Error::TargetContract {
                    what: "tree() returned None after offering tree support",
                });
            };
            tree.forward_tree(last, &g.draft.block(), &mut g.logits)?;
        } else {
            let mut feed = Vec::with_capacity(rows);
            feed.push(last);
            feed.extend_from_slice(&g.draft.tokens[..rows - 1]);
            g.target.forward(&feed, &mut g.logits)?;
        }
        let forward_time = t.elapsed();
        if g.logits.len() != rows * vocab {
            return Err(Error::ShapeMismatch {
                what: if p.tree {
                    "target logits ([nodes + 1, vocab])"
                } else {
                    "target logits ([k + 1, vocab])"
                },
                expected: rows * vocab,
                actual: g.logits.len(),
            });
        }
        check_seq_len(
            &g.target,
            self.context.len() - 1 + rows,
            "seq_len after forward",
        )?;
        Ok(forward_time)
    }

    /// Verify phase: the logits of the forward against the draft (a chain or a tree).
    fn verify(&mut self, p: &Proposed) -> Result<(StepOutput, Duration)> {
        let t = Instant::now();
        let mut verifier = std::mem::take(&mut self.g.verifier);
        let out = verifier.verify(&self.verify_request(p, &self.g.logits));
        self.g.verifier = verifier;
        Ok((out?, t.elapsed()))
    }

    /// The verify request of a proposed step over `target_logits` (`[rows, vocab]`).
    pub(crate) fn verify_request<'s>(
        &'s self,
        p: &Proposed,
        target_logits: &'s [f32],
    ) -> VerifyRequest<'s> {
        let v = SeqView {
            context: &self.context,
            prompt_len: self.prompt_len,
            seed: self.seed,
            suppressed: &self.suppressed,
        };
        build_request(self.g, self.params, v, p, target_logits)
    }

    /// Commit phase: appends the emitted tokens up to the first stop and keeps the target's KV
    /// cache for exactly them but the last (a chain by truncation, a tree by committing the
    /// accepted path). Returns what was kept.
    fn commit(&mut self, p: &Proposed, out: &StepOutput) -> Result<Kept> {
        let before = self.context.len();
        let text_before = self.text.released;
        let scan = stop_scan(self.params, &self.g.detokenizer, false);
        let mut kept = 0;
        let mut reason = None;
        for &tok in &out.tokens {
            self.context.push(tok);
            kept += 1;
            reason = scan.token(&mut self.text, &self.context[self.prompt_len..])?;
            if reason.is_some() {
                break;
            }
        }
        // The KV cache keeps every emitted token but the last (the next step feeds it).
        let g = &mut *self.g;
        if p.tree {
            // Rows of a tree forward: 0 for the root, j + 1 for node j. The row that predicted
            // the last kept token is the one of the token before it.
            let row = if kept >= 2 {
                out.path[kept - 2] as usize + 1
            } else {
                0
            };
            g.capture_hidden(row);
            // The features of the root and of the accepted path but its last token.
            let rows = 1 + g.draft.len();
            let path = &out.path[..kept - 1];
            g.append_hidden_rows(
                std::iter::once(0).chain(path.iter().map(|&j| j as usize + 1)),
                rows,
            );
            match g.target.tree() {
                Some(tree) => tree.commit_tree(&out.path[..kept - 1])?,
                None => {
                    return Err(Error::TargetContract {
                        what: "tree() returned None after a tree forward",
                    });
                }
            }
            check_seq_len(&g.target, before + kept - 1, "seq_len after commit_tree")?;
        } else {
            // The features of the root and the kept drafts but the last emitted token: rows
            // `0..kept` of the forward (which appended `k + 1` rows, `k` when the final draft
            // ends the sequence).
            g.append_hidden_rows(0..kept, p.k + 1 - p.ends as usize);
            g.target.truncate(before + kept - 1)?;
            g.capture_hidden(kept - 1);
        }
        Ok(Kept {
            before,
            text_before,
            kept,
            reason,
        })
    }

    /// Observe phase: log-probabilities, the proposer's feedback, metrics and the policy's
    /// observations, and the end of the generation when a stop or the budget is reached.
    fn observe(
        &mut self,
        p: &Proposed,
        out: StepOutput,
        k: Kept,
        forward: Duration,
        verify: Duration,
    ) -> Result<()> {
        let params = self.params;
        let Kept {
            before,
            text_before,
            kept,
            reason,
        } = k;
        let gen_before = before - self.prompt_len;
        let g = &mut *self.g;
        let accepted_kept = out.accepted.min(kept);
        if let (Some(all), Some(lps)) = (self.logprobs.as_mut(), out.logprobs) {
            all.extend(lps.into_iter().take(kept));
        }
        let t = Instant::now();
        if !out.row_top.is_empty() {
            // Row 0's input is the root (the token before the step), row j + 1's node j's.
            g.row_inputs.clear();
            g.row_inputs.push(self.context[before - 1]);
            g.row_inputs
                .extend_from_slice(&g.draft.tokens[..out.row_top.rows() - 1]);
            g.proposer.observe_rows(&VerifiedRows {
                inputs: &g.row_inputs,
                parents: if p.tree { &g.draft.parents } else { &[] },
                candidates: &out.row_top,
                path: &out.path,
            })?;
        }
        g.proposer
            .observe(accepted_kept, &self.context[before..before + kept])?;
        let observe_time = t.elapsed();

        let m = &mut self.metrics;
        // Tree steps: whether the walk stopped at a row with children (a depth was tested and
        // failed).
        let tested = p.tree && {
            let row = out.path.last().map_or(0, |&j| j as usize + 1);
            accepted_kept == out.accepted
                && !matches!(out.end, StepEnd::Ended)
                && g.draft.block().children(row).next().is_some()
        };
        if p.tree {
            m.record_tree_step(p.k, p.depth, accepted_kept, kept, tested);
        } else {
            m.record_step(p.k, out.accepted, accepted_kept, kept);
        }
        m.propose_time += p.time + observe_time;
        m.forward_time += forward;
        m.verify_time += verify;
        if m.time_to_first_token.is_none() {
            m.time_to_first_token = Some(self.start.elapsed());
        }
        if let DraftLength::Adaptive(a) = &params.draft {
            // The policy learns its costs from the cost source (the measured times by default).
            let propose_secs = g.costs.propose_secs(p.k, p.time + observe_time);
            let forward_secs = g.costs.forward_secs(p.k + 1, forward);
            if p.shaped {
                // The tree policy learns by depth and sibling rank, and the cost by rows.
                g.adaptive.observe_draft(
                    a,
                    &g.draft.block(),
                    &out.path,
                    forward_secs,
                    propose_secs,
                );
            } else {
                g.adaptive
                    .observe(a, p.k, out.accepted, forward_secs, propose_secs);
            }
        }

        let generated = self.context.len() - self.prompt_len;
        if let Some(r) = reason {
            self.end(r);
        } else if generated >= params.max_new_tokens {
            self.end(FinishReason::MaxTokens);
        } else if self.context.len() >= self.g.target.max_context() {
            self.end(FinishReason::ContextFull);
        }
        let released = self
            .text
            .releasable(&params.stop, self.finish.is_some())
            .max(text_before);
        self.text.released = released;
        self.last = LastStep {
            tokens: (gen_before, gen_before + kept),
            text: (text_before, released),
            stats: StepStats {
                drafted: p.k,
                depth: p.depth,
                accepted: accepted_kept,
                tree: p.tree,
            },
        };
        Ok(())
    }

    /// Ends the session (as cancelled if it was still running) and returns the result.
    pub fn into_generation(mut self) -> Generation {
        if self.finish.is_none() {
            self.end(FinishReason::Cancelled);
        }
        let text = self
            .g
            .detokenizer
            .as_ref()
            .map(|_| self.text.output().to_string());
        Generation {
            tokens: self.context[self.prompt_len..].to_vec(),
            finish: self.finish.unwrap_or(FinishReason::Cancelled),
            metrics: std::mem::take(&mut self.metrics),
            logprobs: self.logprobs.take(),
            text,
            seed: self.seed,
        }
    }

    /// Total wall time so far.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

/// What the commit phase kept: the context length before the step, the released text
/// before it, the number of emitted tokens kept, and the stop that cut them.
struct Kept {
    before: usize,
    text_before: usize,
    kept: usize,
    reason: Option<FinishReason>,
}

/// `true` when the draft can be verified as a chain: no parents, or parents of a chain with the
/// draft form's default scheme (a chain step then gives the same law and needs no tree support).
fn plain_chain(d: &Draft) -> bool {
    if d.parents.is_empty() {
        return true;
    }
    let default = TreeLimits {
        dense_q: d.q.is_some(),
        ..TreeLimits::vocab(0)
    }
    .default_scheme();
    d.block().is_chain() && d.schemes.iter().all(|&s| s == default)
}

/// Checks a proposer's draft before the target sees it: a chain of at most `max_draft` tokens,
/// or (tree steps, `max_nodes > 0`) a valid tree of at most `max_nodes` nodes and depth
/// `max_draft` and at most `max_branch` children per node ([`crate::DraftBlock::validate`]);
/// every id in the vocabulary; q of shape
/// `[k, q_vocab]` with `0 < q_vocab <= vocab`.
fn check_proposal(
    d: &Draft,
    max_draft: usize,
    max_nodes: usize,
    max_branch: usize,
    vocab: usize,
    proposer: &'static str,
) -> Result<()> {
    let fault = |fault| Error::InvalidProposal { proposer, fault };
    let k = d.tokens.len();
    if !plain_chain(d) {
        if max_nodes == 0 {
            return Err(fault(ProposalFault::TreeNotRequested));
        }
        // A branching tree must fit the node budget (the request's, capped by the target's
        // capacity and the context room) and the depth; a chain, the draft length.
        let limits = TreeLimits {
            vocab_size: vocab,
            max_nodes,
            max_depth: max_draft,
            max_branch,
            dense_q: d.q.is_some(),
        };
        d.block()
            .validate(&limits)
            .map_err(|t| fault(ProposalFault::Tree(t)))?;
    } else if k > max_draft {
        return Err(fault(ProposalFault::TooLong { len: k, max_draft }));
    }
    if let Some((index, &token)) = d
        .tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| t as usize >= vocab)
    {
        return Err(fault(ProposalFault::TokenOutOfVocab {
            index,
            token,
            vocab_size: vocab,
        }));
    }
    if let Some(q) = &d.q {
        let qv = d.q_vocab;
        if qv == 0 || qv > vocab || q.len() != k * qv {
            return Err(fault(ProposalFault::QShape {
                expected: k * qv.max(1),
                actual: q.len(),
            }));
        }
    }
    Ok(())
}

impl<T: TargetModel, P: Proposer> Iterator for Session<'_, T, P> {
    type Item = Result<Vec<u32>>;

    /// The tokens of the next step; `None` once finished. An error ends the iteration.
    fn next(&mut self) -> Option<Self::Item> {
        match self.step() {
            Ok(Some(t)) => Some(Ok(t.to_vec())),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }
}
