//! The history a row of a draft block is processed with: the committed context plus the tokens
//! of the path that leads to the row (a node's ancestors), with push / pop.

use super::{History, SamplingConfig, TokenCounts};
use crate::error::Result;

/// Penalty counts, mask prefix and suppressed tokens for the rows of one draft block.
///
/// A row of a block (a target row of the verifier, or the draft row a sampling proposer draws
/// from) follows the committed context and the tokens of its path: for a chain the earlier
/// drafts, for a tree the ancestors of the node it follows (see [`crate::tree`]). The history
/// starts at the context ([`BlockHistory::begin`]), grows by one token per step down the block
/// ([`BlockHistory::push`]) and shrinks back ([`BlockHistory::pop`], [`BlockHistory::goto`]) to
/// move to another branch, so that the penalties and masks of a node see its ancestors only,
/// never its siblings' branches. The tokens on the path count as generated tokens for the
/// frequency and presence penalties (case C12).
///
/// Suppressed tokens (`min_tokens`) apply at depths `0..suppress_rows`: the depth is the number
/// of tokens pushed, i.e. the number of tokens generated in the block before the row.
#[derive(Debug, Default, Clone)]
pub(crate) struct BlockHistory {
    counts: Option<TokenCounts>,
    use_prefix: bool,
    /// The context (when the caller's mask needs it) followed by the path's tokens.
    prefix: Vec<u32>,
    /// The path's tokens (what [`BlockHistory::pop`] takes back).
    path: Vec<u32>,
    suppress: Vec<u32>,
    suppress_rows: usize,
    vocab: usize,
}

impl BlockHistory {
    /// Starts a block after `context` (whose first `prompt_len` tokens are the prompt), over a
    /// vocabulary of `vocab` tokens, with `suppress` banned at depths `0..suppress_rows`.
    ///
    /// # Errors
    /// [`crate::Error::TokenOutOfVocab`] when the penalties are on and a context token is
    /// `>= vocab`.
    pub(crate) fn begin(
        &mut self,
        cfg: &SamplingConfig,
        context: &[u32],
        prompt_len: usize,
        vocab: usize,
        suppress: impl IntoIterator<Item = u32>,
        suppress_rows: usize,
    ) -> Result<()> {
        self.counts = if cfg.has_penalties() {
            Some(TokenCounts::from_context(context, prompt_len, vocab)?)
        } else {
            None
        };
        self.use_prefix = cfg.mask().is_some();
        self.prefix.clear();
        if self.use_prefix {
            self.prefix.extend_from_slice(context);
        }
        self.path.clear();
        self.suppress.clear();
        self.suppress.extend(suppress);
        self.suppress_rows = suppress_rows;
        self.vocab = vocab;
        Ok(())
    }

    /// Steps down the block: `token` (an accepted or drawn draft) joins the history.
    ///
    /// # Errors
    /// [`crate::Error::TokenOutOfVocab`] when the penalties are on and `token >= vocab`.
    pub(crate) fn push(&mut self, token: u32) -> Result<()> {
        if let Some(c) = self.counts.as_mut() {
            c.add(token, self.vocab)?;
        }
        if self.use_prefix {
            self.prefix.push(token);
        }
        self.path.push(token);
        Ok(())
    }

    /// Steps back up: the last pushed token leaves the history (nothing when none is left).
    pub(crate) fn pop(&mut self) {
        let Some(t) = self.path.pop() else {
            return;
        };
        if let Some(c) = self.counts.as_mut() {
            c.remove(t);
        }
        if self.use_prefix {
            self.prefix.pop();
        }
    }

    /// Moves to the row that follows `path` (the tokens from the root's child down): pops back
    /// to the longest common prefix with the current path and pushes the rest. The history
    /// depends only on the tokens, so this equals [`BlockHistory::begin`] followed by pushing
    /// `path`.
    ///
    /// # Errors
    /// As [`BlockHistory::push`].
    pub(crate) fn goto(&mut self, path: &[u32]) -> Result<()> {
        let common = self
            .path
            .iter()
            .zip(path)
            .take_while(|(a, b)| a == b)
            .count();
        while self.path.len() > common {
            self.pop();
        }
        for &t in &path[common..] {
            self.push(t)?;
        }
        Ok(())
    }

    /// Number of tokens pushed (the depth of the row in the block).
    pub(crate) fn depth(&self) -> usize {
        self.path.len()
    }

    /// What the current row's processing sees.
    pub(crate) fn view(&self) -> History<'_> {
        History {
            counts: self.counts.as_ref(),
            prefix: &self.prefix,
            suppress: if self.depth() < self.suppress_rows {
                &self.suppress
            } else {
                &[]
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::TokenMask;

    fn counts(h: &BlockHistory) -> Vec<(u32, u32, u32)> {
        let mut v: Vec<_> = h.view().counts.unwrap().iter().collect();
        v.sort();
        v
    }

    #[test]
    fn push_pop_and_goto_equal_a_fresh_history() {
        let mask: std::sync::Arc<dyn TokenMask> =
            std::sync::Arc::new(|_prefix: &[u32], _logits: &mut [f32]| {});
        let cfg = SamplingConfig::builder()
            .frequency_penalty(0.5)
            .mask(mask)
            .build()
            .unwrap();
        let mut h = BlockHistory::default();
        h.begin(&cfg, &[1, 2, 3], 1, 10, [9], 2).unwrap();
        h.push(4).unwrap();
        h.push(2).unwrap();
        assert_eq!(h.depth(), 2);
        assert!(h.view().suppress.is_empty());
        h.goto(&[4, 5]).unwrap();
        let mut fresh = BlockHistory::default();
        fresh.begin(&cfg, &[1, 2, 3], 1, 10, [9], 2).unwrap();
        fresh.push(4).unwrap();
        fresh.push(5).unwrap();
        assert_eq!(counts(&h), counts(&fresh));
        assert_eq!(h.view().prefix, fresh.view().prefix);
        assert_eq!(h.view().prefix, &[1, 2, 3, 4, 5]);
        h.goto(&[]).unwrap();
        assert_eq!(h.depth(), 0);
        assert_eq!(h.view().suppress, &[9]);
        assert_eq!(counts(&h), vec![(1, 1, 0), (2, 0, 1), (3, 0, 1)]);
        h.pop();
        assert_eq!(h.depth(), 0);
    }
}
