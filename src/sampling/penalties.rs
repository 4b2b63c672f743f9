//! Repetition (CTRL, Keskar et al. 2019) and frequency / presence (OpenAI API) penalties.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::sampling::SamplingConfig;

/// Which earlier tokens the frequency and presence penalties count ([`SamplingConfig`]).
///
/// The repetition penalty always counts the prompt and the generated tokens (CTRL, and vLLM /
/// HF transformers); the scope only changes the frequency and presence penalties.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PenaltyScope {
    /// The default: frequency and presence penalties count generated tokens only, the tokens
    /// after the prompt including the earlier drafts of the block (the OpenAI API and vLLM
    /// convention; case C12).
    #[default]
    Generated,
    /// Frequency and presence penalties count every earlier token, prompt included.
    WholeContext,
}

/// Occurrence counts of earlier tokens, the input of the penalties, split into prompt and
/// generated occurrences.
///
/// At verify row `i` of a block the counts cover the context plus drafts `0..i` (drafts are
/// generated tokens), so a target row and the draft row at the same prefix are penalised
/// identically.
///
/// The default counts nothing (no earlier token).
#[derive(Debug, Clone, Default)]
pub struct TokenCounts {
    /// token -> (occurrences in the prompt, occurrences generated).
    counts: HashMap<u32, (u32, u32)>,
}

impl TokenCounts {
    /// Counts of `tokens`, all of them generated (no prompt).
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] when a token is `>= vocab_size`.
    pub fn from_tokens(tokens: &[u32], vocab_size: usize) -> Result<Self> {
        Self::from_context(tokens, 0, vocab_size)
    }

    /// Counts of `context`, whose first `prompt_len` tokens are the prompt and the rest generated
    /// (`prompt_len` larger than the context counts everything as prompt).
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] when a token is `>= vocab_size`.
    pub fn from_context(context: &[u32], prompt_len: usize, vocab_size: usize) -> Result<Self> {
        let mut c = TokenCounts::default();
        let split = prompt_len.min(context.len());
        for &t in &context[..split] {
            check(t, vocab_size)?;
            c.counts.entry(t).or_insert((0, 0)).0 += 1;
        }
        for &t in &context[split..] {
            c.add(t, vocab_size)?;
        }
        Ok(c)
    }

    /// Adds one generated occurrence of `token`.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] when `token >= vocab_size`.
    pub fn add(&mut self, token: u32, vocab_size: usize) -> Result<()> {
        check(token, vocab_size)?;
        self.counts.entry(token).or_insert((0, 0)).1 += 1;
        Ok(())
    }

    /// Removes one generated occurrence of `token` (the inverse of [`TokenCounts::add`]), for a
    /// history that steps back up a draft tree. A token without a generated occurrence is left
    /// as it is; a token with no occurrence left is no longer counted ([`TokenCounts::len`]).
    pub fn remove(&mut self, token: u32) {
        if let Some(e) = self.counts.get_mut(&token)
            && e.1 > 0
        {
            e.1 -= 1;
            if *e == (0, 0) {
                self.counts.remove(&token);
            }
        }
    }

    /// Number of occurrences of `token`, prompt and generated.
    pub fn get(&self, token: u32) -> u32 {
        self.counts.get(&token).map_or(0, |&(p, g)| p + g)
    }

    /// Number of generated occurrences of `token`.
    pub fn generated(&self, token: u32) -> u32 {
        self.counts.get(&token).map_or(0, |&(_, g)| g)
    }

    /// `(token, prompt count, generated count)` triples in unspecified order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32, u32)> + '_ {
        self.counts.iter().map(|(&t, &(p, g))| (t, p, g))
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

fn check(token: u32, vocab_size: usize) -> Result<()> {
    if token as usize >= vocab_size {
        return Err(Error::TokenOutOfVocab {
            what: "context token",
            token,
            vocab_size,
        });
    }
    Ok(())
}

/// Applies the penalties of `cfg` to `logits` (`[vocab]`, in place), for every counted token.
///
/// Repetition penalty `r` (CTRL, Keskar et al. 2019, section 4.1): a positive logit is divided by
/// `r`, a negative one multiplied by `r`, once per distinct earlier token of prompt and output.
/// Then frequency `f` and presence `pr` (OpenAI API): `logit -= count * f + (count > 0) * pr`,
/// where `count` counts generated tokens only, or every earlier token with
/// [`PenaltyScope::WholeContext`]. Tokens outside `logits` are ignored (the caller checked them
/// against the vocabulary). A `-inf` logit (a banned token) stays `-inf`, and a finite logit
/// stays finite: results beyond the f32 range saturate at `±f32::MAX`, so extreme penalties
/// never turn finite logits into `inf` or NaN.
pub fn apply_penalties(cfg: &SamplingConfig, counts: &TokenCounts, logits: &mut [f32]) {
    let r = cfg.repetition_penalty;
    let f = cfg.frequency_penalty;
    let pr = cfg.presence_penalty;
    let whole = cfg.penalty_scope == PenaltyScope::WholeContext;
    for (t, p, g) in counts.iter() {
        let Some(l) = logits.get_mut(t as usize).filter(|l| l.is_finite()) else {
            continue;
        };
        let c = if whole { p + g } else { g };
        let x = penalise(*l, p + g > 0, c, r, f, pr);
        // Only a result outside the f32 range is recomputed (in f64) and saturated, so every
        // ordinary logit gets exactly the f32 arithmetic the GPU kernels use too.
        *l = if x.is_finite() {
            x
        } else {
            let mut y = *l as f64;
            if r != 1.0 && p + g > 0 {
                y = if y > 0.0 { y / r as f64 } else { y * r as f64 };
            }
            if c > 0 {
                y -= c as f64 * f as f64 + pr as f64;
            }
            saturate(y)
        };
    }
}

/// The penalties of one finite logit in f32: repetition (`present`, factor `r`), then frequency
/// `f` per counted occurrence (`c`) and presence `pr`.
#[inline]
fn penalise(l: f32, present: bool, c: u32, r: f32, f: f32, pr: f32) -> f32 {
    let mut l = l;
    if r != 1.0 && present {
        l = if l > 0.0 { l / r } else { l * r };
    }
    if c > 0 {
        l -= c as f32 * f + pr;
    }
    l
}

/// `x` rounded to f32 and clamped to the finite range `[-f32::MAX, f32::MAX]`.
#[inline]
pub(crate) fn saturate(x: f64) -> f32 {
    x.clamp(-(f32::MAX as f64), f32::MAX as f64) as f32
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
        // The prompt's tokens feed the repetition penalty only (default scope).
        let prompt = TokenCounts::from_context(&[0, 1, 1, 3], 4, 4).unwrap();
        let mut lp = [4.0, -2.0, 1.0, 0.5];
        apply_penalties(&cfg, &prompt, &mut lp);
        assert_eq!(lp, [2.0, -4.0, 1.0, 0.25]);
        let whole = cfg
            .to_builder()
            .penalty_scope(PenaltyScope::WholeContext)
            .build()
            .unwrap();
        let mut lw = [4.0, -2.0, 1.0, f32::NEG_INFINITY];
        apply_penalties(&whole, &prompt, &mut lw);
        assert_eq!(lw, l);
        assert_eq!(l[0], 4.0 / 2.0 - 0.5 - 0.25);
        assert_eq!(l[1], -2.0 * 2.0 - 2.0 * 0.5 - 0.25);
        assert_eq!(l[2], 1.0);
        assert_eq!(l[3], f32::NEG_INFINITY);
        assert!(TokenCounts::from_tokens(&[4], 4).is_err());
    }
}
