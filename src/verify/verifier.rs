//! [`Verifier`]: the reusable buffers of verification and its single-sequence entry point,
//! which validates a request, processes its draft-logit rows and dispatches to the greedy or
//! stochastic rule.

use super::{
    DraftQ, RowCandidates, StepOutput, VerifyRequest, begin_history, greedy, group_first, row,
    scheme_default, stochastic,
};
use crate::error::{Error, Result, RowKind};
use crate::sampling::{BlockHistory, Logit, RowProcessor, TokenDist};
use crate::tree::SiblingScheme;
#[cfg(doc)]
use crate::{
    sampling::SamplingConfig,
    tree::{DraftBlock, TreeFault},
};

/// The verifier. Holds reusable buffers; create one per thread and call it for every step.
///
/// The default is [`Verifier::new`]: empty buffers, grown to the vocabulary size on first use.
///
/// `Verifier` is `Send + Sync`; its methods take `&mut self`, so use one per thread (a
/// [`SamplingConfig`] can be shared between them).
///
/// # Example
///
/// ```
/// use speculative::{SamplingConfig, Verifier, VerifyRequest, StepEnd};
///
/// // vocab 4, k = 2 drafts [1, 2]; the target's argmaxes are 1, 3, 0.
/// let logits = [
///     0.0, 5.0, 1.0, 0.0, // row 0: argmax 1 (accepts d_1 = 1)
///     0.0, 0.0, 1.0, 4.0, // row 1: argmax 3 (rejects d_2 = 2)
///     9.0, 0.0, 0.0, 0.0, // row 2: would give the bonus token
/// ];
/// let cfg = SamplingConfig::greedy();
/// let mut verifier = Verifier::new();
/// let out = verifier.verify(&VerifyRequest::new(&cfg, &logits, 4, &[1, 2])).unwrap();
/// assert_eq!(out.accepted, 1);
/// assert_eq!(out.tokens, vec![1, 3]);
/// assert_eq!(out.end, StepEnd::Rejected { index: 1 });
/// ```
#[derive(Debug, Default)]
pub struct Verifier {
    /// Processes target and draft rows (penalties, bias, masks, temperature, truncation).
    pub(super) proc: RowProcessor,
    /// The processed target row of the current step.
    pub(super) p: TokenDist,
    /// The history of the current path (penalty counts, mask prefix, suppressed rows).
    pub(super) hist: BlockHistory,
    /// Residual weights of the current sibling (`p_j`).
    pub(super) residual: Vec<(u32, f64)>,
    /// Residual weights of the next sibling (`p_{j+1}`).
    pub(super) residual_next: Vec<(u32, f64)>,
    /// Processed draft-logit rows (`DraftProbs::Logits`), computed before any draw: the row of
    /// the first node of each sampled group (the group's q).
    pub(super) q_rows: Vec<TokenDist>,
    /// The sibling group of the current row.
    pub(super) kids: Vec<usize>,
    /// Node indices of a path (draft-row histories).
    pub(super) path_nodes: Vec<u32>,
    /// Tokens of a path (draft-row histories).
    pub(super) path_tokens: Vec<u32>,
}

impl Verifier {
    /// A verifier with empty buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Verifies one sequence's block ([`VerifyRequest::draft`]): a chain, or a token tree.
    ///
    /// # Errors
    /// - [`Error::ShapeMismatch`]: `target_logits` is not `[k + 1, vocab]` (`[k, vocab]` for a
    ///   chain whose final draft ends, [`DraftBlock::verify_rows`]), or q is not
    ///   `[k, draft_vocab]`.
    /// - [`Error::InvalidTree`]: the block's structure ([`DraftBlock::validate`] without node
    ///   or depth limits: the shapes of parents, schemes and ends, duplicate siblings, a sampled
    ///   scheme without q, an ending node with children, [`TreeFault::EndHasChildren`]).
    /// - [`Error::TokenOutOfVocab`]: a draft or context token (or a token of the configuration)
    ///   is outside the vocabulary.
    /// - [`Error::DraftVocabTooLarge`]: the draft vocabulary is wider than the target's.
    /// - [`Error::NonFiniteLogits`]: a target or (read) draft logit, any row, is NaN or `+inf`.
    /// - [`Error::InvalidDraftProbs`]: a q row is not a distribution, gives its own draft token
    ///   probability 0 (any row; draft-logit rows after processing), or differs from its
    ///   siblings' in a sampled group.
    /// - [`Error::NoAllowedToken`]: a draft-logit row (any), or a target row that the step
    ///   processes, has no token left after masking.
    ///
    /// All but the last are decided before any random draw: they never depend on the seed.
    pub fn verify<L: Logit, Q: Logit>(
        &mut self,
        req: &VerifyRequest<'_, L, Q>,
    ) -> Result<StepOutput> {
        req.validate()?;
        self.prepare_draft_rows(req)?;
        begin_history(&mut self.hist, req)?;
        let mut out = if req.state.config.is_greedy() {
            greedy::verify(self, req)?
        } else {
            stochastic::verify(self, req)?
        };
        if req.state.row_top_k > 0 {
            self.fill_row_top(req, &mut out.row_top)?;
        }
        Ok(out)
    }

    /// [`StepOutput::row_top`]: the `row_top_k` best ids of every target row, each processed
    /// with its own path's history. A row whose mask allows no token (possible off the
    /// accepted path only) gets no ids.
    fn fill_row_top<L: Logit, Q: Logit>(
        &mut self,
        req: &VerifyRequest<'_, L, Q>,
        rows_out: &mut RowCandidates,
    ) -> Result<()> {
        rows_out.clear();
        let block = req.draft;
        // A row lists at most `vocab` ids, whatever was asked (`usize::MAX`: all of them).
        let mut ids = Vec::with_capacity(req.state.row_top_k.min(req.vocab_size));
        for r in 0..req.target_rows() {
            block.row_path_tokens(r, &mut self.path_nodes, &mut self.path_tokens);
            self.hist.goto(&self.path_tokens)?;
            let hist = self.hist.view();
            let logits = row(req.target_logits, req.vocab_size, r);
            match self.proc.top_ids(
                req.state.config,
                logits,
                &hist,
                req.state.row_top_k,
                RowKind::Target,
                r,
                &mut ids,
            ) {
                Ok(()) => {}
                Err(Error::NoAllowedToken { .. }) => ids.clear(),
                Err(e) => return Err(e),
            }
            rows_out.push_row(&ids);
        }
        Ok(())
    }

    /// Processes the draft-logit row of the first node of every sampled group with its history
    /// (context plus the node's ancestors: the row the group was drawn from), before any draw,
    /// and checks that every node of the group is possible under it. Rows of deterministic
    /// groups are not read.
    fn prepare_draft_rows<L: Logit, Q: Logit>(
        &mut self,
        req: &VerifyRequest<'_, L, Q>,
    ) -> Result<()> {
        let DraftQ::Logits { logits, vocab: qv } = req.draft_probs else {
            return Ok(());
        };
        let k = req.k();
        let block = req.draft;
        let default = scheme_default(true);
        begin_history(&mut self.hist, req)?;
        self.q_rows
            .resize_with(k.max(self.q_rows.len()), TokenDist::default);
        for (i, &d) in req.draft.tokens().iter().enumerate() {
            if block.scheme(i, default) == SiblingScheme::Deterministic {
                continue;
            }
            let first = group_first(&block, i);
            if first == i {
                let parent = block.parent_row(i);
                block.row_path_tokens(parent, &mut self.path_nodes, &mut self.path_tokens);
                self.hist.goto(&self.path_tokens)?;
                let row = row(logits, qv, i);
                let hist = self.hist.view();
                if req.state.config.is_greedy() {
                    let t = self
                        .proc
                        .argmax(req.state.config, row, &hist, RowKind::Draft, i)?;
                    self.q_rows[i] = TokenDist::point_mass(t, qv)?;
                } else {
                    self.proc.distribution(
                        req.state.config,
                        row,
                        &hist,
                        RowKind::Draft,
                        i,
                        &mut self.q_rows[i],
                    )?;
                }
            }
            if self.q_rows[first].prob(d) <= 0.0 {
                return Err(Error::InvalidDraftProbs {
                    row: i,
                    reason: "the drafted token has probability 0 under the processed draft logits",
                });
            }
        }
        Ok(())
    }
}
