//! What the cost-aware [`super::MergedProposer`] weighs its candidates against: where its step
//! and member costs come from ([`MergeCosts`]: the measured clock, or fixed costs for exact,
//! reproducible tests), and what it learns from them online (the crate-private [`Ledger`]:
//! each member's marginal accepted tokens per step, its time per call, and the step time by
//! verify rows).
//!
//! The rule (see "Cost-aware merging" on [`super::MergedProposer`]): a member is asked to draft
//! only when the tokens it is expected to add over the members asked before it, `g`, pay for
//! the time it costs, `t`: `g / L >= t / T`, with `L` the expected tokens per step without it
//! and `T` the step time without it. That is the condition under which asking it raises the
//! tokens per second, `(L + g) / (T + t) >= L / T`. A node is kept only while it raises the
//! expected tokens per second of the step, `(1 + sum of the kept nodes' reach probabilities)
//! / T(rows)`, with `T(rows)` the learned step time of a verify over that many rows: the
//! allocation by marginal expected accepted tokens per unit cost of EAGLE-2 (Li et al. 2024,
//! dynamic draft trees) and Sequoia (Chen et al. 2024, tree size against the hardware's cost
//! curve), applied across proposers.

use std::time::Duration;

use crate::error::{Result, check_secs};
use crate::timing::{RobustCurve, RowSamples};

/// How [`super::MergedProposer`] chooses and ranks its candidates.
///
/// `#[non_exhaustive]`: new rules may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MergePolicy {
    /// Every member is asked every step; the budget is filled with the nodes of highest
    /// estimated reach probability (the rule before the cost-aware merge; see "The rule" on
    /// [`super::MergedProposer`]).
    Reach,
    /// The default: members are asked only when their expected extra accepted tokens pay for
    /// their time (with an occasional probe), and nodes are kept only while they raise the
    /// step's expected tokens per second (see "Cost-aware merging" on
    /// [`super::MergedProposer`]).
    #[default]
    CostAware,
}

/// Where the cost-aware merge learns its costs from, in seconds: the measured clock
/// ([`MeasuredMergeCosts`], the default) or fixed costs ([`FixedMergeCosts`], exact and
/// reproducible: the merge's choices then depend only on the acceptance it observes).
///
/// The merge times each member's draft call and the rest of each step (from the end of one
/// proposal to the start of the next: the target's verify forward and the loop), and passes
/// the times through this source. Implementations should be cheap and return finite values
/// `>= 0`.
pub trait MergeCosts: Send {
    /// Seconds to record for member `member`'s draft call, which drafted `drafted` tokens (tree
    /// nodes count one each) and took `measured`.
    fn member_secs(&self, member: usize, drafted: usize, measured: Duration) -> f64;

    /// Seconds to record for the rest of a step whose verify ran `rows >= 1` target rows (the
    /// merged draft's nodes plus the root), which took `measured`.
    fn step_secs(&self, rows: usize, measured: Duration) -> f64;
}

/// The measured clock: every cost is the time measured. The default of
/// [`super::MergedProposer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeasuredMergeCosts;

impl MergeCosts for MeasuredMergeCosts {
    /// `measured` in seconds.
    fn member_secs(&self, _member: usize, _drafted: usize, measured: Duration) -> f64 {
        measured.as_secs_f64()
    }

    /// `measured` in seconds.
    fn step_secs(&self, _rows: usize, measured: Duration) -> f64 {
        measured.as_secs_f64()
    }
}

/// Fixed costs: the rest of a step over `rows` verify rows costs `base + per_row * rows`
/// seconds, and member `s`'s call `per_call(s) + per_token(s) * drafted` (0 for a member
/// without costs set), whatever the clock says.
///
/// ```
/// use speculative::propose::{FixedMergeCosts, MergeCosts};
/// use std::time::Duration;
///
/// // 10 ms per verify plus 1 ms per row; member 1 costs 0.5 ms per call and 0.2 ms per token.
/// let c = FixedMergeCosts::new(0.010, 0.001)?.with_member(1, 0.0005, 0.0002)?;
/// assert!((c.step_secs(3, Duration::ZERO) - 0.013).abs() < 1e-12);
/// assert!((c.member_secs(1, 4, Duration::ZERO) - 0.0013).abs() < 1e-12);
/// assert_eq!(c.member_secs(0, 4, Duration::from_secs(1)), 0.0);
/// # Ok::<(), speculative::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FixedMergeCosts {
    base: f64,
    per_row: f64,
    /// `(per_call, per_token)` of each member (missing: free).
    members: Vec<(f64, f64)>,
}

impl FixedMergeCosts {
    /// A step costs `base_secs + per_row_secs * rows`; every member is free until
    /// [`FixedMergeCosts::with_member`].
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] when a time is negative or not finite.
    pub fn new(base_secs: f64, per_row_secs: f64) -> Result<Self> {
        check_secs("base_secs", base_secs)?;
        check_secs("per_row_secs", per_row_secs)?;
        Ok(FixedMergeCosts {
            base: base_secs,
            per_row: per_row_secs,
            members: Vec::new(),
        })
    }

    /// Sets member `member`'s cost: `per_call_secs + per_token_secs * drafted` per draft call.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] when a time is negative or not finite.
    pub fn with_member(
        mut self,
        member: usize,
        per_call_secs: f64,
        per_token_secs: f64,
    ) -> Result<Self> {
        check_secs("per_call_secs", per_call_secs)?;
        check_secs("per_token_secs", per_token_secs)?;
        if self.members.len() <= member {
            self.members.resize(member + 1, (0.0, 0.0));
        }
        self.members[member] = (per_call_secs, per_token_secs);
        Ok(self)
    }
}

impl MergeCosts for FixedMergeCosts {
    fn member_secs(&self, member: usize, drafted: usize, _measured: Duration) -> f64 {
        let (call, token) = self.members.get(member).copied().unwrap_or_default();
        call + token * drafted as f64
    }

    fn step_secs(&self, rows: usize, _measured: Duration) -> f64 {
        self.base + self.per_row * rows as f64
    }
}

/// Buckets of the expected accepted length `E` of the candidates gathered before a member is
/// asked: none at all, then `E` in `(0, 0.5]`, `(0.5, 1]`, `(1, 2]` and above 2. A member's
/// marginal gain is learned per bucket: the draft head adds much when the copy proposers have
/// nothing, little when they hold a long likely copy.
pub(super) const BUCKETS: usize = 5;

/// The bucket of an expected accepted length (`None`: no candidate yet).
pub(super) fn bucket(expected: Option<f64>) -> usize {
    match expected {
        None => 0,
        Some(e) if e <= 0.5 => 1,
        Some(e) if e <= 1.0 => 2,
        Some(e) if e <= 2.0 => 3,
        Some(_) => 4,
    }
}

/// The first probe interval (skipped steps of one member and bucket before it is asked
/// anyway), and the most it grows to (doubling after each probe that did not pay).
const PROBE_FIRST: u32 = 8;
const PROBE_MAX: u32 = 64;

/// The most share of the decoding time a member's probes may cost: a member that does not
/// pay is probed only once the steps since its last call took at least its learned seconds
/// per call (or its last call's, if more: a probe's catch-up) divided by this. A draft model's call after skipped steps includes its catch-up
/// with every token since (on the 2-core machine, SmolLM2-135M drafting for Gemma 3 270M: a
/// probe cost about five target steps), so probes by step count alone cost 10-20 % of short
/// requests.
const PROBE_SHARE: f64 = 0.02;

/// Each probe in a row that finds a member still not paying halves its share of the time,
/// down to [`PROBE_SHARE`] over this (0.5 %): a member that never pays on this engine (a draft
/// model as dear as the target) costs ever less, and one that pays again resets it.
const PROBE_BACKOFF_MAX: f64 = 4.0;

/// Most tokens (and tree nodes) a probe asks for: a probe is cheap, and its gain is measured on
/// the leading tokens, where a member that does not pay shows it first.
pub(super) const PROBE_DRAFT: usize = 2;

/// A member whose call costs at most this share of the step is asked whatever its learned
/// gain (net of its rows, which can be briefly negative while the rates learn): skipping it
/// saves next to nothing, and its nodes are cut one by one where their rows do not pay.
const FREE_SHARE: f64 = 0.01;

/// Prior of a member's marginal gain: one pseudo-step at one token (optimistic, so a new member
/// is tried before it is judged).
const GAIN_PRIOR: f64 = 1.0;

/// A decayed mean: `sum` and `weight` both multiplied by the decay before each sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Mean {
    sum: f64,
    weight: f64,
}

impl Mean {
    fn push(&mut self, x: f64, decay: f64) {
        self.sum = self.sum * decay + x;
        self.weight = self.weight * decay + 1.0;
    }

    /// The mean with a prior of `prior_weight` pseudo-samples at `prior`.
    fn with_prior(&self, prior: f64, prior_weight: f64) -> f64 {
        (self.sum + prior * prior_weight) / (self.weight + prior_weight)
    }

    fn get(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.sum / self.weight)
    }
}

/// Row counts above this share the last slot (and its x).
const MAX_ROW_SLOT: usize = 64;

/// The rest of a step's seconds by verify rows: per row count its last 7 times
/// ([`RowSamples`]), read through the crate's robust curve (`RobustCurve`, refitted at each
/// step, as the tree policy reads its forward costs). At a measured row count the median, where
/// above the least-squares line through the medians of every measured count shrunk toward it
/// as `(m * median + line) / (m + 1)`, with `m` the count's samples aged by `0.98` per step
/// since its last one (timing noise only adds time: a median below the line is kept); linear
/// between measured counts, the line beyond them.
///
/// A count measured often and lately is thus read nearly as measured: llama.cpp's CPU
/// verify of Gemma 3 270M costs `c(2) = 2.1` single steps and `c(5) = 3.9`, and a line
/// through those underprices one- and two-token drafts, whose rows then look as if they paid
/// (the merge's sampled chains at `k = 4`, issue 31); nor is it monotone (about 45 ms at 3 rows
/// and 40 ms at 4 on a 2-core x86 machine: matrix products in tiles of 4 rows), and a curve
/// raised to be monotone priced three-token drafts a third too dear. A count measured once,
/// or long ago, drifts toward the line instead: one slow step at a row count the merge then
/// stops choosing no longer keeps that count above the line for good (the likely cause, not
/// traced, of a run on 2 threads in which the merge with a SmolLM2 draft stopped drafting
/// three-token chains and kept to six-token ones or none for whole requests: 1.13x against
/// 1.32x without the draft). Where the line itself
/// runs through such counts (the first slow samples of a request's first steps at 4 and 5
/// rows, and no fresh count but the plain step's), aging moves them all alike and they stay
/// dear until a draft of that length is verified again (issue 31, not fixed).
#[derive(Debug, Clone, Default)]
struct StepCurve {
    /// Per row count (index), its last times.
    samples: Vec<RowSamples>,
    /// Steps recorded (the age of a count's samples).
    steps: usize,
    /// The curve fitted after the last step.
    fit: RobustCurve,
}

impl StepCurve {
    fn push(&mut self, rows: usize, secs: f64) {
        let r = rows.min(MAX_ROW_SLOT);
        if self.samples.len() <= r {
            self.samples.resize(r + 1, RowSamples::default());
        }
        self.steps += 1;
        self.samples[r].push(secs, self.steps);
        self.fit = RobustCurve::fit(&self.samples, self.steps);
    }

    /// The seconds at `rows` rows (`None` before a sample).
    fn at(&self, rows: usize) -> Option<f64> {
        self.fit.at(rows)
    }
}

/// A step's learned seconds by verify rows (a view of the ledger's curve).
#[derive(Debug, Clone, Copy)]
pub(super) struct StepTime<'a> {
    curve: &'a StepCurve,
}

impl StepTime<'_> {
    /// Seconds of the rest of a step over `rows` verify rows.
    pub(super) fn secs(&self, rows: usize) -> f64 {
        self.curve.at(rows).unwrap_or(1.0)
    }
}

/// The probe state of one (member, bucket).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Probe {
    skipped: u32,
    interval: u32,
}

impl Default for Probe {
    fn default() -> Self {
        Probe {
            skipped: 0,
            interval: PROBE_FIRST,
        }
    }
}

/// What the cost-aware merge has learned about its members' value and cost.
#[derive(Debug, Clone, Default)]
pub(super) struct Ledger {
    /// Each member's decayed marginal accepted tokens per step it was asked, per bucket.
    gains: Vec<[Mean; BUCKETS]>,
    probes: Vec<[Probe; BUCKETS]>,
    /// Each member's decayed seconds per draft call.
    secs: Vec<Mean>,
    /// Each member's decayed tokens (nodes) drafted per call.
    drafted: Vec<Mean>,
    /// Each member's seconds of recorded steps since its last call (the probe budget).
    since: Vec<f64>,
    /// Each member's seconds of its last call (a probe after skipped steps: with the
    /// catch-up it paid, which the mean per call dilutes with the calls of steps it paid on).
    last: Vec<f64>,
    /// Each member's probe backoff: the divisor of [`PROBE_SHARE`] (1, doubled by each probe
    /// in a row that did not lead to a paying step, at most [`PROBE_BACKOFF_MAX`]).
    backoff: Vec<f64>,
    /// The rest of a step's seconds against its verify rows.
    step: StepCurve,
}

/// Why a member is asked at a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Decision {
    /// Its expected gain pays for its cost.
    Pays,
    /// It does not pay, but is asked to re-measure its gain.
    Probe,
    /// Not asked.
    Skip,
}

impl Ledger {
    pub(super) fn new(members: usize) -> Self {
        Ledger {
            gains: vec![[Mean::default(); BUCKETS]; members],
            probes: vec![[Probe::default(); BUCKETS]; members],
            secs: vec![Mean::default(); members],
            drafted: vec![Mean::default(); members],
            since: vec![0.0; members],
            last: vec![0.0; members],
            backoff: vec![1.0; members],
            step: StepCurve::default(),
        }
    }

    pub(super) fn clear(&mut self) {
        *self = Ledger::new(self.gains.len());
    }

    /// Member `s`'s learned seconds per call (0 before it was timed).
    pub(super) fn member_secs(&self, s: usize) -> f64 {
        self.secs[s].get().unwrap_or(0.0)
    }

    /// Member `s`'s learned seconds per drafted token (its seconds per call over its tokens
    /// per call; 0 before it drafted a token).
    pub(super) fn token_secs(&self, s: usize) -> f64 {
        match self.drafted[s].get() {
            Some(n) if n > 0.0 => self.member_secs(s) / n,
            _ => 0.0,
        }
    }

    /// Whether member `s`'s call costs at most [`FREE_SHARE`] of a step of `secs` seconds.
    pub(super) fn is_free(&self, s: usize, secs: f64) -> bool {
        self.member_secs(s) <= FREE_SHARE * secs
    }

    /// The learned seconds of the rest of a step over `rows` verify rows (`None` before a
    /// step was timed).
    pub(super) fn step_secs(&self, rows: usize) -> Option<f64> {
        self.step.at(rows)
    }

    /// The learned seconds of the rest of a step by verify rows (`None` before a step was
    /// timed).
    pub(super) fn step_time(&self) -> Option<StepTime<'_>> {
        self.step.at(1).map(|_| StepTime { curve: &self.step })
    }

    /// Member `s`'s expected marginal accepted tokens in bucket `b`: its decayed mean there,
    /// with one pseudo-step at its mean over all buckets (itself with one pseudo-step at
    /// [`GAIN_PRIOR`]), so that a bucket seen for the first time starts from what the member
    /// showed elsewhere.
    pub(super) fn gain(&self, s: usize, b: usize) -> f64 {
        let all = self.gains[s].iter().fold(Mean::default(), |a, m| Mean {
            sum: a.sum + m.sum,
            weight: a.weight + m.weight,
        });
        self.gains[s][b].with_prior(all.with_prior(GAIN_PRIOR, 1.0), 1.0)
    }

    /// Whether member `s` pays in bucket `b`: `gain / tokens >= cost / secs`, with `tokens`
    /// the expected tokens per step and `secs` the step's seconds without it; a member whose
    /// call costs at most [`FREE_SHARE`] of the step always does (its nodes are still cut one
    /// by one where their rows do not pay).
    fn pays(&self, s: usize, b: usize, tokens: f64, secs: f64) -> bool {
        self.is_free(s, secs) || self.gain(s, b) * secs >= tokens * self.member_secs(s)
    }

    /// Decides whether member `s` is asked in bucket `b` (see [`Ledger::pays`]); a member that
    /// does not pay is asked anyway once its skipped steps in the bucket reach the probe
    /// interval and the steps since its last call (in any bucket) took at least its seconds
    /// per call over its share of the time ([`PROBE_SHARE`], halved by each probe in a row that
    /// did not pay, down to a quarter; a probe waits, its skipped count kept, until then).
    pub(super) fn decide(&mut self, s: usize, b: usize, tokens: f64, secs: f64) -> Decision {
        if self.pays(s, b, tokens, secs) {
            self.probes[s][b] = Probe::default();
            self.backoff[s] = 1.0;
            return Decision::Pays;
        }
        let cost = self.member_secs(s).max(self.last[s]);
        let budget = self.since[s] * PROBE_SHARE >= cost * self.backoff[s];
        let p = &mut self.probes[s][b];
        p.skipped = p.skipped.saturating_add(1);
        if p.skipped >= p.interval && budget {
            p.skipped = 0;
            p.interval = (p.interval * 2).min(PROBE_MAX);
            // The share before this probe was spent on it; the next one gets half, unless a
            // step pays first.
            self.backoff[s] = (self.backoff[s] * 2.0).min(PROBE_BACKOFF_MAX);
            return Decision::Probe;
        }
        Decision::Skip
    }

    /// Records member `s`'s call: `secs` seconds, `drafted` tokens (nodes).
    pub(super) fn record_call(&mut self, s: usize, secs: f64, drafted: usize, decay: f64) {
        self.since[s] = 0.0;
        self.last[s] = secs;
        self.secs[s].push(secs, decay);
        self.drafted[s].push(drafted as f64, decay);
    }

    /// Records member `s`'s marginal accepted tokens `gain` at a step it was asked in bucket `b`.
    pub(super) fn record_gain(&mut self, s: usize, b: usize, gain: f64, decay: f64) {
        self.gains[s][b].push(gain, decay);
    }

    /// Records the rest of a step: `rows` verify rows in `secs` seconds.
    pub(super) fn record_step(&mut self, rows: usize, secs: f64) {
        for t in &mut self.since {
            *t += secs;
        }
        self.step.push(rows, secs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_costs_are_checked_and_priced() {
        assert!(FixedMergeCosts::new(-1.0, 0.0).is_err());
        assert!(FixedMergeCosts::new(0.0, f64::NAN).is_err());
        let c = FixedMergeCosts::new(1.0, 0.5).unwrap();
        assert!(c.clone().with_member(0, f64::INFINITY, 0.0).is_err());
        let c = c.with_member(2, 0.25, 0.125).unwrap();
        assert_eq!(c.step_secs(4, Duration::from_secs(9)), 3.0);
        assert_eq!(c.member_secs(2, 2, Duration::ZERO), 0.5);
        assert_eq!(c.member_secs(1, 2, Duration::ZERO), 0.0);
        let m = MeasuredMergeCosts;
        assert_eq!(m.step_secs(3, Duration::from_millis(250)), 0.25);
        assert_eq!(m.member_secs(0, 3, Duration::from_millis(500)), 0.5);
    }

    #[test]
    fn buckets_split_the_expected_length() {
        let got: Vec<usize> = [None, Some(0.0), Some(0.5), Some(0.7), Some(2.0), Some(2.1)]
            .into_iter()
            .map(bucket)
            .collect();
        assert_eq!(got, [0, 1, 1, 2, 3, 4]);
    }

    #[test]
    fn the_step_curve_is_read_nearly_as_measured_where_it_was_measured() {
        // llama.cpp's curve on a CPU: T(2) = 2.1, T(5) = 3.9 (in T(1)); a line through the
        // three medians says T(2) = 1.8, and a two-row draft right on 3 steps of 4 (1.75
        // tokens) would look paying.
        let mut c = StepCurve::default();
        for _ in 0..7 {
            c.push(1, 1.0);
            c.push(2, 2.1);
            c.push(5, 3.9);
        }
        let at = |x: usize| c.at(x).unwrap();
        assert!((at(1) - 1.0).abs() < 0.03, "{}", at(1));
        assert!((at(2) - 2.1).abs() < 0.05, "{}", at(2));
        assert!((at(5) - 3.9).abs() < 0.02, "{}", at(5));
        assert!(at(2) > 1.75 * at(1), "the two-row draft does not pay");
        let mid = at(2) + (at(5) - at(2)) / 3.0;
        assert!(
            (at(3) - mid).abs() < 1e-12,
            "between two measured counts: a straight line"
        );
        let slope = at(8) - at(7);
        assert!(
            at(7) > at(5) && slope > 0.5 && slope < 1.0,
            "beyond: the line"
        );
        assert_eq!(StepCurve::default().at(1), None);
    }

    #[test]
    fn a_step_of_more_rows_may_cost_less() {
        // llama.cpp's CPU verify of Gemma 3 270M at 2 threads (ms): 3 rows cost more than 4
        // (matrix products in tiles of 4 rows). The 4-row median is kept, not raised to 45.
        let mut c = StepCurve::default();
        for _ in 0..7 {
            for (rows, ms) in [(1, 14.0), (2, 29.0), (3, 45.0), (4, 40.0), (5, 57.0)] {
                c.push(rows, ms);
            }
        }
        let at = |x: usize| c.at(x).unwrap();
        assert!((at(3) - 45.0).abs() < 1.5, "{}", at(3));
        assert!((at(4) - 40.0).abs() < 1.5, "{}", at(4));
        assert!(at(4) < at(3) - 3.0);
        assert!((at(5) - 57.0).abs() < 1.0, "{}", at(5));
    }

    #[test]
    fn the_step_curve_ignores_a_slow_outlier() {
        let mut c = StepCurve::default();
        for _ in 0..7 {
            c.push(2, 1.0);
            c.push(4, 1.2);
        }
        let before = c.at(6).unwrap();
        assert!((before - 1.4).abs() < 0.01, "{before}");
        // Three slow steps out of seven at 4 rows: the median is still 1.2.
        for _ in 0..3 {
            c.push(4, 10.0);
        }
        assert!((c.at(4).unwrap() - 1.2).abs() < 0.01);
        // A fourth makes it the majority of the last seven: the curve follows.
        c.push(4, 10.0);
        assert!(c.at(4).unwrap() > 5.0);
        // Row counts past the last slot share it.
        c.push(1000, 3.0);
        assert_eq!(c.samples.len(), MAX_ROW_SLOT + 1);
    }

    #[test]
    fn a_row_count_measured_once_in_a_slow_moment_drifts_back_to_the_line() {
        // One 4-row step of 100 ms among 1-row steps of 14 ms and 7-row ones of 64 ms; the
        // merge then drafts 6 tokens or none, and 4 rows are not measured again.
        let mut c = StepCurve::default();
        for _ in 0..7 {
            c.push(1, 14.0);
            c.push(7, 64.0);
        }
        c.push(4, 100.0);
        // Fresh, the slow sample counts (half-way from the line): 4 rows look dear.
        let fresh = c.at(4).unwrap();
        assert!(fresh > 60.0, "{fresh}");
        for _ in 0..150 {
            c.push(1, 14.0);
            c.push(7, 64.0);
        }
        // 300 steps later: the line through the fresh counts (39 ms).
        let stale = c.at(4).unwrap();
        assert!((stale - 39.0).abs() < 1.0, "{stale}");
        assert!((c.at(7).unwrap() - 64.0).abs() < 0.5);
    }

    #[test]
    fn a_member_that_does_not_pay_is_skipped_and_probed_less_and_less() {
        let mut l = Ledger::new(2);
        // Untimed: free, so it pays.
        assert_eq!(l.decide(1, 0, 1.0, 1.0), Decision::Pays);
        // 0.5 s per call against a 1 s step: it must add half a token per step.
        l.record_call(1, 0.5, 4, 1.0);
        for _ in 0..20 {
            l.record_gain(1, 0, 0.0, 1.0);
        }
        let mut asked = Vec::new();
        for step in 0..40 {
            if l.decide(1, 0, 1.0, 1.0) == Decision::Probe {
                asked.push(step);
                l.record_call(1, 0.5, 2, 1.0);
            }
            // 1 s steps: the probe budget (0.5 s per call at 2 %: 25 s) is never binding.
            l.record_step(1, 30.0);
        }
        // Probes after 8, then 16 more skipped steps.
        assert_eq!(asked, [7, 23]);
        // A bucket not seen yet starts from the member's mean elsewhere: it does not pay
        // there either; a member never measured starts at one token.
        assert!((l.gain(1, 3) - 1.0 / 21.0).abs() < 1e-12);
        assert_eq!(l.decide(1, 3, 1.0, 1.0), Decision::Skip);
        assert_eq!(l.gain(0, 3), 1.0);
        // Gains that pay bring it back.
        for _ in 0..40 {
            l.record_gain(1, 0, 2.0, 0.9);
        }
        assert_eq!(l.decide(1, 0, 1.0, 1.0), Decision::Pays);
        l.clear();
        assert_eq!(l.member_secs(1), 0.0);
    }

    #[test]
    fn probes_cost_at_most_their_share_of_the_time() {
        let mut l = Ledger::new(2);
        // A call of 0.0972 s that never pays, against steps of 0.05 s: at 2 %, a probe needs
        // 4.86 s of steps since the last call (98 steps), not the 8 skipped steps alone; each
        // probe that finds it still not paying halves the share, down to 0.5 % (389 steps).
        l.record_call(1, 0.0972, 2, 1.0);
        for _ in 0..20 {
            l.record_gain(1, 0, 0.0, 1.0);
        }
        let mut asked = Vec::new();
        for step in 0..1200 {
            if l.decide(1, 0, 1.0, 0.05) == Decision::Probe {
                asked.push(step);
                l.record_call(1, 0.0972, 2, 1.0);
            }
            l.record_step(1, 0.05);
        }
        assert_eq!(asked, [98, 293, 682, 1071]);
        // The probes' share of the time: 4 calls of 0.0972 s in 60 s of steps.
        let share = asked.len() as f64 * 0.0972 / (1200.0 * 0.05);
        assert!(share <= PROBE_SHARE / 2.0, "{share}");
        // A step that pays resets the backoff: the next probe is due after 98 steps again.
        for _ in 0..40 {
            l.record_gain(1, 0, 3.0, 0.9);
        }
        assert_eq!(l.decide(1, 0, 1.0, 0.05), Decision::Pays);
        l.record_call(1, 0.0972, 2, 1.0);
        for _ in 0..200 {
            l.record_gain(1, 0, 0.0, 0.9);
        }
        let mut waited = 0;
        while l.decide(1, 0, 1.0, 0.05) != Decision::Probe {
            l.record_step(1, 0.05);
            waited += 1;
        }
        assert_eq!(waited, 98);
        let mut l = Ledger::new(2);
        for _ in 0..20 {
            l.record_gain(1, 0, 0.0, 1.0);
        }
        // Cheap calls (0.01 s: steps it paid on) then a dear probe (0.2 s, a catch-up): the
        // next probe waits for the dear one's budget (10 s, 200 steps), not the mean's.
        for _ in 0..10 {
            l.record_call(1, 0.01, 2, 0.9);
        }
        l.record_call(1, 0.2, 2, 0.9);
        assert!(l.member_secs(1) < 0.1);
        let mut waited = 0;
        while l.decide(1, 0, 1.0, 0.05) != Decision::Probe {
            l.record_step(1, 0.05);
            waited += 1;
        }
        assert_eq!(waited, 200);
        // A cheap member (1 ms per call: 50 ms of steps) is probed by the step count.
        let mut asked = Vec::new();
        l.record_call(0, 0.001, 2, 1.0);
        for _ in 0..20 {
            l.record_gain(0, 0, -1.0, 1.0);
        }
        for step in 0..30 {
            if l.decide(0, 0, 1.0, 0.05) == Decision::Probe {
                asked.push(step);
                l.record_call(0, 0.001, 2, 1.0);
            }
            l.record_step(1, 0.05);
        }
        assert_eq!(asked, [7, 23]);
    }
}
