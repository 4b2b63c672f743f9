//! Continuous batching ([`BatchGenerator`]) against the single-sequence loop ([`Generator`]):
//! every request's output from the batch equals its output alone, greedy and sampled, whatever
//! joins or leaves the batch; cancellation and a failing request leave the others unchanged.

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};

use speculative::decode::{
    AdaptiveConfig, BatchConfig, BatchGenerator, BatchRequest, DraftLength, FinishReason,
    FixedCosts, Generation, GenerationParams, Generator, RequestId, StopConditions, TreeDrafts,
};
use speculative::propose::{DraftModelProposer, PromptLookup, SuffixConfig, SuffixProposer};
use speculative::test_util::ToyModel;
use speculative::{
    BatchTarget, Draft, Error, PerSlot, ProposeRequest, Proposer, Result, SamplingConfig,
    SlotChunk, SlotInput,
};

const VOCAB: usize = 12;

fn target() -> ToyModel {
    ToyModel::markov(VOCAB, 2, 2.5, 7).with_tree(16)
}

fn batch_target(slots: usize) -> PerSlot<ToyModel> {
    PerSlot::new((0..slots).map(|_| target()).collect()).unwrap()
}

/// A request of the test mix: prompt, parameters and a proposer factory.
#[derive(Clone)]
struct Case {
    prompt: Vec<u32>,
    params: GenerationParams,
    proposer: usize,
}

fn proposer(kind: usize) -> Box<dyn Proposer + Send> {
    match kind % 4 {
        0 => Box::new(PromptLookup::new(1, 4).unwrap()),
        1 => Box::new(SuffixProposer::new(SuffixConfig::default()).unwrap()),
        2 => Box::new(DraftModelProposer::new(ToyModel::markov(VOCAB, 2, 2.5, 9))),
        _ => Box::new(PromptLookup::new(2, 6).unwrap()),
    }
}

fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((j * 7 + i * 3 + j / 3) % VOCAB) as u32)
        .collect()
}

fn cases(sampled: bool) -> Vec<Case> {
    let mut out = Vec::new();
    for i in 0..10 {
        let len = [1, 3, 9, 17, 30, 5, 12, 40, 2, 21][i];
        let max_new = 8 + 5 * i;
        let mut params = if sampled {
            let cfg = SamplingConfig::builder()
                .temperature(0.9)
                .top_k(8)
                .build()
                .unwrap();
            GenerationParams::sampled(cfg, 1000 + i as u64, max_new)
        } else {
            GenerationParams::greedy(max_new)
        };
        params = match i % 5 {
            0 => params.with_draft(DraftLength::Fixed(4)),
            1 => params.with_draft(DraftLength::Adaptive(AdaptiveConfig::default())),
            2 => params.with_draft(DraftLength::Off),
            3 => params
                .with_draft(DraftLength::Fixed(3))
                .with_tree(TreeDrafts::nodes(8)),
            _ => params.with_draft(DraftLength::Fixed(6)),
        };
        if matches!(i, 3 | 5 | 7 | 9) {
            // Drafts cut at an EOS (chains: one row less) next to trees in one verify_batch.
            params = params
                .with_stop(StopConditions::eos((i % 4) as u32 + 4))
                .unwrap();
        }
        out.push(Case {
            prompt: prompt(i, len),
            params,
            proposer: i + i / 5,
        });
    }
    out
}

fn alone(c: &Case) -> Generation {
    let mut g = Generator::new(target(), proposer(c.proposer));
    g.generate(&c.prompt, &c.params).unwrap()
}

/// Runs the cases through one batch with `slots` slots; half of them join after `join_after`
/// steps. Returns the generations in case order.
fn batched(
    cases: &[Case],
    slots: usize,
    config: BatchConfig,
    join_after: usize,
) -> Vec<Generation> {
    let mut b = BatchGenerator::with_config(batch_target(slots), config).unwrap();
    let mut ids: Vec<Option<RequestId>> = vec![None; cases.len()];
    let submit = |b: &mut BatchGenerator<_>, c: &Case| {
        b.submit(BatchRequest::new(
            c.prompt.clone(),
            c.params.clone(),
            proposer(c.proposer),
        ))
        .unwrap()
    };
    for (i, c) in cases.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        ids[i] = Some(submit(&mut b, c));
    }
    for _ in 0..join_after {
        b.step().unwrap();
    }
    for (i, c) in cases.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
        ids[i] = Some(submit(&mut b, c));
    }
    let done = b.run().unwrap();
    assert_eq!(done.len(), cases.len());
    assert!(b.is_idle());
    ids.iter()
        .map(|id| {
            let f = done.iter().find(|f| Some(f.id) == *id).unwrap();
            f.result.as_ref().unwrap().clone()
        })
        .collect()
}

fn assert_same(a: &Generation, b: &Generation, what: &str) {
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    assert_eq!(a.finish, b.finish, "{what}: finish");
}

#[test]
fn greedy_batch_equals_each_request_alone() {
    let cases = cases(false);
    let want: Vec<Generation> = cases.iter().map(alone).collect();
    for (slots, join, rows, chunk) in [(4, 3, 512, 256), (10, 0, 512, 256), (3, 5, 24, 7)] {
        let cfg = BatchConfig::default()
            .with_max_batch_tokens(rows)
            .with_prefill_chunk(chunk);
        let got = batched(&cases, slots, cfg, join);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_same(g, w, &format!("case {i}, {slots} slots"));
        }
    }
}

#[test]
fn sampled_batch_equals_each_request_alone_for_its_seed() {
    let cases = cases(true);
    let want: Vec<Generation> = cases.iter().map(alone).collect();
    for (slots, join) in [(2, 1), (10, 4)] {
        let got = batched(&cases, slots, BatchConfig::default(), join);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let c = &cases[i];
            if matches!(c.params.draft(), DraftLength::Adaptive(_)) && c.proposer % 4 == 2 {
                // A draft model samples its drafts (dense q): its tokens for a seed depend on
                // the draft lengths (GUIDE C15 holds for point-mass drafts), which the goodput
                // policy chooses per batch. Same length and end, not the same tokens.
                assert_eq!(g.tokens.len(), w.tokens.len(), "sampled case {i}");
                continue;
            }
            assert_same(g, w, &format!("sampled case {i}, {slots} slots"));
        }
    }
}

/// Four adaptive greedy requests whose draft model is the target itself (every draft is
/// accepted) through a batch whose policies learn from `costs`; returns the draft rows of every
/// step and the learned cost curve. Checks each output against plain greedy decoding.
fn adaptive_batch(costs: &FixedCosts) -> (Vec<usize>, Vec<(usize, f64)>) {
    let mut b = BatchGenerator::new(batch_target(4)).with_costs(costs.clone());
    let params = GenerationParams::greedy(48).with_draft(DraftLength::Adaptive(
        AdaptiveConfig::default().with_max_draft(6),
    ));
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(i, 6 + 3 * i)).collect();
    for p in &prompts {
        let proposer = Box::new(DraftModelProposer::new(target()));
        b.submit(BatchRequest::new(p.clone(), params.clone(), proposer))
            .unwrap();
    }
    let mut draft_rows = Vec::new();
    while !b.is_idle() {
        draft_rows.push(b.step().unwrap().draft_rows);
    }
    let mut done = b.take_finished();
    done.sort_by_key(|f| f.id);
    for (f, p) in done.iter().zip(&prompts) {
        let plain = Generator::new(target(), speculative::NoProposer)
            .generate(
                p,
                &GenerationParams::greedy(48).with_draft(DraftLength::Off),
            )
            .unwrap();
        assert_eq!(f.result.as_ref().unwrap().tokens, plain.tokens);
    }
    (draft_rows, b.cost_curve())
}

#[test]
fn the_goodput_policy_learns_step_costs_from_the_cost_source() {
    // Memory-bound: 10 ms a step plus 0.01 ms a row, so draft rows are almost free and every
    // draft is accepted: the policy drafts on (nearly) every decoding step.
    let cheap = FixedCosts::linear(0.010, 0.000_01).unwrap();
    let (rows, curve) = adaptive_batch(&cheap);
    // The learned curve is the source's, exactly (proposing is free).
    assert!(curve.len() >= 2, "{curve:?}");
    for &(n, secs) in &curve {
        assert_eq!(secs, cheap.forward(n), "{n} rows: {curve:?}");
    }
    let drafting = rows.iter().filter(|&&r| r > 0).count();
    println!(
        "memory-bound: {drafting} of {} steps drafted, rows {rows:?}",
        rows.len()
    );
    assert!(drafting * 10 >= rows.len() * 8, "{rows:?}");
    // Deterministic: the same source gives the same steps.
    assert_eq!(adaptive_batch(&cheap).0, rows);
    // Compute-bound: 1 ms a row through the origin, a draft row costs as much as a token and
    // brings less than one: speculation turns itself off but for the first steps (the prior,
    // until two row counts are measured) and the probes.
    let dear = FixedCosts::linear(0.0, 0.001).unwrap();
    let (rows_dear, _) = adaptive_batch(&dear);
    let drafting_dear = rows_dear.iter().filter(|&&r| r > 0).count();
    println!(
        "compute-bound: {drafting_dear} of {} steps drafted, rows {rows_dear:?}",
        rows_dear.len()
    );
    assert!(
        rows_dear.len() > rows.len(),
        "plain decoding takes more steps"
    );
    assert!(
        drafting_dear * 3 <= rows_dear.len(),
        "{drafting_dear} of {} steps drafted",
        rows_dear.len()
    );
}

#[test]
fn cancellation_leaves_the_others_unchanged() {
    let cases = cases(false);
    let want: Vec<Generation> = cases.iter().map(alone).collect();
    let mut b = BatchGenerator::new(batch_target(4));
    let streamed = Arc::new(Mutex::new(0usize));
    let ids: Vec<RequestId> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut r = BatchRequest::new(c.prompt.clone(), c.params.clone(), proposer(c.proposer));
            if i == 4 {
                // Cancels itself from its stream after its second step.
                let seen = Arc::clone(&streamed);
                r = r.with_stream(move |_| {
                    let mut n = seen.lock().unwrap();
                    *n += 1;
                    if *n == 2 {
                        ControlFlow::Break(())
                    } else {
                        ControlFlow::Continue(())
                    }
                });
            }
            b.submit(r).unwrap()
        })
        .collect();
    for _ in 0..4 {
        b.step().unwrap();
    }
    assert!(b.cancel(ids[0]), "an active request");
    assert!(b.cancel(ids[9]), "a waiting request");
    assert!(!b.cancel(RequestId(999)));
    let done = b.run().unwrap();
    for (i, id) in ids.iter().enumerate() {
        let g = done
            .iter()
            .find(|f| f.id == *id)
            .unwrap()
            .result
            .as_ref()
            .unwrap();
        match i {
            0 | 4 | 9 => {
                assert_eq!(g.finish, FinishReason::Cancelled, "case {i}");
                assert!(want[i].tokens.starts_with(&g.tokens), "case {i}: a prefix");
            }
            _ => assert_same(g, &want[i], &format!("case {i}")),
        }
    }
    assert!(
        done.iter()
            .find(|f| f.id == ids[9])
            .unwrap()
            .result
            .as_ref()
            .unwrap()
            .tokens
            .is_empty()
    );
    assert_eq!(*streamed.lock().unwrap(), 2);
}

/// A proposer that fails on its `n`-th proposal.
struct FailsAt {
    inner: PromptLookup,
    calls: usize,
    n: usize,
}

impl Proposer for FailsAt {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.calls += 1;
        if self.calls == self.n {
            return Err(Error::Proposer("scripted failure".into()));
        }
        self.inner.propose(req, draft)
    }
}

#[test]
fn a_failing_request_ends_alone_with_its_error() {
    let cases = cases(false);
    let want: Vec<Generation> = cases.iter().map(alone).collect();
    let mut b = BatchGenerator::new(batch_target(5));
    let ids: Vec<RequestId> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let p: Box<dyn Proposer + Send> = if i == 0 {
                Box::new(FailsAt {
                    inner: PromptLookup::new(1, 4).unwrap(),
                    calls: 0,
                    n: 3,
                })
            } else {
                proposer(c.proposer)
            };
            b.submit(BatchRequest::new(c.prompt.clone(), c.params.clone(), p))
                .unwrap()
        })
        .collect();
    let done = b.run().unwrap();
    for (i, id) in ids.iter().enumerate() {
        let r = &done.iter().find(|f| f.id == *id).unwrap().result;
        if i == 0 {
            let e = r.as_ref().unwrap_err();
            assert!(matches!(e.error, Error::Proposer(_)), "{e}");
            assert_eq!(e.partial.finish, FinishReason::Error);
            assert!(want[0].tokens.starts_with(&e.partial.tokens));
            assert!(!e.partial.tokens.is_empty());
        } else {
            assert_same(r.as_ref().unwrap(), &want[i], &format!("case {i}"));
        }
    }
}

#[test]
fn bad_requests_are_refused_at_submit() {
    let mut b = BatchGenerator::new(batch_target(2));
    let p = || -> Box<dyn Proposer + Send> { Box::new(PromptLookup::new(1, 4).unwrap()) };
    let greedy = GenerationParams::greedy(4);
    assert!(matches!(
        b.submit(BatchRequest::new(vec![], greedy.clone(), p())),
        Err(Error::EmptyPrompt)
    ));
    assert!(matches!(
        b.submit(BatchRequest::new(vec![VOCAB as u32], greedy.clone(), p())),
        Err(Error::TokenOutOfVocab { .. })
    ));
    let long = vec![1; target().max_context_len() + 1];
    assert!(matches!(
        b.submit(BatchRequest::new(long, greedy.clone(), p())),
        Err(Error::PromptTooLong { .. })
    ));
    let bad = greedy
        .to_builder()
        .sampling(SamplingConfig::builder().temperature(0.5).build().unwrap())
        .stop(StopConditions::eos(VOCAB as u32 + 3))
        .build()
        .unwrap();
    assert!(b.submit(BatchRequest::new(vec![1, 2], bad, p())).is_err());
    assert!(b.is_idle());
    assert!(
        BatchGenerator::with_config(
            batch_target(1),
            BatchConfig::default().with_max_batch_tokens(0)
        )
        .is_err()
    );
}

trait MaxContext {
    fn max_context_len(&self) -> usize;
}

impl MaxContext for ToyModel {
    fn max_context_len(&self) -> usize {
        speculative::TargetModel::max_context(self)
    }
}

#[test]
fn one_forward_per_step_and_stats_add_up() {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let t = Probe {
        calls: Some(Arc::clone(&calls)),
        ..Probe::new(6)
    };
    let cfg = BatchConfig::default()
        .with_max_batch_tokens(40)
        .with_prefill_chunk(16);
    let mut b = BatchGenerator::with_config(t, cfg).unwrap();
    let mut mix = cases(false);
    // A fixed draft longer than its node budget, from a chain-only proposer: up to k rows.
    mix.push(Case {
        prompt: prompt(3, 20),
        params: GenerationParams::greedy(40)
            .with_draft(DraftLength::Fixed(8))
            .with_tree(TreeDrafts::nodes(4)),
        proposer: 0,
    });
    for c in mix {
        b.submit(BatchRequest::new(c.prompt, c.params, proposer(c.proposer)))
            .unwrap();
    }
    let mut steps = 0;
    let mut rows = 0;
    let mut emitted = 0;
    while !b.is_idle() {
        let s = b.step().unwrap();
        assert!(s.rows <= 40, "{s:?}");
        // Each sequence feeds its last token and its drafts, but a chain cut at an end has no
        // row after its final draft.
        assert!(
            s.rows <= s.prefill_rows + s.sequences + s.draft_rows,
            "{s:?}"
        );
        assert!(s.rows >= s.prefill_rows + s.draft_rows, "{s:?}");
        steps += 1;
        rows += s.rows;
        emitted += s.emitted;
    }
    let log = calls.lock().unwrap();
    assert_eq!(log.len() as u64, b.metrics().steps);
    assert_eq!(log.iter().sum::<usize>(), rows);
    assert_eq!(b.metrics().rows, rows as u64);
    assert_eq!(b.metrics().emitted, emitted as u64);
    assert!(steps > 0 && !b.cost_curve().is_empty());
    let finished = b.take_finished();
    assert_eq!(
        finished
            .iter()
            .map(|f| f.result.as_ref().unwrap().tokens.len())
            .sum::<usize>(),
        emitted
    );
}

#[test]
fn batch_generator_is_send() {
    fn is_send<T: Send>() {}
    is_send::<BatchGenerator<PerSlot<ToyModel>>>();
    is_send::<BatchRequest>();
}

#[test]
fn requests_the_batch_cannot_run_are_refused_and_edge_requests_end_cleanly() {
    let cfg = BatchConfig::default().with_max_batch_tokens(8);
    let mut b = BatchGenerator::with_config(batch_target(2), cfg).unwrap();
    let p = || -> Box<dyn Proposer + Send> { Box::new(PromptLookup::new(1, 4).unwrap()) };
    // k + 1 = 9 rows do not fit 8; neither does a 12-node tree.
    let wide = GenerationParams::greedy(8).with_draft(DraftLength::Fixed(8));
    assert!(matches!(
        b.submit(BatchRequest::new(vec![1, 2], wide, p())),
        Err(Error::InvalidConfig { field: "draft", .. })
    ));
    let tree = GenerationParams::greedy(8)
        .with_draft(DraftLength::Fixed(2))
        .with_tree(TreeDrafts::nodes(12));
    assert!(b.submit(BatchRequest::new(vec![1, 2], tree, p())).is_err());
    // No token to generate: ends at once with nothing prefilled.
    let none = b
        .submit(BatchRequest::new(
            vec![1; 30],
            GenerationParams::greedy(0),
            p(),
        ))
        .unwrap();
    // Cancelled by its flag while still prefilling (a 1-token prefill chunk per step).
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let params = GenerationParams::greedy(8).with_cancel(Arc::clone(&flag));
    let cancelled = b
        .submit(BatchRequest::new(vec![2; 60], params, p()))
        .unwrap();
    let s = b.step().unwrap();
    assert!(s.prefill_rows <= 8, "{s:?}");
    flag.store(true, std::sync::atomic::Ordering::Relaxed);
    let done = b.run().unwrap();
    let get = |id| {
        done.iter()
            .find(|f| f.id == id)
            .unwrap()
            .result
            .as_ref()
            .unwrap()
            .clone()
    };
    assert_eq!(get(none).finish, FinishReason::MaxTokens);
    assert!(get(none).tokens.is_empty());
    assert_eq!(get(cancelled).finish, FinishReason::Cancelled);
    assert!(get(cancelled).tokens.is_empty());
    assert_eq!(b.metrics().prefill_rows, s.prefill_rows as u64);

    // A target without slots.
    let mut b = BatchGenerator::new(Probe {
        slots: Some(0),
        ..Probe::new(1)
    });
    assert!(
        b.submit(BatchRequest::new(vec![1], GenerationParams::greedy(4), p()))
            .is_err()
    );
    assert!(b.is_idle());
}

/// `PerSlot` over toy models, with probes and faults on demand: logs every forward's rows and
/// checks that decode chunks come before prefill chunks (`calls`), reports another slot count
/// (`slots`), fails `release`, or writes one logit row too few.
struct Probe {
    inner: PerSlot<ToyModel>,
    calls: Option<Arc<Mutex<Vec<usize>>>>,
    slots: Option<usize>,
    release_fails: bool,
    short_logits: bool,
}

impl Probe {
    fn new(slots: usize) -> Self {
        Probe {
            inner: batch_target(slots),
            calls: None,
            slots: None,
            release_fails: false,
            short_logits: false,
        }
    }
}

impl BatchTarget for Probe {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn max_slots(&self) -> usize {
        self.slots.unwrap_or(self.inner.max_slots())
    }
    fn max_batch_tokens(&self) -> usize {
        64
    }
    fn max_tree_nodes(&self) -> usize {
        self.inner.max_tree_nodes()
    }
    fn seq_len(&self, slot: usize) -> Result<usize> {
        self.inner.seq_len(slot)
    }
    fn forward_batch(&mut self, chunks: &[SlotChunk<'_>], logits: &mut Vec<f32>) -> Result<()> {
        if let Some(calls) = &self.calls {
            calls
                .lock()
                .unwrap()
                .push(chunks.iter().map(|c| c.input.rows()).sum());
            // Decode chunks come before prefill chunks.
            let first_prefill = chunks
                .iter()
                .position(|c| matches!(c.input, SlotInput::Prefill(_)))
                .unwrap_or(chunks.len());
            assert!(
                chunks[first_prefill..]
                    .iter()
                    .all(|c| matches!(c.input, SlotInput::Prefill(_)))
            );
        }
        self.inner.forward_batch(chunks, logits)?;
        if self.short_logits && !logits.is_empty() {
            logits.truncate(logits.len() - VOCAB);
        }
        Ok(())
    }
    fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        self.inner.truncate(slot, len)
    }
    fn commit_tree(&mut self, slot: usize, path: &[u32]) -> Result<()> {
        self.inner.commit_tree(slot, path)
    }
    fn release(&mut self, slot: usize) -> Result<()> {
        self.inner.release(slot)?;
        if self.release_fails {
            return Err(Error::Model("release failed".into()));
        }
        Ok(())
    }
}

#[test]
fn engine_faults_end_requests_with_errors_and_never_hang() {
    let p = || PromptLookup::new(1, 4).unwrap();
    let greedy = || GenerationParams::greedy(6).with_draft(DraftLength::Fixed(2));
    // A failed release retires the slot: the next request cannot run, and `step` says so
    // instead of spinning. (Slots are released when a request ends with prefix reuse off;
    // with it on, a slot keeps its cache and is released only after an error.)
    let mut b = BatchGenerator::new(Probe {
        release_fails: true,
        ..Probe::new(1)
    })
    .with_prefix_reuse(false);
    let first = b
        .submit(BatchRequest::new(vec![1, 2, 3], greedy(), p()))
        .unwrap();
    let second = b
        .submit(BatchRequest::new(vec![4, 5], greedy(), p()))
        .unwrap();
    let err = b.run().unwrap_err();
    assert!(matches!(err, Error::TargetContract { .. }), "{err}");
    let done = b.take_finished();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].id, first);
    assert_eq!(done[0].result.as_ref().unwrap().tokens.len(), 6);
    assert_eq!(b.waiting(), 1);
    assert!(b.cancel(second));
    // Logits of the wrong size: the step fails with a contract error, and so does every
    // request of that forward.
    let mut b = BatchGenerator::new(Probe {
        short_logits: true,
        ..Probe::new(2)
    });
    b.submit(BatchRequest::new(vec![1, 2, 3], greedy(), p()))
        .unwrap();
    b.submit(BatchRequest::new(vec![4, 5], greedy(), p()))
        .unwrap();
    let err = b.run().unwrap_err();
    assert!(matches!(err, Error::TargetContract { .. }), "{err}");
    let done = b.take_finished();
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|f| f.result.is_err()));
}
