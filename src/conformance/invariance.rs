//! Batch invariance as a measurement: single-row calls against calls of `k + 1` rows.

use super::report::{Invariance, Report};
use super::util::{Fail, argmax, ok, prompt_input, prompts, record};
use super::{KitConfig, Tolerance};
use crate::model::TargetModel;

/// Measures batch invariance ([`Invariance`]) on fresh engines from `make`: for every prompt,
/// each position after the first is scored once in a single-row call (one token per forward)
/// and once in a call of `k + 1` rows (`k` = [`KitConfig::draft_len`], the shape of a verify
/// forward `[last, d_1 .. d_k]`), after the same prefix.
///
/// Check `invariance.rows`, per prompt: [`Outcome::Passed`](super::Outcome::Passed) when every row is bit-identical;
/// otherwise [`Outcome::Failed`](super::Outcome::Failed) under [`Tolerance::Exact`] (the engine claims invariance) or
/// when a difference exceeds [`Tolerance::Abs`], and [`Outcome::Tolerated`](super::Outcome::Tolerated) with the counts
/// when it is within the tolerance. The measurement over all prompts is
/// [`Report::invariance`]. Cost: two passes over each prompt, one of them one token per call.
pub fn check_invariance<T, P>(
    mut make: impl FnMut() -> T,
    prompts_in: &[P],
    cfg: &KitConfig,
) -> Report
where
    T: TargetModel,
    P: AsRef<[u32]>,
{
    let mut report = Report::new("batch invariance", std::any::type_name::<T>());
    let probe = make();
    let (vocab, max_context) = (probe.vocab_size(), probe.max_context());
    drop(probe);
    let Some(ps) = prompts(&mut report, prompts_in, vocab, max_context) else {
        return report;
    };
    let chunk = cfg.draft_len() + 1;
    let mut total = Invariance {
        chunk,
        ..Default::default()
    };
    for (i, p) in ps.iter().enumerate() {
        let input = format!("{}, {chunk}-row calls", prompt_input(i, p));
        match measure(&mut make, p, chunk) {
            Ok(m) => {
                total.rows += m.rows;
                total.identical_rows += m.identical_rows;
                total.argmax_changes += m.argmax_changes;
                total.max_abs_diff = total.max_abs_diff.max(m.max_abs_diff);
                record(
                    &mut report,
                    "invariance.rows",
                    &input,
                    judge(&m, cfg.tolerance()),
                );
            }
            Err(f) => report.push("invariance.rows", &input, f.into_outcome()),
        }
    }
    report.set_invariance(total);
    report
}

/// The measurement on one prompt.
fn measure<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    chunk: usize,
) -> std::result::Result<Invariance, Fail> {
    let mut single = make();
    let v = single.vocab_size();
    let (mut row, mut singles) = (Vec::new(), Vec::new());
    for (i, t) in p.iter().enumerate() {
        ok(
            single.forward(std::slice::from_ref(t), &mut row),
            format!("forward of token {i} alone"),
        )?;
        if i > 0 {
            singles.extend_from_slice(&row);
        }
    }
    let mut multi = make();
    ok(multi.forward(&p[..1], &mut row), "forward(prompt[..1])")?;
    let mut rows = Vec::new();
    for (c, part) in p[1..].chunks(chunk).enumerate() {
        ok(
            multi.forward(part, &mut row),
            format!("forward of rows {}..", 1 + c * chunk),
        )?;
        rows.extend_from_slice(&row);
    }
    if rows.len() != singles.len() || rows.len() != (p.len() - 1) * v {
        return Err(Fail::new(
            format!("{} logits", (p.len() - 1) * v),
            format!("{} (chunked) and {} (single)", rows.len(), singles.len()),
        ));
    }
    let mut m = Invariance {
        chunk,
        rows: p.len() - 1,
        ..Default::default()
    };
    for (a, b) in singles.chunks(v).zip(rows.chunks(v)) {
        let same = a
            .iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || x == y);
        m.identical_rows += same as usize;
        m.argmax_changes += (argmax(a) != argmax(b)) as usize;
        for (x, y) in a.iter().zip(b) {
            let d = (x - y).abs();
            if d.is_finite() {
                m.max_abs_diff = m.max_abs_diff.max(d);
            } else if x != y {
                m.max_abs_diff = f32::INFINITY;
            }
        }
    }
    Ok(m)
}

fn judge(m: &Invariance, tol: Tolerance) -> std::result::Result<(), Fail> {
    if m.identical_rows == m.rows {
        return Ok(());
    }
    let got = format!(
        "{} of {} rows differ, {} argmax changes, largest |difference| {:e}",
        m.rows - m.identical_rows,
        m.rows,
        m.argmax_changes,
        m.max_abs_diff
    );
    let f = Fail::new(format!("{} bit-identical rows", m.rows), got);
    match tol {
        Tolerance::Abs(t) if m.max_abs_diff <= t => Err(f.tolerated(
            "within the tolerance; each argmax change is a position where greedy speculative \
             output may part from plain greedy",
        )),
        _ => Err(f),
    }
}
