//! The batch API for engines: many sequences, ragged draft lengths, one call.

use super::{DraftQ, StepOutput, Verifier, VerifyRequest};
use crate::error::{Error, Result};
use crate::sampling::{Logit, SamplingConfig};
use crate::tree::SiblingScheme;

/// Per-sequence parameters of a [`VerifyBatch`].
///
/// `Q` is the dtype of the sequence's own draft q rows ([`SequenceParams::draft_probs`]), the
/// same as the batch's.
#[derive(Debug, Clone, Copy)]
pub struct SequenceParams<'a, Q = f32> {
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
    /// Tokens banned at the sequence's rows `0..suppress_rows` (depths, for a tree;
    /// [`VerifyRequest::suppress`]).
    pub suppress: &'a [u32],
    /// Number of leading rows (depths, for a tree) at which `suppress` applies.
    pub suppress_rows: usize,
    /// The sequence's own draft form, overriding the batch's [`VerifyBatch::draft_probs`]:
    /// point masses, or its own `[k_b, draft_vocab_b]` probabilities or draft logits (its own
    /// width, independent of the other sequences'). `None` (the default) takes the sequence's
    /// rows of the batch-level form. This lets one batch mix deterministic proposers (prompt
    /// lookup: point masses) and sampling draft models (dense q) without one-hot q rows.
    pub draft_probs: Option<DraftQ<'a, Q>>,
    /// The sequence's final draft ends it (a chain cut at EOS or a stop), so its target rows
    /// are `[k_b, vocab]`: no row past the end is processed (case C11;
    /// [`VerifyRequest::final_draft_ends`]). Default `false`.
    pub final_draft_ends: bool,
    /// Best ids per target row to report for the sequence's proposer
    /// ([`VerifyRequest::row_top_k`]); default 0 (none computed).
    pub row_top_k: usize,
}

impl<'a, Q: Logit> SequenceParams<'a, Q> {
    /// Parameters with an empty context, `position = None` and the batch's draft form. `Q` is
    /// the batch's q dtype (inferred from the batch the parameters go into).
    pub fn new(config: &'a SamplingConfig, seed: u64) -> Self {
        SequenceParams {
            config,
            seed,
            context: &[],
            position: None,
            prompt_len: 0,
            suppress: &[],
            suppress_rows: 0,
            draft_probs: None,
            final_draft_ends: false,
            row_top_k: 0,
        }
    }

    /// Marks the sequence's final draft as ending it ([`SequenceParams::final_draft_ends`]):
    /// its target rows are then `[k_b, vocab]`.
    pub fn final_draft_ends(mut self, ends: bool) -> Self {
        self.final_draft_ends = ends;
        self
    }

    /// Asks for the best `k` ids of each of the sequence's target rows
    /// ([`SequenceParams::row_top_k`]).
    pub fn row_top_k(mut self, k: usize) -> Self {
        self.row_top_k = k;
        self
    }

    /// Gives the sequence its own draft form ([`SequenceParams::draft_probs`]): point masses,
    /// or `[k_b, draft_vocab_b]` probabilities or draft logits, in the batch's q dtype.
    pub fn draft_probs(mut self, q: DraftQ<'a, Q>) -> Self {
        self.draft_probs = Some(q);
        self
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

/// A batch of sequences with ragged draft lengths (chains or token trees), flattened.
///
/// Sequence `b` has `k_b = draft_offsets[b + 1] - draft_offsets[b]` drafts
/// `draft_tokens[draft_offsets[b]..draft_offsets[b + 1]]`; its target rows are
/// `draft_offsets[b] + b ..= draft_offsets[b + 1] + b` of `target_logits`
/// (`[sum_b (k_b + 1), vocab_size]` row-major), and its q rows (if any) are
/// `draft_offsets[b]..draft_offsets[b + 1]` of the `[sum_b k_b, draft_vocab]` array in
/// `draft_probs`, unless the sequence brings its own form ([`SequenceParams::draft_probs`]).
/// A sequence whose final draft ends it ([`SequenceParams::final_draft_ends`]) has one row
/// less (`k_b` rows), and the rows of the sequences after it move up by one.
///
/// Trees: [`VerifyBatch::parents`], [`VerifyBatch::schemes`] and [`VerifyBatch::ends`] are
/// aligned with `draft_tokens` (`[sum_b k_b]`, or absent / empty for none), and sequence `b`'s
/// slice `draft_offsets[b]..draft_offsets[b + 1]` of each is its own
/// [`VerifyRequest::parents`], [`VerifyRequest::schemes`] and [`VerifyRequest::ends`]: parent
/// rows are local to the sequence (`0` for a child of its root, `j + 1` for a child of its node
/// `j`), and its rows stay `[k_b + 1, vocab]`. A sequence whose parents are `i` at its node `i`
/// is a chain, so one batch may mix chains and trees.
///
/// Target logits are in dtype `L`, draft q rows in dtype `Q` (any [`Logit`], `f32` by
/// default), as in [`VerifyRequest`]. From an `ndarray` view: [`VerifyBatch::from_array`].
///
/// A sequence's result depends only on its own rows, parameters and seed, never on its place in
/// the batch or on the other sequences (case C08).
#[derive(Debug, Clone, Copy)]
pub struct VerifyBatch<'a, L = f32, Q = f32> {
    /// Width of a target row, in tokens.
    pub vocab_size: usize,
    /// Target logits `[sum_b (k_b + 1), vocab_size]`.
    pub target_logits: &'a [L],
    /// All draft tokens, `[sum_b k_b]`.
    pub draft_tokens: &'a [u32],
    /// `[batch + 1]` offsets into `draft_tokens`: starts at 0, non-decreasing, ends at
    /// `draft_tokens.len()`.
    pub draft_offsets: &'a [usize],
    /// q for the sequences that do not bring their own ([`SequenceParams::draft_probs`]):
    /// `[sum_b k_b, draft_vocab]` (rows of sequences with their own form are present but not
    /// read), or point masses.
    pub draft_probs: DraftQ<'a, Q>,
    /// One entry per sequence.
    pub sequences: &'a [SequenceParams<'a, Q>],
    /// Parent row of every draft, `[sum_b k_b]`, local to its sequence (see the type docs), or
    /// `None` when every sequence is a chain.
    pub parents: Option<&'a [u32]>,
    /// Sibling scheme of every draft's group, `[sum_b k_b]`, or `None` for the default of each
    /// sequence's draft form ([`crate::TreeLimits::default_scheme`]).
    pub schemes: Option<&'a [SiblingScheme]>,
    /// Per draft, `[sum_b k_b]` or empty for none: `true` when accepting it ends its sequence
    /// ([`VerifyRequest::ends`]).
    pub ends: &'a [bool],
}

impl<'a, L, Q> VerifyBatch<'a, L, Q> {
    /// Makes the drafts token trees with parent rows `parents` (`[sum_b k_b]`, local to each
    /// sequence; see [`VerifyBatch::parents`]).
    pub fn tree(mut self, parents: &'a [u32]) -> Self {
        self.parents = Some(parents);
        self
    }

    /// Sets the sibling scheme of every draft's group (`[sum_b k_b]`).
    pub fn schemes(mut self, schemes: &'a [SiblingScheme]) -> Self {
        self.schemes = Some(schemes);
        self
    }

    /// Marks the drafts whose acceptance ends their sequence (`[sum_b k_b]`).
    pub fn node_ends(mut self, ends: &'a [bool]) -> Self {
        self.ends = ends;
        self
    }
}

/// Sequence `b`'s draft form: its own ([`SequenceParams::draft_probs`]), else its rows
/// `lo..hi` of the batch-level form of width `qv` (layout-checked by [`check_layout`]).
pub(crate) fn sequence_q<'a, Q>(
    batch: DraftQ<'a, Q>,
    own: Option<DraftQ<'a, Q>>,
    lo: usize,
    hi: usize,
    qv: usize,
) -> DraftQ<'a, Q> {
    if let Some(q) = own {
        return q;
    }
    match batch {
        DraftQ::PointMass => DraftQ::PointMass,
        DraftQ::Probs { probs, .. } => DraftQ::Probs {
            probs: &probs[lo * qv..hi * qv],
            vocab: qv,
        },
        DraftQ::Logits { logits, .. } => DraftQ::Logits {
            logits: &logits[lo * qv..hi * qv],
            vocab: qv,
        },
    }
}

impl Verifier {
    /// Verifies every sequence of a batch.
    ///
    /// Greedy sequences take the argmax-only path (no softmax, no random draw); a batch whose
    /// sequences are all greedy never touches the distribution buffers. Each sequence is
    /// verified with its own draft form when it has one ([`SequenceParams::draft_probs`]): the
    /// outcome is the one of that sequence verified alone with [`Verifier::verify`].
    ///
    /// Token trees are verified as [`Verifier::verify`] verifies them (module docs, section
    /// "Trees"); a sequence's result equals verifying it alone, chain or tree.
    ///
    /// # Errors
    /// The outer `Err` is for a malformed batch: [`Error::ShapeMismatch`] when the offsets,
    /// sequences and arrays (`parents`, `schemes` and `ends` included) disagree,
    /// [`Error::InvalidOffsets`] when the offsets do not start at 0 or decrease,
    /// [`Error::DraftVocabTooLarge`] for the batch-level form. Each inner `Result` is that
    /// sequence's own outcome with the errors of [`Verifier::verify`] (the shape of a sequence's
    /// own draft form and the structure of its tree included); one bad sequence does not fail
    /// the others.
    pub fn verify_batch<L: Logit, Q: Logit>(
        &mut self,
        batch: &VerifyBatch<'_, L, Q>,
    ) -> Result<Vec<Result<StepOutput>>> {
        let off = batch.draft_offsets;
        let n = batch.sequences.len();
        let v = batch.vocab_size;
        let qv = check_layout(off, n, batch.draft_tokens.len(), v, &batch.draft_probs)?;
        check_tree_layout(
            batch.draft_tokens.len(),
            batch.parents,
            batch.schemes,
            batch.ends,
        )?;
        let cut = batch
            .sequences
            .iter()
            .filter(|s| s.final_draft_ends)
            .count();
        let rows = (batch.draft_tokens.len() + n).saturating_sub(cut);
        let expected = rows.saturating_mul(v);
        if batch.target_logits.len() != expected {
            return Err(Error::ShapeMismatch {
                what: "target_logits ([sum(k + 1), vocab])",
                expected,
                actual: batch.target_logits.len(),
            });
        }
        let mut out = Vec::with_capacity(n);
        let mut row = 0;
        for b in 0..n {
            let (lo, hi) = (off[b], off[b + 1]);
            // A sequence ending at its final draft of none has no row at all; it is verified
            // (and rejected) alone.
            let own = (hi - lo + 1).saturating_sub(batch.sequences[b].final_draft_ends as usize);
            let target = &batch.target_logits[row * v..(row + own) * v];
            row += own;
            let req = sequence_request(
                batch.sequences,
                batch.draft_tokens,
                off,
                batch.draft_probs,
                (b, qv, v),
                target,
            )
            .with_tree(batch.parents, batch.schemes, batch.ends, (lo, hi));
            out.push(self.verify(&req));
        }
        Ok(out)
    }
}

/// Sequence `b` of a layout-checked batch (`(b, draft vocab qv, vocab)`) as one request with
/// `target` as its target logits: its drafts, its own draft form or its rows of the batch-level
/// one, and its parameters; a chain until [`VerifyRequest::with_tree`] gives it its slices of
/// the batch's tree arrays. Shared by [`Verifier::verify_batch`] and the GPU packer, so both
/// verify exactly the request a sequence would be alone.
pub(crate) fn sequence_request<'a, L, Q: Copy>(
    sequences: &'a [SequenceParams<'a, Q>],
    draft_tokens: &'a [u32],
    offsets: &[usize],
    batch_q: DraftQ<'a, Q>,
    (b, qv, vocab_size): (usize, usize, usize),
    target: &'a [L],
) -> VerifyRequest<'a, L, Q> {
    let (lo, hi) = (offsets[b], offsets[b + 1]);
    let s = &sequences[b];
    VerifyRequest {
        config: s.config,
        target_logits: target,
        vocab_size,
        draft_tokens: &draft_tokens[lo..hi],
        draft_probs: sequence_q(batch_q, s.draft_probs, lo, hi, qv),
        context: s.context,
        seed: s.seed,
        position: s.position,
        prompt_len: s.prompt_len,
        suppress: s.suppress,
        suppress_rows: s.suppress_rows,
        final_draft_ends: s.final_draft_ends,
        parents: None,
        schemes: None,
        ends: &[],
        row_top_k: s.row_top_k,
    }
}

impl<'a, L, Q> VerifyRequest<'a, L, Q> {
    /// Gives a batch sequence (drafts `lo..hi` of the batch) its slices of the batch's
    /// layout-checked tree arrays ([`check_tree_layout`]).
    pub(crate) fn with_tree(
        mut self,
        parents: Option<&'a [u32]>,
        schemes: Option<&'a [SiblingScheme]>,
        ends: &'a [bool],
        (lo, hi): (usize, usize),
    ) -> Self {
        self.parents = parents.map(|p| &p[lo..hi]);
        self.schemes = schemes.map(|s| &s[lo..hi]);
        self.ends = if ends.is_empty() { ends } else { &ends[lo..hi] };
        self
    }
}

/// The batch-level shape checks of the tree arrays shared by [`Verifier::verify_batch`] and
/// the GPU backends: `parents` and `schemes` (when given) and `ends` (when not empty) have one
/// entry per draft token.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming the array.
pub(crate) fn check_tree_layout(
    draft_tokens: usize,
    parents: Option<&[u32]>,
    schemes: Option<&[SiblingScheme]>,
    ends: &[bool],
) -> Result<()> {
    let lens = [
        ("parents ([sum k])", parents.map(<[u32]>::len)),
        ("schemes ([sum k])", schemes.map(<[SiblingScheme]>::len)),
        (
            "ends ([sum k] or empty)",
            (!ends.is_empty()).then_some(ends.len()),
        ),
    ];
    for (what, len) in lens {
        if let Some(actual) = len.filter(|&l| l != draft_tokens) {
            return Err(Error::ShapeMismatch {
                what,
                expected: draft_tokens,
                actual,
            });
        }
    }
    Ok(())
}

/// The batch-level layout checks shared by [`Verifier::verify_batch`] and the GPU backends:
/// `offsets` (`[n_seq + 1]`, from 0, non-decreasing, ending at `draft_tokens`) and the draft
/// probabilities' shape (`[draft_tokens, draft_vocab]`, `draft_vocab <= vocab`). Returns the
/// draft vocabulary (0 for point masses).
///
/// # Errors
/// [`Error::ShapeMismatch`], [`Error::InvalidOffsets`] or [`Error::DraftVocabTooLarge`], as
/// documented on [`Verifier::verify_batch`].
pub(crate) fn check_layout<Q>(
    off: &[usize],
    n: usize,
    draft_tokens: usize,
    vocab: usize,
    draft_probs: &DraftQ<'_, Q>,
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
        DraftQ::PointMass => Ok(0),
        DraftQ::Probs {
            probs: d,
            vocab: qv,
        }
        | DraftQ::Logits {
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
