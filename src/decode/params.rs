//! Parameters of one generation request: [`GenerationParams`], its validated builder, and the
//! tree-draft setting [`TreeDrafts`].

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::policy::DraftLength;
use super::stop::StopConditions;
use crate::error::{Error, Result};
use crate::sampling::SamplingConfig;

/// Tree drafts of one request: off (chains, the default), or token trees of a node budget and a
/// branching limit.
///
/// With [`TreeDrafts::Tree`], a step whose target offers tree support
/// ([`TargetModel::tree`](crate::TargetModel::tree)) asks the proposer for a token tree
/// ([`Proposer::propose_tree`](crate::Proposer::propose_tree)) of at most `nodes` nodes (also
/// capped by the target's [`TreeTarget::max_tree_nodes`](crate::TreeTarget::max_tree_nodes)
/// and the context room), at most `branch` children per node (the root included,
/// [`ProposeRequest::max_branch`](crate::ProposeRequest::max_branch); `None` leaves the shape
/// to the proposer, 1 makes every tree a chain), and verifies every branch in one forward. A
/// target without tree support verifies chains (the proposer's `propose`), as with
/// [`TreeDrafts::Off`].
///
/// The depth of a tree is the request's [`DraftLength`]: a fixed `k` is the largest depth, and
/// the shipped proposers branch only when `nodes` exceeds it (with `nodes <= k` they return a
/// chain of `nodes` tokens), so give `nodes` above `k`: for example `Fixed(8)` with 16 or 32
/// nodes. With [`DraftLength::Adaptive`] `nodes` is the largest node budget: each step the
/// policy picks the tree (node count, depth, children per node, within `nodes`, `branch`,
/// `max_draft`, the token budget and the context room) that maximises expected tokens per
/// second, a chain when siblings do not pay and plain decoding when nothing does
/// ([`AdaptiveState::choose_tree`](super::AdaptiveState::choose_tree)).
///
/// In configs (`serde` feature) this is the pair `tree_nodes` (0 = off) and `tree_branch`
/// (0 = no limit), read with [`TreeDrafts::nodes`] and [`TreeDrafts::with_branch`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TreeDrafts {
    /// Chains: every step verifies one chain of draft tokens (the default).
    #[default]
    Off,
    /// Token trees of at most `nodes` nodes and at most `branch` children per node. Build it
    /// with [`TreeDrafts::nodes`] (and [`TreeDrafts::with_branch`]).
    #[non_exhaustive]
    Tree {
        /// Node budget per step (the root, the last committed token, not counted).
        nodes: NonZeroUsize,
        /// Most children per node, the root included; `None`: the proposer's choice.
        branch: Option<NonZeroUsize>,
    },
}

impl TreeDrafts {
    /// Token trees of at most `nodes` nodes, no branching limit; `nodes(0)` is
    /// [`TreeDrafts::Off`] (as `tree_nodes: 0` is in configs).
    pub fn nodes(nodes: usize) -> Self {
        NonZeroUsize::new(nodes).map_or(TreeDrafts::Off, |nodes| TreeDrafts::Tree {
            nodes,
            branch: None,
        })
    }

    /// At most `children` children per node (0 = no limit, 1 = chains). On
    /// [`TreeDrafts::Off`] it changes nothing: there is no tree to limit.
    pub fn with_branch(self, children: usize) -> Self {
        match self {
            TreeDrafts::Off => TreeDrafts::Off,
            TreeDrafts::Tree { nodes, .. } => TreeDrafts::Tree {
                nodes,
                branch: NonZeroUsize::new(children),
            },
        }
    }

    /// `true` for [`TreeDrafts::Tree`].
    pub fn is_on(&self) -> bool {
        matches!(self, TreeDrafts::Tree { .. })
    }

    /// The node budget; 0 when off.
    pub fn node_budget(&self) -> usize {
        match self {
            TreeDrafts::Off => 0,
            TreeDrafts::Tree { nodes, .. } => nodes.get(),
        }
    }

    /// The branching limit; 0 when off or without a limit.
    pub fn branch(&self) -> usize {
        match self {
            TreeDrafts::Tree {
                branch: Some(b), ..
            } => b.get(),
            _ => 0,
        }
    }
}

/// Parameters of one generation request.
///
/// Build it with [`GenerationParams::builder`] (whose [`build`](GenerationParamsBuilder::build)
/// checks every field once, as [`SamplingConfig`]'s does) or the shortcuts
/// [`GenerationParams::greedy`] and [`GenerationParams::sampled`]; change one with
/// [`GenerationParams::to_builder`], the checked setters
/// [`with_stop`](GenerationParams::with_stop) and
/// [`with_min_tokens`](GenerationParams::with_min_tokens) (which return `Result`), or the
/// setters [`with_seed`](GenerationParams::with_seed),
/// [`with_draft`](GenerationParams::with_draft) (whose adaptive configuration, the one value
/// they can get wrong, is checked when the generation starts),
/// [`with_tree`](GenerationParams::with_tree) and [`with_cancel`](GenerationParams::with_cancel).
/// The fields are read through the methods of the same name.
///
/// | field | default | meaning |
/// |---|---|---|
/// | `sampling` | [`SamplingConfig::greedy`] | used by the verifier and by sampling proposers alike |
/// | `seed` | `None` | seed of the request's random stream; `None` draws a fresh one |
/// | `max_new_tokens` | 256 | the token budget |
/// | `min_tokens` | 0 | no stop before this many new tokens; `<= max_new_tokens` |
/// | `stop` | none | EOS ids, stop sequences (none empty), stop strings (none empty) |
/// | `draft` | `Fixed(4)` | draft length policy ([`DraftLength`]) |
/// | `tree` | [`TreeDrafts::Off`] | chains or token trees |
/// | `cancel` | none | a flag that cancels the generation when set |
///
/// What only the target knows is checked when the generation starts
/// ([`GenerationParams::validate`]): token ids against its vocabulary, and stop strings against
/// the generator's [`Detokenizer`](super::Detokenizer).
#[derive(Debug, Clone)]
pub struct GenerationParams {
    pub(crate) sampling: SamplingConfig,
    pub(crate) seed: Option<u64>,
    pub(crate) max_new_tokens: usize,
    pub(crate) min_tokens: usize,
    pub(crate) stop: StopConditions,
    pub(crate) draft: DraftLength,
    pub(crate) tree: TreeDrafts,
    pub(crate) cancel: Option<Arc<AtomicBool>>,
}

impl Default for GenerationParams {
    /// The table of [`GenerationParams`]: greedy sampling, no seed, `max_new_tokens` 256,
    /// `min_tokens` 0, no stop condition, draft length `Fixed(4)`, chains, no cancel flag.
    fn default() -> Self {
        GenerationParams {
            sampling: SamplingConfig::greedy(),
            seed: None,
            max_new_tokens: 256,
            min_tokens: 0,
            stop: StopConditions::default(),
            draft: DraftLength::default(),
            tree: TreeDrafts::Off,
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
            && self.tree == other.tree
    }
}

impl GenerationParams {
    /// Starts a builder from [`GenerationParams::default`].
    pub fn builder() -> GenerationParamsBuilder {
        GenerationParamsBuilder {
            params: GenerationParams::default(),
        }
    }

    /// Turns these parameters back into a builder, to change a field.
    pub fn to_builder(&self) -> GenerationParamsBuilder {
        GenerationParamsBuilder {
            params: self.clone(),
        }
    }

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

    /// Sets the draft length policy ([`GenerationParams::draft`]). An adaptive configuration
    /// is checked ([`AdaptiveConfig::validate`](super::AdaptiveConfig::validate)) when the
    /// generation starts; [`GenerationParamsBuilder::draft`] checks it at `build`.
    pub fn with_draft(mut self, draft: DraftLength) -> Self {
        self.draft = draft;
        self
    }

    /// Replaces the stop conditions (the token budget is kept), checked as
    /// [`GenerationParamsBuilder::build`] checks them.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an empty stop string or stop sequence.
    pub fn with_stop(self, stop: StopConditions) -> Result<Self> {
        self.to_builder().stop(stop).build()
    }

    /// Sets `min_tokens` ([`GenerationParams::min_tokens`]).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `min_tokens` exceeds `max_new_tokens`.
    pub fn with_min_tokens(self, min_tokens: usize) -> Result<Self> {
        self.to_builder().min_tokens(min_tokens).build()
    }

    /// Sets the tree drafts ([`GenerationParams::tree`]).
    pub fn with_tree(mut self, tree: TreeDrafts) -> Self {
        self.tree = tree;
        self
    }

    /// Sets the cancel flag ([`GenerationParams::cancel`]).
    pub fn with_cancel(mut self, flag: Arc<AtomicBool>) -> Self {
        self.cancel = Some(flag);
        self
    }

    /// Sampling configuration, used by the verifier and by sampling proposers alike.
    pub fn sampling(&self) -> &SamplingConfig {
        &self.sampling
    }

    /// Seed of the request's random stream ([`crate::rng::Stream`]). With point-mass proposers
    /// (prompt lookup, suffix) the same seed gives the same tokens whatever the proposer, the
    /// draft length, the policy and the batch, and the same tokens as plain sampling (case C15).
    ///
    /// `None` (the default, and `"seed": null` in configs) draws a fresh seed for each request
    /// from the generator's [`SeedSource`](super::SeedSource) (the OS by default), so two
    /// requests without a seed are independent (case C20); the seed used is reported in
    /// [`Generation::seed`](super::Generation::seed).
    pub fn seed(&self) -> Option<u64> {
        self.seed
    }

    /// Maximum number of new tokens (the token budget). Default 256.
    pub fn max_new_tokens(&self) -> usize {
        self.max_new_tokens
    }

    /// Minimum number of new tokens before the generation may stop: the first `min_tokens`
    /// tokens are never an EOS id or a single-token stop sequence (banned at every target and
    /// draft row), and a stop sequence or stop string ends the generation only when it completes
    /// at token `min_tokens` or later (vLLM's `min_tokens`; rule 1 of [`crate::decode`]'s stop
    /// rules). At most `max_new_tokens`. Default 0.
    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }

    /// Stop conditions (EOS ids, stop sequences, stop strings). Default: none.
    pub fn stop(&self) -> &StopConditions {
        &self.stop
    }

    /// Draft length policy for this request (per-request override or opt-out). With tree drafts
    /// a fixed length sets the depth of the tree; [`DraftLength::Adaptive`] chooses each step's
    /// node budget, depth and branching (the cost-aware tree-shape policy,
    /// [`AdaptiveConfig`](super::AdaptiveConfig)).
    pub fn draft(&self) -> &DraftLength {
        &self.draft
    }

    /// Tree drafts ([`TreeDrafts`]): off (chains, the default) or a node budget and branching
    /// limit.
    pub fn tree(&self) -> TreeDrafts {
        self.tree
    }

    /// The cancel flag: set it to `true` from any thread to cancel; checked before each step.
    pub fn cancel(&self) -> Option<&Arc<AtomicBool>> {
        self.cancel.as_ref()
    }

    /// Checks the parameters against a vocabulary of `vocab` tokens and the generator's
    /// detokenizer (`has_detokenizer`), and repeats [`GenerationParamsBuilder::build`]'s checks.
    /// [`Generator::session`](super::Generator::session) and
    /// [`BatchGenerator::submit`](super::BatchGenerator::submit) call it before the target runs.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] for a configuration, EOS or stop-sequence token outside the
    /// vocabulary; [`Error::InvalidConfig`] for stop strings without a detokenizer, or any
    /// error of [`GenerationParamsBuilder::build`].
    pub fn validate(&self, vocab: usize, has_detokenizer: bool) -> Result<()> {
        self.check()?;
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
        if !self.stop.stop_strings.is_empty() && !has_detokenizer {
            return Err(Error::config(
                "stop.stop_strings",
                self.stop.stop_strings.len(),
                "stop strings need a Detokenizer (Generator::with_detokenizer)",
            ));
        }
        Ok(())
    }

    /// The checks that need no target (the errors of [`GenerationParamsBuilder::build`]).
    fn check(&self) -> Result<()> {
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
        if let DraftLength::Adaptive(a) = &self.draft {
            a.validate()?;
        }
        Ok(())
    }
}

/// Builder for [`GenerationParams`]; [`GenerationParamsBuilder::build`] validates every field
/// once. Each setter's field is documented on the [`GenerationParams`] method of the same name.
#[derive(Debug, Clone)]
pub struct GenerationParamsBuilder {
    params: GenerationParams,
}

impl GenerationParamsBuilder {
    /// The sampling configuration (already validated by its own builder).
    pub fn sampling(mut self, sampling: SamplingConfig) -> Self {
        self.params.sampling = sampling;
        self
    }
    /// The seed: a `u64`, or `None` for a fresh seed per request.
    pub fn seed(mut self, seed: impl Into<Option<u64>>) -> Self {
        self.params.seed = seed.into();
        self
    }
    /// The token budget.
    pub fn max_new_tokens(mut self, n: usize) -> Self {
        self.params.max_new_tokens = n;
        self
    }
    /// The stop floor (at most `max_new_tokens`).
    pub fn min_tokens(mut self, n: usize) -> Self {
        self.params.min_tokens = n;
        self
    }
    /// The stop conditions (none of its stop strings or stop sequences empty).
    pub fn stop(mut self, stop: StopConditions) -> Self {
        self.params.stop = stop;
        self
    }
    /// The draft length policy (an adaptive configuration must pass
    /// [`AdaptiveConfig::validate`](super::AdaptiveConfig::validate)).
    pub fn draft(mut self, draft: DraftLength) -> Self {
        self.params.draft = draft;
        self
    }
    /// The tree drafts.
    pub fn tree(mut self, tree: TreeDrafts) -> Self {
        self.params.tree = tree;
        self
    }
    /// The cancel flag; `None` removes it.
    pub fn cancel(mut self, flag: impl Into<Option<Arc<AtomicBool>>>) -> Self {
        self.params.cancel = flag.into();
        self
    }

    /// Validates and returns the parameters.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `min_tokens` when it exceeds `max_new_tokens`,
    /// `stop.stop_strings` / `stop.stop_sequences` for an empty stop string / sequence, or the
    /// field of [`AdaptiveConfig::validate`](super::AdaptiveConfig::validate) for an invalid
    /// adaptive draft length.
    pub fn build(self) -> Result<GenerationParams> {
        self.params.check()?;
        Ok(self.params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::AdaptiveConfig;

    fn field(r: Result<GenerationParams>) -> &'static str {
        match r {
            Err(Error::InvalidConfig { field, .. }) => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn build_refuses_bad_parameters() {
        let b = GenerationParams::builder();
        assert_eq!(
            field(b.clone().max_new_tokens(3).min_tokens(4).build()),
            "min_tokens"
        );
        let empty_string = StopConditions::default().with_stop_string("");
        assert_eq!(
            field(b.clone().stop(empty_string).build()),
            "stop.stop_strings"
        );
        let empty_seq = StopConditions::default().with_stop_sequence(vec![]);
        assert_eq!(
            field(b.clone().stop(empty_seq).build()),
            "stop.stop_sequences"
        );
        let bad = AdaptiveConfig::default().with_decay(0.0);
        assert_eq!(field(b.draft(DraftLength::Adaptive(bad)).build()), "decay");
    }

    #[test]
    fn build_keeps_valid_parameters() {
        let flag = Arc::new(AtomicBool::new(false));
        let p = GenerationParams::builder()
            .seed(7)
            .max_new_tokens(5)
            .min_tokens(5)
            .stop(StopConditions::eos(2))
            .draft(DraftLength::Fixed(3))
            .tree(TreeDrafts::nodes(16).with_branch(2))
            .cancel(flag.clone())
            .build()
            .unwrap();
        assert_eq!(p.seed(), Some(7));
        assert_eq!((p.max_new_tokens(), p.min_tokens()), (5, 5));
        assert_eq!(p.stop().eos, vec![2]);
        assert_eq!(p.draft(), &DraftLength::Fixed(3));
        assert_eq!((p.tree().node_budget(), p.tree().branch()), (16, 2));
        assert!(Arc::ptr_eq(p.cancel().unwrap(), &flag));
        assert_eq!(p.to_builder().build().unwrap(), p);
        assert_eq!(p.to_builder().seed(None).build().unwrap().seed(), None);
        assert_eq!(
            GenerationParams::builder().build().unwrap(),
            GenerationParams::default()
        );
    }

    #[test]
    fn tree_drafts_values() {
        assert_eq!(TreeDrafts::nodes(0), TreeDrafts::Off);
        assert_eq!(TreeDrafts::Off.with_branch(3), TreeDrafts::Off);
        assert!(!TreeDrafts::default().is_on());
        let t = TreeDrafts::nodes(8);
        assert!(t.is_on());
        assert_eq!((t.node_budget(), t.branch()), (8, 0));
        assert_eq!(t.with_branch(2).with_branch(0), t);
    }

    #[test]
    fn validate_checks_the_target_side() {
        let p = GenerationParams::greedy(4).with_draft(DraftLength::Fixed(2));
        assert!(p.validate(10, false).is_ok());
        let eos = p
            .to_builder()
            .stop(StopConditions::eos(10))
            .build()
            .unwrap();
        assert!(matches!(
            eos.validate(10, false),
            Err(Error::TokenOutOfVocab { token: 10, .. })
        ));
        let text = p
            .to_builder()
            .stop(StopConditions::default().with_stop_string("x"))
            .build()
            .unwrap();
        assert!(text.validate(10, true).is_ok());
        assert!(matches!(
            text.validate(10, false),
            Err(Error::InvalidConfig {
                field: "stop.stop_strings",
                ..
            })
        ));
    }
}
