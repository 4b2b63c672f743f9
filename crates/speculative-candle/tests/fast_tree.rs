//! Token-tree support of the fast forward (`FastTarget` as a `speculative::TreeTarget`): every
//! node's logits and hidden states equal, bit for bit, those of a chain forward of the root and
//! the node's path; after `commit_tree` the KV cache equals the chain's; truncation and every
//! error. The real-model tests need `models/SmolLM2-135M-Instruct.Q4_1.gguf` (run
//! `scripts/fetch-model.sh` first); the random-weight ones need nothing.

mod common;

use common::Rng;

use std::sync::{Arc, OnceLock};

use speculative::{
    DraftBlock, Error, HiddenStates, SiblingScheme, TargetModel, TreeFault, TreeTarget,
};
use speculative_candle::fast::RandomSpec;
use speculative_candle::{
    CandleError, ChatMessage, FastFormat, FastTarget, FastWeights, GgufTokenizer, KernelPath,
    default_model_path,
};

// ---------------------------------------------------------------- helpers

fn real_weights() -> Arc<FastWeights> {
    static W: OnceLock<Arc<FastWeights>> = OnceLock::new();
    W.get_or_init(|| {
        let p = default_model_path();
        assert!(
            p.is_file(),
            "model file {} is missing: run `scripts/fetch-model.sh` from the repository root \
             (or set SPECULATIVE_MODEL)",
            p.display()
        );
        FastWeights::load(p, FastFormat::Q8).expect("loading the model")
    })
    .clone()
}

fn chat_prompt(question: &str) -> Vec<u32> {
    let tok = GgufTokenizer::load(default_model_path()).expect("loading the tokenizer");
    let text = tok
        .apply_chat_template(&[ChatMessage::user(question)])
        .unwrap();
    tok.encode(&text).unwrap()
}

/// Tree shapes (parent rows, see `speculative::tree`).
#[derive(Debug, Clone, Copy)]
enum Shape {
    /// Every node a child of the root.
    Wide,
    /// A chain.
    Deep,
    /// Each node's parent drawn uniformly from the earlier rows.
    Mixed,
    /// A binary tree in breadth-first order (row `i / 2`).
    Binary,
    /// Three chains from the root, interleaved in node order.
    Branches,
}

const SHAPES: [Shape; 5] = [
    Shape::Wide,
    Shape::Deep,
    Shape::Mixed,
    Shape::Binary,
    Shape::Branches,
];

fn parents(shape: Shape, n: usize, rng: &mut Rng) -> Vec<u32> {
    (0..n)
        .map(|i| match shape {
            Shape::Wide => 0,
            Shape::Deep => i as u32,
            Shape::Mixed => rng.below(i + 1) as u32,
            Shape::Binary => (i / 2) as u32,
            Shape::Branches => {
                if i < 3 {
                    0
                } else {
                    (i - 3 + 1) as u32
                }
            }
        })
        .collect()
}

/// Nodes without children.
fn leaves(block: &DraftBlock<'_>) -> Vec<usize> {
    (0..block.len())
        .filter(|&i| block.children(i + 1).next().is_none())
        .collect()
}

fn path_to(block: &DraftBlock<'_>, node: usize) -> Vec<u32> {
    let mut p = Vec::new();
    block.path_to(node, &mut p);
    p
}

/// Runs a tree forward on a fork of `base` and checks every row against chain forwards (one
/// per leaf, from another fork of `base`): logits and hidden states bit for bit. Returns the
/// model with the tree pending.
fn assert_tree_equals_chains(base: &FastTarget, root: u32, tokens: &[u32], parents: &[u32]) {
    let block = DraftBlock::tree(tokens, parents);
    let mut m = base.fork();
    let (v, h) = (m.vocab_size(), m.hidden_size());
    let mut tree = Vec::new();
    m.tree()
        .unwrap()
        .forward_tree(root, &block, &mut tree)
        .unwrap();
    let n = block.len();
    assert_eq!(tree.len(), (n + 1) * v);
    assert_eq!(m.seq_len(), base.seq_len() + n + 1);
    let tree_hidden = m.last_hidden().unwrap().to_vec();
    assert_eq!(tree_hidden.len(), (n + 1) * h);
    let mut seen = vec![false; n];
    let mut chain_logits = Vec::new();
    let mut leaves = leaves(&block);
    if leaves.is_empty() {
        leaves.push(usize::MAX); // empty block: the root row only
    }
    for leaf in leaves {
        let path = if leaf == usize::MAX {
            Vec::new()
        } else {
            path_to(&block, leaf)
        };
        let mut chain = vec![root];
        chain.extend(path.iter().map(|&j| tokens[j as usize]));
        let mut c = base.fork();
        c.forward(&chain, &mut chain_logits).unwrap();
        let chain_hidden = c.last_hidden().unwrap();
        // Row 0 (the root) and the path's nodes.
        let rows = std::iter::once(0).chain(path.iter().map(|&j| j as usize + 1));
        for (k, row) in rows.enumerate() {
            assert!(
                chain_logits[k * v..(k + 1) * v] == tree[row * v..(row + 1) * v],
                "row {row} (depth {k}) of a tree {parents:?} differs from the chain of its path"
            );
            assert!(
                chain_hidden[k * h..(k + 1) * h] == tree_hidden[row * h..(row + 1) * h],
                "hidden state of row {row} differs from the chain's"
            );
            if row > 0 {
                seen[row - 1] = true;
            }
        }
    }
    assert!(seen.iter().all(|&s| s), "every node is on a leaf's path");
}

/// The chain state a commit of `path` must reproduce: `base` + `[root, path tokens]`.
fn chain_after(base: &FastTarget, root: u32, tokens: &[u32], path: &[u32]) -> FastTarget {
    let mut c = base.fork();
    let mut chain = vec![root];
    chain.extend(path.iter().map(|&j| tokens[j as usize]));
    c.forward(&chain, &mut Vec::new()).unwrap();
    c
}

/// `got` and `want` hold the same sequence: same length, same KV cache (bit for bit), and the
/// same logits for a next forward of `next`.
fn assert_same_state(got: &mut FastTarget, want: &mut FastTarget, next: &[u32], what: &str) {
    assert_eq!(got.seq_len(), want.seq_len(), "{what}: sequence length");
    assert!(
        got.kv_snapshot() == want.kv_snapshot(),
        "{what}: KV cache differs from the chain's"
    );
    let (mut a, mut b) = (Vec::new(), Vec::new());
    got.forward(next, &mut a).unwrap();
    want.forward(next, &mut b).unwrap();
    assert!(a == b, "{what}: next forward's logits differ");
}

/// Paths to commit for a block: empty, the first-child descent, the last-child descent (the
/// path the forward leaves in the cache) and the path to a random node.
fn paths_to_commit(block: &DraftBlock<'_>, rng: &mut Rng) -> Vec<Vec<u32>> {
    let descend = |last: bool| {
        let mut path = Vec::new();
        let mut row = 0;
        loop {
            let kids: Vec<usize> = block.children(row).collect();
            let next = if last { kids.last() } else { kids.first() };
            match next {
                Some(&j) => {
                    path.push(j as u32);
                    row = j + 1;
                }
                None => return path,
            }
        }
    };
    let mut out = vec![Vec::new(), descend(false), descend(true)];
    if !block.is_empty() {
        out.push(path_to(block, rng.below(block.len())));
    }
    out
}

fn random_model(format: FastFormat) -> FastTarget {
    FastTarget::new(FastWeights::random(&RandomSpec::default(), format).unwrap())
}

// ---------------------------------------------------------------- random-weight model

/// Bit-identity and commit on a tiny random model, for both formats, the portable attention
/// kernel (scalar path) and an early-exit model.
#[test]
fn random_model_tree_rows_equal_chains_and_commit_equals_chain() {
    let mut rng = Rng(7);
    for format in [FastFormat::Q8, FastFormat::F32] {
        let w = FastWeights::random(&RandomSpec::default(), format).unwrap();
        let models = [
            FastTarget::new(w.clone()),
            FastTarget::new(w.clone())
                .with_kernel(KernelPath::Scalar)
                .unwrap(),
            FastTarget::early_exit(w, 1).unwrap(),
        ];
        for mut base in models {
            let vocab = base.vocab_size();
            let prefix: Vec<u32> = (0..21).map(|_| rng.below(vocab) as u32).collect();
            base.forward(&prefix, &mut Vec::new()).unwrap();
            for shape in SHAPES {
                for n in [0, 1, 3, 9, 17] {
                    let tokens: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
                    let par = parents(shape, n, &mut rng);
                    let root = rng.below(vocab) as u32;
                    assert_tree_equals_chains(&base, root, &tokens, &par);
                    let block = DraftBlock::tree(&tokens, &par);
                    for path in paths_to_commit(&block, &mut rng) {
                        let mut m = base.fork();
                        m.forward_tree(root, &block, &mut Vec::new()).unwrap();
                        m.commit_tree(&path).unwrap();
                        let mut want = chain_after(&base, root, &tokens, &path);
                        let next = [rng.below(vocab) as u32, rng.below(vocab) as u32];
                        assert_same_state(
                            &mut m,
                            &mut want,
                            &next,
                            &format!("{format:?} {shape:?} n={n} path {path:?}"),
                        );
                    }
                }
            }
        }
    }
}

/// Several tree steps in a row, each committing a random path, keep the cache equal to the
/// chain of the accepted tokens.
#[test]
fn random_model_repeated_tree_steps_track_the_chain() {
    let mut rng = Rng(99);
    let mut tree_model = random_model(FastFormat::Q8);
    let mut chain_model = tree_model.fork();
    let vocab = tree_model.vocab_size();
    let prompt: Vec<u32> = (0..9).map(|_| rng.below(vocab) as u32).collect();
    tree_model.prefill(&prompt).unwrap();
    chain_model.prefill(&prompt).unwrap();
    let mut root = rng.below(vocab) as u32;
    for step in 0..12 {
        let n = 1 + rng.below(12);
        let tokens: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
        let par = parents(SHAPES[step % SHAPES.len()], n, &mut rng);
        let block = DraftBlock::tree(&tokens, &par);
        let mut tree_logits = Vec::new();
        tree_model
            .forward_tree(root, &block, &mut tree_logits)
            .unwrap();
        let path = path_to(&block, rng.below(n));
        tree_model.commit_tree(&path).unwrap();
        let mut chain = vec![root];
        chain.extend(path.iter().map(|&j| tokens[j as usize]));
        let mut chain_logits = Vec::new();
        chain_model.forward(&chain, &mut chain_logits).unwrap();
        let last = *path.last().unwrap() as usize + 1;
        assert!(
            chain_logits[path.len() * vocab..] == tree_logits[last * vocab..(last + 1) * vocab],
            "step {step}"
        );
        assert_eq!(tree_model.seq_len(), chain_model.seq_len());
        assert!(
            tree_model.kv_snapshot() == chain_model.kv_snapshot(),
            "step {step}"
        );
        root = rng.below(vocab) as u32;
    }
}

/// Negative control: the tree row of a node is *not* the chain that also contains an earlier
/// sibling, so the comparison above would catch attention to non-ancestors.
#[test]
fn random_model_tree_rows_do_not_see_siblings() {
    let mut base = random_model(FastFormat::Q8);
    base.forward(&[5, 6, 7, 8], &mut Vec::new()).unwrap();
    let v = base.vocab_size();
    let (tokens, par) = ([11u32, 12], [0u32, 0]);
    let mut tree = Vec::new();
    let mut m = base.fork();
    m.forward_tree(3, &DraftBlock::tree(&tokens, &par), &mut tree)
        .unwrap();
    let mut wrong = Vec::new();
    base.fork().forward(&[3, 11, 12], &mut wrong).unwrap();
    assert!(
        wrong[2 * v..] != tree[2 * v..],
        "node 1 must not attend to node 0"
    );
    let mut right = Vec::new();
    base.fork().forward(&[3, 12], &mut right).unwrap();
    assert!(right[v..] == tree[2 * v..]);
}

/// `truncate` after an uncommitted tree: back to the length before it (or keeping the root)
/// drops the tree; a longer length keeps a chain prefix of nodes and is refused otherwise.
#[test]
fn truncate_undoes_an_uncommitted_tree() {
    let mut rng = Rng(3);
    let mut base = random_model(FastFormat::Q8);
    let vocab = base.vocab_size();
    let prefix: Vec<u32> = (0..12).map(|_| rng.below(vocab) as u32).collect();
    base.forward(&prefix, &mut Vec::new()).unwrap();
    let p = base.seq_len();
    let tokens: Vec<u32> = (0..7).map(|_| rng.below(vocab) as u32).collect();
    let mixed = [0u32, 1, 2, 0, 4, 2, 6];
    let block = DraftBlock::tree(&tokens, &mixed);
    let next = [1u32, 2, 3];
    for len in [0, p - 5, p, p + 1] {
        let mut m = base.fork();
        m.forward_tree(9, &block, &mut Vec::new()).unwrap();
        m.truncate(len).unwrap();
        let mut want = base.fork();
        if len == p + 1 {
            want.forward(&[9], &mut Vec::new()).unwrap();
        } else {
            want.truncate(len).unwrap();
        }
        assert_same_state(&mut m, &mut want, &next, &format!("truncate({len})"));
        // No tree is pending any more.
        assert!(matches!(
            m.commit_tree(&[]),
            Err(Error::TargetContract { .. })
        ));
    }
    // Nodes 0, 1, 2 are a chain: truncate(p + 4) keeps them, like commit_tree(&[0, 1, 2]).
    let mut m = base.fork();
    m.forward_tree(9, &block, &mut Vec::new()).unwrap();
    m.truncate(p + 4).unwrap();
    let mut want = chain_after(&base, 9, &tokens, &[0, 1, 2]);
    assert_same_state(&mut m, &mut want, &next, "truncate into a chain prefix");
    // Node 3 is a child of the root, not of node 2: truncate(p + 5) is refused, nothing changes.
    let mut m = base.fork();
    m.forward_tree(9, &block, &mut Vec::new()).unwrap();
    let e = m.truncate(p + 5).unwrap_err();
    assert!(e.to_string().contains("not a chain"), "{e}");
    assert_eq!(m.seq_len(), p + 8);
    m.commit_tree(&[3, 4]).unwrap();
    let mut want = chain_after(&base, 9, &tokens, &[3, 4]);
    assert_same_state(&mut m, &mut want, &next, "commit after a refused truncate");
    // A fork carries the pending tree; a refused path keeps it pending.
    let mut m = base.fork();
    m.forward_tree(9, &block, &mut Vec::new()).unwrap();
    let mut f = m.fork();
    f.commit_tree(&[0, 1, 5]).unwrap();
    let mut want = chain_after(&base, 9, &tokens, &[0, 1, 5]);
    assert_same_state(&mut f, &mut want, &next, "commit on a fork");
    assert!(matches!(
        f.commit_tree(&[]),
        Err(Error::TargetContract { .. })
    ));
    assert!(matches!(
        m.commit_tree(&[2, 5]),
        Err(Error::TargetContract { .. })
    ));
    m.commit_tree(&[3, 4]).unwrap();
    let mut want = chain_after(&base, 9, &tokens, &[3, 4]);
    assert_same_state(&mut m, &mut want, &next, "commit after a refused path");
}

#[test]
fn every_error_is_typed_and_keeps_the_sequence() {
    let spec = RandomSpec {
        context: 32,
        ..RandomSpec::default()
    };
    let w = FastWeights::random(&spec, FastFormat::Q8).unwrap();
    let mut m = FastTarget::new(w.clone()).with_max_tree_nodes(6);
    assert_eq!(m.tree().unwrap().max_tree_nodes(), 6);
    assert_eq!(
        FastTarget::new(w.clone()).max_tree_nodes(),
        speculative_candle::fast::DEFAULT_MAX_TREE_NODES
    );
    assert!(
        FastTarget::new(w.clone())
            .with_max_tree_nodes(0)
            .tree()
            .is_none()
    );
    m.forward(&[1, 2, 3, 4], &mut Vec::new()).unwrap();
    let snap = m.kv_snapshot();
    let mut logits = vec![1.0];
    let tree_err = |m: &mut FastTarget, tokens: &[u32], parents: &[u32]| {
        m.forward_tree(0, &DraftBlock::tree(tokens, parents), &mut Vec::new())
            .unwrap_err()
    };
    // Invalid trees.
    let faults = [
        tree_err(&mut m, &[1, 2], &[0]),
        tree_err(&mut m, &[1, 2], &[0, 2]),
        tree_err(&mut m, &[1, 301], &[0, 1]),
        tree_err(&mut m, &[1; 7], &[0; 7]),
    ];
    assert!(matches!(
        faults[0],
        Error::InvalidTree(TreeFault::Shape { .. })
    ));
    assert!(matches!(
        faults[1],
        Error::InvalidTree(TreeFault::ParentNotBefore { node: 1, parent: 2 })
    ));
    assert!(matches!(
        faults[2],
        Error::InvalidTree(TreeFault::TokenOutOfVocab { node: 1, .. })
    ));
    assert!(matches!(
        faults[3],
        Error::InvalidTree(TreeFault::TooManyNodes { nodes: 7, max: 6 })
    ));
    let det = [SiblingScheme::Deterministic; 2];
    let e = m
        .forward_tree(
            0,
            &DraftBlock::tree(&[5, 5], &[0, 0]).with_schemes(&det),
            &mut logits,
        )
        .unwrap_err();
    assert!(matches!(
        e,
        Error::InvalidTree(TreeFault::DuplicateSiblings { node: 1, token: 5 })
    ));
    // Sampled sibling schemes (and duplicates drawn with replacement) are fine.
    let wr = [SiblingScheme::WithReplacement; 2];
    m.fork()
        .forward_tree(
            0,
            &DraftBlock::tree(&[5, 5], &[0, 0]).with_schemes(&wr),
            &mut logits,
        )
        .unwrap();
    // Engine errors: root outside the vocabulary, context overflow (counting every node).
    let e = m
        .forward_tree(301, &DraftBlock::chain(&[1]), &mut logits)
        .unwrap_err();
    assert!(
        matches!(e, Error::Model(_)) && e.to_string().contains("vocabulary"),
        "{e}"
    );
    let mut long = m.fork();
    long.forward(&[1; 24], &mut logits).unwrap();
    let e = long
        .forward_tree(
            1,
            &DraftBlock::tree(&[1, 2, 3, 4], &[0, 0, 0, 0]),
            &mut logits,
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::Model(_)) && e.to_string().contains("context overflow"),
        "{e}"
    );
    assert_eq!(long.seq_len(), 28);
    long.forward_tree(1, &DraftBlock::tree(&[1, 2, 3], &[0, 0, 0]), &mut logits)
        .unwrap();
    assert_eq!(long.seq_len(), 32);
    // Commit without a pending tree.
    assert!(matches!(
        m.commit_tree(&[]),
        Err(Error::TargetContract { .. })
    ));
    assert_eq!(m.seq_len(), 4);
    assert!(m.kv_snapshot() == snap);
    // A pending tree: paths that are not paths of it, forwards before the commit.
    let tokens = [7u32, 8, 9, 10];
    let par = [0u32, 1, 0, 3];
    m.forward_tree(6, &DraftBlock::tree(&tokens, &par), &mut logits)
        .unwrap();
    assert_eq!(m.seq_len(), 9);
    for bad in [&[1u32][..], &[0, 2], &[0, 1, 2], &[4], &[2, 1], &[0, 0]] {
        assert!(
            matches!(m.commit_tree(bad), Err(Error::TargetContract { .. })),
            "{bad:?}"
        );
        assert_eq!(m.seq_len(), 9);
    }
    let e = m.forward(&[1], &mut logits).unwrap_err();
    assert!(
        matches!(e, Error::Model(_)) && e.to_string().contains("commit_tree"),
        "{e}"
    );
    assert!(m.prefill(&[1]).is_err());
    assert!(
        m.forward_tree(1, &DraftBlock::chain(&[1]), &mut logits)
            .is_err()
    );
    assert!(matches!(
        m.truncate_to(10),
        Err(CandleError::TruncateBeyondEnd { .. })
    ));
    assert_eq!(m.seq_len(), 9);
    m.commit_tree(&[2, 3]).unwrap();
    assert_eq!(m.seq_len(), 7);
    let mut want = FastTarget::new(w);
    want.forward(&[1, 2, 3, 4, 6, 9, 10], &mut Vec::new())
        .unwrap();
    assert!(m.kv_snapshot() == want.kv_snapshot());
}

// ---------------------------------------------------------------- real model

/// SmolLM2-135M (Q8): random trees of up to 32 nodes in five shapes, random tokens; every
/// node's logits and hidden state equal the chain's bit for bit.
#[test]
fn real_model_tree_rows_equal_chains() {
    let mut base = FastTarget::new(real_weights());
    let prompt = chat_prompt("List four facts about lighthouses and the people who kept them.");
    base.prefill(&prompt).unwrap();
    let vocab = base.vocab_size();
    let mut rng = Rng(2024);
    for (k, n) in [32, 24, 16, 8, 3].into_iter().enumerate() {
        for shape in SHAPES {
            // Fewer large wide trees: each leaf costs a chain forward.
            if matches!(shape, Shape::Wide) && k % 2 == 1 {
                continue;
            }
            let tokens: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
            let par = parents(shape, n, &mut rng);
            let root = rng.below(vocab) as u32;
            assert_tree_equals_chains(&base, root, &tokens, &par);
        }
    }
}

/// SmolLM2-135M: after `commit_tree` of random paths (empty, first-child and last-child
/// descents, a random node) the cache equals the chain's, compared directly and through the
/// next forward's logits.
#[test]
fn real_model_commit_equals_chain() {
    let mut base = FastTarget::new(real_weights());
    let prompt = chat_prompt("Write two sentences about the sea.");
    base.prefill(&prompt).unwrap();
    let vocab = base.vocab_size();
    let mut rng = Rng(17);
    for (shape, n) in [
        (Shape::Mixed, 32),
        (Shape::Binary, 20),
        (Shape::Branches, 12),
    ] {
        let tokens: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
        let par = parents(shape, n, &mut rng);
        let root = rng.below(vocab) as u32;
        let block = DraftBlock::tree(&tokens, &par);
        for path in paths_to_commit(&block, &mut rng) {
            let mut m = base.fork();
            m.forward_tree(root, &block, &mut Vec::new()).unwrap();
            m.commit_tree(&path).unwrap();
            assert_eq!(m.seq_len(), base.seq_len() + 1 + path.len());
            let mut want = chain_after(&base, root, &tokens, &path);
            let next = [rng.below(vocab) as u32, rng.below(vocab) as u32];
            assert_same_state(
                &mut m,
                &mut want,
                &next,
                &format!("{shape:?} n={n} path {path:?}"),
            );
        }
    }
}
