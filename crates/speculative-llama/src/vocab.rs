//! llama.cpp's vocabulary as bytes ([`LlamaEngine::vocab_pieces`]) and its tokenizer as a
//! [`BytesEncoder`] ([`LlamaBytesEncoder`]), for a draft model with another tokenizer than the
//! target's ([`speculative::propose::CrossVocabProposer`] over a [`speculative::propose::VocabMap`]
//! built with [`speculative::propose::VocabMap::from_pieces`]).

use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::token_type::LlamaTokenAttr;
use speculative::propose::{BytesEncoder, VocabPieces};

use crate::engine::LlamaEngine;
use crate::error::LlamaError;

impl LlamaEngine {
    /// Every token's bytes as llama.cpp writes them in text (`token_to_piece` without special
    /// rendering: SentencePiece's `▁` as a space and `<0xNN>` byte tokens as their byte,
    /// byte-level BPE through GPT-2's table, user-defined tokens as they are), and the special
    /// tokens: those whose llama.cpp attributes say control, unknown or unused (or none at all),
    /// with their text from the vocabulary (`<end_of_turn>`), and no bytes. `O(vocab)` calls
    /// into llama.cpp (about 0.1 s for Gemma 3's 262,144 tokens).
    pub fn vocab_pieces(&self) -> VocabPieces {
        let vocab = self.model().vocab();
        let mut pieces = Vec::with_capacity(self.vocab_size());
        let mut special = Vec::new();
        for id in 0..self.vocab_size() as u32 {
            let t = LlamaToken(id as i32);
            let attr = vocab.attr(t);
            let ordinary = attr.intersects(
                LlamaTokenAttr::Normal | LlamaTokenAttr::UserDefined | LlamaTokenAttr::Byte,
            ) && !attr.intersects(
                LlamaTokenAttr::Control | LlamaTokenAttr::Unknown | LlamaTokenAttr::Unused,
            );
            if ordinary {
                pieces.push(vocab.token_to_piece(t, false, None));
            } else {
                let text = vocab.text(t).map(|c| c.to_bytes().to_vec());
                special.push((id, text.unwrap_or_default()));
                pieces.push(Vec::new());
            }
        }
        VocabPieces::new(pieces, special)
    }

    /// llama.cpp's tokenizer as a [`BytesEncoder`] (see [`LlamaBytesEncoder`]). `O(vocab)`
    /// once (the single-byte tokens are looked up).
    pub fn bytes_encoder(&self) -> LlamaBytesEncoder {
        let pieces = self.vocab_pieces();
        let mut byte_ids = [None; 256];
        for (id, p) in pieces.pieces.iter().enumerate().rev() {
            if let [b] = p.as_slice() {
                byte_ids[*b as usize] = Some(id as u32);
            }
        }
        LlamaBytesEncoder {
            engine: self.clone(),
            byte_ids,
        }
    }
}

/// llama.cpp's tokenizer as a [`BytesEncoder`], made by [`LlamaEngine::bytes_encoder`]: the
/// target side of [`speculative::propose::CrossVocabProposer::retokenizing`] (or the draft side
/// when the draft runs on llama.cpp).
///
/// Encodes with `llama_tokenize` without BOS and without parsing control-token texts (they
/// are encoded as plain text; user-defined tokens such as Gemma's `\n\n` are matched as
/// llama.cpp always matches them). Bytes that are not valid UTF-8 (a slice of text that
/// starts or ends inside a character) are encoded one single-byte token per byte (Gemma's
/// `<0xNN>`, a byte-level BPE's byte tokens), the valid runs between them with the tokenizer.
/// A SentencePiece model whose metadata asks for a prefix space
/// (`tokenizer.ggml.add_space_prefix`) gets one from llama.cpp, which breaks the encoder's
/// contract: [`speculative::propose::CrossVocabProposer`] reports it as an
/// [`speculative::propose::EncodingMismatch`] (Gemma 3 sets it to false).
#[derive(Clone)]
pub struct LlamaBytesEncoder {
    engine: LlamaEngine,
    byte_ids: [Option<u32>; 256],
}

impl std::fmt::Debug for LlamaBytesEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaBytesEncoder")
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl BytesEncoder for LlamaBytesEncoder {
    /// # Errors
    /// [`speculative::Error::Model`] wrapping [`LlamaError::Text`] when llama.cpp returns an
    /// id outside the vocabulary, or a byte outside valid UTF-8 has no single-byte token.
    fn encode_bytes(&self, bytes: &[u8]) -> speculative::Result<Vec<u32>> {
        let vocab = self.engine.model().vocab();
        let n = self.engine.vocab_size();
        let mut out = Vec::with_capacity(bytes.len() / 3 + 1);
        for chunk in bytes.utf8_chunks() {
            if !chunk.valid().is_empty() {
                for t in vocab.tokenize(chunk.valid().as_bytes(), false, false) {
                    let id = u32::try_from(t.0)
                        .ok()
                        .filter(|&id| (id as usize) < n)
                        .ok_or_else(|| {
                            LlamaError::Text(format!("tokenizer returned id {}", t.0))
                        })?;
                    out.push(id);
                }
            }
            for &b in chunk.invalid() {
                let id = self.byte_ids[b as usize].ok_or_else(|| {
                    LlamaError::Text(format!("byte 0x{b:02X} has no single-byte token"))
                })?;
                out.push(id);
            }
        }
        Ok(out)
    }
}
