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
//! assert_eq!(params.sampling(), &sampling);
//! assert_eq!(params.max_new_tokens(), 128);
//! assert_eq!(params.stop().eos, [151645, 151643]);
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
//! | `tree_nodes` | integer | 0 (chains) | node budget of tree drafts ([`GenerationParams::tree`], [`TreeDrafts::nodes`](crate::decode::TreeDrafts::nodes)) |
//! | `tree_branch` | integer | 0 (no limit) | most children per node of tree drafts ([`TreeDrafts::with_branch`](crate::decode::TreeDrafts::with_branch)) |
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
//! assert_eq!(params.stop().eos, [2]);
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
//!
//! # Implementation
//!
//! [`RequestConfig`] is the serialised form of [`GenerationParams`], [`SamplingConfig`],
//! [`StopConditions`] and [`DraftLength`] (each of the last three its own rows), with one
//! conversion each way per type. [`AdaptiveConfig`], [`SuffixConfig`], [`PromptLookupConfig`]
//! and [`RequestConfig`] derive their serde code on the type with `#[serde(remote = "Self")]`,
//! serde's way to add the aliases, the field names in errors and the validation around a derived
//! implementation. That derive also emits inherent `serialize` / `deserialize` functions on these
//! types, which do none of the three: load through the traits (`serde_json::from_str`,
//! `<T as Deserialize>::deserialize`), never `T::deserialize`.

mod keys;
mod lenient;
mod params;
mod request;
mod rows;
mod settings;

pub use lenient::{HF_IGNORED_KEYS, HF_NEUTRAL_KEYS, Lenient, Neutral};
pub use request::RequestConfig;

#[cfg(doc)]
use crate::{
    Error, SamplingConfig,
    decode::{AdaptiveConfig, DraftLength, GenerationParams, StopConditions},
    propose::{PromptLookupConfig, SuffixConfig},
    sampling::PenaltyScope,
};
