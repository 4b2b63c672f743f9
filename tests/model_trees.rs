//! Model-based token trees in the decoding loop: draft-model trees (EAGLE-2 style) and heads
//! trees (Medusa style).
//!
//! - **Greedy identity**: the output of [`Generator`] with tree drafts equals plain greedy
//!   decoding ([`NoProposer`]) token for token, on toy targets with tree support.
//! - **Losslessness under sampling**: vocab 5, 3 new tokens, so the 125 possible outputs are
//!   enumerable and their exact probabilities are products of processed target conditionals
//!   (penalties over the prompt and the generated tokens, as the loop counts them). `N` seeded
//!   generations (seed = run index) per configuration; Pearson's chi-square
//!   (`common::chi_square`, cells with expected count < 5 pooled; a probability-0 output gives
//!   p = 0). Significance `ALPHA = 1e-3`: a positive test passes when p >= ALPHA, a negative
//!   control when p < ALPHA. Seeds are fixed, so every outcome is deterministic.
//! - **Negative controls** (the same trees, one rule broken; each must be rejected):
//!   (a) draft-model trees whose drawn siblings are pruned by their q value (the lowest-q
//!   sibling of every group of two or more is dropped with its subtree): the number of
//!   siblings kept depends on the siblings' own values, and the rest is no longer a sample
//!   without replacement of q;
//!   (b) heads trees whose top-k candidates are labelled [`SiblingScheme::WithoutReplacement`]
//!   with the heads' dense q: deterministic candidates verified as if they were samples.

mod common;

use common::chi_square;
use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions, TreeDrafts};
use speculative::propose::{
    DraftHeads, DraftModelProposer, DraftTreeConfig, HeadsInput, HeadsProposer,
};
use speculative::sampling::{History, RowProcessor, TokenCounts, TokenDist};
use speculative::test_util::{LogitsFn, ToyModel};
use speculative::{
    Draft, DraftBlock, HiddenStates, NoProposer, ProposeRequest, Proposer, Result, RowKind,
    SamplingConfig, SiblingScheme, TargetModel, TreeTarget,
};

const ALPHA: f64 = 1e-3;

// ---------------------------------------------------------------------------------------------
// Models

/// A target with tree support over `vocab` tokens.
fn target(vocab: usize, seed: u64) -> ToyModel {
    ToyModel::markov(vocab, 2, 1.6, seed).with_tree(32)
}

/// A draft model with tree support: the target's logits plus independent noise of scale
/// `noise` (so that its best guesses are often, not always, the target's).
fn noisy_draft(vocab: usize, seed: u64, noise: f32) -> ToyModel {
    let t = ToyModel::markov(vocab, 2, 1.6, seed);
    let n = ToyModel::markov(vocab, 2, noise, seed ^ 0xD0_5E);
    let f: LogitsFn = std::sync::Arc::new(move |p: &[u32]| {
        t.logits(p)
            .iter()
            .zip(n.logits(p))
            .map(|(a, b)| a + b)
            .collect()
    });
    ToyModel::new(vocab, 1 << 20, f).with_tree(32)
}

/// A target with tree support that exposes a one-wide hidden state per appended row: the row's
/// input token (prefill, forward and tree forward alike).
struct WithHidden {
    inner: ToyModel,
    hidden: Vec<f32>,
}

impl WithHidden {
    fn new(inner: ToyModel) -> Self {
        WithHidden {
            inner,
            hidden: Vec::new(),
        }
    }
}

impl TargetModel for WithHidden {
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
        self.hidden = tokens.iter().map(|&t| t as f32).collect();
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.inner.truncate(len)
    }
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        Some(self)
    }
    fn hidden_states(&self) -> Option<&dyn HiddenStates> {
        Some(self)
    }
}

impl TreeTarget for WithHidden {
    fn max_tree_nodes(&self) -> usize {
        32
    }
    fn forward_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let tree = self.inner.tree().expect("the inner toy has tree support");
        tree.forward_tree(root, block, logits)?;
        self.hidden = std::iter::once(root)
            .chain(block.tokens().iter().copied())
            .map(|t| t as f32)
            .collect();
        Ok(())
    }
    fn commit_tree(&mut self, path: &[u32]) -> Result<()> {
        self.inner.tree().unwrap().commit_tree(path)
    }
}

impl HiddenStates for WithHidden {
    fn hidden_size(&self) -> usize {
        1
    }
    fn last_hidden(&self) -> Option<&[f32]> {
        Some(&self.hidden)
    }
}

/// Heads for an order-2 Markov target: head `j` rolls the target's greedy chain from the last
/// two tokens (the hidden state's input token and the last token) and returns the target's
/// logits at that chain position plus noise, so the top candidate is often the target's choice
/// and the second or third often when it is not.
struct MarkovHeads {
    target: ToyModel,
    noise: ToyModel,
    heads: usize,
}

impl MarkovHeads {
    fn new(vocab: usize, target_seed: u64, noise: f32, heads: usize) -> Self {
        MarkovHeads {
            target: ToyModel::markov(vocab, 2, 1.6, target_seed),
            noise: ToyModel::markov(vocab, 2, noise, target_seed ^ 0x4EAD),
            heads,
        }
    }
}

impl DraftHeads for MarkovHeads {
    fn num_heads(&self) -> usize {
        self.heads
    }
    fn vocab_size(&self) -> usize {
        self.target.vocab_size()
    }
    fn hidden_size(&self) -> usize {
        1
    }
    fn logits(&mut self, input: &HeadsInput<'_>, n: usize, logits: &mut Vec<f32>) -> Result<()> {
        logits.clear();
        let mut seq = vec![input.hidden[0] as u32, input.last_token];
        for j in 0..n {
            let l = self.target.logits(&seq);
            let e = self.noise.logits(&[seq[seq.len() - 1], j as u32]);
            let row: Vec<f32> = l.iter().zip(&e).map(|(a, b)| a + b).collect();
            let best = (0..row.len())
                .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
                .unwrap() as u32;
            logits.extend_from_slice(&row);
            seq.push(best);
        }
        Ok(())
    }
}

fn plain_greedy(t: ToyModel, prompt: &[u32], params: &GenerationParams) -> Vec<u32> {
    let plain = params
        .clone()
        .with_draft(DraftLength::Off)
        .with_tree(TreeDrafts::nodes(0));
    let mut g = Generator::new(t, NoProposer);
    g.generate(prompt, &plain).unwrap().tokens
}

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|i| (0..5 + i).map(|j| (j * 7 + i * 3) % vocab).collect())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Greedy identity

#[test]
fn draft_model_trees_give_plain_greedy_output() {
    const V: usize = 16;
    let mut tree_steps = 0;
    let (mut emitted, mut calls) = (0, 0);
    for (seed, prompt) in prompts(V as u32).into_iter().enumerate() {
        let seed = seed as u64 + 1;
        for (nodes, branch, eos) in [(12, 0, None), (16, 2, None), (10, 0, Some(3u32))] {
            let mut params = GenerationParams::greedy(40)
                .with_draft(DraftLength::Fixed(4))
                .with_tree(TreeDrafts::nodes(nodes).with_branch(branch));
            if let Some(e) = eos {
                params = params.with_stop(StopConditions::eos(e)).unwrap();
            }
            let want = plain_greedy(target(V, seed), &prompt, &params);
            let draft = DraftModelProposer::new(noisy_draft(V, seed, 1.2))
                .with_tree_config(DraftTreeConfig::default().with_beam(3).with_children(3))
                .unwrap();
            let mut g = Generator::new(target(V, seed), draft);
            let out = g.generate(&prompt, &params).unwrap();
            assert_eq!(
                out.tokens, want,
                "seed {seed}, nodes {nodes}, branch {branch}"
            );
            tree_steps += out.metrics.tree_steps;
            emitted += out.metrics.emitted;
            calls += out.metrics.target_calls;
        }
    }
    println!(
        "draft-model trees: {tree_steps} tree steps, {:.2} tokens per target call",
        emitted as f64 / calls as f64
    );
    assert!(tree_steps > 50, "trees were not exercised: {tree_steps}");
    assert!(emitted as f64 / calls as f64 > 1.5);
}

#[test]
fn draft_model_trees_beat_chains_of_the_same_depth_in_accepted_length() {
    // Not a speed claim: more nodes per step must accept at least as much on average here.
    const V: usize = 16;
    let (mut tree, mut chain) = ((0, 0), (0, 0));
    for (seed, prompt) in prompts(V as u32).into_iter().enumerate() {
        let seed = seed as u64 + 1;
        for (nodes, acc) in [(16, &mut tree), (0, &mut chain)] {
            let params = GenerationParams::greedy(40)
                .with_draft(DraftLength::Fixed(4))
                .with_tree(TreeDrafts::nodes(nodes));
            let mut g = Generator::new(
                target(V, seed),
                DraftModelProposer::new(noisy_draft(V, seed, 1.2)),
            );
            let out = g.generate(&prompt, &params).unwrap();
            acc.0 += out.metrics.emitted;
            acc.1 += out.metrics.target_calls;
        }
    }
    let (t, c) = (
        tree.0 as f64 / tree.1 as f64,
        chain.0 as f64 / chain.1 as f64,
    );
    println!("mean accepted length: tree {t:.2}, chain {c:.2}");
    assert!(t > c, "tree {t:.2} <= chain {c:.2}");
}

#[test]
fn heads_trees_give_plain_greedy_output() {
    const V: usize = 16;
    let mut tree_steps = 0;
    for (seed, prompt) in prompts(V as u32).into_iter().enumerate() {
        let seed = seed as u64 + 1;
        for (nodes, branch) in [(12, 0), (16, 3), (6, 2)] {
            let params = GenerationParams::greedy(40)
                .with_draft(DraftLength::Fixed(4))
                .with_tree(TreeDrafts::nodes(nodes).with_branch(branch));
            let want = plain_greedy(target(V, seed), &prompt, &params);
            let heads = HeadsProposer::new(MarkovHeads::new(V, seed, 1.5, 4))
                .with_tree_top_k(3)
                .unwrap();
            let mut g = Generator::new(WithHidden::new(target(V, seed)), heads);
            let out = g.generate(&prompt, &params).unwrap();
            assert_eq!(
                out.tokens, want,
                "seed {seed}, nodes {nodes}, branch {branch}"
            );
            tree_steps += out.metrics.tree_steps;
        }
    }
    assert!(tree_steps > 50, "trees were not exercised: {tree_steps}");
}

// ---------------------------------------------------------------------------------------------
// Losslessness under sampling

const VS: usize = 5;
const LEN: usize = 3;
const N: u64 = 12_000;
const PROMPT: [u32; 6] = [0, 1, 2, 3, 4, 1];
const TARGET_SEED: u64 = 11;

/// Exact processed conditional of the statistical target after `prefix`.
fn conditional(cfg: &SamplingConfig, prefix: &[u32]) -> TokenDist {
    let logits = target(VS, TARGET_SEED).logits(prefix);
    let counts = TokenCounts::from_context(prefix, PROMPT.len(), VS).unwrap();
    let mut d = TokenDist::default();
    let hist = History {
        counts: Some(&counts),
        prefix,
        suppress: &[],
    };
    RowProcessor::new()
        .distribution(cfg, &logits, &hist, RowKind::Target, 0, &mut d)
        .unwrap();
    d
}

/// Exact law of the first `LEN` generated tokens (`[VS^LEN]`, first token most significant).
fn exact(cfg: &SamplingConfig) -> Vec<f64> {
    (0..VS.pow(LEN as u32))
        .map(|cell| {
            let mut ctx = PROMPT.to_vec();
            let mut pr = 1.0f64;
            for j in 0..LEN {
                let t = (cell / VS.pow((LEN - 1 - j) as u32)) % VS;
                pr *= conditional(cfg, &ctx).prob(t as u32) as f64;
                ctx.push(t as u32);
            }
            pr
        })
        .collect()
}

fn sampling_configs() -> Vec<(&'static str, SamplingConfig)> {
    vec![
        (
            "t=1 top_k=4 repetition=1.4 presence=0.3",
            SamplingConfig::builder()
                .temperature(1.0)
                .top_k(4)
                .repetition_penalty(1.4)
                .presence_penalty(0.3)
                .build()
                .unwrap(),
        ),
        (
            "t=0.9 frequency=0.4",
            SamplingConfig::builder()
                .temperature(0.9)
                .frequency_penalty(0.4)
                .build()
                .unwrap(),
        ),
    ]
}

/// Counts of the generated sequences over `N` seeds, and the number of branching tree steps.
fn sequence_counts<T: TargetModel, P: Proposer>(
    g: &mut Generator<T, P>,
    cfg: &SamplingConfig,
) -> (Vec<u64>, usize) {
    let mut counts = vec![0u64; VS.pow(LEN as u32)];
    let mut tree_steps = 0;
    for seed in 0..N {
        let params = GenerationParams::builder()
            .sampling(cfg.clone())
            .seed(seed)
            .max_new_tokens(LEN)
            .draft(DraftLength::Fixed(3))
            .tree(TreeDrafts::nodes(8))
            .build()
            .unwrap();
        let out = g.generate(&PROMPT, &params).unwrap();
        assert_eq!(out.tokens.len(), LEN);
        tree_steps += out.metrics.tree_steps;
        let cell = out.tokens.iter().fold(0usize, |a, &t| a * VS + t as usize);
        counts[cell] += 1;
    }
    (counts, tree_steps)
}

/// p-value of the sequences `g` generates under `cfg` against the exact law.
fn p_value<T: TargetModel, P: Proposer>(
    name: &str,
    g: &mut Generator<T, P>,
    cfg: &SamplingConfig,
) -> f64 {
    let (counts, tree_steps) = sequence_counts(g, cfg);
    let fit = chi_square(&counts, &exact(cfg));
    println!(
        "{name}: p = {:.3e} (chi2 = {:.1}, df = {}, impossible = {}), {tree_steps} tree steps",
        fit.p_value, fit.stat, fit.df, fit.impossible
    );
    assert!(
        tree_steps > N as usize / 2,
        "{name}: trees were not exercised"
    );
    fit.p_value
}

fn tree_draft() -> DraftModelProposer<ToyModel> {
    DraftModelProposer::new(ToyModel::markov(VS, 2, 1.6, 23).with_tree(32))
        .with_tree_config(DraftTreeConfig::default().with_beam(2).with_children(3))
        .unwrap()
}

#[test]
fn draft_model_trees_are_lossless_under_sampling() {
    for (name, cfg) in sampling_configs() {
        let mut g = Generator::new(target(VS, TARGET_SEED), tree_draft());
        let p = p_value(&format!("draft-model tree, {name}"), &mut g, &cfg);
        assert!(p >= ALPHA, "draft-model tree, {name}: p = {p:.2e} < alpha");
    }
}

/// Fault (a): the draft model's tree with the lowest-q sibling of every group of two or more
/// dropped, subtree included (siblings pruned by their own values).
struct PruneBySiblingQ(DraftModelProposer<ToyModel>);

impl Proposer for PruneBySiblingQ {
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.0.begin(prompt)
    }
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.propose(req, draft)
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.propose_tree(req, draft)?;
        if draft.parents.is_empty() {
            return Ok(());
        }
        let (n, qv) = (draft.len(), draft.q_vocab);
        let q = draft.q.clone().expect("sampled tree");
        let qx = |i: usize| q[i * qv + draft.tokens[i] as usize];
        let mut drop = vec![false; n];
        for row in 0..=n {
            let kids: Vec<usize> = draft.block().children(row).collect();
            if kids.len() >= 2 {
                let worst = *kids
                    .iter()
                    .min_by(|&&a, &&b| qx(a).total_cmp(&qx(b)))
                    .unwrap();
                drop[worst] = true;
            }
        }
        for i in 0..n {
            let r = draft.parents[i] as usize;
            if r > 0 && drop[r - 1] {
                drop[i] = true;
            }
        }
        let mut out = Draft::default();
        out.q_vocab = qv;
        let mut newq = Vec::new();
        let mut map = vec![0u32; n];
        for i in (0..n).filter(|&i| !drop[i]) {
            map[i] = out.tokens.len() as u32;
            let r = draft.parents[i] as usize;
            out.parents.push(if r == 0 { 0 } else { map[r - 1] + 1 });
            out.tokens.push(draft.tokens[i]);
            out.schemes.push(draft.schemes[i]);
            newq.extend_from_slice(&q[i * qv..(i + 1) * qv]);
        }
        out.q = Some(newq);
        *draft = out;
        Ok(())
    }
}

#[test]
fn negative_control_siblings_pruned_by_q_are_rejected() {
    let (name, cfg) = &sampling_configs()[0];
    let mut g = Generator::new(target(VS, TARGET_SEED), PruneBySiblingQ(tree_draft()));
    let p = p_value(
        &format!("(a) siblings pruned by q, {name} (negative control)"),
        &mut g,
        cfg,
    );
    assert!(
        p < ALPHA,
        "pruning drawn siblings by q was not detected: p = {p:.3}"
    );
}

/// Heads over 5 tokens for the statistical target, with a one-wide hidden state.
struct SynthHeads;
impl DraftHeads for SynthHeads {
    fn num_heads(&self) -> usize {
        3
    }
    fn vocab_size(&self) -> usize {
        VS
    }
    fn hidden_size(&self) -> usize {
        1
    }
    fn logits(&mut self, input: &HeadsInput<'_>, n: usize, logits: &mut Vec<f32>) -> Result<()> {
        logits.clear();
        let h = input.hidden[0] as usize;
        for j in 0..n {
            for v in 0..VS {
                let x = (h * 3 + input.last_token as usize * 2 + j * 5 + v * 7) % 5;
                logits.push(x as f32 * 0.6);
            }
        }
        Ok(())
    }
}

fn heads() -> HeadsProposer<SynthHeads> {
    HeadsProposer::new(SynthHeads).with_tree_top_k(3).unwrap()
}

#[test]
fn heads_trees_are_lossless_under_sampling() {
    for (name, cfg) in sampling_configs() {
        let mut g = Generator::new(WithHidden::new(target(VS, TARGET_SEED)), heads());
        let p = p_value(&format!("heads tree, {name}"), &mut g, &cfg);
        assert!(p >= ALPHA, "heads tree, {name}: p = {p:.2e} < alpha");
    }
}

/// Fault (b): the heads tree's top-k candidates labelled as samples drawn without replacement,
/// with the processed head row as every node's q.
struct HeadsAsSamples(HeadsProposer<SynthHeads>);

impl Proposer for HeadsAsSamples {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.propose(req, draft)
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.propose_tree(req, draft)?;
        if draft.parents.is_empty() {
            return Ok(());
        }
        let hidden = req.target_hidden.unwrap();
        let input = HeadsInput::new(hidden, *req.context.last().unwrap(), req.context.len());
        let mut rows = Vec::new();
        SynthHeads.logits(&input, 3, &mut rows)?;
        let mut depths = Vec::new();
        draft.block().depths(&mut depths);
        let mut q = Vec::new();
        let mut path = Vec::new();
        for (i, &depth) in depths.iter().enumerate() {
            // The head row of the node's group, processed along the group's path.
            let d = depth as usize - 1;
            let r = draft.parents[i] as usize;
            let mut prefix = req.context.to_vec();
            if r > 0 {
                draft.block().path_to(r - 1, &mut path);
                prefix.extend(path.iter().map(|&j| draft.tokens[j as usize]));
            }
            let counts = TokenCounts::from_context(&prefix, req.prompt_len, VS)?;
            let hist = History {
                counts: Some(&counts),
                prefix: &prefix,
                suppress: &[],
            };
            let mut dist = TokenDist::default();
            RowProcessor::new().distribution(
                req.config,
                &rows[d * VS..(d + 1) * VS],
                &hist,
                RowKind::Draft,
                d,
                &mut dist,
            )?;
            q.extend((0..VS as u32).map(|v| dist.prob(v)));
        }
        draft.q = Some(q);
        draft.q_vocab = VS;
        draft.schemes = vec![SiblingScheme::WithoutReplacement; draft.len()];
        Ok(())
    }
}

#[test]
fn negative_control_heads_candidates_labelled_as_samples_are_rejected() {
    let (name, cfg) = &sampling_configs()[0];
    let mut g = Generator::new(
        WithHidden::new(target(VS, TARGET_SEED)),
        HeadsAsSamples(heads()),
    );
    let p = p_value(
        &format!("(b) heads top-k as samples, {name} (negative control)"),
        &mut g,
        cfg,
    );
    assert!(
        p < ALPHA,
        "top-k candidates labelled as samples were not detected: p = {p:.3}"
    );
}
