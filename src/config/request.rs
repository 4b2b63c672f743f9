//! [`RequestConfig`]: the flat object of HF `GenerationConfig` and vLLM `SamplingParams` names,
//! and the parsers of its values that take more than one shape.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, IntoDeserializer, SeqAccess, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::keys::named_serde;
use crate::decode::AdaptiveConfig;
use crate::sampling::PenaltyScope;
#[cfg(doc)]
use crate::{Error, decode::GenerationParams};

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
#[serde(remote = "Self", default, deny_unknown_fields)]
pub struct RequestConfig {
    /// HF `do_sample`: `Some(false)` means greedy whatever `temperature` says (see the module
    /// docs). Never written by serialisation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub do_sample: Option<bool>,
    /// Temperature (`>= 0`; 0 = greedy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Top-k: 0 or -1 (vLLM) = off; other negative values are invalid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// Top-p nucleus mass in `(0, 1]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Min-p in `[0, 1]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// CTRL repetition penalty (`> 0`; 1 = off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// OpenAI frequency penalty, in logits per occurrence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// OpenAI presence penalty, in logits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// Which tokens the frequency and presence penalties count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub penalty_scope: Option<PenaltyScope>,
    /// Token id -> added logit. In JSON the keys are strings (`{"42": -5.0}`), and a value may
    /// be the string `"-inf"` (a ban), since JSON has no infinity.
    #[serde(skip_serializing_if = "Option::is_none", with = "bias")]
    pub logit_bias: Option<BTreeMap<u32, f32>>,
    /// vLLM `allowed_token_ids`: only these tokens may be emitted (must not be empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Tokens never emitted (HF `suppress_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub banned_token_ids: Option<Vec<u32>>,
    /// vLLM `logprobs`: report the emitted tokens' log-probabilities and this many top
    /// alternatives.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<usize>,
    /// Seed of the request's random stream; `None` (absent or `null`): a fresh seed per request
    /// ([`crate::decode::SeedSource`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Token budget (vLLM `max_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
    /// Minimum number of new tokens (HF `min_new_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<usize>,
    /// Stop strings (HF `stop_strings`); a single string is read as a list of one.
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "one_or_many"
    )]
    pub stop: Option<Vec<String>>,
    /// vLLM `stop_token_ids`: each id is a stop sequence of one token. Serialisation writes
    /// every stop sequence under `stop_token_sequences` instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Stop token sequences (none empty), after those of `stop_token_ids`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_token_sequences: Option<Vec<Vec<u32>>>,
    /// HF `eos_token_id`: EOS ids; one id is read as a list of one.
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "one_or_many"
    )]
    pub eos_token_id: Option<Vec<u32>>,
    /// vLLM `include_stop_str_in_output`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM `num_speculative_tokens`: fixed draft length; 0 = no speculation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_speculative_tokens: Option<usize>,
    /// Adaptive draft length (not together with `num_speculative_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adaptive_draft: Option<AdaptiveConfig>,
    /// Node budget of tree drafts ([`TreeDrafts::nodes`](crate::decode::TreeDrafts::nodes)); 0 = chains ([`TreeDrafts::Off`](crate::decode::TreeDrafts::Off)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tree_nodes: Option<usize>,
    /// Branching limit of tree drafts ([`TreeDrafts::with_branch`](crate::decode::TreeDrafts::with_branch)); 0 = none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tree_branch: Option<usize>,
}

/// The aliases of [`RequestConfig`]'s fields, as `(alias, name)`.
const ALIASES: &[(&str, &str)] = &[
    ("suppress_tokens", "banned_token_ids"),
    ("max_tokens", "max_new_tokens"),
    ("min_new_tokens", "min_tokens"),
    ("stop_strings", "stop"),
];

named_serde!(RequestConfig, ALIASES);

/// Calls `$m!` with the name of every field of [`RequestConfig`] in declaration order (the
/// struct literal of [`RequestConfig::merge`] checks that the list is complete).
macro_rules! with_fields {
    ($m:ident) => {
        $m! {
            do_sample, temperature, top_k, top_p, min_p, repetition_penalty, frequency_penalty,
            presence_penalty, penalty_scope, logit_bias, allowed_token_ids, banned_token_ids,
            logprobs, seed, max_new_tokens, min_tokens, stop, stop_token_ids,
            stop_token_sequences, eos_token_id, include_stop_str_in_output,
            num_speculative_tokens, adaptive_draft, tree_nodes, tree_branch
        }
    };
}

impl RequestConfig {
    /// The names of the fields that are set (`Some`), in declaration order.
    pub fn set_fields(&self) -> Vec<&'static str> {
        macro_rules! set {
            ($($f:ident),*) => { [$((stringify!($f), self.$f.is_some())),*] };
        }
        with_fields!(set)
            .into_iter()
            .filter_map(|(name, set)| set.then_some(name))
            .collect()
    }

    /// `self` with the fields set in `other` taken from `other`.
    pub(super) fn merge(self, other: RequestConfig) -> RequestConfig {
        macro_rules! pick {
            ($($f:ident),*) => { RequestConfig { $($f: other.$f.or(self.$f)),* } };
        }
        with_fields!(pick)
    }
}

// ---------------------------------------------------------------------------------------------
// Values: penalty scopes, one or many, logit bias maps.
// ---------------------------------------------------------------------------------------------

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

/// [`OneOrMany`] of an optional field.
fn one_or_many<'de, D, T>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<OneOrMany<T>>::deserialize(d)?.map(|v| v.0))
}

/// A token id as a map key: an integer, or a string holding one (JSON object keys).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
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

/// `logit_bias`: JSON object keys are strings, and JSON has no infinity.
mod bias {
    use super::*;
    use serde::ser::SerializeMap;

    /// Token ids as integers or strings holding one ([`TokenKey`]), biases as numbers or
    /// `"-inf"` ([`BiasValue`]).
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<BTreeMap<u32, f32>>, D::Error> {
        let m = Option::<BTreeMap<TokenKey, BiasValue>>::deserialize(d)?;
        Ok(m.map(|m| m.into_iter().map(|(t, b)| (t.0, b.0)).collect()))
    }

    /// Writes `logit_bias` with string keys (valid in every format) and `"-inf"` for a ban.
    pub(super) fn serialize<S: Serializer>(
        m: &Option<BTreeMap<u32, f32>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rows::{DRAFT_FIELDS, SAMPLING_FIELDS, STOP_FIELDS};
    use crate::config::{HF_IGNORED_KEYS, HF_NEUTRAL_KEYS};

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
