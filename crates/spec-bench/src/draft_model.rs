//! The `draft-model:FILE` proposer: any GGUF file as the draft model, on our fast forward
//! (`speculative_candle::FastTarget`), for any target; and the target's text side
//! ([`TargetText`]: chat template, tokenizer, EOS set and vocabulary bytes), which a target
//! with a SentencePiece vocabulary (Gemma 3 through `--backend llama`) takes from llama.cpp.
//!
//! Same tokenizer as the target (equal GGUF vocabularies, [`GgufVocab`]) -> a
//! [`DraftModelProposer`]; another tokenizer -> a [`CrossVocabProposer`] over the
//! [`VocabMap`] of the two vocabularies (special tokens paired only by role,
//! [`speculative::propose::SpecialRole`]): re-tokenising (SLEM) for greedy requests, TLI for
//! sampling ones ([`CrossVocabProposer::retokenizing`]), both lossless.

use std::sync::Arc;

use speculative::Proposer;
use speculative::propose::{
    BytesEncoder, CrossVocabProposer, DraftModelProposer, VocabMap, VocabPieces,
};
use speculative_candle::fast::{FastFormat, FastTarget, FastWeights};
use speculative_candle::{ChatMessage, GgufTokenizer, GgufVocab};

use crate::error::{BenchError, Result};

/// The text side of a target: prompts through its chat template and tokenizer, its EOS set,
/// and its vocabulary as bytes.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum TargetText {
    /// A byte-level BPE GGUF read by `speculative-candle` (SmolLM2): the file's chat template
    /// (minijinja) and EOS id.
    Gguf(Arc<GgufTokenizer>),
    /// llama.cpp's tokenizer and chat template (a Gemma file without a template gets Gemma's,
    /// see `speculative_llama::LlamaEngine::apply_chat_template`) and its end-of-generation ids
    /// (Gemma 3: `<eos>` and `<end_of_turn>`).
    #[cfg(feature = "llama")]
    Llama(speculative_llama::LlamaEngine),
}

#[cfg(feature = "llama")]
fn llama_err(e: speculative_llama::LlamaError) -> BenchError {
    BenchError::Decode(e.into())
}

impl TargetText {
    /// The text side of the target file `path` for `backend`: the GGUF tokenizer when the file
    /// has a byte-level BPE; otherwise, on the llama backend, llama.cpp's.
    ///
    /// # Errors
    /// The GGUF tokenizer's error when the file is not byte-level BPE and the backend is not
    /// `llama` (or spec-bench was built without the `llama` feature); llama.cpp's load error.
    pub fn load(path: &std::path::Path, backend: &str) -> Result<Self> {
        match GgufTokenizer::load(path) {
            Ok(t) => Ok(TargetText::Gguf(Arc::new(t))),
            #[cfg(feature = "llama")]
            Err(_) if backend == "llama" => {
                let opts = speculative_llama::ModelOptions::default();
                let e = speculative_llama::LlamaEngine::load(path, &opts).map_err(llama_err)?;
                Ok(TargetText::Llama(e))
            }
            Err(e) => {
                let _ = backend;
                Err(e.into())
            }
        }
    }

    /// The GGUF tokenizer, when the target has one (grammars need it).
    pub fn gguf(&self) -> Option<&GgufTokenizer> {
        match self {
            TargetText::Gguf(t) => Some(t),
            #[cfg(feature = "llama")]
            TargetText::Llama(_) => None,
        }
    }

    /// The prompt text of a conversation, ending with the assistant's opening.
    ///
    /// # Errors
    /// The chat template's errors.
    pub fn chat(&self, msgs: &[ChatMessage]) -> Result<String> {
        match self {
            TargetText::Gguf(t) => Ok(t.apply_chat_template(msgs)?),
            #[cfg(feature = "llama")]
            TargetText::Llama(e) => {
                let turns: Vec<_> = msgs
                    .iter()
                    .map(|m| speculative_llama::ChatTurn {
                        role: m.role.clone(),
                        content: m.content.clone(),
                    })
                    .collect();
                e.apply_chat_template(&turns, true).map_err(llama_err)
            }
        }
    }

    /// Token ids of a prompt (control tokens in the text parsed; llama.cpp adds the BOS the
    /// file asks for).
    ///
    /// # Errors
    /// The tokenizer's errors.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TargetText::Gguf(t) => Ok(t.encode(text)?),
            #[cfg(feature = "llama")]
            TargetText::Llama(e) => e.encode(text).map_err(llama_err),
        }
    }

    /// The text of `ids`, control tokens dropped when `skip_special`.
    ///
    /// # Errors
    /// An id outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match self {
            TargetText::Gguf(t) => Ok(t.decode(ids, skip_special)?),
            #[cfg(feature = "llama")]
            TargetText::Llama(e) => e.decode(ids, skip_special).map_err(llama_err),
        }
    }

    /// The stop tokens of a reply: the GGUF's EOS id; llama.cpp's end-of-generation ids.
    pub fn eos_ids(&self) -> Vec<u32> {
        match self {
            TargetText::Gguf(t) => vec![t.eos_id()],
            #[cfg(feature = "llama")]
            TargetText::Llama(e) => e.eog_ids().to_vec(),
        }
    }

    /// The vocabulary as bytes (the GGUF file's through [`GgufVocab`] for `path`; llama.cpp's
    /// own for the llama variant).
    ///
    /// # Errors
    /// [`GgufVocab::load`]'s errors.
    pub fn pieces(&self, path: &std::path::Path) -> Result<VocabPieces> {
        match self {
            TargetText::Gguf(_) => Ok(GgufVocab::load(path)?.into_pieces()),
            #[cfg(feature = "llama")]
            TargetText::Llama(e) => Ok(e.vocab_pieces()),
        }
    }

    /// The tokenizer as a [`BytesEncoder`].
    pub fn bytes_encoder(&self) -> Arc<dyn BytesEncoder> {
        match self {
            TargetText::Gguf(t) => Arc::new(t.bytes_encoder()),
            #[cfg(feature = "llama")]
            TargetText::Llama(e) => Arc::new(e.bytes_encoder()),
        }
    }
}

/// A loaded draft model for `draft-model:FILE`, shared by every proposer made from it.
pub struct DraftModel {
    weights: Arc<FastWeights>,
    threads: usize,
    pairing: Pairing,
    note: String,
}

enum Pairing {
    Same,
    Cross {
        map: Arc<VocabMap>,
        draft_enc: Arc<dyn BytesEncoder>,
        target_enc: Arc<dyn BytesEncoder>,
    },
}

impl DraftModel {
    /// Loads the draft GGUF `file` (Q8 weights on the fast forward, `threads` threads) and
    /// pairs it with the target: `target_pieces` (its vocabulary as bytes), `target_vocab` (its
    /// logits width) and `target_text` (its tokenizer, for the re-tokenising mode).
    ///
    /// # Errors
    /// The draft file's load errors; [`BenchError::Invalid`] when the two vocabularies share
    /// no token or the draft file's vocabulary is not byte-level BPE.
    pub fn load(
        file: &std::path::Path,
        threads: usize,
        target_pieces: &VocabPieces,
        target_vocab: usize,
        target_text: &TargetText,
    ) -> Result<Self> {
        let weights = FastWeights::load(file, FastFormat::Q8)?;
        let draft_vocab = GgufVocab::load(file)?;
        let same = draft_vocab.pieces() == target_pieces && draft_vocab.len() == target_vocab;
        let (pairing, note) = if same {
            let note = format!(
                "draft-model:{}: same tokenizer as the target -> DraftModelProposer (token-level drafts, verified as usual)",
                file.display()
            );
            (Pairing::Same, note)
        } else {
            let tok = GgufTokenizer::load(file)?;
            let map = VocabMap::from_pieces(draft_vocab.pieces(), target_pieces)
                .target_vocab_size(target_vocab)
                .build()
                .map_err(|e| BenchError::Invalid {
                    what: "draft-model",
                    reason: e.to_string(),
                })?;
            let note = format!(
                "draft-model:{}: another tokenizer ({} draft tokens, {} target tokens, intersection {}, special pairs {:?}) -> CrossVocabProposer: re-tokenising (SLEM) for greedy requests, TLI for sampling",
                file.display(),
                map.draft_vocab_size(),
                map.target_vocab_size(),
                map.intersection_len(),
                map.special_pairs()
            );
            let pairing = Pairing::Cross {
                map: Arc::new(map),
                draft_enc: Arc::new(tok.bytes_encoder()),
                target_enc: target_text.bytes_encoder(),
            };
            (pairing, note)
        };
        Ok(DraftModel {
            weights,
            threads,
            pairing,
            note,
        })
    }

    /// Which mode the proposer uses and why (printed in the report).
    pub fn note(&self) -> &str {
        &self.note
    }

    /// The vocabulary map, when the tokenizers differ.
    pub fn map(&self) -> Option<&Arc<VocabMap>> {
        match &self.pairing {
            Pairing::Same => None,
            Pairing::Cross { map, .. } => Some(map),
        }
    }

    /// A fresh proposer over a new draft model sharing the weights.
    ///
    /// # Errors
    /// [`CrossVocabProposer::retokenizing`]'s errors.
    pub fn proposer(&self) -> Result<Box<dyn Proposer + Send>> {
        let model = FastTarget::new(self.weights.clone()).with_threads(self.threads);
        Ok(match &self.pairing {
            Pairing::Same => Box::new(DraftModelProposer::new(model)),
            Pairing::Cross {
                map,
                draft_enc,
                target_enc,
            } => Box::new(CrossVocabProposer::retokenizing(
                model,
                map.clone(),
                draft_enc.clone(),
                target_enc.clone(),
            )?),
        })
    }
}
