//! Measures llama.cpp's batch invariance on a GGUF model: how often the argmax of a row differs
//! between one call of `k + 1` rows (a verify call) and `k + 1` single-row calls (plain
//! decoding), and the largest logit difference.
//!
//! For each prompt it decodes `--tokens` greedy tokens one row at a time (the reference), then
//! re-runs the same tokens in windows of `k + 1` rows (truncating the cache to the window's
//! start, as the decoding loop does after a verify call) and compares every row. It prints one
//! Markdown table row per (flash attention, k, batch tokens) setting.
//!
//! ```text
//! cargo run --release -p speculative-llama --example batch_invariance -- --k 4,8 --tokens 200
//! ```

use clap::Parser;
use speculative::TargetModel;
use speculative_llama::{ChatTurn, FlashAttention, LlamaConfig, LlamaEngine, ModelOptions};

#[derive(Parser)]
#[command(about = "Batch invariance of llama.cpp's logits: k+1-row calls vs single rows")]
struct Args {
    /// GGUF model (default: the repository's SmolLM2 file or $SPECULATIVE_MODEL).
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Draft lengths k (a verify call has k + 1 rows).
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    k: Vec<usize>,
    /// Greedy tokens generated per prompt (the positions compared).
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// Flash-attention settings to measure: auto, on, off.
    #[arg(long, value_delimiter = ',', default_value = "on,off")]
    flash_attention: Vec<String>,
    /// llama.cpp threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

const PROMPTS: [&str; 3] = [
    "Rewrite the following paragraph in the past tense and keep everything else unchanged:\n\nThe library opens at eight in the morning. Students arrive early and find seats near the windows. The librarian checks the returned books and puts them back on the shelves.",
    "Add type hints to this Python function and keep the body unchanged:\n\ndef mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)",
    "What are three good habits for staying healthy while working from home?",
];

/// The id of the largest logit (ties: the lowest id).
fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > row[best] { i } else { best })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let path = a
        .model
        .clone()
        .unwrap_or_else(speculative_llama::default_model_path);
    let engine = LlamaEngine::load(&path, &ModelOptions::default())?;
    let vocab = engine.vocab_size();
    println!(
        "| flash attention | k | rows compared | argmax differs | rate | max abs logit diff | rows bit-identical |"
    );
    println!("|---|---|---|---|---|---|---|");
    for fa in &a.flash_attention {
        let flash = match fa.as_str() {
            "auto" => FlashAttention::Auto,
            "on" => FlashAttention::On,
            "off" => FlashAttention::Off,
            other => return Err(format!("--flash-attention {other}: auto, on or off").into()),
        };
        let cfg = LlamaConfig::default()
            .with_threads(a.threads)
            .with_flash_attention(flash);
        let mut target = engine.target(&cfg)?;
        for &k in &a.k {
            let (mut rows, mut differ, mut identical, mut max_diff) =
                (0usize, 0usize, 0usize, 0f32);
            for prompt in PROMPTS {
                let text = engine.apply_chat_template(&[ChatTurn::user(prompt)], true)?;
                let prompt = engine.encode(&text)?;
                // Reference: single-row calls, greedy.
                target.truncate(0)?;
                target.prefill(&prompt[..prompt.len() - 1])?;
                let mut seq = prompt.clone();
                let mut reference: Vec<f32> = Vec::with_capacity(a.tokens * vocab);
                let mut logits = Vec::new();
                for _ in 0..a.tokens {
                    target.forward(&seq[seq.len() - 1..], &mut logits)?;
                    seq.push(argmax(&logits) as u32);
                    reference.extend_from_slice(&logits);
                }
                // Windows of k + 1 rows over the same positions.
                let start = prompt.len() - 1;
                let mut s = 0;
                while s + k < a.tokens {
                    target.truncate(start + s)?;
                    target.forward(&seq[start + s..start + s + k + 1], &mut logits)?;
                    for r in 0..=k {
                        let got = &logits[r * vocab..(r + 1) * vocab];
                        let want = &reference[(s + r) * vocab..(s + r + 1) * vocab];
                        rows += 1;
                        differ += usize::from(argmax(got) != argmax(want));
                        identical += usize::from(got == want);
                        let d = got
                            .iter()
                            .zip(want)
                            .map(|(x, y)| (x - y).abs())
                            .fold(0f32, f32::max);
                        max_diff = max_diff.max(d);
                    }
                    s += k + 1;
                }
            }
            println!(
                "| {fa} | {k} | {rows} | {differ} | {:.2}% | {max_diff:.4} | {identical} |",
                100.0 * differ as f64 / rows.max(1) as f64
            );
        }
    }
    Ok(())
}
