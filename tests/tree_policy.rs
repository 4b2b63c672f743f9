//! The cost-aware tree-shape policy in the loop (`DraftLength::Adaptive` with `tree_nodes > 0`):
//! plain decoding with backed-off probes when every draft is rejected, larger (branching) trees
//! when acceptance is high, chains when only the first sibling is ever accepted or when a
//! second node does not pay, the node budget, branching limit, token budget and context room
//! respected at every step, and the output of plain greedy decoding and of plain seeded
//! sampling (point-mass trees, case C15).
//!
//! The policy learns its step costs from a fixed cost curve ([`FixedCosts`], set with
//! `Generator::with_costs`), not from the clock: a forward over `n` rows costs
//! `12 ms + 2 ms * n` (c(2) 1.14, c(9) 2.1, c(17) 3.3 relative to one row) unless a test says
//! otherwise, and proposing is free. Every choice is therefore a function of the proposer's
//! (seeded) acceptance alone: these tests give the same result on a quiet machine and beside a
//! build, and need no lock against each other.

use speculative::decode::{
    AdaptiveConfig, DraftLength, FinishReason, FixedCosts, GenerationParams, Generator, TreeDrafts,
};
use speculative::rng::Stream;
use speculative::test_util::{CallLog, ToyModel, WrongProposer, c10_next};
use speculative::{Draft, NoProposer, ProposeRequest, Proposer, Result, SamplingConfig};

/// The cost curve of these tests: 12 ms a forward plus 2 ms a row.
fn script() -> FixedCosts {
    FixedCosts::linear(0.012, 0.002).unwrap()
}

/// One request a proposer received: context length, max_nodes, max_draft, max_branch.
#[derive(Debug, Clone, Copy)]
struct Asked {
    context: usize,
    nodes: usize,
    depth: usize,
    branch: usize,
}

/// A best-first tree proposer for the C10 model (EAGLE-2's expansion with its own confidence):
/// below any node (and the root), the true next token is the rank-0 child with probability
/// `p0`, else the rank-1 child with probability `p1`, else no child (pseudo-random, keyed by
/// the node's whole prefix); a node's priority is the product along its path of `p0` for a
/// rank-0 step and `(1 - p0) * p1` for a rank-1 step, and the proposer adds the frontier node
/// of highest priority until the request's node budget, depth and branching (at most 2) are
/// reached. So the acceptance of a child depends on its rank only, as the policy models it.
struct Siblings {
    p0: f64,
    p1: f64,
    salt: u64,
    asked: Vec<Asked>,
}

impl Siblings {
    fn new(p0: f64, p1: f64, salt: u64) -> Self {
        Siblings {
            p0,
            p1,
            salt,
            asked: Vec::new(),
        }
    }

    /// The token of the rank-`rank` child of the node whose prefix is `prefix`.
    fn child(&self, prefix: &[u32], rank: usize) -> u32 {
        let truth = c10_next(prefix);
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &t in prefix {
            h = (h ^ t as u64).wrapping_mul(0x1000_0000_01b3);
        }
        let b = Stream::new(self.salt).bits(h, prefix.len() as u32);
        let u = |x: u32| (x >> 8) as f64 / 16_777_216.0;
        let true_rank = if u(b[0]) < self.p0 {
            Some(0)
        } else if u(b[1]) < self.p1 {
            Some(1)
        } else {
            None
        };
        if Some(rank) == true_rank {
            truth
        } else {
            (truth + 1 + rank as u32) % 7
        }
    }
}

impl Proposer for Siblings {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        let one = req.max_nodes(req.max_draft).max_branch(1);
        self.propose_tree(&one, draft)?;
        draft.parents.clear();
        Ok(())
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.asked.push(Asked {
            context: req.context.len(),
            nodes: req.max_nodes,
            depth: req.max_draft,
            branch: req.max_branch,
        });
        draft.clear();
        let w = [self.p0, (1.0 - self.p0) * self.p1];
        // Frontier: (priority, parent row, rank); prefixes per row (row 0 = the context).
        let mut prefixes = vec![req.context.to_vec()];
        let mut depth_of = vec![0usize];
        let mut frontier: Vec<(f64, usize, usize)> = vec![(w[0], 0, 0)];
        while draft.tokens.len() < req.max_nodes {
            // Highest priority first, ties to the earliest pushed.
            let Some(best) = (0..frontier.len())
                .rev()
                .max_by(|&a, &b| frontier[a].0.total_cmp(&frontier[b].0))
            else {
                break;
            };
            let (prio, row, rank) = frontier.remove(best);
            let tok = self.child(&prefixes[row], rank);
            draft.tokens.push(tok);
            draft.parents.push(row as u32);
            let mut prefix = prefixes[row].clone();
            prefix.push(tok);
            prefixes.push(prefix);
            let depth = depth_of[row] + 1;
            depth_of.push(depth);
            let parent_prio = prio / w[rank];
            if rank + 1 < req.max_branch.min(2) {
                frontier.push((parent_prio * w[rank + 1], row, rank + 1));
            }
            if depth < req.max_draft {
                frontier.push((prio * w[0], prefixes.len() - 1, 0));
            }
        }
        Ok(())
    }
}

fn adaptive() -> DraftLength {
    DraftLength::Adaptive(AdaptiveConfig::default())
}

fn plain_greedy(prompt: &[u32], n: usize) -> Vec<u32> {
    Generator::new(ToyModel::c10(), NoProposer)
        .generate(
            prompt,
            &GenerationParams::greedy(n).with_draft(DraftLength::Off),
        )
        .unwrap()
        .tokens
}

/// The largest number of children of one row (the root included) of a logged tree.
fn branching(parents: &[u32]) -> usize {
    let mut count = vec![0usize; parents.len() + 1];
    for &p in parents {
        count[p as usize] += 1;
    }
    count.into_iter().max().unwrap_or(0)
}

#[test]
fn every_draft_rejected_gives_plain_decoding_with_backed_off_probes() {
    let params = GenerationParams::greedy(400)
        .with_draft(adaptive())
        .with_tree(TreeDrafts::nodes(16));
    // A chain proposer (the default `propose_tree`) that is always wrong, and a tree proposer
    // whose siblings are all wrong.
    let proposers: Vec<Box<dyn Proposer>> = vec![
        Box::new(WrongProposer::new(7, c10_next)),
        Box::new(Siblings::new(0.0, 0.0, 3)),
    ];
    for proposer in proposers {
        let mut g = Generator::new(ToyModel::c10().with_tree(32), proposer).with_costs(script());
        let mut s = g.session(&[1, 2], &params).unwrap();
        let mut drafting = Vec::new();
        let mut step = 0;
        while s.step().unwrap().is_some() {
            if s.last_step().drafted > 0 {
                drafting.push(step);
            }
            step += 1;
        }
        let out = s.into_generation();
        assert_eq!(out.tokens, plain_greedy(&[1, 2], 400));
        assert_eq!(out.metrics.accepted, 0);
        // Warm-up (step 0) and a few steps that learn the rejections, then only probes, at
        // intervals that double: 16, 32, 64, 128 steps.
        assert_eq!(drafting.first(), Some(&0), "{drafting:?}");
        let learning = drafting.iter().filter(|&&s| s < 16).count();
        assert!(learning <= 12, "{drafting:?}");
        let probes = &drafting[learning..];
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.len() >= 3, "{drafting:?}");
        assert!(
            gaps[1..].iter().zip(&gaps).all(|(b, a)| *b == 2 * a),
            "{drafting:?}"
        );
        assert!(out.metrics.no_draft_steps * 20 > out.metrics.target_calls * 19);
    }
}

/// Runs `proposer` under the tree policy on the C10 target with the cost curve `costs`;
/// returns the requests it received after the first `skip` and the generation's mean accepted
/// length.
fn run_with(
    proposer: Siblings,
    costs: FixedCosts,
    tree_nodes: usize,
    n: usize,
    skip: usize,
) -> (Vec<Asked>, f64) {
    let params = GenerationParams::greedy(n)
        .with_draft(adaptive())
        .with_tree(TreeDrafts::nodes(tree_nodes));
    let mut g = Generator::new(ToyModel::c10().with_tree(64), proposer).with_costs(costs);
    let prompt = [3, 1, 4];
    let out = g.generate(&prompt, &params).unwrap();
    assert_eq!(out.tokens, plain_greedy(&prompt, n));
    let asked = g.proposer().asked[skip.min(g.proposer().asked.len())..].to_vec();
    (asked, out.metrics.mean_accepted_length())
}

/// [`run_with`] on the script's cost curve.
fn run(proposer: Siblings, tree_nodes: usize, n: usize, skip: usize) -> (Vec<Asked>, f64) {
    run_with(proposer, script(), tree_nodes, n, skip)
}

fn mean(asked: &[Asked], f: impl Fn(&Asked) -> usize) -> f64 {
    asked.iter().map(f).sum::<usize>() as f64 / asked.len().max(1) as f64
}

#[test]
fn high_acceptance_gives_larger_trees() {
    // Rank 0 right 90% of the time: a chain of depth 8 expects 6.1 tokens for 9 rows (2.1
    // times one row). Right half the time: 1 or 2 nodes pay, no more.
    let (high, mal) = run(Siblings::new(0.9, 0.0, 1), 32, 600, 10);
    let (low, _) = run(Siblings::new(0.5, 0.0, 1), 32, 300, 10);
    let nodes = mean(&high, |a| a.nodes);
    let low_nodes = mean(&low, |a| a.nodes);
    println!(
        "high: {} requests, mean nodes {nodes:.1}, mean accepted length {mal:.2}; low: {} \
         requests, mean nodes {low_nodes:.1}",
        high.len(),
        low.len()
    );
    assert!(nodes >= 6.0, "mean nodes {nodes}");
    assert!(low_nodes + 3.0 < nodes, "{low_nodes} vs {nodes}");
    assert!(high.iter().all(|a| a.nodes <= 32 && a.depth <= 8));
}

#[test]
fn acceptance_at_rank_1_gives_branching_trees() {
    // Rank 0 right 60% of the time, rank 1 whenever rank 0 is wrong: siblings pay.
    // An unlucky warm-up (rank 0 right five times in a row) can judge rank 1 too early; the
    // exploring steps bring it back. Count the second half of the requests.
    let (asked, mal) = run(Siblings::new(0.6, 1.0, 4), 32, 600, 0);
    let asked = &asked[asked.len() / 2..];
    let wide = asked.iter().filter(|a| a.branch >= 2).count();
    println!(
        "{} requests, {wide} branching, mean nodes {:.1}, mean accepted length {mal:.2}",
        asked.len(),
        mean(asked, |a| a.nodes)
    );
    assert!(wide * 10 >= asked.len() * 9, "{wide} of {}", asked.len());
    assert!(mal > 2.2, "{mal}");
}

#[test]
fn acceptance_at_rank_1_gives_chains_where_a_second_node_does_not_pay() {
    // The proposer of the test above, on a curve where a second row is almost free and a third
    // costs as much as a plain step (10, 10.5, 20 ms, then 9.5 ms per row): one node (1.6
    // tokens for 10.5 ms) beats two (a branching pair, 2 tokens for 20 ms) and plain decoding
    // (1 token for 10 ms), so the policy asks for one-node chains but on its exploring steps.
    let costs = FixedCosts::curve(&[(1, 0.010), (2, 0.0105), (3, 0.020)]).unwrap();
    let (asked, mal) = run_with(Siblings::new(0.6, 1.0, 4), costs, 32, 600, 0);
    let asked = &asked[asked.len() / 2..];
    let chains = asked.iter().filter(|a| a.branch == 1).count();
    let single = asked.iter().filter(|a| a.nodes == 1).count();
    println!(
        "{} requests, {chains} chains, {single} of one node, mean nodes {:.1}, mean accepted \
         length {mal:.2}",
        asked.len(),
        mean(asked, |a| a.nodes)
    );
    assert!(
        chains * 10 >= asked.len() * 9,
        "{chains} of {}",
        asked.len()
    );
    assert!(
        single * 10 >= asked.len() * 9,
        "{single} of {}",
        asked.len()
    );
    // Speculating still pays: most steps are not plain decoding.
    assert!(asked.len() > 150, "{} requests", asked.len());
    assert!(mal > 1.3 && mal < 2.0, "{mal}");
}

#[test]
fn only_rank_0_accepted_gives_chains() {
    // Rank 0 right 85% of the time, rank 1 never: the policy stops asking for siblings but on
    // its exploring steps (one in `probe_interval`).
    let (asked, mal) = run(Siblings::new(0.85, 0.0, 2), 32, 600, 20);
    let chains = asked.iter().filter(|a| a.branch == 1).count();
    println!(
        "{} requests, {chains} chains, mean depth {:.1}, mean accepted length {mal:.2}",
        asked.len(),
        mean(&asked, |a| a.depth)
    );
    assert!(
        chains * 10 >= asked.len() * 8,
        "{chains} of {}",
        asked.len()
    );
    // A chain request asks for exactly its depth.
    assert!(
        asked
            .iter()
            .filter(|a| a.branch == 1)
            .all(|a| a.nodes == a.depth)
    );
    assert!(mean(&asked, |a| a.depth) >= 3.0);
    assert!(mal > 3.0, "{mal}");
}

#[test]
fn the_policy_respects_the_node_budget_branching_token_budget_and_context_room() {
    for (tree_nodes, tree_branch, budget, max_ctx) in [
        (16, 0, 40, 4096),
        (6, 0, 40, 4096),
        (16, 2, 40, 4096),
        (16, 1, 40, 4096),
        (32, 3, 7, 4096),
        (32, 0, 100, 20),
        (64, 0, 100, 11),
    ] {
        let params = GenerationParams::greedy(budget)
            .with_draft(adaptive())
            .with_tree(TreeDrafts::nodes(tree_nodes).with_branch(tree_branch));
        let target = ToyModel::deterministic(7, max_ctx, c10_next).with_tree(64);
        let mut g = Generator::new(CallLog::new(target), Siblings::new(0.9, 1.0, 5));
        let prompt = [2u32, 5, 1];
        let mut s = g.session(&prompt, &params).unwrap();
        let mut context = prompt.len();
        let case = format!("nodes {tree_nodes} branch {tree_branch} budget {budget} ctx {max_ctx}");
        while s.step().unwrap().is_some() {
            let st = s.last_step();
            let remaining = budget - (context - prompt.len());
            let room = max_ctx - context;
            assert!(st.drafted <= tree_nodes.min(room), "{case}: {st:?}");
            assert!(st.depth < remaining.min(room), "{case}: {st:?}");
            context += s.last_chunk().tokens.len();
        }
        let out = s.into_generation();
        let want = (max_ctx - prompt.len()).min(budget);
        assert_eq!(out.tokens.len(), want, "{case}");
        let finish = if budget < max_ctx - prompt.len() {
            FinishReason::MaxTokens
        } else {
            FinishReason::ContextFull
        };
        assert_eq!(out.finish, finish, "{case}");
        for a in &g.proposer().asked {
            let remaining = budget - (a.context - prompt.len());
            let room = max_ctx - a.context;
            assert!(a.nodes <= tree_nodes.min(room), "{case}: {a:?}");
            assert!(
                a.depth < remaining.min(room) && a.depth <= a.nodes,
                "{case}: {a:?}"
            );
            if tree_branch > 0 {
                assert!(a.branch <= tree_branch, "{case}: {a:?}");
            }
        }
        for (_, tokens, parents) in &g.target().trees {
            assert!(tokens.len() <= tree_nodes, "{case}");
            if tree_branch > 0 {
                assert!(branching(parents) <= tree_branch, "{case}");
            }
        }
        assert!(!g.proposer().asked.is_empty(), "{case}: the policy drafted");
    }
}

#[test]
fn greedy_output_with_the_policy_equals_plain_greedy() {
    for salt in 0..5u64 {
        let prompt: Vec<u32> = (0..4).map(|i| ((i * 5 + salt) % 7) as u32).collect();
        let want = plain_greedy(&prompt, 120);
        for (p0, p1) in [(0.9, 1.0), (0.6, 0.5), (0.3, 0.0)] {
            let params = GenerationParams::greedy(120)
                .with_draft(adaptive())
                .with_tree(TreeDrafts::nodes(24));
            let mut g = Generator::new(
                CallLog::new(ToyModel::c10().with_tree(24)),
                Siblings::new(p0, p1, salt),
            );
            let out = g.generate(&prompt, &params).unwrap();
            assert_eq!(out.tokens, want, "salt {salt} p0 {p0} p1 {p1}");
            assert_eq!(g.target().trees.len(), out.metrics.tree_steps);
        }
    }
}

/// Random point-mass trees within the request (distinct siblings) for a vocab-8 model.
struct RandomTree {
    salt: u64,
}

impl Proposer for RandomTree {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let s = Stream::new(self.salt);
        let pos = req.context.len() as u64;
        for i in 0..req.max_draft {
            draft.tokens.push(s.bits(pos, i as u32)[0] % 8);
        }
        Ok(())
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        // Two-wide levels down to the depth, as the budget and branching allow.
        draft.clear();
        let s = Stream::new(self.salt);
        let pos = req.context.len() as u64;
        let mut parent = 0u32;
        for depth in 0..req.max_draft {
            let first = s.bits(pos, depth as u32)[0] % 8;
            for rank in 0..req.max_branch.min(2) as u32 {
                if draft.tokens.len() >= req.max_nodes {
                    return Ok(());
                }
                draft.tokens.push((first + rank) % 8);
                draft.parents.push(parent);
            }
            parent = draft.tokens.len() as u32;
        }
        Ok(())
    }
}

#[test]
fn seeded_sampling_with_the_policy_equals_plain_sampling() {
    // C15: with point-mass trees the tokens are those of plain sampling with the same seed,
    // whatever shape the policy picks each step.
    let cfg = SamplingConfig::builder().temperature(0.8).build().unwrap();
    for seed in 0..6u64 {
        let model = ToyModel::markov(8, 2, 3.0, 5);
        let prompt = [1u32, 2, 3];
        let params = GenerationParams::sampled(cfg.clone(), seed, 60);
        let want = Generator::new(model.clone(), NoProposer)
            .generate(&prompt, &params.clone().with_draft(DraftLength::Off))
            .unwrap()
            .tokens;
        let params = params
            .with_draft(adaptive())
            .with_tree(TreeDrafts::nodes(12));
        let mut g = Generator::new(model.with_tree(12), RandomTree { salt: seed });
        let out = g.generate(&prompt, &params).unwrap();
        assert_eq!(out.tokens, want, "seed {seed}");
    }
}
