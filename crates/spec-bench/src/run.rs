//! Running a configuration matrix against plain decoding, interleaved, with the full set of
//! latency figures.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use speculative::decode::{
    AdaptiveConfig, AdaptiveState, DraftLength, GenerationParams, Generator, StopConditions,
    TreeDrafts,
};
use speculative::{Draft, NoProposer, ProposeRequest, Proposer, SamplingConfig, TargetModel};

use crate::error::Result;
use crate::stats::percentile;
use speculative_guidance::{ForcedDrafts, Grammar, GrammarMask, Vocabulary};
use std::sync::Arc;

/// Draft length of a configuration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftSpec {
    /// Fixed `k`.
    Fixed(usize),
    /// Adaptive policy with this maximum `k`.
    Adaptive(usize),
}

impl std::fmt::Display for DraftSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraftSpec::Fixed(k) => write!(f, "k={k}"),
            DraftSpec::Adaptive(k) => write!(f, "adaptive<={k}"),
        }
    }
}

impl DraftSpec {
    /// Parses `4` or `adaptive` / `adaptive:8`.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix("adaptive") {
            let max = rest
                .strip_prefix(':')
                .map(|m| m.parse().ok())
                .unwrap_or(Some(8))?;
            return Some(DraftSpec::Adaptive(max));
        }
        s.parse().ok().map(DraftSpec::Fixed)
    }

    fn to_length(self) -> DraftLength {
        match self {
            DraftSpec::Fixed(k) => DraftLength::Fixed(k),
            DraftSpec::Adaptive(max_draft) => {
                DraftLength::Adaptive(AdaptiveConfig::default().with_max_draft(max_draft))
            }
        }
    }
}

/// One speculative configuration of the matrix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigSpec {
    /// Proposer name, resolved by the caller's proposer factory.
    pub proposer: String,
    /// Draft length.
    pub draft: DraftSpec,
    /// Temperature (0 = greedy).
    pub temperature: f32,
    /// Top-p (1 = off).
    pub top_p: f32,
    /// Seed.
    pub seed: u64,
    /// Node budget of tree drafts ([`TreeDrafts::nodes`]); 0 = chains. Absent in
    /// files written before trees: 0.
    #[serde(default)]
    pub tree_nodes: usize,
    /// Branching limit of tree drafts ([`TreeDrafts::with_branch`]); 0 = none. Absent in
    /// older files: 0.
    #[serde(default)]
    pub tree_branch: usize,
}

impl ConfigSpec {
    /// A short label such as `prompt-lookup k=4 t=0 p=1 s=0`, or
    /// `suffix k=8 tree=16 t=0 p=1 s=0` for a tree configuration (depth k, 16 nodes), with
    /// ` branch=2` after the node budget when the branching is limited.
    pub fn label(&self) -> String {
        let tree = match (self.tree_nodes, self.tree_branch) {
            (0, _) => String::new(),
            (n, 0) => format!(" tree={n}"),
            (n, b) => format!(" tree={n} branch={b}"),
        };
        format!(
            "{} {}{tree} t={} p={} s={}",
            self.proposer, self.draft, self.temperature, self.top_p, self.seed
        )
    }

    /// The sampling configuration.
    ///
    /// # Errors
    /// [`speculative::Error::InvalidConfig`] for an invalid temperature or top-p.
    pub fn sampling(&self) -> Result<SamplingConfig> {
        Ok(SamplingConfig::builder()
            .temperature(self.temperature)
            .top_p(self.top_p)
            .build()?)
    }
}

/// One verify step as seen by the harness.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Output position (0-based) of the first token emitted by this step.
    pub position: usize,
    /// Drafts verified.
    pub k: usize,
    /// Drafts accepted.
    pub accepted: usize,
    /// Tokens emitted.
    pub emitted: usize,
    /// Depth of the step's draft tree (`None` for a chain, and in files written before trees).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree_depth: Option<usize>,
}

/// The measurements of one generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Index of the request in the workload.
    pub request: usize,
    /// The request's kind.
    pub kind: String,
    /// Configuration label (`"plain"` for the baseline).
    pub label: String,
    /// The configuration (`None` for the baseline).
    pub config: Option<ConfigSpec>,
    /// Repetition index.
    pub rep: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// FNV-1a hash of the prompt's token ids (little-endian u32s), so that a later
    /// `spec-bench replay` can check it re-tokenised the same prompt. `None` in files written
    /// before it was recorded.
    #[serde(default)]
    pub prompt_hash: Option<u64>,
    /// Output tokens.
    pub tokens: Vec<u32>,
    /// End-to-end latency in seconds (prefill included).
    pub e2e_s: f64,
    /// Time to first token in seconds.
    pub ttft_s: f64,
    /// Inter-token latencies in seconds (one per output token after the first; tokens that
    /// arrive in the same verified block have latency 0). They sum to `e2e_s - ttft_s`.
    pub itl_s: Vec<f64>,
    /// Output tokens per second over the end-to-end latency.
    pub tokens_per_s: f64,
    /// Peak resident memory of the process during the run, in KiB (Linux `VmHWM` after a reset
    /// through `/proc/self/clear_refs`; `None` elsewhere).
    pub peak_rss_kib: Option<u64>,
    /// Seconds in the proposer.
    pub propose_s: f64,
    /// Seconds in target verify forwards.
    pub forward_s: f64,
    /// Seconds in verification (processing and acceptance).
    pub verify_s: f64,
    /// Seconds in the prefill.
    pub prefill_s: f64,
    /// Acceptance rate (accepted / proposed drafts).
    pub acceptance_rate: f64,
    /// Mean accepted length (emitted tokens / target calls).
    pub mean_accepted_length: f64,
    /// Per draft position: `(reached, accepted)`.
    pub by_position: Vec<(usize, usize)>,
    /// The steps.
    pub steps: Vec<StepRecord>,
    /// Speed-up against the baseline of the same request, rep and sampling configuration
    /// (ratio of tokens per second end to end, prefill included), set for speculative runs.
    pub speedup: Option<f64>,
    /// Decode speed-up against the same baseline: the ratio of output tokens per second of
    /// decoding, prefill excluded (`tokens / (e2e_s - prefill_s)`), set for speculative runs.
    /// `None` in files written before it was recorded.
    #[serde(default)]
    pub decode_speedup: Option<f64>,
    /// For greedy runs: whether the output equals the plain greedy output token for token.
    pub greedy_identical: Option<bool>,
    /// Steps whose draft was a branching tree.
    #[serde(default)]
    pub tree_steps: usize,
    /// Mean nodes per tree step (0 without tree steps).
    #[serde(default)]
    pub mean_tree_nodes: f64,
    /// The run reused cached prefixes ([`RunInput::cached`]; prefix reuse on).
    #[serde(default)]
    pub prefix_reuse: bool,
    /// Prompt tokens found in the target's cache (not prefilled).
    #[serde(default)]
    pub prompt_reused: usize,
    /// Prompt tokens the target processed (prefill and the first step's last prompt token).
    #[serde(default)]
    pub prompt_prefilled: usize,
    /// Runs with reuse on, when the same run has the reuse-off mode too: whether the tokens
    /// equal the reuse-off run's of the same request, configuration and repetition.
    #[serde(default)]
    pub reuse_identical: Option<bool>,
}

/// Wraps a proposer to record each step's draft length and outcome.
struct Recording<'p> {
    inner: &'p mut dyn Proposer,
    pending_k: Option<usize>,
    pending_depth: Option<usize>,
    position: usize,
    steps: Vec<StepRecord>,
}

impl Proposer for Recording<'_> {
    fn drafts_from_tokens(&self) -> bool {
        self.inner.drafts_from_tokens()
    }

    /// The inner proposer's (a cost-aware merge under the adaptive draft length is asked for
    /// the longest draft, as without the recording).
    fn sizes_own_drafts(&self, config: &speculative::SamplingConfig) -> bool {
        self.inner.sizes_own_drafts(config)
    }

    /// The inner proposer's.
    fn learned(&self) -> Option<speculative::propose::Learned> {
        self.inner.learned()
    }

    /// Forwarded to the inner proposer.
    fn start_from_learned(
        &mut self,
        costs: &speculative::propose::Learned,
    ) -> speculative::Result<()> {
        self.inner.start_from_learned(costs)
    }
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> speculative::Result<()> {
        self.inner.propose(req, draft)?;
        self.pending_k = Some(draft.tokens.len().min(req.max_draft));
        self.pending_depth = None;
        Ok(())
    }
    fn propose_tree(
        &mut self,
        req: &ProposeRequest<'_>,
        draft: &mut Draft,
    ) -> speculative::Result<()> {
        self.inner.propose_tree(req, draft)?;
        self.pending_k = Some(draft.tokens.len().min(req.max_nodes));
        let b = draft.block();
        self.pending_depth = (!b.is_chain()).then(|| b.max_depth());
        Ok(())
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> speculative::Result<()> {
        self.steps.push(StepRecord {
            position: self.position,
            k: self.pending_k.take().unwrap_or(0),
            accepted,
            emitted: emitted.len(),
            tree_depth: self.pending_depth.take(),
        });
        self.position += emitted.len();
        self.inner.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> speculative::Result<()> {
        self.inner.begin(prompt)
    }
    fn begin_reusing(&mut self, prompt: &[u32]) -> speculative::Result<()> {
        self.inner.begin_reusing(prompt)
    }
    fn finish(&mut self, sequence: &[u32]) {
        self.inner.finish(sequence)
    }
    fn row_candidates(&self) -> usize {
        self.inner.row_candidates()
    }
    fn observe_rows(&mut self, rows: &speculative::VerifiedRows<'_>) -> speculative::Result<()> {
        self.inner.observe_rows(rows)
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

/// Output tokens per second of decoding (prefill excluded) of a record.
pub fn decode_tokens_per_s(r: &RunRecord) -> f64 {
    let t = r.e2e_s - r.prefill_s;
    if t > 0.0 {
        r.tokens.len() as f64 / t
    } else {
        0.0
    }
}

fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// What a single generation needs.
pub struct RunInput<'a> {
    /// Request index.
    pub request: usize,
    /// Request kind.
    pub kind: &'a str,
    /// Prompt tokens.
    pub prompt: &'a [u32],
    /// Maximum new tokens.
    pub max_tokens: usize,
    /// EOS ids.
    pub eos: &'a [u32],
    /// Repetition index.
    pub rep: usize,
    /// The request's grammar (structured output), if any.
    pub constraint: Option<Constraint<'a>>,
    /// Prefix reuse: the tokens the target's cache holds before this run (what this
    /// conversation's previous turn left, as a server that keeps it would have), put there
    /// untimed with [`speculative::decode::Generator::prefill_cache`]; the run then reuses
    /// their common prefix with its prompt. `None`: reuse off (a full prefill).
    pub cached: Option<&'a [u32]>,
    /// [`speculative::decode::Generator::with_fused_prefill`] for the run.
    pub fused_prefill: bool,
}

impl RunInput<'_> {
    /// The tokens the target's cache holds after a run of this input that emitted `tokens`:
    /// the prompt and the output but the last token.
    pub fn cached_after(&self, tokens: &[u32]) -> Vec<u32> {
        let mut all: Vec<u32> = self.prompt.iter().chain(tokens).copied().collect();
        all.pop();
        all
    }
}

/// A grammar constraint of one request: every run (baseline included) masks its rows with a
/// fresh [`GrammarMask`] of `grammar`; speculative runs put the grammar-forced tokens in front
/// of their proposer's drafts ([`ForcedDrafts`]) when `forced_drafts` is set.
#[derive(Debug, Clone, Copy)]
pub struct Constraint<'a> {
    /// The model's vocabulary for llguidance.
    pub vocab: &'a Vocabulary,
    /// The grammar.
    pub grammar: &'a Grammar,
    /// Wrap speculative proposers in [`ForcedDrafts`].
    pub forced_drafts: bool,
}

/// Runs one generation of `proposer` on `target` (`config = None` is the plain baseline) and
/// measures it.
///
/// `policy`: the adaptive policy's cost estimates to start from and to update
/// ([`AdaptiveState::costs_only`] of what the run's generator measured; the acceptance
/// estimates start fresh in every run), as a server that keeps its engine's cost curve across
/// requests; `None`: a fresh policy, which spends its first step measuring the curve.
///
/// # Errors
/// Errors of the decoding loop.
pub fn run_one(
    target: &mut dyn TargetModel,
    proposer: &mut dyn Proposer,
    input: &RunInput<'_>,
    config: Option<&ConfigSpec>,
    sampling: &SamplingConfig,
    seed: u64,
    policy: Option<&mut AdaptiveState>,
) -> Result<RunRecord> {
    let mut stop = StopConditions::default();
    for &e in input.eos {
        stop = stop.with_eos(e);
    }
    let mut params = GenerationParams::builder()
        .sampling(sampling.clone())
        .seed(seed)
        .max_new_tokens(input.max_tokens)
        .stop(stop)
        .draft(
            config
                .map(|c| c.draft.to_length())
                .unwrap_or(DraftLength::Off),
        )
        .tree(
            TreeDrafts::nodes(config.map_or(0, |c| c.tree_nodes))
                .with_branch(config.map_or(0, |c| c.tree_branch)),
        )
        .build()?;
    let mut no = NoProposer;
    let mut inner: &mut dyn Proposer = if config.is_some() { proposer } else { &mut no };
    let mut forced;
    if let Some(c) = &input.constraint {
        let mask = Arc::new(
            GrammarMask::new(c.vocab, c.grammar, input.prompt.len())
                .map_err(speculative::Error::from)?,
        );
        params = params
            .to_builder()
            .sampling(sampling.to_builder().mask(mask.clone()).build()?)
            .build()?;
        if c.forced_drafts && config.is_some() {
            forced = ForcedDrafts::new(mask, inner);
            inner = &mut forced;
        }
    }
    let mut rec = Recording {
        inner,
        pending_k: None,
        pending_depth: None,
        position: 0,
        steps: Vec::new(),
    };
    reset_peak_rss();
    let mut arrivals: Vec<(f64, usize)> = Vec::new();
    let mut g = Generator::new(&mut *target, &mut rec)
        .with_prefix_reuse(input.cached.is_some())
        .with_fused_prefill(input.fused_prefill);
    if let Some(p) = policy.as_deref() {
        g = g.with_adaptive_state(p.costs_only());
    }
    if let Some(c) = input.cached {
        g.prefill_cache(c)?;
    }
    let start = Instant::now();
    let out = {
        g.generate_with(input.prompt, &params, |t| {
            arrivals.push((start.elapsed().as_secs_f64(), t.len()));
            std::ops::ControlFlow::Continue(())
        })
        .map_err(speculative::Error::from)?
    };
    let e2e = start.elapsed().as_secs_f64();
    if let Some(p) = policy {
        *p = g.adaptive_state().costs_only();
    }
    drop(g);
    let peak = peak_rss_kib();
    let ttft = arrivals.first().map(|a| a.0).unwrap_or(e2e);
    let itl = inter_token_latencies(&arrivals);
    let m = &out.metrics;
    Ok(RunRecord {
        request: input.request,
        kind: input.kind.to_string(),
        label: {
            let l = config.map(|c| c.label()).unwrap_or_else(|| "plain".into());
            if input.cached.is_some() {
                format!("{l} +reuse")
            } else {
                l
            }
        },
        config: config.cloned(),
        rep: input.rep,
        prompt_tokens: input.prompt.len(),
        prompt_hash: Some(token_hash(input.prompt)),
        tokens_per_s: if e2e > 0.0 {
            out.tokens.len() as f64 / e2e
        } else {
            0.0
        },
        tokens: out.tokens,
        e2e_s: e2e,
        ttft_s: ttft,
        itl_s: itl,
        peak_rss_kib: peak,
        propose_s: m.propose_time.as_secs_f64(),
        forward_s: m.forward_time.as_secs_f64(),
        verify_s: m.verify_time.as_secs_f64(),
        prefill_s: m.prefill_time.as_secs_f64(),
        acceptance_rate: m.acceptance_rate(),
        mean_accepted_length: m.mean_accepted_length(),
        by_position: m
            .reached_at
            .iter()
            .copied()
            .zip(m.accepted_at.iter().copied())
            .collect(),
        steps: rec.steps,
        speedup: None,
        decode_speedup: None,
        greedy_identical: None,
        tree_steps: m.tree_steps,
        mean_tree_nodes: m.mean_tree_nodes(),
        prefix_reuse: input.cached.is_some(),
        prompt_reused: m.prompt_tokens_reused,
        prompt_prefilled: m.prompt_tokens_prefilled,
        reuse_identical: None,
    })
}

/// Inter-token latencies (seconds) from chunk arrivals `(time, tokens)`: the first token of each
/// later chunk waits `time - previous time`, the other tokens of a chunk wait 0. The sum equals
/// the last arrival minus the first.
pub fn inter_token_latencies(arrivals: &[(f64, usize)]) -> Vec<f64> {
    let mut itl = Vec::new();
    for (i, &(t, n)) in arrivals.iter().enumerate() {
        if i > 0 {
            itl.push(t - arrivals[i - 1].0);
            itl.extend(std::iter::repeat_n(0.0, n.saturating_sub(1)));
        } else {
            itl.extend(std::iter::repeat_n(0.0, n.saturating_sub(1)));
        }
    }
    itl
}

/// Latency percentiles of a record's inter-token latencies: (p50, p90, p99) in seconds.
pub fn itl_percentiles(r: &RunRecord) -> (f64, f64, f64) {
    (
        percentile(&r.itl_s, 50.0).unwrap_or(0.0),
        percentile(&r.itl_s, 90.0).unwrap_or(0.0),
        percentile(&r.itl_s, 99.0).unwrap_or(0.0),
    )
}

/// FNV-1a (64-bit) over the little-endian bytes of `tokens`: the prompt fingerprint stored in
/// [`RunRecord::prompt_hash`].
pub fn token_hash(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recording_keeps_what_the_loop_asks_of_its_proposer() {
        // A cost-aware merge sizes its own drafts: under the adaptive draft length the loop
        // asks it for the longest draft, recorded or not.
        let mut merge = speculative::propose::MergedProposer::new(vec![Box::new(
            speculative::propose::PromptLookup::new(1, 3).unwrap(),
        )])
        .unwrap();
        let rec = Recording {
            inner: &mut merge,
            pending_k: None,
            pending_depth: None,
            position: 0,
            steps: Vec::new(),
        };
        assert!(rec.sizes_own_drafts(&speculative::SamplingConfig::greedy()));
        assert!(rec.drafts_from_tokens());
    }
}
