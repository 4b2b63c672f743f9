//! # speculative
//!
//! Lossless speculative decoding for any LLM inference engine.
//!
//! A cheap **proposer** guesses `k` draft tokens; the **target** model scores them in one forward
//! over `[last token, d_1 .. d_k]`, giving logits `[k + 1, vocab]`; the **verifier** accepts the
//! longest valid prefix and emits one corrected or bonus token. The emitted sequence has exactly
//! the distribution of plain sampling from the processed target (Leviathan, Kalman & Matias 2023;
//! Chen et al. 2023), and in greedy mode it is token-identical to plain greedy decoding.
//!
//! The crate never asks for your tensor types: logits are slices with documented shapes, in the
//! dtype you have them in (`f32`; `half::f16` and `half::bf16` with the feature `half`; see
//! [`sampling::Logit`]), or `ndarray` views ([`VerifyRequest::from_array`]).
//!
//! ## Quick start: verify logits you already have
//!
//! ```
//! use speculative::{DraftProbs, SamplingConfig, Verifier, VerifyRequest};
//!
//! let vocab = 3;
//! // k = 1 draft token (token 0) sampled by a draft model from q = [0.5, 0.4, 0.1].
//! let q = [0.5f32, 0.4, 0.1];
//! // Target logits [k + 1, vocab].
//! let target = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln(), 0.0, 0.0, 0.0];
//! let cfg = SamplingConfig::builder().temperature(1.0).top_p(0.9).build()?;
//! let mut verifier = Verifier::new();
//! let out = verifier.verify(
//!     &VerifyRequest::new(&cfg, &target, vocab, &[0])
//!         .draft_probs(DraftProbs::Probs { probs: &q, vocab })
//!         .seed(7),
//! )?;
//! assert_eq!(out.tokens.len(), out.accepted + 1);
//! # Ok::<(), speculative::Error>(())
//! ```
//!
//! ## The guarantee
//!
//! For any proposer, each verify step emits tokens distributed exactly as plain sampling from
//! the processed target distribution. The processing pipeline (see [`sampling`]) is applied to
//! target rows and draft rows by the same code, with the same history. Greedy verification
//! compares argmaxes (ties to the lowest id) and is token-identical to plain greedy decoding.
//! Random draws come from a counter-based stream keyed by `(seed, position)` ([`rng`]), so a
//! sequence's result never depends on batch order or composition.
//!
//! ## Terms
//!
//! One spelling for each idea across the API and these docs:
//!
//! - **Draft length `k`**: the number of draft tokens verified in one step. A verify call scores
//!   `k + 1` target rows, logits `[k + 1, vocab]`. Fields that bound or set it end in `_draft`:
//!   [`ProposeRequest::max_draft`],
//!   [`AdaptiveConfig::max_draft`](decode::AdaptiveConfig::max_draft),
//!   [`AdaptiveConfig::probe_draft`](decode::AdaptiveConfig::probe_draft); the per-request
//!   policy is [`DraftLength`](decode::DraftLength) (`Fixed(k)`, `Adaptive`, `Off`).
//!   The `k` of top-k sampling ([`SamplingConfig::top_k`]) is another number.
//! - **No-draft step**: a step with `k = 0`, that is one step of plain decoding (one target row,
//!   one token). It ends with [`StepEnd::NoDraft`] and is counted by
//!   [`Metrics::no_draft_steps`](decode::Metrics::no_draft_steps). `DraftLength::Off`
//!   (speculation off) and [`NoProposer`] make every step one; any proposer may return an empty
//!   draft.
//! - **Accepted** counts draft tokens only ([`StepOutput::accepted`]); **emitted** adds the one
//!   correction or bonus token of the step. The mean accepted length counts emitted tokens per
//!   verify call, the bonus included ([`Metrics`](decode::Metrics) states both definitions).
//! - **p** is the processed target distribution of a row, **q** the draft distribution a draft
//!   token was sampled from; a proposer without q (prompt lookup, suffix tree) gives a
//!   **point-mass** draft.
//! - **Token tree**: a draft of several candidate continuations verified in one forward
//!   ([`DraftBlock`]; nodes with the target row of their parent, the root being the last
//!   committed token). A chain is the tree with one node per depth. For a tree, `k` counts its
//!   **nodes**, its **depth** is the longest path, and the accepted length is that of the
//!   accepted path ([`StepOutput::path`]); [`decode::TreeDrafts`] ([`decode::GenerationParams::tree`])
//!   turns tree steps on.
//!
//! ## Layers
//!
//! - [`sampling`]: configuration and logits processing.
//! - [`tree`]: the draft block (a chain or a token tree) every layer reads.
//! - [`verify`]: greedy and stochastic verification, the batch API, closed forms.
//! - [`propose`]: the [`Proposer`] trait and the shipped proposers.
//! - [`model`]: the engine-facing traits ([`TargetModel`], with the optional [`TreeTarget`],
//!   [`HiddenStates`] and [`TargetFeatures`] extensions), below `propose` and `decode`, which
//!   both drive models.
//! - [`decode`]: the decoding loop.
//! - `conformance` (feature `conformance`): checks of an engine against the contract of
//!   [`model`], above every other layer.
//! - [`rng`]: the counter-based random stream.
//! - [`gpu`]: the same verification on a GPU, where the logits are.
//!
//! ## Features
//!
//! - `test-util`: toy targets and proposers (module `test_util`) for your own tests.
//! - `conformance`: the conformance kit (module `conformance`, macro `conformance_tests!`):
//!   checks that an engine meets the contract of [`model`]'s traits and that it decodes
//!   losslessly with a proposer and our loop, with a report of what differs.
//! - `half`: logits and draft q in `half::f16` / `half::bf16` ([`sampling::Logit`]), read
//!   without an `f32` copy. Off by default only to keep the default build small: `half` brings
//!   `zerocopy-derive` and a second major version of `syn` (proc-macro crates) into the build.
//! - `wgpu`: [`gpu::Backend::Wgpu`], WGSL kernels on Vulkan, Metal or DX12 through wgpu
//!   (re-exported as `gpu::wgpu`).
//! - `metal`: the same as `wgpu` (wgpu drives Apple GPUs through Metal).
//! - `cuda`: [`gpu::Backend::Cuda`], CUDA kernels compiled at run time by NVRTC, through cudarc
//!   (re-exported as `gpu::cudarc`); the driver and NVRTC are loaded dynamically, so the crate
//!   builds and its tests run (skipping) on machines without CUDA.
//! - `serde`: `Serialize` / `Deserialize` for [`SamplingConfig`], [`decode::GenerationParams`]
//!   and the other settings, with the parameter names of HF `GenerationConfig` and vLLM
//!   `SamplingParams` (module `config`).
//!
//! Without a GPU feature, [`gpu::GpuVerifier::new`] reports
//! [`Error::BackendUnavailable`] for those backends; the API is the same under every feature set.

//!
//! ## Dependencies
//!
//! - `rand` (default features off: only its traits): [`rng::StreamRng`] implements
//!   `rand::RngCore`, so callers draw from the request's reproducible stream with any `rand` or
//!   `rand_distr` distribution. The crate's own draws need no distribution beyond the uniform of
//!   [`rng::Stream`] (tokens are drawn by inverse CDF over the processed row), so `rand_distr`
//!   is only a dev-dependency: the tests and doc examples use it to show that `StreamRng` drives
//!   its distributions.
//! - `serde` (optional, feature `serde`).

#![deny(missing_docs)]
// docs.rs (`--cfg docsrs`, nightly rustdoc): label feature-gated items with their feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "serde")]
pub mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod decode;
pub mod error;
pub mod gpu;
pub mod model;
pub mod propose;
pub mod rng;
pub mod sampling;
#[cfg(feature = "test-util")]
pub mod test_util;
pub(crate) mod timing;
pub mod tree;
pub mod verify;

pub use error::{Error, ProposalFault, Result, RowKind};
pub use model::{
    BatchRollback, BatchRowStates, BatchStateSnapshot, BatchTarget, FeatureLayer, FeatureLayout,
    HiddenStates, PerSlot, Rollback, RollbackMode, RowStates, SlotChunk, SlotInput, StateSnapshot,
    TargetFeatures, TargetModel, TreeTarget, check_feature_layouts, rollback_mode,
};
pub use propose::{
    CrossVocabProposer, Draft, DraftModelProposer, MergedProposer, NoProposer, PromptLookup,
    PromptLookupConfig, ProposeRequest, Proposer, RecyclingConfig, SuffixConfig, SuffixProposer,
    TokenRecycling, VerifiedRows,
};
pub use sampling::{SamplingConfig, SamplingConfigBuilder, TokenDist, TokenMask};
pub use tree::{DraftBlock, SiblingScheme, TreeFault, TreeLimits};
pub use verify::{
    DraftProbs, DraftQ, RowCandidates, SequenceParams, SequenceState, StepEnd, StepOutput,
    TokenLogprob, Verifier, VerifyBatch, VerifyRequest,
};

/// The code blocks of README.md, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
