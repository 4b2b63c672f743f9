//! Plugging your own engine into the decoding loop.
//!
//! Shows how an engine becomes a [`TargetModel`] (forward with logits of every appended
//! position, KV-cache rollback by `truncate`, a prefill that skips the output head), and how
//! [`Generator`] runs speculative decoding over it with the prompt-lookup proposer:
//! streaming with [`Generator::generate_stream`] (tokens, their log-probabilities, and text
//! through a small [`Detokenizer`]), a stop string, `min_tokens`, and the metrics.
//!
//! The engine is a toy character-level n-gram model written below (no download, deterministic),
//! standing in for a real forward pass. It prints every streamed step (tokens, logprobs, text),
//! the final text and finish reason of a run with and without `min_tokens`, the acceptance rate
//! and mean accepted length, and checks that greedy speculative output equals plain greedy
//! decoding (`DraftLength::Off`) token for token, with fewer target forwards.
//!
//! Run: `cargo run --example custom_engine`

use std::error::Error;
use std::io::Write;
use std::ops::ControlFlow;

use speculative::decode::{
    Detokenizer, DraftLength, FinishReason, Generation, GenerationParams, Generator, StopConditions,
};
use speculative::{PromptLookup, Result, SamplingConfig, TargetModel};

/// The vocabulary: one token per character.
const ALPHABET: &str = " abcdefghijklmnopqrstuvwxyz.\n";
/// What the toy model "knows": its next-token logits come from n-gram counts of this text.
const CORPUS: &str = "a dog sat on a log. the dog saw the cat. the cat sat on the mat. \
                      the dog saw the cat. the cat sat on the mat.\n";
/// Longest context, in tokens, the n-gram model looks at.
const ORDER: usize = 12;

/// A toy engine: a character n-gram model with a "KV cache" (the tokens it holds).
struct NgramEngine {
    corpus: Vec<u32>,
    /// The sequence the engine holds; `truncate` rolls it back as a KV cache would.
    tokens: Vec<u32>,
    /// Number of `forward` calls (target forwards), for the comparison at the end.
    forwards: usize,
}

impl NgramEngine {
    fn new() -> Self {
        NgramEngine {
            corpus: encode(CORPUS),
            tokens: Vec::new(),
            forwards: 0,
        }
    }

    /// Appends the logits `[vocab]` of the token after `prefix`: counts of what follows the
    /// longest suffix of `prefix` (up to `ORDER` tokens) that occurs in the corpus, as scaled
    /// log-counts; unseen tokens get a low floor, so that every token keeps some probability.
    fn logits_after(&self, prefix: &[u32], logits: &mut Vec<f32>) {
        let vocab = self.vocab_size();
        let mut counts = vec![0u32; vocab];
        for n in (1..=ORDER.min(prefix.len())).rev() {
            let suffix = &prefix[prefix.len() - n..];
            for w in self.corpus.windows(n + 1) {
                if &w[..n] == suffix {
                    counts[w[n] as usize] += 1;
                }
            }
            if counts.iter().any(|&c| c > 0) {
                break;
            }
        }
        logits.extend(counts.iter().map(|&c| {
            if c == 0 {
                -4.0
            } else {
                4.0 * (c as f32).ln_1p()
            }
        }));
    }
}

impl TargetModel for NgramEngine {
    fn vocab_size(&self) -> usize {
        ALPHABET.len()
    }

    fn max_context(&self) -> usize {
        512
    }

    fn seq_len(&self) -> usize {
        self.tokens.len()
    }

    /// Appends `tokens` and writes the logits of every appended position, `[n, vocab]`.
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        if self.tokens.len() + tokens.len() > self.max_context() {
            return Err(speculative::Error::Model("context full".into()));
        }
        self.forwards += 1;
        logits.clear();
        for &t in tokens {
            self.tokens.push(t);
            self.logits_after(&self.tokens, logits);
        }
        Ok(())
    }

    /// Drops every position at index `>= len` (rollback of rejected drafts).
    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.tokens.len() {
            return Err(speculative::Error::Model("truncate past the end".into()));
        }
        self.tokens.truncate(len);
        Ok(())
    }

    /// The prompt but its last token: no logits needed, so the "output head" is skipped.
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.tokens.extend_from_slice(tokens);
        Ok(())
    }
}

/// Token ids to text, for streaming text and stop strings.
struct Chars;

impl Detokenizer for Chars {
    fn decode(&self, tokens: &[u32]) -> Result<String> {
        Ok(tokens
            .iter()
            .map(|&t| ALPHABET.as_bytes()[t as usize] as char)
            .collect())
    }
}

fn encode(text: &str) -> Vec<u32> {
    text.bytes()
        .map(|b| {
            ALPHABET
                .bytes()
                .position(|a| a == b)
                .expect("in the alphabet") as u32
        })
        .collect()
}

fn main() -> std::result::Result<(), Box<dyn Error>> {
    run(&mut std::io::stdout().lock())
}

/// Runs the example, writing the report to `out`. Panics when a checked fact fails.
pub fn run(out: &mut dyn Write) -> std::result::Result<(), Box<dyn Error>> {
    let prompt = encode("the cat sat on the mat. the dog");
    let eos = encode("\n")[0];
    // Greedy, with the log-probability of each token (0 alternatives).
    let params = GenerationParams::builder()
        .sampling(SamplingConfig::builder().logprobs(0).build()?)
        .max_new_tokens(120)
        // The first "cat." is ignored: stops (and EOS) only count after 40 new tokens.
        .min_tokens(40)
        .stop(StopConditions::eos(eos).with_stop_string("cat."))
        .draft(DraftLength::Fixed(6))
        .build()?;
    let mut generator =
        Generator::new(NgramEngine::new(), PromptLookup::new(2, 6)?).with_detokenizer(Chars);

    writeln!(out, "prompt: {:?}", Chars.decode(&prompt)?)?;
    let mut streamed_tokens = Vec::new();
    let mut streamed_text = String::new();
    let mut step = 0;
    let spec = generator.generate_stream(&prompt, &params, |chunk| {
        step += 1;
        streamed_tokens.extend_from_slice(chunk.tokens);
        streamed_text.push_str(chunk.text);
        let logprobs: Vec<String> = chunk
            .logprobs
            .unwrap_or_default()
            .iter()
            .map(|lp| format!("{:.2}", lp.logprob))
            .collect();
        let line = writeln!(
            out,
            "step {step:>2}: {} tokens {:?}, logprobs [{}], text {:?}",
            chunk.tokens.len(),
            chunk.tokens,
            logprobs.join(", "),
            chunk.text
        );
        // A failed write (closed pipe) cancels the generation.
        if line.is_ok() {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    })?;
    let spec_forwards = generator.target().forwards;
    let text = spec.text.clone().unwrap_or_default();
    writeln!(out, "text: {text:?}")?;
    writeln!(
        out,
        "finish: {}, {} tokens, {} target forwards",
        spec.finish,
        spec.tokens.len(),
        spec.metrics.target_calls
    )?;
    writeln!(
        out,
        "acceptance rate {:.3}, mean accepted length {:.3} tokens per target forward",
        spec.metrics.acceptance_rate(),
        spec.metrics.mean_accepted_length()
    )?;
    // What was streamed is the generation; the stop string ends it, outside the text.
    assert_eq!(streamed_tokens, spec.tokens);
    assert_eq!(streamed_text, text);
    assert_eq!(spec.finish, FinishReason::StopString);
    assert!(spec.tokens.len() >= params.min_tokens());
    assert_eq!(
        spec.logprobs.as_ref().map(Vec::len),
        Some(spec.tokens.len())
    );
    // The first "cat." came before min_tokens; the second one stopped the generation.
    assert_eq!(
        text,
        " saw the cat. the cat sat on the mat. the dog saw the "
    );
    assert!(spec.metrics.mean_accepted_length() > 1.5);

    // Without min_tokens the first "cat." ends the generation.
    let early = generator.generate(&prompt, &params.clone().with_min_tokens(0)?)?;
    writeln!(
        out,
        "without min_tokens: finish {}, {} tokens, text {:?}",
        early.finish,
        early.tokens.len(),
        early.text.as_deref().unwrap_or_default()
    )?;
    assert_eq!(early.finish, FinishReason::StopString);
    assert!(early.tokens.len() < params.min_tokens());

    // Greedy speculative decoding is lossless: plain greedy decoding gives the same tokens.
    generator.target_mut().forwards = 0;
    let plain: Generation =
        generator.generate(&prompt, &params.clone().with_draft(DraftLength::Off))?;
    let plain_forwards = generator.target().forwards;
    writeln!(
        out,
        "plain greedy (DraftLength::Off): {} tokens, {} target forwards",
        plain.tokens.len(),
        plain.metrics.target_calls
    )?;
    assert_eq!(plain.tokens, spec.tokens);
    assert_eq!(plain.text, spec.text);
    assert_eq!(plain.finish, spec.finish);
    assert_eq!(plain.logprobs, spec.logprobs);
    assert_eq!(plain_forwards, plain.metrics.target_calls);
    assert_eq!(spec_forwards, spec.metrics.target_calls);
    assert!(spec_forwards < plain_forwards);
    writeln!(
        out,
        "greedy speculative output equals plain greedy output: {} tokens, {} vs {} forwards",
        spec.tokens.len(),
        spec_forwards,
        plain_forwards
    )?;
    Ok(())
}
