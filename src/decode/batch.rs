//! Continuous batching: many generations share one batched target forward per step.

use std::collections::VecDeque;
use std::fmt;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::costs::{MeasuredCosts, StepCosts};
use super::goodput::{BatchCost, DraftCandidate, GoodputConfig, choose_draft_lengths};
use super::params::GenerationParams;
use super::policy::DraftLength;
use super::seed::SeedSource;
use super::sequence::{
    CacheOp, Committed, Generation, GenerationError, Plan, Sequence, Start, StepMark, StepTimes,
    StreamChunk, TargetLimits, check_request, kept_prefix,
};
use super::slots::{MIN_SHARED_PREFIX, Placement, SlotPool, common_prefix};
use super::stop::{Detokenizer, FinishReason};
use crate::error::{Error, Result};
use crate::model::{self, BatchTarget, RollbackMode, SlotChunk, SlotInput};
use crate::propose::Proposer;
use crate::verify::{DraftQ, SequenceParams, StepOutput, Verifier, VerifyBatch, VerifyRequest};

/// Identifies a request submitted to a [`BatchGenerator`] (ids count up from 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A streaming callback of a [`BatchRequest`].
type StreamFn = Box<dyn FnMut(StreamChunk<'_>) -> ControlFlow<()> + Send>;

/// One generation for a [`BatchGenerator`]: the prompt, its parameters, its own proposer, and
/// optionally a detokenizer and a streaming callback.
pub struct BatchRequest {
    prompt: Vec<u32>,
    params: GenerationParams,
    proposer: Box<dyn Proposer + Send>,
    detokenizer: Option<Box<dyn Detokenizer + Send>>,
    stream: Option<StreamFn>,
    /// The conversation the request belongs to ([`BatchRequest::with_conversation`]).
    conversation: Option<u64>,
}

impl fmt::Debug for BatchRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchRequest")
            .field("prompt_len", &self.prompt.len())
            .field("params", &self.params)
            .field("proposer", &self.proposer.name())
            .finish_non_exhaustive()
    }
}

impl BatchRequest {
    /// A request generating from `prompt` with `params`, drafting with `proposer` (each request
    /// brings its own; with [`DraftLength::Off`] the request decodes one token per step and the
    /// proposer is only told the prompt and the output).
    pub fn new(
        prompt: Vec<u32>,
        params: GenerationParams,
        proposer: impl Proposer + Send + 'static,
    ) -> Self {
        BatchRequest {
            prompt,
            params,
            proposer: Box::new(proposer),
            detokenizer: None,
            stream: None,
            conversation: None,
        }
    }

    /// Tags the request with a conversation key (any value the caller chooses, for example a
    /// hash of a session id): with prefix reuse on
    /// ([`BatchGenerator::with_prefix_reuse`]), a request goes to the free slot the previous
    /// request of the same conversation left, whose cache then holds the conversation so far.
    /// Without a key the loop matches the longest cached prefix among the free slots; the key
    /// only makes the match survive an edited history. It never changes the output.
    pub fn with_conversation(mut self, key: u64) -> Self {
        self.conversation = Some(key);
        self
    }

    /// Adds a [`Detokenizer`]: the generation then reports its text, streams text, and may use
    /// stop strings (as [`Generator::with_detokenizer`](super::Generator::with_detokenizer)).
    pub fn with_detokenizer(mut self, detokenizer: Box<dyn Detokenizer + Send>) -> Self {
        self.detokenizer = Some(detokenizer);
        self
    }

    /// Calls `f` after every verified step of this request with the step's tokens,
    /// log-probabilities and released text, as [`Generator::generate_stream`](super::Generator::generate_stream) does. Returning
    /// `ControlFlow::Break(())` cancels the request (it finishes with
    /// [`FinishReason::Cancelled`] and the tokens streamed so far).
    pub fn with_stream(
        mut self,
        f: impl FnMut(StreamChunk<'_>) -> ControlFlow<()> + Send + 'static,
    ) -> Self {
        self.stream = Some(Box::new(f));
        self
    }
}

/// Settings of a [`BatchGenerator`].
///
/// | field | default | range |
/// |---|---|---|
/// | `max_batch_tokens` | 512 | `>= 1` (capped by [`BatchTarget::max_batch_tokens`]) |
/// | `prefill_chunk` | 256 | `>= 1` |
/// | `goodput` | [`GoodputConfig::default`] | see there |
///
/// `#[non_exhaustive]`: build it from [`BatchConfig::default`] and the `with_` setters.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BatchConfig {
    /// Most rows one step's forward takes (decode and draft rows first, then prefill chunks
    /// in submission order), in tokens.
    pub max_batch_tokens: usize,
    /// Most prompt tokens one request prefills per step (chunked prefill), in tokens.
    pub prefill_chunk: usize,
    /// The goodput policy that chooses the draft lengths of [`DraftLength::Adaptive`]
    /// requests.
    pub goodput: GoodputConfig,
}

impl Default for BatchConfig {
    /// `max_batch_tokens` 512, `prefill_chunk` 256, the default goodput policy.
    fn default() -> Self {
        BatchConfig {
            max_batch_tokens: 512,
            prefill_chunk: 256,
            goodput: GoodputConfig::default(),
        }
    }
}

impl BatchConfig {
    /// Sets [`BatchConfig::max_batch_tokens`] (checked by [`BatchGenerator::with_config`]).
    pub fn with_max_batch_tokens(mut self, max_batch_tokens: usize) -> Self {
        self.max_batch_tokens = max_batch_tokens;
        self
    }

    /// Sets [`BatchConfig::prefill_chunk`] (checked by [`BatchGenerator::with_config`]).
    pub fn with_prefill_chunk(mut self, prefill_chunk: usize) -> Self {
        self.prefill_chunk = prefill_chunk;
        self
    }

    /// Sets [`BatchConfig::goodput`] (checked by [`BatchGenerator::with_config`]).
    pub fn with_goodput(mut self, goodput: GoodputConfig) -> Self {
        self.goodput = goodput;
        self
    }

    /// Checks the ranges of the table above.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for `max_batch_tokens == 0`, `prefill_chunk == 0` or a bad
    /// goodput setting.
    pub fn validate(&self) -> Result<()> {
        if self.max_batch_tokens == 0 {
            return Err(Error::config("max_batch_tokens", 0, "must be >= 1"));
        }
        if self.prefill_chunk == 0 {
            return Err(Error::config("prefill_chunk", 0, "must be >= 1"));
        }
        self.goodput.validate()
    }
}

/// A request that ended, with its generation or its error.
///
/// `#[non_exhaustive]`: returned by the loop, read its fields.
#[derive(Debug)]
#[non_exhaustive]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Its generation (the finish reason says why it ended), or the error that ended it
    /// with everything emitted before.
    pub result: std::result::Result<Generation, GenerationError>,
}

/// What one [`BatchGenerator::step`] did.
///
/// `#[non_exhaustive]`: returned by the loop, read its fields.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchStepStats {
    /// Sequences that verified a draft (or decoded one token) in this step.
    pub sequences: usize,
    /// Rows of the batched forward (prefill, decode and draft rows), in tokens.
    pub rows: usize,
    /// Of which prompt prefill rows.
    pub prefill_rows: usize,
    /// Draft tokens verified (chain drafts and tree nodes): each sequence's rows are its
    /// drafts plus one, minus one for a chain cut at an end (EOS or a stop) after its final
    /// draft.
    pub draft_rows: usize,
    /// Tokens emitted by all sequences.
    pub emitted: usize,
    /// Requests that finished in this step (any reason).
    pub finished: usize,
    /// Time of the batched forward.
    pub forward_time: Duration,
    /// Tokens replayed after rejections (targets in snapshot mode,
    /// [`crate::BatchRollback::Snapshot`]), in tokens.
    pub replayed: usize,
    /// Time of those replays (restores and their forwards; part of `step_time`).
    pub replay_time: Duration,
    /// Sequences that replayed; they replay together in one batched forward after the
    /// step's commits (0 or 1 replay forward per step).
    pub replaying: usize,
    /// Wall time of the whole step (planning and proposing, forward, verification, commits,
    /// callbacks).
    pub step_time: Duration,
}

/// Totals over every step of a [`BatchGenerator`].
///
/// `#[non_exhaustive]`: returned by the loop, read its fields.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchMetrics {
    /// Steps run (batched forwards).
    pub steps: u64,
    /// Rows of all forwards, in tokens.
    pub rows: u64,
    /// Prompt prefill rows.
    pub prefill_rows: u64,
    /// Draft tokens verified.
    pub draft_rows: u64,
    /// Tokens emitted.
    pub emitted: u64,
    /// Time in batched forwards.
    pub forward_time: Duration,
    /// Tokens replayed after rejections (snapshot mode).
    pub replayed: u64,
    /// Time of those replays.
    pub replay_time: Duration,
    /// Sequence replays (one per sequence and step with a replay).
    pub replays: u64,
    /// Batched replay forwards (at most one per step, for all its replaying sequences).
    pub replay_forwards: u64,
    /// Wall time of all steps.
    pub step_time: Duration,
    /// Prompt tokens the admitted requests found in their slot's cache (kept from an earlier
    /// request, or copied from another slot) and did not prefill.
    pub prompt_tokens_reused: u64,
    /// Prefix copies between slots ([`BatchTarget::copy_prefix`]).
    pub prefix_copies: u64,
    /// Positions copied by them.
    pub prefix_copied_tokens: u64,
}

/// Where a running request is.
enum Phase {
    /// `done` of the `prompt.len() - 1` prefill tokens are in its slot's KV cache.
    Prefill { done: usize },
    /// Verifying one draft per step.
    Decoding,
}

/// A request holding a slot: its sequence, and what the batch loop keeps beside it.
struct Running {
    id: RequestId,
    slot: usize,
    seq: Sequence,
    proposer: Box<dyn Proposer + Send>,
    /// Where its adaptive policy learns step costs from (the loop's when it was admitted).
    costs: Arc<dyn StepCosts>,
    phase: Phase,
    stream: Option<StreamFn>,
    /// The step planned for this forward, with where the step started.
    plan: Option<(Plan, StepMark)>,
    /// `false` when the request failed before its proposer started (its result is then an
    /// empty generation).
    started: bool,
    /// The error that ended the request, if any.
    error: Option<Error>,
    /// Steps this decoding sequence was left out of for want of rows (it goes first next).
    waited: u32,
    /// Time of this step's state save (snapshot mode).
    saved: Duration,
    /// The request's conversation key ([`BatchRequest::with_conversation`]).
    conversation: Option<u64>,
}

/// A prefill chunk of a step: the running request's index, and the prompt range it appends.
#[derive(Debug, Clone, Copy)]
struct PrefillChunk {
    index: usize,
    from: usize,
    to: usize,
}

/// Runs many generations at once (continuous batching) over a [`BatchTarget`]: each
/// [`BatchGenerator::step`] runs **one** batched forward over every active sequence's rows
/// (new requests' prompt prefill chunks under a row budget, each decoding sequence's
/// `[last, d_1 .. d_k]` chain or token tree) and **one** [`Verifier::verify_batch`], then
/// commits, streams and ends each request on its own.
///
/// Every request keeps the guarantees of [`Generator`](super::Generator) alone: the same validation, stop
/// conditions (EOS, stop sequences and strings inside accepted drafts, case C11), token budget,
/// streaming chunks, cancellation, logprobs and metrics. Given batch-invariant logits (the
/// [`BatchTarget`] contract), every greedy request's output is bit-identical to its output from
/// a [`Generator`](super::Generator) alone, and a sampled request's tokens for its seed do not depend on the batch
/// (random draws are keyed by the request's seed and positions, C15) when its drafts are point
/// masses (prompt lookup, suffix, recycling, heads, grammar-forced) or its draft length is
/// fixed. A proposer that samples its drafts (dense q) under [`DraftLength::Adaptive`] keeps the
/// output *distribution* exact, but its tokens for a seed depend on the draft lengths, which the
/// goodput policy chooses from the whole batch (as the adaptive policy of a [`Generator`](super::Generator) alone
/// chooses them from measured times). A request that fails (its proposer
/// errs, a draft is invalid, its verification fails) ends alone with its error in
/// [`Finished::result`]; the others go on.
///
/// **Draft lengths**: requests with [`DraftLength::Fixed`] draft what they ask (chains, or
/// trees with [`TreeDrafts::Tree`](super::TreeDrafts::Tree) and a target has tree support); [`DraftLength::Off`] decodes
/// one token per step; the draft lengths of [`DraftLength::Adaptive`] requests are chosen for
/// the whole batch by the goodput policy ([`super::goodput`]) from each request's acceptance
/// estimates and the step time by rows learned online (measured, or from the cost source of
/// [`BatchGenerator::with_costs`]), so speculation backs off as the batch becomes
/// compute-bound. Adaptive requests draft chains in a batch (the per-request tree-shape
/// policy of [`Generator`](super::Generator) is not used); a request whose draft length is 0 for a while probes
/// with [`super::AdaptiveConfig::probe_draft`] drafts at its probe intervals.
///
/// **Scheduling**: requests take free slots in submission order; decode and draft rows are
/// scheduled before prefill chunks (decoding sequences are never stalled by a long prompt).
///
/// **Prefix reuse** (on by default, [`BatchGenerator::with_prefix_reuse`]): a request that ends
/// (without an error) keeps its slot's KV cache while the slot is free, and a new request
/// takes the free slot of its conversation ([`BatchRequest::with_conversation`]) or the one
/// whose cache starts its prompt, and prefills only the rest; a request with nothing in common
/// takes an empty slot, else the least recently used free one (dropping its cache). With a
/// target that copies prefixes between slots ([`BatchTarget::copy_prefix`]), a request whose
/// longest cached prefix sits in a busy slot, or in a free slot holding more than the shared
/// part, gets a copy of it (many requests with the same system prompt prefill it once, after
/// the first one's prefill has run). Memory: the caches of free slots are the slots' own, so
/// the total stays within `max_slots` caches of at most `max_context` positions, what the target
/// holds with every slot busy (an engine that frees a slot's memory at
/// [`BatchTarget::release`], like `FastBatch`, keeps it allocated while the slot is free; turn
/// reuse off to release slots at once). Reuse never changes a request's output given
/// batch-invariant logits: a kept or copied prefix holds the entries a prefill of the same
/// tokens writes.
///
/// With reuse off, a slot is released when its request ends. Per-request [`Metrics`](super::Metrics) count the batched
/// forward's whole time as each request's forward time, and `prefill_time` stays 0 (the
/// prefill is chunked into shared steps).
///
/// Hidden states ([`crate::HiddenStates`]) are not passed through a [`BatchTarget`]: proposers
/// that read target features get `None` in the batch loop.
///
/// # Example
/// ```
/// use speculative::decode::{BatchGenerator, BatchRequest, GenerationParams};
/// use speculative::propose::PromptLookup;
/// use speculative::test_util::ToyModel;
/// use speculative::PerSlot;
///
/// let target = PerSlot::new((0..4).map(|_| ToyModel::c10()).collect()).unwrap();
/// let mut batch = BatchGenerator::new(target);
/// for n in [8, 16, 24] {
///     let proposer = Box::new(PromptLookup::new(2, 4).unwrap());
///     batch.submit(BatchRequest::new(vec![3; n], GenerationParams::greedy(16), proposer)).unwrap();
/// }
/// let done = batch.run().unwrap();
/// assert_eq!(done.len(), 3);
/// assert!(done.iter().all(|f| f.result.as_ref().unwrap().tokens.len() == 16));
/// ```
pub struct BatchGenerator<B> {
    target: B,
    config: BatchConfig,
    vocab: usize,
    max_context: usize,
    max_slots: usize,
    max_rows: usize,
    tree_nodes: usize,
    /// How the slots roll back ([`BatchTarget::rollback`], read at construction).
    rollback: RollbackMode,
    next_id: u64,
    waiting: VecDeque<(RequestId, BatchRequest)>,
    active: Vec<Running>,
    /// Free slots and what their caches hold.
    slots: SlotPool,
    /// Keep and reuse slot caches across requests ([`BatchGenerator::with_prefix_reuse`]).
    prefix_reuse: bool,
    finished: Vec<Finished>,
    cost: BatchCost,
    /// Where the goodput policy's step costs come from (and every request's adaptive policy,
    /// from its admission).
    costs: Arc<dyn StepCosts>,
    metrics: BatchMetrics,
    /// Slots whose release failed (never used again).
    retired_slots: usize,
    verifier: Verifier,
    logits: Vec<f32>,
    /// Seeds of requests without one.
    seeds: SeedSource,
}

impl<B> fmt::Debug for BatchGenerator<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchGenerator")
            .field("config", &self.config)
            .field("slots", &self.max_slots)
            .field("waiting", &self.waiting.len())
            .field("active", &self.active.len())
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

impl<B: BatchTarget> BatchGenerator<B> {
    /// A batch loop over `target` with [`BatchConfig::default`].
    pub fn new(target: B) -> Self {
        Self::build(target, BatchConfig::default())
    }

    /// A batch loop over `target` with `config`.
    ///
    /// # Errors
    /// [`BatchConfig::validate`]'s.
    pub fn with_config(target: B, config: BatchConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self::build(target, config))
    }

    fn build(mut target: B, config: BatchConfig) -> Self {
        let rollback = target
            .rollback()
            .map_or(RollbackMode::Truncate, |r| r.mode());
        let max_slots = target.max_slots();
        let max_rows = config
            .max_batch_tokens
            .min(target.max_batch_tokens())
            .max(1);
        BatchGenerator {
            vocab: target.vocab_size(),
            max_context: target.max_context(),
            // A target that cannot truncate verifies chains.
            tree_nodes: if rollback == RollbackMode::Truncate {
                target.max_tree_nodes()
            } else {
                0
            },
            rollback,
            target,
            config,
            max_slots,
            max_rows,
            next_id: 0,
            waiting: VecDeque::new(),
            active: Vec::new(),
            slots: SlotPool::new(max_slots),
            prefix_reuse: true,
            finished: Vec::new(),
            cost: BatchCost::default(),
            costs: Arc::new(MeasuredCosts),
            metrics: BatchMetrics::default(),
            retired_slots: 0,
            verifier: Verifier::new(),
            logits: Vec::new(),
            seeds: SeedSource::default(),
        }
    }

    /// Turns prefix reuse across requests on (the default) or off (type docs). Off, every slot
    /// is released when its request ends and every request prefills its whole prompt, and
    /// proposers are started with [`Proposer::begin`].
    pub fn with_prefix_reuse(mut self, on: bool) -> Self {
        self.prefix_reuse = on;
        self
    }

    /// Prompt tokens the caches of the free slots hold (kept for reuse).
    pub fn cached_tokens(&self) -> usize {
        self.slots.held_tokens()
    }

    /// Sets where requests without a seed get theirs (default [`SeedSource::os`]): each such
    /// request draws one when it is submitted, and reports it in [`Generation::seed`].
    pub fn with_seed_source(mut self, seeds: SeedSource) -> Self {
        self.seeds = seeds;
        self
    }

    /// Sets where the goodput policy learns the step time by rows from, and every request's
    /// adaptive policy its step costs ([`Generator::with_costs`](super::Generator::with_costs)): [`MeasuredCosts`] (the
    /// measured times, the default) or, for example, a [`FixedCosts`](super::FixedCosts)
    /// curve, which makes the draft lengths it chooses reproducible whatever the machine's
    /// load. A step of `rows` rows with `d` draft rows is recorded as
    /// [`StepCosts::forward_secs`]`(rows, forward time)` plus [`StepCosts::propose_secs`]`(d,
    /// the rest of the step)`. Requests admitted before the call keep the source they started
    /// with; [`BatchMetrics`] and [`BatchStepStats`] keep the measured times either way.
    pub fn with_costs(mut self, costs: impl StepCosts + 'static) -> Self {
        self.costs = Arc::new(costs);
        self
    }

    /// Where the goodput policy learns step costs from ([`BatchGenerator::with_costs`]).
    pub fn costs(&self) -> &dyn StepCosts {
        &*self.costs
    }

    /// Queues a request; it takes a slot as soon as one is free (submission order).
    ///
    /// # Errors
    /// Checked here, before anything is queued: [`Error::EmptyPrompt`],
    /// [`Error::PromptTooLong`], [`Error::TokenOutOfVocab`] for a prompt token, the errors of
    /// [`GenerationParams::validate`], and [`Error::InvalidConfig`] when the target has no slot
    /// or a [`DraftLength::Fixed`] draft (`k + 1` rows, or the tree's node budget + 1) does not
    /// fit the row budget ([`BatchConfig::max_batch_tokens`] and the target's).
    pub fn submit(&mut self, mut req: BatchRequest) -> Result<RequestId> {
        check_request(
            &req.prompt,
            &req.params,
            &self.limits(),
            req.detokenizer.is_some(),
        )?;
        if self.max_slots == 0 {
            return Err(Error::config(
                "max_slots",
                0,
                "the BatchTarget has no slot to run a request in",
            ));
        }
        if let DraftLength::Fixed(k) = req.params.draft {
            let rows = 1 + fixed_draft_rows(&req.params, k, self.tree_nodes);
            if rows > self.max_rows {
                return Err(Error::config(
                    "draft",
                    format!("{rows} rows per step (row budget {})", self.max_rows),
                    "a fixed draft (k + 1 rows, or the tree's node budget + 1) must fit the batch's row \
                     budget (BatchConfig::max_batch_tokens and the target's max_batch_tokens)",
                ));
            }
        }
        if req.params.seed.is_none() {
            req.params.seed = Some(self.seeds.next_seed());
        }
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.waiting.push_back((id, req));
        Ok(id)
    }

    /// Cancels a request: a waiting one finishes at once with no tokens, an active one with
    /// the tokens emitted so far ([`FinishReason::Cancelled`]; its slot is released). `false`
    /// when the id is not waiting or active (unknown or already finished).
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|(w, _)| *w == id) {
            let seed = self
                .waiting
                .remove(i)
                .map_or(0, |(_, r)| r.params.seed.unwrap_or(0));
            self.finished.push(Finished {
                id,
                result: Ok(Generation::empty(FinishReason::Cancelled, seed)),
            });
            return true;
        }
        if let Some(i) = self.active.iter().position(|s| s.id == id) {
            let run = self.active.swap_remove(i);
            self.finish(run);
            return true;
        }
        false
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests holding a slot (prefilling or decoding).
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// `true` when no request is waiting or active.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.active.is_empty()
    }

    /// Totals over every step so far.
    pub fn metrics(&self) -> &BatchMetrics {
        &self.metrics
    }

    /// The step time by rows the goodput policy learned: `(rows, median seconds)` per row
    /// count seen, ascending (measured, or from the source set by
    /// [`BatchGenerator::with_costs`]).
    pub fn cost_curve(&self) -> Vec<(usize, f64)> {
        self.cost.curve()
    }

    /// The requests finished since the last call, in the order they finished.
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// Steps until no request is waiting or active and returns every finished request, in the
    /// order they finished (match them to your requests by [`Finished::id`]).
    ///
    /// # Errors
    /// The first error of [`BatchGenerator::step`] (after it the requests of the failed step
    /// have finished with errors; the finished list is kept for
    /// [`BatchGenerator::take_finished`]).
    pub fn run(&mut self) -> Result<Vec<Finished>> {
        while !self.is_idle() {
            self.step()?;
        }
        Ok(self.take_finished())
    }

    /// Gives the target back (every request still waiting or active is dropped).
    pub fn into_target(mut self) -> B {
        self.active.clear();
        self.waiting.clear();
        self.target
    }

    /// Runs one step: admits waiting requests into free slots, plans every decoding
    /// sequence's draft (the goodput policy for adaptive ones), runs one batched forward over
    /// all their rows plus prefill chunks, verifies every sequence in one
    /// [`Verifier::verify_batch`], commits, streams and ends requests. With nothing to do it
    /// returns empty statistics.
    ///
    /// # Errors
    /// A failure of the batched forward itself (the target's error): every request of that
    /// forward finishes with an error naming it, and the others stay queued. Errors of one
    /// request never fail the step.
    pub fn step(&mut self) -> Result<BatchStepStats> {
        let t0 = Instant::now();
        let mut stats = BatchStepStats::default();
        stats.finished += self.admit();
        stats.finished += self.cancel_prefilling();
        if self.active.is_empty() && !self.waiting.is_empty() && self.slots.is_empty() {
            return Err(Error::TargetContract {
                what: "BatchTarget::release failed for every slot: no slot is left for the waiting requests",
            });
        }
        // Sequences left out of earlier forwards for want of rows go first, then by age.
        self.active
            .sort_by_key(|s| (std::cmp::Reverse(s.waited), s.id));
        let choice = self.choose_lengths();
        let mut rows_left = self.max_rows;
        stats.finished += self.plan_all(&choice, &mut rows_left);
        // `swap_remove` may have moved planned sequences: find them by their plan.
        let decoding: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].plan.is_some())
            .collect();
        let prefill = self.prefill_chunks(rows_left);
        if decoding.is_empty() && prefill.is_empty() {
            stats.step_time = t0.elapsed();
            return Ok(stats);
        }
        let t_fwd = Instant::now();
        let (rows, forward) = self.forward(&decoding, &prefill);
        stats.rows = rows;
        stats.forward_time = t_fwd.elapsed();
        stats.prefill_rows = prefill.iter().map(|c| c.to - c.from).sum();
        if let Err(e) = forward {
            return Err(self.fail_forward(e, &decoding, &prefill));
        }
        let t_ver = Instant::now();
        let outs = self.verify_all(&decoding);
        let times = StepTimes {
            forward: stats.forward_time,
            verify: t_ver.elapsed(),
            ..StepTimes::default()
        };
        let mut done = self.commit_all(&decoding, outs, times, &mut stats);
        self.prefill_progress(&prefill, &mut done);
        stats.finished += self.finish_all(done);
        stats.step_time = t0.elapsed();
        self.learn(&stats);
        Ok(stats)
    }

    /// The limits every sequence plans with.
    fn limits(&self) -> TargetLimits {
        TargetLimits {
            vocab: self.vocab,
            max_context: self.max_context,
            max_tree_nodes: self.tree_nodes,
            rollback: self.rollback,
        }
    }

    /// Moves waiting requests into free slots: resets the slot, starts the sequence and its
    /// proposer (`begin`); prompts of one token start decoding at once. Returns how many
    /// ended here.
    fn admit(&mut self) -> usize {
        let mut ended_here = 0;
        // Requests waiting for a shared prefix another request is prefilling; they keep
        // their place at the front of the queue.
        let mut deferred = Vec::new();
        while let Some((id, req)) = self.waiting.pop_front() {
            if self.prefix_in_prefill(&req.prompt) {
                deferred.push((id, req));
                continue;
            }
            let Some(place) = self.place(&req.prompt, req.conversation) else {
                self.waiting.push_front((id, req));
                break;
            };
            let mut run = self.start(id, place, req);
            let ended = run.error.is_some() || run.seq.finish_reason().is_some();
            if ended {
                self.finish(run);
                ended_here += 1;
            } else {
                // A one-token prompt has nothing to prefill; a request with no token to
                // generate ends at its first plan, with nothing prefilled.
                let cached = matches!(run.phase, Phase::Prefill { done } if done + 1 == run.seq.prompt().len());
                if cached || run.seq.params().max_new_tokens == 0 {
                    run.phase = Phase::Decoding;
                }
                self.active.push(run);
            }
        }
        for d in deferred.into_iter().rev() {
            self.waiting.push_front(d);
        }
        ended_here
    }

    /// With prefix copy on: `true` when a request still prefilling has a prompt that shares
    /// at least [`MIN_SHARED_PREFIX`] tokens with `prompt` beyond what any slot's cache holds
    /// now. The new request then waits for that prefill and copies the prefix
    /// ([`BatchTarget::copy_prefix`]) instead of prefilling it too, so that a system prompt
    /// shared by requests submitted together is prefilled once, not once per request. The
    /// wait ends when the source's cache holds the prefix or the source leaves.
    fn prefix_in_prefill(&self, prompt: &[u32]) -> bool {
        if !(self.prefix_reuse && self.target.can_copy_prefix()) || self.active.is_empty() {
            return false;
        }
        let limit = prompt.len().saturating_sub(1);
        let lcp = |t: &[u32]| common_prefix(t, prompt).min(limit);
        let mut coming = 0;
        let mut now = self.slots.longest_prefix(prompt);
        for r in &self.active {
            let Ok(held) = self.target.seq_len(r.slot) else {
                continue;
            };
            let n = lcp(r.seq.prompt());
            if matches!(r.phase, Phase::Prefill { .. }) && n > held {
                coming = coming.max(n);
            }
            now = now.max(n.min(held));
        }
        coming >= MIN_SHARED_PREFIX && coming > now
    }

    /// Takes a free slot for a request of `prompt` ([`SlotPool::take`]; the tokens the busy
    /// slots hold are candidates for a prefix copy when the target copies prefixes).
    fn place(&mut self, prompt: &[u32], conversation: Option<u64>) -> Option<Placement> {
        let copy = self.prefix_reuse && self.target.can_copy_prefix();
        let busy: Vec<(usize, &[u32])> = if copy {
            self.active
                .iter()
                .filter_map(|r| {
                    let n = self.target.seq_len(r.slot).ok()?;
                    Some((r.slot, r.seq.context().get(..n)?))
                })
                .collect()
        } else {
            Vec::new()
        };
        self.slots
            .take(prompt, conversation, self.prefix_reuse, copy, &busy)
    }

    /// Brings the slot of `place` to its kept prefix: the prefix copy, then the truncation.
    /// Returns the prompt tokens the slot holds (0 when the copy failed).
    fn prepare_slot(&mut self, place: Placement) -> Result<usize> {
        let mut keep = place.keep;
        if let Some((src, len)) = place.copy {
            if self.target.copy_prefix(src, place.slot, len).is_ok()
                && self.target.seq_len(place.slot).ok() == Some(len)
            {
                self.metrics.prefix_copies += 1;
                self.metrics.prefix_copied_tokens += len as u64;
            } else {
                // A failed copy only costs the prefill.
                keep = 0;
            }
        }
        let held = self.target.seq_len(place.slot)?;
        let keep = kept_prefix(keep, held, self.target.rollback().is_none());
        self.target.truncate(place.slot, keep)?;
        self.metrics.prompt_tokens_reused += keep as u64;
        Ok(keep)
    }

    /// A request of the queue, started in the slot of `place` (validated at
    /// [`BatchGenerator::submit`]); a failure to prepare the slot or start the proposer is in
    /// its `error`.
    fn start(&mut self, id: RequestId, place: Placement, req: BatchRequest) -> Running {
        let at = Instant::now();
        let slot = place.slot;
        let prepared = self.prepare_slot(place);
        let reused = *prepared.as_ref().unwrap_or(&0);
        let mut seq = Sequence::new();
        seq.begin(Start {
            prompt: &req.prompt,
            seed: req.params.seed.unwrap_or(0),
            params: req.params,
            detokenizer: req.detokenizer.map(|d| Arc::new(d) as Arc<dyn Detokenizer>),
            limits: self.limits(),
            hidden_width: 0,
            reused,
            at,
        });
        let mut run = Running {
            id,
            slot,
            seq,
            proposer: req.proposer,
            costs: Arc::clone(&self.costs),
            phase: Phase::Prefill { done: reused },
            stream: req.stream,
            plan: None,
            started: false,
            error: None,
            waited: 0,
            saved: Duration::ZERO,
            conversation: req.conversation,
        };
        let reuse = self.prefix_reuse;
        let started = prepared.and_then(|_| run.seq.start_proposer(&mut *run.proposer, reuse));
        match started {
            Ok(()) => run.started = true,
            Err(e) => run.error = Some(e),
        }
        run
    }

    /// Ends the requests still prefilling whose [`GenerationParams::cancel`] flag is set (a
    /// decoding request sees it in its next plan, as with [`Generator`](super::Generator)).
    fn cancel_prefilling(&mut self) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < self.active.len() {
            let s = &self.active[i];
            if s.seq.cancel_flagged() && matches!(s.phase, Phase::Prefill { .. }) {
                let run = self.active.swap_remove(i);
                self.finish(run);
                n += 1;
            } else {
                i += 1;
            }
        }
        n
    }

    /// The draft lengths of the decoding adaptive sequences for this step: the goodput policy
    /// over the batch (module [`super::goodput`]), then each sequence's probe schedule.
    fn choose_lengths(&mut self) -> Vec<(RequestId, usize)> {
        let (ids, acc, decode_rows, prefill_rows) = self.goodput_inputs();
        if ids.is_empty() {
            return Vec::new();
        }
        let cands: Vec<DraftCandidate<'_>> = acc
            .iter()
            .map(|a| DraftCandidate { acceptance: a })
            .collect();
        let prior = self.config.goodput.prior_row_cost;
        let cost = &self.cost;
        // Decode and draft rows come first; prefill chunks take what is left, so drafts are
        // limited by the decode rows only, and the step's cost counts the prefill rows that
        // still fit beside them.
        let extra = self.max_rows.saturating_sub(decode_rows);
        let max_rows = self.max_rows;
        // One emitted token per decoding sequence whatever the drafts.
        let fixed_tokens = self
            .active
            .iter()
            .filter(|s| matches!(s.phase, Phase::Decoding))
            .count() as f64;
        let k = choose_draft_lengths(&cands, decode_rows, fixed_tokens, extra, |r| {
            let prefill = prefill_rows.min(max_rows.saturating_sub(r));
            cost.policy_cost(r + prefill, prior)
        });
        // Probes take draft rows the policy left over.
        let mut left = extra.saturating_sub(k.iter().sum());
        let mut out = Vec::with_capacity(ids.len());
        for ((&i, &ki), a) in ids.iter().zip(&k).zip(&acc) {
            let s = &mut self.active[i];
            let DraftLength::Adaptive(cfg) = &s.seq.params().draft else {
                continue;
            };
            let cfg = cfg.clone();
            let probe = s.seq.adaptive_mut().probe_now(&cfg, ki == 0);
            let k = if probe {
                let kp = cfg.probe_draft.min(a.len()).min(left);
                left -= kp;
                kp
            } else {
                ki
            };
            out.push((s.id, k));
        }
        out
    }

    /// What the goodput policy needs of the batch: the indices of the decoding adaptive
    /// sequences and their acceptance estimates (as many as drafts they may take), the rows
    /// the other decoding sequences take (one each, plus fixed drafts), and the prefill rows
    /// wanted.
    fn goodput_inputs(&self) -> (Vec<usize>, Vec<Vec<f64>>, usize, usize) {
        let mut decode_rows = 0usize;
        let mut prefill_rows = 0usize;
        let mut acc: Vec<Vec<f64>> = Vec::new();
        let mut ids: Vec<usize> = Vec::new();
        for (i, s) in self.active.iter().enumerate() {
            let Phase::Prefill { done } = s.phase else {
                decode_rows += 1;
                match &s.seq.params().draft {
                    DraftLength::Adaptive(a) => {
                        let cap = if s.started { s.seq.draft_cap() } else { 0 };
                        let n = cap.min(a.max_draft).min(self.config.goodput.max_draft);
                        let st = s.seq.adaptive();
                        acc.push((0..n).map(|j| st.acceptance(j)).collect());
                        ids.push(i);
                    }
                    DraftLength::Fixed(k) => {
                        // Unknown acceptance: count the rows, not their tokens.
                        decode_rows += fixed_draft_rows(s.seq.params(), *k, self.tree_nodes);
                    }
                    DraftLength::Off => {}
                }
                continue;
            };
            let left = s.seq.prompt().len() - 1 - done;
            prefill_rows += left.min(self.config.prefill_chunk);
        }
        (ids, acc, decode_rows, prefill_rows)
    }

    /// The plan phase of every decoding sequence that fits what is left of the row budget
    /// (`k_override` from `choice` for adaptive ones); the others wait a step. Returns how
    /// many requests ended here.
    fn plan_all(&mut self, choice: &[(RequestId, usize)], rows_left: &mut usize) -> usize {
        let limits = self.limits();
        let mut ended = 0;
        let mut i = 0;
        while i < self.active.len() {
            let s = &mut self.active[i];
            if !matches!(s.phase, Phase::Decoding) {
                i += 1;
                continue;
            }
            let k_override = choice.iter().find(|(id, _)| *id == s.id).map(|&(_, k)| k);
            if row_bound(s.seq.params(), k_override, self.tree_nodes) > *rows_left {
                // No room left in this forward: the sequence waits a step. (Every sequence fits
                // an empty forward: `submit` refuses fixed drafts wider than the budget, and the
                // goodput policy keeps adaptive drafts within it.)
                s.waited += 1;
                i += 1;
                continue;
            }
            let mark = s.seq.mark();
            let planned = s.seq.plan(&mut *s.proposer, limits, k_override);
            match planned.and_then(|p| save_planned(&mut self.target, s, p)) {
                Ok(Some(p)) => {
                    *rows_left = rows_left.saturating_sub(p.rows());
                    s.plan = Some((p, mark));
                    s.waited = 0;
                    i += 1;
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    let len = s.seq.fail(mark);
                    rewind_slot(&mut self.target, s.slot, s.seq.fail_op(len));
                    s.error = Some(e);
                }
            }
            let run = self.active.swap_remove(i);
            self.finish(run);
            ended += 1;
        }
        ended
    }

    /// Prefill chunks under what is left of the row budget, in submission order.
    fn prefill_chunks(&self, mut rows_left: usize) -> Vec<PrefillChunk> {
        let mut chunks = Vec::new();
        let mut order: Vec<usize> = (0..self.active.len())
            .filter(|&i| matches!(self.active[i].phase, Phase::Prefill { .. }))
            .collect();
        order.sort_by_key(|&i| self.active[i].id);
        for index in order {
            if rows_left == 0 {
                break;
            }
            let s = &self.active[index];
            let Phase::Prefill { done } = s.phase else {
                continue;
            };
            let total = s.seq.prompt().len() - 1;
            let n = (total - done).min(self.config.prefill_chunk).min(rows_left);
            if n > 0 {
                chunks.push(PrefillChunk {
                    index,
                    from: done,
                    to: done + n,
                });
                rows_left -= n;
            }
        }
        chunks
    }

    /// One batched forward over the planned rows of `decoding` (first, in that order) and the
    /// prefill chunks; checks the logits' size. Returns the rows fed and the result.
    fn forward(&mut self, decoding: &[usize], prefill: &[PrefillChunk]) -> (usize, Result<()>) {
        let mut chunks: Vec<SlotChunk<'_>> = Vec::with_capacity(decoding.len() + prefill.len());
        for &i in decoding {
            let s = &self.active[i];
            let (plan, _) = s.plan.as_ref().expect("a decoding sequence is planned");
            chunks.push(SlotChunk {
                slot: s.slot,
                input: s.seq.rows(plan),
            });
        }
        for c in prefill {
            let s = &self.active[c.index];
            chunks.push(SlotChunk {
                slot: s.slot,
                input: SlotInput::Prefill(&s.seq.prompt()[c.from..c.to]),
            });
        }
        let logit_rows: usize = chunks.iter().map(|c| c.input.logit_rows()).sum();
        let rows = chunks.iter().map(|c| c.input.rows()).sum();
        let result = self
            .target
            .forward_batch(&chunks, &mut self.logits)
            .and_then(|()| {
                if self.logits.len() == logit_rows * self.vocab {
                    Ok(())
                } else {
                    Err(Error::TargetContract {
                        what: "BatchTarget::forward_batch wrote logits of the wrong size ([sum of logit rows, vocab])",
                    })
                }
            });
        (rows, result)
    }

    /// Verifies every planned sequence in one [`Verifier::verify_batch`] over the forward's
    /// logits (decode chunks first, in `decoding` order), then checks each slot holds its
    /// context but the last token plus the rows it was fed (the check
    /// [`Generator`](super::Generator) makes after its own forward). Per-sequence results.
    fn verify_all(&mut self, decoding: &[usize]) -> Vec<Result<StepOutput>> {
        let n = decoding.len();
        if n == 0 {
            return Vec::new();
        }
        // The requests as the sequences would verify them alone.
        let reqs: Vec<VerifyRequest<'_>> = decoding
            .iter()
            .map(|&i| {
                let s = &self.active[i];
                let (plan, _) = s.plan.as_ref().expect("a decoding sequence is planned");
                s.seq.verify_request(plan, &[])
            })
            .collect();
        let flat = FlatDrafts::of(&reqs);
        let sessions: Vec<SequenceParams<'_>> = reqs
            .iter()
            .map(|r| SequenceParams::from(r.state).draft_probs(r.draft_probs))
            .collect();
        let mut batch = VerifyBatch::new(
            self.vocab,
            &self.logits,
            &flat.tokens,
            &flat.offsets,
            &sessions,
        );
        if flat.any_tree {
            batch = batch.tree(&flat.parents);
        }
        if flat.any_ends {
            batch = batch.ends(&flat.ends);
        }
        if flat.any_schemes {
            batch = batch.schemes(&flat.schemes);
        }
        let mut outs = match self.verifier.verify_batch(&batch) {
            Ok(v) => v,
            Err(e) => {
                // A malformed batch is the loop's own bug; report it on every sequence.
                let msg = e.to_string();
                (0..n)
                    .map(|_| Err(Error::Model(msg.clone().into())))
                    .collect()
            }
        };
        for (o, &i) in outs.iter_mut().zip(decoding) {
            let s = &self.active[i];
            let (plan, _) = s.plan.as_ref().expect("a decoding sequence is planned");
            if self.target.seq_len(s.slot).ok() != Some(s.seq.cache_len_after(plan)) {
                *o = Err(Error::TargetContract {
                    what: "BatchTarget::seq_len(slot) after forward_batch is not the slot's context plus its rows",
                });
            }
        }
        outs
    }

    /// The commit and observe phases of every verified sequence, and its stream callback.
    /// Sequences whose rollback is a replay (snapshot mode) replay together in one batched
    /// forward after the others committed ([`BatchGenerator::replay_all`]). Returns the
    /// indices of the requests that ended.
    fn commit_all(
        &mut self,
        decoding: &[usize],
        outs: Vec<Result<StepOutput>>,
        times: StepTimes,
        stats: &mut BatchStepStats,
    ) -> Vec<usize> {
        let mut done: Vec<usize> = Vec::new();
        let mut replaying: Vec<Replaying> = Vec::new();
        for (&i, out) in decoding.iter().zip(outs) {
            let s = &mut self.active[i];
            let (plan, mark) = s.plan.take().expect("a decoding sequence is planned");
            stats.sequences += 1;
            stats.draft_rows += plan.drafted();
            let times = StepTimes {
                snapshot: s.saved,
                ..times
            };
            let committed = out.and_then(|out| commit_slot(&mut self.target, s, &plan, out));
            let r = match committed {
                Ok((out, c, Some((from, len)))) => {
                    replaying.push(Replaying {
                        i,
                        plan,
                        mark,
                        out,
                        committed: c,
                        from,
                        len,
                        times,
                    });
                    continue;
                }
                Ok((out, c, None)) => {
                    s.seq
                        .observe(&mut *s.proposer, &*s.costs, &plan, out, c, times)
                }
                Err(e) => Err(e),
            };
            settle_one(&mut self.target, s, i, mark, r, stats, &mut done);
        }
        self.replay_all(replaying, stats, &mut done);
        done
    }

    /// The replays of a step (snapshot mode): restores each replaying slot's saved state, then
    /// feeds every slot's accepted tokens in one batched forward (prefill chunks, no logits
    /// read), checks each slot's length and runs the observe phases. The replay's time is
    /// shared among the sequences by tokens replayed. A slot whose restore fails, or every
    /// replaying slot when the forward fails, ends its request with the error.
    fn replay_all(
        &mut self,
        replaying: Vec<Replaying>,
        stats: &mut BatchStepStats,
        done: &mut Vec<usize>,
    ) {
        if replaying.is_empty() {
            return;
        }
        let t = Instant::now();
        let restored: Vec<Result<()>> = replaying
            .iter()
            .map(|r| model::restore_slot(&mut self.target, self.active[r.i].slot))
            .collect();
        let chunks: Vec<SlotChunk<'_>> = replaying
            .iter()
            .zip(&restored)
            .filter(|(_, ok)| ok.is_ok())
            .map(|(r, _)| {
                let s = &self.active[r.i];
                let input = SlotInput::Prefill(&s.seq.context()[r.from..r.len]);
                SlotChunk {
                    slot: s.slot,
                    input,
                }
            })
            .collect();
        let fed = if chunks.is_empty() {
            Ok(())
        } else {
            self.target
                .forward_batch(&chunks, &mut Vec::new())
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let elapsed = t.elapsed();
        let tokens: usize = replaying.iter().map(|r| r.len - r.from).sum();
        for (r, restore) in replaying.into_iter().zip(restored) {
            let s = &mut self.active[r.i];
            let n = r.len - r.from;
            let times = StepTimes {
                replay: elapsed.mul_f64(n as f64 / tokens.max(1) as f64),
                replayed: n,
                ..r.times
            };
            let res = restore
                .and_then(|()| {
                    fed.clone().map_err(|msg| {
                        Error::Model(format!("the batched replay forward failed: {msg}").into())
                    })
                })
                .and_then(|()| check_slot_len(&self.target, s.slot, r.len))
                .and_then(|()| {
                    stats.replayed += n;
                    stats.replay_time += times.replay;
                    stats.replaying += 1;
                    s.seq.observe(
                        &mut *s.proposer,
                        &*s.costs,
                        &r.plan,
                        r.out,
                        r.committed,
                        times,
                    )
                });
            settle_one(&mut self.target, s, r.i, r.mark, res, stats, done);
        }
    }

    /// Records the prefill chunks fed; a request whose prompt is in starts decoding (after a
    /// check of its slot's length; one that fails it is added to `done`).
    fn prefill_progress(&mut self, prefill: &[PrefillChunk], done: &mut Vec<usize>) {
        for c in prefill {
            let s = &mut self.active[c.index];
            let total = s.seq.prompt().len() - 1;
            s.phase = Phase::Prefill { done: c.to };
            if c.to == total {
                if self.target.seq_len(s.slot).ok() != Some(total) {
                    s.error = Some(Error::TargetContract {
                        what: "seq_len after the prefill chunks",
                    });
                    done.push(c.index);
                } else {
                    s.phase = Phase::Decoding;
                }
            }
        }
    }

    /// Ends the requests at `done` (indices into the running requests); returns how many.
    fn finish_all(&mut self, mut done: Vec<usize>) -> usize {
        done.sort_unstable();
        done.dedup();
        for &i in done.iter().rev() {
            let run = self.active.swap_remove(i);
            self.finish(run);
        }
        done.len()
    }

    /// The goodput policy learns the step's cost from the cost source (measured by default:
    /// the forward plus the rest of the step, that is the step time); the totals.
    fn learn(&mut self, stats: &BatchStepStats) {
        let rest = stats
            .step_time
            .saturating_sub(stats.forward_time + stats.replay_time);
        let mut step_secs = self.costs.forward_secs(stats.rows, stats.forward_time)
            + self.costs.propose_secs(stats.draft_rows, rest);
        if stats.replayed > 0 {
            // Replays after rejections (snapshot mode): c(replay) on top of the step.
            step_secs += self.costs.replay_secs(stats.replayed, stats.replay_time);
        }
        self.cost.observe(stats.rows, step_secs);
        let m = &mut self.metrics;
        m.steps += 1;
        m.rows += stats.rows as u64;
        m.prefill_rows += stats.prefill_rows as u64;
        m.draft_rows += stats.draft_rows as u64;
        m.emitted += stats.emitted as u64;
        m.forward_time += stats.forward_time;
        m.replayed += stats.replayed as u64;
        m.replay_time += stats.replay_time;
        m.replays += stats.replaying as u64;
        m.replay_forwards += (stats.replaying > 0) as u64;
        m.step_time += stats.step_time;
    }

    /// Ends every request of a failed forward with an error naming the target's and returns
    /// the target's error for [`BatchGenerator::step`].
    fn fail_forward(&mut self, e: Error, decoding: &[usize], prefill: &[PrefillChunk]) -> Error {
        let msg = e.to_string();
        let failed = || Error::Model(format!("the batched forward failed: {msg}").into());
        let mut hit: Vec<usize> = Vec::new();
        for &i in decoding {
            let s = &mut self.active[i];
            if let Some((_, mark)) = s.plan.take() {
                let len = s.seq.fail(mark);
                rewind_slot(&mut self.target, s.slot, s.seq.fail_op(len));
            }
            s.error = Some(failed());
            hit.push(i);
        }
        for c in prefill {
            self.active[c.index].error = Some(failed());
            hit.push(c.index);
        }
        self.finish_all(hit);
        e
    }

    /// Ends a request: its generation (cancelled when still running), its slot released.
    fn finish(&mut self, mut run: Running) {
        let failed = run.error.is_some();
        let result = if run.started {
            let generation = run.seq.take_generation(&mut *run.proposer);
            match run.error.take() {
                Some(error) => Err(GenerationError {
                    error,
                    partial: Box::new(Generation {
                        finish: FinishReason::Error,
                        ..generation
                    }),
                }),
                None => Ok(generation),
            }
        } else {
            Err(GenerationError {
                error: run.error.take().unwrap_or(Error::TargetContract {
                    what: "a request ended before it started",
                }),
                partial: Box::new(Generation::empty(FinishReason::Error, run.seq.seed())),
            })
        };
        self.give_back(&run, failed);
        self.finished.push(Finished { id: run.id, result });
    }

    /// Gives an ended request's slot back: with prefix reuse, after a request without an
    /// error, the slot keeps its cache (the request's context but the last token, or the
    /// prompt prefilled so far); otherwise it is released. A slot whose release fails is not
    /// used again (its state is unknown); `step` reports when no usable slot is left for the
    /// waiting requests.
    fn give_back(&mut self, run: &Running, failed: bool) {
        if self.prefix_reuse && run.started && !failed {
            let held = self
                .target
                .seq_len(run.slot)
                .ok()
                .and_then(|n| run.seq.context().get(..n));
            if let Some(tokens) = held {
                self.slots.put(run.slot, tokens.to_vec(), run.conversation);
                return;
            }
        }
        if self.target.release(run.slot).is_ok() {
            self.slots.put(run.slot, Vec::new(), None);
        } else {
            self.retired_slots += 1;
        }
    }
}

/// A verified sequence whose commit left a replay (snapshot mode) for the step's one batched
/// replay forward ([`BatchGenerator::replay_all`]): `context[from..len]` to feed after its
/// slot's state is restored.
struct Replaying {
    /// Index of the running request.
    i: usize,
    plan: Plan,
    mark: StepMark,
    out: StepOutput,
    committed: Committed,
    from: usize,
    len: usize,
    times: StepTimes,
}

/// What [`commit_slot`] gives back: the step's output, what it committed, and the context range
/// `(from, len)` left to replay (snapshot mode), if any.
type SlotCommit = (StepOutput, Committed, Option<(usize, usize)>);

/// The commit phase of one verified sequence and its cache operation on its slot, except a
/// replay, which is returned (`Some((from, len))`) for the batched replay.
fn commit_slot<B: BatchTarget>(
    target: &mut B,
    s: &mut Running,
    plan: &Plan,
    out: StepOutput,
) -> Result<SlotCommit> {
    let (cache, committed) = s.seq.commit(plan, &out, None)?;
    if let CacheOp::Replay { from, len } = cache {
        return Ok((out, committed, Some((from, len))));
    }
    apply_slot(target, s.slot, cache)?;
    Ok((out, committed, None))
}

/// After a sequence's observe phase (`r`): its stream callback and whether it ended (pushed to
/// `done`); on an error, the sequence fails back to `mark` and its slot is rewound.
fn settle_one<B: BatchTarget>(
    target: &mut B,
    s: &mut Running,
    i: usize,
    mark: StepMark,
    r: Result<()>,
    stats: &mut BatchStepStats,
    done: &mut Vec<usize>,
) {
    match r {
        Ok(()) => {
            let chunk = s.seq.last_chunk();
            stats.emitted += chunk.tokens.len();
            if let Some(f) = s.stream.as_mut()
                && f(chunk).is_break()
            {
                s.seq.cancel();
            }
            if s.seq.finish_reason().is_some() || s.seq.is_cancelled() {
                done.push(i);
            }
        }
        Err(e) => {
            let len = s.seq.fail(mark);
            rewind_slot(target, s.slot, s.seq.fail_op(len));
            s.error = Some(e);
            done.push(i);
        }
    }
}

/// [`Error::TargetContract`] unless `slot` holds `len` positions (an invalid slot reads as an
/// impossible length).
fn check_slot_len<B: BatchTarget>(target: &B, slot: usize, len: usize) -> Result<()> {
    if target.seq_len(slot).unwrap_or(usize::MAX) != len {
        return Err(Error::TargetContract {
            what: "BatchTarget::seq_len(slot) after the step's replay (restore_state and the replayed tokens)",
        });
    }
    Ok(())
}

/// Snapshot mode: saves the slot's state before the forward of a planned step (its time in
/// `s.saved`); passes the plan through.
fn save_planned<B: BatchTarget>(
    target: &mut B,
    s: &mut Running,
    plan: Option<Plan>,
) -> Result<Option<Plan>> {
    s.saved = Duration::ZERO;
    if plan.as_ref().is_some_and(Plan::saves_state) {
        let t = Instant::now();
        model::save_slot(target, s.slot)?;
        s.saved = t.elapsed();
    }
    Ok(plan)
}

/// Applies a cache operation other than a replay to `slot` (as [`super::Generator`]'s driver
/// does to its target: truncation, the tree commit, or the rollback of a target that cannot
/// truncate); checks the slot's length except after a plain truncation. A replay is done by
/// [`BatchGenerator::replay_all`] for all slots at once; here it is a contract error.
fn apply_slot<B: BatchTarget>(target: &mut B, slot: usize, op: CacheOp<'_>) -> Result<()> {
    match op {
        CacheOp::Keep(n) => return target.truncate(slot, n),
        CacheOp::CommitTree { path, .. } => target.commit_tree(slot, path)?,
        CacheOp::Hold(_) => {}
        CacheOp::Replay { .. } => {
            return Err(Error::TargetContract {
                what: "a replay outside the batched replay",
            });
        }
        CacheOp::KeepRows { rows, .. } => model::keep_slot_rows(target, slot, rows)?,
        CacheOp::Restore(_) => model::restore_slot(target, slot)?,
    }
    // An invalid slot reads as an impossible length, which is a broken contract.
    if target.seq_len(slot).unwrap_or(usize::MAX) != op.len() {
        return Err(Error::TargetContract {
            what: match op {
                CacheOp::CommitTree { .. } => "seq_len after commit_tree",
                _ => {
                    "BatchTarget::seq_len(slot) after the step's rollback (keep_rows, restore_state or none)"
                }
            },
        });
    }
    Ok(())
}

/// After a failed step: brings `slot` back with `op` ([`Sequence::fail_op`]) as
/// [`super::Generator`] does; a slot that cannot truncate is reset when that fails.
fn rewind_slot<B: BatchTarget>(target: &mut B, slot: usize, op: CacheOp<'static>) {
    match op {
        CacheOp::Keep(len) => {
            let _ = target.truncate(slot, len);
        }
        _ if target.seq_len(slot).ok() == Some(op.len()) => {}
        _ => {
            if apply_slot(target, slot, op).is_err() {
                let _ = target.truncate(slot, 0);
            }
        }
    }
}

/// The drafts of a step's verify requests, flattened for one [`VerifyBatch`]: tokens and
/// offsets, (when any sequence drafts a tree) parents for every sequence, a chain as the tree
/// of its parents, (when any sequence has an ending node) node ends for every sequence, and
/// (when any tree has its own schemes) schemes.
struct FlatDrafts {
    tokens: Vec<u32>,
    offsets: Vec<usize>,
    parents: Vec<u32>,
    schemes: Vec<crate::SiblingScheme>,
    ends: Vec<bool>,
    any_tree: bool,
    any_ends: bool,
    any_schemes: bool,
}

impl FlatDrafts {
    fn of(reqs: &[VerifyRequest<'_>]) -> Self {
        let any_tree = reqs.iter().any(|r| r.draft.parents().is_some());
        let any_ends = reqs.iter().any(|r| r.draft.ends().contains(&true));
        let any_schemes = reqs
            .iter()
            .any(|r| r.draft.schemes().is_some_and(|s| s.len() == r.draft.len()));
        let mut f = FlatDrafts {
            tokens: Vec::new(),
            offsets: vec![0],
            parents: Vec::new(),
            schemes: Vec::new(),
            ends: Vec::new(),
            any_tree,
            any_ends,
            any_schemes,
        };
        for r in reqs {
            let k = r.draft.len();
            f.tokens.extend_from_slice(r.draft.tokens());
            f.offsets.push(f.tokens.len());
            if any_tree {
                match r.draft.parents() {
                    Some(par) => f.parents.extend_from_slice(par),
                    None => f.parents.extend(0..k as u32),
                }
            }
            if any_ends {
                f.ends.extend((0..k).map(|j| r.draft.ends_at(j)));
            }
            if any_schemes {
                let default = crate::tree::TreeLimits {
                    dense_q: !matches!(r.draft_probs, DraftQ::PointMass),
                    ..crate::tree::TreeLimits::vocab(0)
                }
                .default_scheme();
                match r.draft.schemes() {
                    Some(sc) => f.schemes.extend_from_slice(sc),
                    None => f.schemes.extend(std::iter::repeat_n(default, k)),
                }
            }
        }
        f
    }
}

/// An upper bound of the rows a decoding sequence with `params` appends this step.
fn row_bound(params: &GenerationParams, k_override: Option<usize>, tree_nodes: usize) -> usize {
    1 + match &params.draft {
        DraftLength::Off => 0,
        DraftLength::Adaptive(_) => k_override.unwrap_or(0),
        DraftLength::Fixed(k) => fixed_draft_rows(params, *k, tree_nodes),
    }
}

/// Draft rows a [`DraftLength::Fixed`] request of draft length `k` may verify in one step: its
/// node budget when it drafts trees (the target has tree support), never fewer than `k` (a
/// proposer without trees returns a chain of up to `k` drafts).
fn fixed_draft_rows(params: &GenerationParams, k: usize, target_tree_nodes: usize) -> usize {
    if params.tree.is_on() && target_tree_nodes > 0 {
        k.max(params.tree.node_budget().min(target_tree_nodes))
    } else {
        k
    }
}
