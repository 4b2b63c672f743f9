//! Reading llama-architecture GGUF files: the file and its metadata, the hyper-parameters
//! ([`LlamaConfig`]), tensors by name and shape, and the RoPE tables. Used by both forwards
//! (`crate::model`, `crate::fast`) and the tokenizer; imports neither.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::Device;
use candle_core::quantized::QTensor;
use candle_core::quantized::gguf_file::{self, Value};

use crate::error::{CandleError, Result};

/// Hyper-parameters read from the GGUF metadata (`llama.*` keys).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LlamaConfig {
    /// Number of transformer blocks (`llama.block_count`).
    pub n_layers: usize,
    /// Hidden size (`llama.embedding_length`).
    pub hidden_size: usize,
    /// MLP inner size (`llama.feed_forward_length`).
    pub ffn_size: usize,
    /// Query heads (`llama.attention.head_count`).
    pub n_heads: usize,
    /// Key/value heads (`llama.attention.head_count_kv`; defaults to `n_heads`).
    pub n_kv_heads: usize,
    /// Per-head width, `hidden_size / n_heads`.
    pub head_dim: usize,
    /// Maximum context in tokens (`llama.context_length`).
    pub context_length: usize,
    /// RoPE base frequency (`llama.rope.freq_base`; default 10000).
    pub rope_theta: f32,
    /// RMSNorm epsilon (`llama.attention.layer_norm_rms_epsilon`; default 1e-5).
    pub rms_eps: f64,
    /// Vocabulary size (rows of `token_embd.weight`).
    pub vocab_size: usize,
}

/// Opens `path` and parses its GGUF header and metadata (the tensors are read later).
///
/// # Errors
/// [`CandleError::ModelNotFound`] when the file does not exist, [`CandleError::Io`] when it
/// cannot be opened, [`CandleError::CorruptModel`] when it is not a readable GGUF file.
pub(crate) fn open_gguf(path: &Path) -> Result<(gguf_file::Content, BufReader<File>)> {
    let file = File::open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            CandleError::ModelNotFound {
                path: path.to_path_buf(),
            }
        } else {
            CandleError::Io(e)
        }
    })?;
    let mut reader = BufReader::new(file);
    let content = gguf_file::Content::read(&mut reader).map_err(|e| CandleError::CorruptModel {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok((content, reader))
}

/// The metadata value `key`.
///
/// # Errors
/// [`CandleError::Metadata`] when it is missing.
pub(crate) fn meta<'a>(content: &'a gguf_file::Content, key: &str) -> Result<&'a Value> {
    content
        .metadata
        .get(key)
        .ok_or_else(|| CandleError::Metadata {
            key: key.to_string(),
            reason: "missing".into(),
        })
}

/// The integer metadata value `key` as a `usize`.
///
/// # Errors
/// [`CandleError::Metadata`] when it is missing, not an integer, negative or too large.
fn meta_usize(content: &gguf_file::Content, key: &str) -> Result<usize> {
    let v = meta(content, key)?;
    let bad = |reason: &str| CandleError::Metadata {
        key: key.to_string(),
        reason: reason.to_string(),
    };
    let n: u64 = match v {
        Value::U8(x) => u64::from(*x),
        Value::U16(x) => u64::from(*x),
        Value::U32(x) => u64::from(*x),
        Value::U64(x) => *x,
        Value::I8(x) => u64::try_from(*x).map_err(|_| bad("negative"))?,
        Value::I16(x) => u64::try_from(*x).map_err(|_| bad("negative"))?,
        Value::I32(x) => u64::try_from(*x).map_err(|_| bad("negative"))?,
        Value::I64(x) => u64::try_from(*x).map_err(|_| bad("negative"))?,
        _ => return Err(bad("not an integer")),
    };
    usize::try_from(n).map_err(|_| bad("too large"))
}

/// The float metadata value `key`, `default` when absent.
///
/// # Errors
/// [`CandleError::Metadata`] when it is not a float.
fn meta_f64_or(content: &gguf_file::Content, key: &str, default: f64) -> Result<f64> {
    match content.metadata.get(key) {
        None => Ok(default),
        Some(Value::F32(x)) => Ok(f64::from(*x)),
        Some(Value::F64(x)) => Ok(*x),
        Some(_) => Err(CandleError::Metadata {
            key: key.to_string(),
            reason: "not a float".into(),
        }),
    }
}

impl LlamaConfig {
    /// Reads the configuration from GGUF metadata; `vocab_size` comes from `token_embd.weight`.
    ///
    /// # Errors
    /// [`CandleError::Metadata`] when `general.architecture` is not `llama`, a required key is
    /// missing or sizes are inconsistent (hidden size not divisible by heads, heads not divisible
    /// by kv heads, partial RoPE); [`CandleError::Tensor`] when `token_embd.weight` is missing.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        check_architecture(content)?;
        let n_layers = meta_usize(content, "llama.block_count")?;
        let hidden_size = meta_usize(content, "llama.embedding_length")?;
        let ffn_size = meta_usize(content, "llama.feed_forward_length")?;
        let n_heads = meta_usize(content, "llama.attention.head_count")?;
        let n_kv_heads = if content
            .metadata
            .contains_key("llama.attention.head_count_kv")
        {
            meta_usize(content, "llama.attention.head_count_kv")?
        } else {
            n_heads
        };
        let context_length = meta_usize(content, "llama.context_length")?;
        let rope_theta = meta_f64_or(content, "llama.rope.freq_base", 10_000.0)? as f32;
        let rms_eps = meta_f64_or(content, "llama.attention.layer_norm_rms_epsilon", 1e-5)?;
        let mut cfg = LlamaConfig {
            n_layers,
            hidden_size,
            ffn_size,
            n_heads,
            n_kv_heads,
            head_dim: 0,
            context_length,
            rope_theta,
            rms_eps,
            vocab_size: 0,
        };
        cfg.head_dim = cfg.checked_head_dim()?;
        cfg.check_rope(content)?;
        cfg.vocab_size = embedding_rows(content, hidden_size)?;
        Ok(cfg)
    }

    /// `hidden_size / n_heads`, after checking that the sizes are positive and consistent.
    fn checked_head_dim(&self) -> Result<usize> {
        let inconsistent = |key: &str, reason: String| CandleError::Metadata {
            key: key.to_string(),
            reason,
        };
        let (h, nh, nkv) = (self.hidden_size, self.n_heads, self.n_kv_heads);
        if self.n_layers == 0 || h == 0 || self.ffn_size == 0 || self.context_length == 0 {
            return Err(inconsistent(
                "llama.*",
                "block_count, embedding_length, feed_forward_length and context_length must be > 0"
                    .into(),
            ));
        }
        if nh == 0 || nkv == 0 || h % nh != 0 || nh % nkv != 0 {
            return Err(inconsistent(
                "llama.attention.head_count",
                format!("hidden {h}, heads {nh}, kv heads {nkv} are inconsistent"),
            ));
        }
        let head_dim = h / nh;
        if head_dim % 2 != 0 {
            return Err(inconsistent(
                "llama.attention.head_count",
                format!("head dim {head_dim} is odd"),
            ));
        }
        Ok(head_dim)
    }

    /// Checks that RoPE covers the whole head (`llama.rope.dimension_count`, when present,
    /// equals `head_dim`).
    fn check_rope(&self, content: &gguf_file::Content) -> Result<()> {
        if content.metadata.contains_key("llama.rope.dimension_count") {
            let rope_dim = meta_usize(content, "llama.rope.dimension_count")?;
            if rope_dim != self.head_dim {
                return Err(CandleError::Metadata {
                    key: "llama.rope.dimension_count".into(),
                    reason: format!(
                        "partial RoPE ({rope_dim} of {}) is not supported",
                        self.head_dim
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Checks `general.architecture` is `llama`.
fn check_architecture(content: &gguf_file::Content) -> Result<()> {
    let arch = meta(content, "general.architecture")?
        .to_string()
        .map_err(|e| CandleError::Metadata {
            key: "general.architecture".into(),
            reason: e.to_string(),
        })?;
    if arch != "llama" {
        return Err(CandleError::Metadata {
            key: "general.architecture".into(),
            reason: format!("`{arch}` is not supported (only `llama`)"),
        });
    }
    Ok(())
}

/// The vocabulary size: the rows of `token_embd.weight` (`[vocab, hidden]`).
fn embedding_rows(content: &gguf_file::Content, hidden_size: usize) -> Result<usize> {
    let embd = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| CandleError::Tensor {
            name: "token_embd.weight".into(),
            reason: "missing".into(),
        })?;
    let dims = embd.shape.dims();
    if dims.len() != 2 || dims[1] != hidden_size {
        return Err(CandleError::Tensor {
            name: "token_embd.weight".into(),
            reason: format!("shape {dims:?}, expected [vocab, {hidden_size}]"),
        });
    }
    Ok(dims[0])
}

/// Reads the tensors of an open GGUF file ([`open_gguf`]) onto the CPU, checking names and
/// shapes.
pub(crate) struct TensorReader<'a> {
    pub(crate) content: &'a gguf_file::Content,
    pub(crate) reader: &'a mut BufReader<File>,
    /// The file, for error messages.
    pub(crate) path: &'a Path,
}

impl TensorReader<'_> {
    /// The tensor `name` as stored (quantised or float), checked to have the shape `dims`.
    ///
    /// # Errors
    /// [`CandleError::Tensor`] when it is missing or has another shape;
    /// [`CandleError::CorruptModel`] when its data cannot be read.
    pub(crate) fn qtensor(&mut self, name: &str, dims: &[usize]) -> Result<QTensor> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| CandleError::Tensor {
                name: name.into(),
                reason: "missing".into(),
            })?;
        if info.shape.dims() != dims {
            return Err(CandleError::Tensor {
                name: name.into(),
                reason: format!("shape {:?}, expected {dims:?}", info.shape.dims()),
            });
        }
        self.content
            .tensor(self.reader, name, &Device::Cpu)
            .map_err(|e| CandleError::CorruptModel {
                path: self.path.to_path_buf(),
                reason: format!("reading `{name}`: {e}"),
            })
    }

    /// Whether the file holds a tensor `name`.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }
}

/// The name of the weight `s` of block `i` (`blk.{i}.{s}.weight`).
pub(crate) fn block_tensor(i: usize, s: &str) -> String {
    format!("blk.{i}.{s}.weight")
}

/// `cos` and `sin` of `pos * theta^(-2i/d)` for `pos < context_length`, `i < d / 2`: each
/// `[context_length, d / 2]`, row-major.
pub(crate) fn rope_tables(cfg: &LlamaConfig) -> (Vec<f32>, Vec<f32>) {
    let half = cfg.head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / cfg.head_dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(cfg.context_length * half);
    let mut sin = Vec::with_capacity(cfg.context_length * half);
    for pos in 0..cfg.context_length {
        for &f in &inv_freq {
            let a = pos as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}
