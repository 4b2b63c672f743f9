//! The [`TargetModel`] trait: what the decoding loop needs from an inference engine.

use crate::error::Result;

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
    /// [`TargetModel::last_hidden`] must return the appended positions' final hidden states as
    /// after `forward` (heads proposers read the last prompt position's row). On error the
    /// sequence should be left as it was (as `forward`).
    ///
    /// # Errors
    /// As [`TargetModel::forward`].
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        let mut logits = Vec::new();
        self.forward(tokens, &mut logits)
    }

    /// Width of the hidden states returned by [`TargetModel::last_hidden`]; 0 when the model
    /// does not expose hidden states (the default).
    fn hidden_size(&self) -> usize {
        0
    }

    /// The final hidden states (after the last norm, before the output head) of the positions
    /// appended by the most recent [`TargetModel::forward`] or [`TargetModel::prefill`] call,
    /// shape `[n, hidden_size]` (every appended row: the loop reads the row of the last accepted
    /// position).
    /// Heads proposers (MTP / Medusa) read the last row. `None` when not supported.
    fn last_hidden(&self) -> Option<&[f32]> {
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
    fn hidden_size(&self) -> usize {
        (**self).hidden_size()
    }
    fn last_hidden(&self) -> Option<&[f32]> {
        (**self).last_hidden()
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
    fn hidden_size(&self) -> usize {
        (**self).hidden_size()
    }
    fn last_hidden(&self) -> Option<&[f32]> {
        (**self).last_hidden()
    }
}
