//! The batch API for engines: many sequences, ragged draft lengths, one call.

use super::{DraftProbs, StepOutput, Verifier, VerifyRequest};
use crate::error::{Error, Result};
use crate::sampling::SamplingConfig;

/// Per-sequence parameters of a [`VerifyBatch`].
#[derive(Debug, Clone, Copy)]
pub struct SequenceParams<'a> {
    /// The sequence's sampling configuration.
    pub config: &'a SamplingConfig,
    /// The sequence's seed.
    pub seed: u64,
    /// Tokens before the block (prompt + generated) for penalties and masks; may be empty when
    /// the configuration uses neither.
    pub context: &'a [u32],
    /// Absolute position of the token emitted at the sequence's first row; `None` means
    /// `context.len()`. **It must advance from step to step** (pass the context, or the number of
    /// tokens before the block): random draws are keyed by `(seed, position)`, so a position that
    /// stays at 0 reuses the same uniforms every step and correlates the steps.
    pub position: Option<u64>,
    /// Number of leading `context` tokens that are the prompt ([`VerifyRequest::prompt_len`]).
    pub prompt_len: usize,
    /// Tokens banned at the sequence's rows `0..suppress_rows` ([`VerifyRequest::suppress`]).
    pub suppress: &'a [u32],
    /// Number of leading rows at which `suppress` applies.
    pub suppress_rows: usize,
}

impl<'a> SequenceParams<'a> {
    /// Parameters with an empty context and `position = None`.
    pub fn new(config: &'a SamplingConfig, seed: u64) -> Self {
        SequenceParams {
            config,
            seed,
            context: &[],
            position: None,
            prompt_len: 0,
            suppress: &[],
            suppress_rows: 0,
        }
    }

    /// Sets the context (prompt + generated tokens before the block).
    pub fn context(mut self, context: &'a [u32]) -> Self {
        self.context = context;
        self
    }

    /// Sets the absolute position of the first emitted token.
    pub fn position(mut self, position: u64) -> Self {
        self.position = Some(position);
        self
    }

    /// Sets the prompt length within the context.
    pub fn prompt_len(mut self, prompt_len: usize) -> Self {
        self.prompt_len = prompt_len;
        self
    }

    /// Bans `tokens` at rows `0..rows` only.
    pub fn suppress(mut self, tokens: &'a [u32], rows: usize) -> Self {
        self.suppress = tokens;
        self.suppress_rows = rows;
        self
    }
}

/// A batch of sequences with ragged draft lengths, flattened.
///
/// Sequence `b` has `k_b = draft_offsets[b + 1] - draft_offsets[b]` drafts
/// `draft_tokens[draft_offsets[b]..draft_offsets[b + 1]]`; its target rows are
/// `draft_offsets[b] + b ..= draft_offsets[b + 1] + b` of `target_logits`
/// (`[sum_b (k_b + 1), vocab_size]` row-major), and its q rows (if any) are
/// `draft_offsets[b]..draft_offsets[b + 1]` of the `[sum_b k_b, draft_vocab]` array in
/// `draft_probs`.
///
/// A sequence's result depends only on its own rows, parameters and seed, never on its place in
/// the batch or on the other sequences (case C08).
#[derive(Debug, Clone, Copy)]
pub struct VerifyBatch<'a> {
    /// Width of a target row, in tokens.
    pub vocab_size: usize,
    /// Target logits `[sum_b (k_b + 1), vocab_size]`.
    pub target_logits: &'a [f32],
    /// All draft tokens, `[sum_b k_b]`.
    pub draft_tokens: &'a [u32],
    /// `[batch + 1]` offsets into `draft_tokens`: starts at 0, non-decreasing, ends at
    /// `draft_tokens.len()`.
    pub draft_offsets: &'a [usize],
    /// q for all sequences: `[sum_b k_b, draft_vocab]`, or point masses.
    pub draft_probs: DraftProbs<'a>,
    /// One entry per sequence.
    pub sequences: &'a [SequenceParams<'a>],
}

impl Verifier {
    /// Verifies every sequence of a batch.
    ///
    /// Greedy sequences take the argmax-only path (no softmax, no random draw); a batch whose
    /// sequences are all greedy never touches the distribution buffers.
    ///
    /// # Errors
    /// The outer `Err` is for a malformed batch: [`Error::ShapeMismatch`] when the offsets,
    /// sequences and arrays disagree, [`Error::InvalidOffsets`] when the offsets do not start at
    /// 0 or decrease, [`Error::DraftVocabTooLarge`]. Each inner `Result` is that
    /// sequence's own outcome with the errors of [`Verifier::verify`]; one bad sequence does not
    /// fail the others.
    pub fn verify_batch(&mut self, batch: &VerifyBatch<'_>) -> Result<Vec<Result<StepOutput>>> {
        let off = batch.draft_offsets;
        let n = batch.sequences.len();
        let v = batch.vocab_size;
        let qv = check_layout(off, n, batch.draft_tokens.len(), v, &batch.draft_probs)?;
        let rows = batch.draft_tokens.len() + n;
        let expected = rows.saturating_mul(v);
        if batch.target_logits.len() != expected {
            return Err(Error::ShapeMismatch {
                what: "target_logits ([sum(k + 1), vocab])",
                expected,
                actual: batch.target_logits.len(),
            });
        }
        let mut out = Vec::with_capacity(n);
        for (b, s) in batch.sequences.iter().enumerate() {
            let (lo, hi) = (off[b], off[b + 1]);
            let draft_probs = match batch.draft_probs {
                DraftProbs::PointMass => DraftProbs::PointMass,
                DraftProbs::Probs { probs, .. } => DraftProbs::Probs {
                    probs: &probs[lo * qv..hi * qv],
                    vocab: qv,
                },
                DraftProbs::Logits { logits, .. } => DraftProbs::Logits {
                    logits: &logits[lo * qv..hi * qv],
                    vocab: qv,
                },
            };
            let req = VerifyRequest {
                config: s.config,
                target_logits: &batch.target_logits[(lo + b) * v..(hi + b + 1) * v],
                vocab_size: v,
                draft_tokens: &batch.draft_tokens[lo..hi],
                draft_probs,
                context: s.context,
                seed: s.seed,
                position: s.position,
                prompt_len: s.prompt_len,
                suppress: s.suppress,
                suppress_rows: s.suppress_rows,
                final_draft_ends: false,
            };
            out.push(self.verify(&req));
        }
        Ok(out)
    }
}

/// The batch-level layout checks shared by [`Verifier::verify_batch`] and the GPU backends:
/// `offsets` (`[n_seq + 1]`, from 0, non-decreasing, ending at `draft_tokens`) and the draft
/// probabilities' shape (`[draft_tokens, draft_vocab]`, `draft_vocab <= vocab`). Returns the
/// draft vocabulary (0 for point masses).
///
/// # Errors
/// [`Error::ShapeMismatch`], [`Error::InvalidOffsets`] or [`Error::DraftVocabTooLarge`], as
/// documented on [`Verifier::verify_batch`].
pub(crate) fn check_layout(
    off: &[usize],
    n: usize,
    draft_tokens: usize,
    vocab: usize,
    draft_probs: &DraftProbs<'_>,
) -> Result<usize> {
    if off.len() != n + 1 {
        return Err(Error::ShapeMismatch {
            what: "draft_offsets ([batch + 1])",
            expected: n + 1,
            actual: off.len(),
        });
    }
    if off[0] != 0 {
        return Err(Error::InvalidOffsets {
            index: 0,
            value: off[0],
            reason: "must be 0",
        });
    }
    if let Some(i) = off.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::InvalidOffsets {
            index: i + 1,
            value: off[i + 1],
            reason: "offsets must be non-decreasing",
        });
    }
    if off[n] != draft_tokens {
        return Err(Error::ShapeMismatch {
            what: "draft_tokens (draft_offsets[batch])",
            expected: off[n],
            actual: draft_tokens,
        });
    }
    match *draft_probs {
        DraftProbs::PointMass => Ok(0),
        DraftProbs::Probs {
            probs: d,
            vocab: qv,
        }
        | DraftProbs::Logits {
            logits: d,
            vocab: qv,
        } => {
            if qv > vocab {
                return Err(Error::DraftVocabTooLarge {
                    draft: qv,
                    target: vocab,
                });
            }
            let expected = draft_tokens.saturating_mul(qv);
            if d.len() != expected {
                return Err(Error::ShapeMismatch {
                    what: "draft probabilities ([sum k, draft_vocab])",
                    expected,
                    actual: d.len(),
                });
            }
            Ok(qv)
        }
    }
}
