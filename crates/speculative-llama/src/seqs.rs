//! One llama.cpp context holding one or more sequences, with our own length bookkeeping: the
//! shared core of [`crate::LlamaTarget`] and [`crate::LlamaBatchTarget`].

use std::sync::Arc;

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::session::{LlamaStateSeqFlags, SeqState};
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use crate::engine::{LlamaEngine, nonzero};
use crate::error::{LlamaError, Result};

/// llama.cpp's flash-attention choice for a context.
///
/// It decides batch invariance on llama.cpp's CPU backend (measured on SmolLM2, see
/// `docs/llama-cpp.md`): with flash attention every row of a `k + 1`-row verify call was
/// bit-identical to the same row decoded alone, so greedy speculative output equals plain
/// greedy output; without it about 1.5% of rows changed their argmax.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlashAttention {
    /// llama.cpp decides per device (its own default; on for the CPU backend).
    Auto,
    /// Always (the adapter's default: batch-invariant on the CPU backend).
    #[default]
    On,
    /// Never: attention as separate matmul, softmax and matmul operations.
    Off,
}

/// A llama.cpp context for a target: sizes and threads.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LlamaConfig {
    /// Tokens one sequence can hold (prompt + generated), enforced by the adapter; llama.cpp's
    /// cache holds at least `context * slots` positions (it pads to a multiple of 256). At most
    /// 2^30 in all. Default 2048.
    pub context: usize,
    /// Sequences of a [`crate::LlamaBatchTarget`] (its slots); a [`crate::LlamaTarget`] has
    /// one and ignores this. Default 1.
    pub slots: usize,
    /// The most rows one `llama_decode` call takes (llama.cpp's `n_batch` and `n_ubatch`, set
    /// equal so that a verify call is one forward; at most 65536, and llama.cpp lowers it to
    /// the context size). Longer appends are split. Default 512.
    pub batch_tokens: usize,
    /// CPU threads of llama.cpp's kernels (`n_threads` and `n_threads_batch`). Default 1 (as
    /// our own forward; on an idle 2-core machine 2 threads were faster, see
    /// `docs/llama-cpp.md`).
    pub threads: usize,
    /// One KV cache for every sequence (llama.cpp's `kv_unified`; default `false`).
    ///
    /// `false`: each sequence has its own cache of [`LlamaConfig::context`] positions, laid out
    /// as a sequence alone would have it, and a slot's logits do not depend on the other slots
    /// (measured: batched greedy output equal to each request alone); llama.cpp splits a batch
    /// into pieces of equal length per sequence, so a batch of ragged chunks costs more than
    /// one forward. `true`: one forward per batch, but a slot's logits change in the last bits
    /// with the other slots' cache entries (measured: batched greedy outputs left the requests'
    /// outputs alone). Only [`crate::LlamaBatchTarget`] sees a difference.
    pub unified_kv: bool,
    /// Flash attention. Default [`FlashAttention::On`], which makes greedy speculative output
    /// identical to plain greedy output on the CPU backend (see [`FlashAttention`]).
    pub flash_attention: FlashAttention,
    /// Roll back by snapshot and replay ([`speculative::Rollback::Snapshot`]) even when the
    /// model could truncate its KV cache. Recurrent and hybrid models
    /// ([`crate::LlamaEngine::is_recurrent`]) always do; this forces it on for the others (to
    /// test the wiring on a transformer; it costs a copy of the sequence's KV cells per step).
    /// Default `false`.
    pub force_snapshot: bool,
}

impl Default for LlamaConfig {
    fn default() -> Self {
        LlamaConfig {
            context: 2048,
            slots: 1,
            batch_tokens: 512,
            threads: 1,
            flash_attention: FlashAttention::On,
            unified_kv: false,
            force_snapshot: false,
        }
    }
}

impl LlamaConfig {
    /// With `threads` threads (other fields kept).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }
    /// With a context of `context` tokens per sequence (other fields kept).
    pub fn with_context(mut self, context: usize) -> Self {
        self.context = context;
        self
    }
    /// With `slots` sequences (batch targets).
    pub fn with_slots(mut self, slots: usize) -> Self {
        self.slots = slots;
        self
    }
    /// With at most `batch_tokens` rows per `llama_decode`.
    pub fn with_batch_tokens(mut self, batch_tokens: usize) -> Self {
        self.batch_tokens = batch_tokens;
        self
    }
    /// With or without one KV cache shared by the sequences.
    pub fn with_unified_kv(mut self, unified_kv: bool) -> Self {
        self.unified_kv = unified_kv;
        self
    }
    /// With the given flash-attention choice.
    pub fn with_flash_attention(mut self, flash_attention: FlashAttention) -> Self {
        self.flash_attention = flash_attention;
        self
    }
    /// With snapshot rollback forced on or not ([`LlamaConfig::force_snapshot`]).
    pub fn with_force_snapshot(mut self, force_snapshot: bool) -> Self {
        self.force_snapshot = force_snapshot;
        self
    }
}

/// The most positions of one context (all sequences), well inside llama.cpp's `i32` positions.
const MAX_POSITIONS: usize = 1 << 30;
/// The most rows of one `llama_decode` we ask for.
const MAX_BATCH_TOKENS: usize = 1 << 16;

/// One part of an append: `tokens` to sequence `seq`, with or without their logits.
pub(crate) struct Part<'a> {
    pub(crate) seq: usize,
    pub(crate) tokens: &'a [u32],
    pub(crate) logits: bool,
}

pub(crate) struct Seqs {
    // Field order matters: `ctx` points into the model that `_model` keeps alive, so it must be
    // dropped first (fields drop in declaration order).
    ctx: LlamaContext<'static>,
    _model: Arc<LlamaModel>,
    batch: LlamaBatch<'static>,
    /// Tokens held per sequence.
    lens: Vec<usize>,
    context: usize,
    batch_tokens: usize,
    vocab_size: usize,
    /// (batch index, row of the output) of the rows whose logits the current `llama_decode`
    /// returns.
    out_rows: Vec<(i32, usize)>,
    /// Rollback by snapshot and replay (a recurrent or hybrid model, or forced).
    snapshot: bool,
    /// The model is recurrent or hybrid: its cells cannot be partly removed.
    recurrent: bool,
    /// Per sequence in snapshot mode: the saved state and its length.
    saved: Vec<Option<(SeqState, usize)>>,
    /// Tests: fail the `llama_decode` after this many more succeed.
    #[cfg(test)]
    fail_after: Option<usize>,
}

impl Seqs {
    pub(crate) fn new(engine: &LlamaEngine, config: &LlamaConfig, slots: usize) -> Result<Self> {
        nonzero("context", config.context)?;
        let total = config.context.saturating_mul(slots);
        // Positions are i32 in llama.cpp, and it pads the context to a multiple of 256.
        if total > MAX_POSITIONS {
            return Err(LlamaError::Config {
                field: "context * slots",
                value: total.to_string(),
                reason: "must be at most 2^30 positions",
            });
        }
        let n_ctx = nonzero("context * slots", total)?;
        if config.batch_tokens > MAX_BATCH_TOKENS {
            return Err(LlamaError::Config {
                field: "batch_tokens",
                value: config.batch_tokens.to_string(),
                reason: "must be at most 65536",
            });
        }
        let n_batch = nonzero("batch_tokens", config.batch_tokens)?.get();
        let n_seq = nonzero("slots", slots)?.get();
        let threads = i32::try_from(nonzero("threads", config.threads)?.get()).map_err(|_| {
            LlamaError::Config {
                field: "threads",
                value: config.threads.to_string(),
                reason: "must fit an i32",
            }
        })?;
        if n_seq > 256 {
            return Err(LlamaError::Config {
                field: "slots",
                value: slots.to_string(),
                reason: "llama.cpp holds at most 256 sequences per context",
            });
        }
        let fa = match config.flash_attention {
            FlashAttention::Auto => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_AUTO,
            FlashAttention::On => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED,
            FlashAttention::Off => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        };
        let params = LlamaContextParams::default()
            .with_n_ctx(Some(n_ctx))
            .with_n_batch(n_batch)
            .with_n_ubatch(n_batch)
            .with_n_seq_max(n_seq)
            // Shared cache: one forward per batch, not batch-invariant; a cache per sequence
            // (the default): batch-invariant, ragged batches split (see `unified_kv`).
            .with_kv_unified(config.unified_kv)
            .with_n_threads(threads)
            .with_n_threads_batch(threads)
            .with_flash_attention_policy(fa);
        let model = engine.shared_model().clone();
        let ctx = model
            .new_context(crate::engine::backend()?, params)
            .map_err(|e| LlamaError::Context(e.to_string()))?;
        // SAFETY: the context borrows the model behind `model`'s `Arc`, a heap allocation that
        // does not move and that the `_model` field keeps alive for as long as `ctx` exists
        // (`ctx` is declared, hence dropped, first). The lifetime is only widened, never
        // used to reach the model past that.
        let ctx: LlamaContext<'static> = unsafe { std::mem::transmute(ctx) };
        // llama.cpp may lower n_batch (to the context size): keep to what it holds.
        let n_batch = ctx.n_batch().min(ctx.n_ubatch()).min(n_batch);
        Ok(Seqs {
            ctx,
            _model: model,
            batch: LlamaBatch::new(n_batch as usize, 1),
            lens: vec![0; slots],
            context: config.context,
            batch_tokens: n_batch as usize,
            vocab_size: engine.vocab_size(),
            out_rows: Vec::new(),
            snapshot: engine.is_recurrent() || config.force_snapshot,
            recurrent: engine.is_recurrent(),
            saved: (0..slots).map(|_| None).collect(),
            #[cfg(test)]
            fail_after: None,
        })
    }

    pub(crate) fn slots(&self) -> usize {
        self.lens.len()
    }
    pub(crate) fn context(&self) -> usize {
        self.context
    }
    pub(crate) fn batch_tokens(&self) -> usize {
        self.batch_tokens
    }
    pub(crate) fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    pub(crate) fn len(&self, seq: usize) -> usize {
        self.lens[seq]
    }
    /// Whether the sequences roll back by snapshot and replay.
    pub(crate) fn snapshot(&self) -> bool {
        self.snapshot
    }

    /// Saves sequence `seq`'s whole state (`llama_state_seq_get_data`: its KV cells and, for a
    /// recurrent or hybrid model, its recurrent state), replacing the saved one.
    pub(crate) fn save(&mut self, seq: usize) -> Result<()> {
        let state = self
            .ctx
            .state_seq_get(seq as i32, LlamaStateSeqFlags::empty())
            .map_err(|e| LlamaError::State {
                seq,
                reason: e.to_string(),
            })?;
        self.saved[seq] = Some((state, self.lens[seq]));
        Ok(())
    }

    /// Restores the state saved by [`Seqs::save`] (`llama_state_seq_set_data`, which replaces
    /// the sequence's cells); the snapshot stays.
    pub(crate) fn restore(&mut self, seq: usize) -> Result<()> {
        let Some((state, len)) = &self.saved[seq] else {
            return Err(LlamaError::StateRollback(
                "restore_state without a saved state",
            ));
        };
        self.ctx
            .state_seq_set(state, seq as i32)
            .map_err(|e| LlamaError::State {
                seq,
                reason: e.to_string(),
            })?;
        self.lens[seq] = *len;
        Ok(())
    }

    /// Checks every part (sequence in range is the caller's job) before anything changes.
    pub(crate) fn check(&self, parts: &[Part<'_>]) -> Result<()> {
        for p in parts {
            if p.tokens.is_empty() {
                return Err(LlamaError::Empty);
            }
            if let Some(&token) = p.tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
                return Err(LlamaError::TokenOutOfVocab {
                    token,
                    vocab_size: self.vocab_size,
                });
            }
            let seq_len = self.lens[p.seq];
            if seq_len + p.tokens.len() > self.context {
                return Err(LlamaError::ContextOverflow {
                    seq: p.seq,
                    seq_len,
                    added: p.tokens.len(),
                    max_context: self.context,
                });
            }
        }
        Ok(())
    }

    /// Appends every part and writes the logits of the parts that ask for them (cleared
    /// first), `[rows, vocab]` in part order. Parts of at most `batch_tokens` rows in all run
    /// as one `llama_decode`; longer appends are split in order. On error every sequence is
    /// rolled back to its length before the call.
    pub(crate) fn append(&mut self, parts: &[Part<'_>], logits: &mut Vec<f32>) -> Result<()> {
        self.check(parts)?;
        let before: Vec<(usize, usize)> = parts.iter().map(|p| (p.seq, self.lens[p.seq])).collect();
        let r = self.append_unchecked(parts, logits);
        if r.is_err() {
            logits.clear();
            for &(seq, len) in &before {
                if self.recurrent {
                    // A recurrent state cannot be cut back to `len`: the sequence is emptied
                    // (its snapshot kept, from which the decoding loop restores it).
                    let _ = self.ctx.clear_kv_cache_seq(Some(seq as u32), None, None);
                    self.lens[seq] = 0;
                    continue;
                }
                // Best effort: the decode error is the one to report.
                let _ = self
                    .ctx
                    .clear_kv_cache_seq(Some(seq as u32), Some(len as u32), None);
                self.lens[seq] = len;
            }
        }
        r
    }

    fn append_unchecked(&mut self, parts: &[Part<'_>], logits: &mut Vec<f32>) -> Result<()> {
        // Logit rows land in call order; each part's first row in `logits`:
        let mut first_row = Vec::with_capacity(parts.len());
        let mut rows = 0;
        for p in parts {
            first_row.push(rows);
            rows += if p.logits { p.tokens.len() } else { 0 };
        }
        logits.clear();
        logits.resize(rows * self.vocab_size, 0.0);
        // Tokens go to llama.cpp in sequence-id order: with a cache per sequence llama.cpp
        // splits a batch into pieces over consecutive ids, so this order keeps them few.
        let mut order: Vec<usize> = (0..parts.len()).collect();
        order.sort_by_key(|&i| parts[i].seq);
        self.batch.clear();
        self.out_rows.clear();
        for &pi in &order {
            let p = &parts[pi];
            for (i, &t) in p.tokens.iter().enumerate() {
                if self.batch.n_tokens() as usize == self.batch_tokens {
                    self.decode(logits)?;
                }
                let pos = (self.lens[p.seq] + i) as i32;
                if p.logits {
                    self.out_rows
                        .push((self.batch.n_tokens(), first_row[pi] + i));
                }
                self.batch
                    .add(LlamaToken(t as i32), pos, &[p.seq as i32], p.logits)
                    .map_err(|e| LlamaError::Decode(e.to_string()))?;
            }
        }
        if self.batch.n_tokens() > 0 {
            self.decode(logits)?;
        }
        for p in parts {
            self.lens[p.seq] += p.tokens.len();
        }
        Ok(())
    }

    /// One `llama_decode` of the batch so far, its logit rows copied to their rows of `logits`.
    fn decode(&mut self, logits: &mut [f32]) -> Result<()> {
        #[cfg(test)]
        if let Some(n) = self.fail_after.as_mut() {
            if *n == 0 {
                return Err(LlamaError::Decode("injected failure".into()));
            }
            *n -= 1;
        }
        self.ctx
            .decode(&mut self.batch)
            .map_err(|e| LlamaError::Decode(e.to_string()))?;
        let v = self.vocab_size;
        for &(idx, row) in &self.out_rows {
            let l = self.ctx.get_logits_ith(idx);
            if l.len() != v {
                return Err(LlamaError::LogitsSize {
                    got: l.len(),
                    vocab_size: v,
                });
            }
            logits[row * v..(row + 1) * v].copy_from_slice(l);
        }
        self.batch.clear();
        self.out_rows.clear();
        Ok(())
    }

    /// Makes `dst` hold the first `len` positions of `src` (`src` unchanged) with llama.cpp's
    /// sequence copy (`llama_memory_seq_cp`): in a unified cache the cells are shared (no data
    /// copied); with a cache per sequence llama.cpp copies `src`'s whole stream buffer into
    /// `dst`'s at the next decode (it copies only whole buffers), and the positions from `len`
    /// on are then removed from `dst`.
    ///
    /// # Errors
    /// [`LlamaError::Config`] for `src == dst`; [`LlamaError::TruncateBeyond`] for
    /// `len > len(src)` (nothing changed); [`LlamaError::Cache`] when llama.cpp refuses the
    /// removal (`dst` is then empty).
    pub(crate) fn copy_prefix(&mut self, src: usize, dst: usize, len: usize) -> Result<()> {
        if src == dst {
            return Err(LlamaError::Config {
                field: "copy_prefix",
                value: format!("{src} -> {dst}"),
                reason: "the source and destination slots must differ",
            });
        }
        let seq_len = self.lens[src];
        if len > seq_len {
            return Err(LlamaError::TruncateBeyond {
                seq: src,
                len,
                seq_len,
            });
        }
        self.truncate(dst, 0)?;
        let ids = |s: usize| i32::try_from(s).unwrap_or(i32::MAX);
        self.ctx
            .copy_kv_cache_seq(ids(src), ids(dst), None, None)
            .map_err(|e| LlamaError::Cache {
                seq: dst,
                from: 0,
                reason: e.to_string(),
            })?;
        self.lens[dst] = seq_len;
        if let Err(e) = self.truncate(dst, len) {
            let _ = self.ctx.clear_kv_cache_seq(Some(dst as u32), None, None);
            self.lens[dst] = 0;
            return Err(e);
        }
        Ok(())
    }

    /// Drops every position of `seq` at index `>= len`. In snapshot mode only `len == 0`
    /// (which also drops the snapshot) and `len == seq_len` are taken.
    pub(crate) fn truncate(&mut self, seq: usize, len: usize) -> Result<()> {
        let seq_len = self.lens[seq];
        if len > seq_len {
            return Err(LlamaError::TruncateBeyond { seq, len, seq_len });
        }
        if self.snapshot && len == 0 {
            self.saved[seq] = None;
        } else if self.snapshot && len < seq_len {
            return Err(LlamaError::StateRollback(
                "truncate to a length other than 0 or seq_len in snapshot mode",
            ));
        }
        if len < seq_len {
            self.ctx
                .clear_kv_cache_seq(Some(seq as u32), Some(len as u32), None)
                .map_err(|e| LlamaError::Cache {
                    seq,
                    from: len,
                    reason: e.to_string(),
                })
                .and_then(|removed| {
                    if removed {
                        Ok(())
                    } else {
                        Err(LlamaError::Cache {
                            seq,
                            from: len,
                            reason: "llama.cpp refused a partial removal".into(),
                        })
                    }
                })?;
            self.lens[seq] = len;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LlamaEngine, ModelOptions};

    /// A `llama_decode` that fails after earlier pieces of a split append succeeded: every
    /// sequence is rolled back, and the next forward equals a fresh one.
    #[test]
    fn a_failed_decode_rolls_every_sequence_back() {
        let path = crate::default_model_path();
        assert!(path.is_file(), "run scripts/fetch-model.sh");
        let e = LlamaEngine::load(&path, &ModelOptions::default()).unwrap();
        let cfg = LlamaConfig::default()
            .with_slots(2)
            .with_context(128)
            .with_batch_tokens(4);
        let prompt: Vec<u32> = (0..11).map(|i| 500 + 7 * i).collect();
        let more: Vec<u32> = (0..9).map(|i| 900 + 3 * i).collect();
        let chain = [17u32, 18, 19];
        let run = |fail: Option<usize>| {
            let mut s = Seqs::new(&e, &cfg, 2).unwrap();
            let mut l = Vec::new();
            let parts = |seq, tokens| Part {
                seq,
                tokens,
                logits: true,
            };
            s.append(&[parts(0, &prompt[..]), parts(1, &prompt[..5])], &mut l)
                .unwrap();
            s.fail_after = fail;
            let r = s.append(&[parts(1, &more[..]), parts(0, &more[..4])], &mut l);
            s.fail_after = None;
            let lens = (s.len(0), s.len(1));
            s.append(&[parts(0, &chain[..]), parts(1, &chain[..])], &mut l)
                .unwrap();
            (r.is_ok(), lens, l)
        };
        // Rows 13 in 4-row pieces: the third of four llama_decode calls fails.
        let (ok, lens, after) = run(Some(2));
        assert!(!ok);
        assert_eq!(lens, (11, 5));
        let (ok, lens, _) = run(None);
        assert!(ok);
        assert_eq!(lens, (15, 14));
        // Reference: the same sequences without the failed append.
        let mut s = Seqs::new(&e, &cfg, 2).unwrap();
        let mut want = Vec::new();
        let parts = |seq, tokens| Part {
            seq,
            tokens,
            logits: true,
        };
        s.append(&[parts(0, &prompt[..]), parts(1, &prompt[..5])], &mut want)
            .unwrap();
        s.append(&[parts(0, &chain[..]), parts(1, &chain[..])], &mut want)
            .unwrap();
        assert!(
            after == want,
            "logits after the rollback differ from a fresh run"
        );
    }
}
