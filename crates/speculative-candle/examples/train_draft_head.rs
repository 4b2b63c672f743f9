//! Self-distils an EAGLE draft head for the bundled model (driven by
//! `scripts/train-draft-head.sh`; see `speculative_candle::train` for the recipe).
//!
//! ```text
//! train_draft_head generate --prompts P.jsonl --out data.bin [--threads 2]
//! train_draft_head generate-tokens --conversations C.jsonl --out DIR [--slots 16] [--lookup]
//! train_draft_head train --data data.bin --out head.safetensors --log log.json [--steps 600]
//! train_draft_head eval --data data.bin --head head.safetensors
//! train_draft_head bench-step [--steps 5] [--unroll 1] [--seqs 8] [--len 256]
//! train_draft_head feature-rate --tokens DIR [--limit 40]
//! train_draft_head dump-features --tokens DIR --out FEATURES [--max-seq-len 1024]
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand};
use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions};
use speculative::{NoProposer, SamplingConfig};
use speculative_candle::distil;
use speculative_candle::fast::head::{DraftHead, DraftHeadWeights, frequency_ranked};
use speculative_candle::train::{
    Dataset, GenSettings, Sequence, TrainConfig, Trainer, evaluate, feature_rms, record_features,
};
use speculative_candle::{
    ChatMessage, FastFormat, FastTarget, FastWeights, GgufTokenizer, default_model_path,
};

#[derive(Parser, Debug)]
#[command(about = "Self-distil an EAGLE draft head for the bundled model on the CPU")]
struct Args {
    /// GGUF model (default: the bundled SmolLM2-135M-Instruct).
    #[arg(long, global = true)]
    model: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Answer the prompts with the target and record its hidden states.
    Generate {
        /// JSON lines with a "prompt" field.
        #[arg(long)]
        prompts: PathBuf,
        /// Output dataset.
        #[arg(long)]
        out: PathBuf,
        /// Longest answer, in tokens.
        #[arg(long, default_value_t = 192)]
        max_tokens: usize,
        /// Temperatures cycled over the prompts (0 = greedy).
        #[arg(long, value_delimiter = ',', default_value = "0,0,0.7,1.0")]
        temperatures: Vec<f32>,
        /// Worker threads (one target each).
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Use only the first N prompts (after --skip).
        #[arg(long)]
        limit: Option<usize>,
        /// Skip the first N prompts.
        #[arg(long, default_value_t = 0)]
        skip: usize,
        /// Seed of the sampled answers.
        #[arg(long, default_value_t = 7)]
        seed: u64,
    },
    /// Answer conversations with the batch loop and store token ids only, resumably
    /// (`speculative_candle::distil`): run it again on the same --out to continue.
    GenerateTokens {
        /// JSON lines of conversations (scripts/make-eagle3-conversations.py).
        #[arg(long)]
        conversations: PathBuf,
        /// Output directory (manifest.json and shard-NNNNN.jsonl).
        #[arg(long)]
        out: PathBuf,
        /// Longest answer, in tokens.
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        /// Base seed of the answers.
        #[arg(long, default_value_t = 29)]
        seed: u64,
        /// Conversations per shard.
        #[arg(long, default_value_t = 500)]
        shard_conversations: u64,
        /// Sequences per forward (FastBatch slots).
        #[arg(long, default_value_t = 16)]
        slots: usize,
        /// Matmul threads.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Rows per forward.
        #[arg(long, default_value_t = 512)]
        max_batch_tokens: usize,
        /// Draft with prompt lookup (1..=3-grams, adaptive length); lossless, the data do not change.
        #[arg(long)]
        lookup: bool,
        /// Stop after N conversations in this run.
        #[arg(long)]
        limit: Option<u64>,
        /// Seconds between progress lines.
        #[arg(long, default_value_t = 60.0)]
        progress_secs: f64,
    },
    /// Train a head on a dataset.
    Train {
        /// Dataset files (comma-separated), concatenated.
        #[arg(long, value_delimiter = ',')]
        data: Vec<PathBuf>,
        /// Output head (f16 safetensors).
        #[arg(long)]
        out: PathBuf,
        /// Training log (JSON).
        #[arg(long)]
        log: Option<PathBuf>,
        #[arg(long, default_value_t = 600)]
        steps: usize,
        #[arg(long, default_value_t = 2048)]
        batch_tokens: usize,
        #[arg(long, default_value_t = 1e-3)]
        lr: f64,
        #[arg(long, default_value_t = 19)]
        seed: u64,
        /// Size of the token subset of the output head.
        #[arg(long, default_value_t = 8192)]
        subset: usize,
        #[arg(long, default_value_t = 2)]
        unroll: usize,
        #[arg(long, default_value_t = 1536)]
        ffn: usize,
        /// Every Nth greedy sequence is held out for validation.
        #[arg(long, default_value_t = 20)]
        val_every: usize,
    },
    /// Seconds per training step of the one-layer head on synthetic data (random features and
    /// tokens: the cost does not depend on the values), for comparing training libraries.
    BenchStep {
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Passes per step (1: no unrolled pass).
        #[arg(long, default_value_t = 1)]
        unroll: usize,
        /// Sequences per step.
        #[arg(long, default_value_t = 8)]
        seqs: usize,
        /// Tokens per sequence.
        #[arg(long, default_value_t = 256)]
        len: usize,
    },
    /// Positions per second of recomputing EAGLE-3 features (a prefill of each stored sequence
    /// with FeatureLayout::eagle3 on a FastTarget) over the first records of a token store.
    FeatureRate {
        /// A `generate-tokens` output directory.
        #[arg(long)]
        tokens: PathBuf,
        /// Records to prefill.
        #[arg(long, default_value_t = 40)]
        limit: usize,
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// Write the EAGLE-3 training features of a token store (multi-layer features, final
    /// hidden states, embeddings; `speculative_candle::distil::dump`) to safetensors files,
    /// resumably: run it again on the same --out to continue.
    DumpFeatures {
        /// A `generate-tokens` output directory.
        #[arg(long)]
        tokens: PathBuf,
        /// Output directory (features-NNNNN.safetensors, lm_head.safetensors, features.json).
        #[arg(long)]
        out: PathBuf,
        /// Tokens kept of each record (its first ones).
        #[arg(long, default_value_t = 1024)]
        max_seq_len: usize,
        /// Records per file.
        #[arg(long, default_value_t = 64)]
        seqs_per_file: usize,
        /// Feature layers (Residual indices, comma-separated; default EAGLE-3's low / middle /
        /// high layers of the model).
        #[arg(long)]
        layers: Option<String>,
        /// Stop after writing N files in this run.
        #[arg(long)]
        limit_files: Option<usize>,
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// Validation accuracy of a head file.
    Eval {
        /// Dataset files (comma-separated), concatenated.
        #[arg(long, value_delimiter = ',')]
        data: Vec<PathBuf>,
        #[arg(long)]
        head: PathBuf,
        #[arg(long, default_value_t = 20)]
        val_every: usize,
        #[arg(long, default_value_t = 5)]
        depth: usize,
        /// Only the first N validation sequences.
        #[arg(long)]
        limit: Option<usize>,
    },
}

type DynError = Box<dyn std::error::Error>;

fn main() {
    if let Err(e) = run() {
        eprintln!("train_draft_head: error: {e}");
        std::process::exit(1);
    }
}

/// Train / validation split: every `every`-th greedy sequence is validation.
fn split(data: &Dataset, every: usize) -> (Vec<usize>, Vec<usize>) {
    let (mut train, mut val) = (Vec::new(), Vec::new());
    let mut g = 0;
    for (i, s) in data.seqs.iter().enumerate() {
        if s.temperature == 0.0 {
            g += 1;
            if g % every.max(1) == 0 {
                val.push(i);
                continue;
            }
        }
        train.push(i);
    }
    (train, val)
}

fn read_all(paths: &[PathBuf]) -> Result<Dataset, DynError> {
    let mut all = Dataset::default();
    for p in paths {
        let d = Dataset::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
        all.hidden = d.hidden;
        all.seqs.extend(d.seqs);
    }
    Ok(all)
}

fn subset_of(data: &Dataset, idx: &[usize]) -> Dataset {
    Dataset {
        hidden: data.hidden,
        seqs: idx.iter().map(|&i| data.seqs[i].clone()).collect(),
    }
}

/// `generate-tokens`: the batch loop over the conversations, into a resumable token store.
fn generate_tokens(
    path: &std::path::Path,
    weights: Arc<FastWeights>,
    cmd: Cmd,
) -> Result<(), DynError> {
    let Cmd::GenerateTokens {
        conversations,
        out,
        max_tokens,
        seed,
        shard_conversations,
        slots,
        threads,
        max_batch_tokens,
        lookup,
        limit,
        progress_secs,
    } = cmd
    else {
        return Err("not generate-tokens".into());
    };
    let bytes = std::fs::read(&conversations)?;
    let convs = distil::parse_conversations(std::str::from_utf8(&bytes)?)?;
    let cfg = distil::DistilConfig {
        max_tokens,
        seed,
        shard_conversations,
        slots,
        threads,
        max_batch_tokens,
        drafting: if lookup {
            distil::Drafting::PromptLookup { min_n: 1, max_n: 3 }
        } else {
            distil::Drafting::Off
        },
        limit,
        progress_secs,
    };
    let id = distil::identity(path, &bytes, convs.len() as u64, &cfg)?;
    let mut store = distil::TokenStore::open(&out, id)?;
    let tok = GgufTokenizer::load(path)?;
    eprintln!(
        "generate-tokens: {} conversations, {} already written ({} answer tokens); slots {slots}, threads {threads}, lookup {lookup}",
        convs.len(),
        store.next_conv(),
        store.manifest().answer_tokens()
    );
    let s = distil::generate_tokens(weights, &tok, &convs, &mut store, &cfg, &mut |l| {
        eprintln!("{l}")
    })?;
    let m = store.manifest();
    println!(
        "this run: {} conversations, {} answer tokens in {:.0} s ({:.1} answer tokens/s); in all {} conversations, {} turns, {} answer tokens in {}",
        s.conversations,
        s.answer_tokens,
        s.seconds,
        s.answer_tokens as f64 / s.seconds.max(1e-9),
        m.conversations_done(),
        m.turns(),
        m.answer_tokens(),
        out.display()
    );
    Ok(())
}

/// `bench-step`: times `steps` optimiser steps (after one warm-up step) on a synthetic batch
/// of `seqs` sequences of `len` tokens (prompt 16 tokens), 8,192-id subset.
fn bench_step(weights: Arc<FastWeights>, cmd: Cmd) -> Result<(), DynError> {
    let Cmd::BenchStep {
        steps,
        unroll,
        seqs,
        len,
    } = cmd
    else {
        return Err("not bench-step".into());
    };
    let c = weights.config();
    let (h, vocab) = (c.hidden_size, c.vocab_size as u64);
    let mut rng = speculative_candle::train::SplitMix::new(3);
    let data = Dataset {
        hidden: h,
        seqs: (0..seqs)
            .map(|_| Sequence {
                tokens: (0..len).map(|_| (rng.next_u64() % vocab) as u32).collect(),
                prompt_len: 16,
                temperature: 0.0,
                features: (0..len * h)
                    .map(|_| half::f16::from_f64(rng.normal()))
                    .collect(),
            })
            .collect(),
    };
    let cfg = TrainConfig {
        steps: steps + 1,
        unroll,
        batch_tokens: seqs * len,
        max_len: len,
        ..TrainConfig::default()
    };
    let ids: Vec<u32> = (0..8192).collect();
    let mut trainer = Trainer::new(cfg, weights.clone(), ids)?;
    let idx: Vec<usize> = (0..seqs).collect();
    trainer.step(&data, &idx)?;
    let mut times = Vec::new();
    for _ in 0..steps {
        let t0 = Instant::now();
        trainer.step(&data, &idx)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    println!(
        "candle: {} positions per step, unroll {unroll}: median {:.3} s per step (min {:.3}, max {:.3}, {steps} steps)",
        seqs * len,
        times[times.len() / 2],
        times[0],
        times[times.len() - 1]
    );
    Ok(())
}

/// `feature-rate`: prefills the first `limit` stored sequences with EAGLE-3's default layers
/// and reports positions per second (the features training recomputes instead of storing).
fn feature_rate(weights: Arc<FastWeights>, cmd: Cmd) -> Result<(), DynError> {
    let Cmd::FeatureRate {
        tokens,
        limit,
        threads,
    } = cmd
    else {
        return Err("not feature-rate".into());
    };
    let (_, recs) = distil::read_records(&tokens)?;
    let c = weights.config();
    let layout = speculative::FeatureLayout::eagle3(c.n_layers, c.hidden_size)?;
    let mut target = FastTarget::new(weights.clone())
        .with_threads(threads)
        .with_feature_layout(layout)?;
    let (mut positions, t0) = (0usize, Instant::now());
    for r in recs.iter().take(limit) {
        speculative::TargetModel::truncate(&mut target, 0)?;
        speculative::TargetModel::prefill(&mut target, &r.tokens)?;
        positions += r.tokens.len();
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{} sequences, {positions} positions in {secs:.1} s: {:.0} positions/s of [3 x {}] features",
        limit.min(recs.len()),
        positions as f64 / secs,
        c.hidden_size
    );
    Ok(())
}

/// `dump-features`: the training features of a token store (`distil::dump`).
fn dump_features(
    path: &std::path::Path,
    weights: Arc<FastWeights>,
    cmd: Cmd,
) -> Result<(), DynError> {
    let Cmd::DumpFeatures {
        tokens,
        out,
        max_seq_len,
        seqs_per_file,
        layers,
        limit_files,
        threads,
    } = cmd
    else {
        return Err("not dump-features".into());
    };
    let c = weights.config();
    let layout = match layers {
        Some(l) => speculative_candle::fast::head::parse_feature_layers(&l, c.hidden_size)?,
        None => speculative::FeatureLayout::eagle3(c.n_layers, c.hidden_size)?,
    };
    let (_, recs) = distil::read_records(&tokens)?;
    let cfg = distil::DumpConfig {
        layout,
        max_seq_len,
        seqs_per_file,
        threads,
        limit_files,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    eprintln!(
        "dump-features: {} records into {}",
        recs.len(),
        out.display()
    );
    let s = distil::dump_features(weights, &name, &recs, &out, &cfg, &mut |l| eprintln!("{l}"))?;
    println!(
        "this run: {} files ({} skipped), {} sequences, {} positions in {:.0} s ({:.0} positions/s)",
        s.files_written,
        s.files_skipped,
        s.sequences,
        s.positions,
        s.seconds,
        s.positions as f64 / s.seconds.max(1e-9)
    );
    Ok(())
}

fn run() -> Result<(), DynError> {
    let a = Args::parse();
    let path = a.model.clone().unwrap_or_else(default_model_path);
    let weights = FastWeights::load(&path, FastFormat::Q8)?;
    match a.cmd {
        c @ Cmd::GenerateTokens { .. } => generate_tokens(&path, weights.clone(), c)?,
        c @ Cmd::BenchStep { .. } => bench_step(weights.clone(), c)?,
        c @ Cmd::FeatureRate { .. } => feature_rate(weights.clone(), c)?,
        c @ Cmd::DumpFeatures { .. } => dump_features(&path, weights.clone(), c)?,
        Cmd::Generate {
            prompts,
            out,
            max_tokens,
            temperatures,
            threads,
            limit,
            skip,
            seed,
        } => {
            let tok = Arc::new(GgufTokenizer::load(&path)?);
            let mut texts = Vec::new();
            for line in std::fs::read_to_string(&prompts)?.lines() {
                if line.trim().is_empty() {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(line)?;
                let p = v["prompt"].as_str().ok_or("a line without \"prompt\"")?;
                texts.push(p.to_string());
            }
            texts.drain(..skip.min(texts.len()));
            if let Some(l) = limit {
                texts.truncate(l);
            }
            let gen_cfg = GenSettings {
                temperatures,
                top_p: 0.95,
                max_tokens,
                seed,
            };
            let t0 = Instant::now();
            let n = texts.len();
            let texts = Arc::new(texts);
            let bar = indicatif::ProgressBar::new(n as u64);
            let mut handles = Vec::new();
            for t in 0..threads.max(1) {
                let (w, tok, texts, cfg, bar) = (
                    weights.clone(),
                    tok.clone(),
                    texts.clone(),
                    gen_cfg.clone(),
                    bar.clone(),
                );
                handles.push(std::thread::spawn(
                    move || -> Result<Vec<(usize, Sequence)>, String> {
                        let mut target = FastTarget::new(w);
                        let mut out = Vec::new();
                        for i in (t..texts.len()).step_by(threads.max(1)) {
                            let prompt_text = tok
                                .apply_chat_template(&[ChatMessage::user(texts[i].clone())])
                                .map_err(|e| e.to_string())?;
                            let prompt = tok.encode(&prompt_text).map_err(|e| e.to_string())?;
                            let gi = i + skip;
                            let temp = cfg.temperatures[gi % cfg.temperatures.len()];
                            let sampling = SamplingConfig::builder()
                                .temperature(temp)
                                .top_p(if temp == 0.0 { 1.0 } else { cfg.top_p })
                                .build()
                                .map_err(|e| e.to_string())?;
                            let params = GenerationParams::builder()
                                .sampling(sampling)
                                .seed(cfg.seed.wrapping_mul(1_000_003).wrapping_add(gi as u64))
                                .max_new_tokens(cfg.max_tokens)
                                .stop(StopConditions::eos(tok.eos_id()))
                                .draft(DraftLength::Off)
                                .build()
                                .map_err(|e| e.to_string())?;
                            let r = Generator::new(&mut target, NoProposer)
                                .generate(&prompt, &params)
                                .map_err(|e| e.to_string())?;
                            let mut tokens = prompt.clone();
                            tokens.extend_from_slice(&r.tokens);
                            let f =
                                record_features(&mut target, &tokens).map_err(|e| e.to_string())?;
                            out.push((
                                i,
                                Sequence {
                                    prompt_len: prompt.len(),
                                    temperature: temp,
                                    features: f.iter().map(|&x| half::f16::from_f32(x)).collect(),
                                    tokens,
                                },
                            ));
                            bar.inc(1);
                        }
                        Ok(out)
                    },
                ));
            }
            let mut all = Vec::new();
            for h in handles {
                all.extend(h.join().map_err(|_| "a worker panicked")??);
            }
            bar.finish_and_clear();
            all.sort_by_key(|x| x.0);
            let data = Dataset {
                hidden: weights.config().hidden_size,
                seqs: all.into_iter().map(|x| x.1).collect(),
            };
            data.write(&out)?;
            let secs = t0.elapsed().as_secs_f64();
            println!(
                "{} sequences, {} tokens ({} answer tokens) in {secs:.0} s ({:.0} answer tokens/s); wrote {}",
                data.seqs.len(),
                data.tokens(),
                data.answer_tokens(),
                data.answer_tokens() as f64 / secs,
                out.display()
            );
        }
        Cmd::Train {
            data,
            out,
            log,
            steps,
            batch_tokens,
            lr,
            seed,
            subset,
            unroll,
            ffn,
            val_every,
        } => {
            let t0 = Instant::now();
            let data = read_all(&data)?;
            let (train_idx, val_idx) = split(&data, val_every);
            let vocab = weights.config().vocab_size;
            let mut counts = vec![0u64; vocab];
            for &i in &train_idx {
                let s = &data.seqs[i];
                for &t in &s.tokens[s.prompt_len..] {
                    counts[t as usize] += 1;
                }
            }
            let ids = frequency_ranked(&counts, subset);
            let in_set: std::collections::HashSet<u32> = ids.iter().copied().collect();
            let (mut cov, mut tot) = (0usize, 0usize);
            for &i in &val_idx {
                let s = &data.seqs[i];
                for t in &s.tokens[s.prompt_len..] {
                    tot += 1;
                    cov += in_set.contains(t) as usize;
                }
            }
            let coverage = cov as f64 / tot.max(1) as f64;
            let cfg = TrainConfig {
                seed,
                steps,
                batch_tokens,
                lr,
                unroll,
                ffn_size: ffn,
                ..TrainConfig::default()
            };
            let train = subset_of(&data, &train_idx);
            let val = subset_of(&data, &val_idx);
            println!(
                "train: {} sequences, {} answer tokens; validation: {} sequences, {} answer tokens; subset {} ids cover {:.1} % of validation answer tokens",
                train.seqs.len(),
                train.answer_tokens(),
                val.seqs.len(),
                val.answer_tokens(),
                ids.len(),
                100.0 * coverage
            );
            let rms = feature_rms(&train, 200);
            let mut trainer = Trainer::new(cfg.clone(), weights.clone(), ids)?;
            trainer.set_feature_rms(rms);
            let mut pool: Vec<usize> = (0..train.seqs.len()).collect();
            let mut cursor = 0;
            let bar = indicatif::ProgressBar::new(steps as u64);
            let mut first = Vec::new();
            let mut curve = Vec::new();
            let (mut acc_loss, mut acc_ce, mut acc_acc, mut acc_n) = (0.0, 0.0, 0.0, 0);
            for step in 0..steps {
                let idx = trainer.next_batch(&train, &mut pool, &mut cursor);
                let l = trainer.step(&train, &idx)?;
                if step < 5 {
                    first.push(l.total);
                }
                acc_loss += l.total;
                acc_ce += l.ce;
                acc_acc += l.acc;
                acc_n += 1;
                if (step + 1) % 25 == 0 || step + 1 == steps {
                    let m = acc_n as f64;
                    // indicatif drops println while the bar is hidden (no terminal).
                    let say = |line: String| {
                        if bar.is_hidden() {
                            eprintln!("{line}");
                        } else {
                            bar.println(line);
                        }
                    };
                    say(format!(
                        "step {:4}  loss {:.4}  ce {:.3}  top-1 (train, pass 1) {:.3}  lr {:.2e}  {:.0} s",
                        step + 1,
                        acc_loss / m,
                        acc_ce / m,
                        acc_acc / m,
                        trainer.lr_at(step),
                        t0.elapsed().as_secs_f64()
                    ));
                    curve.push(serde_json::json!({"step": step + 1, "loss": acc_loss / m, "ce": acc_ce / m, "top1": acc_acc / m}));
                    (acc_loss, acc_ce, acc_acc, acc_n) = (0.0, 0.0, 0.0, 0);
                }
                bar.inc(1);
            }
            bar.finish_and_clear();
            let train_secs = t0.elapsed().as_secs_f64();
            println!("{steps} steps in {train_secs:.1} s");
            let mut meta = BTreeMap::new();
            meta.insert(
                "target".into(),
                speculative_candle::DEFAULT_MODEL_FILE.into(),
            );
            meta.insert("seed".into(), seed.to_string());
            meta.insert("steps".into(), steps.to_string());
            meta.insert(
                "train_answer_tokens".into(),
                train.answer_tokens().to_string(),
            );
            let tensors = trainer.export(meta)?;
            tensors.write(&out, true)?;
            let hw = DraftHeadWeights::load(&out, weights.clone())?;
            let mut head = DraftHead::new(hw);
            let acc = evaluate(&mut head, &val, 5, 1)?;
            println!(
                "validation (greedy answers, f16 weights, Q8 head): top-1 {:?}  top-3 {:?}  mean accepted (chain of 5) {:.3}",
                acc.top1
                    .iter()
                    .map(|x| format!("{x:.3}"))
                    .collect::<Vec<_>>(),
                acc.top3
                    .iter()
                    .map(|x| format!("{x:.3}"))
                    .collect::<Vec<_>>(),
                acc.mean_accepted
            );
            println!("trained in {train_secs:.0} s; wrote {}", out.display());
            if let Some(log) = log {
                let j = serde_json::json!({
                    "config": format!("{cfg:?}"),
                    "train_sequences": train.seqs.len(),
                    "train_tokens": train.tokens(),
                    "train_answer_tokens": train.answer_tokens(),
                    "val_sequences": val.seqs.len(),
                    "val_answer_tokens": val.answer_tokens(),
                    "subset": subset,
                    "subset_coverage_val": coverage,
                    "feature_rms": rms,
                    "first_losses": first,
                    "curve": curve,
                    "train_seconds": train_secs,
                    "val_top1": acc.top1,
                    "val_top3": acc.top3,
                    "val_count": acc.count,
                    "val_mean_accepted_chain5": acc.mean_accepted,
                });
                std::fs::write(&log, serde_json::to_string_pretty(&j)? + "\n")?;
            }
        }
        Cmd::Eval {
            data,
            head,
            val_every,
            depth,
            limit,
        } => {
            let data = read_all(&data)?;
            let (_, mut val_idx) = split(&data, val_every);
            val_idx.truncate(limit.unwrap_or(usize::MAX));
            let val = subset_of(&data, &val_idx);
            let hw = DraftHeadWeights::load(&head, weights.clone())?;
            let mut h = DraftHead::new(hw);
            let t0 = Instant::now();
            let acc = evaluate(&mut h, &val, depth, 1)?;
            println!(
                "{} positions: top-1 {:?}  top-3 {:?}  mean accepted {:.3}  ({:.1} s)",
                acc.count.first().copied().unwrap_or(0),
                acc.top1,
                acc.top3,
                acc.mean_accepted,
                t0.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}
