//! Cost curve c(n) = t(n) / t(1) of the fast batch-invariant forward, beside candle's stock
//! Q8_0 path measured in the same run.
//!
//! For each configuration: the time of a 1-token forward after a prefix of `--prefix` tokens and
//! c(n) = time(forward of n new tokens) / time(1-token forward), each the median of `--runs`
//! timed runs (after one warm-up), truncating back to the prefix after every run.
//!
//! ```text
//! scripts/fetch-model.sh
//! RAYON_NUM_THREADS=1 cargo run --release -p speculative-candle --example fast_cost_curve
//! ```
//!
//! `--stat min` reports the fastest run instead of the median (less sensitive to other jobs on
//! a shared machine) and `--ms` adds the absolute times.
//!
//! `--batch` measures the multi-sequence forward ([`FastBatch`], fast Q8, one thread) instead:
//! `B` slots, each holding `--prefix` tokens, run together in one
//! [`BatchTarget::forward_batch`] call of `B x 1` rows (a plain batched decoding step) and of
//! `B x (k + 1)` rows (a batched verify of `k = --batch-k` drafts), for `B` in
//! `--batch-sizes` (default 1, 2, 4, 8, 16); it reports the ms per call and the ratio to one
//! row of one sequence (`B = 1`, 1 row):
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo run --release -p speculative-candle --example fast_cost_curve -- --batch
//! ```
//!
//! Measured with that command (median of 11; 2-core AMD EPYC with AVX-512 VNNI, shared with
//! other jobs, load average 1.3-1.5 during the runs), three runs, SmolLM2-135M:
//!
//! | path | 1-token ms | c(2) | c(3) | c(5) | c(9) | c(17) |
//! |---|---|---|---|---|---|---|
//! | candle QMatMul Q8_0, 1 thread | 12.7-13.1 | 1.79-1.85 | 2.55-2.66 | 4.09-4.37 | 7.17-7.61 | 13.6-14.2 |
//! | fast Q8 (Avx512Vnni), 1 thread | 5.08-5.11 | 0.96-0.99 | 1.07 | 1.11-1.14 | 1.43-1.54 | 2.40-2.45 |
//! | fast Q8 (Avx512Vnni), 2 threads | 3.66-4.28 | 0.96-1.05 | 1.02-1.12 | 1.02-1.13 | 1.25-1.35 | 1.86-2.10 |
//! | fast F32, 1 thread | 49.2-50.3 | 1.02-1.13 | 1.02-1.06 | 1.32-1.44 | 2.11-2.23 | 3.17-3.36 |
//!
//! (A third run's fast Q8 1-thread 1-token median was an outlier at 6.50 ms with n = 2 at
//! 4.72 ms; it is left out of the range.) Two threads help only while the second core is
//! idle: with one busy-loop process running, the 1-token step took 7.2-7.4 ms on 2 threads
//! against 5.2-5.5 ms on one, so one thread stays the default.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use speculative::{BatchTarget, SlotChunk, SlotInput, TargetModel};
use speculative_candle::{
    CandleTarget, FastBatch, FastFormat, FastTarget, FastWeights, GgufTokenizer, KernelPath,
    LlamaWeights, LoadOptions, WeightFormat, default_model_path,
};

#[derive(Parser, Debug)]
#[command(about = "Cost curve c(n) of the fast forward versus candle's Q8_0 path")]
struct Args {
    /// GGUF model file (default: models/SmolLM2-135M-Instruct.Q4_1.gguf or $SPECULATIVE_MODEL).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prefix length in tokens before the measured forwards.
    #[arg(long, default_value_t = 100)]
    prefix: usize,
    /// Timed runs per n (median reported).
    #[arg(long, default_value_t = 11)]
    runs: usize,
    /// Numbers of new tokens per forward, comma separated (1 is always measured).
    #[arg(long, value_delimiter = ',', default_values_t = [2, 3, 5, 9, 17])]
    ns: Vec<usize>,
    /// Thread counts for the fast path, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2])]
    threads: Vec<usize>,
    /// Skip candle's Q8_0 baseline.
    #[arg(long)]
    no_candle: bool,
    /// Skip the fast F32 path.
    #[arg(long)]
    no_f32: bool,
    /// Also measure every available int8 kernel path (one thread).
    #[arg(long)]
    all_kernels: bool,
    /// Also print the absolute times (ms) of every n.
    #[arg(long)]
    ms: bool,
    /// Statistic over the runs: `median` (default) or `min` (less sensitive to other load).
    #[arg(long, default_value = "median")]
    stat: String,
    /// Measure the multi-sequence forward (`FastBatch`) instead of the single-sequence paths.
    #[arg(long)]
    batch: bool,
    /// Numbers of sequences per batched call (with `--batch`), comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8, 16])]
    batch_sizes: Vec<usize>,
    /// Draft length k of the batched verify rows (`k + 1` rows per sequence; with `--batch`).
    #[arg(long, default_value_t = 4)]
    batch_k: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn minimum(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// Median ms of a forward over `new[..n]` after `prefix` is cached, for 1 and every `ns`.
fn curve<T: TargetModel>(
    m: &mut T,
    prefix: &[u32],
    new: &[u32],
    ns: &[usize],
    runs: usize,
    stat: fn(Vec<f64>) -> f64,
) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let mut logits = Vec::new();
    m.truncate(0)?;
    m.forward(prefix, &mut logits)?;
    let p = m.seq_len();
    let mut out = Vec::new();
    for &n in ns {
        m.forward(&new[..n], &mut logits)?;
        m.truncate(p)?;
        let mut t = Vec::with_capacity(runs);
        for _ in 0..runs {
            let s = Instant::now();
            m.forward(&new[..n], &mut logits)?;
            t.push(s.elapsed().as_secs_f64() * 1e3);
            m.truncate(p)?;
        }
        out.push(stat(t));
    }
    Ok(out)
}

/// ms of one `forward_batch` over slots `0 .. b`, each appending `new[..rows]` after its
/// prefix, for every `b` in `bs` (`stat` over `runs` timed calls after one warm-up; every slot
/// truncated back to its prefix after each call).
fn batch_curve(
    m: &mut FastBatch,
    bs: &[usize],
    new: &[u32],
    rows: usize,
    runs: usize,
    stat: fn(Vec<f64>) -> f64,
) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let mut logits = Vec::new();
    let mut out = Vec::new();
    for &b in bs {
        let lens: Vec<usize> = (0..b).map(|s| m.seq_len(s)).collect::<Result<_, _>>()?;
        let chunks: Vec<SlotChunk<'_>> = (0..b)
            .map(|slot| SlotChunk {
                slot,
                input: SlotInput::Chain(&new[..rows]),
            })
            .collect();
        let mut t = Vec::with_capacity(runs);
        for i in 0..=runs {
            let s = Instant::now();
            m.forward_batch(&chunks, &mut logits)?;
            if i > 0 {
                t.push(s.elapsed().as_secs_f64() * 1e3);
            }
            for (slot, &len) in lens.iter().enumerate() {
                m.truncate(slot, len)?;
            }
        }
        out.push(stat(t));
    }
    Ok(out)
}

/// The `--batch` table: `B x 1` and `B x (k + 1)` rows per call.
fn batch_table(
    args: &Args,
    path: &std::path::Path,
    prefix: &[u32],
    new: &[u32],
    stat: fn(Vec<f64>) -> f64,
) -> Result<(), Box<dyn std::error::Error>> {
    let w = FastWeights::load(path, FastFormat::Q8)?;
    let mut bs = vec![1];
    bs.extend(args.batch_sizes.iter().copied().filter(|&b| b > 1));
    let max_b = bs.iter().copied().max().unwrap_or(1);
    let k1 = args.batch_k + 1;
    let mut m = FastBatch::new(w, max_b)?.with_max_batch_tokens((max_b * k1).max(prefix.len()));
    // Every slot holds the prefix (its own copy, in one prefill call per slot).
    for slot in 0..max_b {
        m.forward_batch(
            &[SlotChunk {
                slot,
                input: SlotInput::Prefill(prefix),
            }],
            &mut Vec::new(),
        )?;
    }
    let one = batch_curve(&mut m, &bs, new, 1, args.runs, stat)?;
    let verify = batch_curve(&mut m, &bs, new, k1, args.runs, stat)?;
    println!("| sequences B | rows | ms per call | ratio to 1 row |");
    println!("|---|---|---|---|");
    for (i, &b) in bs.iter().enumerate() {
        println!("| {b} | {b} x 1 | {:.2} | {:.2} |", one[i], one[i] / one[0]);
    }
    for (i, &b) in bs.iter().enumerate() {
        println!(
            "| {b} | {b} x {k1} | {:.2} | {:.2} |",
            verify[i],
            verify[i] / one[0]
        );
    }
    Ok(())
}

fn row(name: &str, ns: &[usize], ms: &[f64], abs: bool) {
    let mut s = format!("| {name} | {:.2} |", ms[0]);
    for (i, _) in ns.iter().enumerate().skip(1) {
        s.push_str(&format!(" {:.2} |", ms[i] / ms[0]));
    }
    println!("{s}");
    if abs {
        let v: Vec<String> = ms.iter().map(|m| format!("{m:.2}")).collect();
        println!("|   ms for n = {ns:?} | {} |", v.join(" | "));
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let stat: fn(Vec<f64>) -> f64 = match args.stat.as_str() {
        "min" => minimum,
        _ => median,
    };
    let path = args.model.clone().unwrap_or_else(default_model_path);
    let threads = speculative_candle::use_single_thread_if_unset();
    let tok = GgufTokenizer::load(&path)?;
    let text = "The history of lighthouses is long. Keepers lived on remote rocks, trimmed the \
                wicks, wound the clockwork and logged the weather every four hours. In 1850 a \
                keeper earned about 50 pounds a year; storms cut them off for weeks at a time. ";
    let mut ns = vec![1];
    ns.extend(args.ns.iter().copied().filter(|&n| n > 1));
    let max_n = ns.iter().copied().max().unwrap_or(1).max(args.batch_k + 1);
    let mut tokens = Vec::new();
    while tokens.len() < args.prefix + max_n {
        tokens.extend(tok.encode(text)?);
    }
    let (prefix, new) = tokens.split_at(args.prefix);
    println!(
        "model {}; prefix {} tokens; {} of {} runs; candle threads {threads}; kernel {:?}",
        path.display(),
        args.prefix,
        if args.stat == "min" { "min" } else { "median" },
        args.runs,
        KernelPath::detect()
    );
    if args.batch {
        return batch_table(&args, &path, prefix, new, stat);
    }
    let mut head = String::from("| path | 1-token ms |");
    for n in &ns[1..] {
        head.push_str(&format!(" c({n}) |"));
    }
    println!("{head}");
    println!("|---|---|{}", "---|".repeat(ns.len() - 1));

    if !args.no_candle {
        let w = LlamaWeights::load_with(&path, &LoadOptions::with_format(WeightFormat::Q8_0))?;
        let mut m = CandleTarget::new(w);
        let ms = curve(&mut m, prefix, new, &ns, args.runs, stat)?;
        row("candle QMatMul Q8_0, 1 thread", &ns, &ms, args.ms);
    }
    let q8 = FastWeights::load(&path, FastFormat::Q8)?;
    for &t in &args.threads {
        let mut m = FastTarget::new(q8.clone()).with_threads(t);
        let ms = curve(&mut m, prefix, new, &ns, args.runs, stat)?;
        row(
            &format!("fast Q8 ({:?}), {t} thread(s)", m.kernel()),
            &ns,
            &ms,
            args.ms,
        );
    }
    if args.all_kernels {
        for k in KernelPath::available() {
            let mut m = FastTarget::new(q8.clone()).with_kernel(k)?;
            let ms = curve(&mut m, prefix, new, &ns, args.runs, stat)?;
            row(&format!("fast Q8 ({k:?}), 1 thread"), &ns, &ms, args.ms);
        }
    }
    drop(q8);
    if !args.no_f32 {
        let f = FastWeights::load(&path, FastFormat::F32)?;
        for &t in &args.threads {
            let mut m = FastTarget::new(f.clone()).with_threads(t);
            let ms = curve(&mut m, prefix, new, &ns, args.runs, stat)?;
            row(&format!("fast F32, {t} thread(s)"), &ns, &ms, args.ms);
        }
    }
    Ok(())
}
