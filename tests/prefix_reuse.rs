//! Prefix reuse across generations and requests (issue 30): a new generation keeps the longest
//! common prefix of its prompt and the target's cache and prefills only the rest; the batch
//! loop keeps a finished request's slot cache, lands a conversation's next turn in it, evicts
//! the least recently used slot and copies shared prefixes between slots.
//!
//! Every test compares reuse on with reuse off (the old full prefill) on exact toy targets
//! (logits a function of the prefix), so any wrong truncation, a stale proposer state or a
//! wrong hidden row shows up as a different token, draft, q or hidden row. Conversations are
//! multi-turn: each turn's prompt is the previous prompt, its output and new user tokens.

use speculative::decode::{
    BatchGenerator, BatchRequest, DraftLength, GenerationParams, Generator, Metrics,
};
use speculative::propose::{DraftModelProposer, PromptLookup, SuffixConfig, SuffixProposer};
use speculative::test_util::{ToyFeatureDraft, ToyModel, ToyRnn};
use speculative::{
    BatchTarget, Draft, NoProposer, PerSlot, ProposeRequest, Proposer, Result, SamplingConfig,
    SlotChunk, TargetModel,
};

const V: usize = 12;

/// User tokens of turn `t` of conversation `c`.
fn user(c: u32, t: u32) -> Vec<u32> {
    (0..3 + (c + t) % 4)
        .map(|j| (j * 5 + c * 7 + t * 3) % V as u32)
        .collect()
}

/// A fixed-draft greedy or seeded request of `n` new tokens.
fn params(n: usize, sampled: bool) -> GenerationParams {
    let p = if sampled {
        let cfg = SamplingConfig::builder().temperature(0.9).build().unwrap();
        GenerationParams::sampled(cfg, 17, n)
    } else {
        GenerationParams::greedy(n)
    };
    p.with_draft(DraftLength::Fixed(3))
}

/// Runs `turns` turns of one conversation on `g` (system prompt `system`); returns every turn's
/// output and metrics.
fn converse<T: TargetModel, P: Proposer>(
    g: &mut Generator<T, P>,
    system: &[u32],
    c: u32,
    turns: u32,
    sampled: bool,
) -> Vec<(Vec<u32>, Metrics)> {
    let mut history = system.to_vec();
    let mut out = Vec::new();
    for t in 0..turns {
        history.extend(user(c, t));
        let out_t = g.generate(&history, &params(6, sampled)).unwrap();
        history.extend(&out_t.tokens);
        out.push((out_t.tokens, out_t.metrics));
    }
    out
}

fn tokens(turns: &[(Vec<u32>, Metrics)]) -> Vec<Vec<u32>> {
    turns.iter().map(|(t, _)| t.clone()).collect()
}

#[test]
fn a_conversation_prefills_only_its_new_tokens_and_outputs_do_not_change() {
    for sampled in [false, true] {
        let on_target = ToyModel::markov(V, 3, 2.0, 5);
        let mut on = Generator::new(on_target, PromptLookup::new(1, 3).unwrap());
        let mut off = Generator::new(
            ToyModel::markov(V, 3, 2.0, 5),
            PromptLookup::new(1, 3).unwrap(),
        )
        .with_prefix_reuse(false);
        assert!(on.prefix_reuse() && !off.prefix_reuse());
        let a = converse(&mut on, &[1, 2, 3, 4], 0, 4, sampled);
        let b = converse(&mut off, &[1, 2, 3, 4], 0, 4, sampled);
        assert_eq!(tokens(&a), tokens(&b), "sampled {sampled}");
        // Turn t > 0 keeps the previous prompt and its output but the last token.
        let mut prompt_len = 4;
        let mut prev_ctx = 0;
        for (t, ((out_t, m), (_, m_off))) in a.iter().zip(&b).enumerate() {
            prompt_len += user(0, t as u32).len();
            let want = if t == 0 { 0 } else { prev_ctx - 1 };
            assert_eq!(m.prompt_tokens_reused, want, "turn {t}");
            assert_eq!(
                m.prompt_tokens_reused + m.prompt_tokens_prefilled,
                prompt_len
            );
            assert_eq!(
                (m_off.prompt_tokens_reused, m_off.prompt_tokens_prefilled),
                (0, prompt_len)
            );
            prompt_len += out_t.len();
            prev_ctx = prompt_len;
        }
        // The same steps ran: the target processed exactly the reused tokens fewer.
        let (fed_on, fed_off) = (on.target().forward_tokens, off.target().forward_tokens);
        let reused: usize = a.iter().map(|(_, m)| m.prompt_tokens_reused).sum();
        assert!(reused > 0);
        assert_eq!(fed_off - fed_on, reused, "sampled {sampled}");
    }
}

#[test]
fn the_cache_after_reuse_is_a_fresh_prefill_of_the_prompt() {
    // The session prefills before its first step (no fused prefill, which feeds the prompt
    // in that step: tests/fused_prefill.rs).
    let mut g =
        Generator::new(ToyModel::markov(V, 2, 2.0, 1), NoProposer).with_fused_prefill(false);
    g.generate(&[1, 2, 3, 4, 5], &params(4, false)).unwrap();
    // A prompt that diverges inside the cached prefix keeps only the common part.
    let prompt = [1, 2, 3, 9, 9, 9];
    let p = params(3, false);
    let s = g.session(&prompt, &p).unwrap();
    assert_eq!(s.metrics().prompt_tokens_reused, 3);
    assert_eq!(g.target().tokens(), &prompt[..5]);
    // A prompt that is entirely cached keeps all but its last token.
    let again = g.generate(&prompt, &p).unwrap();
    let full: Vec<u32> = prompt.iter().chain(&again.tokens).copied().collect();
    let s = g.session(&full[..7], &p).unwrap();
    assert_eq!(s.metrics().prompt_tokens_reused, 6);
    assert_eq!(g.target().tokens(), &full[..6]);
    // An unrelated prompt starts from an empty cache; `target_mut` forgets the cache.
    let s = g.session(&[7, 7], &p).unwrap();
    assert_eq!(s.metrics().prompt_tokens_reused, 0);
    g.generate(&[7, 7, 7], &p).unwrap();
    let _ = g.target_mut();
    let s = g.session(&[7, 7, 7, 1], &p).unwrap();
    assert_eq!(s.metrics().prompt_tokens_reused, 0);
}

/// Records what the proposer was asked (context, hidden state, hidden rows) and drafted.
/// One proposal: context, hidden state, hidden rows, draft.
type Asked = (Vec<u32>, Option<Vec<f32>>, Option<Vec<f32>>, Draft);

struct Recorder<P> {
    inner: P,
    log: Vec<Asked>,
}

impl<P: Proposer> Proposer for Recorder<P> {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose(req, draft)?;
        self.log.push((
            req.context.to_vec(),
            req.target_hidden.map(<[f32]>::to_vec),
            req.target_hidden_rows.map(<[f32]>::to_vec),
            draft.clone(),
        ));
        Ok(())
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.inner.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.inner.begin(prompt)
    }
    fn begin_reusing(&mut self, prompt: &[u32]) -> Result<()> {
        self.inner.begin_reusing(prompt)
    }
    fn finish(&mut self, sequence: &[u32]) {
        self.inner.finish(sequence)
    }
}

fn eagle(reuse: bool) -> Generator<ToyModel, Recorder<DraftModelProposer<ToyFeatureDraft>>> {
    let rnn = ToyRnn::new(V, 6, 3.0, 4);
    let head = ToyFeatureDraft::new(rnn.perturbed(0.3, 9), 1 << 16);
    let rec = Recorder {
        inner: DraftModelProposer::new(head),
        log: Vec::new(),
    };
    Generator::new(rnn.target(1 << 16), rec).with_prefix_reuse(reuse)
}

#[test]
fn eagle_features_and_the_draft_cache_are_kept_and_drafts_do_not_change() {
    for sampled in [false, true] {
        let (mut on, mut off) = (eagle(true), eagle(false));
        let a = converse(&mut on, &[2, 4], 1, 4, sampled);
        let b = converse(&mut off, &[2, 4], 1, 4, sampled);
        assert_eq!(tokens(&a), tokens(&b));
        // Every proposal saw the same context, hidden state and rows, and drafted the same
        // tokens with the same q.
        assert_eq!(on.proposer().log, off.proposer().log, "sampled {sampled}");
        // A whole cached prompt (the last turn's context) uses the kept hidden rows too.
        let last = on.proposer().log.last().unwrap().0.clone();
        let x = on.generate(&last, &params(4, sampled)).unwrap();
        let y = off.generate(&last, &params(4, sampled)).unwrap();
        assert_eq!(x.tokens, y.tokens);
        assert_eq!(x.metrics.prompt_tokens_reused, last.len() - 1);
        let n = off.proposer().log.len();
        assert_eq!(on.proposer().log[n - 1], off.proposer().log[n - 1]);
        // The head never restarted from an empty sequence after the first turn, and its later
        // turns handed over only the features past the kept prefix.
        let model = on.proposer().inner.model();
        assert_eq!(model.first_rows, 1);
        let off_model = off.proposer().inner.model();
        assert!(off_model.first_rows >= 4);
        let handed: usize = model.feature_sets.iter().map(|&(_, n)| n).sum();
        let handed_off: usize = off_model.feature_sets.iter().map(|&(_, n)| n).sum();
        assert!(handed < handed_off, "{handed} vs {handed_off}");
    }
}

#[test]
fn draft_model_and_suffix_proposers_give_the_same_output() {
    let mk = |reuse: bool| {
        let draft = DraftModelProposer::new(ToyModel::markov(V, 2, 2.0, 6));
        Generator::new(ToyModel::markov(V, 3, 2.0, 5), draft).with_prefix_reuse(reuse)
    };
    let (mut on, mut off) = (mk(true), mk(false));
    for sampled in [false, true] {
        let a = converse(&mut on, &[5, 6, 7], 2, 3, sampled);
        let b = converse(&mut off, &[5, 6, 7], 2, 3, sampled);
        assert_eq!(tokens(&a), tokens(&b));
    }
    assert!(on.proposer().model().forward_tokens < off.proposer().model().forward_tokens);
    let mk = |reuse: bool| {
        Generator::new(
            ToyModel::markov(V, 3, 2.0, 5),
            SuffixProposer::new(SuffixConfig::default()).unwrap(),
        )
        .with_prefix_reuse(reuse)
    };
    let (mut on, mut off) = (mk(true), mk(false));
    for c in 0..3 {
        let a = converse(&mut on, &[5, 6, 7], c, 3, false);
        let b = converse(&mut off, &[5, 6, 7], c, 3, false);
        assert_eq!(tokens(&a), tokens(&b));
    }
}

// ---------------------------------------------------------------------------------------------
// Batch loop

/// `PerSlot` over toys, optionally without prefix copy.
struct NoCopy(PerSlot<ToyModel>);

impl BatchTarget for NoCopy {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn max_slots(&self) -> usize {
        self.0.max_slots()
    }
    fn max_batch_tokens(&self) -> usize {
        self.0.max_batch_tokens()
    }
    fn seq_len(&self, slot: usize) -> Result<usize> {
        self.0.seq_len(slot)
    }
    fn forward_batch(&mut self, chunks: &[SlotChunk<'_>], logits: &mut Vec<f32>) -> Result<()> {
        self.0.forward_batch(chunks, logits)
    }
    fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        self.0.truncate(slot, len)
    }
    fn release(&mut self, slot: usize) -> Result<()> {
        self.0.release(slot)
    }
}

fn slots(n: usize) -> PerSlot<ToyModel> {
    PerSlot::new((0..n).map(|_| ToyModel::markov(V, 3, 2.0, 5)).collect()).unwrap()
}

/// Runs `convs` conversations of `turns` turns each through `b`, `wave` conversations at a
/// time (one turn of each per wave, the next turn submitted after the previous finished);
/// returns each conversation's outputs and the per-request metrics.
fn batch_converse<B: BatchTarget>(
    b: &mut BatchGenerator<B>,
    system: &[u32],
    convs: u32,
    turns: u32,
    keyed: bool,
) -> (Vec<Vec<Vec<u32>>>, Vec<Metrics>) {
    let mut hist: Vec<Vec<u32>> = (0..convs).map(|_| system.to_vec()).collect();
    let mut outs = vec![Vec::new(); convs as usize];
    let mut metrics = Vec::new();
    for t in 0..turns {
        let mut ids = Vec::new();
        for c in 0..convs {
            hist[c as usize].extend(user(c, t));
            let mut req = BatchRequest::new(
                hist[c as usize].clone(),
                params(5, c % 2 == 1),
                PromptLookup::new(1, 3).unwrap(),
            );
            if keyed {
                req = req.with_conversation(u64::from(c));
            }
            ids.push((b.submit(req).unwrap(), c));
        }
        for f in b.run().unwrap() {
            let c = ids.iter().find(|(id, _)| *id == f.id).unwrap().1 as usize;
            let g = f.result.unwrap();
            hist[c].extend(&g.tokens);
            outs[c].push(g.tokens);
            metrics.push(g.metrics);
        }
    }
    (outs, metrics)
}

#[test]
fn batch_turns_land_in_their_slots_and_eviction_never_changes_outputs() {
    let system: Vec<u32> = (0..20).map(|i| (i * 5 + 1) % V as u32).collect();
    let mut off = BatchGenerator::new(slots(3)).with_prefix_reuse(false);
    let (want, m_off) = batch_converse(&mut off, &system, 5, 3, false);
    assert!(m_off.iter().all(|m| m.prompt_tokens_reused == 0));
    // 5 conversations over 3 slots: turns evict each other (least recently used first).
    for keyed in [false, true] {
        for copy in [false, true] {
            let (got, m) = if copy {
                let mut on = BatchGenerator::new(slots(3));
                let r = batch_converse(&mut on, &system, 5, 3, keyed);
                assert!(on.metrics().prefix_copies > 0);
                r
            } else {
                let mut on = BatchGenerator::new(NoCopy(slots(3)));
                let r = batch_converse(&mut on, &system, 5, 3, keyed);
                assert_eq!(on.metrics().prefix_copies, 0);
                r
            };
            assert_eq!(got, want, "keyed {keyed} copy {copy}");
            let reused: usize = m.iter().map(|m| m.prompt_tokens_reused).sum();
            assert!(reused > 0, "keyed {keyed} copy {copy}");
        }
    }
}

#[test]
fn a_shared_system_prompt_is_prefilled_once_with_prefix_copy() {
    let system: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % V as u32).collect();
    let mut on = BatchGenerator::new(slots(4));
    // The first request prefills the system prompt; the next ones copy it.
    let first = BatchRequest::new(
        [system.clone(), user(0, 0)].concat(),
        params(4, false),
        NoProposer,
    );
    on.submit(first).unwrap();
    on.run().unwrap();
    for c in 1..4 {
        let req = BatchRequest::new(
            [system.clone(), user(c, 0)].concat(),
            params(4, false),
            NoProposer,
        );
        on.submit(req).unwrap();
    }
    let done = on.run().unwrap();
    for f in &done {
        let m = &f.result.as_ref().unwrap().metrics;
        assert!(m.prompt_tokens_reused >= system.len(), "{m:?}");
    }
    assert!(on.metrics().prefix_copies >= 2);
    // Same outputs as without reuse.
    let mut off = BatchGenerator::new(slots(4)).with_prefix_reuse(false);
    for c in 1..4 {
        let req = BatchRequest::new(
            [system.clone(), user(c, 0)].concat(),
            params(4, false),
            NoProposer,
        );
        off.submit(req).unwrap();
    }
    let want = off.run().unwrap();
    let by_id = |v: &[speculative::decode::Finished]| {
        let mut t: Vec<(u64, Vec<u32>)> = v
            .iter()
            .map(|f| (f.id.0, f.result.as_ref().unwrap().tokens.clone()))
            .collect();
        t.sort();
        t.into_iter().map(|(_, t)| t).collect::<Vec<_>>()
    };
    assert_eq!(by_id(&done), by_id(&want));
}

#[test]
fn per_slot_copies_a_prefix_and_refuses_bad_copies() {
    let mut b = slots(2);
    assert!(b.can_copy_prefix());
    let mut logits = Vec::new();
    b.forward_batch(
        &[SlotChunk {
            slot: 0,
            input: speculative::SlotInput::Prefill(&[1, 2, 3, 4]),
        }],
        &mut logits,
    )
    .unwrap();
    b.copy_prefix(0, 1, 3).unwrap();
    assert_eq!(b.seq_len(1).unwrap(), 3);
    assert_eq!(b.model(1).unwrap().tokens(), &[1, 2, 3]);
    assert!(b.copy_prefix(0, 1, 5).is_err());
    assert!(b.copy_prefix(0, 0, 1).is_err());
    assert!(b.copy_prefix(0, 2, 1).is_err());
    assert!(!NoCopy(slots(1)).can_copy_prefix());
}

#[test]
fn a_rebuilt_generator_reuses_the_cache_it_is_told_about() {
    let p = params(4, false);
    let mut first = Generator::new(ToyModel::markov(V, 3, 2.0, 5), NoProposer);
    assert_eq!(first.cached_tokens(), None);
    let out = first.generate(&[1, 2, 3, 4], &p).unwrap();
    let held = first.cached_tokens().unwrap().to_vec();
    assert_eq!(held.len(), 4 + out.tokens.len() - 1);
    let (target, _) = first.into_parts();
    let next: Vec<u32> = [&[1, 2, 3, 4][..], &out.tokens, &[5, 6]].concat();
    let mut g = Generator::new(target, NoProposer).with_cached_tokens(&held);
    let a = g.generate(&next, &p).unwrap();
    assert_eq!(a.metrics.prompt_tokens_reused, held.len());
    let mut fresh = Generator::new(ToyModel::markov(V, 3, 2.0, 5), NoProposer);
    assert_eq!(a.tokens, fresh.generate(&next, &p).unwrap().tokens);
    // A claim of the wrong length is not trusted.
    let (target, _) = g.into_parts();
    let mut g = Generator::new(target, NoProposer).with_cached_tokens(&held);
    assert_eq!(
        g.generate(&next, &p).unwrap().metrics.prompt_tokens_reused,
        0
    );
}

#[test]
fn a_prefilled_cache_is_reused_with_its_hidden_rows() {
    let p = params(5, true);
    let system: Vec<u32> = vec![2, 4, 6, 8, 10, 1];
    let prompt: Vec<u32> = [&system[..], &[3, 5, 7]].concat();
    let (mut on, mut off) = (eagle(true), eagle(false));
    on.prefill_cache(&system).unwrap();
    assert_eq!(on.cached_tokens(), Some(&system[..]));
    let a = on.generate(&prompt, &p).unwrap();
    assert_eq!(a.metrics.prompt_tokens_reused, system.len());
    let b = off.generate(&prompt, &p).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(on.proposer().log, off.proposer().log);
    assert!(on.prefill_cache(&[V as u32]).is_err());
}

/// Requests submitted together with one system prompt: with prefix copy the first one
/// prefills it and the others wait for that prefill and copy it (the system prompt is
/// prefilled once); a request with nothing in common is not held back; outputs equal those
/// without copy and without reuse.
#[test]
fn requests_submitted_together_prefill_a_shared_system_prompt_once() {
    let system: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % V as u32).collect();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|c| [system.clone(), user(c, 0)].concat())
        .chain([vec![5; 30]])
        .collect();
    use speculative::decode::RequestId;
    let run = |b: &mut dyn FnMut(BatchRequest) -> RequestId| {
        prompts
            .iter()
            .map(|p| b(BatchRequest::new(p.clone(), params(4, false), NoProposer)))
            .collect::<Vec<_>>()
    };
    let outputs = |done: Vec<speculative::decode::Finished>, ids: &[RequestId]| {
        ids.iter()
            .map(|id| {
                let f = done.iter().find(|f| f.id == *id).unwrap();
                f.result.as_ref().unwrap().tokens.clone()
            })
            .collect::<Vec<_>>()
    };
    let mut on = BatchGenerator::new(slots(5));
    let ids = run(&mut |r| on.submit(r).unwrap());
    // Step 1 admits the first request and the unrelated one; the other three wait.
    on.step().unwrap();
    assert_eq!((on.active(), on.waiting()), (2, 3));
    let done = on.run().unwrap();
    let got = outputs(done, &ids);
    let m = on.metrics();
    assert_eq!(m.prefix_copies, 3);
    // Prefill rows: the first prompt, the unrelated one, and only the user part of the others
    // (each prompt's last token is fed with its first decode row).
    let users: usize = (1..4).map(|c| user(c, 0).len() - 1).sum();
    assert_eq!(
        m.prefill_rows as usize,
        (prompts[0].len() - 1) + 29 + users,
        "{m:?}"
    );
    let mut no_copy = BatchGenerator::new(NoCopy(slots(5)));
    let ids = run(&mut |r| no_copy.submit(r).unwrap());
    let done = no_copy.run().unwrap();
    assert_eq!(outputs(done, &ids), got);
    let all: usize = prompts.iter().map(|p| p.len() - 1).sum();
    assert_eq!(no_copy.metrics().prefill_rows as usize, all);
    let mut off = BatchGenerator::new(slots(5)).with_prefix_reuse(false);
    let ids = run(&mut |r| off.submit(r).unwrap());
    let done = off.run().unwrap();
    assert_eq!(outputs(done, &ids), got);
}
