//! Draft length policies: a fixed draft length `k`, or an adaptive `k` that maximises expected
//! tokens per second.

use crate::error::{Error, Result};

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
/// (exponential moving average per `n`, a least-squares line through the measured `n` for the
/// others), plus the proposer's time per draft token. It picks the `k` that maximises
///
/// `E[tokens](k) / (t(k + 1) + k * t_propose)`, with `E[tokens](k) = 1 + sum_{j=1..k} prod_{i<j} a_i`
///
/// (the expected number of tokens per step, Leviathan et al. 2023, section 3.1, with per-position
/// rates). `k = 0` (plain decoding) wins when speculation does not pay; then every
/// `probe_interval` steps it tries `k = probe_draft` so that the estimates keep learning.
/// Each probe that does not bring speculation back doubles the interval, up to
/// `max_probe_interval` steps (exponential backoff), so that a proposer that never pays
/// (a draft model rejected everywhere, whose catch-up over the skipped tokens is costly) costs
/// a vanishing share of the time; the first step that speculates again resets the wait.
///
/// **With token trees** ([`GenerationParams::tree_nodes`](crate::decode::GenerationParams::tree_nodes))
/// `k` is the tree's depth: `a_i` is the probability that the accepted path reaches depth
/// `i + 1` given it reached depth `i`, and `t(k + 1)` is the measured cost of the steps that
/// chose depth `k` (tree forwards of up to the node budget, or chains when the proposer found a
/// single path), so the same rule weighs the longer accepted paths of trees against their wider
/// forwards, and turns speculation off where trees do not pay ([`AdaptiveState::observe_tree`]).
///
/// | field | default | valid range |
/// |---|---|---|
/// | `max_draft` | 8 | any (0 makes every step a no-draft step) |
/// | `decay` | 0.98 | `(0, 1]` |
/// | `time_smoothing` | 0.2 | `(0, 1]` |
/// | `probe_interval` | 16 | `>= 1` |
/// | `max_probe_interval` | 256 | any (below `probe_interval`: a fixed interval) |
/// | `probe_draft` | 2 | any (capped by `max_draft`) |
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveConfig {
    /// Largest draft length `k` considered.
    pub max_draft: usize,
    /// Decay of the acceptance counts per observation, in `(0, 1]` (1 = no forgetting).
    pub decay: f64,
    /// Weight of a new timing in the moving averages, in `(0, 1]`.
    pub time_smoothing: f64,
    /// While `k = 0` wins, every this many steps probe with `k = probe_draft` (the initial
    /// interval).
    pub probe_interval: usize,
    /// Longest interval between probes, in steps, reached by doubling after each probe that
    /// fails. Values below `probe_interval` act as `probe_interval` (a fixed interval).
    pub max_probe_interval: usize,
    /// Draft length `k` of a probe step (capped by `max_draft`).
    pub probe_draft: usize,
}

impl Default for AdaptiveConfig {
    /// `max_draft` 8, `decay` 0.98, `time_smoothing` 0.2, `probe_interval` 16,
    /// `max_probe_interval` 256, `probe_draft` 2 (the table of [`AdaptiveConfig`]).
    fn default() -> Self {
        AdaptiveConfig {
            max_draft: 8,
            decay: 0.98,
            time_smoothing: 0.2,
            probe_interval: 16,
            max_probe_interval: 256,
            probe_draft: 2,
        }
    }
}

impl AdaptiveConfig {
    /// Checks the ranges documented on each field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for `decay` or `time_smoothing` outside `(0, 1]` or
    /// `probe_interval == 0`.
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
        Ok(())
    }
}

/// Online state of the adaptive policy for one generator (kept across generations, since the
/// target's cost curve does not change between requests).
///
/// The default state has observed nothing: every position's acceptance estimate is the prior
/// mean 0.5 and no forward cost is known, so the first step uses `max_draft`.
#[derive(Debug, Clone, Default)]
pub struct AdaptiveState {
    acc: Vec<f64>,
    seen: Vec<f64>,
    /// EMA of forward seconds by number of tokens fed (index n).
    cost: Vec<Option<f64>>,
    propose_per_token: Option<f64>,
    zero_run: usize,
    /// Current interval between probes (0 before the first probe: `probe_interval`).
    wait: usize,
    steps: usize,
}

impl AdaptiveState {
    /// Estimated acceptance probability of position `i` given that `0..i` were accepted.
    pub fn acceptance(&self, i: usize) -> f64 {
        let a = self.acc.get(i).copied().unwrap_or(0.0);
        let s = self.seen.get(i).copied().unwrap_or(0.0);
        (a + 1.0) / (s + 2.0)
    }

    /// Estimated seconds of a target forward over `n >= 1` tokens, if anything was measured.
    pub fn forward_cost(&self, n: usize) -> Option<f64> {
        if let Some(Some(c)) = self.cost.get(n) {
            return Some(*c);
        }
        let pts: Vec<(f64, f64)> = self
            .cost
            .iter()
            .enumerate()
            .filter_map(|(n, c)| c.map(|c| (n as f64, c)))
            .collect();
        match pts.len() {
            0 => None,
            1 => Some(pts[0].1),
            _ => {
                let m = pts.len() as f64;
                let mx = pts.iter().map(|p| p.0).sum::<f64>() / m;
                let my = pts.iter().map(|p| p.1).sum::<f64>() / m;
                let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
                let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
                let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
                Some((my + slope * (n as f64 - mx)).max(1e-12))
            }
        }
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

    /// The draft length to use, at most `cap`.
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
        let tp = self.propose_per_token.unwrap_or(0.0);
        let mut best = (0usize, f64::NEG_INFINITY);
        for k in 0..=max_k {
            let t = self.forward_cost(k + 1).unwrap_or(f64::INFINITY) + k as f64 * tp;
            let rate = self.expected_tokens(k) / t;
            if rate > best.1 {
                best = (k, rate);
            }
        }
        if best.0 == 0 {
            let wait = self.wait.max(cfg.probe_interval);
            if self.zero_run + 1 >= wait {
                self.zero_run = 0;
                // The next wait is longer unless this probe brings speculation back.
                self.wait = wait
                    .saturating_mul(2)
                    .min(cfg.max_probe_interval.max(cfg.probe_interval));
                return cfg.probe_draft.min(max_k);
            }
            self.zero_run += 1;
        } else {
            self.zero_run = 0;
            self.wait = cfg.probe_interval;
        }
        best.0
    }

    /// Starts a generation: the probe interval and the run of plain steps start over; the
    /// acceptance and cost estimates are kept. Called by the generator at each new generation.
    pub fn begin_generation(&mut self) {
        self.zero_run = 0;
        self.wait = 0;
    }

    fn cost_at(&self, n: usize) -> Option<f64> {
        self.cost.get(n).copied().flatten()
    }

    /// Records one step: `k` drafts verified, `accepted` accepted, forward over `k + 1` tokens
    /// took `forward_secs`, proposing took `propose_secs`.
    pub fn observe(
        &mut self,
        cfg: &AdaptiveConfig,
        k: usize,
        accepted: usize,
        forward_secs: f64,
        propose_secs: f64,
    ) {
        // A chain tests every position up to the first rejection.
        let reached = (accepted + 1).min(k);
        self.record(cfg, k, accepted, reached, forward_secs, propose_secs);
    }

    /// Records one tree step chosen with depth `depth` (the `k` that [`AdaptiveState::choose`]
    /// returned): `accepted` nodes on the accepted path, `tested_next` when the walk stopped at
    /// a node with children (the next depth was tested and rejected; a path that ends at a leaf
    /// tests nothing more), the tree forward took `forward_secs` (kept as the cost of depth
    /// `depth`), proposing took `propose_secs`.
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
        self.record(cfg, depth, accepted, reached, forward_secs, propose_secs);
    }

    fn record(
        &mut self,
        cfg: &AdaptiveConfig,
        k: usize,
        accepted: usize,
        reached: usize,
        forward_secs: f64,
        propose_secs: f64,
    ) {
        self.steps += 1;
        let n = k + 1;
        if self.cost.len() <= n {
            self.cost.resize(n + 1, None);
        }
        let w = cfg.time_smoothing;
        self.cost[n] = Some(match self.cost[n] {
            Some(c) => (1.0 - w) * c + w * forward_secs,
            None => forward_secs,
        });
        if k > 0 {
            let per = propose_secs / k as f64;
            self.propose_per_token = Some(match self.propose_per_token {
                Some(c) => (1.0 - w) * c + w * per,
                None => per,
            });
        }
        if self.acc.len() < k {
            self.acc.resize(k, 0.0);
            self.seen.resize(k, 0.0);
        }
        for i in 0..reached {
            self.acc[i] *= cfg.decay;
            self.seen[i] *= cfg.decay;
            self.seen[i] += 1.0;
            if i < accepted {
                self.acc[i] += 1.0;
            }
        }
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

    #[test]
    fn probes_after_a_run_of_plain_steps() {
        let cfg = AdaptiveConfig {
            probe_interval: 4,
            max_probe_interval: 4,
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
            ..Default::default()
        };
        let mut s = AdaptiveState::default();
        let mut probes = Vec::new();
        for step in 0..1000 {
            let k = s.choose(&cfg, 100);
            if step > 0 && k > 0 {
                probes.push(step);
            }
            s.observe(&cfg, k, 0, 0.01 * (k + 1) as f64, 0.0);
        }
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
