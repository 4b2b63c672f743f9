//! A counter-based random stream keyed by `(seed, position)`.
//!
//! Every random draw of the crate (acceptance tests, residual and bonus samples, draft samples of
//! the shipped sampling proposers) is a pure function of the request's seed, the absolute token
//! position the draw belongs to, and a lane that names its purpose. There is no hidden generator
//! state: results do not depend on batch order, batch composition, or how the generation was
//! split into steps, and a GPU kernel reproduces the same draws bit for bit.
//!
//! The generator is Philox4x32-10 (Salmon, Moraes, Dror & Shaw, "Parallel random numbers: as easy
//! as 1, 2, 3", SC 2011), the counter-based generator used by cuRAND, PyTorch and JAX. The key is
//! the 64-bit seed; the 128-bit counter is `(position low, position high, lane, 0)`.

/// Lanes: the purpose of a draw at a position. Different lanes give independent uniforms.
pub mod lane {
    /// The uniform `u` of the acceptance test `u < p(x) / q(x)` of the draft at this position.
    pub const ACCEPT: u32 = 0;
    /// The uniform that samples the emitted token at this position (residual, bonus, or plain).
    pub const SAMPLE: u32 = 1;
    /// The uniform a sampling proposer (draft model, heads) uses to draw its draft at this position.
    pub const DRAFT: u32 = 2;
}

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = (a as u64) * (b as u64);
    ((p >> 32) as u32, p as u32)
}

/// Philox4x32 with 10 rounds: 128 random bits from a 128-bit counter and a 64-bit key.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The random stream of one request: uniforms keyed by `(position, lane)`.
///
/// `Stream` is `Send + Sync` and `Copy`: it holds only the key, so share or copy it freely.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stream {
    key: [u32; 2],
}

impl Stream {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        Stream {
            key: [seed as u32, (seed >> 32) as u32],
        }
    }

    /// 128 random bits for `(position, lane)`.
    #[inline]
    pub fn bits(&self, position: u64, lane: u32) -> [u32; 4] {
        philox4x32_10(
            [position as u32, (position >> 32) as u32, lane, 0],
            self.key,
        )
    }

    /// A uniform in `[0, 1)` with 24 bits of resolution (exactly representable in `f32`, so a GPU
    /// kernel computes the same value): `(bits >> 8) * 2^-24` of the first output word.
    #[inline]
    pub fn uniform(&self, position: u64, lane: u32) -> f32 {
        (self.bits(position, lane)[0] >> 8) as f32 * (1.0 / 16_777_216.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answer() {
        // Known-answer vectors from the Random123 distribution (kat_vectors, philox4x32_10).
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn uniforms_are_in_range_and_keyed() {
        let s = Stream::new(42);
        let mut sum = 0.0f64;
        for pos in 0..10_000u64 {
            let u = s.uniform(pos, lane::ACCEPT);
            assert!((0.0..1.0).contains(&u));
            sum += u as f64;
        }
        assert!((sum / 10_000.0 - 0.5).abs() < 0.01);
        assert_ne!(s.uniform(7, lane::ACCEPT), s.uniform(7, lane::SAMPLE));
        assert_ne!(
            s.uniform(7, lane::ACCEPT),
            Stream::new(43).uniform(7, lane::ACCEPT)
        );
        assert_eq!(
            s.uniform(7, lane::ACCEPT),
            Stream::new(42).uniform(7, lane::ACCEPT)
        );
    }
}
