//! Greedy verification is bit-identical to a straightforward argmax reference.
//!
//! The reference below is written from the documented definitions only (GUIDE section 1 and the
//! [`SamplingConfig`] docs): penalties over the context plus the accepted drafts (repetition per
//! distinct token, then `count * f + pr`), logit bias (last entry per token wins), banned and
//! allowed sets, then the first index of the maximum (ties to the lowest id). Temperature 0
//! makes top-k, top-p and min-p irrelevant to the argmax, so they are set at random and ignored
//! by the reference. Inputs are full of ties (logits from a small set of values), `-inf`
//! entries and magnitudes up to 1e30; half of the drafts follow the reference argmax so that
//! long accepted runs and bonus tokens occur.

mod common;

use common::Masking;
use proptest::collection::vec;
use proptest::prelude::*;
use speculative::{
    DraftProbs, Error, RowKind, SamplingConfig, SequenceParams, StepEnd, StepOutput, Verifier,
    VerifyBatch, VerifyRequest,
};

#[derive(Debug, Clone)]
struct Params {
    repetition: f32,
    frequency: f32,
    presence: f32,
    bias: Vec<(u32, f32)>,
    banned: Vec<u32>,
    allowed: Option<Vec<u32>>,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    logprobs: Option<usize>,
}

impl Params {
    fn config(&self) -> SamplingConfig {
        let mut b = SamplingConfig::builder()
            .temperature(0.0)
            .repetition_penalty(self.repetition)
            .frequency_penalty(self.frequency)
            .presence_penalty(self.presence)
            .banned_tokens(self.banned.iter().copied())
            .top_k(self.top_k)
            .top_p(self.top_p)
            .min_p(self.min_p);
        for &(t, v) in &self.bias {
            b = b.logit_bias(t, v);
        }
        if let Some(a) = &self.allowed {
            b = b.allowed_tokens(a.iter().copied());
        }
        if let Some(n) = self.logprobs {
            b = b.logprobs(n);
        }
        b.build().unwrap()
    }

    /// The documented processing of one row after `history` (steps 1-3 of the pipeline).
    fn effective(&self, row: &[f32], history: &[u32]) -> Vec<f32> {
        Masking {
            repetition: self.repetition,
            frequency: self.frequency,
            presence: self.presence,
            bias: &self.bias,
            banned: &self.banned,
            allowed: self.allowed.as_deref(),
        }
        .apply(row, history)
    }
}

/// First index of the maximum; `None` when every entry is `-inf`.
fn first_argmax(e: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in e.iter().enumerate() {
        if x > f32::NEG_INFINITY && best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// What the reference expects from a step.
#[derive(Debug, PartialEq)]
enum Expected {
    Ok { tokens: Vec<u32>, end: StepEnd },
    NoAllowed { row: usize },
}

fn reference(p: &Params, target: &[f32], vocab: usize, drafts: &[u32], ctx: &[u32]) -> Expected {
    let k = drafts.len();
    let mut hist = ctx.to_vec();
    let mut tokens = Vec::new();
    for i in 0..=k {
        let e = p.effective(&target[i * vocab..(i + 1) * vocab], &hist);
        let Some(best) = first_argmax(&e) else {
            return Expected::NoAllowed { row: i };
        };
        tokens.push(best);
        if i == k {
            let end = if k == 0 {
                StepEnd::NoDraft
            } else {
                StepEnd::AllAccepted
            };
            return Expected::Ok { tokens, end };
        }
        if drafts[i] != best {
            return Expected::Ok {
                tokens,
                end: StepEnd::Rejected { index: i },
            };
        }
        hist.push(best);
    }
    unreachable!()
}

/// log-softmax (temperature 1) of the effective row, and its `n` best `(token, logprob)`.
fn reference_logprobs(e: &[f32], token: u32, n: usize) -> (f64, Vec<(u32, f64)>) {
    let mx = e.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = mx + e.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln();
    let mut ids: Vec<u32> = (0..e.len() as u32)
        .filter(|&t| e[t as usize] > f32::NEG_INFINITY)
        .collect();
    ids.sort_by(|&a, &b| {
        e[b as usize]
            .partial_cmp(&e[a as usize])
            .unwrap()
            .then(a.cmp(&b))
    });
    ids.truncate(n);
    (
        e[token as usize] as f64 - lse,
        ids.iter()
            .map(|&t| (t, e[t as usize] as f64 - lse))
            .collect(),
    )
}

/// NaN (both signs) or `+inf`.
fn non_finite() -> impl Strategy<Value = f32> {
    prop::sample::select(vec![f32::NAN, -f32::NAN, f32::INFINITY])
}

fn tie_logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => prop::sample::select(vec![-1.0f32, 0.0, 0.5, 1.0, 2.0, 2.5]),
        2 => Just(f32::NEG_INFINITY),
        2 => -4.0f32..4.0,
        1 => prop::sample::select(vec![-1e30f32, 1e30]),
    ]
}

fn penalty(off: f32, common: Vec<f32>, lo: f32, hi: f32) -> impl Strategy<Value = f32> {
    prop_oneof![
        2 => Just(off),
        1 => prop::sample::select(common),
        1 => lo..hi,
    ]
}

fn bias_value() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => prop::sample::select(vec![0.5f32, 1.0, -1.0]),
        1 => Just(f32::NEG_INFINITY),
        1 => -3.0f32..3.0,
    ]
}

fn params(vocab: usize) -> impl Strategy<Value = Params> {
    let v = vocab as u32;
    let filters = (
        0..=vocab,
        prop_oneof![Just(1.0f32), 0.05f32..1.0],
        prop_oneof![Just(0.0f32), 0.0f32..1.0],
    );
    (
        penalty(1.0, vec![0.5, 1.5, 2.0], 0.3, 3.0),
        penalty(0.0, vec![0.5, -0.5], -1.0, 1.0),
        penalty(0.0, vec![0.5, 1.0], -1.0, 1.0),
        vec((0..v, bias_value()), 0..5),
        vec(0..v, 0..4),
        prop_oneof![4 => Just(None), 1 => vec(0..v, 1..8).prop_map(Some)],
        filters,
        prop_oneof![2 => Just(None), 1 => (0usize..5).prop_map(Some)],
    )
        .prop_map(
            |(repetition, frequency, presence, bias, banned, allowed, f, logprobs)| {
                let (top_k, top_p, min_p) = f;
                Params {
                    repetition,
                    frequency,
                    presence,
                    bias,
                    banned,
                    allowed,
                    top_k,
                    top_p,
                    min_p,
                    logprobs,
                }
            },
        )
}

#[derive(Debug, Clone)]
struct Case {
    vocab: usize,
    target: Vec<f32>,
    /// For each draft position: follow the reference argmax (`None`) or propose this token.
    draft_choice: Vec<Option<u32>>,
    context: Vec<u32>,
    params: Params,
    seeds: (u64, u64),
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..=64, 0usize..=8)
        .prop_flat_map(|(vocab, k)| {
            (
                vec(tie_logit(), (k + 1) * vocab),
                vec(prop_oneof![Just(None), (0..vocab as u32).prop_map(Some)], k),
                vec(0..vocab as u32, 0..12),
                params(vocab),
                any::<(u64, u64)>(),
            )
        })
        .prop_map(|(target, draft_choice, context, params, seeds)| Case {
            vocab: target.len() / (draft_choice.len() + 1),
            target,
            draft_choice,
            context,
            params,
            seeds,
        })
}

impl Case {
    /// Drafts: the reference argmax along the path where `draft_choice` is `None`.
    fn drafts(&self) -> Vec<u32> {
        let mut hist = self.context.clone();
        let mut drafts = Vec::new();
        for (i, c) in self.draft_choice.iter().enumerate() {
            let row = &self.target[i * self.vocab..(i + 1) * self.vocab];
            let d = match c {
                Some(t) => *t,
                None => first_argmax(&self.params.effective(row, &hist)).unwrap_or(0),
            };
            drafts.push(d);
            hist.push(d);
        }
        drafts
    }
}

fn check(out: &Result<StepOutput, Error>, want: &Expected) -> Result<(), TestCaseError> {
    match (out, want) {
        (Ok(o), Expected::Ok { tokens, end }) => {
            prop_assert_eq!(&o.tokens, tokens);
            prop_assert_eq!(o.accepted, tokens.len() - 1);
            prop_assert_eq!(&o.end, end);
        }
        (
            Err(Error::NoAllowedToken {
                kind: RowKind::Target,
                row,
            }),
            Expected::NoAllowed { row: r },
        ) => {
            prop_assert_eq!(row, r);
        }
        (got, want) => {
            return Err(TestCaseError::fail(format!("got {got:?}, want {want:?}")));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn greedy_matches_first_index_of_max(c in case()) {
        let cfg = c.params.config();
        let drafts = c.drafts();
        let want = reference(&c.params, &c.target, c.vocab, &drafts, &c.context);
        let mut v = Verifier::new();
        let mut outs = Vec::new();
        // Any seed, any position, any draft-probability representation: same result.
        let q = vec![1.0f32 / c.vocab as f32; drafts.len() * c.vocab];
        for (seed, probs) in [
            (c.seeds.0, DraftProbs::PointMass),
            (c.seeds.1, DraftProbs::Probs { probs: &q, vocab: c.vocab }),
        ] {
            let req = VerifyRequest::new(&cfg, &c.target, c.vocab, &drafts)
                .draft_probs(probs)
                .context(&c.context)
                .seed(seed)
                .position(seed % 4096);
            let out = v.verify(&req);
            check(&out, &want)?;
            outs.push(out);
        }
        if let (Ok(a), Ok(b)) = (&outs[0], &outs[1]) {
            prop_assert_eq!(a, b);
        }
        // Log-probabilities: under the softmax at temperature 1 of the processed logits.
        if let (Ok(o), Some(n)) = (&outs[0], c.params.logprobs) {
            let lps = o.logprobs.as_ref().expect("logprobs were requested");
            prop_assert_eq!(lps.len(), o.tokens.len());
            let mut hist = c.context.clone();
            for (i, lp) in lps.iter().enumerate() {
                let e = c.params.effective(&c.target[i * c.vocab..(i + 1) * c.vocab], &hist);
                let (want_lp, want_top) = reference_logprobs(&e, o.tokens[i], n);
                prop_assert_eq!(lp.token, o.tokens[i]);
                let tol = 1e-4 * (1.0 + want_lp.abs());
                let err = (lp.logprob as f64 - want_lp).abs();
                prop_assert!(err <= tol, "{} vs {}", lp.logprob, want_lp);
                prop_assert_eq!(
                    lp.top.iter().map(|x| x.0).collect::<Vec<_>>(),
                    want_top.iter().map(|x| x.0).collect::<Vec<_>>()
                );
                for (&(_, a), &(_, b)) in lp.top.iter().zip(&want_top) {
                    prop_assert!((a as f64 - b).abs() <= 1e-4 * (1.0 + b.abs()), "{} vs {}", a, b);
                }
                hist.push(o.tokens[i]);
            }
        } else if let Ok(o) = &outs[0] {
            prop_assert!(o.logprobs.is_none());
        }
    }

    /// Long rows (the argmax scan works in chunks of 16 lanes): ties everywhere, the first
    /// index of the maximum wins.
    #[test]
    fn long_rows_with_ties(row in (1usize..3000).prop_flat_map(|n| vec(prop_oneof![
        8 => prop::sample::select(vec![-1.0f32, 0.0, -0.0, 1.0, 2.0]),
        1 => Just(f32::NEG_INFINITY),
        1 => -3.0f32..2.0,
    ], n))) {
        let vocab = row.len();
        let cfg = SamplingConfig::greedy();
        let out = Verifier::new().verify(&VerifyRequest::new(&cfg, &row, vocab, &[]));
        match first_argmax(&row) {
            Some(t) => prop_assert_eq!(out.unwrap().tokens, vec![t]),
            None => {
                let no_allowed = matches!(out, Err(Error::NoAllowedToken { .. }));
                prop_assert!(no_allowed, "{:?}", out);
            }
        }
    }

    /// Long rows with NaN / +inf anywhere, huge finite values whose sum overflows, and `-inf`:
    /// the argmax scan reports the first NaN / +inf, and never a false one.
    #[test]
    fn long_rows_non_finite_screen(
        row in (1usize..3000).prop_flat_map(|n| vec(prop_oneof![
            6 => -3.0f32..3.0,
            2 => prop::sample::select(vec![3.0e38f32, -3.0e38, f32::NEG_INFINITY]),
        ], n)),
        bad in vec((0usize..3000, non_finite()), 0..3),
    ) {
        let mut row = row;
        let vocab = row.len();
        for (i, v) in bad {
            row[i % vocab] = v;
        }
        let cfg = SamplingConfig::greedy();
        let out = Verifier::new().verify(&VerifyRequest::new(&cfg, &row, vocab, &[]));
        match row.iter().position(|v| v.is_nan() || *v == f32::INFINITY) {
            Some(t) => {
                let ok = matches!(out, Err(Error::NonFiniteLogits { token, .. }) if token == t);
                prop_assert!(ok, "want NonFiniteLogits at {}, got {:?}", t, out);
            }
            None => match first_argmax(&row) {
                Some(t) => prop_assert_eq!(out.unwrap().tokens, vec![t]),
                None => {
                    let no_allowed = matches!(out, Err(Error::NoAllowedToken { .. }));
                    prop_assert!(no_allowed, "{:?}", out);
                }
            },
        }
    }

    /// A NaN or +inf at an unmasked token of row j is reported exactly when row j is read.
    #[test]
    fn greedy_reports_non_finite_rows_anywhere(
        c in case(),
        j in 0usize..9,
        tok in 0usize..64,
        inf in any::<bool>(),
    ) {
        // Case C14: a NaN / +inf in any target row is an error, whether or not the step would
        // read that row (validation never depends on where the drafts are rejected).
        let cfg = c.params.config();
        let drafts = c.drafts();
        let j = j.min(drafts.len());
        let tok = tok % c.vocab;
        let mut target = c.target.clone();
        target[j * c.vocab + tok] = if inf { f32::INFINITY } else { f32::NAN };
        let out = Verifier::new().verify(
            &VerifyRequest::new(&cfg, &target, c.vocab, &drafts).context(&c.context),
        );
        let (row, first_bad) = target
            .iter()
            .position(|x| x.is_nan() || *x == f32::INFINITY)
            .map(|i| (i / c.vocab, i % c.vocab))
            .unwrap();
        match out {
            Err(Error::NonFiniteLogits { kind: RowKind::Target, row: r, token, .. }) => {
                prop_assert_eq!(r, row);
                prop_assert_eq!(token, first_bad);
            }
            other => {
                let msg = format!("want NonFiniteLogits, got {other:?}");
                return Err(TestCaseError::fail(msg));
            }
        }
    }
}

/// Whole batches of random greedy sequences (ragged drafts, mixed penalties) through
/// `verify_batch` agree with the reference sequence by sequence.
#[test]
fn greedy_batches_match_reference() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    for _ in 0..200 {
        let n = 1 + runner.rng().random_range(0..12usize);
        let vocab = 1 + runner.rng().random_range(0..48usize);
        let mut cases = Vec::new();
        for _ in 0..n {
            let mut c = case().new_tree(&mut runner).unwrap().current();
            // Re-shape to the batch's vocabulary.
            let k = c.draft_choice.len();
            c.target = (0..(k + 1) * vocab)
                .map(|i| c.target.get(i).copied().unwrap_or(1.0))
                .collect();
            c.vocab = vocab;
            c.context.iter_mut().for_each(|t| *t %= vocab as u32);
            c.draft_choice
                .iter_mut()
                .flatten()
                .for_each(|t| *t %= vocab as u32);
            let p = &mut c.params;
            p.bias.iter_mut().for_each(|(t, _)| *t %= vocab as u32);
            p.banned.iter_mut().for_each(|t| *t %= vocab as u32);
            if let Some(a) = p.allowed.as_mut() {
                a.iter_mut().for_each(|t| *t %= vocab as u32);
            }
            cases.push(c);
        }
        let configs: Vec<SamplingConfig> = cases.iter().map(|c| c.params.config()).collect();
        let drafts: Vec<Vec<u32>> = cases.iter().map(|c| c.drafts()).collect();
        let mut offsets = vec![0usize];
        for d in &drafts {
            offsets.push(offsets.last().unwrap() + d.len());
        }
        let flat_drafts: Vec<u32> = drafts.concat();
        let target: Vec<f32> = cases
            .iter()
            .flat_map(|c| c.target.iter().copied())
            .collect();
        let seqs: Vec<SequenceParams<'_>> = cases
            .iter()
            .zip(&configs)
            .map(|(c, cfg)| SequenceParams::new(cfg, c.seeds.0).context(&c.context))
            .collect();
        let out = Verifier::new()
            .verify_batch(&VerifyBatch::new(
                vocab,
                &target,
                &flat_drafts,
                &offsets,
                &seqs,
            ))
            .unwrap();
        assert_eq!(out.len(), n);
        for ((c, d), o) in cases.iter().zip(&drafts).zip(&out) {
            let want = reference(&c.params, &c.target, vocab, d, &c.context);
            check(o, &want).unwrap();
        }
    }
}
