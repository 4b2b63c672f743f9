//! GPU verification: logits processing and speculative verification where the logits live.
//!
//! In a GPU engine the target logits `[sum_b (k_b + 1), vocab]` of a verify step are already on
//! the device; copying them to the host costs more than verifying them. [`GpuVerifier`] runs the
//! whole pipeline of [`crate::verify`] on the device and copies back only the small results
//! (per row: an acceptance flag, one token, two log-probabilities and the top-n list).
//!
//! | backend | cargo feature | devices | kernels |
//! |---|---|---|---|
//! | [`Backend::Wgpu`] | `wgpu` (or `metal`) | Vulkan, Metal, DX12 through wgpu | WGSL |
//! | [`Backend::Cuda`] | `cuda` | NVIDIA through cudarc (driver and NVRTC loaded at run time) | CUDA C, compiled by NVRTC |
//!
//! The public API is the same under every feature set. A backend that was not compiled in, or
//! that finds no device or driver at run time, makes [`GpuVerifier::new`] return
//! [`Error::BackendUnavailable`] whose `reason` says which (for example "built without feature
//! `wgpu`", "no wgpu adapter found", "CUDA driver library not found"). There is no CPU backend
//! here: the CPU path is [`Verifier::verify_batch`] itself, on the same [`VerifyBatch`], so an
//! engine falls back to it when [`GpuVerifier::new`] fails.
//!
//! ## Semantics
//!
//! Exactly those of [`crate::Verifier::verify_batch`]: ragged drafts by offsets, a
//! [`SamplingConfig`](crate::SamplingConfig), seed, context, prompt length, position and
//! suppressed tokens per sequence ([`SequenceParams`]).
//!
//! Inputs are `f32`: the GPU backends take [`VerifyBatch`] and [`DeviceBatch`] over `f32`
//! target logits and q rows (the default type parameters), not the `half::f16` / `half::bf16`
//! rows that the CPU [`Verifier`] also takes ([`crate::sampling::Logit`]). One draft form per
//! batch: a sequence's own [`SequenceParams::draft_probs`] is accepted only as point masses in
//! a point-mass batch; any other per-sequence form (a batch mixing point-mass and dense-q
//! sequences, or dense q given per sequence) is [`Error::Unsupported`] (the outer `Err`) on the
//! wgpu and CUDA backends; the CPU [`Verifier::verify_batch`] verifies it.
//!
//! Chains only: the kernels verify chains of drafts. A batch with a token tree
//! ([`VerifyBatch::parents`] other than each sequence's chain), a sibling scheme other than the
//! draft form's default ([`VerifyBatch::schemes`]) or an ending draft ([`VerifyBatch::ends`])
//! is [`Error::Unsupported`] (the outer `Err`); the CPU [`Verifier::verify_batch`] verifies
//! trees ([`crate::verify`], section "Trees").
//!
//! - Processing order: penalties -> logit bias -> allowed / banned sets, the tokens suppressed at
//!   rows `0..suppress_rows` and the caller's mask -> temperature -> top-k -> softmax -> top-p ->
//!   min-p -> renormalise. The repetition penalty counts every earlier token (prompt and
//!   generated); frequency and presence count the generated ones (context from `prompt_len` on,
//!   and the earlier drafts of the block) unless
//!   [`PenaltyScope::WholeContext`](crate::sampling::PenaltyScope::WholeContext) (case C12).
//! - Greedy rows: the argmax, ties to the lowest id.
//! - Point-mass drafts at temperature > 0: the row's token is drawn from the processed row with
//!   the SAMPLE-lane uniform of its position (inverse CDF in token-id order) and the draft is
//!   accepted iff it is that token, which is also the token emitted on rejection (case C15): on
//!   the device as on the CPU, seeded output does not depend on the drafts or their number.
//! - Dense-q drafts (probabilities, or draft logits processed on the device by the same kernel
//!   in a first pass, with the sequence's configuration and history, into dense q): acceptance
//!   `min(1, p / q)` with the ACCEPT-lane uniform, residual `normalise(max(0, p - q))` with the
//!   SAMPLE-lane one; the bonus token from row `k`.
//!
//! Random draws use the same Philox4x32-10 stream ([`crate::rng::Stream::uniform`], same
//! positions and lanes), so the GPU emits the same tokens as the CPU except where float rounding
//! moves a draw across a boundary (the GPU sums in f32 where the CPU sums in f64). Top-k and
//! top-p never sort the vocabulary: the threshold is found by a multi-pivot bisection on the
//! order-preserving bit pattern of the keys, with counting (top-k) or mass (top-p) passes, and
//! ties at the threshold go to the lowest ids as on the CPU.
//!
//! ## Validation
//!
//! As on the CPU, whether a sequence is rejected never depends on its seed (case C14), and its
//! first error is the CPU's. Everything that is in host memory (shapes, token ids against the
//! target and draft vocabularies, the configuration's and the suppressed tokens, every dense q
//! row, every draft logit) is checked on the host before the launch by the CPU's own checks;
//! with host logits ([`GpuVerifier::verify_batch`]) the raw target logits too. With
//! device-resident logits ([`GpuVerifier::verify_wgpu`], [`GpuVerifier::verify_cuda`]) every
//! target row reports its first NaN / `+inf` from the device, reached by the step or not. Then
//! come the context tokens (with penalties), the draft-logit rows in order (processed on the
//! device: no allowed token, or a draft the processed row gives probability 0, in greedy mode a
//! draft that is not its argmax), and last [`Error::NoAllowedToken`] (or a NaN / `+inf` made by
//! the penalties or the bias) for the target rows the step reaches.
//!
//! Differences from the CPU path:
//! - At most [`MAX_TOP_LOGPROBS`] top log-probabilities per token ([`Error::InvalidConfig`] for
//!   the sequence otherwise, reported after the CPU's input checks, before the raw target check
//!   of device-resident logits).
//! - A caller [`TokenMask`](crate::TokenMask) is evaluated on the host on a row of zeros (the
//!   device logits are never read by the host): it must depend only on the prefix, as its
//!   contract says, not on the logit values.
//! - Probabilities below the smallest normal f32 (about `1e-38`) may be flushed to 0 by the
//!   device, so such tokens can be missing from the support and the top-n lists (and a draft of
//!   such a probability can be reported as impossible).
//! - One launch addresses at most `2^32` logits elements (and, on wgpu, one storage binding of
//!   the device's limit): larger batches are an [`Error::BatchTooLarge`]; split them.
//! - Penalties or a logit bias that push a finite logit past the f32 range (magnitudes near
//!   `3.4e38`): the CPU saturates at `±f32::MAX`, the kernels report
//!   [`Error::NonFiniteLogits`] for that row when the step reaches it.
//!
//! ## Errors
//!
//! The outer `Err` of the verify methods is for a malformed batch (the errors of
//! [`Verifier::verify_batch`]), a call on the wrong backend ([`Error::WrongBackend`]), or a
//! device failure ([`Error::BackendUnavailable`]); each inner `Result` is one sequence's outcome
//! with the errors of [`Verifier::verify`], including [`RowKind::Draft`](crate::RowKind::Draft)
//! errors of draft-logit rows.
//!
//! ## Sources
//!
//! Leviathan, Kalman & Matias 2023 and Chen et al. 2023 (the acceptance rule); Salmon et al.
//! 2011 (Philox); the pivot-based sorting-free top-k / top-p idea of FlashInfer's sampling
//! kernels (our kernels are our own, deterministic, and reproduce the CPU's tie rules).

#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
mod pack;

#[cfg(feature = "cuda")]
mod cuda_impl;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_absent.rs"]
mod cuda_impl;
#[cfg(feature = "wgpu")]
mod wgpu_impl;
#[cfg(not(feature = "wgpu"))]
#[path = "wgpu_absent.rs"]
mod wgpu_impl;

#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "wgpu")]
pub use wgpu;

pub use cuda_impl::{CudaDevice, CudaLogits};
pub use pack::MAX_TOP_LOGPROBS;
pub use wgpu_impl::{WgpuDevice, WgpuLogits};

use std::fmt;

use crate::error::{Error, Result};
use crate::tree::SiblingScheme;
use crate::verify::{DraftProbs, SequenceParams, StepOutput, VerifyBatch};
// For the docs' links only: verification itself never calls the CPU verifier.
#[cfg(doc)]
use crate::verify::Verifier;

/// The WGSL source of the verification kernel (entry point `verify_rows`).
pub const WGSL_SOURCE: &str = include_str!("kernels/verify.wgsl");
/// The CUDA C source of the verification kernel (entry point `verify_rows`), compiled at run
/// time by NVRTC.
pub const CUDA_SOURCE: &str = include_str!("kernels/verify.cu");

/// The GPU backend a [`GpuVerifier`] runs on (on the host, use [`Verifier::verify_batch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// NVIDIA GPUs through cudarc (feature `cuda`).
    Cuda,
    /// Vulkan, Metal or DX12 through wgpu (feature `wgpu`, or `metal` on Apple).
    Wgpu,
}

impl Backend {
    /// The backend's name as used in errors: `"cuda"`, `"wgpu"`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cuda => "cuda",
            Backend::Wgpu => "wgpu",
        }
    }

    /// Whether this build contains the backend (it may still find no device at run time).
    pub fn is_compiled(self) -> bool {
        match self {
            Backend::Cuda => cuda_impl::COMPILED,
            Backend::Wgpu => wgpu_impl::COMPILED,
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A verify batch whose target logits stay on the device: [`VerifyBatch`] (over `f32`) without
/// `target_logits`. The logits are passed separately ([`WgpuLogits`], [`CudaLogits`]) with the
/// same shape, `[sum_b (k_b + 1), vocab_size]` row-major f32.
#[derive(Debug, Clone, Copy)]
pub struct DeviceBatch<'a> {
    /// Width of a target row, in tokens.
    pub vocab_size: usize,
    /// All draft tokens, `[sum_b k_b]` (host memory).
    pub draft_tokens: &'a [u32],
    /// `[batch + 1]` offsets into `draft_tokens`: starts at 0, non-decreasing, ends at
    /// `draft_tokens.len()`.
    pub draft_offsets: &'a [usize],
    /// q for all sequences (host memory): point masses, or `[sum_b k_b, draft_vocab]`
    /// probabilities or draft logits (uploaded, then processed on the device).
    pub draft_probs: DraftProbs<'a>,
    /// One entry per sequence.
    pub sequences: &'a [SequenceParams<'a>],
    /// Parent rows, `[sum_b k_b]` ([`VerifyBatch::parents`]): the GPU backends take chains only,
    /// so every sequence's parents must be its chain (`i` at node `i`), or `None`.
    pub parents: Option<&'a [u32]>,
    /// Sibling schemes, `[sum_b k_b]` ([`VerifyBatch::schemes`]): on the GPU only the default
    /// of the batch's draft form, or `None`.
    pub schemes: Option<&'a [SiblingScheme]>,
    /// Ending drafts, `[sum_b k_b]` or empty ([`VerifyBatch::ends`]): on the GPU all `false`,
    /// or empty.
    pub ends: &'a [bool],
}

impl<'a> DeviceBatch<'a> {
    /// The batch of `b` without its host logits.
    pub fn from_batch(b: &VerifyBatch<'a>) -> Self {
        DeviceBatch {
            vocab_size: b.vocab_size,
            draft_tokens: b.draft_tokens,
            draft_offsets: b.draft_offsets,
            draft_probs: b.draft_probs,
            sequences: b.sequences,
            parents: b.parents,
            schemes: b.schemes,
            ends: b.ends,
        }
    }

    /// The draft layout (tokens, offsets, tree arrays) shared with the CPU path.
    pub(crate) fn layout(&self) -> crate::verify::BatchLayout<'a> {
        crate::verify::BatchLayout {
            draft_tokens: self.draft_tokens,
            draft_offsets: self.draft_offsets,
            parents: self.parents,
            schemes: self.schemes,
            ends: self.ends,
        }
    }

    /// Number of target rows, `sum_b (k_b + 1)`.
    pub fn rows(&self) -> usize {
        self.draft_tokens.len() + self.sequences.len()
    }
}

enum Inner {
    Cuda(Box<cuda_impl::CudaVerifier>),
    Wgpu(Box<wgpu_impl::WgpuVerifier>),
}

/// Batch verification on a GPU backend, with the same results as [`Verifier::verify_batch`]
/// (the CPU path, on the same [`VerifyBatch`]).
///
/// Holds the device, the compiled kernel and reusable device buffers; create one per device
/// and reuse it for every step.
///
/// `GpuVerifier` is `Send + Sync` under every feature set (`wgpu`, `cuda` or neither): it can be
/// moved to the thread that drives its device. Its methods take `&mut self`.
pub struct GpuVerifier {
    inner: Inner,
}

impl fmt::Debug for GpuVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuVerifier")
            .field("backend", &self.backend())
            .field("device", &self.device_name())
            .finish()
    }
}

impl GpuVerifier {
    /// A verifier on the default device of `backend` (wgpu: a high-performance adapter of any
    /// native API; CUDA: device 0).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the backend was not compiled in ("built without
    /// feature ..."), its driver cannot be loaded, no device is found, or the kernel does not
    /// compile (the reason is in the message).
    pub fn new(backend: Backend) -> Result<Self> {
        let inner = match backend {
            Backend::Cuda => Inner::Cuda(Box::new(cuda_impl::CudaVerifier::new()?)),
            Backend::Wgpu => Inner::Wgpu(Box::new(wgpu_impl::WgpuVerifier::new()?)),
        };
        Ok(GpuVerifier { inner })
    }

    /// A verifier on an engine's own wgpu device (so that [`GpuVerifier::verify_wgpu`] can read
    /// the engine's buffers).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the kernel does not compile on this device.
    pub fn with_wgpu(device: WgpuDevice) -> Result<Self> {
        Ok(GpuVerifier {
            inner: Inner::Wgpu(Box::new(wgpu_impl::WgpuVerifier::from_device(device)?)),
        })
    }

    /// A verifier on an engine's own CUDA context and stream (so that
    /// [`GpuVerifier::verify_cuda`] can read the engine's device memory).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when NVRTC is missing or the kernel does not compile.
    pub fn with_cuda(device: CudaDevice) -> Result<Self> {
        Ok(GpuVerifier {
            inner: Inner::Cuda(Box::new(cuda_impl::CudaVerifier::from_device(device)?)),
        })
    }

    /// The backend this verifier runs on.
    pub fn backend(&self) -> Backend {
        match self.inner {
            Inner::Cuda(_) => Backend::Cuda,
            Inner::Wgpu(_) => Backend::Wgpu,
        }
    }

    /// A human-readable device name (adapter name and driver, or the CUDA device name).
    pub fn device_name(&self) -> String {
        match &self.inner {
            Inner::Cuda(c) => c.device_name(),
            Inner::Wgpu(w) => w.device_name(),
        }
    }

    /// The wgpu device this verifier runs on (`None` for other backends): create the logits
    /// buffers for [`GpuVerifier::verify_wgpu`] on it.
    pub fn wgpu_device(&self) -> Option<&WgpuDevice> {
        match &self.inner {
            Inner::Wgpu(w) => Some(w.device()),
            _ => None,
        }
    }

    /// The CUDA stream this verifier runs on (`None` for other backends).
    pub fn cuda_device(&self) -> Option<&CudaDevice> {
        match &self.inner {
            Inner::Cuda(c) => Some(c.device()),
            _ => None,
        }
    }

    /// One read of the first `n` logits of a wgpu buffer: a reduction kernel that sums every
    /// element once, on the same device and queue as verification. The benchmarks quote
    /// verification time as a ratio to this. Returns the sum (f32, order unspecified).
    ///
    /// # Errors
    /// [`Error::WrongBackend`] when this verifier is not on wgpu, [`Error::ShapeMismatch`]
    /// when the buffer holds fewer than `n` values, [`Error::BackendUnavailable`] on a device
    /// failure.
    pub fn read_wgpu(&mut self, logits: WgpuLogits<'_>, n: usize) -> Result<f32> {
        let b = self.backend();
        match &mut self.inner {
            Inner::Wgpu(w) => w.read(logits, n),
            _ => Err(Error::WrongBackend {
                method: "read_wgpu",
                backend: b.name(),
            }),
        }
    }

    /// [`GpuVerifier::read_wgpu`] for CUDA device memory.
    ///
    /// # Errors
    /// As [`GpuVerifier::read_wgpu`], for CUDA.
    pub fn read_cuda(&mut self, logits: CudaLogits<'_>, n: usize) -> Result<f32> {
        let b = self.backend();
        match &mut self.inner {
            Inner::Cuda(c) => c.read(logits, n),
            _ => Err(Error::WrongBackend {
                method: "read_cuda",
                backend: b.name(),
            }),
        }
    }

    /// Verifies a batch whose logits are in host memory: they are uploaded, verified on the
    /// device, and only the small results come back. Same contract as
    /// [`Verifier::verify_batch`], for `f32` rows.
    ///
    /// # Errors
    /// The outer `Err` for a malformed batch (the errors of [`Verifier::verify_batch`]), for
    /// per-sequence draft forms or token trees the device backends do not take
    /// ([`Error::Unsupported`], see the module docs) or for a device failure ([`Error::BackendUnavailable`]); each inner
    /// `Result` is that sequence's own outcome.
    pub fn verify_batch(&mut self, batch: &VerifyBatch<'_>) -> Result<Vec<Result<StepOutput>>> {
        let dev = DeviceBatch::from_batch(batch);
        match &mut self.inner {
            Inner::Cuda(c) => {
                let qv = check(&dev, batch.target_logits.len(), true)?;
                c.verify_host(batch.target_logits, &dev, qv)
            }
            Inner::Wgpu(w) => {
                let qv = check(&dev, batch.target_logits.len(), true)?;
                w.verify_host(batch.target_logits, &dev, qv)
            }
        }
    }

    /// Verifies a batch whose logits are in a wgpu buffer of this verifier's device.
    ///
    /// # Errors
    /// As [`GpuVerifier::verify_batch`]; [`Error::WrongBackend`] when this verifier is not
    /// on wgpu; [`Error::ShapeMismatch`] when the buffer is smaller than the batch's logits.
    pub fn verify_wgpu(
        &mut self,
        logits: WgpuLogits<'_>,
        batch: &DeviceBatch<'_>,
    ) -> Result<Vec<Result<StepOutput>>> {
        match &mut self.inner {
            Inner::Wgpu(w) => {
                let qv = check(batch, logits.len(), false)?;
                w.verify_device(logits, batch, qv)
            }
            _ => Err(Error::WrongBackend {
                method: "verify_wgpu",
                backend: self.backend().name(),
            }),
        }
    }

    /// Verifies a batch whose logits are CUDA device memory of this verifier's context.
    ///
    /// # Errors
    /// As [`GpuVerifier::verify_wgpu`], for CUDA.
    pub fn verify_cuda(
        &mut self,
        logits: CudaLogits<'_>,
        batch: &DeviceBatch<'_>,
    ) -> Result<Vec<Result<StepOutput>>> {
        match &mut self.inner {
            Inner::Cuda(c) => {
                let qv = check(batch, logits.len(), false)?;
                c.verify_device(logits, batch, qv)
            }
            _ => Err(Error::WrongBackend {
                method: "verify_cuda",
                backend: self.backend().name(),
            }),
        }
    }
}

/// Compiles [`CUDA_SOURCE`] to PTX with NVRTC (what [`GpuVerifier::new`] does for
/// [`Backend::Cuda`] before loading it); useful to check a toolkit without a GPU.
///
/// # Errors
/// [`Error::BackendUnavailable`] when built without feature `cuda`, when the NVRTC library
/// cannot be loaded, or with the compiler log when the source does not compile.
pub fn cuda_ptx() -> Result<String> {
    cuda_impl::compile_ptx()
}

/// Batch checks plus the logits length; returns the dense q width (0 for point masses).
fn check(batch: &DeviceBatch<'_>, logits_len: usize, exact: bool) -> Result<usize> {
    let qv = pack::check_batch(batch)?;
    let expected = batch.rows() * batch.vocab_size;
    if logits_len < expected || (exact && logits_len != expected) {
        return Err(Error::ShapeMismatch {
            what: "target_logits ([sum(k + 1), vocab])",
            expected,
            actual: logits_len,
        });
    }
    Ok(qv)
}

pub(crate) fn unavailable(backend: Backend, reason: impl Into<String>) -> Error {
    Error::BackendUnavailable {
        backend: backend.name(),
        reason: reason.into(),
    }
}
