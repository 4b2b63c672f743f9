//! [`FastBatch`]: the fast forward over several sequences at once ([`speculative::BatchTarget`]).

use std::sync::Arc;

use speculative::{BatchTarget, SlotChunk, SlotInput};

use super::forward::{Exec, FastWeights, Segment, SeqState, run_rows};
use super::q8::KernelPath;
use crate::engine::{DEFAULT_MAX_TREE_NODES, check_tree};
use crate::error::{CandleError, Result};
use crate::tree::{Rows, tree_tokens};

/// Default of [`FastBatch::with_max_batch_tokens`]: rows (tokens) per
/// [`BatchTarget::forward_batch`] call.
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 1024;

/// Several sequences (slots) over shared [`FastWeights`], run together: one
/// [`BatchTarget::forward_batch`] call is **one** forward over the rows of every chunk (prompt
/// prefill chunks, verify chains and token trees of different slots mixed), so each weight
/// block is read once per call however many sequences it serves.
///
/// # What runs where
/// The rows of all chunks are concatenated in call order. Embedding, RMSNorms, the fused
/// QKV, output, gate/up and down projections run over all rows at once; RoPE, the KV-cache
/// writes and attention run per chunk against that slot's own KV cache at that slot's positions
/// (chains: position `seq_len + i`; trees: tree attention at `seq_len + depth`, exactly as
/// [`FastTarget`](super::FastTarget) does, with the tree pending until
/// [`BatchTarget::commit_tree`] or [`BatchTarget::truncate`] of the slot). The output head runs
/// only over the rows of chunks that want logits (not prefill chunks). [`FastTarget`](super::FastTarget) is the
/// one-sequence case of the same row pipeline.
///
/// # Batch invariance
/// Every row's arithmetic (matmul accumulation order, norms, attention over its own slot's
/// cache) is independent of the other rows of the call (module docs of [`crate::fast`]), so
/// **each slot's logits and KV cache are bit-identical to those of a
/// [`FastTarget`](super::FastTarget) that saw the same history alone**, whatever the other
/// chunks of each call, for both [`FastFormat`](super::FastFormat)s, every kernel path and
/// thread count.
///
/// # Memory
/// Each slot's KV cache takes `2 · n_layers · kv_heads · head_dim · 4` bytes per position
/// ([`FastBatch::kv_bytes_per_position`]; SmolLM2-135M: 46,080 bytes, 45 KiB) and grows on
/// demand (doubling, in steps of 16 positions, at least 64), never past the model's context
/// length ([`BatchTarget::max_context`]); so a slot holds at most
/// `max_context · kv_bytes_per_position` bytes (SmolLM2-135M, 8,192 positions: 360 MiB) and the
/// whole batch at most `max_slots` times that. A tree forward keeps its rows' keys and values
/// aside, `(nodes + 1) · 2 · kv_heads · head_dim · 4` bytes per layer. [`BatchTarget::release`]
/// frees the slot's cache (a reused slot grows again), so memory follows the live sequences.
/// The per-call scratch buffers are proportional to the rows of the call
/// ([`BatchTarget::max_batch_tokens`]).
#[derive(Debug)]
pub struct FastBatch {
    weights: Arc<FastWeights>,
    exec: Exec,
    slots: Vec<SeqState>,
    max_tree_nodes: usize,
    max_batch_tokens: usize,
    /// Scratch: the final hidden states of the last call's rows.
    hidden: Vec<f32>,
}

impl FastBatch {
    /// `slots` empty sequences over shared `weights` (the full model), with the fastest kernel
    /// path of this CPU ([`KernelPath::detect`]), one thread, [`DEFAULT_MAX_TREE_NODES`] nodes
    /// per tree and [`DEFAULT_MAX_BATCH_TOKENS`] rows per call. Nothing is allocated per slot
    /// until it receives tokens.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] for `slots == 0`.
    pub fn new(weights: Arc<FastWeights>, slots: usize) -> Result<Self> {
        if slots == 0 {
            return Err(CandleError::InvalidArgument(
                "a FastBatch needs at least one slot".into(),
            ));
        }
        let n_layers = weights.config.n_layers;
        let seq = SeqState::new(&weights.config, n_layers);
        Ok(FastBatch {
            exec: Exec::detect(),
            slots: vec![seq; slots],
            max_tree_nodes: DEFAULT_MAX_TREE_NODES,
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
            hidden: Vec::new(),
            weights,
        })
    }

    /// Splits every matmul between this thread and a persistent helper thread when
    /// `threads >= 2`, as [`FastTarget::with_threads`](super::FastTarget::with_threads) (same
    /// results for every count; one thread is the default).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.exec.threads = threads.max(1);
        self
    }

    /// Chooses the int8 kernel path (all paths give the same bits; for tests and benches).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when this CPU cannot run `path`.
    pub fn with_kernel(mut self, path: KernelPath) -> Result<Self> {
        self.exec.set_kernel(path)?;
        Ok(self)
    }

    /// Sets the most nodes of one slot's tree ([`BatchTarget::max_tree_nodes`]; default
    /// [`DEFAULT_MAX_TREE_NODES`]); `0` turns tree chunks off.
    pub fn with_max_tree_nodes(mut self, max_nodes: usize) -> Self {
        self.max_tree_nodes = max_nodes;
        self
    }

    /// Sets the most rows (tokens, every chunk's [`SlotInput::rows`] summed) one
    /// [`BatchTarget::forward_batch`] call takes (default [`DEFAULT_MAX_BATCH_TOKENS`]; `0` is
    /// treated as 1). It bounds the per-call scratch memory: about
    /// `rows · (6 hidden + 2 ffn + (heads + 2 kv_heads) head_dim) · 4` bytes plus
    /// `rows · vocab · 4` bytes of logits (1,024 rows of SmolLM2-135M: about 240 MB of logits
    /// if every row asks for them).
    pub fn with_max_batch_tokens(mut self, rows: usize) -> Self {
        self.max_batch_tokens = rows.max(1);
        self
    }

    /// The kernel path in use.
    pub fn kernel(&self) -> KernelPath {
        self.exec.path
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<FastWeights> {
        &self.weights
    }

    /// Bytes of KV cache one position of one slot takes:
    /// `2 · n_layers · kv_heads · head_dim · 4` (keys and values, f32).
    pub fn kv_bytes_per_position(&self) -> usize {
        let c = &self.weights.config;
        2 * c.n_layers * c.n_kv_heads * c.head_dim * std::mem::size_of::<f32>()
    }

    /// Bytes currently held by the KV caches and kept-aside tree rows of every slot
    /// (allocated capacity, not only the positions in use).
    pub fn kv_memory_bytes(&self) -> usize {
        self.slots.iter().map(SeqState::memory_bytes).sum()
    }

    /// The keys and values of positions `0 .. seq_len(slot)` of every layer of `slot`, as
    /// [`FastTarget::kv_snapshot`](super::FastTarget::kv_snapshot); `None` for a slot out of
    /// range. For tests that compare caches.
    #[doc(hidden)]
    pub fn kv_snapshot(&self, slot: usize) -> Option<Vec<(Vec<f32>, Vec<f32>)>> {
        self.slots.get(slot).map(SeqState::kv_snapshot)
    }

    fn slot_ref(&self, slot: usize) -> speculative::Result<&SeqState> {
        self.slots.get(slot).ok_or(speculative::Error::InvalidSlot {
            slot,
            max_slots: self.slots.len(),
            reason: "out of range",
        })
    }

    fn slot_mut(&mut self, slot: usize) -> speculative::Result<&mut SeqState> {
        let max_slots = self.slots.len();
        self.slots
            .get_mut(slot)
            .ok_or(speculative::Error::InvalidSlot {
                slot,
                max_slots,
                reason: "out of range",
            })
    }

    /// Validates every chunk against its slot and returns each chunk's row tokens (a tree's
    /// root first) and tree layout. Touches nothing.
    fn prepare(&self, chunks: &[SlotChunk<'_>]) -> speculative::Result<Vec<Prepared>> {
        speculative::model::check_slots(chunks, self.slots.len())?;
        let rows: usize = chunks.iter().map(|c| c.input.rows()).sum();
        if rows > self.max_batch_tokens {
            return Err(CandleError::InvalidArgument(format!(
                "a batch of {rows} rows exceeds max_batch_tokens = {}",
                self.max_batch_tokens
            ))
            .into());
        }
        let cfg = &self.weights.config;
        let mut out = Vec::with_capacity(chunks.len());
        for c in chunks {
            let seq = &self.slots[c.slot];
            let p = match c.input {
                SlotInput::Prefill(t) | SlotInput::Chain(t) => {
                    seq.check(cfg, t)?;
                    Prepared {
                        tokens: t.to_vec(),
                        rows: None,
                    }
                }
                SlotInput::Tree { root, block } => {
                    if self.max_tree_nodes == 0 {
                        return Err(speculative::Error::TargetContract {
                            what: "a tree chunk for a FastBatch with max_tree_nodes = 0",
                        });
                    }
                    check_tree(cfg.vocab_size, self.max_tree_nodes, &block)?;
                    let tokens = tree_tokens(root, &block);
                    seq.check(cfg, &tokens)?;
                    Prepared {
                        tokens,
                        rows: Some(Rows::of(&block)),
                    }
                }
            };
            out.push(p);
        }
        Ok(out)
    }
}

/// A validated chunk: its rows' tokens and, for a tree, their layout.
struct Prepared {
    tokens: Vec<u32>,
    rows: Option<Rows>,
}

impl BatchTarget for FastBatch {
    fn vocab_size(&self) -> usize {
        self.weights.config.vocab_size
    }

    fn max_context(&self) -> usize {
        self.weights.config.context_length
    }

    fn max_slots(&self) -> usize {
        self.slots.len()
    }

    fn max_batch_tokens(&self) -> usize {
        self.max_batch_tokens
    }

    fn max_tree_nodes(&self) -> usize {
        self.max_tree_nodes
    }

    fn seq_len(&self, slot: usize) -> speculative::Result<usize> {
        Ok(self.slot_ref(slot)?.seq_len)
    }

    /// One forward over the rows of every chunk (type docs). Everything is validated before
    /// any slot is touched: on error no slot changes.
    ///
    /// # Errors
    /// [`speculative::Error::InvalidSlot`] for a slot out of range or listed twice;
    /// [`speculative::Error::InvalidTree`] for a malformed tree or one over
    /// [`BatchTarget::max_tree_nodes`] nodes; [`speculative::Error::TargetContract`] for a
    /// tree chunk with `max_tree_nodes == 0`; [`speculative::Error::Model`] (source
    /// [`CandleError`]) for more than [`BatchTarget::max_batch_tokens`] rows, an empty chunk,
    /// a token outside the vocabulary, a slot that would exceed the context, or a chunk for a
    /// slot whose tree is not committed.
    fn forward_batch(
        &mut self,
        chunks: &[SlotChunk<'_>],
        logits: &mut Vec<f32>,
    ) -> speculative::Result<()> {
        let prepared = self.prepare(chunks)?;
        logits.clear();
        if chunks.is_empty() {
            return Ok(());
        }
        let mut by_slot: Vec<Option<&mut SeqState>> = self.slots.iter_mut().map(Some).collect();
        let mut segs = Vec::with_capacity(chunks.len());
        for (c, p) in chunks.iter().zip(&prepared) {
            let Some(seq) = by_slot[c.slot].take() else {
                // Unreachable after `check_slots`; kept as an error, not a panic.
                return Err(speculative::Error::InvalidSlot {
                    slot: c.slot,
                    max_slots: prepared.len(),
                    reason: "listed twice in one batch",
                });
            };
            let tree = match (&p.rows, &c.input) {
                (Some(rows), SlotInput::Tree { block, .. }) => Some((rows, block)),
                _ => None,
            };
            segs.push(Segment {
                seq,
                tokens: &p.tokens,
                tree,
                logit_rows: c.input.logit_rows(),
            });
        }
        let n_layers = self.weights.config.n_layers;
        run_rows(
            &self.weights,
            n_layers,
            &mut self.exec,
            &mut segs,
            &mut self.hidden,
            logits,
            None,
        )?;
        Ok(())
    }

    /// Drops every position of `slot` at index `>= len`, with
    /// [`FastTarget::truncate_to`](super::FastTarget::truncate_to)'s handling of a pending
    /// tree: `len <= ` root position + 1 drops it, a longer `len` keeps the first nodes when
    /// they form a chain from the root.
    ///
    /// # Errors
    /// [`speculative::Error::InvalidSlot`]; [`speculative::Error::Model`] when
    /// `len > seq_len(slot)` or `len` cuts into a pending tree whose first nodes are not a
    /// chain (the slot is then unchanged).
    fn truncate(&mut self, slot: usize, len: usize) -> speculative::Result<()> {
        let w = Arc::clone(&self.weights);
        Ok(self.slot_mut(slot)?.truncate_to(&w.config, len)?)
    }

    /// # Errors
    /// [`speculative::Error::InvalidSlot`]; [`speculative::Error::TargetContract`] when the
    /// slot has no pending tree or `path` is not a path of it (the slot is then unchanged).
    fn commit_tree(&mut self, slot: usize, path: &[u32]) -> speculative::Result<()> {
        let w = Arc::clone(&self.weights);
        self.slot_mut(slot)?.commit_tree(&w.config, path)
    }

    /// `true`: slots copy prefixes by copying their cache rows.
    fn can_copy_prefix(&self) -> bool {
        true
    }

    /// Copies the keys and values of `src`'s first `len` positions into `dst` (whose cache
    /// grows as needed; `src` unchanged): afterwards `dst`'s logits for any continuation are
    /// bit-identical to `src`'s, and to those of a slot that prefilled the same tokens.
    /// Costs `len · kv_bytes_per_position` bytes of copying, no forward.
    ///
    /// # Errors
    /// [`speculative::Error::InvalidSlot`]; [`speculative::Error::Model`] for `src == dst`,
    /// `len > seq_len(src)` or a pending tree in `src` (`dst` is then unchanged).
    fn copy_prefix(&mut self, src: usize, dst: usize, len: usize) -> speculative::Result<()> {
        self.slot_ref(src)?;
        self.slot_ref(dst)?;
        if src == dst {
            return Err(
                CandleError::InvalidArgument("copy_prefix from a slot into itself".into()).into(),
            );
        }
        let (a, b) = self.slots.split_at_mut(src.max(dst));
        let (from, to) = if src < dst {
            (&a[src], &mut b[0])
        } else {
            (&b[0], &mut a[dst])
        };
        Ok(to.copy_prefix_from(from, len)?)
    }

    /// Empties `slot` (`seq_len` 0, no pending tree) and frees its KV cache.
    ///
    /// # Errors
    /// [`speculative::Error::InvalidSlot`].
    fn release(&mut self, slot: usize) -> speculative::Result<()> {
        let fresh = SeqState::new(&self.weights.config, self.weights.config.n_layers);
        *self.slot_mut(slot)? = fresh;
        Ok(())
    }
}
