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

use std::sync::Arc;

use super::DeviceBatch;
use crate::error::{Error, Result, RowKind};
use crate::sampling::{PenaltyScope, TokenMask};
use crate::verify::{DraftProbs, SequenceState, StepEnd, StepOutput, TokenLogprob, VerifyRequest};

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
    if batch.sequences.iter().any(|s| s.state.row_top_k > 0) {
        return Err(Error::Unsupported {
            backend: "gpu",
            what: "SequenceState::row_top_k (row candidates); the CPU Verifier verifies them",
        });
    }
    if !chains_only(batch) {
        return Err(Error::Unsupported {
            backend: "gpu",
            what: "token trees and ending drafts (parents other than a chain, sibling schemes other than the draft form's default, stop-cut chains or ending nodes); the CPU Verifier verifies them",
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
    batch.layout().request(
        batch.sequences,
        batch.draft_probs,
        (b, qv, batch.vocab_size),
        target,
    )
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
            let s = &batch.sequences[b].state;
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
    let main = pack(batch, qv, Pass::Main, &pre)?;
    let draft = match batch.draft_probs {
        DraftProbs::Logits { .. } => Some(pack(batch, qv, Pass::Draft, &pre)?),
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

/// Which pass a [`Packed`] launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// The target rows, `[k + 1, vocab]` per sequence.
    Main,
    /// The draft-logit rows (`DraftProbs::Logits`), `[k, qv]` per sequence, processed with each
    /// sequence's configuration and history into dense q (stochastic) or checked against their
    /// argmax (greedy).
    Draft,
}

/// Packs the sequences that `pre` lets run for `pass`: per sequence its patches, masks, rows and
/// sequence record, then the launch's parameter array and uniform block.
fn pack(batch: &DeviceBatch<'_>, qv: usize, pass: Pass, pre: &[Pre]) -> Result<Packed> {
    let v = batch.vocab_size;
    check_vocab_limit(v)?;
    let width = match pass {
        Pass::Main => v,
        Pass::Draft => qv,
    };
    let mut sec = Sections::new(batch.sequences.len(), width);
    let mut p = Packed::default();
    for (b, s) in batch.sequences.iter().enumerate() {
        let k = batch.draft_offsets[b + 1] - batch.draft_offsets[b];
        p.logprobs.push(s.state.config.logprobs());
        let Some(deferred) = runs_in(pass, &pre[b], k) else {
            p.seqs.push(None);
            continue;
        };
        let first_row = sec.n_rows;
        let row_map = (pass == Pass::Draft).then_some(&mut p.row_map);
        sec.push_sequence(batch, b, pass, deferred, row_map);
        p.seqs.push(Some((first_row, k)));
    }
    sec.finish(p, batch, qv, pass)
}

/// Refuses a vocabulary the kernels cannot index (token ids are 31-bit there).
fn check_vocab_limit(v: usize) -> Result<()> {
    if v >= (1 << 31) {
        return Err(Error::BatchTooLarge {
            backend: "gpu",
            what: "vocab_size",
            size: v as u64,
            limit: (1u64 << 31) - 1,
        });
    }
    Ok(())
}

/// Whether a sequence is packed in `pass`: `None` when not (the host rejected it, or in the
/// draft pass it has no draft or a deferred error), else `Some(deferred)`, `true` when it
/// carries a deferred error. Such a sequence runs only for the device's check of its raw target
/// rows: no draft pass, and the caller's mask is not called with its invalid context.
fn runs_in(pass: Pass, pre: &Pre, k: usize) -> Option<bool> {
    let deferred = match pre {
        Pre::Fail(_) => return None,
        Pre::Run { deferred } => deferred.is_some(),
    };
    match pass {
        Pass::Draft if k == 0 || deferred => None,
        _ => Some(deferred),
    }
}

/// The sections of one launch's parameter array while they are built, the running counts, and
/// the scratch of the caller-mask rows.
#[derive(Debug)]
struct Sections {
    /// Row width of the pass (`vocab`, or `qv` in the draft pass).
    width: usize,
    /// `ceil(width / 32)`: words per mask.
    mask_words: usize,
    /// Sequence records, [`SEQ_WORDS`] each.
    seq_recs: Vec<u32>,
    /// Row records, 8 words each.
    rows: Vec<u32>,
    /// Patches, 4 words each.
    patches: Vec<u32>,
    /// Mask words.
    masks: Vec<u32>,
    /// Rows packed so far.
    n_rows: usize,
    /// Scratch rows handed out so far.
    slots: usize,
    /// A zero row the caller's mask writes its bans into.
    zero_row: Vec<f32>,
    /// The caller mask's prefix: context plus the drafts before the row.
    prefix: Vec<u32>,
}

impl Sections {
    /// Empty sections for `n` sequences of rows `width` wide.
    fn new(n: usize, width: usize) -> Self {
        Sections {
            width,
            mask_words: width.div_ceil(32),
            seq_recs: Vec::with_capacity(n * SEQ_WORDS),
            rows: Vec::new(),
            patches: Vec::new(),
            masks: Vec::new(),
            n_rows: 0,
            slots: 0,
            zero_row: Vec::new(),
            prefix: Vec::new(),
        }
    }

    /// Packs sequence `b`: its patches, masks, rows (with their `(sequence, i)` in `row_map`,
    /// the draft pass's) and record. `deferred`: it carries a deferred error ([`runs_in`]).
    fn push_sequence(
        &mut self,
        batch: &DeviceBatch<'_>,
        b: usize,
        pass: Pass,
        deferred: bool,
        row_map: Option<&mut Vec<(usize, usize)>>,
    ) {
        let s = &batch.sequences[b].state;
        let lo = batch.draft_offsets[b];
        let drafts = &batch.draft_tokens[lo..batch.draft_offsets[b + 1]];
        let cfg = s.config;
        let caller_mask = cfg.mask().filter(|_| !deferred);
        let sidx = self.seq_recs.len() / SEQ_WORDS;
        let patch_off = self.patches.len() / 4;
        let merged = sequence_patches(s, drafts, self.width);
        for &(t, c, bias, has, seen) in &merged {
            let flags = has as u32 | (seen as u32) << 1;
            self.patches
                .extend_from_slice(&[t, c, bias.to_bits(), flags]);
        }
        let masks = SeqMasks::new(s, self.width, self.mask_words);
        let shared = match caller_mask {
            None => self.push_shared_masks(&masks),
            Some(_) => (NONE, NONE),
        };
        let seq = SeqRows {
            s,
            b,
            sidx,
            lo,
            drafts,
            caller_mask,
            masks: &masks,
            shared,
            patched: !merged.is_empty(),
        };
        self.push_rows(&seq, pass, row_map);
        let rec = sequence_record(s, patch_off, merged.len(), lo, drafts.len());
        self.seq_recs.extend_from_slice(&rec);
    }

    /// Writes the masks every row of a sequence without a caller's mask shares: the base mask
    /// (when the configuration has one) and the one with the suppressed tokens (when they apply
    /// at some row). Returns their word offsets `(base, suppressed)`, `NONE` for an absent one.
    fn push_shared_masks(&mut self, m: &SeqMasks) -> (u32, u32) {
        let (mut seq_mask, mut sup_mask) = (NONE, NONE);
        if m.has_base {
            seq_mask = self.masks.len() as u32;
            self.masks.extend_from_slice(&m.base);
        }
        if m.sup_rows > 0 {
            sup_mask = self.masks.len() as u32;
            self.masks.extend_from_slice(&m.with_sup);
        }
        (seq_mask, sup_mask)
    }

    /// Writes the row records of one sequence (rows `0..=k`, `0..k` in the draft pass), with a
    /// mask of its own for every row when the caller's mask applies, and a scratch slot for
    /// every row that is masked or patched.
    fn push_rows(
        &mut self,
        seq: &SeqRows<'_>,
        pass: Pass,
        mut row_map: Option<&mut Vec<(usize, usize)>>,
    ) {
        let k = seq.drafts.len();
        let pos0 = seq.s.position.unwrap_or(seq.s.context.len() as u64);
        let last_row = match pass {
            Pass::Main => k,
            Pass::Draft => k - 1,
        };
        for i in 0..=last_row {
            let sup = i < seq.masks.sup_rows;
            let mut row_mask = if sup { seq.shared.1 } else { seq.shared.0 };
            if let Some(m) = seq.caller_mask {
                let start = if sup {
                    &seq.masks.with_sup
                } else {
                    &seq.masks.base
                };
                row_mask = self.push_caller_mask(m, seq.s.context, &seq.drafts[..i], start);
            }
            let pos = pos0 + i as u64;
            let slot = if row_mask != NONE || seq.patched {
                self.slots += 1;
                (self.slots - 1) as u32
            } else {
                NONE
            };
            if let Some(map) = row_map.as_deref_mut() {
                map.push((seq.b, i));
            }
            let logits_row = match pass {
                Pass::Main => seq.lo + seq.b + i,
                Pass::Draft => seq.lo + i,
            };
            self.rows.extend_from_slice(&[
                seq.sidx as u32,
                i as u32,
                logits_row as u32,
                if i < k { seq.drafts[i] } else { NONE },
                pos as u32,
                (pos >> 32) as u32,
                row_mask,
                slot,
            ]);
            self.n_rows += 1;
        }
    }

    /// Writes one row's own mask: `start` (the sequence's base mask, with the suppressed tokens
    /// at a suppressed row) plus every token the caller's mask bans after `context` and
    /// `drafts`. Returns its word offset.
    fn push_caller_mask(
        &mut self,
        m: &Arc<dyn TokenMask>,
        context: &[u32],
        drafts: &[u32],
        start: &[u32],
    ) -> u32 {
        self.prefix.clear();
        self.prefix.extend_from_slice(context);
        self.prefix.extend_from_slice(drafts);
        self.zero_row.clear();
        self.zero_row.resize(self.width, 0.0);
        m.apply(&self.prefix, &mut self.zero_row);
        let offset = self.masks.len();
        self.masks.extend_from_slice(start);
        for (t, &z) in self.zero_row.iter().enumerate() {
            if z == f32::NEG_INFINITY {
                forbid(&mut self.masks[offset..], t as u32);
            }
        }
        offset as u32
    }

    /// Lays the sections out into `p.params` (sequence records, rows, patches, all draft
    /// tokens, masks), checks the launch's sizes against `u32` and fills the uniform block.
    fn finish(
        self,
        mut p: Packed,
        batch: &DeviceBatch<'_>,
        qv: usize,
        pass: Pass,
    ) -> Result<Packed> {
        let row_base = self.seq_recs.len();
        let patch_base = row_base + self.rows.len();
        let draft_base = patch_base + self.patches.len();
        let mask_base = draft_base + batch.draft_tokens.len();
        p.params = self.seq_recs;
        p.params.extend_from_slice(&self.rows);
        p.params.extend_from_slice(&self.patches);
        p.params.extend_from_slice(batch.draft_tokens);
        p.params.extend_from_slice(&self.masks);
        if p.params.is_empty() {
            p.params.push(0);
        }
        let (n_rows, width) = (self.n_rows, self.width);
        launch_size(n_rows.saturating_mul(width))?;
        launch_size(self.slots.saturating_mul(width))?;
        launch_size(p.params.len())?;
        p.dense_words = match pass {
            Pass::Main => 0,
            Pass::Draft => batch.draft_tokens.len() * qv,
        };
        launch_size(n_rows * OUT_WORDS + p.dense_words)?;
        p.globals = [
            width as u32,
            qv as u32,
            n_rows as u32,
            row_base as u32,
            patch_base as u32,
            draft_base as u32,
            mask_base as u32,
            self.mask_words as u32,
            MAX_TOP_LOGPROBS as u32,
            (n_rows * OUT_WORDS) as u32,
            0,
            !matches!(batch.draft_probs, DraftProbs::PointMass) as u32,
            0,
            (pass == Pass::Draft) as u32,
            0,
            0,
        ];
        p.n_rows = n_rows;
        p.scratch_rows = self.slots;
        Ok(p)
    }
}

/// `x` as a `u32` size of one launch, or [`Error::BatchTooLarge`].
fn launch_size(x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::BatchTooLarge {
        backend: "gpu",
        what: "logits elements of one launch",
        size: x as u64,
        limit: u32::MAX as u64,
    })
}

/// What [`Sections::push_rows`] needs to know of one sequence.
struct SeqRows<'s> {
    /// The sequence's parameters.
    s: &'s SequenceState<'s>,
    /// Its index in the batch.
    b: usize,
    /// Its index among the packed sequences (its record).
    sidx: usize,
    /// Offset of its first draft in the batch.
    lo: usize,
    /// Its drafts.
    drafts: &'s [u32],
    /// The caller's mask, when it is called for this sequence's rows.
    caller_mask: Option<&'s Arc<dyn TokenMask>>,
    /// Its masks before the caller's.
    masks: &'s SeqMasks,
    /// Word offsets of its shared masks `(base, suppressed)` ([`Sections::push_shared_masks`]).
    shared: (u32, u32),
    /// `true` when it has patches (every row then needs a scratch slot).
    patched: bool,
}

/// The merged patches of one sequence, by token: every token whose logit the penalties or the
/// bias may change. The repetition penalty counts prompt and generated tokens; frequency and
/// presence count generated tokens (context from `prompt_len` on, and the earlier drafts, which
/// the kernel adds) unless the scope is the whole context. Tokens beyond the row width (a
/// shorter draft vocabulary) are ignored, as on the CPU.
fn sequence_patches(s: &SequenceState<'_>, drafts: &[u32], width: usize) -> Vec<Patch> {
    let cfg = s.config;
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
    merged.retain(|e| (e.0 as usize) < width);
    merged
}

/// One sequence's masks before the caller's: the allowed / banned sets (`base`), and `base`
/// plus the suppressed tokens (`with_sup`), which apply at rows `0..sup_rows`.
#[derive(Debug)]
struct SeqMasks {
    /// `true` when the configuration restricts tokens (an allowed set or banned tokens).
    has_base: bool,
    /// The allowed / banned sets.
    base: Vec<u32>,
    /// `base` plus the suppressed tokens.
    with_sup: Vec<u32>,
    /// Rows at which `with_sup` applies: `suppress_rows`, or 0 when no suppressed token falls
    /// inside the row width.
    sup_rows: usize,
}

impl SeqMasks {
    /// The masks of `s` over rows `width` wide (`mask_words` words each).
    fn new(s: &SequenceState<'_>, width: usize, mask_words: usize) -> Self {
        let cfg = s.config;
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
        SeqMasks {
            has_base,
            base,
            with_sup,
            sup_rows,
        }
    }
}

/// The record of one sequence ([`SEQ_WORDS`] words; `S_*` in `kernels/verify.wgsl`): sampling
/// parameters, flags, seed, its patches and its drafts.
fn sequence_record(
    s: &SequenceState<'_>,
    patch_off: usize,
    n_patches: usize,
    lo: usize,
    k: usize,
) -> [u32; SEQ_WORDS] {
    let cfg = s.config;
    let flags = (cfg.is_greedy() as u32) | ((cfg.has_penalties() as u32) << 1);
    [
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
        n_patches as u32,
        lo as u32,
        k as u32,
        cfg.logprobs().map(|n| n as u32).unwrap_or(NONE),
        lo as u32,
    ]
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
        let rows = RowResults {
            out,
            r0,
            k,
            tops_base,
        };
        if let Some(e) = rows.raw_non_finite() {
            res.push(Err(e));
            continue;
        }
        if let Some(e) = deferred.or_else(|| draft_errs.get_mut(b).and_then(Option::take)) {
            res.push(Err(e));
            continue;
        }
        let drafts = &batch.draft_tokens[batch.draft_offsets[b]..batch.draft_offsets[b + 1]];
        res.push(rows.step(drafts, p.logprobs[b].is_some()));
    }
    res
}

/// The main pass's results for one packed sequence: rows `r0 ..= r0 + k` of `out` (each
/// [`OUT_WORDS`] words), and their top log-probabilities from word `tops_base` on.
struct RowResults<'o> {
    /// The main pass's output words.
    out: &'o [u32],
    /// The sequence's first row.
    r0: usize,
    /// The sequence's number of drafts.
    k: usize,
    /// Word offset of the top log-probabilities (`[rows, MAX_TOP_LOGPROBS]` pairs).
    tops_base: usize,
}

impl RowResults<'_> {
    /// The output words of the sequence's row `i`.
    fn row(&self, i: usize) -> &[u32] {
        let r = self.r0 + i;
        &self.out[r * OUT_WORDS..(r + 1) * OUT_WORDS]
    }

    /// The first raw target row (any, reached or not) with a NaN / `+inf`, as its error.
    fn raw_non_finite(&self) -> Option<Error> {
        let i = (0..=self.k).find(|&i| self.row(i)[0] == ST_RAW_NON_FINITE)?;
        let o = self.row(i);
        Some(Error::NonFiniteLogits {
            kind: RowKind::Target,
            row: i,
            token: o[1] as usize,
            value: f32::from_bits(o[2]),
        })
    }

    /// The step: the rows in order, each emitting its accepted draft or its own token, until
    /// the first that does not accept its draft (or fails). `logprobs`: the sequence asked for
    /// log-probabilities.
    fn step(&self, drafts: &[u32], logprobs: bool) -> Result<StepOutput> {
        let k = self.k;
        let mut tokens = Vec::with_capacity(k + 1);
        let mut lps = logprobs.then(|| Vec::with_capacity(k + 1));
        let mut end = if k == 0 {
            StepEnd::NoDraft
        } else {
            StepEnd::AllAccepted
        };
        for i in 0..=k {
            let o = self.row(i);
            if let Some(e) = row_error(o, i) {
                return Err(e);
            }
            // The draft, when row i has one and accepted it.
            let taken = drafts.get(i).copied().filter(|_| o[3] != 0);
            let (tok, lp) = match taken {
                Some(d) => (d, f32::from_bits(o[5])),
                None => (o[4], f32::from_bits(o[6])),
            };
            tokens.push(tok);
            if let Some(l) = lps.as_mut() {
                l.push(self.logprob(i, tok, lp));
            }
            if taken.is_none() {
                if i < k {
                    end = StepEnd::Rejected { index: i };
                }
                break;
            }
        }
        Ok(StepOutput {
            accepted: tokens.len() - 1,
            path: (0..tokens.len() as u32 - 1).collect(),
            tokens,
            logprobs: lps,
            end,
            row_top: Default::default(),
        })
    }

    /// Row `i`'s emitted token `token` with its log-probability `logprob` and the row's top
    /// entries.
    fn logprob(&self, i: usize, token: u32, logprob: f32) -> TokenLogprob {
        let n = (self.row(i)[7] as usize).min(MAX_TOP_LOGPROBS);
        let base = self.tops_base + (self.r0 + i) * MAX_TOP_LOGPROBS * 2;
        let out = self.out;
        let top = (0..n)
            .map(|j| (out[base + 2 * j], f32::from_bits(out[base + 2 * j + 1])))
            .collect();
        TokenLogprob {
            token,
            logprob,
            top,
        }
    }
}

/// The error of target row `i` from its status word (`o[0]`), `None` for [`ST_OK`].
fn row_error(o: &[u32], i: usize) -> Option<Error> {
    match o[0] {
        ST_OK => None,
        ST_NO_TOKEN => Some(Error::NoAllowedToken {
            kind: RowKind::Target,
            row: i,
        }),
        _ => Some(Error::NonFiniteLogits {
            kind: RowKind::Target,
            row: i,
            token: o[1] as usize,
            value: f32::from_bits(o[2]),
        }),
    }
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
