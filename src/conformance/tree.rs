//! The [`TreeTarget`](crate::TreeTarget) family: node rows, commit, truncate, invalid trees.

use super::report::{Outcome, Report};
use super::util::{
    Fail, compare_rows, last_row, ok, prompt_input, prompts, record, same_len, seq_is, token,
};
use super::{KitConfig, Tolerance};
use crate::error::Error;
use crate::model::TargetModel;
use crate::tree::{DraftBlock, SiblingScheme};

type Check = std::result::Result<(), Fail>;

/// Parent rows of the kit's tree (node `i` has parent row `PARENTS[i]`: 0 the root, `j + 1`
/// node `j`): two children of the root, two under the first, a chain below; its first `n`
/// nodes are a tree for every `n`.
const PARENTS: [u32; 6] = [0, 0, 1, 1, 3, 2];

/// A test tree: tokens (siblings distinct) and parents, at most `cap` nodes.
pub(crate) struct TestTree {
    pub(crate) tokens: Vec<u32>,
    pub(crate) parents: Vec<u32>,
}

impl TestTree {
    pub(crate) fn new(p: &[u32], vocab: usize, cap: usize) -> Self {
        let n = cap.min(PARENTS.len());
        let parents = PARENTS[..n].to_vec();
        let mut tokens: Vec<u32> = Vec::with_capacity(n);
        for i in 0..n {
            let mut t = token(p, i + 11, vocab);
            // Siblings distinct (the kit's trees are deterministic-safe).
            while (0..i).any(|j| parents[j] == parents[i] && tokens[j] == t) {
                t = (t + 1) % vocab as u32;
            }
            tokens.push(t);
        }
        TestTree { tokens, parents }
    }

    pub(crate) fn block(&self) -> DraftBlock<'_> {
        DraftBlock::tree(&self.tokens, &self.parents)
    }

    /// Tokens of the path to `node` (node included), root's child first.
    pub(crate) fn path_tokens(&self, node: usize) -> (Vec<u32>, Vec<u32>) {
        let mut nodes = Vec::new();
        self.block().path_to(node, &mut nodes);
        let toks = nodes.iter().map(|&j| self.tokens[j as usize]).collect();
        (nodes, toks)
    }

    /// The deepest node.
    pub(crate) fn deepest(&self) -> usize {
        let b = self.block();
        (0..b.len())
            .max_by_key(|&i| (b.depth(i), usize::MAX - i))
            .unwrap_or(0)
    }
}

/// Runs the [`TreeTarget`](crate::TreeTarget) checks (`tree.*`, listed in
/// [`crate::conformance`]) when `make()`'s [`TargetModel::tree`] is `Some` (else one skipped
/// `tree.support`). Each prompt's last token is the root of a tree of up to 6 nodes over the
/// rest. Cost: about 15 forwards of each prompt plus the tree forwards.
pub fn check_tree<T, P>(mut make: impl FnMut() -> T, prompts_in: &[P], cfg: &KitConfig) -> Report
where
    T: TargetModel,
    P: AsRef<[u32]>,
{
    let mut report = Report::new("TreeTarget", std::any::type_name::<T>());
    let mut probe = make();
    let (vocab, max_context) = (probe.vocab_size(), probe.max_context());
    let cap = probe.tree().map(|t| t.max_tree_nodes());
    drop(probe);
    let cap = match cap {
        None | Some(0) => {
            let reason = if cap.is_none() {
                "tree() is None"
            } else {
                "max_tree_nodes() is 0"
            };
            report.push(
                "tree.support",
                "the engine",
                Outcome::Skipped {
                    reason: reason.into(),
                },
            );
            return report;
        }
        Some(c) => c,
    };
    let Some(ps) = prompts(&mut report, prompts_in, vocab, max_context) else {
        return report;
    };
    let tol = cfg.tolerance();
    for (i, p) in ps.iter().enumerate() {
        let tree = TestTree::new(p, vocab, cap);
        let input = format!(
            "{}, tree of {} nodes",
            prompt_input(i, p),
            tree.tokens.len()
        );
        record(
            &mut report,
            "tree.rows",
            &input,
            rows(&mut make, p, &tree, tol),
        );
        record(
            &mut report,
            "tree.commit",
            &input,
            commit(&mut make, p, &tree, tol),
        );
        record(
            &mut report,
            "tree.truncate",
            &input,
            undo(&mut make, p, &tree, tol),
        );
        for (case, r) in invalid(&mut make, p, cap, tol, cfg) {
            record(
                &mut report,
                "tree.invalid",
                &format!("{}, {case}", prompt_input(i, p)),
                r,
            );
        }
    }
    report
}

/// A fresh engine holding the prompt but its last token, its tree forward of `tree` done;
/// returns the logits.
fn start<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    tree: &TestTree,
) -> std::result::Result<(T, Vec<f32>), Fail> {
    let mut m = make();
    let n = p.len();
    let mut logits = Vec::new();
    ok(
        m.forward(&p[..n - 1], &mut logits),
        "forward(prompt[..n - 1])",
    )?;
    let t = m
        .tree()
        .ok_or_else(|| Fail::new("tree() Some on every fresh engine", "None"))?;
    ok(
        t.forward_tree(p[n - 1], &tree.block(), &mut logits),
        "forward_tree(last token, tree)",
    )?;
    Ok((m, logits))
}

/// Every node's row equals the chain logits of its path.
fn rows<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    tree: &TestTree,
    tol: Tolerance,
) -> Check {
    let (m, logits) = start(make, p, tree)?;
    let v = m.vocab_size();
    let nodes = tree.tokens.len();
    same_len(
        "logits.len() ([nodes + 1, vocab])",
        (nodes + 1) * v,
        logits.len(),
    )?;
    seq_is(&m, p.len() + nodes, "forward_tree")?;
    let root = last_row(make, p)?;
    compare_rows(&root, &logits[..v], v, 0, tol)
        .map_err(|f| f.context("root row vs chain".into()))?;
    for i in 0..nodes {
        let (_, toks) = tree.path_tokens(i);
        let chain = [p, &toks].concat();
        let expected = last_row(make, &chain)?;
        compare_rows(&expected, &logits[(i + 1) * v..(i + 2) * v], v, i + 1, tol)
            .map_err(|f| f.context(format!("node {i} (path {toks:?}) vs its chain")))?;
    }
    Ok(())
}

/// After `commit_tree(path)` the length is `seq_len + 1 + path.len()` and the next row is a
/// chain's.
fn commit<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    tree: &TestTree,
    tol: Tolerance,
) -> Check {
    let deep = tree.path_tokens(tree.deepest());
    let mut paths = vec![deep, (Vec::new(), Vec::new())];
    if tree.tokens.len() >= 2 {
        paths.push(tree.path_tokens(1));
    }
    for (nodes, toks) in paths {
        let (mut m, _) = start(make, p, tree)?;
        let v = m.vocab_size();
        let t = m.tree().ok_or_else(|| Fail::new("tree() Some", "None"))?;
        ok(t.commit_tree(&nodes), format!("commit_tree({nodes:?})"))?;
        seq_is(
            &m,
            p.len() + nodes.len(),
            &format!("commit_tree({nodes:?})"),
        )?;
        let x = token(p, 3, v);
        let mut row = Vec::new();
        ok(m.forward(&[x], &mut row), "forward after commit_tree")?;
        let expected = last_row(make, &[p, &toks, &[x]].concat())?;
        compare_rows(&expected, &row, v, 0, tol).map_err(|f| {
            f.context(format!(
                "the row after committing path {nodes:?} vs a chain"
            ))
        })?;
    }
    Ok(())
}

/// Truncate undoes an uncommitted tree.
fn undo<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    tree: &TestTree,
    tol: Tolerance,
) -> Check {
    let n = p.len();
    let (mut m, _) = start(make, p, tree)?;
    let v = m.vocab_size();
    ok(m.truncate(n - 1), "truncate(seq_len before the tree)")?;
    seq_is(&m, n - 1, "truncate")?;
    let x = token(p, 4, v);
    let mut rows = Vec::new();
    ok(
        m.forward(&[p[n - 1], x], &mut rows),
        "forward([root, x]) after the truncate",
    )?;
    let chain = [p, &[x]].concat();
    let expected = last_row(make, &chain)?;
    compare_rows(&expected, &rows[v..], v, 1, tol)
        .map_err(|f| f.context("after undoing a tree".into()))
        .map(|_| ())
}

/// Invalid trees and commits are refused without change.
fn invalid<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    cap: usize,
    tol: Tolerance,
    cfg: &KitConfig,
) -> Vec<(String, Check)> {
    let n = p.len();
    let probe = make();
    let (v, max_context) = (probe.vocab_size(), probe.max_context());
    drop(probe);
    let a = token(p, 1, v);
    let root = p[n - 1];
    let bad = |name: String, tokens: Vec<u32>, parents: Vec<u32>| BadTree {
        name,
        tokens,
        parents,
        scheme: None,
        root,
        invalid_tree: true,
    };
    let mut cases = vec![
        bad("a parent not before its node".into(), vec![a], vec![1]),
        bad("a node id >= vocab_size".into(), vec![v as u32], vec![0]),
        BadTree {
            root: v as u32,
            invalid_tree: false,
            ..bad("a root id >= vocab_size".into(), vec![a], vec![0])
        },
    ];
    if cap <= 256 {
        let over: Vec<u32> = (0..cap as u32 + 1).map(|i| (a + i) % v as u32).collect();
        let parents = (0..over.len() as u32).collect();
        cases.push(bad(
            format!("{} nodes, above max_tree_nodes", cap + 1),
            over,
            parents,
        ));
    }
    if cap >= 2 {
        cases.push(BadTree {
            scheme: Some(SiblingScheme::Deterministic),
            ..bad(
                "duplicate deterministic siblings".into(),
                vec![a, a],
                vec![0, 0],
            )
        });
    }
    let mut out: Vec<(String, Check)> = cases
        .into_iter()
        .map(|c| {
            let r = refused_tree(make, p, &c, tol);
            (c.name, r)
        })
        .collect();
    if cap >= 2 && max_context <= cfg.context_budget() {
        out.push(("a tree crossing max_context".into(), overflow(make, p)));
    }
    out.push((
        "commit_tree without a pending tree, and of a non-path".into(),
        bad_commit(make, p, cap),
    ));
    out
}

/// An invalid tree forward: the block, its root, and whether the contract names the error
/// ([`Error::InvalidTree`]) or only asks for one.
struct BadTree {
    name: String,
    tokens: Vec<u32>,
    parents: Vec<u32>,
    scheme: Option<SiblingScheme>,
    root: u32,
    invalid_tree: bool,
}

fn refused_tree<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    c: &BadTree,
    tol: Tolerance,
) -> Check {
    let (toks, parents, scheme, root, tree_err) =
        (&c.tokens, &c.parents, c.scheme, c.root, c.invalid_tree);
    let n = p.len();
    let mut m = make();
    let v = m.vocab_size();
    let mut logits = Vec::new();
    ok(
        m.forward(&p[..n - 1], &mut logits),
        "forward(prompt[..n - 1])",
    )?;
    let schemes = scheme.map(|s| vec![s; toks.len()]);
    let mut block = DraftBlock::tree(toks, parents);
    if let Some(s) = &schemes {
        block = block.with_schemes(s);
    }
    let t = m.tree().ok_or_else(|| Fail::new("tree() Some", "None"))?;
    match t.forward_tree(root, &block, &mut logits) {
        Ok(()) => return Err(Fail::new("forward_tree: Err", "Ok")),
        Err(Error::InvalidTree(_)) => {}
        Err(e) if tree_err => {
            return Err(Fail::new(
                "forward_tree: Err(InvalidTree(..))",
                format!("Err({e})"),
            ));
        }
        Err(_) => {}
    }
    seq_is(&m, n - 1, "the refused tree")?;
    let mut row = Vec::new();
    ok(
        m.forward(&p[n - 1..], &mut row),
        "forward(last token) after the refused tree",
    )?;
    let expected = last_row(make, p)?;
    compare_rows(&expected, &row, v, n - 1, tol)
        .map_err(|f| f.context("after the refused tree".into()))
        .map(|_| ())
}

/// A tree crossing the context limit is refused without change.
fn overflow<T: TargetModel>(make: &mut impl FnMut() -> T, p: &[u32]) -> Check {
    let mut m = make();
    let (max, v) = (m.max_context(), m.vocab_size());
    let fill: Vec<u32> = (0..max - 2).map(|i| token(p, i, v)).collect();
    let mut logits = Vec::new();
    for chunk in fill.chunks(256) {
        ok(m.forward(chunk, &mut logits), "forward of a fill chunk")?;
    }
    let toks = [token(p, 1, v), token(p, 2, v)];
    let t = m.tree().ok_or_else(|| Fail::new("tree() Some", "None"))?;
    match t.forward_tree(p[0], &DraftBlock::chain(&toks), &mut logits) {
        Ok(()) => Err(Fail::new(
            "forward_tree of 3 rows at max_context - 2: Err",
            "Ok",
        )),
        Err(_) => seq_is(&m, max - 2, "the refused tree"),
    }
}

/// commit_tree without a pending tree, and of a path that is not one, are refused.
fn bad_commit<T: TargetModel>(make: &mut impl FnMut() -> T, p: &[u32], cap: usize) -> Check {
    let mut m = make();
    let t = m.tree().ok_or_else(|| Fail::new("tree() Some", "None"))?;
    if t.commit_tree(&[]).is_ok() {
        return Err(Fail::new(
            "commit_tree(&[]) without a pending tree: Err",
            "Ok",
        ));
    }
    if cap < 3 {
        return Ok(());
    }
    let tree = TestTree::new(p, m.vocab_size(), cap);
    let (mut m, _) = start(make, p, &tree)?;
    let t = m.tree().ok_or_else(|| Fail::new("tree() Some", "None"))?;
    // Node 2's parent is node 0, so [2] alone is not a path from the root.
    match t.commit_tree(&[2]) {
        Ok(()) => Err(Fail::new(
            "commit_tree([2]) (node 2 is a child of node 0): Err",
            "Ok",
        )),
        Err(_) => Ok(()),
    }
}
