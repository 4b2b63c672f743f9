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
//! **Trees.** [`replay_tree`] asks the proposer for a token tree
//! ([`Proposer::propose_tree`]) of at most `nodes` nodes and depth at most `k`. Under greedy
//! verification a step accepts the longest root-to-node path of the tree whose tokens equal the
//! recorded continuation (at each node, descend into the child equal to the target's argmax,
//! which is the next recorded token), then emits one more token, so the counts are again exact;
//! a step with `n` nodes is charged `c(n + 1)`, the cost of a chain forward over the same
//! number of rows (a tree forward reads the same rows; its attention mask is not modelled).
//! The chain of the same node budget `n` has depth `min(n, k)` ([`replay`] with that `k`).
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
use speculative::tree::{DraftBlock, TreeLimits};

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
    /// Tree replays: per depth `d` (0 = the root's children) and sibling rank `r` (the node's
    /// index among its parent's children, in draft order), `(tested, accepted)`: a node is
    /// tested when its parent was reached, accepted when it is on the accepted path. Empty for
    /// chains.
    pub by_rank: Vec<Vec<(usize, usize)>>,
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

    /// Counts the tested and accepted nodes of `block` by depth and sibling rank against the
    /// true continuation (see [`ReplayStats::by_rank`]).
    fn record_ranks(&mut self, block: &DraftBlock<'_>, truth: &[u32]) {
        let tokens = block.tokens();
        let mut row = 0usize;
        for (d, &t) in truth.iter().enumerate() {
            let mut next = None;
            for (r, j) in block.children(row).enumerate() {
                if self.by_rank.len() <= d {
                    self.by_rank.resize(d + 1, Vec::new());
                }
                let at = &mut self.by_rank[d];
                if at.len() <= r {
                    at.resize(r + 1, (0, 0));
                }
                at[r].0 += 1;
                if tokens[j] == t {
                    at[r].1 += 1;
                    next = Some(j);
                }
            }
            match next {
                Some(j) => row = j + 1,
                None => break,
            }
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

/// Greedy acceptance of a draft block against the true continuation `truth`: the length `a`
/// of the longest root-to-node path whose tokens equal `truth[..a]` (descending, at each row,
/// into the child equal to the next true token; siblings are distinct, so the path is unique),
/// and whether the last node of that path has children (a deeper node was tried and
/// rejected). For a chain, `a` is the matched prefix. `O(n * a)` for `n` nodes.
pub fn accepted_path(block: &DraftBlock<'_>, truth: &[u32]) -> (usize, bool) {
    let tokens = block.tokens();
    let (mut row, mut a) = (0usize, 0usize);
    loop {
        let mut children = block.children(row).peekable();
        let has_children = children.peek().is_some();
        let next = truth
            .get(a)
            .and_then(|&t| children.find(|&j| tokens[j] == t));
        match next {
            Some(j) => {
                a += 1;
                row = j + 1;
            }
            None => return (a, has_children),
        }
    }
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
        let req = ProposeRequest::new(&ctx, &cfg, k.min(remaining - 1));
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

/// Replays `trace` through `proposer`'s tree drafts ([`Proposer::propose_tree`]) with at most
/// `nodes` nodes and depth at most `k` (capped, as in [`replay`], so that a step never drafts
/// past the last output token); see "Trees" in the module docs. The metrics count nodes as
/// proposed drafts (acceptance rate = accepted path nodes / nodes) and depths as positions
/// (per-position acceptance = acceptance at depth `i` given that the path reached depth `i - 1`
/// and the tree had a node below it).
///
/// # Errors
/// [`BenchError::Decode`] when the proposer fails; [`BenchError::Invalid`] when its tree fails
/// [`DraftBlock::validate`] against the node budget and depth (the proposer's bug).
pub fn replay_tree(
    proposer: &mut dyn Proposer,
    trace: &Trace,
    k: usize,
    nodes: usize,
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
        let req = ProposeRequest::new(&ctx, &cfg, k.min(remaining - 1)).max_nodes(nodes);
        proposer.propose_tree(&req, &mut draft)?;
        let block = draft.block();
        let limits = TreeLimits::vocab(usize::MAX)
            .with_max_nodes(req.max_nodes)
            .with_max_depth(req.max_draft);
        block.validate(&limits).map_err(|e| BenchError::Invalid {
            what: "tree draft",
            reason: format!("{} at output position {i}: {e}", proposer.name()),
        })?;
        let n = block.len();
        let (a, deeper) = accepted_path(&block, &trace.output[i..]);
        stats.record_ranks(&block, &trace.output[i..]);
        let emitted = (a + 1).min(remaining);
        // Positions are depths: `a` accepted, and depth `a + 1` tried when the path's last node
        // has children; every other node counts as proposed only.
        let tried = a + usize::from(deeper);
        stats.record(tried, a, emitted, cost.relative(n + 1));
        // (A non-empty tree has a child of the root, so `tried >= 1`: not a no-draft step.)
        stats.metrics.proposed += n - tried;
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
        if out.by_rank.len() < s.by_rank.len() {
            out.by_rank.resize(s.by_rank.len(), Vec::new());
        }
        for (d, ranks) in s.by_rank.iter().enumerate() {
            let at = &mut out.by_rank[d];
            if at.len() < ranks.len() {
                at.resize(ranks.len(), (0, 0));
            }
            for (r, &(t, a)) in ranks.iter().enumerate() {
                at[r].0 += t;
                at[r].1 += a;
            }
        }
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
    /// Draft length k (for a tree row: the depth bound).
    pub k: usize,
    /// Node budget of the tree-replay rows (trees and the chains they are compared with),
    /// `None` for the rows of the chain table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<usize>,
    /// `true` for a tree draft ([`replay_tree`]), `false` for a chain.
    #[serde(default)]
    pub tree: bool,
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
    /// Tree rows: acceptance by depth and sibling rank, `[depth][rank]` = accepted / tested
    /// (see [`ReplayStats::by_rank`]); empty for chains.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_acceptance: Vec<Vec<f64>>,
}

impl ReplayRow {
    /// Aggregates per-trace statistics into a row.
    pub fn new(kind: &str, proposer: &str, k: usize, per_trace: &[ReplayStats]) -> Self {
        let n = per_trace.len().max(1) as f64;
        let total = sum(per_trace);
        let rank_acceptance = total
            .by_rank
            .iter()
            .map(|ranks| {
                ranks
                    .iter()
                    .map(|&(t, a)| if t == 0 { 0.0 } else { a as f64 / t as f64 })
                    .collect()
            })
            .collect();
        let m = total.metrics;
        ReplayRow {
            kind: kind.to_string(),
            proposer: proposer.to_string(),
            k,
            nodes: None,
            tree: false,
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
            rank_acceptance,
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

/// Notes printed under the tree table ([`tree_markdown`]).
pub const TREE_MARKDOWN_NOTES: &str = "Trees: the proposer's tree draft (`Proposer::propose_tree`) \
with at most `node budget` nodes and depth at most k; greedy acceptance is the longest path of the \
tree that matches the recorded output (exact). The chain of the same node budget has depth \
min(budget, k). Nodes per step: mean nodes proposed per verify step (the tree may be smaller than \
its budget). Predicted speed-ups charge c(nodes + 1) per step, the chain cost curve of the same \
number of rows (beyond its last measured point it is extrapolated linearly); they exclude the \
tree forward's mask, the prefill and the proposer's time.";

/// A markdown table comparing each tree row with the chain row of the same kind, proposer and
/// node budget (rows with `nodes` set; trees without their chain are left out).
pub fn tree_markdown(rows: &[ReplayRow]) -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "| kind | proposer | k | node budget | chain depth | chain mean accepted length | tree mean accepted length | tree / chain | tree nodes per step | chain predicted speed-up | tree predicted speed-up | tree acceptance by depth: rank 0/1/2 |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for t in rows.iter().filter(|r| r.tree) {
        let Some(c) = rows.iter().find(|c| {
            !c.tree
                && c.nodes == t.nodes
                && c.kind == t.kind
                && c.proposer == t.proposer
                && c.k == t.nodes.unwrap_or(0).min(t.k)
        }) else {
            continue;
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.3} | {:.1} | {:.2}x | {:.2}x | {} |",
            t.kind,
            t.proposer,
            t.k,
            t.nodes.unwrap_or(0),
            c.k,
            c.mean_accepted_length,
            t.mean_accepted_length,
            t.mean_accepted_length / c.mean_accepted_length.max(f64::MIN_POSITIVE),
            t.proposed as f64 / t.steps.max(1) as f64,
            c.predicted_speedup_mean,
            t.predicted_speedup_mean,
            rank_cell(&t.rank_acceptance),
        );
    }
    s
}

/// Acceptance by depth and rank as a table cell: `d1 .62/.10/.03; d2 ...` (the first four
/// depths, the first three ranks).
fn rank_cell(by: &[Vec<f64>]) -> String {
    by.iter()
        .take(4)
        .enumerate()
        .map(|(d, ranks)| {
            let r: Vec<String> = ranks.iter().take(3).map(|a| format!("{a:.2}")).collect();
            format!("d{} {}", d + 1, r.join("/"))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// A markdown table of the chain replay rows (rows without a node budget).
pub fn markdown(rows: &[ReplayRow]) -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "| kind | proposer | k | acceptance rate | mean accepted length | predicted decode speed-up | measured e2e speed-up |\n|---|---|---|---|---|---|---|\n",
    );
    for r in rows.iter().filter(|r| r.nodes.is_none()) {
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
        let params = GenerationParams::greedy(60).with_draft(DraftLength::Fixed(4));
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
                let req = ProposeRequest::new(&ctx, &cfg, 4);
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

    /// Returns the scripted trees in order (tokens, parents), then empty drafts.
    struct ScriptedTrees(Vec<(Vec<u32>, Vec<u32>)>);

    impl Proposer for ScriptedTrees {
        fn propose(
            &mut self,
            _req: &ProposeRequest<'_>,
            draft: &mut Draft,
        ) -> speculative::Result<()> {
            draft.clear();
            Ok(())
        }
        fn propose_tree(
            &mut self,
            _req: &ProposeRequest<'_>,
            draft: &mut Draft,
        ) -> speculative::Result<()> {
            draft.clear();
            if !self.0.is_empty() {
                let (t, p) = self.0.remove(0);
                draft.tokens = t;
                draft.parents = p;
            }
            Ok(())
        }
    }

    #[test]
    fn accepted_path_descends_into_the_matching_child() {
        // Root -> 5 -> 6 -> 7, root -> 5 -> 8, root -> 9.
        let tokens = [5, 6, 9, 8, 7];
        let parents = [0, 1, 0, 1, 2];
        let b = DraftBlock::tree(&tokens, &parents);
        assert_eq!(accepted_path(&b, &[5, 8, 1]), (2, false));
        assert_eq!(accepted_path(&b, &[5, 6, 7, 1]), (3, false));
        assert_eq!(accepted_path(&b, &[5, 6, 1]), (2, true));
        assert_eq!(accepted_path(&b, &[9, 1]), (1, false));
        assert_eq!(accepted_path(&b, &[1]), (0, true));
        assert_eq!(accepted_path(&b, &[5]), (1, true), "truth ends");
        assert_eq!(
            accepted_path(&DraftBlock::chain(&[1, 2, 3]), &[1, 2, 4]),
            (2, true)
        );
        assert_eq!(accepted_path(&DraftBlock::chain(&[]), &[1]), (0, false));
    }

    #[test]
    fn scripted_trees_are_scored_exactly() {
        let trace = Trace {
            kind: "t".into(),
            request: 0,
            prompt: vec![9],
            output: vec![1, 2, 3, 4, 5, 6],
        };
        // Step 1: tree 7 | 1 -> {4, 2 -> 3}: path 1 2 3 accepted (3 of 5 nodes), emits 4
        // tokens. Step 2: tree {6, 5}: 5 accepted, then the bonus: 2 tokens, done.
        let mut p = ScriptedTrees(vec![
            (vec![7, 1, 4, 2, 3], vec![0, 0, 2, 2, 4]),
            (vec![6, 5], vec![0, 0]),
        ]);
        let c = flat_cost();
        let s = replay_tree(&mut p, &trace, 3, 5, &c).unwrap();
        let m = &s.metrics;
        assert_eq!(
            (
                m.target_calls,
                m.proposed,
                m.accepted,
                m.emitted,
                m.no_draft_steps
            ),
            (2, 7, 4, 6, 0)
        );
        // Depth 1 tried twice (accepted twice), depth 2 once, depth 3 once; the leaf at
        // depth 3 and the leaf 5 end their paths (nothing deeper tried).
        assert_eq!(
            (&m.reached_at[..], &m.accepted_at[..]),
            (&[2, 1, 1][..], &[2, 1, 1][..])
        );
        assert!((s.cost - (c.relative(6) + c.relative(3))).abs() < 1e-12);
        // By depth and rank: the accepted node was the second child at depths 1 and 2 of
        // step 1 and at depth 1 of step 2.
        assert_eq!(
            s.by_rank,
            vec![vec![(2, 0), (2, 2)], vec![(1, 0), (1, 1)], vec![(1, 1)],]
        );
        let row = ReplayRow::new("t", "scripted", 3, &[s.clone(), s]);
        assert_eq!(row.rank_acceptance[0], vec![0.0, 1.0]);
        assert_eq!(
            rank_cell(&row.rank_acceptance),
            "d1 0.00/1.00; d2 0.00/1.00; d3 1.00"
        );
        // A tree over the budget is the proposer's bug, reported as such.
        let mut big = ScriptedTrees(vec![(vec![1, 2, 3], vec![0, 0, 0])]);
        assert!(replay_tree(&mut big, &trace, 3, 2, &c).is_err());
        let mut dup = ScriptedTrees(vec![(vec![1, 1], vec![0, 0])]);
        assert!(replay_tree(&mut dup, &trace, 3, 4, &c).is_err());
    }

    #[test]
    fn tree_replay_of_one_node_equals_the_chain_of_one() {
        let trace = Trace {
            kind: "t".into(),
            request: 0,
            prompt: vec![1, 2, 3, 4, 1, 2, 5, 1],
            output: vec![2, 3, 4, 1, 2, 5, 1, 2, 3, 9, 1, 2],
        };
        let c = flat_cost();
        for k in [1, 3, 6] {
            let chain = replay(&mut PromptLookup::new(1, 3).unwrap(), &trace, 1, &c).unwrap();
            let tree =
                replay_tree(&mut PromptLookup::new(1, 3).unwrap(), &trace, k, 1, &c).unwrap();
            assert_eq!(
                (&tree.metrics, tree.cost),
                (&chain.metrics, chain.cost),
                "k {k}"
            );
            // Every depth-1 node tested was the only child (rank 0).
            assert_eq!(tree.by_rank.len(), 1);
            assert_eq!(tree.by_rank[0].len(), 1);
        }
        // With a budget above k the tree holds the chain and more: after the trailing 1, the
        // chain drafts "2 5 1" (newest match) and accepts 1 token; the tree also holds "2 3 4"
        // (older match) and accepts 3, finishing in one step instead of two.
        let trace = Trace {
            output: vec![2, 3, 4, 9],
            ..trace
        };
        let chain = replay(&mut PromptLookup::new(1, 3).unwrap(), &trace, 3, &c).unwrap();
        let tree = replay_tree(&mut PromptLookup::new(1, 3).unwrap(), &trace, 3, 8, &c).unwrap();
        assert_eq!(
            (chain.metrics.target_calls, tree.metrics.target_calls),
            (2, 1)
        );
    }

    #[test]
    fn tree_rows_pair_with_chains_of_the_same_budget() {
        let stats = |calls: usize, emitted: usize| ReplayStats {
            metrics: {
                let mut m = Metrics::default();
                m.target_calls = calls;
                m.emitted = emitted;
                m.proposed = 10;
                m
            },
            cost: calls as f64,
            by_rank: Vec::new(),
        };
        let mut chain = ReplayRow::new("chat", "suffix", 8, &[stats(10, 15)]);
        chain.nodes = Some(16);
        let mut tree = ReplayRow::new("chat", "suffix", 8, &[stats(10, 18)]);
        tree.nodes = Some(16);
        tree.tree = true;
        let plain = ReplayRow::new("chat", "suffix", 4, &[stats(10, 14)]);
        let md = tree_markdown(&[plain.clone(), chain, tree]);
        assert!(
            md.contains("| chat | suffix | 8 | 16 | 8 | 1.50 | 1.80 | 1.200 | 1.0 |"),
            "{md}"
        );
        assert_eq!(md.lines().count(), 3);
        // The chain table leaves the tree replay's rows out.
        assert_eq!(markdown(&[plain]).lines().count(), 3);
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
