//! [`SamplingConfig`]: the validated set of logits processors for one request.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use super::PenaltyScope;
use crate::error::{Error, Result};

/// A caller-supplied, per-position token mask (grammars, JSON schemas, structured output).
///
/// At each position the processor calls [`TokenMask::apply`] with the whole token prefix that
/// the position follows (context plus the earlier drafts of the same block) and the row's logits
/// (`[vocab]`, after penalties and logit bias). The mask sets the logits of forbidden tokens to
/// `f32::NEG_INFINITY` and must not change the others. Target and draft rows at the same prefix
/// get the same call, so the mask shapes both sides of the acceptance ratio. `logits.len()` is
/// the width of the row being processed: a draft model with a shorter (padded) vocabulary
/// passes shorter rows, so a mask must index within `logits.len()`.
pub trait TokenMask: Send + Sync {
    /// Sets forbidden tokens' logits to `-inf` for the position that follows `prefix`.
    fn apply(&self, prefix: &[u32], logits: &mut [f32]);
}

impl<F: Fn(&[u32], &mut [f32]) + Send + Sync> TokenMask for F {
    fn apply(&self, prefix: &[u32], logits: &mut [f32]) {
        self(prefix, logits)
    }
}

/// A validated sampling configuration, shared by target rows and draft rows.
///
/// Processing order (identical for target and draft rows at the same prefix): penalties
/// (repetition over the prompt and generated tokens; frequency and presence over the generated
/// tokens, the earlier drafts of the block included, unless [`PenaltyScope::WholeContext`]) ->
/// logit bias -> allowed / banned sets and the caller's [`TokenMask`] -> temperature -> top-k ->
/// softmax -> top-p -> min-p -> renormalise.
///
/// Build it with [`SamplingConfig::builder`]. [`SamplingConfig::default`] is
/// [`SamplingConfig::greedy`]: temperature 0 and every other processor off.
///
/// | field | off value | meaning |
/// |---|---|---|
/// | temperature | - | `0` = greedy (argmax, ties to the lowest id) |
/// | top_k | `0` | keep the k highest-probability tokens |
/// | top_p | `1.0` | keep the smallest highest-probability set with mass `>= top_p` |
/// | min_p | `0.0` | keep tokens with `prob >= min_p * max prob` |
/// | repetition_penalty | `1.0` | CTRL (Keskar et al. 2019): positive logits `/ r`, negative `* r`, once per distinct earlier token of prompt and output |
/// | frequency_penalty, presence_penalty | `0.0` | OpenAI: `logit -= count * f + (count > 0) * pr`, `count` over generated tokens ([`PenaltyScope`]) |
/// | penalty_scope | - | [`PenaltyScope::Generated`] (vLLM / OpenAI) or [`PenaltyScope::WholeContext`] |
///
/// `SamplingConfig` is `Send + Sync` (a caller's [`TokenMask`] must be too) and cheap to clone
/// (the mask is shared through an `Arc`).
#[derive(Clone)]
pub struct SamplingConfig {
    pub(crate) temperature: f32,
    pub(crate) top_k: usize,
    pub(crate) top_p: f32,
    pub(crate) min_p: f32,
    pub(crate) repetition_penalty: f32,
    pub(crate) frequency_penalty: f32,
    pub(crate) presence_penalty: f32,
    pub(crate) penalty_scope: PenaltyScope,
    pub(crate) logit_bias: Vec<(u32, f32)>,
    pub(crate) allowed: Option<Vec<u32>>,
    pub(crate) banned: Vec<u32>,
    pub(crate) mask: Option<Arc<dyn TokenMask>>,
    pub(crate) logprobs: Option<usize>,
}

impl fmt::Debug for SamplingConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SamplingConfig")
            .field("temperature", &self.temperature)
            .field("top_k", &self.top_k)
            .field("top_p", &self.top_p)
            .field("min_p", &self.min_p)
            .field("repetition_penalty", &self.repetition_penalty)
            .field("frequency_penalty", &self.frequency_penalty)
            .field("presence_penalty", &self.presence_penalty)
            .field("penalty_scope", &self.penalty_scope)
            .field("logit_bias", &self.logit_bias)
            .field("allowed", &self.allowed.as_ref().map(|a| a.len()))
            .field("banned", &self.banned.len())
            .field("mask", &self.mask.is_some())
            .field("logprobs", &self.logprobs)
            .finish()
    }
}

impl PartialEq for SamplingConfig {
    /// Field by field; two masks are equal when they are the same `Arc` ([`Arc::ptr_eq`]).
    fn eq(&self, other: &Self) -> bool {
        let masks = match (&self.mask, &other.mask) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        masks
            && self.temperature == other.temperature
            && self.top_k == other.top_k
            && self.top_p == other.top_p
            && self.min_p == other.min_p
            && self.repetition_penalty == other.repetition_penalty
            && self.frequency_penalty == other.frequency_penalty
            && self.presence_penalty == other.presence_penalty
            && self.penalty_scope == other.penalty_scope
            && self.logit_bias == other.logit_bias
            && self.allowed == other.allowed
            && self.banned == other.banned
            && self.logprobs == other.logprobs
    }
}

impl Default for SamplingConfig {
    /// [`SamplingConfig::greedy`]: a valid configuration (temperature 0, top-p 1, repetition
    /// penalty 1, every other processor off).
    fn default() -> Self {
        SamplingConfig::greedy()
    }
}

impl SamplingConfig {
    /// Greedy decoding (temperature 0) with no other processor.
    pub fn greedy() -> Self {
        SamplingConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_scope: PenaltyScope::Generated,
            logit_bias: Vec::new(),
            allowed: None,
            banned: Vec::new(),
            mask: None,
            logprobs: None,
        }
    }

    /// Pure sampling from the softmax at `temperature`, no filtering.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `temperature` is negative or not finite.
    pub fn sampling(temperature: f32) -> Result<Self> {
        Self::builder().temperature(temperature).build()
    }

    /// Starts a builder from [`SamplingConfig::greedy`].
    pub fn builder() -> SamplingConfigBuilder {
        SamplingConfigBuilder {
            cfg: SamplingConfig::greedy(),
        }
    }

    /// Turns this configuration back into a builder, to change a field.
    pub fn to_builder(&self) -> SamplingConfigBuilder {
        SamplingConfigBuilder { cfg: self.clone() }
    }

    /// `true` when temperature is 0: the processed distribution is a point mass on the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Temperature (dimensionless; 0 = greedy).
    pub fn temperature(&self) -> f32 {
        self.temperature
    }
    /// Top-k (0 = off).
    pub fn top_k(&self) -> usize {
        self.top_k
    }
    /// Top-p nucleus mass in `(0, 1]` (1 = off).
    pub fn top_p(&self) -> f32 {
        self.top_p
    }
    /// Min-p in `[0, 1]` (0 = off).
    pub fn min_p(&self) -> f32 {
        self.min_p
    }
    /// Repetition penalty (1 = off).
    pub fn repetition_penalty(&self) -> f32 {
        self.repetition_penalty
    }
    /// Frequency penalty (0 = off), in logits per occurrence.
    pub fn frequency_penalty(&self) -> f32 {
        self.frequency_penalty
    }
    /// Presence penalty (0 = off), in logits.
    pub fn presence_penalty(&self) -> f32 {
        self.presence_penalty
    }
    /// Which tokens the frequency and presence penalties count.
    pub fn penalty_scope(&self) -> PenaltyScope {
        self.penalty_scope
    }
    /// Logit bias entries `(token, added logit)`, sorted by token, one per token.
    pub fn logit_bias(&self) -> &[(u32, f32)] {
        &self.logit_bias
    }
    /// Allowed-token set (sorted), if any: every other token is banned.
    pub fn allowed_tokens(&self) -> Option<&[u32]> {
        self.allowed.as_deref()
    }
    /// Banned tokens (sorted).
    pub fn banned_tokens(&self) -> &[u32] {
        &self.banned
    }
    /// The caller's per-position mask, if any.
    pub fn mask(&self) -> Option<&Arc<dyn TokenMask>> {
        self.mask.as_ref()
    }
    /// Number of top log-probabilities to report per emitted token; `None` = no log-probabilities.
    pub fn logprobs(&self) -> Option<usize> {
        self.logprobs
    }

    /// `true` when any penalty is active, so processing needs the token history.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// Checks that every token this configuration names is inside a vocabulary of `vocab_size`.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] naming the first offending token.
    pub fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        let check = |what: &'static str, t: u32| {
            if (t as usize) < vocab_size {
                Ok(())
            } else {
                Err(Error::TokenOutOfVocab {
                    what,
                    token: t,
                    vocab_size,
                })
            }
        };
        for &(t, _) in &self.logit_bias {
            check("logit_bias", t)?;
        }
        for &t in self.allowed.iter().flatten() {
            check("allowed token", t)?;
        }
        for &t in &self.banned {
            check("banned token", t)?;
        }
        Ok(())
    }
}

/// Builder for [`SamplingConfig`]; [`SamplingConfigBuilder::build`] validates every field once.
#[derive(Clone, Debug)]
pub struct SamplingConfigBuilder {
    cfg: SamplingConfig,
}

impl SamplingConfigBuilder {
    /// Temperature `>= 0`; 0 means greedy. Tiny values (1e-6) are fine and never give NaN.
    pub fn temperature(mut self, t: f32) -> Self {
        self.cfg.temperature = t;
        self
    }
    /// Keep the `k` highest-probability tokens; 0 turns it off.
    pub fn top_k(mut self, k: usize) -> Self {
        self.cfg.top_k = k;
        self
    }
    /// Nucleus mass in `(0, 1]`; 1 turns it off.
    pub fn top_p(mut self, p: f32) -> Self {
        self.cfg.top_p = p;
        self
    }
    /// Min-p in `[0, 1]`; 0 turns it off.
    pub fn min_p(mut self, p: f32) -> Self {
        self.cfg.min_p = p;
        self
    }
    /// CTRL repetition penalty `> 0`; 1 turns it off.
    pub fn repetition_penalty(mut self, r: f32) -> Self {
        self.cfg.repetition_penalty = r;
        self
    }
    /// OpenAI frequency penalty (finite, usually in `[-2, 2]`); 0 turns it off.
    pub fn frequency_penalty(mut self, f: f32) -> Self {
        self.cfg.frequency_penalty = f;
        self
    }
    /// OpenAI presence penalty (finite, usually in `[-2, 2]`); 0 turns it off.
    pub fn presence_penalty(mut self, p: f32) -> Self {
        self.cfg.presence_penalty = p;
        self
    }
    /// Which earlier tokens the frequency and presence penalties count (default
    /// [`PenaltyScope::Generated`], the vLLM / OpenAI convention).
    pub fn penalty_scope(mut self, scope: PenaltyScope) -> Self {
        self.cfg.penalty_scope = scope;
        self
    }
    /// Adds `bias` to the logit of `token`. Later entries for the same token replace earlier.
    /// `f32::NEG_INFINITY` bans the token.
    pub fn logit_bias(mut self, token: u32, bias: f32) -> Self {
        self.cfg.logit_bias.push((token, bias));
        self
    }
    /// Only these tokens may be emitted.
    pub fn allowed_tokens(mut self, tokens: impl IntoIterator<Item = u32>) -> Self {
        self.cfg.allowed = Some(tokens.into_iter().collect());
        self
    }
    /// These tokens are never emitted.
    pub fn banned_tokens(mut self, tokens: impl IntoIterator<Item = u32>) -> Self {
        self.cfg.banned.extend(tokens);
        self
    }
    /// A per-position mask supplied by the caller (see [`TokenMask`]).
    pub fn mask(mut self, mask: Arc<dyn TokenMask>) -> Self {
        self.cfg.mask = Some(mask);
        self
    }
    /// Report the emitted tokens' log-probabilities and the `n` most likely alternatives
    /// (`n` may be 0 for the emitted token's log-probability alone).
    pub fn logprobs(mut self, n: usize) -> Self {
        self.cfg.logprobs = Some(n);
        self
    }

    /// Validates and returns the configuration.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when temperature is negative or not finite, `top_p` is not in
    /// `(0, 1]`, `min_p` is not in `[0, 1]`, the repetition penalty is not finite and `> 0`, a
    /// frequency / presence penalty is not finite, a logit bias is NaN or `+inf`, or the allowed
    /// set is empty.
    pub fn build(self) -> Result<SamplingConfig> {
        let mut c = self.cfg;
        if !(c.temperature.is_finite() && c.temperature >= 0.0) {
            return Err(Error::config(
                "temperature",
                c.temperature,
                "must be finite and >= 0",
            ));
        }
        if !(c.top_p > 0.0 && c.top_p <= 1.0) {
            return Err(Error::config("top_p", c.top_p, "must be in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&c.min_p) {
            return Err(Error::config("min_p", c.min_p, "must be in [0, 1]"));
        }
        if !(c.repetition_penalty.is_finite() && c.repetition_penalty > 0.0) {
            return Err(Error::config(
                "repetition_penalty",
                c.repetition_penalty,
                "must be finite and > 0",
            ));
        }
        if !c.frequency_penalty.is_finite() {
            return Err(Error::config(
                "frequency_penalty",
                c.frequency_penalty,
                "must be finite",
            ));
        }
        if !c.presence_penalty.is_finite() {
            return Err(Error::config(
                "presence_penalty",
                c.presence_penalty,
                "must be finite",
            ));
        }
        let mut bias: HashMap<u32, f32> = HashMap::new();
        for &(t, b) in &c.logit_bias {
            if b.is_nan() || b == f32::INFINITY {
                return Err(Error::config("logit_bias", b, "must not be NaN or +inf"));
            }
            bias.insert(t, b);
        }
        c.logit_bias = bias.into_iter().collect();
        c.logit_bias.sort_unstable_by_key(|&(t, _)| t);
        if let Some(a) = c.allowed.as_mut() {
            a.sort_unstable();
            a.dedup();
            if a.is_empty() {
                return Err(Error::config("allowed_tokens", "[]", "must not be empty"));
            }
        }
        c.banned.sort_unstable();
        c.banned.dedup();
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_values() {
        assert!(SamplingConfig::builder().temperature(-1.0).build().is_err());
        assert!(
            SamplingConfig::builder()
                .temperature(f32::NAN)
                .build()
                .is_err()
        );
        assert!(SamplingConfig::builder().top_p(0.0).build().is_err());
        assert!(SamplingConfig::builder().top_p(1.5).build().is_err());
        assert!(SamplingConfig::builder().min_p(-0.1).build().is_err());
        assert!(
            SamplingConfig::builder()
                .repetition_penalty(0.0)
                .build()
                .is_err()
        );
        assert!(
            SamplingConfig::builder()
                .frequency_penalty(f32::INFINITY)
                .build()
                .is_err()
        );
        assert!(
            SamplingConfig::builder()
                .logit_bias(3, f32::NAN)
                .build()
                .is_err()
        );
        assert!(
            SamplingConfig::builder()
                .allowed_tokens([])
                .build()
                .is_err()
        );
    }

    #[test]
    fn default_is_valid_greedy() {
        let d = SamplingConfig::default();
        assert!(d.is_greedy());
        let rebuilt = d.to_builder().build().unwrap();
        assert_eq!(
            format!("{rebuilt:?}"),
            format!("{:?}", SamplingConfig::greedy())
        );
    }

    #[test]
    fn normalises_sets() {
        let c = SamplingConfig::builder()
            .logit_bias(5, 1.0)
            .logit_bias(2, 3.0)
            .logit_bias(5, -1.0)
            .banned_tokens([4, 1, 4])
            .allowed_tokens([9, 3, 3])
            .build()
            .unwrap();
        assert_eq!(c.logit_bias(), &[(2, 3.0), (5, -1.0)]);
        assert_eq!(c.banned_tokens(), &[1, 4]);
        assert_eq!(c.allowed_tokens(), Some(&[3, 9][..]));
        assert!(c.check_vocab(10).is_ok());
        assert!(matches!(
            c.check_vocab(9),
            Err(Error::TokenOutOfVocab { token: 9, .. })
        ));
    }
}
