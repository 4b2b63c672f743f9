//! Bookkeeping shared by the tree forwards of [`crate::FastTarget`] and
//! [`crate::CandleTarget`] ([`speculative::TreeTarget`]): the row layout and attention order of
//! a tree forward, and the pending tree a commit or truncation resolves.
//!
//! Both engines run a tree forward the same way: the root (row 0) and the nodes (row `i + 1`
//! is node `i`) are the rows of one forward, row `r` at position `base + depth(r)`. The rows
//! attend in depth-first preorder; before row `r` attends, its key and value are written to
//! cache slot `base + depth(r)`. In preorder every row comes after its ancestors, and a slot
//! is only overwritten by a row of the same depth in another subtree, which comes after every
//! descendant of the row it replaces; so when `r` attends, slots `base ..= base + depth(r)`
//! hold the root and exactly `r`'s ancestors and `r` itself, in position order — the keys and
//! values a chain forward of `r`'s path holds there, and `r` attends to slots
//! `0 ..= base + depth(r)` as that chain's row would.

use speculative::DraftBlock;

use crate::error::CandleError;

/// The error of a forward, prefill or tree forward while a tree forward is not committed.
pub(crate) fn pending_error() -> CandleError {
    CandleError::InvalidArgument(
        "a tree forward is not committed: call commit_tree or truncate first".into(),
    )
}

/// The tokens of a tree forward's rows: `root`, then the block's nodes (`[n + 1]`).
pub(crate) fn tree_tokens(root: u32, block: &DraftBlock<'_>) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(block.rows());
    tokens.push(root);
    tokens.extend_from_slice(block.tokens());
    tokens
}

/// The checks of [`speculative::TreeTarget::commit_tree`]: takes the pending tree out of
/// `pending` (whose [`PendingTree`] `tree` gives) when `path` is one of its paths.
///
/// # Errors
/// [`speculative::Error::TargetContract`] when none is pending or `path` is not a path of its
/// block; `pending` is then unchanged.
pub(crate) fn take_for_commit<T>(
    pending: &mut Option<T>,
    path: &[u32],
    tree: impl Fn(&T) -> &PendingTree,
) -> speculative::Result<T> {
    let Some(t) = pending.take() else {
        return Err(speculative::Error::TargetContract {
            what: "commit_tree without a pending tree forward",
        });
    };
    if !tree(&t).is_path(path) {
        *pending = Some(t);
        return Err(speculative::Error::TargetContract {
            what: "commit_tree path is not a path of the pending tree block",
        });
    }
    Ok(t)
}

/// The rows of a tree forward: depth and attention order (module docs).
#[derive(Debug)]
pub(crate) struct Rows {
    /// Depth of each row, `[n + 1]` (0 for the root).
    pub(crate) depth: Vec<u32>,
    /// The rows in depth-first preorder, children in node order, `[n + 1]`, row 0 first.
    pub(crate) order: Vec<u32>,
}

impl Rows {
    /// The layout of a valid block's rows (root and nodes).
    pub(crate) fn of(block: &DraftBlock<'_>) -> Self {
        let n = block.len();
        let mut nodes = Vec::with_capacity(n);
        block.depths(&mut nodes);
        let mut depth = Vec::with_capacity(n + 1);
        depth.push(0);
        depth.extend_from_slice(&nodes);
        let mut kids: Vec<Vec<u32>> = vec![Vec::new(); n + 1];
        for i in 0..n {
            kids[block.parent_row(i)].push(i as u32 + 1);
        }
        let mut order = Vec::with_capacity(n + 1);
        let mut stack = vec![0u32];
        while let Some(r) = stack.pop() {
            order.push(r);
            stack.extend(kids[r as usize].iter().rev());
        }
        Rows { depth, order }
    }

    /// The row whose entries sit in slot `base + 1 + k` (depth `k + 1`) once every row has
    /// attended: the last row of each depth in the preorder.
    fn final_slots(&self) -> Vec<u32> {
        let max = self.depth.iter().copied().max().unwrap_or(0) as usize;
        let mut slots = vec![u32::MAX; max];
        for &r in &self.order[1..] {
            slots[self.depth[r as usize] as usize - 1] = r;
        }
        slots
    }
}

/// A tree forward that is not committed yet.
#[derive(Debug, Clone)]
pub(crate) struct PendingTree {
    /// Sequence length before the tree forward (the root's position).
    pub(crate) base: usize,
    /// Parent row of each node, `[n]`.
    parents: Vec<u32>,
    /// The row whose entries sit in cache slot `base + 1 + k`, per depth `k + 1`.
    slots: Vec<u32>,
}

impl PendingTree {
    /// The pending state after a tree forward of `block` laid out as `rows` at `base`.
    pub(crate) fn new(base: usize, block: &DraftBlock<'_>, rows: &Rows) -> Self {
        PendingTree {
            base,
            parents: (0..block.len())
                .map(|i| block.parent_row(i) as u32)
                .collect(),
            slots: rows.final_slots(),
        }
    }

    /// Whether `path` is a path of the block from the root (each node the child of the one
    /// before, the first a child of the root).
    pub(crate) fn is_path(&self, path: &[u32]) -> bool {
        let mut row = 0usize;
        for &j in path {
            if self.parents.get(j as usize).map(|&r| r as usize) != Some(row) {
                return false;
            }
            row = j as usize + 1;
        }
        true
    }

    /// Whether slot `base + 1 + k` already holds the entries of `row`.
    pub(crate) fn in_place(&self, k: usize, row: usize) -> bool {
        self.slots.get(k).is_some_and(|&r| r as usize == row)
    }

    /// What `truncate(len)` (`len <= base + 1 + n`) does to the pending tree: `Ok(None)` drops
    /// it (`len <= base + 1`), `Ok(Some(path))` keeps the first `len - base - 1` nodes when
    /// they form a chain from the root.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when those nodes are not a chain.
    pub(crate) fn truncation(&self, len: usize) -> Result<Option<Vec<u32>>, CandleError> {
        if len <= self.base + 1 {
            return Ok(None);
        }
        let m = len - self.base - 1;
        let path: Vec<u32> = (0..m as u32).collect();
        if self.is_path(&path) {
            Ok(Some(path))
        } else {
            Err(CandleError::InvalidArgument(format!(
                "truncate to {len} keeps {m} nodes of an uncommitted tree that are not a chain: \
                 call commit_tree with the accepted path first"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preorder_and_final_slots() {
        // Root -> 0 -> 1, root -> 2 -> 3, 2 -> 4; rows are node + 1.
        let tokens = [1, 2, 3, 4, 5];
        let parents = [0, 1, 0, 3, 3];
        let block = DraftBlock::tree(&tokens, &parents);
        let rows = Rows::of(&block);
        assert_eq!(rows.depth, vec![0, 1, 2, 1, 2, 2]);
        assert_eq!(rows.order, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(rows.final_slots(), vec![3, 5]);
        // Interleaved branches: root -> 0 -> 2 -> 4, root -> 1 -> 3.
        let parents = [0, 0, 1, 2, 3];
        let rows = Rows::of(&DraftBlock::tree(&tokens, &parents));
        assert_eq!(rows.order, vec![0, 1, 3, 5, 2, 4]);
        assert_eq!(rows.final_slots(), vec![2, 4, 5]);
        let p = PendingTree::new(10, &DraftBlock::tree(&tokens, &parents), &rows);
        assert!(p.is_path(&[]) && p.is_path(&[0, 2, 4]) && p.is_path(&[1, 3]));
        assert!(!p.is_path(&[2]) && !p.is_path(&[0, 3]) && !p.is_path(&[5]));
        assert!(p.in_place(0, 2) && p.in_place(1, 4) && !p.in_place(0, 1) && !p.in_place(3, 0));
        assert_eq!(p.truncation(11).unwrap(), None);
        assert_eq!(p.truncation(12).unwrap(), Some(vec![0]));
        assert!(p.truncation(13).is_err());
        // A chain's preorder is its node order.
        let rows = Rows::of(&DraftBlock::chain(&tokens));
        assert_eq!(rows.order, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(rows.final_slots(), vec![1, 2, 3, 4, 5]);
    }
}
