//! The engines `speculate` runs on: the target model and a maker of draft models on the same
//! weights (`--backend` / `--engine`).

use std::path::Path;
use std::sync::Arc;

use speculative::TargetModel;
use speculative_candle::fast::{FastFormat, FastTarget, FastWeights};
use speculative_candle::{CandleTarget, LlamaWeights, LoadOptions, WeightFormat};

use crate::args::{Args, Backend, Format};

/// The error type of the command (printed by `main`).
pub type DynError = Box<dyn std::error::Error>;

/// Makes a model sharing the loaded weights: `None` the full model, `Some(n)` an early exit
/// after `n` layers.
pub type ModelMaker = Box<dyn Fn(Option<usize>) -> Result<Box<dyn TargetModel>, DynError>>;

/// A loaded engine.
pub struct Engine {
    /// The target model, with an empty KV cache.
    pub target: Box<dyn TargetModel>,
    /// Draft models on the target's weights.
    pub draft_for: ModelMaker,
    /// The fast backend's weights (the draft head runs on them); `None` on other backends.
    pub fast_weights: Option<Arc<FastWeights>>,
}

/// Loads the GGUF file `path` on the engine `a.backend` chooses, in `a.format`.
///
/// # Errors
/// The engine's load error, or (`--engine llama` without the `llama` feature) a message saying
/// how to build it.
pub fn load(a: &Args, path: &Path) -> Result<Engine, DynError> {
    match a.backend {
        Backend::Fast => fast(path, a.format, a.threads),
        Backend::Candle => candle(path, a.format),
        Backend::Llama => llama(path, a.threads),
    }
}

/// [`FastTarget`]s (`speculative_candle::fast`) on one set of weights.
fn fast(path: &Path, format: Format, threads: usize) -> Result<Engine, DynError> {
    let format = match format {
        Format::Q8 => FastFormat::Q8,
        Format::F32 => FastFormat::F32,
    };
    let w = FastWeights::load(path, format)?;
    let w2 = w.clone();
    Ok(Engine {
        target: Box::new(FastTarget::new(w.clone()).with_threads(threads)),
        draft_for: Box::new(move |layers| {
            Ok(match layers {
                Some(n) => Box::new(FastTarget::early_exit(w2.clone(), n)?.with_threads(threads)),
                None => Box::new(FastTarget::new(w2.clone()).with_threads(threads)),
            })
        }),
        fast_weights: Some(w),
    })
}

/// [`CandleTarget`]s on one set of weights.
fn candle(path: &Path, format: Format) -> Result<Engine, DynError> {
    let format = match format {
        Format::Q8 => WeightFormat::Q8_0,
        Format::F32 => WeightFormat::F32,
    };
    let w = LlamaWeights::load_with(path, &LoadOptions::with_format(format))?;
    Ok(Engine {
        target: Box::new(CandleTarget::new(w.clone())),
        draft_for: Box::new(move |layers| {
            Ok(match layers {
                Some(n) => Box::new(CandleTarget::early_exit(w.clone(), n)?),
                None => Box::new(CandleTarget::new(w.clone())),
            })
        }),
        fast_weights: None,
    })
}

/// A llama.cpp target (context: the model's training length, at most 8,192) and a maker of
/// more (draft models on the same weights; no early exit).
#[cfg(feature = "llama")]
fn llama(path: &Path, threads: usize) -> Result<Engine, DynError> {
    use speculative_llama::{LlamaConfig, LlamaEngine, ModelOptions};
    let engine = LlamaEngine::load(path, &ModelOptions::default())?;
    if speculative_llama::cpu_weight_repacking()? {
        eprintln!(
            "note: this llama.cpp build repacks weights (GGML_CPU_REPACK on): verify rows of \
             Q4_0 / Q4_K / IQ4_NL weights are not bit-identical to single rows, so greedy \
             output may leave plain greedy output at a near tie (see speculative_llama::cpu_weight_repacking)"
        );
    }
    // The training context, capped as in spec-bench: a long-context model would otherwise
    // allocate its whole KV cache (twice with `--proposer same-model`).
    let cfg = LlamaConfig::default()
        .with_threads(threads)
        .with_context(engine.context_train().min(8192));
    Ok(Engine {
        target: Box::new(engine.target(&cfg)?),
        draft_for: Box::new(move |layers| match layers {
            Some(_) => Err("--proposer early-exit needs --backend fast or candle".into()),
            None => Ok(Box::new(engine.target(&cfg)?)),
        }),
        fast_weights: None,
    })
}

/// Without the `llama` feature: the error that says how to build it.
#[cfg(not(feature = "llama"))]
fn llama(_: &Path, _: usize) -> Result<Engine, DynError> {
    Err(LLAMA_MISSING.into())
}

/// The error of `--engine llama` in a build without the `llama` feature.
#[cfg(not(feature = "llama"))]
pub const LLAMA_MISSING: &str = "--engine llama needs speculate built with `--features llama` \
     (cargo run --release -p speculate --features llama -- --engine llama ...)";

#[cfg(all(test, not(feature = "llama")))]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn llama_without_the_feature_says_how_to_build_it() {
        let a = Args::try_parse_from(["speculate", "--engine", "llama"]).unwrap();
        let err = load(&a, Path::new("/nonexistent.gguf")).err().unwrap();
        assert_eq!(err.to_string(), LLAMA_MISSING);
    }
}
