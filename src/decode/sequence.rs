//! One generation as a state machine: the per-sequence state and phases under both loops.
//!
//! A [`Sequence`] owns everything one generation holds between steps (context, parameters,
//! seed, metrics, log-probabilities, text and stop tracking, the draft, the hidden rows, the
//! adaptive policy's state, the last step, the finish) and runs the phases of a step. It never
//! calls an engine: its phases take plain values (the target's limits, logits, hidden rows) and
//! return plain values (the rows to feed, the verify request, what the engine must do to its
//! cache). [`super::Generator`] drives one sequence with single forwards,
//! [`super::BatchGenerator`] many with one batched forward and one
//! [`crate::Verifier::verify_batch`] per step; both run the same phases:
//!
//! 1. [`Sequence::mark`]: where the step starts (for [`Sequence::fail`]).
//! 2. [`Sequence::plan`]: budget, draft length or tree shape, propose, check and cut the draft
//!    at its first end. `None` when the generation ended instead.
//! 3. The driver feeds [`Sequence::rows`] to the target (one forward, or the sequence's part of
//!    a batched one) and checks the cache holds [`Sequence::cache_len_after`] positions.
//! 4. The driver verifies [`Sequence::verify_request`] over the logits.
//! 5. [`Sequence::commit`]: the emitted tokens up to the first stop, the hidden rows of the
//!    forward, and the [`CacheOp`] the driver applies to the target's cache.
//! 6. [`Sequence::observe`]: the proposer's feedback, metrics, the policy's observations, the
//!    end of the generation, the released text.
//!
//! An error in any phase (or in the driver's engine calls) ends the generation with
//! [`Sequence::fail`], which returns the cache length the engine must be rolled back to.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::costs::StepCosts;
use super::metrics::Metrics;
use super::params::GenerationParams;
use super::policy::{AdaptiveState, DraftLength, TreeShape};
use super::stop::{Detokenizer, FinishReason, StopScan, TextMark, TextTracker};
use crate::error::{Error, ProposalFault, Result};
use crate::model::{RollbackMode, SlotInput};
use crate::propose::{Draft, ProposeRequest, Proposer, VerifiedRows};
use crate::tree::{DraftBlock, TreeLimits};
use crate::verify::{DraftProbs, SequenceState, StepEnd, StepOutput, TokenLogprob, VerifyRequest};

/// The result of a generation.
///
/// `#[non_exhaustive]`: returned by the loops, read its fields.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
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
    /// generator's [`SeedSource`](super::SeedSource) when that was `None` (pass it back to
    /// reproduce the output).
    pub seed: u64,
}

impl Generation {
    /// A generation that emitted nothing, with the request's `seed`.
    pub(crate) fn empty(finish: FinishReason, seed: u64) -> Self {
        Generation {
            tokens: Vec::new(),
            finish,
            metrics: Metrics::default(),
            logprobs: None,
            text: None,
            seed,
        }
    }
}

/// A generation that failed: the error, and everything emitted before it.
///
/// `partial.finish` is [`FinishReason::Error`]; `partial.tokens` (and `text`, `logprobs`) hold
/// every token the generation emitted, and streamed, before the failure. The target's KV cache
/// was rolled back to the emitted tokens, so the [`Generator`](super::Generator) can run the
/// next request, which gives the same output as on a fresh generator.
///
/// `#[non_exhaustive]`: returned by the loops, read its fields.
#[derive(Debug)]
#[non_exhaustive]
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

/// One streamed step: what [`Generator::generate_stream`](super::Generator::generate_stream)
/// hands the callback.
///
/// `#[non_exhaustive]`: passed to stream callbacks, read its fields.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
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

/// What one verify step drafted and accepted ([`StreamChunk::step`],
/// [`Session::last_step`](super::Session::last_step)).
///
/// `#[non_exhaustive]`: returned by the loops, read its fields.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
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

/// What a sequence needs to know of its target: read by the driver from the engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TargetLimits {
    /// Width of a logits row, in tokens.
    pub vocab: usize,
    /// Most positions of a sequence.
    pub max_context: usize,
    /// Most nodes of one tree forward; 0 when the target has no tree support (or the request
    /// drafts no trees).
    pub max_tree_nodes: usize,
    /// How the target rolls back rejected drafts ([`crate::TargetModel::rollback`]); a target
    /// that cannot truncate is driven with chains (trees fall back to chains).
    pub rollback: RollbackMode,
}

/// The final hidden states of the target's last forward, as the driver read them
/// ([`crate::HiddenStates`]): `size` floats per row, `last` the rows (`None` when the target
/// has none yet).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HiddenView<'a> {
    pub size: usize,
    pub last: Option<&'a [f32]>,
}

/// How a generation starts ([`Sequence::begin`]).
pub(crate) struct Start<'a> {
    /// The prompt (at least one token, validated by [`check_request`]).
    pub prompt: &'a [u32],
    /// The request's parameters (validated).
    pub params: GenerationParams,
    /// The seed in use ([`Generation::seed`]).
    pub seed: u64,
    /// The detokenizer, when the text is tracked.
    pub detokenizer: Option<Arc<dyn Detokenizer>>,
    /// The target's limits.
    pub limits: TargetLimits,
    /// Width of the target's hidden states kept for the proposer (0: none).
    pub hidden_width: usize,
    /// Leading prompt tokens the engine's cache already holds (kept from the previous
    /// generation, [`Sequence::reusable`]; 0 for a fresh start); at most `prompt.len() - 1`.
    pub reused: usize,
    /// When the request started (its total time counts from here).
    pub at: Instant,
}

/// Where a step started: the context length and the text state ([`Sequence::fail`]).
#[derive(Debug, Clone)]
pub(crate) struct StepMark {
    len: usize,
    text: TextMark,
}

/// A planned step ([`Sequence::plan`]): the draft's size and shape, and what the later phases
/// need of the plan. The draft itself stays in the sequence ([`Sequence::rows`]).
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// Draft tokens (nodes, for a tree).
    k: usize,
    /// The final draft of a chain ends the sequence (no row follows it).
    ends: bool,
    /// The draft is a branching tree (then the sequence's node ends say which nodes end it).
    tree: bool,
    /// Depth of the draft.
    depth: usize,
    /// Time spent proposing.
    time: Duration,
    /// The tree-shape policy chose the request (its observation goes to
    /// [`AdaptiveState::observe_draft`]).
    shaped: bool,
    /// Leading rows (depths) at which the EOS ids are banned (`min_tokens`).
    suppress_rows: usize,
    /// The proposer's [`Proposer::row_candidates`].
    row_top_k: usize,
    /// The driver saves the target's state before the forward (snapshot mode).
    saves_state: bool,
    /// Prompt tokens the forward feeds ahead of the verify rows (a fused prefill,
    /// [`Sequence::defer_prefill`]); 0 for every other step.
    fed: usize,
}

impl Plan {
    /// Target rows of the step: `k + 1`, `k` when the final draft of a chain ends the sequence.
    pub fn rows(&self) -> usize {
        self.k + 1 - self.ends as usize
    }

    /// Draft tokens verified (nodes, for a tree).
    pub fn drafted(&self) -> usize {
        self.k
    }

    /// Whether the draft is a branching tree.
    pub fn is_tree(&self) -> bool {
        self.tree
    }

    /// Whether the driver must save the target's state before the step's forward
    /// ([`crate::StateSnapshot::save_state`]; targets in snapshot mode), so that
    /// [`CacheOp::Replay`] and [`CacheOp::Restore`] can restore it.
    pub fn saves_state(&self) -> bool {
        self.saves_state
    }

    /// Prompt tokens the step's forward feeds ahead of its [`Plan::rows`] verify rows (a fused
    /// prefill: [`Sequence::rows`] then holds `fed + rows` tokens, and the driver reads the
    /// logits of the last `rows` only, [`crate::TargetModel::forward_tail`]); 0 otherwise.
    pub fn fed(&self) -> usize {
        self.fed
    }
}

/// What the engine must do to the sequence's KV cache (or state) after a commit: keep exactly
/// the emitted tokens but the last; or, after a failed step ([`Sequence::fail_op`]), go back to
/// where the step started. Every variant names the length `len` the cache holds afterwards
/// (the driver checks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CacheOp<'o> {
    /// Keep the first `n` positions (truncate a chain's rejected rows).
    Keep(usize),
    /// Keep the accepted `path` of the pending tree (node indices); the cache then holds `len`
    /// positions.
    CommitTree { path: &'o [u32], len: usize },
    /// Nothing to do: the forward left exactly the `len` positions to keep (every draft
    /// accepted, on a target that cannot truncate).
    Hold(usize),
    /// Snapshot mode: restore the state saved before the step's forward (`from` positions) and
    /// replay `context[from..len]` ([`Sequence::context`]) with a prefill (no logits).
    Replay { from: usize, len: usize },
    /// Per-row states: keep the first `rows` positions the step's forward appended
    /// ([`crate::RowStates::keep_rows`]).
    KeepRows { rows: usize, len: usize },
    /// Snapshot mode, after a failed step: restore the state saved before the step's forward.
    Restore(usize),
}

impl CacheOp<'_> {
    /// The cache length after the operation.
    pub fn len(&self) -> usize {
        match *self {
            CacheOp::Keep(n) | CacheOp::Hold(n) | CacheOp::Restore(n) => n,
            CacheOp::CommitTree { len, .. }
            | CacheOp::Replay { len, .. }
            | CacheOp::KeepRows { len, .. } => len,
        }
    }
}

/// What the commit phase kept, for [`Sequence::observe`]: the context length before the step,
/// the released text before it, the number of emitted tokens kept, and the stop that cut them.
#[derive(Debug)]
pub(crate) struct Committed {
    before: usize,
    text_before: usize,
    kept: usize,
    reason: Option<FinishReason>,
}

/// The measured times of a step's engine phases, and the rollback work the driver did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StepTimes {
    pub forward: Duration,
    pub verify: Duration,
    /// Saving the target's state before the forward (snapshot mode).
    pub snapshot: Duration,
    /// Restoring and replaying ([`CacheOp::Replay`]).
    pub replay: Duration,
    /// Tokens replayed (0: no replay).
    pub replayed: usize,
}

/// Ranges of the last step's output, for [`Sequence::last_chunk`].
#[derive(Debug, Default, Clone, Copy)]
struct LastStep {
    tokens: (usize, usize),
    text: (usize, usize),
    stats: StepStats,
}

/// What the draft phase asks the proposer for.
#[derive(Debug, Clone, Copy)]
struct Ask {
    /// Most drafts (the depth, for a tree).
    k: usize,
    /// Node budget of a tree; 0 for a chain.
    nodes: usize,
    /// Most children per node.
    branch: usize,
    /// Chosen by the tree-shape policy.
    shaped: bool,
    /// See [`Plan::suppress_rows`].
    suppress_rows: usize,
}

/// Checks a request before anything reaches the target.
///
/// # Errors
/// [`Error::EmptyPrompt`], [`Error::PromptTooLong`]; [`Error::TokenOutOfVocab`] for a prompt
/// token; the errors of [`GenerationParams::validate`].
pub(crate) fn check_request(
    prompt: &[u32],
    params: &GenerationParams,
    limits: &TargetLimits,
    has_detokenizer: bool,
) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    if prompt.len() > limits.max_context {
        return Err(Error::PromptTooLong {
            len: prompt.len(),
            max_context: limits.max_context,
        });
    }
    if let Some(&t) = prompt.iter().find(|&&t| t as usize >= limits.vocab) {
        return Err(Error::TokenOutOfVocab {
            what: "prompt token",
            token: t,
            vocab_size: limits.vocab,
        });
    }
    params.validate(limits.vocab, has_detokenizer)
}

/// One generation: its state between steps and the phases of a step (module docs).
pub(crate) struct Sequence {
    params: GenerationParams,
    detokenizer: Option<Arc<dyn Detokenizer>>,
    limits: TargetLimits,
    /// Prompt and generated tokens.
    context: Vec<u32>,
    prompt_len: usize,
    /// The seed in use ([`Generation::seed`]).
    seed: u64,
    metrics: Metrics,
    logprobs: Option<Vec<TokenLogprob>>,
    /// Ids banned before `min_tokens` ([`super::StopConditions::suppressed_ids`]).
    suppressed: Vec<u32>,
    text: TextTracker,
    last: LastStep,
    finish: Option<FinishReason>,
    cancelled: bool,
    start: Instant,
    /// The adaptive policy's estimates (kept across the generations of a
    /// [`super::Generator`]).
    adaptive: AdaptiveState,
    /// The current step's draft.
    draft: Draft,
    /// Per node of a tree draft: accepting it ends the generation.
    node_ends: Vec<bool>,
    /// Scratch for tree paths.
    path: Vec<u32>,
    /// The chain rows of the current step, `[last, d_1 .. d_rows-1]`.
    feed: Vec<u32>,
    /// Input token of each target row of the step (for [`Proposer::observe_rows`]).
    row_inputs: Vec<u32>,
    /// The target's hidden state of the row that predicted the last token (heads proposers).
    hidden: Vec<f32>,
    /// The target's final hidden states of every context position but the last
    /// (`[context.len() - 1, hidden_width]`), while `hidden_rows_ok`.
    hidden_rows: Vec<f32>,
    /// `hidden_rows` is complete for the current generation (the target exposes hidden states
    /// and every forward gave rows of the documented size).
    hidden_rows_ok: bool,
    /// Width of a row of `hidden_rows`.
    hidden_width: usize,
    /// Leading prompt tokens the engine's cache held at the start ([`Start::reused`]).
    reused: usize,
    /// Prompt tokens before the last that the engine's cache does not hold yet: the first
    /// step's forward feeds them ahead of its verify rows ([`Sequence::defer_prefill`]).
    unfed: usize,
}

impl Sequence {
    /// An empty sequence (no generation yet).
    pub fn new() -> Self {
        Sequence {
            params: GenerationParams::default(),
            detokenizer: None,
            limits: TargetLimits::default(),
            context: Vec::new(),
            prompt_len: 0,
            seed: 0,
            metrics: Metrics::default(),
            logprobs: None,
            suppressed: Vec::new(),
            text: TextTracker::default(),
            last: LastStep::default(),
            finish: None,
            cancelled: false,
            start: Instant::now(),
            adaptive: AdaptiveState::default(),
            draft: Draft::default(),
            node_ends: Vec::new(),
            path: Vec::new(),
            feed: Vec::new(),
            row_inputs: Vec::new(),
            hidden: Vec::new(),
            hidden_rows: Vec::new(),
            hidden_rows_ok: false,
            hidden_width: 0,
            reused: 0,
            unfed: 0,
        }
    }

    /// Starts a generation of the prompt of `s` (validated by [`check_request`]): resets every
    /// per-generation state (the adaptive policy keeps its estimates). The engine's cache must
    /// hold exactly `prompt[..s.reused]` (empty for a fresh start; the hidden rows of those
    /// positions are kept from the previous generation); the driver then prefills
    /// `prompt[s.reused..n - 1]` ([`Sequence::prefilled`]) and starts the proposer
    /// ([`Sequence::start_proposer`]).
    pub fn begin(&mut self, s: Start<'_>) {
        self.context.clear();
        self.context.extend_from_slice(s.prompt);
        self.prompt_len = s.prompt.len();
        self.seed = s.seed;
        self.suppressed = s.params.stop.suppressed_ids();
        self.logprobs = s.params.sampling.logprobs().map(|_| Vec::new());
        self.params = s.params;
        self.detokenizer = s.detokenizer;
        self.limits = s.limits;
        self.metrics = Metrics::default();
        self.text = TextTracker::default();
        self.last = LastStep::default();
        self.finish = None;
        self.cancelled = false;
        self.start = s.at;
        self.hidden.clear();
        // `reusable` guaranteed the kept positions' rows when the target has hidden states.
        self.hidden_rows.truncate(s.reused * s.hidden_width);
        self.hidden_width = s.hidden_width;
        self.hidden_rows_ok = s.hidden_width > 0;
        self.reused = s.reused;
        self.unfed = 0;
        self.metrics.prompt_tokens_reused = s.reused;
        self.metrics.prompt_tokens_prefilled = s.prompt.len() - s.reused;
        if s.reused > 0 && s.reused + 1 == s.prompt.len() {
            // Nothing left to prefill: the row that predicted the last prompt token is kept.
            let rows = std::mem::take(&mut self.hidden_rows);
            let h = s.hidden_width;
            self.capture_hidden(
                s.reused - 1,
                Some(HiddenView {
                    size: h,
                    last: Some(&rows),
                }),
            );
            self.hidden_rows = rows;
        }
        self.adaptive.begin_generation();
    }

    /// Makes the sequence's state say that the engine's cache holds `tokens` (the context but
    /// its last token, as after a generation): the context becomes `tokens` and a placeholder
    /// last token that [`Sequence::reusable`] never compares. `hidden` (width `width`) are the
    /// hidden states of a prefill of exactly `tokens`, or `None` when they are not known (no
    /// hidden rows are then kept).
    pub fn assume_cached(&mut self, tokens: &[u32], hidden: Option<HiddenView<'_>>, width: usize) {
        self.context.clear();
        self.context.extend_from_slice(tokens);
        self.context.push(u32::MAX);
        self.prompt_len = self.context.len();
        self.hidden_rows.clear();
        self.hidden_width = width;
        self.hidden_rows_ok = width > 0 && hidden.is_some();
        if !tokens.is_empty() {
            self.append_hidden_rows(0..tokens.len(), tokens.len(), hidden);
        }
    }

    /// How many leading tokens of `prompt` a new generation can keep of an engine cache that
    /// holds `cached_len` positions, given that the cache holds this sequence's context but
    /// its last token (the loops' invariant after every step): the longest common prefix of
    /// that and `prompt`, at most `prompt.len() - 1` (the first step feeds the last prompt
    /// token, whose row gives the first logits). 0 when the cache is not in that state, or
    /// when the target keeps hidden rows of width `hidden_width > 0` and this sequence's are
    /// not complete (the proposer must see every position's row).
    pub fn reusable(&self, prompt: &[u32], cached_len: usize, hidden_width: usize) -> usize {
        if self.context.len() != cached_len + 1 || prompt.is_empty() {
            return 0;
        }
        let common = self.context[..cached_len]
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        let rows_ok = hidden_width == 0
            || (self.hidden_rows_ok
                && self.hidden_width == hidden_width
                && self.hidden_rows.len() >= common * hidden_width);
        if rows_ok { common } else { 0 }
    }

    /// The driver prefilled `prompt[reused..n - 1]` in one forward that took `time`
    /// (`reused < n - 1`), whose hidden states are `hidden`.
    pub fn prefilled(&mut self, time: Duration, hidden: Option<HiddenView<'_>>) {
        self.metrics.prefill_time = time;
        let n = self.prompt_len - 1 - self.reused;
        self.capture_hidden(n.saturating_sub(1), hidden);
        self.append_hidden_rows(0..n, n, hidden);
    }

    /// The driver does not prefill `prompt[reused..n - 1]` (`reused < n - 1`): the first
    /// step's forward feeds those tokens ahead of its verify rows, in one forward (a fused
    /// prefill; [`Plan::fed`]). Call after [`Sequence::begin`], in place of
    /// [`Sequence::prefilled`], on a target that can truncate. The first step is then a chain
    /// (a tree request drafts a chain for that step), and the cache holds `reused` positions
    /// until its forward: a generation that ends before it leaves a cache the next one does
    /// not reuse ([`Sequence::reusable`] sees the length differ).
    pub fn defer_prefill(&mut self) {
        self.unfed = self.prompt_len - 1 - self.reused;
        self.metrics.prompt_tokens_fused = self.unfed;
    }

    /// Tells the proposer the prompt ([`Proposer::begin`], or [`Proposer::begin_reusing`] when
    /// the driver keeps cached prefixes, `reuse`); a prompt that fills the context ends the
    /// generation at once.
    ///
    /// # Errors
    /// The proposer's.
    pub fn start_proposer(&mut self, proposer: &mut dyn Proposer, reuse: bool) -> Result<()> {
        let t = Instant::now();
        if reuse {
            proposer.begin_reusing(&self.context)?;
        } else {
            proposer.begin(&self.context)?;
        }
        self.metrics.propose_time += t.elapsed();
        if self.context.len() == self.limits.max_context {
            self.end(FinishReason::ContextFull, proposer);
        }
        Ok(())
    }

    /// The request's parameters.
    pub fn params(&self) -> &GenerationParams {
        &self.params
    }

    /// The prompt followed by the tokens emitted so far (the tokens of a [`CacheOp::Replay`]).
    pub fn context(&self) -> &[u32] {
        &self.context
    }

    /// The prompt.
    pub fn prompt(&self) -> &[u32] {
        &self.context[..self.prompt_len]
    }

    /// The seed in use.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The new tokens so far.
    pub fn tokens(&self) -> &[u32] {
        &self.context[self.prompt_len..]
    }

    /// The text of the new tokens so far (`None` without a detokenizer).
    pub fn text(&self) -> Option<&str> {
        self.detokenizer.as_ref().map(|_| self.text.output())
    }

    /// The finish reason once the generation has ended.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Metrics so far.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Asks to cancel: the next plan ends the generation with [`FinishReason::Cancelled`].
    pub fn cancel(&mut self) {
        self.cancelled = true;
    }

    /// `true` once [`Sequence::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled
    }

    /// `true` when the request's cancel flag ([`GenerationParams::cancel`]) is set.
    pub fn cancel_flagged(&self) -> bool {
        self.params
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed))
    }

    /// The adaptive policy's estimates.
    pub fn adaptive(&self) -> &AdaptiveState {
        &self.adaptive
    }

    /// Replaces the adaptive policy's estimates ([`super::Generator::with_adaptive_state`]).
    pub fn set_adaptive(&mut self, state: AdaptiveState) {
        self.adaptive = state;
    }

    /// The adaptive policy's state, mutably (the batch loop's probe schedule).
    pub fn adaptive_mut(&mut self) -> &mut AdaptiveState {
        &mut self.adaptive
    }

    /// The tokens of the last successful step.
    pub fn last_tokens(&self) -> &[u32] {
        let (a, b) = self.last.tokens;
        &self.tokens()[a..b]
    }

    /// The tokens, log-probabilities and released text of the last successful step.
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

    /// The draft size, depth and accepted length of the last successful step.
    pub fn last_step(&self) -> StepStats {
        self.last.stats
    }

    /// Wall time since the request started.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// The most drafts a step may verify now: accepted drafts plus the bonus token must fit the
    /// token budget and the context; 0 once either is used up.
    pub fn draft_cap(&self) -> usize {
        let len = self.context.len();
        let remaining = self
            .params
            .max_new_tokens
            .saturating_sub(len - self.prompt_len);
        let room = self.limits.max_context.saturating_sub(len);
        remaining.min(room).saturating_sub(1)
    }

    /// Where a step starts, for [`Sequence::fail`].
    pub fn mark(&self) -> StepMark {
        StepMark {
            len: self.context.len(),
            text: self.text.mark(),
        }
    }

    /// Ends the generation after a failed step that started at `mark` ([`Sequence::mark`]):
    /// forgets the step's tokens (they were never streamed) and returns the cache length the
    /// engine must be rolled back to (every emitted token but the last, the loops' invariant),
    /// whatever the failing call left behind (best effort: the next generation starts from an
    /// empty cache anyway).
    pub fn fail(&mut self, mark: StepMark) -> usize {
        let len = mark.len;
        self.context.truncate(len);
        self.text.reset(&mark.text);
        if let Some(l) = self.logprobs.as_mut() {
            l.truncate(len - self.prompt_len);
        }
        let rows = (len - 1) * self.hidden_width;
        if self.hidden_rows.len() >= rows {
            self.hidden_rows.truncate(rows);
        } else {
            self.hidden_rows_ok = false;
        }
        self.close(FinishReason::Error);
        len - 1
    }

    /// The cache operation that brings the target back to `len` positions after a failed step
    /// ([`Sequence::fail`]'s length): truncation; on a target that cannot truncate, restoring
    /// the step's snapshot, or keeping none of the rows appended since the last commit (the
    /// step's forward). Drivers skip it when the target already holds `len` positions (a
    /// failure before the forward), and reset the target (`truncate(0)`) when it fails or
    /// leaves another length (a failure after the step's own cache operation).
    pub fn fail_op(&self, len: usize) -> CacheOp<'static> {
        match self.limits.rollback {
            RollbackMode::Truncate => CacheOp::Keep(len),
            RollbackMode::Snapshot => CacheOp::Restore(len),
            RollbackMode::RowStates => CacheOp::KeepRows { rows: 0, len },
        }
    }

    /// Ends the generation (as cancelled if it was still running) and takes its result out.
    pub fn take_generation(&mut self, proposer: &mut dyn Proposer) -> Generation {
        if self.finish.is_none() {
            self.end(FinishReason::Cancelled, proposer);
        }
        Generation {
            tokens: self.tokens().to_vec(),
            finish: self.finish.unwrap_or(FinishReason::Cancelled),
            metrics: std::mem::take(&mut self.metrics),
            logprobs: self.logprobs.take(),
            text: self.text().map(str::to_string),
            seed: self.seed,
        }
    }

    /// Ends the generation with `reason` (the first end wins) and tells the proposer, unless
    /// it failed.
    fn end(&mut self, reason: FinishReason, proposer: &mut dyn Proposer) {
        if self.close(reason) && reason != FinishReason::Error {
            proposer.finish(&self.context);
        }
    }

    /// Sets the finish reason if none is set; `true` when it was set now.
    fn close(&mut self, reason: FinishReason) -> bool {
        if self.finish.is_some() {
            return false;
        }
        self.finish = Some(reason);
        self.metrics.total_time = self.start.elapsed();
        // Rule 6: unless a stop string cut it, the text is that of every emitted token (best
        // effort: the same window decoded without error at the last commit).
        if reason != FinishReason::StopString
            && let Some(d) = self.detokenizer.as_deref()
        {
            let _ = self.text.flush(d, &self.context[self.prompt_len..]);
        }
        true
    }
}

/// The plan phase.
impl Sequence {
    /// Budget and propose phases: ends the generation on cancellation, a used-up budget or a
    /// full context (`Ok(None)`), else chooses the draft length (or tree shape) and proposes.
    /// `k_override` replaces the adaptive policy's choice of an [`DraftLength::Adaptive`]
    /// request by a chain of that length (capped; the batch loop's goodput policy); fixed and
    /// disabled drafts ignore it.
    ///
    /// # Errors
    /// The proposer's; [`Error::InvalidProposal`] for a draft that breaks the request
    /// ([`check_proposal`]); the detokenizer's.
    pub fn plan(
        &mut self,
        proposer: &mut dyn Proposer,
        limits: TargetLimits,
        k_override: Option<usize>,
    ) -> Result<Option<Plan>> {
        self.limits = limits;
        if limits.rollback != RollbackMode::Truncate {
            // A target that cannot truncate verifies chains (tree requests fall back).
            self.limits.max_tree_nodes = 0;
        }
        let Some(ask) = self.budget(proposer, k_override) else {
            return Ok(None);
        };
        let t = Instant::now();
        self.ask(proposer, ask)?;
        let mut plan = self.cut(ask)?;
        plan.time = t.elapsed();
        plan.row_top_k = proposer.row_candidates();
        plan.saves_state = self.limits.rollback == RollbackMode::Snapshot;
        if !plan.tree {
            // The unfed prompt tokens (a fused prefill), the last token, the drafts.
            plan.fed = self.unfed;
            let from = self.context.len() - 1 - self.unfed;
            self.feed.clear();
            self.feed.extend_from_slice(&self.context[from..]);
            self.feed
                .extend_from_slice(&self.draft.tokens[..plan.rows() - 1]);
        }
        Ok(Some(plan))
    }

    /// The budget: ends the generation when it must (`None`), else what to ask the proposer
    /// for.
    fn budget(&mut self, proposer: &mut dyn Proposer, k_override: Option<usize>) -> Option<Ask> {
        if self.cancelled || self.cancel_flagged() {
            self.end(FinishReason::Cancelled, proposer);
            return None;
        }
        let generated = self.context.len() - self.prompt_len;
        let remaining = self.params.max_new_tokens.saturating_sub(generated);
        let room = self.limits.max_context.saturating_sub(self.context.len());
        if remaining == 0 {
            self.end(FinishReason::MaxTokens, proposer);
            return None;
        }
        if room == 0 {
            self.end(FinishReason::ContextFull, proposer);
            return None;
        }
        // Accepted drafts plus the bonus token must fit the budget and the context.
        let cap = remaining.min(room) - 1;
        let self_sized = proposer.sizes_own_drafts(&self.params.sampling);
        let mut ask = self.draft_shape(cap, room, k_override, self_sized);
        ask.suppress_rows = self.params.min_tokens.saturating_sub(generated);
        Some(ask)
    }

    /// The draft length (or tree shape) of a step with at most `cap` drafts and `room`
    /// positions left in the context; `self_sized`: the proposer cuts its own drafts by cost
    /// ([`Proposer::sizes_own_drafts`]), so an adaptive request asks it for `max_draft` as a
    /// fixed one would.
    fn draft_shape(
        &mut self,
        cap: usize,
        room: usize,
        k_override: Option<usize>,
        self_sized: bool,
    ) -> Ask {
        let params = &self.params;
        // Tree drafts: every node holds a KV slot until the commit, so the node budget is also
        // capped by the context room (the depth, like a chain's k, by `cap`).
        let mut tree_room = match params.tree.node_budget() {
            0 => 0,
            n => n.min(self.limits.max_tree_nodes).min(room),
        };
        // A fused prefill's step is a chain (the prompt tokens go ahead of its rows); under the
        // tree policy, as deep as the tree it would have drafted.
        let fused_tree = if self.unfed > 0 {
            std::mem::take(&mut tree_room)
        } else {
            0
        };
        let user_branch = match params.tree.branch() {
            0 => usize::MAX,
            b => b,
        };
        let fixed = |k: usize| {
            let k = k.min(cap);
            (k, if k > 0 { tree_room } else { 0 }, user_branch, false)
        };
        let (k, nodes, branch, shaped) = match &params.draft {
            DraftLength::Off => (0, 0, user_branch, false),
            DraftLength::Adaptive(_) if k_override.is_some() => {
                (k_override.unwrap_or(0).min(cap), 0, user_branch, false)
            }
            DraftLength::Fixed(k) => fixed(*k),
            DraftLength::Adaptive(a) if self_sized => fixed(a.max_draft),
            // The cost-aware tree-shape policy: node budget, depth and branching per step.
            DraftLength::Adaptive(a) if tree_room > 0 => {
                let limits = TreeShape {
                    nodes: tree_room,
                    depth: cap,
                    branch: user_branch,
                };
                let s = self.adaptive.choose_tree(a, limits);
                (s.depth, s.nodes, s.branch.clamp(1, user_branch), true)
            }
            DraftLength::Adaptive(a) if fused_tree > 0 => {
                let limits = TreeShape {
                    nodes: fused_tree,
                    depth: cap,
                    branch: user_branch,
                };
                (
                    self.adaptive.choose_tree(a, limits).depth,
                    0,
                    user_branch,
                    false,
                )
            }
            DraftLength::Adaptive(a) => (self.adaptive.choose(a, cap), 0, user_branch, false),
        };
        Ask {
            k,
            nodes,
            branch,
            shaped,
            suppress_rows: 0,
        }
    }

    /// Asks the proposer for up to `ask.k` drafts (a tree of at most `ask.nodes` nodes, depth
    /// `ask.k` and `ask.branch` children per node when `ask.nodes > 0`) and checks them; a
    /// chain-shaped draft is stored as a chain.
    fn ask(&mut self, proposer: &mut dyn Proposer, ask: Ask) -> Result<()> {
        self.draft.clear();
        if ask.k > 0 {
            let rows = hidden_rows_for(
                &self.hidden_rows,
                self.hidden_rows_ok,
                self.hidden_width,
                self.context.len(),
            );
            let req = ProposeRequest {
                context: &self.context,
                config: &self.params.sampling,
                max_draft: ask.k,
                max_nodes: if ask.nodes > 0 { ask.nodes } else { ask.k },
                max_branch: ask.branch,
                seed: self.seed,
                target_hidden: (!self.hidden.is_empty()).then_some(&self.hidden[..]),
                target_hidden_rows: rows,
                prompt_len: self.prompt_len,
                eos: &self.params.stop.eos,
                suppress: &self.suppressed,
                suppress_rows: ask.suppress_rows,
                fused_prompt: self.unfed,
            };
            if ask.nodes > 0 {
                proposer.propose_tree(&req, &mut self.draft)?;
            } else {
                proposer.propose(&req, &mut self.draft)?;
            }
        }
        check_proposal(&self.draft, ask, self.limits.vocab, proposer.name())?;
        if plain_chain(&self.draft) {
            self.draft.parents.clear();
            self.draft.schemes.clear();
        }
        Ok(())
    }

    /// Cuts the checked draft at its first end (EOS, stop sequence or stop string; case C11):
    /// a chain after the ending token, a tree below every ending node.
    fn cut(&mut self, ask: Ask) -> Result<Plan> {
        let mut plan = Plan {
            k: 0,
            ends: false,
            tree: false,
            depth: 0,
            time: Duration::ZERO,
            shaped: ask.shaped,
            suppress_rows: ask.suppress_rows,
            row_top_k: 0,
            saves_state: false,
            fed: 0,
        };
        if !self.draft.parents.is_empty() {
            self.tree_ends()?;
            plan.k = self.draft.len();
            if plain_chain(&self.draft) {
                // Pruning left a chain: only its last node can end the generation.
                plan.ends = self.node_ends.last().copied().unwrap_or(false);
                self.draft.parents.clear();
                self.draft.schemes.clear();
                plan.depth = plan.k;
            } else {
                plan.tree = true;
                plan.depth = self.draft.block().max_depth();
            }
            return Ok(plan);
        }
        let (k, ends) = self.draft_end()?;
        // A chain marks only its final node, when it ends (no row follows it).
        self.node_ends.clear();
        if ends {
            self.node_ends.resize(k, false);
            self.node_ends[k - 1] = true;
        }
        self.draft.tokens.truncate(k);
        if let Some(q) = self.draft.q.as_mut() {
            q.truncate(k * self.draft.q_vocab);
        }
        plan.k = k;
        plan.ends = ends;
        plan.depth = k;
        Ok(plan)
    }

    /// The draft length after cutting at the first draft token that would end the generation,
    /// and whether the (new) final draft ends it: the commit's stop scan over the context plus
    /// the drafts (rule 8 of the module's stop rules).
    fn draft_end(&mut self) -> Result<(usize, bool)> {
        let k = self.draft.tokens.len();
        let scan = stop_scan(&self.params, self.detokenizer.as_deref(), true);
        if k == 0 || !scan.active() {
            return Ok((k, false));
        }
        // Append the drafts tentatively (no copy of the context), check, then roll back.
        let (len, mark) = (self.context.len(), self.text.mark());
        let mut end = Ok((k, false));
        for j in 0..k {
            self.context.push(self.draft.tokens[j]);
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

    /// Marks the tree nodes whose acceptance ends the generation (`node_ends`) and removes
    /// every node below one (case C11 for trees: no row past an end is processed). A node's
    /// path is checked exactly as a chain's tokens are ([`Sequence::draft_end`]); its ancestors
    /// were checked before it (topological order), so only its own token can end it.
    fn tree_ends(&mut self) -> Result<()> {
        let n = self.draft.len();
        self.node_ends.clear();
        self.node_ends.resize(n, false);
        let scan = stop_scan(&self.params, self.detokenizer.as_deref(), true);
        if n == 0 || !scan.active() {
            return Ok(());
        }
        let (len, root) = (self.context.len(), self.text.mark());
        // Each node's scan starts from its parent's text (the text after the parent's token).
        let mut marks: Vec<TextMark> = Vec::with_capacity(n);
        let keep_from = root.keep();
        let mut keep = vec![true; n];
        let mut path = std::mem::take(&mut self.path);
        let mut res = Ok(());
        for i in 0..n {
            let block = self.draft.block();
            let r = block.parent_row(i);
            marks.push(TextMark::default());
            if r > 0 && (!keep[r - 1] || self.node_ends[r - 1]) {
                keep[i] = false;
                continue;
            }
            block.path_to(i, &mut path);
            self.context.truncate(len);
            self.context
                .extend(path.iter().map(|&j| self.draft.tokens[j as usize]));
            self.text.reset(if r == 0 { &root } else { &marks[r - 1] });
            match scan.token(&mut self.text, &self.context[self.prompt_len..]) {
                Ok(end) => self.node_ends[i] = end.is_some(),
                Err(e) => {
                    res = Err(e);
                    break;
                }
            }
            marks[i] = self.text.mark_from(keep_from);
        }
        self.context.truncate(len);
        self.text.reset(&root);
        self.path = path;
        res?;
        if !keep.iter().all(|&k| k) {
            self.prune(&keep);
        }
        Ok(())
    }

    /// Removes the draft nodes not in `keep` (each one's descendants are not kept either):
    /// remaps parent rows, keeps q rows, schemes and end flags in step.
    fn prune(&mut self, keep: &[bool]) {
        let n = keep.len();
        let d = &mut self.draft;
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
            self.node_ends[w] = self.node_ends[i];
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
        self.node_ends.truncate(w);
        if let Some(q) = d.q.as_mut() {
            q.truncate(w * qv);
        }
    }
}

/// The forward and verify phases' views.
impl Sequence {
    /// The rows the planned step appends: the chain `[last, d_1 .. d_rows-1]` (preceded by the
    /// [`Plan::fed`] prompt tokens of a fused prefill), or the root and the draft tree.
    pub fn rows(&self, plan: &Plan) -> SlotInput<'_> {
        if plan.tree {
            SlotInput::Tree {
                root: self.context.last().copied().unwrap_or(0),
                block: self.draft.block(),
            }
        } else {
            SlotInput::Chain(&self.feed)
        }
    }

    /// The positions the engine's cache must hold after the step's forward: the context but
    /// the last token, plus the rows fed.
    pub fn cache_len_after(&self, plan: &Plan) -> usize {
        self.context.len() - 1 + plan.rows()
    }

    /// The verify request of a planned step over `target_logits` (`[rows, vocab]`; the batch
    /// loop passes them in its [`crate::VerifyBatch`] and leaves them empty here).
    pub fn verify_request<'s>(
        &'s self,
        plan: &Plan,
        target_logits: &'s [f32],
    ) -> VerifyRequest<'s> {
        let d = &self.draft;
        let draft_probs = match &d.q {
            None => DraftProbs::PointMass,
            Some(q) => DraftProbs::Probs {
                probs: q,
                vocab: d.q_vocab,
            },
        };
        let mut draft = if plan.tree {
            DraftBlock::tree(&d.tokens, &d.parents)
        } else {
            DraftBlock::chain(&d.tokens)
        };
        if plan.tree && !d.schemes.is_empty() {
            draft = draft.with_schemes(&d.schemes);
        }
        if plan.tree || plan.ends {
            draft = draft.with_ends(&self.node_ends);
        }
        VerifyRequest {
            state: SequenceState {
                config: &self.params.sampling,
                seed: self.seed,
                context: &self.context,
                position: Some(self.context.len() as u64),
                prompt_len: self.prompt_len,
                suppress: &self.suppressed,
                suppress_rows: plan.suppress_rows,
                row_top_k: plan.row_top_k,
            },
            target_logits,
            vocab_size: self.limits.vocab,
            draft,
            draft_probs,
        }
    }
}

/// The commit and observe phases.
impl Sequence {
    /// Commit phase: appends the emitted tokens of `out` up to the first stop, keeps the
    /// forward's hidden rows (`hidden`) of the positions committed, and returns what the
    /// engine must do to its cache (keep every emitted token but the last: a chain by
    /// truncation, a tree by committing the accepted path) and what was kept.
    ///
    /// # Errors
    /// The detokenizer's.
    pub fn commit<'o>(
        &mut self,
        plan: &Plan,
        out: &'o StepOutput,
        hidden: Option<HiddenView<'_>>,
    ) -> Result<(CacheOp<'o>, Committed)> {
        let before = self.context.len();
        let text_before = self.text.released;
        let scan = stop_scan(&self.params, self.detokenizer.as_deref(), false);
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
        let cache = if plan.tree {
            // Rows of a tree forward: 0 for the root, j + 1 for node j. The row that predicted
            // the last kept token is the one of the token before it.
            let row = if kept >= 2 {
                out.path[kept - 2] as usize + 1
            } else {
                0
            };
            self.capture_hidden(row, hidden);
            // The features of the root and of the accepted path but its last token.
            let path = &out.path[..kept - 1];
            let rows = std::iter::once(0).chain(path.iter().map(|&j| j as usize + 1));
            self.append_hidden_rows(rows, 1 + self.draft.len(), hidden);
            CacheOp::CommitTree {
                path,
                len: before + kept - 1,
            }
        } else {
            // The features of the fused prompt tokens (`plan.fed`, ahead of the verify rows),
            // the root and the kept drafts but the last emitted token: rows `0..fed + kept` of
            // the forward (which appended `fed + k + 1` rows, one less when the final draft
            // ends the sequence).
            let fed = plan.fed;
            self.append_hidden_rows(0..fed + kept, fed + plan.rows(), hidden);
            self.capture_hidden(fed + kept - 1, hidden);
            self.unfed = 0;
            chain_op(self.limits.rollback, before, kept, plan.rows())
        };
        let committed = Committed {
            before,
            text_before,
            kept,
            reason,
        };
        Ok((cache, committed))
    }

    /// Observe phase: log-probabilities, the proposer's feedback, metrics and the policy's
    /// observations (step costs from `costs`), and the end of the generation when a stop or
    /// the budget is reached; then the released text and the last step.
    ///
    /// # Errors
    /// The proposer's.
    pub fn observe(
        &mut self,
        proposer: &mut dyn Proposer,
        costs: &dyn StepCosts,
        plan: &Plan,
        mut out: StepOutput,
        c: Committed,
        times: StepTimes,
    ) -> Result<()> {
        let accepted_kept = out.accepted.min(c.kept);
        if let (Some(all), Some(lps)) = (self.logprobs.as_mut(), out.logprobs.take()) {
            all.extend(lps.into_iter().take(c.kept));
        }
        let t = Instant::now();
        self.feedback(proposer, plan, &out, &c, accepted_kept)?;
        let observe_time = t.elapsed();
        self.record(costs, plan, &out, &c, times, observe_time);
        self.settle(proposer, plan, c, accepted_kept);
        Ok(())
    }

    /// The proposer's feedback: the verified rows' candidates, then the accepted drafts and the
    /// emitted tokens.
    fn feedback(
        &mut self,
        proposer: &mut dyn Proposer,
        plan: &Plan,
        out: &StepOutput,
        c: &Committed,
        accepted_kept: usize,
    ) -> Result<()> {
        if !out.row_top.is_empty() {
            // Row 0's input is the root (the token before the step), row j + 1's node j's.
            self.row_inputs.clear();
            self.row_inputs.push(self.context[c.before - 1]);
            self.row_inputs
                .extend_from_slice(&self.draft.tokens[..out.row_top.rows() - 1]);
            proposer.observe_rows(&VerifiedRows {
                inputs: &self.row_inputs,
                parents: if plan.tree { &self.draft.parents } else { &[] },
                candidates: &out.row_top,
                path: &out.path,
            })?;
        }
        proposer.observe(accepted_kept, &self.context[c.before..c.before + c.kept])
    }

    /// Metrics and the adaptive policy's observations of a step.
    fn record(
        &mut self,
        costs: &dyn StepCosts,
        plan: &Plan,
        out: &StepOutput,
        c: &Committed,
        times: StepTimes,
        observe_time: Duration,
    ) {
        let accepted_kept = out.accepted.min(c.kept);
        let m = &mut self.metrics;
        // Tree steps: whether the walk stopped at a row with children (a depth was tested and
        // failed).
        let tested = plan.tree && {
            let row = out.path.last().map_or(0, |&j| j as usize + 1);
            accepted_kept == out.accepted
                && !matches!(out.end, StepEnd::Ended)
                && self.draft.block().children(row).next().is_some()
        };
        if plan.tree {
            m.record_tree_step(plan.k, plan.depth, accepted_kept, c.kept, tested);
        } else {
            m.record_step(plan.k, out.accepted, accepted_kept, c.kept);
        }
        m.propose_time += plan.time + observe_time;
        m.forward_time += times.forward;
        m.verify_time += times.verify;
        m.snapshot_time += times.snapshot;
        m.replay_time += times.replay;
        m.replays += (times.replayed > 0) as usize;
        m.replayed_tokens += times.replayed;
        if m.time_to_first_token.is_none() {
            m.time_to_first_token = Some(self.start.elapsed());
        }
        if let DraftLength::Adaptive(a) = &self.params.draft {
            // The policy learns its costs from the cost source (the measured times by default).
            let propose_secs = costs.propose_secs(plan.k, plan.time + observe_time);
            // Saving the state counts with the forward; a replay (snapshot mode) is learned
            // apart, as the cost of its tokens, and priced by the policy from its acceptance
            // estimates (`AdaptiveState::expected_replay`).
            let forward_secs = costs.forward_secs(plan.k + 1, times.forward + times.snapshot);
            if times.replayed > 0 {
                let secs = costs.replay_secs(times.replayed, times.replay);
                self.adaptive.observe_replay(a, times.replayed, secs);
            }
            if plan.shaped {
                // The tree policy learns by depth and sibling rank, and the cost by rows.
                self.adaptive.observe_draft(
                    a,
                    &self.draft.block(),
                    &out.path,
                    forward_secs,
                    propose_secs,
                );
            } else {
                // A fused prefill's forward also fed the prompt: no cost of `k + 1` rows.
                let secs = (plan.fed == 0).then_some(forward_secs);
                self.adaptive
                    .observe_chain(a, plan.k, out.accepted, secs, propose_secs);
            }
        }
    }

    /// Ends the generation when a stop, the budget or the context is reached; releases the
    /// text that can no longer become a stop; records the last step.
    fn settle(&mut self, proposer: &mut dyn Proposer, plan: &Plan, c: Committed, accepted: usize) {
        let generated = self.context.len() - self.prompt_len;
        if let Some(r) = c.reason {
            self.end(r, proposer);
        } else if generated >= self.params.max_new_tokens {
            self.end(FinishReason::MaxTokens, proposer);
        } else if self.context.len() >= self.limits.max_context {
            self.end(FinishReason::ContextFull, proposer);
        }
        let released = self
            .text
            .releasable(&self.params.stop, self.finish.is_some())
            .max(c.text_before);
        self.text.released = released;
        let gen_before = c.before - self.prompt_len;
        self.last = LastStep {
            tokens: (gen_before, gen_before + c.kept),
            text: (c.text_before, released),
            stats: StepStats {
                drafted: plan.k,
                depth: plan.depth,
                accepted,
                tree: plan.tree,
            },
        };
    }
}

/// Hidden states.
impl Sequence {
    /// Keeps row `row` of the target's last hidden states for a heads proposer.
    fn capture_hidden(&mut self, row: usize, hidden: Option<HiddenView<'_>>) {
        self.hidden.clear();
        let Some(hs) = hidden else {
            return;
        };
        let h = hs.size;
        if h == 0 {
            return;
        }
        if let Some(all) = hs.last
            && let Some(r) = all.get(row * h..(row + 1) * h)
        {
            self.hidden.extend_from_slice(r);
        }
    }

    /// Appends rows `rows` (indices into the rows of the target's last forward, which appended
    /// `appended` positions) to `hidden_rows`, the features of the positions just committed.
    /// Missing hidden states, a row count other than `appended` or a changed width end the
    /// buffer for the rest of the generation (proposers then get `None`); never panics.
    fn append_hidden_rows(
        &mut self,
        rows: impl Iterator<Item = usize>,
        appended: usize,
        hidden: Option<HiddenView<'_>>,
    ) {
        if !self.hidden_rows_ok {
            return;
        }
        let h = self.hidden_width;
        let all = hidden
            .filter(|hs| hs.size == h)
            .and_then(|hs| hs.last)
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

/// The cache operation after a chain step on a target in `mode`: the context held `before`
/// tokens (the cache all but the last), the forward appended `rows` rows, `kept` tokens were
/// emitted; the cache must hold `before + kept - 1` positions (the rows `[last, d_1 ..
/// d_kept-1]`).
fn chain_op(mode: RollbackMode, before: usize, kept: usize, rows: usize) -> CacheOp<'static> {
    let (from, len) = (before - 1, before + kept - 1);
    match mode {
        RollbackMode::Truncate => CacheOp::Keep(len),
        // Every row kept: the state after the forward is the one to keep.
        RollbackMode::Snapshot if kept == rows => CacheOp::Hold(len),
        RollbackMode::Snapshot => CacheOp::Replay { from, len },
        // Also when every row is kept: `keep_rows` moves the commit point to the new end.
        RollbackMode::RowStates => CacheOp::KeepRows { rows: kept, len },
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
    detokenizer: Option<&'a dyn Detokenizer>,
    drafts: bool,
) -> StopScan<'a> {
    let text = !drafts || !params.stop.stop_strings.is_empty();
    StopScan {
        stop: &params.stop,
        min_tokens: params.min_tokens,
        detokenizer: detokenizer.filter(|_| text),
    }
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

/// Checks a proposer's draft before the target sees it: a chain of at most `ask.k` tokens, or
/// (tree steps, `ask.nodes > 0`) a valid tree of at most `ask.nodes` nodes and depth `ask.k`
/// and at most `ask.branch` children per node ([`crate::DraftBlock::validate`]); every id in
/// the vocabulary; q of shape `[k, q_vocab]` with `0 < q_vocab <= vocab`.
fn check_proposal(d: &Draft, ask: Ask, vocab: usize, proposer: &'static str) -> Result<()> {
    let fault = |fault| Error::InvalidProposal { proposer, fault };
    let k = d.tokens.len();
    if !plain_chain(d) {
        if ask.nodes == 0 {
            return Err(fault(ProposalFault::TreeNotRequested));
        }
        // A branching tree must fit the node budget (the request's, capped by the target's
        // capacity and the context room) and the depth; a chain, the draft length.
        let limits = TreeLimits {
            vocab_size: vocab,
            max_nodes: ask.nodes,
            max_depth: ask.k,
            max_branch: ask.branch,
            dense_q: d.q.is_some(),
        };
        d.block()
            .validate(&limits)
            .map_err(|t| fault(ProposalFault::Tree(t)))?;
    } else if k > ask.k {
        return Err(fault(ProposalFault::TooLong {
            len: k,
            max_draft: ask.k,
        }));
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

/// The cached prefix a driver keeps of the `reusable` tokens ([`Sequence::reusable`]) when the
/// engine holds `held` positions: all of them, or 0 when the engine holds fewer or when it
/// cannot truncate (`truncates == false`: [`crate::TargetModel::rollback`] /
/// [`crate::BatchTarget::rollback`] offered) and keeping them would drop positions.
pub(crate) fn kept_prefix(reusable: usize, held: usize, truncates: bool) -> usize {
    if held < reusable || (reusable != held && !truncates) {
        0
    } else {
        reusable
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{MeasuredCosts, StopConditions};
    use crate::test_util::ScriptedProposer;
    use crate::verify::Verifier;

    const LIMITS: TargetLimits = TargetLimits {
        vocab: 8,
        max_context: 64,
        max_tree_nodes: 0,
        rollback: RollbackMode::Truncate,
    };

    /// Logits rows `[rows, 8]` whose greedy choice is `next[i]` at row `i`.
    fn one_hot(next: &[u32]) -> Vec<f32> {
        next.iter()
            .flat_map(|&t| (0..8).map(move |v| if v == t { 10.0 } else { 0.0 }))
            .collect()
    }

    fn started(params: GenerationParams, p: &mut ScriptedProposer) -> Sequence {
        let mut seq = Sequence::new();
        seq.begin(Start {
            prompt: &[1, 2],
            params,
            seed: 0,
            detokenizer: None,
            limits: LIMITS,
            hidden_width: 0,
            reused: 0,
            at: Instant::now(),
        });
        seq.start_proposer(p, false).unwrap();
        seq
    }

    const TIMES: StepTimes = StepTimes {
        forward: Duration::ZERO,
        verify: Duration::ZERO,
        snapshot: Duration::ZERO,
        replay: Duration::ZERO,
        replayed: 0,
    };

    #[test]
    fn kept_prefix_drops_nothing_a_target_cannot_truncate() {
        assert_eq!(kept_prefix(5, 8, true), 5);
        assert_eq!(kept_prefix(5, 8, false), 0);
        assert_eq!(kept_prefix(8, 8, false), 8);
        assert_eq!(kept_prefix(9, 8, true), 0);
        assert_eq!(kept_prefix(0, 8, false), 0);
    }
    #[test]
    fn a_step_runs_on_plain_values() {
        let mut p = ScriptedProposer::new(vec![vec![3, 4, 5]]);
        let params = GenerationParams::greedy(10).with_draft(DraftLength::Fixed(3));
        let mut seq = started(params, &mut p);
        let plan = seq.plan(&mut p, LIMITS, None).unwrap().unwrap();
        assert_eq!((plan.rows(), plan.drafted(), plan.is_tree()), (4, 3, false));
        let SlotInput::Chain(rows) = seq.rows(&plan) else {
            panic!("a chain draft feeds a chain");
        };
        assert_eq!(rows, &[2, 3, 4, 5]);
        assert_eq!(seq.cache_len_after(&plan), 5);
        // The target agrees with 3 and 4, then says 6.
        let logits = one_hot(&[3, 4, 6, 7]);
        let out = Verifier::new()
            .verify(&seq.verify_request(&plan, &logits))
            .unwrap();
        let (cache, c) = seq.commit(&plan, &out, None).unwrap();
        // Prompt 2 + 3 emitted: the cache keeps all but the last.
        assert_eq!(cache, CacheOp::Keep(4));
        seq.observe(&mut p, &MeasuredCosts, &plan, out, c, TIMES)
            .unwrap();
        assert_eq!(seq.tokens(), &[3, 4, 6]);
        assert_eq!(seq.last_tokens(), &[3, 4, 6]);
        assert_eq!(seq.last_step().accepted, 2);
        assert_eq!(seq.finish_reason(), None);
        assert_eq!(seq.draft_cap(), 6);
    }

    #[test]
    fn a_draft_is_cut_at_its_end_and_a_failed_step_rolls_back() {
        let mut p = ScriptedProposer::new(vec![vec![3, 4, 5], vec![3]]);
        let params = GenerationParams::greedy(10)
            .with_draft(DraftLength::Fixed(3))
            .with_stop(StopConditions::eos(4))
            .unwrap();
        let mut seq = started(params, &mut p);
        let mark = seq.mark();
        let plan = seq.plan(&mut p, LIMITS, None).unwrap().unwrap();
        // EOS 4 ends the draft: no row follows it.
        assert_eq!((plan.drafted(), plan.rows()), (2, 2));
        let logits = one_hot(&[3, 4]);
        let out = Verifier::new()
            .verify(&seq.verify_request(&plan, &logits))
            .unwrap();
        assert_eq!(out.tokens, vec![3, 4]);
        // The engine failed to apply the cache operation: the step is forgotten.
        let (cache, _) = seq.commit(&plan, &out, None).unwrap();
        assert_eq!(cache, CacheOp::Keep(3));
        assert_eq!(seq.fail(mark), 1);
        assert_eq!(seq.tokens(), &[] as &[u32]);
        assert_eq!(seq.finish_reason(), Some(FinishReason::Error));
        let g = seq.take_generation(&mut p);
        assert_eq!((g.tokens.len(), g.finish), (0, FinishReason::Error));
    }

    #[test]
    fn chain_cache_ops_by_rollback_mode() {
        use RollbackMode::*;
        // A context of 5 tokens (the cache holds 4), a forward of 4 rows, 2 tokens emitted: the
        // cache must hold 6.
        assert_eq!(chain_op(Truncate, 5, 2, 4), CacheOp::Keep(6));
        assert_eq!(
            chain_op(Snapshot, 5, 2, 4),
            CacheOp::Replay { from: 4, len: 6 }
        );
        assert_eq!(
            chain_op(RowStates, 5, 2, 4),
            CacheOp::KeepRows { rows: 2, len: 6 }
        );
        // Every row kept: nothing to replay; row states still move their commit point.
        assert_eq!(chain_op(Snapshot, 5, 4, 4), CacheOp::Hold(8));
        assert_eq!(
            chain_op(RowStates, 5, 4, 4),
            CacheOp::KeepRows { rows: 4, len: 8 }
        );
        let mut p = ScriptedProposer::new(vec![vec![3, 4, 5]]);
        let params = GenerationParams::greedy(10)
            .with_draft(DraftLength::Fixed(3))
            .with_tree(crate::decode::TreeDrafts::nodes(6));
        let mut seq = started(params, &mut p);
        let limits = TargetLimits {
            max_tree_nodes: 8,
            rollback: Snapshot,
            ..LIMITS
        };
        let plan = seq.plan(&mut p, limits, None).unwrap().unwrap();
        assert!(plan.saves_state() && !plan.is_tree());
        assert_eq!(seq.fail_op(3), CacheOp::Restore(3));
    }

    #[test]
    fn the_budget_ends_the_generation_at_the_plan() {
        let mut p = ScriptedProposer::default();
        let mut seq = started(GenerationParams::greedy(0), &mut p);
        assert!(seq.plan(&mut p, LIMITS, None).unwrap().is_none());
        assert_eq!(seq.finish_reason(), Some(FinishReason::MaxTokens));
        let mut seq = started(GenerationParams::greedy(4), &mut p);
        seq.cancel();
        assert!(seq.plan(&mut p, LIMITS, None).unwrap().is_none());
        assert_eq!(seq.finish_reason(), Some(FinishReason::Cancelled));
    }
}
