//! Stop conditions, finish reasons, and the text side of stopping (stop strings, held-back
//! streaming).

use crate::error::Result;

/// When a generation stops, besides its token budget
/// ([`crate::decode::GenerationParams::max_new_tokens`], which lives outside this type so that
/// setting stops never resets it).
///
/// Checked token by token, also inside an accepted block and inside a draft: nothing after the
/// stopping token is emitted, streamed or counted, and no target or draft row after it is
/// processed (case C11). Before `min_tokens` tokens have been generated, no stop is checked and
/// the EOS ids (and single-token stop sequences) are banned at every target and draft row.
///
/// The default stops on nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopConditions {
    /// End-of-sequence token ids. The EOS token itself is emitted (it is the last token).
    pub eos: Vec<u32>,
    /// Stop token sequences, matched against the generated tokens only (not the prompt),
    /// including across step boundaries. The completing tokens are emitted.
    pub stop_sequences: Vec<Vec<u32>>,
    /// Stop strings, matched against the generated text (not the prompt), across token
    /// boundaries and steps. Needs a [`Detokenizer`] on the generator. The token that completes
    /// a stop string is the last token emitted; the text ends before the stop string, or after
    /// it with `include_stop_str_in_output`.
    pub stop_strings: Vec<String>,
    /// Keep the stop string in [`crate::decode::Generation::text`] and in the streamed text
    /// (default `false`, as in vLLM and the OpenAI API).
    pub include_stop_str_in_output: bool,
}

impl StopConditions {
    /// Stop at EOS id `eos`.
    pub fn eos(eos: u32) -> Self {
        StopConditions::default().with_eos(eos)
    }

    /// Adds an EOS id.
    pub fn with_eos(mut self, eos: u32) -> Self {
        self.eos.push(eos);
        self
    }

    /// Adds a stop token sequence (ignored when empty).
    pub fn with_stop_sequence(mut self, seq: Vec<u32>) -> Self {
        if !seq.is_empty() {
            self.stop_sequences.push(seq);
        }
        self
    }

    /// Adds a stop string (an empty string is rejected when the generation starts).
    pub fn with_stop_string(mut self, stop: impl Into<String>) -> Self {
        self.stop_strings.push(stop.into());
        self
    }

    /// Keeps (or drops, the default) the stop string in the output text.
    pub fn include_stop_string(mut self, include: bool) -> Self {
        self.include_stop_str_in_output = include;
        self
    }

    /// The token-level reason to stop after `generated` (the new tokens so far, the last one
    /// just appended): an EOS id or a completed stop sequence. Stop strings and the budget are
    /// checked by the loop.
    pub fn check(&self, generated: &[u32]) -> Option<FinishReason> {
        let last = *generated.last()?;
        if self.eos.contains(&last) {
            return Some(FinishReason::Eos);
        }
        if self.stop_sequences.iter().any(|s| generated.ends_with(s)) {
            return Some(FinishReason::StopSequence);
        }
        None
    }

    /// The ids banned while `min_tokens` is not reached: the EOS ids and the single-token stop
    /// sequences (vLLM's `stop_token_ids`), sorted, without duplicates.
    pub fn suppressed_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .eos
            .iter()
            .copied()
            .chain(
                self.stop_sequences
                    .iter()
                    .filter(|s| s.len() == 1)
                    .map(|s| s[0]),
            )
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FinishReason {
    /// An EOS token was emitted.
    Eos,
    /// A stop sequence was completed.
    StopSequence,
    /// A stop string was completed in the generated text.
    StopString,
    /// `max_new_tokens` were emitted.
    MaxTokens,
    /// The sequence filled the model's context (`max_context` tokens).
    ContextFull,
    /// The caller cancelled (cancel flag or streaming callback).
    Cancelled,
    /// The generation failed (see [`crate::decode::GenerationError`]); the tokens emitted before
    /// the failure are kept.
    Error,
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FinishReason::Eos => "eos",
            FinishReason::StopSequence => "stop_sequence",
            FinishReason::StopString => "stop_string",
            FinishReason::MaxTokens => "max_tokens",
            FinishReason::ContextFull => "context_full",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error => "error",
        })
    }
}

/// Incremental text of the generated tokens, stop-string matching and held-back streaming.
///
/// Decoding follows the usual incremental scheme (as in HF transformers' and vLLM's
/// detokenizers): the text of `tokens[prefix..]` minus the text of `tokens[prefix..read]` is the
/// new text, accepted only when it does not end in U+FFFD (an incomplete UTF-8 character), so
/// every decode call sees a short window and the text only ever grows by complete characters.
#[derive(Debug, Clone, Default)]
pub(crate) struct TextTracker {
    /// Text of the generated tokens `[..read]`.
    pub text: String,
    prefix: usize,
    read: usize,
    /// Bytes of `text` already handed to the caller.
    pub released: usize,
    /// Set when a stop string was found: the end of the output text.
    pub stop_at: Option<usize>,
}

/// A [`TextTracker`] state to return to ([`TextTracker::mark`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TextMark {
    len: usize,
    prefix: usize,
    read: usize,
    released: usize,
    stop_at: Option<usize>,
}

impl TextTracker {
    /// The current state, for [`TextTracker::reset`].
    pub fn mark(&self) -> TextMark {
        TextMark {
            len: self.text.len(),
            prefix: self.prefix,
            read: self.read,
            released: self.released,
            stop_at: self.stop_at,
        }
    }

    /// Returns to a state taken by [`TextTracker::mark`] (text only grows between the two).
    pub fn reset(&mut self, m: TextMark) {
        self.text.truncate(m.len);
        self.prefix = m.prefix;
        self.read = m.read;
        self.released = m.released;
        self.stop_at = m.stop_at;
    }

    /// Takes `generated` (all generated tokens, the last one just appended) into the text and
    /// checks the stop strings in the part of the text that changed. Returns `true` when a stop
    /// string is completed (then `stop_at` is set).
    pub fn push(
        &mut self,
        d: &dyn Detokenizer,
        generated: &[u32],
        stop: &StopConditions,
        check_stops: bool,
    ) -> Result<bool> {
        let before = d.decode(&generated[self.prefix..self.read])?;
        let now = d.decode(&generated[self.prefix..])?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') || !now.starts_with(&before) {
            return Ok(false);
        }
        let old_len = self.text.len();
        self.text.push_str(&now[before.len()..]);
        self.prefix = self.read;
        self.read = generated.len();
        if !check_stops || stop.stop_strings.is_empty() {
            return Ok(false);
        }
        let longest = stop.stop_strings.iter().map(String::len).max().unwrap_or(0);
        let mut from = old_len.saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = stop
            .stop_strings
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| {
                self.text[from..]
                    .find(s.as_str())
                    .map(|i| (from + i, s.len()))
            })
            .min();
        if let Some((at, len)) = hit {
            self.stop_at = Some(if stop.include_stop_str_in_output {
                at + len
            } else {
                at
            });
            return Ok(true);
        }
        Ok(false)
    }

    /// The output text: cut at the stop string when one was found.
    pub fn output(&self) -> &str {
        &self.text[..self.stop_at.unwrap_or(self.text.len())]
    }

    /// How much of the text may be streamed now: everything except a suffix that could still
    /// grow into a stop string (or everything up to the stop, once found; everything when
    /// `finished`).
    pub fn releasable(&self, stop: &StopConditions, finished: bool) -> usize {
        if let Some(at) = self.stop_at {
            return at;
        }
        if finished {
            return self.text.len();
        }
        let t = self.text.as_str();
        let mut hold = 0;
        for s in stop.stop_strings.iter().filter(|s| !s.is_empty()) {
            // The longest proper prefix of `s` that is a suffix of the text.
            for (i, _) in s.char_indices().skip(1) {
                if i > hold && t.ends_with(&s[..i]) {
                    hold = i;
                }
            }
        }
        t.len() - hold
    }
}

/// Turns generated token ids into text, so the loop can match stop strings that span token
/// boundaries and steps, and stream text (the hook behind [`StopConditions::stop_strings`]).
///
/// The loop decodes incrementally: it calls [`Detokenizer::decode`] on a short window of recent
/// tokens and keeps only complete characters, so an implementation only needs a stateless
/// decode of any token slice. The result must not drop or add characters at the window's start
/// other than what the tokenizer itself does for a leading token (byte-level BPE and
/// SentencePiece decoders qualify). Bytes that do not yet form a complete UTF-8 character must
/// come out as U+FFFD (the usual lossy decode); the loop then waits for the next token.
///
/// `Send + Sync`, so a [`crate::decode::Generator`] holding one stays `Send`.
///
/// # Example
/// ```
/// use speculative::decode::Detokenizer;
///
/// /// One character per token id: 0 = 'a', 1 = 'b', ...
/// struct Letters;
/// impl Detokenizer for Letters {
///     fn decode(&self, tokens: &[u32]) -> speculative::Result<String> {
///         Ok(tokens.iter().map(|&t| (b'a' + (t % 26) as u8) as char).collect())
///     }
/// }
/// assert_eq!(Letters.decode(&[7, 8]).unwrap(), "hi");
/// ```
pub trait Detokenizer: Send + Sync {
    /// The text of `tokens`.
    ///
    /// # Errors
    /// Implementation defined (wrap tokenizer errors in [`crate::Error::Model`]).
    fn decode(&self, tokens: &[u32]) -> crate::Result<String>;
}

impl<D: Detokenizer + ?Sized> Detokenizer for Box<D> {
    fn decode(&self, tokens: &[u32]) -> crate::Result<String> {
        (**self).decode(tokens)
    }
}

impl<D: Detokenizer + ?Sized> Detokenizer for std::sync::Arc<D> {
    fn decode(&self, tokens: &[u32]) -> crate::Result<String> {
        (**self).decode(tokens)
    }
}
