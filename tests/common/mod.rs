//! Helpers shared by the verifier proofs (closed form, statistics, cases, greedy).
//!
//! Only thin wrappers over the crate's public API live here; nothing in this module decides
//! whether a test passes.

#![allow(dead_code)]

pub mod steps;
pub mod text;
pub mod tree;

use speculative::sampling::{History, RowProcessor, TokenCounts};
use speculative::{Result, RowKind, SamplingConfig, TokenDist};
use statrs::distribution::{ChiSquared, ContinuousCDF};

/// The processed distribution of one row of `logits` after the token `prefix` (penalties count
/// every token of `prefix`; `prefix` tokens must be `< vocab`).
pub fn process(
    cfg: &SamplingConfig,
    logits: &[f32],
    prefix: &[u32],
    vocab: usize,
) -> Result<TokenDist> {
    let counts = TokenCounts::from_tokens(prefix, vocab)?;
    let hist = History {
        counts: Some(&counts),
        prefix,
        suppress: &[],
    };
    let mut d = TokenDist::default();
    RowProcessor::new().distribution(cfg, logits, &hist, RowKind::Target, 0, &mut d)?;
    Ok(d)
}

/// Temperature 0.7 + top-p 0.9 + top-k 3 (a configuration of the chi-square suite,
/// `tests/statistical.rs`).
pub fn nucleus_config() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(0.7)
        .top_p(0.9)
        .top_k(3)
        .build()
        .unwrap()
}

/// Temperature 1.2 + min-p 0.25 (a configuration of the chi-square suite).
pub fn min_p_config() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(1.2)
        .min_p(0.25)
        .build()
        .unwrap()
}

/// Repetition 2.5, presence 0.5, frequency 0.3 at temperature 1 (a configuration of the
/// chi-square suite).
pub fn penalty_config() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(1.0)
        .repetition_penalty(2.5)
        .presence_penalty(0.5)
        .frequency_penalty(0.3)
        .build()
        .unwrap()
}

/// A distribution as a dense row of `width` probabilities (entries beyond its support are 0).
pub fn dense(d: &TokenDist, width: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; width];
    for (&t, &p) in d.ids().iter().zip(d.probs()) {
        out[t as usize] = p;
    }
    out
}

/// Softmax at temperature 1 with no processing at all (the "raw" q of the negative controls).
pub fn raw_softmax(logits: &[f32]) -> Vec<f32> {
    let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits.iter().map(|&l| ((l - mx) as f64).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|&x| (x / s) as f32).collect()
}

/// The result of a goodness-of-fit test.
#[derive(Debug, Clone, Copy)]
pub struct Fit {
    /// Pearson's chi-square statistic over the pooled bins.
    pub stat: f64,
    /// Degrees of freedom (bins - 1).
    pub df: usize,
    /// Upper-tail p-value; exactly 0 when an outcome of probability 0 was observed.
    pub p_value: f64,
    /// Number of observations in cells whose exact probability is 0.
    pub impossible: u64,
}

/// Pearson chi-square goodness-of-fit of `observed` counts against exact cell probabilities
/// `expected` (summing to 1).
///
/// Cells with probability 0 must never be observed: one observation there makes the p-value 0.
/// Cells whose expected count is below 5 are pooled into one bin (the usual validity rule for the
/// chi-square approximation); the pooled bin is dropped only if its expected count stays below 1.
pub fn chi_square(observed: &[u64], expected: &[f64]) -> Fit {
    assert_eq!(observed.len(), expected.len());
    let n: u64 = observed.iter().sum();
    let nf = n as f64;
    let mut impossible = 0u64;
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let (mut pool_o, mut pool_e) = (0.0f64, 0.0f64);
    for (&o, &p) in observed.iter().zip(expected) {
        if p <= 0.0 {
            impossible += o;
            continue;
        }
        let e = p * nf;
        if e < 5.0 {
            pool_o += o as f64;
            pool_e += e;
        } else {
            bins.push((o as f64, e));
        }
    }
    if pool_e >= 1.0 {
        bins.push((pool_o, pool_e));
    }
    let stat: f64 = bins.iter().map(|&(o, e)| (o - e) * (o - e) / e).sum();
    let df = bins.len().saturating_sub(1).max(1);
    let p_value = if impossible > 0 {
        0.0
    } else {
        ChiSquared::new(df as f64).expect("df > 0").sf(stat)
    };
    Fit {
        stat,
        df,
        p_value,
        impossible,
    }
}

/// Steps 1-3 of the documented pipeline (GUIDE section 1), written from the definitions:
/// penalties over `history` (CTRL repetition once per distinct token, then OpenAI
/// `count * f + (count > 0) * pr`), logit bias (the last entry for a token wins), banned tokens,
/// allowed set. Used as the independent reference of the processing tests.
#[derive(Debug, Clone, Copy)]
pub struct Masking<'a> {
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
    pub bias: &'a [(u32, f32)],
    pub banned: &'a [u32],
    pub allowed: Option<&'a [u32]>,
}

impl Masking<'_> {
    /// The row after steps 1-3 (tokens of the configuration outside the row are ignored).
    pub fn apply(&self, row: &[f32], history: &[u32]) -> Vec<f32> {
        let mut e = row.to_vec();
        let mut counts = std::collections::BTreeMap::<u32, u32>::new();
        for &t in history {
            *counts.entry(t).or_insert(0) += 1;
        }
        for (&t, &c) in &counts {
            let Some(l) = e.get_mut(t as usize) else {
                continue;
            };
            if self.repetition != 1.0 {
                *l = if *l > 0.0 {
                    *l / self.repetition
                } else {
                    *l * self.repetition
                };
            }
            *l -= c as f32 * self.frequency + if c > 0 { self.presence } else { 0.0 };
        }
        let mut bias = std::collections::HashMap::new();
        for &(t, v) in self.bias {
            bias.insert(t, v);
        }
        for (&t, &v) in &bias {
            if let Some(l) = e.get_mut(t as usize) {
                *l += v;
            }
        }
        for &t in self.banned {
            if let Some(l) = e.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        if let Some(a) = self.allowed {
            for (t, l) in e.iter_mut().enumerate() {
                if !a.contains(&(t as u32)) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        e
    }
}
