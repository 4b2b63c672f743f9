//! [`PromptLookup`]: prompt lookup decoding (Saxena 2023), the n-gram proposer.
//!
//! The proposer looks for the trailing n-gram of the context earlier in the context (prompt and
//! generated text) and proposes the tokens that followed its most recent earlier occurrence.
//! Inputs that copy from the prompt (summaries, code edits, retrieval answers) get long accepted
//! drafts at almost no cost.
//!
//! The index is a trie over reversed n-grams (depth `max_n`), kept in one hash map from
//! `(node, token)` to child node; every node remembers the most recent end position of its
//! n-gram. It is updated only for the tokens appended since the previous call, so a proposal
//! costs `O(max_n + max_draft)` hash look-ups and copies whatever the context length.
//!
//! This file also holds the small helpers shared with [`super::suffix`]: the edge map type with
//! its hasher and the "is this context an extension of what was indexed" check.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::{Draft, ProposeRequest, Proposer};
use crate::error::{Error, Result};

/// The longest draft periodic extension builds, in tokens, whatever `max_draft` asks for: it
/// bounds the allocation for direct callers that pass a huge `max_draft`.
pub const MAX_PERIODIC_DRAFT: usize = 4096;

/// Largest n-gram size [`PromptLookup::new`] accepts. The index holds up to `max_n` trie nodes
/// per context token, so the bound keeps memory linear with a small constant.
const MAX_NGRAM: usize = 64;

// ---------------------------------------------------------------------------------------------
// Helpers shared with `suffix.rs`.
// ---------------------------------------------------------------------------------------------

/// A `Hasher` for the single `u64` edge keys of the trie maps: one multiply-xorshift mixing
/// round per word (a bijection on `u64`, so distinct keys never collide in the full hash). The
/// standard SipHash is about 3x slower on these keys and its HashDoS resistance buys nothing
/// here: keys are token ids and our own node ids.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct EdgeHasher(u64);

impl EdgeHasher {
    #[inline]
    fn mix(mut x: u64) -> u64 {
        x ^= x >> 32;
        x = x.wrapping_mul(0xd6e8_feb8_6659_fd93);
        x ^= x >> 32;
        x = x.wrapping_mul(0xd6e8_feb8_6659_fd93);
        x ^ (x >> 32)
    }
}

impl Hasher for EdgeHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Not used by `u64` keys; kept correct for any other key type.
        for &b in bytes {
            self.0 = Self::mix(self.0 ^ u64::from(b));
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = Self::mix(self.0 ^ x);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Map from an edge `(parent node, token)` (see [`edge_key`]) to the child node id.
pub(super) type EdgeMap = HashMap<u64, u32, BuildHasherDefault<EdgeHasher>>;

/// Packs the edge `(parent, token)` into one map key.
#[inline]
pub(super) fn edge_key(parent: u32, token: u32) -> u64 {
    (u64::from(parent) << 32) | u64::from(token)
}

/// `true` when `context` is `indexed` followed by zero or more new tokens.
///
/// Exact: compares every indexed token with the context's prefix (one `memcmp` of
/// `4 * indexed.len()` bytes), so a proposer used without [`Proposer::begin`] never serves
/// drafts from an unrelated sequence that happens to agree at a few positions.
pub(super) fn extends(indexed: &[u32], context: &[u32]) -> bool {
    context.get(..indexed.len()) == Some(indexed)
}

// ---------------------------------------------------------------------------------------------
// The n-gram index.
// ---------------------------------------------------------------------------------------------

/// Trie over reversed n-grams, each node tagged with the most recent end of its n-gram.
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
    /// Ends `1 .. next_end` are indexed.
    next_end: usize,
}

impl NgramIndex {
    fn new() -> Self {
        NgramIndex {
            seq: Vec::new(),
            edges: EdgeMap::default(),
            last_end: vec![0],
            next_end: 1,
        }
    }

    fn clear(&mut self) {
        self.seq.clear();
        self.edges.clear();
        self.last_end.clear();
        self.last_end.push(0);
        self.next_end = 1;
    }

    /// Brings the index up to date with `context`: appends and indexes the new tokens, or
    /// rebuilds from scratch when `context` does not extend the indexed sequence. Afterwards
    /// every end `1 ..= context.len() - 1` is indexed, so the trailing n-gram (end
    /// `context.len()`) is not yet in the index and every match is an earlier occurrence.
    fn sync(&mut self, context: &[u32], max_n: usize) -> Result<()> {
        if !extends(&self.seq, context) {
            self.clear();
        }
        if let Some(new) = context.get(self.seq.len()..) {
            self.seq.extend_from_slice(new);
        }
        while self.next_end < self.seq.len() {
            self.insert_end(self.next_end, max_n)?;
            self.next_end += 1;
        }
        Ok(())
    }

    /// Records end `e`: the n-grams `seq[e - n .. e]` for `n = 1 ..= min(max_n, e)`.
    fn insert_end(&mut self, e: usize, max_n: usize) -> Result<()> {
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
/// # Example
/// ```
/// use speculative::propose::{PromptLookup, PromptLookupConfig};
///
/// let cfg = PromptLookupConfig { min_n: 2, max_n: 5, ..PromptLookupConfig::default() };
/// let lookup = PromptLookup::from_config(cfg)?;
/// assert_eq!((lookup.min_n(), lookup.max_n()), (2, 5));
/// assert_eq!(lookup.config(), cfg);
/// # Ok::<(), speculative::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PromptLookupConfig {
    /// Smallest n-gram size matched, in tokens.
    pub min_n: usize,
    /// Largest n-gram size matched, in tokens.
    pub max_n: usize,
    /// Periodic extension on (see [`PromptLookup::periodic_extension`]).
    pub periodic: bool,
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
/// each), so `O(L * max_n)`.
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
/// let req = ProposeRequest {
///     context: &context,
///     config: &config,
///     max_draft: 3,
///     max_nodes: 3,
///     seed: 0,
///     target_hidden: None,
///     prompt_len: 0,
///     eos: &[],
///     suppress_eos_rows: 0,
/// };
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
            index: NgramIndex::new(),
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
}

impl Proposer for PromptLookup {
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
        self.index.sync(req.context, self.max_n)?;
        if req.max_draft == 0 {
            return Ok(());
        }
        let Some(end) = self.index.lookup(self.min_n, self.max_n) else {
            return Ok(());
        };
        let seq = &self.index.seq;
        let Some(continuation) = seq.get(end..).filter(|c| !c.is_empty()) else {
            return Ok(());
        };
        if self.periodic {
            // Bounded whatever `max_draft` says (returning fewer tokens is always allowed).
            let take = req.max_draft.min(MAX_PERIODIC_DRAFT);
            draft.tokens.extend(continuation.iter().cycle().take(take));
        } else {
            let take = req.max_draft.min(continuation.len());
            draft.tokens.extend_from_slice(&continuation[..take]);
        }
        // A draft ends at its first EOS.
        let keep = req.draft_len_to_eos(&draft.tokens);
        draft.tokens.truncate(keep);
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
        self.index.sync(prompt, self.max_n)
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
            seed: 0,
            target_hidden: None,
            prompt_len: 0,
            eos: &[],
            suppress_eos_rows: 0,
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

    #[test]
    fn extends_detects_changes() {
        let a: Vec<u32> = (0..1000).collect();
        let mut b = a.clone();
        b.push(5);
        assert!(extends(&a, &b));
        assert!(extends(&a, &a));
        assert!(!extends(&b, &a));
        assert!(extends(&[], &a));
        b[0] = 7;
        assert!(!extends(&a, &b));
        b[0] = 0;
        b[990] = 7;
        assert!(!extends(&a, &b));
        // Any single position counts, not only sampled ones.
        for i in [1, 500, 700, 966, 983] {
            let mut c = a.clone();
            c.push(5);
            c[i] = 7;
            assert!(!extends(&a, &c), "change at {i}");
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
}
