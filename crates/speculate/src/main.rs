//! `speculate`: generate text with speculative decoding on a real GGUF model, on the CPU.
//!
//! ```text
//! scripts/fetch-model.sh
//! cargo run --release -p speculative-candle --example speculate -- \
//!     --prompt "Rewrite this sentence in the passive voice: the cat chased the mouse." \
//!     --proposer prompt-lookup --k 4 --compare
//! ```
//!
//! The prompt comes from `--prompt`, `--prompt-file`, or standard input (`--prompt -`). The chat
//! template stored in the GGUF is applied unless `--raw`. The text streams as it is verified;
//! then the run's figures are printed: tokens per second, acceptance rate, mean accepted length
//! and acceptance per draft position. With `--compare` the same prompt is also decoded plainly,
//! and the speed-up and (for greedy runs) whether both outputs are identical are printed.
//!
//! Structured output: `--json-schema FILE` or `--grammar FILE` (Lark) constrain every target and
//! draft row with the grammar (crate `speculative-guidance`), and the tokens the grammar forces
//! are drafted in front of the proposer's draft (`--no-forced-drafts` turns that off).

use std::io::{Read, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use speculative::decode::{
    AdaptiveConfig, DraftLength, Generation, GenerationParams, Generator, SeedSource,
    StopConditions,
};
use speculative::propose::{
    DraftModelProposer, MergedProposer, PromptLookup, RecyclingConfig, SuffixConfig,
    SuffixProposer, TokenRecycling, TreeTemplate,
};
use speculative::{NoProposer, Proposer, SamplingConfig, TargetModel};
use speculative_candle::fast::head::{DraftHead, DraftHeadWeights};
use speculative_candle::fast::{FastFormat, FastTarget, FastWeights};
use speculative_candle::{
    CandleTarget, ChatMessage, GgufDetokenizer, GgufTokenizer, LlamaWeights, LoadOptions,
    WeightFormat, default_head_path, default_model_path,
};
use speculative_guidance::{ForcedDrafts, Grammar, GrammarMask, Vocabulary};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum ProposerKind {
    /// n-gram match against the prompt and the generated text.
    PromptLookup,
    /// Suffix tree over the sequence and earlier generations (SuffixDecoding).
    Suffix,
    /// The first `--exit-layers` layers of the target as a draft model (LayerSkip-style).
    EarlyExit,
    /// The target itself as the draft model (every draft is accepted in greedy mode).
    SameModel,
    /// Token Recycling: the target's own top candidates from earlier verify rows, drafted along
    /// a tree template (load a warmed table with --recycling-table).
    Recycling,
    /// Prompt lookup, suffix and token recycling merged into one tree per step.
    Merged,
    /// The EAGLE draft head on the target's hidden states (--draft-head; fast backend).
    DraftHead,
    /// The draft head, prompt lookup and suffix merged into one tree per step.
    HeadMerged,
    /// No speculation.
    None,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Format {
    /// 8-bit weights and activations (fast, approximate).
    Q8,
    /// Weights dequantised to f32 (the exact model of the file).
    F32,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Backend {
    /// Our multi-row, batch-invariant int8 / f32 forward (`speculative_candle::fast`).
    Fast,
    /// The forward on candle's stock quantised matmul.
    Candle,
    /// llama.cpp through `speculative-llama` (build the example with `--features llama`); the
    /// GGUF file as stored, `--format` does not apply.
    Llama,
}

/// Speculative decoding on a real GGUF model.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// The prompt; `-` reads standard input.
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// A file holding the prompt.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Optional system message.
    #[arg(long)]
    system: Option<String>,
    /// Do not apply the chat template.
    #[arg(long)]
    raw: bool,
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf or $SPECULATIVE_MODEL).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Forward implementation (`--engine` is the same option).
    #[arg(long, alias = "engine", value_enum, default_value = "fast")]
    backend: Backend,
    /// Weight format.
    #[arg(long, value_enum, default_value = "q8")]
    format: Format,
    /// Threads for the fast backend's matmuls and llama.cpp (1 or 2; see the crate README).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Proposer.
    #[arg(long, value_enum, default_value = "prompt-lookup")]
    proposer: ProposerKind,
    /// A token-recycling table written by `spec-bench warm-recycling`, for `recycling` and
    /// `merged` (default: an empty table, filled as the generation runs).
    #[arg(long)]
    recycling_table: Option<PathBuf>,
    /// Layers of the early-exit draft.
    #[arg(long, default_value_t = 8)]
    exit_layers: usize,
    /// Draft-head weights for --proposer draft-head / head-merged (default: the shipped head).
    #[arg(long)]
    draft_head: Option<PathBuf>,
    /// Draft length: an integer, or `adaptive` / `adaptive:MAX`. With --tree-nodes, the depth of
    /// the tree.
    #[arg(long, default_value = "4", value_parser = draft_length)]
    k: DraftLength,
    /// Node budget of tree drafts (0 = chains): every step verifies a token tree of at most this
    /// many nodes in one forward (the fast backend; the candle backend falls back to chains).
    #[arg(long, default_value_t = 0)]
    tree_nodes: usize,
    /// Branching limit of tree drafts: at most this many children per node (0 = none).
    #[arg(long, default_value_t = 0)]
    tree_branch: usize,
    /// Temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the random stream (default: a fresh one, printed when sampling, so that the run
    /// can be repeated).
    #[arg(long)]
    seed: Option<u64>,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Minimum new tokens before EOS or a stop may end the generation.
    #[arg(long, default_value_t = 0)]
    min_tokens: usize,
    /// Stop string (repeatable): the generation ends when the text contains it, even across
    /// tokens; the stop string itself is not printed.
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Constrain the output to this JSON schema (structured output through llguidance; the
    /// generation ends where the JSON does).
    #[arg(long, conflicts_with = "grammar")]
    json_schema: Option<PathBuf>,
    /// Constrain the output to this Lark grammar.
    #[arg(long)]
    grammar: Option<PathBuf>,
    /// Under --json-schema / --grammar, do not draft the grammar-forced tokens in front of the
    /// proposer's drafts.
    #[arg(long)]
    no_forced_drafts: bool,
    /// Also decode plainly and print the speed-up.
    #[arg(long)]
    compare: bool,
    /// Do not stream the text: show a progress bar and print the text at the end.
    #[arg(long)]
    quiet: bool,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("speculate: error: {e}");
        std::process::exit(1);
    }
}

type DynError = Box<dyn std::error::Error>;

/// Makes a model sharing the loaded weights: `None` the full model, `Some(n)` an early exit
/// after `n` layers.
type ModelMaker = Box<dyn Fn(Option<usize>) -> Result<Box<dyn TargetModel>, DynError>>;

/// A llama.cpp target (context: the model's training length, at most 8,192) and a maker of more (draft
/// models on the same weights; no early exit).
#[cfg(feature = "llama")]
fn llama_target(
    path: &std::path::Path,
    threads: usize,
) -> Result<(Box<dyn TargetModel>, ModelMaker), DynError> {
    use speculative_llama::{LlamaConfig, LlamaEngine, ModelOptions};
    let engine = LlamaEngine::load(path, &ModelOptions::default())?;
    // The training context, capped as in spec-bench: a long-context model would otherwise
    // allocate its whole KV cache (twice with `--proposer same-model`).
    let cfg = LlamaConfig::default()
        .with_threads(threads)
        .with_context(engine.context_train().min(8192));
    let target = Box::new(engine.target(&cfg)?);
    Ok((
        target,
        Box::new(move |layers| match layers {
            Some(_) => Err("--proposer early-exit needs --backend fast or candle".into()),
            None => Ok(Box::new(engine.target(&cfg)?)),
        }),
    ))
}

#[cfg(not(feature = "llama"))]
fn llama_target(
    _: &std::path::Path,
    _: usize,
) -> Result<(Box<dyn TargetModel>, ModelMaker), DynError> {
    Err(
        "--engine llama needs the example built with `--features llama` \
         (cargo run --release -p speculative-candle --features llama --example speculate)"
            .into(),
    )
}

/// The draft-head proposer over the fast backend's weights.
fn head_proposer(
    a: &Args,
    w: Option<&std::sync::Arc<FastWeights>>,
) -> Result<DraftModelProposer<DraftHead>, DynError> {
    let w = w.ok_or("--proposer draft-head needs --backend fast")?;
    let path = a.draft_head.clone().unwrap_or_else(default_head_path);
    let hw =
        DraftHeadWeights::load(&path, w.clone()).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(DraftModelProposer::new(DraftHead::new(hw)))
}

fn read_prompt(a: &Args) -> Result<String, DynError> {
    if let Some(p) = &a.prompt_file {
        return Ok(std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?);
    }
    match a.prompt.as_deref() {
        Some("-") | None => {
            if a.prompt.is_none() {
                eprintln!("(reading the prompt from standard input; end with Ctrl-D)");
            }
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s)?;
            Ok(s)
        }
        Some(p) => Ok(p.to_string()),
    }
}

/// Parses `--k` (checked by clap before the model loads).
fn draft_length(s: &str) -> Result<DraftLength, String> {
    let bad = || format!("{s}: expected an integer or adaptive[:MAX]");
    if let Some(rest) = s.strip_prefix("adaptive") {
        let max_draft = match rest.strip_prefix(':') {
            Some(m) => m.parse().map_err(|_| bad())?,
            None if rest.is_empty() => 8,
            None => return Err(bad()),
        };
        return Ok(DraftLength::Adaptive(AdaptiveConfig {
            max_draft,
            ..Default::default()
        }));
    }
    Ok(DraftLength::Fixed(s.parse().map_err(|_| bad())?))
}

fn run() -> Result<(), DynError> {
    let a = Args::parse();
    let path = a.model.clone().unwrap_or_else(default_model_path);
    let text = read_prompt(&a)?;
    if text.trim().is_empty() {
        return Err("the prompt is empty".into());
    }
    let t0 = Instant::now();
    let mut fast_weights = None;
    let (target, draft_for): (Box<dyn TargetModel>, ModelMaker) = match a.backend {
        Backend::Fast => {
            let format = match a.format {
                Format::Q8 => FastFormat::Q8,
                Format::F32 => FastFormat::F32,
            };
            let w = FastWeights::load(&path, format)?;
            fast_weights = Some(w.clone());
            let threads = a.threads;
            let w2 = w.clone();
            (
                Box::new(FastTarget::new(w).with_threads(threads)),
                Box::new(move |layers| {
                    Ok(match layers {
                        Some(n) => {
                            Box::new(FastTarget::early_exit(w2.clone(), n)?.with_threads(threads))
                        }
                        None => Box::new(FastTarget::new(w2.clone()).with_threads(threads)),
                    })
                }),
            )
        }
        Backend::Candle => {
            let format = match a.format {
                Format::Q8 => WeightFormat::Q8_0,
                Format::F32 => WeightFormat::F32,
            };
            let w = LlamaWeights::load_with(&path, &LoadOptions::with_format(format))?;
            let w2 = w.clone();
            (
                Box::new(CandleTarget::new(w)),
                Box::new(move |layers| {
                    Ok(match layers {
                        Some(n) => Box::new(CandleTarget::early_exit(w2.clone(), n)?),
                        None => Box::new(CandleTarget::new(w2.clone())),
                    })
                }),
            )
        }
        Backend::Llama => llama_target(&path, a.threads)?,
    };
    let tok = std::sync::Arc::new(GgufTokenizer::load(&path)?);
    eprintln!(
        "loaded {} ({:?} backend, {} weights) in {:.2} s",
        std::fs::canonicalize(&path)
            .unwrap_or_else(|_| path.clone())
            .display(),
        a.backend,
        if a.backend == Backend::Llama {
            "as stored".to_string()
        } else {
            format!("{:?}", a.format)
        },
        t0.elapsed().as_secs_f64()
    );
    let prompt_text = if a.raw {
        text
    } else {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage::system(s.clone()));
        }
        msgs.push(ChatMessage::user(text));
        tok.apply_chat_template(&msgs)?
    };
    let prompt = tok.encode(&prompt_text)?;
    // Structured output: the grammar's mask on every target and draft row.
    let grammar = match (&a.json_schema, &a.grammar) {
        (Some(p), _) => Some(Grammar::json_schema_str(&std::fs::read_to_string(p)?)?),
        (None, Some(p)) => Some(Grammar::Lark(std::fs::read_to_string(p)?)),
        (None, None) => None,
    };
    let mask = match &grammar {
        Some(g) => {
            let n = tok.vocab_size() as u32;
            let bytes = (0..n)
                .map(|i| tok.token_bytes(i).unwrap_or_default().to_vec())
                .collect();
            let special = (0..n).map(|i| tok.is_special(i)).collect();
            let vocab =
                Vocabulary::with_tokenizer(bytes, special, tok.eos_id(), tok.tokenizer().clone())?;
            Some(Arc::new(GrammarMask::new(&vocab, g, prompt.len())?))
        }
        None => None,
    };
    let mut sampling = SamplingConfig::builder()
        .temperature(a.temperature)
        .top_k(a.top_k)
        .top_p(a.top_p);
    if let Some(m) = &mask {
        sampling = sampling.mask(m.clone());
    }
    let sampling = sampling.build()?;
    let draft = if a.proposer == ProposerKind::None {
        DraftLength::Off
    } else {
        a.k.clone()
    };
    // One seed for both runs of --compare (the same seed gives the same tokens, C15).
    let seed = a.seed.unwrap_or_else(|| SeedSource::os().next_seed());
    if a.temperature > 0.0 {
        eprintln!("seed {seed}");
    }
    let params = GenerationParams {
        sampling,
        seed: Some(seed),
        max_new_tokens: a.max_tokens,
        min_tokens: a.min_tokens,
        stop: a
            .stop
            .iter()
            .fold(StopConditions::eos(tok.eos_id()), |s, t| {
                s.with_stop_string(t.as_str())
            }),
        draft,
        tree_nodes: a.tree_nodes,
        tree_branch: a.tree_branch,
        ..Default::default()
    };
    let proposer: Box<dyn Proposer> = match a.proposer {
        ProposerKind::PromptLookup => Box::new(PromptLookup::new(1, 4)?),
        ProposerKind::Suffix => Box::new(SuffixProposer::new(SuffixConfig::default())?),
        ProposerKind::EarlyExit => {
            Box::new(DraftModelProposer::new(draft_for(Some(a.exit_layers))?))
        }
        ProposerKind::SameModel => Box::new(DraftModelProposer::new(draft_for(None)?)),
        ProposerKind::Recycling => Box::new(recycling(target.vocab_size(), &a.recycling_table)?),
        ProposerKind::Merged => Box::new(MergedProposer::new(vec![
            Box::new(PromptLookup::new(1, 4)?),
            Box::new(SuffixProposer::new(SuffixConfig::default())?),
            Box::new(recycling(target.vocab_size(), &a.recycling_table)?),
        ])?),
        ProposerKind::DraftHead => Box::new(head_proposer(&a, fast_weights.as_ref())?),
        ProposerKind::HeadMerged => Box::new(MergedProposer::new(vec![
            Box::new(head_proposer(&a, fast_weights.as_ref())?),
            Box::new(PromptLookup::new(1, 4)?),
            Box::new(SuffixProposer::new(SuffixConfig::default())?),
        ])?),
        ProposerKind::None => Box::new(NoProposer),
    };
    let proposer: Box<dyn Proposer> = match &mask {
        Some(m) if !a.no_forced_drafts && a.proposer != ProposerKind::None => {
            Box::new(ForcedDrafts::new(m.clone(), proposer))
        }
        _ => proposer,
    };
    let mut target = target;
    eprintln!(
        "prompt: {} tokens; proposer {:?}, draft {:?}, temperature {}",
        prompt.len(),
        a.proposer,
        params.draft,
        a.temperature
    );

    // Speculative run, streamed.
    let spec = {
        let mut g = Generator::new(&mut *target, proposer)
            .with_detokenizer(GgufDetokenizer::new(tok.clone(), true));
        let mut out = std::io::stdout();
        let quiet = a.quiet;
        // With --quiet the text is not streamed, so a progress bar counts the tokens instead.
        let bar = quiet.then(|| {
            let b = indicatif::ProgressBar::new(a.max_tokens as u64);
            if let Ok(st) = indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} tokens {per_sec}",
            ) {
                b.set_style(st);
            }
            b
        });
        // The text arrives in whole characters; text that could still become a stop string is
        // held back until it cannot.
        let r = g.generate_stream(&prompt, &params, |chunk| {
            if let Some(b) = &bar {
                b.inc(chunk.tokens.len() as u64);
            }
            if !quiet {
                let _ = out.write_all(chunk.text.as_bytes());
                let _ = out.flush();
            }
            ControlFlow::Continue(())
        })?;
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        if quiet {
            print!("{}", r.text.as_deref().unwrap_or_default());
        }
        println!();
        r
    };
    println!();
    report("speculative", &spec);

    if a.compare {
        let plain_params = GenerationParams {
            draft: DraftLength::Off,
            ..params.clone()
        };
        let mut g = Generator::new(&mut *target, NoProposer);
        let plain = g.generate(&prompt, &plain_params)?;
        report("plain", &plain);
        let s = spec.metrics.decode_tokens_per_second();
        let p = plain.metrics.decode_tokens_per_second();
        println!(
            "speed-up (decode tokens/s, prefill excluded): {:.2}x  ({s:.1} vs {p:.1} tokens/s)",
            if p > 0.0 { s / p } else { 0.0 }
        );
        if a.temperature != 0.0 {
            println!(
                "(sampled runs: outputs differ from plain sampling token by token but follow the same distribution)"
            );
        } else {
            println!(
                "greedy outputs identical: {}",
                if spec.tokens == plain.tokens {
                    "yes"
                } else {
                    "NO"
                }
            );
        }
    }
    Ok(())
}

fn report(name: &str, g: &Generation) {
    let m = &g.metrics;
    println!(
        "[{name}] {} tokens ({}) in {:.2} s: {:.1} tokens/s end to end, {:.1} decode tokens/s; \
         prefill {:.0} ms, propose {:.0} ms, target forwards {:.0} ms, sampling/verification {:.0} ms",
        g.tokens.len(),
        g.finish,
        m.total_time.as_secs_f64(),
        m.tokens_per_second(),
        m.decode_tokens_per_second(),
        m.prefill_time.as_secs_f64() * 1e3,
        m.propose_time.as_secs_f64() * 1e3,
        m.forward_time.as_secs_f64() * 1e3,
        m.verify_time.as_secs_f64() * 1e3,
    );
    if m.tree_steps > 0 {
        println!(
            "[{name}] {} tree steps: {:.1} nodes and depth {:.1} per tree on average",
            m.tree_steps,
            m.mean_tree_nodes(),
            m.mean_tree_depth()
        );
    }
    if m.proposed > 0 {
        let per: Vec<String> = m
            .position_acceptance()
            .iter()
            .map(|a| format!("{a:.2}"))
            .collect();
        println!(
            "[{name}] acceptance rate {:.3} ({} of {} drafts), mean accepted length {:.2} tokens per target call ({} calls), acceptance by draft position given the earlier ones were accepted [{}]",
            m.acceptance_rate(),
            m.accepted,
            m.proposed,
            m.mean_accepted_length(),
            m.target_calls,
            per.join(", ")
        );
    }
}

/// A token-recycling proposer over `vocab` ids, with the table of `table` when given.
/// The table keeps the `top_k` it was warmed with; its vocabulary must be the target's.
fn recycling(vocab: usize, table: &Option<PathBuf>) -> Result<TokenRecycling, DynError> {
    let Some(path) = table else {
        return Ok(TokenRecycling::new(vocab, RecyclingConfig::default())?);
    };
    let mut file = std::io::BufReader::new(std::fs::File::open(path)?);
    let r = TokenRecycling::load(&mut file, TreeTemplate::default())?;
    if r.vocab_size() != vocab {
        return Err(format!(
            "{}: a table for {} token ids, the model has {vocab}",
            path.display(),
            r.vocab_size()
        )
        .into());
    }
    Ok(r)
}
