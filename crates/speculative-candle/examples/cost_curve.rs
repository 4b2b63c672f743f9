//! Measures the verify cost curve of the candle adapter.
//!
//! For each weight format: the load time, the time of a 1-token forward after a prefix of
//! `--prefix` tokens, and c(n) = time(forward of n new tokens) / time(1-token forward), each
//! the median of `--runs` timed runs (after one warm-up), truncating back to the prefix after
//! every run.
//!
//! ```text
//! scripts/fetch-model.sh
//! cargo run --release -p speculative-candle --example cost_curve -- --format q8 --format f32
//! RAYON_NUM_THREADS=2 cargo run --release -p speculative-candle --example cost_curve -- --ns 1
//! ```
//!
//! The thread count comes from `RAYON_NUM_THREADS` (one thread when unset).

use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use speculative::TargetModel;
use speculative_candle::{
    CandleTarget, GgufTokenizer, LlamaWeights, LoadOptions, WeightFormat, default_model_path,
};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Format {
    /// Q4_1 re-quantised to Q8_0 (default adapter setting).
    Q8,
    /// Exact f32 dequantisation.
    F32,
    /// As stored in the file (Q4_1).
    Stored,
}

#[derive(Parser, Debug)]
#[command(about = "Cost curve c(n) of one forward over n new tokens, relative to one token")]
struct Args {
    /// GGUF model file (default: models/SmolLM2-135M-Instruct.Q4_1.gguf or $SPECULATIVE_MODEL).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Weight formats to measure (repeatable).
    #[arg(long, value_enum, default_values_t = [Format::Q8, Format::F32])]
    format: Vec<Format>,
    /// Prefix length in tokens before the measured forwards.
    #[arg(long, default_value_t = 100)]
    prefix: usize,
    /// Timed runs per n (median reported).
    #[arg(long, default_value_t = 11)]
    runs: usize,
    /// Numbers of new tokens per forward, comma separated (1 is always measured).
    #[arg(long, value_delimiter = ',', default_values_t = [2, 3, 5, 9, 17])]
    ns: Vec<usize>,
    /// Also compare each format's logits over the prefix with the exact f32 model (argmax
    /// agreement, mean and max |logit difference|).
    #[arg(long)]
    accuracy: bool,
    /// Early-exit depth to measure instead of the full model (number of layers).
    #[arg(long)]
    layers: Option<usize>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let path = args.model.clone().unwrap_or_else(default_model_path);
    let tok = GgufTokenizer::load(&path)?;
    let text = "The history of lighthouses is long. Keepers lived on remote rocks, trimmed the \
                wicks, wound the clockwork and logged the weather every four hours. In 1850 a \
                keeper earned about 50 pounds a year; storms cut them off for weeks at a time. ";
    let max_n = args.ns.iter().copied().max().unwrap_or(1).max(1);
    let mut tokens = Vec::new();
    while tokens.len() < args.prefix + max_n {
        tokens.extend(tok.encode(text)?);
    }
    let (prefix, new) = tokens.split_at(args.prefix);
    let threads = speculative_candle::use_single_thread_if_unset();
    println!(
        "model {}; prefix {} tokens; {} runs (median); {} thread(s)",
        path.display(),
        args.prefix,
        args.runs,
        threads
    );
    println!(
        "| format | load s | 1-token ms | {} |",
        args.ns
            .iter()
            .map(|n| format!("c({n})"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|---|---|{}", "---|".repeat(args.ns.len()));
    let mut exact: Option<Vec<f32>> = None;
    if args.accuracy {
        let w = LlamaWeights::load_with(&path, &LoadOptions::with_format(WeightFormat::F32))?;
        let mut m = CandleTarget::new(w);
        let mut logits = Vec::new();
        m.forward(prefix, &mut logits)?;
        exact = Some(logits);
    }
    let mut accuracy_lines = Vec::new();
    for &f in &args.format {
        let format = match f {
            Format::Q8 => WeightFormat::Q8_0,
            Format::F32 => WeightFormat::F32,
            Format::Stored => WeightFormat::AsStored,
        };
        let t0 = Instant::now();
        let w = LlamaWeights::load_with(&path, &LoadOptions::with_format(format))?;
        let load_s = t0.elapsed().as_secs_f64();
        let mut m = match args.layers {
            Some(l) => CandleTarget::early_exit(w, l)?,
            None => CandleTarget::new(w),
        };
        let mut logits = Vec::new();
        m.forward(prefix, &mut logits)?;
        if let Some(want) = &exact {
            let vocab = m.vocab_size();
            let argmax = |r: &[f32]| {
                r.iter()
                    .enumerate()
                    .fold(0, |b, (i, &v)| if v > r[b] { i } else { b })
            };
            let (mut agree, mut max_d, mut sum_d) = (0, 0f32, 0f64);
            for (a, b) in want.chunks(vocab).zip(logits.chunks(vocab)) {
                agree += usize::from(argmax(a) == argmax(b));
                for (x, y) in a.iter().zip(b) {
                    max_d = max_d.max((x - y).abs());
                    sum_d += f64::from((x - y).abs());
                }
            }
            accuracy_lines.push(format!(
                "{format:?} vs exact f32 over {} prefix positions: argmax agrees at {agree}, \
                 mean |logit diff| {:.3}, max {:.2}",
                args.prefix,
                sum_d / want.len() as f64,
                max_d
            ));
        }
        let mut time_n = |n: usize| -> Result<f64, Box<dyn std::error::Error>> {
            let mut v = Vec::with_capacity(args.runs);
            for r in 0..=args.runs {
                let t = Instant::now();
                m.forward(&new[..n], &mut logits)?;
                let dt = t.elapsed().as_secs_f64() * 1e3;
                m.truncate(args.prefix)?;
                if r > 0 {
                    v.push(dt);
                }
            }
            Ok(median(v))
        };
        let one = time_n(1)?;
        let mut cells = Vec::new();
        for &n in &args.ns {
            cells.push(format!("{:.2}", time_n(n)? / one));
        }
        println!(
            "| {format:?} | {load_s:.2} | {one:.1} | {} |",
            cells.join(" | ")
        );
    }
    for line in accuracy_lines {
        println!("{line}");
    }
    Ok(())
}
