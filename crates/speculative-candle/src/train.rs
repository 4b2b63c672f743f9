//! Self-distillation of an EAGLE draft head ([`crate::fast::head`]) on the CPU with candle's
//! autograd.
//!
//! The recipe (EAGLE, Li et al. 2024, section 4 "training"; Medusa-2's self-distillation, Cai
//! et al. 2024, section 3.3):
//!
//! 1. **Data.** The target writes the training text itself: prompts of our own writing,
//!    answered at a few temperatures ([`GenSettings`]); each sequence (prompt and answer) is
//!    then run once through the target to record the final hidden state of every position
//!    ([`record_features`]). Stored as a [`Dataset`] (f16 features).
//! 2. **Objective.** At each answer position `p` the head reads `(f_{p-1}, x_p)` and predicts
//!    `f^_p`; the loss is `w_reg · SmoothL1(f^_p, f_p) + w_ce · CE(softmax(f_p E_S^T),
//!    f^_p E_S^T)`: feature regression plus cross-entropy against the target's own next-token
//!    distribution over the subset `S` (EAGLE's loss, with soft labels as in its code).
//!    Input features get Gaussian noise (EAGLE's robustness to its own feature errors), and
//!    with [`TrainConfig::unroll`] `= 2` a second pass feeds each row the first pass's
//!    prediction of the previous position while it attends to the first pass's keys of the
//!    earlier rows and its own second-pass key: the situation of the second draft token at
//!    inference (EAGLE-3's training-time test, Li et al. 2025, section 3).
//! 3. **Evaluation.** [`evaluate`] runs the shipped inference head ([`DraftHead`], the fast
//!    Q8 path) along greedy validation answers: top-1 / top-3 accuracy per draft position and
//!    the mean accepted length of a greedy chain.
//!
//! Everything is deterministic for a seed: initialisation, noise and batch order come from a
//! seeded [`SplitMix`] stream; candle's CPU matmuls split work by output blocks, so the sums
//! do not depend on the thread count.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::sync::Arc;

use candle_core::{D, DType, Device, Tensor, Var};
use candle_nn::optim::{AdamW, Optimizer, ParamsAdamW};

use crate::error::{CandleError, Result};
use crate::fast::head::{DraftHead, HeadTensors};
use crate::fast::{FastTarget, FastWeights};

/// A small, seedable random stream (splitmix64; Steele et al. 2014).
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A stream for `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix(seed ^ 0x6a09_e667_f3bc_c909)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n.max(1)
    }
}

/// One training sequence: prompt and answer tokens with the target's features.
#[derive(Debug, Clone, PartialEq)]
pub struct Sequence {
    /// Prompt then answer, `[len]`.
    pub tokens: Vec<u32>,
    /// Number of leading prompt tokens.
    pub prompt_len: usize,
    /// Temperature the answer was sampled at (0 = greedy).
    pub temperature: f32,
    /// The target's final hidden state of every position, `[len, h]`, f16.
    pub features: Vec<half::f16>,
}

/// Training sequences with features of width `hidden`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dataset {
    /// Feature width `h`.
    pub hidden: usize,
    /// The sequences.
    pub seqs: Vec<Sequence>,
}

const MAGIC: &[u8; 8] = b"SPECHD01";

fn io_bad(path: &Path, why: &str) -> CandleError {
    CandleError::CorruptModel {
        path: path.to_path_buf(),
        reason: why.into(),
    }
}

impl Dataset {
    /// Total answer tokens (the positions that carry a loss).
    pub fn answer_tokens(&self) -> usize {
        self.seqs
            .iter()
            .map(|s| s.tokens.len() - s.prompt_len)
            .sum()
    }

    /// Total tokens.
    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Writes the dataset (little-endian binary: magic, `h`, count, then per sequence its
    /// length, prompt length, temperature, tokens and f16 features).
    ///
    /// # Errors
    /// [`CandleError::Io`].
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut w = BufWriter::new(std::fs::File::create(path.as_ref())?);
        w.write_all(MAGIC)?;
        w.write_all(&(self.hidden as u32).to_le_bytes())?;
        w.write_all(&(self.seqs.len() as u32).to_le_bytes())?;
        for s in &self.seqs {
            w.write_all(&(s.tokens.len() as u32).to_le_bytes())?;
            w.write_all(&(s.prompt_len as u32).to_le_bytes())?;
            w.write_all(&s.temperature.to_le_bytes())?;
            for t in &s.tokens {
                w.write_all(&t.to_le_bytes())?;
            }
            for f in &s.features {
                w.write_all(&f.to_le_bytes())?;
            }
        }
        w.flush()?;
        Ok(())
    }

    /// Reads a dataset written by [`Dataset::write`].
    ///
    /// # Errors
    /// [`CandleError::Io`]; [`CandleError::CorruptModel`] for a wrong magic or inconsistent
    /// lengths.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut r = BufReader::new(std::fs::File::open(path)?);
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(io_bad(path, "not a draft-head dataset"));
        }
        fn u(r: &mut impl Read) -> Result<u32> {
            let mut b = [0u8; 4];
            r.read_exact(&mut b)?;
            Ok(u32::from_le_bytes(b))
        }
        let hidden = u(&mut r)? as usize;
        let n = u(&mut r)? as usize;
        if hidden == 0 || hidden > 1 << 16 {
            return Err(io_bad(path, "implausible feature width"));
        }
        let mut seqs = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            let len = u(&mut r)? as usize;
            let prompt_len = u(&mut r)? as usize;
            let temperature = f32::from_bits(u(&mut r)?);
            if prompt_len > len || len > 1 << 17 {
                return Err(io_bad(path, "inconsistent sequence lengths"));
            }
            let mut tokens = Vec::with_capacity(len);
            for _ in 0..len {
                tokens.push(u(&mut r)?);
            }
            let mut bytes = vec![0u8; len * hidden * 2];
            r.read_exact(&mut bytes)?;
            let features = bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                .collect();
            seqs.push(Sequence {
                tokens,
                prompt_len,
                temperature,
                features,
            });
        }
        Ok(Dataset { hidden, seqs })
    }
}

/// Runs `tokens` through a fresh sequence of `target` and returns the final hidden state of
/// every position, `[len, h]` (one prefill; [`FastTarget`] is batch-invariant, so these are
/// the hidden states decoding sees).
///
/// # Errors
/// Errors of the forward (empty input, context overflow).
pub fn record_features(target: &mut FastTarget, tokens: &[u32]) -> Result<Vec<f32>> {
    use speculative::HiddenStates;
    target.truncate_to(0)?;
    target.prefill_tokens(tokens)?;
    Ok(target.last_hidden().unwrap_or_default().to_vec())
}

/// Settings of the answers the target writes for the training data.
#[derive(Debug, Clone, PartialEq)]
pub struct GenSettings {
    /// Temperatures, cycled over the prompts (0 = greedy).
    pub temperatures: Vec<f32>,
    /// Top-p of the sampled answers.
    pub top_p: f32,
    /// Longest answer, in tokens.
    pub max_tokens: usize,
    /// Seed of the sampled answers (each prompt's seed is derived from it and its index).
    pub seed: u64,
}

impl Default for GenSettings {
    fn default() -> Self {
        GenSettings {
            temperatures: vec![0.0, 0.0, 0.7, 1.0],
            top_p: 0.95,
            max_tokens: 192,
            seed: 7,
        }
    }
}

/// Hyper-parameters of [`Trainer`].
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Seed of initialisation, noise and batch order.
    pub seed: u64,
    /// Query heads of the head's attention.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// MLP width.
    pub ffn_size: usize,
    /// Peak learning rate (AdamW, linear warm-up then cosine decay to 10 %).
    pub lr: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// Total optimiser steps.
    pub steps: usize,
    /// Positions per batch (sequences are packed until this many tokens).
    pub batch_tokens: usize,
    /// Longest window of one sequence, in tokens (longer sequences are cut).
    pub max_len: usize,
    /// Weight of the feature regression.
    pub w_reg: f64,
    /// Weight of the token cross-entropy.
    pub w_ce: f64,
    /// Standard deviation of the input-feature noise, relative to the features' RMS.
    pub noise: f64,
    /// Passes per step: 1, or 2 to also train on the head's own predicted features.
    pub unroll: usize,
    /// Gradient-norm clip.
    pub clip: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            seed: 19,
            n_heads: 9,
            n_kv_heads: 3,
            ffn_size: 1536,
            lr: 1e-3,
            warmup: 40,
            steps: 600,
            batch_tokens: 2048,
            max_len: 384,
            w_reg: 1.0,
            w_ce: 0.1,
            noise: 0.05,
            unroll: 2,
            clip: 1.0,
            weight_decay: 0.0,
        }
    }
}

/// Losses of one step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepLoss {
    /// The weighted total.
    pub total: f64,
    /// Feature regression (SmoothL1 per dimension), first pass.
    pub reg: f64,
    /// Cross-entropy against the target's subset distribution, first pass (nats).
    pub ce: f64,
    /// Top-1 agreement with the target's subset argmax on the first pass.
    pub acc: f64,
}

/// The head's parameters as candle [`Var`]s.
struct Params {
    fc_w: Var,
    fc_b: Var,
    attn_norm: Var,
    wq: Var,
    wk: Var,
    wv: Var,
    wo: Var,
    ffn_norm: Var,
    wg: Var,
    wu: Var,
    wd: Var,
    out_norm: Var,
}

impl Params {
    fn all(&self) -> [(&'static str, &Var); 12] {
        [
            ("fc.weight", &self.fc_w),
            ("fc.bias", &self.fc_b),
            ("attn_norm.weight", &self.attn_norm),
            ("attn_q.weight", &self.wq),
            ("attn_k.weight", &self.wk),
            ("attn_v.weight", &self.wv),
            ("attn_output.weight", &self.wo),
            ("ffn_norm.weight", &self.ffn_norm),
            ("ffn_gate.weight", &self.wg),
            ("ffn_up.weight", &self.wu),
            ("ffn_down.weight", &self.wd),
            ("output_norm.weight", &self.out_norm),
        ]
    }
}

/// One packed batch on the host.
struct Batch {
    b: usize,
    t: usize,
    /// `[b, t, h]` input features (shifted: row `p` holds `f_{p-1}`).
    feat_in: Vec<f32>,
    /// `[b, t, h]` target features `f_p`.
    feat_out: Vec<f32>,
    /// `[b, t]` tokens.
    tokens: Vec<u32>,
    /// `[b, t]` 1 where the position carries a loss.
    mask: Vec<f32>,
}

/// Trains a draft head (module docs).
pub struct Trainer {
    cfg: TrainConfig,
    h: usize,
    d: usize,
    eps: f64,
    rope_theta: f32,
    params: Params,
    opt: AdamW,
    /// `[|S|, h]` target output rows of the subset.
    head_rows: Tensor,
    /// Full embedding access.
    target: Arc<FastWeights>,
    vocab_ids: Vec<u32>,
    rng: SplitMix,
    feature_rms: f64,
    step: usize,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("cfg", &self.cfg)
            .field("step", &self.step)
            .finish()
    }
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// RoPE on adjacent pairs of `x` (`[b, heads, t, d]`) with `cos`/`sin` `[t, d/2]`.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let (b, nh, t, d) = x.dims4()?;
    let x = x.reshape((b, nh, t, d / 2, 2))?;
    let x0 = x.narrow(4, 0, 1)?.squeeze(4)?;
    let x1 = x.narrow(4, 1, 1)?.squeeze(4)?;
    let r0 = (x0.broadcast_mul(cos)? - x1.broadcast_mul(sin)?)?;
    let r1 = (x0.broadcast_mul(sin)? + x1.broadcast_mul(cos)?)?;
    Tensor::stack(&[r0, r1], 4)?.reshape((b, nh, t, d))
}

/// SmoothL1 (beta 1) of `x`, element-wise.
fn smooth_l1(x: &Tensor) -> candle_core::Result<Tensor> {
    let a = x.abs()?;
    let q = a.clamp(0f32, 1f32)?;
    q.mul(&(a - (&q * 0.5)?)?)
}

/// The causal mask of a `t`-row window, `[t, t]`: 0 on and below the diagonal, `-inf` above.
fn causal_mask(t: usize) -> Vec<f32> {
    let mut causal = vec![0f32; t * t];
    for i in 0..t {
        for j in i + 1..t {
            causal[i * t + j] = f32::NEG_INFINITY;
        }
    }
    causal
}

/// The mask of the second unrolled pass, `[t, 2t]`: as at inference, where only the drafted
/// row reads a prediction, row `p` attends to the first pass's keys of rows `0 .. p` (built
/// from target features) and to its own second-pass key (EAGLE-3's training-time test, Li et
/// al. 2025).
fn unroll_mask(t: usize) -> Vec<f32> {
    let mut m2 = vec![f32::NEG_INFINITY; t * 2 * t];
    for i in 0..t {
        for j in 0..i {
            m2[i * 2 * t + j] = 0.0;
        }
        m2[i * 2 * t + t + i] = 0.0;
    }
    m2
}

impl Trainer {
    /// A freshly initialised head for `target` over the subset `vocab_ids` (normal(0, 0.02)
    /// matrices, residual projections scaled by `1/sqrt(2)`, unit norms, the output norm from
    /// the target's), with AdamW.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] for inconsistent head sizes; candle errors.
    pub fn new(cfg: TrainConfig, target: Arc<FastWeights>, vocab_ids: Vec<u32>) -> Result<Self> {
        let tc = target.config().clone();
        let (h, d) = (tc.hidden_size, tc.head_dim);
        if cfg.n_heads == 0
            || cfg.n_kv_heads == 0
            || !cfg.n_heads.is_multiple_of(cfg.n_kv_heads)
            || cfg.ffn_size == 0
            || !(1..=2).contains(&cfg.unroll)
            || vocab_ids.is_empty()
        {
            return Err(CandleError::InvalidArgument(format!(
                "inconsistent training configuration {cfg:?}"
            )));
        }
        let dev = Device::Cpu;
        let mut rng = SplitMix::new(cfg.seed);
        let mut mat = |rows: usize, cols: usize, std: f64| -> Result<Var> {
            let v: Vec<f32> = (0..rows * cols)
                .map(|_| (rng.normal() * std) as f32)
                .collect();
            Ok(Var::from_tensor(&Tensor::from_vec(v, (rows, cols), &dev)?)?)
        };
        let s = 0.02;
        let r = 0.02 / 2f64.sqrt();
        let (nh, nkv, f) = (cfg.n_heads, cfg.n_kv_heads, cfg.ffn_size);
        let fc_w = mat(h, 2 * h, s)?;
        let wq = mat(nh * d, h, s)?;
        let wk = mat(nkv * d, h, s)?;
        let wv = mat(nkv * d, h, s)?;
        let wo = mat(h, nh * d, r)?;
        let wg = mat(f, h, s)?;
        let wu = mat(f, h, s)?;
        let wd = mat(h, f, r)?;
        let ones = || Var::from_tensor(&Tensor::ones(h, DType::F32, &dev)?);
        let params = Params {
            fc_w,
            fc_b: Var::from_tensor(&Tensor::zeros(h, DType::F32, &dev)?)?,
            attn_norm: ones()?,
            wq,
            wk,
            wv,
            wo,
            ffn_norm: ones()?,
            wg,
            wu,
            wd,
            out_norm: Var::from_tensor(&Tensor::from_vec(target.output_norm.clone(), h, &dev)?)?,
        };
        let vars: Vec<Var> = params.all().iter().map(|(_, v)| (*v).clone()).collect();
        let opt = AdamW::new(
            vars,
            ParamsAdamW {
                lr: cfg.lr,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: cfg.weight_decay,
            },
        )?;
        let mut rows = vec![0f32; vocab_ids.len() * h];
        for (row, &id) in rows.chunks_exact_mut(h).zip(&vocab_ids) {
            target.head.row(id as usize, row);
        }
        let head_rows = Tensor::from_vec(rows, (vocab_ids.len(), h), &dev)?;
        Ok(Trainer {
            rng: SplitMix::new(cfg.seed.wrapping_add(1)),
            eps: tc.rms_eps,
            rope_theta: tc.rope_theta,
            cfg,
            h,
            d,
            params,
            opt,
            head_rows,
            target,
            vocab_ids,
            feature_rms: 1.0,
            step: 0,
        })
    }

    /// Sets the RMS of the features (the noise is relative to it); see [`feature_rms`].
    pub fn set_feature_rms(&mut self, rms: f64) {
        self.feature_rms = rms;
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    fn cos_sin(&self, t: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let half = self.d / 2;
        let mut c = Vec::with_capacity(t * half);
        let mut s = Vec::with_capacity(t * half);
        for pos in 0..t {
            for i in 0..half {
                let f = 1.0 / self.rope_theta.powf(2.0 * i as f32 / self.d as f32);
                let a = pos as f32 * f;
                c.push(a.cos());
                s.push(a.sin());
            }
        }
        Ok((
            Tensor::from_vec(c, (t, half), &Device::Cpu)?,
            Tensor::from_vec(s, (t, half), &Device::Cpu)?,
        ))
    }

    /// The head on `[b, t, h]` input features and `[b, t, h]` embeddings: `[b, t, h]`
    /// predicted features, and the pass's keys and values (`[b, nh, t, d]`, roped, repeated
    /// over the query groups). With `prior` (an earlier pass's keys and values) the rows attend
    /// to `cat(prior, own)` under `mask` (`[t, 2t]`); else to their own under `mask` (`[t, t]`).
    fn forward(
        &self,
        feat_in: &Tensor,
        emb: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        prior: Option<(&Tensor, &Tensor)>,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let p = &self.params;
        let (b, t, h) = feat_in.dims3()?;
        let (nh, nkv, d) = (self.cfg.n_heads, self.cfg.n_kv_heads, self.d);
        let x = Tensor::cat(&[feat_in, emb], 2)?;
        let u = x
            .broadcast_matmul(&p.fc_w.t()?)?
            .broadcast_add(p.fc_b.as_tensor())?;
        let a = rms_norm(&u, &p.attn_norm, self.eps)?;
        let q = a
            .broadcast_matmul(&p.wq.t()?)?
            .reshape((b, t, nh, d))?
            .transpose(1, 2)?;
        let k = a
            .broadcast_matmul(&p.wk.t()?)?
            .reshape((b, t, nkv, d))?
            .transpose(1, 2)?;
        let v = a
            .broadcast_matmul(&p.wv.t()?)?
            .reshape((b, t, nkv, d))?
            .transpose(1, 2)?;
        let q = (rope(&q.contiguous()?, cos, sin)? * (1.0 / (d as f64).sqrt()))?;
        let k = rope(&k.contiguous()?, cos, sin)?;
        let g = nh / nkv;
        let k = k
            .unsqueeze(2)?
            .broadcast_as((b, nkv, g, t, d))?
            .reshape((b, nh, t, d))?;
        let v = v
            .contiguous()?
            .unsqueeze(2)?
            .broadcast_as((b, nkv, g, t, d))?
            .reshape((b, nh, t, d))?;
        let (k_all, v_all) = match prior {
            Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
            None => (k.clone(), v.clone()),
        };
        let scores = q.matmul(&k_all.t()?.contiguous()?)?.broadcast_add(mask)?;
        let att = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let o = att
            .matmul(&v_all)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, t, nh * d))?;
        let v1 = (u + o.broadcast_matmul(&p.wo.t()?)?)?;
        let a2 = rms_norm(&v1, &p.ffn_norm, self.eps)?;
        let gate = a2.broadcast_matmul(&p.wg.t()?)?.silu()?;
        let up = a2.broadcast_matmul(&p.wu.t()?)?;
        let w = (v1 + (gate * up)?.broadcast_matmul(&p.wd.t()?)?)?;
        let _ = h;
        Ok((rms_norm(&w, &p.out_norm, self.eps)?, k, v))
    }

    /// Packs sequences `idx` into a batch (windows of at most `max_len` tokens, starting at
    /// the sequence start or, for a longer sequence, at a random answer position).
    fn batch(&mut self, data: &Dataset, idx: &[usize]) -> Batch {
        let h = self.h;
        let max_len = self.cfg.max_len;
        let mut wins = Vec::with_capacity(idx.len());
        for &i in idx {
            let s = &data.seqs[i];
            let len = s.tokens.len();
            let start = if len <= max_len {
                0
            } else {
                let lo = s.prompt_len.saturating_sub(1).min(len - max_len);
                lo + self.rng.below(len - max_len - lo + 1)
            };
            wins.push((i, start, (len - start).min(max_len)));
        }
        let t = wins.iter().map(|w| w.2).max().unwrap_or(1);
        let b = wins.len();
        let mut out = Batch {
            b,
            t,
            feat_in: vec![0.0; b * t * h],
            feat_out: vec![0.0; b * t * h],
            tokens: vec![0; b * t],
            mask: vec![0.0; b * t],
        };
        for (bi, &(i, start, len)) in wins.iter().enumerate() {
            let s = &data.seqs[i];
            for j in 0..len {
                let p = start + j;
                let row = bi * t + j;
                out.tokens[row] = s.tokens[p];
                if p > 0 {
                    for (o, f) in out.feat_in[row * h..(row + 1) * h]
                        .iter_mut()
                        .zip(&s.features[(p - 1) * h..p * h])
                    {
                        *o = f.to_f32();
                    }
                }
                for (o, f) in out.feat_out[row * h..(row + 1) * h]
                    .iter_mut()
                    .zip(&s.features[p * h..(p + 1) * h])
                {
                    *o = f.to_f32();
                }
                // The loss covers rows whose next token is an answer token.
                if p + 1 >= s.prompt_len && p + 1 < s.tokens.len() {
                    out.mask[row] = 1.0;
                }
            }
        }
        out
    }

    fn embeddings(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.h;
        let w = &self.target;
        let embed = w.embed.as_ref().unwrap_or(&w.head);
        let mut out = vec![0f32; tokens.len() * h];
        for (row, &t) in out.chunks_exact_mut(h).zip(tokens) {
            embed.row(t as usize, row);
        }
        out
    }

    /// Losses of `pred` (`[b, t, h]`) against the batch targets; `(total, reg, ce, acc)`.
    fn losses(
        &self,
        pred: &Tensor,
        target: &Tensor,
        target_p: &Tensor,
        target_arg: &Tensor,
        mask: &Tensor,
        count: f64,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor, f64)> {
        let h = self.h as f64;
        let reg = (smooth_l1(&(pred - target)?)?
            .sum(D::Minus1)?
            .mul(mask)?
            .sum_all()?
            / (count * h))?;
        let logits = pred.broadcast_matmul(&self.head_rows.t()?)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let ce = ((target_p.mul(&logp)?.sum(D::Minus1)?.mul(mask)?.sum_all()? / count)? * -1.0)?;
        let arg = logits.argmax(D::Minus1)?;
        let hit = arg
            .eq(target_arg)?
            .to_dtype(DType::F32)?
            .mul(mask)?
            .sum_all()?
            .to_scalar::<f32>()? as f64
            / count;
        let total = ((&reg * self.cfg.w_reg)? + (&ce * self.cfg.w_ce)?)?;
        Ok((total, reg, ce, hit))
    }

    /// One optimiser step on the sequences `idx` of `data`.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] for an empty `idx`, an index outside `data`, features
    /// of another width or a sequence whose features do not match its tokens;
    /// [`CandleError::TokenOutOfVocab`]; candle errors.
    pub fn step(&mut self, data: &Dataset, idx: &[usize]) -> Result<StepLoss> {
        self.check_batch(data, idx)?;
        let dev = Device::Cpu;
        let bt = self.batch(data, idx);
        let (b, t, h) = (bt.b, bt.t, self.h);
        let count = bt.mask.iter().sum::<f32>().max(1.0) as f64;
        let feat_in = self.with_noise(bt.feat_in, &bt.mask);
        let emb = Tensor::from_vec(self.embeddings(&bt.tokens), (b, t, h), &dev)?;
        let feat_in = Tensor::from_vec(feat_in, (b, t, h), &dev)?;
        let target = Tensor::from_vec(bt.feat_out, (b, t, h), &dev)?;
        let mask = Tensor::from_vec(bt.mask, (b, t), &dev)?;
        let causal = Tensor::from_vec(causal_mask(t), (t, t), &dev)?;
        let (cos, sin) = self.cos_sin(t)?;
        let target_logits = target.broadcast_matmul(&self.head_rows.t()?)?;
        let target_p = candle_nn::ops::softmax(&target_logits, D::Minus1)?.detach();
        let target_arg = target_logits.argmax(D::Minus1)?;
        let (pred, k1, v1) = self.forward(&feat_in, &emb, &cos, &sin, &causal, None)?;
        let (mut total, reg, ce, acc) =
            self.losses(&pred, &target, &target_p, &target_arg, &mask, count)?;
        if self.cfg.unroll == 2 {
            // Second pass: row p reads the first pass's prediction of p - 1.
            let shifted = Tensor::cat(
                &[
                    Tensor::zeros((b, 1, h), DType::F32, &dev)?,
                    pred.detach().narrow(1, 0, t - 1)?,
                ],
                1,
            )?;
            let m2 = Tensor::from_vec(unroll_mask(t), (t, 2 * t), &dev)?;
            let (pk, pv) = (k1.detach(), v1.detach());
            let (pred2, _, _) = self.forward(&shifted, &emb, &cos, &sin, &m2, Some((&pk, &pv)))?;
            let (t2, _, _, _) =
                self.losses(&pred2, &target, &target_p, &target_arg, &mask, count)?;
            total = (total + t2)?;
        }
        self.optimise(&total)?;
        Ok(StepLoss {
            total: total.to_scalar::<f32>()? as f64,
            reg: reg.to_scalar::<f32>()? as f64,
            ce: ce.to_scalar::<f32>()? as f64,
            acc,
        })
    }

    /// Checks the sequences `idx` of `data` for a step: some given, all in `data`, features of
    /// the head's width matching the tokens, tokens in the vocabulary.
    fn check_batch(&self, data: &Dataset, idx: &[usize]) -> Result<()> {
        let vocab = self.target.config().vocab_size;
        if idx.is_empty() || data.hidden != self.h {
            return Err(CandleError::InvalidArgument(format!(
                "a step needs sequences with features of width {} ({} given, width {})",
                self.h,
                idx.len(),
                data.hidden
            )));
        }
        for &i in idx {
            let s = data.seqs.get(i).ok_or_else(|| {
                CandleError::InvalidArgument(format!("sequence {i} is not in the dataset"))
            })?;
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(CandleError::TokenOutOfVocab {
                    token: t,
                    vocab_size: vocab,
                });
            }
            if s.features.len() != s.tokens.len() * self.h || s.tokens.is_empty() {
                return Err(CandleError::InvalidArgument(format!(
                    "sequence {i}: {} features for {} tokens",
                    s.features.len(),
                    s.tokens.len()
                )));
            }
        }
        Ok(())
    }

    /// `feat_in` (`[b, t, h]`) with Gaussian noise of standard deviation `noise ·
    /// feature_rms` on every feature of a row in `mask` and every non-zero one (row 0 of each
    /// window without a previous feature stays zero).
    fn with_noise(&mut self, mut feat_in: Vec<f32>, mask: &[f32]) -> Vec<f32> {
        let (h, sigma) = (self.h, self.cfg.noise * self.feature_rms);
        if sigma > 0.0 {
            for (i, v) in feat_in.iter_mut().enumerate() {
                if mask[i / h] > 0.0 || *v != 0.0 {
                    *v += (self.rng.normal() * sigma) as f32;
                }
            }
        }
        feat_in
    }

    /// Back-propagates `total`, clips the global gradient norm to `clip` and takes one AdamW
    /// step at the scheduled learning rate.
    fn optimise(&mut self, total: &Tensor) -> Result<()> {
        let mut grads = total.backward()?;
        let mut sq = 0f64;
        for (_, v) in self.params.all() {
            if let Some(g) = grads.get(v.as_tensor()) {
                sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        let norm = sq.sqrt();
        if norm > self.cfg.clip {
            let scale = self.cfg.clip / norm;
            for (_, v) in self.params.all() {
                if let Some(g) = grads.remove(v.as_tensor()) {
                    grads.insert(v.as_tensor(), (g * scale)?);
                }
            }
        }
        self.opt.set_learning_rate(self.lr_at(self.step));
        self.opt.step(&grads)?;
        self.step += 1;
        Ok(())
    }

    /// Learning rate at `step`: linear warm-up, then cosine to 10 % of the peak.
    pub fn lr_at(&self, step: usize) -> f64 {
        let c = &self.cfg;
        if step < c.warmup {
            return c.lr * (step + 1) as f64 / c.warmup as f64;
        }
        let span = c.steps.saturating_sub(c.warmup).max(1) as f64;
        let x = ((step - c.warmup) as f64 / span).min(1.0);
        c.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * x).cos()))
    }

    /// Draws the next batch's sequence indices from `pool` (a shuffled cycle through it,
    /// reshuffled each pass), packing sequences until [`TrainConfig::batch_tokens`].
    pub fn next_batch(
        &mut self,
        data: &Dataset,
        pool: &mut [usize],
        cursor: &mut usize,
    ) -> Vec<usize> {
        let mut out = Vec::new();
        if pool.is_empty() {
            return out;
        }
        *cursor %= pool.len();
        let mut tokens = 0;
        let mut longest = 0;
        loop {
            if *cursor == 0 {
                // Fisher-Yates with the trainer's stream.
                for i in (1..pool.len()).rev() {
                    let j = self.rng.below(i + 1);
                    pool.swap(i, j);
                }
            }
            let i = pool[*cursor];
            let len = data.seqs[i].tokens.len().min(self.cfg.max_len);
            // Padding counts: a batch costs rows x its longest window.
            let cost = (out.len() + 1) * longest.max(len);
            if !out.is_empty() && cost > self.cfg.batch_tokens {
                break;
            }
            out.push(i);
            longest = longest.max(len);
            tokens += len;
            *cursor = (*cursor + 1) % pool.len();
            if tokens >= self.cfg.batch_tokens {
                break;
            }
        }
        out
    }

    /// The trained head as named tensors (f32), with the subset and `metadata`.
    ///
    /// # Errors
    /// Candle errors.
    pub fn export(
        &self,
        metadata: std::collections::BTreeMap<String, String>,
    ) -> Result<HeadTensors> {
        let mut t = HeadTensors {
            vocab_ids: self.vocab_ids.clone(),
            metadata,
            ..HeadTensors::default()
        };
        for (name, v) in self.params.all() {
            let shape = v.as_tensor().dims().to_vec();
            let data = v.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            t.tensors.insert(name.to_string(), (shape, data));
        }
        Ok(t)
    }
}

/// RMS of the features of `data` (over every value of up to the first `max_seqs` sequences).
pub fn feature_rms(data: &Dataset, max_seqs: usize) -> f64 {
    let (mut sum, mut n) = (0f64, 0usize);
    for s in data.seqs.iter().take(max_seqs) {
        for v in &s.features {
            let x = v.to_f64();
            sum += x * x;
            n += 1;
        }
    }
    (sum / n.max(1) as f64).sqrt()
}

/// Validation figures of a head.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Accuracy {
    /// Draft positions evaluated per depth.
    pub count: Vec<usize>,
    /// Top-1 accuracy per draft position (depth 1 first): the head's argmax equals the
    /// target's next token, the earlier positions fed with the true tokens and the head's own
    /// predicted features.
    pub top1: Vec<f64>,
    /// Top-3 accuracy per draft position.
    pub top3: Vec<f64>,
    /// Mean accepted length of a greedy chain of `depth` drafts (leading top-1 hits), over the
    /// positions with `depth` answer tokens after them.
    pub mean_accepted: f64,
}

/// Evaluates `head` along the greedy answers of `data` (sequences with temperature 0; none:
/// all counts 0): at every `stride`-th answer position, `depth` drafts with the true tokens
/// fed and the head's own predicted features for every drafted position (module docs); the
/// features are the dataset's f16 values.
///
/// # Errors
/// [`CandleError::InvalidArgument`] for `depth == 0` or features of another width than the
/// head's; errors of the head's forward.
pub fn evaluate(
    head: &mut DraftHead,
    data: &Dataset,
    depth: usize,
    stride: usize,
) -> Result<Accuracy> {
    let h = data.hidden;
    if depth == 0 || h != head.weights().config().hidden_size {
        return Err(CandleError::InvalidArgument(format!(
            "evaluate needs depth >= 1 ({depth}) and features of the head's width ({h})"
        )));
    }
    let mut tally = Tally::new(depth);
    let mut logits = Vec::new();
    let mut feats: Vec<f32> = Vec::new();
    let vocab = speculative::TargetModel::vocab_size(head);
    for s in data.seqs.iter().filter(|s| s.temperature == 0.0) {
        let len = s.tokens.len();
        feats.clear();
        feats.extend(s.features.iter().map(|f| f.to_f32()));
        head.truncate_to(0)?;
        head.set_features(0, &[])?;
        let first = s.prompt_len.max(1) - 1;
        // Positions p whose row predicts token p + 1 (an answer token).
        let mut p = first;
        let mut known = 0;
        while p + 1 < len {
            // The head holds the target features of 0 .. p - 1 and the rows 0 .. p - 1.
            let start = known.min(p);
            head.set_features(start, &feats[start * h..p * h])?;
            known = p;
            let held = speculative::TargetModel::seq_len(head);
            if held < p {
                head.prefill_tokens(&s.tokens[held..p])?;
            }
            let n = depth.min(len - 1 - p);
            head.forward_logits(&s.tokens[p..p + n], &mut logits)?;
            tally.score(&logits, vocab, &s.tokens[p + 1..p + 1 + n]);
            p += stride.max(1);
        }
    }
    Ok(tally.accuracy())
}

/// The counts of [`evaluate`], per draft position `k < depth`.
struct Tally {
    depth: usize,
    hits1: Vec<usize>,
    hits3: Vec<usize>,
    count: Vec<usize>,
    /// Sum and number of the accepted lengths of full-depth windows.
    acc_sum: usize,
    acc_n: usize,
}

impl Tally {
    fn new(depth: usize) -> Self {
        Tally {
            depth,
            hits1: vec![0; depth],
            hits3: vec![0; depth],
            count: vec![0; depth],
            acc_sum: 0,
            acc_n: 0,
        }
    }

    /// Scores one window: row `k` of `logits` (`[n, vocab]`) against `truth[k]` (`n` tokens).
    fn score(&mut self, logits: &[f32], vocab: usize, truth: &[u32]) {
        let mut chain = true;
        let mut accepted = 0;
        for (k, &truth) in truth.iter().enumerate() {
            let best = top3(&logits[k * vocab..(k + 1) * vocab]);
            let truth = truth as usize;
            self.count[k] += 1;
            if best[0] == truth {
                self.hits1[k] += 1;
                if chain {
                    accepted += 1;
                }
            } else {
                chain = false;
            }
            if best.contains(&truth) {
                self.hits3[k] += 1;
            }
        }
        if truth.len() == self.depth {
            self.acc_sum += accepted;
            self.acc_n += 1;
        }
    }

    fn accuracy(self) -> Accuracy {
        let frac = |h: &[usize]| -> Vec<f64> {
            h.iter()
                .zip(&self.count)
                .map(|(&x, &n)| x as f64 / n.max(1) as f64)
                .collect()
        };
        Accuracy {
            top1: frac(&self.hits1),
            top3: frac(&self.hits3),
            mean_accepted: self.acc_sum as f64 / self.acc_n.max(1) as f64,
            count: self.count,
        }
    }
}

/// The ids of the 3 largest values of `row`, largest first (`usize::MAX` past the row's
/// length; the first of equal values wins).
fn top3(row: &[f32]) -> [usize; 3] {
    let mut best = [(f32::NEG_INFINITY, usize::MAX); 3];
    for (i, &v) in row.iter().enumerate() {
        if v > best[2].0 {
            best[2] = (v, i);
            best.sort_by(|a, b| b.0.total_cmp(&a.0));
        }
    }
    best.map(|b| b.1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fast::head::DraftHeadWeights;
    use crate::fast::{FastFormat, RandomSpec};
    use speculative::{TargetFeatures, TargetModel};

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// The training forward (candle) and the shipped inference head (`DraftHead`) compute the
    /// same function: first pass against a chain forward with every target feature held,
    /// second pass against a row that reads the head's own prediction. 4 query heads on 2
    /// key-value heads, so a wrong grouping order shows.
    #[test]
    fn training_forward_equals_the_inference_head() {
        let w = FastWeights::random(&RandomSpec::default(), FastFormat::F32).unwrap();
        let (h, t) = (96, 12);
        let cfg = TrainConfig {
            n_heads: 4,
            n_kv_heads: 2,
            ffn_size: 40,
            ..TrainConfig::default()
        };
        let ids: Vec<u32> = (0..301).step_by(2).collect();
        let tr = Trainer::new(cfg, w.clone(), ids).unwrap();
        // Weights away from their initial scale: a few random steps' worth of change.
        let mut rng = SplitMix::new(5);
        for (_, v) in tr.params.all() {
            let n = v.as_tensor().elem_count();
            let noise: Vec<f32> = (0..n).map(|_| 0.2 * rng.normal() as f32).collect();
            let z = Tensor::from_vec(noise, v.as_tensor().shape(), &Device::Cpu).unwrap();
            v.set(&(v.as_tensor() + z).unwrap()).unwrap();
        }
        let tokens: Vec<u32> = (0..t as u32).map(|i| (i * 37 + 5) % 301).collect();
        let feats: Vec<f32> = (0..t * h).map(|_| rng.normal() as f32).collect();
        let mut shifted = vec![0f32; t * h];
        shifted[h..].copy_from_slice(&feats[..(t - 1) * h]);
        let dev = Device::Cpu;
        let feat_in = Tensor::from_vec(shifted, (1, t, h), &dev).unwrap();
        let emb = Tensor::from_vec(tr.embeddings(&tokens), (1, t, h), &dev).unwrap();
        let mut causal = vec![0f32; t * t];
        for i in 0..t {
            for j in i + 1..t {
                causal[i * t + j] = f32::NEG_INFINITY;
            }
        }
        let causal = Tensor::from_vec(causal, (t, t), &dev).unwrap();
        let (cos, sin) = tr.cos_sin(t).unwrap();
        let (pred, k1, v1) = tr
            .forward(&feat_in, &emb, &cos, &sin, &causal, None)
            .unwrap();
        let pred: Vec<f32> = pred.flatten_all().unwrap().to_vec1().unwrap();

        let hw =
            DraftHeadWeights::from_tensors(&tr.export(Default::default()).unwrap(), w).unwrap();
        let mut head = DraftHead::new(hw.clone());
        head.set_target_hidden(0, &feats[..(t - 1) * h]).unwrap();
        let mut logits = Vec::new();
        head.forward(&tokens, &mut logits).unwrap();
        let d1 = max_diff(head.last_predicted(), &pred);
        assert!(d1 < 1e-4, "first pass differs by {d1}");

        // Second pass: row p reads the first pass's prediction of p - 1.
        let mut m2 = vec![f32::NEG_INFINITY; t * 2 * t];
        for i in 0..t {
            for j in 0..i {
                m2[i * 2 * t + j] = 0.0;
            }
            m2[i * 2 * t + t + i] = 0.0;
        }
        let m2 = Tensor::from_vec(m2, (t, 2 * t), &dev).unwrap();
        let mut s2 = vec![0f32; t * h];
        s2[h..].copy_from_slice(&pred[..(t - 1) * h]);
        let s2 = Tensor::from_vec(s2, (1, t, h), &dev).unwrap();
        let (pred2, _, _) = tr
            .forward(&s2, &emb, &cos, &sin, &m2, Some((&k1, &v1)))
            .unwrap();
        let pred2: Vec<f32> = pred2.flatten_all().unwrap().to_vec1().unwrap();
        for p in [1, 5, t - 1] {
            // Target features of 0 .. p - 2 held: row p - 1 reads f_{p-2}, row p the head's
            // own prediction of p - 1.
            let mut m = DraftHead::new(hw.clone());
            m.set_target_hidden(0, &feats[..(p - 1) * h]).unwrap();
            m.forward(&tokens[..=p], &mut logits).unwrap();
            let got = &m.last_predicted()[p * h..(p + 1) * h];
            let d2 = max_diff(got, &pred2[p * h..(p + 1) * h]);
            assert!(d2 < 1e-4, "second pass at {p} differs by {d2}");
        }
    }

    #[test]
    fn bad_training_input_is_a_typed_error() {
        let w = FastWeights::random(&RandomSpec::default(), FastFormat::F32).unwrap();
        let mut tr = Trainer::new(TrainConfig::default(), w, vec![1, 2, 3]).unwrap();
        let empty = Dataset {
            hidden: 96,
            seqs: Vec::new(),
        };
        assert!(tr.next_batch(&empty, &mut [], &mut 0).is_empty());
        assert!(tr.step(&empty, &[]).is_err());
        let wrong = Dataset {
            hidden: 8,
            seqs: vec![Sequence {
                tokens: vec![1, 2],
                prompt_len: 1,
                temperature: 0.0,
                features: vec![half::f16::ZERO; 16],
            }],
        };
        assert!(tr.step(&wrong, &[0]).is_err());
        let oov = Dataset {
            hidden: 96,
            seqs: vec![Sequence {
                tokens: vec![1, 999],
                prompt_len: 1,
                temperature: 0.0,
                features: vec![half::f16::ZERO; 192],
            }],
        };
        assert!(tr.step(&oov, &[0]).is_err());
        assert!(
            Trainer::new(
                TrainConfig {
                    unroll: 3,
                    ..TrainConfig::default()
                },
                FastWeights::random(&RandomSpec::default(), FastFormat::F32).unwrap(),
                vec![1]
            )
            .is_err()
        );
    }
}
