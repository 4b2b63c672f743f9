//! The decoding loop with token-tree drafts: greedy output identical to plain greedy, seeded
//! point-mass trees identical to plain sampling (case C15), ends inside a tree (case C11), the
//! token budget and context cap, invalid trees, and the fallback to chains for targets without
//! tree support.

use speculative::decode::{FinishReason, GenerationParams, Generator, StopConditions, TreeDrafts};
use speculative::error::ProposalFault;
use speculative::rng::Stream;
use speculative::test_util::{CallLog, ToyModel, c10_greedy, c10_next};
use speculative::{
    Draft, Error, NoProposer, ProposeRequest, Proposer, Result, SamplingConfig, TreeFault,
};

/// A tree proposer for the C10 model: at every depth it offers up to `width` distinct
/// candidates, one of which (at a pseudo-random sibling rank) is the model's true next token
/// while the depth is below a pseudo-random "correct depth"; the true branch continues, the
/// others are leaves. `propose` (chains) returns the first branch only.
struct OracleTree {
    width: usize,
    salt: u64,
    /// Every tree returned, as (tokens, parents).
    log: Vec<(Vec<u32>, Vec<u32>)>,
    chain_calls: usize,
}

impl OracleTree {
    fn new(width: usize, salt: u64) -> Self {
        OracleTree {
            width,
            salt,
            log: Vec::new(),
            chain_calls: 0,
        }
    }

    fn build(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft, tree: bool) {
        draft.clear();
        let s = Stream::new(self.salt);
        let pos = req.context.len() as u64;
        let correct_depth = (s.bits(pos, 0)[0] % (req.max_draft as u32 + 1)) as usize;
        let mut ctx = req.context.to_vec();
        let mut parent_row = 0u32;
        for depth in 0..req.max_draft {
            let truth = c10_next(&ctx);
            let good = depth < correct_depth;
            let width = if tree { self.width } else { 1 };
            let rank = (s.bits(pos, 1 + depth as u32)[1] as usize) % width;
            let mut next_parent = None;
            for j in 0..width {
                if draft.tokens.len() >= req.max_nodes {
                    break;
                }
                let tok = if good && j == rank {
                    truth
                } else {
                    // A wrong token distinct from the truth and from its siblings.
                    ((truth as usize + 1 + j + (j >= rank) as usize) % 7) as u32
                };
                draft.tokens.push(tok);
                draft.parents.push(parent_row);
                if j == rank {
                    next_parent = Some(draft.tokens.len() as u32);
                }
            }
            match next_parent {
                Some(r) if draft.tokens.len() < req.max_nodes => {
                    parent_row = r;
                    ctx.push(draft.tokens[r as usize - 1]);
                }
                _ => break,
            }
        }
        if !tree {
            draft.parents.clear();
        }
        self.log.push((draft.tokens.clone(), draft.parents.clone()));
    }
}

impl Proposer for OracleTree {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.chain_calls += 1;
        self.build(req, draft, false);
        Ok(())
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.build(req, draft, true);
        Ok(())
    }
}

fn plain(target: ToyModel, prompt: &[u32], params: &GenerationParams) -> Vec<u32> {
    let params = params
        .clone()
        .with_draft(speculative::decode::DraftLength::Off)
        .with_tree(TreeDrafts::nodes(0));
    Generator::new(target, NoProposer)
        .generate(prompt, &params)
        .unwrap()
        .tokens
}

#[test]
fn greedy_tree_output_equals_plain_greedy() {
    for salt in 0..6u64 {
        let prompt: Vec<u32> = (0..5).map(|i| ((i * 3 + salt) % 7) as u32).collect();
        let params = GenerationParams::greedy(60)
            .with_draft(speculative::decode::DraftLength::Fixed(5))
            .with_tree(TreeDrafts::nodes(12));
        let want = plain(ToyModel::c10(), &prompt, &params);
        let mut g = Generator::new(
            CallLog::new(ToyModel::c10().with_tree(16)),
            OracleTree::new(3, salt),
        );
        let out = g.generate(&prompt, &params).unwrap();
        assert_eq!(out.tokens, want, "salt {salt}");
        let m = &out.metrics;
        assert!(m.tree_steps > 0, "tree steps were taken");
        assert_eq!(g.target().trees.len(), m.tree_steps);
        assert_eq!(g.target().commits.len(), m.tree_steps);
        assert!(m.tree_nodes <= 12 * m.tree_steps);
        // Every tree fit the budget and the depth.
        for (tokens, parents) in &g.proposer().log {
            assert!(tokens.len() <= 12);
            assert_eq!(tokens.len(), parents.len());
        }
        // The oracle's trees hold the true branch: tree steps accept more than width-1 chains.
        assert!(
            m.mean_accepted_length() > 1.5,
            "{}",
            m.mean_accepted_length()
        );
        assert_eq!(g.proposer().chain_calls, 0);
    }
}

#[test]
fn a_target_without_tree_support_verifies_chains() {
    let prompt = [1u32, 2, 3];
    let params = GenerationParams::greedy(40).with_tree(TreeDrafts::nodes(12));
    let want = plain(ToyModel::c10(), &prompt, &params);
    let mut g = Generator::new(CallLog::new(ToyModel::c10()), OracleTree::new(3, 7));
    let out = g.generate(&prompt, &params).unwrap();
    assert_eq!(out.tokens, want);
    assert_eq!(out.metrics.tree_steps, 0);
    assert!(g.target().trees.is_empty());
    assert!(g.proposer().chain_calls > 0, "propose, not propose_tree");
}

#[test]
fn tree_nodes_zero_never_asks_for_a_tree() {
    let mut g = Generator::new(ToyModel::c10().with_tree(16), OracleTree::new(3, 1));
    let out = g.generate(&[4, 5], &GenerationParams::greedy(30)).unwrap();
    assert_eq!(out.metrics.tree_steps, 0);
    assert_eq!(g.target().tree_calls, 0);
}

/// Random point-mass trees (distinct siblings, at most `max_branch` per node) for a vocab-`v`
/// model.
struct RandomTree {
    vocab: u32,
    salt: u64,
}

impl Proposer for RandomTree {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.propose_tree(req, draft)?;
        draft.tokens.truncate(1);
        draft.parents.clear();
        Ok(())
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let s = Stream::new(self.salt);
        let pos = req.context.len() as u64;
        let mut depth_of = Vec::new();
        for attempt in 0..2 * req.max_nodes {
            let i = draft.tokens.len();
            if i == req.max_nodes {
                break;
            }
            let b = s.bits(pos, attempt as u32);
            // Parent: any earlier row whose depth allows a child.
            let mut r = (b[0] as usize) % (i + 1);
            while r > 0 && depth_of[r - 1] >= req.max_draft {
                r -= 1;
            }
            let d = if r == 0 { 1 } else { depth_of[r - 1] + 1 };
            if d > req.max_draft {
                break;
            }
            // A token not used by a sibling.
            let used: Vec<u32> = (0..i)
                .filter(|&j| draft.parents[j] as usize == r)
                .map(|j| draft.tokens[j])
                .collect();
            if used.len() as u32 >= self.vocab || used.len() >= req.max_branch {
                continue;
            }
            let mut t = b[1] % self.vocab;
            while used.contains(&t) {
                t = (t + 1) % self.vocab;
            }
            draft.tokens.push(t);
            draft.parents.push(r as u32);
            depth_of.push(d);
        }
        Ok(())
    }
}

#[test]
fn seeded_point_mass_trees_reproduce_plain_sampling() {
    // C15 for trees: with point-mass (deterministic) trees the emitted tokens are the ones plain
    // sampling with the same seed emits, whatever the tree.
    let cfg = SamplingConfig::builder()
        .temperature(0.9)
        .top_k(6)
        .build()
        .unwrap();
    for seed in 0..8u64 {
        let model = ToyModel::markov(8, 2, 2.0, 11);
        let prompt = [1u32, 2, 3, 4];
        let params = GenerationParams::sampled(cfg.clone(), seed, 48)
            .with_draft(speculative::decode::DraftLength::Fixed(4))
            .with_tree(TreeDrafts::nodes(10));
        let want = plain(model.clone(), &prompt, &params);
        let mut g = Generator::new(
            model.with_tree(10),
            RandomTree {
                vocab: 8,
                salt: seed,
            },
        );
        let out = g.generate(&prompt, &params).unwrap();
        assert_eq!(out.tokens, want, "seed {seed}");
        assert!(out.metrics.tree_steps > 0);
    }
}

#[test]
fn an_eos_inside_a_tree_prunes_its_subtree_and_ends_there() {
    // C10 model; EOS = the token the model emits 3rd. The oracle's true branch runs through it;
    // no node below an EOS may reach the target, and the output ends at the EOS exactly as
    // plain greedy decoding with the same stop.
    let prompt = [3u32, 1, 4];
    let eos = c10_greedy(&prompt, 3)[2];
    let params = GenerationParams::greedy(40)
        .with_draft(speculative::decode::DraftLength::Fixed(6))
        .with_tree(TreeDrafts::nodes(20))
        .with_stop(StopConditions::default().with_eos(eos))
        .unwrap();
    let want = plain(ToyModel::c10(), &prompt, &params);
    let mut g = Generator::new(
        CallLog::new(ToyModel::c10().with_tree(32)),
        OracleTree::new(3, 99),
    );
    let out = g.generate(&prompt, &params).unwrap();
    assert_eq!(out.tokens, want);
    assert_eq!(out.finish, FinishReason::Eos);
    let with_eos = g
        .target()
        .trees
        .iter()
        .filter(|(_, tokens, _)| tokens.contains(&eos))
        .count();
    assert!(with_eos > 0, "the test must put the EOS inside a tree");
    for (_, tokens, parents) in &g.target().trees {
        for (i, &r) in parents.iter().enumerate() {
            if r > 0 {
                assert_ne!(
                    tokens[r as usize - 1],
                    eos,
                    "node {i} below an EOS reached the target"
                );
            }
        }
    }
}

#[test]
fn the_budget_and_the_context_cap_count_the_tree_depth() {
    for budget in 1..12 {
        let params = GenerationParams::greedy(budget)
            .with_draft(speculative::decode::DraftLength::Fixed(6))
            .with_tree(TreeDrafts::nodes(16));
        let mut g = Generator::new(ToyModel::c10().with_tree(16), OracleTree::new(2, 5));
        let out = g.generate(&[1, 2], &params).unwrap();
        assert_eq!(out.tokens.len(), budget);
        assert_eq!(out.finish, FinishReason::MaxTokens);
    }
    for max_ctx in 4..14 {
        let params = GenerationParams::greedy(100)
            .with_draft(speculative::decode::DraftLength::Fixed(6))
            .with_tree(TreeDrafts::nodes(16));
        let target = ToyModel::deterministic(7, max_ctx, c10_next).with_tree(16);
        let mut g = Generator::new(target, OracleTree::new(3, 2));
        let out = g.generate(&[1, 2, 3], &params).unwrap();
        assert_eq!(out.tokens.len(), max_ctx - 3);
        assert_eq!(out.finish, FinishReason::ContextFull);
    }
}

/// Returns a fixed draft whatever it is asked.
struct Fixed(Draft);

impl Proposer for Fixed {
    fn propose(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        *draft = self.0.clone();
        Ok(())
    }
    fn name(&self) -> &'static str {
        "fixed"
    }
}

#[test]
fn invalid_trees_never_reach_the_target() {
    let tree = |tokens: Vec<u32>, parents: Vec<u32>| Draft::tree(tokens, parents);
    let cases: Vec<(Draft, usize, ProposalFault)> = vec![
        (
            tree(vec![1, 2], vec![0, 2]),
            8,
            ProposalFault::Tree(TreeFault::ParentNotBefore { node: 1, parent: 2 }),
        ),
        (
            tree(vec![1, 1], vec![0, 0]),
            8,
            ProposalFault::Tree(TreeFault::DuplicateSiblings { node: 1, token: 1 }),
        ),
        (
            tree(vec![1, 2, 3, 4, 5], vec![0, 0, 0, 0, 0]),
            4,
            ProposalFault::Tree(TreeFault::TooManyNodes { nodes: 5, max: 4 }),
        ),
        (
            tree(vec![1, 2, 3, 4, 5, 6], vec![0, 1, 2, 3, 4, 0]),
            8,
            ProposalFault::Tree(TreeFault::TooDeep { depth: 5, max: 4 }),
        ),
        (
            // A chain written with parents is checked as a chain: its length against k.
            tree(vec![1, 2, 3, 4, 5], vec![0, 1, 2, 3, 4]),
            8,
            ProposalFault::TooLong {
                len: 5,
                max_draft: 4,
            },
        ),
        (
            tree(vec![1, 9], vec![0, 0]),
            8,
            ProposalFault::Tree(TreeFault::TokenOutOfVocab {
                node: 1,
                token: 9,
                vocab_size: 7,
            }),
        ),
    ];
    for (d, nodes, want) in cases {
        let params = GenerationParams::greedy(8)
            .with_draft(speculative::decode::DraftLength::Fixed(4))
            .with_tree(TreeDrafts::nodes(nodes));
        let mut g = Generator::new(CallLog::new(ToyModel::c10().with_tree(16)), Fixed(d));
        let e = g.generate(&[1, 2], &params).unwrap_err();
        match &e.error {
            Error::InvalidProposal { proposer, fault } => {
                assert_eq!(*proposer, "fixed");
                assert_eq!(fault, &want);
            }
            other => panic!("{other:?}"),
        }
        assert!(g.target().trees.is_empty());
        assert!(g.target().forwards.is_empty());
    }
    // A branching tree where the loop asked for a chain.
    let mut g = Generator::new(
        CallLog::new(ToyModel::c10()),
        Fixed(tree(vec![1, 2], vec![0, 0])),
    );
    let e = g
        .generate(&[1, 2], &GenerationParams::greedy(8))
        .unwrap_err();
    assert!(matches!(
        e.error,
        Error::InvalidProposal {
            fault: ProposalFault::TreeNotRequested,
            ..
        }
    ));
    // A chain written with parents is a chain, with or without tree support.
    let mut g = Generator::new(
        CallLog::new(ToyModel::c10()),
        Fixed(tree(vec![1, 2], vec![0, 1])),
    );
    let params = GenerationParams::greedy(8);
    let mut s = g.session(&[1, 2], &params).unwrap();
    let r = s.step().map(|t| t.map(<[u32]>::len));
    assert!(matches!(r, Ok(Some(1..=3))), "{r:?}");
}

#[test]
fn streaming_reports_each_tree_step() {
    let params = GenerationParams::greedy(30)
        .with_draft(speculative::decode::DraftLength::Fixed(4))
        .with_tree(TreeDrafts::nodes(9));
    let mut g = Generator::new(ToyModel::c10().with_tree(9), OracleTree::new(3, 3));
    let mut steps = Vec::new();
    let out = g
        .generate_stream(&[2, 2], &params, |c| {
            steps.push((c.tokens.len(), c.step));
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(steps.len(), out.metrics.target_calls);
    let trees = steps.iter().filter(|(_, s)| s.tree).count();
    assert_eq!(trees, out.metrics.tree_steps);
    for (n, s) in &steps {
        assert!(s.drafted <= 9 && s.depth <= 4 && s.accepted <= s.depth);
        assert!(*n <= s.accepted + 1);
    }
    let accepted: usize = steps.iter().map(|(_, s)| s.accepted).sum();
    assert_eq!(accepted, out.metrics.accepted);
}

#[test]
fn the_kv_cache_after_tree_steps_is_the_emitted_sequence() {
    let params = GenerationParams::greedy(25)
        .with_draft(speculative::decode::DraftLength::Fixed(5))
        .with_tree(TreeDrafts::nodes(12));
    let prompt = [6u32, 0, 5];
    let mut g = Generator::new(ToyModel::c10().with_tree(12), OracleTree::new(3, 8));
    let out = g.generate(&prompt, &params).unwrap();
    let mut all = prompt.to_vec();
    all.extend(&out.tokens);
    // The loop's invariant: the cache holds every token but the last.
    assert_eq!(g.target().tokens(), &all[..all.len() - 1]);
}

/// A wide tree of `width` distinct children of the root, whatever the request asks.
struct Wide(usize);

impl Proposer for Wide {
    fn propose(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        Ok(())
    }
    fn propose_tree(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        draft.tokens.extend(0..self.0 as u32);
        draft.parents.resize(self.0, 0);
        Ok(())
    }
    fn name(&self) -> &'static str {
        "wide"
    }
}

#[test]
fn the_node_budget_and_the_target_capacity_bound_a_branching_tree() {
    let depth6 = GenerationParams::greedy(8).with_draft(speculative::decode::DraftLength::Fixed(6));
    let cases = [
        // Budget 3 nodes, depth 6: a 6-node tree is over the budget, not "within the depth".
        (
            depth6.clone().with_tree(TreeDrafts::nodes(3)),
            16,
            TreeFault::TooManyNodes { nodes: 6, max: 3 },
        ),
        // The target holds 4 nodes: the same tree never reaches its forward.
        (
            depth6.clone().with_tree(TreeDrafts::nodes(32)),
            4,
            TreeFault::TooManyNodes { nodes: 6, max: 4 },
        ),
        // A branching limit of 2: six children of the root are too many.
        (
            depth6.with_tree(TreeDrafts::nodes(32).with_branch(2)),
            16,
            TreeFault::TooManyChildren { row: 0, max: 2 },
        ),
    ];
    for (params, capacity, want) in cases {
        let mut g = Generator::new(CallLog::new(ToyModel::c10().with_tree(capacity)), Wide(6));
        let e = g.generate(&[1, 2], &params).unwrap_err();
        match &e.error {
            Error::InvalidProposal {
                fault: ProposalFault::Tree(fault),
                ..
            } => assert_eq!(fault, &want),
            other => panic!("{other:?}"),
        }
        assert!(g.target().trees.is_empty());
    }
}

#[test]
fn the_branching_limit_reaches_the_proposers() {
    // Prompt lookup on a repetitive prompt: with a limit of 2 no row has more than 2 children,
    // and the output is still plain greedy's.
    let prompt: Vec<u32> = (0..60)
        .map(|i| [1u32, 2, 3, 1, 2, 4, 1, 2, 5][i % 9])
        .collect();
    let params = GenerationParams::greedy(40)
        .with_draft(speculative::decode::DraftLength::Fixed(4))
        .with_tree(TreeDrafts::nodes(12).with_branch(2));
    let want = plain(ToyModel::c10(), &prompt, &params);
    let mut g = Generator::new(
        CallLog::new(ToyModel::c10().with_tree(16)),
        speculative::PromptLookup::new(1, 3).unwrap(),
    );
    let out = g.generate(&prompt, &params).unwrap();
    assert_eq!(out.tokens, want);
    assert!(out.metrics.tree_steps > 0);
    for (_, tokens, parents) in &g.target().trees {
        for row in 0..=tokens.len() {
            assert!(parents.iter().filter(|&&r| r as usize == row).count() <= 2);
        }
    }
}

/// Samples `width` root children with replacement from a fixed q (duplicates allowed), dense q.
struct Sampled {
    width: usize,
}

impl Proposer for Sampled {
    fn propose(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        Ok(())
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let vocab = 8usize;
        let q: Vec<f32> = (0..vocab).map(|v| (v + 1) as f32 / 36.0).collect();
        let s = Stream::new(req.seed ^ 0xabc);
        for j in 0..self.width {
            let u = s.uniform(req.context.len() as u64, 10 + j as u32);
            let mut acc = 0.0;
            let mut t = vocab - 1;
            for (v, &p) in q.iter().enumerate() {
                acc += p;
                if u < acc {
                    t = v;
                    break;
                }
            }
            draft.tokens.push(t as u32);
            draft.parents.push(0);
        }
        draft.q = Some(q.repeat(self.width));
        draft.q_vocab = vocab;
        draft.schemes = vec![speculative::SiblingScheme::WithReplacement; self.width];
        Ok(())
    }
}

#[test]
fn sampled_trees_with_repeated_tokens_reach_a_tree_target() {
    let cfg = SamplingConfig::builder().temperature(1.0).build().unwrap();
    let model = ToyModel::markov(8, 1, 1.5, 3);
    let params = GenerationParams::sampled(cfg, 5, 60)
        .with_draft(speculative::decode::DraftLength::Fixed(1))
        .with_tree(TreeDrafts::nodes(4));
    let mut g = Generator::new(CallLog::new(model.with_tree(8)), Sampled { width: 4 });
    let out = g.generate(&[1, 2, 3], &params).unwrap();
    assert_eq!(out.tokens.len(), 60);
    let repeated = g.target().trees.iter().any(|(_, t, _)| {
        let mut s = t.clone();
        s.sort_unstable();
        s.dedup();
        s.len() < t.len()
    });
    assert!(repeated, "the test must send a tree with a repeated token");
    assert_eq!(out.metrics.tree_steps, g.target().trees.len());
}

#[test]
fn adaptive_depth_turns_unprofitable_trees_off() {
    let params = GenerationParams::greedy(200)
        .with_draft(speculative::decode::DraftLength::Adaptive(
            speculative::decode::AdaptiveConfig::default(),
        ))
        .with_tree(TreeDrafts::nodes(24));
    // The policy learns from a fixed cost curve, not the clock: 4 ms + 1 ms per row, so a
    // forward of 25 rows costs 5.8 plain steps.
    let costs = speculative::decode::FixedCosts::linear(0.004, 0.001).unwrap();
    let mut g = Generator::new(
        ToyModel::c10().with_tree(32),
        RandomTree { vocab: 7, salt: 4 },
    )
    .with_costs(costs);
    let out = g.generate(&[1, 2], &params).unwrap();
    let m = &out.metrics;
    assert!(m.tree_steps > 0, "the policy starts by measuring trees");
    // Random trees of 24 nodes cost 25 rows for a few accepted tokens: the policy settles on
    // plain decoding for most steps, as it does with chains that do not pay.
    println!(
        "{} calls, {} no-draft, {} tree steps, mean accepted length {:.2}",
        m.target_calls,
        m.no_draft_steps,
        m.tree_steps,
        m.mean_accepted_length()
    );
    assert!(
        m.no_draft_steps * 2 > m.target_calls,
        "{} no-draft steps of {}",
        m.no_draft_steps,
        m.target_calls
    );
}
