//! The [`BatchTarget`] family: slots alone and interleaved, trees, errors, release and reuse.

use super::report::{Outcome, Report};
use super::tree::TestTree;
use super::util::{Fail, compare_rows, ok, refused, same_len, token};
use super::{KitConfig, Tolerance};
use crate::error::Error;
use crate::model::{BatchTarget, SlotChunk, SlotInput};

type Check = std::result::Result<(), Fail>;

/// Runs the [`BatchTarget`] checks (`batch.*`, listed in [`crate::conformance`]) on fresh
/// engines from `make`. The reference of a prompt is its chain run alone in slot 0 of a fresh
/// engine; the other checks spread up to `max_slots` prompts over the slots (the last prompt in
/// slot 0, ...).
pub fn check_batch<B, P>(mut make: impl FnMut() -> B, prompts_in: &[P], cfg: &KitConfig) -> Report
where
    B: BatchTarget,
    P: AsRef<[u32]>,
{
    let mut report = Report::new("BatchTarget", std::any::type_name::<B>());
    let probe = make();
    let (vocab, max_context, slots) = (probe.vocab_size(), probe.max_context(), probe.max_slots());
    drop(probe);
    let Some(ps) = super::util::prompts(&mut report, prompts_in, vocab, max_context) else {
        return report;
    };
    if slots == 0 {
        report.push(
            "batch.shape",
            "max_slots()",
            Outcome::Failed {
                expected: ">= 1".into(),
                got: "0".into(),
            },
        );
        return report;
    }
    let ps: Vec<&[u32]> = ps.into_iter().take(slots).collect();
    let input = format!("{} prompts on {slots} slots", ps.len());
    let mut refs = Vec::new();
    for p in &ps {
        match alone(&mut make, p) {
            Ok(r) => refs.push(r),
            Err(f) => {
                report.push("batch.shape", &input, f.into_outcome());
                return report;
            }
        }
    }
    report.push("batch.shape", &input, Outcome::Passed);
    let tol = cfg.tolerance();
    let r = interleaved(&mut make, &ps, &refs, tol);
    super::util::record(&mut report, "batch.interleaved", &input, r);
    let r = tree(&mut make, &ps, tol);
    super::util::record(&mut report, "batch.tree", &input, r);
    for (case, r) in errors(&mut make, &ps, &refs, tol) {
        super::util::record(&mut report, "batch.errors", &format!("{input}, {case}"), r);
    }
    let r = release(&mut make, &ps, &refs, tol);
    super::util::record(&mut report, "batch.release", &input, r);
    report
}

/// The slot of prompt `i` (reversed, so prompt 0 is not in slot 0 when there are two).
fn slot_of(i: usize, n: usize) -> usize {
    n - 1 - i
}

/// Runs `chunks` in as few calls as `max_batch_tokens` allows; the logits of each chunk.
fn run<B: BatchTarget>(
    b: &mut B,
    chunks: &[SlotChunk<'_>],
) -> std::result::Result<Vec<Vec<f32>>, Fail> {
    let (v, cap) = (b.vocab_size(), b.max_batch_tokens().max(1));
    let mut out = Vec::new();
    let mut start = 0;
    while start < chunks.len() {
        let mut end = start;
        let mut rows = 0;
        while end < chunks.len() && (end == start || rows + chunks[end].input.rows() <= cap) {
            rows += chunks[end].input.rows();
            end += 1;
        }
        let mut logits = Vec::new();
        ok(
            b.forward_batch(&chunks[start..end], &mut logits),
            format!("forward_batch of {} chunks", end - start),
        )?;
        let want: usize = chunks[start..end]
            .iter()
            .map(|c| c.input.logit_rows())
            .sum();
        same_len("logits.len() ([logit rows, vocab])", want * v, logits.len())?;
        let mut at = 0;
        for c in &chunks[start..end] {
            let n = c.input.logit_rows() * v;
            out.push(logits[at..at + n].to_vec());
            at += n;
        }
        start = end;
    }
    Ok(out)
}

/// A fresh engine: slots empty, `seq_len(max_slots)` refused; the prompt's chain alone in slot 0.
fn alone<B: BatchTarget>(
    make: &mut impl FnMut() -> B,
    p: &[u32],
) -> std::result::Result<Vec<f32>, Fail> {
    let mut b = make();
    let s = b.max_slots();
    for slot in 0..s {
        same_len(
            format!("seq_len({slot}) of a fresh engine"),
            0,
            ok(b.seq_len(slot), "seq_len")?,
        )?;
    }
    match b.seq_len(s) {
        Err(Error::InvalidSlot { .. }) => {}
        other => {
            return Err(Fail::new(
                format!("seq_len({s}): Err(InvalidSlot)"),
                format!("{other:?}"),
            ));
        }
    }
    let out = run(
        &mut b,
        &[SlotChunk {
            slot: 0,
            input: SlotInput::Chain(p),
        }],
    )?;
    same_len(
        "seq_len(0) after a chain",
        p.len(),
        ok(b.seq_len(0), "seq_len")?,
    )?;
    Ok(out.concat())
}

/// Prefill and chain chunks of every slot mixed, in several orders.
fn interleaved<B: BatchTarget>(
    make: &mut impl FnMut() -> B,
    ps: &[&[u32]],
    refs: &[Vec<f32>],
    tol: Tolerance,
) -> Check {
    let mut b = make();
    let (v, n) = (b.vocab_size(), ps.len());
    let split = |i: usize, p: &[u32]| (p.len() / 2).saturating_sub(i % 2).max(1);
    let first: Vec<SlotChunk<'_>> = (0..n)
        .rev()
        .map(|i| SlotChunk {
            slot: slot_of(i, n),
            input: SlotInput::Prefill(&ps[i][..split(i, ps[i])]),
        })
        .collect();
    run(&mut b, &first)?;
    let second: Vec<SlotChunk<'_>> = (0..n)
        .map(|i| SlotChunk {
            slot: slot_of(i, n),
            input: SlotInput::Chain(&ps[i][split(i, ps[i])..ps[i].len() - 1]),
        })
        .filter(|c| c.input.rows() > 0)
        .collect();
    let second_rows = run(&mut b, &second)?;
    let third: Vec<SlotChunk<'_>> = (0..n)
        .rev()
        .map(|i| SlotChunk {
            slot: slot_of(i, n),
            input: SlotInput::Chain(&ps[i][ps[i].len() - 1..]),
        })
        .collect();
    let third_rows = run(&mut b, &third)?;
    let mut k = 0;
    for i in 0..n {
        let (a, len) = (split(i, ps[i]), ps[i].len());
        let mut got = Vec::new();
        if len - 1 > a {
            got.extend_from_slice(&second_rows[k]);
            k += 1;
        }
        got.extend_from_slice(&third_rows[n - 1 - i]);
        compare_rows(&refs[i][a * v..], &got, v, a, tol).map_err(|f| {
            f.context(format!(
                "prompt {i} in slot {} interleaved vs alone",
                slot_of(i, n)
            ))
        })?;
        same_len(
            format!("seq_len({})", slot_of(i, n)),
            len,
            ok(b.seq_len(slot_of(i, n)), "seq_len")?,
        )?;
    }
    Ok(())
}

/// A tree chunk beside chains: node rows equal chain rows; commit keeps the path.
fn tree<B: BatchTarget>(make: &mut impl FnMut() -> B, ps: &[&[u32]], tol: Tolerance) -> Check {
    let mut b = make();
    let cap = b.max_tree_nodes();
    if cap == 0 {
        return Err(Fail::skip("max_tree_nodes() is 0"));
    }
    let (v, n, p) = (b.vocab_size(), ps.len(), ps[0]);
    let t = TestTree::new(p, v, cap);
    let slot = slot_of(0, n);
    let mut chunks = vec![SlotChunk {
        slot,
        input: SlotInput::Prefill(&p[..p.len() - 1]),
    }];
    chunks.extend((1..n).map(|i| SlotChunk {
        slot: slot_of(i, n),
        input: SlotInput::Chain(ps[i]),
    }));
    run(&mut b, &chunks)?;
    let mut calls = vec![SlotChunk {
        slot,
        input: SlotInput::Tree {
            root: p[p.len() - 1],
            block: t.block(),
        },
    }];
    calls.extend((1..n).map(|i| SlotChunk {
        slot: slot_of(i, n),
        input: SlotInput::Chain(&ps[i][..1]),
    }));
    let mut logits = Vec::new();
    ok(
        b.forward_batch(&calls, &mut logits),
        "forward_batch with a tree chunk",
    )?;
    let rows = t.tokens.len() + 1;
    same_len("logits.len()", (rows + n - 1) * v, logits.len())?;
    for i in 0..t.tokens.len() {
        let (_, toks) = t.path_tokens(i);
        let expected = alone(make, &[p, &toks].concat())?;
        compare_rows(
            &expected[expected.len() - v..],
            &logits[(i + 1) * v..(i + 2) * v],
            v,
            i + 1,
            tol,
        )
        .map_err(|f| f.context(format!("tree node {i} vs its chain alone")))?;
    }
    let (nodes, toks) = t.path_tokens(t.deepest());
    ok(
        b.commit_tree(slot, &nodes),
        format!("commit_tree({slot}, {nodes:?})"),
    )?;
    same_len(
        "seq_len after commit_tree",
        p.len() + nodes.len(),
        ok(b.seq_len(slot), "seq_len")?,
    )?;
    let x = token(p, 3, v);
    let got = run(
        &mut b,
        &[SlotChunk {
            slot,
            input: SlotInput::Chain(&[x]),
        }],
    )?
    .concat();
    let expected = alone(make, &[p, &toks, &[x]].concat())?;
    compare_rows(&expected[expected.len() - v..], &got, v, 0, tol)
        .map_err(|f| f.context("the row after commit_tree vs a chain".into()))
        .map(|_| ())
}

/// Refused calls change no slot.
fn errors<B: BatchTarget>(
    make: &mut impl FnMut() -> B,
    ps: &[&[u32]],
    refs: &[Vec<f32>],
    tol: Tolerance,
) -> Vec<(&'static str, Check)> {
    [
        "an out-of-vocab id in the last chunk",
        "a slot out of range",
        "a slot listed twice",
        "truncate beyond the length",
    ]
    .into_iter()
    .map(|case| (case, error_case(make, ps, refs, tol, case)))
    .collect()
}

fn error_case<B: BatchTarget>(
    make: &mut impl FnMut() -> B,
    ps: &[&[u32]],
    refs: &[Vec<f32>],
    tol: Tolerance,
    case: &str,
) -> Check {
    let mut b = make();
    let (v, s, n) = (b.vocab_size(), b.max_slots(), ps.len());
    let halves: Vec<usize> = ps.iter().map(|p| p.len() / 2).collect();
    let start: Vec<SlotChunk<'_>> = (0..n)
        .map(|i| SlotChunk {
            slot: slot_of(i, n),
            input: SlotInput::Chain(&ps[i][..halves[i]]),
        })
        .collect();
    run(&mut b, &start)?;
    let oov = [v as u32];
    let good = SlotChunk {
        slot: slot_of(0, n),
        input: SlotInput::Chain(&ps[0][halves[0]..]),
    };
    let mut logits = Vec::new();
    match case {
        "an out-of-vocab id in the last chunk" => {
            let bad = SlotChunk {
                slot: slot_of(n - 1, n),
                input: SlotInput::Chain(&oov),
            };
            let chunks = if n >= 2 { vec![good, bad] } else { vec![bad] };
            refused(
                b.forward_batch(&chunks, &mut logits),
                "forward_batch with a chunk of an id >= vocab_size",
            )?
        }
        "a slot out of range" => {
            let bad = SlotChunk {
                slot: s,
                input: SlotInput::Chain(&ps[0][..1]),
            };
            match b.forward_batch(&[good, bad], &mut logits) {
                Err(Error::InvalidSlot { .. }) => {}
                other => {
                    return Err(Fail::new(
                        format!("forward_batch with slot {s}: Err(InvalidSlot)"),
                        format!("{:?}", other.map(|_| "Ok")),
                    ));
                }
            }
        }
        "a slot listed twice" => match b.forward_batch(&[good, good], &mut logits) {
            Err(Error::InvalidSlot { .. }) => {}
            other => {
                return Err(Fail::new(
                    "forward_batch listing a slot twice: Err(InvalidSlot)",
                    format!("{:?}", other.map(|_| "Ok")),
                ));
            }
        },
        _ => {
            let slot = slot_of(0, n);
            refused(
                b.truncate(slot, halves[0] + 1),
                format!(
                    "truncate({slot}, {}) at length {}",
                    halves[0] + 1,
                    halves[0]
                ),
            )?
        }
    }
    unchanged_after(&mut b, ps, refs, &halves, tol, case)
}

/// After the refused call of `case`: every slot still holds its first half (`halves`), and the
/// second halves give the reference rows `refs` (within `tol`).
fn unchanged_after<B: BatchTarget>(
    b: &mut B,
    ps: &[&[u32]],
    refs: &[Vec<f32>],
    halves: &[usize],
    tol: Tolerance,
    case: &str,
) -> Check {
    let (v, n) = (b.vocab_size(), ps.len());
    for (i, &half) in halves.iter().enumerate() {
        let slot = slot_of(i, n);
        same_len(
            format!("seq_len({slot}) after the refused call ({case})"),
            half,
            ok(b.seq_len(slot), "seq_len")?,
        )?;
    }
    let rest: Vec<SlotChunk<'_>> = (0..n)
        .map(|i| SlotChunk {
            slot: slot_of(i, n),
            input: SlotInput::Chain(&ps[i][halves[i]..]),
        })
        .collect();
    let got = run(b, &rest)?;
    for i in 0..n {
        compare_rows(&refs[i][halves[i] * v..], &got[i], v, halves[i], tol)
            .map_err(|f| f.context(format!("prompt {i} after the refused call ({case})")))?;
    }
    Ok(())
}

/// A released slot is empty and, reused, gives a fresh slot's rows.
fn release<B: BatchTarget>(
    make: &mut impl FnMut() -> B,
    ps: &[&[u32]],
    refs: &[Vec<f32>],
    tol: Tolerance,
) -> Check {
    let mut b = make();
    let (v, s, n) = (b.vocab_size(), b.max_slots(), ps.len());
    let first: Vec<SlotChunk<'_>> = (0..n)
        .map(|i| SlotChunk {
            slot: slot_of(i, n),
            input: SlotInput::Chain(ps[i]),
        })
        .collect();
    run(&mut b, &first)?;
    let slot = slot_of(0, n);
    ok(b.release(slot), format!("release({slot})"))?;
    same_len(
        format!("seq_len({slot}) after release"),
        0,
        ok(b.seq_len(slot), "seq_len")?,
    )?;
    if n >= 2 {
        let other = slot_of(1, n);
        same_len(
            format!("seq_len({other}) after releasing {slot}"),
            ps[1].len(),
            ok(b.seq_len(other), "seq_len")?,
        )?;
    }
    match b.release(s) {
        Err(Error::InvalidSlot { .. }) => {}
        other => {
            return Err(Fail::new(
                format!("release({s}): Err(InvalidSlot)"),
                format!("{:?}", other.map(|_| "Ok")),
            ));
        }
    }
    let q = ps[n - 1];
    let got = run(
        &mut b,
        &[SlotChunk {
            slot,
            input: SlotInput::Chain(q),
        }],
    )?
    .concat();
    compare_rows(&refs[n - 1], &got, v, 0, tol)
        .map_err(|f| {
            f.context(format!(
                "prompt {} in the reused slot {slot} vs alone",
                n - 1
            ))
        })
        .map(|_| ())
}
