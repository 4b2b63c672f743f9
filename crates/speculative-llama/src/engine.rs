//! The loaded model: weights, tokenizer and chat template from the GGUF file, and the maker of
//! targets that share the weights.

use std::num::NonZeroU32;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once, OnceLock};

use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::{LlamaChatMessage, LlamaChatTemplate, LlamaModel};
use llama_cpp_2::token::LlamaToken;
use speculative::decode::Detokenizer;

use crate::error::{LlamaError, Result};

static BACKEND: OnceLock<std::result::Result<LlamaBackend, String>> = OnceLock::new();

/// Whether llama.cpp's log lines reach stderr (see [`set_logging`]).
static LOGGING: AtomicBool = AtomicBool::new(false);
/// Whether our log callback is installed in llama.cpp.
static LOG_HOOK: Once = Once::new();

/// llama.cpp's process-wide backend, initialised on first use and never freed. llama.cpp's
/// log output is off unless [`set_logging`] or the environment variable
/// `SPECULATIVE_LLAMA_LOG` (any value but `0`) turns it on.
///
/// llama-cpp-2 allows one `LlamaBackend` per process: a program that also calls llama-cpp-2
/// directly must use this one instead of calling `LlamaBackend::init()` itself.
///
/// # Errors
/// [`LlamaError::Backend`] when something else in the process initialised llama-cpp-2's backend
/// first.
pub fn backend() -> Result<&'static LlamaBackend> {
    BACKEND
        .get_or_init(|| {
            let env = std::env::var("SPECULATIVE_LLAMA_LOG").is_ok_and(|v| v != "0");
            set_logging(env || LOGGING.load(Ordering::Relaxed));
            LlamaBackend::init().map_err(|e| {
                format!(
                    "{e} (initialised elsewhere in the process? use speculative_llama::backend())"
                )
            })
        })
        .as_ref()
        .map_err(|e| LlamaError::Backend(e.clone()))
}

/// Turns llama.cpp's own log lines (model loading, context creation, errors) on or off for the
/// whole process; they go to stderr. Off by default. Any number of calls, at any time.
pub fn set_logging(enabled: bool) {
    LOGGING.store(enabled, Ordering::Relaxed);
    LOG_HOOK.call_once(|| {
        // SAFETY: `log_line` is a valid callback for the whole process lifetime and ignores
        // its user-data pointer, which is null.
        unsafe { llama_cpp_sys_2::llama_log_set(Some(log_line), std::ptr::null_mut()) };
    });
}

/// llama.cpp's log callback: the line to stderr when logging is on.
unsafe extern "C" fn log_line(
    _level: llama_cpp_sys_2::ggml_log_level,
    text: *const std::os::raw::c_char,
    _user: *mut std::os::raw::c_void,
) {
    if text.is_null() || !LOGGING.load(Ordering::Relaxed) {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string valid for the call.
    let line = unsafe { std::ffi::CStr::from_ptr(text) };
    eprint!("{}", line.to_string_lossy());
}

/// How to load a GGUF file.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ModelOptions {
    /// Layers to offload to the GPU (builds with the `cuda` or `metal` feature; `u32::MAX` for
    /// all). 0 (the default) keeps the model on the CPU.
    pub gpu_layers: u32,
    /// Map the file instead of reading it (llama.cpp's default, `true`).
    pub use_mmap: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            gpu_layers: 0,
            use_mmap: true,
        }
    }
}

impl ModelOptions {
    /// With `gpu_layers` layers offloaded (other fields kept).
    pub fn with_gpu_layers(mut self, gpu_layers: u32) -> Self {
        self.gpu_layers = gpu_layers;
        self
    }
}

/// A message of a conversation, for [`LlamaEngine::apply_chat_template`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTurn {
    /// `"system"`, `"user"` or `"assistant"`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatTurn {
    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        ChatTurn {
            role: "user".into(),
            content: content.into(),
        }
    }
    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        ChatTurn {
            role: "assistant".into(),
            content: content.into(),
        }
    }
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        ChatTurn {
            role: "system".into(),
            content: content.into(),
        }
    }
}

/// A GGUF model loaded by llama.cpp, shared (cheap to clone) by every target made from it:
/// [`LlamaEngine::target`] for one sequence ([`crate::LlamaTarget`]),
/// [`LlamaEngine::batch_target`] for several ([`crate::LlamaBatchTarget`]). Each target has its
/// own llama.cpp context (KV cache); the weights are loaded once.
///
/// It is also the model's tokenizer (llama.cpp's, from the GGUF metadata) and chat template,
/// and implements [`Detokenizer`] for stop strings and streaming in the decoding loop.
///
/// ```no_run
/// use speculative_llama::{ChatTurn, LlamaConfig, LlamaEngine, ModelOptions};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let engine = LlamaEngine::load("models/SmolLM2-135M-Instruct.Q4_1.gguf", &ModelOptions::default())?;
/// let text = engine.apply_chat_template(&[ChatTurn::user("Hi!")], true)?;
/// let prompt = engine.encode(&text)?;
/// let target = engine.target(&LlamaConfig::default())?;
/// # let _ = (prompt, target);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LlamaEngine {
    model: Arc<LlamaModel>,
    vocab_size: usize,
    eos: u32,
    eog: Vec<u32>,
    recurrent: bool,
}

impl std::fmt::Debug for LlamaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaEngine")
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .finish_non_exhaustive()
    }
}

impl LlamaEngine {
    /// Loads a GGUF file.
    ///
    /// # Errors
    /// [`LlamaError::Backend`] (see [`backend`]); [`LlamaError::Load`] for a missing or
    /// unreadable file, or one llama.cpp cannot load.
    pub fn load(path: impl AsRef<Path>, options: &ModelOptions) -> Result<Self> {
        let path = path.as_ref();
        let load_err = |reason: String| LlamaError::Load {
            path: path.to_path_buf(),
            reason,
        };
        // llama.cpp answers a missing file with a null model and a log line only.
        if !path.is_file() {
            return Err(load_err("no such file".into()));
        }
        let backend = backend()?;
        let params = LlamaModelParams::default()
            .with_n_gpu_layers(options.gpu_layers)
            .with_use_mmap(options.use_mmap);
        let model = LlamaModel::load_from_file(backend, path, &params).map_err(|e| {
            load_err(format!(
                "{e} (set SPECULATIVE_LLAMA_LOG=1 for llama.cpp's log)"
            ))
        })?;
        // Recurrent and hybrid models cannot drop positions: their targets roll back by
        // snapshot and replay (`LlamaTarget::rollback`).
        let recurrent = model.is_recurrent() || model.is_hybrid();
        let vocab_size = usize::try_from(model.n_vocab())
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| load_err(format!("vocabulary size {}", model.n_vocab())))?;
        let vocab = model.vocab();
        let eos = u32::try_from(vocab.eos().0)
            .map_err(|_| load_err("no end-of-sequence token".into()))?;
        let eog = (0..vocab_size as u32)
            .filter(|&t| vocab.is_eog(LlamaToken(t as i32)))
            .collect();
        Ok(LlamaEngine {
            model: Arc::new(model),
            vocab_size,
            eos,
            eog,
            recurrent,
        })
    }

    /// `true` for a recurrent or hybrid architecture (Mamba, RWKV, gated delta-net layers):
    /// its state cannot drop positions, so [`crate::LlamaTarget`] and
    /// [`crate::LlamaBatchTarget`] roll back by snapshot and replay
    /// ([`speculative::Rollback::Snapshot`]).
    pub fn is_recurrent(&self) -> bool {
        self.recurrent
    }

    /// The llama-cpp-2 model, for what this crate does not wrap.
    pub fn model(&self) -> &LlamaModel {
        &self.model
    }

    pub(crate) fn shared_model(&self) -> &Arc<LlamaModel> {
        &self.model
    }

    /// Logits per position (the output head's width), in tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The context length the model was trained with, in tokens.
    pub fn context_train(&self) -> usize {
        self.model.n_ctx_train() as usize
    }

    /// The end-of-sequence token id.
    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// Every end-of-generation token id (EOS, end-of-turn and the like), ascending: the stop
    /// tokens of a chat.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Token ids of a prompt: control tokens written in the text (`<|im_start|>`) are parsed
    /// as such, and the BOS token is put in front when the model's metadata asks for one
    /// (`tokenizer.ggml.add_bos_token`; llama.cpp's built-in chat templates do not write it)
    /// and the text does not already start with it. SmolLM2 adds none.
    ///
    /// # Errors
    /// [`LlamaError::Text`] when llama.cpp returns an id outside the vocabulary.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let vocab = self.model.vocab();
        let mut ids = vocab.tokenize(text.as_bytes(), vocab.should_add_bos(), true);
        // A template that writes the BOS text, tokenized with the BOS added: keep one.
        if vocab.should_add_bos() && ids.len() >= 2 && ids[0] == vocab.bos() && ids[1] == ids[0] {
            ids.remove(0);
        }
        ids.into_iter()
            .map(|t| {
                u32::try_from(t.0)
                    .ok()
                    .filter(|&id| (id as usize) < self.vocab_size)
                    .ok_or_else(|| LlamaError::Text(format!("tokenizer returned id {}", t.0)))
            })
            .collect()
    }

    /// The bytes of one token as it appears in text (control tokens included).
    ///
    /// # Errors
    /// [`LlamaError::TokenOutOfVocab`].
    pub fn token_bytes(&self, token: u32) -> Result<Vec<u8>> {
        self.check(&[token])?;
        Ok(self
            .model
            .vocab()
            .token_to_piece(LlamaToken(token as i32), true, None))
    }

    /// The text of `tokens` (invalid UTF-8 replaced), control tokens dropped when
    /// `skip_special`.
    ///
    /// # Errors
    /// [`LlamaError::TokenOutOfVocab`].
    pub fn decode(&self, tokens: &[u32], skip_special: bool) -> Result<String> {
        self.check(tokens)?;
        let ids: Vec<LlamaToken> = tokens.iter().map(|&t| LlamaToken(t as i32)).collect();
        let bytes = self.model.vocab().detokenize(&ids, false, !skip_special);
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The prompt text of a conversation under the model's own chat template (from the GGUF,
    /// applied by llama.cpp's built-in template engine), ending with the assistant's opening
    /// when `add_assistant`.
    ///
    /// A Gemma file without a template (`general.architecture` `gemma`, `gemma2` or `gemma3`;
    /// the Gemma 3 270M GGUF of `scripts/fetch-gemma.sh` has none) gets Gemma's own format,
    /// llama.cpp's built-in `gemma` template: `<start_of_turn>user\n{text}<end_of_turn>\n`
    /// per user turn, `model` for the assistant's role, a system message put in front of the
    /// first user message (followed by a blank line), contents trimmed, and
    /// `<start_of_turn>model\n` to open the reply, as in Gemma 3's Hugging Face template. The
    /// `<bos>` it starts with is added by [`LlamaEngine::encode`] (the file asks for it). Its
    /// turns end at `<end_of_turn>`, one of [`LlamaEngine::eog_ids`] (with `<eos>`).
    ///
    /// # Errors
    /// [`LlamaError::ChatTemplate`] when the file has none (and is not Gemma) or llama.cpp does
    /// not know it; [`LlamaError::Text`] for a NUL byte in a message.
    pub fn apply_chat_template(&self, turns: &[ChatTurn], add_assistant: bool) -> Result<String> {
        let arch = self.model.meta_val_str("general.architecture");
        let template = match self.model.chat_template(None) {
            Err(_)
                if arch
                    .as_deref()
                    .is_ok_and(|a| matches!(a, "gemma" | "gemma2" | "gemma3")) =>
            {
                LlamaChatTemplate::new("gemma").map_err(|e| LlamaError::Text(e.to_string()))?
            }
            t => t.map_err(|e| LlamaError::ChatTemplate(e.to_string()))?,
        };
        let msgs = turns
            .iter()
            .map(|t| {
                LlamaChatMessage::new(t.role.clone(), t.content.clone())
                    .map_err(|e| LlamaError::Text(e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        self.model
            .apply_chat_template(&template, &msgs, add_assistant)
            .map_err(|e| LlamaError::ChatTemplate(e.to_string()))
    }

    /// A single-sequence target with its own context (see [`crate::LlamaTarget`]).
    ///
    /// # Errors
    /// As [`crate::LlamaTarget::new`].
    pub fn target(&self, config: &crate::LlamaConfig) -> Result<crate::LlamaTarget> {
        crate::LlamaTarget::new(self, config)
    }

    /// A target of `config.slots` sequences in one context (see [`crate::LlamaBatchTarget`]).
    ///
    /// # Errors
    /// As [`crate::LlamaBatchTarget::new`].
    pub fn batch_target(&self, config: &crate::LlamaConfig) -> Result<crate::LlamaBatchTarget> {
        crate::LlamaBatchTarget::new(self, config)
    }

    fn check(&self, tokens: &[u32]) -> Result<()> {
        match tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
            Some(&token) => Err(LlamaError::TokenOutOfVocab {
                token,
                vocab_size: self.vocab_size,
            }),
            None => Ok(()),
        }
    }
}

/// The text of the tokens with control tokens dropped ([`LlamaEngine::decode`]).
///
/// # Errors
/// [`speculative::Error::Model`] wrapping [`LlamaError::TokenOutOfVocab`].
impl Detokenizer for LlamaEngine {
    fn decode(&self, tokens: &[u32]) -> speculative::Result<String> {
        Ok(LlamaEngine::decode(self, tokens, true)?)
    }
}

pub(crate) fn nonzero(field: &'static str, v: usize) -> Result<NonZeroU32> {
    u32::try_from(v)
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(|| LlamaError::Config {
            field,
            value: v.to_string(),
            reason: "must be between 1 and u32::MAX",
        })
}
