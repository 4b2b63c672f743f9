//! Validation of a [`VerifyRequest`] before any random draw (case C14), as named checks run in
//! a fixed order: shapes, draft token ids, tree structure, the ids of the sampling inputs, the
//! q shape, the q rows, and the raw target logits. The order is part of the contract: with
//! several faults the first in this order is reported, on the CPU and the GPU backends alike.
//!
//! Two entry points: [`VerifyRequest::validate`] for target logits in host memory (every
//! check), and [`VerifyRequest::validate_inputs`] for target logits that live elsewhere
//! (device memory), which skips the two checks that read them.

use super::{DraftQ, VerifyRequest, group_first, row, scheme_default};
use crate::error::{Error, Result, RowKind};
use crate::sampling::Logit;
use crate::tree::{DraftBlock, SiblingScheme, TreeLimits};

impl<L: Logit, Q: Logit> VerifyRequest<'_, L, Q> {
    /// Checks everything that does not need processing: shapes, vocabularies, token ids, dense q
    /// rows and raw logit values, for the whole input (case C14).
    pub(crate) fn validate(&self) -> Result<()> {
        let target_len = self.check_shapes()?;
        self.check_target_len(target_len)?;
        self.check_draft()?;
        check_finite(self.target_logits, self.vocab_size, RowKind::Target)
    }

    /// [`VerifyRequest::validate`] for target logits that live elsewhere (device memory): the
    /// same checks in the same order, without the target logits' shape and values.
    pub(crate) fn validate_inputs(&self) -> Result<()> {
        self.check_shapes()?;
        self.check_draft()
    }

    /// The checks that do not read the target logits, after [`Self::check_shapes`] (and the
    /// target length): draft ids, tree, sampling ids, q shape, q rows.
    fn check_draft(&self) -> Result<()> {
        self.check_draft_ids()?;
        let block = self.draft;
        self.check_tree(&block)?;
        self.check_sampling_ids()?;
        self.check_q_shape(&block)?;
        self.check_q_rows(&block)
    }

    /// The vocabulary is not empty and `[rows, vocab]` fits in `usize`. Returns the expected
    /// `target_logits` length ([`DraftBlock::verify_rows`] rows).
    fn check_shapes(&self) -> Result<usize> {
        let v = self.vocab_size;
        if v == 0 {
            return Err(Error::ShapeMismatch {
                what: "vocab_size",
                expected: 1,
                actual: 0,
            });
        }
        self.target_rows()
            .checked_mul(v)
            .ok_or(Error::ShapeMismatch {
                what: "target_logits",
                expected: usize::MAX,
                actual: self.target_logits.len(),
            })
    }

    /// `target_logits` holds `expected` values (`[k + 1, vocab]`, or `[k, vocab]` for a chain
    /// whose final draft ends).
    fn check_target_len(&self, expected: usize) -> Result<()> {
        if self.target_logits.len() != expected {
            return Err(Error::ShapeMismatch {
                what: if self.draft.final_ends() {
                    "target_logits ([k, vocab]: the final draft ends)"
                } else {
                    "target_logits ([k + 1, vocab])"
                },
                expected,
                actual: self.target_logits.len(),
            });
        }
        Ok(())
    }

    /// Every draft token is inside the target vocabulary.
    fn check_draft_ids(&self) -> Result<()> {
        let v = self.vocab_size;
        match self.draft.tokens().iter().find(|&&t| t as usize >= v) {
            Some(&t) => Err(Error::TokenOutOfVocab {
                what: "draft token",
                token: t,
                vocab_size: v,
            }),
            None => Ok(()),
        }
    }

    /// The tree's structure: [`DraftBlock::validate`] without node or depth limits (ending
    /// nodes included: `[k]` or empty, leaves only).
    fn check_tree(&self, block: &DraftBlock<'_>) -> Result<()> {
        block
            .validate(&TreeLimits::vocab(self.vocab_size).with_dense_q(self.dense_q()))
            .map_err(Error::InvalidTree)
    }

    /// The tokens of the configuration, the context (when a mask reads it) and the suppressed
    /// tokens are inside the target vocabulary.
    fn check_sampling_ids(&self) -> Result<()> {
        let v = self.vocab_size;
        self.state.config.check_vocab(v)?;
        // The context reaches the caller's mask (and the penalties, which check it themselves).
        if self.state.config.mask.is_some()
            && let Some(&t) = self.state.context.iter().find(|&&t| t as usize >= v)
        {
            return Err(Error::TokenOutOfVocab {
                what: "context token",
                token: t,
                vocab_size: v,
            });
        }
        if let Some(&t) = self.state.suppress.iter().find(|&&t| t as usize >= v) {
            return Err(Error::TokenOutOfVocab {
                what: "suppressed token",
                token: t,
                vocab_size: v,
            });
        }
        Ok(())
    }

    /// Dense q (probabilities or draft logits) is `[k, draft_vocab]` with
    /// `0 < draft_vocab <= vocab` (when `k > 0`), and the token of every node of a sampled group
    /// is inside the draft vocabulary.
    fn check_q_shape(&self, block: &DraftBlock<'_>) -> Result<()> {
        let (v, k) = (self.vocab_size, self.k());
        let (DraftQ::Probs { probs: data, vocab }
        | DraftQ::Logits {
            logits: data,
            vocab,
        }) = self.draft_probs
        else {
            return Ok(());
        };
        if vocab > v {
            return Err(Error::DraftVocabTooLarge {
                draft: vocab,
                target: v,
            });
        }
        if vocab == 0 && k > 0 {
            return Err(Error::ShapeMismatch {
                what: "draft vocab",
                expected: 1,
                actual: 0,
            });
        }
        let expected = k.saturating_mul(vocab);
        if data.len() != expected {
            return Err(Error::ShapeMismatch {
                what: "draft probabilities ([k, draft_vocab])",
                expected,
                actual: data.len(),
            });
        }
        for (i, &t) in self.draft.tokens().iter().enumerate() {
            if t as usize >= vocab && self.sampled(block, i) {
                return Err(Error::TokenOutOfVocab {
                    what: "draft token (draft vocabulary)",
                    token: t,
                    vocab_size: vocab,
                });
            }
        }
        Ok(())
    }

    /// The q rows of the nodes of sampled groups, node by node (the q rows of deterministic
    /// groups are not read: those nodes are point masses). Probabilities: the group's first row
    /// is a distribution, later siblings carry the same row, and every node's token has
    /// probability > 0. Draft logits: finite (no NaN or `+inf`) and the same row across a group.
    fn check_q_rows(&self, block: &DraftBlock<'_>) -> Result<()> {
        match self.draft_probs {
            DraftQ::PointMass => Ok(()),
            DraftQ::Probs { probs, vocab: qv } => self.check_q_probs(block, probs, qv),
            DraftQ::Logits { logits, vocab: qv } => self.check_q_logits(block, logits, qv),
        }
    }

    /// [`Self::check_q_rows`] for dense probabilities `[k, qv]`.
    fn check_q_probs(&self, block: &DraftBlock<'_>, probs: &[Q], qv: usize) -> Result<()> {
        for (i, &d) in self.draft.tokens().iter().enumerate() {
            if !self.sampled(block, i) {
                continue;
            }
            let q = row(probs, qv, i);
            // A later sibling's row must equal its group's first row, which was checked
            // in full: the equality is the whole check (one pass over the row, not two).
            if group_first(block, i) == i {
                check_dense_q(q, i)?;
            } else {
                check_group_row(probs, qv, block, i)?;
            }
            if q[d as usize].widen() <= 0.0 {
                return Err(Error::InvalidDraftProbs {
                    row: i,
                    reason: "the drafted token has probability 0 under q",
                });
            }
        }
        Ok(())
    }

    /// [`Self::check_q_rows`] for raw draft logits `[k, qv]`.
    fn check_q_logits(&self, block: &DraftBlock<'_>, logits: &[Q], qv: usize) -> Result<()> {
        for i in (0..self.k()).filter(|&i| self.sampled(block, i)) {
            if let Some(e) = crate::sampling::non_finite_in(row(logits, qv, i), RowKind::Draft, i) {
                return Err(e);
            }
            check_group_row(logits, qv, block, i)?;
        }
        Ok(())
    }

    /// `true` when the request carries dense q (probabilities or draft logits).
    fn dense_q(&self) -> bool {
        !matches!(self.draft_probs, DraftQ::PointMass)
    }

    /// `true` when node `i`'s group is sampled (its scheme, or the draft form's default, is not
    /// [`SiblingScheme::Deterministic`]): only then is its dense q row read.
    fn sampled(&self, block: &DraftBlock<'_>, i: usize) -> bool {
        block.scheme(i, scheme_default(self.dense_q())) != SiblingScheme::Deterministic
    }
}

/// Checks that node `i`'s dense q row (`[qv]` in `data`) equals the row of its group's first
/// node: the siblings of a sampled group were drawn from one q, and each carries it.
fn check_group_row<Q: Logit>(
    data: &[Q],
    qv: usize,
    block: &DraftBlock<'_>,
    i: usize,
) -> Result<()> {
    let first = group_first(block, i);
    if first != i
        && row(data, qv, first)
            .iter()
            .zip(row(data, qv, i))
            .any(|(a, b)| a.widen() != b.widen())
    {
        return Err(Error::InvalidDraftProbs {
            row: i,
            reason: "siblings of a sampled group (with or without replacement) must carry the same q row, the distribution the group was drawn from",
        });
    }
    Ok(())
}

/// Tolerance on the total of a dense q row (probabilities must sum to 1 within this).
const Q_SUM_TOLERANCE: f64 = 1e-3;

/// Checks one dense q row: finite, non-negative, sums to 1 within [`Q_SUM_TOLERANCE`].
fn check_dense_q<Q: Logit>(q: &[Q], row: usize) -> Result<()> {
    // Eight partial sums (value `i` goes to sum `i % 8`, added in index order), so the loop
    // vectorises instead of waiting on one chain of f64 additions; the spans of buffered dtypes
    // are whole multiples of 8 values, so every dtype adds in the same order.
    // `0 <= x <= f32::MAX` is "finite and non-negative" (NaN fails both comparisons), in a form
    // the compiler vectorises (no early exit: the flags are folded at the end).
    const LANES: usize = 8;
    let mut acc = [0.0f64; LANES];
    let mut ok = [true; LANES];
    crate::sampling::for_each_span(q, |_, block| {
        let chunks = block.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for j in 0..LANES {
                let x = c[j];
                ok[j] &= (0.0..=f32::MAX).contains(&x);
                acc[j] += x as f64;
            }
        }
        for (j, &x) in rest.iter().enumerate() {
            ok[j] &= (0.0..=f32::MAX).contains(&x);
            acc[j] += x as f64;
        }
    });
    let bad = ok.iter().any(|&o| !o);
    let total: f64 = acc.iter().sum();
    if bad {
        return Err(Error::InvalidDraftProbs {
            row,
            reason: "a probability is negative or not finite",
        });
    }
    if (total - 1.0).abs() > Q_SUM_TOLERANCE {
        return Err(Error::InvalidDraftProbs {
            row,
            reason: "probabilities do not sum to 1 (tolerance 1e-3)",
        });
    }
    Ok(())
}

/// Checks every row of `[rows, width]` logits for NaN and `+inf` (`-inf` means banned).
fn check_finite<T: Logit>(logits: &[T], width: usize, kind: RowKind) -> Result<()> {
    if width == 0 {
        return Ok(());
    }
    for (r, row) in logits.chunks_exact(width).enumerate() {
        if let Some(e) = crate::sampling::non_finite_in(row, kind, r) {
            return Err(e);
        }
    }
    Ok(())
}
