//! The batch API for engines: many sequences, ragged draft lengths, one call.

use super::request::sequence_state_setters;
use super::{DraftQ, SequenceState, StepOutput, Verifier, VerifyRequest};
use crate::error::{Error, Result};
use crate::sampling::{Logit, SamplingConfig};
use crate::tree::{DraftBlock, SiblingScheme};

/// Per-sequence parameters of a [`VerifyBatch`]: the sequence's [`SequenceState`] and,
/// optionally, its own draft form.
///
/// `Q` is the dtype of the sequence's own draft q rows ([`SequenceParams::draft_probs`]), the
/// same as the batch's. Build with [`SequenceParams::new`] (or `From<SequenceState>`) and the
/// setters, which are [`SequenceState`]'s.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct SequenceParams<'a, Q = f32> {
    /// The sequence: configuration, seed, position, context, suppression, row candidates
    /// (row candidates are computed by [`Verifier::verify`] only; see
    /// [`StepOutput::row_top`]).
    pub state: SequenceState<'a>,
    /// The sequence's own draft form, overriding the batch's [`VerifyBatch::draft_probs`]:
    /// point masses, or its own `[k_b, draft_vocab_b]` probabilities or draft logits (its own
    /// width, independent of the other sequences'). `None` (the default) takes the sequence's
    /// rows of the batch-level form. This lets one batch mix deterministic proposers (prompt
    /// lookup: point masses) and sampling draft models (dense q) without one-hot q rows.
    pub draft_probs: Option<DraftQ<'a, Q>>,
}

impl<'a, Q: Logit> SequenceParams<'a, Q> {
    /// Parameters with the state [`SequenceState::new`]`(config)` and seed `seed`, and the
    /// batch's draft form. `Q` is the batch's q dtype (inferred from the batch the parameters
    /// go into).
    pub fn new(config: &'a SamplingConfig, seed: u64) -> Self {
        SequenceState::new(config).seed(seed).into()
    }

    /// Gives the sequence its own draft form ([`SequenceParams::draft_probs`]): point masses,
    /// or `[k_b, draft_vocab_b]` probabilities or draft logits, in the batch's q dtype.
    pub fn draft_probs(mut self, q: DraftQ<'a, Q>) -> Self {
        self.draft_probs = Some(q);
        self
    }

    sequence_state_setters!();
}

impl<'a, Q> From<SequenceState<'a>> for SequenceParams<'a, Q> {
    /// The parameters of a sequence with state `state` and the batch's draft form.
    fn from(state: SequenceState<'a>) -> Self {
        SequenceParams {
            state,
            draft_probs: None,
        }
    }
}

/// A batch of sequences with ragged draft lengths (chains or token trees), flattened.
///
/// Sequence `b` has `k_b = draft_offsets[b + 1] - draft_offsets[b]` drafts
/// `draft_tokens[draft_offsets[b]..draft_offsets[b + 1]]`; its target rows follow those of the
/// sequences before it in `target_logits` (`[sum_b rows_b, vocab_size]` row-major, with
/// `rows_b = k_b + 1`), and its q rows (if any) are `draft_offsets[b]..draft_offsets[b + 1]` of
/// the `[sum_b k_b, draft_vocab]` array in `draft_probs`, unless the sequence brings its own
/// form ([`SequenceParams::draft_probs`]).
///
/// Trees and ends: [`VerifyBatch::parents`], [`VerifyBatch::schemes`] and
/// [`VerifyBatch::ends`] are aligned with `draft_tokens` (`[sum_b k_b]`, or absent / empty for
/// none), and sequence `b`'s slice `draft_offsets[b]..draft_offsets[b + 1]` of each makes its
/// own [`DraftBlock`] (parents, [`DraftBlock::with_schemes`], [`DraftBlock::with_ends`]):
/// parent rows are local to the sequence (`0` for a child of its root, `j + 1` for a child of
/// its node `j`). A sequence whose parents are `i` at its node `i` is a chain, so one batch may
/// mix chains and trees. A chain whose final draft ends it has one row less (`rows_b = k_b`:
/// no row follows the end, case C11; [`DraftBlock::verify_rows`]), and the rows of the
/// sequences after it move up by one.
///
/// Target logits are in dtype `L`, draft q rows in dtype `Q` (any [`Logit`], `f32` by
/// default), as in [`VerifyRequest`]. Build with [`VerifyBatch::new`] and the setters, or from
/// an `ndarray` view with [`VerifyBatch::from_array`].
///
/// A sequence's result depends only on its own rows, parameters and seed, never on its place in
/// the batch or on the other sequences (case C08).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct VerifyBatch<'a, L = f32, Q = f32> {
    /// Width of a target row, in tokens.
    pub vocab_size: usize,
    /// Target logits `[sum_b rows_b, vocab_size]` (`rows_b = k_b + 1`, or `k_b`; see the type
    /// docs).
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
    /// ([`DraftBlock::with_ends`]).
    pub ends: &'a [bool],
}

impl<'a, L> VerifyBatch<'a, L> {
    /// A batch of chains with point-mass drafts and `f32` q rows (set a dense q with
    /// [`VerifyBatch::draft_probs`]): `target_logits` `[sum_b (k_b + 1), vocab_size]`,
    /// `draft_tokens` `[sum_b k_b]`, `draft_offsets` `[batch + 1]` and one [`SequenceParams`]
    /// per sequence. Not checked here: [`Verifier::verify_batch`] does. For q rows in another
    /// dtype: [`VerifyBatch::with_q`].
    pub fn new(
        vocab_size: usize,
        target_logits: &'a [L],
        draft_tokens: &'a [u32],
        draft_offsets: &'a [usize],
        sequences: &'a [SequenceParams<'a>],
    ) -> Self {
        VerifyBatch::with_q(
            vocab_size,
            target_logits,
            draft_tokens,
            draft_offsets,
            DraftQ::PointMass,
            sequences,
        )
    }
}

impl<'a, L, Q> VerifyBatch<'a, L, Q> {
    /// [`VerifyBatch::new`] with the batch-level draft form `draft_probs` in any q dtype `Q`
    /// (the dtype of the sequences' own forms too).
    pub fn with_q(
        vocab_size: usize,
        target_logits: &'a [L],
        draft_tokens: &'a [u32],
        draft_offsets: &'a [usize],
        draft_probs: DraftQ<'a, Q>,
        sequences: &'a [SequenceParams<'a, Q>],
    ) -> Self {
        VerifyBatch {
            vocab_size,
            target_logits,
            draft_tokens,
            draft_offsets,
            draft_probs,
            sequences,
            parents: None,
            schemes: None,
            ends: &[],
        }
    }

    /// Sets the batch-level draft form ([`VerifyBatch::draft_probs`]).
    pub fn draft_probs(mut self, q: DraftQ<'a, Q>) -> Self {
        self.draft_probs = q;
        self
    }

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

    /// Marks the drafts whose acceptance ends their sequence (`[sum_b k_b]`; see
    /// [`VerifyBatch::ends`]).
    pub fn ends(mut self, ends: &'a [bool]) -> Self {
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
        let layout = BatchLayout::of(batch);
        let n = batch.sequences.len();
        let v = batch.vocab_size;
        let qv = layout.check(n, v, &batch.draft_probs)?;
        let rows: usize = (0..n).map(|b| layout.block(b).verify_rows()).sum();
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
            let own = layout.block(b).verify_rows();
            let target = &batch.target_logits[row * v..(row + own) * v];
            row += own;
            let req = layout.request(batch.sequences, batch.draft_probs, (b, qv, v), target);
            out.push(self.verify(&req));
        }
        Ok(out)
    }
}

/// The draft layout of a batch: tokens, offsets and the tree arrays, aligned with the tokens.
/// Shared by [`Verifier::verify_batch`] and the GPU backends' batch, so both cut a sequence out
/// of a batch the same way.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchLayout<'a> {
    /// All draft tokens, `[sum_b k_b]`.
    pub draft_tokens: &'a [u32],
    /// `[batch + 1]` offsets into `draft_tokens`.
    pub draft_offsets: &'a [usize],
    /// Parent rows, `[sum_b k_b]` (local to each sequence), or `None`.
    pub parents: Option<&'a [u32]>,
    /// Sibling schemes, `[sum_b k_b]`, or `None`.
    pub schemes: Option<&'a [SiblingScheme]>,
    /// End flags, `[sum_b k_b]` or empty.
    pub ends: &'a [bool],
}

impl<'a> BatchLayout<'a> {
    /// The layout of `batch`.
    pub fn of<L, Q>(batch: &VerifyBatch<'a, L, Q>) -> Self {
        BatchLayout {
            draft_tokens: batch.draft_tokens,
            draft_offsets: batch.draft_offsets,
            parents: batch.parents,
            schemes: batch.schemes,
            ends: batch.ends,
        }
    }

    /// The batch-level checks: [`check_layout`] (offsets for `n` sequences, q shape against
    /// `vocab`) and [`check_tree_layout`]. Returns the draft vocabulary (0 for point masses).
    ///
    /// # Errors
    /// Those of [`check_layout`] and [`check_tree_layout`].
    pub fn check<Q>(&self, n: usize, vocab: usize, q: &DraftQ<'_, Q>) -> Result<usize> {
        let k = self.draft_tokens.len();
        let qv = check_layout(self.draft_offsets, n, k, vocab, q)?;
        check_tree_layout(k, self.parents, self.schemes, self.ends)?;
        Ok(qv)
    }

    /// Sequence `b`'s drafts (of a layout-checked batch): its tokens and its slices of the
    /// tree arrays.
    pub fn block(&self, b: usize) -> DraftBlock<'a> {
        let (lo, hi) = (self.draft_offsets[b], self.draft_offsets[b + 1]);
        let tokens = &self.draft_tokens[lo..hi];
        let mut block = match self.parents {
            None => DraftBlock::chain(tokens),
            Some(p) => DraftBlock::tree(tokens, &p[lo..hi]),
        };
        if let Some(s) = self.schemes {
            block = block.with_schemes(&s[lo..hi]);
        }
        if !self.ends.is_empty() {
            block = block.with_ends(&self.ends[lo..hi]);
        }
        block
    }

    /// Sequence `b` of a layout-checked batch (`(b, draft vocab qv, vocab)`) as one request with
    /// `target` as its target logits: its drafts ([`BatchLayout::block`]), its own draft form
    /// or its rows of the batch-level one, and its state. So the CPU and GPU paths verify
    /// exactly the request a sequence would be alone.
    pub fn request<L, Q: Copy>(
        &self,
        sequences: &'a [SequenceParams<'a, Q>],
        batch_q: DraftQ<'a, Q>,
        (b, qv, vocab_size): (usize, usize, usize),
        target: &'a [L],
    ) -> VerifyRequest<'a, L, Q> {
        let (lo, hi) = (self.draft_offsets[b], self.draft_offsets[b + 1]);
        let s = &sequences[b];
        VerifyRequest {
            state: s.state,
            target_logits: target,
            vocab_size,
            draft: self.block(b),
            draft_probs: sequence_q(batch_q, s.draft_probs, lo, hi, qv),
        }
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
