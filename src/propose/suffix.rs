//! [`SuffixProposer`]: SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975).
//!
//! Two frequency-annotated suffix tries of bounded depth: one over the current request's
//! sequence (prompt + generated), updated token by token, and one over a bounded FIFO corpus of
//! earlier generations fed through [`Proposer::finish`]. The longest suffix of the context found
//! in a trie is extended greedily by the most frequent continuation while the estimated path
//! probability stays above a threshold; of the two candidates (request, corpus) the one with the
//! larger expected number of accepted tokens wins.
//!
//! Tree drafts ([`Proposer::propose_tree`]) grow a speculation tree best-first by the same
//! path probability over both tries; the rule is documented on [`SuffixProposer`].
//!
//! A trie node stands for one token string `w` of length `1 ..= max_depth` and counts its
//! occurrences (every substring of every indexed sequence, up to `max_depth` tokens, is counted
//! once per start position). Children are kept in a doubly linked sibling list (for the greedy
//! argmax and O(1) removal) and in a hash map from `(node, token)` for look-ups.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use super::ngram::{EdgeMap, edge_key, extends, normalize_chain};
use super::{Draft, ProposeRequest, Proposer};
use crate::error::{Error, Result};

/// Largest [`SuffixConfig::max_depth`] accepted.
const MAX_DEPTH_LIMIT: usize = 1024;

/// Largest number of corpus trie nodes the configuration may allow (`max_corpus_tokens *
/// max_depth`), so that node ids always fit in `u32`.
const MAX_CORPUS_NODES: usize = 1 << 31;

// ---------------------------------------------------------------------------------------------
// Configuration.
// ---------------------------------------------------------------------------------------------

/// Configuration of a [`SuffixProposer`] (SuffixDecoding, Oliaro et al. 2024).
///
/// `#[non_exhaustive]`: build one from the defaults with the `with_` setters and validate it with
/// [`SuffixProposer::new`]:
///
/// ```
/// use speculative::propose::{SuffixConfig, SuffixProposer};
///
/// let cfg = SuffixConfig::default().with_min_confidence(0.2);
/// let proposer = SuffixProposer::new(cfg)?;
/// # Ok::<(), speculative::Error>(())
/// ```
///
/// | field | default | valid range |
/// |---|---|---|
/// | `max_depth` | 24 | `2 ..= 1024` |
/// | `max_match_len` | 12 | `1 ..= max_depth - 1` |
/// | `min_confidence` | 0.1 | finite, `0.0 ..= 1.0` |
/// | `max_corpus_tokens` | 65,536 | `max_corpus_tokens * max_depth <= 2^31` (0 disables the corpus) |
/// | `corpus_outputs_only` | `true` | any |
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(remote = "Self", default, deny_unknown_fields)
)]
#[non_exhaustive]
pub struct SuffixConfig {
    /// Longest token string indexed, in tokens: the depth bound of both tries. A draft can reach
    /// at most `max_depth - m` tokens past a match of `m` tokens. Memory grows linearly with it
    /// (see [`SuffixProposer`]).
    pub max_depth: usize,
    /// Longest suffix of the context matched, in tokens (`< max_depth`, so that a match always
    /// leaves room for at least one draft token).
    pub max_match_len: usize,
    /// Stop the draft when the estimated probability of the whole draft path, the product over
    /// its steps of `count(child) / count(node)`, falls below this (dimensionless, `0.0 ..=
    /// 1.0`; `0.0` never stops early). For tree drafts ([`Proposer::propose_tree`]) every node
    /// is held to it: a node whose path's estimated probability is below it is not added.
    pub min_confidence: f32,
    /// Most tokens of earlier generations kept in the shared corpus. When a new generation
    /// would exceed it, the oldest generations are evicted whole (FIFO) until it fits; a single
    /// generation longer than the bound is cut to its last `max_corpus_tokens` tokens. `0`
    /// disables the corpus.
    pub max_corpus_tokens: usize,
    /// When `true` (default), [`Proposer::finish`] adds only the generated part of the sequence
    /// (the tokens after the prompt given to [`Proposer::begin`]) to the corpus, as in the
    /// paper; when `false`, prompt and output. If the prompt is unknown, the whole sequence is
    /// added.
    pub corpus_outputs_only: bool,
}

impl SuffixConfig {
    /// Sets [`SuffixConfig::max_depth`] (checked by [`SuffixConfig::validate`]).
    pub fn with_max_depth(mut self, max_depth: usize) -> Self {
        self.max_depth = max_depth;
        self
    }

    /// Sets [`SuffixConfig::max_match_len`] (checked by [`SuffixConfig::validate`]).
    pub fn with_max_match_len(mut self, max_match_len: usize) -> Self {
        self.max_match_len = max_match_len;
        self
    }

    /// Sets [`SuffixConfig::min_confidence`] (checked by [`SuffixConfig::validate`]).
    pub fn with_min_confidence(mut self, min_confidence: f32) -> Self {
        self.min_confidence = min_confidence;
        self
    }

    /// Sets [`SuffixConfig::max_corpus_tokens`] (checked by [`SuffixConfig::validate`]).
    pub fn with_max_corpus_tokens(mut self, max_corpus_tokens: usize) -> Self {
        self.max_corpus_tokens = max_corpus_tokens;
        self
    }

    /// Sets [`SuffixConfig::corpus_outputs_only`] (checked by [`SuffixConfig::validate`]).
    pub fn with_corpus_outputs_only(mut self, corpus_outputs_only: bool) -> Self {
        self.corpus_outputs_only = corpus_outputs_only;
        self
    }
}

impl Default for SuffixConfig {
    /// `max_depth` 24, `max_match_len` 12, `min_confidence` 0.1, `max_corpus_tokens` 65,536,
    /// `corpus_outputs_only` true (the table of [`SuffixConfig`]).
    fn default() -> Self {
        SuffixConfig {
            max_depth: 24,
            max_match_len: 12,
            min_confidence: 0.1,
            max_corpus_tokens: 65_536,
            corpus_outputs_only: true,
        }
    }
}

impl SuffixConfig {
    /// Checks every field against the ranges in the table of [`SuffixConfig`]. `O(1)`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first offending field.
    pub fn validate(&self) -> Result<()> {
        if !(2..=MAX_DEPTH_LIMIT).contains(&self.max_depth) {
            return Err(Error::config(
                "max_depth",
                self.max_depth,
                "must be in 2..=1024",
            ));
        }
        if self.max_match_len == 0 || self.max_match_len >= self.max_depth {
            return Err(Error::config(
                "max_match_len",
                self.max_match_len,
                "must be in 1..=max_depth - 1",
            ));
        }
        if !(0.0..=1.0).contains(&self.min_confidence) {
            return Err(Error::config(
                "min_confidence",
                self.min_confidence,
                "must be a finite number in 0.0..=1.0",
            ));
        }
        if self.max_corpus_tokens.saturating_mul(self.max_depth) > MAX_CORPUS_NODES {
            return Err(Error::config(
                "max_corpus_tokens",
                self.max_corpus_tokens,
                "max_corpus_tokens * max_depth must not exceed 2^31 trie nodes",
            ));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The counted suffix trie.
// ---------------------------------------------------------------------------------------------

/// "No node" in links and in [`Node::best`].
const NIL: u32 = u32::MAX;
/// [`Node::best`] must be recomputed from the child list.
const STALE: u32 = u32::MAX - 1;
/// The root (the empty string).
const ROOT: u32 = 0;

#[derive(Debug, Clone, Copy)]
struct Node {
    /// Occurrences of the node's string (0 only for the root and freed nodes).
    count: u32,
    /// Last token of the node's string (the edge label from the parent).
    token: u32,
    first_child: u32,
    next: u32,
    prev: u32,
    /// Cached child with the largest count (ties: lowest token), [`NIL`] or [`STALE`].
    best: u32,
}

impl Node {
    const fn new(token: u32) -> Self {
        Node {
            count: 0,
            token,
            first_child: NIL,
            next: NIL,
            prev: NIL,
            best: NIL,
        }
    }
}

#[derive(Debug, Clone)]
struct Trie {
    nodes: Vec<Node>,
    edges: EdgeMap,
    free: Vec<u32>,
}

impl Trie {
    fn new() -> Self {
        Trie {
            nodes: vec![Node::new(0)],
            edges: EdgeMap::default(),
            free: Vec::new(),
        }
    }

    fn clear(&mut self) {
        self.nodes.clear();
        self.nodes.push(Node::new(0));
        self.edges.clear();
        self.free.clear();
    }

    /// Nodes in use, the root included.
    fn live_nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    #[inline]
    fn count(&self, u: u32) -> u32 {
        self.nodes.get(u as usize).map_or(0, |n| n.count)
    }

    #[inline]
    fn child(&self, u: u32, token: u32) -> Option<u32> {
        self.edges.get(&edge_key(u, token)).copied()
    }

    /// `true` when child `a` ranks before child `b`: larger count, then lower token.
    #[inline]
    fn beats(&self, a: u32, b: u32) -> bool {
        let (na, nb) = (&self.nodes[a as usize], &self.nodes[b as usize]);
        na.count > nb.count || (na.count == nb.count && na.token < nb.token)
    }

    /// Adds one occurrence of the string `u + token`, creating the node if needed. `None` only
    /// when the trie already holds `2^32 - 2` nodes.
    fn increment_child(&mut self, u: u32, token: u32) -> Option<u32> {
        let c = match self.child(u, token) {
            Some(c) => c,
            None => {
                let c = self.alloc(token)?;
                let head = self.nodes[u as usize].first_child;
                self.nodes[c as usize].next = head;
                if head != NIL {
                    self.nodes[head as usize].prev = c;
                }
                self.nodes[u as usize].first_child = c;
                self.edges.insert(edge_key(u, token), c);
                c
            }
        };
        let node = &mut self.nodes[c as usize];
        node.count = node.count.saturating_add(1);
        let best = self.nodes[u as usize].best;
        if best == NIL || (best != STALE && best != c && self.beats(c, best)) {
            self.nodes[u as usize].best = c;
        }
        Some(c)
    }

    fn alloc(&mut self, token: u32) -> Option<u32> {
        if let Some(id) = self.free.pop() {
            self.nodes[id as usize] = Node::new(token);
            return Some(id);
        }
        let id = u32::try_from(self.nodes.len())
            .ok()
            .filter(|&id| id < STALE)?;
        self.nodes.push(Node::new(token));
        Some(id)
    }

    /// Removes one occurrence of each prefix of `path` (one occurrence of a string starting at
    /// some position), freeing nodes whose count reaches 0.
    fn decrement_path(&mut self, path: &[u32]) {
        let mut u = ROOT;
        for &token in path {
            let Some(c) = self.child(u, token) else {
                return;
            };
            let node = &mut self.nodes[c as usize];
            node.count = node.count.saturating_sub(1);
            let emptied = node.count == 0;
            if self.nodes[u as usize].best == c {
                self.nodes[u as usize].best = STALE;
            }
            if emptied {
                // Its own children can only hold this same occurrence; they are freed as the
                // walk goes on (the edge map still leads to them).
                self.unlink(u, c, token);
            }
            u = c;
        }
    }

    fn unlink(&mut self, u: u32, c: u32, token: u32) {
        let Node { prev, next, .. } = self.nodes[c as usize];
        if prev == NIL {
            self.nodes[u as usize].first_child = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        }
        self.edges.remove(&edge_key(u, token));
        self.nodes[c as usize] = Node::new(token);
        self.free.push(c);
    }

    /// The child of `u` with the largest count (ties: lowest token). Amortised `O(1)`; a scan of
    /// the children after an eviction touched the previous best.
    fn best_child(&mut self, u: u32) -> Option<u32> {
        let mut best = self.nodes[u as usize].best;
        if best == STALE {
            best = NIL;
            let mut c = self.nodes[u as usize].first_child;
            while c != NIL {
                if best == NIL || self.beats(c, best) {
                    best = c;
                }
                c = self.nodes[c as usize].next;
            }
            self.nodes[u as usize].best = best;
        }
        (best != NIL).then_some(best)
    }

    /// Greedy draft from node `start` (a string of `depth` tokens): repeatedly moves to the most
    /// frequent child while the product of `count(child) / denominator(node)` stays at or above
    /// `min_confidence`, writing the tokens to `out` and stopping after the first token in
    /// `eos`. `tail[d]`, when given, is the node of the
    /// context's suffix of length `d`: that occurrence has no continuation yet and is left out
    /// of the denominator. Returns the expected number of accepted tokens under these estimates
    /// (the sum of the path probabilities after each step).
    #[allow(clippy::too_many_arguments)]
    fn greedy_path(
        &mut self,
        start: u32,
        depth: usize,
        tail: Option<&[u32]>,
        max_draft: usize,
        min_confidence: f64,
        eos: &[u32],
        out: &mut Vec<u32>,
    ) -> f64 {
        out.clear();
        let (mut u, mut d) = (start, depth);
        let (mut confidence, mut score) = (1.0f64, 0.0f64);
        while out.len() < max_draft {
            let is_tail = tail.is_some_and(|t| t.get(d) == Some(&u));
            let denominator = self.count(u).saturating_sub(u32::from(is_tail));
            if denominator == 0 {
                break;
            }
            let Some(c) = self.best_child(u) else {
                break;
            };
            confidence *= f64::from(self.count(c)) / f64::from(denominator);
            if confidence < min_confidence {
                break;
            }
            let token = self.nodes[c as usize].token;
            out.push(token);
            score += confidence;
            // A draft ends at its first EOS.
            if eos.contains(&token) {
                break;
            }
            u = c;
            d += 1;
        }
        score
    }
}

// ---------------------------------------------------------------------------------------------
// Per-request index and corpus.
// ---------------------------------------------------------------------------------------------

/// The current request's trie, with the nodes of the context's suffixes.
#[derive(Debug, Clone)]
struct RequestIndex {
    trie: Trie,
    /// Copy of the indexed sequence.
    seq: Vec<u32>,
    /// `active[d]`: node of the suffix of length `d` of `seq`, `d = 0 ..= min(len, max_depth)`.
    active: Vec<u32>,
}

impl RequestIndex {
    fn new() -> Self {
        RequestIndex {
            trie: Trie::new(),
            seq: Vec::new(),
            active: vec![ROOT],
        }
    }

    fn clear(&mut self) {
        self.trie.clear();
        self.seq.clear();
        self.active.clear();
        self.active.push(ROOT);
    }

    /// Appends one token: every string ending at the new position (lengths `1 ..=
    /// max_depth`) gains one occurrence. `O(max_depth)`.
    fn push(&mut self, token: u32, max_depth: usize) -> Result<()> {
        let top = self.active.len().min(max_depth);
        if self.active.len() <= top {
            self.active.push(ROOT);
        }
        for d in (1..=top).rev() {
            let parent = self.active[d - 1];
            self.active[d] = self
                .trie
                .increment_child(parent, token)
                .ok_or_else(|| Error::proposer("suffix index exceeds 2^32 - 2 nodes"))?;
        }
        self.seq.push(token);
        Ok(())
    }
}

/// The shared corpus of earlier generations.
#[derive(Debug, Clone)]
struct Corpus {
    trie: Trie,
    generations: VecDeque<Vec<u32>>,
    tokens: usize,
}

impl Corpus {
    fn new() -> Self {
        Corpus {
            trie: Trie::new(),
            generations: VecDeque::new(),
            tokens: 0,
        }
    }

    fn clear(&mut self) {
        self.trie.clear();
        self.generations.clear();
        self.tokens = 0;
    }

    /// Adds `generation` (cut to its last `max_tokens` tokens), first evicting the oldest
    /// generations until it fits. Returns `true` when the corpus changed.
    fn add(&mut self, generation: &[u32], max_tokens: usize, max_depth: usize) -> bool {
        if max_tokens == 0 || generation.is_empty() {
            return false;
        }
        let generation = &generation[generation.len().saturating_sub(max_tokens)..];
        while self.tokens + generation.len() > max_tokens {
            let Some(old) = self.generations.pop_front() else {
                break;
            };
            for i in 0..old.len() {
                self.trie
                    .decrement_path(&old[i..old.len().min(i + max_depth)]);
            }
            self.tokens -= old.len();
        }
        for i in 0..generation.len() {
            let mut u = ROOT;
            for &token in &generation[i..generation.len().min(i + max_depth)] {
                // Cannot fail: the validated bound keeps the trie below 2^31 nodes.
                match self.trie.increment_child(u, token) {
                    Some(c) => u = c,
                    None => break,
                }
            }
        }
        self.generations.push_back(generation.to_vec());
        self.tokens += generation.len();
        true
    }
}

// ---------------------------------------------------------------------------------------------
// The proposer.
// ---------------------------------------------------------------------------------------------

/// SuffixDecoding (Oliaro, Jia, Campos & Qiao 2024, "SuffixDecoding: A Model-Free Approach to
/// Speeding Up Large Language Model Inference", arXiv 2411.04975): a model-free proposer over
/// suffix tries of the current request and of earlier generations.
///
/// `SuffixProposer` is `Send + Sync`; it holds one request's index and the shared corpus, so use
/// one per sequence (or per generator).
///
/// # Algorithm
///
/// Two tries count every token string of at most [`SuffixConfig::max_depth`] tokens: the
/// **request trie** over the current context (prompt + generated tokens) and the **corpus trie**
/// over the stored earlier generations. At each step:
///
/// 1. Match: in the request trie, the longest suffix of the context of `m <=
///    max_match_len` tokens that also occurs earlier in the context; in the corpus trie, the
///    longest suffix of `m <= max_match_len` tokens present in the corpus.
/// 2. Extend greedily: from the matched node, repeatedly take the child with the largest count
///    (ties to the lowest token id). Each step has confidence `count(child) / count(node)`
///    (in the request trie, the context's own last occurrence, which has no continuation yet,
///    is not counted in `count(node)`); the path confidence is the product of the step
///    confidences. Stop before the step that brings it below
///    [`SuffixConfig::min_confidence`], at `max_draft` tokens, at depth `max_depth`, or right
///    after an EOS id ([`ProposeRequest::eos`]; a draft ends at its first EOS).
/// 3. Choose: the candidate with the larger sum of path confidences after each step (the
///    expected number of accepted tokens under these estimates); ties go to the request trie.
///
/// The proposer is deterministic: [`Draft::q`] is `None` (a point mass on each draft token).
///
/// # Tree drafts
///
/// [`Proposer::propose_tree`] grows a speculation tree greedily by estimated probability, as
/// SuffixDecoding does (Oliaro, Jia, Campos & Qiao, arXiv 2411.04975, NeurIPS 2025 version:
/// the method's speculation-tree expansion and scoring). For a request with `max_draft = k` and `max_nodes = N`:
///
/// 1. `N <= k`: the chain that [`Proposer::propose`] returns for `max_draft = N`.
/// 2. The chain of `propose` (with `max_draft = k`) first, as nodes `0 .. L` (node `i` the child
///    of node `i - 1`).
/// 3. Best-first expansion over **both** tries: the candidates are the children of the two
///    matched nodes (step 1 of the algorithm above), each with its estimated path probability
///    `D` = the product along its path from the match of `count(child) / count(node)` (the step
///    estimate of the chain, the request trie leaving out the context's own last occurrence).
///    Repeatedly the candidate with the largest `D` is taken (ties: lower parent node, lower
///    token, request trie first). When the draft already has a node with the same parent and
///    token (a node of the chain, or the same prefix from the other trie), the candidate merges
///    into it and costs no node; otherwise it becomes a new node. Then its children become
///    candidates, unless it is an EOS (a branch ends at its first EOS) or at depth `k`. With
///    a branching limit ([`ProposeRequest::max_branch`]) a candidate whose parent already has
///    that many children is dropped, with everything below it.
///    Stops at `N` nodes or when no candidate is left.
/// 4. [`SuffixConfig::min_confidence`] applies to every node: a candidate whose `D` is below it
///    is never added (for a chain this is the same stopping rule). The trie depth
///    [`SuffixConfig::max_depth`] bounds the paths as for chains.
///
/// Candidates are taken in decreasing `D`, and `D` never increases along a path, so parents
/// come before their children (topological order) and, apart from the chain kept first, the
/// nodes are the `N` most probable prefixes under these estimates, which maximises the
/// estimated number of accepted tokens (the sum of `D` over the nodes, the paper's score) among
/// trees of `N` nodes. Two differences from the paper, both documented choices: the paper
/// builds one tree per suffix tree and verifies the higher-scoring one, while this proposer
/// merges both into one tree (each prefix ranked by the better of its two estimates, so the
/// merged tree's score is at least either tree's); and the paper sizes the tree by the match
/// length (`MAX_SPEC = alpha * p`), while here the caller's node budget `N` and depth `k` do
/// (the loop's policy). Siblings are distinct tokens, nodes are point masses
/// ([`crate::tree::SiblingScheme::Deterministic`]), and a tree that is a single path is returned
/// as a chain (empty [`Draft::parents`]), equal to `propose`'s draft. The tree holds the chain as
/// a path: under greedy verification it never accepts less than the chain at the same step
/// when `N > k`.
///
/// # State across requests
///
/// The request trie belongs to one context. Every call checks exactly that `req.context`
/// starts with the whole indexed sequence (a `memcmp`); when it does not (another request, a
/// context that shrank or changed anywhere), the request trie is rebuilt from `req.context`, as
/// [`Proposer::begin`] would (the prompt length for
/// [`SuffixConfig::corpus_outputs_only`] is then unknown until the next `begin`). The shared
/// corpus of earlier generations is cross-request state by design and is kept. So the drafts
/// never depend on an earlier request's context: they equal the drafts of a proposer with the
/// same corpus that is given the same context fresh.
///
/// # Memory bound and eviction
///
/// - Corpus: holds whole earlier generations, at most [`SuffixConfig::max_corpus_tokens`]
///   tokens in total. [`SuffixProposer::add_to_corpus`] (which [`Proposer::finish`] calls) first
///   cuts a generation longer than the bound to its last `max_corpus_tokens` tokens, then
///   evicts the oldest stored generations, whole and in insertion order, until the new one
///   fits. Eviction removes exactly the occurrences the generation added (one per start
///   position and length `1 ..= max_depth`), decrementing counts and freeing nodes whose count
///   reaches 0, so the corpus trie always equals a trie freshly built from the stored
///   generations. It has at most `1 + max_corpus_tokens * max_depth` nodes.
/// - Request trie: at most `1 + L * max_depth` nodes for a context of `L` tokens, plus a copy of
///   the context; it is emptied by [`Proposer::finish`], which keeps its allocation, so it holds
///   the memory of the longest context it has indexed.
/// - Bytes: a live node is 24 bytes plus its edge hash-map entry, but the process holds more
///   per node: the node vector grows by doubling, the edge map (17 bytes a bucket) grows to the
///   next power of two under the corpus's insert / evict churn and holds its old table while it
///   grows, and the free list keeps 4 bytes per freed node. Budget **105 bytes per node of the
///   bound at the peak and 75 in steady state**: with the defaults the corpus trie stays below
///   1.6 million nodes, about 160 MiB at the peak and 110 MiB after. Measured with 10,000
///   generations through one generator (the project's soak test): peak RSS 136 MiB with at
///   most 1.33 million live nodes. Repeated text shares nodes; the bounds are reached only by
///   text with no repeated strings: on the synthetic text of the project's proposer benchmark,
///   65,000 corpus tokens took 418,000 nodes and a 32,000-token context 566,000.
///
/// # Complexity
///
/// Per call, `O(a * (max_depth + max_match_len) + max_match_len + max_draft)` expected time for
/// a context that extends the previous one by `a` tokens (usually 1 to `k + 1`), independent of
/// the context length, plus the `O(L)` comparison above (a `memcmp` of `4 L` bytes). A context
/// that is not an extension of the indexed one is re-indexed in `O(L * max_depth)`. Adding a generation of `g` tokens costs `O(g *
/// max_depth)` plus the same per evicted token. A tree draft of `N` nodes adds at most `2 N`
/// expansions (each node is reached from at most two tries), each scanning the node's
/// children and pushing those above `min_confidence` onto a heap: `O(N * c * log(N c))` for at
/// most `c` children per node (with `min_confidence > 0`, at most `1 / min_confidence` of them
/// pass).
///
/// # Example
///
/// ```
/// use speculative::propose::{Draft, ProposeRequest, Proposer, SuffixConfig, SuffixProposer};
/// use speculative::SamplingConfig;
///
/// let mut suffix = SuffixProposer::new(SuffixConfig::default())?;
/// // An earlier generation: the corpus learns "1 2 3 4 5".
/// suffix.finish(&[1, 2, 3, 4, 5]);
/// let config = SamplingConfig::greedy();
/// let context = [9, 9, 2, 3];
/// let req = ProposeRequest::new(&context, &config, 4);
/// let mut draft = Draft::default();
/// suffix.propose(&req, &mut draft)?;
/// assert_eq!(draft.tokens, [4, 5]);
/// # Ok::<(), speculative::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct SuffixProposer {
    cfg: SuffixConfig,
    request: RequestIndex,
    corpus: Corpus,
    /// `corpus_match[d]`: corpus node of the context's suffix of length `d`, for `d = 0 ..= m`
    /// (`m <= max_match_len`, the longest present; shorter suffixes of a present string are
    /// always present).
    corpus_match: Vec<u32>,
    corpus_match_scratch: Vec<u32>,
    /// `corpus_match` must be recomputed (the corpus changed or the context was re-indexed).
    corpus_match_stale: bool,
    /// Length of the prompt given to `begin`, while the request index still starts with it.
    prompt_len: Option<usize>,
    request_draft: Vec<u32>,
    corpus_draft: Vec<u32>,
    /// Scratch of [`Proposer::propose_tree`]: the frontier of the best-first expansion.
    tree_frontier: BinaryHeap<Frontier>,
    /// Scratch of [`Proposer::propose_tree`]: `(parent row, token) -> node` of the draft.
    tree_edges: EdgeMap,
    /// The corpus shared with other proposers, and the serial of the next generation of its
    /// log this proposer has not added yet.
    shared: Option<(SharedCorpus, u64)>,
}

/// A suffix corpus shared by several [`SuffixProposer`]s, for example the proposers of the
/// concurrent requests of a [`crate::decode::BatchGenerator`]: every generation one of them
/// finishes is published to the shared log, and every proposer adds the generations published
/// by the others to its own corpus at its next [`Proposer::begin`] (SuffixDecoding's global
/// tree, Oliaro et al. 2025, section 3). Opt in with [`SuffixProposer::with_shared_corpus`].
///
/// The log holds at most `max_tokens` tokens (the oldest generations are dropped first; a
/// proposer that had not read them yet skips them). Each proposer still keeps its own trie of
/// the corpus (memory per proposer as documented on [`SuffixProposer`]); the log adds one copy
/// of the published tokens. Cloning the handle shares the same log. Drafts are point masses,
/// so what the corpus holds never changes the output distribution, only the speed.
#[derive(Debug, Clone)]
pub struct SharedCorpus {
    log: std::sync::Arc<std::sync::Mutex<SharedLog>>,
}

#[derive(Debug)]
struct SharedLog {
    /// `(serial, tokens)`, oldest first.
    generations: VecDeque<(u64, Vec<u32>)>,
    next: u64,
    tokens: usize,
    max_tokens: usize,
}

impl SharedCorpus {
    /// An empty shared corpus holding at most `max_tokens` tokens of published generations.
    pub fn new(max_tokens: usize) -> Self {
        SharedCorpus {
            log: std::sync::Arc::new(std::sync::Mutex::new(SharedLog {
                generations: VecDeque::new(),
                next: 0,
                tokens: 0,
                max_tokens,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SharedLog> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Generations published so far (including those dropped from the log).
    pub fn published(&self) -> u64 {
        self.lock().next
    }

    /// Tokens the log holds now (`<= max_tokens`).
    pub fn tokens(&self) -> usize {
        self.lock().tokens
    }

    /// Publishes a generation; returns its serial. An empty one is not published.
    fn publish(&self, generation: &[u32]) -> Option<u64> {
        if generation.is_empty() {
            return None;
        }
        let mut log = self.lock();
        let serial = log.next;
        log.next += 1;
        if generation.len() > log.max_tokens {
            return Some(serial);
        }
        log.tokens += generation.len();
        log.generations.push_back((serial, generation.to_vec()));
        while log.tokens > log.max_tokens {
            match log.generations.pop_front() {
                Some((_, g)) => log.tokens -= g.len(),
                None => break,
            }
        }
        Some(serial)
    }

    /// Calls `f` with every generation of serial `>= from` still in the log; returns the serial
    /// to read from next time.
    fn read_since(&self, from: u64, mut f: impl FnMut(&[u32])) -> u64 {
        let log = self.lock();
        for (serial, g) in &log.generations {
            if *serial >= from {
                f(g);
            }
        }
        log.next
    }
}

impl SuffixProposer {
    /// A proposer with empty tries.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when a field of `cfg` is out of range (see [`SuffixConfig`]).
    pub fn new(cfg: SuffixConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(SuffixProposer {
            cfg,
            request: RequestIndex::new(),
            corpus: Corpus::new(),
            corpus_match: vec![ROOT],
            corpus_match_scratch: Vec::new(),
            corpus_match_stale: false,
            prompt_len: None,
            request_draft: Vec::new(),
            corpus_draft: Vec::new(),
            tree_frontier: BinaryHeap::new(),
            tree_edges: EdgeMap::default(),
            shared: None,
        })
    }

    /// Shares the corpus through `shared` ([`SharedCorpus`]): finished generations are
    /// published there, and the generations the other proposers published are added to this
    /// proposer's corpus at each [`Proposer::begin`] (and now, for those already there).
    pub fn with_shared_corpus(mut self, shared: &SharedCorpus) -> Self {
        self.shared = Some((shared.clone(), 0));
        self.pull_shared();
        self
    }

    /// Adds the shared log's generations not yet added to the corpus.
    fn pull_shared(&mut self) {
        let Some((shared, from)) = self.shared.take() else {
            return;
        };
        let next = shared.read_since(from, |g| self.add_to_corpus(g));
        self.shared = Some((shared, next));
    }

    /// The validated configuration. `O(1)`.
    pub fn config(&self) -> &SuffixConfig {
        &self.cfg
    }

    /// Adds one earlier generation (or any token text worth drafting from) to the shared
    /// corpus, evicting the oldest generations as described under "Memory bound and eviction"
    /// in [`SuffixProposer`]. An empty sequence, or `max_corpus_tokens == 0`, changes nothing.
    /// `O(g * max_depth)` for `g` tokens, plus the same per evicted token.
    pub fn add_to_corpus(&mut self, generation: &[u32]) {
        let (max_tokens, max_depth) = (self.cfg.max_corpus_tokens, self.cfg.max_depth);
        if self.corpus.add(generation, max_tokens, max_depth) {
            self.corpus_match_stale = true;
        }
    }

    /// Empties the shared corpus (keeping allocations). `O(corpus nodes)`.
    pub fn clear_corpus(&mut self) {
        self.corpus.clear();
        self.corpus_match_stale = true;
    }

    /// Tokens currently held in the corpus (`<= max_corpus_tokens`). `O(1)`.
    pub fn corpus_tokens(&self) -> usize {
        self.corpus.tokens
    }

    /// Generations currently held in the corpus. `O(1)`.
    pub fn corpus_generations(&self) -> usize {
        self.corpus.generations.len()
    }

    /// Trie nodes in use, root included: `(request trie, corpus trie)`. A measure of memory.
    /// `O(1)`.
    pub fn node_counts(&self) -> (usize, usize) {
        (
            self.request.trie.live_nodes(),
            self.corpus.trie.live_nodes(),
        )
    }

    /// Number of context tokens currently indexed in the request trie. `O(1)`.
    pub fn indexed_len(&self) -> usize {
        self.request.seq.len()
    }

    /// Forgets the current request (the corpus is kept). `O(request nodes)`.
    pub fn reset(&mut self) {
        self.request.clear();
        self.prompt_len = None;
        self.corpus_match_stale = true;
    }

    /// Brings the request index and the corpus match up to date with `context`.
    fn sync(&mut self, context: &[u32]) -> Result<()> {
        let (max_depth, max_match) = (self.cfg.max_depth, self.cfg.max_match_len);
        if !extends(&self.request.seq, context) {
            self.reset();
        }
        let start = self.request.seq.len();
        for &token in context.get(start..).unwrap_or_default() {
            self.request.push(token, max_depth)?;
            if !self.corpus_match_stale {
                advance_match(
                    &self.corpus.trie,
                    &mut self.corpus_match,
                    &mut self.corpus_match_scratch,
                    token,
                    max_match,
                );
            }
        }
        if self.corpus_match_stale {
            self.corpus_match.clear();
            self.corpus_match.push(ROOT);
            let seq = &self.request.seq;
            for &token in &seq[seq.len().saturating_sub(max_match)..] {
                advance_match(
                    &self.corpus.trie,
                    &mut self.corpus_match,
                    &mut self.corpus_match_scratch,
                    token,
                    max_match,
                );
            }
            self.corpus_match_stale = false;
        }
        Ok(())
    }
}

/// A matched suffix: `(trie node, match length m)`.
type Match = (u32, usize);

impl SuffixProposer {
    /// The matched nodes `(trie node, match length m)` after [`SuffixProposer::sync`]: in the
    /// request trie the longest suffix of `m <= max_match_len` tokens with an earlier
    /// occurrence (count at least 2), in the corpus trie the longest suffix present.
    fn matches(&self) -> (Option<Match>, Option<Match>) {
        let active = &self.request.active;
        let longest = self.cfg.max_match_len.min(active.len().saturating_sub(1));
        let request = (1..=longest)
            .rev()
            .find(|&m| self.request.trie.count(active[m]) >= 2)
            .map(|m| (active[m], m));
        let corpus = self
            .corpus_match
            .iter()
            .enumerate()
            .next_back()
            .filter(|&(m, _)| m > 0)
            .map(|(m, &node)| (node, m));
        (request, corpus)
    }

    /// Pushes the children of trie node `node` (a string of `depth` tokens; path probability
    /// `prob`) whose path probability `prob * count(child) / denominator(node)` is at least
    /// `min_confidence`, as candidates for draft row `row` at draft depth `tree_depth`.
    #[allow(clippy::too_many_arguments)]
    fn push_children(
        &mut self,
        corpus: bool,
        node: u32,
        depth: usize,
        prob: f64,
        row: u32,
        tree_depth: u32,
        min_confidence: f64,
    ) {
        let (trie, tail) = if corpus {
            (&self.corpus.trie, None)
        } else {
            (&self.request.trie, Some(self.request.active.as_slice()))
        };
        // As in `Trie::greedy_path`: the context's own last occurrence has no continuation.
        let is_tail = tail.is_some_and(|t| t.get(depth) == Some(&node));
        let denominator = trie.count(node).saturating_sub(u32::from(is_tail));
        if denominator == 0 {
            return;
        }
        let mut c = trie.nodes[node as usize].first_child;
        while c != NIL {
            let child = &trie.nodes[c as usize];
            let p = prob * f64::from(child.count) / f64::from(denominator);
            if child.count > 0 && p >= min_confidence {
                self.tree_frontier.push(Frontier {
                    prob: p,
                    row,
                    token: child.token,
                    corpus,
                    node: c,
                    depth: depth as u32 + 1,
                    tree_depth,
                });
            }
            c = child.next;
        }
    }
}

/// A candidate node of a tree draft (see "Tree drafts" on [`SuffixProposer`]): a child of trie
/// node `node`'s parent, proposed under draft row `row`. Ordered by path probability, ties by
/// lower row, then lower token, then request before corpus, so the expansion is a function of
/// the counts only (not of the tries' child-list order).
#[derive(Debug, Clone, Copy)]
struct Frontier {
    /// Estimated path probability: the product of `count(child) / count(parent)` from the match.
    prob: f64,
    /// Draft row of the parent (0: the root).
    row: u32,
    token: u32,
    /// From the corpus trie (else the request trie).
    corpus: bool,
    /// The trie node of the candidate.
    node: u32,
    /// Length of the candidate's trie string.
    depth: u32,
    /// Draft depth of the candidate (1 for a child of the root).
    tree_depth: u32,
}

impl Ord for Frontier {
    fn cmp(&self, other: &Self) -> Ordering {
        // BinaryHeap pops the greatest: larger probability, then smaller row, token, source.
        self.prob
            .total_cmp(&other.prob)
            .then_with(|| other.row.cmp(&self.row))
            .then_with(|| other.token.cmp(&self.token))
            .then_with(|| other.corpus.cmp(&self.corpus))
    }
}

impl PartialOrd for Frontier {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Frontier {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Frontier {}

/// Moves the corpus match of the context's suffixes forward by one appended `token`.
fn advance_match(trie: &Trie, cur: &mut Vec<u32>, next: &mut Vec<u32>, token: u32, max_len: usize) {
    next.clear();
    next.push(ROOT);
    for d in 1..=cur.len().min(max_len) {
        match trie.child(cur[d - 1], token) {
            Some(c) => next.push(c),
            None => break,
        }
    }
    std::mem::swap(cur, next);
}

impl Proposer for SuffixProposer {
    /// `true`: drafts from the context's tokens alone.
    fn drafts_from_tokens(&self) -> bool {
        true
    }

    /// Proposes up to `req.max_draft` tokens by the algorithm described on [`SuffixProposer`],
    /// ending at the first EOS. Rebuilds the request trie when `req.context` does not extend the
    /// indexed sequence (see "State across requests" there).
    ///
    /// # Errors
    /// [`Error::Proposer`] only if the request trie would exceed `2^32 - 2` nodes (a context of
    /// about `4e9 / max_depth` tokens with no repetition); the draft is then empty.
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        self.sync(req.context)?;
        if req.max_draft == 0 {
            return Ok(());
        }
        let min_confidence = f64::from(self.cfg.min_confidence);
        let (request_match, corpus_match) = self.matches();

        // Request trie: the longest suffix with an earlier occurrence.
        let mut request_score = 0.0;
        self.request_draft.clear();
        if let Some((node, m)) = request_match {
            request_score = self.request.trie.greedy_path(
                node,
                m,
                Some(&self.request.active),
                req.max_draft,
                min_confidence,
                req.eos,
                &mut self.request_draft,
            );
        }

        // Corpus trie: the longest suffix present.
        let mut corpus_score = 0.0;
        self.corpus_draft.clear();
        if let Some((node, m)) = corpus_match {
            corpus_score = self.corpus.trie.greedy_path(
                node,
                m,
                None,
                req.max_draft,
                min_confidence,
                req.eos,
                &mut self.corpus_draft,
            );
        }

        let chosen = if corpus_score > request_score {
            &self.corpus_draft
        } else {
            &self.request_draft
        };
        draft.tokens.extend_from_slice(chosen);
        Ok(())
    }

    /// A speculation tree of at most `req.max_nodes` nodes and depth at most `req.max_draft`,
    /// grown best-first by estimated path probability over both tries, by the rule in "Tree
    /// drafts" on [`SuffixProposer`]. With `req.max_nodes <= req.max_draft` it returns exactly
    /// the chain [`Proposer::propose`] returns for `max_draft = max_nodes`, and a tree that
    /// holds a single path is returned as a chain (empty [`Draft::parents`]). Rebuilds the
    /// request trie as `propose` does.
    ///
    /// # Errors
    /// As [`SuffixProposer::propose`](Proposer::propose).
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        // The chain first (nodes 0 .. L, each the child of the one before). An empty chain
        // means no match, or no continuation reaches `min_confidence`: nor would any other node.
        if !super::tree_starts_with_chain(self, req, draft)? {
            return Ok(());
        }
        let min_confidence = f64::from(self.cfg.min_confidence);
        let (request_match, corpus_match) = self.matches();
        let mut edges = std::mem::take(&mut self.tree_edges);
        edges.clear();
        draft.parents.clear();
        // Children per row (0 = the root), for the branching limit: the chain gives each of its
        // rows one.
        let mut children = vec![0usize; req.max_nodes + 1];
        for (i, &t) in draft.tokens.iter().enumerate() {
            edges.insert(edge_key(i as u32, t), i as u32);
            draft.parents.push(i as u32);
            children[i] = 1;
        }
        self.tree_frontier.clear();
        if let Some((node, m)) = request_match {
            self.push_children(false, node, m, 1.0, 0, 1, min_confidence);
        }
        if let Some((node, m)) = corpus_match {
            self.push_children(true, node, m, 1.0, 0, 1, min_confidence);
        }
        while draft.tokens.len() < req.max_nodes {
            let Some(f) = self.tree_frontier.pop() else {
                break;
            };
            let key = edge_key(f.row, f.token);
            let index = match edges.get(&key) {
                // The same prefix from the other trie (or the chain): merged, no new node.
                Some(&i) => i,
                // The parent has as many children as the branching limit allows: this
                // continuation and everything below it stay out.
                None if children[f.row as usize] >= req.max_branch => continue,
                None => {
                    // `max_nodes` nodes at most, and each node is a distinct trie string of
                    // one of two tries below 2^32 nodes.
                    children[f.row as usize] += 1;
                    let i = draft.tokens.len() as u32;
                    draft.tokens.push(f.token);
                    draft.parents.push(f.row);
                    edges.insert(key, i);
                    i
                }
            };
            // A branch ends at its first EOS; depth at most `max_draft`.
            if req.is_eos(f.token) || f.tree_depth as usize >= req.max_draft {
                continue;
            }
            self.push_children(
                f.corpus,
                f.node,
                f.depth as usize,
                f.prob,
                index + 1,
                f.tree_depth + 1,
                min_confidence,
            );
        }
        self.tree_edges = edges;
        normalize_chain(draft);
        Ok(())
    }

    /// Indexes the prompt of a new generation (replacing the previous request's index) and
    /// remembers its length for [`SuffixConfig::corpus_outputs_only`].
    ///
    /// # Errors
    /// As [`SuffixProposer::propose`](Proposer::propose).
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.pull_shared();
        self.reset();
        self.sync(prompt)?;
        self.prompt_len = Some(prompt.len());
        Ok(())
    }

    /// Adds the finished generation to the corpus (see [`SuffixConfig::corpus_outputs_only`] and
    /// [`SuffixProposer::add_to_corpus`]) and empties the request index.
    fn finish(&mut self, sequence: &[u32]) {
        let mut part = sequence;
        if self.cfg.corpus_outputs_only
            && let Some(p) = self.prompt_len
            && self
                .request
                .seq
                .get(..p)
                .is_some_and(|prompt| sequence.starts_with(prompt))
        {
            part = &sequence[p..];
        }
        self.add_to_corpus(part);
        if self.shared.is_some() {
            // Read the others' generations first, then skip our own in the log.
            self.pull_shared();
            if let Some((shared, next)) = self.shared.as_mut()
                && let Some(serial) = shared.publish(part)
                && *next == serial
            {
                *next = serial + 1;
            }
        }
        self.reset();
    }

    /// `"suffix"`.
    fn name(&self) -> &'static str {
        "suffix"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingConfig;
    use proptest::prelude::*;

    #[test]
    fn shared_corpus_reaches_the_other_proposers_once() {
        let shared = SharedCorpus::new(1000);
        let cfg = SuffixConfig {
            corpus_outputs_only: false,
            ..SuffixConfig::default()
        };
        let mut a = SuffixProposer::new(cfg.clone())
            .unwrap()
            .with_shared_corpus(&shared);
        let mut b = SuffixProposer::new(cfg.clone())
            .unwrap()
            .with_shared_corpus(&shared);
        a.begin(&[1, 2, 3]).unwrap();
        a.finish(&[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(shared.published(), 1);
        assert_eq!(a.corpus_generations(), 1, "its own, once");
        assert_eq!(b.corpus_generations(), 0);
        b.begin(&[9, 4, 5]).unwrap();
        assert_eq!(b.corpus_generations(), 1);
        assert_eq!(propose(&mut b, &[9, 4, 5], 2), [6, 7]);
        b.finish(&[9, 4, 5, 6]);
        a.begin(&[8]).unwrap();
        assert_eq!(a.corpus_generations(), 2);
        assert_eq!(b.corpus_generations(), 2);
        // A late joiner reads what the log still holds.
        let c = SuffixProposer::new(cfg)
            .unwrap()
            .with_shared_corpus(&shared);
        assert_eq!(c.corpus_generations(), 2);
        // The log is bounded.
        let small = SharedCorpus::new(5);
        assert_eq!(small.publish(&[1, 2, 3]), Some(0));
        assert_eq!(small.publish(&[4, 5, 6]), Some(1));
        assert_eq!(small.tokens(), 3);
        assert_eq!(small.publish(&[]), None);
    }

    fn propose(p: &mut SuffixProposer, context: &[u32], k: usize) -> Vec<u32> {
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
            tokens: vec![77; 3],
            q: Some(vec![0.5]),
            q_vocab: 1,
            ..Default::default()
        };
        p.propose(&req, &mut draft).unwrap();
        assert!(draft.q.is_none());
        assert!(draft.tokens.len() <= k);
        draft.tokens
    }

    fn propose_eos(p: &mut SuffixProposer, context: &[u32], k: usize, eos: &[u32]) -> Vec<u32> {
        let config = SamplingConfig::greedy();
        let req = ProposeRequest {
            eos,
            ..ProposeRequest::new(context, &config, k)
        };
        let mut draft = Draft::default();
        p.propose(&req, &mut draft).unwrap();
        draft.tokens
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
        let corpus = [1u32, 2, 3, 4, 5];
        let mut p = SuffixProposer::new(SuffixConfig::default()).unwrap();
        p.add_to_corpus(&corpus);
        assert_eq!(propose(&mut p, &a, 5), [50, 51, 52, 53, 54]);
        // Directly on B, without begin.
        let got = propose(&mut p, &b, 5);
        let mut fresh = SuffixProposer::new(SuffixConfig::default()).unwrap();
        fresh.add_to_corpus(&corpus);
        assert_eq!(got, propose(&mut fresh, &b, 5));
        assert_eq!(got, [60, 61, 62, 63, 64]);
        assert_eq!(p.indexed_len(), b.len());
        assert_eq!(p.node_counts(), fresh.node_counts());
        // The shared corpus is intended cross-request state: it stays.
        assert_eq!(p.corpus_tokens(), 5);
        assert_eq!(propose(&mut p, &[9, 9, 2, 3], 4), [4, 5]);
        // And back to A.
        assert_eq!(propose(&mut p, &a, 5), [50, 51, 52, 53, 54]);
    }

    #[test]
    fn stale_state_context_that_shrinks_or_diverges() {
        let c = cfg(8, 3, 0.1);
        let corpus = vec![(0..40).map(|i| (i * 5 % 7) as u32).collect::<Vec<u32>>()];
        let mut x = 11u64;
        let seq: Vec<u32> = (0..300)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 7) as u32
            })
            .collect();
        let mut p = SuffixProposer::new(c.clone()).unwrap();
        p.add_to_corpus(&corpus[0]);
        propose(&mut p, &seq, 4);
        // Shrinks: a prefix of what was indexed.
        for cut in [299, 150, 2, 0] {
            let got = propose(&mut p, &seq[..cut], 4);
            assert_eq!(got, reference(&seq[..cut], &corpus, &c, 4), "cut {cut}");
            propose(&mut p, &seq, 4);
        }
        // Diverges mid-way, then grows past the old length.
        for at in [0, 1, 77, 150, 298] {
            let mut other = seq.clone();
            other[at] = (other[at] + 1) % 7;
            other.extend_from_slice(&seq[..20]);
            propose(&mut p, &seq, 4);
            let got = propose(&mut p, &other, 4);
            assert_eq!(got, reference(&other, &corpus, &c, 4), "diverge at {at}");
            assert_eq!(p.indexed_len(), other.len());
        }
        assert_eq!(p.corpus_tokens(), 40);
    }

    #[test]
    fn draft_ends_at_the_first_eos() {
        let ctx = [5, 6, 7, 2, 9, 10, 3, 11, 5, 6];
        let mut p = SuffixProposer::new(cfg(12, 4, 0.0)).unwrap();
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[]), [7, 2, 9, 10, 3, 11]);
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[2]), [7, 2]);
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[3, 2]), [7, 2]);
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[3]), [7, 2, 9, 10, 3]);
        assert_eq!(propose_eos(&mut p, &ctx, 6, &[7]), [7]);
        // From the corpus as well.
        let mut p = SuffixProposer::new(cfg(12, 4, 0.0)).unwrap();
        p.add_to_corpus(&[1, 2, 3, 0, 4, 5]);
        assert_eq!(propose_eos(&mut p, &[9, 1, 2], 6, &[]), [3, 0, 4, 5]);
        assert_eq!(propose_eos(&mut p, &[9, 1, 2], 6, &[0]), [3, 0]);
    }

    #[test]
    fn name_is_suffix() {
        let p = SuffixProposer::new(SuffixConfig::default()).unwrap();
        assert_eq!(p.name(), "suffix");
    }

    fn cfg(max_depth: usize, max_match_len: usize, min_confidence: f32) -> SuffixConfig {
        SuffixConfig {
            max_depth,
            max_match_len,
            min_confidence,
            ..SuffixConfig::default()
        }
    }

    /// Occurrences of `w` in `s`, counting only occurrences that end at or before `limit`.
    fn occurrences(s: &[u32], w: &[u32], limit: usize) -> u32 {
        if w.is_empty() || w.len() > s.len() {
            return 0;
        }
        (0..=s.len() - w.len())
            .filter(|&i| i + w.len() <= limit && &s[i..i + w.len()] == w)
            .count() as u32
    }

    /// Brute-force specification: counts by scanning the texts.
    fn reference(context: &[u32], corpus: &[Vec<u32>], c: &SuffixConfig, k: usize) -> Vec<u32> {
        reference_eos(context, corpus, c, k, &[])
    }

    /// [`reference`] with EOS ids: a path ends right after its first EOS.
    fn reference_eos(
        context: &[u32],
        corpus: &[Vec<u32>],
        c: &SuffixConfig,
        k: usize,
        eos: &[u32],
    ) -> Vec<u32> {
        let len = context.len();
        // count(w) for a path string, denominator excludes the context's own last occurrence.
        let walk =
            |start: Vec<u32>, count: &dyn Fn(&[u32]) -> u32, denom: &dyn Fn(&[u32]) -> u32| {
                let mut w = start;
                let (mut conf, mut score, mut out) = (1.0f64, 0.0f64, Vec::new());
                while out.len() < k && w.len() < c.max_depth {
                    let d = denom(&w);
                    if d == 0 {
                        break;
                    }
                    let mut tokens: Vec<u32> = context
                        .iter()
                        .chain(corpus.iter().flatten())
                        .copied()
                        .collect();
                    tokens.sort_unstable();
                    tokens.dedup();
                    let mut best: Option<(u32, u32)> = None;
                    for t in tokens {
                        let mut x = w.clone();
                        x.push(t);
                        let n = count(&x);
                        if n > 0 && best.is_none_or(|(_, bn)| n > bn) {
                            best = Some((t, n));
                        }
                    }
                    let Some((t, n)) = best else { break };
                    conf *= f64::from(n) / f64::from(d);
                    if conf < f64::from(c.min_confidence) {
                        break;
                    }
                    out.push(t);
                    score += conf;
                    w.push(t);
                    if eos.contains(&t) {
                        break;
                    }
                }
                (out, score)
            };
        let req_count = |w: &[u32]| occurrences(context, w, len);
        let req_denom = |w: &[u32]| occurrences(context, w, len - 1);
        let corpus_count = |w: &[u32]| {
            corpus
                .iter()
                .map(|g| occurrences(g, w, g.len()))
                .sum::<u32>()
        };
        let mut request = (Vec::new(), 0.0);
        for m in (1..=c.max_match_len.min(len)).rev() {
            let w = &context[len - m..];
            if req_count(w) >= 2 {
                request = walk(w.to_vec(), &req_count, &req_denom);
                break;
            }
        }
        let mut from_corpus = (Vec::new(), 0.0);
        for m in (1..=c.max_match_len.min(len)).rev() {
            let w = &context[len - m..];
            if corpus_count(w) >= 1 {
                from_corpus = walk(w.to_vec(), &corpus_count, &corpus_count);
                break;
            }
        }
        if from_corpus.1 > request.1 {
            from_corpus.0
        } else {
            request.0
        }
    }

    #[test]
    fn request_trie_proposes_repeated_text() {
        let mut p = SuffixProposer::new(SuffixConfig::default()).unwrap();
        assert_eq!(
            propose(&mut p, &[5, 6, 7, 8, 9, 10, 11, 7, 8], 3),
            [9, 10, 11]
        );
        assert_eq!(propose(&mut p, &[], 3), Vec::<u32>::new());
        assert_eq!(propose(&mut p, &[1, 2, 3], 3), Vec::<u32>::new());
    }

    #[test]
    fn most_frequent_continuation_wins() {
        let mut p = SuffixProposer::new(cfg(8, 2, 0.0)).unwrap();
        // After 1: 2 twice, 3 once.
        assert_eq!(propose(&mut p, &[1, 2, 1, 3, 1, 2, 0, 1], 1), [2]);
        // Ties go to the lowest token.
        assert_eq!(propose(&mut p, &[1, 4, 1, 3, 0, 1], 1), [3]);
    }

    #[test]
    fn corpus_proposes_from_earlier_generations() {
        let mut p = SuffixProposer::new(SuffixConfig::default()).unwrap();
        p.begin(&[100, 101]).unwrap();
        // Output 1 2 3 4 5 after the prompt; only the output goes to the corpus.
        p.finish(&[100, 101, 1, 2, 3, 4, 5]);
        assert_eq!((p.corpus_tokens(), p.corpus_generations()), (5, 1));
        assert_eq!(p.indexed_len(), 0);
        assert_eq!(propose(&mut p, &[7, 1, 2], 8), [3, 4, 5]);
        // The prompt tokens were not stored.
        assert!(propose(&mut p, &[100], 3).is_empty());
    }

    #[test]
    fn corpus_outputs_only_false_keeps_the_prompt() {
        let c = SuffixConfig {
            corpus_outputs_only: false,
            ..SuffixConfig::default()
        };
        let mut p = SuffixProposer::new(c).unwrap();
        p.begin(&[100, 101]).unwrap();
        p.finish(&[100, 101, 1, 2]);
        assert_eq!(p.corpus_tokens(), 4);
        assert_eq!(propose(&mut p, &[100], 3), [101, 1, 2]);
    }

    #[test]
    fn confidence_threshold_stops_early() {
        // Corpus: after [1, 2, 3] comes 4 three times and 5 once; the generations end after it.
        let corpus = [
            vec![1, 2, 3, 4],
            vec![1, 2, 3, 4],
            vec![1, 2, 3, 4],
            vec![1, 2, 3, 5],
        ];
        let run = |min_confidence: f32| {
            let mut p = SuffixProposer::new(cfg(8, 4, min_confidence)).unwrap();
            for g in &corpus {
                p.add_to_corpus(g);
            }
            propose(&mut p, &[9, 1, 2], 8)
        };
        // Step confidences: 3 (4/4 = 1), then 4 (3/4); then generations end (count 3, no child).
        assert_eq!(run(0.0), [3, 4]);
        assert_eq!(run(0.75), [3, 4]);
        assert_eq!(run(0.8), [3]);
        assert_eq!(run(1.0), [3]);
    }

    #[test]
    fn generation_end_lowers_confidence() {
        // "1 2" is followed by 3 in one generation and ends the other: confidence 1/2.
        let mut p = SuffixProposer::new(cfg(8, 4, 0.6)).unwrap();
        p.add_to_corpus(&[1, 2, 3]);
        p.add_to_corpus(&[1, 2]);
        assert!(propose(&mut p, &[1, 2], 4).is_empty());
        let mut p = SuffixProposer::new(cfg(8, 4, 0.5)).unwrap();
        p.add_to_corpus(&[1, 2, 3]);
        p.add_to_corpus(&[1, 2]);
        assert_eq!(propose(&mut p, &[1, 2], 4), [3]);
    }

    #[test]
    fn never_more_than_max_draft_and_zero_gives_empty() {
        let mut p = SuffixProposer::new(SuffixConfig::default()).unwrap();
        let ctx: Vec<u32> = (0..40).map(|i| i % 5).collect();
        for k in 0..12 {
            let d = propose(&mut p, &ctx, k);
            assert_eq!(d.len(), k, "k = {k}");
        }
        assert!(propose(&mut p, &ctx, 0).is_empty());
    }

    #[test]
    fn depth_bound_limits_the_draft() {
        let mut p = SuffixProposer::new(cfg(6, 2, 0.0)).unwrap();
        let ctx: Vec<u32> = (0..10).chain(0..2).collect();
        // Match of 2 tokens ([0, 1]), at most 6 - 2 = 4 more.
        assert_eq!(propose(&mut p, &ctx, 10), [2, 3, 4, 5]);
    }

    #[test]
    fn config_is_validated() {
        let bad = [
            (cfg(1, 1, 0.1), "max_depth"),
            (cfg(2000, 1, 0.1), "max_depth"),
            (cfg(8, 0, 0.1), "max_match_len"),
            (cfg(8, 8, 0.1), "max_match_len"),
            (cfg(8, 4, -0.1), "min_confidence"),
            (cfg(8, 4, 1.5), "min_confidence"),
            (cfg(8, 4, f32::NAN), "min_confidence"),
            (
                SuffixConfig {
                    max_corpus_tokens: usize::MAX,
                    ..SuffixConfig::default()
                },
                "max_corpus_tokens",
            ),
        ];
        for (c, name) in bad {
            match SuffixProposer::new(c) {
                Err(Error::InvalidConfig { field, .. }) => assert_eq!(field, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        let p = SuffixProposer::new(SuffixConfig::default()).unwrap();
        assert_eq!(p.config(), &SuffixConfig::default());
        assert!(SuffixConfig::default().validate().is_ok());
    }

    #[test]
    fn corpus_eviction_respects_the_bound() {
        let c = SuffixConfig {
            max_corpus_tokens: 10,
            ..cfg(4, 2, 0.0)
        };
        let mut p = SuffixProposer::new(c.clone()).unwrap();
        p.add_to_corpus(&[1, 2, 3, 4]);
        p.add_to_corpus(&[5, 6, 7]);
        assert_eq!((p.corpus_tokens(), p.corpus_generations()), (7, 2));
        assert_eq!(propose(&mut p, &[0, 1], 3), [2, 3, 4]);
        // 7 + 5 > 10: the first generation goes, whole.
        p.add_to_corpus(&[8, 9, 10, 11, 12]);
        assert_eq!((p.corpus_tokens(), p.corpus_generations()), (8, 2));
        assert!(propose(&mut p, &[0, 1], 3).is_empty());
        assert_eq!(propose(&mut p, &[0, 5], 3), [6, 7]);
        // Longer than the bound: cut to its last 10 tokens, evicting everything else.
        p.add_to_corpus(&(100..120).collect::<Vec<_>>());
        assert_eq!((p.corpus_tokens(), p.corpus_generations()), (10, 1));
        assert!(propose(&mut p, &[0, 105], 3).is_empty());
        assert_eq!(propose(&mut p, &[0, 110], 3), [111, 112, 113]);
        // The trie equals one built from the kept generation only.
        let mut fresh = SuffixProposer::new(c).unwrap();
        fresh.add_to_corpus(&(110..120).collect::<Vec<_>>());
        assert_eq!(p.node_counts().1, fresh.node_counts().1);
        p.clear_corpus();
        assert_eq!(
            (p.corpus_tokens(), p.corpus_generations(), p.node_counts().1),
            (0, 0, 1)
        );
    }

    #[test]
    fn disabled_corpus_stores_nothing() {
        let c = SuffixConfig {
            max_corpus_tokens: 0,
            ..SuffixConfig::default()
        };
        let mut p = SuffixProposer::new(c).unwrap();
        p.finish(&[1, 2, 3]);
        assert_eq!((p.corpus_tokens(), p.node_counts().1), (0, 1));
        assert!(propose(&mut p, &[1, 2], 3).is_empty());
    }

    #[test]
    fn unrelated_context_reindexes() {
        let mut p = SuffixProposer::new(SuffixConfig::default()).unwrap();
        assert_eq!(propose(&mut p, &[1, 2, 3, 1], 2), [2, 3]);
        assert_eq!(propose(&mut p, &[4, 5, 6, 4], 2), [5, 6]);
        assert_eq!(propose(&mut p, &[7, 8, 7], 2), [8, 7]);
        p.begin(&[3, 3]).unwrap();
        assert_eq!(p.indexed_len(), 2);
        p.reset();
        assert_eq!(p.indexed_len(), 0);
        assert_eq!(p.node_counts().0, 1);
    }

    #[test]
    fn long_context_steps_match_reference() {
        let c = cfg(10, 4, 0.1);
        let mut p = SuffixProposer::new(c.clone()).unwrap();
        let corpus = vec![(0..30).map(|i| (i * 7 % 13) as u32).collect::<Vec<u32>>()];
        p.add_to_corpus(&corpus[0]);
        let mut x = 99u64;
        let mut seq: Vec<u32> = Vec::new();
        for i in 0..600 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let t = if i > 40 && x % 6 < 2 {
                seq[i - 37]
            } else {
                (x % 13) as u32
            };
            seq.push(t);
            if i % 29 == 0 {
                assert_eq!(
                    propose(&mut p, &seq, 6),
                    reference(&seq, &corpus, &c, 6),
                    "at {i}"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(192))]

        /// Incremental updates after several extensions give what a fresh proposer on the whole
        /// context gives, and both follow the brute-force specification.
        #[test]
        fn incremental_equals_rebuild(
            seq in proptest::collection::vec(0u32..4, 0..60),
            cuts in proptest::collection::vec(0usize..60, 0..6),
            corpus in proptest::collection::vec(proptest::collection::vec(0u32..4, 0..12), 0..4),
            max_depth in 2usize..8,
            match_frac in 0usize..8,
            min_confidence in prop_oneof![Just(0.0f32), 0.0f32..1.0],
            k in 0usize..8,
        ) {
            let c = cfg(max_depth, 1 + match_frac % (max_depth - 1), min_confidence);
            let mut inc = SuffixProposer::new(c.clone()).unwrap();
            let mut fresh = SuffixProposer::new(c.clone()).unwrap();
            for g in &corpus {
                inc.add_to_corpus(g);
                fresh.add_to_corpus(g);
            }
            let kept: Vec<Vec<u32>> = corpus.iter().filter(|g| !g.is_empty()).cloned().collect();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|x| x.min(seq.len())).collect();
            cuts.sort_unstable();
            for &cut in &cuts {
                prop_assert_eq!(propose(&mut inc, &seq[..cut], k), reference(&seq[..cut], &kept, &c, k));
            }
            let got = propose(&mut inc, &seq, k);
            prop_assert_eq!(&got, &propose(&mut fresh, &seq, k));
            prop_assert_eq!(got, reference(&seq, &kept, &c, k));
        }

        /// With EOS ids, drafts follow the specification whose paths end at the first EOS, and
        /// never hold a token after an EOS.
        #[test]
        fn drafts_end_at_eos(
            seq in proptest::collection::vec(0u32..4, 0..60),
            corpus in proptest::collection::vec(proptest::collection::vec(0u32..4, 0..12), 0..4),
            eos in proptest::collection::vec(0u32..4, 0..2),
            k in 0usize..8,
        ) {
            let c = cfg(6, 3, 0.0);
            let mut p = SuffixProposer::new(c.clone()).unwrap();
            for g in &corpus {
                p.add_to_corpus(g);
            }
            let kept: Vec<Vec<u32>> = corpus.iter().filter(|g| !g.is_empty()).cloned().collect();
            let got = propose_eos(&mut p, &seq, k, &eos);
            if let Some(i) = got.iter().position(|t| eos.contains(t)) {
                prop_assert_eq!(i + 1, got.len());
            }
            prop_assert_eq!(got, reference_eos(&seq, &kept, &c, k, &eos));
        }

        /// After any sequence of additions the corpus holds at most the bound, keeps the newest
        /// generations whole, and its trie equals one built from the kept generations.
        #[test]
        fn eviction_keeps_bound_and_counts(
            gens in proptest::collection::vec(proptest::collection::vec(0u32..5, 0..15), 1..12),
            max_tokens in 0usize..30,
            max_depth in 2usize..6,
            probes in proptest::collection::vec(proptest::collection::vec(0u32..5, 1..5), 1..6),
        ) {
            let c = SuffixConfig { max_corpus_tokens: max_tokens, ..cfg(max_depth, 1, 0.0) };
            let mut p = SuffixProposer::new(c.clone()).unwrap();
            let mut kept: VecDeque<Vec<u32>> = VecDeque::new();
            for g in &gens {
                p.add_to_corpus(g);
                if max_tokens > 0 && !g.is_empty() {
                    let g = g[g.len().saturating_sub(max_tokens)..].to_vec();
                    while kept.iter().map(Vec::len).sum::<usize>() + g.len() > max_tokens {
                        kept.pop_front();
                    }
                    kept.push_back(g);
                }
                prop_assert!(p.corpus_tokens() <= max_tokens);
            }
            prop_assert_eq!(p.corpus_generations(), kept.len());
            let mut fresh = SuffixProposer::new(c.clone()).unwrap();
            for g in &kept {
                fresh.add_to_corpus(g);
            }
            prop_assert_eq!(p.node_counts().1, fresh.node_counts().1);
            prop_assert!(p.node_counts().1 <= 1 + max_tokens * max_depth);
            let kept: Vec<Vec<u32>> = kept.into_iter().collect();
            for probe in &probes {
                prop_assert_eq!(propose(&mut p, probe, 4), reference(probe, &kept, &c, 4));
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Tree drafts.
    // -----------------------------------------------------------------------------------------

    fn propose_tree(
        p: &mut SuffixProposer,
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
            tokens: vec![77; 3],
            parents: vec![0; 2],
            ..Default::default()
        };
        p.propose_tree(&req, &mut draft).unwrap();
        assert!(draft.q.is_none());
        draft
    }

    /// Brute-force specification of the tree rule, with counts found by scanning the texts:
    /// the chain of [`reference_eos`], then best-first by path probability over the children
    /// of both matches (ties: lower row, lower token, request first), merging equal prefixes.
    fn reference_tree(
        context: &[u32],
        corpus: &[Vec<u32>],
        c: &SuffixConfig,
        k: usize,
        nodes: usize,
        eos: &[u32],
    ) -> (Vec<u32>, Vec<u32>) {
        if nodes <= k {
            return (reference_eos(context, corpus, c, nodes, eos), Vec::new());
        }
        let chain = reference_eos(context, corpus, c, k, eos);
        if chain.is_empty() {
            return (chain, Vec::new());
        }
        let len = context.len();
        let count = |corp: bool, w: &[u32]| -> u32 {
            if corp {
                corpus.iter().map(|g| occurrences(g, w, g.len())).sum()
            } else {
                occurrences(context, w, len)
            }
        };
        let denom = |corp: bool, w: &[u32]| -> u32 {
            if corp {
                count(true, w)
            } else {
                occurrences(context, w, len - 1)
            }
        };
        let mut alphabet: Vec<u32> = context
            .iter()
            .chain(corpus.iter().flatten())
            .copied()
            .collect();
        alphabet.sort_unstable();
        alphabet.dedup();
        // (prob, row, token, corpus, string, tree depth)
        type Cand = (f64, u32, u32, bool, Vec<u32>, usize);
        let children =
            |corp: bool, w: &[u32], prob: f64, row: u32, td: usize, out: &mut Vec<Cand>| {
                if w.len() >= c.max_depth {
                    return;
                }
                let d = denom(corp, w);
                if d == 0 {
                    return;
                }
                for &t in &alphabet {
                    let mut x = w.to_vec();
                    x.push(t);
                    let n = count(corp, &x);
                    let p = prob * f64::from(n) / f64::from(d);
                    if n > 0 && p >= f64::from(c.min_confidence) {
                        out.push((p, row, t, corp, x, td));
                    }
                }
            };
        let mut frontier: Vec<Cand> = Vec::new();
        for m in (1..=c.max_match_len.min(len)).rev() {
            let w = &context[len - m..];
            if count(false, w) >= 2 {
                children(false, w, 1.0, 0, 1, &mut frontier);
                break;
            }
        }
        for m in (1..=c.max_match_len.min(len)).rev() {
            let w = &context[len - m..];
            if count(true, w) >= 1 {
                children(true, w, 1.0, 0, 1, &mut frontier);
                break;
            }
        }
        let mut tokens = chain.clone();
        let mut parents: Vec<u32> = (0..chain.len() as u32).collect();
        while tokens.len() < nodes && !frontier.is_empty() {
            let best = (0..frontier.len())
                .max_by(|&a, &b| {
                    let (x, y) = (&frontier[a], &frontier[b]);
                    x.0.total_cmp(&y.0)
                        .then(y.1.cmp(&x.1))
                        .then(y.2.cmp(&x.2))
                        .then(y.3.cmp(&x.3))
                })
                .unwrap();
            let (prob, row, t, corp, w, td) = frontier.swap_remove(best);
            let index = match (0..tokens.len()).find(|&i| parents[i] == row && tokens[i] == t) {
                Some(i) => i,
                None => {
                    tokens.push(t);
                    parents.push(row);
                    tokens.len() - 1
                }
            };
            if eos.contains(&t) || td >= k {
                continue;
            }
            children(corp, &w, prob, index as u32 + 1, td + 1, &mut frontier);
        }
        if parents.iter().enumerate().all(|(i, &r)| r as usize == i) {
            parents.clear();
        }
        (tokens, parents)
    }

    #[test]
    fn tree_grows_by_path_probability() {
        let corpus = [vec![1, 2, 3, 4], vec![1, 2, 3, 4], vec![1, 2, 5, 6]];
        let mut p = SuffixProposer::new(cfg(8, 4, 0.0)).unwrap();
        for g in &corpus {
            p.add_to_corpus(g);
        }
        // After "1 2": 3 (2/3) then 4 (2/3); 5 (1/3) then 6 (1/3).
        let d = propose_tree(&mut p, &[9, 1, 2], 3, 6, &[]);
        assert_eq!(
            (d.tokens.as_slice(), d.parents.as_slice()),
            (&[3, 4, 5, 6][..], &[0, 1, 0, 3][..])
        );
        // A budget of 3: the more probable 5 before its child 6.
        let d = propose_tree(&mut p, &[9, 1, 2], 2, 3, &[]);
        assert_eq!(
            (d.tokens.as_slice(), d.parents.as_slice()),
            (&[3, 4, 5][..], &[0, 1, 0][..])
        );
        // min_confidence 0.5 leaves out the 1/3 branch: the chain form.
        let mut p = SuffixProposer::new(cfg(8, 4, 0.5)).unwrap();
        for g in &corpus {
            p.add_to_corpus(g);
        }
        let d = propose_tree(&mut p, &[9, 1, 2], 3, 6, &[]);
        assert_eq!((d.tokens.as_slice(), d.parents.len()), (&[3, 4][..], 0));
        // EOS 3 ends the first branch at the 3.
        let mut p = SuffixProposer::new(cfg(8, 4, 0.0)).unwrap();
        for g in &corpus {
            p.add_to_corpus(g);
        }
        let d = propose_tree(&mut p, &[9, 1, 2], 3, 6, &[3]);
        assert_eq!(
            (d.tokens.as_slice(), d.parents.as_slice()),
            (&[3, 5, 6][..], &[0, 0, 2][..])
        );
    }

    #[test]
    fn tree_merges_the_request_and_corpus_candidates() {
        let corpus = [vec![1, 2, 3, 4], vec![1, 2, 6]];
        let mut p = SuffixProposer::new(cfg(8, 4, 0.0)).unwrap();
        for g in &corpus {
            p.add_to_corpus(g);
        }
        let ctx = [7, 1, 2, 3, 8, 1, 2];
        // The request chain "3 8 1" (score 3) beats the corpus chain "3 4" (score 1); the
        // corpus's 3 merges into the chain's first node, its 4 and 6 are new nodes.
        assert_eq!(propose(&mut p, &ctx, 3), [3, 8, 1]);
        let d = propose_tree(&mut p, &ctx, 3, 6, &[]);
        assert_eq!(
            (d.tokens.as_slice(), d.parents.as_slice()),
            (&[3, 8, 1, 6, 4][..], &[0, 1, 2, 0, 1][..])
        );
        assert_eq!(
            (d.tokens, d.parents),
            reference_tree(&ctx, &corpus, &cfg(8, 4, 0.0), 3, 6, &[])
        );
    }

    #[test]
    fn tree_chain_special_cases() {
        let corpus = [vec![1, 2, 3, 4], vec![1, 2, 6]];
        let mut p = SuffixProposer::new(cfg(8, 4, 0.0)).unwrap();
        for g in &corpus {
            p.add_to_corpus(g);
        }
        let ctx = [7, 1, 2, 3, 8, 1, 2];
        for (k, n) in [(3, 3), (5, 2), (4, 0), (0, 0)] {
            let d = propose_tree(&mut p, &ctx, k, n, &[]);
            assert!(d.parents.is_empty());
            assert_eq!(d.tokens, propose(&mut p, &ctx, n), "k {k} nodes {n}");
        }
        assert!(propose_tree(&mut p, &ctx, 0, 5, &[]).is_empty());
        // One continuation only.
        let mut q = SuffixProposer::new(SuffixConfig::default()).unwrap();
        let d = propose_tree(&mut q, &[5, 6, 7, 8, 9, 10, 11, 7, 8], 3, 16, &[]);
        assert_eq!(
            (d.tokens.as_slice(), d.parents.len()),
            (&[9, 10, 11][..], 0)
        );
        assert!(propose_tree(&mut q, &[1, 2, 3], 3, 16, &[]).is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(192))]

        /// The tree from the incremental tries equals the brute-force specification after
        /// extensions, with EOS ids and a corpus.
        #[test]
        fn tree_equals_reference(
            seq in proptest::collection::vec(0u32..4, 0..50),
            cuts in proptest::collection::vec(0usize..50, 0..4),
            corpus in proptest::collection::vec(proptest::collection::vec(0u32..4, 0..12), 0..4),
            max_depth in 2usize..8,
            match_frac in 0usize..8,
            min_confidence in prop_oneof![Just(0.0f32), 0.0f32..0.6],
            k in 0usize..7,
            nodes in 0usize..24,
            eos in proptest::collection::vec(0u32..4, 0..2),
        ) {
            let c = cfg(max_depth, 1 + match_frac % (max_depth - 1), min_confidence);
            let mut p = SuffixProposer::new(c.clone()).unwrap();
            for g in &corpus {
                p.add_to_corpus(g);
            }
            let kept: Vec<Vec<u32>> = corpus.iter().filter(|g| !g.is_empty()).cloned().collect();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|x| x.min(seq.len())).collect();
            cuts.sort_unstable();
            cuts.push(seq.len());
            for &cut in &cuts {
                let d = propose_tree(&mut p, &seq[..cut], k, nodes, &eos);
                prop_assert_eq!(
                    (d.tokens, d.parents),
                    reference_tree(&seq[..cut], &kept, &c, k, nodes, &eos),
                    "cut {}", cut
                );
            }
        }
    }
}
