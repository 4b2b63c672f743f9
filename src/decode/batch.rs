//! Continuous batching: many generations share one batched target forward per step.

use std::collections::VecDeque;
use std::fmt;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::StreamChunk;
use super::costs::{MeasuredCosts, StepCosts};
use super::generator::{Generation, GenerationError, Generator, Parked, Proposed, Session};
use super::goodput::{BatchCost, DraftCandidate, GoodputConfig, choose_draft_lengths};
use super::metrics::Metrics;
use super::params::GenerationParams;
use super::policy::DraftLength;
use super::seed::SeedSource;
use super::stop::{Detokenizer, FinishReason};
use crate::error::{Error, Result};
use crate::model::{BatchTarget, SlotChunk, SlotInput, TargetModel, TreeTarget};
use crate::propose::Proposer;
use crate::tree::{DraftBlock, SiblingScheme};
use crate::verify::{DraftQ, SequenceParams, StepOutput, Verifier, VerifyBatch};

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
        }
    }

    /// Adds a [`Detokenizer`]: the generation then reports its text, streams text, and may use
    /// stop strings (as [`Generator::with_detokenizer`]).
    pub fn with_detokenizer(mut self, detokenizer: Box<dyn Detokenizer + Send>) -> Self {
        self.detokenizer = Some(detokenizer);
        self
    }

    /// Calls `f` after every verified step of this request with the step's tokens,
    /// log-probabilities and released text, as [`Generator::generate_stream`] does. Returning
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
#[derive(Debug, Clone, PartialEq)]
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
#[derive(Debug)]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Its generation (the finish reason says why it ended), or the error that ended it
    /// with everything emitted before.
    pub result: std::result::Result<Generation, GenerationError>,
}

/// What one [`BatchGenerator::step`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
    /// Wall time of the whole step (planning and proposing, forward, verification, commits,
    /// callbacks).
    pub step_time: Duration,
}

/// Totals over every step of a [`BatchGenerator`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
    /// Wall time of all steps.
    pub step_time: Duration,
}

/// A [`TargetModel`] view of one slot of a shared [`BatchTarget`]: what each request's
/// [`Generator`] drives for its truncations and tree commits (the batch loop runs the forwards
/// itself, batched).
struct SlotTarget<B> {
    shared: Arc<Mutex<B>>,
    slot: usize,
    vocab: usize,
    max_context: usize,
    tree_nodes: usize,
}

fn lock<B>(m: &Mutex<B>) -> MutexGuard<'_, B> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<B: BatchTarget> TargetModel for SlotTarget<B> {
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn seq_len(&self) -> usize {
        // An invalid slot reads as an impossible length, which the loop reports as a broken
        // contract.
        lock(&self.shared).seq_len(self.slot).unwrap_or(usize::MAX)
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        let chunk = SlotChunk {
            slot: self.slot,
            input: SlotInput::Chain(tokens),
        };
        lock(&self.shared).forward_batch(&[chunk], logits)
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        let chunk = SlotChunk {
            slot: self.slot,
            input: SlotInput::Prefill(tokens),
        };
        lock(&self.shared).forward_batch(&[chunk], &mut Vec::new())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        lock(&self.shared).truncate(self.slot, len)
    }
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        (self.tree_nodes > 0).then_some(self as &mut dyn TreeTarget)
    }
}

impl<B: BatchTarget> TreeTarget for SlotTarget<B> {
    fn max_tree_nodes(&self) -> usize {
        self.tree_nodes
    }
    fn forward_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let chunk = SlotChunk {
            slot: self.slot,
            input: SlotInput::Tree {
                root,
                block: *block,
            },
        };
        lock(&self.shared).forward_batch(&[chunk], logits)
    }
    fn commit_tree(&mut self, path: &[u32]) -> Result<()> {
        lock(&self.shared).commit_tree(self.slot, path)
    }
}

type SeqGen<B> = Generator<SlotTarget<B>, Box<dyn Proposer + Send>>;

/// Where a request is.
enum Phase {
    /// Holding a slot, `done` of the `prompt.len() - 1` prefill tokens in its KV cache.
    Prefill { done: usize },
    /// Verifying one draft per step.
    Decoding,
}

/// A request holding a slot.
struct Seq<B> {
    id: RequestId,
    slot: usize,
    generator: SeqGen<B>,
    params: GenerationParams,
    prompt: Vec<u32>,
    parked: Option<Parked>,
    phase: Phase,
    stream: Option<StreamFn>,
    /// The step planned for this forward, with where the step started.
    plan: Option<(Proposed, (usize, super::stop::TextMark))>,
    /// Scratch for the chain rows fed.
    feed: Vec<u32>,
    /// The error that ended the request, if any.
    error: Option<Error>,
    /// Steps this decoding sequence was left out of for want of rows (it goes first next).
    waited: u32,
}

/// Runs many generations at once (continuous batching) over a [`BatchTarget`]: each
/// [`BatchGenerator::step`] runs **one** batched forward over every active sequence's rows
/// (new requests' prompt prefill chunks under a row budget, each decoding sequence's
/// `[last, d_1 .. d_k]` chain or token tree) and **one** [`Verifier::verify_batch`], then
/// commits, streams and ends each request on its own.
///
/// Every request keeps the guarantees of [`Generator`] alone: the same validation, stop
/// conditions (EOS, stop sequences and strings inside accepted drafts, case C11), token budget,
/// streaming chunks, cancellation, logprobs and metrics. Given batch-invariant logits (the
/// [`BatchTarget`] contract), every greedy request's output is bit-identical to its output from
/// a [`Generator`] alone, and a sampled request's tokens for its seed do not depend on the batch
/// (random draws are keyed by the request's seed and positions, C15) when its drafts are point
/// masses (prompt lookup, suffix, recycling, heads, grammar-forced) or its draft length is
/// fixed. A proposer that samples its drafts (dense q) under [`DraftLength::Adaptive`] keeps the
/// output *distribution* exact, but its tokens for a seed depend on the draft lengths, which the
/// goodput policy chooses from the whole batch (as the adaptive policy of a [`Generator`] alone
/// chooses them from measured times). A request that fails (its proposer
/// errs, a draft is invalid, its verification fails) ends alone with its error in
/// [`Finished::result`]; the others go on.
///
/// **Draft lengths**: requests with [`DraftLength::Fixed`] draft what they ask (chains, or
/// trees when `tree_nodes > 0` and the target has tree support); [`DraftLength::Off`] decodes
/// one token per step; the draft lengths of [`DraftLength::Adaptive`] requests are chosen for
/// the whole batch by the goodput policy ([`super::goodput`]) from each request's acceptance
/// estimates and the step time by rows learned online (measured, or from the cost source of
/// [`BatchGenerator::with_costs`]), so speculation backs off as the batch becomes
/// compute-bound. Adaptive requests draft chains in a batch (the per-request tree-shape
/// policy of [`Generator`] is not used); a request whose draft length is 0 for a while probes
/// with [`super::AdaptiveConfig::probe_draft`] drafts at its probe intervals.
///
/// **Scheduling**: requests take free slots in submission order; decode and draft rows are
/// scheduled before prefill chunks (decoding sequences are never stalled by a long prompt);
/// a slot is released when its request ends. Per-request [`Metrics`] count the batched
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
    shared: Arc<Mutex<B>>,
    config: BatchConfig,
    vocab: usize,
    max_context: usize,
    max_slots: usize,
    max_rows: usize,
    tree_nodes: usize,
    next_id: u64,
    waiting: VecDeque<(RequestId, BatchRequest)>,
    active: Vec<Seq<B>>,
    free_slots: Vec<usize>,
    finished: Vec<Finished>,
    cost: BatchCost,
    /// Where the goodput policy's step costs come from (shared with every request's generator).
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

    fn build(target: B, config: BatchConfig) -> Self {
        let max_slots = target.max_slots();
        let max_rows = config
            .max_batch_tokens
            .min(target.max_batch_tokens())
            .max(1);
        BatchGenerator {
            vocab: target.vocab_size(),
            max_context: target.max_context(),
            tree_nodes: target.max_tree_nodes(),
            shared: Arc::new(Mutex::new(target)),
            config,
            max_slots,
            max_rows,
            next_id: 0,
            waiting: VecDeque::new(),
            active: Vec::new(),
            free_slots: (0..max_slots).rev().collect(),
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

    /// Sets where requests without a seed get theirs (default [`SeedSource::os`]): each such
    /// request draws one when it is submitted, and reports it in [`Generation::seed`].
    pub fn with_seed_source(mut self, seeds: SeedSource) -> Self {
        self.seeds = seeds;
        self
    }

    /// Sets where the goodput policy learns the step time by rows from, and every request's
    /// adaptive policy its step costs ([`Generator::with_costs`]): [`MeasuredCosts`] (the
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
    /// or a [`DraftLength::Fixed`] draft (`k + 1` rows, or `tree_nodes + 1` for trees) does not
    /// fit the row budget ([`BatchConfig::max_batch_tokens`] and the target's).
    pub fn submit(&mut self, mut req: BatchRequest) -> Result<RequestId> {
        if req.prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if req.prompt.len() > self.max_context {
            return Err(Error::PromptTooLong {
                len: req.prompt.len(),
                max_context: self.max_context,
            });
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::TokenOutOfVocab {
                what: "prompt token",
                token: t,
                vocab_size: self.vocab,
            });
        }
        req.params.validate(self.vocab, req.detokenizer.is_some())?;
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
                    "a fixed draft (k + 1 rows, or tree_nodes + 1) must fit the batch's row \
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
                result: Ok(empty_generation(FinishReason::Cancelled, seed)),
            });
            return true;
        }
        if let Some(i) = self.active.iter().position(|s| s.id == id) {
            let seq = self.active.swap_remove(i);
            self.finish(seq, true);
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
        match Arc::try_unwrap(self.shared) {
            Ok(m) => m.into_inner().unwrap_or_else(|e| e.into_inner()),
            // Every SlotTarget clone lived in a dropped request.
            Err(_) => unreachable!("slot views outlived their requests"),
        }
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
        if self.active.is_empty() && !self.waiting.is_empty() && self.free_slots.is_empty() {
            return Err(Error::TargetContract {
                what: "BatchTarget::release failed for every slot: no slot is left for the waiting requests",
            });
        }
        // Plan: draft lengths for the batch, then each sequence's propose phase.
        // Sequences left out of earlier forwards for want of rows go first, then by age.
        self.active
            .sort_by_key(|s| (std::cmp::Reverse(s.waited), s.id));
        let choice = self.choose_lengths();
        let mut rows_left = self.max_rows;
        let mut i = 0;
        while i < self.active.len() {
            if !matches!(self.active[i].phase, Phase::Decoding) {
                i += 1;
                continue;
            }
            let id = self.active[i].id;
            let k_override = choice.iter().find(|(cid, _)| *cid == id).map(|&(_, k)| k);
            let bound = self.row_bound(&self.active[i], k_override);
            if bound > rows_left {
                // No room left in this forward: the sequence waits a step. (Every sequence fits
                // an empty forward: `submit` refuses fixed drafts wider than the budget, and the
                // goodput policy keeps adaptive drafts within it.)
                self.active[i].waited += 1;
                i += 1;
                continue;
            }
            let seq = &mut self.active[i];
            let parked = seq.parked.take().expect("a decoding sequence is parked");
            let mut s = Session::resume(&mut seq.generator, &seq.params, parked);
            let mark = s.mark();
            match s.plan(k_override) {
                Ok(Some(p)) => {
                    rows_left = rows_left.saturating_sub(p.rows());
                    seq.parked = Some(s.park());
                    seq.plan = Some((p, mark));
                    seq.waited = 0;
                    i += 1;
                }
                Ok(None) => {
                    seq.parked = Some(s.park());
                    let seq = self.active.swap_remove(i);
                    self.finish(seq, false);
                    stats.finished += 1;
                }
                Err(e) => {
                    s.fail(mark);
                    seq.parked = Some(s.park());
                    seq.error = Some(e);
                    let seq = self.active.swap_remove(i);
                    self.finish(seq, false);
                    stats.finished += 1;
                }
            }
        }
        // `swap_remove` may have moved planned sequences: find them by their plan.
        let decoding: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].plan.is_some())
            .collect();
        // Prefill chunks under what is left of the row budget, in submission order.
        let mut prefill: Vec<(usize, usize, usize)> = Vec::new(); // (index, from, to)
        let mut order: Vec<usize> = (0..self.active.len())
            .filter(|&i| matches!(self.active[i].phase, Phase::Prefill { .. }))
            .collect();
        order.sort_by_key(|&i| self.active[i].id);
        for i in order {
            if rows_left == 0 {
                break;
            }
            let s = &self.active[i];
            let Phase::Prefill { done } = s.phase else {
                continue;
            };
            let total = s.prompt.len() - 1;
            let n = (total - done).min(self.config.prefill_chunk).min(rows_left);
            if n > 0 {
                prefill.push((i, done, done + n));
                rows_left -= n;
            }
        }
        if decoding.is_empty() && prefill.is_empty() {
            stats.step_time = t0.elapsed();
            return Ok(stats);
        }

        // One batched forward.
        let mut chunks: Vec<SlotChunk<'_>> = Vec::with_capacity(decoding.len() + prefill.len());
        let mut feeds: Vec<Vec<u32>> = decoding
            .iter()
            .map(|&i| std::mem::take(&mut self.active[i].feed))
            .collect();
        let plans: Vec<(Proposed, (usize, super::stop::TextMark))> = decoding
            .iter()
            .map(|&i| self.active[i].plan.take().expect("planned"))
            .collect();
        let t_fwd = Instant::now();
        for ((&i, feed), (p, _)) in decoding.iter().zip(feeds.iter_mut()).zip(&plans) {
            let seq = &self.active[i];
            let parked = seq.parked.as_ref().expect("parked");
            chunks.push(SlotChunk {
                slot: seq.slot,
                input: parked.feed(&seq.generator, p, feed),
            });
        }
        for &(i, from, to) in &prefill {
            let s = &self.active[i];
            chunks.push(SlotChunk {
                slot: s.slot,
                input: SlotInput::Prefill(&s.prompt[from..to]),
            });
        }
        let logit_rows: usize = chunks.iter().map(|c| c.input.logit_rows()).sum();
        let forward_result = lock(&self.shared)
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
        stats.rows = chunks.iter().map(|c| c.input.rows()).sum();
        drop(chunks);
        let forward_time = t_fwd.elapsed();
        for (j, &i) in decoding.iter().enumerate() {
            self.active[i].feed = std::mem::take(&mut feeds[j]);
        }
        stats.forward_time = forward_time;
        stats.prefill_rows = prefill.iter().map(|&(_, a, b)| b - a).sum();
        if let Err(e) = forward_result {
            return Err(self.fail_forward(e, &decoding, plans, &prefill));
        }

        // One verify_batch over every decoding sequence.
        let t_ver = Instant::now();
        let mut outs = self.verify_all(&decoding, &plans);
        // Each slot must hold its context but the last token plus the rows it was fed (the
        // check `Generator` makes after its own forward).
        for ((o, &i), (p, _)) in outs.iter_mut().zip(&decoding).zip(&plans) {
            let seq = &self.active[i];
            let want = seq.parked.as_ref().map_or(0, |c| c.len()) - 1 + p.rows();
            if lock(&self.shared).seq_len(seq.slot).ok() != Some(want) {
                *o = Err(Error::TargetContract {
                    what: "BatchTarget::seq_len(slot) after forward_batch is not the slot's context plus its rows",
                });
            }
        }
        let verify_time = t_ver.elapsed();

        // Commit, observe, stream, end.
        let mut done: Vec<usize> = Vec::new();
        for ((j, &i), out) in decoding.iter().enumerate().zip(outs) {
            let (p, mark) = &plans[j];
            let seq = &mut self.active[i];
            stats.sequences += 1;
            stats.draft_rows += p.k;
            let parked = seq.parked.take().expect("parked");
            let mut s = Session::resume(&mut seq.generator, &seq.params, parked);
            let r = out.and_then(|out| s.finish_step(p, out, forward_time, verify_time));
            match r {
                Ok(()) => {
                    let chunk = s.last_chunk();
                    stats.emitted += chunk.tokens.len();
                    if let Some(f) = seq.stream.as_mut()
                        && f(chunk).is_break()
                    {
                        s.cancel();
                    }
                    let ended = s.finish_reason().is_some() || s.is_cancelled();
                    seq.parked = Some(s.park());
                    if ended {
                        done.push(i);
                    }
                }
                Err(e) => {
                    s.fail(mark.clone());
                    seq.parked = Some(s.park());
                    seq.error = Some(e);
                    done.push(i);
                }
            }
        }
        // Prefill progress.
        for &(i, _, to) in &prefill {
            let seq = &mut self.active[i];
            let total = seq.prompt.len() - 1;
            seq.phase = Phase::Prefill { done: to };
            if to == total {
                let have = lock(&self.shared).seq_len(seq.slot);
                if have.ok() != Some(total) {
                    seq.error = Some(Error::TargetContract {
                        what: "seq_len after the prefill chunks",
                    });
                    done.push(i);
                } else {
                    seq.phase = Phase::Decoding;
                }
            }
        }
        done.sort_unstable();
        done.dedup();
        for &i in done.iter().rev() {
            let seq = self.active.swap_remove(i);
            let cancelled =
                seq.error.is_none() && seq.parked.as_ref().is_some_and(|p| !p.finished());
            self.finish(seq, cancelled);
            stats.finished += 1;
        }
        stats.step_time = t0.elapsed();
        // The goodput policy learns the step's cost from the cost source (measured by default:
        // the forward plus the rest of the step, that is the step time).
        let step_secs = self.costs.forward_secs(stats.rows, stats.forward_time)
            + self.costs.propose_secs(
                stats.draft_rows,
                stats.step_time.saturating_sub(stats.forward_time),
            );
        self.cost.observe(stats.rows, step_secs);
        let m = &mut self.metrics;
        m.steps += 1;
        m.rows += stats.rows as u64;
        m.prefill_rows += stats.prefill_rows as u64;
        m.draft_rows += stats.draft_rows as u64;
        m.emitted += stats.emitted as u64;
        m.forward_time += stats.forward_time;
        m.step_time += stats.step_time;
        Ok(stats)
    }

    /// Moves waiting requests into free slots: starts their sessions (validation, slot reset,
    /// the proposer's `begin`); prompts of one token start decoding at once.
    fn admit(&mut self) -> usize {
        let mut ended_here = 0;
        while !self.waiting.is_empty() {
            let Some(slot) = self.free_slots.pop() else {
                break;
            };
            let Some((id, req)) = self.waiting.pop_front() else {
                break;
            };
            let target = SlotTarget {
                shared: Arc::clone(&self.shared),
                slot,
                vocab: self.vocab,
                max_context: self.max_context,
                tree_nodes: self.tree_nodes,
            };
            let mut generator =
                Generator::new(target, req.proposer).with_shared_costs(Arc::clone(&self.costs));
            if let Some(d) = req.detokenizer {
                generator = generator.with_detokenizer(d);
            }
            let mut seq = Seq {
                id,
                slot,
                generator,
                params: req.params,
                prompt: req.prompt,
                parked: None,
                phase: Phase::Prefill { done: 0 },
                stream: req.stream,
                plan: None,
                feed: Vec::new(),
                error: None,
                waited: 0,
            };
            let started = match seq.generator.start(&seq.prompt, &seq.params, false) {
                Ok(s) => Ok(s.park()),
                Err(e) => Err(e),
            };
            match started {
                Ok(p) => {
                    let ended = p.finished();
                    seq.parked = Some(p);
                    // A one-token prompt has nothing to prefill; a request with no token to
                    // generate ends at its first plan, with nothing prefilled.
                    if seq.prompt.len() == 1 || seq.params.max_new_tokens == 0 {
                        seq.phase = Phase::Decoding;
                    }
                    if ended {
                        self.finish(seq, false);
                        ended_here += 1;
                    } else {
                        self.active.push(seq);
                    }
                }
                Err(e) => {
                    seq.error = Some(e);
                    self.finish(seq, false);
                    ended_here += 1;
                }
            }
        }
        ended_here
    }

    /// Ends the requests still prefilling whose [`GenerationParams::cancel`] flag is set (a
    /// decoding request sees it in its next plan, as with [`Generator`]).
    fn cancel_prefilling(&mut self) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < self.active.len() {
            let s = &self.active[i];
            let flagged = s
                .params
                .cancel
                .as_ref()
                .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed));
            if flagged && matches!(s.phase, Phase::Prefill { .. }) {
                let seq = self.active.swap_remove(i);
                self.finish(seq, true);
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
        let mut decode_rows = 0usize;
        let mut prefill_rows = 0usize;
        let mut fixed_tokens = 0.0f64;
        let mut acc: Vec<Vec<f64>> = Vec::new();
        let mut ids: Vec<usize> = Vec::new();
        for (i, seq) in self.active.iter().enumerate() {
            match seq.phase {
                Phase::Prefill { done } => {
                    let left = seq.prompt.len() - 1 - done;
                    prefill_rows += left.min(self.config.prefill_chunk);
                }
                Phase::Decoding => {
                    decode_rows += 1;
                    fixed_tokens += 1.0;
                    match &seq.params.draft {
                        DraftLength::Adaptive(a) => {
                            let cap = seq
                                .parked
                                .as_ref()
                                .map_or(0, |p| p.draft_cap(&seq.params, self.max_context));
                            let n = cap.min(a.max_draft).min(self.config.goodput.max_draft);
                            let st = seq.generator.adaptive_state();
                            acc.push((0..n).map(|j| st.acceptance(j)).collect());
                            ids.push(i);
                        }
                        DraftLength::Fixed(k) => {
                            // Unknown acceptance: count the rows, not their tokens.
                            let rows = fixed_draft_rows(&seq.params, *k, self.tree_nodes);
                            decode_rows += rows;
                        }
                        DraftLength::Off => {}
                    }
                }
            }
        }
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
        let k = choose_draft_lengths(&cands, decode_rows, fixed_tokens, extra, |r| {
            let prefill = prefill_rows.min(max_rows.saturating_sub(r));
            cost.policy_cost(r + prefill, prior)
        });
        // Probes take draft rows the policy left over.
        let mut left = extra.saturating_sub(k.iter().sum());
        let mut out = Vec::with_capacity(ids.len());
        for (&i, &ki) in ids.iter().zip(&k) {
            let seq = &mut self.active[i];
            let DraftLength::Adaptive(a) = &seq.params.draft else {
                continue;
            };
            let a = a.clone();
            let cap = acc[out.len()].len();
            let probe = seq.generator.adaptive_mut().probe_now(&a, ki == 0);
            let k = if probe {
                let kp = a.probe_draft.min(cap).min(left);
                left -= kp;
                kp
            } else {
                ki
            };
            out.push((seq.id, k));
        }
        out
    }

    /// An upper bound of the rows sequence `seq` appends this step.
    fn row_bound(&self, seq: &Seq<B>, k_override: Option<usize>) -> usize {
        1 + match &seq.params.draft {
            DraftLength::Off => 0,
            DraftLength::Adaptive(_) => k_override.unwrap_or(0),
            DraftLength::Fixed(k) => fixed_draft_rows(&seq.params, *k, self.tree_nodes),
        }
    }

    /// Verifies every planned sequence in one [`Verifier::verify_batch`] over the forward's
    /// logits (decode chunks first, in `decoding` order). Per-sequence results.
    fn verify_all(
        &mut self,
        decoding: &[usize],
        plans: &[(Proposed, (usize, super::stop::TextMark))],
    ) -> Vec<Result<StepOutput>> {
        let n = decoding.len();
        if n == 0 {
            return Vec::new();
        }
        let mut tokens: Vec<u32> = Vec::new();
        let mut offsets: Vec<usize> = vec![0];
        let mut parents: Vec<u32> = Vec::new();
        let mut schemes: Vec<SiblingScheme> = Vec::new();
        let mut ends: Vec<bool> = Vec::new();
        let any_tree = plans.iter().any(|(p, _)| p.tree);
        let any_schemes = decoding
            .iter()
            .zip(plans)
            .any(|(&i, (p, _))| p.tree && self.active[i].generator.draft_schemes().len() == p.k);
        let mut sessions: Vec<SequenceParams<'_>> = Vec::with_capacity(n);
        // The requests as the sessions would build them alone.
        let reqs: Vec<_> = decoding
            .iter()
            .zip(plans)
            .map(|(&i, (p, _))| {
                let seq = &self.active[i];
                let parked = seq.parked.as_ref().expect("parked");
                parked.verify_request(&seq.generator, &seq.params, p)
            })
            .collect();
        for (r, (p, _)) in reqs.iter().zip(plans) {
            tokens.extend_from_slice(r.draft_tokens);
            offsets.push(tokens.len());
            if any_tree {
                match r.parents {
                    Some(par) => parents.extend_from_slice(par),
                    None => parents.extend(0..p.k as u32),
                }
                ends.extend((0..p.k).map(|j| r.ends.get(j).copied().unwrap_or(false)));
            }
            if any_schemes {
                let default = crate::tree::TreeLimits {
                    dense_q: !matches!(r.draft_probs, DraftQ::PointMass),
                    ..crate::tree::TreeLimits::vocab(0)
                }
                .default_scheme();
                match r.schemes {
                    Some(sc) => schemes.extend_from_slice(sc),
                    None => schemes.extend(std::iter::repeat_n(default, p.k)),
                }
            }
            let mut sp = SequenceParams::new(r.config, r.seed)
                .context(r.context)
                .prompt_len(r.prompt_len)
                .suppress(r.suppress, r.suppress_rows)
                .draft_probs(r.draft_probs)
                .final_draft_ends(r.final_draft_ends)
                .row_top_k(r.row_top_k);
            if let Some(pos) = r.position {
                sp = sp.position(pos);
            }
            sessions.push(sp);
        }
        let mut batch = VerifyBatch {
            vocab_size: self.vocab,
            target_logits: &self.logits,
            draft_tokens: &tokens,
            draft_offsets: &offsets,
            draft_probs: DraftQ::PointMass,
            sequences: &sessions,
            parents: None,
            schemes: None,
            ends: &[],
        };
        if any_tree {
            batch = batch.tree(&parents).node_ends(&ends);
        }
        if any_schemes {
            batch = batch.schemes(&schemes);
        }
        match self.verifier.verify_batch(&batch) {
            Ok(v) => v,
            Err(e) => {
                // A malformed batch is the loop's own bug; report it on every sequence.
                let msg = e.to_string();
                (0..n)
                    .map(|_| Err(Error::Model(msg.clone().into())))
                    .collect()
            }
        }
    }

    /// Ends every request of a failed forward with an error naming the target's and returns
    /// the target's error for [`BatchGenerator::step`].
    fn fail_forward(
        &mut self,
        e: Error,
        decoding: &[usize],
        plans: Vec<(Proposed, (usize, super::stop::TextMark))>,
        prefill: &[(usize, usize, usize)],
    ) -> Error {
        let msg = e.to_string();
        let mut hit: Vec<usize> = Vec::new();
        for (&i, (_, mark)) in decoding.iter().zip(plans) {
            let seq = &mut self.active[i];
            let parked = seq.parked.take().expect("parked");
            let mut s = Session::resume(&mut seq.generator, &seq.params, parked);
            s.fail(mark);
            seq.parked = Some(s.park());
            seq.error = Some(Error::Model(
                format!("the batched forward failed: {msg}").into(),
            ));
            hit.push(i);
        }
        for &(i, _, _) in prefill {
            self.active[i].error = Some(Error::Model(
                format!("the batched forward failed: {msg}").into(),
            ));
            hit.push(i);
        }
        hit.sort_unstable();
        hit.dedup();
        for &i in hit.iter().rev() {
            let seq = self.active.swap_remove(i);
            self.finish(seq, false);
        }
        e
    }

    /// Ends a request: its generation (cancelled when `cancel`), its slot released.
    fn finish(&mut self, mut seq: Seq<B>, cancel: bool) {
        let result = match seq.parked.take() {
            Some(p) => {
                let mut s = Session::resume(&mut seq.generator, &seq.params, p);
                if cancel {
                    s.cancel();
                }
                let generation = s.into_generation();
                match seq.error.take() {
                    Some(error) => Err(GenerationError {
                        error,
                        partial: Box::new(Generation {
                            finish: FinishReason::Error,
                            ..generation
                        }),
                    }),
                    None => Ok(generation),
                }
            }
            None => Err(GenerationError {
                error: seq.error.take().unwrap_or(Error::TargetContract {
                    what: "a request ended before it started",
                }),
                partial: Box::new(empty_generation(
                    FinishReason::Error,
                    seq.params.seed.unwrap_or(0),
                )),
            }),
        };
        // A slot whose release fails is not used again (its state is unknown); `step` reports
        // when no usable slot is left for the waiting requests.
        if lock(&self.shared).release(seq.slot).is_ok() {
            self.free_slots.push(seq.slot);
        } else {
            self.retired_slots += 1;
        }
        self.finished.push(Finished { id: seq.id, result });
    }
}

/// Draft rows a [`DraftLength::Fixed`] request of draft length `k` may verify in one step: its
/// node budget when it drafts trees (the target has tree support), never fewer than `k` (a
/// proposer without trees returns a chain of up to `k` drafts).
fn fixed_draft_rows(params: &GenerationParams, k: usize, target_tree_nodes: usize) -> usize {
    if params.tree_nodes > 0 && target_tree_nodes > 0 {
        k.max(params.tree_nodes.min(target_tree_nodes))
    } else {
        k
    }
}

/// A generation that emitted nothing, with the request's `seed`.
fn empty_generation(finish: FinishReason, seed: u64) -> Generation {
    Generation {
        tokens: Vec::new(),
        finish,
        metrics: Metrics::default(),
        logprobs: None,
        text: None,
        seed,
    }
}
