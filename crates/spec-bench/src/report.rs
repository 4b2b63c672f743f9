//! Aggregates, the markdown table, the JSON file and the SVG plots.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{BenchError, Result};
use crate::run::RunRecord;
use crate::sim::SimResult;
use crate::stats::{Summary, percentile};

/// Figures aggregated over the runs of one (workload kind, configuration label).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Aggregate {
    /// Workload kind.
    pub kind: String,
    /// Configuration label (`plain` for the baseline).
    pub label: String,
    /// Number of runs.
    pub runs: usize,
    /// End-to-end latency in seconds.
    pub e2e_s: Summary,
    /// Time to first token in seconds.
    pub ttft_s: Summary,
    /// Time per output token after the first, seconds: `(e2e - ttft) / (tokens - 1)` per run.
    pub tpot_s: Summary,
    /// Inter-token latency percentiles over all tokens of all runs, seconds: p50, p90, p99.
    /// Tokens that arrive in the same verified block have latency 0, so speculative runs often
    /// have p50 = 0; see `tpot_s` for the mean.
    pub itl_p50_s: f64,
    /// p90 inter-token latency (s).
    pub itl_p90_s: f64,
    /// p99 inter-token latency (s).
    pub itl_p99_s: f64,
    /// Output tokens per second.
    pub tokens_per_s: Summary,
    /// Peak resident memory (KiB), the largest over the runs.
    pub peak_rss_kib: Option<u64>,
    /// Share of decode time in the proposer.
    pub propose_share: f64,
    /// Share of decode time in target forwards and verification.
    pub verify_share: f64,
    /// Acceptance rate over all steps.
    pub acceptance_rate: f64,
    /// Mean accepted length (emitted / target calls) over all steps.
    pub mean_accepted_length: f64,
    /// Acceptance by draft position (accepted / reached).
    pub by_position: Vec<f64>,
    /// Acceptance rate by output position, in buckets of `OUTPUT_BUCKET` tokens.
    pub by_output_position: Vec<f64>,
    /// Speed-up against the paired baseline (speculative runs), end to end (prefill included).
    pub speedup: Option<Summary>,
    /// Decode speed-up against the paired baseline (prefill excluded; speculative runs).
    /// Absent in files written before it was recorded.
    #[serde(default)]
    pub decode_speedup: Option<Summary>,
    /// Greedy runs whose output equalled plain greedy, and greedy runs.
    pub greedy_identical: Option<(usize, usize)>,
    /// Share of the prompt tokens found in the cache (prefix reuse), over all runs.
    #[serde(default)]
    pub prompt_reused_share: f64,
    /// Reuse-on runs whose output equalled the same run with reuse off, and such runs (when
    /// both modes ran).
    #[serde(default)]
    pub reuse_identical: Option<(usize, usize)>,
}

/// Bucket width (tokens) of acceptance by output position.
pub const OUTPUT_BUCKET: usize = 32;

/// Aggregates records by (kind, label), plus an `all` kind over every request.
pub fn aggregate(records: &[RunRecord]) -> Vec<Aggregate> {
    let mut groups: BTreeMap<(String, String), Vec<&RunRecord>> = BTreeMap::new();
    for r in records {
        groups
            .entry((r.kind.clone(), r.label.clone()))
            .or_default()
            .push(r);
        groups
            .entry(("all".into(), r.label.clone()))
            .or_default()
            .push(r);
    }
    groups
        .into_iter()
        .map(|((kind, label), rs)| {
            let f =
                |g: &dyn Fn(&RunRecord) -> f64| -> Vec<f64> { rs.iter().map(|r| g(r)).collect() };
            let itl: Vec<f64> = rs.iter().flat_map(|r| r.itl_s.iter().copied()).collect();
            let (mut prop, mut acc, mut emitted, mut calls) = (0usize, 0usize, 0usize, 0usize);
            let mut pos: Vec<(usize, usize)> = Vec::new();
            let mut outpos: Vec<(usize, usize)> = Vec::new();
            for r in &rs {
                for s in &r.steps {
                    prop += s.k;
                    acc += s.accepted;
                    emitted += s.emitted;
                    calls += 1;
                    let b = s.position / OUTPUT_BUCKET;
                    if outpos.len() <= b {
                        outpos.resize(b + 1, (0, 0));
                    }
                    outpos[b].0 += s.k;
                    outpos[b].1 += s.accepted;
                }
                if pos.len() < r.by_position.len() {
                    pos.resize(r.by_position.len(), (0, 0));
                }
                for (i, &(reached, a)) in r.by_position.iter().enumerate() {
                    pos[i].0 += reached;
                    pos[i].1 += a;
                }
            }
            let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
            let decode: f64 = rs
                .iter()
                .map(|r| r.propose_s + r.forward_s + r.verify_s)
                .sum();
            let speed: Vec<f64> = rs.iter().filter_map(|r| r.speedup).collect();
            let dspeed: Vec<f64> = rs.iter().filter_map(|r| r.decode_speedup).collect();
            let greedy: Vec<bool> = rs.iter().filter_map(|r| r.greedy_identical).collect();
            let same: Vec<bool> = rs.iter().filter_map(|r| r.reuse_identical).collect();
            let reused: usize = rs.iter().map(|r| r.prompt_reused).sum();
            let fed: usize = rs.iter().map(|r| r.prompt_prefilled).sum();
            Aggregate {
                kind,
                label,
                runs: rs.len(),
                e2e_s: Summary::of(&f(&|r| r.e2e_s)),
                ttft_s: Summary::of(&f(&|r| r.ttft_s)),
                tpot_s: Summary::of(
                    &rs.iter()
                        .filter(|r| r.tokens.len() > 1)
                        .map(|r| (r.e2e_s - r.ttft_s) / (r.tokens.len() - 1) as f64)
                        .collect::<Vec<_>>(),
                ),
                itl_p50_s: percentile(&itl, 50.0).unwrap_or(0.0),
                itl_p90_s: percentile(&itl, 90.0).unwrap_or(0.0),
                itl_p99_s: percentile(&itl, 99.0).unwrap_or(0.0),
                tokens_per_s: Summary::of(&f(&|r| r.tokens_per_s)),
                peak_rss_kib: rs.iter().filter_map(|r| r.peak_rss_kib).max(),
                propose_share: if decode > 0.0 {
                    rs.iter().map(|r| r.propose_s).sum::<f64>() / decode
                } else {
                    0.0
                },
                verify_share: if decode > 0.0 {
                    rs.iter().map(|r| r.forward_s + r.verify_s).sum::<f64>() / decode
                } else {
                    0.0
                },
                acceptance_rate: ratio(acc, prop),
                mean_accepted_length: ratio(emitted, calls),
                by_position: pos.iter().map(|&(r, a)| ratio(a, r)).collect(),
                by_output_position: outpos.iter().map(|&(p, a)| ratio(a, p)).collect(),
                speedup: (!speed.is_empty()).then(|| Summary::of(&speed)),
                decode_speedup: (!dspeed.is_empty()).then(|| Summary::of(&dspeed)),
                greedy_identical: (!greedy.is_empty())
                    .then(|| (greedy.iter().filter(|&&g| g).count(), greedy.len())),
                prompt_reused_share: ratio(reused, reused + fed),
                reuse_identical: (!same.is_empty())
                    .then(|| (same.iter().filter(|&&g| g).count(), same.len())),
            }
        })
        .collect()
}

/// The markdown table for people: one row per (kind, configuration).
pub fn markdown(aggs: &[Aggregate]) -> String {
    let mut s = String::new();
    s.push_str("| kind | config | runs | tok/s | speed-up (mean ± sd, min-max) | decode speed-up | accept rate | mean acc. len | TTFT ms | TPOT ms | ITL p50/p90/p99 ms | e2e s | propose % | peak RSS MiB | greedy identical | prompt reused % | = reuse off |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for a in aggs {
        let sp = a
            .speedup
            .map(|s| format!("{:.2}x ± {:.2} ({:.2}-{:.2})", s.mean, s.std, s.min, s.max))
            .unwrap_or_else(|| "baseline".into());
        let dsp = a
            .decode_speedup
            .map(|s| format!("{:.2}x ({:.2}-{:.2})", s.mean, s.min, s.max))
            .unwrap_or_else(|| "-".into());
        let gi = a
            .greedy_identical
            .map(|(i, n)| format!("{i}/{n}"))
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} | {} | {} | {:.3} | {:.2} | {:.1} | {:.2} | {:.1}/{:.1}/{:.1} | {:.2} | {:.1} | {} | {} | {:.1} | {} |",
            a.kind,
            a.label,
            a.runs,
            a.tokens_per_s.mean,
            sp,
            dsp,
            a.acceptance_rate,
            a.mean_accepted_length,
            a.ttft_s.mean * 1e3,
            a.tpot_s.mean * 1e3,
            a.itl_p50_s * 1e3,
            a.itl_p90_s * 1e3,
            a.itl_p99_s * 1e3,
            a.e2e_s.mean,
            a.propose_share * 100.0,
            a.peak_rss_kib
                .map(|k| format!("{:.0}", k as f64 / 1024.0))
                .unwrap_or_else(|| "-".into()),
            gi,
            a.prompt_reused_share * 100.0,
            a.reuse_identical
                .map(|(i, n)| format!("{i}/{n}"))
                .unwrap_or_else(|| "-".into())
        );
    }
    s
}

/// Every request listed: one row per (request, configuration) with the mean over repetitions
/// of the end-to-end and decode speed-ups, the mean accepted length and whether greedy
/// outputs matched, so that no request hides behind a kind's mean.
pub fn request_markdown(records: &[RunRecord]) -> String {
    let mut groups: BTreeMap<(usize, String), Vec<&RunRecord>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.config.is_some()) {
        groups
            .entry((r.request, r.label.clone()))
            .or_default()
            .push(r);
    }
    let mut s = String::new();
    s.push_str("| request | kind | config | runs | tokens | speed-up e2e | decode speed-up | mean acc. len | greedy identical |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|\n");
    let mean = |v: &[f64]| {
        if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    for ((req, label), rs) in groups {
        let e2e: Vec<f64> = rs.iter().filter_map(|r| r.speedup).collect();
        let dec: Vec<f64> = rs.iter().filter_map(|r| r.decode_speedup).collect();
        let acc: Vec<f64> = rs.iter().map(|r| r.mean_accepted_length).collect();
        let tokens: Vec<f64> = rs.iter().map(|r| r.tokens.len() as f64).collect();
        let gi: Vec<bool> = rs.iter().filter_map(|r| r.greedy_identical).collect();
        let gi = if gi.is_empty() {
            "-".to_string()
        } else {
            format!("{}/{}", gi.iter().filter(|&&g| g).count(), gi.len())
        };
        let _ = writeln!(
            s,
            "| {req} | {} | {label} | {} | {:.0} | {:.2}x | {:.2}x | {:.2} | {gi} |",
            rs[0].kind,
            rs.len(),
            mean(&tokens),
            mean(&e2e),
            mean(&dec),
            mean(&acc),
        );
    }
    s
}

/// The simulator's result as a markdown table (speed-up per batch size and draft length).
pub fn sim_markdown(r: &SimResult) -> String {
    let ks: Vec<usize> = {
        let mut v: Vec<usize> = r.grid.iter().map(|c| c.k).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let mut s = String::from("| batch |");
    for k in &ks {
        let _ = write!(s, " k={k} |");
    }
    s.push_str(" best k |\n|---|");
    for _ in &ks {
        s.push_str("---|");
    }
    s.push_str("---|\n");
    for b in &r.best {
        let _ = write!(s, "| {} |", b.batch);
        for k in &ks {
            let c = r.grid.iter().find(|c| c.batch == b.batch && c.k == *k);
            let _ = write!(s, " {:.2} |", c.map(|c| c.speedup).unwrap_or(0.0));
        }
        let _ = writeln!(s, " {} ({:.2}x) |", b.k, b.speedup);
    }
    s
}

/// Writes `value` as pretty JSON.
///
/// # Errors
/// [`BenchError::Io`].
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| BenchError::Invalid {
        what: "json",
        reason: e.to_string(),
    })?;
    std::fs::write(path, text).map_err(|e| BenchError::Io {
        path: path.display().to_string(),
        source: e,
    })
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// A line plot of several named series of `(x, y)` points to an SVG file.
///
/// # Errors
/// [`BenchError::Plot`] when drawing or writing fails.
pub fn line_plot(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    let xs = series.iter().flat_map(|s| s.1.iter().map(|p| p.0));
    let ys = series.iter().flat_map(|s| s.1.iter().map(|p| p.1));
    let (x0, x1) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    let (y0, y1) = ys.fold((0.0f64, f64::NEG_INFINITY), |(a, b), y| {
        (a.min(y), b.max(y))
    });
    let (x0, x1) = if x0.is_finite() && x1 > x0 {
        (x0, x1)
    } else {
        (0.0, 1.0)
    };
    let y1 = if y1.is_finite() && y1 > y0 {
        y1 * 1.05
    } else {
        y0 + 1.0
    };
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| plot_err(path, e))?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| plot_err(path, e))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| plot_err(path, e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| plot_err(path, e))?;
    root.present().map_err(|e| plot_err(path, e))?;
    Ok(())
}

/// Writes the three standard plots into `dir`: `acceptance_by_position.svg`,
/// `speedup_vs_k.svg` and `itl_cdf.svg`.
///
/// # Errors
/// [`BenchError::Plot`].
pub fn standard_plots(dir: &Path, records: &[RunRecord], aggs: &[Aggregate]) -> Result<()> {
    let all: Vec<&Aggregate> = aggs.iter().filter(|a| a.kind == "all").collect();
    let by_pos: Vec<(String, Vec<(f64, f64)>)> = all
        .iter()
        .filter(|a| !a.by_position.is_empty())
        .map(|a| {
            (
                a.label.clone(),
                a.by_position
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| ((i + 1) as f64, v))
                    .collect(),
            )
        })
        .collect();
    line_plot(
        &dir.join("acceptance_by_position.svg"),
        "Acceptance by draft position (given earlier positions accepted)",
        "draft position",
        "acceptance",
        &by_pos,
    )?;
    // Speed-up vs fixed k, one series per (proposer, sampling).
    let mut sp: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut acc: BTreeMap<(String, usize), Vec<f64>> = BTreeMap::new();
    for r in records {
        if let (Some(c), Some(s)) = (&r.config, r.speedup)
            && let crate::run::DraftSpec::Fixed(k) = c.draft
        {
            let name = format!("{} t={} p={}", c.proposer, c.temperature, c.top_p);
            acc.entry((name, k)).or_default().push(s);
        }
    }
    for ((name, k), v) in acc {
        sp.entry(name)
            .or_default()
            .push((k as f64, Summary::of(&v).mean));
    }
    let sp: Vec<(String, Vec<(f64, f64)>)> = sp.into_iter().collect();
    line_plot(
        &dir.join("speedup_vs_k.svg"),
        "Speed-up over plain decoding vs draft length",
        "draft length k",
        "speed-up (x)",
        &sp,
    )?;
    // ITL CDF per label (ms).
    let mut itl: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in records {
        itl.entry(r.label.clone())
            .or_default()
            .extend(r.itl_s.iter().map(|x| x * 1e3));
    }
    let cdf: Vec<(String, Vec<(f64, f64)>)> = itl
        .into_iter()
        .map(|(l, mut v)| {
            v.sort_by(|a, b| a.total_cmp(b));
            let n = v.len().max(1) as f64;
            let step = (v.len() / 200).max(1);
            let pts = v
                .iter()
                .enumerate()
                .filter(|(i, _)| i % step == 0 || *i + 1 == v.len())
                .map(|(i, &x)| (x, (i + 1) as f64 / n))
                .collect();
            (l, pts)
        })
        .collect();
    line_plot(
        &dir.join("itl_cdf.svg"),
        "Inter-token latency distribution (CDF)",
        "inter-token latency (ms)",
        "fraction of tokens",
        &cdf,
    )
}

/// Plots the simulator's speed-up against batch size, one series per draft length.
///
/// # Errors
/// [`BenchError::Plot`].
pub fn sim_plot(path: &Path, r: &SimResult) -> Result<()> {
    let mut by_k: BTreeMap<usize, Vec<(f64, f64)>> = BTreeMap::new();
    for c in &r.grid {
        by_k.entry(c.k)
            .or_default()
            .push(((c.batch as f64).log2(), c.speedup));
    }
    let series: Vec<(String, Vec<(f64, f64)>)> = by_k
        .into_iter()
        .map(|(k, v)| (format!("k={k}"), v))
        .collect();
    line_plot(
        path,
        "Simulated speed-up vs batch size",
        "log2(batch size)",
        "expected speed-up (x)",
        &series,
    )
}

/// Time to first token against the prompt tokens each run fed (prefix reuse), for workloads
/// with reuse-on runs: per request (a conversation turn), its prompt length, the tokens the
/// reuse-on runs prefilled, and the mean TTFT of every configuration label over the
/// repetitions; then, per label, the least-squares line `TTFT = a + b * prefilled tokens` over
/// all its runs with its R^2 (TTFT proportional to the new tokens of the turn when `a` is small
/// and R^2 near 1). `None` without reuse-on runs.
pub fn ttft_markdown(records: &[RunRecord]) -> Option<String> {
    if !records.iter().any(|r| r.prefix_reuse) {
        return None;
    }
    let mut labels: Vec<&str> = Vec::new();
    for r in records {
        if !labels.contains(&r.label.as_str()) {
            labels.push(&r.label);
        }
    }
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    let mut s = String::from("| request | prompt tokens | prefilled with reuse |");
    for l in &labels {
        let _ = write!(s, " TTFT ms {l} |");
    }
    let _ = writeln!(s, "\n|---|---|---|{}", "---|".repeat(labels.len()));
    let mut requests: Vec<usize> = records.iter().map(|r| r.request).collect();
    requests.sort_unstable();
    requests.dedup();
    for q in requests {
        let of = |f: &dyn Fn(&RunRecord) -> bool| -> Vec<&RunRecord> {
            records.iter().filter(|r| r.request == q && f(r)).collect()
        };
        let on = of(&|r| r.prefix_reuse);
        let prompt = mean(
            &of(&|_| true)
                .iter()
                .map(|r| r.prompt_tokens as f64)
                .collect::<Vec<_>>(),
        );
        let fed = mean(
            &on.iter()
                .map(|r| r.prompt_prefilled as f64)
                .collect::<Vec<_>>(),
        );
        let _ = write!(s, "| {q} | {prompt:.0} | {fed:.0} |");
        for l in &labels {
            let t: Vec<f64> = of(&|r| r.label == *l)
                .iter()
                .map(|r| r.ttft_s * 1e3)
                .collect();
            let _ = write!(s, " {:.1} |", mean(&t));
        }
        s.push('\n');
    }
    s.push('\n');
    for l in &labels {
        let pts: Vec<(f64, f64)> = records
            .iter()
            .filter(|r| r.label == *l)
            .map(|r| (r.prompt_prefilled as f64, r.ttft_s * 1e3))
            .collect();
        if let Some((a, b, r2)) = least_squares(&pts) {
            let _ = writeln!(
                s,
                "- {l}: TTFT = {a:.1} ms + {b:.3} ms x prefilled tokens (R^2 {r2:.3}, {} runs)",
                pts.len()
            );
        }
    }
    Some(s)
}

/// The least-squares line `y = a + b x` through `pts` and its R^2; `None` for fewer than two
/// points or a constant `x`.
pub fn least_squares(pts: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    let n = pts.len() as f64;
    if pts.len() < 2 {
        return None;
    }
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let syy: f64 = pts.iter().map(|p| (p.1 - my).powi(2)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let b = sxy / sxx;
    let r2 = if syy > 0.0 {
        sxy * sxy / (sxx * syy)
    } else {
        1.0
    };
    Some((my - b * mx, b, r2))
}

#[cfg(test)]
mod ttft_tests {
    use super::least_squares;

    #[test]
    fn a_line_is_fitted_exactly_and_degenerate_inputs_are_refused() {
        let (a, b, r2) = least_squares(&[(0.0, 1.0), (2.0, 5.0), (4.0, 9.0)]).unwrap();
        assert!((a - 1.0).abs() < 1e-12 && (b - 2.0).abs() < 1e-12 && (r2 - 1.0).abs() < 1e-12);
        let (_, _, r2) = least_squares(&[(0.0, 0.0), (1.0, 1.0), (2.0, 0.0), (3.0, 1.0)]).unwrap();
        assert!(r2 < 0.5);
        assert!(least_squares(&[(1.0, 2.0)]).is_none());
        assert!(least_squares(&[(1.0, 2.0), (1.0, 3.0)]).is_none());
    }
}
