//! A batch-invariant llama forward pass in plain Rust on our own kernels.
//!
//! Same model as [`crate::CandleTarget`] (see `model.rs` for the layer equations; RoPE on
//! adjacent pairs `(2i, 2i + 1)` with angles `pos · theta^(-2i/d)`, grouped-query attention,
//! SiLU-gated MLP, tied output head), computed so that **the arithmetic of one row never
//! depends on the other rows of the call**:
//!
//! - matmuls: [`Q8Matrix::matmul`] / [`F32Matrix::matmul`] (fixed per-output accumulation);
//! - RMSNorm sums of squares: 8 running partial sums over the index modulo 8, combined in a fixed
//!   tree, then the tail in order ([`dot`]);
//! - attention: query row `i` (position `p + i`) attends to positions `0 ..= p + i` with the
//!   fixed-order arithmetic of `ops::attend` (keys stored transposed so that 16 positions are
//!   scored per AVX-512 instruction; fused multiply-adds in a fixed chain order; a fast `exp`
//!   accurate to about 1 ulp; an AVX-512 kernel and a portable one with the same bits), which
//!   depends only on the row's own position; the keys and values of the new rows come from the
//!   same per-row code;
//! - SiLU: `g / (1 + exp(-g))` with the same `exp`, element-wise.
//!
//! So a forward over `[t, d1 .. dk]` gives, bit for bit, the logits of `k + 1` single-token
//! forwards, and greedy speculative decoding emits exactly the plain greedy tokens.
//!
//! A token-tree forward ([`speculative::TreeTarget`]) runs the root and the nodes as the rows
//! of one such forward, each at position `seq_len + depth`, and lets every row attend in
//! depth-first order once its ancestors' keys and values sit in the slots a chain would have
//! put them in ([`FastTarget`], section "Token trees"): the logits of every node equal, bit for
//! bit, those of a chain forward of its path.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use candle_core::quantized::GgmlDType;
use speculative::{DraftBlock, FeatureLayer, FeatureLayout};

use super::f32mat::F32Matrix;
use super::ops::{self, KvCache};
use super::q8::{KernelPath, Q8Act, Q8Matrix};
pub use crate::engine::DEFAULT_MAX_TREE_NODES;
use crate::engine::{Engine, check_append, target_glue};
use crate::error::{CandleError, Result};
use crate::gguf::{self, LlamaConfig, TensorReader, block_tensor, open_gguf};
use crate::tree::{PendingTree, Rows, take_for_commit, tree_tokens};

/// In-memory weight format of [`FastWeights`].
///
/// | format | weights | activations | accuracy |
/// |---|---|---|---|
/// | [`FastFormat::Q8`] | our 8-bit blocks (32 values, f32 scale); Q8_0 tensors of the file (the tied embedding/head) imported exactly, Q4_1 tensors dequantised and re-quantised | quantised to 8 bits per 32 values before every matmul | an approximation of the shipped model |
/// | [`FastFormat::F32`] | every tensor dequantised to f32 without re-rounding | f32 | the exact shipped model (up to f32 summation order) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FastFormat {
    /// 8-bit blocks and int8 dot products (default, fastest).
    #[default]
    Q8,
    /// f32 weights (about 4x the memory of `Q8`; the exact model).
    F32,
}

/// One weight matrix in either format.
#[derive(Debug, Clone)]
pub(crate) enum Matrix {
    Q8(Q8Matrix),
    F32(F32Matrix),
}

impl Matrix {
    pub(crate) fn from_f32(
        rows: usize,
        cols: usize,
        data: &[f32],
        format: FastFormat,
    ) -> Result<Self> {
        Ok(match format {
            FastFormat::Q8 => Matrix::Q8(Q8Matrix::quantize(rows, cols, data)?),
            FastFormat::F32 => Matrix::F32(F32Matrix::new(rows, cols, data)?),
        })
    }

    pub(crate) fn row(&self, j: usize, out: &mut [f32]) {
        match self {
            Matrix::Q8(m) => m.dequantize_row(j, out),
            Matrix::F32(m) => m.row(j, out),
        }
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        match self {
            Matrix::Q8(m) => m.memory_bytes(),
            Matrix::F32(m) => m.memory_bytes(),
        }
    }

    /// Input width.
    pub(crate) fn cols(&self) -> usize {
        match self {
            Matrix::Q8(m) => m.cols(),
            Matrix::F32(m) => m.cols(),
        }
    }

    pub(crate) fn matmul(&self, x: &[f32], out: &mut Vec<f32>, s: &mut Exec) -> Result<()> {
        match self {
            Matrix::Q8(m) => {
                s.act.quantize(x, m.cols())?;
                m.matmul(&s.act, out, s.path, s.threads)
            }
            Matrix::F32(m) => m.matmul(x, out, s.threads),
        }
    }
}

/// Kernel choice and reusable quantised-activation buffer.
#[derive(Debug)]
pub(crate) struct Exec {
    pub(crate) path: KernelPath,
    /// Whether the AVX-512 kernels of [`ops`] run (not with [`KernelPath::Scalar`]).
    pub(crate) simd: bool,
    pub(crate) threads: usize,
    pub(crate) act: Q8Act,
}

impl Exec {
    /// The fastest kernel path of this CPU, one thread.
    pub(crate) fn detect() -> Self {
        Exec {
            path: KernelPath::detect(),
            simd: ops::simd_available(),
            threads: 1,
            act: Q8Act::default(),
        }
    }

    /// The same settings with a fresh activation buffer.
    pub(crate) fn fork(&self) -> Self {
        Exec {
            path: self.path,
            simd: self.simd,
            threads: self.threads,
            act: Q8Act::default(),
        }
    }

    /// Chooses the int8 kernel path (the AVX-512 ops of [`ops`] run unless `path` is
    /// [`KernelPath::Scalar`]).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when this CPU cannot run `path`.
    pub(crate) fn set_kernel(&mut self, path: KernelPath) -> Result<()> {
        if !path.is_available() {
            return Err(CandleError::InvalidArgument(format!(
                "kernel path {path:?} is not available on this CPU"
            )));
        }
        self.path = path;
        self.simd = path != KernelPath::Scalar && ops::simd_available();
        Ok(())
    }
}

#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    /// Fused `[q; k; v]`, `[(heads + 2 kv_heads) d, h]`.
    pub(crate) wqkv: Matrix,
    pub(crate) wo: Matrix,
    pub(crate) ffn_norm: Vec<f32>,
    /// Fused `[gate; up]`, `[2 ffn, h]`.
    pub(crate) w_gate_up: Matrix,
    pub(crate) w_down: Matrix,
}

/// The weights of a llama GGUF model in a [`FastFormat`], shared (via [`Arc`]) by every
/// [`FastTarget`] built from them.
#[derive(Debug)]
pub struct FastWeights {
    pub(crate) config: LlamaConfig,
    pub(crate) format: FastFormat,
    path: Option<PathBuf>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) output_norm: Vec<f32>,
    pub(crate) head: Matrix,
    /// `None` when the embedding is tied to the head.
    pub(crate) embed: Option<Matrix>,
    /// `[context_length, head_dim / 2]`.
    pub(crate) rope_cos: Vec<f32>,
    pub(crate) rope_sin: Vec<f32>,
}

/// Sizes and seed of a random-weight model ([`FastWeights::random`]), for tests and benches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RandomSpec {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Hidden size (a multiple of `n_heads`; `hidden / n_heads` must be even).
    pub hidden: usize,
    /// MLP inner size.
    pub ffn: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Maximum context in tokens.
    pub context: usize,
    /// Seed of the weights.
    pub seed: u64,
}

impl Default for RandomSpec {
    /// A tiny model: 2 layers, hidden 96, MLP 160, 6 query / 2 KV heads, vocabulary 301,
    /// context 256, seed 1.
    fn default() -> Self {
        RandomSpec {
            n_layers: 2,
            hidden: 96,
            ffn: 160,
            n_heads: 6,
            n_kv_heads: 2,
            vocab: 301,
            context: 256,
            seed: 1,
        }
    }
}

/// The f32 vector or matrix `name` of shape `dims`, dequantised, flattened.
fn f32s(rd: &mut TensorReader<'_>, name: &str, dims: &[usize]) -> Result<Vec<f32>> {
    let q = rd.qtensor(name, dims)?;
    Ok(q.dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Loads `[rows_i, cols]` tensors stacked along rows. With [`FastFormat::Q8`], when every
/// part is Q8_0 the blocks are imported exactly; otherwise the parts are dequantised to
/// f32 (and re-quantised for `Q8`).
fn matrix(
    rd: &mut TensorReader<'_>,
    names: &[(&str, usize)],
    cols: usize,
    format: FastFormat,
) -> Result<Matrix> {
    let rows: usize = names.iter().map(|&(_, r)| r).sum();
    let mut parts = Vec::with_capacity(names.len());
    for &(name, r) in names {
        parts.push(rd.qtensor(name, &[r, cols])?);
    }
    if format == FastFormat::Q8 && parts.iter().all(|q| q.dtype() == GgmlDType::Q8_0) {
        let mut bytes = Vec::new();
        for q in &parts {
            bytes.extend_from_slice(&q.data()?);
        }
        return Ok(Matrix::Q8(Q8Matrix::from_ggml_q8_0(rows, cols, &bytes)?));
    }
    let mut data = Vec::with_capacity(rows * cols);
    for q in &parts {
        data.extend(
            q.dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
    }
    Matrix::from_f32(rows, cols, &data, format)
}

/// Block `i` of a model of `cfg` in `format` (`q`, `k`, `v` fused, `gate` and `up` fused).
fn layer(
    rd: &mut TensorReader<'_>,
    cfg: &LlamaConfig,
    i: usize,
    format: FastFormat,
) -> Result<Layer> {
    let (h, d, ffn) = (cfg.hidden_size, cfg.head_dim, cfg.ffn_size);
    let (nh, nkv) = (cfg.n_heads, cfg.n_kv_heads);
    let p = |s: &str| block_tensor(i, s);
    let (q, k, v) = (p("attn_q"), p("attn_k"), p("attn_v"));
    let (g, u) = (p("ffn_gate"), p("ffn_up"));
    Ok(Layer {
        attn_norm: f32s(rd, &p("attn_norm"), &[h])?,
        wqkv: matrix(rd, &[(&q, nh * d), (&k, nkv * d), (&v, nkv * d)], h, format)?,
        wo: matrix(rd, &[(&p("attn_output"), h)], nh * d, format)?,
        ffn_norm: f32s(rd, &p("ffn_norm"), &[h])?,
        w_gate_up: matrix(rd, &[(&g, ffn), (&u, ffn)], h, format)?,
        w_down: matrix(rd, &[(&p("ffn_down"), h)], ffn, format)?,
    })
}

impl FastWeights {
    /// Loads a llama-architecture GGUF file (the tensors listed in
    /// [`crate::LlamaWeights::load_with`]) into `format`. Takes about 1-2 s for SmolLM2-135M.
    ///
    /// # Errors
    /// [`CandleError::ModelNotFound`] when the file does not exist, [`CandleError::CorruptModel`]
    /// when it cannot be read, [`CandleError::Metadata`] / [`CandleError::Tensor`] for an
    /// unsupported architecture or missing or mis-shaped weights, and
    /// [`CandleError::InvalidArgument`] when a Q8_0 tensor's width is not a multiple of 32.
    pub fn load(path: impl AsRef<Path>, format: FastFormat) -> Result<Arc<Self>> {
        let path = path.as_ref();
        let (content, mut reader) = open_gguf(path)?;
        let config = LlamaConfig::from_gguf(&content)?;
        let mut rd = TensorReader {
            content: &content,
            reader: &mut reader,
            path,
        };
        let h = config.hidden_size;
        let layers = (0..config.n_layers)
            .map(|i| layer(&mut rd, &config, i, format))
            .collect::<Result<Vec<_>>>()?;
        let output_norm = f32s(&mut rd, "output_norm.weight", &[h])?;
        let tied = !rd.has("output.weight");
        let head_name = if tied {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let head = matrix(&mut rd, &[(head_name, config.vocab_size)], h, format)?;
        let embed = if tied {
            None
        } else {
            Some(matrix(
                &mut rd,
                &[("token_embd.weight", config.vocab_size)],
                h,
                format,
            )?)
        };
        let (rope_cos, rope_sin) = gguf::rope_tables(&config);
        Ok(Arc::new(FastWeights {
            config,
            format,
            path: Some(path.to_path_buf()),
            layers,
            output_norm,
            head,
            embed,
            rope_cos,
            rope_sin,
        }))
    }

    /// A model with uniformly random weights (scaled by `1 / sqrt(fan_in)`, norms near 1,
    /// tied embedding), for tests and benches.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] for a zero size, `hidden` not divisible by `n_heads`,
    /// an odd head width or `n_heads` not divisible by `n_kv_heads`.
    pub fn random(spec: &RandomSpec, format: FastFormat) -> Result<Arc<Self>> {
        let s = spec;
        if [
            s.n_layers,
            s.hidden,
            s.ffn,
            s.n_heads,
            s.n_kv_heads,
            s.vocab,
            s.context,
        ]
        .contains(&0)
            || !s.hidden.is_multiple_of(s.n_heads)
            || !(s.hidden / s.n_heads).is_multiple_of(2)
            || !s.n_heads.is_multiple_of(s.n_kv_heads)
        {
            return Err(CandleError::InvalidArgument(format!(
                "inconsistent random model sizes {spec:?}"
            )));
        }
        let config = LlamaConfig {
            n_layers: s.n_layers,
            hidden_size: s.hidden,
            ffn_size: s.ffn,
            n_heads: s.n_heads,
            n_kv_heads: s.n_kv_heads,
            head_dim: s.hidden / s.n_heads,
            context_length: s.context,
            rope_theta: 10_000.0,
            rms_eps: 1e-5,
            vocab_size: s.vocab,
        };
        let mut state = s.seed ^ 0x9e37_79b9_7f4a_7c15;
        let mut uni = move || {
            // splitmix64
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let (h, d, f) = (s.hidden, config.head_dim, s.ffn);
        let mut mat = |rows: usize, cols: usize| {
            let sc = 1.0 / (cols as f32).sqrt();
            let data: Vec<f32> = (0..rows * cols).map(|_| uni() * sc).collect();
            Matrix::from_f32(rows, cols, &data, format)
        };
        let mut layers = Vec::with_capacity(s.n_layers);
        for _ in 0..s.n_layers {
            layers.push(Layer {
                attn_norm: Vec::new(),
                wqkv: mat((s.n_heads + 2 * s.n_kv_heads) * d, h)?,
                wo: mat(h, s.n_heads * d)?,
                ffn_norm: Vec::new(),
                w_gate_up: mat(2 * f, h)?,
                w_down: mat(h, f)?,
            });
        }
        let head = mat(s.vocab, h)?;
        let mut norm = |len: usize| (0..len).map(|_| 1.0 + 0.1 * uni()).collect::<Vec<f32>>();
        for l in &mut layers {
            l.attn_norm = norm(h);
            l.ffn_norm = norm(h);
        }
        let output_norm = norm(h);
        let (rope_cos, rope_sin) = gguf::rope_tables(&config);
        Ok(Arc::new(FastWeights {
            config,
            format,
            path: None,
            layers,
            output_norm,
            head,
            embed: None,
            rope_cos,
            rope_sin,
        }))
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The in-memory weight format.
    pub fn format(&self) -> FastFormat {
        self.format
    }

    /// The file the weights came from (`None` for [`FastWeights::random`]).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Writes the embedding of `token` (`[h]`, dequantised from the in-memory format; the
    /// output head's row when the embedding is tied) into `out`.
    ///
    /// # Errors
    /// [`CandleError::TokenOutOfVocab`]; [`CandleError::InvalidArgument`] when `out` is not
    /// `[h]`.
    pub fn embedding_row(&self, token: u32, out: &mut [f32]) -> Result<()> {
        self.check_row(token, out.len())?;
        self.embed
            .as_ref()
            .unwrap_or(&self.head)
            .row(token as usize, out);
        Ok(())
    }

    /// Writes the output-head row of `token` (`[h]`, dequantised; the target's logit of
    /// `token` is its dot product with the final hidden state) into `out`.
    ///
    /// # Errors
    /// As [`FastWeights::embedding_row`].
    pub fn output_row(&self, token: u32, out: &mut [f32]) -> Result<()> {
        self.check_row(token, out.len())?;
        self.head.row(token as usize, out);
        Ok(())
    }

    fn check_row(&self, token: u32, len: usize) -> Result<()> {
        let c = &self.config;
        if token as usize >= c.vocab_size {
            return Err(CandleError::TokenOutOfVocab {
                token,
                vocab_size: c.vocab_size,
            });
        }
        if len != c.hidden_size {
            return Err(CandleError::InvalidArgument(format!(
                "a row of {len} floats for hidden size {}",
                c.hidden_size
            )));
        }
        Ok(())
    }

    /// Bytes of matrix weights held in memory (norms and RoPE tables not counted).
    pub fn memory_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.wqkv.memory_bytes()
                    + l.wo.memory_bytes()
                    + l.w_gate_up.memory_bytes()
                    + l.w_down.memory_bytes()
            })
            .sum();
        layers + self.head.memory_bytes() + self.embed.as_ref().map_or(0, Matrix::memory_bytes)
    }
}

/// `Σ a[i] · b[i]` in a fixed order: 8 partial sums over `i mod 8` (element-wise, so the
/// compiler may vectorise it without changing a bit), combined as
/// `((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))`, then the tail `i >= 8 ⌊len/8⌋` in
/// order. Panics never; extra elements of the longer slice are ignored.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let mut s = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            s[i] += x[i] * y[i];
        }
    }
    let mut t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        t += x * y;
    }
    t
}

/// RMSNorm of each row of `x` (`[n, h]`, `h = w.len()`) into `out`:
/// `x · w / sqrt(mean(x²) + eps)` with the sum of squares from [`dot`].
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut Vec<f32>) {
    let h = w.len();
    out.clear();
    for row in x.chunks_exact(h) {
        let ms = dot(row, row) / h as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, g)| (v * inv) * g));
    }
}

/// Scratch buffers of [`ffn_residual`].
pub(crate) struct FfnBufs<'a> {
    pub(crate) a: &'a mut Vec<f32>,
    pub(crate) gu: &'a mut Vec<f32>,
    pub(crate) act: &'a mut Vec<f32>,
    pub(crate) proj: &'a mut Vec<f32>,
}

/// The MLP half of a block on the rows of `x` (`[n, h]`), in place:
/// `x += down(silu(gate(a)) * up(a))` with `a = rms_norm(x)`. Row-wise arithmetic only.
pub(crate) fn ffn_residual(
    layer: &Layer,
    x: &mut [f32],
    eps: f32,
    b: &mut FfnBufs<'_>,
    exec: &mut Exec,
) -> Result<()> {
    rms_norm(x, &layer.ffn_norm, eps, b.a);
    layer.w_gate_up.matmul(b.a, b.gu, exec)?;
    let f = layer.w_down.cols();
    let n = b.a.len() / layer.ffn_norm.len().max(1);
    b.act.clear();
    b.act.resize(n * f, 0.0);
    for (row, out) in b.gu.chunks_exact(2 * f).zip(b.act.chunks_exact_mut(f)) {
        let (g, u) = row.split_at(f);
        ops::silu_mul(g, u, out, exec.simd);
    }
    layer.w_down.matmul(b.act, b.proj, exec)?;
    x.iter_mut()
        .zip(b.proj.iter())
        .for_each(|(xv, pv)| *xv += pv);
    Ok(())
}

/// Rotates adjacent pairs of one head vector `v` (`[d]`) by the angles of one position.
#[inline]
pub(crate) fn rope(v: &mut [f32], cos: &[f32], sin: &[f32]) {
    for ((pair, &c), &s) in v.chunks_exact_mut(2).zip(cos).zip(sin) {
        let (x0, x1) = (pair[0], pair[1]);
        pair[0] = x0 * c - x1 * s;
        pair[1] = x0 * s + x1 * c;
    }
}

/// Causal grouped-query attention of the `n` new query rows (already roped and scaled, in
/// `qkv`, `[n, width]`, their keys and values already in `cache`) into `o` (`[n, nh d]`):
/// row `i` attends to positions `0 ..= p + i` ([`ops::attend`], whose arithmetic depends only
/// on the row's own position).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    cache: &KvCache,
    qkv: &[f32],
    (n, p, nh, nkv, d, width): (usize, usize, usize, usize, usize, usize),
    o: &mut Vec<f32>,
    scores: &mut Vec<f32>,
    simd: bool,
) {
    let group = nh / nkv;
    o.clear();
    o.resize(n * nh * d, 0.0);
    for i in 0..n {
        for kvh in 0..nkv {
            let (h0, h1) = (kvh * group, (kvh + 1) * group);
            let q = &qkv[i * width + h0 * d..i * width + h1 * d];
            let out = &mut o[(i * nh + h0) * d..(i * nh + h1) * d];
            ops::attend(cache, kvh, q, p + i + 1, scores, out, simd);
        }
    }
}

/// Tree attention of the `n` rows of `qkv` (`[n, width]`, roped and scaled, laid out by
/// `rows`) into `o` (`[n, nh d]`): in the preorder of `rows`, each row writes its key and value
/// at slot `p + depth` of `cache`, then attends to slots `0 ..= p + depth` with [`ops::attend`].
/// Those slots then hold the committed context, the root and the row's ancestors, in position
/// order, so each row's arithmetic is exactly that of the same row in a chain forward of its
/// path (keys in the same order, same length).
#[allow(clippy::too_many_arguments)]
fn tree_attention(
    cache: &mut KvCache,
    qkv: &[f32],
    rows: &Rows,
    (p, nh, nkv, d, width): (usize, usize, usize, usize, usize),
    o: &mut Vec<f32>,
    scores: &mut Vec<f32>,
    simd: bool,
) {
    let (group, kvd) = (nh / nkv, nkv * d);
    let n = rows.depth.len();
    o.clear();
    o.resize(n * nh * d, 0.0);
    for &r in &rows.order {
        let i = r as usize;
        let pos = p + rows.depth[i] as usize;
        let row = &qkv[i * width..(i + 1) * width];
        let kv = &row[nh * d..];
        cache.write(pos, &kv[..kvd], &kv[kvd..]);
        for kvh in 0..nkv {
            let (h0, h1) = (kvh * group, (kvh + 1) * group);
            let out = &mut o[(i * nh + h0) * d..(i * nh + h1) * d];
            ops::attend(cache, kvh, &row[h0 * d..h1 * d], pos + 1, scores, out, simd);
        }
    }
}

/// A model instance with its own KV cache over shared [`FastWeights`]: the full model or an
/// early-exit model (first `n` layers, then the final norm and head; LayerSkip, Elhoushi et al.
/// 2024). Implements [`speculative::TargetModel`]; forwards are batch-invariant (module docs).
///
/// # Token trees
///
/// Also implements [`speculative::TreeTarget`] (offered by [`speculative::TargetModel::tree`]
/// while [`FastTarget::with_max_tree_nodes`] is not 0; default capacity
/// [`DEFAULT_MAX_TREE_NODES`] nodes). A tree forward runs the root and the `n` nodes as `n + 1`
/// rows of one forward (each weight block read once for all rows, as in a chain verify), with
/// node `i` at position `seq_len + depth(i)`. Its attention is the chain's: the rows attend in
/// depth-first preorder, and before a row attends its key and value are written to cache slot
/// `seq_len + depth`, so slots `0 ..= seq_len + depth` hold the committed context, the root and
/// exactly the row's ancestors, in position order, and the row runs the very attention call
/// of a chain forward of its path (non-ancestors are never in the slots it reads). With the batch-invariant matmuls and norms, **the logits and hidden
/// states of every node equal, bit for bit, those of a chain forward of the root and the path
/// to the node** (tested on the real model for random trees of up to 32 nodes). Each row's key
/// and value are written once per layer, as in a chain; the keys and values of every row are
/// also kept aside (`[n + 1, 2 kv_heads d]` per layer) for
/// [`commit_tree`](speculative::TreeTarget::commit_tree), which copies the accepted path's
/// entries into slots `seq_len + 1 ..` (skipping those already there). Keys were rotated at
/// the node's depth position, which is its chain position, so the cache after the commit
/// equals a chain forward's, bit for bit.
///
/// While a tree forward is not committed, [`speculative::TargetModel::forward`] and
/// [`speculative::TargetModel::prefill`] return an error; `truncate(len)` with `len <=
/// seq_len + 1` (as before the tree) drops it, and a longer `len` commits the first nodes when
/// they form a chain from the root (an error otherwise).
#[derive(Debug)]
pub struct FastTarget {
    weights: Arc<FastWeights>,
    n_layers: usize,
    exec: Exec,
    /// The KV cache, length and pending tree of the sequence.
    seq: SeqState,
    hidden: Vec<f32>,
    /// Most nodes of one tree forward (0: no tree support).
    max_tree_nodes: usize,
    /// The feature layout handed over instead of the final hidden states, and the last call's
    /// rows in it ([`FastTarget::with_feature_layout`]).
    taps: Option<(FeatureLayout, Vec<f32>)>,
}

impl FastTarget {
    /// The full model over shared weights, with the fastest kernel path of this CPU
    /// ([`KernelPath::detect`]) and one thread.
    pub fn new(weights: Arc<FastWeights>) -> Self {
        let n = weights.config.n_layers;
        Self::with_layers(weights, n)
    }

    /// Loads `path` in `format` and returns the full model.
    ///
    /// # Errors
    /// See [`FastWeights::load`].
    pub fn load(path: impl AsRef<Path>, format: FastFormat) -> Result<Self> {
        Ok(Self::new(FastWeights::load(path, format)?))
    }

    /// An early-exit model running the first `n_layers` blocks, sharing `weights`.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] unless `1 <= n_layers <= config.n_layers`.
    pub fn early_exit(weights: Arc<FastWeights>, n_layers: usize) -> Result<Self> {
        let total = weights.config.n_layers;
        if n_layers == 0 || n_layers > total {
            return Err(CandleError::InvalidArgument(format!(
                "early-exit depth {n_layers} must be in 1..={total}"
            )));
        }
        Ok(Self::with_layers(weights, n_layers))
    }

    fn with_layers(weights: Arc<FastWeights>, n_layers: usize) -> Self {
        let seq = SeqState::new(&weights.config, n_layers);
        FastTarget {
            weights,
            n_layers,
            exec: Exec::detect(),
            seq,
            hidden: Vec::new(),
            max_tree_nodes: DEFAULT_MAX_TREE_NODES,
            taps: None,
        }
    }

    /// Hands over the hidden states of `layout`'s layers instead of the final hidden state
    /// only: afterwards [`speculative::HiddenStates::last_hidden`] holds, for every row of
    /// each forward, prefill and tree forward, the layout's states concatenated in its order
    /// (`[n, layout.row_width()]`), [`speculative::HiddenStates::hidden_size`] is
    /// `row_width()` and [`speculative::HiddenStates::feature_layout`] returns `layout`. The
    /// states are copied from the residual stream while the layers run (no extra pass:
    /// `n · row_width` floats of copying per call), so they are the bits a fresh forward of the
    /// same tokens computes. [`FeatureLayout::final_only`] restores the default.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `layout.width()` is not the model's hidden size
    /// or a `Residual(i)` has `i > n_layers()` (this instance's layers).
    pub fn with_feature_layout(mut self, layout: FeatureLayout) -> Result<Self> {
        let h = self.weights.config.hidden_size;
        if layout.width() != h {
            return Err(CandleError::InvalidArgument(format!(
                "feature layout width {} is not the hidden size {h}",
                layout.width()
            )));
        }
        layout
            .check_layers(self.n_layers)
            .map_err(|e| CandleError::InvalidArgument(e.to_string()))?;
        self.taps = (!layout.is_final_only()).then(|| (layout, Vec::new()));
        Ok(self)
    }

    /// Sets the most nodes one tree forward takes
    /// ([`speculative::TreeTarget::max_tree_nodes`]; default [`DEFAULT_MAX_TREE_NODES`]). The
    /// kernels set no bound: the cost grows with the rows like a chain verify's, and the
    /// kept-aside keys and values take `(n + 1) · 2 kv_heads d · n_layers` floats (64 nodes on
    /// SmolLM2-135M: 1.5 MB). `0` turns tree support off ([`speculative::TargetModel::tree`]
    /// returns `None`, so the decoding loop verifies chains).
    pub fn with_max_tree_nodes(mut self, max_nodes: usize) -> Self {
        self.max_tree_nodes = max_nodes;
        self
    }

    /// Chooses the int8 kernel path (all paths give the same bits; for tests and benches).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when this CPU cannot run `path`.
    pub fn with_kernel(mut self, path: KernelPath) -> Result<Self> {
        self.exec.set_kernel(path)?;
        Ok(self)
    }

    /// Splits every matmul between this thread and a persistent helper thread when
    /// `threads >= 2` (`0` is treated as 1, more than 2 as 2). Results are identical for every
    /// count. About 1.3-1.4x faster when the second core is idle, much slower when another
    /// process competes for it, so one thread is the default (figures in the module docs of
    /// [`crate::fast`]).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.exec.threads = threads.max(1);
        self
    }

    /// The kernel path in use.
    pub fn kernel(&self) -> KernelPath {
        self.exec.path
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<FastWeights> {
        &self.weights
    }

    /// Number of blocks this instance runs.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// A copy with the same weights (shared) and a deep copy of the KV cache.
    pub fn fork(&self) -> Self {
        FastTarget {
            weights: Arc::clone(&self.weights),
            n_layers: self.n_layers,
            exec: self.exec.fork(),
            seq: self.seq.clone(),
            hidden: self.hidden.clone(),
            max_tree_nodes: self.max_tree_nodes,
            taps: self.taps.clone(),
        }
    }

    /// The keys and values of positions `0 .. seq_len` of every layer, `(k, v)` each
    /// `[seq_len, kv_heads d]` (keys after RoPE). For tests that compare caches.
    #[doc(hidden)]
    pub fn kv_snapshot(&self) -> Vec<(Vec<f32>, Vec<f32>)> {
        self.seq.kv_snapshot()
    }

    /// Appends `tokens` (`n` of them) and writes their `[n, vocab]` logits into `logits`
    /// (cleared first); keeps the `[n, hidden]` final hidden states for
    /// [`speculative::HiddenStates::last_hidden`]. On error the sequence is unchanged.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] for an empty slice or while a tree forward is not
    /// committed, [`CandleError::TokenOutOfVocab`], [`CandleError::ContextOverflow`] when
    /// `seq_len + n > context_length`.
    pub fn forward_logits(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.seq.check(&self.weights.config, tokens)?;
        self.run(tokens, None, Some(logits))
    }

    /// Appends `tokens` like [`FastTarget::forward_logits`] but skips the output head: no
    /// logits are computed (the `[n, hidden]` final hidden states are still kept). The KV cache
    /// afterwards is bit-identical to the one `forward_logits` leaves. Used for the prompt
    /// prefill, where the head is about a fifth of the work for SmolLM2-135M.
    ///
    /// # Errors
    /// As [`FastTarget::forward_logits`].
    pub fn prefill_tokens(&mut self, tokens: &[u32]) -> Result<()> {
        self.seq.check(&self.weights.config, tokens)?;
        self.run(tokens, None, None)
    }

    /// Appends `tokens` (`n` of them) in one forward and writes the `[rows, vocab]` logits of
    /// the last `rows` (`1 <= rows <= n`) into `logits` (cleared first): the output head runs
    /// over those rows only, as [`FastTarget::prefill_tokens`] skips it for every row. Each
    /// row's arithmetic does not depend on the other rows of the call, so the logits are
    /// bit-identical to `prefill_tokens` of the first `n - rows` tokens followed by
    /// `forward_logits` of the rest, and so is the KV cache; the `[n, hidden]` final hidden
    /// states of every row are kept. [`speculative::TargetModel::forward_tail`] (the fused
    /// prefill of `speculative::decode::Generator`).
    ///
    /// # Errors
    /// As [`FastTarget::forward_logits`]; [`CandleError::InvalidArgument`] for `rows == 0` or
    /// `rows > n`.
    pub fn forward_tail_logits(
        &mut self,
        tokens: &[u32],
        rows: usize,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        self.seq.check(&self.weights.config, tokens)?;
        if rows == 0 || rows > tokens.len() {
            return Err(CandleError::InvalidArgument(format!(
                "forward_tail: {rows} logit rows of {} tokens",
                tokens.len()
            )));
        }
        logits.clear();
        self.run_tail(tokens, None, rows, Some(logits))
    }

    /// Appends the root and the nodes of a valid `block` (module docs of [`FastTarget`],
    /// "Token trees"), writing `[n + 1, vocab]` logits; the tree is pending afterwards. On error
    /// the sequence is unchanged.
    fn forward_tree_logits(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let tokens = tree_tokens(root, block);
        self.seq.check(&self.weights.config, &tokens)?;
        let rows = Rows::of(block);
        self.run(&tokens, Some((&rows, block)), Some(logits))
    }

    /// The one-segment case of [`run_rows`]: appends `tokens` (a tree when `tree` is set),
    /// writing the logits when asked. Validation is the caller's.
    fn run(
        &mut self,
        tokens: &[u32],
        tree: Option<(&Rows, &DraftBlock<'_>)>,
        logits: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        let rows = if logits.is_some() { tokens.len() } else { 0 };
        self.run_tail(tokens, tree, rows, logits)
    }

    /// [`FastTarget::run`] with logits for the last `logit_rows` rows only (`<= tokens.len()`;
    /// 0 with `logits` `None`).
    fn run_tail(
        &mut self,
        tokens: &[u32],
        tree: Option<(&Rows, &DraftBlock<'_>)>,
        logit_rows: usize,
        logits: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        let w = Arc::clone(&self.weights);
        let mut unused = Vec::new();
        let mut segs = [Segment {
            seq: &mut self.seq,
            tokens,
            tree,
            logit_rows,
        }];
        let mut taps = self.taps.as_mut().map(|(layout, out)| Taps { layout, out });
        run_rows(
            &w,
            self.n_layers,
            &mut self.exec,
            &mut segs,
            &mut self.hidden,
            logits.unwrap_or(&mut unused),
            taps.as_mut(),
        )
    }

    /// Drops every position at index `>= len`. With a tree forward not committed (`seq_len`
    /// then counts the root and every node): `len <= base + 1` (`base` the length before the
    /// tree) drops the tree; a longer `len` keeps the root and the first `len - base - 1`
    /// nodes when they form a chain from the root (as
    /// [`commit_tree`](speculative::TreeTarget::commit_tree) of that path).
    ///
    /// # Errors
    /// [`CandleError::TruncateBeyondEnd`] when `len > seq_len`; [`CandleError::InvalidArgument`]
    /// when `len` cuts into an uncommitted tree whose first nodes are not a chain (the
    /// sequence is then unchanged).
    pub fn truncate_to(&mut self, len: usize) -> Result<()> {
        self.seq.truncate_to(&self.weights.config, len)
    }
}

/// The state of one sequence of [`FastTarget`] or one slot of
/// [`FastBatch`](super::FastBatch): its KV cache, length and uncommitted tree forward.
#[derive(Debug, Clone)]
pub(crate) struct SeqState {
    /// Per layer (positions `>= seq_len` are stale and never read).
    pub(crate) cache: Vec<KvCache>,
    pub(crate) seq_len: usize,
    /// The uncommitted tree forward, if any.
    pub(crate) pending: Option<PendingTree>,
    /// Per layer, the roped keys and values of the last tree forward's rows,
    /// `[n + 1][2 kv_heads d]` (key then value).
    pub(crate) tree_kv: Vec<Vec<f32>>,
}

impl SeqState {
    /// An empty sequence of a model of `cfg` running `n_layers` blocks (nothing allocated).
    pub(crate) fn new(cfg: &LlamaConfig, n_layers: usize) -> Self {
        let cache = KvCache::new(cfg.n_kv_heads, cfg.head_dim);
        SeqState {
            cache: vec![cache; n_layers],
            seq_len: 0,
            pending: None,
            tree_kv: vec![Vec::new(); n_layers],
        }
    }

    /// Validates a forward's tokens: no tree pending, non-empty, in the vocabulary, fitting the
    /// context.
    pub(crate) fn check(&self, cfg: &LlamaConfig, tokens: &[u32]) -> Result<()> {
        check_append(cfg, self.pending.is_some(), self.seq_len, tokens)
    }

    /// Bytes held by the KV cache and the kept-aside tree rows (capacity).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.cache.iter().map(KvCache::memory_bytes).sum::<usize>()
            + self
                .tree_kv
                .iter()
                .map(|v| v.capacity() * std::mem::size_of::<f32>())
                .sum::<usize>()
    }

    /// Makes this sequence the first `len` positions of `src` (a sequence of the same model):
    /// their keys and values copied, nothing pending.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `len > src.seq_len`, `src` has a pending tree or
    /// the caches differ in shape (this sequence is then unchanged).
    pub(crate) fn copy_prefix_from(&mut self, src: &SeqState, len: usize) -> Result<()> {
        if len > src.seq_len || src.pending.is_some() || self.cache.len() != src.cache.len() {
            return Err(CandleError::InvalidArgument(format!(
                "copy_prefix_from: {len} positions of a sequence of {} (pending tree: {}, \
                 layers {} vs {})",
                src.seq_len,
                src.pending.is_some(),
                src.cache.len(),
                self.cache.len()
            )));
        }
        for (d, s) in self.cache.iter_mut().zip(&src.cache) {
            d.copy_prefix_from(s, len);
        }
        self.seq_len = len;
        self.pending = None;
        Ok(())
    }

    /// See [`FastTarget::kv_snapshot`].
    pub(crate) fn kv_snapshot(&self) -> Vec<(Vec<f32>, Vec<f32>)> {
        self.cache
            .iter()
            .map(|c| {
                let (mut k, mut v) = (Vec::new(), Vec::new());
                for pos in 0..self.seq_len {
                    c.read(pos, &mut k, &mut v);
                }
                (k, v)
            })
            .collect()
    }

    /// Keeps the root and the nodes `path` (already checked to be a path of `t`'s block) and
    /// drops the other nodes: copies the kept rows' keys and values to slots `base + 1 ..`
    /// where they are not there already.
    fn commit_rows(&mut self, cfg: &LlamaConfig, t: &PendingTree, path: &[u32]) {
        let kvd = cfg.n_kv_heads * cfg.head_dim;
        for (k, &node) in path.iter().enumerate() {
            let row = node as usize + 1;
            if t.in_place(k, row) {
                continue;
            }
            for (cache, kv) in self.cache.iter_mut().zip(&self.tree_kv) {
                let kv = &kv[row * 2 * kvd..(row + 1) * 2 * kvd];
                cache.write(t.base + 1 + k, &kv[..kvd], &kv[kvd..]);
            }
        }
        self.seq_len = t.base + 1 + path.len();
    }

    /// [`speculative::TreeTarget::commit_tree`] of this sequence.
    pub(crate) fn commit_tree(
        &mut self,
        cfg: &LlamaConfig,
        path: &[u32],
    ) -> speculative::Result<()> {
        let t = take_for_commit(&mut self.pending, path, |t| t)?;
        self.commit_rows(cfg, &t, path);
        Ok(())
    }

    /// See [`FastTarget::truncate_to`].
    pub(crate) fn truncate_to(&mut self, cfg: &LlamaConfig, len: usize) -> Result<()> {
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
                    self.commit_rows(cfg, &t, &path);
                    return Ok(());
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

/// One sequence's rows in a call of [`run_rows`].
pub(crate) struct Segment<'a> {
    /// The sequence the rows are appended to.
    pub(crate) seq: &'a mut SeqState,
    /// The rows' tokens (`[n]`; a tree's root first).
    pub(crate) tokens: &'a [u32],
    /// A tree forward's layout and block (tree attention, pending afterwards); `None` for a
    /// chain or prefill.
    pub(crate) tree: Option<(&'a Rows, &'a DraftBlock<'a>)>,
    /// How many of the segment's last rows get logits (0: none; `tokens.len()`: every row).
    pub(crate) logit_rows: usize,
}

/// The row pipeline of [`FastTarget`] and [`FastBatch`](super::FastBatch): one forward over
/// the rows of every segment (their tokens, validated by the caller, concatenated in segment
/// order). Embedding, norms, every matmul and the MLP run over all rows at once (each weight
/// block read once per call); RoPE, the KV-cache writes and attention run per segment against
/// that segment's own cache at its own positions (`seq_len + i` for a chain, `seq_len + depth`
/// for a tree, with [`tree_attention`] and the rows kept aside in `tree_kv`). Every row's
/// arithmetic depends only on its own token, position and sequence, never on the other rows
/// or segments (module docs), so a segment's logits are the same bits alone or in any batch.
///
/// Writes the `[rows, hidden]` final hidden states of all rows into `hidden` and, when some
/// segment asks, the logits of the rows of those segments in segment order
/// (`[sum of their rows, vocab]`) into `logits` (left untouched when none asks). On success
/// each segment's `seq_len` grows by its rows (a tree becomes pending); on error no segment's
/// `seq_len` or pending tree changes (cache entries past `seq_len` are never read).
///
/// With `taps`, also writes every row's states of the layout's layers into `taps.out`
/// (`[rows, row_width]`, [`Taps`]), copied from the residual stream as the layers run (no
/// extra pass).
pub(crate) fn run_rows(
    w: &FastWeights,
    n_layers: usize,
    exec: &mut Exec,
    segs: &mut [Segment<'_>],
    hidden: &mut Vec<f32>,
    logits: &mut Vec<f32>,
    mut taps: Option<&mut Taps<'_>>,
) -> Result<()> {
    let cfg = &w.config;
    let eps = cfg.rms_eps as f32;
    reserve_segments(cfg, n_layers, segs);
    let mut x = embed_rows(w, segs);
    if let Some(t) = taps.as_deref_mut() {
        t.begin(x.len() / cfg.hidden_size);
    }
    let mut b = RowBufs::default();
    for (li, layer) in w.layers[..n_layers].iter().enumerate() {
        if let Some(t) = taps.as_deref_mut() {
            t.copy(FeatureLayer::Residual(li), &x);
        }
        rms_norm(&x, &layer.attn_norm, eps, &mut b.a);
        layer.wqkv.matmul(&b.a, &mut b.qkv, exec)?;
        attend_segments(w, li, segs, &mut b, exec.simd);
        layer.wo.matmul(&b.o, &mut b.proj, exec)?;
        x.iter_mut().zip(&b.proj).for_each(|(xv, pv)| *xv += pv);
        let mut bufs = FfnBufs {
            a: &mut b.a,
            gu: &mut b.gu,
            act: &mut b.act,
            proj: &mut b.proj,
        };
        ffn_residual(layer, &mut x, eps, &mut bufs, exec)?;
    }
    rms_norm(&x, &w.output_norm, eps, hidden);
    if let Some(t) = taps {
        t.copy(FeatureLayer::Residual(n_layers), &x);
        t.copy(FeatureLayer::Final, hidden);
    }
    head_logits(w, segs, hidden, logits, exec)?;
    for s in segs.iter_mut() {
        if let Some((rows, block)) = s.tree {
            s.seq.pending = Some(PendingTree::new(s.seq.seq_len, block, rows));
        }
        s.seq.seq_len += s.tokens.len();
    }
    Ok(())
}

/// The feature rows of one [`run_rows`] call: for each row, the states of `layout`'s layers
/// concatenated in its order, into `out` (`[rows, layout.row_width()]`, cleared first).
pub(crate) struct Taps<'a> {
    pub(crate) layout: &'a FeatureLayout,
    pub(crate) out: &'a mut Vec<f32>,
}

impl Taps<'_> {
    fn begin(&mut self, rows: usize) {
        self.out.clear();
        self.out.resize(rows * self.layout.row_width(), 0.0);
    }

    /// Copies `x` (`[rows, width]`) into the block of `layer`, when the layout has it.
    fn copy(&mut self, layer: FeatureLayer, x: &[f32]) {
        let Some(j) = self.layout.position(layer) else {
            return;
        };
        let (h, rw) = (self.layout.width(), self.layout.row_width());
        for (dst, src) in self.out.chunks_exact_mut(rw).zip(x.chunks_exact(h)) {
            dst[j * h..(j + 1) * h].copy_from_slice(src);
        }
    }
}

/// Scratch buffers of one [`run_rows`] call.
#[derive(Default)]
struct RowBufs {
    /// Normed rows, `[rows, h]`.
    a: Vec<f32>,
    /// Fused q, k, v of all rows, `[rows, width]`.
    qkv: Vec<f32>,
    /// Attention output of all rows, `[rows, nh d]`.
    o: Vec<f32>,
    /// One segment's attention output (with several segments).
    seg_o: Vec<f32>,
    scores: Vec<f32>,
    proj: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
}

/// Grows every segment's layer caches for its rows and, for a tree, sizes its kept-aside
/// keys and values (`[n][2 kv_heads d]` per layer).
fn reserve_segments(cfg: &LlamaConfig, n_layers: usize, segs: &mut [Segment<'_>]) {
    let kvd = cfg.n_kv_heads * cfg.head_dim;
    for s in segs.iter_mut() {
        let (p, n) = (s.seq.seq_len, s.tokens.len());
        for c in &mut s.seq.cache[..n_layers] {
            c.reserve_within(p + n, p, cfg.context_length);
        }
        if s.tree.is_some() {
            for kv in &mut s.seq.tree_kv[..n_layers] {
                kv.clear();
                kv.resize(n * 2 * kvd, 0.0);
            }
        }
    }
}

/// The embeddings of every segment's tokens, in segment order (`[rows, h]`).
fn embed_rows(w: &FastWeights, segs: &[Segment<'_>]) -> Vec<f32> {
    let h = w.config.hidden_size;
    let total: usize = segs.iter().map(|s| s.tokens.len()).sum();
    let embed = w.embed.as_ref().unwrap_or(&w.head);
    let mut x = vec![0f32; total * h];
    let all_tokens = segs.iter().flat_map(|s| s.tokens.iter());
    for (row, &t) in x.chunks_exact_mut(h).zip(all_tokens) {
        embed.row(t as usize, row);
    }
    x
}

/// The attention half of layer `li` for every segment, from the rows' fused `b.qkv` into
/// `b.o` (`[rows, nh d]`, segment order): RoPE, the cache writes (chains) or the kept-aside
/// rows (trees), and [`attention`] / [`tree_attention`] against the segment's own cache.
fn attend_segments(
    w: &FastWeights,
    li: usize,
    segs: &mut [Segment<'_>],
    b: &mut RowBufs,
    simd: bool,
) {
    let cfg = &w.config;
    let (nh, nkv, d) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
    let width = (nh + 2 * nkv) * d;
    // One segment writes its attention output straight into the call's buffer.
    let single = segs.len() == 1;
    b.o.clear();
    let mut r0 = 0;
    for s in segs.iter_mut() {
        let (p, n) = (s.seq.seq_len, s.tokens.len());
        let rows = s.tree.map(|(rows, _)| rows);
        let seg_qkv = &mut b.qkv[r0 * width..(r0 + n) * width];
        rope_and_store(w, li, s.seq, seg_qkv, rows);
        let cache = &mut s.seq.cache[li];
        let out = if single { &mut b.o } else { &mut b.seg_o };
        match rows {
            None => attention(
                cache,
                seg_qkv,
                (n, p, nh, nkv, d, width),
                out,
                &mut b.scores,
                simd,
            ),
            Some(rows) => tree_attention(
                cache,
                seg_qkv,
                rows,
                (p, nh, nkv, d, width),
                out,
                &mut b.scores,
                simd,
            ),
        }
        if !single {
            b.o.extend_from_slice(&b.seg_o);
        }
        r0 += n;
    }
}

/// RoPE on the queries (then scaled by `1 / sqrt(d)`) and keys of one segment's rows
/// (`qkv`, `[n, width]`) at positions `seq_len + i` (a chain) or `seq_len + depth` (a tree
/// laid out by `rows`); a chain's keys and values go to layer `li`'s cache, a tree's to the
/// kept-aside `tree_kv` (its attention writes the cache).
fn rope_and_store(
    w: &FastWeights,
    li: usize,
    seq: &mut SeqState,
    qkv: &mut [f32],
    rows: Option<&Rows>,
) {
    let cfg = &w.config;
    let (nh, nkv, d) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
    let (kvd, half, width) = (nkv * d, d / 2, (nh + 2 * nkv) * d);
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    let p = seq.seq_len;
    for (i, row) in qkv.chunks_exact_mut(width).enumerate() {
        let pos = p + rows.map_or(i, |t| t.depth[i] as usize);
        let cos = &w.rope_cos[pos * half..(pos + 1) * half];
        let sin = &w.rope_sin[pos * half..(pos + 1) * half];
        let (q, kv) = row.split_at_mut(nh * d);
        for head in q.chunks_exact_mut(d) {
            rope(head, cos, sin);
            head.iter_mut().for_each(|v| *v *= scale);
        }
        let (k, v) = kv.split_at_mut(kvd);
        for head in k.chunks_exact_mut(d) {
            rope(head, cos, sin);
        }
        if rows.is_some() {
            seq.tree_kv[li][i * 2 * kvd..(i + 1) * 2 * kvd].copy_from_slice(kv);
        } else {
            seq.cache[li].write(p + i, k, v);
        }
    }
}

/// The output head over the final `hidden` rows of the segments that ask for logits, into
/// `logits` (`[their rows, vocab]`, segment order; untouched when none asks).
fn head_logits(
    w: &FastWeights,
    segs: &[Segment<'_>],
    hidden: &[f32],
    logits: &mut Vec<f32>,
    exec: &mut Exec,
) -> Result<()> {
    let h = w.config.hidden_size;
    let total: usize = segs.iter().map(|s| s.tokens.len()).sum();
    let wanted: usize = segs.iter().map(|s| s.logit_rows.min(s.tokens.len())).sum();
    if wanted == total && total > 0 {
        w.head.matmul(hidden, logits, exec)?;
    } else if wanted > 0 {
        // Only the rows that need logits (each segment's last `logit_rows`) go through the
        // head (the head is row-wise).
        let mut rows = Vec::with_capacity(wanted * h);
        let mut r0 = 0;
        for s in segs.iter() {
            let n = s.tokens.len();
            let from = r0 + n - s.logit_rows.min(n);
            rows.extend_from_slice(&hidden[from * h..(r0 + n) * h]);
            r0 += n;
        }
        w.head.matmul(&rows, logits, exec)?;
    }
    Ok(())
}

impl Engine for FastTarget {
    fn model_config(&self) -> &LlamaConfig {
        &self.weights.config
    }

    fn positions(&self) -> usize {
        self.seq.seq_len
    }

    fn tree_capacity(&self) -> usize {
        self.max_tree_nodes
    }

    fn append_logits(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.forward_logits(tokens, logits)
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
        self.forward_tree_logits(root, block, logits)
    }

    fn commit_path(&mut self, path: &[u32]) -> speculative::Result<()> {
        self.seq.commit_tree(&self.weights.config, path)
    }

    fn features(&self) -> Option<(&FeatureLayout, &[f32])> {
        self.taps.as_ref().map(|(l, rows)| (l, rows.as_slice()))
    }
}

target_glue!(FastTarget, hidden_states = hidden, {
    fn supports_prefix_copy(&self) -> bool {
        true
    }

    /// One forward over every token, the output head over the last `rows`
    /// ([`FastTarget::forward_tail_logits`]): bit-identical to the default's prefill and
    /// forward.
    ///
    /// # Errors
    /// [`speculative::Error::Model`] (source [`CandleError`]) as `forward`, and for
    /// `rows == 0` or `rows > tokens.len()`; the sequence is then unchanged.
    fn forward_tail(
        &mut self,
        tokens: &[u32],
        rows: usize,
        logits: &mut Vec<f32>,
    ) -> speculative::Result<()> {
        Ok(self.forward_tail_logits(tokens, rows, logits)?)
    }

    /// Copies the keys and values of `src`'s first `len` positions (a `FastTarget` over the
    /// same [`FastWeights`] and layer count): afterwards this model's logits for any
    /// continuation are bit-identical to `src`'s (`speculative::PerSlot` uses it for
    /// [`speculative::BatchTarget::copy_prefix`]).
    ///
    /// # Errors
    /// [`speculative::Error::Model`] (source [`CandleError`]) for another model's `src`,
    /// `len > src.seq_len()` or a pending tree in `src`; this model is then unchanged.
    fn copy_prefix_from(&mut self, src: &Self, len: usize) -> speculative::Result<()> {
        if !Arc::ptr_eq(&self.weights, &src.weights) || self.n_layers != src.n_layers {
            return Err(CandleError::InvalidArgument(
                "copy_prefix_from: a FastTarget over other weights or layers".into(),
            )
            .into());
        }
        self.seq.copy_prefix_from(&src.seq, len)?;
        self.hidden.clear();
        if let Some((_, rows)) = self.taps.as_mut() {
            rows.clear();
        }
        Ok(())
    }
});
