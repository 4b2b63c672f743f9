//! The token table llguidance works on (`toktrie`'s trie), built from the model's tokenizer.

use std::sync::Arc;

use llguidance::ParserFactory;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::GuidanceError;

/// The tokenizer function a [`Vocabulary`] uses to turn grammar-forced bytes into the model's
/// canonical tokens: bytes in, token ids out.
pub type TokenizeFn = dyn Fn(&[u8]) -> Vec<u32> + Send + Sync;

/// The model's vocabulary as llguidance sees it: the raw bytes of every token, which ids are
/// special (control) tokens, the EOS id, and the model's own tokenizer (for grammar-forced
/// tokens, [`crate::ForcedDrafts`]).
///
/// Build it once per model and share it (it is cheap to clone: an `Arc`). Building the trie
/// over a 49,152-token vocabulary takes a few milliseconds.
///
/// With `speculative-candle`:
///
/// ```ignore
/// let tok = speculative_candle::GgufTokenizer::load(path)?;
/// let n = tok.vocab_size() as u32;
/// let bytes = (0..n).map(|i| tok.token_bytes(i).unwrap().to_vec()).collect();
/// let special = (0..n).map(|i| tok.is_special(i)).collect();
/// let vocab = Vocabulary::with_tokenizer(bytes, special, tok.eos_id(), tok.tokenizer().clone())?;
/// ```
#[derive(Clone)]
pub struct Vocabulary {
    env: TokEnv,
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("vocab_size", &self.vocab_size())
            .field("eos", &self.eos())
            .finish()
    }
}

/// Our [`TokenizerEnv`]: the trie plus the model's tokenizer.
struct Env {
    trie: TokTrie,
    tokenize: Option<Arc<TokenizeFn>>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match &self.tokenize {
            // Only valid UTF-8 goes through the model's tokenizer; anything else (a character
            // cut by a forced-bytes boundary) through the trie's greedy tokenization.
            Some(f) if std::str::from_utf8(s).is_ok() => f(s),
            _ => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.tokenize.is_some()
    }
}

impl Vocabulary {
    /// A vocabulary of `token_bytes.len()` tokens: `token_bytes[i]` is the raw byte string of
    /// token `i` (for byte-level BPE, after undoing the byte-to-unicode mapping; for a special
    /// token, its text), `special[i]` marks control tokens (they never match grammar text;
    /// `special` may be empty for none), `eos` is the id that ends a generation (allowed
    /// exactly where the grammar is complete), and `tokenize` is the model's tokenizer, used
    /// to tokenize grammar-forced text canonically.
    ///
    /// # Errors
    /// [`GuidanceError::Vocabulary`] when `token_bytes` is empty or longer than `u32::MAX`,
    /// `special` has another non-zero length, or `eos` is outside the vocabulary.
    pub fn new(
        token_bytes: Vec<Vec<u8>>,
        special: Vec<bool>,
        eos: u32,
        tokenize: impl Fn(&[u8]) -> Vec<u32> + Send + Sync + 'static,
    ) -> Result<Self, GuidanceError> {
        Self::build(token_bytes, special, eos, Some(Arc::new(tokenize)))
    }

    /// As [`Vocabulary::new`] with a `tokenizers` tokenizer (encoding without added special
    /// tokens; an encoding error tokenizes to nothing, so nothing is forced).
    ///
    /// # Errors
    /// As [`Vocabulary::new`].
    pub fn with_tokenizer(
        token_bytes: Vec<Vec<u8>>,
        special: Vec<bool>,
        eos: u32,
        tokenizer: tokenizers::Tokenizer,
    ) -> Result<Self, GuidanceError> {
        Self::new(token_bytes, special, eos, move |b: &[u8]| {
            let text = String::from_utf8_lossy(b);
            tokenizer
                .encode(text.as_ref(), false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }

    /// As [`Vocabulary::new`] without a tokenizer: grammar-forced text is tokenized greedily
    /// (longest token first) and treated as non-canonical, so llguidance forces no tokens and
    /// [`crate::ForcedDrafts`] proposes none. Masks are unaffected. Meant for toy vocabularies.
    ///
    /// # Errors
    /// As [`Vocabulary::new`].
    pub fn without_tokenizer(
        token_bytes: Vec<Vec<u8>>,
        special: Vec<bool>,
        eos: u32,
    ) -> Result<Self, GuidanceError> {
        Self::build(token_bytes, special, eos, None)
    }

    /// As [`Vocabulary::new`], tokenizing forced text greedily through the trie but treating
    /// that as canonical (so forced tokens are proposed). Right for toy vocabularies whose
    /// tokens are single characters, where greedy and canonical tokenization agree.
    ///
    /// # Errors
    /// As [`Vocabulary::new`].
    pub fn greedy(
        token_bytes: Vec<Vec<u8>>,
        special: Vec<bool>,
        eos: u32,
    ) -> Result<Self, GuidanceError> {
        let trie_bytes = token_bytes.clone();
        let specials = special.clone();
        let info = TokRxInfo::new(trie_bytes.len() as u32, eos);
        let words = Self::words(trie_bytes, &specials);
        let trie = TokTrie::from(&info, &words);
        Self::build(
            token_bytes,
            special,
            eos,
            Some(Arc::new(move |b: &[u8]| trie.greedy_tokenize(b))),
        )
    }

    fn words(token_bytes: Vec<Vec<u8>>, special: &[bool]) -> Vec<Vec<u8>> {
        token_bytes
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                if special.get(i).copied().unwrap_or(false) {
                    // toktrie marks special tokens with a leading 0xff byte.
                    let mut w = Vec::with_capacity(b.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(&b);
                    w
                } else {
                    b
                }
            })
            .collect()
    }

    fn build(
        token_bytes: Vec<Vec<u8>>,
        special: Vec<bool>,
        eos: u32,
        tokenize: Option<Arc<TokenizeFn>>,
    ) -> Result<Self, GuidanceError> {
        let n = token_bytes.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(GuidanceError::Vocabulary(format!(
                "{n} tokens (need 1 to 2^32 - 1)"
            )));
        }
        if !special.is_empty() && special.len() != n {
            return Err(GuidanceError::Vocabulary(format!(
                "{} special-token flags for {n} tokens",
                special.len()
            )));
        }
        if eos as usize >= n {
            return Err(GuidanceError::Vocabulary(format!(
                "EOS id {eos} outside the vocabulary of {n}"
            )));
        }
        let info = TokRxInfo::new(n as u32, eos);
        let words = Self::words(token_bytes, &special);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { trie, tokenize });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| GuidanceError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Vocabulary {
            env,
            factory: Arc::new(factory),
        })
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.env.tok_trie().vocab_size()
    }

    /// The EOS id.
    pub fn eos(&self) -> u32 {
        self.env.tok_trie().eos_token()
    }

    /// The raw bytes of `tokens` one after the other (special tokens as their text).
    pub fn decode(&self, tokens: &[u32]) -> Vec<u8> {
        self.env.tok_trie().decode_raw(tokens)
    }

    pub(crate) fn factory(&self) -> &ParserFactory {
        &self.factory
    }
}
