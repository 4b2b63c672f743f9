//! Draft models with another vocabulary than the target's ([`CrossVocabProposer`], issue 31).
//!
//! Two toy byte-level vocabularies overlap partially: the target has the merged tokens "ab",
//! "ba", "cd", "abc" that the draft lacks, the draft has "bc", "dd" that the target lacks; both
//! have "a" .. "d" and an EOS (paired). Both toy models score a token by the bytes it adds to
//! the text (the same byte-pair table; the draft adds noise), so the draft is a decent guesser
//! of the target whatever the token boundaries.
//!
//! - Greedy identity, both modes: the output equals plain greedy decoding of the target.
//! - Cache in step: at every proposal the draft context is the draft tokenisation of the
//!   context's text (re-encoding) or the per-token translation, and the draft model's sequence
//!   starts with it; every draft id is a target id (TLI: inside the intersection, q rows
//!   `[k, target_vocab]` summing to 1 with zeros outside).
//! - Statistics (GUIDE section 2): the first two emitted tokens of sampled generations (TLI)
//!   against the exact processed target law, Pearson chi-square (`common::chi_square`, cells
//!   below 5 expected pooled) at alpha = 1e-3 with fixed seeds `0..N`; the negative control
//!   (q handed to the verifier over the draft's ids, unmapped, while the
//!   draft samples from TLI's q over target ids) must be rejected at the same alpha. (q not
//!   renormalised over the intersection is refused by the verifier outright: its rows must sum
//!   to 1.)

mod common;

use std::sync::Arc;

use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions};
use speculative::propose::{
    BytesEncoder, ContextSync, CrossVocabConfig, CrossVocabMode, CrossVocabProposer, VocabMap,
};
use speculative::test_util::ToyModel;
use speculative::{Draft, ProposeRequest, Proposer, Result, SamplingConfig};

const TARGET: [&str; 9] = ["a", "b", "c", "d", "ab", "ba", "cd", "abc", "</s>"];
const T_EOS: u32 = 8;
const DRAFT: [&str; 7] = ["b", "a", "d", "c", "bc", "dd", "<eos>"];
const D_EOS: u32 = 6;
const ALPHA: f64 = 1e-3;

fn map() -> Arc<VocabMap> {
    Arc::new(
        VocabMap::builder()
            .target_pieces(TARGET)
            .draft_pieces(DRAFT)
            .pair_special(D_EOS, T_EOS)
            .build()
            .unwrap(),
    )
}

/// Leftmost-longest encoding over the ordinary pieces (an independent toy tokenizer).
fn encode(pieces: &[&str], specials: &[u32], bytes: &[u8]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let best = (0..pieces.len() as u32)
            .filter(|t| !specials.contains(t))
            .filter(|&t| bytes[i..].starts_with(pieces[t as usize].as_bytes()))
            .max_by_key(|&t| (pieces[t as usize].len(), std::cmp::Reverse(t)))
            .expect("every byte is a piece");
        out.push(best);
        i += pieces[best as usize].len();
    }
    out
}

fn draft_encoder() -> Arc<dyn BytesEncoder> {
    Arc::new(|b: &[u8]| -> Result<Vec<u32>> { Ok(encode(&DRAFT, &[D_EOS], b)) })
}

fn target_encoder() -> Arc<dyn BytesEncoder> {
    Arc::new(|b: &[u8]| -> Result<Vec<u32>> { Ok(encode(&TARGET, &[T_EOS], b)) })
}

fn text(pieces: &[&str], special: u32, tokens: &[u32]) -> Vec<u8> {
    tokens
        .iter()
        .filter(|&&t| t != special)
        .flat_map(|&t| pieces[t as usize].bytes())
        .collect()
}

/// Score of byte `b` after byte `prev` (0 at the start of the text).
fn pair_score(prev: u8, b: u8) -> f32 {
    let h = (prev as u32).wrapping_mul(2_654_435_761) ^ (b as u32).wrapping_mul(40_503);
    let h = h ^ (h >> 13);
    ((h % 1000) as f32 / 1000.0 - 0.5) * 3.0
}

/// Logits of every piece after `text`: the sum of the pair scores of the bytes it adds; EOS
/// grows likelier with the length.
fn text_logits(pieces: &[&str], eos: u32, text: &[u8], noise: u64) -> Vec<f32> {
    let last = text.last().copied().unwrap_or(0);
    (0..pieces.len() as u32)
        .map(|t| {
            let n = if noise == 0 {
                0.0
            } else {
                let h = (text.len() as u64 * 31 + t as u64).wrapping_mul(noise) >> 7;
                ((h % 100) as f32 / 100.0 - 0.5) * 0.8
            };
            if t == eos {
                return -2.5 + 0.15 * text.len() as f32 + n;
            }
            let mut prev = last;
            let mut s = 0.0;
            for b in pieces[t as usize].bytes() {
                s += pair_score(prev, b);
                prev = b;
            }
            s + n
        })
        .collect()
}

fn target() -> ToyModel {
    ToyModel::new(
        TARGET.len(),
        4096,
        Arc::new(|p: &[u32]| text_logits(&TARGET, T_EOS, &text(&TARGET, T_EOS, p), 0)),
    )
}

fn draft_model() -> ToyModel {
    ToyModel::new(
        DRAFT.len(),
        4096,
        Arc::new(|p: &[u32]| {
            text_logits(
                &DRAFT,
                D_EOS,
                &text(&DRAFT, D_EOS, p),
                0x9E37_79B9_7F4A_7C15,
            )
        }),
    )
}

fn tli() -> CrossVocabProposer<ToyModel> {
    CrossVocabProposer::tli(draft_model(), map(), draft_encoder()).unwrap()
}

fn retok() -> CrossVocabProposer<ToyModel> {
    CrossVocabProposer::retokenizing(draft_model(), map(), draft_encoder(), target_encoder())
        .unwrap()
}

const PROMPTS: [&[u32]; 4] = [&[0, 1, 2], &[4, 3, 6, 1], &[7], &[2, 2, 5, 0, 1, 3, 4]];

fn greedy(n: usize, k: usize) -> GenerationParams {
    GenerationParams::greedy(n)
        .with_draft(DraftLength::Fixed(k))
        .with_stop(StopConditions::eos(T_EOS))
        .unwrap()
}

/// The draft context the proposer must hold for `ctx`, computed from the definitions.
fn expected_draft_context(ctx: &[u32], sync: ContextSync) -> Vec<u32> {
    let m = map();
    match sync {
        ContextSync::PerToken => ctx
            .iter()
            .flat_map(|&t| {
                if t == T_EOS {
                    vec![D_EOS]
                } else if let Some(d) = m.to_draft(t) {
                    vec![d]
                } else {
                    encode(&DRAFT, &[D_EOS], TARGET[t as usize].as_bytes())
                }
            })
            .collect(),
        ContextSync::Reencode { .. } => {
            // Runs of text between EOS tokens, each encoded whole.
            let mut out = Vec::new();
            for (i, run) in ctx.split(|&t| t == T_EOS).enumerate() {
                if i > 0 {
                    out.push(D_EOS);
                }
                out.extend(encode(&DRAFT, &[D_EOS], &text(&TARGET, T_EOS, run)));
            }
            out
        }
    }
}

/// Checks every proposal of the wrapped proposer (see the module docs).
struct Checked {
    inner: CrossVocabProposer<ToyModel>,
    proposals: usize,
    drafted: usize,
}

impl Checked {
    fn new(inner: CrossVocabProposer<ToyModel>) -> Self {
        Checked {
            inner,
            proposals: 0,
            drafted: 0,
        }
    }
}

impl Proposer for Checked {
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.inner.begin(prompt)
    }

    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose(req, draft)?;
        self.proposals += 1;
        self.drafted += draft.len();
        let want = expected_draft_context(req.context, self.inner.config().sync);
        assert_eq!(
            self.inner.draft_context(),
            &want[..],
            "ctx {:?}",
            req.context
        );
        let held = self.inner.model().tokens();
        assert!(
            held.starts_with(&want),
            "draft model holds {held:?}, want {want:?}.."
        );
        assert!(held.len() <= want.len() + req.max_draft + 1);
        assert!(draft.len() <= req.max_draft);
        let m = self.inner.map();
        for &t in &draft.tokens {
            assert!(
                (t as usize) < TARGET.len(),
                "draft id {t} outside the target"
            );
        }
        if self.inner.last_mode() == Some(CrossVocabMode::Tli) {
            for &t in &draft.tokens {
                assert!(
                    m.to_draft(t).is_some(),
                    "TLI draft {t} outside the intersection"
                );
            }
            if let Some(q) = &draft.q {
                assert_eq!(draft.q_vocab, TARGET.len());
                assert_eq!(q.len(), draft.len() * TARGET.len());
                for (i, row) in q.chunks(TARGET.len()).enumerate() {
                    let s: f64 = row.iter().map(|&x| x as f64).sum();
                    assert!((s - 1.0).abs() < 1e-5, "row {i} sums to {s}");
                    for (t, &x) in row.iter().enumerate() {
                        if m.to_draft(t as u32).is_none() {
                            assert_eq!(x, 0.0, "q outside the intersection");
                        }
                    }
                    assert!(row[draft.tokens[i] as usize] > 0.0);
                }
            }
        }
        Ok(())
    }

    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.inner.observe(accepted, emitted)
    }
}

fn configs_for_sync() -> [CrossVocabConfig; 3] {
    [
        CrossVocabConfig::default(),
        CrossVocabConfig::default().with_sync(ContextSync::PerToken),
        CrossVocabConfig::default().with_sync(ContextSync::Reencode { look_behind: 2 }),
    ]
}

fn check_greedy_identity(make: impl Fn() -> CrossVocabProposer<ToyModel>, name: &str) {
    let (mut accepted, mut proposed, mut emitted, mut outside) = (0, 0, 0, 0);
    for cfg in configs_for_sync() {
        for prompt in PROMPTS {
            for k in [1, 3, 5] {
                let plain = Generator::new(target(), speculative::NoProposer)
                    .generate(prompt, &greedy(40, 0))
                    .unwrap();
                let p = Checked::new(make().with_config(cfg).unwrap());
                let mut g = Generator::new(target(), p);
                let out = g.generate(prompt, &greedy(40, k)).unwrap();
                assert_eq!(out.tokens, plain.tokens, "{name} {prompt:?} k {k} {cfg:?}");
                assert_eq!(out.finish, plain.finish);
                accepted += out.metrics.accepted;
                proposed += out.metrics.proposed;
                emitted += out.tokens.len();
                outside += out
                    .tokens
                    .iter()
                    .filter(|&&t| map().to_draft(t).is_none())
                    .count();
            }
        }
    }
    eprintln!(
        "{name}: {accepted} of {proposed} drafts accepted; {outside} of {emitted} emitted tokens outside the intersection"
    );
    assert!(accepted > 0, "{name}: no draft was ever accepted");
}

#[test]
fn greedy_tli_equals_plain_greedy() {
    check_greedy_identity(tli, "tli");
}

#[test]
fn greedy_retokenized_equals_plain_greedy() {
    check_greedy_identity(retok, "retokenize");
}

/// The re-tokenising mode drafts the merged target tokens TLI cannot reach.
#[test]
fn retokenized_drafts_reach_tokens_outside_the_intersection() {
    let m = map();
    let mut outside = 0;
    for prompt in PROMPTS {
        let mut p = retok();
        let cfg = SamplingConfig::greedy();
        let mut ctx = prompt.to_vec();
        for _ in 0..10 {
            let mut d = Draft::default();
            p.propose(&ProposeRequest::new(&ctx, &cfg, 4), &mut d)
                .unwrap();
            assert_eq!(p.last_mode(), Some(CrossVocabMode::Retokenize));
            assert!(d.q.is_none());
            outside += d
                .tokens
                .iter()
                .filter(|&&t| m.to_draft(t).is_none())
                .count();
            // Follow the target's greedy continuation.
            let l = target().logits(&ctx);
            let best = (0..l.len())
                .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
                .unwrap();
            if best as u32 == T_EOS {
                break;
            }
            ctx.push(best as u32);
        }
    }
    assert!(outside > 0);
}

#[test]
fn sampling_requests_in_the_retokenizing_mode_use_tli() {
    let mut p = retok();
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    let mut d = Draft::default();
    p.propose(&ProposeRequest::new(&[0, 1, 2], &cfg, 3), &mut d)
        .unwrap();
    assert_eq!(p.mode(), CrossVocabMode::Retokenize);
    assert_eq!(p.last_mode(), Some(CrossVocabMode::Tli));
    assert_eq!(d.q.as_ref().map(Vec::len), Some(d.len() * TARGET.len()));
}

#[test]
fn suppressed_ids_are_never_drafted_on_their_rows() {
    // EOS is suppressed on the first rows; a long context makes EOS the draft's favourite.
    let ctx: Vec<u32> = (0..40).map(|i| [0, 1, 2, 3][i % 4]).collect();
    let ban = [T_EOS];
    for make in [tli as fn() -> _, retok] {
        for cfg in [
            SamplingConfig::greedy(),
            SamplingConfig::sampling(1.0).unwrap(),
        ] {
            for seed in 0..20 {
                let req = ProposeRequest::new(&ctx, &cfg, 4)
                    .seed(seed)
                    .eos(&ban)
                    .suppress(&ban, 2);
                let mut d = Draft::default();
                make().propose(&req, &mut d).unwrap();
                assert!(!d.tokens.iter().take(2).any(|&t| t == T_EOS), "{d:?}");
            }
            // Without the ban the draft does end at EOS.
            let req = ProposeRequest::new(&ctx, &cfg, 4).eos(&ban);
            let mut d = Draft::default();
            make().propose(&req, &mut d).unwrap();
            assert!(d.tokens.contains(&T_EOS), "{d:?}");
            assert_eq!(d.tokens.last(), Some(&T_EOS));
        }
    }
}

#[test]
fn stale_state_equals_a_fresh_proposer() {
    let a: Vec<u32> = vec![0, 4, 1, 6, 2, 7, 3, 5, 0];
    let mut b = a.clone();
    b.extend([4, 4, 2]);
    let c = a[..4].to_vec();
    let d = vec![7, T_EOS, 1, 2, 3];
    for cfg in configs_for_sync() {
        for sampling in [
            SamplingConfig::greedy(),
            SamplingConfig::sampling(0.9).unwrap(),
        ] {
            let mut p = retok().with_config(cfg).unwrap();
            for ctx in [&a, &b, &c, &a, &d, &b] {
                let req = ProposeRequest::new(ctx, &sampling, 4).seed(5);
                let (mut x, mut y) = (Draft::default(), Draft::default());
                p.propose(&req, &mut x).unwrap();
                retok()
                    .with_config(cfg)
                    .unwrap()
                    .propose(&req, &mut y)
                    .unwrap();
                assert_eq!(x, y, "{ctx:?} {cfg:?}");
                assert_eq!(
                    p.draft_context(),
                    &expected_draft_context(ctx, cfg.sync)[..]
                );
            }
        }
    }
}

/// A random walk of contexts (extensions, rollbacks of any depth, EOS tokens inside): the
/// incremental translation always equals the one computed from scratch.
#[test]
fn translation_follows_any_walk_of_contexts() {
    let cfg = SamplingConfig::greedy();
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    for sync in configs_for_sync() {
        let mut p = tli().with_config(sync).unwrap();
        let mut ctx: Vec<u32> = vec![0];
        for _ in 0..400 {
            if next(3) == 0 {
                let keep = 1 + next(ctx.len() as u64) as usize;
                ctx.truncate(keep);
            } else {
                for _ in 0..1 + next(4) {
                    ctx.push(next(TARGET.len() as u64) as u32);
                }
            }
            let mut d = Draft::default();
            p.propose(&ProposeRequest::new(&ctx, &cfg, 2), &mut d)
                .unwrap();
            let want = expected_draft_context(&ctx, sync.sync);
            assert_eq!(p.draft_context(), &want[..], "{ctx:?} {sync:?}");
            assert!(p.model().tokens().starts_with(&want));
        }
    }
}

#[test]
fn encoder_that_breaks_its_contract_is_an_error() {
    let bad: Arc<dyn BytesEncoder> = Arc::new(|_: &[u8]| -> Result<Vec<u32>> { Ok(vec![0]) });
    let mut p = CrossVocabProposer::tli(draft_model(), map(), bad).unwrap();
    let cfg = SamplingConfig::greedy();
    let mut d = Draft::default();
    let err = p
        .propose(&ProposeRequest::new(&[4, 4], &cfg, 2), &mut d)
        .unwrap_err();
    assert!(matches!(err, speculative::Error::Proposer(_)), "{err}");
    // A context id outside the target vocabulary.
    let mut p = tli();
    let err = p
        .propose(&ProposeRequest::new(&[0, 99], &cfg, 2), &mut d)
        .unwrap_err();
    assert!(
        matches!(err, speculative::Error::TokenOutOfVocab { token: 99, .. }),
        "{err}"
    );
    // A draft model narrower than the map's draft pieces.
    let narrow = ToyModel::c10();
    let narrow = ToyModel::new(
        3,
        64,
        Arc::new(move |p: &[u32]| narrow.logits(p)[..3].to_vec()),
    );
    assert!(CrossVocabProposer::tli(narrow, map(), draft_encoder()).is_err());
    assert!(
        tli()
            .with_config(CrossVocabConfig::default().with_extra_draft_tokens(65))
            .is_err()
    );
}

// ---- Statistics ----

const N: u64 = 20_000;
const PROMPT: [u32; 4] = [0, 4, 2, 3];
/// Cell of "no second token" (the first was EOS).
const NONE: usize = TARGET.len();

fn sampled_configs() -> Vec<(&'static str, SamplingConfig)> {
    vec![
        ("t=1", SamplingConfig::sampling(1.0).unwrap()),
        (
            "t=0.7 top_p=0.9 top_k=5",
            SamplingConfig::builder()
                .temperature(0.7)
                .top_p(0.9)
                .top_k(5)
                .build()
                .unwrap(),
        ),
        (
            "t=1.2 repetition=1.4 min_p=0.05",
            SamplingConfig::builder()
                .temperature(1.2)
                .repetition_penalty(1.4)
                .min_p(0.05)
                .build()
                .unwrap(),
        ),
    ]
}

/// Exact law of the first two emitted tokens, cells `t0 * (V + 1) + t1` (`t1 = V`: none).
fn exact(cfg: &SamplingConfig) -> Vec<f64> {
    let v = TARGET.len();
    let t = target();
    let row = |prefix: &[u32]| {
        let d = common::process(cfg, &t.logits(prefix), prefix, v).unwrap();
        (0..v as u32).map(|x| d.prob(x) as f64).collect::<Vec<_>>()
    };
    let mut out = vec![0.0; v * (v + 1)];
    let p0 = row(&PROMPT);
    for a in 0..v {
        if p0[a] == 0.0 {
            continue;
        }
        if a as u32 == T_EOS {
            out[a * (v + 1) + NONE] = p0[a];
            continue;
        }
        let mut ctx = PROMPT.to_vec();
        ctx.push(a as u32);
        let p1 = row(&ctx);
        for b in 0..v {
            out[a * (v + 1) + b] = p0[a] * p1[b];
        }
    }
    out
}

fn counts<P: Proposer>(mut g: Generator<ToyModel, P>, cfg: &SamplingConfig) -> Vec<u64> {
    let v = TARGET.len();
    let mut c = vec![0u64; v * (v + 1)];
    for seed in 0..N {
        let params = GenerationParams::sampled(cfg.clone(), seed, 2)
            .with_draft(DraftLength::Fixed(3))
            .with_stop(StopConditions::eos(T_EOS))
            .unwrap();
        let out = g.generate(&PROMPT, &params).unwrap();
        let a = out.tokens[0] as usize;
        let b = out.tokens.get(1).map_or(NONE, |&t| t as usize);
        c[a * (v + 1) + b] += 1;
    }
    c
}

#[test]
fn tli_sampling_is_lossless() {
    for (name, cfg) in sampled_configs() {
        let c = counts(Generator::new(target(), tli()), &cfg);
        let fit = common::chi_square(&c, &exact(&cfg));
        eprintln!(
            "TLI {name}: chi2 = {:.2}, df = {}, p = {:.3}",
            fit.stat, fit.df, fit.p_value
        );
        assert!(fit.p_value > ALPHA, "TLI {name}: p = {:.2e}", fit.p_value);
    }
    // The same test passes for plain sampling (the reference law is right).
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    let c = counts(Generator::new(target(), speculative::NoProposer), &cfg);
    let fit = common::chi_square(&c, &exact(&cfg));
    eprintln!("plain t=1: chi2 = {:.2}, p = {:.3}", fit.stat, fit.p_value);
    assert!(fit.p_value > ALPHA);
}

/// The first negative control's fault: the draft samples from TLI's q, but the verifier is
/// handed the draft's full distribution restricted to the intersection *without* renormalising
/// it (the mass of the draft-only tokens "bc", "dd" is lost). The verifier refuses such a q
/// outright (its rows must sum to 1), so the generation fails instead of drifting.
struct UnnormalisedQ(CrossVocabProposer<ToyModel>);

impl Proposer for UnnormalisedQ {
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.0.begin(prompt)
    }

    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.propose(req, draft)?;
        let Some(q) = draft.q.as_mut() else {
            return Ok(());
        };
        let m = map();
        let model = draft_model();
        let mut dctx = self.0.draft_context().to_vec();
        let v = TARGET.len();
        for (i, &t) in draft.tokens.iter().enumerate() {
            // Temperature 1, no filter: the control runs with t=1 only.
            let l = model.logits(&dctx);
            let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
            let row = &mut q[i * v..(i + 1) * v];
            row.iter_mut().for_each(|x| *x = 0.0);
            for &(d, tt) in m.pairs() {
                row[tt as usize] += ((l[d as usize] as f64).exp() / z) as f32;
            }
            dctx.push(m.to_draft(t).unwrap());
        }
        Ok(())
    }
}

#[test]
fn unnormalised_q_is_refused_by_the_verifier() {
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    let mut g = Generator::new(target(), UnnormalisedQ(tli()));
    let refused = (0..50)
        .filter(|&seed| {
            let params = GenerationParams::sampled(cfg.clone(), seed, 4);
            matches!(
                g.generate(&PROMPT, &params),
                Err(e) if matches!(e.error, speculative::Error::InvalidDraftProbs { .. })
            )
        })
        .count();
    assert_eq!(refused, 50);
}

/// The statistical negative control's fault: q handed over the *draft* vocabulary, unmapped
/// (row entry `x` is the draft's probability of draft id `x`, a valid distribution that sums
/// to 1, but over the wrong ids), while the draft token is sampled from TLI's q over target
/// ids. A row whose entry for its drafted token is 0 (the verifier would refuse it) ends the
/// draft before it.
struct UnmappedQ(CrossVocabProposer<ToyModel>);

impl Proposer for UnmappedQ {
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.0.begin(prompt)
    }

    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.0.propose(req, draft)?;
        let Some(q) = draft.q.as_mut() else {
            return Ok(());
        };
        let m = map();
        let v = TARGET.len();
        let mut keep = draft.tokens.len();
        for (i, row) in q.chunks_mut(v).enumerate() {
            let mut by_draft = vec![0.0f32; v];
            for &(d, t) in m.pairs() {
                by_draft[d as usize] = row[t as usize];
            }
            row.copy_from_slice(&by_draft);
            if row[draft.tokens[i] as usize] == 0.0 && keep > i {
                keep = i;
            }
        }
        draft.tokens.truncate(keep);
        q.truncate(keep * v);
        if keep == 0 {
            draft.q = None;
            draft.q_vocab = 0;
        }
        Ok(())
    }
}

#[test]
fn negative_control_unmapped_q_is_rejected() {
    let cfg = SamplingConfig::sampling(1.0).unwrap();
    let c = counts(Generator::new(target(), UnmappedQ(tli())), &cfg);
    let fit = common::chi_square(&c, &exact(&cfg));
    eprintln!(
        "negative control (q over draft ids, unmapped): chi2 = {:.2}, df = {}, p = {:.3e}",
        fit.stat, fit.df, fit.p_value
    );
    assert!(
        fit.p_value < ALPHA,
        "the unmapped q was not detected: p = {:.3}",
        fit.p_value
    );
}

/// A cross-vocabulary draft drafts from the context's tokens alone, so the loop feeds a new
/// prompt in the first step's verify forward (a fused prefill) with it too: same output as plain
/// greedy decoding, and the prompt's tokens counted as fused rather than prefilled.
#[test]
fn cross_vocab_drafts_allow_a_fused_prefill() {
    for (name, make) in [("tli", tli as fn() -> _), ("retokenize", retok)] {
        assert!(make().drafts_from_tokens(), "{name}");
        for prompt in PROMPTS.iter().filter(|p| p.len() > 1) {
            let plain = Generator::new(target(), speculative::NoProposer)
                .generate(prompt, &greedy(30, 0))
                .unwrap();
            let mut g = Generator::new(target(), make()).with_fused_prefill(true);
            let out = g.generate(prompt, &greedy(30, 3)).unwrap();
            assert_eq!(out.tokens, plain.tokens, "{name} {prompt:?}");
            assert_eq!(out.metrics.prompt_tokens_fused, prompt.len() - 1, "{name}");
        }
    }
}
