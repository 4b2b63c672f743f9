//! The grammar mask on toy vocabularies and toy targets (no real model):
//!
//! - rollback: after rows of rejected drafts, the matcher's state at the accepted prefix equals
//!   that of a fresh matcher fed the accepted prefix;
//! - the end of the grammar allows only EOS and the generation stops there;
//! - greedy constrained speculative output equals plain constrained greedy output;
//! - losslessness: the law of constrained sequences with speculation (prompt lookup, random
//!   drafts, grammar-forced drafts, a draft model, trees) equals plain constrained sampling
//!   (G-test against the exact law, alpha = 1e-3), and a negative control (a mask left
//!   advanced by rejected drafts) is rejected by the same test.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions, TreeDrafts};
use speculative::propose::{DraftModelProposer, PromptLookup};
use speculative::rng::Stream;
use speculative::sampling::{History, RowProcessor, TokenDist};
use speculative::test_util::{RandomProposer, ToyModel};
use speculative::{Proposer, RowKind, SamplingConfig, TargetModel, TokenMask};
use speculative_guidance::{ForcedDrafts, Grammar, GrammarMask, Vocabulary};
use statrs::distribution::{ChiSquared, ContinuousCDF};

const ALPHA: f64 = 1e-3;
/// Tokens: `a`, `b`, `c`, `ab`, `{`, `}`, `<eos>` (special).
const TOKENS: [&str; 7] = ["a", "b", "c", "ab", "{", "}", "<eos>"];
const VOCAB: usize = TOKENS.len();
const EOS: u32 = 6;
const PROMPT: [u32; 8] = [0, 1, 2, 3, 0, 1, 4, 5];
/// Generated tokens at most per sequence.
const LEN: usize = 5;
const N: u64 = 12_000;
/// `{` then one or more of `ab` / `c`, then `}` (so `a` forces `b`, `{` is forced at the start
/// and `}` is forced... never, as more `ab`/`c` may follow).
const REGEX: &str = r"\{(ab|c)+\}";

fn vocab() -> Vocabulary {
    let bytes = TOKENS.iter().map(|t| t.as_bytes().to_vec()).collect();
    let special = (0..VOCAB).map(|i| i as u32 == EOS).collect();
    Vocabulary::greedy(bytes, special, EOS).unwrap()
}

fn mask() -> Arc<GrammarMask> {
    Arc::new(GrammarMask::regex(&vocab(), REGEX, PROMPT.len()).unwrap())
}

fn target() -> ToyModel {
    ToyModel::markov(VOCAB, 2, 1.5, 7)
}

fn draft_model() -> ToyModel {
    ToyModel::markov(VOCAB, 2, 1.5, 31)
}

/// A small deterministic generator for the random walks.
struct Rng(Stream, u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.1 += 1;
        (self.0.bits(self.1, 0)[0] as usize) % n
    }
}

#[test]
fn rejected_drafts_leave_no_trace_in_the_matcher() {
    let vocab = vocab();
    let used = GrammarMask::regex(&vocab, REGEX, PROMPT.len()).unwrap();
    let mut rng = Rng(Stream::new(5), 0);
    let mut logits = vec![0.0f32; VOCAB];
    for walk in 0..200 {
        // An accepted prefix: a random walk through the allowed sets (of a fresh mask).
        let fresh = GrammarMask::regex(&vocab, REGEX, PROMPT.len()).unwrap();
        let mut acc = PROMPT.to_vec();
        let steps = rng.below(LEN + 1);
        for _ in 0..steps {
            let allowed = fresh.allowed(&acc).unwrap();
            let t = allowed[rng.below(allowed.len())];
            if t == EOS {
                break;
            }
            acc.push(t);
        }
        // Rows of drafts after it (valid or not), as a verify step would process them.
        for _ in 0..3 {
            let mut p = acc.clone();
            for _ in 0..rng.below(5) {
                p.push(rng.below(VOCAB) as u32);
                logits.fill(0.0);
                used.apply(&p, &mut logits);
            }
        }
        let got = used.state_at(&acc);
        let want = GrammarMask::regex(&vocab, REGEX, PROMPT.len())
            .unwrap()
            .state_at(&acc);
        assert_eq!(
            got, want,
            "walk {walk}: state after rejected drafts differs"
        );
        assert_eq!(got.consumed, acc[PROMPT.len()..], "walk {walk}");
    }
}

#[test]
fn the_mask_bans_what_the_grammar_rejects_and_ends_with_eos() {
    let m = mask();
    let p = |g: &[u32]| [&PROMPT[..], g].concat();
    // Start: only `{`.
    assert_eq!(m.allowed(&p(&[])).unwrap(), vec![4]);
    // After `{a`: only `b`.
    assert_eq!(m.allowed(&p(&[4, 0])).unwrap(), vec![1]);
    // After `{c`: `a`, `c`, `ab`, `}`.
    assert_eq!(m.allowed(&p(&[4, 2])).unwrap(), vec![0, 2, 3, 5]);
    // Complete: only EOS.
    let done = p(&[4, 2, 5]);
    assert_eq!(m.allowed(&done).unwrap(), vec![EOS]);
    let st = m.state_at(&done);
    assert!(st.accepting && st.stopped);
    let mut row = vec![1.0f32; VOCAB + 2];
    m.apply(&done, &mut row);
    for (t, &l) in row.iter().enumerate() {
        assert_eq!(l.is_finite(), t as u32 == EOS, "token {t}");
    }
    // A rejected token: the rows after it are left alone (never used) and nothing fails.
    assert_eq!(m.allowed(&p(&[0])), None);
    let mut row = vec![1.0f32; VOCAB];
    m.apply(&p(&[0, 1]), &mut row);
    assert!(row.iter().all(|&l| l == 1.0));
    // Forced tokens: `{` at the start, `b` after `{a`.
    assert_eq!(m.forced_tokens(&p(&[])), vec![4]);
    assert_eq!(m.forced_tokens(&p(&[4, 0])), vec![1]);
    assert!(m.fault().is_none());
    // The grammar's prompt tokens are not constrained.
    let mut row = vec![1.0f32; VOCAB];
    m.apply(&PROMPT[..3], &mut row);
    assert!(row.iter().all(|&l| l == 1.0));
}

#[test]
fn a_bad_grammar_is_a_typed_error() {
    let e = GrammarMask::lark(&vocab(), "start: (", 0).unwrap_err();
    assert!(e.to_string().contains("grammar"), "{e}");
    assert!(Grammar::json_schema_str("{nope").is_err());
    assert!(Vocabulary::greedy(vec![b"a".to_vec()], vec![], 3).is_err());
    assert!(Vocabulary::greedy(vec![], vec![], 0).is_err());
}

fn params(cfg: SamplingConfig, seed: u64, k: usize) -> GenerationParams {
    GenerationParams::builder()
        .sampling(cfg)
        .seed(seed)
        .max_new_tokens(LEN)
        .draft(if k == 0 {
            DraftLength::Off
        } else {
            DraftLength::Fixed(k)
        })
        .stop(StopConditions::eos(EOS))
        .build()
        .unwrap()
}

#[test]
fn greedy_constrained_speculation_equals_plain_constrained_greedy() {
    for seed in 0..20u64 {
        let t = || ToyModel::markov(VOCAB, 3, 2.0, 100 + seed).with_tree(16);
        let m = mask();
        let cfg = SamplingConfig::builder().mask(m.clone()).build().unwrap();
        let pp = params(cfg.clone(), 0, 0)
            .to_builder()
            .max_new_tokens(24)
            .build()
            .unwrap();
        let want = Generator::new(t(), speculative::NoProposer)
            .generate(&PROMPT, &pp)
            .unwrap()
            .tokens;
        let re = regex_lite_check(&want);
        assert!(re, "plain constrained output {want:?} does not match");
        let props: Vec<Box<dyn Proposer>> = vec![
            Box::new(PromptLookup::new(1, 4).unwrap()),
            Box::new(ForcedDrafts::new(
                m.clone(),
                PromptLookup::new(1, 4).unwrap(),
            )),
            Box::new(RandomProposer::new(VOCAB, seed)),
            Box::new(ForcedDrafts::new(
                m.clone(),
                RandomProposer::new(VOCAB, seed),
            )),
            Box::new(DraftModelProposer::new(draft_model())),
        ];
        for p in props {
            let name = p.name();
            let mut g = Generator::new(t(), p);
            let sp = params(cfg.clone(), 0, 4)
                .to_builder()
                .max_new_tokens(24)
                .build()
                .unwrap();
            assert_eq!(g.generate(&PROMPT, &sp).unwrap().tokens, want, "{name}");
            let sp = sp.with_tree(TreeDrafts::nodes(8));
            assert_eq!(
                g.generate(&PROMPT, &sp).unwrap().tokens,
                want,
                "{name} (tree)"
            );
        }
    }
}

/// `true` when `out` (generated tokens, maybe ending in EOS) matches [`REGEX`] completely
/// (ending in EOS) or is a prefix of a match (cut by the token budget).
fn regex_lite_check(out: &[u32]) -> bool {
    let (body, eos) = match out.split_last() {
        Some((&EOS, b)) => (b, true),
        _ => (out, false),
    };
    let s: String = body.iter().map(|&t| TOKENS[t as usize]).collect();
    let Some(inner) = s.strip_prefix('{') else {
        return s.is_empty() && !eos;
    };
    let (inner, closed) = match inner.strip_suffix('}') {
        Some(i) => (i, true),
        None => (inner, false),
    };
    // `(ab|c)*` then, when open, maybe a dangling `a`.
    let mut rest = inner;
    while let Some(r) = rest.strip_prefix("ab").or_else(|| rest.strip_prefix('c')) {
        rest = r;
    }
    let words_ok = rest.is_empty() || (rest == "a" && !closed);
    if eos || closed {
        words_ok && closed && rest.is_empty() && !inner.is_empty()
    } else {
        words_ok
    }
}

/// Exact processed conditional of the target after `prefix` under `cfg` (its mask included).
fn conditional(cfg: &SamplingConfig, prefix: &[u32]) -> TokenDist {
    let logits = target().logits(prefix);
    let mut d = TokenDist::default();
    RowProcessor::new()
        .distribution(
            cfg,
            &logits,
            &History {
                counts: None,
                prefix,
                suppress: &[],
            },
            RowKind::Target,
            0,
            &mut d,
        )
        .unwrap();
    d
}

/// The exact law of the generated sequences (up to `LEN` tokens, ending at EOS).
fn exact(cfg: &SamplingConfig) -> HashMap<Vec<u32>, f64> {
    fn walk(cfg: &SamplingConfig, ctx: &mut Vec<u32>, pr: f64, out: &mut HashMap<Vec<u32>, f64>) {
        let gen_len = ctx.len() - PROMPT.len();
        if gen_len == LEN {
            out.insert(ctx[PROMPT.len()..].to_vec(), pr);
            return;
        }
        let d = conditional(cfg, ctx);
        for t in 0..VOCAB as u32 {
            let p = d.prob(t) as f64;
            if p == 0.0 {
                continue;
            }
            ctx.push(t);
            if t == EOS {
                out.insert(ctx[PROMPT.len()..].to_vec(), pr * p);
            } else {
                walk(cfg, ctx, pr * p, out);
            }
            ctx.pop();
        }
    }
    let mut out = HashMap::new();
    walk(cfg, &mut PROMPT.to_vec(), 1.0, &mut out);
    out
}

/// G-test p-value of the observed sequences against the exact law; an observed sequence of
/// probability 0 gives p = 0.
fn g_test(counts: &HashMap<Vec<u32>, u64>, law: &HashMap<Vec<u32>, f64>) -> f64 {
    let n: u64 = counts.values().sum();
    if counts.keys().any(|s| !law.contains_key(s)) {
        return 0.0;
    }
    let mut g = 0.0;
    for (s, &p) in law {
        let c = counts.get(s).copied().unwrap_or(0);
        if c > 0 {
            g += 2.0 * c as f64 * (c as f64 / (n as f64 * p)).ln();
        }
    }
    ChiSquared::new((law.len() - 1) as f64).unwrap().sf(g)
}

fn configs() -> Vec<(&'static str, SamplingConfig)> {
    vec![
        ("t=1", SamplingConfig::sampling(1.0).unwrap()),
        (
            "t=0.8 top_k=3",
            SamplingConfig::builder()
                .temperature(0.8)
                .top_k(3)
                .build()
                .unwrap(),
        ),
    ]
}

/// The law of `N` seeded generations with the mask `make_mask()` of each run.
fn law_of<P: Proposer, T: TargetModel>(
    g: &mut Generator<T, P>,
    base: &SamplingConfig,
    make_mask: &dyn Fn() -> Arc<dyn TokenMask>,
    k: usize,
    tree_nodes: usize,
) -> HashMap<Vec<u32>, u64> {
    let mut counts = HashMap::new();
    for seed in 0..N {
        let cfg = rebuild(base, make_mask());
        let p = params(cfg, seed, k).with_tree(TreeDrafts::nodes(tree_nodes));
        let out = g.generate(&PROMPT, &p).unwrap();
        *counts.entry(out.tokens).or_insert(0) += 1;
    }
    counts
}

/// `base` with `mask` as its caller mask.
fn rebuild(base: &SamplingConfig, mask: Arc<dyn TokenMask>) -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(base.temperature())
        .top_k(base.top_k())
        .mask(mask)
        .build()
        .unwrap()
}

/// A wrong mask: it remembers the generated token of every position it was asked about and
/// never forgets a rejected draft: the grammar state of a row is computed from the first
/// token ever seen at each earlier position.
struct LeakyMask {
    inner: Arc<GrammarMask>,
    seen: Mutex<Vec<u32>>,
}

impl TokenMask for LeakyMask {
    fn apply(&self, prefix: &[u32], logits: &mut [f32]) {
        let generated = &prefix[PROMPT.len()..];
        let mut seen = self.seen.lock().unwrap();
        for (i, &t) in generated.iter().enumerate() {
            if i >= seen.len() {
                seen.push(t);
            }
        }
        let stale = [&PROMPT[..], &seen[..generated.len()]].concat();
        self.inner.apply(&stale, logits);
    }
}

fn check(name: &str, g: &mut Generator<ToyModel, Box<dyn Proposer>>, k: usize, tree: usize) {
    let shared = mask();
    for (cname, base) in configs() {
        let law = exact(&rebuild(&base, mask()));
        let m = shared.clone();
        let counts = law_of(g, &base, &move || m.clone(), k, tree);
        let p = g_test(&counts, &law);
        eprintln!("{name} with {cname}: p = {p:.3} ({} sequences)", law.len());
        assert!(p > ALPHA, "{name} with {cname}: p = {p:.2e} <= alpha");
    }
}

#[test]
fn plain_constrained_sampling_matches_the_exact_law() {
    let mut g: Generator<ToyModel, Box<dyn Proposer>> =
        Generator::new(target(), Box::new(speculative::NoProposer));
    check("no proposer", &mut g, 0, 0);
}

#[test]
fn constrained_speculation_is_lossless() {
    let m = mask();
    let cases: Vec<(&str, Box<dyn Proposer>, usize)> = vec![
        (
            "prompt lookup",
            Box::new(PromptLookup::new(1, 3).unwrap()),
            0,
        ),
        ("random drafts", Box::new(RandomProposer::new(VOCAB, 3)), 0),
        (
            "forced + prompt lookup",
            Box::new(ForcedDrafts::new(
                m.clone(),
                PromptLookup::new(1, 3).unwrap(),
            )),
            0,
        ),
        (
            "forced + random (chains)",
            Box::new(ForcedDrafts::new(m.clone(), RandomProposer::new(VOCAB, 5))),
            0,
        ),
        (
            "forced + random (trees)",
            Box::new(ForcedDrafts::new(m.clone(), RandomProposer::new(VOCAB, 5))),
            6,
        ),
        (
            "draft model",
            Box::new(DraftModelProposer::new(draft_model())),
            0,
        ),
        (
            "forced + draft model (one-hot q rows)",
            Box::new(ForcedDrafts::new(
                m.clone(),
                DraftModelProposer::new(draft_model()),
            )),
            0,
        ),
    ];
    for (name, p, tree) in cases {
        let mut g = Generator::new(target().with_tree(16), p);
        check(name, &mut g, 3, tree);
    }
}

#[test]
fn a_mask_left_advanced_by_rejected_drafts_is_detected() {
    let shared = mask();
    let (_, base) = &configs()[0];
    let law = exact(&rebuild(base, mask()));
    // A draft model processes its draft rows after drafts that the verifier then rejects
    // (point-mass drafts are verified row by row and the rows after a rejection never reach
    // the mask), so the leak shows.
    let mut g = Generator::new(target(), DraftModelProposer::new(draft_model()));
    let make = move || -> Arc<dyn TokenMask> {
        Arc::new(LeakyMask {
            inner: shared.clone(),
            seen: Mutex::new(Vec::new()),
        })
    };
    let counts = law_of(&mut g, base, &make, 3, 0);
    let p = g_test(&counts, &law);
    eprintln!("negative control (leaky mask): p = {p:.2e}");
    assert!(p < ALPHA, "the leaky mask was not detected: p = {p:.3}");
}
