//! Llama-architecture GGUF weights and our own forward pass on candle ops.
//!
//! [`LlamaWeights`] holds the weights of one GGUF file behind an [`Arc`]; any number of
//! [`CandleTarget`] instances (the full model, early-exit drafts) share them, each with its own
//! KV cache.
//!
//! The forward pass, per layer `l` (hidden size `h`, `n` new tokens at positions
//! `p .. p + n`):
//!
//! ```text
//! x      = token_embd[tokens]                                   [n, h]
//! a      = rms_norm(x) * attn_norm_l
//! q,k,v  = a · W_qkv_l^T  (q, k, v fused into one matmul)       [n, heads*d], [n, kv_heads*d] x 2
//! q,k    = rope(q, k)     (adjacent pairs (2i, 2i+1), the layout llama GGUF files use)
//! K,V    = cache[0 .. p] ++ (k, v)                              [kv_heads, p + n, d]
//! o[i]   = softmax(q[i] K[0 ..= p+i]^T / sqrt(d)) V[0 ..= p+i]    grouped-query attention, row by row
//! x     += o · W_o_l^T
//! m      = rms_norm(x) * ffn_norm_l
//! x     += (silu(m · W_gate_l^T) * (m · W_up_l^T)) · W_down_l^T   (gate and up fused)
//! ```
//!
//! then `hidden = rms_norm(x) * output_norm` (`[n, h]`, kept for
//! [`speculative::HiddenStates::last_hidden`]) and `logits = hidden · output^T` (`[n, vocab]`;
//! `output.weight` falls back to `token_embd.weight` when the file ties them).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{D, DType, Device, Module, Tensor};
use speculative::DraftBlock;

use crate::engine::{DEFAULT_MAX_TREE_NODES, Engine, check_append, target_glue};
use crate::error::{CandleError, Result};
use crate::gguf::{self, LlamaConfig, TensorReader, block_tensor, open_gguf};
use crate::tree::{PendingTree, Rows, take_for_commit, tree_tokens};

/// How the layer weights are stored in memory after loading.
///
/// SmolLM2-135M-Instruct ships its layer weights as Q4_1 (and the tied embedding as Q8_0).
/// Candle's Q4_1 matmul has no SIMD path on x86, so the default re-quantises them to Q8_0.
///
/// | format | what runs | accuracy vs the exact model (100 positions) | 1-token step, c(9) |
/// |---|---|---|---|
/// | [`WeightFormat::Q8_0`] | int8 dot products, activations quantised to Q8_0 per 32 values | approximation: weights re-rounded, activations quantised; argmax agrees at 95 of 100, mean abs logit diff 0.26 | 13-34 ms, 6.2-7.6 |
/// | [`WeightFormat::F32`] | weights dequantised to f32, gemm | exact (the shipped Q4_1 weights dequantised without re-rounding) | 33-46 ms, 2.7-3.3 |
/// | [`WeightFormat::AsStored`] | Q4_1 kernel (no x86 SIMD), activations quantised | exact weights, quantised activations; 100 of 100, mean diff 0.20 | 49-128 ms, 6.9-11 |
///
/// (2-core x86 shared with other jobs, one thread, 100-token prefix; c(9) is the cost of a
/// 9-token forward relative to a 1-token one.) With Q8_0 the greedy answer to "What is the
/// capital of France?" is not "Paris" (f32 answers "The capital of France is Paris."), so
/// prefer [`WeightFormat::F32`] when output quality matters more than the single-step time.
///
/// See the crate README for measured figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WeightFormat {
    /// The default: re-quantise every quantised matrix to Q8_0 at load (about 1 s for 135M
    /// parameters). Matrices already stored as Q8_0 are kept as they are; f32/f16 matrices stay
    /// f32.
    #[default]
    Q8_0,
    /// Dequantise every matrix to f32 at load: the exact model of the file (4x the memory of
    /// Q8_0: about 0.6 GB for SmolLM2-135M).
    F32,
    /// Keep the matrices as stored in the file (Q4_1 for SmolLM2): exact weights, activations
    /// quantised per 32 values as in llama.cpp; candle's Q4_1 kernel has no x86 SIMD path, so
    /// this is the slowest option. Matrices that would have to be concatenated across
    /// different storage types are dequantised to f32.
    AsStored,
}

/// Options for [`LlamaWeights::load_with`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadOptions {
    /// In-memory weight format. Default [`WeightFormat::Q8_0`].
    pub format: WeightFormat,
    /// When `true` (the default) and neither `RAYON_NUM_THREADS` nor `CANDLE_NUM_THREADS` is
    /// set, loading sets both to `1` (see [`crate::use_single_thread_if_unset`]).
    pub single_thread: bool,
}

impl Default for LoadOptions {
    /// [`WeightFormat::Q8_0`], `single_thread` true.
    fn default() -> Self {
        LoadOptions {
            format: WeightFormat::Q8_0,
            single_thread: true,
        }
    }
}

impl LoadOptions {
    /// Default options with the given weight format.
    pub fn with_format(format: WeightFormat) -> Self {
        LoadOptions {
            format,
            ..LoadOptions::default()
        }
    }
}

struct Layer {
    attn_norm: Tensor,
    /// Fused `[q; k; v]` projection, `[(heads + 2 kv_heads) * d, h]`.
    wqkv: QMatMul,
    wo: QMatMul,
    ffn_norm: Tensor,
    /// Fused `[gate; up]` projection, `[2 ffn, h]`.
    w_gate_up: QMatMul,
    w_down: QMatMul,
}

/// The weights of a llama-architecture GGUF model, shared (via [`Arc`]) by every
/// [`CandleTarget`] built from them.
pub struct LlamaWeights {
    config: LlamaConfig,
    format: WeightFormat,
    path: PathBuf,
    device: Device,
    embed: Arc<QTensor>,
    layers: Vec<Layer>,
    output_norm: Tensor,
    head: QMatMul,
    /// `[context_length, head_dim / 2]` cos and sin tables.
    rope_cos: Tensor,
    rope_sin: Tensor,
}

impl std::fmt::Debug for LlamaWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaWeights")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Reads the layer matrices of a GGUF file in a [`WeightFormat`].
struct Loader<'a> {
    rd: TensorReader<'a>,
}

impl Loader<'_> {
    /// The f32 vector or matrix `name` of shape `dims`, dequantised.
    fn f32_tensor(&mut self, name: &str, dims: &[usize]) -> Result<Tensor> {
        let q = self.rd.qtensor(name, dims)?;
        Ok(q.dequantize(&Device::Cpu)?)
    }

    /// Block `i` of a model of `cfg` in `format` (`q`, `k`, `v` fused, `gate` and `up` fused).
    fn layer(&mut self, cfg: &LlamaConfig, i: usize, format: WeightFormat) -> Result<Layer> {
        let (h, d, ffn) = (cfg.hidden_size, cfg.head_dim, cfg.ffn_size);
        let (nh, nkv) = (cfg.n_heads, cfg.n_kv_heads);
        let p = |s: &str| block_tensor(i, s);
        let (q, k, v) = (p("attn_q"), p("attn_k"), p("attn_v"));
        let (g, u) = (p("ffn_gate"), p("ffn_up"));
        Ok(Layer {
            attn_norm: self.f32_tensor(&p("attn_norm"), &[h])?,
            wqkv: self.matmul(&[(&q, nh * d), (&k, nkv * d), (&v, nkv * d)], h, format)?,
            wo: self.matmul(&[(&p("attn_output"), h)], nh * d, format)?,
            ffn_norm: self.f32_tensor(&p("ffn_norm"), &[h])?,
            w_gate_up: self.matmul(&[(&g, ffn), (&u, ffn)], h, format)?,
            w_down: self.matmul(&[(&p("ffn_down"), h)], ffn, format)?,
        })
    }

    /// Loads the named `[rows_i, cols]` matrices, concatenates them along rows and converts
    /// the result to `format`: kept as stored when `format` allows it (one part, or block-
    /// quantised parts of one type under [`WeightFormat::AsStored`]), else dequantised (and
    /// re-quantised to Q8_0 under [`WeightFormat::Q8_0`]).
    fn matmul(
        &mut self,
        names: &[(&str, usize)],
        cols: usize,
        format: WeightFormat,
    ) -> Result<QMatMul> {
        let mut parts = Vec::with_capacity(names.len());
        for &(name, rows) in names {
            parts.push(self.rd.qtensor(name, &[rows, cols])?);
        }
        let all_q8 = parts.iter().all(|q| q.dtype() == GgmlDType::Q8_0);
        let keep = match format {
            WeightFormat::Q8_0 => all_q8,
            WeightFormat::AsStored => true,
            WeightFormat::F32 => false,
        };
        if keep && parts.len() == 1 {
            let q = parts
                .pop()
                .ok_or_else(|| CandleError::InvalidArgument("no part".into()))?;
            return Ok(QMatMul::from_arc(Arc::new(q))?);
        }
        let same_dtype = parts.iter().all(|q| q.dtype() == parts[0].dtype());
        let is_float = parts
            .iter()
            .all(|q| matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16));
        if format == WeightFormat::AsStored && same_dtype && !is_float {
            let rows: usize = names.iter().map(|&(_, r)| r).sum();
            return concat_quantized(&parts, rows, cols);
        }
        dequantized(&parts, format, is_float)
    }
}

/// Block-quantised `parts` of one type stacked along rows into one `[rows, cols]` matrix, as
/// stored. Rows of a GGUF block-quantised matrix are whole blocks, so stacking matrices along
/// rows is a concatenation of their bytes.
fn concat_quantized(parts: &[QTensor], rows: usize, cols: usize) -> Result<QMatMul> {
    let dtype = parts[0].dtype();
    let mut bytes = Vec::new();
    for q in parts {
        bytes.extend_from_slice(&q.data()?);
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), &Device::Cpu, dtype)?;
    let q = QTensor::new(storage, (rows, cols))?;
    Ok(QMatMul::from_arc(Arc::new(q))?)
}

/// `parts` dequantised and stacked along rows: f32 for [`WeightFormat::F32`] /
/// [`WeightFormat::AsStored`] and float parts (`is_float`), else re-quantised to Q8_0.
fn dequantized(parts: &[QTensor], format: WeightFormat, is_float: bool) -> Result<QMatMul> {
    let deq = parts
        .iter()
        .map(|q| q.dequantize(&Device::Cpu))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let full = if deq.len() == 1 {
        deq.into_iter()
            .next()
            .ok_or_else(|| CandleError::InvalidArgument("no part".into()))?
    } else {
        Tensor::cat(&deq, 0)?
    };
    match format {
        WeightFormat::F32 | WeightFormat::AsStored => Ok(QMatMul::Tensor(full)),
        WeightFormat::Q8_0 if is_float => Ok(QMatMul::Tensor(full)),
        WeightFormat::Q8_0 => Ok(QMatMul::from_arc(Arc::new(QTensor::quantize(
            &full,
            GgmlDType::Q8_0,
        )?))?),
    }
}

impl LlamaWeights {
    /// Loads a llama-architecture GGUF file with [`LoadOptions::default`] (Q8_0 weights,
    /// single thread).
    ///
    /// # Errors
    /// See [`LlamaWeights::load_with`].
    pub fn load(path: impl AsRef<Path>) -> Result<Arc<Self>> {
        Self::load_with(path, &LoadOptions::default())
    }

    /// Loads a llama-architecture GGUF file on the CPU.
    ///
    /// Reads the configuration from the `llama.*` metadata, the weights `token_embd`,
    /// `blk.{i}.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,ffn_up,ffn_down}`,
    /// `output_norm` and `output` (tied to `token_embd` when absent), and converts them to
    /// `opts.format`. The token embedding is kept as stored (rows are dequantised exactly on
    /// lookup).
    ///
    /// # Errors
    /// [`CandleError::ModelNotFound`] when the file does not exist (the message says to run
    /// `scripts/fetch-model.sh`), [`CandleError::CorruptModel`] when it is not a readable GGUF
    /// file or a tensor cannot be read, [`CandleError::Metadata`] / [`CandleError::Tensor`] for
    /// an unsupported architecture or missing or mis-shaped weights.
    pub fn load_with(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<Arc<Self>> {
        if opts.single_thread {
            crate::use_single_thread_if_unset();
        }
        let path = path.as_ref();
        let (content, mut reader) = open_gguf(path)?;
        let config = LlamaConfig::from_gguf(&content)?;
        let device = Device::Cpu;
        let format = opts.format;
        let h = config.hidden_size;
        let mut ld = Loader {
            rd: TensorReader {
                content: &content,
                reader: &mut reader,
                path,
            },
        };
        let embed = Arc::new(
            ld.rd
                .qtensor("token_embd.weight", &[config.vocab_size, h])?,
        );
        if h % embed.dtype().block_size() != 0 {
            return Err(CandleError::Tensor {
                name: "token_embd.weight".into(),
                reason: "hidden size not divisible by the quantisation block".into(),
            });
        }
        let layers = (0..config.n_layers)
            .map(|i| ld.layer(&config, i, format))
            .collect::<Result<Vec<_>>>()?;
        let output_norm = ld.f32_tensor("output_norm.weight", &[h])?;
        let head_name = if ld.rd.has("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let head = ld.matmul(&[(head_name, config.vocab_size)], h, format)?;
        let (rope_cos, rope_sin) = rope_tables(&config, &device)?;
        Ok(Arc::new(LlamaWeights {
            config,
            format,
            path: path.to_path_buf(),
            device,
            embed,
            layers,
            output_norm,
            head,
            rope_cos,
            rope_sin,
        }))
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The in-memory weight format chosen at load.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// The file the weights were read from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The RoPE tables of [`gguf::rope_tables`] as `[context_length, d / 2]` tensors.
fn rope_tables(cfg: &LlamaConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = cfg.head_dim / 2;
    let (cos, sin) = gguf::rope_tables(cfg);
    Ok((
        Tensor::from_vec(cos, (cfg.context_length, half), device)?,
        Tensor::from_vec(sin, (cfg.context_length, half), device)?,
    ))
}

/// `x · W^T` for `x: [n, in]`, `W: [out, in]`, giving `[n, out]`.
///
/// For f32 weights this computes `(W · x^T)^T`: gemm with the large weight matrix as the left
/// operand handles a few rows much better than the other way round (measured on 2-core x86,
/// SmolLM2-135M, 100-token prefix: c(2) 3.3 -> 2.1-2.4, c(9) 4.5 -> 3.0) and is as fast for one
/// row. Quantised weights use candle's quantised matmul.
fn linear(w: &QMatMul, x: &Tensor) -> candle_core::Result<Tensor> {
    match w {
        QMatMul::Tensor(wt) => wt.matmul(&x.t()?)?.t()?.contiguous(),
        _ => w.forward(x),
    }
}

/// Causal grouped-query attention of `n` new query rows at positions `p .. p + n`.
///
/// `q: [n, nkv, group, d]` (already scaled by `1 / sqrt(d)`), `k, v: [nkv, p + n, d]`;
/// returns `[n, nkv * group * d]`. Row `i` attends to keys `0 ..= p + i`.
///
/// Each row is computed on its own, with exactly the tensor shapes a one-token forward at that
/// position uses, so a row's arithmetic (summation order included) does not depend on how many
/// rows are in the call. This is what makes the Q8_0 path batch-invariant: one forward over
/// `n` tokens gives bit-identical logits to `n` one-token forwards (a single batched
/// `[group * n, p + n]` score matmul with a mask differed by up to 1e-6, which Q8_0 activation
/// rounding amplified to logit differences of 1-3). On 2 cores the per-row loop cost no
/// measurable time at n <= 17 next to the weight matmuls.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: usize,
    group: usize,
) -> candle_core::Result<Tensor> {
    let n = q.dim(0)?;
    let mut rows = Vec::with_capacity(n);
    for i in 0..n {
        rows.push(attend_row(q, i, k, v, p + i + 1, group)?);
    }
    cat_rows(rows)
}

/// Attention of query row `i` of `q` (`[n, nkv, group, d]`) over keys and values `0 .. len`
/// of `k`, `v` (`[nkv, >= len, d]`), as `[1, nkv * group * d]`: the per-row computation of
/// [`attention`].
fn attend_row(
    q: &Tensor,
    i: usize,
    k: &Tensor,
    v: &Tensor,
    len: usize,
    group: usize,
) -> candle_core::Result<Tensor> {
    let (_, nkv, _, d) = q.dims4()?;
    let qi = q.narrow(0, i, 1)?.reshape((nkv, group, d))?;
    let scores = qi.matmul(&k.narrow(1, 0, len)?.t()?)?; // [nkv, group, len]
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    let o = probs.matmul(&v.narrow(1, 0, len)?)?; // [nkv, group, d]
    o.reshape((1, nkv * group * d))
}

fn cat_rows(mut rows: Vec<Tensor>) -> candle_core::Result<Tensor> {
    if rows.len() == 1 {
        rows.pop()
            .ok_or_else(|| candle_core::Error::Msg("no rows".into()))
    } else {
        Tensor::cat(&rows, 0)
    }
}

/// Tree attention of the rows of `q` (`[n + 1, nkv, group, d]`, laid out by `rows`; their
/// keys and values `k`, `v`: `[nkv, n + 1, d]`) over the layer cache `cache` (the module docs of
/// `crate::tree`): in depth-first preorder, each row writes its key and value to slot
/// `p + depth` and attends to slots `0 ..= p + depth` exactly as [`attention`] does for the same
/// row of a chain of its path. Returns `[n + 1, nkv * group * d]` in row order.
fn tree_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cache: &KvCache,
    rows: &Rows,
    p: usize,
    group: usize,
) -> candle_core::Result<Tensor> {
    let mut out: Vec<Option<Tensor>> = vec![None; rows.depth.len()];
    for &r in &rows.order {
        let r = r as usize;
        let pos = p + rows.depth[r] as usize;
        cache
            .k
            .slice_set(&k.narrow(1, r, 1)?.contiguous()?, 1, pos)?;
        cache
            .v
            .slice_set(&v.narrow(1, r, 1)?.contiguous()?, 1, pos)?;
        out[r] = Some(attend_row(q, r, &cache.k, &cache.v, pos + 1, group)?);
    }
    cat_rows(out.into_iter().flatten().collect())
}

/// `x * w / sqrt(mean(x^2) + eps)` over the last dimension of `x: [n, h]`, `w: [h]`.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(w)
}

/// Rotates adjacent pairs `(2i, 2i+1)` of `x: [n, heads, d]` by the angles in `cos`/`sin`
/// (`[n, 1, d/2, 1]`).
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let (n, heads, d) = x.dims3()?;
    let x = x.reshape((n, heads, d / 2, 2))?;
    let x0 = x.narrow(3, 0, 1)?;
    let x1 = x.narrow(3, 1, 1)?;
    let r0 = (x0.broadcast_mul(cos)? - x1.broadcast_mul(sin)?)?;
    let r1 = (x0.broadcast_mul(sin)? + x1.broadcast_mul(cos)?)?;
    Tensor::cat(&[r0, r1], 3)?.reshape((n, heads, d))
}

/// One layer's key/value cache: `[kv_heads, capacity, d]` each, valid up to the model's
/// `seq_len`. The tensors are written in place, so they must never be shared between
/// instances (see [`CandleTarget::fork`]).
struct KvCache {
    k: Tensor,
    v: Tensor,
    capacity: usize,
}

/// A model instance with its own KV cache over shared [`LlamaWeights`]: the full model, or an
/// early-exit model that runs only the first `n` layers (a self-speculative draft in the style
/// of LayerSkip, Elhoushi et al. 2024) followed by the final norm and output head.
///
/// Implements [`speculative::TargetModel`]: `forward` appends tokens and writes `[n, vocab]`
/// logits for every appended position, `truncate` rolls the KV cache back, `last_hidden`
/// returns the `[n, hidden]` final hidden states (after the final norm) of the last forward.
///
/// # Batch invariance
/// With [`WeightFormat::Q8_0`] (and [`WeightFormat::AsStored`]) one forward over `n` tokens
/// gives bit-identical logits to `n` one-token forwards (tested), so greedy speculative
/// decoding reproduces plain greedy decoding exactly. With [`WeightFormat::F32`] the f32 gemm
/// sums in a row-count-dependent order: logits differ by up to about 1e-4.
///
/// [`CandleTarget::fork`] copies an instance with its KV cache (not the weights).
///
/// # Token trees
/// Implements [`speculative::TreeTarget`] like [`crate::FastTarget`] (capacity
/// [`crate::fast::DEFAULT_MAX_TREE_NODES`] nodes by default, [`CandleTarget::with_max_tree_nodes`]):
/// the root and the nodes are the rows of one forward at positions `seq_len + depth`; the rows
/// attend one by one in depth-first preorder, each after writing its key and value to slot
/// `seq_len + depth`, so it runs the attention of the same row of a chain forward of its path
/// (same tensors, same shapes). With [`WeightFormat::Q8_0`] the logits of every node equal the
/// chain's bit for bit (tested); with [`WeightFormat::F32`] they may differ as a chain forward
/// of another length would (up to about 1e-4; measured 0 on an 11-node tree). [`speculative::TreeTarget::commit_tree`] copies the
/// accepted path's keys and values (kept aside per layer) to contiguous slots. The cost: one
/// cache write per row per layer (as a chain) plus the copies of the commit.
///
/// While a tree forward is not committed, `forward` and `prefill` return an error;
/// `truncate(len)` with `len <= seq_len + 1` (as before the tree) drops it, and a longer `len`
/// commits the first nodes when they form a chain from the root (an error otherwise).
///
/// # Threads
/// Candle runs with all cores unless `RAYON_NUM_THREADS`/`CANDLE_NUM_THREADS` are set; loading
/// with [`LoadOptions::single_thread`] (the default) sets them to 1 when unset. On a 2-core
/// x86 machine (shared with other jobs) a 1-token step of SmolLM2-135M after a 100-token
/// prefix took 25 ms with one thread and 148 ms with two on Q8_0 (candle's quantised matmul
/// pool spins on a barrier per matmul), 46 ms and 38 ms on f32 (see the crate README).
pub struct CandleTarget {
    weights: Arc<LlamaWeights>,
    n_layers: usize,
    cache: Vec<Option<KvCache>>,
    seq_len: usize,
    hidden: Vec<f32>,
    /// Most nodes of one tree forward (0: no tree support).
    max_tree_nodes: usize,
    /// The uncommitted tree forward, if any.
    pending: Option<PendingTree>,
    /// Per layer, the roped keys and values of the last tree forward's rows (`[nkv, n + 1, d]`
    /// each).
    tree_kv: Vec<Option<(Tensor, Tensor)>>,
}

impl std::fmt::Debug for CandleTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleTarget")
            .field("n_layers", &self.n_layers)
            .field("seq_len", &self.seq_len)
            .field("weights", &self.weights)
            .finish_non_exhaustive()
    }
}

impl CandleTarget {
    /// Loads `path` with default options ([`WeightFormat::Q8_0`]) and returns the full model.
    ///
    /// # Errors
    /// See [`LlamaWeights::load_with`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Ok(Self::new(LlamaWeights::load(path)?))
    }

    /// The full model (all layers) over shared weights, with an empty KV cache.
    pub fn new(weights: Arc<LlamaWeights>) -> Self {
        let n = weights.config.n_layers;
        Self::with_layers(weights, n)
    }

    /// An early-exit model: runs the first `n_layers` blocks, then the final norm and output
    /// head of the full model, sharing `weights`.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] unless `1 <= n_layers <= config.n_layers`.
    pub fn early_exit(weights: Arc<LlamaWeights>, n_layers: usize) -> Result<Self> {
        let total = weights.config.n_layers;
        if n_layers == 0 || n_layers > total {
            return Err(CandleError::InvalidArgument(format!(
                "early-exit depth {n_layers} must be in 1..={total}"
            )));
        }
        Ok(Self::with_layers(weights, n_layers))
    }

    fn with_layers(weights: Arc<LlamaWeights>, n_layers: usize) -> Self {
        CandleTarget {
            weights,
            n_layers,
            cache: (0..n_layers).map(|_| None).collect(),
            seq_len: 0,
            hidden: Vec::new(),
            max_tree_nodes: DEFAULT_MAX_TREE_NODES,
            pending: None,
            tree_kv: vec![None; n_layers],
        }
    }

    /// Sets the most nodes one tree forward takes
    /// ([`speculative::TreeTarget::max_tree_nodes`]; default
    /// [`crate::fast::DEFAULT_MAX_TREE_NODES`]). `0` turns tree support off
    /// ([`speculative::TargetModel::tree`] returns `None`).
    pub fn with_max_tree_nodes(mut self, max_nodes: usize) -> Self {
        self.max_tree_nodes = max_nodes;
        self
    }

    /// A copy of this instance: same weights (shared), a deep copy of the KV cache.
    ///
    /// # Errors
    /// [`CandleError::Candle`] if copying a cache tensor fails.
    pub fn fork(&self) -> Result<Self> {
        let mut cache = Vec::with_capacity(self.cache.len());
        for c in &self.cache {
            cache.push(match c {
                Some(c) => Some(KvCache {
                    k: c.k.copy()?,
                    v: c.v.copy()?,
                    capacity: c.capacity,
                }),
                None => None,
            });
        }
        // The kept-aside tree keys and values are never written in place: sharing is safe.
        Ok(CandleTarget {
            weights: Arc::clone(&self.weights),
            n_layers: self.n_layers,
            cache,
            seq_len: self.seq_len,
            hidden: self.hidden.clone(),
            max_tree_nodes: self.max_tree_nodes,
            pending: self.pending.clone(),
            tree_kv: self.tree_kv.clone(),
        })
    }

    /// The keys and values of positions `0 .. seq_len` of every layer, `(k, v)` each
    /// `[kv_heads, seq_len, d]` flattened (keys after RoPE). For tests that compare caches.
    ///
    /// # Errors
    /// [`CandleError::Candle`] if reading a tensor fails.
    #[doc(hidden)]
    pub fn kv_snapshot(&self) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        let mut out = Vec::with_capacity(self.n_layers);
        for c in &self.cache[..self.n_layers] {
            out.push(match c {
                Some(c) if self.seq_len > 0 => {
                    let read = |t: &Tensor| -> Result<Vec<f32>> {
                        Ok(t.narrow(1, 0, self.seq_len)?
                            .flatten_all()?
                            .to_vec1::<f32>()?)
                    };
                    (read(&c.k)?, read(&c.v)?)
                }
                _ => (Vec::new(), Vec::new()),
            });
        }
        Ok(out)
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.weights
    }

    /// Number of transformer blocks this instance runs (all of them for [`CandleTarget::new`]).
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Drops the whole KV cache (same as `truncate(0)`, but also frees its memory).
    pub fn reset(&mut self) {
        self.cache.iter_mut().for_each(|c| *c = None);
        self.seq_len = 0;
        self.hidden.clear();
        self.pending = None;
        self.tree_kv.iter_mut().for_each(|t| *t = None);
    }

    /// Appends `tokens` and returns the `[n, vocab]` logits as a candle tensor, keeping the
    /// `[n, hidden]` final hidden states for [`speculative::HiddenStates::last_hidden`].
    ///
    /// On error the sequence is left as it was before the call.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] for an empty slice or while a tree forward is not
    /// committed, [`CandleError::TokenOutOfVocab`], [`CandleError::ContextOverflow`] when
    /// `seq_len + n > max_context`, and [`CandleError::Candle`] when a tensor operation fails.
    pub fn forward_tensor(&mut self, tokens: &[u32]) -> Result<Tensor> {
        self.append(tokens, true)?
            .ok_or_else(|| CandleError::InvalidArgument("forward produced no logits".into()))
    }

    /// Appends `tokens` like [`CandleTarget::forward_tensor`] but skips the output head (no
    /// logits; the final hidden states are still kept). The KV cache afterwards is the one
    /// `forward_tensor` leaves. Used for the prompt prefill.
    ///
    /// # Errors
    /// As [`CandleTarget::forward_tensor`].
    pub fn prefill_tokens(&mut self, tokens: &[u32]) -> Result<()> {
        self.append(tokens, false).map(|_| ())
    }

    /// Validates `tokens`, then runs the blocks (and the head when `head`), restoring the
    /// sequence length on error.
    fn append(&mut self, tokens: &[u32], head: bool) -> Result<Option<Tensor>> {
        self.append_rows(tokens, None, head)
    }

    /// [`CandleTarget::append`] with a row layout: `Some` runs a tree forward (the module docs
    /// of `crate::tree`).
    fn append_rows(
        &mut self,
        tokens: &[u32],
        layout: Option<&Rows>,
        head: bool,
    ) -> Result<Option<Tensor>> {
        check_append(
            &self.weights.config,
            self.pending.is_some(),
            self.seq_len,
            tokens,
        )?;
        let saved_len = self.seq_len;
        let out = self.run(tokens, layout, head);
        if out.is_err() {
            // Positions past `saved_len` may hold partial writes; they are simply not valid.
            self.seq_len = saved_len;
        }
        out
    }

    /// Runs the rows `tokens` at positions `seq_len + depth` (`depth = i` without `layout`);
    /// `layout` selects tree attention and keeps every row's keys and values in `tree_kv`.
    fn run(&mut self, tokens: &[u32], layout: Option<&Rows>, head: bool) -> Result<Option<Tensor>> {
        let w = Arc::clone(&self.weights);
        let cfg = &w.config;
        let n = tokens.len();
        let p = self.seq_len;
        let total = p + n;
        let (nh, nkv, d) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let group = nh / nkv;
        let ids = Tensor::from_slice(tokens, n, &w.device)?;
        let mut x = w.embed.embedding(&ids)?; // [n, h]
        let (cos, sin) = match layout {
            None => (w.rope_cos.narrow(0, p, n)?, w.rope_sin.narrow(0, p, n)?),
            Some(rows) => {
                let pos: Vec<u32> = rows.depth.iter().map(|&dep| (p as u32) + dep).collect();
                let pos = Tensor::from_vec(pos, n, &w.device)?;
                (
                    w.rope_cos.index_select(&pos, 0)?,
                    w.rope_sin.index_select(&pos, 0)?,
                )
            }
        };
        let cos = cos.reshape((n, 1, d / 2, 1))?;
        let sin = sin.reshape((n, 1, d / 2, 1))?;
        let scale = 1.0 / (d as f64).sqrt();
        for (li, layer) in w.layers[..self.n_layers].iter().enumerate() {
            let a = rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let qkv = linear(&layer.wqkv, &a)?; // [n, (nh + 2 nkv) d]
            let q = qkv.narrow(1, 0, nh * d)?.reshape((n, nh, d))?;
            let k = qkv.narrow(1, nh * d, nkv * d)?.reshape((n, nkv, d))?;
            let v = qkv
                .narrow(1, (nh + nkv) * d, nkv * d)?
                .reshape((n, nkv, d))?;
            let q = (rope(&q, &cos, &sin)? * scale)?;
            let k = rope(&k, &cos, &sin)?;
            let k = k.transpose(0, 1)?.contiguous()?; // [nkv, n, d]
            let v = v.transpose(0, 1)?.contiguous()?;
            // Query head h uses kv head h / group: [n, nh, d] -> [n, nkv, group, d].
            let q = q.reshape((n, nkv, group, d))?;
            let o = match layout {
                None => {
                    let cache = self.append_kv(li, &k, &v, p, total)?;
                    let k_all = cache.k.narrow(1, 0, total)?; // [nkv, total, d]
                    let v_all = cache.v.narrow(1, 0, total)?;
                    attention(&q, &k_all, &v_all, p, group)? // [n, nh * d]
                }
                Some(rows) => {
                    let cache = self.reserve_kv(li, p, total)?;
                    let o = tree_attention(&q, &k, &v, cache, rows, p, group)?;
                    self.tree_kv[li] = Some((k, v));
                    o
                }
            };
            x = (x + linear(&layer.wo, &o)?)?;
            let m = rms_norm(&x, &layer.ffn_norm, cfg.rms_eps)?;
            let gu = linear(&layer.w_gate_up, &m)?; // [n, 2 ffn]
            let gate = gu.narrow(1, 0, cfg.ffn_size)?;
            let up = gu.narrow(1, cfg.ffn_size, cfg.ffn_size)?;
            let act = (gate.silu()? * up)?;
            x = (x + linear(&layer.w_down, &act)?)?;
        }
        let hidden = rms_norm(&x, &w.output_norm, cfg.rms_eps)?;
        let logits = if head {
            Some(linear(&w.head, &hidden)?)
        } else {
            None
        };
        self.hidden = hidden.flatten_all()?.to_vec1::<f32>()?;
        self.seq_len = total;
        Ok(logits)
    }

    /// Writes `k`, `v` (`[nkv, n, d]`) at positions `p ..` of layer `li`, growing the cache
    /// when needed, and returns the cache.
    fn append_kv(
        &mut self,
        li: usize,
        k: &Tensor,
        v: &Tensor,
        p: usize,
        total: usize,
    ) -> Result<&KvCache> {
        let cache = self.reserve_kv(li, p, total)?;
        cache.k.slice_set(k, 1, p)?;
        cache.v.slice_set(v, 1, p)?;
        Ok(cache)
    }

    /// Grows layer `li`'s cache to hold `total` positions (keeping the first `p`) and returns
    /// it.
    fn reserve_kv(&mut self, li: usize, p: usize, total: usize) -> Result<&KvCache> {
        let cfg = &self.weights.config;
        let (nkv, d) = (cfg.n_kv_heads, cfg.head_dim);
        let need_grow = match &self.cache[li] {
            Some(c) => c.capacity < total,
            None => true,
        };
        if need_grow {
            let capacity = total
                .max(256)
                .max(self.cache[li].as_ref().map_or(0, |c| c.capacity * 2))
                .min(cfg.context_length)
                .max(total);
            let dev = &self.weights.device;
            let nk = Tensor::zeros((nkv, capacity, d), DType::F32, dev)?;
            let nv = Tensor::zeros((nkv, capacity, d), DType::F32, dev)?;
            if let Some(old) = &self.cache[li]
                && p > 0
            {
                nk.slice_set(&old.k.narrow(1, 0, p)?.contiguous()?, 1, 0)?;
                nv.slice_set(&old.v.narrow(1, 0, p)?.contiguous()?, 1, 0)?;
            }
            self.cache[li] = Some(KvCache {
                k: nk,
                v: nv,
                capacity,
            });
        }
        self.cache[li]
            .as_ref()
            .ok_or_else(|| CandleError::InvalidArgument("KV cache missing".into()))
    }

    /// Appends the root and the nodes of a valid `block` as a tree forward (type docs, "Token
    /// trees") and returns the `[n + 1, vocab]` logits; the tree is pending afterwards. On
    /// error the sequence is unchanged.
    fn forward_tree_tensor(&mut self, root: u32, block: &DraftBlock<'_>) -> Result<Tensor> {
        let tokens = tree_tokens(root, block);
        let rows = Rows::of(block);
        let base = self.seq_len;
        let logits = self
            .append_rows(&tokens, Some(&rows), true)?
            .ok_or_else(|| CandleError::InvalidArgument("forward produced no logits".into()))?;
        self.pending = Some(PendingTree::new(base, block, &rows));
        Ok(logits)
    }

    /// Keeps the root and the nodes `path` (a path of `t`'s block): copies the kept rows' keys
    /// and values to slots `base + 1 ..` where they are not there already.
    fn commit_rows(&mut self, t: &PendingTree, path: &[u32]) -> Result<()> {
        for (cache, kv) in self.cache[..self.n_layers].iter().zip(&self.tree_kv) {
            let (Some(cache), Some((k, v))) = (cache, kv) else {
                return Err(CandleError::InvalidArgument(
                    "tree keys and values missing".into(),
                ));
            };
            for (j, &node) in path.iter().enumerate() {
                let row = node as usize + 1;
                if !t.in_place(j, row) {
                    let pos = t.base + 1 + j;
                    cache
                        .k
                        .slice_set(&k.narrow(1, row, 1)?.contiguous()?, 1, pos)?;
                    cache
                        .v
                        .slice_set(&v.narrow(1, row, 1)?.contiguous()?, 1, pos)?;
                }
            }
        }
        self.seq_len = t.base + 1 + path.len();
        Ok(())
    }

    /// Drops every position at index `>= len`. With a tree forward not committed: `len <=
    /// base + 1` (`base` the length before the tree) drops the tree; a longer `len` keeps the
    /// root and the first `len - base - 1` nodes when they form a chain from the root (as
    /// [`commit_tree`](speculative::TreeTarget::commit_tree) of that path).
    ///
    /// # Errors
    /// [`CandleError::TruncateBeyondEnd`] when `len > seq_len`; [`CandleError::InvalidArgument`]
    /// when `len` cuts into an uncommitted tree whose first nodes are not a chain (the
    /// sequence is then unchanged); [`CandleError::Candle`] if copying kept entries fails (the
    /// tree is then dropped and the sequence ends with the root).
    pub fn truncate_to(&mut self, len: usize) -> Result<()> {
        if len > self.seq_len {
            return Err(CandleError::TruncateBeyondEnd {
                len,
                seq_len: self.seq_len,
            });
        }
        if let Some(t) = self.pending.take() {
            match t.truncation(len) {
                Ok(None) => {}
                Ok(Some(path)) => {
                    let out = self.commit_rows(&t, &path);
                    if out.is_err() {
                        self.seq_len = t.base + 1;
                    }
                    return out;
                }
                Err(e) => {
                    self.pending = Some(t);
                    return Err(e);
                }
            }
        }
        self.seq_len = len;
        Ok(())
    }
}

impl Engine for CandleTarget {
    fn model_config(&self) -> &LlamaConfig {
        &self.weights.config
    }

    fn positions(&self) -> usize {
        self.seq_len
    }

    fn tree_capacity(&self) -> usize {
        self.max_tree_nodes
    }

    fn append_logits(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        let t = self.forward_tensor(tokens)?;
        logits.extend_from_slice(&t.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }

    fn append_prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.prefill_tokens(tokens)
    }

    fn truncate_positions(&mut self, len: usize) -> Result<()> {
        self.truncate_to(len)
    }

    fn append_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let t = self.forward_tree_tensor(root, block)?;
        logits.extend_from_slice(&t.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }

    fn commit_path(&mut self, path: &[u32]) -> speculative::Result<()> {
        let t = take_for_commit(&mut self.pending, path, |t| t)?;
        self.commit_rows(&t, path).map_err(|e| {
            // Slots past the root may hold part of the path: keep only what is certain.
            self.seq_len = t.base + 1;
            e.into()
        })
    }
}

target_glue!(CandleTarget, hidden_states = hidden);
