//! The fused prefill of `Generator` (issue 30): the prompt tokens a generation has left to
//! prefill (a fresh prompt, or the new message of a conversation turn after prefix reuse) are
//! fed in the first step's verify forward (`TargetModel::forward_tail`) instead of a forward of
//! their own, for proposers that draft from tokens alone.
//!
//! Every test compares the fused prefill with the separate one (`with_fused_prefill(false)`)
//! on exact toy targets (logits a function of the prefix), over multi-turn conversations with
//! prefix reuse on: the same tokens (greedy, and seeded sampling, whose draws are keyed by seed
//! and position), the same verify calls, one forward fewer per generation, and the fallback to
//! a separate prefill where the fusion does not apply (targets that cannot truncate, proposers
//! that need the target's features or a draft model, the option off).

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use speculative::decode::{
    AdaptiveConfig, DraftLength, GenerationParams, Generator, Metrics, StopConditions, TreeDrafts,
};
use speculative::propose::{
    DraftModelProposer, FixedMergeCosts, MergedProposer, PromptLookup, SuffixConfig, SuffixProposer,
};
use speculative::test_util::{CallLog, RecurrentToy, ToyModel, ToyRnn};
use speculative::{
    Draft, Error, NoProposer, ProposeRequest, Proposer, Result, SamplingConfig, TargetModel,
};

const V: usize = 12;

/// User tokens of turn `t`.
fn user(t: u32) -> Vec<u32> {
    (0..3 + t % 4)
        .map(|j| (j * 5 + t * 3 + 1) % V as u32)
        .collect()
}

/// A request of `n` new tokens: greedy or seeded sampling, with `draft` and trees of `nodes`.
fn params(n: usize, sampled: bool, draft: DraftLength, nodes: usize) -> GenerationParams {
    let p = if sampled {
        let cfg = SamplingConfig::builder().temperature(0.9).build().unwrap();
        GenerationParams::sampled(cfg, 17, n)
    } else {
        GenerationParams::greedy(n)
    };
    p.with_draft(draft).with_tree(TreeDrafts::nodes(nodes))
}

/// Each turn's streamed tokens and metrics.
type Turns = Vec<(Vec<u32>, Metrics)>;

/// `turns` turns of a conversation on `g` (each prompt: the previous one, its output and new
/// user tokens), streaming; checks the streamed tokens are the generation's.
fn converse<T: TargetModel, P: Proposer>(
    g: &mut Generator<T, P>,
    turns: u32,
    p: &GenerationParams,
) -> Turns {
    let mut history = vec![1, 2, 3];
    let mut out = Vec::new();
    for t in 0..turns {
        history.extend(user(t));
        let mut streamed = Vec::new();
        let out_t = g
            .generate_with(&history, p, |c| {
                streamed.extend_from_slice(c);
                ControlFlow::Continue(())
            })
            .unwrap();
        assert_eq!(streamed, out_t.tokens);
        history.extend(&out_t.tokens);
        out.push((out_t.tokens, out_t.metrics));
    }
    out
}

fn tokens(turns: &Turns) -> Vec<Vec<u32>> {
    turns.iter().map(|(t, _)| t.clone()).collect()
}

fn toy() -> CallLog<ToyModel> {
    CallLog::new(ToyModel::markov(V, 2, 2.0, 5).with_tree(16))
}

/// Runs the same conversation fused and separate with proposer `mk()` and request `p`;
/// returns both generators' turns and call logs (fused first).
fn both<P: Proposer>(
    mk: impl Fn() -> P,
    p: &GenerationParams,
) -> ((Turns, CallLog<ToyModel>), (Turns, CallLog<ToyModel>)) {
    let mut on = Generator::new(toy(), mk());
    let mut off = Generator::new(toy(), mk()).with_fused_prefill(false);
    assert!(on.fused_prefill() && !off.fused_prefill());
    let a = converse(&mut on, 5, p);
    let b = converse(&mut off, 5, p);
    ((a, on.into_parts().0), (b, off.into_parts().0))
}

fn suffix() -> SuffixProposer {
    SuffixProposer::new(SuffixConfig::default()).unwrap()
}

/// Prompt lookup + suffix, merged with fixed costs (the cost-aware merge's choices then depend
/// on the acceptance it sees, not on the clock, so runs with and without the fused prefill take
/// the same steps).
fn merged() -> MergedProposer {
    MergedProposer::new(vec![
        Box::new(PromptLookup::new(1, 4).unwrap()),
        Box::new(suffix()),
    ])
    .unwrap()
    .with_costs(FixedMergeCosts::new(0.010, 0.0005).unwrap())
}

/// Asserts a fused run (`a`, log `la`) did what a separate one (`b`, `lb`) did with one forward
/// fewer per generation: the same tokens, no prefill; with `same_steps` (fixed draft lengths)
/// also the same verify calls and tokens fed. (The adaptive policy learns no forward cost from
/// a fused step, so its later choices may differ.)
fn check_fused(
    (a, la): &(Turns, CallLog<ToyModel>),
    (b, lb): &(Turns, CallLog<ToyModel>),
    same_steps: bool,
    what: &str,
) {
    assert_eq!(tokens(a), tokens(b), "{what}");
    assert!(la.prefills.is_empty(), "{what}: {:?}", la.prefills);
    assert_eq!(lb.prefills.len(), a.len(), "{what}");
    assert_eq!(la.tails.len(), a.len(), "{what}");
    for (t, (((_, m), (_, m_off)), &(n, rows))) in a.iter().zip(b).zip(&la.tails).enumerate() {
        // The fused forward: the tokens left to prefill, then the verify rows.
        assert_eq!(m.prompt_tokens_fused, lb.prefills[t], "{what} turn {t}");
        assert_eq!(n, m.prompt_tokens_fused + rows, "{what} turn {t}");
        assert_eq!(m_off.prompt_tokens_fused, 0);
        assert_eq!(
            (m.prompt_tokens_reused, m.prompt_tokens_prefilled),
            (m_off.prompt_tokens_reused, m_off.prompt_tokens_prefilled),
            "{what} turn {t}"
        );
        if same_steps {
            assert_eq!(m.target_calls, m_off.target_calls, "{what} turn {t}");
        }
        assert_eq!(m.emitted, m_off.emitted, "{what} turn {t}");
        assert!(m.time_to_first_token.is_some());
        if t > 0 {
            assert!(m.prompt_tokens_reused > 0, "{what} turn {t}");
        }
    }
    // The same tokens reached the target, in one call fewer per generation.
    let fed = |l: &CallLog<ToyModel>| {
        l.prefills.iter().sum::<usize>()
            + l.forwards.iter().sum::<usize>()
            + l.tails.iter().map(|t| t.0).sum::<usize>()
    };
    let calls = |l: &CallLog<ToyModel>| l.prefills.len() + l.forwards.len() + l.tails.len();
    if same_steps {
        assert_eq!(fed(la), fed(lb), "{what}");
        assert_eq!(calls(la) + a.len(), calls(lb), "{what}");
    }
}

#[test]
fn model_free_proposers_fuse_the_prefill_and_outputs_do_not_change() {
    let adaptive = DraftLength::Adaptive(AdaptiveConfig::default().with_max_draft(6));
    for sampled in [false, true] {
        for draft in [DraftLength::Fixed(3), adaptive.clone()] {
            let p = params(9, sampled, draft.clone(), 0);
            let what = format!("sampled {sampled}, {draft:?}");
            let same = matches!(draft, DraftLength::Fixed(_));
            let (on, off) = both(|| PromptLookup::new(1, 3).unwrap(), &p);
            check_fused(&on, &off, same, &format!("prompt lookup, {what}"));
            let (on, off) = both(suffix, &p);
            check_fused(&on, &off, same, &format!("suffix, {what}"));
            let (on, off) = both(merged, &p);
            check_fused(&on, &off, same, &format!("merged, {what}"));
        }
    }
}

#[test]
fn fused_outputs_equal_plain_decoding_and_plain_decoding_fuses_too() {
    for sampled in [false, true] {
        let plain = params(9, sampled, DraftLength::Off, 0);
        let (on, off) = both(|| NoProposer, &plain);
        check_fused(&on, &off, true, "plain");
        let a = on.0;
        // Speculative decoding with the fused prefill gives plain decoding's tokens.
        let spec = params(9, sampled, DraftLength::Fixed(4), 0);
        let ((s, _), _) = both(|| PromptLookup::new(1, 3).unwrap(), &spec);
        assert_eq!(tokens(&s), tokens(&a), "sampled {sampled}");
    }
}

#[test]
fn a_tree_request_drafts_a_chain_in_the_fused_step_then_trees() {
    let adaptive = DraftLength::Adaptive(AdaptiveConfig::default().with_max_draft(6));
    for sampled in [false, true] {
        for draft in [DraftLength::Fixed(3), adaptive.clone()] {
            let p = params(12, sampled, draft, 8);
            let ((a, la), (b, lb)) = both(merged, &p);
            // Tree steps differ in the first step only, so compare tokens, not calls.
            assert_eq!(tokens(&a), tokens(&b), "sampled {sampled}");
            assert!(la.prefills.is_empty() && lb.tails.is_empty());
            assert_eq!(la.tails.len(), a.len());
            assert!(!la.trees.is_empty(), "later steps draft trees");
            // The fused steps were chains: one tree forward fewer per generation at most.
            assert!(la.trees.len() < lb.trees.len() + a.len());
            // Plain decoding gives the same tokens.
            let plain = params(12, sampled, DraftLength::Off, 0);
            let ((c, _), _) = both(|| NoProposer, &plain);
            assert_eq!(tokens(&a), tokens(&c), "sampled {sampled}");
        }
    }
}

#[test]
fn stops_inside_the_fused_step_end_the_generation_as_without_it() {
    for eos in 0..V as u32 {
        let stop = StopConditions::default().with_eos(eos);
        let p = params(9, false, DraftLength::Fixed(4), 0)
            .with_stop(stop)
            .unwrap();
        let ((a, la), (b, lb)) = both(|| PromptLookup::new(1, 3).unwrap(), &p);
        assert_eq!(tokens(&a), tokens(&b), "eos {eos}");
        assert_eq!(la.tails.len(), a.len());
        assert!(lb.tails.is_empty());
    }
}

#[test]
fn the_fused_step_respects_the_context_and_the_budget() {
    let next = |p: &[u32]| ((p.iter().map(|&t| t as u64).sum::<u64>() * 7 + 3) % 5) as u32;
    let model = |ctx| CallLog::new(ToyModel::deterministic(5, ctx, next));
    let prompt: Vec<u32> = (0..10).map(|i| i % 5).collect();
    for max_context in [10, 11, 12, 14] {
        for n in [1, 2, 5] {
            let p = params(n, false, DraftLength::Fixed(4), 0);
            let mut on = Generator::new(model(max_context), PromptLookup::new(1, 3).unwrap());
            let mut off = Generator::new(model(max_context), PromptLookup::new(1, 3).unwrap())
                .with_fused_prefill(false);
            let a = on.generate(&prompt, &p).unwrap();
            let b = off.generate(&prompt, &p).unwrap();
            assert_eq!(
                (&a.tokens, a.finish),
                (&b.tokens, b.finish),
                "{max_context} {n}"
            );
            assert!(a.tokens.len() <= n && prompt.len() + a.tokens.len() <= max_context);
            // A prompt that fills the context runs no step: it prefills as before.
            let fused = usize::from(max_context > prompt.len());
            assert_eq!(on.target().tails.len(), fused, "{max_context} {n}");
            assert_eq!(a.metrics.prompt_tokens_fused, fused * (prompt.len() - 1));
        }
    }
}

/// Model-free drafts (it says so), but its first `fail` proposals fail.
struct FailsFirst {
    inner: PromptLookup,
    fail: usize,
}

impl Proposer for FailsFirst {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        if self.fail > 0 {
            self.fail -= 1;
            return Err(Error::proposer("scripted failure"));
        }
        self.inner.propose(req, draft)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.inner.begin(prompt)
    }
    fn drafts_from_tokens(&self) -> bool {
        true
    }
}

#[test]
fn a_failed_fused_step_leaves_a_generator_that_gives_the_same_outputs() {
    let p = params(8, false, DraftLength::Fixed(3), 0);
    let prompts = [vec![1, 2, 3, 4, 5], vec![1, 2, 3, 4, 5, 6, 7]];
    let mut want = Generator::new(toy(), PromptLookup::new(1, 3).unwrap());
    let mut g = Generator::new(
        toy(),
        FailsFirst {
            inner: PromptLookup::new(1, 3).unwrap(),
            fail: 1,
        },
    );
    // The first step fails before its forward: nothing was fed past the reused prefix.
    let e = g.generate(&prompts[0], &p).unwrap_err();
    assert!(e.partial.tokens.is_empty());
    assert!(
        g.cached_tokens().is_none(),
        "the cache is not reused after it"
    );
    for prompt in &prompts {
        let x = g.generate(prompt, &p).unwrap();
        let y = want.generate(prompt, &p).unwrap();
        assert_eq!(x.tokens, y.tokens);
    }
    // A cancelled first step leaves no cache to reuse either, and the next turn is right.
    let cancel = p.clone().with_cancel(Arc::new(AtomicBool::new(true)));
    let c = g.generate(&prompts[1], &cancel).unwrap();
    assert!(c.tokens.is_empty());
    let x = g.generate(&prompts[0], &p).unwrap();
    let y = want.generate(&prompts[0], &p).unwrap();
    assert_eq!(x.tokens, y.tokens);
}

#[test]
fn targets_that_cannot_truncate_and_feature_proposers_prefill_separately() {
    let rnn = || ToyRnn::new(V, 6, 3.0, 1);
    let p = params(9, false, DraftLength::Fixed(3), 0);
    for snapshot in [true, false] {
        let target = if snapshot {
            RecurrentToy::snapshot(rnn(), 4096)
        } else {
            RecurrentToy::row_states(rnn(), 4096)
        };
        let mut g = Generator::new(target, PromptLookup::new(1, 3).unwrap());
        let mut reference = Generator::new(rnn().target(4096), NoProposer);
        let a = converse(&mut g, 4, &p);
        let b = converse(&mut reference, 4, &p);
        assert_eq!(tokens(&a), tokens(&b), "snapshot {snapshot}");
        // Every prompt went through a prefill of its own (the cache is kept only when the
        // prompt extends it, so each turn prefills its new tokens).
        assert!(a.iter().all(|(_, m)| m.prompt_tokens_fused == 0));
        let prefilled: usize = a.iter().map(|(_, m)| m.prompt_tokens_prefilled - 1).sum();
        assert!(
            g.target().prefill_tokens >= prefilled,
            "snapshot {snapshot}"
        );
    }
    // A draft model's proposer keeps the separate prefill (it needs its own cache of the
    // prompt, and a feature-conditioned one the target's features).
    let draft = DraftModelProposer::new(ToyModel::markov(V, 2, 2.0, 6));
    assert!(!draft.drafts_from_tokens());
    let mut g = Generator::new(toy(), draft);
    let a = converse(&mut g, 3, &p);
    assert!(a.iter().all(|(_, m)| m.prompt_tokens_fused == 0));
    assert!(g.target().tails.is_empty());
    // A merged proposer fuses only when every proposer drafts from tokens.
    let mixed = MergedProposer::new(vec![
        Box::new(PromptLookup::new(1, 3).unwrap()),
        Box::new(DraftModelProposer::new(ToyModel::markov(V, 2, 2.0, 6))),
    ])
    .unwrap();
    assert!(!mixed.drafts_from_tokens() && merged().drafts_from_tokens());
}

#[test]
fn the_default_forward_tail_is_a_prefill_then_a_forward() {
    let mut a = CallLog::new(ToyModel::markov(V, 2, 2.0, 5));
    let mut b = ToyModel::markov(V, 2, 2.0, 5);
    let tokens = [1, 2, 3, 4, 5, 6];
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    // CallLog runs the inner model's default: its prefill and forward.
    a.forward_tail(&tokens, 2, &mut la).unwrap();
    b.forward(&tokens, &mut lb).unwrap();
    assert_eq!(la, lb[4 * V..]);
    assert_eq!(a.seq_len(), 6);
    for rows in [0, 7] {
        assert!(matches!(
            a.forward_tail(&tokens, rows, &mut la),
            Err(Error::Model(_))
        ));
        assert_eq!(a.seq_len(), 6, "a refused call changes nothing");
    }
}
