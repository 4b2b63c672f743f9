//! Token -> bytes for a GGUF vocabulary ([`GgufVocab`]), for the vocabulary map of a draft model
//! with another tokenizer ([`speculative::propose::VocabMap::from_pieces`]), and the
//! [`speculative::propose::BytesEncoder`] of [`GgufTokenizer`] ([`GgufBytesEncoder`]).
//!
//! Read from the GGUF metadata keys `tokenizer.ggml.model`, `tokenizer.ggml.tokens` and
//! `tokenizer.ggml.token_type` (the token types are llama.cpp's: 1 normal, 2 unknown, 3 control,
//! 4 user-defined, 5 unused, 6 byte). The bytes of a token are what llama.cpp's `token_to_piece`
//! writes for it:
//!
//! | type | `gpt2` (byte-level BPE: SmolLM2, GPT-2, Llama 3) | `llama` (SentencePiece: Gemma, Llama 2) |
//! |---|---|---|
//! | normal | each char through GPT-2's byte-to-unicode table back to its byte | `▁` (U+2581) -> space, the rest as is |
//! | byte | as normal | `<0xNN>` -> the one byte `0xNN` |
//! | user-defined | the text as is | the text as is |
//! | control, unknown, unused (and any other type) | special: no bytes, never matched | special |

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file;
use speculative::propose::{BytesEncoder, VocabPieces};

use crate::error::{CandleError, Result};
use crate::gguf::{meta, open_gguf};
use crate::tokenizer::{GgufTokenizer, byte_level_decode_table, string_array};

/// How a GGUF vocabulary writes its tokens (`tokenizer.ggml.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgufVocabKind {
    /// `gpt2`: byte-level BPE, pieces written through GPT-2's byte-to-unicode table.
    ByteLevelBpe,
    /// `llama`: SentencePiece, `▁` for a space and `<0xNN>` byte-fallback tokens.
    SentencePiece,
}

const TYPE_NORMAL: i32 = 1;
const TYPE_USER_DEFINED: i32 = 4;
const TYPE_BYTE: i32 = 6;

/// A GGUF file's vocabulary as bytes: every token's piece and the special tokens (see the
/// module docs for the rules), the input of
/// [`speculative::propose::VocabMap::from_pieces`].
///
/// ```no_run
/// use speculative::propose::VocabMap;
/// use speculative_candle::{GgufVocab, default_model_path};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let draft = GgufVocab::load(default_model_path())?;
/// let target = GgufVocab::load("models/gemma-3-270m-q4_k_m.gguf")?;
/// let map = VocabMap::from_pieces(draft.pieces(), target.pieces()).build()?;
/// println!("{} shared tokens", map.intersection_len());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct GgufVocab {
    kind: GgufVocabKind,
    pieces: VocabPieces,
}

impl GgufVocab {
    /// Reads the vocabulary from a GGUF file's metadata (the tensors are not read).
    ///
    /// # Errors
    /// [`CandleError::ModelNotFound`] / [`CandleError::CorruptModel`] as for
    /// [`crate::LlamaWeights::load`]; see [`GgufVocab::from_gguf`] for the rest.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let (content, _) = open_gguf(path.as_ref())?;
        Self::from_gguf(&content)
    }

    /// Builds the vocabulary from parsed GGUF metadata.
    ///
    /// # Errors
    /// [`CandleError::Metadata`] for a missing or malformed key, or a model other than `gpt2`
    /// and `llama`; as [`GgufVocab::from_tokens`].
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let key = "tokenizer.ggml.model";
        let model = meta(content, key)?
            .to_string()
            .map_err(|e| CandleError::Metadata {
                key: key.into(),
                reason: e.to_string(),
            })?
            .clone();
        let tokens = string_array(content, "tokenizer.ggml.tokens")?;
        let types: Vec<i32> = match content.metadata.get("tokenizer.ggml.token_type") {
            None => vec![TYPE_NORMAL; tokens.len()],
            Some(v) => v
                .to_vec()
                .and_then(|a| a.iter().map(|x| x.to_i32()).collect())
                .map_err(|e| CandleError::Metadata {
                    key: "tokenizer.ggml.token_type".into(),
                    reason: e.to_string(),
                })?,
        };
        Self::from_tokens(&model, &tokens, &types)
    }

    /// Builds the vocabulary from the GGUF fields themselves: `model` (`tokenizer.ggml.model`),
    /// the token texts and their types (`[vocab]` each).
    ///
    /// # Errors
    /// [`CandleError::Metadata`] when `model` is neither `gpt2` nor `llama`, the two arrays
    /// differ in length, or a SentencePiece byte token is not written `<0xNN>`.
    pub fn from_tokens(model: &str, tokens: &[String], types: &[i32]) -> Result<Self> {
        let kind = match model {
            "gpt2" => GgufVocabKind::ByteLevelBpe,
            "llama" => GgufVocabKind::SentencePiece,
            other => {
                return Err(CandleError::Metadata {
                    key: "tokenizer.ggml.model".into(),
                    reason: format!("`{other}` is not supported (gpt2 or llama)"),
                });
            }
        };
        if types.len() != tokens.len() {
            return Err(CandleError::Metadata {
                key: "tokenizer.ggml.token_type".into(),
                reason: format!("{} entries for {} tokens", types.len(), tokens.len()),
            });
        }
        let table = byte_level_decode_table();
        let mut pieces = Vec::with_capacity(tokens.len());
        let mut special = Vec::new();
        for (id, (t, &ty)) in tokens.iter().zip(types).enumerate() {
            let piece = match (ty, kind) {
                (TYPE_USER_DEFINED, _) => t.as_bytes().to_vec(),
                (TYPE_NORMAL | TYPE_BYTE, GgufVocabKind::ByteLevelBpe) => {
                    let mut out = Vec::with_capacity(t.len());
                    for c in t.chars() {
                        match table.get(&c) {
                            Some(&b) => out.push(b),
                            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    out
                }
                (TYPE_NORMAL, GgufVocabKind::SentencePiece) => t.replace('\u{2581}', " ").into(),
                (TYPE_BYTE, GgufVocabKind::SentencePiece) => vec![byte_token(t)?],
                _ => {
                    special.push((id as u32, t.as_bytes().to_vec()));
                    Vec::new()
                }
            };
            pieces.push(piece);
        }
        Ok(GgufVocab {
            kind,
            pieces: VocabPieces::new(pieces, special),
        })
    }

    /// How the file writes its tokens.
    pub fn kind(&self) -> GgufVocabKind {
        self.kind
    }

    /// Every token's bytes and the special tokens.
    pub fn pieces(&self) -> &VocabPieces {
        &self.pieces
    }

    /// Gives back the pieces.
    pub fn into_pieces(self) -> VocabPieces {
        self.pieces
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// `true` for a vocabulary without tokens.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }
}

/// The byte of a SentencePiece byte-fallback token `<0xNN>`.
fn byte_token(t: &str) -> Result<u8> {
    t.strip_prefix("<0x")
        .and_then(|s| s.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        .and_then(|h| u8::from_str_radix(h, 16).ok())
        .ok_or_else(|| CandleError::Metadata {
            key: "tokenizer.ggml.tokens".into(),
            reason: format!("byte token `{t}` is not written <0xNN>"),
        })
}

/// [`GgufTokenizer`] as a [`BytesEncoder`] (the tokenizers crate's byte-level BPE), for
/// [`speculative::propose::CrossVocabProposer`]: made by [`GgufTokenizer::bytes_encoder`].
///
/// Control-token texts in the bytes are encoded as plain text (never as the control token:
/// the encoder's output must be ordinary tokens). Bytes that are not valid UTF-8 (a slice of
/// text that starts or ends inside a character) are encoded one byte-level token per byte;
/// the valid runs between them with the tokenizer. No BOS is added. `O(bytes)` plus the
/// tokenizer's own cost.
#[derive(Clone)]
pub struct GgufBytesEncoder {
    tokenizer: tokenizers::Tokenizer,
    byte_ids: Arc<[Option<u32>; 256]>,
}

impl std::fmt::Debug for GgufBytesEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufBytesEncoder").finish_non_exhaustive()
    }
}

impl GgufTokenizer {
    /// This tokenizer as a [`BytesEncoder`] (see [`GgufBytesEncoder`]). `O(vocab)` once.
    pub fn bytes_encoder(&self) -> GgufBytesEncoder {
        let mut tokenizer = self.tokenizer().clone();
        tokenizer.set_encode_special_tokens(true);
        let mut byte_ids = [None; 256];
        for id in (0..self.vocab_size() as u32).rev() {
            if let Some(&[b]) = self.token_bytes(id)
                && !self.is_special(id)
            {
                byte_ids[b as usize] = Some(id);
            }
        }
        GgufBytesEncoder {
            tokenizer,
            byte_ids: Arc::new(byte_ids),
        }
    }
}

impl BytesEncoder for GgufBytesEncoder {
    /// # Errors
    /// [`speculative::Error::Proposer`] wrapping [`CandleError::Tokenizer`] when the tokenizer
    /// fails or a byte outside valid UTF-8 has no single-byte token.
    fn encode_bytes(&self, bytes: &[u8]) -> speculative::Result<Vec<u32>> {
        let fail = |e: String| speculative::Error::proposer(CandleError::Tokenizer(e));
        let mut out = Vec::with_capacity(bytes.len() / 3 + 1);
        for chunk in bytes.utf8_chunks() {
            if !chunk.valid().is_empty() {
                let enc = self
                    .tokenizer
                    .encode(chunk.valid(), false)
                    .map_err(|e| fail(e.to_string()))?;
                out.extend_from_slice(enc.get_ids());
            }
            for &b in chunk.invalid() {
                out.push(
                    self.byte_ids[b as usize]
                        .ok_or_else(|| fail(format!("byte 0x{b:02X} has no single-byte token")))?,
                );
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|t| t.to_string()).collect()
    }

    #[test]
    fn sentencepiece_pieces_spaces_bytes_and_specials() {
        let tokens = s(&[
            "<pad>",
            "<eos>",
            "<bos>",
            "▁the",
            "cat",
            "<0x0A>",
            "<0xE2>",
            "\n\n",
            "▁▁",
            "<unused0>",
        ]);
        let types = [3, 3, 3, 1, 1, 6, 6, 4, 1, 5];
        let v = GgufVocab::from_tokens("llama", &tokens, &types).unwrap();
        assert_eq!(v.kind(), GgufVocabKind::SentencePiece);
        let p = v.pieces();
        assert_eq!(p.pieces[3], b" the");
        assert_eq!(p.pieces[4], b"cat");
        assert_eq!(p.pieces[5], b"\n");
        assert_eq!(p.pieces[6], [0xE2]);
        assert_eq!(p.pieces[7], b"\n\n");
        assert_eq!(p.pieces[8], b"  ");
        let ids: Vec<u32> = p.special.iter().map(|s| s.0).collect();
        assert_eq!(ids, [0, 1, 2, 9]);
        assert!(p.pieces[1].is_empty());
        assert_eq!(p.special[1].1, b"<eos>");
        assert!(GgufVocab::from_tokens("llama", &s(&["<0xZZ>"]), &[6]).is_err());
        assert!(GgufVocab::from_tokens("llama", &s(&["<0x0A"]), &[6]).is_err());
        assert!(GgufVocab::from_tokens("bert", &s(&["a"]), &[1]).is_err());
        assert!(GgufVocab::from_tokens("llama", &s(&["a"]), &[]).is_err());
    }

    #[test]
    fn byte_level_pieces_through_the_gpt2_table() {
        // "Ġ" is the space, "Ċ" the newline, "Ã©" the two bytes of "é".
        let tokens = s(&["<|endoftext|>", "Ġthe", "Ċ", "Ã©", "<x>"]);
        let v = GgufVocab::from_tokens("gpt2", &tokens, &[3, 1, 1, 1, 4]).unwrap();
        assert_eq!(v.kind(), GgufVocabKind::ByteLevelBpe);
        let p = v.pieces();
        assert_eq!(p.pieces[1], b" the");
        assert_eq!(p.pieces[2], b"\n");
        assert_eq!(p.pieces[3], "é".as_bytes());
        assert_eq!(p.pieces[4], b"<x>");
        assert_eq!(p.special, vec![(0, b"<|endoftext|>".to_vec())]);
        assert_eq!((v.len(), v.is_empty()), (5, false));
    }
}
