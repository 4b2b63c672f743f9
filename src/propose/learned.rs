//! [`Learned`]: what a proposer learned online that outlives a request, handed from one
//! proposer to a new one of the same configuration ([`super::Proposer::learned`],
//! [`super::Proposer::start_from_learned`]).

use super::merged::MergeMemory;

/// What a proposer learned online that outlives a request, to start a new proposer of the
/// same configuration from. For a [`super::MergedProposer`]: its members' acceptance rates by
/// depth and marginal gains (what it learned from the text), each member's seconds and tokens
/// per draft call, the target's step seconds by verify rows, and the probe budget's state (the
/// seconds of steps since each member's last call, its probe backoff): everything a
/// long-lived merge keeps from one generation to the next, so that a merge started from it
/// behaves as one long-lived merge would.
///
/// A server that builds a proposer per request (the batch loop takes one per
/// [`crate::decode::BatchRequest`]) otherwise pays, on every request, the first call of each
/// member the merge has not timed yet: for a draft model, a catch-up forward over the whole
/// prompt (SmolLM2-135M drafting for Gemma 3 270M on a 2-core machine: 0.13-0.18 s, about five
/// target steps), even when that member never pays on this engine; and with the step costs
/// alone, a fresh merge's rates at the prior would not pay for the verify rows of a dear engine
/// until it relearned them. The adaptive draft length policy's counterpart is
/// [`crate::decode::AdaptiveState::costs_only`].
///
/// Opaque: get one from [`super::Proposer::learned`]; clone it freely (its size is
/// `O(members * depths + verify row counts seen)`, a few kilobytes).
#[derive(Debug, Clone)]
pub struct Learned {
    pub(super) kind: Kind,
}

/// Whose memory a [`Learned`] holds.
#[derive(Debug, Clone)]
pub(super) enum Kind {
    /// A merge's.
    Merge(Box<MergeMemory>),
}

impl Learned {
    /// How many members the proposer that learned it merged (`None`: not a merge). `O(1)`.
    pub fn members(&self) -> Option<usize> {
        match &self.kind {
            Kind::Merge(m) => Some(m.members()),
        }
    }
}
