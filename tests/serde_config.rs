//! The `serde` feature: configs written as HF `generation_config.json` and vLLM `SamplingParams`
//! JSON load to the same values as the builders, every invalid field is an error naming the
//! field, unknown fields are rejected, and serialising then loading gives back an equal config.
#![cfg(feature = "serde")]

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use proptest::prelude::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use speculative::config::{Lenient, RequestConfig};
use speculative::decode::{
    AdaptiveConfig, DraftLength, GenerationParams, StopConditions, TreeDrafts,
};
use speculative::propose::{PromptLookup, PromptLookupConfig, SuffixConfig};
use speculative::sampling::PenaltyScope;
use speculative::{Error, SamplingConfig};

/// Qwen2.5-7B-Instruct's `generation_config.json` as published (HF keys we do not use included).
const HF_QWEN: &str = r#"{
  "bos_token_id": 151643,
  "pad_token_id": 151643,
  "do_sample": true,
  "eos_token_id": [
    151645,
    151643
  ],
  "repetition_penalty": 1.05,
  "temperature": 0.7,
  "top_p": 0.8,
  "top_k": 20,
  "transformers_version": "4.37.0"
}"#;

/// A Llama-style `generation_config.json` with a single EOS id, a total-length budget, beam
/// settings at their neutral values and an explicit token budget.
const HF_LLAMA: &str = r#"{
  "_from_model_config": true,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "pad_token_id": 0,
  "max_length": 4096,
  "max_new_tokens": 512,
  "min_new_tokens": 4,
  "num_beams": 1,
  "num_return_sequences": 1,
  "typical_p": 1.0,
  "bad_words_ids": null,
  "do_sample": true,
  "temperature": 0.6,
  "top_p": 0.9,
  "suppress_tokens": [3, 0],
  "stop_strings": "</s>",
  "use_cache": true,
  "transformers_version": "4.45.0"
}"#;

/// A vLLM `SamplingParams` request body plus `num_speculative_tokens` from its
/// `speculative_config`.
const VLLM: &str = r#"{
  "temperature": 0.8,
  "top_p": 0.95,
  "top_k": -1,
  "min_p": 0.05,
  "presence_penalty": 0.5,
  "frequency_penalty": 0.25,
  "repetition_penalty": 1.1,
  "logit_bias": {"1734": -5.0, "9906": 2.5, "13": "-inf"},
  "allowed_token_ids": null,
  "seed": 1234,
  "max_tokens": 200,
  "min_tokens": 4,
  "stop": ["\n\nUser:", "Observation:"],
  "stop_token_ids": [128009],
  "include_stop_str_in_output": false,
  "logprobs": 5,
  "num_speculative_tokens": 3
}"#;

fn json<T: DeserializeOwned>(s: &str) -> Result<T, String> {
    serde_json::from_str(s).map_err(|e| e.to_string())
}

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(v: &T) -> String {
    let s = serde_json::to_string(v).unwrap();
    let back: T = serde_json::from_str(&s).unwrap_or_else(|e| panic!("{s}: {e}"));
    assert_eq!(&back, v, "{s}");
    // Through a `serde_json::Value` too (numbers as f64 / u64 / i64).
    let value = serde_json::to_value(v).unwrap();
    let back: T = serde_json::from_value(value).unwrap();
    assert_eq!(&back, v);
    s
}

#[test]
fn hf_generation_config_loads_like_the_builder() {
    let want = GenerationParams::builder()
        .sampling(
            SamplingConfig::builder()
                .temperature(0.7)
                .top_p(0.8)
                .top_k(20)
                .repetition_penalty(1.05)
                .build()
                .unwrap(),
        )
        .stop(StopConditions::eos(151645).with_eos(151643))
        .build()
        .unwrap();
    let got = json::<Lenient<GenerationParams>>(HF_QWEN).unwrap().0;
    assert_eq!(got, want);
    // The same file through the typed path.
    let req = json::<Lenient<RequestConfig>>(HF_QWEN).unwrap().0;
    assert_eq!(req.generation_params().unwrap(), want);
    assert_eq!(GenerationParams::try_from(&req).unwrap(), want);
    assert_eq!(&SamplingConfig::try_from(&req).unwrap(), want.sampling());
    // Strict: the HF keys we do not use are unknown fields.
    let err = json::<GenerationParams>(HF_QWEN).unwrap_err();
    assert!(err.contains("unknown field `bos_token_id`"), "{err}");
}

#[test]
fn hf_llama_style_config_with_neutral_keys_loads_like_the_builder() {
    let want = GenerationParams::builder()
        .sampling(
            SamplingConfig::builder()
                .temperature(0.6)
                .top_p(0.9)
                .banned_tokens([3, 0])
                .build()
                .unwrap(),
        )
        .max_new_tokens(512)
        .min_tokens(4)
        .stop(StopConditions::eos(2).with_stop_string("</s>"))
        .build()
        .unwrap();
    let got = json::<Lenient<GenerationParams>>(HF_LLAMA).unwrap().0;
    assert_eq!(got, want);
    assert_eq!(got.sampling().banned_tokens(), &[0, 3]);
}

#[test]
fn vllm_sampling_params_load_like_the_builder() {
    let sampling = SamplingConfig::builder()
        .temperature(0.8)
        .top_p(0.95)
        .top_k(0)
        .min_p(0.05)
        .presence_penalty(0.5)
        .frequency_penalty(0.25)
        .repetition_penalty(1.1)
        .logit_bias(1734, -5.0)
        .logit_bias(9906, 2.5)
        .logit_bias(13, f32::NEG_INFINITY)
        .logprobs(5)
        .build()
        .unwrap();
    let want = GenerationParams::builder()
        .sampling(sampling)
        .seed(1234)
        .max_new_tokens(200)
        .min_tokens(4)
        .stop(
            StopConditions::default()
                .with_stop_sequence(vec![128009])
                .with_stop_string("\n\nUser:")
                .with_stop_string("Observation:"),
        )
        .draft(DraftLength::Fixed(3))
        .tree(TreeDrafts::Off)
        .build()
        .unwrap();
    let got: GenerationParams = json(VLLM).unwrap();
    assert_eq!(got, want);
    // Lenient changes nothing for a file without HF keys.
    assert_eq!(json::<Lenient<GenerationParams>>(VLLM).unwrap().0, want);
    // The sampling rows alone load into a SamplingConfig.
    let sampling_only = r#"{"temperature": 0.8, "top_p": 0.95, "top_k": -1, "min_p": 0.05,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
        "logit_bias": {"1734": -5.0, "9906": 2.5, "13": "-inf"}, "logprobs": 5}"#;
    assert_eq!(
        &json::<SamplingConfig>(sampling_only).unwrap(),
        want.sampling()
    );
}

#[test]
fn do_sample_and_temperature_combine_as_documented() {
    let t = |s: &str| json::<SamplingConfig>(s).unwrap().temperature();
    assert_eq!(t("{}"), 0.0);
    assert_eq!(t(r#"{"temperature": 0.7}"#), 0.7);
    assert_eq!(t(r#"{"do_sample": true}"#), 1.0);
    assert_eq!(t(r#"{"do_sample": true, "temperature": 0.7}"#), 0.7);
    assert_eq!(t(r#"{"do_sample": true, "temperature": 0}"#), 0.0);
    assert_eq!(t(r#"{"do_sample": false, "temperature": 0.7}"#), 0.0);
    assert_eq!(t(r#"{"do_sample": false}"#), 0.0);
    // `do_sample: false` still checks the temperature it overrides.
    let err = json::<SamplingConfig>(r#"{"do_sample": false, "temperature": -1}"#).unwrap_err();
    assert!(err.contains("temperature"), "{err}");
    // The greedy default equals the builder's.
    assert_eq!(
        json::<SamplingConfig>("{}").unwrap(),
        SamplingConfig::default()
    );
    assert_eq!(
        json::<GenerationParams>("{}").unwrap(),
        GenerationParams::default()
    );
}

#[test]
fn stop_fields_map_to_stop_conditions() {
    let s: StopConditions = json(
        r#"{"eos_token_id": 7, "stop_token_ids": [1, 2], "stop_token_sequences": [[3, 4]],
            "stop": "END", "include_stop_str_in_output": true}"#,
    )
    .unwrap();
    assert_eq!(
        s,
        StopConditions::eos(7)
            .with_stop_sequence(vec![1])
            .with_stop_sequence(vec![2])
            .with_stop_sequence(vec![3, 4])
            .with_stop_string("END")
            .include_stop_string(true)
    );
    // `stop_token_ids` are single-token stops, banned before `min_tokens` like EOS.
    assert_eq!(s.suppressed_ids(), [1, 2, 7]);
}

#[test]
fn c20_a_null_or_absent_seed_means_a_fresh_seed_per_request() {
    for text in [
        r#"{"seed": null, "temperature": 1.0}"#,
        r#"{"temperature": 1.0}"#,
    ] {
        let p: GenerationParams = json(text).unwrap();
        assert_eq!(p.seed(), None, "{text}");
        assert_eq!(p, p.clone().to_builder().seed(None).build().unwrap());
    }
    let p: GenerationParams = json(r#"{"seed": 0}"#).unwrap();
    assert_eq!(p.seed(), Some(0));
    // Round trips keep both forms.
    round_trip(&p);
    round_trip(&GenerationParams::default());
}

#[test]
fn empty_stops_are_refused_the_same_way_from_serde_and_the_builder() {
    // serde refuses them while loading.
    invalid_value(r#"{"stop": [""]}"#, "stop");
    invalid_value(r#"{"stop_token_sequences": [[]]}"#, "stop_token_sequences");
    // The builder and the public fields: refused when the parameters are built.
    let mut fields = StopConditions::default();
    fields.stop_sequences = vec![vec![]];
    for stop in [
        StopConditions::default().with_stop_string(""),
        StopConditions::default().with_stop_sequence(vec![]),
        fields,
    ] {
        let err = GenerationParams::greedy(4)
            .with_stop(stop.clone())
            .unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
        let built = GenerationParams::builder().stop(stop).build();
        let err = built.unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
    }
}

#[test]
fn draft_length_names() {
    assert_eq!(json::<DraftLength>("{}").unwrap(), DraftLength::Fixed(4));
    assert_eq!(
        json::<DraftLength>(r#"{"num_speculative_tokens": 0}"#).unwrap(),
        DraftLength::Off
    );
    assert_eq!(
        json::<DraftLength>(r#"{"num_speculative_tokens": 6}"#).unwrap(),
        DraftLength::Fixed(6)
    );
    assert_eq!(
        json::<DraftLength>(r#"{"adaptive_draft": {"max_draft": 5}}"#).unwrap(),
        DraftLength::Adaptive(AdaptiveConfig::default().with_max_draft(5))
    );
    // Fixed(0) acts as Off and is written as 0, which loads as Off.
    let s = serde_json::to_string(&DraftLength::Fixed(0)).unwrap();
    assert_eq!(s, r#"{"num_speculative_tokens":0}"#);
    assert_eq!(json::<DraftLength>(&s).unwrap(), DraftLength::Off);
}

#[test]
fn proposer_configs_load_with_vllm_names() {
    let cfg: PromptLookupConfig =
        json(r#"{"prompt_lookup_min": 2, "prompt_lookup_max": 5}"#).unwrap();
    assert_eq!(
        cfg,
        PromptLookupConfig::default()
            .with_min_n(2)
            .with_max_n(5)
            .with_periodic(false)
    );
    let p = PromptLookup::from_config(cfg).unwrap();
    assert_eq!((p.min_n(), p.max_n(), p.is_periodic()), (2, 5, false));
    assert_eq!(p.config(), cfg);
    let aliases: PromptLookupConfig =
        json(r#"{"min_n": 2, "max_n": 5, "periodic": true}"#).unwrap();
    assert_eq!(aliases, cfg.with_periodic(true));
    assert_eq!(
        json::<PromptLookupConfig>("{}").unwrap(),
        PromptLookupConfig::default()
    );
    let s: SuffixConfig =
        json(r#"{"suffix_decoding_max_tree_depth": 32, "min_confidence": 0.2}"#).unwrap();
    assert_eq!(
        s,
        SuffixConfig::default()
            .with_max_depth(32)
            .with_min_confidence(0.2)
    );
}

// ---------------------------------------------------------------------------------------------
// Every invalid field: a typed error through RequestConfig, and a load error naming the field.
// ---------------------------------------------------------------------------------------------

/// The typed error of `generation_params` on `json` (which must parse as a `RequestConfig`).
fn typed(json_text: &str) -> Error {
    let req: RequestConfig = json(json_text).unwrap();
    req.generation_params()
        .expect_err("the value is out of range")
}

/// Asserts `json_text` fails to load as `GenerationParams` with `InvalidConfig { field }`
/// through `RequestConfig`, and with a message naming the field through serde.
fn invalid_value(json_text: &str, field: &str) {
    match typed(json_text) {
        Error::InvalidConfig { field: f, .. } => assert_eq!(f, field, "{json_text}"),
        other => panic!("{json_text}: {other:?}"),
    }
    invalid_load::<GenerationParams>(json_text, field);
}

/// Asserts `json_text` fails to load as `T` with a message naming `field`.
fn invalid_load<T: DeserializeOwned + std::fmt::Debug>(json_text: &str, field: &str) {
    let err = json::<T>(json_text).unwrap_err();
    assert!(err.contains(field), "{json_text}: {err}");
}

#[test]
fn invalid_temperature() {
    invalid_value(r#"{"temperature": -0.5}"#, "temperature");
    // Beyond the f32 range: an error naming the field, whether the format refuses the number
    // or rounds it to infinity.
    invalid_load::<GenerationParams>(r#"{"temperature": 1e39}"#, "temperature");
    invalid_load::<GenerationParams>(r#"{"temperature": "hot"}"#, "temperature");
}

#[test]
fn invalid_top_k() {
    invalid_value(r#"{"top_k": -2}"#, "top_k");
    invalid_load::<GenerationParams>(r#"{"top_k": 2.5}"#, "top_k");
}

#[test]
fn invalid_top_p() {
    invalid_value(r#"{"top_p": 0}"#, "top_p");
    invalid_value(r#"{"top_p": 1.5}"#, "top_p");
}

#[test]
fn invalid_min_p() {
    invalid_value(r#"{"min_p": -0.1}"#, "min_p");
    invalid_value(r#"{"min_p": 2}"#, "min_p");
}

#[test]
fn invalid_repetition_penalty() {
    invalid_value(r#"{"repetition_penalty": 0}"#, "repetition_penalty");
}

#[test]
fn invalid_frequency_penalty() {
    // JSON has no infinity: a number beyond the f32 range fails the load naming the field
    // (serde_json refuses it, or rounds it to infinity, which the builder refuses) ...
    invalid_load::<GenerationParams>(r#"{"frequency_penalty": 1e39}"#, "frequency_penalty");
    // ... and an infinite value set in code is the typed error.
    let req = RequestConfig {
        frequency_penalty: Some(f32::INFINITY),
        ..RequestConfig::default()
    };
    assert!(matches!(
        req.sampling_config(),
        Err(Error::InvalidConfig {
            field: "frequency_penalty",
            ..
        })
    ));
}

#[test]
fn invalid_presence_penalty() {
    invalid_load::<GenerationParams>(r#"{"presence_penalty": -1e39}"#, "presence_penalty");
    let req = RequestConfig {
        presence_penalty: Some(f32::NEG_INFINITY),
        ..RequestConfig::default()
    };
    assert!(matches!(
        req.sampling_config(),
        Err(Error::InvalidConfig {
            field: "presence_penalty",
            ..
        })
    ));
}

#[test]
fn invalid_penalty_scope() {
    invalid_load::<GenerationParams>(r#"{"penalty_scope": "prompt"}"#, "penalty_scope");
}

#[test]
fn invalid_logit_bias() {
    invalid_load::<GenerationParams>(r#"{"logit_bias": {"5": 1e39}}"#, "logit_bias");
    let req = RequestConfig {
        logit_bias: Some([(5, f32::NAN)].into_iter().collect()),
        ..RequestConfig::default()
    };
    assert!(matches!(
        req.sampling_config(),
        Err(Error::InvalidConfig {
            field: "logit_bias",
            ..
        })
    ));
    invalid_load::<GenerationParams>(r#"{"logit_bias": {"five": 1.0}}"#, "logit_bias");
    invalid_load::<GenerationParams>(r#"{"logit_bias": {"5": "+inf"}}"#, "logit_bias");
    invalid_load::<GenerationParams>(r#"{"logit_bias": {"-1": 1.0}}"#, "logit_bias");
}

#[test]
fn invalid_allowed_token_ids() {
    invalid_value(r#"{"allowed_token_ids": []}"#, "allowed_token_ids");
    invalid_load::<GenerationParams>(r#"{"allowed_token_ids": [-1]}"#, "allowed_token_ids");
}

#[test]
fn invalid_banned_token_ids() {
    invalid_load::<GenerationParams>(r#"{"banned_token_ids": [1.5]}"#, "banned_token_ids");
    // The HF alias reports the field's name.
    invalid_load::<GenerationParams>(r#"{"suppress_tokens": "x"}"#, "banned_token_ids");
}

#[test]
fn invalid_logprobs() {
    invalid_load::<GenerationParams>(r#"{"logprobs": -1}"#, "logprobs");
}

#[test]
fn invalid_seed() {
    invalid_load::<GenerationParams>(r#"{"seed": -1}"#, "seed");
    invalid_load::<GenerationParams>(r#"{"seed": "42"}"#, "seed");
}

#[test]
fn invalid_max_new_tokens() {
    invalid_load::<GenerationParams>(r#"{"max_new_tokens": -5}"#, "max_new_tokens");
    invalid_load::<GenerationParams>(r#"{"max_tokens": 1.5}"#, "max_new_tokens");
}

#[test]
fn invalid_min_tokens() {
    invalid_value(r#"{"min_tokens": 10, "max_tokens": 5}"#, "min_tokens");
    invalid_value(r#"{"min_new_tokens": 300}"#, "min_tokens");
}

#[test]
fn invalid_stop() {
    invalid_value(r#"{"stop": ["ok", ""]}"#, "stop");
    invalid_value(r#"{"stop": ""}"#, "stop");
    invalid_load::<GenerationParams>(r#"{"stop": 5}"#, "stop");
}

#[test]
fn invalid_stop_token_ids() {
    invalid_load::<GenerationParams>(r#"{"stop_token_ids": ["a"]}"#, "stop_token_ids");
}

#[test]
fn invalid_stop_token_sequences() {
    invalid_value(
        r#"{"stop_token_sequences": [[1, 2], []]}"#,
        "stop_token_sequences",
    );
    invalid_load::<GenerationParams>(
        r#"{"stop_token_sequences": [1, 2]}"#,
        "stop_token_sequences",
    );
}

#[test]
fn invalid_eos_token_id() {
    invalid_load::<GenerationParams>(r#"{"eos_token_id": -2}"#, "eos_token_id");
    invalid_load::<GenerationParams>(r#"{"eos_token_id": [1, "x"]}"#, "eos_token_id");
    invalid_load::<GenerationParams>(r#"{"eos_token_id": 4294967296}"#, "eos_token_id");
}

#[test]
fn invalid_include_stop_str_in_output() {
    invalid_load::<GenerationParams>(
        r#"{"include_stop_str_in_output": "yes"}"#,
        "include_stop_str_in_output",
    );
}

#[test]
fn invalid_do_sample() {
    invalid_load::<GenerationParams>(r#"{"do_sample": 1}"#, "do_sample");
}

#[test]
fn invalid_num_speculative_tokens() {
    invalid_load::<GenerationParams>(
        r#"{"num_speculative_tokens": -1}"#,
        "num_speculative_tokens",
    );
}

#[test]
fn invalid_adaptive_draft() {
    invalid_value(
        r#"{"num_speculative_tokens": 3, "adaptive_draft": {}}"#,
        "adaptive_draft",
    );
    // The fields of AdaptiveConfig, named by AdaptiveConfig::validate.
    invalid_load::<GenerationParams>(r#"{"adaptive_draft": {"decay": 0}}"#, "decay");
    invalid_load::<AdaptiveConfig>(r#"{"decay": 1.5}"#, "decay");
    invalid_load::<AdaptiveConfig>(r#"{"time_smoothing": 0}"#, "time_smoothing");
    invalid_load::<AdaptiveConfig>(r#"{"probe_interval": 0}"#, "probe_interval");
    invalid_load::<AdaptiveConfig>(r#"{"max_draft": -1}"#, "max_draft");
    invalid_load::<AdaptiveConfig>(r#"{"probe_draft": "2"}"#, "probe_draft");
    invalid_load::<AdaptiveConfig>(r#"{"max_probe_interval": 0.5}"#, "max_probe_interval");
    invalid_load::<AdaptiveConfig>(r#"{"probe_budget": 0}"#, "probe_budget");
    invalid_load::<AdaptiveConfig>(r#"{"request_probe_budget": 1.5}"#, "request_probe_budget");
    // AdaptiveConfig validates while loading, so the typed error comes from a RequestConfig
    // built in code: AdaptiveConfig::validate's.
    let req = RequestConfig {
        adaptive_draft: Some(AdaptiveConfig::default().with_decay(0.0)),
        ..RequestConfig::default()
    };
    assert!(matches!(
        req.draft_length(),
        Err(Error::InvalidConfig { field: "decay", .. })
    ));
}

#[test]
fn invalid_prompt_lookup_fields() {
    invalid_load::<PromptLookupConfig>(r#"{"prompt_lookup_min": 0}"#, "prompt_lookup_min");
    invalid_load::<PromptLookupConfig>(
        r#"{"prompt_lookup_min": 3, "prompt_lookup_max": 2}"#,
        "prompt_lookup_max",
    );
    invalid_load::<PromptLookupConfig>(r#"{"prompt_lookup_max": 65}"#, "prompt_lookup_max");
    invalid_load::<PromptLookupConfig>(r#"{"periodic": "no"}"#, "periodic");
    let bad = PromptLookupConfig::default().with_min_n(0);
    assert!(matches!(
        PromptLookup::from_config(bad),
        Err(Error::InvalidConfig { field: "min_n", .. })
    ));
}

#[test]
fn invalid_suffix_fields() {
    invalid_load::<SuffixConfig>(r#"{"max_depth": 1}"#, "max_depth");
    invalid_load::<SuffixConfig>(r#"{"max_match_len": 24}"#, "max_match_len");
    invalid_load::<SuffixConfig>(r#"{"min_confidence": 1.5}"#, "min_confidence");
    invalid_load::<SuffixConfig>(r#"{"max_corpus_tokens": 1000000000}"#, "max_corpus_tokens");
    invalid_load::<SuffixConfig>(r#"{"corpus_outputs_only": 1}"#, "corpus_outputs_only");
}

// ---------------------------------------------------------------------------------------------
// Unknown fields.
// ---------------------------------------------------------------------------------------------

#[test]
fn unknown_fields_are_rejected() {
    invalid_load::<GenerationParams>(r#"{"top_pp": 0.9}"#, "unknown field `top_pp`");
    invalid_load::<RequestConfig>(r#"{"ignore_eos": true}"#, "unknown field `ignore_eos`");
    // A type takes only its own rows.
    invalid_load::<SamplingConfig>(r#"{"temperature": 1, "seed": 3}"#, "unknown field `seed`");
    invalid_load::<SamplingConfig>(r#"{"max_tokens": 3}"#, "unknown field `max_new_tokens`");
    invalid_load::<StopConditions>(r#"{"temperature": 1}"#, "unknown field `temperature`");
    invalid_load::<DraftLength>(r#"{"seed": 1}"#, "unknown field `seed`");
    // The field's old name is no longer accepted.
    invalid_load::<AdaptiveConfig>(r#"{"max_k": 4}"#, "unknown field `max_k`");
    invalid_load::<SuffixConfig>(r#"{"depth": 4}"#, "unknown field `depth`");
    invalid_load::<PromptLookupConfig>(r#"{"method": "ngram"}"#, "unknown field `method`");
    invalid_load::<PenaltyScope>(r#""prompt""#, "unknown variant `prompt`");
    // Nested objects are strict too.
    invalid_load::<GenerationParams>(
        r#"{"adaptive_draft": {"max_draft": 4, "speed": 2}}"#,
        "unknown field `speed`",
    );
}

#[test]
fn lenient_skips_only_the_documented_hf_keys() {
    // Unknown keys that are not HF's are still rejected.
    invalid_load::<Lenient<GenerationParams>>(
        r#"{"transformers_version": "4", "top_pp": 0.9}"#,
        "unknown field `top_pp`",
    );
    // Neutral keys at another value are errors naming the key.
    invalid_load::<Lenient<GenerationParams>>(r#"{"num_beams": 4}"#, "num_beams = 4");
    invalid_load::<Lenient<GenerationParams>>(r#"{"typical_p": 0.9}"#, "typical_p = 0.9");
    invalid_load::<Lenient<GenerationParams>>(
        r#"{"bad_words_ids": [[5, 6]]}"#,
        "bad_words_ids = a list of 1",
    );
    // Nested objects are not filtered.
    invalid_load::<Lenient<GenerationParams>>(
        r#"{"adaptive_draft": {"transformers_version": "4"}}"#,
        "unknown field `transformers_version`",
    );
    // Values inside skipped keys may be any JSON.
    let p = json::<Lenient<GenerationParams>>(
        r#"{"cache_implementation": {"a": [1, {"b": null}]}, "num_beams": null, "seed": 3}"#,
    )
    .unwrap()
    .into_inner();
    assert_eq!(p.seed(), Some(3));
}

// ---------------------------------------------------------------------------------------------
// Round trips.
// ---------------------------------------------------------------------------------------------

fn full_sampling() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(0.85)
        .top_k(40)
        .top_p(0.93)
        .min_p(0.02)
        .repetition_penalty(1.15)
        .frequency_penalty(-0.4)
        .presence_penalty(0.6)
        .penalty_scope(PenaltyScope::WholeContext)
        .logit_bias(7, 1.25)
        .logit_bias(3, f32::NEG_INFINITY)
        .allowed_tokens([1, 3, 7, 9, 11])
        .banned_tokens([9])
        .logprobs(0)
        .build()
        .unwrap()
}

#[test]
fn sampling_config_round_trips() {
    round_trip(&SamplingConfig::greedy());
    round_trip(&SamplingConfig::sampling(1.3).unwrap());
    let s = round_trip(&full_sampling());
    assert!(s.contains(r#""3":"-inf""#), "{s}");
    assert!(s.contains(r#""penalty_scope":"whole_context""#), "{s}");
    assert!(!s.contains("do_sample"), "{s}");
}

#[test]
fn generation_params_round_trip() {
    let mut p = GenerationParams::sampled(full_sampling(), 77, 300)
        .with_min_tokens(5)
        .unwrap()
        .with_stop(
            StopConditions::eos(2)
                .with_eos(5)
                .with_stop_sequence(vec![4])
                .with_stop_sequence(vec![8, 9, 10])
                .with_stop_string("\n\n")
                .include_stop_string(true),
        )
        .unwrap();
    round_trip(&p);
    for draft in [
        DraftLength::Off,
        DraftLength::Fixed(7),
        DraftLength::Adaptive(
            AdaptiveConfig::default()
                .with_max_draft(6)
                .with_decay(0.9)
                .with_time_smoothing(0.5)
                .with_probe_interval(8)
                .with_max_probe_interval(64)
                .with_probe_draft(1)
                .with_request_probe_budget(0.05),
        ),
    ] {
        p = p.with_draft(draft.clone());
        round_trip(&p);
        round_trip(&draft);
    }
    round_trip(&GenerationParams::default());
    round_trip(&StopConditions::default());
    round_trip(p.stop());
    round_trip(&AdaptiveConfig::default());
    round_trip(
        &SuffixConfig::default()
            .with_max_depth(40)
            .with_max_match_len(20)
            .with_min_confidence(0.35)
            .with_max_corpus_tokens(1000)
            .with_corpus_outputs_only(false),
    );
    round_trip(
        &PromptLookupConfig::default()
            .with_min_n(2)
            .with_max_n(7)
            .with_periodic(true),
    );
    round_trip(&PenaltyScope::Generated);
    round_trip(&PenaltyScope::WholeContext);
}

#[test]
fn runtime_only_fields_are_skipped() {
    let mask: Arc<dyn speculative::TokenMask> = Arc::new(|_: &[u32], _: &mut [f32]| {});
    let sampling = full_sampling()
        .to_builder()
        .mask(mask.clone())
        .build()
        .unwrap();
    let p = GenerationParams::sampled(sampling.clone(), 1, 10)
        .with_cancel(Arc::new(AtomicBool::new(false)));
    let s = serde_json::to_string(&p).unwrap();
    let back: GenerationParams = serde_json::from_str(&s).unwrap();
    assert!(back.cancel().is_none() && back.sampling().mask().is_none());
    assert_ne!(back, p);
    // Re-attaching the same mask and flag gives back an equal value.
    let again = back
        .to_builder()
        .sampling(back.sampling().to_builder().mask(mask).build().unwrap())
        .cancel(p.cancel().cloned())
        .build()
        .unwrap();
    assert_eq!(again, p);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any valid configuration comes back equal from JSON.
    #[test]
    fn any_valid_config_round_trips(
        temperature in prop_oneof![Just(0.0f32), 1e-6f32..4.0],
        top_k in 0usize..100,
        top_p in prop_oneof![Just(1.0f32), 0.01f32..1.0],
        min_p in 0.0f32..=1.0,
        repetition_penalty in 0.01f32..5.0,
        frequency_penalty in -2.0f32..2.0,
        presence_penalty in -2.0f32..2.0,
        whole in any::<bool>(),
        bias in proptest::collection::vec((0u32..1000, prop_oneof![Just(f32::NEG_INFINITY), -100.0f32..100.0]), 0..6),
        allowed in proptest::option::of(proptest::collection::vec(0u32..1000, 1..6)),
        banned in proptest::collection::vec(0u32..1000, 0..6),
        logprobs in proptest::option::of(0usize..20),
        seed in any::<u64>(),
        max_new_tokens in 0usize..100_000,
        min_frac in 0.0f64..=1.0,
        eos in proptest::collection::vec(any::<u32>(), 0..3),
        seqs in proptest::collection::vec(proptest::collection::vec(any::<u32>(), 1..4), 0..3),
        strings in proptest::collection::vec("[a-z\\n ]{1,6}", 0..3),
        include in any::<bool>(),
        draft in prop_oneof![
            Just(DraftLength::Off),
            (1usize..64).prop_map(DraftLength::Fixed),
            (0usize..16, 0.01f64..=1.0, 0.01f64..=1.0, 1usize..100).prop_map(|(m, d, t, i)| {
                DraftLength::Adaptive(AdaptiveConfig::default().with_max_draft(m).with_decay(d).with_time_smoothing(t).with_probe_interval(i))
            }),
        ],
    ) {
        let mut b = SamplingConfig::builder()
            .temperature(temperature)
            .top_k(top_k)
            .top_p(top_p)
            .min_p(min_p)
            .repetition_penalty(repetition_penalty)
            .frequency_penalty(frequency_penalty)
            .presence_penalty(presence_penalty)
            .penalty_scope(if whole { PenaltyScope::WholeContext } else { PenaltyScope::Generated })
            .banned_tokens(banned);
        for (t, v) in bias {
            b = b.logit_bias(t, v);
        }
        if let Some(a) = allowed {
            b = b.allowed_tokens(a);
        }
        if let Some(n) = logprobs {
            b = b.logprobs(n);
        }
        let sampling = b.build().unwrap();
        let mut stop = StopConditions::default().include_stop_string(include);
        stop.eos = eos;
        stop.stop_sequences = seqs;
        stop.stop_strings = strings;
        let p = GenerationParams::builder()
            .sampling(sampling)
            .seed(seed)
            .max_new_tokens(max_new_tokens)
            .min_tokens((max_new_tokens as f64 * min_frac) as usize)
            .stop(stop)
            .draft(draft)
            .tree(TreeDrafts::nodes((seed % 3) as usize * 16).with_branch((seed % 5) as usize))
            .build()
            .unwrap();
        let s = serde_json::to_string(&p).unwrap();
        let back: GenerationParams = serde_json::from_str(&s).unwrap();
        prop_assert_eq!(&back, &p);
        let sampling_back: SamplingConfig =
            serde_json::from_str(&serde_json::to_string(&p.sampling()).unwrap()).unwrap();
        prop_assert_eq!(&sampling_back, p.sampling());
    }
}
