//! Where the draft-length policies learn step costs from: the measured clock (the default), or
//! a fixed cost curve (exact, reproducible tests and simulations).
//!
//! The adaptive policy of a [`super::Generator`] ([`super::AdaptiveState`]) and the goodput
//! policy of a [`super::BatchGenerator`] ([`super::goodput`]) weigh the tokens a draft is
//! expected to bring against the time it costs. After each step the loop hands them the times
//! it measured, passed through a [`StepCosts`]: [`MeasuredCosts`] (the default) returns them
//! unchanged; [`FixedCosts`] returns the times of a curve given up front, so that the policies'
//! choices depend on the acceptance they observe and not on the machine's load. The metrics
//! ([`super::Metrics`], [`super::BatchMetrics`]) always keep the measured times.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result, check_secs};

/// The step costs the draft-length policies learn from, in seconds.
///
/// The loops call it after each step with what they measured; the value returned is what the
/// policy records. Rows are rows of a target forward: the token before the step plus one per
/// draft token or tree node (`k + 1` for a chain of `k` drafts, `nodes + 1` for a tree, `1` for
/// a plain decoding step); in a batch, every row of the batched forward (prefill chunks, decode
/// rows and drafts of every sequence). Implementations should be cheap (called once per step)
/// and return finite values `>= 0`; with other values the policies' choices are meaningless
/// (the batch's curve ignores them).
///
/// Implemented by [`MeasuredCosts`] (the default of both loops) and [`FixedCosts`]; set one
/// with [`Generator::with_costs`](super::Generator::with_costs) or
/// [`BatchGenerator::with_costs`](super::BatchGenerator::with_costs).
pub trait StepCosts: Send + Sync {
    /// Seconds to record for one target forward over `rows >= 1` rows, which took `measured`
    /// (for a batch step: the forward alone; the rest of the step goes to
    /// [`StepCosts::propose_secs`]).
    fn forward_secs(&self, rows: usize, measured: Duration) -> f64;

    /// Seconds to record for proposing `drafted` draft tokens (tree nodes count one each),
    /// which took `measured` (the proposer's calls for the step; for a batch step: everything
    /// but the forward, proposing and verifying every sequence).
    fn propose_secs(&self, drafted: usize, measured: Duration) -> f64;

    /// Seconds to record for the replay of a step with a rejection on a target in snapshot mode
    /// ([`crate::Rollback::Snapshot`]): restoring the state and a forward over `rows >= 1`
    /// tokens without logits, which took `measured`. The policy's cost of such a step is
    /// `forward_secs(k + 1, ..) + replay_secs(a + 1, ..)` (`a` accepted drafts). The default is
    /// [`StepCosts::forward_secs`]`(rows, measured)`: the replay priced as a forward of its rows.
    fn replay_secs(&self, rows: usize, measured: Duration) -> f64 {
        self.forward_secs(rows, measured)
    }
}

impl<C: StepCosts + ?Sized> StepCosts for Arc<C> {
    fn forward_secs(&self, rows: usize, measured: Duration) -> f64 {
        (**self).forward_secs(rows, measured)
    }

    fn propose_secs(&self, drafted: usize, measured: Duration) -> f64 {
        (**self).propose_secs(drafted, measured)
    }

    fn replay_secs(&self, rows: usize, measured: Duration) -> f64 {
        (**self).replay_secs(rows, measured)
    }
}

/// The measured clock: every cost is the time the loop measured (`measured` in seconds). The
/// default of [`super::Generator`] and [`super::BatchGenerator`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeasuredCosts;

impl StepCosts for MeasuredCosts {
    /// `measured` in seconds.
    fn forward_secs(&self, _rows: usize, measured: Duration) -> f64 {
        measured.as_secs_f64()
    }

    /// `measured` in seconds.
    fn propose_secs(&self, _drafted: usize, measured: Duration) -> f64 {
        measured.as_secs_f64()
    }
}

/// A fixed cost curve: a forward over `n` rows costs [`FixedCosts::forward`]`(n)` seconds and
/// proposing costs a fixed time per draft token, whatever the clock says. Deterministic, so a
/// policy's choices over a seeded run are reproducible on any machine (tests, simulations of a
/// measured curve).
///
/// # Example
/// ```
/// use speculative::decode::{AdaptiveConfig, DraftLength, FixedCosts, GenerationParams, Generator};
/// use speculative::propose::PromptLookup;
/// use speculative::test_util::ToyModel;
///
/// // 10 ms per forward plus 1 ms per row; 0.1 ms per draft token.
/// let costs = FixedCosts::linear(0.010, 0.001).unwrap().with_propose_secs(0.0001).unwrap();
/// assert!((costs.forward(5) - 0.015).abs() < 1e-12);
/// let mut g = Generator::new(ToyModel::c10(), PromptLookup::new(2, 5).unwrap()).with_costs(costs);
/// let params = GenerationParams::greedy(32).with_draft(DraftLength::Adaptive(AdaptiveConfig::default()));
/// assert_eq!(g.generate(&[3; 48], &params).unwrap().tokens.len(), 32);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct FixedCosts {
    curve: Curve,
    propose_per_token: f64,
}

#[derive(Debug, Clone, PartialEq)]
enum Curve {
    Linear { base: f64, per_row: f64 },
    Points(Vec<(usize, f64)>),
}

impl FixedCosts {
    /// A forward over `n` rows costs `base_secs + per_row_secs * n` seconds; proposing is free
    /// until [`FixedCosts::with_propose_secs`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `base_secs` or `per_row_secs` is negative or not finite.
    pub fn linear(base_secs: f64, per_row_secs: f64) -> Result<Self> {
        check_secs("base_secs", base_secs)?;
        check_secs("per_row_secs", per_row_secs)?;
        Ok(FixedCosts {
            curve: Curve::Linear {
                base: base_secs,
                per_row: per_row_secs,
            },
            propose_per_token: 0.0,
        })
    }

    /// A forward over `n` rows costs what the curve `points` (`(rows, seconds)`, rows strictly
    /// increasing from at least 1) says: the point's seconds at a listed row count, linear
    /// between two listed ones, the first point's below the first, and beyond the last the line
    /// through the last two points (the last point's seconds with a single point), never below
    /// 0. Proposing is free until [`FixedCosts::with_propose_secs`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `points` is empty, a row count is 0 or not above the one
    /// before it, or a time is negative or not finite.
    pub fn curve(points: &[(usize, f64)]) -> Result<Self> {
        if points.is_empty() {
            return Err(Error::config(
                "points",
                "[]",
                "a cost curve needs at least one (rows, seconds) point",
            ));
        }
        let mut before = 0;
        for &(rows, secs) in points {
            if rows <= before {
                return Err(Error::config(
                    "points",
                    rows,
                    "row counts must be >= 1 and strictly increasing",
                ));
            }
            check_secs("points", secs)?;
            before = rows;
        }
        Ok(FixedCosts {
            curve: Curve::Points(points.to_vec()),
            propose_per_token: 0.0,
        })
    }

    /// Sets the cost of proposing: `per_token_secs` seconds per draft token (or tree node).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `per_token_secs` is negative or not finite.
    pub fn with_propose_secs(mut self, per_token_secs: f64) -> Result<Self> {
        check_secs("per_token_secs", per_token_secs)?;
        self.propose_per_token = per_token_secs;
        Ok(self)
    }

    /// Seconds of a forward over `rows` rows on this curve.
    pub fn forward(&self, rows: usize) -> f64 {
        let n = rows as f64;
        match &self.curve {
            Curve::Linear { base, per_row } => base + per_row * n,
            Curve::Points(p) => {
                let i = p.partition_point(|&(r, _)| r < rows);
                let at = |j: usize| (p[j].0 as f64, p[j].1);
                let line = |(x0, y0): (f64, f64), (x1, y1): (f64, f64)| {
                    (y0 + (y1 - y0) * (n - x0) / (x1 - x0)).max(0.0)
                };
                if i < p.len() && p[i].0 == rows {
                    p[i].1
                } else if i == 0 || p.len() == 1 {
                    p[0].1
                } else if i == p.len() {
                    line(at(i - 2), at(i - 1))
                } else {
                    line(at(i - 1), at(i))
                }
            }
        }
    }

    /// Seconds of proposing `drafted` draft tokens: `drafted` times the per-token time.
    pub fn propose(&self, drafted: usize) -> f64 {
        self.propose_per_token * drafted as f64
    }
}

impl StepCosts for FixedCosts {
    /// [`FixedCosts::forward`]`(rows)`; `measured` is ignored.
    fn forward_secs(&self, rows: usize, _measured: Duration) -> f64 {
        self.forward(rows)
    }

    /// [`FixedCosts::propose`]`(drafted)`; `measured` is ignored.
    fn propose_secs(&self, drafted: usize, _measured: Duration) -> f64 {
        self.propose(drafted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_passes_the_clock_through() {
        let d = Duration::from_micros(1500);
        assert_eq!(MeasuredCosts.forward_secs(9, d), 0.0015);
        assert_eq!(MeasuredCosts.propose_secs(0, d), 0.0015);
    }

    #[test]
    fn linear_and_curve_costs() {
        let c = FixedCosts::linear(0.01, 0.002)
            .unwrap()
            .with_propose_secs(0.0005)
            .unwrap();
        assert!((c.forward_secs(4, Duration::from_secs(9)) - 0.018).abs() < 1e-15);
        assert!((c.propose_secs(4, Duration::from_secs(9)) - 0.002).abs() < 1e-15);
        let c = FixedCosts::curve(&[(1, 1.0), (9, 1.5), (17, 2.5)]).unwrap();
        assert_eq!(c.forward(1), 1.0);
        assert_eq!(c.forward(9), 1.5);
        assert!((c.forward(5) - 1.25).abs() < 1e-15);
        assert!((c.forward(13) - 2.0).abs() < 1e-15);
        // Beyond the last point: the line through the last two.
        assert!((c.forward(25) - 3.5).abs() < 1e-15);
        assert_eq!(c.propose(8), 0.0);
        let c = FixedCosts::curve(&[(2, 1.0), (4, 0.5)]).unwrap();
        assert_eq!(c.forward(1), 1.0, "the first point below it");
        assert_eq!(c.forward(100), 0.0, "never below 0");
        let c = FixedCosts::curve(&[(3, 0.7)]).unwrap();
        assert_eq!((c.forward(1), c.forward(3), c.forward(50)), (0.7, 0.7, 0.7));
        // Shared sources.
        let shared: Arc<dyn StepCosts> = Arc::new(c);
        assert_eq!(shared.forward_secs(2, Duration::ZERO), 0.7);
    }

    #[test]
    fn constructors_validate() {
        assert!(FixedCosts::linear(-1.0, 0.0).is_err());
        assert!(FixedCosts::linear(0.0, f64::NAN).is_err());
        assert!(FixedCosts::curve(&[]).is_err());
        assert!(FixedCosts::curve(&[(0, 1.0)]).is_err());
        assert!(FixedCosts::curve(&[(2, 1.0), (2, 1.0)]).is_err());
        assert!(FixedCosts::curve(&[(2, 1.0), (1, 1.0)]).is_err());
        assert!(FixedCosts::curve(&[(1, f64::INFINITY)]).is_err());
        let ok = FixedCosts::linear(0.0, 0.0).unwrap();
        assert!(ok.clone().with_propose_secs(-0.1).is_err());
        assert!(ok.with_propose_secs(0.0).is_ok());
    }
}
