//! Fuzzing of the decoding loop (issue 16, "Robustness"): arbitrary prompts (ids in and out of
//! the vocabulary), budgets, `min_tokens`, stop conditions, rogue proposers (any length, any ids,
//! any q) and targets that return NaN / `+inf` logits or logits of the wrong size. The loop
//! never panics, every `Ok` respects the budget and the stops, and every error is a typed
//! variant. Case count: `FUZZ_CASES` (default 64); `scripts/fuzz.sh` runs a long campaign.

use std::sync::Arc;

use proptest::prelude::*;
use speculative::decode::{DraftLength, FinishReason, GenerationParams, Generator, StopConditions};
use speculative::test_util::ToyModel;
use speculative::{Draft, Error, ProposeRequest, Proposer, Result, SamplingConfig, TargetModel};

fn cases() -> u32 {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// One scripted proposal: draft tokens and optional q with its row width.
type Step = (Vec<u32>, Option<(Vec<f32>, usize)>);

/// A proposer that returns arbitrary drafts from a script (ids possibly out of range, lengths
/// possibly over `max_draft`, q possibly malformed).
#[derive(Debug, Clone)]
struct Rogue {
    steps: Vec<Step>,
    next: usize,
}

impl Proposer for Rogue {
    fn propose(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        if let Some((t, q)) = self.steps.get(self.next % self.steps.len().max(1)) {
            draft.tokens.clone_from(t);
            if let Some((q, qv)) = q {
                draft.q = Some(q.clone());
                draft.q_vocab = *qv;
            }
        }
        self.next += 1;
        Ok(())
    }
    fn name(&self) -> &'static str {
        "rogue"
    }
}

/// A target whose logits may be poisoned at some forward calls, or have the wrong size.
struct Wobbly {
    inner: ToyModel,
    poison: Vec<(usize, u8)>,
    calls: usize,
}

impl TargetModel for Wobbly {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.calls += 1;
        self.inner.forward(tokens, logits)?;
        for &(call, kind) in &self.poison {
            if call == self.calls && !logits.is_empty() {
                let i = (call * 7) % logits.len();
                match kind % 4 {
                    0 => logits[i] = f32::NAN,
                    1 => logits[i] = f32::INFINITY,
                    2 => logits.push(0.0),
                    _ => logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY),
                }
            }
        }
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.inner.truncate(len)
    }
}

fn draft_step() -> impl Strategy<Value = Step> {
    (
        proptest::collection::vec(prop_oneof![9 => 0u32..8, 1 => any::<u32>()], 0..7),
        proptest::option::of((
            proptest::collection::vec(
                prop_oneof![4 => 0.0f32..1.0, 1 => Just(f32::NAN), 1 => Just(-1.0f32)],
                0..40,
            ),
            0usize..10,
        )),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn the_loop_never_panics_and_respects_budget_and_stops(
        vocab in 1usize..8,
        prompt in proptest::collection::vec(prop_oneof![9 => 0u32..8, 1 => any::<u32>()], 0..12),
        max_new in 0usize..24,
        min_tokens in 0usize..8,
        max_ctx_extra in 0usize..30,
        eos in proptest::option::of(0u32..9),
        stop_seq in proptest::collection::vec(0u32..9, 0..3),
        temperature in prop_oneof![Just(0.0f32), 0.1f32..2.0],
        top_p in 0.05f32..=1.0,
        k in prop_oneof![Just(None), (0usize..6).prop_map(Some)],
        steps in proptest::collection::vec(draft_step(), 0..6),
        poison in proptest::collection::vec((1usize..12, any::<u8>()), 0..3),
        seed in any::<u64>(),
    ) {
        let max_ctx = prompt.len() + max_ctx_extra;
        let m = ToyModel::markov(vocab, 2, 2.0, seed);
        let target = Wobbly {
            inner: ToyModel::new(vocab, max_ctx.max(1), Arc::new(move |p: &[u32]| m.logits(p))),
            poison,
            calls: 0,
        };
        let mut stop = StopConditions::default();
        if !stop_seq.is_empty() {
            stop = stop.with_stop_sequence(stop_seq.clone());
        }
        if let Some(e) = eos {
            stop = stop.with_eos(e);
        }
        let sampling = SamplingConfig::builder()
            .temperature(temperature)
            .top_p(top_p)
            .build()
            .unwrap();
        let built = GenerationParams::builder()
            .sampling(sampling)
            .seed(seed)
            .max_new_tokens(max_new)
            .min_tokens(min_tokens)
            .stop(stop)
            .draft(k.map_or(DraftLength::Off, DraftLength::Fixed))
            .build();
        // The builder refuses a floor above the budget (the only invalid value drawn here).
        prop_assert_eq!(built.is_err(), min_tokens > max_new);
        let params = match built {
            Ok(p) => p,
            Err(e) => {
                prop_assert!(
                    matches!(e, Error::InvalidConfig { field: "min_tokens", .. }),
                    "{:?}",
                    e
                );
                return Ok(());
            }
        };
        let mut g = Generator::new(target, Rogue { steps, next: 0 });
        let mut streamed = Vec::new();
        let r = g.generate_with(&prompt, &params, |t| {
            streamed.extend_from_slice(t);
            std::ops::ControlFlow::Continue(())
        });
        match r {
            Ok(out) => {
                prop_assert_eq!(&streamed, &out.tokens);
                prop_assert!(out.tokens.len() <= max_new);
                prop_assert!(prompt.len() + out.tokens.len() <= max_ctx);
                prop_assert!(out.tokens.iter().all(|&t| (t as usize) < vocab));
                let cut = out.tokens.len();
                // min_tokens: no EOS before it; no stop before the end.
                if let Some(e) = eos {
                    let n = min_tokens.min(cut);
                    prop_assert!(!out.tokens[..n].contains(&e));
                }
                if matches!(out.finish, FinishReason::Eos) {
                    prop_assert_eq!(Some(out.tokens[cut - 1]), eos);
                }
            }
            Err(e) => {
                // Streamed tokens are never lost, and the error is typed.
                prop_assert_eq!(&streamed, &e.partial.tokens);
                prop_assert_eq!(e.partial.finish, FinishReason::Error);
                let typed = matches!(
                    e.error,
                    Error::EmptyPrompt
                        | Error::PromptTooLong { .. }
                        | Error::TokenOutOfVocab { .. }
                        | Error::InvalidConfig { .. }
                        | Error::InvalidProposal { proposer: "rogue", .. }
                        | Error::InvalidDraftProbs { .. }
                        | Error::NonFiniteLogits { .. }
                        | Error::NoAllowedToken { .. }
                        | Error::ShapeMismatch { .. }
                );
                prop_assert!(typed, "untyped error: {:?}", e.error);
                // The generator stays usable: a valid request runs.
                if !prompt.is_empty() && prompt.iter().all(|&t| (t as usize) < vocab) && prompt.len() <= max_ctx {
                    g.target_mut().poison.clear();
                    let ok = g.generate(&prompt, &GenerationParams::greedy(max_new.min(max_ctx - prompt.len())).with_draft(DraftLength::Off));
                    prop_assert!(ok.is_ok(), "{:?}", ok.err().map(|e| e.error));
                }
            }
        }
    }
}
