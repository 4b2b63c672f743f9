//! Measures llama.cpp's batch invariance on a GGUF model with the conformance kit's measurement
//! (`speculative::conformance::check_invariance`): every position of a sequence is scored once
//! in a single-row call (plain decoding) and once inside a call of `k + 1` rows (a verify call),
//! and the rows are compared: bit-identical rows, rows whose argmax changes, the largest logit
//! difference.
//!
//! The sequences are three chat prompts (a rewrite, a code edit, an open question) each followed
//! by `--tokens` of the model's own greedy output, so the compared rows are those greedy decoding
//! reads. One Markdown table row per (flash attention, k) setting; the first line says whether
//! this build of llama.cpp repacks weights (`speculative_llama::cpu_weight_repacking`). Each row
//! also gives the cost of the calls compared, so that two builds (with and without repacking)
//! can be compared on speed: the median wall time of a single-row forward (plain decoding's
//! step) and `c(k + 1)`, the median time of a `k + 1`-row forward over it (a verify call), both
//! after the first sequence's prompt and `--reps` times each.
//!
//! ```text
//! cargo run --release -p speculative-llama --example batch_invariance -- \
//!     --model models/gemma-3-270m-q4_k_m.gguf --k 4,8 --tokens 64 --threads 1
//! ```

use clap::Parser;
use speculative::TargetModel;
use speculative::conformance::{self, KitConfig, Tolerance};
use speculative_llama::{
    ChatTurn, FlashAttention, LlamaConfig, LlamaEngine, ModelOptions, Quantization,
};

#[derive(Parser)]
#[command(about = "Batch invariance of llama.cpp's logits: k+1-row calls vs single rows")]
struct Args {
    /// GGUF model (default: the repository's SmolLM2 file or $SPECULATIVE_MODEL).
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Measure a copy re-quantized by llama.cpp (q8_0 or q4_0; made once beside the model).
    #[arg(long)]
    quant: Option<String>,
    /// Draft lengths k (a verify call has k + 1 rows).
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    k: Vec<usize>,
    /// Greedy tokens generated after each prompt (the positions compared, with the prompt's).
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Flash-attention settings to measure: auto, on, off.
    #[arg(long, value_delimiter = ',', default_value = "on,off")]
    flash_attention: Vec<String>,
    /// Timed repetitions of each forward (the median is reported).
    #[arg(long, default_value_t = 15)]
    reps: usize,
    /// llama.cpp threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

const PROMPTS: [&str; 3] = [
    "Rewrite the following paragraph in the past tense and keep everything else unchanged:\n\nThe library opens at eight in the morning. Students arrive early and find seats near the windows. The librarian checks the returned books and puts them back on the shelves.",
    "Add type hints to this Python function and keep the body unchanged:\n\ndef mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)",
    "What are three good habits for staying healthy while working from home?",
];

type DynError = Box<dyn std::error::Error>;

/// The id of the largest logit (ties: the lowest id).
fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > row[best] { i } else { best })
}

/// Each prompt followed by `tokens` greedy tokens, decoded one row at a time.
fn sequences(
    engine: &LlamaEngine,
    cfg: &LlamaConfig,
    tokens: usize,
) -> Result<Vec<Vec<u32>>, DynError> {
    let mut target = engine.target(cfg)?;
    let mut out = Vec::new();
    for prompt in PROMPTS {
        let text = engine.apply_chat_template(&[ChatTurn::user(prompt)], true)?;
        let mut seq = engine.encode(&text)?;
        target.truncate(0)?;
        target.prefill(&seq[..seq.len() - 1])?;
        let mut logits = Vec::new();
        for _ in 0..tokens {
            target.forward(&seq[seq.len() - 1..], &mut logits)?;
            seq.push(argmax(&logits) as u32);
        }
        out.push(seq);
    }
    Ok(out)
}

/// Median wall times in milliseconds of a 1-row and a `k + 1`-row forward over the tokens that
/// follow `seq`'s first `start` tokens (the cache truncated back to `start` before each call).
fn timings(
    engine: &LlamaEngine,
    cfg: &LlamaConfig,
    seq: &[u32],
    start: usize,
    k: usize,
    reps: usize,
) -> Result<(f64, f64), DynError> {
    let mut target = engine.target(cfg)?;
    target.prefill(&seq[..start])?;
    let mut logits = Vec::new();
    let mut time = |rows: usize| -> Result<f64, DynError> {
        let mut ms = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            target.truncate(start)?;
            let t = std::time::Instant::now();
            target.forward(&seq[start..start + rows], &mut logits)?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms[ms.len() / 2])
    };
    Ok((time(1)?, time(k + 1)?))
}

fn flash(name: &str) -> Result<FlashAttention, DynError> {
    Ok(match name {
        "auto" => FlashAttention::Auto,
        "on" => FlashAttention::On,
        "off" => FlashAttention::Off,
        other => return Err(format!("--flash-attention {other}: auto, on or off").into()),
    })
}

fn main() -> Result<(), DynError> {
    let a = Args::parse();
    if a.tokens == 0 {
        return Err("--tokens must be at least 1".into());
    }
    let mut path = a
        .model
        .clone()
        .unwrap_or_else(speculative_llama::default_model_path);
    if let Some(q) = &a.quant {
        let to = Quantization::parse(q).ok_or(format!("--quant {q}: q8_0 or q4_0"))?;
        path = speculative_llama::quantized_copy(&path, to, a.threads)?;
    }
    let engine = LlamaEngine::load(&path, &ModelOptions::default())?;
    println!(
        "{}: weight repacking {} (CPU extra buffer types {:?}), {} thread(s)\n",
        path.display(),
        if speculative_llama::cpu_weight_repacking()? {
            "on"
        } else {
            "off"
        },
        speculative_llama::cpu_extra_buffer_types()?,
        a.threads
    );
    println!(
        "| flash attention | k | rows compared | bit-identical | argmax changes | max abs logit diff | 1-row ms | c(k+1) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for fa in &a.flash_attention {
        let cfg = LlamaConfig::default()
            .with_threads(a.threads)
            .with_context(1024)
            .with_flash_attention(flash(fa)?);
        let seqs = sequences(&engine, &cfg, a.tokens)?;
        for &k in &a.k {
            let kit = KitConfig::builder()
                .tolerance(Tolerance::Exact)
                .draft_len(k)
                .build()?;
            let make = || engine.target(&cfg).expect("a context like the first one");
            let r = conformance::check_invariance(make, &seqs, &kit);
            let m = r
                .invariance()
                .ok_or_else(|| format!("no measurement:\n{r}"))?;
            let start = seqs[0].len() - a.tokens;
            let (one, rows) = timings(&engine, &cfg, &seqs[0], start, k.min(a.tokens - 1), a.reps)?;
            println!(
                "| {fa} | {k} | {} | {} | {} | {:.4} | {one:.2} | {:.2} |",
                m.rows,
                m.identical_rows,
                m.argmax_changes,
                m.max_abs_diff,
                rows / one
            );
        }
    }
    Ok(())
}
