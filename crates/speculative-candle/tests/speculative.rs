//! Greedy speculative decoding on the real model (SmolLM2-135M, Q8_0) is token-identical to plain
//! greedy decoding, for every proposer, on three prompts of 64 new tokens.
//!
//! The Q8_0 forward is batch-invariant (a forward over n tokens gives bit-identical logits to n
//! one-token forwards, see tests/model.rs), so identity is exact, not approximate.

mod common;

use speculative::decode::{AdaptiveConfig, DraftLength, GenerationParams, Generator};
use speculative::propose::{DraftModelProposer, PromptLookup, SuffixConfig, SuffixProposer};
use speculative::{NoProposer, Proposer, TargetModel};
use speculative_candle::{CandleTarget, ChatMessage, WeightFormat};

const NEW_TOKENS: usize = 64;

fn prompts() -> Vec<Vec<u32>> {
    let tok = common::tokenizer();
    [
        "Rewrite this paragraph in the past tense: The market opens at six. Farmers bring apples, \
         bread and cheese. Children run between the stalls while their parents talk about the weather.",
        "Fix the bug in this Python function and return the corrected code:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(x)\n",
        "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    ]
    .iter()
    .map(|p| {
        let text = tok.apply_chat_template(&[ChatMessage::user(*p)]).unwrap();
        tok.encode(&text).unwrap()
    })
    .collect()
}

fn params(draft: DraftLength) -> GenerationParams {
    // No EOS: every run generates exactly NEW_TOKENS tokens, even past the end of the answer.
    GenerationParams::greedy(NEW_TOKENS)
        .to_builder()
        .max_new_tokens(NEW_TOKENS)
        .draft(draft)
        .build()
        .unwrap()
}

#[test]
fn greedy_speculation_equals_plain_greedy_for_every_proposer() {
    let w = common::weights(WeightFormat::Q8_0);
    let mut target = CandleTarget::new(w.clone());
    for (i, prompt) in prompts().iter().enumerate() {
        let plain = Generator::new(&mut target as &mut dyn TargetModel, NoProposer)
            .generate(prompt, &params(DraftLength::Off))
            .unwrap();
        assert_eq!(plain.tokens.len(), NEW_TOKENS);
        let proposers: Vec<(&str, Box<dyn Proposer>, DraftLength)> = vec![
            (
                "prompt-lookup",
                Box::new(PromptLookup::new(1, 4).unwrap()),
                DraftLength::Fixed(4),
            ),
            (
                "suffix",
                Box::new(SuffixProposer::new(SuffixConfig::default()).unwrap()),
                DraftLength::Fixed(4),
            ),
            (
                "early-exit-8",
                Box::new(DraftModelProposer::new(
                    CandleTarget::early_exit(w.clone(), 8).unwrap(),
                )),
                DraftLength::Fixed(3),
            ),
            (
                "prompt-lookup-adaptive",
                Box::new(PromptLookup::new(2, 3).unwrap()),
                DraftLength::Adaptive(AdaptiveConfig::default()),
            ),
        ];
        for (name, p, d) in proposers {
            let out = Generator::new(&mut target as &mut dyn TargetModel, p)
                .generate(prompt, &params(d))
                .unwrap();
            let first_diff = out
                .tokens
                .iter()
                .zip(&plain.tokens)
                .position(|(a, b)| a != b);
            assert_eq!(
                out.tokens, plain.tokens,
                "prompt {i}, proposer {name}: first difference at {first_diff:?}"
            );
            eprintln!(
                "prompt {i} {name}: acceptance {:.2}, mean accepted length {:.2}",
                out.metrics.acceptance_rate(),
                out.metrics.mean_accepted_length()
            );
        }
    }
}

#[test]
fn same_model_draft_accepts_every_draft() {
    let w = common::weights(WeightFormat::Q8_0);
    let prompt = &prompts()[2];
    let mut target = CandleTarget::new(w.clone());
    let plain = Generator::new(&mut target as &mut dyn TargetModel, NoProposer)
        .generate(prompt, &params(DraftLength::Off))
        .unwrap();
    let draft = DraftModelProposer::new(CandleTarget::new(w));
    let out = Generator::new(&mut target as &mut dyn TargetModel, draft)
        .generate(prompt, &params(DraftLength::Fixed(4)))
        .unwrap();
    assert_eq!(out.tokens, plain.tokens);
    assert!(out.metrics.proposed > 0);
    assert_eq!(
        out.metrics.accepted, out.metrics.proposed,
        "every draft accepted"
    );
}
