//! The row processor: raw logits `[vocab]` -> greedy argmax or a processed distribution.

use super::logit::{BLOCK, SpanVisitor, for_each_span, visit_spans};
use super::top_k::scan_top_k;
use super::{Cand, Logit, SamplingConfig, TokenCounts, apply_min_p, apply_penalties, apply_top_p};
use crate::error::{Error, Result, RowKind};

/// A processed distribution over the vocabulary: probabilities (not logits) that sum to 1, stored
/// sparsely as the tokens with non-zero probability in increasing id order.
///
/// The default is empty (no token, no probability): an output buffer for
/// [`RowProcessor`] to fill, not a distribution; [`TokenDist::sample`] returns `None` on it.
///
/// `TokenDist` is `Send + Sync`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenDist {
    ids: Vec<u32>,
    probs: Vec<f32>,
    /// Processed logits (after penalties, bias, masks and temperature scaling relative to the
    /// row maximum), aligned with `ids`; `ln(prob) = scaled - ln(sum)`.
    log_norm: f64,
    scaled: Vec<f32>,
    vocab: usize,
}

impl TokenDist {
    /// A distribution from `(id, probability)` pairs over a vocabulary of `vocab` tokens.
    /// Probabilities are normalised; entries of a repeated id add up; entries whose normalised
    /// probability is 0 in f32 are dropped, so the support holds only non-zero probabilities.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] for an id `>= vocab`, [`Error::InvalidDraftProbs`] for a
    /// negative or non-finite probability or when every probability is 0 (every pair is checked,
    /// whatever its order).
    pub fn from_pairs(pairs: impl IntoIterator<Item = (u32, f32)>, vocab: usize) -> Result<Self> {
        let mut v: Vec<(u32, f32)> = pairs.into_iter().collect();
        v.sort_by_key(|&(t, _)| t);
        let mut total = 0.0f64;
        for &(t, p) in &v {
            if t as usize >= vocab {
                return Err(Error::TokenOutOfVocab {
                    what: "distribution entry",
                    token: t,
                    vocab_size: vocab,
                });
            }
            if !(p.is_finite() && p >= 0.0) {
                return Err(Error::InvalidDraftProbs {
                    row: 0,
                    reason: "probability is negative or not finite",
                });
            }
            total += p as f64;
        }
        if total <= 0.0 {
            return Err(Error::InvalidDraftProbs {
                row: 0,
                reason: "all probabilities are zero",
            });
        }
        let mut d = TokenDist {
            vocab,
            ..Default::default()
        };
        let mut i = 0;
        while i < v.len() {
            let t = v[i].0;
            let mut p = 0.0f64;
            while i < v.len() && v[i].0 == t {
                p += v[i].1 as f64;
                i += 1;
            }
            let norm = p / total;
            if norm as f32 > 0.0 {
                d.ids.push(t);
                d.probs.push(norm as f32);
                d.scaled.push(norm.ln() as f32);
            }
        }
        Ok(d)
    }

    /// A point mass on `token`.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] when `token >= vocab`.
    pub fn point_mass(token: u32, vocab: usize) -> Result<Self> {
        if token as usize >= vocab {
            return Err(Error::TokenOutOfVocab {
                what: "point mass",
                token,
                vocab_size: vocab,
            });
        }
        Ok(TokenDist {
            ids: vec![token],
            probs: vec![1.0],
            log_norm: 0.0,
            scaled: vec![0.0],
            vocab,
        })
    }

    /// Vocabulary size the distribution is over.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Tokens with non-zero probability, increasing.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Probabilities aligned with [`TokenDist::ids`].
    pub fn probs(&self) -> &[f32] {
        &self.probs
    }

    /// The distribution as dense probabilities, `[vocab_size]`: `out[t]` is the probability of
    /// token `t`, 0 outside the support. This is the q row a sampling proposer hands the
    /// verifier ([`crate::DraftProbs::Probs`]). Allocates; [`TokenDist::write_dense`] writes into
    /// a buffer of yours.
    pub fn to_dense(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.vocab];
        self.fill_dense(&mut out);
        out
    }

    /// Writes the distribution as dense probabilities into `out` (`[width]`, `width >=
    /// vocab_size`): `out[t]` is the probability of token `t`, 0 outside the support (and at
    /// every index `>= vocab_size`, for a row padded to a wider vocabulary). For example, write
    /// row `i` of a `[k, vocab]` q buffer with `q.chunks_exact_mut(vocab)`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `out` is shorter than [`TokenDist::vocab_size`] (nothing is
    /// written).
    pub fn write_dense(&self, out: &mut [f32]) -> Result<()> {
        if out.len() < self.vocab {
            return Err(Error::ShapeMismatch {
                what: "dense distribution row (at least vocab_size)",
                expected: self.vocab,
                actual: out.len(),
            });
        }
        self.fill_dense(out);
        Ok(())
    }

    fn fill_dense(&self, out: &mut [f32]) {
        out.fill(0.0);
        for (&t, &p) in self.ids.iter().zip(&self.probs) {
            out[t as usize] = p;
        }
    }

    /// Number of tokens with non-zero probability.
    pub fn support_len(&self) -> usize {
        self.ids.len()
    }

    /// Probability of `token` (0 outside the support). O(log support).
    pub fn prob(&self, token: u32) -> f32 {
        match self.ids.binary_search(&token) {
            Ok(i) => self.probs[i],
            Err(_) => 0.0,
        }
    }

    /// Natural log-probability of `token` (`-inf` outside the support), computed from the
    /// processed logits so that it stays accurate for tiny probabilities.
    pub fn logprob(&self, token: u32) -> f32 {
        match self.ids.binary_search(&token) {
            Ok(i) => (self.scaled[i] as f64 - self.log_norm) as f32,
            Err(_) => f32::NEG_INFINITY,
        }
    }

    /// The `n` most likely tokens with their log-probabilities, most likely first (ties: lower id).
    pub fn top_logprobs(&self, n: usize) -> Vec<(u32, f32)> {
        let mut c: Vec<Cand> = self
            .ids
            .iter()
            .zip(&self.scaled)
            .map(|(&id, &s)| Cand::new(id, s))
            .collect();
        let n = n.min(c.len());
        if n == 0 {
            return Vec::new();
        }
        if n < c.len() {
            c.select_nth_unstable_by(n - 1, Cand::rank);
            c.truncate(n);
        }
        c.sort_unstable_by(Cand::rank);
        c.iter()
            .map(|c| (c.id, (c.logit as f64 - self.log_norm) as f32))
            .collect()
    }

    /// The token whose cumulative probability interval (in id order) contains `u * total`,
    /// for a uniform `u` in `[0, 1)`. Never returns a token outside the support; `None` only for
    /// an empty distribution (such as [`TokenDist::default`], an output buffer not yet filled).
    pub fn sample(&self, u: f32) -> Option<u32> {
        sample_weighted(
            self.ids
                .iter()
                .copied()
                .zip(self.probs.iter().map(|&p| p as f64)),
            u,
        )
        .or_else(|| self.ids.first().copied())
    }
}

/// Inverse-CDF sampling over `(token, weight)` pairs in the order given (weights need not be
/// normalised). Returns `None` when the total weight is 0. The result always has weight > 0.
pub(crate) fn sample_weighted(
    pairs: impl Iterator<Item = (u32, f64)> + Clone,
    u: f32,
) -> Option<u32> {
    let total: f64 = pairs.clone().map(|(_, w)| w).sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = u as f64 * total;
    let mut acc = 0.0f64;
    let mut last = None;
    for (t, w) in pairs {
        if w <= 0.0 {
            continue;
        }
        acc += w;
        last = Some(t);
        if acc > target {
            return Some(t);
        }
    }
    last
}

/// What the penalties and the mask of a row see: token counts and the token prefix that the row
/// follows (context plus earlier drafts of the block).
///
/// The default is the history of a first row with no context: no counts, an empty prefix and
/// nothing suppressed.
#[derive(Debug, Clone, Copy, Default)]
pub struct History<'a> {
    /// Occurrence counts for the penalties; `None` means no earlier tokens.
    pub counts: Option<&'a TokenCounts>,
    /// The full prefix, passed to the caller's [`super::TokenMask`].
    pub prefix: &'a [u32],
    /// Tokens banned at this row only, applied with the banned set: the EOS ids while fewer than
    /// `min_tokens` tokens have been generated. Usually empty.
    pub suppress: &'a [u32],
}

/// Reusable buffers for processing rows; one per thread. Processing never allocates once the
/// buffers have grown to the vocabulary size.
///
/// The default is [`RowProcessor::new`]: empty buffers, grown on first use.
///
/// `RowProcessor` is `Send + Sync`; its methods take `&mut self`, so use one per thread.
#[derive(Debug, Default, Clone)]
pub struct RowProcessor {
    scratch: Vec<f32>,
    cands: Vec<Cand>,
    work: Vec<Cand>,
    blocks: Vec<f32>,
}

/// Whether `row` holds a NaN or `+inf`, given `sum`, the f32 sum of the row in any order.
///
/// NaN is absorbing for addition and `+inf` can only vanish into NaN, so a sum that is finite or
/// `-inf` proves the row clean; only otherwise (or on overflow) is the row checked entry by entry.
#[inline]
fn has_nan_or_pos_inf<T: Logit>(sum: f32, row: &[T]) -> bool {
    if sum.is_finite() || sum == f32::NEG_INFINITY {
        return false;
    }
    row.iter().any(|v| {
        let v = v.widen();
        v.is_nan() || v == f32::INFINITY
    })
}

/// The last `len % 16` values of a row (fewer than 16), kept to be added after the lanes, in
/// order.
#[derive(Clone, Copy)]
struct Tail {
    vals: [f32; 16],
    n: usize,
}

impl Tail {
    const EMPTY: Tail = Tail {
        vals: [0.0; 16],
        n: 0,
    };

    fn keep<U: Logit>(rem: &[U]) -> Tail {
        let mut t = Tail::EMPTY;
        for (d, s) in t.vals.iter_mut().zip(rem) {
            *d = s.widen();
        }
        t.n = rem.len();
        t
    }

    fn values(&self) -> &[f32] {
        &self.vals[..self.n]
    }
}

/// [`scan`]'s state: 16 lanes of maximum and of sum.
struct Scan {
    m: [f32; 16],
    acc: [f32; 16],
    tail: Tail,
}

impl SpanVisitor for Scan {
    #[inline(always)]
    fn span<U: Logit>(&mut self, _start: usize, span: &[U]) {
        let chunks = span.chunks_exact(16);
        self.tail = Tail::keep(chunks.remainder());
        let (acc, m) = (&mut self.acc, &mut self.m);
        for c in chunks {
            for j in 0..16 {
                let v = c[j].widen();
                acc[j] += v;
                m[j] = if v > m[j] { v } else { m[j] };
            }
        }
    }
}

/// Maximum and "saw NaN / +inf" over a row, vectorisable (no early exit): 16 lanes of maximum
/// and of sum (the screen of [`has_nan_or_pos_inf`]).
#[inline]
fn scan<T: Logit>(row: &[T]) -> (f32, bool) {
    let mut s = Scan {
        m: [f32::NEG_INFINITY; 16],
        acc: [0.0; 16],
        tail: Tail::EMPTY,
    };
    visit_spans(row, &mut s);
    let mut mx = f32::NEG_INFINITY;
    let mut sum = 0.0f32;
    for j in 0..16 {
        mx = mx.max(s.m[j]);
        sum += s.acc[j];
    }
    for &v in s.tail.values() {
        sum += v;
        mx = mx.max(v);
    }
    (mx, has_nan_or_pos_inf(sum, row))
}

/// [`scan_argmax`]'s state: the best full block, 16 lanes of sum, and the last, partial block
/// (fewer than [`BLOCK`] values: its sum, maximum and the first index holding it), folded in
/// after the full blocks as the scalar remainder.
struct ScanArgmax {
    best: f32,
    best_block: usize,
    acc: [f32; 16],
    rem_sum: f32,
    rem_best: f32,
    rem_idx: usize,
}

impl SpanVisitor for ScanArgmax {
    #[inline(always)]
    fn span<U: Logit>(&mut self, start: usize, span: &[U]) {
        const L: usize = 16;
        const B: usize = BLOCK;
        let blocks = span.chunks_exact(B);
        let rem = blocks.remainder();
        for (bi, block) in blocks.enumerate() {
            let mut m = [f32::NEG_INFINITY; L];
            for c in block.chunks_exact(L) {
                for j in 0..L {
                    let v = c[j].widen();
                    self.acc[j] += v;
                    m[j] = if v > m[j] { v } else { m[j] };
                }
            }
            let mut bm = f32::NEG_INFINITY;
            for &x in &m {
                bm = if x > bm { x } else { bm };
            }
            if bm > self.best {
                self.best = bm;
                self.best_block = start / B + bi;
            }
        }
        let base = start + span.len() - rem.len();
        for (j, v) in rem.iter().enumerate() {
            let v = v.widen();
            self.rem_sum += v;
            if v > self.rem_best {
                self.rem_best = v;
                self.rem_idx = base + j;
            }
        }
    }
}

/// Maximum, index of its first occurrence, and "saw NaN / +inf", in one vectorisable pass.
///
/// The row is read in blocks of 256 entries; each block's maximum is computed in 16 lanes and
/// a block replaces the best one only if its maximum is strictly larger, so the best block is
/// the first that holds the row maximum, and the first entry equal to it there is the first
/// occurrence in the row (ties go to the lowest id).
#[inline]
fn scan_argmax<T: Logit>(row: &[T]) -> (f32, usize, bool) {
    const B: usize = BLOCK;
    let mut s = ScanArgmax {
        best: f32::NEG_INFINITY,
        best_block: usize::MAX,
        acc: [0.0; 16],
        rem_sum: 0.0,
        rem_best: f32::NEG_INFINITY,
        rem_idx: usize::MAX,
    };
    visit_spans(row, &mut s);
    let mut best = s.best;
    let mut idx = usize::MAX;
    if s.best_block != usize::MAX {
        let b = s.best_block * B;
        idx = b + row[b..b + B]
            .iter()
            .position(|v| v.widen() == best)
            .unwrap_or(0);
    }
    // The remainder's maximum wins only if strictly larger (ties to the lower id).
    if s.rem_best > best {
        best = s.rem_best;
        idx = s.rem_idx;
    }
    let mut sum = s.rem_sum;
    for x in s.acc {
        sum += x;
    }
    (best, idx, has_nan_or_pos_inf(sum, row))
}

/// [`non_finite_in`]'s state: 16 lanes of sum.
struct SumScreen {
    acc: [f32; 16],
    tail: Tail,
}

impl SpanVisitor for SumScreen {
    #[inline(always)]
    fn span<U: Logit>(&mut self, _start: usize, span: &[U]) {
        let chunks = span.chunks_exact(16);
        self.tail = Tail::keep(chunks.remainder());
        let acc = &mut self.acc;
        for c in chunks {
            for j in 0..16 {
                acc[j] += c[j].widen();
            }
        }
    }
}

/// The [`Error::NonFiniteLogits`] of `row` if it holds a NaN or `+inf`, found by one vectorisable
/// pass (a sum screen; entries are inspected only when the screen fails).
pub(crate) fn non_finite_in<T: Logit>(row: &[T], kind: RowKind, row_idx: usize) -> Option<Error> {
    let mut s = SumScreen {
        acc: [0.0; 16],
        tail: Tail::EMPTY,
    };
    visit_spans(row, &mut s);
    let sum = s.acc.iter().sum::<f32>() + s.tail.values().iter().sum::<f32>();
    has_nan_or_pos_inf(sum, row).then(|| non_finite(row, kind, row_idx))
}

fn non_finite<T: Logit>(row: &[T], kind: RowKind, row_idx: usize) -> Error {
    let (token, value) = row
        .iter()
        .map(|v| v.widen())
        .enumerate()
        .find(|(_, v)| v.is_nan() || *v == f32::INFINITY)
        .unwrap_or((0, f32::NAN));
    Error::NonFiniteLogits {
        kind,
        row: row_idx,
        token,
        value,
    }
}

/// A row after steps 1-3 of the pipeline: the caller's row itself when no processor of those
/// steps is active (read in its own dtype, no copy), else the processor's `f32` scratch copy.
enum Effective<'s, L> {
    Raw(&'s [L]),
    Scratch(&'s [f32]),
}

/// Runs `$body` with `$eff` bound to the row of an [`Effective`], whatever its dtype (one
/// generic body, instantiated for the caller's dtype and for `f32`).
macro_rules! with_row {
    ($e:expr, |$eff:ident| $body:expr) => {
        match $e {
            Effective::Raw($eff) => $body,
            Effective::Scratch($eff) => $body,
        }
    };
}

impl RowProcessor {
    /// A processor with empty buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Steps 1-3 of the pipeline. Returns the row to read: `logits` itself when no processor of
    /// those steps is active (no copy), else the internal scratch buffer, filled with `logits`
    /// widened to `f32` as they are copied.
    fn effective<'s, L: Logit>(
        scratch: &'s mut Vec<f32>,
        cfg: &SamplingConfig,
        logits: &'s [L],
        hist: &History<'_>,
    ) -> Effective<'s, L> {
        let penalties = cfg.has_penalties() && hist.counts.is_some_and(|c| !c.is_empty());
        let copy = penalties
            || !cfg.logit_bias.is_empty()
            || cfg.allowed.is_some()
            || !cfg.banned.is_empty()
            || !hist.suppress.is_empty()
            || cfg.mask.is_some();
        if !copy {
            return Effective::Raw(logits);
        }
        let v = logits.len();
        scratch.clear();
        if let Some(allowed) = &cfg.allowed {
            scratch.resize(v, f32::NEG_INFINITY);
            for &t in allowed {
                if let Some(&l) = logits.get(t as usize) {
                    scratch[t as usize] = l.widen();
                }
            }
        } else {
            L::extend_widened(logits, scratch);
        }
        if penalties && let Some(c) = hist.counts {
            apply_penalties(cfg, c, scratch);
        }
        for &(t, b) in &cfg.logit_bias {
            if let Some(l) = scratch.get_mut(t as usize) {
                // A finite logit plus a finite bias saturates instead of overflowing to `inf`
                // (the model's logits were fine); a `-inf` bias bans, a banned token stays so.
                let x = *l + b;
                *l = if x.is_finite() || !(l.is_finite() && b.is_finite()) {
                    x
                } else {
                    super::penalties::saturate(*l as f64 + b as f64)
                };
            }
        }
        for &t in cfg.banned.iter().chain(hist.suppress) {
            if let Some(l) = scratch.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        if let Some(m) = &cfg.mask {
            m.apply(hist.prefix, scratch);
        }
        Effective::Scratch(scratch)
    }

    /// Greedy decision for one row: the argmax of the logits after penalties, bias and masks
    /// (temperature, top-k, top-p and min-p never change the argmax). Ties go to the lowest id.
    /// No softmax is computed.
    ///
    /// `logits` is one row, `[vocab]`, in any [`Logit`] dtype (values are widened to `f32` as
    /// they are read; the result is the one of the row converted to `f32`).
    ///
    /// # Errors
    /// [`Error::NonFiniteLogits`] for a NaN or `+inf` entry, [`Error::NoAllowedToken`] when every
    /// entry is `-inf` after masking. `kind` and `row` only label the error.
    pub fn argmax<L: Logit>(
        &mut self,
        cfg: &SamplingConfig,
        logits: &[L],
        hist: &History<'_>,
        kind: RowKind,
        row: usize,
    ) -> Result<u32> {
        with_row!(
            Self::effective(&mut self.scratch, cfg, logits, hist),
            |eff| { argmax_of(eff, kind, row) }
        )
    }

    /// Log-probability of `token` and the `top_n` best tokens under the softmax of the logits
    /// after penalties, bias and masks at temperature 1. Used for greedy rows, whose processed
    /// distribution is a point mass (log-probability 0), to report informative values.
    ///
    /// `logits` is one row, `[vocab]`, in any [`Logit`] dtype.
    ///
    /// # Errors
    /// As [`RowProcessor::argmax`].
    pub fn greedy_logprobs<L: Logit>(
        &mut self,
        cfg: &SamplingConfig,
        logits: &[L],
        hist: &History<'_>,
        token: u32,
        top_n: usize,
    ) -> Result<(f32, Vec<(u32, f32)>)> {
        let (cands, blocks) = (&mut self.cands, &mut self.blocks);
        with_row!(
            Self::effective(&mut self.scratch, cfg, logits, hist),
            |eff| { greedy_logprobs_of(eff, token, top_n, cands, blocks) }
        )
    }

    /// The `n` best tokens of one processed row, best first, into `out` (cleared first): the
    /// highest logits after penalties, bias and masks (steps 1-3; temperature, top-k, top-p and
    /// min-p never change the order), ties to the lowest id. Masked (`-inf`) tokens are never
    /// listed, so `out` holds `min(n, allowed tokens)` ids. The first id is
    /// [`RowProcessor::argmax`]'s.
    ///
    /// `logits` is one row, `[vocab]`, in any [`Logit`] dtype. Cost: the argmax scan plus a
    /// selection of `n` (O(vocab + n log n)), no softmax. Used by the verifier for the verified
    /// rows' top candidates that proposers may ask for
    /// ([`crate::Proposer::row_candidates`]).
    ///
    /// # Errors
    /// As [`RowProcessor::argmax`].
    #[allow(clippy::too_many_arguments)]
    pub fn top_ids<L: Logit>(
        &mut self,
        cfg: &SamplingConfig,
        logits: &[L],
        hist: &History<'_>,
        n: usize,
        kind: RowKind,
        row: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        out.clear();
        let (cands, blocks) = (&mut self.cands, &mut self.blocks);
        with_row!(
            Self::effective(&mut self.scratch, cfg, logits, hist),
            |eff| { top_ids_of(eff, n, kind, row, cands, blocks, out) }
        )
    }

    /// The full pipeline for one row at temperature > 0: writes the processed distribution of
    /// `logits` (`[vocab]`, any [`Logit`] dtype) into `out`.
    ///
    /// For a greedy configuration (temperature 0) the result is the point mass on
    /// [`RowProcessor::argmax`].
    ///
    /// # Errors
    /// [`Error::NonFiniteLogits`] for a NaN or `+inf` entry, [`Error::NoAllowedToken`] when every
    /// entry is `-inf` after masking. `kind` and `row` only label the error.
    pub fn distribution<L: Logit>(
        &mut self,
        cfg: &SamplingConfig,
        logits: &[L],
        hist: &History<'_>,
        kind: RowKind,
        row: usize,
        out: &mut TokenDist,
    ) -> Result<()> {
        let vocab = logits.len();
        if cfg.is_greedy() {
            let t = self.argmax(cfg, logits, hist, kind, row)?;
            *out = TokenDist::point_mass(t, vocab)?;
            return Ok(());
        }
        let bufs = Buffers {
            cands: &mut self.cands,
            work: &mut self.work,
            blocks: &mut self.blocks,
        };
        with_row!(
            Self::effective(&mut self.scratch, cfg, logits, hist),
            |eff| { distribution_of(eff, cfg, bufs, kind, row, out) }
        )
    }
}

/// The processor's candidate buffers, borrowed apart from its scratch row.
struct Buffers<'b> {
    cands: &'b mut Vec<Cand>,
    work: &'b mut Vec<Cand>,
    blocks: &'b mut Vec<f32>,
}

/// [`RowProcessor::argmax`] after steps 1-3.
#[inline]
fn argmax_of<T: Logit>(eff: &[T], kind: RowKind, row: usize) -> Result<u32> {
    let (mx, i, bad) = scan_argmax(eff);
    if bad {
        return Err(non_finite(eff, kind, row));
    }
    if mx == f32::NEG_INFINITY {
        return Err(Error::NoAllowedToken { kind, row });
    }
    Ok(i as u32)
}

/// [`RowProcessor::greedy_logprobs`] after steps 1-3.
fn greedy_logprobs_of<T: Logit>(
    eff: &[T],
    token: u32,
    top_n: usize,
    cands: &mut Vec<Cand>,
    blocks: &mut Vec<f32>,
) -> Result<(f32, Vec<(u32, f32)>)> {
    let (mx, bad) = scan(eff);
    if bad {
        return Err(non_finite(eff, RowKind::Target, 0));
    }
    if mx == f32::NEG_INFINITY {
        return Err(Error::NoAllowedToken {
            kind: RowKind::Target,
            row: 0,
        });
    }
    let mut total = 0.0f64;
    for_each_span(eff, |_, block| {
        for &v in block {
            total += ((v - mx) as f64).exp();
        }
    });
    let lse = mx as f64 + total.ln();
    let lp = eff
        .get(token as usize)
        .map(|v| (v.widen() as f64 - lse) as f32)
        .unwrap_or(f32::NEG_INFINITY);
    let mut top = Vec::new();
    let top_n = top_n.min(eff.len());
    if top_n > 0 {
        scan_top_k(eff, top_n, cands, blocks);
        cands.sort_unstable_by(Cand::rank);
        top = cands
            .iter()
            .map(|c| (c.id, (c.logit as f64 - lse) as f32))
            .collect();
    }
    Ok((lp, top))
}

/// [`RowProcessor::top_ids`] after steps 1-3.
fn top_ids_of<T: Logit>(
    eff: &[T],
    n: usize,
    kind: RowKind,
    row: usize,
    cands: &mut Vec<Cand>,
    blocks: &mut Vec<f32>,
    out: &mut Vec<u32>,
) -> Result<()> {
    let (mx, bad) = scan(eff);
    if bad {
        return Err(non_finite(eff, kind, row));
    }
    if mx == f32::NEG_INFINITY {
        return Err(Error::NoAllowedToken { kind, row });
    }
    let n = n.min(eff.len());
    if n == 0 {
        return Ok(());
    }
    scan_top_k(eff, n, cands, blocks);
    cands.sort_unstable_by(Cand::rank);
    out.extend(
        cands
            .iter()
            .filter(|c| c.logit > f32::NEG_INFINITY)
            .map(|c| c.id),
    );
    Ok(())
}

/// [`RowProcessor::distribution`] after steps 1-3, temperature > 0.
fn distribution_of<T: Logit>(
    eff: &[T],
    cfg: &SamplingConfig,
    bufs: Buffers<'_>,
    kind: RowKind,
    row: usize,
    out: &mut TokenDist,
) -> Result<()> {
    let vocab = eff.len();
    let cands = bufs.cands;
    let top_k = cfg.top_k > 0 && cfg.top_k < vocab;
    // Top-k selection shares its first pass with the scan for the maximum and the screen.
    let (mx, bad) = if top_k {
        let (mx, sum) = scan_top_k(eff, cfg.top_k, cands, bufs.blocks);
        (mx, has_nan_or_pos_inf(sum, eff))
    } else {
        scan(eff)
    };
    if bad {
        return Err(non_finite(eff, kind, row));
    }
    if mx == f32::NEG_INFINITY {
        return Err(Error::NoAllowedToken { kind, row });
    }
    // Temperature: z = (l - max) / T <= 0, so tiny T gives -inf (probability 0), never NaN.
    let inv_t = (1.0 / cfg.temperature).min(f32::MAX);
    if !top_k {
        cands.clear();
        for_each_span(eff, |start, block| {
            cands.extend(
                block
                    .iter()
                    .enumerate()
                    .filter(|&(_, &l)| l > f32::NEG_INFINITY)
                    .map(|(i, &l)| Cand::new((start + i) as u32, l)),
            );
        });
    }
    for c in cands.iter_mut() {
        let d = c.logit - mx;
        let z = if d == 0.0 { 0.0 } else { d * inv_t };
        c.logit = z;
        c.p = z.exp();
    }
    apply_top_p(cands, cfg.top_p, bufs.work);
    apply_min_p(cands, cfg.min_p);
    let total: f64 = cands.iter().map(|c| c.p as f64).sum();
    out.vocab = vocab;
    out.ids.clear();
    out.probs.clear();
    out.scaled.clear();
    out.log_norm = total.ln();
    for c in cands.iter() {
        if c.p > 0.0 {
            out.ids.push(c.id);
            out.probs.push((c.p as f64 / total) as f32);
            out.scaled.push(c.logit);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dist(cfg: &SamplingConfig, logits: &[f32]) -> TokenDist {
        let mut d = TokenDist::default();
        RowProcessor::new()
            .distribution(cfg, logits, &History::default(), RowKind::Target, 0, &mut d)
            .unwrap();
        d
    }

    #[test]
    fn softmax_and_filters() {
        let l: Vec<f32> = [0.6f32, 0.3, 0.1].iter().map(|p| p.ln()).collect();
        let d = dist(&SamplingConfig::sampling(1.0).unwrap(), &l);
        assert!((d.prob(0) - 0.6).abs() < 1e-6);
        let c = SamplingConfig::builder()
            .temperature(1.0)
            .top_p(0.8)
            .build()
            .unwrap();
        let d = dist(&c, &l);
        assert_eq!(d.ids(), &[0, 1]);
        assert!((d.prob(0) - 2.0 / 3.0).abs() < 1e-6);
        let c = SamplingConfig::builder()
            .temperature(1.0)
            .top_k(1)
            .build()
            .unwrap();
        assert_eq!(dist(&c, &l).ids(), &[0]);
        let c = SamplingConfig::builder()
            .temperature(1.0)
            .min_p(0.4)
            .build()
            .unwrap();
        assert_eq!(dist(&c, &l).ids(), &[0, 1]);
    }

    #[test]
    fn tiny_temperature_and_huge_logits_are_finite() {
        for t in [1e-6f32, 1e-3, 1e-30] {
            let c = SamplingConfig::sampling(t).unwrap();
            let d = dist(&c, &[3.0e38, -3.0e38, 3.0e38, 1.0]);
            assert!(d.probs().iter().all(|p| p.is_finite()));
            assert!((d.prob(0) - 0.5).abs() < 1e-6, "{:?}", d);
            assert!(d.logprob(0).is_finite());
        }
    }

    #[test]
    fn non_finite_and_empty_rows_are_errors() {
        let c = SamplingConfig::sampling(1.0).unwrap();
        let mut p = RowProcessor::new();
        let mut d = TokenDist::default();
        let h = History::default();
        let e = p.distribution(&c, &[0.0, f32::NAN], &h, RowKind::Target, 2, &mut d);
        assert!(matches!(
            e,
            Err(Error::NonFiniteLogits {
                row: 2,
                token: 1,
                ..
            })
        ));
        let e = p.argmax(&c, &[f32::INFINITY, 0.0], &h, RowKind::Draft, 0);
        assert!(matches!(
            e,
            Err(Error::NonFiniteLogits {
                kind: RowKind::Draft,
                ..
            })
        ));
        let e = p.argmax(&c, &[f32::NEG_INFINITY; 3], &h, RowKind::Target, 0);
        assert!(matches!(e, Err(Error::NoAllowedToken { .. })));
        let banned = SamplingConfig::builder()
            .temperature(1.0)
            .banned_tokens([0, 1])
            .build()
            .unwrap();
        let e = p.distribution(&banned, &[1.0, 2.0], &h, RowKind::Target, 0, &mut d);
        assert!(matches!(e, Err(Error::NoAllowedToken { .. })));
    }

    #[test]
    fn dense_rows() {
        let d = TokenDist::from_pairs([(3, 0.25), (1, 0.75)], 5).unwrap();
        assert_eq!(d.to_dense(), vec![0.0, 0.75, 0.0, 0.25, 0.0]);
        let mut out = [9.0f32; 7];
        d.write_dense(&mut out).unwrap();
        assert_eq!(out, [0.0, 0.75, 0.0, 0.25, 0.0, 0.0, 0.0]);
        let mut short = [9.0f32; 4];
        assert!(matches!(
            d.write_dense(&mut short),
            Err(Error::ShapeMismatch {
                expected: 5,
                actual: 4,
                ..
            })
        ));
        assert_eq!(short, [9.0; 4]);
        assert_eq!(TokenDist::default().to_dense(), Vec::<f32>::new());
    }

    #[test]
    fn argmax_ties_go_to_lowest_id() {
        let c = SamplingConfig::greedy();
        let mut p = RowProcessor::new();
        let h = History::default();
        assert_eq!(
            p.argmax(&c, &[1.0, 1.0, 0.0], &h, RowKind::Target, 0)
                .unwrap(),
            0
        );
        let row: Vec<f32> = (0..1000)
            .map(|i| if i % 100 == 37 { 5.0 } else { 0.0 })
            .collect();
        assert_eq!(p.argmax(&c, &row, &h, RowKind::Target, 0).unwrap(), 37);
    }

    #[test]
    fn masks_and_bias() {
        let c = SamplingConfig::builder()
            .allowed_tokens([1, 2])
            .logit_bias(2, 10.0)
            .build()
            .unwrap();
        let mut p = RowProcessor::new();
        let h = History::default();
        assert_eq!(
            p.argmax(&c, &[9.0, 1.0, 0.0], &h, RowKind::Target, 0)
                .unwrap(),
            2
        );
        let m = std::sync::Arc::new(|prefix: &[u32], l: &mut [f32]| {
            if prefix.last() == Some(&7) {
                l[0] = f32::NEG_INFINITY;
            }
        });
        let c = SamplingConfig::builder().mask(m).build().unwrap();
        let h = History {
            counts: None,
            prefix: &[7],
            suppress: &[],
        };
        assert_eq!(
            p.argmax(&c, &[9.0, 1.0, 0.0], &h, RowKind::Target, 0)
                .unwrap(),
            1
        );
    }
}
