//! Host side shared by the GPU backends: validation, packing of the small per-sequence
//! parameters into one `u32` array, and assembly of [`StepOutput`]s from the per-row results.
//!
//! Layout of the parameter array (all `u32`; floats stored as their bits):
//! - sequence records, 16 words each (see `S_*` in `kernels/verify.wgsl`);
//! - row records, 8 words each: sequence, row index `i`, logits row, draft token (or `NONE`),
//!   position low / high, mask word offset (or `NONE`), scratch slot (or `NONE`);
//! - patches, 4 words each: token, frequency / presence count from the context, logit bias
//!   bits, flags (bit 0: has a bias, bit 1: occurs in the context, for the repetition penalty);
//! - all draft tokens (penalty counts of earlier drafts);
//! - mask words (bit set = token forbidden), `ceil(vocab / 32)` words per mask.
//!
//! The per-row output is 8 words (status, error token, error value, accept flag, emitted token,
//! log-prob of the draft, log-prob of the emitted token, number of top entries), followed by
//! `[rows, max_top]` pairs `(token, logprob bits)`.
//!
//! Order of the errors of one sequence, as on the CPU ([`crate::Verifier::verify`]): the input
//! checks of `VerifyRequest::validate` (on the host; with device-resident logits the check of the
//! raw target logits comes from the device, every row), the context tokens (penalties), the
//! draft-logit rows in order (the draft pass), then the target rows in the order the step reaches
//! them.

use super::DeviceBatch;
use crate::error::{Error, Result, RowKind};
use crate::sampling::PenaltyScope;
use crate::verify::{DraftProbs, StepEnd, StepOutput, TokenLogprob, VerifyRequest};

pub(crate) const NONE: u32 = u32::MAX;
/// The most top log-probabilities a GPU row reports.
pub const MAX_TOP_LOGPROBS: usize = 32;
pub(crate) const SEQ_WORDS: usize = 16;
pub(crate) const OUT_WORDS: usize = 8;

/// Row status codes written by the kernels (`ST_*` in both sources).
const ST_OK: u32 = 0;
/// NaN / `+inf` in the processed row (penalties or bias overflowed).
const ST_NON_FINITE: u32 = 1;
const ST_NO_TOKEN: u32 = 2;
/// NaN / `+inf` in the raw row (validation: reported whether or not the row is reached).
const ST_RAW_NON_FINITE: u32 = 3;
/// Draft pass: the draft token has probability 0 under its processed draft row (greedy: is not
/// its argmax).
const ST_DRAFT_ZERO: u32 = 4;

/// What the host decided about one sequence before the launch.
#[derive(Debug)]
pub(crate) enum Pre {
    /// Rejected by the host checks: not packed.
    Fail(Error),
    /// Packed. `deferred` is an error the CPU reports after the check of the raw target logits
    /// (a context token outside the vocabulary), held until the device has reported that check.
    Run { deferred: Option<Error> },
}

/// Everything a kernel launch needs, built on the host.
#[derive(Debug, Default)]
pub(crate) struct Packed {
    /// The uniform block (16 words, see `Globals` in the WGSL source).
    pub globals: [u32; 16],
    pub params: Vec<u32>,
    /// Number of rows launched.
    pub n_rows: usize,
    /// Number of scratch rows (`[scratch_rows, width]` f32).
    pub scratch_rows: usize,
    /// Per sequence: the first row and k when packed.
    seqs: Vec<Option<(usize, usize)>>,
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

/// The first error of each sequence's draft-logit rows (`[n_seq]`, `None` when all are fine),
/// from the draft pass's row statuses: NaN / `+inf` after processing, no allowed token, or a
/// draft token the processed row cannot produce.
pub(crate) fn draft_errors(d: &Packed, out: &[u32]) -> Vec<Option<Error>> {
    let mut errs: Vec<Option<Error>> = Vec::new();
    errs.resize_with(d.seqs.len(), || None);
    for (r, &(b, i)) in d.row_map.iter().enumerate() {
        let o = &out[r * OUT_WORDS..(r + 1) * OUT_WORDS];
        if o[0] == ST_OK || errs[b].is_some() {
            continue;
        }
        errs[b] = Some(match o[0] {
            ST_NON_FINITE | ST_RAW_NON_FINITE => Error::NonFiniteLogits {
                kind: RowKind::Draft,
                row: i,
                token: o[1] as usize,
                value: f32::from_bits(o[2]),
            },
            ST_NO_TOKEN => Error::NoAllowedToken {
                kind: RowKind::Draft,
                row: i,
            },
            st => {
                debug_assert_eq!(st, ST_DRAFT_ZERO);
                Error::InvalidDraftProbs {
                    row: i,
                    reason: "the drafted token has probability 0 under the processed draft logits",
                }
            }
        });
    }
    errs
}

/// Batch-level checks (the outer `Err` of `verify_batch`): the CPU's own, plus one draft form
/// for the whole batch (the kernels take one): a sequence may set its own
/// [`SequenceParams::draft_probs`](crate::SequenceParams::draft_probs) only to point masses in a
/// point-mass batch.
pub(crate) fn check_batch(batch: &DeviceBatch<'_>) -> Result<usize> {
    let qv = crate::verify::check_layout(
        batch.draft_offsets,
        batch.sequences.len(),
        batch.draft_tokens.len(),
        batch.vocab_size,
        &batch.draft_probs,
    )?;
    let uniform = batch.sequences.iter().all(|s| match s.draft_probs {
        None => true,
        Some(DraftProbs::PointMass) => matches!(batch.draft_probs, DraftProbs::PointMass),
        Some(_) => false,
    });
    if !uniform {
        return Err(Error::Unsupported {
            backend: "gpu",
            what: "per-sequence draft forms (SequenceParams::draft_probs) other than point masses in a point-mass batch",
        });
    }
    crate::verify::check_tree_layout(
        batch.draft_tokens.len(),
        batch.parents,
        batch.schemes,
        batch.ends,
    )?;
    if batch
        .sequences
        .iter()
        .any(|s| s.final_draft_ends || s.row_top_k > 0)
    {
        return Err(Error::Unsupported {
            backend: "gpu",
            what: "SequenceParams::final_draft_ends or row_top_k (stop-cut chains and row candidates); the CPU Verifier verifies them",
        });
    }
    if !chains_only(batch) {
        return Err(Error::Unsupported {
            backend: "gpu",
            what: "token trees (parents other than a chain, sibling schemes other than the draft form's default, or ending drafts); the CPU Verifier verifies them",
        });
    }
    Ok(qv)
}

/// `true` when every sequence's block is a plain chain the kernels verify: parents `i` at node
/// `i` (or none), the draft form's default scheme, no ending draft.
fn chains_only(batch: &DeviceBatch<'_>) -> bool {
    let off = batch.draft_offsets;
    let default = crate::tree::TreeLimits {
        dense_q: !matches!(batch.draft_probs, DraftProbs::PointMass),
        ..crate::tree::TreeLimits::vocab(batch.vocab_size)
    }
    .default_scheme();
    let parents_ok = batch.parents.is_none_or(|p| {
        (0..batch.sequences.len()).all(|b| {
            crate::tree::DraftBlock::tree(
                &batch.draft_tokens[off[b]..off[b + 1]],
                &p[off[b]..off[b + 1]],
            )
            .is_chain()
        })
    });
    parents_ok
        && batch
            .schemes
            .is_none_or(|s| s.iter().all(|&x| x == default))
        && !batch.ends.contains(&true)
}

/// Sequence `b` of a layout-checked batch as the request [`crate::Verifier::verify_batch`] builds
/// for it, with `target` as its target logits (empty for device-resident logits).
fn request<'b>(
    batch: &DeviceBatch<'b>,
    b: usize,
    qv: usize,
    target: &'b [f32],
) -> VerifyRequest<'b> {
    let (lo, hi) = (batch.draft_offsets[b], batch.draft_offsets[b + 1]);
    crate::verify::sequence_request(
        batch.sequences,
        batch.draft_tokens,
        batch.draft_offsets,
        batch.draft_probs,
        (b, qv, batch.vocab_size),
        target,
    )
    .with_tree(batch.parents, batch.schemes, batch.ends, (lo, hi))
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

/// The host's decision for every sequence of a layout-checked batch. `host_logits`: the batch's
/// target logits when they are in host memory (then the CPU's own `validate` runs, raw target
/// values included), `None` for device-resident logits (the device checks the raw values).
fn pre_checks(batch: &DeviceBatch<'_>, qv: usize, host_logits: Option<&[f32]>) -> Vec<Pre> {
    let v = batch.vocab_size;
    let off = batch.draft_offsets;
    (0..batch.sequences.len())
        .map(|b| {
            let s = &batch.sequences[b];
            let checked = match host_logits {
                Some(l) => {
                    request(batch, b, qv, &l[(off[b] + b) * v..(off[b + 1] + b + 1) * v]).validate()
                }
                None => request(batch, b, qv, &[]).validate_inputs(),
            };
            if let Err(e) = checked {
                return Pre::Fail(e);
            }
            if let Some(n) = s.config.logprobs().filter(|&n| n > MAX_TOP_LOGPROBS) {
                return Pre::Fail(Error::config(
                    "logprobs",
                    n,
                    "the GPU backends report at most 32 top log-probabilities",
                ));
            }
            // The penalties' token counts (`TokenCounts::from_context` on the CPU).
            let context = if s.config.has_penalties() {
                s.context
                    .iter()
                    .try_for_each(|&t| token_check(t, v, "context token"))
                    .err()
            } else {
                None
            };
            match (context, host_logits) {
                (Some(e), Some(_)) => Pre::Fail(e),
                (deferred, _) => Pre::Run { deferred },
            }
        })
        .collect()
}

/// The host side of one verify call, shared by the backends: the host's per-sequence decisions,
/// the main pass's packed rows, the draft pass's (`DraftProbs::Logits` with at least one row),
/// and the host q data to upload (dense q or draft logits; a single 0.0 for point masses).
pub(crate) struct Prepared<'b> {
    pub pre: Vec<Pre>,
    pub main: Packed,
    pub draft: Option<Packed>,
    pub q: &'b [f32],
}

/// Checks and packs `batch` (layout-checked, dense q width `qv`) for the main pass and, for draft
/// logits, the draft pass. `host_logits`: the target logits when they are in host memory.
pub(crate) fn prepare<'b>(
    batch: &DeviceBatch<'b>,
    qv: usize,
    host_logits: Option<&[f32]>,
) -> Result<Prepared<'b>> {
    let pre = pre_checks(batch, qv, host_logits);
    let main = pack(batch, qv, false, &pre)?;
    let draft = match batch.draft_probs {
        DraftProbs::Logits { .. } => Some(pack(batch, qv, true, &pre)?),
        _ => None,
    }
    .filter(|d| d.n_rows > 0);
    let q: &'b [f32] = match batch.draft_probs {
        DraftProbs::Probs { probs, .. } if !probs.is_empty() => probs,
        DraftProbs::Logits { logits, .. } if !logits.is_empty() => logits,
        _ => &[0.0],
    };
    Ok(Prepared {
        pre,
        main,
        draft,
        q,
    })
}

/// Sets bit `t` (token forbidden) of a mask.
fn forbid(mask: &mut [u32], t: u32) {
    mask[t as usize / 32] |= 1u32 << (t % 32);
}

/// One patch before merging: token, frequency / presence count, bias, has bias, in context.
type Patch = (u32, u32, f32, bool, bool);

/// Packs the sequences that `pre` lets run. With `draft`, packs the draft pass instead: the
/// `[sum k, qv]` draft-logit rows, processed with each sequence's configuration and history into
/// dense q (stochastic) or checked against their argmax (greedy) (`DraftProbs::Logits`).
fn pack(batch: &DeviceBatch<'_>, qv: usize, draft: bool, pre: &[Pre]) -> Result<Packed> {
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
        let cfg = s.config;
        p.logprobs.push(cfg.logprobs());
        // A sequence with a deferred error runs only for the device's check of its raw target
        // rows: no draft pass, and the caller's mask is not called with its invalid context.
        let deferred = match &pre[b] {
            Pre::Fail(_) => None,
            Pre::Run { deferred } => Some(deferred.is_some()),
        };
        if deferred.is_none() || (draft && (k == 0 || deferred == Some(true))) {
            p.seqs.push(None);
            continue;
        }
        let caller_mask = cfg.mask().filter(|_| deferred == Some(false));
        let sidx = seq_recs.len() / SEQ_WORDS;
        // Patches: every token whose logit the penalties or the bias may change. The repetition
        // penalty counts prompt and generated tokens; frequency and presence count generated
        // tokens (context from `prompt_len` on, and the earlier drafts, which the kernel adds)
        // unless the scope is the whole context.
        let patch_off = patches.len() / 4;
        let mut entries: Vec<Patch> = Vec::new();
        if cfg.has_penalties() {
            let whole = cfg.penalty_scope() == PenaltyScope::WholeContext;
            let split = s.prompt_len.min(s.context.len());
            for (j, &t) in s.context.iter().enumerate() {
                entries.push((t, (whole || j >= split) as u32, 0.0, false, true));
            }
            for &d in drafts {
                entries.push((d, 0, 0.0, false, false));
            }
        }
        for &(t, bias) in cfg.logit_bias() {
            entries.push((t, 0, bias, true, false));
        }
        entries.sort_by_key(|e| e.0);
        let mut merged: Vec<Patch> = Vec::with_capacity(entries.len());
        for e in entries {
            match merged.last_mut() {
                Some(m) if m.0 == e.0 => {
                    m.1 += e.1;
                    m.4 |= e.4;
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
        for &(t, c, bias, has, seen) in &merged {
            patches.extend_from_slice(&[t, c, bias.to_bits(), has as u32 | (seen as u32) << 1]);
        }
        // Masks: the allowed / banned sets (`base`), plus the suppressed tokens at rows
        // `0..suppress_rows`, plus the caller's mask per row.
        let has_base = cfg.allowed_tokens().is_some() || !cfg.banned_tokens().is_empty();
        let mut base = vec![0u32; mask_words];
        if let Some(a) = cfg.allowed_tokens() {
            base.iter_mut().for_each(|w| *w = u32::MAX);
            for &t in a.iter().filter(|&&t| (t as usize) < width) {
                base[t as usize / 32] &= !(1u32 << (t % 32));
            }
        }
        for &t in cfg
            .banned_tokens()
            .iter()
            .filter(|&&t| (t as usize) < width)
        {
            forbid(&mut base, t);
        }
        let mut with_sup = base.clone();
        let mut any_sup = false;
        for &t in s.suppress.iter().filter(|&&t| (t as usize) < width) {
            forbid(&mut with_sup, t);
            any_sup = true;
        }
        let sup_rows = if any_sup { s.suppress_rows } else { 0 };
        let (mut seq_mask, mut sup_mask) = (NONE, NONE);
        if caller_mask.is_none() {
            if has_base {
                seq_mask = masks.len() as u32;
                masks.extend_from_slice(&base);
            }
            if sup_rows > 0 {
                sup_mask = masks.len() as u32;
                masks.extend_from_slice(&with_sup);
            }
        }
        let pos0 = s.position.unwrap_or(s.context.len() as u64);
        let first_row = n_rows;
        let last_row = if draft { k - 1 } else { k };
        for i in 0..=last_row {
            let sup = i < sup_rows;
            let mut row_mask = if sup { sup_mask } else { seq_mask };
            if let Some(m) = caller_mask {
                prefix.clear();
                prefix.extend_from_slice(s.context);
                prefix.extend_from_slice(&drafts[..i]);
                zero_row.clear();
                zero_row.resize(width, 0.0);
                m.apply(&prefix, &mut zero_row);
                row_mask = masks.len() as u32;
                let start = masks.len();
                masks.extend_from_slice(if sup { &with_sup } else { &base });
                for (t, &z) in zero_row.iter().enumerate() {
                    if z == f32::NEG_INFINITY {
                        forbid(&mut masks[start..], t as u32);
                    }
                }
            }
            let pos = pos0 + i as u64;
            let slot = if row_mask != NONE || !merged.is_empty() {
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
        p.seqs.push(Some((first_row, k)));
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
    check(p.params.len())?;
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
        0,
    ];
    p.n_rows = n_rows;
    p.scratch_rows = slots;
    Ok(p)
}

/// Builds each sequence's [`StepOutput`] from the per-row results (`out`, [`Packed::out_words`]
/// words of the main pass), in the CPU's order: the host's error (`pre`), a NaN / `+inf` in any
/// raw target row, the deferred context error, the first draft-row error (`draft_errs`, from
/// [`draft_errors`]; empty without a draft pass), then the target rows in order, stopping at the
/// first rejection.
pub(crate) fn assemble(
    p: Packed,
    pre: Vec<Pre>,
    batch: &DeviceBatch<'_>,
    out: &[u32],
    mut draft_errs: Vec<Option<Error>>,
) -> Vec<Result<StepOutput>> {
    let tops_base = p.n_rows * OUT_WORDS;
    let mut res = Vec::with_capacity(pre.len());
    for (b, pre) in pre.into_iter().enumerate() {
        let deferred = match pre {
            Pre::Fail(e) => {
                res.push(Err(e));
                continue;
            }
            Pre::Run { deferred } => deferred,
        };
        let Some((r0, k)) = p.seqs[b] else {
            unreachable!("a sequence that runs is packed");
        };
        let row = |i: usize| &out[(r0 + i) * OUT_WORDS..(r0 + i + 1) * OUT_WORDS];
        let raw = (0..=k).find(|&i| row(i)[0] == ST_RAW_NON_FINITE);
        if let Some(i) = raw {
            let o = row(i);
            res.push(Err(Error::NonFiniteLogits {
                kind: RowKind::Target,
                row: i,
                token: o[1] as usize,
                value: f32::from_bits(o[2]),
            }));
            continue;
        }
        if let Some(e) = deferred.or_else(|| draft_errs.get_mut(b).and_then(Option::take)) {
            res.push(Err(e));
            continue;
        }
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
        for i in 0..=k {
            let o = row(i);
            match o[0] {
                ST_OK => {}
                ST_NO_TOKEN => {
                    err = Some(Error::NoAllowedToken {
                        kind: RowKind::Target,
                        row: i,
                    });
                    break;
                }
                _ => {
                    err = Some(Error::NonFiniteLogits {
                        kind: RowKind::Target,
                        row: i,
                        token: o[1] as usize,
                        value: f32::from_bits(o[2]),
                    });
                    break;
                }
            }
            // The draft, when row i has one and accepted it.
            let taken = drafts.get(i).copied().filter(|_| o[3] != 0);
            let accepted = taken.is_some();
            let (tok, lp) = match taken {
                Some(d) => (d, f32::from_bits(o[5])),
                None => (o[4], f32::from_bits(o[6])),
            };
            tokens.push(tok);
            if let Some(l) = lps.as_mut() {
                let n = (o[7] as usize).min(MAX_TOP_LOGPROBS);
                let base = tops_base + (r0 + i) * MAX_TOP_LOGPROBS * 2;
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
                path: (0..tokens.len() as u32 - 1).collect(),
                tokens,
                logprobs: lps,
                end,
                row_top: Default::default(),
            }),
        })
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::SiblingScheme;
    use crate::{SamplingConfig, SequenceParams};

    #[test]
    fn the_kernels_take_chains_and_refuse_trees() {
        let cfg = SamplingConfig::greedy();
        let seqs = [SequenceParams::new(&cfg, 0), SequenceParams::new(&cfg, 1)];
        let batch = DeviceBatch {
            vocab_size: 5,
            draft_tokens: &[1, 2, 3, 4],
            draft_offsets: &[0, 2, 4],
            draft_probs: DraftProbs::PointMass,
            sequences: &seqs,
            parents: None,
            schemes: None,
            ends: &[],
        };
        let unsupported = |b: DeviceBatch<'_>| {
            matches!(
                check_batch(&b),
                Err(Error::Unsupported { backend: "gpu", .. })
            )
        };
        assert_eq!(check_batch(&batch).unwrap(), 0);
        // Chains given as (local) parents, and the default scheme, are chains.
        let chain = DeviceBatch {
            parents: Some(&[0, 1, 0, 1]),
            schemes: Some(&[SiblingScheme::Deterministic; 4]),
            ends: &[false; 4],
            ..batch
        };
        assert!(check_batch(&chain).is_ok());
        assert!(unsupported(DeviceBatch {
            parents: Some(&[0, 1, 0, 0]),
            ..batch
        }));
        assert!(unsupported(DeviceBatch {
            ends: &[false, false, false, true],
            ..batch
        }));
        let dense = [0.2f32; 20];
        assert!(unsupported(DeviceBatch {
            draft_probs: DraftProbs::Probs {
                probs: &dense,
                vocab: 5
            },
            schemes: Some(&[SiblingScheme::Deterministic; 4]),
            ..batch
        }));
        assert!(matches!(
            check_batch(&DeviceBatch {
                parents: Some(&[0, 1]),
                ..batch
            }),
            Err(Error::ShapeMismatch { .. })
        ));
    }
}
