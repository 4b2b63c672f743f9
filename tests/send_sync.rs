//! `Send` / `Sync` of the public types (issue 16), checked at compile time: this file does not
//! compile if a type loses an auto trait its documentation promises. The generic functions
//! prove the statement for every type parameter, not only for the toy ones.
//!
//! Build it under each feature set (`--features wgpu`, `--features cuda`) to check
//! [`GpuVerifier`] with the real backends; without them the backends are uninhabited stand-ins.

use std::sync::Arc;

use speculative::decode::{
    AdaptiveConfig, AdaptiveState, DraftLength, FinishReason, GenerationParams, Generator, Metrics,
    StopConditions,
};
use speculative::gpu::{Backend, DeviceBatch, GpuVerifier};
use speculative::propose::{DraftHeads, HeadsProposer};
use speculative::rng::Stream;
use speculative::sampling::{Cand, History, PenaltyScope, RowProcessor, TokenCounts};
use speculative::test_util::ToyModel;
use speculative::{
    Draft, DraftModelProposer, DraftProbs, Error, NoProposer, PromptLookup, ProposeRequest,
    Proposer, RowKind, SamplingConfig, SamplingConfigBuilder, SequenceParams, StepEnd, StepOutput,
    SuffixConfig, SuffixProposer, TargetModel, TokenDist, TokenLogprob, Verifier, VerifyBatch,
    VerifyRequest,
};

fn send<T: Send>() {}
fn sync<T: Sync>() {}
fn send_sync<T: Send + Sync>() {
    send::<T>();
    sync::<T>();
}

#[test]
fn verification_and_sampling_types_are_send_and_sync() {
    send_sync::<Verifier>();
    send_sync::<VerifyRequest<'static>>();
    send_sync::<VerifyBatch<'static>>();
    send_sync::<SequenceParams<'static>>();
    send_sync::<DraftProbs<'static>>();
    send_sync::<StepOutput>();
    send_sync::<StepEnd>();
    send_sync::<TokenLogprob>();
    send_sync::<SamplingConfig>();
    send_sync::<SamplingConfigBuilder>();
    send_sync::<TokenDist>();
    send_sync::<RowProcessor>();
    send_sync::<TokenCounts>();
    send_sync::<History<'static>>();
    send_sync::<Cand>();
    send_sync::<PenaltyScope>();
    send_sync::<Error>();
    send_sync::<RowKind>();
    send_sync::<Stream>();
}

#[test]
fn proposer_types_are_send_and_sync() {
    send_sync::<Draft>();
    send_sync::<ProposeRequest<'static>>();
    send_sync::<PromptLookup>();
    send_sync::<SuffixProposer>();
    send_sync::<SuffixConfig>();
    send_sync::<speculative::TokenRecycling>();
    send_sync::<speculative::propose::TreeTemplate>();
    send_sync::<speculative::propose::TableFileError>();
    send_sync::<NoProposer>();
    send_sync::<DraftModelProposer<ToyModel>>();
}

#[test]
fn decode_types_are_send_and_sync() {
    send_sync::<Metrics>();
    send_sync::<GenerationParams>();
    send_sync::<StopConditions>();
    send_sync::<FinishReason>();
    send_sync::<DraftLength>();
    send_sync::<AdaptiveConfig>();
    send_sync::<AdaptiveState>();
    send_sync::<Generator<ToyModel, PromptLookup>>();
    send_sync::<Generator<ToyModel, DraftModelProposer<ToyModel>>>();
}

/// `GpuVerifier` is `Send + Sync` under every feature set (it owns its device handles; the
/// CPU backend is a boxed [`Verifier`]).
#[test]
fn gpu_types_are_send_and_sync() {
    send_sync::<GpuVerifier>();
    send_sync::<Backend>();
    send_sync::<DeviceBatch<'static>>();
}

/// The wrappers are `Send` / `Sync` exactly when what they wrap is: proved for every parameter.
#[allow(dead_code)]
fn wrappers_follow_their_parameters<M, H, T, P>()
where
    M: TargetModel + Send,
    H: DraftHeads + Send,
    T: TargetModel + Send,
    P: Proposer + Send,
{
    send::<DraftModelProposer<M>>();
    send::<HeadsProposer<H>>();
    send::<Generator<T, P>>();
}

#[allow(dead_code)]
fn wrappers_follow_their_parameters_sync<M, H, T, P>()
where
    M: TargetModel + Sync,
    H: DraftHeads + Sync,
    T: TargetModel + Sync,
    P: Proposer + Sync,
{
    sync::<DraftModelProposer<M>>();
    sync::<HeadsProposer<H>>();
    sync::<Generator<T, P>>();
}

/// The object-safe traits can be used as `Send` trait objects.
#[test]
fn boxed_engines_are_send() {
    send::<Generator<Box<dyn TargetModel + Send>, Box<dyn Proposer + Send>>>();
    send::<DraftModelProposer<Box<dyn TargetModel + Send>>>();
    // Holds `Box<dyn Proposer + Send>`: Send, and usable as one in the loop.
    send::<speculative::MergedProposer>();
    send::<Generator<Box<dyn TargetModel + Send>, speculative::MergedProposer>>();
}

/// At run time: one configuration shared by reference across threads, one verifier per thread,
/// the same result on every thread.
#[test]
fn one_verifier_per_thread_shared_config() {
    let cfg = Arc::new(
        SamplingConfig::builder()
            .temperature(0.8)
            .top_p(0.9)
            .build()
            .unwrap(),
    );
    let logits: Arc<Vec<f32>> =
        Arc::new((0..3 * 16).map(|i| ((i * 7) % 11) as f32 * 0.3).collect());
    let run = |cfg: &SamplingConfig, logits: &[f32]| {
        let mut v = Verifier::new();
        v.verify(
            &VerifyRequest::new(cfg, logits, 16, &[3, 5])
                .seed(11)
                .position(40),
        )
        .unwrap()
    };
    let want = run(&cfg, &logits);
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let (cfg, logits) = (cfg.clone(), logits.clone());
            std::thread::spawn(move || run(&cfg, &logits))
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), want);
    }
}
