//! End-to-end losslessness of this engine + a proposer + [`Generator`]: greedy identity, a
//! statistical test of the first two sampled tokens, and its negative control.

use std::collections::BTreeMap;

use super::report::{Fit, Report};
use super::stats;
use super::util::{Fail, ok, prompt_input, prompts, record};
use super::{ALPHA, KitConfig, Tolerance};
use crate::decode::{DraftLength, GenerationParams, Generator, TreeDrafts};
use crate::error::{Result, RowKind};
use crate::model::{HiddenStates, Rollback, RollbackMode, TargetModel, TreeTarget, rollback_mode};
use crate::propose::{Draft, DraftModelProposer, NoProposer, ProposeRequest, Proposer};
use crate::rng::Stream;
use crate::sampling::{History, RowProcessor, SamplingConfig, TokenDist};
use crate::tree::DraftBlock;

type Check = std::result::Result<(), Fail>;

/// [`check_lossless_with`] with the kit's proposers only: a draft model made of a second
/// engine from `make` with its logits scaled by 0.6 (a flatter law than the target's, so drafts
/// are sometimes rejected when sampling), and random point-mass drafts (mostly rejected).
pub fn check_lossless<T, P>(
    mut make: impl FnMut() -> T,
    prompts_in: &[P],
    cfg: &KitConfig,
) -> Report
where
    T: TargetModel,
    P: AsRef<[u32]>,
{
    lossless::<T, NoProposer, P>(&mut make, None, prompts_in, cfg)
}

/// Runs the loop checks (`lossless.greedy`, `lossless.sampled`, `lossless.negative_control`,
/// listed in [`crate::conformance`]) on fresh engines from `make` with [`Generator`], the kit's
/// proposers (see [`check_lossless`]) and proposers from `make_proposer`.
///
/// - `lossless.greedy`, per prompt and proposer: [`KitConfig::greedy_tokens`] greedy tokens
///   with draft length [`KitConfig::draft_len`] (and with trees of `2k` nodes when the engine
///   has tree support) equal plain greedy decoding ([`NoProposer`]). A difference fails under
///   [`Tolerance::Exact`] and is tolerated otherwise (see [`super::check_invariance`]).
/// - `lossless.sampled`, on the first prompt: [`KitConfig::samples`] generations of two
///   tokens, seeds `seed ..`, temperature 1, top-k [`KitConfig::top_k`], with `make_proposer`'s
///   proposer (the kit's draft model without one); the counts of the first two tokens against
///   their exact law `p(t1) p(t2 | t1)` from the engine's single-row logits, processed by
///   [`RowProcessor`]; passes when the p-value is `>= ALPHA`.
/// - `lossless.negative_control`: the same test with a proposer that drafts the second most
///   likely first token and claims it had probability `1e-6` (or less) of drawing it, so
///   the verifier accepts it nearly always: must give a p-value `< ALPHA`.
///
/// Cost: for each prompt `2 + proposers` greedy generations; `2 * samples` short generations
/// of the first prompt (each a prefill and one or two verify forwards, plus the proposer's
/// work) and `top_k + 1` forwards for the exact law.
pub fn check_lossless_with<T, Q, P>(
    mut make: impl FnMut() -> T,
    mut make_proposer: impl FnMut() -> Q,
    prompts_in: &[P],
    cfg: &KitConfig,
) -> Report
where
    T: TargetModel,
    Q: Proposer,
    P: AsRef<[u32]>,
{
    lossless(&mut make, Some(&mut make_proposer), prompts_in, cfg)
}

fn lossless<T: TargetModel, Q: Proposer, P: AsRef<[u32]>>(
    make: &mut impl FnMut() -> T,
    mut user: Option<&mut dyn FnMut() -> Q>,
    prompts_in: &[P],
    cfg: &KitConfig,
) -> Report {
    let mut report = Report::new("lossless loop", std::any::type_name::<T>());
    let mut probe = make();
    let (vocab, max_context) = (probe.vocab_size(), probe.max_context());
    let tree = probe.tree().map_or(0, |t| t.max_tree_nodes()) > 0;
    drop(probe);
    let Some(ps) = prompts(&mut report, prompts_in, vocab, max_context) else {
        return report;
    };
    for (i, p) in ps.iter().enumerate() {
        greedy_checks(
            &mut report,
            make,
            user.as_deref_mut(),
            i,
            p,
            cfg,
            tree,
            vocab,
        );
    }
    sampled_checks(&mut report, make, user, ps[0], cfg);
    report
}

/// `lossless.greedy` on prompt `i`: plain greedy decoding against the loop with the engine as
/// its own (tempered) draft model, random drafts, tree drafts where the engine has trees, and
/// the user's proposer.
#[allow(clippy::too_many_arguments)]
fn greedy_checks<T: TargetModel, Q: Proposer>(
    report: &mut Report,
    make: &mut impl FnMut() -> T,
    user: Option<&mut (dyn FnMut() -> Q + '_)>,
    i: usize,
    p: &[u32],
    cfg: &KitConfig,
    tree: bool,
    vocab: usize,
) {
    let k = cfg.draft_len();
    let plain = match run_greedy(make, NoProposer, p, cfg, 0) {
        Ok(t) => t,
        Err(f) => {
            report.push("lossless.greedy", prompt_input(i, p), f.into_outcome());
            return;
        }
    };
    let input = |what: &str| format!("{}, {what}", prompt_input(i, p));
    let m = make();
    let r = same_greedy(
        make,
        DraftModelProposer::new(Tempered::new(m)),
        p,
        cfg,
        0,
        &plain,
    );
    record(
        report,
        "lossless.greedy",
        &input("the engine as its own draft model"),
        r,
    );
    let r = same_greedy(make, RandomDrafts { vocab }, p, cfg, 0, &plain);
    record(report, "lossless.greedy", &input("random drafts"), r);
    if tree {
        let m = make();
        let r = same_greedy(
            make,
            DraftModelProposer::new(Tempered::new(m)),
            p,
            cfg,
            2 * k,
            &plain,
        );
        record(
            report,
            "lossless.greedy",
            &input(&format!("tree drafts of {} nodes", 2 * k)),
            r,
        );
    }
    if let Some(u) = user {
        let r = same_greedy(make, u(), p, cfg, 0, &plain);
        record(report, "lossless.greedy", &input("your proposer"), r);
    }
}

/// `lossless.sampled` and `lossless.negative_control` on prompt `p`: the first tokens' law of
/// plain sampling against the loop's, and against a lying draft that must fail.
fn sampled_checks<T: TargetModel, Q: Proposer>(
    report: &mut Report,
    make: &mut impl FnMut() -> T,
    mut user: Option<&mut dyn FnMut() -> Q>,
    p: &[u32],
    cfg: &KitConfig,
) {
    let input = format!(
        "{}, {} samples, top-k {}",
        prompt_input(0, p),
        cfg.samples(),
        cfg.top_k()
    );
    match exact_law(make, p, cfg) {
        Err(f) => report.push("lossless.sampled", &input, f.into_outcome()),
        Ok(law) => {
            let r = match user.as_mut() {
                Some(u) => sampled(make, u(), p, cfg, &law, "lossless.sampled"),
                None => {
                    let m = make();
                    sampled(
                        make,
                        DraftModelProposer::new(Tempered::new(m)),
                        p,
                        cfg,
                        &law,
                        "lossless.sampled",
                    )
                }
            };
            push_fit(report, "lossless.sampled", &input, r, true);
            let r = match law.liar() {
                Some(liar) => sampled(make, liar, p, cfg, &law, "lossless.negative_control"),
                None => Err(Fail::skip("the first token has a single candidate")),
            };
            push_fit(report, "lossless.negative_control", &input, r, false);
        }
    }
}

fn push_fit(
    report: &mut Report,
    check: &'static str,
    input: &str,
    r: std::result::Result<Fit, Fail>,
    positive: bool,
) {
    match r {
        Err(f) => record(report, check, input, Err(f)),
        Ok(fit) => {
            let pass = (fit.p_value >= ALPHA) == positive;
            let r = if pass {
                Ok(())
            } else if positive {
                Err(Fail::new(
                    format!("p >= {ALPHA:e} (the emitted tokens follow plain sampling)"),
                    fit.to_string(),
                ))
            } else {
                Err(Fail::new(
                    format!(
                        "p < {ALPHA:e} (the test rejects a lying proposer; otherwise it has no power here)"
                    ),
                    fit.to_string(),
                ))
            };
            record(report, check, input, r);
            report.push_fit(fit);
        }
    }
}

fn greedy_params(cfg: &KitConfig, tree_nodes: usize) -> GenerationParams {
    GenerationParams::greedy(cfg.greedy_tokens())
        .with_draft(DraftLength::Fixed(cfg.draft_len()))
        .with_tree(TreeDrafts::nodes(tree_nodes))
}

fn run_greedy<T: TargetModel, Q: Proposer>(
    make: &mut impl FnMut() -> T,
    q: Q,
    p: &[u32],
    cfg: &KitConfig,
    tree_nodes: usize,
) -> std::result::Result<Vec<u32>, Fail> {
    let mut g = Generator::new(make(), q);
    let out = g.generate(p, &greedy_params(cfg, tree_nodes));
    ok(out.map_err(|e| e.error), "generate").map(|g| g.tokens)
}

fn same_greedy<T: TargetModel, Q: Proposer>(
    make: &mut impl FnMut() -> T,
    q: Q,
    p: &[u32],
    cfg: &KitConfig,
    tree_nodes: usize,
    plain: &[u32],
) -> Check {
    let got = run_greedy(make, q, p, cfg, tree_nodes)?;
    if got == plain {
        return Ok(());
    }
    let at = got
        .iter()
        .zip(plain)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(plain.len()));
    let f = Fail::new(
        format!("{plain:?} (plain greedy)"),
        format!("{got:?} (first difference at token {at})"),
    );
    match cfg.tolerance() {
        Tolerance::Exact => Err(f),
        Tolerance::Abs(_) => {
            Err(f.tolerated("the engine does not claim batch invariance (Tolerance::Abs)"))
        }
    }
}

/// The exact law of the first two sampled tokens.
struct Law {
    cells: Vec<((u32, u32), f64)>,
    first: TokenDist,
    vocab: usize,
}

impl Law {
    /// The lying proposer of the negative control, when the first token has two candidates.
    fn liar(&self) -> Option<Liar> {
        let mut ranked: Vec<(u32, f32)> = self
            .first
            .ids()
            .iter()
            .copied()
            .zip(self.first.probs().iter().copied())
            .collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let &(token, p) = ranked.get(1)?;
        (p > 1e-30).then(|| Liar {
            token,
            vocab: self.vocab,
            eps: (p / 1000.0).min(1e-6),
        })
    }
}

fn sampling(cfg: &KitConfig) -> std::result::Result<SamplingConfig, Fail> {
    ok(
        SamplingConfig::builder()
            .temperature(1.0)
            .top_k(cfg.top_k())
            .build(),
        "the sampling configuration",
    )
}

fn dist(
    proc: &mut RowProcessor,
    sc: &SamplingConfig,
    row: &[f32],
) -> std::result::Result<TokenDist, Fail> {
    let mut d = TokenDist::default();
    ok(
        proc.distribution(sc, row, &History::default(), RowKind::Target, 0, &mut d),
        "processing a row",
    )?;
    Ok(d)
}

fn exact_law<T: TargetModel>(
    make: &mut impl FnMut() -> T,
    p: &[u32],
    cfg: &KitConfig,
) -> std::result::Result<Law, Fail> {
    let sc = sampling(cfg)?;
    let mut m = make();
    let v = m.vocab_size();
    let mut proc = RowProcessor::new();
    let mut logits = Vec::new();
    ok(m.forward(p, &mut logits), "forward(prompt)")?;
    let first = dist(&mut proc, &sc, &logits[logits.len() - v..])?;
    let mut cells = Vec::new();
    let truncates = rollback_mode(&mut m) == RollbackMode::Truncate;
    for (&t1, &p1) in first.ids().iter().zip(first.probs()) {
        if truncates {
            ok(m.truncate(p.len()), "truncate(prompt length)")?;
        } else {
            // A state that cannot be truncated: a fresh engine per first token.
            m = make();
            ok(m.prefill(p), "prefill(prompt)")?;
        }
        ok(m.forward(&[t1], &mut logits), "forward(first token)")?;
        let second = dist(&mut proc, &sc, &logits)?;
        for (&t2, &p2) in second.ids().iter().zip(second.probs()) {
            cells.push(((t1, t2), p1 as f64 * p2 as f64));
        }
    }
    let total: f64 = cells.iter().map(|c| c.1).sum();
    for c in &mut cells {
        c.1 /= total;
    }
    Ok(Law {
        cells,
        first,
        vocab: v,
    })
}

fn sampled<T: TargetModel, Q: Proposer>(
    make: &mut impl FnMut() -> T,
    q: Q,
    p: &[u32],
    cfg: &KitConfig,
    law: &Law,
    check: &'static str,
) -> std::result::Result<Fit, Fail> {
    let index: BTreeMap<(u32, u32), usize> = law
        .cells
        .iter()
        .enumerate()
        .map(|(i, c)| (c.0, i))
        .collect();
    let mut counts = vec![0u64; law.cells.len()];
    let mut extra = 0u64;
    let mut g = Generator::new(make(), q);
    let sc = sampling(cfg)?;
    for s in 0..cfg.samples() as u64 {
        let params = GenerationParams {
            draft: DraftLength::Fixed(cfg.draft_len()),
            ..GenerationParams::sampled(sc.clone(), cfg.seed().wrapping_add(s), 2)
        };
        let out = ok(
            g.generate(p, &params).map_err(|e| e.error),
            format!("generate (seed {})", cfg.seed().wrapping_add(s)),
        )?;
        match (out.tokens.first(), out.tokens.get(1)) {
            (Some(&a), Some(&b)) => match index.get(&(a, b)) {
                Some(&i) => counts[i] += 1,
                None => extra += 1,
            },
            _ => {
                return Err(Fail::new(
                    "2 tokens per generation",
                    format!("{:?}", out.tokens),
                ));
            }
        }
    }
    let expected: Vec<f64> = law.cells.iter().map(|c| c.1).collect();
    let t = stats::fit(&counts, &expected, extra);
    Ok(Fit {
        check,
        samples: cfg.samples(),
        statistic: t.statistic,
        df: t.df,
        p_value: t.p_value,
        impossible: t.impossible,
    })
}

/// The negative control's proposer: drafts `token` and claims q(token) = `eps` (the rest
/// uniform), although it always drafts it.
struct Liar {
    token: u32,
    vocab: usize,
    eps: f32,
}

impl Proposer for Liar {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        if req.max_draft == 0 {
            return Ok(());
        }
        let rest = (1.0 - self.eps) / (self.vocab - 1) as f32;
        let mut q = vec![rest; self.vocab];
        q[self.token as usize] = self.eps;
        draft.tokens.push(self.token);
        draft.q = Some(q);
        draft.q_vocab = self.vocab;
        Ok(())
    }

    fn name(&self) -> &'static str {
        "conformance-liar"
    }
}

/// Random point-mass drafts keyed by the context length and seed.
struct RandomDrafts {
    vocab: usize,
}

impl Proposer for RandomDrafts {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let s = Stream::new(req.seed ^ 0xC0F0_4A11);
        let pos = req.context.len() as u64;
        for i in 0..req.max_draft {
            let b = s.bits(pos, i as u32)[0];
            draft.tokens.push((b as u64 % self.vocab as u64) as u32);
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "conformance-random"
    }
}

/// The engine as a draft model with its logits scaled by 0.6 (same argmax, flatter law), its
/// tree support passed through.
struct Tempered<T> {
    inner: T,
    tree_cap: usize,
}

const SCALE: f32 = 0.6;

impl<T: TargetModel> Tempered<T> {
    fn new(mut inner: T) -> Self {
        let tree_cap = inner.tree().map_or(0, |t| t.max_tree_nodes());
        Tempered { inner, tree_cap }
    }
}

impl<T: TargetModel> TargetModel for Tempered<T> {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.inner.forward(tokens, logits)?;
        logits.iter_mut().for_each(|x| *x *= SCALE);
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.inner.truncate(len)
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.inner.prefill(tokens)
    }
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        if self.tree_cap > 0 { Some(self) } else { None }
    }
    fn hidden_states(&self) -> Option<&dyn HiddenStates> {
        None
    }
    fn rollback(&mut self) -> Option<Rollback<'_>> {
        self.inner.rollback()
    }
}

impl<T: TargetModel> TreeTarget for Tempered<T> {
    fn max_tree_nodes(&self) -> usize {
        self.tree_cap
    }
    fn forward_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        match self.inner.tree() {
            Some(t) => t.forward_tree(root, block, logits)?,
            None => {
                return Err(crate::Error::TargetContract {
                    what: "tree() became None",
                });
            }
        }
        logits.iter_mut().for_each(|x| *x *= SCALE);
        Ok(())
    }
    fn commit_tree(&mut self, path: &[u32]) -> Result<()> {
        match self.inner.tree() {
            Some(t) => t.commit_tree(path),
            None => Err(crate::Error::TargetContract {
                what: "tree() became None",
            }),
        }
    }
}
