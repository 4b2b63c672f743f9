//! The configuration matrix, interleaved with the plain baseline.

use std::collections::HashMap;

use speculative::decode::AdaptiveState;
use speculative::propose::Learned;
use speculative::{Proposer, SamplingConfig, TargetModel};

use crate::error::Result;
use crate::run::{ConfigSpec, Constraint, RunInput, RunRecord, decode_tokens_per_s, run_one};

/// A tokenized request.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedRequest {
    /// Kind, for aggregates.
    pub kind: String,
    /// Prompt tokens (chat template applied). Unused for a conversation turn (`turn`), whose
    /// prompt is built when it runs.
    pub prompt: Vec<u32>,
    /// Maximum new tokens.
    pub max_tokens: usize,
    /// A turn of a multi-turn conversation, or `None` for a stand-alone request.
    pub turn: Option<Turn>,
    /// The grammar the output must follow (structured output), or `None`.
    pub grammar: Option<speculative_guidance::Grammar>,
}

/// A turn of a conversation ([`crate::workload::Request::session`]): its prompt is the whole
/// conversation so far (the earlier turns' messages as user turns, and the outputs that the
/// same configuration generated for them as assistant turns) followed by this turn's message,
/// built by the [`PromptBuilder`] when the turn runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Turn {
    /// The conversation's name; turns of one session run in workload order.
    pub session: String,
    /// This turn's user message.
    pub message: String,
}

/// Builds the prompt tokens of a conversation turn from the earlier turns (user message and
/// the output tokens generated for it) and the new message.
pub type PromptBuilder<'a> = dyn FnMut(&[(String, Vec<u32>)], &str) -> Result<Vec<u32>> + 'a;

/// The matrix: configurations, warm-up runs and repetitions.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    /// Speculative configurations.
    pub configs: Vec<ConfigSpec>,
    /// Warm-up generations (of the first request, discarded) per configuration and baseline.
    pub warmup: usize,
    /// Repetitions of every (request, configuration) pair.
    pub reps: usize,
    /// Keep each configuration's proposer across the requests of a repetition (a suffix
    /// corpus, a token-recycling table carry over, as in a server that runs requests one after
    /// another); `false`: a fresh proposer for every run.
    pub carry: bool,
    /// Start every run of a speculative configuration from what its earlier runs learned,
    /// warm-up runs included: the adaptive policy's cost estimates
    /// ([`speculative::decode::AdaptiveState::costs_only`]: the forward cost curve and the
    /// proposing time, never acceptance) and the proposer's ([`speculative::Proposer::learned`]:
    /// a merge's rates, gains and costs, what a long-lived merge keeps), as a server that keeps
    /// them per engine; `false`: a fresh policy per run, which spends its first step measuring
    /// the curve, and proposers that learn everything afresh.
    pub carry_costs: bool,
    /// With grammar-constrained requests: put the grammar-forced tokens in front of every
    /// speculative configuration's drafts (`speculative_guidance::ForcedDrafts`).
    pub forced_drafts: bool,
    /// Prefix reuse modes to run, each with its own baseline and lanes (records of the
    /// reuse-on mode are labelled ` +reuse`; speed-ups compare runs of the same mode). Reuse on:
    /// before each run the target's cache is given what the same lane's previous run of the
    /// conversation (or, for a stand-alone request, the lane's previous request) left, as a
    /// server that keeps each conversation's cache would have it, untimed; the run reuses the
    /// common prefix. Empty means `[false]`.
    pub prefix_reuse: Vec<bool>,
    /// Feed the prompt tokens a run has left to prefill in its first verify forward
    /// ([`speculative::decode::Generator::with_fused_prefill`]), for the plain baselines and
    /// the configurations whose proposer drafts from tokens alone.
    pub fused_prefill: bool,
}

/// Creates a proposer from its name.
pub type ProposerFactory<'a> = dyn FnMut(&str) -> Result<Box<dyn Proposer>> + 'a;

/// The state one configuration (or one baseline) carries through a repetition: its proposer
/// (with [`Matrix::carry`]) and its conversations.
#[derive(Default)]
struct Lane {
    proposer: Option<Box<dyn Proposer>>,
    sessions: HashMap<String, Vec<(String, Vec<u32>)>>,
    /// Prefix reuse: the tokens each conversation's cache holds (key: the session, `""` for
    /// stand-alone requests); `None` with reuse off.
    caches: Option<HashMap<String, Vec<u32>>>,
}

impl Lane {
    /// The prompt of `r` in this lane: its own tokens, or its conversation so far plus its
    /// message.
    fn prompt(&self, r: &PreparedRequest, build: &mut PromptBuilder<'_>) -> Result<Vec<u32>> {
        match &r.turn {
            None => Ok(r.prompt.clone()),
            Some(t) => build(
                self.sessions.get(&t.session).map(|v| &v[..]).unwrap_or(&[]),
                &t.message,
            ),
        }
    }

    /// The cache this lane's run of `r` starts from (reuse on), empty for a first turn.
    fn cached(&self, r: &PreparedRequest) -> Option<&[u32]> {
        let key = r.turn.as_ref().map_or("", |t| &t.session);
        self.caches
            .as_ref()
            .map(|c| c.get(key).map_or(&[][..], |v| &v[..]))
    }

    /// Keeps what a run of `input` for `r` left in the cache (reuse on).
    fn keep_cache(&mut self, r: &PreparedRequest, input: &RunInput<'_>, output: &[u32]) {
        let key = r
            .turn
            .as_ref()
            .map_or("", |t| t.session.as_str())
            .to_string();
        if let Some(c) = self.caches.as_mut() {
            c.insert(key, input.cached_after(output));
        }
    }

    /// Records the output of `r` in its conversation.
    fn answered(&mut self, r: &PreparedRequest, output: &[u32]) {
        if let Some(t) = &r.turn {
            self.sessions
                .entry(t.session.clone())
                .or_default()
                .push((t.message.clone(), output.to_vec()));
        }
    }
}

/// Runs the matrix. For each repetition, request (in workload order) and sampling key
/// (temperature, top-p, seed) in the matrix, the plain baseline runs first and then every
/// speculative configuration with that key, in an order rotated by the repetition index, so
/// that machine drift affects the baseline and the speculative runs alike. Each speculative
/// record gets its speed-ups against that baseline (end to end and decode only, ratios of
/// tokens per second) and, for greedy runs, whether its tokens equal the baseline's.
///
/// Without [`Matrix::carry`] every run gets a fresh proposer from `factory`, so that no run can
/// draw on the output of an earlier run (a suffix proposer's shared corpus would otherwise
/// replay the identical greedy answer of the previous configuration or repetition and overstate
/// its acceptance). With it, each configuration keeps one proposer through the requests of a
/// repetition (a fresh one per repetition), so what it learns from earlier requests (suffix
/// corpus, token-recycling table) carries over, as in a server; the baseline runs the same
/// requests in the same order.
///
/// Conversation turns ([`PreparedRequest::turn`]) get their prompt from `build` over the
/// conversation of the same configuration (each configuration, and the baseline, answers its
/// own conversation; under greedy decoding the answers are the same).
///
/// Requests with a grammar ([`PreparedRequest::grammar`]) are constrained in every run,
/// baseline included, through `vocab` (see [`crate::run::Constraint`]); without `vocab` their
/// grammar is ignored.
///
/// `progress` is called after each generation with a short description.
///
/// # Errors
/// Errors of the factory, of `build` and of the decoding loop (a grammar that does not compile
/// included).
#[allow(clippy::too_many_arguments)]
pub fn run_matrix(
    vocab: Option<&speculative_guidance::Vocabulary>,
    target: &mut dyn TargetModel,
    factory: &mut ProposerFactory<'_>,
    requests: &[PreparedRequest],
    eos: &[u32],
    matrix: &Matrix,
    build: &mut PromptBuilder<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<RunRecord>> {
    // Check every proposer name once, before any run.
    for c in &matrix.configs {
        factory(&c.proposer)?;
    }
    // Group configurations by sampling key, keeping first-seen order.
    let mut keys: Vec<(f32, f32, u64)> = Vec::new();
    for c in &matrix.configs {
        let k = (c.temperature, c.top_p, c.seed);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut none = speculative::NoProposer;
    // Per configuration, the cost estimates its runs carry (`Matrix::carry_costs`).
    let mut costs: Vec<Carried> = vec![Carried::default(); matrix.configs.len()];
    // Warm-up on the first request (fresh proposers, discarded).
    if let Some(r0) = requests.first() {
        let prompt = Lane::default().prompt(r0, build)?;
        for w in 0..matrix.warmup {
            let input = RunInput {
                request: 0,
                kind: &r0.kind,
                prompt: &prompt,
                max_tokens: r0.max_tokens,
                eos,
                rep: w,
                constraint: constraint(vocab, r0, matrix.forced_drafts),
                cached: None,
                fused_prefill: matrix.fused_prefill,
            };
            let s = matrix
                .configs
                .first()
                .map(|c| c.sampling())
                .transpose()?
                .unwrap_or_default();
            run_one(target, &mut none, &input, None, &s, 0, None)?;
            for (ci, c) in matrix.configs.iter().enumerate() {
                let mut p = factory(&c.proposer)?;
                let carried = matrix.carry_costs.then_some(&mut costs[ci]);
                let sampling = c.sampling()?;
                run_carried(target, &mut *p, &input, c, &sampling, c.seed, carried)?;
            }
            progress("warm-up");
        }
    }
    let modes: Vec<bool> = if matrix.prefix_reuse.is_empty() {
        vec![false]
    } else {
        matrix.prefix_reuse.clone()
    };
    let mut out = Vec::new();
    for rep in 0..matrix.reps {
        for &reuse in &modes {
            let lanes = Lanes {
                keys: &keys,
                rep,
                reuse,
                costs: &mut costs,
            };
            let o = run_rep(
                vocab, target, factory, requests, eos, matrix, build, progress, lanes,
            )?;
            out.extend(o);
        }
    }
    if modes.contains(&true) && modes.contains(&false) {
        mark_reuse_identical(&mut out);
    }
    Ok(out)
}

/// The cost estimates a configuration's runs carry ([`Matrix::carry_costs`]).
#[derive(Debug, Clone, Default)]
struct Carried {
    /// The adaptive policy's ([`AdaptiveState::costs_only`]).
    policy: AdaptiveState,
    /// The proposer's ([`Proposer::learned`]; `None`: it learns none, or no run yet).
    proposer: Option<Learned>,
}

/// [`run_one`] of configuration `c`, starting the proposer from the carried costs and the
/// policy from the carried estimates, and keeping what the run measured (`carried = None`:
/// nothing is carried).
fn run_carried(
    target: &mut dyn TargetModel,
    proposer: &mut dyn Proposer,
    input: &RunInput<'_>,
    c: &ConfigSpec,
    sampling: &SamplingConfig,
    seed: u64,
    carried: Option<&mut Carried>,
) -> Result<RunRecord> {
    let Some(carried) = carried else {
        return run_one(target, proposer, input, Some(c), sampling, seed, None);
    };
    if let Some(l) = &carried.proposer {
        proposer.start_from_learned(l)?;
    }
    let rec = run_one(
        target,
        proposer,
        input,
        Some(c),
        sampling,
        seed,
        Some(&mut carried.policy),
    )?;
    carried.proposer = proposer.learned();
    Ok(rec)
}

/// Sets [`RunRecord::reuse_identical`] of every reuse-on record that has a reuse-off twin
/// (same request, repetition and configuration label).
fn mark_reuse_identical(out: &mut [RunRecord]) {
    let off: HashMap<(usize, usize, String), Vec<u32>> = out
        .iter()
        .filter(|r| !r.prefix_reuse)
        .map(|r| ((r.request, r.rep, r.label.clone()), r.tokens.clone()))
        .collect();
    for r in out.iter_mut().filter(|r| r.prefix_reuse) {
        let label = r.label.trim_end_matches(" +reuse").to_string();
        if let Some(t) = off.get(&(r.request, r.rep, label)) {
            r.reuse_identical = Some(*t == r.tokens);
        }
    }
}

/// The grammar constraint of request `r` under `vocab` (`None` when either is absent).
fn constraint<'a>(
    vocab: Option<&'a speculative_guidance::Vocabulary>,
    r: &'a PreparedRequest,
    forced_drafts: bool,
) -> Option<Constraint<'a>> {
    Some(Constraint {
        vocab: vocab?,
        grammar: r.grammar.as_ref()?,
        forced_drafts,
    })
}

/// What one repetition of [`run_matrix`] runs in: the sampling keys, the repetition index, the
/// prefix-reuse mode and the configurations' carried cost estimates.
struct Lanes<'a> {
    keys: &'a [(f32, f32, u64)],
    rep: usize,
    reuse: bool,
    costs: &'a mut [Carried],
}

/// One repetition of [`run_matrix`] in one prefix-reuse mode.
#[allow(clippy::too_many_arguments)]
fn run_rep(
    vocab: Option<&speculative_guidance::Vocabulary>,
    target: &mut dyn TargetModel,
    factory: &mut ProposerFactory<'_>,
    requests: &[PreparedRequest],
    eos: &[u32],
    matrix: &Matrix,
    build: &mut PromptBuilder<'_>,
    progress: &mut dyn FnMut(&str),
    lanes_of: Lanes<'_>,
) -> Result<Vec<RunRecord>> {
    let Lanes {
        keys,
        rep,
        reuse,
        costs,
    } = lanes_of;
    let mut none = speculative::NoProposer;
    let caches = || reuse.then(HashMap::new);
    let mut out = Vec::new();
    {
        // One lane per baseline key, then one per configuration.
        let mut base_lanes: Vec<Lane> = keys
            .iter()
            .map(|_| Lane {
                caches: caches(),
                ..Lane::default()
            })
            .collect();
        let mut lanes: Vec<Lane> = Vec::with_capacity(matrix.configs.len());
        for c in &matrix.configs {
            lanes.push(Lane {
                proposer: if matrix.carry {
                    Some(factory(&c.proposer)?)
                } else {
                    None
                },
                sessions: HashMap::new(),
                caches: caches(),
            });
        }
        for (ri, r) in requests.iter().enumerate() {
            for (ki, &(t, p, seed)) in keys.iter().enumerate() {
                let group: Vec<usize> = (0..matrix.configs.len())
                    .filter(|&ci| {
                        let c = &matrix.configs[ci];
                        (c.temperature, c.top_p, c.seed) == (t, p, seed)
                    })
                    .collect();
                let sampling = matrix.configs[group[0]].sampling()?;
                let prompt = base_lanes[ki].prompt(r, build)?;
                let base_cached = base_lanes[ki].cached(r).map(<[u32]>::to_vec);
                let input = RunInput {
                    request: ri,
                    kind: &r.kind,
                    prompt: &prompt,
                    max_tokens: r.max_tokens,
                    eos,
                    rep,
                    constraint: constraint(vocab, r, matrix.forced_drafts),
                    cached: base_cached.as_deref(),
                    fused_prefill: matrix.fused_prefill,
                };
                let base = run_one(target, &mut none, &input, None, &sampling, seed, None)?;
                base_lanes[ki].keep_cache(r, &input, &base.tokens);
                base_lanes[ki].answered(r, &base.tokens);
                progress(&format!("request {ri} rep {rep} plain"));
                let n = group.len();
                for j in 0..n {
                    let ci = group[(j + rep) % n];
                    let c = &matrix.configs[ci];
                    let lane = &mut lanes[ci];
                    let prompt = lane.prompt(r, build)?;
                    let cached = lane.cached(r).map(<[u32]>::to_vec);
                    let input = RunInput {
                        prompt: &prompt,
                        cached: cached.as_deref(),
                        ..input
                    };
                    let mut fresh;
                    let prop: &mut dyn Proposer = match lane.proposer.as_mut() {
                        Some(p) => &mut **p,
                        None => {
                            fresh = factory(&c.proposer)?;
                            &mut *fresh
                        }
                    };
                    let carried = matrix.carry_costs.then_some(&mut costs[ci]);
                    let mut rec = run_carried(target, prop, &input, c, &sampling, seed, carried)?;
                    lane.keep_cache(r, &input, &rec.tokens);
                    lane.answered(r, &rec.tokens);
                    if base.tokens_per_s > 0.0 {
                        rec.speedup = Some(rec.tokens_per_s / base.tokens_per_s);
                    }
                    let (bd, rd) = (decode_tokens_per_s(&base), decode_tokens_per_s(&rec));
                    if bd > 0.0 {
                        rec.decode_speedup = Some(rd / bd);
                    }
                    if t == 0.0 {
                        rec.greedy_identical = Some(rec.tokens == base.tokens);
                    }
                    progress(&format!("request {ri} rep {rep} {}", c.label()));
                    out.push(rec);
                }
                out.push(base);
            }
        }
    }
    Ok(out)
}
