//! The candidate trie of [`super::MergedProposer`]: every member's draft of one step merged
//! into one prefix trie (identical paths are one node that remembers its proposers), and the
//! selection written from it: the best tree by reach probability under the node budget and
//! branching limit, or the best chain, each optionally cut to the nodes that pay for their
//! verify rows (see "The rule" and "Cost-aware merging" on [`super::MergedProposer`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::Draft;
use super::ngram::{EdgeMap, edge_key, normalize_chain};
use crate::error::{Error, Result};

/// "None" for node ids and links; also the root as a parent.
pub(super) const NONE: u32 = u32::MAX;

/// One node of the candidate trie: a distinct path proposed by at least one proposer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Node {
    pub(super) token: u32,
    /// Parent node id, or [`NONE`] for a child of the root.
    pub(super) parent: u32,
    /// 1 for a child of the root.
    pub(super) depth: u32,
    /// Bit `s` set when proposer `s` proposed this path.
    pub(super) proposers: u64,
    /// Estimated reach probability (product of the conditional rates along the path).
    pub(super) score: f64,
    /// Children in insertion order (linked list).
    pub(super) first_child: u32,
    pub(super) last_child: u32,
    pub(super) next_sibling: u32,
}

/// The prefix trie of every candidate of one step (kept in the draft or not), with the
/// scratch of the selection.
#[derive(Debug, Clone, Default)]
pub(super) struct Trie {
    pub(super) nodes: Vec<Node>,
    /// `(parent id + 1, token) -> id`, the root being 0 (`NONE + 1` wraps to 0).
    pub(super) edges: EdgeMap,
    pub(super) root_first: u32,
    pub(super) root_last: u32,
    /// Ids by decreasing score (selection order).
    pub(super) order: Vec<u32>,
    /// Whether each node is in the draft.
    pub(super) kept: Vec<bool>,
    /// Kept children per node (index `id + 1`; 0 is the root).
    pub(super) kept_children: Vec<usize>,
    /// Kept nodes sorted by (parent, best sibling first), and the links made from it.
    pub(super) groups: Vec<u32>,
    pub(super) first_kept: Vec<u32>,
    pub(super) next_kept: Vec<u32>,
    /// Draft row of each emitted node (its draft index + 1).
    pub(super) out_row: Vec<u32>,
    /// Expected accepted length of the path to each node (chain steps).
    pub(super) sums: Vec<f64>,
}

impl Trie {
    pub(super) fn clear(&mut self) {
        self.nodes.clear();
        self.edges.clear();
        self.root_first = NONE;
        self.root_last = NONE;
    }

    /// The child of `parent` (or of the root, [`NONE`]) with `token`, created at `depth` when
    /// absent; proposer bit `bit` is added to it.
    ///
    /// # Errors
    /// [`Error::Proposer`] when the trie would exceed `2^32 - 2` nodes.
    pub(super) fn child(&mut self, parent: u32, token: u32, depth: u32, bit: u64) -> Result<u32> {
        let key = edge_key(parent.wrapping_add(1), token);
        if let Some(&id) = self.edges.get(&key) {
            self.nodes[id as usize].proposers |= bit;
            return Ok(id);
        }
        let id = u32::try_from(self.nodes.len())
            .ok()
            .filter(|&i| i < NONE - 1)
            .ok_or_else(|| Error::proposer("merged candidate tree exceeds 2^32 - 2 nodes"))?;
        self.nodes.push(Node {
            token,
            parent,
            depth,
            proposers: bit,
            score: 0.0,
            first_child: NONE,
            last_child: NONE,
            next_sibling: NONE,
        });
        self.edges.insert(key, id);
        let last = if parent == NONE {
            self.root_last
        } else {
            self.nodes[parent as usize].last_child
        };
        if last == NONE {
            if parent == NONE {
                self.root_first = id;
            } else {
                self.nodes[parent as usize].first_child = id;
            }
        } else {
            self.nodes[last as usize].next_sibling = id;
        }
        if parent == NONE {
            self.root_last = id;
        } else {
            self.nodes[parent as usize].last_child = id;
        }
        Ok(id)
    }

    pub(super) fn first_child_of(&self, parent: u32) -> u32 {
        if parent == NONE {
            self.root_first
        } else {
            self.nodes[parent as usize].first_child
        }
    }

    /// The ranking of nodes `a` and `b` (`Less`: `a` first): higher score, then earlier node.
    pub(super) fn better(&self, a: u32, b: u32) -> std::cmp::Ordering {
        let (sa, sb) = (self.nodes[a as usize].score, self.nodes[b as usize].score);
        sb.total_cmp(&sa).then(a.cmp(&b))
    }

    /// Writes the best tree: the top `max_nodes` nodes by score, ancestor-closed, at most
    /// `max_branch` children per node (depths were limited when the trie was built), cut to
    /// the leading ones that maximise `(1 + sum of scores) / secs(rows)` when `secs` (the
    /// step's seconds by verify rows) is given; see "The rule" on [`MergedProposer`] for the
    /// order of the nodes.
    pub(super) fn write_tree(
        &mut self,
        max_nodes: usize,
        max_branch: usize,
        secs: Option<&dyn Fn(usize) -> f64>,
        draft: &mut Draft,
    ) {
        let n = self.nodes.len();
        self.order.clear();
        self.order.extend(0..n as u32);
        let mut order = std::mem::take(&mut self.order);
        order.sort_unstable_by(|&a, &b| self.better(a, b));
        self.kept.clear();
        self.kept.resize(n, false);
        self.kept_children.clear();
        self.kept_children.resize(n + 1, 0);
        let mut count = 0usize;
        // `count <= i`: writing `order[count]` never touches a node still to be read.
        for i in 0..n {
            let id = order[i];
            if count == max_nodes {
                break;
            }
            let node = &self.nodes[id as usize];
            // The parent ranks before its children (its score is at least theirs, and it is
            // the earlier node), so its fate is known.
            let row = if node.parent == NONE {
                0
            } else if self.kept[node.parent as usize] {
                node.parent as usize + 1
            } else {
                continue;
            };
            if self.kept_children[row] >= max_branch {
                continue;
            }
            self.kept_children[row] += 1;
            self.kept[id as usize] = true;
            // The kept nodes, in rank order, at the front of `order` (every prefix is
            // ancestor-closed: a parent ranks before its children).
            order[count] = id;
            count += 1;
        }
        if let Some(secs) = secs {
            let keep = best_prefix(
                order[..count]
                    .iter()
                    .map(|&id| self.nodes[id as usize].score),
                secs,
            );
            for &id in &order[keep..count] {
                self.kept[id as usize] = false;
            }
        }
        self.order = order;
        self.emit(draft);
    }

    /// Emits the kept nodes into `draft` (cleared by the caller) in a topological order with
    /// every sibling group best first: repeatedly the earliest (smallest id) node whose parent
    /// and better siblings are already out. When the ranking agrees with the insertion order
    /// (a single proposer), that is the insertion order: the proposer's own node order.
    pub(super) fn emit(&mut self, draft: &mut Draft) {
        let n = self.nodes.len();
        self.groups.clear();
        self.groups
            .extend((0..n as u32).filter(|&id| self.kept[id as usize]));
        let mut groups = std::mem::take(&mut self.groups);
        groups.sort_unstable_by(|&a, &b| {
            let (pa, pb) = (
                self.nodes[a as usize].parent.wrapping_add(1),
                self.nodes[b as usize].parent.wrapping_add(1),
            );
            pa.cmp(&pb).then(self.better(a, b))
        });
        // first_kept[parent + 1], next_kept[id].
        self.first_kept.clear();
        self.first_kept.resize(n + 1, NONE);
        self.next_kept.clear();
        self.next_kept.resize(n, NONE);
        for (i, &id) in groups.iter().enumerate() {
            let p = self.nodes[id as usize].parent.wrapping_add(1) as usize;
            if i == 0 || self.nodes[groups[i - 1] as usize].parent.wrapping_add(1) as usize != p {
                self.first_kept[p] = id;
            }
            if let Some(&next) = groups.get(i + 1)
                && self.nodes[next as usize].parent.wrapping_add(1) as usize == p
            {
                self.next_kept[id as usize] = next;
            }
        }
        self.groups = groups;
        self.out_row.clear();
        self.out_row.resize(n, 0);
        let mut heap = BinaryHeap::new();
        if self.first_kept[0] != NONE {
            heap.push(Reverse(self.first_kept[0]));
        }
        while let Some(Reverse(id)) = heap.pop() {
            let node = self.nodes[id as usize];
            let parent_row = if node.parent == NONE {
                0
            } else {
                self.out_row[node.parent as usize]
            };
            draft.tokens.push(node.token);
            draft.parents.push(parent_row);
            // At most `max_nodes` draft nodes, each a trie node below 2^32 - 2.
            self.out_row[id as usize] = draft.tokens.len() as u32;
            if self.first_kept[id as usize + 1] != NONE {
                heap.push(Reverse(self.first_kept[id as usize + 1]));
            }
            if self.next_kept[id as usize] != NONE {
                heap.push(Reverse(self.next_kept[id as usize]));
            }
        }
        normalize_chain(draft);
    }

    /// The end node of the path with the largest expected accepted length (the sum of the
    /// scores along it; ties to the earlier end node); when `secs` (the step's seconds by
    /// verify rows) is given, of the path (the empty one, [`NONE`], included) with the largest
    /// expected tokens per second, `(1 + sum) / secs(depth + 1)`. [`NONE`] for an empty trie.
    pub(super) fn best_chain_end(&mut self, secs: Option<&dyn Fn(usize) -> f64>) -> u32 {
        // Expected accepted length of the path ending at each node.
        self.sums.clear();
        let value = |sum: f64, depth: u32| match secs {
            Some(f) => (1.0 + sum) / f(depth as usize + 1),
            None => sum,
        };
        let mut best: Option<(f64, u32)> = secs.map(|f| (1.0 / f(1), NONE));
        for id in 0..self.nodes.len() {
            let node = &self.nodes[id];
            let s = node.score
                + if node.parent == NONE {
                    0.0
                } else {
                    self.sums[node.parent as usize]
                };
            self.sums.push(s);
            let v = value(s, node.depth);
            if best.is_none_or(|(b, _)| v > b) {
                best = Some((v, id as u32));
            }
        }
        best.map_or(NONE, |(_, id)| id)
    }

    /// Writes the path to [`Trie::best_chain_end`] as a chain.
    pub(super) fn write_chain(&mut self, secs: Option<&dyn Fn(usize) -> f64>, draft: &mut Draft) {
        let mut id = self.best_chain_end(secs);
        while id != NONE {
            let node = &self.nodes[id as usize];
            draft.tokens.push(node.token);
            id = node.parent;
        }
        draft.tokens.reverse();
    }

    /// How many leading nodes of the accepted path `path` (trie ids from the root's child)
    /// lie on the path from the root to `end` ([`NONE`]: none).
    pub(super) fn accepted_to(&self, path: &[u32], mut end: u32) -> usize {
        // The deepest node of the path to `end` that is on the accepted path (trie paths are
        // unique, so every node above it is too).
        while end != NONE {
            let node = &self.nodes[end as usize];
            let d = node.depth as usize;
            if path.get(d - 1) == Some(&end) {
                return d;
            }
            end = node.parent;
        }
        0
    }
}

/// The number of leading nodes (scores `scores`, in rank order) that maximises the expected
/// tokens per second of the step, `(1 + sum of their scores) / secs(n + 1)` over `n` (`n + 1`
/// verify rows); ties to the fewer nodes.
pub(super) fn best_prefix(scores: impl Iterator<Item = f64>, secs: &dyn Fn(usize) -> f64) -> usize {
    let (mut best, mut best_n, mut sum) = (1.0 / secs(1), 0, 1.0);
    for (i, p) in scores.enumerate() {
        sum += p;
        let v = sum / secs(i + 2);
        if v > best {
            (best, best_n) = (v, i + 1);
        }
    }
    best_n
}
