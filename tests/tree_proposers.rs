//! Tree drafts of the model-free proposers ([`PromptLookup`], [`SuffixProposer`]) against the
//! contract of `Proposer::propose_tree`: a valid tree (node budget, depth, distinct siblings,
//! topological order, point masses), no node after an EOS on any branch, the chain special
//! cases, the chain contained as a path, every path a real candidate, and stale state rebuilt.
//!
//! What "a tree never accepts less than the chain" means here, precisely: when
//! `max_nodes > max_draft`, the tree holds the chain that `propose` returns for the same
//! request as nodes `0 .. L` (node `i` the child of node `i - 1`), so for every true
//! continuation the longest tree path that matches it under greedy verification is at least
//! as long as the chain's matched prefix, at the same step. When `max_nodes <= max_draft` the
//! tree *is* the chain of `max_draft = max_nodes` (not of `max_draft`), so the statement is
//! about that chain.

use proptest::prelude::*;
use speculative::propose::{PromptLookup, PromptLookupConfig, SuffixConfig, SuffixProposer};
use speculative::tree::{DraftBlock, TreeLimits};
use speculative::{Draft, ProposeRequest, Proposer, SamplingConfig};

/// Vocabulary of the random contexts (small, so that n-grams repeat).
const VOCAB: u32 = 5;

fn request<'a>(
    context: &'a [u32],
    config: &'a SamplingConfig,
    k: usize,
    nodes: usize,
    eos: &'a [u32],
) -> ProposeRequest<'a> {
    ProposeRequest::new(context, config, k)
        .max_nodes(nodes)
        .eos(eos)
}

fn tree(p: &mut dyn Proposer, context: &[u32], k: usize, nodes: usize, eos: &[u32]) -> Draft {
    tree_branch(p, context, k, nodes, usize::MAX, eos)
}

fn tree_branch(
    p: &mut dyn Proposer,
    context: &[u32],
    k: usize,
    nodes: usize,
    branch: usize,
    eos: &[u32],
) -> Draft {
    let config = SamplingConfig::greedy();
    let mut d = Draft::tree(vec![4; 9], vec![0; 9]);
    let req = request(context, &config, k, nodes, eos).max_branch(branch);
    p.propose_tree(&req, &mut d).unwrap();
    d
}

fn chain(p: &mut dyn Proposer, context: &[u32], k: usize, eos: &[u32]) -> Vec<u32> {
    let config = SamplingConfig::greedy();
    let mut d = Draft::default();
    p.propose(&request(context, &config, k, k, eos), &mut d)
        .unwrap();
    assert!(d.parents.is_empty());
    d.tokens
}

/// The token paths from the root to every node, `[n]`.
fn paths(d: &Draft) -> Vec<Vec<u32>> {
    let block = d.block();
    let mut idx = Vec::new();
    (0..d.len())
        .map(|i| {
            block.path_to(i, &mut idx);
            idx.iter().map(|&j| d.tokens[j as usize]).collect()
        })
        .collect()
}

/// Greedy acceptance of a block against `truth`: the longest matching root-to-node path.
fn accepted(block: &DraftBlock<'_>, truth: &[u32]) -> usize {
    let (mut row, mut a) = (0, 0);
    while let Some(j) = truth
        .get(a)
        .and_then(|&t| block.children(row).find(|&j| block.tokens()[j] == t))
    {
        a += 1;
        row = j + 1;
    }
    a
}

/// The checks every tree draft must pass, whatever the proposer.
fn check_tree(d: &Draft, k: usize, nodes: usize, eos: &[u32]) -> std::result::Result<(), String> {
    // Token ids of these tests stay below 16.
    let limits = TreeLimits::vocab(16)
        .with_max_nodes(nodes)
        .with_max_depth(k);
    d.block()
        .validate(&limits)
        .map_err(|e| format!("invalid tree {d:?}: {e}"))?;
    if d.q.is_some() || !d.schemes.is_empty() {
        return Err("a model-free tree is point masses with the default scheme".into());
    }
    if !d.parents.is_empty() && d.parents.len() != d.len() {
        return Err("parents must be empty (chain) or one per node".into());
    }
    if !d.parents.is_empty() && d.block().is_chain() {
        return Err("a single path is returned in the chain form".into());
    }
    let block = d.block();
    for i in 0..d.len() {
        if eos.contains(&d.tokens[i]) && block.children(i + 1).next().is_some() {
            return Err(format!("node {i} is an EOS with children: {d:?}"));
        }
    }
    Ok(())
}

fn suffix_with(corpus: &[Vec<u32>], cfg: SuffixConfig) -> SuffixProposer {
    let mut p = SuffixProposer::new(cfg).unwrap();
    for g in corpus {
        p.add_to_corpus(g);
    }
    p
}

/// The proposers of one proptest case: prompt lookup with `(min_n, max_n, periodic)` and suffix
/// with `corpus` and `min_confidence`.
fn proposers(
    min_n: usize,
    extra: usize,
    periodic: bool,
    corpus: &[Vec<u32>],
    min_confidence: f32,
) -> Vec<Box<dyn Proposer>> {
    let pl = PromptLookup::from_config(
        PromptLookupConfig::default()
            .with_min_n(min_n)
            .with_max_n(min_n + extra)
            .with_periodic(periodic),
    )
    .unwrap();
    let cfg = SuffixConfig::default()
        .with_max_depth(8)
        .with_max_match_len(4)
        .with_min_confidence(min_confidence);
    vec![Box::new(pl), Box::new(suffix_with(corpus, cfg))]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Fuzz: random contexts, corpora, budgets, depths and EOS sets give valid trees, with no
    /// node after an EOS; `max_nodes <= max_draft` gives the chain of `max_draft = max_nodes`;
    /// otherwise the chain of `max_draft` is nodes `0 .. L` of the tree; and the tree never
    /// accepts less than that chain against any continuation.
    #[test]
    fn trees_are_valid_and_contain_the_chain(
        context in proptest::collection::vec(0u32..VOCAB, 0..80),
        corpus in proptest::collection::vec(proptest::collection::vec(0u32..VOCAB, 0..16), 0..4),
        min_n in 1usize..3,
        extra in 0usize..3,
        periodic in any::<bool>(),
        min_confidence in prop_oneof![Just(0.0f32), 0.0f32..0.5],
        k in 0usize..10,
        nodes in 0usize..40,
        eos in proptest::collection::vec(0u32..VOCAB, 0..2),
        truth in proptest::collection::vec(0u32..VOCAB, 0..10),
    ) {
        for mut p in proposers(min_n, extra, periodic, &corpus, min_confidence) {
            let d = tree(&mut *p, &context, k, nodes, &eos);
            prop_assert_eq!(check_tree(&d, k, nodes, &eos), Ok(()), "{}", p.name());
            if nodes <= k {
                prop_assert!(d.parents.is_empty());
                prop_assert_eq!(&d.tokens, &chain(&mut *p, &context, nodes, &eos), "{}", p.name());
            } else {
                let c = chain(&mut *p, &context, k, &eos);
                prop_assert_eq!(&d.tokens[..c.len()], &c[..], "{}", p.name());
                if !d.parents.is_empty() {
                    let rows: Vec<u32> = (0..c.len() as u32).collect();
                    prop_assert_eq!(&d.parents[..c.len()], &rows[..]);
                }
                let a_chain = c.iter().zip(&truth).take_while(|(x, y)| x == y).count();
                prop_assert!(accepted(&d.block(), &truth) >= a_chain);
            }
        }
    }

    /// The branching limit: every node (the root included) has at most `branch` children, the
    /// tree stays valid and still starts with the chain, and a limit of 1 gives the chain.
    #[test]
    fn trees_respect_the_branching_limit(
        context in proptest::collection::vec(0u32..VOCAB, 0..80),
        corpus in proptest::collection::vec(proptest::collection::vec(0u32..VOCAB, 0..16), 0..4),
        min_n in 1usize..3,
        k in 1usize..8,
        nodes in 0usize..40,
        branch in 1usize..4,
        eos in proptest::collection::vec(0u32..VOCAB, 0..2),
    ) {
        for mut p in proposers(min_n, 1, false, &corpus, 0.0) {
            let d = tree_branch(&mut *p, &context, k, nodes, branch, &eos);
            prop_assert_eq!(check_tree(&d, k, nodes, &eos), Ok(()), "{}", p.name());
            let limits = TreeLimits::vocab(16).with_max_branch(branch);
            prop_assert_eq!(d.block().validate(&limits), Ok(()), "{} {:?}", p.name(), d);
            let c = chain(&mut *p, &context, k.min(nodes), &eos);
            prop_assert_eq!(&d.tokens[..c.len()], &c[..], "{}", p.name());
            if branch == 1 {
                prop_assert!(d.parents.is_empty(), "{}: {:?}", p.name(), d);
            }
            // The limit only removes branches: the unlimited tree is never smaller.
            let wide = tree(&mut *p, &context, k, nodes, &eos);
            prop_assert!(wide.len() >= d.len());
        }
    }

    /// Every path of a prompt-lookup tree is a prefix of what followed an earlier occurrence
    /// of a trailing n-gram of `min_n ..= max_n` tokens (cut at its first EOS, cycled with
    /// periodic extension), and paths are distinct (a prefix tree).
    #[test]
    fn prompt_lookup_paths_are_real_continuations(
        context in proptest::collection::vec(0u32..VOCAB, 0..80),
        min_n in 1usize..3,
        extra in 0usize..3,
        periodic in any::<bool>(),
        k in 1usize..10,
        nodes in 0usize..40,
        eos in proptest::collection::vec(0u32..VOCAB, 0..2),
    ) {
        let max_n = min_n + extra;
        let mut p = PromptLookup::new(min_n, max_n).unwrap().periodic_extension(periodic);
        let d = tree(&mut p, &context, k, nodes, &eos);
        let len = context.len();
        let mut seen: Vec<Vec<u32>> = Vec::new();
        for path in paths(&d) {
            let found = (min_n..=max_n.min(len)).any(|n| {
                (n..len).any(|e| {
                    if context[e - n..e] != context[len - n..] {
                        return false;
                    }
                    let mut cont: Vec<u32> = if periodic {
                        context[e..].iter().cycle().take(k).copied().collect()
                    } else {
                        context[e..len.min(e + k)].to_vec()
                    };
                    if let Some(i) = cont.iter().position(|t| eos.contains(t)) {
                        cont.truncate(i + 1);
                    }
                    cont.starts_with(&path)
                })
            });
            prop_assert!(found, "path {:?} of {:?}", path, d);
            prop_assert!(!seen.contains(&path), "duplicate path {:?}", path);
            seen.push(path);
        }
    }

    /// Stale state: a tree on a context after an unrelated request equals a fresh proposer's
    /// tree on it (the shared suffix corpus is kept, as for chains).
    #[test]
    fn stale_state_is_rebuilt_for_trees(
        a in proptest::collection::vec(0u32..VOCAB, 0..60),
        b in proptest::collection::vec(0u32..VOCAB, 0..60),
        corpus in proptest::collection::vec(proptest::collection::vec(0u32..VOCAB, 0..16), 0..3),
        k in 0usize..8,
        nodes in 0usize..30,
    ) {
        let fresh = || proposers(1, 2, false, &corpus, 0.0);
        for (mut used, mut new) in fresh().into_iter().zip(fresh()) {
            tree(&mut *used, &a, k, nodes, &[]);
            let got = tree(&mut *used, &b, k, nodes, &[]);
            prop_assert_eq!(&got, &tree(&mut *new, &b, k, nodes, &[]), "{}", used.name());
            // A prefix of b (the context shrank) as well.
            let cut = &b[..b.len() / 2];
            prop_assert_eq!(tree(&mut *used, cut, k, nodes, &[]), tree(&mut *new, cut, k, nodes, &[]));
        }
    }
}

#[test]
fn prompt_lookup_tree_merges_matches_into_a_prefix_tree() {
    // After [1, 2]: "3 4 9" (oldest), "3 5 9", "6 9" (newest: the chain).
    let ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 6, 9, 1, 2];
    let mut p = PromptLookup::new(2, 2).unwrap();
    assert_eq!(chain(&mut p, &ctx, 3, &[]), [6, 9, 1]);
    let d = tree(&mut p, &ctx, 3, 8, &[]);
    // The two "3 ..." continuations share their first node.
    assert_eq!(d.tokens, [6, 9, 1, 3, 5, 4, 9, 9]);
    assert_eq!(d.parents, [0, 1, 2, 0, 4, 4, 5, 6]);
    assert_eq!(
        paths(&d)[3..],
        [
            vec![3],
            vec![3, 5],
            vec![3, 4],
            vec![3, 5, 9],
            vec![3, 4, 9]
        ]
    );
    // Greedy acceptance: the true continuation "3 4 9" is accepted whole (the chain: 0).
    assert_eq!(accepted(&d.block(), &[3, 4, 9, 7]), 3);
    // EOS 3 ends both "3" branches at the 3; EOS 9 ends the chain after its 9.
    let d = tree(&mut p, &ctx, 3, 8, &[3, 9]);
    assert_eq!(
        (d.tokens.as_slice(), d.parents.as_slice()),
        (&[6, 9, 3][..], &[0, 1, 0][..])
    );
}

#[test]
fn suffix_tree_merges_request_and_corpus_candidates() {
    let corpus = [vec![1, 2, 3, 4], vec![1, 2, 6]];
    let cfg = SuffixConfig::default()
        .with_max_depth(8)
        .with_max_match_len(4)
        .with_min_confidence(0.0);
    let mut p = suffix_with(&corpus, cfg);
    let ctx = [7, 1, 2, 3, 8, 1, 2];
    assert_eq!(chain(&mut p, &ctx, 3, &[]), [3, 8, 1]);
    let d = tree(&mut p, &ctx, 3, 6, &[]);
    // The corpus's "3" is the chain's first node; its "3 4" and "6" are new.
    assert_eq!(d.tokens, [3, 8, 1, 6, 4]);
    assert_eq!(d.parents, [0, 1, 2, 0, 1]);
    assert_eq!(check_tree(&d, 3, 6, &[]), Ok(()));
}

#[test]
fn a_single_continuation_is_the_chain() {
    let ctx = [0, 1, 2, 3, 4, 0, 1];
    let mut ps: Vec<Box<dyn Proposer>> = vec![
        Box::new(PromptLookup::new(1, 3).unwrap()),
        Box::new(SuffixProposer::new(SuffixConfig::default()).unwrap()),
    ];
    for p in &mut ps {
        let d = tree(&mut **p, &ctx, 3, 32, &[]);
        assert!(d.parents.is_empty(), "{}", p.name());
        assert_eq!(d.tokens, [2, 3, 4], "{}", p.name());
        // Through a Box<dyn Proposer> as well (the forwarding impl).
        let mut boxed: Box<dyn Proposer> = Box::new(&mut **p);
        assert_eq!(tree(&mut *boxed, &ctx, 3, 32, &[]), d);
    }
}
