//! The merged-tree proposer ([`MergedProposer`]) in the decoding loop: greedy output identical
//! to plain greedy decoding (trees and chains, many prompts), seeded sampling identical to plain
//! sampling (case C15), losslessness under stochastic tree verification (a sequence-distribution
//! test with a negative control), and the learned ranking keeping the proposer that is right.
//!
//! **Distribution test.** A toy target (a random order-2 Markov model over 5 tokens) generates
//! 3 tokens after a fixed prompt through [`Generator`] with a merge of prompt lookup, suffix
//! and random proposers (trees of up to 8 nodes, depth 3), one seed per generation. The
//! empirical law of the 3 tokens (and of the first 1 and 2) is compared with the exact law of
//! plain sampling from the processed target (`common::tree::LawCalc`) by Pearson's chi-square
//! (`common::chi_square`: cells with expected count < 5 pooled). `ALPHA = 1e-3`: the positive
//! test fails when any p-value is below it; the negative control passes only when the p-value
//! of the 3-token law is below it. Seeds are fixed, so the outcome is deterministic; p-values are
//! printed with `--nocapture`.
//!
//! **Negative control**: the same merged trees, verified as if they kept a draft model's q:
//! every node carries the processed distribution of a second toy model after its parent's path
//! and the scheme `WithReplacement`, so the verifier applies `min(1, p / q)` to candidates that
//! were never sampled from q. That is why the merge drops q; the test must reject it.

mod common;

use common::tree::{DetChoice, LawCalc, Models, Shape};
use common::{Fit, chi_square};
use speculative::decode::{DraftLength, GenerationParams, Generator, TreeDrafts};
use speculative::propose::{FixedMergeCosts, MergePolicy, SuffixConfig, SuffixProposer};
use speculative::test_util::{RandomProposer, ToyModel, WrongProposer};
use std::sync::{Arc, Mutex};

use speculative::{
    Draft, MergedProposer, NoProposer, PromptLookup, ProposeRequest, Proposer, Result,
    SamplingConfig, SiblingScheme,
};

/// Significance level of the distribution tests.
const ALPHA: f64 = 1e-3;

fn lookup() -> Box<dyn Proposer + Send> {
    Box::new(PromptLookup::new(1, 3).unwrap())
}

fn suffix() -> Box<dyn Proposer + Send> {
    Box::new(SuffixProposer::new(SuffixConfig::default()).unwrap())
}

fn random(vocab: usize, salt: u64) -> Box<dyn Proposer + Send> {
    Box::new(RandomProposer::new(vocab, salt))
}

/// Prompt lookup + suffix (+ random junk when `junk`), cost-aware with fixed costs (a step
/// 10 ms plus 0.5 ms per row, the junk 2 ms per call plus 1 ms per token): deterministic.
fn merge(vocab: usize, salt: u64, junk: bool) -> MergedProposer {
    let mut subs = vec![lookup(), suffix()];
    if junk {
        subs.push(random(vocab, salt));
    }
    let costs = FixedMergeCosts::new(0.010, 0.0005)
        .unwrap()
        .with_member(2, 0.002, 0.001)
        .unwrap();
    MergedProposer::new(subs).unwrap().with_costs(costs)
}

/// The same members under the rule before the cost-aware one (every member asked, the budget
/// filled): branching trees at most steps.
fn merge_reach(vocab: usize, salt: u64, junk: bool) -> MergedProposer {
    merge(vocab, salt, junk).with_policy(MergePolicy::Reach)
}

fn plain(model: &ToyModel, prompt: &[u32], params: &GenerationParams) -> Vec<u32> {
    let params = params
        .clone()
        .with_draft(DraftLength::Off)
        .with_tree(TreeDrafts::nodes(0));
    Generator::new(model.clone(), NoProposer)
        .generate(prompt, &params)
        .unwrap()
        .tokens
}

/// Small deterministic generator for prompts.
fn prompt(seed: u64, vocab: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let len = 4 + (seed % 13) as usize;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % u64::from(vocab)) as u32
        })
        .collect()
}

/// (draft length, tree nodes, branching limit): trees, a tight tree, chains.
const SHAPES: [(usize, usize, usize); 5] =
    [(4, 8, 0), (6, 16, 2), (8, 32, 0), (3, 3, 0), (5, 0, 0)];

#[test]
fn greedy_merged_output_equals_plain_greedy() {
    let vocab = 8;
    let (mut steps, mut accepted, mut tree_steps) = (0, 0, 0);
    for model_seed in 0..3u64 {
        // A peaked model: greedy text falls into loops, so copies get accepted.
        let model = ToyModel::markov(vocab, 2, 3.0, model_seed);
        for (s, &(k, nodes, branch)) in SHAPES.iter().enumerate() {
            for junk in [false, true] {
                // One generator per setting: the suffix corpus and the rates carry over.
                let mut g =
                    Generator::new(model.clone().with_tree(32), merge(vocab, model_seed, junk));
                for p in 0..5u64 {
                    let prompt = prompt(100 * model_seed + 10 * s as u64 + p, vocab as u32);
                    let params = GenerationParams::greedy(40)
                        .with_draft(DraftLength::Fixed(k))
                        .with_tree(TreeDrafts::nodes(nodes).with_branch(branch));
                    let want = plain(&model, &prompt, &params);
                    let out = g.generate(&prompt, &params).unwrap();
                    assert_eq!(
                        out.tokens, want,
                        "model {model_seed} shape {k}/{nodes}/{branch} junk {junk} prompt {prompt:?}"
                    );
                    let m = &out.metrics;
                    steps += m.target_calls;
                    accepted += m.accepted;
                    tree_steps += m.tree_steps;
                    if nodes > 0 {
                        assert!(m.tree_nodes <= nodes * m.tree_steps);
                    } else {
                        assert_eq!(m.tree_steps, 0);
                    }
                }
            }
        }
    }
    // The merges drafted something that was accepted, in trees.
    assert!(tree_steps > 100, "{tree_steps}");
    assert!(accepted > steps / 2, "accepted {accepted} in {steps} steps");
}

#[test]
fn seeded_sampling_with_merged_trees_reproduces_plain_sampling() {
    // C15: point-mass drafts, so the emitted tokens are those of plain sampling with the seed.
    let cfg = SamplingConfig::builder()
        .temperature(0.8)
        .top_k(5)
        .top_p(0.95)
        .build()
        .unwrap();
    let vocab = 6;
    let model = ToyModel::markov(vocab, 2, 2.5, 4);
    let mut g = Generator::new(model.clone().with_tree(16), merge(vocab, 9, true));
    let mut tree_steps = 0;
    for seed in 0..24u64 {
        let (k, nodes, branch) = SHAPES[seed as usize % SHAPES.len()];
        let prompt = prompt(seed, vocab as u32);
        let params = GenerationParams::sampled(cfg.clone(), seed, 32)
            .with_draft(DraftLength::Fixed(k))
            .with_tree(TreeDrafts::nodes(nodes).with_branch(branch));
        let want = plain(&model, &prompt, &params);
        let out = g.generate(&prompt, &params).unwrap();
        assert_eq!(out.tokens, want, "seed {seed}");
        tree_steps += out.metrics.tree_steps;
    }
    assert!(tree_steps > 50, "{tree_steps}");
}

// ---------------------------------------------------------------------------------------------
// Sequence distribution.

/// The prompt of every generation of the distribution test.
const PROMPT: [u32; 6] = [1, 0, 2, 1, 0, 3];
/// Vocabulary of the distribution test.
const V: usize = 5;

/// Wraps the merge and attaches the processed distribution of `draft` after each node's parent
/// path as its q, with the scheme `WithReplacement` (the negative control).
struct KeepQ {
    inner: MergedProposer,
    draft: ToyModel,
}

impl KeepQ {
    fn attach(&self, req: &ProposeRequest<'_>, draft: &mut Draft) {
        let n = draft.len();
        let block_parents: Vec<u32> = if draft.parents.is_empty() {
            (0..n as u32).collect()
        } else {
            draft.parents.clone()
        };
        let mut q = Vec::with_capacity(n * V);
        for &row in &block_parents {
            // The parent's path: context + tokens of the ancestors of row.
            let mut path = Vec::new();
            let mut r = row as usize;
            while r > 0 {
                path.push(draft.tokens[r - 1]);
                r = block_parents[r - 1] as usize;
            }
            path.reverse();
            let mut seq = req.context.to_vec();
            seq.extend_from_slice(&path);
            let logits = self.draft.logits(&seq);
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
            let s: f32 = e.iter().sum();
            q.extend(e.iter().map(|x| x / s));
        }
        draft.q = Some(q);
        draft.q_vocab = V;
        if !draft.parents.is_empty() {
            draft.schemes = vec![SiblingScheme::WithReplacement; n];
        }
    }
}

impl Proposer for KeepQ {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose(req, draft)?;
        self.attach(req, draft);
        Ok(())
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose_tree(req, draft)?;
        self.attach(req, draft);
        Ok(())
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.inner.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.inner.begin(prompt)
    }
    fn finish(&mut self, sequence: &[u32]) {
        self.inner.finish(sequence)
    }
}

/// Runs `n` generations of 3 tokens (seeds `seed0..`) with `proposer`; the fits of the first
/// 1, 2 and 3 tokens against plain sampling from the processed target.
fn fit<P: Proposer>(cfg: &SamplingConfig, proposer: P, n: u64, seed0: u64) -> (Vec<Fit>, usize) {
    let len = 3;
    let target = ToyModel::markov(V, 2, 1.3, 11);
    let mut g = Generator::new(target.clone().with_tree(8), proposer);
    let mut counts: Vec<Vec<u64>> = (1..=len).map(|l| vec![0u64; V.pow(l as u32)]).collect();
    let mut tree_steps = 0;
    for seed in seed0..seed0 + n {
        let params = GenerationParams::sampled(cfg.clone(), seed, len)
            .with_draft(DraftLength::Fixed(3))
            .with_tree(TreeDrafts::nodes(8));
        let out = g.generate(&PROMPT, &params).unwrap();
        tree_steps += out.metrics.tree_steps;
        for (l, c) in counts.iter_mut().enumerate() {
            c[out.tokens[..=l].iter().fold(0, |a, &x| a * V + x as usize)] += 1;
        }
    }
    let f = |s: &[u32]| target.logits(s);
    let models = Models {
        cfg,
        vocab: V,
        qv: V,
        ctx: &PROMPT,
        target: &f,
        draft: &f,
        eos: None,
        det: DetChoice::Fixed,
        prompt_len: PROMPT.len(),
        suppress: &[],
        suppress_rows: 0,
    };
    let shape = Shape::default();
    let calc = LawCalc::new(&models, &shape);
    let fits = counts
        .iter()
        .enumerate()
        .map(|(l, c)| {
            // LawCalc's cells have a stop symbol (V + 1 values per token); no EOS here, so the
            // cells without it are the law.
            let exact = calc.target(&[], l + 1);
            let mut e = vec![0.0f64; V.pow(l as u32 + 1)];
            for (i, x) in e.iter_mut().enumerate() {
                let (mut j, mut rest, mut w) = (0usize, i, 1usize);
                for _ in 0..=l {
                    j += (rest % V) * w;
                    rest /= V;
                    w *= V + 1;
                }
                *x = exact[j];
            }
            chi_square(c, &e)
        })
        .collect();
    (fits, tree_steps)
}

fn show(name: &str, fits: &[Fit]) {
    for (l, f) in fits.iter().enumerate() {
        println!(
            "{name}: first {}: p = {:.3e} (chi2 = {:.1}, df = {}, impossible = {})",
            l + 1,
            f.p_value,
            f.stat,
            f.df,
            f.impossible
        );
    }
}

#[test]
fn merged_trees_are_lossless_under_stochastic_verification() {
    let n = 40_000;
    let configs = [
        ("plain", SamplingConfig::sampling(1.0).unwrap()),
        (
            "top-k/top-p",
            SamplingConfig::builder()
                .temperature(0.8)
                .top_k(4)
                .top_p(0.95)
                .build()
                .unwrap(),
        ),
    ];
    for (i, (name, cfg)) in configs.iter().enumerate() {
        let (fits, tree_steps) = fit(cfg, merge_reach(V, 3, true), n, 1_000_000 * (i as u64 + 1));
        show(name, &fits);
        // Branching trees at a good share of the steps (single paths go as chains).
        assert!(tree_steps as u64 > n / 5, "{tree_steps}");
        assert!(
            fits.iter().all(|f| f.p_value >= ALPHA),
            "{name}: merged trees were rejected: {fits:?}"
        );
    }
    // Negative control: the same trees verified with a draft model's q kept.
    let control = KeepQ {
        inner: merge_reach(V, 3, true),
        draft: ToyModel::markov(V, 2, 1.3, 11 ^ 0x5EED),
    };
    let (fits, _) = fit(&configs[0].1, control, n, 9_000_000);
    show("q kept (negative control)", &fits);
    let last = fits.last().unwrap();
    assert!(
        last.p_value < ALPHA,
        "the test failed to reject merged trees verified with a kept q: {last:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Learned ranking.

/// The greedy next token of `model` after `prefix` (ties to the lowest id).
fn greedy_next(model: &ToyModel, prefix: &[u32]) -> u32 {
    let l = model.logits(prefix);
    let mut best = 0;
    for (i, &x) in l.iter().enumerate() {
        if x > l[best] {
            best = i;
        }
    }
    best as u32
}

/// Proposes the target's own greedy continuation.
struct Oracle(ToyModel);

impl Proposer for Oracle {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let mut ctx = req.context.to_vec();
        for _ in 0..req.max_draft {
            let t = greedy_next(&self.0, &ctx);
            draft.tokens.push(t);
            ctx.push(t);
        }
        Ok(())
    }
}

#[test]
fn the_learned_ranking_keeps_the_proposer_that_is_right() {
    let vocab = 8;
    let model = ToyModel::markov(vocab, 2, 2.0, 21);
    let m2 = model.clone();
    let wrong = WrongProposer::new(vocab as u32, move |p: &[u32]| greedy_next(&m2, p));
    // The wrong proposer is listed first: it wins every tie of the prior.
    let mut merged = MergedProposer::new(vec![Box::new(wrong), Box::new(Oracle(model.clone()))])
        .unwrap()
        .with_policy(MergePolicy::Reach);
    let cfg = SamplingConfig::greedy();
    let mut context = vec![1u32, 2, 3];
    let mut draft = Draft::default();
    let mut oracle_only = Vec::new();
    for _ in 0..12 {
        let mut req = ProposeRequest::new(&context, &cfg, 4);
        req.max_nodes = 4;
        merged.propose_tree(&req, &mut draft).unwrap();
        let mut truth = Draft::default();
        Oracle(model.clone()).propose(&req, &mut truth).unwrap();
        oracle_only.push(draft.tokens == truth.tokens && draft.parents.is_empty());
        // What greedy verification emits: the longest matching path, then the target's token.
        let mut emitted = Vec::new();
        let mut ctx = context.clone();
        for d in 0..=4 {
            let t = greedy_next(&model, &ctx);
            emitted.push(t);
            ctx.push(t);
            if d == 4 || !has_path(&draft, &emitted) {
                break;
            }
        }
        let accepted = emitted.len() - 1;
        merged.observe(accepted, &emitted).unwrap();
        context.extend_from_slice(&emitted);
    }
    // The first step keeps the wrong proposer's nodes (ties); after a few steps only the right
    // one's chain fills the budget.
    assert!(!oracle_only[0], "{oracle_only:?}");
    assert!(oracle_only[3..].iter().all(|&x| x), "{oracle_only:?}");
    assert!(merged.rate(1, 4) > 0.8 && merged.rate(0, 1) < 0.15);

    // In the loop: the merged tree accepts (nearly) the whole budget after warm-up.
    let m2 = model.clone();
    let wrong = WrongProposer::new(vocab as u32, move |p: &[u32]| greedy_next(&m2, p));
    let merged = MergedProposer::new(vec![Box::new(wrong), Box::new(Oracle(model.clone()))])
        .unwrap()
        .with_costs(FixedMergeCosts::new(0.010, 0.0005).unwrap());
    let mut g = Generator::new(model.clone().with_tree(8), merged);
    let params = GenerationParams::greedy(60)
        .with_draft(DraftLength::Fixed(4))
        .with_tree(TreeDrafts::nodes(4));
    let out = g.generate(&[1, 2, 3], &params).unwrap();
    assert_eq!(out.tokens, plain(&model, &[1, 2, 3], &params));
    assert!(
        out.metrics.mean_accepted_length() > 4.0,
        "{}",
        out.metrics.mean_accepted_length()
    );
}

/// `true` when `tokens` is the token path of some node of `d` (chain or tree).
fn has_path(d: &Draft, tokens: &[u32]) -> bool {
    let b = d.block();
    let mut nodes = Vec::new();
    (0..d.len()).any(|i| {
        b.path_to(i, &mut nodes);
        nodes.len() == tokens.len()
            && nodes
                .iter()
                .zip(tokens)
                .all(|(&j, &t)| d.tokens[j as usize] == t)
    })
}

// ---------------------------------------------------------------------------------------------
// Cost-aware merging: never below the best member (modelled costs, no clock).

/// Step cost of the model below: 10 ms per verify plus 0.5 ms per row; a costly member 2 ms
/// per call plus 1 ms per drafted token (a draft model's order of magnitude against a cheap
/// copy proposer).
const BASE: f64 = 0.010;
const PER_ROW: f64 = 0.0005;
const CALL: f64 = 0.002;
const TOKEN: f64 = 0.001;

/// Counts a member's draft calls and drafted tokens.
struct Counted<P> {
    inner: P,
    calls: Arc<Mutex<(usize, usize)>>,
}

impl<P: Proposer> Proposer for Counted<P> {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose(req, draft)?;
        let mut c = self.calls.lock().unwrap();
        c.0 += 1;
        c.1 += draft.len();
        Ok(())
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.inner.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.inner.begin(prompt)
    }
    fn finish(&mut self, sequence: &[u32]) {
        self.inner.finish(sequence)
    }
}

/// The modelled tokens per second of greedy generations (chains of 6) over a few prompts with
/// `proposer`, whose costly member's calls are counted in `calls`: every verify step costs
/// `BASE + PER_ROW * rows`, every call of the costly member `CALL + TOKEN * drafted`.
fn modelled_speed<P: Proposer>(
    model: &ToyModel,
    proposer: P,
    calls: &Arc<Mutex<(usize, usize)>>,
) -> f64 {
    let mut g = Generator::new(model.clone(), proposer);
    let params = GenerationParams::greedy(80).with_draft(DraftLength::Fixed(6));
    let (mut tokens, mut secs) = (0usize, 0.0f64);
    for p in 0..4u64 {
        let prompt = prompt(700 + p, 8);
        let out = g.generate(&prompt, &params).unwrap();
        assert_eq!(
            out.tokens,
            plain(model, &prompt, &params),
            "prompt {prompt:?}"
        );
        let m = &out.metrics;
        tokens += m.emitted;
        secs += BASE * m.target_calls as f64 + PER_ROW * (m.target_calls + m.proposed) as f64;
    }
    let (n, drafted) = *calls.lock().unwrap();
    secs += CALL * n as f64 + TOKEN * drafted as f64;
    tokens as f64 / secs
}

/// A costly member (`Counted`) and its call counter.
fn counted<P: Proposer + Send + 'static>(p: P) -> (Counted<P>, Arc<Mutex<(usize, usize)>>) {
    let calls = Arc::new(Mutex::new((0, 0)));
    let c = Counted {
        inner: p,
        calls: calls.clone(),
    };
    (c, calls)
}

/// Prompt lookup + the costly member `costly` (member 1), cost-aware (or `reach`: the old rule).
fn with_lookup<P: Proposer + Send + 'static>(costly: Counted<P>, reach: bool) -> MergedProposer {
    let costs = FixedMergeCosts::new(BASE, PER_ROW)
        .unwrap()
        .with_member(1, CALL, TOKEN)
        .unwrap();
    let m = MergedProposer::new(vec![lookup(), Box::new(costly)])
        .unwrap()
        .with_costs(costs);
    if reach {
        m.with_policy(MergePolicy::Reach)
    } else {
        m
    }
}

#[test]
fn the_cost_aware_merge_matches_the_best_member() {
    // A peaked model (greedy text loops: prompt lookup dominates) and a costly member that is
    // never right: the merge must not pay for it. The old rule (every member every step) is the
    // negative control: it must fall below.
    let model = ToyModel::markov(8, 2, 3.0, 5);
    let wrong = || {
        WrongProposer::new(8, {
            let m = model.clone();
            move |p: &[u32]| greedy_next(&m, p)
        })
    };
    let none = Arc::new(Mutex::new((0, 0)));
    let lookup_alone = modelled_speed(&model, lookup(), &none);
    let (c, calls) = counted(wrong());
    let merged = modelled_speed(&model, with_lookup(c, false), &calls);
    let (c, calls) = counted(wrong());
    let old = modelled_speed(&model, with_lookup(c, true), &calls);
    println!("wrong member: lookup {lookup_alone:.1} merged {merged:.1} old {old:.1} tok/s");
    assert!(
        merged >= 0.97 * lookup_alone,
        "{merged} against {lookup_alone}"
    );
    assert!(old < 0.97 * lookup_alone, "the control did not fail: {old}");

    // A costly member that is always right (the target's own greedy continuation): the merge
    // must keep asking it.
    let (c, calls) = counted(Oracle(model.clone()));
    let oracle_alone = modelled_speed(&model, c, &calls);
    let (c, calls) = counted(Oracle(model.clone()));
    let merged = modelled_speed(&model, with_lookup(c, false), &calls);
    println!("right member: lookup {lookup_alone:.1} oracle {oracle_alone:.1} merged {merged:.1}");
    let best = oracle_alone.max(lookup_alone);
    assert!(merged >= 0.97 * best, "{merged} against {best}");
}
