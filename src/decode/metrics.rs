//! Per-generation metrics with the field's common definitions: acceptance rate = accepted /
//! proposed drafts; mean accepted length = emitted tokens / target verify calls (the bonus or
//! correction token included).

use std::time::Duration;

/// Counters and timings of one generation.
///
/// Tokens cut by a stop condition are not counted. Proposed drafts are all the drafts that were
/// verified (each verify step's draft length `k`).
///
/// Two counts of a step differ by one token, and this is the one place that says so:
/// [`StepOutput::accepted`](crate::StepOutput::accepted) (and [`Metrics::accepted`]) counts the
/// accepted **drafts** only, while the mean accepted length
/// ([`Metrics::mean_accepted_length`]) counts every **emitted** token per verify call, the
/// correction or bonus token included. A step that accepts 3 of 4 drafts has `accepted == 3`
/// and emits 4 tokens; plain decoding has mean accepted length 1.0 and acceptance rate 0.
///
/// The default is all zeros (counters, timings, empty per-position vectors, no time to first
/// token): the metrics of a generation that has not started.
///
/// `Metrics` is `Send + Sync` (plain counters and durations).
///
/// `#[non_exhaustive]`: returned by the loops, read its fields ([`Metrics::default`] and
/// [`Metrics::merge`] to add up several).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Metrics {
    /// Draft tokens proposed and verified.
    pub proposed: usize,
    /// Draft tokens accepted (and emitted); the correction or bonus token is not a draft and is
    /// not counted here (it is in `emitted`).
    pub accepted: usize,
    /// Tokens emitted (accepted drafts plus corrections / bonus tokens).
    pub emitted: usize,
    /// Verify forwards of the target (one per step; prefill not included).
    pub target_calls: usize,
    /// No-draft steps: steps whose draft was empty (`k = 0`, plain decoding; they end with
    /// [`StepEnd::NoDraft`](crate::StepEnd::NoDraft)).
    pub no_draft_steps: usize,
    /// `reached_at[i]`: steps in which draft position `i` (0-based) was tested, that is, steps
    /// with `k > i` whose positions `0..i` were all accepted.
    pub reached_at: Vec<usize>,
    /// `accepted_at[i]`: steps in which draft position `i` was accepted.
    pub accepted_at: Vec<usize>,
    /// Tree steps: verify steps whose draft was a branching token tree
    /// ([`GenerationParams::tree`](crate::decode::GenerationParams::tree)). Their
    /// nodes count in `proposed`; their positions in `reached_at` / `accepted_at` are depths
    /// (position `i` is depth `i + 1`: reached when the accepted path's node at depth `i` has
    /// children).
    pub tree_steps: usize,
    /// Nodes of all tree steps (divide by `tree_steps` for the mean tree size).
    pub tree_nodes: usize,
    /// Sum of the depths of all tree steps (the deepest node of each).
    pub tree_depth: usize,
    /// Steps that restored the target's snapshot and replayed the tokens to keep (targets in
    /// [`RollbackMode::Snapshot`](crate::RollbackMode::Snapshot): a step that rejected
    /// drafts).
    pub replays: usize,
    /// Tokens replayed by those steps (`accepted drafts + 1` each), in tokens.
    pub replayed_tokens: usize,
    /// Time spent restoring snapshots and replaying (not in `forward_time`).
    pub replay_time: Duration,
    /// Time spent saving the target's state before each verify forward (snapshot mode; not in
    /// `forward_time`).
    pub snapshot_time: Duration,
    /// Time spent in the prompt prefill forward (only the prompt tokens not reused from the
    /// cache are prefilled).
    pub prefill_time: Duration,
    /// Prompt tokens whose KV entries the target's cache already held from an earlier
    /// generation (prefix reuse, [`Generator::with_prefix_reuse`](crate::decode::Generator::with_prefix_reuse)
    /// and the batch loop's idle slots): the target did not process them again. At most the
    /// prompt length minus one.
    pub prompt_tokens_reused: usize,
    /// Prompt tokens the target processed: the prefill and the last prompt token (fed with the
    /// first step). `prompt_tokens_reused + prompt_tokens_prefilled` is the prompt length; the
    /// prefill part of the time to first token grows with this count, not with the prompt.
    pub prompt_tokens_prefilled: usize,
    /// Of the prompt tokens before the last that the target processed, those fed in the first
    /// step's verify forward ([`TargetModel::forward_tail`](crate::TargetModel::forward_tail))
    /// instead of a prefill forward of their own: the fused prefill of
    /// [`Generator::with_fused_prefill`](crate::decode::Generator::with_fused_prefill). With a
    /// fused prefill, `prefill_time` stays zero and the first step's `forward_time` includes
    /// these tokens; the step counts as one target call (`target_calls`). 0 otherwise.
    pub prompt_tokens_fused: usize,
    /// Time spent in [`crate::Proposer::propose`] and [`crate::Proposer::observe`].
    pub propose_time: Duration,
    /// Time spent in target verify forwards.
    pub forward_time: Duration,
    /// Time spent in verification (processing + acceptance), excluding the forward.
    pub verify_time: Duration,
    /// Wall time from the start of the generation to its end.
    pub total_time: Duration,
    /// Time from the start to the first emitted token.
    pub time_to_first_token: Option<Duration>,
}

impl Metrics {
    /// Acceptance rate = accepted drafts / proposed drafts (0 when nothing was proposed).
    pub fn acceptance_rate(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }

    /// Mean accepted length = emitted tokens / target verify calls (includes the correction or
    /// bonus token, unlike [`StepOutput::accepted`](crate::StepOutput::accepted); 1.0 for plain
    /// decoding, 0 before the first verify call).
    pub fn mean_accepted_length(&self) -> f64 {
        if self.target_calls == 0 {
            0.0
        } else {
            self.emitted as f64 / self.target_calls as f64
        }
    }

    /// Per-position acceptance: `accepted_at[i] / reached_at[i]`, the probability that draft
    /// position `i` is accepted given that positions `0..i` were.
    pub fn position_acceptance(&self) -> Vec<f64> {
        self.reached_at
            .iter()
            .zip(&self.accepted_at)
            .map(|(&p, &a)| if p == 0 { 0.0 } else { a as f64 / p as f64 })
            .collect()
    }

    /// Share of the prompt tokens reused from the cache: `prompt_tokens_reused / (reused +
    /// prefilled)` (0 for an empty count).
    pub fn prompt_reuse_share(&self) -> f64 {
        let total = self.prompt_tokens_reused + self.prompt_tokens_prefilled;
        if total == 0 {
            0.0
        } else {
            self.prompt_tokens_reused as f64 / total as f64
        }
    }

    /// Mean number of nodes of a tree step (0 without tree steps).
    pub fn mean_tree_nodes(&self) -> f64 {
        if self.tree_steps == 0 {
            0.0
        } else {
            self.tree_nodes as f64 / self.tree_steps as f64
        }
    }

    /// Mean depth of a tree step (0 without tree steps).
    pub fn mean_tree_depth(&self) -> f64 {
        if self.tree_steps == 0 {
            0.0
        } else {
            self.tree_depth as f64 / self.tree_steps as f64
        }
    }

    /// Output tokens per second over the whole generation (prefill included in the time).
    pub fn tokens_per_second(&self) -> f64 {
        let s = self.total_time.as_secs_f64();
        if s > 0.0 {
            self.emitted as f64 / s
        } else {
            0.0
        }
    }

    /// Decode-phase tokens per second (prefill excluded).
    pub fn decode_tokens_per_second(&self) -> f64 {
        let s = (self.total_time.saturating_sub(self.prefill_time)).as_secs_f64();
        if s > 0.0 {
            self.emitted as f64 / s
        } else {
            0.0
        }
    }

    /// Records one verify step's counts: `k` drafts proposed, `accepted` of them accepted by the
    /// verifier ([`StepOutput::accepted`](crate::StepOutput::accepted)), of which `kept`
    /// survived the stop conditions (`kept <= accepted <= k`), and `emitted` tokens kept
    /// (accepted drafts plus the correction or bonus token, unless a stop cut it). The loop calls it once per step; offline replays of recorded generations (as in
    /// `spec-bench replay`) call it to count exactly as the loop does. Timings are not touched.
    pub fn record_step(&mut self, k: usize, accepted: usize, kept: usize, emitted: usize) {
        self.target_calls += 1;
        self.proposed += k;
        self.accepted += kept;
        self.emitted += emitted;
        if k == 0 {
            self.no_draft_steps += 1;
        }
        if self.reached_at.len() < k {
            self.reached_at.resize(k, 0);
            self.accepted_at.resize(k, 0);
        }
        for i in 0..kept {
            self.reached_at[i] += 1;
            self.accepted_at[i] += 1;
        }
        // The rejection position counts only when no stop cut the block before it.
        if kept == accepted && accepted < k {
            self.reached_at[accepted] += 1;
        }
    }
}

impl Metrics {
    /// Records one tree step: `nodes` drafted in a tree of depth `depth`, `kept` nodes of the
    /// accepted path kept after the stop conditions, `emitted` tokens kept, and whether the walk
    /// stopped at a node with children (`tested_next`: the depth after the path was tested and
    /// nothing there was accepted). Acceptance by depth goes to `reached_at` / `accepted_at`.
    pub fn record_tree_step(
        &mut self,
        nodes: usize,
        depth: usize,
        kept: usize,
        emitted: usize,
        tested_next: bool,
    ) {
        self.target_calls += 1;
        self.proposed += nodes;
        self.accepted += kept;
        self.emitted += emitted;
        self.tree_steps += 1;
        self.tree_nodes += nodes;
        self.tree_depth += depth;
        let reach = depth.max(kept + tested_next as usize);
        if self.reached_at.len() < reach {
            self.reached_at.resize(reach, 0);
            self.accepted_at.resize(reach, 0);
        }
        for i in 0..kept {
            self.reached_at[i] += 1;
            self.accepted_at[i] += 1;
        }
        if tested_next {
            self.reached_at[kept] += 1;
        }
    }

    /// Adds `other`'s counters and timings to these (for totals over several generations).
    pub fn merge(&mut self, other: &Metrics) {
        self.proposed += other.proposed;
        self.accepted += other.accepted;
        self.emitted += other.emitted;
        self.target_calls += other.target_calls;
        self.no_draft_steps += other.no_draft_steps;
        self.tree_steps += other.tree_steps;
        self.tree_nodes += other.tree_nodes;
        self.tree_depth += other.tree_depth;
        let n = self.reached_at.len().max(other.reached_at.len());
        self.reached_at.resize(n, 0);
        self.accepted_at.resize(n, 0);
        for (i, (&r, &a)) in other.reached_at.iter().zip(&other.accepted_at).enumerate() {
            self.reached_at[i] += r;
            self.accepted_at[i] += a;
        }
        self.prefill_time += other.prefill_time;
        self.prompt_tokens_reused += other.prompt_tokens_reused;
        self.prompt_tokens_prefilled += other.prompt_tokens_prefilled;
        self.prompt_tokens_fused += other.prompt_tokens_fused;
        self.propose_time += other.propose_time;
        self.forward_time += other.forward_time;
        self.verify_time += other.verify_time;
        self.total_time += other.total_time;
        self.time_to_first_token = match (self.time_to_first_token, other.time_to_first_token) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn definitions() {
        let mut m = Metrics::default();
        m.record_step(3, 1, 1, 2);
        m.record_step(3, 3, 3, 4);
        m.record_step(0, 0, 0, 1);
        // A stop inside the accepted block: nothing after it is counted.
        let mut cut = Metrics::default();
        cut.record_step(4, 4, 2, 3);
        assert_eq!((cut.accepted, cut.emitted, cut.reached_at[2]), (2, 3, 0));
        assert_eq!(m.proposed, 6);
        assert_eq!(m.accepted, 4);
        assert!((m.acceptance_rate() - 4.0 / 6.0).abs() < 1e-12);
        assert!((m.mean_accepted_length() - 7.0 / 3.0).abs() < 1e-12);
        assert_eq!(m.position_acceptance(), vec![1.0, 0.5, 1.0]);
        assert_eq!(m.no_draft_steps, 1);
        let mut total = cut.clone();
        total.merge(&m);
        assert_eq!((total.proposed, total.accepted, total.emitted), (10, 6, 10));
        assert_eq!(total.target_calls, 4);
        assert_eq!(total.reached_at, vec![3, 3, 1, 0]);
        assert_eq!(total.accepted_at, vec![3, 2, 1, 0]);
    }

    #[test]
    fn tree_steps_count_by_depth() {
        let mut m = Metrics::default();
        // 6 nodes, depth 3: path of 2 accepted, the node at depth 2 had children.
        m.record_tree_step(6, 3, 2, 3, true);
        // 4 nodes, depth 2: a leaf at depth 2 accepted (bonus token).
        m.record_tree_step(4, 2, 2, 3, false);
        assert_eq!((m.proposed, m.accepted, m.emitted), (10, 4, 6));
        assert_eq!((m.tree_steps, m.tree_nodes, m.tree_depth), (2, 10, 5));
        assert_eq!(m.reached_at, vec![2, 2, 1]);
        assert_eq!(m.accepted_at, vec![2, 2, 0]);
        assert_eq!(m.position_acceptance(), vec![1.0, 1.0, 0.0]);
        assert!((m.mean_tree_nodes() - 5.0).abs() < 1e-12);
        assert!((m.mean_tree_depth() - 2.5).abs() < 1e-12);
        let mut total = Metrics::default();
        total.merge(&m);
        assert_eq!(total.tree_steps, 2);
    }
}
