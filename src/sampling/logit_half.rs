//! [`Logit`] for `half::f16` and `half::bf16` (cargo feature `half`).
//!
//! The conversions are written here from the IEEE 754 binary16 and bfloat16 layouts, branch-free
//! (selects only) so that the row scans that call them per element vectorise. `half`'s own
//! `to_f32` checks for a hardware instruction at run time on every call, which stops the
//! compiler from vectorising those loops.

use half::{bf16, f16};

use super::logit::{sealed::Sealed, Logit};

impl Sealed for f16 {}
impl Sealed for bf16 {}

/// `2^-14`, the smallest positive normal binary16 value, as an `f32` (exponent field 113).
const TWO_POW_M14: u32 = 113 << 23;

/// Exact binary16 -> binary32 conversion of the bits `h`.
///
/// Exponent and mantissa move to the binary32 positions (`<< 13`) and the exponent is rebased
/// by `127 - 15 = 112`. Then: exponent field 31 (infinity, NaN) gets another 112 so that it
/// becomes 255, keeping the mantissa (NaN payload); exponent field 0 (zero, subnormal,
/// `m * 2^-24`) is built as the normal `2^-14 * (1 + m / 1024)` minus `2^-14`, which is exact
/// and never touches a binary32 subnormal. The sign bit is copied last.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let em = (h & 0x7fff) << 13;
    let exp = em & 0x0f80_0000;
    let rebased = em + (112 << 23);
    let normal = f32::from_bits(rebased);
    let special = f32::from_bits(rebased + (112 << 23));
    let tiny = f32::from_bits(rebased + (1 << 23)) - f32::from_bits(TWO_POW_M14);
    let mag = if exp == 0x0f80_0000 {
        special
    } else if exp == 0 {
        tiny
    } else {
        normal
    };
    f32::from_bits(mag.to_bits() | ((h & 0x8000) << 16))
}

impl Logit for f16 {
    const NAME: &'static str = "f16";

    #[inline(always)]
    fn widen(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
}

impl Logit for bf16 {
    const NAME: &'static str = "bf16";

    /// bfloat16 is the upper half of a binary32: the conversion is a shift.
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every binary16 value, against `half`'s portable conversion (bits equal, NaN for NaN).
    #[test]
    fn f16_widen_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let want = h.to_f32_const();
            let got = h.widen();
            if want.is_nan() {
                assert!(got.is_nan(), "{bits:#06x}");
                assert_eq!(got.to_bits() & 0x8000_0000, want.to_bits() & 0x8000_0000);
            } else {
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{bits:#06x}: {got} vs {want}"
                );
            }
            // Round trip: the f32 value converts back to the same binary16 value.
            if !want.is_nan() {
                assert_eq!(f16::from_f32(got).to_bits(), bits);
            }
        }
    }

    #[test]
    fn bf16_widen_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let b = bf16::from_bits(bits);
            let want = b.to_f32();
            let got = b.widen();
            if want.is_nan() {
                assert!(got.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn special_values() {
        assert_eq!(f16::INFINITY.widen(), f32::INFINITY);
        assert_eq!(f16::NEG_INFINITY.widen(), f32::NEG_INFINITY);
        assert!(f16::NAN.widen().is_nan());
        assert_eq!(f16::MIN_POSITIVE_SUBNORMAL.widen(), 2f32.powi(-24));
        assert_eq!(f16::MAX.widen(), 65504.0);
        assert_eq!(f16::NEG_ZERO.widen().to_bits(), (-0.0f32).to_bits());
        assert_eq!(bf16::NEG_INFINITY.widen(), f32::NEG_INFINITY);
        assert_eq!(bf16::from_f32(1.5).widen(), 1.5);
    }
}
