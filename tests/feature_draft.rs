//! Feature-conditioned draft models (EAGLE heads; Li et al. 2024) through the decoding loop.
//!
//! The target is a toy recurrent model ([`ToyRnn`]) whose final hidden state of every position
//! is known in closed form, the draft a [`ToyFeatureDraft`] whose row at position `p` reads the
//! target's feature of position `p - 1` (or its own prediction for draft positions), driven by
//! [`DraftModelProposer`].
//!
//! - **Plumbing**: at every proposal of the real [`Generator`] loop (chains, token trees,
//!   adaptive steps with `k = 0`, several generations in a row on one proposer, one-token
//!   prompts), `ProposeRequest::target_hidden_rows` holds the target's true hidden states of
//!   every context position but the last, and the features the draft model holds and its rows
//!   of every context position read are those true states (computed by brute force from the
//!   prefix). Each step hands over only the rows from the previous step's last context position.
//! - **Greedy identity** with plain greedy decoding, and the features pay: the same draft head
//!   accepts more with the target's features than without them.
//! - **Losslessness under sampling**: vocab 5, 3 new tokens (125 enumerable outputs, exact law
//!   from the processed target conditionals); `N` seeded generations; Pearson's chi-square
//!   (`common::chi_square`), `ALPHA = 1e-3` (a positive test passes when p >= ALPHA, the
//!   negative control when p < ALPHA). Negative control: the draft tokens sampled by the head
//!   with the target's features, but q reported as the head's distribution with a zero feature
//!   at the root (q is not the distribution the tokens were drawn from).
//! - **Loop edge cases**: a target without hidden states gives `None`; a target whose hidden
//!   rows change width mid-generation gives `None` from then on, and nothing panics.

mod common;

use common::chi_square;
use speculative::decode::{
    AdaptiveConfig, DraftLength, FixedCosts, GenerationParams, Generator, TreeDrafts,
};
use speculative::propose::{DraftModelProposer, DraftTreeConfig};
use speculative::sampling::{History, RowProcessor, TokenCounts, TokenDist};
use speculative::test_util::{FeatureSource, HiddenFn, ToyFeatureDraft, ToyModel, ToyRnn};
use speculative::{
    Draft, Error, NoProposer, ProposeRequest, Proposer, Result, RowKind, SamplingConfig,
    TargetFeatures, TargetModel,
};
use std::sync::Arc;

const ALPHA: f64 = 1e-3;
const V: usize = 12;
const H: usize = 6;

fn rnn(vocab: usize, seed: u64) -> ToyRnn {
    ToyRnn::new(vocab, H, 3.0, seed)
}

fn target(r: &ToyRnn) -> ToyModel {
    r.target(1 << 16).with_tree(32)
}

fn head(r: &ToyRnn, noise: f32, tree: bool) -> DraftModelProposer<ToyFeatureDraft> {
    let m = ToyFeatureDraft::new(r.perturbed(noise, 99), 1 << 16);
    let m = if tree { m.with_tree(32) } else { m };
    DraftModelProposer::new(m)
        .with_tree_config(DraftTreeConfig::default().with_beam(3).with_children(3))
        .unwrap()
}

/// The target's true hidden states of every position of `ctx` but the last.
fn true_rows(r: &ToyRnn, ctx: &[u32]) -> Vec<f32> {
    (0..ctx.len().saturating_sub(1))
        .flat_map(|p| r.hidden(&ctx[..=p]))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Plumbing

/// Wraps the head's proposer and checks, at every proposal, the request's rows and what the
/// draft model holds against the brute-force truth. Every `skip`-th call (when `skip > 0`) is
/// answered with an empty draft without asking the head, as a `k = 0` step would.
struct Checked {
    inner: DraftModelProposer<ToyFeatureDraft>,
    truth: ToyRnn,
    skip: usize,
    calls: usize,
    checked: usize,
    /// Context length at the head's previous proposal in this generation.
    prev_len: Option<usize>,
    /// Rows handed to the model over all proposals.
    rows_set: usize,
    /// Set calls that were not the first of their generation.
    incremental: usize,
    /// Generations in which the head proposed.
    generations: usize,
}

impl Checked {
    fn new(inner: DraftModelProposer<ToyFeatureDraft>, truth: ToyRnn, skip: usize) -> Self {
        Checked {
            inner,
            truth,
            skip,
            calls: 0,
            checked: 0,
            prev_len: None,
            rows_set: 0,
            incremental: 0,
            generations: 0,
        }
    }

    fn check(&mut self, req: &ProposeRequest<'_>) {
        let ctx = req.context;
        let want = true_rows(&self.truth, ctx);
        let rows = req
            .target_hidden_rows
            .expect("the target exposes hidden states");
        assert_eq!(rows, &want[..], "target_hidden_rows at context {ctx:?}");
        match req.target_hidden {
            Some(last) => assert_eq!(last, &want[want.len() - H..]),
            None => assert_eq!(ctx.len(), 1),
        }
        let m = self.inner.model();
        assert_eq!(&m.tokens()[..ctx.len()], ctx);
        assert_eq!(m.target_hidden_len(), ctx.len() - 1);
        assert_eq!(m.held(), &want[..], "held features at context {ctx:?}");
        for p in 0..ctx.len() {
            let (src, f) = m.row_feature(p).unwrap();
            if p == 0 {
                assert_eq!(src, FeatureSource::Start);
            } else {
                assert_eq!(src, FeatureSource::Target, "row {p} of {ctx:?}");
                assert_eq!(f, &want[(p - 1) * H..p * H], "row {p} of {ctx:?}");
            }
        }
        // Only the rows from the previous proposal's last context position were handed over.
        let &(start, n) = m.feature_sets.last().unwrap();
        assert_eq!(start + n, ctx.len() - 1);
        match self.prev_len {
            Some(prev) => {
                assert_eq!(start, prev - 1, "context {prev} -> {}", ctx.len());
                self.incremental += 1;
            }
            None => {
                assert_eq!(start, 0);
                self.generations += 1;
            }
        }
        // The model started from an empty sequence once per generation, never again.
        assert_eq!(
            m.first_rows, self.generations,
            "restarts at context {ctx:?}"
        );
        self.rows_set += n;
        self.prev_len = Some(ctx.len());
        self.checked += 1;
    }

    fn skipped(&mut self) -> bool {
        self.calls += 1;
        self.skip > 0 && self.calls.is_multiple_of(self.skip)
    }
}

impl Proposer for Checked {
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.prev_len = None;
        self.inner.begin(prompt)
    }
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        if self.skipped() {
            draft.clear();
            return Ok(());
        }
        self.inner.propose(req, draft)?;
        self.check(req);
        Ok(())
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        if self.skipped() {
            draft.clear();
            return Ok(());
        }
        self.inner.propose_tree(req, draft)?;
        self.check(req);
        Ok(())
    }
}

fn prompts() -> Vec<Vec<u32>> {
    let mut p: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..3 + 4 * i).map(|j| (j * 5 + i * 7) % V as u32).collect())
        .collect();
    p.insert(1, vec![3]);
    p.push(vec![7]);
    p
}

fn sampled() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(0.8)
        .repetition_penalty(1.2)
        .build()
        .unwrap()
}

fn plain(r: &ToyRnn, prompt: &[u32], params: &GenerationParams) -> Vec<u32> {
    let plain = params
        .clone()
        .with_draft(DraftLength::Off)
        .with_tree(TreeDrafts::nodes(0));
    Generator::new(target(r), NoProposer)
        .generate(prompt, &plain)
        .unwrap()
        .tokens
}

/// The adaptive policy's step costs in these tests: 4 ms + 1 ms per row, 1 ms per draft token.
fn costs() -> FixedCosts {
    FixedCosts::linear(0.004, 0.001)
        .unwrap()
        .with_propose_secs(0.001)
        .unwrap()
}

#[test]
fn the_head_holds_the_targets_true_features_at_every_proposal() {
    let adaptive = DraftLength::Adaptive(
        AdaptiveConfig::default()
            .with_max_draft(4)
            .with_probe_interval(2)
            // Probes as often as the interval says (the fixed costs make a probe dear, and the
            // default budget would space them out): every hand-over path gets exercised.
            .with_probe_budget(1.0)
            .with_request_probe_budget(1.0),
    );
    let mut total = (0, 0, 0, 0);
    for seed in 1..=3u64 {
        let r = rnn(V, seed);
        for (draft, nodes, skip) in [
            (DraftLength::Fixed(4), 0, 0),
            (DraftLength::Fixed(4), 10, 0),
            (DraftLength::Fixed(3), 0, 3),
            (DraftLength::Fixed(3), 12, 2),
            (adaptive.clone(), 0, 0),
            (adaptive.clone(), 10, 0),
        ] {
            for cfg in [SamplingConfig::greedy(), sampled()] {
                // One generator, one proposer, every prompt in a row.
                let checked = Checked::new(head(&r, 0.3, nodes > 0), r.clone(), skip);
                // The adaptive policy learns from a fixed cost curve (not the clock), so its
                // choices, and the counts below, are the same on any machine.
                let mut g = Generator::new(target(&r), checked).with_costs(costs());
                for (i, prompt) in prompts().iter().enumerate() {
                    let params = GenerationParams::builder()
                        .sampling(cfg.clone())
                        .seed(i as u64)
                        .max_new_tokens(30)
                        .draft(draft.clone())
                        .tree(TreeDrafts::nodes(nodes))
                        .build()
                        .unwrap();
                    let out = g.generate(prompt, &params).unwrap();
                    assert_eq!(out.tokens.len(), 30);
                    if cfg.is_greedy() {
                        assert_eq!(out.tokens, plain(&r, prompt, &params), "{draft:?} {nodes}");
                    }
                    total.1 += out.metrics.tree_steps;
                    total.2 += out.metrics.no_draft_steps;
                }
                let c = g.proposer();
                assert!(c.checked >= 10, "{} proposals checked", c.checked);
                // Incremental hand-over: about one row per emitted token, not the context.
                assert!(
                    c.rows_set < 30 * prompts().len() + 40,
                    "{} rows",
                    c.rows_set
                );
                total.0 += c.checked;
                total.3 += c.incremental;
            }
        }
    }
    let (checked, trees, no_draft, incremental) = total;
    println!(
        "{checked} proposals checked ({incremental} incremental), {trees} tree steps, \
         {no_draft} no-draft steps"
    );
    assert!(trees > 100, "trees were not exercised: {trees}");
    assert!(no_draft > 100, "k = 0 steps were not exercised: {no_draft}");
}

/// Mean tokens per target call of the head on `r`'s target with `features` on or off.
fn tokens_per_call(r: &ToyRnn, nodes: usize, features: bool) -> f64 {
    let (mut emitted, mut calls) = (0, 0);
    for prompt in prompts() {
        let params = GenerationParams::greedy(40)
            .with_draft(DraftLength::Fixed(4))
            .with_tree(TreeDrafts::nodes(nodes));
        let want = plain(r, &prompt, &params);
        let out = if features {
            Generator::new(target(r), head(r, 0.3, nodes > 0))
                .generate(&prompt, &params)
                .unwrap()
        } else {
            // The same target without hidden states: the head reads only its own features.
            let r2 = r.clone();
            let f = Arc::new(move |p: &[u32]| r2.head(&r2.hidden(p)));
            let t = ToyModel::new(V, 1 << 16, f).with_tree(32);
            Generator::new(t, head(r, 0.3, nodes > 0))
                .generate(&prompt, &params)
                .unwrap()
        };
        assert_eq!(out.tokens, want);
        emitted += out.metrics.emitted;
        calls += out.metrics.target_calls;
    }
    emitted as f64 / calls as f64
}

#[test]
fn greedy_output_is_plain_greedy_and_the_features_pay() {
    // Deterministic (greedy, fixed seeds); where the head's own features are already good
    // the two may tie, so the claim is on the sum over seeds.
    let (mut sum_with, mut sum_without) = (0.0, 0.0);
    for seed in 1..=4u64 {
        let r = rnn(V, seed);
        for nodes in [0, 12] {
            let with = tokens_per_call(&r, nodes, true);
            let without = tokens_per_call(&r, nodes, false);
            println!("seed {seed}, nodes {nodes}: {with:.2} with features, {without:.2} without");
            assert!(with > 1.5, "seed {seed}, nodes {nodes}: {with:.2}");
            sum_with += with;
            sum_without += without;
        }
    }
    assert!(
        sum_with > 1.05 * sum_without,
        "features did not pay: {sum_with:.2} vs {sum_without:.2}"
    );
}

// ---------------------------------------------------------------------------------------------
// The proposer's checks

#[test]
fn rows_of_the_wrong_size_are_a_typed_error() {
    let r = rnn(V, 1);
    let mut p = head(&r, 0.3, false);
    let cfg = SamplingConfig::greedy();
    let ctx = [1u32, 2, 3];
    let mut rows = true_rows(&r, &ctx);
    rows.pop();
    let req = ProposeRequest::new(&ctx, &cfg, 3).target_hidden_rows(Some(&rows));
    let err = p.propose(&req, &mut Draft::default()).unwrap_err();
    assert!(
        matches!(err, Error::ShapeMismatch { expected, actual, .. }
        if expected == 2 * H && actual == 2 * H - 1),
        "{err}"
    );
    // A model of another hidden size.
    let other = ToyRnn::new(V, H + 1, 3.0, 1);
    let mut p = DraftModelProposer::new(ToyFeatureDraft::new(other, 1 << 16));
    let rows = true_rows(&r, &ctx);
    let req = ProposeRequest::new(&ctx, &cfg, 3).target_hidden_rows(Some(&rows));
    assert!(matches!(
        p.propose(&req, &mut Draft::default()),
        Err(Error::ShapeMismatch { .. })
    ));
}

#[test]
fn set_target_hidden_checks_its_input() {
    let mut m = ToyFeatureDraft::new(rnn(V, 1), 64);
    assert!(matches!(
        m.set_target_hidden(1, &[]),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        m.set_target_hidden(0, &[0.0; H + 1]),
        Err(Error::ShapeMismatch { .. })
    ));
    m.set_target_hidden(0, &[0.5; 3 * H]).unwrap();
    m.forward(&[1, 2, 3, 4, 5], &mut Vec::new()).unwrap();
    // truncate keeps the held features; set_target_hidden drops the rows after start.
    m.truncate(4).unwrap();
    assert_eq!(m.target_hidden_len(), 3);
    m.set_target_hidden(2, &[0.25; H]).unwrap();
    assert_eq!((m.target_hidden_len(), m.seq_len()), (3, 3));
    assert_eq!(&m.held()[2 * H..], &[0.25; H]);
    assert_eq!(m.feature_sets, vec![(0, 3), (2, 1)]);
}

// ---------------------------------------------------------------------------------------------
// The loop's rows

/// `(context, target_hidden_rows, target_hidden)` of one proposal.
type Seen = (Vec<u32>, Option<Vec<f32>>, Option<Vec<f32>>);

/// Records `target_hidden_rows` and `target_hidden` of every proposal; proposes nothing.
#[derive(Default)]
struct Recorder {
    seen: Vec<Seen>,
}

impl Proposer for Recorder {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        self.seen.push((
            req.context.to_vec(),
            req.target_hidden_rows.map(<[f32]>::to_vec),
            req.target_hidden.map(<[f32]>::to_vec),
        ));
        Ok(())
    }
}

#[test]
fn the_loop_passes_every_context_row_even_for_a_one_token_prompt() {
    let r = rnn(V, 5);
    let mut g = Generator::new(target(&r), Recorder::default());
    for prompt in [vec![4u32], vec![1, 2, 3, 4, 5]] {
        g.generate(
            &prompt,
            &GenerationParams::greedy(6).with_draft(DraftLength::Fixed(2)),
        )
        .unwrap();
    }
    let seen = &g.proposer().seen;
    // The last step of each generation has room for no draft (k = 0, no proposal).
    assert_eq!(seen.len(), 10);
    // The one-token prompt: no rows yet, but the target has hidden states.
    assert_eq!(seen[0].1.as_deref(), Some(&[][..]));
    assert_eq!(seen[0].2, None);
    for (ctx, rows, last) in seen {
        let want = true_rows(&r, ctx);
        assert_eq!(rows.as_deref(), Some(&want[..]), "{ctx:?}");
        if ctx.len() > 1 {
            assert_eq!(last.as_deref(), Some(&want[want.len() - H..]));
        }
    }
}

#[test]
fn without_complete_hidden_states_the_loop_passes_none() {
    let r = rnn(V, 5);
    // No hidden states at all.
    let r2 = r.clone();
    let plain_target = ToyModel::new(
        V,
        1 << 16,
        Arc::new(move |p: &[u32]| r2.head(&r2.hidden(p))),
    );
    let mut g = Generator::new(plain_target, Recorder::default());
    g.generate(&[1, 2, 3], &GenerationParams::greedy(4))
        .unwrap();
    assert!(g.proposer().seen.iter().all(|(_, rows, _)| rows.is_none()));
    // Hidden states that change width after 6 positions: rows until then, None afterwards.
    let r3 = r.clone();
    let hf: HiddenFn = Arc::new(move |p: &[u32]| {
        let mut h = r3.hidden(p);
        if p.len() > 6 {
            h.pop();
        }
        h
    });
    let r4 = r.clone();
    let odd = ToyModel::new(
        V,
        1 << 16,
        Arc::new(move |p: &[u32]| r4.head(&r4.hidden(p))),
    )
    .with_hidden(H, hf);
    let mut g = Generator::new(odd, Recorder::default());
    g.generate(&[1, 2, 3], &GenerationParams::greedy(8))
        .unwrap();
    let seen = &g.proposer().seen;
    assert_eq!(seen.len(), 7);
    for (ctx, rows, _) in seen {
        if ctx.len() <= 7 {
            assert_eq!(rows.as_deref(), Some(&true_rows(&r, ctx)[..]), "{ctx:?}");
        } else {
            assert_eq!(rows, &None, "{ctx:?}");
        }
    }
    // The next generation starts complete again.
    g.generate(&[1, 2], &GenerationParams::greedy(2)).unwrap();
    assert_eq!(g.proposer().seen.len(), 8);
    assert!(g.proposer().seen[7].1.is_some());
}

// ---------------------------------------------------------------------------------------------
// Losslessness under sampling

const VS: usize = 5;
const LEN: usize = 3;
const N: u64 = 12_000;
const PROMPT: [u32; 6] = [0, 1, 2, 3, 4, 1];

fn stat_rnn() -> ToyRnn {
    ToyRnn::new(VS, H, 2.0, 11)
}

fn stat_config() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(0.9)
        .frequency_penalty(0.4)
        .build()
        .unwrap()
}

/// The processed conditional of `logits` after `prefix` (`kind` rows: penalties over the
/// generated part of `prefix`).
fn processed(cfg: &SamplingConfig, logits: &[f32], prefix: &[u32], kind: RowKind) -> TokenDist {
    let counts = TokenCounts::from_context(prefix, PROMPT.len(), VS).unwrap();
    let hist = History {
        counts: Some(&counts),
        prefix,
        suppress: &[],
    };
    let mut d = TokenDist::default();
    RowProcessor::new()
        .distribution(cfg, logits, &hist, kind, 0, &mut d)
        .unwrap();
    d
}

/// Exact law of the first `LEN` generated tokens (`[VS^LEN]`, first token most significant).
fn exact(cfg: &SamplingConfig) -> Vec<f64> {
    let r = stat_rnn();
    (0..VS.pow(LEN as u32))
        .map(|cell| {
            let mut ctx = PROMPT.to_vec();
            let mut pr = 1.0f64;
            for j in 0..LEN {
                let t = (cell / VS.pow((LEN - 1 - j) as u32)) % VS;
                let d = processed(cfg, &r.head(&r.hidden(&ctx)), &ctx, RowKind::Target);
                pr *= d.prob(t as u32) as f64;
                ctx.push(t as u32);
            }
            pr
        })
        .collect()
}

fn p_value<P: Proposer>(name: &str, proposer: P, nodes: usize) -> f64 {
    let cfg = stat_config();
    let mut g = Generator::new(stat_rnn().target(1 << 16).with_tree(32), proposer);
    let mut counts = vec![0u64; VS.pow(LEN as u32)];
    let (mut tree_steps, mut accepted) = (0, 0);
    for seed in 0..N {
        let params = GenerationParams::builder()
            .sampling(cfg.clone())
            .seed(seed)
            .max_new_tokens(LEN)
            .draft(DraftLength::Fixed(3))
            .tree(TreeDrafts::nodes(nodes))
            .build()
            .unwrap();
        let out = g.generate(&PROMPT, &params).unwrap();
        assert_eq!(out.tokens.len(), LEN);
        tree_steps += out.metrics.tree_steps;
        accepted += out.metrics.accepted;
        let cell = out.tokens.iter().fold(0usize, |a, &t| a * VS + t as usize);
        counts[cell] += 1;
    }
    let fit = chi_square(&counts, &exact(&cfg));
    println!(
        "{name}: p = {:.3e} (chi2 = {:.1}, df = {}, impossible = {}), {tree_steps} tree steps, \
         {accepted} accepted drafts",
        fit.p_value, fit.stat, fit.df, fit.impossible
    );
    assert!(
        accepted > N as usize,
        "{name}: the head was hardly accepted"
    );
    if nodes > 0 {
        assert!(
            tree_steps > N as usize / 2,
            "{name}: trees were not exercised"
        );
    }
    fit.p_value
}

fn stat_head(tree: bool) -> DraftModelProposer<ToyFeatureDraft> {
    let m = ToyFeatureDraft::new(stat_rnn().perturbed(0.4, 7), 1 << 16);
    let m = if tree { m.with_tree(32) } else { m };
    DraftModelProposer::new(m)
        .with_tree_config(DraftTreeConfig::default().with_beam(2).with_children(3))
        .unwrap()
}

#[test]
fn the_head_is_lossless_under_sampling() {
    for (name, nodes) in [("chain", 0), ("tree", 8)] {
        let p = p_value(
            &format!("feature head, {name}"),
            stat_head(nodes > 0),
            nodes,
        );
        assert!(p >= ALPHA, "feature head, {name}: p = {p:.2e} < alpha");
    }
}

/// Fault: the head's chain, sampled with the target's features, reported with the q of the same
/// head reading a zero feature at the root (and its own features after it).
struct WrongFeatureQ(DraftModelProposer<ToyFeatureDraft>);

impl Proposer for WrongFeatureQ {
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.0.begin(prompt)
    }
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.propose(req, draft)?;
        if draft.q.is_none() {
            return Ok(());
        }
        let head = stat_rnn().perturbed(0.4, 7);
        let mut feature = head.step(&[0.0; H], *req.context.last().unwrap());
        let mut prefix = req.context.to_vec();
        let mut q = Vec::new();
        for &t in &draft.tokens {
            let d = processed(req.config, &head.head(&feature), &prefix, RowKind::Draft);
            q.extend((0..VS as u32).map(|v| d.prob(v)));
            feature = head.step(&feature, t);
            prefix.push(t);
        }
        draft.q = Some(q);
        Ok(())
    }
}

#[test]
fn negative_control_q_from_the_wrong_features_is_rejected() {
    let p = p_value(
        "q from a zero root feature (negative control)",
        WrongFeatureQ(stat_head(false)),
        0,
    );
    assert!(
        p < ALPHA,
        "q from the wrong features was not detected: p = {p:.3}"
    );
}
