//! Shared pieces of the checks: the internal failure type, row comparison, prompt checks and
//! the tokens the checks feed.

use std::fmt::Display;

use super::Tolerance;
use super::report::{Outcome, Report};
use crate::error::Result;
use crate::model::TargetModel;

/// Why a check failed (or differs within the configuration): becomes an [`Outcome`].
#[derive(Debug)]
pub(crate) struct Fail {
    expected: String,
    got: String,
    tolerated: Option<&'static str>,
    skipped: bool,
}

impl Fail {
    pub(crate) fn new(expected: impl Display, got: impl Display) -> Self {
        Fail {
            expected: expected.to_string(),
            got: got.to_string(),
            tolerated: None,
            skipped: false,
        }
    }

    /// A skip (the check could not run), carried through `?`.
    pub(crate) fn skip(reason: impl Display) -> Self {
        Fail {
            expected: String::new(),
            got: reason.to_string(),
            tolerated: None,
            skipped: true,
        }
    }

    /// Marks the difference as allowed by the configuration.
    pub(crate) fn tolerated(mut self, why: &'static str) -> Self {
        self.tolerated = Some(why);
        self
    }

    pub(crate) fn into_outcome(self) -> Outcome {
        if self.skipped {
            return Outcome::Skipped { reason: self.got };
        }
        match self.tolerated {
            Some(why) => Outcome::Tolerated {
                expected: self.expected,
                got: self.got,
                why,
            },
            None => Outcome::Failed {
                expected: self.expected,
                got: self.got,
            },
        }
    }
}

/// The outcome of a check's result.
pub(crate) fn outcome(r: std::result::Result<(), Fail>) -> Outcome {
    match r {
        Ok(()) => Outcome::Passed,
        Err(f) => f.into_outcome(),
    }
}

/// Records a check.
pub(crate) fn record(
    report: &mut Report,
    check: &'static str,
    input: &str,
    r: std::result::Result<(), Fail>,
) {
    report.push(check, input, outcome(r));
}

/// An engine call that must succeed.
pub(crate) fn ok<T>(r: Result<T>, call: impl Display) -> std::result::Result<T, Fail> {
    r.map_err(|e| Fail::new(format!("{call}: Ok"), format!("Err({e})")))
}

/// An engine call that must fail.
pub(crate) fn refused<T>(r: Result<T>, call: impl Display) -> std::result::Result<(), Fail> {
    match r {
        Ok(_) => Err(Fail::new(format!("{call}: Err"), "Ok")),
        Err(_) => Ok(()),
    }
}

/// `got == expected` for a count (sequence length, buffer length).
pub(crate) fn same_len(
    what: impl Display,
    expected: usize,
    got: usize,
) -> std::result::Result<(), Fail> {
    if expected == got {
        Ok(())
    } else {
        Err(Fail::new(
            format!("{what} = {expected}"),
            format!("{what} = {got}"),
        ))
    }
}

/// The sequence length must be `expected`.
pub(crate) fn seq_is<T: TargetModel + ?Sized>(
    m: &T,
    expected: usize,
    after: &str,
) -> std::result::Result<(), Fail> {
    same_len(format!("seq_len() after {after}"), expected, m.seq_len())
}

/// The first difference of two `[rows, width]` buffers beyond `tol`, if any; also the
/// largest absolute difference. `first_row` numbers the rows in messages.
pub(crate) fn compare_rows(
    expected: &[f32],
    got: &[f32],
    width: usize,
    first_row: usize,
    tol: Tolerance,
) -> std::result::Result<f32, Fail> {
    same_len("rows * width", expected.len(), got.len())?;
    let mut worst = 0.0f32;
    for (i, (&e, &g)) in expected.iter().zip(got).enumerate() {
        let diff = (e - g).abs();
        let bad = match tol {
            Tolerance::Exact => e.to_bits() != g.to_bits() && !(e == 0.0 && g == 0.0),
            Tolerance::Abs(t) => {
                e != g && diff.partial_cmp(&t) != Some(std::cmp::Ordering::Less) && diff != t
            }
        };
        if bad {
            let (row, tok) = (first_row + i / width.max(1), i % width.max(1));
            return Err(Fail::new(
                format!("row {row}, token {tok}: {e:e} (within {tol})"),
                format!("{g:e} (|difference| {diff:e})"),
            ));
        }
        if diff.is_finite() {
            worst = worst.max(diff);
        }
    }
    Ok(worst)
}

/// The argmax of a row, ties to the lowest id (the crate's greedy rule); NaN never wins.
pub(crate) fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] || row[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best
}

/// A description of prompt `i` for report inputs.
pub(crate) fn prompt_input(i: usize, p: &[u32]) -> String {
    format!("prompt {i} ({} tokens)", p.len())
}

/// The prompts as slices, after the kit's own requirements (every prompt at least 2 tokens,
/// ids below `vocab`, at least one prompt), recorded as check `kit.prompts` when they fail.
pub(crate) fn prompts<'p, P: AsRef<[u32]>>(
    report: &mut Report,
    prompts: &'p [P],
    vocab: usize,
    max_context: usize,
) -> Option<Vec<&'p [u32]>> {
    let out: Vec<&[u32]> = prompts.iter().map(|p| p.as_ref()).collect();
    let bad = if out.is_empty() {
        Some("at least one prompt".to_string())
    } else if let Some(i) = out.iter().position(|p| p.len() < 2) {
        Some(format!("prompt {i}: at least 2 tokens"))
    } else if let Some(i) = out
        .iter()
        .position(|p| p.iter().any(|&t| t as usize >= vocab))
    {
        Some(format!("prompt {i}: token ids below vocab_size {vocab}"))
    } else {
        out.iter().position(|p| p.len() + 8 > max_context).map(|i| {
            format!(
                "prompt {i}: at most max_context - 8 = {} tokens",
                max_context.saturating_sub(8)
            )
        })
    };
    match bad {
        Some(need) => {
            report.push(
                "kit.prompts",
                "the prompts given",
                Outcome::Failed {
                    expected: need,
                    got: format!(
                        "{} prompts of lengths {:?}",
                        out.len(),
                        out.iter().map(|p| p.len()).collect::<Vec<_>>()
                    ),
                },
            );
            None
        }
        None => Some(out),
    }
}

/// A token in `0..vocab` derived from the prompt and an index: varied, deterministic.
pub(crate) fn token(prompt: &[u32], i: usize, vocab: usize) -> u32 {
    let base = prompt.get(i % prompt.len().max(1)).copied().unwrap_or(0) as usize;
    ((base.wrapping_mul(7) + i * 13 + 1) % vocab.max(1)) as u32
}

/// A fresh engine's logits of `tokens` in one forward, `[n, vocab]`.
pub(crate) fn one_call<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    tokens: &[u32],
) -> std::result::Result<Vec<f32>, Fail> {
    let mut m = make();
    let mut logits = Vec::new();
    ok(
        m.forward(tokens, &mut logits),
        format!("forward of {} tokens on a fresh engine", tokens.len()),
    )?;
    same_len("logits.len()", tokens.len() * m.vocab_size(), logits.len())?;
    Ok(logits)
}

/// The last row of a fresh engine's forward of `tokens` (`[vocab]`).
pub(crate) fn last_row<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    tokens: &[u32],
) -> std::result::Result<Vec<f32>, Fail> {
    let rows = one_call(make, tokens)?;
    let v = rows.len() / tokens.len().max(1);
    Ok(rows[rows.len() - v..].to_vec())
}

impl Fail {
    /// Prefixes the expectation with where it was checked.
    pub(crate) fn context(mut self, at: String) -> Self {
        if !self.skipped {
            self.expected = format!("{at}: {}", self.expected);
        }
        self
    }
}
