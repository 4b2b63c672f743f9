//! [`GrammarMask`]: an llguidance grammar as the [`TokenMask`] of every target and draft row.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use llguidance::Matcher;
use llguidance::api::TopLevelGrammar;
use speculative::TokenMask;
use toktrie::SimpleVob;

use crate::{GuidanceError, Vocabulary};

/// A grammar to constrain the generated text with.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Grammar {
    /// A JSON schema (llguidance's subset: objects, arrays, strings with `maxLength` /
    /// `pattern` / `enum`, numbers, `anyOf`, local `$ref`s). Unless the schema carries its own
    /// `"x-guidance"` options, the JSON is compact: no whitespace between tokens
    /// (`{"whitespace_flexible": false}`), so that a small model cannot spend its token budget
    /// on blanks.
    JsonSchema(serde_json::Value),
    /// A Lark grammar (llguidance's dialect, rule `start`).
    Lark(String),
    /// A regular expression the whole output must match (Rust `regex` syntax).
    Regex(String),
}

impl Grammar {
    /// A JSON schema given as JSON text.
    ///
    /// # Errors
    /// [`GuidanceError::SchemaJson`] when `text` is not JSON.
    pub fn json_schema_str(text: &str) -> Result<Self, GuidanceError> {
        Ok(Grammar::JsonSchema(serde_json::from_str(text)?))
    }

    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonSchema(v) => {
                let mut v = v.clone();
                if let Some(o) = v.as_object_mut()
                    && !o.contains_key("x-guidance")
                {
                    o.insert(
                        "x-guidance".into(),
                        serde_json::json!({ "whitespace_flexible": false }),
                    );
                }
                TopLevelGrammar::from_json_schema(v)
            }
            Grammar::Lark(s) => TopLevelGrammar::from_lark(s.clone()),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
        }
    }
}

/// Largest number of cached rows before the cache is emptied (one row is `vocab / 8` bytes).
const CACHE_ROWS: usize = 512;

/// The allowed set of one row.
#[derive(Debug)]
enum Row {
    /// The grammar's allowed tokens (EOS included where the grammar is complete).
    Allowed(SimpleVob),
    /// The row follows a token the grammar rejects: left unmasked (see [`GrammarMask`]).
    Unconstrained,
}

/// The matcher and what it has consumed.
struct State {
    /// Advanced through `consumed`.
    matcher: Matcher,
    /// The fresh matcher, cloned to recover from an internal error.
    initial: Matcher,
    /// Generated tokens (after the prompt) the matcher has consumed.
    consumed: Vec<u32>,
    /// Rows computed so far, keyed by the generated tokens before the row.
    cache: HashMap<Vec<u32>, Arc<Row>>,
    /// Rows computed (cache misses) and rows served.
    computed: u64,
    served: u64,
    /// The first internal llguidance error, if any.
    fault: Option<String>,
}

/// The grammar state of a [`GrammarMask`] after some generated tokens
/// ([`GrammarMask::state_at`]), computed from the matcher itself (never from the cache).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarState {
    /// The generated tokens the matcher has consumed: the longest prefix of the queried tokens
    /// that the grammar accepts.
    pub consumed: Vec<u32>,
    /// Allowed next tokens in increasing id order (only EOS once the grammar is complete).
    pub allowed: Vec<u32>,
    /// The grammar accepts the consumed text as a complete output.
    pub accepting: bool,
    /// The grammar cannot be extended (only EOS may follow).
    pub stopped: bool,
}

/// An llguidance grammar as a [`TokenMask`]: each row's logits keep only the tokens the grammar
/// allows after the row's prefix, for target rows and draft rows alike.
///
/// # Prefixes, rollback and the cache
///
/// The processor calls [`TokenMask::apply`] with the whole prefix of the row: the prompt, the
/// emitted tokens, and the drafts before the row on its own path (a tree node's ancestors).
/// The grammar starts at the first generated token: the first `prompt_len` tokens of every
/// prefix are the prompt, unconstrained and not fed to the grammar. One `GrammarMask` serves
/// one request (one prompt); build a new one per request.
///
/// One llguidance matcher follows the prefixes: for a prefix it is rolled back
/// (`Matcher::rollback`) to the longest common prefix of what it has consumed and the prefix's
/// generated tokens, then advanced through the rest. So the state never keeps a trace of a
/// rejected draft: it is always that of a fresh matcher fed exactly the prefix
/// ([`GrammarMask::state_at`], tested). The allowed set of each prefix is cached, so the
/// target row and the draft row at the same prefix (and repeated prefixes in a tree) share one
/// computation; the cache holds at most 512 rows and is emptied when full.
///
/// # Rows the grammar rejects, and the end of the grammar
///
/// - A row whose prefix holds a token the grammar rejects (possible only after a draft token
///   that the mask of its own target row banned, so the draft is rejected there and the row
///   is never used) is left unmasked, so that it never fails for lack of an allowed token.
/// - When the grammar is complete and allows nothing else, the mask allows only the
///   vocabulary's EOS id; with EOS among the generation's stop ids the generation ends there.
///   Where the grammar accepts but may go on, EOS is allowed beside the continuations.
/// - An internal llguidance error (e.g. a grammar too ambiguous for its step budget) is kept
///   in [`GrammarMask::fault`] and the row allows only EOS: the generation ends instead of
///   going on unconstrained.
/// - Tokens outside the vocabulary (a padded logits row wider than it) are banned.
///
/// `GrammarMask` is `Send + Sync`: the matcher sits behind a `Mutex`.
pub struct GrammarMask {
    state: Mutex<State>,
    vocab: Vocabulary,
    prompt_len: usize,
}

impl std::fmt::Debug for GrammarMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMask")
            .field("prompt_len", &self.prompt_len)
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl GrammarMask {
    /// A mask for a request whose prompt is `prompt_len` tokens long: the grammar constrains
    /// every token after them.
    ///
    /// # Errors
    /// [`GuidanceError::Grammar`] when the grammar does not compile.
    pub fn new(
        vocab: &Vocabulary,
        grammar: &Grammar,
        prompt_len: usize,
    ) -> Result<Self, GuidanceError> {
        let parser = vocab
            .factory()
            .create_parser(grammar.top_level())
            .map_err(|e| GuidanceError::Grammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GuidanceError::Grammar(e));
        }
        Ok(GrammarMask {
            state: Mutex::new(State {
                initial: matcher.clone(),
                matcher,
                consumed: Vec::new(),
                cache: HashMap::new(),
                computed: 0,
                served: 0,
                fault: None,
            }),
            vocab: vocab.clone(),
            prompt_len,
        })
    }

    /// [`GrammarMask::new`] with a JSON schema.
    ///
    /// # Errors
    /// As [`GrammarMask::new`].
    pub fn json_schema(
        vocab: &Vocabulary,
        schema: &serde_json::Value,
        prompt_len: usize,
    ) -> Result<Self, GuidanceError> {
        Self::new(vocab, &Grammar::JsonSchema(schema.clone()), prompt_len)
    }

    /// [`GrammarMask::new`] with a Lark grammar.
    ///
    /// # Errors
    /// As [`GrammarMask::new`].
    pub fn lark(vocab: &Vocabulary, lark: &str, prompt_len: usize) -> Result<Self, GuidanceError> {
        Self::new(vocab, &Grammar::Lark(lark.into()), prompt_len)
    }

    /// [`GrammarMask::new`] with a regular expression.
    ///
    /// # Errors
    /// As [`GrammarMask::new`].
    pub fn regex(
        vocab: &Vocabulary,
        regex: &str,
        prompt_len: usize,
    ) -> Result<Self, GuidanceError> {
        Self::new(vocab, &Grammar::Regex(regex.into()), prompt_len)
    }

    /// Number of leading prompt tokens the grammar does not see.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// The vocabulary.
    pub fn vocabulary(&self) -> &Vocabulary {
        &self.vocab
    }

    /// `(computed, served)`: rows whose allowed set was computed by the matcher, and rows
    /// masked in all (computed plus served from the cache).
    pub fn row_counts(&self) -> (u64, u64) {
        let s = self.lock();
        (s.computed, s.served)
    }

    /// Empties the row cache (the matcher keeps its state). Rows are recomputed on demand.
    pub fn clear_cache(&self) {
        self.lock().cache.clear();
    }

    /// The first internal llguidance error met, if any (see the type's docs).
    pub fn fault(&self) -> Option<String> {
        self.lock().fault.clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held cannot leave the matcher half-updated in a way we
        // rely on: `sync` re-derives everything from `consumed`, so a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The generated part of `prefix` (empty for a prefix inside the prompt).
    fn generated<'p>(&self, prefix: &'p [u32]) -> &'p [u32] {
        prefix.get(self.prompt_len..).unwrap_or(&[])
    }

    /// Moves the matcher to the generated tokens `gen` (rollback to the common prefix, then
    /// forward) and returns how many of them the grammar accepts.
    fn sync(s: &mut State, generated: &[u32]) -> usize {
        let common = s
            .consumed
            .iter()
            .zip(generated)
            .take_while(|(a, b)| a == b)
            .count();
        if common < s.consumed.len() {
            let back = s.consumed.len() - common;
            if s.matcher.rollback(back).is_err() {
                Self::replay(s, common);
            }
            s.consumed.truncate(common);
        }
        let rest = &generated[common..];
        if rest.is_empty() {
            return common;
        }
        match s.matcher.try_consume_tokens(rest) {
            Ok(n) => {
                s.consumed.extend_from_slice(&rest[..n]);
                common + n
            }
            Err(e) => {
                s.fault.get_or_insert(e.to_string());
                Self::replay(s, common);
                common
            }
        }
    }

    /// Rebuilds the matcher from the fresh one and the first `keep` consumed tokens.
    fn replay(s: &mut State, keep: usize) {
        s.matcher = s.initial.clone();
        let keep = keep.min(s.consumed.len());
        let toks: Vec<u32> = s.consumed[..keep].to_vec();
        let n = s.matcher.try_consume_tokens(&toks).unwrap_or(0);
        s.consumed.truncate(n);
    }

    /// The EOS-only row.
    fn eos_only(&self) -> SimpleVob {
        let mut v = SimpleVob::alloc(self.vocab.vocab_size());
        v.allow_token(self.vocab.eos());
        v
    }

    /// The row after `generated` (cached).
    fn row(&self, s: &mut State, generated: &[u32]) -> Arc<Row> {
        s.served += 1;
        if let Some(r) = s.cache.get(generated) {
            return r.clone();
        }
        s.computed += 1;
        let ok = Self::sync(s, generated);
        let row = if ok < generated.len() {
            Row::Unconstrained
        } else {
            match s.matcher.compute_mask_or_eos() {
                Ok(v) => Row::Allowed(v),
                Err(e) => {
                    s.fault.get_or_insert(e.to_string());
                    Row::Allowed(self.eos_only())
                }
            }
        };
        let row = Arc::new(row);
        if s.cache.len() >= CACHE_ROWS {
            s.cache.clear();
        }
        s.cache.insert(generated.to_vec(), row.clone());
        row
    }

    /// The allowed next tokens after `prefix` (prompt included), in increasing id order, or
    /// `None` when the prefix holds a token the grammar rejects (the row is left unmasked) or
    /// lies inside the prompt.
    pub fn allowed(&self, prefix: &[u32]) -> Option<Vec<u32>> {
        if prefix.len() < self.prompt_len {
            return None;
        }
        let mut s = self.lock();
        match &*self.row(&mut s, self.generated(prefix)) {
            Row::Allowed(v) => Some(ones(v)),
            Row::Unconstrained => None,
        }
    }

    /// `true` when the grammar allows `token` after `prefix` (prompt included); `false` also
    /// when the prefix holds a token the grammar rejects or lies inside the prompt. Uses the
    /// row cache like [`TokenMask::apply`].
    pub fn allows(&self, prefix: &[u32], token: u32) -> bool {
        if prefix.len() < self.prompt_len {
            return false;
        }
        let mut s = self.lock();
        match &*self.row(&mut s, self.generated(prefix)) {
            Row::Allowed(v) => (token as usize) < v.len() && v.is_allowed(token),
            Row::Unconstrained => false,
        }
    }

    /// The tokens the grammar forces after `prefix` (llguidance's fast-forward tokens: the
    /// canonical tokenization of the bytes every continuation starts with, less a tail that
    /// could be tokenized otherwise). Empty when nothing is forced, the grammar rejects the
    /// prefix, or the vocabulary has no canonical tokenizer.
    ///
    /// The model may spell forced text with other tokens than the canonical ones, so forced
    /// tokens are drafts to verify, not certainties; see [`crate::ForcedDrafts`].
    pub fn forced_tokens(&self, prefix: &[u32]) -> Vec<u32> {
        if prefix.len() < self.prompt_len {
            return Vec::new();
        }
        let generated = self.generated(prefix);
        let mut s = self.lock();
        if Self::sync(&mut s, generated) < generated.len() || s.matcher.is_stopped() {
            return Vec::new();
        }
        s.matcher.compute_ff_tokens()
    }

    /// Moves the matcher to `prefix` (rolling back anything else it consumed) and reports its
    /// state, computed from the matcher (not the cache). A fresh mask asked for the same prefix
    /// reports the same state: rejected drafts leave no trace.
    pub fn state_at(&self, prefix: &[u32]) -> GrammarState {
        let generated = self.generated(prefix);
        let mut s = self.lock();
        Self::sync(&mut s, generated);
        let allowed = match s.matcher.compute_mask_or_eos() {
            Ok(v) => ones(&v),
            Err(_) => vec![self.vocab.eos()],
        };
        GrammarState {
            consumed: s.consumed.clone(),
            allowed,
            accepting: s.matcher.is_accepting().unwrap_or(false),
            stopped: s.matcher.is_stopped(),
        }
    }
}

/// The set ids of `v`, increasing.
fn ones(v: &SimpleVob) -> Vec<u32> {
    let mut out = Vec::new();
    v.iter_set_entries(|i| out.push(i as u32));
    out
}

impl TokenMask for GrammarMask {
    fn apply(&self, prefix: &[u32], logits: &mut [f32]) {
        if prefix.len() < self.prompt_len {
            return;
        }
        let row = {
            let mut s = self.lock();
            self.row(&mut s, self.generated(prefix))
        };
        let Row::Allowed(v) = &*row else {
            return;
        };
        // 32 tokens per word of the bit set; ids past the vocabulary are banned.
        let words = v.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            match words.get(w).copied().unwrap_or(0) {
                0 => chunk.fill(f32::NEG_INFINITY),
                u32::MAX => {}
                bits => {
                    for (b, l) in chunk.iter_mut().enumerate() {
                        if bits & (1 << b) == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        // The bit set may be allocated past the vocabulary: ban ids at or above it.
        let n = self.vocab.vocab_size();
        if logits.len() > n {
            logits[n..].fill(f32::NEG_INFINITY);
        }
    }
}
