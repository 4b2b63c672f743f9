//! Generators of the closed-form suite (`tests/closed_form.rs`), shared with the dtype suite
//! (`tests/dtypes.rs`): random sampling parameters, logits and full verify steps.

use proptest::collection::vec;
use proptest::prelude::*;
use speculative::SamplingConfig;

use super::{dense, process};

/// Raw sampling parameters, turned into a [`SamplingConfig`] by [`Params::config`].
#[derive(Debug, Clone)]
pub struct Params {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
    pub bias: Vec<(u32, f32)>,
    pub banned: Vec<u32>,
    pub allowed: Option<Vec<u32>>,
    pub context: Vec<u32>,
}

impl Params {
    pub fn config(&self) -> SamplingConfig {
        let mut b = SamplingConfig::builder()
            .temperature(self.temperature)
            .top_k(self.top_k)
            .top_p(self.top_p)
            .min_p(self.min_p)
            .repetition_penalty(self.repetition)
            .frequency_penalty(self.frequency)
            .presence_penalty(self.presence)
            .banned_tokens(self.banned.iter().copied());
        for &(t, v) in &self.bias {
            b = b.logit_bias(t, v);
        }
        if let Some(a) = &self.allowed {
            b = b.allowed_tokens(a.iter().copied());
        }
        b.build().expect("generated parameters are valid")
    }

    pub fn masking(&self) -> super::Masking<'_> {
        super::Masking {
            repetition: self.repetition,
            frequency: self.frequency,
            presence: self.presence,
            bias: &self.bias,
            banned: &self.banned,
            allowed: self.allowed.as_deref(),
        }
    }

    /// Makes sure token `keep` survives the masks, so every row has an allowed token.
    pub fn protect(&mut self, keep: u32) {
        self.banned.retain(|&t| t != keep);
        for (t, v) in self.bias.iter_mut() {
            if *t == keep && *v == f32::NEG_INFINITY {
                *v = 0.0;
            }
        }
        if let Some(a) = self.allowed.as_mut() {
            a.push(keep);
        }
    }
}

pub fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        10 => -8.0f32..8.0,
        2 => Just(f32::NEG_INFINITY),
        2 => prop::sample::select(vec![-1.0f32, 0.0, 1.0, 2.5]),
        1 => -1e30f32..1e30,
    ]
}

pub fn temperature(greedy_too: bool) -> BoxedStrategy<f32> {
    let t = prop_oneof![
        1 => 1e-3f32..0.05,
        4 => 0.05f32..3.0,
        1 => Just(1.0f32),
    ];
    if greedy_too {
        prop_oneof![5 => t, 1 => Just(0.0f32)].boxed()
    } else {
        t.boxed()
    }
}

pub fn params(vocab: usize, greedy_too: bool) -> impl Strategy<Value = Params> {
    let v = vocab as u32;
    (
        temperature(greedy_too),
        prop_oneof![2 => Just(0usize), 3 => 0..=vocab],
        prop_oneof![1 => Just(1.0f32), 2 => 0.01f32..=1.0],
        prop_oneof![1 => Just(0.0f32), 1 => 0.0f32..=0.5],
        prop_oneof![2 => Just(1.0f32), 1 => 0.5f32..2.5],
        prop_oneof![2 => Just(0.0f32), 1 => -1.0f32..1.0],
        prop_oneof![2 => Just(0.0f32), 1 => -1.0f32..1.0],
        vec(
            (
                0..v,
                prop_oneof![4 => -5.0f32..5.0, 1 => Just(f32::NEG_INFINITY)],
            ),
            0..4,
        ),
        vec(0..v, 0..4),
        prop_oneof![4 => Just(None), 1 => vec(0..v, 1..6).prop_map(Some)],
        vec(0..v, 0..10),
    )
        .prop_map(
            |(
                temperature,
                top_k,
                top_p,
                min_p,
                repetition,
                frequency,
                presence,
                bias,
                banned,
                allowed,
                context,
            )| Params {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition,
                frequency,
                presence,
                bias,
                banned,
                allowed,
                context,
            },
        )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QMode {
    PointMass,
    Probs,
    Logits,
}

/// A full verify step: `[k + 1, vocab]` target logits, `[k, qv]` draft logits, drafts sampled
/// by the test from the processed draft rows (or arbitrary tokens for point masses).
#[derive(Debug, Clone)]
pub struct StepCase {
    pub vocab: usize,
    pub qv: usize,
    pub k: usize,
    pub target: Vec<f32>,
    pub draft_logits: Vec<f32>,
    pub point_drafts: Vec<u32>,
    pub draft_uniforms: Vec<f32>,
    pub mode: QMode,
    pub params: Params,
    pub seed: u64,
    /// A token that no mask removes, finite in every row.
    pub keep: u32,
}

pub fn step_case() -> impl Strategy<Value = StepCase> {
    step_case_in(2..=40, 5)
}

/// [`step_case`] with the vocabulary drawn from `vocab` and `k <= k_max`.
pub fn step_case_in(
    vocab: std::ops::RangeInclusive<usize>,
    k_max: usize,
) -> impl Strategy<Value = StepCase> {
    (vocab, 0usize..=k_max, any::<bool>())
        .prop_flat_map(|(vocab, k, padded)| {
            let qv = if padded {
                (1..=vocab).boxed()
            } else {
                Just(vocab).boxed()
            };
            (Just(vocab), Just(k), qv)
        })
        .prop_flat_map(|(vocab, k, qv)| {
            (
                Just((vocab, k, qv)),
                vec(logit(), (k + 1) * vocab),
                vec(logit(), k * qv),
                vec(0..vocab as u32, k),
                vec(0.0f32..1.0, k),
                prop::sample::select(vec![QMode::PointMass, QMode::Probs, QMode::Logits]),
                params(vocab, true),
                (0..qv as u32, any::<u64>()),
            )
        })
        .prop_map(
            |(
                (vocab, k, qv),
                mut target,
                mut draft_logits,
                point_drafts,
                draft_uniforms,
                mode,
                mut params,
                (keep, seed),
            )| {
                for r in 0..=k {
                    target[r * vocab + keep as usize] = 0.5;
                }
                for r in 0..k {
                    draft_logits[r * qv + keep as usize] = 0.25;
                }
                params.protect(keep);
                StepCase {
                    vocab,
                    qv,
                    k,
                    target,
                    draft_logits,
                    point_drafts,
                    draft_uniforms,
                    mode,
                    params,
                    seed,
                    keep,
                }
            },
        )
}

/// Draws the drafts the way a sampling proposer would and returns (drafts, dense q rows).
pub fn draw_drafts(c: &StepCase, cfg: &SamplingConfig) -> (Vec<u32>, Vec<f32>) {
    if c.mode == QMode::PointMass {
        return (c.point_drafts.clone(), Vec::new());
    }
    let mut prefix = c.params.context.clone();
    let mut drafts = Vec::new();
    let mut q_rows = Vec::new();
    for i in 0..c.k {
        let row = &c.draft_logits[i * c.qv..(i + 1) * c.qv];
        let q = process(cfg, row, &prefix, c.vocab).unwrap();
        let x = q.sample(c.draft_uniforms[i]).unwrap();
        q_rows.extend(dense(&q, c.qv));
        drafts.push(x);
        prefix.push(x);
    }
    (drafts, q_rows)
}
