//! Repetition (CTRL, Keskar et al. 2019) and frequency / presence (OpenAI API) penalties.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::sampling::SamplingConfig;

/// Occurrence counts of earlier tokens, the input of the penalties.
///
/// At verify row `i` of a block the counts cover the context plus drafts `0..i`, so a target row
/// and the draft row at the same prefix are penalised identically.
#[derive(Debug, Clone, Default)]
pub struct TokenCounts {
    counts: HashMap<u32, u32>,
}

impl TokenCounts {
    /// Counts of `tokens`.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] when a token is `>= vocab_size`.
    pub fn from_tokens(tokens: &[u32], vocab_size: usize) -> Result<Self> {
        let mut c = TokenCounts::default();
        for &t in tokens {
            c.add(t, vocab_size)?;
        }
        Ok(c)
    }

    /// Adds one occurrence of `token`.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] when `token >= vocab_size`.
    pub fn add(&mut self, token: u32, vocab_size: usize) -> Result<()> {
        if token as usize >= vocab_size {
            return Err(Error::TokenOutOfVocab {
                what: "context token",
                token,
                vocab_size,
            });
        }
        *self.counts.entry(token).or_insert(0) += 1;
        Ok(())
    }

    /// Number of occurrences of `token`.
    pub fn get(&self, token: u32) -> u32 {
        self.counts.get(&token).copied().unwrap_or(0)
    }

    /// `(token, count)` pairs in unspecified order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.counts.iter().map(|(&t, &c)| (t, c))
    }

    /// Number of distinct tokens.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// `true` when no token was counted.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

/// Applies the penalties of `cfg` to `logits` (`[vocab]`, in place), for every counted token.
///
/// Repetition penalty `r` (CTRL): a positive logit is divided by `r`, a negative one multiplied by
/// `r`, once per distinct earlier token. Then frequency `f` and presence `pr` (OpenAI):
/// `logit -= count * f + (count > 0) * pr`. Tokens outside `logits` are ignored (the caller
/// checked them against the vocabulary).
pub fn apply_penalties(cfg: &SamplingConfig, counts: &TokenCounts, logits: &mut [f32]) {
    let r = cfg.repetition_penalty;
    let f = cfg.frequency_penalty;
    let pr = cfg.presence_penalty;
    for (t, c) in counts.iter() {
        let Some(l) = logits.get_mut(t as usize) else {
            continue;
        };
        if r != 1.0 {
            *l = if *l > 0.0 { *l / r } else { *l * r };
        }
        if c > 0 {
            *l -= c as f32 * f + pr;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctrl_and_openai_definitions() {
        let cfg = SamplingConfig::builder()
            .repetition_penalty(2.0)
            .frequency_penalty(0.5)
            .presence_penalty(0.25)
            .build()
            .unwrap();
        let counts = TokenCounts::from_tokens(&[0, 1, 1, 3], 4).unwrap();
        let mut l = [4.0, -2.0, 1.0, f32::NEG_INFINITY];
        apply_penalties(&cfg, &counts, &mut l);
        assert_eq!(l[0], 4.0 / 2.0 - 0.5 - 0.25);
        assert_eq!(l[1], -2.0 * 2.0 - 2.0 * 0.5 - 0.25);
        assert_eq!(l[2], 1.0);
        assert_eq!(l[3], f32::NEG_INFINITY);
        assert!(TokenCounts::from_tokens(&[4], 4).is_err());
    }
}
