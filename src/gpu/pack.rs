//! Host side shared by the GPU backends: validation, packing of the small per-sequence
//! parameters into one `u32` array, and assembly of [`StepOutput`]s from the per-row results.
//!
//! Layout of the parameter array (all `u32`; floats stored as their bits):
//! - sequence records, 16 words each (see `S_*` in `kernels/verify.wgsl`);
//! - row records, 8 words each: sequence, row index `i`, logits row, draft token (or `NONE`),
//!   position low / high, mask word offset (or `NONE`), scratch slot (or `NONE`);
//! - patches, 4 words each: token, count in the context, logit bias bits, has-bias flag;
//! - all draft tokens (penalty counts of earlier drafts);
//! - mask words (bit set = token forbidden), `ceil(vocab / 32)` words per mask.
//!
//! The per-row output is 8 words (status, error token, error value, accept flag, emitted token,
//! log-prob of the draft, log-prob of the emitted token, number of top entries), followed by
//! `[rows, max_top]` pairs `(token, logprob bits)`.

use super::DeviceBatch;
use crate::error::{Error, Result, RowKind};
use crate::sampling::SamplingConfig;
use crate::verify::{DraftProbs, StepEnd, StepOutput, TokenLogprob};

pub(crate) const NONE: u32 = u32::MAX;
/// The most top log-probabilities a GPU row reports.
pub const MAX_TOP_LOGPROBS: usize = 32;
pub(crate) const SEQ_WORDS: usize = 16;
pub(crate) const OUT_WORDS: usize = 8;

/// Everything a kernel launch needs, built on the host.
#[derive(Debug, Default)]
pub(crate) struct Packed {
    /// The uniform block (16 words, see `Globals` in the WGSL source).
    pub globals: [u32; 16],
    pub params: Vec<u32>,
    /// Dense q rows (`[sum k, draft_vocab]`), or one zero when q is a point mass.
    pub n_rows: usize,
    pub scratch_rows: usize,
    /// Per sequence: `Err` from validation, or the first row and k.
    seqs: Vec<std::result::Result<(usize, usize), Error>>,
    logprobs: Vec<Option<usize>>,
    /// Draft pass only: `(sequence, i)` of every row.
    pub row_map: Vec<(usize, usize)>,
    /// Draft pass only: `sum k * draft_vocab`, the dense q written after the row records.
    pub dense_words: usize,
}

impl Packed {
    /// Output buffer length in `u32` words.
    pub fn out_words(&self) -> usize {
        if self.globals[13] == 1 {
            return self.n_rows * OUT_WORDS + self.dense_words;
        }
        self.n_rows * OUT_WORDS + self.n_rows * MAX_TOP_LOGPROBS * 2
    }
}

/// The errors of the draft pass, by `(sequence, draft row)`: the draft-logit rows that have a
/// NaN / `+inf` logit or no allowed token.
pub(crate) fn draft_errors(
    d: &Packed,
    out: &[u32],
) -> std::collections::HashMap<(usize, usize), Error> {
    let mut m = std::collections::HashMap::new();
    for (r, &(b, i)) in d.row_map.iter().enumerate() {
        let o = &out[r * OUT_WORDS..(r + 1) * OUT_WORDS];
        let e = match o[0] {
            0 => continue,
            1 => Error::NonFiniteLogits {
                kind: RowKind::Draft,
                row: i,
                token: o[1] as usize,
                value: f32::from_bits(o[2]),
            },
            _ => Error::NoAllowedToken {
                kind: RowKind::Draft,
                row: i,
            },
        };
        m.insert((b, i), e);
    }
    m
}

fn token_check(t: u32, vocab: usize, what: &'static str) -> Result<()> {
    if (t as usize) < vocab {
        Ok(())
    } else {
        Err(Error::TokenOutOfVocab {
            what,
            token: t,
            vocab_size: vocab,
        })
    }
}

/// Batch-level checks (the outer `Err` of `verify_batch`): the CPU's own.
pub(crate) fn check_batch(batch: &DeviceBatch<'_>) -> Result<usize> {
    crate::verify::check_layout(
        batch.draft_offsets,
        batch.sequences.len(),
        batch.draft_tokens.len(),
        batch.vocab_size,
        &batch.draft_probs,
    )
}

fn check_sequence(
    cfg: &SamplingConfig,
    drafts: &[u32],
    context: &[u32],
    vocab: usize,
    qv: usize,
    dense: bool,
) -> Result<()> {
    if vocab == 0 {
        return Err(Error::ShapeMismatch {
            what: "vocab_size",
            expected: 1,
            actual: 0,
        });
    }
    for &t in drafts {
        token_check(t, vocab, "draft token")?;
    }
    cfg.check_vocab(vocab)?;
    if dense && qv == 0 && !drafts.is_empty() {
        return Err(Error::ShapeMismatch {
            what: "draft vocab",
            expected: 1,
            actual: 0,
        });
    }
    if cfg.has_penalties() {
        for &t in context {
            token_check(t, vocab, "context token")?;
        }
    }
    if let Some(n) = cfg.logprobs() {
        if n > MAX_TOP_LOGPROBS {
            return Err(Error::config(
                "logprobs",
                n,
                "the GPU backends report at most 32 top log-probabilities",
            ));
        }
    }
    Ok(())
}

/// The host side of one verify call, shared by the backends: the main pass's packed rows, the
/// draft pass's (`DraftProbs::Logits` with at least one row), and the host q data to upload
/// (dense q or draft logits; a single 0.0 for point masses).
pub(crate) struct Prepared<'b> {
    pub main: Packed,
    pub draft: Option<Packed>,
    pub q: &'b [f32],
}

/// Packs `batch` for the main pass and, for draft logits, the draft pass.
pub(crate) fn prepare<'b>(batch: &DeviceBatch<'b>, qv: usize) -> Result<Prepared<'b>> {
    let main = pack(batch, qv, false)?;
    let draft = match batch.draft_probs {
        DraftProbs::Logits { .. } => Some(pack(batch, qv, true)?),
        _ => None,
    }
    .filter(|d| d.n_rows > 0);
    let q: &'b [f32] = match batch.draft_probs {
        DraftProbs::Probs { probs, .. } if !probs.is_empty() => probs,
        DraftProbs::Logits { logits, .. } if !logits.is_empty() => logits,
        _ => &[0.0],
    };
    Ok(Prepared { main, draft, q })
}

/// Packs a validated batch. With `draft`, packs the draft pass instead: the `[sum k, qv]`
/// draft-logit rows of the stochastic sequences, processed with each sequence's configuration
/// into dense q (`DraftProbs::Logits`).
pub(crate) fn pack(batch: &DeviceBatch<'_>, qv: usize, draft: bool) -> Result<Packed> {
    let v = batch.vocab_size;
    let width = if draft { qv } else { v };
    if v >= (1 << 31) {
        return Err(Error::BatchTooLarge {
            backend: "gpu",
            what: "vocab_size",
            size: v as u64,
            limit: (1u64 << 31) - 1,
        });
    }
    let dense = !matches!(batch.draft_probs, DraftProbs::PointMass);
    let checked = matches!(batch.draft_probs, DraftProbs::Probs { .. });
    let off = batch.draft_offsets;
    let n = batch.sequences.len();
    let mask_words = width.div_ceil(32);
    let mut seq_recs: Vec<u32> = Vec::with_capacity(n * SEQ_WORDS);
    let mut rows: Vec<u32> = Vec::new();
    let mut patches: Vec<u32> = Vec::new();
    let mut masks: Vec<u32> = Vec::new();
    let mut p = Packed::default();
    let mut n_rows = 0usize;
    let mut slots = 0usize;
    let mut zero_row: Vec<f32> = Vec::new();
    let mut prefix: Vec<u32> = Vec::new();
    for (b, s) in batch.sequences.iter().enumerate() {
        let (lo, hi) = (off[b], off[b + 1]);
        let drafts = &batch.draft_tokens[lo..hi];
        let k = drafts.len();
        p.logprobs.push(s.config.logprobs());
        if let Err(e) = check_sequence(s.config, drafts, s.context, v, qv, dense) {
            p.seqs.push(Err(e));
            continue;
        }
        let cfg = s.config;
        if draft && (cfg.is_greedy() || k == 0) {
            p.seqs.push(Ok((n_rows, 0)));
            continue;
        }
        let sidx = seq_recs.len() / SEQ_WORDS;
        // Patches: every token whose logit the penalties or the bias may change.
        let patch_off = patches.len() / 4;
        let mut entries: Vec<(u32, u32, f32, bool)> = Vec::new();
        if cfg.has_penalties() {
            let mut c: Vec<u32> = s.context.to_vec();
            c.sort_unstable();
            for g in c.chunk_by(|a, b| a == b) {
                entries.push((g[0], g.len() as u32, 0.0, false));
            }
            for &d in drafts {
                entries.push((d, 0, 0.0, false));
            }
        }
        for &(t, bias) in cfg.logit_bias() {
            entries.push((t, 0, bias, true));
        }
        entries.sort_by_key(|e| e.0);
        let mut merged: Vec<(u32, u32, f32, bool)> = Vec::with_capacity(entries.len());
        for e in entries {
            match merged.last_mut() {
                Some(m) if m.0 == e.0 => {
                    m.1 += e.1;
                    if e.3 {
                        m.2 = e.2;
                        m.3 = true;
                    }
                }
                _ => merged.push(e),
            }
        }
        // Tokens beyond the row width (a shorter draft vocabulary) are ignored, as on the CPU.
        merged.retain(|e| (e.0 as usize) < width);
        for &(t, c, bias, has) in &merged {
            patches.extend_from_slice(&[t, c, bias.to_bits(), has as u32]);
        }
        let has_mask = cfg.allowed_tokens().is_some()
            || !cfg.banned_tokens().is_empty()
            || cfg.mask().is_some();
        let needs_scratch = has_mask || !merged.is_empty();
        // Masks: one per sequence, or one per row with a caller mask.
        let mut seq_mask = NONE;
        let mut base_mask: Vec<u32> = Vec::new();
        if has_mask {
            base_mask = vec![0u32; mask_words];
            if let Some(a) = cfg.allowed_tokens() {
                base_mask.iter_mut().for_each(|w| *w = u32::MAX);
                for &t in a.iter().filter(|&&t| (t as usize) < width) {
                    base_mask[t as usize / 32] &= !(1u32 << (t % 32));
                }
            }
            for &t in cfg
                .banned_tokens()
                .iter()
                .filter(|&&t| (t as usize) < width)
            {
                base_mask[t as usize / 32] |= 1u32 << (t % 32);
            }
            if cfg.mask().is_none() {
                seq_mask = masks.len() as u32;
                masks.extend_from_slice(&base_mask);
            }
        }
        let pos0 = s.position.unwrap_or(s.context.len() as u64);
        let first_row = n_rows;
        let last_row = if draft { k - 1 } else { k };
        for i in 0..=last_row {
            let mut row_mask = seq_mask;
            if let Some(m) = cfg.mask() {
                prefix.clear();
                prefix.extend_from_slice(s.context);
                prefix.extend_from_slice(&drafts[..i]);
                zero_row.clear();
                zero_row.resize(width, 0.0);
                m.apply(&prefix, &mut zero_row);
                row_mask = masks.len() as u32;
                let start = masks.len();
                masks.extend_from_slice(&base_mask);
                for (t, &z) in zero_row.iter().enumerate() {
                    if z == f32::NEG_INFINITY {
                        masks[start + t / 32] |= 1u32 << (t % 32);
                    }
                }
            }
            let pos = pos0 + i as u64;
            let slot = if needs_scratch {
                slots += 1;
                (slots - 1) as u32
            } else {
                NONE
            };
            if draft {
                p.row_map.push((b, i));
            }
            rows.extend_from_slice(&[
                sidx as u32,
                i as u32,
                if draft { lo + i } else { lo + b + i } as u32,
                if i < k { drafts[i] } else { NONE },
                pos as u32,
                (pos >> 32) as u32,
                row_mask,
                slot,
            ]);
            n_rows += 1;
        }
        let flags = (cfg.is_greedy() as u32) | ((cfg.has_penalties() as u32) << 1);
        seq_recs.extend_from_slice(&[
            cfg.temperature().to_bits(),
            cfg.top_k().min(u32::MAX as usize) as u32,
            cfg.top_p().to_bits(),
            cfg.min_p().to_bits(),
            cfg.repetition_penalty().to_bits(),
            cfg.frequency_penalty().to_bits(),
            cfg.presence_penalty().to_bits(),
            flags,
            s.seed as u32,
            (s.seed >> 32) as u32,
            patch_off as u32,
            merged.len() as u32,
            lo as u32,
            k as u32,
            cfg.logprobs().map(|n| n as u32).unwrap_or(NONE),
            lo as u32,
        ]);
        p.seqs.push(Ok((first_row, k)));
    }
    let row_base = seq_recs.len();
    let patch_base = row_base + rows.len();
    let draft_base = patch_base + patches.len();
    let mask_base = draft_base + batch.draft_tokens.len();
    p.params = seq_recs;
    p.params.extend_from_slice(&rows);
    p.params.extend_from_slice(&patches);
    p.params.extend_from_slice(batch.draft_tokens);
    p.params.extend_from_slice(&masks);
    if p.params.is_empty() {
        p.params.push(0);
    }
    let check = |x: usize| -> Result<u32> {
        u32::try_from(x).map_err(|_| Error::BatchTooLarge {
            backend: "gpu",
            what: "logits elements of one launch",
            size: x as u64,
            limit: u32::MAX as u64,
        })
    };
    check(n_rows.saturating_mul(width))?;
    check(slots.saturating_mul(width))?;
    p.dense_words = if draft {
        batch.draft_tokens.len() * qv
    } else {
        0
    };
    check(n_rows * OUT_WORDS + p.dense_words)?;
    p.globals = [
        width as u32,
        qv as u32,
        n_rows as u32,
        row_base as u32,
        patch_base as u32,
        draft_base as u32,
        mask_base as u32,
        mask_words as u32,
        MAX_TOP_LOGPROBS as u32,
        (n_rows * OUT_WORDS) as u32,
        0,
        dense as u32,
        0,
        draft as u32,
        0,
        checked as u32,
    ];
    p.n_rows = n_rows;
    p.scratch_rows = slots;
    Ok(p)
}

/// Builds each sequence's [`StepOutput`] from the per-row results (`out`, [`Packed::out_words`]
/// words), walking its rows in order and stopping at the first rejection, as the CPU does.
/// `draft_errs` holds the draft pass's errors (`DraftProbs::Logits`), reported after the
/// target row's own errors and before the checks of q, as the CPU does.
pub(crate) fn assemble(
    p: Packed,
    batch: &DeviceBatch<'_>,
    out: &[u32],
    mut draft_errs: std::collections::HashMap<(usize, usize), Error>,
) -> Vec<Result<StepOutput>> {
    let tops_base = p.n_rows * OUT_WORDS;
    let mut res = Vec::with_capacity(p.seqs.len());
    for (b, s) in p.seqs.into_iter().enumerate() {
        let (r0, k) = match s {
            Err(e) => {
                res.push(Err(e));
                continue;
            }
            Ok(x) => x,
        };
        let drafts = &batch.draft_tokens[batch.draft_offsets[b]..batch.draft_offsets[b + 1]];
        let want = p.logprobs[b];
        let mut tokens = Vec::with_capacity(k + 1);
        let mut lps = want.map(|_| Vec::with_capacity(k + 1));
        let mut end = if k == 0 {
            StepEnd::NoDraft
        } else {
            StepEnd::AllAccepted
        };
        let mut err = None;
        for (i, r) in (r0..=r0 + k).enumerate() {
            let o = &out[r * OUT_WORDS..(r + 1) * OUT_WORDS];
            let e = match o[0] {
                0 => None,
                1 => Some(Error::NonFiniteLogits {
                    kind: RowKind::Target,
                    row: i,
                    token: o[1] as usize,
                    value: f32::from_bits(o[2]),
                }),
                2 => Some(Error::NoAllowedToken {
                    kind: RowKind::Target,
                    row: i,
                }),
                3 => Some(Error::InvalidDraftProbs {
                    row: i,
                    reason: "a probability is negative or not finite",
                }),
                4 => Some(Error::InvalidDraftProbs {
                    row: i,
                    reason: "probabilities do not sum to 1 (tolerance 1e-3)",
                }),
                _ => Some(Error::InvalidDraftProbs {
                    row: i,
                    reason: "the drafted token has probability 0 under q",
                }),
            };
            // Order of the CPU: the target row, then the draft row, then q.
            if let Some(e @ (Error::NonFiniteLogits { .. } | Error::NoAllowedToken { .. })) = e {
                err = Some(e);
                break;
            }
            if let Some(e) = draft_errs.remove(&(b, i)) {
                err = Some(e);
                break;
            }
            if let Some(e) = e {
                err = Some(e);
                break;
            }
            let accepted = i < k && o[3] != 0;
            let (tok, lp) = if accepted {
                (drafts[i], f32::from_bits(o[5]))
            } else {
                (o[4], f32::from_bits(o[6]))
            };
            tokens.push(tok);
            if let Some(l) = lps.as_mut() {
                let n = (o[7] as usize).min(MAX_TOP_LOGPROBS);
                let base = tops_base + r * MAX_TOP_LOGPROBS * 2;
                let top = (0..n)
                    .map(|j| (out[base + 2 * j], f32::from_bits(out[base + 2 * j + 1])))
                    .collect();
                l.push(TokenLogprob {
                    token: tok,
                    logprob: lp,
                    top,
                });
            }
            if !accepted {
                if i < k {
                    end = StepEnd::Rejected { index: i };
                }
                break;
            }
        }
        res.push(match err {
            Some(e) => Err(e),
            None => Ok(StepOutput {
                accepted: tokens.len() - 1,
                tokens,
                logprobs: lps,
                end,
            }),
        })
    }
    res
}
