//! Proposers: cheap guessers of the next `k` tokens.
//!
//! A [`Proposer`] looks at the context (prompt plus generated tokens) and returns up to
//! `max_draft` draft tokens, optionally with the draft probabilities q they were sampled from.
//! The verifier then accepts the longest valid prefix (Leviathan et al. 2023, section 2.3).
//!
//! Shipped proposers:
//! - [`PromptLookup`]: n-gram match against the prompt and generated text (prompt lookup
//!   decoding, Saxena 2023).
//! - [`SuffixProposer`]: suffix-tree proposer over the sequence and a bounded corpus of earlier
//!   generations (SuffixDecoding, Oliaro et al. 2024).
//! - [`DraftModelProposer`]: a smaller model implementing [`crate::TargetModel`] samples the draft
//!   (Leviathan et al. 2023; Chen et al. 2023); with the draft model's tree support it grows
//!   EAGLE-2 style trees ([`DraftTreeConfig`]).
//! - [`CrossVocabProposer`]: a draft model with another tokenizer than the target's, related by a
//!   [`VocabMap`] of the two vocabularies' byte strings: TLI (lossless for any request) or the
//!   draft's greedy text re-tokenised for the target (Timor et al. 2025).
//! - [`HeadsProposer`]: MTP / Medusa heads on the target's last hidden state (Cai et al. 2024),
//!   chains or Medusa trees.
//! - [`MergedProposer`]: any set of proposers, their drafts merged into one prefix tree per step
//!   and ranked by acceptance rates learned online (SpecInfer, Miao et al. 2024).
//! - [`TokenRecycling`]: an adjacency table of the target's own top candidates from earlier
//!   verify rows, drafted along a static tree template (Luo et al. 2024).

use crate::error::Result;
use crate::sampling::SamplingConfig;
use crate::tree::{DraftBlock, SiblingScheme};
use crate::verify::RowCandidates;

mod cross_vocab;
mod draft_model;
mod heads;
mod learned;
mod merge_costs;
mod merge_shadow;
mod merge_trie;
mod merged;
mod ngram;
mod prompt_lookup;
mod recycling;
mod sampler;
mod suffix;
mod vocab_map;
mod vocab_pieces;

pub use cross_vocab::{
    BytesEncoder, ContextSync, CrossVocabConfig, CrossVocabMode, CrossVocabProposer,
    EncodingMismatch,
};
pub use draft_model::{DraftModelProposer, DraftTreeConfig};
pub use heads::{DraftHeads, HeadsInput, HeadsProposer};
pub use learned::Learned;
pub use merge_costs::{FixedMergeCosts, MeasuredMergeCosts, MergeCosts, MergePolicy};
pub use merged::{DEFAULT_MERGE_DECAY, MAX_MERGED_PROPOSERS, MergedProposer};
pub use prompt_lookup::{PromptLookup, PromptLookupConfig};
pub use recycling::{RecyclingConfig, TableFileError, TemplateNode, TokenRecycling, TreeTemplate};
pub use suffix::{SharedCorpus, SuffixConfig, SuffixProposer};
pub use vocab_map::{VocabMap, VocabMapBuilder, VocabMapError, VocabSide};
pub use vocab_pieces::{SpecialRole, VocabPieces};

/// What a proposer is asked for at one step.
///
/// Build one with [`ProposeRequest::new`] and the setters (each sets the field of the same
/// name); the fields are public to read, and the type is `#[non_exhaustive]`, so new fields are
/// not a breaking change. A proposer that asks another for a sub-draft derives its request
/// from its own with the setters (`req.context(&longer).max_draft(room)`).
///
/// ```
/// use speculative::{ProposeRequest, SamplingConfig};
///
/// let cfg = SamplingConfig::greedy();
/// let req = ProposeRequest::new(&[5, 6, 7], &cfg, 4).seed(9).eos(&[2]).prompt_len(2);
/// assert_eq!((req.max_draft, req.max_nodes, req.seed), (4, 4, 9));
/// let sub = req.context(&[5, 6, 7, 8]).max_draft(2);
/// assert_eq!((sub.context.len(), sub.max_draft, sub.eos), (4, 2, &[2][..]));
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ProposeRequest<'a> {
    /// The whole sequence so far: prompt followed by every emitted token. The target will be fed
    /// `context.last()` followed by the draft.
    pub context: &'a [u32],
    /// The request's sampling configuration. Proposers that sample (draft model, heads) process
    /// their logits with exactly this configuration, so that q matches what the verifier expects.
    pub config: &'a SamplingConfig,
    /// Maximum number of draft tokens to return (the draft length k). May be 0. For a tree
    /// ([`Proposer::propose_tree`]) it bounds the depth.
    pub max_draft: usize,
    /// Node budget of a tree draft ([`Proposer::propose_tree`]): at most this many nodes. Chains
    /// ([`Proposer::propose`]) ignore it. [`ProposeRequest::new`] sets it to `max_draft`.
    pub max_nodes: usize,
    /// Branching limit of a tree draft: at most this many children per node, the root included
    /// (`usize::MAX`, what [`ProposeRequest::new`] sets, for none). Chains ignore it.
    pub max_branch: usize,
    /// The request's seed. Proposers that sample draw from the counter-based stream
    /// [`crate::rng::Stream`] keyed by this seed and the absolute token position.
    pub seed: u64,
    /// The target's final hidden state (`[hidden_size]`) of the row that predicted
    /// `context.last()` (the row whose input is `context[context.len() - 2]`), when the target
    /// exposes hidden states. For a generated token the target's own prediction from this row is
    /// that token; for the prompt's last token it may not be. [`HeadsProposer`] passes it to its
    /// heads together with `context.last()` (see [`HeadsInput`]).
    pub target_hidden: Option<&'a [f32]>,
    /// The target's final hidden states of every context position but the last,
    /// `[context.len() - 1, hidden_size]` row-major: row `p` from the target row whose input
    /// was `context[p]` (the feature of position `p`, see [`crate::TargetFeatures`]); its last
    /// row equals `target_hidden`. `None` when the target exposes no hidden states (or gave
    /// rows of the wrong size). The loop passes `Some` with no rows for a one-token prompt.
    /// [`DraftModelProposer`] feeds them to a feature-conditioned draft model (an EAGLE head).
    pub target_hidden_rows: Option<&'a [f32]>,
    /// Number of leading `context` tokens that are the prompt (frequency and presence penalties
    /// count only the tokens after it; see [`crate::sampling::PenaltyScope`]).
    pub prompt_len: usize,
    /// End-of-sequence token ids. A draft ends at its first EOS: a proposer never drafts past
    /// one (nothing after an end can be emitted), and sampling proposers process no row after it.
    pub eos: &'a [u32],
    /// The ids banned at draft rows `0..suppress_rows` while `min_tokens` is not reached: every
    /// id the loop bans on the target rows of the same positions (the EOS ids and the
    /// single-token stop sequences, [`crate::decode::StopConditions::suppressed_ids`]), so that
    /// sampling proposers draw from the distribution the verifier checks against (case C19).
    pub suppress: &'a [u32],
    /// Number of leading draft rows (depths, for a tree) at which the `suppress` ids are banned.
    pub suppress_rows: usize,
    /// Prompt tokens that this step's verify forward also feeds ahead of the draft (a fused
    /// prefill, [`crate::decode::Generator::with_fused_prefill`]; 0 otherwise): such a step's
    /// forward costs more than its verify rows, so a proposer that times steps
    /// ([`MergedProposer`]) leaves it out.
    pub fused_prompt: usize,
}

impl<'a> ProposeRequest<'a> {
    /// A request for at most `max_draft` tokens after `context` with seed 0, no hidden state
    /// (`target_hidden` and `target_hidden_rows` `None`), no prompt split, no EOS, no
    /// suppression and no fused prompt tokens.
    pub fn new(context: &'a [u32], config: &'a SamplingConfig, max_draft: usize) -> Self {
        ProposeRequest {
            context,
            config,
            max_draft,
            max_nodes: max_draft,
            max_branch: usize::MAX,
            seed: 0,
            target_hidden: None,
            target_hidden_rows: None,
            prompt_len: 0,
            eos: &[],
            suppress: &[],
            suppress_rows: 0,
            fused_prompt: 0,
        }
    }

    /// Sets [`ProposeRequest::context`].
    pub fn context(mut self, context: &'a [u32]) -> Self {
        self.context = context;
        self
    }

    /// Sets [`ProposeRequest::config`].
    pub fn config(mut self, config: &'a SamplingConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets [`ProposeRequest::max_draft`] (not the node budget: see
    /// [`ProposeRequest::max_nodes`]).
    pub fn max_draft(mut self, max_draft: usize) -> Self {
        self.max_draft = max_draft;
        self
    }

    /// Sets the node budget of a tree draft ([`ProposeRequest::max_nodes`]).
    pub fn max_nodes(mut self, max_nodes: usize) -> Self {
        self.max_nodes = max_nodes;
        self
    }

    /// Sets the branching limit of a tree draft ([`ProposeRequest::max_branch`]).
    pub fn max_branch(mut self, max_branch: usize) -> Self {
        self.max_branch = max_branch;
        self
    }

    /// Sets [`ProposeRequest::seed`].
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets the target's last hidden state, `[hidden_size]` ([`ProposeRequest::target_hidden`];
    /// `None` for none).
    pub fn target_hidden(mut self, hidden: Option<&'a [f32]>) -> Self {
        self.target_hidden = hidden;
        self
    }

    /// Sets the target's hidden states of every context position but the last,
    /// `[context.len() - 1, hidden_size]` ([`ProposeRequest::target_hidden_rows`]; `None` for
    /// none).
    pub fn target_hidden_rows(mut self, rows: Option<&'a [f32]>) -> Self {
        self.target_hidden_rows = rows;
        self
    }

    /// Sets [`ProposeRequest::prompt_len`].
    pub fn prompt_len(mut self, prompt_len: usize) -> Self {
        self.prompt_len = prompt_len;
        self
    }

    /// Sets the EOS ids ([`ProposeRequest::eos`]).
    pub fn eos(mut self, eos: &'a [u32]) -> Self {
        self.eos = eos;
        self
    }

    /// Bans `tokens` at draft rows `0..rows` ([`ProposeRequest::suppress`]).
    pub fn suppress(mut self, tokens: &'a [u32], rows: usize) -> Self {
        self.suppress = tokens;
        self.suppress_rows = rows;
        self
    }

    /// Sets the number of leading draft rows at which the suppressed ids are banned
    /// ([`ProposeRequest::suppress_rows`]), keeping the ids.
    pub fn suppress_rows(mut self, rows: usize) -> Self {
        self.suppress_rows = rows;
        self
    }

    /// Sets [`ProposeRequest::fused_prompt`].
    pub fn fused_prompt(mut self, tokens: usize) -> Self {
        self.fused_prompt = tokens;
        self
    }

    /// `true` when `token` is one of the request's EOS ids.
    pub fn is_eos(&self, token: u32) -> bool {
        self.eos.contains(&token)
    }

    /// Length of `tokens` cut right after its first EOS id (`tokens.len()` when it holds none):
    /// the longest prefix a proposer may return as a draft. `O(tokens.len() * eos.len())`.
    pub fn draft_len_to_eos(&self, tokens: &[u32]) -> usize {
        tokens
            .iter()
            .position(|&t| self.is_eos(t))
            .map_or(tokens.len(), |i| i + 1)
    }
}

/// A proposal: draft tokens, their tree shape, and, for sampling proposers, the draft
/// probabilities q.
///
/// A chain leaves `parents` empty. A tree ([`Proposer::propose_tree`]) fills `parents` with
/// one parent row per node (`0` for a child of the root, `j + 1` for a child of node `j`; see
/// [`crate::tree`]) and may set each node's [`SiblingScheme`]; [`Draft::block`] is the view the
/// loop and the verifier read.
///
/// The default is the empty draft (no token, no q): what a proposer fills, and a valid
/// proposal in itself (a no-draft step).
///
/// Build one with [`Draft::default`] (and fill its fields, as a proposer does), or with
/// [`Draft::chain`] / [`Draft::tree`] and the `with_` setters; the fields are public and the
/// type is `#[non_exhaustive]`.
///
/// `Draft` is `Send + Sync`.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Draft {
    /// Draft tokens `d_1 .. d_k` (`k <= max_draft`).
    pub tokens: Vec<u32>,
    /// Probabilities (not logits) the tokens were sampled from, shape `[k, q_vocab]` row-major,
    /// or `None` for deterministic proposers (a point mass on each draft token).
    pub q: Option<Vec<f32>>,
    /// Width of each q row, in tokens (may be smaller than the target vocabulary; missing entries
    /// count as probability 0).
    pub q_vocab: usize,
    /// Parent row of each node (`[n]`), or empty for a chain.
    pub parents: Vec<u32>,
    /// Sibling scheme of each node's group (`[n]`), or empty for the default of the draft form
    /// (deterministic for point masses, with replacement for q).
    pub schemes: Vec<SiblingScheme>,
}

impl Draft {
    /// The chain `tokens` of point masses (no q).
    pub fn chain(tokens: Vec<u32>) -> Self {
        Draft {
            tokens,
            ..Draft::default()
        }
    }

    /// The tree of `tokens` with parent rows `parents` (`[n]`; see [`Draft::parents`]), point
    /// masses (no q). Not checked here (the loop checks a proposal).
    pub fn tree(tokens: Vec<u32>, parents: Vec<u32>) -> Self {
        Draft {
            tokens,
            parents,
            ..Draft::default()
        }
    }

    /// Sets the draft probabilities `q` (`[k, q_vocab]` row-major; see [`Draft::q`]).
    pub fn with_q(mut self, q: Vec<f32>, q_vocab: usize) -> Self {
        self.q = Some(q);
        self.q_vocab = q_vocab;
        self
    }

    /// Sets the sibling scheme of each node's group (`[n]`; see [`Draft::schemes`]).
    pub fn with_schemes(mut self, schemes: Vec<SiblingScheme>) -> Self {
        self.schemes = schemes;
        self
    }

    /// Empties the draft, keeping its allocations.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.q = None;
        self.q_vocab = 0;
        self.parents.clear();
        self.schemes.clear();
    }

    /// The draft's shape: a chain when `parents` is empty, else a tree (not validated here).
    pub fn block(&self) -> DraftBlock<'_> {
        let b = if self.parents.is_empty() {
            DraftBlock::chain(&self.tokens)
        } else {
            DraftBlock::tree(&self.tokens, &self.parents)
        };
        if self.schemes.is_empty() {
            b
        } else {
            b.with_schemes(&self.schemes)
        }
    }

    /// Number of draft tokens k (nodes, for a tree).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// `true` when there are no draft tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// What the target's rows said at one verify step, for proposers that learn from them
/// ([`Proposer::observe_rows`]): the input token of every target row and the row's best ids.
///
/// Row 0's input is the root (the last token before the step), row `j + 1`'s is node `j`'s
/// token; a row's candidates are the target's best next tokens after that input along the
/// row's own path (processed with the request's configuration, see [`RowCandidates`]). Rows of
/// rejected nodes are included.
///
/// The loop builds it; [`VerifiedRows::new`] builds one elsewhere (a test, or an engine that
/// runs its own loop). The fields are public to read, and the type is `#[non_exhaustive]`.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct VerifiedRows<'a> {
    /// Input token of each row, `[rows]`: the root, then the token of each node that has a row.
    pub inputs: &'a [u32],
    /// Parent row of each node (`[rows - 1]`, see [`Draft::parents`]), empty for a chain.
    pub parents: &'a [u32],
    /// The best ids of each row, `rows` rows of up to [`Proposer::row_candidates`] ids.
    pub candidates: &'a RowCandidates,
    /// Node indices of the accepted path, the root's child first (`[accepted]`; for a chain
    /// `0..accepted`). Not cut by a stop: [`Proposer::observe`]'s `accepted` is.
    pub path: &'a [u32],
}

impl<'a> VerifiedRows<'a> {
    /// The rows of a step: the `[rows]` input tokens, the nodes' parent rows (`[rows - 1]`,
    /// empty for a chain), the rows' candidates and the accepted path (see the fields).
    pub fn new(
        inputs: &'a [u32],
        parents: &'a [u32],
        candidates: &'a RowCandidates,
        path: &'a [u32],
    ) -> Self {
        VerifiedRows {
            inputs,
            parents,
            candidates,
            path,
        }
    }
}

/// A source of draft tokens.
///
/// Object safe: engines can hold `Box<dyn Proposer>`. The decoding loop calls
/// [`Proposer::begin`] once per generation, then for each step [`Proposer::propose`] followed by
/// [`Proposer::observe`] with the verified outcome.
///
/// # State across requests
///
/// A proposer may be used directly, without the loop and without [`Proposer::begin`]. It must
/// then never serve drafts from a previous request's state: a proposer that keeps per-request
/// state checks in `propose` whether `req.context` extends what it has seen, and rebuilds its
/// state from `req.context` when it does not (or, only if it cannot rebuild, returns
/// [`crate::Error::StaleProposerState`]). Every shipped proposer rebuilds; see each type's docs.
///
/// # Drafts end at EOS
///
/// A draft never holds a token after its first EOS id ([`ProposeRequest::eos`]; see
/// [`ProposeRequest::draft_len_to_eos`]): nothing after an end can be emitted, and sampling
/// proposers process no draft row after it.
///
/// # Example
///
/// A proposer that always guesses the last token again:
///
/// ```
/// use speculative::{Draft, ProposeRequest, Proposer, Result};
///
/// struct Repeat;
///
/// impl Proposer for Repeat {
///     fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
///         draft.clear();
///         if let Some(&last) = req.context.last() {
///             draft.tokens.extend(std::iter::repeat(last).take(req.max_draft));
///         }
///         Ok(())
///     }
/// }
/// ```
pub trait Proposer {
    /// Fills `draft` with at most `req.max_draft` tokens (clear it first). An empty draft is
    /// allowed and makes the step a plain decoding step.
    ///
    /// # Errors
    /// [`crate::Error::Proposer`] or [`crate::Error::Model`] when the proposer's own model fails.
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()>;

    /// Fills `draft` with a token tree of at most `req.max_nodes` nodes, depth at most
    /// `req.max_draft` and at most `req.max_branch` children per node (parents in [`Draft::parents`]; see [`crate::tree`]). Every node must
    /// satisfy the rules of [`Proposer::propose`] along its own path (no token after an EOS).
    /// The loop calls it instead of `propose` when tree drafts are on and the target supports
    /// them. The default returns the chain of [`Proposer::propose`] (a chain is a tree; the loop
    /// checks a chain against `max_draft` only, so it may exceed a `max_nodes` below
    /// `max_draft`).
    ///
    /// # Errors
    /// As [`Proposer::propose`].
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.propose(req, draft)
    }

    /// Told after verification: `accepted` of the proposed drafts were accepted and `emitted`
    /// (the accepted drafts plus the correction or bonus token, possibly cut by a stop) was
    /// appended to the context. From the loop, `emitted.len()` is `accepted + 1`, or
    /// `accepted` when an accepted draft ended the generation (EOS, stop; no bonus token), and
    /// `accepted` is already cut to the emitted tokens. A step without a proposal (`k = 0`:
    /// speculation off, no room, or an adaptive choice) is observed too, with `accepted` 0.
    /// Inside a [`MergedProposer`], `accepted` is this proposer's own count (the leading
    /// emitted tokens that are a path of its own draft), so `emitted` may be longer than
    /// `accepted + 1`: write `observe` for any `accepted <= emitted.len()`. Proposers with state roll back or update here. The default does
    /// nothing.
    ///
    /// # Errors
    /// Implementation defined.
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        let _ = (accepted, emitted);
        Ok(())
    }

    /// How many best ids of each verified target row this proposer wants in
    /// [`Proposer::observe_rows`] (0, the default: none; any larger value is valid, and a row
    /// never lists more ids than its allowed tokens). The loop asks the verifier for that many
    /// ([`crate::VerifyRequest::row_top_k`]), which costs one more pass over each row: a scan of
    /// `[vocab]` logits with the row's penalties and masks, plus a sort of the `n` ids, for every
    /// row of the step (a tree: the root and every node, rejected ones included). A proposer
    /// that wants none costs nothing. Read once per step, before the verification.
    fn row_candidates(&self) -> usize {
        0
    }

    /// Told after verification, before [`Proposer::observe`], when
    /// [`Proposer::row_candidates`] is above 0: the input token and best ids of every target row
    /// of the step (root and nodes, rejected ones included). Token Recycling (Luo et al. 2024)
    /// keeps them as successor candidates. The default does nothing.
    ///
    /// # Errors
    /// Implementation defined.
    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        let _ = rows;
        Ok(())
    }

    /// Called once at the start of a generation with the prompt. The default does nothing.
    ///
    /// # Errors
    /// Implementation defined.
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        let _ = prompt;
        Ok(())
    }

    /// Called once at the start of a generation in place of [`Proposer::begin`] when the loop
    /// keeps cached prefixes across generations ([`crate::decode::Generator::with_prefix_reuse`],
    /// on by default): the target's KV cache may already hold a prefix of `prompt` (an earlier
    /// turn of the conversation, a shared system prompt), and the proposer may keep what it
    /// holds of that prefix too. Its drafts must still equal those of a proposer started with
    /// `begin` on the same prompt. [`DraftModelProposer`] keeps its draft model's cache (and a
    /// feature-conditioned model's held target features) up to the longest common prefix of
    /// what it has seen and the context, which its first proposal computes. The default calls
    /// [`Proposer::begin`], which is always correct: proposers that index the context (prompt
    /// lookup, suffix) rebuild their index from `prompt` there.
    ///
    /// # Errors
    /// Implementation defined.
    fn begin_reusing(&mut self, prompt: &[u32]) -> Result<()> {
        self.begin(prompt)
    }

    /// Called once when a generation ends with the full sequence (prompt + output), so that
    /// proposers with a shared corpus (suffix) can learn from it. The default does nothing.
    fn finish(&mut self, sequence: &[u32]) {
        let _ = sequence;
    }

    /// `true` when the proposer drafts from the context's tokens alone: its proposals read
    /// neither the target's hidden states ([`ProposeRequest::target_hidden`],
    /// [`ProposeRequest::target_hidden_rows`]) nor a draft model's cache of the context, so it
    /// can draft for a prompt whose last tokens the target has not seen yet. The default is
    /// `false`; prompt lookup, suffix, token recycling and [`CrossVocabProposer`] (which
    /// brings its own draft model to the context's tokens at each proposal) return `true`, a
    /// merged proposer when all of its proposers do, [`NoProposer`] `true`.
    ///
    /// [`crate::decode::Generator`] reads it at the start of a generation: with `true` (and a
    /// target that can truncate), the prompt tokens that prefix reuse leaves to feed are fed in
    /// the first step's verify forward instead of a prefill forward of their own
    /// ([`crate::decode::Generator::with_fused_prefill`]). Read once per generation; a wrong
    /// `true` costs no exactness (any draft is verified), only the target's features of the
    /// new prompt tokens at the first proposal (`None` then).
    fn drafts_from_tokens(&self) -> bool {
        false
    }

    /// `true` when the proposer cuts its own drafts, for requests sampled with `config`, to
    /// the length (or tree) that pays on the costs it measures, so that a draft length chosen
    /// for it from outside can only cut a draft it found paying: a [`MergedProposer`] under its
    /// default [`MergePolicy::CostAware`] for greedy requests, where it prices every node
    /// against the verify rows it costs (learned per member and per depth, from the merge's
    /// own clock). The default is `false`.
    ///
    /// Under [`DraftLength::Adaptive`](crate::decode::DraftLength::Adaptive) the
    /// single-sequence loop ([`crate::decode::Generator`]) then asks such a proposer for the
    /// longest draft the request allows (`max_draft`, capped by the token budget and the
    /// context room; the node budget with trees) instead of the adaptive policy's choice, as
    /// for [`DraftLength::Fixed`](crate::decode::DraftLength::Fixed) of `max_draft`: the policy's
    /// estimates are per draft position over all of the proposer's drafts and its cost curve a
    /// line between measured row counts, so stacked on the merge's cut it kept most steps
    /// plain where the merge's drafts paid (issue 31: prompt lookup + suffix on llama.cpp's CPU
    /// verify of Gemma 3 270M, 1.00x adaptive against 1.21x at `k = 4`). The batch loop's
    /// goodput policy, which prices the batch's shared forward, still sizes every sequence's
    /// draft. Read at every step.
    fn sizes_own_drafts(&self, config: &SamplingConfig) -> bool {
        let _ = config;
        false
    }

    /// What this proposer learned online that outlives a request ([`Learned`]: a
    /// [`MergedProposer`]'s acceptance rates, marginal gains and measured costs), to start a new
    /// proposer of the same configuration from ([`Proposer::start_from_learned`]): a server
    /// that builds a proposer per request carries it from the last one, so that each new one
    /// behaves as one long-lived proposer would (as it carries the adaptive policy's costs,
    /// [`crate::decode::AdaptiveState::costs_only`]). The default, and every shipped proposer
    /// but [`MergedProposer`], learns nothing of the kind: `None`. Called between generations.
    fn learned(&self) -> Option<Learned> {
        None
    }

    /// Starts from what a proposer of the same configuration learned ([`Proposer::learned`])
    /// instead of learning it again; the per-request state (the context, a draft model's
    /// cache) is this proposer's own. Call it before the first generation. The default ignores
    /// it (`Ok`): a proposer that learns nothing of the kind has nothing to start from.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] naming `learned` when it is of another configuration
    /// (a [`MergedProposer`]'s: of a merge with another number of members).
    fn start_from_learned(&mut self, learned: &Learned) -> Result<()> {
        let _ = learned;
        Ok(())
    }

    /// A short, stable name for messages and metrics. The decoding loop puts it in
    /// [`crate::Error::InvalidProposal`] and [`crate::Error::StaleProposerState`] so that a caller
    /// with several proposers sees which one failed.
    ///
    /// The default is [`std::any::type_name`] of the implementing type (for example
    /// `my_crate::Repeat`); the shipped proposers return `"prompt-lookup"`, `"suffix"`,
    /// `"draft-model"`, `"cross-vocab"`, `"heads"`, `"merged"`, `"recycling"` and `"none"`. `Box<P>` and `&mut P`
    /// forward to `P`, so a `Box<dyn Proposer>` reports the boxed proposer's name.
    fn name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }
}

impl<P: Proposer + ?Sized> Proposer for Box<P> {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        (**self).propose(req, draft)
    }
    fn row_candidates(&self) -> usize {
        (**self).row_candidates()
    }
    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        (**self).observe_rows(rows)
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        (**self).propose_tree(req, draft)
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        (**self).observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        (**self).begin(prompt)
    }
    fn begin_reusing(&mut self, prompt: &[u32]) -> Result<()> {
        (**self).begin_reusing(prompt)
    }
    fn finish(&mut self, sequence: &[u32]) {
        (**self).finish(sequence)
    }
    fn drafts_from_tokens(&self) -> bool {
        (**self).drafts_from_tokens()
    }
    fn sizes_own_drafts(&self, config: &SamplingConfig) -> bool {
        (**self).sizes_own_drafts(config)
    }
    fn learned(&self) -> Option<Learned> {
        (**self).learned()
    }
    fn start_from_learned(&mut self, learned: &Learned) -> Result<()> {
        (**self).start_from_learned(learned)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
}

impl<P: Proposer + ?Sized> Proposer for &mut P {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        (**self).propose(req, draft)
    }
    fn row_candidates(&self) -> usize {
        (**self).row_candidates()
    }
    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        (**self).observe_rows(rows)
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        (**self).propose_tree(req, draft)
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        (**self).observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        (**self).begin(prompt)
    }
    fn begin_reusing(&mut self, prompt: &[u32]) -> Result<()> {
        (**self).begin_reusing(prompt)
    }
    fn finish(&mut self, sequence: &[u32]) {
        (**self).finish(sequence)
    }
    fn drafts_from_tokens(&self) -> bool {
        (**self).drafts_from_tokens()
    }
    fn sizes_own_drafts(&self, config: &SamplingConfig) -> bool {
        (**self).sizes_own_drafts(config)
    }
    fn learned(&self) -> Option<Learned> {
        (**self).learned()
    }
    fn start_from_learned(&mut self, learned: &Learned) -> Result<()> {
        (**self).start_from_learned(learned)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
}

/// The start of a model-free tree draft: `propose`'s chain. With `req.max_nodes <=
/// req.max_draft` the draft is the chain of `max_draft = max_nodes` and nothing grows from it
/// (`Ok(false)`); otherwise the chain of `max_draft`, and `Ok(true)` when it is not empty (a
/// tree may grow around it).
///
/// # Errors
/// Those of `p.propose`.
fn tree_starts_with_chain<P: Proposer + ?Sized>(
    p: &mut P,
    req: &ProposeRequest<'_>,
    draft: &mut Draft,
) -> Result<bool> {
    if req.max_nodes <= req.max_draft {
        let chain = ProposeRequest {
            max_draft: req.max_nodes,
            ..*req
        };
        p.propose(&chain, draft)?;
        return Ok(false);
    }
    p.propose(req, draft)?;
    Ok(!draft.is_empty())
}

/// The proposer that never proposes: every step is a no-draft step (`k = 0`, plain decoding).
/// It has no state, so its default is the only value.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProposer;

impl Proposer for NoProposer {
    /// `true`: drafts from the context's tokens alone.
    fn drafts_from_tokens(&self) -> bool {
        true
    }

    fn propose(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        Ok(())
    }

    /// `"none"`.
    fn name(&self) -> &'static str {
        "none"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingConfig;

    struct Unnamed;
    impl Proposer for Unnamed {
        fn propose(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
            draft.clear();
            Ok(())
        }
    }

    /// The name as seen through a generic `P: Proposer` (the impls for `Box` and `&mut`).
    fn name_of<P: Proposer>(p: P) -> &'static str {
        p.name()
    }

    #[test]
    fn name_defaults_to_the_type_name_and_is_forwarded() {
        assert!(Unnamed.name().ends_with("::Unnamed"), "{}", Unnamed.name());
        let boxed: Box<dyn Proposer> = Box::new(Unnamed);
        assert_eq!(name_of(boxed), Unnamed.name());
        let mut none = NoProposer;
        assert_eq!(none.name(), "none");
        assert_eq!(name_of(&mut none), "none");
        let mut boxed: Box<dyn Proposer> = Box::new(NoProposer);
        assert_eq!(name_of(&mut boxed), "none");
        assert_eq!(name_of(Box::new(&mut boxed)), "none");
    }

    #[test]
    fn draft_len_to_eos_cuts_after_the_first_eos() {
        let cfg = SamplingConfig::greedy();
        let mut req = ProposeRequest::new(&[1], &cfg, 4);
        assert_eq!(req.draft_len_to_eos(&[3, 4, 5]), 3);
        req.eos = &[4, 9];
        assert_eq!(req.draft_len_to_eos(&[3, 4, 5]), 2);
        assert_eq!(req.draft_len_to_eos(&[9, 4, 5]), 1);
        assert_eq!(req.draft_len_to_eos(&[]), 0);
        assert_eq!(req.draft_len_to_eos(&[1, 2]), 2);
    }
}
