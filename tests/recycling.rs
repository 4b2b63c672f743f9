//! Token Recycling ([`TokenRecycling`]) in the decoding loop:
//! (1) the feedback path: at every step the proposer gets exactly the processed rows' top
//!     candidates, checked against a brute-force ranking of `ToyModel::logits(prefix)` along each
//!     row's path (penalties on, so the history matters), for chains and trees;
//! (2) greedy identity: with recycling drafts (chains and trees) the output equals plain greedy
//!     decoding token for token;
//! (3) losslessness under stochastic tree verification: the law of the first emitted tokens,
//!     with recycling trees verified by the real verifier and by the loop, equals plain sampling
//!     from the processed target (chi-square, `ALPHA = 1e-3`, fixed seeds), and the same test
//!     rejects two deliberately wrong sibling rules on the same trees (negative controls, the
//!     faults of `tests/tree_statistical.rs`);
//! (4) the table carries over across requests and warms (acceptance rises on a repeated
//!     prompt), and a saved table drafts exactly as the one it was saved from.

mod common;

use common::tree::{Fault, Instance, LawCalc, Models, QForm, Shape, StepRule, outcome_tokens};
use common::{Fit, Masking, chi_square, penalty_config};
use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions, TreeDrafts};
use speculative::propose::{RecyclingConfig, TokenRecycling};
use speculative::test_util::ToyModel;
use speculative::{
    Draft, DraftBlock, NoProposer, ProposeRequest, Proposer, Result, SamplingConfig, SiblingScheme,
    VerifiedRows, Verifier,
};

fn recycling(vocab: usize, top_k: usize) -> TokenRecycling {
    TokenRecycling::new(vocab, RecyclingConfig::default().with_top_k(top_k)).unwrap()
}

// ---------------------------------------------------------------------------------------------
// (1) The feedback path.
// ---------------------------------------------------------------------------------------------

/// One verify step as the proposer saw it.
#[derive(Debug, Clone)]
struct Seen {
    context: Vec<u32>,
    draft: Draft,
    inputs: Vec<u32>,
    parents: Vec<u32>,
    rows: Vec<Vec<u32>>,
    path: Vec<u32>,
    emitted: Vec<u32>,
}

/// Wraps [`TokenRecycling`] and records every proposal and every [`VerifiedRows`].
struct Recorder {
    inner: TokenRecycling,
    steps: Vec<Seen>,
    pending: Option<Seen>,
    /// The sequence so far, from `begin` and `observe`.
    ctx: Vec<u32>,
}

impl Recorder {
    fn new(inner: TokenRecycling) -> Self {
        Recorder {
            inner,
            steps: Vec::new(),
            pending: None,
            ctx: Vec::new(),
        }
    }

    fn start(&mut self, req: &ProposeRequest<'_>, draft: &Draft) {
        assert_eq!(req.context, &self.ctx[..]);
        self.pending = Some(self.seen(draft.clone()));
    }

    fn seen(&self, draft: Draft) -> Seen {
        Seen {
            context: self.ctx.clone(),
            draft,
            inputs: Vec::new(),
            parents: Vec::new(),
            rows: Vec::new(),
            path: Vec::new(),
            emitted: Vec::new(),
        }
    }
}

impl Proposer for Recorder {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose(req, draft)?;
        self.start(req, draft);
        Ok(())
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose_tree(req, draft)?;
        self.start(req, draft);
        Ok(())
    }
    fn row_candidates(&self) -> usize {
        self.inner.row_candidates()
    }
    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        // A step with no proposal (k = 0, e.g. the last token) has rows too.
        if self.pending.is_none() {
            self.pending = Some(self.seen(Draft::default()));
        }
        let s = self.pending.as_mut().expect("set above");
        s.inputs = rows.inputs.to_vec();
        s.parents = rows.parents.to_vec();
        s.rows = rows.candidates.iter().map(<[u32]>::to_vec).collect();
        s.path = rows.path.to_vec();
        self.inner.observe_rows(rows)
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        let mut s = self.pending.take().expect("observe_rows before observe");
        s.emitted = emitted.to_vec();
        self.ctx.extend_from_slice(emitted);
        assert!(accepted <= s.draft.len());
        self.steps.push(s);
        self.inner.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.ctx = prompt.to_vec();
        self.inner.begin(prompt)
    }
}

/// The `n` best ids after `seq` (whose first `prompt_len` tokens are the prompt) under
/// `penalty_config()`, written from the definitions: CTRL repetition over the whole sequence,
/// frequency and presence over the generated part, then the highest logits, ties to the lowest
/// id (temperature does not change the order).
fn brute_top(model: &ToyModel, seq: &[u32], prompt_len: usize, n: usize) -> Vec<u32> {
    let rep = Masking {
        repetition: 2.5,
        frequency: 0.0,
        presence: 0.0,
        bias: &[],
        banned: &[],
        allowed: None,
    };
    let freq = Masking {
        repetition: 1.0,
        frequency: 0.3,
        presence: 0.5,
        ..rep
    };
    let row = freq.apply(&rep.apply(&model.logits(seq), seq), &seq[prompt_len..]);
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    ids.truncate(n);
    ids
}

/// Runs the loop with a recorder and checks every step's rows against brute force.
fn check_feedback(sampling: SamplingConfig, tree_nodes: usize, seed: u64) -> usize {
    const V: usize = 12;
    const N: usize = 3;
    let model = ToyModel::markov(V, 2, 2.0, seed);
    let prompt: Vec<u32> = (0..6)
        .map(|i| ((i * 5 + seed as usize) % V) as u32)
        .collect();
    let params = GenerationParams::greedy(40)
        .to_builder()
        .sampling(sampling)
        .seed(seed)
        .build()
        .unwrap()
        .with_draft(DraftLength::Fixed(3))
        .with_tree(TreeDrafts::nodes(tree_nodes));
    let mut g = Generator::new(model.clone().with_tree(16), Recorder::new(recycling(V, N)));
    let out = g.generate(&prompt, &params).unwrap();
    let steps = &g.proposer().steps;
    assert_eq!(steps.len(), out.metrics.target_calls);
    let mut drafted_rows = 0;
    for (i, s) in steps.iter().enumerate() {
        let k = s.draft.len();
        // No EOS: every step has k + 1 rows, row 0's input the root, row j + 1's node j's.
        assert_eq!(s.rows.len(), k + 1, "step {i}");
        assert_eq!(s.inputs[0], *s.context.last().unwrap());
        assert_eq!(&s.inputs[1..], &s.draft.tokens[..]);
        let tree = !s.draft.parents.is_empty();
        assert_eq!(
            s.parents,
            if tree {
                s.draft.parents.clone()
            } else {
                vec![]
            }
        );
        let block = if tree {
            DraftBlock::tree(&s.draft.tokens, &s.draft.parents)
        } else {
            DraftBlock::chain(&s.draft.tokens)
        };
        let mut nodes = Vec::new();
        for (r, got) in s.rows.iter().enumerate() {
            let mut seq = s.context.clone();
            if r > 0 {
                block.path_to(r - 1, &mut nodes);
                seq.extend(nodes.iter().map(|&n| s.draft.tokens[n as usize]));
            }
            assert_eq!(
                got,
                &brute_top(&model, &seq, prompt.len(), N),
                "step {i} row {r}"
            );
        }
        // The accepted path's tokens open the emitted tokens.
        let path_tokens: Vec<u32> = s.path.iter().map(|&n| s.draft.tokens[n as usize]).collect();
        assert_eq!(&s.emitted[..path_tokens.len()], &path_tokens[..]);
        drafted_rows += k;
    }
    assert!(out.tokens.len() == 40);
    drafted_rows
}

#[test]
fn feedback_rows_are_the_processed_top_candidates() {
    let sampled = penalty_config();
    let greedy_pen = SamplingConfig::builder()
        .temperature(0.0)
        .repetition_penalty(2.5)
        .presence_penalty(0.5)
        .frequency_penalty(0.3)
        .build()
        .unwrap();
    for seed in 0..4 {
        for (cfg, what) in [(&sampled, "sampled"), (&greedy_pen, "greedy")] {
            let chains = check_feedback(cfg.clone(), 0, seed);
            let trees = check_feedback(cfg.clone(), 8, seed);
            // The table fills and the proposer drafts: rows of nodes were checked too.
            assert!(
                chains > 0 && trees > 0,
                "{what} seed {seed}: {chains} {trees}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (2) Greedy identity.
// ---------------------------------------------------------------------------------------------

#[test]
fn greedy_output_equals_plain_greedy() {
    let mut accepted = [0usize; 2];
    let mut tree_steps = 0;
    for seed in 0..12u64 {
        let vocab = 16;
        let order = 1 + (seed % 2) as usize;
        let model = ToyModel::markov(vocab, order, 3.0, seed);
        let prompt: Vec<u32> = (0..4 + seed as usize % 5)
            .map(|i| ((i * 7 + seed as usize * 3) % vocab) as u32)
            .collect();
        let eos = (seed % 3 == 0).then_some(5u32);
        let mut params = GenerationParams::greedy(60);
        if let Some(e) = eos {
            params = params
                .with_stop(StopConditions::default().with_eos(e))
                .unwrap();
        }
        let want = Generator::new(model.clone(), NoProposer)
            .generate(&prompt, &params)
            .unwrap()
            .tokens;
        for (i, nodes) in [0usize, 16].into_iter().enumerate() {
            let p = params
                .clone()
                .with_draft(DraftLength::Fixed(4))
                .with_tree(TreeDrafts::nodes(nodes));
            let mut g = Generator::new(model.clone().with_tree(16), recycling(vocab, 8));
            // Two requests with the same proposer: the second starts from a warm table.
            for _ in 0..2 {
                let out = g.generate(&prompt, &p).unwrap();
                assert_eq!(out.tokens, want, "seed {seed}, tree nodes {nodes}");
                tree_steps += out.metrics.tree_steps;
                accepted[i] += out.metrics.accepted;
            }
        }
    }
    assert!(accepted[0] > 0 && accepted[1] > 0, "{accepted:?}");
    assert!(tree_steps > 0);
}

// ---------------------------------------------------------------------------------------------
// (3) Losslessness under stochastic tree verification.
// ---------------------------------------------------------------------------------------------

/// Significance level of the statistical tests.
const ALPHA: f64 = 1e-3;
/// Vocabulary of the statistical toy target.
const SV: usize = 5;
/// The prompt of every generation.
const PROMPT: [u32; 4] = [1, 0, 2, 1];
/// Generations per fit.
const GENS: u64 = 40_000;

/// Who decides each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// The real verifier.
    Real,
    /// The test-local sibling rule with a deliberate fault (`common::tree`).
    Local(Fault),
}

fn models<'a>(
    cfg: &'a SamplingConfig,
    ctx: &'a [u32],
    target: &'a dyn Fn(&[u32]) -> Vec<f32>,
) -> Models<'a> {
    Models {
        cfg,
        vocab: SV,
        qv: SV,
        ctx,
        target,
        draft: target,
        eos: None,
        det: common::tree::DetChoice::Fixed,
        prompt_len: 0,
        suppress: &[],
        suppress_rows: 0,
    }
}

/// The exact laws of plain sampling for the first `1..=len` tokens after the prompt.
fn exact(model: &ToyModel, cfg: &SamplingConfig, len: usize) -> Vec<Vec<f64>> {
    let target = |s: &[u32]| model.logits(s);
    let m = models(cfg, &PROMPT, &target);
    let shape = Shape::default();
    let calc = LawCalc::new(&m, &shape);
    (1..=len).map(|l| calc.target(&[], l)).collect()
}

fn fits(counts: &[Vec<u64>], exact: Vec<Vec<f64>>) -> Vec<Fit> {
    counts
        .iter()
        .zip(exact)
        .map(|(c, e)| chi_square(c, &e))
        .collect()
}

fn count(counts: &mut [Vec<u64>], tokens: &[u32]) {
    for (l, c) in counts.iter_mut().enumerate() {
        c[tokens[..=l]
            .iter()
            .fold(0, |a, &x| a * (SV + 1) + x as usize)] += 1;
    }
}

/// `GENS` generations of `len` tokens driven here: recycling trees (8 nodes, depth 3, one
/// table carried across all generations and refreshed from the real verifier's rows) decided by
/// `rule`. Returns the fits of the first `1..=len` tokens and the mean drafted nodes per step.
fn driver_fits(cfg: &SamplingConfig, rule: Rule, len: usize, seed0: u64) -> (Vec<Fit>, f64) {
    let model = ToyModel::markov(SV, 2, 1.3, 11);
    let target = |s: &[u32]| model.logits(s);
    let mut rec = recycling(SV, 3);
    let mut verifier = Verifier::new();
    let mut counts: Vec<Vec<u64>> = (1..=len)
        .map(|l| vec![0u64; (SV + 1).pow(l as u32)])
        .collect();
    let mut draft = Draft::default();
    let (mut steps, mut nodes) = (0usize, 0usize);
    let mut nodes_buf = Vec::new();
    for seed in seed0..seed0 + GENS {
        let mut ctx = PROMPT.to_vec();
        while ctx.len() < PROMPT.len() + len {
            let req = ProposeRequest::new(&ctx, cfg, 3).max_nodes(8).seed(seed);
            rec.propose_tree(&req, &mut draft).unwrap();
            steps += 1;
            nodes += draft.len();
            let block = DraftBlock::tree(&draft.tokens, &draft.parents);
            let mut inst = Instance {
                vocab: SV,
                qv: SV,
                tokens: draft.tokens.clone(),
                parents: draft.parents.clone(),
                schemes: vec![SiblingScheme::Deterministic; draft.len()],
                ends: vec![false; draft.len()],
                target: model.logits(&ctx),
                q: Vec::new(),
                form: QForm::PointMass,
                paths: vec![Vec::new()],
                prompt_len: 0,
                suppress: Vec::new(),
                suppress_rows: 0,
            };
            for j in 0..draft.len() {
                block.path_to(j, &mut nodes_buf);
                let path: Vec<u32> = nodes_buf
                    .iter()
                    .map(|&n| draft.tokens[n as usize])
                    .collect();
                let mut seq = ctx.clone();
                seq.extend_from_slice(&path);
                inst.target.extend(model.logits(&seq));
                inst.paths.push(path);
            }
            let out = verifier
                .verify(
                    &inst
                        .request(cfg, &ctx, seed, &inst.schemes)
                        .row_top_k(rec.row_candidates()),
                )
                .unwrap();
            let mut inputs = vec![*ctx.last().unwrap()];
            inputs.extend_from_slice(&draft.tokens);
            rec.observe_rows(&VerifiedRows::new(
                &inputs,
                &draft.parents,
                &out.row_top,
                &out.path,
            ))
            .unwrap();
            let tokens = match rule {
                Rule::Real => out.tokens,
                Rule::Local(fault) => {
                    let m = models(cfg, &ctx, &target);
                    let r = StepRule {
                        models: &m,
                        inst: &inst,
                        fault,
                        wor_as_wr: false,
                    };
                    let o = r.sample(seed.wrapping_mul(0x9E37_79B9) ^ (ctx.len() as u64) << 48);
                    outcome_tokens(&inst, &o)
                }
            };
            ctx.extend(tokens);
        }
        count(&mut counts, &ctx[PROMPT.len()..PROMPT.len() + len]);
    }
    (
        fits(&counts, exact(&model, cfg, len)),
        nodes as f64 / steps as f64,
    )
}

/// The same through the loop: `Generator` with a toy target offering trees and one
/// `TokenRecycling` carried across all generations.
fn loop_fits(cfg: &SamplingConfig, len: usize, seed0: u64) -> (Vec<Fit>, f64) {
    let model = ToyModel::markov(SV, 2, 1.3, 11);
    let mut g = Generator::new(model.clone().with_tree(16), recycling(SV, 3));
    let mut counts: Vec<Vec<u64>> = (1..=len)
        .map(|l| vec![0u64; (SV + 1).pow(l as u32)])
        .collect();
    let (mut steps, mut nodes) = (0usize, 0usize);
    for seed in seed0..seed0 + GENS {
        let params = GenerationParams::greedy(len)
            .to_builder()
            .sampling(cfg.clone())
            .seed(seed)
            .build()
            .unwrap()
            .with_draft(DraftLength::Fixed(3))
            .with_tree(TreeDrafts::nodes(8));
        let out = g.generate(&PROMPT, &params).unwrap();
        steps += out.metrics.tree_steps;
        nodes += out.metrics.tree_nodes;
        count(&mut counts, &out.tokens);
    }
    (
        fits(&counts, exact(&model, cfg, len)),
        nodes as f64 / steps.max(1) as f64,
    )
}

fn show(name: &str, fits: &[Fit], mean_nodes: f64) {
    for (l, f) in fits.iter().enumerate() {
        println!(
            "{name}: first {}: p = {:.3e} (chi2 = {:.1}, df = {}, impossible = {}), {mean_nodes:.2} nodes/step",
            l + 1,
            f.p_value,
            f.stat,
            f.df,
            f.impossible
        );
    }
}

fn filtered() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(0.8)
        .top_k(4)
        .top_p(0.95)
        .build()
        .unwrap()
}

#[test]
fn recycling_trees_are_lossless_under_sampling() {
    let configs = [
        ("plain", SamplingConfig::sampling(1.0).unwrap()),
        ("top-k/top-p", filtered()),
    ];
    for (i, (name, cfg)) in configs.iter().enumerate() {
        let seed0 = 1_000_000 + i as u64 * GENS;
        let (f, nodes) = driver_fits(cfg, Rule::Real, 3, seed0);
        show(&format!("verifier {name}"), &f, nodes);
        assert!(nodes > 3.0, "the trees branch: {nodes}");
        assert!(f.iter().all(|f| f.p_value >= ALPHA), "{name}: {f:?}");
        let (f, nodes) = loop_fits(cfg, 3, seed0 + 10 * GENS);
        show(&format!("loop {name}"), &f, nodes);
        assert!(nodes > 3.0, "the trees branch: {nodes}");
        assert!(f.iter().all(|f| f.p_value >= ALPHA), "{name}: {f:?}");
    }
}

/// Negative controls: the same drafts and the same test, decided by a wrong sibling rule,
/// must be rejected.
#[test]
fn recycling_negative_controls_are_rejected() {
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    for (j, fault) in [Fault::NoResidualUpdate, Fault::Independent]
        .into_iter()
        .enumerate()
    {
        let (f, nodes) = driver_fits(&cfg, Rule::Local(fault), 3, 5_000_000 + j as u64 * GENS);
        show(&format!("{fault:?} (negative control)"), &f, nodes);
        let last = f.last().unwrap();
        assert!(last.p_value < ALPHA, "{fault:?} was not rejected: {last:?}");
    }
    // The local sampler without a fault passes: the controls fail because of the fault.
    let (f, nodes) = driver_fits(&cfg, Rule::Local(Fault::None), 3, 7_000_000);
    show("local rule without fault", &f, nodes);
    assert!(f.iter().all(|f| f.p_value >= ALPHA), "{f:?}");
}

// ---------------------------------------------------------------------------------------------
// (4) The table carries over across requests.
// ---------------------------------------------------------------------------------------------

#[test]
fn table_carries_over_and_warms() {
    for seed in 0..4u64 {
        let vocab = 32;
        let model = ToyModel::markov(vocab, 1, 3.0, seed + 100);
        let prompt: Vec<u32> = (0..6)
            .map(|i| ((i * 11 + seed as usize) % vocab) as u32)
            .collect();
        for nodes in [0usize, 12] {
            let params = GenerationParams::greedy(48)
                .with_draft(DraftLength::Fixed(4))
                .with_tree(TreeDrafts::nodes(nodes));
            let mut g = Generator::new(model.clone().with_tree(16), recycling(vocab, 4));
            let first = g.generate(&prompt, &params).unwrap();
            let filled = g.proposer().filled_rows();
            assert!(filled > 0);
            let second = g.generate(&prompt, &params).unwrap();
            assert_eq!(first.tokens, second.tokens);
            assert!(g.proposer().filled_rows() >= filled, "begin kept the table");
            let (m1, m2) = (&first.metrics, &second.metrics);
            assert!(
                m2.accepted > m1.accepted && m2.target_calls < m1.target_calls,
                "seed {seed} nodes {nodes}: accepted {} -> {}, calls {} -> {}",
                m1.accepted,
                m2.accepted,
                m1.target_calls,
                m2.target_calls
            );
            // A saved copy of the warm table drafts exactly as the table it was saved from.
            let mut bytes = Vec::new();
            g.proposer().write_to(&mut bytes).unwrap();
            let mut loaded = recycling(vocab, 4);
            loaded.read_from(&mut &bytes[..]).unwrap();
            let third = g.generate(&prompt, &params).unwrap();
            let mut g2 = Generator::new(model.clone().with_tree(16), loaded);
            let copy = g2.generate(&prompt, &params).unwrap();
            assert_eq!(copy.tokens, third.tokens);
            assert_eq!(
                (copy.metrics.accepted, copy.metrics.target_calls),
                (third.metrics.accepted, third.metrics.target_calls)
            );
            // Cleared, it starts cold again.
            g.proposer_mut().clear();
            let cold = g.generate(&prompt, &params).unwrap();
            assert_eq!(cold.metrics.accepted, m1.accepted);
        }
    }
}
