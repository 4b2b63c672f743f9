//! Draft length policies: a fixed draft length `k`, or an adaptive `k` that maximises expected
//! tokens per second; with token trees, an adaptive node budget and tree shape (the cost-aware
//! tree-shape policy, [`AdaptiveState::choose_tree`]).
//!
//! Sources: the expected tokens per step of a chain, Leviathan et al. 2023, section 3.1; the
//! optimal tree for acceptance by position and the choice of its size against the measured
//! cost of a forward, Sequoia (Chen et al. 2024, section 3); the greedy expansion of the nodes
//! with the highest reach probability, EAGLE-2 (Li et al. 2024, section 4).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::error::{Error, Result};
use crate::timing::{RobustCurve, RowSamples, curve_at, median_curve, propose_curve, robust_cost};
use crate::tree::DraftBlock;

/// How many draft tokens to ask for at each step (the draft length `k`).
///
/// The default is `Fixed(4)`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum DraftLength {
    /// Speculation off: every step is a no-draft step (`k = 0`, plain decoding), as with
    /// [`NoProposer`](crate::NoProposer); a per-request opt-out.
    Off,
    /// Always ask for `k` drafts (capped by budget and context).
    Fixed(usize),
    /// Pick `k` in `0..=max_draft` each step from online estimates (see [`AdaptiveConfig`]).
    Adaptive(AdaptiveConfig),
}

impl Default for DraftLength {
    /// `Fixed(4)`: four drafts per step, a good start for model-free proposers at batch size 1.
    fn default() -> Self {
        DraftLength::Fixed(4)
    }
}

/// Configuration of the adaptive draft-length policy.
///
/// The policy keeps, per draft position `i`, an estimate `a_i` of the probability that position
/// `i` is accepted given that positions `0..i` were (a Beta(1, 1) prior with exponentially
/// decayed counts), and an estimate `t(n)` of the wall time of a target forward over `n` tokens
/// (the median of the last 7 forwards of `n` rows, a least-squares line through the measured
/// `n` for the others: one forward slowed by the machine does not move it), plus the proposer's
/// time `P(k)` for `k` draft tokens (the median of the last 7 drafting steps of `k` tokens; a
/// fixed part per step, a draft model's catch-up with the tokens accepted since its last draft,
/// plus a part per token, linear between the measured lengths, [`AdaptiveState::propose_cost`]:
/// a merged proposer that asks a costly member on a few steps only, for a probe, is priced at
/// its typical step, and the merge prices its members itself,
/// [`MergedProposer`](crate::propose::MergedProposer)). The times are those the generator's cost
/// source reports ([`StepCosts`](crate::decode::StepCosts): the measured clock by default, a
/// fixed curve with [`Generator::with_costs`](crate::decode::Generator::with_costs)). It picks the `k` that maximises
///
/// `E[tokens](k) / (t(k + 1) + P(k))`, with `E[tokens](k) = 1 + sum_{j=1..k} prod_{i<j} a_i`
///
/// (the expected number of tokens per step, Leviathan et al. 2023, section 3.1, with per-position
/// rates). `k = 0` (plain decoding) wins when speculation does not pay; then every
/// `probe_interval` steps it tries `k = probe_draft` so that the estimates keep learning.
/// Each probe that does not bring speculation back doubles the interval, up to
/// `max_probe_interval` steps (exponential backoff), so that a proposer that never pays
/// (a draft model rejected everywhere, whose catch-up over the skipped tokens is costly) costs
/// a vanishing share of the time; the first step that speculates again resets the wait. Where
/// the measured cost curve says no draft could pay even if every token were accepted (a CPU
/// engine whose verify of 2 rows costs more than 2 single steps, a draft model that costs more
/// than the target step it saves: [`AdaptiveState::cannot_pay`]), learning acceptance is
/// worthless and the policy probes only every `max_probe_interval` plain steps, counted across
/// generations, to re-measure the curve. Either way a probe also waits until it fits
/// `probe_budget` (2 % of the decoding time by default): the steps since the last probe,
/// across generations, must have taken at least a probe's extra cost over a plain step (the
/// last probe's proposing time plus the extra rows of its forward) divided by that share (the
/// warm-up step is not a probe: a merged proposer has learned nothing there and asks every
/// member), so that a draft model whose probe pays a catch-up with the whole
/// prompt and every token since costs at most that share of a server's time, however short its
/// requests. It also waits until it fits `request_probe_budget` of the request's own decoding
/// time (2 % by default): the steps of this generation since its start or its last probe must
/// have taken at least the probe's extra cost divided by that share, so that no request pays
/// more than that share for probes (a SmolLM2 draft's probe on llama.cpp's CPU verify of Gemma
/// 3 270M costs about 0.13 s, 15 % of a 64-token request: with this budget such a request is
/// not probed, a 512-token one once). Start a request from an earlier one's cost estimates
/// with [`Generator::with_adaptive_state`](crate::decode::Generator::with_adaptive_state) and
/// [`AdaptiveState::costs_only`].
///
/// **With token trees** ([`TreeDrafts::Tree`](crate::decode::TreeDrafts::Tree) in
/// [`GenerationParams::tree`](crate::decode::GenerationParams::tree) and a target with tree
/// support) the policy chooses each step's node budget and shape instead of `k`
/// ([`AdaptiveState::choose_tree`]):
///
/// - Estimates: per depth `d >= 1` and sibling rank `r` (a node's index among its parent's
///   children in draft order; every node of a chain has rank 0), `a(d, r)`, the probability
///   that the rank-`r` child of a node at depth `d - 1` is accepted given that node was reached,
///   with the same decayed counts as chains; its Beta prior (weight 2) has the mean of rank `r`
///   over all depths, itself under a prior of mean `2^-(r + 1)` (so rank 0 starts at 0.5 like a
///   chain position). Every child of a reached node (the root and each
///   node of the accepted path) counts as tested, the one on the path as accepted; chain steps
///   teach rank 0. For ranks `r >= 1` the value is scaled by `f(r)`, the share of steps whose
///   requested shape held a rank-`r` node in which the proposer's draft held one (`(filled + 1)
///   / (offered + 1)`, decayed counts), so that ranks a proposer never fills (a chain proposer)
///   stop counting. The plan uses each estimate plus half its posterior standard deviation
///   ([`AdaptiveState::tree_value`]), so that a rank or depth judged on a few steps is tried
///   again (optimism in the face of uncertainty).
/// - Cost: `t(n)`, the forward time by rows fed (`nodes + 1`; one curve for chains and trees):
///   per measured row count the median of its last 7 forwards (a slow outlier on a shared
///   machine does not count), shrunk toward the least-squares line through all measured row
///   counts where above it, linear between measured row counts and the line (kept monotone) outside them
///   ([`AdaptiveState::tree_forward_cost`]); `P(n)` the proposing time of `n` nodes, as for
///   chains.
/// - Choice (Sequoia, Chen et al. 2024, section 3; EAGLE-2, Li et al. 2024): the reach
///   probability of a node is the product of the values along its path; the best tree of `n`
///   nodes holds the `n` highest reach probabilities, built greedily from the root (add the
///   frontier node with the highest reach probability; optimal when the values do not grow with
///   rank, since reach probabilities never grow down a path), within the depth (`max_draft`, the
///   token budget and context room) and branching ([`TreeDrafts::branch`](crate::decode::TreeDrafts::branch)) limits. With `E(n) = 1 + sum of
///   those n reach probabilities`, the policy picks the `n` in `0..=node budget` maximising
///   `E(n) / (t(n + 1) + P(n))` and asks the proposer for `n` nodes with the depth and
///   largest branching of that tree. A chain is the case where every rank above 0 is worthless;
///   `n = 0` is plain decoding, with the same probes and backoff as `k = 0`. While it
///   speculates, every `probe_interval`-th step explores: it plans with each value raised to at
///   least its rank's prior `2^-(r + 1)` (times `f(r)`), so that a depth or rank judged on a few
///   unlucky steps is tried again.
///
/// | field | default | valid range |
/// |---|---|---|
/// | `max_draft` | 8 | any (0 makes every step a no-draft step) |
/// | `decay` | 0.98 | `(0, 1]` |
/// | `time_smoothing` | 0.2 | `(0, 1]` |
/// | `probe_interval` | 16 | `>= 1` |
/// | `max_probe_interval` | 256 | any (below `probe_interval`: a fixed interval) |
/// | `probe_draft` | 2 | any (capped by `max_draft`) |
/// | `probe_budget` | 0.02 | `(0, 1]` |
/// | `request_probe_budget` | 0.02 | `(0, 1]` |
///
/// `#[non_exhaustive]`: build it from [`AdaptiveConfig::default`] and the `with_` setters (checked
/// by [`AdaptiveConfig::validate`], which
/// [`GenerationParamsBuilder::build`](crate::decode::GenerationParamsBuilder::build) calls).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(remote = "Self", default, deny_unknown_fields)
)]
#[non_exhaustive]
pub struct AdaptiveConfig {
    /// Largest draft length `k` considered.
    pub max_draft: usize,
    /// Decay of the acceptance counts per observation, in `(0, 1]` (1 = no forgetting).
    pub decay: f64,
    /// Weight of a new timing in the moving averages of replay times (snapshot rollback),
    /// in `(0, 1]`. Forward and proposing times are medians of the last samples instead
    /// ([`AdaptiveState::forward_cost`], [`AdaptiveState::propose_cost`]).
    pub time_smoothing: f64,
    /// While `k = 0` wins, every this many steps probe with `k = probe_draft` (the initial
    /// interval). With trees, also the interval of the exploring steps while speculating.
    pub probe_interval: usize,
    /// Longest interval between probes, in steps, reached by doubling after each probe that
    /// fails. Values below `probe_interval` act as `probe_interval` (a fixed interval).
    pub max_probe_interval: usize,
    /// Draft length `k` of a probe step (capped by `max_draft`).
    pub probe_draft: usize,
    /// The most share of the decoding time that probes may cost, in `(0, 1]`: a probe waits
    /// (past its interval) until the steps since the last probe, counted across generations,
    /// took at least a probe's extra cost (the last probe's proposing time plus the forward of
    /// `probe_draft + 1` rows less a plain step's, from the learned curve) divided by this
    /// share. A draft model's probe pays its catch-up
    /// with every token since it was last asked (a new request's whole prompt included), which
    /// on a CPU engine is several target steps; 1 leaves the intervals alone.
    pub probe_budget: f64,
    /// The most share of one request's decoding time that probes may cost, in `(0, 1]`: a
    /// probe also waits until the steps of this generation since its start (or its last probe)
    /// took at least the probe's extra cost (as for `probe_budget`) divided by this share, so
    /// that a dear probe never lands in a request too short to carry it. The first probe, with
    /// no earlier probe to be priced from, is not held back. 1 leaves the intervals alone.
    pub request_probe_budget: f64,
}

impl Default for AdaptiveConfig {
    /// `max_draft` 8, `decay` 0.98, `time_smoothing` 0.2, `probe_interval` 16,
    /// `max_probe_interval` 256, `probe_draft` 2, `probe_budget` 0.02, `request_probe_budget`
    /// 0.02 (the table of [`AdaptiveConfig`]).
    fn default() -> Self {
        AdaptiveConfig {
            max_draft: 8,
            decay: 0.98,
            time_smoothing: 0.2,
            probe_interval: 16,
            max_probe_interval: 256,
            probe_draft: 2,
            probe_budget: 0.02,
            request_probe_budget: 0.02,
        }
    }
}

impl AdaptiveConfig {
    /// Sets [`AdaptiveConfig::max_draft`] (any value is valid).
    pub fn with_max_draft(mut self, max_draft: usize) -> Self {
        self.max_draft = max_draft;
        self
    }

    /// Sets [`AdaptiveConfig::decay`] (checked by [`AdaptiveConfig::validate`]).
    pub fn with_decay(mut self, decay: f64) -> Self {
        self.decay = decay;
        self
    }

    /// Sets [`AdaptiveConfig::time_smoothing`] (checked by [`AdaptiveConfig::validate`]).
    pub fn with_time_smoothing(mut self, time_smoothing: f64) -> Self {
        self.time_smoothing = time_smoothing;
        self
    }

    /// Sets [`AdaptiveConfig::probe_interval`] (checked by [`AdaptiveConfig::validate`]).
    pub fn with_probe_interval(mut self, probe_interval: usize) -> Self {
        self.probe_interval = probe_interval;
        self
    }

    /// Sets [`AdaptiveConfig::max_probe_interval`] (any value is valid).
    pub fn with_max_probe_interval(mut self, max_probe_interval: usize) -> Self {
        self.max_probe_interval = max_probe_interval;
        self
    }

    /// Sets [`AdaptiveConfig::probe_draft`] (any value is valid).
    pub fn with_probe_draft(mut self, probe_draft: usize) -> Self {
        self.probe_draft = probe_draft;
        self
    }

    /// Sets [`AdaptiveConfig::probe_budget`] (checked by [`AdaptiveConfig::validate`]).
    pub fn with_probe_budget(mut self, probe_budget: f64) -> Self {
        self.probe_budget = probe_budget;
        self
    }

    /// Sets [`AdaptiveConfig::request_probe_budget`] (checked by [`AdaptiveConfig::validate`]).
    pub fn with_request_probe_budget(mut self, request_probe_budget: f64) -> Self {
        self.request_probe_budget = request_probe_budget;
        self
    }

    /// Checks the ranges documented on each field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for `decay`, `time_smoothing`, `probe_budget` or
    /// `request_probe_budget` outside `(0, 1]` or `probe_interval == 0`.
    pub fn validate(&self) -> Result<()> {
        if !(self.decay > 0.0 && self.decay <= 1.0) {
            return Err(Error::config("decay", self.decay, "must be in (0, 1]"));
        }
        if !(self.time_smoothing > 0.0 && self.time_smoothing <= 1.0) {
            return Err(Error::config(
                "time_smoothing",
                self.time_smoothing,
                "must be in (0, 1]",
            ));
        }
        if self.probe_interval == 0 {
            return Err(Error::config("probe_interval", 0, "must be >= 1"));
        }
        for (name, share) in [
            ("probe_budget", self.probe_budget),
            ("request_probe_budget", self.request_probe_budget),
        ] {
            if !(share > 0.0 && share <= 1.0) {
                return Err(Error::config(name, share, "must be in (0, 1]"));
            }
        }
        Ok(())
    }
}

/// The shape of a token tree: node budget, depth and branching. [`AdaptiveState::choose_tree`]
/// takes one as its limits and returns the chosen one.
///
/// `#[non_exhaustive]`: build one with [`TreeShape::new`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TreeShape {
    /// Number of nodes (the node budget; 0 = plain decoding).
    pub nodes: usize,
    /// Depth of the deepest node: the most drafts one step can accept.
    pub depth: usize,
    /// Most children of one node, the root included (1 = a chain; as a limit, `usize::MAX`
    /// for none).
    pub branch: usize,
}

impl TreeShape {
    /// A shape (or limits) of `nodes` nodes, depth `depth` and at most `branch` children per
    /// node.
    pub fn new(nodes: usize, depth: usize, branch: usize) -> Self {
        TreeShape {
            nodes,
            depth,
            branch,
        }
    }
}

/// One node of the tree the policy plans ([`AdaptiveState::plan_tree`]), in the order the
/// greedy expansion added it.
///
/// `#[non_exhaustive]`: returned by the policy, read its fields.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct PlannedNode {
    /// Depth (1 for a child of the root).
    pub depth: usize,
    /// Rank among its parent's children (0 = first).
    pub rank: usize,
    /// Index of the parent in the plan; `None` for a child of the root.
    pub parent: Option<usize>,
    /// Reach probability: the product of [`AdaptiveState::tree_value`] along the path.
    pub reach: f64,
}

/// While the chain policy speculates, one step in this many is plain, so that the single-row
/// forward cost `c(1)` is measured again (plain steps are its only samples): on a shared
/// machine whose speed drifts, a `c(1)` measured in a slow moment would keep a draft that does
/// not pay (seen on 2 threads: a SmolLM2 draft at `k = 1` for two requests, 0.68-0.73x).
/// Costs at most one step's gain per 64 steps.
const REMEASURE_PLAIN: usize = 64;

/// Online state of the adaptive policy for one generator (kept across generations, since the
/// target's cost curve does not change between requests).
///
/// The default state has observed nothing: every position's acceptance estimate is the prior
/// mean 0.5 and no forward cost is known, so the first step uses `max_draft` (with trees, the
/// planned tree of `max_draft` nodes).
#[derive(Debug, Clone, Default)]
pub struct AdaptiveState {
    acc: Vec<f64>,
    seen: Vec<f64>,
    /// EMA of replay seconds by tokens replayed (index r; targets in snapshot mode only,
    /// empty until the first replay).
    replay_cost: Vec<Option<f64>>,
    /// The last drafting steps' proposing seconds by draft length (index k; tokens of a
    /// chain, nodes of a tree).
    propose_by_len: Vec<RowSamples>,
    /// A step of this generation drafted: its proposing time was the first (see
    /// [`AdaptiveState::observe`]).
    drafted_this_generation: bool,
    zero_run: usize,
    /// Current interval between probes (0 before the first probe: `probe_interval`).
    wait: usize,
    steps: usize,
    /// Decayed counts per `[depth - 1][rank]`: accepted, tested.
    tree_acc: Vec<Vec<f64>>,
    tree_seen: Vec<Vec<f64>>,
    /// Decayed counts per rank `r >= 1` (index r): steps whose requested shape held a rank-r
    /// node, and those whose draft held one.
    offered: Vec<f64>,
    filled: Vec<f64>,
    /// The shape of the last [`AdaptiveState::choose_tree`].
    last_shape: Option<TreeShape>,
    /// The request the next [`AdaptiveState::observe_draft`] belongs to.
    pending: Option<TreeShape>,
    /// The last forward times by rows fed (index n): the chain policy's median curve and the
    /// tree policy's robust one.
    row_samples: Vec<RowSamples>,
    /// Speculative tree-policy steps since the last exploring one.
    explore_run: usize,
    /// Plain steps, across generations, since the last probe of a state in which no draft
    /// could pay ([`AdaptiveState::cannot_pay`]).
    ceiling_run: usize,
    /// The last probe's proposing seconds (`None` before the first probe).
    probe_cost: Option<f64>,
    /// Seconds of the steps since the last probe, across generations.
    since_probe: f64,
    /// Seconds of this generation's steps since its start or its last probe.
    request_since_probe: f64,
    /// The last choice was a probe: the next recorded step prices it.
    probing: bool,
    /// The step count at the last plain step (or forced re-measure) of the chain policy.
    plain_at: usize,
    /// The last choice was a re-measure of `c(1)`: a time below the estimate replaces its
    /// samples.
    remeasure: bool,
}

/// A frontier node of the greedy expansion.
struct Candidate {
    reach: f64,
    seq: u64,
    depth: usize,
    rank: usize,
    parent: Option<usize>,
    parent_reach: f64,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    /// Higher reach first; ties to the candidate found first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.reach
            .total_cmp(&other.reach)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// Decays a count pair and adds one observation.
/// How many nodes of `path` (node indices, the root's child first) follow `block`: each a
/// child of the one before (the first a child of the root); reading stops at the first that
/// does not.
fn accepted_prefix(block: &DraftBlock<'_>, path: &[u32]) -> usize {
    let n = block.len();
    let mut accepted = 0;
    let mut row = 0;
    for &j in path {
        let j = j as usize;
        if j >= n || block.parent_row(j) != row {
            break;
        }
        accepted += 1;
        row = j + 1;
    }
    accepted
}

/// The largest sibling rank (index among its parent's children, in draft order) a node of
/// `block` has; 0 for a chain or an empty block.
fn max_sibling_rank(block: &DraftBlock<'_>) -> usize {
    let n = block.len();
    let mut children = vec![0usize; n + 1];
    let mut max_rank = 0;
    for i in 0..n {
        let r = block.parent_row(i).min(n);
        max_rank = max_rank.max(children[r]);
        children[r] += 1;
    }
    max_rank
}

fn count(acc: &mut f64, seen: &mut f64, decay: f64, hit: bool) {
    *acc *= decay;
    *seen *= decay;
    *seen += 1.0;
    if hit {
        *acc += 1.0;
    }
}

impl AdaptiveState {
    /// Estimated acceptance probability of position `i` given that `0..i` were accepted: the
    /// decayed counts of position `i` shrunk toward the estimate of position `i - 1`,
    /// `p_i = (accepted_i + 2 p_{i-1}) / (tested_i + 2)` with `p_{-1} = 0.5` (a Beta prior of
    /// weight 2 centred on the previous position). A position that was never tested thus
    /// inherits the estimate of the one before it, so a policy that has settled on a short
    /// draft still values the next position as what it last saw and tries it, instead of
    /// holding the uninformed 0.5 against it for good.
    pub fn acceptance(&self, i: usize) -> f64 {
        let mut p = 0.5;
        for j in 0..=i {
            let a = self.acc.get(j).copied().unwrap_or(0.0);
            let s = self.seen.get(j).copied().unwrap_or(0.0);
            p = (a + 2.0 * p) / (s + 2.0);
        }
        p
    }

    /// Estimated seconds of a target forward over `n >= 1` tokens (rows), if anything was
    /// measured: the median of the last 7 forwards of `n` rows, else the least-squares line
    /// through the medians of the measured row counts (slope at least 0). A median, not a
    /// moving average: one forward slowed by the machine (seen on 2 threads: a plain step of
    /// 186 ms among steps of 14 ms) cannot make plain decoding look dear.
    pub fn forward_cost(&self, n: usize) -> Option<f64> {
        median_curve(&self.row_samples, n)
    }

    /// Estimated proposing seconds of a draft of `k` tokens (nodes of a tree): a fixed part
    /// per step (a draft model's catch-up with the tokens accepted since its last draft) and a
    /// part per token, from the medians of the last drafting steps by draft length (see the
    /// crate-internal `propose_curve`: measured lengths as measured, linear between them,
    /// proportional from a single one). `0` before the first sample and for `k = 0`.
    pub fn propose_cost(&self, k: usize) -> f64 {
        propose_curve(&self.propose_by_len, k).unwrap_or(0.0)
    }

    /// Estimated seconds of a replay of `rows >= 1` tokens after a rejection (snapshot mode,
    /// [`crate::Rollback::Snapshot`]): the replays measured so far ([`AdaptiveState::observe_replay`]),
    /// their value at `rows` or the least-squares line through them; with a single measured
    /// replay length, that replay plus the forward curve's difference between the two lengths.
    /// `None` before the first replay (a target that rolls back without replaying never has one).
    pub fn replay_cost(&self, rows: usize) -> Option<f64> {
        let pts = self.replay_cost.iter().filter(|c| c.is_some()).count();
        if pts == 1
            && let Some((r0, c0)) = self
                .replay_cost
                .iter()
                .enumerate()
                .find_map(|(r, c)| c.map(|c| (r, c)))
            && r0 != rows
        {
            let shift = self.forward_cost(rows).zip(self.forward_cost(r0));
            return Some(shift.map_or(c0, |(a, b)| (c0 + a - b).max(1e-12)));
        }
        curve_at(&self.replay_cost, rows)
    }

    /// Expected replay seconds of a step with `k` drafts (snapshot mode): a rejection of draft
    /// position `a` (the first `a` accepted) replays `a + 1` tokens, so
    /// `sum_{a<k} prod_{i<a} p_i (1 - p_a) r(a + 1)` with `p_i` = [`AdaptiveState::acceptance`]
    /// and `r` = [`AdaptiveState::replay_cost`]. Zero before the first replay and for `k = 0`.
    pub fn expected_replay(&self, k: usize) -> f64 {
        let p: Vec<f64> = (0..k).map(|i| self.acceptance(i)).collect();
        self.replay_of(&p)
    }

    /// The expected replay seconds for per-position acceptances `p` (see
    /// [`AdaptiveState::expected_replay`]).
    fn replay_of(&self, p: &[f64]) -> f64 {
        if self.replay_cost.is_empty() {
            return 0.0;
        }
        let (mut reach, mut e) = (1.0, 0.0);
        for (a, &p) in p.iter().enumerate() {
            e += reach * (1.0 - p) * self.replay_cost(a + 1).unwrap_or(0.0);
            reach *= p;
        }
        e
    }

    /// The values the chain policy ([`AdaptiveState::choose`]) gives draft positions `0..k`:
    /// the optimistic acceptance `min(1, p + sd / 2)` of [`AdaptiveState::tree_value`], with
    /// `p` = [`AdaptiveState::acceptance`] and `sd` its Beta posterior's standard deviation
    /// (`sqrt(p (1 - p) / (tested + 3))`). A position judged on a step or two is thus tried
    /// again until its estimate is firm: one early rejection at position 2 cannot keep the
    /// policy at `k = 1` for good.
    fn chain_values(&self, k: usize) -> Vec<f64> {
        (0..k)
            .map(|i| {
                let p = self.acceptance(i);
                let seen = self.seen.get(i).copied().unwrap_or(0.0);
                (p + 0.5 * (p * (1.0 - p) / (seen + 3.0)).sqrt()).min(1.0)
            })
            .collect()
    }

    /// Estimated seconds of a target forward over `rows >= 1` rows (a tree of `rows - 1`
    /// nodes, or a chain of `rows - 1` drafts), as the tree policy reads the cost curve, robust
    /// to the odd slow forward of a shared machine: per measured row count the median of its
    /// last 7 forward times with weight `m = samples * 0.98^(steps since the last one)`, shrunk
    /// toward the weighted least-squares line through all measured row counts as
    /// `(m * median + line) / (m + 1)` where that is below the median (timing noise only adds
    /// time: a median below the line is kept as measured, so a row count that is cheap for
    /// the engine's kernels stays cheap); between measured row counts linear, outside them the
    /// line, kept at or above the estimate of the nearest measured row count below and at or
    /// below the nearest above. A row count the policy stopped choosing (plain decoding while
    /// it speculates) thus drifts to what the fresh measurements say, so one slow sample cannot
    /// hold a choice for good. `None` before any measurement.
    pub fn tree_forward_cost(&self, rows: usize) -> Option<f64> {
        robust_cost(&self.row_samples, self.steps, rows)
    }

    /// Expected tokens per step with `k` drafts: `1 + sum_{j=1..k} prod_{i<j} a_i`.
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let mut e = 1.0;
        let mut prod = 1.0;
        for i in 0..k {
            prod *= self.acceptance(i);
            e += prod;
        }
        e
    }

    /// The draft length to use, at most `cap`: the `k` in `0..=min(max_draft, cap)` of the most
    /// expected tokens per second, `E(k) / (c(k + 1) + P(k) + R(k))`, with `E` from the
    /// optimistic position values of [`AdaptiveState::tree_value`]'s kind (a position tested a
    /// few times only is worth a little more than its estimate, so it is tried again), `c` the
    /// forward cost curve ([`AdaptiveState::forward_cost`]), `P(k)` the proposing time of `k`
    /// draft tokens ([`AdaptiveState::propose_cost`]) and `R` the expected replay
    /// ([`AdaptiveState::expected_replay`]; zero for targets that never replayed). While
    /// plain decoding wins, probes as [`AdaptiveConfig::probe_interval`] says, except where no
    /// draft could pay even fully accepted ([`AdaptiveState::cannot_pay`]): then it probes every
    /// [`AdaptiveConfig::max_probe_interval`] plain steps, counted across generations. While it
    /// speculates, a step 64 steps after the last plain one is plain (plain steps are the only
    /// samples of `c(1)`), and a time below the estimate replaces `c(1)`'s samples.
    pub fn choose(&mut self, cfg: &AdaptiveConfig, cap: usize) -> usize {
        let max_k = cfg.max_draft.min(cap);
        if max_k == 0 {
            return 0;
        }
        // Warm-up: measure a full-length forward and a single-token forward first.
        if self.cost_at(max_k + 1).is_none() && self.steps == 0 {
            return max_k;
        }
        if self.cost_at(1).is_none() {
            return 0;
        }
        let mut best = (0usize, f64::NEG_INFINITY);
        for k in 0..=max_k {
            let values = self.chain_values(k);
            let t = self.forward_cost(k + 1).unwrap_or(f64::INFINITY)
                + self.propose_cost(k)
                + self.replay_of(&values);
            let rate = tokens_of(&values) / t;
            if rate > best.1 {
                best = (k, rate);
            }
        }
        if best.0 > 0 && self.steps.saturating_sub(self.plain_at) >= REMEASURE_PLAIN {
            // A plain step re-measures c(1): while every step speculates, c(1) is never
            // sampled, and one measured in a slow moment keeps a draft that does not pay.
            self.plain_at = self.steps;
            self.remeasure = true;
            return 0;
        }
        if best.0 == 0 && self.cannot_pay(max_k, |n| self.forward_cost(n)) {
            return if self.ceiling_probe(cfg) {
                cfg.probe_draft.min(max_k)
            } else {
                0
            };
        }
        if self.probe_now(cfg, best.0 == 0) {
            return cfg.probe_draft.min(max_k);
        }
        best.0
    }

    /// `true` when no draft of `1..=max_k` tokens (`max_k` nodes for a tree) could beat plain
    /// decoding even if every drafted token were accepted: `(k + 1) c(1) <= c(k + 1) + P(k)`
    /// for every `k`, with `cost` the forward cost curve (seconds by rows) and `P(k)` the
    /// proposing time of `k` draft tokens ([`AdaptiveState::propose_cost`]). Then no acceptance estimate can change
    /// the choice, so the probes that learn acceptance are wasted; the policy probes only every
    /// [`AdaptiveConfig::max_probe_interval`] plain steps, counted across generations, to
    /// re-measure the cost curve ([`AdaptiveState::choose`]). `false` while the curve holds
    /// fewer than two measured row counts (a single point extends flat).
    pub fn cannot_pay(&self, max_k: usize, cost: impl Fn(usize) -> Option<f64>) -> bool {
        let measured = self.row_samples.iter().filter(|r| r.median().is_some());
        let Some(c1) = cost(1) else {
            return false;
        };
        measured.count() >= 2
            && (1..=max_k).all(|k| {
                cost(k + 1).is_some_and(|c| (k + 1) as f64 * c1 <= c + self.propose_cost(k))
            })
    }

    /// The probe schedule of a state that [`AdaptiveState::cannot_pay`]: `true` once every
    /// `max(max_probe_interval, probe_interval)` calls, a count that
    /// [`AdaptiveState::begin_generation`] keeps (new requests do not change the engine's
    /// costs, so short requests do not each pay for a probe).
    fn ceiling_probe(&mut self, cfg: &AdaptiveConfig) -> bool {
        self.ceiling_run = self.ceiling_run.saturating_add(1);
        if self.ceiling_run >= cfg.max_probe_interval.max(cfg.probe_interval)
            && self.probe_affordable(cfg)
        {
            self.ceiling_run = 0;
            self.probing = true;
            return true;
        }
        false
    }

    /// Whether a probe fits [`AdaptiveConfig::probe_budget`] and
    /// [`AdaptiveConfig::request_probe_budget`]: the steps since the last probe took at least a
    /// probe's extra cost over the budget share, and this generation's steps since its start
    /// or its last probe at least that cost over the request's share (always, before the
    /// first probe). A probe's extra cost: the last probe's proposing seconds (a draft model's
    /// catch-up included) plus the forward of `probe_draft + 1` rows less a plain step's.
    fn probe_affordable(&self, cfg: &AdaptiveConfig) -> bool {
        let Some(propose) = self.probe_cost else {
            return true;
        };
        let n = cfg.probe_draft.min(cfg.max_draft).max(1) + 1;
        let rows = match (self.forward_cost(n), self.forward_cost(1)) {
            (Some(a), Some(b)) => (a - b).max(0.0),
            _ => 0.0,
        };
        let cost = propose + rows;
        self.since_probe * cfg.probe_budget >= cost
            && self.request_since_probe * cfg.request_probe_budget >= cost
    }

    /// Counts a recorded step's seconds toward the probe budget; a probe step (`k > 0` after a
    /// probing choice) sets the probe's proposing seconds and restarts the count.
    fn price_probe(&mut self, k: usize, forward_secs: Option<f64>, propose_secs: f64) {
        if std::mem::take(&mut self.probing) && k > 0 {
            self.probe_cost = Some(propose_secs);
            self.since_probe = 0.0;
            self.request_since_probe = 0.0;
        } else {
            let secs = forward_secs.unwrap_or(0.0) + propose_secs;
            self.since_probe += secs;
            self.request_since_probe += secs;
        }
    }

    /// The cost estimates of this state alone: the forward cost curve (and the tree policy's
    /// samples of it), the replay costs, the proposing time per draft token and the probe
    /// budget's count (the last probe's proposing time, the seconds since it and the plain steps since a
    /// ceiling probe), with the acceptance estimates, the probe intervals and the tree
    /// statistics of a fresh state.
    /// The cost curve belongs to the engine (and the proposing time to the proposer), not to a
    /// request, so a server can start each request's policy from what earlier requests
    /// measured ([`crate::decode::Generator::with_adaptive_state`]) without carrying one
    /// request's acceptance into the next. A state that knows the cost curve skips the
    /// warm-up step of a fresh one (a forward of `max_draft + 1` rows).
    pub fn costs_only(&self) -> AdaptiveState {
        AdaptiveState {
            replay_cost: self.replay_cost.clone(),
            propose_by_len: self.propose_by_len.clone(),
            steps: self.steps,
            row_samples: self.row_samples.clone(),
            ceiling_run: self.ceiling_run,
            probe_cost: self.probe_cost,
            since_probe: self.since_probe,
            plain_at: self.plain_at,
            ..AdaptiveState::default()
        }
    }

    /// The probe bookkeeping of both policies: `true` when this step, for which plain decoding
    /// won (`plain`), is a probe; a step that speculates resets the wait.
    pub(crate) fn probe_now(&mut self, cfg: &AdaptiveConfig, plain: bool) -> bool {
        if plain {
            let wait = self.wait.max(cfg.probe_interval);
            if self.zero_run + 1 >= wait && self.probe_affordable(cfg) {
                self.zero_run = 0;
                self.probing = true;
                // The next wait is longer unless this probe brings speculation back.
                self.wait = wait
                    .saturating_mul(2)
                    .min(cfg.max_probe_interval.max(cfg.probe_interval));
                return true;
            }
            self.zero_run = self.zero_run.saturating_add(1);
        } else {
            self.zero_run = 0;
            self.wait = cfg.probe_interval;
        }
        false
    }

    /// Estimated probability that the rank-`rank` child of a node at depth `depth - 1` is
    /// accepted given that node was reached (and the child was drafted): the posterior mean of
    /// the decayed counts of every step at this depth and rank under a Beta prior of weight 2
    /// whose mean is the rank's estimate over all depths ([`AdaptiveState::rank_acceptance`]),
    /// so that a depth seen on a few steps starts from what the other depths say about the
    /// rank (Sequoia's acceptance vector by rank, Chen et al. 2024, section 3). `depth` 0 (the
    /// root, always reached) gives 1.
    pub fn tree_acceptance(&self, depth: usize, rank: usize) -> f64 {
        if depth == 0 {
            return 1.0;
        }
        let (a, s) = self.tree_counts(depth, rank);
        (a + 2.0 * self.rank_acceptance(rank)) / (s + 2.0)
    }

    /// Estimated probability that a rank-`rank` child is accepted given its parent was reached,
    /// over all depths: the decayed counts of every depth at this rank under a Beta prior of
    /// mean `2^-(rank + 1)` and weight 2.
    pub fn rank_acceptance(&self, rank: usize) -> f64 {
        let prior = 0.5f64.powi(rank.min(1100) as i32 + 1);
        let (mut a, mut s) = (0.0, 0.0);
        for (acc, seen) in self.tree_acc.iter().zip(&self.tree_seen) {
            a += acc.get(rank).copied().unwrap_or(0.0);
            s += seen.get(rank).copied().unwrap_or(0.0);
        }
        (a + 2.0 * prior) / (s + 2.0)
    }

    /// The decayed (accepted, tested) counts at `depth >= 1` and `rank`.
    fn tree_counts(&self, depth: usize, rank: usize) -> (f64, f64) {
        let get = |v: &Vec<Vec<f64>>| {
            v.get(depth - 1)
                .and_then(|r| r.get(rank))
                .copied()
                .unwrap_or(0.0)
        };
        (get(&self.tree_acc), get(&self.tree_seen))
    }

    /// Estimated share of the steps asked for a tree with a rank-`rank` node in which the
    /// proposer drafted a node of that rank (1 for rank 0, whose absence is a short draft).
    pub fn tree_fill(&self, rank: usize) -> f64 {
        if rank == 0 {
            return 1.0;
        }
        let o = self.offered.get(rank).copied().unwrap_or(0.0);
        let f = self.filled.get(rank).copied().unwrap_or(0.0);
        (f + 1.0) / (o + 1.0)
    }

    /// The value the tree policy gives a node at `depth` and `rank`: [`AdaptiveState::tree_fill`]
    /// times the optimistic acceptance `min(1, a + sd / 2)`, where `a` is
    /// [`AdaptiveState::tree_acceptance`] and `sd` the standard deviation of its Beta posterior
    /// (optimism in the face of uncertainty, as in UCB: a depth or sibling rank judged on a few
    /// steps is tried again until its estimate is firm; once the decayed counts saturate, at
    /// about `1 / (1 - decay)` tests, the bonus is at most 0.035 with the default decay).
    pub fn tree_value(&self, depth: usize, rank: usize) -> f64 {
        if depth == 0 {
            return 1.0;
        }
        let a = self.tree_acceptance(depth, rank);
        let seen = self.tree_counts(depth, rank).1;
        let sd = (a * (1.0 - a) / (seen + 3.0)).sqrt();
        self.tree_fill(rank) * (a + 0.5 * sd).min(1.0)
    }

    /// The best tree for the current estimates, greedily, with at most `limits.nodes` nodes,
    /// depth `limits.depth` and `limits.branch` children per node: repeatedly adds the frontier
    /// node (the first child of a planned node, or the next sibling of one) with the highest
    /// reach probability (EAGLE-2, Li et al. 2024; Sequoia, Chen et al. 2024, section 3). The
    /// first `n` nodes are the plan of a tree of `n` nodes; `1 + sum` of their reach is the
    /// expected number of tokens of a step over that tree.
    pub fn plan_tree(&self, limits: TreeShape) -> Vec<PlannedNode> {
        self.plan(limits, false)
    }

    /// The value of a node for planning; an exploring plan gives each (depth, rank) at least
    /// its rank's starting prior `2^-(rank + 1)` (times the rank's fill).
    fn plan_value(&self, depth: usize, rank: usize, explore: bool) -> f64 {
        let v = self.tree_value(depth, rank);
        if explore {
            v.max(self.tree_fill(rank) * 0.5f64.powi(rank.min(1100) as i32 + 1))
        } else {
            v
        }
    }

    fn plan(&self, limits: TreeShape, explore: bool) -> Vec<PlannedNode> {
        let mut out = Vec::with_capacity(limits.nodes.min(1024));
        if limits.nodes == 0 || limits.depth == 0 || limits.branch == 0 {
            return out;
        }
        let mut heap = BinaryHeap::new();
        let mut seq = 0u64;
        heap.push(Candidate {
            reach: self.plan_value(1, 0, explore),
            seq,
            depth: 1,
            rank: 0,
            parent: None,
            parent_reach: 1.0,
        });
        while out.len() < limits.nodes {
            let Some(c) = heap.pop() else { break };
            let index = out.len();
            out.push(PlannedNode {
                depth: c.depth,
                rank: c.rank,
                parent: c.parent,
                reach: c.reach,
            });
            if c.rank + 1 < limits.branch {
                seq += 1;
                heap.push(Candidate {
                    reach: c.parent_reach * self.plan_value(c.depth, c.rank + 1, explore),
                    seq,
                    depth: c.depth,
                    rank: c.rank + 1,
                    parent: c.parent,
                    parent_reach: c.parent_reach,
                });
            }
            if c.depth < limits.depth {
                seq += 1;
                heap.push(Candidate {
                    reach: c.reach * self.plan_value(c.depth + 1, 0, explore),
                    seq,
                    depth: c.depth + 1,
                    rank: 0,
                    parent: Some(index),
                    parent_reach: c.reach,
                });
            }
        }
        out
    }

    /// The node budget and shape to ask for this step (the cost-aware tree-shape policy, see
    /// [`AdaptiveConfig`]): within `limits` (the node budget, the depth, capped here by
    /// `cfg.max_draft`, and the branching limit), the tree of the `n` highest reach
    /// probabilities ([`AdaptiveState::plan_tree`]) for the `n` that maximises
    /// `E(n) / (t(n + 1) + n * t_propose)`. Returns its node count, depth and largest number
    /// of children; `nodes == 0` is a plain decoding step. The first step ever plans a tree of
    /// `depth` nodes and the next is a plain step (to measure two points of the cost curve, as
    /// the chain policy does); while plain
    /// decoding wins, every probe interval (doubling after each failed probe, as for chains)
    /// asks for the planned tree of `cfg.probe_draft` nodes.
    pub fn choose_tree(&mut self, cfg: &AdaptiveConfig, limits: TreeShape) -> TreeShape {
        let limits = TreeShape {
            depth: limits.depth.min(cfg.max_draft),
            ..limits
        };
        let shape = self.choose_tree_inner(cfg, limits);
        self.last_shape = Some(shape);
        self.pending = Some(shape);
        shape
    }

    fn choose_tree_inner(&mut self, cfg: &AdaptiveConfig, limits: TreeShape) -> TreeShape {
        let plan = self.plan_tree(limits);
        if plan.is_empty() {
            return TreeShape::default();
        }
        // Warm-up, as the chain policy's: a forward over the planned tree of `depth` nodes
        // (a chain's worth of rows), then a single-row forward; larger trees are extrapolated
        // until they are measured.
        if self.steps == 0 && self.row_samples.iter().all(|r| r.median().is_none()) {
            return shape_of(&plan[..limits.depth.min(plan.len())]);
        }
        if self.cost_at(1).is_none() {
            return TreeShape::default();
        }
        let curve = RobustCurve::fit(&self.row_samples, self.steps);
        let best = self.best_size(&plan, &curve);
        if best == 0 && self.cannot_pay(plan.len(), |n| curve.at(n)) {
            return if self.ceiling_probe(cfg) {
                shape_of(&plan[..cfg.probe_draft.min(plan.len())])
            } else {
                TreeShape::default()
            };
        }
        if self.probe_now(cfg, best == 0) {
            return shape_of(&plan[..cfg.probe_draft.min(plan.len())]);
        }
        if best == 0 {
            return TreeShape::default();
        }
        // While speculating, every `probe_interval`-th step explores: it plans with every
        // estimate raised to at least its rank's prior, so that a depth or sibling rank judged
        // too early (a few unlucky steps) is tested again.
        self.explore_run += 1;
        if self.explore_run >= cfg.probe_interval {
            self.explore_run = 0;
            let plan = self.plan(limits, true);
            return shape_of(&plan[..self.best_size(&plan, &curve)]);
        }
        shape_of(&plan[..best])
    }

    /// The `n` in `0..=plan.len()` that maximises `E(n) / (t(n + 1) + P(n))`, with `t` the
    /// fitted forward cost curve `curve` ([`AdaptiveState::tree_forward_cost`]) and `P` the
    /// proposing time of `n` nodes ([`AdaptiveState::propose_cost`]).
    fn best_size(&self, plan: &[PlannedNode], curve: &RobustCurve) -> usize {
        let mut best = (0usize, f64::NEG_INFINITY);
        let mut e = 1.0;
        for n in 0..=plan.len() {
            if n > 0 {
                e += plan[n - 1].reach;
            }
            let t = curve.at(n + 1).unwrap_or(f64::INFINITY) + self.propose_cost(n);
            let rate = e / t;
            if rate > best.1 {
                best = (n, rate);
            }
        }
        best.0
    }

    /// The shape the last [`AdaptiveState::choose_tree`] returned (`None` before the first).
    pub fn last_tree_shape(&self) -> Option<TreeShape> {
        self.last_shape
    }

    /// Starts a generation: the probe interval, the run of plain steps and the request's probe
    /// budget start over; the acceptance and cost estimates are kept. Called by the generator
    /// at each new generation.
    pub fn begin_generation(&mut self) {
        self.request_since_probe = 0.0;
        self.zero_run = 0;
        self.wait = 0;
        self.pending = None;
        self.drafted_this_generation = false;
    }

    fn cost_at(&self, n: usize) -> Option<f64> {
        self.row_samples.get(n).and_then(RowSamples::median)
    }

    /// Records one step: `k` drafts verified, `accepted` accepted, forward over `k + 1` tokens
    /// took `forward_secs`, proposing took `propose_secs` (learnt from the second drafting step
    /// of a generation on: the first includes a draft model's catch-up with the prompt). Also
    /// teaches the tree policy's rank-0
    /// estimates ([`AdaptiveState::tree_acceptance`]).
    pub fn observe(
        &mut self,
        cfg: &AdaptiveConfig,
        k: usize,
        accepted: usize,
        forward_secs: f64,
        propose_secs: f64,
    ) {
        self.observe_chain(cfg, k, accepted, Some(forward_secs), propose_secs);
    }

    /// [`AdaptiveState::observe`], with the forward's cost learnt only when `forward_secs` is
    /// given (a fused step's forward, which also fed prompt tokens, teaches acceptance only).
    pub(crate) fn observe_chain(
        &mut self,
        cfg: &AdaptiveConfig,
        k: usize,
        accepted: usize,
        forward_secs: Option<f64>,
        propose_secs: f64,
    ) {
        // A chain tests every position up to the first rejection.
        let reached = (accepted + 1).min(k);
        self.record(cfg, k, accepted, reached, forward_secs, propose_secs);
        for i in 0..reached {
            self.tree_count(cfg, i + 1, 0, i < accepted);
        }
    }

    /// Records one replay of `rows` tokens after a rejection (snapshot mode) that took
    /// `seconds` (restoring the state and the forward over the replayed tokens). The replay is
    /// priced apart from the step's forward ([`AdaptiveState::expected_replay`], from the
    /// acceptance estimates), so one replaying step does not inflate the forward cost of its
    /// draft length for later steps. `rows == 0` and non-finite or negative times are ignored.
    pub fn observe_replay(&mut self, cfg: &AdaptiveConfig, rows: usize, seconds: f64) {
        if rows == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        if self.replay_cost.len() <= rows {
            self.replay_cost.resize(rows + 1, None);
        }
        let w = cfg.time_smoothing;
        self.replay_cost[rows] = Some(match self.replay_cost[rows] {
            Some(c) => (1.0 - w) * c + w * seconds,
            None => seconds,
        });
    }

    /// Records one tree step chosen with depth `depth` (the `k` that [`AdaptiveState::choose`]
    /// returned): `accepted` nodes on the accepted path, `tested_next` when the walk stopped at
    /// a node with children (the next depth was tested and rejected; a path that ends at a leaf
    /// tests nothing more), the tree forward took `forward_secs` (kept as the cost of depth
    /// `depth`), proposing took `propose_secs`.
    ///
    /// This is the depth-only record of the chain policy applied to trees; the generator now
    /// records tree steps with [`AdaptiveState::observe_draft`] (by rows, depth and rank). Do
    /// not mix the two on one state: this one files a tree's cost under `depth + 1` rows.
    pub fn observe_tree(
        &mut self,
        cfg: &AdaptiveConfig,
        depth: usize,
        accepted: usize,
        tested_next: bool,
        forward_secs: f64,
        propose_secs: f64,
    ) {
        let reached = (accepted + tested_next as usize).min(depth);
        self.record(
            cfg,
            depth,
            accepted,
            reached,
            Some(forward_secs),
            propose_secs,
        );
    }

    /// Records one step of any shape for the tree policy: the verified draft `block` (a chain
    /// or a tree of `n` nodes, `n = 0` for a plain step), the node indices of its accepted path
    /// `path` (`[accepted]`, the root's child first, as
    /// [`StepOutput::path`](crate::verify::StepOutput::path)), the forward over its `n + 1`
    /// rows took `forward_secs`, proposing took `propose_secs`.
    ///
    /// Every child of a reached node (the root and each node of the path) counts as tested at
    /// its depth and sibling rank, the one on the path as accepted; the forward time is filed
    /// under `n + 1` rows; the ranks the last [`AdaptiveState::choose_tree`] planned count as
    /// offered, and as filled when the draft holds a node of that rank. A chain also teaches
    /// the chain policy, exactly as [`AdaptiveState::observe`]. A path that does not follow the
    /// block (not a child of the previous node) is read up to its first wrong node.
    pub fn observe_draft(
        &mut self,
        cfg: &AdaptiveConfig,
        block: &DraftBlock<'_>,
        path: &[u32],
        forward_secs: f64,
        propose_secs: f64,
    ) {
        let n = block.len();
        let requested = self.pending.take();
        let accepted = accepted_prefix(block, path);
        if block.is_chain() {
            self.observe(cfg, n, accepted, forward_secs, propose_secs);
        } else {
            self.record(cfg, n, 0, 0, Some(forward_secs), propose_secs);
            self.count_reached_children(cfg, block, &path[..accepted]);
        }
        if let Some(req) = requested
            && n > 0
            && req.branch > 1
        {
            self.count_filled_ranks(cfg, block, req.branch);
        }
    }

    /// Counts every child of the root and of each node of `path` (a path of `block` from the
    /// root) as tested at its depth and sibling rank, the one on the path as accepted.
    fn count_reached_children(
        &mut self,
        cfg: &AdaptiveConfig,
        block: &DraftBlock<'_>,
        path: &[u32],
    ) {
        let mut row = 0;
        for depth in 1..=path.len() + 1 {
            let next = path.get(depth - 1).map(|&j| j as usize);
            for (rank, c) in block.children(row).enumerate() {
                self.tree_count(cfg, depth, rank, Some(c) == next);
            }
            match next {
                Some(j) => row = j + 1,
                None => break,
            }
        }
    }

    /// Counts the sibling ranks `1..branch` the last plan asked for as offered, and as filled
    /// when `block` holds a node of that rank.
    fn count_filled_ranks(&mut self, cfg: &AdaptiveConfig, block: &DraftBlock<'_>, branch: usize) {
        let max_rank = max_sibling_rank(block);
        if self.offered.len() < branch {
            self.offered.resize(branch, 0.0);
            self.filled.resize(branch, 0.0);
        }
        for r in 1..branch {
            count(
                &mut self.filled[r],
                &mut self.offered[r],
                cfg.decay,
                max_rank >= r,
            );
        }
    }

    /// One test of the rank-`rank` child at `depth` (>= 1).
    fn tree_count(&mut self, cfg: &AdaptiveConfig, depth: usize, rank: usize, accepted: bool) {
        if self.tree_acc.len() < depth {
            self.tree_acc.resize(depth, Vec::new());
            self.tree_seen.resize(depth, Vec::new());
        }
        let (a, s) = (
            &mut self.tree_acc[depth - 1],
            &mut self.tree_seen[depth - 1],
        );
        if a.len() <= rank {
            a.resize(rank + 1, 0.0);
            s.resize(rank + 1, 0.0);
        }
        count(&mut a[rank], &mut s[rank], cfg.decay, accepted);
    }

    fn record(
        &mut self,
        cfg: &AdaptiveConfig,
        k: usize,
        accepted: usize,
        reached: usize,
        forward_secs: Option<f64>,
        propose_secs: f64,
    ) {
        self.steps += 1;
        if k == 0 {
            self.plain_at = self.steps;
        }
        self.price_probe(k, forward_secs, propose_secs);
        let remeasure = std::mem::take(&mut self.remeasure) && k == 0;
        // A fused step's forward also fed prompt tokens: its time is no cost of `k + 1` rows.
        if let Some(forward_secs) = forward_secs {
            let n = k + 1;
            if self.row_samples.len() <= n {
                self.row_samples.resize(n + 1, RowSamples::default());
            }
            // A re-measure below the median says the samples are from a slow moment; one
            // above it is one more sample (timing noise only ever adds time).
            let samples = &mut self.row_samples[n];
            if remeasure && samples.median().is_some_and(|m| forward_secs < m) {
                samples.reset_to(forward_secs, self.steps);
            } else {
                samples.push(forward_secs, self.steps);
            }
        }
        // The first drafting step of a generation is not a sample of the proposing time: a
        // draft model catches up with the whole prompt there (a prefill, paid once per
        // request), which would price every later draft token as a prompt's worth.
        let first = k > 0 && !std::mem::replace(&mut self.drafted_this_generation, true);
        if k > 0 && !first {
            // The median of the last samples, not a moving average: one step that asked a
            // costly member of a merge (its probe, with a catch-up over the tokens since it
            // was last asked) would otherwise price every later draft token at a share of it,
            // and the policy would stop drafting with the merge's free members too.
            if self.propose_by_len.len() <= k {
                self.propose_by_len.resize(k + 1, RowSamples::default());
            }
            self.propose_by_len[k].push(propose_secs, self.steps);
        }
        if self.acc.len() < k && reached > 0 {
            self.acc.resize(k, 0.0);
            self.seen.resize(k, 0.0);
        }
        for i in 0..reached {
            count(&mut self.acc[i], &mut self.seen[i], cfg.decay, i < accepted);
        }
        // In a step that speculated, the positions it did not test forget at the same rate,
        // so an estimate that no longer gets tested (a longer draft than the policy now
        // chooses) fades back to its prior, the estimate of the position before it, and is
        // tried again. Plain steps leave them alone: there the probes decide.
        let untested = if k > 0 { reached..self.acc.len() } else { 0..0 };
        for i in untested {
            self.acc[i] *= cfg.decay;
            self.seen[i] *= cfg.decay;
        }
    }
}

/// Expected tokens of a chain step whose positions have the values `p`:
/// `1 + sum_j prod_{i<=j} p_i`.
fn tokens_of(p: &[f64]) -> f64 {
    let (mut e, mut prod) = (1.0, 1.0);
    for &p in p {
        prod *= p;
        e += prod;
    }
    e
}

/// The shape of a planned tree (or of its first nodes).
fn shape_of(plan: &[PlannedNode]) -> TreeShape {
    TreeShape {
        nodes: plan.len(),
        depth: plan.iter().map(|p| p.depth).max().unwrap_or(0),
        branch: plan.iter().map(|p| p.rank + 1).max().unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_zero_when_speculation_cannot_pay() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        // Forward cost linear in n (no batching benefit) and nothing accepted.
        for _ in 0..50 {
            let k = s.choose(&cfg, 100);
            s.observe(&cfg, k, 0, 0.01 * (k + 1) as f64, 0.0);
        }
        assert_eq!(s.choose(&cfg, 100), 0);
    }

    /// Steps of `k > 0` a state chooses in `gens` generations of `steps` steps, every draft
    /// accepted, on the cost curve `c`.
    fn speculative_steps(
        s: &mut AdaptiveState,
        cfg: &AdaptiveConfig,
        c: impl Fn(usize) -> f64,
        gens: usize,
        steps: usize,
    ) -> Vec<usize> {
        let mut out = Vec::new();
        for _ in 0..gens {
            s.begin_generation();
            let mut n = 0;
            for _ in 0..steps {
                let k = s.choose(cfg, 100);
                n += (k > 0) as usize;
                s.observe(cfg, k, k, c(k + 1), 0.0);
            }
            out.push(n);
        }
        out
    }

    #[test]
    fn a_curve_on_which_no_draft_pays_is_probed_once_per_max_interval() {
        let cfg = AdaptiveConfig::default();
        // Each extra row costs three single steps: even a fully accepted draft loses.
        let c = |n: usize| 0.01 * (1 + 3 * (n - 1)) as f64;
        let mut s = AdaptiveState::default();
        let steps = speculative_steps(&mut s, &cfg, c, 30, 20);
        assert!(s.cannot_pay(8, |n| s.forward_cost(n)));
        // The warm-up, then a probe every 256 plain steps across generations (600 steps: 2),
        // not one 16 steps into each generation.
        let later: usize = steps[1..].iter().sum();
        assert!(later <= 3, "{steps:?}");
        // The same curve with a free draft row: full acceptance pays, probes follow the
        // acceptance schedule (one per generation here) and speculation comes back.
        let cheap = |n: usize| 0.01 + 0.0001 * (n - 1) as f64;
        let mut s = AdaptiveState::default();
        let steps = speculative_steps(&mut s, &cfg, cheap, 5, 20);
        assert!(!s.cannot_pay(8, |n| s.forward_cost(n)));
        assert!(steps[1..].iter().all(|&n| n >= 15), "{steps:?}");
    }

    #[test]
    fn the_proposing_time_counts_against_a_draft_that_could_pay() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        // c(n) = 1 + 0.5 (n - 1) single steps: free drafts pay, drafts that cost a step each
        // cannot.
        let c = |n: usize| 0.01 + 0.005 * (n - 1) as f64;
        s.observe(&cfg, 0, 0, c(1), 0.0);
        s.observe(&cfg, 4, 4, c(5), 0.0);
        assert!(!s.cannot_pay(4, |n| s.forward_cost(n)));
        for _ in 0..31 {
            s.observe(&cfg, 4, 4, c(5), 0.04);
        }
        assert!(s.cannot_pay(4, |n| s.forward_cost(n)));
    }

    #[test]
    fn the_first_drafting_step_of_a_generation_is_not_a_proposing_time_sample() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        let c = |n: usize| 0.01 + 0.001 * (n - 1) as f64;
        s.observe(&cfg, 0, 0, c(1), 0.0);
        for g in 0..3 {
            s.begin_generation();
            // A draft model's first proposal catches up with a 300-token prompt (0.3 s), the
            // later ones cost 1 ms a token.
            s.observe(&cfg, 4, 4, c(5), 0.3);
            s.observe(&cfg, 4, 4, c(5), 0.004);
            assert!((s.propose_cost(4) - 0.004).abs() < 1e-12, "generation {g}");
        }
        assert!(!s.cannot_pay(4, |n| s.forward_cost(n)));
    }

    /// Probes of a draft model on a CPU engine in 40 requests of `tokens` tokens, the costs
    /// carried from one to the next: verifying 3 rows costs 3.8 plain steps, and a probe's
    /// proposing pays a catch-up with the prompt and every token since (0.1 s, 10 steps).
    /// Counts the probes after the first one, which has no earlier probe to be priced from
    /// (nor the warm-up before it, whose proposer ran with nothing learned yet: a merge then
    /// asks every member, its costly ones too), and returns their number, their share of all
    /// the time and the largest share of one request's time.
    fn simulate_probes(cfg: &AdaptiveConfig, tokens: usize) -> (usize, f64, f64) {
        let c = |n: usize| 0.01 * if n == 1 { 1.0 } else { 3.8 + (n - 3) as f64 };
        let mut s = AdaptiveState::default();
        let (mut probes, mut first, mut worst) = (0, 2, 0.0f64);
        let (mut all_secs, mut all_probe_secs) = (0.0, 0.0);
        for _ in 0..40 {
            let mut g = s.costs_only();
            g.begin_generation();
            let (mut secs, mut probe_secs) = (0.0, 0.0);
            for _ in 0..tokens {
                let k = g.choose(cfg, 8);
                let propose = if k > 0 { 0.1 } else { 0.0 };
                if k > 0 && first > 0 {
                    first -= 1;
                } else if k > 0 {
                    probes += 1;
                    probe_secs += propose + c(k + 1) - c(1);
                }
                secs += propose + c(k + 1);
                g.observe(cfg, k, 0, c(k + 1), propose);
            }
            worst = worst.max(probe_secs / secs);
            all_secs += secs;
            all_probe_secs += probe_secs;
            s = g;
        }
        (probes, all_probe_secs / all_secs, worst)
    }

    #[test]
    fn probes_cost_at_most_the_probe_budget_across_generations() {
        let probes = |budget: f64| {
            // The budget across generations alone (the request's budget: the test below).
            let cfg = AdaptiveConfig::default()
                .with_probe_budget(budget)
                .with_request_probe_budget(1.0);
            let (n, share, _) = simulate_probes(&cfg, 64);
            (n, share)
        };
        let (n, share) = probes(0.02);
        assert!(share <= 0.02, "{n} probes cost {share}");
        assert!(n >= 2, "it still probes: {n}");
        // Negative control: without the budget the probes cost several times more.
        let (m, loose) = probes(1.0);
        assert!(m > 2 * n && loose > 2.0 * share, "{m} probes cost {loose}");
        assert!(
            AdaptiveConfig::default()
                .with_probe_budget(0.0)
                .validate()
                .is_err()
        );
        assert!(
            AdaptiveConfig::default()
                .with_probe_budget(1.5)
                .validate()
                .is_err()
        );
    }

    #[test]
    fn no_request_pays_more_than_the_request_probe_budget() {
        // A probe costs 0.128 s: 20 % of a 64-token request (0.64 s), 1.3 % of a 1000-token
        // one.
        let cfg = AdaptiveConfig::default();
        let (n, _, worst) = simulate_probes(&cfg, 64);
        assert_eq!(n, 0, "no probe fits a short request ({worst})");
        let (n, _, worst) = simulate_probes(&cfg, 1000);
        assert!(
            n >= 2 && worst <= 0.02 + 1e-9,
            "{n} probes, worst request {worst}"
        );
        // Negative control: with the budget across requests alone, a short request that gets
        // a probe loses a fifth of its time.
        let loose = cfg.clone().with_request_probe_budget(1.0);
        let (m, _, worst) = simulate_probes(&loose, 64);
        assert!(m >= 2 && worst > 0.1, "{m} probes, worst request {worst}");
        for bad in [0.0, 1.5, f64::NAN] {
            assert!(
                cfg.clone()
                    .with_request_probe_budget(bad)
                    .validate()
                    .is_err()
            );
        }
    }

    #[test]
    fn a_stale_single_row_cost_is_measured_again_while_speculating() {
        // c(1) was measured in a slow moment (45 ms); the machine is back at 22 ms a plain
        // step, 40 ms for 2 rows, and the draft costs 18 ms a token, accepted 88 %: k = 1
        // makes 1.88 tokens in 58 ms (32/s) against 45/s plain. With the stale c(1) it looks
        // like 1.88 in 58 against 1 in 45 ms: it pays, and no plain step would say otherwise.
        let cfg = AdaptiveConfig::default().with_max_draft(1);
        let mut s = AdaptiveState::default();
        s.observe(&cfg, 1, 1, 0.040, 0.018);
        s.observe(&cfg, 0, 0, 0.045, 0.0);
        let mut ks = Vec::new();
        for i in 0..200 {
            let k = s.choose(&cfg, 1);
            ks.push(k);
            let c = if k == 0 { 0.022 } else { 0.040 };
            s.observe(
                &cfg,
                k,
                usize::from(k > 0 && i % 25 != 0),
                c,
                0.018 * k as f64,
            );
        }
        let first_plain = ks.iter().position(|&k| k == 0).unwrap();
        assert!(first_plain <= 64, "{ks:?}");
        assert!((s.forward_cost(1).unwrap() - 0.022).abs() < 1e-9);
        // After it, plain decoding but for probes.
        let drafted = ks[first_plain..].iter().filter(|&&k| k > 0).count();
        assert!(
            drafted <= 12,
            "{drafted} drafting steps after the re-measure: {ks:?}"
        );
        // Negative control: the step before the re-measure, every step speculated.
        assert!(ks[..first_plain].iter().all(|&k| k == 1));
    }

    #[test]
    fn a_rare_costly_proposing_step_does_not_price_every_draft_token() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        let c = |n: usize| 0.01 + 0.001 * (n - 1) as f64;
        s.observe(&cfg, 0, 0, c(1), 0.0);
        s.begin_generation();
        s.observe(&cfg, 4, 4, c(5), 0.3);
        for i in 0..20 {
            // A merge of free members (0.1 ms a token) that asks a draft model on one step of
            // ten (0.1 s: its catch-up and forwards).
            let secs = if i % 10 == 9 { 0.1 } else { 0.0004 };
            s.observe(&cfg, 4, 4, c(5), secs);
            assert!((s.propose_cost(4) - 0.0004).abs() < 1e-12, "step {i}");
            // Fully accepted drafts of 4 at 1.4 ms of verify more than a plain step pay.
            assert_eq!(s.choose(&cfg, 4), 4, "step {i}");
        }
        // Negative control: a proposer that is costly on most steps is priced so.
        for _ in 0..4 {
            s.observe(&cfg, 4, 4, c(5), 0.1);
        }
        assert!((s.propose_cost(4) - 0.1).abs() < 1e-12);
        assert!(s.cannot_pay(4, |n| s.forward_cost(n)));
    }

    #[test]
    fn costs_only_keeps_the_curve_and_forgets_acceptance() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        for _ in 0..40 {
            let k = s.choose(&cfg, 100);
            s.observe(&cfg, k, 0, 0.01 * (k + 1) as f64, 0.001 * k as f64);
        }
        assert!(s.acceptance(0) < 0.5);
        let c = s.costs_only();
        assert_eq!(c.acceptance(0), 0.5);
        for n in [1, 3, 9] {
            assert_eq!(c.forward_cost(n), s.forward_cost(n));
            assert_eq!(c.tree_forward_cost(n), s.tree_forward_cost(n));
        }
        // A fresh state's first step is the warm-up at max_draft; this one's is not.
        let mut fresh = AdaptiveState::default();
        assert_eq!(fresh.choose(&cfg, 100), cfg.max_draft);
        let mut c = c;
        assert_eq!(c.choose(&cfg, 100), 0);
    }

    #[test]
    fn picks_long_drafts_when_all_accepted_and_verify_is_cheap() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        for _ in 0..50 {
            let k = s.choose(&cfg, 100);
            s.observe(&cfg, k, k, 0.01 + 0.0005 * k as f64, 0.0);
        }
        assert_eq!(s.choose(&cfg, 100), cfg.max_draft);
        assert_eq!(s.choose(&cfg, 3), 3);
    }

    /// A deterministic acceptance pattern: draft position `i` of step `t` is accepted unless
    /// `(7 t + 3 i) % 20 == 0` (about 95 % per position).
    fn accepted_of(t: usize, k: usize) -> usize {
        (0..k)
            .take_while(|i| !(7 * t + 3 * i).is_multiple_of(20))
            .count()
    }

    #[test]
    fn a_replay_is_priced_apart_from_the_forward_of_its_draft_length() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        let c = |n: usize| 0.010 + 0.002 * n as f64;
        // Warm-up at k = 8 rejected at position 1: a replay of 2 tokens.
        let k = s.choose(&cfg, 100);
        assert_eq!(k, 8);
        s.observe(&cfg, k, 1, c(k + 1), 0.0);
        s.observe_replay(&cfg, 2, c(2));
        assert_eq!(
            s.forward_cost(9),
            Some(c(9)),
            "the replay is not filed under 9 rows"
        );
        assert_eq!(s.replay_cost(2), Some(c(2)));
        // One measured replay length: the others follow the forward curve's slope.
        s.observe(&cfg, 0, 0, c(1), 0.0);
        assert!((s.replay_cost(4).unwrap() - c(4)).abs() < 1e-12);
        // The expected replay of k drafts is the chance of a rejection at each position times
        // the replay of the tokens before it: zero for k = 0, growing with k.
        assert_eq!(s.expected_replay(0), 0.0);
        let p0 = s.acceptance(0);
        assert!((s.expected_replay(1) - (1.0 - p0) * c(1)).abs() < 1e-12);
        assert!(s.expected_replay(4) > s.expected_replay(1));
        // With drafts right about 95 % of the time the policy settles on long drafts.
        let mut ks = Vec::new();
        for t in 0..300 {
            let k = s.choose(&cfg, 100);
            let a = accepted_of(t, k);
            s.observe(&cfg, k, a, c(k + 1), 0.0);
            if a < k {
                s.observe_replay(&cfg, a + 1, c(a + 1));
            }
            ks.push(k);
        }
        let mean = ks[200..].iter().sum::<usize>() as f64 / 100.0;
        assert!(mean >= 4.0, "mean k {mean}");
    }

    #[test]
    fn an_early_rejection_does_not_hold_a_position_down_for_good() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        // A steep curve: a draft row costs as much as the step's fixed part.
        let c = |n: usize| 0.010 + 0.010 * n as f64;
        let mut ks = Vec::new();
        for t in 0..300 {
            let k = s.choose(&cfg, 100);
            // The warm-up draft is rejected at position 1; later drafts are right ~95 %.
            let a = if t == 0 { 1 } else { accepted_of(t, k) };
            s.observe(&cfg, k, a, c(k + 1), 0.0);
            ks.push(k);
        }
        // At 95 % per position the best fixed k on this curve is 3-5; the policy gets there
        // instead of staying at k = 1 behind the one rejection at position 1.
        let mean = ks[200..].iter().sum::<usize>() as f64 / 100.0;
        assert!(mean >= 2.5, "mean k {mean}: {:?}", &ks[..40]);
    }

    #[test]
    fn probes_after_a_run_of_plain_steps() {
        let cfg = AdaptiveConfig {
            probe_interval: 4,
            max_probe_interval: 4,
            // The intervals alone (a probe here costs 2 plain steps: the default budget
            // would space them 100 steps apart; see the probe-budget test).
            probe_budget: 1.0,
            request_probe_budget: 1.0,
            ..Default::default()
        };
        let mut s = AdaptiveState::default();
        let mut ks = Vec::new();
        for _ in 0..40 {
            let k = s.choose(&cfg, 100);
            ks.push(k);
            s.observe(&cfg, k, 0, 0.01 * (k + 1) as f64, 0.0);
        }
        assert!(ks[10..].iter().filter(|&&k| k == cfg.probe_draft).count() >= 5);
    }

    #[test]
    fn failed_probes_back_off_exponentially_and_success_resets_the_wait() {
        let cfg = AdaptiveConfig {
            probe_interval: 4,
            max_probe_interval: 64,
            // The intervals alone (a probe here costs 2 plain steps: the default budget
            // would space them 100 steps apart; see the probe-budget test).
            probe_budget: 1.0,
            request_probe_budget: 1.0,
            ..Default::default()
        };
        let mut s = AdaptiveState::default();
        let mut probes = Vec::new();
        for step in 0..1000 {
            let k = s.choose(&cfg, 100);
            if step > 0 && k > 0 {
                probes.push(step);
            }
            // Nearly linear in rows, yet a fully accepted draft would pay (slightly), so the
            // acceptance schedule applies ([`AdaptiveState::cannot_pay`] is false).
            s.observe(&cfg, k, 0, 0.0001 + 0.0099 * (k + 1) as f64, 0.0);
        }
        assert!(!s.cannot_pay(8, |n| s.forward_cost(n)));
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        // After the first probe the interval doubles: 8, 16, 32, then 64 steps for good.
        assert_eq!(&gaps[..4], &[8, 16, 32, 64], "gaps {gaps:?}");
        assert!(gaps[4..].iter().all(|&g| g == 64), "gaps {gaps:?}");
        assert_eq!(s.wait, 64);
        // Once drafts are accepted and verifying 3 tokens is cheap, speculation comes back and
        // the interval starts over.
        for _ in 0..200 {
            s.observe(&cfg, 2, 2, 0.0101, 0.0);
        }
        // A plain step (the policy re-measures c(1) every 64 speculating steps).
        s.observe(&cfg, 0, 0, 0.01, 0.0);
        assert!(s.choose(&cfg, 100) > 0);
        assert_eq!(s.wait, cfg.probe_interval);
        s.begin_generation();
        assert_eq!(s.wait, 0);
        // A maximum below the initial interval means a fixed interval, not an error.
        assert!(
            AdaptiveConfig {
                max_probe_interval: 3,
                ..cfg
            }
            .validate()
            .is_ok()
        );
    }

    /// A state that measured `curve` (rows, relative cost) in units of 25 ms and whose tree
    /// estimates are `rate(depth, rank)` for depths `1..=16` and ranks `0..4` (from 1000
    /// observations each, so the prior hardly counts).
    fn synthetic(curve: &[(usize, f64)], rate: impl Fn(usize, usize) -> f64) -> AdaptiveState {
        let mut s = AdaptiveState {
            steps: 100,
            ..Default::default()
        };
        for &(n, c) in curve {
            if s.row_samples.len() <= n {
                s.row_samples.resize(n + 1, RowSamples::default());
            }
            for _ in 0..RowSamples::CAP {
                s.row_samples[n].push(0.025 * c, 100);
            }
        }
        for d in 1..=16 {
            s.tree_acc
                .push((0..4).map(|r| 1000.0 * rate(d, r)).collect());
            s.tree_seen.push(vec![1000.0; 4]);
        }
        s
    }

    /// The cost curve of SmolLM2-135M's fast forward measured for issue 12 (rows, cost relative
    /// to one row).
    const MEASURED: [(usize, f64); 5] = [(1, 1.0), (9, 1.5), (17, 2.5), (33, 4.9), (65, 9.3)];

    fn tree_cfg() -> AdaptiveConfig {
        AdaptiveConfig {
            max_draft: 16,
            ..Default::default()
        }
    }

    const WIDE: TreeShape = TreeShape {
        nodes: 64,
        depth: 64,
        branch: usize::MAX,
    };

    #[test]
    fn the_tree_policy_picks_8_to_16_nodes_on_the_measured_curve() {
        let cfg = tree_cfg();
        // High acceptance: rank 0 is right 90% of the time, rank 1 catches a third of the rest.
        let mut s = synthetic(&MEASURED, |_, r| [0.9, 0.03, 0.0, 0.0][r]);
        let shape = s.choose_tree(&cfg, WIDE);
        assert!((8..=16).contains(&shape.nodes), "{shape:?}");
        assert_eq!(s.last_tree_shape(), Some(shape));
        // More rank-1 acceptance makes it branch.
        let mut s = synthetic(&MEASURED, |_, r| [0.6, 0.3, 0.05, 0.0][r]);
        let shape = s.choose_tree(&cfg, WIDE);
        assert!((4..=16).contains(&shape.nodes), "{shape:?}");
        assert!(shape.branch >= 2, "{shape:?}");
        // Whatever the acceptance, 64 nodes never pay on this curve.
        for a in [0.5, 0.8, 0.95, 0.99, 1.0] {
            let mut s = synthetic(&MEASURED, |_, r| if r == 0 { a } else { 0.0 });
            let shape = s.choose_tree(&cfg, WIDE);
            assert!(shape.nodes <= 16, "a = {a}: {shape:?}");
        }
        // A flat curve with everything accepted uses the whole budget.
        let mut s = synthetic(
            &[(1, 1.0), (65, 1.01)],
            |_, r| if r == 0 { 1.0 } else { 0.0 },
        );
        let shape = s.choose_tree(&cfg, WIDE);
        assert_eq!(shape.nodes, 16, "depth-limited chain: {shape:?}");
        assert_eq!(shape.branch, 1);
    }

    #[test]
    fn the_tree_policy_picks_a_chain_when_only_rank_0_is_accepted() {
        let cfg = tree_cfg();
        let mut s = synthetic(&MEASURED, |_, r| if r == 0 { 0.8 } else { 0.0 });
        let shape = s.choose_tree(&cfg, WIDE);
        assert_eq!(shape.branch, 1, "{shape:?}");
        assert_eq!(shape.nodes, shape.depth);
        assert!(shape.nodes >= 4, "{shape:?}");
    }

    #[test]
    fn the_tree_policy_decodes_plainly_when_nothing_is_accepted_and_respects_limits() {
        let cfg = tree_cfg();
        let mut s = synthetic(&MEASURED, |_, _| 0.01);
        assert_eq!(s.choose_tree(&cfg, WIDE).nodes, 0);
        // Limits: nodes, depth (also max_draft), branching.
        let mut s = synthetic(&[(1, 1.0), (65, 1.01)], |_, r| [0.99, 0.9, 0.9, 0.9][r]);
        for (nodes, depth, branch) in [(5, 64, 64), (64, 3, 64), (64, 64, 2), (7, 2, 3), (1, 1, 1)]
        {
            let limits = TreeShape {
                nodes,
                depth,
                branch,
            };
            let shape = s.choose_tree(&cfg, limits);
            assert!(
                shape.nodes <= nodes && shape.nodes > 0,
                "{limits:?} {shape:?}"
            );
            assert!(
                shape.depth <= depth.min(cfg.max_draft),
                "{limits:?} {shape:?}"
            );
            assert!(shape.branch <= branch, "{limits:?} {shape:?}");
        }
        for limits in [
            TreeShape { nodes: 0, ..WIDE },
            TreeShape { depth: 0, ..WIDE },
            TreeShape { branch: 0, ..WIDE },
        ] {
            assert_eq!(s.choose_tree(&cfg, limits), TreeShape::default());
        }
        let cfg0 = AdaptiveConfig {
            max_draft: 0,
            ..cfg
        };
        assert_eq!(s.choose_tree(&cfg0, WIDE), TreeShape::default());
    }

    /// The best value of a forest of `n` nodes below a node of reach `reach` at depth `d - 1`,
    /// by exhaustive search over the ordered trees (children of rank `0..m`).
    fn brute(
        v: &dyn Fn(usize, usize) -> f64,
        d: usize,
        reach: f64,
        n: usize,
        lim: TreeShape,
    ) -> f64 {
        fn forest(
            v: &dyn Fn(usize, usize) -> f64,
            d: usize,
            reach: f64,
            rank: usize,
            n: usize,
            lim: TreeShape,
        ) -> f64 {
            if n == 0 || d > lim.depth || rank >= lim.branch {
                return if n == 0 { 0.0 } else { f64::NEG_INFINITY };
            }
            // The rank-`rank` child takes `m` nodes (itself and its subtree), later siblings
            // the rest (or none).
            let r = reach * v(d, rank);
            let mut best = f64::NEG_INFINITY;
            for m in 1..=n {
                let sub = forest(v, d + 1, r, 0, m - 1, lim);
                let rest = forest(v, d, reach, rank + 1, n - m, lim);
                best = best.max(r + sub + rest);
            }
            best
        }
        forest(v, d, reach, 0, n, lim)
    }

    #[test]
    fn the_greedy_plan_is_the_best_tree_for_values_that_fall_with_rank() {
        let stream = crate::rng::Stream::new(7);
        for case in 0..40u64 {
            // Values per (depth, rank), non-increasing in rank.
            let mut table = [[0.0f64; 4]; 6];
            for (d, row) in table.iter_mut().enumerate() {
                let mut left = 1.0;
                for (r, x) in row.iter_mut().enumerate() {
                    let u = (stream.bits(case, (d * 4 + r) as u32)[0] >> 8) as f64 / 16_777_216.0;
                    *x = left * u;
                    left = *x;
                }
            }
            let s = synthetic(
                &[(1, 1.0)],
                |d, r| if d <= 6 { table[d - 1][r] } else { 0.0 },
            );
            let v = |d: usize, r: usize| s.tree_value(d, r);
            let lim = TreeShape {
                nodes: 7,
                depth: 1 + (case % 4) as usize,
                branch: 1 + (case % 3) as usize,
            };
            let plan = s.plan_tree(lim);
            let mut e = 0.0;
            for n in 1..=plan.len() {
                e += plan[n - 1].reach;
                let best = brute(&v, 1, 1.0, n, lim);
                assert!(
                    (e - best).abs() < 1e-12,
                    "case {case} n {n}: greedy {e} best {best}"
                );
            }
            // Each planned node's reach is its parent's times its own value.
            for p in &plan {
                let parent = p.parent.map_or(1.0, |i| plan[i].reach);
                assert!((p.reach - parent * v(p.depth, p.rank)).abs() < 1e-15);
            }
        }
    }

    #[test]
    fn observe_draft_counts_every_child_of_a_reached_node() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        // Root children: nodes 0 (rank 0) and 1 (rank 1); node 1's children: 2 (rank 0) and
        // 3 (rank 1); node 0's child 4 is never tested. Path: 1, 3.
        let tokens = [10, 11, 12, 13, 14];
        let parents = [0, 0, 2, 2, 1];
        let block = DraftBlock::tree(&tokens, &parents);
        s.pending = Some(TreeShape {
            nodes: 5,
            depth: 2,
            branch: 3,
        });
        s.observe_draft(&cfg, &block, &[1, 3], 0.01, 0.001);
        assert_eq!(s.tree_seen[0], vec![1.0, 1.0]);
        assert_eq!(s.tree_acc[0], vec![0.0, 1.0]);
        assert_eq!(s.tree_seen[1], vec![1.0, 1.0]);
        assert_eq!(s.tree_acc[1], vec![0.0, 1.0]);
        assert_eq!(
            s.tree_seen.len(),
            2,
            "node 3 is a leaf: nothing tested at depth 3"
        );
        // Rank 1 over all depths: 2 of 2 under a prior of mean 1/4; depth 1 under that.
        assert!((s.rank_acceptance(1) - (2.0 + 0.5) / 4.0).abs() < 1e-12);
        assert!((s.tree_acceptance(1, 1) - (1.0 + 2.0 * 0.625) / 3.0).abs() < 1e-12);
        assert!((s.rank_acceptance(0) - 1.0 / 4.0).abs() < 1e-12);
        assert!((s.tree_acceptance(1, 0) - 0.5 / 3.0).abs() < 1e-12);
        assert!(
            s.tree_value(1, 1) > s.tree_acceptance(1, 1),
            "optimistic value"
        );
        // Rank 1 was offered and filled, rank 2 offered and not.
        assert_eq!(s.tree_fill(1), 1.0);
        assert_eq!(s.tree_fill(2), 0.5);
        assert_eq!(s.tree_forward_cost(6), Some(0.01));
        // The chain policy learned nothing from a tree.
        assert!(s.seen.iter().all(|&x| x == 0.0));
        // A chain teaches both policies: two of three accepted.
        let chain = DraftBlock::chain(&tokens[..3]);
        s.observe_draft(&cfg, &chain, &[0, 1], 0.005, 0.0);
        assert_eq!(&s.seen[..3], &[1.0, 1.0, 1.0]);
        // Each position shrunk toward the one before: 2/3, (1 + 4/3) / 3, (0 + 14/9) / 3.
        assert!((s.acceptance(0) - 2.0 / 3.0).abs() < 1e-12);
        assert!((s.acceptance(1) - 7.0 / 9.0).abs() < 1e-12);
        assert!((s.acceptance(2) - 14.0 / 27.0).abs() < 1e-12);
        assert_eq!(s.tree_seen[2], vec![1.0]);
        // A path that leaves the block is read up to its first wrong node.
        s.observe_draft(&cfg, &block, &[0, 3], 0.01, 0.0);
        // Node 0 was accepted, its child 4 tested (rank 0 at depth 2), node 1's children not.
        assert_eq!(s.tree_seen[1][1], 1.0, "rank 1 at depth 2 was not tested");
        let d = cfg.decay;
        assert!((s.tree_seen[1][0] - ((1.0 * d + 1.0) * d + 1.0)).abs() < 1e-12);
    }

    #[test]
    fn the_tree_policy_warms_up_probes_and_backs_off() {
        let cfg = AdaptiveConfig {
            probe_interval: 4,
            max_probe_interval: 32,
            // The intervals alone (a probe here costs 2 plain steps: the default budget
            // would space them 100 steps apart; see the probe-budget test).
            probe_budget: 1.0,
            request_probe_budget: 1.0,
            ..Default::default()
        };
        let mut s = AdaptiveState::default();
        let limits = TreeShape {
            nodes: 16,
            depth: 100,
            branch: 4,
        };
        let mut probes = Vec::new();
        for step in 0..400 {
            let shape = s.choose_tree(&cfg, limits);
            if step == 0 {
                assert_eq!(
                    shape.nodes, cfg.max_draft,
                    "warm-up: a chain's worth of nodes"
                );
            }
            if step == 1 {
                assert_eq!(shape.nodes, 0, "then a plain step");
            }
            if step > 1 && shape.nodes > 0 {
                probes.push(step);
                assert_eq!(shape.nodes, cfg.probe_draft, "{shape:?}");
            }
            // Every draft rejected, cost nearly linear in rows (a fully accepted draft would
            // pay, slightly): a chain of the shape's depth.
            let tokens = vec![1u32; shape.depth];
            s.observe_draft(
                &cfg,
                &DraftBlock::chain(&tokens),
                &[],
                0.0001 + 0.0099 * (shape.depth + 1) as f64,
                0.0,
            );
        }
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(&gaps[..3], &[8, 16, 32], "gaps {gaps:?}");
        assert!(gaps[3..].iter().all(|&g| g == 32), "gaps {gaps:?}");
        // The chain proposer never drafted a rank-1 node: rank 1 stopped counting.
        assert!(s.tree_fill(1) < 0.2, "{}", s.tree_fill(1));
    }

    /// The SmolLM2 draft on llama.cpp's CPU verify of Gemma 3 270M (2 threads, measured
    /// 2026-12-04): a plain step 14.5 ms, 8.5 ms more per verified row, and a draft of `k`
    /// tokens 8 ms of catch-up plus 8 ms a token, about 95 % of the tokens accepted. Runs `steps`
    /// steps of 64-token requests from `s`; the plain step at index `slow_at` takes 186 ms,
    /// and from then on plain steps take `plain_after` seconds. Returns the drafting steps
    /// and the run's speed-up over plain decoding of as many tokens on the same machine.
    fn simulate_slow_plain_step(
        s: &mut AdaptiveState,
        steps: usize,
        slow_at: usize,
        plain_after: f64,
    ) -> (usize, f64) {
        let cfg = AdaptiveConfig::default().with_max_draft(6);
        let (mut drafted, mut secs, mut tokens, mut left) = (0, 0.0, 0usize, 0usize);
        for i in 0..steps {
            if left == 0 {
                s.begin_generation();
                left = 64;
            }
            let k = s.choose(&cfg, left - 1);
            let accepted = accepted_of(i, k);
            let plain = match i {
                _ if i == slow_at => 0.186,
                _ if i > slow_at => plain_after,
                _ => 0.0145,
            };
            let forward = plain + 0.0085 * k as f64;
            let propose = if k > 0 { 0.008 + 0.008 * k as f64 } else { 0.0 };
            s.observe(&cfg, k, accepted, forward, propose);
            drafted += usize::from(k > 0);
            secs += forward + propose;
            tokens += accepted + 1;
            left = left.saturating_sub(accepted + 1);
        }
        let plain = slow_at as f64 * 0.0145 + 0.186 + (tokens - slow_at - 1) as f64 * plain_after;
        (drafted, plain / secs)
    }

    #[test]
    fn one_slow_plain_step_does_not_make_a_draft_that_cannot_pay_look_paying() {
        // Seen on 2 threads: after a plain step of 186 ms, the moving average of c(1) made a
        // 1-token draft at 40 ms a step look paying, for five requests (0.48-0.78x each).
        let mut s = AdaptiveState::default();
        let (drafted, speedup) = simulate_slow_plain_step(&mut s, 600, 40, 0.0145);
        assert!(drafted <= 4, "{drafted} drafting steps, {speedup}");
        assert!(speedup >= 0.97, "{speedup}");
        assert!(s.forward_cost(1).unwrap() < 0.015);
        // Control: a machine on which plain steps really became dear (40 ms from the slow one
        // on) makes the policy draft.
        let mut s = AdaptiveState::default();
        let (drafted, _) = simulate_slow_plain_step(&mut s, 600, 40, 0.040);
        assert!(drafted >= 400, "{drafted} drafting steps");
    }

    #[test]
    fn a_draft_models_catch_up_is_priced_on_every_draft_length() {
        // Proposing time 8 ms per step plus 2 ms a token, measured at k = 2 and k = 6 only.
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        s.observe(&cfg, 0, 0, 0.010, 0.0);
        s.begin_generation();
        s.observe(&cfg, 6, 0, 0.016, 0.5);
        for _ in 0..3 {
            s.observe(&cfg, 2, 2, 0.012, 0.012);
            s.observe(&cfg, 6, 6, 0.016, 0.020);
        }
        assert!((s.propose_cost(1) - 0.010).abs() < 1e-12);
        assert!((s.propose_cost(4) - 0.016).abs() < 1e-12);
        assert!((s.propose_cost(8) - 0.024).abs() < 1e-12);
        // A 1-token draft (11 ms verify + 10 ms proposing for at most 2 tokens) cannot pay
        // against plain steps of 10 ms; priced per token (4 ms for one) it would look paying.
        assert!((s.forward_cost(2).unwrap() - 0.011).abs() < 1e-9);
        assert!(s.cannot_pay(1, |n| s.forward_cost(n)));
        // Control: measured at one length only, the time is proportional (no catch-up known).
        let mut one = AdaptiveState::default();
        one.observe(&cfg, 0, 0, 0.010, 0.0);
        one.begin_generation();
        one.observe(&cfg, 6, 0, 0.016, 0.5);
        one.observe(&cfg, 2, 2, 0.012, 0.012);
        assert!((one.propose_cost(1) - 0.006).abs() < 1e-12);
        assert!(!one.cannot_pay(1, |n| one.forward_cost(n)));
    }

    #[test]
    fn the_tree_cost_curve_ignores_an_outlier_and_ages_stale_rows() {
        let cfg = AdaptiveConfig::default();
        let mut s = AdaptiveState::default();
        // Rows 1: six forwards of 1 ms and one of 10 ms; rows 9: 1.5 ms.
        for i in 0..7 {
            let t = if i == 3 { 0.010 } else { 0.001 };
            s.observe(&cfg, 0, 0, t, 0.0);
            s.observe(&cfg, 8, 8, 0.0015, 0.0);
        }
        let t1 = s.tree_forward_cost(1).unwrap();
        assert!((t1 - 0.001).abs() < 0.0001, "{t1}");
        // The chain policy's median ignores it too.
        assert_eq!(s.forward_cost(1), Some(0.001));
        let t5 = s.tree_forward_cost(5).unwrap();
        assert!(t5 > t1 && t5 < s.tree_forward_cost(9).unwrap(), "{t5}");
        // A slow sample of one row, then only speculative steps at 2 and 9 rows for a long
        // while: the stale single-row cost drifts to the line through the fresh ones.
        let mut s = AdaptiveState::default();
        s.observe(&cfg, 0, 0, 0.005, 0.0);
        for _ in 0..300 {
            s.observe(&cfg, 1, 1, 0.0011, 0.0);
            s.observe(&cfg, 8, 8, 0.0018, 0.0);
        }
        let t1 = s.tree_forward_cost(1).unwrap();
        assert!(t1 < 0.0012, "{t1}");
    }

    #[test]
    fn validates() {
        assert!(
            AdaptiveConfig {
                decay: 0.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(AdaptiveConfig::default().validate().is_ok());
    }
}
