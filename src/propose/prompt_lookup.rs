//! [`PromptLookup`]: prompt lookup decoding (Saxena 2023), the n-gram proposer.
//!
//! The proposer looks for the trailing n-gram of the context earlier in the context (prompt and
//! generated text) and proposes the tokens that followed its most recent earlier occurrence.
//! Inputs that copy from the prompt (summaries, code edits, retrieval answers) get long accepted
//! drafts at almost no cost.
//!
//! The index is a trie over reversed n-grams (depth `max_n`), kept in one hash map from
//! `(node, token)` to child node; every node remembers the most recent end position of its
//! n-gram, and every indexed end the previous end of each of its n-grams (the occurrence
//! lists that tree drafts walk). It is updated only for the tokens appended since the previous
//! call, so a proposal costs `O(max_n + max_draft)` hash look-ups and copies whatever the
//! context length.
//!
//! Tree drafts ([`Proposer::propose_tree`]) merge the continuations after several earlier
//! occurrences into a prefix tree; the rule is documented on [`PromptLookup`].
//!
//! The edge map, its hasher and the "does this context extend what was indexed" check come
//! from [`super::ngram`], shared with [`super::suffix`] and [`super::merged`].

use super::ngram::{EdgeMap, edge_key, extends, normalize_chain};
use super::{Draft, ProposeRequest, Proposer};
use crate::error::{Error, Result};

/// The longest draft periodic extension builds, in tokens, whatever `max_draft` asks for: it
/// bounds the allocation for direct callers that pass a huge `max_draft`.
pub const MAX_PERIODIC_DRAFT: usize = 4096;

/// Largest n-gram size [`PromptLookup::new`] accepts. The index holds up to `max_n` trie nodes
/// per context token, so the bound keeps memory linear with a small constant.
const MAX_NGRAM: usize = 64;

// ---------------------------------------------------------------------------------------------
// The n-gram index.
// ---------------------------------------------------------------------------------------------

/// Trie over reversed n-grams, each node tagged with the most recent end of its n-gram, and
/// for every indexed end the previous end of the same n-gram (one list of occurrences per
/// n-gram, newest first, for tree drafts).
///
/// Node 0 is the root. The node reached from the root by the edges `t_1, t_2, .., t_n` stands
/// for the n-gram `[t_n, .., t_2, t_1]` (read backwards from an end position). An "end" `e` is
/// the exclusive end of an occurrence: the n-gram occupies `seq[e - n .. e]`.
#[derive(Debug, Clone)]
struct NgramIndex {
    /// Copy of the sequence indexed so far (compared by [`extends`] on every call).
    seq: Vec<u32>,
    /// `(node, token) -> child`.
    edges: EdgeMap,
    /// `last_end[node]`: most recent indexed end of the node's n-gram.
    last_end: Vec<usize>,
    /// `prev[(e - 1) * max_n + n - 1]`: the end before `e` of the n-gram `seq[e - n .. e]`, or
    /// 0 when `e` is its first occurrence (or `n > e`). Walking it from `last_end[node]` lists
    /// every occurrence of the node's n-gram, newest first.
    prev: Vec<u32>,
    /// Largest n-gram size indexed (the stride of `prev`).
    max_n: usize,
    /// Ends `1 .. next_end` are indexed.
    next_end: usize,
}

impl NgramIndex {
    fn new(max_n: usize) -> Self {
        NgramIndex {
            seq: Vec::new(),
            edges: EdgeMap::default(),
            last_end: vec![0],
            prev: Vec::new(),
            max_n,
            next_end: 1,
        }
    }

    fn clear(&mut self) {
        self.seq.clear();
        self.edges.clear();
        self.last_end.clear();
        self.last_end.push(0);
        self.prev.clear();
        self.next_end = 1;
    }

    /// Brings the index up to date with `context`: appends and indexes the new tokens, or
    /// rebuilds from scratch when `context` does not extend the indexed sequence. Afterwards
    /// every end `1 ..= context.len() - 1` is indexed, so the trailing n-gram (end
    /// `context.len()`) is not yet in the index and every match is an earlier occurrence.
    fn sync(&mut self, context: &[u32]) -> Result<()> {
        if !extends(&self.seq, context) {
            self.clear();
        }
        if let Some(new) = context.get(self.seq.len()..) {
            self.seq.extend_from_slice(new);
        }
        while self.next_end < self.seq.len() {
            self.insert_end(self.next_end)?;
            self.next_end += 1;
        }
        Ok(())
    }

    /// Records end `e`: the n-grams `seq[e - n .. e]` for `n = 1 ..= min(max_n, e)`.
    fn insert_end(&mut self, e: usize) -> Result<()> {
        let max_n = self.max_n;
        // Ends are stored as `u32` in `prev`.
        if u32::try_from(e).is_err() {
            return Err(Error::proposer(
                "prompt lookup index exceeds 2^32 - 1 tokens",
            ));
        }
        // Entries of end `e` sit at `base ..` (a failed earlier insert may have left a partial
        // row behind: the row is rewritten from scratch).
        let base = (e - 1) * max_n;
        self.prev.truncate(base);
        self.prev.resize(base + max_n, 0);
        let mut node = 0u32;
        for n in 1..=max_n.min(e) {
            let token = self.seq[e - n];
            let next_id = self.last_end.len();
            let child = *self.edges.entry(edge_key(node, token)).or_insert_with(|| {
                // A failed conversion leaves `u32::MAX`, caught just below.
                u32::try_from(next_id).unwrap_or(u32::MAX)
            });
            if child == u32::MAX {
                self.edges.remove(&edge_key(node, token));
                return Err(Error::proposer(
                    "prompt lookup index exceeds 2^32 - 1 n-grams",
                ));
            }
            if child as usize == next_id {
                self.last_end.push(e);
            } else {
                // `last_end <= e - 1 < 2^32`, checked when it was recorded.
                self.prev[base + n - 1] = self.last_end[child as usize] as u32;
                self.last_end[child as usize] = e;
            }
            node = child;
        }
        Ok(())
    }

    /// The end of the most recent earlier occurrence of the longest trailing n-gram of `seq`
    /// with `min_n <= n <= max_n`, if any.
    fn lookup(&self, min_n: usize, max_n: usize) -> Option<usize> {
        let len = self.seq.len();
        let mut node = 0u32;
        let mut found = None;
        for n in 1..=max_n.min(len) {
            let token = self.seq[len - n];
            match self.edges.get(&edge_key(node, token)) {
                Some(&child) => node = child,
                None => break,
            }
            if n >= min_n {
                found = self.last_end.get(node as usize).copied();
            }
        }
        found
    }

    /// The trie nodes of the trailing n-grams of `seq` that occur earlier: `out[n - 1]` for
    /// `n = 1 ..= ` the longest such `n` (at most `max_n`); `out` is cleared first.
    fn trailing_nodes(&self, out: &mut Vec<u32>) {
        out.clear();
        let len = self.seq.len();
        let mut node = 0u32;
        for n in 1..=self.max_n.min(len) {
            match self.edges.get(&edge_key(node, self.seq[len - n])) {
                Some(&child) => node = child,
                None => break,
            }
            out.push(node);
        }
    }

    /// The end of the occurrence of the n-gram `seq[e - n .. e]` before end `e`, if any.
    #[inline]
    fn prev_end(&self, e: usize, n: usize) -> Option<usize> {
        let p = self.prev[(e - 1) * self.max_n + n - 1];
        (p != 0).then_some(p as usize)
    }
}

// ---------------------------------------------------------------------------------------------
// Tree drafts: the prefix trie of candidate continuations.
// ---------------------------------------------------------------------------------------------

/// Most occurrences (matches) whose continuations a tree draft considers, whatever the node
/// budget: it bounds the work of a call (`O(MAX_TREE_MATCHES * max_draft)`).
const MAX_TREE_MATCHES: usize = 256;

/// "The root" as the parent of a [`CandidateNode`].
const ROOT_PARENT: u32 = u32::MAX;

/// One node of the candidate trie: a distinct prefix of the candidate continuations.
#[derive(Debug, Clone, Copy)]
struct CandidateNode {
    token: u32,
    /// Parent node id, or [`ROOT_PARENT`].
    parent: u32,
    /// Number of candidates (matches) whose continuation starts with this node's prefix.
    support: u32,
    /// Rank of the first candidate that reached the node (0 is the chain).
    rank: u32,
    /// Depth, 1 for a child of the root.
    depth: u32,
}

/// The prefix trie of the candidate continuations of one tree draft, and the rule that picks
/// the nodes of the draft from it (see "Tree drafts" on [`PromptLookup`]).
#[derive(Debug, Clone, Default)]
struct CandidateTrie {
    nodes: Vec<CandidateNode>,
    /// `(parent id + 1, token) -> id`, the root being 0.
    edges: EdgeMap,
    /// Node ids outside the chain, in selection order.
    order: Vec<u32>,
    /// Draft node index of each candidate node (`u32::MAX` when not selected).
    out_index: Vec<u32>,
    /// Trailing n-gram nodes of the index (see `NgramIndex::trailing_nodes`).
    trail: Vec<u32>,
    /// One continuation.
    scratch: Vec<u32>,
}

impl CandidateTrie {
    fn clear(&mut self) {
        self.nodes.clear();
        self.edges.clear();
    }

    /// Adds the candidate continuation `tokens` of rank `rank`: one more support for each of
    /// its prefixes. The first call (rank 0) creates nodes `0 .. tokens.len()` in order.
    fn insert(&mut self, tokens: &[u32], rank: u32) {
        let mut parent = ROOT_PARENT;
        for (d, &token) in tokens.iter().enumerate() {
            let key = edge_key(parent.wrapping_add(1), token);
            let id = match self.edges.get(&key) {
                Some(&id) => {
                    self.nodes[id as usize].support += 1;
                    id
                }
                None => {
                    // Below `MAX_TREE_MATCHES * MAX_PERIODIC_DRAFT` nodes: fits in `u32`.
                    let id = self.nodes.len() as u32;
                    self.nodes.push(CandidateNode {
                        token,
                        parent,
                        support: 1,
                        rank,
                        depth: d as u32 + 1,
                    });
                    self.edges.insert(key, id);
                    id
                }
            };
            parent = id;
        }
    }

    /// Writes the draft: the chain (candidate nodes `0 .. chain_len`, already in
    /// `draft.tokens`) as nodes `0 .. chain_len`, then the other candidate nodes by decreasing
    /// support, then increasing depth, then increasing rank, up to `budget` nodes in all and
    /// `max_branch` children per node (a candidate whose parent has them all, or was left out,
    /// is skipped with its subtree). A
    /// parent always precedes its children in that order (its support is at least theirs; on
    /// a tie it is shallower), so the selected nodes form a tree in topological order. A
    /// result that is a single path is left as a chain (empty `parents`).
    fn write(&mut self, chain_len: usize, budget: usize, max_branch: usize, draft: &mut Draft) {
        let nodes = &self.nodes;
        self.order.clear();
        self.order.extend(chain_len as u32..nodes.len() as u32);
        self.order.sort_unstable_by_key(|&id| {
            let c = &nodes[id as usize];
            (std::cmp::Reverse(c.support), c.depth, c.rank, id)
        });
        if self.order.is_empty() || budget <= chain_len || max_branch <= 1 {
            return;
        }
        self.out_index.clear();
        self.out_index.resize(nodes.len(), u32::MAX);
        // Children per output row (row 0 = the root): the chain gives each of its rows one.
        let mut children = vec![0usize; budget + 1];
        draft.parents.clear();
        for (i, c) in children.iter_mut().enumerate().take(chain_len) {
            self.out_index[i] = i as u32;
            draft.parents.push(i as u32);
            *c = 1;
        }
        for &id in &self.order {
            if draft.tokens.len() == budget {
                break;
            }
            let c = &nodes[id as usize];
            let row = if c.parent == ROOT_PARENT {
                0
            } else {
                match self.out_index[c.parent as usize] {
                    // The parent was left out (the branching limit): so is its subtree.
                    u32::MAX => continue,
                    r => r as usize + 1,
                }
            };
            if children[row] >= max_branch {
                continue;
            }
            children[row] += 1;
            self.out_index[id as usize] = draft.tokens.len() as u32;
            draft.tokens.push(c.token);
            draft.parents.push(row as u32);
        }
        normalize_chain(draft);
    }
}

// ---------------------------------------------------------------------------------------------
// The proposer.
// ---------------------------------------------------------------------------------------------

/// The settings of a [`PromptLookup`]: the n-gram range and periodic extension, as plain data
/// (with the `serde` feature it loads from vLLM's `speculative_config` names
/// `prompt_lookup_min` / `prompt_lookup_max`; see the `config` module).
///
/// | field | default | valid range |
/// |---|---|---|
/// | `min_n` | 1 | `>= 1` |
/// | `max_n` | 4 | `min_n ..= 64` |
/// | `periodic` | `false` | any ([`PromptLookup::periodic_extension`]) |
///
/// `#[non_exhaustive]`: build it from [`PromptLookupConfig::default`] and the `with_` setters.
///
/// # Example
/// ```
/// use speculative::propose::{PromptLookup, PromptLookupConfig};
///
/// let cfg = PromptLookupConfig::default().with_min_n(2).with_max_n(5);
/// let lookup = PromptLookup::from_config(cfg)?;
/// assert_eq!((lookup.min_n(), lookup.max_n()), (2, 5));
/// assert_eq!(lookup.config(), cfg);
/// # Ok::<(), speculative::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(remote = "Self", default, deny_unknown_fields)
)]
#[non_exhaustive]
pub struct PromptLookupConfig {
    /// Smallest n-gram size matched, in tokens.
    #[cfg_attr(feature = "serde", serde(rename = "prompt_lookup_min"))]
    pub min_n: usize,
    /// Largest n-gram size matched, in tokens.
    #[cfg_attr(feature = "serde", serde(rename = "prompt_lookup_max"))]
    pub max_n: usize,
    /// Periodic extension on (see [`PromptLookup::periodic_extension`]).
    pub periodic: bool,
}

impl PromptLookupConfig {
    /// Sets [`PromptLookupConfig::min_n`] (checked by [`PromptLookupConfig::validate`]).
    pub fn with_min_n(mut self, min_n: usize) -> Self {
        self.min_n = min_n;
        self
    }

    /// Sets [`PromptLookupConfig::max_n`] (checked by [`PromptLookupConfig::validate`]).
    pub fn with_max_n(mut self, max_n: usize) -> Self {
        self.max_n = max_n;
        self
    }

    /// Sets [`PromptLookupConfig::periodic`] (checked by [`PromptLookupConfig::validate`]).
    pub fn with_periodic(mut self, periodic: bool) -> Self {
        self.periodic = periodic;
        self
    }
}

impl Default for PromptLookupConfig {
    /// `min_n = 1`, `max_n = 4`, periodic extension off.
    fn default() -> Self {
        PromptLookupConfig {
            min_n: 1,
            max_n: 4,
            periodic: false,
        }
    }
}

impl PromptLookupConfig {
    /// Checks the ranges in the table of [`PromptLookupConfig`]. `O(1)`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `min_n` when it is 0, or `max_n` when it is below
    /// `min_n` or above 64.
    pub fn validate(&self) -> Result<()> {
        if self.min_n == 0 {
            return Err(Error::config("min_n", self.min_n, "must be at least 1"));
        }
        if self.max_n < self.min_n {
            return Err(Error::config("max_n", self.max_n, "must be at least min_n"));
        }
        if self.max_n > MAX_NGRAM {
            return Err(Error::config(
                "max_n",
                self.max_n,
                "must be at most 64 (MAX_NGRAM)",
            ));
        }
        Ok(())
    }
}

/// Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; the n-gram proposer of vLLM
/// and of Hugging Face's `prompt_lookup_num_tokens`).
///
/// At each step the proposer takes the trailing n-gram of the context for `n = max_n` down to
/// `min_n`, finds the largest `n` whose n-gram also occurs earlier in the context (prompt and
/// generated text; occurrences may overlap the trailing one but never are it), and proposes up
/// to `max_draft` tokens that followed the **most recent** such occurrence. If that continuation
/// reaches the end of the context the proposal is shorter (unless
/// [`PromptLookup::periodic_extension`] is on). No match gives an empty draft, as does an empty
/// context or one shorter than `min_n + 1`. The draft ends right after its first EOS id
/// ([`ProposeRequest::eos`]), if it holds one.
///
/// The proposer is deterministic: [`Draft::q`] is `None` (a point mass on each draft token).
///
/// # Tree drafts
///
/// [`Proposer::propose_tree`] drafts the continuations after several earlier occurrences of
/// the trailing n-gram at once, merged into a prefix tree: the candidate sequences of one step
/// share a single verify forward as a token tree (SpecInfer, Miao et al., ASPLOS 2024), and
/// candidates retrieved from text are merged into a trie whose prefixes are ranked by how
/// many candidates share them (REST, He et al., NAACL 2024; SuffixDecoding, Oliaro et al.,
/// arXiv 2411.04975, scores by the same empirical frequencies). The rule, for a request with
/// `max_draft = k` and `max_nodes = N`:
///
/// 1. `N <= k`: the chain that [`Proposer::propose`] returns for `max_draft = N` (a deeper
///    chain is worth more than alternatives at the same budget).
/// 2. Candidates: the earlier occurrences of the trailing n-gram for `n` from the longest
///    matched down to `min_n`; within one `n` the newest first, and an occurrence that also
///    matches the `(n + 1)`-gram is taken only once, in the longer list. At most
///    `min(N, MAX_TREE_MATCHES)` (256) occurrences. Each gives its continuation exactly as the
///    chain does (at most `k` tokens, cycled with periodic extension, cut after its first EOS),
///    and the first one is the chain of `propose`.
/// 3. The continuations are merged into a prefix trie; the **support** of a prefix is the
///    number of candidates that start with it (how often the text went on that way after the
///    n-gram).
/// 4. Nodes: the chain first, whole, as nodes `0 .. L` (node `i` the child of node `i - 1`);
///    then the other prefixes by decreasing support, then increasing depth (breadth first among
///    equally supported prefixes), then the newer candidate first, until `N` nodes. A parent
///    sorts before its children (its support is at least theirs and it is shallower), so the
///    nodes come in topological order and every selected node's parent is selected. With a
///    branching limit ([`ProposeRequest::max_branch`]) a prefix whose parent already has that
///    many children is skipped, with everything below it.
///
/// So the tree holds the chain as a path: under greedy verification it never accepts less than
/// the chain at the same step when `N > k`. Siblings are distinct tokens (a prefix tree), nodes
/// are point masses ([`crate::tree::SiblingScheme::Deterministic`], [`Draft::schemes`] empty),
/// no branch goes past its first EOS, and the depth is at most `k`. A tree that is a single
/// path (one distinct continuation) is returned as a chain (empty [`Draft::parents`]), equal to
/// `propose`'s draft. On the project's workloads breadth first on ties gave slightly longer
/// accepted lengths than taking each candidate whole in rank order (`spec-bench replay
/// --nodes`; docs/benchmarks.md, "Tree replay").
///
/// # State across requests
///
/// The index belongs to one context. Every call checks exactly that `req.context` starts with
/// the whole indexed sequence (a `memcmp`); when it does not (another request, a context that
/// shrank or changed anywhere), the index is rebuilt from `req.context`, as
/// [`Proposer::begin`] would. So the drafts never depend on an earlier request, with or without
/// `begin`: they equal a fresh proposer's drafts on the same context.
///
/// `PromptLookup` is `Send + Sync`; it holds one request's index, so use one per sequence.
///
/// # Complexity
///
/// The index is updated incrementally: a call whose context extends the previous one by `a`
/// tokens costs `O(a * max_n + max_n + max_draft)` expected time (hash look-ups) plus the
/// `O(L)` comparison above (a `memcmp` of `4 L` bytes, a few microseconds at `L = 32,000`). A
/// context that does not extend the indexed one is indexed from scratch in `O(L * max_n)`.
/// Memory: a copy of the context plus at most `max_n` trie nodes per token (about 30 bytes
/// each) and the occurrence lists (`4 * max_n` bytes per token), so `O(L * max_n)`.
///
/// A tree draft costs the chain's proposal plus `O(M * k)` hash operations for its `M <=
/// min(max_nodes, 256)` candidates and a sort of at most `M * k` candidate prefixes, whatever the
/// context length.
///
/// # Example
///
/// ```
/// use speculative::propose::{Draft, PromptLookup, ProposeRequest, Proposer};
/// use speculative::SamplingConfig;
///
/// let mut lookup = PromptLookup::new(1, 2)?;
/// let config = SamplingConfig::greedy();
/// let context = [5, 6, 7, 8, 9, 10, 11, 7, 8];
/// let req = ProposeRequest::new(&context, &config, 3);
/// let mut draft = Draft::default();
/// lookup.propose(&req, &mut draft)?;
/// assert_eq!(draft.tokens, [9, 10, 11]); // what followed the earlier [7, 8]
/// # Ok::<(), speculative::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PromptLookup {
    min_n: usize,
    max_n: usize,
    periodic: bool,
    index: NgramIndex,
    /// Scratch of [`Proposer::propose_tree`].
    tree: CandidateTrie,
}

impl PromptLookup {
    /// A proposer matching trailing n-grams of `min_n ..= max_n` tokens (longest first).
    ///
    /// Typical settings: `(1, 3)` or `(2, 5)`. Larger `min_n` gives fewer but more reliable
    /// drafts.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `min_n == 0`, `max_n < min_n`, or `max_n > 64`.
    pub fn new(min_n: usize, max_n: usize) -> Result<Self> {
        Self::from_config(PromptLookupConfig {
            min_n,
            max_n,
            periodic: false,
        })
    }

    /// A proposer with the settings of `cfg` (n-gram range and periodic extension).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] as [`PromptLookupConfig::validate`].
    pub fn from_config(cfg: PromptLookupConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(PromptLookup {
            min_n: cfg.min_n,
            max_n: cfg.max_n,
            periodic: cfg.periodic,
            index: NgramIndex::new(cfg.max_n),
            tree: CandidateTrie::default(),
        })
    }

    /// The settings of this proposer. `O(1)`.
    pub fn config(&self) -> PromptLookupConfig {
        PromptLookupConfig {
            min_n: self.min_n,
            max_n: self.max_n,
            periodic: self.periodic,
        }
    }

    /// Turns periodic extension on or off (off by default).
    ///
    /// When the continuation of the match runs into the end of the context after `r` tokens
    /// (the match ends `r` tokens before the end), the context ends in a repeat with period `r`.
    /// With the extension on, the draft continues that period up to `max_draft` tokens; this is
    /// what re-running the lookup on the context extended by its own draft gives when
    /// `n <= r`. It helps on degenerate repetition ("1, 1, 1, ..."); off, such a match proposes
    /// only the `r` available tokens.
    ///
    /// `O(1)`; never fails.
    #[must_use]
    pub fn periodic_extension(mut self, on: bool) -> Self {
        self.periodic = on;
        self
    }

    /// Smallest n-gram size matched, in tokens. `O(1)`.
    pub fn min_n(&self) -> usize {
        self.min_n
    }

    /// Largest n-gram size matched, in tokens. `O(1)`.
    pub fn max_n(&self) -> usize {
        self.max_n
    }

    /// Whether periodic extension is on (see [`PromptLookup::periodic_extension`]). `O(1)`.
    pub fn is_periodic(&self) -> bool {
        self.periodic
    }

    /// Number of context tokens currently indexed. `O(1)`.
    pub fn indexed_len(&self) -> usize {
        self.index.seq.len()
    }

    /// Forgets the indexed context (keeping allocations). The next call indexes from scratch.
    /// `O(number of index entries)`.
    pub fn reset(&mut self) {
        self.index.clear();
    }

    /// Writes to `out` (cleared first) the draft that follows the occurrence ending at `end`:
    /// at most `max_draft` tokens of `seq[end..]` (cycled when periodic extension is on), cut
    /// after the first EOS of `req`.
    fn continuation(&self, end: usize, req: &ProposeRequest<'_>, out: &mut Vec<u32>) {
        out.clear();
        let Some(cont) = self.index.seq.get(end..).filter(|c| !c.is_empty()) else {
            return;
        };
        if self.periodic {
            // Bounded whatever `max_draft` says (returning fewer tokens is always allowed).
            let take = req.max_draft.min(MAX_PERIODIC_DRAFT);
            out.extend(cont.iter().cycle().take(take));
        } else {
            out.extend_from_slice(&cont[..req.max_draft.min(cont.len())]);
        }
        // A draft ends at its first EOS.
        let keep = req.draft_len_to_eos(out);
        out.truncate(keep);
    }
}

impl Proposer for PromptLookup {
    /// `true`: drafts from the context's tokens alone.
    fn drafts_from_tokens(&self) -> bool {
        true
    }

    /// Proposes up to `req.max_draft` tokens that followed the most recent earlier occurrence of
    /// the longest matching trailing n-gram of `req.context`, cut after the first EOS; see
    /// [`PromptLookup`]. Rebuilds the index when `req.context` does not extend the indexed
    /// sequence (see "State across requests" there).
    ///
    /// # Errors
    /// [`Error::Proposer`] only if the index would exceed `2^32 - 1` n-grams (a context of
    /// hundreds of millions of tokens); the draft is then empty.
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        self.index.sync(req.context)?;
        if req.max_draft == 0 {
            return Ok(());
        }
        let Some(end) = self.index.lookup(self.min_n, self.max_n) else {
            return Ok(());
        };
        let mut tokens = std::mem::take(&mut draft.tokens);
        self.continuation(end, req, &mut tokens);
        draft.tokens = tokens;
        Ok(())
    }

    /// A prefix tree of the continuations after several earlier occurrences of the trailing
    /// n-gram, of at most `req.max_nodes` nodes and depth at most `req.max_draft`, by the rule
    /// in "Tree drafts" on [`PromptLookup`]. With `req.max_nodes <= req.max_draft` it returns
    /// exactly the chain [`Proposer::propose`] returns for `max_draft = max_nodes`, and a
    /// tree that holds a single path is returned as that chain (empty [`Draft::parents`]).
    /// Rebuilds the index as `propose` does.
    ///
    /// # Errors
    /// As [`PromptLookup::propose`](Proposer::propose).
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        // The chain first: it is the continuation of the first match in the order below. An
        // empty chain means no occurrence of any trailing n-gram: no candidate.
        if !super::tree_starts_with_chain(self, req, draft)? {
            return Ok(());
        }
        let mut tree = std::mem::take(&mut self.tree);
        tree.clear();
        tree.insert(&draft.tokens, 0);
        let max_matches = req.max_nodes.min(MAX_TREE_MATCHES);
        self.index.trailing_nodes(&mut tree.trail);
        let longest = tree.trail.len();
        let len = self.index.seq.len();
        let mut rank = 1u32;
        let mut cont = std::mem::take(&mut tree.scratch);
        'lists: for n in (self.min_n..=longest).rev() {
            let mut end = Some(self.index.last_end[tree.trail[n - 1] as usize]);
            if n == longest {
                // The newest occurrence of the longest n-gram is the chain's, inserted above.
                end = end.and_then(|e| self.index.prev_end(e, n));
            }
            while let Some(e) = end {
                if rank as usize >= max_matches {
                    break 'lists;
                }
                // An occurrence of the (n + 1)-gram as well was visited in that longer list.
                let longer = n < longest
                    && e > n
                    && self.index.seq[e - n - 1] == self.index.seq[len - n - 1];
                if !longer {
                    self.continuation(e, req, &mut cont);
                    tree.insert(&cont, rank);
                    rank += 1;
                }
                end = self.index.prev_end(e, n);
            }
        }
        tree.scratch = cont;
        tree.write(draft.tokens.len(), req.max_nodes, req.max_branch, draft);
        self.tree = tree;
        Ok(())
    }

    /// `"prompt-lookup"`.
    fn name(&self) -> &'static str {
        "prompt-lookup"
    }

    /// Indexes the prompt ahead of the first proposal (replacing any earlier index).
    ///
    /// # Errors
    /// As [`PromptLookup::propose`](Proposer::propose).
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.index.clear();
        self.index.sync(prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingConfig;
    use proptest::prelude::*;

    fn propose(p: &mut PromptLookup, context: &[u32], k: usize) -> Vec<u32> {
        let config = SamplingConfig::greedy();
        let req = ProposeRequest {
            context,
            config: &config,
            max_draft: k,
            max_nodes: k,
            max_branch: usize::MAX,
            seed: 0,
            target_hidden: None,
            target_hidden_rows: None,
            prompt_len: 0,
            eos: &[],
            suppress: &[],
            suppress_rows: 0,
            fused_prompt: 0,
        };
        let mut draft = Draft {
            tokens: vec![99; 7],
            q: Some(vec![1.0]),
            q_vocab: 1,
            ..Default::default()
        };
        p.propose(&req, &mut draft).unwrap();
        assert!(draft.q.is_none());
        assert!(draft.tokens.len() <= k);
        draft.tokens
    }

    /// Straightforward rescan, the specification the index must match.
    fn reference(
        context: &[u32],
        min_n: usize,
        max_n: usize,
        k: usize,
        periodic: bool,
    ) -> Vec<u32> {
        let len = context.len();
        for n in (min_n..=max_n).rev() {
            if n > len {
                continue;
            }
            let tail = &context[len - n..];
            for end in (n..len).rev() {
                if &context[end - n..end] == tail {
                    let cont = &context[end..];
                    return if periodic {
                        cont.iter().cycle().take(k).copied().collect()
                    } else {
                        cont[..k.min(cont.len())].to_vec()
                    };
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn c04_match_proposes_what_followed() {
        let mut p = PromptLookup::new(1, 2).unwrap();
        assert_eq!(
            propose(&mut p, &[5, 6, 7, 8, 9, 10, 11, 7, 8], 3),
            [9, 10, 11]
        );
        // With n fixed at 2 as well.
        let mut p = PromptLookup::new(2, 2).unwrap();
        assert_eq!(
            propose(&mut p, &[5, 6, 7, 8, 9, 10, 11, 7, 8], 3),
            [9, 10, 11]
        );
    }

    #[test]
    fn c04_empty_context_gives_empty_draft() {
        let mut p = PromptLookup::new(1, 3).unwrap();
        assert!(propose(&mut p, &[], 4).is_empty());
    }

    #[test]
    fn c04_short_continuation_gives_shorter_draft() {
        let mut p = PromptLookup::new(1, 2).unwrap();
        // The trailing [9, 8] was seen ending at 2: only the 3 tokens after it exist.
        assert_eq!(propose(&mut p, &[9, 8, 4, 9, 8], 5), [4, 9, 8]);
        // Continuation of one token: [3, 3, 3] -> trailing [3, 3] was last seen ending at 2.
        assert_eq!(propose(&mut p, &[3, 3, 3], 4), [3]);
    }

    #[test]
    fn c04_min_n_larger_than_context_gives_empty_draft() {
        let mut p = PromptLookup::new(4, 6).unwrap();
        assert!(propose(&mut p, &[1, 2, 1], 3).is_empty());
        assert!(propose(&mut p, &[1, 2, 1, 2], 3).is_empty());
    }

    #[test]
    fn c04_no_match_gives_empty_draft() {
        let mut p = PromptLookup::new(1, 3).unwrap();
        assert!(propose(&mut p, &[1, 2, 3, 4], 3).is_empty());
        assert!(propose(&mut p, &[1], 3).is_empty());
    }

    #[test]
    fn most_recent_occurrence_wins() {
        let mut p = PromptLookup::new(1, 1).unwrap();
        // 1 was followed by 2, later by 3: the later one wins.
        assert_eq!(propose(&mut p, &[1, 2, 0, 1, 3, 0, 1], 1), [3]);
    }

    #[test]
    fn longest_ngram_wins() {
        let mut p = PromptLookup::new(1, 2).unwrap();
        // Unigram 2 was last followed by 9; bigram [1, 2] by 5.
        assert_eq!(propose(&mut p, &[1, 2, 5, 6, 2, 9, 1, 2], 2), [5, 6]);
    }

    #[test]
    fn max_draft_zero_gives_empty() {
        let mut p = PromptLookup::new(1, 2).unwrap();
        assert!(propose(&mut p, &[5, 6, 7, 8, 9, 10, 11, 7, 8], 0).is_empty());
        // The index still followed the context.
        assert_eq!(p.indexed_len(), 9);
    }

    #[test]
    fn periodic_extension_repeats_the_period() {
        let mut p = PromptLookup::new(1, 2).unwrap().periodic_extension(true);
        assert!(p.is_periodic());
        assert_eq!(propose(&mut p, &[3, 3, 3], 4), [3, 3, 3, 3]);
        assert_eq!(propose(&mut p, &[1, 2, 3, 1, 2], 5), [3, 1, 2, 3, 1]);
        // A long continuation is not affected.
        assert_eq!(
            propose(&mut p, &[5, 6, 7, 8, 9, 10, 11, 7, 8], 3),
            [9, 10, 11]
        );
    }

    #[test]
    fn constructor_validates() {
        assert!(matches!(
            PromptLookup::new(0, 3),
            Err(Error::InvalidConfig { field: "min_n", .. })
        ));
        assert!(matches!(
            PromptLookup::new(3, 2),
            Err(Error::InvalidConfig { field: "max_n", .. })
        ));
        assert!(matches!(
            PromptLookup::new(1, MAX_NGRAM + 1),
            Err(Error::InvalidConfig { field: "max_n", .. })
        ));
        let p = PromptLookup::new(2, 2).unwrap();
        assert_eq!((p.min_n(), p.max_n(), p.is_periodic()), (2, 2, false));
    }

    #[test]
    fn unrelated_context_rebuilds_the_index() {
        let mut p = PromptLookup::new(1, 2).unwrap();
        assert_eq!(propose(&mut p, &[1, 2, 3, 1], 2), [2, 3]);
        // Same length, different content.
        assert_eq!(propose(&mut p, &[4, 5, 6, 4], 2), [5, 6]);
        // Shorter.
        assert_eq!(propose(&mut p, &[7, 8, 7], 2), [8, 7]);
        // Longer, but a different prefix (the first token differs).
        let mut long: Vec<u32> = (0..200).collect();
        long.push(150);
        assert_eq!(propose(&mut p, &long, 2), [151, 152]);
        long[0] = 1000;
        long.push(151);
        assert_eq!(propose(&mut p, &long, 2), [152, 153]);
        // begin() announces a new sequence explicitly.
        p.begin(&[9, 9]).unwrap();
        assert_eq!(p.indexed_len(), 2);
        assert_eq!(propose(&mut p, &[9, 9, 1, 9], 3), [1, 9]);
        p.reset();
        assert_eq!(p.indexed_len(), 0);
    }

    #[test]
    fn long_context_incremental_steps_match_reference() {
        let mut p = PromptLookup::new(2, 4).unwrap();
        let mut x = 12345u64;
        let mut seq: Vec<u32> = Vec::new();
        for i in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let t = if i > 100 && x % 6 < 2 {
                seq[i - 97]
            } else {
                (x % 50) as u32
            };
            seq.push(t);
            if i % 37 == 0 {
                let got = propose(&mut p, &seq, 6);
                assert_eq!(
                    got,
                    reference(&seq, 2, 4, 6, false),
                    "at length {}",
                    seq.len()
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The incremental index after several extensions proposes what a fresh index on the
        /// whole context proposes, and both equal the rescan.
        #[test]
        fn incremental_equals_rebuild(
            seq in proptest::collection::vec(0u32..4, 0..80),
            cuts in proptest::collection::vec(0usize..80, 0..6),
            min_n in 1usize..4,
            extra in 0usize..3,
            k in 0usize..8,
            periodic in any::<bool>(),
        ) {
            let max_n = min_n + extra;
            let mut inc = PromptLookup::new(min_n, max_n).unwrap().periodic_extension(periodic);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(seq.len())).collect();
            cuts.sort_unstable();
            for &c in &cuts {
                let got = propose(&mut inc, &seq[..c], k);
                prop_assert_eq!(got, reference(&seq[..c], min_n, max_n, k, periodic));
            }
            let got = propose(&mut inc, &seq, k);
            let mut fresh = PromptLookup::new(min_n, max_n).unwrap().periodic_extension(periodic);
            prop_assert_eq!(&got, &propose(&mut fresh, &seq, k));
            prop_assert_eq!(got, reference(&seq, min_n, max_n, k, periodic));
        }

        /// Arbitrary switches between unrelated contexts never panic and stay exact.
        #[test]
        fn switching_contexts_stays_exact(
            seqs in proptest::collection::vec(proptest::collection::vec(0u32..3, 0..40), 1..6),
            k in 0usize..5,
        ) {
            let mut p = PromptLookup::new(1, 3).unwrap();
            for s in &seqs {
                prop_assert_eq!(propose(&mut p, s, k), reference(s, 1, 3, k, false));
            }
        }
    }

    fn propose_eos(p: &mut PromptLookup, context: &[u32], k: usize, eos: &[u32]) -> Vec<u32> {
        let config = SamplingConfig::greedy();
        let req = ProposeRequest {
            eos,
            ..ProposeRequest::new(context, &config, k)
        };
        let mut draft = Draft::default();
        p.propose(&req, &mut draft).unwrap();
        draft.tokens
    }

    #[test]
    fn draft_ends_at_the_first_eos() {
        let ctx = [5, 6, 7, 2, 9, 10, 3, 11, 5, 6];
        let mut p = PromptLookup::new(1, 2).unwrap();
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[]), [7, 2, 9, 10, 3, 11]);
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[2]), [7, 2]);
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[3, 2]), [7, 2]);
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[3]), [7, 2, 9, 10, 3]);
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[7]), [7]);
        // Periodic extension: the cycle is cut at the EOS too.
        let mut p = PromptLookup::new(1, 2).unwrap().periodic_extension(true);
        assert_eq!(
            propose_eos(&mut p, &[1, 4, 8, 1, 4], 6, &[]),
            [8, 1, 4, 8, 1, 4]
        );
        assert_eq!(propose_eos(&mut p, &[1, 4, 8, 1, 4], 6, &[4]), [8, 1, 4]);
    }

    /// Two requests of 400 tokens that differ only at positions 303..308: the same length,
    /// first token, last 16 tokens and tokens at distances 32, 64, 128, 256 from the end, so a
    /// check that samples those positions takes B for a continuation of A.
    fn look_alike_requests() -> (Vec<u32>, Vec<u32>) {
        let mut a: Vec<u32> = (100..500).collect();
        a[397..400].copy_from_slice(&[7, 8, 9]);
        a[300..303].copy_from_slice(&[7, 8, 9]);
        a[303..308].copy_from_slice(&[50, 51, 52, 53, 54]);
        let mut b = a.clone();
        b[303..308].copy_from_slice(&[60, 61, 62, 63, 64]);
        (a, b)
    }

    #[test]
    fn stale_state_unrelated_request_equals_a_fresh_proposer() {
        let (a, b) = look_alike_requests();
        for (min_n, max_n) in [(1, 3), (2, 4), (3, 3)] {
            let mut p = PromptLookup::new(min_n, max_n).unwrap();
            assert_eq!(propose(&mut p, &a, 5), [50, 51, 52, 53, 54]);
            // Directly on B, without begin.
            let got = propose(&mut p, &b, 5);
            let mut fresh = PromptLookup::new(min_n, max_n).unwrap();
            assert_eq!(got, propose(&mut fresh, &b, 5));
            assert_eq!(got, [60, 61, 62, 63, 64]);
            // And back to A.
            assert_eq!(propose(&mut p, &a, 5), [50, 51, 52, 53, 54]);
        }
    }

    #[test]
    fn stale_state_context_that_shrinks_or_diverges() {
        let mut x = 7u64;
        let seq: Vec<u32> = (0..300)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 6) as u32
            })
            .collect();
        let mut p = PromptLookup::new(1, 3).unwrap();
        propose(&mut p, &seq, 4);
        // Shrinks: a prefix of what was indexed.
        for cut in [299, 150, 2, 0] {
            let got = propose(&mut p, &seq[..cut], 4);
            assert_eq!(got, reference(&seq[..cut], 1, 3, 4, false), "cut {cut}");
            propose(&mut p, &seq, 4);
        }
        // Diverges mid-way, then grows past the old length.
        for at in [0, 1, 77, 150, 298] {
            let mut other = seq.clone();
            other[at] = (other[at] + 1) % 6;
            other.extend_from_slice(&seq[..20]);
            propose(&mut p, &seq, 4);
            let got = propose(&mut p, &other, 4);
            assert_eq!(got, reference(&other, 1, 3, 4, false), "diverge at {at}");
            assert_eq!(p.indexed_len(), other.len());
        }
    }

    // -----------------------------------------------------------------------------------------
    // Tree drafts.
    // -----------------------------------------------------------------------------------------

    fn propose_tree(
        p: &mut PromptLookup,
        context: &[u32],
        k: usize,
        nodes: usize,
        eos: &[u32],
    ) -> Draft {
        let config = SamplingConfig::greedy();
        let req = ProposeRequest {
            max_nodes: nodes,
            eos,
            ..ProposeRequest::new(context, &config, k)
        };
        let mut draft = Draft {
            tokens: vec![99; 7],
            parents: vec![0; 3],
            ..Default::default()
        };
        p.propose_tree(&req, &mut draft).unwrap();
        draft
    }

    /// Brute-force specification of the tree rule: occurrences found by scanning the context,
    /// in the documented order (longest n first, newest first, each occurrence once, at most
    /// `min(nodes, MAX_TREE_MATCHES)`), their continuations merged into a prefix trie, the
    /// first (the chain) kept whole, the other prefixes by (support desc, depth, rank).
    fn reference_tree(
        context: &[u32],
        min_n: usize,
        max_n: usize,
        k: usize,
        nodes: usize,
        periodic: bool,
        eos: &[u32],
    ) -> (Vec<u32>, Vec<u32>) {
        let chain_k = if nodes <= k { nodes } else { k };
        let cut = |mut v: Vec<u32>| {
            if let Some(i) = v.iter().position(|t| eos.contains(t)) {
                v.truncate(i + 1);
            }
            v
        };
        let cont = |e: usize| -> Vec<u32> {
            let c = &context[e..];
            cut(if periodic {
                c.iter().cycle().take(chain_k).copied().collect()
            } else {
                c[..chain_k.min(c.len())].to_vec()
            })
        };
        let len = context.len();
        let matches_n = |e: usize, n: usize| e >= n && context[e - n..e] == context[len - n..];
        let longest = (1..=max_n.min(len))
            .take_while(|&n| (n..len).any(|e| matches_n(e, n)))
            .last()
            .unwrap_or(0);
        if longest < min_n || chain_k == 0 {
            return (Vec::new(), Vec::new());
        }
        let mut ends = Vec::new();
        for n in (min_n..=longest).rev() {
            for e in (n..len).rev() {
                if matches_n(e, n) && !(n < longest && matches_n(e, n + 1)) {
                    ends.push(e);
                }
            }
        }
        let chain = cont(ends[0]);
        if nodes <= k {
            return (chain, Vec::new());
        }
        ends.truncate(nodes.min(MAX_TREE_MATCHES));
        // Distinct prefixes: (prefix, support, first rank).
        let mut prefixes: Vec<(Vec<u32>, u32, usize)> = Vec::new();
        for (rank, &e) in ends.iter().enumerate() {
            let c = cont(e);
            for d in 1..=c.len() {
                match prefixes.iter_mut().find(|p| p.0 == c[..d]) {
                    Some(p) => p.1 += 1,
                    None => prefixes.push((c[..d].to_vec(), 1, rank)),
                }
            }
        }
        let mut rest: Vec<&(Vec<u32>, u32, usize)> = prefixes
            .iter()
            .filter(|p| !chain.starts_with(&p.0))
            .collect();
        rest.sort_by_key(|p| (std::cmp::Reverse(p.1), p.0.len(), p.2));
        rest.truncate(nodes - chain.len());
        let mut paths: Vec<Vec<u32>> = (1..=chain.len()).map(|d| chain[..d].to_vec()).collect();
        let mut tokens = chain.clone();
        let mut parents: Vec<u32> = (0..chain.len() as u32).collect();
        for p in rest {
            let (head, last) = p.0.split_at(p.0.len() - 1);
            let row = if head.is_empty() {
                0
            } else {
                1 + paths.iter().position(|q| q == head).unwrap() as u32
            };
            paths.push(p.0.clone());
            tokens.push(last[0]);
            parents.push(row);
        }
        if parents.iter().enumerate().all(|(i, &r)| r as usize == i) {
            parents.clear();
        }
        (tokens, parents)
    }

    #[test]
    fn tree_merges_shared_prefixes() {
        // After [1, 2]: "3 4 9" (oldest), "3 5 9", then "6 9" (newest, the chain).
        let ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 6, 9, 1, 2];
        let mut p = PromptLookup::new(2, 2).unwrap();
        let d = propose_tree(&mut p, &ctx, 3, 8, &[]);
        // Chain 6 9 1 first; then "3" (support 2), then depth 2: "3 5" (rank 1), "3 4" (rank 2),
        // then depth 3: "3 5 9", "3 4 9" (one node of the budget of 8 is left for them).
        assert_eq!(d.tokens, [6, 9, 1, 3, 5, 4, 9, 9]);
        assert_eq!(d.parents, [0, 1, 2, 0, 4, 4, 5, 6]);
        assert_eq!(
            (d.tokens.clone(), d.parents.clone()),
            reference_tree(&ctx, 2, 2, 3, 8, false, &[])
        );
        let lim = crate::tree::TreeLimits {
            max_nodes: 8,
            max_depth: 3,
            ..crate::tree::TreeLimits::vocab(10)
        };
        assert_eq!(d.block().validate(&lim), Ok(()));
        // A budget of 6: the two depth-3 nodes do not fit.
        let d = propose_tree(&mut p, &ctx, 3, 6, &[]);
        assert_eq!(d.tokens, [6, 9, 1, 3, 5, 4]);
        assert_eq!(d.parents, [0, 1, 2, 0, 4, 4]);
    }

    #[test]
    fn tree_chain_special_cases() {
        let ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 6, 9, 1, 2];
        let mut p = PromptLookup::new(1, 2).unwrap();
        // max_nodes <= max_draft: the chain of max_draft = max_nodes.
        for (k, n) in [(3, 3), (5, 2), (4, 0), (0, 0)] {
            let d = propose_tree(&mut p, &ctx, k, n, &[]);
            assert!(d.parents.is_empty());
            assert_eq!(d.tokens, propose(&mut p, &ctx, n), "k {k} nodes {n}");
        }
        // max_draft 0 with a budget: nothing.
        assert!(propose_tree(&mut p, &ctx, 0, 5, &[]).is_empty());
        // One continuation only: the chain form.
        let one = [5, 6, 7, 8, 9, 10, 11, 7, 8];
        let d = propose_tree(&mut p, &one, 3, 16, &[]);
        assert!(d.parents.is_empty());
        assert_eq!(d.tokens, [9, 10, 11]);
        // No match: empty.
        assert!(propose_tree(&mut p, &[1, 2, 3], 3, 16, &[]).is_empty());
    }

    #[test]
    fn tree_branches_end_at_their_first_eos() {
        let ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 6, 9, 1, 2];
        let mut p = PromptLookup::new(2, 2).unwrap();
        // EOS 3 cuts both "3 ..." branches after the 3; EOS 9 cuts the chain after 9.
        let d = propose_tree(&mut p, &ctx, 3, 8, &[3, 9]);
        assert_eq!(d.tokens, [6, 9, 3]);
        assert_eq!(d.parents, [0, 1, 0]);
        let d = propose_tree(&mut p, &ctx, 3, 8, &[5]);
        assert_eq!(d.tokens, [6, 9, 1, 3, 5, 4, 9]);
        assert_eq!(d.parents, [0, 1, 2, 0, 4, 4, 6]);
    }

    #[test]
    fn tree_occurrence_lists_span_n_gram_sizes() {
        // Trailing [7, 2]: one earlier [7, 2] (then 8); [2] alone also follows 1 and 3.
        let ctx = [1, 2, 5, 3, 2, 6, 7, 2, 8, 0, 7, 2];
        let mut p = PromptLookup::new(1, 2).unwrap();
        let d = propose_tree(&mut p, &ctx, 2, 16, &[]);
        // Chain "8 0"; then the occurrences of [2] not preceded by 7, newest first: "6 7",
        // "5 3"; then "2" itself? No: end 12 is the trailing occurrence, never a match.
        assert_eq!(d.tokens, [8, 0, 6, 5, 7, 3]);
        assert_eq!(d.parents, [0, 1, 0, 0, 3, 4]);
        assert_eq!(
            (d.tokens, d.parents),
            reference_tree(&ctx, 1, 2, 2, 16, false, &[])
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The tree from the incremental index equals the brute-force specification, after
        /// extensions and rebuilds, with EOS ids and periodic extension.
        #[test]
        fn tree_equals_reference(
            seq in proptest::collection::vec(0u32..4, 0..70),
            cuts in proptest::collection::vec(0usize..70, 0..4),
            min_n in 1usize..3,
            extra in 0usize..3,
            k in 0usize..7,
            nodes in 0usize..30,
            periodic in any::<bool>(),
            eos in proptest::collection::vec(0u32..4, 0..2),
        ) {
            let max_n = min_n + extra;
            let mut p = PromptLookup::new(min_n, max_n).unwrap().periodic_extension(periodic);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(seq.len())).collect();
            cuts.sort_unstable();
            cuts.push(seq.len());
            for &c in &cuts {
                let d = propose_tree(&mut p, &seq[..c], k, nodes, &eos);
                prop_assert!(d.q.is_none());
                prop_assert_eq!(
                    (d.tokens, d.parents),
                    reference_tree(&seq[..c], min_n, max_n, k, nodes, periodic, &eos),
                    "cut {}", c
                );
            }
        }
    }
}
