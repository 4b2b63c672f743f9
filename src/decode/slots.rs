//! The batch loop's slots across requests: which slots are free, what each free slot's KV
//! cache still holds (prefix reuse), and which slot a new request takes.
//!
//! A request that ends keeps its slot's cache (its context but the last token) while the slot
//! is free; a later request whose prompt starts with those tokens (the next turn of the same
//! conversation, or another request with the same system prompt) takes that slot and prefills
//! only the rest. A request with nothing in common takes an empty slot, else the free slot used
//! least recently (its cache is dropped: the eviction). With a target that copies prefixes
//! between slots ([`crate::BatchTarget::copy_prefix`]), a request whose best prefix lives in a
//! busy slot, or in a free slot holding more than the shared part, gets a copy of it in the
//! slot it takes, and the source keeps its cache.

/// The shortest prefix the pool shares that is not a slot's whole cache or its conversation's:
/// a shorter match (a few tokens in common by chance) is not worth evicting the rest of a
/// slot's cache or copying, and leaves the scheduling as without reuse.
pub(crate) const MIN_SHARED_PREFIX: usize = 16;

/// What one free slot's cache holds.
#[derive(Debug, Clone, Default)]
struct Held {
    /// The tokens of the slot's cache (empty: nothing kept).
    tokens: Vec<u32>,
    /// The conversation key of the request that left them.
    conversation: Option<u64>,
    /// When the slot was last given back (a counter; larger is more recent).
    used: u64,
}

/// Where a new request runs: its slot, the prompt tokens that slot will hold before the
/// prefill, and the prefix copy that puts them there (source slot and length), if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    pub slot: usize,
    pub keep: usize,
    pub copy: Option<(usize, usize)>,
}

/// The free slots and what their caches hold.
#[derive(Debug, Clone)]
pub(crate) struct SlotPool {
    held: Vec<Held>,
    /// Free slot indices; the last one is taken first when nothing is reused.
    free: Vec<usize>,
    tick: u64,
}

/// Length of the longest common prefix of `a` and `b`.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SlotPool {
    /// `n` empty free slots.
    pub fn new(n: usize) -> Self {
        SlotPool {
            held: vec![Held::default(); n],
            free: (0..n).rev().collect(),
            tick: 0,
        }
    }

    /// `true` when no slot is free.
    pub fn is_empty(&self) -> bool {
        self.free.is_empty()
    }

    /// Gives `slot` back, its cache holding `tokens` (empty after a release) left by a request
    /// of `conversation`.
    pub fn put(&mut self, slot: usize, tokens: Vec<u32>, conversation: Option<u64>) {
        self.tick += 1;
        if let Some(h) = self.held.get_mut(slot) {
            *h = Held {
                tokens,
                conversation,
                used: self.tick,
            };
            self.free.push(slot);
        }
    }

    /// Takes a free slot for `prompt` (`None` when none is free). Without `reuse`, the last
    /// freed slot and nothing kept. With it: a free slot of the same `conversation` or whose
    /// whole cache starts the prompt keeps that prefix; otherwise, when the target copies
    /// prefixes (`copy`), the longest prefix of any free or `busy` slot (slot, the tokens its
    /// cache holds) is copied into an empty or the least recently used free slot; otherwise
    /// the free slot with the longest common prefix keeps it (and loses the rest). Shared
    /// prefixes shorter than [`MIN_SHARED_PREFIX`] count only as a slot's whole cache or its
    /// conversation's. At most `prompt.len() - 1` tokens are kept (the first step feeds the
    /// last one).
    pub fn take(
        &mut self,
        prompt: &[u32],
        conversation: Option<u64>,
        reuse: bool,
        copy: bool,
        busy: &[(usize, &[u32])],
    ) -> Option<Placement> {
        if !reuse {
            let slot = self.free.pop()?;
            return Some(Placement {
                slot,
                keep: 0,
                copy: None,
            });
        }
        let limit = prompt.len().saturating_sub(1);
        let lcp = |t: &[u32]| common_prefix(t, prompt).min(limit);
        // The best free slot of its own: the same conversation first, then the longest prefix,
        // then the least recently used.
        let own = (0..self.free.len()).max_by_key(|&i| {
            let h = &self.held[self.free[i]];
            let same = conversation.is_some() && h.conversation == conversation;
            (same, lcp(&h.tokens), std::cmp::Reverse(h.used))
        })?;
        let own_slot = self.free[own];
        let own_held = &self.held[own_slot];
        let mut own_keep = lcp(&own_held.tokens);
        // Nothing of value is lost: the slot's conversation, its whole cache, or the whole
        // prompt (a retry) in common.
        let lossless = (conversation.is_some() && own_held.conversation == conversation)
            || (own_keep > 0 && (own_keep == own_held.tokens.len() || own_keep == limit));
        if !lossless && own_keep < MIN_SHARED_PREFIX {
            own_keep = 0;
        }
        let source = if copy {
            self.free
                .iter()
                .map(|&s| (s, lcp(&self.held[s].tokens)))
                .chain(busy.iter().map(|&(s, t)| (s, lcp(t))))
                .max_by_key(|&(s, n)| (n, std::cmp::Reverse(s)))
                .filter(|&(_, n)| n >= MIN_SHARED_PREFIX && (n > own_keep || !lossless))
        } else {
            None
        };
        let placement = match source {
            Some((src, n)) if !(lossless && own_keep >= n) => {
                let victim = self.victim();
                let slot = self.free[victim];
                if slot == src {
                    Placement {
                        slot,
                        keep: n,
                        copy: None,
                    }
                } else {
                    Placement {
                        slot,
                        keep: n,
                        copy: Some((src, n)),
                    }
                }
            }
            _ if own_keep > 0 || lossless => Placement {
                slot: own_slot,
                keep: own_keep,
                copy: None,
            },
            _ => Placement {
                slot: self.free[self.victim()],
                keep: 0,
                copy: None,
            },
        };
        let i = self.free.iter().position(|&s| s == placement.slot)?;
        self.free.remove(i);
        self.held[placement.slot].tokens.clear();
        Some(placement)
    }

    /// The free slot a request with nothing to reuse takes: the last freed empty one, else the
    /// least recently used (index into `free`; the pool is not empty).
    fn victim(&self) -> usize {
        if let Some(i) = (0..self.free.len())
            .rev()
            .find(|&i| self.held[self.free[i]].tokens.is_empty())
        {
            return i;
        }
        (0..self.free.len())
            .min_by_key(|&i| self.held[self.free[i]].used)
            .unwrap_or(0)
    }

    /// The longest prefix of `prompt` (at most `prompt.len() - 1` tokens) that a free slot's
    /// cache holds.
    pub fn longest_prefix(&self, prompt: &[u32]) -> usize {
        let limit = prompt.len().saturating_sub(1);
        self.free
            .iter()
            .map(|&s| common_prefix(&self.held[s].tokens, prompt).min(limit))
            .max()
            .unwrap_or(0)
    }

    /// Tokens the free slots' caches hold in all (the memory idle slots keep).
    pub fn held_tokens(&self) -> usize {
        self.free.iter().map(|&s| self.held[s].tokens.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_kept_without_reuse() {
        let mut p = SlotPool::new(2);
        p.put(0, vec![1, 2, 3], None);
        let t = p.take(&[1, 2, 3, 4], None, false, true, &[]).unwrap();
        assert_eq!((t.keep, t.copy), (0, None));
    }

    #[test]
    fn a_new_turn_lands_in_its_slot_and_others_evict_the_least_recently_used() {
        let mut p = SlotPool::new(3);
        for _ in 0..3 {
            assert!(p.take(&[9, 9], None, true, false, &[]).is_some());
        }
        assert!(p.is_empty());
        p.put(1, vec![1, 2, 3], Some(7));
        p.put(0, vec![5, 6], None);
        p.put(2, vec![8], None);
        // The next turn of conversation 7 lands in slot 1 and keeps its prefix.
        let t = p.take(&[1, 2, 3, 4, 5], Some(7), true, false, &[]).unwrap();
        assert_eq!(
            t,
            Placement {
                slot: 1,
                keep: 3,
                copy: None
            }
        );
        // Nothing in common: the least recently used slot (0) is evicted.
        let t = p.take(&[4, 4], None, true, false, &[]).unwrap();
        assert_eq!(
            t,
            Placement {
                slot: 0,
                keep: 0,
                copy: None
            }
        );
        // A whole cached prompt keeps all but its last token.
        p.put(0, vec![3, 3, 3], None);
        let t = p.take(&[3, 3, 3], None, true, false, &[]).unwrap();
        assert_eq!((t.slot, t.keep), (0, 2));
    }

    #[test]
    fn a_shared_prefix_is_copied_into_another_slot() {
        let mut p = SlotPool::new(3);
        for _ in 0..3 {
            p.take(&[0, 0], None, true, true, &[]);
        }
        let sys: Vec<u32> = (0..20).collect();
        let with = |tail: &[u32]| [&sys[..], tail].concat();
        p.put(0, with(&[30, 31]), Some(1));
        p.put(2, Vec::new(), None);
        // The system prompt lives in slot 0 (another conversation): copied into the empty
        // slot 2, slot 0 keeps its cache.
        let t = p.take(&with(&[40, 41]), Some(2), true, true, &[]).unwrap();
        let copied = |slot, keep, src| Placement {
            slot,
            keep,
            copy: Some((src, keep)),
        };
        assert_eq!(t, copied(2, 20, 0));
        // From a busy slot too; without copy support the free slot's prefix is kept instead.
        let busy_tokens = with(&[40]);
        let busy: &[(usize, &[u32])] = &[(2, &busy_tokens)];
        let mut q = p.clone();
        let t = p.take(&with(&[40, 5]), None, true, true, busy).unwrap();
        assert_eq!(t, copied(0, 21, 2));
        let t = q.take(&with(&[40, 5]), None, true, false, busy).unwrap();
        assert_eq!((t.slot, t.keep, t.copy), (0, 20, None));
        // A short prefix in common by chance is not shared.
        let mut r = SlotPool::new(1);
        r.take(&[0, 0], None, true, true, &[]);
        r.put(0, vec![1, 2, 3, 4], None);
        let t = r.take(&[1, 2, 9, 9], None, true, true, &[]).unwrap();
        assert_eq!((t.keep, t.copy), (0, None));
    }
}
