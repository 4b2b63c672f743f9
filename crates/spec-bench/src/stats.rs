//! Small statistics helpers: percentiles, mean and spread.

use serde::{Deserialize, Serialize};

/// Percentile `q` in `[0, 100]` of `xs` by linear interpolation between closest ranks
/// (the "R-7" / NumPy default definition). `None` for an empty slice.
pub fn percentile(xs: &[f64], q: f64) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let h = (v.len() - 1) as f64 * (q.clamp(0.0, 100.0) / 100.0);
    let lo = h.floor() as usize;
    let hi = h.ceil() as usize;
    Some(v[lo] + (h - lo as f64) * (v[hi] - v[lo]))
}

/// Mean, sample standard deviation, min and max of a sample.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Summary {
    /// Number of values.
    pub n: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Sample standard deviation (n - 1 in the denominator; 0 for n < 2).
    pub std: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// Median.
    pub median: f64,
}

impl Summary {
    /// Summary of `xs` (all zeros when empty).
    pub fn of(xs: &[f64]) -> Self {
        if xs.is_empty() {
            return Summary::default();
        }
        let n = xs.len();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let std = if n > 1 {
            (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        Summary {
            n,
            mean,
            std,
            min: xs.iter().copied().fold(f64::INFINITY, f64::min),
            max: xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            median: percentile(xs, 50.0).unwrap_or(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let xs = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&xs, 0.0), Some(1.0));
        assert_eq!(percentile(&xs, 50.0), Some(2.5));
        assert_eq!(percentile(&xs, 100.0), Some(4.0));
        assert!((percentile(&xs, 90.0).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[], 50.0), None);
        let s = Summary::of(&[2.0, 4.0]);
        assert_eq!((s.mean, s.min, s.max, s.median), (3.0, 2.0, 4.0, 3.0));
        assert!((s.std - 2f64.sqrt()).abs() < 1e-12);
    }
}
