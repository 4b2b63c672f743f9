//! Small helpers shared by the verification rules: a row of a row-major buffer, a node's
//! sibling group, the default sibling scheme, and the start of a block's history.

use super::VerifyRequest;
use crate::error::Result;
use crate::sampling::BlockHistory;
use crate::tree::{DraftBlock, SiblingScheme, TreeLimits};

/// The scheme of a group without one: [`TreeLimits::default_scheme`].
pub(super) fn scheme_default(dense_q: bool) -> SiblingScheme {
    TreeLimits {
        dense_q,
        ..TreeLimits::vocab(1)
    }
    .default_scheme()
}

/// The first node of node `i`'s sibling group (the node whose q row is the group's q).
#[inline]
pub(super) fn group_first(block: &DraftBlock<'_>, i: usize) -> usize {
    block.children(block.parent_row(i)).next().unwrap_or(i)
}

/// Starts `hist` at the request's context (penalty counts, mask prefix, suppressed rows).
pub(super) fn begin_history<L, Q>(
    hist: &mut BlockHistory,
    req: &VerifyRequest<'_, L, Q>,
) -> Result<()> {
    hist.begin(
        req.state.config,
        req.state.context,
        req.state.prompt_len,
        req.vocab_size,
        req.state.suppress.iter().copied(),
        req.state.suppress_rows,
    )
}

/// Row `i` (`[vocab]`) of the row-major `logits`.
#[inline]
pub(super) fn row<T>(logits: &[T], vocab: usize, i: usize) -> &[T] {
    &logits[i * vocab..(i + 1) * vocab]
}
