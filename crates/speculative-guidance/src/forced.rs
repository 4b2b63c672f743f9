//! [`ForcedDrafts`]: the tokens a grammar forces as free drafts in front of another proposer's.

use std::sync::Arc;

use speculative::propose::VerifiedRows;
use speculative::{Draft, ProposeRequest, Proposer, Result, SiblingScheme};

use crate::GrammarMask;

/// Most allowed tokens at a point where [`ForcedDrafts::propose_tree`] branches over them.
pub const MAX_CHOICES: usize = 32;
/// Most siblings at such a point (and at most the request's `max_branch`).
pub const MAX_BRANCHES: usize = 4;

/// A proposer that drafts the tokens the grammar forces at the current context
/// ([`GrammarMask::forced_tokens`]: the keys, quotes and braces a JSON schema leaves no choice
/// about) and lets `inner` continue the draft after them.
///
/// - Chains ([`Proposer::propose`]): the forced tokens `f` (at most `max_draft`), then `inner`'s
///   chain for the context extended by `f` with `max_draft - |f|` tokens. When `inner` drafts
///   point masses, its chain is cut before its first token the grammar bans (that draft and
///   every row after it would be wasted), and forced tokens and `inner` chains then alternate
///   while the draft has room: the forced tokens after the kept inner tokens, `inner`'s chain
///   after those, and so on. The grammar checks reuse the allowed sets that the verifier's rows
///   at the same prefixes need (the mask's cache).
/// - Trees ([`Proposer::propose_tree`]): the forced tokens are the trunk (a chain from the
///   root), and `inner`'s tree for the extended context (depth `max_draft - |f|`, nodes
///   `max_nodes - |f|`) hangs from the last forced node. With no forced token this is `inner`'s
///   own tree. Where the grammar leaves only a few tokens after the trunk (at most
///   [`MAX_CHOICES`]: a boolean, an enum value), the tree branches over them instead (at most
///   [`MAX_BRANCHES`] siblings, the longest first), each sibling followed by the tokens the
///   grammar forces after it, so the choice and the structure after it fit in one step.
///
/// Forced tokens are point-mass drafts (when `inner` drafts with q, each forced node gets a
/// one-hot q row, which the verifier accepts with the same probability `p(x)` as a point mass).
/// Verification stays lossless whatever they are. Where the grammar allows exactly one token
/// the processed target puts all its mass on it, so the forced draft is always accepted; where
/// the forced text could be spelled with other tokens (llguidance forces the canonical
/// tokenization), the target decides like for any draft.
///
/// `inner` sees the context extended by the forced tokens; when they are not all accepted its
/// next context does not extend the one it saw, and the shipped proposers (prompt lookup,
/// suffix) rebuild their state then. `inner.observe` gets the emitted tokens after the leading
/// forced ones and its own accepted count (at most the length of its first draft of the step),
/// or zero and all emitted tokens when it was not asked (a choice tree) or the forced tokens
/// were not all accepted.
pub struct ForcedDrafts<P> {
    mask: Arc<GrammarMask>,
    inner: P,
    /// Forced tokens of the last proposal.
    forced: usize,
    /// Scratch: the extended context and the inner draft.
    ctx: Vec<u32>,
    inner_draft: Draft,
    /// Forced tokens proposed in all.
    proposed_forced: u64,
    /// Length of the context of the current step (to tell its first forced tokens).
    step_context: usize,
    /// Tokens of `inner`'s first draft of the step kept right after the leading forced tokens,
    /// or `None` when `inner` was not asked this step.
    inner_len: Option<usize>,
}

impl<P: std::fmt::Debug> std::fmt::Debug for ForcedDrafts<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForcedDrafts")
            .field("inner", &self.inner)
            .field("proposed_forced", &self.proposed_forced)
            .finish()
    }
}

impl<P: Proposer> ForcedDrafts<P> {
    /// Forced tokens of `mask` in front of `inner`'s drafts. `mask` must be the mask of the
    /// request being generated (the same one in its [`speculative::SamplingConfig`]).
    pub fn new(mask: Arc<GrammarMask>, inner: P) -> Self {
        ForcedDrafts {
            mask,
            inner,
            forced: 0,
            ctx: Vec::new(),
            inner_draft: Draft::default(),
            proposed_forced: 0,
            step_context: usize::MAX,
            inner_len: None,
        }
    }

    /// Replaces the grammar (for the next request; masks are per request).
    pub fn set_mask(&mut self, mask: Arc<GrammarMask>) {
        self.mask = mask;
    }

    /// The inner proposer.
    pub fn inner(&self) -> &P {
        &self.inner
    }

    /// The inner proposer, mutably.
    pub fn inner_mut(&mut self) -> &mut P {
        &mut self.inner
    }

    /// Number of forced tokens proposed since construction.
    pub fn proposed_forced(&self) -> u64 {
        self.proposed_forced
    }

    /// The forced tokens for `req` (cut to `limit` and at the first EOS). The first call of a
    /// step sets `self.forced` (the leading forced tokens).
    fn forced(&mut self, req: &ProposeRequest<'_>, limit: usize) -> Vec<u32> {
        let mut f = self.mask.forced_tokens(req.context);
        f.truncate(limit);
        f.truncate(req.draft_len_to_eos(&f));
        self.proposed_forced += f.len() as u64;
        if req.context.len() == self.step_context {
            self.forced = f.len();
        }
        f
    }

    /// How many leading `tokens` (at most `limit`) the grammar allows after `ctx`, pushing
    /// them onto `ctx`. The allowed sets are those the verifier's rows at the same prefixes
    /// need (cached in the mask), so the check costs no extra mask computation.
    fn valid_prefix(&self, ctx: &mut Vec<u32>, tokens: &[u32], limit: usize) -> usize {
        let mut n = 0;
        for &t in tokens.iter().take(limit) {
            if !self.mask.allows(ctx, t) {
                break;
            }
            ctx.push(t);
            n += 1;
        }
        n
    }

    /// Runs `inner` (chain or tree) after the forced tokens `f` into `self.inner_draft`.
    fn inner_after(&mut self, req: &ProposeRequest<'_>, f: &[u32], tree: bool) -> Result<()> {
        self.inner_draft.clear();
        if f.last().is_some_and(|&t| req.is_eos(t)) {
            return Ok(());
        }
        self.ctx.clear();
        self.ctx.extend_from_slice(req.context);
        self.ctx.extend_from_slice(f);
        let sub = req
            .context(&self.ctx)
            .max_draft(req.max_draft - f.len())
            .max_nodes(req.max_nodes.saturating_sub(f.len()))
            .target_hidden(if f.is_empty() {
                req.target_hidden
            } else {
                None
            })
            .target_hidden_rows(if f.is_empty() {
                req.target_hidden_rows
            } else {
                None
            })
            .suppress_rows(req.suppress_rows.saturating_sub(f.len()));
        if sub.max_draft == 0 || (tree && sub.max_nodes == 0) {
            return Ok(());
        }
        let r = if tree {
            self.inner.propose_tree(&sub, &mut self.inner_draft)
        } else {
            self.inner.propose(&sub, &mut self.inner_draft)
        };
        self.inner_len = Some(self.inner_draft.tokens.len());
        r
    }

    /// At a small choice point after the forced trunk `f` (2 to [`MAX_CHOICES`] allowed
    /// tokens: a boolean, an enum), `draft` = the trunk, then up to `min(max_branch, 4)` of the
    /// allowed tokens as siblings (the longest byte strings first), each followed by the tokens
    /// the grammar forces after it. Returns `false`, leaving `draft` alone, anywhere else.
    /// Siblings are point masses (deterministic candidates), so any choice of them is exact.
    fn choice_tree(&mut self, req: &ProposeRequest<'_>, f: &[u32], draft: &mut Draft) -> bool {
        let n = f.len();
        let depth_room = req.max_draft.saturating_sub(n);
        let node_room = req.max_nodes.saturating_sub(n);
        if depth_room == 0 || node_room < 2 || f.last().is_some_and(|&t| req.is_eos(t)) {
            return false;
        }
        let mut ctx = req.context.to_vec();
        ctx.extend_from_slice(f);
        let Some(allowed) = self.mask.allowed(&ctx) else {
            return false;
        };
        let branches = req
            .max_branch
            .min(MAX_BRANCHES)
            .min(node_room)
            .min(allowed.len());
        if allowed.len() < 2 || allowed.len() > MAX_CHOICES || branches < 2 {
            return false;
        }
        let vocab = self.mask.vocabulary();
        let mut cand = allowed;
        cand.sort_by_key(|&t| (std::cmp::Reverse(vocab.decode(&[t]).len()), t));
        cand.truncate(branches);
        draft.clear();
        draft.tokens.extend_from_slice(f);
        draft.parents.extend(0..n as u32);
        let mut nodes_left = node_room - branches;
        for &a in &cand {
            draft.tokens.push(a);
            draft.parents.push(n as u32);
            if req.is_eos(a) || depth_room < 2 || nodes_left == 0 {
                continue;
            }
            ctx.push(a);
            let mut cont = self.mask.forced_tokens(&ctx);
            ctx.pop();
            cont.truncate((depth_room - 1).min(nodes_left));
            cont.truncate(req.draft_len_to_eos(&cont));
            for &t in &cont {
                let parent = draft.tokens.len() as u32;
                draft.tokens.push(t);
                draft.parents.push(parent);
            }
            nodes_left -= cont.len();
            self.proposed_forced += cont.len() as u64;
        }
        true
    }

    /// `draft` = forced tokens then the inner draft (a tree hanging from the last forced node).
    fn assemble(&mut self, f: &[u32], draft: &mut Draft) {
        draft.clear();
        let inner = &self.inner_draft;
        if f.is_empty() {
            draft.clone_from(inner);
            return;
        }
        let n = f.len();
        draft.tokens.extend_from_slice(f);
        draft.tokens.extend_from_slice(&inner.tokens);
        let is_tree = !inner.parents.is_empty();
        if is_tree {
            draft.parents.extend(0..n as u32);
            // Inner row 0 (its root) is the last forced node, row n; node j's row j + 1 -> n + j + 1.
            draft
                .parents
                .extend(inner.parents.iter().map(|&r| r + n as u32));
        }
        if !inner.schemes.is_empty() {
            draft
                .schemes
                .extend(std::iter::repeat_n(SiblingScheme::Deterministic, n));
            draft.schemes.extend_from_slice(&inner.schemes);
        }
        if let Some(q) = &inner.q {
            let w = inner.q_vocab;
            if f.iter().all(|&t| (t as usize) < w) {
                let mut rows = vec![0.0f32; n * w];
                for (i, &t) in f.iter().enumerate() {
                    rows[i * w + t as usize] = 1.0;
                }
                rows.extend_from_slice(q);
                draft.q = Some(rows);
                draft.q_vocab = w;
            } else {
                // A forced id beyond the draft's q width: keep the forced tokens alone.
                draft.tokens.truncate(n);
                draft.parents.clear();
                draft.schemes.clear();
            }
        }
    }
}

impl<P: Proposer> Proposer for ForcedDrafts<P> {
    /// The inner proposer's: forced tokens come from the grammar mask over the context.
    fn drafts_from_tokens(&self) -> bool {
        self.inner.drafts_from_tokens()
    }

    /// The inner proposer's: forced tokens are always accepted, so a draft that the inner
    /// proposer cuts by cost is cut where it would be without them.
    fn sizes_own_drafts(&self, config: &speculative::SamplingConfig) -> bool {
        self.inner.sizes_own_drafts(config)
    }

    /// The inner proposer's.
    fn learned(&self) -> Option<speculative::propose::Learned> {
        self.inner.learned()
    }

    /// Forwarded to the inner proposer.
    fn start_from_learned(&mut self, costs: &speculative::propose::Learned) -> Result<()> {
        self.inner.start_from_learned(costs)
    }

    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.step_context = req.context.len();
        self.inner_len = None;
        let f = self.forced(req, req.max_draft);
        self.inner_after(req, &f, false)?;
        // A chain from `inner` has no parents; if it returned a tree anyway, keep the trunk.
        if !self.inner_draft.parents.is_empty() && !f.is_empty() {
            self.inner_draft.clear();
            self.inner_len = Some(0);
        }
        if self.inner_draft.q.is_some() || !self.inner_draft.parents.is_empty() {
            self.assemble(&f, draft);
            return Ok(());
        }
        // Point masses: keep the inner draft up to its first token the grammar bans, then
        // alternate forced tokens and inner drafts until the draft is full or neither adds.
        draft.clear();
        draft.tokens.extend_from_slice(&f);
        let mut ctx: Vec<u32> = req.context.to_vec();
        ctx.extend_from_slice(&f);
        let mut inner = std::mem::take(&mut self.inner_draft.tokens);
        loop {
            let valid = self.valid_prefix(&mut ctx, &inner, req.max_draft - draft.tokens.len());
            if draft.tokens.len() == f.len() {
                self.inner_len = Some(valid);
            }
            draft.tokens.extend_from_slice(&inner[..valid]);
            let room = req.max_draft - draft.tokens.len();
            if valid == 0 || room == 0 || inner[..valid].iter().any(|&t| req.is_eos(t)) {
                break;
            }
            let sub = req.context(&ctx);
            let f = self.forced(&sub, room);
            if f.is_empty() {
                break;
            }
            draft.tokens.extend_from_slice(&f);
            ctx.extend_from_slice(&f);
            let room = req.max_draft - draft.tokens.len();
            if room == 0 || f.last().is_some_and(|&t| req.is_eos(t)) {
                break;
            }
            let sub = req
                .context(&ctx)
                .max_draft(room)
                .max_nodes(room)
                .target_hidden(None)
                .target_hidden_rows(None)
                .suppress_rows(req.suppress_rows.saturating_sub(draft.tokens.len()));
            self.inner_draft.clear();
            self.inner.propose(&sub, &mut self.inner_draft)?;
            if self.inner_draft.q.is_some() {
                break;
            }
            inner = std::mem::take(&mut self.inner_draft.tokens);
        }
        self.inner_draft.clear();
        Ok(())
    }

    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.step_context = req.context.len();
        self.inner_len = None;
        let f = self.forced(req, req.max_draft.min(req.max_nodes));
        if self.choice_tree(req, &f, draft) {
            return Ok(());
        }
        self.inner_after(req, &f, true)?;
        self.assemble(&f, draft);
        Ok(())
    }

    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        let n = self.forced;
        self.forced = 0;
        // `inner` counts only its own draft: the accepted tokens after the leading forced ones,
        // at most the length of its draft; nothing when it was not asked or not reached.
        match self.inner_len.take() {
            Some(len) if accepted >= n && emitted.len() >= n => {
                self.inner.observe((accepted - n).min(len), &emitted[n..])
            }
            _ => self.inner.observe(0, emitted),
        }
    }

    fn row_candidates(&self) -> usize {
        self.inner.row_candidates()
    }

    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        self.inner.observe_rows(rows)
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.forced = 0;
        self.inner.begin(prompt)
    }

    fn begin_reusing(&mut self, prompt: &[u32]) -> Result<()> {
        self.forced = 0;
        self.inner.begin_reusing(prompt)
    }

    fn finish(&mut self, sequence: &[u32]) {
        self.inner.finish(sequence)
    }

    fn name(&self) -> &'static str {
        "grammar-forced"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Vocabulary;
    use speculative::SamplingConfig;

    /// Tokens `a`, `b`, `c`, `{`, `}`, `<eos>`; grammar `{(ab|c)+}`.
    fn mask(prompt_len: usize) -> Arc<GrammarMask> {
        let toks = ["a", "b", "c", "{", "}", "<eos>"];
        let bytes = toks.iter().map(|t| t.as_bytes().to_vec()).collect();
        let special = (0..6).map(|i| i == 5).collect();
        let v = Vocabulary::greedy(bytes, special, 5).unwrap();
        Arc::new(GrammarMask::regex(&v, r"\{(ab|c)+\}", prompt_len).unwrap())
    }

    /// Proposes a fixed draft (chain or tree) whatever the context.
    struct Fixed(Draft);
    impl Proposer for Fixed {
        fn propose(&mut self, req: &ProposeRequest<'_>, d: &mut Draft) -> Result<()> {
            d.clone_from(&self.0);
            d.parents.clear();
            d.tokens.truncate(req.max_draft);
            Ok(())
        }
        fn propose_tree(&mut self, _req: &ProposeRequest<'_>, d: &mut Draft) -> Result<()> {
            d.clone_from(&self.0);
            Ok(())
        }
    }

    #[test]
    fn chains_put_forced_tokens_first_and_cut_banned_inner_tokens() {
        let cfg = SamplingConfig::greedy();
        let ctx = [9u32; 0];
        let m = mask(0);
        // At the start `{` is forced; the inner `c a b a` is valid up to `c a b`, then `a`
        // after `ab` is fine too, so all is kept: `{ c a b a`, then forced `b`.
        let inner = Draft::chain(vec![2, 0, 1, 0]);
        let mut p = ForcedDrafts::new(m.clone(), Fixed(inner));
        let mut d = Draft::default();
        p.propose(&ProposeRequest::new(&ctx, &cfg, 8), &mut d)
            .unwrap();
        assert_eq!(d.tokens[..5], [3, 2, 0, 1, 0]);
        assert_eq!(d.tokens[5], 1, "the forced `b` after the inner draft");
        // An inner draft starting with a banned token adds nothing.
        let inner = Draft::chain(vec![4, 4]);
        let mut p = ForcedDrafts::new(m, Fixed(inner));
        p.propose(&ProposeRequest::new(&ctx, &cfg, 8), &mut d)
            .unwrap();
        assert_eq!(d.tokens, vec![3]);
        assert!(d.parents.is_empty());
    }

    #[test]
    fn a_merge_inside_still_sizes_its_own_drafts() {
        // The adaptive loop asks a cost-aware merge for its longest draft
        // (`Proposer::sizes_own_drafts`); forced tokens in front must not hide that.
        let merge =
            speculative::propose::MergedProposer::new(vec![Box::new(Fixed(Draft::default()))])
                .unwrap();
        let greedy = SamplingConfig::greedy();
        assert!(ForcedDrafts::new(mask(0), merge).sizes_own_drafts(&greedy));
        let fixed = ForcedDrafts::new(mask(0), Fixed(Draft::default()));
        assert!(!fixed.sizes_own_drafts(&greedy));
    }

    #[test]
    fn trees_hang_from_the_forced_trunk() {
        let cfg = SamplingConfig::greedy();
        let ctx: [u32; 0] = [];
        // Inner tree: two children of the root (`c`, `a`), `b` under `a`.
        let inner = Draft::tree(vec![2, 0, 1], vec![0, 0, 2]);
        let mut p = ForcedDrafts::new(mask(0), Fixed(inner));
        let mut d = Draft::default();
        let mut req = ProposeRequest::new(&ctx, &cfg, 4);
        req.max_nodes = 8;
        // At the choice point after `{` (`a` or `c`) the tree branches over the choices, each
        // followed by its forced tokens: `{` -> `a` -> `b`, `{` -> `c`.
        p.propose_tree(&req, &mut d).unwrap();
        assert_eq!(d.tokens, vec![3, 0, 1, 2]);
        assert_eq!(d.parents, vec![0, 1, 2, 1]);
        // With one child per node there is no branching: the inner tree hangs from the trunk.
        req.max_branch = 1;
        p.propose_tree(&req, &mut d).unwrap();
        assert_eq!(d.tokens, vec![3, 2, 0, 1]);
        // The forced `{` is node 0 (row 1); the inner root's children hang from row 1.
        assert_eq!(d.parents, vec![0, 1, 1, 3]);
        let limits = speculative::tree::TreeLimits::vocab(6)
            .with_max_nodes(8)
            .with_max_depth(8)
            .with_max_branch(8);
        d.block().validate(&limits).unwrap();
        // Observe: the forced token and one inner token accepted.
        p.observe(2, &[3, 2, 4]).unwrap();
    }
}
