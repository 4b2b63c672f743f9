//! [`LlamaBatchTarget`]: several sequences in one llama.cpp context, [`BatchTarget`].

use speculative::model::check_slots;
use speculative::{BatchRollback, BatchStateSnapshot, BatchTarget, SlotChunk, SlotInput};

use crate::engine::LlamaEngine;
use crate::error::Result;
use crate::seqs::{LlamaConfig, Part, Seqs};

/// Several sequences on llama.cpp, for continuous batching
/// ([`speculative::decode::BatchGenerator`]): slot `i` is llama.cpp sequence id `i` of one
/// context whose KV cache holds [`LlamaConfig::context`] positions per slot.
///
/// One [`BatchTarget::forward_batch`] is one `llama_decode` over every chunk's rows (prefill
/// chunks ask for no logits; the rows fit [`LlamaConfig::batch_tokens`], which
/// [`BatchTarget::max_batch_tokens`] reports and the batch loop keeps to). How many forwards
/// llama.cpp runs for it depends on [`LlamaConfig::unified_kv`]: with one shared cache, one
/// forward (each weight read once for the whole batch); with a cache per sequence (the
/// default, batch-invariant), llama.cpp splits the batch into pieces over consecutive slots
/// with the same number of rows each, so chunks of different lengths (a prefill beside verify
/// chains, different draft lengths) take several forwards. Chains and prefill only: token trees
/// are refused ([`BatchTarget::max_tree_nodes`] is 0).
///
/// Every check (slots, empty chunks, token ids, context) runs before llama.cpp sees the batch,
/// so a refused call changes no slot; a failed `llama_decode` rolls every listed slot back.
/// Errors are [`speculative::Error::InvalidSlot`] for slots, [`speculative::Error::Model`]
/// wrapping a [`crate::LlamaError`] otherwise.
///
/// Batch invariance: llama.cpp does not promise that a slot's logits are independent of the
/// other rows of the call (see the crate docs for the measurement).
///
/// Recurrent and hybrid models (and [`LlamaConfig::force_snapshot`]) roll back by snapshot and
/// replay per slot ([`BatchRollback::Snapshot`]), as [`crate::LlamaTarget`] does.
pub struct LlamaBatchTarget {
    seqs: Seqs,
}

impl std::fmt::Debug for LlamaBatchTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaBatchTarget")
            .field("slots", &self.seqs.slots())
            .field("context", &self.seqs.context())
            .finish_non_exhaustive()
    }
}

impl LlamaBatchTarget {
    /// `config.slots` sequences over `engine`'s weights in one new llama.cpp context.
    ///
    /// # Errors
    /// [`crate::LlamaError::Config`] for zero slots, context, batch size or threads, or more
    /// than 256 slots; [`crate::LlamaError::Context`] when llama.cpp cannot create the context.
    pub fn new(engine: &LlamaEngine, config: &LlamaConfig) -> Result<Self> {
        Ok(LlamaBatchTarget {
            seqs: Seqs::new(engine, config, config.slots)?,
        })
    }

    fn slot_error(&self, slot: usize) -> speculative::Error {
        speculative::Error::InvalidSlot {
            slot,
            max_slots: self.seqs.slots(),
            reason: "out of range",
        }
    }
}

impl BatchTarget for LlamaBatchTarget {
    fn vocab_size(&self) -> usize {
        self.seqs.vocab_size()
    }

    fn max_context(&self) -> usize {
        self.seqs.context()
    }

    fn max_slots(&self) -> usize {
        self.seqs.slots()
    }

    fn max_batch_tokens(&self) -> usize {
        self.seqs.batch_tokens()
    }

    fn seq_len(&self, slot: usize) -> speculative::Result<usize> {
        if slot >= self.seqs.slots() {
            return Err(self.slot_error(slot));
        }
        Ok(self.seqs.len(slot))
    }

    fn forward_batch(
        &mut self,
        chunks: &[SlotChunk<'_>],
        logits: &mut Vec<f32>,
    ) -> speculative::Result<()> {
        check_slots(chunks, self.seqs.slots())?;
        let mut parts = Vec::with_capacity(chunks.len());
        let mut rows = 0usize;
        for c in chunks {
            let (tokens, want) = match c.input {
                SlotInput::Prefill(t) => (t, false),
                SlotInput::Chain(t) => (t, true),
                SlotInput::Tree { .. } => {
                    return Err(speculative::Error::TargetContract {
                        what: "a tree chunk for LlamaBatchTarget, which verifies chains only",
                    });
                }
            };
            rows += tokens.len();
            parts.push(Part {
                seq: c.slot,
                tokens,
                logits: want,
            });
        }
        if rows > self.seqs.batch_tokens() {
            return Err(speculative::Error::model(format!(
                "a batch of {rows} rows exceeds max_batch_tokens {}",
                self.seqs.batch_tokens()
            )));
        }
        Ok(self.seqs.append(&parts, logits)?)
    }

    fn truncate(&mut self, slot: usize, len: usize) -> speculative::Result<()> {
        if slot >= self.seqs.slots() {
            return Err(self.slot_error(slot));
        }
        Ok(self.seqs.truncate(slot, len)?)
    }

    fn release(&mut self, slot: usize) -> speculative::Result<()> {
        self.truncate(slot, 0)
    }

    fn rollback(&mut self) -> Option<BatchRollback<'_>> {
        self.seqs
            .snapshot()
            .then_some(BatchRollback::Snapshot(self as &mut dyn BatchStateSnapshot))
    }

    /// `true` when the model rolls back by truncation: llama.cpp copies sequences
    /// (`llama_memory_seq_cp`). `false` in snapshot mode (recurrent and hybrid models, or
    /// [`LlamaConfig::force_snapshot`]): a recurrent state has no prefix to copy, and the copy
    /// of separate KV buffers happens at the next decode, after the state save that the loop
    /// makes before it, so the saved state would miss the copied prefix (a replay from it
    /// decoded garbage).
    fn can_copy_prefix(&self) -> bool {
        !self.seqs.snapshot()
    }

    /// Makes `dst` hold `src`'s first `len` positions with llama.cpp's sequence copy: shared
    /// cells with [`LlamaConfig::unified_kv`], else a copy of `src`'s whole per-sequence KV
    /// buffer (`max_context` positions, done at the next decode) followed by the removal of
    /// the positions from `len` on.
    ///
    /// # Errors
    /// [`speculative::Error::InvalidSlot`]; [`speculative::Error::Model`] wrapping
    /// [`crate::LlamaError`] for `src == dst`, `len > seq_len(src)` or a refused removal.
    fn copy_prefix(&mut self, src: usize, dst: usize, len: usize) -> speculative::Result<()> {
        for s in [src, dst] {
            if s >= self.seqs.slots() {
                return Err(self.slot_error(s));
            }
        }
        Ok(self.seqs.copy_prefix(src, dst, len)?)
    }
}

impl BatchStateSnapshot for LlamaBatchTarget {
    fn save_state(&mut self, slot: usize) -> speculative::Result<()> {
        if slot >= self.seqs.slots() {
            return Err(self.slot_error(slot));
        }
        Ok(self.seqs.save(slot)?)
    }

    fn restore_state(&mut self, slot: usize) -> speculative::Result<()> {
        if slot >= self.seqs.slots() {
            return Err(self.slot_error(slot));
        }
        Ok(self.seqs.restore(slot)?)
    }
}
