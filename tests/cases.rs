//! The verifier's regression cases from `cases/verifier-and-loop-cases.md`: C01, C05, C06, C07,
//! C08, C09. Each test asserts what its case says, in closed form where the case gives numbers
//! and statistically (chi-square at `ALPHA`, see `tests/statistical.rs` for the method) where the
//! claim is about a sampled distribution. Every statistical check comes with the faulty variant
//! the case describes, which the same check must reject.

mod common;

use common::{chi_square, dense, process};
use speculative::rng::{Stream, lane};
use speculative::verify::DraftRow;
use speculative::verify::exact::{first_token_given_draft, first_token_marginal};
use speculative::{
    DraftProbs, Error, Result, RowKind, SamplingConfig, SequenceParams, StepEnd, StepOutput,
    TokenDist, Verifier, VerifyBatch, VerifyRequest,
};

/// Significance level of the statistical checks.
const ALPHA: f64 = 1e-3;

fn ln(ps: &[f32]) -> Vec<f32> {
    ps.iter().map(|p| p.ln()).collect()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{what}: entry {i}: {g} vs {w} (all: {got:?})"
        );
    }
}

fn probs_of(d: &TokenDist) -> Vec<f64> {
    (0..d.vocab_size() as u32)
        .map(|t| d.prob(t) as f64)
        .collect()
}

/// Counts of the first emitted token over seeds `0..n` of a one-draft step.
fn first_token_counts(n: u64, vocab: usize, mut step: impl FnMut(u64) -> StepOutput) -> Vec<u64> {
    let mut c = vec![0u64; vocab];
    for seed in 0..n {
        let out = step(seed);
        assert_eq!(out.tokens.len(), out.accepted + 1);
        c[out.tokens[0] as usize] += 1;
    }
    c
}

// ---------------------------------------------------------------------------------------------

#[test]
fn c01_top_p_shapes_both_sides_of_the_ratio() {
    let vocab = 3;
    let cfg = SamplingConfig::builder()
        .temperature(1.0)
        .top_p(0.8)
        .build()
        .unwrap();
    let t_row = ln(&[0.6, 0.3, 0.1]);
    let d_row = ln(&[0.5, 0.4, 0.1]);
    let p = process(&cfg, &t_row, &[], vocab).unwrap();
    let q = process(&cfg, &d_row, &[], vocab).unwrap();
    assert_close(
        &probs_of(&p),
        &[2.0 / 3.0, 1.0 / 3.0, 0.0],
        1e-6,
        "processed p",
    );
    assert_close(
        &probs_of(&q),
        &[5.0 / 9.0, 4.0 / 9.0, 0.0],
        1e-6,
        "processed q",
    );
    // Closed form: the first emitted token follows p; token 2 has probability exactly 0.
    let m = first_token_marginal(&p, &q).unwrap();
    assert_close(&m, &[2.0 / 3.0, 1.0 / 3.0, 0.0], 1e-6, "marginal");
    assert_eq!(m[2], 0.0);
    // The fault: an unfiltered target emits token 2 with probability 0.1.
    let unfiltered = SamplingConfig::sampling(1.0).unwrap();
    let p_raw = process(&unfiltered, &t_row, &[], vocab).unwrap();
    let m_raw = first_token_marginal(&p_raw, &q).unwrap();
    assert_close(
        &m_raw,
        &[0.6, 0.3, 0.1],
        1e-6,
        "marginal with unfiltered target",
    );

    // The real verifier, draft sampled from q (q passed as logits and as probabilities).
    let target: Vec<f32> = [t_row.clone(), t_row.clone()].concat();
    let q_dense = dense(&q, vocab);
    let n = 20_000;
    let draw = |seed: u64| {
        q.sample(Stream::new(!seed).uniform(0, lane::DRAFT))
            .unwrap()
    };
    let mut v = Verifier::new();
    for pass_logits in [false, true] {
        let counts = first_token_counts(n, vocab, |seed| {
            let drafts = [draw(seed)];
            let probs = if pass_logits {
                DraftProbs::Logits {
                    logits: &d_row,
                    vocab,
                }
            } else {
                DraftProbs::Probs {
                    probs: &q_dense,
                    vocab,
                }
            };
            v.verify(
                &VerifyRequest::new(&cfg, &target, vocab, &drafts)
                    .draft_probs(probs)
                    .seed(seed),
            )
            .unwrap()
        });
        assert_eq!(counts[2], 0, "token 2 was emitted");
        let fit = chi_square(&counts, &m);
        assert!(fit.p_value >= ALPHA, "{fit:?}");
    }
    // The faulty verifier (target without top-p) is rejected and emits token 2 ~10% of the time.
    let counts = first_token_counts(n, vocab, |seed| {
        let drafts = [draw(seed)];
        v.verify(
            &VerifyRequest::new(&unfiltered, &target, vocab, &drafts)
                .draft_probs(DraftProbs::Probs {
                    probs: &q_dense,
                    vocab,
                })
                .seed(seed),
        )
        .unwrap()
    });
    let share = counts[2] as f64 / n as f64;
    assert!((0.09..0.11).contains(&share), "token 2 share {share}");
    assert!(chi_square(&counts, &m).p_value < ALPHA);
}

#[test]
fn c05_q_is_the_distribution_the_draft_was_sampled_from() {
    let vocab = 3;
    let raw_q = [0.5f32, 0.3, 0.2];
    let draft_cfg = SamplingConfig::builder()
        .temperature(1.0)
        .top_k(1)
        .build()
        .unwrap();
    let q_proc = process(&draft_cfg, &ln(&raw_q), &[], vocab).unwrap();
    assert_eq!(q_proc.ids(), &[0]);
    let q_dense = dense(&q_proc, vocab);
    assert_eq!(q_dense, vec![1.0, 0.0, 0.0]);
    let p = TokenDist::from_pairs([(0, 0.4), (1, 0.4), (2, 0.2)], vocab).unwrap();

    // With q': accept with 0.4, residual [0, 2/3, 1/3], marginal = p.
    let row = DraftRow::Dense(&q_dense);
    let given = first_token_given_draft(&p, &row, 0).unwrap();
    assert_close(&given, &[0.4, 0.4, 0.2], 1e-6, "with processed q");
    let mut res = Vec::new();
    let total = speculative::verify::residual_weights(&p, &row, 0, &mut res);
    let res: Vec<f64> = res.iter().map(|&(_, w)| w / total).collect();
    assert_close(&res, &[2.0 / 3.0, 1.0 / 3.0], 1e-6, "residual");
    assert!((speculative::verify::acceptance_probability(0.4, 1.0) - 0.4).abs() < 1e-7);
    // With the raw q (the fault): [0.8, 0.2, 0].
    let bad = first_token_given_draft(&p, &DraftRow::Dense(&raw_q), 0).unwrap();
    assert_close(&bad, &[0.8, 0.2, 0.0], 1e-6, "with raw q");

    // The real verifier: the drafts are always token 0 (sampled from q').
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    let target: Vec<f32> = [ln(&[0.4, 0.4, 0.2]), vec![0.0; 3]].concat();
    let n = 20_000;
    let mut v = Verifier::new();
    let mut run = |q: &[f32]| {
        first_token_counts(n, vocab, |seed| {
            let x = q_proc
                .sample(Stream::new(!seed).uniform(0, lane::DRAFT))
                .unwrap();
            assert_eq!(x, 0);
            v.verify(
                &VerifyRequest::new(&cfg, &target, vocab, &[0])
                    .draft_probs(DraftProbs::Probs { probs: q, vocab })
                    .seed(seed),
            )
            .unwrap()
        })
    };
    let good = run(&q_dense);
    assert!(
        chi_square(&good, &[0.4, 0.4, 0.2]).p_value >= ALPHA,
        "{good:?}"
    );
    let faulty = run(&raw_q);
    assert!(
        chi_square(&faulty, &[0.4, 0.4, 0.2]).p_value < ALPHA,
        "{faulty:?}"
    );
    assert!(
        chi_square(&faulty, &[0.8, 0.2, 0.0]).p_value >= ALPHA,
        "{faulty:?}"
    );
    assert_eq!(faulty[2], 0);

    // Deterministic proposer (no q): for every drafted x, "accept with p(x), else sample p
    // without x" gives exactly p, in closed form and through the verifier.
    for x in 0..vocab as u32 {
        let given = first_token_given_draft(&p, &DraftRow::PointMass, x).unwrap();
        assert_close(
            &given,
            &[0.4, 0.4, 0.2],
            1e-6,
            &format!("point mass on {x}"),
        );
        let counts = first_token_counts(n, vocab, |seed| {
            v.verify(&VerifyRequest::new(&cfg, &target, vocab, &[x]).seed(seed))
                .unwrap()
        });
        let fit = chi_square(&counts, &[0.4, 0.4, 0.2]);
        assert!(fit.p_value >= ALPHA, "point mass on {x}: {fit:?}");
    }
}

/// Greedy logits for a row whose argmax is `t` (vocab `v`).
fn onehot(v: usize, t: u32) -> Vec<f32> {
    (0..v)
        .map(|i| if i == t as usize { 3.0 } else { 0.0 })
        .collect()
}

#[test]
fn c06_accepted_is_the_leading_run_via_batch() {
    let v = 6;
    // Sequence 0: flags [1, 0, 1] (row 2 would accept d_3 but is never reached).
    // Sequence 1: flags [1, 1, 1], bonus 5.
    let drafts = [1u32, 2, 3, 4, 0, 2];
    let offsets = [0usize, 3, 6];
    let target: Vec<f32> = [
        onehot(v, 1),
        onehot(v, 4), // != 2: reject
        onehot(v, 3), // == 3, but after the rejection
        onehot(v, 0),
        onehot(v, 4),
        onehot(v, 0),
        onehot(v, 2),
        onehot(v, 5), // bonus
    ]
    .concat();
    let greedy = SamplingConfig::greedy();
    let seqs = [
        SequenceParams::new(&greedy, 1),
        SequenceParams::new(&greedy, 2),
    ];
    let batch = VerifyBatch::new(v, &target, &drafts, &offsets, &seqs);
    let out: Vec<StepOutput> = Verifier::new()
        .verify_batch(&batch)
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(
        out.iter().map(|o| o.accepted).collect::<Vec<_>>(),
        vec![1, 3]
    );
    assert_eq!(
        out.iter().map(|o| o.tokens.len()).collect::<Vec<_>>(),
        vec![2, 4]
    );
    assert_eq!(out[0].tokens, vec![1, 4]);
    assert_eq!(out[0].end, StepEnd::Rejected { index: 1 });
    assert_eq!(out[1].tokens, vec![4, 0, 2, 5]);
    assert_eq!(out[1].end, StepEnd::AllAccepted);

    // The same flags in stochastic mode: p(d) = 1 where the flag is 1 (certain acceptance),
    // p(d) = 0 where it is 0 (the drafted token is banned by a -inf logit), for every seed.
    let sure = |t: u32| -> Vec<f32> {
        (0..v)
            .map(|i| if i == t as usize { 0.0 } else { -200.0 })
            .collect()
    };
    let never = |t: u32| -> Vec<f32> {
        (0..v)
            .map(|i| {
                if i == t as usize {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect()
    };
    let target: Vec<f32> = [
        sure(1),
        never(2),
        sure(3),
        vec![0.0; v],
        sure(4),
        sure(0),
        sure(2),
        vec![0.0; v],
    ]
    .concat();
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    for seed in 0..50 {
        let seqs = [
            SequenceParams::new(&cfg, seed),
            SequenceParams::new(&cfg, seed + 1),
        ];
        let out = Verifier::new()
            .verify_batch(
                &VerifyBatch::new(v, &target, batch.draft_tokens, batch.draft_offsets, &seqs)
                    .draft_probs(batch.draft_probs),
            )
            .unwrap();
        let out: Vec<StepOutput> = out.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(out[0].accepted, 1);
        assert_eq!(out[0].tokens.len(), 2);
        assert_ne!(
            out[0].tokens[1], 2,
            "the rejected draft cannot be the correction"
        );
        assert_eq!(out[1].accepted, 3);
        assert_eq!(out[1].tokens.len(), 4);
    }
}

#[test]
fn c07_non_finite_logits_never_become_a_token() {
    let v = 5;
    let nan_rows: Vec<f32> = [vec![f32::NAN; v], vec![0.0; v]].concat();
    let q_uniform = vec![0.2f32; v];
    let q_logits = vec![0.0f32; v];
    let sampling = SamplingConfig::sampling(1.0).unwrap();
    let greedy = SamplingConfig::greedy();
    let modes = [
        DraftProbs::PointMass,
        DraftProbs::Probs {
            probs: &q_uniform,
            vocab: v,
        },
        DraftProbs::Logits {
            logits: &q_logits,
            vocab: v,
        },
    ];
    let mut verifier = Verifier::new();
    for cfg in [&sampling, &greedy] {
        for q in modes {
            let req = VerifyRequest::new(cfg, &nan_rows, v, &[3]).draft_probs(q);
            let e = verifier.verify(&req);
            assert!(
                matches!(
                    e,
                    Err(Error::NonFiniteLogits {
                        kind: RowKind::Target,
                        row: 0,
                        token: 0,
                        ..
                    })
                ),
                "{e:?}"
            );
        }
        // Every entry -inf after allowed-token masking.
        let allow = cfg.to_builder().allowed_tokens([1, 2]).build().unwrap();
        let mut rows = vec![0.0f32; 2 * v];
        rows[1] = f32::NEG_INFINITY;
        rows[2] = f32::NEG_INFINITY;
        let e = verifier.verify(&VerifyRequest::new(&allow, &rows, v, &[3]));
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
        // A row that is all -inf, with top-k set.
        let topk = cfg.to_builder().top_k(2).build().unwrap();
        let mut rows = vec![0.0f32; 2 * v];
        rows[..v].fill(f32::NEG_INFINITY);
        let e = verifier.verify(&VerifyRequest::new(&topk, &rows, v, &[3]));
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
        // The bonus row is checked too when every draft is accepted.
        let mut rows = onehot(v, 3);
        rows[3] = 100.0;
        rows.extend(vec![f32::NAN; v]);
        let e = verifier.verify(&VerifyRequest::new(cfg, &rows, v, &[3]));
        assert!(
            matches!(e, Err(Error::NonFiniteLogits { row: 1, .. })),
            "{e:?}"
        );
    }
    // Draft rows: NaN draft logits, and draft logits with no allowed token.
    let nan_q = vec![f32::NAN; v];
    let e = verifier.verify(
        &VerifyRequest::new(&sampling, &[0.0; 10], v, &[3]).draft_probs(DraftProbs::Logits {
            logits: &nan_q,
            vocab: v,
        }),
    );
    assert!(
        matches!(
            e,
            Err(Error::NonFiniteLogits {
                kind: RowKind::Draft,
                row: 0,
                ..
            })
        ),
        "{e:?}"
    );
    let dead_q = vec![f32::NEG_INFINITY; v];
    let e = verifier.verify(
        &VerifyRequest::new(&sampling, &[0.0; 10], v, &[3]).draft_probs(DraftProbs::Logits {
            logits: &dead_q,
            vocab: v,
        }),
    );
    assert!(
        matches!(
            e,
            Err(Error::NoAllowedToken {
                kind: RowKind::Draft,
                row: 0
            })
        ),
        "{e:?}"
    );

    // In a batch, the bad sequence gets its error; its neighbours are unaffected and every Ok
    // step emits at least one token.
    let target: Vec<f32> = [vec![0.0f32; 2 * v], nan_rows.clone(), vec![0.5f32; v]].concat();
    let drafts = [1u32, 3];
    let offsets = [0usize, 1, 2, 2];
    for cfg in [&sampling, &greedy] {
        let seqs = [
            SequenceParams::new(cfg, 1),
            SequenceParams::new(cfg, 2),
            SequenceParams::new(cfg, 3),
        ];
        let out = verifier
            .verify_batch(&VerifyBatch::new(v, &target, &drafts, &offsets, &seqs))
            .unwrap();
        assert!(
            matches!(out[1], Err(Error::NonFiniteLogits { row: 0, .. })),
            "{:?}",
            out[1]
        );
        for r in [&out[0], &out[2]] {
            let o = r.as_ref().unwrap();
            assert!(!o.tokens.is_empty() && o.tokens.iter().all(|&t| (t as usize) < v));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// C08

/// One sequence of the C08 batch.
struct Seq {
    config: SamplingConfig,
    seed: u64,
    context: Vec<u32>,
    drafts: Vec<u32>,
    /// `[k + 1, vocab]`.
    target: Vec<f32>,
    /// `[k, vocab]` draft logits, and their processed q rows.
    draft_logits: Vec<f32>,
    q: Vec<f32>,
}

const V8: usize = 8;

fn pseudo(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let s = Stream::new(seed);
    (0..n)
        .map(|i| (s.uniform(i as u64, 5) - 0.5) * scale)
        .collect()
}

fn make_seq(config: SamplingConfig, seed: u64, k: usize, salt: u64) -> Seq {
    let context: Vec<u32> = (0..5)
        .map(|i| ((i * 3 + salt) % V8 as u64) as u32)
        .collect();
    let target = pseudo(salt * 7 + 1, (k + 1) * V8, 4.0);
    let draft_logits = pseudo(salt * 7 + 2, k * V8, 4.0);
    // Draft tokens sampled from the processed draft rows (history: context + earlier drafts).
    let mut prefix = context.clone();
    let mut drafts = Vec::new();
    let mut q = Vec::new();
    for i in 0..k {
        let d = process(&config, &draft_logits[i * V8..(i + 1) * V8], &prefix, V8).unwrap();
        let x = d
            .sample(Stream::new(salt).uniform(i as u64, lane::DRAFT))
            .unwrap();
        q.extend(dense(&d, V8));
        drafts.push(x);
        prefix.push(x);
    }
    Seq {
        config,
        seed,
        context,
        drafts,
        target,
        draft_logits,
        q,
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    PointMass,
    Probs,
    Logits,
}

/// Verifies `seqs` in the given order through one batch call; results in `order`'s order.
fn run_batch(v: &mut Verifier, seqs: &[&Seq], mode: Mode) -> Vec<Result<StepOutput>> {
    let mut target = Vec::new();
    let mut drafts = Vec::new();
    let mut offsets = vec![0usize];
    let mut q = Vec::new();
    let mut dl = Vec::new();
    for s in seqs {
        target.extend_from_slice(&s.target);
        drafts.extend_from_slice(&s.drafts);
        offsets.push(drafts.len());
        q.extend_from_slice(&s.q);
        dl.extend_from_slice(&s.draft_logits);
    }
    let params: Vec<SequenceParams<'_>> = seqs
        .iter()
        .map(|s| SequenceParams::new(&s.config, s.seed).context(&s.context))
        .collect();
    let draft_probs = match mode {
        Mode::PointMass => DraftProbs::PointMass,
        Mode::Probs => DraftProbs::Probs {
            probs: &q,
            vocab: V8,
        },
        Mode::Logits => DraftProbs::Logits {
            logits: &dl,
            vocab: V8,
        },
    };
    v.verify_batch(
        &VerifyBatch::new(V8, &target, &drafts, &offsets, &params).draft_probs(draft_probs),
    )
    .unwrap()
}

fn same(a: &Result<StepOutput>, b: &Result<StepOutput>) -> bool {
    match (a, b) {
        (Ok(x), Ok(y)) => x == y,
        (Err(x), Err(y)) => x.to_string() == y.to_string(),
        _ => false,
    }
}

const PERMUTATIONS: [[usize; 3]; 6] = [
    [0, 1, 2],
    [0, 2, 1],
    [1, 0, 2],
    [1, 2, 0],
    [2, 0, 1],
    [2, 1, 0],
];

#[test]
fn c08_rows_of_a_batch_never_see_each_other() {
    let nucleus = SamplingConfig::builder()
        .temperature(0.8)
        .top_p(0.9)
        .top_k(5)
        .repetition_penalty(1.3)
        .logprobs(2)
        .build()
        .unwrap();
    let plain = SamplingConfig::sampling(1.1).unwrap();
    let greedy = SamplingConfig::builder()
        .presence_penalty(0.4)
        .build()
        .unwrap();
    let mut distinct_outputs = std::collections::HashSet::new();
    for trial in 0..40u64 {
        // Draft lengths 3, 0, 1: 4 + 1 + 2 = 7 target rows.
        let seqs = [
            make_seq(nucleus.clone(), trial, 3, 3 * trial + 1),
            make_seq(
                if trial % 2 == 0 {
                    greedy.clone()
                } else {
                    plain.clone()
                },
                trial + 100,
                0,
                3 * trial + 2,
            ),
            make_seq(plain.clone(), trial + 200, 1, 3 * trial + 3),
        ];
        for mode in [Mode::PointMass, Mode::Probs, Mode::Logits] {
            // Reference: each sequence alone in a batch of one, with a fresh verifier.
            let alone: Vec<Result<StepOutput>> = seqs
                .iter()
                .map(|s| run_batch(&mut Verifier::new(), &[s], mode).pop().unwrap())
                .collect();
            // The single-request API agrees.
            for (s, a) in seqs.iter().zip(&alone) {
                let q = match mode {
                    Mode::PointMass => DraftProbs::PointMass,
                    Mode::Probs => DraftProbs::Probs {
                        probs: &s.q,
                        vocab: V8,
                    },
                    Mode::Logits => DraftProbs::Logits {
                        logits: &s.draft_logits,
                        vocab: V8,
                    },
                };
                let r = Verifier::new().verify(
                    &VerifyRequest::new(&s.config, &s.target, V8, &s.drafts)
                        .draft_probs(q)
                        .context(&s.context)
                        .seed(s.seed),
                );
                assert!(same(&r, a));
                if let Ok(o) = a {
                    distinct_outputs.insert(o.tokens.clone());
                }
            }
            // Every order, through one reused verifier.
            let mut v = Verifier::new();
            for perm in PERMUTATIONS {
                let ordered: Vec<&Seq> = perm.iter().map(|&i| &seqs[i]).collect();
                let out = run_batch(&mut v, &ordered, mode);
                for (slot, &i) in perm.iter().enumerate() {
                    assert!(
                        same(&out[slot], &alone[i]),
                        "trial {trial}, order {perm:?}: sequence {i} changed"
                    );
                }
            }
        }
    }
    // The results are not trivially constant (otherwise the comparison proves nothing).
    assert!(distinct_outputs.len() > 20, "{}", distinct_outputs.len());
}

#[test]
fn c08_greedy_sequences_consume_no_randomness() {
    let greedy = SamplingConfig::builder()
        .repetition_penalty(1.2)
        .build()
        .unwrap();
    let a = make_seq(greedy.clone(), 0, 3, 91);
    let b = make_seq(greedy.clone(), 0, 0, 92);
    let c = make_seq(SamplingConfig::sampling(1.0).unwrap(), 0, 1, 93);
    let reference = run_batch(&mut Verifier::new(), &[&a, &b, &c], Mode::Probs);
    let mut v = Verifier::new();
    for seed in [1u64, 2, 17, 12345, u64::MAX, 0xDEAD_BEEF] {
        let a2 = Seq {
            seed,
            ..make_seq(greedy.clone(), 0, 3, 91)
        };
        let b2 = Seq {
            seed: seed ^ 5,
            ..make_seq(greedy.clone(), 0, 0, 92)
        };
        // The sampling neighbour's seed changes too: it must not matter to the greedy ones.
        let c2 = Seq {
            seed: seed.wrapping_mul(3),
            ..make_seq(SamplingConfig::sampling(1.0).unwrap(), 0, 1, 93)
        };
        let out = run_batch(&mut v, &[&a2, &b2, &c2], Mode::Probs);
        assert!(same(&out[0], &reference[0]));
        assert!(same(&out[1], &reference[1]));
        // A greedy sequence at another absolute position gives the same tokens as well.
        let r = v
            .verify(
                &VerifyRequest::new(&a.config, &a.target, V8, &a.drafts)
                    .context(&a.context)
                    .seed(seed)
                    .position(seed % 1000),
            )
            .unwrap();
        assert!(same(&Ok(r), &reference[0]));
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn c09_temperature_zero_and_tiny_temperatures() {
    let v = 3;
    let draft_row = [2.0f32, 1.0, 0.5];
    let target_row = [1.5f32, 1.4, 0.0];
    let target: Vec<f32> = [target_row, target_row].concat();
    let greedy = SamplingConfig::greedy();
    // Temperature 0: greedy; the draft (argmax of the draft, token 0) is accepted, for any seed.
    let g = process(&greedy, &draft_row, &[], v).unwrap();
    assert_eq!(g.ids(), &[0]);
    let reference = Verifier::new()
        .verify(&VerifyRequest::new(&greedy, &target, v, &[0]))
        .unwrap();
    assert_eq!(reference.accepted, 1);
    assert_eq!(reference.tokens, vec![0, 0]);
    let mut verifier = Verifier::new();
    for t in [1e-6f32, 1e-3] {
        let cfg = SamplingConfig::builder()
            .temperature(t)
            .logprobs(3)
            .build()
            .unwrap();
        let p = process(&cfg, &target_row, &[], v).unwrap();
        let q = process(&cfg, &draft_row, &[], v).unwrap();
        for d in [&p, &q] {
            assert!(d.probs().iter().all(|x| x.is_finite()));
            assert!((d.prob(0) as f64 - 1.0).abs() < 1e-6, "T={t}: {d:?}");
            assert!(d.logprob(0).is_finite() && d.logprob(0) <= 0.0);
        }
        let qd = dense(&q, v);
        for seed in 0..500 {
            for probs in [
                DraftProbs::Probs {
                    probs: &qd,
                    vocab: v,
                },
                DraftProbs::Logits {
                    logits: &draft_row,
                    vocab: v,
                },
            ] {
                let out = verifier
                    .verify(
                        &VerifyRequest::new(&cfg, &target, v, &[0])
                            .draft_probs(probs)
                            .seed(seed),
                    )
                    .unwrap();
                assert_eq!(out.tokens, reference.tokens, "T={t} seed {seed}");
                assert_eq!(out.accepted, 1);
                let lps = out.logprobs.unwrap();
                assert!(lps
                    .iter()
                    .all(|l| l.logprob.is_finite() && l.top.iter().all(|&(_, lp)| !lp.is_nan())));
            }
        }
    }
    // A tie is broken the same documented way (lowest id) in the speculative and plain paths.
    let tie = [1.0f32, 1.0, 0.0];
    let tie2: Vec<f32> = [tie, tie].concat();
    let plain = verifier
        .verify(&VerifyRequest::new(&greedy, &tie, v, &[]))
        .unwrap();
    assert_eq!(plain.tokens, vec![0]);
    assert_eq!(plain.end, StepEnd::NoDraft);
    let spec_accept = verifier
        .verify(&VerifyRequest::new(&greedy, &tie2, v, &[0]))
        .unwrap();
    assert_eq!(spec_accept.tokens, vec![0, 0]);
    let spec_reject = verifier
        .verify(&VerifyRequest::new(&greedy, &tie2, v, &[1]))
        .unwrap();
    assert_eq!(spec_reject.tokens, vec![0]);
    assert_eq!(spec_reject.end, StepEnd::Rejected { index: 0 });
    // Top-k ties keep the lowest id as well: top_k = 1 on the tie is a point mass on 0.
    let k1 = SamplingConfig::builder()
        .temperature(1.0)
        .top_k(1)
        .build()
        .unwrap();
    assert_eq!(process(&k1, &tie, &[], v).unwrap().ids(), &[0]);
}

#[test]
fn batch_offsets_that_decrease_name_the_offending_index() {
    let cfg = speculative::SamplingConfig::greedy();
    let params = [
        speculative::SequenceParams::new(&cfg, 0),
        speculative::SequenceParams::new(&cfg, 0),
    ];
    let logits = vec![0.0f32; 6 * 2];
    let batch = speculative::VerifyBatch::new(2, &logits, &[0, 0, 0, 0], &[0, 5, 4], &params);
    let e = speculative::Verifier::new()
        .verify_batch(&batch)
        .unwrap_err();
    assert!(
        matches!(
            e,
            speculative::Error::InvalidOffsets {
                index: 2,
                value: 4,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("draft_offsets[2] = 4"), "{e}");
}
