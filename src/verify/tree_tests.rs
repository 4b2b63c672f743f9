//! Unit tests of tree verification on small hand-made and random trees: greedy descent, the
//! point-mass rule's seeded equality with plain sampling (C15 for trees), the sampled schemes'
//! residual updates, histories of ancestors only, and every validation error.

use super::*;
use crate::error::{Error, Result, RowKind};
use crate::rng::Stream;
use crate::sampling::{RowProcessor, SamplingConfig, TokenDist};
use crate::tree::{DraftBlock, SiblingScheme, TreeFault};
use std::sync::Arc;

/// A small deterministic generator for the random trees (the tests' own, not the crate's stream).
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The toy target: logits of the token after `prefix`, a hash of the prefix with one favoured
/// token (so that drafts are often right).
fn target(prefix: &[u32], vocab: usize) -> Vec<f32> {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for &t in prefix {
        h = (h ^ t as u64).wrapping_mul(0x100_0000_01B3);
    }
    let mut g = Gen(h);
    let fav = g.below(vocab);
    (0..vocab)
        .map(|v| (g.below(1000) as f32 / 250.0 - 2.0) + if v == fav { 2.5 } else { 0.0 })
        .collect()
}

/// The favoured token after `prefix`.
fn favoured(prefix: &[u32], vocab: usize) -> u32 {
    let l = target(prefix, vocab);
    (0..vocab)
        .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
        .unwrap() as u32
}

/// Target logits `[n + 1, vocab]` of a tree after `ctx`: row 0 after the context, row `i + 1`
/// after node `i`'s path.
fn tree_logits(tokens: &[u32], parents: &[u32], ctx: &[u32], vocab: usize) -> Vec<f32> {
    let block = DraftBlock::tree(tokens, parents);
    let mut out = target(ctx, vocab);
    let mut nodes = Vec::new();
    for i in 0..tokens.len() {
        block.path_to(i, &mut nodes);
        let mut prefix = ctx.to_vec();
        prefix.extend(nodes.iter().map(|&n| tokens[n as usize]));
        out.extend(target(&prefix, vocab));
    }
    out
}

/// A random tree of up to `max_nodes` nodes whose sibling groups hold distinct tokens; about
/// half of the nodes carry the favoured token of their prefix.
fn random_tree(g: &mut Gen, vocab: usize, ctx: &[u32], max_nodes: usize) -> (Vec<u32>, Vec<u32>) {
    let n = g.below(max_nodes + 1);
    let (mut tokens, mut parents): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
    let mut nodes = Vec::new();
    for _ in 0..n {
        let i = tokens.len();
        let parent = g.below(i + 1) as u32;
        let mut prefix = ctx.to_vec();
        if parent > 0 {
            DraftBlock::tree(&tokens, &parents).path_to(parent as usize - 1, &mut nodes);
            prefix.extend(nodes.iter().map(|&n| tokens[n as usize]));
        }
        let taken: Vec<u32> = (0..i)
            .filter(|&j| parents[j] == parent)
            .map(|j| tokens[j])
            .collect();
        if taken.len() >= vocab {
            continue;
        }
        let mut t = if g.below(2) == 0 {
            favoured(&prefix, vocab)
        } else {
            g.below(vocab) as u32
        };
        while taken.contains(&t) {
            t = (t + 1) % vocab as u32;
        }
        tokens.push(t);
        parents.push(parent);
    }
    (tokens, parents)
}

/// The rows of a tree forward (`logits`, `[n + 1, vocab]`) that a verify step over the block
/// with `ends` reads: all, or all but the last for a chain-shaped tree whose final node ends.
fn verify_rows(mut logits: Vec<f32>, tokens: &[u32], parents: &[u32], ends: &[bool]) -> Vec<f32> {
    let rows = DraftBlock::tree(tokens, parents)
        .with_ends(ends)
        .verify_rows();
    logits.truncate(logits.len() / (tokens.len() + 1) * rows);
    logits
}

/// Leaves of a tree, each marked as an end with probability 1/4.
fn random_ends(g: &mut Gen, parents: &[u32]) -> Vec<bool> {
    let n = parents.len();
    (0..n)
        .map(|i| !parents.contains(&(i as u32 + 1)) && g.below(4) == 0)
        .collect()
}

/// Plain decoding of `n` tokens after `ctx` (no-draft steps), from position `pos0`.
fn plain(
    cfg: &SamplingConfig,
    ctx: &[u32],
    vocab: usize,
    seed: u64,
    pos0: u64,
    n: usize,
) -> Vec<u32> {
    let mut v = Verifier::new();
    let mut prefix = ctx.to_vec();
    for i in 0..n {
        let logits = target(&prefix, vocab);
        let req = VerifyRequest::new(cfg, &logits, vocab, &[])
            .context(&prefix)
            .seed(seed)
            .position(pos0 + i as u64);
        let out = v.verify(&req).unwrap();
        assert_eq!(out.end, StepEnd::NoDraft);
        prefix.push(out.tokens[0]);
    }
    prefix[ctx.len()..].to_vec()
}

/// Checks that `out.path` is a root-to-node path of the tree whose tokens lead `out.tokens`.
fn check_path(out: &StepOutput, tokens: &[u32], parents: &[u32]) {
    assert_eq!(out.path.len(), out.accepted);
    let mut row = 0u32;
    for (d, &node) in out.path.iter().enumerate() {
        assert_eq!(parents[node as usize], row, "path {:?}", out.path);
        assert_eq!(tokens[node as usize], out.tokens[d]);
        row = node + 1;
    }
    let want = out.accepted + (out.end != StepEnd::Ended) as usize;
    assert_eq!(out.tokens.len(), want);
}

fn penalised(temperature: f32) -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(temperature)
        .repetition_penalty(1.6)
        .presence_penalty(0.4)
        .frequency_penalty(0.3)
        .logprobs(2)
        .build()
        .unwrap()
}

// Root -> 0 (1) -> 3 (4); root -> 1 (2) -> 2 (3).
const TOKENS: [u32; 4] = [1, 2, 3, 4];
const PARENTS: [u32; 4] = [0, 0, 2, 1];

/// One-hot-ish greedy rows: row `r` favours `best[r]`.
fn rows_favouring(best: &[u32], vocab: usize) -> Vec<f32> {
    best.iter()
        .flat_map(|&b| (0..vocab).map(move |v| if v as u32 == b { 3.0 } else { 0.0 }))
        .collect()
}

#[test]
fn greedy_descends_into_the_branch_of_the_argmax() {
    let cfg = SamplingConfig::greedy();
    // Row 0 -> 2 (node 1), row 2 (after node 1) -> 3 (node 2), row 3 (after node 2) -> 0.
    let logits = rows_favouring(&[2, 0, 3, 0, 0], 5);
    let req =
        VerifyRequest::new(&cfg, &logits, 5, &TOKENS).draft(DraftBlock::tree(&TOKENS, &PARENTS));
    let out = Verifier::new().verify(&req).unwrap();
    assert_eq!(out.tokens, vec![2, 3, 0]);
    assert_eq!(out.path, vec![1, 2]);
    assert_eq!((out.accepted, out.end), (2, StepEnd::AllAccepted));
    // Row 2 favours 4, which node 1's only child (3) is not: rejected at depth 1.
    let logits = rows_favouring(&[2, 0, 4, 0, 0], 5);
    let req =
        VerifyRequest::new(&cfg, &logits, 5, &TOKENS).draft(DraftBlock::tree(&TOKENS, &PARENTS));
    let out = Verifier::new().verify(&req).unwrap();
    assert_eq!(out.tokens, vec![2, 4]);
    assert_eq!(out.path, vec![1]);
    assert_eq!(out.end, StepEnd::Rejected { index: 1 });
    // Row 0 favours a token no child carries.
    let logits = rows_favouring(&[0, 0, 4, 0, 0], 5);
    let req =
        VerifyRequest::new(&cfg, &logits, 5, &TOKENS).draft(DraftBlock::tree(&TOKENS, &PARENTS));
    let out = Verifier::new().verify(&req).unwrap();
    assert_eq!(
        (out.tokens, out.end),
        (vec![0], StepEnd::Rejected { index: 0 })
    );
}

#[test]
fn an_accepted_ending_node_stops_without_a_bonus() {
    let cfg = SamplingConfig::greedy();
    let logits = rows_favouring(&[2, 0, 3, 0, 0], 5);
    let ends = [false, false, true, false];
    let req = VerifyRequest::new(&cfg, &logits, 5, &TOKENS)
        .draft(DraftBlock::tree(&TOKENS, &PARENTS).with_ends(&ends));
    let out = Verifier::new().verify(&req).unwrap();
    assert_eq!(out.tokens, vec![2, 3]);
    assert_eq!((out.accepted, out.end), (2, StepEnd::Ended));
    let cfg = SamplingConfig::builder().temperature(1.0).build().unwrap();
    let logits: Vec<f32> = [2u32, 0, 3, 0, 0]
        .iter()
        .flat_map(|&b| (0..5).map(move |v| if v == b { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let req = VerifyRequest::new(&cfg, &logits, 5, &TOKENS)
        .draft(DraftBlock::tree(&TOKENS, &PARENTS).with_ends(&ends));
    let out = Verifier::new().verify(&req).unwrap();
    assert_eq!((out.tokens, out.end), (vec![2, 3], StepEnd::Ended));
}

#[test]
fn greedy_trees_equal_plain_greedy_decoding() {
    let mut g = Gen(1);
    let mut v = Verifier::new();
    let mut deep = 0;
    for case in 0..400 {
        let vocab = 2 + g.below(7);
        let cfg = if case % 2 == 0 {
            SamplingConfig::greedy()
        } else {
            penalised(0.0)
        };
        let ctx: Vec<u32> = (0..g.below(4)).map(|_| g.below(vocab) as u32).collect();
        let (tokens, parents) = random_tree(&mut g, vocab, &ctx, 10);
        let ends = random_ends(&mut g, &parents);
        let logits = verify_rows(
            tree_logits(&tokens, &parents, &ctx, vocab),
            &tokens,
            &parents,
            &ends,
        );
        let req = VerifyRequest::new(&cfg, &logits, vocab, &tokens)
            .draft(DraftBlock::tree(&tokens, &parents).with_ends(&ends))
            .context(&ctx);
        let out = v.verify(&req).unwrap();
        check_path(&out, &tokens, &parents);
        assert_eq!(out.tokens, plain(&cfg, &ctx, vocab, 0, 0, out.tokens.len()));
        if let Some(lps) = &out.logprobs {
            assert_eq!(lps.len(), out.tokens.len());
        }
        deep += (out.accepted >= 2) as usize;
    }
    assert!(deep > 40, "the trees must be accepted deep often ({deep})");
}

#[test]
fn point_mass_trees_reproduce_plain_sampling_with_the_same_seed() {
    let mut g = Gen(2);
    let mut v = Verifier::new();
    let mut deep = 0;
    for case in 0..400 {
        let vocab = 2 + g.below(7);
        let cfg = if case % 2 == 0 {
            SamplingConfig::builder().temperature(0.8).build().unwrap()
        } else {
            penalised(1.0)
        };
        let ctx: Vec<u32> = (0..g.below(4)).map(|_| g.below(vocab) as u32).collect();
        let (tokens, parents) = random_tree(&mut g, vocab, &ctx, 10);
        let ends = random_ends(&mut g, &parents);
        let logits = verify_rows(
            tree_logits(&tokens, &parents, &ctx, vocab),
            &tokens,
            &parents,
            &ends,
        );
        let (seed, pos0) = (g.next(), g.below(50) as u64);
        let req = VerifyRequest::new(&cfg, &logits, vocab, &tokens)
            .draft(DraftBlock::tree(&tokens, &parents).with_ends(&ends))
            .context(&ctx)
            .seed(seed)
            .position(pos0);
        let out = v.verify(&req).unwrap();
        check_path(&out, &tokens, &parents);
        let want = plain(&cfg, &ctx, vocab, seed, pos0, out.tokens.len());
        assert_eq!(out.tokens, want, "case {case}");
        // The same tree with dense q but deterministic groups: q rows are not read.
        let q = vec![7.0f32; tokens.len() * vocab];
        let schemes = vec![SiblingScheme::Deterministic; tokens.len()];
        let dense = req
            .draft(req.draft.with_schemes(&schemes))
            .draft_probs(DraftProbs::Probs { probs: &q, vocab });
        assert_eq!(v.verify(&dense).unwrap(), out);
        deep += (out.accepted >= 2) as usize;
    }
    assert!(deep > 30, "the trees must be accepted deep often ({deep})");
}

/// One row of probabilities as logits at temperature 1.
fn log_row(p: &[f64]) -> Vec<f32> {
    p.iter()
        .map(|&x| {
            if x > 0.0 {
                x.ln() as f32
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect()
}

#[test]
fn with_replacement_rejection_replaces_the_target_by_the_residual() {
    // p = (0.5, 0.5, 0), q = (0, 0.5, 0.5). Sibling 2 (p = 0) is always rejected; the residual
    // is norm(max(0, p - q)) = (1, 0, 0), under which sibling 1 is always rejected too, and the
    // emitted token is 0, whatever the seed. Testing sibling 1 against the unmodified p would
    // accept it every time (p(1) / q(1) = 1).
    let cfg = SamplingConfig::builder().temperature(1.0).build().unwrap();
    let mut logits = log_row(&[0.5, 0.5, 0.0]);
    logits.extend([0.0; 6]);
    let q = [0.0f32, 0.5, 0.5, 0.0, 0.5, 0.5];
    let schemes = [SiblingScheme::WithReplacement; 2];
    let mut v = Verifier::new();
    for seed in 0..200 {
        let req = VerifyRequest::new(&cfg, &logits, 3, &[2, 1])
            .draft(DraftBlock::tree(&[2, 1], &[0, 0]).with_schemes(&schemes))
            .draft_probs(DraftProbs::Probs {
                probs: &q,
                vocab: 3,
            })
            .seed(seed);
        let out = v.verify(&req).unwrap();
        assert_eq!(
            (out.tokens, out.end),
            (vec![0], StepEnd::Rejected { index: 0 })
        );
    }
}

#[test]
fn without_replacement_removes_the_rejected_siblings_from_q() {
    // p = (0, 0.3, 0.7), q = (0.5, 0.25, 0.25); siblings 0 then 1. Sibling 0 is always rejected;
    // p_1 = norm(max(0, p - q)) = (0, 0.1, 0.9). With replacement sibling 1 is accepted with
    // p_1(1) / q(1) = 0.4; without, q_1 = (0, 0.5, 0.5) and the ratio is 0.2.
    let cfg = SamplingConfig::builder().temperature(1.0).build().unwrap();
    let mut logits = log_row(&[0.0, 0.3, 0.7]);
    logits.extend([0.0; 6]);
    let q = [0.5f32, 0.25, 0.25, 0.5, 0.25, 0.25];
    let n = 20_000;
    for (scheme, want) in [
        (SiblingScheme::WithReplacement, 0.4),
        (SiblingScheme::WithoutReplacement, 0.2),
    ] {
        let schemes = [scheme; 2];
        let req = VerifyRequest::new(&cfg, &logits, 3, &[0, 1])
            .draft(DraftBlock::tree(&[0, 1], &[0, 0]).with_schemes(&schemes))
            .draft_probs(DraftProbs::Probs {
                probs: &q,
                vocab: 3,
            });
        let mut v = Verifier::new();
        let mut accepted = 0;
        let mut freq = [0.0f64; 3];
        for seed in 0..n {
            let out = v.verify(&req.seed(seed)).unwrap();
            accepted += (out.path == [1]) as u32;
            freq[out.tokens[0] as usize] += 1.0 / n as f64;
        }
        let rate = accepted as f64 / n as f64;
        // 5 standard deviations of a binomial proportion at n = 20,000: about 0.018.
        assert!((rate - want).abs() < 0.018, "{scheme:?}: {rate} vs {want}");
        // Token 0 (p = 0) is never emitted.
        assert_eq!(freq[0], 0.0);
    }
}

#[test]
fn each_sibling_tests_its_acceptance_on_its_own_lane() {
    // As above: sibling 0 is always rejected, sibling 1 is accepted with probability 0.4 (with
    // replacement), on the uniform of lane sibling_accept(1) at the row's position.
    let cfg = SamplingConfig::builder().temperature(1.0).build().unwrap();
    let mut logits = log_row(&[0.0, 0.3, 0.7]);
    logits.extend([0.0; 6]);
    let q = [0.5f32, 0.25, 0.25, 0.5, 0.25, 0.25];
    let req = VerifyRequest::new(&cfg, &logits, 3, &[0, 1])
        .draft(DraftBlock::tree(&[0, 1], &[0, 0]))
        .draft_probs(DraftProbs::Probs {
            probs: &q,
            vocab: 3,
        })
        .position(7);
    let mut v = Verifier::new();
    for seed in 0..300 {
        let out = v.verify(&req.seed(seed)).unwrap();
        let u = Stream::new(seed).uniform(7, crate::rng::lane::sibling_accept(1));
        assert_eq!(out.path == [1], u < 0.4, "seed {seed}: u = {u}, {out:?}");
    }
}

/// `m` siblings drawn from `q` with the test's generator: independently, or without
/// replacement (each draw from q without the earlier ones, renormalised).
fn draw_siblings(g: &mut Gen, q: &[f64], m: usize, without: bool) -> Vec<u32> {
    let mut w = q.to_vec();
    let mut out = Vec::new();
    for _ in 0..m {
        let total: f64 = w.iter().sum();
        let mut u = (g.next() >> 11) as f64 / (1u64 << 53) as f64 * total;
        let mut t = w.len() - 1;
        for (i, &x) in w.iter().enumerate() {
            if u < x {
                t = i;
                break;
            }
            u -= x;
        }
        while w[t] == 0.0 {
            t -= 1;
        }
        out.push(t as u32);
        if without {
            w[t] = 0.0;
        }
    }
    out
}

#[test]
fn every_scheme_emits_the_target_law_at_a_three_sibling_root() {
    let cfg = SamplingConfig::builder().temperature(1.0).build().unwrap();
    let p = [0.1, 0.35, 0.05, 0.3, 0.2];
    let qd = [0.3, 0.1, 0.3, 0.1, 0.2];
    let mut logits = log_row(&p);
    logits.extend([0.0; 15]);
    let q: Vec<f32> = qd.iter().map(|&x| x as f32).cycle().take(15).collect();
    let n = 20_000;
    let mut g = Gen(4);
    let mut v = Verifier::new();
    for scheme in [
        SiblingScheme::WithReplacement,
        SiblingScheme::WithoutReplacement,
        SiblingScheme::Deterministic,
    ] {
        let schemes = [scheme; 3];
        let mut f = [0.0f64; 5];
        for seed in 0..n {
            let toks = match scheme {
                SiblingScheme::WithReplacement => draw_siblings(&mut g, &qd, 3, false),
                SiblingScheme::WithoutReplacement => draw_siblings(&mut g, &qd, 3, true),
                // Point masses: any fixed distinct candidates.
                _ => vec![0, 2, 4],
            };
            let req = VerifyRequest::new(&cfg, &logits, 5, &toks)
                .draft(DraftBlock::tree(&toks, &[0, 0, 0]).with_schemes(&schemes))
                .draft_probs(DraftProbs::Probs {
                    probs: &q,
                    vocab: 5,
                })
                .seed(seed);
            let out = v.verify(&req).unwrap();
            f[out.tokens[0] as usize] += 1.0 / n as f64;
        }
        for (i, (&fi, &pi)) in f.iter().zip(&p).enumerate() {
            let sd = (pi * (1.0 - pi) / n as f64).sqrt();
            assert!(
                (fi - pi).abs() < 5.0 * sd,
                "{scheme:?} token {i}: {fi} vs {pi}"
            );
        }
    }
}

#[test]
fn a_chain_with_one_sibling_per_group_is_the_chain_rule() {
    // The tree walk on a chain given as parents equals the chain request, for every form.
    let mut g = Gen(3);
    let mut v = Verifier::new();
    let cfg = penalised(0.9);
    for _ in 0..200 {
        let vocab = 3 + g.below(5);
        let k = g.below(5);
        let tokens: Vec<u32> = (0..k).map(|_| g.below(vocab) as u32).collect();
        let parents: Vec<u32> = (0..k as u32).collect();
        let logits: Vec<f32> = (0..(k + 1) * vocab)
            .map(|_| g.below(100) as f32 / 25.0)
            .collect();
        let ql: Vec<f32> = (0..k * vocab).map(|_| g.below(100) as f32 / 25.0).collect();
        let seed = g.next();
        let chain = VerifyRequest::new(&cfg, &logits, vocab, &tokens).seed(seed);
        let forms = [
            DraftProbs::PointMass,
            DraftProbs::Logits { logits: &ql, vocab },
        ];
        for q in forms {
            let a = v.verify(&chain.draft_probs(q)).unwrap();
            let b = v
                .verify(
                    &chain
                        .draft(DraftBlock::tree(&tokens, &parents))
                        .draft_probs(q),
                )
                .unwrap();
            assert_eq!(a, b);
            assert_eq!(a.path, (0..a.accepted as u32).collect::<Vec<_>>());
        }
    }
}

#[test]
fn rows_see_their_ancestors_only() {
    // A mask that forbids every token already in the prefix. Node 2 (token 2) follows node 0
    // (token 1); its sibling branch holds token 2 (node 1), which must not count in its history.
    let no_repeat: Arc<dyn crate::sampling::TokenMask> =
        Arc::new(|prefix: &[u32], logits: &mut [f32]| {
            for &t in prefix {
                logits[t as usize] = f32::NEG_INFINITY;
            }
        });
    let cfg = SamplingConfig::builder()
        .temperature(1.0)
        .mask(no_repeat)
        .build()
        .unwrap();
    let (tokens, parents) = ([1u32, 2, 2], [0u32, 0, 1]);
    let ql = vec![0.0f32; 3 * 4];
    let schemes = [SiblingScheme::WithReplacement; 3];
    let logits = vec![0.0f32; 4 * 4];
    let req = VerifyRequest::new(&cfg, &logits, 4, &tokens)
        .draft(DraftBlock::tree(&tokens, &parents).with_schemes(&schemes))
        .context(&[3])
        .draft_probs(DraftProbs::Logits {
            logits: &ql,
            vocab: 4,
        });
    let mut v = Verifier::new();
    for seed in 0..100 {
        let out = v.verify(&req.seed(seed)).unwrap();
        check_path(&out, &tokens, &parents);
        let mut seen = vec![3u32];
        for &t in &out.tokens {
            assert!(!seen.contains(&t), "{out:?}");
            seen.push(t);
        }
    }
    // Node 2 carrying its ancestor's token 1 is impossible under its processed draft row.
    let bad = [1u32, 2, 1];
    let err = v
        .verify(&req.draft(DraftBlock::tree(&bad, req.draft.parents().unwrap())))
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidDraftProbs { row: 2, .. }),
        "{err}"
    );
}

#[test]
fn every_tree_validation_error_comes_before_any_draw() {
    let cfg = SamplingConfig::builder().temperature(1.0).build().unwrap();
    let logits = vec![0.0f32; 5 * 5];
    let base = VerifyRequest::new(&cfg, &logits, 5, &TOKENS);
    let tree = DraftBlock::tree(&TOKENS, &PARENTS);
    let mut v = Verifier::new();
    let mut check = |req: VerifyRequest<'_>, want: &dyn Fn(&Error) -> bool| {
        for seed in [0, 1, 99] {
            let e = v.verify(&req.seed(seed)).unwrap_err();
            assert!(want(&e), "{e:?}");
        }
    };
    check(base.draft(DraftBlock::tree(&TOKENS, &[0, 0, 2])), &|e| {
        matches!(
            e,
            Error::InvalidTree(TreeFault::Shape {
                what: "parents",
                ..
            })
        )
    });
    check(base.draft(DraftBlock::tree(&TOKENS, &[0, 0, 4, 1])), &|e| {
        matches!(
            e,
            Error::InvalidTree(TreeFault::ParentNotBefore { node: 2, parent: 4 })
        )
    });
    let dup = [1u32, 1, 3, 4];
    check(
        VerifyRequest::new(&cfg, &logits, 5, &dup).draft(DraftBlock::tree(&dup, &PARENTS)),
        &|e| {
            matches!(
                e,
                Error::InvalidTree(TreeFault::DuplicateSiblings { node: 1, token: 1 })
            )
        },
    );
    let wr = [SiblingScheme::WithReplacement; 4];
    check(base.draft(tree.with_schemes(&wr)), &|e| {
        matches!(e, Error::InvalidTree(TreeFault::SchemeNeedsQ { node: 0 }))
    });
    check(base.draft(tree.with_schemes(&wr[..3])), &|e| {
        matches!(
            e,
            Error::InvalidTree(TreeFault::Shape {
                what: "schemes",
                ..
            })
        )
    });
    check(base.draft(tree.with_ends(&[false; 3])), &|e| {
        matches!(e, Error::InvalidTree(TreeFault::Shape { what: "ends", .. }))
    });
    check(
        base.draft(tree.with_ends(&[false, true, false, false])),
        &|e| matches!(e, Error::InvalidTree(TreeFault::EndHasChildren { node: 1 })),
    );
    check(
        base.draft(base.draft.with_ends(&[false, true, false, false])),
        &|e| matches!(e, Error::InvalidTree(TreeFault::EndHasChildren { node: 1 })),
    );
    let short = &logits[..4 * 5];
    // A tree whose last node ends keeps its `k + 1` rows: `[k, vocab]` is refused.
    check(
        VerifyRequest::new(&cfg, short, 5, &TOKENS)
            .draft(tree.with_ends(&[false, false, false, true])),
        &|e| matches!(e, Error::ShapeMismatch { .. }),
    );
    check(
        VerifyRequest::new(&cfg, short, 5, &TOKENS).draft(DraftBlock::tree(&TOKENS, &PARENTS)),
        &|e| matches!(e, Error::ShapeMismatch { .. }),
    );
    // Dense q: siblings of a sampled group must carry the same row.
    let mut q: Vec<f32> = [0.2f32; 5].repeat(4);
    q[5] = 0.3;
    q[6] = 0.1;
    check(
        base.draft(tree).draft_probs(DraftProbs::Probs {
            probs: &q,
            vocab: 5,
        }),
        &|e| matches!(e, Error::InvalidDraftProbs { row: 1, .. }),
    );
    check(
        base.draft(tree).draft_probs(DraftProbs::Logits {
            logits: &q,
            vocab: 5,
        }),
        &|e| matches!(e, Error::InvalidDraftProbs { row: 1, .. }),
    );
    // ... but a deterministic group's rows are not read at all.
    let det = [SiblingScheme::Deterministic; 4];
    let garbage = vec![f32::NAN; 4 * 5];
    let ok = base
        .draft(tree.with_schemes(&det))
        .draft_probs(DraftProbs::Probs {
            probs: &garbage,
            vocab: 5,
        });
    assert!(v.verify(&ok).is_ok());
    // A chain whose final draft ends has `[k, vocab]` rows, given as parents too.
    let ends = [false, false, false, true];
    for block in [
        DraftBlock::chain(&TOKENS),
        DraftBlock::tree(&TOKENS, &[0, 1, 2, 3]),
    ] {
        let chain = VerifyRequest::new(&cfg, short, 5, &TOKENS).draft(block.with_ends(&ends));
        assert!(v.verify(&chain).is_ok());
    }
}

#[test]
fn sibling_lanes_are_distinct_and_the_first_is_the_chains() {
    use crate::rng::lane;
    assert_eq!(lane::sibling_accept(0), lane::ACCEPT);
    let lanes: Vec<u32> = (0..64).map(lane::sibling_accept).collect();
    for (i, a) in lanes.iter().enumerate() {
        assert!(![lane::SAMPLE, lane::DRAFT].contains(a));
        assert!(!lanes[i + 1..].contains(a));
    }
    let s = Stream::new(5);
    assert_ne!(s.uniform(3, lanes[1]), s.uniform(3, lanes[2]));
}

/// A random tree request's arrays: tokens, parents, per-node schemes, `[n, vocab]` dense q with
/// one row per sibling group, ends, target logits.
struct TreeCase {
    tokens: Vec<u32>,
    parents: Vec<u32>,
    schemes: Vec<SiblingScheme>,
    q: Vec<f32>,
    ends: Vec<bool>,
    logits: Vec<f32>,
    ctx: Vec<u32>,
}

fn tree_case(g: &mut Gen, vocab: usize, chain: bool) -> TreeCase {
    let ctx: Vec<u32> = (0..g.below(4)).map(|_| g.below(vocab) as u32).collect();
    let (tokens, parents) = if chain {
        let k = g.below(5);
        (
            (0..k).map(|_| g.below(vocab) as u32).collect(),
            (0..k as u32).collect(),
        )
    } else {
        random_tree(g, vocab, &ctx, 9)
    };
    let n = tokens.len();
    let all = [
        SiblingScheme::Deterministic,
        SiblingScheme::WithReplacement,
        SiblingScheme::WithoutReplacement,
    ];
    let group_scheme: Vec<SiblingScheme> = (0..=n).map(|_| all[g.below(3)]).collect();
    let group_q: Vec<Vec<f32>> = (0..=n)
        .map(|_| {
            let w: Vec<f32> = (0..vocab).map(|_| 1.0 + g.below(20) as f32).collect();
            let t: f32 = w.iter().sum();
            w.iter().map(|x| x / t).collect()
        })
        .collect();
    let schemes = parents.iter().map(|&r| group_scheme[r as usize]).collect();
    let q = parents
        .iter()
        .flat_map(|&r| group_q[r as usize].clone())
        .collect();
    let ends = random_ends(g, &parents);
    let logits = verify_rows(
        tree_logits(&tokens, &parents, &ctx, vocab),
        &tokens,
        &parents,
        &ends,
    );
    TreeCase {
        tokens,
        parents,
        schemes,
        q,
        ends,
        logits,
        ctx,
    }
}

#[test]
fn a_batch_of_trees_and_chains_verifies_each_sequence_as_alone() {
    let mut g = Gen(5);
    let mut v = Verifier::new();
    let configs = [
        SamplingConfig::greedy(),
        SamplingConfig::builder().temperature(0.9).build().unwrap(),
        penalised(1.0),
    ];
    let mut trees = 0;
    for round in 0..60 {
        let vocab = 3 + g.below(6);
        let n_seq = 1 + g.below(5);
        let cases: Vec<TreeCase> = (0..n_seq)
            .map(|_| {
                let chain = g.below(3) == 0;
                tree_case(&mut g, vocab, chain)
            })
            .collect();
        // Half the rounds give every sequence its own dense q, the others use point masses.
        let dense = round % 2 == 0;
        let seeds: Vec<u64> = (0..n_seq).map(|_| g.next()).collect();
        let cfgs: Vec<&SamplingConfig> = (0..n_seq).map(|_| &configs[g.below(3)]).collect();
        let seqs: Vec<SequenceParams<'_>> = (0..n_seq)
            .map(|b| {
                let s = SequenceParams::new(cfgs[b], seeds[b])
                    .context(&cases[b].ctx)
                    .position(10 + b as u64);
                if dense {
                    s.draft_probs(DraftProbs::Probs {
                        probs: &cases[b].q,
                        vocab,
                    })
                } else {
                    s
                }
            })
            .collect();
        let cat =
            |f: &dyn Fn(&TreeCase) -> Vec<u32>| -> Vec<u32> { cases.iter().flat_map(f).collect() };
        let tokens = cat(&|c| c.tokens.clone());
        let parents = cat(&|c| c.parents.clone());
        let schemes: Vec<SiblingScheme> = if dense {
            cases.iter().flat_map(|c| c.schemes.clone()).collect()
        } else {
            vec![SiblingScheme::Deterministic; tokens.len()]
        };
        let ends: Vec<bool> = cases.iter().flat_map(|c| c.ends.clone()).collect();
        let logits: Vec<f32> = cases.iter().flat_map(|c| c.logits.clone()).collect();
        let mut offsets = vec![0usize];
        for c in &cases {
            offsets.push(offsets.last().unwrap() + c.tokens.len());
        }
        let batch = VerifyBatch {
            vocab_size: vocab,
            target_logits: &logits,
            draft_tokens: &tokens,
            draft_offsets: &offsets,
            draft_probs: DraftProbs::PointMass,
            sequences: &seqs,
            parents: None,
            schemes: None,
            ends: &[],
        }
        .tree(&parents)
        .schemes(&schemes)
        .ends(&ends);
        let got = v.verify_batch(&batch).unwrap();
        for (b, c) in cases.iter().enumerate() {
            let lo = offsets[b];
            let alone = VerifyRequest::new(cfgs[b], &c.logits, vocab, &c.tokens)
                .draft(
                    DraftBlock::tree(&c.tokens, &c.parents)
                        .with_schemes(&schemes[lo..lo + c.tokens.len()])
                        .with_ends(&c.ends),
                )
                .context(&c.ctx)
                .seed(seeds[b])
                .position(10 + b as u64);
            let alone = if dense {
                v.verify(&alone.draft_probs(DraftProbs::Probs { probs: &c.q, vocab }))
            } else {
                v.verify(&alone)
            };
            let out = got[b].as_ref().unwrap();
            assert_eq!(out, &alone.unwrap(), "round {round} sequence {b}");
            check_path(out, &c.tokens, &c.parents);
            trees += !DraftBlock::tree(&c.tokens, &c.parents).is_chain() as usize;
        }
    }
    assert!(trees > 50, "{trees}");
}

#[test]
fn batch_tree_arrays_must_cover_every_draft() {
    let cfg = SamplingConfig::greedy();
    let seqs = [SequenceParams::new(&cfg, 0), SequenceParams::new(&cfg, 1)];
    let logits = vec![0.0f32; 6 * 5];
    let batch = VerifyBatch {
        vocab_size: 5,
        target_logits: &logits,
        draft_tokens: &[1, 2, 3, 4],
        draft_offsets: &[0, 2, 4],
        draft_probs: DraftProbs::PointMass,
        sequences: &seqs,
        parents: None,
        schemes: None,
        ends: &[],
    };
    let mut v = Verifier::new();
    let shape = |r: Result<Vec<Result<StepOutput>>>| match r {
        Err(Error::ShapeMismatch { what, .. }) => what,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        shape(v.verify_batch(&batch.tree(&[0, 0, 0]))),
        "parents ([sum k])"
    );
    let s = [SiblingScheme::Deterministic; 3];
    assert_eq!(
        shape(v.verify_batch(&batch.schemes(&s))),
        "schemes ([sum k])"
    );
    assert_eq!(
        shape(v.verify_batch(&batch.ends(&[false]))),
        "ends ([sum k] or empty)"
    );
    // Parents are local to each sequence: [0, 0] is a two-sibling root in both.
    let out = v.verify_batch(&batch.tree(&[0, 0, 0, 0])).unwrap();
    assert!(
        out.iter()
            .all(|r| r.as_ref().unwrap().end == StepEnd::Rejected { index: 0 })
    );
    // A bad tree fails its own sequence only.
    let out = v.verify_batch(&batch.tree(&[0, 0, 0, 2])).unwrap();
    assert!(out[0].is_ok());
    assert!(matches!(
        out[1],
        Err(Error::InvalidTree(TreeFault::ParentNotBefore {
            node: 1,
            parent: 2
        }))
    ));
}

/// The `n` best ids after `prefix` under `cfg`'s penalties and masks, ranked by an independent
/// route: the full softmax at temperature 1 (monotone in the processed logits), ties to the
/// lowest id, zero-probability (masked) tokens left out.
fn best_ids(cfg: &SamplingConfig, logits: &[f32], prefix: &[u32], n: usize) -> Vec<u32> {
    let t1 = cfg.to_builder().temperature(1.0).build().unwrap();
    let vocab = logits.len();
    let counts = crate::sampling::TokenCounts::from_tokens(prefix, vocab).unwrap();
    let hist = crate::sampling::History {
        counts: Some(&counts),
        prefix,
        suppress: &[],
    };
    let mut d = TokenDist::default();
    RowProcessor::new()
        .distribution(&t1, logits, &hist, RowKind::Target, 0, &mut d)
        .unwrap();
    let mut p: Vec<(u32, f32)> = (0..vocab as u32).map(|t| (t, d.prob(t))).collect();
    p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    p.into_iter()
        .filter(|&(_, q)| q > 0.0)
        .take(n)
        .map(|(t, _)| t)
        .collect()
}

#[test]
fn row_top_lists_the_best_ids_of_every_row_along_its_own_path() {
    let vocab = 9;
    let ctx = [2u32, 5, 2];
    // Forbids the context's last token again: rows differ in what they mask.
    let no_repeat_last: Arc<dyn crate::sampling::TokenMask> =
        Arc::new(|prefix: &[u32], logits: &mut [f32]| {
            if let Some(&t) = prefix.last() {
                logits[t as usize] = f32::NEG_INFINITY;
            }
        });
    let masked = penalised(0.7)
        .to_builder()
        .mask(no_repeat_last)
        .build()
        .unwrap();
    let mut g = Gen(41);
    let mut v = Verifier::new();
    for cfg in [penalised(0.0), penalised(0.7), masked] {
        for case in 0..60 {
            let (tokens, parents) = random_tree(&mut g, vocab, &ctx, 7);
            let logits = tree_logits(&tokens, &parents, &ctx, vocab);
            let n = 1 + case % 4;
            let req = VerifyRequest::new(&cfg, &logits, vocab, &tokens)
                .draft(DraftBlock::tree(&tokens, &parents))
                .context(&ctx)
                .seed(case as u64)
                .position(ctx.len() as u64);
            let plain_out = v.verify(&req).unwrap();
            assert!(plain_out.row_top.is_empty());
            let out = v.verify(&req.row_top_k(n)).unwrap();
            // The verification itself is unchanged.
            assert_eq!(
                (&out.tokens, &out.path),
                (&plain_out.tokens, &plain_out.path)
            );
            assert_eq!(out.row_top.rows(), tokens.len() + 1);
            let block = DraftBlock::tree(&tokens, &parents);
            let mut nodes = Vec::new();
            for r in 0..=tokens.len() {
                let mut prefix = ctx.to_vec();
                if r > 0 {
                    block.path_to(r - 1, &mut nodes);
                    prefix.extend(nodes.iter().map(|&j| tokens[j as usize]));
                }
                let want = best_ids(&cfg, &logits[r * vocab..(r + 1) * vocab], &prefix, n);
                assert_eq!(out.row_top.row(r), &want[..], "case {case} row {r}");
            }
        }
    }
}

#[test]
fn a_batch_cuts_the_row_after_a_chains_final_end_only() {
    // Sequence 0: chain [1, 2] whose final draft ends ([2, vocab] rows); sequence 1: a tree of
    // two siblings whose second ends ([3, vocab] rows); sequence 2: a chain without an end.
    let cfg = SamplingConfig::greedy();
    let vocab = 5;
    let row = |t: usize| {
        (0..vocab)
            .map(|i| if i == t { 5.0 } else { 0.0 })
            .collect::<Vec<f32>>()
    };
    let rows: Vec<Vec<f32>> = vec![row(1), row(2), row(3), row(0), row(4), row(3), row(4)];
    let logits: Vec<f32> = rows.concat();
    let tokens = [1u32, 2, 0, 3, 3];
    let offsets = [0usize, 2, 4, 5];
    let parents = [0u32, 1, 0, 0, 0];
    let ends = [false, true, false, true, false];
    let seqs = [
        SequenceParams::new(&cfg, 1),
        SequenceParams::new(&cfg, 2),
        SequenceParams::new(&cfg, 3),
    ];
    let batch = VerifyBatch::new(vocab, &logits, &tokens, &offsets, &seqs)
        .tree(&parents)
        .ends(&ends);
    let mut v = Verifier::new();
    let got = v.verify_batch(&batch).unwrap();
    let alone = [
        VerifyRequest::new(&cfg, &logits[..2 * vocab], vocab, &tokens[..2])
            .draft(DraftBlock::chain(&tokens[..2]).with_ends(&ends[..2])),
        VerifyRequest::new(&cfg, &logits[2 * vocab..5 * vocab], vocab, &tokens[2..4])
            .draft(DraftBlock::tree(&tokens[2..4], &[0, 0]).with_ends(&ends[2..4])),
        VerifyRequest::new(&cfg, &logits[5 * vocab..], vocab, &tokens[4..]),
    ];
    for (b, req) in alone.iter().enumerate() {
        assert_eq!(
            got[b].as_ref().unwrap(),
            &v.verify(req).unwrap(),
            "sequence {b}"
        );
    }
    assert_eq!(got[0].as_ref().unwrap().end, StepEnd::Ended);
    assert_eq!(got[1].as_ref().unwrap().tokens, vec![3]);
    assert_eq!(got[2].as_ref().unwrap().end, StepEnd::AllAccepted);
    // One row more (the chain's row after its end) is the wrong shape for the whole batch.
    let more = [logits.as_slice(), &row(0)].concat();
    let mut long = batch;
    long.target_logits = &more;
    assert!(matches!(
        v.verify_batch(&long),
        Err(Error::ShapeMismatch { .. })
    ));
}
