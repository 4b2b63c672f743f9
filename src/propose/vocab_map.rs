//! A map between two vocabularies built from their tokens' byte strings, for draft models with
//! another tokenizer than the target's ([`crate::propose::CrossVocabProposer`]).
//!
//! Every engine can say which bytes a token stands for (`token -> bytes`: a GGUF vocabulary
//! with its byte-level or SentencePiece decoding, a `tokenizers` vocabulary decoded one token
//! at a time). Two tokens of different vocabularies are the same token when their byte strings
//! are equal; the tokens of both vocabularies with equal byte strings are the **intersection**
//! (Timor et al., ICML 2025, "Accelerating LLM Inference with Lossless Speculative Decoding
//! Algorithms for Heterogeneous Vocabularies", arXiv 2502.05202, section 3: "token-level
//! intersection").
//!
//! Special (control) tokens are never matched by their text: `<|endoftext|>` in one
//! vocabulary and `</s>` in the other are both an end of sequence, and a control token's
//! printed form says nothing about what it means. They map only through the pairs the caller
//! names ([`VocabMapBuilder::pair_special`], for example the two EOS ids).

use std::collections::HashMap;

/// Which vocabulary an item belongs to, in [`VocabMapError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VocabSide {
    /// The draft model's vocabulary.
    Draft,
    /// The target model's vocabulary.
    Target,
}

impl std::fmt::Display for VocabSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VocabSide::Draft => "draft",
            VocabSide::Target => "target",
        })
    }
}

/// Why a [`VocabMap`] could not be built ([`VocabMapBuilder::build`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VocabMapError {
    /// A vocabulary has no token.
    #[error("the {side} vocabulary is empty")]
    EmptyVocabulary {
        /// Which vocabulary.
        side: VocabSide,
    },
    /// A vocabulary size set with [`VocabMapBuilder::draft_vocab_size`] or
    /// [`VocabMapBuilder::target_vocab_size`] is below the number of pieces given, or a
    /// vocabulary has `u32::MAX` tokens or more (ids must fit a `u32` below `u32::MAX`).
    #[error("the {side} vocabulary size {size} is invalid ({pieces} pieces given)")]
    InvalidVocabSize {
        /// Which vocabulary.
        side: VocabSide,
        /// The size asked for.
        size: usize,
        /// Number of pieces given.
        pieces: usize,
    },
    /// A special id (or one of a pair) is not below its vocabulary's size.
    #[error("special token id {id} is outside the {side} vocabulary of size {vocab}")]
    SpecialOutOfRange {
        /// Which vocabulary.
        side: VocabSide,
        /// The id.
        id: u32,
        /// The vocabulary's size.
        vocab: usize,
    },
    /// An id appears in two special pairs with different partners.
    #[error("{side} special token id {id} is paired twice")]
    ConflictingPair {
        /// Which vocabulary the id belongs to.
        side: VocabSide,
        /// The id.
        id: u32,
    },
    /// No ordinary token of one vocabulary has the byte string of an ordinary token of the
    /// other: a cross-vocabulary draft could only ever propose the paired special tokens.
    #[error("the two vocabularies share no ordinary token")]
    NoSharedTokens,
}

const NONE: u32 = u32::MAX;

/// One vocabulary: every piece's bytes, flat, and which ids are special.
#[derive(Debug, Clone, Default)]
struct Side {
    bytes: Vec<u8>,
    /// `offsets[i]..offsets[i + 1]` are piece `i`'s bytes (`[pieces + 1]`).
    offsets: Vec<usize>,
    special: Vec<bool>,
}

impl Side {
    fn vocab(&self) -> usize {
        self.special.len()
    }

    fn pieces(&self) -> usize {
        self.offsets.len() - 1
    }

    fn bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        if i + 1 < self.offsets.len() {
            Some(&self.bytes[self.offsets[i]..self.offsets[i + 1]])
        } else {
            None
        }
    }

    /// An id that may take part in the byte-string match: ordinary, with a non-empty piece.
    fn matchable(&self, id: u32) -> Option<&[u8]> {
        if self.special[id as usize] {
            return None;
        }
        self.bytes(id).filter(|b| !b.is_empty())
    }

    fn heap_bytes(&self) -> usize {
        self.bytes.capacity()
            + self.offsets.capacity() * std::mem::size_of::<usize>()
            + self.special.capacity()
    }
}

/// The map between a draft vocabulary and a target vocabulary.
///
/// Built by [`VocabMap::builder`] from each vocabulary's token byte strings (`pieces[id]`).
///
/// # Matching rules
///
/// - An **ordinary** draft token maps to the target token with exactly the same bytes, if
///   there is one. Tokens with an empty byte string, and ids above the pieces given (padding up
///   to [`VocabMapBuilder::draft_vocab_size`] / [`VocabMapBuilder::target_vocab_size`]), never
///   map.
/// - **Special** tokens never match by bytes; a draft special maps to a target special only
///   through [`VocabMapBuilder::pair_special`] (one to one).
/// - **Duplicate byte strings** inside one vocabulary (a SentencePiece byte-fallback token
///   `<0x61>` beside the piece `a`, say) are resolved by the lowest id: the lowest target id
///   holding a byte string is the one every draft token with those bytes maps to (the other
///   target ids holding it are outside the image: [`VocabMap::to_draft`] is `None` for them);
///   every draft id holding it maps there (several draft ids may map to one target id:
///   [`VocabMap::restrict_logits`] adds their probabilities), and [`VocabMap::to_draft`] of the
///   target id is the lowest of them.
///
/// # Cost
///
/// [`VocabMapBuilder::build`] hashes every ordinary target piece once and looks every ordinary
/// draft piece up: `O(total bytes of both vocabularies)` expected time, with a temporary hash
/// map of one entry per target token (a few MB for a 262,144-token vocabulary). The map keeps
/// both vocabularies' bytes (flat, plus one offset per token), one `u32` per token each way and
/// one flag per token: about `total bytes + 13 * (draft_vocab + target_vocab)` bytes on a
/// 64-bit machine, plus 8 bytes per mapped draft token ([`VocabMap::heap_bytes`] tells the
/// exact figure). Lookups are `O(1)`.
///
/// `VocabMap` is `Send + Sync`; share one between proposers with an `Arc`.
///
/// # Example
///
/// ```
/// use speculative::propose::VocabMap;
///
/// // Target: "a", "b", "ab", EOS (id 3). Draft: "b", "a", EOS (id 2).
/// let map = VocabMap::builder()
///     .target_pieces(["a", "b", "ab", "</s>"])
///     .draft_pieces(["b", "a", "<|end|>"])
///     .pair_special(2, 3)
///     .build()
///     .unwrap();
/// assert_eq!(map.to_target(0), Some(1));
/// assert_eq!(map.to_draft(2), None); // "ab" is not a draft token
/// assert_eq!(map.to_target(2), Some(3)); // the paired EOS
/// assert_eq!(map.intersection_len(), 3);
/// ```
#[derive(Debug, Clone)]
pub struct VocabMap {
    draft: Side,
    target: Side,
    /// Target id of each draft id (`NONE` outside the intersection), `[draft_vocab]`.
    d2t: Vec<u32>,
    /// Draft id of each target id (`NONE` outside the intersection), `[target_vocab]`.
    t2d: Vec<u32>,
    /// Every mapped draft id with its target id, in draft id order.
    pairs: Vec<(u32, u32)>,
    /// Number of target ids with a draft counterpart.
    shared: usize,
    /// The special pairs named by the caller.
    special_pairs: Vec<(u32, u32)>,
}

impl VocabMap {
    /// A builder with no vocabulary yet.
    pub fn builder() -> VocabMapBuilder {
        VocabMapBuilder::default()
    }

    /// Number of draft token ids (the pieces given, or the size set with
    /// [`VocabMapBuilder::draft_vocab_size`]).
    pub fn draft_vocab_size(&self) -> usize {
        self.draft.vocab()
    }

    /// Number of target token ids: the width of the q rows of
    /// [`crate::propose::CrossVocabProposer`] (`[k, target_vocab]`).
    pub fn target_vocab_size(&self) -> usize {
        self.target.vocab()
    }

    /// Number of target ids with a draft counterpart (ordinary tokens matched by bytes plus
    /// the paired specials): the support a TLI draft can reach.
    pub fn intersection_len(&self) -> usize {
        self.shared
    }

    /// Number of draft ids that map to a target id (at least [`VocabMap::intersection_len`]:
    /// draft duplicates map to one target id).
    pub fn mapped_draft_len(&self) -> usize {
        self.pairs.len()
    }

    /// The special pairs `(draft id, target id)` named with [`VocabMapBuilder::pair_special`].
    pub fn special_pairs(&self) -> &[(u32, u32)] {
        &self.special_pairs
    }

    /// Every mapped draft id with its target id, `(draft, target)`, in draft id order.
    pub fn pairs(&self) -> &[(u32, u32)] {
        &self.pairs
    }

    /// The target id of draft token `draft`, `None` outside the intersection or the vocabulary.
    pub fn to_target(&self, draft: u32) -> Option<u32> {
        self.d2t.get(draft as usize).copied().filter(|&t| t != NONE)
    }

    /// The draft id of target token `target` (the lowest draft id with its bytes, or its paired
    /// special), `None` outside the intersection or the vocabulary.
    pub fn to_draft(&self, target: u32) -> Option<u32> {
        self.t2d
            .get(target as usize)
            .copied()
            .filter(|&d| d != NONE)
    }

    /// The bytes of draft token `id`; `None` for an id without a piece (padding, or outside).
    pub fn draft_bytes(&self, id: u32) -> Option<&[u8]> {
        self.draft.bytes(id)
    }

    /// The bytes of target token `id`; `None` for an id without a piece (padding, or outside).
    pub fn target_bytes(&self, id: u32) -> Option<&[u8]> {
        self.target.bytes(id)
    }

    /// `true` when draft id `id` is special (marked, or paired); `false` outside the vocabulary.
    pub fn is_draft_special(&self, id: u32) -> bool {
        self.draft
            .special
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }

    /// `true` when target id `id` is special (marked, or paired); `false` outside the vocabulary.
    pub fn is_target_special(&self, id: u32) -> bool {
        self.target
            .special
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }

    /// Number of draft ids with a piece (the pieces given; ids above are padding).
    pub fn draft_pieces(&self) -> usize {
        self.draft.pieces()
    }

    /// Number of target ids with a piece (the pieces given; ids above are padding).
    pub fn target_pieces(&self) -> usize {
        self.target.pieces()
    }

    /// Heap memory held by the map, in bytes.
    pub fn heap_bytes(&self) -> usize {
        self.draft.heap_bytes()
            + self.target.heap_bytes()
            + (self.d2t.capacity() + self.t2d.capacity()) * 4
            + (self.pairs.capacity() + self.special_pairs.capacity()) * 8
    }

    /// TLI's restriction of one row of draft logits (`[draft_logits.len()]`, usually the draft
    /// model's width) to the intersection, written over target ids into `out` (cleared, then
    /// `[target_vocab]`): entry `t` is the draft logit of the draft token mapped to `t`
    /// (`ln(sum(exp))` of them when several draft ids map to `t`), `-inf` for every target id
    /// outside the intersection. Draft logits past `draft_logits.len()` count as `-inf`.
    /// A softmax of `out` is the draft's softmax restricted to the intersection and
    /// renormalised. `O(target_vocab + mapped draft ids)`.
    pub fn restrict_logits(&self, draft_logits: &[f32], out: &mut Vec<f32>) {
        out.clear();
        out.resize(self.target.vocab(), f32::NEG_INFINITY);
        for &(d, t) in &self.pairs {
            let Some(&l) = draft_logits.get(d as usize) else {
                break;
            };
            let o = &mut out[t as usize];
            *o = if l.is_nan() || l == f32::INFINITY || o.is_nan() {
                // Kept for the row processor to report (NaN and +inf are errors there).
                if o.is_nan() { *o } else { l }
            } else if *o == f32::NEG_INFINITY || l == f32::NEG_INFINITY {
                o.max(l)
            } else {
                let (hi, lo) = if *o >= l { (*o, l) } else { (l, *o) };
                hi + (lo - hi).exp().ln_1p()
            };
        }
    }
}

/// Builder of a [`VocabMap`] (see its matching rules).
///
/// Pieces are given in id order (`pieces[id]` is token `id`'s bytes, which need not be valid
/// UTF-8). Every setter may be called in any order; [`VocabMapBuilder::build`] validates.
#[derive(Debug, Clone, Default)]
pub struct VocabMapBuilder {
    draft: Vec<Vec<u8>>,
    target: Vec<Vec<u8>>,
    draft_size: Option<usize>,
    target_size: Option<usize>,
    draft_special: Vec<u32>,
    target_special: Vec<u32>,
    pairs: Vec<(u32, u32)>,
}

impl VocabMapBuilder {
    /// The draft vocabulary's pieces, `pieces[id]` the bytes of draft token `id`.
    pub fn draft_pieces<I, B>(mut self, pieces: I) -> Self
    where
        I: IntoIterator<Item = B>,
        B: AsRef<[u8]>,
    {
        self.draft = pieces.into_iter().map(|b| b.as_ref().to_vec()).collect();
        self
    }

    /// The target vocabulary's pieces, `pieces[id]` the bytes of target token `id`.
    pub fn target_pieces<I, B>(mut self, pieces: I) -> Self
    where
        I: IntoIterator<Item = B>,
        B: AsRef<[u8]>,
    {
        self.target = pieces.into_iter().map(|b| b.as_ref().to_vec()).collect();
        self
    }

    /// The draft vocabulary's size when it exceeds the pieces (the draft model's logits width,
    /// padded embedding rows): ids above the pieces never map. Default: the number of pieces.
    pub fn draft_vocab_size(mut self, size: usize) -> Self {
        self.draft_size = Some(size);
        self
    }

    /// The target vocabulary's size when it exceeds the pieces (set it to the target model's
    /// [`crate::TargetModel::vocab_size`], the width the verifier and the request's masks see).
    /// Default: the number of pieces.
    pub fn target_vocab_size(mut self, size: usize) -> Self {
        self.target_size = Some(size);
        self
    }

    /// Marks draft ids as special (control tokens: never matched by their bytes). Adds to the
    /// ids marked before.
    pub fn draft_special(mut self, ids: impl IntoIterator<Item = u32>) -> Self {
        self.draft_special.extend(ids);
        self
    }

    /// Marks target ids as special (control tokens: never matched by their bytes). Adds to the
    /// ids marked before.
    pub fn target_special(mut self, ids: impl IntoIterator<Item = u32>) -> Self {
        self.target_special.extend(ids);
        self
    }

    /// Says that draft special `draft` means target special `target` (for example the two EOS
    /// ids, or the chat templates' turn markers): both are marked special and map to each other.
    /// Naming the same pair twice is allowed.
    pub fn pair_special(mut self, draft: u32, target: u32) -> Self {
        self.pairs.push((draft, target));
        self
    }

    /// Builds the map. `O(total bytes)` expected time (see [`VocabMap`], "Cost").
    ///
    /// # Errors
    /// Checked in this order:
    /// - [`VocabMapError::EmptyVocabulary`]: no piece was given for a side (draft first);
    /// - [`VocabMapError::InvalidVocabSize`]: a size set below the pieces given, or of
    ///   `u32::MAX` tokens or more;
    /// - [`VocabMapError::SpecialOutOfRange`]: a special or paired id outside its vocabulary;
    /// - [`VocabMapError::ConflictingPair`]: an id paired with two different partners;
    /// - [`VocabMapError::NoSharedTokens`]: no ordinary token is in both vocabularies.
    pub fn build(self) -> Result<VocabMap, VocabMapError> {
        let (dv, tv) = self.check_sizes()?;
        self.check_ids(dv, tv)?;
        let mut d2t = vec![NONE; dv];
        let mut t2d = vec![NONE; tv];
        let special_pairs = self.pair_specials(&mut d2t, &mut t2d)?;
        let pd: Vec<u32> = special_pairs.iter().map(|p| p.0).collect();
        let pt: Vec<u32> = special_pairs.iter().map(|p| p.1).collect();
        let draft = Side::new(self.draft, dv, &self.draft_special, &pd);
        let target = Side::new(self.target, tv, &self.target_special, &pt);
        let ordinary = match_ordinary(&draft, &target, &mut d2t, &mut t2d);
        if ordinary == 0 {
            return Err(VocabMapError::NoSharedTokens);
        }
        let pairs: Vec<(u32, u32)> = d2t
            .iter()
            .enumerate()
            .filter(|&(_, &t)| t != NONE)
            .map(|(d, &t)| (d as u32, t))
            .collect();
        Ok(VocabMap {
            shared: ordinary + special_pairs.len(),
            draft,
            target,
            d2t,
            t2d,
            pairs,
            special_pairs,
        })
    }

    /// [`VocabMapBuilder::build`]: both sides have pieces, and their sizes (set, or the number
    /// of pieces) are at least the pieces and below `u32::MAX`. Returns `(draft, target)`.
    fn check_sizes(&self) -> Result<(usize, usize), VocabMapError> {
        for (side, pieces) in [
            (VocabSide::Draft, &self.draft),
            (VocabSide::Target, &self.target),
        ] {
            if pieces.is_empty() {
                return Err(VocabMapError::EmptyVocabulary { side });
            }
        }
        let size = |side, pieces: &[Vec<u8>], set: Option<usize>| {
            let size = set.unwrap_or(pieces.len());
            if size < pieces.len() || size >= NONE as usize {
                Err(VocabMapError::InvalidVocabSize {
                    side,
                    size,
                    pieces: pieces.len(),
                })
            } else {
                Ok(size)
            }
        };
        let dv = size(VocabSide::Draft, &self.draft, self.draft_size)?;
        let tv = size(VocabSide::Target, &self.target, self.target_size)?;
        Ok((dv, tv))
    }

    /// [`VocabMapBuilder::build`]: every special and paired id inside its vocabulary.
    fn check_ids(&self, dv: usize, tv: usize) -> Result<(), VocabMapError> {
        let check = |side, id: u32, vocab: usize| {
            if (id as usize) < vocab {
                Ok(())
            } else {
                Err(VocabMapError::SpecialOutOfRange { side, id, vocab })
            }
        };
        for &id in &self.draft_special {
            check(VocabSide::Draft, id, dv)?;
        }
        for &id in &self.target_special {
            check(VocabSide::Target, id, tv)?;
        }
        for &(d, t) in &self.pairs {
            check(VocabSide::Draft, d, dv)?;
            check(VocabSide::Target, t, tv)?;
        }
        Ok(())
    }

    /// [`VocabMapBuilder::build`]: the explicit pairs into both maps (a repeated pair once; an
    /// id paired with two partners is an error). Returns the distinct pairs, in order.
    fn pair_specials(
        &self,
        d2t: &mut [u32],
        t2d: &mut [u32],
    ) -> Result<Vec<(u32, u32)>, VocabMapError> {
        let mut special_pairs = Vec::new();
        for &(d, t) in &self.pairs {
            if special_pairs.contains(&(d, t)) {
                continue;
            }
            if d2t[d as usize] != NONE {
                return Err(VocabMapError::ConflictingPair {
                    side: VocabSide::Draft,
                    id: d,
                });
            }
            if t2d[t as usize] != NONE {
                return Err(VocabMapError::ConflictingPair {
                    side: VocabSide::Target,
                    id: t,
                });
            }
            d2t[d as usize] = t;
            t2d[t as usize] = d;
            special_pairs.push((d, t));
        }
        Ok(special_pairs)
    }
}

impl Side {
    /// One side's pieces concatenated with their offsets, and its special flags (`[vocab]`:
    /// the `special` ids and the `paired` ones).
    fn new(pieces: Vec<Vec<u8>>, vocab: usize, special: &[u32], paired: &[u32]) -> Self {
        let mut s = Side {
            bytes: Vec::with_capacity(pieces.iter().map(Vec::len).sum()),
            offsets: Vec::with_capacity(pieces.len() + 1),
            special: vec![false; vocab],
        };
        s.offsets.push(0);
        for p in &pieces {
            s.bytes.extend_from_slice(p);
            s.offsets.push(s.bytes.len());
        }
        for &id in special.iter().chain(paired) {
            s.special[id as usize] = true;
        }
        s
    }
}

/// [`VocabMapBuilder::build`]: maps every ordinary draft token to the lowest target id of the
/// same byte string (`d2t`), and each target id reached to its first draft id (`t2d`, where
/// not yet paired). Returns the number of target ids newly reached.
fn match_ordinary(draft: &Side, target: &Side, d2t: &mut [u32], t2d: &mut [u32]) -> usize {
    let mut index: HashMap<&[u8], u32> = HashMap::with_capacity(target.pieces());
    for id in 0..target.pieces() as u32 {
        if let Some(b) = target.matchable(id) {
            index.entry(b).or_insert(id);
        }
    }
    let mut ordinary = 0usize;
    for id in 0..draft.pieces() as u32 {
        let Some(&t) = draft.matchable(id).and_then(|b| index.get(b)) else {
            continue;
        };
        d2t[id as usize] = t;
        if t2d[t as usize] == NONE {
            t2d[t as usize] = id;
            ordinary += 1;
        }
    }
    ordinary
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> VocabMap {
        // Target: a b ab c <eos>(4) <pad>(5, special, bytes "a")
        // Draft: b a a(dup, 2) bc <end>(4) "" (5)
        VocabMap::builder()
            .target_pieces(["a", "b", "ab", "c", "</s>", "a"])
            .target_special([5])
            .draft_pieces(["b", "a", "a", "bc", "<end>", ""])
            .pair_special(4, 4)
            .build()
            .unwrap()
    }

    #[test]
    fn maps_by_bytes_with_lowest_id_duplicates_and_paired_specials() {
        let m = toy();
        assert_eq!(m.to_target(0), Some(1));
        assert_eq!(m.to_target(1), Some(0));
        assert_eq!(
            m.to_target(2),
            Some(0),
            "duplicate maps to the same target id"
        );
        assert_eq!(m.to_target(3), None);
        assert_eq!(m.to_target(4), Some(4));
        assert_eq!(m.to_target(5), None, "empty piece never maps");
        assert_eq!(m.to_draft(0), Some(1), "lowest draft id");
        assert_eq!(m.to_draft(2), None);
        assert_eq!(m.to_draft(5), None, "special never matches by bytes");
        assert_eq!(m.intersection_len(), 3);
        assert_eq!(m.mapped_draft_len(), 4);
        assert!(m.is_draft_special(4) && m.is_target_special(4) && m.is_target_special(5));
        assert!(!m.is_draft_special(99));
        assert_eq!(m.target_bytes(2), Some(&b"ab"[..]));
        assert_eq!(m.to_target(99), None);
        assert!(m.heap_bytes() > 0);
    }

    #[test]
    fn restrict_logits_adds_duplicates_and_bans_the_rest() {
        let m = toy();
        let mut out = Vec::new();
        m.restrict_logits(&[1.0, 0.0, 0.0, 5.0, -1.0, 9.0], &mut out);
        assert_eq!(out.len(), 6);
        assert!((out[0] - (2.0f32).ln()).abs() < 1e-6);
        assert_eq!(out[1], 1.0);
        assert_eq!(out[4], -1.0);
        for t in [2, 3, 5] {
            assert_eq!(out[t], f32::NEG_INFINITY);
        }
        // A shorter row: the rest counts as -inf.
        m.restrict_logits(&[1.0], &mut out);
        assert_eq!(out[1], 1.0);
        assert_eq!(out[0], f32::NEG_INFINITY);
    }

    #[test]
    fn errors_in_their_documented_order() {
        use VocabMapError as E;
        let b = || VocabMap::builder().target_pieces(["a"]).draft_pieces(["a"]);
        let empty: [&str; 0] = [];
        assert_eq!(
            VocabMap::builder()
                .target_pieces(["a"])
                .build()
                .unwrap_err(),
            E::EmptyVocabulary {
                side: VocabSide::Draft
            }
        );
        assert_eq!(
            VocabMap::builder()
                .draft_pieces(["a"])
                .target_pieces(empty)
                .build()
                .unwrap_err(),
            E::EmptyVocabulary {
                side: VocabSide::Target
            }
        );
        assert!(matches!(
            b().target_vocab_size(0).build(),
            Err(E::InvalidVocabSize { .. })
        ));
        assert!(matches!(
            b().draft_special([1]).build(),
            Err(E::SpecialOutOfRange { id: 1, .. })
        ));
        assert!(matches!(
            b().target_vocab_size(3)
                .pair_special(0, 1)
                .pair_special(0, 2)
                .build(),
            Err(E::ConflictingPair {
                side: VocabSide::Draft,
                id: 0
            })
        ));
        assert_eq!(
            VocabMap::builder()
                .target_pieces(["a"])
                .draft_pieces(["b"])
                .build()
                .unwrap_err(),
            E::NoSharedTokens
        );
        // The same pair twice is fine; padding ids never map.
        let m = b()
            .draft_vocab_size(4)
            .target_vocab_size(3)
            .pair_special(3, 2)
            .pair_special(3, 2)
            .build()
            .unwrap();
        assert_eq!(m.special_pairs(), &[(3, 2)]);
        assert_eq!((m.draft_vocab_size(), m.target_vocab_size()), (4, 3));
        assert_eq!(m.draft_bytes(3), None);
        assert_eq!(m.intersection_len(), 2);
        assert!(E::NoSharedTokens.to_string().contains("share no"));
    }
}
