//! Logits dtypes: the element types the verifier and the row processor read.
//!
//! Engines hand logits over in the dtype they compute in: `f32`, or `half::f16` / `half::bf16`
//! from a GPU or a quantised head (cargo feature `half`). Every entry point that reads logits or
//! draft probabilities (`VerifyRequest`, `VerifyBatch`, `DraftQ`, `RowProcessor`) is generic over
//! [`Logit`] and converts values to `f32` as it reads them, so there is no extra pass over the row
//! and no `f32` copy of it: the row scans (maximum, argmax, top-k, the NaN screen) read `f32`
//! and `bf16` rows in place, widening each `bf16` value inside their loops (a shift), and `f16`
//! rows in blocks of 256 values widened into a buffer on the stack by the CPU's conversion
//! instruction (F16C on x86-64); the other passes (candidate lists, log-sum-exp, q checks) widen
//! any non-`f32` row in blocks of 256 values on the stack. The scans process rows in blocks of
//! 256 values whatever the dtype, so `f16` and `bf16` rows go through exactly the arithmetic of
//! their values converted to `f32` (an exact conversion): the results (tokens,
//! log-probabilities, errors) are identical to converting the rows to `f32` first and verifying
//! those.

use std::fmt::Debug;

/// A floating-point element type of logits and draft probabilities: `f32`, and with the cargo
/// feature `half`, `half::f16` and `half::bf16`.
///
/// The bound is [`num_traits::Float`] (so generic code over the dtype has the usual float
/// methods) plus the conversion the processing pipeline uses, [`Logit::widen`]. The trait is
/// sealed: the crate guarantees that `widen` is exact for every implementor, which is what makes
/// the results independent of the dtype a value arrives in.
///
/// Type inference: `f32` is the only primitive float that implements `Logit`, so an array of
/// untyped float literals (`[0.0, 5.0]`) passed where logits are expected is `f32`. (An empty
/// untyped slice `&[]` has no element type to infer: write `&[] as &[f32]`.)
///
/// # Feature `half`
///
/// `half::f16` and `half::bf16` implement `Logit` with the cargo feature `half`, which is off by
/// default: the crate `half` brings `zerocopy-derive` and a second major version of `syn` into
/// the build, which callers with `f32` logits should not pay for. Cost of reading them (the
/// crate's `dtype` benchmark): `bf16` is widened in the scans' loops
/// (a shift), `f16` in blocks of 256 values by the F16C instruction on x86-64 (run-time
/// detected; a portable branch-free conversion elsewhere), both well below the cost of
/// converting the rows to `f32` first.
pub trait Logit: num_traits::Float + Debug + Send + Sync + 'static + sealed::Sealed {
    /// The dtype's name, as used in benchmark labels and messages (`"f32"`, `"f16"`, `"bf16"`).
    const NAME: &'static str;

    /// The value as `f32`, exactly (every `f16` and `bf16` value, NaN payloads included, is an
    /// `f32` value). Branch-free, so that loops over rows vectorise.
    fn widen(self) -> f32;

    /// Whether the scans read this dtype through a buffer of widened blocks
    /// ([`visit_spans`]) rather than widening each value inside their loops.
    #[doc(hidden)]
    const BUFFERED: bool = false;

    /// The values themselves when the dtype is `f32` (read in place), else `None`.
    #[doc(hidden)]
    #[inline(always)]
    fn as_f32(_src: &[Self]) -> Option<&[f32]> {
        None
    }

    /// Writes `src` widened to `f32` into `dst` (`dst.len() == src.len()`), with the fastest
    /// conversion available (vector instructions).
    #[doc(hidden)]
    #[inline]
    fn widen_into(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.widen();
        }
    }

    /// Appends `src` widened to `f32` to `dst` (a copy for `f32`).
    #[doc(hidden)]
    #[inline]
    fn extend_widened(src: &[Self], dst: &mut Vec<f32>) {
        let n = dst.len();
        dst.resize(n + src.len(), 0.0);
        Self::widen_into(src, &mut dst[n..]);
    }
}

/// Rows of dtypes other than `f32` are widened in blocks of this many values
/// ([`for_each_span`]); the scans also work in blocks of this size.
pub(crate) const BLOCK: usize = 256;

/// Calls `f(start, values)` on consecutive spans of `row` widened to `f32`, in order: an `f32`
/// row as one span, read in place; any other dtype in spans of [`BLOCK`] values (the last one may
/// be shorter) widened into a buffer on the stack. Every span but the last is a whole number of
/// blocks of [`BLOCK`] values, so a caller that works block by block (and on the final partial
/// block last) does the same arithmetic in the same order for every dtype.
#[inline(always)]
pub(crate) fn for_each_span<T: Logit>(row: &[T], mut f: impl FnMut(usize, &[f32])) {
    match T::as_f32(row) {
        Some(r) => f(0, r),
        None => {
            let mut buf = [0.0f32; BLOCK];
            for (i, b) in row.chunks(BLOCK).enumerate() {
                let w = &mut buf[..b.len()];
                T::widen_into(b, w);
                f(i * BLOCK, w);
            }
        }
    }
}

/// A row scan that reads a row as consecutive spans ([`visit_spans`]).
pub(crate) trait SpanVisitor {
    /// Reads `span`, the values of the row from index `start` on. Every span but the last is a
    /// whole number of blocks of [`BLOCK`] values.
    fn span<U: Logit>(&mut self, start: usize, span: &[U]);
}

/// Feeds `row` to `v` in order, in the form the dtype is cheapest to read in: the row itself as
/// one span for dtypes whose conversion is a move or a shift (`f32`, `bf16`: each value widened
/// inside the visitor's loops), spans of [`BLOCK`] values widened into a buffer on the stack for
/// the others ([`Logit::BUFFERED`]: `f16`, converted by the CPU's instruction in bulk). A
/// visitor that works block by block (the final partial block last) does the same arithmetic in
/// the same order either way.
#[inline(always)]
pub(crate) fn visit_spans<T: Logit, V: SpanVisitor>(row: &[T], v: &mut V) {
    if T::BUFFERED {
        let mut buf = [0.0f32; BLOCK];
        for (i, b) in row.chunks(BLOCK).enumerate() {
            let w = &mut buf[..b.len()];
            T::widen_into(b, w);
            v.span(i * BLOCK, &*w);
        }
    } else {
        v.span(0, row);
    }
}

/// `f(values)` for at most [`BLOCK`] values of a row, widened to `f32` (in place for `f32`).
#[inline(always)]
pub(crate) fn with_widened<T: Logit, R>(part: &[T], f: impl FnOnce(&[f32]) -> R) -> R {
    debug_assert!(part.len() <= BLOCK);
    match T::as_f32(part) {
        Some(r) => f(r),
        None => {
            let mut buf = [0.0f32; BLOCK];
            let w = &mut buf[..part.len()];
            T::widen_into(part, w);
            f(w)
        }
    }
}

pub(crate) mod sealed {
    /// Only the crate implements [`super::Logit`].
    pub trait Sealed {}
    impl Sealed for f32 {}
}

impl Logit for f32 {
    const NAME: &'static str = "f32";

    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[inline(always)]
    fn as_f32(src: &[Self]) -> Option<&[f32]> {
        Some(src)
    }

    #[inline]
    fn widen_into(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline]
    fn extend_widened(src: &[Self], dst: &mut Vec<f32>) {
        dst.extend_from_slice(src);
    }
}
