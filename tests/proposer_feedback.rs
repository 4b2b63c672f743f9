//! The proposer feedback contract in the loop, for the proposers that learn from it
//! (TokenRecycling, MergedProposer and its sub-proposers, draft-model trees): a wrapper checks at
//! every call that `propose` sees the sequence told by `begin` + `observe`, that `observe`'s
//! accepted tokens are a path of the proposer's own draft (0 without a proposal), and that
//! `observe_rows`'s row 0 input is the root, with one input per row. Chains and trees, greedy
//! and seeded sampling (point-mass drafts give plain decoding's tokens, C15), EOS stops with
//! `min_tokens`. Also `row_top` asked for more ids than the vocabulary.

use std::sync::{Arc, Mutex};

use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions, TreeDrafts};
use speculative::propose::{
    DraftModelProposer, FixedMergeCosts, MergedProposer, PromptLookup, RecyclingConfig,
    SuffixConfig, SuffixProposer, TokenRecycling,
};
use speculative::test_util::{RandomProposer, ToyModel};
use speculative::{
    Draft, NoProposer, ProposeRequest, Proposer, Result, SamplingConfig, VerifiedRows,
};

/// What a wrapped proposer saw, checked at each call.
#[derive(Debug, Default)]
struct Seen {
    /// The context and draft of the pending proposal.
    pending: Option<(Vec<u32>, Draft)>,
    /// The sequence as told by begin + observe.
    seq: Vec<u32>,
    began: bool,
    faults: Vec<String>,
    rows_seen: usize,
}

/// Wraps a proposer and checks: observe's `emitted` follows the last context; `accepted` tokens
/// are a path of the proposer's own draft; rows' inputs are the root and the draft's nodes.
struct Check<P> {
    inner: P,
    seen: Arc<Mutex<Seen>>,
}

fn check<P: Proposer + Send + 'static>(inner: P) -> (Box<dyn Proposer + Send>, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    (
        Box::new(Check {
            inner,
            seen: seen.clone(),
        }),
        seen,
    )
}

/// Tokens of the path to node `j` (inclusive).
fn path_of(d: &Draft, j: usize) -> Vec<u32> {
    let mut p = vec![d.tokens[j]];
    let mut r = if d.parents.is_empty() {
        j
    } else {
        d.parents[j] as usize
    };
    while r > 0 {
        p.push(d.tokens[r - 1]);
        r = if d.parents.is_empty() {
            r - 1
        } else {
            d.parents[r - 1] as usize
        };
    }
    p.reverse();
    p
}

fn is_path(d: &Draft, tokens: &[u32]) -> bool {
    tokens.is_empty() || (0..d.tokens.len()).any(|j| path_of(d, j) == tokens)
}

impl<P: Proposer> Proposer for Check<P> {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose(req, draft)?;
        let mut s = self.seen.lock().unwrap();
        if s.began && req.context != &s.seq[..] {
            let m = format!(
                "propose: context {:?} is not the sequence told {:?}",
                req.context, s.seq
            );
            s.faults.push(m);
        }
        s.pending = Some((req.context.to_vec(), draft.clone()));
        Ok(())
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose_tree(req, draft)?;
        let mut s = self.seen.lock().unwrap();
        if s.began && req.context != &s.seq[..] {
            let m = format!(
                "propose_tree: context {:?} is not the sequence told {:?}",
                req.context, s.seq
            );
            s.faults.push(m);
        }
        s.pending = Some((req.context.to_vec(), draft.clone()));
        Ok(())
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        {
            let mut s = self.seen.lock().unwrap();
            let pending = s.pending.take();
            if accepted > emitted.len() {
                s.faults.push(format!(
                    "observe: accepted {accepted} of emitted {emitted:?}"
                ));
            }
            match pending {
                Some((_, d)) => {
                    if !is_path(&d, &emitted[..accepted.min(emitted.len())]) {
                        s.faults.push(format!(
                            "observe: accepted {accepted} but {emitted:?} does not start with a path of {d:?}"
                        ));
                    }
                }
                None => {
                    if accepted != 0 {
                        s.faults
                            .push(format!("observe without a proposal: accepted {accepted}"));
                    }
                }
            }
            s.seq.extend_from_slice(emitted);
        }
        self.inner.observe(accepted, emitted)
    }
    fn row_candidates(&self) -> usize {
        self.inner.row_candidates()
    }
    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        {
            let mut s = self.seen.lock().unwrap();
            s.rows_seen += 1;
            let root = s.seq.last().copied();
            if rows.inputs.first().copied() != root {
                s.faults.push(format!(
                    "observe_rows: row 0 input {:?}, root {:?}",
                    rows.inputs.first(),
                    root
                ));
            }
            if rows.inputs.len() != rows.candidates.rows() {
                s.faults.push(format!(
                    "observe_rows: {} inputs, {} rows",
                    rows.inputs.len(),
                    rows.candidates.rows()
                ));
            }
        }
        self.inner.observe_rows(rows)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        {
            let mut s = self.seen.lock().unwrap();
            s.began = true;
            s.seq = prompt.to_vec();
            s.pending = None;
        }
        self.inner.begin(prompt)
    }
    fn finish(&mut self, sequence: &[u32]) {
        self.inner.finish(sequence)
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

const VOCAB: usize = 12;

fn target() -> ToyModel {
    ToyModel::markov(VOCAB, 2, 2.5, 11).with_tree(32)
}

fn recycling() -> TokenRecycling {
    TokenRecycling::new(VOCAB, RecyclingConfig::default()).unwrap()
}

fn faults(seen: &[Arc<Mutex<Seen>>]) -> Vec<String> {
    seen.iter()
        .flat_map(|s| s.lock().unwrap().faults.clone())
        .collect()
}

fn params(sampled: bool, seed: u64, nodes: usize) -> GenerationParams {
    let p = if sampled {
        let cfg = SamplingConfig::builder()
            .temperature(0.9)
            .repetition_penalty(1.2)
            .build()
            .unwrap();
        GenerationParams::sampled(cfg, seed, 40)
    } else {
        GenerationParams::greedy(40)
    };
    p.with_draft(DraftLength::Fixed(4))
        .with_tree(TreeDrafts::nodes(nodes))
}

/// Plain decoding's tokens.
fn plain(prompt: &[u32], p: &GenerationParams) -> Vec<u32> {
    let p = p
        .clone()
        .with_draft(DraftLength::Off)
        .with_tree(TreeDrafts::nodes(0));
    Generator::new(target(), NoProposer)
        .generate(prompt, &p)
        .unwrap()
        .tokens
}

#[test]
fn merged_subproposer_feedback_is_consistent() {
    let prompts: [&[u32]; 3] = [
        &[1, 2, 3, 1, 2, 3, 1, 2],
        &[4, 5, 6, 7, 4, 5],
        &[9, 9, 9, 9],
    ];
    for sampled in [false, true] {
        for nodes in [0, 8, 16] {
            for eos in [None, Some(3u32)] {
                let (a, sa) = check(PromptLookup::new(1, 3).unwrap());
                let (b, sb) = check(recycling());
                let (c, sc) = check(DraftModelProposer::new(
                    ToyModel::markov(VOCAB, 2, 2.0, 12).with_tree(32),
                ));
                let (d, sd) = check(RandomProposer::new(VOCAB, 3));
                let (e, se) = check(SuffixProposer::new(SuffixConfig::default()).unwrap());
                let merged = MergedProposer::new(vec![a, b, c, d, e])
                    .unwrap()
                    .with_costs(fixed_costs());
                let all = [sa, sb.clone(), sc, sd, se];
                let mut g = Generator::new(target(), merged);
                let mut tree_steps = 0;
                for (i, prompt) in prompts.iter().enumerate() {
                    let mut p = params(sampled, 7 + i as u64, nodes);
                    if let Some(e) = eos {
                        p = p
                            .with_stop(StopConditions::eos(e))
                            .unwrap()
                            .with_min_tokens(2)
                            .unwrap();
                    }
                    let out = g.generate(prompt, &p).unwrap();
                    tree_steps += out.metrics.tree_steps;
                    assert_eq!(
                        out.tokens,
                        plain(prompt, &p),
                        "sampled {sampled} nodes {nodes} eos {eos:?}"
                    );
                }
                let f = faults(&all);
                assert!(
                    f.is_empty(),
                    "sampled {sampled} nodes {nodes} eos {eos:?}: {f:#?}"
                );
                assert!(sb.lock().unwrap().rows_seen > 0);
                assert_eq!(tree_steps > 0, nodes > 0, "nodes {nodes}");
            }
        }
    }
}

#[test]
fn recycling_alone_in_the_loop() {
    for sampled in [false, true] {
        for nodes in [0, 4, 5, 16] {
            let (r, s) = check(recycling());
            let mut g = Generator::new(target(), r);
            for prompt in [&[1u32, 2, 3][..], &[1, 2, 3, 1, 2]] {
                let p = params(sampled, 5, nodes)
                    .with_stop(StopConditions::eos(0))
                    .unwrap()
                    .with_min_tokens(3)
                    .unwrap();
                let out = g.generate(prompt, &p).unwrap();
                assert_eq!(out.tokens, plain(prompt, &p));
            }
            let f = faults(&[s]);
            assert!(f.is_empty(), "{f:#?}");
        }
    }
}

#[test]
fn draft_model_trees_in_the_loop() {
    for sampled in [false, true] {
        for nodes in [0, 3, 8, 16] {
            let (d, s) = check(DraftModelProposer::new(
                ToyModel::markov(VOCAB, 2, 2.0, 12).with_tree(32),
            ));
            let mut g = Generator::new(target(), d);
            for prompt in [&[1u32, 2, 3][..], &[1, 2, 3, 1, 2]] {
                let p = params(sampled, 5, nodes)
                    .with_stop(StopConditions::eos(0))
                    .unwrap()
                    .with_min_tokens(2)
                    .unwrap();
                let out = g.generate(prompt, &p);
                let out = out.unwrap();
                if !sampled {
                    assert_eq!(out.tokens, plain(prompt, &p));
                }
            }
            let f = faults(&[s]);
            assert!(f.is_empty(), "{f:#?}");
        }
    }
}

/// `row_top(n)` with `n` above the vocabulary ("all of them") lists every allowed id of every
/// row, best first; it must neither panic nor allocate for `n` ids.
#[test]
fn row_top_above_the_vocabulary_lists_every_allowed_id() {
    use speculative::{Verifier, VerifyRequest};
    let vocab = 4;
    let logits = [
        0.5,
        2.0,
        1.0,
        f32::NEG_INFINITY, //
        3.0,
        0.0,
        1.0,
        2.0,
    ];
    let cfg = SamplingConfig::greedy();
    let mut v = Verifier::new();
    for n in [5, usize::MAX] {
        let out = v
            .verify(&VerifyRequest::new(&cfg, &logits, vocab, &[1]).row_top_k(n))
            .unwrap();
        assert_eq!(out.row_top.row(0), &[1, 2, 0]);
        assert_eq!(out.row_top.row(1), &[0, 3, 2, 1]);
    }
}

/// A proposer that asks for "every id" of each row (`usize::MAX`) gets them in the loop.
#[test]
fn proposer_asking_for_every_row_id_runs() {
    struct All(Vec<usize>);
    impl Proposer for All {
        fn propose(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
            draft.clear();
            Ok(())
        }
        fn row_candidates(&self) -> usize {
            usize::MAX
        }
        fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
            self.0.push(rows.candidates.row(0).len());
            Ok(())
        }
    }
    let mut g = Generator::new(target(), All(Vec::new()));
    let out = g.generate(&[1, 2], &GenerationParams::greedy(3)).unwrap();
    assert_eq!(out.tokens.len(), 3);
    assert_eq!(g.proposer().0, vec![VOCAB; 3]);
}

/// Randomised: merged (recycling, prompt lookup, draft model, random), recycling alone and draft
/// model trees under small contexts, budgets, stop sequences, `min_tokens`, branching limits and
/// adaptive draft lengths (k = 0 steps included), greedy and sampled, several requests per
/// proposer: never an error, the feedback contract holds, and point-mass drafts give plain
/// decoding's tokens.
#[test]
fn randomised_loop_configurations_keep_the_contract() {
    use speculative::decode::AdaptiveConfig;
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut rnd = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let markov = ToyModel::markov(VOCAB, 2, 2.5, 11);
    for case in 0..300 {
        let max_ctx = 6 + rnd(30) as usize;
        let m = markov.clone();
        let f: speculative::test_util::LogitsFn = Arc::new(move |p: &[u32]| m.logits(p));
        let tree_cap = rnd(20) as usize;
        let make_target = || ToyModel::new(VOCAB, max_ctx, f.clone()).with_tree(tree_cap);
        let which = rnd(3);
        let mut seen = Vec::new();
        let mut subs: Vec<Box<dyn Proposer + Send>> = Vec::new();
        let mut push = |p: (Box<dyn Proposer + Send>, Arc<Mutex<Seen>>)| {
            seen.push(p.1);
            subs.push(p.0);
        };
        let draft_model = || {
            DraftModelProposer::new(ToyModel::markov(VOCAB, 2, 2.0, 12).with_tree(1 + (case % 9)))
        };
        match which {
            0 => {
                push(check(recycling()));
                push(check(PromptLookup::new(1, 3).unwrap()));
                push(check(draft_model()));
                push(check(RandomProposer::new(VOCAB, case as u64)));
            }
            1 => push(check(recycling())),
            _ => push(check(draft_model())),
        }
        let dense = which == 2;
        let proposer: Box<dyn Proposer + Send> = if which == 0 {
            Box::new(MergedProposer::new(subs).unwrap().with_costs(fixed_costs()))
        } else {
            subs.pop().unwrap()
        };
        let mut g = Generator::new(make_target(), proposer);
        for req in 0..3 {
            let sampled = rnd(2) == 1;
            let p = params(sampled, rnd(1000), rnd(12) as usize);
            let max_new_tokens = 1 + rnd(20) as usize;
            let tree = p.tree().with_branch(rnd(4) as usize);
            let draft = match rnd(3) {
                0 => DraftLength::Fixed(rnd(6) as usize),
                1 => DraftLength::Adaptive(
                    AdaptiveConfig::default().with_max_draft(1 + rnd(6) as usize),
                ),
                _ => DraftLength::Fixed(1 + rnd(3) as usize),
            };
            let mut stop = StopConditions::default();
            if rnd(2) == 1 {
                stop = stop.with_eos(rnd(VOCAB as u64) as u32);
            }
            if rnd(3) == 1 {
                stop = stop
                    .with_stop_sequence(vec![rnd(VOCAB as u64) as u32, rnd(VOCAB as u64) as u32]);
            }
            let min = (rnd(3) as usize).min(max_new_tokens);
            let p = p
                .to_builder()
                .max_new_tokens(max_new_tokens)
                .tree(tree)
                .draft(draft)
                .stop(stop)
                .min_tokens(min)
                .build()
                .unwrap();
            let plen = 1 + rnd(4) as usize;
            let prompt: Vec<u32> = (0..plen).map(|_| rnd(VOCAB as u64) as u32).collect();
            let out = g.generate(&prompt, &p);
            let out = match out {
                Ok(o) => o,
                Err(e) => panic!("case {case} req {req} which {which}: {e:?} ({p:?})"),
            };
            if !(dense && sampled) {
                let plain = Generator::new(make_target(), NoProposer)
                    .generate(
                        &prompt,
                        &p.clone()
                            .with_draft(DraftLength::Off)
                            .with_tree(TreeDrafts::nodes(0)),
                    )
                    .unwrap();
                assert_eq!(
                    out.tokens, plain.tokens,
                    "case {case} req {req} which {which}"
                );
            }
        }
        let f = faults(&seen);
        assert!(f.is_empty(), "case {case} which {which}: {f:#?}");
    }
}

/// Checks every row of `observe_rows` against the target's own ranking after the row's
/// labelled input path (context + inputs along the parents), so that a row labelled with the
/// wrong input (an off-by-one, a pruned node, a chain whose final draft ends the sequence and
/// has no row) fails.
struct RowsAgainstModel {
    inner: TokenRecycling,
    model: ToyModel,
    ctx: Vec<u32>,
    rows: usize,
    faults: Vec<String>,
}

impl Proposer for RowsAgainstModel {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose(req, draft)
    }
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose_tree(req, draft)
    }
    fn row_candidates(&self) -> usize {
        3
    }
    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        let n = rows.candidates.rows();
        if !rows.parents.is_empty() && rows.parents.len() + 1 != n {
            self.faults
                .push(format!("{} parents for {n} rows", rows.parents.len()));
        }
        for r in 0..n {
            let mut path = Vec::new();
            let mut at = r;
            while at > 0 {
                path.push(rows.inputs[at]);
                at = if rows.parents.is_empty() {
                    at - 1
                } else {
                    rows.parents[at - 1] as usize
                };
            }
            path.reverse();
            let mut seq = self.ctx.clone();
            seq.extend_from_slice(&path);
            let logits = self.model.logits(&seq);
            let mut ids: Vec<u32> = (0..VOCAB as u32).collect();
            ids.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            ids.truncate(3);
            if rows.candidates.row(r) != &ids[..] {
                self.faults.push(format!(
                    "row {r} (input path {path:?}): {:?}, the model ranks {ids:?}",
                    rows.candidates.row(r)
                ));
            }
        }
        self.rows += n;
        self.inner.observe_rows(rows)
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.ctx.extend_from_slice(emitted);
        self.inner.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.ctx = prompt.to_vec();
        self.inner.begin(prompt)
    }
}

#[test]
fn feedback_rows_are_labelled_with_their_inputs_under_stops() {
    let model = ToyModel::markov(VOCAB, 2, 2.5, 11);
    let mut total = 0;
    for nodes in [0, 8, 16] {
        for eos in 0..VOCAB as u32 {
            let p = RowsAgainstModel {
                inner: TokenRecycling::new(VOCAB, RecyclingConfig::default()).unwrap(),
                model: model.clone(),
                ctx: Vec::new(),
                rows: 0,
                faults: Vec::new(),
            };
            let mut g = Generator::new(target(), p);
            for prompt in [&[1u32, 2, 3, 1, 2, 3][..], &[4, 5, 4, 5, 4]] {
                let params = GenerationParams::greedy(30)
                    .with_draft(DraftLength::Fixed(4))
                    .with_tree(TreeDrafts::nodes(nodes))
                    .with_stop(StopConditions::eos(eos).with_stop_sequence(vec![(eos + 1) % 12, 3]))
                    .unwrap();
                g.generate(prompt, &params).unwrap();
            }
            let p = g.proposer();
            assert!(
                p.faults.is_empty(),
                "nodes {nodes} eos {eos}: {:#?}",
                p.faults
            );
            total += p.rows;
        }
    }
    assert!(total > 0);
}

/// Vocabulary mismatches between a proposer and the target are typed errors or harmless,
/// never a panic: a recycling table for a smaller vocabulary learns nothing about the larger
/// ids; one holding ids the target does not have is rejected by the loop; a draft model with a
/// larger vocabulary fails the step with a typed error, as a chain and as a tree.
#[test]
fn vocabulary_mismatches_are_typed_errors_or_harmless() {
    use speculative::Error;
    let prompt = [1u32, 2, 3, 1, 2, 3];
    for nodes in [0, 8] {
        let p = params(false, 1, nodes);
        // Smaller table: works and is exact.
        let small = TokenRecycling::new(8, RecyclingConfig::default()).unwrap();
        let mut g = Generator::new(target(), small);
        assert_eq!(g.generate(&prompt, &p).unwrap().tokens, plain(&prompt, &p));
        // A table with ids beyond the target's vocabulary (another model's file).
        let mut big = TokenRecycling::new(20, RecyclingConfig::default()).unwrap();
        for t in 0..20 {
            big.set_successors(t, &[19, 18]);
        }
        let err = Generator::new(target(), big)
            .generate(&prompt, &p)
            .unwrap_err();
        assert!(
            matches!(err.error, Error::InvalidProposal { .. }),
            "{err:?}"
        );
        // Inside a merge, the same error names the merge.
        let mut big = TokenRecycling::new(20, RecyclingConfig::default()).unwrap();
        big.set_successors(3, &[19]);
        let merged = MergedProposer::new(vec![Box::new(big)]).unwrap();
        let err = Generator::new(target(), merged)
            .generate(&prompt, &p)
            .unwrap_err();
        assert!(
            matches!(
                err.error,
                Error::InvalidProposal {
                    proposer: "merged",
                    ..
                }
            ),
            "{err:?}"
        );
        // A draft model of a larger vocabulary, greedy and sampled.
        for sampled in [false, true] {
            let d = DraftModelProposer::new(ToyModel::markov(16, 2, 2.0, 3).with_tree(16));
            let p = params(sampled, 1, nodes);
            match Generator::new(target(), d).generate(&prompt, &p) {
                Ok(_) => {}
                Err(e) => assert!(
                    matches!(
                        e.error,
                        Error::InvalidProposal { .. } | Error::DraftVocabTooLarge { .. }
                    ),
                    "nodes {nodes} sampled {sampled}: {e:?}"
                ),
            }
        }
    }
}

/// Heads trees (Medusa) and a merge of heads with recycling, in the loop with the hidden states
/// of `OneHotHidden`: the contract holds and the tokens are plain decoding's (point masses).
#[test]
fn heads_trees_and_merged_heads_keep_the_contract() {
    use speculative::propose::HeadsProposer;
    use speculative::test_util::{HeadsConditioning, OneHotHidden, ToyHeads};
    let next = |t: u32| (t * 5 + 3) % VOCAB as u32;
    let model = ToyModel::deterministic(VOCAB, 4096, move |p: &[u32]| next(*p.last().unwrap()))
        .with_tree(32);
    for conditioning in [HeadsConditioning::LastToken, HeadsConditioning::HiddenOnly] {
        for nodes in [0, 6, 16] {
            for merged in [false, true] {
                let heads = HeadsProposer::new(ToyHeads::new(VOCAB, 4, conditioning, next))
                    .with_tree_top_k(3)
                    .unwrap();
                let (h, sh) = check(heads);
                let (r, sr) = check(recycling());
                let proposer: Box<dyn Proposer + Send> = if merged {
                    Box::new(
                        MergedProposer::new(vec![h, r])
                            .unwrap()
                            .with_costs(fixed_costs()),
                    )
                } else {
                    h
                };
                let mut g = Generator::new(OneHotHidden::new(model.clone()), proposer);
                for prompt in [&[1u32, 2][..], &[7, 7, 7]] {
                    let p = params(false, 1, nodes)
                        .with_stop(StopConditions::eos(4))
                        .unwrap();
                    let out = g.generate(prompt, &p).unwrap();
                    let plain = Generator::new(model.clone(), NoProposer)
                        .generate(prompt, &p.clone().with_draft(DraftLength::Off))
                        .unwrap();
                    assert_eq!(out.tokens, plain.tokens);
                }
                let f = faults(&[sh, sr]);
                assert!(
                    f.is_empty(),
                    "{conditioning:?} nodes {nodes} merged {merged}: {f:#?}"
                );
            }
        }
    }
}

/// A table learned under one request's configuration drafts tokens that a later request bans
/// (allowed set, banned set): the verifier rejects them (point masses) and the output is the
/// later request's plain output, greedy and sampled, chains and trees.
#[test]
fn carried_table_with_tokens_a_later_request_bans() {
    let prompt = [1u32, 2, 3, 1, 2, 3];
    for nodes in [0, 8] {
        for sampled in [false, true] {
            let mut g = Generator::new(target(), recycling());
            g.generate(&prompt, &params(sampled, 3, nodes)).unwrap();
            assert!(g.proposer().filled_rows() > 0);
            for cfg in [
                SamplingConfig::builder()
                    .temperature(if sampled { 0.8 } else { 0.0 })
                    .allowed_tokens([0, 2, 5, 7])
                    .build()
                    .unwrap(),
                SamplingConfig::builder()
                    .temperature(if sampled { 0.8 } else { 0.0 })
                    .banned_tokens(0..6)
                    .build()
                    .unwrap(),
            ] {
                let p = GenerationParams::sampled(cfg, 9, 30)
                    .with_draft(DraftLength::Fixed(4))
                    .with_tree(TreeDrafts::nodes(nodes));
                let out = g.generate(&prompt, &p).unwrap();
                assert_eq!(
                    out.tokens,
                    plain(&prompt, &p),
                    "nodes {nodes} sampled {sampled}"
                );
            }
        }
    }
}

/// Fixed merge costs (every member free, a step 10 ms + 0.5 ms a row): the cost-aware merge's
/// choices depend on the acceptance it sees, not on the machine's clock.
fn fixed_costs() -> FixedMergeCosts {
    FixedMergeCosts::new(0.010, 0.0005).unwrap()
}
