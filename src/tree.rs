//! Draft blocks: the shape of what one verify step checks, a chain or a token tree.
//!
//! A step feeds the target the **root** (the last committed token, which is not a node) followed
//! by `n` draft **nodes** in topological order, and reads `n + 1` rows of logits: row 0 follows
//! the root, row `i + 1` follows node `i`. Node `i` is checked against the row of its parent,
//! [`DraftBlock::parent_row`]`(i)`: `0` for a child of the root, `j + 1` for a child of node `j`.
//! A **chain** `d_1 .. d_k` is the block whose node `i` has parent row `i` (node `i - 1`, or the
//! root for `i = 0`), so "row `i` checks draft `i`" is the chain case of "the parent's row checks
//! the node".
//!
//! Each node sits at **depth** `1 + depth(parent)` (the root's children at depth 1); a node
//! attends to the committed context and its ancestors only and takes the position
//! `context_len - 1 + depth` (the root sits at `context_len - 1`). Nodes that share a parent
//! form a **sibling group**; every group has one [`SiblingScheme`] telling the verifier how its
//! candidates were chosen (SpecInfer, Miao et al. 2024, section 4; Jeon et al. 2024 for samples
//! without replacement).
//!
//! The same type is read by the verifier ([`crate::Verifier`]), the draft sampler of the
//! sampling proposers, the GPU packer, the target's tree forward
//! ([`crate::model::TreeTarget`]) and the decoding loop.

use std::fmt;

/// How the candidates of one sibling group (the children of one node, or of the root) were
/// chosen. The verifier's acceptance rule depends on it; each rule is lossless only for the
/// scheme it is written for (see [`crate::verify`], section "Trees").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[non_exhaustive]
pub enum SiblingScheme {
    /// Distinct candidates chosen without a random draw (n-gram continuations, top-k of a draft
    /// distribution): each is a point mass. Duplicate tokens in the group are an error
    /// ([`TreeFault::DuplicateSiblings`]). The default, and the scheme of point-mass drafts.
    #[default]
    Deterministic,
    /// Independent samples from one draft distribution q, with replacement (SpecInfer's
    /// multi-step speculative sampling, Miao et al. 2024, algorithm 2). Every node of the group
    /// carries the same q row. Duplicate tokens are allowed.
    WithReplacement,
    /// Samples drawn one after another from q with the earlier siblings removed and the rest
    /// renormalised (recursive rejection sampling, Jeon et al. 2024). Every node of the group
    /// carries the same q row (the distribution of the first draw). Duplicates are an error.
    WithoutReplacement,
}

/// A borrowed draft block: `n` nodes (tokens), the parent of each, and optionally the sibling
/// scheme of each node's group and the nodes that end the sequence.
///
/// Build one with [`DraftBlock::chain`] or [`DraftBlock::tree`]; check a tree with
/// [`DraftBlock::validate`]. Parents are target row indices (see the module docs): `parents[i]`
/// is `0` for a child of the root and `j + 1` for a child of node `j`, so a valid tree has
/// `parents[i] <= i`, and a chain has `parents[i] == i`.
///
/// **Ending nodes** ([`DraftBlock::with_ends`]): a node whose acceptance ends the sequence (an
/// EOS, or it completes a stop) must be a leaf; a verify step that accepts it emits nothing
/// after it and reads no row after it. The number of target rows a verify step reads follows
/// from them ([`DraftBlock::verify_rows`]): `n + 1`, or `n` for a chain whose final node ends
/// (no row follows the end, case C11). "Chain" means the shape ([`DraftBlock::is_chain`]): a
/// tree whose parents are `i` at node `i` is a chain too, so a tree forward's `n + 1` rows of
/// such a block lose their last row when its final node ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DraftBlock<'a> {
    tokens: &'a [u32],
    parents: Option<&'a [u32]>,
    schemes: Option<&'a [SiblingScheme]>,
    ends: &'a [bool],
}

impl<'a> DraftBlock<'a> {
    /// The chain `d_1 .. d_k`: node `i`'s parent row is `i`.
    pub fn chain(tokens: &'a [u32]) -> Self {
        DraftBlock {
            tokens,
            parents: None,
            schemes: None,
            ends: &[],
        }
    }

    /// A tree of `tokens.len()` nodes with parent rows `parents` (`[n]`, see the type docs).
    /// Not checked here: call [`DraftBlock::validate`] (the verifier and the loop do).
    pub fn tree(tokens: &'a [u32], parents: &'a [u32]) -> Self {
        DraftBlock {
            tokens,
            parents: Some(parents),
            schemes: None,
            ends: &[],
        }
    }

    /// Sets the scheme of each node's sibling group, `[n]` (siblings must agree). Without it
    /// every group takes the default of the draft form: [`SiblingScheme::Deterministic`] for
    /// point masses, [`SiblingScheme::WithReplacement`] for dense q.
    pub fn with_schemes(mut self, schemes: &'a [SiblingScheme]) -> Self {
        self.schemes = Some(schemes);
        self
    }

    /// Marks the nodes whose acceptance ends the sequence: `ends[i]` for node `i` (`[n]`, or
    /// empty for none; see the type docs). An ending node must be a leaf
    /// ([`TreeFault::EndHasChildren`]). For a chain only the final node can end, and then the
    /// block has `n` target rows, not `n + 1` ([`DraftBlock::verify_rows`]).
    pub fn with_ends(mut self, ends: &'a [bool]) -> Self {
        self.ends = ends;
        self
    }

    /// The per-node end flags, `[n]`, or empty when no node ends the sequence.
    pub fn ends(&self) -> &'a [bool] {
        self.ends
    }

    /// `true` when accepting node `i` ends the sequence ([`DraftBlock::with_ends`]); `false`
    /// for a node without a flag.
    #[inline]
    pub fn ends_at(&self, i: usize) -> bool {
        self.ends.get(i).copied().unwrap_or(false)
    }

    /// `true` when the block is a chain ([`DraftBlock::is_chain`]) whose final node ends the
    /// sequence: its verify step reads `n` target rows, no row after the end (case C11).
    pub fn final_ends(&self) -> bool {
        !self.tokens.is_empty() && self.ends_at(self.tokens.len() - 1) && self.is_chain()
    }

    /// Number of target rows a verify step over the block reads: `n + 1` (row 0 after the
    /// root, row `i + 1` after node `i`), or `n` when the block is a chain whose final node
    /// ends the sequence ([`DraftBlock::final_ends`]). A tree keeps its `n + 1` rows even when
    /// its last node ends (the tree forward computes every node's row; an ending leaf's is not
    /// read).
    pub fn verify_rows(&self) -> usize {
        self.rows() - self.final_ends() as usize
    }

    /// The node tokens, `[n]`.
    pub fn tokens(&self) -> &'a [u32] {
        self.tokens
    }

    /// The parent rows, `[n]`, or `None` for a chain built with [`DraftBlock::chain`].
    pub fn parents(&self) -> Option<&'a [u32]> {
        self.parents
    }

    /// The per-node schemes, `[n]`, when set.
    pub fn schemes(&self) -> Option<&'a [SiblingScheme]> {
        self.schemes
    }

    /// Number of nodes `n` (the draft length k of a chain).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// `true` when the block has no node (a no-draft step).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Number of target rows a forward over the root and the block produces: `n + 1`. A verify
    /// step may read one less ([`DraftBlock::verify_rows`]).
    pub fn rows(&self) -> usize {
        self.tokens.len() + 1
    }

    /// `true` when every node's parent is the node before it (a chain, however it was built):
    /// no parents, or one parent row per node with `parents[i] == i`.
    pub fn is_chain(&self) -> bool {
        match self.parents {
            None => true,
            Some(p) => {
                p.len() == self.tokens.len() && p.iter().enumerate().all(|(i, &r)| r as usize == i)
            }
        }
    }

    /// The target row that checks node `i` (its parent's row). Panics if `i >= n` (or if the
    /// block's `parents` is shorter than its tokens: [`DraftBlock::validate`] reports that).
    #[inline]
    pub fn parent_row(&self, i: usize) -> usize {
        match self.parents {
            None => i,
            Some(p) => p[i] as usize,
        }
    }

    /// The scheme of node `i`'s sibling group; `default` when the block carries none.
    #[inline]
    pub fn scheme(&self, i: usize, default: SiblingScheme) -> SiblingScheme {
        self.schemes.map_or(default, |s| s[i])
    }

    /// The nodes whose parent row is `row`, in node order (the sibling group of row `row`).
    /// `O(n)` for a tree, `O(1)` for a chain.
    pub fn children(&self, row: usize) -> impl Iterator<Item = usize> + '_ {
        let (start, end) = match self.parents {
            None => (row.min(self.len()), (row + 1).min(self.len())),
            Some(_) => (row.min(self.len()), self.len()),
        };
        (start..end).filter(move |&j| self.parent_row(j) == row)
    }

    /// Depth of node `i` (1 for a child of the root). `O(depth)`. Panics if `i >= n`. On a
    /// block that [`DraftBlock::validate`] rejects the walk stops at the first parent that is
    /// not an earlier node (no panic, no endless loop; the value is then meaningless).
    pub fn depth(&self, i: usize) -> usize {
        let mut d = 1;
        let mut node = i;
        let mut row = self.parent_row(i);
        while row != 0 && row - 1 < node {
            d += 1;
            node = row - 1;
            row = self.parent_row(node);
        }
        d
    }

    /// Depth of every node, written to `out` (`[n]`, cleared first). `O(n)`. A node whose parent
    /// is not an earlier node (a block [`DraftBlock::validate`] rejects) counts as depth 1.
    pub fn depths(&self, out: &mut Vec<u32>) {
        out.clear();
        for i in 0..self.len() {
            let r = self.parent_row(i);
            let d = if r == 0 || r > i { 1 } else { out[r - 1] + 1 };
            out.push(d);
        }
    }

    /// The largest node depth (0 for an empty block): the most tokens one step can accept.
    pub fn max_depth(&self) -> usize {
        if self.parents.is_none() {
            return self.len();
        }
        let mut d = Vec::with_capacity(self.len());
        self.depths(&mut d);
        d.iter().copied().max().unwrap_or(0) as usize
    }

    /// The nodes from the root's child down to `node` (inclusive), written to `out` (cleared
    /// first): the path whose tokens a step emits when it accepts `node`. Panics if
    /// `node >= n`; on a block that [`DraftBlock::validate`] rejects the path stops at the first
    /// parent that is not an earlier node.
    pub fn path_to(&self, node: usize, out: &mut Vec<u32>) {
        out.clear();
        let mut i = node;
        loop {
            out.push(i as u32);
            let r = self.parent_row(i);
            if r == 0 || r > i {
                break;
            }
            i = r - 1;
        }
        out.reverse();
    }

    /// The tokens that target row `row` follows within the block, written to `tokens` (cleared
    /// first): empty for row 0 (the root's), else the tokens of the path to node `row - 1`, the
    /// root's child first, the history a row of that node is processed with. `nodes` is
    /// scratch for the node indices ([`DraftBlock::path_to`]). Panics if `row > n`.
    pub fn row_path_tokens(&self, row: usize, nodes: &mut Vec<u32>, tokens: &mut Vec<u32>) {
        tokens.clear();
        if row > 0 {
            self.path_to(row - 1, nodes);
            tokens.extend(nodes.iter().map(|&j| self.tokens[j as usize]));
        }
    }

    /// Checks the block's structure against `limits`, without looking at any logits.
    ///
    /// # Errors
    /// The first [`TreeFault`] found, checked in this order: shape of `parents` / `schemes` /
    /// `ends` ([`TreeFault::Shape`]), node count over `max_nodes` ([`TreeFault::TooManyNodes`]),
    /// a parent not before its node ([`TreeFault::ParentNotBefore`]), a token outside the
    /// vocabulary ([`TreeFault::TokenOutOfVocab`]), depth over `max_depth`
    /// ([`TreeFault::TooDeep`]), more children under one row than `max_branch`
    /// ([`TreeFault::TooManyChildren`]), siblings with different schemes
    /// ([`TreeFault::MixedSchemes`]), a sampled scheme in a point-mass block
    /// ([`TreeFault::SchemeNeedsQ`]), duplicate tokens in a deterministic or
    /// without-replacement group ([`TreeFault::DuplicateSiblings`]), an ending node with
    /// children ([`TreeFault::EndHasChildren`]).
    pub fn validate(&self, limits: &TreeLimits) -> Result<(), TreeFault> {
        self.check_shapes()?;
        self.check_order(limits)?;
        let depth = self.max_depth();
        if depth > limits.max_depth {
            return Err(TreeFault::TooDeep {
                depth,
                max: limits.max_depth,
            });
        }
        self.check_groups(limits)?;
        self.check_ends()
    }

    /// [`DraftBlock::validate`]: `parents` and `schemes` (when set) and `ends` (when not
    /// empty) have one entry per node.
    fn check_shapes(&self) -> Result<(), TreeFault> {
        let n = self.len();
        let lens = [
            ("parents", self.parents.map(<[u32]>::len)),
            ("schemes", self.schemes.map(<[SiblingScheme]>::len)),
            ("ends", (!self.ends.is_empty()).then_some(self.ends.len())),
        ];
        match lens
            .into_iter()
            .find_map(|(what, len)| len.filter(|&l| l != n).map(|l| (what, l)))
        {
            Some((what, actual)) => Err(TreeFault::Shape {
                what,
                expected: n,
                actual,
            }),
            None => Ok(()),
        }
    }

    /// [`DraftBlock::validate`]: the node count, parents before their nodes, and the tokens
    /// inside the vocabulary.
    fn check_order(&self, limits: &TreeLimits) -> Result<(), TreeFault> {
        let n = self.len();
        if n > limits.max_nodes {
            return Err(TreeFault::TooManyNodes {
                nodes: n,
                max: limits.max_nodes,
            });
        }
        if let Some(p) = self.parents
            && let Some((node, &parent)) = p.iter().enumerate().find(|&(i, &r)| r as usize > i)
        {
            return Err(TreeFault::ParentNotBefore { node, parent });
        }
        match self
            .tokens
            .iter()
            .enumerate()
            .find(|&(_, &t)| t as usize >= limits.vocab_size)
        {
            Some((node, &token)) => Err(TreeFault::TokenOutOfVocab {
                node,
                token,
                vocab_size: limits.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// [`DraftBlock::validate`]: every sibling group, node by node: the branching limit, one
    /// scheme per group, sampled schemes only with dense q, no duplicate tokens where the
    /// scheme forbids them.
    fn check_groups(&self, limits: &TreeLimits) -> Result<(), TreeFault> {
        let default = limits.default_scheme();
        let mut children = vec![0usize; self.len() + 1];
        for i in 0..self.len() {
            let row = self.parent_row(i);
            children[row] += 1;
            if children[row] > limits.max_branch {
                return Err(TreeFault::TooManyChildren {
                    row,
                    max: limits.max_branch,
                });
            }
            let s = self.scheme(i, default);
            // Compare with the earlier siblings only: each pair is seen once.
            for j in self.children(row).take_while(|&j| j < i) {
                if self.scheme(j, default) != s {
                    return Err(TreeFault::MixedSchemes { node: i });
                }
                if s != SiblingScheme::WithReplacement && self.tokens[j] == self.tokens[i] {
                    return Err(TreeFault::DuplicateSiblings {
                        node: i,
                        token: self.tokens[i],
                    });
                }
            }
            if !limits.dense_q && s != SiblingScheme::Deterministic {
                return Err(TreeFault::SchemeNeedsQ { node: i });
            }
        }
        Ok(())
    }

    /// [`DraftBlock::validate`]: every ending node is a leaf.
    fn check_ends(&self) -> Result<(), TreeFault> {
        let k = self.len();
        match (0..self.ends.len().min(k))
            .find(|&i| self.ends[i] && i + 1 < k && self.children(i + 1).next().is_some())
        {
            Some(node) => Err(TreeFault::EndHasChildren { node }),
            None => Ok(()),
        }
    }
}

/// Limits a [`DraftBlock`] is checked against ([`DraftBlock::validate`]).
///
/// Build one with [`TreeLimits::vocab`] or [`TreeLimits::target`] and the `with_` setters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TreeLimits {
    /// Target vocabulary size, in tokens: every node token must be below it.
    pub vocab_size: usize,
    /// Most nodes allowed (the target's tree capacity, or the request's node budget).
    pub max_nodes: usize,
    /// Most depth allowed (the remaining token budget or context room of the step).
    pub max_depth: usize,
    /// Most children of one node (the root included): the branching factor of the request.
    pub max_branch: usize,
    /// `true` when the block comes with dense q (probabilities or draft logits); point-mass
    /// blocks allow only [`SiblingScheme::Deterministic`] groups.
    pub dense_q: bool,
}

impl TreeLimits {
    /// The limits a target's tree forward checks ([`crate::TreeTarget::forward_tree`]): the
    /// vocabulary and the target's capacity, any depth, and any sibling scheme (a target sees
    /// no q: with `dense_q: true` sampled groups, which may repeat a token, pass; groups marked
    /// [`SiblingScheme::Deterministic`] still may not).
    pub fn target(vocab_size: usize, max_nodes: usize) -> Self {
        TreeLimits {
            vocab_size,
            max_nodes,
            max_depth: usize::MAX,
            max_branch: usize::MAX,
            dense_q: true,
        }
    }

    /// Limits with a vocabulary only: any node count, depth and branching, point-mass drafts.
    pub fn vocab(vocab_size: usize) -> Self {
        TreeLimits {
            vocab_size,
            max_nodes: usize::MAX,
            max_depth: usize::MAX,
            max_branch: usize::MAX,
            dense_q: false,
        }
    }

    /// Sets [`TreeLimits::max_nodes`].
    pub fn with_max_nodes(mut self, max_nodes: usize) -> Self {
        self.max_nodes = max_nodes;
        self
    }

    /// Sets [`TreeLimits::max_depth`].
    pub fn with_max_depth(mut self, max_depth: usize) -> Self {
        self.max_depth = max_depth;
        self
    }

    /// Sets [`TreeLimits::max_branch`].
    pub fn with_max_branch(mut self, max_branch: usize) -> Self {
        self.max_branch = max_branch;
        self
    }

    /// Sets [`TreeLimits::dense_q`].
    pub fn with_dense_q(mut self, dense_q: bool) -> Self {
        self.dense_q = dense_q;
        self
    }

    /// The scheme of a group that has none: deterministic for point masses, with replacement for
    /// dense q.
    pub fn default_scheme(&self) -> SiblingScheme {
        if self.dense_q {
            SiblingScheme::WithReplacement
        } else {
            SiblingScheme::Deterministic
        }
    }
}

/// What is wrong with a draft tree ([`DraftBlock::validate`]). Carried by
/// [`crate::Error::InvalidTree`] (verifier input) and
/// [`crate::error::ProposalFault::Tree`] (a proposer's draft).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TreeFault {
    /// `parents` or `schemes` does not have one entry per node.
    Shape {
        /// Which array.
        what: &'static str,
        /// Number of nodes.
        expected: usize,
        /// Its length.
        actual: usize,
    },
    /// Node `node`'s parent row is not an earlier row (`parent > node`): nodes must come in
    /// topological order, parents first.
    ParentNotBefore {
        /// Node index.
        node: usize,
        /// Its parent row.
        parent: u32,
    },
    /// A node token is outside the target vocabulary.
    TokenOutOfVocab {
        /// Node index.
        node: usize,
        /// The token id.
        token: u32,
        /// The target vocabulary size.
        vocab_size: usize,
    },
    /// Two siblings of a deterministic or without-replacement group carry the same token.
    DuplicateSiblings {
        /// The later of the two nodes.
        node: usize,
        /// The token.
        token: u32,
    },
    /// More nodes than allowed (the target's capacity or the node budget).
    TooManyNodes {
        /// Number of nodes.
        nodes: usize,
        /// The limit.
        max: usize,
    },
    /// A path deeper than the remaining budget (tokens left, or context room).
    TooDeep {
        /// The deepest node's depth.
        depth: usize,
        /// The limit.
        max: usize,
    },
    /// A node (or the root) has more children than the branching limit.
    TooManyChildren {
        /// The parent's row (0 = the root, `j + 1` = node `j`).
        row: usize,
        /// The limit.
        max: usize,
    },
    /// Siblings declare different schemes.
    MixedSchemes {
        /// The first node whose scheme differs from an earlier sibling's.
        node: usize,
    },
    /// A sampled scheme (with or without replacement) in a block without dense q.
    SchemeNeedsQ {
        /// The node.
        node: usize,
    },
    /// A node that ends the sequence has children (nothing after an end can be emitted).
    EndHasChildren {
        /// The ending node.
        node: usize,
    },
}

impl fmt::Display for TreeFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TreeFault::Shape {
                what,
                expected,
                actual,
            } => write!(
                f,
                "{what} has {actual} entries, the tree has {expected} nodes"
            ),
            TreeFault::ParentNotBefore { node, parent } => write!(
                f,
                "node {node} has parent row {parent}; parents must come before their children (parent rows: 0 = the root, j + 1 = node j, so row <= node index)"
            ),
            TreeFault::TokenOutOfVocab {
                node,
                token,
                vocab_size,
            } => write!(
                f,
                "node {node} token {token} is outside the vocabulary of size {vocab_size}"
            ),
            TreeFault::DuplicateSiblings { node, token } => write!(
                f,
                "node {node} repeats token {token} of an earlier sibling (deterministic or without-replacement group)"
            ),
            TreeFault::TooManyNodes { nodes, max } => {
                write!(f, "{nodes} nodes, at most {max} allowed")
            }
            TreeFault::TooDeep { depth, max } => {
                write!(f, "depth {depth}, at most {max} allowed")
            }
            TreeFault::TooManyChildren { row, max } => write!(
                f,
                "row {row} (0 = the root, j + 1 = node j) has more than {max} children, the branching limit"
            ),
            TreeFault::MixedSchemes { node } => {
                write!(f, "node {node}'s sibling scheme differs from its siblings'")
            }
            TreeFault::SchemeNeedsQ { node } => write!(
                f,
                "node {node} is in a sampled group, but the draft has no q (point masses)"
            ),
            TreeFault::EndHasChildren { node } => {
                write!(f, "node {node} ends the sequence but has children")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Root -> 0 (a) -> 1 (b), root -> 2 (c) -> 3 (d), 2 -> 4 (e).
    const TOKENS: [u32; 5] = [10, 11, 12, 13, 14];
    const PARENTS: [u32; 5] = [0, 1, 0, 3, 3];

    #[test]
    fn chain_and_tree_shapes() {
        let c = DraftBlock::chain(&TOKENS);
        assert!(c.is_chain());
        assert_eq!(c.parent_row(3), 3);
        assert_eq!(c.max_depth(), 5);
        assert_eq!(c.children(2).collect::<Vec<_>>(), vec![2]);
        assert_eq!(c.children(5).count(), 0);
        let t = DraftBlock::tree(&TOKENS, &PARENTS);
        assert!(!t.is_chain());
        assert_eq!(t.children(0).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(t.children(3).collect::<Vec<_>>(), vec![3, 4]);
        let mut d = Vec::new();
        t.depths(&mut d);
        assert_eq!(d, vec![1, 2, 1, 2, 2]);
        assert_eq!((t.depth(4), t.max_depth()), (2, 2));
        let mut p = Vec::new();
        t.path_to(4, &mut p);
        assert_eq!(p, vec![2, 4]);
        let mut toks = vec![99];
        t.row_path_tokens(5, &mut p, &mut toks);
        assert_eq!(toks, vec![t.tokens()[2], t.tokens()[4]]);
        t.row_path_tokens(0, &mut p, &mut toks);
        assert!(toks.is_empty());
        assert!(DraftBlock::tree(&TOKENS, &[0, 1, 2, 3, 4]).is_chain());
        assert_eq!(t.validate(&TreeLimits::vocab(15)), Ok(()));
    }

    #[test]
    fn ending_nodes_set_the_verify_rows() {
        let ends = [false, false, false, false, true];
        // A chain whose final node ends reads no row after it, however the chain was built.
        let c = DraftBlock::chain(&TOKENS).with_ends(&ends);
        assert!(c.final_ends() && c.ends_at(4) && !c.ends_at(3) && !c.ends_at(9));
        assert_eq!((c.rows(), c.verify_rows()), (6, 5));
        let as_parents = DraftBlock::tree(&TOKENS, &[0, 1, 2, 3, 4]).with_ends(&ends);
        assert_eq!(as_parents.verify_rows(), 5);
        // A tree keeps every row, whichever leaf ends; so does a chain ending nowhere.
        let t = DraftBlock::tree(&TOKENS, &PARENTS).with_ends(&ends);
        assert_eq!((t.final_ends(), t.verify_rows()), (false, 6));
        assert_eq!(DraftBlock::chain(&TOKENS).verify_rows(), 6);
        assert_eq!(DraftBlock::chain(&[]).with_ends(&[]).verify_rows(), 1);
        assert_eq!(t.validate(&TreeLimits::vocab(15)), Ok(()));
        // Ends are checked with the block: one flag per node, on leaves only.
        assert_eq!(
            t.with_ends(&[true]).validate(&TreeLimits::vocab(15)),
            Err(TreeFault::Shape {
                what: "ends",
                expected: 5,
                actual: 1
            })
        );
        assert_eq!(
            t.with_ends(&[false, false, true, false, false])
                .validate(&TreeLimits::vocab(15)),
            Err(TreeFault::EndHasChildren { node: 2 })
        );
        assert_eq!(
            c.with_ends(&[false, true, false, false, false])
                .validate(&TreeLimits::vocab(15)),
            Err(TreeFault::EndHasChildren { node: 1 })
        );
    }

    #[test]
    fn invalid_blocks_never_hang_or_panic_in_the_accessors() {
        // Node 0's parent is node 1 and node 1's is node 0: a cycle, and parents after nodes.
        let bad = DraftBlock::tree(&[1, 2, 3], &[2, 1, 3]);
        let mut d = Vec::new();
        bad.depths(&mut d);
        assert_eq!(d.len(), 3);
        for i in 0..3 {
            assert!(bad.depth(i) >= 1);
            bad.path_to(i, &mut d);
            assert_eq!(d.last(), Some(&(i as u32)));
        }
        assert!(bad.max_depth() >= 1);
        assert!(!bad.is_chain());
        assert!(bad.validate(&TreeLimits::vocab(8)).is_err());
        // Fewer parents than tokens is not a chain, and validation says why.
        let short = DraftBlock::tree(&[1, 2, 3], &[0, 1]);
        assert!(!short.is_chain());
        assert!(matches!(
            short.validate(&TreeLimits::vocab(8)),
            Err(TreeFault::Shape {
                what: "parents",
                ..
            })
        ));
    }

    #[test]
    fn every_fault_is_reported() {
        let lim = TreeLimits::vocab(15);
        let bad = |tokens: &[u32], parents: &[u32], lim: &TreeLimits| {
            DraftBlock::tree(tokens, parents).validate(lim).unwrap_err()
        };
        assert!(matches!(
            bad(&[1, 2], &[0], &lim),
            TreeFault::Shape {
                what: "parents",
                ..
            }
        ));
        assert_eq!(
            bad(&[1, 2], &[0, 3], &lim),
            TreeFault::ParentNotBefore { node: 1, parent: 3 }
        );
        assert_eq!(
            bad(&[1, 2], &[0, 2], &lim),
            TreeFault::ParentNotBefore { node: 1, parent: 2 }
        );
        assert_eq!(
            bad(&[1, 15], &[0, 1], &lim),
            TreeFault::TokenOutOfVocab {
                node: 1,
                token: 15,
                vocab_size: 15
            }
        );
        assert_eq!(
            bad(&[1, 1], &[0, 0], &lim),
            TreeFault::DuplicateSiblings { node: 1, token: 1 }
        );
        let small = TreeLimits {
            max_nodes: 4,
            ..lim
        };
        assert_eq!(
            bad(&TOKENS, &PARENTS, &small),
            TreeFault::TooManyNodes { nodes: 5, max: 4 }
        );
        let narrow = TreeLimits {
            max_branch: 1,
            ..lim
        };
        assert_eq!(
            bad(&TOKENS, &PARENTS, &narrow),
            TreeFault::TooManyChildren { row: 0, max: 1 }
        );
        let shallow = TreeLimits {
            max_depth: 1,
            ..lim
        };
        assert_eq!(
            bad(&TOKENS, &PARENTS, &shallow),
            TreeFault::TooDeep { depth: 2, max: 1 }
        );
        let schemes = [
            SiblingScheme::WithReplacement,
            SiblingScheme::WithoutReplacement,
        ];
        let dense = TreeLimits {
            dense_q: true,
            ..lim
        };
        assert_eq!(
            DraftBlock::tree(&[1, 2], &[0, 0])
                .with_schemes(&schemes)
                .validate(&dense),
            Err(TreeFault::MixedSchemes { node: 1 })
        );
        let wr = [SiblingScheme::WithReplacement; 2];
        assert_eq!(
            DraftBlock::tree(&[1, 1], &[0, 0])
                .with_schemes(&wr)
                .validate(&dense),
            Ok(())
        );
        assert_eq!(
            DraftBlock::tree(&[1, 1], &[0, 0]).validate(&dense),
            Ok(()),
            "dense q defaults to with replacement"
        );
        assert_eq!(
            DraftBlock::tree(&[1, 2], &[0, 0])
                .with_schemes(&wr)
                .validate(&lim),
            Err(TreeFault::SchemeNeedsQ { node: 0 })
        );
        let wor = [SiblingScheme::WithoutReplacement; 2];
        assert_eq!(
            DraftBlock::tree(&[3, 3], &[0, 0])
                .with_schemes(&wor)
                .validate(&dense),
            Err(TreeFault::DuplicateSiblings { node: 1, token: 3 })
        );
    }
}
