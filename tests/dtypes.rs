//! Logits in the caller's dtype and as `ndarray` views: the same outcome as the `f32` slice path.
//!
//! `f16` and `bf16` convert to `f32` exactly, so verifying rows held in those dtypes must give
//! exactly (tokens, accepted count, end, log-probabilities bit for bit, errors) what verifying
//! the same values converted to `f32` first gives. The reference conversion here is `half`'s own
//! (`to_f32`), independent of the crate's `Logit::widen`.
//!
//! 1. The closed-form suite's random steps (`common::steps`, shared with `tests/closed_form.rs`):
//!    random vocabularies, logits with `-inf`, ties and huge magnitudes, random configurations
//!    (greedy included), point-mass / probabilities / draft-logit drafts, padded draft
//!    vocabularies; target and q each in f32, f16 and bf16 (mixed too), as slices and as
//!    `ndarray` views, single requests and batches.
//! 2. The chi-square suite's inputs (`tests/statistical.rs`: its toy Markov targets and drafts,
//!    its configurations and seeds): every step of seeded generations, in every dtype.
//! 3. `ndarray` views that are not in standard layout are refused with `Error::NonContiguous`;
//!    `as_standard_layout()` of them verifies like the slice.
//! 4. A batch mixing per-sequence draft forms gives each sequence the outcome of verifying it
//!    alone; the GPU packer's rule for such batches is tested in `tests/gpu.rs`.

mod common;

use common::steps::{QMode, StepCase, draw_drafts, step_case, step_case_in};
use common::{dense, min_p_config, nucleus_config, penalty_config, process};
use half::{bf16, f16};
use ndarray::{Array2, ArrayView2, s};
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use speculative::rng::{Stream, lane};
use speculative::sampling::Logit;
use speculative::test_util::ToyModel;
use speculative::{
    DraftProbs, DraftQ, Error, Result, SamplingConfig, SequenceParams, StepOutput, TokenDist,
    Verifier, VerifyBatch, VerifyRequest,
};

/// A dtype the tests round `f32` values into, with `half`'s own conversion back to `f32` as the
/// reference.
trait Dtype: Logit {
    fn quantize(x: f32) -> Self;
    fn reference(self) -> f32;
}

impl Dtype for f32 {
    fn quantize(x: f32) -> Self {
        x
    }
    fn reference(self) -> f32 {
        self
    }
}

impl Dtype for f16 {
    fn quantize(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn reference(self) -> f32 {
        self.to_f32()
    }
}

impl Dtype for bf16 {
    fn quantize(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn reference(self) -> f32 {
        self.to_f32()
    }
}

fn round<D: Dtype>(v: &[f32]) -> Vec<D> {
    v.iter().map(|&x| D::quantize(x)).collect()
}

fn reference<D: Dtype>(v: &[D]) -> Vec<f32> {
    v.iter().map(|&x| x.reference()).collect()
}

/// The outcome as text: `Debug` of `f32` is its shortest round-trip form, so equal text means
/// bit-identical log-probabilities (and equal tokens, counts, ends and errors).
fn canon(r: &Result<StepOutput>) -> String {
    format!("{r:?}")
}

/// Draft form of a case over rows in dtype `Q` (`q_rows`: dense q for `Probs`, else the case's
/// draft logits, already in `Q`).
fn form<'a, Q: Logit>(mode: QMode, rows: &'a [Q], qv: usize) -> DraftQ<'a, Q> {
    match mode {
        QMode::PointMass => DraftQ::PointMass,
        QMode::Probs => DraftQ::Probs {
            probs: rows,
            vocab: qv,
        },
        QMode::Logits => DraftQ::Logits {
            logits: rows,
            vocab: qv,
        },
    }
}

/// Counters that keep the comparisons from being vacuous: how many compared outcomes were a
/// step (not an error), per draft form.
#[derive(Debug, Default)]
struct Coverage {
    ok: [usize; 3],
    total: [usize; 3],
}

impl Coverage {
    fn add(&mut self, mode: QMode, r: &Result<StepOutput>) {
        let i = mode as usize;
        self.total[i] += 1;
        self.ok[i] += r.is_ok() as usize;
    }
}

/// One closed-form case with target rows in `L` and q rows in `Q`: slice path, `ndarray` path
/// and a batch, each against the reference (the same values converted to `f32` by `half`).
fn check_case<L: Dtype, Q: Dtype>(
    c: &StepCase,
    cfg: &SamplingConfig,
    drafts: &[u32],
    q_f32: &[f32],
    cov: &mut Coverage,
) -> std::result::Result<(), TestCaseError> {
    let target: Vec<L> = round(&c.target);
    let q_src = match c.mode {
        QMode::Probs => q_f32,
        _ => &c.draft_logits[..],
    };
    let q: Vec<Q> = round(q_src);
    let (target_ref, q_ref) = (reference(&target), reference(&q));
    let mut v = Verifier::new();
    let base = |t: &[f32], qr: &[f32]| {
        Verifier::new().verify(
            &VerifyRequest::new(cfg, t, c.vocab, drafts)
                .draft_probs(form(c.mode, qr, c.qv))
                .context(&c.params.context)
                .seed(c.seed),
        )
    };
    let want = canon(&base(&target_ref, &q_ref));
    // Slices in the caller's dtypes.
    let got = v.verify(
        &VerifyRequest::new(cfg, &target, c.vocab, drafts)
            .draft_probs(form(c.mode, &q, c.qv))
            .context(&c.params.context)
            .seed(c.seed),
    );
    cov.add(c.mode, &got);
    proptest::prop_assert_eq!(&canon(&got), &want, "slices {}/{}", L::NAME, Q::NAME);
    // ndarray views in the caller's dtypes.
    let tv = ArrayView2::from_shape((c.k + 1, c.vocab), &target[..]).unwrap();
    let qv = ArrayView2::from_shape((c.k, c.qv), &q[..]).unwrap();
    let q_form = match c.mode {
        QMode::PointMass => DraftQ::PointMass,
        QMode::Probs => DraftQ::probs_array(qv).unwrap(),
        QMode::Logits => DraftQ::logits_array(qv).unwrap(),
    };
    let got = v.verify(
        &VerifyRequest::from_array(cfg, tv, drafts)
            .unwrap()
            .draft_probs(q_form)
            .context(&c.params.context)
            .seed(c.seed),
    );
    proptest::prop_assert_eq!(&canon(&got), &want, "ndarray {}/{}", L::NAME, Q::NAME);
    // A batch of three sequences: the case, the case with one draft fewer (its own rows), and
    // the case with another seed. Each must equal its own reference.
    let k1 = c.k.saturating_sub(1);
    let offsets = [0, c.k, c.k + k1, 2 * c.k + k1];
    let mut tokens = drafts.to_vec();
    tokens.extend_from_slice(&drafts[..k1]);
    tokens.extend_from_slice(drafts);
    let rows =
        |r: std::ops::Range<usize>, w: usize, src: &[L]| src[r.start * w..r.end * w].to_vec();
    let mut batch_target = target.clone();
    batch_target.extend(rows(0..k1 + 1, c.vocab, &target));
    batch_target.extend_from_slice(&target);
    let mut batch_q = q.clone();
    if c.mode != QMode::PointMass {
        batch_q.extend_from_slice(&q[..k1 * c.qv]);
        batch_q.extend_from_slice(&q);
    }
    let seeds = [c.seed, c.seed, c.seed ^ 0xABCD];
    let seqs: Vec<SequenceParams<'_, Q>> = seeds
        .iter()
        .map(|&s| SequenceParams::new(cfg, s).context(&c.params.context))
        .collect();
    let batch = VerifyBatch::with_q(
        c.vocab,
        &batch_target[..],
        &tokens,
        &offsets,
        form(c.mode, &batch_q, c.qv),
        &seqs,
    );
    let out = v.verify_batch(&batch).unwrap();
    for (b, r) in out.iter().enumerate() {
        let (lo, hi) = (offsets[b], offsets[b + 1]);
        let kb = hi - lo;
        let t_ref = reference(&batch_target[(lo + b) * c.vocab..(hi + b + 1) * c.vocab]);
        let q_ref = if c.mode == QMode::PointMass {
            Vec::new()
        } else {
            reference(&batch_q[lo * c.qv..hi * c.qv])
        };
        let want = Verifier::new().verify(
            &VerifyRequest::new(cfg, &t_ref, c.vocab, &tokens[lo..hi])
                .draft_probs(form(c.mode, &q_ref, c.qv))
                .context(&c.params.context)
                .seed(seeds[b]),
        );
        proptest::prop_assert_eq!(
            canon(r),
            canon(&want),
            "batch {}/{} sequence {} (k {})",
            L::NAME,
            Q::NAME,
            b,
            kb
        );
    }
    Ok(())
}

/// Part 1: the closed-form suite's random steps, every dtype pair that matters (same dtype for
/// target and q, and a `bf16` / `f16` target with `f32` q, the case of a half-precision engine
/// with this crate's draft-model proposer).
#[test]
fn closed_form_inputs_give_identical_outcomes_in_every_dtype() {
    let mut runner = TestRunner::new(Config {
        cases: 600,
        failure_persistence: None,
        ..Config::default()
    });
    let mut cov = Coverage::default();
    let cov_ref = std::cell::RefCell::new(&mut cov);
    runner
        .run(&step_case(), |c| {
            let cfg = c.params.config().to_builder().logprobs(3).build().unwrap();
            let (drafts, q) = draw_drafts(&c, &cfg);
            let mut cov = cov_ref.borrow_mut();
            check_case::<f32, f32>(&c, &cfg, &drafts, &q, &mut cov)?;
            check_case::<f16, f16>(&c, &cfg, &drafts, &q, &mut cov)?;
            check_case::<bf16, bf16>(&c, &cfg, &drafts, &q, &mut cov)?;
            check_case::<bf16, f32>(&c, &cfg, &drafts, &q, &mut cov)?;
            check_case::<f16, f32>(&c, &cfg, &drafts, &q, &mut cov)?;
            // The same logits scaled into the binary16 subnormal range (|x| < 6.1e-5).
            let mut tiny = c.clone();
            for x in tiny.target.iter_mut().chain(tiny.draft_logits.iter_mut()) {
                *x *= 2f32.powi(-18);
            }
            let (drafts, q) = draw_drafts(&tiny, &cfg);
            check_case::<f16, f16>(&tiny, &cfg, &drafts, &q, &mut Coverage::default())?;
            Ok(())
        })
        .unwrap();
    // Most compared outcomes must be steps, not errors (rounding q to a half type can break its
    // normalisation, which is an error on both paths, but not in most cases).
    for m in [QMode::PointMass, QMode::Probs, QMode::Logits] {
        let i = m as usize;
        assert!(
            cov.total[i] > 200 && cov.ok[i] * 2 > cov.total[i],
            "{m:?}: {} of {} outcomes were steps",
            cov.ok[i],
            cov.total[i]
        );
    }
    eprintln!("coverage (steps / compared): {cov:?}");
}

/// Part 1 on long rows (vocabularies 200..3000: several blocks of 256 values, full and partial,
/// which the scans read through a buffer for half types), fewer cases.
#[test]
fn long_rows_give_identical_outcomes_in_every_dtype() {
    let mut runner = TestRunner::new(Config {
        cases: 60,
        failure_persistence: None,
        ..Config::default()
    });
    let mut cov = Coverage::default();
    let cov_ref = std::cell::RefCell::new(&mut cov);
    runner
        .run(&step_case_in(200..=3000, 3), |c| {
            let cfg = c.params.config().to_builder().logprobs(4).build().unwrap();
            let (drafts, q) = draw_drafts(&c, &cfg);
            let mut cov = cov_ref.borrow_mut();
            check_case::<f16, f16>(&c, &cfg, &drafts, &q, &mut cov)?;
            check_case::<bf16, bf16>(&c, &cfg, &drafts, &q, &mut cov)?;
            check_case::<bf16, f32>(&c, &cfg, &drafts, &q, &mut cov)?;
            Ok(())
        })
        .unwrap();
    let (ok, total): (usize, usize) = (cov.ok.iter().sum(), cov.total.iter().sum());
    assert!(total >= 180 && ok * 2 > total, "{ok} of {total}");
}

/// Part 2: the chi-square suite's inputs. For each of its setups (vocabulary, configuration,
/// seed of the toy models), seeded generations of 3 tokens with draft lengths 1..=4 and each
/// draft form run through the `f32` verifier; at every step, the same step in `f16` and `bf16`
/// (target and q) must equal the reference on the rounded values.
#[test]
fn chi_square_inputs_give_identical_outcomes_in_every_dtype() {
    let greedy = SamplingConfig::builder().logprobs(2).build().unwrap();
    let setups: [(usize, SamplingConfig, u64); 6] = [
        (5, SamplingConfig::sampling(1.0).unwrap(), 11),
        (6, nucleus_config(), 23),
        (5, min_p_config(), 37),
        (4, penalty_config(), 41),
        (5, nucleus_config(), 53),
        (5, greedy, 53),
    ];
    let mut steps = 0usize;
    let mut ok = 0usize;
    for (vocab, config, model_seed) in setups {
        let target = ToyModel::markov(vocab, 2, 1.3, model_seed);
        let draft = ToyModel::markov(vocab, 2, 1.3, model_seed ^ 0x5EED_D4AF);
        for mode in [QMode::Probs, QMode::Logits, QMode::PointMass] {
            for k in 1..=4usize {
                for seed in 0..25u64 {
                    let (s, o) = generation(&target, &draft, vocab, &config, mode, k, seed);
                    steps += s;
                    ok += o;
                }
            }
        }
    }
    assert!(steps > 1000 && ok * 10 > steps * 9, "{ok} of {steps} steps");
}

/// One generation of 3 tokens after the suite's prompt; returns (steps compared, steps that
/// were not errors).
fn generation(
    target: &ToyModel,
    draft: &ToyModel,
    v: usize,
    cfg: &SamplingConfig,
    mode: QMode,
    k: usize,
    seed: u64,
) -> (usize, usize) {
    const PROMPT: [u32; 4] = [1, 0, 2, 1];
    let draft_stream = Stream::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD12A_F7ED);
    let mut ctx = PROMPT.to_vec();
    let mut verifier = Verifier::new();
    let (mut steps, mut ok) = (0, 0);
    while ctx.len() < PROMPT.len() + 3 {
        let pos = ctx.len() as u64;
        let mut prefix = ctx.clone();
        let (mut drafts, mut q_rows, mut draft_logits) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..k {
            let dl = draft.logits(&prefix);
            let q = process(cfg, &dl, &prefix, v).unwrap();
            let x = match mode {
                QMode::PointMass => q.ids()[0],
                _ => q
                    .sample(draft_stream.uniform(pos + i as u64, lane::DRAFT))
                    .unwrap(),
            };
            q_rows.extend(dense(&q, v));
            draft_logits.extend_from_slice(&dl);
            drafts.push(x);
            prefix.push(x);
        }
        let mut target_logits = Vec::new();
        for i in 0..=k {
            let mut c = ctx.clone();
            c.extend_from_slice(&drafts[..i]);
            target_logits.extend(target.logits(&c));
        }
        let q_src: &[f32] = if mode == QMode::Probs {
            &q_rows
        } else {
            &draft_logits
        };
        let run = |verifier: &mut Verifier| {
            verifier.verify(
                &VerifyRequest::new(cfg, &target_logits, v, &drafts)
                    .draft_probs(form(mode, q_src, v))
                    .context(&ctx)
                    .seed(seed),
            )
        };
        let out = run(&mut verifier).unwrap();
        for (name, got, want) in [
            step_in::<f16>(cfg, &target_logits, q_src, mode, v, &drafts, &ctx, seed),
            step_in::<bf16>(cfg, &target_logits, q_src, mode, v, &drafts, &ctx, seed),
        ] {
            assert_eq!(got, want, "{name} k={k} seed={seed} ctx={ctx:?}");
            steps += 1;
            ok += !got.starts_with("Err") as usize;
        }
        ctx.extend_from_slice(&out.tokens);
    }
    (steps, ok)
}

/// One step with target and q rounded to `D`: (dtype, outcome in `D`, reference outcome).
#[allow(clippy::too_many_arguments)]
fn step_in<D: Dtype>(
    cfg: &SamplingConfig,
    target: &[f32],
    q: &[f32],
    mode: QMode,
    v: usize,
    drafts: &[u32],
    ctx: &[u32],
    seed: u64,
) -> (&'static str, String, String) {
    let (t, qd): (Vec<D>, Vec<D>) = (round(target), round(q));
    let (t_ref, q_ref) = (reference(&t), reference(&qd));
    let got = Verifier::new().verify(
        &VerifyRequest::new(cfg, &t, v, drafts)
            .draft_probs(form(mode, &qd, v))
            .context(ctx)
            .seed(seed),
    );
    let want = Verifier::new().verify(
        &VerifyRequest::new(cfg, &t_ref, v, drafts)
            .draft_probs(form(mode, &q_ref, v))
            .context(ctx)
            .seed(seed),
    );
    (D::NAME, canon(&got), canon(&want))
}

/// Part 3: views with other strides are refused with a typed error naming the input, and their
/// standard-layout copies verify like slices.
#[test]
fn non_contiguous_views_are_refused_with_a_typed_error() {
    let (vocab, k) = (6usize, 2usize);
    let cfg = SamplingConfig::sampling(0.9).unwrap();
    let logits: Vec<f32> = (0..(k + 1) * vocab)
        .map(|i| ((i * 7919) % 13) as f32 * 0.3 - 1.5)
        .collect();
    let drafts = [1u32, 4];
    let want =
        canon(&Verifier::new().verify(&VerifyRequest::new(&cfg, &logits, vocab, &drafts).seed(5)));
    // The transpose of a [vocab, k + 1] array has the right shape but column-major strides.
    let cm = Array2::from_shape_fn((vocab, k + 1), |(t, r)| logits[r * vocab + t]);
    // Every other row of a [2 (k + 1), vocab] array: a step between rows.
    let wide = Array2::from_shape_fn((2 * (k + 1), vocab), |(r, t)| {
        if r % 2 == 0 {
            logits[(r / 2) * vocab + t]
        } else {
            f32::NAN
        }
    });
    // The first `vocab` columns of a [k + 1, vocab + 3] array: rows padded on the right.
    let padded = Array2::from_shape_fn((k + 1, vocab + 3), |(r, t)| {
        if t < vocab {
            logits[r * vocab + t]
        } else {
            0.0
        }
    });
    let views = [
        ("transposed", cm.t()),
        ("row step", wide.slice(s![..;2, ..])),
        ("column slice", padded.slice(s![.., ..vocab])),
    ];
    let seqs = [SequenceParams::new(&cfg, 5)];
    for (name, view) in views {
        assert_eq!(view.dim(), (k + 1, vocab), "{name}");
        let e = VerifyRequest::from_array(&cfg, view, &drafts);
        assert!(
            matches!(
                e,
                Err(Error::NonContiguous {
                    what: "target_logits"
                })
            ),
            "{name}: {e:?}"
        );
        let e = DraftQ::probs_array(view);
        assert!(
            matches!(
                e,
                Err(Error::NonContiguous {
                    what: "draft probabilities"
                })
            ),
            "{name}: {e:?}"
        );
        assert!(matches!(
            DraftQ::logits_array(view),
            Err(Error::NonContiguous {
                what: "draft logits"
            })
        ));
        assert!(matches!(
            VerifyBatch::from_array(view, &drafts, &[0, 2], DraftProbs::PointMass, &seqs),
            Err(Error::NonContiguous {
                what: "target_logits"
            })
        ));
        // The documented remedy.
        let copy = view.as_standard_layout();
        let got = Verifier::new().verify(
            &VerifyRequest::from_array(&cfg, copy.view(), &drafts)
                .unwrap()
                .seed(5),
        );
        assert_eq!(canon(&got), want, "{name}");
    }
    // A contiguous view is read in place: no copy is made.
    let a = Array2::from_shape_vec((k + 1, vocab), logits.clone()).unwrap();
    let req = VerifyRequest::from_array(&cfg, a.view(), &drafts).unwrap();
    assert_eq!(req.target_logits.as_ptr(), a.as_ptr());
    assert_eq!(req.vocab_size, vocab);
}

/// The dense-q helper writes the distribution the test suites build by hand.
#[test]
fn token_dist_dense_rows_match_the_support() {
    let cfg = nucleus_config();
    let d: TokenDist = process(&cfg, &[0.3, -1.0, 2.0, 0.9, 0.0, 1.1], &[], 6).unwrap();
    assert_eq!(d.to_dense(), dense(&d, 6));
    let mut q = [7.0f32; 2 * 8];
    for row in q.chunks_exact_mut(8) {
        d.write_dense(row).unwrap();
    }
    assert_eq!(&q[8..14], &dense(&d, 6)[..]);
    assert_eq!(&q[14..], &[0.0, 0.0]);
    assert!(matches!(
        d.write_dense(&mut [0.0; 5]),
        Err(Error::ShapeMismatch { .. })
    ));
}

/// Part 4: one batch mixing per-sequence draft forms (its own point masses, its own
/// probabilities of a narrower draft vocabulary, its own draft logits, the batch-level
/// probabilities, and a malformed own form) gives every sequence the outcome of verifying it
/// alone; the malformed one fails alone. In `f32` and with `f16` q rows.
#[test]
fn mixed_per_sequence_draft_forms_equal_verifying_each_alone() {
    mixed_forms::<f32>();
    mixed_forms::<f16>();
    mixed_forms::<bf16>();
}

/// `q` rounded to multiples of `1/256` that sum to exactly 1, with `keep` (the drafted token)
/// at least `1/256`: exact in `f16` and `bf16` too, so the rows stay valid distributions in
/// every dtype (a `bf16` row of arbitrary probabilities can miss the 1e-3 sum tolerance).
fn dyadic(q: &[f32], keep: usize) -> Vec<f32> {
    let mut m: Vec<i32> = q.iter().map(|&p| (p * 256.0).round() as i32).collect();
    m[keep] = m[keep].max(1);
    let top = (0..m.len()).max_by_key(|&i| m[i]).unwrap();
    m[top] += 256 - m.iter().sum::<i32>();
    m.iter().map(|&x| x as f32 / 256.0).collect()
}

fn mixed_forms<Q: Dtype>() {
    let vocab = 7usize;
    let cfg = SamplingConfig::builder()
        .temperature(0.8)
        .top_p(0.95)
        .logprobs(2)
        .build()
        .unwrap();
    let greedy = SamplingConfig::greedy();
    let model = ToyModel::markov(vocab, 2, 1.3, 99);
    let draft_model = ToyModel::markov(vocab, 2, 1.3, 7);
    // Sequence b: context, k, and the form it brings.
    let ks = [3usize, 2, 3, 2, 1, 2];
    let mut target = Vec::new();
    let mut tokens = Vec::new();
    let mut offsets = vec![0usize];
    let mut contexts: Vec<Vec<u32>> = Vec::new();
    let mut own_q: Vec<Vec<Q>> = Vec::new();
    let mut batch_q: Vec<Q> = Vec::new();
    let narrow = 5usize;
    for (b, &k) in ks.iter().enumerate() {
        let ctx: Vec<u32> = (0..4 + b as u32).map(|i| (i * 3 + b as u32) % 5).collect();
        let mut prefix = ctx.clone();
        let mut q_rows: Vec<f32> = Vec::new();
        let mut logit_rows: Vec<f32> = Vec::new();
        let qv = if b == 1 { narrow } else { vocab };
        for i in 0..k {
            let dl = &draft_model.logits(&prefix)[..qv];
            let q = process(&cfg, dl, &prefix, qv).unwrap();
            let x = q
                .sample(Stream::new(b as u64).uniform(i as u64, lane::DRAFT))
                .unwrap();
            q_rows.extend(dyadic(&q.to_dense(), x as usize));
            logit_rows.extend_from_slice(dl);
            tokens.push(x);
            prefix.push(x);
        }
        for i in 0..=k {
            target.extend(model.logits(&prefix[..ctx.len() + i]));
        }
        // Batch-level rows (vocab wide) for every sequence; only sequence 3 reads them. The
        // others get one-hot rows that give their draft probability 0: read by mistake, they
        // would make the sequence fail with `InvalidDraftProbs`.
        let start = tokens.len() - k;
        for i in 0..k {
            let mut row = vec![0.0f32; vocab];
            if b == 3 {
                row[..qv].copy_from_slice(&q_rows[i * qv..(i + 1) * qv]);
            } else {
                row[(tokens[start + i] as usize + 1) % vocab] = 1.0;
            }
            batch_q.extend(round::<Q>(&row));
        }
        own_q.push(match b {
            2 => round(&logit_rows),
            _ => round(&q_rows),
        });
        offsets.push(tokens.len());
        contexts.push(ctx);
    }
    let forms: Vec<Option<DraftQ<'_, Q>>> = vec![
        Some(DraftQ::PointMass),
        Some(DraftQ::Probs {
            probs: &own_q[1],
            vocab: narrow,
        }),
        Some(DraftQ::Logits {
            logits: &own_q[2],
            vocab,
        }),
        None,
        // Malformed: one row short.
        Some(DraftQ::Probs {
            probs: &own_q[4][..0],
            vocab,
        }),
        Some(DraftQ::PointMass),
    ];
    let seqs: Vec<SequenceParams<'_, Q>> = forms
        .iter()
        .enumerate()
        .map(|(b, f)| {
            let c = if b == 5 { &greedy } else { &cfg };
            let s = SequenceParams::new(c, 1000 + b as u64).context(&contexts[b]);
            match f {
                Some(q) => s.draft_probs(*q),
                None => s,
            }
        })
        .collect();
    let batch = VerifyBatch::with_q(
        vocab,
        &target[..],
        &tokens,
        &offsets,
        DraftQ::Probs {
            probs: &batch_q,
            vocab,
        },
        &seqs,
    );
    let out = Verifier::new().verify_batch(&batch).unwrap();
    for (b, r) in out.iter().enumerate() {
        let (lo, hi) = (offsets[b], offsets[b + 1]);
        // What the sequence is alone: its own form, or its rows of the batch-level one.
        let q = forms[b].unwrap_or(DraftQ::Probs {
            probs: &batch_q[lo * vocab..hi * vocab],
            vocab,
        });
        let alone = Verifier::new().verify(
            &VerifyRequest::new(
                seqs[b].state.config,
                &target[(lo + b) * vocab..(hi + b + 1) * vocab],
                vocab,
                &tokens[lo..hi],
            )
            .draft_probs(q)
            .context(&contexts[b])
            .seed(1000 + b as u64),
        );
        assert_eq!(canon(r), canon(&alone), "{} sequence {b}", Q::NAME);
        // Only the malformed sequence fails (shape of its own q); a sequence that read the
        // batch-level rows instead of its own form would fail too.
        match (b, r) {
            (4, Err(Error::ShapeMismatch { .. })) => {}
            (4, r) => panic!("{} sequence 4: {r:?}", Q::NAME),
            (_, r) => assert!(r.is_ok(), "{} sequence {b}: {r:?}", Q::NAME),
        }
    }
}
