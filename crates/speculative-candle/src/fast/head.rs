//! An EAGLE draft head on [`FastWeights`]: one decoder layer that reads the target's final
//! hidden state of the previous position and the embedding of the current token, predicts the
//! current position's hidden state, and scores a frequency-ranked subset of the vocabulary
//! with the target's own output head.
//!
//! Sources: EAGLE (Li et al. 2024, "EAGLE: speculative sampling requires rethinking feature
//! uncertainty", section 3: the draft model autoregresses on features, its input at each
//! position being the feature of the previous position fused with the embedding of the token
//! one step ahead), EAGLE-2 (Li et al. 2024, dynamic draft trees, used through
//! [`speculative::DraftModelProposer`]) and FR-Spec (Zhao et al. 2025: an output head over
//! the most frequent tokens only).
//!
//! # The model
//!
//! For the token `x_p` at position `p`, with `f_{p-1}` the feature of position `p - 1` (the
//! target's final hidden state, after the last norm, of the row whose input was `x_{p-1}`;
//! zeros at `p = 0`) and `e(x_p)` the target's embedding of `x_p`:
//!
//! ```text
//! u_p    = W_fc [f_{p-1} ; e(x_p)] + b_fc                       [h]   (fc: [h, 2h])
//! v_p    = u_p + Attn(rms_norm(u))_p                            (causal, RoPE at p, GQA)
//! w_p    = v_p + W_down (silu(W_gate a_p) * W_up a_p),  a_p = rms_norm(v_p)
//! f^_p   = rms_norm(w_p) * g_out                                 the predicted feature of p
//! logits = f^_p · E_S^T                                          [|S|]
//! ```
//!
//! where `E_S` are the target's output-head rows of the token subset `S` (the file's
//! `vocab_ids`). [`DraftHead`] reports logits over the whole target vocabulary (`[n, vocab]`)
//! with `-inf` outside `S`, so tokens outside the subset are never drafted (their draft
//! probability is 0, which keeps verification exact: the verifier only needs the q a draft was
//! sampled from).
//!
//! Where the target's feature of `p - 1` is not known (a drafted position: the target has not
//! run it), the head's own prediction `f^_{p-1}` takes its place, as in EAGLE.
//!
//! # File format
//!
//! A safetensors file (f16 or f32 tensors) with the metadata key `format` =
//! [`HEAD_FORMAT`] and the tensors (`h` the target's hidden size, `d` its head width,
//! `nh` / `nkv` the head's query / key-value heads, `f` its MLP width):
//! `fc.weight [h, 2h]`, `fc.bias [h]`, `attn_norm.weight [h]`, `attn_q.weight [nh d, h]`,
//! `attn_k.weight [nkv d, h]`, `attn_v.weight [nkv d, h]`, `attn_output.weight [h, nh d]`,
//! `ffn_norm.weight [h]`, `ffn_gate.weight [f, h]`, `ffn_up.weight [f, h]`,
//! `ffn_down.weight [h, f]`, `output_norm.weight [h]`, and `vocab_ids [|S|]` (u32, distinct
//! ids of the target vocabulary). Every other metadata key is kept as
//! [`DraftHeadWeights::metadata`] (training settings, seed, data size).
//!
//! # EAGLE-3 heads
//!
//! A file with `format` = [`HEAD3_FORMAT`] (EAGLE-3, Li et al. 2025, section 3.2) holds the
//! same tensors plus `fc3.weight [h, k h]` (no bias) and the metadata `feature_layers`
//! (comma-separated `Residual` indices, `"2,15,27"` for `FeatureLayout::eagle3(30, 576)`).
//! Its target feature rows are `[k h]`: the target's states of those layers
//! ([`speculative::FeatureLayout`], as `FastTarget::with_feature_layout` hands them over), and
//! the row at `p` reads, in place of `f_{p-1}`,
//!
//! ```text
//! g_{p-1} = W_fc3 [a_{p-1}; b_{p-1}; c_{p-1}]     when the target ran p - 1
//! g_{p-1} = w_{p-1}                              at a drafted position (before the final norm)
//! g_{-1}  = 0
//! ```
//!
//! and the rest of the model is the one above ([`super::head_fusion`]). The head reports the
//! file's layout ([`speculative::TargetFeatures::feature_layout`],
//! [`DraftHeadWeights::check_target_layout`]), so a pairing with a target that hands over
//! other layers is refused where it is built.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use speculative::DraftBlock;

use speculative::FeatureLayout;

use super::forward::{
    Exec, FastWeights, FfnBufs, Layer, Matrix, attention, ffn_residual, rms_norm, rope,
};
use super::head_fusion::Fusion;
pub use super::head_fusion::{
    FC3_TENSOR, FEATURE_LAYERS_KEY, HEAD3_FORMAT, HeadFormat, format_feature_layers,
    parse_feature_layers,
};
use super::ops::{self, KvCache};
use crate::engine::{Engine, check_append, target_glue};
use crate::error::{CandleError, Result};
use crate::gguf::LlamaConfig;
use crate::tree::{PendingTree, Rows, take_for_commit, tree_tokens};

/// The value of the `format` metadata key of an EAGLE-1 draft-head file (see
/// [`HEAD3_FORMAT`] for EAGLE-3).
pub const HEAD_FORMAT: &str = "speculative-eagle-head-v1";

/// Default of [`DraftHead::with_max_tree_nodes`].
pub const DEFAULT_HEAD_TREE_NODES: usize = 64;

/// Shape of a draft head (read from its file; the rest comes from the target).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftHeadConfig {
    /// The target's hidden size `h` (features, embeddings and the head's residual width).
    pub hidden_size: usize,
    /// Query heads of the head's attention (`nh`; `nh · d` may differ from `h`).
    pub n_heads: usize,
    /// Key/value heads (`nkv`, divides `nh`).
    pub n_kv_heads: usize,
    /// Per-head width `d`: the target's (the head uses the target's RoPE tables).
    pub head_dim: usize,
    /// MLP inner width `f`.
    pub ffn_size: usize,
    /// Size of the token subset `|S|`.
    pub subset: usize,
}

/// Named f32 tensors of a draft head with their shapes: what a file holds, what training
/// produces ([`crate::train`]) and what [`DraftHeadWeights::from_tensors`] takes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadTensors {
    /// Tensor name to (shape, row-major f32 values).
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// The token subset `S`, `[|S|]` ids of the target vocabulary.
    pub vocab_ids: Vec<u32>,
    /// Free-form metadata (training settings), written to and read from the file.
    pub metadata: BTreeMap<String, String>,
}

/// Names of the f32 tensors of an EAGLE-1 head file, in file order (an EAGLE-3 file adds
/// [`FC3_TENSOR`]).
pub const HEAD_TENSORS: [&str; 12] = [
    "fc.weight",
    "fc.bias",
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "output_norm.weight",
];

fn bad(path: &Path, reason: impl Into<String>) -> CandleError {
    CandleError::CorruptModel {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

impl HeadTensors {
    /// The tensor `name`, checked against `shape`.
    ///
    /// # Errors
    /// [`CandleError::Tensor`] when it is missing or has another shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<&[f32]> {
        let (s, v) = self.tensors.get(name).ok_or_else(|| CandleError::Tensor {
            name: name.into(),
            reason: "missing".into(),
        })?;
        if s != shape || v.len() != shape.iter().product::<usize>() {
            return Err(CandleError::Tensor {
                name: name.into(),
                reason: format!("shape {s:?}, expected {shape:?}"),
            });
        }
        Ok(v)
    }

    /// The head's shape, inferred from the tensors' shapes for a target of hidden size `h`
    /// and head width `d`.
    ///
    /// # Errors
    /// [`CandleError::Tensor`] for a missing or inconsistent tensor.
    pub fn config(&self, h: usize, d: usize) -> Result<DraftHeadConfig> {
        let dim = |name: &str, i: usize| -> Result<usize> {
            self.tensors
                .get(name)
                .and_then(|(s, _)| s.get(i).copied())
                .ok_or_else(|| CandleError::Tensor {
                    name: name.into(),
                    reason: "missing".into(),
                })
        };
        let (q, kv, f) = (
            dim("attn_q.weight", 0)?,
            dim("attn_k.weight", 0)?,
            dim("ffn_gate.weight", 0)?,
        );
        let (nh, nkv) = (q / d.max(1), kv / d.max(1));
        if d == 0 || nh == 0 || nkv == 0 || q % d != 0 || kv % d != 0 || nh % nkv != 0 {
            return Err(CandleError::Tensor {
                name: "attn_q.weight".into(),
                reason: format!("{q} query and {kv} key rows do not fit head width {d}"),
            });
        }
        Ok(DraftHeadConfig {
            hidden_size: h,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            ffn_size: f,
            subset: self.vocab_ids.len(),
        })
    }

    /// Writes a safetensors file with the tensors stored as f16 (`half`) or f32, the
    /// `vocab_ids` as u32 and the metadata plus `format` = [`HeadTensors::format`]'s name
    /// ([`HEAD_FORMAT`], or [`HEAD3_FORMAT`] when the tensors hold [`FC3_TENSOR`]). The
    /// header's keys are sorted, so the file's bytes depend only on its contents.
    ///
    /// # Errors
    /// [`CandleError::Io`] when the file cannot be written; [`CandleError::InvalidArgument`]
    /// when a tensor's values do not match its shape or a value is not finite (in f16 with
    /// `half`).
    pub fn write(&self, path: impl AsRef<Path>, half: bool) -> Result<()> {
        use safetensors::tensor::{Dtype, TensorView};
        let mut bufs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (name, (shape, v)) in &self.tensors {
            if v.iter()
                .any(|x| !x.is_finite() || (half && x.abs() > 65504.0))
            {
                return Err(CandleError::InvalidArgument(format!(
                    "tensor `{name}` has a value that is not finite{}",
                    if half { " in f16" } else { "" }
                )));
            }
            if v.len() != shape.iter().product::<usize>() {
                return Err(CandleError::InvalidArgument(format!(
                    "tensor `{name}`: {} values for shape {shape:?}",
                    v.len()
                )));
            }
            let (dtype, bytes) = if half {
                let b: Vec<u8> = v
                    .iter()
                    .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                    .collect();
                (Dtype::F16, b)
            } else {
                (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
            };
            bufs.push((name.clone(), dtype, shape.clone(), bytes));
        }
        let ids: Vec<u8> = self
            .vocab_ids
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        bufs.push((
            "vocab_ids".into(),
            Dtype::U32,
            vec![self.vocab_ids.len()],
            ids,
        ));
        let mut views = Vec::with_capacity(bufs.len());
        for (name, dtype, shape, bytes) in &bufs {
            let view = TensorView::new(*dtype, shape.clone(), bytes)
                .map_err(|e| CandleError::InvalidArgument(format!("tensor `{name}`: {e}")))?;
            views.push((name.clone(), view));
        }
        let mut meta: std::collections::HashMap<String, String> =
            self.metadata.clone().into_iter().collect();
        meta.insert("format".into(), self.format().name().into());
        let bytes = crate::st::serialize(views, meta)
            .map_err(|e| CandleError::InvalidArgument(format!("safetensors: {e}")))?;
        std::fs::write(path.as_ref(), bytes)?;
        Ok(())
    }

    /// Reads a head file written by [`HeadTensors::write`] (tensors in f16, bf16 or f32).
    ///
    /// # Errors
    /// [`CandleError::ModelNotFound`] when the file does not exist;
    /// [`CandleError::CorruptModel`] when it is not a safetensors file, its `format` is
    /// neither [`HEAD_FORMAT`] nor [`HEAD3_FORMAT`], the format does not match the presence of
    /// [`FC3_TENSOR`], or a tensor has an unexpected dtype.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        use safetensors::tensor::Dtype;
        let path = path.as_ref();
        if !path.exists() {
            return Err(CandleError::ModelNotFound {
                path: path.to_path_buf(),
            });
        }
        let bytes = std::fs::read(path)?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad(path, format!("safetensors header: {e}")))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(path, format!("safetensors: {e}")))?;
        let mut metadata: BTreeMap<String, String> = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let format = metadata.remove("format");
        let Some(format) = format.as_deref().and_then(HeadFormat::parse) else {
            return Err(bad(
                path,
                format!(
                    "metadata `format` is {format:?}, expected {HEAD_FORMAT:?} or {HEAD3_FORMAT:?}"
                ),
            ));
        };
        let mut out = HeadTensors {
            metadata,
            ..HeadTensors::default()
        };
        for (name, view) in st.tensors() {
            let data = view.data();
            if name == "vocab_ids" {
                if view.dtype() != Dtype::U32 {
                    return Err(bad(path, "`vocab_ids` must be u32"));
                }
                out.vocab_ids = data
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                continue;
            }
            let values: Vec<f32> = match view.dtype() {
                Dtype::F16 => data
                    .chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                Dtype::BF16 => data
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                other => return Err(bad(path, format!("tensor `{name}` has dtype {other:?}"))),
            };
            out.tensors.insert(name, (view.shape().to_vec(), values));
        }
        if out.format() != format {
            return Err(bad(
                path,
                format!(
                    "format {:?} with{} `{FC3_TENSOR}`",
                    format.name(),
                    match format {
                        HeadFormat::Eagle1 => "",
                        HeadFormat::Eagle3 => "out",
                    }
                ),
            ));
        }
        Ok(out)
    }
}

/// A draft head's weights in a [`FastFormat`](super::FastFormat), bound to the target's [`FastWeights`] (whose
/// embedding, output head rows and RoPE tables it uses), shared through an [`Arc`] by every
/// [`DraftHead`].
#[derive(Debug)]
pub struct DraftHeadWeights {
    config: DraftHeadConfig,
    target: Arc<FastWeights>,
    fc: Matrix,
    fc_bias: Vec<f32>,
    layer: Layer,
    out_norm: Vec<f32>,
    /// What a row reads as the feature of the previous position.
    fusion: Fusion,
    /// `[|S|]`, the subset's ids in the file's order.
    ids: Vec<u32>,
    /// The target's output rows of `ids`, `[|S|, h]`.
    head: Matrix,
    metadata: BTreeMap<String, String>,
}

impl DraftHeadWeights {
    /// Loads a head file ([`HeadTensors::read`]) for `target`, in the target's format.
    ///
    /// # Errors
    /// As [`HeadTensors::read`] and [`DraftHeadWeights::from_tensors`].
    pub fn load(path: impl AsRef<Path>, target: Arc<FastWeights>) -> Result<Arc<Self>> {
        let t = HeadTensors::read(path)?;
        Self::from_tensors(&t, target)
    }

    /// Builds the head from named tensors (for example fresh from training).
    ///
    /// # Errors
    /// [`CandleError::Tensor`] for a missing or mis-shaped tensor (shapes in the module
    /// docs); [`CandleError::InvalidArgument`] when `vocab_ids` is empty, has duplicates or
    /// ids outside the target vocabulary, or (EAGLE-3) `feature_layers` is missing, malformed
    /// or names a layer past the target's last.
    pub fn from_tensors(t: &HeadTensors, target: Arc<FastWeights>) -> Result<Arc<Self>> {
        let tc = target.config.clone();
        let (h, d) = (tc.hidden_size, tc.head_dim);
        let config = t.config(h, d)?;
        let (nh, nkv, f) = (config.n_heads, config.n_kv_heads, config.ffn_size);
        if t.vocab_ids.is_empty() {
            return Err(CandleError::InvalidArgument("empty `vocab_ids`".into()));
        }
        let mut seen = vec![false; tc.vocab_size];
        for &id in &t.vocab_ids {
            match seen.get_mut(id as usize) {
                None => {
                    return Err(CandleError::TokenOutOfVocab {
                        token: id,
                        vocab_size: tc.vocab_size,
                    });
                }
                Some(s) if *s => {
                    return Err(CandleError::InvalidArgument(format!(
                        "`vocab_ids` lists token {id} twice"
                    )));
                }
                Some(s) => *s = true,
            }
        }
        let format = target.format;
        let m = |rows: usize, cols: usize, data: &[f32]| Matrix::from_f32(rows, cols, data, format);
        let mut qkv = t.get("attn_q.weight", &[nh * d, h])?.to_vec();
        qkv.extend_from_slice(t.get("attn_k.weight", &[nkv * d, h])?);
        qkv.extend_from_slice(t.get("attn_v.weight", &[nkv * d, h])?);
        let mut gu = t.get("ffn_gate.weight", &[f, h])?.to_vec();
        gu.extend_from_slice(t.get("ffn_up.weight", &[f, h])?);
        let layer = Layer {
            attn_norm: t.get("attn_norm.weight", &[h])?.to_vec(),
            wqkv: m((nh + 2 * nkv) * d, h, &qkv)?,
            wo: m(h, nh * d, t.get("attn_output.weight", &[h, nh * d])?)?,
            ffn_norm: t.get("ffn_norm.weight", &[h])?.to_vec(),
            w_gate_up: m(2 * f, h, &gu)?,
            w_down: m(h, f, t.get("ffn_down.weight", &[h, f])?)?,
        };
        let mut rows = vec![0f32; t.vocab_ids.len() * h];
        for (row, &id) in rows.chunks_exact_mut(h).zip(&t.vocab_ids) {
            target.head.row(id as usize, row);
        }
        // Re-rounding a dequantised Q8 row gives back its blocks; f32 rows are copied.
        let head = m(t.vocab_ids.len(), h, &rows)?;
        let fusion = Fusion::from_tensors(t, &target)?;
        Ok(Arc::new(DraftHeadWeights {
            fusion,
            config,
            fc: m(h, 2 * h, t.get("fc.weight", &[h, 2 * h])?)?,
            fc_bias: t.get("fc.bias", &[h])?.to_vec(),
            layer,
            out_norm: t.get("output_norm.weight", &[h])?.to_vec(),
            ids: t.vocab_ids.clone(),
            head,
            metadata: t.metadata.clone(),
            target,
        }))
    }

    /// The head's shape.
    pub fn config(&self) -> &DraftHeadConfig {
        &self.config
    }

    /// The token subset `S` (`[|S|]` target ids).
    pub fn vocab_ids(&self) -> &[u32] {
        &self.ids
    }

    /// The file's metadata (training settings), without `format`.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The file format of the head.
    pub fn format(&self) -> HeadFormat {
        match self.fusion {
            Fusion::Last => HeadFormat::Eagle1,
            Fusion::Layers { .. } => HeadFormat::Eagle3,
        }
    }

    /// The layout of the target feature rows the head reads: `[Final]` of width `h` for an
    /// EAGLE-1 head, the file's `feature_layers` for an EAGLE-3 head.
    pub fn feature_layout(&self) -> FeatureLayout {
        self.fusion.layout(self.config.hidden_size)
    }

    /// Checks that a target handing over rows of `target` (its
    /// [`speculative::HiddenStates::feature_layout`]) feeds this head.
    ///
    /// # Errors
    /// [`CandleError::FeatureLayoutMismatch`] when `target` is not
    /// [`DraftHeadWeights::feature_layout`].
    pub fn check_target_layout(&self, target: &FeatureLayout) -> Result<()> {
        let head = self.feature_layout();
        if &head == target {
            return Ok(());
        }
        Err(CandleError::FeatureLayoutMismatch {
            head: format!("{head:?}"),
            target: format!("{target:?}"),
        })
    }

    /// The target weights the head reads (embedding, output rows, RoPE tables).
    pub fn target(&self) -> &Arc<FastWeights> {
        &self.target
    }

    /// Bytes of the head's own matrices in memory (the subset's output rows included).
    pub fn memory_bytes(&self) -> usize {
        let l = &self.layer;
        [
            &self.fc,
            &l.wqkv,
            &l.wo,
            &l.w_gate_up,
            &l.w_down,
            &self.head,
        ]
        .iter()
        .map(|m| m.memory_bytes())
        .sum::<usize>()
            + self.fusion.memory_bytes()
    }
}

/// The state of an uncommitted tree forward of a [`DraftHead`].
#[derive(Debug, Clone)]
struct HeadPending {
    tree: PendingTree,
    /// Roped key then value of every row, `[n + 1, 2 nkv d]`.
    kv: Vec<f32>,
    /// Predicted feature of every row, `[n + 1, h]`.
    pred: Vec<f32>,
}

/// A tree forward in progress ([`DraftHead::tree_level`]): rows are the root (0) and the
/// nodes (`i + 1`).
struct TreeRows<'a> {
    /// The rows' tokens, `[n + 1]`.
    tokens: &'a [u32],
    /// Depth of each row, `[n + 1]`.
    depth: &'a [u32],
    /// Parent row of each row (0 for the root), `[n + 1]`.
    parent: Vec<u32>,
    /// Sequence length before the tree (the root's position).
    base: usize,
    /// Roped key then value of every row, `[n + 1, 2 nkv d]`.
    kv: Vec<f32>,
    /// The feature every row feeds to its children, `[n + 1, h]` (`f^` or `w`, module docs).
    pred: Vec<f32>,
    /// Normed output (`f^`) of every row, `[n + 1, h]`, for the logits.
    out: Vec<f32>,
}

/// Reusable buffers of one forward.
#[derive(Debug, Default)]
struct Scratch {
    input: Vec<f32>,
    x: Vec<f32>,
    a: Vec<f32>,
    qkv: Vec<f32>,
    o: Vec<f32>,
    proj: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    scores: Vec<f32>,
    out: Vec<f32>,
    /// EAGLE-3: the pre-norm outputs `w` of the rows of `out`.
    fed: Vec<f32>,
    /// EAGLE-3: the fc3 product of handed-over feature rows.
    fused: Vec<f32>,
    sub: Vec<f32>,
}

impl Scratch {
    /// The rows a forward feeds forward, row-aligned with `out`: `out` itself when `normed`
    /// (EAGLE-1) or the pre-norm rows `fed` (EAGLE-3).
    fn fed_rows(&self, normed: bool) -> &[f32] {
        if normed { &self.out } else { &self.fed }
    }
}

/// An EAGLE draft head instance with its own KV cache (module docs), driven as a draft model:
/// implements [`speculative::TargetModel`] (logits `[n, vocab]` of the target vocabulary,
/// `-inf` outside the subset), [`speculative::TreeTarget`] (one call grows the rows of a
/// draft tree level by level, each node reading its parent's predicted feature) and
/// [`speculative::TargetFeatures`] (the target's hidden states of committed positions), so
/// [`speculative::DraftModelProposer`] drafts chains and EAGLE-2 trees with it.
///
/// **Batch invariance.** Each row's arithmetic is that of the target's fast forward (fixed
/// accumulation orders), so the logits of one forward over `n` tokens equal, bit for bit,
/// those of `n` one-token forwards given the same features, and a tree node's logits equal
/// those of a chain forward of its path.
///
/// **Memory.** Per position: one layer's key and value (`2 nkv d` floats) and the predicted
/// feature (`h` floats), plus `h` floats per target feature held (after the `fc3` projection
/// for an EAGLE-3 head); 3.1 KB per position for the shipped SmolLM2 head.
#[derive(Debug)]
pub struct DraftHead {
    w: Arc<DraftHeadWeights>,
    exec: Exec,
    cache: KvCache,
    seq_len: usize,
    /// Input features (`f` or `g = fc3 · F`, `[h]` each) from the target rows of positions
    /// `0 .. feats.len() / h`.
    feats: Vec<f32>,
    /// The feature every cached position feeds to the next (`f^`, or `w` for EAGLE-3),
    /// `[seq_len, h]` (prefix valid).
    pred: Vec<f32>,
    max_tree_nodes: usize,
    pending: Option<HeadPending>,
    s: Scratch,
}

impl DraftHead {
    /// A head instance with an empty sequence, the fastest kernel path and one thread.
    pub fn new(weights: Arc<DraftHeadWeights>) -> Self {
        let c = weights.config;
        DraftHead {
            cache: KvCache::new(c.n_kv_heads, c.head_dim),
            w: weights,
            exec: Exec::detect(),
            seq_len: 0,
            feats: Vec::new(),
            pred: Vec::new(),
            max_tree_nodes: DEFAULT_HEAD_TREE_NODES,
            pending: None,
            s: Scratch::default(),
        }
    }

    /// Sets the most nodes of one tree forward (default [`DEFAULT_HEAD_TREE_NODES`]; `0`
    /// turns tree support off).
    pub fn with_max_tree_nodes(mut self, n: usize) -> Self {
        self.max_tree_nodes = n;
        self
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<DraftHeadWeights> {
        &self.w
    }

    /// The predicted features `f^` (`[n, h]`, after the final norm: what the logits score)
    /// of the rows of the last forward, prefill or tree forward, in row order.
    pub fn last_predicted(&self) -> &[f32] {
        &self.s.out
    }

    fn h(&self) -> usize {
        self.w.config.hidden_size
    }

    fn check(&self, tokens: &[u32]) -> Result<()> {
        check_append(
            &self.w.target.config,
            self.pending.is_some(),
            self.seq_len,
            tokens,
        )
    }

    /// The input feature of a row at position `p` whose previous position has no row in the
    /// current call: the target's feature of `p - 1` when held, else the head's prediction,
    /// zeros at `p = 0`.
    fn feature_before(&self, p: usize, out: &mut Vec<f32>) {
        let h = self.h();
        if p == 0 {
            out.extend(std::iter::repeat_n(0.0, h));
        } else if let Some(f) = self.feats.get((p - 1) * h..p * h) {
            out.extend_from_slice(f);
        } else {
            out.extend_from_slice(&self.pred[(p - 1) * h..p * h]);
        }
    }

    /// fc over `s.input` (`[m, 2h]`, feature then embedding per row) into `s.x` (`[m, h]`).
    fn fuse(&mut self) -> Result<()> {
        let s = &mut self.s;
        self.w.fc.matmul(&s.input, &mut s.x, &mut self.exec)?;
        let h = self.w.config.hidden_size;
        for row in s.x.chunks_exact_mut(h) {
            row.iter_mut()
                .zip(&self.w.fc_bias)
                .for_each(|(v, b)| *v += b);
        }
        Ok(())
    }

    /// Appends the embedding of `token` to `s.input`.
    fn push_embedding(&mut self, token: u32) {
        let w = &self.w.target;
        let embed = w.embed.as_ref().unwrap_or(&w.head);
        let h = self.w.config.hidden_size;
        let start = self.s.input.len();
        self.s.input.resize(start + h, 0.0);
        embed.row(token as usize, &mut self.s.input[start..]);
    }

    /// Ropes and scales the rows of `s.qkv` (`[m, width]`) at `positions`.
    fn rope_rows(&mut self, positions: &[usize]) {
        let c = self.w.config;
        let (nh, nkv, d) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let (half, width) = (d / 2, (nh + 2 * nkv) * d);
        let scale = (1.0 / (d as f64).sqrt()) as f32;
        let tw = &self.w.target;
        for (row, &pos) in self.s.qkv.chunks_exact_mut(width).zip(positions) {
            let cos = &tw.rope_cos[pos * half..(pos + 1) * half];
            let sin = &tw.rope_sin[pos * half..(pos + 1) * half];
            let (q, kv) = row.split_at_mut(nh * d);
            for head in q.chunks_exact_mut(d) {
                rope(head, cos, sin);
                head.iter_mut().for_each(|v| *v *= scale);
            }
            for head in kv[..nkv * d].chunks_exact_mut(d) {
                rope(head, cos, sin);
            }
        }
    }

    /// The rest of the layer after attention wrote `s.o`: output projection, residual, MLP,
    /// output norm into `s.out` (appended; EAGLE-3: the pre-norm rows into `s.fed`).
    fn finish_rows(&mut self) -> Result<()> {
        let eps = self.w.target.config.rms_eps as f32;
        let s = &mut self.s;
        self.w.layer.wo.matmul(&s.o, &mut s.proj, &mut self.exec)?;
        s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
        let mut bufs = FfnBufs {
            a: &mut s.a,
            gu: &mut s.gu,
            act: &mut s.act,
            proj: &mut s.proj,
        };
        ffn_residual(&self.w.layer, &mut s.x, eps, &mut bufs, &mut self.exec)?;
        if !self.w.fusion.feeds_normed() {
            s.fed.extend_from_slice(&s.x);
        }
        let mut normed = Vec::new();
        rms_norm(&s.x, &self.w.out_norm, eps, &mut normed);
        s.out.extend_from_slice(&normed);
        Ok(())
    }

    /// Runs chain rows `tokens[i..j]` at positions `p0 + i ..` (their input features already
    /// decided by the caller: row `i` reads `feature_before`, later rows the target's
    /// features) and appends their predicted features to `s.out`.
    fn run_segment(&mut self, tokens: &[u32], p: usize) -> Result<()> {
        let h = self.h();
        let c = self.w.config;
        let (nh, nkv, d) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let m = tokens.len();
        let mut input = std::mem::take(&mut self.s.input);
        input.clear();
        self.s.input = input;
        for (i, &t) in tokens.iter().enumerate() {
            let mut f = std::mem::take(&mut self.s.input);
            if i == 0 {
                self.feature_before(p, &mut f);
            } else {
                f.extend_from_slice(&self.feats[(p + i - 1) * h..(p + i) * h]);
            }
            self.s.input = f;
            self.push_embedding(t);
        }
        self.fuse()?;
        let eps = self.w.target.config.rms_eps as f32;
        rms_norm(&self.s.x, &self.w.layer.attn_norm, eps, &mut self.s.a);
        self.w
            .layer
            .wqkv
            .matmul(&self.s.a, &mut self.s.qkv, &mut self.exec)?;
        let positions: Vec<usize> = (p..p + m).collect();
        self.rope_rows(&positions);
        let (kvd, width) = (nkv * d, (nh + 2 * nkv) * d);
        for (i, row) in self.s.qkv.chunks_exact(width).enumerate() {
            let kv = &row[nh * d..];
            self.cache.write(p + i, &kv[..kvd], &kv[kvd..]);
        }
        attention(
            &self.cache,
            &self.s.qkv,
            (m, p, nh, nkv, d, width),
            &mut self.s.o,
            &mut self.s.scores,
            self.exec.simd,
        );
        let before = self.s.out.len();
        self.finish_rows()?;
        // Fed features by position.
        self.pred.truncate(p * h);
        let normed = self.w.fusion.feeds_normed();
        self.pred
            .extend_from_slice(&self.s.fed_rows(normed)[before..]);
        self.seq_len = p + m;
        Ok(())
    }

    /// Clears the output rows of a forward (`s.out`, `s.fed`).
    fn clear_out(&mut self) {
        self.s.out.clear();
        self.s.fed.clear();
    }

    /// Appends `tokens` at positions `seq_len ..`, computing their predicted features (kept
    /// for [`DraftHead::last_predicted`]) and, when asked, their logits `[n, vocab]`.
    fn run(&mut self, tokens: &[u32], logits: Option<&mut Vec<f32>>) -> Result<()> {
        let h = self.h();
        let p0 = self.seq_len;
        let known = self.feats.len() / h;
        self.cache.reserve(p0 + tokens.len(), p0);
        self.clear_out();
        // Rows run in segments: a row whose previous position has a target feature (or is
        // the first row of the call) joins the segment; else it waits for its predecessor.
        let mut i = 0;
        while i < tokens.len() {
            let mut j = i + 1;
            while j < tokens.len() && p0 + j - 1 < known {
                j += 1;
            }
            self.run_segment(&tokens[i..j], p0 + i)?;
            i = j;
        }
        if let Some(logits) = logits {
            self.subset_logits(logits)?;
        }
        Ok(())
    }

    /// Scores the rows of `s.out` on the subset and scatters them into `logits`
    /// (`[rows, vocab]`, `-inf` outside the subset).
    fn subset_logits(&mut self, logits: &mut Vec<f32>) -> Result<()> {
        let vocab = self.w.target.config.vocab_size;
        let s = &mut self.s;
        self.w.head.matmul(&s.out, &mut s.sub, &mut self.exec)?;
        let n = s.out.len() / self.w.config.hidden_size;
        logits.clear();
        logits.resize(n * vocab, f32::NEG_INFINITY);
        let k = self.w.ids.len();
        for (row, sub) in logits.chunks_exact_mut(vocab).zip(s.sub.chunks_exact(k)) {
            for (&id, &v) in self.w.ids.iter().zip(sub) {
                row[id as usize] = v;
            }
        }
        Ok(())
    }

    /// Appends `tokens` and writes their `[n, vocab]` logits (`-inf` outside the subset).
    /// On error the sequence is unchanged.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] for an empty slice or while a tree forward is not
    /// committed, [`CandleError::TokenOutOfVocab`], [`CandleError::ContextOverflow`].
    pub fn forward_logits(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.check(tokens)?;
        let saved = self.seq_len;
        let out = self.run(tokens, Some(logits));
        if out.is_err() {
            self.seq_len = saved;
        }
        out
    }

    /// Appends `tokens` without computing logits.
    ///
    /// # Errors
    /// As [`DraftHead::forward_logits`].
    pub fn prefill_tokens(&mut self, tokens: &[u32]) -> Result<()> {
        self.check(tokens)?;
        let saved = self.seq_len;
        let out = self.run(tokens, None);
        if out.is_err() {
            self.seq_len = saved;
        }
        out
    }

    /// Tree forward: the root at position `base = seq_len` and node `i` at `base + depth(i)`,
    /// run level by level (a node's input feature is its parent's predicted feature, so a
    /// level waits for the one above). Before a row attends, the keys and values of its
    /// ancestors are written to slots `base + 1 ..` and its own to `base + depth`: it attends
    /// to exactly what a chain forward of its path holds.
    fn forward_tree_rows(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let all = tree_tokens(root, block);
        self.check(&all)?;
        let rows = Rows::of(block);
        let h = self.h();
        let c = self.w.config;
        let kvd = c.n_kv_heads * c.head_dim;
        let base = self.seq_len;
        let n = all.len();
        let max_depth = rows.depth.iter().copied().max().unwrap_or(0) as usize;
        self.cache.reserve(base + max_depth + 1, base);
        let mut parent = vec![0u32; n];
        for (i, p) in parent.iter_mut().enumerate().skip(1) {
            *p = block.parent_row(i - 1) as u32;
        }
        let mut t = TreeRows {
            tokens: &all,
            depth: &rows.depth,
            parent,
            base,
            kv: vec![0f32; n * 2 * kvd],
            pred: vec![0f32; n * h],
            out: vec![0f32; n * h],
        };
        for level in 0..=max_depth {
            self.tree_level(&mut t, level)?;
        }
        // Rows in order for the logits and `last_predicted`.
        self.clear_out();
        self.s.out.extend_from_slice(&t.out);
        self.subset_logits(logits)?;
        // The root's entries are final (slot `base`); the sequence now holds the whole tree
        // until it is committed.
        self.pred.truncate(base * h);
        self.pred.extend_from_slice(&t.pred[..h]);
        self.seq_len = base + 1 + block.len();
        self.pending = Some(HeadPending {
            tree: PendingTree::new(base, block, &rows),
            kv: t.kv,
            pred: t.pred,
        });
        Ok(())
    }

    /// The rows of depth `level` of a tree forward, as one forward: inputs (the feature
    /// before the root, else the parent's prediction, with the row's embedding), fc, norm,
    /// q / k / v at position `base + level`, attention ([`DraftHead::tree_attend`]), and the
    /// rows' predicted features into `t.pred`.
    fn tree_level(&mut self, t: &mut TreeRows<'_>, level: usize) -> Result<()> {
        let h = self.h();
        let members: Vec<usize> = (0..t.tokens.len())
            .filter(|&r| t.depth[r] as usize == level)
            .collect();
        self.s.input.clear();
        for &r in &members {
            let mut f = std::mem::take(&mut self.s.input);
            if r == 0 {
                self.feature_before(t.base, &mut f);
            } else {
                let p = t.parent[r] as usize;
                f.extend_from_slice(&t.pred[p * h..(p + 1) * h]);
            }
            self.s.input = f;
            self.push_embedding(t.tokens[r]);
        }
        self.fuse()?;
        let eps = self.w.target.config.rms_eps as f32;
        rms_norm(&self.s.x, &self.w.layer.attn_norm, eps, &mut self.s.a);
        self.w
            .layer
            .wqkv
            .matmul(&self.s.a, &mut self.s.qkv, &mut self.exec)?;
        let positions = vec![t.base + level; members.len()];
        self.rope_rows(&positions);
        self.tree_attend(t, level, &members);
        self.clear_out();
        self.finish_rows()?;
        let fed = self.s.fed_rows(self.w.fusion.feeds_normed());
        for (mi, &r) in members.iter().enumerate() {
            t.out[r * h..(r + 1) * h].copy_from_slice(&self.s.out[mi * h..(mi + 1) * h]);
            t.pred[r * h..(r + 1) * h].copy_from_slice(&fed[mi * h..(mi + 1) * h]);
        }
        Ok(())
    }

    /// Attention of the rows `members` (depth `level`; their roped q / k / v in `s.qkv`) into
    /// `s.o`: each row's key and value are kept in `t.kv`, then the root's, its ancestors' and
    /// its own entries are written to slots `base ..= base + level` and the row attends to
    /// slots `0 ..= base + level`.
    fn tree_attend(&mut self, t: &mut TreeRows<'_>, level: usize, members: &[usize]) {
        let c = self.w.config;
        let (nh, nkv, d) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let (kvd, width) = (nkv * d, (nh + 2 * nkv) * d);
        let group = nh / nkv;
        self.s.o.clear();
        self.s.o.resize(members.len() * nh * d, 0.0);
        let mut chain: Vec<usize> = Vec::new();
        for (mi, &r) in members.iter().enumerate() {
            let row = &self.s.qkv[mi * width..(mi + 1) * width];
            t.kv[r * 2 * kvd..(r + 1) * 2 * kvd].copy_from_slice(&row[nh * d..]);
            // Ancestors (depth 1 .. level - 1) then the row itself into their slots.
            chain.clear();
            let mut a = r;
            while a != 0 {
                chain.push(a);
                a = t.parent[a] as usize;
            }
            chain.push(0);
            for (depth, &a) in chain.iter().rev().enumerate() {
                let e = &t.kv[a * 2 * kvd..(a + 1) * 2 * kvd];
                self.cache.write(t.base + depth, &e[..kvd], &e[kvd..]);
            }
            for kvh in 0..nkv {
                let (h0, h1) = (kvh * group, (kvh + 1) * group);
                let out = &mut self.s.o[(mi * nh + h0) * d..(mi * nh + h1) * d];
                ops::attend(
                    &self.cache,
                    kvh,
                    &row[h0 * d..h1 * d],
                    t.base + level + 1,
                    &mut self.s.scores,
                    out,
                    self.exec.simd,
                );
            }
        }
    }

    /// Keeps the root and the nodes `path` of the pending tree.
    fn commit_rows(&mut self, t: &HeadPending, path: &[u32]) {
        let h = self.h();
        let kvd = self.w.config.n_kv_heads * self.w.config.head_dim;
        let base = t.tree.base;
        self.pred.truncate((base + 1) * h);
        for (k, &node) in path.iter().enumerate() {
            let r = node as usize + 1;
            let e = &t.kv[r * 2 * kvd..(r + 1) * 2 * kvd];
            self.cache.write(base + 1 + k, &e[..kvd], &e[kvd..]);
            self.pred.extend_from_slice(&t.pred[r * h..(r + 1) * h]);
        }
        self.seq_len = base + 1 + path.len();
    }

    /// Drops every position `>= len` (features held are kept: they are keyed by position and
    /// replaced only by [`speculative::TargetFeatures::set_target_hidden`]). With a tree
    /// forward pending: as [`crate::FastTarget::truncate_to`].
    ///
    /// # Errors
    /// [`CandleError::TruncateBeyondEnd`] when `len > seq_len`;
    /// [`CandleError::InvalidArgument`] when `len` cuts into a pending tree whose first nodes
    /// are not a chain.
    pub fn truncate_to(&mut self, len: usize) -> Result<()> {
        if len > self.seq_len {
            return Err(CandleError::TruncateBeyondEnd {
                len,
                seq_len: self.seq_len,
            });
        }
        if let Some(t) = self.pending.take() {
            match t.tree.truncation(len) {
                Ok(None) => {}
                Ok(Some(path)) => {
                    self.commit_rows(&t, &path);
                    return Ok(());
                }
                Err(e) => {
                    self.pending = Some(t);
                    return Err(e);
                }
            }
        }
        self.seq_len = len;
        self.pred.truncate(len * self.h());
        Ok(())
    }

    /// Floats per target feature row: `h` (EAGLE-1) or `k h` (EAGLE-3, `k` feature layers).
    pub fn feature_row_width(&self) -> usize {
        match &self.w.fusion {
            Fusion::Last => self.h(),
            Fusion::Layers { layout, .. } => layout.row_width(),
        }
    }

    /// Replaces the held target features of positions `>= start` by `rows`
    /// (`[n, feature_row_width]`: `[n, h]` for EAGLE-1, `[n, k h]` for EAGLE-3, projected by
    /// `fc3` here) and truncates the sequence to at most `start + 1` positions (module docs).
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] when `start` exceeds the features held or `rows` is
    /// not a whole number of rows.
    pub fn set_features(&mut self, start: usize, rows: &[f32]) -> Result<()> {
        let (h, rw) = (self.h(), self.feature_row_width());
        let held = self.feats.len() / h;
        if start > held || !rows.len().is_multiple_of(rw) {
            return Err(CandleError::InvalidArgument(format!(
                "target features from position {start} ({} floats) do not extend the {held} \
                 positions held ([n, {rw}] rows)",
                rows.len()
            )));
        }
        let fused = self
            .w
            .fusion
            .project(rows, &mut self.s.fused, &mut self.exec)?;
        self.feats.truncate(start * h);
        self.feats.extend_from_slice(fused);
        let limit = start + 1;
        if let Some(t) = &self.pending {
            // A pending tree's rows read features that may change: drop it.
            let len = (t.tree.base + 1).min(limit);
            self.truncate_to(len)?;
        } else if self.seq_len > limit {
            self.truncate_to(limit)?;
        }
        Ok(())
    }
}

impl Engine for DraftHead {
    fn model_config(&self) -> &LlamaConfig {
        &self.w.target.config
    }

    fn positions(&self) -> usize {
        self.seq_len
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

    /// See [`DraftHead`]: nodes run level by level, each attending to the committed context,
    /// the root and its ancestors, at position `seq_len + depth`.
    fn append_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let saved = (self.seq_len, self.pred.len());
        let out = self.forward_tree_rows(root, block, logits);
        if out.is_err() {
            self.seq_len = saved.0;
            self.pred.truncate(saved.1);
        }
        out
    }

    fn commit_path(&mut self, path: &[u32]) -> speculative::Result<()> {
        let t = take_for_commit(&mut self.pending, path, |t| &t.tree)?;
        self.commit_rows(&t, path);
        Ok(())
    }
}

target_glue!(DraftHead, target_features);

impl speculative::TargetFeatures for DraftHead {
    /// The feature row width, [`DraftHead::feature_row_width`] (`h`, or `k h` for EAGLE-3).
    fn hidden_size(&self) -> usize {
        self.feature_row_width()
    }

    fn target_hidden_len(&self) -> usize {
        self.feats.len() / self.h()
    }

    /// # Errors
    /// [`speculative::Error::ShapeMismatch`] when `start` exceeds the features held or `rows`
    /// is not a whole number of `[feature_row_width]` rows (nothing changes then).
    fn set_target_hidden(&mut self, start: usize, rows: &[f32]) -> speculative::Result<()> {
        let (h, held) = (self.feature_row_width(), self.feats.len() / self.h());
        if start > held {
            return Err(speculative::Error::ShapeMismatch {
                what: "target features start (at most the positions held)",
                expected: held,
                actual: start,
            });
        }
        if !rows.len().is_multiple_of(h) {
            return Err(speculative::Error::ShapeMismatch {
                what: "target feature rows ([n, hidden])",
                expected: rows.len().next_multiple_of(h),
                actual: rows.len(),
            });
        }
        Ok(self.set_features(start, rows)?)
    }

    /// [`DraftHeadWeights::feature_layout`].
    fn feature_layout(&self) -> FeatureLayout {
        self.w.feature_layout()
    }
}

/// The most frequent ids of `counts` (`[vocab]`, occurrences), at most `n`, most frequent
/// first (ties by id), for a head's `vocab_ids` (FR-Spec, Zhao et al. 2025, section 3).
pub fn frequency_ranked(counts: &[u64], n: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..counts.len() as u32).collect();
    ids.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
    ids.truncate(n);
    ids
}
