//! A fast, batch-invariant CPU forward pass: our own int8 block matmul that reads each weight
//! block once for all rows of a verify call, and a plain-Rust llama forward on it.
//!
//! - [`q8`]: the 8-bit block weight format ([`Q8Matrix`]), activation quantisation
//!   ([`Q8Act`]) and the multi-row matmul with AVX-512 VNNI, AVX2, NEON (with and without the
//!   dot-product extension) and portable kernels that give bit-identical results
//!   ([`KernelPath`]).
//! - [`f32mat`]: the exact path ([`F32Matrix`]): f32 weights, same multi-row structure.
//! - [`forward`]: [`FastWeights`] (loaded from a GGUF file, shared through an `Arc`) and
//!   [`FastTarget`], which implements [`speculative::TargetModel`].
//! - [`batch`]: [`FastBatch`], several sequences in one forward
//!   ([`speculative::BatchTarget`]; each slot's logits bit-identical to a [`FastTarget`]
//!   alone).
//!
//! **Batch invariance.** Every row of a forward is computed by arithmetic that does not depend
//! on how many rows are in the call (fixed accumulation orders everywhere), so the logits of
//! one forward over `n` tokens equal, bit for bit, those of `n` one-token forwards. Greedy
//! speculative decoding with [`FastTarget`] therefore emits exactly the tokens of plain greedy
//! decoding with [`FastTarget`].
//!
//! **Token trees.** [`FastTarget`] implements [`speculative::TreeTarget`]: one forward over a
//! draft tree's root and nodes (tree attention: each node sees the committed context and its
//! ancestors only, at the rotary position of its depth) gives every node, bit for bit, the
//! logits of a chain forward of its path, and `commit_tree` leaves the KV cache a chain of the
//! accepted path would leave (see [`FastTarget`], section "Token trees").
//!
//! **Accuracy.** [`FastFormat::F32`] is the exact shipped model (Q4_1 weights dequantised
//! without re-rounding). [`FastFormat::Q8`] re-quantises the Q4_1 weights to 8-bit blocks
//! (the tied Q8_0 embedding/head is imported exactly) and quantises activations to 8 bits per
//! 32 values before each matmul, like candle's and llama.cpp's Q8_0 paths: an approximation.
//!
//! **Threads.** `FastTarget::with_threads(2)` splits each matmul's output features between the
//! calling thread and one persistent helper thread (spins 200 µs after each job, then parks;
//! no spawn per call), with the same results. Measured on the 2-core machine (SmolLM2-135M,
//! Q8, 100-token prefix, median of 15, `examples/fast_cost_curve.rs`): with the other core
//! idle, 2 threads take 3.8-4.0 ms per 1-token step and 5.3-5.7 ms for 9 tokens against
//! 5.1-5.6 and 7.5-7.7 ms on one thread; with one busy process on the machine, 2 threads take
//! 7.2-7.4 ms per 1-token step (9 tokens: 13-38 ms) against 5.2-5.5 ms on one. The test
//! machines are shared, so one thread stays the default.

pub mod batch;
pub mod f32mat;
pub mod forward;
pub mod head;
pub mod head_fusion;
mod ops;
mod pool;
pub mod q8;

pub use batch::{DEFAULT_MAX_BATCH_TOKENS, FastBatch};
pub use f32mat::F32Matrix;
pub use forward::{DEFAULT_MAX_TREE_NODES, FastFormat, FastTarget, FastWeights, RandomSpec};
pub use head::{DraftHead, DraftHeadConfig, DraftHeadWeights, HeadFormat, HeadTensors};
pub use q8::{KernelPath, Q8Act, Q8Matrix};
