//! The engine-facing traits: what the decoding loop and the draft-model proposer need from an
//! inference engine.
//!
//! - [`TargetModel`]: a causal language model with a KV cache that can be rolled back; the only
//!   trait an engine must implement.
//! - [`TreeTarget`]: the optional tree forward (each node attends to the committed context and
//!   its ancestors) and the commit of an accepted path; an engine offers it through
//!   [`TargetModel::tree`]. Without it the loop verifies chains.
//! - [`HiddenStates`]: the optional final hidden states of the last forward, read by heads
//!   proposers (MTP / Medusa / EAGLE); offered through [`TargetModel::hidden_states`].
//! - [`TargetFeatures`]: the optional input side of a feature-conditioned draft model (an EAGLE
//!   head): it holds the target's hidden states of the committed positions; offered through
//!   [`TargetModel::target_features`] and fed by [`crate::propose::DraftModelProposer`].
//!
//! This module sits below [`crate::propose`] and [`crate::decode`], which both drive models
//! through it.

use crate::error::Result;
use crate::tree::DraftBlock;

/// A causal language model with a KV cache that can be rolled back.
///
/// Call order in the decoding loop ([`crate::decode::Generator`]): at the start of a generation
/// `truncate(0)`, then, for a prompt of `n >= 2` tokens, one [`TargetModel::prefill`] with
/// `prompt[..n - 1]` (no logits needed). Then, once per speculative step, one
/// [`TargetModel::forward`] with `[last token, d_1 .. d_k]`, reading back the logits of every
/// appended position (`[k + 1, vocab]`), and after verification [`TargetModel::truncate`] to
/// drop the KV entries of rejected drafts. [`crate::propose::DraftModelProposer`] drives a draft
/// model through the same methods (its first proposal of a generation prefills the context but
/// its last token).
///
/// The trait is object safe, so engines can hold a `Box<dyn TargetModel>`.
///
/// # Example
///
/// A toy "model" whose next token is always `(last + 1) % vocab`:
///
/// ```
/// use speculative::{Result, TargetModel};
///
/// struct Counter { tokens: Vec<u32>, vocab: usize }
///
/// impl TargetModel for Counter {
///     fn vocab_size(&self) -> usize { self.vocab }
///     fn max_context(&self) -> usize { 1 << 20 }
///     fn seq_len(&self) -> usize { self.tokens.len() }
///     fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
///         logits.clear();
///         for &t in tokens {
///             self.tokens.push(t);
///             let next = (t as usize + 1) % self.vocab;
///             logits.extend((0..self.vocab).map(|v| if v == next { 10.0 } else { 0.0 }));
///         }
///         Ok(())
///     }
///     fn truncate(&mut self, len: usize) -> Result<()> {
///         self.tokens.truncate(len);
///         Ok(())
///     }
/// }
///
/// let mut m = Counter { tokens: vec![], vocab: 8 };
/// let mut logits = Vec::new();
/// m.forward(&[3, 4], &mut logits).unwrap();
/// assert_eq!(logits.len(), 2 * 8);
/// assert_eq!(logits[4], 10.0); // row 0 follows token 3, so it predicts 4
/// assert_eq!(logits[8 + 5], 10.0); // row 1 follows token 4
/// ```
pub trait TargetModel {
    /// Number of logits per position (the output head's width), in tokens.
    fn vocab_size(&self) -> usize;

    /// Maximum number of tokens the model can hold in its context (prompt + generated).
    fn max_context(&self) -> usize;

    /// Number of tokens currently in the sequence (the KV cache length).
    fn seq_len(&self) -> usize;

    /// Appends `tokens` (`n >= 1` of them) to the sequence and writes the logits of every
    /// appended position into `logits`, which is cleared first: row `i` (`[vocab]`) holds the
    /// logits for the token that follows `tokens[i]`. Shape `[n, vocab]`, row-major.
    ///
    /// # Errors
    /// Implementations return [`crate::Error::Model`] for engine failures and when the
    /// sequence would exceed [`TargetModel::max_context`].
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()>;

    /// Drops every position at index `>= len` (KV-cache rollback). `len` greater than
    /// [`TargetModel::seq_len`] is an error.
    ///
    /// # Errors
    /// [`crate::Error::Model`] when `len > seq_len()` or the engine fails.
    fn truncate(&mut self, len: usize) -> Result<()>;

    /// Appends `tokens` (`n >= 1`) whose logits the caller will not read: the prompt before its
    /// last token. [`crate::decode::Generator`] calls it once per generation of a prompt of two
    /// or more tokens, right after `truncate(0)` and before the first [`TargetModel::forward`];
    /// [`crate::propose::DraftModelProposer`] calls it on its draft model at its first proposal.
    /// Implementations must not assume an empty sequence: it appends, like `forward`.
    ///
    /// The default runs [`TargetModel::forward`] and discards the logits, which allocates
    /// `[n, vocab]` f32 (about 4 GB for an 8k-token prompt and a 128k vocabulary); engines
    /// should override it and skip the output head, which for a small model is also a large
    /// share of the prefill work (SmolLM2-135M: 28M of 135M multiply-adds per token). The KV
    /// cache afterwards must be exactly what `forward` would leave, and
    /// [`HiddenStates::last_hidden`] (when offered) must return the appended positions' final
    /// hidden states as after `forward` (heads proposers read the last prompt position's row).
    /// On error the sequence should be left as it was (as `forward`).
    ///
    /// # Errors
    /// As [`TargetModel::forward`].
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        let mut logits = Vec::new();
        self.forward(tokens, &mut logits)
    }

    /// The engine's tree support, `None` (the default) when it has none: the loop then verifies
    /// chains. An engine that implements [`TreeTarget`] returns `Some(self)`.
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        None
    }

    /// The engine's hidden states, `None` (the default) when it does not expose them. An engine
    /// that implements [`HiddenStates`] returns `Some(self)`; heads proposers need it.
    fn hidden_states(&self) -> Option<&dyn HiddenStates> {
        None
    }

    /// The model's input of target hidden states, `None` (the default) when its rows do not
    /// read the target's features. A feature-conditioned draft model (an EAGLE head) that
    /// implements [`TargetFeatures`] returns `Some(self)`;
    /// [`crate::propose::DraftModelProposer`] then feeds it the target's hidden states of the
    /// context before each proposal.
    fn target_features(&mut self) -> Option<&mut dyn TargetFeatures> {
        None
    }
}

impl<T: TargetModel + ?Sized> TargetModel for Box<T> {
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
    fn max_context(&self) -> usize {
        (**self).max_context()
    }
    fn seq_len(&self) -> usize {
        (**self).seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        (**self).forward(tokens, logits)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        (**self).truncate(len)
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        (**self).prefill(tokens)
    }
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        (**self).tree()
    }
    fn hidden_states(&self) -> Option<&dyn HiddenStates> {
        (**self).hidden_states()
    }
    fn target_features(&mut self) -> Option<&mut dyn TargetFeatures> {
        (**self).target_features()
    }
}

impl<T: TargetModel + ?Sized> TargetModel for &mut T {
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
    fn max_context(&self) -> usize {
        (**self).max_context()
    }
    fn seq_len(&self) -> usize {
        (**self).seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        (**self).forward(tokens, logits)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        (**self).truncate(len)
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        (**self).prefill(tokens)
    }
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        (**self).tree()
    }
    fn hidden_states(&self) -> Option<&dyn HiddenStates> {
        (**self).hidden_states()
    }
    fn target_features(&mut self) -> Option<&mut dyn TargetFeatures> {
        (**self).target_features()
    }
}

/// Final hidden states of a target's last forward: an optional extension of [`TargetModel`],
/// offered through [`TargetModel::hidden_states`]. Heads proposers (MTP / Medusa, Cai et al.
/// 2024; EAGLE, Li et al. 2024) read them.
pub trait HiddenStates {
    /// Width of a hidden state, in floats (`> 0`).
    fn hidden_size(&self) -> usize;

    /// The final hidden states (after the last norm, before the output head) of the positions
    /// appended by the most recent [`TargetModel::forward`], [`TargetModel::prefill`] or
    /// [`TreeTarget::forward_tree`] call, shape `[n, hidden_size]` (every appended row, in the
    /// order of the logits rows). `None` when nothing was run yet. The loop reads them right
    /// after each call (before [`TargetModel::truncate`] or [`TreeTarget::commit_tree`]): every
    /// row of a prefill, and the rows of the committed positions of a step, which it keeps for
    /// the generation ([`crate::ProposeRequest::target_hidden_rows`]); rows of another count
    /// than the call appended end that buffer for the generation.
    fn last_hidden(&self) -> Option<&[f32]>;
}

/// The target's hidden states held by a feature-conditioned draft model: an optional extension
/// of [`TargetModel`] for a draft model, offered through [`TargetModel::target_features`].
///
/// An EAGLE draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
/// Uncertainty", section 3) is a small causal transformer whose row at position `p` reads the
/// token `x_p` and the **feature** of position `p - 1`. The feature of position `p` is the
/// target's final hidden state (after the last norm, before the output head: the rows of
/// [`HiddenStates::last_hidden`]) of the target row whose input was `context[p]`, `[hidden_size]`.
/// For a draft position (no target row exists yet) the head reads its own predicted feature of
/// the previous position instead. Position 0 has no previous feature (the model decides what
/// its row reads there).
///
/// Features are keyed by absolute position. The model holds those of the leading
/// [`TargetFeatures::target_hidden_len`] positions; a row at position `p` with
/// `p - 1 < target_hidden_len()` reads the held feature, any later row reads the model's own.
/// [`TargetModel::truncate`] does **not** drop held features: only
/// [`TargetFeatures::set_target_hidden`] replaces them. [`crate::propose::DraftModelProposer`]
/// calls it before each proposal with the features of the context but its last token, from the
/// first position whose feature may have changed, so the model's rows of every context position
/// read the target's features and its rows of draft positions its own.
///
/// The trait is object safe.
pub trait TargetFeatures {
    /// Width of one hidden state, in floats (`> 0`). Must equal the target's
    /// [`HiddenStates::hidden_size`].
    fn hidden_size(&self) -> usize;

    /// Number of leading positions whose target hidden states the model holds.
    fn target_hidden_len(&self) -> usize;

    /// Replaces the held target hidden states of positions `>= start` by `rows`
    /// (`[n, hidden_size]` row-major: positions `start .. start + n`; afterwards
    /// [`TargetFeatures::target_hidden_len`] is `start + n`), and truncates the model's sequence
    /// to at most `start + 1` positions: the rows of positions `> start` read a feature of a
    /// position `>= start`, which may have changed, so they are dropped (as by
    /// [`TargetModel::truncate`]). `n` may be 0 (drops the held features from `start` on).
    ///
    /// The caller guarantees that the features of positions `< start` are unchanged: they belong
    /// to the same tokens as when they were set. An uncommitted tree forward
    /// ([`TreeTarget::forward_tree`]) is ended by the truncation like by
    /// [`TargetModel::truncate`].
    ///
    /// # Errors
    /// [`crate::Error::ShapeMismatch`] when `start > target_hidden_len()` (`expected` is
    /// `start`, `actual` the held length) or when `rows.len()` is not a multiple of
    /// [`TargetFeatures::hidden_size`]; the held features and the sequence are then unchanged.
    /// [`crate::Error::Model`] for engine failures.
    fn set_target_hidden(&mut self, start: usize, rows: &[f32]) -> Result<()>;
}

/// Token-tree forward and commit: an optional extension of [`TargetModel`], offered through
/// [`TargetModel::tree`].
///
/// A tree step appends the root (the last committed token) and the `n` nodes of a
/// [`DraftBlock`] in one forward. Node `i` attends to the committed context, the root and its own
/// ancestors only (tree attention: SpecInfer, Miao et al. 2024, section 4.2; Medusa, Cai et al.
/// 2024, section 2.1.2), and takes the rotary position `seq_len + depth(i)`, where `seq_len` is
/// the length before the call (the root's position). After verification
/// [`TreeTarget::commit_tree`] keeps the root and the accepted path and drops every other node,
/// so the cache is the one a chain forward of the root and the path's tokens would leave.
///
/// Contract, checked by the loop and by the tests of the shipped engines:
/// - the logits of node `i` equal those of the same tokens verified as a chain (the path from the
///   root to `i`), up to the engine's batch invariance (bit for bit in
///   `speculative-candle`'s `FastTarget`);
/// - after `commit_tree(path)` the sequence length is `seq_len + 1 + path.len()` and the KV cache
///   equals a chain's;
/// - [`TargetModel::truncate`] to any length `<= seq_len` (as before the call) also undoes a tree
///   forward that is not committed.
pub trait TreeTarget {
    /// The most nodes one [`TreeTarget::forward_tree`] takes (`n`, the root not counted).
    fn max_tree_nodes(&self) -> usize;

    /// Appends the root token and the block's nodes and writes the logits of every appended
    /// position into `logits` (cleared first): `[n + 1, vocab]` row-major, row 0 after the root,
    /// row `i + 1` after node `i`. [`TargetModel::seq_len`] grows by `n + 1` until the commit.
    ///
    /// # Errors
    /// [`crate::Error::InvalidTree`] for a block that is not a valid tree or has more than
    /// [`TreeTarget::max_tree_nodes`] nodes (check it with `block.validate(&`
    /// [`TreeLimits::target`](crate::TreeLimits::target)`(vocab, max_tree_nodes))`: a target
    /// sees no q, so it must accept every sibling scheme); [`crate::Error::Model`] for engine failures and when
    /// the sequence would exceed [`TargetModel::max_context`] (counting every node). On error the
    /// sequence is left as it was.
    fn forward_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()>;

    /// Keeps the root and the nodes of `path` (node indices of the last
    /// [`TreeTarget::forward_tree`] block, root's child first, each the child of the previous;
    /// may be empty) and drops every other node, compacting the kept entries to contiguous
    /// positions. Afterwards [`TargetModel::seq_len`] is `seq_len_before_tree + 1 + path.len()`.
    ///
    /// # Errors
    /// [`crate::Error::TargetContract`] when no tree forward is pending or `path` is not a path
    /// of its block; [`crate::Error::Model`] for engine failures.
    fn commit_tree(&mut self, path: &[u32]) -> Result<()>;
}
