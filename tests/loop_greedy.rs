//! Greedy speculative decoding is token-identical to plain greedy decoding, whatever the
//! proposer (case C10), and the loop's stop handling (cases C02, C03).

use std::sync::Arc;

use speculative::decode::{
    AdaptiveConfig, DraftLength, FinishReason, GenerationParams, Generator, StopConditions,
};
use speculative::propose::{
    DraftHeads, DraftModelProposer, HeadsInput, HeadsProposer, PromptLookup, SuffixConfig,
    SuffixProposer,
};
use speculative::test_util::{
    CallLog, RandomProposer, ScriptedProposer, ToyModel, WrongProposer, c10_next,
};
use speculative::{NoProposer, Proposer, Result, SamplingConfig, TargetModel};

/// Plain greedy decoding written out directly against the model, without the library's loop.
fn plain_greedy(model: &mut ToyModel, prompt: &[u32], n: usize) -> Vec<u32> {
    model.truncate(0).unwrap();
    let mut ctx = prompt.to_vec();
    let mut logits = Vec::new();
    let v = model.vocab_size();
    model.forward(&ctx[..ctx.len() - 1], &mut logits).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        model.forward(&ctx[ctx.len() - 1..], &mut logits).unwrap();
        let row = &logits[..v];
        let mut best = 0;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        ctx.push(best as u32);
        out.push(best as u32);
    }
    out
}

fn run<P: Proposer>(
    proposer: P,
    draft: DraftLength,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, speculative::decode::Metrics) {
    let mut g = Generator::new(ToyModel::c10(), proposer);
    let params = GenerationParams::greedy(n).with_draft(draft);
    let out = g.generate(prompt, &params).unwrap();
    assert_eq!(out.finish, FinishReason::MaxTokens);
    assert_eq!(
        g.target().forward_calls,
        out.metrics.target_calls + 1,
        "one target call per step plus the prefill"
    );
    (out.tokens, out.metrics)
}

/// Synthetic heads over the toy model's hidden-free interface: they guess from a fixed table.
struct TableHeads;
impl DraftHeads for TableHeads {
    fn num_heads(&self) -> usize {
        4
    }
    fn vocab_size(&self) -> usize {
        7
    }
    fn hidden_size(&self) -> usize {
        1
    }
    fn logits(&mut self, input: &HeadsInput<'_>, n: usize, logits: &mut Vec<f32>) -> Result<()> {
        let hidden = input.hidden;
        logits.clear();
        for j in 0..n {
            let t = (hidden[0] as usize + j) % 7;
            logits.extend((0..7).map(|v| if v == t { 1.0 } else { 0.0 }));
        }
        Ok(())
    }
}

#[test]
fn c10_greedy_speculation_equals_plain_greedy_for_every_proposer() {
    let prompt = vec![3u32; 48];
    let expected = plain_greedy(&mut ToyModel::c10(), &prompt, 32);
    for n in 2..=5 {
        let (t, m) = run(
            PromptLookup::new(n, n).unwrap(),
            DraftLength::Fixed(4),
            &prompt,
            32,
        );
        assert_eq!(t, expected, "prompt lookup n={n}");
        assert_eq!(m.emitted, 32);
    }
    for k in 1..=6 {
        let (t, _) = run(
            RandomProposer::new(7, k as u64),
            DraftLength::Fixed(k),
            &prompt,
            32,
        );
        assert_eq!(t, expected, "random k={k}");
    }
    let (t, m) = run(
        WrongProposer::new(7, c10_next),
        DraftLength::Fixed(4),
        &prompt,
        32,
    );
    assert_eq!(t, expected, "always wrong");
    assert_eq!(m.accepted, 0);
    assert_eq!(m.target_calls, 32);
    // A length-1 draft can be rejected too.
    let (t, m) = run(
        WrongProposer::new(7, c10_next),
        DraftLength::Fixed(1),
        &prompt,
        32,
    );
    assert_eq!(t, expected);
    assert_eq!((m.proposed, m.accepted), (31, 0));
    let (t, _) = run(
        SuffixProposer::new(SuffixConfig::default()).unwrap(),
        DraftLength::Fixed(4),
        &prompt,
        32,
    );
    assert_eq!(t, expected, "suffix");
    let (t, m) = run(
        DraftModelProposer::new(ToyModel::c10()),
        DraftLength::Fixed(4),
        &prompt,
        32,
    );
    assert_eq!(t, expected, "same-model draft");
    assert_eq!(
        m.accepted, m.proposed,
        "same-model draft: every draft accepted"
    );
    let (t, _) = run(
        DraftModelProposer::new(ToyModel::markov(7, 2, 2.0, 5)),
        DraftLength::Fixed(3),
        &prompt,
        32,
    );
    assert_eq!(t, expected, "unrelated draft model");
    let (t, _) = run(NoProposer, DraftLength::Fixed(4), &prompt, 32);
    assert_eq!(t, expected, "no proposer");
    let (t, _) = run(RandomProposer::new(7, 1), DraftLength::Off, &prompt, 32);
    assert_eq!(t, expected, "opt-out");
    let (t, _) = run(
        RandomProposer::new(7, 9),
        DraftLength::Adaptive(AdaptiveConfig::default()),
        &prompt,
        32,
    );
    assert_eq!(t, expected, "adaptive");
}

#[test]
fn heads_proposer_with_synthetic_hidden_states_is_lossless() {
    /// The C10 model exposing a one-wide "hidden state": the greedy next token.
    struct WithHidden(ToyModel, Vec<f32>);
    impl TargetModel for WithHidden {
        fn vocab_size(&self) -> usize {
            7
        }
        fn max_context(&self) -> usize {
            4096
        }
        fn seq_len(&self) -> usize {
            self.0.seq_len()
        }
        fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
            self.0.forward(tokens, logits)?;
            self.1 = logits
                .chunks(7)
                .map(|r| r.iter().position(|&x| x == 10.0).unwrap() as f32)
                .collect();
            Ok(())
        }
        fn truncate(&mut self, len: usize) -> Result<()> {
            self.0.truncate(len)
        }
        fn hidden_states(&self) -> Option<&dyn speculative::HiddenStates> {
            Some(self)
        }
    }
    impl speculative::HiddenStates for WithHidden {
        fn hidden_size(&self) -> usize {
            1
        }
        fn last_hidden(&self) -> Option<&[f32]> {
            Some(&self.1)
        }
    }
    let prompt = vec![3u32; 20];
    let expected = plain_greedy(&mut ToyModel::c10(), &prompt, 40);
    let mut g = Generator::new(
        WithHidden(ToyModel::c10(), vec![]),
        HeadsProposer::new(TableHeads),
    );
    let out = g.generate(&prompt, &GenerationParams::greedy(40)).unwrap();
    assert_eq!(out.tokens, expected);
    assert!(out.metrics.proposed > 0);
}

#[test]
fn c02_eos_inside_an_accepted_block_ends_the_generation() {
    // Target greedy continuation [5, 9, 2, 7, 8]; EOS 2; drafts [5, 9, 2, 7] all match.
    let cont = [5u32, 9, 2, 7, 8, 1, 1, 1];
    let target = ToyModel::deterministic(10, 100, move |p: &[u32]| cont[(p.len() - 1).min(7)]);
    let mut g = Generator::new(target, ScriptedProposer::new(vec![vec![5, 9, 2, 7]]));
    let params = GenerationParams::greedy(50)
        .to_builder()
        .stop(StopConditions::default().with_eos(2))
        .build()
        .unwrap();
    let mut streamed = Vec::new();
    let out = g
        .generate_with(&[0], &params, |t| {
            streamed.extend_from_slice(t);
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(out.tokens, vec![5, 9, 2]);
    assert_eq!(streamed, vec![5, 9, 2]);
    assert_eq!(out.finish, FinishReason::Eos);
    assert_eq!(out.metrics.emitted, 3);
    assert_eq!(out.metrics.accepted, 3);

    // The same for a stop sequence completed inside the block.
    let target = ToyModel::deterministic(10, 100, move |p: &[u32]| cont[(p.len() - 1).min(7)]);
    let mut g = Generator::new(target, ScriptedProposer::new(vec![vec![5, 9, 2, 7]]));
    let params = GenerationParams::greedy(50)
        .to_builder()
        .stop(StopConditions::default().with_stop_sequence(vec![9, 2]))
        .build()
        .unwrap();
    let out = g.generate(&[0], &params).unwrap();
    assert_eq!(out.tokens, vec![5, 9, 2]);
    assert_eq!(out.finish, FinishReason::StopSequence);
}

#[test]
fn c03_never_more_new_tokens_than_the_budget() {
    // 17-token prompt whose continuation the prompt-lookup proposer can offer in full.
    let prompt: Vec<u32> = (0..17).map(|i| (i % 5) as u32).collect();
    let next = |p: &[u32]| (p[p.len() - 1] + 1) % 5;
    let plain = plain_greedy(&mut ToyModel::deterministic(5, 1000, next), &prompt, 2);
    let mut g = Generator::new(
        ToyModel::deterministic(5, 1000, next),
        PromptLookup::new(1, 3).unwrap(),
    );
    let params = GenerationParams::greedy(2).with_draft(DraftLength::Fixed(3));
    let out = g.generate(&prompt, &params).unwrap();
    assert_eq!(out.tokens, plain);
    assert_eq!(out.tokens.len(), 2);
    assert_eq!(out.metrics.proposed, 1, "draft capped at remaining - 1");
    assert_eq!(out.finish, FinishReason::MaxTokens);
}

#[test]
fn context_limit_caps_drafts_and_ends_generation() {
    let next = |p: &[u32]| (p[p.len() - 1] + 1) % 5;
    let mut g = Generator::new(
        ToyModel::deterministic(5, 20, next),
        ScriptedProposer::new(vec![vec![1, 2, 3, 4, 0, 1, 2, 3, 4]; 10]),
    );
    let params = GenerationParams::greedy(100).with_draft(DraftLength::Fixed(8));
    let out = g.generate(&[0; 15], &params).unwrap();
    assert_eq!(out.tokens.len(), 5);
    assert_eq!(out.finish, FinishReason::ContextFull);
    assert!(g.target().seq_len() <= 20);
}

#[test]
fn cancellation_by_flag_and_by_callback() {
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut g = Generator::new(ToyModel::c10(), NoProposer);
    let params = GenerationParams::greedy(10).with_cancel(flag.clone());
    let out = g.generate(&[1, 2], &params).unwrap();
    assert_eq!((out.tokens.len(), out.finish), (0, FinishReason::Cancelled));
    let mut calls = 0;
    let out = g
        .generate_with(&[1, 2], &GenerationParams::greedy(10), |_| {
            calls += 1;
            std::ops::ControlFlow::Break(())
        })
        .unwrap();
    assert_eq!(
        (calls, out.tokens.len(), out.finish),
        (1, 1, FinishReason::Cancelled)
    );
}

#[test]
fn bad_requests_are_typed_errors() {
    let mut g = Generator::new(ToyModel::c10(), NoProposer);
    let p = GenerationParams::greedy(4);
    assert!(matches!(
        g.generate(&[], &p).map_err(|e| e.error),
        Err(speculative::Error::EmptyPrompt)
    ));
    assert!(matches!(
        g.generate(&[9], &p).map_err(|e| e.error),
        Err(speculative::Error::TokenOutOfVocab { token: 9, .. })
    ));
    let mut g = Generator::new(ToyModel::deterministic(5, 4, |_| 0), NoProposer);
    assert!(matches!(
        g.generate(&[0; 5], &p).map_err(|e| e.error),
        Err(speculative::Error::PromptTooLong {
            len: 5,
            max_context: 4
        })
    ));
    let bad = GenerationParams::greedy(4)
        .to_builder()
        .sampling(
            SamplingConfig::builder()
                .banned_tokens([77])
                .build()
                .unwrap(),
        )
        .build()
        .unwrap();
    assert!(g.generate(&[0], &bad).is_err());
    // An EOS id from the wrong tokenizer is caught before any work.
    let wrong_eos = GenerationParams::greedy(4)
        .to_builder()
        .stop(StopConditions::default().with_eos(999))
        .build()
        .unwrap();
    assert!(matches!(
        g.generate(&[0], &wrong_eos).map_err(|e| e.error),
        Err(speculative::Error::TokenOutOfVocab { token: 999, .. })
    ));
}

#[test]
fn session_iterator_streams_each_step() {
    let prompt = vec![3u32; 48];
    let expected = plain_greedy(&mut ToyModel::c10(), &prompt, 20);
    let mut g = Generator::new(ToyModel::c10(), PromptLookup::new(2, 4).unwrap());
    let params = GenerationParams::greedy(20);
    let s = g.session(&prompt, &params).unwrap();
    let chunks: Vec<Vec<u32>> = s.map(|r| r.unwrap()).collect();
    assert!(chunks.iter().all(|c| !c.is_empty()));
    assert_eq!(chunks.concat(), expected);
}

#[test]
fn prompt_prefill_goes_through_prefill_once_and_output_is_unchanged() {
    let prompt = [1u32, 2, 3, 4, 5, 6];
    let mut want_model = ToyModel::c10();
    let want = plain_greedy(&mut want_model, &prompt, 20);
    let mut t = CallLog::new(ToyModel::c10());
    let mut g = Generator::new(&mut t, PromptLookup::new(1, 3).unwrap()).with_fused_prefill(false);
    let out = g.generate(&prompt, &GenerationParams::greedy(20)).unwrap();
    assert_eq!(out.tokens, want);
    drop(g);
    assert_eq!(t.prefills, vec![prompt.len() - 1]);
    assert!(!t.forwards.is_empty() && t.tails.is_empty());
    // The fused prefill (the default) feeds them in the first verify forward instead.
    t.prefills.clear();
    t.forwards.clear();
    t.truncate(0).unwrap();
    let mut g = Generator::new(&mut t, PromptLookup::new(1, 3).unwrap());
    let out = g.generate(&prompt, &GenerationParams::greedy(20)).unwrap();
    assert_eq!(out.tokens, want);
    assert_eq!(out.metrics.prompt_tokens_fused, prompt.len() - 1);
    drop(g);
    assert!(t.prefills.is_empty());
    assert_eq!(t.tails.len(), 1);
    assert_eq!(t.tails[0].0 - t.tails[0].1, prompt.len() - 1);
    // A one-token prompt needs no prefill.
    t.prefills.clear();
    let mut g = Generator::new(&mut t, NoProposer);
    g.generate(&[3], &GenerationParams::greedy(4)).unwrap();
    drop(g);
    assert!(t.prefills.is_empty());
}
