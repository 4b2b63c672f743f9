//! [`LlamaTarget`]: one sequence, [`TargetModel`].

use speculative::{Rollback, StateSnapshot, TargetModel};

use crate::engine::LlamaEngine;
use crate::error::Result;
use crate::seqs::{LlamaConfig, Part, Seqs};

/// One sequence on llama.cpp: a [`TargetModel`] for the decoding loop
/// ([`speculative::decode::Generator`]), or a draft model for
/// [`speculative::propose::DraftModelProposer`] (a smaller GGUF with the same vocabulary, or
/// the same model).
///
/// - [`TargetModel::forward`] appends `n` tokens at positions `seq_len ..` in one
///   `llama_decode` (up to [`LlamaConfig::batch_tokens`] rows; longer appends are split) and
///   returns the logits of every appended position, `[n, vocab]`, row `i` after `tokens[i]`.
/// - [`TargetModel::prefill`] appends without asking llama.cpp for any logits (the output head
///   is skipped).
/// - [`TargetModel::truncate`] removes the KV entries from a position on
///   (`llama_memory_seq_rm`); `seq_len` is kept here, not queried from llama.cpp.
///
/// Bad input (an empty append, a token id outside the vocabulary, an append past
/// [`LlamaConfig::context`], a truncate beyond the length) is refused before llama.cpp sees it,
/// with [`speculative::Error::Model`] wrapping a [`crate::LlamaError`]; the sequence is then
/// unchanged. A failed `llama_decode` rolls the sequence back to its length before the call.
///
/// Batch invariance: llama.cpp does not promise that a row's logits are the same whether it
/// runs alone or among other rows; see the crate docs for what we measured and what it means
/// for greedy output.
///
/// No tree forward ([`TargetModel::tree`] is `None`): the loop verifies chains.
///
/// Recurrent and hybrid models ([`LlamaEngine::is_recurrent`]), and any model with
/// [`LlamaConfig::force_snapshot`], roll back by snapshot and replay: [`TargetModel::rollback`]
/// is [`Rollback::Snapshot`], whose save and restore are llama.cpp's sequence state
/// (`llama_state_seq_get_data` / `llama_state_seq_set_data`, the whole sequence: KV cells and
/// recurrent state), and `truncate` takes only 0 and the current length
/// ([`speculative::Error::StateRollback`] otherwise). A failed `llama_decode` of a recurrent
/// model empties the sequence (it cannot be cut back), keeping the snapshot.
pub struct LlamaTarget {
    seqs: Seqs,
}

impl std::fmt::Debug for LlamaTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaTarget")
            .field("seq_len", &self.seqs.len(0))
            .field("context", &self.seqs.context())
            .finish_non_exhaustive()
    }
}

impl LlamaTarget {
    /// A target over `engine`'s weights with its own llama.cpp context (`config.slots` is
    /// ignored: one sequence).
    ///
    /// # Errors
    /// [`crate::LlamaError::Config`] for a zero context, batch size or thread count;
    /// [`crate::LlamaError::Context`] when llama.cpp cannot create the context.
    pub fn new(engine: &LlamaEngine, config: &LlamaConfig) -> Result<Self> {
        Ok(LlamaTarget {
            seqs: Seqs::new(engine, config, 1)?,
        })
    }

    /// The most rows one `llama_decode` takes ([`LlamaConfig::batch_tokens`]).
    pub fn batch_tokens(&self) -> usize {
        self.seqs.batch_tokens()
    }
}

impl TargetModel for LlamaTarget {
    fn vocab_size(&self) -> usize {
        self.seqs.vocab_size()
    }

    fn max_context(&self) -> usize {
        self.seqs.context()
    }

    fn seq_len(&self) -> usize {
        self.seqs.len(0)
    }

    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> speculative::Result<()> {
        let part = Part {
            seq: 0,
            tokens,
            logits: true,
        };
        Ok(self.seqs.append(&[part], logits)?)
    }

    fn truncate(&mut self, len: usize) -> speculative::Result<()> {
        Ok(self.seqs.truncate(0, len)?)
    }

    fn prefill(&mut self, tokens: &[u32]) -> speculative::Result<()> {
        let part = Part {
            seq: 0,
            tokens,
            logits: false,
        };
        Ok(self.seqs.append(&[part], &mut Vec::new())?)
    }

    fn rollback(&mut self) -> Option<Rollback<'_>> {
        self.seqs
            .snapshot()
            .then_some(Rollback::Snapshot(self as &mut dyn StateSnapshot))
    }
}

impl StateSnapshot for LlamaTarget {
    fn save_state(&mut self) -> speculative::Result<()> {
        Ok(self.seqs.save(0)?)
    }

    fn restore_state(&mut self) -> speculative::Result<()> {
        Ok(self.seqs.restore(0)?)
    }
}
