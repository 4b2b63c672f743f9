//! The pieces of the trie indexes shared by the n-gram and suffix proposers.
//!
//! [`super::prompt_lookup`] (a trie over reversed n-grams), [`super::suffix`] (suffix tries of
//! the sequence and the corpus) and [`super::merged`] (the prefix tree of merged drafts) all
//! store a trie as one hash map from an edge `(parent node, token)` to the child node id:
//! [`EdgeMap`], keyed by [`edge_key`] and hashed by the fast [`EdgeHasher`]. The incremental
//! indexes ask [`extends`] whether a context only appends to what they indexed, and the tree
//! builders return a tree that is a single path in chain form through [`normalize_chain`].

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::Draft;

/// A `Hasher` for the single `u64` edge keys of the trie maps: one multiply-xorshift mixing
/// round per word (a bijection on `u64`, so distinct keys never collide in the full hash). The
/// standard SipHash is about 3x slower on these keys and its HashDoS resistance buys nothing
/// here: keys are token ids and our own node ids.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct EdgeHasher(u64);

impl EdgeHasher {
    /// One mixing round (xorshift, multiply, twice, then a last xorshift).
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
/// `4 * indexed.len()` bytes), so a proposer used without [`Proposer::begin`](super::Proposer::begin) never serves
/// drafts from an unrelated sequence that happens to agree at a few positions.
pub(super) fn extends(indexed: &[u32], context: &[u32]) -> bool {
    context.get(..indexed.len()) == Some(indexed)
}

/// Clears `draft.parents` when every node's parent is the node before it: a tree that is a
/// single path is returned in the chain form (the form [`Proposer::propose`](super::Proposer::propose) returns).
pub(super) fn normalize_chain(draft: &mut Draft) {
    if draft.block().is_chain() {
        draft.parents.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
