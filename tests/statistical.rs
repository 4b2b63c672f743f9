//! Statistical proofs of losslessness: full seeded generations through the real [`Verifier`].
//!
//! **Method.** A toy target (a random order-2 Markov model over 4-6 tokens) and a different toy
//! draft model are processed with the same sampling configuration. A small driver written here
//! plays the engine: the draft samples `k` tokens from its processed distribution (uniforms from
//! [`rng::Stream`] on the `DRAFT` lane of a seed unrelated to the verifier's), the target logits
//! of the block are computed, the verifier accepts a prefix and emits a correction or bonus, and
//! the loop repeats until 3 tokens are emitted. Each generation uses its own seed. The empirical
//! joint distribution of the first 3 emitted tokens is compared with the exact target
//! distribution (the product of the processed target conditionals, computed by enumeration) by
//! Pearson's chi-square test (`common::chi_square`): cells with expected count < 5 are pooled,
//! and any observation of a probability-0 sequence gives p-value 0.
//!
//! **Significance.** `ALPHA = 1e-3`: a positive test fails when its p-value is below `ALPHA`;
//! a negative control passes only when its p-value is below `ALPHA`. All seeds are fixed, so the
//! outcome is deterministic; the positive p-values observed were far above `ALPHA` and the
//! negative ones far below it (see the `p = ...` lines printed with `--nocapture`).
//!
//! **Negative controls** (each must be rejected by the same test):
//! (a) the verifier is handed the raw softmax of the draft logits instead of the processed q the
//!     draft really sampled from;
//! (b) the verifier processes the target with a configuration that lacks the top-k / top-p /
//!     min-p / penalty the expected distribution has;
//! (c) an always-accept verifier written here (accepts every draft, then samples the bonus).

mod common;

use common::{
    Fit, chi_square, dense, min_p_config, nucleus_config, penalty_config, process, raw_softmax,
};
use speculative::rng::{Stream, lane};
use speculative::test_util::ToyModel;
use speculative::verify::DraftRow;
use speculative::verify::exact::first_token_given_draft;
use speculative::{DraftProbs, SamplingConfig, StepOutput, TokenDist, Verifier, VerifyRequest};

/// Significance level of every test in this file.
const ALPHA: f64 = 1e-3;
/// Number of emitted tokens whose joint distribution is tested.
const LEN: usize = 3;
/// The prompt of every generation.
const PROMPT: [u32; 4] = [1, 0, 2, 1];

/// How the draft chooses its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drafter {
    /// Samples from the draft model's processed distribution.
    Model,
    /// The draft model's argmax after processing (a deterministic proposer: point masses).
    Argmax,
    /// A uniformly random token (point masses).
    Random,
}

/// What the verifier is told about q.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QPass {
    /// The processed q the draft sampled from, as dense probabilities.
    Probs,
    /// The raw draft logits; the verifier processes them itself.
    Logits,
    /// Point masses (no q).
    PointMass,
    /// Fault (a): the raw softmax of the draft logits.
    RawSoftmax,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum VerifierKind {
    Real,
    /// Fault (c): accept every draft, then sample the bonus from processed row k.
    AlwaysAccept,
}

struct Setup {
    vocab: usize,
    target: ToyModel,
    draft: ToyModel,
    /// The configuration the draft samples with (and the expected distribution is defined by).
    config: SamplingConfig,
    /// The configuration the verifier is given (differs only for fault (b)).
    verify_config: SamplingConfig,
    drafter: Drafter,
    q_pass: QPass,
    kind: VerifierKind,
}

impl Setup {
    fn new(vocab: usize, config: SamplingConfig, seed: u64) -> Self {
        Setup {
            vocab,
            target: ToyModel::markov(vocab, 2, 1.3, seed),
            draft: ToyModel::markov(vocab, 2, 1.3, seed ^ 0x5EED_D4AF),
            verify_config: config.clone(),
            config,
            drafter: Drafter::Model,
            q_pass: QPass::Probs,
            kind: VerifierKind::Real,
        }
    }

    /// Exact probability of every sequence of `LEN` tokens after the prompt, index
    /// `t1 * vocab^2 + t2 * vocab + t3`.
    fn exact(&self) -> Vec<f64> {
        let v = self.vocab;
        let mut out = vec![1.0f64; v.pow(LEN as u32)];
        for (idx, o) in out.iter_mut().enumerate() {
            let mut prefix = PROMPT.to_vec();
            let mut rest = idx;
            let mut digits = [0u32; LEN];
            for d in digits.iter_mut().rev() {
                *d = (rest % v) as u32;
                rest /= v;
            }
            for &t in &digits {
                let p = process(&self.config, &self.target.logits(&prefix), &prefix, v).unwrap();
                *o *= p.prob(t) as f64;
                prefix.push(t);
            }
        }
        out
    }

    /// The first `LEN` tokens of one generation with draft length `k` and seed `seed`.
    fn generate(&self, k: usize, seed: u64, verifier: &mut Verifier) -> [u32; LEN] {
        let v = self.vocab;
        let draft_stream = Stream::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD12A_F7ED);
        let mut ctx = PROMPT.to_vec();
        let mut target_logits = Vec::with_capacity((k + 1) * v);
        let mut q_rows: Vec<f32> = Vec::with_capacity(k * v);
        let mut draft_logits: Vec<f32> = Vec::with_capacity(k * v);
        let mut drafts: Vec<u32> = Vec::with_capacity(k);
        while ctx.len() < PROMPT.len() + LEN {
            let pos = ctx.len() as u64;
            drafts.clear();
            q_rows.clear();
            draft_logits.clear();
            let mut prefix = ctx.clone();
            for i in 0..k {
                let dl = self.draft.logits(&prefix);
                let q = process(&self.config, &dl, &prefix, v).unwrap();
                let x = match self.drafter {
                    Drafter::Model => q
                        .sample(draft_stream.uniform(pos + i as u64, lane::DRAFT))
                        .unwrap(),
                    Drafter::Argmax => argmax(&q),
                    Drafter::Random => draft_stream.bits(pos + i as u64, lane::DRAFT)[1] % v as u32,
                };
                match self.q_pass {
                    QPass::RawSoftmax => q_rows.extend(raw_softmax(&dl)),
                    _ => q_rows.extend(dense(&q, v)),
                }
                draft_logits.extend_from_slice(&dl);
                drafts.push(x);
                prefix.push(x);
            }
            target_logits.clear();
            for i in 0..=k {
                target_logits.extend(self.target.logits(&ctx_with(&ctx, &drafts[..i])));
            }
            let out = match self.kind {
                VerifierKind::Real => {
                    let q = match self.q_pass {
                        QPass::Probs | QPass::RawSoftmax => DraftProbs::Probs {
                            probs: &q_rows,
                            vocab: v,
                        },
                        QPass::Logits => DraftProbs::Logits {
                            logits: &draft_logits,
                            vocab: v,
                        },
                        QPass::PointMass => DraftProbs::PointMass,
                    };
                    let req = VerifyRequest::new(&self.verify_config, &target_logits, v, &drafts)
                        .draft_probs(q)
                        .context(&ctx)
                        .seed(seed);
                    verifier.verify(&req).unwrap()
                }
                VerifierKind::AlwaysAccept => {
                    always_accept(&self.verify_config, &target_logits, v, &drafts, &ctx, seed)
                }
            };
            assert_eq!(out.tokens.len(), out.accepted + 1);
            ctx.extend_from_slice(&out.tokens);
        }
        let mut r = [0u32; LEN];
        r.copy_from_slice(&ctx[PROMPT.len()..PROMPT.len() + LEN]);
        r
    }

    /// Runs `n` generations (seeds `seed0..seed0 + n`) and tests them against the exact target.
    fn fit(&self, k: usize, n: u64, seed0: u64) -> Fit {
        let v = self.vocab;
        let mut counts = vec![0u64; v.pow(LEN as u32)];
        let mut verifier = Verifier::new();
        for s in seed0..seed0 + n {
            let t = self.generate(k, s, &mut verifier);
            counts[t.iter().fold(0usize, |a, &x| a * v + x as usize)] += 1;
        }
        chi_square(&counts, &self.exact())
    }
}

fn ctx_with(ctx: &[u32], drafts: &[u32]) -> Vec<u32> {
    let mut c = ctx.to_vec();
    c.extend_from_slice(drafts);
    c
}

fn argmax(d: &TokenDist) -> u32 {
    let mut best = (d.ids()[0], d.probs()[0]);
    for (&t, &p) in d.ids().iter().zip(d.probs()) {
        if p > best.1 {
            best = (t, p);
        }
    }
    best.0
}

/// Fault (c): accepts every draft and samples the bonus token from the processed row k.
fn always_accept(
    cfg: &SamplingConfig,
    logits: &[f32],
    vocab: usize,
    drafts: &[u32],
    ctx: &[u32],
    seed: u64,
) -> StepOutput {
    let k = drafts.len();
    let prefix = ctx_with(ctx, drafts);
    let p = process(cfg, &logits[k * vocab..], &prefix, vocab).unwrap();
    let u = Stream::new(seed).uniform(prefix.len() as u64, lane::SAMPLE);
    let mut tokens = drafts.to_vec();
    tokens.push(p.sample(u).unwrap());
    StepOutput::new(k, tokens, speculative::StepEnd::AllAccepted)
}

fn expect_pass(name: &str, f: Fit) {
    println!(
        "{name}: p = {:.3e} (chi2 = {:.1}, df = {})",
        f.p_value, f.stat, f.df
    );
    assert!(
        f.p_value >= ALPHA,
        "{name}: the real verifier was rejected: {f:?}"
    );
}

fn expect_reject(name: &str, f: Fit) {
    println!(
        "{name} (negative control): p = {:.3e} (chi2 = {:.1}, df = {}, impossible = {})",
        f.p_value, f.stat, f.df, f.impossible
    );
    assert!(
        f.p_value < ALPHA,
        "{name}: the test failed to reject a wrong verifier: {f:?}"
    );
}

/// Generations per test. Each generation is one to three verify steps.
const N: u64 = 30_000;

// ---------------------------------------------------------------------------------------------

/// Plain sampling at temperature 1 (no filter), draft model proposals, k = 1..4.
#[test]
fn draft_model_plain_sampling() {
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    let s = Setup::new(5, cfg, 11);
    for k in 1..=4 {
        expect_pass(&format!("plain k={k}"), s.fit(k, N, 1_000 * k as u64));
    }
    let bad = Setup {
        kind: VerifierKind::AlwaysAccept,
        ..Setup::new(5, SamplingConfig::sampling(1.0).unwrap(), 11)
    };
    expect_reject("plain always-accept k=2", bad.fit(2, N, 7_000));
}

/// Temperature 0.7 + top-p 0.9 + top-k 3 on vocab 6, q passed as probabilities and as logits.
#[test]
fn temperature_top_p_top_k() {
    let s = Setup::new(6, nucleus_config(), 23);
    for k in 1..=4 {
        expect_pass(
            &format!("nucleus probs k={k}"),
            s.fit(k, N, 100_000 + k as u64 * N),
        );
    }
    let s = Setup {
        q_pass: QPass::Logits,
        ..Setup::new(6, nucleus_config(), 23)
    };
    expect_pass("nucleus logits k=3", s.fit(3, N, 200_000));
}

#[test]
fn temperature_top_p_top_k_negative_controls() {
    let raw = Setup {
        q_pass: QPass::RawSoftmax,
        ..Setup::new(6, nucleus_config(), 23)
    };
    expect_reject("nucleus (a) raw q k=2", raw.fit(2, N, 300_000));
    let unprocessed = Setup {
        verify_config: SamplingConfig::sampling(0.7).unwrap(),
        ..Setup::new(6, nucleus_config(), 23)
    };
    expect_reject(
        "nucleus (b) no top-p/top-k k=2",
        unprocessed.fit(2, N, 400_000),
    );
    let always = Setup {
        kind: VerifierKind::AlwaysAccept,
        ..Setup::new(6, nucleus_config(), 23)
    };
    expect_reject("nucleus (c) always-accept k=2", always.fit(2, N, 500_000));
}

/// Temperature 1.2 + min-p 0.25 on vocab 5.
#[test]
fn min_p() {
    let s = Setup::new(5, min_p_config(), 37);
    for k in [1, 3] {
        expect_pass(&format!("min-p k={k}"), s.fit(k, N, 600_000 + k as u64 * N));
    }
    let raw = Setup {
        q_pass: QPass::RawSoftmax,
        ..Setup::new(5, min_p_config(), 37)
    };
    expect_reject("min-p (a) raw q k=2", raw.fit(2, N, 700_000));
    let unprocessed = Setup {
        verify_config: SamplingConfig::sampling(1.2).unwrap(),
        ..Setup::new(5, min_p_config(), 37)
    };
    expect_reject("min-p (b) no min-p k=2", unprocessed.fit(2, N, 800_000));
}

/// Repetition / presence / frequency penalties on vocab 4: the history (prompt, accepted
/// drafts, earlier drafts of the block) changes every row.
#[test]
fn penalties_with_history() {
    let s = Setup::new(4, penalty_config(), 41);
    for k in [1, 2, 4] {
        expect_pass(
            &format!("penalties k={k}"),
            s.fit(k, N, 900_000 + k as u64 * N),
        );
    }
    let s = Setup {
        q_pass: QPass::Logits,
        ..Setup::new(4, penalty_config(), 41)
    };
    expect_pass("penalties logits k=3", s.fit(3, N, 1_000_000));
    let raw = Setup {
        q_pass: QPass::RawSoftmax,
        ..Setup::new(4, penalty_config(), 41)
    };
    expect_reject("penalties (a) raw q k=3", raw.fit(3, N, 1_050_000));
    let unprocessed = Setup {
        verify_config: SamplingConfig::sampling(1.0).unwrap(),
        ..Setup::new(4, penalty_config(), 41)
    };
    expect_reject(
        "penalties (b) no penalty k=3",
        unprocessed.fit(3, N, 1_100_000),
    );
    let always = Setup {
        kind: VerifierKind::AlwaysAccept,
        ..Setup::new(4, penalty_config(), 41)
    };
    expect_reject(
        "penalties (c) always-accept k=3",
        always.fit(3, N, 1_200_000),
    );
}

/// Deterministic proposers (point masses): the draft model's processed argmax, and uniformly
/// random tokens (often outside the target's top-k / top-p support).
#[test]
fn point_mass_drafts() {
    for drafter in [Drafter::Argmax, Drafter::Random] {
        for (name, cfg) in [
            ("plain", SamplingConfig::sampling(1.0).unwrap()),
            ("nucleus", nucleus_config()),
        ] {
            let s = Setup {
                drafter,
                q_pass: QPass::PointMass,
                ..Setup::new(5, cfg, 53)
            };
            for k in [1, 3] {
                expect_pass(
                    &format!("point mass {drafter:?} {name} k={k}"),
                    s.fit(k, N / 2, 1_300_000 + k as u64 * N),
                );
            }
        }
    }
    let unprocessed = Setup {
        drafter: Drafter::Random,
        q_pass: QPass::PointMass,
        verify_config: SamplingConfig::sampling(0.7).unwrap(),
        ..Setup::new(5, nucleus_config(), 53)
    };
    expect_reject(
        "point mass (b) no top-p/top-k k=2",
        unprocessed.fit(2, N / 2, 1_400_000),
    );
    let always = Setup {
        drafter: Drafter::Argmax,
        q_pass: QPass::PointMass,
        kind: VerifierKind::AlwaysAccept,
        ..Setup::new(5, SamplingConfig::sampling(1.0).unwrap(), 53)
    };
    expect_reject(
        "point mass (c) always-accept k=2",
        always.fit(2, N / 2, 1_500_000),
    );
}

/// The verifier's distribution of the first emitted token given a fixed draft token matches the
/// closed form of `verify::exact` (which the closed-form proofs show sums to p): this ties the
/// closed-form proofs to the sampling code. Negative control: an always-accept verifier.
#[test]
fn first_token_given_draft_matches_closed_form() {
    let vocab = 6;
    let cfg = SamplingConfig::builder()
        .temperature(0.9)
        .top_p(0.95)
        .build()
        .unwrap();
    let t_logits = [
        1.0f32, 0.2, -0.5, 0.8, 0.1, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
    ];
    let d_logits = [0.1f32, 1.2, -0.3, 0.9, 0.4, 0.0];
    let p = process(&cfg, &t_logits[..vocab], &[], vocab).unwrap();
    let q = process(&cfg, &d_logits, &[], vocab).unwrap();
    let q_dense = dense(&q, vocab);
    let n = 30_000u64;
    let mut verifier = Verifier::new();
    for &x in q.ids() {
        let exact = first_token_given_draft(&p, &DraftRow::Dist(&q), x).unwrap();
        let mut counts = vec![0u64; vocab];
        let drafts = [x];
        for seed in 0..n {
            let req = VerifyRequest::new(&cfg, &t_logits, vocab, &drafts)
                .draft_probs(DraftProbs::Probs {
                    probs: &q_dense,
                    vocab,
                })
                .seed(seed ^ ((x as u64) << 40));
            counts[verifier.verify(&req).unwrap().tokens[0] as usize] += 1;
        }
        expect_pass(&format!("given draft {x}"), chi_square(&counts, &exact));
        // Always accepting gives a point mass on x, which the same test rejects whenever the
        // closed form puts less than all its mass on x.
        let mut always = vec![0u64; vocab];
        always[x as usize] = n;
        if exact[x as usize] < 0.99 {
            expect_reject(
                &format!("given draft {x} always-accept"),
                chi_square(&always, &exact),
            );
        }
    }
}
