//! Draft lengths for a whole batch: the goodput policy of [`super::BatchGenerator`].
//!
//! In a batch every sequence's draft rows share one forward, so whether one more draft row pays
//! depends on the whole batch: a row that is almost free while the forward is memory-bound (a
//! small batch reads each weight once for all rows) costs as much as a token once the forward is
//! compute-bound. The policy picks each sequence's draft length `k_i` (0 allowed) to maximise the
//! batch's *goodput*, the expected emitted tokens per second of step time (SmartSpec, Liu et al.
//! 2024, "Optimizing Speculative Decoding for Serving Large Language Models Using Goodput",
//! section 4; TurboSpec):
//!
//! ```text
//! goodput(k_1 .. k_n) = sum_i E_i(k_i) / c(F + sum_i k_i)
//! E_i(k) = 1 + sum_{j=1..k} prod_{l<=j} a_i(l)
//! ```
//!
//! where `a_i(l)` is sequence `i`'s estimated acceptance of draft position `l` given the ones
//! before were accepted ([`super::AdaptiveState::acceptance`]), `F` the rows the step holds
//! anyway (one per decoding sequence, prefill chunks, fixed-length drafts) and `c(rows)` the
//! step time by rows learned online ([`BatchCost`]; measured, or from the cost source set by
//! [`super::BatchGenerator::with_costs`]). The marginal gain of sequence `i`'s `j`-th draft
//! is `m_ij = prod_{l<=j} a_i(l)`, non-increasing in `j`; so for a total of `R` draft rows the
//! best choice takes the `R` largest gains (each sequence's gains in order), and the policy
//! evaluates every `R` from 0 to the row budget and keeps the best. When rows are as dear as
//! steps (`c` linear through the origin) a draft row adds `m < 1` tokens for the cost of one
//! token, so every `k_i` is 0: speculation turns itself off when the batch is compute-bound.

use crate::error::{Error, Result};
use crate::timing::{RobustCurve, RowSamples};

/// Settings of the goodput policy ([`super::BatchConfig::goodput`]).
///
/// | field | default | range |
/// |---|---|---|
/// | `max_draft` | 8 | any (also capped by each request's [`super::AdaptiveConfig::max_draft`]) |
/// | `prior_row_cost` | 0.05 | `>= 0` |
///
/// `#[non_exhaustive]`: build it from [`GoodputConfig::default`] and the `with_` setters.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct GoodputConfig {
    /// Largest draft length considered for one sequence.
    pub max_draft: usize,
    /// Until step times of two different row counts are measured, the cost of one more row
    /// relative to a one-row step (a memory-bound prior, so that the first steps speculate
    /// and measure the curve).
    pub prior_row_cost: f64,
}

impl Default for GoodputConfig {
    /// `max_draft` 8, `prior_row_cost` 0.05.
    fn default() -> Self {
        GoodputConfig {
            max_draft: 8,
            prior_row_cost: 0.05,
        }
    }
}

impl GoodputConfig {
    /// Sets [`GoodputConfig::max_draft`] (any value is valid).
    pub fn with_max_draft(mut self, max_draft: usize) -> Self {
        self.max_draft = max_draft;
        self
    }

    /// Sets [`GoodputConfig::prior_row_cost`] (checked by [`GoodputConfig::validate`]).
    pub fn with_prior_row_cost(mut self, prior_row_cost: f64) -> Self {
        self.prior_row_cost = prior_row_cost;
        self
    }

    /// Checks the ranges of the table above.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a negative or non-finite `prior_row_cost`.
    pub fn validate(&self) -> Result<()> {
        if !(self.prior_row_cost.is_finite() && self.prior_row_cost >= 0.0) {
            return Err(Error::config(
                "prior_row_cost",
                self.prior_row_cost,
                "must be finite and >= 0",
            ));
        }
        Ok(())
    }
}

/// The batch's step time by rows, learned online (from the times the batch loop's
/// [`super::StepCosts`] reports: measured by default): per row count the median of its last 7
/// step times, aged and shrunk toward a least-squares line through all row counts where above
/// it, linear in
/// between (the robust curve of [`super::AdaptiveState::tree_forward_cost`]). Seconds.
#[derive(Debug, Clone, Default)]
pub struct BatchCost {
    samples: Vec<RowSamples>,
    steps: usize,
    measured: usize,
    /// The curve fitted after the last step (read for every sequence and draft length).
    fit: RobustCurve,
}

impl BatchCost {
    /// Records one step of `rows` rows (every row of the batched forward: prefill chunks,
    /// decode rows and drafts) that took `seconds` (forward, verification and proposing).
    /// Non-finite or negative times and `rows == 0` are ignored.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        if rows == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        self.steps += 1;
        if self.samples.len() <= rows {
            self.samples.resize(rows + 1, RowSamples::default());
        }
        if self.samples[rows].median().is_none() {
            self.measured += 1;
        }
        self.samples[rows].push(seconds, self.steps);
        self.fit = RobustCurve::fit(&self.samples, self.steps);
    }

    /// Estimated seconds of a step of `rows >= 1` rows; `None` before any measurement.
    pub fn cost(&self, rows: usize) -> Option<f64> {
        self.fit.at(rows)
    }

    /// Number of distinct row counts measured.
    pub fn row_counts(&self) -> usize {
        self.measured
    }

    /// `(rows, median seconds)` of every measured row count, ascending.
    pub fn curve(&self) -> Vec<(usize, f64)> {
        self.samples
            .iter()
            .enumerate()
            .filter_map(|(n, s)| s.median().map(|m| (n, m)))
            .collect()
    }

    /// The cost the policy uses: the measured curve once two row counts are known, else the
    /// prior `c(rows) = c1 * (1 + prior_row_cost * (rows - 1))` scaled to the one measurement
    /// (or to 1 s without any).
    pub(crate) fn policy_cost(&self, rows: usize, prior_row_cost: f64) -> f64 {
        if self.measured >= 2
            && let Some(c) = self.cost(rows)
        {
            return c;
        }
        let prior = |n: usize| 1.0 + prior_row_cost * (n.max(1) - 1) as f64;
        match self.curve().first() {
            Some(&(n, c)) => c * prior(rows) / prior(n),
            None => prior(rows),
        }
    }
}

/// One sequence's input to [`choose_draft_lengths`].
///
/// `#[non_exhaustive]`: build one with [`DraftCandidate::new`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct DraftCandidate<'a> {
    /// Estimated acceptance of draft positions `1, 2, ..` given the ones before were
    /// accepted, each in `[0, 1]`; its length is the most drafts the sequence may take now.
    pub acceptance: &'a [f64],
}

impl<'a> DraftCandidate<'a> {
    /// A sequence whose draft positions `1, 2, ..` are accepted with `acceptance`.
    pub fn new(acceptance: &'a [f64]) -> Self {
        DraftCandidate { acceptance }
    }
}

/// Per sequence, the draft length maximising the batch's goodput (module docs):
/// `sum_i E_i(k_i) / cost(fixed_rows + sum_i k_i)`, with `sum_i k_i <= max_extra_rows`.
/// `fixed_rows` are the step's rows that do not depend on the choice (one per decoding
/// sequence, prefill chunks, fixed drafts) and `fixed_tokens` the tokens they are expected to
/// emit; `cost(rows)` the step time in seconds. Ties go to fewer rows. Acceptance values are
/// clamped to `[0, 1]` (NaN counts as 0).
pub fn choose_draft_lengths(
    seqs: &[DraftCandidate<'_>],
    fixed_rows: usize,
    fixed_tokens: f64,
    max_extra_rows: usize,
    cost: impl Fn(usize) -> f64,
) -> Vec<usize> {
    // Every marginal gain, tagged with its sequence; each sequence's gains are non-increasing.
    let mut gains: Vec<(f64, usize)> = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        let mut reach = 1.0;
        for &a in s.acceptance {
            let a = if a.is_nan() { 0.0 } else { a.clamp(0.0, 1.0) };
            reach *= a;
            if reach <= 0.0 {
                break;
            }
            gains.push((reach, i));
        }
    }
    // Largest first; a stable sort keeps each sequence's own order among equal gains.
    gains.sort_by(|a, b| b.0.total_cmp(&a.0));
    let max_r = gains.len().min(max_extra_rows);
    let (mut best_r, mut best) = (0, f64::NEG_INFINITY);
    let mut tokens = fixed_tokens;
    for r in 0..=max_r {
        if r > 0 {
            tokens += gains[r - 1].0;
        }
        let c = cost(fixed_rows + r);
        let rate = if c > 0.0 { tokens / c } else { f64::INFINITY };
        if rate > best * (1.0 + 1e-12) {
            best = rate;
            best_r = r;
        }
    }
    let mut k = vec![0; seqs.len()];
    for &(_, i) in &gains[..best_r] {
        k[i] += 1;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_bound_cost_turns_speculation_off() {
        // Rows as dear as steps: every row costs as much as a whole one-row step.
        let acc = [0.9; 8];
        let seqs = vec![DraftCandidate { acceptance: &acc }; 8];
        let k = choose_draft_lengths(&seqs, 8, 8.0, 64, |rows| rows as f64);
        assert_eq!(k, vec![0; 8]);
    }

    #[test]
    fn cheap_rows_give_positive_draft_lengths() {
        // Memory-bound: 64 rows cost 1.5x one row.
        let acc = [0.8; 8];
        let seqs = vec![DraftCandidate { acceptance: &acc }; 4];
        let k = choose_draft_lengths(&seqs, 4, 4.0, 64, |rows| {
            1.0 + 0.5 * (rows as f64 - 1.0) / 63.0
        });
        assert!(k.iter().all(|&k| k > 0), "{k:?}");
        // Equal sequences get equal lengths.
        assert!(k.windows(2).all(|w| w[0] == w[1]), "{k:?}");
    }

    #[test]
    fn better_acceptance_gets_longer_drafts_and_zero_acceptance_none() {
        let hi = [0.95; 8];
        let lo = [0.0; 8];
        let seqs = [
            DraftCandidate { acceptance: &hi },
            DraftCandidate { acceptance: &lo },
        ];
        let k = choose_draft_lengths(&seqs, 2, 2.0, 64, |rows| 1.0 + 0.1 * rows as f64);
        assert!(k[0] > 0);
        assert_eq!(k[1], 0);
    }

    #[test]
    fn brute_force_agrees_on_small_batches() {
        // Exhaustive search over k in 0..=3 for 3 sequences, several cost curves.
        let accs: [[f64; 3]; 3] = [[0.9, 0.7, 0.5], [0.6, 0.6, 0.6], [0.3, 0.9, 0.9]];
        let curves: [fn(usize) -> f64; 3] = [
            |r| 1.0 + 0.02 * r as f64,
            |r| 1.0 + 0.3 * r as f64,
            |r| (r as f64).sqrt(),
        ];
        for cost in curves {
            let seqs: Vec<_> = accs
                .iter()
                .map(|a| DraftCandidate { acceptance: a })
                .collect();
            let k = choose_draft_lengths(&seqs, 3, 3.0, 9, cost);
            let value = |k: &[usize]| {
                let mut e = 0.0;
                for (a, &ki) in accs.iter().zip(k) {
                    let mut reach = 1.0;
                    e += 1.0;
                    for &x in &a[..ki] {
                        reach *= x;
                        e += reach;
                    }
                }
                e / cost(3 + k.iter().sum::<usize>())
            };
            let mut best = 0.0f64;
            for a in 0..=3 {
                for b in 0..=3 {
                    for c in 0..=3 {
                        best = best.max(value(&[a, b, c]));
                    }
                }
            }
            assert!((value(&k) - best).abs() < 1e-12, "{k:?}");
        }
    }

    #[test]
    fn row_budget_caps_the_drafts() {
        let acc = [1.0; 8];
        let seqs = vec![DraftCandidate { acceptance: &acc }; 4];
        let k = choose_draft_lengths(&seqs, 4, 4.0, 5, |_| 1.0);
        assert_eq!(k.iter().sum::<usize>(), 5);
    }

    #[test]
    fn cost_curve_uses_the_prior_until_two_row_counts() {
        let mut c = BatchCost::default();
        assert_eq!(c.policy_cost(1, 0.1), 1.0);
        c.observe(4, 0.010);
        assert!((c.policy_cost(8, 0.1) - 0.010 * 1.7 / 1.3).abs() < 1e-12);
        c.observe(8, 0.020);
        assert!((c.policy_cost(8, 0.1) - 0.020).abs() < 1e-3);
        assert_eq!(c.row_counts(), 2);
        assert_eq!(c.curve(), vec![(4, 0.010), (8, 0.020)]);
        c.observe(0, 1.0);
        c.observe(3, f64::NAN);
        assert_eq!(c.row_counts(), 2);
    }

    #[test]
    fn validate_rejects_bad_prior() {
        let bad = GoodputConfig {
            prior_row_cost: -1.0,
            ..GoodputConfig::default()
        };
        assert!(bad.validate().is_err());
        assert!(GoodputConfig::default().validate().is_ok());
    }
}
