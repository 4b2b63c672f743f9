//! Timing samples and cost curves of the adaptive draft-length policies
//! ([`crate::decode::AdaptiveState`], the goodput policy of [`crate::decode::goodput`]) and of
//! the cost-aware merge ([`crate::propose::MergedProposer`]): the last forward (or proposing)
//! times per row count, their medians, and the curves read from them.
//!
//! Timing noise on a shared machine is one-sided (a descheduled thread or a page fault only adds
//! time), so the policies read medians of the last samples rather than moving averages: one
//! forward that took ten times a plain step cannot move the estimate (Chen and Revels 2016,
//! "Robust benchmarking in noisy environments", prefer the minimum over the mean for the same
//! reason).

/// The last [`RowSamples::CAP`] times (seconds) of one row count, or of one draft length's
/// proposing (a ring).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RowSamples {
    buf: [f64; RowSamples::CAP],
    len: u8,
    next: u8,
    /// The step count of its owner (the policy's or the curve's steps) at the last sample.
    last: usize,
}

impl RowSamples {
    pub(crate) const CAP: usize = 7;
    /// Per step since the last sample, the weight of a row count's samples is multiplied by
    /// this (a half-life of about 34 steps).
    const AGING: f64 = 0.98;

    /// Adds the time `x` taken at step `step` (the oldest of a full ring is dropped).
    pub(crate) fn push(&mut self, x: f64, step: usize) {
        self.last = step;
        self.buf[self.next as usize] = x;
        self.next = ((self.next as usize + 1) % Self::CAP) as u8;
        self.len = (self.len as usize + 1).min(Self::CAP) as u8;
    }

    /// The median of the samples (`None` before the first).
    pub(crate) fn median(&self) -> Option<f64> {
        let n = self.len as usize;
        if n == 0 {
            return None;
        }
        let mut v = self.buf;
        let v = &mut v[..n];
        v.sort_unstable_by(f64::total_cmp);
        Some(if n % 2 == 1 {
            v[n / 2]
        } else {
            0.5 * (v[n / 2 - 1] + v[n / 2])
        })
    }

    /// Forgets every sample and keeps `x` alone (a re-measure that found the estimate too
    /// high).
    pub(crate) fn reset_to(&mut self, x: f64, step: usize) {
        *self = RowSamples::default();
        self.push(x, step);
    }
}

/// The robust cost curve of [`crate::decode::AdaptiveState::tree_forward_cost`] over
/// per-row-count samples (`samples[n]`: the times of forwards of `n` rows), `steps` being the
/// current step count: per measured count its median, where above the weighted least-squares
/// line through all of them shrunk toward it as `(m * median + line) / (m + 1)` with `m` the
/// count's samples aged by [`RowSamples::AGING`] per step since its last one; linear between
/// measured counts, the line outside them.
pub(crate) fn robust_cost(samples: &[RowSamples], steps: usize, rows: usize) -> Option<f64> {
    RobustCurve::fit(samples, steps).at(rows)
}

/// The curve of [`robust_cost`] fitted once, to be read at many row counts (the cost-aware
/// merge prices every candidate node of a step on it).
#[derive(Debug, Clone, Default)]
pub(crate) struct RobustCurve {
    /// `(rows, estimate)` of each measured row count, by rows.
    pts: Vec<(usize, f64)>,
    /// The weighted least-squares line: mean rows, mean seconds, slope (at least 0).
    mx: f64,
    my: f64,
    slope: f64,
}

impl RobustCurve {
    /// Fits the curve to `samples` (`samples[n]`: the times of `n` rows) at step `steps`.
    pub(crate) fn fit(samples: &[RowSamples], steps: usize) -> RobustCurve {
        let pts: Vec<(usize, f64, f64)> = samples
            .iter()
            .enumerate()
            .filter_map(|(n, r)| {
                let age = steps.saturating_sub(r.last).min(100_000) as i32;
                let w = r.len as f64 * RowSamples::AGING.powi(age);
                r.median().map(|m| (n, m, w.max(1e-9)))
            })
            .collect();
        if pts.is_empty() {
            return RobustCurve::default();
        }
        let w: f64 = pts.iter().map(|p| p.2).sum();
        let mx = pts.iter().map(|p| p.2 * p.0 as f64).sum::<f64>() / w;
        let my = pts.iter().map(|p| p.2 * p.1).sum::<f64>() / w;
        let sxy: f64 = pts
            .iter()
            .map(|p| p.2 * (p.0 as f64 - mx) * (p.1 - my))
            .sum();
        let sxx: f64 = pts.iter().map(|p| p.2 * (p.0 as f64 - mx).powi(2)).sum();
        let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        let mut curve = RobustCurve {
            pts: Vec::with_capacity(pts.len()),
            mx,
            my,
            slope,
        };
        // Timing noise only adds time: a median above the line is shrunk toward it by its
        // evidence, one below it is kept as measured.
        for &(n, m, c) in &pts {
            let est = ((c * m + curve.line(n)) / (c + 1.0)).min(m);
            curve.pts.push((n, est));
        }
        curve
    }

    fn line(&self, n: usize) -> f64 {
        (self.my + self.slope * (n as f64 - self.mx)).max(1e-12)
    }

    /// The seconds at `rows` rows: linear between measured counts, the line outside them
    /// (kept at or above the nearest measured count below, at or below the nearest above);
    /// `None` before any sample.
    pub(crate) fn at(&self, rows: usize) -> Option<f64> {
        if self.pts.is_empty() {
            return None;
        }
        let i = self.pts.partition_point(|p| p.0 < rows);
        let above = self.pts.get(i).copied();
        let below = match above {
            Some(p) if p.0 == rows => Some(p),
            _ => i.checked_sub(1).map(|j| self.pts[j]),
        };
        Some(match (below, above) {
            (Some((a, ca)), Some((b, cb))) if b > a => {
                ca + (cb - ca) * (rows - a) as f64 / (b - a) as f64
            }
            (Some((_, ca)), Some(_)) => ca,
            (Some((_, ca)), None) => self.line(rows).max(ca),
            (None, Some((_, cb))) => self.line(rows).min(cb),
            (None, None) => self.line(rows),
        })
    }
}

/// A cost curve by row count (index `n`) read at `n`: its value there, else the least-squares
/// line through the measured row counts (slope at least 0; a single measured count: its
/// value). `None` when nothing was measured.
pub(crate) fn curve_at(curve: &[Option<f64>], n: usize) -> Option<f64> {
    if let Some(Some(c)) = curve.get(n) {
        return Some(*c);
    }
    let pts: Vec<(f64, f64)> = curve
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

/// The median curve of per-row-count samples (`samples[n]`: the last times of `n` rows) read
/// at `n`: the median there, else the least-squares line through the measured medians as
/// [`curve_at`] reads it. `None` before any sample.
pub(crate) fn median_curve(samples: &[RowSamples], n: usize) -> Option<f64> {
    if let Some(m) = samples.get(n).and_then(RowSamples::median) {
        return Some(m);
    }
    let medians: Vec<Option<f64>> = samples.iter().map(RowSamples::median).collect();
    curve_at(&medians, n)
}

/// Estimated proposing seconds of a draft of `k` tokens (or nodes) from the last proposing
/// times by draft length (`samples[j]`: seconds of whole drafting steps of `j` tokens),
/// modelled as `f + k t`: a fixed part per step (a draft model's catch-up forward over the
/// tokens accepted since its last draft) and a part per drafted token.
///
/// At a measured `k`: its median. With one measured length `j`: `P(j) k / j` (no fixed part
/// is known). With two or more: linear between the measured lengths around `k`; below the
/// shortest `lo` the least-squares line through the medians, kept within `[P(lo) k / lo,
/// P(lo)]`; above the longest `hi` the line kept within `[P(hi), P(hi) k / hi]` (the bounds
/// that hold for any `f, t >= 0`). `0` for `k = 0`; `None` before any sample.
pub(crate) fn propose_curve(samples: &[RowSamples], k: usize) -> Option<f64> {
    if let Some(m) = samples
        .get(k)
        .filter(|_| k > 0)
        .and_then(RowSamples::median)
    {
        return Some(m);
    }
    let pts: Vec<(usize, f64)> = samples
        .iter()
        .enumerate()
        .filter_map(|(j, r)| r.median().filter(|_| j > 0).map(|m| (j, m)))
        .collect();
    if k == 0 {
        return pts.first().map(|_| 0.0);
    }
    let (&(lo, p_lo), &(hi, p_hi)) = (pts.first()?, pts.last()?);
    if let Some(&(_, m)) = pts.iter().find(|p| p.0 == k) {
        return Some(m);
    }
    if pts.len() == 1 {
        return Some(p_lo * k as f64 / lo as f64);
    }
    if k > lo && k < hi {
        let (a, pa) = *pts.iter().rev().find(|p| p.0 < k)?;
        let (b, pb) = *pts.iter().find(|p| p.0 > k)?;
        return Some(pa + (pb - pa) * (k - a) as f64 / (b - a) as f64);
    }
    let line = least_squares(&pts);
    let x = k as f64;
    Some(if k < lo {
        line(x).clamp(p_lo * x / lo as f64, p_lo)
    } else {
        line(x).clamp(p_hi, p_hi * x / hi as f64)
    })
}

/// The least-squares line through `pts` (`(x, y)`, at least two distinct `x`).
fn least_squares(pts: &[(usize, f64)]) -> impl Fn(f64) -> f64 {
    let m = pts.len() as f64;
    let mx = pts.iter().map(|p| p.0 as f64).sum::<f64>() / m;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / m;
    let sxy: f64 = pts.iter().map(|p| (p.0 as f64 - mx) * (p.1 - my)).sum();
    let sxx: f64 = pts.iter().map(|p| (p.0 as f64 - mx).powi(2)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    move |x| my + slope * (x - mx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(pts: &[(usize, &[f64])]) -> Vec<RowSamples> {
        let mut v = vec![RowSamples::default(); pts.iter().map(|p| p.0).max().unwrap_or(0) + 1];
        for &(n, xs) in pts {
            for &x in xs {
                v[n].push(x, 0);
            }
        }
        v
    }

    #[test]
    fn the_median_curve_ignores_a_slow_sample() {
        let s = samples(&[(1, &[0.014, 0.186, 0.015]), (3, &[0.030])]);
        assert_eq!(median_curve(&s, 1), Some(0.015));
        assert!((median_curve(&s, 2).unwrap() - 0.0225).abs() < 1e-12);
        assert_eq!(median_curve(&[], 1), None);
    }

    #[test]
    fn a_median_below_the_line_is_kept_and_one_above_it_is_shrunk() {
        // Fresh medians 10, 20, 30, 24 ms at 1-4 rows (4 rows cheap: tiled kernels), then
        // one 5-row sample of 80 ms: 4 rows are read as measured, 5 half-way to the line.
        let mut s = samples(&[(1, &[0.010; 7]), (2, &[0.020; 7]), (3, &[0.030; 7])]);
        s.resize(6, RowSamples::default());
        for _ in 0..7 {
            s[4].push(0.024, 0);
        }
        s[5].push(0.080, 0);
        assert!((robust_cost(&s, 0, 4).unwrap() - 0.024).abs() < 1e-12);
        let five = robust_cost(&s, 0, 5).unwrap();
        assert!(five > 0.050 && five < 0.070, "{five}");
        // Aged 200 steps while the others stay fresh, the 5-row sample is the line's.
        for r in &mut s[1..5] {
            r.last = 200;
        }
        let aged = robust_cost(&s, 200, 5).unwrap();
        assert!(aged < 0.035, "{aged}");
    }

    #[test]
    fn a_re_measure_resets_the_samples() {
        let mut r = RowSamples::default();
        for _ in 0..5 {
            r.push(0.040, 1);
        }
        r.reset_to(0.014, 2);
        assert_eq!(r.median(), Some(0.014));
        assert_eq!(r.last, 2);
    }

    #[test]
    fn proposing_time_is_a_catch_up_plus_a_part_per_token() {
        // 8 ms per step plus 8 ms a token, measured at 2 and 6 tokens.
        let s = samples(&[(2, &[0.024]), (6, &[0.056, 0.3, 0.056])]);
        let p = |k| propose_curve(&s, k).unwrap();
        assert_eq!(p(0), 0.0);
        assert_eq!(p(2), 0.024);
        assert_eq!(p(6), 0.056);
        assert!((p(4) - 0.040).abs() < 1e-12);
        assert!((p(1) - 0.016).abs() < 1e-12);
        assert!((p(8) - 0.072).abs() < 1e-12);
        // One measured length: proportional.
        let one = samples(&[(2, &[0.024])]);
        assert!((propose_curve(&one, 1).unwrap() - 0.012).abs() < 1e-12);
        assert!((propose_curve(&one, 6).unwrap() - 0.072).abs() < 1e-12);
        assert_eq!(propose_curve(&[], 3), None);
    }

    #[test]
    fn proposing_time_outside_the_measured_lengths_stays_within_its_bounds() {
        // Noisy medians whose line has a negative intercept (2 tokens 10 ms, 3 tokens 20 ms):
        // one token is at least half of two (no negative catch-up), at most two tokens' time.
        let s = samples(&[(2, &[0.010]), (3, &[0.020])]);
        assert!((propose_curve(&s, 1).unwrap() - 0.005).abs() < 1e-12);
        // A line that falls (3 tokens cheaper than 2): longer drafts cost at least the
        // longest measured one.
        let s = samples(&[(2, &[0.020]), (3, &[0.015])]);
        assert!((propose_curve(&s, 5).unwrap() - 0.015).abs() < 1e-12);
        assert!((propose_curve(&s, 1).unwrap() - 0.020).abs() < 1e-12);
    }
}
