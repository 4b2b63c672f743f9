//! Greedy tree verification on toy targets is plain greedy decoding.
//!
//! For random trees over [`ToyModel`] targets (random order-3 Markov models, and tie-heavy tables
//! of logits with `-inf` entries), with random penalties, bias and masks at temperature 0, a
//! prompt length, `min_tokens` suppression (by depth), and an EOS whose nodes end the step: the tokens a greedy tree step emits are the first tokens of
//! plain greedy decoding from the same context (argmax of every processed row, the history being
//! the context plus the tokens before it), and the accepted path is the longest path of the tree
//! that follows plain greedy decoding, so the verifier never stops before a matching child.
//! Half of the sibling groups contain the greedy token of their row so that long paths and bonus
//! tokens occur. Groups are deterministic (point masses, distinct siblings) or, with dense q,
//! sampled with replacement (duplicates allowed; then only the tokens and the path's shape are
//! checked, since a duplicate's subtree may be the deeper one).

mod common;

use std::sync::Arc;

use common::steps::{Params, logit, params};
use common::tree::{DET, SplitMix, WR};
use proptest::collection::vec;
use proptest::prelude::*;
use speculative::DraftBlock;
use speculative::sampling::{History, RowProcessor, TokenCounts};
use speculative::test_util::ToyModel;
use speculative::{
    DraftProbs, RowKind, SamplingConfig, SiblingScheme, StepEnd, Verifier, VerifyRequest,
};

#[derive(Debug, Clone)]
struct GreedyCase {
    vocab: usize,
    /// Seed of the Markov model; `None`: the tie-heavy table below.
    markov: Option<u64>,
    /// `[vocab * vocab]` rows keyed by the last token (tie-heavy target).
    table: Vec<f32>,
    params: Params,
    tree_seed: u64,
    sampled: bool,
    eos: Option<u32>,
    extra: Extra,
}

fn greedy_case() -> impl Strategy<Value = GreedyCase> {
    (3usize..=12)
        .prop_flat_map(|vocab| {
            (
                Just(vocab),
                prop_oneof![Just(None), any::<u64>().prop_map(Some)],
                vec(logit(), vocab * vocab),
                params(vocab, true),
                (0..vocab as u32, any::<u64>(), any::<bool>()),
                prop_oneof![2 => Just(None), 1 => (0..vocab as u32).prop_map(Some)],
                (0usize..=10, vec(0..vocab as u32, 0..3), 0usize..4),
            )
        })
        .prop_map(
            |(
                vocab,
                markov,
                mut table,
                mut params,
                (keep, tree_seed, sampled),
                eos,
                (prompt_len, mut suppress, suppress_rows),
            )| {
                for r in 0..vocab {
                    table[r * vocab + keep as usize] = 0.5;
                }
                params.protect(keep);
                params.temperature = 0.0;
                suppress.retain(|&t| t != keep);
                let extra = Extra {
                    ctx_len: params.context.len(),
                    prompt_len: prompt_len.min(params.context.len()),
                    suppress,
                    suppress_rows,
                };
                GreedyCase {
                    vocab,
                    markov,
                    table,
                    params,
                    tree_seed,
                    sampled,
                    eos,
                    extra,
                }
            },
        )
}

impl GreedyCase {
    fn model(&self) -> ToyModel {
        match self.markov {
            Some(seed) => ToyModel::markov(self.vocab, 3, 2.0, seed),
            None => {
                let (v, t) = (self.vocab, self.table.clone());
                ToyModel::new(
                    v,
                    1 << 16,
                    Arc::new(move |s: &[u32]| {
                        let last = s.last().copied().unwrap_or(0) as usize;
                        t[last * v..(last + 1) * v].to_vec()
                    }),
                )
            }
        }
    }
}

/// What the request adds to a row's history: the prompt length (frequency and presence
/// penalties skip the prompt) and the tokens suppressed at depths `0..suppress_rows` after a
/// context of `ctx_len` tokens.
#[derive(Debug, Clone, Default)]
struct Extra {
    ctx_len: usize,
    prompt_len: usize,
    suppress: Vec<u32>,
    suppress_rows: usize,
}

/// The greedy token after `seq` (the context and the tokens after it), the documented
/// processing written out with the library's row processor.
fn argmax(cfg: &SamplingConfig, model: &ToyModel, seq: &[u32], x: &Extra) -> u32 {
    let row = model.logits(seq);
    let counts = TokenCounts::from_context(seq, x.prompt_len, row.len()).unwrap();
    let hist = History {
        counts: Some(&counts),
        prefix: seq,
        suppress: if seq.len() - x.ctx_len < x.suppress_rows {
            &x.suppress
        } else {
            &[]
        },
    };
    RowProcessor::new()
        .argmax(cfg, &row, &hist, RowKind::Target, 0)
        .unwrap()
}

/// A drafted tree: tokens, parent rows, schemes, ends and the `[n + 1, vocab]` target rows.
struct Tree {
    tokens: Vec<u32>,
    parents: Vec<u32>,
    schemes: Vec<SiblingScheme>,
    ends: Vec<bool>,
    target: Vec<f32>,
}

/// A random tree after `ctx`: depth up to 5, up to 3 siblings per group, at most 40 nodes; each
/// group holds its row's greedy token with probability 1/2.
fn draft(case: &GreedyCase, cfg: &SamplingConfig, model: &ToyModel, ctx: &[u32]) -> Tree {
    let v = case.vocab;
    let mut rng = SplitMix(case.tree_seed);
    let scheme = if case.sampled { WR } else { DET };
    let mut t = Tree {
        tokens: vec![],
        parents: vec![],
        schemes: vec![],
        ends: vec![],
        target: model.logits(ctx),
    };
    // (row, path tokens after ctx)
    let mut open: Vec<(usize, Vec<u32>)> = vec![(0, vec![])];
    let mut next = 0;
    while next < open.len() {
        let (row, path) = open[next].clone();
        next += 1;
        if path.len() >= 5 || t.tokens.len() >= 40 || (row != 0 && rng.below(100) >= 70) {
            continue;
        }
        let m = (1 + rng.below(3) as usize).min(40 - t.tokens.len()).min(v);
        let mut seq = ctx.to_vec();
        seq.extend_from_slice(&path);
        let mut group: Vec<u32> = Vec::new();
        for _ in 0..m {
            let mut x = rng.below(v as u64) as u32;
            if scheme == DET {
                while group.contains(&x) {
                    x = (x + 1) % v as u32;
                }
            }
            group.push(x);
        }
        if rng.below(2) == 0 {
            let g = argmax(cfg, model, &seq, &case.extra);
            if !group.contains(&g) {
                let j = rng.below(m as u64) as usize;
                group[j] = g;
            }
        }
        for x in group {
            let node = t.tokens.len();
            t.tokens.push(x);
            t.parents.push(row as u32);
            t.schemes.push(scheme);
            let ends = case.eos == Some(x);
            t.ends.push(ends);
            let mut p2 = path.clone();
            p2.push(x);
            let mut s2 = seq.clone();
            s2.push(x);
            t.target.extend(model.logits(&s2));
            if !ends {
                open.push((node + 1, p2));
            }
        }
    }
    // A tree in the shape of a chain whose final node ends reads no row after it.
    let rows = DraftBlock::tree(&t.tokens, &t.parents)
        .with_ends(&t.ends)
        .verify_rows();
    t.target.truncate(rows * v);
    t
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn greedy_tree_is_plain_greedy(case in greedy_case()) {
        let cfg = case.params.config();
        let model = case.model();
        let v = case.vocab;
        let ctx = case.params.context.clone();
        let tree = draft(&case, &cfg, &model, &ctx);
        let q = vec![1.0 / v as f32; tree.tokens.len() * v];
        let dp = if case.sampled {
            DraftProbs::Probs { probs: &q, vocab: v }
        } else {
            DraftProbs::PointMass
        };
        let req = VerifyRequest::new(&cfg, &tree.target, v, &tree.tokens)
.draft(DraftBlock::tree(&tree.tokens, &tree.parents).with_schemes(&tree.schemes).with_ends(&tree.ends))
.draft_probs(dp)
.context(&ctx)
.seed(case.tree_seed)
.prompt_len(case.extra.prompt_len)
.suppress(&case.extra.suppress, case.extra.suppress_rows);
        let out = Verifier::new().verify(&req).unwrap();

        // Plain greedy decoding from the same context.
        let mut seq = ctx.clone();
        for (i, &t) in out.tokens.iter().enumerate() {
            let g = argmax(&cfg, &model, &seq, &case.extra);
            prop_assert_eq!(t, g, "token {} of {:?}", i, out);
            seq.push(g);
        }
        // The path: a path of the tree, carrying the accepted tokens.
        prop_assert_eq!(out.path.len(), out.accepted);
        for (i, &n) in out.path.iter().enumerate() {
            let parent = if i == 0 { 0 } else { out.path[i - 1] + 1 };
            prop_assert_eq!(tree.parents[n as usize], parent, "{:?}", out);
            prop_assert_eq!(tree.tokens[n as usize], out.tokens[i]);
        }
        let ended = out.accepted > 0 && tree.ends[*out.path.last().unwrap() as usize];
        prop_assert_eq!(ended, out.end == StepEnd::Ended, "{:?}", out);
        prop_assert_eq!(out.tokens.len(), out.accepted + usize::from(!ended), "{:?}", out);
        if ended {
            prop_assert_eq!(case.eos, Some(out.tokens[out.accepted - 1]));
        }
        // The longest path that follows greedy decoding (siblings distinct: it is unique).
        if !case.sampled {
            let mut row = 0usize;
            let mut longest = Vec::new();
            let mut seq = ctx.clone();
            loop {
                let g = argmax(&cfg, &model, &seq, &case.extra);
                let child = (0..tree.tokens.len())
                    .find(|&i| tree.parents[i] as usize == row && tree.tokens[i] == g);
                match child {
                    Some(n) => {
                        longest.push(n as u32);
                        seq.push(g);
                        if tree.ends[n] {
                            break;
                        }
                        row = n + 1;
                    }
                    None => break,
                }
            }
            prop_assert_eq!(&out.path, &longest, "{:?}", out);
        }
    }
}

/// A tree with no node is a plain greedy step.
#[test]
fn empty_tree_is_a_plain_step() {
    let cfg = SamplingConfig::greedy();
    let model = ToyModel::markov(7, 3, 2.0, 5);
    let ctx = [1u32, 2, 3];
    let row = model.logits(&ctx);
    let out = Verifier::new()
        .verify(
            &VerifyRequest::new(&cfg, &row, 7, &[])
                .draft(DraftBlock::tree(&[], &[]))
                .context(&ctx),
        )
        .unwrap();
    let x = Extra {
        ctx_len: 3,
        ..Extra::default()
    };
    assert_eq!(out.tokens, vec![argmax(&cfg, &model, &ctx, &x)]);
    assert_eq!(out.end, StepEnd::NoDraft);
    assert!(out.path.is_empty());
}
