//! The engine-facing traits: what the decoding loop and the draft-model proposer need from an
//! inference engine.
//!
//! - [`TargetModel`]: a causal language model with a KV cache that can be rolled back; the only
//!   trait an engine must implement.
//! - [`TreeTarget`]: the optional tree forward (each node attends to the committed context and
//!   its ancestors) and the commit of an accepted path; an engine offers it through
//!   [`TargetModel::tree`]. Without it the loop verifies chains.
//! - [`HiddenStates`]: the optional final hidden states of the last forward, read by heads
//!   proposers (MTP / Medusa / EAGLE); offered through [`TargetModel::hidden_states`]. A
//!   target may instead hand over the states of chosen layers ([`FeatureLayout`]: EAGLE-3's
//!   fused low / middle / high layers) through the same rows.
//! - [`TargetFeatures`]: the optional input side of a feature-conditioned draft model (an EAGLE
//!   head): it holds the target's hidden states of the committed positions; offered through
//!   [`TargetModel::target_features`] and fed by [`crate::propose::DraftModelProposer`].
//! - [`Rollback`]: the optional rollback of a model whose state cannot be truncated (recurrent
//!   and hybrid models: Mamba, RWKV, gated delta-net layers): [`StateSnapshot`] (snapshot and
//!   replay) or [`RowStates`] (per-row states of the verify forward); offered through
//!   [`TargetModel::rollback`], and per slot through [`BatchTarget::rollback`].
//!
//! This module sits below [`crate::propose`] and [`crate::decode`], which both drive models
//! through it.

use crate::error::Result;
use crate::tree::DraftBlock;

mod layout;
pub use layout::{FeatureLayer, FeatureLayout};

/// A causal language model with a KV cache that can be rolled back.
///
/// Call order in the decoding loop ([`crate::decode::Generator`]): at the start of a generation
/// `truncate(p)`, where `p` is the prefix of the prompt the cache already holds from the
/// previous generation (0 with prefix reuse off or nothing in common; at most `n - 1`), then,
/// when `p < n - 1`, one [`TargetModel::prefill`] with `prompt[p..n - 1]` (no logits needed;
/// with the fused prefill, [`crate::decode::Generator::with_fused_prefill`], those tokens go
/// instead ahead of the first step's rows in one [`TargetModel::forward_tail`]).
/// Then, once per speculative step, one
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
    /// sequence would exceed [`TargetModel::max_context`], and an error (for example
    /// [`crate::Error::TokenOutOfVocab`]) for a token id `>= vocab_size()`. On error the
    /// sequence is left as it was (nothing of the call is appended). An empty `tokens` is
    /// refused or changes nothing.
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()>;

    /// Drops every position at index `>= len` (KV-cache rollback). `len` greater than
    /// [`TargetModel::seq_len`] is an error.
    ///
    /// # Errors
    /// [`crate::Error::Model`] when `len > seq_len()` or the engine fails.
    fn truncate(&mut self, len: usize) -> Result<()>;

    /// Appends `tokens` (`n >= 1`) whose logits the caller will not read: the prompt before its
    /// last token. [`crate::decode::Generator`] calls it once per generation with the prompt
    /// tokens its cache does not hold yet, right after the `truncate` to the reused prefix and
    /// before the first [`TargetModel::forward`];
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

    /// Appends `tokens` (`n >= 1`) and writes the logits of their last `rows` positions
    /// (`1 <= rows <= n`) into `logits`, cleared first: `[rows, vocab]` row-major, row `i`
    /// following `tokens[n - rows + i]`. The first `n - rows` tokens are fed as by
    /// [`TargetModel::prefill`] (no logits read). [`crate::decode::Generator`] calls it for a
    /// fused prefill: the prompt tokens prefix reuse left to feed, followed by the first
    /// step's verify rows `[last, d_1 .. d_k]`, in one forward
    /// ([`crate::decode::Generator::with_fused_prefill`]).
    ///
    /// The default is [`TargetModel::prefill`] of the first `n - rows` tokens (when any)
    /// followed by [`TargetModel::forward`] of the rest: two forwards, exactly as without a
    /// fused prefill. Engines that can skip the output head per row should override it with
    /// one forward over all `n` rows and the head over the last `rows` only; the logits must
    /// then equal the default's (bit for bit on a batch-invariant engine: a row's logits do not
    /// depend on the other rows of the call), the KV cache and
    /// [`HiddenStates::last_hidden`] (when offered: every appended row, `[n, hidden]`) as
    /// after `forward` of all `n` tokens. On error the sequence should be left as it was.
    ///
    /// # Errors
    /// As [`TargetModel::forward`]; [`crate::Error::Model`] for `rows == 0` or `rows > n`
    /// (the default's check).
    fn forward_tail(&mut self, tokens: &[u32], rows: usize, logits: &mut Vec<f32>) -> Result<()> {
        check_tail(tokens.len(), rows)?;
        let head = tokens.len() - rows;
        if head > 0 {
            let len = self.seq_len();
            self.prefill(&tokens[..head])?;
            if let Err(e) = self.forward(&tokens[head..], logits) {
                // Leave the sequence as it was (best effort: a failed truncation keeps the
                // forward's error).
                let _ = self.truncate(len);
                return Err(e);
            }
            return Ok(());
        }
        self.forward(tokens, logits)
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

    /// How the model rolls its state back, `None` (the default) when
    /// [`TargetModel::truncate`] can drop any suffix (a KV cache). A model whose running state
    /// has no positions to drop (recurrent and hybrid layers) returns
    /// [`Rollback::Snapshot`] or [`Rollback::RowStates`] (see [`Rollback`] for the contract);
    /// [`crate::decode::Generator`] and [`crate::propose::DraftModelProposer`] then use it
    /// instead of truncating to a length other than 0. Such a model is driven with chains: the
    /// loop does not use its [`TargetModel::tree`].
    fn rollback(&mut self) -> Option<Rollback<'_>> {
        None
    }

    /// `true` when [`TargetModel::copy_prefix_from`] works for this model (the default:
    /// `false`). [`PerSlot`] then offers [`BatchTarget::copy_prefix`].
    fn supports_prefix_copy(&self) -> bool {
        false
    }

    /// Makes this model's sequence the first `len` positions of `src`'s (its KV entries
    /// copied; whatever this model held is dropped, a pending tree too), so that a sequence
    /// sharing a prefix with another (a common system prompt) need not prefill it again.
    /// `src` must be the same model (the same weights and settings; [`PerSlot`]'s slots are),
    /// and is left unchanged. Afterwards this model's logits and hidden states for any
    /// continuation equal `src`'s for the same continuation. Not part of the object-safe
    /// interface (`Self: Sized`).
    ///
    /// # Errors
    /// [`crate::Error::TargetContract`] when the model does not support it (the default);
    /// [`crate::Error::Model`] when `len > src.seq_len()`, `src` has a pending tree, or the
    /// models differ. On error this model's sequence is unchanged or empty.
    fn copy_prefix_from(&mut self, src: &Self, len: usize) -> Result<()>
    where
        Self: Sized,
    {
        let _ = (src, len);
        Err(crate::Error::TargetContract {
            what: "copy_prefix_from called on a TargetModel without prefix copy",
        })
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
    fn forward_tail(&mut self, tokens: &[u32], rows: usize, logits: &mut Vec<f32>) -> Result<()> {
        (**self).forward_tail(tokens, rows, logits)
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
    fn rollback(&mut self) -> Option<Rollback<'_>> {
        (**self).rollback()
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
    fn forward_tail(&mut self, tokens: &[u32], rows: usize, logits: &mut Vec<f32>) -> Result<()> {
        (**self).forward_tail(tokens, rows, logits)
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
    fn rollback(&mut self) -> Option<Rollback<'_>> {
        (**self).rollback()
    }
}

/// `Err(Model)` unless `1 <= rows <= n` ([`TargetModel::forward_tail`]'s rows of `n` tokens).
///
/// # Errors
/// [`crate::Error::Model`] naming both counts.
pub(crate) fn check_tail(n: usize, rows: usize) -> Result<()> {
    if rows == 0 || rows > n {
        return Err(crate::Error::model(format!(
            "forward_tail: {rows} logit rows of {n} tokens (need 1 <= rows <= n)"
        )));
    }
    Ok(())
}

/// Which rollback a model offers: a plain value of [`Rollback`] / [`BatchRollback`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RollbackMode {
    /// [`TargetModel::truncate`] drops any suffix (a KV cache): no rollback capability (the
    /// default).
    #[default]
    Truncate,
    /// Snapshot and replay ([`StateSnapshot`]).
    Snapshot,
    /// Per-row states of the verify forward ([`RowStates`]).
    RowStates,
}

/// How a model whose state cannot be truncated rolls a step back, offered through
/// [`TargetModel::rollback`].
///
/// Recurrent and hybrid models (Mamba / Mamba-2, RWKV, gated delta-net layers as in Qwen3-Next,
/// Jamba) hold a running state with no positions to drop, so after a verify forward over
/// `[last, d_1 .. d_k]` that rejected drafts, `truncate` cannot bring the state back to
/// `[last, d_1 .. d_a]`. Engines do it one of two ways, and the loop drives either:
///
/// - [`Rollback::Snapshot`] (checkpoint and replay; llama.cpp's recurrent-state checkpoints,
///   `llama_state_seq_get_data` / `llama_state_seq_set_data`): the loop saves the state at the
///   start of each step ([`StateSnapshot::save_state`]); after a rejection it restores it and
///   **replays** the tokens to keep, `[last, d_1 .. d_a]` (`a + 1` tokens, one
///   [`TargetModel::prefill`]: their logits are known from the verify forward, and the next step
///   feeds the last emitted token as usual). The replay costs a forward of `a + 1` tokens per
///   step with a rejection: [`crate::decode::Metrics::replayed_tokens`] and
///   [`crate::decode::Metrics::replay_time`] count it, and the adaptive policy's cost of such a
///   step is `c(k + 1) + c(a + 1)` ([`crate::decode::StepCosts::replay_secs`]). A step that
///   accepts every draft needs no replay.
/// - [`Rollback::RowStates`] (per-row states; vLLM's and SGLang's Mamba state handling under
///   speculative decoding): the model keeps the state after each position its forwards append
///   and the loop keeps the accepted row's ([`RowStates::keep_rows`]): no replay, at the cost
///   of `k + 1` states of memory (a Mamba-2 layer's state is `heads * head_dim * state_size`
///   floats per sequence). Public reports put it several times faster than replay (llama.cpp
///   issue 28120: 44 vs 6 tokens/s on one model).
///
/// Contract of a model that offers either (checked by `conformance::check_rollback`, feature
/// `conformance`):
/// - [`TargetModel::truncate`]`(0)` resets the sequence (the loops call it at the start of a
///   generation) and `truncate(seq_len())` changes nothing; any other length may be refused
///   with [`crate::Error::StateRollback`], the state unchanged.
/// - [`TargetModel::forward`] and [`TargetModel::prefill`] append as for any model, and their
///   errors leave the state as it was.
/// - The loop never asks such a model for trees: it verifies chains (tree requests fall back
///   to chains, as on a model without [`TargetModel::tree`]).
#[non_exhaustive]
pub enum Rollback<'a> {
    /// The model saves and restores its whole state.
    Snapshot(&'a mut dyn StateSnapshot),
    /// The model keeps the state after each appended position.
    RowStates(&'a mut dyn RowStates),
}

impl Rollback<'_> {
    /// The mode as a plain value.
    pub fn mode(&self) -> RollbackMode {
        match self {
            Rollback::Snapshot(_) => RollbackMode::Snapshot,
            Rollback::RowStates(_) => RollbackMode::RowStates,
        }
    }
}

impl std::fmt::Debug for Rollback<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Rollback::{:?}", self.mode())
    }
}

/// The rollback mode of `model`: [`RollbackMode::Truncate`] when it offers no
/// [`TargetModel::rollback`].
pub fn rollback_mode<T: TargetModel + ?Sized>(model: &mut T) -> RollbackMode {
    model
        .rollback()
        .map_or(RollbackMode::Truncate, |r| r.mode())
}

/// Snapshot and restore of a model's whole state ([`Rollback::Snapshot`]).
///
/// One snapshot is held at a time. The loop calls [`StateSnapshot::save_state`] before each
/// verify forward and, after a rejection, [`StateSnapshot::restore_state`] followed by a
/// [`TargetModel::prefill`] of the tokens to keep. Memory: one copy of the state (for a hybrid
/// model that also holds a KV cache, whatever its snapshot holds: llama.cpp's full sequence
/// state copies the KV cells too).
pub trait StateSnapshot {
    /// Saves the state of the sequence as it is now (its [`TargetModel::seq_len`] positions),
    /// replacing the saved one.
    ///
    /// # Errors
    /// [`crate::Error::Model`] for engine failures (nothing is saved then).
    fn save_state(&mut self) -> Result<()>;

    /// Restores the saved state: afterwards the model is exactly as when it was saved,
    /// [`TargetModel::seq_len`] included. The snapshot stays: it may be restored again, until
    /// the next [`StateSnapshot::save_state`] or [`TargetModel::truncate`]`(0)` (which drops
    /// it).
    ///
    /// # Errors
    /// [`crate::Error::StateRollback`] when no state is saved; [`crate::Error::Model`] for engine
    /// failures. The state is unchanged on error.
    fn restore_state(&mut self) -> Result<()>;
}

/// Per-row states ([`Rollback::RowStates`]): the model keeps the state after each position
/// that [`TargetModel::forward`] appended since its **commit point**, and keeps the one asked
/// for.
///
/// The commit point is the sequence's end after the last [`TargetModel::prefill`],
/// [`TargetModel::truncate`]`(0)` or [`RowStates::keep_rows`] (a prefill's positions keep no
/// states of their own). So in the loop, after the verify forward of `[last, d_1 .. d_k]` the
/// model holds `k + 1` row states, and `keep_rows(a + 1)` leaves the state after
/// `[last, d_1 .. d_a]`. A draft model fed one token per forward holds one state per draft
/// ([`crate::propose::DraftModelProposer`] keeps the accepted ones the same way). Memory: one
/// state per position since the commit point, plus the commit point's.
pub trait RowStates {
    /// Positions appended by [`TargetModel::forward`] since the commit point (whose states
    /// are held), in tokens.
    fn pending_rows(&self) -> usize;

    /// Keeps the first `rows` positions appended since the commit point and drops the rest:
    /// afterwards the state is the one after those positions, [`TargetModel::seq_len`] is the
    /// commit point plus `rows`, and that is the new commit point. `rows == 0` goes back to the
    /// commit point; `rows == pending_rows()` keeps everything.
    ///
    /// # Errors
    /// [`crate::Error::StateRollback`] when `rows > pending_rows()`; [`crate::Error::Model`] for
    /// engine failures. The state is unchanged on error.
    fn keep_rows(&mut self, rows: usize) -> Result<()>;
}

/// The per-slot rollback of a [`BatchTarget`] whose slots' states cannot be truncated, offered
/// through [`BatchTarget::rollback`]: [`Rollback`]'s two modes, for each slot on its own (the
/// slot's commit point is set by its prefill chunks, `truncate(slot, 0)`, `release(slot)` and
/// [`BatchRowStates::keep_rows`]; its chain chunks append row states).
/// [`crate::decode::BatchGenerator`] saves the state of each decoding slot before the batched
/// forward (snapshot mode) and, after the verification, restores and replays each slot that
/// rejected drafts in a forward of its own (replays are not batched across slots), or keeps its
/// accepted row. Trees are not used with such a target.
#[non_exhaustive]
pub enum BatchRollback<'a> {
    /// Each slot saves and restores its state.
    Snapshot(&'a mut dyn BatchStateSnapshot),
    /// Each slot keeps the state after each appended position.
    RowStates(&'a mut dyn BatchRowStates),
}

impl BatchRollback<'_> {
    /// The mode as a plain value.
    pub fn mode(&self) -> RollbackMode {
        match self {
            BatchRollback::Snapshot(_) => RollbackMode::Snapshot,
            BatchRollback::RowStates(_) => RollbackMode::RowStates,
        }
    }
}

impl std::fmt::Debug for BatchRollback<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BatchRollback::{:?}", self.mode())
    }
}

/// [`StateSnapshot`] per slot of a [`BatchTarget`].
pub trait BatchStateSnapshot {
    /// [`StateSnapshot::save_state`] of `slot`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`]; engine failures.
    fn save_state(&mut self, slot: usize) -> Result<()>;

    /// [`StateSnapshot::restore_state`] of `slot`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`]; [`crate::Error::StateRollback`] when the slot has no saved
    /// state; engine failures.
    fn restore_state(&mut self, slot: usize) -> Result<()>;
}

/// [`RowStates`] per slot of a [`BatchTarget`].
pub trait BatchRowStates {
    /// [`RowStates::pending_rows`] of `slot` (`&mut self`: [`PerSlot`] reaches its models'
    /// [`TargetModel::rollback`], which takes `&mut`).
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`].
    fn pending_rows(&mut self, slot: usize) -> Result<usize>;

    /// [`RowStates::keep_rows`] of `slot`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`]; [`crate::Error::StateRollback`] when
    /// `rows > pending_rows(slot)`; engine failures.
    fn keep_rows(&mut self, slot: usize, rows: usize) -> Result<()>;
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

    /// What each row of [`HiddenStates::last_hidden`] holds: the hidden states of the layers
    /// of the layout, concatenated in its order (row `r`'s columns `j · width .. (j + 1) ·
    /// width` are `layers[j]` of the `r`-th appended position; [`FeatureLayout`]). Must satisfy
    /// `feature_layout().row_width() == hidden_size()`. The default, for engines that hand over
    /// the final hidden state only, is [`FeatureLayout::final_only`]`(hidden_size())`; an
    /// engine configured to expose other layers (for EAGLE-3 or MTP drafters) returns them
    /// here, and every row it appends (forward, prefill, tree forward, k = 0 steps) carries
    /// them, so the loop's per-position rows, kept across steps and cut on rollback, carry
    /// them too.
    fn feature_layout(&self) -> FeatureLayout {
        FeatureLayout::final_only(self.hidden_size())
    }
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

    /// The layout of the feature rows this model reads ([`HiddenStates::feature_layout`] of
    /// the target it was trained on; `row_width()` must equal
    /// [`TargetFeatures::hidden_size`]). Default: [`FeatureLayout::final_only`]`(hidden_size())`
    /// (EAGLE-1/2). The caller that builds the pair checks that it equals the target's.
    fn feature_layout(&self) -> FeatureLayout {
        FeatureLayout::final_only(self.hidden_size())
    }
}

/// Checks that a draft model reads the feature rows a target hands over: the draft's
/// [`TargetFeatures::feature_layout`] equals the target's [`HiddenStates::feature_layout`]
/// (same layers, same order, same width). Call it where the pair is built: the loop and
/// [`crate::propose::DraftModelProposer`] only see the row width, which two layouts of as many
/// layers share.
///
/// # Errors
/// [`crate::Error::InvalidConfig`] (field `feature_layout`) naming both layouts.
pub fn check_feature_layouts(target: &dyn HiddenStates, draft: &dyn TargetFeatures) -> Result<()> {
    let (t, d) = (target.feature_layout(), draft.feature_layout());
    if t == d {
        Ok(())
    } else {
        Err(crate::Error::config(
            "feature_layout",
            format!("target {t:?}, draft {d:?}"),
            "the draft model must read the layers the target hands over",
        ))
    }
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

/// What one slot appends in a [`BatchTarget::forward_batch`] call.
#[derive(Debug, Clone, Copy)]
pub enum SlotInput<'a> {
    /// Append these tokens (`n >= 1`) without writing logits: a prompt prefill chunk. The KV
    /// cache afterwards equals the one [`SlotInput::Chain`] with the same tokens leaves.
    Prefill(&'a [u32]),
    /// Append these tokens (`n >= 1`) and write their `[n, vocab]` logits: row `i` follows
    /// `tokens[i]` (a verify chain `[last, d_1 .. d_k]`, or the last chunk of a prefill).
    Chain(&'a [u32]),
    /// Append `root` and the nodes of a valid token tree (as [`TreeTarget::forward_tree`]:
    /// each node attends to the slot's committed context and its ancestors, at the rotary
    /// position of its depth) and write `[nodes + 1, vocab]` logits, root row first. The tree is
    /// pending until [`BatchTarget::commit_tree`] or [`BatchTarget::truncate`] of that slot.
    /// Only for targets with [`BatchTarget::max_tree_nodes`] `> 0`.
    Tree {
        /// The slot's last committed token (row 0).
        root: u32,
        /// The nodes (rows `1 ..= block.len()`).
        block: DraftBlock<'a>,
    },
}

impl SlotInput<'_> {
    /// Rows this input appends: `n` tokens for a chain or prefill, `nodes + 1` for a tree.
    pub fn rows(&self) -> usize {
        match self {
            SlotInput::Prefill(t) | SlotInput::Chain(t) => t.len(),
            SlotInput::Tree { block, .. } => block.rows(),
        }
    }

    /// Rows of logits this input writes: 0 for a prefill, [`SlotInput::rows`] otherwise.
    pub fn logit_rows(&self) -> usize {
        match self {
            SlotInput::Prefill(_) => 0,
            _ => self.rows(),
        }
    }
}

/// One slot's part of a [`BatchTarget::forward_batch`] call.
#[derive(Debug, Clone, Copy)]
pub struct SlotChunk<'a> {
    /// The slot (`0 .. max_slots()`).
    pub slot: usize,
    /// What it appends.
    pub input: SlotInput<'a>,
}

/// A causal language model that runs several sequences in one forward (continuous batching).
///
/// Sequences live in *slots* `0 .. max_slots()`, each with its own KV cache that starts empty
/// and can be rolled back per slot. One [`BatchTarget::forward_batch`] call appends a chunk to
/// each listed slot: prompt prefill chunks (no logits), verify chains and token trees mixed
/// freely, so an engine reads each weight once for every row of the batch. The logits come
/// back in one buffer: the chunks' logit rows in call order ([`SlotInput::logit_rows`] each,
/// prefill chunks none), `[sum of logit rows, vocab]` row-major.
///
/// Call order in the batch loop ([`crate::decode::BatchGenerator`]): a slot is taken for a
/// request with `truncate(slot, p)` (`p` the prefix of its prompt the slot's cache holds, kept
/// from an earlier request or put there by [`BatchTarget::copy_prefix`]; 0 without prefix
/// reuse), receives the rest of its prompt but the last token in prefill chunks, then one
/// chain or tree per step, followed by `truncate(slot, len)` (chains) or
/// `commit_tree(slot, path)` (trees) to drop rejected drafts; `release(slot)` when the request
/// ends (with prefix reuse, only when the slot's cache is not kept). A batch never lists a slot
/// twice.
///
/// Engines that run one sequence at a time get this trait from [`PerSlot`], which holds one
/// [`TargetModel`] per slot and runs the chunks one after the other. Every slot starts empty
/// (`seq_len(slot) == 0`); [`check_slots`] does the slot checks `forward_batch` owes.
///
/// The trait is object safe (`Box<dyn BatchTarget + Send>`).
///
/// # Contract (what the batch loop checks and relies on)
/// - The logits of a slot's rows must not depend on which other slots share the call (batch
///   invariance): then every request's greedy output equals its output alone, which the loop
///   guarantees only given the logits it receives.
/// - On error the call changes no slot (or the loop cannot recover: it ends every request in
///   the batch with that error).
pub trait BatchTarget {
    /// Number of logits per position (the output head's width), in tokens.
    fn vocab_size(&self) -> usize;

    /// Maximum tokens one slot can hold (prompt + generated).
    fn max_context(&self) -> usize;

    /// Number of slots (the most sequences held at once).
    fn max_slots(&self) -> usize;

    /// The most rows ([`SlotInput::rows`] summed) one [`BatchTarget::forward_batch`] call
    /// takes, in tokens.
    fn max_batch_tokens(&self) -> usize;

    /// The most nodes of one slot's tree ([`SlotInput::Tree`]); 0 (the default) when the
    /// engine verifies chains only.
    fn max_tree_nodes(&self) -> usize {
        0
    }

    /// Tokens held by `slot` (its KV cache length; a pending tree counts its root and nodes).
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`] for `slot >= max_slots()`.
    fn seq_len(&self, slot: usize) -> Result<usize>;

    /// Appends every chunk to its slot in one forward and writes the logits (cleared first) of
    /// the chunks that ask for them, in call order (see the trait docs).
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`] for a slot out of range or listed twice ([`check_slots`]);
    /// engine failures, a context overflow or more than [`BatchTarget::max_batch_tokens`] rows
    /// as [`crate::Error::Model`]; [`crate::Error::InvalidTree`] for a malformed tree;
    /// [`crate::Error::TargetContract`] for a tree chunk on an engine without tree support.
    fn forward_batch(&mut self, chunks: &[SlotChunk<'_>], logits: &mut Vec<f32>) -> Result<()>;

    /// Drops every position of `slot` at index `>= len` (KV-cache rollback; a pending tree is
    /// dropped when `len <= ` its root's position + 1).
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`]; [`crate::Error::Model`] when `len > seq_len(slot)`.
    fn truncate(&mut self, slot: usize, len: usize) -> Result<()>;

    /// Keeps the root and the nodes `path` of `slot`'s pending tree (node indices, each the
    /// child of the one before, the first a child of the root) and drops the other nodes, as
    /// [`TreeTarget::commit_tree`]; the slot then holds its context, the root and the path,
    /// compacted to contiguous positions.
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`]; [`crate::Error::TargetContract`] when no tree is pending
    /// or the engine has no tree support (the default).
    fn commit_tree(&mut self, slot: usize, path: &[u32]) -> Result<()> {
        let _ = (slot, path);
        Err(crate::Error::TargetContract {
            what: "commit_tree called on a BatchTarget without tree support",
        })
    }

    /// Ends `slot`'s sequence and frees what it holds (its KV cache may be kept for reuse but
    /// `seq_len(slot)` is 0 afterwards).
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`]; engine failures. The batch loop does not use a slot again
    /// after its release failed.
    fn release(&mut self, slot: usize) -> Result<()>;

    /// How the slots roll their state back, `None` (the default) when
    /// [`BatchTarget::truncate`] can drop any suffix. See [`BatchRollback`] (and [`Rollback`]
    /// for the contract, per slot: `truncate(slot, 0)` and `truncate(slot, seq_len)` must work,
    /// other lengths may be refused with [`crate::Error::StateRollback`]).
    fn rollback(&mut self) -> Option<BatchRollback<'_>> {
        None
    }

    /// `true` when the engine copies prefixes between slots ([`BatchTarget::copy_prefix`]); the
    /// default is `false`.
    fn can_copy_prefix(&self) -> bool {
        false
    }

    /// Makes slot `dst` hold the first `len` positions of slot `src` (their KV entries,
    /// copied or shared; `dst`'s previous contents are dropped; `src` is unchanged), so that a
    /// request sharing a prefix with another slot's sequence (a common system prompt) does not
    /// prefill it again. Afterwards `dst`'s logits for any continuation equal those `src`
    /// would give for it. The batch loop calls it between steps, when no slot has a pending
    /// tree, for a `dst` it is about to give to a new request.
    ///
    /// # Errors
    /// [`crate::Error::InvalidSlot`]; [`crate::Error::Model`] when `src == dst` or
    /// `len > seq_len(src)`; [`crate::Error::TargetContract`] when the engine does not copy
    /// prefixes (the default). On error `dst` holds its previous contents or nothing.
    fn copy_prefix(&mut self, src: usize, dst: usize, len: usize) -> Result<()> {
        let _ = (src, dst, len);
        Err(crate::Error::TargetContract {
            what: "copy_prefix called on a BatchTarget without prefix copy",
        })
    }
}

impl<T: BatchTarget + ?Sized> BatchTarget for Box<T> {
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
    fn max_context(&self) -> usize {
        (**self).max_context()
    }
    fn max_slots(&self) -> usize {
        (**self).max_slots()
    }
    fn max_batch_tokens(&self) -> usize {
        (**self).max_batch_tokens()
    }
    fn max_tree_nodes(&self) -> usize {
        (**self).max_tree_nodes()
    }
    fn seq_len(&self, slot: usize) -> Result<usize> {
        (**self).seq_len(slot)
    }
    fn forward_batch(&mut self, chunks: &[SlotChunk<'_>], logits: &mut Vec<f32>) -> Result<()> {
        (**self).forward_batch(chunks, logits)
    }
    fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        (**self).truncate(slot, len)
    }
    fn commit_tree(&mut self, slot: usize, path: &[u32]) -> Result<()> {
        (**self).commit_tree(slot, path)
    }
    fn release(&mut self, slot: usize) -> Result<()> {
        (**self).release(slot)
    }
    fn rollback(&mut self) -> Option<BatchRollback<'_>> {
        (**self).rollback()
    }

    fn can_copy_prefix(&self) -> bool {
        (**self).can_copy_prefix()
    }
    fn copy_prefix(&mut self, src: usize, dst: usize, len: usize) -> Result<()> {
        (**self).copy_prefix(src, dst, len)
    }
}

/// Checks that every chunk's slot is below `max_slots` and listed once (for implementations of
/// [`BatchTarget::forward_batch`]).
///
/// # Errors
/// [`crate::Error::InvalidSlot`].
pub fn check_slots(chunks: &[SlotChunk<'_>], max_slots: usize) -> Result<()> {
    for (i, c) in chunks.iter().enumerate() {
        if c.slot >= max_slots {
            return Err(crate::Error::InvalidSlot {
                slot: c.slot,
                max_slots,
                reason: "out of range",
            });
        }
        if chunks[..i].iter().any(|o| o.slot == c.slot) {
            return Err(crate::Error::InvalidSlot {
                slot: c.slot,
                max_slots,
                reason: "listed twice in one batch",
            });
        }
    }
    Ok(())
}

/// A [`BatchTarget`] over single-sequence engines: one [`TargetModel`] per slot, the chunks of a
/// batch run one after the other (prefill chunks through [`TargetModel::prefill`], chains
/// through [`TargetModel::forward`], trees through [`TreeTarget::forward_tree`] when every
/// slot's model offers them). Any engine with the simple trait can thus use the batch loop; it
/// gains no batching speed (each slot's forward reads the weights again), and its logits are
/// batch-invariant by construction.
///
/// Memory: whatever the `n` models hold (for models sharing weights, `n` KV caches).
///
/// # Example
/// ```
/// use speculative::{BatchTarget, PerSlot, SlotChunk, SlotInput};
/// use speculative::test_util::ToyModel;
///
/// let mut batch = PerSlot::new((0..2).map(|_| ToyModel::c10()).collect()).unwrap();
/// let mut logits = Vec::new();
/// batch
///     .forward_batch(
///         &[
///             SlotChunk { slot: 0, input: SlotInput::Prefill(&[1, 2, 3]) },
///             SlotChunk { slot: 1, input: SlotInput::Chain(&[4, 5]) },
///         ],
///         &mut logits,
///     )
///     .unwrap();
/// assert_eq!(logits.len(), 2 * batch.vocab_size());
/// assert_eq!(batch.seq_len(0).unwrap(), 3);
/// ```
#[derive(Debug)]
pub struct PerSlot<T> {
    models: Vec<T>,
    rows: Vec<f32>,
    /// The smallest [`TreeTarget::max_tree_nodes`] over the models (0: chains only).
    tree_nodes: usize,
    /// The models' common [`TargetModel::rollback`] mode.
    rollback: RollbackMode,
}

impl<T: TargetModel> PerSlot<T> {
    /// One slot per model. The models must share the vocabulary size, the context length and
    /// the rollback mode ([`TargetModel::rollback`]; models that cannot truncate make a
    /// [`BatchTarget`] with the same [`BatchTarget::rollback`], per slot).
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] for an empty list or models of different vocabulary size,
    /// context length or rollback mode.
    pub fn new(mut models: Vec<T>) -> Result<Self> {
        let Some(first) = models.first() else {
            return Err(crate::Error::InvalidConfig {
                field: "models",
                value: "0".into(),
                reason: "need at least one model (one per slot)",
            });
        };
        let (v, c) = (first.vocab_size(), first.max_context());
        if models
            .iter()
            .any(|m| m.vocab_size() != v || m.max_context() != c)
        {
            return Err(crate::Error::InvalidConfig {
                field: "models",
                value: format!("{} models", models.len()),
                reason: "every slot's model must have the same vocab_size and max_context",
            });
        }
        let tree_nodes = models
            .iter_mut()
            .map(|m| m.tree().map_or(0, |t| t.max_tree_nodes()))
            .min()
            .unwrap_or(0);
        let rollback = rollback_mode(&mut models[0]);
        if models.iter_mut().any(|m| rollback_mode(m) != rollback) {
            return Err(crate::Error::InvalidConfig {
                field: "models",
                value: format!("{} models", models.len()),
                reason: "every slot's model must have the same rollback mode",
            });
        }
        Ok(PerSlot {
            models,
            rows: Vec::new(),
            tree_nodes,
            rollback,
        })
    }

    /// The model of `slot`.
    pub fn model(&self, slot: usize) -> Option<&T> {
        self.models.get(slot)
    }

    /// Gives the models back.
    pub fn into_models(self) -> Vec<T> {
        self.models
    }

    /// The checks a model that cannot truncate would fail in a chunk, made before any chunk
    /// runs: ids `>= vocab_size`, a chunk past the slot's context, a tree chunk.
    fn check_chunks(&self, chunks: &[SlotChunk<'_>]) -> Result<()> {
        let vocab = self.vocab_size();
        for c in chunks {
            let m = &self.models[c.slot];
            let tokens = match c.input {
                SlotInput::Prefill(t) | SlotInput::Chain(t) => t,
                SlotInput::Tree { .. } => {
                    return Err(crate::Error::TargetContract {
                        what: "a tree chunk for a slot whose model cannot truncate",
                    });
                }
            };
            if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(crate::Error::TokenOutOfVocab {
                    what: "batch chunk token",
                    token: t,
                    vocab_size: vocab,
                });
            }
            if m.seq_len() + tokens.len() > m.max_context() {
                return Err(crate::Error::model(format!(
                    "slot {}: context overflow: {} + {} > {}",
                    c.slot,
                    m.seq_len(),
                    tokens.len(),
                    m.max_context()
                )));
            }
        }
        Ok(())
    }

    fn slot_mut(&mut self, slot: usize) -> Result<&mut T> {
        let n = self.models.len();
        self.models.get_mut(slot).ok_or(crate::Error::InvalidSlot {
            slot,
            max_slots: n,
            reason: "out of range",
        })
    }
}

impl<T: TargetModel> BatchTarget for PerSlot<T> {
    fn vocab_size(&self) -> usize {
        self.models[0].vocab_size()
    }

    fn max_context(&self) -> usize {
        self.models[0].max_context()
    }

    fn max_slots(&self) -> usize {
        self.models.len()
    }

    /// No limit of its own: each chunk is one call of its slot's model.
    fn max_batch_tokens(&self) -> usize {
        usize::MAX
    }

    /// The smallest tree capacity over the slots' models (0 when one has no tree support),
    /// read at construction.
    fn max_tree_nodes(&self) -> usize {
        self.tree_nodes
    }

    fn seq_len(&self, slot: usize) -> Result<usize> {
        self.models
            .get(slot)
            .map(|m| m.seq_len())
            .ok_or(crate::Error::InvalidSlot {
                slot,
                max_slots: self.models.len(),
                reason: "out of range",
            })
    }

    /// Runs the chunks in order. On an error in chunk `i`, the slots of chunks before `i` are
    /// truncated back to their lengths before the call (a tree they appended is dropped), so
    /// the call changes no slot. Models that cannot truncate ([`TargetModel::rollback`]) cannot
    /// be rolled back here: their chunks' token ids and context room are checked before any
    /// chunk runs, and an engine failure in a later chunk leaves the earlier ones appended
    /// (the batch loop then restores each decoding slot from its own snapshot or row states).
    fn forward_batch(&mut self, chunks: &[SlotChunk<'_>], logits: &mut Vec<f32>) -> Result<()> {
        check_slots(chunks, self.models.len())?;
        if self.rollback != RollbackMode::Truncate {
            self.check_chunks(chunks)?;
        }
        logits.clear();
        let mut rows = std::mem::take(&mut self.rows);
        let mut out = Ok(());
        let mut done = 0;
        for c in chunks {
            let m = &mut self.models[c.slot];
            let r = match c.input {
                SlotInput::Prefill(t) => m.prefill(t),
                SlotInput::Chain(t) => m.forward(t, &mut rows).map(|()| logits.extend(&rows)),
                SlotInput::Tree { root, block } => match m.tree() {
                    Some(tree) => tree
                        .forward_tree(root, &block, &mut rows)
                        .map(|()| logits.extend(&rows)),
                    None => Err(crate::Error::TargetContract {
                        what: "a tree chunk for a slot whose model has no tree support",
                    }),
                },
            };
            if let Err(e) = r {
                out = Err(e);
                break;
            }
            done += 1;
        }
        self.rows = rows;
        if out.is_err() {
            logits.clear();
            for c in chunks[..done]
                .iter()
                .filter(|_| self.rollback == RollbackMode::Truncate)
            {
                let m = &mut self.models[c.slot];
                // Every chunk appended exactly its rows; a failed rollback would only hide the
                // original error, which is the one returned.
                let _ = m.truncate(m.seq_len() - c.input.rows());
            }
        }
        out
    }

    fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        self.slot_mut(slot)?.truncate(len)
    }

    fn commit_tree(&mut self, slot: usize, path: &[u32]) -> Result<()> {
        match self.slot_mut(slot)?.tree() {
            Some(t) => t.commit_tree(path),
            None => Err(crate::Error::TargetContract {
                what: "commit_tree for a slot whose model has no tree support",
            }),
        }
    }

    fn release(&mut self, slot: usize) -> Result<()> {
        self.slot_mut(slot)?.truncate(0)
    }

    /// The models' rollback, per slot (read at construction).
    fn rollback(&mut self) -> Option<BatchRollback<'_>> {
        match self.rollback {
            RollbackMode::Truncate => None,
            RollbackMode::Snapshot => Some(BatchRollback::Snapshot(self)),
            RollbackMode::RowStates => Some(BatchRollback::RowStates(self)),
        }
    }

    /// `true` when the slots' models support [`TargetModel::copy_prefix_from`].
    fn can_copy_prefix(&self) -> bool {
        self.models.iter().all(|m| m.supports_prefix_copy())
    }

    /// [`TargetModel::copy_prefix_from`] from `src`'s model into `dst`'s.
    fn copy_prefix(&mut self, src: usize, dst: usize, len: usize) -> Result<()> {
        self.slot_mut(src)?;
        self.slot_mut(dst)?;
        if src == dst {
            return Err(crate::Error::model("copy_prefix from a slot into itself"));
        }
        let (a, b) = self.models.split_at_mut(src.max(dst));
        let (from, to) = if src < dst {
            (&a[src], &mut b[0])
        } else {
            (&b[0], &mut a[dst])
        };
        to.copy_prefix_from(from, len)
    }
}

/// The error of a slot whose model stopped offering the rollback it offered at construction.
const ROLLBACK_GONE: crate::Error = crate::Error::TargetContract {
    what: "a slot's model no longer offers the rollback mode it had at PerSlot::new",
};

impl<T: TargetModel> BatchStateSnapshot for PerSlot<T> {
    fn save_state(&mut self, slot: usize) -> Result<()> {
        match self.slot_mut(slot)?.rollback() {
            Some(Rollback::Snapshot(s)) => s.save_state(),
            _ => Err(ROLLBACK_GONE),
        }
    }

    fn restore_state(&mut self, slot: usize) -> Result<()> {
        match self.slot_mut(slot)?.rollback() {
            Some(Rollback::Snapshot(s)) => s.restore_state(),
            _ => Err(ROLLBACK_GONE),
        }
    }
}

impl<T: TargetModel> BatchRowStates for PerSlot<T> {
    fn pending_rows(&mut self, slot: usize) -> Result<usize> {
        match self.slot_mut(slot)?.rollback() {
            Some(Rollback::RowStates(r)) => Ok(r.pending_rows()),
            _ => Err(ROLLBACK_GONE),
        }
    }

    fn keep_rows(&mut self, slot: usize, rows: usize) -> Result<()> {
        match self.slot_mut(slot)?.rollback() {
            Some(Rollback::RowStates(r)) => r.keep_rows(rows),
            _ => Err(ROLLBACK_GONE),
        }
    }
}

/// The error of a model whose [`TargetModel::rollback`] changed mode between calls.
const MODE_CHANGED: crate::Error = crate::Error::TargetContract {
    what: "rollback() no longer offers the mode it offered before",
};

/// [`StateSnapshot::save_state`] of `model` (snapshot mode).
///
/// # Errors
/// The model's; [`crate::Error::TargetContract`] when it offers no snapshot.
pub(crate) fn save_state<T: TargetModel + ?Sized>(model: &mut T) -> Result<()> {
    match model.rollback() {
        Some(Rollback::Snapshot(s)) => s.save_state(),
        _ => Err(MODE_CHANGED),
    }
}

/// [`StateSnapshot::restore_state`] of `model` (snapshot mode).
///
/// # Errors
/// The model's; [`crate::Error::TargetContract`] when it offers no snapshot.
pub(crate) fn restore_state<T: TargetModel + ?Sized>(model: &mut T) -> Result<()> {
    match model.rollback() {
        Some(Rollback::Snapshot(s)) => s.restore_state(),
        _ => Err(MODE_CHANGED),
    }
}

/// [`RowStates::keep_rows`] of `model` (per-row mode).
///
/// # Errors
/// The model's; [`crate::Error::TargetContract`] when it offers no row states.
pub(crate) fn keep_rows<T: TargetModel + ?Sized>(model: &mut T, rows: usize) -> Result<()> {
    match model.rollback() {
        Some(Rollback::RowStates(r)) => r.keep_rows(rows),
        _ => Err(MODE_CHANGED),
    }
}

/// [`RowStates::pending_rows`] of `model`; `None` unless it offers row states.
pub(crate) fn pending_rows<T: TargetModel + ?Sized>(model: &mut T) -> Option<usize> {
    match model.rollback() {
        Some(Rollback::RowStates(r)) => Some(r.pending_rows()),
        _ => None,
    }
}

/// The error of a batch target whose [`BatchTarget::rollback`] changed mode between calls.
const BATCH_MODE_CHANGED: crate::Error = crate::Error::TargetContract {
    what: "BatchTarget::rollback() no longer offers the mode it offered before",
};

/// [`BatchStateSnapshot::save_state`] of `slot`.
///
/// # Errors
/// The target's; [`crate::Error::TargetContract`] when it offers no snapshot.
pub(crate) fn save_slot<B: BatchTarget + ?Sized>(target: &mut B, slot: usize) -> Result<()> {
    match target.rollback() {
        Some(BatchRollback::Snapshot(s)) => s.save_state(slot),
        _ => Err(BATCH_MODE_CHANGED),
    }
}

/// [`BatchStateSnapshot::restore_state`] of `slot`.
///
/// # Errors
/// The target's; [`crate::Error::TargetContract`] when it offers no snapshot.
pub(crate) fn restore_slot<B: BatchTarget + ?Sized>(target: &mut B, slot: usize) -> Result<()> {
    match target.rollback() {
        Some(BatchRollback::Snapshot(s)) => s.restore_state(slot),
        _ => Err(BATCH_MODE_CHANGED),
    }
}

/// [`BatchRowStates::keep_rows`] of `slot`.
///
/// # Errors
/// The target's; [`crate::Error::TargetContract`] when it offers no row states.
pub(crate) fn keep_slot_rows<B: BatchTarget + ?Sized>(
    target: &mut B,
    slot: usize,
    rows: usize,
) -> Result<()> {
    match target.rollback() {
        Some(BatchRollback::RowStates(r)) => r.keep_rows(slot, rows),
        _ => Err(BATCH_MODE_CHANGED),
    }
}
