//! `ndarray` views as an input form: `ArrayView2` of `[rows, width]` in standard layout, read
//! in place.
//!
//! The verifier reads rows as slices, so a view is accepted when it is in standard layout
//! (contiguous and row-major, [`ndarray::ArrayBase::is_standard_layout`]) and then costs
//! nothing: no copy, the rows are the view's memory. Any other strides (a transposed or
//! column-major array, a slice with a step, a slice of the columns of a wider array) are refused
//! with [`Error::NonContiguous`] rather than copied behind the caller's back: the caller decides
//! whether to pay for the copy, with `view.as_standard_layout()` (which borrows when the view is
//! already in standard layout).

use ndarray::ArrayView2;

use super::{DraftQ, SequenceParams, VerifyBatch, VerifyRequest};
use crate::error::{Error, Result};
use crate::sampling::{Logit, SamplingConfig};

/// The rows of a `[rows, width]` view as one row-major slice (`[rows * width]`, borrowed from
/// the view's memory, no copy) and the width.
///
/// `what` names the input in the error.
///
/// # Errors
/// [`Error::NonContiguous`] when the view is not in standard layout (contiguous, row-major).
///
/// # Example
///
/// ```
/// use ndarray::array;
/// use speculative::{verify::array_rows, Error};
///
/// let a = array![[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]];
/// assert_eq!(array_rows(a.view(), "logits")?, (&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0][..], 3));
/// // A transposed view is column-major: refused, not copied.
/// assert!(matches!(array_rows(a.t(), "logits"), Err(Error::NonContiguous { .. })));
/// // The caller can copy it explicitly.
/// let t = a.t().as_standard_layout().into_owned();
/// assert_eq!(array_rows(t.view(), "logits")?.1, 2);
/// # Ok::<(), Error>(())
/// ```
pub fn array_rows<'a, T>(view: ArrayView2<'a, T>, what: &'static str) -> Result<(&'a [T], usize)> {
    let width = view.ncols();
    match view.to_slice() {
        Some(s) => Ok((s, width)),
        None => Err(Error::NonContiguous { what }),
    }
}

impl<'a, L: Logit> VerifyRequest<'a, L> {
    /// A request ([`VerifyRequest::new`]) whose target logits are an `ndarray` view of shape
    /// `[k + 1, vocab]` (`[k, vocab]` for a chain whose final draft ends,
    /// [`crate::DraftBlock::verify_rows`]), read in place;
    /// the vocabulary size is the view's number of columns.
    ///
    /// # Errors
    /// [`Error::NonContiguous`] when the view is not in standard layout (see [`array_rows`]).
    /// The shape itself is checked by [`crate::Verifier::verify`], as for slices.
    pub fn from_array(
        config: &'a SamplingConfig,
        target_logits: ArrayView2<'a, L>,
        draft_tokens: &'a [u32],
    ) -> Result<Self> {
        let (logits, vocab) = array_rows(target_logits, "target_logits")?;
        Ok(VerifyRequest::new(config, logits, vocab, draft_tokens))
    }
}

impl<'a, Q: Logit> DraftQ<'a, Q> {
    /// [`DraftQ::Probs`] from an `ndarray` view of shape `[k, draft_vocab]`, read in place.
    ///
    /// # Errors
    /// [`Error::NonContiguous`] when the view is not in standard layout (see [`array_rows`]).
    pub fn probs_array(probs: ArrayView2<'a, Q>) -> Result<Self> {
        let (probs, vocab) = array_rows(probs, "draft probabilities")?;
        Ok(DraftQ::Probs { probs, vocab })
    }

    /// [`DraftQ::Logits`] from an `ndarray` view of shape `[k, draft_vocab]`, read in place.
    ///
    /// # Errors
    /// [`Error::NonContiguous`] when the view is not in standard layout (see [`array_rows`]).
    pub fn logits_array(logits: ArrayView2<'a, Q>) -> Result<Self> {
        let (logits, vocab) = array_rows(logits, "draft logits")?;
        Ok(DraftQ::Logits { logits, vocab })
    }
}

impl<'a, L: Logit, Q: Logit> VerifyBatch<'a, L, Q> {
    /// A batch whose target logits are an `ndarray` view of shape `[sum_b (k_b + 1), vocab]`,
    /// read in place; the vocabulary size is the view's number of columns. The other arguments
    /// are the fields of the same names: pass [`DraftProbs::PointMass`](super::DraftProbs) for
    /// point masses, or [`DraftQ::probs_array`] / [`DraftQ::logits_array`] of a
    /// `[sum_b k_b, draft_vocab]` view.
    ///
    /// # Errors
    /// [`Error::NonContiguous`] when the view is not in standard layout (see [`array_rows`]).
    /// The layout of offsets and rows is checked by [`crate::Verifier::verify_batch`].
    pub fn from_array(
        target_logits: ArrayView2<'a, L>,
        draft_tokens: &'a [u32],
        draft_offsets: &'a [usize],
        draft_probs: DraftQ<'a, Q>,
        sequences: &'a [SequenceParams<'a, Q>],
    ) -> Result<Self> {
        let (target_logits, vocab_size) = array_rows(target_logits, "target_logits")?;
        Ok(VerifyBatch::with_q(
            vocab_size,
            target_logits,
            draft_tokens,
            draft_offsets,
            draft_probs,
            sequences,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, s};

    #[test]
    fn standard_layout_is_borrowed_and_other_strides_refused() {
        let a = Array2::from_shape_fn((3, 4), |(r, c)| (r * 4 + c) as f32);
        let (rows, w) = array_rows(a.view(), "x").unwrap();
        assert_eq!(w, 4);
        assert_eq!(rows.as_ptr(), a.as_ptr());
        // Whole rows sliced out of a larger array are still contiguous.
        let (rows, w) = array_rows(a.slice(s![1.., ..]), "x").unwrap();
        assert_eq!((rows.len(), w, rows[0]), (8, 4, 4.0));
        for bad in [a.t(), a.slice(s![.., ..2]), a.slice(s![..;2, ..])] {
            assert!(matches!(
                array_rows(bad, "x"),
                Err(Error::NonContiguous { what: "x" })
            ));
        }
        // A view with one row ignores its row stride.
        assert!(array_rows(a.slice(s![1..2, ..]), "x").is_ok());
    }
}
