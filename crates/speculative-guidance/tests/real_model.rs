//! Structured output on the real model (needs `models/SmolLM2-135M-Instruct.Q4_1.gguf`; run
//! `scripts/fetch-model.sh` first): 20 requests (10 greedy, 10 sampled) over three JSON
//! schemas all end at EOS with JSON that validates against the request's schema, and greedy
//! constrained speculative decoding (grammar-forced drafts + prompt lookup, + suffix, chains
//! and trees) gives plain constrained greedy output token for token.

use std::sync::{Arc, OnceLock};

use serde_json::{Value, json};
use speculative::decode::{
    DraftLength, FinishReason, GenerationParams, Generator, StopConditions, TreeDrafts,
};
use speculative::propose::{PromptLookup, SuffixConfig, SuffixProposer};
use speculative::{Proposer, SamplingConfig};
use speculative_candle::{
    ChatMessage, FastFormat, FastTarget, FastWeights, GgufTokenizer, default_model_path,
};
use speculative_guidance::{ForcedDrafts, GrammarMask, Vocabulary};

fn weights() -> Arc<FastWeights> {
    static W: OnceLock<Arc<FastWeights>> = OnceLock::new();
    W.get_or_init(|| {
        let p = default_model_path();
        assert!(
            p.is_file(),
            "model file {} is missing: run `scripts/fetch-model.sh`",
            p.display()
        );
        FastWeights::load(p, FastFormat::Q8).expect("loading the model")
    })
    .clone()
}

fn tokenizer() -> &'static GgufTokenizer {
    static TOK: OnceLock<GgufTokenizer> = OnceLock::new();
    TOK.get_or_init(|| GgufTokenizer::load(default_model_path()).expect("loading the tokenizer"))
}

fn vocab() -> &'static Vocabulary {
    static V: OnceLock<Vocabulary> = OnceLock::new();
    V.get_or_init(|| {
        let tok = tokenizer();
        let n = tok.vocab_size() as u32;
        let bytes = (0..n)
            .map(|i| tok.token_bytes(i).unwrap().to_vec())
            .collect();
        let special = (0..n).map(|i| tok.is_special(i)).collect();
        Vocabulary::with_tokenizer(bytes, special, tok.eos_id(), tok.tokenizer().clone()).unwrap()
    })
}

fn chat(question: &str) -> Vec<u32> {
    let tok = tokenizer();
    let text = tok
        .apply_chat_template(&[
            ChatMessage::system("You answer with a single JSON object."),
            ChatMessage::user(question),
        ])
        .unwrap();
    tok.encode(&text).unwrap()
}

fn schemas() -> Vec<Value> {
    vec![
        json!({
            "type": "object",
            "properties": {
                "name": {"enum": ["get_weather", "search_web", "send_email"]},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "maxLength": 24},
                        "urgent": {"type": "boolean"}
                    },
                    "required": ["query", "urgent"],
                    "additionalProperties": false
                }
            },
            "required": ["name", "arguments"],
            "additionalProperties": false
        }),
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": {"type": "string", "maxLength": 16}
            },
            "required": ["name", "age", "city"],
            "additionalProperties": false
        }),
        json!({
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "title": {"type": "string", "maxLength": 12},
                            "done": {"type": "boolean"}
                        },
                        "required": ["title", "done"],
                        "additionalProperties": false
                    }
                }
            },
            "required": ["items"],
            "additionalProperties": false
        }),
    ]
}

/// `(question, schema index)`.
const REQUESTS: [(&str, usize); 10] = [
    ("Call a tool to find the weather in Paris.", 0),
    ("Call a tool to email Bob that the meeting moved.", 0),
    ("Call a tool to search the web for rust tutorials.", 0),
    ("Alice is 31 and lives in Berlin. Extract her details.", 1),
    ("Extract the person: Tom Baker, aged 45, from Leeds.", 1),
    ("My grandmother Rosa turned 88; she lives in Naples.", 1),
    ("List my tasks: buy milk (done), call mom (not done).", 2),
    ("Make a to-do list for a trip to the beach.", 2),
    ("List three chores, none of them done yet.", 2),
    ("Call a tool to find the weather in Tokyo, urgently.", 0),
];

/// A small validator for the schema keywords used here: type, enum, properties, required,
/// additionalProperties: false, maxLength, minItems / maxItems, minimum / maximum.
fn validate(v: &Value, s: &Value) -> Result<(), String> {
    if let Some(e) = s.get("enum") {
        return if e.as_array().unwrap().contains(v) {
            Ok(())
        } else {
            Err(format!("{v} not in {e}"))
        };
    }
    match s["type"].as_str().unwrap() {
        "object" => {
            let o = v.as_object().ok_or(format!("{v} is not an object"))?;
            let props = s["properties"].as_object().unwrap();
            for r in s["required"].as_array().unwrap() {
                if !o.contains_key(r.as_str().unwrap()) {
                    return Err(format!("missing {r}"));
                }
            }
            for (k, x) in o {
                let ps = props.get(k).ok_or(format!("extra property {k}"))?;
                validate(x, ps)?;
            }
            Ok(())
        }
        "array" => {
            let a = v.as_array().ok_or(format!("{v} is not an array"))?;
            let n = a.len() as u64;
            if n < s["minItems"].as_u64().unwrap_or(0)
                || n > s["maxItems"].as_u64().unwrap_or(u64::MAX)
            {
                return Err(format!("{n} items"));
            }
            a.iter().try_for_each(|x| validate(x, &s["items"]))
        }
        "string" => {
            let t = v.as_str().ok_or(format!("{v} is not a string"))?;
            let max = s["maxLength"].as_u64().unwrap_or(u64::MAX);
            if t.chars().count() as u64 > max {
                return Err(format!("{t:?} longer than {max}"));
            }
            Ok(())
        }
        "integer" => {
            let i = v.as_i64().ok_or(format!("{v} is not an integer"))?;
            if i < s["minimum"].as_i64().unwrap_or(i64::MIN)
                || i > s["maximum"].as_i64().unwrap_or(i64::MAX)
            {
                return Err(format!("{i} out of range"));
            }
            Ok(())
        }
        "boolean" => v.as_bool().map(|_| ()).ok_or(format!("{v} is not a bool")),
        t => Err(format!("type {t} not handled")),
    }
}

fn params(mask: Arc<GrammarMask>, temperature: f32, seed: u64) -> GenerationParams {
    let sampling = SamplingConfig::builder()
        .temperature(temperature)
        .mask(mask)
        .build()
        .unwrap();
    GenerationParams::builder()
        .sampling(sampling)
        .seed(seed)
        .max_new_tokens(160)
        .draft(DraftLength::Fixed(8))
        .stop(StopConditions::eos(tokenizer().eos_id()))
        .build()
        .unwrap()
}

/// Checks that `tokens` end at EOS and spell JSON valid against `schema`; returns the text.
fn check_output(tokens: &[u32], finish: FinishReason, schema: &Value, what: &str) -> String {
    let eos = tokenizer().eos_id();
    assert_eq!(tokens.last(), Some(&eos), "{what}: no EOS at the end");
    assert_eq!(finish, FinishReason::Eos, "{what}");
    let text = tokenizer()
        .decode(&tokens[..tokens.len() - 1], false)
        .unwrap();
    let v: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: {text:?} is not JSON: {e}"));
    validate(&v, schema).unwrap_or_else(|e| panic!("{what}: {text} fails its schema: {e}"));
    text
}

#[test]
fn constrained_outputs_validate_and_speculation_keeps_greedy_output() {
    let w = weights();
    let schemas = schemas();
    let mut forced_total = 0u64;
    for (i, &(q, si)) in REQUESTS.iter().enumerate() {
        let schema = &schemas[si];
        let prompt = chat(q);
        let new_mask =
            || Arc::new(GrammarMask::json_schema(vocab(), schema, prompt.len()).unwrap());
        // Plain constrained greedy.
        let plain_params = params(new_mask(), 0.0, 0).with_draft(DraftLength::Off);
        let mut plain = Generator::new(FastTarget::new(w.clone()), speculative::NoProposer);
        let want = plain.generate(&prompt, &plain_params).unwrap();
        let text = check_output(&want.tokens, want.finish, schema, q);
        // Speculative constrained greedy: forced drafts + prompt lookup (chain), + suffix (tree).
        let m = new_mask();
        let mut g = Generator::new(
            FastTarget::new(w.clone()),
            ForcedDrafts::new(m.clone(), PromptLookup::new(1, 4).unwrap()),
        );
        let out = g.generate(&prompt, &params(m.clone(), 0.0, 0)).unwrap();
        assert_eq!(
            out.tokens, want.tokens,
            "forced + prompt lookup differs on {q:?}"
        );
        assert_eq!(m.fault(), None, "llguidance failed on {q:?}");
        forced_total += g.proposer().proposed_forced();
        println!(
            "{q:?}: {text} ({} tokens; plain {} calls, speculative {} calls, accepted length {:.2})",
            want.tokens.len(),
            want.metrics.target_calls,
            out.metrics.target_calls,
            out.metrics.mean_accepted_length()
        );
        if i % 3 == 0 {
            let m = new_mask();
            let mut g = Generator::new(
                FastTarget::new(w.clone()),
                ForcedDrafts::new(
                    m.clone(),
                    SuffixProposer::new(SuffixConfig::default()).unwrap(),
                ),
            );
            let p = params(m, 0.0, 0).with_tree(TreeDrafts::nodes(16));
            let out = g.generate(&prompt, &p).unwrap();
            assert_eq!(
                out.tokens, want.tokens,
                "forced + suffix tree differs on {q:?}"
            );
        }
    }
    assert!(forced_total > 0, "the schemas force keys and braces");
}

#[test]
fn sampled_constrained_outputs_validate() {
    let w = weights();
    let schemas = schemas();
    for (i, &(q, si)) in REQUESTS.iter().enumerate() {
        let schema = &schemas[si];
        let prompt = chat(q);
        let m = Arc::new(GrammarMask::json_schema(vocab(), schema, prompt.len()).unwrap());
        let p: Box<dyn Proposer> = Box::new(ForcedDrafts::new(
            m.clone(),
            PromptLookup::new(1, 4).unwrap(),
        ));
        let mut g = Generator::new(FastTarget::new(w.clone()), p);
        let out = g
            .generate(&prompt, &params(m, 0.8, 1000 + i as u64))
            .unwrap();
        let text = check_output(&out.tokens, out.finish, schema, q);
        println!("sampled {q:?}: {text}");
    }
}
