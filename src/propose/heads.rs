//! Heads proposer: MTP / Medusa heads on the target's last hidden state (Cai et al. 2024,
//! "Medusa: simple LLM inference acceleration framework with multiple decoding heads";
//! multi-token prediction, Gloeckle et al. 2024; DeepSeek-V3's MTP modules and EAGLE, Li et al.
//! 2024, which also read the last token).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::sampler::DraftSampler;
use super::{Draft, ProposeRequest, Proposer};
use crate::error::{Error, Result};
use crate::tree::SiblingScheme;

/// Default [`HeadsProposer::tree_top_k`].
const DEFAULT_TREE_TOP_K: usize = 4;

/// A candidate node of a heads tree: cumulative log-probability, parent row, token, depth.
#[derive(Debug, Clone, Copy)]
struct Slot {
    score: f64,
    /// Order of creation: ties go to the earlier slot.
    seq: usize,
    parent: u32,
    token: u32,
    depth: usize,
}

impl PartialEq for Slot {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Slot {}
impl PartialOrd for Slot {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Slot {
    /// The max-heap's order: higher score first, then the earlier slot.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.seq.cmp(&self.seq))
    }
}

/// What [`DraftHeads::logits`] conditions on at one step.
///
/// For a context `c` of `L` tokens: `hidden` is the target's final hidden state of the row at
/// position `L - 2` (input `c[L - 2]`), the row whose output head predicted position `L - 1`;
/// `last_token` is `c[L - 1]`, the token really at that position; `position` is `L`, the
/// absolute position of the first drafted token.
///
/// For a generated token, `last_token` is the target's own prediction from `hidden`. For the
/// prompt's last token it need not be (the prompt is the caller's text, case C13): heads that
/// condition on `last_token` (MTP modules, EAGLE-style draft layers) stay exact there, while
/// Medusa-style heads, which read `hidden` alone and may ignore `last_token`, implicitly assume
/// the target's prediction.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct HeadsInput<'a> {
    /// The target's final hidden state (after the last norm, before the output head) of the row
    /// that predicted `last_token`, `[hidden_size]`.
    pub hidden: &'a [f32],
    /// The last token of the context (the token the first head continues from).
    pub last_token: u32,
    /// Absolute position of the first drafted token: the context length. Head `j` drafts the
    /// token at position `position + j`.
    pub position: usize,
    /// The target's final hidden states of every context position but the last,
    /// `[position - 1, hidden_size]` ([`ProposeRequest::target_hidden_rows`]), for heads that
    /// attend over the context (MTP modules, EAGLE-style layers); `None` when the target does
    /// not expose them. Its last row is `hidden`. (A head that drafts autoregressively with
    /// its own KV cache is better driven as a draft model through
    /// [`crate::TargetFeatures`] and [`crate::DraftModelProposer`]; see the candle adapter's
    /// EAGLE head.)
    pub hidden_rows: Option<&'a [f32]>,
}

impl<'a> HeadsInput<'a> {
    /// The input for a context of `position` tokens ending in `last_token`, with `hidden`
    /// (`[hidden_size]`) the hidden state of the row that predicted `last_token`.
    pub fn new(hidden: &'a [f32], last_token: u32, position: usize) -> Self {
        HeadsInput {
            hidden,
            last_token,
            position,
            hidden_rows: None,
        }
    }
}

/// Trained draft heads that map the target's final hidden state (and the last token) to
/// next-token logits.
///
/// Head `j` (0-based) predicts the token `j + 1` positions after `input.last_token`, that is the
/// token at absolute position `input.position + j`; see [`HeadsInput`] for which hidden state
/// the heads get and why the last token matters.
///
/// Heads that keep state across calls (for example a draft layer's KV cache) must key it by
/// `input.position` and never serve a previous request's state: they rebuild it, or return
/// [`Error::StaleProposerState`] when they cannot.
pub trait DraftHeads {
    /// Number of heads (the largest draft length the heads can propose).
    fn num_heads(&self) -> usize;

    /// Width of each head's logits, in tokens (may be smaller than the target vocabulary).
    fn vocab_size(&self) -> usize;

    /// Width of the hidden state the heads read.
    fn hidden_size(&self) -> usize;

    /// Writes the logits of the first `n <= num_heads()` heads for `input` into `logits`
    /// (cleared first), shape `[n, vocab_size]`. `input.hidden` has `hidden_size()` entries.
    ///
    /// # Errors
    /// Implementation defined (wrap engine errors in [`Error::Proposer`]).
    fn logits(&mut self, input: &HeadsInput<'_>, n: usize, logits: &mut Vec<f32>) -> Result<()>;
}

/// Proposes with [`DraftHeads`]: draft `i` is sampled from head `i`'s processed distribution
/// (the request's configuration; penalties and masks see the context plus drafts `0..i`), with
/// uniforms from [`Stream`](crate::rng::Stream) on lane [`lane::DRAFT`](crate::rng::lane::DRAFT);
/// q is returned (`[k, head vocab]`). Greedy requests take each head's argmax and return no q.
/// Heads are independent per position (as in Medusa-1), which does not affect losslessness: the
/// verifier only needs the q each draft was really sampled from. The draft ends at its first EOS
/// id: no head row after it is processed.
///
/// The heads get [`HeadsInput`] built from the request: `req.target_hidden`,
/// `req.context.last()` and `req.context.len()`. Without a hidden state (the target does not
/// expose one, or the prompt had a single token) or with an empty context it proposes nothing.
///
/// # State across requests
///
/// The proposer keeps no per-request state: every proposal is a function of the request alone
/// (and of the heads), so using it directly on another request without [`Proposer::begin`] is
/// always exact. Stateful heads follow the rule on [`DraftHeads`].
///
/// `HeadsProposer<H>` is `Send` when `H` is `Send`, and `Sync` when `H` is `Sync`.
#[derive(Debug)]
pub struct HeadsProposer<H> {
    heads: H,
    sampler: DraftSampler,
    logits: Vec<f32>,
    tree_top_k: usize,
}

impl<H: DraftHeads> HeadsProposer<H> {
    /// Wraps `heads`, with [`HeadsProposer::tree_top_k`] 4.
    pub fn new(heads: H) -> Self {
        HeadsProposer {
            heads,
            sampler: DraftSampler::default(),
            logits: Vec::new(),
            tree_top_k: DEFAULT_TREE_TOP_K,
        }
    }

    /// Sets how many candidates of each head a tree draft considers per node
    /// ([`Proposer::propose_tree`]; also capped by [`ProposeRequest::max_branch`]).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `tree_top_k` when it is not in `1..=64`.
    pub fn with_tree_top_k(mut self, top_k: usize) -> Result<Self> {
        if !(1..=64).contains(&top_k) {
            return Err(Error::config("tree_top_k", top_k, "must be in 1..=64"));
        }
        self.tree_top_k = top_k;
        Ok(self)
    }

    /// Candidates per head of a tree draft (default 4).
    pub fn tree_top_k(&self) -> usize {
        self.tree_top_k
    }

    /// The heads' logits for `req`: `Ok(None)` when the request gives no hidden state or an
    /// empty context, or asks for no token; else the number of rows `n` written into
    /// `self.logits` (`[n, vocab]`).
    fn head_rows(&mut self, req: &ProposeRequest<'_>) -> Result<Option<usize>> {
        let Some(hidden) = req.target_hidden else {
            return Ok(None);
        };
        if hidden.len() != self.heads.hidden_size() {
            return Err(Error::ShapeMismatch {
                what: "target hidden state for heads",
                expected: self.heads.hidden_size(),
                actual: hidden.len(),
            });
        }
        let Some(&last_token) = req.context.last() else {
            return Ok(None);
        };
        let k = req.max_draft.min(self.heads.num_heads());
        if k == 0 {
            return Ok(None);
        }
        let vocab = self.heads.vocab_size();
        let input = HeadsInput {
            hidden_rows: req.target_hidden_rows,
            ..HeadsInput::new(hidden, last_token, req.context.len())
        };
        self.heads.logits(&input, k, &mut self.logits)?;
        if self.logits.len() != k * vocab {
            return Err(Error::ShapeMismatch {
                what: "head logits ([n, vocab])",
                expected: k * vocab,
                actual: self.logits.len(),
            });
        }
        Ok(Some(k))
    }

    /// The wrapped heads.
    pub fn heads(&self) -> &H {
        &self.heads
    }

    /// Gives back the wrapped heads.
    pub fn into_inner(self) -> H {
        self.heads
    }
}

impl<H: DraftHeads> Proposer for HeadsProposer<H> {
    /// Proposes up to `min(req.max_draft, num_heads)` tokens; see [`HeadsProposer`].
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `req.target_hidden` is not `[hidden_size]` or the heads
    /// return logits that are not `[n, vocab_size]`; errors of the heads; processing errors of
    /// the request's configuration (for example [`Error::NoAllowedToken`]).
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let Some(k) = self.head_rows(req)? else {
            return Ok(());
        };
        let vocab = self.heads.vocab_size();
        let cfg = req.config;
        self.sampler.begin(req, vocab)?;
        for i in 0..k {
            let row = &self.logits[i * vocab..(i + 1) * vocab];
            let t = self.sampler.draw(cfg, req.seed, row, i, draft)?;
            // A draft ends at its own EOS: no head row after it is processed.
            if req.is_eos(t) {
                break;
            }
        }
        self.sampler.finish(cfg, vocab, draft);
        Ok(())
    }

    /// A Medusa token tree (Cai et al. 2024, section 2.1.2, "tree attention"): the top
    /// [`HeadsProposer::tree_top_k`] candidates of each head (capped by `req.max_branch`), the
    /// candidate paths of their Cartesian product ranked by the product of their head
    /// probabilities, and the best `req.max_nodes` nodes kept. Depth `d` uses head `d - 1`, so
    /// the depth is at most `min(req.max_draft, num_heads)`. With `req.max_nodes <=
    /// req.max_draft` (no budget to branch; the convention of the shipped proposers) it returns
    /// the chain of [`Proposer::propose`] with `max_draft = req.max_nodes`.
    ///
    /// Built best first: a node enters when it is the best remaining candidate, and only then
    /// are its children (head `depth`'s candidates) offered, so the tree is ancestor-closed and
    /// in topological order; a node's children follow its parent's product order. Each head
    /// row is processed along the node's own path (penalties, masks and EOS suppression over
    /// the context plus the node's ancestors, as the verifier processes the target row), and
    /// probabilities are those of the processed row (sampling requests) or of the softmax at
    /// temperature 1 after penalties, bias and masks (greedy requests). No node is added below
    /// an EOS node.
    ///
    /// The nodes are point masses ([`SiblingScheme::Deterministic`], no q), exact for any choice
    /// of candidates, also under sampling. The heads' q is not used in trees: head `i`'s
    /// distribution reads the target's hidden state at the root only and does not condition on
    /// the drafted path, so the children of different nodes at one depth would share one q and
    /// top-k candidates are not samples of it. Chains ([`Proposer::propose`]) still sample
    /// with q. A tree whose every group has one node is returned as a chain (no `parents`).
    ///
    /// # Errors
    /// As [`Proposer::propose`].
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        if req.max_nodes <= req.max_draft {
            let chain = ProposeRequest {
                max_draft: req.max_nodes,
                ..*req
            };
            return self.propose(&chain, draft);
        }
        draft.clear();
        if req.max_branch == 0 {
            return Ok(());
        }
        let Some(depth_max) = self.head_rows(req)? else {
            return Ok(());
        };
        let vocab = self.heads.vocab_size();
        let cfg = req.config;
        let width = self.tree_top_k.min(req.max_branch);
        self.sampler.begin(req, vocab)?;
        let mut heap = BinaryHeap::new();
        let (mut top, mut path, mut path_tokens) = (Vec::new(), Vec::new(), Vec::new());
        let mut seq = 0usize;
        // Offers the children of row `row` (0 = the root) at depth `depth + 1`.
        let mut row = 0usize;
        let mut depth = 0usize;
        let mut base = 0.0f64;
        while draft.tokens.len() < req.max_nodes {
            if depth < depth_max {
                draft
                    .block()
                    .row_path_tokens(row, &mut path, &mut path_tokens);
                self.sampler.goto(&path_tokens)?;
                let logits = &self.logits[depth * vocab..(depth + 1) * vocab];
                self.sampler.top(cfg, logits, depth, width, &mut top)?;
                for &(token, lp) in &top {
                    heap.push(Slot {
                        score: base + lp as f64,
                        seq,
                        parent: row as u32,
                        token,
                        depth: depth + 1,
                    });
                    seq += 1;
                }
            }
            let Some(best) = heap.pop() else {
                break;
            };
            draft.tokens.push(best.token);
            draft.parents.push(best.parent);
            row = draft.tokens.len();
            depth = if req.is_eos(best.token) {
                // Nothing after an end: no children.
                depth_max
            } else {
                best.depth
            };
            base = best.score;
        }
        draft.schemes = vec![SiblingScheme::Deterministic; draft.tokens.len()];
        if draft.block().is_chain() {
            draft.parents.clear();
            draft.schemes.clear();
        }
        Ok(())
    }

    /// `"heads"`.
    fn name(&self) -> &'static str {
        "heads"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingConfig;
    use crate::test_util::{HeadsConditioning, ToyHeads};

    fn next(t: u32) -> u32 {
        (3 * t + 1) % 8
    }

    fn one_hot(t: u32) -> Vec<f32> {
        (0..8).map(|v| if v == t { 1.0 } else { 0.0 }).collect()
    }

    fn heads() -> HeadsProposer<ToyHeads> {
        HeadsProposer::new(ToyHeads::new(8, 4, HeadsConditioning::LastToken, next))
    }

    fn propose(p: &mut HeadsProposer<ToyHeads>, req: &ProposeRequest<'_>) -> Draft {
        let mut d = Draft::default();
        p.propose(req, &mut d).unwrap();
        d
    }

    #[test]
    fn heads_get_the_hidden_state_last_token_and_position() {
        let cfg = SamplingConfig::greedy();
        let hidden = one_hot(5);
        let ctx = [4u32, 5, 2];
        let req = ProposeRequest {
            target_hidden: Some(&hidden),
            ..ProposeRequest::new(&ctx, &cfg, 3)
        };
        let mut p = heads();
        assert_eq!(propose(&mut p, &req).tokens, [7, 6, 3]);
        assert_eq!(p.heads().inputs, vec![(hidden.clone(), 2, 3)]);
        assert_eq!(p.name(), "heads");
        // Medusa-style heads that ignore the last token continue from the target's own guess
        // after 5 (0), not from the real last token: the case C13 fault.
        let mut m = HeadsProposer::new(ToyHeads::new(8, 4, HeadsConditioning::HiddenOnly, next));
        assert_eq!(propose(&mut m, &req).tokens, [1, 4, 5]);
    }

    #[test]
    fn no_hidden_state_or_empty_context_proposes_nothing() {
        let cfg = SamplingConfig::greedy();
        let hidden = one_hot(1);
        let mut p = heads();
        assert!(propose(&mut p, &ProposeRequest::new(&[1, 2], &cfg, 3)).is_empty());
        let req = ProposeRequest {
            target_hidden: Some(&hidden),
            ..ProposeRequest::new(&[], &cfg, 3)
        };
        assert!(propose(&mut p, &req).is_empty());
        assert!(p.heads().inputs.is_empty());
    }

    #[test]
    fn stale_state_unrelated_request_equals_a_fresh_proposer() {
        let hidden_a = one_hot(3);
        let hidden_b = one_hot(6);
        let (a, b) = ([1u32, 3, 2], [6u32, 0]);
        for cfg in [
            SamplingConfig::greedy(),
            SamplingConfig::builder().temperature(1.0).build().unwrap(),
        ] {
            let req_a = ProposeRequest {
                target_hidden: Some(&hidden_a),
                ..ProposeRequest::new(&a, &cfg, 3)
            };
            let req_b = ProposeRequest {
                target_hidden: Some(&hidden_b),
                ..ProposeRequest::new(&b, &cfg, 3)
            };
            let shrunk = ProposeRequest {
                target_hidden: Some(&hidden_a),
                ..ProposeRequest::new(&a[..2], &cfg, 3)
            };
            let mut p = heads();
            propose(&mut p, &req_a);
            let on_b = propose(&mut p, &req_b);
            assert_eq!(on_b, propose(&mut heads(), &req_b));
            let on_shrunk = propose(&mut p, &shrunk);
            assert_eq!(on_shrunk, propose(&mut heads(), &shrunk));
            if cfg.is_greedy() {
                assert_eq!(on_b.tokens, [1, 4, 5]);
                assert_eq!(on_shrunk.tokens, [2, 7, 6]);
            }
        }
    }

    #[test]
    fn draft_ends_at_eos_even_when_nothing_is_allowed_after_it() {
        // Chain from 2: 7, 6, 3, 2. EOS 6; a caller mask that allows nothing after an EOS.
        let mask = |prefix: &[u32], logits: &mut [f32]| {
            if prefix.last() == Some(&6) {
                logits.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            }
        };
        let hidden = one_hot(5);
        let ctx = [5u32, 2];
        for temperature in [0.0, 1.0] {
            let cfg = SamplingConfig::builder()
                .temperature(temperature)
                .mask(std::sync::Arc::new(mask))
                .build()
                .unwrap();
            let mut req = ProposeRequest {
                target_hidden: Some(&hidden),
                ..ProposeRequest::new(&ctx, &cfg, 4)
            };
            // Without the EOS in the request, the row after 6 has no allowed token.
            assert!(matches!(
                heads().propose(&req, &mut Draft::default()),
                Err(Error::NoAllowedToken { row: 2, .. })
            ));
            req.eos = &[6];
            let d = propose(&mut heads(), &req);
            assert_eq!(d.tokens, [7, 6]);
            if temperature > 0.0 {
                assert_eq!(d.q.as_ref().map(Vec::len), Some(2 * 8));
            }
        }
    }

    // ---- token trees (propose_tree) ----

    fn tree_req<'a>(
        ctx: &'a [u32],
        cfg: &'a SamplingConfig,
        hidden: &'a [f32],
        depth: usize,
        nodes: usize,
    ) -> ProposeRequest<'a> {
        ProposeRequest {
            target_hidden: Some(hidden),
            max_nodes: nodes,
            ..ProposeRequest::new(ctx, cfg, depth)
        }
    }

    fn propose_tree(p: &mut HeadsProposer<ToyHeads>, req: &ProposeRequest<'_>) -> Draft {
        let mut d = Draft::default();
        p.propose_tree(req, &mut d).unwrap();
        d
    }

    #[test]
    fn tree_top_k_is_validated() {
        for k in [0, 65] {
            assert!(matches!(
                heads().with_tree_top_k(k),
                Err(Error::InvalidConfig {
                    field: "tree_top_k",
                    ..
                })
            ));
        }
        assert_eq!(heads().tree_top_k(), 4);
        assert_eq!(heads().with_tree_top_k(2).unwrap().tree_top_k(), 2);
    }

    #[test]
    fn heads_tree_is_best_first_by_product_of_head_probabilities() {
        // Chain from 2: 7, 6, 3, 2 (each head's top candidate, probability ~1); every other
        // candidate has probability ~e^-10, ties broken by the lower id.
        let hidden = one_hot(5);
        let ctx = [4u32, 5, 2];
        for cfg in [
            SamplingConfig::greedy(),
            SamplingConfig::builder().temperature(1.0).build().unwrap(),
        ] {
            let mut p = heads().with_tree_top_k(2).unwrap();
            let d = propose_tree(&mut p, &tree_req(&ctx, &cfg, &hidden, 4, 7));
            // With `c` the top candidate's -log-probability, a path's score is `-depth * c -
            // 10 * (non-top candidates on it)`. The whole top-1 chain first, then the paths
            // with one non-top candidate, shortest first (ties to the earlier candidate): the
            // root's second (id 0), the second below node 0 (id 0), then head 1's top (6)
            // below the root's second, which beats the second below node 1 (depth 3).
            assert_eq!(d.tokens, [7, 6, 3, 2, 0, 0, 6]);
            assert_eq!(d.parents, [0, 1, 2, 3, 0, 1, 5]);
            assert!(d.q.is_none(), "heads trees are point masses");
            assert!(d.schemes.iter().all(|&s| s == SiblingScheme::Deterministic));
            let limits = crate::TreeLimits {
                max_nodes: 7,
                max_depth: 4,
                max_branch: 2,
                ..crate::TreeLimits::vocab(8)
            };
            assert_eq!(d.block().validate(&limits), Ok(()));
            // One heads call per tree.
            assert_eq!(p.heads().inputs.len(), 1);
        }
    }

    #[test]
    fn heads_tree_limits_depth_branching_and_eos() {
        let hidden = one_hot(5);
        let ctx = [4u32, 5, 2];
        let cfg = SamplingConfig::greedy();
        // Depth: at most the number of heads (4) and max_draft.
        let d = propose_tree(&mut heads(), &tree_req(&ctx, &cfg, &hidden, 2, 20));
        assert_eq!(d.block().max_depth(), 2);
        assert_eq!(
            d.len(),
            4 + 4 * 4,
            "top-4 of each of the 2 heads, every path"
        );
        let d = propose_tree(&mut heads(), &tree_req(&ctx, &cfg, &hidden, 9, 40));
        assert_eq!(d.block().max_depth(), 4);
        // Branching.
        let req = ProposeRequest {
            max_branch: 1,
            ..tree_req(&ctx, &cfg, &hidden, 4, 10)
        };
        let d = propose_tree(&mut heads(), &req);
        assert_eq!(d.tokens, [7, 6, 3, 2]);
        assert!(
            d.parents.is_empty(),
            "a one-child tree is returned as a chain"
        );
        // EOS 6: nothing below any node carrying it.
        let req = ProposeRequest {
            eos: &[6],
            ..tree_req(&ctx, &cfg, &hidden, 4, 30)
        };
        let d = propose_tree(&mut heads(), &req);
        assert!(d.len() > 4);
        for i in 0..d.len() {
            let r = d.block().parent_row(i);
            assert!(r == 0 || d.tokens[r - 1] != 6, "{d:?}");
        }
        // No budget beyond the depth: the chain.
        let req = tree_req(&ctx, &cfg, &hidden, 3, 3);
        assert_eq!(
            propose_tree(&mut heads(), &req),
            propose(&mut heads(), &req)
        );
        // No hidden state: nothing.
        let req = ProposeRequest {
            target_hidden: None,
            ..tree_req(&ctx, &cfg, &hidden, 3, 8)
        };
        assert!(propose_tree(&mut heads(), &req).is_empty());
    }
}
