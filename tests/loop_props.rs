//! Property tests of the loop's stop handling: for random targets, proposers, budgets, contexts
//! and stop conditions, nothing is emitted after EOS or a stop sequence, never past the budget or
//! the context, and greedy output equals plain greedy output cut at the first stop.

use proptest::prelude::*;
use speculative::decode::{DraftLength, FinishReason, GenerationParams, Generator, StopConditions};
use speculative::test_util::{RandomProposer, ToyModel};
use speculative::{SamplingConfig, TargetModel};

fn plain(vocab: usize, seed: u64, prompt: &[u32], n: usize) -> Vec<u32> {
    let m = ToyModel::markov(vocab, 2, 2.0, seed);
    let mut ctx = prompt.to_vec();
    for _ in 0..n {
        let l = m.logits(&ctx);
        let mut best = 0;
        for (i, &x) in l.iter().enumerate() {
            if x > l[best] {
                best = i;
            }
        }
        ctx.push(best as u32);
    }
    ctx[prompt.len()..].to_vec()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn stops_budget_and_context(
        vocab in 3usize..8,
        seed in 0u64..1000,
        prompt_len in 1usize..12,
        max_new in 0usize..30,
        max_ctx_extra in 0usize..40,
        k in 0usize..7,
        eos in proptest::option::of(0u32..8),
        stop_seq in proptest::collection::vec(0u32..8, 0..3),
        greedy in any::<bool>(),
    ) {
        let eos = eos.filter(|&e| (e as usize) < vocab);
        let stop_seq: Vec<u32> = stop_seq.into_iter().filter(|&t| (t as usize) < vocab).collect();
        let prompt: Vec<u32> = (0..prompt_len).map(|i| ((i * 7 + seed as usize) % vocab) as u32).collect();
        let max_ctx = prompt_len + max_ctx_extra;
        let target = ToyModel::new(vocab, max_ctx, std::sync::Arc::new({
            let m = ToyModel::markov(vocab, 2, 2.0, seed);
            move |p: &[u32]| m.logits(p)
        }));
        let mut stop = StopConditions::default();
        if !stop_seq.is_empty() { stop = stop.with_stop_sequence(stop_seq.clone()); }
        if let Some(e) = eos { stop = stop.with_eos(e); }
        let params = GenerationParams::builder().sampling(if greedy { SamplingConfig::greedy() } else { SamplingConfig::sampling(0.8).unwrap() }).seed(seed).max_new_tokens(max_new).stop(stop).draft(DraftLength::Fixed(k)).build().unwrap();
        let mut g = Generator::new(target, RandomProposer::new(vocab, seed));
        let mut streamed = Vec::new();
        let out = g.generate_with(&prompt, &params, |t| { streamed.extend_from_slice(t); std::ops::ControlFlow::Continue(()) }).unwrap();
        prop_assert_eq!(&streamed, &out.tokens);
        prop_assert!(out.tokens.len() <= max_new);
        prop_assert!(prompt_len + out.tokens.len() <= max_ctx);
        prop_assert!(g.target().seq_len() <= max_ctx);
        prop_assert_eq!(out.metrics.emitted, out.tokens.len());
        // No token after a stop.
        for i in 0..out.tokens.len() {
            let head = &out.tokens[..=i];
            let stopped = eos.is_some_and(|e| head[i] == e)
                || (!stop_seq.is_empty() && head.ends_with(&stop_seq));
            if stopped {
                prop_assert_eq!(i + 1, out.tokens.len(), "token after a stop");
                prop_assert!(matches!(out.finish, FinishReason::Eos | FinishReason::StopSequence));
            }
        }
        match out.finish {
            FinishReason::MaxTokens => prop_assert_eq!(out.tokens.len(), max_new),
            FinishReason::ContextFull => prop_assert_eq!(prompt_len + out.tokens.len(), max_ctx),
            FinishReason::Eos | FinishReason::StopSequence => {}
            other => prop_assert!(false, "unexpected finish {:?}", other),
        }
        if greedy {
            let n = out.tokens.len();
            prop_assert_eq!(&out.tokens, &plain(vocab, seed, &prompt, n));
        }
    }
}
