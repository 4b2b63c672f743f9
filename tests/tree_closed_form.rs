//! Closed-form proofs of tree verification, and the real verifier against them.
//!
//! 1. **Exact law** (property test). For random small trees (vocabulary 3-12, depth up to 4, up
//!    to 3 siblings per group, every sibling scheme and trees that mix them, penalties, bias,
//!    masks, top-k / top-p / min-p, a prompt length, `min_tokens` suppression by depth, a draft
//!    vocabulary narrower than the target's, an EOS whose nodes end the step) whose groups are drafted as their scheme says (deterministic: fixed
//!    distinct tokens or the draft's top tokens; with replacement: i.i.d. from q; without
//!    replacement: sequentially from q), the exact law of the first emitted token and of the
//!    first two, marginalised over the drafts and the verifier's rule (`common::tree::LawCalc`,
//!    f64), equals the processed target's: `p(a)` and `p(a) * p'(b | a)` with `p'` the processed
//!    row after `a`, within 1e-9. Target and draft rows come from the library's own processing
//!    (`RowProcessor` with the history context + path), as in `tests/closed_form.rs`.
//! 2. **Negative controls of the calculator**: the same identity fails (by far more than 1e-9)
//!    for the faulty rules (a) residual not updated between siblings, (b) siblings tested
//!    independently against the unmodified target, (c) samples drawn without replacement
//!    verified with the with-replacement rule.
//! 3. **The real verifier against the calculator**: for fixed drafted trees, the empirical law of
//!    `Verifier::verify`'s outcome (accepted path and emitted token) over 40,000 seeds against the
//!    calculator's conditional law given the drafts, Pearson chi-square at `ALPHA = 1e-3`
//!    (fixed seeds, so deterministic; p-values printed with `--nocapture`). Negative control: the
//!    same counts against the law of a wrong rule are rejected.
//! 4. Every outcome of the real verifier on random trees is possible under the exact law given
//!    the drafts and well-formed (the path is a path of the tree, the tokens are its tokens and
//!    the emitted token, an ending node emits no bonus).
//! 5. Deterministic (point-mass) trees reproduce plain sampling with the same seed token for
//!    token (case C15: the position's token is drawn from `p` exactly as plain sampling draws it).
//! 6. A batch of ragged trees (`Verifier::verify_batch`, each sequence with its own draft form,
//!    context, seed, prompt length and suppression) gives each sequence exactly the outcome of
//!    verifying it alone, so the laws above hold in batches too.

mod common;

use std::collections::HashMap;

use common::steps::{Params, logit, params};
use common::tree::{
    DET, DetChoice, Fault, Instance, LawCalc, Models, Outcome, QForm, Shape, SplitMix, StepRule,
    WOR, WR, outcome_tokens,
};
use common::{Fit, chi_square};
use proptest::collection::vec;
use proptest::prelude::*;
use speculative::{
    DraftProbs, SamplingConfig, SequenceParams, SiblingScheme, StepEnd, StepOutput, Verifier,
    VerifyBatch, VerifyRequest,
};

/// Tolerance of the exact identities (f64 throughout, from f32 processed rows renormalised).
const TOL: f64 = 1e-9;
/// Significance of the chi-square tests in this file.
const ALPHA: f64 = 1e-3;
/// Depths with their own logits table (deeper rows reuse the last).
const DEPTHS: usize = 6;

/// Which schemes a random tree's groups use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Det,
    Wr,
    Wor,
    Mixed,
}

impl Mode {
    fn schemes(self) -> &'static [SiblingScheme] {
        match self {
            Mode::Det => &[DET],
            Mode::Wr => &[WR],
            Mode::Wor => &[WOR],
            Mode::Mixed => &[DET, WR, WOR],
        }
    }
}

/// A random step: order-1 target and draft models (one logits row per depth and last token),
/// sampling parameters with a context, a tree shape, and the draft form.
#[derive(Debug, Clone)]
struct TreeCase {
    vocab: usize,
    qv: usize,
    /// `[DEPTHS * vocab, vocab]`: row `depth * vocab + last token`.
    target: Vec<f32>,
    /// `[DEPTHS * vocab, qv]`.
    draft: Vec<f32>,
    params: Params,
    shape_seed: u64,
    mode: Mode,
    det: DetChoice,
    logits_form: bool,
    eos: Option<u32>,
    /// The request's prompt length (within the context) and `min_tokens` suppression.
    prompt_len: usize,
    suppress: Vec<u32>,
    suppress_rows: usize,
}

fn tree_case() -> impl Strategy<Value = TreeCase> {
    (3usize..=12, any::<bool>())
        .prop_flat_map(|(vocab, padded)| {
            let qv = if padded {
                (1..=vocab).boxed()
            } else {
                Just(vocab).boxed()
            };
            (Just(vocab), qv)
        })
        .prop_flat_map(|(vocab, qv)| {
            (
                Just((vocab, qv)),
                vec(logit(), DEPTHS * vocab * vocab),
                vec(logit(), DEPTHS * vocab * qv),
                params(vocab, false),
                (0..qv as u32, any::<u64>()),
                prop::sample::select(vec![Mode::Det, Mode::Wr, Mode::Wor, Mode::Mixed]),
                prop::sample::select(vec![DetChoice::Fixed, DetChoice::TopOfDraft]),
                any::<bool>(),
                prop_oneof![2 => Just(None), 1 => (0..vocab as u32).prop_map(Some)],
                (0usize..=10, vec(0..vocab as u32, 0..3), 0usize..4),
            )
        })
        .prop_map(
            |(
                (vocab, qv),
                mut target,
                mut draft,
                mut params,
                (keep, shape_seed),
                mode,
                det,
                lf,
                eos,
                (prompt_len, mut suppress, suppress_rows),
            )| {
                for r in 0..DEPTHS * vocab {
                    target[r * vocab + keep as usize] = 0.5;
                    draft[r * qv + keep as usize] = 0.25;
                }
                params.protect(keep);
                suppress.retain(|&t| t != keep);
                let prompt_len = prompt_len.min(params.context.len());
                TreeCase {
                    vocab,
                    qv,
                    target,
                    draft,
                    params,
                    shape_seed,
                    mode,
                    det,
                    logits_form: lf && mode != Mode::Det,
                    eos,
                    prompt_len,
                    suppress,
                    suppress_rows,
                }
            },
        )
}

/// The row of an order-1 table after `seq` (context + path): depth = tokens after the context.
fn table_row(table: &[f32], width: usize, vocab: usize, ctx_len: usize, seq: &[u32]) -> Vec<f32> {
    let d = (seq.len() - ctx_len).min(DEPTHS - 1);
    let last = seq.last().copied().unwrap_or(0) as usize;
    let r = d * vocab + last;
    table[r * width..(r + 1) * width].to_vec()
}

impl TreeCase {
    fn shape(&self) -> Shape {
        // Deterministic tokens below the draft vocabulary when the block carries dense q.
        let range = if self.mode == Mode::Det {
            self.vocab
        } else {
            self.qv
        };
        Shape::random(self.shape_seed, 4, 3, 40, self.mode.schemes(), range)
    }

    fn form(&self) -> QForm {
        match self.mode {
            Mode::Det => QForm::PointMass,
            _ if self.logits_form => QForm::Logits,
            _ => QForm::Probs,
        }
    }

    /// Runs `f` with the case's models (context = the parameters' context).
    fn with_models<R>(&self, cfg: &SamplingConfig, f: impl FnOnce(&Models<'_>) -> R) -> R {
        let ctx = self.params.context.clone();
        let n = ctx.len();
        let (v, qv) = (self.vocab, self.qv);
        let target = |s: &[u32]| table_row(&self.target, v, v, n, s);
        let draft = |s: &[u32]| table_row(&self.draft, qv, v, n, s);
        let models = Models {
            cfg,
            vocab: v,
            qv,
            ctx: &ctx,
            target: &target,
            draft: &draft,
            eos: self.eos,
            det: self.det,
            prompt_len: self.prompt_len,
            suppress: &self.suppress,
            suppress_rows: self.suppress_rows,
        };
        f(&models)
    }
}

fn assert_close(got: &[f64], want: &[f64], what: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    let total: f64 = got.iter().sum();
    prop_assert!((total - 1.0).abs() <= TOL, "{}: total mass {}", what, total);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        prop_assert!(
            (g - w).abs() <= TOL,
            "{}: cell {}: tree law {} vs processed target {}",
            what,
            i,
            g,
            w
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// The law of the first emitted token, and of the first two, equals the processed target's.
    #[test]
    fn tree_law_equals_processed_target(case in tree_case()) {
        let cfg = case.params.config();
        let shape = case.shape();
        case.with_models(&cfg, |m| {
            let calc = LawCalc::new(m, &shape);
            // Row 0 of the target law is the processed row itself (a check of the calculator's
            // own target side).
            // (Laws have a cell for the stop symbol, empty at length 1.)
            let mut p0 = m.p(&[]);
            p0.push(0.0);
            assert_close(&calc.target(&[], 1), &p0, "target law vs processed row 0")?;
            for len in [1, 2] {
                let got = calc.law(Some(0), &[], len);
                assert_close(&got, &calc.target(&[], len), &format!("{:?} len {len}", case.mode))?;
            }
            Ok::<(), TestCaseError>(())
        })?;
    }
}

// ---------------------------------------------------------------------------------------------
// Negative controls of the calculator: the faulty rules are not lossless.

/// A fixed case where every fault matters: vocabulary 5, a target and a draft that disagree.
fn control_case() -> TreeCase {
    let v = 5;
    let t_row = [2.0f32, 1.5, 0.5, 0.0, -1.0];
    let d_row = [0.0f32, 1.0, 2.0, 1.5, -0.5];
    TreeCase {
        vocab: v,
        qv: v,
        target: t_row.iter().copied().cycle().take(DEPTHS * v * v).collect(),
        draft: d_row.iter().copied().cycle().take(DEPTHS * v * v).collect(),
        params: Params {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition: 1.0,
            frequency: 0.0,
            presence: 0.0,
            bias: vec![],
            banned: vec![],
            allowed: None,
            context: vec![1, 2],
        },
        shape_seed: 0,
        mode: Mode::Wr,
        det: DetChoice::Fixed,
        logits_form: false,
        eos: None,
        prompt_len: 0,
        suppress: vec![],
        suppress_rows: 0,
    }
}

/// The largest cell difference between the (possibly faulty) tree law and the target's.
fn max_gap(case: &TreeCase, shape: &Shape, fault: Fault, wor_as_wr: bool, len: usize) -> f64 {
    let cfg = case.params.config();
    case.with_models(&cfg, |m| {
        let mut calc = LawCalc::new(m, shape);
        calc.fault = fault;
        calc.wor_as_wr = wor_as_wr;
        let got = calc.law(Some(0), &[], len);
        let want = calc.target(&[], len);
        got.iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max)
    })
}

#[test]
fn faulty_rules_break_the_identity() {
    let case = control_case();
    // Three siblings at the root, each with a group of two below.
    let tree = |scheme: SiblingScheme| {
        let mut s = Shape::default();
        for n in s.group(0, scheme, 3, &[0, 1, 2]) {
            s.group(n + 1, scheme, 2, &[0, 1]);
        }
        s
    };
    for scheme in [DET, WR, WOR] {
        let s = tree(scheme);
        let ok = max_gap(&case, &s, Fault::None, false, 2);
        println!("{scheme:?}: correct rule, largest gap {ok:.2e}");
        assert!(ok <= TOL, "{scheme:?}: the correct rule is off by {ok}");
        for fault in [Fault::NoResidualUpdate, Fault::Independent] {
            for len in [1, 2] {
                let gap = max_gap(&case, &s, fault, false, len);
                println!("{scheme:?} {fault:?} len {len}: largest gap {gap:.2e}");
                assert!(
                    gap > 1e-3,
                    "{scheme:?} {fault:?}: the fault went unseen ({gap})"
                );
            }
        }
    }
    let s = tree(WOR);
    for len in [1, 2] {
        let gap = max_gap(&case, &s, Fault::None, true, len);
        println!("WithoutReplacement verified as WithReplacement, len {len}: gap {gap:.2e}");
        assert!(gap > 1e-3, "fault (c) went unseen ({gap})");
    }
}

// ---------------------------------------------------------------------------------------------
// The real verifier against the calculator's conditional law given the drafts.

fn expect_pass(name: &str, f: Fit) {
    println!(
        "{name}: p = {:.3e} (chi2 = {:.1}, df = {})",
        f.p_value, f.stat, f.df
    );
    assert!(
        f.p_value >= ALPHA,
        "{name}: the verifier was rejected: {f:?}"
    );
}

fn expect_reject(name: &str, f: Fit) {
    println!(
        "{name} (negative control): p = {:.3e} (chi2 = {:.1}, df = {}, impossible = {})",
        f.p_value, f.stat, f.df, f.impossible
    );
    assert!(
        f.p_value < ALPHA,
        "{name}: the test failed to reject a wrong law: {f:?}"
    );
}

/// The outcome of a verify step as (path, emitted token), checked for well-formedness.
fn outcome(inst: &Instance, out: &StepOutput) -> Outcome {
    let k = out.accepted;
    assert_eq!(out.path.len(), k, "{out:?}");
    for (i, &n) in out.path.iter().enumerate() {
        let want_parent = if i == 0 { 0 } else { out.path[i - 1] + 1 };
        assert_eq!(inst.parents[n as usize], want_parent, "not a path: {out:?}");
        assert_eq!(out.tokens[i], inst.tokens[n as usize], "{out:?}");
    }
    let ended = k > 0 && inst.ends[out.path[k - 1] as usize];
    if ended {
        assert_eq!(
            out.tokens.len(),
            k,
            "an ending node emits no bonus: {out:?}"
        );
        assert_eq!(out.end, StepEnd::Ended);
        (out.path.clone(), None)
    } else {
        assert_eq!(out.tokens.len(), k + 1, "{out:?}");
        assert_ne!(out.end, StepEnd::Ended);
        (out.path.clone(), Some(out.tokens[k]))
    }
}

/// Counts of the real verifier's outcomes over `n` seeds, as cells aligned with `law` (plus one
/// cell of probability 0 for outcomes the law does not have).
fn fit_against(
    inst: &Instance,
    counts: &HashMap<Outcome, u64>,
    law: &HashMap<Outcome, f64>,
) -> Fit {
    let mut keys: Vec<&Outcome> = law.keys().collect();
    keys.sort();
    let mut observed: Vec<u64> = keys
        .iter()
        .map(|k| counts.get(*k).copied().unwrap_or(0))
        .collect();
    let mut expected: Vec<f64> = keys.iter().map(|k| law[*k]).collect();
    let stray: u64 = counts
        .iter()
        .filter(|(k, _)| !law.contains_key(*k))
        .map(|(k, &c)| {
            println!(
                "  impossible outcome {k:?} (tokens {:?}) x{c}",
                outcome_tokens(inst, k)
            );
            c
        })
        .sum();
    observed.push(stray);
    expected.push(0.0);
    chi_square(&observed, &expected)
}

/// The fixed cases of the conditional test: (name, mode, configuration, draft form).
fn fixed_cases() -> Vec<(&'static str, Mode, SamplingConfig, DetChoice, bool)> {
    let plain = SamplingConfig::sampling(1.0).unwrap();
    let nucleus = common::nucleus_config();
    let penalties = common::penalty_config();
    let min_p = common::min_p_config();
    vec![
        (
            "det fixed plain",
            Mode::Det,
            plain.clone(),
            DetChoice::Fixed,
            false,
        ),
        (
            "det top-of-draft penalties",
            Mode::Det,
            penalties.clone(),
            DetChoice::TopOfDraft,
            false,
        ),
        (
            "with replacement plain",
            Mode::Wr,
            plain.clone(),
            DetChoice::Fixed,
            false,
        ),
        (
            "with replacement nucleus",
            Mode::Wr,
            nucleus.clone(),
            DetChoice::Fixed,
            false,
        ),
        (
            "with replacement penalties (draft logits)",
            Mode::Wr,
            penalties.clone(),
            DetChoice::Fixed,
            true,
        ),
        (
            "without replacement plain",
            Mode::Wor,
            plain.clone(),
            DetChoice::Fixed,
            false,
        ),
        (
            "without replacement min-p",
            Mode::Wor,
            min_p,
            DetChoice::Fixed,
            false,
        ),
        (
            "without replacement penalties (draft logits)",
            Mode::Wor,
            penalties.clone(),
            DetChoice::Fixed,
            true,
        ),
        (
            "mixed plain",
            Mode::Mixed,
            plain.clone(),
            DetChoice::Fixed,
            false,
        ),
        (
            "mixed plain (draft logits)",
            Mode::Mixed,
            plain,
            DetChoice::Fixed,
            true,
        ),
        (
            "mixed nucleus",
            Mode::Mixed,
            nucleus,
            DetChoice::Fixed,
            false,
        ),
        (
            "mixed penalties",
            Mode::Mixed,
            penalties,
            DetChoice::TopOfDraft,
            false,
        ),
    ]
}

/// A case with random tables (from `seed`) and the given mode and configuration.
fn seeded_case(
    seed: u64,
    vocab: usize,
    qv: usize,
    mode: Mode,
    det: DetChoice,
    lf: bool,
) -> TreeCase {
    let mut rng = SplitMix(seed);
    let mut table = |width: usize| -> Vec<f32> {
        (0..DEPTHS * vocab * width)
            .map(|_| (rng.uniform() * 4.0 - 2.0) as f32)
            .collect()
    };
    let target = table(vocab);
    let draft = table(qv);
    let mut p = control_case().params;
    p.context = vec![0, 1, 1];
    TreeCase {
        vocab,
        qv,
        target,
        draft,
        params: p,
        shape_seed: seed ^ 0xA5A5,
        mode,
        det,
        logits_form: lf,
        eos: Some(2),
        prompt_len: 2,
        suppress: vec![2],
        suppress_rows: 1,
    }
}

/// Seeds per fixed tree.
const N_GIVEN: u64 = 40_000;

#[test]
fn verifier_matches_conditional_law_given_drafts() {
    let mut verifier = Verifier::new();
    for (c, (name, mode, cfg, det, lf)) in fixed_cases().into_iter().enumerate() {
        let case = seeded_case(1000 + c as u64, 6, 5, mode, det, lf);
        // A bushy shape: three siblings at the root and at least 10 nodes.
        let shape = (case.shape_seed..)
            .map(|s| Shape::random(s, 4, 3, 24, mode.schemes(), 5))
            .find(|s| s.children(0).len() == 3 && s.len() >= 10)
            .unwrap();
        case.with_models(&cfg, |m| {
            let inst = Instance::draft(m, &shape, case.form(), &mut SplitMix(77 + c as u64));
            let rule = StepRule {
                models: m,
                inst: &inst,
                fault: Fault::None,
                wor_as_wr: false,
            };
            let law = rule.law();
            let mut counts: HashMap<Outcome, u64> = HashMap::new();
            for s in 0..N_GIVEN {
                let seed = s.wrapping_mul(0x9E37_79B9) ^ ((c as u64) << 48);
                let req = inst.request(&cfg, m.ctx, seed, &inst.schemes);
                let out = verifier
                    .verify(&req)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                *counts.entry(outcome(&inst, &out)).or_insert(0) += 1;
            }
            expect_pass(
                &format!("{name} ({} nodes, {} outcomes)", inst.len(), law.len()),
                fit_against(&inst, &counts, &law),
            );
        });
    }
}

/// The conditional test has power: the real verifier's counts against the law of a faulty rule
/// on the same drafts are rejected.
#[test]
fn conditional_test_rejects_wrong_rules() {
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    let mut verifier = Verifier::new();
    for (scheme, fault, wor_as_wr) in [
        (DET, Fault::NoResidualUpdate, false),
        (WR, Fault::NoResidualUpdate, false),
        (WR, Fault::Independent, false),
        (WOR, Fault::Independent, false),
        (WOR, Fault::None, true),
    ] {
        let case = control_case();
        let mut shape = Shape::default();
        for n in shape.group(0, scheme, 3, &[0, 1, 2]) {
            shape.group(n + 1, scheme, 2, &[0, 1]);
        }
        let form = if scheme == DET {
            QForm::PointMass
        } else {
            QForm::Probs
        };
        case.with_models(&cfg, |m| {
            // Drafts where every sibling matters: redraw until the root group is 3 distinct
            // tokens.
            let mut rng = SplitMix(5);
            let inst = loop {
                let inst = Instance::draft(m, &shape, form, &mut rng);
                let mut root: Vec<u32> = inst.children(0).iter().map(|&n| inst.tokens[n]).collect();
                root.dedup();
                if root.len() == 3 {
                    break inst;
                }
            };
            let wrong = StepRule {
                models: m,
                inst: &inst,
                fault,
                wor_as_wr,
            }
            .law();
            let mut counts: HashMap<Outcome, u64> = HashMap::new();
            for seed in 0..N_GIVEN {
                let req = inst.request(&cfg, m.ctx, seed, &inst.schemes);
                let out = verifier.verify(&req).unwrap();
                *counts.entry(outcome(&inst, &out)).or_insert(0) += 1;
            }
            expect_reject(
                &format!("{scheme:?} real verifier vs {fault:?} (wor as wr: {wor_as_wr})"),
                fit_against(&inst, &counts, &wrong),
            );
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Outcomes of the real verifier on random trees.

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every outcome is well-formed and has positive probability under the exact law given the
    /// drafts.
    #[test]
    fn outcomes_are_possible(case in tree_case(), draft_seed in any::<u64>(), seed in any::<u64>()) {
        let cfg = case.params.config();
        let shape = case.shape();
        case.with_models(&cfg, |m| {
            let inst = Instance::draft(m, &shape, case.form(), &mut SplitMix(draft_seed));
            let law = StepRule { models: m, inst: &inst, fault: Fault::None, wor_as_wr: false }.law();
            let total: f64 = law.values().sum();
            prop_assert!((total - 1.0).abs() < TOL, "conditional law total {}", total);
            let req = inst.request(&cfg, m.ctx, seed, &inst.schemes);
            let out = Verifier::new().verify(&req).unwrap();
            let o = outcome(&inst, &out);
            prop_assert!(law.get(&o).copied().unwrap_or(0.0) > 0.0, "impossible outcome {:?}: {:?}", o, out);
            Ok::<(), TestCaseError>(())
        })?;
    }

    /// Deterministic trees emit exactly the tokens plain sampling emits with the same seed.
    #[test]
    fn point_mass_trees_reproduce_plain_sampling(case in tree_case(), seed in any::<u64>()) {
        let case = TreeCase { mode: Mode::Det, logits_form: false, ..case };
        let cfg = case.params.config();
        let shape = case.shape();
        case.with_models(&cfg, |m| {
            let inst = Instance::draft(m, &shape, QForm::PointMass, &mut SplitMix(0));
            let req = inst.request(&cfg, m.ctx, seed, &inst.schemes);
            let out = Verifier::new().verify(&req).unwrap();
            let mut seq = m.ctx.to_vec();
            for (i, &t) in out.tokens.iter().enumerate() {
                let row = (m.target)(&seq);
                let plain = Verifier::new()
                    .verify(
                        &VerifyRequest::new(&cfg, &row, m.vocab, &[])
                            .context(&seq)
                            .seed(seed)
                            .prompt_len(case.prompt_len)
                            .suppress(&case.suppress, case.suppress_rows.saturating_sub(i)),
                    )
                    .unwrap();
                prop_assert_eq!(plain.tokens[0], t, "token {} of {:?}", i, out);
                seq.push(t);
            }
            Ok::<(), TestCaseError>(())
        })?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Each sequence of a batch of trees gets exactly the outcome it gets alone.
    #[test]
    fn batch_of_trees_is_each_tree_alone(
        case in tree_case(),
        modes in vec(prop::sample::select(vec![Mode::Det, Mode::Wr, Mode::Wor, Mode::Mixed]), 1..5),
        seeds in vec(any::<u64>(), 4),
    ) {
        let cfg = case.params.config();
        let cases: Vec<TreeCase> = modes
            .iter()
            .enumerate()
            .map(|(b, &mode)| TreeCase {
                mode,
                shape_seed: case.shape_seed ^ b as u64,
                logits_form: case.logits_form && mode != Mode::Det,
                // Contexts of different lengths: different positions and histories.
                params: Params {
                    context: case.params.context[..case.params.context.len().saturating_sub(b)].to_vec(),
                    ..case.params.clone()
                },
                prompt_len: case.prompt_len.min(case.params.context.len().saturating_sub(b)),
                ..case.clone()
            })
            .collect();
        let insts: Vec<Instance> = cases
            .iter()
            .enumerate()
            .map(|(b, c)| {
                let shape = c.shape();
                c.with_models(&cfg, |m| Instance::draft(m, &shape, c.form(), &mut SplitMix(seeds[b])))
            })
            .collect();
        let mut target = Vec::new();
        let (mut tokens, mut parents, mut schemes, mut ends) = (vec![], vec![], vec![], vec![]);
        let mut offsets = vec![0];
        for inst in &insts {
            target.extend_from_slice(&inst.target);
            tokens.extend_from_slice(&inst.tokens);
            parents.extend_from_slice(&inst.parents);
            schemes.extend_from_slice(&inst.schemes);
            ends.extend_from_slice(&inst.ends);
            offsets.push(tokens.len());
        }
        let seqs: Vec<SequenceParams<'_>> = insts
            .iter()
            .zip(&cases)
            .enumerate()
            .map(|(b, (inst, c))| {
                let q = match inst.form {
                    QForm::PointMass => DraftProbs::PointMass,
                    QForm::Probs => DraftProbs::Probs { probs: &inst.q, vocab: inst.qv },
                    QForm::Logits => DraftProbs::Logits { logits: &inst.q, vocab: inst.qv },
                };
                SequenceParams::new(&cfg, seeds[b])
                    .context(&c.params.context)
                    .prompt_len(inst.prompt_len)
                    .suppress(&inst.suppress, inst.suppress_rows)
                    .draft_probs(q)
            })
            .collect();
        let batch = VerifyBatch::new(case.vocab, &target, &tokens, &offsets, &seqs)
        .tree(&parents)
        .schemes(&schemes)
        .ends(&ends);
        let got = Verifier::new().verify_batch(&batch).unwrap();
        prop_assert_eq!(got.len(), insts.len());
        for (b, (inst, c)) in insts.iter().zip(&cases).enumerate() {
            let alone = Verifier::new()
                .verify(&inst.request(&cfg, &c.params.context, seeds[b], &inst.schemes))
                .unwrap();
            prop_assert_eq!(got[b].as_ref().unwrap(), &alone, "sequence {}", b);
        }
    }
}
