//! Drawing draft tokens from processed rows: the step shared by every sampling proposer.

use super::{Draft, ProposeRequest};
use crate::error::{Result, RowKind};
use crate::rng::{Stream, lane};
use crate::sampling::{BlockHistory, RowProcessor, SamplingConfig, TokenDist};

/// Samples the drafts of one block, one row of draft logits at a time.
///
/// Row `i` is processed with the request's configuration and the history the verifier will use
/// for target row `i` (one [`BlockHistory`] type for both: penalty counts and mask prefix over
/// the context plus drafts `0..i`, EOS suppressed at rows `0..suppress_eos_rows`), so q is
/// exactly the distribution the verifier needs. Greedy requests take the argmax and return no
/// q; sampling requests draw with the uniform of [`Stream`] at `(context.len() + i, DRAFT)` and
/// record the processed row as q (`[k, vocab]`).
#[derive(Debug, Default)]
pub(crate) struct DraftSampler {
    proc: RowProcessor,
    dist: TokenDist,
    hist: BlockHistory,
    q: Vec<f32>,
    base: usize,
}

impl DraftSampler {
    /// Starts a block after `req.context` over a vocabulary of `vocab` tokens, with the
    /// request's prompt split and EOS suppression.
    pub(crate) fn begin(&mut self, req: &ProposeRequest<'_>, vocab: usize) -> Result<()> {
        // EOS ids outside a shorter draft vocabulary are impossible there anyway.
        self.hist.begin(
            req.config,
            req.context,
            req.prompt_len,
            vocab,
            req.eos.iter().copied().filter(|&t| (t as usize) < vocab),
            req.suppress_eos_rows,
        )?;
        self.q.clear();
        self.base = req.context.len();
        Ok(())
    }

    /// Draws draft `i` of a chain from `logits` (`[vocab]`), records q and pushes the token into
    /// `draft`.
    pub(crate) fn draw(
        &mut self,
        cfg: &SamplingConfig,
        seed: u64,
        logits: &[f32],
        i: usize,
        draft: &mut Draft,
    ) -> Result<u32> {
        let t = self.sample(cfg, seed, logits, i, lane::DRAFT)?;
        self.push(t, logits.len())?;
        draft.tokens.push(t);
        Ok(t)
    }

    /// Draws a node of a token tree: sibling `sibling` (0-based) of the group under target row
    /// `parent_row` of `draft`'s block (0 = the root, `j + 1` = node `j`; see [`crate::tree`]),
    /// from `logits` (`[vocab]`, the draft model's row after the parent's path). The history is
    /// moved to the parent's path first ([`BlockHistory::goto`]: context plus the parent's
    /// ancestors and itself, never another branch), exactly what the verifier uses for the
    /// parent's target row; the draw uses the uniform at `(context.len() + depth(parent),
    /// lane::sibling_draft(sibling))`, so siblings are independent draws from one q (the
    /// [`crate::SiblingScheme::WithReplacement`] scheme), and a chain drawn this way equals
    /// [`DraftSampler::draw`]'s. Appends the node (token, parent row) to `draft`, whose
    /// `parents` must hold one entry per node, and records q as the node's row.
    #[allow(dead_code)] // The tree drafts of sampling proposers come with the next issue.
    pub(crate) fn draw_child(
        &mut self,
        cfg: &SamplingConfig,
        seed: u64,
        logits: &[f32],
        parent_row: usize,
        sibling: usize,
        draft: &mut Draft,
    ) -> Result<u32> {
        let mut path = Vec::new();
        if parent_row > 0 {
            draft.block().path_to(parent_row - 1, &mut path);
        }
        let tokens: Vec<u32> = path.iter().map(|&j| draft.tokens[j as usize]).collect();
        self.hist.goto(&tokens)?;
        let t = self.sample(
            cfg,
            seed,
            logits,
            tokens.len(),
            lane::sibling_draft(sibling),
        )?;
        draft.tokens.push(t);
        draft.parents.push(parent_row as u32);
        Ok(t)
    }

    /// Processes `logits` with the current history and draws: the argmax (greedy) or a sample
    /// with the uniform at `(context.len() + depth, lane)`, recording the processed row as q.
    fn sample(
        &mut self,
        cfg: &SamplingConfig,
        seed: u64,
        logits: &[f32],
        depth: usize,
        lane: u32,
    ) -> Result<u32> {
        let vocab = logits.len();
        let i = depth;
        let hist = self.hist.view();
        if cfg.is_greedy() {
            return self.proc.argmax(cfg, logits, &hist, RowKind::Draft, i);
        }
        self.proc
            .distribution(cfg, logits, &hist, RowKind::Draft, i, &mut self.dist)?;
        let u = Stream::new(seed).uniform((self.base + depth) as u64, lane);
        let row = self.q.len();
        self.q.resize(row + vocab, 0.0);
        for (&id, &p) in self.dist.ids().iter().zip(self.dist.probs()) {
            self.q[row + id as usize] = p;
        }
        self.dist.sample(u).ok_or(crate::Error::NoAllowedToken {
            kind: RowKind::Draft,
            row: i,
        })
    }

    fn push(&mut self, t: u32, vocab: usize) -> Result<()> {
        self.hist
            .push(t)
            .map_err(|_| crate::Error::TokenOutOfVocab {
                what: "draft token",
                token: t,
                vocab_size: vocab,
            })
    }

    /// Moves the recorded q into `draft` (sampling requests only).
    pub(crate) fn finish(&mut self, cfg: &SamplingConfig, vocab: usize, draft: &mut Draft) {
        if !cfg.is_greedy() && !draft.tokens.is_empty() {
            draft.q = Some(std::mem::take(&mut self.q));
            draft.q_vocab = vocab;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::SiblingScheme;
    use crate::verify::{DraftQ, Verifier, VerifyRequest};

    const V: usize = 6;

    /// Draft logits after a path: a fixed function of its tokens.
    fn draft_logits(ctx: &[u32], path: &[u32]) -> Vec<f32> {
        let h: u32 = ctx
            .iter()
            .chain(path)
            .fold(7, |h, &t| h.wrapping_mul(31) ^ t);
        (0..V as u32)
            .map(|v| ((h ^ v.wrapping_mul(2654435761)) % 97) as f32 / 40.0)
            .collect()
    }

    fn path_tokens(d: &Draft, parent_row: usize) -> Vec<u32> {
        let mut p = Vec::new();
        if parent_row > 0 {
            d.block().path_to(parent_row - 1, &mut p);
        }
        p.iter().map(|&j| d.tokens[j as usize]).collect()
    }

    #[test]
    fn draw_child_along_a_chain_equals_draw() {
        let cfg = SamplingConfig::builder()
            .temperature(0.8)
            .repetition_penalty(1.3)
            .build()
            .unwrap();
        let ctx = [1u32, 2, 3];
        let req = ProposeRequest::new(&ctx, &cfg, 4);
        let (mut a, mut b) = (DraftSampler::default(), DraftSampler::default());
        let (mut da, mut db) = (Draft::default(), Draft::default());
        a.begin(&req, V).unwrap();
        b.begin(&req, V).unwrap();
        for i in 0..4 {
            let la = draft_logits(&ctx, &da.tokens);
            a.draw(&cfg, 9, &la, i, &mut da).unwrap();
            let lb = draft_logits(&ctx, &path_tokens(&db, i));
            b.draw_child(&cfg, 9, &lb, i, 0, &mut db).unwrap();
        }
        a.finish(&cfg, V, &mut da);
        b.finish(&cfg, V, &mut db);
        assert_eq!(da.tokens, db.tokens);
        assert_eq!(da.q, db.q);
        assert_eq!(db.parents, vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_drawn_tree_carries_the_q_rows_the_verifier_computes() {
        // Root group of 3 samples with replacement; 2 samples under the root's second child.
        let cfg = SamplingConfig::builder()
            .temperature(0.9)
            .frequency_penalty(0.7)
            .build()
            .unwrap();
        let ctx = [4u32, 1, 4];
        let req = ProposeRequest::new(&ctx, &cfg, 2);
        for seed in 0..50u64 {
            let mut s = DraftSampler::default();
            let mut d = Draft::default();
            s.begin(&req, V).unwrap();
            let mut logit_rows = Vec::new();
            for (parent_row, width) in [(0usize, 3usize), (2, 2)] {
                let l = draft_logits(&ctx, &path_tokens(&d, parent_row));
                for j in 0..width {
                    s.draw_child(&cfg, seed, &l, parent_row, j, &mut d).unwrap();
                    logit_rows.extend_from_slice(&l);
                }
            }
            s.finish(&cfg, V, &mut d);
            assert_eq!(d.parents, vec![0, 0, 0, 2, 2]);
            d.schemes = vec![SiblingScheme::WithReplacement; 5];
            let q = d.q.clone().unwrap();
            // Siblings were drawn independently from one q: their rows are equal.
            assert_eq!(q[..V], q[V..2 * V]);
            assert_eq!(q[3 * V..4 * V], q[4 * V..]);
            // Verifying with the recorded q equals verifying with the draft logits, which the
            // verifier processes with each node's own history.
            let target: Vec<f32> = (0..6 * V).map(|i| ((i * 37 % 11) as f32) / 5.0).collect();
            let base = VerifyRequest::new(&cfg, &target, V, &d.tokens)
                .tree(&d.parents)
                .schemes(&d.schemes)
                .context(&ctx)
                .seed(seed);
            let mut v = Verifier::new();
            let with_q = v
                .verify(&base.draft_probs(DraftQ::Probs {
                    probs: &q,
                    vocab: V,
                }))
                .unwrap();
            let with_logits = v
                .verify(&base.draft_probs(DraftQ::Logits {
                    logits: &logit_rows,
                    vocab: V,
                }))
                .unwrap();
            assert_eq!(with_q, with_logits, "seed {seed}");
        }
    }
}
