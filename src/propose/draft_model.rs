//! A draft model proposer: a smaller model samples the draft (Leviathan et al. 2023; Chen et al.
//! 2023).

use super::sampler::DraftSampler;
use super::{Draft, ProposeRequest, Proposer};
use crate::error::{Error, Result};
use crate::model::{self, RollbackMode, TargetModel, rollback_mode};
use crate::tree::{DraftBlock, SiblingScheme};

/// Shape of the token trees [`DraftModelProposer`] grows with [`Proposer::propose_tree`]
/// (EAGLE-2, Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
/// Trees", section 4: expand the nodes of highest cumulative draft probability).
///
/// | field | default | range |
/// |---|---|---|
/// | `beam` | 4 | `1 ..= 64` |
/// | `children` | 4 | `1 ..= 64` |
///
/// `#[non_exhaustive]`: build it from [`DraftTreeConfig::default`] and the `with_` setters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DraftTreeConfig {
    /// Nodes expanded per depth (the beam width): the nodes of the newest depth with the highest
    /// cumulative draft probability (the product of the draft probabilities along the node's
    /// path), EOS nodes never. Each depth costs one tree forward of the draft model over the
    /// beam and its ancestors (at most `beam * depth` nodes).
    pub beam: usize,
    /// Children per expanded node, at most (also capped by [`ProposeRequest::max_branch`]): the
    /// top ids of the node's processed draft row (greedy requests) or draws without replacement
    /// from it (sampling requests).
    pub children: usize,
}

impl DraftTreeConfig {
    /// Sets [`DraftTreeConfig::beam`] (checked by [`DraftTreeConfig::validate`]).
    pub fn with_beam(mut self, beam: usize) -> Self {
        self.beam = beam;
        self
    }

    /// Sets [`DraftTreeConfig::children`] (checked by [`DraftTreeConfig::validate`]).
    pub fn with_children(mut self, children: usize) -> Self {
        self.children = children;
        self
    }
}

impl Default for DraftTreeConfig {
    /// `beam` 4, `children` 4.
    fn default() -> Self {
        DraftTreeConfig {
            beam: 4,
            children: 4,
        }
    }
}

impl DraftTreeConfig {
    /// Checks every field against the ranges in the table of [`DraftTreeConfig`]. `O(1)`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first offending field.
    pub fn validate(&self) -> Result<()> {
        if !(1..=64).contains(&self.beam) {
            return Err(Error::config("beam", self.beam, "must be in 1..=64"));
        }
        if !(1..=64).contains(&self.children) {
            return Err(Error::config(
                "children",
                self.children,
                "must be in 1..=64",
            ));
        }
        Ok(())
    }
}

/// A node of a draft tree being grown: token, parent row (0 = the root, `j + 1` = node `j`)
/// and cumulative draft log-probability.
#[derive(Debug, Clone, Copy)]
struct Node {
    token: u32,
    parent: u32,
    score: f64,
}

/// The tokens of the path from the root's child down to row `row` (0 = the root: empty).
fn path_tokens(nodes: &[Node], row: usize, out: &mut Vec<u32>) {
    out.clear();
    let mut r = row;
    while r > 0 {
        let n = &nodes[r - 1];
        out.push(n.token);
        r = n.parent as usize;
    }
    out.reverse();
}

/// `true` when node `a` ranks before node `b`: higher score, ties to the lower index.
fn ranks_before(nodes: &[Node], a: usize, b: usize) -> bool {
    match nodes[a].score.total_cmp(&nodes[b].score) {
        std::cmp::Ordering::Greater => true,
        std::cmp::Ordering::Less => false,
        std::cmp::Ordering::Equal => a < b,
    }
}

/// Node indices sorted best first (score descending, ties to the lower index).
fn ranked(nodes: &[Node], idx: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut v: Vec<usize> = idx.collect();
    v.sort_by(|&a, &b| nodes[b].score.total_cmp(&nodes[a].score).then(a.cmp(&b)));
    v
}

/// Wraps any [`TargetModel`] as a draft model.
///
/// At each step it samples `k` tokens one at a time from its processed distribution (the
/// request's [`crate::SamplingConfig`], penalties counting the context plus earlier drafts),
/// drawing uniforms from [`Stream`](crate::rng::Stream) keyed by the request seed on lane [`lane::DRAFT`](crate::rng::lane::DRAFT), and returns
/// the probabilities q it sampled from (`[k, draft_vocab]`). In greedy mode it proposes the
/// argmax chain and returns no q.
///
/// Its KV cache is kept in step with the context: before proposing it truncates to the longest
/// common prefix of what it has seen and the current context (rollback after a rejection) and
/// feeds the missing tokens (catch-up on the correction or bonus token). Costs `k` draft
/// forwards per step (the first one feeds every token not yet seen). The first proposal of a
/// generation feeds the context but its last token through [`TargetModel::prefill`], which lets
/// the model skip its output head for those rows; a generation in which the draft-length policy
/// never asks for drafts never runs the draft model.
///
/// The draft ends at its first EOS id ([`ProposeRequest::eos`]): no draft row after it is
/// computed or processed, so a caller's [`crate::TokenMask`] that allows nothing after an end
/// is never asked about one.
///
/// # State across requests
///
/// The model's sequence is exactly the tokens it has seen, and every call compares them in full
/// with `req.context` (a `memcmp` when the context extends them, else a scan for the longest
/// common prefix). A context from another request, or one that shrank or changed anywhere, keeps
/// only the common prefix and recomputes the rest, as [`Proposer::begin`] followed by a
/// proposal would. If the model's sequence length no longer matches what the proposer fed (the
/// model was driven from elsewhere), the proposer starts over from an empty sequence. So the
/// drafts never depend on an earlier request: they equal a fresh proposer's drafts on the same
/// context (for a model whose logits depend only on its sequence).
///
/// # Feature-conditioned draft models
///
/// An EAGLE draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
/// Uncertainty") reads, at each position, the token and the target's hidden state of the
/// previous position. Such a model implements [`crate::TargetFeatures`] and offers it through
/// [`TargetModel::target_features`]. When the request carries the target's rows
/// ([`ProposeRequest::target_hidden_rows`], `[context.len() - 1, hidden_size]`, which the
/// decoding loop passes for a target with [`crate::HiddenStates`]), each proposal first calls
/// [`crate::TargetFeatures::set_target_hidden`] with the rows from the first position whose
/// feature may have changed: the longest common prefix of the model's sequence and the context
/// (so, in a generation, from the previous step's last context position: `kept` rows per
/// step), capped by the positions whose held features it set itself. The model then holds the
/// target's features of every context position but the last and drops its rows that read a
/// later feature (the draft rows of the previous step, computed from its own features), and the
/// catch-up recomputes the accepted tokens' rows from the target's features. Draft rows read
/// the model's own predicted features. Checks: the rows' length must be
/// `(context.len() - 1) * hidden_size` of the draft model (else [`Error::ShapeMismatch`]). A
/// request without rows leaves the held features as they are (and no longer trusts them from
/// the first changed position on). [`Proposer::begin`] leaves them too: the first proposal of
/// a generation replaces them all (its common prefix is empty).
///
/// # Draft models that cannot truncate
///
/// A recurrent or hybrid draft model ([`TargetModel::rollback`], see [`crate::Rollback`]) is
/// rolled back with the same capability as a target: in snapshot mode the proposer saves its
/// state after each catch-up (before the drafts are fed) and, at the next proposal, restores
/// it and feeds the accepted drafts again with the rest of the catch-up (one prefill: the
/// replay); with row states it keeps the rows of the accepted drafts
/// ([`crate::RowStates::keep_rows`]: each draft was one forward since the commit point). A
/// context that diverged before the saved point starts over from an empty sequence. Such a
/// model drafts chains ([`Proposer::propose_tree`] falls back to [`Proposer::propose`]).
///
/// # Trees
///
/// [`Proposer::propose_tree`] grows EAGLE-2 style token trees when the draft model offers tree
/// support ([`TargetModel::tree`]), shaped by [`DraftTreeConfig`] (see the method's docs for
/// the greedy and the sampled rules); one draft tree forward per depth after the first.
///
/// `DraftModelProposer<M>` is `Send` when `M` is `Send`, and `Sync` when `M` is `Sync`.
#[derive(Debug)]
pub struct DraftModelProposer<M> {
    model: M,
    seen: Vec<u32>,
    sampler: DraftSampler,
    logits: Vec<f32>,
    tree: DraftTreeConfig,
    /// Leading positions of `seen` whose target features the model holds (feature-conditioned
    /// models only): set to the context's feature rows at each proposal that has them.
    features_valid: usize,
    /// A draft model in snapshot mode: the length of its saved state (saved after each
    /// catch-up), `None` when none is saved.
    snap: Option<usize>,
    /// A draft model with row states: its commit point ([`crate::RowStates`]).
    commit: usize,
}

impl<M: TargetModel> DraftModelProposer<M> {
    /// Wraps `model` (its sequence is reset at the start of each generation), with the default
    /// [`DraftTreeConfig`].
    pub fn new(model: M) -> Self {
        DraftModelProposer {
            model,
            seen: Vec::new(),
            sampler: DraftSampler::default(),
            logits: Vec::new(),
            tree: DraftTreeConfig::default(),
            features_valid: 0,
            snap: None,
            commit: 0,
        }
    }

    /// Sets the shape of the trees of [`Proposer::propose_tree`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] as [`DraftTreeConfig::validate`].
    pub fn with_tree_config(mut self, tree: DraftTreeConfig) -> Result<Self> {
        tree.validate()?;
        self.tree = tree;
        Ok(self)
    }

    /// The shape of the trees of [`Proposer::propose_tree`].
    pub fn tree_config(&self) -> DraftTreeConfig {
        self.tree
    }

    /// The wrapped model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// Gives back the wrapped model.
    pub fn into_inner(self) -> M {
        self.model
    }

    /// Feeds `tokens` and keeps the last row of logits in `self.logits`.
    fn feed(&mut self, tokens: &[u32]) -> Result<()> {
        self.model.forward(tokens, &mut self.logits)?;
        self.seen.extend_from_slice(tokens);
        let v = self.model.vocab_size();
        let n = self.logits.len();
        if n != tokens.len() * v || n < v {
            return Err(Error::ShapeMismatch {
                what: "draft model logits ([n, vocab])",
                expected: tokens.len() * v,
                actual: n,
            });
        }
        self.logits.drain(..n - v);
        Ok(())
    }

    /// Brings the model's sequence to exactly `ctx` (`ctx` not empty): truncates to the longest
    /// common prefix of what it has seen and `ctx` (at most `ctx.len() - 1`, so that at least
    /// the last token is fed), then feeds the rest; the first proposal of a generation prefills
    /// all but the last token. Leaves the row after `ctx.last()` in `self.logits`.
    fn catch_up(&mut self, ctx: &[u32]) -> Result<()> {
        // Roll back to the common prefix, keeping at least one token to feed. The whole seen
        // sequence is compared (exact stale-state detection): a memcmp in the usual case where
        // the context extends it.
        let common = if self.model.seq_len() != self.seen.len() {
            0
        } else if ctx.get(..self.seen.len()) == Some(&self.seen[..]) {
            self.seen.len()
        } else {
            self.seen
                .iter()
                .zip(ctx)
                .take_while(|(a, b)| a == b)
                .count()
        }
        .min(ctx.len() - 1);
        let common = self.rewind(common)?;
        if common == 0 && ctx.len() > 1 {
            // First proposal of a generation: the prompt's rows need no logits.
            let head = &ctx[..ctx.len() - 1];
            self.prefill(head)?;
            self.feed(&ctx[ctx.len() - 1..])?;
        } else {
            // Only the last row's logits are read: the rows before it are prefilled.
            let last = ctx.len() - 1;
            if last > common {
                self.prefill(&ctx[common..last])?;
            }
            self.feed(&ctx[last..])?;
        }
        if rollback_mode(&mut self.model) == RollbackMode::Snapshot {
            // The drafts are fed after this point: the next proposal restores it.
            self.snap = None;
            model::save_state(&mut self.model)?;
            self.snap = Some(self.seen.len());
        }
        Ok(())
    }

    /// Prefills `tokens` (their logits are not read) and records them as seen.
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.model.prefill(tokens)?;
        self.seen.extend_from_slice(tokens);
        self.commit = self.seen.len();
        Ok(())
    }

    /// Brings the model back to the first `common` tokens of `seen` and returns the length it
    /// holds afterwards (`<= common`; the caller feeds the rest). A model that can truncate is
    /// truncated to `common`. One that cannot ([`TargetModel::rollback`]) restores the state
    /// saved after the last catch-up and reaches its length (the accepted drafts are then fed
    /// again: the replay), or keeps the row states of the accepted drafts
    /// ([`crate::RowStates::keep_rows`], no replay); when neither reaches back far enough (a
    /// context that diverged before the last catch-up) it starts over from an empty sequence.
    fn rewind(&mut self, common: usize) -> Result<usize> {
        let reached = match rollback_mode(&mut self.model) {
            RollbackMode::Truncate => {
                self.model.truncate(common)?;
                common
            }
            _ if common == 0 => self.reset()?,
            RollbackMode::Snapshot if self.model.seq_len() == common => common,
            RollbackMode::Snapshot => match self.snap.filter(|&s| s <= common) {
                Some(s) => {
                    model::restore_state(&mut self.model)?;
                    if self.model.seq_len() == s {
                        s
                    } else {
                        self.reset()?
                    }
                }
                None => self.reset()?,
            },
            RollbackMode::RowStates => {
                let held = model::pending_rows(&mut self.model).unwrap_or(0);
                match common.checked_sub(self.commit).filter(|&r| r <= held) {
                    Some(rows) => {
                        model::keep_rows(&mut self.model, rows)?;
                        self.commit = common;
                        common
                    }
                    None => self.reset()?,
                }
            }
        };
        self.seen.truncate(reached);
        Ok(reached)
    }

    /// Empties the model's sequence (`truncate(0)`, which every model supports) and forgets
    /// its snapshot and commit point; returns 0.
    fn reset(&mut self) -> Result<usize> {
        self.model.truncate(0)?;
        self.seen.clear();
        self.snap = None;
        self.commit = 0;
        Ok(0)
    }

    /// Feature-conditioned draft models ([`TargetModel::target_features`]): hands the model the
    /// target's features of the context positions from the first one that may have changed,
    /// before [`DraftModelProposer::catch_up`]. `start` is the longest common prefix of what the
    /// model has seen and `ctx` (at most `ctx.len() - 1`), capped by the positions whose held
    /// features are known to belong to `seen` and by the model's held length; the model drops
    /// its rows after `start`, and `seen` follows it.
    ///
    /// Without rows (a target without hidden states) nothing is handed over; the held features
    /// from the first changed position on are then no longer trusted.
    fn sync_features(&mut self, ctx: &[u32], rows: Option<&[f32]>) -> Result<()> {
        let consistent = self.model.seq_len() == self.seen.len();
        let common = if consistent {
            self.seen
                .iter()
                .zip(ctx)
                .take_while(|(a, b)| a == b)
                .count()
                .min(ctx.len().saturating_sub(1))
        } else {
            0
        };
        let Some(rows) = rows else {
            self.features_valid = self.features_valid.min(common);
            return Ok(());
        };
        let Some(tf) = self.model.target_features() else {
            return Ok(());
        };
        let h = tf.hidden_size();
        if h == 0 {
            return Err(Error::TargetContract {
                what: "draft model target_features().hidden_size() is 0",
            });
        }
        let n = ctx.len().saturating_sub(1);
        if rows.len() != n * h {
            return Err(Error::ShapeMismatch {
                what: "target_hidden_rows ([context.len() - 1, draft model hidden_size])",
                expected: n * h,
                actual: rows.len(),
            });
        }
        let start = common.min(self.features_valid).min(tf.target_hidden_len());
        tf.set_target_hidden(start, &rows[start * h..])?;
        self.features_valid = n;
        // The model dropped its rows that read a feature at a position >= start; a model whose
        // sequence is not what this proposer fed starts over (as `catch_up` would).
        let len = self.model.seq_len();
        if consistent && len <= self.seen.len() {
            self.seen.truncate(len);
        } else {
            self.reset()?;
        }
        Ok(())
    }

    /// Grows the tree of [`Proposer::propose_tree`] into `nodes` (depth by depth; greedy
    /// requests: every candidate, re-ranked by the caller) and returns whether the model holds
    /// an uncommitted tree forward. `max_depth >= 1`; the model holds `ctx` and `self.logits`
    /// its root row.
    ///
    /// Each depth: the candidates of every beam row ([`Self::expand_beam`]; sampled requests
    /// then draw the children, [`Self::draw_children`]), the next beam that fits one tree
    /// forward ([`next_beam`]), and that forward's rows for the beam ([`Self::forward_beam`]).
    fn grow_tree(
        &mut self,
        req: &ProposeRequest<'_>,
        max_depth: usize,
        cap: usize,
        nodes: &mut Vec<Node>,
    ) -> Result<bool> {
        let greedy = req.config.is_greedy();
        // The rows to expand (0 = the root, j + 1 = node j) and their draft logits, one row each.
        let mut g = Grow {
            beam: vec![0],
            rows: std::mem::take(&mut self.logits),
            ..Grow::default()
        };
        let mut pending = false;
        for depth in 0..max_depth {
            let first_new = nodes.len();
            self.expand_beam(req, depth, &mut g, nodes)?;
            if !greedy {
                self.draw_children(req, depth, max_depth, &mut g, nodes)?;
            }
            if depth + 1 == max_depth || nodes.len() == first_new {
                break;
            }
            if !greedy && nodes.len() >= req.max_nodes {
                break;
            }
            let (fits, keep) = next_beam(req, self.tree.beam, nodes, first_new, cap);
            if fits.is_empty() {
                break;
            }
            self.forward_beam(req, nodes, &keep, &fits, &mut g)?;
            pending = true;
        }
        Ok(pending)
    }

    /// [`Self::grow_tree`], one depth: the `children` best candidates of every beam row. Greedy
    /// requests make every candidate a node (point masses; the caller keeps the best
    /// `max_nodes`, EAGLE-2's re-ranking); sampled requests collect them as slots for
    /// [`Self::draw_children`]. A row without any allowed token gets no children.
    fn expand_beam(
        &mut self,
        req: &ProposeRequest<'_>,
        depth: usize,
        g: &mut Grow,
        nodes: &mut Vec<Node>,
    ) -> Result<()> {
        let vocab = self.model.vocab_size();
        let greedy = req.config.is_greedy();
        let width = self.tree.children.min(req.max_branch);
        g.slots.clear();
        for (b, &row) in g.beam.iter().enumerate() {
            path_tokens(nodes, row, &mut g.path);
            self.sampler.goto(&g.path)?;
            let base = if row == 0 { 0.0 } else { nodes[row - 1].score };
            let logits = &g.rows[b * vocab..(b + 1) * vocab];
            match self
                .sampler
                .top(req.config, logits, depth, width, &mut g.top)
            {
                Err(Error::NoAllowedToken { .. }) => continue,
                r => r?,
            }
            for (rank, &(t, lp)) in g.top.iter().enumerate() {
                let score = base + lp as f64;
                if greedy {
                    nodes.push(Node {
                        token: t,
                        parent: row as u32,
                        score,
                    });
                } else {
                    g.slots.push((score, b, rank));
                }
            }
        }
        Ok(())
    }

    /// [`Self::grow_tree`], one depth of a sampled request: how many children each beam node
    /// gets is decided from the rows' probabilities (known before any child is drawn): this
    /// depth's share of the remaining budget goes to the candidate slots of highest expected
    /// cumulative probability (parent's times the rank's probability). The children are then
    /// drawn without replacement; nothing drawn is ever pruned.
    fn draw_children(
        &mut self,
        req: &ProposeRequest<'_>,
        depth: usize,
        max_depth: usize,
        g: &mut Grow,
        nodes: &mut Vec<Node>,
    ) -> Result<()> {
        let vocab = self.model.vocab_size();
        let left = req.max_nodes - nodes.len();
        let quota = left.div_ceil(max_depth - depth);
        g.slots
            .sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut count = vec![0usize; g.beam.len()];
        for &(_, b, _) in g.slots.iter().take(quota) {
            count[b] += 1;
        }
        for (b, &row) in g.beam.iter().enumerate() {
            if count[b] == 0 {
                continue;
            }
            path_tokens(nodes, row, &mut g.path);
            self.sampler.goto(&g.path)?;
            let base = if row == 0 { 0.0 } else { nodes[row - 1].score };
            let logits = &g.rows[b * vocab..(b + 1) * vocab];
            self.sampler.draw_without_replacement(
                req.config,
                req.seed,
                logits,
                depth,
                count[b],
                &mut g.drawn,
            )?;
            let q = self.sampler.last_q();
            for &t in &g.drawn {
                nodes.push(Node {
                    token: t,
                    parent: row as u32,
                    score: base + (q[t as usize] as f64).ln(),
                });
            }
        }
        Ok(())
    }

    /// [`Self::grow_tree`]: one tree forward of the draft model over the `keep` nodes (in node
    /// order: parents first) after the context, and the rows of the new beam `fits` into
    /// `g.rows` (`g.beam` becomes their rows).
    ///
    /// # Errors
    /// The model's; [`Error::TargetContract`] when it stops offering tree support,
    /// [`Error::ShapeMismatch`] when its tree logits are not `[n + 1, vocab]`.
    fn forward_beam(
        &mut self,
        req: &ProposeRequest<'_>,
        nodes: &[Node],
        keep: &[bool],
        fits: &[usize],
        g: &mut Grow,
    ) -> Result<()> {
        let ctx = req.context;
        let vocab = self.model.vocab_size();
        let mut map = vec![0u32; nodes.len()];
        g.block_tokens.clear();
        g.block_parents.clear();
        for (i, n) in nodes.iter().enumerate() {
            if keep[i] {
                map[i] = g.block_tokens.len() as u32;
                g.block_tokens.push(n.token);
                let p = n.parent as usize;
                g.block_parents
                    .push(if p == 0 { 0 } else { map[p - 1] + 1 });
            }
        }
        let before = ctx.len() - 1;
        self.model.truncate(before)?;
        self.seen.truncate(before);
        let Some(tree) = self.model.tree() else {
            return Err(Error::TargetContract {
                what: "draft model tree() returned None after offering tree support",
            });
        };
        let block = DraftBlock::tree(&g.block_tokens, &g.block_parents);
        tree.forward_tree(ctx[ctx.len() - 1], &block, &mut self.logits)?;
        if self.logits.len() != block.rows() * vocab {
            return Err(Error::ShapeMismatch {
                what: "draft model tree logits ([n + 1, vocab])",
                expected: block.rows() * vocab,
                actual: self.logits.len(),
            });
        }
        g.rows.clear();
        for &j in fits {
            let r = map[j] as usize + 1;
            g.rows
                .extend_from_slice(&self.logits[r * vocab..(r + 1) * vocab]);
        }
        g.beam.clear();
        g.beam.extend(fits.iter().map(|&j| j + 1));
        Ok(())
    }
}

/// The state of [`DraftModelProposer::grow_tree`] across depths, and its scratch.
#[derive(Default)]
struct Grow {
    /// The rows to expand (0 = the root, `j + 1` = node `j`).
    beam: Vec<usize>,
    /// Their draft logits, one `[vocab]` row each.
    rows: Vec<f32>,
    /// Candidate children of a sampled request: (cumulative log-probability, beam index, rank).
    slots: Vec<(f64, usize, usize)>,
    /// Scratch: a row's path tokens, its top candidates, its drawn children.
    path: Vec<u32>,
    top: Vec<(u32, f32)>,
    drawn: Vec<u32>,
    /// Scratch: the block of the next tree forward.
    block_tokens: Vec<u32>,
    block_parents: Vec<u32>,
}

/// [`DraftModelProposer::grow_tree`]: the next beam, the best `beam` new nodes (from
/// `first_new`) that do not end the sequence, and of them those that fit, each with its
/// ancestors, into one tree forward of at most `cap` nodes. Returns the fitting beam nodes and
/// the nodes the forward holds (`[nodes.len()]`).
fn next_beam(
    req: &ProposeRequest<'_>,
    beam: usize,
    nodes: &[Node],
    first_new: usize,
    cap: usize,
) -> (Vec<usize>, Vec<bool>) {
    let mut next = ranked(nodes, first_new..nodes.len());
    next.retain(|&j| !req.is_eos(nodes[j].token));
    next.truncate(beam);
    if req.config.is_greedy() && nodes.len() >= req.max_nodes {
        // A child never ranks before its parent: once the best beam node is out of the best
        // `max_nodes`, nothing deeper can enter them.
        let all = ranked(nodes, 0..nodes.len());
        let kth = all[req.max_nodes - 1];
        next.retain(|&j| ranks_before(nodes, j, kth));
    }
    let mut keep = vec![false; nodes.len()];
    let mut used = 0;
    let mut fits = Vec::with_capacity(next.len());
    for &j in &next {
        let mut extra = Vec::new();
        let mut r = j + 1;
        while r > 0 && !keep[r - 1] {
            extra.push(r - 1);
            r = nodes[r - 1].parent as usize;
        }
        if used + extra.len() <= cap {
            used += extra.len();
            for i in extra {
                keep[i] = true;
            }
            fits.push(j);
        }
    }
    (fits, keep)
}

impl<M: TargetModel> Proposer for DraftModelProposer<M> {
    fn begin(&mut self, _prompt: &[u32]) -> Result<()> {
        self.reset()?;
        self.features_valid = 0;
        Ok(())
    }

    /// Keeps the draft model's cache, what it has seen and the features it set: the first
    /// proposal of the generation truncates them to the longest common prefix of what the
    /// model has seen and the context and recomputes the rest (see "State across requests" in
    /// the type docs), so the drafts equal those after [`Proposer::begin`] (for a model whose
    /// logits depend only on its sequence) while the shared prefix is not fed again.
    fn begin_reusing(&mut self, _prompt: &[u32]) -> Result<()> {
        Ok(())
    }

    /// Proposes up to `req.max_draft` tokens (fewer near the model's context limit, or when a
    /// draft ends at EOS); see [`DraftModelProposer`].
    ///
    /// # Errors
    /// Errors of the model's `prefill`, `forward`, `truncate` and `set_target_hidden`;
    /// [`Error::ShapeMismatch`] when the model returns logits that are not `[n, vocab]` or
    /// `req.target_hidden_rows` is not `[context.len() - 1, hidden_size]` for a
    /// feature-conditioned model; processing errors of the request's
    /// configuration (for example [`Error::NoAllowedToken`]).
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let ctx = req.context;
        if req.max_draft == 0 || ctx.is_empty() {
            return Ok(());
        }
        let vocab = self.model.vocab_size();
        let room = self.model.max_context().saturating_sub(ctx.len());
        let k = req.max_draft.min(room);
        if k == 0 {
            return Ok(());
        }
        self.sync_features(ctx, req.target_hidden_rows)?;
        self.catch_up(ctx)?;

        let cfg = req.config;
        self.sampler.begin(req, vocab)?;
        for i in 0..k {
            // A draft row that masks, bans or a draft vocabulary subset (an EAGLE head's
            // FR-Spec subset) leave without any token ends the draft there.
            let t = match self.sampler.draw(cfg, req.seed, &self.logits, i, draft) {
                Err(Error::NoAllowedToken { .. }) => break,
                r => r?,
            };
            // A draft ends at its own EOS: no draft row after it is computed or processed.
            if i + 1 < k && !req.is_eos(t) {
                self.feed(&[t])?;
            } else {
                break;
            }
        }
        self.sampler.finish(cfg, vocab, draft);
        Ok(())
    }

    /// Grows a token tree with the draft model (EAGLE-2, Li et al. 2024, section 4), when the
    /// draft model offers tree support ([`TargetModel::tree`]) and the node budget exceeds the
    /// depth (`req.max_nodes > req.max_draft`, the convention of the shipped proposers); else
    /// the chain of [`Proposer::propose`] with `max_draft = min(req.max_draft, req.max_nodes)`.
    ///
    /// Depth by depth, starting at the root (the context's last token): the beam (the
    /// [`DraftTreeConfig::beam`] nodes of the newest depth with the highest cumulative draft
    /// probability, never an EOS node) is expanded into up to `min(children, req.max_branch)`
    /// children each, from the node's processed draft row (the request's configuration,
    /// penalties and masks over the context plus the node's path, as the verifier processes
    /// the target row). One tree forward of the draft model per depth computes the rows of the
    /// beam ([`crate::TreeTarget::forward_tree`] over the beam and its ancestors, each node
    /// attending to its ancestors only); depth is at most `req.max_draft` (and the context
    /// room), the nodes of one forward at most the draft model's
    /// [`crate::TreeTarget::max_tree_nodes`] (beam nodes that do not fit are not expanded).
    ///
    /// - **Greedy requests**: the children are the top ids of the row (point masses, no q,
    ///   [`SiblingScheme::Deterministic`]; cumulative probability under the softmax at
    ///   temperature 1 of the row after penalties, bias and masks). Every candidate is kept
    ///   while growing, and the best `req.max_nodes` by cumulative probability are returned
    ///   (EAGLE-2's re-ranking; ancestor-closed, since a node never ranks before its parent).
    ///   Growth stops early once no beam node is among the best `req.max_nodes`. Any choice of
    ///   deterministic candidates is exact.
    /// - **Sampling requests**: the children of a node are drawn WITHOUT replacement from its
    ///   processed row q ([`SiblingScheme::WithoutReplacement`], verified by recursive rejection
    ///   sampling, Jeon et al. 2024), sibling `j` with the uniform of
    ///   [`crate::rng::lane::sibling_draft`]`(j)` at the node's position; every node carries its
    ///   group's q row (`q`: `[nodes, draft vocab]`). How many children each beam node gets is
    ///   decided BEFORE they are drawn: each depth takes `ceil(left / depths left)` of the node
    ///   budget, given to the candidate slots (node, rank) of highest expected cumulative
    ///   probability (the node's times the rank's probability in its row). Drawn siblings are
    ///   never pruned by their values, which would break the law the verifier relies on (see
    ///   [`crate::verify`], "Trees", and `tests/model_trees.rs` for a negative control).
    ///   Why the dynamic shape is still exact: the children of a node at depth `d` are drawn
    ///   with the uniforms of position `context.len() + d`, which nothing else reads (the
    ///   verifier uses other lanes); their number depends only on nodes of depth `<= d`, drawn
    ///   with the uniforms of earlier positions. So when the verifier reaches a node, its
    ///   children are, given everything the step decided before, a sample without replacement
    ///   of its q of a size fixed in advance: the situation of the lemma in [`crate::verify`].
    ///   Cousins (children of different nodes at one depth) share those uniforms; they are
    ///   never on one path, and the verifier reads one group per depth.
    ///
    /// A tree whose every group has one node is returned as a chain (no `parents`, no
    /// `schemes`: the same draws and law). No node is added below an EOS node. After the call
    /// the draft model holds exactly the context (the last tree forward is committed with an
    /// empty path), so the next step catches up as a chain proposal does.
    ///
    /// # Errors
    /// As [`Proposer::propose`], plus those of the draft model's tree forward and commit, and
    /// [`Error::ShapeMismatch`] when a tree forward's logits are not `[n + 1, vocab]`.
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        // A draft model that cannot truncate drafts chains.
        let truncates = rollback_mode(&mut self.model) == RollbackMode::Truncate;
        let tree_cap = self
            .model
            .tree()
            .map(|t| t.max_tree_nodes())
            .filter(|_| truncates);
        let Some(tree_cap) = tree_cap.filter(|_| req.max_nodes > req.max_draft) else {
            let chain = ProposeRequest {
                max_draft: req.max_draft.min(req.max_nodes),
                ..*req
            };
            return self.propose(&chain, draft);
        };
        draft.clear();
        let ctx = req.context;
        if req.max_draft == 0 || req.max_nodes == 0 || req.max_branch == 0 || ctx.is_empty() {
            return Ok(());
        }
        let vocab = self.model.vocab_size();
        let room = self.model.max_context().saturating_sub(ctx.len());
        let max_depth = req.max_draft.min(room);
        if max_depth == 0 {
            return Ok(());
        }
        self.sync_features(ctx, req.target_hidden_rows)?;
        self.catch_up(ctx)?;
        self.sampler.begin(req, vocab)?;
        let mut nodes = Vec::new();
        // A tree forward appends the root and its nodes after `ctx.len() - 1` tokens.
        let cap = tree_cap.min(room);
        let grown = self.grow_tree(req, max_depth, cap, &mut nodes);
        let q = self.sampler.take_q();
        let pending = grown?;
        if pending {
            // Keep the root only: the model holds exactly the context again.
            let Some(tree) = self.model.tree() else {
                return Err(Error::TargetContract {
                    what: "draft model tree() returned None after offering tree support",
                });
            };
            tree.commit_tree(&[])?;
            self.seen.push(ctx[ctx.len() - 1]);
        }
        let greedy = req.config.is_greedy();
        // Greedy: the best `max_nodes` candidates (ancestor-closed), in node order.
        let keep: Vec<usize> = if greedy && nodes.len() > req.max_nodes {
            let mut best = ranked(&nodes, 0..nodes.len());
            best.truncate(req.max_nodes);
            best.sort_unstable();
            best
        } else {
            (0..nodes.len()).collect()
        };
        let mut map = vec![0u32; nodes.len()];
        for (k, &i) in keep.iter().enumerate() {
            let n = &nodes[i];
            map[i] = k as u32;
            draft.tokens.push(n.token);
            let p = n.parent as usize;
            draft.parents.push(if p == 0 { 0 } else { map[p - 1] + 1 });
        }
        if greedy {
            draft.schemes = vec![SiblingScheme::Deterministic; draft.tokens.len()];
        } else if !draft.tokens.is_empty() {
            draft.q = Some(q);
            draft.q_vocab = vocab;
            draft.schemes = vec![SiblingScheme::WithoutReplacement; draft.tokens.len()];
        }
        if draft.block().is_chain() {
            draft.parents.clear();
            draft.schemes.clear();
        }
        Ok(())
    }

    /// `"draft-model"`.
    fn name(&self) -> &'static str {
        "draft-model"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{CallLog, ToyModel};
    use crate::{RowKind, SamplingConfig};

    #[test]
    fn prompt_is_prefilled_once_and_drafts_match_full_forwards() {
        let prompt = [1u32, 2, 3, 4, 5, 6, 0, 2];
        let cfg = SamplingConfig::greedy();
        let req = ProposeRequest::new(&prompt, &cfg, 3);
        let mut p = DraftModelProposer::new(CallLog::new(ToyModel::c10()));
        p.begin(&prompt).unwrap();
        assert!(
            p.model().prefills.is_empty(),
            "begin must not run the draft model"
        );
        let mut d = Draft::default();
        p.propose(&req, &mut d).unwrap();
        let calls = &p.model().prefills;
        assert_eq!(calls, &vec![prompt.len() - 1]);
        // The first forward feeds only the prompt's last token, then one per draft token.
        assert_eq!(p.model().forwards, vec![1, 1, 1]);
        // Same drafts as a model without a `prefill` of its own (one full forward).
        let mut q = DraftModelProposer::new(ToyModel::c10());
        let mut e = Draft::default();
        q.propose(&req, &mut e).unwrap();
        assert_eq!(d.tokens, e.tokens);
        assert_eq!(d.tokens.len(), 3);
    }

    /// Drafts of a fresh proposer on `ctx`.
    fn fresh(ctx: &[u32], cfg: &SamplingConfig, k: usize) -> Draft {
        let mut p = DraftModelProposer::new(ToyModel::c10());
        let mut d = Draft::default();
        p.propose(&ProposeRequest::new(ctx, cfg, k), &mut d)
            .unwrap();
        d
    }

    fn configs() -> [SamplingConfig; 2] {
        [
            SamplingConfig::greedy(),
            SamplingConfig::builder().temperature(1.0).build().unwrap(),
        ]
    }

    #[test]
    fn stale_state_unrelated_request_equals_a_fresh_proposer() {
        // The c10 model's logits depend on the sum of the whole prefix, so any stale cache
        // entry changes the drafts.
        let a: Vec<u32> = (0..60).map(|i| (i * 3 % 7) as u32).collect();
        let mut b = a.clone();
        b[30] = (b[30] + 1) % 7;
        let c: Vec<u32> = vec![6; 45];
        for cfg in configs() {
            let mut p = DraftModelProposer::new(ToyModel::c10());
            let mut d = Draft::default();
            for ctx in [&a, &b, &c, &a] {
                p.propose(&ProposeRequest::new(ctx, &cfg, 4), &mut d)
                    .unwrap();
                assert_eq!(d, fresh(ctx, &cfg, 4));
                assert_eq!(&p.model().tokens()[..ctx.len()], &ctx[..]);
            }
        }
    }

    #[test]
    fn stale_state_context_that_shrinks_or_diverges() {
        let seq: Vec<u32> = (0..80).map(|i| (i * i % 7) as u32).collect();
        for cfg in configs() {
            let mut p = DraftModelProposer::new(ToyModel::c10());
            let mut d = Draft::default();
            p.propose(&ProposeRequest::new(&seq, &cfg, 3), &mut d)
                .unwrap();
            for cut in [79, 40, 2, 1] {
                let ctx = &seq[..cut];
                p.propose(&ProposeRequest::new(ctx, &cfg, 3), &mut d)
                    .unwrap();
                assert_eq!(d, fresh(ctx, &cfg, 3), "cut {cut}");
                p.propose(&ProposeRequest::new(&seq, &cfg, 3), &mut d)
                    .unwrap();
            }
            for at in [0, 1, 40, 78, 79] {
                let mut other = seq.clone();
                other[at] = (other[at] + 3) % 7;
                other.extend_from_slice(&seq[..5]);
                p.propose(&ProposeRequest::new(&seq, &cfg, 3), &mut d)
                    .unwrap();
                p.propose(&ProposeRequest::new(&other, &cfg, 3), &mut d)
                    .unwrap();
                assert_eq!(d, fresh(&other, &cfg, 3), "diverge at {at}");
            }
        }
    }

    #[test]
    fn stale_state_model_with_a_sequence_of_its_own_starts_over() {
        let mut model = ToyModel::c10();
        model.forward(&[5, 5, 5, 5], &mut Vec::new()).unwrap();
        let ctx = [1u32, 2, 3];
        let cfg = SamplingConfig::greedy();
        let mut p = DraftModelProposer::new(model);
        let mut d = Draft::default();
        p.propose(&ProposeRequest::new(&ctx, &cfg, 3), &mut d)
            .unwrap();
        assert_eq!(d, fresh(&ctx, &cfg, 3));
        assert_eq!(&p.model().tokens()[..3], &ctx);
    }

    #[test]
    fn draft_ends_at_eos_and_computes_no_row_after_it() {
        // Greedy chain after [0]: c10 gives a fixed sequence; make its second token the EOS.
        let ctx = [0u32];
        let cfg = SamplingConfig::greedy();
        let free = fresh(&ctx, &cfg, 4).tokens;
        assert_eq!(free.len(), 4);
        let eos = [free[1]];
        let req = ProposeRequest {
            eos: &eos,
            ..ProposeRequest::new(&ctx, &cfg, 4)
        };
        let mut p = DraftModelProposer::new(CallLog::new(ToyModel::c10()));
        let mut d = Draft::default();
        p.propose(&req, &mut d).unwrap();
        assert_eq!(d.tokens, free[..2]);
        // One forward for the context's last token, one for the first draft; none after EOS.
        assert_eq!(p.model().forwards, vec![1, 1]);
        assert_eq!(p.name(), "draft-model");
    }

    // ---- token trees (propose_tree) ----

    use crate::sampling::{History, RowProcessor, TokenCounts, TokenDist};
    use crate::tree::TreeLimits;

    fn tree_model(cap: usize) -> ToyModel {
        ToyModel::markov(8, 2, 1.6, 5).with_tree(cap)
    }

    fn tree_req<'a>(
        ctx: &'a [u32],
        cfg: &'a SamplingConfig,
        depth: usize,
        nodes: usize,
    ) -> ProposeRequest<'a> {
        ProposeRequest {
            max_nodes: nodes,
            seed: 7,
            ..ProposeRequest::new(ctx, cfg, depth)
        }
    }

    fn node_path(d: &Draft, row: usize) -> Vec<u32> {
        let mut p = Vec::new();
        if row > 0 {
            d.block().path_to(row - 1, &mut p);
        }
        p.iter().map(|&j| d.tokens[j as usize]).collect()
    }

    fn sampled() -> SamplingConfig {
        SamplingConfig::builder()
            .temperature(0.8)
            .top_k(6)
            .repetition_penalty(1.3)
            .build()
            .unwrap()
    }

    /// The processed row of `model` after `ctx` + `path`, as the verifier processes it.
    fn processed(model: &ToyModel, cfg: &SamplingConfig, ctx: &[u32], path: &[u32]) -> TokenDist {
        let mut seq = ctx.to_vec();
        seq.extend_from_slice(path);
        let counts = TokenCounts::from_context(&seq, ctx.len(), 8).unwrap();
        let hist = History {
            counts: Some(&counts),
            prefix: &seq,
            suppress: &[],
        };
        let mut d = TokenDist::default();
        RowProcessor::new()
            .distribution(cfg, &model.logits(&seq), &hist, RowKind::Draft, 0, &mut d)
            .unwrap();
        d
    }

    fn check_limits(d: &Draft, req: &ProposeRequest<'_>) {
        let limits = TreeLimits {
            vocab_size: 8,
            max_nodes: req.max_nodes,
            max_depth: req.max_draft,
            max_branch: req.max_branch,
            dense_q: d.q.is_some(),
        };
        assert_eq!(d.block().validate(&limits), Ok(()), "{d:?}");
    }

    #[test]
    fn tree_config_is_validated() {
        for (beam, children, field) in [(0, 4, "beam"), (65, 4, "beam"), (4, 0, "children")] {
            let err = DraftModelProposer::new(ToyModel::c10())
                .with_tree_config(DraftTreeConfig { beam, children })
                .unwrap_err();
            assert!(
                matches!(err, Error::InvalidConfig { field: f, .. } if f == field),
                "{err}"
            );
        }
        let p = DraftModelProposer::new(ToyModel::c10());
        assert_eq!(p.tree_config(), DraftTreeConfig::default());
    }

    #[test]
    fn without_tree_support_or_budget_the_tree_is_the_chain() {
        let ctx = [1u32, 2, 3];
        for cfg in configs() {
            // No tree support: the chain of min(depth, nodes).
            for (depth, nodes) in [(3, 8), (4, 2)] {
                let mut p = DraftModelProposer::new(ToyModel::c10());
                let mut d = Draft::default();
                p.propose_tree(&tree_req(&ctx, &cfg, depth, nodes), &mut d)
                    .unwrap();
                assert_eq!(d, fresh(&ctx, &cfg, depth.min(nodes)));
            }
            // Tree support but no budget beyond the depth: the chain.
            let mut p = DraftModelProposer::new(tree_model(32));
            let (mut a, mut b) = (Draft::default(), Draft::default());
            p.propose_tree(&tree_req(&ctx, &cfg, 4, 4), &mut a).unwrap();
            let mut q = DraftModelProposer::new(tree_model(32));
            q.propose(&tree_req(&ctx, &cfg, 4, 4), &mut b).unwrap();
            assert_eq!(a, b);
            assert!(a.parents.is_empty());
        }
    }

    #[test]
    fn beam_one_child_one_is_exactly_the_chain() {
        let ctx = [1u32, 2, 3, 1];
        for cfg in [SamplingConfig::greedy(), sampled()] {
            for seed in 0..20 {
                let req = ProposeRequest {
                    seed,
                    ..tree_req(&ctx, &cfg, 4, 9)
                };
                let mut p = DraftModelProposer::new(tree_model(32))
                    .with_tree_config(DraftTreeConfig {
                        beam: 1,
                        children: 1,
                    })
                    .unwrap();
                let (mut a, mut b) = (Draft::default(), Draft::default());
                p.propose_tree(&req, &mut a).unwrap();
                DraftModelProposer::new(tree_model(32))
                    .propose(&req, &mut b)
                    .unwrap();
                assert_eq!(a, b, "seed {seed}");
                assert_eq!(a.len(), 4);
            }
        }
    }

    /// A draft row without any allowed token (a mask that allows nothing after the first
    /// drafted token, as an EAGLE head's vocabulary subset can leave) ends that branch: the
    /// tree keeps the first depth, the chain its first token, and nothing fails.
    #[test]
    fn rows_without_an_allowed_token_end_the_draft_there() {
        let ctx = [4u32, 0, 6, 2];
        let mask = |prefix: &[u32], logits: &mut [f32]| {
            if prefix.len() > 4 {
                logits.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            }
        };
        for temperature in [0.0, 1.0] {
            let cfg = SamplingConfig::builder()
                .temperature(temperature)
                .mask(std::sync::Arc::new(mask))
                .build()
                .unwrap();
            let mut p = DraftModelProposer::new(tree_model(32));
            let mut d = Draft::default();
            p.propose_tree(&tree_req(&ctx, &cfg, 4, 8), &mut d).unwrap();
            assert!(!d.is_empty());
            assert_eq!(d.block().max_depth(), 1, "temperature {temperature}");
            let mut c = Draft::default();
            p.propose(&ProposeRequest::new(&ctx, &cfg, 4), &mut c)
                .unwrap();
            assert_eq!(c.len(), 1, "temperature {temperature}");
            if temperature > 0.0 {
                assert_eq!(c.q.as_ref().map(Vec::len), Some(c.q_vocab));
            }
        }
    }

    #[test]
    fn greedy_tree_children_are_top_ids_reranked_to_the_budget() {
        let ctx = [4u32, 0, 6, 2];
        let cfg = SamplingConfig::greedy();
        let reference = tree_model(32);
        for (depth, nodes, branch) in [(4, 10, usize::MAX), (3, 12, 2), (5, 7, 3)] {
            let req = ProposeRequest {
                max_branch: branch,
                ..tree_req(&ctx, &cfg, depth, nodes)
            };
            let mut p = DraftModelProposer::new(CallLog::new(tree_model(32)))
                .with_tree_config(DraftTreeConfig {
                    beam: 3,
                    children: 3,
                })
                .unwrap();
            let mut d = Draft::default();
            p.propose_tree(&req, &mut d).unwrap();
            check_limits(&d, &req);
            assert_eq!(d.len(), nodes, "enough candidates to fill the budget");
            assert!(d.q.is_none());
            assert!(d.schemes.iter().all(|&s| s == SiblingScheme::Deterministic));
            assert!(d.block().max_depth() >= 2);
            let width = 3.min(branch);
            for i in 0..d.len() {
                let path = node_path(&d, d.block().parent_row(i));
                let mut seq = ctx.to_vec();
                seq.extend_from_slice(&path);
                let l = reference.logits(&seq);
                let mut ids: Vec<u32> = (0..8).collect();
                ids.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
                assert!(ids[..width].contains(&d.tokens[i]), "node {i}");
            }
            // One tree forward per depth after the first at most, each within the beam's
            // ancestors; the model holds exactly the context afterwards.
            let log = p.model();
            assert!(log.trees.len() < depth, "{} tree forwards", log.trees.len());
            assert!(log.trees.iter().all(|(_, t, _)| t.len() <= 3 * depth));
            assert!(log.trees.iter().all(|(root, _, _)| *root == 2));
            assert_eq!(log.commits, vec![Vec::<u32>::new()]);
            assert_eq!(log.inner.tokens(), &ctx);
        }
    }

    #[test]
    fn sampled_tree_draws_without_replacement_with_the_group_q() {
        let ctx = [4u32, 0, 6, 2];
        let cfg = sampled();
        let reference = tree_model(32);
        let mut shapes = std::collections::HashSet::new();
        for seed in 0..40 {
            let req = ProposeRequest {
                seed,
                ..tree_req(&ctx, &cfg, 3, 9)
            };
            let mut p = DraftModelProposer::new(tree_model(32))
                .with_tree_config(DraftTreeConfig {
                    beam: 2,
                    children: 3,
                })
                .unwrap();
            let mut d = Draft::default();
            p.propose_tree(&req, &mut d).unwrap();
            check_limits(&d, &req);
            assert_eq!(d.len(), 9);
            assert!(
                d.schemes
                    .iter()
                    .all(|&s| s == SiblingScheme::WithoutReplacement)
            );
            let q = d.q.clone().unwrap();
            assert_eq!((d.q_vocab, q.len()), (8, 9 * 8));
            for i in 0..d.len() {
                let path = node_path(&d, d.block().parent_row(i));
                let want = processed(&reference, &cfg, &ctx, &path);
                let row = &q[i * 8..(i + 1) * 8];
                for v in 0..8u32 {
                    assert!((row[v as usize] - want.prob(v)).abs() < 1e-6, "node {i}");
                }
                assert!(row[d.tokens[i] as usize] > 0.0);
            }
            // Same seed, same tree; the model holds the context.
            let mut again = Draft::default();
            DraftModelProposer::new(tree_model(32))
                .with_tree_config(p.tree_config())
                .unwrap()
                .propose_tree(&req, &mut again)
                .unwrap();
            assert_eq!(d, again);
            assert_eq!(p.model().tokens(), &ctx);
            shapes.insert((d.tokens.clone(), d.parents.clone()));
        }
        assert!(
            shapes.len() > 20,
            "the trees are samples: {} distinct",
            shapes.len()
        );
    }

    #[test]
    fn tree_nodes_never_follow_an_eos() {
        let ctx = [4u32, 0, 6, 2];
        for cfg in [SamplingConfig::greedy(), sampled()] {
            for eos in 0..8u32 {
                let eos_ids = [eos];
                let req = ProposeRequest {
                    eos: &eos_ids,
                    ..tree_req(&ctx, &cfg, 4, 12)
                };
                let mut p = DraftModelProposer::new(tree_model(32));
                let mut d = Draft::default();
                p.propose_tree(&req, &mut d).unwrap();
                for i in 0..d.len() {
                    let r = d.block().parent_row(i);
                    assert!(r == 0 || d.tokens[r - 1] != eos, "eos {eos}: {d:?}");
                }
            }
        }
    }

    #[test]
    fn small_tree_capacity_bounds_every_draft_forward() {
        let ctx = [4u32, 0, 6, 2];
        for cfg in [SamplingConfig::greedy(), sampled()] {
            let req = tree_req(&ctx, &cfg, 5, 16);
            let mut p = DraftModelProposer::new(CallLog::new(tree_model(3)));
            let mut d = Draft::default();
            p.propose_tree(&req, &mut d).unwrap();
            check_limits(&d, &req);
            assert!(!p.model().trees.is_empty());
            assert!(p.model().trees.iter().all(|(_, t, _)| t.len() <= 3));
        }
    }

    #[test]
    fn stale_state_after_a_tree_equals_a_fresh_proposer() {
        let a: Vec<u32> = (0..30).map(|i| (i * 5 % 8) as u32).collect();
        let mut b = a.clone();
        b.extend([3, 1, 4]);
        let c = a[..12].to_vec();
        for cfg in [SamplingConfig::greedy(), sampled()] {
            let mut p = DraftModelProposer::new(tree_model(32));
            let mut d = Draft::default();
            for ctx in [&a, &b, &c, &a] {
                p.propose_tree(&tree_req(ctx, &cfg, 3, 8), &mut d).unwrap();
                let mut f = Draft::default();
                DraftModelProposer::new(tree_model(32))
                    .propose_tree(&tree_req(ctx, &cfg, 3, 8), &mut f)
                    .unwrap();
                assert_eq!(d, f);
                assert_eq!(p.model().tokens(), &ctx[..]);
                // A chain proposal after a tree sees the same state as a fresh one.
                p.propose(&tree_req(ctx, &cfg, 3, 3), &mut d).unwrap();
                let mut f = Draft::default();
                DraftModelProposer::new(tree_model(32))
                    .propose(&tree_req(ctx, &cfg, 3, 3), &mut f)
                    .unwrap();
                assert_eq!(d, f);
            }
        }
    }
}

#[cfg(test)]
mod feature_tests {
    //! Feature-conditioned draft models: what `DraftModelProposer` hands over, used directly.
    use super::*;
    use crate::SamplingConfig;
    use crate::model::TargetFeatures;
    use crate::test_util::{FeatureSource, ToyFeatureDraft, ToyRnn};

    const H: usize = 4;

    fn rnn() -> ToyRnn {
        ToyRnn::new(9, H, 2.0, 3)
    }

    fn rows(r: &ToyRnn, ctx: &[u32]) -> Vec<f32> {
        (0..ctx.len() - 1)
            .flat_map(|p| r.hidden(&ctx[..=p]))
            .collect()
    }

    fn propose(
        p: &mut DraftModelProposer<ToyFeatureDraft>,
        ctx: &[u32],
        rows: Option<&[f32]>,
    ) -> Draft {
        let cfg = SamplingConfig::greedy();
        let req = ProposeRequest {
            target_hidden_rows: rows,
            ..ProposeRequest::new(ctx, &cfg, 3)
        };
        let mut d = Draft::default();
        p.propose(&req, &mut d).unwrap();
        d
    }

    /// The held features and every context row's feature are the target's.
    fn assert_true_features(p: &DraftModelProposer<ToyFeatureDraft>, r: &ToyRnn, ctx: &[u32]) {
        let m = p.model();
        assert_eq!(m.held(), &rows(r, ctx)[..]);
        for q in 1..ctx.len() {
            let (src, f) = m.row_feature(q).unwrap();
            assert_eq!(src, FeatureSource::Target);
            assert_eq!(f, &r.hidden(&ctx[..q])[..]);
        }
    }

    #[test]
    fn rows_are_handed_over_from_the_first_changed_position() {
        let r = rnn();
        let mut p = DraftModelProposer::new(ToyFeatureDraft::new(r.perturbed(0.3, 1), 256));
        let a: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7, 8];
        propose(&mut p, &a, Some(&rows(&r, &a)));
        assert_eq!(p.model().feature_sets, vec![(0, 7)]);
        assert_true_features(&p, &r, &a);
        // Two more tokens: only the rows from the previous last position.
        let mut b = a.clone();
        b.extend([0, 4]);
        propose(&mut p, &b, Some(&rows(&r, &b)));
        assert_eq!(p.model().feature_sets[1], (7, 2));
        assert_true_features(&p, &r, &b);
        // A context that diverges at position 5: from there.
        let mut c = b[..5].to_vec();
        c.extend([8, 8, 8]);
        propose(&mut p, &c, Some(&rows(&r, &c)));
        assert_eq!(p.model().feature_sets[2], (5, 2));
        assert_true_features(&p, &r, &c);
        // A request without rows on a context diverging at 2 leaves the features, but the next
        // request with rows replaces them from position 2 on.
        let mut d = c[..2].to_vec();
        d.extend([6, 6, 6, 6]);
        propose(&mut p, &d, None);
        assert_eq!(p.model().feature_sets.len(), 3);
        d.push(1);
        propose(&mut p, &d, Some(&rows(&r, &d)));
        assert_eq!(p.model().feature_sets[3], (2, 4));
        assert_true_features(&p, &r, &d);
        // The drafts equal a fresh proposer's with the same rows.
        let mut fresh = DraftModelProposer::new(ToyFeatureDraft::new(r.perturbed(0.3, 1), 256));
        d.push(2);
        assert_eq!(
            propose(&mut p, &d, Some(&rows(&r, &d))),
            propose(&mut fresh, &d, Some(&rows(&r, &d)))
        );
        // begin() keeps the held features (truncate does not drop them); the next proposal
        // replaces them all.
        p.begin(&d).unwrap();
        assert_eq!(p.model().target_hidden_len(), d.len() - 1);
        propose(&mut p, &d, Some(&rows(&r, &d)));
        assert_eq!(p.model().feature_sets.last(), Some(&(0, d.len() - 1)));
    }

    #[test]
    fn a_one_token_context_clears_the_features() {
        let r = rnn();
        let mut p = DraftModelProposer::new(ToyFeatureDraft::new(r.clone(), 256));
        propose(&mut p, &[1, 2, 3], Some(&rows(&r, &[1, 2, 3])));
        propose(&mut p, &[4], Some(&[]));
        assert_eq!(p.model().target_hidden_len(), 0);
        assert_eq!(p.model().feature_sets.last(), Some(&(0, 0)));
        // With the target's own parameters and features, the greedy draft is the target's
        // greedy continuation.
        let ctx = [4u32, 0, 7];
        let d = propose(&mut p, &ctx, Some(&rows(&r, &ctx)));
        let mut seq = ctx.to_vec();
        for &t in &d.tokens {
            let l = r.head(&r.hidden(&seq));
            let best = (0..9u32)
                .max_by(|&a, &b| l[a as usize].total_cmp(&l[b as usize]).then(b.cmp(&a)))
                .unwrap();
            assert_eq!(t, best);
            seq.push(t);
        }
        assert_eq!(d.tokens.len(), 3);
    }
}
