//! The whole text path of the decoding loop against a brute-force reference (issue 26; the stop
//! rules of the `decode` docs; the reference is `tests/common/text.rs`).
//!
//! Each case draws a byte-level vocabulary (pieces of 1-4 bytes, multi-byte characters split
//! across tokens, lone continuation bytes, 0xFF), a target whose greedy output is a hash of its
//! context, and one to three requests with random stops: EOS ids, stop token sequences (many cut
//! from the target's actual output), stop strings (many cut from its actual text, overlapping,
//! nested, multi-byte, U+FFFD), `min_tokens`, `max_new_tokens`, include / exclude, chain drafts
//! that follow the target's output for a while, token trees of any depth. Every request runs
//! alone on a [`Generator`] and all of them together on a [`BatchGenerator`]; tokens, text,
//! finish reason and every streamed chunk must equal the reference's.
//!
//! Case count: `FUZZ_CASES` (default [`DEFAULT_CASES`], fixed seed); `scripts/fuzz.sh` runs many
//! more with a random seed (`PROPTEST_RNG_SEED` reproduces one).

mod common;

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};

use common::text::{ByteVocab, Expected, Outcome, Rule, floor_bans, greedy_output, reference};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};
use speculative::decode::{
    BatchGenerator, BatchRequest, DraftLength, FinishReason, GenerationError, GenerationParams,
    Generator, StopConditions, StreamChunk, TreeDrafts,
};
use speculative::test_util::{LogitsFn, ToyModel};
use speculative::{Draft, Error, PerSlot, ProposeRequest, Proposer, Result};

/// Cases of the property in the normal test suite.
const DEFAULT_CASES: u32 = 4000;

/// Tree capacity of the toy targets.
const TREE_CAPACITY: usize = 16;

/// Cases to run: `FUZZ_CASES` or [`DEFAULT_CASES`].
fn cases() -> u32 {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// The runner's configuration: a fixed seed in the normal suite (reproducible CI), proptest's
/// own (random or `PROPTEST_RNG_SEED`) when `FUZZ_CASES` is set; no regression files.
fn config(cases: u32) -> Config {
    let fuzzing = std::env::var_os("FUZZ_CASES").is_some();
    Config {
        cases,
        failure_persistence: None,
        rng_seed: if fuzzing {
            Config::default().rng_seed
        } else {
            RngSeed::Fixed(0x7e57_0026)
        },
        ..Config::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Hashing (the toy target and the proposers draw from it).

/// SplitMix64's finaliser.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A hash of a seed and a list of words.
fn hash(seed: u64, words: impl IntoIterator<Item = u64>) -> u64 {
    words.into_iter().fold(mix(seed), |h, w| mix(h ^ w))
}

// ---------------------------------------------------------------------------------------------
// The generated cases.

/// The shared part of a case: a byte-level vocabulary and a target.
#[derive(Debug, Clone)]
struct World {
    /// Token -> bytes.
    pieces: Vec<Vec<u8>>,
    /// The target's logits depend on its last `order` context tokens.
    order: usize,
    /// The target's hash seed.
    seed: u64,
    /// Slots of the batch target.
    slots: usize,
}

/// A stop token sequence before it meets the target's output.
#[derive(Debug, Clone)]
enum SeqSpec {
    /// `len` (2 or 3) tokens of the target's output from token `at` (modulo its length).
    FromOutput { at: usize, len: usize },
    /// Literal ids (modulo the vocabulary), 2 or 3 of them, or none (an invalid request).
    Ids(Vec<u32>),
}

/// A stop string before it meets the target's text.
#[derive(Debug, Clone)]
enum StrSpec {
    /// `chars` characters of the target's visible text from character `at` (modulo its
    /// length); with `inner`, also the same string without its first and last character.
    FromText {
        at: usize,
        chars: usize,
        inner: bool,
    },
    /// A literal string (possibly empty: an invalid request).
    Literal(String),
}

/// One request of a case.
#[derive(Debug, Clone)]
struct RequestSpec {
    prompt: Vec<u32>,
    eos: Vec<u32>,
    /// Single-token stop sequences (banned below the floor like EOS).
    singles: Vec<u32>,
    seqs: Vec<SeqSpec>,
    strings: Vec<StrSpec>,
    include: bool,
    max_new: usize,
    min_tokens: usize,
    /// `None`: `DraftLength::Off`; else `Fixed(k)`.
    k: Option<usize>,
    tree_nodes: usize,
    tree_branch: usize,
    /// Percent chance that each draft token follows the target's output (while it still does).
    follow: u64,
    salt: u64,
}

/// A case: a world and the requests run in it.
#[derive(Debug, Clone)]
struct Case {
    world: World,
    requests: Vec<RequestSpec>,
}

/// Characters whose bytes the vocabularies cut into pieces.
const WIDE: [&str; 5] = ["\u{e9}", "\u{20ac}", "\u{1f600}", "\u{df}", "\u{FFFD}"];

/// One unit of a piece: ASCII, a whole multi-byte character, its first or last bytes, or a byte
/// that is never valid where it stands.
fn unit() -> impl Strategy<Value = Vec<u8>> {
    let wide = (0..WIDE.len(), 1usize..4);
    prop_oneof![
        6 => prop::sample::select(vec!["a", "b", "c", " ", "x"]).prop_map(|s| s.as_bytes().to_vec()),
        2 => (0..WIDE.len()).prop_map(|i| WIDE[i].as_bytes().to_vec()),
        2 => wide.clone().prop_map(|(i, cut)| {
            let b = WIDE[i].as_bytes();
            b[..cut.min(b.len() - 1)].to_vec()
        }),
        2 => wide.prop_map(|(i, cut)| {
            let b = WIDE[i].as_bytes();
            b[cut.min(b.len() - 1)..].to_vec()
        }),
        1 => Just(vec![0xFF]),
        1 => Just(vec![0x80]),
    ]
}

/// A token's bytes: 1 to 4 of them.
fn piece() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(unit(), 1..=3).prop_map(|units| {
        let mut b = units.concat();
        b.truncate(4);
        b
    })
}

fn world() -> impl Strategy<Value = World> {
    (
        prop::collection::vec(piece(), 4..=12),
        1usize..=3,
        any::<u64>(),
        1usize..=3,
    )
        .prop_map(|(pieces, order, seed, slots)| World {
            pieces,
            order,
            seed,
            slots,
        })
}

fn seq_spec() -> impl Strategy<Value = SeqSpec> {
    prop_oneof![
        20 => (0usize..32, 2usize..=3).prop_map(|(at, len)| SeqSpec::FromOutput { at, len }),
        9 => prop::collection::vec(0u32..16, 2..=3).prop_map(SeqSpec::Ids),
        1 => Just(SeqSpec::Ids(Vec::new())),
    ]
}

fn str_spec() -> impl Strategy<Value = StrSpec> {
    let alphabet = vec![
        "a",
        "b",
        "c",
        " ",
        "\u{e9}",
        "\u{20ac}",
        "\u{1f600}",
        "\u{FFFD}",
    ];
    let literal = prop::collection::vec(prop::sample::select(alphabet), 1..=3);
    prop_oneof![
        36 => (0usize..64, 1usize..=4, prop::bool::weighted(0.3))
            .prop_map(|(at, chars, inner)| StrSpec::FromText { at, chars, inner }),
        12 => literal.prop_map(|s| StrSpec::Literal(s.concat())),
        1 => Just(StrSpec::Literal(String::new())),
    ]
}

fn request_spec() -> impl Strategy<Value = RequestSpec> {
    let ids = |n| prop::collection::vec(0u32..16, 0..=n);
    let stops = (
        prop_oneof![1 => Just(vec![]), 1 => ids(2)],
        prop_oneof![3 => Just(vec![]), 1 => ids(1)],
        prop::collection::vec(seq_spec(), 0..=2),
        prop::collection::vec(str_spec(), 0..=3),
        any::<bool>(),
    );
    let lengths = (
        prop_oneof![1 => 0usize..=2, 9 => 3usize..=24],
        prop_oneof![1 => Just(0usize), 2 => 0usize..=24],
    );
    let drafts = (
        prop_oneof![1 => Just(None), 4 => (0usize..=6).prop_map(Some)],
        prop_oneof![1 => Just(0usize), 1 => 1usize..=12],
        0usize..=3,
        prop_oneof![1 => 0u64..=100, 2 => 70u64..=100],
        any::<u64>(),
    );
    (
        prop::collection::vec(0u32..16, 1..=4),
        stops,
        lengths,
        drafts,
    )
        .prop_map(
            |(prompt, (eos, singles, seqs, strings, include), (max_new, min_tokens), drafts)| {
                let (k, tree_nodes, tree_branch, follow, salt) = drafts;
                RequestSpec {
                    prompt,
                    eos,
                    singles,
                    seqs,
                    strings,
                    include,
                    max_new,
                    min_tokens: min_tokens.min(max_new),
                    k,
                    tree_nodes,
                    tree_branch,
                    follow,
                    salt,
                }
            },
        )
}

fn case() -> impl Strategy<Value = Case> {
    (world(), prop::collection::vec(request_spec(), 1..=3))
        .prop_map(|(world, requests)| Case { world, requests })
}

// ---------------------------------------------------------------------------------------------
// Resolving a case: the target, its output, and the concrete requests.

impl World {
    fn vocab(&self) -> ByteVocab {
        ByteVocab::new(self.pieces.clone())
    }

    /// The target's logits after `context`: distinct ranks `0..vocab` keyed by the last `order`
    /// tokens, so that every argmax (with or without bans) is unique.
    fn logits(&self) -> LogitsFn {
        let (n, order, seed) = (self.pieces.len(), self.order, self.seed);
        Arc::new(move |ctx: &[u32]| {
            let key = hash(
                seed,
                ctx[ctx.len().saturating_sub(order)..]
                    .iter()
                    .map(|&t| t as u64),
            );
            let mut ids: Vec<usize> = (0..n).collect();
            ids.sort_by_key(|&t| hash(key, [t as u64]));
            let mut row = vec![0.0f32; n];
            for (rank, t) in ids.into_iter().enumerate() {
                row[t] = rank as f32;
            }
            row
        })
    }

    /// A toy target over this world's logits, with tree support.
    fn target(&self) -> ToyModel {
        ToyModel::new(self.pieces.len(), 1 << 12, self.logits()).with_tree(TREE_CAPACITY)
    }
}

/// A request ready to run: prompt, parameters, and the target's greedy output of
/// `max_new_tokens` tokens under the floor's bans (what the proposer follows and the reference
/// cuts).
#[derive(Debug, Clone)]
struct Request {
    prompt: Vec<u32>,
    /// The parameters, or `GenerationParamsBuilder::build`'s refusal (rule 9: an empty stop
    /// string or sequence is refused when the parameters are built).
    params: std::result::Result<GenerationParams, Refusal>,
    /// The stop conditions and floor the parameters were built from (the reference's input).
    stop: StopConditions,
    min_tokens: usize,
    /// The other settings, for failure reports.
    settings: String,
    output: Vec<u32>,
    follow: u64,
    salt: u64,
}

/// Resolves `spec` in `world`: ids modulo the vocabulary, stop sequences and strings cut from
/// the target's output and text.
fn resolve(world: &World, spec: &RequestSpec) -> Request {
    let n = world.pieces.len() as u32;
    let prompt: Vec<u32> = spec.prompt.iter().map(|&t| t % n).collect();
    let mut stop = StopConditions::default().include_stop_string(spec.include);
    stop.eos = spec.eos.iter().map(|&t| t % n).collect();
    stop.stop_sequences = spec.singles.iter().map(|&t| vec![t % n]).collect();
    let logits = world.logits();
    let bans = floor_bans(&stop);
    let output = greedy_output(&*logits, &prompt, &bans, spec.min_tokens, spec.max_new);
    for s in &spec.seqs {
        stop.stop_sequences.extend(stop_sequence(s, &output, n));
    }
    let text: Vec<char> = world.vocab().visible(&output).chars().collect();
    for s in &spec.strings {
        stop.stop_strings.extend(stop_strings(s, &text));
    }
    let draft = spec.k.map_or(DraftLength::Off, DraftLength::Fixed);
    let settings = format!(
        "max_new_tokens {}, draft {draft:?}, tree_nodes {}, tree_branch {}",
        spec.max_new, spec.tree_nodes, spec.tree_branch
    );
    let params = GenerationParams::builder()
        .max_new_tokens(spec.max_new)
        .min_tokens(spec.min_tokens)
        .stop(stop.clone())
        .draft(draft)
        .tree(TreeDrafts::nodes(spec.tree_nodes).with_branch(spec.tree_branch))
        .build()
        .map_err(|e| Refusal {
            invalid_config: matches!(e, Error::InvalidConfig { .. }),
            message: e.to_string(),
        });
    Request {
        prompt,
        params,
        stop,
        min_tokens: spec.min_tokens,
        settings,
        output,
        follow: spec.follow,
        salt: spec.salt,
    }
}

/// The stop sequence of `spec` (none when the output is too short to cut one from).
fn stop_sequence(spec: &SeqSpec, output: &[u32], n: u32) -> Option<Vec<u32>> {
    match spec {
        SeqSpec::Ids(ids) => Some(ids.iter().map(|&t| t % n).collect()),
        SeqSpec::FromOutput { at, len } => {
            let at = at % output.len().max(1);
            (at + len <= output.len()).then(|| output[at..at + len].to_vec())
        }
    }
}

/// The stop strings of `spec` (none when the text is empty).
fn stop_strings(spec: &StrSpec, text: &[char]) -> Vec<String> {
    match spec {
        StrSpec::Literal(s) => vec![s.clone()],
        StrSpec::FromText { .. } if text.is_empty() => Vec::new(),
        &StrSpec::FromText { at, chars, inner } => {
            let at = at % text.len();
            let s = &text[at..(at + chars).min(text.len())];
            let mut out = vec![s.iter().collect::<String>()];
            if inner && s.len() > 2 {
                out.push(s[1..s.len() - 1].iter().collect());
            }
            out
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The proposer.

/// A point-mass proposer that drafts the target's output (`truth`) token by token, each with
/// chance `follow` percent while it still follows it, and hashed random tokens after the first
/// miss. Trees add random siblings (distinct) at random ranks, 0 to 3 children per node. Every
/// draft is a function of the context alone, so a request drafts the same alone and in a batch.
struct Follower {
    truth: Vec<u32>,
    prompt_len: usize,
    vocab: u64,
    follow: u64,
    salt: u64,
}

impl Follower {
    fn new(req: &Request, vocab: usize) -> Self {
        Follower {
            truth: req.output.clone(),
            prompt_len: req.prompt.len(),
            vocab: vocab as u64,
            follow: req.follow,
            salt: req.salt,
        }
    }

    /// The hash of a draft position: the context length, a node and a purpose.
    fn roll(&self, ctx_len: usize, node: usize, what: u64) -> u64 {
        hash(self.salt, [ctx_len as u64, node as u64, what])
    }

    /// The target's token at generated position `pos`, when the draft may take it.
    fn truth_at(&self, pos: usize, roll: u64) -> Option<u32> {
        (roll % 100 < self.follow).then(|| self.truth.get(pos).copied())?
    }
}

impl Proposer for Follower {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let (len, generated) = (req.context.len(), req.context.len() - self.prompt_len);
        let mut on_track = true;
        for d in 0..req.max_draft {
            let truth = self.truth_at(generated + d, self.roll(len, d, 0));
            on_track &= truth.is_some();
            let random = (self.roll(len, d, 1) % self.vocab) as u32;
            draft
                .tokens
                .push(truth.filter(|_| on_track).unwrap_or(random));
        }
        Ok(())
    }

    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let (len, generated) = (req.context.len(), req.context.len() - self.prompt_len);
        let widest = req.max_branch.min(3).min(self.vocab as usize);
        // Breadth first: (parent row, depth of its children, parent follows the truth).
        let mut open = vec![(0usize, 0usize, true)];
        let mut next = 0;
        while next < open.len() && draft.tokens.len() < req.max_nodes {
            let (row, depth, on_track) = open[next];
            next += 1;
            if depth >= req.max_draft {
                continue;
            }
            let width = (self.roll(len, row, 2) % (widest as u64 + 1)) as usize;
            let truth = on_track
                .then(|| self.truth_at(generated + depth, self.roll(len, row, 3)))
                .flatten();
            let rank = (self.roll(len, row, 4) % width.max(1) as u64) as usize;
            for (j, token) in self
                .siblings(width, truth, rank, len, row)
                .into_iter()
                .enumerate()
            {
                if draft.tokens.len() >= req.max_nodes {
                    break;
                }
                draft.tokens.push(token);
                draft.parents.push(row as u32);
                let follows = truth.is_some() && j == rank;
                open.push((draft.tokens.len(), depth + 1, follows));
            }
        }
        Ok(())
    }
}

impl Follower {
    /// `width` distinct sibling tokens, `truth` (when given) at index `rank`.
    fn siblings(
        &self,
        width: usize,
        truth: Option<u32>,
        rank: usize,
        len: usize,
        row: usize,
    ) -> Vec<u32> {
        let mut out: Vec<u32> = truth.into_iter().collect();
        let mut r = self.roll(len, row, 5);
        while out.len() < width {
            let mut t = (r % self.vocab) as u32;
            while out.contains(&t) {
                t = (t + 1) % self.vocab as u32;
            }
            out.push(t);
            r = mix(r);
        }
        if truth.is_some() && width > 0 {
            out.swap(0, rank);
        }
        out.truncate(width);
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Running the loop and comparing.

/// What the loop returned for one request: its result and every streamed chunk (tokens, text).
#[derive(Debug, Clone, Default)]
struct Observed {
    result: Option<std::result::Result<Outcome, String>>,
    /// `true` when the request was refused with `Error::InvalidConfig`.
    invalid_config: bool,
    chunks: Vec<(Vec<u32>, String)>,
}

impl Observed {
    fn record(&mut self, c: &StreamChunk<'_>) {
        self.chunks.push((c.tokens.to_vec(), c.text.to_owned()));
    }

    fn finish(&mut self, r: std::result::Result<speculative::decode::Generation, GenerationError>) {
        match r {
            Ok(g) => {
                let text = g.text.unwrap_or_else(|| "<no text>".into());
                let tokens = g.tokens;
                self.result = Some(Ok(Outcome {
                    tokens,
                    text,
                    finish: g.finish,
                }));
            }
            Err(e) => self.refuse(&e.error),
        }
    }

    fn refuse(&mut self, e: &Error) {
        self.invalid_config = matches!(e, Error::InvalidConfig { .. });
        self.result = Some(Err(e.to_string()));
    }

    /// The request never ran: its parameters were refused when built.
    fn refused(r: &Refusal) -> Observed {
        Observed {
            result: Some(Err(r.message.clone())),
            invalid_config: r.invalid_config,
            chunks: Vec::new(),
        }
    }
}

/// Why `GenerationParamsBuilder::build` refused a request's parameters.
#[derive(Debug, Clone)]
struct Refusal {
    invalid_config: bool,
    message: String,
}

/// Runs `req` alone on a [`Generator`].
fn run_alone(world: &World, req: &Request) -> Observed {
    let params = match &req.params {
        Ok(p) => p,
        Err(r) => return Observed::refused(r),
    };
    let proposer = Follower::new(req, world.pieces.len());
    let mut g = Generator::new(world.target(), proposer).with_detokenizer(world.vocab());
    let mut seen = Observed::default();
    let r = g.generate_stream(&req.prompt, params, |c| {
        seen.record(&c);
        ControlFlow::Continue(())
    });
    seen.finish(r);
    seen
}

/// Runs every request of `reqs` in one [`BatchGenerator`] over `world.slots` slots.
fn run_batched(world: &World, reqs: &[Request]) -> Vec<Observed> {
    let slots = (0..world.slots).map(|_| world.target()).collect();
    let mut batch = BatchGenerator::new(PerSlot::new(slots).expect("slots"));
    let seen: Vec<Arc<Mutex<Observed>>> = reqs.iter().map(|_| Arc::default()).collect();
    let mut ids = Vec::new();
    for (req, seen) in reqs.iter().zip(&seen) {
        let params = match &req.params {
            Ok(p) => p.clone(),
            Err(r) => {
                *seen.lock().unwrap() = Observed::refused(r);
                continue;
            }
        };
        let proposer = Follower::new(req, world.pieces.len());
        let sink = Arc::clone(seen);
        let r = BatchRequest::new(req.prompt.clone(), params, proposer)
            .with_detokenizer(Box::new(world.vocab()))
            .with_stream(move |c| {
                sink.lock().unwrap().record(&c);
                ControlFlow::Continue(())
            });
        match batch.submit(r) {
            Ok(id) => ids.push((id, Arc::clone(seen))),
            Err(e) => seen.lock().unwrap().refuse(&e),
        }
    }
    match batch.run() {
        Ok(done) => {
            for f in done {
                let (_, seen) = ids.iter().find(|(id, _)| *id == f.id).expect("known id");
                seen.lock().unwrap().finish(f.result);
            }
        }
        Err(e) => ids.iter().for_each(|(_, s)| s.lock().unwrap().refuse(&e)),
    }
    seen.iter().map(|s| s.lock().unwrap().clone()).collect()
}

/// `Ok` when `got` is what `want` says: the same outcome and the streamed chunks of rule 7.
fn compare(
    want: &Expected,
    got: &Observed,
    vocab: &ByteVocab,
    strings: &[String],
) -> std::result::Result<(), String> {
    let out = match (want, &got.result) {
        (Expected::Invalid, _) if got.invalid_config => return Ok(()),
        (Expected::Invalid, r) => return Err(format!("want InvalidConfig, got {r:?}")),
        (Expected::Done(want), Some(Ok(out))) if out == want => out,
        (Expected::Done(want), r) => return Err(format!("want {want:?}, got {r:?}")),
    };
    let streamed: Vec<u32> = got.chunks.iter().flat_map(|c| c.0.clone()).collect();
    if streamed != out.tokens {
        return Err(format!("streamed tokens {streamed:?}"));
    }
    let sizes: Vec<usize> = got.chunks.iter().map(|c| c.0.len()).collect();
    let chunks = common::text::stream_chunks(out, vocab, strings, &sizes);
    let texts: Vec<&str> = got.chunks.iter().map(|c| c.1.as_str()).collect();
    if texts != chunks {
        return Err(format!(
            "streamed text {texts:?}, want {chunks:?} (steps {sizes:?})"
        ));
    }
    Ok(())
}

/// The request as a reader wants it in a failure: vocabulary, output, text, parameters.
fn describe(world: &World, req: &Request) -> String {
    let pieces: Vec<String> = world
        .pieces
        .iter()
        .map(|p| p.escape_ascii().to_string())
        .collect();
    format!(
        "pieces {pieces:?}\nprompt {:?}, target output {:?} = {:?}\nstop {:?}\nmin_tokens {}, \
         {}, follow {}%",
        req.prompt,
        req.output,
        world.vocab().text(&req.output),
        req.stop,
        req.min_tokens,
        req.settings,
        req.follow,
    )
}

/// A request on which the loop and the reference disagree.
struct Failure {
    /// "alone" or "in a batch".
    how: &'static str,
    req: Request,
    want: Expected,
    got: Observed,
    why: String,
}

impl Failure {
    fn message(&self, world: &World) -> String {
        format!("{}: {}\n{}", self.how, self.why, describe(world, &self.req))
    }
}

/// Every disagreement of the loop (each request alone and all in a batch) with the reference
/// under `rule`.
fn failures(case: &Case, rule: Rule) -> Vec<Failure> {
    let world = &case.world;
    let vocab = world.vocab();
    let reqs: Vec<Request> = case.requests.iter().map(|s| resolve(world, s)).collect();
    let batched = run_batched(world, &reqs);
    let mut out = Vec::new();
    for (req, in_batch) in reqs.iter().zip(batched) {
        let stop = &req.stop;
        let want = reference(&req.output, &vocab, stop, req.min_tokens, rule);
        for (how, got) in [("alone", run_alone(world, req)), ("in a batch", in_batch)] {
            if let Err(why) = compare(&want, &got, &vocab, &stop.stop_strings) {
                let (req, want) = (req.clone(), want.clone());
                out.push(Failure {
                    how,
                    req,
                    want,
                    got,
                    why,
                });
            }
        }
    }
    out
}

/// The property: no disagreement in `case` under `rule`.
fn check_case(case: &Case, rule: Rule) -> std::result::Result<(), TestCaseError> {
    match failures(case, rule).first() {
        Some(f) => Err(TestCaseError::fail(f.message(&case.world))),
        None => Ok(()),
    }
}

/// Runs `cases` cases against the reference under `rule`; the runner's error on a failure.
fn run_property(cases: u32, rule: Rule, shrink: bool) -> std::result::Result<(), TestError<Case>> {
    let mut cfg = config(cases);
    if !shrink {
        cfg.max_shrink_iters = 0;
    }
    TestRunner::new(cfg).run(&case(), |c| check_case(&c, rule))
}

#[test]
fn the_loop_matches_the_text_reference() {
    let n = cases();
    let r = run_property(n, Rule::Contract, true);
    let verdict = if r.is_ok() { "" } else { " (FAILED)" };
    println!("fuzz text_reference: {n} cases{verdict}");
    if let Err(e) = r {
        panic!("{e}");
    }
}

#[test]
fn the_harness_rejects_a_wrong_reference() {
    for rule in [Rule::FirstStartWins, Rule::WholeTokens] {
        let r = run_property(DEFAULT_CASES, rule, false);
        assert!(
            matches!(r, Err(TestError::Fail(..))),
            "the property passes with {rule:?}: {r:?}"
        );
    }
}

/// Counts of the reference's outcomes over `n` generated requests (no loop run).
fn reference_outcomes(n: u32) -> std::collections::HashMap<String, u32> {
    let mut runner = TestRunner::new(config(n));
    let mut counts = std::collections::HashMap::new();
    for _ in 0..n {
        let c = case().new_tree(&mut runner).expect("a case").current();
        for spec in &c.requests {
            let req = resolve(&c.world, spec);
            let (stop, m) = (&req.stop, req.min_tokens);
            let key = match reference(&req.output, &c.world.vocab(), stop, m, Rule::Contract) {
                Expected::Invalid => "invalid".to_owned(),
                Expected::Done(o) => format!("{:?}", o.finish),
            };
            *counts.entry(key).or_insert(0) += 1;
        }
    }
    counts
}

#[test]
fn the_generated_cases_reach_every_ending() {
    let counts = reference_outcomes(DEFAULT_CASES);
    let total: u32 = counts.values().sum();
    println!("reference endings of {total} requests: {counts:?}");
    for (key, min_percent) in [
        ("Eos", 5),
        ("StopSequence", 5),
        ("StopString", 20),
        ("MaxTokens", 10),
        ("invalid", 1),
    ] {
        let n = counts.get(key).copied().unwrap_or(0);
        assert!(
            n * 100 >= total * min_percent,
            "{key}: {n} of {total} ({counts:?})"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Diagnostics: `cargo test --test text_reference -- --ignored --nocapture failure_census`.

/// `true` when the loop's stop-string text `got` ends at an occurrence of a stop string that
/// completes at its last token (rule 3), `false` when it ends at an older occurrence.
fn fresh_stop(vocab: &ByteVocab, stop: &StopConditions, got: &Outcome) -> bool {
    let Some((&_, earlier)) = got.tokens.split_last() else {
        return false;
    };
    let (v, before) = (vocab.visible(&got.tokens), vocab.visible(earlier).len());
    let end = got.text.len();
    stop.stop_strings.iter().any(|s| {
        let (a, b) = if stop.include_stop_str_in_output {
            (end.saturating_sub(s.len()), end)
        } else {
            (end, end + s.len())
        };
        b > before && v.get(a..b) == Some(s.as_str())
    })
}

/// The kind of a disagreement, read from its symptoms (the kinds of cases C16-C18 and rules 6,
/// 7 and 9).
fn kind(world: &World, f: &Failure) -> &'static str {
    let vocab = world.vocab();
    let stop = &f.req.stop;
    let (want, got) = match (&f.want, &f.got.result) {
        (Expected::Invalid, _) if stop.stop_sequences.iter().any(Vec::is_empty) => {
            return "rule 9: an empty stop sequence is not refused";
        }
        (Expected::Invalid, _) => return "rule 9: an empty stop string is not refused",
        (Expected::Done(w), Some(Ok(g))) => (w, g),
        (Expected::Done(_), _) => return "the loop fails",
    };
    let partial = vocab.text(&want.tokens).ends_with('\u{FFFD}');
    if got.finish == FinishReason::StopString && !fresh_stop(&vocab, stop, got) {
        return "C16: an occurrence that completed at an earlier token (below the floor) stops";
    }
    let late = got.tokens.len() > want.tokens.len() || got.finish != want.finish;
    if late && want.finish == FinishReason::StopString && partial {
        return "C17: a token ending in U+FFFD hides the stop string it completes";
    }
    if got.tokens != want.tokens {
        return "other token difference";
    }
    match (want.finish == got.finish, want.text == got.text) {
        (false, _) => "finish reason differs (other)",
        (true, false) if want.finish == FinishReason::StopString => {
            "C18: the stop string that starts first wins, not the one that completes first"
        }
        (true, false) => final_text_kind(&want.text, &got.text),
        (true, true) => "rule 7: streamed chunks differ",
    }
}

/// The kind of a wrong final text of a finish other than `StopString` (rule 6).
fn final_text_kind(want: &str, got: &str) -> &'static str {
    match want.strip_prefix(got) {
        Some(rest) if rest.chars().all(|c| c == '\u{FFFD}') => {
            "rule 6: the final text drops its trailing U+FFFD"
        }
        Some(_) => {
            "rule 6: the final text is cut (at a stop string, or before a partial character)"
        }
        None => "rule 6: the final text differs (other)",
    }
}

/// The message of the first generated case with a disagreement of kind `wanted`, shrunk by
/// proptest (within `n` cases).
fn minimal_of_kind(n: u32, wanted: (&str, &str)) -> String {
    let r = TestRunner::new(config(n)).run(&case(), |c| {
        let all = failures(&c, Rule::Contract);
        match all.iter().find(|f| (kind(&c.world, f), f.how) == wanted) {
            Some(f) => Err(TestCaseError::fail(format!(
                "{}\nwant {:?}\ngot {:?}",
                f.message(&c.world),
                f.want,
                f.got.result
            ))),
            None => Ok(()),
        }
    });
    match r {
        Err(TestError::Fail(why, _)) => why.to_string(),
        other => format!("not found: {other:?}"),
    }
}

#[test]
#[ignore = "diagnostic: counts the loop's disagreements by kind and shows a minimal case of each"]
fn failure_census() {
    let n = cases();
    let mut runner = TestRunner::new(config(n));
    let mut kinds = std::collections::BTreeMap::<(&str, &str), u32>::new();
    let started = std::time::Instant::now();
    for _ in 0..n {
        let c = case().new_tree(&mut runner).expect("a case").current();
        for f in failures(&c, Rule::Contract) {
            *kinds.entry((kind(&c.world, &f), f.how)).or_default() += 1;
        }
    }
    println!("{n} cases in {:.1} s", started.elapsed().as_secs_f64());
    for (k, count) in kinds {
        let example = minimal_of_kind(n, k);
        println!("\n=== {} ({}): {count} requests\n{example}", k.0, k.1);
    }
}
