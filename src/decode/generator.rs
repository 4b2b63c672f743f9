//! The single-sequence driver: one [`Sequence`] over one [`TargetModel`], single forwards.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::costs::{MeasuredCosts, StepCosts};
use super::metrics::Metrics;
use super::params::GenerationParams;
use super::policy::AdaptiveState;
use super::seed::SeedSource;
use super::sequence::{
    CacheOp, Generation, GenerationError, HiddenView, Plan, Sequence, Start, StepStats,
    StreamChunk, TargetLimits, check_request, kept_prefix,
};
use super::stop::{Detokenizer, FinishReason};
use crate::error::{Error, Result};
use crate::model::{self, RollbackMode, SlotInput, TargetModel, rollback_mode};
use crate::propose::Proposer;
use crate::verify::Verifier;

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
/// to the proposer as [`ProposeRequest::target_hidden_rows`](crate::ProposeRequest::target_hidden_rows) (feature-conditioned draft models,
/// see [`crate::TargetFeatures`]).
///
/// **Prefix reuse** (on by default, [`Generator::with_prefix_reuse`]): after a generation the
/// target's KV cache holds its prompt and output but the last token. A new generation whose
/// prompt starts with some of those tokens (the next turn of a conversation, which resubmits
/// the conversation so far; another request with the same system prompt) keeps the longest
/// common prefix, truncates the cache to it and prefills only the rest; the proposer is
/// started with [`Proposer::begin_reusing`] so that a draft model keeps its own cache the same
/// way (and a feature-conditioned one its held target features of the kept positions), while
/// proposers that index the context rebuild it from the prompt. At least the last prompt token
/// is always fed (its row gives the first logits): a prompt that is all cached keeps
/// `len - 1` tokens. The outputs are those of a fresh prefill of the same tokens for a target
/// whose logits do not depend on how its cache was filled (batch-invariant engines: bit for
/// bit); [`Metrics::prompt_tokens_reused`] and [`Metrics::prompt_tokens_prefilled`] say what
/// was reused. Memory: nothing beyond the cache the target holds anyway (and, for a target with
/// hidden states, the hidden rows of the last context, which the loop keeps for the
/// proposer). The loop only reuses what it knows: [`Generator::target_mut`] forgets the cache,
/// and so does a failed generation whose rollback failed.
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
    /// Where the adaptive policy's step costs come from.
    costs: Arc<dyn StepCosts>,
    logits: Vec<f32>,
    detokenizer: Option<Arc<dyn Detokenizer>>,
    /// Seeds of requests without one.
    seeds: SeedSource,
    /// The generation in progress (or the last one); its adaptive state persists across
    /// generations.
    seq: Sequence,
    /// Keep the cached prefix across generations ([`Generator::with_prefix_reuse`]).
    prefix_reuse: bool,
    /// The target's cache holds `seq`'s context but its last token (set once a generation has
    /// started; cleared before its first engine call, by [`Generator::target_mut`] and by a
    /// failed rollback).
    cache_known: bool,
    /// Feed the prompt tokens left to prefill in the first verify forward
    /// ([`Generator::with_fused_prefill`]).
    fused_prefill: bool,
}

impl<T: TargetModel, P: Proposer> Generator<T, P> {
    /// A generator over `target` with `proposer`.
    pub fn new(target: T, proposer: P) -> Self {
        Generator {
            target,
            proposer,
            verifier: Verifier::new(),
            costs: Arc::new(MeasuredCosts),
            logits: Vec::new(),
            detokenizer: None,
            seeds: SeedSource::default(),
            seq: Sequence::new(),
            prefix_reuse: true,
            cache_known: false,
            fused_prefill: true,
        }
    }

    /// Turns prefix reuse across generations on (the default) or off (type docs). Off, every
    /// generation starts with `truncate(0)` and prefills its whole prompt, and the proposer is
    /// started with [`Proposer::begin`] (a draft model then starts from an empty cache too).
    pub fn with_prefix_reuse(mut self, on: bool) -> Self {
        self.prefix_reuse = on;
        self
    }

    /// Turns the fused prefill on (the default) or off. On, a generation whose prompt leaves
    /// `m > 0` tokens before its last to feed (all of a fresh prompt but its last token, or
    /// what prefix reuse did not find in the cache: the new message of a conversation turn)
    /// does not prefill them in a forward of their own: its proposer drafts from the context
    /// first, and one target forward over `[prompt[reused..n - 1], last, d_1 .. d_k]`
    /// ([`TargetModel::forward_tail`]) both fills the cache and gives the `[k + 1, vocab]`
    /// verify rows, which saves a forward (a read of every weight) per generation. That needs
    /// a proposer that drafts from tokens alone ([`Proposer::drafts_from_tokens`]: prompt
    /// lookup, suffix, token recycling, merged model-free proposers; or a request with
    /// [`DraftLength::Off`](super::DraftLength::Off), plain decoding) and a target that can
    /// truncate ([`TargetModel::rollback`] `None`); otherwise, and for a prompt that fills the
    /// context, the generation prefills as with the option off. The first step is then a
    /// chain, also for a tree request (the tree policy takes over from the second step).
    ///
    /// Exactness: the verify rows are the rows a prefill followed by the verify forward give
    /// on an engine whose rows do not depend on the other rows of the call (batch-invariant;
    /// `speculative-candle`'s `FastTarget`: bit for bit), so the outputs, greedy and seeded
    /// sampling alike, are those with the option off. Engines that keep the default
    /// [`TargetModel::forward_tail`] (a prefill, then a forward) run the same two forwards as
    /// with the option off. Metrics: [`Metrics::prompt_tokens_fused`] counts the tokens fed
    /// that way, `prefill_time` stays zero, the fused forward is the first step's target call
    /// and its time is in `forward_time` (and so in the time to first token, as the prefill
    /// was); the adaptive policy learns acceptance but not a forward cost from it.
    pub fn with_fused_prefill(mut self, on: bool) -> Self {
        self.fused_prefill = on;
        self
    }

    /// Whether the fused prefill is on ([`Generator::with_fused_prefill`]).
    pub fn fused_prefill(&self) -> bool {
        self.fused_prefill
    }

    /// The tokens the target's cache holds, when the generator knows them: after a
    /// generation, its prompt and output but the last token (`None` before the first one,
    /// after [`Generator::target_mut`] or a failed rollback).
    pub fn cached_tokens(&self) -> Option<&[u32]> {
        let n = self.target.seq_len();
        (self.cache_known && self.seq.context().len() == n + 1).then(|| &self.seq.context()[..n])
    }

    /// Tells a new generator what its target's cache already holds: `tokens`, as
    /// [`Generator::cached_tokens`] of the generator that filled it returned them, for a
    /// driver that builds a generator per request around a target it keeps between requests.
    /// The next generation then reuses their common prefix with its prompt (if prefix reuse is
    /// on and the target's `seq_len` is `tokens.len()`; else it starts fresh). The caller
    /// guarantees the contents. A target with hidden states gets no reuse from it (the hidden
    /// rows of the kept positions are not known).
    pub fn with_cached_tokens(mut self, tokens: &[u32]) -> Self {
        self.seq.assume_cached(tokens, None, 0);
        self.cache_known = true;
        self
    }

    /// Fills the target's cache with `tokens` ahead of a request (a known system prompt, or a
    /// conversation restored from elsewhere): truncates it to 0 and prefills them, keeping
    /// their hidden rows when the target has hidden states, so that the next generation whose
    /// prompt starts with them prefills only the rest (with prefix reuse on). Nothing is
    /// generated and the proposer is not told.
    ///
    /// # Errors
    /// [`Error::PromptTooLong`] for more than `max_context` tokens, [`Error::TokenOutOfVocab`]
    /// for a token outside the vocabulary (nothing reaches the target then); the target's
    /// truncate and prefill errors (the cache is then not reused).
    pub fn prefill_cache(&mut self, tokens: &[u32]) -> Result<()> {
        let limits = self.limits(false);
        if tokens.len() > limits.max_context {
            return Err(Error::PromptTooLong {
                len: tokens.len(),
                max_context: limits.max_context,
            });
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= limits.vocab) {
            return Err(Error::TokenOutOfVocab {
                what: "prompt token",
                token: t,
                vocab_size: limits.vocab,
            });
        }
        let width = self.target.hidden_states().map_or(0, |hs| hs.hidden_size());
        self.cache_known = false;
        self.target.truncate(0)?;
        if !tokens.is_empty() {
            self.target.prefill(tokens)?;
            check_seq_len(&self.target, tokens.len(), "seq_len after prefill")?;
        }
        self.seq
            .assume_cached(tokens, hidden_view(&self.target), width);
        self.cache_known = true;
        Ok(())
    }

    /// Whether prefix reuse is on ([`Generator::with_prefix_reuse`]).
    pub fn prefix_reuse(&self) -> bool {
        self.prefix_reuse
    }

    /// Adds a [`Detokenizer`]: generations then report their text, stream text, and may use stop
    /// strings.
    pub fn with_detokenizer(mut self, detokenizer: impl Detokenizer + 'static) -> Self {
        self.detokenizer = Some(Arc::new(detokenizer));
        self
    }

    /// Sets where requests without a seed get theirs (default [`SeedSource::os`]).
    pub fn with_seed_source(mut self, seeds: SeedSource) -> Self {
        self.seeds = seeds;
        self
    }

    /// Sets where the adaptive policy ([`DraftLength::Adaptive`](super::DraftLength::Adaptive))
    /// learns step costs from: [`MeasuredCosts`] (the measured forward and propose times, the
    /// default) or, for example, a [`FixedCosts`](super::FixedCosts) curve, which makes the
    /// policy's choices and so a seeded run's steps reproducible whatever the machine's load.
    /// [`Metrics`] keep the measured times either way.
    pub fn with_costs(mut self, costs: impl StepCosts + 'static) -> Self {
        self.costs = Arc::new(costs);
        self
    }

    /// Starts the adaptive policy ([`DraftLength::Adaptive`](super::DraftLength::Adaptive))
    /// from `state` instead of a fresh one, for example the cost estimates a generator over the
    /// same engine measured earlier ([`AdaptiveState::costs_only`]): the policy then knows the
    /// forward cost curve from the first step and skips the warm-up forward of
    /// `max_draft + 1` rows a fresh state spends on measuring it. A generator keeps its state
    /// across its own generations anyway; this is for a server that builds a generator per
    /// request or per connection. Greedy output is unchanged (the policy only chooses `k`).
    pub fn with_adaptive_state(mut self, state: AdaptiveState) -> Self {
        self.seq.set_adaptive(state);
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

    /// The target model, mutably. The generator then no longer knows what the target's cache
    /// holds: the next generation starts from an empty cache (no prefix reuse for it).
    pub fn target_mut(&mut self) -> &mut T {
        self.cache_known = false;
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
        self.seq.adaptive()
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
                    partial: Box::new(Generation::empty(
                        FinishReason::Error,
                        params.seed.unwrap_or(0),
                    )),
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

    /// Starts a generation: validates `params`, truncates the target's sequence to the prefix
    /// of `prompt` it already holds (0 with prefix reuse off or nothing in common; at most
    /// `n - 1` tokens, see [`Generator::with_prefix_reuse`]), prefills the rest of
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
        let at = Instant::now();
        // The tree capacity is read at each plan (nothing but the vocabulary and the context
        // size is asked of the target before the request is validated).
        let limits = self.limits(false);
        check_request(prompt, params, &limits, self.detokenizer.is_some())?;
        let seed = params.seed.unwrap_or_else(|| self.seeds.next_seed());
        let hidden_width = self.target.hidden_states().map_or(0, |hs| hs.hidden_size());
        let truncates = rollback_mode(&mut self.target) == RollbackMode::Truncate;
        let reused = kept_prefix(
            self.reusable_prefix(prompt, hidden_width),
            self.target.seq_len(),
            truncates,
        );
        self.cache_known = false;
        self.target.truncate(reused)?;
        self.seq.begin(Start {
            prompt,
            params: params.clone(),
            seed,
            detokenizer: self.detokenizer.clone(),
            limits,
            hidden_width,
            reused,
            at,
        });
        if prompt.len() - 1 > reused && self.fuses(prompt, params, truncates) {
            self.seq.defer_prefill();
        } else if prompt.len() - 1 > reused {
            let t = Instant::now();
            self.target.prefill(&prompt[reused..prompt.len() - 1])?;
            let time = t.elapsed();
            check_seq_len(&self.target, prompt.len() - 1, "seq_len after prefill")?;
            self.seq.prefilled(time, hidden_view(&self.target));
        }
        self.cache_known = true;
        self.seq
            .start_proposer(&mut self.proposer, self.prefix_reuse)?;
        Ok(Session { g: self })
    }

    /// Whether this generation's prompt tokens are fed in the first verify forward
    /// ([`Generator::with_fused_prefill`]): the option is on, the target truncates, the
    /// proposer drafts from tokens alone or the request drafts nothing, and a first step will
    /// run (the prompt leaves room in the context).
    fn fuses(&self, prompt: &[u32], params: &GenerationParams, truncates: bool) -> bool {
        let drafts_ok =
            matches!(params.draft, super::DraftLength::Off) || self.proposer.drafts_from_tokens();
        self.fused_prefill
            && truncates
            && drafts_ok
            && params.max_new_tokens > 0
            && prompt.len() < self.target.max_context()
    }

    /// The leading tokens of `prompt` the target's cache holds and the next generation keeps:
    /// 0 with prefix reuse off or an unknown cache, else [`Sequence::reusable`] over the last
    /// generation's context.
    fn reusable_prefix(&self, prompt: &[u32], hidden_width: usize) -> usize {
        if !self.prefix_reuse || !self.cache_known {
            return 0;
        }
        self.seq
            .reusable(prompt, self.target.seq_len(), hidden_width)
    }

    /// The target's limits; its tree capacity only when the request drafts trees (`trees`)
    /// and the target can truncate (one that cannot verifies chains).
    fn limits(&mut self, trees: bool) -> TargetLimits {
        let rollback = rollback_mode(&mut self.target);
        TargetLimits {
            vocab: self.target.vocab_size(),
            max_context: self.target.max_context(),
            max_tree_nodes: if trees && rollback == RollbackMode::Truncate {
                self.target.tree().map_or(0, |t| t.max_tree_nodes())
            } else {
                0
            },
            rollback,
        }
    }

    /// One step's phases on the sequence: plan, forward, verify, commit (and the cache
    /// operation), observe. `Ok(false)` when the generation ended before doing anything.
    fn run_step(&mut self) -> Result<bool> {
        let limits = self.limits(self.seq.params().tree.is_on());
        let Some(plan) = self.seq.plan(&mut self.proposer, limits, None)? else {
            return Ok(false);
        };
        let snapshot = self.save_state(&plan)?;
        let forward = self.forward(&plan)?;
        let t = Instant::now();
        let out = self
            .verifier
            .verify(&self.seq.verify_request(&plan, &self.logits))?;
        let verify = t.elapsed();
        let (cache, committed) = self.seq.commit(&plan, &out, hidden_view(&self.target))?;
        let (replay, replayed) = apply_cache(&mut self.target, cache, self.seq.context())?;
        let times = super::sequence::StepTimes {
            forward,
            verify,
            snapshot,
            replay,
            replayed,
        };
        self.seq.observe(
            &mut self.proposer,
            &*self.costs,
            &plan,
            out,
            committed,
            times,
        )?;
        Ok(true)
    }

    /// Snapshot mode: saves the target's state before the step's forward; the time it took.
    fn save_state(&mut self, plan: &Plan) -> Result<Duration> {
        if !plan.saves_state() {
            return Ok(Duration::ZERO);
        }
        let t = Instant::now();
        model::save_state(&mut self.target)?;
        Ok(t.elapsed())
    }

    /// Forward phase: one target forward over the planned rows (`[last, d_1 .. d_k]`, without
    /// the final draft when it ends the sequence, or the root and every node of a tree through
    /// [`crate::TreeTarget::forward_tree`]); checks the logits' shape and the sequence length.
    fn forward(&mut self, plan: &Plan) -> Result<Duration> {
        let vocab = self.target.vocab_size();
        let rows = plan.rows();
        let t = Instant::now();
        match self.seq.rows(plan) {
            SlotInput::Tree { root, block } => {
                // One tree forward over the root and every node (each attends to its ancestors).
                let Some(tree) = self.target.tree() else {
                    return Err(Error::TargetContract {
                        what: "tree() returned None after offering tree support",
                    });
                };
                tree.forward_tree(root, &block, &mut self.logits)?;
            }
            SlotInput::Chain(feed) | SlotInput::Prefill(feed) if plan.fed() > 0 => {
                // A fused prefill: the prompt tokens, then the verify rows, in one forward.
                self.target.forward_tail(feed, rows, &mut self.logits)?;
            }
            SlotInput::Chain(feed) | SlotInput::Prefill(feed) => {
                self.target.forward(feed, &mut self.logits)?;
            }
        }
        let forward_time = t.elapsed();
        if self.logits.len() != rows * vocab {
            return Err(Error::ShapeMismatch {
                what: if plan.is_tree() {
                    "target logits ([nodes + 1, vocab])"
                } else {
                    "target logits ([k + 1, vocab])"
                },
                expected: rows * vocab,
                actual: self.logits.len(),
            });
        }
        let want = self.seq.cache_len_after(plan);
        check_seq_len(&self.target, want, "seq_len after forward")?;
        Ok(forward_time)
    }
}

/// The target's hidden states of its last forward, as the sequence reads them.
fn hidden_view<T: TargetModel>(target: &T) -> Option<HiddenView<'_>> {
    target.hidden_states().map(|hs| HiddenView {
        size: hs.hidden_size(),
        last: hs.last_hidden(),
    })
}

/// Applies a cache operation to the target: truncation, the tree commit, or a rollback of a
/// target that cannot truncate (restore and replay `context[from..len]`, keep rows, restore);
/// then checks the sequence length (except after a plain truncation). Returns the replay's
/// time and tokens (zero without a replay).
fn apply_cache<T: TargetModel>(
    target: &mut T,
    op: CacheOp<'_>,
    context: &[u32],
) -> Result<(Duration, usize)> {
    let none = (Duration::ZERO, 0);
    match op {
        CacheOp::Keep(n) => return target.truncate(n).map(|()| none),
        CacheOp::CommitTree { path, .. } => match target.tree() {
            Some(tree) => tree.commit_tree(path)?,
            None => {
                return Err(Error::TargetContract {
                    what: "tree() returned None after a tree forward",
                });
            }
        },
        CacheOp::Hold(_) => {}
        CacheOp::Replay { from, len } => {
            let t = Instant::now();
            model::restore_state(target)?;
            check_seq_len(target, from, "seq_len after restore_state")?;
            target.prefill(&context[from..len])?;
            check_seq_len(target, len, "seq_len after the replay")?;
            return Ok((t.elapsed(), len - from));
        }
        CacheOp::KeepRows { rows, .. } => model::keep_rows(target, rows)?,
        CacheOp::Restore(_) => model::restore_state(target)?,
    }
    let what = match op {
        CacheOp::CommitTree { .. } => "seq_len after commit_tree",
        _ => "seq_len after the step's rollback (keep_rows, restore_state or none)",
    };
    check_seq_len(target, op.len(), what)?;
    Ok(none)
}

/// After a failed step: brings the target back with `op` ([`Sequence::fail_op`]); a target
/// that cannot truncate and is not at the length already is reset (`truncate(0)`) when the
/// rollback fails. Best effort: `false` when the cache is not known to hold the sequence's
/// tokens afterwards (the next generation then does not reuse it).
fn rewind<T: TargetModel>(target: &mut T, op: CacheOp<'static>) -> bool {
    match op {
        CacheOp::Keep(len) => target.truncate(len).is_ok(),
        _ if target.seq_len() == op.len() => true,
        _ => {
            if apply_cache(target, op, &[]).is_err() {
                let _ = target.truncate(0);
                return false;
            }
            true
        }
    }
}

/// `Err(TargetContract)` unless the target holds `expected` positions.
fn check_seq_len<T: TargetModel>(target: &T, expected: usize, what: &'static str) -> Result<()> {
    if target.seq_len() != expected {
        return Err(Error::TargetContract { what });
    }
    Ok(())
}

/// One generation in progress; see [`Generator::session`].
pub struct Session<'g, T, P> {
    g: &'g mut Generator<T, P>,
}

impl<T: TargetModel, P: Proposer> Session<'_, T, P> {
    /// The new tokens so far.
    pub fn tokens(&self) -> &[u32] {
        self.g.seq.tokens()
    }

    /// The text of the new tokens so far (complete characters only; `None` without a
    /// [`Detokenizer`]).
    pub fn text(&self) -> Option<&str> {
        self.g.seq.text()
    }

    /// The finish reason once the generation has ended.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.g.seq.finish_reason()
    }

    /// Metrics so far.
    pub fn metrics(&self) -> &Metrics {
        self.g.seq.metrics()
    }

    /// Cancels: the next [`Session::step`] returns `None` with [`FinishReason::Cancelled`].
    pub fn cancel(&mut self) {
        self.g.seq.cancel();
    }

    /// The tokens, log-probabilities and released text of the last successful
    /// [`Session::step`].
    pub fn last_chunk(&self) -> StreamChunk<'_> {
        self.g.seq.last_chunk()
    }

    /// The draft size, depth and accepted length of the last successful [`Session::step`].
    pub fn last_step(&self) -> StepStats {
        self.g.seq.last_step()
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
        if self.g.seq.finish_reason().is_some() {
            return Ok(None);
        }
        let mark = self.g.seq.mark();
        match self.g.run_step() {
            Ok(true) => Ok(Some(self.g.seq.last_tokens())),
            Ok(false) => Ok(None),
            Err(e) => {
                // Best effort: a cache whose rollback failed is not reused.
                let len = self.g.seq.fail(mark);
                if !rewind(&mut self.g.target, self.g.seq.fail_op(len)) {
                    self.g.cache_known = false;
                }
                Err(e)
            }
        }
    }

    /// Ends the session (as cancelled if it was still running) and returns the result.
    pub fn into_generation(self) -> Generation {
        self.g.seq.take_generation(&mut self.g.proposer)
    }

    /// Total wall time so far.
    pub fn elapsed(&self) -> Duration {
        self.g.seq.elapsed()
    }
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
