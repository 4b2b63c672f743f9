//! The [`TargetModel`] family: append, shapes, pieces, prefill, truncate, errors, context limit.

use super::report::{Outcome, Report};
use super::util::{
    Fail, compare_rows, ok, prompt_input, prompts, record, refused, same_len, seq_is, token,
};
use super::{KitConfig, Tolerance};
use crate::model::{RollbackMode, TargetModel, rollback_mode};

type Check = std::result::Result<(), Fail>;

/// Runs the [`TargetModel`] checks (`target.*`, listed in [`crate::conformance`]) on fresh
/// engines from `make`, for every prompt.
///
/// Cost: about 20 forwards of each prompt (a few of them one token per call), plus filling
/// `max_context` twice when it is within [`KitConfig::context_budget`].
pub fn check_target<T, P>(mut make: impl FnMut() -> T, prompts_in: &[P], cfg: &KitConfig) -> Report
where
    T: TargetModel,
    P: AsRef<[u32]>,
{
    let mut report = Report::new("TargetModel", std::any::type_name::<T>());
    let probe = make();
    let (vocab, max_context) = (probe.vocab_size(), probe.max_context());
    drop(probe);
    let Some(ps) = prompts(&mut report, prompts_in, vocab, max_context) else {
        return report;
    };
    let tol = cfg.tolerance();
    for (i, p) in ps.iter().enumerate() {
        let input = prompt_input(i, p);
        let reference = match shape(&mut make, p) {
            Ok(r) => {
                report.push("target.shape", &input, Outcome::Passed);
                r
            }
            Err(f) => {
                report.push("target.shape", &input, f.into_outcome());
                continue;
            }
        };
        record(
            &mut report,
            "target.pieces",
            &input,
            pieces(&mut make, p, &reference, tol),
        );
        record(
            &mut report,
            "target.prefill",
            &input,
            prefill(&mut make, p, &reference, tol),
        );
        record(
            &mut report,
            "target.truncate",
            &input,
            truncate(&mut make, p, &reference, tol),
        );
        for (case, r) in errors(&mut make, p, &reference, tol) {
            record(&mut report, "target.errors", &format!("{input}, {case}"), r);
        }
    }
    let input = format!("max_context {max_context}");
    if max_context > cfg.context_budget() {
        report.push(
            "target.max_context",
            &input,
            Outcome::Skipped {
                reason: format!("above the context budget {}", cfg.context_budget()),
            },
        );
    } else {
        record(
            &mut report,
            "target.max_context",
            &input,
            context(&mut make, ps[0]),
        );
    }
    report
}

/// A fresh engine is empty; forward appends `n` and gives `[n, vocab]` logits (returned) without
/// NaN or `+inf` (`-inf` bans a token), each row with a finite logit.
fn shape<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
) -> std::result::Result<Vec<f32>, Fail> {
    let mut m = make();
    seq_is(&m, 0, "construction")?;
    let mut logits = vec![f32::NAN; 3];
    ok(m.forward(p, &mut logits), "forward(prompt)")?;
    same_len(
        "logits.len() ([n, vocab])",
        p.len() * m.vocab_size(),
        logits.len(),
    )?;
    seq_is(&m, p.len(), "forward(prompt)")?;
    // `-inf` bans a token (a draft model's restricted output, a mask): the verifier takes it.
    if let Some(i) = logits
        .iter()
        .position(|&x| x.is_nan() || x == f32::INFINITY)
    {
        return Err(Fail::new(
            "logits without NaN or +inf",
            format!("{} at row {}", logits[i], i / m.vocab_size()),
        ));
    }
    let v = m.vocab_size().max(1);
    if let Some(r) = logits
        .chunks(v)
        .position(|row| !row.iter().any(|x| x.is_finite()))
    {
        return Err(Fail::new(
            "a finite logit in every row",
            format!("row {r} all -inf"),
        ));
    }
    Ok(logits)
}

/// Forward in two pieces and one token per call equal one call.
fn pieces<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    reference: &[f32],
    tol: Tolerance,
) -> Check {
    let mut m = make();
    let v = m.vocab_size();
    let a = p.len() / 2;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    ok(
        m.forward(&p[..a], &mut x),
        format!("forward(prompt[..{a}])"),
    )?;
    ok(
        m.forward(&p[a..], &mut y),
        format!("forward(prompt[{a}..])"),
    )?;
    seq_is(&m, p.len(), "two forwards")?;
    x.extend_from_slice(&y);
    compare_rows(reference, &x, v, 0, tol)
        .map_err(|f| f.context(format!("split at {a} vs one call")))?;
    let mut m = make();
    let mut rows = Vec::new();
    for (i, t) in p.iter().enumerate() {
        ok(
            m.forward(std::slice::from_ref(t), &mut y),
            format!("forward of token {i} alone"),
        )?;
        rows.extend_from_slice(&y);
    }
    compare_rows(reference, &rows, v, 0, tol)
        .map_err(|f| f.context("one token per call vs one call".to_string()))?;
    Ok(())
}

/// Prefill of `n - 1` tokens (also after a forward), then forward of the last, equals one call.
fn prefill<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    reference: &[f32],
    tol: Tolerance,
) -> Check {
    let n = p.len();
    let v = reference.len() / n;
    let last = &reference[(n - 1) * v..];
    let mut row = Vec::new();
    let mut m = make();
    ok(
        m.prefill(&p[..n - 1]),
        format!("prefill(prompt[..{}])", n - 1),
    )?;
    seq_is(&m, n - 1, "prefill")?;
    ok(
        m.forward(&p[n - 1..], &mut row),
        "forward(last token) after prefill",
    )?;
    compare_rows(last, &row, v, n - 1, tol).map_err(|f| f.context("prefill + forward".into()))?;
    if n >= 3 {
        let mut m = make();
        ok(m.forward(&p[..1], &mut row), "forward(prompt[..1])")?;
        ok(m.prefill(&p[1..n - 1]), "prefill after a forward")?;
        seq_is(&m, n - 1, "forward + prefill")?;
        ok(m.forward(&p[n - 1..], &mut row), "forward(last token)")?;
        compare_rows(last, &row, v, n - 1, tol)
            .map_err(|f| f.context("forward + prefill (appends) + forward".into()))?;
    }
    Ok(())
}

/// Truncate to the length is a no-op, truncate then forward equals a fresh forward (also after
/// rejected tokens), truncate(0) restarts.
fn truncate<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    reference: &[f32],
    tol: Tolerance,
) -> Check {
    let n = p.len();
    let v = reference.len() / n;
    let a = n / 2;
    let mut m = make();
    let vocab = m.vocab_size();
    let mut rows = Vec::new();
    ok(m.forward(p, &mut rows), "forward(prompt)")?;
    ok(m.truncate(n), "truncate(seq_len)")?;
    seq_is(&m, n, "truncate(seq_len)")?;
    if rollback_mode(&mut m) != RollbackMode::Truncate {
        // A state that cannot be truncated: only the reset (the rest is `rollback.truncate`).
        ok(m.truncate(0), "truncate(0)")?;
        seq_is(&m, 0, "truncate(0)")?;
        ok(m.forward(p, &mut rows), "forward(prompt) after truncate(0)")?;
        return compare_rows(reference, &rows, v, 0, tol)
            .map_err(|f| f.context("truncate(0), forward".into()))
            .map(|_| ());
    }
    ok(m.truncate(a), format!("truncate({a})"))?;
    seq_is(&m, a, &format!("truncate({a})"))?;
    ok(
        m.forward(&p[a..], &mut rows),
        format!("forward(prompt[{a}..]) after truncate"),
    )?;
    compare_rows(&reference[a * v..], &rows, v, a, tol)
        .map_err(|f| f.context(format!("forward, truncate({a}), forward")))?;
    let rejected: Vec<u32> = (0..3).map(|i| token(p, i + 5, vocab)).collect();
    ok(m.truncate(a), format!("truncate({a})"))?;
    ok(
        m.forward(&rejected, &mut rows),
        "forward of 3 tokens to reject",
    )?;
    ok(m.truncate(a), format!("truncate({a}) dropping them"))?;
    ok(
        m.forward(&p[a..], &mut rows),
        format!("forward(prompt[{a}..])"),
    )?;
    compare_rows(&reference[a * v..], &rows, v, a, tol)
        .map_err(|f| f.context(format!("3 tokens appended and truncated away at {a}")))?;
    ok(m.truncate(0), "truncate(0)")?;
    seq_is(&m, 0, "truncate(0)")?;
    ok(m.forward(p, &mut rows), "forward(prompt) after truncate(0)")?;
    compare_rows(reference, &rows, v, 0, tol)
        .map_err(|f| f.context("truncate(0), forward".into()))
        .map(|_| ())
}

/// Each refused (or empty) call leaves the sequence as it was: the same length, and the rest of
/// the prompt gives the reference rows.
fn errors<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    reference: &[f32],
    tol: Tolerance,
) -> Vec<(&'static str, Check)> {
    let n = p.len();
    let a = (n / 2).max(1);
    let cases: [&'static str; 6] = [
        "empty forward",
        "empty prefill",
        "out-of-vocab id in forward",
        "valid id then out-of-vocab id in forward",
        "valid id then out-of-vocab id in prefill",
        "truncate beyond the length",
    ];
    cases
        .iter()
        .map(|&case| (case, error_case(make, p, reference, tol, a, case)))
        .collect()
}

fn error_case<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    reference: &[f32],
    tol: Tolerance,
    a: usize,
    case: &str,
) -> Check {
    let mut m = make();
    let v = m.vocab_size();
    let oov = v as u32;
    let mut rows = Vec::new();
    ok(
        m.forward(&p[..a], &mut rows),
        format!("forward(prompt[..{a}])"),
    )?;
    match case {
        "empty forward" => {
            if m.forward(&[], &mut rows).is_ok() {
                same_len("logits of an empty forward", 0, rows.len())?;
            }
        }
        "empty prefill" => {
            let _ = m.prefill(&[]);
        }
        "out-of-vocab id in forward" => {
            refused(m.forward(&[oov], &mut rows), format!("forward([{oov}])"))?
        }
        "valid id then out-of-vocab id in forward" => refused(
            m.forward(&[p[a], oov], &mut rows),
            format!("forward([{}, {oov}])", p[a]),
        )?,
        "valid id then out-of-vocab id in prefill" => refused(
            m.prefill(&[p[a], oov]),
            format!("prefill([{}, {oov}])", p[a]),
        )?,
        _ => refused(
            m.truncate(a + 1),
            format!("truncate({}) at length {a}", a + 1),
        )?,
    }
    seq_is(&m, a, case)?;
    ok(
        m.forward(&p[a..], &mut rows),
        format!("forward(prompt[{a}..]) after the {case}"),
    )?;
    compare_rows(&reference[a * v..], &rows, v, a, tol)
        .map_err(|f| f.context(format!("the rest of the prompt after the {case}")))?;
    Ok(())
}

/// The engine holds exactly `max_context` tokens; calls that would cross it are refused whole.
fn context<T: TargetModel>(make: &mut impl FnMut() -> T, p: &[u32]) -> Check {
    let mut m = make();
    let (max, v) = (m.max_context(), m.vocab_size());
    let mut rows = Vec::new();
    let fill: Vec<u32> = (0..max).map(|i| token(p, i, v)).collect();
    for (c, chunk) in fill[..max - 2].chunks(256).enumerate() {
        ok(
            m.forward(chunk, &mut rows),
            format!("forward of fill chunk {c}"),
        )?;
    }
    seq_is(&m, max - 2, "filling to max_context - 2")?;
    refused(
        m.forward(&fill[..3], &mut rows),
        "forward of 3 tokens at max_context - 2",
    )?;
    seq_is(&m, max - 2, "the refused crossing forward")?;
    ok(
        m.forward(&fill[max - 2..], &mut rows),
        "forward of the last 2 tokens",
    )?;
    seq_is(&m, max, "filling to max_context")?;
    refused(
        m.forward(&fill[..1], &mut rows),
        "forward of 1 token at max_context",
    )?;
    refused(m.prefill(&fill[..1]), "prefill of 1 token at max_context")?;
    seq_is(&m, max, "the refused calls")?;
    if rollback_mode(&mut m) != RollbackMode::Truncate {
        return Ok(());
    }
    ok(m.truncate(max - 1), "truncate(max_context - 1)")?;
    ok(
        m.forward(&fill[..1], &mut rows),
        "forward of 1 token at max_context - 1",
    )?;
    same_len("logits of that forward", v, rows.len())?;
    seq_is(&m, max, "refilling to max_context")
}
