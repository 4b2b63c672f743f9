//! Configs from JSON (or any self-describing serde format): the `serde` feature.
//!
//! [`SamplingConfig`], [`GenerationParams`], [`StopConditions`], [`DraftLength`],
//! [`AdaptiveConfig`], [`PenaltyScope`], [`PromptLookupConfig`] and [`SuffixConfig`] implement
//! `Serialize` and `Deserialize`. The names are the ones users type for other engines: Hugging
//! Face `GenerationConfig` (`generation_config.json`), vLLM `SamplingParams` and vLLM's
//! `speculative_config`. Every load goes through the same validation as the builders, so a
//! loaded config is always valid, and serialising a config then loading it gives back an equal
//! config.
//!
//! ```
//! use speculative::decode::{GenerationParams, StopConditions};
//! use speculative::SamplingConfig;
//!
//! let json = r#"{
//!     "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
//!     "seed": 7, "max_tokens": 128, "stop": ["\n\n"], "eos_token_id": [151645, 151643]
//! }"#;
//! let params: GenerationParams = serde_json::from_str(json).unwrap();
//! let sampling = SamplingConfig::builder()
//!     .temperature(0.7).top_p(0.8).top_k(20).repetition_penalty(1.05).build()?;
//! assert_eq!(params.sampling, sampling);
//! assert_eq!(params.max_new_tokens, 128);
//! assert_eq!(params.stop.eos, [151645, 151643]);
//! # Ok::<(), speculative::Error>(())
//! ```
//!
//! # Names
//!
//! [`GenerationParams`] is one flat object, as HF and vLLM write it ([`RequestConfig`] is that
//! object as a Rust struct). [`SamplingConfig`] accepts the sampling rows only,
//! [`StopConditions`] the stop rows only and [`DraftLength`] the draft rows only.
//!
//! | name (aliases) | type | absent | meaning |
//! |---|---|---|---|
//! | `do_sample` | bool | - | HF: `false` = greedy; see below |
//! | `temperature` | number `>= 0` | 0 (greedy) | 0 = greedy; see below |
//! | `top_k` | integer | 0 (off) | 0 or -1 (vLLM) = off |
//! | `top_p` | number in `(0, 1]` | 1 (off) | |
//! | `min_p` | number in `[0, 1]` | 0 (off) | |
//! | `repetition_penalty` | number `> 0` | 1 (off) | CTRL, prompt and output |
//! | `frequency_penalty`, `presence_penalty` | number | 0 (off) | OpenAI / vLLM |
//! | `penalty_scope` | `"generated"` or `"whole_context"` | `"generated"` | [`PenaltyScope`] |
//! | `logit_bias` | object token id -> number or `"-inf"` | none | keys are strings in JSON (`{"50256": -100}`); `"-inf"` bans (JSON has no infinity) |
//! | `allowed_token_ids` | list of ids, not empty | all allowed | vLLM |
//! | `banned_token_ids` (`suppress_tokens`) | list of ids | none | HF's `suppress_tokens` |
//! | `logprobs` | integer or null | null (none) | vLLM: number of top alternatives; 0 = the emitted token's only |
//! | `seed` | integer `>= 0` or null | null: a fresh seed per request ([`crate::decode::SeedSource`]) | the request's [`crate::rng::Stream`] |
//! | `max_new_tokens` (`max_tokens`) | integer | 256 | the token budget (vLLM's default is 16) |
//! | `min_tokens` (`min_new_tokens`) | integer `<= max_new_tokens` | 0 | vLLM / HF |
//! | `stop` (`stop_strings`) | string or list of strings, none empty | none | stop strings (need a [`crate::decode::Detokenizer`] when the generation starts) |
//! | `stop_token_ids` | list of ids | none | vLLM: single-token stop sequences |
//! | `stop_token_sequences` | list of non-empty lists of ids | none | multi-token stop sequences |
//! | `eos_token_id` | id or list of ids | none | HF: EOS ids |
//! | `include_stop_str_in_output` | bool | false | vLLM |
//! | `num_speculative_tokens` | integer | fixed 4 | vLLM `speculative_config`: fixed draft length; 0 = no speculation ([`DraftLength::Off`]) |
//! | `adaptive_draft` | [`AdaptiveConfig`] object | - | [`DraftLength::Adaptive`]; not together with `num_speculative_tokens` |
//! | `tree_nodes` | integer | 0 (chains) | node budget of tree drafts ([`GenerationParams::tree`], [`TreeDrafts::nodes`]) |
//! | `tree_branch` | integer | 0 (no limit) | most children per node of tree drafts ([`TreeDrafts::with_branch`]) |
//!
//! An absent field takes this crate's default (the builder's, [`GenerationParams::default`]),
//! not another engine's: HF transformers applies `top_k = 50` when sampling and vLLM samples at
//! temperature 1 by default; here an absent `top_k` is off and an absent `temperature` is greedy,
//! so write the values you mean. `null` counts as absent. Token ids are checked against the
//! vocabulary, and stop strings against the detokenizer, when the generation starts
//! ([`GenerationParams::validate`]), since a config file knows neither.
//!
//! **`do_sample` and `temperature`** (HF's rule, where `do_sample` defaults to `false`):
//!
//! | `do_sample` | `temperature` | result |
//! |---|---|---|
//! | absent | absent | 0 (greedy) |
//! | absent | `t` | `t` |
//! | `true` | absent | 1 (HF's default temperature) |
//! | `true` | `t` | `t` (0 is still greedy) |
//! | `false` | any | 0 (greedy); a given `t` must still be valid |
//!
//! Serialising writes `temperature` and never `do_sample`. [`DraftLength::Fixed`]`(0)` and
//! [`DraftLength::Off`] act the same and both serialise as `"num_speculative_tokens": 0`, which
//! loads as `Off`.
//!
//! **Runtime-only fields** are not serialised and are absent after a load: the
//! [`crate::TokenMask`] of a [`SamplingConfig`] (re-attach it with
//! `config.to_builder().mask(..)`) and the cancel flag of a [`GenerationParams`].
//!
//! The other types have their own objects: [`AdaptiveConfig`] and [`SuffixConfig`] use their
//! field names (`max_depth` also as vLLM's `suffix_decoding_max_tree_depth`), absent fields
//! taking the type's default; [`PromptLookupConfig`] is `{"prompt_lookup_min": 1,
//! "prompt_lookup_max": 4, "periodic": false}` (vLLM's names; `min_n` / `max_n` as aliases);
//! [`PenaltyScope`] is `"generated"` or `"whole_context"`.
//!
//! # Unknown fields: strict by default, [`Lenient`] for HF files
//!
//! Every type rejects a field it does not know, with serde's "unknown field" error (a typo such
//! as `top_pp` never passes silently). An HF `generation_config.json` also carries fields this
//! crate has no use for (`bos_token_id`, `transformers_version`, ...); load such a file through
//! [`Lenient`], which skips the top-level keys of [`HF_IGNORED_KEYS`] and accepts those of
//! [`HF_NEUTRAL_KEYS`] only at the value that turns their feature off (so `"num_beams": 4` is an
//! error, not a silent change of algorithm). Any other unknown key is still an error.
//!
//! ```
//! use speculative::config::Lenient;
//! use speculative::decode::GenerationParams;
//!
//! let hf = r#"{ "bos_token_id": 1, "eos_token_id": 2, "do_sample": true,
//!               "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0" }"#;
//! assert!(serde_json::from_str::<GenerationParams>(hf).is_err()); // strict: bos_token_id
//! let params = serde_json::from_str::<Lenient<GenerationParams>>(hf).unwrap().0;
//! assert_eq!(params.stop.eos, [2]);
//! ```
//!
//! # Errors
//!
//! A value out of range fails the load with the message of [`Error::InvalidConfig`], which names
//! the field (`invalid configuration: top_p = 1.5 (must be in (0, 1])`); a value of the wrong
//! type fails with serde's message prefixed by the field name (`seed: invalid value: integer
//! `-1`, expected u64`). To get the typed [`Error`] instead of a format's error, deserialise a
//! [`RequestConfig`] (which only checks types) and convert it with
//! [`RequestConfig::generation_params`] or [`RequestConfig::sampling_config`].
//!
//! The `Deserialize` implementations need a self-describing format (JSON, TOML, YAML, ...):
//! fields such as `eos_token_id` accept more than one shape.
//!
//! **Exact round trips.** Every number is written in its shortest exact form. serde_json's
//! default float parser can be one unit in the last place off for `f64`, which matters for the
//! `f64` fields of [`AdaptiveConfig`]; enable serde_json's `float_roundtrip` feature when a
//! reloaded config must be bit-identical (the `f32` fields come back exact either way).

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{
    self, DeserializeSeed, Deserializer, IgnoredAny, IntoDeserializer, MapAccess, SeqAccess,
    Visitor,
};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

use crate::decode::{AdaptiveConfig, DraftLength, GenerationParams, StopConditions, TreeDrafts};
use crate::error::{Error, Result};
use crate::propose::{PromptLookupConfig, SuffixConfig};
use crate::sampling::{PenaltyScope, SamplingConfig};

// ---------------------------------------------------------------------------------------------
// RequestConfig: the flat engine-named object.
// ---------------------------------------------------------------------------------------------

/// The parameters of a generation request as one flat object with the names of HF
/// `GenerationConfig` and vLLM `SamplingParams` (see the table in [the module
/// docs](crate::config)): the serialised form of [`GenerationParams`], every field optional.
///
/// Deserialising a `RequestConfig` checks types only, and rejects unknown fields; the
/// conversions ([`RequestConfig::generation_params`], [`RequestConfig::sampling_config`],
/// [`RequestConfig::stop_conditions`], [`RequestConfig::draft_length`]) validate the values
/// and return the typed [`Error`]. `None` means absent (the default of the target type).
///
/// ```
/// use speculative::config::RequestConfig;
/// use speculative::Error;
///
/// let req: RequestConfig = serde_json::from_str(r#"{"top_p": 1.5}"#).unwrap();
/// assert!(matches!(
///     req.sampling_config(),
///     Err(Error::InvalidConfig { field: "top_p", .. })
/// ));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestConfig {
    /// HF `do_sample`: `Some(false)` means greedy whatever `temperature` says (see the module
    /// docs). Never written by serialisation.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::do_sample"
    )]
    pub do_sample: Option<bool>,
    /// Temperature (`>= 0`; 0 = greedy).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::temperature"
    )]
    pub temperature: Option<f32>,
    /// Top-k: 0 or -1 (vLLM) = off; other negative values are invalid.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::top_k"
    )]
    pub top_k: Option<i64>,
    /// Top-p nucleus mass in `(0, 1]`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::top_p"
    )]
    pub top_p: Option<f32>,
    /// Min-p in `[0, 1]`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::min_p"
    )]
    pub min_p: Option<f32>,
    /// CTRL repetition penalty (`> 0`; 1 = off).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::repetition_penalty"
    )]
    pub repetition_penalty: Option<f32>,
    /// OpenAI frequency penalty, in logits per occurrence.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::frequency_penalty"
    )]
    pub frequency_penalty: Option<f32>,
    /// OpenAI presence penalty, in logits.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::presence_penalty"
    )]
    pub presence_penalty: Option<f32>,
    /// Which tokens the frequency and presence penalties count.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::penalty_scope"
    )]
    pub penalty_scope: Option<PenaltyScope>,
    /// Token id -> added logit. In JSON the keys are strings (`{"42": -5.0}`), and a value may
    /// be the string `"-inf"` (a ban), since JSON has no infinity.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "ser_logit_bias",
        deserialize_with = "de_logit_bias"
    )]
    pub logit_bias: Option<BTreeMap<u32, f32>>,
    /// vLLM `allowed_token_ids`: only these tokens may be emitted (must not be empty).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::allowed_token_ids"
    )]
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Tokens never emitted (HF `suppress_tokens`).
    #[serde(
        default,
        alias = "suppress_tokens",
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::banned_token_ids"
    )]
    pub banned_token_ids: Option<Vec<u32>>,
    /// vLLM `logprobs`: report the emitted tokens' log-probabilities and this many top
    /// alternatives.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::logprobs"
    )]
    pub logprobs: Option<usize>,
    /// Seed of the request's random stream; `None` (absent or `null`): a fresh seed per request
    /// ([`crate::decode::SeedSource`]).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::seed"
    )]
    pub seed: Option<u64>,
    /// Token budget (vLLM `max_tokens`).
    #[serde(
        default,
        alias = "max_tokens",
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::max_new_tokens"
    )]
    pub max_new_tokens: Option<usize>,
    /// Minimum number of new tokens (HF `min_new_tokens`).
    #[serde(
        default,
        alias = "min_new_tokens",
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::min_tokens"
    )]
    pub min_tokens: Option<usize>,
    /// Stop strings (HF `stop_strings`); a single string is read as a list of one.
    #[serde(
        default,
        alias = "stop_strings",
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_stop"
    )]
    pub stop: Option<Vec<String>>,
    /// vLLM `stop_token_ids`: each id is a stop sequence of one token. Serialisation writes
    /// every stop sequence under `stop_token_sequences` instead.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::stop_token_ids"
    )]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Stop token sequences (none empty), after those of `stop_token_ids`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::stop_token_sequences"
    )]
    pub stop_token_sequences: Option<Vec<Vec<u32>>>,
    /// HF `eos_token_id`: EOS ids; one id is read as a list of one.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_eos"
    )]
    pub eos_token_id: Option<Vec<u32>>,
    /// vLLM `include_stop_str_in_output`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::include_stop_str_in_output"
    )]
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM `num_speculative_tokens`: fixed draft length; 0 = no speculation.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::num_speculative_tokens"
    )]
    pub num_speculative_tokens: Option<usize>,
    /// Adaptive draft length (not together with `num_speculative_tokens`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::adaptive_draft"
    )]
    pub adaptive_draft: Option<AdaptiveConfig>,
    /// Node budget of tree drafts ([`TreeDrafts::nodes`]); 0 = chains ([`TreeDrafts::Off`]).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::tree_nodes"
    )]
    pub tree_nodes: Option<usize>,
    /// Branching limit of tree drafts ([`TreeDrafts::with_branch`]); 0 = none.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rq::tree_branch"
    )]
    pub tree_branch: Option<usize>,
}

/// The fields [`SamplingConfig`] accepts.
const SAMPLING_FIELDS: &[&str] = &[
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
const STOP_FIELDS: &[&str] = &[
    "eos_token_id",
    "stop",
    "stop_token_ids",
    "stop_token_sequences",
    "include_stop_str_in_output",
];

/// The fields [`DraftLength`] accepts.
const DRAFT_FIELDS: &[&str] = &["num_speculative_tokens", "adaptive_draft"];

impl RequestConfig {
    /// The names of the fields that are set (`Some`), in declaration order.
    pub fn set_fields(&self) -> Vec<&'static str> {
        let RequestConfig {
            do_sample,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            penalty_scope,
            logit_bias,
            allowed_token_ids,
            banned_token_ids,
            logprobs,
            seed,
            max_new_tokens,
            min_tokens,
            stop,
            stop_token_ids,
            stop_token_sequences,
            eos_token_id,
            include_stop_str_in_output,
            num_speculative_tokens,
            adaptive_draft,
            tree_nodes,
            tree_branch,
        } = self;
        [
            ("do_sample", do_sample.is_some()),
            ("temperature", temperature.is_some()),
            ("top_k", top_k.is_some()),
            ("top_p", top_p.is_some()),
            ("min_p", min_p.is_some()),
            ("repetition_penalty", repetition_penalty.is_some()),
            ("frequency_penalty", frequency_penalty.is_some()),
            ("presence_penalty", presence_penalty.is_some()),
            ("penalty_scope", penalty_scope.is_some()),
            ("logit_bias", logit_bias.is_some()),
            ("allowed_token_ids", allowed_token_ids.is_some()),
            ("banned_token_ids", banned_token_ids.is_some()),
            ("logprobs", logprobs.is_some()),
            ("seed", seed.is_some()),
            ("max_new_tokens", max_new_tokens.is_some()),
            ("min_tokens", min_tokens.is_some()),
            ("stop", stop.is_some()),
            ("stop_token_ids", stop_token_ids.is_some()),
            ("stop_token_sequences", stop_token_sequences.is_some()),
            ("eos_token_id", eos_token_id.is_some()),
            (
                "include_stop_str_in_output",
                include_stop_str_in_output.is_some(),
            ),
            ("num_speculative_tokens", num_speculative_tokens.is_some()),
            ("adaptive_draft", adaptive_draft.is_some()),
            ("tree_nodes", tree_nodes.is_some()),
            ("tree_branch", tree_branch.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }

    /// The first set field not in `allowed`, as serde's "unknown field" error.
    fn only<E: de::Error>(&self, allowed: &'static [&'static str]) -> Result<(), E> {
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

    /// The generation parameters of every field: [`RequestConfig::sampling_config`],
    /// [`RequestConfig::stop_conditions`], [`RequestConfig::draft_length`], and `seed`,
    /// `max_new_tokens`, `min_tokens`, `tree_nodes`, `tree_branch` (absent: [`GenerationParams::default`]'s). No cancel
    /// flag.
    ///
    /// # Errors
    /// The errors of the three conversions above, and [`Error::InvalidConfig`] naming
    /// `min_tokens` when it exceeds `max_new_tokens`.
    pub fn generation_params(&self) -> Result<GenerationParams> {
        let d = GenerationParams::default();
        let max_new_tokens = self.max_new_tokens.unwrap_or(d.max_new_tokens);
        let min_tokens = self.min_tokens.unwrap_or(d.min_tokens);
        if min_tokens > max_new_tokens {
            return Err(Error::config(
                "min_tokens",
                min_tokens,
                "must not exceed max_new_tokens",
            ));
        }
        Ok(GenerationParams {
            sampling: self.sampling_config()?,
            seed: self.seed,
            max_new_tokens,
            min_tokens,
            stop: self.stop_conditions()?,
            draft: self.draft_length()?,
            tree: TreeDrafts::nodes(self.tree_nodes.unwrap_or(d.tree.node_budget()))
                .with_branch(self.tree_branch.unwrap_or(d.tree.branch())),
            cancel: None,
        })
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

    /// Every field of `params` except the cancel flag (and the sampling mask).
    pub fn from_params(params: &GenerationParams) -> Self {
        let GenerationParams {
            sampling,
            seed,
            max_new_tokens,
            min_tokens,
            stop,
            draft,
            tree,
            cancel: _,
        } = params;
        RequestConfig {
            seed: *seed,
            tree_nodes: Some(tree.node_budget()),
            tree_branch: Some(tree.branch()),
            max_new_tokens: Some(*max_new_tokens),
            min_tokens: Some(*min_tokens),
            ..RequestConfig::from_sampling(sampling)
                .merge(RequestConfig::from_stop(stop))
                .merge(RequestConfig::from_draft(draft))
        }
    }

    /// `self` with the fields set in `other` taken from `other`.
    fn merge(self, other: RequestConfig) -> RequestConfig {
        macro_rules! pick {
            ($($f:ident),*) => {
                RequestConfig { $($f: other.$f.or(self.$f)),* }
            };
        }
        pick!(
            do_sample,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            penalty_scope,
            logit_bias,
            allowed_token_ids,
            banned_token_ids,
            logprobs,
            seed,
            max_new_tokens,
            min_tokens,
            stop,
            stop_token_ids,
            stop_token_sequences,
            eos_token_id,
            include_stop_str_in_output,
            num_speculative_tokens,
            adaptive_draft,
            tree_nodes,
            tree_branch
        )
    }
}

impl TryFrom<&RequestConfig> for SamplingConfig {
    type Error = Error;
    /// [`RequestConfig::sampling_config`].
    fn try_from(r: &RequestConfig) -> Result<Self> {
        r.sampling_config()
    }
}

impl TryFrom<&RequestConfig> for GenerationParams {
    type Error = Error;
    /// [`RequestConfig::generation_params`].
    fn try_from(r: &RequestConfig) -> Result<Self> {
        r.generation_params()
    }
}

impl From<&SamplingConfig> for RequestConfig {
    /// [`RequestConfig::from_sampling`].
    fn from(c: &SamplingConfig) -> Self {
        RequestConfig::from_sampling(c)
    }
}

impl From<&GenerationParams> for RequestConfig {
    /// [`RequestConfig::from_params`].
    fn from(p: &GenerationParams) -> Self {
        RequestConfig::from_params(p)
    }
}

// ---------------------------------------------------------------------------------------------
// Serialize / Deserialize of the crate's types through RequestConfig.
// ---------------------------------------------------------------------------------------------

impl Serialize for SamplingConfig {
    /// The sampling fields of [`RequestConfig::from_sampling`]; the mask is not written.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RequestConfig::from_sampling(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for SamplingConfig {
    /// The sampling fields only (see the module docs), validated by the builder.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let r = RequestConfig::deserialize(d)?;
        r.only(SAMPLING_FIELDS)?;
        r.sampling_config().map_err(de::Error::custom)
    }
}

impl Serialize for GenerationParams {
    /// [`RequestConfig::from_params`]: one flat object; the cancel flag and the mask are not
    /// written.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RequestConfig::from_params(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for GenerationParams {
    /// Every field of the module docs' table, validated as [`RequestConfig::generation_params`].
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        RequestConfig::deserialize(d)?
            .generation_params()
            .map_err(de::Error::custom)
    }
}

impl Serialize for StopConditions {
    /// [`RequestConfig::from_stop`].
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RequestConfig::from_stop(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for StopConditions {
    /// The stop fields only, validated as [`RequestConfig::stop_conditions`].
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let r = RequestConfig::deserialize(d)?;
        r.only(STOP_FIELDS)?;
        r.stop_conditions().map_err(de::Error::custom)
    }
}

impl Serialize for DraftLength {
    /// [`RequestConfig::from_draft`]: `{"num_speculative_tokens": k}` or
    /// `{"adaptive_draft": {..}}`.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RequestConfig::from_draft(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for DraftLength {
    /// The draft fields only, validated as [`RequestConfig::draft_length`] (`{}` is the
    /// default, fixed 4).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let r = RequestConfig::deserialize(d)?;
        r.only(DRAFT_FIELDS)?;
        r.draft_length().map_err(de::Error::custom)
    }
}

impl Serialize for PenaltyScope {
    /// `"generated"` or `"whole_context"`.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match self {
            PenaltyScope::Generated => "generated",
            PenaltyScope::WholeContext => "whole_context",
        })
    }
}

impl<'de> Deserialize<'de> for PenaltyScope {
    /// `"generated"` or `"whole_context"`.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const VARIANTS: &[&str] = &["generated", "whole_context"];
        let s = String::deserialize(d)?;
        match s.as_str() {
            "generated" => Ok(PenaltyScope::Generated),
            "whole_context" => Ok(PenaltyScope::WholeContext),
            other => Err(de::Error::unknown_variant(other, VARIANTS)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The plain settings structs, through private mirrors with named fields.
// ---------------------------------------------------------------------------------------------

/// [`AdaptiveConfig`] on the wire: its own field names, absent = default.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct AdaptiveWire {
    #[serde(deserialize_with = "ad::max_draft")]
    max_draft: usize,
    #[serde(deserialize_with = "ad::decay")]
    decay: f64,
    #[serde(deserialize_with = "ad::time_smoothing")]
    time_smoothing: f64,
    #[serde(deserialize_with = "ad::probe_interval")]
    probe_interval: usize,
    #[serde(deserialize_with = "ad::max_probe_interval")]
    max_probe_interval: usize,
    #[serde(deserialize_with = "ad::probe_draft")]
    probe_draft: usize,
}

impl From<&AdaptiveConfig> for AdaptiveWire {
    fn from(c: &AdaptiveConfig) -> Self {
        let AdaptiveConfig {
            max_draft,
            decay,
            time_smoothing,
            probe_interval,
            max_probe_interval,
            probe_draft,
        } = *c;
        AdaptiveWire {
            max_draft,
            decay,
            time_smoothing,
            probe_interval,
            max_probe_interval,
            probe_draft,
        }
    }
}

impl Default for AdaptiveWire {
    fn default() -> Self {
        AdaptiveWire::from(&AdaptiveConfig::default())
    }
}

impl Serialize for AdaptiveConfig {
    /// Every field, under its own name.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        AdaptiveWire::from(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for AdaptiveConfig {
    /// Its own field names, absent fields from [`AdaptiveConfig::default`], checked by
    /// [`AdaptiveConfig::validate`].
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let AdaptiveWire {
            max_draft,
            decay,
            time_smoothing,
            probe_interval,
            max_probe_interval,
            probe_draft,
        } = AdaptiveWire::deserialize(d)?;
        let c = AdaptiveConfig {
            max_draft,
            decay,
            time_smoothing,
            probe_interval,
            max_probe_interval,
            probe_draft,
        };
        c.validate().map_err(de::Error::custom)?;
        Ok(c)
    }
}

/// [`SuffixConfig`] on the wire: its own field names, absent = default.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct SuffixWire {
    #[serde(
        alias = "suffix_decoding_max_tree_depth",
        deserialize_with = "sx::max_depth"
    )]
    max_depth: usize,
    #[serde(deserialize_with = "sx::max_match_len")]
    max_match_len: usize,
    #[serde(deserialize_with = "sx::min_confidence")]
    min_confidence: f32,
    #[serde(deserialize_with = "sx::max_corpus_tokens")]
    max_corpus_tokens: usize,
    #[serde(deserialize_with = "sx::corpus_outputs_only")]
    corpus_outputs_only: bool,
}

impl From<&SuffixConfig> for SuffixWire {
    fn from(c: &SuffixConfig) -> Self {
        let SuffixConfig {
            max_depth,
            max_match_len,
            min_confidence,
            max_corpus_tokens,
            corpus_outputs_only,
        } = *c;
        SuffixWire {
            max_depth,
            max_match_len,
            min_confidence,
            max_corpus_tokens,
            corpus_outputs_only,
        }
    }
}

impl Default for SuffixWire {
    fn default() -> Self {
        SuffixWire::from(&SuffixConfig::default())
    }
}

impl Serialize for SuffixConfig {
    /// Every field, under its own name.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        SuffixWire::from(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for SuffixConfig {
    /// Its own field names (`max_depth` also as vLLM's `suffix_decoding_max_tree_depth`),
    /// absent fields from [`SuffixConfig::default`], checked by [`SuffixConfig::validate`].
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let SuffixWire {
            max_depth,
            max_match_len,
            min_confidence,
            max_corpus_tokens,
            corpus_outputs_only,
        } = SuffixWire::deserialize(d)?;
        let c = SuffixConfig {
            max_depth,
            max_match_len,
            min_confidence,
            max_corpus_tokens,
            corpus_outputs_only,
        };
        c.validate().map_err(de::Error::custom)?;
        Ok(c)
    }
}

/// [`PromptLookupConfig`] on the wire: vLLM's names, absent = default.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct PromptLookupWire {
    #[serde(alias = "min_n", deserialize_with = "pl::prompt_lookup_min")]
    prompt_lookup_min: usize,
    #[serde(alias = "max_n", deserialize_with = "pl::prompt_lookup_max")]
    prompt_lookup_max: usize,
    #[serde(deserialize_with = "pl::periodic")]
    periodic: bool,
}

impl From<&PromptLookupConfig> for PromptLookupWire {
    fn from(c: &PromptLookupConfig) -> Self {
        let PromptLookupConfig {
            min_n,
            max_n,
            periodic,
        } = *c;
        PromptLookupWire {
            prompt_lookup_min: min_n,
            prompt_lookup_max: max_n,
            periodic,
        }
    }
}

impl Default for PromptLookupWire {
    fn default() -> Self {
        PromptLookupWire::from(&PromptLookupConfig::default())
    }
}

impl Serialize for PromptLookupConfig {
    /// `{"prompt_lookup_min": .., "prompt_lookup_max": .., "periodic": ..}`.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        PromptLookupWire::from(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for PromptLookupConfig {
    /// vLLM's `prompt_lookup_min` / `prompt_lookup_max` (or `min_n` / `max_n`) and `periodic`,
    /// absent fields from [`PromptLookupConfig::default`], checked by
    /// [`PromptLookupConfig::validate`] (whose errors name `min_n` / `max_n`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = PromptLookupWire::deserialize(d)?;
        let c = PromptLookupConfig {
            min_n: w.prompt_lookup_min,
            max_n: w.prompt_lookup_max,
            periodic: w.periodic,
        };
        c.validate().map_err(|e| match &e {
            Error::InvalidConfig { field: "min_n", .. } => {
                de::Error::custom(format_args!("prompt_lookup_min: {e}"))
            }
            Error::InvalidConfig { field: "max_n", .. } => {
                de::Error::custom(format_args!("prompt_lookup_max: {e}"))
            }
            _ => de::Error::custom(e),
        })?;
        Ok(c)
    }
}

// ---------------------------------------------------------------------------------------------
// Field helpers: type errors that name the field, one-or-many values, logit bias maps.
// ---------------------------------------------------------------------------------------------

/// Deserialises `T`, prefixing any error with the field name.
fn named<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    field: &'static str,
    d: D,
) -> Result<T, D::Error> {
    T::deserialize(d).map_err(|e| de::Error::custom(format_args!("{field}: {e}")))
}

/// One `deserialize_with` function per field, each [`named`] after its field.
macro_rules! named_fields {
    ($($name:ident: $ty:ty),* $(,)?) => {
        $(
            pub(super) fn $name<'de, D: serde::Deserializer<'de>>(
                d: D,
            ) -> std::result::Result<$ty, D::Error> {
                super::named(stringify!($name), d)
            }
        )*
    };
}

/// Field deserialisers of [`RequestConfig`].
mod rq {
    use super::*;
    named_fields! {
        do_sample: Option<bool>,
        temperature: Option<f32>,
        top_k: Option<i64>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        repetition_penalty: Option<f32>,
        frequency_penalty: Option<f32>,
        presence_penalty: Option<f32>,
        penalty_scope: Option<PenaltyScope>,
        allowed_token_ids: Option<Vec<u32>>,
        banned_token_ids: Option<Vec<u32>>,
        logprobs: Option<usize>,
        seed: Option<u64>,
        max_new_tokens: Option<usize>,
        min_tokens: Option<usize>,
        stop_token_ids: Option<Vec<u32>>,
        stop_token_sequences: Option<Vec<Vec<u32>>>,
        include_stop_str_in_output: Option<bool>,
        num_speculative_tokens: Option<usize>,
        adaptive_draft: Option<AdaptiveConfig>,
        tree_nodes: Option<usize>,
        tree_branch: Option<usize>,
    }
}

/// Field deserialisers of [`AdaptiveWire`].
mod ad {
    named_fields! {
        max_draft: usize,
        decay: f64,
        time_smoothing: f64,
        probe_interval: usize,
        max_probe_interval: usize,
        probe_draft: usize,
    }
}

/// Field deserialisers of [`SuffixWire`].
mod sx {
    named_fields! {
        max_depth: usize,
        max_match_len: usize,
        min_confidence: f32,
        max_corpus_tokens: usize,
        corpus_outputs_only: bool,
    }
}

/// Field deserialisers of [`PromptLookupWire`].
mod pl {
    named_fields! {
        prompt_lookup_min: usize,
        prompt_lookup_max: usize,
        periodic: bool,
    }
}

/// A value or a list of values (HF writes `eos_token_id` both ways, vLLM `stop` both ways).
struct OneOrMany<T>(Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for OneOrMany<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Vec<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a value or a list of values")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Vec<T>, A::Error> {
                let mut v = Vec::with_capacity(a.size_hint().unwrap_or(0).min(4096));
                while let Some(x) = a.next_element()? {
                    v.push(x);
                }
                Ok(v)
            }
            fn visit_u64<E: de::Error>(self, x: u64) -> Result<Vec<T>, E> {
                T::deserialize(x.into_deserializer()).map(|t| vec![t])
            }
            fn visit_i64<E: de::Error>(self, x: i64) -> Result<Vec<T>, E> {
                T::deserialize(x.into_deserializer()).map(|t| vec![t])
            }
            fn visit_f64<E: de::Error>(self, x: f64) -> Result<Vec<T>, E> {
                T::deserialize(x.into_deserializer()).map(|t| vec![t])
            }
            fn visit_bool<E: de::Error>(self, x: bool) -> Result<Vec<T>, E> {
                T::deserialize(x.into_deserializer()).map(|t| vec![t])
            }
            fn visit_str<E: de::Error>(self, x: &str) -> Result<Vec<T>, E> {
                T::deserialize(x.into_deserializer()).map(|t| vec![t])
            }
        }
        d.deserialize_any(V(PhantomData)).map(OneOrMany)
    }
}

fn de_eos<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u32>>, D::Error> {
    named::<_, Option<OneOrMany<u32>>>("eos_token_id", d).map(|o| o.map(|v| v.0))
}

fn de_stop<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    named::<_, Option<OneOrMany<String>>>("stop", d).map(|o| o.map(|v| v.0))
}

/// A token id as a map key: an integer, or a string holding one (JSON object keys).
struct TokenKey(u32);

impl<'de> Deserialize<'de> for TokenKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = u32;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (an integer, or a string holding one)")
            }
            fn visit_u64<E: de::Error>(self, x: u64) -> Result<u32, E> {
                u32::try_from(x).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(x), &self))
            }
            fn visit_i64<E: de::Error>(self, x: i64) -> Result<u32, E> {
                u32::try_from(x).map_err(|_| E::invalid_value(de::Unexpected::Signed(x), &self))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<u32, E> {
                s.trim()
                    .parse()
                    .map_err(|_| E::invalid_value(de::Unexpected::Str(s), &self))
            }
        }
        d.deserialize_any(V).map(TokenKey)
    }
}

/// A logit bias: a number, or the string `"-inf"` (also `"-infinity"`, any case).
struct BiasValue(f32);

impl<'de> Deserialize<'de> for BiasValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = f32;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number or \"-inf\"")
            }
            fn visit_f64<E: de::Error>(self, x: f64) -> Result<f32, E> {
                Ok(x as f32)
            }
            fn visit_u64<E: de::Error>(self, x: u64) -> Result<f32, E> {
                Ok(x as f32)
            }
            fn visit_i64<E: de::Error>(self, x: i64) -> Result<f32, E> {
                Ok(x as f32)
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<f32, E> {
                let t = s.trim().to_ascii_lowercase();
                if t == "-inf" || t == "-infinity" {
                    Ok(f32::NEG_INFINITY)
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(s), &self))
                }
            }
        }
        d.deserialize_any(V).map(BiasValue)
    }
}

/// The `logit_bias` map.
struct BiasMap(BTreeMap<u32, f32>);

impl<'de> Deserialize<'de> for BiasMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = BTreeMap<u32, f32>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map from token id to logit bias")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                let mut m = BTreeMap::new();
                while let Some((TokenKey(t), BiasValue(b))) = a.next_entry()? {
                    m.insert(t, b);
                }
                Ok(m)
            }
        }
        d.deserialize_map(V).map(BiasMap)
    }
}

fn de_logit_bias<'de, D: Deserializer<'de>>(d: D) -> Result<Option<BTreeMap<u32, f32>>, D::Error> {
    named::<_, Option<BiasMap>>("logit_bias", d).map(|o| o.map(|m| m.0))
}

/// Writes `logit_bias` with string keys (valid in every format) and `"-inf"` for a ban.
fn ser_logit_bias<S: Serializer>(m: &Option<BTreeMap<u32, f32>>, s: S) -> Result<S::Ok, S::Error> {
    let Some(m) = m else {
        return s.serialize_none();
    };
    let mut out = s.serialize_map(Some(m.len()))?;
    for (t, &b) in m {
        let key = t.to_string();
        if b == f32::NEG_INFINITY {
            out.serialize_entry(&key, "-inf")?;
        } else {
            out.serialize_entry(&key, &b)?;
        }
    }
    out.end()
}

// ---------------------------------------------------------------------------------------------
// Lenient: HF generation_config.json files.
// ---------------------------------------------------------------------------------------------

/// Top-level keys of an HF `generation_config.json` that [`Lenient`] skips whatever their value,
/// because they do not change which tokens this crate emits: file metadata
/// (`_from_model_config`, `transformers_version`), ids of prompt construction and padding
/// (`bos_token_id`, `pad_token_id`, `decoder_start_token_id`), HF runtime and output options
/// (`use_cache`, `cache_implementation`, `return_dict_in_generate`, `output_*`), options this
/// crate always applies (`renormalize_logits`) or never needs (`remove_invalid_values`: NaN
/// logits are an error here), beam-search-only options (`early_stopping`, `length_penalty`;
/// beam search itself is refused, see [`HF_NEUTRAL_KEYS`]), HF's assisted-generation settings
/// (lossless, so they never change the output; set the proposer here), and `max_length`.
///
/// `max_length` is the only one that changes something: HF's budget counts the prompt too, which
/// a config file cannot turn into a number of new tokens; the budget is `max_new_tokens` (or its
/// default of 256), so set `max_new_tokens` if the file relied on `max_length`.
pub const HF_IGNORED_KEYS: &[&str] = &[
    "_from_model_config",
    "transformers_version",
    "bos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "use_cache",
    "cache_implementation",
    "return_dict_in_generate",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "output_logits",
    "renormalize_logits",
    "remove_invalid_values",
    "early_stopping",
    "length_penalty",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "max_length",
];

/// The value at which an HF key of [`HF_NEUTRAL_KEYS`] turns its feature off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Neutral {
    /// The number 1 (or `null`).
    One,
    /// The number 0 (or `null`).
    Zero,
    /// `null`, `false`, an empty list or an empty object.
    Absent,
}

impl fmt::Display for Neutral {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Neutral::One => "1 or null",
            Neutral::Zero => "0 or null",
            Neutral::Absent => "null, false or empty",
        })
    }
}

/// Top-level keys of an HF `generation_config.json` that [`Lenient`] accepts only at the value
/// that turns their feature off, because this crate implements no such feature: beam search and
/// several return sequences, typical / epsilon / eta sampling, n-gram blocking, HF's total-length
/// minimum, contrastive search, forced and banned word lists, sequence bias, guidance, watermarks.
/// Any other value is an error naming the key.
pub const HF_NEUTRAL_KEYS: &[(&str, Neutral)] = &[
    ("num_beams", Neutral::One),
    ("num_beam_groups", Neutral::One),
    ("num_return_sequences", Neutral::One),
    ("diversity_penalty", Neutral::Zero),
    ("typical_p", Neutral::One),
    ("epsilon_cutoff", Neutral::Zero),
    ("eta_cutoff", Neutral::Zero),
    ("encoder_repetition_penalty", Neutral::One),
    ("no_repeat_ngram_size", Neutral::Zero),
    ("encoder_no_repeat_ngram_size", Neutral::Zero),
    ("min_length", Neutral::Zero),
    ("penalty_alpha", Neutral::Zero),
    ("guidance_scale", Neutral::One),
    ("forced_bos_token_id", Neutral::Absent),
    ("forced_eos_token_id", Neutral::Absent),
    ("begin_suppress_tokens", Neutral::Absent),
    ("bad_words_ids", Neutral::Absent),
    ("force_words_ids", Neutral::Absent),
    ("sequence_bias", Neutral::Absent),
    ("exponential_decay_length_penalty", Neutral::Absent),
    ("max_time", Neutral::Absent),
    ("watermarking_config", Neutral::Absent),
    ("dola_layers", Neutral::Absent),
];

/// Deserialises `T` from an HF `generation_config.json`-style object: the top-level keys of
/// [`HF_IGNORED_KEYS`] are skipped, those of [`HF_NEUTRAL_KEYS`] are accepted at their neutral
/// value only, and everything else reaches `T`'s own (strict) deserialisation. Nested objects
/// (such as `adaptive_draft`) stay strict.
///
/// Works for any `T` deserialised from a map: [`GenerationParams`], [`RequestConfig`] (for
/// typed errors), [`SamplingConfig`] (for a file without stop fields: an HF file's
/// `eos_token_id` belongs to [`GenerationParams`], so load that and take `.sampling`), ... With a
/// non-neutral value the error names the key (`num_beams = 4 is not supported ...`).
///
/// ```
/// use speculative::config::Lenient;
/// use speculative::SamplingConfig;
///
/// let hf = r#"{"do_sample": false, "num_beams": 1, "pad_token_id": 0}"#;
/// let cfg = serde_json::from_str::<Lenient<SamplingConfig>>(hf).unwrap().0;
/// assert!(cfg.is_greedy());
/// let beams = serde_json::from_str::<Lenient<SamplingConfig>>(r#"{"num_beams": 4}"#);
/// assert!(beams.unwrap_err().to_string().contains("num_beams = 4"));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lenient<T>(pub T);

impl<T> Lenient<T> {
    /// The loaded value.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Lenient<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::deserialize(SkipHfKeys(d)).map(Lenient)
    }
}

/// A deserializer whose top-level map drops the HF keys (see [`Lenient`]).
struct SkipHfKeys<D>(D);

impl<'de, D: Deserializer<'de>> Deserializer<'de> for SkipHfKeys<D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_any(SkipHfVisitor(v))
    }

    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_map(SkipHfVisitor(v))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_struct(name, fields, SkipHfVisitor(v))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct enum identifier
        ignored_any
    }
}

/// Passes the inner visitor a map that skips the HF keys.
struct SkipHfVisitor<V>(V);

impl<'de, V: Visitor<'de>> Visitor<'de> for SkipHfVisitor<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.0.visit_map(SkipHfMap(map))
    }
}

/// The filtering map of [`Lenient`].
struct SkipHfMap<A>(A);

impl<'de, A: MapAccess<'de>> MapAccess<'de> for SkipHfMap<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        loop {
            let Some(key) = self.0.next_key::<String>()? else {
                return Ok(None);
            };
            if HF_IGNORED_KEYS.contains(&key.as_str()) {
                self.0.next_value::<IgnoredAny>()?;
                continue;
            }
            if let Some(&(_, neutral)) = HF_NEUTRAL_KEYS.iter().find(|(k, _)| *k == key) {
                if let Some(found) = self.0.next_value_seed(NeutralSeed(neutral))? {
                    return Err(de::Error::custom(format_args!(
                        "{key} = {found} is not supported: this crate implements no such \
                         feature, so only {neutral} is accepted"
                    )));
                }
                continue;
            }
            return seed.deserialize(key.into_deserializer()).map(Some);
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        self.0.next_value_seed(seed)
    }
}

/// Reads a value and says whether it is `neutral`: `None` if it is, else the value, described.
struct NeutralSeed(Neutral);

impl<'de> DeserializeSeed<'de> for NeutralSeed {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NeutralSeed {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Option<String>, E> {
        Ok((b || self.0 != Neutral::Absent).then(|| b.to_string()))
    }

    fn visit_f64<E: de::Error>(self, x: f64) -> Result<Option<String>, E> {
        let neutral = match self.0 {
            Neutral::One => x == 1.0,
            Neutral::Zero => x == 0.0,
            Neutral::Absent => false,
        };
        Ok((!neutral).then(|| x.to_string()))
    }

    fn visit_u64<E: de::Error>(self, x: u64) -> Result<Option<String>, E> {
        self.visit_f64(x as f64)
    }

    fn visit_i64<E: de::Error>(self, x: i64) -> Result<Option<String>, E> {
        self.visit_f64(x as f64)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Option<String>, E> {
        Ok(Some(format!("{s:?}")))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Option<String>, A::Error> {
        let mut n = 0usize;
        while a.next_element::<IgnoredAny>()?.is_some() {
            n += 1;
        }
        Ok((n > 0 || self.0 != Neutral::Absent).then(|| format!("a list of {n}")))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Option<String>, A::Error> {
        let mut n = 0usize;
        while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
            n += 1;
        }
        Ok((n > 0 || self.0 != Neutral::Absent).then(|| format!("an object of {n} entries")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field set, so that `set_fields` and the serialised keys can be compared.
    fn full() -> RequestConfig {
        RequestConfig {
            do_sample: Some(true),
            temperature: Some(0.5),
            top_k: Some(3),
            top_p: Some(0.9),
            min_p: Some(0.1),
            repetition_penalty: Some(1.1),
            frequency_penalty: Some(0.2),
            presence_penalty: Some(0.3),
            penalty_scope: Some(PenaltyScope::WholeContext),
            logit_bias: Some([(1, 2.0), (4, f32::NEG_INFINITY)].into_iter().collect()),
            allowed_token_ids: Some(vec![1, 2, 4]),
            banned_token_ids: Some(vec![3]),
            logprobs: Some(2),
            seed: Some(9),
            max_new_tokens: Some(20),
            min_tokens: Some(2),
            stop: Some(vec!["x".into()]),
            stop_token_ids: Some(vec![5]),
            stop_token_sequences: Some(vec![vec![6, 7]]),
            eos_token_id: Some(vec![8]),
            include_stop_str_in_output: Some(true),
            num_speculative_tokens: Some(3),
            adaptive_draft: Some(AdaptiveConfig::default()),
            tree_nodes: Some(16),
            tree_branch: Some(2),
        }
    }

    #[test]
    fn set_fields_lists_every_serialised_key() {
        let r = full();
        let v = serde_json::to_value(&r).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut set = r.set_fields();
        set.sort_unstable();
        assert_eq!(keys, set);
        assert_eq!(set.len(), 25);
        for f in SAMPLING_FIELDS
            .iter()
            .chain(STOP_FIELDS)
            .chain(DRAFT_FIELDS)
        {
            assert!(set.contains(f), "{f}");
        }
        assert!(RequestConfig::default().set_fields().is_empty());
        // The full config round-trips through JSON, "-inf" bias included.
        let back: RequestConfig = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn merge_takes_the_fields_set_in_other() {
        let a = RequestConfig {
            seed: Some(1),
            top_k: Some(2),
            ..Default::default()
        };
        let b = RequestConfig {
            seed: Some(3),
            stop: Some(vec!["s".into()]),
            ..Default::default()
        };
        let m = a.merge(b);
        assert_eq!(
            (m.seed, m.top_k, m.stop),
            (Some(3), Some(2), Some(vec!["s".to_string()]))
        );
    }

    #[test]
    fn neutral_values() {
        let check = |n: Neutral, json: &str| {
            let mut de = serde_json::Deserializer::from_str(json);
            NeutralSeed(n).deserialize(&mut de).unwrap()
        };
        assert_eq!(check(Neutral::One, "1"), None);
        assert_eq!(check(Neutral::One, "1.0"), None);
        assert_eq!(check(Neutral::One, "null"), None);
        assert_eq!(check(Neutral::One, "4"), Some("4".into()));
        assert_eq!(check(Neutral::Zero, "0"), None);
        assert_eq!(check(Neutral::Zero, "0.5"), Some("0.5".into()));
        assert_eq!(check(Neutral::Absent, "[]"), None);
        assert_eq!(check(Neutral::Absent, "false"), None);
        assert_eq!(check(Neutral::Absent, "{}"), None);
        assert_eq!(
            check(Neutral::Absent, "[[1, 2]]"),
            Some("a list of 1".into())
        );
        assert_eq!(check(Neutral::Absent, "2"), Some("2".into()));
        assert_eq!(check(Neutral::Zero, "\"x\""), Some("\"x\"".into()));
    }

    #[test]
    fn hf_key_lists_do_not_overlap_the_fields() {
        let r = full();
        let fields = r.set_fields();
        for k in HF_IGNORED_KEYS
            .iter()
            .chain(HF_NEUTRAL_KEYS.iter().map(|(k, _)| k))
        {
            assert!(!fields.contains(k), "{k}");
            assert!(
                ![
                    "max_tokens",
                    "min_new_tokens",
                    "stop_strings",
                    "suppress_tokens"
                ]
                .contains(k)
            );
        }
    }
}
