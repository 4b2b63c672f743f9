//! A brute-force reference for the text path of the decoding loop, written from the stop rules
//! (`notes/stop-rules.md`, the `decode` docs) and nothing of the crate's own stop code.
//!
//! The reference decodes the whole output at once: a byte-level vocabulary (token -> bytes)
//! whose detokenizer is `String::from_utf8_lossy` of the concatenated bytes, the target's plain
//! greedy output with the floor's bans, and a scan of every token count `i` for the first stop
//! that completes at or after the floor. It also gives the streamed text chunks for any step
//! boundaries. Everything is recomputed from scratch at every token (quadratic, and meant to be).

use std::sync::Arc;

use speculative::decode::{Detokenizer, FinishReason, StopConditions};

/// A byte-level vocabulary: token `t` is the bytes `pieces[t]` (which need not be valid UTF-8).
#[derive(Debug, Clone)]
pub struct ByteVocab(pub Arc<Vec<Vec<u8>>>);

impl ByteVocab {
    /// A vocabulary of the given pieces.
    pub fn new(pieces: Vec<Vec<u8>>) -> Self {
        ByteVocab(Arc::new(pieces))
    }

    /// A vocabulary of text pieces.
    pub fn of_strs(pieces: &[&str]) -> Self {
        Self::new(pieces.iter().map(|p| p.as_bytes().to_vec()).collect())
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The concatenated bytes of `tokens`.
    pub fn bytes(&self, tokens: &[u32]) -> Vec<u8> {
        tokens
            .iter()
            .flat_map(|&t| self.0[t as usize].iter().copied())
            .collect()
    }

    /// D: the lossy decode of the concatenated bytes (incomplete or invalid bytes -> U+FFFD).
    pub fn text(&self, tokens: &[u32]) -> String {
        String::from_utf8_lossy(&self.bytes(tokens)).into_owned()
    }

    /// V: the text of `tokens` without its trailing U+FFFD characters (rule 3).
    pub fn visible(&self, tokens: &[u32]) -> String {
        self.text(tokens).trim_end_matches('\u{FFFD}').to_owned()
    }
}

impl Detokenizer for ByteVocab {
    fn decode(&self, tokens: &[u32]) -> speculative::Result<String> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.len()) {
            return Err(speculative::Error::model(format!(
                "token {t} outside the vocabulary"
            )));
        }
        Ok(self.text(tokens))
    }
}

/// The ids banned at token counts `i <= min_tokens` (rule 1): the EOS ids and the ids of the
/// single-token stop sequences.
pub fn floor_bans(stop: &StopConditions) -> Vec<u32> {
    let singles = stop.stop_sequences.iter().filter(|s| s.len() == 1);
    stop.eos
        .iter()
        .copied()
        .chain(singles.map(|s| s[0]))
        .collect()
}

/// Plain greedy decoding of `n` tokens after `prompt`: at token count `i`, the argmax of
/// `logits(prompt + g_1..g_{i-1})` over the ids not in `bans` (the bans hold while
/// `i <= min_tokens`). Ties go to the lowest id (the generators of the tests avoid ties).
pub fn greedy_output(
    logits: &dyn Fn(&[u32]) -> Vec<f32>,
    prompt: &[u32],
    bans: &[u32],
    min_tokens: usize,
    n: usize,
) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for i in 1..=n {
        let row = logits(&seq);
        let allowed = (0..row.len() as u32).filter(|t| i > min_tokens || !bans.contains(t));
        let best = allowed.fold(None, |best: Option<u32>, t| match best {
            Some(b) if row[b as usize] >= row[t as usize] => Some(b),
            _ => Some(t),
        });
        seq.push(best.expect("some id is allowed"));
    }
    seq.split_off(prompt.len())
}

/// Which rule picks the stop string among those completing at one token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// The contract (rules 3-4): the occurrence that ends first wins, then the one that starts
    /// first; complete characters are visible as soon as their token is emitted.
    Contract,
    /// A deliberately wrong rule for negative controls: the occurrence that starts first wins
    /// (then the shorter one).
    FirstStartWins,
    /// A deliberately wrong rule for negative controls: no stop string completes at a token
    /// whose text ends in an incomplete character (the whole token's text waits).
    WholeTokens,
}

/// What the loop must return for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// The request is refused with `Error::InvalidConfig` before any work (rule 9).
    Invalid,
    /// The generation's tokens, text and finish reason.
    Done(Outcome),
}

/// The tokens, text and finish reason of a generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
}

/// The occurrence `[a, b)` of stop string `s` that completes at a token with visible text `v`,
/// the previous token's visible text having `before` bytes: the first occurrence (by start)
/// that ends after `before` (rule 3).
pub fn completes(v: &str, before: usize, s: &str) -> Option<(usize, usize)> {
    v.char_indices()
        .map(|(a, _)| (a, a + s.len()))
        .find(|&(a, b)| b > before && v[a..].starts_with(s))
}

/// The stop string occurrence that ends the generation at a token (rule 4 under `rule`).
fn winning_stop(v: &str, before: usize, strings: &[String], rule: Rule) -> Option<(usize, usize)> {
    let hits = strings.iter().filter_map(|s| completes(v, before, s));
    match rule {
        Rule::FirstStartWins => hits.min(),
        Rule::Contract | Rule::WholeTokens => hits.min_by_key(|&(a, b)| (b, a)),
    }
}

/// The finish reason of a token stop at token count `i` (rule 2), if any.
fn token_stop(output: &[u32], i: usize, stop: &StopConditions) -> Option<FinishReason> {
    let generated = &output[..i];
    if stop.eos.contains(&generated[i - 1]) {
        return Some(FinishReason::Eos);
    }
    let seq_ends = stop.stop_sequences.iter().any(|s| generated.ends_with(s));
    seq_ends.then_some(FinishReason::StopSequence)
}

/// The reference outcome of a request whose target output (plain greedy with the floor's bans,
/// [`greedy_output`], `max_new_tokens` tokens long) is `output` (rules 1-6 and 9).
pub fn reference(
    output: &[u32],
    vocab: &ByteVocab,
    stop: &StopConditions,
    min_tokens: usize,
    rule: Rule,
) -> Expected {
    let empty_seq = stop.stop_sequences.iter().any(Vec::is_empty);
    if empty_seq || stop.stop_strings.iter().any(String::is_empty) {
        return Expected::Invalid;
    }
    let mut before = String::new();
    for i in 1..=output.len() {
        let v = vocab.visible(&output[..i]);
        assert!(v.starts_with(&before), "V_i extends V_(i-1) (rule 3)");
        let done = |finish, text| {
            let tokens = output[..i].to_vec();
            Expected::Done(Outcome {
                tokens,
                text,
                finish,
            })
        };
        if i >= min_tokens {
            if let Some(finish) = token_stop(output, i, stop) {
                return done(finish, vocab.text(&output[..i]));
            }
            let waits = rule == Rule::WholeTokens && vocab.text(&output[..i]).ends_with('\u{FFFD}');
            let hit = winning_stop(&v, before.len(), &stop.stop_strings, rule);
            if let (Some((a, b)), false) = (hit, waits) {
                let end = if stop.include_stop_str_in_output {
                    b
                } else {
                    a
                };
                return done(FinishReason::StopString, v[..end].to_owned());
            }
        }
        if !(rule == Rule::WholeTokens && vocab.text(&output[..i]).ends_with('\u{FFFD}')) {
            before = v;
        }
    }
    Expected::Done(Outcome {
        tokens: output.to_vec(),
        text: vocab.text(output),
        finish: FinishReason::MaxTokens,
    })
}

/// Length of the longest suffix of `v` that is a proper, non-empty prefix (at a character
/// boundary) of some stop string: the text streaming must hold back (rule 7).
pub fn held_back(v: &str, strings: &[String]) -> usize {
    strings
        .iter()
        .flat_map(|s| s.char_indices().skip(1).map(move |(c, _)| &s[..c]))
        .filter(|p| v.ends_with(p))
        .map(str::len)
        .max()
        .unwrap_or(0)
}

/// The streamed text chunks of `out` for steps of `sizes` tokens each (summing to
/// `out.tokens.len()`; rule 7): after each step the longest prefix of the visible text that
/// leaves out [`held_back`] (never shrinking), and after the last step the rest of the final
/// text.
pub fn stream_chunks(
    out: &Outcome,
    vocab: &ByteVocab,
    strings: &[String],
    sizes: &[usize],
) -> Vec<String> {
    let (mut released, mut emitted) = (0usize, 0usize);
    let mut chunks = Vec::with_capacity(sizes.len());
    for (step, &n) in sizes.iter().enumerate() {
        emitted = (emitted + n).min(out.tokens.len());
        if step + 1 == sizes.len() {
            chunks.push(out.text.get(released..).unwrap_or("<shrunk>").to_owned());
            break;
        }
        let v = vocab.visible(&out.tokens[..emitted]);
        let now = released.max(v.len() - held_back(&v, strings));
        chunks.push(v[released..now].to_owned());
        released = now;
    }
    chunks
}
