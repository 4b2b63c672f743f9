//! Logits dtypes: the element types the verifier and the row processor read.
//!
//! Engines hand logits over in the dtype they compute in: `f32`, or `half::f16` / `half::bf16`
//! from a GPU or a quantised head (cargo feature `half`). Every entry point that reads logits or
//! draft probabilities (`VerifyRequest`, `VerifyBatch`, `DraftQ`, `RowProcessor`) is generic over
//! [`Logit`] and converts each value to `f32` as it reads it ([`Logit::widen`]), inside the same
//! vectorised passes as for `f32`: no extra pass over the row and no `f32` copy of it. `f16` and
//! `bf16` convert to `f32` exactly, so the results (tokens, log-probabilities, errors) are
//! identical to converting the rows to `f32` first and verifying those.

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
/// untyped float literals (`[0.0, 5.0]`) passed where logits are expected is `f32`.
pub trait Logit: num_traits::Float + Debug + Send + Sync + 'static + sealed::Sealed {
    /// The dtype's name, as used in benchmark labels and messages (`"f32"`, `"f16"`, `"bf16"`).
    const NAME: &'static str;

    /// The value as `f32`, exactly (every `f16` and `bf16` value, NaN payloads included, is an
    /// `f32` value). Branch-free, so that loops over rows vectorise.
    fn widen(self) -> f32;

    /// Appends `src` widened to `f32` to `dst` (a copy for `f32`).
    #[doc(hidden)]
    #[inline]
    fn extend_widened(src: &[Self], dst: &mut Vec<f32>) {
        dst.extend(src.iter().map(|x| x.widen()));
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

    #[inline]
    fn extend_widened(src: &[Self], dst: &mut Vec<f32>) {
        dst.extend_from_slice(src);
    }
}
