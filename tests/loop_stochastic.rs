//! The distribution of complete generated sequences equals plain sampling from the processed
//! target, for every proposer kind.
//!
//! Method (GUIDE section 2): vocab 4, 3 new tokens, so the 64 possible outputs are enumerable and
//! their exact probabilities are products of processed target conditionals. Each test runs
//! `N` seeded generations (seed = run index) and applies a G-test (likelihood-ratio chi-square)
//! of the observed counts against the exact probabilities. Significance: alpha = 1e-3; a test
//! passes when p > alpha. A negative control (a draft whose q is the raw, unprocessed draft
//! distribution while it samples from the processed one) runs through the same test and must be
//! rejected (p < alpha). Outputs with exact probability 0 must never be observed.

use speculative::decode::{DraftLength, GenerationParams, Generator};
use speculative::propose::{
    DraftHeads, DraftModelProposer, HeadsInput, HeadsProposer, PromptLookup, SuffixConfig,
    SuffixProposer,
};
use speculative::sampling::{History, RowProcessor, TokenCounts, TokenDist};
use speculative::test_util::{RandomProposer, ToyModel};
use speculative::{Draft, ProposeRequest, Proposer, Result, RowKind, SamplingConfig, TargetModel};
use statrs::distribution::{ChiSquared, ContinuousCDF};

const ALPHA: f64 = 1e-3;
const VOCAB: usize = 4;
const LEN: usize = 3;
const N: u64 = 12_000;
const PROMPT: [u32; 10] = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1];

fn target() -> ToyModel {
    ToyModel::markov(VOCAB, 2, 1.2, 11)
}

fn draft_model() -> ToyModel {
    ToyModel::markov(VOCAB, 2, 1.2, 23)
}

/// Exact processed conditional of the target after `prefix`.
fn conditional(cfg: &SamplingConfig, prefix: &[u32]) -> TokenDist {
    let logits = target().logits(prefix);
    // Frequency / presence penalties count generated tokens only (the loop passes the prompt
    // length); the repetition penalty counts the prompt too.
    let counts = TokenCounts::from_context(prefix, PROMPT.len(), VOCAB).unwrap();
    let mut d = TokenDist::default();
    RowProcessor::new()
        .distribution(
            cfg,
            &logits,
            &History {
                counts: Some(&counts),
                prefix,
                suppress: &[],
            },
            RowKind::Target,
            0,
            &mut d,
        )
        .unwrap();
    d
}

fn exact(cfg: &SamplingConfig) -> Vec<f64> {
    let mut probs = vec![0.0; VOCAB.pow(LEN as u32)];
    for (cell, p) in probs.iter_mut().enumerate() {
        let mut ctx = PROMPT.to_vec();
        let mut pr = 1.0f64;
        for j in 0..LEN {
            let t = (cell / VOCAB.pow((LEN - 1 - j) as u32)) % VOCAB;
            pr *= conditional(cfg, &ctx).prob(t as u32) as f64;
            ctx.push(t as u32);
        }
        *p = pr;
    }
    probs
}

/// G-test p-value of `counts` against `probs`; panics if an impossible cell was observed.
fn g_test(counts: &[u64], probs: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    let mut g = 0.0;
    let mut cells = 0;
    for (&c, &p) in counts.iter().zip(probs) {
        if p == 0.0 {
            assert_eq!(c, 0, "an output with probability 0 was generated");
            continue;
        }
        cells += 1;
        if c > 0 {
            g += 2.0 * c as f64 * (c as f64 / (n as f64 * p)).ln();
        }
    }
    ChiSquared::new((cells - 1) as f64).unwrap().sf(g)
}

fn sequence_counts<P: Proposer, T: TargetModel>(
    mut g: Generator<T, P>,
    cfg: &SamplingConfig,
    k: usize,
) -> Vec<u64> {
    let mut counts = vec![0u64; VOCAB.pow(LEN as u32)];
    for seed in 0..N {
        let params = GenerationParams::builder()
            .sampling(cfg.clone())
            .seed(seed)
            .max_new_tokens(LEN)
            .draft(DraftLength::Fixed(k))
            .build()
            .unwrap();
        let out = g.generate(&PROMPT, &params).unwrap();
        assert_eq!(out.tokens.len(), LEN);
        let cell = out
            .tokens
            .iter()
            .fold(0usize, |a, &t| a * VOCAB + t as usize);
        counts[cell] += 1;
    }
    counts
}

fn configs() -> Vec<(&'static str, SamplingConfig)> {
    vec![
        ("t=1", SamplingConfig::sampling(1.0).unwrap()),
        (
            "t=0.7 top_p=0.9 top_k=3",
            SamplingConfig::builder()
                .temperature(0.7)
                .top_p(0.9)
                .top_k(3)
                .build()
                .unwrap(),
        ),
        (
            "min_p=0.2 repetition=1.5",
            SamplingConfig::builder()
                .temperature(1.0)
                .min_p(0.2)
                .repetition_penalty(1.5)
                .build()
                .unwrap(),
        ),
    ]
}

fn check<P: Proposer, T: TargetModel>(name: &str, make: impl Fn() -> Generator<T, P>, k: usize) {
    for (cname, cfg) in configs() {
        let counts = sequence_counts(make(), &cfg, k);
        let p = g_test(&counts, &exact(&cfg));
        eprintln!("{name} with {cname}: p = {p:.3}");
        assert!(p > ALPHA, "{name} with {cname}: p = {p:.2e} <= alpha");
    }
}

#[test]
fn plain_sampling_matches_exact() {
    check(
        "no proposer",
        || Generator::new(target(), speculative::NoProposer),
        0,
    );
}

#[test]
fn draft_model_is_lossless() {
    check(
        "draft model",
        || Generator::new(target(), DraftModelProposer::new(draft_model())),
        3,
    );
}

#[test]
fn point_mass_proposers_are_lossless() {
    check(
        "prompt lookup",
        || Generator::new(target(), PromptLookup::new(1, 3).unwrap()),
        3,
    );
    check(
        "random",
        || Generator::new(target(), RandomProposer::new(VOCAB, 3)),
        2,
    );
    check(
        "suffix",
        || {
            Generator::new(
                target(),
                SuffixProposer::new(SuffixConfig::default()).unwrap(),
            )
        },
        3,
    );
}

/// The target with a 1-wide "hidden state" (the input token) for a heads proposer.
struct WithHidden(ToyModel, Vec<f32>);
impl TargetModel for WithHidden {
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn max_context(&self) -> usize {
        1 << 20
    }
    fn seq_len(&self) -> usize {
        self.0.seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.0.forward(tokens, logits)?;
        self.1 = tokens.iter().map(|&t| t as f32).collect();
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.0.truncate(len)
    }
    fn hidden_states(&self) -> Option<&dyn speculative::HiddenStates> {
        Some(self)
    }
}

impl speculative::HiddenStates for WithHidden {
    fn hidden_size(&self) -> usize {
        1
    }
    fn last_hidden(&self) -> Option<&[f32]> {
        Some(&self.1)
    }
}

struct SynthHeads;
impl DraftHeads for SynthHeads {
    fn num_heads(&self) -> usize {
        3
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn hidden_size(&self) -> usize {
        1
    }
    fn logits(&mut self, input: &HeadsInput<'_>, n: usize, logits: &mut Vec<f32>) -> Result<()> {
        let hidden = input.hidden;
        logits.clear();
        for j in 0..n {
            for v in 0..VOCAB {
                logits.push(((hidden[0] as usize * 3 + j * 5 + v * 7) % 4) as f32 * 0.8);
            }
        }
        Ok(())
    }
}

#[test]
fn heads_proposer_is_lossless() {
    check(
        "heads",
        || {
            Generator::new(
                WithHidden(target(), Vec::new()),
                HeadsProposer::new(SynthHeads),
            )
        },
        3,
    );
}

/// The fault of case C05 inside the loop: the draft samples from the processed q but hands the
/// verifier the raw softmax of its logits.
struct RawQ(DraftModelProposer<ToyModel>, ToyModel);
impl Proposer for RawQ {
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.0.begin(prompt)
    }
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.propose(req, draft)?;
        let raw = SamplingConfig::sampling(1.0).unwrap();
        let mut ctx = req.context.to_vec();
        let mut q = Vec::new();
        for &t in &draft.tokens {
            let mut d = TokenDist::default();
            RowProcessor::new()
                .distribution(
                    &raw,
                    &self.1.logits(&ctx),
                    &History::default(),
                    RowKind::Draft,
                    0,
                    &mut d,
                )
                .unwrap();
            q.extend((0..VOCAB as u32).map(|v| d.prob(v)));
            ctx.push(t);
        }
        if draft.q.is_some() {
            draft.q = Some(q);
        }
        Ok(())
    }
}

#[test]
fn negative_control_raw_q_is_rejected() {
    let cfg = SamplingConfig::builder()
        .temperature(0.7)
        .top_p(0.9)
        .top_k(2)
        .build()
        .unwrap();
    let counts = sequence_counts(
        Generator::new(
            target(),
            RawQ(DraftModelProposer::new(draft_model()), draft_model()),
        ),
        &cfg,
        3,
    );
    // Raw q can put drafts' rejection mass on tokens outside the processed support, so the
    // zero-probability assertion is part of what may fire; count that as a rejection too.
    let probs = exact(&cfg);
    let impossible = counts.iter().zip(&probs).any(|(&c, &p)| p == 0.0 && c > 0);
    let p = if impossible {
        0.0
    } else {
        g_test(&counts, &probs)
    };
    eprintln!("negative control: impossible outputs seen: {impossible}, p = {p:.3e}");
    assert!(p < ALPHA, "the faulty q was not detected: p = {p:.3}");
}

#[test]
fn negative_control_wrong_target_is_rejected() {
    // Sampling plainly from an unprocessed target (temperature 1, no filters) while the exact
    // distribution is the processed one.
    let cfg = SamplingConfig::builder()
        .temperature(0.7)
        .top_p(0.9)
        .top_k(3)
        .build()
        .unwrap();
    let counts = sequence_counts(
        Generator::new(target(), speculative::NoProposer),
        &SamplingConfig::sampling(1.0).unwrap(),
        0,
    );
    let probs = exact(&cfg);
    let impossible = counts.iter().zip(&probs).any(|(&c, &p)| p == 0.0 && c > 0);
    let p = if impossible {
        0.0
    } else {
        g_test(&counts, &probs)
    };
    eprintln!("negative control: impossible outputs seen: {impossible}, p = {p:.3e}");
    assert!(
        p < ALPHA,
        "the unprocessed target was not detected: p = {p:.3}"
    );
}
