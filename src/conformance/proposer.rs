//! The [`Proposer`] family: drafts within the limits, no token past an EOS, state across
//! requests and rollbacks.

use super::KitConfig;
use super::report::Report;
use super::util::{Fail, ok, prompt_input, prompts, record};
use crate::error::Error;
use crate::propose::{Draft, ProposeRequest, Proposer};
use crate::sampling::SamplingConfig;
use crate::tree::TreeLimits;

type Check = std::result::Result<(), Fail>;

/// Runs the [`Proposer`] checks (`proposer.*`, listed in [`crate::conformance`]) on fresh
/// proposers from `make`, for every prompt as context, greedy and sampled (temperature 1, top-k
/// [`KitConfig::top_k`]), seed 7. `vocab` is the target's vocabulary size.
pub fn check_proposer<Q, P>(
    mut make: impl FnMut() -> Q,
    prompts_in: &[P],
    vocab: usize,
    cfg: &KitConfig,
) -> Report
where
    Q: Proposer,
    P: AsRef<[u32]>,
{
    let mut report = Report::new("Proposer", std::any::type_name::<Q>());
    let Some(ps) = prompts(&mut report, prompts_in, vocab, usize::MAX) else {
        return report;
    };
    let sampled = SamplingConfig::builder()
        .temperature(1.0)
        .top_k(cfg.top_k())
        .build();
    let configs = match sampled {
        Ok(s) => [("greedy", SamplingConfig::greedy()), ("sampled", s)],
        Err(_) => [
            ("greedy", SamplingConfig::greedy()),
            ("greedy", SamplingConfig::greedy()),
        ],
    };
    let k = cfg.draft_len();
    for (i, p) in ps.iter().enumerate() {
        for (name, sc) in &configs {
            let input = format!("{}, {name}", prompt_input(i, p));
            record(
                &mut report,
                "proposer.limits",
                &input,
                limits(&mut make, p, sc, vocab, k),
            );
            record(
                &mut report,
                "proposer.tree",
                &input,
                tree(&mut make, p, sc, vocab),
            );
            record(
                &mut report,
                "proposer.eos",
                &input,
                eos(&mut make, p, sc, vocab, k),
            );
            let other = ps[(i + 1) % ps.len()];
            record(
                &mut report,
                "proposer.new_request",
                &input,
                new_request(&mut make, p, other, sc, vocab, k),
            );
            record(
                &mut report,
                "proposer.rollback",
                &input,
                rollback(&mut make, p, sc, vocab, k),
            );
        }
    }
    report
}

fn request<'a>(ctx: &'a [u32], sc: &'a SamplingConfig, k: usize) -> ProposeRequest<'a> {
    let mut req = ProposeRequest::new(ctx, sc, k);
    req.seed = 7;
    req.prompt_len = ctx.len();
    req
}

/// A draft valid for `req`: length, ids, q shape and rows.
fn valid(d: &Draft, req: &ProposeRequest<'_>, vocab: usize) -> Check {
    let what = format!("draft {:?} for max_draft {}", d.tokens, req.max_draft);
    if d.parents.is_empty() && d.tokens.len() > req.max_draft {
        return Err(Fail::new(format!("at most {} tokens", req.max_draft), what));
    }
    if let Some(t) = d.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Fail::new(
            format!("ids below {vocab}"),
            format!("{t} in {what}"),
        ));
    }
    let Some(q) = &d.q else { return Ok(()) };
    let qv = d.q_vocab;
    if qv == 0 || qv > vocab || q.len() != d.tokens.len() * qv {
        return Err(Fail::new(
            format!(
                "q of [{}, q_vocab] with 1 <= q_vocab <= {vocab}",
                d.tokens.len()
            ),
            format!("{} floats, q_vocab {qv}", q.len()),
        ));
    }
    for (r, (row, &t)) in q.chunks(qv).zip(&d.tokens).enumerate() {
        let sum: f64 = row.iter().map(|&x| x as f64).sum();
        let bad = row.iter().any(|x| !x.is_finite() || *x < 0.0) || (sum - 1.0).abs() > 1e-3;
        let mass = row.get(t as usize).copied().unwrap_or(0.0);
        if bad || mass <= 0.0 {
            return Err(Fail::new(
                format!("q row {r}: a distribution (sum 1 within 1e-3) with mass on its token {t}"),
                format!("sum {sum}, q[{t}] = {mass}"),
            ));
        }
    }
    Ok(())
}

fn limits<Q: Proposer>(
    make: &mut impl FnMut() -> Q,
    p: &[u32],
    sc: &SamplingConfig,
    vocab: usize,
    k: usize,
) -> Check {
    for max in [0, 1, k] {
        let mut q = make();
        ok(q.begin(p), "begin(prompt)")?;
        let mut d = Draft::default();
        let req = request(p, sc, max);
        ok(q.propose(&req, &mut d), format!("propose(max_draft {max})"))?;
        valid(&d, &req, vocab)?;
        if !d.parents.is_empty() {
            return Err(Fail::new(
                "propose returns a chain (no parents)",
                format!("parents {:?}", d.parents),
            ));
        }
    }
    Ok(())
}

fn tree<Q: Proposer>(
    make: &mut impl FnMut() -> Q,
    p: &[u32],
    sc: &SamplingConfig,
    vocab: usize,
) -> Check {
    let mut q = make();
    ok(q.begin(p), "begin(prompt)")?;
    let mut req = request(p, sc, 3);
    (req.max_nodes, req.max_branch) = (6, 2);
    let mut d = Draft::default();
    ok(
        q.propose_tree(&req, &mut d),
        "propose_tree(max_draft 3, max_nodes 6, max_branch 2)",
    )?;
    valid(&d, &req, vocab)?;
    if d.parents.is_empty() {
        return Ok(());
    }
    let limits = TreeLimits {
        vocab_size: vocab,
        max_nodes: 6,
        max_depth: 3,
        max_branch: 2,
        dense_q: d.q.is_some(),
    };
    d.block().validate(&limits).map_err(|e| {
        Fail::new(
            "a tree within 6 nodes, depth 3, 2 children per node",
            format!("{e} in {:?} / {:?}", d.tokens, d.parents),
        )
    })
}

fn eos<Q: Proposer>(
    make: &mut impl FnMut() -> Q,
    p: &[u32],
    sc: &SamplingConfig,
    vocab: usize,
    k: usize,
) -> Check {
    let first = fresh(make, p, sc, k)?;
    for j in 0..first.tokens.len() {
        let mut q = make();
        ok(q.begin(p), "begin(prompt)")?;
        let stop = [first.tokens[j]];
        let mut req = request(p, sc, k);
        req.eos = &stop;
        let mut d = Draft::default();
        ok(
            q.propose(&req, &mut d),
            format!("propose with EOS {}", stop[0]),
        )?;
        valid(&d, &req, vocab)?;
        if req.draft_len_to_eos(&d.tokens) != d.tokens.len() {
            return Err(Fail::new(
                format!("no token after the EOS id {}", stop[0]),
                format!("draft {:?}", d.tokens),
            ));
        }
    }
    Ok(())
}

/// The draft of a fresh proposer begun with `ctx`.
fn fresh<Q: Proposer>(
    make: &mut impl FnMut() -> Q,
    ctx: &[u32],
    sc: &SamplingConfig,
    k: usize,
) -> std::result::Result<Draft, Fail> {
    let mut q = make();
    ok(q.begin(ctx), "begin")?;
    let mut d = Draft::default();
    ok(
        q.propose(&request(ctx, sc, k), &mut d),
        "propose on a fresh proposer",
    )?;
    Ok(d)
}

/// A reused proposer's draft on `ctx`: valid, or StaleProposerState; a difference from a
/// fresh proposer's draft is tolerated.
fn reused<Q: Proposer>(
    q: &mut Q,
    make: &mut impl FnMut() -> Q,
    ctx: &[u32],
    sc: &SamplingConfig,
    vocab: usize,
    k: usize,
    what: &str,
) -> Check {
    let mut d = Draft::default();
    let req = request(ctx, sc, k);
    match q.propose(&req, &mut d) {
        Err(Error::StaleProposerState { .. }) => return Ok(()),
        r => ok(r, format!("propose {what}"))?,
    }
    valid(&d, &req, vocab)?;
    let f = fresh(make, ctx, sc, k)?;
    if f.tokens != d.tokens {
        return Err(Fail::new(format!("{:?} (a fresh proposer's draft)", f.tokens), format!("{:?} {what}", d.tokens))
            .tolerated("fine for a proposer that learns across requests, a bug for one that should have rebuilt its state"));
    }
    Ok(())
}

fn new_request<Q: Proposer>(
    make: &mut impl FnMut() -> Q,
    p: &[u32],
    other: &[u32],
    sc: &SamplingConfig,
    vocab: usize,
    k: usize,
) -> Check {
    let mut q = make();
    ok(q.begin(p), "begin(prompt)")?;
    let mut d = Draft::default();
    ok(q.propose(&request(p, sc, k), &mut d), "propose(prompt)")?;
    let emitted = [d.tokens.first().copied().unwrap_or(p[0])];
    ok(q.observe(d.tokens.len().min(1), &emitted), "observe")?;
    reused(
        &mut q,
        make,
        other,
        sc,
        vocab,
        k,
        "used directly on another prompt (no begin)",
    )
}

fn rollback<Q: Proposer>(
    make: &mut impl FnMut() -> Q,
    p: &[u32],
    sc: &SamplingConfig,
    vocab: usize,
    k: usize,
) -> Check {
    let mut q = make();
    ok(q.begin(p), "begin(prompt)")?;
    let longer: Vec<u32> = [p, &p[..2]].concat();
    let mut d = Draft::default();
    ok(
        q.propose(&request(&longer, sc, k), &mut d),
        "propose(prompt + 2 tokens)",
    )?;
    ok(q.observe(0, &longer[p.len()..p.len() + 1]), "observe")?;
    reused(
        &mut q,
        make,
        &p[..p.len() - 1],
        sc,
        vocab,
        k,
        "on a shorter context (a rollback)",
    )
}
