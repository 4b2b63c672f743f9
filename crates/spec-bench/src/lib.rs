//! `spec-bench`: reproducible speculative-decoding benchmarks.
//!
//! Fix the target model, prompts, sampling configuration, stop rules and hardware; run a matrix
//! of proposers x draft lengths x sampling configurations x seeds against plain decoding in the
//! same process, interleaved; record end-to-end latency, time to first token, inter-token
//! latency percentiles, output throughput, peak memory, the propose / verify time split,
//! acceptance by draft and output position, and speed-ups with their spread. Results go to a JSON
//! file, a markdown table and SVG plots. The [`sim`] module answers "does speculation still pay
//! at batch size B?" from a cost table and recorded acceptance.
//!
//! The library is generic over [`speculative::TargetModel`] and [`speculative::Proposer`]; the
//! `spec-bench` binary wires it to the SmolLM2 GGUF through `speculative-candle`.

#![deny(missing_docs)]

pub mod draft_model;
pub mod error;
pub mod matrix;
pub mod replay;
pub mod report;
pub mod run;
pub mod serve;
pub mod serve_reuse;
pub mod sim;
pub mod stats;
pub mod workload;

pub use error::{BenchError, Result};
