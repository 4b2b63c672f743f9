//! The tokenizer, chat template and streaming detokenizer stored in a GGUF file.
//!
//! Built from the GGUF metadata keys `tokenizer.ggml.tokens`, `tokenizer.ggml.merges`,
//! `tokenizer.ggml.token_type`, `tokenizer.ggml.eos_token_id` and `tokenizer.chat_template`:
//! a GPT-2 style byte-level BPE (pre-tokenizer: individual digits, then the byte-level regex
//! split without a prefix space; byte-level decoder) with the control tokens
//! (`token_type == 3`) added as special tokens. No BOS token is added.
//!
//! [`GgufTokenizer`] and [`GgufDetokenizer`] implement [`speculative::decode::Detokenizer`], the
//! hook the decoding loop uses to match stop strings across token boundaries and to stream text.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use speculative::decode::Detokenizer;

use candle_core::quantized::gguf_file::{self, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{CandleError, Result};
use crate::gguf::{meta, open_gguf};

/// GGUF `token_type` of control tokens (`<|im_start|>`, `<|endoftext|>`, ...).
const TOKEN_TYPE_CONTROL: i32 = 3;

/// One chat message for [`GgufTokenizer::apply_chat_template`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"` or `"assistant"`.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `"system"` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `"user"` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `"assistant"` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// The tokenizer of a GGUF file (byte-level BPE), its eos id and chat template.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    tokenizer: Tokenizer,
    /// Raw bytes of every token (control tokens: their UTF-8 text).
    token_bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    eos_id: u32,
    bos_token: Option<String>,
    chat_template: Option<String>,
}

/// GPT-2's reversible byte <-> printable char table: char -> byte.
pub(crate) fn byte_level_decode_table() -> HashMap<char, u8> {
    let mut table = HashMap::with_capacity(256);
    let mut extra = 0u32;
    for b in 0u32..=255 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            extra += 1;
            255 + extra
        };
        if let Some(c) = char::from_u32(c) {
            table.insert(c, b as u8);
        }
    }
    table
}

pub(crate) fn string_array(content: &gguf_file::Content, key: &str) -> Result<Vec<String>> {
    let bad = |reason: String| CandleError::Metadata {
        key: key.into(),
        reason,
    };
    let arr = meta(content, key)?
        .to_vec()
        .map_err(|e| bad(e.to_string()))?;
    arr.iter()
        .map(|v| v.to_string().cloned().map_err(|e| bad(e.to_string())))
        .collect()
}

fn token_id(content: &gguf_file::Content, key: &str) -> Result<Option<u32>> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::U32(x)) => Ok(Some(*x)),
        Some(Value::I32(x)) if *x >= 0 => Ok(Some(*x as u32)),
        Some(Value::U64(x)) if *x <= u64::from(u32::MAX) => Ok(Some(*x as u32)),
        Some(v) => Err(CandleError::Metadata {
            key: key.into(),
            reason: format!("not a token id: {v:?}"),
        }),
    }
}

/// Checks `tokenizer.ggml.model` (when present) is `gpt2`, byte-level BPE.
fn check_model(content: &gguf_file::Content) -> Result<()> {
    if let Some(v) = content.metadata.get("tokenizer.ggml.model") {
        let model = v.to_string().map_err(|e| CandleError::Metadata {
            key: "tokenizer.ggml.model".into(),
            reason: e.to_string(),
        })?;
        if model != "gpt2" {
            return Err(CandleError::Metadata {
                key: "tokenizer.ggml.model".into(),
                reason: format!("`{model}` is not supported (only byte-level BPE `gpt2`)"),
            });
        }
    }
    Ok(())
}

/// `tokenizer.ggml.token_type`, one entry per token (all normal, `1`, when absent).
fn token_types(content: &gguf_file::Content, n_tokens: usize) -> Result<Vec<i32>> {
    let types: Vec<i32> = match content.metadata.get("tokenizer.ggml.token_type") {
        None => vec![1; n_tokens],
        Some(v) => v
            .to_vec()
            .and_then(|a| a.iter().map(|x| x.to_i32()).collect())
            .map_err(|e| CandleError::Metadata {
                key: "tokenizer.ggml.token_type".into(),
                reason: e.to_string(),
            })?,
    };
    if types.len() != n_tokens {
        return Err(CandleError::Metadata {
            key: "tokenizer.ggml.token_type".into(),
            reason: format!("{} entries for {n_tokens} tokens", types.len()),
        });
    }
    Ok(types)
}

/// The byte-level BPE tokenizer of `tokens` and `merges` (`"a b"` each), with the GPT-2
/// pre-tokenizer (digits split, byte level) and the `special` tokens as added special tokens.
fn bpe_tokenizer(tokens: &[String], merges: &[String], special: &[bool]) -> Result<Tokenizer> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| CandleError::Metadata {
                    key: "tokenizer.ggml.merges".into(),
                    reason: format!("merge `{m}` has no space"),
                })
        })
        .collect::<Result<_>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| CandleError::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let pre = Sequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ]);
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(special)
        .filter(|&(_, &s)| s)
        .map(|(t, _)| AddedToken::from(t.clone(), true))
        .collect();
    tokenizer
        .add_special_tokens(added)
        .map_err(|e| CandleError::Tokenizer(e.to_string()))?;
    Ok(tokenizer)
}

/// The bytes of each token: a special token's text as it is, a normal token's byte-level
/// characters mapped back to bytes (a character outside the table as its UTF-8).
fn byte_strings(tokens: &[String], special: &[bool]) -> Vec<Vec<u8>> {
    let table = byte_level_decode_table();
    tokens
        .iter()
        .zip(special)
        .map(|(t, &s)| {
            if s {
                return t.as_bytes().to_vec();
            }
            let mut out = Vec::with_capacity(t.len());
            for c in t.chars() {
                match table.get(&c) {
                    Some(&b) => out.push(b),
                    None => {
                        let mut buf = [0u8; 4];
                        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                }
            }
            out
        })
        .collect()
}

impl GgufTokenizer {
    /// Reads the tokenizer from the metadata of a GGUF file (the tensors are not read).
    ///
    /// # Errors
    /// [`CandleError::ModelNotFound`] / [`CandleError::CorruptModel`] as for
    /// [`crate::LlamaWeights::load`]; see [`GgufTokenizer::from_gguf`] for the rest.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let (content, _) = open_gguf(path.as_ref())?;
        Self::from_gguf(&content)
    }

    /// Builds the tokenizer from parsed GGUF metadata.
    ///
    /// # Errors
    /// [`CandleError::Metadata`] when `tokenizer.ggml.model` is not `gpt2`, a key is missing
    /// or malformed, or the eos id is outside the vocabulary; [`CandleError::Tokenizer`] when
    /// the BPE model cannot be built.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        check_model(content)?;
        let tokens = string_array(content, "tokenizer.ggml.tokens")?;
        let merges = string_array(content, "tokenizer.ggml.merges")?;
        let types = token_types(content, tokens.len())?;
        let special: Vec<bool> = types.iter().map(|&t| t == TOKEN_TYPE_CONTROL).collect();
        let tokenizer = bpe_tokenizer(&tokens, &merges, &special)?;
        let token_bytes = byte_strings(&tokens, &special);
        let eos_id = token_id(content, "tokenizer.ggml.eos_token_id")?.ok_or_else(|| {
            CandleError::Metadata {
                key: "tokenizer.ggml.eos_token_id".into(),
                reason: "missing".into(),
            }
        })?;
        if eos_id as usize >= tokens.len() {
            return Err(CandleError::Metadata {
                key: "tokenizer.ggml.eos_token_id".into(),
                reason: format!("{eos_id} is outside the vocabulary of {}", tokens.len()),
            });
        }
        let bos_token = token_id(content, "tokenizer.ggml.bos_token_id")?
            .and_then(|id| tokens.get(id as usize).cloned());
        let chat_template = match content.metadata.get("tokenizer.chat_template") {
            None => None,
            Some(v) => Some(
                v.to_string()
                    .map_err(|e| CandleError::Metadata {
                        key: "tokenizer.chat_template".into(),
                        reason: e.to_string(),
                    })?
                    .clone(),
            ),
        };
        Ok(GgufTokenizer {
            tokenizer,
            token_bytes,
            special,
            eos_id,
            bos_token,
            chat_template,
        })
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Number of tokens in the vocabulary (`tokenizer.ggml.tokens`).
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// The end-of-sequence id (`tokenizer.ggml.eos_token_id`).
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// The id of a token given by its text (for example `"<|im_end|>"`), if present.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Whether `id` is a control (special) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The raw bytes a token stands for (a control token: its text); `None` outside the
    /// vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// The chat template stored in the file (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Encodes text to token ids. Control tokens written in the text (`<|im_start|>`) are
    /// recognised as single tokens. No BOS is added.
    ///
    /// # Errors
    /// [`CandleError::Tokenizer`] if the tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| CandleError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes token ids to text; `skip_special` drops control tokens. Invalid UTF-8 (a
    /// multi-byte character cut by the end of `ids`) becomes U+FFFD.
    ///
    /// # Errors
    /// [`CandleError::TokenOutOfVocab`] for an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let bytes = self.concat_bytes(ids, skip_special)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The raw bytes of `ids` one after the other (control tokens dropped when `skip_special`).
    fn concat_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        for &id in ids {
            let b = self.token_bytes(id).ok_or(CandleError::TokenOutOfVocab {
                token: id,
                vocab_size: self.vocab_size(),
            })?;
            if !(skip_special && self.is_special(id)) {
                bytes.extend_from_slice(b);
            }
        }
        Ok(bytes)
    }

    /// [`Detokenizer::decode`] for both implementations: the lossy UTF-8 text of `ids`, with an
    /// out-of-vocabulary id reported as [`speculative::Error::TokenOutOfVocab`].
    fn detokenize(&self, ids: &[u32], skip_special: bool) -> speculative::Result<String> {
        match self.concat_bytes(ids, skip_special) {
            Ok(bytes) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
            Err(CandleError::TokenOutOfVocab { token, vocab_size }) => {
                Err(speculative::Error::TokenOutOfVocab {
                    what: "token to detokenize",
                    token,
                    vocab_size,
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Renders the file's chat template (Jinja, via minijinja) for `messages` with
    /// `add_generation_prompt = true`, so the result ends where the assistant's reply starts.
    /// The template also sees `bos_token` and `eos_token`, and `raise_exception(msg)` fails
    /// the rendering with `msg`. Blocks are trimmed as in Hugging Face's renderer
    /// (`trim_blocks`, `lstrip_blocks`).
    ///
    /// # Errors
    /// [`CandleError::Template`] when the file has no chat template or it fails to parse or
    /// render.
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        let src = self
            .chat_template
            .as_deref()
            .ok_or_else(|| CandleError::Template("the GGUF file has no chat template".into()))?;
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", src)
            .map_err(|e| CandleError::Template(e.to_string()))?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| CandleError::Template(e.to_string()))?;
        let eos = self
            .token_bytes(self.eos_id)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default();
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => eos,
        })
        .map_err(|e| CandleError::Template(e.to_string()))
    }

    /// A streaming detokenizer: feed tokens one at a time, get text as soon as it forms
    /// complete UTF-8 characters.
    pub fn stream(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            pending: Vec::new(),
            skip_special,
        }
    }
}

/// The text a reader sees: control tokens (`<|im_end|>`, ...) are skipped, as in
/// [`GgufTokenizer::decode`] with `skip_special = true` and the `speculate` command's stream.
/// Use [`GgufDetokenizer`] to keep them in the text.
///
/// Stateless and exact for any slice: the text of `tokens` is the lossy UTF-8 decode of the
/// concatenated raw bytes of the tokens ([`GgufTokenizer::token_bytes`]), so a window that starts
/// and ends on character boundaries decodes to exactly the corresponding part of the full text,
/// and bytes that do not yet form a complete character (a 4-byte emoji cut after its first
/// tokens) come out as U+FFFD. `O(bytes of tokens)`.
///
/// Note that the inherent [`GgufTokenizer::decode`] (two arguments) takes precedence in method
/// syntax; call this one as `Detokenizer::decode(&tokenizer, ids)`.
///
/// # Errors
/// [`speculative::Error::TokenOutOfVocab`] for an id `>= vocab_size()`.
impl Detokenizer for GgufTokenizer {
    fn decode(&self, tokens: &[u32]) -> speculative::Result<String> {
        self.detokenize(tokens, true)
    }
}

/// A [`Detokenizer`] over a shared [`GgufTokenizer`] that chooses whether control tokens are
/// part of the text.
///
/// With `skip_special = false` the text of `<|im_end|>` is in the decoded text (so a stop
/// string can match it, and a stream shows it); with `true` it behaves exactly as the
/// [`Detokenizer`] implementation of [`GgufTokenizer`]. Cloning shares the tokenizer.
///
/// ```no_run
/// use std::sync::Arc;
/// use speculative::decode::Detokenizer;
/// use speculative_candle::{default_model_path, GgufDetokenizer, GgufTokenizer};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let tok = Arc::new(GgufTokenizer::load(default_model_path())?);
/// let ids = tok.encode("<|im_start|>Hi")?;
/// let raw: Box<dyn Detokenizer> = Box::new(GgufDetokenizer::new(tok.clone(), false));
/// assert_eq!(raw.decode(&ids)?, "<|im_start|>Hi");
/// assert_eq!(Detokenizer::decode(&*tok, &ids)?, "Hi");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct GgufDetokenizer {
    tokenizer: Arc<GgufTokenizer>,
    skip_special: bool,
}

impl GgufDetokenizer {
    /// A detokenizer over `tokenizer`; `skip_special` drops control tokens from the text.
    pub fn new(tokenizer: Arc<GgufTokenizer>, skip_special: bool) -> Self {
        GgufDetokenizer {
            tokenizer,
            skip_special,
        }
    }

    /// The shared tokenizer.
    pub fn tokenizer(&self) -> &Arc<GgufTokenizer> {
        &self.tokenizer
    }

    /// Whether control tokens are dropped from the text.
    pub fn skip_special(&self) -> bool {
        self.skip_special
    }
}

/// The lossy UTF-8 text of the tokens' raw bytes, control tokens dropped when
/// [`GgufDetokenizer::skip_special`]; the same guarantees as the implementation on
/// [`GgufTokenizer`]. `O(bytes of tokens)`.
///
/// # Errors
/// [`speculative::Error::TokenOutOfVocab`] for an id `>= vocab_size()`.
impl Detokenizer for GgufDetokenizer {
    fn decode(&self, tokens: &[u32]) -> speculative::Result<String> {
        self.tokenizer.detokenize(tokens, self.skip_special)
    }
}

/// Incremental detokenizer from [`GgufTokenizer::stream`].
///
/// Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character (an emoji is
/// often 2-4 tokens). [`StreamDecoder::push`] buffers the incomplete bytes and returns only
/// complete characters, so concatenating every returned piece plus [`StreamDecoder::finish`]
/// equals [`GgufTokenizer::decode`] of all tokens.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a GgufTokenizer,
    pending: Vec<u8>,
    skip_special: bool,
}

impl StreamDecoder<'_> {
    /// Adds one token and returns the text that became complete (possibly empty). Bytes that
    /// can never form valid UTF-8 are returned as U+FFFD.
    ///
    /// # Errors
    /// [`CandleError::TokenOutOfVocab`] for an id outside the vocabulary (the decoder state is
    /// unchanged).
    pub fn push(&mut self, id: u32) -> Result<String> {
        let tok = self.tokenizer;
        let bytes = tok.token_bytes(id).ok_or(CandleError::TokenOutOfVocab {
            token: id,
            vocab_size: tok.vocab_size(),
        })?;
        if !(self.skip_special && tok.is_special(id)) {
            self.pending.extend_from_slice(bytes);
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just validated, so this cannot fail.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            // An incomplete character at the end: wait for more bytes.
                            self.pending.drain(..valid);
                            break;
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    /// Flushes what is left (an incomplete character becomes U+FFFD).
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}
