//! Shadows of the cost-aware [`super::MergedProposer`]: the candidates of a step deeper than the
//! tokens the step emitted (left out of the draft by cost, or past the accepted path's end),
//! scored against the tokens emitted at the next steps.
//!
//! A merge that cuts nodes by cost learns its deep rates only from the nodes it drafts; where
//! a verify row is dear (a CPU engine: two rows cost more than 1.6 single steps) the prior
//! rates say no chain pays, nothing is drafted, and the rates never leave the prior. A
//! candidate chain is a guess about the next tokens, and the next steps emit them anyway: the
//! shadow of a step keeps its candidates below the last node that the step's emitted tokens
//! matched, and each later emitted token tests the shadow's children of the current node (the
//! matching one, if any, becomes current), exactly as if they had been drafted. With greedy
//! verification the emitted token is the target's argmax, so a shadow's test is what a
//! verification of the same candidate would have decided; sampling, the emitted token is the
//! target's draw (or a correction after another draft's rejection), an estimate of the
//! acceptance probability of a point-mass candidate.

use super::merge_trie::{NONE, Trie};

/// Most shadows kept at once: one per step, each lives for at most its depth in tokens; the
/// oldest is dropped first.
const MAX_SHADOWS: usize = 16;

/// One candidate of a shadow.
#[derive(Debug, Clone, Copy)]
struct ShadowNode {
    token: u32,
    /// Index of the parent in [`Shadow::nodes`], [`NONE`] for a child of the shadow's start.
    parent: u32,
    /// Depth in the step's trie (1 for a child of the step's root).
    depth: u32,
    /// The members that proposed it (bit `s` for member `s`).
    proposers: u64,
}

/// The candidates of one step below one node, and the node the later tokens matched so far.
#[derive(Debug, Clone, Default)]
struct Shadow {
    nodes: Vec<ShadowNode>,
    /// The current node (index in `nodes`; [`NONE`]: the start).
    at: u32,
}

/// The live shadows of a merge (see the module docs).
#[derive(Debug, Clone, Default)]
pub(super) struct Shadows {
    live: Vec<Shadow>,
    /// Scratch: the `(proposers, hit)` of one level of one shadow.
    level: Vec<(u64, bool)>,
}

impl Shadows {
    /// Forgets every shadow (a new generation: the next tokens continue another context).
    pub(super) fn clear(&mut self) {
        self.live.clear();
    }

    /// Keeps the candidates of `trie` below node `at` ([`NONE`]: the root), if it has any.
    /// `O(trie nodes)`.
    pub(super) fn keep(&mut self, trie: &Trie, at: u32) {
        if trie.first_child_of(at) == NONE {
            return;
        }
        let mut s = Shadow {
            nodes: Vec::new(),
            at: NONE,
        };
        // Breadth first: a parent before its children, so parents' indices are known.
        let mut from: Vec<(u32, u32)> = vec![(at, NONE)];
        let mut i = 0;
        while i < from.len() {
            let (trie_id, shadow_id) = from[i];
            let mut c = trie.first_child_of(trie_id);
            while c != NONE {
                let n = &trie.nodes[c as usize];
                from.push((c, s.nodes.len() as u32));
                s.nodes.push(ShadowNode {
                    token: n.token,
                    parent: shadow_id,
                    depth: n.depth,
                    proposers: n.proposers,
                });
                c = n.next_sibling;
            }
            i += 1;
        }
        if self.live.len() == MAX_SHADOWS {
            self.live.remove(0);
        }
        self.live.push(s);
    }

    /// Scores every shadow against `emitted`, token by token: for each shadow, the children of
    /// its current node are tested against the token, `level(depth, &[(proposers, hit)])` is
    /// called with them, and the matching child becomes current; a shadow whose current node
    /// has no matching child (or no children) is dropped. `O(shadow nodes * tokens)`.
    pub(super) fn advance(
        &mut self,
        emitted: &[u32],
        mut level: impl FnMut(usize, &[(u64, bool)]),
    ) {
        let mut live = std::mem::take(&mut self.live);
        live.retain_mut(|s| {
            for &token in emitted {
                self.level.clear();
                let mut next = NONE;
                let mut depth = 0;
                for (i, n) in s.nodes.iter().enumerate() {
                    if n.parent != s.at {
                        continue;
                    }
                    let hit = n.token == token;
                    if hit {
                        next = i as u32;
                    }
                    depth = n.depth as usize;
                    self.level.push((n.proposers, hit));
                }
                if self.level.is_empty() {
                    return false;
                }
                level(depth, &self.level);
                if next == NONE {
                    return false;
                }
                s.at = next;
            }
            true
        });
        self.live = live;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shadow_is_tested_by_the_later_tokens_until_it_misses() {
        let mut trie = Trie::default();
        // Member 0: 1 -> 2 -> 3; member 1: 1 -> 4.
        let a = trie.child(NONE, 1, 1, 0b01 | 0b10).unwrap();
        let b = trie.child(a, 2, 2, 0b01).unwrap();
        trie.child(b, 3, 3, 0b01).unwrap();
        trie.child(a, 4, 2, 0b10).unwrap();
        let mut sh = Shadows::default();
        // The step emitted [1]: below node `a` the candidates 2 -> 3 and 4 wait.
        sh.keep(&trie, a);
        let mut seen = Vec::new();
        sh.advance(&[2], |d, l| seen.push((d, l.to_vec())));
        assert_eq!(seen, [(2, vec![(0b01, true), (0b10, false)])]);
        seen.clear();
        // Then 9: node 3 misses and the shadow is gone.
        sh.advance(&[9, 3], |d, l| seen.push((d, l.to_vec())));
        assert_eq!(seen, [(3, vec![(0b01, false)])]);
        assert!(sh.live.is_empty());
        // Nothing below a leaf: no shadow.
        let leaf = trie.child(NONE, 7, 1, 0b01).unwrap();
        sh.keep(&trie, leaf);
        assert!(sh.live.is_empty());
        // At most MAX_SHADOWS live at once.
        for _ in 0..MAX_SHADOWS + 3 {
            sh.keep(&trie, NONE);
        }
        assert_eq!(sh.live.len(), MAX_SHADOWS);
        sh.clear();
        assert!(sh.live.is_empty());
    }
}
