//! What a verify step returns: [`StepOutput`] with its [`StepEnd`], the emitted tokens'
//! [`TokenLogprob`]s and the per-row [`RowCandidates`].

#[cfg(doc)]
use super::{Verifier, VerifyRequest};
#[cfg(doc)]
use crate::sampling::SamplingConfig;

/// Why a verify step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StepEnd {
    /// The drafts at depth `index + 1` were rejected (for a chain: draft `index`, 0-based; for
    /// a tree: every child of the last accepted node, or of the root); the last emitted token is
    /// the correction sampled from the residual (or the target argmax in greedy mode).
    /// `index == accepted`.
    Rejected {
        /// Number of accepted drafts before the rejection: the index of the rejected draft in a
        /// chain, the depth at which a tree walk stopped.
        index: usize,
    },
    /// The walk reached a leaf: for a chain all `k >= 1` drafts were accepted; the last emitted
    /// token is the bonus token from the leaf's row (row `k` for a chain).
    AllAccepted,
    /// The last accepted draft ends the sequence (a node marked as ending,
    /// [`crate::DraftBlock::with_ends`]): no bonus token, `tokens.len() == accepted`.
    Ended,
    /// A no-draft step (`k = 0`, plain decoding): the one emitted token comes from row 0.
    NoDraft,
}

/// Log-probabilities of one emitted token.
///
/// The verifier builds them; [`TokenLogprob::new`] builds one elsewhere (a reference
/// implementation in a test). `#[non_exhaustive]`: the fields are public to read.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TokenLogprob {
    /// The emitted token.
    pub token: u32,
    /// Natural log-probability of `token` under the processed target row. For greedy rows (a
    /// point mass) it is taken under the softmax at temperature 1 of the logits after penalties,
    /// bias and masks, which is what users expect to see.
    pub logprob: f32,
    /// The most likely tokens of the same distribution, most likely first, as
    /// `(token, logprob)`; as many as [`SamplingConfig::logprobs`] asked for.
    pub top: Vec<(u32, f32)>,
}

/// The result of one verify step for one sequence.
///
/// The verifier builds it; [`StepOutput::new`] and the `with_` setters build one elsewhere (a
/// reference implementation in a test, an engine's own verifier). `#[non_exhaustive]`: the
/// fields are public to read.
///
/// `StepOutput` is `Send + Sync`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StepOutput {
    /// Number of accepted draft tokens (the leading run of a chain, the path length of a tree;
    /// the bonus token is not counted).
    pub accepted: usize,
    /// Emitted tokens: the accepted drafts (a tree's path) followed by one correction or bonus
    /// token, so `tokens.len() == accepted + 1`, except after [`StepEnd::Ended`] (an accepted
    /// draft that ends the sequence), where `tokens.len() == accepted`.
    pub tokens: Vec<u32>,
    /// Per emitted token, when the configuration asked for log-probabilities.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// Why the step ended.
    pub end: StepEnd,
    /// Node indices of the accepted drafts, the root's child first (`[accepted]`): for a chain
    /// `0..accepted`; for a tree the accepted path, which a target with tree support keeps
    /// ([`crate::TreeTarget::commit_tree`]).
    pub path: Vec<u32>,
    /// The best tokens of every target row of the step, when the request asked for them
    /// ([`crate::SequenceState::row_top_k`]); empty otherwise. Only [`Verifier::verify`] computes
    /// them: batch verification ([`Verifier::verify_batch`], the GPU verifiers) has no
    /// `row_top_k` and always leaves this empty; an engine that batches and feeds a proposer
    /// such as [`crate::propose::TokenRecycling`] verifies that sequence with
    /// [`Verifier::verify`] and [`VerifyRequest::row_top_k`].
    pub row_top: RowCandidates,
}

impl TokenLogprob {
    /// The log-probability `logprob` of `token` with the `top` most likely `(token, logprob)`
    /// pairs of the same row, most likely first.
    pub fn new(token: u32, logprob: f32, top: Vec<(u32, f32)>) -> Self {
        TokenLogprob {
            token,
            logprob,
            top,
        }
    }
}

impl StepOutput {
    /// A step that accepted `accepted` drafts of a chain and emitted `tokens`, ending with
    /// `end`: path `0..accepted`, no log-probabilities, no row candidates.
    pub fn new(accepted: usize, tokens: Vec<u32>, end: StepEnd) -> Self {
        StepOutput {
            accepted,
            tokens,
            logprobs: None,
            end,
            path: (0..accepted as u32).collect(),
            row_top: RowCandidates::default(),
        }
    }

    /// Sets the accepted path of a tree ([`StepOutput::path`], `[accepted]`).
    pub fn with_path(mut self, path: Vec<u32>) -> Self {
        self.path = path;
        self
    }

    /// Sets the log-probabilities of the emitted tokens ([`StepOutput::logprobs`]).
    pub fn with_logprobs(mut self, logprobs: Vec<TokenLogprob>) -> Self {
        self.logprobs = Some(logprobs);
        self
    }

    /// Sets the row candidates ([`StepOutput::row_top`]).
    pub fn with_row_top(mut self, row_top: RowCandidates) -> Self {
        self.row_top = row_top;
        self
    }
}

/// The best tokens of each target row of one verify step: row 0 is the root's (its input is
/// the last committed token), row `j + 1` node `j`'s (its input is draft token `j`), so a
/// step has `k + 1` rows (`k` when the final draft of a chain ends the sequence, whose row is
/// never computed).
///
/// Each row lists up to [`crate::SequenceState::row_top_k`] ids, best first, ranked by the row's
/// processed logits (the request's penalties, bias and masks along the row's own path;
/// [`crate::sampling::RowProcessor::top_ids`]): every row is processed, not only those of the
/// accepted path, so the rows of rejected nodes carry information too. A row lists fewer ids
/// when fewer tokens are allowed, and none when its mask allows none (a row off the accepted
/// path only: a row on it fails the step).
///
/// Layout: the ids of all rows in one buffer with row offsets (`[rows + 1]`), so a step
/// allocates nothing once the buffers have grown. Token Recycling (Luo et al. 2024) reads these
/// rows as "successors of the row's input token" ([`crate::Proposer::observe_rows`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowCandidates {
    ids: Vec<u32>,
    offsets: Vec<u32>,
}

impl RowCandidates {
    /// Number of rows (0 when none were asked for).
    pub fn rows(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// `true` when no row is held.
    pub fn is_empty(&self) -> bool {
        self.rows() == 0
    }

    /// The ids of row `r`, best first (empty for `r >= rows()`).
    pub fn row(&self, r: usize) -> &[u32] {
        match (self.offsets.get(r), self.offsets.get(r + 1)) {
            (Some(&a), Some(&b)) => &self.ids[a as usize..b as usize],
            _ => &[],
        }
    }

    /// Every row, row 0 first.
    pub fn iter(&self) -> impl Iterator<Item = &[u32]> + '_ {
        (0..self.rows()).map(|r| self.row(r))
    }

    /// Removes every row, keeping the allocations.
    pub fn clear(&mut self) {
        self.ids.clear();
        self.offsets.clear();
    }

    /// Appends one row (its ids, best first).
    pub fn push_row(&mut self, ids: &[u32]) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        self.ids.extend_from_slice(ids);
        self.offsets.push(self.ids.len() as u32);
    }
}

/// Number of accepted drafts given per-position acceptance flags: the length of the leading run
/// of `true`, never the count of `true` (case C06).
pub fn leading_accepted(flags: &[bool]) -> usize {
    flags.iter().take_while(|&&f| f).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c06_accepted_is_the_leading_run() {
        let flags = [[true, false, true], [true, true, true]];
        let accepted: Vec<usize> = flags.iter().map(|f| leading_accepted(f)).collect();
        assert_eq!(accepted, vec![1, 3]);
        let emitted: Vec<usize> = accepted.iter().map(|a| a + 1).collect();
        assert_eq!(emitted, vec![2, 4]);
    }
}
