//! The [`HiddenStates`](crate::HiddenStates) family: row count, width and position-wise rows.

use super::report::{Outcome, Report};
use super::tree::TestTree;
use super::util::{Fail, compare_rows, ok, prompt_input, prompts, record, same_len};
use super::{KitConfig, Tolerance};
use crate::model::TargetModel;

type Check = std::result::Result<(), Fail>;

/// Runs the [`HiddenStates`](crate::HiddenStates) checks (`hidden.shape`, `hidden.rows`,
/// listed in [`crate::conformance`]) when `make()`'s [`TargetModel::hidden_states`] is `Some`
/// (else one skipped `hidden.support`).
pub fn check_hidden<T, P>(mut make: impl FnMut() -> T, prompts_in: &[P], cfg: &KitConfig) -> Report
where
    T: TargetModel,
    P: AsRef<[u32]>,
{
    let mut report = Report::new("HiddenStates", std::any::type_name::<T>());
    let probe = make();
    let (vocab, max_context) = (probe.vocab_size(), probe.max_context());
    let hs = probe
        .hidden_states()
        .map(|s| (s.hidden_size(), s.feature_layout()));
    drop(probe);
    let Some((h, layout)) = hs else {
        report.push(
            "hidden.support",
            "the engine",
            Outcome::Skipped {
                reason: "hidden_states() is None".into(),
            },
        );
        return report;
    };
    if h == 0 {
        report.push(
            "hidden.shape",
            "hidden_size()",
            Outcome::Failed {
                expected: "> 0".into(),
                got: "0".into(),
            },
        );
        return report;
    }
    let layout_ok = if layout.row_width() == h {
        Ok(())
    } else {
        Err(Fail::new(
            format!("feature_layout().row_width() == hidden_size() ({h})"),
            format!("{} ({layout:?})", layout.row_width()),
        ))
    };
    record(&mut report, "hidden.layout", "feature_layout()", layout_ok);
    let Some(ps) = prompts(&mut report, prompts_in, vocab, max_context) else {
        return report;
    };
    for (i, p) in ps.iter().enumerate() {
        let input = prompt_input(i, p);
        record(&mut report, "hidden.shape", &input, shape(&mut make, p, h));
        record(
            &mut report,
            "hidden.rollback",
            &input,
            rollback(&mut make, p, h, cfg.tolerance()),
        );
        record(
            &mut report,
            "hidden.rows",
            &input,
            rows(&mut make, p, h, cfg.tolerance()),
        );
    }
    report
}

/// The rows the engine holds now (`[n, h]` expected), finite.
fn read<T: TargetModel>(
    m: &T,
    n: usize,
    h: usize,
    after: &str,
) -> std::result::Result<Vec<f32>, Fail> {
    let s = m
        .hidden_states()
        .ok_or_else(|| Fail::new("hidden_states() Some", "None"))?;
    let rows = s
        .last_hidden()
        .ok_or_else(|| Fail::new(format!("last_hidden() Some after {after}"), "None"))?;
    same_len(
        format!("last_hidden().len() after {after} ([n, hidden_size])"),
        n * h,
        rows.len(),
    )?;
    if let Some(i) = rows.iter().position(|x| !x.is_finite()) {
        return Err(Fail::new(
            "finite hidden states",
            format!("{} at row {} after {after}", rows[i], i / h),
        ));
    }
    Ok(rows.to_vec())
}

fn shape<T: TargetModel>(make: &mut impl FnMut() -> T, p: &[u32], h: usize) -> Check {
    let n = p.len();
    let mut m = make();
    let mut logits = Vec::new();
    ok(m.forward(p, &mut logits), "forward(prompt)")?;
    read(&m, n, h, "forward(prompt)")?;
    ok(m.truncate(0), "truncate(0)")?;
    ok(m.prefill(&p[..n - 1]), "prefill(prompt[..n - 1])")?;
    read(&m, n - 1, h, "prefill")?;
    ok(m.forward(&p[n - 1..], &mut logits), "forward(last token)")?;
    read(&m, 1, h, "a 1-token forward")?;
    let cap = m.tree().map_or(0, |t| t.max_tree_nodes());
    if cap > 0 {
        let tree = TestTree::new(p, m.vocab_size(), cap);
        ok(m.truncate(n - 1), "truncate(n - 1)")?;
        let t = m.tree().ok_or_else(|| Fail::new("tree() Some", "None"))?;
        ok(
            t.forward_tree(p[n - 1], &tree.block(), &mut logits),
            "forward_tree",
        )?;
        read(&m, tree.tokens.len() + 1, h, "forward_tree")?;
    }
    Ok(())
}

/// Rows after rejected tokens and their truncation are a fresh forward's (skipped, as passed,
/// for a target that cannot truncate: its rollback is checked by the rollback family).
fn rollback<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    h: usize,
    tol: Tolerance,
) -> Check {
    let n = p.len();
    let mut logits = Vec::new();
    let mut m = make();
    if crate::model::rollback_mode(&mut m) != crate::model::RollbackMode::Truncate {
        return Ok(());
    }
    ok(m.forward(p, &mut logits), "forward(prompt)")?;
    let whole = read(&m, n, h, "forward(prompt)")?;
    let mut m = make();
    ok(
        m.forward(&p[..n - 1], &mut logits),
        "forward(prompt[..n - 1])",
    )?;
    let junk: Vec<u32> = p.iter().rev().take(3).copied().collect();
    ok(m.forward(&junk, &mut logits), "forward(3 rejected tokens)")?;
    read(&m, junk.len(), h, "forward(3 rejected tokens)")?;
    ok(m.truncate(n - 1), "truncate(n - 1)")?;
    ok(m.forward(&p[n - 1..], &mut logits), "forward(last token)")?;
    let last = read(&m, 1, h, "forward(last token) after the truncation")?;
    compare_rows(&whole[(n - 1) * h..], &last, h, n - 1, tol)
        .map_err(|f| f.context("hidden row after rejected tokens and truncate".into()))?;
    Ok(())
}

/// A position's row does not depend on the call that computed it.
fn rows<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    h: usize,
    tol: Tolerance,
) -> Check {
    let n = p.len();
    let a = n / 2;
    let mut logits = Vec::new();
    let mut m = make();
    ok(m.forward(p, &mut logits), "forward(prompt)")?;
    let whole = read(&m, n, h, "forward(prompt)")?;
    let mut m = make();
    ok(m.forward(&p[..a], &mut logits), "forward(prompt[..a])")?;
    let mut pieces = read(&m, a, h, "forward(prompt[..a])")?;
    ok(m.forward(&p[a..], &mut logits), "forward(prompt[a..])")?;
    pieces.extend(read(&m, n - a, h, "forward(prompt[a..])")?);
    compare_rows(&whole, &pieces, h, 0, tol)
        .map_err(|f| f.context(format!("hidden rows, split at {a} vs one call")))?;
    let mut m = make();
    ok(m.prefill(&p[..n - 1]), "prefill(prompt[..n - 1])")?;
    let mut pre = read(&m, n - 1, h, "prefill")?;
    ok(m.forward(&p[n - 1..], &mut logits), "forward(last token)")?;
    pre.extend(read(&m, 1, h, "forward(last token)")?);
    compare_rows(&whole, &pre, h, 0, tol)
        .map_err(|f| f.context("hidden rows, prefill + forward vs one call".into()))?;
    let cap = m.tree().map_or(0, |t| t.max_tree_nodes());
    if cap == 0 {
        return Ok(());
    }
    let tree = TestTree::new(p, m.vocab_size(), cap);
    ok(m.truncate(n - 1), "truncate(n - 1)")?;
    let t = m.tree().ok_or_else(|| Fail::new("tree() Some", "None"))?;
    ok(
        t.forward_tree(p[n - 1], &tree.block(), &mut logits),
        "forward_tree",
    )?;
    let tree_rows = read(&m, tree.tokens.len() + 1, h, "forward_tree")?;
    compare_rows(&whole[(n - 1) * h..], &tree_rows[..h], h, 0, tol)
        .map_err(|f| f.context("tree root's hidden row".into()))?;
    for i in 0..tree.tokens.len() {
        let (_, toks) = tree.path_tokens(i);
        let mut c = make();
        ok(
            c.forward(&[p, &toks].concat(), &mut logits),
            "forward of a node's chain",
        )?;
        let chain = read(&c, n + toks.len(), h, "forward of a node's chain")?;
        compare_rows(
            &chain[chain.len() - h..],
            &tree_rows[(i + 1) * h..(i + 2) * h],
            h,
            i + 1,
            tol,
        )
        .map_err(|f| f.context(format!("node {i}'s hidden row vs its chain")))?;
    }
    Ok(())
}
