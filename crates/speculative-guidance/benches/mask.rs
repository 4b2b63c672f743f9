//! Cost of the grammar mask per row on the real vocabulary (SmolLM2-135M, 49,152 tokens; needs
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf`), against the cost of processing the same row
//! without a mask.
//!
//! A JSON answer of a tool-call schema (`ANSWER`, 30-odd tokens) is fed row by row:
//!
//! - `mask_computed`: the cache emptied first, every row's allowed set computed by llguidance
//!   (advancing the matcher by one token, the token mask, the `-inf` fill of the row): the
//!   cost of a target row at a new prefix; divided by the number of rows (printed);
//! - `mask_cached`: the same rows served from the cache (a draft row, or a target row at a
//!   prefix already masked in the step): the `-inf` fill alone;
//! - `argmax_plain` / `argmax_masked`: the processor's greedy decision of one row (`[49152]`
//!   logits) without and with the mask (cached): what the verifier pays per row.
//!
//! `cargo bench -p speculative-guidance --bench mask`.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use speculative::sampling::{History, RowProcessor};
use speculative::{RowKind, SamplingConfig, TokenMask};
use speculative_candle::{GgufTokenizer, default_model_path};
use speculative_guidance::{GrammarMask, Vocabulary};

const SCHEMA: &str = r#"{"type":"object","properties":{"name":{"enum":["get_weather","search_web","send_email"]},"arguments":{"type":"object","properties":{"city":{"type":"string","maxLength":24},"unit":{"enum":["celsius","fahrenheit"]},"days":{"type":"integer","minimum":1,"maximum":7}},"required":["city","unit","days"],"additionalProperties":false}},"required":["name","arguments"],"additionalProperties":false}"#;
const ANSWER: &str =
    r#"{"name":"get_weather","arguments":{"city":"San Francisco","unit":"celsius","days":3}}"#;

fn bench(c: &mut Criterion) {
    let tok = GgufTokenizer::load(default_model_path()).expect("the model file");
    let n = tok.vocab_size() as u32;
    let bytes = (0..n)
        .map(|i| tok.token_bytes(i).unwrap().to_vec())
        .collect();
    let special = (0..n).map(|i| tok.is_special(i)).collect();
    let vocab =
        Vocabulary::with_tokenizer(bytes, special, tok.eos_id(), tok.tokenizer().clone()).unwrap();
    let answer = tok.encode(ANSWER).unwrap();
    let prompt = tok
        .encode("<|im_start|>user\nweather?<|im_end|>\n")
        .unwrap();
    let mask = Arc::new(
        GrammarMask::new(
            &vocab,
            &speculative_guidance::Grammar::json_schema_str(SCHEMA).unwrap(),
            prompt.len(),
        )
        .unwrap(),
    );
    let prefixes: Vec<Vec<u32>> = (0..=answer.len())
        .map(|i| [&prompt[..], &answer[..i]].concat())
        .collect();
    // Every prefix of the answer must be allowed by the grammar.
    for (i, p) in prefixes.iter().enumerate().skip(1) {
        let prev = &prefixes[i - 1];
        assert!(
            mask.allowed(prev).unwrap().contains(&p[p.len() - 1]),
            "token {i} of the answer is not allowed"
        );
    }
    eprintln!("rows per iteration: {}", prefixes.len());
    let logits: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 100.0).collect();
    let mut row = logits.clone();
    let mut g = c.benchmark_group("mask_v49152");
    g.bench_function("mask_computed", |b| {
        b.iter(|| {
            mask.clear_cache();
            for p in &prefixes {
                row.copy_from_slice(&logits);
                mask.apply(p, &mut row);
            }
            black_box(&row);
        })
    });
    g.bench_function("mask_cached", |b| {
        b.iter(|| {
            for p in &prefixes {
                row.copy_from_slice(&logits);
                mask.apply(p, &mut row);
            }
            black_box(&row);
        })
    });
    let plain = SamplingConfig::greedy();
    let masked = SamplingConfig::builder()
        .mask(mask.clone())
        .build()
        .unwrap();
    let mut proc = RowProcessor::new();
    for (name, cfg) in [("argmax_plain", &plain), ("argmax_masked", &masked)] {
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut s = 0u32;
                for p in &prefixes {
                    let h = History {
                        counts: None,
                        prefix: p,
                        suppress: &[],
                    };
                    s ^= proc.argmax(cfg, &logits, &h, RowKind::Target, 0).unwrap();
                }
                black_box(s)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
