//! The decoding loop, stop conditions, draft length policies and metrics.
//!
//! [`Generator`] runs speculative decoding over any [`TargetModel`] (re-exported here from
//! [`crate::model`]) and [`crate::Proposer`]: propose, one target forward over
//! `[last token, d_1 .. d_k]` (or over a token tree, [`GenerationParams::tree_nodes`]), verify,
//! commit (truncate, or keep the accepted path of a tree), observe.

mod batch;
mod generator;
pub mod goodput;
mod metrics;
mod params;
mod policy;
mod stop;

pub use crate::model::TargetModel;
pub use batch::{
    BatchConfig, BatchGenerator, BatchMetrics, BatchRequest, BatchStepStats, Finished, RequestId,
};
pub use generator::{Generation, GenerationError, Generator, Session, StepStats, StreamChunk};
pub use goodput::GoodputConfig;
pub use metrics::Metrics;
pub use params::GenerationParams;
pub use policy::{AdaptiveConfig, AdaptiveState, DraftLength, PlannedNode, TreeShape};
pub use stop::{Detokenizer, FinishReason, StopConditions};
