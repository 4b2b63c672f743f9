//! Stochastic verification: speculative sampling with residual resampling, for chains and trees.
//!
//! Leviathan, Kalman & Matias 2023 (section 2.3, algorithm 1); Chen et al. 2023 (algorithm 2);
//! for sibling groups SpecInfer's multi-step speculative sampling (Miao et al. 2024, algorithm 2)
//! and recursive rejection sampling (Jeon et al. 2024). Point-mass drafts use the reproducible
//! form of the same rule (see the module docs of [`crate::verify`], case C15, and its section
//! "Trees" for the proofs). A chain is the tree whose groups have one node each: the same walk
//! verifies both, and a chain draws exactly the uniforms it drew before trees existed.

use super::{
    DraftQ, DraftRow, StepEnd, StepOutput, TokenLogprob, Verifier, VerifyRequest,
    residual_weights_of, row, scheme_default,
};
use crate::error::{Error, Result, RowKind};
use crate::rng::{Stream, lane};
use crate::sampling::{Logit, TokenDist, sample_weighted};
use crate::tree::{DraftBlock, SiblingScheme};

/// Unnormalised `(token, weight)` pairs in id order: a residual distribution.
type Weights = Vec<(u32, f64)>;

/// What a row's sibling group decided.
enum Pick {
    /// Descend into this node (accepted).
    Child(usize),
    /// Emit this token and stop (every sibling rejected, or no sibling).
    Emit(u32),
}

/// Verifies one validated request by the stochastic rules (module docs): walks down from the
/// root, one sibling group per row, until a group emits a token or an ending node is accepted.
pub(super) fn verify<L: Logit, Q: Logit>(
    v: &mut Verifier,
    req: &VerifyRequest<'_, L, Q>,
) -> Result<StepOutput> {
    let vocab = req.vocab_size;
    let k = req.draft.tokens().len();
    let cfg = req.state.config;
    let block = req.draft;
    let default = scheme_default(!matches!(req.draft_probs, DraftQ::PointMass));
    let stream = Stream::new(req.state.seed);
    let pos0 = req.state.position.unwrap_or(req.state.context.len() as u64);
    let want_lp = cfg.logprobs();
    let cap = block.max_depth() + 1;
    let mut tokens = Vec::with_capacity(cap);
    let mut path = Vec::with_capacity(cap);
    let mut logprobs: Option<Vec<TokenLogprob>> = want_lp.map(|_| Vec::with_capacity(cap));
    let push_lp = |lps: &mut Option<Vec<TokenLogprob>>, p: &TokenDist, t: u32| {
        if let (Some(lps), Some(n)) = (lps.as_mut(), want_lp) {
            lps.push(TokenLogprob {
                token: t,
                logprob: p.logprob(t),
                top: p.top_logprobs(n),
            });
        }
    };
    let mut r = 0;
    let end = loop {
        // Row r follows the path so far: its position is pos0 + depth.
        let pos = pos0.wrapping_add(path.len() as u64);
        let hist = v.hist.view();
        v.proc.distribution(
            cfg,
            row(req.target_logits, vocab, r),
            &hist,
            RowKind::Target,
            r,
            &mut v.p,
        )?;
        let pick = decide_group(v, req, &block, default, (stream, pos, r))?;
        match pick {
            Pick::Emit(t) => {
                tokens.push(t);
                push_lp(&mut logprobs, &v.p, t);
                break if !v.kids.is_empty() {
                    StepEnd::Rejected { index: path.len() }
                } else if k == 0 {
                    StepEnd::NoDraft
                } else {
                    StepEnd::AllAccepted
                };
            }
            Pick::Child(j) => {
                let x = req.draft.tokens()[j];
                tokens.push(x);
                push_lp(&mut logprobs, &v.p, x);
                path.push(j as u32);
                if req.ends_at(j) {
                    // The accepted node ends the sequence: no row after it is processed.
                    break StepEnd::Ended;
                }
                v.hist.push(x)?;
                r = j + 1;
            }
        }
    };
    Ok(StepOutput {
        accepted: path.len(),
        path,
        tokens,
        logprobs,
        end,
        row_top: Default::default(),
    })
}

/// The decision of the sibling group below row `r` (position `pos`) against the processed
/// target row in `v.p`; the group's nodes go to `v.kids`. A leaf or a no-draft step emits the
/// position's plain draw; point masses (and deterministic groups) descend into the sibling that
/// carries that draw; sampled groups follow [`sampled_group`].
fn decide_group<L: Logit, Q: Logit>(
    v: &mut Verifier,
    req: &VerifyRequest<'_, L, Q>,
    block: &DraftBlock<'_>,
    default: SiblingScheme,
    (stream, pos, r): (Stream, u64, usize),
) -> Result<Pick> {
    v.kids.clear();
    v.kids.extend(block.children(r));
    Ok(match v.kids.first() {
        // A leaf (bonus token) or a no-draft step: the plain draw of the position.
        None => Pick::Emit(draw(&v.p, stream.uniform(pos, lane::SAMPLE), r)?),
        Some(&first) => {
            let scheme = block.scheme(first, default);
            let q = match (scheme, req.draft_probs) {
                (SiblingScheme::Deterministic, _) | (_, DraftQ::PointMass) => None,
                (_, DraftQ::Probs { probs, vocab: qv }) => {
                    Some(DraftRow::Dense(row(probs, qv, first)))
                }
                (_, DraftQ::Logits { .. }) => Some(DraftRow::Dist(&v.q_rows[first])),
            };
            match q {
                // Point masses: draw the position's token as plain sampling would and
                // descend into the sibling that carries it, if any.
                None => {
                    let t = draw(&v.p, stream.uniform(pos, lane::SAMPLE), r)?;
                    match v.kids.iter().find(|&&j| req.draft.tokens()[j] == t) {
                        Some(&j) => Pick::Child(j),
                        None => Pick::Emit(t),
                    }
                }
                Some(q) => sampled_group(
                    &v.p,
                    &q,
                    scheme == SiblingScheme::WithoutReplacement,
                    &v.kids,
                    req.draft.tokens(),
                    (stream, pos, r),
                    (&mut v.residual, &mut v.residual_next),
                )?,
            }
        }
    })
}

/// One sampled sibling group against the processed target row `p`: siblings `kids` (node
/// indices, in order) were drawn from `q` with replacement, or without (`without`: q then loses
/// each earlier sibling and is renormalised). Sibling `j` is accepted with probability
/// `min(1, p_j(x_j) / q_j(x_j))` on the uniform of lane [`lane::sibling_accept`]`(j)`; on
/// rejection `p_{j+1} = norm(max(0, p_j - q_j))`. When every sibling is rejected the residual
/// `p_m` is sampled with the position's SAMPLE uniform; if a residual has no mass (`p_j = q_j`
/// up to rounding, where rejection has probability 0 in exact arithmetic) `p_j` is sampled
/// instead. With one sibling this is exactly the chain rule of Leviathan et al. (same uniforms,
/// same arithmetic).
fn sampled_group<Q: Logit>(
    p: &TokenDist,
    q: &DraftRow<'_, Q>,
    without: bool,
    kids: &[usize],
    draft_tokens: &[u32],
    (stream, pos, r): (Stream, u64, usize),
    (cur, next): (&mut Weights, &mut Weights),
) -> Result<Pick> {
    // p_j = cur * scale for j >= 1; p_0 is `p` itself (its f32 probabilities, as the chain rule
    // has always read them).
    let mut on_p = true;
    let mut scale = 1.0f64;
    // Without replacement: the q mass of the rejected siblings, and q's total.
    let mut removed = 0.0f64;
    let mut q_total: Option<f64> = None;
    let removed_tokens = |j: usize| kids[..j].iter().map(|&n| draft_tokens[n]);
    for (j, &node) in kids.iter().enumerate() {
        let x = draft_tokens[node];
        let qx = q.prob(x, x) as f64;
        // q_j's normaliser: 1 for q itself (j = 0, or with replacement).
        let norm = if without && j > 0 {
            let total = *q_total.get_or_insert_with(|| dense_total(q));
            (total - removed).max(qx)
        } else {
            1.0
        };
        let px = if on_p {
            p.prob(x) as f64
        } else {
            cur.binary_search_by_key(&x, |e| e.0)
                .map_or(0.0, |i| cur[i].1 * scale)
        };
        // Validation checked q(x) > 0 for every node of a sampled group.
        let u = stream.uniform(pos, lane::sibling_accept(j)) as f64;
        if u < (px / (qx / norm)).min(1.0) {
            return Ok(Pick::Child(node));
        }
        // Rejected: p_{j+1} = max(0, p_j - q_j) (unnormalised).
        let q_j = |v: u32| {
            if without && j > 0 && removed_tokens(j).any(|t| t == v) {
                0.0
            } else {
                q.prob(v, x) as f64 / norm
            }
        };
        let total = if on_p {
            // j = 0: q_0 = q, exactly the chain's residual.
            residual_weights_of(p, q, x, next)
        } else {
            fill_residual(cur, scale, q_j, next)
        };
        if without {
            removed += qx;
        }
        if total.is_nan() || total <= 0.0 {
            // No residual mass: sample p_j.
            let u2 = stream.uniform(pos, lane::SAMPLE);
            return Ok(Pick::Emit(if on_p {
                draw(p, u2, r)?
            } else {
                sample_weighted(cur.iter().copied(), u2).ok_or(Error::NoAllowedToken {
                    kind: RowKind::Target,
                    row: r,
                })?
            }));
        }
        std::mem::swap(cur, next);
        scale = 1.0 / total;
        on_p = false;
    }
    // Every sibling rejected: sample the residual p_m.
    let u2 = stream.uniform(pos, lane::SAMPLE);
    match sample_weighted(cur.iter().copied(), u2) {
        Some(t) => Ok(Pick::Emit(t)),
        None => Ok(Pick::Emit(draw(p, u2, r)?)),
    }
}

/// `max(0, w * scale - q_j(v))` over `(v, w)` in order, the positive ones written to `out`;
/// returns their total.
fn fill_residual(
    weights: &[(u32, f64)],
    scale: f64,
    q_j: impl Fn(u32) -> f64,
    out: &mut Vec<(u32, f64)>,
) -> f64 {
    out.clear();
    let mut total = 0.0f64;
    for &(t, w) in weights {
        let r = (w * scale - q_j(t)).max(0.0);
        if r > 0.0 {
            out.push((t, r));
            total += r;
        }
    }
    total
}

/// Total mass of a q row (`1` within the validation tolerance).
fn dense_total<Q: Logit>(q: &DraftRow<'_, Q>) -> f64 {
    match q {
        DraftRow::PointMass => 1.0,
        DraftRow::Dense(row) => {
            let mut total = 0.0f64;
            crate::sampling::for_each_span(row, |_, block| {
                total += block.iter().map(|&x| x as f64).sum::<f64>();
            });
            total
        }
        DraftRow::Dist(d) => d.probs().iter().map(|&x| x as f64).sum(),
    }
}

/// The token of processed target row `row` at uniform `u` (a processed row is never empty; the
/// error is for completeness).
fn draw(p: &TokenDist, u: f32, row: usize) -> Result<u32> {
    p.sample(u).ok_or(Error::NoAllowedToken {
        kind: RowKind::Target,
        row,
    })
}
