//! The rollback family: targets whose state cannot be truncated ([`TargetModel::rollback`]):
//! truncation rules, snapshot / restore, per-row states, and their refusals.

use super::report::{Outcome, Report};
use super::util::{Fail, compare_rows, ok, one_call, prompt_input, prompts, record, seq_is, token};
use super::{KitConfig, Tolerance};
use crate::error::{Error, Result};
use crate::model::{self, RollbackMode, TargetModel, rollback_mode};

type Check = std::result::Result<(), Fail>;

/// Runs the rollback checks (`rollback.*`, listed in [`crate::conformance`]) on fresh engines
/// from `make`, for every prompt; skipped (`rollback.offered`) when the engine offers no
/// [`TargetModel::rollback`].
///
/// Cost: about 10 forwards of each prompt, plus one per prompt position with row states.
pub fn check_rollback<T, P>(
    mut make: impl FnMut() -> T,
    prompts_in: &[P],
    cfg: &KitConfig,
) -> Report
where
    T: TargetModel,
    P: AsRef<[u32]>,
{
    let mut report = Report::new("Rollback", std::any::type_name::<T>());
    let mut probe = make();
    let (vocab, max_context) = (probe.vocab_size(), probe.max_context());
    let mode = rollback_mode(&mut probe);
    drop(probe);
    if mode == RollbackMode::Truncate {
        report.push(
            "rollback.offered",
            "the engine",
            Outcome::Skipped {
                reason: "TargetModel::rollback is None: the engine truncates".into(),
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
        let reference = match one_call(&mut make, p) {
            Ok(r) => r,
            Err(f) => {
                report.push("rollback.truncate", &input, f.into_outcome());
                continue;
            }
        };
        let rf = Ref {
            p,
            rows: &reference,
            tol,
        };
        check_prompt(&mut report, &mut make, mode, &input, &rf);
    }
    report
}

/// The checks of one prompt (its reference rows in `rf`): truncation, then the mode's own
/// check (`rollback.snapshot` or `rollback.rows`) and its refusals (`rollback.errors`).
fn check_prompt<T: TargetModel>(
    report: &mut Report,
    make: &mut impl FnMut() -> T,
    mode: RollbackMode,
    input: &str,
    rf: &Ref<'_>,
) {
    record(report, "rollback.truncate", input, truncation(make, rf));
    let cases: Vec<(&str, Check)> = if mode == RollbackMode::Snapshot {
        record(report, "rollback.snapshot", input, snapshot(make, rf));
        vec![
            (
                "restore without a saved state",
                no_snapshot(make, rf, false),
            ),
            ("restore after truncate(0)", no_snapshot(make, rf, true)),
        ]
    } else {
        record(report, "rollback.rows", input, row_states(make, rf));
        vec![
            (
                "keep_rows beyond the pending rows",
                too_many_rows(make, rf, 1),
            ),
            (
                "keep_rows right after a prefill",
                too_many_rows(make, rf, 0),
            ),
        ]
    };
    for (case, r) in cases {
        record(report, "rollback.errors", &format!("{input}, {case}"), r);
    }
}

/// A prompt and its one-call rows.
struct Ref<'a> {
    p: &'a [u32],
    rows: &'a [f32],
    tol: Tolerance,
}

impl Ref<'_> {
    fn vocab(&self) -> usize {
        self.rows.len() / self.p.len()
    }

    /// `m` continues the prompt from position `at` (holding `p[..at]` exactly): its rows of
    /// `p[at..]` equal the reference's.
    fn continues<T: TargetModel>(&self, m: &mut T, at: usize, after: &str) -> Check {
        seq_is(m, at, after)?;
        let v = self.vocab();
        let mut rows = Vec::new();
        ok(
            m.forward(&self.p[at..], &mut rows),
            format!("forward(prompt[{at}..]) after {after}"),
        )?;
        compare_rows(&self.rows[at * v..], &rows, v, at, self.tol)
            .map_err(|f| f.context(format!("the rest of the prompt after {after}")))?;
        Ok(())
    }

    /// Three tokens that are not the prompt's continuation.
    fn junk(&self) -> Vec<u32> {
        (0..3).map(|i| token(self.p, i + 5, self.vocab())).collect()
    }
}

/// An engine call that must be refused with [`Error::StateRollback`].
fn refused_rollback<T>(r: Result<T>, call: &str) -> Check {
    match r {
        Err(Error::StateRollback { .. }) => Ok(()),
        Err(e) => Err(Fail::new(
            format!("{call}: Err(StateRollback)"),
            format!("Err({e})"),
        )),
        Ok(_) => Err(Fail::new(format!("{call}: Err(StateRollback)"), "Ok")),
    }
}

/// `truncate(seq_len)` changes nothing; a truncation to a middle length either works as a
/// truncation or is refused with [`Error::StateRollback`] without change; `truncate(0)`
/// restarts.
fn truncation<T: TargetModel>(make: &mut impl FnMut() -> T, r: &Ref<'_>) -> Check {
    let (n, a) = (r.p.len(), r.p.len() / 2);
    let mut m = make();
    let mut rows = Vec::new();
    ok(
        m.forward(&r.p[..a], &mut rows),
        format!("forward(prompt[..{a}])"),
    )?;
    ok(m.truncate(a), "truncate(seq_len)")?;
    r.continues(&mut m, a, "truncate(seq_len)")?;
    let mut m = make();
    ok(m.forward(r.p, &mut rows), "forward(prompt)")?;
    match m.truncate(a) {
        Ok(()) => r.continues(&mut m, a, &format!("an accepted truncate({a})"))?,
        Err(Error::StateRollback { .. }) => {
            seq_is(&m, n, &format!("a refused truncate({a})"))?;
            // Unchanged: going back to the start still gives the prompt's rows.
            ok(m.truncate(0), "truncate(0)")?;
            r.continues(&mut m, 0, "truncate(0)")?;
        }
        Err(e) => {
            return Err(Fail::new(
                format!("truncate({a}): Ok or Err(StateRollback)"),
                format!("Err({e})"),
            ));
        }
    }
    let mut m = make();
    ok(m.forward(r.p, &mut rows), "forward(prompt)")?;
    ok(m.truncate(0), "truncate(0)")?;
    r.continues(&mut m, 0, "forward(prompt), truncate(0)")
}

/// Snapshot then restore equals never advanced (after a forward and after a prefill, junk fed
/// in between); the snapshot stays for a second restore.
fn snapshot<T: TargetModel>(make: &mut impl FnMut() -> T, r: &Ref<'_>) -> Check {
    let a = r.p.len() / 2;
    let junk = r.junk();
    let mut rows = Vec::new();
    for prefilled in [false, true] {
        let mut m = make();
        if prefilled {
            ok(m.prefill(&r.p[..a]), format!("prefill(prompt[..{a}])"))?;
        } else {
            ok(
                m.forward(&r.p[..a], &mut rows),
                format!("forward(prompt[..{a}])"),
            )?;
        }
        ok(model::save_state(&mut m), "save_state")?;
        ok(m.forward(&junk, &mut rows), "forward of 3 other tokens")?;
        ok(m.prefill(&junk), "prefill of 3 other tokens")?;
        ok(model::restore_state(&mut m), "restore_state")?;
        r.continues(&mut m, a, "save_state, 6 other tokens, restore_state")?;
        ok(model::restore_state(&mut m), "a second restore_state")?;
        r.continues(&mut m, a, "a second restore_state")?;
    }
    Ok(())
}

/// A restore with no saved state (never saved, or dropped by `truncate(0)`) is refused with
/// [`Error::StateRollback`] and changes nothing.
fn no_snapshot<T: TargetModel>(make: &mut impl FnMut() -> T, r: &Ref<'_>, reset: bool) -> Check {
    let a = r.p.len() / 2;
    let mut m = make();
    let mut rows = Vec::new();
    if reset {
        ok(m.forward(r.p, &mut rows), "forward(prompt)")?;
        ok(model::save_state(&mut m), "save_state")?;
        ok(m.truncate(0), "truncate(0)")?;
        refused_rollback(
            model::restore_state(&mut m),
            "restore_state after truncate(0)",
        )?;
        return r.continues(&mut m, 0, "the refused restore_state");
    }
    ok(
        m.forward(&r.p[..a], &mut rows),
        format!("forward(prompt[..{a}])"),
    )?;
    refused_rollback(
        model::restore_state(&mut m),
        "restore_state without save_state",
    )?;
    r.continues(&mut m, a, "the refused restore_state")
}

/// Per-row state `i` equals the state after a forward of the first `i` rows (`i = 0 ..`, the
/// other rows in the same forward, and across forwards); `keep_rows` moves the commit point.
fn row_states<T: TargetModel>(make: &mut impl FnMut() -> T, r: &Ref<'_>) -> Check {
    let (n, a) = (r.p.len(), r.p.len() / 2);
    let junk = r.junk();
    let mut rows = Vec::new();
    for i in 0..n - a {
        let mut m = make();
        ok(m.prefill(&r.p[..a]), format!("prefill(prompt[..{a}])"))?;
        let fed: Vec<u32> = r.p[a..a + i].iter().chain(&junk).copied().collect();
        ok(
            m.forward(&fed, &mut rows),
            format!("forward of {i} prompt and 3 other tokens"),
        )?;
        pending_is(&mut m, i + 3, "that forward")?;
        ok(model::keep_rows(&mut m, i), format!("keep_rows({i})"))?;
        pending_is(&mut m, 0, "keep_rows")?;
        r.continues(&mut m, a + i, &format!("keep_rows({i}) of {} rows", i + 3))?;
    }
    // Rows of several forwards since the commit point.
    let mut m = make();
    ok(m.prefill(&r.p[..a]), format!("prefill(prompt[..{a}])"))?;
    ok(
        m.forward(&r.p[a..a + 1], &mut rows),
        "forward of one prompt token",
    )?;
    ok(m.forward(&junk, &mut rows), "forward of 3 other tokens")?;
    pending_is(&mut m, 4, "two forwards")?;
    ok(model::keep_rows(&mut m, 1), "keep_rows(1) of two forwards")?;
    r.continues(&mut m, a + 1, "keep_rows(1) over two forwards")
}

fn pending_is<T: TargetModel>(m: &mut T, expected: usize, after: &str) -> Check {
    match model::pending_rows(m) {
        Some(got) if got == expected => Ok(()),
        got => Err(Fail::new(
            format!("pending_rows() after {after} = {expected}"),
            format!("{got:?}"),
        )),
    }
}

/// `keep_rows` of more rows than are pending (one more than a one-token forward holds, or any
/// right after a prefill, which holds none) is refused with [`Error::StateRollback`] without
/// change.
fn too_many_rows<T: TargetModel>(make: &mut impl FnMut() -> T, r: &Ref<'_>, fed: usize) -> Check {
    let a = r.p.len() / 2;
    let mut m = make();
    let mut rows = Vec::new();
    ok(m.prefill(&r.p[..a]), format!("prefill(prompt[..{a}])"))?;
    if fed > 0 {
        ok(
            m.forward(&r.p[a..a + fed], &mut rows),
            "forward of one token",
        )?;
    }
    let call = format!("keep_rows({}) with {fed} pending", fed + 1);
    refused_rollback(model::keep_rows(&mut m, fed + 1), &call)?;
    pending_is(&mut m, fed, "the refused keep_rows")?;
    r.continues(&mut m, a + fed, "the refused keep_rows")
}
