//! Real-model tests of the forward pass (need `models/SmolLM2-135M-Instruct.Q4_1.gguf`; run
//! `scripts/fetch-model.sh` first).

mod common;

use common::{argmax, tokenizer, weights};
use speculative::{HiddenStates, TargetModel};
use speculative_candle::{CandleError, CandleTarget, ChatMessage, WeightFormat};

fn prompt_tokens() -> Vec<u32> {
    let tok = tokenizer();
    let text = tok
        .apply_chat_template(&[ChatMessage::user(
            "Write a short poem about the sea, the wind and the old lighthouse keeper.",
        )])
        .unwrap();
    tok.encode(&text).unwrap()
}

/// Compares one forward over `tokens[split..]` with one-token forwards, both after the same
/// prefix `tokens[..split]`. Returns (max abs diff of logits, argmax mismatches, rows).
fn batch_vs_sequential(
    mut model: CandleTarget,
    tokens: &[u32],
    split: usize,
) -> (f32, usize, usize) {
    let vocab = model.vocab_size();
    let mut logits = Vec::new();
    model.forward(&tokens[..split], &mut logits).unwrap();
    let mut seq_model = model.fork().unwrap();
    let new = &tokens[split..];
    let mut batch = Vec::new();
    model.forward(new, &mut batch).unwrap();
    assert_eq!(batch.len(), new.len() * vocab);
    let batch_hidden = model.last_hidden().unwrap().to_vec();
    assert_eq!(batch_hidden.len(), new.len() * model.hidden_size());
    let mut max_diff = 0f32;
    let mut mismatches = 0;
    for (i, &t) in new.iter().enumerate() {
        seq_model.forward(&[t], &mut logits).unwrap();
        assert_eq!(logits.len(), vocab);
        let row = &batch[i * vocab..(i + 1) * vocab];
        for (a, b) in row.iter().zip(&logits) {
            max_diff = max_diff.max((a - b).abs());
        }
        if argmax(row) != argmax(&logits) {
            mismatches += 1;
        }
    }
    assert_eq!(model.seq_len(), seq_model.seq_len());
    (max_diff, mismatches, new.len())
}

/// Tolerances for "one forward over n tokens == n one-token forwards".
///
/// Q8_0: exact. Candle's quantised matmul computes each row on its own and our attention runs
/// row by row with the shapes of a one-token step, so the logits must be bit-identical
/// (measured max |diff| 0 for the full model and the 8-layer early exit, 9 and 45 rows).
/// f32: gemm's summation order depends on the row count; measured max |diff| 6.5e-5 (9 rows)
/// and 9.9e-5 (45 rows); argmax must agree everywhere.
fn tolerance(format: WeightFormat) -> f32 {
    match format {
        WeightFormat::F32 => 1e-3,
        _ => 0.0,
    }
}

fn check_batch(format: WeightFormat, layers: Option<usize>) {
    let w = weights(format);
    let model = match layers {
        Some(l) => CandleTarget::early_exit(w, l).unwrap(),
        None => CandleTarget::new(w),
    };
    let tokens = prompt_tokens();
    let n = tokens.len();
    // Verify-sized call (9 tokens) after a prefix, and a prefill-sized one from position 1.
    for split in [n - 9, 1] {
        let (diff, mism, rows) = batch_vs_sequential(model.fork().unwrap(), &tokens, split);
        println!(
            "{format:?} layers={layers:?} rows={rows}: max |logit diff| = {diff:e}, argmax mismatches = {mism}"
        );
        let tol = tolerance(format);
        assert!(diff <= tol, "max abs logit diff {diff} exceeds {tol}");
        assert_eq!(mism, 0, "argmax differs at {mism} of {rows} positions");
    }
}

#[test]
fn batch_forward_equals_single_steps_q8() {
    check_batch(WeightFormat::Q8_0, None);
}

#[test]
fn batch_forward_equals_single_steps_early_exit() {
    check_batch(WeightFormat::Q8_0, Some(8));
}

#[test]
fn batch_forward_equals_single_steps_f32() {
    check_batch(WeightFormat::F32, None);
}

#[test]
fn truncate_then_rerun_equals_fresh_run() {
    let w = weights(WeightFormat::Q8_0);
    let tokens = prompt_tokens();
    let n = tokens.len();
    let mut fresh = CandleTarget::new(w.clone());
    let mut want = Vec::new();
    fresh.forward(&tokens, &mut want).unwrap();

    let mut m = CandleTarget::new(w);
    let mut logits = Vec::new();
    m.forward(&tokens[..n - 5], &mut logits).unwrap();
    // Rejected drafts: three wrong tokens, then roll back and continue with the real ones.
    m.forward(&[17, 4242, 9], &mut logits).unwrap();
    m.truncate(n - 5).unwrap();
    assert_eq!(m.seq_len(), n - 5);
    let mut got = Vec::new();
    m.forward(&tokens[n - 5..], &mut got).unwrap();
    let vocab = m.vocab_size();
    assert_eq!(
        got[..],
        want[(n - 5) * vocab..],
        "truncate + re-run must equal a fresh run"
    );

    // Roll back to 0 and run everything again.
    m.truncate(0).unwrap();
    m.forward(&tokens, &mut got).unwrap();
    assert_eq!(got, want);
}

#[test]
fn bad_input_gives_typed_errors() {
    let w = weights(WeightFormat::Q8_0);
    let mut m = CandleTarget::new(w.clone());
    let mut logits = vec![1.0];
    assert!(m.forward(&[], &mut logits).is_err());
    let e = m.forward(&[u32::MAX], &mut logits).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    assert_eq!(m.seq_len(), 0);
    assert!(m.truncate(1).is_err());
    m.forward(&[1, 2, 3], &mut logits).unwrap();
    let e = m.truncate(4).unwrap_err();
    assert!(e.to_string().contains("cannot truncate"), "{e}");
    assert!(matches!(
        CandleTarget::early_exit(w.clone(), 0),
        Err(CandleError::InvalidArgument(_))
    ));
    assert!(CandleTarget::early_exit(w.clone(), w.config().n_layers + 1).is_err());
    let max = m.max_context();
    assert_eq!(max, w.config().context_length);
    let long = vec![1u32; max];
    let e = m.forward(&long, &mut logits).unwrap_err();
    assert!(e.to_string().contains("context overflow"), "{e}");
    assert_eq!(m.seq_len(), 3);
}

#[test]
fn missing_model_file_says_how_to_fetch() {
    let e = speculative_candle::LlamaWeights::load("/nonexistent/model.gguf").unwrap_err();
    assert!(matches!(e, CandleError::ModelNotFound { .. }));
    assert!(e.to_string().contains("scripts/fetch-model.sh"), "{e}");
    let dir = std::env::temp_dir().join(format!("spec-candle-corrupt-{}.gguf", std::process::id()));
    std::fs::write(&dir, b"not a gguf file at all").unwrap();
    let e = speculative_candle::LlamaWeights::load(&dir).unwrap_err();
    std::fs::remove_file(&dir).ok();
    assert!(matches!(e, CandleError::CorruptModel { .. }), "{e}");
    assert!(e.to_string().contains("scripts/fetch-model.sh"), "{e}");
}

fn greedy(format: WeightFormat, question: &str) -> String {
    let tok = tokenizer();
    let w = weights(format);
    let mut m = CandleTarget::new(w);
    let prompt = tok
        .apply_chat_template(&[ChatMessage::user(question)])
        .unwrap();
    let mut input = tok.encode(&prompt).unwrap();
    let vocab = m.vocab_size();
    let mut logits = Vec::new();
    let mut out = Vec::new();
    let mut stream = tok.stream(true);
    let mut text = String::new();
    for _ in 0..20 {
        m.forward(&input, &mut logits).unwrap();
        let last = &logits[logits.len() - vocab..];
        let next = argmax(last) as u32;
        if next == tok.eos_id() || tok.token_to_id("<|im_end|>") == Some(next) {
            break;
        }
        out.push(next);
        text.push_str(&stream.push(next).unwrap());
        input = vec![next];
    }
    text.push_str(&stream.finish());
    println!("{format:?} greedy: {text:?}");
    assert_eq!(text, tok.decode(&out, true).unwrap());
    text
}

#[test]
fn greedy_generation_answers_paris() {
    // The exact model (f32 dequantisation of the shipped Q4_1 weights).
    let text = greedy(WeightFormat::F32, "What is the capital of France?");
    assert!(text.contains("Paris"), "expected Paris in {text:?}");
}

#[test]
fn greedy_generation_q8_is_text() {
    // Q8_0 is an approximation: on this machine it answers the France question with
    // "L'Étoile, la Cité, ..." instead of Paris (argmax agrees with f32 at about 92% of
    // positions), so only check that it produces text; it is printed for inspection.
    let text = greedy(WeightFormat::Q8_0, "What is the capital of France?");
    assert!(!text.trim().is_empty());
    let text = greedy(WeightFormat::Q8_0, "Name three primary colours.");
    assert!(!text.trim().is_empty());
}

#[test]
fn prefill_without_head_leaves_the_same_cache() {
    let w = weights(WeightFormat::Q8_0);
    let tokens = prompt_tokens();
    let n = tokens.len();
    let mut want = Vec::new();
    let mut full = CandleTarget::new(w.clone());
    full.forward(&tokens[..n - 3], &mut want).unwrap();
    let want_hidden = full.last_hidden().unwrap().to_vec();
    full.forward(&tokens[n - 3..], &mut want).unwrap();

    let mut m = CandleTarget::new(w);
    m.prefill(&tokens[..n - 3]).unwrap();
    assert_eq!(m.seq_len(), n - 3);
    assert_eq!(m.last_hidden().unwrap(), &want_hidden[..]);
    let mut got = Vec::new();
    m.forward(&tokens[n - 3..], &mut got).unwrap();
    assert_eq!(
        got, want,
        "prefill then forward must equal forward then forward"
    );
    // Bad input keeps the sequence, as `forward` does.
    assert!(matches!(
        m.prefill_tokens(&[u32::MAX]),
        Err(CandleError::TokenOutOfVocab { .. })
    ));
    assert!(m.prefill_tokens(&[]).is_err());
    assert_eq!(m.seq_len(), n);
}
