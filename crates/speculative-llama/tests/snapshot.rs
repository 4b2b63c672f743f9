//! Snapshot rollback on llama.cpp (`LlamaConfig::force_snapshot`): the wiring that recurrent and
//! hybrid models use (`llama_state_seq_get_data` / `set_data`), tested on the SmolLM2 GGUF with
//! the snapshot mode forced on, since no recurrent GGUF can be downloaded here. With it the
//! loop never truncates: it saves the sequence state before each verify forward and, after a
//! rejection, restores it and replays the accepted tokens. The greedy output must equal the
//! output of the same model rolled back by truncation, and the rollback family of the
//! conformance kit must pass.

mod common;

use common::{chat, engine};
use speculative::conformance::{self, KitConfig, Tolerance};
use speculative::decode::{
    BatchGenerator, BatchRequest, DraftLength, GenerationParams, Generator, StopConditions,
};
use speculative::propose::{DraftModelProposer, PromptLookup};
use speculative::{Error, Rollback, RollbackMode, TargetModel, rollback_mode};
use speculative_llama::LlamaConfig;

const TEXT: &str = "Rewrite in the past tense: The library opens at eight. Students arrive early and find seats near the windows.";

fn params() -> GenerationParams {
    let stop = engine()
        .eog_ids()
        .iter()
        .fold(StopConditions::default(), |s, &t| s.with_eos(t));
    GenerationParams::greedy(40)
        .with_stop(stop)
        .expect("EOS ids alone are valid stop conditions")
        .with_draft(DraftLength::Fixed(4))
}

fn snapshot_cfg() -> LlamaConfig {
    LlamaConfig::default()
        .with_context(256)
        .with_force_snapshot(true)
}

#[test]
fn forced_snapshot_gives_the_greedy_output_of_truncation() {
    let e = engine();
    let p = chat(TEXT);
    let truncating = LlamaConfig::default().with_context(256);
    let mut want_g = Generator::new(
        e.target(&truncating).unwrap(),
        PromptLookup::new(1, 4).unwrap(),
    );
    let want = want_g.generate(&p, &params()).unwrap();
    let mut t = e.target(&snapshot_cfg()).unwrap();
    assert_eq!(rollback_mode(&mut t), RollbackMode::Snapshot);
    let mut g = Generator::new(t, PromptLookup::new(1, 4).unwrap());
    let got = g.generate(&p, &params()).unwrap();
    assert_eq!(got.tokens, want.tokens);
    assert!(
        got.metrics.replays > 0,
        "some drafts were rejected and replayed"
    );
    assert_eq!(want.metrics.replays, 0);
    // A draft model in snapshot mode (the same model) drafts through the same capability.
    let draft = DraftModelProposer::new(e.target(&snapshot_cfg()).unwrap());
    let mut g = Generator::new(e.target(&snapshot_cfg()).unwrap(), draft);
    assert_eq!(g.generate(&p, &params()).unwrap().tokens, want.tokens);
    // Batched: two slots in snapshot mode.
    let bt = e.batch_target(&snapshot_cfg().with_slots(2)).unwrap();
    let mut batch = BatchGenerator::new(bt);
    for _ in 0..2 {
        let pl = PromptLookup::new(1, 4).unwrap();
        batch
            .submit(BatchRequest::new(p.clone(), params(), pl))
            .unwrap();
    }
    for f in batch.run().unwrap() {
        assert_eq!(f.result.unwrap().tokens, want.tokens);
    }
    assert!(batch.metrics().replayed > 0);
}

#[test]
fn snapshot_mode_refuses_middle_truncation_and_a_missing_snapshot() {
    let mut t = engine().target(&snapshot_cfg()).unwrap();
    let mut logits = Vec::new();
    t.forward(&[1, 2, 3, 4], &mut logits).unwrap();
    assert!(matches!(t.truncate(2), Err(Error::StateRollback { .. })));
    t.truncate(4).unwrap();
    let Some(Rollback::Snapshot(s)) = t.rollback() else {
        panic!("snapshot mode");
    };
    assert!(matches!(
        s.restore_state(),
        Err(Error::StateRollback { .. })
    ));
    assert_eq!(t.seq_len(), 4);
    t.truncate(0).unwrap();
    assert_eq!(t.seq_len(), 0);
}

#[test]
fn snapshot_mode_meets_the_rollback_contract() {
    let cfg = KitConfig::builder()
        .tolerance(Tolerance::Exact)
        .build()
        .unwrap();
    let prompts = vec![chat("Name a river."), vec![1, 2, 3, 4, 5]];
    let make = || engine().target(&snapshot_cfg()).unwrap();
    let mut r = conformance::check_rollback(make, &prompts, &cfg);
    r.merge(conformance::check_target(make, &prompts, &cfg));
    println!("{r}");
    r.assert_passed();
}

/// The first four rewrite prompts of docs/workloads/smollm2.jsonl (copy-heavy, so prompt lookup
/// drafts often and is sometimes rejected).
const REWRITES: [&str; 4] = [
    "Rewrite the following paragraph in the past tense and keep everything else unchanged:

The library opens at eight in the morning. Students arrive early and find seats near the windows. The librarian checks the returned books and puts them back on the shelves. At noon the reading room is full, and the only sound is the turning of pages.",
    "Extract every date and the event that happened on it from this text, as a list of lines 'date: event':

The company was founded on 3 March 1998 in a small garage. On 14 July 2003 it opened its first office in Berlin. The first product shipped on 1 October 2005. On 20 January 2012 the company listed its shares on the stock exchange, and on 9 May 2019 it moved its headquarters to Amsterdam.",
    "Rewrite this email so that it is more polite, keeping all the facts:

Hi Tom, the report you sent is late again. I need the numbers for March and April by Friday. Send them to me and to Anna. The meeting on Monday is at 10 in room 4. Bring the slides.",
    "Copy the following list and add the word 'fresh' before each item:

apples
bread
milk
eggs
tomatoes
basil
cheese
lemons
spinach
fish",
];

/// Replay (forced snapshot mode) against truncation on the real model: decode time per token
/// and its split (forward, state saves, replays) for plain decoding, fixed `k = 4` and the
/// adaptive draft length, with prompt lookup, greedy, at most 96 new tokens, the four rewrite prompts
/// (each generated twice, the first discarded as warm-up). Prints the table of
/// docs/benchmarks.md section 11; asserts only that the outputs of both modes are equal.
/// Run with `cargo test --profile test -p speculative-llama --test snapshot -- --ignored
/// --nocapture snapshot_costs_on_the_real_model` (wall-clock figures: not run in CI).
#[test]
#[ignore]
fn snapshot_costs_on_the_real_model() {
    let e = engine();
    println!(
        "| rollback | draft | tokens | mean k | acceptance | replays | replayed | ms / token | forward | saves | replays (ms) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let drafts = [
        ("plain", DraftLength::Off),
        ("fixed 4", DraftLength::Fixed(4)),
        (
            "adaptive",
            DraftLength::Adaptive(speculative::decode::AdaptiveConfig::default()),
        ),
    ];
    let mut outputs: Vec<Vec<Vec<u32>>> = Vec::new();
    for (mode, cfg) in [
        ("truncate", LlamaConfig::default().with_context(256)),
        ("snapshot", snapshot_cfg()),
    ] {
        let mut mode_out = Vec::new();
        for (name, draft) in &drafts {
            let t = e.target(&cfg).unwrap();
            let mut g =
                Generator::new(t, PromptLookup::new(1, 4).unwrap()).with_prefix_reuse(false);
            let params = params()
                .to_builder()
                .max_new_tokens(96)
                .draft(draft.clone())
                .build()
                .unwrap();
            let mut m = speculative::decode::Metrics::default();
            let mut decode = std::time::Duration::ZERO;
            for text in REWRITES {
                let p = chat(text);
                g.generate(&p, &params).unwrap();
                let out = g.generate(&p, &params).unwrap();
                decode += out
                    .metrics
                    .total_time
                    .saturating_sub(out.metrics.prefill_time);
                mode_out.push(out.tokens.clone());
                let o = out.metrics;
                m.emitted += o.emitted;
                m.proposed += o.proposed;
                m.accepted += o.accepted;
                m.target_calls += o.target_calls;
                m.replays += o.replays;
                m.replayed_tokens += o.replayed_tokens;
                m.forward_time += o.forward_time;
                m.snapshot_time += o.snapshot_time;
                m.replay_time += o.replay_time;
            }
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            println!(
                "| {mode} | {name} | {} | {:.2} | {:.2} | {} | {} | {:.2} | {:.0} | {:.0} | {:.0} |",
                m.emitted,
                m.proposed as f64 / m.target_calls.max(1) as f64,
                m.acceptance_rate(),
                m.replays,
                m.replayed_tokens,
                ms(decode) / m.emitted.max(1) as f64,
                ms(m.forward_time),
                ms(m.snapshot_time),
                ms(m.replay_time),
            );
        }
        outputs.push(mode_out);
    }
    assert_eq!(outputs[0], outputs[1], "greedy outputs of both modes");
}
