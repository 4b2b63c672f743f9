//! Verifying logits an engine already has: the verifier alone, no model, no decoding loop.
//!
//! Your engine ran the target model over `[last token, d_1 .. d_k]` and holds its logits
//! `[k + 1, vocab]`; this example hands them to [`Verifier::verify`] as a plain `&[f32]` slice:
//!
//! 1. greedy verification of point-mass drafts (a proposer without probabilities, such as prompt
//!    lookup), with log-probabilities and the top alternatives of every emitted token;
//! 2. sampled verification of the same drafts for a few seeds, checking that every emitted token
//!    is the token plain sampling with that seed draws at that position (point-mass drafts are
//!    seed-reproducible, case C15 in the `verify` module docs);
//! 3. sampled verification of drafts that a draft model sampled from dense probabilities q
//!    (`DraftProbs::Probs`), checking that handing over the raw draft logits instead
//!    (`DraftProbs::Logits`) gives the same result.
//!
//! It prints, per case, the accepted count, the emitted tokens as words and their
//! log-probabilities, and asserts each of those facts (a failed check exits non-zero).
//!
//! Run: `cargo run --example verify_logits`

use std::error::Error;
use std::io::Write;

use speculative::rng::{Stream, lane};
use speculative::sampling::{History, RowProcessor, TokenDist};
use speculative::{
    DraftProbs, RowKind, SamplingConfig, StepEnd, StepOutput, TokenLogprob, Verifier, VerifyRequest,
};

/// A toy vocabulary, so that tokens print as words.
const WORDS: [&str; 8] = ["<eos>", "the", "cat", "sat", "on", "a", "mat", "."];
const VOCAB: usize = WORDS.len();

/// The tokens before the block: "the cat sat".
const CONTEXT: [u32; 3] = [1, 2, 3];

/// Target logits `[k + 1, vocab]` of one verify forward over `[sat, on, a, mat]` (k = 3):
/// row `i` predicts the token after `d_i` (row 0: after "sat").
#[rustfmt::skip]
const TARGET: [f32; 4 * VOCAB] = [
//  <eos>  the   cat   sat   on    a     mat   .
    -2.0,  0.5, -1.0, -1.0,  3.0,  0.0, -1.0, -1.0, // after "sat": "on"
    -2.0,  2.0, -1.0, -1.0, -2.0,  1.5, -1.0, -2.0, // after "on": "the", then "a"
    -2.0, -1.0,  1.0, -1.0, -2.0, -2.0,  2.5, -1.0, // after "a": "mat", then "cat"
     0.5, -1.0, -2.0, -2.0, -1.0, -2.0, -2.0,  3.0, // after "mat": "."
];

/// Draft-model logits `[k, vocab]`: the draft model's rows for the same positions.
#[rustfmt::skip]
const DRAFT: [f32; 3 * VOCAB] = [
    -2.0,  0.0, -1.0, -1.0,  2.5,  0.5, -1.0, -1.0,
    -2.0,  1.0, -1.0, -1.0, -2.0,  2.0, -1.0, -2.0,
    -2.0, -1.0,  0.5, -1.0, -2.0, -2.0,  2.0, -1.0,
];

fn main() -> Result<(), Box<dyn Error>> {
    run(&mut std::io::stdout().lock())
}

/// Runs the three cases, writing the report to `out`. Panics when a checked fact fails.
pub fn run(out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let mut verifier = Verifier::new();
    // Point-mass drafts, as prompt lookup would propose them: "on a mat".
    let drafts = [4u32, 5, 6];

    // 1. Greedy, with the 2 most likely alternatives of every emitted token.
    let greedy = SamplingConfig::builder().logprobs(2).build()?;
    let step =
        verifier.verify(&VerifyRequest::new(&greedy, &TARGET, VOCAB, &drafts).context(&CONTEXT))?;
    writeln!(out, "context: {}", words(&CONTEXT))?;
    writeln!(out, "drafts:  {} (point masses)", words(&drafts))?;
    writeln!(out, "greedy: {}", summary(&step, drafts.len()))?;
    print_logprobs(out, step.logprobs.as_deref())?;
    // "on" is the argmax of row 0 (accepted); row 1's argmax is "the", not "a": rejected, and
    // the argmax is emitted in its place.
    assert_eq!(step.tokens, [4, 1]);
    assert_eq!(step.accepted, 1);
    assert_eq!(step.end, StepEnd::Rejected { index: 1 });

    // 2. Sampled, same point-mass drafts, several seeds.
    let sampled = SamplingConfig::builder()
        .temperature(0.9)
        .top_p(0.95)
        .logprobs(2)
        .build()?;
    for seed in 0..5u64 {
        let step = verifier.verify(
            &VerifyRequest::new(&sampled, &TARGET, VOCAB, &drafts)
                .context(&CONTEXT)
                .seed(seed),
        )?;
        writeln!(
            out,
            "sampled, point-mass drafts, seed {seed}: {}",
            summary(&step, drafts.len())
        )?;
        check_step(&step, drafts.len());
        if seed == 0 {
            print_logprobs(out, step.logprobs.as_deref())?;
        }
        // Case C15: each emitted token is what plain sampling (a step with no draft) draws at
        // that position with the same seed. Row i follows the context plus drafts[..i], which
        // are exactly the tokens emitted before it.
        for (i, &token) in step.tokens.iter().enumerate() {
            let mut prefix = CONTEXT.to_vec();
            prefix.extend_from_slice(&step.tokens[..i]);
            let plain = verifier.verify(
                &VerifyRequest::new(&sampled, row(&TARGET, i), VOCAB, &[])
                    .context(&prefix)
                    .seed(seed),
            )?;
            assert_eq!(plain.tokens, [token], "seed {seed}, position {i}");
        }
    }
    writeln!(
        out,
        "every sampled token equals plain sampling's token at its position and seed"
    )?;

    // 3. Dense q: a draft model sampled each d_i from its processed row q_i (the same
    // configuration as the target; here the rows do not depend on the drafts, a real draft
    // model's row i would follow d_1 .. d_i).
    let mut proc = RowProcessor::new();
    let mut dist = TokenDist::default();
    let mut accepted_total = 0;
    for seed in 0..5u64 {
        let stream = Stream::new(seed);
        let position = CONTEXT.len() as u64;
        let mut q = Vec::with_capacity(DRAFT.len());
        let mut sampled_drafts = Vec::new();
        for i in 0..3 {
            let hist = History::default(); // no penalties and no mask in this configuration
            proc.distribution(
                &sampled,
                row(&DRAFT, i),
                &hist,
                RowKind::Draft,
                i,
                &mut dist,
            )?;
            q.extend(dense(&dist));
            let u = stream.uniform(position + i as u64, lane::DRAFT);
            sampled_drafts.push(dist.sample(u).expect("a processed row is never empty"));
        }
        let request = VerifyRequest::new(&sampled, &TARGET, VOCAB, &sampled_drafts)
            .context(&CONTEXT)
            .seed(seed);
        let with_probs = verifier.verify(&request.draft_probs(DraftProbs::Probs {
            probs: &q,
            vocab: VOCAB,
        }))?;
        let with_logits = verifier.verify(&request.draft_probs(DraftProbs::Logits {
            logits: &DRAFT,
            vocab: VOCAB,
        }))?;
        writeln!(
            out,
            "sampled, dense-q drafts {}, seed {seed}: {}",
            words(&sampled_drafts),
            summary(&with_probs, sampled_drafts.len())
        )?;
        check_step(&with_probs, sampled_drafts.len());
        if seed == 0 {
            print_logprobs(out, with_probs.logprobs.as_deref())?;
        }
        // The verifier processes raw draft logits exactly as the draft model did.
        assert_eq!(with_probs, with_logits);
        accepted_total += with_probs.accepted;
    }
    writeln!(
        out,
        "dense q given as probabilities or as raw draft logits: identical results"
    )?;
    writeln!(
        out,
        "dense-q drafts accepted over 5 seeds: {accepted_total} of 15"
    )?;
    Ok(())
}

/// Row `i` of a `[rows, VOCAB]` array.
fn row(logits: &[f32], i: usize) -> &[f32] {
    &logits[i * VOCAB..(i + 1) * VOCAB]
}

/// A processed distribution as a dense row `[VOCAB]` (0 outside its support).
fn dense(dist: &TokenDist) -> Vec<f32> {
    let mut q = vec![0.0; VOCAB];
    for (&id, &p) in dist.ids().iter().zip(dist.probs()) {
        q[id as usize] = p;
    }
    q
}

fn words(tokens: &[u32]) -> String {
    let w: Vec<&str> = tokens.iter().map(|&t| WORDS[t as usize]).collect();
    format!("[{}]", w.join(" "))
}

fn summary(step: &StepOutput, k: usize) -> String {
    format!(
        "accepted {} of {k}, emitted {}, {:?}",
        step.accepted,
        words(&step.tokens),
        step.end
    )
}

/// The invariants of every step: the accepted drafts plus one correction or bonus token, and
/// one log-probability per emitted token (the configurations ask for them).
fn check_step(step: &StepOutput, k: usize) {
    assert!(step.accepted <= k);
    assert_eq!(step.tokens.len(), step.accepted + 1);
    let logprobs = step.logprobs.as_ref().expect("logprobs were requested");
    assert_eq!(logprobs.len(), step.tokens.len());
    for (lp, &t) in logprobs.iter().zip(&step.tokens) {
        assert_eq!(lp.token, t);
        assert!(lp.logprob <= 0.0 && lp.logprob.is_finite());
    }
}

fn print_logprobs(out: &mut dyn Write, logprobs: Option<&[TokenLogprob]>) -> std::io::Result<()> {
    for lp in logprobs.unwrap_or_default() {
        let top: Vec<String> = lp
            .top
            .iter()
            .map(|&(t, l)| format!("{} {l:.3}", WORDS[t as usize]))
            .collect();
        writeln!(
            out,
            "  {:>5} logprob {:.3}, top: {}",
            WORDS[lp.token as usize],
            lp.logprob,
            top.join(", ")
        )?;
    }
    Ok(())
}
