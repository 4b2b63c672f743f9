//! The decoding loop, stop conditions, draft length policies and metrics.
//!
//! [`Generator`] runs speculative decoding over any [`TargetModel`] (re-exported here from
//! [`crate::model`]) and [`crate::Proposer`]: propose, one target forward over
//! `[last token, d_1 .. d_k]` (or over a token tree, [`GenerationParams::tree_nodes`]), verify,
//! commit (truncate, or keep the accepted path of a tree), observe.
//!
//! [`BatchGenerator`] runs many generations at once over a [`crate::BatchTarget`] (continuous
//! batching): each step is one batched forward over every active sequence's rows (chunked
//! prompt prefill, verify chains, token trees) and one [`crate::Verifier::verify_batch`]; each
//! request has its own proposer, parameters, stream and result, and gets the same output it
//! would get from a [`Generator`] alone. The draft lengths of adaptive requests are chosen for
//! the whole batch by the goodput policy ([`goodput`]). Engines that run one sequence at a time
//! use it through [`crate::PerSlot`].
//!
//! Both policies learn step costs through a [`StepCosts`] source: the measured clock
//! ([`MeasuredCosts`], the default) or a fixed curve ([`FixedCosts`]) that makes their choices
//! independent of the machine's load ([`Generator::with_costs`], [`BatchGenerator::with_costs`]).

mod batch;
mod costs;
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
pub use costs::{FixedCosts, MeasuredCosts, StepCosts};
pub use generator::{Generation, GenerationError, Generator, Session, StepStats, StreamChunk};
pub use goodput::GoodputConfig;
pub use metrics::Metrics;
pub use params::GenerationParams;
pub use policy::{AdaptiveConfig, AdaptiveState, DraftLength, PlannedNode, TreeShape};
pub use stop::{Detokenizer, FinishReason, StopConditions};
