//! Stop conditions and finish reasons.

/// When a generation stops. Checked token by token, also inside an accepted block: nothing after
/// the stopping token is emitted, streamed or counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopConditions {
    /// End-of-sequence token ids. The EOS token itself is emitted (it is the last token).
    pub eos: Vec<u32>,
    /// Stop token sequences, matched against the generated tokens only (not the prompt),
    /// including across step boundaries. The completing tokens are emitted.
    pub stop_sequences: Vec<Vec<u32>>,
    /// Maximum number of new tokens.
    pub max_new_tokens: usize,
}

impl Default for StopConditions {
    fn default() -> Self {
        StopConditions {
            eos: Vec::new(),
            stop_sequences: Vec::new(),
            max_new_tokens: 256,
        }
    }
}

impl StopConditions {
    /// At most `max_new_tokens` new tokens, no EOS, no stop sequence.
    pub fn max_tokens(max_new_tokens: usize) -> Self {
        StopConditions {
            max_new_tokens,
            ..Default::default()
        }
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

    /// The reason to stop after `generated` (the new tokens so far, the last one just appended),
    /// or `None`. Budget and context are checked by the loop.
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
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FinishReason {
    /// An EOS token was emitted.
    Eos,
    /// A stop sequence was completed.
    StopSequence,
    /// `max_new_tokens` were emitted.
    MaxTokens,
    /// The sequence filled the model's context (`max_context` tokens).
    ContextFull,
    /// The caller cancelled (cancel flag or streaming callback).
    Cancelled,
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FinishReason::Eos => "eos",
            FinishReason::StopSequence => "stop_sequence",
            FinishReason::MaxTokens => "max_tokens",
            FinishReason::ContextFull => "context_full",
            FinishReason::Cancelled => "cancelled",
        })
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
