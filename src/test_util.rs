//! Toy targets and proposers for tests (feature `test-util`).
//!
//! They implement the crate's traits exactly as a real engine would, with logits that are cheap,
//! deterministic functions of the prefix, so that the exact conditional distributions are known
//! and tests can compare generated sequences with plain decoding or with exact probabilities.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::model::{HiddenStates, TargetFeatures, TargetModel, TreeTarget};
use crate::propose::{Draft, DraftHeads, HeadsInput, ProposeRequest, Proposer};
use crate::rng::Stream;
use crate::tree::{DraftBlock, TreeLimits};

/// The logits function of a toy model: prefix -> logits `[vocab]`.
pub type LogitsFn = Arc<dyn Fn(&[u32]) -> Vec<f32> + Send + Sync>;

/// The hidden-state function of a toy model: prefix -> final hidden state `[hidden_size]`.
pub type HiddenFn = Arc<dyn Fn(&[u32]) -> Vec<f32> + Send + Sync>;

/// A toy [`TargetModel`] whose logits at each position are `f(prefix)`, where `prefix` is every
/// token up to and including the position's input token.
#[derive(Clone)]
pub struct ToyModel {
    f: LogitsFn,
    vocab: usize,
    max_context: usize,
    tokens: Vec<u32>,
    /// Number of [`TargetModel::forward`] calls so far.
    pub forward_calls: usize,
    /// Total number of tokens passed to [`TargetModel::forward`].
    pub forward_tokens: usize,
    /// Tree capacity ([`TreeTarget::max_tree_nodes`]); 0 (the default) offers no tree support.
    tree_nodes: usize,
    /// The pending tree forward: sequence length before it and the block's parent rows.
    pending: Option<(usize, Vec<u32>)>,
    /// Number of [`TreeTarget::forward_tree`] calls so far.
    pub tree_calls: usize,
    /// Hidden states ([`ToyModel::with_hidden`]): width and function of the prefix.
    hidden: Option<(usize, HiddenFn)>,
    /// The hidden states of the positions appended by the last forward, `[n, width]`.
    last_hidden: Vec<f32>,
}

impl std::fmt::Debug for ToyModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToyModel")
            .field("vocab", &self.vocab)
            .field("len", &self.tokens.len())
            .finish()
    }
}

impl ToyModel {
    /// A model with logits function `f` over `vocab` tokens and a context limit.
    pub fn new(vocab: usize, max_context: usize, f: LogitsFn) -> Self {
        ToyModel {
            f,
            vocab,
            max_context,
            tokens: Vec::new(),
            forward_calls: 0,
            forward_tokens: 0,
            tree_nodes: 0,
            pending: None,
            tree_calls: 0,
            hidden: None,
            last_hidden: Vec::new(),
        }
    }

    /// Offers hidden states ([`TargetModel::hidden_states`]) of width `size`: the hidden state
    /// of a position is `hidden(prefix)` (`[size]`), `prefix` as for the logits. Every
    /// `forward`, `prefill` and tree forward records the rows of the positions it appended.
    pub fn with_hidden(mut self, size: usize, hidden: HiddenFn) -> Self {
        self.hidden = Some((size, hidden));
        self
    }

    /// The hidden state after `prefix` (`[hidden_size]`), `None` without hidden states.
    pub fn hidden_of(&self, prefix: &[u32]) -> Option<Vec<f32>> {
        self.hidden.as_ref().map(|(_, f)| f(prefix))
    }

    /// Offers tree support ([`TargetModel::tree`]) for blocks of up to `max_nodes` nodes: node
    /// `i`'s logits are `f(committed + root + ancestors of i + i)`, exactly those of the same
    /// tokens fed as a chain.
    pub fn with_tree(mut self, max_nodes: usize) -> Self {
        self.tree_nodes = max_nodes;
        self
    }

    /// A deterministic "next token" model: logit 10 on `next(prefix)`, 0 elsewhere.
    pub fn deterministic(
        vocab: usize,
        max_context: usize,
        next: impl Fn(&[u32]) -> u32 + Send + Sync + 'static,
    ) -> Self {
        let f: LogitsFn = Arc::new(move |prefix: &[u32]| {
            let n = next(prefix) as usize % vocab;
            (0..vocab)
                .map(|v| if v == n { 10.0 } else { 0.0 })
                .collect()
        });
        Self::new(vocab, max_context, f)
    }

    /// The model of case C10: next token = `(sum(prefix) * 31 + len(prefix)) mod 7`
    /// ([`c10_next`]), vocab 7.
    pub fn c10() -> Self {
        Self::deterministic(7, 4096, c10_next)
    }

    /// A random Markov model of order `order`: the logits after a prefix are pseudo-random
    /// normals (scale `scale`) keyed by the last `order` tokens and `seed`. The exact conditional
    /// distribution of every prefix is available through [`ToyModel::logits`].
    pub fn markov(vocab: usize, order: usize, scale: f32, seed: u64) -> Self {
        let stream = Stream::new(seed);
        let f: LogitsFn = Arc::new(move |prefix: &[u32]| {
            let start = prefix.len().saturating_sub(order);
            let mut h: u64 = 0x9E37_79B9_7F4A_7C15 ^ (prefix.len().min(order) as u64);
            for &t in &prefix[start..] {
                h = (h ^ t as u64)
                    .wrapping_mul(0x1000_0000_01B3)
                    .rotate_left(17);
            }
            (0..vocab)
                .map(|v| {
                    let b = stream.bits(h, v as u32);
                    // Box-Muller from two 24-bit uniforms (never exactly 0).
                    let u1 = ((b[0] >> 8) as f32 + 0.5) / 16_777_216.0;
                    let u2 = (b[1] >> 8) as f32 / 16_777_216.0;
                    scale * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
                })
                .collect()
        });
        Self::new(vocab, 1 << 20, f)
    }

    /// The logits after `prefix` (`[vocab]`).
    pub fn logits(&self, prefix: &[u32]) -> Vec<f32> {
        (self.f)(prefix)
    }

    /// The tokens currently in the sequence.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl TargetModel for ToyModel {
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn seq_len(&self) -> usize {
        self.tokens.len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        if self.tokens.len() + tokens.len() > self.max_context {
            return Err(Error::model(format!(
                "context overflow: {} + {} > {}",
                self.tokens.len(),
                tokens.len(),
                self.max_context
            )));
        }
        // Every id is checked before anything is appended: on error the sequence is as it was.
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::TokenOutOfVocab {
                what: "model input",
                token: t,
                vocab_size: self.vocab,
            });
        }
        self.forward_calls += 1;
        self.forward_tokens += tokens.len();
        logits.clear();
        self.last_hidden.clear();
        for &t in tokens {
            self.tokens.push(t);
            logits.extend((self.f)(&self.tokens));
            if let Some((_, h)) = &self.hidden {
                self.last_hidden.extend(h(&self.tokens));
            }
        }
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.tokens.len() {
            return Err(Error::model(format!(
                "truncate to {len} beyond length {}",
                self.tokens.len()
            )));
        }
        // Any rollback ends a pending tree forward (its nodes are no longer all there).
        if len < self.tokens.len() {
            self.pending = None;
        }
        self.tokens.truncate(len);
        Ok(())
    }
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        if self.tree_nodes == 0 {
            None
        } else {
            Some(self)
        }
    }
    fn hidden_states(&self) -> Option<&dyn HiddenStates> {
        self.hidden.as_ref().map(|_| self as &dyn HiddenStates)
    }
    fn supports_prefix_copy(&self) -> bool {
        true
    }
    /// Copies `src`'s first `len` tokens (the caller guarantees the same logits function).
    fn copy_prefix_from(&mut self, src: &Self, len: usize) -> Result<()> {
        if len > src.tokens.len() || src.pending.is_some() || src.vocab != self.vocab {
            return Err(Error::model(format!(
                "copy_prefix_from: {len} positions of a sequence of {} (pending tree: {})",
                src.tokens.len(),
                src.pending.is_some()
            )));
        }
        self.pending = None;
        self.tokens.clear();
        self.tokens.extend_from_slice(&src.tokens[..len]);
        Ok(())
    }
}

impl HiddenStates for ToyModel {
    fn hidden_size(&self) -> usize {
        self.hidden.as_ref().map_or(0, |(n, _)| *n)
    }
    fn last_hidden(&self) -> Option<&[f32]> {
        Some(&self.last_hidden)
    }
}

impl TreeTarget for ToyModel {
    fn max_tree_nodes(&self) -> usize {
        self.tree_nodes
    }
    fn forward_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let limits = TreeLimits::target(self.vocab, self.tree_nodes);
        block.validate(&limits).map_err(Error::InvalidTree)?;
        if root as usize >= self.vocab {
            return Err(Error::TokenOutOfVocab {
                what: "model input",
                token: root,
                vocab_size: self.vocab,
            });
        }
        let base = self.tokens.len();
        if base + block.rows() > self.max_context {
            return Err(Error::model("context overflow in a tree forward"));
        }
        self.tree_calls += 1;
        logits.clear();
        self.last_hidden.clear();
        let mut prefix = self.tokens.clone();
        prefix.push(root);
        logits.extend((self.f)(&prefix));
        if let Some((_, h)) = &self.hidden {
            self.last_hidden.extend(h(&prefix));
        }
        let mut path = Vec::new();
        for i in 0..block.len() {
            block.path_to(i, &mut path);
            prefix.truncate(base + 1);
            prefix.extend(path.iter().map(|&j| block.tokens()[j as usize]));
            logits.extend((self.f)(&prefix));
            if let Some((_, h)) = &self.hidden {
                self.last_hidden.extend(h(&prefix));
            }
        }
        self.tokens.push(root);
        self.tokens.extend_from_slice(block.tokens());
        let parents = (0..block.len())
            .map(|i| block.parent_row(i) as u32)
            .collect();
        self.pending = Some((base, parents));
        Ok(())
    }
    fn commit_tree(&mut self, path: &[u32]) -> Result<()> {
        let Some((base, parents)) = self.pending.take() else {
            return Err(Error::TargetContract {
                what: "commit_tree without a pending tree forward",
            });
        };
        let mut row = 0usize;
        for &j in path {
            if parents.get(j as usize).map(|&r| r as usize) != Some(row) {
                self.pending = Some((base, parents));
                return Err(Error::TargetContract {
                    what: "commit_tree path is not a path of the block",
                });
            }
            row = j as usize + 1;
        }
        let kept: Vec<u32> = path
            .iter()
            .map(|&j| self.tokens[base + 1 + j as usize])
            .collect();
        self.tokens.truncate(base + 1);
        self.tokens.extend(kept);
        Ok(())
    }
}

/// Wraps a target and logs the size of every [`TargetModel::prefill`] and
/// [`TargetModel::forward`] call, in order, to check how a caller drives a model. Its `prefill`
/// appends through the inner model's `forward` and discards the logits, as an engine that skips
/// its output head would.
#[derive(Debug)]
pub struct CallLog<M> {
    /// The wrapped model.
    pub inner: M,
    /// Token counts of the `prefill` calls.
    pub prefills: Vec<usize>,
    /// Token counts of the `forward` calls.
    pub forwards: Vec<usize>,
    /// `(tokens, logit rows)` of the [`TargetModel::forward_tail`] calls (a fused prefill);
    /// each runs the inner model's `forward_tail` (not logged in `prefills` / `forwards`).
    pub tails: Vec<(usize, usize)>,
    /// The blocks of the `forward_tree` calls: `(root, tokens, parent rows)`.
    pub trees: Vec<(u32, Vec<u32>, Vec<u32>)>,
    /// The paths of the `commit_tree` calls.
    pub commits: Vec<Vec<u32>>,
    tree_cap: usize,
}

impl<M> CallLog<M> {
    /// Wraps `inner` with empty logs.
    pub fn new(inner: M) -> Self {
        CallLog {
            inner,
            prefills: Vec::new(),
            forwards: Vec::new(),
            tails: Vec::new(),
            trees: Vec::new(),
            commits: Vec::new(),
            tree_cap: 0,
        }
    }
}

impl<M: TargetModel> TargetModel for CallLog<M> {
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
        self.forwards.push(tokens.len());
        self.inner.forward(tokens, logits)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.inner.truncate(len)
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.prefills.push(tokens.len());
        let mut scratch = Vec::new();
        self.inner.forward(tokens, &mut scratch)
    }
    fn forward_tail(&mut self, tokens: &[u32], rows: usize, logits: &mut Vec<f32>) -> Result<()> {
        self.tails.push((tokens.len(), rows));
        self.inner.forward_tail(tokens, rows, logits)
    }
    fn hidden_states(&self) -> Option<&dyn HiddenStates> {
        self.inner.hidden_states()
    }
    fn target_features(&mut self) -> Option<&mut dyn TargetFeatures> {
        self.inner.target_features()
    }
    /// The inner model's tree support, logged.
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        match self.inner.tree().map(|t| t.max_tree_nodes()) {
            Some(cap) => {
                self.tree_cap = cap;
                Some(self)
            }
            None => None,
        }
    }
}

impl<M: TargetModel> TreeTarget for CallLog<M> {
    fn max_tree_nodes(&self) -> usize {
        // Read from the inner model by `tree()`, the only way to reach this impl.
        self.tree_cap
    }
    fn forward_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let parents = (0..block.len())
            .map(|i| block.parent_row(i) as u32)
            .collect();
        self.trees.push((root, block.tokens().to_vec(), parents));
        match self.inner.tree() {
            Some(t) => t.forward_tree(root, block, logits),
            None => Err(Error::model("inner model has no tree support")),
        }
    }
    fn commit_tree(&mut self, path: &[u32]) -> Result<()> {
        self.commits.push(path.to_vec());
        match self.inner.tree() {
            Some(t) => t.commit_tree(path),
            None => Err(Error::model("inner model has no tree support")),
        }
    }
}

/// A proposer of uniformly random tokens (point masses), keyed by seed and position.
#[derive(Debug, Clone)]
pub struct RandomProposer {
    vocab: usize,
    salt: u64,
}

impl RandomProposer {
    /// Proposes tokens uniformly from `0..vocab`; `salt` varies the stream.
    pub fn new(vocab: usize, salt: u64) -> Self {
        RandomProposer { vocab, salt }
    }
}

impl Proposer for RandomProposer {
    /// `true`: drafts from the context's tokens alone.
    fn drafts_from_tokens(&self) -> bool {
        true
    }

    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let s = Stream::new(req.seed ^ self.salt.rotate_left(29) ^ 0xA5A5);
        let pos = req.context.len() as u64;
        for i in 0..req.max_draft {
            let b = s.bits(pos + i as u64, 7)[0];
            draft.tokens.push((b as u64 % self.vocab as u64) as u32);
        }
        Ok(())
    }
}

/// A greedy next-token function: prefix -> token.
pub type NextFn = Box<dyn Fn(&[u32]) -> u32 + Send + Sync>;

/// A proposer that always proposes a token the greedy target would not emit:
/// `(greedy_next(context) + 1) mod vocab`, continuing on its own wrong path.
pub struct WrongProposer {
    next: NextFn,
    vocab: u32,
}

impl WrongProposer {
    /// `next` is the target's greedy next-token function.
    pub fn new(vocab: u32, next: impl Fn(&[u32]) -> u32 + Send + Sync + 'static) -> Self {
        WrongProposer {
            next: Box::new(next),
            vocab,
        }
    }
}

impl Proposer for WrongProposer {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let mut ctx = req.context.to_vec();
        for _ in 0..req.max_draft {
            let t = ((self.next)(&ctx) + 1) % self.vocab;
            draft.tokens.push(t);
            ctx.push(t);
        }
        Ok(())
    }
}

/// A proposer that replays a fixed list of drafts, one per step (then empty drafts). The default
/// has no drafts: every step is a no-draft step.
#[derive(Debug, Clone, Default)]
pub struct ScriptedProposer {
    steps: Vec<Vec<u32>>,
    next: usize,
}

impl ScriptedProposer {
    /// Replays `steps` in order, each capped at the step's `max_draft`.
    pub fn new(steps: Vec<Vec<u32>>) -> Self {
        ScriptedProposer { steps, next: 0 }
    }
}

impl Proposer for ScriptedProposer {
    /// `true`: drafts from the context's tokens alone.
    fn drafts_from_tokens(&self) -> bool {
        true
    }

    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        if let Some(s) = self.steps.get(self.next) {
            draft.tokens.extend(s.iter().take(req.max_draft));
        }
        self.next += 1;
        Ok(())
    }
}

/// Wraps a target and gives it hidden states: the hidden state of a position is the one-hot
/// vector (`[vocab]`) of that position's input token, so [`HiddenStates::hidden_size`] is the
/// vocabulary size. `prefill` and `forward` both record one row per appended token.
#[derive(Debug)]
pub struct OneHotHidden<M> {
    /// The wrapped model.
    pub inner: M,
    hidden: Vec<f32>,
}

impl<M> OneHotHidden<M> {
    /// Wraps `inner`.
    pub fn new(inner: M) -> Self {
        OneHotHidden {
            inner,
            hidden: Vec::new(),
        }
    }
}

impl<M: TargetModel> OneHotHidden<M> {
    fn record(&mut self, tokens: &[u32]) {
        let v = self.inner.vocab_size();
        self.hidden.clear();
        self.hidden.resize(tokens.len() * v, 0.0);
        for (row, &t) in tokens.iter().enumerate() {
            if let Some(x) = self.hidden.get_mut(row * v + t as usize) {
                *x = 1.0;
            }
        }
    }
}

impl<M: TargetModel> TargetModel for OneHotHidden<M> {
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
        self.record(tokens);
        Ok(())
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.inner.prefill(tokens)?;
        self.record(tokens);
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.inner.truncate(len)
    }
    fn hidden_states(&self) -> Option<&dyn HiddenStates> {
        Some(self)
    }
}

impl<M: TargetModel> HiddenStates for OneHotHidden<M> {
    fn hidden_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn last_hidden(&self) -> Option<&[f32]> {
        Some(&self.hidden)
    }
}

/// How [`ToyHeads`] use their input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadsConditioning {
    /// MTP-style: head `j` predicts `next^(j + 1)(last_token)`.
    LastToken,
    /// Medusa-style, ignoring the last token: head `j` predicts `next^(j + 2)(x)`, where `x` is
    /// the argmax of the (one-hot) hidden state, i.e. the input token of the row that predicted
    /// the last token, and `next(x)` the target's own prediction there.
    HiddenOnly,
}

/// Draft heads for a target whose greedy next token depends only on the last token
/// (`next(t)`), reading one-hot hidden states such as [`OneHotHidden`]'s. Each head puts logit
/// 10 on its prediction and 0 elsewhere. Every input is recorded in [`ToyHeads::inputs`].
pub struct ToyHeads {
    next: Box<dyn Fn(u32) -> u32 + Send + Sync>,
    vocab: usize,
    heads: usize,
    conditioning: HeadsConditioning,
    /// `(hidden, last_token, position)` of every [`DraftHeads::logits`] call, in order.
    pub inputs: Vec<(Vec<f32>, u32, usize)>,
}

impl std::fmt::Debug for ToyHeads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToyHeads")
            .field("vocab", &self.vocab)
            .field("heads", &self.heads)
            .field("conditioning", &self.conditioning)
            .finish()
    }
}

impl ToyHeads {
    /// `heads` heads over `vocab` tokens for the chain `next` (results are taken mod `vocab`).
    pub fn new(
        vocab: usize,
        heads: usize,
        conditioning: HeadsConditioning,
        next: impl Fn(u32) -> u32 + Send + Sync + 'static,
    ) -> Self {
        ToyHeads {
            next: Box::new(next),
            vocab,
            heads,
            conditioning,
            inputs: Vec::new(),
        }
    }
}

impl DraftHeads for ToyHeads {
    fn num_heads(&self) -> usize {
        self.heads
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn hidden_size(&self) -> usize {
        self.vocab
    }
    fn logits(&mut self, input: &HeadsInput<'_>, n: usize, logits: &mut Vec<f32>) -> Result<()> {
        self.inputs
            .push((input.hidden.to_vec(), input.last_token, input.position));
        let v = self.vocab as u32;
        let mut t = match self.conditioning {
            HeadsConditioning::LastToken => input.last_token,
            HeadsConditioning::HiddenOnly => {
                let x = input
                    .hidden
                    .iter()
                    .position(|&h| h > 0.5)
                    .ok_or_else(|| Error::proposer("toy heads: hidden state is not one-hot"))?;
                (self.next)(x as u32) % v
            }
        };
        logits.clear();
        for _ in 0..n {
            t = (self.next)(t) % v;
            logits.extend((0..v).map(|x| if x == t { 10.0 } else { 0.0 }));
        }
        Ok(())
    }
}

/// A standard normal keyed by `(key, idx)` on `stream` (Box-Muller from two 24-bit uniforms).
fn normal(stream: &Stream, key: u64, idx: u32) -> f32 {
    let b = stream.bits(key, idx);
    let u1 = ((b[0] >> 8) as f32 + 0.5) / 16_777_216.0;
    let u2 = (b[1] >> 8) as f32 / 16_777_216.0;
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

/// A toy recurrent language model with a known final hidden state, for feature-conditioned draft
/// models (EAGLE; Li et al. 2024): the hidden state of position `p` is
/// `f_p = tanh(A f_{p-1} + E[x_p])` (`f_{-1} = 0`), the logits `W f_p`. A draft that knows
/// `f_{p-1}` and `x_p` can compute the target's row at `p` exactly ([`ToyFeatureDraft`] with the
/// same parameters), so feature plumbing errors show up as wrong drafts.
#[derive(Debug, Clone)]
pub struct ToyRnn {
    vocab: usize,
    hidden: usize,
    /// `[hidden, hidden]` row-major.
    a: Vec<f32>,
    /// `[vocab, hidden]`: input embeddings.
    e: Vec<f32>,
    /// `[vocab, hidden]`: output head.
    w: Vec<f32>,
}

impl ToyRnn {
    /// Pseudo-random parameters keyed by `seed`; `scale` scales the logits (larger: more
    /// peaked rows).
    pub fn new(vocab: usize, hidden: usize, scale: f32, seed: u64) -> Self {
        let s = Stream::new(seed ^ 0x005E_ED0F_4EA7);
        let ra = 1.1 / (hidden as f32).sqrt();
        let rw = scale / (hidden as f32).sqrt();
        ToyRnn {
            vocab,
            hidden,
            a: (0..hidden * hidden)
                .map(|i| ra * normal(&s, 1, i as u32))
                .collect(),
            e: (0..vocab * hidden)
                .map(|i| normal(&s, 2, i as u32))
                .collect(),
            w: (0..vocab * hidden)
                .map(|i| rw * normal(&s, 3, i as u32))
                .collect(),
        }
    }

    /// The same model with independent normal noise of scale `noise` (relative to each
    /// parameter group's own scale) added to every parameter: a draft that is often, not
    /// always, right.
    pub fn perturbed(&self, noise: f32, seed: u64) -> Self {
        let s = Stream::new(seed ^ 0x0004_015E);
        let ra = 1.1 / (self.hidden as f32).sqrt();
        let bump = |v: &[f32], key: u64, r: f32| -> Vec<f32> {
            v.iter()
                .enumerate()
                .map(|(i, &x)| x + noise * r * normal(&s, key, i as u32))
                .collect()
        };
        let rw = self.w.iter().map(|x| x * x).sum::<f32>().sqrt() / (self.w.len() as f32).sqrt();
        ToyRnn {
            vocab: self.vocab,
            hidden: self.hidden,
            a: bump(&self.a, 4, ra),
            e: bump(&self.e, 5, 1.0),
            w: bump(&self.w, 6, rw),
        }
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Width of the hidden state.
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// One recurrence step: `tanh(A prev + E[token])` (`prev`: `[hidden]`; tokens are taken mod
    /// the vocabulary).
    pub fn step(&self, prev: &[f32], token: u32) -> Vec<f32> {
        let h = self.hidden;
        let t = token as usize % self.vocab;
        (0..h)
            .map(|i| {
                let mut x = self.e[t * h + i];
                for (j, &p) in prev.iter().enumerate().take(h) {
                    x += self.a[i * h + j] * p;
                }
                x.tanh()
            })
            .collect()
    }

    /// The hidden state after `prefix` (zeros for an empty prefix).
    pub fn hidden(&self, prefix: &[u32]) -> Vec<f32> {
        let mut f = vec![0.0; self.hidden];
        for &t in prefix {
            f = self.step(&f, t);
        }
        f
    }

    /// The logits `W feature` (`[vocab]`).
    pub fn head(&self, feature: &[f32]) -> Vec<f32> {
        let h = self.hidden;
        (0..self.vocab)
            .map(|v| (0..h).map(|i| self.w[v * h + i] * feature[i]).sum())
            .collect()
    }

    /// The target: a [`ToyModel`] with logits `head(hidden(prefix))` and hidden states
    /// `hidden(prefix)` ([`ToyModel::with_hidden`]); add tree support with
    /// [`ToyModel::with_tree`].
    pub fn target(&self, max_context: usize) -> ToyModel {
        let (a, b) = (self.clone(), self.clone());
        let f: LogitsFn = Arc::new(move |p: &[u32]| a.head(&a.hidden(p)));
        let hf: HiddenFn = Arc::new(move |p: &[u32]| b.hidden(p));
        ToyModel::new(self.vocab, max_context, f).with_hidden(self.hidden, hf)
    }
}

/// Which feature a row of [`ToyFeatureDraft`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureSource {
    /// Position 0: no previous position (zeros).
    Start,
    /// The held target feature of the previous position.
    Target,
    /// The model's own predicted feature of the previous position (a draft row).
    Own,
}

/// A feature-conditioned toy draft model (an EAGLE head on a [`ToyRnn`] target): its row at
/// position `p` reads the token `x_p` and the feature of position `p - 1`, the held target
/// feature ([`TargetFeatures`]) when `p - 1 < target_hidden_len()`, else its own predicted
/// feature of `p - 1`; it predicts `f_p = rnn.step(feature, x_p)` and outputs `rnn.head(f_p)`.
/// With the target's own [`ToyRnn`] and the true features its rows equal the target's.
/// Records the feature each row of its sequence read and every `set_target_hidden` call.
#[derive(Debug, Clone)]
pub struct ToyFeatureDraft {
    rnn: ToyRnn,
    max_context: usize,
    tokens: Vec<u32>,
    /// `[seq_len, hidden]`: the feature each row read.
    inputs: Vec<f32>,
    sources: Vec<FeatureSource>,
    /// `[seq_len, hidden]`: each row's predicted feature.
    own: Vec<f32>,
    /// `[target_hidden_len, hidden]`.
    held: Vec<f32>,
    tree_nodes: usize,
    pending: Option<(usize, Vec<u32>)>,
    /// `(start, rows)` of every [`TargetFeatures::set_target_hidden`] call, in order.
    pub feature_sets: Vec<(usize, usize)>,
    /// Number of rows computed at position 0 by [`TargetModel::forward`] (or `prefill`): each is
    /// a start from an empty sequence. (A tree forward over a one-token context also computes
    /// its root at position 0; not counted.)
    pub first_rows: usize,
}

impl ToyFeatureDraft {
    /// A draft model computing with `rnn`'s parameters.
    pub fn new(rnn: ToyRnn, max_context: usize) -> Self {
        ToyFeatureDraft {
            rnn,
            max_context,
            tokens: Vec::new(),
            inputs: Vec::new(),
            sources: Vec::new(),
            own: Vec::new(),
            held: Vec::new(),
            tree_nodes: 0,
            pending: None,
            feature_sets: Vec::new(),
            first_rows: 0,
        }
    }

    /// Offers tree support for blocks of up to `max_nodes` nodes (a node reads its parent's
    /// predicted feature).
    pub fn with_tree(mut self, max_nodes: usize) -> Self {
        self.tree_nodes = max_nodes;
        self
    }

    /// The tokens of the sequence.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The held target features, `[target_hidden_len, hidden]`.
    pub fn held(&self) -> &[f32] {
        &self.held
    }

    /// The feature the row at position `p` of the sequence read, and where it came from.
    pub fn row_feature(&self, p: usize) -> Option<(FeatureSource, &[f32])> {
        let h = self.rnn.hidden;
        Some((*self.sources.get(p)?, self.inputs.get(p * h..(p + 1) * h)?))
    }

    /// The feature a new row at position `p` reads (`p <= seq_len`).
    fn feature_in(&self, p: usize) -> (FeatureSource, Vec<f32>) {
        let h = self.rnn.hidden;
        if p == 0 {
            (FeatureSource::Start, vec![0.0; h])
        } else if p - 1 < self.held.len() / h {
            (
                FeatureSource::Target,
                self.held[(p - 1) * h..p * h].to_vec(),
            )
        } else {
            (FeatureSource::Own, self.own[(p - 1) * h..p * h].to_vec())
        }
    }

    /// Appends a row reading `feature` and writes its logits.
    fn push_row(
        &mut self,
        token: u32,
        src: FeatureSource,
        feature: Vec<f32>,
        logits: &mut Vec<f32>,
    ) {
        let f = self.rnn.step(&feature, token);
        logits.extend(self.rnn.head(&f));
        self.tokens.push(token);
        self.sources.push(src);
        self.inputs.extend(feature);
        self.own.extend(f);
    }

    fn check_token(&self, t: u32) -> Result<()> {
        if t as usize >= self.rnn.vocab {
            return Err(Error::TokenOutOfVocab {
                what: "model input",
                token: t,
                vocab_size: self.rnn.vocab,
            });
        }
        Ok(())
    }
}

impl TargetModel for ToyFeatureDraft {
    fn vocab_size(&self) -> usize {
        self.rnn.vocab
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn seq_len(&self) -> usize {
        self.tokens.len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        if self.tokens.len() + tokens.len() > self.max_context {
            return Err(Error::model("context overflow"));
        }
        for &t in tokens {
            self.check_token(t)?;
        }
        logits.clear();
        for &t in tokens {
            self.first_rows += self.tokens.is_empty() as usize;
            let (src, feature) = self.feature_in(self.tokens.len());
            self.push_row(t, src, feature, logits);
        }
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.tokens.len() {
            return Err(Error::model("truncate beyond the sequence"));
        }
        if len < self.tokens.len() {
            self.pending = None;
        }
        let h = self.rnn.hidden;
        self.tokens.truncate(len);
        self.sources.truncate(len);
        self.inputs.truncate(len * h);
        self.own.truncate(len * h);
        Ok(())
    }
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        if self.tree_nodes == 0 {
            None
        } else {
            Some(self)
        }
    }
    fn target_features(&mut self) -> Option<&mut dyn TargetFeatures> {
        Some(self)
    }
}

impl TargetFeatures for ToyFeatureDraft {
    fn hidden_size(&self) -> usize {
        self.rnn.hidden
    }
    fn target_hidden_len(&self) -> usize {
        self.held.len() / self.rnn.hidden
    }
    fn set_target_hidden(&mut self, start: usize, rows: &[f32]) -> Result<()> {
        let h = self.rnn.hidden;
        let held = self.target_hidden_len();
        if start > held {
            return Err(Error::ShapeMismatch {
                what: "target hidden states held before start (set_target_hidden)",
                expected: start,
                actual: held,
            });
        }
        if !rows.len().is_multiple_of(h) {
            return Err(Error::ShapeMismatch {
                what: "set_target_hidden rows ([n, hidden_size])",
                expected: rows.len() / h * h,
                actual: rows.len(),
            });
        }
        self.feature_sets.push((start, rows.len() / h));
        self.held.truncate(start * h);
        self.held.extend_from_slice(rows);
        let keep = self.tokens.len().min(start + 1);
        self.truncate(keep)
    }
}

impl TreeTarget for ToyFeatureDraft {
    fn max_tree_nodes(&self) -> usize {
        self.tree_nodes
    }
    fn forward_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let limits = TreeLimits::target(self.rnn.vocab, self.tree_nodes);
        block.validate(&limits).map_err(Error::InvalidTree)?;
        self.check_token(root)?;
        let base = self.tokens.len();
        if base + block.rows() > self.max_context {
            return Err(Error::model("context overflow in a tree forward"));
        }
        logits.clear();
        let (src, feature) = self.feature_in(base);
        self.push_row(root, src, feature, logits);
        let h = self.rnn.hidden;
        for i in 0..block.len() {
            // Row r of the block sits at position base + r of the flat sequence.
            let r = base + block.parent_row(i);
            let feature = self.own[r * h..(r + 1) * h].to_vec();
            self.push_row(block.tokens()[i], FeatureSource::Own, feature, logits);
        }
        let parents = (0..block.len())
            .map(|i| block.parent_row(i) as u32)
            .collect();
        self.pending = Some((base, parents));
        Ok(())
    }
    fn commit_tree(&mut self, path: &[u32]) -> Result<()> {
        let Some((base, parents)) = self.pending.take() else {
            return Err(Error::TargetContract {
                what: "commit_tree without a pending tree forward",
            });
        };
        let mut row = 0usize;
        for &j in path {
            if parents.get(j as usize).map(|&r| r as usize) != Some(row) {
                self.pending = Some((base, parents));
                return Err(Error::TargetContract {
                    what: "commit_tree path is not a path of the block",
                });
            }
            row = j as usize + 1;
        }
        let h = self.rnn.hidden;
        for (d, &j) in path.iter().enumerate() {
            let (from, to) = (base + 1 + j as usize, base + 1 + d);
            self.tokens[to] = self.tokens[from];
            self.sources[to] = self.sources[from];
            self.inputs.copy_within(from * h..(from + 1) * h, to * h);
            self.own.copy_within(from * h..(from + 1) * h, to * h);
        }
        self.truncate(base + 1 + path.len())
    }
}

/// A toy recurrent language model that **cannot truncate**: it holds only a running state
/// `s_p = tanh(A s_{p-1} + E[x_p])` (`[hidden]` floats, `s_{-1} = 0`; [`ToyRnn::step`]) and a
/// position count, no tokens; the logits of a position are `W s_p` ([`ToyRnn::head`]). The
/// same parameters as a [`ToyRnn`], so its logits are bit-identical to
/// [`RecurrentToy::reference`] (a [`ToyModel`] that recomputes every prefix and can truncate),
/// which makes plain greedy decoding of either the reference for speculative decoding of this
/// one.
///
/// It rolls back through [`TargetModel::rollback`] in one of two modes, chosen at construction:
/// [`RecurrentToy::snapshot`] ([`crate::Rollback::Snapshot`]: one saved copy of the state) or
/// [`RecurrentToy::row_states`] ([`crate::Rollback::RowStates`]: the state after each position
/// appended by `forward` since the commit point). [`TargetModel::truncate`]`(0)` resets it
/// (state zero, the snapshot and the row states dropped), `truncate(seq_len())` changes
/// nothing, any other length is refused with [`Error::StateRollback`] (or [`Error::Model`]
/// beyond the length), the state unchanged. Errors of `forward` / `prefill` (an id `>= vocab`,
/// a context overflow) change nothing. Use it as a [`crate::BatchTarget`] with
/// [`crate::PerSlot`].
#[derive(Debug, Clone)]
pub struct RecurrentToy {
    rnn: ToyRnn,
    max_context: usize,
    mode: crate::model::RollbackMode,
    state: Vec<f32>,
    len: usize,
    /// Snapshot mode: the saved state and its length.
    saved: Option<(Vec<f32>, usize)>,
    /// Row-state mode: the state and length at the commit point, and the states after each
    /// position appended since.
    commit: (Vec<f32>, usize),
    rows: Vec<Vec<f32>>,
    /// Number of [`TargetModel::forward`] calls so far.
    pub forward_calls: usize,
    /// Tokens passed to [`TargetModel::forward`] so far.
    pub forward_tokens: usize,
    /// Tokens passed to [`TargetModel::prefill`] so far (prompt prefills and replays).
    pub prefill_tokens: usize,
    /// Successful [`crate::StateSnapshot::restore_state`] calls so far.
    pub restores: usize,
}

impl RecurrentToy {
    fn with_mode(rnn: ToyRnn, max_context: usize, mode: crate::model::RollbackMode) -> Self {
        let zero = vec![0.0; rnn.hidden_size()];
        RecurrentToy {
            max_context,
            mode,
            state: zero.clone(),
            len: 0,
            saved: None,
            commit: (zero, 0),
            rows: Vec::new(),
            rnn,
            forward_calls: 0,
            forward_tokens: 0,
            prefill_tokens: 0,
            restores: 0,
        }
    }

    /// The model of `rnn`'s parameters in snapshot mode ([`crate::Rollback::Snapshot`]).
    pub fn snapshot(rnn: ToyRnn, max_context: usize) -> Self {
        Self::with_mode(rnn, max_context, crate::model::RollbackMode::Snapshot)
    }

    /// The model of `rnn`'s parameters with per-row states ([`crate::Rollback::RowStates`]).
    pub fn row_states(rnn: ToyRnn, max_context: usize) -> Self {
        Self::with_mode(rnn, max_context, crate::model::RollbackMode::RowStates)
    }

    /// Its rollback mode.
    pub fn mode(&self) -> crate::model::RollbackMode {
        self.mode
    }

    /// The running state, `[hidden]`.
    pub fn state(&self) -> &[f32] {
        &self.state
    }

    /// The same model as a [`ToyModel`] that recomputes the state of every prefix (and so can
    /// truncate): the reference for plain decoding.
    pub fn reference(&self) -> ToyModel {
        self.rnn.target(self.max_context)
    }

    /// Refuses ids `>= vocab` and a context overflow before anything changes.
    fn check(&self, tokens: &[u32]) -> Result<()> {
        if self.len + tokens.len() > self.max_context {
            return Err(Error::model(format!(
                "context overflow: {} + {} > {}",
                self.len,
                tokens.len(),
                self.max_context
            )));
        }
        let vocab = self.rnn.vocab_size();
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&t) => Err(Error::TokenOutOfVocab {
                what: "model input",
                token: t,
                vocab_size: vocab,
            }),
            None => Ok(()),
        }
    }

    /// Sets the commit point at the current end (row-state mode).
    fn set_commit(&mut self) {
        self.rows.clear();
        self.commit = (self.state.clone(), self.len);
    }
}

impl TargetModel for RecurrentToy {
    fn vocab_size(&self) -> usize {
        self.rnn.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn seq_len(&self) -> usize {
        self.len
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.check(tokens)?;
        self.forward_calls += 1;
        self.forward_tokens += tokens.len();
        logits.clear();
        for &t in tokens {
            self.state = self.rnn.step(&self.state, t);
            self.len += 1;
            logits.extend(self.rnn.head(&self.state));
            if self.mode == crate::model::RollbackMode::RowStates {
                self.rows.push(self.state.clone());
            }
        }
        Ok(())
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.check(tokens)?;
        self.prefill_tokens += tokens.len();
        for &t in tokens {
            self.state = self.rnn.step(&self.state, t);
            self.len += 1;
        }
        self.set_commit();
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        if len == self.len {
            return Ok(());
        }
        if len > self.len {
            return Err(Error::model(format!(
                "truncate to {len} beyond length {}",
                self.len
            )));
        }
        if len != 0 {
            return Err(Error::StateRollback {
                what: "truncate of a recurrent state to a length other than 0 or seq_len",
            });
        }
        self.state.iter_mut().for_each(|x| *x = 0.0);
        self.len = 0;
        self.saved = None;
        self.set_commit();
        Ok(())
    }
    fn rollback(&mut self) -> Option<crate::model::Rollback<'_>> {
        use crate::model::{Rollback, RollbackMode};
        match self.mode {
            RollbackMode::Snapshot => Some(Rollback::Snapshot(self)),
            RollbackMode::RowStates => Some(Rollback::RowStates(self)),
            RollbackMode::Truncate => None,
        }
    }
}

impl crate::model::StateSnapshot for RecurrentToy {
    fn save_state(&mut self) -> Result<()> {
        self.saved = Some((self.state.clone(), self.len));
        Ok(())
    }
    fn restore_state(&mut self) -> Result<()> {
        let Some((state, len)) = &self.saved else {
            return Err(Error::StateRollback {
                what: "restore_state without a saved state",
            });
        };
        self.state.clone_from(state);
        self.len = *len;
        self.restores += 1;
        Ok(())
    }
}

impl crate::model::RowStates for RecurrentToy {
    fn pending_rows(&self) -> usize {
        self.rows.len()
    }
    fn keep_rows(&mut self, rows: usize) -> Result<()> {
        if rows > self.rows.len() {
            return Err(Error::StateRollback {
                what: "keep_rows of more rows than were appended since the commit point",
            });
        }
        self.state = match rows {
            0 => self.commit.0.clone(),
            r => self.rows[r - 1].clone(),
        };
        self.len = self.commit.1 + rows;
        self.set_commit();
        Ok(())
    }
}

/// The next token of case C10's model ([`ToyModel::c10`]) after `prefix`:
/// `(sum(prefix) * 31 + len(prefix)) mod 7`, the sum in `u64`.
pub fn c10_next(prefix: &[u32]) -> u32 {
    let s: u64 = prefix.iter().map(|&t| t as u64).sum();
    ((s * 31 + prefix.len() as u64) % 7) as u32
}

/// The `n` tokens that plain greedy decoding of [`ToyModel::c10`] emits after `prompt`
/// ([`c10_next`] applied `n` times), for checking a loop's greedy output.
pub fn c10_greedy(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    for _ in 0..n {
        ctx.push(c10_next(&ctx));
    }
    ctx[prompt.len()..].to_vec()
}
