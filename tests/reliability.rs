//! Issue 16: cases C11, C12, C14, C15 (../shared/cases), `min_tokens`, stop strings, faults
//! and the new-user faults, each as a named test. C13 lives in tests/heads.rs.

use std::ops::ControlFlow;
use std::sync::Arc;

use speculative::DraftBlock;
use speculative::decode::{
    AdaptiveConfig, Detokenizer, DraftLength, FinishReason, GenerationParams, Generator,
    StopConditions,
};
use speculative::propose::{DraftModelProposer, NoProposer, PromptLookup, SuffixProposer};
use speculative::rng::{Stream, lane};
use speculative::sampling::{History, PenaltyScope, RowProcessor};
use speculative::test_util::{CallLog, RandomProposer, ScriptedProposer, ToyModel};
use speculative::{
    Draft, DraftProbs, Error, ProposeRequest, Proposer, Result, RowKind, SamplingConfig, StepEnd,
    TargetModel, TokenDist, Verifier, VerifyRequest,
};

// ---------------------------------------------------------------------------------------------
// C11: nothing is processed past an accepted end.

/// The C11 mask: only 1, 2, 3 at the first three generated positions, nothing after 3.
fn c11_mask() -> Arc<dyn speculative::TokenMask> {
    Arc::new(|prefix: &[u32], logits: &mut [f32]| {
        let generated = &prefix[2..];
        let allowed = match generated {
            [] => Some(1),
            [1] => Some(2),
            [1, 2] => Some(3),
            _ => None,
        };
        for (v, l) in logits.iter_mut().enumerate() {
            if Some(v as u32) != allowed {
                *l = f32::NEG_INFINITY;
            }
        }
    })
}

/// Greedy continuation after [0, 0] is [1, 2, 3, 4, 5, ...] (next = len - 1 mod 8).
fn c11_target() -> ToyModel {
    ToyModel::deterministic(8, 100, |p: &[u32]| ((p.len() - 1) % 8) as u32)
}

#[test]
fn c11_drafts_past_an_accepted_eos_are_never_processed() {
    let cfg = SamplingConfig::builder().mask(c11_mask()).build().unwrap();
    for (sampling, seed) in [
        (cfg.clone(), 0),
        (cfg.to_builder().temperature(0.7).build().unwrap(), 5),
    ] {
        let mut g = Generator::new(
            CallLog::new(c11_target()),
            ScriptedProposer::new(vec![vec![1, 2, 3, 1, 2]]),
        );
        let params = GenerationParams::builder()
            .sampling(sampling)
            .seed(seed)
            .max_new_tokens(16)
            .stop(StopConditions::eos(3))
            .draft(DraftLength::Fixed(5))
            .build()
            .unwrap();
        let out = g.generate(&[0, 0], &params).unwrap();
        assert_eq!(out.tokens, vec![1, 2, 3]);
        assert_eq!(out.finish, FinishReason::Eos);
        // One forward over [0, last, 1, 2] (the prompt's first token fused ahead of the
        // verify rows), with 3 verify rows: no row after the EOS draft was computed.
        assert_eq!(g.target().tails, vec![(4, 3)]);
        assert!(g.target().forwards.is_empty() && g.target().prefills.is_empty());
        assert_eq!(out.metrics.proposed, 3);
        assert_eq!(out.metrics.accepted, 3);
    }
}

#[test]
fn c11_a_stop_sequence_completed_inside_a_draft_cuts_it() {
    let mut g = Generator::new(
        CallLog::new(c11_target()),
        ScriptedProposer::new(vec![vec![1, 2, 3, 4, 5]]),
    );
    let params = GenerationParams::builder()
        .max_new_tokens(16)
        .stop(StopConditions::default().with_stop_sequence(vec![2, 3]))
        .draft(DraftLength::Fixed(5))
        .build()
        .unwrap();
    let out = g.generate(&[0, 0], &params).unwrap();
    assert_eq!(out.tokens, vec![1, 2, 3]);
    assert_eq!(out.finish, FinishReason::StopSequence);
    // The fused prefill's forward: the prompt's first token, then 3 verify rows.
    assert_eq!(g.target().tails, vec![(4, 3)]);
    assert!(g.target().forwards.is_empty());
}

#[test]
fn c11_a_draft_model_ends_its_draft_at_its_own_eos() {
    let cfg = SamplingConfig::builder().mask(c11_mask()).build().unwrap();
    let mut g = Generator::new(c11_target(), DraftModelProposer::new(c11_target()));
    let params = GenerationParams::builder()
        .sampling(cfg)
        .max_new_tokens(16)
        .stop(StopConditions::eos(3))
        .draft(DraftLength::Fixed(5))
        .build()
        .unwrap();
    let out = g.generate(&[0, 0], &params).unwrap();
    assert_eq!(out.tokens, vec![1, 2, 3]);
    assert_eq!(out.finish, FinishReason::Eos);
}

#[test]
fn c11_verifier_final_draft_ends_needs_no_row_after_it() {
    // Three drafts, the last one an end: two-row... three rows of target logits, no bonus row.
    let logits = [
        0.0f32, 5.0, 0.0, 0.0, // predicts 1
        0.0, 0.0, 5.0, 0.0, // predicts 2
        0.0, 0.0, 0.0, 5.0, // predicts 3
    ];
    let cfg = SamplingConfig::greedy();
    let ends = [false, false, true];
    let chain = |tokens| DraftBlock::chain(tokens).with_ends(&ends);
    let out = Verifier::new()
        .verify(&VerifyRequest::new(&cfg, &logits, 4, &[1, 2, 3]).draft(chain(&[1, 2, 3])))
        .unwrap();
    assert_eq!(out.tokens, vec![1, 2, 3]);
    assert_eq!((out.accepted, out.end), (3, StepEnd::Ended));
    // A rejection before the end emits the correction as usual.
    let out = Verifier::new()
        .verify(&VerifyRequest::new(&cfg, &logits, 4, &[1, 0, 3]).draft(chain(&[1, 0, 3])))
        .unwrap();
    assert_eq!(out.tokens, vec![1, 2]);
    assert_eq!(out.end, StepEnd::Rejected { index: 1 });
    // [k + 1] rows is the wrong shape once the final draft ends the sequence.
    let more = [logits.as_slice(), &[0.0; 4]].concat();
    assert!(matches!(
        Verifier::new()
            .verify(&VerifyRequest::new(&cfg, &more, 4, &[1, 2, 3]).draft(chain(&[1, 2, 3]))),
        Err(Error::ShapeMismatch { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// C12: which tokens the penalties count.

fn c12(cfg: SamplingConfig, n: usize, drafts: usize) -> Vec<u32> {
    let target = ToyModel::new(3, 100, Arc::new(|_: &[u32]| vec![2.0, 1.9, 0.0]));
    let mut g = Generator::new(target, RandomProposer::new(3, 9));
    let params = GenerationParams::builder()
        .sampling(cfg)
        .max_new_tokens(n)
        .draft(DraftLength::Fixed(drafts))
        .build()
        .unwrap();
    g.generate(&[0, 0, 0], &params).unwrap().tokens
}

#[test]
fn c12_frequency_and_presence_count_generated_tokens_repetition_counts_the_prompt() {
    let b = || SamplingConfig::builder();
    for drafts in [0, 1, 3] {
        let freq = b().frequency_penalty(1.0).build().unwrap();
        assert_eq!(c12(freq, 2, drafts), vec![0, 1], "frequency, k = {drafts}");
        let pres = b().presence_penalty(0.5).build().unwrap();
        assert_eq!(c12(pres, 2, drafts), vec![0, 1], "presence, k = {drafts}");
        let rep = b().repetition_penalty(2.0).build().unwrap();
        assert_eq!(c12(rep, 1, drafts), vec![1], "repetition, k = {drafts}");
        // The whole-context scope is an option: the prompt's three 0s now count.
        let whole = b()
            .frequency_penalty(1.0)
            .penalty_scope(PenaltyScope::WholeContext)
            .build()
            .unwrap();
        assert_eq!(
            c12(whole, 1, drafts),
            vec![1],
            "whole context, k = {drafts}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// C14: validation does not depend on the seed.

#[test]
fn c14_draft_outside_the_draft_vocabulary_is_an_error_for_every_seed() {
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    let logits = [0.0f32; 6];
    let q = [1.0f32, 1.0];
    for seed in 0..500 {
        let r = Verifier::new().verify(
            &VerifyRequest::new(&cfg, &logits, 2, &[0, 1])
                .draft_probs(DraftProbs::Probs {
                    probs: &q,
                    vocab: 1,
                })
                .seed(seed),
        );
        assert!(
            matches!(r, Err(Error::TokenOutOfVocab { token: 1, .. })),
            "seed {seed}: {r:?}"
        );
    }
    // Greedy: the draft that q gives probability 0 is not silently accepted.
    let greedy = SamplingConfig::greedy();
    let logits = [0.0f32, 1.0, 0.0, 0.0];
    let r = Verifier::new().verify(&VerifyRequest::new(&greedy, &logits, 2, &[1]).draft_probs(
        DraftProbs::Probs {
            probs: &[1.0],
            vocab: 1,
        },
    ));
    assert!(r.is_err(), "{r:?}");
}

#[test]
fn c14_every_q_row_and_every_logit_row_is_checked_before_any_draw() {
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    // The first draft is almost surely rejected; the faults sit in later rows.
    let mut logits = vec![0.0f32; 3 * 3];
    logits[0] = -20.0;
    let good_q = [1.0f32, 0.0, 0.0];
    let bad_rows: Vec<(Vec<f32>, Vec<f32>)> = vec![
        // q row 1 does not sum to 1.
        (logits.clone(), [good_q, [0.5, 0.2, 0.0]].concat()),
        // q row 1 gives its own draft probability 0.
        (logits.clone(), [good_q, [0.0, 0.0, 1.0]].concat()),
        // A NaN in the bonus row.
        (
            {
                let mut l = logits.clone();
                l[7] = f32::NAN;
                l
            },
            [good_q, good_q].concat(),
        ),
    ];
    for (l, q) in &bad_rows {
        let errors: Vec<bool> = (0..200)
            .map(|seed| {
                Verifier::new()
                    .verify(
                        &VerifyRequest::new(&cfg, l, 3, &[0, 0])
                            .draft_probs(DraftProbs::Probs { probs: q, vocab: 3 })
                            .seed(seed),
                    )
                    .is_err()
            })
            .collect();
        assert!(errors.iter().all(|&e| e), "some seeds passed: {q:?}");
    }
    // Draft logits are processed in full too: row 1's draft is banned by its own logits.
    let ql = [0.0f32, 0.0, 0.0, f32::NEG_INFINITY, 0.0, 0.0];
    for seed in 0..100 {
        let r = Verifier::new().verify(
            &VerifyRequest::new(&cfg, &logits, 3, &[0, 0])
                .draft_probs(DraftProbs::Logits {
                    logits: &ql,
                    vocab: 3,
                })
                .seed(seed),
        );
        assert!(
            matches!(r, Err(Error::InvalidDraftProbs { row: 1, .. })),
            "seed {seed}: {r:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// C15: a seed reproduces its output, whatever the drafts.

fn c15_target() -> ToyModel {
    ToyModel::new(
        8,
        1000,
        Arc::new(|p: &[u32]| {
            let last = *p.last().unwrap() as usize;
            let n = p.len();
            (0..8)
                .map(|v| {
                    if v == (last + 1) % 6 {
                        2.5
                    } else {
                        ((v * 7 + last * 3 + n) % 5) as f32 * 0.4
                    }
                })
                .collect()
        }),
    )
}

const C15_PROMPT: [u32; 14] = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1];

fn c15_config() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(1.0)
        .top_p(0.9)
        .build()
        .unwrap()
}

/// Plain sampling, written out: at each position, process the target's row and take the token
/// whose id-ordered CDF interval holds the seed's SAMPLE-lane uniform for that position.
fn plain_sampling(seed: u64, n: usize) -> Vec<u32> {
    let model = c15_target();
    let cfg = c15_config();
    let mut ctx = C15_PROMPT.to_vec();
    let mut d = TokenDist::default();
    let mut proc = RowProcessor::new();
    for _ in 0..n {
        let logits = model.logits(&ctx);
        proc.distribution(
            &cfg,
            &logits,
            &History::default(),
            RowKind::Target,
            0,
            &mut d,
        )
        .unwrap();
        let u = Stream::new(seed).uniform(ctx.len() as u64, lane::SAMPLE);
        ctx.push(d.sample(u).unwrap());
    }
    ctx[C15_PROMPT.len()..].to_vec()
}

#[test]
fn c15_seeded_output_is_the_same_for_every_draft_length_policy_and_proposer() {
    let expected = plain_sampling(42, 48);
    let params = |draft| {
        GenerationParams::builder()
            .sampling(c15_config())
            .seed(42)
            .max_new_tokens(48)
            .draft(draft)
            .build()
            .unwrap()
    };
    let mut g = Generator::new(c15_target(), PromptLookup::new(1, 3).unwrap());
    let policies = [
        DraftLength::Off,
        DraftLength::Fixed(1),
        DraftLength::Fixed(2),
        DraftLength::Fixed(4),
        DraftLength::Adaptive(AdaptiveConfig::default()),
    ];
    for draft in policies {
        let out = g.generate(&C15_PROMPT, &params(draft.clone())).unwrap();
        assert_eq!(out.tokens, expected, "{draft:?}");
    }
    // After another request on the same generator (its proposer and policy state changed).
    let _ = g
        .generate(
            &[7, 7, 6, 5, 4],
            &GenerationParams::sampled(c15_config(), 3, 30),
        )
        .unwrap();
    let out = g
        .generate(
            &C15_PROMPT,
            &params(DraftLength::Adaptive(AdaptiveConfig::default())),
        )
        .unwrap();
    assert_eq!(out.tokens, expected, "after another request");
    // Other point-mass proposers.
    let mut g = Generator::new(
        c15_target(),
        SuffixProposer::new(Default::default()).unwrap(),
    );
    assert_eq!(
        g.generate(&C15_PROMPT, &params(DraftLength::Fixed(4)))
            .unwrap()
            .tokens,
        expected
    );
    let mut g = Generator::new(c15_target(), RandomProposer::new(8, 1));
    assert_eq!(
        g.generate(&C15_PROMPT, &params(DraftLength::Fixed(3)))
            .unwrap()
            .tokens,
        expected
    );
    let mut g = Generator::new(c15_target(), NoProposer);
    assert_eq!(
        g.generate(&C15_PROMPT, &params(DraftLength::Fixed(4)))
            .unwrap()
            .tokens,
        expected
    );
    // A different seed gives a different sequence (the test can fail).
    assert_ne!(plain_sampling(43, 48), expected);
}

// ---------------------------------------------------------------------------------------------
// min_tokens: EOS suppressed at every target and draft row until min_tokens are generated.

#[test]
fn min_tokens_suppresses_eos_at_every_draft_position() {
    // The target prefers EOS (2) everywhere; next best is (len % 5) + 3.
    let target = || {
        ToyModel::new(
            8,
            100,
            Arc::new(|p: &[u32]| {
                let alt = (p.len() % 5) + 3;
                (0..8)
                    .map(|v| match v {
                        2 => 9.0,
                        v if v == alt => 5.0,
                        _ => 0.0,
                    })
                    .collect()
            }),
        )
    };
    // Plain greedy with EOS banned for the first 6 tokens.
    let mut expected = Vec::new();
    let prompt = [1u32, 1];
    let mut ctx = prompt.to_vec();
    for i in 0..7 {
        let t = if i < 6 { (ctx.len() % 5) as u32 + 3 } else { 2 };
        expected.push(t);
        ctx.push(t);
    }
    for k in 0..=5 {
        // Drafts that put EOS at every position.
        let scripted: Vec<Vec<u32>> = (0..8)
            .map(|s| {
                (0..k)
                    .map(|j| if (j + s) % 3 == 0 { 2 } else { 3 })
                    .collect()
            })
            .collect();
        let mut g = Generator::new(target(), ScriptedProposer::new(scripted));
        let params = GenerationParams::builder()
            .max_new_tokens(20)
            .min_tokens(6)
            .stop(StopConditions::eos(2))
            .draft(DraftLength::Fixed(k))
            .build()
            .unwrap();
        let out = g.generate(&prompt, &params).unwrap();
        assert_eq!(out.tokens, expected, "k = {k}");
        assert_eq!(out.finish, FinishReason::Eos);
    }
    // Sampled, with a draft model that would draft EOS: never before min_tokens.
    for seed in 0..20 {
        let mut g = Generator::new(target(), DraftModelProposer::new(target()));
        let params = GenerationParams::builder()
            .sampling(SamplingConfig::sampling(1.0).unwrap())
            .seed(seed)
            .max_new_tokens(20)
            .min_tokens(6)
            .stop(StopConditions::eos(2))
            .draft(DraftLength::Fixed(4))
            .build()
            .unwrap();
        let out = g.generate(&prompt, &params).unwrap();
        assert!(out.tokens.len() >= 7, "{:?}", out.tokens);
        assert!(!out.tokens[..6].contains(&2), "{:?}", out.tokens);
    }
    // min_tokens above the budget is a typed error naming the field, when the parameters are
    // built (the setter and the builder alike).
    for e in [
        GenerationParams::greedy(4).with_min_tokens(5).unwrap_err(),
        GenerationParams::builder()
            .max_new_tokens(4)
            .min_tokens(5)
            .build()
            .unwrap_err(),
    ] {
        assert!(matches!(
            e,
            Error::InvalidConfig {
                field: "min_tokens",
                ..
            }
        ));
    }
}

// ---------------------------------------------------------------------------------------------
// Stop strings.

/// Token t decodes to a fixed piece of text (several characters, or one byte of a 2-byte
/// character).
struct Pieces;

const PIECES: [&str; 8] = ["ab", "c", "<e", "nd>", "x", " ", "\u{e9}", "yz"];

impl Detokenizer for Pieces {
    fn decode(&self, tokens: &[u32]) -> Result<String> {
        Ok(tokens.iter().map(|&t| PIECES[t as usize % 8]).collect())
    }
}

/// A target that walks a fixed script of tokens.
fn script_target(script: &'static [u32]) -> ToyModel {
    ToyModel::deterministic(8, 200, move |p: &[u32]| {
        script[(p.len() - 1) % script.len()]
    })
}

#[test]
fn stop_strings_across_tokens_and_steps_are_never_streamed_when_excluded() {
    // Text: "ab" "x" "c" "<e" "nd>" "yz" ... the stop "c<end>" spans three tokens.
    static SCRIPT: [u32; 8] = [0, 4, 1, 2, 3, 7, 4, 4];
    let prompt = [0u32];
    for k in [0usize, 1, 2, 4] {
        for include in [false, true] {
            let mut g = Generator::new(script_target(&SCRIPT), PromptLookup::new(1, 3).unwrap())
                .with_detokenizer(Pieces);
            let params = GenerationParams::builder()
                .max_new_tokens(30)
                .stop(
                    StopConditions::default()
                        .with_stop_string("c<end>")
                        .include_stop_string(include),
                )
                .draft(DraftLength::Fixed(k))
                .build()
                .unwrap();
            let mut streamed = String::new();
            let mut held_back_ok = true;
            let out = g
                .generate_stream(&prompt, &params, |c| {
                    streamed.push_str(c.text);
                    // "c" could start the stop string: it is held back until it cannot.
                    held_back_ok &= include || !streamed.contains('c');
                    ControlFlow::Continue(())
                })
                .unwrap();
            // Tokens up to the one completing the stop string ("nd>").
            assert_eq!(out.tokens, vec![0, 4, 1, 2, 3], "k = {k}");
            assert_eq!(out.finish, FinishReason::StopString);
            let want = if include { "abxc<end>" } else { "abx" };
            assert_eq!(out.text.as_deref(), Some(want));
            assert_eq!(streamed, want, "k = {k}, include = {include}");
            assert!(held_back_ok);
        }
    }
    // Stop strings without a detokenizer are refused before any work.
    let mut g = Generator::new(CallLog::new(script_target(&SCRIPT)), NoProposer);
    let params = GenerationParams::greedy(5)
        .with_stop(StopConditions::default().with_stop_string("x"))
        .unwrap();
    let e = g.generate(&prompt, &params).unwrap_err();
    assert!(
        matches!(e.error, Error::InvalidConfig { .. }),
        "{}",
        e.error
    );
    assert!(g.target().forwards.is_empty() && g.target().prefills.is_empty());
}

#[test]
fn text_streams_whole_characters_and_equals_the_final_text() {
    // "é" is one token here; "yz" "é" " " "ab" ...
    static SCRIPT: [u32; 5] = [7, 6, 5, 0, 6];
    let mut g = Generator::new(script_target(&SCRIPT), PromptLookup::new(1, 2).unwrap())
        .with_detokenizer(Pieces);
    let mut streamed = String::new();
    let out = g
        .generate_stream(&[7], &GenerationParams::greedy(12), |c| {
            streamed.push_str(c.text);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(out.text.as_deref(), Some(streamed.as_str()));
    assert_eq!(
        streamed,
        Pieces.decode(&out.tokens).unwrap(),
        "streamed text is the decode of the tokens"
    );
}

// ---------------------------------------------------------------------------------------------
// Faults: typed errors with every emitted token, KV cache consistent, next run equals a fresh run.

/// Fails the `n`-th call (1-based) of the chosen kind.
struct Faulty<M> {
    inner: M,
    fail_forward: Option<usize>,
    fail_truncate: Option<usize>,
    forwards: usize,
    truncates: usize,
}

impl<M> Faulty<M> {
    fn new(inner: M, fail_forward: Option<usize>, fail_truncate: Option<usize>) -> Self {
        Faulty {
            inner,
            fail_forward,
            fail_truncate,
            forwards: 0,
            truncates: 0,
        }
    }
}

#[derive(Debug)]
struct Boom;
impl std::fmt::Display for Boom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("injected fault")
    }
}
impl std::error::Error for Boom {}

impl<M: TargetModel> TargetModel for Faulty<M> {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.forwards += 1;
        if Some(self.forwards) == self.fail_forward {
            // Fail half-way: the engine appended part of the tokens.
            let mut l = Vec::new();
            self.inner
                .forward(&tokens[..tokens.len().div_ceil(2)], &mut l)?;
            return Err(Error::model(Boom));
        }
        self.inner.forward(tokens, logits)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.truncates += 1;
        if Some(self.truncates) == self.fail_truncate {
            return Err(Error::model(Boom));
        }
        self.inner.truncate(len)
    }
}

/// A proposer that fails at its `n`-th proposal.
struct FailingProposer<P> {
    inner: P,
    n: usize,
    calls: usize,
}

impl<P: Proposer> Proposer for FailingProposer<P> {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.calls += 1;
        if self.calls == self.n {
            return Err(Error::proposer(Boom));
        }
        self.inner.propose(req, draft)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.inner.begin(prompt)
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.inner.observe(accepted, emitted)
    }
}

fn fault_params() -> GenerationParams {
    GenerationParams::builder()
        .sampling(c15_config())
        .seed(7)
        .max_new_tokens(40)
        .draft(DraftLength::Fixed(3))
        .build()
        .unwrap()
}

/// Runs `g` (whose fault fires during the first generation), checks the error and the partial
/// output against `fresh` (a run of the same proposer kind without faults), then checks that
/// the next generation equals it.
fn check_fault<T: TargetModel, P: Proposer>(
    mut g: Generator<T, P>,
    fresh: speculative::decode::Generation,
    what: &str,
) {
    let mut streamed = Vec::new();
    let e = g
        .generate_with(&C15_PROMPT, &fault_params(), |t| {
            streamed.extend_from_slice(t);
            ControlFlow::Continue(())
        })
        .unwrap_err();
    assert!(
        matches!(e.error, Error::Model(_) | Error::Proposer(_)),
        "{what}: {}",
        e.error
    );
    assert_eq!(e.partial.finish, FinishReason::Error, "{what}");
    assert_eq!(e.partial.tokens, streamed, "{what}: streamed tokens kept");
    assert!(
        !streamed.is_empty(),
        "{what}: the fault fired after some steps"
    );
    assert_eq!(
        &fresh.tokens[..streamed.len()],
        &streamed[..],
        "{what}: emitted tokens are the run's tokens"
    );
    let again = g.generate(&C15_PROMPT, &fault_params()).unwrap();
    assert_eq!(again.tokens, fresh.tokens, "{what}: next generation");
}

#[test]
fn faults_return_every_emitted_token_and_leave_the_generator_usable() {
    let lookup = || PromptLookup::new(1, 3).unwrap();
    let fresh = || {
        Generator::new(c15_target(), lookup())
            .generate(&C15_PROMPT, &fault_params())
            .unwrap()
    };
    check_fault(
        Generator::new(Faulty::new(c15_target(), Some(4), None), lookup()),
        fresh(),
        "forward",
    );
    // Truncate call 1 is the session's reset; 4 is a step's rollback.
    check_fault(
        Generator::new(Faulty::new(c15_target(), None, Some(4)), lookup()),
        fresh(),
        "truncate",
    );
    check_fault(
        Generator::new(
            c15_target(),
            FailingProposer {
                inner: lookup(),
                n: 3,
                calls: 0,
            },
        ),
        fresh(),
        "proposer",
    );
    let fresh_draft_model = Generator::new(c15_target(), DraftModelProposer::new(c15_target()))
        .generate(&C15_PROMPT, &fault_params())
        .unwrap();
    check_fault(
        Generator::new(
            c15_target(),
            DraftModelProposer::new(Faulty::new(c15_target(), Some(5), None)),
        ),
        fresh_draft_model,
        "draft model",
    );
    // After a failing forward the target holds exactly the emitted tokens but the last.
    let mut g = Generator::new(Faulty::new(c15_target(), Some(3), None), lookup());
    let e = g.generate(&C15_PROMPT, &fault_params()).unwrap_err();
    assert_eq!(
        g.target().seq_len(),
        C15_PROMPT.len() + e.partial.tokens.len() - 1
    );
}

// ---------------------------------------------------------------------------------------------
// New-user faults.

#[test]
fn default_params_are_valid() {
    let mut g = Generator::new(ToyModel::c10(), PromptLookup::new(1, 3).unwrap());
    let out = g
        .generate(&[1, 2, 3], &GenerationParams::builder().build().unwrap())
        .unwrap();
    assert_eq!(out.tokens.len(), 256);
    assert!(SamplingConfig::default().is_greedy());
}

/// A proposer that returns whatever it was built with, ignoring the request.
struct Rogue(Draft);
impl Proposer for Rogue {
    fn propose(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        *draft = self.0.clone();
        Ok(())
    }
    fn name(&self) -> &'static str {
        "rogue"
    }
}

#[test]
fn a_bad_proposal_never_reaches_the_target() {
    let drafts = [
        Draft::chain(vec![1, 99]),
        Draft::chain(vec![1, 2, 3, 4, 5, 6]),
        Draft::chain(vec![1]).with_q(vec![1.0; 3], 2),
    ];
    for d in drafts {
        let mut g = Generator::new(CallLog::new(ToyModel::c10()), Rogue(d.clone()));
        let e = g
            .generate(&[1, 2], &GenerationParams::greedy(8))
            .unwrap_err();
        assert!(
            matches!(
                e.error,
                Error::InvalidProposal {
                    proposer: "rogue",
                    ..
                }
            ),
            "{d:?}: {}",
            e.error
        );
        assert!(e.error.to_string().contains("rogue"));
        assert!(g.target().forwards.is_empty(), "{d:?} reached the target");
    }
}
