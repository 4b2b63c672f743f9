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
//!
//! # Drawing your own numbers: [`StreamRng`]
//!
//! [`Stream::rng`] gives a [`rand::RngCore`] keyed by `(seed, position, lane)`, so a caller's
//! own draws (a custom proposer, a sampler of its own, noise for tests) come from the same
//! reproducible stream with any `rand` or `rand_distr` distribution. It walks the fourth counter
//! word with its top bit set, `(position low, position high, lane, 2^31 | block)`, while every
//! draw of the crate uses a fourth word of 0: the two sets of counters are disjoint, so a
//! [`StreamRng`] never repeats a number the verifier or a proposer uses, whatever lane it is
//! given (all `2^32` lanes are free to the caller).
//!
//! ```
//! use rand::Rng;
//! use rand_distr::{Distribution, Normal};
//! use speculative::rng::Stream;
//!
//! let stream = Stream::new(42);
//! let normal = Normal::new(0.0f64, 1.0).unwrap();
//! // Position 7, the caller's lane 0: the same numbers on every run and every machine.
//! let a: Vec<f64> = normal.sample_iter(stream.rng(7, 0)).take(3).collect();
//! let b: Vec<f64> = normal.sample_iter(stream.rng(7, 0)).take(3).collect();
//! assert_eq!(a, b);
//! let coin: bool = stream.rng(8, 0).random_bool(0.5);
//! # let _ = coin;
//! ```

/// Lanes: the purpose of a draw at a position. Different lanes give independent uniforms.
pub mod lane {
    /// The uniform `u` of the acceptance test `u < p(x) / q(x)` of the draft at this position.
    pub const ACCEPT: u32 = 0;
    /// The uniform that samples the emitted token at this position (residual, bonus, or plain).
    pub const SAMPLE: u32 = 1;
    /// The uniform a sampling proposer (draft model, heads) uses to draw its draft at this position.
    pub const DRAFT: u32 = 2;
    /// First lane of the acceptance tests of later siblings: sibling `j >= 1` of a sampled
    /// group uses lane `SIBLING_BASE + j` ([`sibling_accept`]).
    pub const SIBLING_BASE: u32 = 0x100;

    /// The lane of the acceptance test of sibling `j` (0-based, in node order) of a sampled tree
    /// group (with or without replacement, see [`crate::verify`], section "Trees"): [`ACCEPT`]
    /// for the first sibling, so that a chain (one node per group) draws exactly the uniforms it
    /// always drew, and `SIBLING_BASE + j` for the later ones (distinct from every other lane
    /// of the crate for `j < 2^32 - 0x100`; larger `j` wraps).
    #[inline]
    pub const fn sibling_accept(j: usize) -> u32 {
        if j == 0 {
            ACCEPT
        } else {
            SIBLING_BASE.wrapping_add(j as u32)
        }
    }

    /// First lane of the draft draws of later siblings: sibling `j >= 1` of a sampled group is
    /// drawn with lane `SIBLING_DRAFT_BASE + j` ([`sibling_draft`]).
    pub const SIBLING_DRAFT_BASE: u32 = 0x1_0000;

    /// The lane with which a sampling proposer draws sibling `j` (0-based) of a tree group:
    /// [`DRAFT`] for the first, so that a chain draws what it always drew, and
    /// `SIBLING_DRAFT_BASE + j` for the later ones (independent draws from the same q, as
    /// [`crate::SiblingScheme::WithReplacement`] requires).
    #[inline]
    pub const fn sibling_draft(j: usize) -> u32 {
        if j == 0 {
            DRAFT
        } else {
            SIBLING_DRAFT_BASE.wrapping_add(j as u32)
        }
    }
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

    /// A [`rand::RngCore`] drawing from this stream at `(position, lane)`: the caller's own
    /// reproducible draws, for any `rand` / `rand_distr` distribution (see [`StreamRng`]).
    ///
    /// `lane` is the caller's: every `u32` is free, and no lane reaches the counters the crate
    /// draws from (the crate's [`lane`] constants name the crate's own purposes, not reserved
    /// values here). The same `(seed, position, lane)` always gives the same sequence. `O(1)`;
    /// nothing is computed until the first draw.
    pub fn rng(&self, position: u64, lane: u32) -> StreamRng {
        StreamRng {
            stream: *self,
            position,
            lane,
            block: 0,
            buf: [0; 4],
            used: 4,
        }
    }

    /// A uniform in `[0, 1)` with 24 bits of resolution (exactly representable in `f32`, so a GPU
    /// kernel computes the same value): `(bits >> 8) * 2^-24` of the first output word.
    #[inline]
    pub fn uniform(&self, position: u64, lane: u32) -> f32 {
        (self.bits(position, lane)[0] >> 8) as f32 * (1.0 / 16_777_216.0)
    }
}

/// Top bit of the fourth counter word: set for [`StreamRng`] blocks, clear for the crate's draws.
const USER_BLOCK: u32 = 1 << 31;

/// A [`rand::RngCore`] over one `(seed, position, lane)` of a [`Stream`], made by
/// [`Stream::rng`].
///
/// Block `b` (`b = 0, 1, 2, ...`) is Philox4x32-10 of the counter
/// `(position low, position high, lane, 2^31 | b)` under the stream's key; its four 32-bit
/// words are handed out in order. The crate's own draws use the counters with a fourth word of
/// 0, so these never coincide with them. [`RngCore::next_u64`] is two consecutive words, the
/// first as the low half; [`RngCore::fill_bytes`] writes consecutive words in little-endian
/// order, a partial last word consuming a whole word. The period is `2^31` blocks (32 GiB) per
/// `(seed, position, lane)`; after that the sequence repeats.
///
/// Not cryptographically secure (Philox is a statistical generator): it does not implement
/// `CryptoRng`.
///
/// [`RngCore`]: rand::RngCore
/// [`RngCore::next_u64`]: rand::RngCore::next_u64
/// [`RngCore::fill_bytes`]: rand::RngCore::fill_bytes
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRng {
    stream: Stream,
    position: u64,
    lane: u32,
    /// Index of the next block to compute (the low 31 bits of the fourth counter word).
    block: u32,
    buf: [u32; 4],
    /// Words of `buf` already handed out (4 = empty).
    used: usize,
}

impl StreamRng {
    /// The position this generator is keyed by.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// The caller's lane this generator is keyed by.
    pub fn lane(&self) -> u32 {
        self.lane
    }

    fn refill(&mut self) {
        let p = self.position;
        self.buf = philox4x32_10(
            [
                p as u32,
                (p >> 32) as u32,
                self.lane,
                USER_BLOCK | self.block,
            ],
            self.stream.key,
        );
        self.block = (self.block + 1) & !USER_BLOCK;
        self.used = 0;
    }
}

impl rand::RngCore for StreamRng {
    #[inline]
    fn next_u32(&mut self) -> u32 {
        if self.used == 4 {
            self.refill();
        }
        let w = self.buf[self.used];
        self.used += 1;
        w
    }

    #[inline]
    fn next_u64(&mut self) -> u64 {
        let lo = u64::from(self.next_u32());
        let hi = u64::from(self.next_u32());
        (hi << 32) | lo
    }

    fn fill_bytes(&mut self, dst: &mut [u8]) {
        for chunk in dst.chunks_mut(4) {
            let w = self.next_u32().to_le_bytes();
            chunk.copy_from_slice(&w[..chunk.len()]);
        }
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
    fn stream_rng_walks_the_user_counters() {
        use rand::RngCore;
        let s = Stream::new(0x0123_4567_89ab_cdef);
        let mut r = s.rng(5, 9);
        let words: Vec<u32> = (0..12).map(|_| r.next_u32()).collect();
        for b in 0..3u32 {
            let block = philox4x32_10([5, 0, 9, USER_BLOCK | b], s.key);
            assert_eq!(&words[4 * b as usize..4 * b as usize + 4], &block);
        }
        // next_u64: two words, low first; fill_bytes: little-endian words, partial last word.
        let mut r = s.rng(5, 9);
        assert_eq!(
            r.next_u64(),
            u64::from(words[0]) | (u64::from(words[1]) << 32)
        );
        let mut bytes = [0u8; 7];
        r.fill_bytes(&mut bytes);
        assert_eq!(&bytes[..4], &words[2].to_le_bytes());
        assert_eq!(&bytes[4..], &words[3].to_le_bytes()[..3]);
        assert_eq!(r.next_u32(), words[4]);
        // Never the crate's own draws: those have a fourth counter word of 0.
        for lane in [lane::ACCEPT, lane::SAMPLE, lane::DRAFT] {
            let first: Vec<u32> = {
                let mut r = s.rng(5, lane);
                (0..4).map(|_| r.next_u32()).collect()
            };
            assert_ne!(first, s.bits(5, lane));
        }
        // The block counter wraps inside the user half of the counter space.
        let mut r = s.rng(1, 2);
        r.block = !USER_BLOCK;
        r.refill();
        assert_eq!(r.block, 0);
        assert_eq!(r.buf, philox4x32_10([1, 0, 2, u32::MAX], s.key));
    }

    #[test]
    fn stream_rng_drives_rand_distr_reproducibly() {
        use rand::Rng;
        use rand_distr::{Distribution, Exp, Normal};
        let s = Stream::new(2024);
        let normal = Normal::new(3.0f64, 2.0).unwrap();
        let exp = Exp::new(0.5f64).unwrap();
        let n = 20_000;
        let xs: Vec<f64> = normal.sample_iter(s.rng(11, 0)).take(n).collect();
        let again: Vec<f64> = normal.sample_iter(s.rng(11, 0)).take(n).collect();
        assert_eq!(xs, again, "same (seed, position, lane), same draws");
        let other: Vec<f64> = normal.sample_iter(s.rng(11, 1)).take(n).collect();
        assert_ne!(xs, other, "another lane, other draws");
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        // Standard errors: 2 / sqrt(n) = 0.014 for the mean, about 0.04 for the variance 4.
        assert!((mean - 3.0).abs() < 0.06, "mean {mean}");
        assert!((var - 4.0).abs() < 0.2, "variance {var}");
        let ys: Vec<f64> = exp.sample_iter(s.rng(12, 0)).take(n).collect();
        let ymean = ys.iter().sum::<f64>() / n as f64;
        assert!((ymean - 2.0).abs() < 0.06, "exponential mean {ymean}");
        assert!(ys.iter().all(|&y| y >= 0.0));
        let mut r = s.rng(13, 7);
        let k = r.random_range(0..10u32);
        assert_eq!(k, s.rng(13, 7).random_range(0..10u32));
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
