//! Stop conditions, finish reasons, and the text side of stopping (stop strings, held-back
//! streaming).

use crate::error::Result;

/// When a generation stops, besides its token budget
/// ([`crate::decode::GenerationParams::max_new_tokens`], which lives outside this type so that
/// setting stops never resets it).
///
/// Checked token by token, also inside an accepted block and inside a draft: nothing after the
/// stopping token is emitted, streamed or counted, and no target or draft row after it is
/// processed (case C11). A stop completes only at or after the `min_tokens` floor, before
/// which the EOS ids (and single-token stop sequences) are banned at every target and draft
/// row. The full rules (which text a stop string may match, earliest completion, partial
/// characters, streaming) are in [`crate::decode`]'s "Stop rules".
///
/// The default stops on nothing.
///
/// `#[non_exhaustive]`: build it with [`StopConditions::eos`] or [`Default`] and the `with_`
/// methods; the fields stay public to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StopConditions {
    /// End-of-sequence token ids. The EOS token itself is emitted (it is the last token).
    pub eos: Vec<u32>,
    /// Stop token sequences, matched against the generated tokens only (not the prompt),
    /// including across step boundaries; none may be empty. The completing tokens are emitted.
    pub stop_sequences: Vec<Vec<u32>>,
    /// Stop strings, matched against the generated text (not the prompt), across token
    /// boundaries and steps; none may be empty. Needs a [`Detokenizer`] on the generator. The
    /// token that completes a stop string is the last token emitted; the text ends before the
    /// stop string, or after it with `include_stop_str_in_output`; of several completing in one
    /// token, the one that ends first wins.
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

    /// Adds a stop token sequence (an empty one is refused when the
    /// [`GenerationParams`](crate::decode::GenerationParams) are built, as an empty stop string
    /// is, whether it came from here, the public field or serde).
    pub fn with_stop_sequence(mut self, seq: Vec<u32>) -> Self {
        self.stop_sequences.push(seq);
        self
    }

    /// Adds a stop string (an empty string is refused when the
    /// [`GenerationParams`](crate::decode::GenerationParams) are built).
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
/// new text, so every decode call sees a short window. New text that ends in U+FFFD (an
/// incomplete UTF-8 character, or bytes that may still become one) is split: its complete
/// characters are *visible* at once (the stop check sees them, case C17) as a tentative tail, and
/// the window only advances past the token once its text ends in a complete character. The
/// visible text only ever grows ([`crate::decode`], "Stop rules", rule 3).
#[derive(Debug, Clone, Default)]
pub(crate) struct TextTracker {
    /// The visible text of the generated tokens: the text of `[..read]`, then the complete
    /// characters of the newer tokens (the last `tail` bytes).
    pub text: String,
    /// Bytes at the end of `text` that belong to tokens `[read..]` (not yet final).
    tail: usize,
    prefix: usize,
    read: usize,
    /// Length of the visible text before the last [`TextTracker::push`]: a stop string
    /// completes at the pushed token only when its occurrence ends after it.
    before: usize,
    /// Bytes of `text` already handed to the caller.
    pub released: usize,
    /// Set when a stop string ended the generation: the end of the output text.
    pub stop_at: Option<usize>,
}

/// A [`TextTracker`] state to return to ([`TextTracker::mark`]): a copy of everything but the
/// text, of which only a length `keep` is kept and a copy of the rest (pushes after the mark
/// change the text only after `keep`).
#[derive(Debug, Clone, Default)]
pub(crate) struct TextMark {
    /// Length of the text kept by [`TextTracker::reset`] (at most the final part).
    keep: usize,
    /// The text after `keep` (the tail and anything newer, at the mark).
    tail_text: String,
    tail: usize,
    prefix: usize,
    read: usize,
    before: usize,
    released: usize,
    stop_at: Option<usize>,
}

impl TextMark {
    /// The length of text that a reset to this mark keeps.
    pub fn keep(&self) -> usize {
        self.keep
    }
}

impl TextTracker {
    /// The current state, for [`TextTracker::reset`].
    pub fn mark(&self) -> TextMark {
        self.mark_from(self.text.len() - self.tail)
    }

    /// The current state, keeping a copy of the text after byte `keep`, which must be at most
    /// the final (non-tail) length of the text at an earlier [`TextTracker::mark`] that every
    /// state reset to it descends from (a draft tree's root).
    pub fn mark_from(&self, keep: usize) -> TextMark {
        TextMark {
            keep,
            tail_text: self.text[keep..].to_string(),
            tail: self.tail,
            prefix: self.prefix,
            read: self.read,
            before: self.before,
            released: self.released,
            stop_at: self.stop_at,
        }
    }

    /// Returns to a state taken by [`TextTracker::mark`] or [`TextTracker::mark_from`] of this
    /// tracker (pushes only change the text after the mark's `keep`).
    pub fn reset(&mut self, m: &TextMark) {
        debug_assert!(m.keep <= self.text.len());
        self.text.truncate(m.keep);
        self.text.push_str(&m.tail_text);
        self.tail = m.tail;
        self.prefix = m.prefix;
        self.read = m.read;
        self.before = m.before;
        self.released = m.released;
        self.stop_at = m.stop_at;
    }

    /// Takes `generated` (all generated tokens, the last one just appended, the tracker holding
    /// the text of the ones before) into the visible text, and remembers where the visible text
    /// ended before it (for [`TextTracker::find_stop`]).
    ///
    /// # Errors
    /// The detokenizer's.
    pub fn push(&mut self, d: &dyn Detokenizer, generated: &[u32]) -> Result<()> {
        self.before = self.text.len();
        let before = d.decode(&generated[self.prefix..self.read])?;
        let now = d.decode(&generated[self.prefix..])?;
        let Some(new) = now.strip_prefix(before.as_str()) else {
            // The window's text changed before its end (a decoder that does not decode windows
            // consistently): keep the visible text and wait for the next token.
            return Ok(());
        };
        let complete = new.trim_end_matches('\u{FFFD}');
        let keep = self.text.len() - self.tail;
        if !complete.starts_with(&self.text[keep..]) {
            // Never take back visible text.
            return Ok(());
        }
        self.text.truncate(keep);
        self.text.push_str(complete);
        if complete.len() == new.len() && !new.is_empty() {
            self.tail = 0;
            self.prefix = self.read;
            self.read = generated.len();
        } else {
            self.tail = complete.len();
        }
        Ok(())
    }

    /// Looks for a stop string completed by the last [`TextTracker::push`]: an occurrence ending
    /// in the text that push made visible; of those, the one that ends first, and on a tie the
    /// one that starts first (rule 4). Sets `stop_at` and returns `true` when one is found.
    pub fn find_stop(&mut self, stop: &StopConditions) -> bool {
        let hit = stop
            .stop_strings
            .iter()
            .filter_map(|s| first_ending_after(&self.text, s, self.before))
            .min_by_key(|&(a, b)| (b, a));
        let Some((a, b)) = hit else {
            return false;
        };
        self.stop_at = Some(if stop.include_stop_str_in_output {
            b
        } else {
            a
        });
        true
    }

    /// The final text of a generation that did not end at a stop string (rule 6): the text of
    /// every generated token, the decoder's rendering of an incomplete final character included.
    pub fn flush(&mut self, d: &dyn Detokenizer, generated: &[u32]) -> Result<()> {
        if self.stop_at.is_some() || self.read == generated.len() {
            return Ok(());
        }
        let before = d.decode(&generated[self.prefix..self.read])?;
        let now = d.decode(&generated[self.prefix..])?;
        if let Some(new) = now.strip_prefix(before.as_str()) {
            let keep = self.text.len() - self.tail;
            if new.starts_with(&self.text[keep..]) {
                self.text.truncate(keep);
                self.text.push_str(new);
                self.tail = 0;
                self.prefix = self.read;
                self.read = generated.len();
            }
        }
        Ok(())
    }

    /// The output text: cut at the stop string when one was found.
    pub fn output(&self) -> &str {
        &self.text[..self.stop_at.unwrap_or(self.text.len())]
    }

    /// How much of the text may be streamed now (rule 7): everything except the longest suffix
    /// that is a proper prefix of a stop string (everything up to the stop, once found;
    /// everything when `finished`).
    pub fn releasable(&self, stop: &StopConditions, finished: bool) -> usize {
        if let Some(at) = self.stop_at {
            return at;
        }
        if finished {
            return self.text.len();
        }
        let t = self.text.as_str();
        let mut hold = 0;
        for s in &stop.stop_strings {
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

/// The first occurrence `[a, b)` of `s` in `text` with `b > after` (occurrences may overlap);
/// `None` for an empty `s` or when there is none.
fn first_ending_after(text: &str, s: &str, after: usize) -> Option<(usize, usize)> {
    if s.is_empty() {
        return None;
    }
    // An occurrence ending after `after` starts after `after - s.len()`.
    let mut from = (after + 1).saturating_sub(s.len());
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    while let Some(i) = text.get(from..)?.find(s) {
        let a = from + i;
        if a + s.len() > after {
            return Some((a, a + s.len()));
        }
        // The next character boundary after `a`.
        from = a + text[a..].chars().next().map_or(1, char::len_utf8);
    }
    None
}

/// The stop scan (rules 1-5 of [`crate::decode`]'s "Stop rules"), one appended token at a time:
/// the same code for a draft chain, each path of a draft tree, and the commit of a verified step.
#[derive(Clone, Copy)]
pub(crate) struct StopScan<'a> {
    /// The request's stops.
    pub stop: &'a StopConditions,
    /// `min_tokens`: no stop completes at a token below it.
    pub min_tokens: usize,
    /// The detokenizer when the text is tracked (stop strings need it).
    pub detokenizer: Option<&'a dyn Detokenizer>,
}

impl StopScan<'_> {
    /// Whether any stop can end a generation (a scan of drafts is needed).
    pub fn active(&self) -> bool {
        !self.stop.eos.is_empty()
            || !self.stop.stop_sequences.is_empty()
            || (!self.stop.stop_strings.is_empty() && self.detokenizer.is_some())
    }

    /// Takes the token just appended to `generated` (all generated tokens) into `text` and
    /// returns the stop that it completes, if any (at one token: EOS, then a stop sequence,
    /// then a stop string; only a stop string sets `text.stop_at`).
    ///
    /// # Errors
    /// The detokenizer's.
    pub fn token(&self, text: &mut TextTracker, generated: &[u32]) -> Result<Option<FinishReason>> {
        if let Some(d) = self.detokenizer {
            text.push(d, generated)?;
        }
        if generated.len() < self.min_tokens {
            return Ok(None);
        }
        if let Some(r) = self.stop.check(generated) {
            return Ok(Some(r));
        }
        if self.detokenizer.is_some() && text.find_stop(self.stop) {
            return Ok(Some(FinishReason::StopString));
        }
        Ok(None)
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
