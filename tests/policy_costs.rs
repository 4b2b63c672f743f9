//! The adaptive policy on an engine where no draft can pay (issue 31): a verify forward of
//! `n` rows costs more than `n` single steps, as llama.cpp's CPU verify of Gemma 3 270M does
//! (c(2) = 3.8 single steps, c(7) = 7.3). Even a proposer that is always right loses there, so
//! the policy must not keep probing every request, and a generator started from an earlier
//! generator's cost estimates ([`AdaptiveState::costs_only`]) must not spend a warm-up step.
//!
//! Costs come from fixed curves ([`FixedCosts`]), never the clock: every count below is a
//! function of the tokens alone.

use speculative::decode::{AdaptiveConfig, DraftLength, FixedCosts, GenerationParams, Generator};
use speculative::test_util::{ToyModel, c10_greedy};
use speculative::{Draft, ProposeRequest, Proposer, Result};

/// Proposes the target's own greedy continuation: every draft is accepted.
struct Oracle;

impl Proposer for Oracle {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        draft.tokens = c10_greedy(req.context, req.max_draft);
        Ok(())
    }
}

/// Gemma 3 270M on llama.cpp, 1 thread (docs/benchmarks.md, issue 31), in units of 10 ms.
fn steep() -> FixedCosts {
    FixedCosts::curve(&[(1, 0.010), (2, 0.038), (3, 0.056), (5, 0.067), (7, 0.073)]).unwrap()
}

/// A curve on which full acceptance pays (c(7) = 1.6 single steps).
fn flat() -> FixedCosts {
    FixedCosts::curve(&[(1, 0.010), (7, 0.016)]).unwrap()
}

fn params(n: usize) -> GenerationParams {
    GenerationParams::greedy(n).with_draft(DraftLength::Adaptive(
        AdaptiveConfig::default().with_max_draft(6),
    ))
}

/// Runs `requests` generations of `n` tokens on one generator; returns the generator's
/// speculative steps per generation (steps that drafted at least one token).
fn speculative_steps(
    mut g: Generator<ToyModel, Oracle>,
    requests: usize,
    n: usize,
) -> (Vec<usize>, Generator<ToyModel, Oracle>) {
    let mut steps = Vec::new();
    for r in 0..requests {
        let prompt = [3, 1, r as u32 % 7];
        let out = g.generate(&prompt, &params(n)).unwrap();
        assert_eq!(out.tokens, c10_greedy(&prompt, n), "request {r}");
        let m = &out.metrics;
        steps.push(m.target_calls - m.no_draft_steps);
    }
    (steps, g)
}

#[test]
fn where_no_draft_can_pay_short_requests_do_not_each_pay_for_probes() {
    let g = Generator::new(ToyModel::c10(), Oracle).with_costs(steep());
    let (steps, _) = speculative_steps(g, 20, 40);
    // The first request's warm-up measures the curve; after that, one probe per 256 plain
    // steps at most (800 steps in all: at most 3), where the acceptance schedule would probe
    // 16 steps into each of the 20 requests.
    assert!(steps[0] >= 1, "the warm-up step: {steps:?}");
    let later: usize = steps[1..].iter().sum();
    assert!(later <= 3, "probes after the warm-up: {steps:?}");
}

#[test]
fn where_drafts_could_pay_the_policy_still_speculates() {
    // Negative control of the test above: on a flat curve the same always-right proposer is
    // used at every step after the warm-up.
    let g = Generator::new(ToyModel::c10(), Oracle).with_costs(flat());
    let (steps, _) = speculative_steps(g, 5, 40);
    assert!(steps[1..].iter().all(|&s| s >= 5), "{steps:?}");
}

#[test]
fn a_generator_started_from_cost_estimates_skips_the_warm_up() {
    let g = Generator::new(ToyModel::c10(), Oracle).with_costs(steep());
    let (_, g) = speculative_steps(g, 1, 40);
    let known = g.adaptive_state().costs_only();
    assert!(known.forward_cost(7).is_some());
    assert_eq!(known.acceptance(0), 0.5, "acceptance starts over");
    let fresh = Generator::new(ToyModel::c10(), Oracle).with_costs(steep());
    let (steps, _) = speculative_steps(fresh, 1, 40);
    assert!(steps[0] >= 1, "a fresh state warms up: {steps:?}");
    let warm = Generator::new(ToyModel::c10(), Oracle)
        .with_costs(steep())
        .with_adaptive_state(known);
    let (steps, _) = speculative_steps(warm, 1, 40);
    assert_eq!(steps, vec![0], "no warm-up, no probe");
}
