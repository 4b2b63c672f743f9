//! Token trees for the tree-verification suites (`tests/tree_closed_form.rs`,
//! `tests/tree_statistical.rs`): tree shapes, drafting each sibling group as its
//! [`SiblingScheme`] says, the exact law of a verify step in f64, and a test-local sampler of
//! that law with the deliberate faults of the negative controls.
//!
//! The rules, at a row with processed target `p` and siblings `x_0 .. x_{m-1}` (SpecInfer, Miao
//! et al. 2024, section 4; Jeon et al. 2024 for samples without replacement):
//! - `Deterministic`: accept `x_j` with `p_j(x_j)`, where `p_j` is `p` without `x_0 .. x_{j-1}`,
//!   renormalised; all rejected: a sample of `p` without the siblings. This is the
//!   `WithReplacement` rule with `q_j` the point mass on `x_j` (`norm(max(0, p_j - δ_x))` is
//!   `p_j` without `x`), which is how [`row_law`] computes it.
//! - `WithReplacement`: accept `x_j` with `min(1, p_j(x_j) / q(x_j))`; on rejection
//!   `p_{j+1} = norm(max(0, p_j - q))`; all rejected: a sample of `p_m`.
//! - `WithoutReplacement`: the same with `q_j` = `q` without `x_0 .. x_{j-1}`, renormalised.
//! - A leaf emits a bonus token from its own row; a node whose token is the EOS ends the step.

use std::cell::RefCell;
use std::collections::HashMap;

use speculative::DraftBlock;
use speculative::rng::Stream;
use speculative::sampling::{History, RowProcessor, TokenCounts};
use speculative::{DraftProbs, RowKind, SamplingConfig, SiblingScheme, TokenDist, VerifyRequest};

use super::dense;

pub const DET: SiblingScheme = SiblingScheme::Deterministic;
pub const WR: SiblingScheme = SiblingScheme::WithReplacement;
pub const WOR: SiblingScheme = SiblingScheme::WithoutReplacement;

/// A deliberate fault of the sibling rule (the negative controls).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The rule as documented.
    None,
    /// (a) The residual is not updated between siblings: every sibling is tested against the
    /// row's target `p`, and the token emitted when all are rejected comes from the residual
    /// against the first sibling only.
    NoResidualUpdate,
    /// (b) Every sibling is tested independently against the unmodified target `p`, and the
    /// token emitted when all are rejected is a sample of `p`.
    Independent,
}

/// The shape of a draft tree: nodes in topological order, each with its parent row (0 = the
/// root, `j + 1` = node `j`), the scheme of its sibling group, and, for deterministic groups, its
/// fixed token (distinct among siblings). Sampled groups get their tokens when drafted.
#[derive(Debug, Clone, Default)]
pub struct Shape {
    pub parents: Vec<u32>,
    pub schemes: Vec<SiblingScheme>,
    pub fixed: Vec<u32>,
}

impl Shape {
    pub fn len(&self) -> usize {
        self.parents.len()
    }

    /// The nodes whose parent row is `row`, in order.
    pub fn children(&self, row: usize) -> Vec<usize> {
        (0..self.len())
            .filter(|&i| self.parents[i] as usize == row)
            .collect()
    }

    /// Adds a sibling group of `m` nodes under `row` with `scheme` and returns their indices.
    /// Deterministic groups take `fixed` (one distinct token per sibling); others ignore it.
    pub fn group(
        &mut self,
        row: usize,
        scheme: SiblingScheme,
        m: usize,
        fixed: &[u32],
    ) -> Vec<usize> {
        let start = self.len();
        for j in 0..m {
            self.parents.push(row as u32);
            self.schemes.push(scheme);
            self.fixed.push(fixed.get(j).copied().unwrap_or(0));
        }
        (start..start + m).collect()
    }

    /// `true` when a group is sampled (needs dense q).
    pub fn sampled(&self) -> bool {
        self.schemes.iter().any(|&s| s != DET)
    }

    /// A shape drawn from `seed`: depth up to `max_depth`, up to `max_sib` siblings per group,
    /// at most `max_nodes` nodes; group schemes from `schemes` (one picked per group);
    /// deterministic tokens distinct, below `token_range`.
    pub fn random(
        seed: u64,
        max_depth: usize,
        max_sib: usize,
        max_nodes: usize,
        schemes: &[SiblingScheme],
        token_range: usize,
    ) -> Shape {
        let mut rng = SplitMix(seed);
        let mut s = Shape::default();
        // (row, depth of the row)
        let mut open = vec![(0usize, 0usize)];
        let mut next = 0;
        while next < open.len() {
            let (row, depth) = open[next];
            next += 1;
            if depth >= max_depth || s.len() >= max_nodes {
                continue;
            }
            // The root always has children; deeper rows with probability 0.65.
            if row != 0 && rng.below(100) >= 65 {
                continue;
            }
            let m = (1 + rng.below(max_sib as u64) as usize)
                .min(max_nodes - s.len())
                .min(token_range);
            let scheme = schemes[rng.below(schemes.len() as u64) as usize];
            let mut pool: Vec<u32> = (0..token_range as u32).collect();
            let mut fixed = Vec::new();
            for _ in 0..m {
                let i = rng.below(pool.len() as u64) as usize;
                fixed.push(pool.swap_remove(i));
            }
            for node in s.group(row, scheme, m, &fixed) {
                open.push((node + 1, depth + 1));
            }
        }
        s
    }
}

/// SplitMix64: the tests' own small generator (shapes and draft draws).
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A processed distribution as normalised f64 probabilities over `width` tokens.
pub fn normalised(d: &TokenDist, width: usize) -> Vec<f64> {
    let mut out = vec![0.0f64; width];
    for (&t, &p) in d.ids().iter().zip(d.probs()) {
        out[t as usize] = p as f64;
    }
    normalise(&mut out);
    out
}

/// Divides by the total (left alone when the total is 0); returns the total.
pub fn normalise(v: &mut [f64]) -> f64 {
    let s: f64 = v.iter().sum();
    if s > 0.0 {
        for x in v.iter_mut() {
            *x /= s;
        }
    }
    s
}

/// Inverse-CDF draw from f64 weights (need not be normalised) at uniform `u`; `None` when all
/// weights are 0.
pub fn sample_f64(w: &[f64], u: f64) -> Option<u32> {
    let total: f64 = w.iter().sum();
    if total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut acc = 0.0;
    let mut last = None;
    for (i, &x) in w.iter().enumerate() {
        if x > 0.0 {
            acc += x;
            last = Some(i as u32);
            if target < acc {
                return last;
            }
        }
    }
    last
}

/// The conditional law of one row's outcome given the sibling tokens: `accept[j]` is the
/// probability that sibling `j` is accepted, `reject` that all are, and `residual` (normalised)
/// the law of the token emitted then.
#[derive(Debug, Clone)]
pub struct RowLaw {
    pub accept: Vec<f64>,
    pub reject: f64,
    pub residual: Vec<f64>,
}

/// The rule of `scheme` (with `fault`) at one row: `p` the processed target (`[vocab]`,
/// normalised), `q` the group's draft distribution (`[vocab]`, zero-padded; `None` for
/// deterministic groups), `xs` the siblings in order.
pub fn row_law(
    scheme: SiblingScheme,
    fault: Fault,
    p: &[f64],
    q: Option<&[f64]>,
    xs: &[u32],
) -> RowLaw {
    let v = p.len();
    let mut accept = vec![0.0f64; xs.len()];
    let mut reach = 1.0f64;
    let mut pj = p.to_vec();
    let mut qj: Vec<f64> = match scheme {
        DET => vec![0.0; v],
        _ => q.expect("a sampled group has q").to_vec(),
    };
    for (j, &x) in xs.iter().enumerate() {
        let x = x as usize;
        let qrow: Vec<f64> = if scheme == DET {
            let mut one = vec![0.0; v];
            one[x] = 1.0;
            one
        } else {
            qj.clone()
        };
        let tested = if fault == Fault::None { &pj } else { p };
        assert!(qrow[x] > 0.0, "sibling {j} (token {x}) has q = 0");
        let a = (tested[x] / qrow[x]).min(1.0);
        accept[j] = reach * a;
        reach *= 1.0 - a;
        let update = match fault {
            Fault::None => true,
            Fault::NoResidualUpdate => j == 0,
            Fault::Independent => false,
        };
        if update {
            let mut res: Vec<f64> = pj
                .iter()
                .zip(&qrow)
                .map(|(&a, &b)| (a - b).max(0.0))
                .collect();
            // Zero residual mass means p_j == q, where rejection has probability 0.
            if normalise(&mut res) > 0.0 {
                pj = res;
            }
        }
        if scheme == WOR {
            qj[x] = 0.0;
            normalise(&mut qj);
        }
    }
    RowLaw {
        accept,
        reject: reach.max(0.0),
        residual: pj,
    }
}

/// Every way a group of `m` siblings can be drawn from `q` (`[vocab]`, normalised) under
/// `scheme`, with its probability: with replacement `q`-i.i.d. tuples; without replacement
/// ordered tuples of distinct tokens, `prod q(x_j) / (1 - q(x_0) - .. - q(x_{j-1}))`, as many
/// siblings as `q`'s support allows (at most `m`).
pub fn group_configs(scheme: SiblingScheme, m: usize, q: &[f64]) -> Vec<(f64, Vec<u32>)> {
    let support: Vec<u32> = (0..q.len() as u32)
        .filter(|&t| q[t as usize] > 0.0)
        .collect();
    let m = if scheme == WOR {
        m.min(support.len())
    } else {
        m
    };
    let mut out = Vec::new();
    let mut cur = Vec::with_capacity(m);
    fn rec(
        scheme: SiblingScheme,
        m: usize,
        q: &[f64],
        support: &[u32],
        w: f64,
        cur: &mut Vec<u32>,
        out: &mut Vec<(f64, Vec<u32>)>,
    ) {
        if cur.len() == m {
            out.push((w, cur.clone()));
            return;
        }
        let left: f64 = if scheme == WOR {
            support
                .iter()
                .filter(|t| !cur.contains(t))
                .map(|&t| q[t as usize])
                .sum()
        } else {
            1.0
        };
        for &t in support {
            if scheme == WOR && cur.contains(&t) {
                continue;
            }
            cur.push(t);
            rec(scheme, m, q, support, w * q[t as usize] / left, cur, out);
            cur.pop();
        }
    }
    rec(scheme, m, q, &support, 1.0, &mut cur, &mut out);
    out
}

/// How deterministic groups choose their tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DetChoice {
    /// The shape's fixed tokens.
    Fixed,
    /// The `m` most likely tokens of the processed draft distribution at the row (ties to the
    /// lower id); fewer when its support is smaller.
    TopOfDraft,
}

/// The target and draft models, the context and the configuration of a step.
pub struct Models<'a> {
    pub cfg: &'a SamplingConfig,
    pub vocab: usize,
    /// Draft vocabulary (`<= vocab`; q is 0 beyond it).
    pub qv: usize,
    pub ctx: &'a [u32],
    /// Raw target logits after a whole sequence (context + path), `[vocab]`.
    pub target: &'a dyn Fn(&[u32]) -> Vec<f32>,
    /// Raw draft logits after a whole sequence, `[qv]`.
    pub draft: &'a dyn Fn(&[u32]) -> Vec<f32>,
    /// A token that ends the sequence (its node is a leaf that ends the step).
    pub eos: Option<u32>,
    pub det: DetChoice,
    /// Leading context tokens that are the prompt (frequency and presence penalties skip them).
    pub prompt_len: usize,
    /// Tokens banned at depths `0..suppress_rows` (`min_tokens`).
    pub suppress: &'a [u32],
    pub suppress_rows: usize,
}

impl Models<'_> {
    pub fn seq(&self, path: &[u32]) -> Vec<u32> {
        let mut s = self.ctx.to_vec();
        s.extend_from_slice(path);
        s
    }

    /// `logits` processed with the history of the row after `path`: penalties over the context
    /// (the prompt part as the request says) and the path, the suppressed tokens at depths
    /// below `suppress_rows`.
    pub fn process(&self, logits: &[f32], path: &[u32]) -> TokenDist {
        let s = self.seq(path);
        let counts = TokenCounts::from_context(&s, self.prompt_len, self.vocab).unwrap();
        let hist = History {
            counts: Some(&counts),
            prefix: &s,
            suppress: if path.len() < self.suppress_rows {
                self.suppress
            } else {
                &[]
            },
        };
        let mut d = TokenDist::default();
        RowProcessor::new()
            .distribution(self.cfg, logits, &hist, RowKind::Target, 0, &mut d)
            .unwrap();
        d
    }

    /// The processed target after `path`, normalised, `[vocab]`.
    pub fn p(&self, path: &[u32]) -> Vec<f64> {
        let s = self.seq(path);
        normalised(&self.process(&(self.target)(&s), path), self.vocab)
    }

    /// The processed draft distribution after `path` (`[qv]`), with the target's history.
    pub fn q_dist(&self, path: &[u32]) -> TokenDist {
        let s = self.seq(path);
        self.process(&(self.draft)(&s), path)
    }

    /// [`Models::q_dist`] normalised and zero-padded to `[vocab]`.
    pub fn q(&self, path: &[u32]) -> Vec<f64> {
        normalised(&self.q_dist(path), self.vocab)
    }

    /// The tokens of a deterministic group (shape nodes `group`) after `path`.
    pub fn det_tokens(&self, shape: &Shape, group: &[usize], path: &[u32]) -> Vec<u32> {
        match self.det {
            DetChoice::Fixed => group.iter().map(|&n| shape.fixed[n]).collect(),
            DetChoice::TopOfDraft => {
                let q = self.q(path);
                let mut order: Vec<u32> = (0..self.vocab as u32)
                    .filter(|&t| q[t as usize] > 0.0)
                    .collect();
                order.sort_by(|&a, &b| q[b as usize].total_cmp(&q[a as usize]).then(a.cmp(&b)));
                order.truncate(group.len());
                order
            }
        }
    }

    /// `true` when the group needs q: sampled, or deterministic from the draft.
    fn needs_q(&self, scheme: SiblingScheme) -> bool {
        scheme != DET || self.det == DetChoice::TopOfDraft
    }
}

/// A memoised law: (shape row or `usize::MAX` for none, path after the context, length).
type LawKey = (usize, Vec<u32>, usize);

/// The exact law (f64) of the next `len` emitted tokens, marginalised over the drafts'
/// randomness and the verifier's rule.
///
/// A law over `len` tokens is a vector of `(vocab + 1)^len` cells: cell
/// `sum_i t_i (vocab + 1)^(len - 1 - i)`, where after the EOS the remaining tokens are the
/// symbol `vocab` (stop).
pub struct LawCalc<'a> {
    pub models: &'a Models<'a>,
    pub shape: &'a Shape,
    pub fault: Fault,
    /// Groups drawn without replacement are verified with the with-replacement rule (fault (c)).
    pub wor_as_wr: bool,
    memo: RefCell<HashMap<LawKey, Vec<f64>>>,
}

impl<'a> LawCalc<'a> {
    pub fn new(models: &'a Models<'a>, shape: &'a Shape) -> Self {
        LawCalc {
            models,
            shape,
            fault: Fault::None,
            wor_as_wr: false,
            memo: RefCell::new(HashMap::new()),
        }
    }

    /// The law of the next `len` tokens after `path` when the step's next row is shape row
    /// `row` (`None`: no draft there, plain sampling from the target).
    pub fn law(&self, row: Option<usize>, path: &[u32], len: usize) -> Vec<f64> {
        if len == 0 {
            return vec![1.0];
        }
        let key = (row.unwrap_or(usize::MAX), path.to_vec(), len);
        if let Some(v) = self.memo.borrow().get(&key) {
            return v.clone();
        }
        let m = self.models;
        let v = m.vocab;
        let tail = (v + 1).pow(len as u32 - 1);
        let mut out = vec![0.0f64; (v + 1).pow(len as u32)];
        let p = m.p(path);
        let emit = |out: &mut Vec<f64>, a: u32, w: f64, next: Option<usize>| {
            if w <= 0.0 {
                return;
            }
            let base = a as usize * tail;
            if m.eos == Some(a) {
                out[base + tail - 1] += w;
                return;
            }
            let mut path2 = path.to_vec();
            path2.push(a);
            for (i, c) in self.law(next, &path2, len - 1).into_iter().enumerate() {
                out[base + i] += w * c;
            }
        };
        let group = row.map(|r| self.shape.children(r)).unwrap_or_default();
        if group.is_empty() {
            for (a, &pa) in p.iter().enumerate() {
                emit(&mut out, a as u32, pa, None);
            }
        } else {
            let scheme = self.shape.schemes[group[0]];
            let q = m.needs_q(scheme).then(|| m.q(path));
            let configs = match scheme {
                DET => vec![(1.0, m.det_tokens(self.shape, &group, path))],
                _ => group_configs(scheme, group.len(), q.as_deref().unwrap()),
            };
            let rule = if self.wor_as_wr && scheme == WOR {
                WR
            } else {
                scheme
            };
            let rule_q = if scheme == DET { None } else { q.as_deref() };
            for (w, xs) in configs {
                let law = row_law(rule, self.fault, &p, rule_q, &xs);
                for (j, &x) in xs.iter().enumerate() {
                    emit(&mut out, x, w * law.accept[j], Some(group[j] + 1));
                }
                for a in 0..v {
                    emit(&mut out, a as u32, w * law.reject * law.residual[a], None);
                }
            }
        }
        self.memo.borrow_mut().insert(key, out.clone());
        out
    }

    /// The processed target's law of the next `len` tokens after `path` (plain sampling).
    pub fn target(&self, path: &[u32], len: usize) -> Vec<f64> {
        self.law(None, path, len)
    }
}

/// The form in which an instance hands q to the verifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QForm {
    /// Point masses (every group deterministic).
    PointMass,
    /// Dense processed q rows (one-hot rows for deterministic nodes).
    Probs,
    /// Raw draft logits (deterministic nodes carry their row too).
    Logits,
}

/// One drafted tree, ready for the verifier: `[n]` tokens, parent rows, schemes and ends,
/// `[n + 1, vocab]` target logits, and the q rows of the chosen form (`[n, qv]`).
#[derive(Debug, Clone)]
pub struct Instance {
    pub vocab: usize,
    pub qv: usize,
    pub tokens: Vec<u32>,
    pub parents: Vec<u32>,
    pub schemes: Vec<SiblingScheme>,
    pub ends: Vec<bool>,
    pub target: Vec<f32>,
    pub q: Vec<f32>,
    pub form: QForm,
    /// Tokens after the context leading to each row (`[n + 1]`; row 0: empty).
    pub paths: Vec<Vec<u32>>,
    /// The request's prompt length and suppressed tokens (from the models).
    pub prompt_len: usize,
    pub suppress: Vec<u32>,
    pub suppress_rows: usize,
}

impl Instance {
    /// Drafts `shape` after `models.ctx`: deterministic groups take their tokens, sampled groups
    /// draw theirs from q with `rng` as their scheme says (without replacement: as many as q's
    /// support allows; siblings not drawn are dropped with their subtrees), and nodes whose
    /// token is the EOS become ending leaves.
    pub fn draft(models: &Models<'_>, shape: &Shape, form: QForm, rng: &mut SplitMix) -> Self {
        assert!(form != QForm::PointMass || !shape.sampled());
        let mut inst = Instance {
            vocab: models.vocab,
            qv: models.qv,
            tokens: Vec::new(),
            parents: Vec::new(),
            schemes: Vec::new(),
            ends: Vec::new(),
            target: (models.target)(models.ctx),
            q: Vec::new(),
            form,
            paths: vec![Vec::new()],
            prompt_len: models.prompt_len,
            suppress: models.suppress.to_vec(),
            suppress_rows: models.suppress_rows,
        };
        let mut map: Vec<Option<usize>> = vec![None; shape.len()];
        for srow in 0..=shape.len() {
            let irow = if srow == 0 {
                0
            } else {
                match map[srow - 1] {
                    Some(i) if !inst.ends[i] => i + 1,
                    _ => continue,
                }
            };
            let group = shape.children(srow);
            if group.is_empty() {
                continue;
            }
            let path = inst.paths[irow].clone();
            let scheme = shape.schemes[group[0]];
            let q = models.needs_q(scheme).then(|| models.q_dist(&path));
            let xs: Vec<u32> = match scheme {
                DET => models.det_tokens(shape, &group, &path),
                _ => {
                    let mut w = normalised(q.as_ref().unwrap(), models.vocab);
                    let mut xs = Vec::new();
                    for _ in 0..group.len() {
                        let Some(x) = sample_f64(&w, rng.uniform()) else {
                            break;
                        };
                        xs.push(x);
                        if scheme == WOR {
                            w[x as usize] = 0.0;
                        }
                    }
                    xs
                }
            };
            let draft_row = (form == QForm::Logits).then(|| (models.draft)(&models.seq(&path)));
            for (j, &x) in xs.iter().enumerate() {
                map[group[j]] = Some(inst.tokens.len());
                inst.tokens.push(x);
                inst.parents.push(irow as u32);
                inst.schemes.push(scheme);
                inst.ends.push(models.eos == Some(x));
                match form {
                    QForm::PointMass => {}
                    QForm::Probs if scheme == DET => {
                        assert!((x as usize) < models.qv);
                        let mut one = vec![0.0f32; models.qv];
                        one[x as usize] = 1.0;
                        inst.q.extend(one);
                    }
                    QForm::Probs => inst.q.extend(dense(q.as_ref().unwrap(), models.qv)),
                    // (A deterministic node's row is the draft's row too; the rule reads none.)
                    QForm::Logits => inst.q.extend_from_slice(draft_row.as_ref().unwrap()),
                }
                let mut p2 = path.clone();
                p2.push(x);
                inst.target.extend((models.target)(&models.seq(&p2)));
                inst.paths.push(p2);
            }
        }
        // A tree in the shape of a chain whose final node ends reads no row after it.
        let rows = DraftBlock::tree(&inst.tokens, &inst.parents)
            .with_ends(&inst.ends)
            .verify_rows();
        inst.target.truncate(rows * inst.vocab);
        inst
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn children(&self, row: usize) -> Vec<usize> {
        (0..self.len())
            .filter(|&i| self.parents[i] as usize == row)
            .collect()
    }

    /// The verify request for this tree (context, seed); `schemes` overrides the schemes
    /// (fault (c)).
    pub fn request<'a>(
        &'a self,
        cfg: &'a SamplingConfig,
        ctx: &'a [u32],
        seed: u64,
        schemes: &'a [SiblingScheme],
    ) -> VerifyRequest<'a> {
        let q = match self.form {
            QForm::PointMass => DraftProbs::PointMass,
            QForm::Probs => DraftProbs::Probs {
                probs: &self.q,
                vocab: self.qv,
            },
            QForm::Logits => DraftProbs::Logits {
                logits: &self.q,
                vocab: self.qv,
            },
        };
        VerifyRequest::new(cfg, &self.target, self.vocab, &self.tokens)
            .draft(
                DraftBlock::tree(&self.tokens, &self.parents)
                    .with_schemes(schemes)
                    .with_ends(&self.ends),
            )
            .draft_probs(q)
            .context(ctx)
            .seed(seed)
            .prompt_len(self.prompt_len)
            .suppress(&self.suppress, self.suppress_rows)
    }

    /// The schemes with groups drawn without replacement relabelled as with replacement.
    pub fn schemes_wor_as_wr(&self) -> Vec<SiblingScheme> {
        self.schemes
            .iter()
            .map(|&s| if s == WOR { WR } else { s })
            .collect()
    }
}

/// What one verify step returned: the accepted path (node indices) and the emitted token
/// (`None`: an accepted ending node, no bonus).
pub type Outcome = (Vec<u32>, Option<u32>);

/// The rule applied to a drafted tree: at each row the verifier's decision given the drafts.
pub struct StepRule<'a> {
    pub models: &'a Models<'a>,
    pub inst: &'a Instance,
    pub fault: Fault,
    pub wor_as_wr: bool,
}

impl StepRule<'_> {
    fn row(&self, row: usize) -> (Vec<usize>, RowLaw, Vec<f64>) {
        let m = self.models;
        let path = &self.inst.paths[row];
        let p = m.p(path);
        let group = self.inst.children(row);
        if group.is_empty() {
            return (
                group,
                RowLaw {
                    accept: vec![],
                    reject: 1.0,
                    residual: p.clone(),
                },
                p,
            );
        }
        let scheme = self.inst.schemes[group[0]];
        let q = (scheme != DET).then(|| m.q(path));
        let xs: Vec<u32> = group.iter().map(|&n| self.inst.tokens[n]).collect();
        let rule = if self.wor_as_wr && scheme == WOR {
            WR
        } else {
            scheme
        };
        let law = row_law(rule, self.fault, &p, q.as_deref(), &xs);
        (group, law, p)
    }

    /// The exact law of the step's outcome given the drafts.
    pub fn law(&self) -> HashMap<Outcome, f64> {
        let mut out = HashMap::new();
        self.law_from(0, Vec::new(), 1.0, &mut out);
        out
    }

    fn law_from(&self, row: usize, nodes: Vec<u32>, w: f64, out: &mut HashMap<Outcome, f64>) {
        let (group, law, _) = self.row(row);
        for (j, &n) in group.iter().enumerate() {
            let wj = w * law.accept[j];
            if wj <= 0.0 {
                continue;
            }
            let mut nodes2 = nodes.clone();
            nodes2.push(n as u32);
            if self.inst.ends[n] {
                *out.entry((nodes2, None)).or_insert(0.0) += wj;
            } else {
                self.law_from(n + 1, nodes2, wj, out);
            }
        }
        for (a, &r) in law.residual.iter().enumerate() {
            let wa = w * law.reject * r;
            if wa > 0.0 {
                *out.entry((nodes.clone(), Some(a as u32))).or_insert(0.0) += wa;
            }
        }
    }

    /// One draw of the step's outcome (the test-local verifier of the negative controls), with
    /// uniforms from `Stream::new(seed)` on the caller's lanes.
    pub fn sample(&self, seed: u64) -> Outcome {
        let stream = Stream::new(seed);
        let mut nodes = Vec::new();
        let mut row = 0;
        loop {
            let (group, law, _) = self.row(row);
            let u = stream.rng(row as u64, 7).next_u64_f64();
            let mut acc = 0.0;
            let mut chosen = None;
            for (j, &n) in group.iter().enumerate() {
                acc += law.accept[j];
                if u < acc {
                    chosen = Some(n);
                    break;
                }
            }
            match chosen {
                Some(n) => {
                    nodes.push(n as u32);
                    if self.inst.ends[n] {
                        return (nodes, None);
                    }
                    row = n + 1;
                }
                None => {
                    let u2 = stream.rng(row as u64, 8).next_u64_f64();
                    let t = sample_f64(&law.residual, u2).expect("a residual has mass");
                    return (nodes, Some(t));
                }
            }
        }
    }
}

/// Uniform f64 from a `rand::RngCore`.
pub trait UniformF64 {
    fn next_u64_f64(&mut self) -> f64;
}

impl<R: rand::RngCore> UniformF64 for R {
    fn next_u64_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The tokens of an outcome: the accepted nodes' tokens, then the emitted token.
pub fn outcome_tokens(inst: &Instance, o: &Outcome) -> Vec<u32> {
    let mut t: Vec<u32> = o.0.iter().map(|&n| inst.tokens[n as usize]).collect();
    t.extend(o.1);
    t
}
