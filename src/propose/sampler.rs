//! Drawing draft tokens from processed rows: the step shared by every sampling proposer.

use super::{Draft, ProposeRequest};
use crate::error::{Result, RowKind};
use crate::rng::{Stream, lane};
use crate::sampling::{BlockHistory, RowProcessor, SamplingConfig, TokenDist, sample_weighted};

/// Samples the drafts of one block, one row of draft logits at a time.
///
/// Row `i` is processed with the request's configuration and the history the verifier will use
/// for target row `i` (one [`BlockHistory`] type for both: penalty counts and mask prefix over
/// the context plus drafts `0..i`, the `suppress` ids banned at rows `0..suppress_rows`), so q is
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
    /// request's prompt split and suppressed ids.
    pub(crate) fn begin(&mut self, req: &ProposeRequest<'_>, vocab: usize) -> Result<()> {
        // Ids outside a shorter draft vocabulary are impossible there anyway.
        self.hist.begin(
            req.config,
            req.context,
            req.prompt_len,
            vocab,
            req.suppress
                .iter()
                .copied()
                .filter(|&t| (t as usize) < vocab),
            req.suppress_rows,
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
    #[allow(dead_code)] // Shipped sampling trees draw without replacement (below); kept for WR trees.
    pub(crate) fn draw_child(
        &mut self,
        cfg: &SamplingConfig,
        seed: u64,
        logits: &[f32],
        parent_row: usize,
        sibling: usize,
        draft: &mut Draft,
    ) -> Result<u32> {
        let (mut nodes, mut tokens) = (Vec::new(), Vec::new());
        draft
            .block()
            .row_path_tokens(parent_row, &mut nodes, &mut tokens);
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

    /// Moves the history to the row after `path` (the tokens of a node's path, the root's child
    /// first; empty for the root's row), as the verifier processes that target row.
    ///
    /// # Errors
    /// [`crate::Error::TokenOutOfVocab`] for a path token outside the vocabulary (penalties on).
    pub(crate) fn goto(&mut self, path: &[u32]) -> Result<()> {
        self.hist.goto(path)
    }

    /// The `n` best tokens of `logits` (`[vocab]`) processed with the current history (see
    /// [`DraftSampler::goto`]), best first, with their natural log-probabilities: under the
    /// processed distribution for a sampling configuration, under the softmax at temperature 1
    /// of the row after penalties, bias and masks for a greedy one (whose processed row is a
    /// point mass). Tokens of probability 0 are never listed. Ties go to the lower id.
    ///
    /// # Errors
    /// [`crate::Error::NonFiniteLogits`] and [`crate::Error::NoAllowedToken`] (labelled as draft
    /// row `depth`).
    pub(crate) fn top(
        &mut self,
        cfg: &SamplingConfig,
        logits: &[f32],
        depth: usize,
        n: usize,
        out: &mut Vec<(u32, f32)>,
    ) -> Result<()> {
        out.clear();
        let hist = self.hist.view();
        if cfg.is_greedy() {
            let first = self
                .proc
                .argmax(cfg, logits, &hist, RowKind::Draft, depth)?;
            let (_, top) = self.proc.greedy_logprobs(cfg, logits, &hist, first, n)?;
            out.extend(top.into_iter().filter(|&(_, lp)| lp.is_finite()));
            return Ok(());
        }
        self.proc
            .distribution(cfg, logits, &hist, RowKind::Draft, depth, &mut self.dist)?;
        out.extend(
            self.dist
                .top_logprobs(n)
                .into_iter()
                .filter(|&(_, lp)| lp.is_finite()),
        );
        Ok(())
    }

    /// Draws `m` siblings WITHOUT replacement from `logits` (`[vocab]`) processed with the
    /// current history (sampling configurations only; see [`DraftSampler::goto`]): sibling `j`
    /// is drawn by inverse CDF in id order from q with siblings `0..j` removed and the rest
    /// renormalised, with the uniform at `(context.len() + depth, lane::sibling_draft(j))`, so
    /// that sibling 0 is the chain's draw at that depth. `m` is capped at q's support size
    /// (decided before any draw). The drawn tokens are written to `out` (cleared first), and q
    /// (`[vocab]`, the distribution of the first draw) is recorded once per sibling, the row
    /// [`crate::SiblingScheme::WithoutReplacement`] requires of every node of the group
    /// (recursive rejection sampling, Jeon et al. 2024).
    ///
    /// # Errors
    /// [`crate::Error::NonFiniteLogits`] and [`crate::Error::NoAllowedToken`] (labelled as draft
    /// row `depth`).
    pub(crate) fn draw_without_replacement(
        &mut self,
        cfg: &SamplingConfig,
        seed: u64,
        logits: &[f32],
        depth: usize,
        m: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        out.clear();
        let vocab = logits.len();
        let hist = self.hist.view();
        self.proc
            .distribution(cfg, logits, &hist, RowKind::Draft, depth, &mut self.dist)?;
        let m = m.min(self.dist.support_len());
        let stream = Stream::new(seed);
        let pos = (self.base + depth) as u64;
        for j in 0..m {
            let u = stream.uniform(pos, lane::sibling_draft(j));
            let (ids, probs) = (self.dist.ids(), self.dist.probs());
            let left = ids
                .iter()
                .copied()
                .zip(probs.iter().map(|&p| p as f64))
                .filter(|(t, _)| !out.contains(t));
            let t = sample_weighted(left.clone(), u)
                .or_else(|| left.map(|(t, _)| t).next())
                .ok_or(crate::Error::NoAllowedToken {
                    kind: RowKind::Draft,
                    row: depth,
                })?;
            out.push(t);
        }
        for _ in 0..m {
            let row = self.q.len();
            self.q.resize(row + vocab, 0.0);
            for (&id, &p) in self.dist.ids().iter().zip(self.dist.probs()) {
                self.q[row + id as usize] = p;
            }
        }
        Ok(())
    }

    /// The last recorded q row (`[vocab]`; empty when none was recorded).
    pub(crate) fn last_q(&self) -> &[f32] {
        let v = self.dist.vocab_size();
        if v == 0 || self.q.len() < v {
            return &[];
        }
        &self.q[self.q.len() - v..]
    }

    /// Takes the recorded q rows (`[nodes, vocab]`), leaving none.
    pub(crate) fn take_q(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.q)
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
            // A row recorded for a draw that found no token is not a draft's row.
            self.q.truncate(draft.tokens.len() * vocab);
            draft.q = Some(std::mem::take(&mut self.q));
            draft.q_vocab = vocab;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::DraftBlock;
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
                .draft(DraftBlock::tree(&d.tokens, &d.parents).with_schemes(&d.schemes))
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

    #[test]
    fn draws_without_replacement_have_the_sequential_law() {
        // Pairs (x_0, x_1) of 2 siblings over many seeds against the exact law
        // q(a) q(b) / (1 - q(a)), a != b. Tolerance 0.006 on each cell frequency (about 6
        // standard deviations at n = 60,000). Negative control: the with-replacement law
        // q(a) q(b) differs from the same frequencies by more than 0.02 somewhere.
        let cfg = SamplingConfig::builder().temperature(0.7).build().unwrap();
        let ctx = [1u32, 2];
        let req = ProposeRequest::new(&ctx, &cfg, 2);
        let logits = draft_logits(&ctx, &[]);
        let n = 60_000u64;
        let mut counts = vec![0u64; V * V];
        let mut s = DraftSampler::default();
        let mut out = Vec::new();
        for seed in 0..n {
            s.begin(&req, V).unwrap();
            s.goto(&[]).unwrap();
            s.draw_without_replacement(&cfg, seed, &logits, 0, 2, &mut out)
                .unwrap();
            assert_eq!(out.len(), 2);
            assert_eq!(s.take_q().len(), 2 * V, "one q row per sibling");
            counts[out[0] as usize * V + out[1] as usize] += 1;
        }
        s.begin(&req, V).unwrap();
        s.draw_without_replacement(&cfg, 0, &logits, 0, 1, &mut out)
            .unwrap();
        let q: Vec<f64> = s.take_q().iter().map(|&x| x as f64).collect();
        let (mut wor, mut wr) = (0.0f64, 0.0f64);
        for a in 0..V {
            for b in 0..V {
                let f = counts[a * V + b] as f64 / n as f64;
                let exact = if a == b {
                    0.0
                } else {
                    q[a] * q[b] / (1.0 - q[a])
                };
                wor = wor.max((f - exact).abs());
                wr = wr.max((f - q[a] * q[b]).abs());
            }
        }
        assert!(
            wor < 0.006,
            "max deviation from the law without replacement: {wor}"
        );
        assert!(
            wr > 0.02,
            "negative control: with replacement fits too well: {wr}"
        );
    }

    #[test]
    fn first_sibling_without_replacement_is_the_chain_draw() {
        let cfg = SamplingConfig::builder().temperature(1.1).build().unwrap();
        let ctx = [3u32, 0, 5];
        let req = ProposeRequest::new(&ctx, &cfg, 1);
        let logits = draft_logits(&ctx, &[]);
        for seed in 0..100 {
            let (mut a, mut b) = (DraftSampler::default(), DraftSampler::default());
            let mut d = Draft::default();
            a.begin(&req, V).unwrap();
            a.draw(&cfg, seed, &logits, 0, &mut d).unwrap();
            b.begin(&req, V).unwrap();
            let mut out = Vec::new();
            b.draw_without_replacement(&cfg, seed, &logits, 0, 3, &mut out)
                .unwrap();
            assert_eq!(out[0], d.tokens[0]);
            assert_eq!(b.take_q()[..V], a.take_q()[..]);
            let mut sorted = out.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), 3, "distinct siblings");
        }
    }
}
