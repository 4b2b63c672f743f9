//! Targets whose state cannot be truncated ([`speculative::Rollback`]): the recurrent toy of
//! `test_util` in snapshot mode (restore and replay) and with per-row states, under both loops,
//! with prompt lookup and with a recurrent draft model.
//!
//! - Greedy identity: every speculative greedy output equals plain greedy decoding of the same
//!   toy (its logits are bit-identical to the truncatable reference `RecurrentToy::reference`).
//! - Losslessness (GUIDE section 2): the first two tokens of `N` seeded sampled generations
//!   against their exact law from the reference's rows (temperature 1, top-k 4: 16 cells), a
//!   chi-square at alpha = 1e-3; the negative control, a target whose restore (or keep_rows)
//!   forgets the rejected tokens' effect, must fail the same test.
//! - Errors: a failed step leaves the target at the emitted tokens but the last (snapshot
//!   restored, row states dropped) or reset to 0 when that is impossible, and the generator's
//!   next request gives the output of a fresh one.

use speculative::decode::{
    AdaptiveConfig, BatchGenerator, BatchRequest, DraftLength, FixedCosts, GenerationParams,
    Generator,
};
use speculative::propose::{DraftModelProposer, NoProposer, PromptLookup};
use speculative::sampling::{History, RowProcessor, TokenDist};
use speculative::test_util::{RecurrentToy, ToyRnn};
use speculative::{
    Draft, Error, PerSlot, ProposeRequest, Proposer, Result, Rollback, RollbackMode, RowKind,
    RowStates, SamplingConfig, StateSnapshot, TargetModel,
};
use statrs::distribution::{ChiSquared, ContinuousCDF};

const PROMPTS: &[&[u32]] = &[&[1, 2, 3, 1, 2, 3, 1, 2], &[5, 4, 5, 4, 5], &[7, 0]];
const MAX_CONTEXT: usize = 96;

fn rnn() -> ToyRnn {
    ToyRnn::new(12, 6, 3.0, 1)
}

fn toy(mode: RollbackMode) -> RecurrentToy {
    of(rnn(), mode)
}

fn of(r: ToyRnn, mode: RollbackMode) -> RecurrentToy {
    match mode {
        RollbackMode::Snapshot => RecurrentToy::snapshot(r, MAX_CONTEXT),
        _ => RecurrentToy::row_states(r, MAX_CONTEXT),
    }
}

/// A recurrent draft model: the target's parameters with noise (often, not always, right).
fn draft(mode: RollbackMode) -> DraftModelProposer<RecurrentToy> {
    DraftModelProposer::new(of(rnn().perturbed(0.4, 9), mode))
}

const MODES: [RollbackMode; 2] = [RollbackMode::Snapshot, RollbackMode::RowStates];

fn plain(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut g = Generator::new(toy(RollbackMode::Snapshot).reference(), NoProposer);
    g.generate(prompt, &GenerationParams::greedy(n))
        .unwrap()
        .tokens
}

fn drafts() -> [DraftLength; 2] {
    [
        DraftLength::Fixed(4),
        DraftLength::Adaptive(AdaptiveConfig::default()),
    ]
}

fn costs() -> FixedCosts {
    FixedCosts::linear(0.010, 0.002).unwrap()
}

#[test]
fn greedy_generator_equals_plain_decoding_in_both_modes() {
    for mode in MODES {
        let mut replays = 0;
        for (pi, p) in PROMPTS.iter().enumerate() {
            let want = plain(p, 40);
            for draft_len in drafts() {
                let params = GenerationParams::greedy(40).with_draft(draft_len.clone());
                let pl = PromptLookup::new(1, 3).unwrap();
                let mut g = Generator::new(toy(mode), pl).with_costs(costs());
                let out = g.generate(p, &params).unwrap();
                assert_eq!(out.tokens, want, "{mode:?} prompt lookup, prompt {pi}");
                replays += out.metrics.replays;
                let mut g = Generator::new(toy(mode), draft(mode)).with_costs(costs());
                let out = g.generate(p, &params).unwrap();
                assert_eq!(out.tokens, want, "{mode:?} draft model, prompt {pi}");
                assert!(out.metrics.accepted > 0, "the draft model is often right");
                replays += out.metrics.replays;
                if mode == RollbackMode::Snapshot {
                    assert_eq!(out.metrics.replays > 0, out.metrics.replayed_tokens > 0);
                }
                // The mixed pairing: a draft model of the other mode.
                let other = if mode == RollbackMode::Snapshot {
                    RollbackMode::RowStates
                } else {
                    RollbackMode::Snapshot
                };
                let mut g = Generator::new(toy(mode), draft(other));
                assert_eq!(g.generate(p, &params).unwrap().tokens, want);
            }
        }
        match mode {
            RollbackMode::Snapshot => assert!(replays > 0, "rejections were replayed"),
            _ => assert_eq!(replays, 0, "row states need no replay"),
        }
    }
}

#[test]
fn tree_requests_fall_back_to_chains() {
    let params = GenerationParams::greedy(24)
        .with_draft(DraftLength::Fixed(3))
        .with_tree(speculative::decode::TreeDrafts::nodes(8));
    for mode in MODES {
        let mut g = Generator::new(toy(mode), draft(mode));
        let out = g.generate(PROMPTS[0], &params).unwrap();
        assert_eq!(out.tokens, plain(PROMPTS[0], 24));
        assert_eq!(out.metrics.tree_steps, 0);
    }
}

#[test]
fn greedy_batch_equals_plain_decoding_in_both_modes() {
    for mode in MODES {
        let target = PerSlot::new((0..2).map(|_| toy(mode)).collect()).unwrap();
        let mut batch = BatchGenerator::new(target).with_costs(costs());
        let mut want = Vec::new();
        for (i, p) in PROMPTS.iter().cycle().take(5).enumerate() {
            let draft_len = drafts()[i % 2].clone();
            let params = GenerationParams::greedy(30).with_draft(draft_len);
            let req = if i % 2 == 0 {
                BatchRequest::new(p.to_vec(), params, PromptLookup::new(1, 3).unwrap())
            } else {
                BatchRequest::new(p.to_vec(), params, draft(mode))
            };
            let id = batch.submit(req).unwrap();
            want.push((id, plain(p, 30)));
        }
        let done = batch.run().unwrap();
        assert_eq!(done.len(), want.len());
        for f in done {
            let (_, w) = want.iter().find(|(id, _)| *id == f.id).unwrap();
            let g = f.result.unwrap();
            assert_eq!(&g.tokens, w, "{mode:?} request {}", f.id);
        }
        let m = batch.metrics();
        match mode {
            RollbackMode::Snapshot => {
                assert!(m.replayed > 0);
                // The slots that replay in a step share one batched forward.
                assert!(
                    m.replay_forwards > 0 && m.replay_forwards < m.replays,
                    "{m:?}"
                );
            }
            _ => assert_eq!((m.replayed, m.replays, m.replay_forwards), (0, 0, 0)),
        }
    }
}

#[test]
fn per_slot_refuses_models_of_different_modes() {
    let models = vec![toy(RollbackMode::Snapshot), toy(RollbackMode::RowStates)];
    assert!(matches!(
        PerSlot::new(models),
        Err(Error::InvalidConfig { .. })
    ));
}

// ---- losslessness ----

const TOP_K: usize = 4;
const N: u64 = 1500;
const ALPHA: f64 = 1e-3;

fn sampling() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(1.0)
        .top_k(TOP_K)
        .build()
        .unwrap()
}

fn processed(row: &[f32]) -> TokenDist {
    let mut d = TokenDist::default();
    RowProcessor::new()
        .distribution(
            &sampling(),
            row,
            &History::default(),
            RowKind::Target,
            0,
            &mut d,
        )
        .unwrap();
    d
}

/// The exact law of the first two tokens after `prompt`: `(t1, t2) -> p`, from the reference's
/// single-row logits.
fn exact_law(prompt: &[u32]) -> Vec<((u32, u32), f64)> {
    let reference = toy(RollbackMode::Snapshot).reference();
    let last = |ctx: &[u32]| {
        let mut m = reference.clone();
        let mut logits = Vec::new();
        m.forward(ctx, &mut logits).unwrap();
        logits[logits.len() - 12..].to_vec()
    };
    let first = processed(&last(prompt));
    let mut cells = Vec::new();
    for (&t1, &p1) in first.ids().iter().zip(first.probs()) {
        let ctx: Vec<u32> = prompt.iter().copied().chain([t1]).collect();
        let second = processed(&last(&ctx));
        for (&t2, &p2) in second.ids().iter().zip(second.probs()) {
            cells.push(((t1, t2), p1 as f64 * p2 as f64));
        }
    }
    let total: f64 = cells.iter().map(|c| c.1).sum();
    cells.iter().map(|&(c, p)| (c, p / total)).collect()
}

/// The p-value of the first two tokens of `N` seeded generations of `target` with a recurrent
/// draft model of `mode` (draft length 2: the first step drafts 1, the budget's cap).
fn p_value<T: TargetModel>(target: T, mode: RollbackMode, prompt: &[u32]) -> f64 {
    let law = exact_law(prompt);
    let mut g = Generator::new(target, draft(mode));
    let mut counts = vec![0u64; law.len()];
    let mut outside = 0u64;
    for seed in 0..N {
        let params =
            GenerationParams::sampled(sampling(), seed, 2).with_draft(DraftLength::Fixed(2));
        let t = g.generate(prompt, &params).unwrap().tokens;
        match law.iter().position(|&((a, b), _)| [a, b] == t[..]) {
            Some(i) => counts[i] += 1,
            None => outside += 1,
        }
    }
    if outside > 0 {
        return 0.0;
    }
    // Pearson chi-square, cells of expected count < 5 pooled.
    let (mut stat, mut bins, mut pool) = (0.0, 0usize, (0.0, 0.0));
    for (&o, &(_, p)) in counts.iter().zip(&law) {
        let e = p * N as f64;
        if e < 5.0 {
            pool = (pool.0 + o as f64, pool.1 + e);
        } else {
            stat += (o as f64 - e).powi(2) / e;
            bins += 1;
        }
    }
    if pool.1 >= 1.0 {
        stat += (pool.0 - pool.1).powi(2) / pool.1;
        bins += 1;
    }
    ChiSquared::new((bins - 1) as f64).unwrap().sf(stat)
}

#[test]
fn sampled_first_tokens_follow_the_target_law_in_both_modes() {
    for mode in MODES {
        let p = p_value(toy(mode), mode, PROMPTS[1]);
        assert!(p >= ALPHA, "{mode:?}: p = {p}");
    }
}

/// A target whose rollback forgets: it reports the length the loop expects, but its state keeps
/// the rejected tokens' effect (snapshot: `restore_state` restores nothing; row states:
/// `keep_rows` keeps every row).
struct Forgets {
    inner: RecurrentToy,
    len: usize,
    saved: usize,
    commit: usize,
}

impl Forgets {
    fn new(mode: RollbackMode) -> Self {
        Forgets {
            inner: toy(mode),
            len: 0,
            saved: 0,
            commit: 0,
        }
    }
}

impl TargetModel for Forgets {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn seq_len(&self) -> usize {
        self.len
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.inner.forward(tokens, logits)?;
        self.len += tokens.len();
        Ok(())
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.inner.prefill(tokens)?;
        self.len += tokens.len();
        self.commit = self.len;
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        assert_eq!(len, 0, "the loop only resets a recurrent target");
        self.inner.truncate(0)?;
        (self.len, self.commit) = (0, 0);
        Ok(())
    }
    fn rollback(&mut self) -> Option<Rollback<'_>> {
        Some(match self.inner.mode() {
            RollbackMode::Snapshot => Rollback::Snapshot(self),
            _ => Rollback::RowStates(self),
        })
    }
}

impl StateSnapshot for Forgets {
    fn save_state(&mut self) -> Result<()> {
        self.saved = self.len;
        Ok(())
    }
    fn restore_state(&mut self) -> Result<()> {
        self.len = self.saved;
        Ok(())
    }
}

impl RowStates for Forgets {
    fn pending_rows(&self) -> usize {
        self.len - self.commit
    }
    fn keep_rows(&mut self, rows: usize) -> Result<()> {
        self.len = self.commit + rows;
        self.commit = self.len;
        Ok(())
    }
}

#[test]
fn negative_control_a_target_that_forgets_to_roll_back_fails_the_test() {
    for mode in MODES {
        let p = p_value(Forgets::new(mode), mode, PROMPTS[1]);
        assert!(
            p < ALPHA,
            "{mode:?}: the broken rollback went unnoticed, p = {p}"
        );
    }
}

// ---- errors ----

/// Wraps a target and returns NaN logits from its `nan_on`-th forward (1-based) on.
struct NanOn<T> {
    inner: T,
    calls: usize,
    nan_on: usize,
}

impl<T: TargetModel> TargetModel for NanOn<T> {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.inner.forward(tokens, logits)?;
        self.calls += 1;
        if self.calls == self.nan_on {
            logits[0] = f32::NAN;
        }
        Ok(())
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.inner.prefill(tokens)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.inner.truncate(len)
    }
    fn rollback(&mut self) -> Option<Rollback<'_>> {
        self.inner.rollback()
    }
}

/// A proposer that drafts like prompt lookup and fails its `fail_on`-th `observe`.
struct FailsObserve {
    inner: PromptLookup,
    calls: usize,
    fail_on: usize,
}

impl Proposer for FailsObserve {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose(req, draft)
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.calls += 1;
        if self.calls == self.fail_on {
            return Err(Error::Proposer("observe failed on purpose".into()));
        }
        self.inner.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.inner.begin(prompt)
    }
    fn name(&self) -> &'static str {
        "fails-observe"
    }
}

/// The state of a fresh toy after `tokens`.
fn state_after(tokens: &[u32]) -> Vec<f32> {
    let mut m = toy(RollbackMode::Snapshot);
    m.prefill(tokens).unwrap();
    m.state().to_vec()
}

#[test]
fn a_failed_verification_rolls_the_state_back_to_the_emitted_tokens() {
    let prompt = PROMPTS[0];
    let params = GenerationParams::greedy(30).with_draft(DraftLength::Fixed(3));
    for mode in MODES {
        let target = NanOn {
            inner: toy(mode),
            calls: 0,
            nan_on: 4,
        };
        let mut g = Generator::new(target, PromptLookup::new(1, 3).unwrap());
        let err = g.generate(prompt, &params).unwrap_err();
        assert!(matches!(err.error, Error::NonFiniteLogits { .. }), "{err}");
        let emitted = &err.partial.tokens;
        assert!(!emitted.is_empty());
        // The cache holds every emitted token but the last, and the state is theirs.
        let held: Vec<u32> = prompt.iter().chain(emitted).copied().collect();
        let held = &held[..held.len() - 1];
        let t = &g.target().inner;
        assert_eq!(t.seq_len(), held.len(), "{mode:?}");
        assert_eq!(t.state(), &state_after(held)[..], "{mode:?}");
        // The next request is unaffected.
        g.target_mut().nan_on = usize::MAX;
        let out = g.generate(prompt, &params).unwrap();
        assert_eq!(out.tokens, plain(prompt, 30));
    }
}

#[test]
fn a_failure_after_the_rollback_restores_the_snapshot_or_resets() {
    let prompt = PROMPTS[0];
    let params = GenerationParams::greedy(30).with_draft(DraftLength::Fixed(3));
    for mode in MODES {
        let p = FailsObserve {
            inner: PromptLookup::new(1, 3).unwrap(),
            calls: 0,
            fail_on: 3,
        };
        let mut g = Generator::new(toy(mode), p);
        let err = g.generate(prompt, &params).unwrap_err();
        assert!(matches!(err.error, Error::Proposer(_)), "{err}");
        let held: Vec<u32> = prompt.iter().chain(&err.partial.tokens).copied().collect();
        let held = &held[..held.len() - 1];
        let t = g.target();
        match mode {
            // The step's snapshot is restored.
            RollbackMode::Snapshot => {
                assert_eq!(t.seq_len(), held.len());
                assert_eq!(t.state(), &state_after(held)[..]);
            }
            // The step's rows were committed: no state of the step's start is left, so the
            // target is reset.
            _ => {
                assert_eq!(t.seq_len(), 0);
                assert!(t.state().iter().all(|&x| x == 0.0));
            }
        }
        g.proposer_mut().fail_on = usize::MAX;
        assert_eq!(
            g.generate(prompt, &params).unwrap().tokens,
            plain(prompt, 30)
        );
    }
}

#[test]
fn the_toy_refuses_truncation_and_bad_rollbacks_with_typed_errors() {
    for mode in MODES {
        let mut m = toy(mode);
        let mut logits = Vec::new();
        m.forward(&[1, 2, 3], &mut logits).unwrap();
        let state = m.state().to_vec();
        assert!(matches!(m.truncate(1), Err(Error::StateRollback { .. })));
        assert!(m.truncate(4).is_err());
        m.truncate(3).unwrap();
        assert_eq!((m.seq_len(), m.state()), (3, &state[..]));
        match m.rollback().unwrap() {
            Rollback::Snapshot(s) => {
                assert!(matches!(
                    s.restore_state(),
                    Err(Error::StateRollback { .. })
                ));
            }
            Rollback::RowStates(r) => {
                assert_eq!(r.pending_rows(), 3);
                assert!(matches!(r.keep_rows(4), Err(Error::StateRollback { .. })));
            }
            _ => panic!("RecurrentToy offers snapshot or row states only"),
        }
        assert_eq!((m.seq_len(), m.state()), (3, &state[..]));
        m.truncate(0).unwrap();
        assert_eq!(m.seq_len(), 0);
    }
}

// ---- measurement (docs/benchmarks.md), not run in CI ----

/// Replay vs per-row states on the toy under fixed step costs (deterministic): per mode and
/// draft policy, the steps, the mean draft length chosen, acceptance, replays, and the cost per
/// emitted token on the linear curve `c(n) = base + per_row * n` (a replay of `r` tokens costs
/// `c(r)`). Run with `cargo test -p speculative --test recurrent -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement: prints a table for docs/benchmarks.md"]
fn rollback_costs_by_mode() {
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| p.to_vec()).collect();
    println!(
        "| curve c(n) | mode | draft | steps | mean k | acceptance | replays | replayed | cost / token (ms) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (base, per_row) in [(0.010, 0.002), (0.010, 0.010)] {
        for mode in MODES {
            for draft_len in drafts() {
                let c = FixedCosts::linear(base, per_row).unwrap();
                let mut g = Generator::new(toy(mode), draft(mode)).with_costs(c);
                let params = GenerationParams::greedy(200).with_draft(draft_len.clone());
                let (mut steps, mut k, mut acc, mut rep, mut rtok, mut emitted) =
                    (0, 0, 0, 0, 0, 0);
                for p in &prompts {
                    let m = g.generate(p, &params).unwrap().metrics;
                    steps += m.target_calls;
                    k += m.proposed;
                    acc += m.accepted;
                    rep += m.replays;
                    rtok += m.replayed_tokens;
                    emitted += m.emitted;
                }
                let forward = steps as f64 * base + per_row * (k + steps) as f64;
                let replay = rep as f64 * base + per_row * rtok as f64;
                let name = match draft_len {
                    DraftLength::Fixed(k) => format!("fixed {k}"),
                    _ => "adaptive".into(),
                };
                println!(
                    "| {:.0} + {:.0} n ms | {mode:?} | {name} | {steps} | {:.2} | {:.2} | {rep} | {rtok} | {:.2} |",
                    base * 1e3,
                    per_row * 1e3,
                    k as f64 / steps as f64,
                    acc as f64 / k.max(1) as f64,
                    1e3 * (forward + replay) / emitted as f64,
                );
            }
        }
    }
}
