//! `spec-bench serve`: every mode at every load and prefix-reuse mode, one process, the same
//! weights (a module of the binary; the driver and the figures are in `spec_bench::serve` and
//! `spec_bench::serve_reuse`).

use std::path::PathBuf;

use spec_bench::report::write_json;
use spec_bench::serve::{
    Cell, Load, LoadRun, PromptBuilder, ServeMode, ServeReport, ServeRequest, Turn, batch_table,
    concurrency_markdown, cost_table_from_steps, drive_conversations, mark_mismatches, markdown,
    peak_rss_kib, plots, prediction_markdown, predictions, repeat_requests, reset_peak_rss,
    summarize,
};
use spec_bench::serve_reuse::{
    NoPrefixCopy, ReuseMode, reuse_check_line, reuse_checks, reuse_markdown, speedup_markdown,
};
use spec_bench::{BenchError, Result, workload};
use speculative::decode::{BatchConfig, BatchGenerator, BatchRequest};
use speculative::propose::{DraftModelProposer, SharedCorpus};
use speculative::{BatchTarget, NoProposer, PerSlot, Proposer};
use speculative_candle::fast::head::{DraftHead, DraftHeadWeights};
use speculative_candle::fast::{FastBatch, FastFormat, FastTarget, FastWeights};
use speculative_candle::{ChatMessage, GgufTokenizer, default_model_path};

use crate::{ServeArgs, bad_arg, io, llama_batch, named_proposer, single_backend};

/// The batch target of a serve run.
type Target = Box<dyn BatchTarget + Send>;

/// What the loads of one run share.
struct Setup {
    tok: GgufTokenizer,
    weights: std::sync::Arc<FastWeights>,
    path: PathBuf,
    slots: usize,
    config: BatchConfig,
    max_ctx: usize,
    /// The system message of every request (`--system-prompt`).
    system: Option<String>,
}

/// `spec-bench serve`.
pub(crate) fn serve(a: ServeArgs) -> Result<()> {
    let modes = a
        .modes
        .iter()
        .map(|m| ServeMode::parse(m))
        .collect::<Result<Vec<_>>>()?;
    let reuse = ReuseMode::parse_list(&a.prefix_reuse)?;
    if a.concurrency.contains(&0) {
        return Err(bad_arg("--concurrency", "must be at least 1".into()));
    }
    let (setup, mut target) = setup(&a)?;
    let base = base_requests(&a, &setup)?;
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let n = a.requests.unwrap_or(base.len().max(2 * max_c));
    let load_requests = repeat_requests(&base, n);
    let proposers = Proposers::new(&a, target.vocab_size(), &setup.weights)?;
    let eos = [setup.tok.eos_id()];
    let mut loads: Vec<Load> = a.concurrency.iter().map(|&c| Load::Closed(c)).collect();
    loads.extend(a.rate.iter().map(|&rate| Load::Open { rate, seed: a.seed }));
    let mut build =
        |turns: &[(String, Vec<u32>)], message: &str| turn_prompt(&setup, turns, message);
    if a.warmup > 0 {
        let warm = repeat_requests(&base, a.warmup);
        let mut generator = BatchGenerator::with_config(target, setup.config.clone())?;
        let mut make = |r: &ServeRequest| {
            Ok(BatchRequest::new(
                r.prompt.clone(),
                ServeMode::Plain.params(r.max_tokens, &eos),
                Box::new(NoProposer),
            ))
        };
        let run = drive_conversations(
            &mut generator,
            &warm,
            &Load::Closed(1),
            &mut make,
            &mut build,
        );
        target = generator.into_target();
        run?;
    }
    let mut cells = Vec::new();
    // Every reuse mode and mode at one load, then the next load: the ratios at the same load
    // are measured minutes apart at most, whatever the machine's drift over the whole run.
    for (li, load) in loads.iter().enumerate() {
        for (ri, &r) in reuse.iter().enumerate() {
            for (mi, &mode) in modes.iter().enumerate() {
                let shared = (a.shared_corpus > 0).then(|| SharedCorpus::new(a.shared_corpus));
                let mut make = |q: &ServeRequest| -> Result<BatchRequest> {
                    let proposer: Box<dyn Proposer + Send> = if mode.speculative() {
                        proposers.make(shared.as_ref())?
                    } else {
                        Box::new(NoProposer)
                    };
                    Ok(BatchRequest::new(
                        q.prompt.clone(),
                        mode.params(q.max_tokens, &eos),
                        proposer,
                    ))
                };
                let (t, run) = run_load(
                    target,
                    &setup.config,
                    r,
                    &load_requests,
                    load,
                    &mut make,
                    &mut build,
                )?;
                target = t;
                let run = run?;
                let mut summary = summarize(mode, *load, &run, peak_rss_kib());
                summary.reuse = r;
                eprintln!(
                    "{} {} {}: {:.1} tok/s, TTFT p50 {:.0} ms, prefilled {:.1} tok/request ({:.0}% reused), mean acc. len {:.2}",
                    mode.label(),
                    load.label(),
                    r.label(),
                    summary.tokens_per_s,
                    summary.ttft_p50_s * 1e3,
                    summary.prompt_prefilled as f64 / summary.requests.max(1) as f64,
                    summary.reused_share() * 100.0,
                    summary.mean_accepted_length
                );
                cells.push(((ri, mi, li), Cell { summary, run }));
            }
        }
    }
    // Reported by reuse mode, then mode, then load, in the order given.
    cells.sort_by_key(|c| c.0);
    let cells: Vec<Cell> = cells.into_iter().map(|c| c.1).collect();
    write_report(&a, &setup, n, cells)
}

/// Loads the weights, the tokenizer and the batch target.
fn setup(a: &ServeArgs) -> Result<(Setup, Target)> {
    if single_backend(&a.model)? != "fast" {
        return Err(bad_arg(
            "--backend",
            format!(
                "{} (serve runs the fast backend; llama.cpp through --batch-target llama)",
                a.model.backend.join(",")
            ),
        ));
    }
    let format = match a.model.format.as_str() {
        "q8" | "q8_0" => FastFormat::Q8,
        "f32" => FastFormat::F32,
        other => return Err(bad_arg("--format", format!("{other} (fast: q8 or f32)"))),
    };
    let path = a.model.model.clone().unwrap_or_else(default_model_path);
    let weights = FastWeights::load(&path, format)?;
    let tok = GgufTokenizer::load(&path)?;
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let slots = a.slots.unwrap_or(max_c).max(1);
    let threads = a.model.threads;
    let target: Target = match a.batch_target.as_str() {
        "fast-batch" => Box::new(FastBatch::new(weights.clone(), slots)?.with_threads(threads)),
        "per-slot" => Box::new(PerSlot::new(
            (0..slots)
                .map(|_| FastTarget::new(weights.clone()).with_threads(threads))
                .collect(),
        )?),
        "llama" => llama_batch(&a.model, &path, slots, threads)?,
        other => {
            return Err(bad_arg(
                "--batch-target",
                format!("{other} (expected fast-batch, per-slot or llama)"),
            ));
        }
    };
    let defaults = BatchConfig::default();
    let config = defaults
        .clone()
        .with_max_batch_tokens(a.max_batch_tokens.unwrap_or(defaults.max_batch_tokens))
        .with_prefill_chunk(a.prefill_chunk.unwrap_or(defaults.prefill_chunk));
    let system = match &a.system_prompt {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .map_err(io(p))?
                .trim()
                .to_string(),
        ),
        None => None,
    };
    let setup = Setup {
        max_ctx: target.max_context(),
        tok,
        weights,
        path,
        slots,
        config,
        system,
    };
    Ok((setup, target))
}

/// The chat messages of a request: the system message (if any), the earlier turns (user
/// message, then the decoded output as the assistant's message) and the new user message.
fn messages(s: &Setup, turns: &[(String, Vec<u32>)], message: &str) -> Result<Vec<ChatMessage>> {
    let mut msgs = Vec::with_capacity(2 * turns.len() + 2);
    if let Some(sys) = &s.system {
        msgs.push(ChatMessage::system(sys.clone()));
    }
    for (user, reply) in turns {
        msgs.push(ChatMessage::user(user.clone()));
        msgs.push(ChatMessage::assistant(s.tok.decode(reply, true)?));
    }
    msgs.push(ChatMessage::user(message.to_string()));
    Ok(msgs)
}

/// The prompt of a conversation turn (see [`messages`]).
///
/// # Errors
/// [`BenchError::Invalid`] when it exceeds half the context.
fn turn_prompt(s: &Setup, turns: &[(String, Vec<u32>)], message: &str) -> Result<Vec<u32>> {
    let text = s.tok.apply_chat_template(&messages(s, turns, message)?)?;
    let prompt = s.tok.encode(&text)?;
    if prompt.len() > s.max_ctx / 2 {
        return Err(BenchError::Invalid {
            what: "workload",
            reason: format!(
                "a conversation turn of {} tokens exceeds half the context ({})",
                prompt.len(),
                s.max_ctx / 2
            ),
        });
    }
    Ok(prompt)
}

/// The workload's requests of the chosen kinds, chat template (and system prompt) applied;
/// requests with a session are conversation turns.
fn base_requests(a: &ServeArgs, s: &Setup) -> Result<Vec<ServeRequest>> {
    let requests = workload::load(&a.workload)?;
    let base: Vec<ServeRequest> = requests
        .iter()
        .enumerate()
        .filter(|(_, r)| a.kinds.is_empty() || a.kinds.contains(&r.kind))
        .map(|(i, r)| {
            let text = s.tok.apply_chat_template(&messages(s, &[], &r.prompt)?)?;
            let mut prompt = s.tok.encode(&text)?;
            prompt.truncate(s.max_ctx / 2);
            let max_tokens = r.max_tokens.unwrap_or(a.max_tokens);
            Ok(ServeRequest {
                index: 0,
                source: i,
                kind: r.kind.clone(),
                prompt,
                max_tokens: a.max_tokens_cap.map_or(max_tokens, |c| max_tokens.min(c)),
                turn: r.session.as_ref().map(|session| Turn {
                    session: session.clone(),
                    message: r.prompt.clone(),
                }),
            })
        })
        .collect::<Result<_>>()?;
    if base.is_empty() {
        return Err(bad_arg("--kinds", "no request of these kinds".into()));
    }
    Ok(base)
}

/// The speculative modes' proposer (`--proposer`), one fresh per request.
struct Proposers {
    name: String,
    vocab: usize,
    /// The EAGLE head's weights, loaded once when the proposer names `draft-head`.
    head: Option<std::sync::Arc<DraftHeadWeights>>,
}

impl Proposers {
    fn new(a: &ServeArgs, vocab: usize, weights: &std::sync::Arc<FastWeights>) -> Result<Self> {
        let head = if a.proposer.contains("draft-head") {
            Some(DraftHeadWeights::load(
                a.draft_head
                    .clone()
                    .unwrap_or_else(speculative_candle::default_head_path),
                weights.clone(),
            )?)
        } else {
            None
        };
        let p = Proposers {
            name: a.proposer.clone(),
            vocab,
            head,
        };
        // Check the name once, before any load.
        p.make(None)?;
        Ok(p)
    }

    fn make(&self, shared: Option<&SharedCorpus>) -> Result<Box<dyn Proposer + Send>> {
        let head = |name: &str| -> Result<Box<dyn Proposer + Send>> {
            if name != "draft-head" {
                return Err(bad_arg(
                    "proposer",
                    format!("{name}: serve takes draft-head"),
                ));
            }
            let hw = self
                .head
                .clone()
                .ok_or_else(|| bad_arg("proposer", "draft head weights not loaded".into()))?;
            Ok(Box::new(DraftModelProposer::new(DraftHead::new(hw))))
        };
        named_proposer(&self.name, self.vocab, None, &head, shared)
    }
}

/// One load in one reuse mode: a fresh `BatchGenerator` over `target` (reuse off:
/// `with_prefix_reuse(false)`; no copy: the target behind [`NoPrefixCopy`]). Gives the target
/// back with the load's outcome.
///
/// # Errors
/// [`BatchConfig::validate`]'s (the target is then lost).
fn run_load(
    target: Target,
    config: &BatchConfig,
    reuse: ReuseMode,
    requests: &[ServeRequest],
    load: &Load,
    make: &mut dyn FnMut(&ServeRequest) -> Result<BatchRequest>,
    build: &mut PromptBuilder<'_>,
) -> Result<(Target, Result<LoadRun>)> {
    reset_peak_rss();
    if reuse == ReuseMode::NoCopy {
        let mut g = BatchGenerator::with_config(NoPrefixCopy(target), config.clone())?;
        let run = drive_conversations(&mut g, requests, load, make, build);
        return Ok((g.into_target().0, run));
    }
    let mut g =
        BatchGenerator::with_config(target, config.clone())?.with_prefix_reuse(reuse.reuse());
    let run = drive_conversations(&mut g, requests, load, make, build);
    Ok((g.into_target(), run))
}

/// Writes serve.json, records.json, the cost tables, the plots and serve.md, and prints
/// serve.md.
fn write_report(a: &ServeArgs, s: &Setup, n: usize, mut cells: Vec<Cell>) -> Result<()> {
    let mismatches = mark_mismatches(&mut cells);
    let checks = reuse_checks(&cells);
    let source = format!(
        "spec-bench serve: workload {} (kinds {}){}, {} requests per load, model {} (fast {}, {} thread(s)), {} slots ({}), proposer {}, shared suffix corpus {} tokens, prefix reuse {}",
        a.workload.display(),
        if a.kinds.is_empty() {
            "all".to_string()
        } else {
            a.kinds.join("+")
        },
        a.system_prompt
            .as_ref()
            .map(|p| format!(", system prompt {}", p.display()))
            .unwrap_or_default(),
        n,
        s.path
            .canonicalize()
            .unwrap_or_else(|_| s.path.clone())
            .display(),
        a.model.format,
        a.model.threads,
        s.slots,
        a.batch_target,
        a.proposer,
        a.shared_corpus,
        a.prefix_reuse,
    );
    let steps: Vec<_> = cells
        .iter()
        .flat_map(|c| c.run.steps.iter().copied())
        .collect();
    let cost_rows = cost_table_from_steps(
        &steps,
        &format!("median batched-forward time per row count over every step of `{source}`"),
    )?;
    let preds = predictions(&cells, &cost_rows, &s.config);
    let report = ServeReport {
        source: source.clone(),
        cells: cells.iter().map(|c| c.summary.clone()).collect(),
        cost_rows: cost_rows.clone(),
        predictions: preds.clone(),
        mismatches,
        reuse_checks: checks.clone(),
    };
    std::fs::create_dir_all(&a.out).map_err(io(&a.out))?;
    write_json(&a.out.join("serve.json"), &report)?;
    write_json(&a.out.join("records.json"), &cells)?;
    write_json(&a.out.join("cost-rows.json"), &cost_rows)?;
    let mut bs: Vec<usize> = a.concurrency.clone();
    bs.sort_unstable();
    bs.dedup();
    write_json(
        &a.out.join("cost-table.json"),
        &batch_table(&cost_rows, &bs, &[1, 2, 3, 5, 9])?,
    )?;
    plots(&a.out, &report.cells)?;
    let md = format!(
        "{source}\n\n{}\nGreedy outputs differing between loads: {mismatches}.\n{}\n\n## Prefix reuse\n\n{}\n## Speculative over plain decoding, and reuse on over off\n\n{}\n## Closed loop by concurrency\n\n{}\n## Simulated against measured (closed loop)\n\n{}",
        markdown(&report.cells),
        reuse_check_line(&checks),
        reuse_markdown(&report.cells),
        speedup_markdown(&report.cells),
        concurrency_markdown(&report.cells),
        prediction_markdown(&preds)
    );
    let p = a.out.join("serve.md");
    std::fs::write(&p, &md).map_err(io(&p))?;
    println!("{md}");
    println!("wrote {}", a.out.display());
    Ok(())
}
