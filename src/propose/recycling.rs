//! [`TokenRecycling`]: Token Recycling (Luo et al. 2024, "Turning Trash into Treasure:
//! Accelerating Inference of Large Language Models with Token Recycling", arXiv 2408.08696).
//!
//! Every verify step computes the target's distribution after each token it was fed, the
//! rejected draft nodes included, and plain speculative decoding throws those rows away. Token
//! Recycling keeps, for every token id `t`, the best `top_k` next tokens the target's most recent
//! row after `t` produced (an adjacency table of `vocab x top_k` ids), and drafts by walking the
//! table: the chain follows each token's best successor, a tree follows a static template
//! ([`TreeTemplate`]) whose node `(parent, r)` is "the `r`-th best successor of the parent's
//! token" (the paper's section 3).
//!
//! The rows arrive through the loop's feedback path: the proposer asks for `top_k` ids per row
//! ([`Proposer::row_candidates`]), the verifier computes them once per step
//! ([`crate::VerifyRequest::row_top_k`]) and the loop hands them over in
//! [`Proposer::observe_rows`]. Drafts are point masses (no q), so the verifier's
//! [`crate::SiblingScheme::Deterministic`] rule applies and every step is exact whatever the
//! table holds.

use std::io::{Read, Write};

use super::{Draft, ProposeRequest, Proposer, VerifiedRows};
use crate::error::{Error, Result};

/// `RecyclingConfig::DEFAULT_TOP_K`.
const DEFAULT_TOP_K: usize = 8;

/// `RecyclingConfig::MAX_TOP_K`.
const MAX_TOP_K: usize = 64;

/// `TreeTemplate::MAX_NODES`.
const MAX_TEMPLATE_NODES: usize = 4096;

/// `TreeTemplate::DEFAULT_WIDTHS`.
const DEFAULT_WIDTHS: [usize; 8] = [8, 16, 16, 14, 10, 8, 5, 3];

/// Table entry that holds no successor. Never a token id: [`TokenRecycling::new`] requires
/// `vocab_size <= u32::MAX`, so every id is below it.
const EMPTY: u32 = u32::MAX;

/// "No draft row" in the walk's slot map.
const NO_ROW: u32 = u32::MAX;

/// Magic bytes opening a saved table ([`TokenRecycling::write_to`]).
const MAGIC: [u8; 8] = *b"SPECRTBL";

/// Version of the saved-table format written by this crate.
const FORMAT_VERSION: u32 = 1;

// ---------------------------------------------------------------------------------------------
// The tree template.
// ---------------------------------------------------------------------------------------------

/// One node of a [`TreeTemplate`]: the slot of its parent (`0` = the root, `j + 1` = template
/// node `j`, the convention of [`crate::Draft::parents`]) and its sibling rank `rank`: the node's
/// token is the `rank`-th best successor (0 = best) of its parent's token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct TemplateNode {
    /// Parent slot: `0` for a child of the root, `j + 1` for a child of template node `j`.
    pub parent: u32,
    /// Sibling rank, `0 .. MAX_TOP_K`: which entry of the parent token's table row.
    pub rank: u32,
}

impl TemplateNode {
    /// The node with parent slot `parent` (`0` = the root, `j + 1` = template node `j`) and
    /// sibling rank `rank` (checked by [`TreeTemplate::new`]).
    pub fn new(parent: u32, rank: u32) -> Self {
        TemplateNode { parent, rank }
    }
}

/// A static draft-tree template for [`TokenRecycling`]: nodes in breadth-first order (depth never
/// decreases; every parent before its children), each "the `r`-th best successor of the
/// parent's token" ([`TemplateNode`]).
///
/// # Shape
///
/// Luo et al. (2024) draft every step along one static, imbalanced tree: wide near the root
/// (the root's candidates side by side), narrowing with depth, the deeper branches under the
/// better-ranked candidates. We do not reproduce the paper's node list. Our shape is derived
/// from a positional prior instead: a node of rank `r` is assumed to be accepted, given its
/// parent, with probability `2^-(r + 1)`, so the **cost** of a node, `-log2` of its path's prior
/// acceptance, is the sum of `rank + 1` along its path ([`TreeTemplate::cost`]).
/// [`TreeTemplate::from_widths`] puts at each depth the cheapest children of the previous
/// depth's nodes, and the default ([`TreeTemplate::DEFAULT_WIDTHS`] = `[8, 16, 16, 14, 10, 8,
/// 5, 3]`: 80 nodes, all 8 candidates of the root at depth 1, then narrowing) is that rule
/// applied to widths of the paper's profile. The node budgets that pay on a CPU (8-16 nodes)
/// use only its cheapest part (below).
///
/// # Scaling to a request
///
/// [`TreeTemplate::scaled`] keeps, of the nodes within the depth (`req.max_draft`) and
/// branching (`req.max_branch`, by rank) limits, the `max_nodes` cheapest (ties: template
/// order), in template order. The cost grows strictly along every path, so the kept nodes
/// always form a tree; a small budget gets the cheapest paths (the rank-0 chain and the
/// best-ranked branches near it), the full budget the whole template. (A plain prefix of the
/// breadth-first order would spend a small budget on the root's fan of depth 1.) The depth of
/// a tree draft never exceeds the template's ([`TreeTemplate::max_depth`], 8 for the default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeTemplate {
    nodes: Vec<TemplateNode>,
    /// Depth of each node (1 for a child of the root).
    depth: Vec<u32>,
    /// Cost of each node (see the type docs).
    cost: Vec<u32>,
    /// Node indices by (cost, index).
    by_cost: Vec<u32>,
}

impl Default for TreeTemplate {
    /// [`TreeTemplate::from_widths`] of [`TreeTemplate::DEFAULT_WIDTHS`] (80 nodes, depth 8).
    fn default() -> Self {
        Self::from_widths(&DEFAULT_WIDTHS).expect("the default widths are valid")
    }
}

impl TreeTemplate {
    /// Per-depth widths of the default template ([`TreeTemplate::default`]): 80 nodes over 8
    /// depths.
    pub const DEFAULT_WIDTHS: [usize; 8] = DEFAULT_WIDTHS;

    /// Largest number of nodes a template may hold.
    pub const MAX_NODES: usize = MAX_TEMPLATE_NODES;

    /// A template from its nodes (`[n]`, breadth-first order, see [`TemplateNode`]). `O(n log
    /// n)`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] (field `template`) when there are more than
    /// [`TreeTemplate::MAX_NODES`] nodes, a parent slot is not `0` or an earlier node, the depth
    /// decreases (not breadth-first), a rank is `>= MAX_TOP_K`, or two siblings share a rank.
    pub fn new(nodes: &[TemplateNode]) -> Result<Self> {
        if nodes.len() > MAX_TEMPLATE_NODES {
            return Err(Error::config(
                "template",
                nodes.len(),
                "at most MAX_TEMPLATE_NODES (4096) nodes",
            ));
        }
        let mut depth = Vec::with_capacity(nodes.len());
        let mut cost = Vec::with_capacity(nodes.len());
        let mut seen = std::collections::HashSet::new();
        for (i, n) in nodes.iter().enumerate() {
            if n.parent as usize > i {
                return Err(Error::config(
                    "template",
                    format!("node {i} with parent slot {}", n.parent),
                    "a parent slot must be 0 (the root) or j + 1 for an earlier node j",
                ));
            }
            if n.rank as usize >= MAX_TOP_K {
                return Err(Error::config(
                    "template",
                    format!("node {i} with rank {}", n.rank),
                    "ranks must be below MAX_TOP_K (64)",
                ));
            }
            if !seen.insert((n.parent, n.rank)) {
                return Err(Error::config(
                    "template",
                    format!("node {i}: rank {} twice under slot {}", n.rank, n.parent),
                    "siblings must have distinct ranks",
                ));
            }
            let (pd, pc) = match n.parent {
                0 => (0, 0),
                p => (depth[p as usize - 1], cost[p as usize - 1]),
            };
            if depth.last().is_some_and(|&d| pd + 1 < d) {
                return Err(Error::config(
                    "template",
                    format!("node {i} at depth {}", pd + 1),
                    "nodes must be in breadth-first order (depth never decreases)",
                ));
            }
            depth.push(pd + 1);
            cost.push(pc + n.rank + 1);
        }
        let mut by_cost: Vec<u32> = (0..nodes.len() as u32).collect();
        by_cost.sort_by_key(|&i| (cost[i as usize], i));
        Ok(TreeTemplate {
            nodes: nodes.to_vec(),
            depth,
            cost,
            by_cost,
        })
    }

    /// A template with `widths[d]` nodes at depth `d + 1`: at each depth the cheapest children
    /// (cost as in the type docs; ties: earlier parent, then lower rank) of the previous
    /// depth's nodes, grouped by parent in breadth-first order. `widths = [w]` is the root's fan
    /// of ranks `0 .. w`; `[1; k]` is the rank-0 chain of length `k`. `O(n * MAX_TOP_K)`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] (field `widths`) when a width is 0, the first is above
    /// [`RecyclingConfig::MAX_TOP_K`], a width exceeds `MAX_TOP_K` times the previous one, or the total exceeds
    /// [`TreeTemplate::MAX_NODES`].
    pub fn from_widths(widths: &[usize]) -> Result<Self> {
        let total = widths.iter().try_fold(0usize, |a, &w| a.checked_add(w));
        if total.is_none_or(|t| t > MAX_TEMPLATE_NODES) {
            return Err(Error::config(
                "widths",
                format!("{widths:?}"),
                "at most MAX_TEMPLATE_NODES (4096) nodes in all",
            ));
        }
        let mut nodes: Vec<TemplateNode> = Vec::new();
        // Slots (0 = root) of the previous depth, with their costs.
        let mut prev: Vec<(u32, u32)> = vec![(0, 0)];
        for &w in widths {
            if w == 0 || w > prev.len() * MAX_TOP_K {
                return Err(Error::config(
                    "widths",
                    format!("{widths:?}"),
                    "every width must be in 1..=MAX_TOP_K (64) times the previous width",
                ));
            }
            let mut cands: Vec<(u32, usize, u32)> = Vec::with_capacity(prev.len() * MAX_TOP_K);
            for (pi, &(_, pc)) in prev.iter().enumerate() {
                for r in 0..MAX_TOP_K as u32 {
                    cands.push((pc + r + 1, pi, r));
                }
            }
            cands.sort_unstable();
            cands.truncate(w);
            // Breadth-first, grouped by parent, ranks ascending.
            cands.sort_unstable_by_key(|&(_, pi, r)| (pi, r));
            let mut next = Vec::with_capacity(w);
            for (c, pi, r) in cands {
                nodes.push(TemplateNode {
                    parent: prev[pi].0,
                    rank: r,
                });
                next.push((nodes.len() as u32, c));
            }
            prev = next;
        }
        Self::new(&nodes)
    }

    /// The nodes, `[n]`, breadth-first.
    pub fn nodes(&self) -> &[TemplateNode] {
        &self.nodes
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// `true` when the template has no node (tree drafts are then empty).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Depth of node `i` (1 for a child of the root).
    ///
    /// # Panics
    /// If `i >= len()`.
    pub fn depth(&self, i: usize) -> usize {
        self.depth[i] as usize
    }

    /// Largest node depth (0 for an empty template).
    pub fn max_depth(&self) -> usize {
        self.depth.last().copied().unwrap_or(0) as usize
    }

    /// Cost of node `i`: the sum of `rank + 1` along its path, `-log2` of the path's prior
    /// acceptance (see the type docs). Strictly larger than its parent's.
    ///
    /// # Panics
    /// If `i >= len()`.
    pub fn cost(&self, i: usize) -> u32 {
        self.cost[i]
    }

    /// The template scaled to a request: of the nodes at depth `<= max_depth` with rank
    /// `< max_branch` (so no node gets more than `max_branch` children) whose ancestors are all
    /// kept, the `max_nodes` cheapest (ties: template order), in template order with their
    /// parent slots renumbered. See the type docs. `O(n)`.
    pub fn scaled(&self, max_nodes: usize, max_depth: usize, max_branch: usize) -> TreeTemplate {
        let mut keep = vec![false; self.len()];
        let mut kept = 0;
        for &i in &self.by_cost {
            if kept >= max_nodes {
                break;
            }
            let i = i as usize;
            let n = self.nodes[i];
            let parent_ok = n.parent == 0 || keep[n.parent as usize - 1];
            if parent_ok && self.depth(i) <= max_depth && (n.rank as usize) < max_branch {
                keep[i] = true;
                kept += 1;
            }
        }
        let mut slot = vec![0u32; self.len()];
        let mut nodes = Vec::with_capacity(kept);
        for i in 0..self.len() {
            if keep[i] {
                let n = self.nodes[i];
                let parent = match n.parent {
                    0 => 0,
                    p => slot[p as usize - 1],
                };
                nodes.push(TemplateNode {
                    parent,
                    rank: n.rank,
                });
                slot[i] = nodes.len() as u32;
            }
        }
        Self::new(&nodes).expect("a subtree of a valid template is valid")
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration and errors.
// ---------------------------------------------------------------------------------------------

/// Configuration of a [`TokenRecycling`] proposer. `#[non_exhaustive]`: build it from
/// [`RecyclingConfig::default`] and the `with_` setters (checked by the proposer's
/// constructor).
///
/// | field | default | valid range |
/// |---|---|---|
/// | `top_k` | 8 ([`RecyclingConfig::DEFAULT_TOP_K`]) | `1 ..= 64` ([`RecyclingConfig::MAX_TOP_K`]) |
/// | `template` | [`TreeTemplate::default`] (80 nodes) | any [`TreeTemplate`] |
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecyclingConfig {
    /// Successor ids kept per token: the width of the adjacency table and the number of ids
    /// asked of every verified row ([`Proposer::row_candidates`]). Memory: `vocab * top_k * 4`
    /// bytes.
    pub top_k: usize,
    /// The tree-draft template. Template nodes of rank `>= top_k` are never drafted.
    pub template: TreeTemplate,
}

impl RecyclingConfig {
    /// Sets [`RecyclingConfig::top_k`].
    pub fn with_top_k(mut self, top_k: usize) -> Self {
        self.top_k = top_k;
        self
    }

    /// Sets [`RecyclingConfig::template`].
    pub fn with_template(mut self, template: TreeTemplate) -> Self {
        self.template = template;
        self
    }
}

impl RecyclingConfig {
    /// Default number of successor ids kept per token ([`RecyclingConfig::top_k`]), the
    /// paper's choice.
    pub const DEFAULT_TOP_K: usize = DEFAULT_TOP_K;

    /// Largest [`RecyclingConfig::top_k`] accepted, and the bound on template ranks.
    pub const MAX_TOP_K: usize = MAX_TOP_K;
}

impl Default for RecyclingConfig {
    /// `top_k` 8, the default template.
    fn default() -> Self {
        RecyclingConfig {
            top_k: DEFAULT_TOP_K,
            template: TreeTemplate::default(),
        }
    }
}

/// Why a saved table could not be read ([`TokenRecycling::read_from`]); carried by
/// [`Error::Proposer`] (downcast the source to this type).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TableFileError {
    /// The data does not start with the table magic.
    #[error("not a token-recycling table (bad magic bytes)")]
    BadMagic,
    /// A format version this crate cannot read.
    #[error("unsupported token-recycling table version {0} (this crate reads version 1)")]
    UnsupportedVersion(u32),
    /// The table was saved for another vocabulary size or `top_k`.
    #[error("table {field} is {found}, this proposer's is {expected}")]
    Mismatch {
        /// `"vocab"` or `"top_k"`.
        field: &'static str,
        /// This proposer's value.
        expected: u64,
        /// The file's value.
        found: u64,
    },
    /// The header's vocabulary size (0 or above `u32::MAX`) or `top_k` (0 or above
    /// [`RecyclingConfig::MAX_TOP_K`]) is out of range ([`TokenRecycling::load`]).
    #[error("invalid token-recycling table header: {field} {value}")]
    InvalidHeader {
        /// `"vocab"` or `"top_k"`.
        field: &'static str,
        /// The file's value.
        value: u64,
    },
    /// An entry is out of the vocabulary, repeats an earlier id of its row, or follows an empty
    /// entry.
    #[error("invalid entry {value} at row {row}, slot {slot}")]
    InvalidEntry {
        /// Table row (the token id).
        row: usize,
        /// Position in the row.
        slot: usize,
        /// The stored value.
        value: u32,
    },
    /// The data ended early, or reading failed.
    #[error("reading the table failed: {0}")]
    Io(#[from] std::io::Error),
}

// ---------------------------------------------------------------------------------------------
// The proposer.
// ---------------------------------------------------------------------------------------------

/// Token Recycling (Luo et al. 2024): drafts from an adjacency table of the target's own recent
/// top candidates.
///
/// # Table
///
/// `vocab x top_k` `u32` ids, row-major: row `t` holds the best next tokens after token `t`,
/// best first, as the most recent target row whose input was `t` ranked them (processed with
/// the request's configuration along that row's path, [`crate::RowCandidates`]). Memory:
/// `vocab * top_k * 4` bytes ([`TokenRecycling::table_bytes`]), for example 1.5 MiB for
/// SmolLM2's 49,152-token vocabulary at `top_k` 8, 8 MiB for Gemma 3's 262,144. Entries not yet
/// filled are empty (an internal marker that never reaches a draft).
///
/// # Update
///
/// [`Proposer::observe_rows`]: for every verified row of the step (the root's and every node's,
/// rejected nodes included), in row order, the table row of the row's input token is replaced
/// by the row's candidates (the paper's rule: the newest candidates replace the old; later rows
/// of the same step win). A row with no candidate (its mask allowed none) leaves the table
/// alone. Input tokens and candidate ids `>= vocab_size` are ignored (never an error, never a
/// panic): a table built for a smaller vocabulary simply learns nothing about them.
///
/// # Drafts
///
/// - Chain ([`Proposer::propose`]): the rank-0 chain from the last context token, up to
///   `req.max_draft` tokens, stopping at an empty entry and after the first EOS.
/// - Tree ([`Proposer::propose_tree`]), when `req.max_nodes > req.max_draft` (else the chain
///   of `max_nodes` tokens, like the other shipped proposers): the template scaled to the request
///   ([`TreeTemplate::scaled`] with `max_nodes`, depth `max_draft`, branching `min(max_branch,
///   top_k)`), walked breadth-first: node `(parent, r)` is `table[parent's token][r]`. A node
///   whose entry is empty, or whose parent is an EOS, is skipped with its subtree (the draft
///   may have fewer nodes than the budget). Siblings are distinct (a table row holds distinct
///   ids; checked again while drafting).
///
/// Drafts are point masses (no q): the verifier's deterministic sibling rule makes every step
/// exact whatever the table holds, and greedy output is identical to plain greedy decoding.
///
/// # State across requests
///
/// The table is kept by [`Proposer::begin`] and [`Proposer::finish`]: it is knowledge of the
/// target model (which tokens the model ranks best after a token), not of a request. Drafts
/// read only `req.context.last()` and the table, so a proposer used without the loop never
/// serves a stale request's state in the sense of the [`Proposer`] docs: any table is a valid
/// source of candidates for any request, and a table warmed on earlier requests (or loaded with
/// [`TokenRecycling::read_from`] or [`TokenRecycling::load`]) is what makes the first steps of a
/// new request draft well.
/// Call [`TokenRecycling::clear`] when the target model or its tokenizer changes.
///
/// ```
/// use speculative::propose::{RecyclingConfig, TokenRecycling};
/// use speculative::Proposer;
///
/// let p = TokenRecycling::new(49_152, RecyclingConfig::default())?;
/// assert_eq!(p.table_bytes(), 49_152 * 8 * 4);
/// assert_eq!(p.row_candidates(), 8);
/// assert_eq!(p.filled_rows(), 0);
/// # Ok::<(), speculative::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct TokenRecycling {
    vocab: usize,
    top_k: usize,
    table: Vec<u32>,
    filled: usize,
    template: TreeTemplate,
    /// The template scaled to the last request's limits `(max_nodes, max_draft, branch)`.
    scaled: Option<((usize, usize, usize), TreeTemplate)>,
    /// Draft row (`j + 1`) of each scaled-template node, [`NO_ROW`] when skipped.
    slot_row: Vec<u32>,
}

impl TokenRecycling {
    /// An empty table for `vocab_size` token ids.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `vocab_size` is 0 or above `u32::MAX`, `top_k` is 0 or
    /// above [`RecyclingConfig::MAX_TOP_K`], or the table's size in bytes overflows `usize`.
    pub fn new(vocab_size: usize, config: RecyclingConfig) -> Result<Self> {
        if vocab_size == 0 || vocab_size > u32::MAX as usize {
            return Err(Error::config(
                "vocab_size",
                vocab_size,
                "must be in 1..=u32::MAX",
            ));
        }
        if config.top_k == 0 || config.top_k > MAX_TOP_K {
            return Err(Error::config(
                "top_k",
                config.top_k,
                "must be in 1..=MAX_TOP_K (64)",
            ));
        }
        let entries = vocab_size
            .checked_mul(config.top_k)
            .filter(|e| e.checked_mul(4).is_some())
            .ok_or_else(|| {
                Error::config(
                    "vocab_size",
                    vocab_size,
                    "vocab_size * top_k * 4 bytes must fit in usize",
                )
            })?;
        Ok(TokenRecycling {
            vocab: vocab_size,
            top_k: config.top_k,
            table: vec![EMPTY; entries],
            filled: 0,
            template: config.template,
            scaled: None,
            slot_row: Vec::new(),
        })
    }

    /// The vocabulary size the table covers.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Successor ids kept per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The tree template.
    pub fn template(&self) -> &TreeTemplate {
        &self.template
    }

    /// Size of the table in bytes: `vocab_size * top_k * 4`.
    pub fn table_bytes(&self) -> usize {
        self.table.len() * 4
    }

    /// Number of tokens whose table row holds at least one successor.
    pub fn filled_rows(&self) -> usize {
        self.filled
    }

    /// The successors of `token`, best first (empty when none is known or `token >=
    /// vocab_size`).
    pub fn successors(&self, token: u32) -> &[u32] {
        let Some(row) = self.row(token) else {
            return &[];
        };
        let n = row.iter().position(|&t| t == EMPTY).unwrap_or(row.len());
        &row[..n]
    }

    /// Empties the table (every row).
    pub fn clear(&mut self) {
        self.table.fill(EMPTY);
        self.filled = 0;
    }

    /// Replaces the successors of `token` with `ids` (best first): ids `>= vocab_size` and
    /// repeats are dropped, at most `top_k` kept, the rest of the row emptied. Does nothing when
    /// `token >= vocab_size` or no id remains. The update of [`Proposer::observe_rows`].
    pub fn set_successors(&mut self, token: u32, ids: &[u32]) {
        if token as usize >= self.vocab {
            return;
        }
        let (k, vocab) = (self.top_k, self.vocab);
        let start = token as usize * k;
        let row = &mut self.table[start..start + k];
        let was_filled = row[0] != EMPTY;
        let mut n = 0;
        for &id in ids {
            if n == k {
                break;
            }
            if (id as usize) < vocab && !row[..n].contains(&id) {
                row[n] = id;
                n += 1;
            }
        }
        if n == 0 {
            return;
        }
        row[n..].fill(EMPTY);
        if !was_filled {
            self.filled += 1;
        }
    }

    fn row(&self, token: u32) -> Option<&[u32]> {
        let t = token as usize;
        (t < self.vocab).then(|| &self.table[t * self.top_k..(t + 1) * self.top_k])
    }

    /// Entry `rank` of `token`'s row (`None`: empty, or out of range).
    fn entry(&self, token: u32, rank: usize) -> Option<u32> {
        self.row(token)
            .and_then(|r| r.get(rank).copied())
            .filter(|&t| t != EMPTY)
    }

    /// Saves the table: a 24-byte header (magic `SPECRTBL`, format version `u32`, vocab size
    /// `u64`, `top_k` `u32`, all little-endian) followed by the `vocab * top_k` entries as
    /// little-endian `u32` (empty entries as `u32::MAX`). The template is not saved.
    ///
    /// # Errors
    /// [`Error::Proposer`] with a [`TableFileError::Io`] when writing fails.
    pub fn write_to(&self, w: &mut impl Write) -> Result<()> {
        let io = |e: std::io::Error| Error::proposer(TableFileError::Io(e));
        w.write_all(&MAGIC).map_err(io)?;
        w.write_all(&FORMAT_VERSION.to_le_bytes()).map_err(io)?;
        w.write_all(&(self.vocab as u64).to_le_bytes())
            .map_err(io)?;
        w.write_all(&(self.top_k as u32).to_le_bytes())
            .map_err(io)?;
        let mut buf = Vec::with_capacity(4 * 4096);
        for chunk in self.table.chunks(4096) {
            buf.clear();
            for &t in chunk {
                buf.extend_from_slice(&t.to_le_bytes());
            }
            w.write_all(&buf).map_err(io)?;
        }
        Ok(())
    }

    /// Loads a table saved by [`TokenRecycling::write_to`], replacing this one. The file's vocab
    /// size and `top_k` must equal this proposer's; every entry must be an id below the vocab
    /// size, distinct within its row, or empty, and no id may follow an empty entry. Reads
    /// exactly the header and the table. On any error the current table is left unchanged.
    ///
    /// # Errors
    /// [`Error::Proposer`] with a [`TableFileError`]: `BadMagic`, `UnsupportedVersion`,
    /// `InvalidHeader`, `Mismatch`, `InvalidEntry`, or `Io` (the data ended early, or reading
    /// failed). To load a table whose `top_k` you do not know, use [`TokenRecycling::load`].
    pub fn read_from(&mut self, r: &mut impl Read) -> Result<()> {
        let table = self.read_table(r).map_err(Error::proposer)?;
        self.filled = table
            .chunks(self.top_k)
            .filter(|row| row[0] != EMPTY)
            .count();
        self.table = table;
        Ok(())
    }

    /// A proposer holding the table saved by [`TokenRecycling::write_to`], with the vocabulary
    /// size and `top_k` read from the file (a table warmed with any `top_k`, without knowing it
    /// in advance), drafting along `template`. Every entry is checked as by
    /// [`TokenRecycling::read_from`]. Memory: `vocab * top_k * 4` bytes, grown as the entries
    /// are read (a header that promises more than the data holds fails with `Io`, never with an
    /// allocation of the promised size).
    ///
    /// The file does not say which model it was warmed on: compare
    /// [`TokenRecycling::vocab_size`] with your target's (a table of another vocabulary drafts
    /// ids your target does not have, which the loop rejects with
    /// [`Error::InvalidProposal`]); a table of another model with the same vocabulary is valid
    /// but drafts poorly until its rows are replaced.
    ///
    /// # Errors
    /// [`Error::Proposer`] with a [`TableFileError`]: `BadMagic`, `UnsupportedVersion`,
    /// `InvalidHeader` (vocab size 0 or above `u32::MAX`, `top_k` 0 or above
    /// [`RecyclingConfig::MAX_TOP_K`]), `InvalidEntry`, or `Io`.
    pub fn load(r: &mut impl Read, template: TreeTemplate) -> Result<Self> {
        let (vocab, top_k) = read_header(r).map_err(Error::proposer)?;
        let table = read_entries(r, vocab, top_k).map_err(Error::proposer)?;
        let filled = table.chunks(top_k).filter(|row| row[0] != EMPTY).count();
        Ok(TokenRecycling {
            vocab,
            top_k,
            table,
            filled,
            template,
            scaled: None,
            slot_row: Vec::new(),
        })
    }

    fn read_table(&self, r: &mut impl Read) -> std::result::Result<Vec<u32>, TableFileError> {
        let (vocab, top_k) = read_header(r)?;
        if vocab != self.vocab {
            return Err(TableFileError::Mismatch {
                field: "vocab",
                expected: self.vocab as u64,
                found: vocab as u64,
            });
        }
        if top_k != self.top_k {
            return Err(TableFileError::Mismatch {
                field: "top_k",
                expected: self.top_k as u64,
                found: top_k as u64,
            });
        }
        read_entries(r, vocab, top_k)
    }

    /// The template scaled to `key = (max_nodes, max_draft, branch)`, cached.
    fn scaled_template(&mut self, key: (usize, usize, usize)) -> &TreeTemplate {
        if self.scaled.as_ref().is_none_or(|(k, _)| *k != key) {
            let t = self.template.scaled(key.0, key.1, key.2);
            self.scaled = Some((key, t));
        }
        &self.scaled.as_ref().expect("just set").1
    }
}

/// The header of a saved table: `(vocab, top_k)`, each checked against the ranges
/// [`TokenRecycling::new`] accepts.
fn read_header(r: &mut impl Read) -> std::result::Result<(usize, usize), TableFileError> {
    let mut header = [0u8; 24];
    r.read_exact(&mut header)?;
    if header[..8] != MAGIC {
        return Err(TableFileError::BadMagic);
    }
    let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(TableFileError::UnsupportedVersion(version));
    }
    let vocab = u64::from_le_bytes(header[12..20].try_into().expect("8 bytes"));
    if vocab == 0 || vocab > u32::MAX as u64 {
        return Err(TableFileError::InvalidHeader {
            field: "vocab",
            value: vocab,
        });
    }
    let top_k = u32::from_le_bytes(header[20..24].try_into().expect("4 bytes"));
    if top_k == 0 || top_k as usize > MAX_TOP_K {
        return Err(TableFileError::InvalidHeader {
            field: "top_k",
            value: top_k as u64,
        });
    }
    Ok((vocab as usize, top_k as usize))
}

/// The `vocab * k` entries of a saved table, each checked (see [`TokenRecycling::read_from`]).
/// The table grows as rows arrive, so a short file fails before a large allocation.
fn read_entries(
    r: &mut impl Read,
    vocab: usize,
    k: usize,
) -> std::result::Result<Vec<u32>, TableFileError> {
    let mut table = Vec::new();
    let mut buf = vec![0u8; 4 * k];
    for row in 0..vocab {
        r.read_exact(&mut buf)?;
        let start = table.len();
        for slot in 0..k {
            let v = u32::from_le_bytes(buf[4 * slot..4 * slot + 4].try_into().expect("4 bytes"));
            let prev = &table[start..];
            let bad = if v == EMPTY {
                false
            } else {
                v as usize >= vocab || prev.contains(&v) || prev.contains(&EMPTY)
            };
            if bad {
                return Err(TableFileError::InvalidEntry {
                    row,
                    slot,
                    value: v,
                });
            }
            table.push(v);
        }
    }
    Ok(table)
}

impl Proposer for TokenRecycling {
    /// `true`: drafts from the context's tokens alone.
    fn drafts_from_tokens(&self) -> bool {
        true
    }

    /// The rank-0 chain from `req.context.last()`: at most `req.max_draft` tokens, ending at the
    /// first empty entry or right after the first EOS. Empty when the context is empty or its
    /// last token is `>= vocab_size`. `O(max_draft)`.
    ///
    /// # Errors
    /// None.
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let Some(&root) = req.context.last() else {
            return Ok(());
        };
        let mut t = root;
        while draft.tokens.len() < req.max_draft {
            let Some(next) = self.entry(t, 0) else {
                break;
            };
            draft.tokens.push(next);
            if req.is_eos(next) {
                break;
            }
            t = next;
        }
        Ok(())
    }

    /// The scaled template walked breadth-first (see the type docs): at most `req.max_nodes`
    /// nodes, depth at most `req.max_draft`, at most `min(req.max_branch, top_k)` children per
    /// node, no node below an EOS, distinct siblings. With `req.max_nodes <= req.max_draft` it
    /// is the chain of [`TokenRecycling::propose`](Proposer::propose) with `max_draft =
    /// max_nodes`, as for the other shipped proposers. `O(nodes * siblings)` after the template
    /// is scaled (once per distinct set of limits, `O(template)`).
    ///
    /// # Errors
    /// None.
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        if req.max_nodes <= req.max_draft {
            // The convention of the shipped proposers: no branching unless the node budget
            // exceeds the depth.
            let chain = ProposeRequest {
                max_draft: req.max_nodes,
                ..*req
            };
            return self.propose(&chain, draft);
        }
        let Some(&root) = req.context.last() else {
            return Ok(());
        };
        let key = (req.max_nodes, req.max_draft, req.max_branch.min(self.top_k));
        self.scaled_template(key);
        let template = &self.scaled.as_ref().expect("scaled above").1;
        let mut slot_row = std::mem::take(&mut self.slot_row);
        slot_row.clear();
        for n in template.nodes() {
            let (parent_row, parent_tok) = match n.parent {
                0 => (0, root),
                p => match slot_row[p as usize - 1] {
                    NO_ROW => {
                        slot_row.push(NO_ROW);
                        continue;
                    }
                    row => (row, draft.tokens[row as usize - 1]),
                },
            };
            let tok = if parent_row != 0 && req.is_eos(parent_tok) {
                None
            } else {
                self.entry(parent_tok, n.rank as usize)
            };
            // Distinct siblings: a table row holds distinct ids, checked again here so that a
            // duplicate can never reach the verifier.
            let tok = tok.filter(|&t| {
                !draft
                    .tokens
                    .iter()
                    .zip(&draft.parents)
                    .any(|(&s, &p)| p == parent_row && s == t)
            });
            match tok {
                Some(t) => {
                    draft.tokens.push(t);
                    draft.parents.push(parent_row);
                    slot_row.push(draft.tokens.len() as u32);
                }
                None => slot_row.push(NO_ROW),
            }
        }
        self.slot_row = slot_row;
        Ok(())
    }

    /// `top_k`: the number of best ids of each verified row the table keeps.
    fn row_candidates(&self) -> usize {
        self.top_k
    }

    /// Replaces the table row of each verified row's input token with the row's candidates (see
    /// the type docs, "Update").
    ///
    /// # Errors
    /// None: tokens `>= vocab_size` are ignored.
    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        for (r, ids) in rows.candidates.iter().enumerate() {
            if let Some(&input) = rows.inputs.get(r) {
                self.set_successors(input, ids);
            }
        }
        Ok(())
    }

    /// `"recycling"`.
    fn name(&self) -> &'static str {
        "recycling"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingConfig;
    use crate::verify::RowCandidates;

    fn cfg(top_k: usize) -> RecyclingConfig {
        RecyclingConfig {
            top_k,
            ..RecyclingConfig::default()
        }
    }

    fn node(parent: u32, rank: u32) -> TemplateNode {
        TemplateNode { parent, rank }
    }

    fn observe(p: &mut TokenRecycling, inputs: &[u32], rows: &[&[u32]]) {
        let mut c = RowCandidates::default();
        for r in rows {
            c.push_row(r);
        }
        p.observe_rows(&VerifiedRows {
            inputs,
            parents: &[],
            candidates: &c,
            path: &[],
        })
        .unwrap();
    }

    fn tree(p: &mut TokenRecycling, ctx: &[u32], k: usize, nodes: usize, eos: &[u32]) -> Draft {
        let config = SamplingConfig::greedy();
        let req = ProposeRequest {
            max_nodes: nodes,
            eos,
            ..ProposeRequest::new(ctx, &config, k)
        };
        let mut d = Draft {
            tokens: vec![9; 3],
            ..Default::default()
        };
        p.propose_tree(&req, &mut d).unwrap();
        d
    }

    fn chain(p: &mut TokenRecycling, ctx: &[u32], k: usize, eos: &[u32]) -> Vec<u32> {
        let config = SamplingConfig::greedy();
        let req = ProposeRequest {
            eos,
            ..ProposeRequest::new(ctx, &config, k)
        };
        let mut d = Draft {
            tokens: vec![9; 3],
            ..Default::default()
        };
        p.propose(&req, &mut d).unwrap();
        assert!(d.parents.is_empty() && d.q.is_none());
        d.tokens
    }

    #[test]
    fn config_errors_are_typed() {
        for (vocab, k) in [(0, 8), (10, 0), (10, MAX_TOP_K + 1)] {
            assert!(matches!(
                TokenRecycling::new(vocab, cfg(k)),
                Err(Error::InvalidConfig { .. })
            ));
        }
        assert!(matches!(
            TokenRecycling::new(usize::MAX / 2, cfg(8)),
            Err(Error::InvalidConfig { .. })
        ));
        let p = TokenRecycling::new(49_152, cfg(8)).unwrap();
        assert_eq!(p.table_bytes(), 1_572_864);
        assert_eq!(p.name(), "recycling");
    }

    #[test]
    fn table_update_replaces_rows_newest_first() {
        let mut p = TokenRecycling::new(10, cfg(3)).unwrap();
        assert_eq!(p.row_candidates(), 3);
        observe(&mut p, &[1, 2], &[&[4, 5, 6, 7], &[3]]);
        assert_eq!(p.successors(1), &[4, 5, 6]);
        assert_eq!(p.successors(2), &[3]);
        assert_eq!(p.filled_rows(), 2);
        // Newer rows replace older ones; within a step the later row wins; an empty row and
        // out-of-vocabulary ids are ignored.
        observe(&mut p, &[1, 2, 1, 42], &[&[8], &[], &[6, 99, 6, 0], &[1]]);
        assert_eq!(p.successors(1), &[6, 0]);
        assert_eq!(p.successors(2), &[3]);
        assert_eq!(p.successors(42), &[] as &[u32]);
        assert_eq!(p.filled_rows(), 2);
        // begin keeps the table; clear empties it.
        p.begin(&[1, 2, 3]).unwrap();
        assert_eq!(p.filled_rows(), 2);
        p.clear();
        assert_eq!((p.filled_rows(), p.successors(1).len()), (0, 0));
    }

    #[test]
    fn empty_table_gives_empty_drafts() {
        let mut p = TokenRecycling::new(10, cfg(8)).unwrap();
        assert!(chain(&mut p, &[1, 2], 4, &[]).is_empty());
        assert!(tree(&mut p, &[1, 2], 4, 16, &[]).is_empty());
        assert!(chain(&mut p, &[], 4, &[]).is_empty());
        observe(&mut p, &[2], &[&[3]]);
        // A last token outside the vocabulary drafts nothing.
        assert!(chain(&mut p, &[2, 77], 4, &[]).is_empty());
        assert!(tree(&mut p, &[77], 4, 16, &[]).is_empty());
    }

    #[test]
    fn chain_follows_rank_zero_and_stops_at_empty_and_eos() {
        let mut p = TokenRecycling::new(10, cfg(2)).unwrap();
        observe(&mut p, &[1, 2, 3, 4], &[&[2, 9], &[3], &[4, 1], &[1]]);
        assert_eq!(chain(&mut p, &[0, 1], 6, &[]), [2, 3, 4, 1, 2, 3]);
        assert_eq!(chain(&mut p, &[1], 2, &[]), [2, 3]);
        assert_eq!(chain(&mut p, &[1], 6, &[3]), [2, 3]);
        assert_eq!(chain(&mut p, &[9], 6, &[]), &[] as &[u32]);
        observe(&mut p, &[4], &[&[5]]);
        assert_eq!(chain(&mut p, &[1], 6, &[]), [2, 3, 4, 5]);
        assert_eq!(chain(&mut p, &[1], 0, &[]), &[] as &[u32]);
    }

    #[test]
    fn template_from_widths_is_breadth_first_and_cheapest() {
        let t = TreeTemplate::from_widths(&[3, 2, 1]).unwrap();
        // Depth 1: ranks 0..3 (costs 1, 2, 3); depth 2: the cheapest children (0,0) cost 2 and
        // (0,1) cost 3 tie with (1,0) cost 3: earlier parent first; depth 3: (0,0,0).
        assert_eq!(
            t.nodes(),
            &[
                node(0, 0),
                node(0, 1),
                node(0, 2),
                node(1, 0),
                node(1, 1),
                node(4, 0)
            ]
        );
        assert_eq!(t.max_depth(), 3);
        assert_eq!((t.cost(3), t.cost(5)), (2, 3));
        assert_eq!(TreeTemplate::from_widths(&[1, 1, 1]).unwrap().len(), 3);
        let d = TreeTemplate::default();
        assert_eq!(d.len(), DEFAULT_WIDTHS.iter().sum::<usize>());
        assert_eq!(d.max_depth(), DEFAULT_WIDTHS.len());
        for w in [&[0usize][..], &[65], &[1, 65], &[4096, 1]] {
            assert!(matches!(
                TreeTemplate::from_widths(w),
                Err(Error::InvalidConfig { .. })
            ));
        }
    }

    #[test]
    fn template_validation() {
        assert!(TreeTemplate::new(&[node(0, 0), node(1, 0), node(0, 1)]).is_err()); // depth drops
        assert!(TreeTemplate::new(&[node(0, 0), node(0, 0)]).is_err()); // same rank
        assert!(TreeTemplate::new(&[node(1, 0)]).is_err()); // parent not earlier
        assert!(TreeTemplate::new(&[node(0, 64)]).is_err());
        assert!(TreeTemplate::new(&[]).unwrap().is_empty());
        assert!(TreeTemplate::new(&[node(0, 0), node(0, 1), node(1, 0), node(2, 0)]).is_ok());
    }

    /// Scaling under each limit: node budget, depth, branching.
    #[test]
    fn template_scaling_respects_each_limit() {
        let t = TreeTemplate::from_widths(&[3, 2, 1]).unwrap();
        // Budget: the cheapest first (ties in template order): (0) 1, (0,0) 2, (1) 2, ...
        assert_eq!(t.scaled(1, 9, 9).nodes(), &[node(0, 0)]);
        assert_eq!(t.scaled(2, 9, 9).nodes(), &[node(0, 0), node(0, 1)]);
        assert_eq!(
            t.scaled(3, 9, 9).nodes(),
            &[node(0, 0), node(0, 1), node(1, 0)]
        );
        assert_eq!(t.scaled(100, 9, 9), t);
        assert!(t.scaled(0, 9, 9).is_empty());
        // Depth.
        assert_eq!(
            t.scaled(100, 1, 9).nodes(),
            &[node(0, 0), node(0, 1), node(0, 2)]
        );
        assert!(t.scaled(100, 0, 9).is_empty());
        // Branching: rank 0 only is the chain.
        assert_eq!(
            t.scaled(100, 9, 1).nodes(),
            &[node(0, 0), node(1, 0), node(2, 0)]
        );
        // All three, on the default template: every scaled tree is valid and within limits.
        let d = TreeTemplate::default();
        for (n, depth, b) in [(8, 4, 8), (16, 6, 3), (5, 2, 2), (80, 8, 8), (12, 12, 1)] {
            let s = d.scaled(n, depth, b);
            assert!(s.len() <= n && s.max_depth() <= depth);
            assert!(s.nodes().iter().all(|x| (x.rank as usize) < b));
            let mut costs: Vec<u32> = (0..s.len()).map(|i| s.cost(i)).collect();
            costs.sort();
            // The kept nodes are the cheapest of the eligible ones.
            let eligible = d.scaled(usize::MAX, depth, b);
            let mut all: Vec<u32> = (0..eligible.len()).map(|i| eligible.cost(i)).collect();
            all.sort();
            assert_eq!(costs, all[..s.len()]);
        }
        assert_eq!(d.scaled(usize::MAX, usize::MAX, usize::MAX), d);
    }

    #[test]
    fn tree_walks_the_template_and_skips_empty_and_eos() {
        let mut p = TokenRecycling::new(10, cfg(3)).unwrap();
        observe(
            &mut p,
            &[0, 1, 2, 3],
            &[&[1, 2, 3], &[4, 5], &[6], &[7, 8, 9]],
        );
        let t = TreeTemplate::from_widths(&[3, 2, 1]).unwrap();
        p.template = t;
        // Template (0,0)=1 (0,1)=2 (0,2)=3, under 1: (1,0)=4 (1,1)=5, under 4: nothing (empty).
        let d = tree(&mut p, &[0], 3, 16, &[]);
        assert_eq!(d.tokens, [1, 2, 3, 4, 5]);
        assert_eq!(d.parents, [0, 0, 0, 1, 1]);
        assert!(d.q.is_none() && d.schemes.is_empty());
        // An EOS node gets no children.
        let d = tree(&mut p, &[0], 3, 16, &[1]);
        assert_eq!((d.tokens, d.parents), (vec![1, 2, 3], vec![0, 0, 0]));
        // Budget, depth and branching limits apply.
        // A budget within the depth gives the rank-0 chain.
        let d = tree(&mut p, &[0], 3, 2, &[]);
        assert_eq!((d.tokens, d.parents), (vec![1, 4], vec![]));
        let d = tree(&mut p, &[0], 2, 3, &[]);
        assert_eq!((d.tokens, d.parents), (vec![1, 2, 4], vec![0, 0, 1]));
        let d = tree(&mut p, &[0], 1, 16, &[]);
        assert_eq!(d.tokens, [1, 2, 3]);
        let config = SamplingConfig::greedy();
        let req = ProposeRequest {
            max_nodes: 16,
            max_branch: 1,
            ..ProposeRequest::new(&[0], &config, 3)
        };
        let mut d = Draft::default();
        p.propose_tree(&req, &mut d).unwrap();
        assert_eq!((d.tokens, d.parents), (vec![1, 4], vec![0, 1]));
        // top_k bounds the branching: ranks >= top_k are never read.
        let mut q = TokenRecycling::new(10, cfg(1)).unwrap();
        observe(&mut q, &[0, 1], &[&[1, 2], &[4, 5]]);
        let d = tree(&mut q, &[0], 3, 16, &[]);
        assert_eq!((d.tokens, d.parents), (vec![1, 4], vec![0, 1]));
    }

    /// Random tables, limits and EOS sets: every tree is valid (distinct siblings, parents
    /// before children), within the budget, the depth and the branching, never below an EOS,
    /// and every node is the table entry its template node names.
    #[test]
    fn random_tables_give_valid_trees_within_the_limits() {
        use crate::tree::TreeLimits;
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..300 {
            let vocab = 2 + next(30) as usize;
            let top_k = 1 + next(8) as usize;
            let mut p = TokenRecycling::new(vocab, cfg(top_k)).unwrap();
            for _ in 0..next(3 * vocab as u64) {
                let t = next(vocab as u64 + 2) as u32;
                let ids: Vec<u32> = (0..next(10))
                    .map(|_| next(vocab as u64 + 3) as u32)
                    .collect();
                p.set_successors(t, &ids);
            }
            let (k, nodes, branch) = (next(9) as usize, next(40) as usize, 1 + next(9) as usize);
            let eos: Vec<u32> = (0..next(3)).map(|_| next(vocab as u64) as u32).collect();
            let ctx = [next(vocab as u64) as u32];
            let config = SamplingConfig::greedy();
            let req = ProposeRequest {
                max_nodes: nodes,
                max_branch: branch,
                eos: &eos,
                ..ProposeRequest::new(&ctx, &config, k)
            };
            let mut d = Draft::default();
            p.propose_tree(&req, &mut d).unwrap();
            let limits = TreeLimits {
                max_nodes: nodes.max(k.min(nodes)),
                max_depth: k,
                max_branch: if nodes <= k { usize::MAX } else { branch },
                ..TreeLimits::vocab(vocab)
            };
            d.block().validate(&limits).unwrap();
            assert!(d.len() <= nodes);
            let block = d.block();
            for i in 0..d.len() {
                let r = block.parent_row(i);
                let parent_tok = if r == 0 { ctx[0] } else { d.tokens[r - 1] };
                assert!(r == 0 || !eos.contains(&parent_tok));
                assert!(p.successors(parent_tok).contains(&d.tokens[i]));
            }
        }
    }

    #[test]
    fn duplicate_siblings_never_reach_the_draft() {
        let mut p = TokenRecycling::new(10, cfg(3)).unwrap();
        observe(&mut p, &[0], &[&[1, 2, 3]]);
        // Corrupt the row behind the update's back.
        p.table[1] = 1;
        p.template = TreeTemplate::from_widths(&[3]).unwrap();
        let d = tree(&mut p, &[0], 3, 16, &[]);
        assert_eq!(d.tokens, [1, 3]);
    }

    #[test]
    fn save_load_round_trip() {
        let mut p = TokenRecycling::new(50, cfg(4)).unwrap();
        observe(&mut p, &[0, 7, 49], &[&[1, 2, 3, 4], &[9], &[0, 49]]);
        let mut buf = Vec::new();
        p.write_to(&mut buf).unwrap();
        assert_eq!(buf.len(), 24 + p.table_bytes());
        let mut q = TokenRecycling::new(50, cfg(4)).unwrap();
        q.read_from(&mut &buf[..]).unwrap();
        assert_eq!(q.table, p.table);
        assert_eq!(q.filled_rows(), 3);
        assert_eq!(q.successors(49), &[0, 49]);
    }

    fn file_error(e: Error) -> TableFileError {
        match e {
            Error::Proposer(b) => *b.downcast::<TableFileError>().unwrap(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn corrupt_files_are_typed_errors_and_leave_the_table() {
        let mut p = TokenRecycling::new(50, cfg(4)).unwrap();
        observe(&mut p, &[0], &[&[1, 2]]);
        let mut good = Vec::new();
        p.write_to(&mut good).unwrap();
        let mut q = TokenRecycling::new(50, cfg(4)).unwrap();
        observe(&mut q, &[5], &[&[6]]);
        let before = q.table.clone();
        let mut check = |bytes: Vec<u8>, want: fn(&TableFileError) -> bool| {
            let e = file_error(q.read_from(&mut &bytes[..]).unwrap_err());
            assert!(want(&e), "{e:?}");
            assert_eq!(q.table, before);
            assert_eq!(q.filled_rows(), 1);
        };
        let mut b = good.clone();
        b[0] = b'X';
        check(b, |e| matches!(e, TableFileError::BadMagic));
        let mut b = good.clone();
        b[8] = 2;
        check(b, |e| matches!(e, TableFileError::UnsupportedVersion(2)));
        let mut b = good.clone();
        b[12] = 51;
        check(b, |e| {
            matches!(e, TableFileError::Mismatch { field: "vocab", .. })
        });
        let mut b = good.clone();
        b[20] = 8;
        check(b, |e| {
            matches!(e, TableFileError::Mismatch { field: "top_k", .. })
        });
        check(good[..good.len() - 1].to_vec(), |e| {
            matches!(e, TableFileError::Io(_))
        });
        check(good[..10].to_vec(), |e| matches!(e, TableFileError::Io(_)));
        // Entry 2 of row 0 (an empty slot) set to 50 (out of the vocabulary).
        let mut b = good.clone();
        b[24 + 8..24 + 12].copy_from_slice(&50u32.to_le_bytes());
        check(b, |e| {
            matches!(
                e,
                TableFileError::InvalidEntry {
                    row: 0,
                    slot: 2,
                    value: 50
                }
            )
        });
        // A repeated id, and an id after an empty entry.
        let mut b = good.clone();
        b[24 + 4..24 + 8].copy_from_slice(&1u32.to_le_bytes());
        check(b, |e| {
            matches!(
                e,
                TableFileError::InvalidEntry {
                    row: 0,
                    slot: 1,
                    ..
                }
            )
        });
        let mut b = good.clone();
        b[24 + 12..24 + 16].copy_from_slice(&3u32.to_le_bytes());
        check(b, |e| {
            matches!(
                e,
                TableFileError::InvalidEntry {
                    row: 0,
                    slot: 3,
                    ..
                }
            )
        });
        // Empty input.
        check(Vec::new(), |e| matches!(e, TableFileError::Io(_)));
    }

    #[test]
    fn load_takes_vocab_and_top_k_from_the_file() {
        let mut p = TokenRecycling::new(50, cfg(16)).unwrap();
        observe(&mut p, &[0, 7], &[&[1, 2, 3], &[9]]);
        let mut buf = Vec::new();
        p.write_to(&mut buf).unwrap();
        // `read_from` into the default top_k refuses the file...
        let mut d = TokenRecycling::new(50, RecyclingConfig::default()).unwrap();
        assert!(matches!(
            file_error(d.read_from(&mut &buf[..]).unwrap_err()),
            TableFileError::Mismatch { field: "top_k", .. }
        ));
        // ... `load` takes it as it is.
        let template = TreeTemplate::from_widths(&[2, 2]).unwrap();
        let q = TokenRecycling::load(&mut &buf[..], template.clone()).unwrap();
        assert_eq!((q.vocab_size(), q.top_k()), (50, 16));
        assert_eq!(q.table, p.table);
        assert_eq!(q.filled_rows(), 2);
        assert_eq!(q.template(), &template);
        assert_eq!(q.row_candidates(), 16);
        // Headers out of range, and a header promising more rows than the data holds.
        let load =
            |b: &[u8]| file_error(TokenRecycling::load(&mut &b[..], template.clone()).unwrap_err());
        for (at, bytes, field) in [
            (12, 0u64.to_le_bytes().to_vec(), "vocab"),
            (12, (u32::MAX as u64 + 1).to_le_bytes().to_vec(), "vocab"),
            (20, 0u32.to_le_bytes().to_vec(), "top_k"),
            (20, 65u32.to_le_bytes().to_vec(), "top_k"),
        ] {
            let mut b = buf.clone();
            b[at..at + bytes.len()].copy_from_slice(&bytes);
            assert!(
                matches!(load(&b), TableFileError::InvalidHeader { field: f, .. } if f == field),
                "{field}"
            );
        }
        let mut b = buf.clone();
        b[12..20].copy_from_slice(&(u32::MAX as u64).to_le_bytes());
        assert!(matches!(load(&b), TableFileError::Io(_)));
        // An entry out of the file's own vocabulary.
        let mut b = buf.clone();
        b[24 + 4 * 3..24 + 4 * 4].copy_from_slice(&50u32.to_le_bytes());
        assert!(matches!(
            load(&b),
            TableFileError::InvalidEntry {
                row: 0,
                slot: 3,
                value: 50
            }
        ));
    }
}
