//! [`MergedProposer`]: the drafts of several proposers merged into one prefix tree per step,
//! ranked by acceptance rates learned online.
//!
//! n-gram and suffix proposers win where text repeats, model-based drafts elsewhere, and an
//! oracle that picks the best proposer per step beats every single one ("Performance or
//! Illusion?", MLSys 2026). With token trees no choice is needed: the candidates of every
//! proposer share one verify forward as branches of one tree (SpecInfer, Miao et al., ASPLOS
//! 2024, section 3: a token tree merged from the candidates of several small speculative
//! models). The node budget is spent where acceptance is likely: each node is scored by its
//! estimated reach probability, the product of conditional acceptance rates along its path
//! (the expansion rule of EAGLE-2, Li et al. 2024, and the acceptance-vector model of Sequoia,
//! Chen et al. 2024), with the rates learned per proposer and depth from what the target
//! emitted.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::ngram::{EdgeMap, edge_key, normalize_chain};
use super::{Draft, ProposeRequest, Proposer, VerifiedRows};
use crate::error::{Error, ProposalFault, Result};
use crate::tree::TreeFault;
use crate::verify::RowCandidates;

/// Most proposers one [`MergedProposer`] holds (each node remembers its proposers in a 64-bit
/// set).
pub const MAX_MERGED_PROPOSERS: usize = 64;

/// Default of [`MergedProposer::with_decay`]: the adaptive draft-length policy's decay
/// ([`crate::decode::AdaptiveConfig::decay`]).
pub const DEFAULT_MERGE_DECAY: f64 = 0.98;

/// "None" for node ids and links; also the root as a parent.
const NONE: u32 = u32::MAX;

/// Decayed counts of one (proposer, depth): tested candidates and accepted ones.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    accepted: f64,
    tested: f64,
}

impl Counts {
    /// Posterior mean of the acceptance rate under a Beta(1, 1) prior.
    fn rate(&self) -> f64 {
        (self.accepted + 1.0) / (self.tested + 2.0)
    }
}

/// One node of the candidate trie: a distinct path proposed by at least one proposer.
#[derive(Debug, Clone, Copy)]
struct Node {
    token: u32,
    /// Parent node id, or [`NONE`] for a child of the root.
    parent: u32,
    /// 1 for a child of the root.
    depth: u32,
    /// Bit `s` set when proposer `s` proposed this path.
    proposers: u64,
    /// Estimated reach probability (product of the conditional rates along the path).
    score: f64,
    /// Children in insertion order (linked list).
    first_child: u32,
    last_child: u32,
    next_sibling: u32,
}

/// The prefix trie of every candidate of one step (kept in the draft or not), with the
/// scratch of the selection.
#[derive(Debug, Clone, Default)]
struct Trie {
    nodes: Vec<Node>,
    /// `(parent id + 1, token) -> id`, the root being 0 (`NONE + 1` wraps to 0).
    edges: EdgeMap,
    root_first: u32,
    root_last: u32,
    /// Ids by decreasing score (selection order).
    order: Vec<u32>,
    /// Whether each node is in the draft.
    kept: Vec<bool>,
    /// Kept children per node (index `id + 1`; 0 is the root).
    kept_children: Vec<usize>,
    /// Kept nodes sorted by (parent, best sibling first), and the links made from it.
    groups: Vec<u32>,
    first_kept: Vec<u32>,
    next_kept: Vec<u32>,
    /// Draft row of each emitted node (its draft index + 1).
    out_row: Vec<u32>,
    /// Expected accepted length of the path to each node (chain steps).
    sums: Vec<f64>,
}

impl Trie {
    fn clear(&mut self) {
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
    fn child(&mut self, parent: u32, token: u32, depth: u32, bit: u64) -> Result<u32> {
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

    fn first_child_of(&self, parent: u32) -> u32 {
        if parent == NONE {
            self.root_first
        } else {
            self.nodes[parent as usize].first_child
        }
    }

    /// The ranking of nodes `a` and `b` (`Less`: `a` first): higher score, then earlier node.
    fn better(&self, a: u32, b: u32) -> std::cmp::Ordering {
        let (sa, sb) = (self.nodes[a as usize].score, self.nodes[b as usize].score);
        sb.total_cmp(&sa).then(a.cmp(&b))
    }

    /// Writes the best tree: the top `max_nodes` nodes by score, ancestor-closed, at most
    /// `max_branch` children per node (depths were limited when the trie was built); see
    /// "The rule" on [`MergedProposer`] for the order of the nodes.
    fn write_tree(&mut self, max_nodes: usize, max_branch: usize, draft: &mut Draft) {
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
        for &id in &order {
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
            count += 1;
        }
        self.order = order;
        self.emit(draft);
    }

    /// Emits the kept nodes into `draft` (cleared by the caller) in a topological order with
    /// every sibling group best first: repeatedly the earliest (smallest id) node whose parent
    /// and better siblings are already out. When the ranking agrees with the insertion order
    /// (a single proposer), that is the insertion order: the proposer's own node order.
    fn emit(&mut self, draft: &mut Draft) {
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

    /// Writes the path with the largest expected accepted length (the sum of the scores along
    /// it; ties to the earlier end node) as a chain.
    fn write_chain(&mut self, draft: &mut Draft) {
        let n = self.nodes.len();
        // Expected accepted length of the path ending at each node.
        self.sums.clear();
        let mut best: Option<(f64, u32)> = None;
        for id in 0..n {
            let node = &self.nodes[id];
            let s = node.score
                + if node.parent == NONE {
                    0.0
                } else {
                    self.sums[node.parent as usize]
                };
            self.sums.push(s);
            if best.is_none_or(|(b, _)| s > b) {
                best = Some((s, id as u32));
            }
        }
        let Some((_, mut id)) = best else {
            return;
        };
        while id != NONE {
            let node = &self.nodes[id as usize];
            draft.tokens.push(node.token);
            id = node.parent;
        }
        draft.tokens.reverse();
    }
}

/// Merges the drafts of several proposers into one prefix tree per step and keeps the nodes
/// most likely to be accepted under the node budget.
///
/// # The rule
///
/// At each step every proposer is asked for its draft with the same request
/// ([`Proposer::propose_tree`] for a tree step, [`Proposer::propose`] for a chain step), in the
/// order given to [`MergedProposer::new`]. Then:
///
/// 1. **Merge.** All candidates go into one prefix trie: identical paths (the same tokens from
///    the root) are one node, which remembers every proposer that proposed it. Nodes deeper
///    than `req.max_draft` are left out (with their subtrees); draft probabilities q and
///    sibling schemes of the proposers are dropped.
/// 2. **Score.** Proposer `s` at depth `d` has the estimated conditional acceptance rate
///    `r(s, d) = (a + 1) / (t + 2)` (the posterior mean under a Beta(1, 1) prior) from its
///    decayed counts `a` of accepted and `t` of tested candidates at that depth (0.5 before
///    any observation). A node's conditional rate is the largest `r(s, d)` over the proposers
///    that proposed it, and its score is the product of the conditional rates along its path:
///    its estimated probability to be reached by the accepted path.
/// 3. **Select** (tree steps). The nodes by decreasing score, ties to the earlier node (the
///    earlier proposer, then the proposer's own order), are kept until `req.max_nodes` nodes,
///    skipping a node whose parent was not kept or already has `req.max_branch` kept
///    children. Rates are below 1, so a node scores below its parent and the kept set is
///    ancestor-closed: the top `max_nodes` nodes that fit the branching limit.
/// 4. **Order.** The kept nodes are written in a topological order in which every sibling
///    group is best first: repeatedly the earliest node whose parent and better siblings are
///    already written. With one proposer all siblings tie, so a draft that fits the budget
///    comes out exactly as that proposer wrote it. A tree that is a single path is returned in
///    the chain form (empty [`Draft::parents`]).
///
/// **Chain steps** ([`Proposer::propose`]) merge the proposers' chains the same way and return
/// the path with the largest expected accepted length (the sum of the scores of its nodes; ties
/// to the earlier proposer), at most `req.max_draft` tokens. With one proposer that is its own
/// chain.
///
/// # Losslessness: the merged draft is a point mass
///
/// The merged draft carries no q ([`Draft::q`] is `None`) and the default sibling scheme,
/// [`crate::SiblingScheme::Deterministic`]: every node is a point mass, for which the verifier
/// is exact whatever candidates are chosen and however they are ranked (see [`crate::verify`],
/// "Trees"). A proposer's q (a [`super::DraftModelProposer`]'s, for example) is **not used**
/// when it is merged: its tokens count as point-mass candidates, so under stochastic
/// verification its nodes are accepted with the target's probability of the token rather than
/// `min(1, p / q)`. The rates are learned only from tokens already emitted, so a draft never
/// depends on the verifier's draws at its own positions.
///
/// # Learning
///
/// [`Proposer::observe`] matches `emitted` against the trie of **all** candidates of the step
/// (kept in the draft or not): the accepted path is the sequence of nodes whose tokens are the
/// leading emitted tokens. A candidate was *tested* when its parent is on that path (or it is a
/// child of the root) and its depth `d` is at most `emitted.len()`; it was *accepted* when it
/// is on the path. With point-mass drafts the emitted token at each position is the target's
/// own draw (greedy: the argmax; sampling: the seeded draw, case C15), so whether a candidate
/// left out of the draft would have been accepted is known exactly, and every proposer learns
/// at every step, whatever the selection kept. Each tested candidate adds 1 to `t` of every
/// proposer that proposed it at its depth, each accepted one also 1 to `a`; before a step's
/// counts are added, the counts of each (proposer, depth) that has some are multiplied by the
/// decay ([`MergedProposer::with_decay`], default 0.98, as the adaptive draft-length policy).
/// The rates carry over from one generation to the next.
///
/// # Feedback to the proposers
///
/// [`Proposer::begin`] and [`Proposer::finish`] are forwarded to every proposer.
/// [`Proposer::observe`] tells each proposer its own accepted count: the length of the longest
/// leading run of `emitted` that is a path of its own draft of the step (a chain: the leading
/// tokens of its chain that match), at most the merged step's `accepted` (tokens past the
/// accepted path were not verified as drafts), with the same `emitted`; without a pending step
/// (observe without a proposal) the count is 0. [`Proposer::row_candidates`] is the largest of
/// the proposers', and [`Proposer::observe_rows`] is forwarded to every proposer that asks for
/// rows, each seeing at most the number of ids per row it asked for; the rows' inputs, parents
/// and path are those of the merged draft (Token Recycling, for one, reads only the inputs and
/// their candidates).
///
/// # Errors
///
/// An error of a proposer (in any of the forwarded calls) is returned as it is, and the step's
/// later proposers are not asked; a proposer's malformed tree (`parents` of the wrong length,
/// or a parent after its node) is [`Error::InvalidProposal`] naming that proposer.
///
/// # Complexity
///
/// A step costs the proposers' own calls plus, for `M` candidate nodes in all, `O(M)` hash
/// operations to merge, `O(M * P)` for the rates of `P` proposers and `O(M log M)` to rank and
/// order; memory `O(M)` scratch plus 16 bytes per (proposer, depth) of the rates.
///
/// `MergedProposer` is `Send` (its proposers are).
///
/// # Example
///
/// ```
/// use speculative::propose::{
///     Draft, MergedProposer, PromptLookup, ProposeRequest, Proposer, SuffixConfig, SuffixProposer,
/// };
/// use speculative::SamplingConfig;
///
/// let mut merged = MergedProposer::new(vec![
///     Box::new(PromptLookup::new(1, 3)?),
///     Box::new(SuffixProposer::new(SuffixConfig::default())?),
/// ])?;
/// let config = SamplingConfig::greedy();
/// let context = [5, 6, 7, 8, 9, 5, 6, 7, 3, 4, 5, 6];
/// let mut req = ProposeRequest::new(&context, &config, 3);
/// req.max_nodes = 6;
/// let mut draft = Draft::default();
/// merged.propose_tree(&req, &mut draft)?;
/// assert!(draft.len() <= 6 && draft.q.is_none());
/// assert_eq!(draft.tokens[0], 7); // what followed [5, 6] both times before
/// // ... the target verifies the tree and emits [7, 3, 1]; every proposer learns from it.
/// merged.observe(2, &[7, 3, 1])?;
/// assert!(merged.rate(0, 1) > 0.5);
/// # Ok::<(), speculative::Error>(())
/// ```
pub struct MergedProposer {
    subs: Vec<Box<dyn Proposer + Send>>,
    decay: f64,
    /// `stats[s][d - 1]`: decayed counts of proposer `s` at depth `d`.
    stats: Vec<Vec<Counts>>,
    /// Each proposer's draft of the pending step.
    sub_drafts: Vec<Draft>,
    trie: Trie,
    /// Draft node -> trie node, one proposer's draft at a time.
    map: Vec<u32>,
    /// A proposal is waiting for its [`Proposer::observe`].
    pending: bool,
    /// Per-proposer counts of one depth of one step.
    step: Vec<Counts>,
    /// Rows cut to one proposer's [`Proposer::row_candidates`].
    rows: RowCandidates,
}

impl std::fmt::Debug for MergedProposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MergedProposer")
            .field(
                "proposers",
                &self.subs.iter().map(|s| s.name()).collect::<Vec<_>>(),
            )
            .field("decay", &self.decay)
            .finish()
    }
}

impl MergedProposer {
    /// Merges `proposers` (1 to [`MAX_MERGED_PROPOSERS`]), in this order (it breaks ties), with
    /// the decay [`DEFAULT_MERGE_DECAY`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `proposers` when the set is empty or holds more than 64.
    pub fn new(proposers: Vec<Box<dyn Proposer + Send>>) -> Result<Self> {
        if proposers.is_empty() {
            return Err(Error::config(
                "proposers",
                0,
                "a merge needs at least one proposer",
            ));
        }
        if proposers.len() > MAX_MERGED_PROPOSERS {
            return Err(Error::config(
                "proposers",
                proposers.len(),
                "at most 64 proposers (MAX_MERGED_PROPOSERS)",
            ));
        }
        let n = proposers.len();
        Ok(MergedProposer {
            subs: proposers,
            decay: DEFAULT_MERGE_DECAY,
            stats: vec![Vec::new(); n],
            sub_drafts: vec![Draft::default(); n],
            trie: Trie::default(),
            map: Vec::new(),
            pending: false,
            step: vec![Counts::default(); n],
            rows: RowCandidates::default(),
        })
    }

    /// Sets the decay of the acceptance counts per step, in `(0, 1]` (1 = no forgetting; see
    /// "Learning" on [`MergedProposer`]).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `decay` outside `(0, 1]` (NaN included).
    pub fn with_decay(mut self, decay: f64) -> Result<Self> {
        if !(decay > 0.0 && decay <= 1.0) {
            return Err(Error::config("decay", decay, "must be in (0, 1]"));
        }
        self.decay = decay;
        Ok(self)
    }

    /// The decay of the acceptance counts per step. `O(1)`.
    pub fn decay(&self) -> f64 {
        self.decay
    }

    /// Number of merged proposers. `O(1)`.
    pub fn len(&self) -> usize {
        self.subs.len()
    }

    /// Always `false`: a merge holds at least one proposer. `O(1)`.
    pub fn is_empty(&self) -> bool {
        self.subs.is_empty()
    }

    /// Proposer `i` (in the order given to [`MergedProposer::new`]), if any. `O(1)`.
    pub fn proposer(&self, i: usize) -> Option<&(dyn Proposer + Send)> {
        self.subs.get(i).map(|b| &**b)
    }

    /// The estimated conditional acceptance rate of proposer `i` at depth `depth` (1 for a
    /// child of the root): `(a + 1) / (t + 2)` from its decayed counts, 0.5 before any
    /// observation (and for depth 0 or an unknown proposer). `O(1)`.
    pub fn rate(&self, proposer: usize, depth: usize) -> f64 {
        self.counts(proposer, depth).rate()
    }

    /// Forgets every learned rate (back to the prior). `O(proposers * depths)`.
    pub fn reset_rates(&mut self) {
        for s in &mut self.stats {
            s.clear();
        }
    }

    fn counts(&self, proposer: usize, depth: usize) -> Counts {
        depth
            .checked_sub(1)
            .and_then(|d| self.stats.get(proposer)?.get(d).copied())
            .unwrap_or_default()
    }

    /// The conditional rate of a node proposed by the set `proposers` at `depth`.
    fn node_rate(&self, mut proposers: u64, depth: u32) -> f64 {
        let mut best = 0.0f64;
        while proposers != 0 {
            let s = proposers.trailing_zeros() as usize;
            proposers &= proposers - 1;
            best = best.max(self.rate(s, depth as usize));
        }
        best
    }

    /// Asks every proposer for its draft (`tree`: `propose_tree`) and merges the drafts into
    /// the trie, scored.
    fn gather(&mut self, req: &ProposeRequest<'_>, tree: bool) -> Result<()> {
        self.pending = false;
        self.trie.clear();
        for (sub, d) in self.subs.iter_mut().zip(&mut self.sub_drafts) {
            if tree {
                sub.propose_tree(req, d)?;
            } else {
                sub.propose(req, d)?;
            }
        }
        for s in 0..self.subs.len() {
            self.insert(s, req.max_draft)?;
        }
        for id in 0..self.trie.nodes.len() {
            let node = self.trie.nodes[id];
            let parent = if node.parent == NONE {
                1.0
            } else {
                self.trie.nodes[node.parent as usize].score
            };
            self.trie.nodes[id].score = parent * self.node_rate(node.proposers, node.depth);
        }
        self.pending = true;
        Ok(())
    }

    /// Merges proposer `s`'s draft into the trie (nodes deeper than `max_depth` left out).
    fn insert(&mut self, s: usize, max_depth: usize) -> Result<()> {
        let d = &self.sub_drafts[s];
        let n = d.tokens.len();
        let fault = |f: TreeFault| Error::InvalidProposal {
            proposer: self.subs[s].name(),
            fault: ProposalFault::Tree(f),
        };
        if !d.parents.is_empty() && d.parents.len() != n {
            return Err(fault(TreeFault::Shape {
                what: "parents",
                expected: n,
                actual: d.parents.len(),
            }));
        }
        let bit = 1u64 << s;
        self.map.clear();
        for j in 0..n {
            let row = if d.parents.is_empty() {
                j
            } else {
                d.parents[j] as usize
            };
            if row > j {
                return Err(fault(TreeFault::ParentNotBefore {
                    node: j,
                    parent: row as u32,
                }));
            }
            let (parent, depth) = if row == 0 {
                (NONE, 1u32)
            } else {
                match self.map[row - 1] {
                    NONE => {
                        self.map.push(NONE);
                        continue;
                    }
                    p => (p, self.trie.nodes[p as usize].depth + 1),
                }
            };
            if depth as usize > max_depth {
                self.map.push(NONE);
                continue;
            }
            let id = self.trie.child(parent, d.tokens[j], depth, bit)?;
            self.map.push(id);
        }
        Ok(())
    }

    /// Updates the rates from the pending step's trie and `emitted` (see "Learning").
    fn learn(&mut self, emitted: &[u32]) {
        let mut cur = NONE;
        for (d, &token) in emitted.iter().enumerate() {
            self.step.fill(Counts::default());
            let mut next = NONE;
            let mut c = self.trie.first_child_of(cur);
            if c == NONE {
                break;
            }
            while c != NONE {
                let node = self.trie.nodes[c as usize];
                let hit = node.token == token;
                if hit {
                    next = c;
                }
                let mut m = node.proposers;
                while m != 0 {
                    let s = m.trailing_zeros() as usize;
                    m &= m - 1;
                    self.step[s].tested += 1.0;
                    if hit {
                        self.step[s].accepted += 1.0;
                    }
                }
                c = node.next_sibling;
            }
            for (stats, step) in self.stats.iter_mut().zip(&self.step) {
                if step.tested == 0.0 {
                    continue;
                }
                if stats.len() <= d {
                    stats.resize(d + 1, Counts::default());
                }
                let e = &mut stats[d];
                e.accepted = e.accepted * self.decay + step.accepted;
                e.tested = e.tested * self.decay + step.tested;
            }
            if next == NONE {
                break;
            }
            cur = next;
        }
    }
}

/// The length of the longest leading run of `emitted` that is a path of `d` (chain or tree),
/// at most `cap`. One pass: the nodes are in topological order.
fn own_accepted(d: &Draft, emitted: &[u32], cap: usize) -> usize {
    let limit = cap.min(emitted.len());
    let mut row = 0usize;
    let mut depth = 0usize;
    for (j, &t) in d.tokens.iter().enumerate() {
        if depth == limit {
            break;
        }
        let parent = if d.parents.is_empty() {
            j
        } else {
            match d.parents.get(j) {
                Some(&p) => p as usize,
                None => break,
            }
        };
        if parent == row && t == emitted[depth] {
            row = j + 1;
            depth += 1;
        }
    }
    depth
}

impl Proposer for MergedProposer {
    /// `true` when every merged proposer drafts from tokens alone.
    fn drafts_from_tokens(&self) -> bool {
        self.subs.iter().all(|p| p.drafts_from_tokens())
    }

    /// The merged chain: every proposer's chain ([`Proposer::propose`]) merged, and the path
    /// with the largest expected accepted length, at most `req.max_draft` tokens (see "The
    /// rule" on [`MergedProposer`]). No q.
    ///
    /// # Errors
    /// The first error of a proposer, as it is; [`Error::InvalidProposal`] naming a proposer
    /// whose draft is a malformed tree; [`Error::Proposer`] past `2^32 - 2` candidates.
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        self.gather(req, false)?;
        self.trie.write_chain(draft);
        Ok(())
    }

    /// The merged tree: every proposer's tree ([`Proposer::propose_tree`]) merged, and the
    /// best `req.max_nodes` nodes by estimated reach probability, depth at most
    /// `req.max_draft`, at most `req.max_branch` children per node, siblings best first (see
    /// "The rule" on [`MergedProposer`]). Point masses only: no q, default schemes.
    ///
    /// # Errors
    /// As [`MergedProposer::propose`](Proposer::propose).
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        self.gather(req, true)?;
        self.trie.write_tree(req.max_nodes, req.max_branch, draft);
        Ok(())
    }

    /// Learns the rates from the pending step (see "Learning" on [`MergedProposer`]), then
    /// tells each proposer its own accepted count and `emitted`.
    ///
    /// # Errors
    /// The first error of a proposer's `observe`, as it is (the later proposers are not told).
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        let pending = std::mem::replace(&mut self.pending, false);
        if pending {
            self.learn(emitted);
        }
        for (sub, d) in self.subs.iter_mut().zip(&self.sub_drafts) {
            let own = if pending {
                own_accepted(d, emitted, accepted)
            } else {
                0
            };
            sub.observe(own, emitted)?;
        }
        Ok(())
    }

    /// The largest [`Proposer::row_candidates`] of the merged proposers.
    fn row_candidates(&self) -> usize {
        self.subs
            .iter()
            .map(|s| s.row_candidates())
            .max()
            .unwrap_or(0)
    }

    /// Forwards `rows` to every proposer whose [`Proposer::row_candidates`] is above 0, each
    /// row cut to the number of ids that proposer asked for.
    ///
    /// # Errors
    /// The first error of a proposer, as it is.
    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        for sub in &mut self.subs {
            let k = sub.row_candidates();
            if k == 0 {
                continue;
            }
            if rows.candidates.iter().all(|r| r.len() <= k) {
                sub.observe_rows(rows)?;
            } else {
                self.rows.clear();
                for r in rows.candidates.iter() {
                    self.rows.push_row(&r[..k.min(r.len())]);
                }
                sub.observe_rows(&VerifiedRows {
                    candidates: &self.rows,
                    ..*rows
                })?;
            }
        }
        Ok(())
    }

    /// Forwards `begin` to every proposer (the learned rates are kept).
    ///
    /// # Errors
    /// The first error of a proposer, as it is.
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.pending = false;
        for sub in &mut self.subs {
            sub.begin(prompt)?;
        }
        Ok(())
    }

    /// Forwards `begin_reusing` to every proposer.
    fn begin_reusing(&mut self, prompt: &[u32]) -> Result<()> {
        self.pending = false;
        for sub in &mut self.subs {
            sub.begin_reusing(prompt)?;
        }
        Ok(())
    }

    /// Forwards `finish` to every proposer.
    fn finish(&mut self, sequence: &[u32]) {
        self.pending = false;
        for sub in &mut self.subs {
            sub.finish(sequence);
        }
    }

    /// `"merged"`.
    fn name(&self) -> &'static str {
        "merged"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::propose::PromptLookup;
    use crate::sampling::SamplingConfig;
    use crate::tree::{DraftBlock, TreeLimits};
    use std::sync::{Arc, Mutex};

    /// What a [`Fixed`] proposer was told.
    #[derive(Debug, Default)]
    struct Log {
        observed: Vec<(usize, Vec<u32>)>,
        rows: Vec<Vec<Vec<u32>>>,
        begins: usize,
        finishes: usize,
    }

    /// Returns the same draft every step (`propose_tree`: the whole tree, a chain when
    /// `parents` is empty; `propose`: the first `max_draft` tokens as a chain), and logs its
    /// feedback.
    struct Fixed {
        tokens: Vec<u32>,
        parents: Vec<u32>,
        row_k: usize,
        fail: bool,
        log: Arc<Mutex<Log>>,
    }

    fn fixed(tokens: &[u32], parents: &[u32]) -> (Box<dyn Proposer + Send>, Arc<Mutex<Log>>) {
        let log = Arc::new(Mutex::new(Log::default()));
        let p = Fixed {
            tokens: tokens.to_vec(),
            parents: parents.to_vec(),
            row_k: 0,
            fail: false,
            log: log.clone(),
        };
        (Box::new(p), log)
    }

    fn chain(tokens: &[u32]) -> Box<dyn Proposer + Send> {
        fixed(tokens, &[]).0
    }

    impl Proposer for Fixed {
        fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
            draft.clear();
            if self.fail {
                return Err(Error::proposer("fixed failed"));
            }
            let k = req.max_draft.min(self.tokens.len());
            draft.tokens.extend_from_slice(&self.tokens[..k]);
            Ok(())
        }
        fn propose_tree(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
            draft.clear();
            if self.fail {
                return Err(Error::proposer("fixed failed"));
            }
            draft.tokens.extend_from_slice(&self.tokens);
            draft.parents.extend_from_slice(&self.parents);
            Ok(())
        }
        fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
            self.log
                .lock()
                .unwrap()
                .observed
                .push((accepted, emitted.to_vec()));
            Ok(())
        }
        fn row_candidates(&self) -> usize {
            self.row_k
        }
        fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
            let r = rows.candidates.iter().map(|r| r.to_vec()).collect();
            self.log.lock().unwrap().rows.push(r);
            Ok(())
        }
        fn begin(&mut self, _prompt: &[u32]) -> Result<()> {
            self.log.lock().unwrap().begins += 1;
            Ok(())
        }
        fn finish(&mut self, _sequence: &[u32]) {
            self.log.lock().unwrap().finishes += 1;
        }
    }

    const CTX: [u32; 3] = [0, 0, 0];

    fn tree(m: &mut MergedProposer, depth: usize, nodes: usize, branch: usize) -> Draft {
        let cfg = SamplingConfig::greedy();
        let mut req = ProposeRequest::new(&CTX, &cfg, depth);
        req.max_nodes = nodes;
        req.max_branch = branch;
        let mut d = Draft::default();
        m.propose_tree(&req, &mut d).unwrap();
        d
    }

    fn chain_of(m: &mut MergedProposer, depth: usize) -> Draft {
        let cfg = SamplingConfig::greedy();
        let req = ProposeRequest::new(&CTX, &cfg, depth);
        let mut d = Draft::default();
        m.propose(&req, &mut d).unwrap();
        d
    }

    /// Every root-to-node path of a draft, as token sequences, sorted.
    fn paths(d: &Draft) -> Vec<Vec<u32>> {
        let b = d.block();
        let mut out: Vec<Vec<u32>> = (0..d.len())
            .map(|i| {
                let mut nodes = Vec::new();
                b.path_to(i, &mut nodes);
                nodes.iter().map(|&j| d.tokens[j as usize]).collect()
            })
            .collect();
        out.sort();
        out
    }

    fn valid(d: &Draft, depth: usize, nodes: usize, branch: usize) {
        let limits = TreeLimits {
            max_nodes: nodes,
            max_depth: depth,
            max_branch: branch,
            ..TreeLimits::vocab(1 << 20)
        };
        d.block().validate(&limits).unwrap();
        assert!(d.q.is_none() && d.schemes.is_empty());
    }

    #[test]
    fn construction_is_checked() {
        assert!(matches!(
            MergedProposer::new(Vec::new()),
            Err(Error::InvalidConfig {
                field: "proposers",
                ..
            })
        ));
        let many: Vec<Box<dyn Proposer + Send>> = (0..65).map(|_| chain(&[1])).collect();
        assert!(matches!(
            MergedProposer::new(many),
            Err(Error::InvalidConfig {
                field: "proposers",
                ..
            })
        ));
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let m = MergedProposer::new(vec![chain(&[1])]).unwrap();
            assert!(matches!(
                m.with_decay(bad),
                Err(Error::InvalidConfig { field: "decay", .. })
            ));
        }
        let m = MergedProposer::new(vec![chain(&[1]), chain(&[2])])
            .unwrap()
            .with_decay(1.0)
            .unwrap();
        assert_eq!((m.len(), m.decay(), m.name()), (2, 1.0, "merged"));
        assert_eq!(m.rate(0, 1), 0.5);
        assert_eq!(m.rate(7, 0), 0.5);
        assert!(!m.is_empty());
        assert!(m.proposer(1).is_some() && m.proposer(2).is_none());
    }

    #[test]
    fn overlapping_drafts_merge_into_one_trie() {
        // A: chain 1 2 3. B: tree 1 -> 2 -> 4, 1 -> 6, root -> 5.
        let (b, _) = fixed(&[1, 2, 4, 5, 6], &[0, 1, 2, 0, 1]);
        let mut m = MergedProposer::new(vec![chain(&[1, 2, 3]), b]).unwrap();
        let d = tree(&mut m, 8, 16, usize::MAX);
        valid(&d, 8, 16, usize::MAX);
        assert_eq!(
            paths(&d),
            [
                vec![1],
                vec![1, 2],
                vec![1, 2, 3],
                vec![1, 2, 4],
                vec![1, 6],
                vec![5]
            ]
        );
        // All rates at the prior: scores by depth, ties to the earlier node; the earliest node
        // whose parent and better siblings are out comes next.
        assert_eq!(d.tokens, [1, 2, 3, 4, 5, 6]);
        assert_eq!(d.parents, [0, 1, 2, 2, 0, 1]);
    }

    #[test]
    fn a_single_proposer_is_passed_through() {
        // A prefix tree in a non-breadth-first order.
        let tokens = [1, 2, 3, 4, 5, 6];
        let parents = [0, 1, 0, 3, 1, 2];
        let (p, _) = fixed(&tokens, &parents);
        let mut m = MergedProposer::new(vec![p]).unwrap();
        for _ in 0..3 {
            let d = tree(&mut m, 4, 6, 3);
            assert_eq!((&d.tokens[..], &d.parents[..]), (&tokens[..], &parents[..]));
            m.observe(1, &[1, 9]).unwrap();
        }
        // Chains, tree and chain steps.
        let mut m = MergedProposer::new(vec![chain(&[4, 5, 6])]).unwrap();
        let d = tree(&mut m, 4, 8, 2);
        assert_eq!(
            (&d.tokens[..], d.parents.is_empty()),
            (&[4, 5, 6][..], true)
        );
        assert_eq!(chain_of(&mut m, 2).tokens, [4, 5]);
        // A real proposer's tree, a few contexts.
        let cfg = SamplingConfig::greedy();
        let context = [3, 4, 5, 6, 3, 4, 7, 8, 3, 4, 5, 9, 3, 4];
        for (depth, nodes) in [(3, 6), (4, 4), (2, 3), (5, 12)] {
            let mut req = ProposeRequest::new(&context, &cfg, depth);
            req.max_nodes = nodes;
            let mut want = Draft::default();
            PromptLookup::new(1, 3)
                .unwrap()
                .propose_tree(&req, &mut want)
                .unwrap();
            assert!(!want.is_empty());
            let mut m =
                MergedProposer::new(vec![Box::new(PromptLookup::new(1, 3).unwrap())]).unwrap();
            let mut got = Draft::default();
            m.propose_tree(&req, &mut got).unwrap();
            assert_eq!(got, want, "depth {depth} nodes {nodes}");
            PromptLookup::new(1, 3)
                .unwrap()
                .propose(&req, &mut want)
                .unwrap();
            m.propose(&req, &mut got).unwrap();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn budget_depth_and_branching_are_honoured() {
        // A complete ternary tree of depth 3 (39 nodes), breadth first, from two proposers
        // with different tokens at the leaves.
        let mut tokens = Vec::new();
        let mut parents = Vec::new();
        let mut level = vec![0u32];
        for depth in 0..3 {
            let mut next = Vec::new();
            for &row in &level {
                for c in 0..3 {
                    tokens.push(10 * depth + c);
                    parents.push(row);
                    next.push(tokens.len() as u32);
                }
            }
            level = next;
        }
        let mut leaves = tokens.clone();
        for t in &mut leaves[12..] {
            *t += 100;
        }
        let (a, _) = fixed(&tokens, &parents);
        let (b, _) = fixed(&leaves, &parents);
        let mut m = MergedProposer::new(vec![a, b]).unwrap();
        for (depth, nodes, branch) in [
            (3, 64, usize::MAX),
            (3, 10, usize::MAX),
            (2, 64, usize::MAX),
            (3, 64, 2),
            (3, 7, 1),
            (1, 2, 5),
            (0, 5, 5),
            (3, 0, 5),
        ] {
            let d = tree(&mut m, depth, nodes, branch);
            valid(&d, depth, nodes, branch);
            // Per level: 3 children per node at depths 1 and 2, 6 at depth 3 (both leaf sets).
            let (w, w3) = (3.min(branch), 6.min(branch));
            let levels = [w, w * w, w * w * w3];
            let want = levels[..depth].iter().sum::<usize>().min(nodes);
            assert_eq!(d.len(), want, "{depth} {nodes} {branch}");
            // The top nodes: a full tree is kept level by level (scores fall with depth).
            let depths: Vec<usize> = (0..d.len()).map(|i| d.block().depth(i)).collect();
            assert!(depths.windows(2).all(|w| w[0] <= w[1]), "{depths:?}");
        }
    }

    #[test]
    fn rates_are_learned_with_decay() {
        let mut m = MergedProposer::new(vec![chain(&[1, 2]), chain(&[1, 3])])
            .unwrap()
            .with_decay(0.5)
            .unwrap();
        // Budget 1: only node 1 is drafted, but every candidate is learned from.
        let d = tree(&mut m, 2, 1, 8);
        assert_eq!(d.tokens, [1]);
        m.observe(1, &[1, 2]).unwrap();
        // Depth 1: both tested and accepted; depth 2: both tested, A accepted.
        assert_eq!(m.rate(0, 1), 2.0 / 3.0);
        assert_eq!(m.rate(1, 1), 2.0 / 3.0);
        assert_eq!(m.rate(0, 2), 2.0 / 3.0);
        assert_eq!(m.rate(1, 2), 1.0 / 3.0);
        assert_eq!(m.rate(0, 3), 0.5);
        // Step 2: emitted 1 3: A's depth-2 counts (1, 1) decay to (0.5, 0.5), then (+0, +1).
        tree(&mut m, 2, 1, 8);
        m.observe(1, &[1, 3]).unwrap();
        assert_eq!(m.rate(0, 2), (0.5 + 1.0) / (1.5 + 2.0));
        assert_eq!(m.rate(1, 2), (0.0 + 1.0 + 1.0) / (1.5 + 2.0));
        assert_eq!(m.rate(0, 1), (1.5 + 1.0) / (1.5 + 2.0));
        // A first token off every candidate: depth 1 tested and rejected, nothing deeper.
        tree(&mut m, 2, 1, 8);
        m.observe(0, &[7]).unwrap();
        assert_eq!(m.rate(0, 1), (0.75 + 1.0) / (1.75 + 2.0));
        assert_eq!(m.rate(0, 2), (0.5 + 1.0) / (1.5 + 2.0));
        // An observe without a proposal learns nothing.
        m.observe(0, &[5]).unwrap();
        assert_eq!(m.rate(0, 1), (0.75 + 1.0) / (1.75 + 2.0));
        m.reset_rates();
        assert_eq!(m.rate(0, 1), 0.5);
    }

    #[test]
    fn ranking_follows_the_learned_rates() {
        // B is listed first and wins ties; A is the one that is right.
        let mut m = MergedProposer::new(vec![chain(&[7, 8, 9]), chain(&[1, 2, 3])]).unwrap();
        // At the prior the top 3 by reach: both depth-1 nodes and B's depth-2 node.
        let d = tree(&mut m, 3, 3, 8);
        assert_eq!(
            (&d.tokens[..], &d.parents[..]),
            (&[7, 8, 1][..], &[0, 1, 0][..])
        );
        m.observe(0, &[1]).unwrap();
        let d = tree(&mut m, 3, 4, 8);
        // A's depth 1 node now ranks first, and siblings come best first.
        assert_eq!(d.tokens[0], 1);
        assert_eq!(d.parents[..2], [0, 0]);
        for _ in 0..4 {
            tree(&mut m, 3, 3, 8);
            m.observe(3, &[1, 2, 3, 4]).unwrap();
        }
        assert!(m.rate(1, 3) > 0.6 && m.rate(0, 1) < 0.3);
        assert_eq!(tree(&mut m, 3, 3, 8).tokens, [1, 2, 3]);
        assert_eq!(chain_of(&mut m, 3).tokens, [1, 2, 3]);
        m.observe(3, &[1, 2, 3, 4]).unwrap();
    }

    #[test]
    fn chain_steps_pick_the_longest_expected_path() {
        // At the prior, 3 nodes (0.5 + 0.25 + 0.125) beat 1 (0.5) whatever the order.
        let mut m = MergedProposer::new(vec![chain(&[4]), chain(&[1, 2, 3])]).unwrap();
        let d = chain_of(&mut m, 8);
        assert_eq!(
            (d.tokens.as_slice(), d.parents.is_empty()),
            (&[1, 2, 3][..], true)
        );
        assert_eq!(chain_of(&mut m, 2).tokens, [1, 2]);
        // Learn that 4 is right at depth 1 and the other is wrong.
        for _ in 0..6 {
            chain_of(&mut m, 3);
            m.observe(1, &[4, 0]).unwrap();
        }
        assert_eq!(chain_of(&mut m, 3).tokens, [4]);
        assert!(chain_of(&mut m, 0).is_empty());
    }

    #[test]
    fn each_proposer_is_told_its_own_accepted_count() {
        let (a, la) = fixed(&[1, 2, 3], &[]);
        // B: 1 -> 5, 1 -> 2 -> 3 -> 4 (the matching branch is not the first).
        let (b, lb) = fixed(&[1, 5, 2, 3, 4], &[0, 1, 1, 3, 4]);
        let (c, lc) = fixed(&[9, 2], &[]);
        let mut m = MergedProposer::new(vec![a, b, c]).unwrap();
        m.begin(&[0]).unwrap();
        tree(&mut m, 4, 2, 8);
        // Only two nodes were drafted and accepted; the bonus token 3 is not an accepted draft.
        m.observe(2, &[1, 2, 3]).unwrap();
        tree(&mut m, 4, 16, 8);
        m.observe(4, &[1, 2, 3, 4, 6]).unwrap();
        // A stop cut the step: accepted = emitted.len().
        tree(&mut m, 4, 16, 8);
        m.observe(1, &[1]).unwrap();
        // No proposal pending.
        m.observe(0, &[6]).unwrap();
        m.finish(&[0, 1]);
        let got = |l: &Arc<Mutex<Log>>| {
            let l = l.lock().unwrap();
            assert_eq!((l.begins, l.finishes), (1, 1));
            l.observed.iter().map(|o| o.0).collect::<Vec<_>>()
        };
        assert_eq!(got(&la), [2, 3, 1, 0]);
        assert_eq!(got(&lb), [2, 4, 1, 0]);
        assert_eq!(got(&lc), [0, 0, 0, 0]);
        assert_eq!(la.lock().unwrap().observed[1].1, [1, 2, 3, 4, 6]);
    }

    #[test]
    fn rows_are_forwarded_to_the_proposers_that_ask() {
        let mk = |k| {
            let log = Arc::new(Mutex::new(Log::default()));
            let p: Box<dyn Proposer + Send> = Box::new(Fixed {
                tokens: vec![1],
                parents: vec![],
                row_k: k,
                fail: false,
                log: log.clone(),
            });
            (p, log)
        };
        let (a, la) = mk(2);
        let (b, lb) = mk(0);
        let (c, lc) = mk(4);
        let mut m = MergedProposer::new(vec![a, b, c]).unwrap();
        assert_eq!(m.row_candidates(), 4);
        let mut rows = RowCandidates::default();
        rows.push_row(&[5, 6, 7, 8]);
        rows.push_row(&[9]);
        m.observe_rows(&VerifiedRows {
            inputs: &[0, 1],
            parents: &[],
            candidates: &rows,
            path: &[0],
        })
        .unwrap();
        assert_eq!(la.lock().unwrap().rows, [vec![vec![5, 6], vec![9]]]);
        assert!(lb.lock().unwrap().rows.is_empty());
        assert_eq!(lc.lock().unwrap().rows, [vec![vec![5, 6, 7, 8], vec![9]]]);
        let m = MergedProposer::new(vec![chain(&[1])]).unwrap();
        assert_eq!(m.row_candidates(), 0);
    }

    #[test]
    fn proposer_errors_propagate() {
        let log = Arc::new(Mutex::new(Log::default()));
        let failing: Box<dyn Proposer + Send> = Box::new(Fixed {
            tokens: vec![1],
            parents: vec![],
            row_k: 0,
            fail: true,
            log,
        });
        let mut m = MergedProposer::new(vec![chain(&[1]), failing]).unwrap();
        let cfg = SamplingConfig::greedy();
        let req = ProposeRequest::new(&CTX, &cfg, 2);
        let mut d = Draft::default();
        let e = m.propose(&req, &mut d).unwrap_err();
        assert_eq!(e.to_string(), "proposer error: fixed failed");
        // A malformed tree names its proposer.
        let (bad, _) = fixed(&[1, 2], &[0, 2]);
        let mut m = MergedProposer::new(vec![chain(&[1]), bad]).unwrap();
        let e = m.propose_tree(&req, &mut d).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::InvalidProposal {
                    fault: ProposalFault::Tree(TreeFault::ParentNotBefore { node: 1, parent: 2 }),
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("Fixed"), "{e}");
        let _ = DraftBlock::chain(&[]);
    }

    /// A draft of up to 12 nodes with random parents (any earlier row) and tokens below 4:
    /// duplicate siblings and any depth allowed.
    fn any_tree() -> impl proptest::strategy::Strategy<Value = (Vec<u32>, Vec<u32>)> {
        use proptest::prelude::*;
        proptest::collection::vec((any::<u32>(), 0u32..4), 0..12).prop_map(|v| {
            let parents = v
                .iter()
                .enumerate()
                .map(|(j, &(r, _))| r % (j as u32 + 1))
                .collect();
            (parents, v.iter().map(|&(_, t)| t).collect())
        })
    }

    proptest::proptest! {
        #[test]
        fn merged_trees_are_valid_and_hold_only_proposed_paths(
            subs in proptest::collection::vec(any_tree(), 1..4),
            depth in 0usize..5,
            nodes in 0usize..20,
            branch in proptest::prop_oneof![1usize..4, proptest::strategy::Just(usize::MAX)],
        ) {
            let boxed = subs
                .iter()
                .map(|(parents, tokens)| fixed(tokens, parents).0)
                .collect();
            let mut m = MergedProposer::new(boxed).unwrap();
            let d = tree(&mut m, depth, nodes, branch);
            valid(&d, depth, nodes, branch);
            // Every candidate path within the depth, over all proposers.
            let mut all = std::collections::BTreeSet::new();
            for (parents, tokens) in &subs {
                let sub = Draft { tokens: tokens.clone(), parents: parents.clone(), ..Draft::default() };
                for p in paths(&sub) {
                    if p.len() <= depth {
                        all.insert(p);
                    }
                }
            }
            let got = paths(&d);
            for p in &got {
                proptest::prop_assert!(all.contains(p), "{p:?} was proposed by nobody");
            }
            // Distinct paths: a prefix tree.
            let distinct: std::collections::BTreeSet<_> = got.iter().collect();
            proptest::prop_assert_eq!(distinct.len(), got.len());
            if branch == usize::MAX {
                // At the prior the score falls with depth only: the shallowest candidates
                // fill the budget.
                proptest::prop_assert_eq!(got.len(), nodes.min(all.len()));
                if let Some(deepest) = got.iter().map(Vec::len).max() {
                    for p in &all {
                        proptest::prop_assert!(p.len() >= deepest || distinct.contains(p));
                    }
                }
            }
            // Siblings best first: at the prior, in order of depth; all nodes in topological
            // order (checked by `valid`).
            let mut chain_req = Draft::default();
            let cfg = SamplingConfig::greedy();
            let req = ProposeRequest::new(&CTX, &cfg, depth);
            m.propose(&req, &mut chain_req).unwrap();
            proptest::prop_assert!(chain_req.parents.is_empty() && chain_req.len() <= depth);
        }
    }
}
