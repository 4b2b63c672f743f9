//! A draft model with its own vocabulary (another tokenizer than the target's): TLI for any
//! request, and a re-tokenising greedy mode (SLEM / Universal Assisted Generation style).
//!
//! Sources: Timor et al., ICML 2025, "Accelerating LLM Inference with Lossless Speculative
//! Decoding Algorithms for Heterogeneous Vocabularies" (arXiv 2502.05202): TLI (token-level
//! intersection) and SLEM (string-level exact match); Hugging Face transformers' Universal
//! Assisted Generation for the look-behind window that keeps token boundaries right when text
//! is re-tokenised.

use std::sync::Arc;

use super::sampler::DraftSampler;
use super::vocab_map::VocabMap;
use super::{Draft, ProposeRequest, Proposer};
use crate::error::{Error, Result, RowKind};
use crate::model::TargetModel;

/// Encodes text (as bytes) into the token ids of one vocabulary: the caller's tokenizer, as
/// [`CrossVocabProposer`] needs it (the draft's tokenizer for the draft model's context, the
/// target's for the re-tokenising mode).
///
/// The contract, checked on every call: the returned ids are ordinary tokens (never a special
/// of the [`VocabMap`], no BOS added) whose pieces concatenate to exactly `bytes`. A byte-level
/// BPE (GPT-2, SmolLM2) can encode any bytes; a SentencePiece vocabulary needs byte fallback
/// (Gemma has it). `bytes` is a slice of the text, so it may start or end inside a UTF-8
/// character, and never holds a special token's text (specials are handled by the map).
/// The encoding should be the tokenizer's plain one, without normalisation that changes bytes
/// (SentencePiece's prefix space must not be added: the bytes are a continuation).
///
/// Closures `Fn(&[u8]) -> Result<Vec<u32>> + Send + Sync` implement it.
pub trait BytesEncoder: Send + Sync {
    /// The token ids of `bytes`.
    ///
    /// # Errors
    /// Implementation defined (wrap tokenizer errors in [`Error::Proposer`]).
    fn encode_bytes(&self, bytes: &[u8]) -> Result<Vec<u32>>;
}

impl<F> BytesEncoder for F
where
    F: Fn(&[u8]) -> Result<Vec<u32>> + Send + Sync,
{
    fn encode_bytes(&self, bytes: &[u8]) -> Result<Vec<u32>> {
        self(bytes)
    }
}

/// How [`CrossVocabProposer`] drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CrossVocabMode {
    /// Token-level intersection (TLI): the draft's row restricted to the shared tokens,
    /// processed with the request's configuration over target ids; q is handed to the
    /// verifier. Lossless for greedy and sampling requests.
    Tli,
    /// The draft's greedy text re-encoded with the target's tokenizer (SLEM): point-mass
    /// drafts, exact-match verification. Greedy requests only; sampling requests are served by
    /// [`CrossVocabMode::Tli`] (see [`CrossVocabProposer::last_mode`]).
    Retokenize,
}

/// How the target context is translated into the draft model's tokens (its context).
///
/// The translation is **prefix-stable**: after a step, the draft context of the new target
/// context keeps every draft token whose text lies before the first changed target token
/// (minus the look-behind), so the draft model's cache is truncated to the common prefix and
/// only the tail is recomputed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ContextSync {
    /// Each target token on its own: the shared tokens through the map
    /// ([`VocabMap::to_draft`], `O(1)`), the others by encoding their bytes alone with the
    /// draft tokenizer. Cheap and a pure function of the target tokens, but the draft model
    /// sees the target's token boundaries (`"ab"` becomes `"a" "b"` even where the draft
    /// tokenizer would write `"ab"` from the text), which it was not trained on.
    PerToken,
    /// The context's text re-encoded with the draft tokenizer, incrementally: at each step the
    /// text from `look_behind` draft tokens before the first changed byte to the end is encoded
    /// again, and the draft tokens before it are kept. The result equals the draft tokenizer's
    /// encoding of the whole text whenever the tokenizer is stable over that window (re-encoding
    /// a text from one of its own token boundaries reproduces the same tokens after it, once
    /// that boundary is `look_behind` tokens before any text that changed): true of a
    /// leftmost-longest tokenizer with `look_behind >=` its longest piece, and in practice of
    /// pre-tokenised BPE from a word boundary on. Costs one encode of the window plus the new
    /// text per step. `look_behind` 0 keeps every token before the change (the last one may
    /// then have the wrong boundary).
    Reencode {
        /// Draft tokens re-encoded before the first changed byte.
        look_behind: usize,
    },
}

/// Settings of [`CrossVocabProposer`].
///
/// | field | default | range |
/// |---|---|---|
/// | `sync` | `Reencode { look_behind: 8 }` | `look_behind <= 1024` |
/// | `target_look_behind` | 8 | `0 ..= 1024` |
/// | `extra_draft_tokens` | 1 | `0 ..= 64` |
///
/// `#[non_exhaustive]`: build it from [`CrossVocabConfig::default`] and the `with_` setters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CrossVocabConfig {
    /// How the target context becomes the draft model's context.
    pub sync: ContextSync,
    /// Re-tokenising mode: target tokens of context before the draft's text that are encoded
    /// with it (the look-behind window that lets the target tokenizer see where the context's
    /// last word started). Never reaches before a special token.
    pub target_look_behind: usize,
    /// Re-tokenising mode: draft tokens generated beyond `max_draft` (the last re-encoded
    /// target token is dropped unless the draft ended, since more text could still change it).
    pub extra_draft_tokens: usize,
}

impl Default for CrossVocabConfig {
    /// `Reencode { look_behind: 8 }`, 8, 1.
    fn default() -> Self {
        CrossVocabConfig {
            sync: ContextSync::Reencode { look_behind: 8 },
            target_look_behind: 8,
            extra_draft_tokens: 1,
        }
    }
}

impl CrossVocabConfig {
    /// Sets [`CrossVocabConfig::sync`] (checked by [`CrossVocabProposer::with_config`]).
    pub fn with_sync(mut self, sync: ContextSync) -> Self {
        self.sync = sync;
        self
    }

    /// Sets [`CrossVocabConfig::target_look_behind`] (checked by
    /// [`CrossVocabProposer::with_config`]).
    pub fn with_target_look_behind(mut self, tokens: usize) -> Self {
        self.target_look_behind = tokens;
        self
    }

    /// Sets [`CrossVocabConfig::extra_draft_tokens`] (checked by
    /// [`CrossVocabProposer::with_config`]).
    pub fn with_extra_draft_tokens(mut self, tokens: usize) -> Self {
        self.extra_draft_tokens = tokens;
        self
    }

    /// Checks every field against the table of [`CrossVocabConfig`]. `O(1)`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first offending field.
    pub fn validate(&self) -> Result<()> {
        if let ContextSync::Reencode { look_behind } = self.sync
            && look_behind > 1024
        {
            return Err(Error::config("look_behind", look_behind, "must be <= 1024"));
        }
        if self.target_look_behind > 1024 {
            return Err(Error::config(
                "target_look_behind",
                self.target_look_behind,
                "must be <= 1024",
            ));
        }
        if self.extra_draft_tokens > 64 {
            return Err(Error::config(
                "extra_draft_tokens",
                self.extra_draft_tokens,
                "must be <= 64",
            ));
        }
        Ok(())
    }
}

/// The concatenated bytes of `ids` must be `bytes`, every id an ordinary token with a piece.
fn check_encoding(
    map: &VocabMap,
    draft_side: bool,
    ids: &[u32],
    bytes: &[u8],
    ends: Option<(&mut Vec<u64>, u64)>,
) -> Result<()> {
    let what = if draft_side {
        "draft encoder output"
    } else {
        "target encoder output"
    };
    let vocab = if draft_side {
        map.draft_vocab_size()
    } else {
        map.target_vocab_size()
    };
    let mut at = 0usize;
    let mut ends = ends;
    for &t in ids {
        let (p, special) = if draft_side {
            (map.draft_bytes(t), map.is_draft_special(t))
        } else {
            (map.target_bytes(t), map.is_target_special(t))
        };
        let p = p.ok_or(Error::TokenOutOfVocab {
            what,
            token: t,
            vocab_size: vocab,
        })?;
        if special || bytes.get(at..at + p.len()) != Some(p) {
            return Err(Error::proposer(EncodingMismatch { what, token: t }));
        }
        at += p.len();
        if let Some((e, start)) = ends.as_mut() {
            e.push(*start + at as u64);
        }
    }
    if at != bytes.len() {
        return Err(Error::proposer(EncodingMismatch {
            what,
            token: u32::MAX,
        }));
    }
    Ok(())
}

/// A [`BytesEncoder`] broke its contract: its tokens' pieces do not spell the bytes it was
/// given (or it returned a special token).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[error(
    "{what}: the tokens do not spell the encoded bytes (at token {token}; u32::MAX: too short)"
)]
pub struct EncodingMismatch {
    /// Which encoder.
    pub what: &'static str,
    /// The first offending token (`u32::MAX`: the tokens spell a proper prefix).
    pub token: u32,
}

/// The draft translation of a target context (see [`ContextSync`]), kept incrementally.
///
/// Text positions are counted in a "stream" of bytes in which every ordinary target token adds
/// its bytes and every special target token one virtual byte (a hard break: no encoding ever
/// crosses it).
#[derive(Debug, Default, Clone)]
struct Translator {
    /// The target context translated.
    ctx: Vec<u32>,
    /// Stream offset after each target position.
    tend: Vec<u64>,
    /// The draft translation.
    dseq: Vec<u32>,
    /// Stream offset after each draft token.
    dend: Vec<u64>,
    /// After each special target token: (target position after it, draft length after its
    /// translation, stream offset after it).
    breaks: Vec<(usize, usize, u64)>,
    buf: Vec<u8>,
}

impl Translator {
    fn clear(&mut self) {
        self.ctx.clear();
        self.tend.clear();
        self.dseq.clear();
        self.dend.clear();
        self.breaks.clear();
    }

    fn tstart(&self, p: usize) -> u64 {
        if p == 0 { 0 } else { self.tend[p - 1] }
    }

    /// Brings the translation to `ctx` (a target context): keeps the common prefix, rolls the
    /// draft side back to where re-translation starts ([`Self::rollback`]), appends the target
    /// side of the new tokens ([`Self::extend_target`]) and translates from there
    /// ([`Self::translate`]).
    fn update(
        &mut self,
        ctx: &[u32],
        map: &VocabMap,
        enc: &dyn BytesEncoder,
        sync: ContextSync,
    ) -> Result<()> {
        let m = self.ctx.iter().zip(ctx).take_while(|(a, b)| a == b).count();
        if m == ctx.len() && m == self.ctx.len() {
            return Ok(());
        }
        self.ctx.truncate(m);
        self.tend.truncate(m);
        self.breaks.retain(|b| b.0 <= m);
        let (start, p, skip) = self.rollback(m, sync);
        self.extend_target(&ctx[m..], map)?;
        self.translate(ctx, (start, p, skip), map, enc, sync)
    }

    /// [`Self::update`]: drops the draft tokens from the point where translation restarts,
    /// given `m` kept target tokens: after the kept text (per token), or `look_behind` draft
    /// tokens earlier and never before the last special-token break (re-encoding). Returns
    /// the stream offset of the restart, its target position and the bytes of that target
    /// token already covered.
    fn rollback(&mut self, m: usize, sync: ContextSync) -> (u64, usize, usize) {
        let l = self.tstart(m);
        // Draft tokens whose text lies inside the kept target text.
        let inside = self.dend.partition_point(|&e| e <= l);
        let floor = self.breaks.last().copied();
        let (j, start, p, skip) = match sync {
            ContextSync::PerToken => (inside, l, m, 0),
            ContextSync::Reencode { look_behind } => {
                let j = inside.saturating_sub(look_behind);
                match floor {
                    Some((tp, dl, off)) if j <= dl => (dl, off, tp, 0),
                    _ if j == 0 => (0, 0, 0, 0),
                    _ => {
                        let s = self.dend[j - 1];
                        let p = self.tend.partition_point(|&e| e <= s);
                        (j, s, p, (s - self.tstart(p)) as usize)
                    }
                }
            }
        };
        self.dseq.truncate(j);
        self.dend.truncate(j);
        (start, p, skip)
    }

    /// [`Self::update`]: the target side of the new tokens `new` (their byte ends).
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`] for a token outside the target vocabulary.
    fn extend_target(&mut self, new: &[u32], map: &VocabMap) -> Result<()> {
        for &t in new {
            let len = if map.is_target_special(t) {
                1
            } else {
                map.target_bytes(t)
                    .ok_or(Error::TokenOutOfVocab {
                        what: "context token",
                        token: t,
                        vocab_size: map.target_vocab_size(),
                    })?
                    .len() as u64
            };
            let prev = self.tend.last().copied().unwrap_or(0);
            self.ctx.push(t);
            self.tend.push(prev + len);
        }
        Ok(())
    }

    /// [`Self::update`]: translates `ctx` from target position `p` (its first `skip` bytes are
    /// already covered; the stream restarts at offset `start`): special tokens map one to one
    /// and break the text; other tokens map one to one or are encoded (per token), or are
    /// re-encoded as runs of text (re-encoding).
    fn translate(
        &mut self,
        ctx: &[u32],
        (start, p, skip): (u64, usize, usize),
        map: &VocabMap,
        enc: &dyn BytesEncoder,
        sync: ContextSync,
    ) -> Result<()> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let mut buf_start = start;
        for (i, &t) in ctx.iter().enumerate().skip(p) {
            if map.is_target_special(t) {
                self.flush(&buf, buf_start, map, enc)?;
                buf.clear();
                if let Some(d) = map.to_draft(t) {
                    self.dseq.push(d);
                    self.dend.push(self.tend[i]);
                }
                self.breaks.push((i + 1, self.dseq.len(), self.tend[i]));
                buf_start = self.tend[i];
                continue;
            }
            let bytes = map.target_bytes(t).unwrap_or_default();
            let bytes = if i == p { &bytes[skip..] } else { bytes };
            match sync {
                ContextSync::PerToken => {
                    if let Some(d) = map.to_draft(t) {
                        self.dseq.push(d);
                        self.dend.push(self.tend[i]);
                    } else {
                        self.flush(bytes, self.tstart(i), map, enc)?;
                    }
                }
                ContextSync::Reencode { .. } => buf.extend_from_slice(bytes),
            }
        }
        self.flush(&buf, buf_start, map, enc)?;
        self.buf = buf;
        Ok(())
    }

    /// Encodes `bytes` (starting at stream offset `start`) and appends the draft tokens.
    fn flush(
        &mut self,
        bytes: &[u8],
        start: u64,
        map: &VocabMap,
        enc: &dyn BytesEncoder,
    ) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let ids = enc.encode_bytes(bytes)?;
        check_encoding(map, true, &ids, bytes, Some((&mut self.dend, start)))
            .inspect_err(|_| self.dend.truncate(self.dseq.len()))?;
        self.dseq.extend_from_slice(&ids);
        Ok(())
    }
}

/// A draft model with its own vocabulary, over any [`TargetModel`]: the draft model and the
/// target have different tokenizers, related by a [`VocabMap`].
///
/// # The draft model's context
///
/// The target context (target ids) is translated into draft ids with the draft tokenizer
/// ([`BytesEncoder`]) as [`CrossVocabConfig::sync`] says ([`ContextSync`]; by default the
/// context's text re-encoded from a look-behind window of 8 draft tokens, so token boundaries
/// are those the draft tokenizer writes). Special target tokens translate to their paired draft
/// special ([`crate::propose::VocabMapBuilder::pair_special`]) or to nothing, and no encoding
/// crosses them. [`CrossVocabProposer::draft_context`] is the translation of the last
/// proposal's context. Before each proposal the draft model is truncated to the longest common
/// prefix of the draft ids it holds and the new translation (at most its length minus one),
/// and the rest is fed (the first proposal of a generation prefills all but the last token):
/// after a rejection the draft tokens of the rejected text are dropped, the accepted text is
/// re-encoded and fed. A context whose translation is empty (only unpaired specials) gets no
/// draft.
///
/// # TLI (every request, and sampling requests in the re-tokenising mode)
///
/// Each draft row of the draft model (`[draft_vocab]` logits) is restricted to the
/// intersection and written over target ids ([`VocabMap::restrict_logits`]: `-inf` outside),
/// then processed with the request's [`crate::SamplingConfig`] exactly as the verifier processes
/// the target row at that position (penalties over the target context plus earlier drafts,
/// bias, masks and the `suppress` ids at rows `0..suppress_rows`, temperature, top-k, softmax,
/// top-p, min-p). The draft token is drawn from that distribution q (greedy requests: its
/// argmax, ties to the lowest target id; no q), with the uniform of
/// [`Stream`](crate::rng::Stream) at `(context.len() + i, lane::DRAFT)`, and q is handed to the
/// verifier as a dense row over the target vocabulary, `[k, target_vocab]` (zeros outside the
/// intersection, [`Draft::q_vocab`] = [`VocabMap::target_vocab_size`]). The drafted target
/// token's draft id ([`VocabMap::to_draft`]) is fed to the draft model for the next row. This is
/// Timor et al.'s TLI with one choice made explicit: the restriction comes before the request's
/// processing (the configuration is defined over target ids, and the softmax inside the
/// processing is the renormalisation over the intersection); with plain temperature sampling
/// it is exactly "restrict the draft's distribution and renormalise".
///
/// **Why it is lossless.** Speculative sampling (Leviathan et al. 2023, Theorem 1; Chen et al.
/// 2023) emits, at each position, a token distributed as the processed target row p for *any*
/// draft distribution q, as long as the draft token was drawn from q and q is what the verifier
/// is given: `P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) *
/// max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = p(x)`. Here q is a distribution over the
/// target vocabulary (it lives on the intersection, and 0 outside it is allowed: tokens outside
/// the intersection are emitted through the residual `max(0, p - q) = p` there), the token is
/// drawn from exactly q, and q depends only on the context and the draft's own uniforms (lane
/// `DRAFT`, which the verifier never reads), never on the target's draws. So the emitted
/// sequence has the target's law by induction over positions, whatever the draft model, the
/// map or the context translation are; a poor translation costs acceptance, never correctness.
/// The draft's cache stays consistent because its contents are a function of the accepted
/// target context only: before every proposal it is cut back to the common prefix with the
/// translation of the *current* context and caught up, so no rejected draft token survives.
///
/// # Re-tokenising greedy mode (SLEM, [`CrossVocabProposer::retokenizing`])
///
/// For greedy requests: the draft model decodes greedily in its own full vocabulary
/// (argmax of the raw draft logits, ties to the lowest id; the request's processing is over
/// target ids and is not applied to draft rows) up to `max_draft +`
/// [`CrossVocabConfig::extra_draft_tokens`] tokens, stopping at a draft special. Its text,
/// preceded by the text of up to [`CrossVocabConfig::target_look_behind`] last context tokens
/// (never before a special), is encoded with the target's tokenizer; when the encoding starts
/// with those context tokens, the tokens after them are the draft (the look-behind lets the
/// target tokenizer see where the context's last word started), otherwise the draft's text is
/// encoded on its own. The last token is dropped unless the draft ended at a special (more text
/// could still change it); a paired draft special then adds its target special. The draft is
/// cut to `max_draft`, after its first EOS, and before the first `suppress` id at rows
/// `0..suppress_rows`. Point masses (no q): the verifier's greedy path accepts exactly the
/// tokens equal to the target's argmax, so the output equals plain greedy decoding.
///
/// # Trees
///
/// Chains only: [`Proposer::propose_tree`] returns the chain. (TLI trees would fit the way
/// [`crate::propose::DraftModelProposer`] grows them, with each draft row restricted; the
/// re-tokenising mode has no per-token draft distribution to branch on.)
///
/// # State across requests
///
/// Every call compares the context with the one it translated (the longest common prefix) and
/// the draft model's sequence with the translation, so a context from another request keeps
/// only what is common; a draft model whose sequence length differs from what the proposer fed
/// is reset. The drafts then equal a fresh proposer's on the same context whenever the
/// translation does (always for [`ContextSync::PerToken`]; for [`ContextSync::Reencode`] when
/// the draft tokenizer is stable over the look-behind window).
///
/// `CrossVocabProposer<M>` is `Send` when `M` is `Send`, and `Sync` when `M` is `Sync`.
pub struct CrossVocabProposer<M> {
    model: M,
    map: Arc<VocabMap>,
    draft_enc: Arc<dyn BytesEncoder>,
    target_enc: Option<Arc<dyn BytesEncoder>>,
    cfg: CrossVocabConfig,
    tr: Translator,
    seen: Vec<u32>,
    sampler: DraftSampler,
    logits: Vec<f32>,
    row: Vec<f32>,
    last_mode: Option<CrossVocabMode>,
}

impl<M> std::fmt::Debug for CrossVocabProposer<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CrossVocabProposer")
            .field("retokenizing", &self.target_enc.is_some())
            .field("config", &self.cfg)
            .field("draft_context", &self.tr.dseq.len())
            .finish_non_exhaustive()
    }
}

/// Feeds `tokens` to `model`, keeps the last row of logits.
fn feed<M: TargetModel>(
    model: &mut M,
    seen: &mut Vec<u32>,
    logits: &mut Vec<f32>,
    tokens: &[u32],
) -> Result<()> {
    model.forward(tokens, logits)?;
    seen.extend_from_slice(tokens);
    let v = model.vocab_size();
    let n = logits.len();
    if n != tokens.len() * v || n < v {
        return Err(Error::ShapeMismatch {
            what: "draft model logits ([n, vocab])",
            expected: tokens.len() * v,
            actual: n,
        });
    }
    logits.drain(..n - v);
    Ok(())
}

impl<M: TargetModel> CrossVocabProposer<M> {
    /// A TLI proposer ([`CrossVocabMode::Tli`]): `model` drafts over the draft vocabulary of
    /// `map`, `draft_encoder` is the draft's tokenizer. Default [`CrossVocabConfig`].
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the model's [`TargetModel::vocab_size`] is below the
    /// map's draft pieces (every draft token needs a logit).
    pub fn tli(model: M, map: Arc<VocabMap>, draft_encoder: Arc<dyn BytesEncoder>) -> Result<Self> {
        if model.vocab_size() < map.draft_pieces() {
            return Err(Error::ShapeMismatch {
                what: "draft model vocab_size (at least the map's draft pieces)",
                expected: map.draft_pieces(),
                actual: model.vocab_size(),
            });
        }
        Ok(CrossVocabProposer {
            model,
            map,
            draft_enc: draft_encoder,
            target_enc: None,
            cfg: CrossVocabConfig::default(),
            tr: Translator::default(),
            seen: Vec::new(),
            sampler: DraftSampler::default(),
            logits: Vec::new(),
            row: Vec::new(),
            last_mode: None,
        })
    }

    /// A re-tokenising proposer ([`CrossVocabMode::Retokenize`]): greedy requests get the
    /// draft's greedy text re-encoded with `target_encoder` (the target's tokenizer); sampling
    /// requests get TLI.
    ///
    /// # Errors
    /// As [`CrossVocabProposer::tli`].
    pub fn retokenizing(
        model: M,
        map: Arc<VocabMap>,
        draft_encoder: Arc<dyn BytesEncoder>,
        target_encoder: Arc<dyn BytesEncoder>,
    ) -> Result<Self> {
        let mut p = Self::tli(model, map, draft_encoder)?;
        p.target_enc = Some(target_encoder);
        Ok(p)
    }

    /// Sets the configuration.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] as [`CrossVocabConfig::validate`].
    pub fn with_config(mut self, cfg: CrossVocabConfig) -> Result<Self> {
        cfg.validate()?;
        self.cfg = cfg;
        self.tr.clear();
        Ok(self)
    }

    /// The configuration.
    pub fn config(&self) -> CrossVocabConfig {
        self.cfg
    }

    /// The mode chosen at construction.
    pub fn mode(&self) -> CrossVocabMode {
        if self.target_enc.is_some() {
            CrossVocabMode::Retokenize
        } else {
            CrossVocabMode::Tli
        }
    }

    /// The mode the last proposal used (`None` before any draft was computed): in the
    /// re-tokenising mode, [`CrossVocabMode::Tli`] for a sampling request.
    pub fn last_mode(&self) -> Option<CrossVocabMode> {
        self.last_mode
    }

    /// The vocabulary map.
    pub fn map(&self) -> &Arc<VocabMap> {
        &self.map
    }

    /// The draft ids the last proposal's context translated to ([`ContextSync`]); the draft
    /// model's sequence starts with them (followed by the draft tokens it was fed).
    pub fn draft_context(&self) -> &[u32] {
        &self.tr.dseq
    }

    /// The wrapped model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// Gives back the wrapped model.
    pub fn into_inner(self) -> M {
        self.model
    }

    /// Translates `ctx` and brings the model to the translation; `false` when it is empty or
    /// does not fit the draft model's context.
    fn sync(&mut self, ctx: &[u32]) -> Result<bool> {
        self.tr
            .update(ctx, &self.map, &*self.draft_enc, self.cfg.sync)
            .inspect_err(|_| self.tr.clear())?;
        let d = &self.tr.dseq;
        if d.is_empty() || d.len() >= self.model.max_context() {
            return Ok(false);
        }
        let common = if self.model.seq_len() != self.seen.len() {
            0
        } else {
            self.seen.iter().zip(d).take_while(|(a, b)| a == b).count()
        }
        .min(d.len() - 1);
        self.model.truncate(common)?;
        self.seen.truncate(common);
        let last = d.len() - 1;
        if last > common {
            self.model.prefill(&d[common..last])?;
            self.seen.extend_from_slice(&d[common..last]);
        }
        feed(
            &mut self.model,
            &mut self.seen,
            &mut self.logits,
            &d[last..],
        )?;
        Ok(true)
    }

    fn propose_tli(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        let tv = self.map.target_vocab_size();
        let room = self.model.max_context().saturating_sub(self.seen.len());
        let k = req.max_draft.min(room + 1);
        let cfg = req.config;
        self.sampler.begin(req, tv)?;
        for i in 0..k {
            self.map.restrict_logits(&self.logits, &mut self.row);
            let t = match self.sampler.draw(cfg, req.seed, &self.row, i, draft) {
                Err(Error::NoAllowedToken { .. }) => break,
                r => r?,
            };
            if i + 1 == k || req.is_eos(t) {
                break;
            }
            // A token outside the intersection (only a caller's mask can make one drawable)
            // ends the draft: the draft model has no id for it.
            let Some(d) = self.map.to_draft(t) else {
                break;
            };
            feed(&mut self.model, &mut self.seen, &mut self.logits, &[d])?;
        }
        self.sampler.finish(cfg, tv, draft);
        Ok(())
    }

    fn propose_retokenized(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        let Some(enc) = self.target_enc.clone() else {
            return Ok(());
        };
        let map = self.map.clone();
        let room = self.model.max_context().saturating_sub(self.seen.len());
        let n = (req.max_draft + self.cfg.extra_draft_tokens).min(room + 1);
        let width = self.logits.len().min(map.draft_pieces());
        let mut text: Vec<u8> = Vec::new();
        let mut gen_bytes: Vec<u8> = Vec::new();
        let mut ended: Option<Option<u32>> = None;
        for i in 0..n {
            let mut best: Option<(u32, f32)> = None;
            for (v, &l) in self.logits[..width].iter().enumerate() {
                if l.is_nan() || l == f32::INFINITY {
                    return Err(Error::NonFiniteLogits {
                        kind: RowKind::Draft,
                        row: i,
                        token: v,
                        value: l,
                    });
                }
                if best.is_none_or(|(_, b)| l > b) {
                    best = Some((v as u32, l));
                }
            }
            let Some((d, l)) = best else { break };
            if l == f32::NEG_INFINITY {
                break;
            }
            if map.is_draft_special(d) {
                ended = Some(map.to_target(d));
                break;
            }
            gen_bytes.extend_from_slice(map.draft_bytes(d).unwrap_or_default());
            if i + 1 < n {
                feed(&mut self.model, &mut self.seen, &mut self.logits, &[d])?;
            }
        }
        // The look-behind window of context tokens (ordinary tokens after the last special).
        let ctx = req.context;
        let lo = ctx.len().saturating_sub(self.cfg.target_look_behind);
        let s = ctx[lo..]
            .iter()
            .rposition(|&t| map.is_target_special(t))
            .map_or(lo, |i| lo + i + 1);
        for &t in &ctx[s..] {
            text.extend_from_slice(map.target_bytes(t).unwrap_or_default());
        }
        text.extend_from_slice(&gen_bytes);
        let mut cand = Vec::new();
        if !gen_bytes.is_empty() {
            let ids = enc.encode_bytes(&text)?;
            check_encoding(&map, false, &ids, &text, None)?;
            if ids.starts_with(&ctx[s..]) {
                cand.extend_from_slice(&ids[ctx.len() - s..]);
            } else {
                let ids = enc.encode_bytes(&gen_bytes)?;
                check_encoding(&map, false, &ids, &gen_bytes, None)?;
                cand = ids;
            }
        }
        match ended {
            None => {
                cand.pop();
            }
            Some(Some(t)) => cand.push(t),
            Some(None) => {}
        }
        cand.truncate(req.max_draft);
        cand.truncate(req.draft_len_to_eos(&cand));
        if let Some(i) = cand
            .iter()
            .take(req.suppress_rows)
            .position(|t| req.suppress.contains(t))
        {
            cand.truncate(i);
        }
        draft.tokens = cand;
        Ok(())
    }
}

impl<M: TargetModel> Proposer for CrossVocabProposer<M> {
    /// `true`: it drafts from the context's tokens alone (it brings its own draft model to
    /// their translation at each proposal and never reads the target's hidden states), so the
    /// loops can feed a new prompt in the first step's verify forward (a fused prefill).
    fn drafts_from_tokens(&self) -> bool {
        true
    }

    fn begin(&mut self, _prompt: &[u32]) -> Result<()> {
        self.model.truncate(0)?;
        self.seen.clear();
        self.tr.clear();
        Ok(())
    }

    /// Proposes up to `req.max_draft` target tokens (fewer near the draft model's context
    /// limit, when a draft ends at EOS, or when no allowed shared token is left); see
    /// [`CrossVocabProposer`] for the two modes.
    ///
    /// # Errors
    /// Errors of the encoders ([`BytesEncoder`]; [`Error::Proposer`] with an
    /// [`EncodingMismatch`] when an encoder's tokens do not spell its input,
    /// [`Error::TokenOutOfVocab`] for an id outside the map); [`Error::TokenOutOfVocab`] for a
    /// context id outside the map's target vocabulary; errors of the draft model's `prefill`,
    /// `forward` and `truncate`; [`Error::ShapeMismatch`] when it returns logits that are not
    /// `[n, vocab]`; processing errors of the request's configuration (TLI) or
    /// [`Error::NonFiniteLogits`] (re-tokenising mode).
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        if req.max_draft == 0 || req.context.is_empty() {
            return Ok(());
        }
        if !self.sync(req.context)? {
            return Ok(());
        }
        if self.target_enc.is_some() && req.config.is_greedy() {
            self.last_mode = Some(CrossVocabMode::Retokenize);
            self.propose_retokenized(req, draft)
        } else {
            self.last_mode = Some(CrossVocabMode::Tli);
            self.propose_tli(req, draft)
        }
    }

    /// `"cross-vocab"`.
    fn name(&self) -> &'static str {
        "cross-vocab"
    }
}
