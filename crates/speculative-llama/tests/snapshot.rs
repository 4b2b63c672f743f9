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
