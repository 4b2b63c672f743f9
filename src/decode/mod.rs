//! The decoding loop, stop conditions, draft length policies and metrics.
//!
//! [`Generator`] runs speculative decoding over any [`TargetModel`] (re-exported here from
//! [`crate::model`]) and [`crate::Proposer`]: propose, one target forward over
//! `[last token, d_1 .. d_k]` (or over a token tree, [`GenerationParams::tree`]), verify,
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
//! Both loops are thin drivers over one per-sequence state machine (`decode/sequence.rs`): a
//! sequence plans its step (budget, draft length or tree shape, propose, cut at the first
//! stop), names the rows to feed and the verify request of the logits the engine returned,
//! commits the verified tokens (saying what the engine must do to its cache: keep `n`
//! positions, or commit a tree path) and observes the step, without ever calling the engine;
//! so every request of a [`BatchGenerator`] runs the same phase code as a [`Generator`].
//!
//! # Stop rules
//!
//! Every stop rule of both loops, in one place; chains, trees and commits run the same scan.
//! Write the generated tokens `g_1 .. g_n` (the prompt is never matched), `m` for
//! [`GenerationParams::min_tokens`] and `D` for the [`Detokenizer`].
//!
//! 1. **Floor.** A stop of any kind (EOS id, stop sequence, stop string) ends the generation
//!    only at a token `g_i` with `i >= m`: it must *complete* at or after the floor (a stop
//!    string that completed earlier is not found later; which other stops are configured never
//!    changes this). The tokens `g_i` with `i <= m` are never an EOS id or the id of a
//!    single-token stop sequence ([`StopConditions::suppressed_ids`]): those ids are banned at
//!    every target row *and* every draft row of those positions
//!    ([`crate::ProposeRequest::suppress`], case C19).
//! 2. **Token stops** at `g_i`: [`FinishReason::Eos`] when `g_i` is an EOS id, else
//!    [`FinishReason::StopSequence`] when `g_1 .. g_i` ends with a stop sequence (which may
//!    have started below the floor).
//! 3. **Visible text.** `V_i` is `D(g_1 .. g_i)` without its trailing U+FFFD characters: the
//!    complete characters of a token's text are visible when the token is emitted; only an
//!    incomplete trailing character (which the decoder renders as U+FFFD) waits for the next
//!    token (case C17). A stop string `s` completes at `g_i` when it occurs in `V_i` ending after
//!    `V_{i-1}`'s end (its first such occurrence).
//! 4. **Earliest completion.** Of the stop strings completing at `g_i`, the one whose
//!    occurrence ends first wins, and on a tie the one that starts first (case C18, vLLM's rule).
//! 5. **The end.** The generation ends at the first `g_i` (`i >= m`) at which a stop completes,
//!    at `i = max_new_tokens` ([`FinishReason::MaxTokens`]) or when the context is full. The
//!    stopping token is emitted, whatever the kind; at one token the reason is the first of
//!    `Eos`, `StopSequence`, `StopString`.
//! 6. **Output text** ([`Generation::text`]). Ended by a stop string occurring at `[a, b)` of
//!    `V_i`: `V_i[..a]`, or `V_i[..b]` with [`StopConditions::include_stop_str_in_output`]. Any
//!    other end: `D` of every emitted token (an incomplete final character as the decoder
//!    renders it).
//! 7. **Streaming** ([`StreamChunk::text`]). After each step the text released is the visible
//!    text minus its longest suffix that is a proper prefix of a stop string (such text may still
//!    become a stop); it never shrinks, and the rest is released when the generation ends, so the
//!    chunks add up to the output text. A chunk's tokens are the step's emitted tokens.
//! 8. **Drafts.** A chain draft is cut right after its first token at which the generation would
//!    end (scanned exactly as rules 1-5 scan a commit) and the target processes no row after it;
//!    a tree node at which it would end keeps no children (case C11).
//! 9. **Validation.** An empty stop string or stop sequence is refused with
//!    [`crate::Error::InvalidConfig`] when the [`GenerationParams`] are built
//!    ([`GenerationParamsBuilder::build`], [`GenerationParams::with_stop`]; serde refuses it
//!    while loading), whether it came from [`StopConditions`]' builder methods or its public
//!    fields; the generation's start (and [`BatchGenerator::submit`]) checks it again.
//!
//! `tests/text_reference.rs` checks both loops against a brute-force reference of these rules
//! (whole-output decoding) on random byte-level vocabularies, stops, floors, drafts and trees.
//!
//! # Seeds
//!
//! [`GenerationParams::seed`] `None` (the default, `"seed": null` in configs) draws a fresh seed
//! per request from the loop's [`SeedSource`] (the OS unless set for tests), reported in
//! [`Generation::seed`]; a request with a seed is reproducible whatever the batch, the proposer
//! and, for point-mass drafts, the draft length (case C15).
//!
//! # Prefix reuse
//!
//! Both loops keep the KV cache of a finished generation and reuse its longest common prefix
//! with a later prompt (on by default; [`Generator::with_prefix_reuse`],
//! [`BatchGenerator::with_prefix_reuse`]): a conversation's next turn, or another request with
//! the same system prompt, prefills only its new tokens. The outputs do not change for a
//! target whose logits do not depend on how its cache was filled;
//! [`Metrics::prompt_tokens_reused`] reports what was kept.
//!
//! # Step costs
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
mod seed;
mod sequence;
mod slots;
mod stop;

pub use crate::model::TargetModel;
pub use batch::{
    BatchConfig, BatchGenerator, BatchMetrics, BatchRequest, BatchStepStats, Finished, RequestId,
};
pub use costs::{FixedCosts, MeasuredCosts, StepCosts};
pub use generator::{Generator, Session};
pub use goodput::GoodputConfig;
pub use metrics::Metrics;
pub use params::{GenerationParams, GenerationParamsBuilder, TreeDrafts};
pub use policy::{AdaptiveConfig, AdaptiveState, DraftLength, PlannedNode, TreeShape};
pub use seed::SeedSource;
pub use sequence::{Generation, GenerationError, StepStats, StreamChunk};
pub use stop::{Detokenizer, FinishReason, StopConditions};
