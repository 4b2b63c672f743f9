//! Writing your own proposer.
//!
//! Shows a [`Proposer`] written from scratch: a bigram table learned online (from the prompt in
//! [`Proposer::begin`], from every verified step in [`Proposer::observe`]) that drafts by
//! following the most frequent successor of each token, with a [`Proposer::name`] and a rebuild
//! when it is handed a context it has not seen. It runs in the decoding loop over a toy engine
//! (written below; no model needed).
//!
//! It prints, for greedy decoding and for seeded sampling at several draft lengths, the tokens,
//! the acceptance rate and the mean accepted length, and checks that the output equals plain
//! decoding with the same seed: greedy output is always identical, and because the bigram
//! proposer's drafts are point masses (no draft probabilities), seeded sampled output is
//! identical too, whatever the draft length (case C15 in the `verify` module docs).
//!
//! Run: `cargo run --example custom_proposer`

use std::collections::HashMap;
use std::error::Error;
use std::io::Write;

use speculative::decode::{DraftLength, Generation, GenerationParams, Generator};
use speculative::rng::Stream;
use speculative::{
    Draft, NoProposer, ProposeRequest, Proposer, Result, SamplingConfig, TargetModel,
};

/// Proposes by following the most frequent successor of each token in the sequence so far.
#[derive(Debug, Default)]
struct Bigram {
    /// `counts[a][b]`: how often token `b` followed token `a`.
    counts: HashMap<u32, HashMap<u32, u32>>,
    /// The sequence learned so far (prompt and emitted tokens).
    history: Vec<u32>,
    /// Times `propose` found a context it had not learned and rebuilt the table from it.
    rebuilds: usize,
}

impl Bigram {
    fn reset(&mut self) {
        self.counts.clear();
        self.history.clear();
    }

    /// Learns the pairs that `tokens` form with the sequence so far.
    fn learn(&mut self, tokens: &[u32]) {
        for &t in tokens {
            if let Some(&prev) = self.history.last() {
                *self.counts.entry(prev).or_default().entry(t).or_default() += 1;
            }
            self.history.push(t);
        }
    }

    /// The most frequent successor of `token` (ties: the lowest id), if any was seen.
    fn best_after(&self, token: u32) -> Option<u32> {
        let next = self.counts.get(&token)?;
        next.iter()
            .max_by(|(a, ca), (b, cb)| ca.cmp(cb).then(b.cmp(a)))
            .map(|(&t, _)| t)
    }

    fn pairs(&self) -> usize {
        self.counts.values().map(HashMap::len).sum()
    }
}

impl Proposer for Bigram {
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.reset();
        self.learn(prompt);
        Ok(())
    }

    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        // Used without the loop, or on another request: never serve a stale table.
        if req.context != self.history.as_slice() {
            self.rebuilds += 1;
            self.reset();
            self.learn(req.context);
        }
        let Some(&last) = req.context.last() else {
            return Ok(());
        };
        let mut token = last;
        while draft.tokens.len() < req.max_draft {
            let Some(next) = self.best_after(token) else {
                break;
            };
            draft.tokens.push(next);
            if req.is_eos(next) {
                break; // a draft ends at its first EOS
            }
            token = next;
        }
        Ok(())
    }

    fn observe(&mut self, _accepted: usize, emitted: &[u32]) -> Result<()> {
        self.learn(emitted);
        Ok(())
    }

    fn name(&self) -> &'static str {
        "bigram"
    }
}

const VOCAB: usize = 24;

/// A toy engine: logits depend on the last two tokens through a fixed pseudo-random table, with
/// one favoured successor per token, so that a bigram table predicts it often but not always.
struct ToyEngine {
    tokens: Vec<u32>,
}

impl ToyEngine {
    fn logits_after(prefix: &[u32], logits: &mut Vec<f32>) {
        let table = Stream::new(2024);
        let last = *prefix.last().expect("never empty") as u64;
        let prev = if prefix.len() >= 2 {
            prefix[prefix.len() - 2] as u64
        } else {
            VOCAB as u64
        };
        let v = VOCAB as u64;
        let favoured = (last * 5 + 3) % v;
        for t in 0..v {
            let mut x = 3.0 * table.uniform(last * v + t, 0)
                + 1.5 * table.uniform((prev * v + last) * v + t, 1);
            if t == favoured {
                x += 5.0;
            }
            logits.push(x);
        }
    }
}

impl TargetModel for ToyEngine {
    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn max_context(&self) -> usize {
        4096
    }

    fn seq_len(&self) -> usize {
        self.tokens.len()
    }

    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        logits.clear();
        for &t in tokens {
            self.tokens.push(t);
            Self::logits_after(&self.tokens, logits);
        }
        Ok(())
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.tokens.len() {
            return Err(speculative::Error::Model("truncate past the end".into()));
        }
        self.tokens.truncate(len);
        Ok(())
    }
}

fn main() -> std::result::Result<(), Box<dyn Error>> {
    run(&mut std::io::stdout().lock())
}

/// Runs the example, writing the report to `out`. Panics when a checked fact fails.
pub fn run(out: &mut dyn Write) -> std::result::Result<(), Box<dyn Error>> {
    let prompt: Vec<u32> = (0..12).map(|i| (i * 7 % VOCAB) as u32).collect();
    let mut speculative = Generator::new(ToyEngine { tokens: vec![] }, Bigram::default());
    let mut plain = Generator::new(ToyEngine { tokens: vec![] }, NoProposer);
    writeln!(out, "proposer: {}", speculative.proposer().name())?;

    // Greedy: identical to plain greedy decoding.
    let params = GenerationParams::greedy(64);
    let reference = plain.generate(&prompt, &params)?;
    let spec = speculative.generate(&prompt, &params)?;
    report(out, "greedy, k = 4", &spec)?;
    writeln!(
        out,
        "  bigram pairs learned: {}",
        speculative.proposer().pairs()
    )?;
    assert_eq!(spec.tokens, reference.tokens);
    assert!(spec.metrics.acceptance_rate() > 0.5);
    // In the loop, begin and observe keep the table in step with the sequence.
    assert_eq!(speculative.proposer().rebuilds, 0);
    assert_eq!(
        speculative.proposer().history.len(),
        prompt.len() + spec.tokens.len()
    );

    // Seeded sampling: the same seed gives plain sampling's tokens at any draft length.
    let sampling = SamplingConfig::builder()
        .temperature(0.8)
        .top_p(0.95)
        .build()?;
    let seed = 11;
    let params = GenerationParams::sampled(sampling, seed, 64);
    let reference = plain.generate(&prompt, &params)?;
    writeln!(
        out,
        "plain sampling, seed {seed}: {:?}",
        &reference.tokens[..16]
    )?;
    let mut total_accepted = 0;
    for k in [1, 2, 4, 8] {
        let spec =
            speculative.generate(&prompt, &params.clone().with_draft(DraftLength::Fixed(k)))?;
        report(out, &format!("sampled, seed {seed}, k = {k}"), &spec)?;
        assert_eq!(spec.tokens, reference.tokens, "k = {k}");
        total_accepted += spec.metrics.accepted;
    }
    // The comparison is not vacuous: drafts were accepted.
    assert!(total_accepted > 0);
    writeln!(
        out,
        "sampled output equals plain sampling with the same seed at every draft length"
    )?;

    // Used directly, without the loop: it rebuilds its table from the context it is given.
    let mut bigram = Bigram::default();
    let mut draft = Draft::default();
    let greedy = SamplingConfig::greedy();
    bigram.propose(
        &ProposeRequest::new(&[1, 2, 3, 1, 2], &greedy, 4),
        &mut draft,
    )?;
    writeln!(
        out,
        "direct proposal after [1, 2, 3, 1, 2]: {:?}",
        draft.tokens
    )?;
    assert_eq!(draft.tokens, [3, 1, 2, 3]);
    assert_eq!(bigram.rebuilds, 1);
    Ok(())
}

fn report(out: &mut dyn Write, label: &str, g: &Generation) -> std::io::Result<()> {
    writeln!(
        out,
        "{label}: {} tokens, first {:?}, acceptance rate {:.3}, mean accepted length {:.3}",
        g.tokens.len(),
        &g.tokens[..16],
        g.metrics.acceptance_rate(),
        g.metrics.mean_accepted_length()
    )
}
