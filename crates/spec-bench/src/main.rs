//! `spec-bench`: benchmark speculative decoding on a GGUF model, or simulate batch sizes.
//!
//! ```text
//! cargo run --release -p spec-bench -- run --workload docs/workloads/smollm2.jsonl --out bench-out
//! cargo run --release -p spec-bench -- simulate --cost docs/cost-tables/cpu-smollm2-fast-q8.json \
//!     --runs bench-out/runs.json --out sim-out
//! cargo run --release -p spec-bench -- replay --workload docs/workloads/smollm2.jsonl \
//!     --runs bench-out/runs.json --cost docs/cost-tables/cpu-smollm2-fast-q8.json --out replay-out
//! cargo run --release -p spec-bench -- replay --workload docs/workloads/smollm2.jsonl \
//!     --runs bench-out/runs.json --cost docs/cost-tables/cpu-smollm2-fast-q8.json \
//!     --k 8 --nodes 8,16,32,64 --out replay-tree-out
//! cargo run --release -p spec-bench -- serve --workload docs/workloads/smollm2.jsonl \
//!     --kinds rewrite,code-edit --concurrency 1,2,4,8,16 --rate 2 --out serve-out
//! cargo run --release -p spec-bench -- warm-recycling --workload docs/workloads/warmup.jsonl \
//!     --out recycling-table.bin
//! cargo run --release -p spec-bench -- run --workload docs/workloads/agentic.jsonl --carry \
//!     --proposers recycling,merged:prompt-lookup+suffix+recycling --k adaptive --tree-nodes 16 \
//!     --recycling-table recycling-table.bin --out agentic-out
//! ```

mod cmd_serve;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use spec_bench::draft_model::{DraftModel, TargetText};
use spec_bench::matrix::{Matrix, PreparedRequest, Turn, run_matrix};
use spec_bench::replay::{
    CostCurve, MARKDOWN_NOTES as REPLAY_NOTES, ReplayRow, ReplayStats, TREE_MARKDOWN_NOTES, Trace,
    markdown as replay_markdown, oracle, replay, replay_tree, tree_markdown,
};
use spec_bench::report::{
    aggregate, markdown, request_markdown, sim_markdown, sim_plot, standard_plots, write_json,
};
use spec_bench::run::{ConfigSpec, DraftSpec, RunRecord, token_hash};
use spec_bench::sim::{AcceptanceModel, CostTable, default_batches, simulate_draft};
use spec_bench::{BenchError, Result, workload};
use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions, TreeDrafts};
use speculative::propose::{
    DraftModelProposer, MergePolicy, MergedProposer, PromptLookup, RecyclingConfig, SharedCorpus,
    SuffixConfig, SuffixProposer, TokenRecycling, TreeTemplate,
};
use speculative::{BatchTarget, NoProposer, Proposer, TargetModel};
use speculative_candle::fast::head::{DraftHead, DraftHeadWeights};
use speculative_candle::fast::{FastFormat, FastTarget, FastWeights};
use speculative_candle::{
    CandleTarget, ChatMessage, GgufTokenizer, LlamaWeights, LoadOptions, WeightFormat,
    default_model_path,
};
use speculative_guidance::{Grammar, Vocabulary};

#[derive(Parser)]
#[command(version, about = "Reproducible speculative-decoding benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run a workload against plain decoding and a matrix of speculative configurations.
    Run(RunArgs),
    /// Simulate the expected speed-up over batch sizes from a cost table and acceptance data.
    Simulate(SimArgs),
    /// Measure a cost table c(batch, tokens) for the simulator on this machine.
    CostTable(CostArgs),
    /// Replay recorded greedy generations through model-free proposers without the model, and
    /// bound what any proposer copying from the request's own context could accept (the copy
    /// oracle; see the `spec_bench::replay` docs).
    Replay(ReplayArgs),
    /// Warm a token-recycling table: greedy generations over a workload of generic prompts with
    /// a `recycling` proposer, whose table fills from every verified row; the table is written
    /// to a file for `run --recycling-table`.
    WarmRecycling(WarmArgs),
    /// Serve many requests at once through continuous batching: plain batched decoding
    /// against speculative modes (fixed k, goodput policy), closed loop at several concurrencies
    /// and open loop at Poisson arrival rates; throughput, TTFT, TPOT, ITL, peak RSS, and the
    /// simulator's predicted throughput from the run's measured cost table.
    Serve(ServeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// JSONL workload. Requests with a `session` are the turns of a conversation: a turn is
    /// submitted when its previous turn has finished, with the conversation so far (the
    /// outputs generated in the same load) as its prompt and the session as its conversation
    /// key (`BatchRequest::with_conversation`).
    #[arg(long)]
    workload: PathBuf,
    /// Only requests of these kinds (default: all).
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<String>,
    /// Backend and model options (fast backend only).
    #[command(flatten)]
    model: ModelArgs,
    /// Proposer of the speculative modes, as in `run` (one fresh proposer per request):
    /// prompt-lookup, suffix, recycling (empty table), draft-head, merged:A+B+...
    #[arg(long, default_value = "merged:prompt-lookup+suffix")]
    proposer: String,
    /// The EAGLE draft head of the `draft-head` proposer (default: the shipped head).
    #[arg(long)]
    draft_head: Option<PathBuf>,
    /// Share one suffix corpus of at most this many tokens between the suffix proposers of a
    /// load's requests (`SharedCorpus`; 0 = each request alone). Requests repeat the workload's
    /// prompts, so later repeats can copy an earlier identical request's output.
    #[arg(long, default_value_t = 0)]
    shared_corpus: usize,
    /// Modes, run in this order: plain, fixed:K, goodput[:MAX].
    #[arg(long, value_delimiter = ',', default_value = "plain,fixed:4,goodput:8")]
    modes: Vec<String>,
    /// Closed-loop concurrencies (requests kept in flight).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    concurrency: Vec<usize>,
    /// Open-loop Poisson arrival rates, requests per second (default: none).
    #[arg(long, value_delimiter = ',')]
    rate: Vec<f64>,
    /// Seed of the open-loop arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Requests per load (the workload's prompts repeated in order; default: the workload's
    /// count, at least twice the largest concurrency).
    #[arg(long)]
    requests: Option<usize>,
    /// Default maximum new tokens (a request's max_tokens wins).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Cap on every request's max_tokens (for short smoke runs).
    #[arg(long)]
    max_tokens_cap: Option<usize>,
    /// Sequence slots of the batch target (default: the largest concurrency; open-loop
    /// requests beyond it wait in the generator's queue).
    #[arg(long)]
    slots: Option<usize>,
    /// Rows of one batched forward at most (default: BatchConfig::default()).
    #[arg(long)]
    max_batch_tokens: Option<usize>,
    /// Prompt rows a request prefills per step (default: BatchConfig::default()).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Batch target: fast-batch (`FastBatch`: one forward over the rows of every sequence,
    /// each weight block read once) or per-slot (one `FastTarget` per slot run one after the
    /// other: the same logits, no batching speed).
    #[arg(long, default_value = "fast-batch")]
    batch_target: String,
    /// Warm-up requests (the first ones of the load, plain decoding, one at a time), run
    /// before the measured loads and discarded.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Prefix reuse modes, each run at every load with every mode: `on` (a request keeps the
    /// prefix its slot's cache holds, and copies the longest shared prefix from another slot
    /// when the target can: the `BatchGenerator` default), `off` (every request prefills its
    /// whole prompt), `no-copy` (reuse on, prefix copy hidden), `both` (= `off,on`); a
    /// comma-separated list. With `off` and another mode, the greedy outputs of every request
    /// are compared between them (serve.md says the result).
    #[arg(long, default_value = "both")]
    prefix_reuse: String,
    /// A text file whose content is the system message of every request (a shared system
    /// prompt; for example docs/workloads/system-prompt.txt).
    #[arg(long)]
    system_prompt: Option<PathBuf>,
    /// Output directory for serve.json, records.json, serve.md, cost tables and plots.
    #[arg(long, default_value = "serve-out")]
    out: PathBuf,
}

#[derive(Args)]
struct WarmArgs {
    /// JSONL workload of warm-up prompts (docs/workloads/warmup.jsonl: 200 generic prompts).
    #[arg(long)]
    workload: PathBuf,
    /// Backend and model options, as for `run`.
    #[command(flatten)]
    model: ModelArgs,
    /// Successor candidates kept per token id (the table is vocab x top-k u32 ids).
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    /// Draft depth of the warm-up generations.
    #[arg(long, default_value_t = 4)]
    k: usize,
    /// Node budget of the warm-up generations' tree drafts (every node's row teaches the table).
    #[arg(long, default_value_t = 16)]
    tree_nodes: usize,
    /// Default maximum new tokens (a request's max_tokens wins).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Output file of the table.
    #[arg(long, default_value = "recycling-table.bin")]
    out: PathBuf,
}

#[derive(Args)]
struct ReplayArgs {
    /// The workload the runs were recorded from (prompts are re-tokenised with the model's
    /// tokenizer and chat template).
    #[arg(long)]
    workload: PathBuf,
    /// runs.json of a greedy `spec-bench run` on that workload: the output of every request is
    /// taken from a run whose output equals plain greedy decoding.
    #[arg(long)]
    runs: PathBuf,
    /// Cost table; its batch-1 row gives the forward cost curve c(n) (made non-decreasing).
    #[arg(long)]
    cost: PathBuf,
    /// GGUF file holding the tokenizer (default: the model of `run`).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Proposers: prompt-lookup, prompt-lookup:MIN-MAX (n-gram sizes), suffix,
    /// suffix:MIN_CONFIDENCE (SuffixConfig::min_confidence).
    #[arg(long, value_delimiter = ',', default_value = "prompt-lookup,suffix")]
    proposers: Vec<String>,
    /// Draft lengths (for trees: the depth bound).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    k: Vec<usize>,
    /// Node budgets of tree drafts (e.g. 8,16,32,64): for each budget n and each k, the
    /// proposers' trees (`Proposer::propose_tree`, at most n nodes, depth at most k) are
    /// replayed next to their chains of the same budget (depth min(n, k)). Default: none.
    #[arg(long, value_delimiter = ',')]
    nodes: Vec<usize>,
    /// Longest n-gram the copy oracle matches.
    #[arg(long, default_value_t = 8)]
    oracle_max_n: usize,
    /// Output directory for replay.json and replay.md.
    #[arg(long, default_value = "replay-out")]
    out: PathBuf,
}

#[derive(Args)]
struct CostArgs {
    /// Backend and model options, as for `run`.
    #[command(flatten)]
    model: ModelArgs,
    /// Batch sizes of the table.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    batch: Vec<usize>,
    /// Tokens per sequence of the table (must include 1).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,5,9")]
    tokens: Vec<usize>,
    /// Prefix length (tokens already in the KV cache) for every measurement.
    #[arg(long, default_value_t = 100)]
    prefix: usize,
    /// Repetitions per cell; the median is kept.
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Output JSON file.
    #[arg(long, default_value = "cost-table.json")]
    out: PathBuf,
}

#[derive(Args)]
struct RunArgs {
    /// JSONL workload: {"prompt": ..., "kind": ..., "max_tokens": ...} per line.
    #[arg(long)]
    workload: PathBuf,
    /// Backend and model options.
    #[command(flatten)]
    model: ModelArgs,
    /// Proposers: prompt-lookup, suffix, recycling (token recycling), draft-head (the EAGLE
    /// head, --draft-head), draft-model:FILE (any GGUF as the draft model on the fast forward:
    /// same tokenizer as the target -> token drafts; another tokenizer -> cross-vocabulary
    /// drafts, re-tokenised for greedy requests and TLI for sampling; the report says which),
    /// merged:A+B+... (one tree merged from those, cost-aware, e.g.
    /// merged:draft-head+prompt-lookup+suffix), merged-reach:A+B+... (the same members under the
    /// rule before the cost-aware one: every member every step, the budget filled by reach),
    /// early-exit:N (first N layers as draft), same-model.
    #[arg(long, value_delimiter = ',', default_value = "prompt-lookup,suffix")]
    proposers: Vec<String>,
    /// Draft lengths: integers and/or adaptive[:max]. With tree drafts, the tree depth.
    #[arg(long, value_delimiter = ',', default_value = "4")]
    k: Vec<String>,
    /// Node budgets of tree drafts (0 = chains), crossed with every --k (the depth): for example
    /// `--k 8,16 --tree-nodes 0,16` runs chains of 8 and 16 and trees of 16 nodes of depth 8 and
    /// 16, so a tree and a chain of the same budget run side by side. Needs a backend with tree
    /// support (fast); others fall back to chains.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    tree_nodes: Vec<usize>,
    /// Branching limits of tree drafts (most children per node; 0 = the proposer's choice),
    /// crossed with every tree configuration (--tree-nodes above 0).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    tree_branch: Vec<usize>,
    /// Temperatures (0 = greedy).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    temperature: Vec<f32>,
    /// Top-p values.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    top_p: Vec<f32>,
    /// Seeds.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    seeds: Vec<u64>,
    /// Repetitions per (request, configuration).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Warm-up generations per configuration (first request, discarded).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Default maximum new tokens (a request's max_tokens wins).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Only the first N requests of the workload (after --kinds).
    #[arg(long)]
    limit: Option<usize>,
    /// Only requests of these kinds (default: all), e.g. `--kinds rewrite`.
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<String>,
    /// A token-recycling table warmed by `spec-bench warm-recycling` (any `--top-k`; its
    /// vocabulary must be the model's), loaded into every `recycling` proposer (alone or merged)
    /// of the run; without it the tables start empty (top-k 8).
    #[arg(long)]
    recycling_table: Option<PathBuf>,
    /// The EAGLE draft head of the `draft-head` proposer (alone or merged; fast backend only;
    /// default: the shipped head, `speculative_candle::default_head_path`).
    #[arg(long)]
    draft_head: Option<PathBuf>,
    /// Keep each configuration's proposer across the requests of a repetition (suffix corpus
    /// and token-recycling table carry over, as in a server; the baseline runs the same
    /// requests in the same order). Without it every run starts from a fresh proposer.
    #[arg(long)]
    carry: bool,
    /// Start every run of a configuration from the adaptive policy's cost estimates (forward
    /// cost curve, proposing time; not acceptance) that its earlier runs measured, warm-up
    /// included, as a server keeps them; without it each run's policy starts fresh and spends
    /// its first step measuring the curve.
    #[arg(long)]
    carry_costs: bool,
    /// Output directory for runs.json, summary.json, summary.md and the plots.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// A JSON schema file constraining every request without its own `json_schema` /
    /// `grammar` (structured output through llguidance, baseline included).
    #[arg(long, conflicts_with = "grammar")]
    json_schema: Option<PathBuf>,
    /// A Lark grammar file, as --json-schema.
    #[arg(long)]
    grammar: Option<PathBuf>,
    /// Under a grammar, do not put the grammar-forced tokens in front of the proposers' drafts.
    #[arg(long)]
    no_forced_drafts: bool,
    /// Prefix reuse across the turns of a conversation (and consecutive requests): `on` (each
    /// run starts from the cache its conversation's previous turn left, as a server keeps it),
    /// `off` (a full prefill per run), or `both` (every run in both modes, each with its own
    /// baseline; reuse-on records are labelled ` +reuse`).
    #[arg(long, default_value = "on")]
    prefix_reuse: String,
    /// Feed the prompt tokens each run has left to prefill (the new message of a turn after
    /// prefix reuse, or a whole prompt) in its first verify forward instead of a prefill
    /// forward of their own (`Generator::with_fused_prefill`): `on` (the default) or `off`.
    /// Applies to the plain baselines and to proposers that draft from tokens alone. Such a
    /// run has no separate prefill (its time is in the first forward), so its decode speed-up
    /// equals its end-to-end one; run `off` for the decode speed-up without the prefill.
    #[arg(long, default_value = "on")]
    fused_prefill: String,
}

#[derive(Args)]
struct ModelArgs {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf or $SPECULATIVE_MODEL).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Forward implementation: fast (our multi-row batch-invariant kernels), candle, or llama
    /// (llama.cpp; spec-bench built with `--features llama`). `run` and `cost-table` take a
    /// list (`fast,llama`) and measure every engine in one invocation, one after the other;
    /// `--engine` is the same option.
    #[arg(long, alias = "engine", value_delimiter = ',', default_value = "fast")]
    backend: Vec<String>,
    /// Weight format: q8 or f32 (candle also accepts as-stored).
    #[arg(long, default_value = "q8")]
    format: String,
    /// Threads of the fast backend's matmuls and of llama.cpp.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// llama backend: run a copy of the model re-quantized by llama.cpp's quantizer (q8_0 or
    /// q4_0; made once beside the model, `speculative_llama::quantized_copy`) instead of the
    /// file as stored. llama.cpp has no multi-row CPU kernel for Q4_1, so on the shipped file a
    /// verify call costs about one step per row.
    #[arg(long)]
    llama_quant: Option<String>,
}

#[derive(Args)]
struct SimArgs {
    /// JSON cost table {"source", "batch": [...], "tokens": [...], "cost": [[...]]}.
    #[arg(long)]
    cost: PathBuf,
    /// runs.json from `spec-bench run`: replay its recorded steps.
    #[arg(long)]
    runs: Option<PathBuf>,
    /// Only replay runs whose label contains this text.
    #[arg(long)]
    label: Option<String>,
    /// Constant per-position acceptance probability instead of recorded runs.
    #[arg(long)]
    acceptance: Option<f64>,
    /// Largest draft length k (`--max-k` is accepted as an alias).
    #[arg(long, alias = "max-k", default_value_t = 8)]
    max_draft: usize,
    /// A draft model's cost per drafted token as a fraction of the target's single-token
    /// forward `c(B, 1)` (0 = a free proposer; `sim::simulate_draft`).
    #[arg(long, default_value_t = 0.0)]
    draft_cost: f64,
    /// Output directory for simulation.json, simulation.md and simulation.svg.
    #[arg(long, default_value = "sim-out")]
    out: PathBuf,
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("spec-bench: error: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Run(a) => run(a),
        Cmd::Simulate(a) => sim(a),
        Cmd::CostTable(a) => cost_table(a),
        Cmd::Replay(a) => replay_cmd(a),
        Cmd::WarmRecycling(a) => warm_recycling(a),
        Cmd::Serve(a) => cmd_serve::serve(a),
    }
}

fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> BenchError + '_ {
    move |e| BenchError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

fn run(a: RunArgs) -> Result<()> {
    let mut requests = workload::load(&a.workload)?;
    requests.retain(|r| a.kinds.is_empty() || a.kinds.contains(&r.kind));
    if requests.is_empty() {
        return Err(bad_arg("--kinds", "no request of these kinds".into()));
    }
    let requests = &requests[..a.limit.unwrap_or(requests.len()).min(requests.len())];
    let path = a.model.model.clone().unwrap_or_else(default_model_path);
    let mut records: Vec<RunRecord> = Vec::new();
    let notes = std::cell::RefCell::new(Vec::new());
    for backend in &a.model.backend {
        let tok = TargetText::load(&path, backend)?;
        let mut recs = run_engine(&a, backend, &path, &tok, requests, &notes)?;
        // Several engines in one run: each engine's records (baseline included) are labelled
        // with it, so that the summary groups them apart.
        if a.model.backend.len() > 1 {
            for r in &mut recs {
                r.label = format!("{backend}: {}", r.label);
            }
        }
        records.extend(recs);
    }
    std::fs::create_dir_all(&a.out).map_err(io(&a.out))?;
    let aggs = aggregate(&records);
    write_json(&a.out.join("runs.json"), &records)?;
    write_json(&a.out.join("summary.json"), &aggs)?;
    let mut md = format!(
        "{}\n## Every request\n\n{}",
        markdown(&aggs),
        request_markdown(&records)
    );
    // How each draft model was paired with the target (same tokenizer or cross-vocabulary).
    if let Some(t) = spec_bench::report::ttft_markdown(&records) {
        md.push_str(&format!(
            "\n## Time to first token against the prefilled tokens\n\n{t}"
        ));
    }
    let notes = notes.into_inner();
    if !notes.is_empty() {
        md.push_str("\n## Draft models\n\n");
        for n in &notes {
            md.push_str(&format!("- {n}\n"));
        }
    }
    let md_path = a.out.join("summary.md");
    std::fs::write(&md_path, &md).map_err(io(&md_path))?;
    standard_plots(&a.out, &records, &aggs)?;
    println!("{md}");
    println!("wrote {}", a.out.display());
    Ok(())
}

/// One engine's part of `run`: its plain baseline and every configuration over the workload.
fn run_engine(
    a: &RunArgs,
    backend: &str,
    path: &std::path::Path,
    tok: &TargetText,
    requests: &[workload::Request],
    notes: &std::cell::RefCell<Vec<String>>,
) -> Result<Vec<RunRecord>> {
    let (mut target, make_model, fast_weights) = load_backend(&a.model, backend, path)?;
    let max_ctx = target.max_context();
    let default_grammar = match (&a.json_schema, &a.grammar) {
        (Some(p), _) => Some(
            Grammar::json_schema_str(&std::fs::read_to_string(p).map_err(io(p))?)
                .map_err(|e| bad_arg("--json-schema", e.to_string()))?,
        ),
        (None, Some(p)) => Some(Grammar::Lark(std::fs::read_to_string(p).map_err(io(p))?)),
        (None, None) => None,
    };
    let prepared: Vec<PreparedRequest> = requests
        .iter()
        .map(|r| {
            let text = tok.chat(&[ChatMessage::user(r.prompt.clone())])?;
            let mut prompt = tok.encode(&text)?;
            prompt.truncate(max_ctx / 2);
            Ok(PreparedRequest {
                kind: r.kind.clone(),
                prompt,
                max_tokens: r.max_tokens.unwrap_or(a.max_tokens),
                turn: r.session.as_ref().map(|s| Turn {
                    session: s.clone(),
                    message: r.prompt.clone(),
                }),
                grammar: match (&r.json_schema, &r.grammar) {
                    (Some(v), _) => Some(Grammar::JsonSchema(v.clone())),
                    (None, Some(g)) => Some(Grammar::Lark(g.clone())),
                    (None, None) => default_grammar.clone(),
                },
            })
        })
        .collect::<Result<_>>()?;
    // A conversation turn: the chat template over the earlier turns (user message, then the
    // decoded output as the assistant's message) and the new message.
    let mut build = |turns: &[(String, Vec<u32>)], message: &str| -> Result<Vec<u32>> {
        let mut msgs = Vec::with_capacity(2 * turns.len() + 1);
        for (user, reply) in turns {
            msgs.push(ChatMessage::user(user.clone()));
            msgs.push(ChatMessage::assistant(tok.decode(reply, true)?));
        }
        msgs.push(ChatMessage::user(message.to_string()));
        let prompt = tok.encode(&tok.chat(&msgs)?)?;
        if prompt.len() > max_ctx / 2 {
            return Err(BenchError::Invalid {
                what: "workload",
                reason: format!(
                    "a conversation turn of {} tokens exceeds half the context ({})",
                    prompt.len(),
                    max_ctx / 2
                ),
            });
        }
        Ok(prompt)
    };
    let mut configs = Vec::new();
    for p in &a.proposers {
        for k in &a.k {
            let draft = DraftSpec::parse(k).ok_or_else(|| BenchError::Invalid {
                what: "--k",
                reason: format!("{k} (expected an integer or adaptive[:max])"),
            })?;
            for &tree_nodes in &a.tree_nodes {
                // Chains have no branching to vary.
                let branches = if tree_nodes == 0 {
                    &[0][..]
                } else {
                    &a.tree_branch[..]
                };
                for &tree_branch in branches {
                    for &t in &a.temperature {
                        for &tp in &a.top_p {
                            for &seed in &a.seeds {
                                configs.push(ConfigSpec {
                                    proposer: p.clone(),
                                    draft,
                                    temperature: t,
                                    top_p: tp,
                                    seed,
                                    tree_nodes,
                                    tree_branch,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    let matrix = Matrix {
        configs,
        warmup: a.warmup,
        reps: a.reps,
        carry: a.carry,
        carry_costs: a.carry_costs,
        forced_drafts: !a.no_forced_drafts,
        fused_prefill: match a.fused_prefill.as_str() {
            "on" => true,
            "off" => false,
            other => return Err(bad_arg("--fused-prefill", format!("{other} (on or off)"))),
        },
        prefix_reuse: match a.prefix_reuse.as_str() {
            "on" => vec![true],
            "off" => vec![false],
            "both" => vec![false, true],
            other => {
                return Err(bad_arg(
                    "--prefix-reuse",
                    format!("{other} (on, off or both)"),
                ));
            }
        },
    };
    // The model's vocabulary for llguidance, when some request is constrained.
    let grammar_vocab = if prepared.iter().any(|r| r.grammar.is_some()) {
        let tok = tok.gguf().ok_or_else(|| {
            bad_arg(
                "grammar",
                "grammars need a byte-level BPE target".to_string(),
            )
        })?;
        let n = tok.vocab_size() as u32;
        let bytes = (0..n)
            .map(|i| tok.token_bytes(i).unwrap_or_default().to_vec())
            .collect();
        let special = (0..n).map(|i| tok.is_special(i)).collect();
        Some(
            Vocabulary::with_tokenizer(bytes, special, tok.eos_id(), tok.tokenizer().clone())
                .map_err(|e| bad_arg("grammar", e.to_string()))?,
        )
    } else {
        None
    };
    let keys = a.temperature.len() * a.top_p.len() * a.seeds.len();
    let total =
        (matrix.warmup + prepared.len() * matrix.reps * (matrix.configs.len() + keys)) as u64;
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let vocab = target.vocab_size();
    // A warmed token-recycling table, loaded into every recycling proposer of the run.
    let table = match &a.recycling_table {
        Some(p) => Some(std::fs::read(p).map_err(io(p))?),
        None => None,
    };
    // The draft head's weights, loaded on first use and shared by every `draft-head` proposer.
    let head_path = a
        .draft_head
        .clone()
        .unwrap_or_else(speculative_candle::default_head_path);
    let head_weights = std::cell::OnceCell::new();
    let target_weights = fast_weights.clone();
    // `draft-model:FILE` drafts, loaded on first use (one per file) and shared.
    let drafts = std::cell::RefCell::new(Vec::<(String, std::rc::Rc<DraftModel>)>::new());
    let threads = a.model.threads;
    let draft_model = move |file: &str| -> Result<Box<dyn Proposer + Send>> {
        let found = drafts
            .borrow()
            .iter()
            .find(|d| d.0 == file)
            .map(|d| d.1.clone());
        let d = match found {
            Some(d) => d,
            None => {
                let pieces = tok.pieces(path)?;
                let d = DraftModel::load(file.as_ref(), threads, &pieces, vocab, tok)?;
                eprintln!("spec-bench: {}", d.note());
                notes.borrow_mut().push(d.note().to_string());
                let d = std::rc::Rc::new(d);
                drafts.borrow_mut().push((file.to_string(), d.clone()));
                d
            }
        };
        d.proposer()
    };
    let head = move |name: &str| -> Result<Box<dyn Proposer + Send>> {
        if let Some(file) = name.strip_prefix("draft-model:") {
            return draft_model(file);
        }
        let Some(tw) = &target_weights else {
            return Err(bad_arg(
                "proposer",
                "draft-head needs the fast backend".to_string(),
            ));
        };
        if head_weights.get().is_none() {
            let hw = DraftHeadWeights::load(&head_path, tw.clone())?;
            let _ = head_weights.set(hw);
        }
        let hw = head_weights
            .get()
            .cloned()
            .ok_or_else(|| bad_arg("proposer", "draft head weights not loaded".to_string()))?;
        Ok(Box::new(DraftModelProposer::new(DraftHead::new(hw))))
    };
    let mut factory = move |name: &str| -> Result<Box<dyn Proposer>> {
        Ok(match name {
            "same-model" => Box::new(DraftModelProposer::new(make_model(None)?)),
            "none" => Box::new(NoProposer),
            other => {
                if let Some(n) = other.strip_prefix("early-exit:") {
                    let n: usize = n.parse().map_err(|_| BenchError::Invalid {
                        what: "proposer",
                        reason: format!("{other}: early-exit:N needs a layer count"),
                    })?;
                    Box::new(DraftModelProposer::new(make_model(Some(n))?))
                } else {
                    named_proposer(other, vocab, table.as_deref(), &head, None)?
                }
            }
        })
    };
    let eos = tok.eos_ids();
    let records: Vec<RunRecord> = run_matrix(
        grammar_vocab.as_ref(),
        &mut *target,
        &mut factory,
        &prepared,
        &eos,
        &matrix,
        &mut build,
        &mut |msg| {
            bar.inc(1);
            bar.set_message(msg.to_string());
        },
    )?;
    bar.finish_and_clear();
    Ok(records)
}

/// The proposers of `run` that can be merged, by name: `prompt-lookup`, `suffix`, `recycling`
/// (with the warmed `table` when given), `draft-head` (made by `head`) and `merged:A+B+...` (a
/// [`MergedProposer`] of those). Suffix proposers join the `shared` corpus when given.
fn named_proposer(
    name: &str,
    vocab: usize,
    table: Option<&[u8]>,
    head: &dyn Fn(&str) -> Result<Box<dyn Proposer + Send>>,
    shared: Option<&SharedCorpus>,
) -> Result<Box<dyn Proposer + Send>> {
    Ok(match name {
        "draft-head" => head(name)?,
        other if other.starts_with("draft-model:") => head(name)?,
        "prompt-lookup" => Box::new(PromptLookup::new(1, 4)?),
        "suffix" => {
            let p = SuffixProposer::new(SuffixConfig::default())?;
            Box::new(match shared {
                Some(c) => p.with_shared_corpus(c),
                None => p,
            })
        }
        "recycling" => match table {
            // The table's own top_k (`warm-recycling --top-k`), its vocabulary the target's.
            Some(mut bytes) => {
                let r = TokenRecycling::load(&mut bytes, TreeTemplate::default())?;
                if r.vocab_size() != vocab {
                    return Err(BenchError::Invalid {
                        what: "recycling table",
                        reason: format!(
                            "warmed for a vocabulary of {} ids, the target has {vocab}",
                            r.vocab_size()
                        ),
                    });
                }
                Box::new(r)
            }
            None => Box::new(TokenRecycling::new(vocab, RecyclingConfig::default())?),
        },
        other => {
            // `merged:` is the cost-aware merge (the default rule), `merged-reach:` the rule
            // before it (every member every step, the budget filled by reach probability).
            let (list, policy) = match (
                other.strip_prefix("merged:"),
                other.strip_prefix("merged-reach:"),
            ) {
                (Some(l), _) => (l, MergePolicy::CostAware),
                (_, Some(l)) => (l, MergePolicy::Reach),
                _ => {
                    return Err(BenchError::Invalid {
                        what: "proposer",
                        reason: format!(
                            "{other} (expected prompt-lookup, suffix, recycling, draft-head, draft-model:FILE, merged:A+B, merged-reach:A+B, early-exit:N, same-model, none)"
                        ),
                    });
                }
            };
            let subs = list
                .split('+')
                .map(|n| named_proposer(n, vocab, table, head, shared))
                .collect::<Result<Vec<_>>>()?;
            Box::new(MergedProposer::new(subs)?.with_policy(policy))
        }
    })
}

/// Makes a model: `None` the full model, `Some(n)` an early exit after `n` layers.
type ModelMaker = Box<dyn Fn(Option<usize>) -> Result<Box<dyn TargetModel>>>;

fn bad_arg(what: &'static str, reason: String) -> BenchError {
    BenchError::Invalid { what, reason }
}

/// The target, a maker of draft models sharing its weights, and (fast backend) the weights.
type Loaded = (
    Box<dyn TargetModel>,
    ModelMaker,
    Option<std::sync::Arc<FastWeights>>,
);

fn load_backend(a: &ModelArgs, backend: &str, path: &std::path::Path) -> Result<Loaded> {
    match backend {
        "fast" => {
            let format = match a.format.as_str() {
                "q8" | "q8_0" => FastFormat::Q8,
                "f32" => FastFormat::F32,
                other => return Err(bad_arg("--format", format!("{other} (fast: q8 or f32)"))),
            };
            let w = FastWeights::load(path, format)?;
            let fw = w.clone();
            let threads = a.threads;
            let target = Box::new(FastTarget::new(w.clone()).with_threads(threads));
            let make: ModelMaker = Box::new(move |layers| {
                Ok(match layers {
                    Some(n) => {
                        Box::new(FastTarget::early_exit(w.clone(), n)?.with_threads(threads))
                    }
                    None => Box::new(FastTarget::new(w.clone()).with_threads(threads)),
                })
            });
            Ok((target, make, Some(fw)))
        }
        "candle" => {
            let format = match a.format.as_str() {
                "q8" | "q8_0" => WeightFormat::Q8_0,
                "f32" => WeightFormat::F32,
                "as-stored" => WeightFormat::AsStored,
                other => {
                    return Err(bad_arg(
                        "--format",
                        format!("{other} (candle: q8, f32 or as-stored)"),
                    ));
                }
            };
            let w = LlamaWeights::load_with(path, &LoadOptions::with_format(format))?;
            let target = Box::new(CandleTarget::new(w.clone()));
            let make: ModelMaker = Box::new(move |layers| {
                Ok(match layers {
                    Some(n) => Box::new(CandleTarget::early_exit(w.clone(), n)?),
                    None => Box::new(CandleTarget::new(w.clone())),
                })
            });
            Ok((target, make, None))
        }
        "llama" => llama_backend(a, path),
        other => Err(bad_arg(
            "--backend",
            format!("{other} (expected fast, candle or llama)"),
        )),
    }
}

/// llama.cpp through `speculative-llama`: the target (context: the model's training length)
/// and a maker of draft models on the same weights (no early exit).
#[cfg(feature = "llama")]
fn llama_backend(a: &ModelArgs, path: &std::path::Path) -> Result<Loaded> {
    use speculative_llama::LlamaConfig;
    let llama = |e: speculative_llama::LlamaError| bad_arg("--backend llama", e.to_string());
    let engine = llama_engine(a, path)?;
    // The training context, capped: a long-context model would allocate its whole KV cache.
    let cfg = LlamaConfig::default()
        .with_threads(a.threads)
        .with_context(engine.context_train().min(8192));
    let target = Box::new(engine.target(&cfg).map_err(llama)?);
    let make: ModelMaker = Box::new(move |layers| match layers {
        Some(_) => Err(bad_arg(
            "proposer",
            "early-exit needs the fast or candle backend".to_string(),
        )),
        None => Ok(Box::new(engine.target(&cfg).map_err(llama)?)),
    });
    Ok((target, make, None))
}

/// The llama.cpp engine of `--backend llama`: the model file, or its re-quantized copy
/// (`--llama-quant`).
#[cfg(feature = "llama")]
fn llama_engine(a: &ModelArgs, path: &std::path::Path) -> Result<speculative_llama::LlamaEngine> {
    use speculative_llama::{LlamaEngine, ModelOptions, Quantization, quantized_copy};
    let llama = |e: speculative_llama::LlamaError| bad_arg("--backend llama", e.to_string());
    let file = match &a.llama_quant {
        None => path.to_path_buf(),
        Some(q) => {
            let to = Quantization::parse(q)
                .ok_or_else(|| bad_arg("--llama-quant", format!("{q} (expected q8_0 or q4_0)")))?;
            quantized_copy(path, to, 2).map_err(llama)?
        }
    };
    LlamaEngine::load(&file, &ModelOptions::default()).map_err(llama)
}

#[cfg(not(feature = "llama"))]
fn llama_backend(_: &ModelArgs, _: &std::path::Path) -> Result<Loaded> {
    Err(bad_arg(
        "--backend",
        "llama needs spec-bench built with `--features llama` (cargo run --release -p spec-bench --features llama -- ...)".to_string(),
    ))
}

/// llama.cpp's batched target for `serve --batch-target llama`: `slots` sequences of half the
/// model's training context (at most 4,096 tokens) each, in one llama.cpp context.
#[cfg(feature = "llama")]
fn llama_batch(
    model: &ModelArgs,
    path: &std::path::Path,
    slots: usize,
    threads: usize,
) -> Result<Box<dyn BatchTarget + Send>> {
    use speculative_llama::LlamaConfig;
    let llama = |e: speculative_llama::LlamaError| bad_arg("--batch-target llama", e.to_string());
    let engine = llama_engine(model, path)?;
    // Half the training context per slot: prompts are cut to half the context.
    let cfg = LlamaConfig::default()
        .with_threads(threads)
        .with_slots(slots)
        .with_context(engine.context_train().min(8192) / 2);
    Ok(Box::new(engine.batch_target(&cfg).map_err(llama)?))
}

#[cfg(not(feature = "llama"))]
fn llama_batch(
    _: &ModelArgs,
    _: &std::path::Path,
    _: usize,
    _: usize,
) -> Result<Box<dyn BatchTarget + Send>> {
    Err(bad_arg(
        "--batch-target",
        "llama needs spec-bench built with `--features llama`".to_string(),
    ))
}

/// The one engine of a subcommand that measures a single engine.
fn single_backend(a: &ModelArgs) -> Result<&str> {
    match a.backend.as_slice() {
        [one] => Ok(one),
        _ => Err(bad_arg(
            "--backend",
            format!("{} (this subcommand takes one engine)", a.backend.join(",")),
        )),
    }
}

/// Measures `c(B, n)` as the time of one forward over `B * n` new tokens after `prefix` cached
/// tokens (one sequence stands in for `B` sequences: the weights are read once per call either
/// way; attention over `B` separate prefixes is not modelled). Median of `reps`.
fn cost_table(a: CostArgs) -> Result<()> {
    let path = a.model.model.clone().unwrap_or_else(default_model_path);
    let mut tables = Vec::new();
    for backend in &a.model.backend {
        let table = measure_cost_table(&a, backend, &path)?;
        // Several engines: one file each, `cost-table-fast.json`, `cost-table-llama.json`.
        let out = if a.model.backend.len() > 1 {
            let stem = a
                .out
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("cost-table");
            a.out.with_file_name(format!("{stem}-{backend}.json"))
        } else {
            a.out.clone()
        };
        write_json(&out, &table)?;
        println!("wrote {}", out.display());
        tables.push((backend.as_str(), table));
    }
    // The batch-1 cost curve of every engine side by side: ms of a 1-token forward and
    // c(n) = time(n) / time(1).
    if let Some(one) = a.batch.iter().position(|&b| b == 1) {
        let ones = a.tokens.iter().position(|&n| n == 1);
        let mut md = String::from("| engine | 1-token ms |");
        for &n in &a.tokens {
            md.push_str(&format!(" c({n}) |"));
        }
        md.push_str("\n|---|---|");
        md.push_str(&"---|".repeat(a.tokens.len()));
        md.push('\n');
        for (backend, t) in &tables {
            let row = &t.cost[one];
            let base = ones.map(|i| row[i]).unwrap_or(f64::NAN);
            md.push_str(&format!("| {backend} | {:.2} |", base * 1e3));
            for &c in row {
                md.push_str(&format!(" {:.2} |", c / base));
            }
            md.push('\n');
        }
        println!("{md}");
    }
    Ok(())
}

/// Measures `c(B, n)` on one engine (see [`cost_table`]).
fn measure_cost_table(a: &CostArgs, backend: &str, path: &std::path::Path) -> Result<CostTable> {
    let (mut target, _, _) = load_backend(&a.model, backend, path)?;
    let vocab = target.vocab_size() as u32;
    let prefix: Vec<u32> = (0..a.prefix as u32)
        .map(|i| (i * 37 + 11) % vocab)
        .collect();
    let mut logits = Vec::new();
    target.truncate(0)?;
    target.forward(&prefix, &mut logits)?;
    let mut cost = Vec::new();
    for &b in &a.batch {
        let mut row = Vec::new();
        for &n in &a.tokens {
            let rows = b * n;
            let toks: Vec<u32> = (0..rows as u32).map(|i| (i * 101 + 7) % vocab).collect();
            let mut times = Vec::new();
            for _ in 0..a.reps.max(1) {
                let t = std::time::Instant::now();
                target.forward(&toks, &mut logits)?;
                times.push(t.elapsed().as_secs_f64());
                target.truncate(prefix.len())?;
            }
            let med = spec_bench::stats::percentile(&times, 50.0).unwrap_or(0.0);
            eprintln!("{backend}: batch {b} tokens {n}: {:.2} ms", med * 1e3);
            row.push(med);
        }
        cost.push(row);
    }
    let format = match (backend, &a.model.llama_quant) {
        ("llama", Some(q)) => q.as_str(),
        ("llama", None) => "as-stored",
        _ => a.model.format.as_str(),
    };
    let table = CostTable {
        source: format!(
            "measured by `spec-bench cost-table` ({backend} backend, {format} weights, {} thread(s), prefix {}): one forward over batch*tokens rows, median of {}",
            a.model.threads, a.prefix, a.reps
        ),
        batch: a.batch.clone(),
        tokens: a.tokens.clone(),
        cost,
    };
    table.validate()?;
    Ok(table)
}

fn replay_proposer(name: &str) -> Result<Box<dyn Proposer>> {
    let bad = || BenchError::Invalid {
        what: "proposer",
        reason: format!(
            "{name} (replay takes prompt-lookup, prompt-lookup:MIN-MAX, suffix, suffix:MIN_CONFIDENCE)"
        ),
    };
    Ok(match name {
        "prompt-lookup" => Box::new(PromptLookup::new(1, 4)?),
        "suffix" => Box::new(SuffixProposer::new(SuffixConfig::default())?),
        other if other.starts_with("suffix:") => {
            let c: f32 = other["suffix:".len()..].parse().map_err(|_| bad())?;
            Box::new(SuffixProposer::new(
                SuffixConfig::default().with_min_confidence(c),
            )?)
        }
        other => {
            let range = other.strip_prefix("prompt-lookup:").ok_or_else(bad)?;
            let (lo, hi) = range.split_once('-').ok_or_else(bad)?;
            let lo: usize = lo.parse().map_err(|_| bad())?;
            let hi: usize = hi.parse().map_err(|_| bad())?;
            Box::new(PromptLookup::new(lo, hi)?)
        }
    })
}

/// `spec-bench warm-recycling`: greedy generations (seed 0, deterministic) over the workload's
/// prompts with a token-recycling proposer drafting trees, then the table to a file.
fn warm_recycling(a: WarmArgs) -> Result<()> {
    let requests = workload::load(&a.workload)?;
    let path = a.model.model.clone().unwrap_or_else(default_model_path);
    let (mut target, _, _) = load_backend(&a.model, single_backend(&a.model)?, &path)?;
    let tok = GgufTokenizer::load(&path)?;
    let mut table = TokenRecycling::new(
        target.vocab_size(),
        RecyclingConfig::default().with_top_k(a.top_k),
    )?;
    let bar = ProgressBar::new(requests.len() as u64);
    let start = std::time::Instant::now();
    let mut generated = 0usize;
    for r in &requests {
        let text = tok.apply_chat_template(&[ChatMessage::user(r.prompt.clone())])?;
        let prompt = tok.encode(&text)?;
        let params = GenerationParams::builder()
            .max_new_tokens(r.max_tokens.unwrap_or(a.max_tokens))
            .stop(StopConditions::default().with_eos(tok.eos_id()))
            .draft(DraftLength::Fixed(a.k))
            .tree(TreeDrafts::nodes(a.tree_nodes))
            .build()?;
        let mut g = Generator::new(&mut *target, &mut table);
        let out = g
            .generate(&prompt, &params)
            .map_err(speculative::Error::from)?;
        generated += out.tokens.len();
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mut f = std::fs::File::create(&a.out).map_err(io(&a.out))?;
    table.write_to(&mut f)?;
    println!(
        "warmed on {} prompts ({} generated tokens) in {:.1} s: {} of {} token ids have successors; table {} bytes; wrote {}",
        requests.len(),
        generated,
        start.elapsed().as_secs_f64(),
        table.filled_rows(),
        table.vocab_size(),
        table.table_bytes(),
        a.out.display()
    );
    Ok(())
}

fn replay_cmd(a: ReplayArgs) -> Result<()> {
    let requests = workload::load(&a.workload)?;
    let path = a.model.clone().unwrap_or_else(default_model_path);
    let tok = GgufTokenizer::load(&path)?;
    let text = std::fs::read_to_string(&a.runs).map_err(io(&a.runs))?;
    let recs: Vec<RunRecord> = serde_json::from_str(&text).map_err(|e| BenchError::Invalid {
        what: "runs.json",
        reason: e.to_string(),
    })?;
    let cost = CostCurve::new(CostTable::from_json(
        &std::fs::read_to_string(&a.cost).map_err(io(&a.cost))?,
    )?)?;
    for p in &a.proposers {
        replay_proposer(p)?;
    }
    if a.nodes.contains(&0) {
        return Err(BenchError::Invalid {
            what: "--nodes",
            reason: "node budgets must be at least 1".into(),
        });
    }
    if a.oracle_max_n == 0 {
        return Err(BenchError::Invalid {
            what: "--oracle-max-n",
            reason: "must be at least 1".into(),
        });
    }
    let mut traces = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        if r.session.is_some() {
            eprintln!(
                "replay: request {i} skipped: a conversation turn (its prompt depends on earlier outputs)"
            );
            continue;
        }
        let Some(rec) = recs
            .iter()
            .find(|x| x.request == i && x.greedy_identical == Some(true))
        else {
            eprintln!(
                "replay: request {i} skipped: no greedy run whose output equals plain greedy decoding"
            );
            continue;
        };
        let text = tok.apply_chat_template(&[ChatMessage::user(r.prompt.clone())])?;
        let prompt = tok.encode(&text)?;
        if rec.prompt_hash.is_some_and(|h| h != token_hash(&prompt)) {
            return Err(BenchError::Invalid {
                what: "runs.json",
                reason: format!(
                    "request {i}: the workload prompt's tokens differ from the recorded run's: not recorded from this workload and model"
                ),
            });
        }
        if prompt.len() != rec.prompt_tokens {
            return Err(BenchError::Invalid {
                what: "runs.json",
                reason: format!(
                    "request {i}: the workload prompt has {} tokens, the run {}: not recorded from this workload and model",
                    prompt.len(),
                    rec.prompt_tokens
                ),
            });
        }
        traces.push(Trace {
            kind: r.kind.clone(),
            request: i,
            prompt,
            output: rec.tokens.clone(),
        });
    }
    if traces.is_empty() {
        return Err(BenchError::Invalid {
            what: "runs.json",
            reason: "no greedy run with greedy_identical = true".into(),
        });
    }
    let mut kinds: Vec<String> = traces.iter().map(|t| t.kind.clone()).collect();
    kinds.sort();
    kinds.dedup();
    let mut rows = Vec::new();
    for kind in &kinds {
        let of_kind: Vec<&Trace> = traces.iter().filter(|t| &t.kind == kind).collect();
        for &k in &a.k {
            for name in &a.proposers {
                let per: Vec<ReplayStats> = of_kind
                    .iter()
                    .map(|t| replay(&mut *replay_proposer(name)?, t, k, &cost))
                    .collect::<Result<_>>()?;
                let mut row = ReplayRow::new(kind, name, k, &per);
                let label = format!("{name} k={k} t=0 ");
                let measured: Vec<f64> = recs
                    .iter()
                    .filter(|x| of_kind.iter().any(|t| t.request == x.request))
                    .filter(|x| x.label.starts_with(&label))
                    .filter_map(|x| x.speedup)
                    .collect();
                if !measured.is_empty() {
                    row.measured_speedup_mean =
                        Some(measured.iter().sum::<f64>() / measured.len() as f64);
                }
                rows.push(row);
            }
            for (name, min_n) in [
                ("oracle n>=1".to_string(), 1),
                ("oracle any position".to_string(), 0),
            ] {
                let per: Vec<ReplayStats> = of_kind
                    .iter()
                    .map(|t| oracle(t, k, min_n, a.oracle_max_n.max(min_n), &cost))
                    .collect::<Result<_>>()?;
                rows.push(ReplayRow::new(kind, &name, k, &per));
            }
            for &n in &a.nodes {
                for name in &a.proposers {
                    let chain: Vec<ReplayStats> = of_kind
                        .iter()
                        .map(|t| replay(&mut *replay_proposer(name)?, t, n.min(k), &cost))
                        .collect::<Result<_>>()?;
                    let tree: Vec<ReplayStats> = of_kind
                        .iter()
                        .map(|t| replay_tree(&mut *replay_proposer(name)?, t, k, n, &cost))
                        .collect::<Result<_>>()?;
                    let mut row = ReplayRow::new(kind, name, n.min(k), &chain);
                    row.nodes = Some(n);
                    rows.push(row);
                    let mut row = ReplayRow::new(kind, name, k, &tree);
                    row.nodes = Some(n);
                    row.tree = true;
                    rows.push(row);
                }
            }
        }
    }
    std::fs::create_dir_all(&a.out).map_err(io(&a.out))?;
    write_json(&a.out.join("replay.json"), &rows)?;
    let md = replay_markdown(&rows);
    let trees = if a.nodes.is_empty() {
        String::new()
    } else {
        format!(
            "\n## Trees against chains of the same node budget\n\n{}\n{TREE_MARKDOWN_NOTES}\n",
            tree_markdown(&rows)
        )
    };
    let p = a.out.join("replay.md");
    std::fs::write(
        &p,
        format!(
            "Greedy traces: {} ({} requests); cost curve: {}\n\n{md}\n{}\n{trees}",
            a.runs.display(),
            traces.len(),
            CostTable::from_json(&std::fs::read_to_string(&a.cost).map_err(io(&a.cost))?)?.source,
            REPLAY_NOTES
        ),
    )
    .map_err(io(&p))?;
    println!("{md}{trees}");
    Ok(())
}

fn sim(a: SimArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.cost).map_err(io(&a.cost))?;
    let table = CostTable::from_json(&text)?;
    let model = match (a.acceptance, &a.runs) {
        (Some(x), _) => {
            if !(0.0..=1.0).contains(&x) {
                return Err(BenchError::Invalid {
                    what: "--acceptance",
                    reason: format!("{x} is not in [0, 1]"),
                });
            }
            AcceptanceModel::Constant(x)
        }
        (None, Some(runs)) => {
            let text = std::fs::read_to_string(runs).map_err(io(runs))?;
            let recs: Vec<RunRecord> =
                serde_json::from_str(&text).map_err(|e| BenchError::Invalid {
                    what: "runs.json",
                    reason: e.to_string(),
                })?;
            let steps = recs
                .iter()
                .filter(|r| r.config.is_some())
                .filter(|r| {
                    a.label
                        .as_ref()
                        .is_none_or(|l| r.label.contains(l.as_str()))
                })
                .flat_map(|r| r.steps.iter().copied())
                .collect();
            AcceptanceModel::Trace(steps)
        }
        (None, None) => {
            return Err(BenchError::Invalid {
                what: "arguments",
                reason: "give --acceptance A or --runs runs.json".into(),
            });
        }
    };
    let r = simulate_draft(
        &table,
        &model,
        &default_batches(),
        a.max_draft,
        a.draft_cost,
    );
    std::fs::create_dir_all(&a.out).map_err(io(&a.out))?;
    write_json(&a.out.join("simulation.json"), &r)?;
    let md = sim_markdown(&r);
    let p = a.out.join("simulation.md");
    let head = format!(
        "Cost table: {}; draft cost per token {} x c(B, 1)",
        table.source, a.draft_cost
    );
    std::fs::write(&p, format!("{head}\n\n{md}")).map_err(io(&p))?;
    sim_plot(&a.out.join("simulation.svg"), &r)?;
    println!("{md}");
    Ok(())
}
