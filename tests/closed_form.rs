//! Closed-form proofs of one verify step, and the shape contract of the stochastic verifier.
//!
//! 1. For random vocabularies (2..64), random logits (including `-inf` entries, ties and
//!    magnitudes up to 1e30) and random sampling configurations, the exact distribution of the
//!    first emitted token, `sum_x q(x) * P(first = . | draft = x)`, equals the processed target
//!    `p` within 1e-6 (f64 sums). `p` and `q` come from the same [`RowProcessor`] with the same
//!    configuration and history; `q` from different (draft) logits. The per-draft distribution is
//!    computed by `verify::exact`, which uses the verifier's own acceptance rule and residual, so a
//!    fault in either shows up here.
//! 2. Point-mass drafts (no q): for every token x, "accept with p(x), else sample p without x"
//!    gives exactly p.
//! 3. Padded vocabularies: q over a shorter draft vocabulary (missing entries are 0), as a
//!    processed distribution and as a dense row.
//! 4. The stochastic verifier on random valid inputs returns a well-formed [`StepOutput`]
//!    (`tokens.len() == accepted + 1`, accepted tokens are the drafts' prefix, every token is in
//!    the processed target's support); on random malformed inputs it returns one of the documented
//!    typed errors and never panics; each documented bad input gives its specific error.

mod common;

use common::steps::{Params, QMode, StepCase, draw_drafts, logit, params, step_case};
use common::{dense, process};
use proptest::collection::vec;
use proptest::prelude::*;
use speculative::rng::{Stream, lane};
use speculative::verify::DraftRow;
use speculative::verify::exact::{first_token_given_draft, first_token_marginal};
use speculative::{DraftBlock, SequenceState};
use speculative::{
    DraftProbs, Error, RowKind, SamplingConfig, StepEnd, StepOutput, TokenDist, Verifier,
    VerifyRequest,
};

/// Tolerance of the closed-form identities (f64 sums of f32 probabilities).
const TOL: f64 = 1e-6;

/// One target row and one draft row (the draft row has `qv <= vocab` entries).
#[derive(Debug, Clone)]
struct RowCase {
    vocab: usize,
    target: Vec<f32>,
    draft: Vec<f32>,
    params: Params,
}

fn row_case(padded: bool) -> impl Strategy<Value = RowCase> {
    (2usize..=64)
        .prop_flat_map(move |vocab| {
            let qv = if padded {
                (1..=vocab).boxed()
            } else {
                Just(vocab).boxed()
            };
            (Just(vocab), qv)
        })
        .prop_flat_map(|(vocab, qv)| {
            (
                vec(logit(), vocab),
                vec(logit(), qv),
                0..qv as u32,
                -4.0f32..4.0,
                -4.0f32..4.0,
                params(vocab, false),
            )
        })
        .prop_map(|(mut target, mut draft, keep, lt, ld, mut params)| {
            target[keep as usize] = lt;
            draft[keep as usize] = ld;
            params.protect(keep);
            RowCase {
                vocab: target.len(),
                target,
                draft,
                params,
            }
        })
}

fn check_is_distribution(d: &TokenDist, vocab: usize) -> Result<(), TestCaseError> {
    prop_assert_eq!(d.vocab_size(), vocab);
    prop_assert!(!d.ids().is_empty());
    prop_assert!(d.ids().windows(2).all(|w| w[0] < w[1]));
    prop_assert!(d.ids().iter().all(|&t| (t as usize) < vocab));
    prop_assert!(d.probs().iter().all(|&p| p.is_finite() && p > 0.0));
    let s: f64 = d.probs().iter().map(|&p| p as f64).sum();
    prop_assert!((s - 1.0).abs() < TOL, "sum {}", s);
    Ok(())
}

fn assert_equals_p(m: &[f64], p: &TokenDist, what: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(m.len(), p.vocab_size());
    let total: f64 = m.iter().sum();
    prop_assert!((total - 1.0).abs() < TOL, "{}: total mass {}", what, total);
    for (v, &mv) in m.iter().enumerate() {
        let pv = p.prob(v as u32) as f64;
        prop_assert!(
            (mv - pv).abs() <= TOL,
            "{}: token {}: closed form {} vs processed target {}",
            what,
            v,
            mv,
            pv
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    /// The first emitted token's marginal equals the processed target (same-size vocabularies).
    #[test]
    fn marginal_of_first_token_is_processed_target(case in row_case(false)) {
        let cfg = case.params.config();
        let ctx = &case.params.context;
        let p = process(&cfg, &case.target, ctx, case.vocab).unwrap();
        let q = process(&cfg, &case.draft, ctx, case.vocab).unwrap();
        check_is_distribution(&p, case.vocab)?;
        check_is_distribution(&q, case.vocab)?;
        let m = first_token_marginal(&p, &q).unwrap();
        assert_equals_p(&m, &p, "q as TokenDist")?;
        // The same through dense q rows (the `DraftProbs::Probs` representation).
        let qd = dense(&q, case.vocab);
        let mut md = vec![0.0f64; case.vocab];
        for x in q.ids() {
            let given = first_token_given_draft(&p, &DraftRow::Dense(&qd), *x).unwrap();
            for (o, g) in md.iter_mut().zip(given) {
                *o += qd[*x as usize] as f64 * g;
            }
        }
        assert_equals_p(&md, &p, "dense q")?;
    }

    /// Padded vocabularies: q is over the first `qv <= vocab` tokens; missing entries are 0.
    #[test]
    fn marginal_with_shorter_draft_vocab(case in row_case(true)) {
        let cfg = case.params.config();
        let ctx = &case.params.context;
        let qv = case.draft.len();
        let p = process(&cfg, &case.target, ctx, case.vocab).unwrap();
        let q = process(&cfg, &case.draft, ctx, case.vocab).unwrap();
        check_is_distribution(&q, qv)?;
        let m = first_token_marginal(&p, &q).unwrap();
        assert_equals_p(&m, &p, "padded q as TokenDist")?;
        let qd = dense(&q, qv);
        let mut md = vec![0.0f64; case.vocab];
        for x in q.ids() {
            let given = first_token_given_draft(&p, &DraftRow::Dense(&qd), *x).unwrap();
            for (o, g) in md.iter_mut().zip(given) {
                *o += qd[*x as usize] as f64 * g;
            }
        }
        assert_equals_p(&md, &p, "padded dense q")?;
        // A q over a wider vocabulary than p is a typed error, not a silent truncation.
        if qv < case.vocab {
            let wide = first_token_marginal(&q, &p);
            prop_assert!(matches!(wide, Err(Error::DraftVocabTooLarge { .. })), "{:?}", wide);
        }
    }

    /// Point-mass drafts: whatever token x is drafted, the first emitted token follows p exactly.
    #[test]
    fn point_mass_draft_gives_p_for_every_token(case in row_case(false)) {
        let cfg = case.params.config();
        let p = process(&cfg, &case.target, &case.params.context, case.vocab).unwrap();
        for x in 0..case.vocab as u32 {
            let given = first_token_given_draft(&p, &DraftRow::PointMass, x).unwrap();
            assert_equals_p(&given, &p, &format!("point mass on {x}"))?;
        }
        let out = first_token_given_draft(&p, &DraftRow::PointMass, case.vocab as u32);
        prop_assert!(matches!(out, Err(Error::TokenOutOfVocab { .. })), "{:?}", out);
    }
}

// ---------------------------------------------------------------------------------------------
// The processed target itself: `RowProcessor::distribution` against the documented pipeline.

/// The documented pipeline in f64, written from the definitions (GUIDE section 1): steps 1-3,
/// temperature, top-k (ties to the lower id), softmax, top-p (smallest highest-probability set
/// with mass >= top_p, ties to the lower id), min-p (prob >= min_p * max prob), renormalise.
/// Returns `None` when the case sits on a filter boundary within rounding error (then float
/// details legitimately decide), so that the comparison is only made where it is well defined.
fn reference_distribution(params: &Params, row: &[f32], history: &[u32]) -> Option<Vec<f64>> {
    let e = params.masking().apply(row, history);
    let vocab = e.len();
    let mx = e.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Rank: processed logit descending, then id ascending.
    let mut order: Vec<usize> = (0..vocab).filter(|&i| e[i] > f32::NEG_INFINITY).collect();
    order.sort_by(|&a, &b| e[b].partial_cmp(&e[a]).unwrap().then(a.cmp(&b)));
    if params.top_k > 0 && params.top_k < order.len() {
        order.truncate(params.top_k);
    }
    let t = params.temperature as f64;
    let mut w: Vec<(usize, f64)> = order
        .iter()
        .map(|&i| (i, ((e[i] as f64 - mx as f64) / t).exp()))
        .collect();
    let total: f64 = w.iter().map(|x| x.1).sum();
    if params.top_p < 1.0 {
        let need = params.top_p as f64 * total;
        let mut acc = 0.0;
        let mut cut = w.len();
        for (j, &(_, x)) in w.iter().enumerate() {
            let before = acc;
            acc += x;
            if acc >= need {
                // Ambiguous if the running mass is within rounding of the threshold, or if the
                // boundary token and the next have nearly equal (but not equal) probability.
                if (acc - need).abs() < 1e-5 * total || (need - before).abs() < 1e-5 * total {
                    return None;
                }
                if let Some(&(i2, x2)) = w.get(j + 1) {
                    let i = w[j].0;
                    if e[i] != e[i2] && (x - x2).abs() <= 1e-4 * x {
                        return None;
                    }
                }
                cut = j + 1;
                break;
            }
        }
        w.truncate(cut);
    }
    if params.min_p > 0.0 {
        let max = w.iter().fold(0.0f64, |m, x| m.max(x.1));
        let thr = params.min_p as f64 * max;
        if w.iter().any(|x| (x.1 - thr).abs() < 1e-5 * max) {
            return None;
        }
        w.retain(|x| x.1 >= thr);
    }
    let total: f64 = w.iter().map(|x| x.1).sum();
    let mut out = vec![0.0f64; vocab];
    for (i, x) in w {
        out[i] = x / total;
    }
    Some(out)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 3000,
        max_global_rejects: 3000,
        ..ProptestConfig::default()
    })]

    /// The processed target p is the documented pipeline's distribution (so the closed-form and
    /// statistical proofs are about the right p).
    #[test]
    fn processing_matches_documented_pipeline(case in row_case(false)) {
        let cfg = case.params.config();
        let ctx = &case.params.context;
        let want = reference_distribution(&case.params, &case.target, ctx);
        prop_assume!(want.is_some());
        let want = want.unwrap();
        let got = process(&cfg, &case.target, ctx, case.vocab).unwrap();
        for (t, &w) in want.iter().enumerate() {
            let g = got.prob(t as u32) as f64;
            prop_assert!((g - w).abs() <= 1e-5, "token {}: {} vs reference {}\n{:?}", t, g, w, got);
            // Same support, up to f32 underflow of tiny probabilities.
            if w > 1e-30 {
                prop_assert!(g > 0.0 || w < 1e-6, "token {} dropped (reference {})", t, w);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The verifier's output contract on random inputs.

fn check_well_formed(
    out: &StepOutput,
    c: &StepCase,
    cfg: &SamplingConfig,
    drafts: &[u32],
) -> Result<(), TestCaseError> {
    prop_assert_eq!(out.tokens.len(), out.accepted + 1);
    prop_assert!(out.accepted <= c.k);
    prop_assert_eq!(&out.tokens[..out.accepted], &drafts[..out.accepted]);
    prop_assert!(out.tokens.iter().all(|&t| (t as usize) < c.vocab));
    let end = if out.accepted < c.k {
        StepEnd::Rejected {
            index: out.accepted,
        }
    } else if c.k == 0 {
        StepEnd::NoDraft
    } else {
        StepEnd::AllAccepted
    };
    prop_assert_eq!(out.end, end);
    // Every emitted token is in the support of its processed target row.
    let mut prefix = c.params.context.clone();
    for (i, &t) in out.tokens.iter().enumerate() {
        let row = &c.target[i * c.vocab..(i + 1) * c.vocab];
        let p = process(cfg, row, &prefix, c.vocab).unwrap();
        prop_assert!(
            p.prob(t) > 0.0,
            "row {} emitted {} outside the support {:?}",
            i,
            t,
            p.ids()
        );
        prefix.push(t);
    }
    Ok(())
}

fn request<'a>(
    c: &'a StepCase,
    cfg: &'a SamplingConfig,
    drafts: &'a [u32],
    q_rows: &'a [f32],
) -> VerifyRequest<'a> {
    let q = match c.mode {
        QMode::PointMass => DraftProbs::PointMass,
        QMode::Probs => DraftProbs::Probs {
            probs: q_rows,
            vocab: c.qv,
        },
        QMode::Logits => DraftProbs::Logits {
            logits: &c.draft_logits,
            vocab: c.qv,
        },
    };
    VerifyRequest::new(cfg, &c.target, c.vocab, drafts)
        .draft_probs(q)
        .context(&c.params.context)
        .seed(c.seed)
}

fn is_documented_error(e: &Error) -> bool {
    matches!(
        e,
        Error::ShapeMismatch { .. }
            | Error::TokenOutOfVocab { .. }
            | Error::DraftVocabTooLarge { .. }
            | Error::NonFiniteLogits { .. }
            | Error::NoAllowedToken { .. }
            | Error::InvalidDraftProbs { .. }
    )
}

/// Arbitrary, mostly malformed inputs for the fuzz property.
#[derive(Debug, Clone)]
struct Fuzz {
    vocab: usize,
    target: Vec<f32>,
    drafts: Vec<u32>,
    q: Vec<f32>,
    qv: usize,
    q_is_logits: bool,
    params: Params,
    seed: u64,
}

/// NaN (both signs) or `+inf`.
fn non_finite() -> impl Strategy<Value = f32> {
    prop::sample::select(vec![f32::NAN, -f32::NAN, f32::INFINITY])
}

fn wild() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => -5.0f32..5.0,
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
        1 => Just(0.0f32),
        1 => -1.0f32..0.0,
    ]
}

fn fuzz() -> impl Strategy<Value = Fuzz> {
    (1usize..=12, 0usize..=4, 0usize..=14)
        .prop_flat_map(|(vocab, k, qv)| {
            // Shapes are right most of the time and off by one sometimes.
            let rows = prop_oneof![6 => Just((k + 1) * vocab), 1 => 0..(k + 2) * vocab + 2];
            let qlen = prop_oneof![6 => Just(k * qv), 1 => 0..(k + 1) * qv + 2];
            (
                Just((vocab, qv)),
                rows.prop_flat_map(|n| vec(wild(), n)),
                vec(0..vocab as u32 + 2, k),
                qlen.prop_flat_map(|n| vec(wild(), n)),
                any::<bool>(),
                params(vocab.max(1), true),
                any::<u64>(),
            )
        })
        .prop_map(
            |((vocab, qv), target, drafts, q, q_is_logits, params, seed)| Fuzz {
                vocab,
                target,
                drafts,
                q,
                qv,
                q_is_logits,
                params,
                seed,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    /// Valid inputs: the step succeeds, is well formed, and is a pure function of its inputs.
    #[test]
    fn stochastic_step_output_is_well_formed(c in step_case()) {
        let cfg = c.params.config();
        let (drafts, q_rows) = draw_drafts(&c, &cfg);
        let req = request(&c, &cfg, &drafts, &q_rows);
        let mut v = Verifier::new();
        let out = v.verify(&req);
        let out = match out {
            Ok(o) => o,
            Err(e) => return Err(TestCaseError::fail(format!("valid input failed: {e}"))),
        };
        check_well_formed(&out, &c, &cfg, &drafts)?;
        // Same seed, fresh or reused verifier: same output.
        prop_assert_eq!(&Verifier::new().verify(&req).unwrap(), &out);
        prop_assert_eq!(&v.verify(&req).unwrap(), &out);
    }

    /// A NaN in target row j (at a token no mask removes) is reported as exactly that error,
    /// unless the step ended before reading row j.
    #[test]
    fn nan_target_row_is_reported_when_read(c in step_case(), j in 0usize..6) {
        let j = j.min(c.k);
        let cfg = c.params.config();
        let (drafts, q_rows) = draw_drafts(&c, &cfg);
        let mut c2 = c.clone();
        c2.target[j * c.vocab + c.keep as usize] = f32::NAN;
        let req = request(&c2, &cfg, &drafts, &q_rows);
        match Verifier::new().verify(&req) {
            Ok(out) => prop_assert!(out.accepted < j, "row {} was read but NaN not reported", j),
            Err(Error::NonFiniteLogits { kind: RowKind::Target, row, .. }) => {
                prop_assert_eq!(row, j)
            }
            Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
        }
    }

    /// Arbitrary inputs: never a panic; Ok outputs are well formed; errors are the typed ones.
    #[test]
    fn malformed_inputs_give_typed_errors(f in fuzz()) {
        let cfg = f.params.config();
        let q = if f.q_is_logits {
            DraftProbs::Logits { logits: &f.q, vocab: f.qv }
        } else {
            DraftProbs::Probs { probs: &f.q, vocab: f.qv }
        };
        for probs in [q, DraftProbs::PointMass] {
            let req = VerifyRequest::new(&cfg, &f.target, f.vocab, &f.drafts)
                .draft_probs(probs)
                .context(&f.params.context)
                .seed(f.seed);
            match Verifier::new().verify(&req) {
                Ok(out) => {
                    prop_assert_eq!(out.tokens.len(), out.accepted + 1);
                    prop_assert!(out.accepted <= f.drafts.len());
                    prop_assert!(out.tokens.iter().all(|&t| (t as usize) < f.vocab));
                }
                Err(e) => prop_assert!(is_documented_error(&e), "undocumented error {:?}", e),
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Long rows (the row scans work on 16-lane chunks and 256-entry blocks) with NaN / +inf
    /// anywhere, huge finite values whose sum overflows, and `-inf`: sampling configurations
    /// (with and without top-k) report the first NaN / +inf, and never a false one.
    #[test]
    fn long_rows_non_finite_screen(
        row in (1usize..3000).prop_flat_map(|n| vec(prop_oneof![
            6 => -3.0f32..3.0,
            2 => prop::sample::select(vec![3.0e38f32, -3.0e38, f32::NEG_INFINITY]),
        ], n)),
        bad in vec((0usize..3000, non_finite()), 0..3),
        top_k in prop_oneof![Just(0usize), 1usize..100],
    ) {
        let mut row = row;
        let vocab = row.len();
        for (i, v) in bad {
            row[i % vocab] = v;
        }
        let cfg = SamplingConfig::builder()
            .temperature(0.9)
            .top_k(top_k)
            .top_p(0.95)
            .build()
            .unwrap();
        let out = process(&cfg, &row, &[], vocab);
        match row.iter().position(|v| v.is_nan() || *v == f32::INFINITY) {
            Some(t) => {
                let ok = matches!(out, Err(Error::NonFiniteLogits { token, .. }) if token == t);
                prop_assert!(ok, "want NonFiniteLogits at {}, got {:?}", t, out);
            }
            None if row.iter().all(|&v| v == f32::NEG_INFINITY) => {
                let no_allowed = matches!(out, Err(Error::NoAllowedToken { .. }));
                prop_assert!(no_allowed, "{:?}", out);
            }
            None => {
                let d = out.unwrap();
                check_is_distribution(&d, vocab)?;
                // The maximum is always kept.
                let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let first = row.iter().position(|&v| v == mx).unwrap() as u32;
                prop_assert!(d.prob(first) > 0.0);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Top-k selection on long rows (block prefilter, chunk skipping, branch-free admission,
    /// buffer compactions) equals sorting by (logit descending, id ascending).
    #[test]
    fn top_k_selection_matches_sorting(
        row in (1usize..20_000).prop_flat_map(|n| vec(prop_oneof![
            4 => -3.0f32..3.0,
            4 => prop::sample::select(vec![-1.0f32, 0.0, -0.0, 0.5, 1.0, 2.0]),
            1 => Just(f32::NEG_INFINITY),
            1 => prop::sample::select(vec![3.0e38f32, -3.0e38, f32::MIN_POSITIVE, -1e-38]),
        ], n)),
        k in prop_oneof![1usize..8, 8usize..400, Just(2000usize)],
    ) {
        let mut out = Vec::new();
        speculative::sampling::select_top_k(&row, k, &mut out);
        let got: Vec<u32> = out.iter().map(|c| c.id).collect();
        let mut idx: Vec<u32> = (0..row.len() as u32)
            .filter(|&i| row[i as usize] > f32::NEG_INFINITY)
            .collect();
        idx.sort_by(|&a, &b| {
            row[b as usize].partial_cmp(&row[a as usize]).unwrap().then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort_unstable();
        prop_assert_eq!(got, idx);
        prop_assert!(out.iter().all(|c| c.logit == row[c.id as usize]));
    }
}

// ---------------------------------------------------------------------------------------------
// Each documented bad input, one by one, for a sampling and a greedy configuration.

fn configs() -> [SamplingConfig; 2] {
    [
        SamplingConfig::builder()
            .temperature(0.8)
            .top_p(0.9)
            .build()
            .unwrap(),
        SamplingConfig::greedy(),
    ]
}

#[test]
fn bad_inputs_give_documented_errors() {
    let vocab = 5;
    let k = 2;
    let target: Vec<f32> = (0..(k + 1) * vocab).map(|i| (i % 7) as f32 * 0.3).collect();
    let q: Vec<f32> = vec![0.2; k * vocab];
    let qlog: Vec<f32> = vec![0.0; k * vocab];
    let drafts = [1u32, 3];
    for cfg in &configs() {
        let mut v = Verifier::new();
        let probs = DraftProbs::Probs { probs: &q, vocab };
        let ok = VerifyRequest::new(cfg, &target, vocab, &drafts).draft_probs(probs);
        assert!(v.verify(&ok).is_ok());

        // Wrong target shape.
        let short = &target[..target.len() - 1];
        let mut r = ok;
        r.target_logits = short;
        let e = v.verify(&r);
        assert!(
            matches!(
                e,
                Err(Error::ShapeMismatch {
                    expected: 15,
                    actual: 14,
                    ..
                })
            ),
            "{e:?}"
        );
        // Wrong q shape.
        let e = v.verify(&ok.draft_probs(DraftProbs::Probs {
            probs: &q[1..],
            vocab,
        }));
        assert!(
            matches!(
                e,
                Err(Error::ShapeMismatch {
                    expected: 10,
                    actual: 9,
                    ..
                })
            ),
            "{e:?}"
        );
        // Vocabulary 0.
        let e = v.verify(&VerifyRequest::new(cfg, &[] as &[f32], 0, &[]));
        assert!(matches!(e, Err(Error::ShapeMismatch { .. })), "{e:?}");
        // Draft token outside the vocabulary.
        let e = v.verify(&ok.draft(DraftBlock::chain(&[1, 5])));
        assert!(
            matches!(
                e,
                Err(Error::TokenOutOfVocab {
                    token: 5,
                    vocab_size: 5,
                    ..
                })
            ),
            "{e:?}"
        );
        // Context token outside the vocabulary (penalties need it).
        let pen = cfg.to_builder().repetition_penalty(1.3).build().unwrap();
        let e = v.verify(&ok.state(SequenceState::new(&pen)).context(&[0, 9]));
        assert!(
            matches!(e, Err(Error::TokenOutOfVocab { token: 9, .. })),
            "{e:?}"
        );
        // Configuration naming a token outside the vocabulary.
        let ban = cfg.to_builder().banned_tokens([7]).build().unwrap();
        let e = v.verify(&ok.state(SequenceState::new(&ban)));
        assert!(
            matches!(e, Err(Error::TokenOutOfVocab { token: 7, .. })),
            "{e:?}"
        );
        // Draft vocabulary wider than the target's.
        let wide = vec![1.0 / 6.0; k * 6];
        let e = v.verify(&ok.draft_probs(DraftProbs::Probs {
            probs: &wide,
            vocab: 6,
        }));
        assert!(
            matches!(
                e,
                Err(Error::DraftVocabTooLarge {
                    draft: 6,
                    target: 5
                })
            ),
            "{e:?}"
        );
        // NaN and +inf in target row 0 (always read).
        for bad in [f32::NAN, f32::INFINITY] {
            let mut t = target.clone();
            t[2] = bad;
            let mut r = ok;
            r.target_logits = &t;
            let e = v.verify(&r);
            assert!(
                matches!(
                    e,
                    Err(Error::NonFiniteLogits {
                        kind: RowKind::Target,
                        row: 0,
                        token: 2,
                        ..
                    })
                ),
                "{e:?}"
            );
        }
        // A row with every entry -inf.
        let mut t = target.clone();
        t[..vocab].fill(f32::NEG_INFINITY);
        let mut r = ok;
        r.target_logits = &t;
        let e = v.verify(&r);
        assert!(
            matches!(
                e,
                Err(Error::NoAllowedToken {
                    kind: RowKind::Target,
                    row: 0
                })
            ),
            "{e:?}"
        );
        // Every token removed by the allowed set (the allowed tokens are -inf).
        let allow = cfg.to_builder().allowed_tokens([0, 4]).build().unwrap();
        let mut t = target.clone();
        t[0] = f32::NEG_INFINITY;
        t[4] = f32::NEG_INFINITY;
        let mut r = ok.state(SequenceState::new(&allow));
        r.target_logits = &t;
        let e = v.verify(&r);
        assert!(
            matches!(e, Err(Error::NoAllowedToken { row: 0, .. })),
            "{e:?}"
        );
    }

    // Errors that only the stochastic path can see (greedy never reads q).
    let cfg = &configs()[0];
    let mut v = Verifier::new();
    let with_q = |q: &[f32]| -> Result<StepOutput, Error> {
        Verifier::new().verify(
            &VerifyRequest::new(cfg, &target, vocab, &drafts)
                .draft_probs(DraftProbs::Probs { probs: q, vocab }),
        )
    };
    // q gives the drafted token probability 0.
    let mut q0 = q.clone();
    q0[1] = 0.0;
    q0[0] = 0.4;
    assert!(matches!(
        with_q(&q0),
        Err(Error::InvalidDraftProbs { row: 0, .. })
    ));
    // A NaN, a negative entry, a row that does not sum to 1.
    for (i, bad) in [(2usize, f32::NAN), (2, -0.1), (2, 0.5)] {
        let mut qb = q.clone();
        qb[i] = bad;
        assert!(
            matches!(with_q(&qb), Err(Error::InvalidDraftProbs { row: 0, .. })),
            "{bad}"
        );
    }
    // NaN in draft logits is a draft-row error.
    let mut ql = qlog.clone();
    ql[3] = f32::NAN;
    let e = v.verify(
        &VerifyRequest::new(cfg, &target, vocab, &drafts)
            .draft_probs(DraftProbs::Logits { logits: &ql, vocab }),
    );
    assert!(
        matches!(
            e,
            Err(Error::NonFiniteLogits {
                kind: RowKind::Draft,
                row: 0,
                token: 3,
                ..
            })
        ),
        "{e:?}"
    );
    // Draft logits whose processed q gives the drafted token probability 0 (banned via -inf).
    let mut ql = qlog.clone();
    ql[1] = f32::NEG_INFINITY;
    let e = v.verify(
        &VerifyRequest::new(cfg, &target, vocab, &drafts)
            .draft_probs(DraftProbs::Logits { logits: &ql, vocab }),
    );
    assert!(
        matches!(e, Err(Error::InvalidDraftProbs { row: 0, .. })),
        "{e:?}"
    );
    // A drafted token beyond a shorter draft vocabulary cannot have been drawn from q.
    let qs = vec![0.25f32; k * 4];
    let e = v.verify(
        &VerifyRequest::new(cfg, &target, vocab, &[4, 0]).draft_probs(DraftProbs::Probs {
            probs: &qs,
            vocab: 4,
        }),
    );
    assert!(
        matches!(
            e,
            Err(Error::TokenOutOfVocab {
                token: 4,
                vocab_size: 4,
                ..
            })
        ),
        "{e:?}"
    );
}

/// The seed keys every random draw: over many seeds a step with a contested draft both accepts
/// and rejects, and the same seed always gives the same result.
#[test]
fn seed_keys_the_outcome() {
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    let target = [0.0f32, 0.0, 0.0, 0.0, 0.0, 0.0];
    let q = [0.9f32, 0.1, 0.0];
    let mut accepted = 0;
    for seed in 0..200u64 {
        let req = VerifyRequest::new(&cfg, &target, 3, &[0])
            .draft_probs(DraftProbs::Probs {
                probs: &q,
                vocab: 3,
            })
            .seed(seed);
        let a = Verifier::new().verify(&req).unwrap();
        assert_eq!(a, Verifier::new().verify(&req).unwrap());
        accepted += a.accepted;
        // The acceptance draw is exactly the documented uniform: u < p(x) / q(x) = (1/3) / 0.9.
        let u = Stream::new(seed).uniform(0, lane::ACCEPT) as f64;
        assert_eq!(
            a.accepted == 1,
            u < (1.0f64 / 3.0) as f32 as f64 / 0.9f32 as f64
        );
    }
    assert!((40..110).contains(&accepted), "{accepted}");
}
