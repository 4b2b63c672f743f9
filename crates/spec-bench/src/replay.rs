//! Offline replay of greedy generations through proposers, and the copy-oracle bound.
//!
//! In greedy mode the emitted text does not depend on the proposer (speculative greedy output is
//! token-identical to plain greedy output), so once a generation `output` of a prompt is known,
//! any proposer can be evaluated without the model: at each step the proposer sees
//! `prompt + output[..i]`, its draft is accepted up to the first token that differs from
//! `output[i..]`, and the step emits the accepted drafts plus one token. The counts (acceptance
//! rate, mean accepted length, per-position acceptance) are exactly those a real greedy run
//! would record; only the time is modelled, by a forward cost curve `c(n)` = cost of a target
//! forward over `n` new tokens relative to one token (a [`CostTable`]'s batch-1 row):
//!
//! `predicted decode speed-up = output tokens / sum over steps of c(k_step + 1)`
//!
//! where `k_step` is the number of drafts the proposer actually returned (0: a plain step). The
//! proposer's own time and the prefill are not included (both are in the measured end-to-end
//! figures of `spec-bench run`).
//!
//! **Copy oracle.** [`oracle`] replays the same trace with the best draft a proposer that
//! *copies from the request's own context* could make at each step: among all earlier positions
//! `j` of the context whose preceding `n` tokens equal the context's last `n` tokens (for some
//! `n` in `min_n ..= max_n`; `min_n = 0` admits every position), it takes the continuation that
//! matches the most tokens of the true output, and drafts just those tokens. Prompt lookup
//! (Saxena 2023), the request trie of SuffixDecoding (Oliaro et al. 2024; not its cross-request
//! corpus) and any tree of such candidates draw their drafts from this candidate set, so at
//! each step none of them can accept more. Over a whole generation it also needs the fewest
//! verify steps for `min_n <= 1`: if position `j` continues the output `a` tokens from output
//! position `i`, then `j + 1` (preceded by `ctx[j]`, the token just emitted) continues it to the
//! same end from `i + 1`, so the furthest reachable end never decreases and taking the longest
//! copy at every step is optimal. Its mean accepted length is therefore the ceiling of
//! model-free copying on a workload: when it is below what a goal needs, only a different
//! proposer kind (a draft model, heads), a cross-request corpus or a different model can reach
//! the goal. Cost: `O(steps * max_n * context)` per trace.

use serde::{Deserialize, Serialize};
use speculative::SamplingConfig;
use speculative::decode::Metrics;
use speculative::propose::{Draft, ProposeRequest, Proposer};

use crate::error::{BenchError, Result};
use crate::sim::CostTable;

/// One greedy generation: the prompt and the tokens the target emitted after it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// Workload kind, for aggregates.
    pub kind: String,
    /// Index of the request in the workload.
    pub request: usize,
    /// Prompt tokens (chat template applied), as fed to the target.
    pub prompt: Vec<u32>,
    /// Greedy output tokens (EOS included when the generation stopped on it).
    pub output: Vec<u32>,
}

/// Counts of one replay (exact for greedy decoding: the loop's own [`Metrics`], without
/// timings) and its modelled cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayStats {
    /// Steps, drafts, acceptances and emitted tokens, counted by [`Metrics::record_step`] as the
    /// decoding loop counts them.
    pub metrics: Metrics,
    /// Sum over steps of `c(k_step + 1)`, in units of one single-token forward.
    pub cost: f64,
}

impl ReplayStats {
    /// Predicted decode speed-up over plain decoding: `emitted tokens / cost` (plain decoding
    /// costs one unit per token).
    pub fn predicted_speedup(&self) -> f64 {
        if self.cost > 0.0 {
            self.metrics.emitted as f64 / self.cost
        } else {
            0.0
        }
    }

    fn record(&mut self, drafted: usize, accepted: usize, emitted: usize, cost: f64) {
        self.metrics
            .record_step(drafted, accepted, accepted, emitted);
        self.cost += cost;
    }
}

/// A forward cost curve relative to a single-token forward: `c(n) = cost(1, n) / cost(1, 1)`
/// from a [`CostTable`]'s batch-1 row (interpolated between its points), made non-decreasing
/// in `n` (`c(n) = max over m <= n`): a forward over more tokens does the work of a shorter one
/// and more, so a measured dip below an earlier point is timing noise, and taking it at face
/// value would credit speculation with a verify call cheaper than a plain step.
#[derive(Debug, Clone)]
pub struct CostCurve {
    table: CostTable,
}

impl CostCurve {
    /// Wraps a validated table.
    ///
    /// # Errors
    /// [`BenchError::Invalid`] when the table fails [`CostTable::validate`] or has no batch-1
    /// row (`batch[0] != 1`).
    pub fn new(table: CostTable) -> Result<Self> {
        table.validate()?;
        if table.batch[0] != 1 {
            return Err(BenchError::Invalid {
                what: "cost table",
                reason: format!(
                    "replay needs a batch-1 row; the first batch size is {}",
                    table.batch[0]
                ),
            });
        }
        Ok(CostCurve { table })
    }

    /// `c(n)` for a forward over `n >= 1` new tokens, relative to `n = 1` (non-decreasing,
    /// `c(1) = 1`).
    pub fn relative(&self, n: usize) -> f64 {
        let one = self.table.cost(1, 1);
        let mut c: f64 = 1.0;
        // Running maximum over the table points below n, then n itself.
        for &t in self.table.tokens.iter().take_while(|&&t| t < n) {
            c = c.max(self.table.cost(1, t) / one);
        }
        c.max(self.table.cost(1, n.max(1)) / one)
    }
}

fn matched(draft: &[u32], truth: &[u32]) -> usize {
    draft.iter().zip(truth).take_while(|(d, t)| d == t).count()
}

/// Replays `trace` through `proposer` with draft length `k` (capped, as the loop does, so that
/// a step never drafts past the last output token).
///
/// # Errors
/// [`BenchError::Decode`] when the proposer fails.
pub fn replay(
    proposer: &mut dyn Proposer,
    trace: &Trace,
    k: usize,
    cost: &CostCurve,
) -> Result<ReplayStats> {
    let cfg = SamplingConfig::greedy();
    proposer.begin(&trace.prompt)?;
    let mut ctx = trace.prompt.clone();
    let mut stats = ReplayStats::default();
    let mut draft = Draft::default();
    let mut i = 0;
    while i < trace.output.len() {
        let remaining = trace.output.len() - i;
        let req = ProposeRequest {
            context: &ctx,
            config: &cfg,
            max_draft: k.min(remaining - 1),
            max_nodes: k.min(remaining - 1),
            seed: 0,
            target_hidden: None,
            prompt_len: 0,
            eos: &[],
            suppress_eos_rows: 0,
        };
        proposer.propose(&req, &mut draft)?;
        let n = draft.tokens.len().min(req.max_draft);
        let a = matched(&draft.tokens[..n], &trace.output[i..]);
        let emitted = (a + 1).min(remaining);
        stats.record(n, a, emitted, cost.relative(n + 1));
        ctx.extend_from_slice(&trace.output[i..i + emitted]);
        i += emitted;
    }
    proposer.finish(&ctx);
    Ok(stats)
}

/// The copy-oracle bound of a trace (see the module docs): at each step the oracle drafts the
/// longest prefix (at most `k` tokens) of the true output that continues some earlier context
/// position preceded by the context's last `n` tokens, for some `n` in `min_n ..= max_n`
/// (`min_n = 0`: every position). It drafts only tokens that will be accepted, so its
/// acceptance rate is 1 by construction and a step that copies `a` tokens costs `c(a + 1)`
/// (`c(1)`, a plain step, when nothing matches). Its mean accepted length bounds that of every
/// proposer drawing from the same candidates (see the module docs); its predicted speed-up is
/// the speed-up at those minimal draft lengths.
///
/// # Errors
/// [`BenchError::Invalid`] when `max_n < min_n`.
pub fn oracle(
    trace: &Trace,
    k: usize,
    min_n: usize,
    max_n: usize,
    cost: &CostCurve,
) -> Result<ReplayStats> {
    if max_n < min_n {
        return Err(BenchError::Invalid {
            what: "oracle",
            reason: format!("max_n {max_n} < min_n {min_n}"),
        });
    }
    let mut ctx = trace.prompt.clone();
    let mut stats = ReplayStats::default();
    let mut i = 0;
    while i < trace.output.len() {
        let remaining = trace.output.len() - i;
        let kk = k.min(remaining - 1);
        let truth = &trace.output[i..];
        let a = best_copy(&ctx, truth, kk, min_n, max_n).map_or(0, |b| b.0);
        let emitted = (a + 1).min(remaining);
        stats.record(a, a, emitted, cost.relative(a + 1));
        ctx.extend_from_slice(&truth[..emitted]);
        i += emitted;
    }
    Ok(stats)
}

/// One step of the copy oracle: `(accepted, drafted)` of the best candidate draft of at most
/// `k` tokens for the true continuation `truth` after `ctx`, or `None` when no position
/// qualifies (see [`oracle`]). `O(ctx.len() * max_n)`.
pub fn best_copy(
    ctx: &[u32],
    truth: &[u32],
    k: usize,
    min_n: usize,
    max_n: usize,
) -> Option<(usize, usize)> {
    let len = ctx.len();
    let mut best: Option<(usize, usize)> = None;
    // A draft starts inside the context, at `j`, preceded by >= min_n tokens equal to the
    // context's last ones.
    for j in 0..len {
        let preceding = ctx[..j]
            .iter()
            .rev()
            .zip(ctx.iter().rev())
            .take(max_n)
            .take_while(|(a, b)| a == b)
            .count();
        if preceding < min_n {
            continue;
        }
        let cont = &ctx[j..(j + k).min(len)];
        let a = matched(cont, truth);
        if best.is_none_or(|(ba, _)| a > ba) {
            best = Some((a, cont.len()));
        }
    }
    best
}

/// Sums replay statistics (for an aggregate over the traces of one kind).
pub fn sum(stats: &[ReplayStats]) -> ReplayStats {
    let mut out = ReplayStats::default();
    for s in stats {
        out.metrics.merge(&s.metrics);
        out.cost += s.cost;
    }
    out
}

/// One row of a replay report: a proposer (or an oracle) at one draft length on one kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayRow {
    /// Workload kind.
    pub kind: String,
    /// Proposer name, or `oracle n>=N` / `oracle any position`.
    pub proposer: String,
    /// Draft length k.
    pub k: usize,
    /// Traces replayed.
    pub traces: usize,
    /// Output tokens replayed (all traces).
    pub tokens: usize,
    /// Verify steps (all traces).
    pub steps: usize,
    /// Drafts proposed (all traces).
    pub proposed: usize,
    /// Drafts accepted (all traces).
    pub accepted: usize,
    /// Accepted / proposed drafts.
    pub acceptance_rate: f64,
    /// Emitted tokens per verify step, bonus included.
    pub mean_accepted_length: f64,
    /// Per draft position `i`: acceptance given positions `0..i` were accepted.
    pub position_acceptance: Vec<f64>,
    /// Mean over traces of the predicted decode speed-up.
    pub predicted_speedup_mean: f64,
    /// Mean measured end-to-end speed-up of the same proposer and fixed k in the runs the
    /// traces came from (prefill included), when such runs exist.
    pub measured_speedup_mean: Option<f64>,
}

impl ReplayRow {
    /// Aggregates per-trace statistics into a row.
    pub fn new(kind: &str, proposer: &str, k: usize, per_trace: &[ReplayStats]) -> Self {
        let n = per_trace.len().max(1) as f64;
        let m = sum(per_trace).metrics;
        ReplayRow {
            kind: kind.to_string(),
            proposer: proposer.to_string(),
            k,
            traces: per_trace.len(),
            tokens: m.emitted,
            steps: m.target_calls,
            proposed: m.proposed,
            accepted: m.accepted,
            acceptance_rate: m.acceptance_rate(),
            mean_accepted_length: m.mean_accepted_length(),
            position_acceptance: m.position_acceptance(),
            predicted_speedup_mean: per_trace
                .iter()
                .map(ReplayStats::predicted_speedup)
                .sum::<f64>()
                / n,
            measured_speedup_mean: None,
        }
    }
}

/// Notes printed under a replay table, explaining its columns.
pub const MARKDOWN_NOTES: &str = "Acceptance rate and mean accepted length (emitted tokens per \
verify step, bonus included) are pooled over the kind's requests and exact for greedy decoding. \
Predicted decode speed-up = output tokens / sum over steps of c(drafts + 1), the mean of the \
per-request ratios; it excludes the prefill and the proposer's time. Measured e2e speed-up is the \
mean over the same requests of the runs' measured tokens-per-second ratios (prefill and proposer \
included), for the same proposer and fixed k. Oracle rows draft only tokens that are accepted \
(acceptance 1 by construction); their mean accepted length bounds every proposer that copies from \
the request's own context (`oracle n>=1`: positions after a matching token, which includes \
prompt lookup and suffix trees; `oracle any position`: every position).";

/// A markdown table of replay rows.
pub fn markdown(rows: &[ReplayRow]) -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "| kind | proposer | k | acceptance rate | mean accepted length | predicted decode speed-up | measured e2e speed-up |\n|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let measured = r
            .measured_speedup_mean
            .map_or("-".to_string(), |m| format!("{m:.2}x"));
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.3} | {:.2} | {:.2}x | {} |",
            r.kind,
            r.proposer,
            r.k,
            r.acceptance_rate,
            r.mean_accepted_length,
            r.predicted_speedup_mean,
            measured
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use speculative::decode::{DraftLength, GenerationParams, Generator};
    use speculative::propose::PromptLookup;
    use speculative::test_util::{ScriptedProposer, ToyModel};

    fn flat_cost() -> CostCurve {
        CostCurve::new(CostTable {
            source: String::new(),
            batch: vec![1],
            tokens: vec![1, 5],
            cost: vec![vec![1.0, 1.4]],
        })
        .unwrap()
    }

    #[test]
    fn replay_counts_match_a_real_greedy_run() {
        // A toy model that copies with period 5 most of the time: prompt lookup gets long runs.
        let mut model = ToyModel::deterministic(16, 4096, |p: &[u32]| {
            let n = p.len();
            if n < 5 || n.is_multiple_of(11) {
                (p.last().copied().unwrap_or(0) + 3) % 16
            } else {
                p[n - 5]
            }
        });
        let prompt: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7];
        let params = GenerationParams {
            draft: DraftLength::Fixed(4),
            ..GenerationParams::greedy(60)
        };
        let real = {
            let mut g = Generator::new(&mut model, PromptLookup::new(1, 3).unwrap());
            g.generate(&prompt, &params).unwrap()
        };
        let trace = Trace {
            kind: "toy".into(),
            request: 0,
            prompt,
            output: real.tokens.clone(),
        };
        let s = replay(
            &mut PromptLookup::new(1, 3).unwrap(),
            &trace,
            4,
            &flat_cost(),
        )
        .unwrap();
        let m = &real.metrics;
        let r = &s.metrics;
        assert_eq!(r.emitted, real.tokens.len());
        assert_eq!(
            (
                r.target_calls,
                r.proposed,
                r.accepted,
                r.emitted,
                r.no_draft_steps
            ),
            (
                m.target_calls,
                m.proposed,
                m.accepted,
                m.emitted,
                m.no_draft_steps
            )
        );
        assert_eq!(
            (&r.reached_at, &r.accepted_at),
            (&m.reached_at, &m.accepted_at)
        );
        assert!(r.accepted > 10, "the toy must exercise acceptance");
    }

    #[test]
    fn scripted_drafts_are_scored_exactly() {
        let trace = Trace {
            kind: "t".into(),
            request: 0,
            prompt: vec![9],
            output: vec![1, 2, 3, 4, 5],
        };
        // Step 1 drafts [1, 2, 7]: 2 accepted, emits 3 tokens. Step 2 drafts [4]: 1 accepted
        // and the last token is the bonus.
        let mut p = ScriptedProposer::new(vec![vec![1, 2, 7], vec![4]]);
        let s = replay(&mut p, &trace, 3, &flat_cost()).unwrap();
        let m = &s.metrics;
        assert_eq!(
            (m.target_calls, m.proposed, m.accepted, m.emitted),
            (2, 4, 3, 5)
        );
        assert_eq!(
            (&m.reached_at[..], &m.accepted_at[..]),
            (&[2, 1, 1][..], &[2, 1, 0][..])
        );
        let c = flat_cost();
        assert!((s.cost - (c.relative(4) + c.relative(2))).abs() < 1e-12);
        assert!((s.predicted_speedup() - 5.0 / s.cost).abs() < 1e-12);
    }

    #[test]
    fn oracle_bounds_prompt_lookup_step_by_step() {
        // Pseudo-random traces over a small vocabulary, so that copies and near-copies occur.
        let mut state = 12345u64;
        let mut next = move |m: u32| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % m as u64) as u32
        };
        for case in 0..30 {
            let prompt: Vec<u32> = (0..40).map(|_| next(6)).collect();
            let mut output = Vec::new();
            for _ in 0..40 {
                // Mostly copy a random stretch of the prompt, sometimes a fresh token.
                if next(4) == 0 {
                    output.push(next(6));
                } else {
                    let s = next(30) as usize;
                    output.extend_from_slice(&prompt[s..s + 1 + next(5) as usize]);
                }
            }
            let trace = Trace {
                kind: "t".into(),
                request: case,
                prompt,
                output,
            };
            // Per step, from the same context, the oracle accepts at least what prompt lookup
            // (whose candidates are a subset) accepts.
            let mut pl = PromptLookup::new(1, 4).unwrap();
            let cfg = SamplingConfig::greedy();
            let mut ctx = trace.prompt.clone();
            pl.begin(&ctx).unwrap();
            let mut d = Draft::default();
            for i in 0..trace.output.len() - 1 {
                let req = ProposeRequest {
                    context: &ctx,
                    config: &cfg,
                    max_draft: 4,
                    max_nodes: 4,
                    seed: 0,
                    target_hidden: None,
                    prompt_len: 0,
                    eos: &[],
                    suppress_eos_rows: 0,
                };
                pl.propose(&req, &mut d).unwrap();
                let a_pl = matched(&d.tokens, &trace.output[i..]);
                let a_or = best_copy(&ctx, &trace.output[i..], 4, 1, 4).map_or(0, |b| b.0);
                assert!(
                    a_or >= a_pl,
                    "case {case} step {i}: oracle {a_or} < prompt lookup {a_pl}"
                );
                ctx.push(trace.output[i]);
            }
        }
    }

    #[test]
    fn oracle_with_every_position_is_at_least_the_matched_oracle() {
        let trace = Trace {
            kind: "t".into(),
            request: 0,
            prompt: vec![1, 2, 3, 4, 5, 6, 7, 8],
            output: vec![9, 4, 5, 6, 7, 8, 1, 2, 3],
        };
        let c = flat_cost();
        let any = oracle(&trace, 4, 0, 4, &c).unwrap();
        let matched1 = oracle(&trace, 4, 1, 4, &c).unwrap();
        let (any, matched1) = (&any.metrics, &matched1.metrics);
        assert!(any.emitted == matched1.emitted && any.target_calls <= matched1.target_calls);
        // `4` never follows `9`, so a matching oracle must wait; the any-position oracle copies
        // `4 5 6 7 8` at once after the first step.
        assert!(any.target_calls < matched1.target_calls);
        assert!(oracle(&trace, 4, 3, 2, &c).is_err());
        assert_eq!(
            any.accepted, any.proposed,
            "the oracle drafts only accepted tokens"
        );
    }

    #[test]
    fn cost_curve_is_non_decreasing_and_needs_batch_one() {
        let noisy = CostTable {
            source: String::new(),
            batch: vec![1, 2],
            tokens: vec![1, 2, 5, 9],
            cost: vec![vec![5.0, 4.5, 5.5, 7.5], vec![6.0, 7.0, 9.0, 12.0]],
        };
        let c = CostCurve::new(noisy.clone()).unwrap();
        assert_eq!(c.relative(1), 1.0);
        assert_eq!(c.relative(2), 1.0, "a dip below c(1) is noise");
        assert!((c.relative(5) - 1.1).abs() < 1e-12);
        let mut prev = 0.0;
        for n in 1..20 {
            assert!(c.relative(n) >= prev);
            prev = c.relative(n);
        }
        let no_one = CostTable {
            batch: vec![2],
            cost: vec![noisy.cost[1].clone()],
            ..noisy
        };
        assert!(CostCurve::new(no_one).is_err());
    }
}
