//! Continuous batching on the real model (needs `models/SmolLM2-135M-Instruct.Q4_1.gguf`; run
//! `scripts/fetch-model.sh` first): every request's output from a
//! [`speculative::decode::BatchGenerator`] equals its output from a
//! [`speculative::decode::Generator`] alone on a [`FastTarget`], greedy (token for token) and
//! sampled (the same seed gives the same tokens), with requests of different lengths joining
//! and leaving mid-run.

mod common;

use speculative::decode::{
    AdaptiveConfig, BatchConfig, BatchGenerator, BatchRequest, DraftLength, Generation,
    GenerationParams, Generator, RequestId, StopConditions, TreeDrafts,
};
use speculative::propose::{
    MergedProposer, PromptLookup, SharedCorpus, SuffixConfig, SuffixProposer,
};
use speculative::{BatchTarget, PerSlot, Proposer, SamplingConfig};
use speculative_candle::{FastBatch, FastTarget};

use common::{chat, fast_weights, tokenizer};

const QUESTIONS: [&str; 6] = [
    "Rewrite this sentence in the passive voice: The committee approved the budget, the \
     committee rejected the plan, and the committee postponed the vote.",
    "Here is a function:\nfn add(a: i32, b: i32) -> i32 { a + b }\nRename it to sum and add a \
     doc comment; show the whole function.",
    "What is a good way to learn to play the guitar?",
    "List three colours.",
    "Copy this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries.",
    "Hi",
];

struct Req {
    prompt: Vec<u32>,
    params: GenerationParams,
    kind: usize,
}

fn proposer(kind: usize, shared: Option<&SharedCorpus>) -> Box<dyn Proposer + Send> {
    let suffix = || {
        let s = SuffixProposer::new(SuffixConfig::default()).unwrap();
        match shared {
            Some(c) => s.with_shared_corpus(c),
            None => s,
        }
    };
    match kind % 3 {
        0 => Box::new(PromptLookup::new(2, 8).unwrap()),
        1 => Box::new(suffix()),
        _ => Box::new(
            MergedProposer::new(vec![
                Box::new(PromptLookup::new(2, 8).unwrap()),
                Box::new(suffix()),
            ])
            .unwrap(),
        ),
    }
}

fn requests(sampled: bool) -> Vec<Req> {
    let eos = tokenizer().eos_id();
    QUESTIONS
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let max_new = [48, 24, 40, 16, 56, 8][i];
            let mut p = if sampled {
                let cfg = SamplingConfig::builder()
                    .temperature(0.8)
                    .top_p(0.95)
                    .build()
                    .unwrap();
                GenerationParams::sampled(cfg, 77 + i as u64, max_new)
            } else {
                GenerationParams::greedy(max_new)
            };
            p = p.with_stop(StopConditions::eos(eos)).unwrap();
            p = match i % 4 {
                0 => p.with_draft(DraftLength::Fixed(6)),
                1 => p.with_draft(DraftLength::Adaptive(AdaptiveConfig::default())),
                2 => p
                    .with_draft(DraftLength::Fixed(4))
                    .with_tree(TreeDrafts::nodes(12)),
                _ => p.with_draft(DraftLength::Off),
            };
            Req {
                prompt: chat(q),
                params: p,
                kind: i,
            }
        })
        .collect()
}

fn alone(r: &Req) -> Generation {
    let mut g = Generator::new(FastTarget::new(fast_weights()), proposer(r.kind, None));
    g.generate(&r.prompt, &r.params).unwrap()
}

/// Runs the requests through one batch: the first three at once, the others after `join`
/// steps; with fewer slots than requests some wait for a slot.
fn batched<B: BatchTarget>(target: B, reqs: &[Req], join: usize, shared: bool) -> Vec<Generation> {
    let corpus = shared.then(|| SharedCorpus::new(1 << 16));
    let cfg = BatchConfig::default()
        .with_max_batch_tokens(96)
        .with_prefill_chunk(32);
    let mut b = BatchGenerator::with_config(target, cfg).unwrap();
    let mut ids: Vec<RequestId> = Vec::new();
    let submit = |b: &mut BatchGenerator<B>, r: &Req| {
        b.submit(BatchRequest::new(
            r.prompt.clone(),
            r.params.clone(),
            proposer(r.kind, corpus.as_ref()),
        ))
        .unwrap()
    };
    for r in &reqs[..3] {
        ids.push(submit(&mut b, r));
    }
    for _ in 0..join {
        b.step().unwrap();
    }
    for r in &reqs[3..] {
        ids.push(submit(&mut b, r));
    }
    let done = b.run().unwrap();
    ids.iter()
        .map(|id| {
            done.iter()
                .find(|f| f.id == *id)
                .unwrap()
                .result
                .as_ref()
                .unwrap()
                .clone()
        })
        .collect()
}

fn per_slot(slots: usize) -> PerSlot<FastTarget> {
    PerSlot::new(
        (0..slots)
            .map(|_| FastTarget::new(fast_weights()))
            .collect(),
    )
    .unwrap()
}

#[test]
fn batched_greedy_equals_each_request_alone_on_the_real_model() {
    let reqs = requests(false);
    let want: Vec<Generation> = reqs.iter().map(alone).collect();
    for (slots, join, shared) in [(4, 5, false), (6, 0, true)] {
        let got = batched(per_slot(slots), &reqs, join, shared);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.tokens, w.tokens, "request {i}, {slots} slots");
            assert_eq!(g.finish, w.finish, "request {i}");
        }
    }
    // The multi-sequence forward: one forward per step over every slot's rows.
    for (slots, join) in [(3, 2), (6, 7)] {
        let fast = FastBatch::new(fast_weights(), slots).unwrap();
        let got = batched(fast, &reqs, join, false);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.tokens, w.tokens, "FastBatch: request {i}, {slots} slots");
            assert_eq!(g.finish, w.finish, "FastBatch: request {i}");
        }
    }
}

#[test]
fn batched_sampling_equals_each_request_alone_for_its_seed() {
    let reqs = requests(true);
    let want: Vec<Generation> = reqs.iter().map(alone).collect();
    for got in [
        batched(per_slot(3), &reqs, 2, false),
        batched(FastBatch::new(fast_weights(), 4).unwrap(), &reqs, 1, true),
    ] {
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // Point-mass drafts: the tokens of a seed do not depend on the draft lengths (C15).
            assert_eq!(g.tokens, w.tokens, "sampled request {i}");
        }
    }
}
