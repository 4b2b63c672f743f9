//! The multi-sequence fast forward (`FastBatch` as a `speculative::BatchTarget`): every slot's
//! logits and KV cache are bit-identical to those of a `FastTarget` that saw the same history
//! alone, whatever the other chunks of each call (random interleavings of prefill chunks,
//! chains, trees, truncation, commits, releases), for both formats and every kernel path; every
//! error leaves every slot unchanged. The real-model test needs
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf` (run `scripts/fetch-model.sh` first); the
//! random-weight ones need nothing.

mod common;

use common::Rng;

use std::sync::Arc;

use speculative::{BatchTarget, DraftBlock, Error, SlotChunk, SlotInput, TargetModel};
use speculative_candle::fast::RandomSpec;
use speculative_candle::{FastBatch, FastFormat, FastTarget, FastWeights, KernelPath};

// ---------------------------------------------------------------- helpers

fn weights(format: FastFormat) -> Arc<FastWeights> {
    FastWeights::random(&RandomSpec::default(), format).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A tree chunk's owned data: root, node tokens, parent rows.
#[derive(Debug, Clone)]
struct OwnedTree {
    root: u32,
    tokens: Vec<u32>,
    parents: Vec<u32>,
}

impl OwnedTree {
    fn random(rng: &mut Rng, nodes: usize, vocab: usize) -> Self {
        OwnedTree {
            root: rng.below(vocab) as u32,
            tokens: rng.tokens(nodes, vocab),
            parents: (0..nodes).map(|i| rng.below(i + 1) as u32).collect(),
        }
    }
    fn block(&self) -> DraftBlock<'_> {
        DraftBlock::tree(&self.tokens, &self.parents)
    }
    /// How many leading nodes form a chain from the root (node `j`'s parent row is `j`).
    fn chain_prefix(&self) -> usize {
        self.parents
            .iter()
            .enumerate()
            .take_while(|&(j, &p)| p as usize == j)
            .count()
    }
}

/// One slot's chunk of a step, owned.
#[derive(Debug, Clone)]
enum Owned {
    Prefill(Vec<u32>),
    Chain(Vec<u32>),
    Tree(OwnedTree),
}

impl Owned {
    fn input(&self) -> SlotInput<'_> {
        match self {
            Owned::Prefill(t) => SlotInput::Prefill(t),
            Owned::Chain(t) => SlotInput::Chain(t),
            Owned::Tree(t) => SlotInput::Tree {
                root: t.root,
                block: t.block(),
            },
        }
    }
    fn rows(&self) -> usize {
        self.input().rows()
    }
}

/// Runs `chunk` on the solo reference and returns its logits (empty for a prefill).
fn solo(m: &mut FastTarget, chunk: &Owned) -> Vec<f32> {
    let mut logits = Vec::new();
    match chunk {
        Owned::Prefill(t) => m.prefill(t).unwrap(),
        Owned::Chain(t) => m.forward(t, &mut logits).unwrap(),
        Owned::Tree(t) => m
            .tree()
            .unwrap()
            .forward_tree(t.root, &t.block(), &mut logits)
            .unwrap(),
    }
    logits
}

/// A `FastBatch` and one solo `FastTarget` per slot, driven through the same histories.
struct Sim {
    batch: FastBatch,
    refs: Vec<FastTarget>,
    /// The pending tree of each slot, with its base (root position).
    pending: Vec<Option<(usize, OwnedTree)>>,
    rng: Rng,
    vocab: usize,
    context: usize,
}

impl Sim {
    fn new(
        w: &Arc<FastWeights>,
        slots: usize,
        kernel: KernelPath,
        threads: usize,
        seed: u64,
    ) -> Self {
        let batch = FastBatch::new(w.clone(), slots)
            .unwrap()
            .with_kernel(kernel)
            .unwrap()
            .with_threads(threads);
        let refs = (0..slots)
            .map(|_| FastTarget::new(w.clone()).with_kernel(kernel).unwrap())
            .collect();
        Sim {
            batch,
            refs,
            pending: vec![None; slots],
            rng: Rng(seed),
            vocab: w.config().vocab_size,
            context: w.config().context_length,
        }
    }

    fn slots(&self) -> usize {
        self.refs.len()
    }

    /// Every slot's length and KV cache equal its reference's, bit for bit.
    fn assert_same_state(&self, what: &str) {
        for s in 0..self.slots() {
            assert_eq!(
                self.batch.seq_len(s).unwrap(),
                self.refs[s].seq_len(),
                "{what}: seq_len of slot {s}"
            );
            let a = self.batch.kv_snapshot(s).unwrap();
            let b = self.refs[s].kv_snapshot();
            assert_eq!(a.len(), b.len());
            // With a tree pending, the slots past `base + 1 + max depth` are stale in both:
            // compare the positions a commit can keep.
            let len = self.refs[s].seq_len();
            let valid = match &self.pending[s] {
                Some((base, t)) => base + 1 + t.block().max_depth(),
                None => len,
            };
            let cut = |v: &Vec<f32>| bits(&v[..v.len() / len.max(1) * valid]);
            for (l, ((ka, va), (kb, vb))) in a.iter().zip(&b).enumerate() {
                assert!(
                    cut(ka) == cut(kb) && cut(va) == cut(vb),
                    "{what}: KV cache of slot {s}, layer {l}"
                );
            }
        }
    }

    /// Resolves a pending tree of `s` at random: commit of a random path (possibly empty),
    /// a truncation that drops it, or one that keeps a leading chain of nodes.
    fn resolve(&mut self, s: usize) {
        let Some((base, t)) = self.pending[s].take() else {
            return;
        };
        match self.rng.below(3) {
            0 => {
                let mut path = Vec::new();
                if !t.tokens.is_empty() && self.rng.chance(80) {
                    let node = self.rng.below(t.tokens.len());
                    t.block().path_to(node, &mut path);
                }
                self.batch.commit_tree(s, &path).unwrap();
                self.refs[s].tree().unwrap().commit_tree(&path).unwrap();
            }
            1 => {
                let len = base + 1 - self.rng.below(base + 2);
                self.batch.truncate(s, len).unwrap();
                self.refs[s].truncate(len).unwrap();
            }
            _ => {
                let m = self.rng.below(t.chain_prefix() + 1);
                let len = base + 1 + m;
                self.batch.truncate(s, len).unwrap();
                self.refs[s].truncate(len).unwrap();
            }
        }
    }

    fn release(&mut self, s: usize) {
        self.batch.release(s).unwrap();
        self.refs[s].truncate(0).unwrap();
        self.pending[s] = None;
    }

    /// A random chunk for slot `s` (which has no pending tree).
    fn chunk(&mut self, s: usize, trees: bool) -> Owned {
        let len = self.refs[s].seq_len();
        let (vocab, rng) = (self.vocab, &mut self.rng);
        let kind = if len == 0 {
            0
        } else {
            rng.below(if trees { 3 } else { 2 })
        };
        match kind {
            0 => {
                let n = 1 + rng.below(16);
                Owned::Prefill(rng.tokens(n, vocab))
            }
            1 => {
                let n = 1 + rng.below(6);
                Owned::Chain(rng.tokens(n, vocab))
            }
            _ => {
                let nodes = rng.below(9);
                Owned::Tree(OwnedTree::random(rng, nodes, vocab))
            }
        }
    }

    /// One step: resolve some pending trees, release a slot now and then, one batch over a
    /// random subset of slots in random order, compare the logits with the solo references,
    /// then roll some chains back.
    fn step(&mut self, trees: bool) {
        let n = self.slots();
        for s in 0..n {
            if self.pending[s].is_some() && self.rng.chance(80) {
                self.resolve(s);
            }
        }
        if self.rng.chance(10) {
            let s = self.rng.below(n);
            if self.pending[s].is_none() || self.rng.chance(50) {
                self.release(s);
            }
        }
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, self.rng.below(i + 1));
        }
        let mut chunks: Vec<(usize, Owned)> = Vec::new();
        for s in order {
            if self.pending[s].is_some() || !self.rng.chance(70) {
                continue;
            }
            let mut c = self.chunk(s, trees);
            if self.refs[s].seq_len() + c.rows() > self.context {
                self.release(s);
                c = self.chunk(s, trees);
            }
            chunks.push((s, c));
        }
        let list: Vec<SlotChunk<'_>> = chunks
            .iter()
            .map(|(s, c)| SlotChunk {
                slot: *s,
                input: c.input(),
            })
            .collect();
        let mut logits = vec![f32::NAN; 3];
        self.batch.forward_batch(&list, &mut logits).unwrap();
        let vocab = self.vocab;
        let mut at = 0;
        for (s, c) in &chunks {
            let base = self.refs[*s].seq_len();
            let expect = solo(&mut self.refs[*s], c);
            let got = &logits[at..at + expect.len()];
            assert!(
                bits(got) == bits(&expect),
                "logits of slot {s} ({c:?}) differ from the solo forward"
            );
            at += expect.len();
            match c {
                Owned::Tree(t) => self.pending[*s] = Some((base, t.clone())),
                Owned::Chain(t) if self.rng.chance(50) => {
                    let len = base + t.len() - self.rng.below(t.len() + 1);
                    self.batch.truncate(*s, len).unwrap();
                    self.refs[*s].truncate(len).unwrap();
                }
                _ => {}
            }
        }
        assert_eq!(at, logits.len(), "logit rows in call order");
        assert_eq!(logits.len() % vocab, 0);
        self.assert_same_state("after a step");
    }
}

fn run_sim(format: FastFormat, kernel: KernelPath, threads: usize, seed: u64, steps: usize) {
    let w = weights(format);
    let mut sim = Sim::new(&w, 5, kernel, threads, seed);
    for _ in 0..steps {
        sim.step(true);
    }
    // Every slot's state still equals its reference after resolving the trees.
    for s in 0..sim.slots() {
        sim.resolve(s);
    }
    sim.assert_same_state("at the end");
}

// ---------------------------------------------------------------- batch invariance

#[test]
fn random_interleavings_match_solo_q8_every_kernel() {
    for (i, k) in KernelPath::available().into_iter().enumerate() {
        run_sim(FastFormat::Q8, k, 1, 11 + i as u64, 40);
    }
}

#[test]
fn random_interleavings_match_solo_f32_every_kernel() {
    for (i, k) in KernelPath::available().into_iter().enumerate() {
        run_sim(FastFormat::F32, k, 1, 31 + i as u64, 30);
    }
}

#[test]
fn random_interleavings_match_solo_two_threads() {
    run_sim(FastFormat::Q8, KernelPath::detect(), 2, 51, 30);
    run_sim(FastFormat::F32, KernelPath::detect(), 2, 52, 15);
}

#[test]
fn chains_only_many_seeds() {
    let w = weights(FastFormat::Q8);
    for seed in 0..6 {
        let mut sim = Sim::new(
            &w,
            3 + seed as usize % 4,
            KernelPath::detect(),
            1,
            100 + seed,
        );
        for _ in 0..15 {
            sim.step(false);
        }
    }
}

/// The same chunks one per call give the same bits as all of them in one call (the batch
/// against itself, besides the solo `FastTarget` the simulations compare with).
#[test]
fn one_chunk_per_call_equals_one_call() {
    let w = weights(FastFormat::Q8);
    let mut rng = Rng(7);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| rng.tokens(5 + 7 * i, 301)).collect();
    let mut a = FastBatch::new(w.clone(), 4).unwrap();
    let mut b = FastBatch::new(w, 4).unwrap();
    let chunks: Vec<SlotChunk<'_>> = prompts
        .iter()
        .enumerate()
        .map(|(s, p)| SlotChunk {
            slot: s,
            input: if s % 2 == 0 {
                SlotInput::Chain(p)
            } else {
                SlotInput::Prefill(p)
            },
        })
        .collect();
    let (mut all, mut one) = (Vec::new(), Vec::new());
    a.forward_batch(&chunks, &mut all).unwrap();
    let mut joined = Vec::new();
    for c in &chunks {
        b.forward_batch(std::slice::from_ref(c), &mut one).unwrap();
        joined.extend_from_slice(&one);
    }
    assert_eq!(all.len(), (prompts[0].len() + prompts[2].len()) * 301);
    assert!(bits(&all) == bits(&joined));
    for s in 0..4 {
        assert_eq!(a.kv_snapshot(s), b.kv_snapshot(s));
    }
}

// ---------------------------------------------------------------- memory, Send, capacity

#[test]
fn fast_batch_is_send_and_object_safe() {
    fn send<T: Send>() {}
    send::<FastBatch>();
    let b: Box<dyn BatchTarget + Send> =
        Box::new(FastBatch::new(weights(FastFormat::Q8), 2).unwrap());
    assert_eq!(b.max_slots(), 2);
    assert_eq!(b.vocab_size(), 301);
    assert_eq!(b.max_context(), 256);
    assert_eq!(
        b.max_tree_nodes(),
        speculative_candle::fast::DEFAULT_MAX_TREE_NODES
    );
    assert_eq!(
        b.max_batch_tokens(),
        speculative_candle::fast::DEFAULT_MAX_BATCH_TOKENS
    );
}

#[test]
fn zero_slots_is_an_error() {
    assert!(FastBatch::new(weights(FastFormat::Q8), 0).is_err());
}

#[test]
fn kv_memory_is_bounded_by_the_context_and_freed_on_release() {
    let w = weights(FastFormat::Q8);
    let mut b = FastBatch::new(w, 3).unwrap();
    // 2 layers, 2 KV heads of 16, f32 keys and values.
    assert_eq!(b.kv_bytes_per_position(), 2 * 2 * 2 * 16 * 4);
    assert_eq!(b.kv_memory_bytes(), 0);
    let mut rng = Rng(3);
    let toks = rng.tokens(256, 301);
    let mut logits = Vec::new();
    for part in toks.chunks(37) {
        b.forward_batch(
            &[SlotChunk {
                slot: 1,
                input: SlotInput::Prefill(part),
            }],
            &mut logits,
        )
        .unwrap();
    }
    assert_eq!(b.seq_len(1).unwrap(), 256);
    assert_eq!(b.kv_memory_bytes(), 256 * b.kv_bytes_per_position());
    b.release(1).unwrap();
    assert_eq!(b.seq_len(1).unwrap(), 0);
    assert_eq!(b.kv_memory_bytes(), 0);
}

#[test]
fn released_slot_is_reused_like_a_fresh_sequence() {
    let w = weights(FastFormat::Q8);
    let mut b = FastBatch::new(w.clone(), 2).unwrap();
    let mut rng = Rng(9);
    let (old, new) = (rng.tokens(30, 301), rng.tokens(12, 301));
    let mut logits = Vec::new();
    let chunk = |s, t| SlotChunk {
        slot: s,
        input: SlotInput::Chain(t),
    };
    b.forward_batch(&[chunk(0, &old), chunk(1, &new)], &mut logits)
        .unwrap();
    b.release(0).unwrap();
    b.forward_batch(&[chunk(0, &new)], &mut logits).unwrap();
    let mut fresh = FastTarget::new(w);
    let mut expect = Vec::new();
    fresh.forward(&new, &mut expect).unwrap();
    assert!(bits(&logits) == bits(&expect));
    assert_eq!(b.kv_snapshot(0).unwrap(), fresh.kv_snapshot());
    assert_eq!(b.kv_snapshot(1).unwrap(), fresh.kv_snapshot());
}

// ---------------------------------------------------------------- errors

/// A batch with slot 0 at 20 tokens, slot 1 with a pending tree, slot 2 at 250 of 256.
fn error_fixture() -> FastBatch {
    let w = weights(FastFormat::Q8);
    let mut b = FastBatch::new(w, 4).unwrap().with_max_batch_tokens(40);
    let mut rng = Rng(5);
    let (a, c, d) = (
        rng.tokens(20, 301),
        rng.tokens(10, 301),
        rng.tokens(40, 301),
    );
    let mut logits = Vec::new();
    b.forward_batch(
        &[
            SlotChunk {
                slot: 0,
                input: SlotInput::Prefill(&a),
            },
            SlotChunk {
                slot: 1,
                input: SlotInput::Prefill(&c),
            },
        ],
        &mut logits,
    )
    .unwrap();
    let parents = [0, 0, 1];
    b.forward_batch(
        &[SlotChunk {
            slot: 1,
            input: SlotInput::Tree {
                root: 3,
                block: DraftBlock::tree(&[4, 5, 6], &parents),
            },
        }],
        &mut logits,
    )
    .unwrap();
    for _ in 0..6 {
        b.forward_batch(
            &[SlotChunk {
                slot: 2,
                input: SlotInput::Prefill(&d),
            }],
            &mut logits,
        )
        .unwrap();
    }
    b.forward_batch(
        &[SlotChunk {
            slot: 2,
            input: SlotInput::Prefill(&d[..10]),
        }],
        &mut logits,
    )
    .unwrap();
    assert_eq!(b.seq_len(2).unwrap(), 250);
    b
}

type Snapshot = Vec<(usize, Vec<(Vec<f32>, Vec<f32>)>)>;

/// An error case: name, chunks, the expected error kind.
type Case<'a> = (&'static str, Vec<SlotChunk<'a>>, fn(&Error) -> bool);

fn snapshot(b: &FastBatch) -> Snapshot {
    (0..b.max_slots())
        .map(|s| (b.seq_len(s).unwrap(), b.kv_snapshot(s).unwrap()))
        .collect()
}

#[test]
fn every_error_leaves_every_slot_unchanged() {
    let ok = [7u32, 8];
    let big = [1u32; 41];
    let parents_bad = [0u32, 5];
    let parents_ok = [0u32, 1];
    let bad_token = [1u32, 301];
    let over = [1u32; 7];
    let c = |slot, input| SlotChunk { slot, input };
    let cases: Vec<Case<'_>> = vec![
        (
            "slot out of range",
            vec![c(0, SlotInput::Chain(&ok)), c(4, SlotInput::Chain(&ok))],
            |e| matches!(e, Error::InvalidSlot { slot: 4, .. }),
        ),
        (
            "slot listed twice",
            vec![
                c(0, SlotInput::Chain(&ok)),
                c(3, SlotInput::Chain(&ok)),
                c(0, SlotInput::Prefill(&ok)),
            ],
            |e| matches!(e, Error::InvalidSlot { slot: 0, .. }),
        ),
        ("too many rows", vec![c(0, SlotInput::Prefill(&big))], |e| {
            matches!(e, Error::Model(_))
        }),
        (
            "too many rows over several chunks",
            vec![
                c(0, SlotInput::Prefill(&big[..30])),
                c(3, SlotInput::Chain(&big[..11])),
            ],
            |e| matches!(e, Error::Model(_)),
        ),
        (
            "context overflow",
            vec![c(0, SlotInput::Chain(&ok)), c(2, SlotInput::Chain(&over))],
            |e| matches!(e, Error::Model(_)),
        ),
        (
            "tree on a slot with a pending tree",
            vec![
                c(0, SlotInput::Chain(&ok)),
                c(
                    1,
                    SlotInput::Tree {
                        root: 1,
                        block: DraftBlock::tree(&ok, &parents_ok),
                    },
                ),
            ],
            |e| matches!(e, Error::Model(_)),
        ),
        (
            "chain on a slot with a pending tree",
            vec![c(1, SlotInput::Chain(&ok))],
            |e| matches!(e, Error::Model(_)),
        ),
        (
            "bad tree",
            vec![
                c(0, SlotInput::Chain(&ok)),
                c(
                    3,
                    SlotInput::Tree {
                        root: 1,
                        block: DraftBlock::tree(&ok, &parents_bad),
                    },
                ),
            ],
            |e| matches!(e, Error::InvalidTree(_)),
        ),
        (
            "token outside the vocabulary",
            vec![
                c(0, SlotInput::Chain(&ok)),
                c(3, SlotInput::Prefill(&bad_token)),
            ],
            |e| matches!(e, Error::Model(_)),
        ),
        (
            "tree root outside the vocabulary",
            vec![c(
                3,
                SlotInput::Tree {
                    root: 301,
                    block: DraftBlock::chain(&ok),
                },
            )],
            |e| matches!(e, Error::Model(_)),
        ),
        (
            "empty chunk",
            vec![c(0, SlotInput::Chain(&ok)), c(3, SlotInput::Chain(&[]))],
            |e| matches!(e, Error::Model(_)),
        ),
    ];
    for (what, chunks, expected) in cases {
        let mut b = error_fixture();
        let before = snapshot(&b);
        let mut logits = vec![1.0f32; 5];
        let e = b.forward_batch(&chunks, &mut logits).unwrap_err();
        assert!(expected(&e), "{what}: unexpected error {e:?}");
        assert!(snapshot(&b) == before, "{what}: a slot changed");
        // The pending tree of slot 1 is still there and committable; slot 0 still appends.
        b.commit_tree(1, &[0, 2]).unwrap();
        assert_eq!(b.seq_len(1).unwrap(), 13);
        b.forward_batch(&[c(0, SlotInput::Chain(&ok))], &mut logits)
            .unwrap();
        assert_eq!(logits.len(), 2 * 301, "{what}");
    }
}

#[test]
fn tree_chunk_without_tree_support_is_an_error() {
    let mut b = FastBatch::new(weights(FastFormat::Q8), 2)
        .unwrap()
        .with_max_tree_nodes(0);
    assert_eq!(b.max_tree_nodes(), 0);
    let mut logits = Vec::new();
    let e = b
        .forward_batch(
            &[SlotChunk {
                slot: 0,
                input: SlotInput::Tree {
                    root: 1,
                    block: DraftBlock::chain(&[2]),
                },
            }],
            &mut logits,
        )
        .unwrap_err();
    assert!(matches!(e, Error::TargetContract { .. }), "{e:?}");
    assert_eq!(b.seq_len(0).unwrap(), 0);
}

#[test]
fn tree_over_the_node_budget_is_invalid() {
    let mut b = FastBatch::new(weights(FastFormat::Q8), 1)
        .unwrap()
        .with_max_tree_nodes(2);
    let mut logits = Vec::new();
    let e = b
        .forward_batch(
            &[SlotChunk {
                slot: 0,
                input: SlotInput::Tree {
                    root: 1,
                    block: DraftBlock::chain(&[2, 3, 4]),
                },
            }],
            &mut logits,
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidTree(_)), "{e:?}");
    assert_eq!(b.seq_len(0).unwrap(), 0);
}

#[test]
fn per_slot_errors_leave_slots_unchanged() {
    let mut b = error_fixture();
    let before = snapshot(&b);
    assert!(matches!(b.seq_len(4), Err(Error::InvalidSlot { .. })));
    assert!(matches!(b.truncate(4, 0), Err(Error::InvalidSlot { .. })));
    assert!(matches!(b.release(9), Err(Error::InvalidSlot { .. })));
    assert!(matches!(
        b.commit_tree(4, &[]),
        Err(Error::InvalidSlot { .. })
    ));
    assert!(matches!(b.truncate(0, 21), Err(Error::Model(_))));
    assert!(matches!(
        b.commit_tree(0, &[]),
        Err(Error::TargetContract { .. })
    ));
    // Slot 1's tree: nodes 0 and 1 are both children of the root, so keeping two nodes by
    // truncation is not a chain; [1, 2] is not a path (2's parent is node 0).
    assert!(matches!(b.truncate(1, 13), Err(Error::Model(_))));
    assert!(matches!(
        b.commit_tree(1, &[1, 2]),
        Err(Error::TargetContract { .. })
    ));
    assert!(snapshot(&b) == before);
    // Keeping one node (a chain of one) by truncation works.
    b.truncate(1, 12).unwrap();
    assert_eq!(b.seq_len(1).unwrap(), 12);
}

#[test]
fn empty_batch_clears_the_logits() {
    let mut b = FastBatch::new(weights(FastFormat::Q8), 1).unwrap();
    let mut logits = vec![1.0];
    b.forward_batch(&[], &mut logits).unwrap();
    assert!(logits.is_empty());
    assert_eq!(b.seq_len(0).unwrap(), 0);
}

// ---------------------------------------------------------------- real model

/// Four chat prompts of different lengths: prefilled together in uneven chunks, then three
/// batched greedy steps (one slot verifying a 3-token chain, one a small tree); every slot's
/// logits equal, bit for bit, those of a solo `FastTarget`.
#[test]
fn real_model_batch_of_four_matches_solo() {
    let w = common::fast_weights();
    let questions = [
        "Hi!",
        "What is the capital of France?",
        "Write a haiku about the sea and the wind in the evening.",
        "Explain in two sentences why the sky is blue, for a child of seven.",
    ];
    let prompts: Vec<Vec<u32>> = questions.iter().map(|q| common::chat(q)).collect();
    let mut batch = FastBatch::new(w.clone(), 4).unwrap();
    let mut solo_models: Vec<FastTarget> = (0..4).map(|_| FastTarget::new(w.clone())).collect();
    // Prefill all but the last token: first halves together, then second halves.
    let mut logits = Vec::new();
    for half in 0..2 {
        let parts: Vec<&[u32]> = prompts
            .iter()
            .map(|p| {
                let body = &p[..p.len() - 1];
                let mid = body.len() / 2;
                if half == 0 {
                    &body[..mid]
                } else {
                    &body[mid..]
                }
            })
            .collect();
        let chunks: Vec<SlotChunk<'_>> = parts
            .iter()
            .enumerate()
            .map(|(s, t)| SlotChunk {
                slot: s,
                input: SlotInput::Prefill(t),
            })
            .collect();
        batch.forward_batch(&chunks, &mut logits).unwrap();
    }
    for (m, p) in solo_models.iter_mut().zip(&prompts) {
        m.prefill(&p[..p.len() - 1]).unwrap();
    }
    let vocab = w.config().vocab_size;
    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32
    };
    let mut last: Vec<u32> = prompts.iter().map(|p| p[p.len() - 1]).collect();
    for step in 0..3 {
        let chain3: Vec<u32> = vec![last[1], 17, 42];
        let tree_nodes = [5u32, 9, 11];
        let tree_parents = [0u32, 0, 1];
        let inputs: Vec<(usize, Owned)> = vec![
            (3, Owned::Chain(vec![last[3]])),
            (
                1,
                if step == 1 {
                    Owned::Chain(chain3.clone())
                } else {
                    Owned::Chain(vec![last[1]])
                },
            ),
            (
                0,
                if step == 2 {
                    Owned::Tree(OwnedTree {
                        root: last[0],
                        tokens: tree_nodes.to_vec(),
                        parents: tree_parents.to_vec(),
                    })
                } else {
                    Owned::Chain(vec![last[0]])
                },
            ),
            (2, Owned::Chain(vec![last[2]])),
        ];
        let chunks: Vec<SlotChunk<'_>> = inputs
            .iter()
            .map(|(s, c)| SlotChunk {
                slot: *s,
                input: c.input(),
            })
            .collect();
        batch.forward_batch(&chunks, &mut logits).unwrap();
        let mut at = 0;
        for (s, c) in &inputs {
            let base = solo_models[*s].seq_len();
            let expect = solo(&mut solo_models[*s], c);
            assert!(
                bits(&logits[at..at + expect.len()]) == bits(&expect),
                "step {step}, slot {s}: batched logits differ from solo"
            );
            // Keep the first row's greedy token; roll back the rest.
            last[*s] = argmax(&expect[..vocab]);
            match c {
                Owned::Tree(_) => {
                    batch.commit_tree(*s, &[]).unwrap();
                    solo_models[*s].tree().unwrap().commit_tree(&[]).unwrap();
                }
                _ => {
                    batch.truncate(*s, base + 1).unwrap();
                    solo_models[*s].truncate(base + 1).unwrap();
                }
            }
            at += expect.len();
        }
        assert_eq!(at, logits.len());
    }
    for (s, m) in solo_models.iter().enumerate() {
        assert_eq!(batch.kv_snapshot(s).unwrap(), m.kv_snapshot());
    }
}
