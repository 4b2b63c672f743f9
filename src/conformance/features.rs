//! The [`TargetFeatures`](crate::TargetFeatures) family of feature-conditioned draft models.

use super::report::{Outcome, Report};
use super::util::{Fail, compare_rows, ok, prompt_input, prompts, record, same_len, seq_is};
use super::{KitConfig, Tolerance};
use crate::error::Error;
use crate::model::{TargetFeatures, TargetModel};

type Check = std::result::Result<(), Fail>;

/// Runs the [`TargetFeatures`](crate::TargetFeatures) checks (`features.*`, listed in
/// [`crate::conformance`]) on a feature-conditioned draft model, when `make()`'s
/// [`TargetModel::target_features`] is `Some` (else one skipped `features.support`).
///
/// The features are synthetic (`0.5 sin(0.37 p + 0.11 j + salt)` at position `p`, entry `j`):
/// the checks test the plumbing the trait documents, not what the model does with them.
pub fn check_features<T, P>(
    mut make: impl FnMut() -> T,
    prompts_in: &[P],
    cfg: &KitConfig,
) -> Report
where
    T: TargetModel,
    P: AsRef<[u32]>,
{
    let mut report = Report::new("TargetFeatures", std::any::type_name::<T>());
    let mut probe = make();
    let (vocab, max_context) = (probe.vocab_size(), probe.max_context());
    let h = probe
        .target_features()
        .map(|f| (f.hidden_size(), f.target_hidden_len()));
    drop(probe);
    let Some((h, held)) = h else {
        report.push(
            "features.support",
            "the engine",
            Outcome::Skipped {
                reason: "target_features() is None".into(),
            },
        );
        return report;
    };
    if h == 0 || held != 0 {
        report.push(
            "features.set",
            "a fresh model",
            Outcome::Failed {
                expected: "hidden_size() > 0, target_hidden_len() 0".into(),
                got: format!("{h}, {held}"),
            },
        );
        return report;
    }
    let Some(ps) = prompts(&mut report, prompts_in, vocab, max_context) else {
        return report;
    };
    let tol = cfg.tolerance();
    for (i, p) in ps.iter().enumerate() {
        let input = prompt_input(i, p);
        record(&mut report, "features.set", &input, set(&mut make, p, h));
        record(
            &mut report,
            "features.errors",
            &input,
            errors(&mut make, p, h),
        );
        record(
            &mut report,
            "features.truncate",
            &input,
            keep(&mut make, p, h),
        );
        record(
            &mut report,
            "features.causal",
            &input,
            causal(&mut make, p, h, tol),
        );
        record(
            &mut report,
            "features.replace",
            &input,
            replace(&mut make, p, h, tol),
        );
    }
    report
}

/// Synthetic features of positions `from .. to`, `[to - from, h]`.
fn feats(from: usize, to: usize, h: usize, salt: f32) -> Vec<f32> {
    (from..to)
        .flat_map(|p| (0..h).map(move |j| 0.5 * (0.37 * p as f32 + 0.11 * j as f32 + salt).sin()))
        .collect()
}

fn tf<T: TargetModel>(m: &mut T) -> std::result::Result<&mut dyn TargetFeatures, Fail> {
    m.target_features()
        .ok_or_else(|| Fail::new("target_features() Some", "None"))
}

fn held<T: TargetModel>(m: &mut T, expected: usize, after: &str) -> Check {
    let got = tf(m)?.target_hidden_len();
    same_len(format!("target_hidden_len() after {after}"), expected, got)
}

/// A fresh model holding the prompt's rows read with features `f` of positions `0..n - 1`.
fn with_features<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    f: &[f32],
) -> std::result::Result<(T, Vec<f32>), Fail> {
    let mut m = make();
    ok(
        tf(&mut m)?.set_target_hidden(0, f),
        "set_target_hidden(0, features)",
    )?;
    let mut logits = Vec::new();
    ok(m.forward(p, &mut logits), "forward(prompt)")?;
    Ok((m, logits))
}

fn set<T: TargetModel>(make: &mut impl FnMut() -> T, p: &[u32], h: usize) -> Check {
    let n = p.len();
    let mut m = make();
    let mut logits = Vec::new();
    ok(m.forward(p, &mut logits), "forward(prompt)")?;
    ok(
        tf(&mut m)?.set_target_hidden(0, &feats(0, n - 1, h, 0.0)),
        "set_target_hidden(0, [n - 1 rows])",
    )?;
    held(&mut m, n - 1, "set_target_hidden(0, [n - 1 rows])")?;
    seq_is(&m, 1, "set_target_hidden(0, ..) (truncates to start + 1)")?;
    ok(m.forward(&p[1..], &mut logits), "forward(prompt[1..])")?;
    ok(
        tf(&mut m)?.set_target_hidden(n - 1, &[]),
        "set_target_hidden(n - 1, no rows)",
    )?;
    held(&mut m, n - 1, "set_target_hidden(n - 1, no rows)")?;
    seq_is(&m, n, "set_target_hidden(n - 1, ..) (keeps n = start + 1)")?;
    ok(
        tf(&mut m)?.set_target_hidden(1, &[]),
        "set_target_hidden(1, no rows)",
    )?;
    held(&mut m, 1, "set_target_hidden(1, no rows) (drops from 1 on)")?;
    seq_is(&m, 2, "set_target_hidden(1, ..)")
}

fn errors<T: TargetModel>(make: &mut impl FnMut() -> T, p: &[u32], h: usize) -> Check {
    let n = p.len();
    let mut m = make();
    let mut logits = Vec::new();
    ok(
        tf(&mut m)?.set_target_hidden(0, &feats(0, n - 1, h, 0.0)),
        "set_target_hidden(0, ..)",
    )?;
    ok(m.forward(p, &mut logits), "forward(prompt)")?;
    let mut bad: Vec<(String, usize, Vec<f32>)> = vec![(
        format!("set_target_hidden({n}, ..) past the held {}", n - 1),
        n,
        feats(n, n + 1, h, 0.0),
    )];
    if h >= 2 {
        bad.push((
            format!(
                "set_target_hidden(0, {} floats) with hidden_size {h}",
                h + 1
            ),
            0,
            vec![0.1; h + 1],
        ));
    }
    for (call, start, rows) in bad {
        match tf(&mut m)?.set_target_hidden(start, &rows) {
            Err(Error::ShapeMismatch { .. }) => {}
            Err(e) => {
                return Err(Fail::new(
                    format!("{call}: Err(ShapeMismatch)"),
                    format!("Err({e})"),
                ));
            }
            Ok(()) => return Err(Fail::new(format!("{call}: Err(ShapeMismatch)"), "Ok")),
        }
        held(&mut m, n - 1, &call)?;
        seq_is(&m, n, &call)?;
    }
    Ok(())
}

fn keep<T: TargetModel>(make: &mut impl FnMut() -> T, p: &[u32], h: usize) -> Check {
    let n = p.len();
    let (mut m, _) = with_features(make, p, &feats(0, n - 1, h, 0.0))?;
    ok(m.truncate(0), "truncate(0)")?;
    held(&mut m, n - 1, "truncate(0) (keeps the held features)")
}

fn causal<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    h: usize,
    tol: Tolerance,
) -> Check {
    let n = p.len();
    let j = (n - 2) / 2;
    let f = feats(0, n - 1, h, 0.0);
    let mut g = f.clone();
    for x in &mut g[j * h..(j + 1) * h] {
        *x = -*x + 0.25;
    }
    let (m, a) = with_features(make, p, &f)?;
    let v = m.vocab_size();
    let (_, b) = with_features(make, p, &g)?;
    compare_rows(&a[..(j + 1) * v], &b[..(j + 1) * v], v, 0, tol).map_err(|f| {
        f.context(format!(
            "rows at positions <= {j} with the feature of {j} changed"
        ))
    })?;
    let (ra, rb) = (&a[(j + 1) * v..(j + 2) * v], &b[(j + 1) * v..(j + 2) * v]);
    if ra.iter().zip(rb).all(|(x, y)| x == y) {
        return Err(Fail::new(
            format!("the row at position {} reads the feature of {j}", j + 1),
            "the same row with the feature changed",
        ));
    }
    Ok(())
}

fn replace<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    h: usize,
    tol: Tolerance,
) -> Check {
    let n = p.len();
    if n < 3 {
        return Err(Fail::skip("needs a prompt of at least 3 tokens"));
    }
    let (mut m, _) = with_features(make, p, &feats(0, n - 1, h, 0.0))?;
    let v = m.vocab_size();
    ok(
        tf(&mut m)?.set_target_hidden(1, &feats(1, n - 1, h, 1.3)),
        "set_target_hidden(1, new rows)",
    )?;
    held(&mut m, n - 1, "set_target_hidden(1, ..)")?;
    seq_is(&m, 2, "set_target_hidden(1, ..)")?;
    let mut rows = Vec::new();
    ok(m.forward(&p[2..], &mut rows), "forward(prompt[2..])")?;
    let mut f = feats(0, 1, h, 0.0);
    f.extend(feats(1, n - 1, h, 1.3));
    let (_, fresh) = with_features(make, p, &f)?;
    compare_rows(&fresh[2 * v..], &rows, v, 2, tol)
        .map_err(|f| f.context("after replacing features from 1 vs a fresh model".into()))
        .map(|_| ())
}
