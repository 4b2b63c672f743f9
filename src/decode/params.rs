//! Parameters of one generation request.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::policy::DraftLength;
use super::stop::StopConditions;
use crate::error::{Error, Result};
use crate::sampling::SamplingConfig;

/// Parameters of one generation request.
///
/// The [`Default`] is valid: greedy sampling, no seed (a fresh one per request), at most 256
/// new tokens, no `min_tokens`,
/// no stop condition, a fixed draft length of 4 ([`DraftLength::default`]), no cancel flag.
/// Every field is validated by [`Generator::session`](super::Generator::session) before the target runs.
#[derive(Debug, Clone)]
pub struct GenerationParams {
    /// Sampling configuration, used by the verifier and by sampling proposers alike.
    pub sampling: SamplingConfig,
    /// Seed of the request's random stream ([`crate::rng::Stream`]). With point-mass proposers
    /// (prompt lookup, suffix) the same seed gives the same tokens whatever the proposer, the
    /// draft length, the policy and the batch, and the same tokens as plain sampling (case C15).
    ///
    /// `None` (the default, and `"seed": null` in configs) draws a fresh seed for each request
    /// from the generator's [`SeedSource`](super::SeedSource) (the OS by default), so two
    /// requests without a seed are independent (case C20); the seed used is reported in
    /// [`Generation::seed`](super::Generation::seed).
    pub seed: Option<u64>,
    /// Maximum number of new tokens (the token budget). Default 256.
    pub max_new_tokens: usize,
    /// Minimum number of new tokens before the generation may stop: the first `min_tokens`
    /// tokens are never an EOS id or a single-token stop sequence (banned at every target and
    /// draft row), and a stop sequence or stop string ends the generation only when it completes
    /// at token `min_tokens` or later (vLLM's `min_tokens`; rule 1 of [`crate::decode`]'s stop
    /// rules). Must not exceed `max_new_tokens`. Default 0.
    pub min_tokens: usize,
    /// Stop conditions (EOS ids, stop sequences, stop strings). Default: none.
    pub stop: StopConditions,
    /// Draft length policy for this request (per-request override or opt-out). With tree drafts
    /// a fixed length sets the depth of the tree; [`DraftLength::Adaptive`] chooses each step's
    /// node budget, depth and branching (the cost-aware tree-shape policy,
    /// [`AdaptiveConfig`](super::AdaptiveConfig)).
    pub draft: DraftLength,
    /// Node budget of tree drafts; 0 (the default) verifies chains. With `n > 0`, a step whose
    /// target offers tree support ([`TargetModel::tree`](crate::TargetModel::tree)) asks the proposer for a token tree
    /// ([`Proposer::propose_tree`](crate::Proposer::propose_tree)) of at most `n` nodes (also capped by the target's
    /// [`TreeTarget::max_tree_nodes`](crate::TreeTarget::max_tree_nodes) and the context room)
    /// and depth at most the step's draft length, and verifies every branch in one forward. A
    /// target without tree support verifies chains (the proposer's `propose`), as with 0.
    ///
    /// The shipped proposers branch only when `n` exceeds the draft length (with `n <= k` they
    /// return a chain of `n` tokens), so give `n` above the [`DraftLength`]'s `k`: for example
    /// `Fixed(8)` with 16 or 32 nodes. With [`DraftLength::Adaptive`] `n` is the largest node
    /// budget: each step the policy asks for the tree (node count, depth, children per node,
    /// within `n`, [`GenerationParams::tree_branch`], `max_draft`, the token budget and the
    /// context room) that maximises expected tokens per second from acceptance by depth and
    /// sibling rank and the measured forward cost by rows, a chain when siblings do not pay and
    /// plain decoding when nothing does ([`AdaptiveState::choose_tree`](super::AdaptiveState::choose_tree)).
    pub tree_nodes: usize,
    /// Branching limit of tree drafts: at most this many children per node, the root included
    /// ([`ProposeRequest::max_branch`](crate::ProposeRequest::max_branch)); 0 (the default)
    /// leaves the shape to the proposer. With 1 a tree is a chain.
    pub tree_branch: usize,
    /// Set to `true` from any thread to cancel; checked before each step.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Default for GenerationParams {
    /// Greedy sampling ([`SamplingConfig::greedy`]), no seed, `max_new_tokens` 256,
    /// `min_tokens` 0, no stop condition, draft length `Fixed(4)`, chains (`tree_nodes` 0), no
    /// cancel flag.
    fn default() -> Self {
        GenerationParams {
            sampling: SamplingConfig::greedy(),
            seed: None,
            max_new_tokens: 256,
            min_tokens: 0,
            stop: StopConditions::default(),
            draft: DraftLength::default(),
            tree_nodes: 0,
            tree_branch: 0,
            cancel: None,
        }
    }
}

impl PartialEq for GenerationParams {
    /// Field by field ([`SamplingConfig`]'s equality); two cancel flags are equal when they are
    /// the same `Arc` ([`Arc::ptr_eq`]).
    fn eq(&self, other: &Self) -> bool {
        let cancel = match (&self.cancel, &other.cancel) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        cancel
            && self.sampling == other.sampling
            && self.seed == other.seed
            && self.max_new_tokens == other.max_new_tokens
            && self.min_tokens == other.min_tokens
            && self.stop == other.stop
            && self.draft == other.draft
            && self.tree_nodes == other.tree_nodes
            && self.tree_branch == other.tree_branch
    }
}

impl GenerationParams {
    /// Greedy decoding of at most `max_new_tokens`, fixed draft length 4, no stop condition.
    pub fn greedy(max_new_tokens: usize) -> Self {
        GenerationParams {
            max_new_tokens,
            ..Default::default()
        }
    }

    /// Sampling with `sampling` and `seed`, at most `max_new_tokens`, fixed draft length 4.
    pub fn sampled(sampling: SamplingConfig, seed: u64, max_new_tokens: usize) -> Self {
        GenerationParams {
            sampling,
            seed: Some(seed),
            max_new_tokens,
            ..Default::default()
        }
    }

    /// Sets the seed ([`GenerationParams::seed`]).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Replaces the stop conditions (the token budget is kept).
    pub fn with_stop(mut self, stop: StopConditions) -> Self {
        self.stop = stop;
        self
    }

    /// Sets the draft length policy.
    pub fn with_draft(mut self, draft: DraftLength) -> Self {
        self.draft = draft;
        self
    }

    /// Sets the node budget of tree drafts ([`GenerationParams::tree_nodes`]; 0 = chains).
    pub fn with_tree_nodes(mut self, nodes: usize) -> Self {
        self.tree_nodes = nodes;
        self
    }

    /// Sets the branching limit of tree drafts ([`GenerationParams::tree_branch`]; 0 = none).
    pub fn with_tree_branch(mut self, children: usize) -> Self {
        self.tree_branch = children;
        self
    }

    /// Sets `min_tokens`.
    pub fn with_min_tokens(mut self, min_tokens: usize) -> Self {
        self.min_tokens = min_tokens;
        self
    }

    /// Checks the parameters against a vocabulary of `vocab` tokens.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] for a configuration, EOS or stop-sequence token outside the
    /// vocabulary; [`Error::InvalidConfig`] for `min_tokens > max_new_tokens`, an empty stop
    /// string or stop sequence, stop strings without a detokenizer (`has_detokenizer`), or an invalid adaptive
    /// configuration.
    pub fn validate(&self, vocab: usize, has_detokenizer: bool) -> Result<()> {
        self.sampling.check_vocab(vocab)?;
        let stop_tokens = self
            .stop
            .eos
            .iter()
            .chain(self.stop.stop_sequences.iter().flatten());
        if let Some(&t) = stop_tokens.into_iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::TokenOutOfVocab {
                what: "EOS or stop-sequence token",
                token: t,
                vocab_size: vocab,
            });
        }
        if self.min_tokens > self.max_new_tokens {
            return Err(Error::config(
                "min_tokens",
                self.min_tokens,
                "must not exceed max_new_tokens",
            ));
        }
        if self.stop.stop_strings.iter().any(String::is_empty) {
            return Err(Error::config(
                "stop.stop_strings",
                "\"\"",
                "stop strings must not be empty",
            ));
        }
        if self.stop.stop_sequences.iter().any(Vec::is_empty) {
            return Err(Error::config(
                "stop.stop_sequences",
                "[]",
                "stop sequences must not be empty",
            ));
        }
        if !self.stop.stop_strings.is_empty() && !has_detokenizer {
            return Err(Error::config(
                "stop.stop_strings",
                self.stop.stop_strings.len(),
                "stop strings need a Detokenizer (Generator::with_detokenizer)",
            ));
        }
        if let DraftLength::Adaptive(a) = &self.draft {
            a.validate()?;
        }
        Ok(())
    }
}
