//! Where the seeds of requests that set none come from.

use rand::TryRngCore;
use rand::rngs::OsRng;

/// The source of the seed of a request whose [`GenerationParams::seed`] is `None`
/// ([`crate::decode::Generator::with_seed_source`],
/// [`crate::decode::BatchGenerator::with_seed_source`]).
///
/// Each such request draws a fresh seed, so two sampled requests without a seed are
/// independent (case C20); the seed used is reported in [`Generation::seed`], so any run can be
/// reproduced by passing it back. The default draws from the operating system's entropy
/// ([`SeedSource::os`]); [`SeedSource::seeded`] gives a fixed sequence of distinct seeds (tests,
/// reproducible benchmarks). Requests with a seed never touch the source.
///
/// [`GenerationParams::seed`]: crate::decode::GenerationParams::seed
/// [`Generation::seed`]: crate::decode::Generation::seed
///
/// # Example
/// ```
/// use speculative::decode::SeedSource;
///
/// let mut a = SeedSource::seeded(7);
/// let mut b = SeedSource::seeded(7);
/// let first = a.next_seed();
/// assert_eq!(first, b.next_seed());
/// assert_ne!(first, a.next_seed());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeedSource {
    /// `None`: the OS; `Some(state)`: the SplitMix64 state of a seeded source.
    state: Option<u64>,
}

impl SeedSource {
    /// Seeds from the operating system's entropy (the default), through `rand`'s `OsRng`.
    pub fn os() -> Self {
        SeedSource { state: None }
    }

    /// A fixed sequence of seeds from `seed` (SplitMix64, Steele, Lea & Flood 2014): the same
    /// `seed` gives the same sequence, consecutive seeds differ.
    pub fn seeded(seed: u64) -> Self {
        SeedSource { state: Some(seed) }
    }

    /// The next seed. An OS source whose entropy read fails (very rare) falls back to a seed
    /// from the standard library's randomly keyed hasher, itself seeded by the OS.
    pub fn next_seed(&mut self) -> u64 {
        match &mut self.state {
            Some(state) => {
                *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = *state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^ (z >> 31)
            }
            None => OsRng.try_next_u64().unwrap_or_else(|_| hasher_seed()),
        }
    }
}

/// A seed from [`std::collections::hash_map::RandomState`] (randomly keyed per process by the
/// OS, and per instance).
fn hasher_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_seeds_differ_and_seeded_sources_repeat() {
        let mut os = SeedSource::os();
        let (a, b) = (os.next_seed(), os.next_seed());
        // 2^-64 chance of a false failure.
        assert_ne!(a, b);
        let mut s = SeedSource::seeded(3);
        let seq: Vec<u64> = (0..4).map(|_| s.next_seed()).collect();
        let mut t = SeedSource::seeded(3);
        assert_eq!(seq, (0..4).map(|_| t.next_seed()).collect::<Vec<_>>());
        assert!(seq.windows(2).all(|w| w[0] != w[1]));
        assert_ne!(SeedSource::seeded(4).next_seed(), seq[0]);
    }
}
