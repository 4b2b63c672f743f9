//! The configuration matrix, interleaved with the plain baseline.

use speculative::{Proposer, TargetModel};

use crate::error::Result;
use crate::run::{ConfigSpec, RunInput, RunRecord, run_one};

/// A tokenized request.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedRequest {
    /// Kind, for aggregates.
    pub kind: String,
    /// Prompt tokens (chat template applied).
    pub prompt: Vec<u32>,
    /// Maximum new tokens.
    pub max_tokens: usize,
}

/// The matrix: configurations, warm-up runs and repetitions.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    /// Speculative configurations.
    pub configs: Vec<ConfigSpec>,
    /// Warm-up generations (of the first request, discarded) per configuration and baseline.
    pub warmup: usize,
    /// Repetitions of every (request, configuration) pair.
    pub reps: usize,
}

/// Creates a proposer from its name.
pub type ProposerFactory<'a> = dyn FnMut(&str) -> Result<Box<dyn Proposer>> + 'a;

/// Runs the matrix. For each request and repetition, and for each sampling key (temperature,
/// top-p, seed) in the matrix, the plain baseline runs first and then every speculative
/// configuration with that key, in an order rotated by the repetition index, so that machine
/// drift affects the baseline and the speculative runs alike. Each speculative record gets its
/// speed-up against that baseline (ratio of tokens per second) and, for greedy runs, whether its
/// tokens equal the baseline's.
///
/// Every run gets a fresh proposer from `factory`, so that no run can draw on the output of an
/// earlier run of the same request (a suffix proposer's shared corpus would otherwise replay the
/// identical greedy answer of the previous configuration or repetition and overstate its
/// acceptance). Cross-request corpus effects are therefore not measured here.
///
/// `progress` is called after each generation with a short description.
///
/// # Errors
/// Errors of the factory and of the decoding loop.
pub fn run_matrix(
    target: &mut dyn TargetModel,
    factory: &mut ProposerFactory<'_>,
    requests: &[PreparedRequest],
    eos: &[u32],
    matrix: &Matrix,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<RunRecord>> {
    // Check every proposer name once, before any run.
    for c in &matrix.configs {
        factory(&c.proposer)?;
    }
    // Group configurations by sampling key, keeping first-seen order.
    let mut keys: Vec<(f32, f32, u64)> = Vec::new();
    for c in &matrix.configs {
        let k = (c.temperature, c.top_p, c.seed);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut none = speculative::NoProposer;
    // Warm-up on the first request.
    if let Some(r0) = requests.first() {
        for w in 0..matrix.warmup {
            let input = RunInput {
                request: 0,
                kind: &r0.kind,
                prompt: &r0.prompt,
                max_tokens: r0.max_tokens,
                eos,
                rep: w,
            };
            let s = matrix
                .configs
                .first()
                .map(|c| c.sampling())
                .transpose()?
                .unwrap_or_default();
            run_one(target, &mut none, &input, None, &s, 0)?;
            for c in &matrix.configs {
                let mut p = factory(&c.proposer)?;
                run_one(target, &mut *p, &input, Some(c), &c.sampling()?, c.seed)?;
            }
            progress("warm-up");
        }
    }
    let mut out = Vec::new();
    for (ri, r) in requests.iter().enumerate() {
        for rep in 0..matrix.reps {
            let input = RunInput {
                request: ri,
                kind: &r.kind,
                prompt: &r.prompt,
                max_tokens: r.max_tokens,
                eos,
                rep,
            };
            for &(t, p, seed) in &keys {
                let group: Vec<&ConfigSpec> = matrix
                    .configs
                    .iter()
                    .filter(|c| (c.temperature, c.top_p, c.seed) == (t, p, seed))
                    .collect();
                let sampling = group[0].sampling()?;
                let base = run_one(target, &mut none, &input, None, &sampling, seed)?;
                progress(&format!("request {ri} rep {rep} plain"));
                let n = group.len();
                for j in 0..n {
                    let c = group[(j + rep) % n];
                    let mut prop = factory(&c.proposer)?;
                    let mut rec = run_one(target, &mut *prop, &input, Some(c), &sampling, seed)?;
                    if base.tokens_per_s > 0.0 {
                        rec.speedup = Some(rec.tokens_per_s / base.tokens_per_s);
                    }
                    if t == 0.0 {
                        rec.greedy_identical = Some(rec.tokens == base.tokens);
                    }
                    progress(&format!("request {ri} rep {rep} {}", c.label()));
                    out.push(rec);
                }
                out.push(base);
            }
        }
    }
    Ok(out)
}
