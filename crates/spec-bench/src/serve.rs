//! Serving benchmark: many requests at once through continuous batching
//! ([`speculative::decode::BatchGenerator`]), plain batched decoding against speculative modes,
//! under a closed loop (a fixed number of requests in flight) or an open loop (Poisson arrivals).
//!
//! Figures per (mode, load), all from one process run:
//! - throughput: generated tokens of every request / wall time of the whole load, tokens/s;
//! - TTFT: first streamed chunk minus the request's arrival (closed loop: its submission; open
//!   loop: its scheduled arrival time, so time spent waiting for the running step counts);
//! - TPOT: (last chunk - first chunk) / (tokens - 1) per request;
//! - ITL: gaps between consecutive streamed chunks of a request (a verified block of several
//!   tokens is one chunk, so a speculative ITL covers more than one token);
//! - p50 / p99 by linear interpolation ([`crate::stats::percentile`]);
//! - peak RSS: Linux `VmHWM` of the whole process, reset before each load (process-wide: the
//!   weights and every slot's KV cache count);
//! - acceptance rate (accepted / proposed drafts) and mean accepted length (emitted tokens /
//!   target verify calls, bonus included) summed over the requests.
//!
//! [`predict_closed_loop`] replays a closed loop against a cost table `c(rows)` measured in the
//! same run (the median forward time per batch row count, [`cost_table_from_steps`]) with the
//! run's measured acceptance: the serving counterpart of the batch-size simulator
//! ([`crate::sim`]).

use std::collections::{BTreeMap, HashMap};
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use speculative::BatchTarget;
use speculative::decode::{AdaptiveConfig, DraftLength, GenerationParams, StopConditions};

use crate::error::{BenchError, Result};
pub use crate::matrix::{PromptBuilder, Turn};
use crate::serve_reuse::ReuseMode;
use crate::sim::CostTable;
use crate::stats::percentile;
use speculative::decode::{BatchConfig, BatchGenerator, BatchRequest, RequestId};

/// How the requests of a load draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServeMode {
    /// Plain batched decoding ([`DraftLength::Off`]): one row per sequence and step.
    Plain,
    /// Speculative decoding with a fixed draft length `k` ([`DraftLength::Fixed`]).
    Fixed(usize),
    /// Speculative decoding with the batch's goodput policy choosing each sequence's `k` in
    /// `0..=max` ([`DraftLength::Adaptive`]).
    Goodput(usize),
}

impl ServeMode {
    /// Parses `plain`, `fixed:K` (or a bare `K`), `goodput` (max 8) or `goodput:MAX`.
    ///
    /// # Errors
    /// [`BenchError::Invalid`] for anything else.
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim();
        let bad = || BenchError::Invalid {
            what: "--modes",
            reason: format!("{s} (expected plain, fixed:K or goodput[:MAX])"),
        };
        if s == "plain" {
            return Ok(ServeMode::Plain);
        }
        if let Some(rest) = s.strip_prefix("goodput") {
            let max = match rest.strip_prefix(':') {
                Some(m) => m.parse().map_err(|_| bad())?,
                None if rest.is_empty() => 8,
                None => return Err(bad()),
            };
            return Ok(ServeMode::Goodput(max));
        }
        let k = s.strip_prefix("fixed:").unwrap_or(s);
        k.parse().map(ServeMode::Fixed).map_err(|_| bad())
    }

    /// `plain`, `fixed k=4` or `goodput k<=8`.
    pub fn label(&self) -> String {
        match self {
            ServeMode::Plain => "plain".into(),
            ServeMode::Fixed(k) => format!("fixed k={k}"),
            ServeMode::Goodput(k) => format!("goodput k<={k}"),
        }
    }

    /// `true` for the speculative modes (they need a proposer).
    pub fn speculative(&self) -> bool {
        !matches!(self, ServeMode::Plain)
    }

    /// The request's draft length.
    pub fn draft(&self) -> DraftLength {
        match *self {
            ServeMode::Plain => DraftLength::Off,
            ServeMode::Fixed(k) => DraftLength::Fixed(k),
            ServeMode::Goodput(max_draft) => {
                DraftLength::Adaptive(AdaptiveConfig::default().with_max_draft(max_draft))
            }
        }
    }

    /// Greedy generation parameters of a request in this mode: at most `max_tokens` new
    /// tokens, stopping at any of `eos`.
    pub fn params(&self, max_tokens: usize, eos: &[u32]) -> GenerationParams {
        let mut stop = StopConditions::default();
        for &e in eos {
            stop = stop.with_eos(e);
        }
        GenerationParams::greedy(max_tokens)
            .with_draft(self.draft())
            .with_stop(stop)
            .expect("EOS ids alone are valid stop conditions")
    }
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Load {
    /// Closed loop: keep this many requests in flight; the next is submitted when one ends.
    Closed(usize),
    /// Open loop: Poisson arrivals at `rate` requests per second ([`poisson_arrivals`]).
    Open {
        /// Mean arrivals per second.
        rate: f64,
        /// Seed of the arrival times.
        seed: u64,
    },
}

impl Load {
    /// `closed C=8` or `open 2.5/s`.
    pub fn label(&self) -> String {
        match self {
            Load::Closed(c) => format!("closed C={c}"),
            Load::Open { rate, .. } => format!("open {rate}/s"),
        }
    }
}

/// SplitMix64 (Steele, Lea and Flood 2014): a small seeded generator for the arrival times.
struct SplitMix(u64);

impl SplitMix {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // 53 random bits as a uniform in [0, 1).
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Arrival times in seconds from the start of a Poisson process of `rate` arrivals per second:
/// `n` increasing times whose gaps are independent exponentials of mean `1 / rate`
/// (`-ln(1 - u) / rate`, `u` uniform from a SplitMix64 stream seeded with `seed`). The same seed
/// gives the same times.
///
/// # Errors
/// [`BenchError::Invalid`] when `rate` is not a positive finite number.
pub fn poisson_arrivals(rate: f64, n: usize, seed: u64) -> Result<Vec<f64>> {
    if !(rate.is_finite() && rate > 0.0) {
        return Err(BenchError::Invalid {
            what: "--rate",
            reason: format!("{rate} is not a positive number of requests per second"),
        });
    }
    let mut rng = SplitMix(seed);
    let mut t = 0.0;
    Ok((0..n)
        .map(|_| {
            t += -(1.0 - rng.next_f64()).ln() / rate;
            t
        })
        .collect())
}

/// One request of a serving load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServeRequest {
    /// Position in the load (0-based).
    pub index: usize,
    /// The workload line it repeats (0-based among the workload's requests).
    pub source: usize,
    /// Workload kind.
    pub kind: String,
    /// Prompt tokens (chat template applied).
    pub prompt: Vec<u32>,
    /// Maximum new tokens.
    pub max_tokens: usize,
    /// A conversation turn (`None`: a stand-alone request): the driver builds its prompt when
    /// the session's previous turn has finished ([`drive_conversations`]), and `prompt` is
    /// then unused.
    #[serde(default)]
    pub turn: Option<Turn>,
}

/// `n` requests cycling through `base` (request `i` repeats `base[i % base.len()]`), so a short
/// workload gives enough requests for a high concurrency. A repeated conversation turn belongs
/// to a new conversation per pass over `base` (session `name#pass`, pass = `i / base.len()`).
/// Empty when `base` is empty.
pub fn repeat_requests(base: &[ServeRequest], n: usize) -> Vec<ServeRequest> {
    if base.is_empty() {
        return Vec::new();
    }
    (0..n)
        .map(|i| {
            let b = &base[i % base.len()];
            ServeRequest {
                index: i,
                source: b.source,
                turn: b.turn.as_ref().map(|t| Turn {
                    session: format!("{}#{}", t.session, i / base.len()),
                    message: t.message.clone(),
                }),
                ..b.clone()
            }
        })
        .collect()
}

/// What one request did, times in seconds from the start of its load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// [`ServeRequest::index`].
    pub index: usize,
    /// [`ServeRequest::source`].
    pub source: usize,
    /// Workload kind.
    pub kind: String,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (the partial output for a failed request).
    pub tokens: Vec<u32>,
    /// When the request arrived: its submission (closed loop) or scheduled arrival (open loop).
    pub arrival_s: f64,
    /// When it was submitted to the generator.
    pub submit_s: f64,
    /// Streamed chunks: (time, tokens in the chunk).
    pub chunks: Vec<(f64, usize)>,
    /// When the generator reported it finished.
    pub end_s: f64,
    /// Drafts proposed.
    pub proposed: usize,
    /// Drafts accepted.
    pub accepted: usize,
    /// Tokens emitted.
    pub emitted: usize,
    /// Target verify calls (steps that included this request's decode rows).
    pub target_calls: usize,
    /// The error, for a request that failed.
    pub error: Option<String>,
    /// Prompt tokens its slot's cache already held (kept or copied; prefix reuse).
    #[serde(default)]
    pub prompt_reused: usize,
    /// Prompt tokens it fed to the target (`prompt_tokens - prompt_reused`).
    #[serde(default)]
    pub prompt_prefilled: usize,
}

impl RequestRecord {
    /// The record of `r` (with a prompt of `prompt_tokens`) before it runs.
    fn blank(r: &ServeRequest, prompt_tokens: usize, arrival: f64, submit: f64) -> Self {
        RequestRecord {
            index: r.index,
            source: r.source,
            kind: r.kind.clone(),
            prompt_tokens,
            tokens: Vec::new(),
            arrival_s: arrival,
            submit_s: submit,
            chunks: Vec::new(),
            end_s: submit,
            proposed: 0,
            accepted: 0,
            emitted: 0,
            target_calls: 0,
            error: None,
            prompt_reused: 0,
            prompt_prefilled: 0,
        }
    }

    /// Time to first token: first chunk minus arrival (`None` without a chunk).
    pub fn ttft(&self) -> Option<f64> {
        self.chunks.first().map(|c| c.0 - self.arrival_s)
    }

    /// Time per output token after the first: `(last chunk - first chunk) / (tokens - 1)`
    /// (`None` for fewer than 2 tokens).
    pub fn tpot(&self) -> Option<f64> {
        let n: usize = self.chunks.iter().map(|c| c.1).sum();
        match (self.chunks.first(), self.chunks.last()) {
            (Some(a), Some(b)) if n > 1 => Some((b.0 - a.0) / (n - 1) as f64),
            _ => None,
        }
    }

    /// Gaps between consecutive streamed chunks, seconds.
    pub fn itl(&self) -> Vec<f64> {
        self.chunks.windows(2).map(|w| w[1].0 - w[0].0).collect()
    }
}

/// A request's streamed chunks (time, tokens), shared with its streaming callback.
type ChunkLog = Arc<Mutex<Vec<(f64, usize)>>>;

/// One [`BatchGenerator::step`] as the driver saw it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepSample {
    /// Requests in flight (active and waiting in the generator) before the step.
    pub in_flight: usize,
    /// Requests of the load not finished yet, before the step.
    pub unfinished: usize,
    /// Sequences in the step's forward.
    pub sequences: usize,
    /// Rows of the forward (prefill, decode and draft rows).
    pub rows: usize,
    /// Prompt prefill rows among them.
    pub prefill_rows: usize,
    /// Draft rows among them.
    pub draft_rows: usize,
    /// Tokens emitted by the step.
    pub emitted: usize,
    /// Seconds in the batched forward.
    pub forward_s: f64,
    /// Seconds of the whole step.
    pub step_s: f64,
}

/// The outcome of one load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadRun {
    /// Every request, in [`ServeRequest::index`] order.
    pub records: Vec<RequestRecord>,
    /// Every step.
    pub steps: Vec<StepSample>,
    /// Wall time from the first submission to the last finished request, seconds.
    pub wall_s: f64,
    /// The generator's online cost curve at the end ([`BatchGenerator::cost_curve`]):
    /// (rows per forward, median forward seconds).
    pub cost_curve: Vec<(usize, f64)>,
    /// Prefix copies between slots during the load ([`BatchTarget::copy_prefix`]).
    #[serde(default)]
    pub prefix_copies: u64,
    /// Positions they copied.
    #[serde(default)]
    pub prefix_copied_tokens: u64,
}

/// Runs `requests` through `generator` under `load` and records every request and step
/// (stand-alone requests only; conversation turns need [`drive_conversations`]).
///
/// # Errors
/// As [`drive_conversations`]. A request with a [`ServeRequest::turn`] is recorded with an
/// error (no prompt builder).
pub fn drive<B: BatchTarget>(
    generator: &mut BatchGenerator<B>,
    requests: &[ServeRequest],
    load: &Load,
    make: &mut dyn FnMut(&ServeRequest) -> Result<BatchRequest>,
) -> Result<LoadRun> {
    let mut no_turns = |_: &[(String, Vec<u32>)], _: &str| -> Result<Vec<u32>> {
        Err(BenchError::Invalid {
            what: "serve driver",
            reason: "a conversation turn needs a prompt builder (drive_conversations)".into(),
        })
    };
    drive_conversations(generator, requests, load, make, &mut no_turns)
}

/// Runs `requests` through `generator` under `load` and records every request and step.
///
/// `make` builds each request (prompt, parameters, proposer); the driver adds a streaming
/// callback that timestamps the chunks. A conversation turn ([`ServeRequest::turn`]) waits
/// until the previous turn of its session has finished; its prompt is then built by `build`
/// from the session's earlier turns (each user message and the tokens generated for it in this
/// load) and its message, `make` gets the request with that prompt, and the driver tags the
/// [`BatchRequest`] with the session's conversation key
/// ([`BatchRequest::with_conversation`]), so that with prefix reuse on the turn lands in the
/// slot whose cache holds its conversation so far.
///
/// Closed loop `C`: the first `C` ready requests (in index order) are submitted at once and
/// the next ready one whenever a request finishes, so `min(C, ready and unfinished)` are in
/// flight before every step. Open loop: before each step every ready request whose arrival
/// time has passed is submitted (a turn arrives at its scheduled time or when its previous
/// turn ends, whichever is later); when nothing is in flight the driver sleeps until the next
/// arrival.
///
/// A request that `make`, `build` or [`BatchGenerator::submit`] rejects, or that ends with an
/// error, is recorded with its error and counts as finished (a later turn of its session then
/// sees its partial output).
///
/// # Errors
/// [`BenchError::Invalid`] for a closed loop of concurrency 0 or an invalid rate; errors of
/// [`BatchGenerator::step`] (a failure of the whole batch) as [`BenchError::Decode`];
/// [`BenchError::Invalid`] when the generator goes idle with requests unfinished.
pub fn drive_conversations<B: BatchTarget>(
    generator: &mut BatchGenerator<B>,
    requests: &[ServeRequest],
    load: &Load,
    make: &mut dyn FnMut(&ServeRequest) -> Result<BatchRequest>,
    build: &mut PromptBuilder<'_>,
) -> Result<LoadRun> {
    let arrivals = match *load {
        Load::Closed(0) => {
            return Err(BenchError::Invalid {
                what: "--concurrency",
                reason: "a closed loop needs at least 1 request in flight".into(),
            });
        }
        Load::Closed(_) => None,
        Load::Open { rate, seed } => Some(poisson_arrivals(rate, requests.len(), seed)?),
    };
    let before = *generator.metrics();
    let mut d = Driver::new(requests, *load, arrivals);
    while d.finished < requests.len() {
        while let Some((i, arrival)) = d.next_due() {
            d.submit(generator, i, arrival, make, build);
        }
        if d.in_flight.is_empty() {
            d.wait_for_arrival();
            continue;
        }
        if generator.is_idle() {
            return Err(BenchError::Invalid {
                what: "batch generator",
                reason: format!(
                    "idle with {} submitted requests unfinished",
                    d.in_flight.len()
                ),
            });
        }
        d.step(generator)?;
    }
    let after = *generator.metrics();
    let mut run = d.into_run()?;
    run.cost_curve = generator.cost_curve();
    run.prefix_copies = after.prefix_copies - before.prefix_copies;
    run.prefix_copied_tokens = after.prefix_copied_tokens - before.prefix_copied_tokens;
    Ok(run)
}

/// The state of one load in [`drive_conversations`].
struct Driver<'a> {
    requests: &'a [ServeRequest],
    load: Load,
    arrivals: Option<Vec<f64>>,
    start: Instant,
    records: Vec<Option<RequestRecord>>,
    streams: Vec<Option<ChunkLog>>,
    in_flight: HashMap<RequestId, usize>,
    /// When each request finished (seconds from the start), `None` while unfinished.
    done_at: Vec<Option<f64>>,
    /// The previous turn of the same session, per request.
    prev: Vec<Option<usize>>,
    /// Each session's turns so far: (user message, generated tokens).
    history: HashMap<String, Vec<(String, Vec<u32>)>>,
    /// Conversation keys by session.
    keys: HashMap<String, u64>,
    finished: usize,
    steps: Vec<StepSample>,
}

impl<'a> Driver<'a> {
    fn new(requests: &'a [ServeRequest], load: Load, arrivals: Option<Vec<f64>>) -> Self {
        let n = requests.len();
        let mut last: HashMap<&str, usize> = HashMap::new();
        let mut keys = HashMap::new();
        let prev = requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let t = r.turn.as_ref()?;
                let k = keys.len() as u64;
                keys.entry(t.session.clone()).or_insert(k);
                last.insert(t.session.as_str(), i)
            })
            .collect();
        Driver {
            requests,
            load,
            arrivals,
            start: Instant::now(),
            records: vec![None; n],
            streams: vec![None; n],
            in_flight: HashMap::new(),
            done_at: vec![None; n],
            prev,
            history: HashMap::new(),
            keys,
            finished: 0,
            steps: Vec::new(),
        }
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Not submitted yet, and its session's previous turn (if any) has finished.
    fn ready(&self, i: usize) -> bool {
        self.records[i].is_none() && self.prev[i].is_none_or(|p| self.done_at[p].is_some())
    }

    /// The next request to submit now and its arrival time, if the load allows one.
    fn next_due(&self) -> Option<(usize, f64)> {
        let mut ready = (0..self.requests.len()).filter(|&i| self.ready(i));
        match (&self.arrivals, self.load) {
            (None, Load::Closed(c)) => {
                if self.in_flight.len() >= c {
                    return None;
                }
                ready.next().map(|i| (i, self.now()))
            }
            (Some(times), _) => {
                let now = self.now();
                ready.find(|&i| times[i] <= now).map(|i| {
                    let after = self.prev[i].and_then(|p| self.done_at[p]).unwrap_or(0.0);
                    (i, times[i].max(after))
                })
            }
            (None, Load::Open { .. }) => None,
        }
    }

    /// Open loop with nothing in flight: sleeps until the next scheduled arrival.
    fn wait_for_arrival(&self) {
        let Some(times) = &self.arrivals else { return };
        let next = (0..self.requests.len())
            .filter(|&i| self.records[i].is_none())
            .map(|i| times[i])
            .reduce(f64::min);
        if let Some(t) = next {
            let wait = t - self.now();
            if wait > 0.0 {
                std::thread::sleep(Duration::from_secs_f64(wait));
            }
        }
    }

    /// Builds request `i` (its prompt, for a turn) and submits it; a failure is recorded.
    fn submit<B: BatchTarget>(
        &mut self,
        generator: &mut BatchGenerator<B>,
        i: usize,
        arrival: f64,
        make: &mut dyn FnMut(&ServeRequest) -> Result<BatchRequest>,
        build: &mut PromptBuilder<'_>,
    ) {
        let requests = self.requests;
        let r = &requests[i];
        let log: ChunkLog = Arc::new(Mutex::new(Vec::new()));
        self.streams[i] = Some(log.clone());
        let start = self.start;
        let built = match &r.turn {
            None => Ok(r.clone()),
            Some(t) => {
                let turns = self.history.get(&t.session).map_or(&[][..], |v| &v[..]);
                build(turns, &t.message).map(|prompt| ServeRequest {
                    prompt,
                    ..r.clone()
                })
            }
        };
        let key = r.turn.as_ref().and_then(|t| self.keys.get(&t.session));
        let prompt_tokens = built.as_ref().map_or(0, |b| b.prompt.len());
        let submitted = built.and_then(|b| make(&b)).and_then(|req| {
            let req = match key {
                Some(&k) => req.with_conversation(k),
                None => req,
            };
            let req = req.with_stream(move |c| {
                if let Ok(mut l) = log.lock() {
                    l.push((start.elapsed().as_secs_f64(), c.tokens.len()));
                }
                ControlFlow::Continue(())
            });
            generator.submit(req).map_err(BenchError::from)
        });
        let submit = self.now();
        let mut rec = RequestRecord::blank(r, prompt_tokens, arrival, submit);
        match submitted {
            Ok(id) => {
                self.in_flight.insert(id, i);
            }
            Err(e) => {
                rec.error = Some(e.to_string());
                self.end(i, &[], submit);
            }
        }
        self.records[i] = Some(rec);
    }

    /// Request `i` finished at `at` with `tokens`: its session's history grows.
    fn end(&mut self, i: usize, tokens: &[u32], at: f64) {
        self.finished += 1;
        self.done_at[i] = Some(at);
        if let Some(t) = &self.requests[i].turn {
            self.history
                .entry(t.session.clone())
                .or_default()
                .push((t.message.clone(), tokens.to_vec()));
        }
    }

    /// One generator step, then the requests it finished.
    fn step<B: BatchTarget>(&mut self, generator: &mut BatchGenerator<B>) -> Result<()> {
        let (inf, unf) = (self.in_flight.len(), self.requests.len() - self.finished);
        let st = generator.step()?;
        self.steps.push(StepSample {
            in_flight: inf,
            unfinished: unf,
            sequences: st.sequences,
            rows: st.rows,
            prefill_rows: st.prefill_rows,
            draft_rows: st.draft_rows,
            emitted: st.emitted,
            forward_s: st.forward_time.as_secs_f64(),
            step_s: st.step_time.as_secs_f64(),
        });
        let end = self.now();
        for f in generator.take_finished() {
            let Some(i) = self.in_flight.remove(&f.id) else {
                continue;
            };
            let (g, err) = match f.result {
                Ok(g) => (g, None),
                Err(e) => (*e.partial, Some(e.error.to_string())),
            };
            self.end(i, &g.tokens, end);
            let Some(rec) = self.records[i].as_mut() else {
                continue;
            };
            rec.end_s = end;
            rec.proposed = g.metrics.proposed;
            rec.accepted = g.metrics.accepted;
            rec.emitted = g.metrics.emitted;
            rec.target_calls = g.metrics.target_calls;
            rec.prompt_reused = g.metrics.prompt_tokens_reused;
            rec.prompt_prefilled = g.metrics.prompt_tokens_prefilled;
            rec.tokens = g.tokens;
            rec.error = err;
        }
        Ok(())
    }

    /// The records (with their streamed chunks) and steps.
    fn into_run(self) -> Result<LoadRun> {
        let wall_s = self.now();
        let records = self
            .records
            .into_iter()
            .zip(self.streams)
            .map(|(r, s)| {
                let mut r = r.ok_or_else(|| BenchError::Invalid {
                    what: "serve driver",
                    reason: "a request was never submitted".into(),
                })?;
                r.chunks = s
                    .and_then(|s| s.lock().ok().map(|l| l.clone()))
                    .unwrap_or_default();
                Ok(r)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LoadRun {
            records,
            steps: self.steps,
            wall_s,
            cost_curve: Vec::new(),
            prefix_copies: 0,
            prefix_copied_tokens: 0,
        })
    }
}

/// The figures of one (mode, load), as in the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellSummary {
    /// [`ServeMode`].
    pub mode: ServeMode,
    /// [`Load`].
    pub load: Load,
    /// Requests of the load.
    pub requests: usize,
    /// Requests that ended with an error.
    pub errors: usize,
    /// Generated tokens over every request.
    pub generated_tokens: usize,
    /// Wall time of the load, seconds.
    pub wall_s: f64,
    /// `generated_tokens / wall_s`.
    pub tokens_per_s: f64,
    /// TTFT p50 / p99 over the requests, seconds.
    pub ttft_p50_s: f64,
    /// TTFT p99, seconds.
    pub ttft_p99_s: f64,
    /// TPOT p50 over the requests, seconds.
    pub tpot_p50_s: f64,
    /// TPOT p99, seconds.
    pub tpot_p99_s: f64,
    /// ITL p50 over every gap between chunks of every request, seconds.
    pub itl_p50_s: f64,
    /// ITL p99, seconds.
    pub itl_p99_s: f64,
    /// Peak RSS of the process during the load, KiB (`None` off Linux).
    pub peak_rss_kib: Option<u64>,
    /// Accepted / proposed drafts over every request (0 without drafts).
    pub acceptance_rate: f64,
    /// Emitted tokens / target verify calls over every request.
    pub mean_accepted_length: f64,
    /// Draft rows per target verify call (mean `k` verified per sequence and step).
    pub mean_draft: f64,
    /// Steps of the load.
    pub steps: usize,
    /// Mean rows per step.
    pub mean_rows: f64,
    /// Mean sequences per step.
    pub mean_sequences: f64,
    /// Share of step time in the batched forward.
    pub forward_share: f64,
    /// Requests whose greedy output differs from the reference ([`mark_mismatches`]).
    #[serde(default)]
    pub mismatches: Vec<usize>,
    /// The load's prefix reuse mode (set by the caller; [`summarize`] leaves the default).
    #[serde(default)]
    pub reuse: ReuseMode,
    /// Prompt tokens over every request.
    #[serde(default)]
    pub prompt_tokens: usize,
    /// Of which found in the slot's cache ([`RequestRecord::prompt_reused`]).
    #[serde(default)]
    pub prompt_reused: usize,
    /// Of which fed to the target ([`RequestRecord::prompt_prefilled`]).
    #[serde(default)]
    pub prompt_prefilled: usize,
    /// Prompt prefill rows of every step (the prefill the target computed; each request's
    /// last prompt token is fed with its first decode row instead).
    #[serde(default)]
    pub prefill_rows: usize,
    /// [`LoadRun::prefix_copies`].
    #[serde(default)]
    pub prefix_copies: u64,
    /// [`LoadRun::prefix_copied_tokens`].
    #[serde(default)]
    pub prefix_copied_tokens: u64,
}

impl CellSummary {
    /// `prompt_reused / (prompt_reused + prompt_prefilled)` (0 without prompts).
    pub fn reused_share(&self) -> f64 {
        ratio(
            self.prompt_reused as f64,
            (self.prompt_reused + self.prompt_prefilled) as f64,
        )
    }
}

fn pct(xs: &[f64], q: f64) -> f64 {
    percentile(xs, q).unwrap_or(0.0)
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// Summarises a load (see [`CellSummary`]).
pub fn summarize(
    mode: ServeMode,
    load: Load,
    run: &LoadRun,
    peak_rss_kib: Option<u64>,
) -> CellSummary {
    let rs = &run.records;
    let ttft: Vec<f64> = rs.iter().filter_map(RequestRecord::ttft).collect();
    let tpot: Vec<f64> = rs.iter().filter_map(RequestRecord::tpot).collect();
    let itl: Vec<f64> = rs.iter().flat_map(RequestRecord::itl).collect();
    let generated: usize = rs.iter().map(|r| r.tokens.len()).sum();
    let sum = |f: &dyn Fn(&RequestRecord) -> usize| rs.iter().map(f).sum::<usize>() as f64;
    let (proposed, accepted) = (sum(&|r| r.proposed), sum(&|r| r.accepted));
    let (emitted, calls) = (sum(&|r| r.emitted), sum(&|r| r.target_calls));
    let steps = run.steps.len();
    let st = |f: &dyn Fn(&StepSample) -> f64| run.steps.iter().map(f).sum::<f64>();
    CellSummary {
        mode,
        load,
        requests: rs.len(),
        errors: rs.iter().filter(|r| r.error.is_some()).count(),
        generated_tokens: generated,
        wall_s: run.wall_s,
        tokens_per_s: ratio(generated as f64, run.wall_s),
        ttft_p50_s: pct(&ttft, 50.0),
        ttft_p99_s: pct(&ttft, 99.0),
        tpot_p50_s: pct(&tpot, 50.0),
        tpot_p99_s: pct(&tpot, 99.0),
        itl_p50_s: pct(&itl, 50.0),
        itl_p99_s: pct(&itl, 99.0),
        peak_rss_kib,
        acceptance_rate: ratio(accepted, proposed),
        mean_accepted_length: ratio(emitted, calls),
        mean_draft: ratio(st(&|s| s.draft_rows as f64), calls),
        steps,
        mean_rows: ratio(st(&|s| s.rows as f64), steps as f64),
        mean_sequences: ratio(st(&|s| s.sequences as f64), steps as f64),
        forward_share: ratio(st(&|s| s.forward_s), st(&|s| s.step_s)),
        mismatches: Vec::new(),
        reuse: ReuseMode::default(),
        prompt_tokens: sum(&|r| r.prompt_tokens) as usize,
        prompt_reused: sum(&|r| r.prompt_reused) as usize,
        prompt_prefilled: sum(&|r| r.prompt_prefilled) as usize,
        prefill_rows: run.steps.iter().map(|s| s.prefill_rows).sum(),
        prefix_copies: run.prefix_copies,
        prefix_copied_tokens: run.prefix_copied_tokens,
    }
}

/// One measured load: its summary and its raw records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    /// The figures.
    pub summary: CellSummary,
    /// Requests and steps.
    pub run: LoadRun,
}

/// Greedy outputs must not depend on the mode or the batch: takes as reference, per request
/// index, the output of the first cell in which that request ended without error, and lists
/// in each cell's [`CellSummary::mismatches`] the requests whose error-free output differs.
/// Returns the total number of mismatches.
pub fn mark_mismatches(cells: &mut [Cell]) -> usize {
    let mut reference: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    for c in cells.iter() {
        for r in c.run.records.iter().filter(|r| r.error.is_none()) {
            reference.entry(r.index).or_insert_with(|| r.tokens.clone());
        }
    }
    let mut total = 0;
    for c in cells.iter_mut() {
        c.summary.mismatches = c
            .run
            .records
            .iter()
            .filter(|r| r.error.is_none() && reference.get(&r.index) != Some(&r.tokens))
            .map(|r| r.index)
            .collect();
        total += c.summary.mismatches.len();
    }
    total
}

/// The cost table `c(rows)` of the run: for every row count seen in a step's batched forward,
/// the median forward time over those steps. As a [`CostTable`] its `batch` axis is the row
/// count and its `tokens` axis is `[1]`, so `table.cost(rows, 1)` is the interpolated forward
/// time of `rows` rows. Pricing a step by its rows alone assumes a target that reads the
/// weights once per forward for every row (a multi-sequence forward); for a target that runs
/// one forward per sequence ([`speculative::PerSlot`]) the cost follows the sequences instead.
///
/// # Errors
/// [`BenchError::Invalid`] when no step has a positive forward time.
pub fn cost_table_from_steps(steps: &[StepSample], source: &str) -> Result<CostTable> {
    let mut by_rows: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for s in steps.iter().filter(|s| s.rows > 0 && s.forward_s > 0.0) {
        by_rows.entry(s.rows).or_default().push(s.forward_s);
    }
    let table = CostTable {
        source: source.to_string(),
        batch: by_rows.keys().copied().collect(),
        tokens: vec![1],
        cost: by_rows.values().map(|v| vec![pct(v, 50.0)]).collect(),
    };
    table.validate()?;
    Ok(table)
}

/// A two-dimensional table for `spec-bench simulate` from a rows table
/// ([`cost_table_from_steps`]): `c(B, n) = c_rows(B * n)` (one forward reads the weights once for
/// all rows; attention over separate KV caches is inside the measured rows costs).
///
/// # Errors
/// [`BenchError::Invalid`] for empty axes.
pub fn batch_table(rows: &CostTable, batch: &[usize], tokens: &[usize]) -> Result<CostTable> {
    let t = CostTable {
        source: format!("{} (c(B, n) = c(B * n rows))", rows.source),
        batch: batch.to_vec(),
        tokens: tokens.to_vec(),
        cost: batch
            .iter()
            .map(|&b| tokens.iter().map(|&n| rows.cost(b * n, 1)).collect())
            .collect(),
    };
    t.validate()?;
    Ok(t)
}

/// What [`predict_closed_loop`] takes from a measured load.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ServeModel {
    /// Tokens emitted per sequence and decode step (the mean accepted length).
    pub tokens_per_step: f64,
    /// Rows per sequence and decode step (1 + the mean draft length).
    pub rows_per_step: f64,
    /// Step time outside the forward per sequence of the step, seconds (proposing, verifying,
    /// scheduling).
    pub overhead_per_sequence_s: f64,
    /// Prompt rows a joining request prefills per step ([`BatchConfig::prefill_chunk`]).
    pub prefill_chunk: usize,
    /// Rows of one step at most ([`BatchConfig::max_batch_tokens`]).
    pub max_batch_tokens: usize,
}

impl ServeModel {
    /// The model of a measured load: its mean accepted length, draft rows per verify call and
    /// measured step overhead.
    pub fn of(c: &CellSummary, run: &LoadRun, config: &BatchConfig) -> Self {
        let st = |f: &dyn Fn(&StepSample) -> f64| run.steps.iter().map(f).sum::<f64>();
        ServeModel {
            tokens_per_step: c.mean_accepted_length.max(1.0),
            rows_per_step: 1.0 + c.mean_draft,
            overhead_per_sequence_s: ratio(
                st(&|s| s.step_s - s.forward_s),
                st(&|s| s.sequences as f64),
            ),
            prefill_chunk: config.prefill_chunk.max(1),
            max_batch_tokens: config.max_batch_tokens.max(1),
        }
    }
}

/// Predicted throughput (tokens/s) of a closed loop of `concurrency` over requests with these
/// `(prompt tokens, generated tokens)`: a step-by-step replay of [`BatchGenerator::step`]'s
/// schedule in which each in-flight request first prefills its prompt (all but the last token)
/// in chunks of `model.prefill_chunk` rows, under what the decode rows leave of
/// `model.max_batch_tokens`, then decodes `model.rows_per_step` rows per step emitting `model.tokens_per_step` tokens
/// (accumulated fractionally) until it has its generated tokens; a finished request is
/// replaced at the next step. A step costs `table.cost(rows, 1)` (the rows table of
/// [`cost_table_from_steps`]) plus `model.overhead_per_sequence_s` per sequence. This is the
/// batch-size simulator's model (`S = E[tokens per step] * c(1 row) / c(k + 1 rows)`, see
/// [`crate::sim`]) applied to a whole served load, tail and prefill included. Returns 0 when
/// nothing is generated.
pub fn predict_closed_loop(
    table: &CostTable,
    requests: &[(usize, usize)],
    concurrency: usize,
    model: &ServeModel,
) -> f64 {
    struct Seq {
        prefill: usize,
        left: f64,
    }
    let total: usize = requests.iter().map(|r| r.1).sum();
    if total == 0 || concurrency == 0 {
        return 0.0;
    }
    let mut queue = requests.iter();
    let mut active: Vec<Seq> = Vec::new();
    let mut time = 0.0;
    loop {
        while active.len() < concurrency {
            match queue.next() {
                Some(&(p, g)) => active.push(Seq {
                    prefill: p.saturating_sub(1),
                    left: g as f64,
                }),
                None => break,
            }
        }
        if active.is_empty() {
            break;
        }
        // Decode rows first, then prefill chunks under what is left of the row budget, in
        // submission order (a request decodes from the step after its prefill ends).
        let mut rows = 0.0;
        for s in active.iter_mut().filter(|s| s.prefill == 0) {
            rows += model.rows_per_step;
            s.left -= model.tokens_per_step;
        }
        let mut budget = model.max_batch_tokens.saturating_sub(rows.ceil() as usize);
        for s in active.iter_mut().filter(|s| s.prefill > 0) {
            let c = s.prefill.min(model.prefill_chunk).min(budget);
            s.prefill -= c;
            budget -= c;
            rows += c as f64;
        }
        let r = rows.round().max(1.0) as usize;
        time += table.cost(r, 1) + model.overhead_per_sequence_s * active.len() as f64;
        active.retain(|s| s.left > 1e-9);
    }
    ratio(total as f64, time)
}

/// Predicted against measured throughput of one closed-loop load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// The mode.
    pub mode: ServeMode,
    /// Requests in flight.
    pub concurrency: usize,
    /// Measured tokens/s.
    pub measured_tokens_per_s: f64,
    /// [`predict_closed_loop`] with the run's cost table and this load's acceptance.
    pub predicted_tokens_per_s: f64,
    /// `predicted / measured - 1`.
    pub error: f64,
    /// The cost table alone, on the load's actual steps: the sum over its steps of
    /// `c(rows of the step)` over the measured sum of forward times, minus 1 (how far the
    /// table's medians are from this load's forwards, e.g. from machine noise; the rest of
    /// `error` comes from the schedule and acceptance model).
    #[serde(default)]
    pub table_error: f64,
    /// Measured tokens/s over plain batched decoding's at the same concurrency (speculative
    /// modes, when plain ran).
    pub measured_speedup: Option<f64>,
    /// The same ratio of predictions.
    pub predicted_speedup: Option<f64>,
    /// The load's prefix reuse mode (speed-ups compare loads of the same mode).
    #[serde(default)]
    pub reuse: ReuseMode,
}

/// Predictions for every closed-loop cell (see [`Prediction`]).
pub fn predictions(cells: &[Cell], table: &CostTable, config: &BatchConfig) -> Vec<Prediction> {
    let mut out: Vec<Prediction> = cells
        .iter()
        .filter_map(|c| match c.summary.load {
            Load::Closed(conc) => {
                let reqs: Vec<(usize, usize)> = c
                    .run
                    .records
                    .iter()
                    // The prompt tokens it fed (reuse on: the rest after the cached prefix;
                    // records without the field: the whole prompt).
                    .map(|r| match r.prompt_prefilled {
                        0 => (r.prompt_tokens, r.tokens.len()),
                        fed => (fed, r.tokens.len()),
                    })
                    .collect();
                let m = ServeModel::of(&c.summary, &c.run, config);
                let p = predict_closed_loop(table, &reqs, conc, &m);
                Some(Prediction {
                    mode: c.summary.mode,
                    concurrency: conc,
                    measured_tokens_per_s: c.summary.tokens_per_s,
                    predicted_tokens_per_s: p,
                    error: ratio(p, c.summary.tokens_per_s) - 1.0,
                    table_error: ratio(
                        c.run
                            .steps
                            .iter()
                            .map(|s| table.cost(s.rows.max(1), 1))
                            .sum(),
                        c.run.steps.iter().map(|s| s.forward_s).sum(),
                    ) - 1.0,
                    measured_speedup: None,
                    predicted_speedup: None,
                    reuse: c.summary.reuse,
                })
            }
            Load::Open { .. } => None,
        })
        .collect();
    let plain: Vec<(usize, ReuseMode, f64, f64)> = out
        .iter()
        .filter(|p| p.mode == ServeMode::Plain)
        .map(|p| {
            (
                p.concurrency,
                p.reuse,
                p.measured_tokens_per_s,
                p.predicted_tokens_per_s,
            )
        })
        .collect();
    for p in out.iter_mut().filter(|p| p.mode.speculative()) {
        if let Some(&(_, _, m, q)) = plain
            .iter()
            .find(|x| x.0 == p.concurrency && x.1 == p.reuse)
        {
            p.measured_speedup = Some(ratio(p.measured_tokens_per_s, m));
            p.predicted_speedup = Some(ratio(p.predicted_tokens_per_s, q));
        }
    }
    out
}

/// Per speculative mode, the smallest closed-loop concurrency at which it was slower than plain
/// batched decoding (measured), with its throughput ratio to plain there; `None` when it never
/// was.
pub fn stops_paying(preds: &[Prediction]) -> Vec<(ServeMode, Option<(usize, f64)>)> {
    let mut modes: Vec<ServeMode> = preds.iter().map(|p| p.mode).collect();
    modes.dedup();
    modes.retain(|m| m.speculative());
    let mut seen = Vec::new();
    for m in modes {
        if seen.iter().any(|(x, _)| *x == m) {
            continue;
        }
        let mut cs: Vec<&Prediction> = preds
            .iter()
            .filter(|p| p.mode == m && p.measured_speedup.is_some())
            .collect();
        cs.sort_by_key(|p| p.concurrency);
        let at = cs
            .iter()
            .find(|p| p.measured_speedup.unwrap_or(1.0) < 1.0)
            .map(|p| (p.concurrency, p.measured_speedup.unwrap_or(1.0)));
        seen.push((m, at));
    }
    seen
}

/// Everything `spec-bench serve` writes to `serve.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServeReport {
    /// The run's settings (free text: workload, model, proposer, slots).
    pub source: String,
    /// Every (mode, load) summary.
    pub cells: Vec<CellSummary>,
    /// The measured cost table `c(rows)` ([`cost_table_from_steps`]).
    pub cost_rows: CostTable,
    /// Predicted against measured throughput.
    pub predictions: Vec<Prediction>,
    /// Greedy outputs that differed between cells (total over cells).
    pub mismatches: usize,
    /// Greedy outputs with prefix reuse on against off, per (mode, load)
    /// ([`crate::serve_reuse::reuse_checks`]; empty when one reuse mode ran).
    #[serde(default)]
    pub reuse_checks: Vec<crate::serve_reuse::ReuseCheck>,
}

/// The summaries as a markdown table.
pub fn markdown(cells: &[CellSummary]) -> String {
    let mut s = String::from(
        "| mode | load | reuse | requests | tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | accept rate | mean acc. len | mean k | rows/step | peak RSS MiB | errors | greedy mismatches |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for c in cells {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.0}/{:.0} | {:.1}/{:.1} | {:.1}/{:.1} | {:.3} | {:.2} | {:.2} | {:.1} | {} | {} | {} |\n",
            c.mode.label(),
            c.load.label(),
            c.reuse.label(),
            c.requests,
            c.tokens_per_s,
            c.ttft_p50_s * 1e3,
            c.ttft_p99_s * 1e3,
            c.tpot_p50_s * 1e3,
            c.tpot_p99_s * 1e3,
            c.itl_p50_s * 1e3,
            c.itl_p99_s * 1e3,
            c.acceptance_rate,
            c.mean_accepted_length,
            c.mean_draft,
            c.mean_rows,
            c.peak_rss_kib
                .map(|k| format!("{:.0}", k as f64 / 1024.0))
                .unwrap_or_else(|| "-".into()),
            c.errors,
            c.mismatches.len(),
        ));
    }
    s
}

/// Closed-loop throughput by concurrency, one column per mode, with each speculative mode's
/// ratio to plain batched decoding at the same concurrency and plain's ratio to plain at
/// concurrency 1 (the rows the goals read).
pub fn concurrency_markdown(cells: &[CellSummary]) -> String {
    let mut modes: Vec<ServeMode> = Vec::new();
    let mut concs: Vec<(ReuseMode, usize)> = Vec::new();
    for c in cells {
        if let Load::Closed(n) = c.load {
            if !modes.contains(&c.mode) {
                modes.push(c.mode);
            }
            if !concs.contains(&(c.reuse, n)) {
                concs.push((c.reuse, n));
            }
        }
    }
    concs.sort_unstable();
    let several = concs.iter().any(|c| c.0 != concs[0].0);
    let tput = |m: ServeMode, (r, n): (ReuseMode, usize)| {
        cells
            .iter()
            .find(|c| c.mode == m && c.load == Load::Closed(n) && c.reuse == r)
            .map(|c| c.tokens_per_s)
    };
    let has_plain = modes.contains(&ServeMode::Plain);
    let mut s = String::from("| concurrency |");
    for m in &modes {
        s.push_str(&format!(" {} tok/s |", m.label()));
    }
    if has_plain {
        s.push_str(" plain / plain C=1 |");
        for m in modes.iter().filter(|m| m.speculative()) {
            s.push_str(&format!(" {} / plain |", m.label()));
        }
    }
    s.push_str("\n|---|");
    let cols = modes.len()
        + if has_plain {
            1 + modes.iter().filter(|m| m.speculative()).count()
        } else {
            0
        };
    s.push_str(&"---|".repeat(cols));
    s.push('\n');
    let f = |v: Option<f64>, x: bool| match v {
        Some(v) if x => format!(" {v:.2}x |"),
        Some(v) => format!(" {v:.1} |"),
        None => " - |".into(),
    };
    for &n in &concs {
        // Plain at the smallest concurrency of the same reuse mode.
        let base = concs
            .iter()
            .find(|c| c.0 == n.0)
            .and_then(|&c| tput(ServeMode::Plain, c));
        if several {
            s.push_str(&format!("| {} ({}) |", n.1, n.0.label()));
        } else {
            s.push_str(&format!("| {} |", n.1));
        }
        for &m in &modes {
            s.push_str(&f(tput(m, n), false));
        }
        if has_plain {
            let p = tput(ServeMode::Plain, n);
            s.push_str(&f(p.zip(base).map(|(a, b)| ratio(a, b)), true));
            for &m in modes.iter().filter(|m| m.speculative()) {
                s.push_str(&f(tput(m, n).zip(p).map(|(a, b)| ratio(a, b)), true));
            }
        }
        s.push('\n');
    }
    s
}

/// The predictions as a markdown table, with the concurrency where each speculative mode stops
/// paying.
pub fn prediction_markdown(preds: &[Prediction]) -> String {
    let mut s = String::from(
        "| mode | concurrency | reuse | measured tok/s | predicted tok/s | error | cost table on the actual steps | measured speed-up | predicted speed-up |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let x = |v: Option<f64>| v.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into());
    for p in preds {
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:+.1}% | {:+.1}% | {} | {} |\n",
            p.mode.label(),
            p.concurrency,
            p.reuse.label(),
            p.measured_tokens_per_s,
            p.predicted_tokens_per_s,
            p.error * 100.0,
            p.table_error * 100.0,
            x(p.measured_speedup),
            x(p.predicted_speedup),
        ));
    }
    let within = preds.iter().filter(|p| p.error.abs() <= 0.15).count();
    s.push_str(&format!(
        "\nPredicted within 15% of measured: {within} of {} loads.\n",
        preds.len()
    ));
    for (m, at) in stops_paying(preds) {
        match at {
            Some((c, r)) => s.push_str(&format!(
                "{}: slower than plain batched decoding from concurrency {c} (measured, {r:.3}x).\n",
                m.label()
            )),
            None => s.push_str(&format!(
                "{}: not slower than plain batched decoding at any measured concurrency.\n",
                m.label()
            )),
        }
    }
    s
}

/// Writes `serve_throughput.svg` (tokens/s against concurrency, one line per mode) and
/// `serve_p99.svg` (p99 ITL and p99 TTFT in ms against concurrency) into `dir`, closed-loop
/// loads only.
///
/// # Errors
/// [`BenchError::Plot`].
pub fn plots(dir: &std::path::Path, cells: &[CellSummary]) -> Result<()> {
    let mut tput: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut lat: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for c in cells {
        if let Load::Closed(conc) = c.load {
            let x = conc as f64;
            let m = c.mode.label();
            tput.entry(m.clone()).or_default().push((x, c.tokens_per_s));
            lat.entry(format!("{m} ITL p99"))
                .or_default()
                .push((x, c.itl_p99_s * 1e3));
            lat.entry(format!("{m} TTFT p99"))
                .or_default()
                .push((x, c.ttft_p99_s * 1e3));
        }
    }
    let sorted = |m: BTreeMap<String, Vec<(f64, f64)>>| -> Vec<(String, Vec<(f64, f64)>)> {
        m.into_iter()
            .map(|(k, mut v)| {
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                (k, v)
            })
            .collect()
    };
    crate::report::line_plot(
        &dir.join("serve_throughput.svg"),
        "Throughput against concurrency (closed loop)",
        "requests in flight",
        "generated tokens/s",
        &sorted(tput),
    )?;
    crate::report::line_plot(
        &dir.join("serve_p99.svg"),
        "p99 latency against concurrency (closed loop)",
        "requests in flight",
        "p99 latency (ms)",
        &sorted(lat),
    )
}

/// Peak resident memory of the process since the last [`reset_peak_rss`], KiB (Linux
/// `VmHWM`; `None` elsewhere).
pub fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Resets the peak resident memory counter (Linux `/proc/self/clear_refs`; a no-op elsewhere).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_seeded_increasing_with_the_right_mean() {
        let a = poisson_arrivals(4.0, 4000, 7).unwrap();
        assert_eq!(a, poisson_arrivals(4.0, 4000, 7).unwrap());
        assert_ne!(a, poisson_arrivals(4.0, 4000, 8).unwrap());
        assert!(a.windows(2).all(|w| w[1] > w[0]) && a[0] > 0.0);
        // Mean gap 1/rate = 0.25 s; sd of the mean of 4000 exponentials = 0.25 / sqrt(4000).
        let mean = a[a.len() - 1] / a.len() as f64;
        assert!((mean - 0.25).abs() < 5.0 * 0.25 / 4000f64.sqrt(), "{mean}");
        // Exponential gaps: P(gap > mean) = e^-1.
        let gaps: Vec<f64> = std::iter::once(a[0])
            .chain(a.windows(2).map(|w| w[1] - w[0]))
            .collect();
        let above = gaps.iter().filter(|&&g| g > 0.25).count() as f64 / gaps.len() as f64;
        assert!((above - (-1f64).exp()).abs() < 0.03, "{above}");
        assert!(poisson_arrivals(0.0, 3, 0).is_err());
        assert!(poisson_arrivals(f64::NAN, 3, 0).is_err());
    }

    #[test]
    fn latency_statistics_on_known_chunks() {
        let r = RequestRecord {
            index: 0,
            source: 0,
            kind: "k".into(),
            prompt_tokens: 3,
            tokens: vec![1; 6],
            arrival_s: 1.0,
            submit_s: 1.0,
            chunks: vec![(1.5, 1), (1.7, 3), (2.0, 1), (2.5, 1)],
            end_s: 2.5,
            proposed: 4,
            accepted: 2,
            emitted: 6,
            target_calls: 4,
            error: None,
            prompt_reused: 0,
            prompt_prefilled: 3,
        };
        assert_eq!(r.ttft(), Some(0.5));
        assert!((r.tpot().unwrap() - 1.0 / 5.0).abs() < 1e-12);
        let itl = r.itl();
        assert_eq!(itl.len(), 3);
        assert!((itl[0] - 0.2).abs() < 1e-12 && (itl[2] - 0.5).abs() < 1e-12);
        let run = LoadRun {
            records: vec![r],
            steps: vec![],
            wall_s: 2.0,
            cost_curve: vec![],
            prefix_copies: 0,
            prefix_copied_tokens: 0,
        };
        let c = summarize(ServeMode::Fixed(2), Load::Closed(1), &run, None);
        assert_eq!(c.tokens_per_s, 3.0);
        assert_eq!((c.acceptance_rate, c.mean_accepted_length), (0.5, 1.5));
        // p50 / p99 of the gaps [0.2, 0.3, 0.5] by linear interpolation.
        assert!((c.itl_p50_s - 0.3).abs() < 1e-12);
        assert!((c.itl_p99_s - (0.3 + 0.98 * 0.2)).abs() < 1e-12);
        assert!((c.ttft_p99_s - 0.5).abs() < 1e-12);
    }

    #[test]
    fn stops_paying_reads_the_first_concurrency_below_plain() {
        let p = |mode, concurrency, sp: Option<f64>| Prediction {
            mode,
            concurrency,
            measured_tokens_per_s: 1.0,
            predicted_tokens_per_s: 1.0,
            error: 0.0,
            table_error: 0.0,
            measured_speedup: sp,
            predicted_speedup: sp,
            reuse: ReuseMode::On,
        };
        let k = ServeMode::Fixed(4);
        let g = ServeMode::Goodput(8);
        let preds = vec![
            p(ServeMode::Plain, 1, None),
            p(k, 8, Some(1.1)),
            p(k, 4, Some(0.9)),
            p(k, 1, Some(1.2)),
            p(k, 2, Some(1.05)),
            p(g, 1, Some(1.3)),
            p(g, 8, Some(1.0)),
        ];
        let got = stops_paying(&preds);
        assert_eq!(got, vec![(k, Some((4, 0.9))), (g, None)]);
        let md = prediction_markdown(&preds);
        assert!(md.contains("from concurrency 4 (measured, 0.900x)"), "{md}");
    }

    #[test]
    fn modes_parse() {
        assert_eq!(ServeMode::parse("plain").unwrap(), ServeMode::Plain);
        assert_eq!(ServeMode::parse("fixed:4").unwrap(), ServeMode::Fixed(4));
        assert_eq!(ServeMode::parse("3").unwrap(), ServeMode::Fixed(3));
        assert_eq!(ServeMode::parse("goodput").unwrap(), ServeMode::Goodput(8));
        assert_eq!(
            ServeMode::parse("goodput:6").unwrap(),
            ServeMode::Goodput(6)
        );
        assert!(ServeMode::parse("goodputx").is_err());
        assert!(ServeMode::parse("fast").is_err());
        assert!(matches!(ServeMode::Plain.draft(), DraftLength::Off));
    }

    #[test]
    fn cost_table_and_prediction() {
        let step = |rows, f| StepSample {
            in_flight: 1,
            unfinished: 1,
            sequences: 1,
            rows,
            prefill_rows: 0,
            draft_rows: 0,
            emitted: 1,
            forward_s: f,
            step_s: f,
        };
        let steps = [step(1, 1.0), step(1, 3.0), step(1, 2.0), step(4, 2.0)];
        let t = cost_table_from_steps(&steps, "t").unwrap();
        assert_eq!(t.batch, vec![1, 4]);
        assert_eq!(t.cost, vec![vec![2.0], vec![2.0]]);
        assert!(cost_table_from_steps(&[], "t").is_err());
        // Flat cost 2 s per step, no overhead, no prefill: C sequences emit C * L per step.
        let m = ServeModel {
            tokens_per_step: 2.0,
            rows_per_step: 3.0,
            overhead_per_sequence_s: 0.0,
            prefill_chunk: 64,
            max_batch_tokens: 512,
        };
        let reqs = vec![(1, 8); 4];
        assert!((predict_closed_loop(&t, &reqs, 4, &m) - 4.0).abs() < 1e-12);
        // One at a time: 16 steps of 2 s for 32 tokens.
        assert!((predict_closed_loop(&t, &reqs, 1, &m) - 1.0).abs() < 1e-12);
        // Prefill of 4 rows in chunks of 2 (2 steps), then 2 decode steps of 1 token.
        let m1 = ServeModel {
            tokens_per_step: 1.0,
            rows_per_step: 1.0,
            prefill_chunk: 2,
            ..m
        };
        assert!((predict_closed_loop(&t, &[(5, 2)], 1, &m1) - 2.0 / 8.0).abs() < 1e-12);
        // A row budget of 1 halves the prefill chunks: 4 prefill steps.
        let m2 = ServeModel {
            max_batch_tokens: 1,
            ..m1
        };
        assert!((predict_closed_loop(&t, &[(5, 2)], 1, &m2) - 2.0 / 12.0).abs() < 1e-12);
        let b = batch_table(&t, &[1, 2], &[1, 3]).unwrap();
        assert_eq!(b.cost(2, 3), 2.0);
    }
}
