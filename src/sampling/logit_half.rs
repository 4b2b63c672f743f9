//! [`Logit`] for `half::f16` and `half::bf16` (cargo feature `half`).
//!
//! The conversions are written here from the IEEE 754 binary16 and bfloat16 layouts,
//! branch-free so that loops over them vectorise. Blocks of `f16` values (what the row scans
//! read, [`Logit::widen_into`]) use the F16C conversion instruction on x86-64 CPUs that have it
//! (detected at run time, once per block of 256 values). All paths are exact and the tests
//! compare them with `half`'s own conversion on every value.

use half::{bf16, f16};

use super::logit::{Logit, sealed::Sealed};

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
    const BUFFERED: bool = true;

    #[inline(always)]
    fn widen(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }

    #[inline]
    fn widen_into(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if f16c::available() {
            // SAFETY: the CPU supports F16C and AVX (checked just above).
            unsafe { f16c::widen(src, dst) };
            return;
        }
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.widen();
        }
    }
}

/// F16C (x86-64): eight binary16 values to binary32 per instruction.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};

    use super::{Logit, f16};

    /// Whether the CPU has F16C and AVX (cached by the standard library after the first call).
    #[inline]
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
    }

    /// Writes `src` widened into `dst[..src.len()]`.
    ///
    /// # Safety
    /// The CPU must support F16C and AVX ([`available`]).
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` keeps both 8-value accesses inside the slices (unaligned
            // loads and stores); `f16` is a transparent `u16`.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = src[j].widen();
        }
    }
}

impl Logit for bf16 {
    const NAME: &'static str = "bf16";

    /// bfloat16 is the upper half of a binary32: the conversion is a shift.
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    #[inline]
    fn widen_into(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.widen();
        }
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

    /// The block conversion (`half`'s, hardware where present) equals the single-value one on
    /// every value.
    #[test]
    fn block_conversion_equals_widen() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let h: Vec<f16> = all.iter().map(|&b| f16::from_bits(b)).collect();
        let b: Vec<bf16> = all.iter().map(|&b| bf16::from_bits(b)).collect();
        let mut out = vec![0.0f32; all.len()];
        f16::widen_into(&h, &mut out);
        for (x, o) in h.iter().zip(&out) {
            assert!(x.widen().to_bits() == o.to_bits() || (x.is_nan() && o.is_nan()));
        }
        // Unaligned starts and short tails.
        for start in 0..9 {
            let mut o = vec![0.0f32; 37];
            f16::widen_into(&h[1000 + start..1037 + start], &mut o);
            for (x, o) in h[1000 + start..].iter().zip(&o) {
                assert_eq!(x.widen().to_bits(), o.to_bits());
            }
        }
        bf16::widen_into(&b, &mut out);
        for (x, o) in b.iter().zip(&out) {
            assert!(x.widen().to_bits() == o.to_bits() || (x.is_nan() && o.is_nan()));
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
