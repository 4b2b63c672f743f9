//! Batch-size simulator: does speculation still pay at large batch sizes?
//!
//! The model is replaced by a cost table `c(batch, tokens)`: the wall time of one target forward
//! in which each of `batch` sequences feeds `tokens` new tokens (`tokens = k + 1` for a verify
//! call with `k` drafts, `1` for plain decoding). Acceptance behaviour comes either from a
//! constant per-position acceptance probability `a` or from steps recorded by real runs.
//!
//! Expected speed-up of draft length `k` at batch size `B`:
//!
//! `S(B, k) = E[tokens per step](k) * c(B, 1) / c(B, k + 1)`
//!
//! with `E[tokens per step](k) = sum_{j=0..k} a^j = (1 - a^(k+1)) / (1 - a)` for a constant `a`
//! (Leviathan et al. 2023, equation 1), or the mean over recorded steps of
//! `min(accepted, k) + 1` for a trace.
//!
//! Assumptions (documented in docs/simulator.md): every sequence of the batch uses the same `k`
//! and shorter drafts are padded, so a step costs `c(B, k + 1)`; the proposer's own cost is
//! ignored (model-free proposers cost microseconds); a recorded step whose drafts were all
//! accepted is taken to accept `min(accepted, k)` also for larger `k`, which underestimates
//! speculation for `k` beyond the recorded draft length; between table points the cost is
//! interpolated linearly in both coordinates and extrapolated linearly from the last two points.

use serde::{Deserialize, Serialize};

use crate::error::{BenchError, Result};
use crate::run::StepRecord;

/// A cost table `c(batch, tokens)` in seconds (or any consistent unit: only ratios matter).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostTable {
    /// Where the numbers come from (free text, printed in reports).
    #[serde(default)]
    pub source: String,
    /// Batch sizes, increasing.
    pub batch: Vec<usize>,
    /// Tokens per sequence, increasing (must include 1).
    pub tokens: Vec<usize>,
    /// `cost[i][j]` = time of one forward with `batch[i]` sequences each feeding `tokens[j]`.
    pub cost: Vec<Vec<f64>>,
}

fn interp(xs: &[f64], ys: &[f64], x: f64) -> f64 {
    if xs.len() == 1 {
        return ys[0];
    }
    let mut i = xs.partition_point(|&v| v <= x);
    i = i.clamp(1, xs.len() - 1);
    let (x0, x1, y0, y1) = (xs[i - 1], xs[i], ys[i - 1], ys[i]);
    y0 + (y1 - y0) * (x - x0) / (x1 - x0)
}

impl CostTable {
    /// Parses a JSON cost table and validates it.
    ///
    /// # Errors
    /// [`BenchError::Invalid`] for malformed JSON or a table that fails [`CostTable::validate`].
    pub fn from_json(text: &str) -> Result<Self> {
        let t: CostTable = serde_json::from_str(text).map_err(|e| BenchError::Invalid {
            what: "cost table",
            reason: e.to_string(),
        })?;
        t.validate()?;
        Ok(t)
    }

    /// Checks shapes, ordering and positivity.
    ///
    /// # Errors
    /// [`BenchError::Invalid`] when the axes are empty or not strictly increasing, `tokens` does
    /// not contain 1, the cost matrix is not `[batch.len(), tokens.len()]`, or a cost is not a
    /// positive finite number.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: &str| {
            Err(BenchError::Invalid {
                what: "cost table",
                reason: reason.into(),
            })
        };
        if self.batch.is_empty() || self.tokens.is_empty() {
            return bad("empty axis");
        }
        if self.batch.windows(2).any(|w| w[1] <= w[0])
            || self.tokens.windows(2).any(|w| w[1] <= w[0])
        {
            return bad("axes must be strictly increasing");
        }
        if self.batch[0] == 0 || !self.tokens.contains(&1) {
            return bad("batch sizes must be >= 1 and tokens must include 1");
        }
        if self.cost.len() != self.batch.len()
            || self.cost.iter().any(|r| r.len() != self.tokens.len())
        {
            return bad("cost must be [batch.len()][tokens.len()]");
        }
        if self
            .cost
            .iter()
            .flatten()
            .any(|&c| !(c.is_finite() && c > 0.0))
        {
            return bad("every cost must be positive and finite");
        }
        Ok(())
    }

    /// Interpolated cost of a forward with `batch` sequences of `tokens` new tokens each.
    pub fn cost(&self, batch: usize, tokens: usize) -> f64 {
        let tx: Vec<f64> = self.tokens.iter().map(|&t| t as f64).collect();
        let per_batch: Vec<f64> = self
            .cost
            .iter()
            .map(|row| interp(&tx, row, tokens as f64))
            .collect();
        let bx: Vec<f64> = self.batch.iter().map(|&b| b as f64).collect();
        interp(&bx, &per_batch, batch as f64).max(f64::MIN_POSITIVE)
    }
}

/// How drafts are accepted in the simulation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AcceptanceModel {
    /// Every draft position is accepted with probability `a`, independently.
    Constant(f64),
    /// Steps recorded by real runs (their `k` and `accepted`); steps with `k = 0` are ignored.
    Trace(Vec<StepRecord>),
}

impl AcceptanceModel {
    /// Expected tokens emitted per verify step with draft length `k` (bonus included).
    pub fn expected_tokens(&self, k: usize) -> f64 {
        match self {
            AcceptanceModel::Constant(a) => (0..=k).map(|j| a.powi(j as i32)).sum(),
            AcceptanceModel::Trace(steps) => {
                let used: Vec<&StepRecord> = steps.iter().filter(|s| s.k > 0).collect();
                if used.is_empty() {
                    return 1.0;
                }
                used.iter()
                    .map(|s| (s.accepted.min(k) + 1) as f64)
                    .sum::<f64>()
                    / used.len() as f64
            }
        }
    }
}

/// One cell of the simulated grid.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SimCell {
    /// Batch size.
    pub batch: usize,
    /// Draft length.
    pub k: usize,
    /// Expected tokens per verify step and sequence.
    pub tokens_per_step: f64,
    /// `c(batch, k + 1) / c(batch, 1)`.
    pub relative_cost: f64,
    /// Expected speed-up over plain decoding at the same batch size.
    pub speedup: f64,
}

/// The simulator's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimResult {
    /// Every `(batch, k)` cell.
    pub grid: Vec<SimCell>,
    /// Per batch size, the best cell (`k = 0` when speculation does not pay).
    pub best: Vec<SimCell>,
}

/// Simulates every batch size in `batches` and draft length `k` in `0..=max_draft`, with a
/// proposer that costs nothing (model-free proposers cost microseconds); see [`simulate_draft`].
pub fn simulate(
    table: &CostTable,
    acc: &AcceptanceModel,
    batches: &[usize],
    max_draft: usize,
) -> SimResult {
    simulate_draft(table, acc, batches, max_draft, 0.0)
}

/// As [`simulate`], with a draft model whose forward of one token costs `draft_cost` (a ratio,
/// dimensionless) times the target's single-token forward at the same batch size, `c(B, 1)`.
/// A step of draft length `k` then costs `c(B, k + 1) + k * draft_cost * c(B, 1)` (`k`
/// sequential draft forwards, the draft's catch-up on the accepted tokens counted in the first
/// one), so `relative_cost` is `c(B, k + 1) / c(B, 1) + k * draft_cost` and the speed-up
/// `E[tokens per step](k) / relative_cost` (Leviathan et al. 2023, section 3.4, with the
/// measured verify cost in place of their `1`). `k = 0` is plain decoding (speed-up 1).
/// `draft_cost` below 0 or not finite counts as 0.
pub fn simulate_draft(
    table: &CostTable,
    acc: &AcceptanceModel,
    batches: &[usize],
    max_draft: usize,
    draft_cost: f64,
) -> SimResult {
    let draft_cost = if draft_cost.is_finite() {
        draft_cost.max(0.0)
    } else {
        0.0
    };
    let mut grid = Vec::new();
    let mut best = Vec::new();
    for &b in batches {
        let base = table.cost(b, 1);
        let mut top: Option<SimCell> = None;
        for k in 0..=max_draft {
            let rel = table.cost(b, k + 1) / base + k as f64 * draft_cost;
            let e = acc.expected_tokens(k);
            let cell = SimCell {
                batch: b,
                k,
                tokens_per_step: e,
                relative_cost: rel,
                speedup: e / rel,
            };
            if top.is_none_or(|t| cell.speedup > t.speedup) {
                top = Some(cell);
            }
            grid.push(cell);
        }
        best.extend(top);
    }
    SimResult { grid, best }
}

/// The batch sizes reported by default: powers of two from 1 to 256.
pub fn default_batches() -> Vec<usize> {
    (0..=8).map(|i| 1usize << i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat() -> CostTable {
        CostTable {
            source: "test".into(),
            batch: vec![1, 256],
            tokens: vec![1, 9],
            cost: vec![vec![1.0, 1.0], vec![1.0, 1.0]],
        }
    }

    #[test]
    fn constant_acceptance_closed_form() {
        for a in [0.0, 0.3, 0.6, 0.9] {
            for k in 0..=8 {
                let want = if a == 0.0 {
                    1.0
                } else {
                    (1.0 - f64::powi(a, k as i32 + 1)) / (1.0 - a)
                };
                let got = AcceptanceModel::Constant(a).expected_tokens(k);
                assert!((got - want).abs() < 1e-12, "a={a} k={k}");
            }
        }
        // With flat costs the speed-up is the expected tokens per step.
        let r = simulate(&flat(), &AcceptanceModel::Constant(0.8), &[1, 64], 8);
        let c = r.grid.iter().find(|c| c.batch == 64 && c.k == 4).unwrap();
        assert!((c.speedup - (1.0 - 0.8f64.powi(5)) / 0.2).abs() < 1e-12);
        assert_eq!(r.best[0].k, 8);
    }

    #[test]
    fn trace_replay_and_interpolation() {
        let steps = vec![
            StepRecord {
                position: 0,
                k: 4,
                accepted: 4,
                emitted: 5,
                tree_depth: None,
            },
            StepRecord {
                position: 5,
                k: 4,
                accepted: 1,
                emitted: 2,
                tree_depth: None,
            },
            StepRecord {
                position: 7,
                k: 0,
                accepted: 0,
                emitted: 1,
                tree_depth: None,
            },
        ];
        let m = AcceptanceModel::Trace(steps);
        assert_eq!(m.expected_tokens(0), 1.0);
        assert_eq!(m.expected_tokens(2), (3.0 + 2.0) / 2.0);
        let t = CostTable {
            source: String::new(),
            batch: vec![1, 4],
            tokens: vec![1, 3],
            cost: vec![vec![1.0, 2.0], vec![2.0, 6.0]],
        };
        assert_eq!(t.cost(1, 2), 1.5);
        assert_eq!(t.cost(4, 3), 6.0);
        assert!((t.cost(2, 1) - 4.0 / 3.0).abs() < 1e-12);
        assert_eq!(t.cost(1, 5), 3.0); // linear extrapolation: 1 + 0.5 * (5 - 1)
    }

    #[test]
    fn draft_cost_adds_k_draft_forwards() {
        let t = flat();
        let acc = AcceptanceModel::Constant(0.8);
        let free = simulate(&t, &acc, &[1], 4);
        let paid = simulate_draft(&t, &acc, &[1], 4, 0.1);
        for (f, p) in free.grid.iter().zip(&paid.grid) {
            assert!((p.relative_cost - f.relative_cost - 0.1 * f.k as f64).abs() < 1e-12);
            assert!((p.speedup - p.tokens_per_step / p.relative_cost).abs() < 1e-12);
        }
        // At a draft cost of 1 per token and a flat table nothing pays: the best is k = 0.
        let r = simulate_draft(&t, &acc, &[1], 4, 1.0);
        assert_eq!(r.best[0].k, 0);
        assert_eq!(simulate_draft(&t, &acc, &[1], 4, f64::NAN), free);
    }

    #[test]
    fn speculation_stops_paying_when_verify_is_compute_bound() {
        // Cost grows linearly in batch * tokens beyond batch 16 (compute-bound).
        let batch = vec![1, 16, 64, 256];
        let tokens = vec![1, 2, 5, 9];
        let cost = batch
            .iter()
            .map(|&b| {
                tokens
                    .iter()
                    .map(|&n| ((b * n) as f64 / 16.0).max(1.0))
                    .collect()
            })
            .collect();
        let t = CostTable {
            source: String::new(),
            batch,
            tokens,
            cost,
        };
        t.validate().unwrap();
        let r = simulate(&t, &AcceptanceModel::Constant(0.7), &[1, 256], 8);
        assert!(r.best[0].k >= 4);
        assert_eq!(r.best[1].k, 0);
    }

    #[test]
    fn invalid_tables() {
        let mut t = flat();
        t.tokens = vec![2, 9];
        assert!(t.validate().is_err());
        assert!(
            CostTable::from_json("{\"batch\": [1], \"tokens\": [1], \"cost\": [[0.0]]}").is_err()
        );
        assert!(CostTable::from_json("{\"batch\": [1], \"tokens\": [1]}").is_err());
        assert!(
            CostTable::from_json("{\"batch\": [1], \"tokens\": [1], \"cost\": [[1.0]]}").is_ok()
        );
    }
}
