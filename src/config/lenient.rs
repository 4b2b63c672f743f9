//! [`Lenient`]: HF `generation_config.json` files, with the lists of HF keys it skips or accepts
//! at their neutral value only.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

#[cfg(doc)]
use super::RequestConfig;
use super::keys::{Keys, Mode};
#[cfg(doc)]
use crate::{SamplingConfig, decode::GenerationParams};

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
        T::deserialize(Keys(d, Mode::SkipHf)).map(Lenient)
    }
}

/// Whether `key` is a key of [`HF_IGNORED_KEYS`] or [`HF_NEUTRAL_KEYS`], which [`Lenient`]
/// drops: then its value has been read from `map`.
///
/// # Errors
/// A key of [`HF_NEUTRAL_KEYS`] at another value than its neutral one (an error naming the key
/// and the value), or the format's error reading the value.
pub(super) fn skip_hf_key<'de, A: MapAccess<'de>>(
    key: &str,
    map: &mut A,
) -> Result<bool, A::Error> {
    if HF_IGNORED_KEYS.contains(&key) {
        map.next_value::<IgnoredAny>()?;
        return Ok(true);
    }
    let Some(&(_, neutral)) = HF_NEUTRAL_KEYS.iter().find(|(k, _)| *k == key) else {
        return Ok(false);
    };
    match map.next_value_seed(NeutralSeed(neutral))? {
        None => Ok(true),
        Some(found) => Err(de::Error::custom(format_args!(
            "{key} = {found} is not supported: this crate implements no such feature, so only \
             {neutral} is accepted"
        ))),
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
}
