//! A proposer that cuts its own drafts by cost ([`Proposer::sizes_own_drafts`]: the cost-aware
//! [`MergedProposer`] on greedy requests) under the adaptive draft length (issue 31): the
//! single-sequence loop asks it for the longest draft allowed instead of stacking the adaptive
//! policy's choice on the merge's cut. On a verify cost curve where only a three-token draft pays (llama.cpp's CPU
//! verify of Gemma 3 270M: 3 rows cost more than 4), the policy alone keeps every step plain
//! (its probes of 2 are cut by the merge and never teach it the third position), while the
//! merge alone drafts on every step.
//!
//! Costs come from fixed tables, never the clock: every count below is a function of the
//! tokens alone.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use speculative::decode::{AdaptiveConfig, DraftLength, FixedCosts, GenerationParams, Generator};
use speculative::propose::{MergeCosts, MergedProposer};
use speculative::test_util::{ToyModel, c10_greedy};
use speculative::{Draft, ProposeRequest, Proposer, Result, SamplingConfig};

/// The verify cost by rows, ms (rows past the table: 14 ms more each).
const TILED_MS: [f64; 7] = [14.0, 29.0, 45.0, 40.0, 57.0, 71.0, 85.0];

fn tiled_secs(rows: usize) -> f64 {
    let last = TILED_MS.len();
    (TILED_MS[rows.clamp(1, last) - 1] + 14.0 * rows.saturating_sub(last) as f64) / 1000.0
}

/// The merge's clock: the tiled step cost; members free.
struct Tiled;

impl MergeCosts for Tiled {
    fn member_secs(&self, _: usize, _: usize, _: Duration) -> f64 {
        0.0
    }
    fn step_secs(&self, rows: usize, _: Duration) -> f64 {
        tiled_secs(rows)
    }
}

/// Proposes the target's own greedy continuation (every draft is accepted) and logs the draft
/// bound of each request.
struct Oracle(Arc<Mutex<Vec<usize>>>);

impl Proposer for Oracle {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.lock().unwrap().push(req.max_draft);
        draft.clear();
        draft.tokens = c10_greedy(req.context, req.max_draft);
        Ok(())
    }
}

/// The merge with [`Proposer::sizes_own_drafts`] hidden (the default `false`).
struct Hidden(MergedProposer);

impl Proposer for Hidden {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.propose(req, draft)
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.0.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.0.begin(prompt)
    }
    fn finish(&mut self, sequence: &[u32]) {
        self.0.finish(sequence)
    }
}

/// What 5 greedy generations of 48 tokens on one generator did: the draft bounds the merge
/// was asked for, and the speculative and plain steps.
struct Run {
    bounds: Vec<usize>,
    speculative: usize,
    plain: usize,
}

fn run(hide: bool) -> Run {
    let bounds = Arc::new(Mutex::new(Vec::new()));
    let merge = MergedProposer::new(vec![Box::new(Oracle(bounds.clone()))])
        .unwrap()
        .with_costs(Tiled);
    assert!(merge.sizes_own_drafts(&SamplingConfig::greedy()));
    // Sampled requests keep the adaptive policy's choice (the merge's sampled rates run high).
    assert!(!merge.sizes_own_drafts(&SamplingConfig::sampling(0.7).unwrap()));
    let proposer: Box<dyn Proposer + Send> = if hide {
        Box::new(Hidden(merge))
    } else {
        Box::new(merge)
    };
    let curve: Vec<(usize, f64)> = (1..=7).map(|n| (n, tiled_secs(n))).collect();
    let mut g =
        Generator::new(ToyModel::c10(), proposer).with_costs(FixedCosts::curve(&curve).unwrap());
    let params = GenerationParams::greedy(48).with_draft(DraftLength::Adaptive(
        AdaptiveConfig::default().with_max_draft(6),
    ));
    let (mut speculative, mut plain) = (0, 0);
    for r in 0..5u32 {
        let prompt = [3, 1, r % 7];
        let out = g.generate(&prompt, &params).unwrap();
        assert_eq!(out.tokens, c10_greedy(&prompt, 48), "request {r}");
        plain += out.metrics.no_draft_steps;
        speculative += out.metrics.target_calls - out.metrics.no_draft_steps;
    }
    let bounds = bounds.lock().unwrap().clone();
    Run {
        bounds,
        speculative,
        plain,
    }
}

#[test]
fn a_merge_that_cuts_its_own_drafts_is_asked_for_the_longest_draft() {
    let r = run(false);
    // Every ask is the longest the request allows: 6, less only where the token budget
    // leaves fewer.
    let short = r.bounds.iter().filter(|&&b| b < 6).count();
    assert!(short <= 5 * 5, "{:?}", r.bounds);
    assert!(r.bounds.iter().all(|&b| b >= 1), "{:?}", r.bounds);
    assert!(
        r.speculative >= 4 * r.plain,
        "{} speculative, {} plain",
        r.speculative,
        r.plain
    );
}

#[test]
fn the_adaptive_policy_on_top_of_the_merge_keeps_it_plain() {
    // Negative control of the test above: the same merge with the flag hidden gets the
    // adaptive policy's choices, which on this curve are plain steps nearly always.
    let r = run(true);
    assert!(
        r.plain >= 4 * r.speculative,
        "{} speculative, {} plain",
        r.speculative,
        r.plain
    );
    let asked_for_6 = r.bounds.iter().filter(|&&b| b == 6).count();
    assert!(asked_for_6 <= 10, "{:?}", r.bounds);
}
