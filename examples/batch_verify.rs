//! Verifying a batch of sequences in one call, as an engine with continuous batching does.
//!
//! Shows [`Verifier::verify_batch`] on five sequences with ragged draft lengths (k = 3, 0, 2, 1,
//! 2) flattened by offsets, each with its own sampling configuration, seed and context
//! ([`SequenceParams`] builders), one of them malformed.
//!
//! It prints each sequence's configuration and result (accepted count, emitted tokens, end, or
//! its error), and checks that each sequence's result equals verifying it alone with
//! [`Verifier::verify`], that reversing the batch changes no sequence's result, and that the
//! malformed sequence fails alone.
//!
//! Run: `cargo run --example batch_verify`

use std::error::Error;
use std::io::Write;

use speculative::rng::Stream;
use speculative::{
    SamplingConfig, SequenceParams, StepOutput, Verifier, VerifyBatch, VerifyRequest,
};

const VOCAB: usize = 32;

/// One sequence of the batch, as the engine holds it.
struct Sequence {
    label: &'static str,
    config: SamplingConfig,
    seed: u64,
    /// Prompt and generated tokens before this step's block.
    context: Vec<u32>,
    /// This step's draft tokens `[k]`.
    drafts: Vec<u32>,
    /// The target's logits over `[last, d_1 .. d_k]`: `[k + 1, VOCAB]`.
    logits: Vec<f32>,
}

/// Deterministic stand-in for a target forward: `rows` rows of logits in `[-2, 2)` with one
/// peaked token per row, drawn from a counter-based stream so that the example needs no model.
fn fake_logits(salt: u64, rows: usize) -> Vec<f32> {
    let s = Stream::new(salt);
    let mut logits = Vec::with_capacity(rows * VOCAB);
    for r in 0..rows {
        let peak = (s.uniform(r as u64, 99) * VOCAB as f32) as usize;
        for v in 0..VOCAB {
            let x = 4.0 * s.uniform((r * VOCAB + v) as u64, 0) - 2.0;
            logits.push(if v == peak { x + 4.0 } else { x });
        }
    }
    logits
}

/// Argmax of row `r` (ties to the lowest id), used to build drafts that the target likes.
fn argmax(logits: &[f32], r: usize) -> u32 {
    let row = &logits[r * VOCAB..(r + 1) * VOCAB];
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A sequence whose first `good` drafts are the target's argmax and whose other drafts are not.
fn sequence(
    label: &'static str,
    config: SamplingConfig,
    seed: u64,
    context: Vec<u32>,
    k: usize,
    good: usize,
) -> Sequence {
    let logits = fake_logits(seed * 1000 + 7, k + 1);
    let drafts = (0..k)
        .map(|i| {
            let best = argmax(&logits, i);
            if i < good {
                best
            } else {
                (best + 1) % VOCAB as u32
            }
        })
        .collect();
    Sequence {
        label,
        config,
        seed,
        context,
        drafts,
        logits,
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    run(&mut std::io::stdout().lock())
}

/// Runs the example, writing the report to `out`. Panics when a checked fact fails.
pub fn run(out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let penalised = SamplingConfig::builder()
        .temperature(1.0)
        .top_p(0.9)
        .repetition_penalty(1.3)
        .logprobs(2)
        .build()?;
    let seqs = vec![
        sequence(
            "greedy",
            SamplingConfig::greedy(),
            1,
            vec![3, 1, 4, 1, 5],
            3,
            2,
        ),
        sequence(
            "temperature 0.7, top-k 5",
            SamplingConfig::builder()
                .temperature(0.7)
                .top_k(5)
                .build()?,
            2,
            vec![9, 2, 6],
            0,
            0,
        ),
        sequence(
            "temperature 1, top-p 0.9, repetition penalty 1.3, logprobs",
            penalised.clone(),
            3,
            vec![5, 3, 5, 8, 9, 7],
            2,
            2,
        ),
        sequence(
            "temperature 0.8, min-p 0.1",
            SamplingConfig::builder()
                .temperature(0.8)
                .min_p(0.1)
                .build()?,
            4,
            vec![2, 7, 1, 8],
            1,
            1,
        ),
        // Malformed: a context token outside the vocabulary, which the penalty needs to count.
        sequence(
            "repetition penalty, bad context",
            penalised,
            5,
            vec![1, 99],
            2,
            1,
        ),
    ];

    let forward = verify_all(&seqs)?;
    let reversed: Vec<&Sequence> = seqs.iter().rev().collect();
    let mut backward = verify_all(&reversed)?;
    backward.reverse();

    let mut verifier = Verifier::new();
    for (i, s) in seqs.iter().enumerate() {
        let result = &forward[i];
        match result {
            Ok(step) => writeln!(
                out,
                "seq {i} ({}; seed {}, k = {}): accepted {}, emitted {:?}, {:?}{}",
                s.label,
                s.seed,
                s.drafts.len(),
                step.accepted,
                step.tokens,
                step.end,
                step.logprobs
                    .as_ref()
                    .map(|l| {
                        let v: Vec<String> =
                            l.iter().map(|t| format!("{:.3}", t.logprob)).collect();
                        format!(", logprobs [{}]", v.join(", "))
                    })
                    .unwrap_or_default()
            )?,
            Err(e) => writeln!(out, "seq {i} ({}; seed {}): error: {e}", s.label, s.seed)?,
        }
        // The same sequence verified alone gives the same result.
        let alone = verifier.verify(
            &VerifyRequest::new(&s.config, &s.logits, VOCAB, &s.drafts)
                .seed(s.seed)
                .context(&s.context),
        );
        assert_eq!(
            format!("{result:?}"),
            format!("{alone:?}"),
            "sequence {i} alone"
        );
        // And its place in the batch does not matter.
        assert_eq!(
            format!("{result:?}"),
            format!("{:?}", backward[i]),
            "sequence {i} reversed"
        );
    }
    assert_eq!(forward.iter().filter(|r| r.is_err()).count(), 1);
    assert!(forward[4].is_err());
    // The greedy sequence accepts its two argmax drafts and rejects the third.
    assert_eq!(forward[0].as_ref().map(|s| s.accepted).ok(), Some(2));
    // k = 0 is a plain decoding step.
    assert_eq!(forward[1].as_ref().map(|s| s.tokens.len()).ok(), Some(1));
    writeln!(
        out,
        "each result equals verifying the sequence alone, in either batch order"
    )?;
    Ok(())
}

/// Flattens `seqs` into one [`VerifyBatch`] and verifies it.
fn verify_all<S: std::borrow::Borrow<Sequence>>(
    seqs: &[S],
) -> speculative::Result<Vec<speculative::Result<StepOutput>>> {
    let mut logits = Vec::new();
    let mut drafts = Vec::new();
    let mut offsets = vec![0];
    for s in seqs {
        let s = s.borrow();
        logits.extend_from_slice(&s.logits);
        drafts.extend_from_slice(&s.drafts);
        offsets.push(drafts.len());
    }
    let params: Vec<SequenceParams<'_>> = seqs
        .iter()
        .map(|s| {
            let s = s.borrow();
            SequenceParams::new(&s.config, s.seed).context(&s.context)
        })
        .collect();
    let batch = VerifyBatch::new(VOCAB, &logits, &drafts, &offsets, &params);
    Verifier::new().verify_batch(&batch)
}
