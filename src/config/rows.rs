//! The types that are some rows of the flat object, [`SamplingConfig`], [`StopConditions`] and
//! [`DraftLength`]: one conversion each way between each and [`RequestConfig`], and their serde
//! implementations through it, which refuse the other rows.

use serde::de::{self, Deserializer};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::RequestConfig;
#[cfg(doc)]
use crate::decode::AdaptiveConfig;
use crate::decode::{DraftLength, StopConditions};
use crate::error::{Error, Result};
use crate::sampling::{PenaltyScope, SamplingConfig};

/// The fields [`SamplingConfig`] accepts.
pub(super) const SAMPLING_FIELDS: &[&str] = &[
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "penalty_scope",
    "logit_bias",
    "allowed_token_ids",
    "banned_token_ids",
    "logprobs",
];

/// The fields [`StopConditions`] accepts.
pub(super) const STOP_FIELDS: &[&str] = &[
    "eos_token_id",
    "stop",
    "stop_token_ids",
    "stop_token_sequences",
    "include_stop_str_in_output",
];

/// The fields [`DraftLength`] accepts.
pub(super) const DRAFT_FIELDS: &[&str] = &["num_speculative_tokens", "adaptive_draft"];

impl RequestConfig {
    /// The first set field not in `allowed`, as serde's "unknown field" error.
    pub(super) fn only<E: de::Error>(&self, allowed: &'static [&'static str]) -> Result<(), E> {
        match self.set_fields().into_iter().find(|f| !allowed.contains(f)) {
            Some(f) => Err(E::unknown_field(f, allowed)),
            None => Ok(()),
        }
    }

    /// The sampling configuration of the sampling fields, through [`SamplingConfig::builder`]
    /// (the other fields are not read). Absent fields keep the builder's defaults (greedy,
    /// every processor off); `do_sample` and `temperature` combine as in the module docs.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field: `temperature`, `top_k` (below -1), `top_p`,
    /// `min_p`, `repetition_penalty`, `frequency_penalty`, `presence_penalty` (out of range or
    /// not finite, as [`crate::SamplingConfigBuilder::build`]), `logit_bias` (NaN or `+inf`),
    /// `allowed_token_ids` (empty).
    pub fn sampling_config(&self) -> Result<SamplingConfig> {
        let mut b = SamplingConfig::builder();
        let temperature = match (self.do_sample, self.temperature) {
            (Some(false), t) => {
                if let Some(t) = t {
                    SamplingConfig::sampling(t)?;
                }
                0.0
            }
            (Some(true), None) => 1.0,
            (_, Some(t)) => t,
            (None, None) => 0.0,
        };
        b = b.temperature(temperature);
        if let Some(k) = self.top_k {
            let k = match k {
                -1 => 0,
                k => usize::try_from(k)
                    .map_err(|_| Error::config("top_k", k, "must be >= 0 (0 or -1 = off)"))?,
            };
            b = b.top_k(k);
        }
        if let Some(p) = self.top_p {
            b = b.top_p(p);
        }
        if let Some(p) = self.min_p {
            b = b.min_p(p);
        }
        if let Some(r) = self.repetition_penalty {
            b = b.repetition_penalty(r);
        }
        if let Some(f) = self.frequency_penalty {
            b = b.frequency_penalty(f);
        }
        if let Some(p) = self.presence_penalty {
            b = b.presence_penalty(p);
        }
        if let Some(s) = self.penalty_scope {
            b = b.penalty_scope(s);
        }
        for (&t, &bias) in self.logit_bias.iter().flatten() {
            b = b.logit_bias(t, bias);
        }
        if let Some(a) = &self.allowed_token_ids {
            if a.is_empty() {
                return Err(Error::config(
                    "allowed_token_ids",
                    "[]",
                    "must not be empty",
                ));
            }
            b = b.allowed_tokens(a.iter().copied());
        }
        if let Some(ids) = &self.banned_token_ids {
            b = b.banned_tokens(ids.iter().copied());
        }
        if let Some(n) = self.logprobs {
            b = b.logprobs(n);
        }
        b.build()
    }

    /// The stop conditions of the stop fields (the other fields are not read): EOS ids from
    /// `eos_token_id`, stop sequences from `stop_token_ids` (one token each) then
    /// `stop_token_sequences`, stop strings from `stop`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `stop` for an empty stop string or
    /// `stop_token_sequences` for an empty sequence.
    pub fn stop_conditions(&self) -> Result<StopConditions> {
        let stop_strings = self.stop.clone().unwrap_or_default();
        if stop_strings.iter().any(String::is_empty) {
            return Err(Error::config(
                "stop",
                "\"\"",
                "stop strings must not be empty",
            ));
        }
        let sequences = self.stop_token_sequences.iter().flatten();
        if sequences.clone().any(Vec::is_empty) {
            return Err(Error::config(
                "stop_token_sequences",
                "[]",
                "stop sequences must not be empty",
            ));
        }
        Ok(StopConditions {
            eos: self.eos_token_id.clone().unwrap_or_default(),
            stop_sequences: self
                .stop_token_ids
                .iter()
                .flatten()
                .map(|&t| vec![t])
                .chain(sequences.cloned())
                .collect(),
            stop_strings,
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
        })
    }

    /// The draft length policy of the draft fields (the other fields are not read): absent =
    /// [`DraftLength::default`] (fixed 4), `num_speculative_tokens` 0 = [`DraftLength::Off`],
    /// `k > 0` = [`DraftLength::Fixed`]`(k)`, `adaptive_draft` = [`DraftLength::Adaptive`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `adaptive_draft` when both fields are set, or the field
    /// of [`AdaptiveConfig::validate`].
    pub fn draft_length(&self) -> Result<DraftLength> {
        match (self.num_speculative_tokens, &self.adaptive_draft) {
            (Some(k), Some(_)) => Err(Error::config(
                "adaptive_draft",
                format_args!("given with num_speculative_tokens = {k}"),
                "give either num_speculative_tokens or adaptive_draft",
            )),
            (Some(0), None) => Ok(DraftLength::Off),
            (Some(k), None) => Ok(DraftLength::Fixed(k)),
            (None, Some(a)) => {
                a.validate()?;
                Ok(DraftLength::Adaptive(a.clone()))
            }
            (None, None) => Ok(DraftLength::default()),
        }
    }

    /// The sampling fields of `cfg` (every scalar written; collections only when not empty;
    /// `penalty_scope` only when not the default). The mask is not represented.
    pub fn from_sampling(cfg: &SamplingConfig) -> Self {
        RequestConfig {
            temperature: Some(cfg.temperature()),
            top_k: Some(i64::try_from(cfg.top_k()).unwrap_or(i64::MAX)),
            top_p: Some(cfg.top_p()),
            min_p: Some(cfg.min_p()),
            repetition_penalty: Some(cfg.repetition_penalty()),
            frequency_penalty: Some(cfg.frequency_penalty()),
            presence_penalty: Some(cfg.presence_penalty()),
            penalty_scope: (cfg.penalty_scope() != PenaltyScope::default())
                .then_some(cfg.penalty_scope()),
            logit_bias: (!cfg.logit_bias().is_empty())
                .then(|| cfg.logit_bias().iter().copied().collect()),
            allowed_token_ids: cfg.allowed_tokens().map(<[u32]>::to_vec),
            banned_token_ids: (!cfg.banned_tokens().is_empty())
                .then(|| cfg.banned_tokens().to_vec()),
            logprobs: cfg.logprobs(),
            ..RequestConfig::default()
        }
    }

    /// The stop fields of `stop`: every stop sequence under `stop_token_sequences`, lists only
    /// when not empty, `include_stop_str_in_output` always.
    pub fn from_stop(stop: &StopConditions) -> Self {
        let StopConditions {
            eos,
            stop_sequences,
            stop_strings,
            include_stop_str_in_output,
        } = stop;
        RequestConfig {
            eos_token_id: (!eos.is_empty()).then(|| eos.clone()),
            stop_token_sequences: (!stop_sequences.is_empty()).then(|| stop_sequences.clone()),
            stop: (!stop_strings.is_empty()).then(|| stop_strings.clone()),
            include_stop_str_in_output: Some(*include_stop_str_in_output),
            ..RequestConfig::default()
        }
    }

    /// The draft fields of `draft`: `num_speculative_tokens` for `Off` (0) and `Fixed(k)`,
    /// `adaptive_draft` for `Adaptive`.
    pub fn from_draft(draft: &DraftLength) -> Self {
        let (num_speculative_tokens, adaptive_draft) = match draft {
            DraftLength::Off => (Some(0), None),
            DraftLength::Fixed(k) => (Some(*k), None),
            DraftLength::Adaptive(a) => (None, Some(a.clone())),
        };
        RequestConfig {
            num_speculative_tokens,
            adaptive_draft,
            ..RequestConfig::default()
        }
    }
}

impl TryFrom<&RequestConfig> for SamplingConfig {
    type Error = Error;
    /// [`RequestConfig::sampling_config`].
    fn try_from(r: &RequestConfig) -> Result<Self> {
        r.sampling_config()
    }
}

impl From<&SamplingConfig> for RequestConfig {
    /// [`RequestConfig::from_sampling`].
    fn from(c: &SamplingConfig) -> Self {
        RequestConfig::from_sampling(c)
    }
}

/// `Serialize` and `Deserialize` for `$ty`, the rows `$fields` of the flat object: written as
/// [`RequestConfig::$store`], loaded as [`RequestConfig::$load`] after refusing the other rows.
macro_rules! rows_serde {
    ($($ty:ty: $fields:expr, $load:ident, $store:ident;)*) => {$(
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                RequestConfig::$store(self).serialize(s)
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let r = <RequestConfig as Deserialize>::deserialize(d)?;
                r.only($fields)?;
                r.$load().map_err(de::Error::custom)
            }
        }
    )*};
}

rows_serde! {
    SamplingConfig: SAMPLING_FIELDS, sampling_config, from_sampling;
    StopConditions: STOP_FIELDS, stop_conditions, from_stop;
    DraftLength: DRAFT_FIELDS, draft_length, from_draft;
}
