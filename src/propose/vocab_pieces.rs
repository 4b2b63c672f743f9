//! A vocabulary as an engine describes it ([`VocabPieces`]: every token's bytes, the special
//! tokens with their printed text), and the explicit pairing of special tokens by their role
//! ([`SpecialRole`]) for [`VocabMap::from_pieces`].

use super::vocab_map::{VocabMap, VocabMapBuilder};

/// One vocabulary, as an engine's tokenizer describes it: the input of
/// [`VocabMap::from_pieces`].
///
/// The adapters build it from their tokenizers (`speculative_candle::GgufVocab` from a GGUF
/// file's metadata, `speculative_llama::LlamaEngine::vocab_pieces` from llama.cpp's
/// `token_to_piece` and token attributes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VocabPieces {
    /// `pieces[id]`: the bytes token `id` stands for in text (`[vocab]`; need not be valid
    /// UTF-8: a byte-fallback token `<0xE2>` is the one byte `0xE2`). Empty for special tokens.
    pub pieces: Vec<Vec<u8>>,
    /// The special tokens (control, unknown and unused tokens: never matched by their bytes),
    /// ascending by id, each with its printed text (`<eos>`, `<|im_end|>`), which only
    /// [`SpecialRole::of`] reads.
    pub special: Vec<(u32, Vec<u8>)>,
}

impl VocabPieces {
    /// A vocabulary of `pieces` (`pieces[id]`) with the special tokens `special`
    /// (`(id, printed text)`, sorted here by id).
    pub fn new(pieces: Vec<Vec<u8>>, mut special: Vec<(u32, Vec<u8>)>) -> Self {
        special.sort_by_key(|s| s.0);
        VocabPieces { pieces, special }
    }

    /// Number of tokens (`pieces.len()`).
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// `true` when there is no token.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// `true` when `id` is one of [`VocabPieces::special`]. `O(log specials)`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.binary_search_by_key(&id, |s| s.0).is_ok()
    }

    /// The lowest special id of each role ([`SpecialRole::of`] of its text), in the order of
    /// [`SpecialRole::ALL`].
    pub fn roles(&self) -> Vec<(SpecialRole, u32)> {
        SpecialRole::ALL
            .iter()
            .filter_map(|&r| {
                self.special
                    .iter()
                    .find(|(_, text)| SpecialRole::of(text) == Some(r))
                    .map(|&(id, _)| (r, id))
            })
            .collect()
    }
}

/// What a special token means, for pairing the special tokens of two vocabularies: only
/// tokens whose printed text is in this fixed table are ever paired, and only with the other
/// vocabulary's token of the same role. Every other special token (`<pad>`, `<mask>`,
/// `<unused0>`, `<repo_name>`, image markers) has no counterpart: in a draft it ends the draft,
/// in a target context it is a hard break of the translation (see
/// [`crate::propose::CrossVocabProposer`]).
///
/// | role | texts |
/// |---|---|
/// | [`SpecialRole::Bos`] | `<s>`, `<bos>`, `<\|begin_of_text\|>`, `<\|startoftext\|>` |
/// | [`SpecialRole::Eos`] | `</s>`, `<eos>`, `<\|endoftext\|>`, `<\|end_of_text\|>` |
/// | [`SpecialRole::TurnStart`] | `<\|im_start\|>` (ChatML), `<start_of_turn>` (Gemma), `<\|start_header_id\|>` (Llama 3) |
/// | [`SpecialRole::TurnEnd`] | `<\|im_end\|>` (ChatML), `<end_of_turn>` (Gemma), `<\|eot_id\|>` (Llama 3), `<\|end\|>` (Phi-3) |
///
/// The table matches texts, not the files' `bos_token_id` / `eos_token_id`: SmolLM2's GGUF
/// names `<|im_start|>` its BOS and `<|im_end|>` its EOS, which are its turn markers; Gemma's
/// `<bos>` has no counterpart in SmolLM2, which adds no BOS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SpecialRole {
    /// Beginning of sequence.
    Bos,
    /// End of sequence (of a document).
    Eos,
    /// Start of a chat turn (followed by the role's name in the text).
    TurnStart,
    /// End of a chat turn.
    TurnEnd,
}

impl SpecialRole {
    /// Every role, in the order of [`VocabPieces::roles`].
    pub const ALL: [SpecialRole; 4] = [
        SpecialRole::Bos,
        SpecialRole::Eos,
        SpecialRole::TurnStart,
        SpecialRole::TurnEnd,
    ];

    /// The role of a special token's printed text, by the table of [`SpecialRole`]; `None`
    /// for any other text (exact match, no trimming).
    pub fn of(text: &[u8]) -> Option<SpecialRole> {
        Some(match text {
            b"<s>" | b"<bos>" | b"<|begin_of_text|>" | b"<|startoftext|>" => SpecialRole::Bos,
            b"</s>" | b"<eos>" | b"<|endoftext|>" | b"<|end_of_text|>" => SpecialRole::Eos,
            b"<|im_start|>" | b"<start_of_turn>" | b"<|start_header_id|>" => SpecialRole::TurnStart,
            b"<|im_end|>" | b"<end_of_turn>" | b"<|eot_id|>" | b"<|end|>" => SpecialRole::TurnEnd,
            _ => return None,
        })
    }
}

impl VocabMap {
    /// A builder with both vocabularies, their special tokens marked, and each
    /// [`SpecialRole`] present on both sides paired (the lowest id of the role on each side;
    /// see [`VocabPieces::roles`]). Set the vocabulary sizes (the models' logits widths) on the
    /// builder when they exceed the pieces, and add pairs with
    /// [`VocabMapBuilder::pair_special`]; [`VocabMapBuilder::build`] validates.
    /// `O(total bytes + specials)`.
    ///
    /// ```
    /// use speculative::propose::{VocabMap, VocabPieces};
    ///
    /// let piece = |s: &str| s.as_bytes().to_vec();
    /// // Draft (ChatML): <|endoftext|> <|im_start|> <|im_end|> "a" " b"
    /// let draft = VocabPieces::new(
    ///     vec![vec![], vec![], vec![], piece("a"), piece(" b")],
    ///     vec![(0, piece("<|endoftext|>")), (1, piece("<|im_start|>")), (2, piece("<|im_end|>"))],
    /// );
    /// // Target (Gemma-like): <pad> <eos> <bos> " b" "a" <start_of_turn> <end_of_turn>
    /// let target = VocabPieces::new(
    ///     vec![vec![], vec![], vec![], piece(" b"), piece("a"), vec![], vec![]],
    ///     vec![(0, piece("<pad>")), (1, piece("<eos>")), (2, piece("<bos>")),
    ///          (5, piece("<start_of_turn>")), (6, piece("<end_of_turn>"))],
    /// );
    /// let map = VocabMap::from_pieces(&draft, &target).build().unwrap();
    /// assert_eq!(map.to_target(3), Some(4)); // "a"
    /// assert_eq!(map.to_target(0), Some(1)); // EOS <-> EOS
    /// assert_eq!(map.to_target(2), Some(6)); // end of turn <-> end of turn
    /// assert_eq!(map.to_draft(2), None); // <bos>: no counterpart
    /// assert_eq!(map.intersection_len(), 5);
    /// ```
    pub fn from_pieces(draft: &VocabPieces, target: &VocabPieces) -> VocabMapBuilder {
        let mut b = VocabMap::builder()
            .draft_pieces(&draft.pieces)
            .target_pieces(&target.pieces)
            .draft_special(draft.special.iter().map(|s| s.0))
            .target_special(target.special.iter().map(|s| s.0));
        let theirs = target.roles();
        for (role, d) in draft.roles() {
            if let Some(&(_, t)) = theirs.iter().find(|(r, _)| *r == role) {
                b = b.pair_special(d, t);
            }
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_by_text_only() {
        assert_eq!(
            SpecialRole::of(b"<end_of_turn>"),
            Some(SpecialRole::TurnEnd)
        );
        assert_eq!(
            SpecialRole::of(b"<|im_start|>"),
            Some(SpecialRole::TurnStart)
        );
        assert_eq!(SpecialRole::of(b"<eos> "), None);
        assert_eq!(SpecialRole::of(b"<pad>"), None);
        let v = VocabPieces::new(
            vec![vec![]; 4],
            vec![
                (3, b"</s>".to_vec()),
                (1, b"<eos>".to_vec()),
                (2, b"<unused0>".to_vec()),
            ],
        );
        assert_eq!(v.special[0].0, 1, "sorted by id");
        assert!(v.is_special(3) && !v.is_special(0));
        // Two EOS texts: the lowest id is the role's token.
        assert_eq!(v.roles(), vec![(SpecialRole::Eos, 1)]);
        assert_eq!((v.len(), v.is_empty()), (4, false));
    }

    #[test]
    fn unpaired_specials_never_match_by_bytes() {
        // Both sides have a special whose printed text is "<pad>", and an ordinary "x".
        let d = VocabPieces::new(
            vec![b"<pad>".to_vec(), b"x".to_vec()],
            vec![(0, b"<pad>".to_vec())],
        );
        let t = VocabPieces::new(
            vec![b"x".to_vec(), b"<pad>".to_vec()],
            vec![(1, b"<pad>".to_vec())],
        );
        let m = VocabMap::from_pieces(&d, &t).build().unwrap();
        assert_eq!(m.to_target(0), None);
        assert_eq!(m.to_target(1), Some(0));
        assert!(m.special_pairs().is_empty());
    }
}
