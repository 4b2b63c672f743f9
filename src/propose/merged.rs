//! [`MergedProposer`]: the drafts of several proposers merged into one prefix tree per step,
//! ranked by acceptance rates learned online.
//!
//! n-gram and suffix proposers win where text repeats, model-based drafts elsewhere, and an
//! oracle that picks the best proposer per step beats every single one ("Performance or
//! Illusion?", MLSys 2026). With token trees no choice is needed: the candidates of every
//! proposer share one verify forward as branches of one tree (SpecInfer, Miao et al., ASPLOS
//! 2024, section 3: a token tree merged from the candidates of several small speculative
//! models). The node budget is spent where acceptance is likely: each node is scored by its
//! estimated reach probability, the product of conditional acceptance rates along its path
//! (the expansion rule of EAGLE-2, Li et al. 2024, and the acceptance-vector model of Sequoia,
//! Chen et al. 2024), with the rates learned per proposer and depth from what the target
//! emitted. The merge is cost-aware by default ([`super::MergePolicy::CostAware`]): a member
//! that does not pay for its time on the request is not asked, and a node is kept only while
//! its reach pays for the verify row it costs (see "Cost-aware merging" on [`MergedProposer`]).

use std::time::Instant;

use super::learned::{Kind, Learned};
use super::merge_costs::{
    Decision, Ledger, MeasuredMergeCosts, MergeCosts, MergePolicy, PROBE_DRAFT, StepTime, bucket,
};
use super::merge_shadow::Shadows;
use super::merge_trie::{NONE, Trie};
use super::{Draft, ProposeRequest, Proposer, VerifiedRows};
use crate::error::{Error, ProposalFault, Result};
use crate::sampling::SamplingConfig;
use crate::tree::TreeFault;
use crate::verify::RowCandidates;

/// Most proposers one [`MergedProposer`] holds (each node remembers its proposers in a 64-bit
/// set).
pub const MAX_MERGED_PROPOSERS: usize = 64;

/// Default of [`MergedProposer::with_decay`]: the adaptive draft-length policy's decay
/// ([`crate::decode::AdaptiveConfig::decay`]).
pub const DEFAULT_MERGE_DECAY: f64 = 0.98;

/// Decayed counts of one (proposer, depth): tested candidates and accepted ones.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    accepted: f64,
    tested: f64,
}

impl Counts {
    /// Posterior mean of the acceptance rate under a Beta(1, 1) prior.
    fn rate(&self) -> f64 {
        (self.accepted + 1.0) / (self.tested + 2.0)
    }

    /// The posterior mean plus half the posterior standard deviation (at most 1): the value a
    /// cost-aware merge plans with, so that a depth seen on few steps is drafted again (the
    /// optimism of the decode policy's tree plan, [`crate::decode::AdaptiveConfig`]).
    fn optimistic(&self) -> f64 {
        let m = self.rate();
        (m + 0.5 * (m * (1.0 - m) / (self.tested + 3.0)).sqrt()).min(1.0)
    }
}

/// Merges the drafts of several proposers into one prefix tree per step and keeps the nodes
/// most likely to be accepted under the node budget.
///
/// # The rule
///
/// At each step every proposer is asked for its draft with the same request
/// ([`Proposer::propose_tree`] for a tree step, [`Proposer::propose`] for a chain step), in the
/// order given to [`MergedProposer::new`] (under [`MergePolicy::CostAware`], the default, only
/// the proposers that pay, cheapest first, and the selection is cut by cost: see "Cost-aware
/// merging" below; [`MergePolicy::Reach`] is this rule exactly). Then:
///
/// 1. **Merge.** All candidates go into one prefix trie: identical paths (the same tokens from
///    the root) are one node, which remembers every proposer that proposed it. Nodes deeper
///    than `req.max_draft` are left out (with their subtrees); draft probabilities q and
///    sibling schemes of the proposers are dropped.
/// 2. **Score.** Proposer `s` at depth `d` has the estimated conditional acceptance rate
///    `r(s, d) = (a + 1) / (t + 2)` (the posterior mean under a Beta(1, 1) prior) from its
///    decayed counts `a` of accepted and `t` of tested candidates at that depth (0.5 before
///    any observation). A node's conditional rate is the largest `r(s, d)` over the proposers
///    that proposed it, and its score is the product of the conditional rates along its path:
///    its estimated probability to be reached by the accepted path.
/// 3. **Select** (tree steps). The nodes by decreasing score, ties to the earlier node (the
///    earlier proposer, then the proposer's own order), are kept until `req.max_nodes` nodes,
///    skipping a node whose parent was not kept or already has `req.max_branch` kept
///    children. Rates are below 1, so a node scores below its parent and the kept set is
///    ancestor-closed: the top `max_nodes` nodes that fit the branching limit.
/// 4. **Order.** The kept nodes are written in a topological order in which every sibling
///    group is best first: repeatedly the earliest node whose parent and better siblings are
///    already written. With one proposer all siblings tie, so a draft that fits the budget
///    comes out exactly as that proposer wrote it. A tree that is a single path is returned in
///    the chain form (empty [`Draft::parents`]).
///
/// **Chain steps** ([`Proposer::propose`]) merge the proposers' chains the same way and return
/// the path with the largest expected accepted length (the sum of the scores of its nodes; ties
/// to the earlier proposer), at most `req.max_draft` tokens. With one proposer that is its own
/// chain.
///
/// # Cost-aware merging ([`MergePolicy::CostAware`], the default)
///
/// A draft head costs a forward of the head per drafted token, prompt lookup and suffix next to
/// nothing, and every node costs a verify row. The merge learns, online and with the decay of
/// the rates:
///
/// - **each member's time per call** `t(s)` and **the rest of a step** by verify rows, `T(rows)`
///   (the target's forward and the loop, from the end of one proposal to the start of the
///   next; a step without a proposal, from one [`Proposer::observe`] to the next, as one row;
///   never a step whose forward also feeds prompt tokens, [`ProposeRequest::fused_prompt`],
///   nor a request's first step without a proposal: per row count the median of its last 7
///   times, so that a slow outlier on a shared machine does not count; at a row count seen its
///   median, where above the least-squares line through all the medians shrunk toward it by
///   the count's samples aged 0.98 per step, so that a count measured once in a slow moment,
///   and then no longer chosen, drifts toward the line (not below it: where the line itself
///   runs through such counts, they stay dear); between two seen, the straight line between them;
///   beyond them, the line (slope at least 0). Read nearly as measured where measured often and
///   lately: a line alone underprices the short drafts of an engine whose verify cost is
///   curved, as llama.cpp's on a CPU, `T(2) = 2.1 T(1)`, `T(5) = 3.9 T(1)`, and a row count
///   that costs less than fewer rows, as 4 rows against 3 in tiled kernels, stays cheap), from
///   the clock through the cost source ([`MergedProposer::with_costs`]: [`MeasuredMergeCosts`],
///   the default, or [`super::FixedMergeCosts`], with which every choice depends only on the
///   emitted tokens: deterministic);
/// - **each member's marginal accepted tokens** `g(s, b)`: at every step it drafts, the leading
///   nodes of the accepted path it proposed, less the most any member asked before it at that
///   step proposed (known exactly for every candidate, kept or not, as the rates are; chain
///   steps: the accepted length of the chain chosen with it less that of the chain chosen
///   without it), **net of the verify rows it added**, charged as the tokens they cost at the
///   step's rate, `(1 + E) * (T(rows with) - T(rows without)) / (T + spent)`. Learned
///   per bucket `b` of the expected accepted length `E` of the candidates gathered before it
///   (none; `E` in `(0, 0.5]`, `(0.5, 1]`, `(1, 2]`, above 2: a draft head adds much when the
///   copy proposers have nothing, little when they hold a long likely copy), as a decayed mean
///   with one pseudo-step at the member's mean over all buckets (itself with one pseudo-step at
///   one token).
///
/// At each step the members are considered cheapest first (`t(s)`, ties to the earlier
/// member). Member `s` is asked when `g(s, b) / (1 + E) >= t(s) / (T(rows) + spent)`, with
/// `rows` the verify rows of the draft without it (the chain the merge would write from the
/// members asked before it plus one; tree steps: their nodes, at most the budget, plus one)
/// and `spent` the time of the members asked before it: with `g` net of its rows, the
/// condition for asking it to raise the expected tokens per second,
/// `(1 + E + g) / (T + t) >= (1 + E) / T`, its rows included in `T`; a member whose call costs at most 1 % of the
/// step is always asked (prompt lookup, suffix: skipping them saves nothing, and their nodes
/// are cut one by one). A costly member that pays is asked only for the depth its own nodes can
/// pay for: the deepest whose reach on its own path `p` (its planning rates multiplied) still
/// meets `p (T + spent) >= (1 + E) (row + token)`, with `row` the learned time of one more
/// verify row and `token` its learned time per drafted token (a draft head is then not run
/// for positions the cost cut would drop anyway). A member that does not pay gets no nodes and is not called; after 8
/// skipped steps in a bucket it is asked once anyway for a probe of at most 2 tokens (nodes),
/// the interval doubling after each probe up to 64 and reset when it pays, but only once the
/// steps since its last call took at least 50 times its learned time per call (or its last
/// call's, if more), so that probes
/// cost at most 2 % of the decoding time (a draft model's probe after skipped steps pays its
/// catch-up with every token since: several target steps). Every member is
/// asked while no step was timed yet (the first step). Then the nodes are ranked as in "The
/// rule" (each rate planned with its posterior mean plus half its posterior standard
/// deviation, `sqrt(r (1 - r) / (t + 3))`, at most 1: a depth tested on few steps, as the deep
/// positions of a copy are, is drafted again rather than cut for good), and only the leading
/// ones that maximise the step's expected tokens per second of the time still to spend,
/// `(1 + sum of their reach) / T(n + 1)`, are kept (for a chain step: the path and length that
/// maximise it; the empty draft when no node pays: `1 / T(1)`). The members' time of the step
/// is left out of that ratio: it is spent whatever is kept, and counting it in both sides made
/// a dear member's own short drafts look paying (`(1 + r) / (T(2) + spent) > 1 / (T(1) +
/// spent)` for any `r` once `spent` is large: a SmolLM2 draft for Gemma 3 270M, whose
/// sampled one- and two-token drafts each cost more verify time than they saved, issue 31).
/// While the step time was seen at one row count only, `T` is flat and no node is cut by cost.
/// Every member is still told every step ([`Proposer::observe`], with 0 accepted when it was
/// not asked), so its state follows the context. Costs: `O(P log P)` per step more for `P`
/// members.
///
/// # Losslessness: the merged draft is a point mass
///
/// The merged draft carries no q ([`Draft::q`] is `None`) and the default sibling scheme,
/// [`crate::SiblingScheme::Deterministic`]: every node is a point mass, for which the verifier
/// is exact whatever candidates are chosen and however they are ranked (see [`crate::verify`],
/// "Trees"). A proposer's q (a [`super::DraftModelProposer`]'s, for example) is **not used**
/// when it is merged: its tokens count as point-mass candidates, so under stochastic
/// verification its nodes are accepted with the target's probability of the token rather than
/// `min(1, p / q)`. The rates are learned only from tokens already emitted, so a draft never
/// depends on the verifier's draws at its own positions.
///
/// # Learning
///
/// [`Proposer::observe`] matches `emitted` against the trie of **all** candidates of the step
/// (kept in the draft or not): the accepted path is the sequence of nodes whose tokens are the
/// leading emitted tokens. A candidate was *tested* when its parent is on that path (or it is a
/// child of the root) and its depth `d` is at most `emitted.len()`; it was *accepted* when it
/// is on the path. With point-mass drafts the emitted token at each position is the target's
/// own draw (greedy: the argmax; sampling: the seeded draw, case C15), so whether a candidate
/// left out of the draft would have been accepted is known exactly, and every proposer learns
/// at every step, whatever the selection kept. Each tested candidate adds 1 to `t` of every
/// proposer that proposed it at its depth, each accepted one also 1 to `a`; before a step's
/// counts are added, the counts of each (proposer, depth) that has some are multiplied by the
/// decay ([`MergedProposer::with_decay`], default 0.98, as the adaptive draft-length policy).
/// The rates carry over from one generation to the next, and to a new merge through
/// [`Proposer::learned`] and [`Proposer::start_from_learned`].
///
/// Under [`MergePolicy::CostAware`] a step's candidates deeper than its emitted tokens (cut by
/// cost, or past the accepted path's end) are also tested by the tokens the next steps emit
/// (the step's *shadow*): where a verify row is dear and nothing deep is drafted, the deep
/// rates are still learned, so that the merge drafts again where a member turns right.
///
/// # Feedback to the proposers
///
/// [`Proposer::begin`] and [`Proposer::finish`] are forwarded to every proposer.
/// [`Proposer::observe`] tells each proposer its own accepted count: the length of the longest
/// leading run of `emitted` that is a path of its own draft of the step (a chain: the leading
/// tokens of its chain that match), at most the merged step's `accepted` (tokens past the
/// accepted path were not verified as drafts), with the same `emitted`; without a pending step
/// (observe without a proposal) the count is 0. [`Proposer::row_candidates`] is the largest of
/// the proposers', and [`Proposer::observe_rows`] is forwarded to every proposer that asks for
/// rows, each seeing at most the number of ids per row it asked for; the rows' inputs, parents
/// and path are those of the merged draft (Token Recycling, for one, reads only the inputs and
/// their candidates).
///
/// # Errors
///
/// An error of a proposer (in any of the forwarded calls) is returned as it is, and the step's
/// later proposers are not asked; a proposer's malformed tree (`parents` of the wrong length,
/// or a parent after its node) is [`Error::InvalidProposal`] naming that proposer.
///
/// # Complexity
///
/// A step costs the proposers' own calls plus, for `M` candidate nodes in all, `O(M)` hash
/// operations to merge, `O(M * P)` for the rates of `P` proposers and `O(M log M)` to rank and
/// order; memory `O(M)` scratch plus 16 bytes per (proposer, depth) of the rates.
///
/// `MergedProposer` is `Send` (its proposers are).
///
/// # Example
///
/// ```
/// use speculative::propose::{
///     Draft, MergedProposer, PromptLookup, ProposeRequest, Proposer, SuffixConfig, SuffixProposer,
/// };
/// use speculative::SamplingConfig;
///
/// let mut merged = MergedProposer::new(vec![
///     Box::new(PromptLookup::new(1, 3)?),
///     Box::new(SuffixProposer::new(SuffixConfig::default())?),
/// ])?;
/// let config = SamplingConfig::greedy();
/// let context = [5, 6, 7, 8, 9, 5, 6, 7, 3, 4, 5, 6];
/// let mut req = ProposeRequest::new(&context, &config, 3);
/// req.max_nodes = 6;
/// let mut draft = Draft::default();
/// merged.propose_tree(&req, &mut draft)?;
/// assert!(draft.len() <= 6 && draft.q.is_none());
/// assert_eq!(draft.tokens[0], 7); // what followed [5, 6] both times before
/// // ... the target verifies the tree and emits [7, 3, 1]; every proposer learns from it.
/// merged.observe(2, &[7, 3, 1])?;
/// assert!(merged.rate(0, 1) > 0.5);
/// # Ok::<(), speculative::Error>(())
/// ```
pub struct MergedProposer {
    subs: Vec<Box<dyn Proposer + Send>>,
    decay: f64,
    policy: MergePolicy,
    costs: Box<dyn MergeCosts>,
    /// What the cost-aware rule learned of each member's gain and cost.
    ledger: Ledger,
    /// The members in the order they are considered at the pending step (cheapest first).
    order: Vec<usize>,
    /// The bucket each member was asked in at the pending step (`None`: not asked).
    asked: Vec<Option<usize>>,
    /// What the decision to ask each member weighed (the pending step): the expected tokens
    /// per step without it, `1 + E`, and the step's seconds without it, `T(rows) + spent`.
    asked_at: Vec<(f64, f64)>,
    /// Seconds the members' calls of the pending step took (as the cost source records them).
    spent: f64,
    /// End of the last proposal and its verify rows, to time the rest of the step.
    last_end: Option<(Instant, usize)>,
    /// End of the last [`Proposer::observe`] of this request, to time a plain step (one
    /// without a proposal) as a step of one verify row.
    last_observe: Option<Instant>,
    /// Trie ids of the accepted path's nodes (scratch of the learning).
    path: Vec<u32>,
    /// Chain steps: the end node of the chain the merge would write after each asked member
    /// (with the members asked before it), to learn each member's gain on the chosen chain.
    chain_ends: Vec<u32>,
    /// Whether the pending step is a tree step.
    tree_step: bool,
    /// `stats[s][d - 1]`: decayed counts of proposer `s` at depth `d`.
    stats: Vec<Vec<Counts>>,
    /// Each proposer's draft of the pending step.
    sub_drafts: Vec<Draft>,
    trie: Trie,
    /// Draft node -> trie node, one proposer's draft at a time.
    map: Vec<u32>,
    /// A proposal is waiting for its [`Proposer::observe`].
    pending: bool,
    /// Per-proposer counts of one depth of one step.
    step: Vec<Counts>,
    /// Rows cut to one proposer's [`Proposer::row_candidates`].
    rows: RowCandidates,
    /// Candidates of earlier steps scored against later tokens (cost-aware rule only).
    shadows: Shadows,
}

impl std::fmt::Debug for MergedProposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MergedProposer")
            .field(
                "proposers",
                &self.subs.iter().map(|s| s.name()).collect::<Vec<_>>(),
            )
            .field("decay", &self.decay)
            .field("policy", &self.policy)
            .finish()
    }
}

impl MergedProposer {
    /// Merges `proposers` (1 to [`MAX_MERGED_PROPOSERS`]), in this order (it breaks ties), with
    /// the decay [`DEFAULT_MERGE_DECAY`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `proposers` when the set is empty or holds more than 64.
    pub fn new(proposers: Vec<Box<dyn Proposer + Send>>) -> Result<Self> {
        if proposers.is_empty() {
            return Err(Error::config(
                "proposers",
                0,
                "a merge needs at least one proposer",
            ));
        }
        if proposers.len() > MAX_MERGED_PROPOSERS {
            return Err(Error::config(
                "proposers",
                proposers.len(),
                "at most 64 proposers (MAX_MERGED_PROPOSERS)",
            ));
        }
        let n = proposers.len();
        Ok(MergedProposer {
            subs: proposers,
            decay: DEFAULT_MERGE_DECAY,
            policy: MergePolicy::default(),
            costs: Box::new(MeasuredMergeCosts),
            ledger: Ledger::new(n),
            order: (0..n).collect(),
            asked: vec![None; n],
            asked_at: vec![(1.0, 0.0); n],
            spent: 0.0,
            last_end: None,
            last_observe: None,
            path: Vec::new(),
            chain_ends: vec![NONE; n],
            tree_step: false,
            stats: vec![Vec::new(); n],
            sub_drafts: vec![Draft::default(); n],
            trie: Trie::default(),
            map: Vec::new(),
            pending: false,
            step: vec![Counts::default(); n],
            rows: RowCandidates::default(),
            shadows: Shadows::default(),
        })
    }

    /// Sets the decay of the acceptance counts per step, in `(0, 1]` (1 = no forgetting; see
    /// "Learning" on [`MergedProposer`]).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `decay` outside `(0, 1]` (NaN included).
    pub fn with_decay(mut self, decay: f64) -> Result<Self> {
        if !(decay > 0.0 && decay <= 1.0) {
            return Err(Error::config("decay", decay, "must be in (0, 1]"));
        }
        self.decay = decay;
        Ok(self)
    }

    /// Sets the rule that chooses the members asked and the nodes kept ([`MergePolicy`];
    /// default [`MergePolicy::CostAware`]; [`MergePolicy::Reach`] is the rule before it).
    pub fn with_policy(mut self, policy: MergePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The rule that chooses the members asked and the nodes kept. `O(1)`.
    pub fn policy(&self) -> MergePolicy {
        self.policy
    }

    /// Sets where the cost-aware rule learns its costs from ([`MeasuredMergeCosts`], the
    /// default, or [`super::FixedMergeCosts`] for reproducible choices); forgets the costs
    /// learned so far.
    pub fn with_costs(mut self, costs: impl MergeCosts + 'static) -> Self {
        self.costs = Box::new(costs);
        self.ledger.clear();
        self.last_end = None;
        self
    }

    /// Whether proposer `i` was asked for a draft at the last proposal (every proposer under
    /// [`MergePolicy::Reach`]; `false` for an unknown proposer). `O(1)`.
    pub fn was_asked(&self, proposer: usize) -> bool {
        self.asked.get(proposer).is_some_and(Option::is_some)
    }

    /// Proposer `i`'s learned marginal accepted tokens per step over the proposers asked
    /// before it, when the candidates gathered before it had an expected accepted length `e`
    /// (`None`: no candidate; see "Cost-aware merging" on [`MergedProposer`]); 1 before any
    /// observation (and for an unknown proposer). `O(1)`.
    pub fn marginal_gain(&self, proposer: usize, expected_before: Option<f64>) -> f64 {
        if proposer >= self.subs.len() {
            return 1.0;
        }
        self.ledger.gain(proposer, bucket(expected_before))
    }

    /// The decay of the acceptance counts per step. `O(1)`.
    pub fn decay(&self) -> f64 {
        self.decay
    }

    /// Number of merged proposers. `O(1)`.
    pub fn len(&self) -> usize {
        self.subs.len()
    }

    /// Always `false`: a merge holds at least one proposer. `O(1)`.
    pub fn is_empty(&self) -> bool {
        self.subs.is_empty()
    }

    /// Proposer `i` (in the order given to [`MergedProposer::new`]), if any. `O(1)`.
    pub fn proposer(&self, i: usize) -> Option<&(dyn Proposer + Send)> {
        self.subs.get(i).map(|b| &**b)
    }

    /// The estimated conditional acceptance rate of proposer `i` at depth `depth` (1 for a
    /// child of the root): `(a + 1) / (t + 2)` from its decayed counts, 0.5 before any
    /// observation (and for depth 0 or an unknown proposer). `O(1)`.
    pub fn rate(&self, proposer: usize, depth: usize) -> f64 {
        self.counts(proposer, depth).rate()
    }

    /// Forgets every learned rate (back to the prior), and the cost-aware rule's gains and
    /// costs. `O(proposers * depths)`.
    pub fn reset_rates(&mut self) {
        for s in &mut self.stats {
            s.clear();
        }
        self.shadows.clear();
        self.ledger.clear();
        self.last_end = None;
    }

    fn counts(&self, proposer: usize, depth: usize) -> Counts {
        depth
            .checked_sub(1)
            .and_then(|d| self.stats.get(proposer)?.get(d).copied())
            .unwrap_or_default()
    }

    /// The conditional rate of a node proposed by the set `proposers` at `depth` (under
    /// [`MergePolicy::CostAware`] the optimistic one, see "Cost-aware merging").
    fn node_rate(&self, mut proposers: u64, depth: u32) -> f64 {
        let mut best = 0.0f64;
        while proposers != 0 {
            let s = proposers.trailing_zeros() as usize;
            proposers &= proposers - 1;
            let c = self.counts(s, depth as usize);
            let r = if self.policy == MergePolicy::Reach {
                c.rate()
            } else {
                c.optimistic()
            };
            best = best.max(r);
        }
        best
    }

    /// Asks the proposers for their drafts (`tree`: `propose_tree`; under
    /// [`MergePolicy::CostAware`] only those that pay, see "Cost-aware merging") and merges the
    /// drafts into the trie, scored.
    fn gather(&mut self, req: &ProposeRequest<'_>, tree: bool) -> Result<()> {
        self.pending = false;
        self.trie.clear();
        self.spent = 0.0;
        self.asked.fill(None);
        self.tree_step = tree;
        if self.policy == MergePolicy::Reach {
            for s in 0..self.subs.len() {
                self.ask(s, 0, req, tree)?;
            }
            self.rescore();
        } else {
            self.time_step();
            self.gather_costed(req, tree)?;
        }
        self.pending = true;
        Ok(())
    }

    /// The cost-aware gathering: the members cheapest first (learned seconds per call, ties to
    /// the earlier member), each asked when its learned gain in the bucket of the candidates
    /// gathered so far pays for its time (or as a probe).
    fn gather_costed(&mut self, req: &ProposeRequest<'_>, tree: bool) -> Result<()> {
        let ledger = &self.ledger;
        self.order.sort_by(|&a, &b| {
            ledger
                .member_secs(a)
                .total_cmp(&ledger.member_secs(b))
                .then(a.cmp(&b))
        });
        // Verify rows of the draft without the member considered: the chain the merge would
        // write from the members asked so far (tree steps: their nodes, at most the budget).
        let mut rows = 1usize;
        let mut expected: Option<f64> = None;
        for i in 0..self.order.len() {
            let s = self.order[i];
            let b = bucket(expected);
            let tokens = 1.0 + expected.unwrap_or(0.0);
            let base = self.ledger.step_secs(rows);
            self.asked_at[s] = (tokens, base.unwrap_or(0.0) + self.spent);
            let decision = match base {
                None => Decision::Pays,
                Some(t) => self.ledger.decide(s, b, tokens, t + self.spent),
            };
            match decision {
                Decision::Skip => {
                    self.sub_drafts[s].clear();
                    continue;
                }
                Decision::Pays => match base {
                    Some(t) if !self.ledger.is_free(s, t + self.spent) => {
                        let depth =
                            self.paying_depth(s, req.max_draft, tokens, t + self.spent, rows);
                        self.ask(s, b, &req.max_draft(depth), tree)?
                    }
                    _ => self.ask(s, b, req, tree)?,
                },
                Decision::Probe => {
                    let short = req
                        .max_draft(req.max_draft.min(PROBE_DRAFT))
                        .max_nodes(req.max_nodes.min(PROBE_DRAFT));
                    self.ask(s, b, &short, tree)?;
                }
            }
            expected = self.rescore();
            if !tree {
                let time = Self::step_time(self.policy, &self.ledger);
                let secs = time.map(|t| move |rows: usize| t.secs(rows));
                let secs = secs.as_ref().map(|f| f as &dyn Fn(usize) -> f64);
                self.chain_ends[s] = self.trie.best_chain_end(secs);
                let end = self.chain_ends[s];
                rows = 1 + if end == NONE {
                    0
                } else {
                    self.trie.nodes[end as usize].depth as usize
                };
            } else {
                rows = 1 + self.trie.nodes.len().min(req.max_nodes);
            }
        }
        Ok(())
    }

    /// The draft depth costly member `s` is asked for (at most `bound`, at least 1): the
    /// deepest `d` whose node on the member's own path, of reach `p` (the product of its
    /// planning rates to `d`), still raises the step's expected tokens per second:
    /// `p * secs >= tokens * (row + token)`, with `row` the learned time of one more verify row after
    /// `rows` and `token` the member's time per drafted token (`tokens`, `secs`: the step's
    /// expected tokens and seconds without it). The nodes past it would be cut by cost anyway;
    /// not drafting them saves the member's time.
    fn paying_depth(&self, s: usize, bound: usize, tokens: f64, secs: f64, rows: usize) -> usize {
        let row = match (self.ledger.step_secs(rows + 1), self.ledger.step_secs(rows)) {
            (Some(a), Some(b)) => (a - b).max(0.0),
            _ => 0.0,
        };
        let cost = tokens * (row + self.ledger.token_secs(s));
        let mut reach = 1.0;
        let mut depth = 0;
        while depth < bound {
            reach *= self.counts(s, depth + 1).optimistic();
            if depth >= 1 && reach * secs < cost {
                break;
            }
            depth += 1;
        }
        depth.max(1).min(bound.max(1))
    }

    /// Asks proposer `s` for its draft, times the call and merges the draft into the trie
    /// (not scored); `b` is the bucket it is asked in.
    fn ask(&mut self, s: usize, b: usize, req: &ProposeRequest<'_>, tree: bool) -> Result<()> {
        let d = &mut self.sub_drafts[s];
        let t = Instant::now();
        if tree {
            self.subs[s].propose_tree(req, d)?;
        } else {
            self.subs[s].propose(req, d)?;
        }
        if self.policy != MergePolicy::Reach {
            let secs = self.costs.member_secs(s, d.len(), t.elapsed());
            self.ledger.record_call(s, secs, d.len(), self.decay);
            self.spent += secs;
        }
        self.asked[s] = Some(b);
        self.insert(s, req.max_draft)
    }

    /// Scores every node (the product of the conditional rates along its path) and returns the
    /// largest expected accepted length of a path (`None` for an empty trie).
    fn rescore(&mut self) -> Option<f64> {
        self.trie.sums.clear();
        let mut best: Option<f64> = None;
        for id in 0..self.trie.nodes.len() {
            let node = self.trie.nodes[id];
            let (parent, above) = if node.parent == NONE {
                (1.0, 0.0)
            } else {
                let p = node.parent as usize;
                (self.trie.nodes[p].score, self.trie.sums[p])
            };
            let score = parent * self.node_rate(node.proposers, node.depth);
            self.trie.nodes[id].score = score;
            self.trie.sums.push(above + score);
            best = Some(best.map_or(above + score, |b: f64| b.max(above + score)));
        }
        best
    }

    /// Marks the end of a proposal of `rows` verify rows, from which [`Self::time_step`] times
    /// the rest of its step; not for a step whose forward also feeds prompt tokens
    /// ([`ProposeRequest::fused_prompt`]: a fused prefill would read as a step of many times
    /// the cost of its verify rows, and price every row at a share of the prompt's prefill).
    fn mark_end(&mut self, rows: usize, req: &ProposeRequest<'_>) {
        self.last_end = (req.fused_prompt == 0).then(|| (Instant::now(), rows));
    }

    /// Records the rest of the previous step (from the end of its proposal to now) against its
    /// verify rows, when the previous proposal was observed and nothing else came between.
    fn time_step(&mut self) {
        if let Some((t, rows)) = self.last_end.take() {
            let secs = self.costs.step_secs(rows, t.elapsed());
            self.ledger.record_step(rows, secs);
        }
    }

    /// The learned seconds of the rest of a step by verify rows, for the cost-aware cut; `None`
    /// under [`MergePolicy::Reach`] or before a step was timed. The members' calls of this step
    /// are not in it: at the cut they are spent whatever is kept (see "Cost-aware merging").
    /// An associated function of the two fields, so that the trie can be written while it is
    /// read.
    fn step_time(policy: MergePolicy, ledger: &Ledger) -> Option<StepTime<'_>> {
        if policy == MergePolicy::Reach {
            return None;
        }
        ledger.step_time()
    }

    /// Merges proposer `s`'s draft into the trie (nodes deeper than `max_depth` left out).
    fn insert(&mut self, s: usize, max_depth: usize) -> Result<()> {
        let d = &self.sub_drafts[s];
        let n = d.tokens.len();
        let fault = |f: TreeFault| Error::InvalidProposal {
            proposer: self.subs[s].name(),
            fault: ProposalFault::Tree(f),
        };
        if !d.parents.is_empty() && d.parents.len() != n {
            return Err(fault(TreeFault::Shape {
                what: "parents",
                expected: n,
                actual: d.parents.len(),
            }));
        }
        let bit = 1u64 << s;
        self.map.clear();
        for j in 0..n {
            let row = if d.parents.is_empty() {
                j
            } else {
                d.parents[j] as usize
            };
            if row > j {
                return Err(fault(TreeFault::ParentNotBefore {
                    node: j,
                    parent: row as u32,
                }));
            }
            let (parent, depth) = if row == 0 {
                (NONE, 1u32)
            } else {
                match self.map[row - 1] {
                    NONE => {
                        self.map.push(NONE);
                        continue;
                    }
                    p => (p, self.trie.nodes[p as usize].depth + 1),
                }
            };
            if depth as usize > max_depth {
                self.map.push(NONE);
                continue;
            }
            let id = self.trie.child(parent, d.tokens[j], depth, bit)?;
            self.map.push(id);
        }
        Ok(())
    }

    /// Updates the rates from the pending step's trie and `emitted` (see "Learning").
    fn learn(&mut self, emitted: &[u32]) {
        self.path.clear();
        let mut cur = NONE;
        // Whether every emitted token is on a path of the trie (its deeper candidates are
        // then the step's shadow).
        let mut complete = true;
        for (d, &token) in emitted.iter().enumerate() {
            self.step.fill(Counts::default());
            let mut next = NONE;
            let mut c = self.trie.first_child_of(cur);
            if c == NONE {
                complete = false;
                break;
            }
            while c != NONE {
                let node = self.trie.nodes[c as usize];
                let hit = node.token == token;
                if hit {
                    next = c;
                }
                let mut m = node.proposers;
                while m != 0 {
                    let s = m.trailing_zeros() as usize;
                    m &= m - 1;
                    self.step[s].tested += 1.0;
                    if hit {
                        self.step[s].accepted += 1.0;
                    }
                }
                c = node.next_sibling;
            }
            self.add_level(d);
            if next == NONE {
                complete = false;
                break;
            }
            self.path.push(next);
            cur = next;
        }
        if self.policy != MergePolicy::Reach {
            if complete && !emitted.is_empty() {
                self.shadows.keep(&self.trie, cur);
            }
            self.learn_gains();
        }
    }

    /// Adds `self.step` (one level's tested and accepted candidates per proposer) to the
    /// counts of depth `d + 1`, decaying those of every proposer that has some.
    fn add_level(&mut self, d: usize) {
        for (stats, step) in self.stats.iter_mut().zip(&self.step) {
            if step.tested == 0.0 {
                continue;
            }
            if stats.len() <= d {
                stats.resize(d + 1, Counts::default());
            }
            let e = &mut stats[d];
            e.accepted = e.accepted * self.decay + step.accepted;
            e.tested = e.tested * self.decay + step.tested;
        }
    }

    /// Scores the shadows of earlier steps against `emitted` (see [`super::merge_shadow`]),
    /// one level of one shadow counted as one step's level of the trie.
    fn learn_shadows(&mut self, emitted: &[u32]) {
        let mut shadows = std::mem::take(&mut self.shadows);
        shadows.advance(emitted, |depth, level| {
            self.step.fill(Counts::default());
            for &(mut m, hit) in level {
                while m != 0 {
                    let s = m.trailing_zeros() as usize;
                    m &= m - 1;
                    self.step[s].tested += 1.0;
                    if hit {
                        self.step[s].accepted += 1.0;
                    }
                }
            }
            self.add_level(depth - 1);
        });
        self.shadows = shadows;
    }

    /// Records each asked member's marginal accepted tokens of the pending step, net of the
    /// verify rows it added. Tree steps: the leading nodes of the accepted path it proposed,
    /// less the most any member asked before it proposed (a node's proposers are among its
    /// parent's, so a set of members reaches the depth of its best member); its rows: the kept
    /// nodes that no member asked before it proposed. Chain steps: the accepted length of the
    /// chain the merge chose with it, less that of the chain it would have chosen without it
    /// and the members after it (negative when its candidates displaced a better chain); its
    /// rows: the difference of the two chains' lengths. The rows are charged as the tokens
    /// they cost at the step's rate without the member, `(1 + E) * (T(with) - T(without)) /
    /// (T + spent)` (the quantities its ask decision weighed), so that the decision
    /// `g / (1 + E) >= t / (T + spent)` asks it only when its tokens pay for its call and its
    /// rows.
    fn learn_gains(&mut self) {
        let (mut before, mut before_end, mut before_mask) = (0usize, NONE, 0u64);
        // Tree steps: the draft's verify rows (`kept` is this step's, written by `write_tree`).
        let rows = if self.tree_step {
            self.trie.kept.iter().filter(|&&k| k).count() + 1
        } else {
            0
        };
        for i in 0..self.order.len() {
            let s = self.order[i];
            let Some(b) = self.asked[s] else {
                continue;
            };
            let bit = 1u64 << s;
            let nodes = &self.trie.nodes;
            let (gain, with_rows, without_rows) = if self.tree_step {
                let alone = self
                    .path
                    .iter()
                    .take_while(|&&id| nodes[id as usize].proposers & bit != 0)
                    .count();
                let g = alone.saturating_sub(before) as f64;
                before = before.max(alone);
                let own = (0..nodes.len())
                    .filter(|&id| self.trie.kept[id])
                    .filter(|&id| nodes[id].proposers & bit != 0)
                    .filter(|&id| nodes[id].proposers & before_mask == 0)
                    .count();
                (g, rows, rows - own)
            } else {
                let end = self.chain_ends[s];
                let with = self.trie.accepted_to(&self.path, end);
                let g = with as f64 - before as f64;
                let depth = |e: u32| {
                    if e == NONE {
                        0
                    } else {
                        nodes[e as usize].depth
                    }
                };
                let r = (depth(end) as usize + 1, depth(before_end) as usize + 1);
                (before, before_end) = (with, end);
                (g, r.0, r.1)
            };
            before_mask |= bit;
            let net = gain - self.rows_in_tokens(s, with_rows, without_rows);
            self.ledger.record_gain(s, b, net, self.decay);
        }
    }

    /// The tokens that `with - without` extra verify rows cost at member `s`'s decision rate
    /// (see [`MergedProposer::learn_gains`]); 0 while no step was timed, and for fewer rows.
    fn rows_in_tokens(&self, s: usize, with: usize, without: usize) -> f64 {
        let (tokens, secs) = self.asked_at[s];
        match (self.ledger.step_secs(with), self.ledger.step_secs(without)) {
            (Some(w), Some(wo)) if with > without && secs > 0.0 => tokens * (w - wo) / secs,
            _ => 0.0,
        }
    }
}

/// The length of the longest leading run of `emitted` that is a path of `d` (chain or tree),
/// at most `cap`. One pass: the nodes are in topological order.
fn own_accepted(d: &Draft, emitted: &[u32], cap: usize) -> usize {
    let limit = cap.min(emitted.len());
    let mut row = 0usize;
    let mut depth = 0usize;
    for (j, &t) in d.tokens.iter().enumerate() {
        if depth == limit {
            break;
        }
        let parent = if d.parents.is_empty() {
            j
        } else {
            match d.parents.get(j) {
                Some(&p) => p as usize,
                None => break,
            }
        };
        if parent == row && t == emitted[depth] {
            row = j + 1;
            depth += 1;
        }
    }
    depth
}

/// What a merge hands to a new one ([`Learned`]): its ledger and its rates' counts.
#[derive(Debug, Clone)]
pub(super) struct MergeMemory {
    ledger: Ledger,
    stats: Vec<Vec<Counts>>,
}

impl MergeMemory {
    /// The number of members.
    pub(super) fn members(&self) -> usize {
        self.stats.len()
    }
}

impl Proposer for MergedProposer {
    /// `true` for greedy requests under [`MergePolicy::CostAware`] (the default): the merge
    /// keeps only the nodes that raise the step's expected tokens per second on its measured
    /// step cost (see "Cost-aware merging"), so the adaptive loop asks it for the longest draft
    /// allowed. Sampled requests keep the adaptive policy's choice: there the merge's learned
    /// rates ran high (prompt lookup's first draft position planned at 0.80 where 0.56 of them
    /// were accepted, temperature 0.7) and its own cut drafted five- and six-token chains that
    /// lost on code edits (0.91x against the policy's 0.99x; issue 31, llama.cpp's CPU verify
    /// of Gemma 3 270M).
    fn sizes_own_drafts(&self, config: &SamplingConfig) -> bool {
        self.policy == MergePolicy::CostAware && config.is_greedy()
    }

    /// `true` when every merged proposer drafts from tokens alone.
    fn drafts_from_tokens(&self) -> bool {
        self.subs.iter().all(|p| p.drafts_from_tokens())
    }

    /// The merged chain: every proposer's chain ([`Proposer::propose`]) merged, and the path
    /// with the largest expected accepted length, at most `req.max_draft` tokens (see "The
    /// rule" on [`MergedProposer`]). No q.
    ///
    /// # Errors
    /// The first error of a proposer, as it is; [`Error::InvalidProposal`] naming a proposer
    /// whose draft is a malformed tree; [`Error::Proposer`] past `2^32 - 2` candidates.
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        self.gather(req, false)?;
        let time = Self::step_time(self.policy, &self.ledger);
        let secs = time.map(|t| move |rows: usize| t.secs(rows));
        self.trie
            .write_chain(secs.as_ref().map(|f| f as &dyn Fn(usize) -> f64), draft);
        self.mark_end(draft.len() + 1, req);
        Ok(())
    }

    /// The merged tree: every proposer's tree ([`Proposer::propose_tree`]) merged, and the
    /// best `req.max_nodes` nodes by estimated reach probability, depth at most
    /// `req.max_draft`, at most `req.max_branch` children per node, siblings best first (see
    /// "The rule" on [`MergedProposer`]). Point masses only: no q, default schemes.
    ///
    /// # Errors
    /// As [`MergedProposer::propose`](Proposer::propose).
    fn propose_tree(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        self.gather(req, true)?;
        let time = Self::step_time(self.policy, &self.ledger);
        let secs = time.map(|t| move |rows: usize| t.secs(rows));
        let secs = secs.as_ref().map(|f| f as &dyn Fn(usize) -> f64);
        self.trie
            .write_tree(req.max_nodes, req.max_branch, secs, draft);
        self.mark_end(draft.len() + 1, req);
        Ok(())
    }

    /// Learns the rates from the pending step (see "Learning" on [`MergedProposer`]), then
    /// tells each proposer its own accepted count and `emitted`.
    ///
    /// # Errors
    /// The first error of a proposer's `observe`, as it is (the later proposers are not told).
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        let pending = std::mem::replace(&mut self.pending, false);
        if self.policy != MergePolicy::Reach {
            self.learn_shadows(emitted);
        }
        if pending {
            self.learn(emitted);
        } else {
            // A step without a proposal came between: the time since the last one is not one
            // step's. The step itself is one of a single verify row, from the last observe.
            self.last_end = None;
            if let Some(t) = self
                .last_observe
                .filter(|_| self.policy != MergePolicy::Reach)
            {
                let secs = self.costs.step_secs(1, t.elapsed());
                self.ledger.record_step(1, secs);
            }
        }
        for (sub, d) in self.subs.iter_mut().zip(&self.sub_drafts) {
            let own = if pending {
                own_accepted(d, emitted, accepted)
            } else {
                0
            };
            sub.observe(own, emitted)?;
        }
        self.last_observe = Some(Instant::now());
        Ok(())
    }

    /// The largest [`Proposer::row_candidates`] of the merged proposers.
    fn row_candidates(&self) -> usize {
        self.subs
            .iter()
            .map(|s| s.row_candidates())
            .max()
            .unwrap_or(0)
    }

    /// Forwards `rows` to every proposer whose [`Proposer::row_candidates`] is above 0, each
    /// row cut to the number of ids that proposer asked for.
    ///
    /// # Errors
    /// The first error of a proposer, as it is.
    fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
        for sub in &mut self.subs {
            let k = sub.row_candidates();
            if k == 0 {
                continue;
            }
            if rows.candidates.iter().all(|r| r.len() <= k) {
                sub.observe_rows(rows)?;
            } else {
                self.rows.clear();
                for r in rows.candidates.iter() {
                    self.rows.push_row(&r[..k.min(r.len())]);
                }
                sub.observe_rows(&VerifiedRows {
                    candidates: &self.rows,
                    ..*rows
                })?;
            }
        }
        Ok(())
    }

    /// Forwards `begin` to every proposer (the learned rates are kept).
    ///
    /// # Errors
    /// The first error of a proposer, as it is.
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.pending = false;
        self.shadows.clear();
        self.last_end = None;
        self.last_observe = None;
        for sub in &mut self.subs {
            sub.begin(prompt)?;
        }
        Ok(())
    }

    /// Forwards `begin_reusing` to every proposer.
    fn begin_reusing(&mut self, prompt: &[u32]) -> Result<()> {
        self.pending = false;
        self.shadows.clear();
        self.last_end = None;
        self.last_observe = None;
        for sub in &mut self.subs {
            sub.begin_reusing(prompt)?;
        }
        Ok(())
    }

    /// Forwards `finish` to every proposer.
    fn finish(&mut self, sequence: &[u32]) {
        self.pending = false;
        self.shadows.clear();
        self.last_end = None;
        self.last_observe = None;
        for sub in &mut self.subs {
            sub.finish(sequence);
        }
    }

    /// What the merge learned ([`Learned`]): its rates, gains and costs; `None` under
    /// [`MergePolicy::Reach`], which learns no costs (its rates carry over within one merge).
    fn learned(&self) -> Option<Learned> {
        (self.policy == MergePolicy::CostAware).then(|| Learned {
            kind: Kind::Merge(Box::new(MergeMemory {
                ledger: self.ledger.clone(),
                stats: self.stats.clone(),
            })),
        })
    }

    /// Starts from what a merge of as many members (in the same order) learned: its rates,
    /// gains and costs replace this merge's, so that a member known not to pay on this engine
    /// is not called at the first step (only probed within its share of the time) and the
    /// chains are as long as the learned rates pay for.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `learned` when it is of a merge of another number of
    /// members.
    fn start_from_learned(&mut self, learned: &Learned) -> Result<()> {
        let Kind::Merge(m) = &learned.kind;
        if m.members() != self.subs.len() {
            return Err(Error::config(
                "learned",
                m.members(),
                "learned by a merge of another number of members",
            ));
        }
        self.ledger = m.ledger.clone();
        self.stats = m.stats.clone();
        self.last_end = None;
        self.last_observe = None;
        self.shadows.clear();
        Ok(())
    }

    /// `"merged"`.
    fn name(&self) -> &'static str {
        "merged"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::propose::PromptLookup;
    use crate::sampling::SamplingConfig;
    use crate::tree::{DraftBlock, TreeLimits};
    use std::sync::{Arc, Mutex};

    /// What a [`Fixed`] proposer was told.
    #[derive(Debug, Default)]
    struct Log {
        observed: Vec<(usize, Vec<u32>)>,
        rows: Vec<Vec<Vec<u32>>>,
        begins: usize,
        finishes: usize,
    }

    /// Returns the same draft every step (`propose_tree`: the whole tree, a chain when
    /// `parents` is empty; `propose`: the first `max_draft` tokens as a chain), and logs its
    /// feedback.
    struct Fixed {
        tokens: Vec<u32>,
        parents: Vec<u32>,
        row_k: usize,
        fail: bool,
        log: Arc<Mutex<Log>>,
    }

    fn fixed(tokens: &[u32], parents: &[u32]) -> (Box<dyn Proposer + Send>, Arc<Mutex<Log>>) {
        let log = Arc::new(Mutex::new(Log::default()));
        let p = Fixed {
            tokens: tokens.to_vec(),
            parents: parents.to_vec(),
            row_k: 0,
            fail: false,
            log: log.clone(),
        };
        (Box::new(p), log)
    }

    fn chain(tokens: &[u32]) -> Box<dyn Proposer + Send> {
        fixed(tokens, &[]).0
    }

    impl Proposer for Fixed {
        fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
            draft.clear();
            if self.fail {
                return Err(Error::proposer("fixed failed"));
            }
            let k = req.max_draft.min(self.tokens.len());
            draft.tokens.extend_from_slice(&self.tokens[..k]);
            Ok(())
        }
        fn propose_tree(&mut self, _req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
            draft.clear();
            if self.fail {
                return Err(Error::proposer("fixed failed"));
            }
            draft.tokens.extend_from_slice(&self.tokens);
            draft.parents.extend_from_slice(&self.parents);
            Ok(())
        }
        fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
            self.log
                .lock()
                .unwrap()
                .observed
                .push((accepted, emitted.to_vec()));
            Ok(())
        }
        fn row_candidates(&self) -> usize {
            self.row_k
        }
        fn observe_rows(&mut self, rows: &VerifiedRows<'_>) -> Result<()> {
            let r = rows.candidates.iter().map(|r| r.to_vec()).collect();
            self.log.lock().unwrap().rows.push(r);
            Ok(())
        }
        fn begin(&mut self, _prompt: &[u32]) -> Result<()> {
            self.log.lock().unwrap().begins += 1;
            Ok(())
        }
        fn finish(&mut self, _sequence: &[u32]) {
            self.log.lock().unwrap().finishes += 1;
        }
    }

    const CTX: [u32; 3] = [0, 0, 0];

    /// A merge under the rule before the cost-aware one (every member asked, the budget
    /// filled): what most tests below pin.
    fn reach(subs: Vec<Box<dyn Proposer + Send>>) -> Result<MergedProposer> {
        Ok(MergedProposer::new(subs)?.with_policy(MergePolicy::Reach))
    }

    fn tree(m: &mut MergedProposer, depth: usize, nodes: usize, branch: usize) -> Draft {
        let cfg = SamplingConfig::greedy();
        let mut req = ProposeRequest::new(&CTX, &cfg, depth);
        req.max_nodes = nodes;
        req.max_branch = branch;
        let mut d = Draft::default();
        m.propose_tree(&req, &mut d).unwrap();
        d
    }

    fn chain_of(m: &mut MergedProposer, depth: usize) -> Draft {
        let cfg = SamplingConfig::greedy();
        let req = ProposeRequest::new(&CTX, &cfg, depth);
        let mut d = Draft::default();
        m.propose(&req, &mut d).unwrap();
        d
    }

    /// Every root-to-node path of a draft, as token sequences, sorted.
    fn paths(d: &Draft) -> Vec<Vec<u32>> {
        let b = d.block();
        let mut out: Vec<Vec<u32>> = (0..d.len())
            .map(|i| {
                let mut nodes = Vec::new();
                b.path_to(i, &mut nodes);
                nodes.iter().map(|&j| d.tokens[j as usize]).collect()
            })
            .collect();
        out.sort();
        out
    }

    fn valid(d: &Draft, depth: usize, nodes: usize, branch: usize) {
        let limits = TreeLimits {
            max_nodes: nodes,
            max_depth: depth,
            max_branch: branch,
            ..TreeLimits::vocab(1 << 20)
        };
        d.block().validate(&limits).unwrap();
        assert!(d.q.is_none() && d.schemes.is_empty());
    }

    #[test]
    fn construction_is_checked() {
        assert!(matches!(
            reach(Vec::new()),
            Err(Error::InvalidConfig {
                field: "proposers",
                ..
            })
        ));
        let many: Vec<Box<dyn Proposer + Send>> = (0..65).map(|_| chain(&[1])).collect();
        assert!(matches!(
            reach(many),
            Err(Error::InvalidConfig {
                field: "proposers",
                ..
            })
        ));
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let m = reach(vec![chain(&[1])]).unwrap();
            assert!(matches!(
                m.with_decay(bad),
                Err(Error::InvalidConfig { field: "decay", .. })
            ));
        }
        let m = reach(vec![chain(&[1]), chain(&[2])])
            .unwrap()
            .with_decay(1.0)
            .unwrap();
        assert_eq!((m.len(), m.decay(), m.name()), (2, 1.0, "merged"));
        assert_eq!(m.rate(0, 1), 0.5);
        assert_eq!(m.rate(7, 0), 0.5);
        assert!(!m.is_empty());
        assert!(m.proposer(1).is_some() && m.proposer(2).is_none());
    }

    #[test]
    fn overlapping_drafts_merge_into_one_trie() {
        // A: chain 1 2 3. B: tree 1 -> 2 -> 4, 1 -> 6, root -> 5.
        let (b, _) = fixed(&[1, 2, 4, 5, 6], &[0, 1, 2, 0, 1]);
        let mut m = reach(vec![chain(&[1, 2, 3]), b]).unwrap();
        let d = tree(&mut m, 8, 16, usize::MAX);
        valid(&d, 8, 16, usize::MAX);
        assert_eq!(
            paths(&d),
            [
                vec![1],
                vec![1, 2],
                vec![1, 2, 3],
                vec![1, 2, 4],
                vec![1, 6],
                vec![5]
            ]
        );
        // All rates at the prior: scores by depth, ties to the earlier node; the earliest node
        // whose parent and better siblings are out comes next.
        assert_eq!(d.tokens, [1, 2, 3, 4, 5, 6]);
        assert_eq!(d.parents, [0, 1, 2, 2, 0, 1]);
    }

    #[test]
    fn a_single_proposer_is_passed_through() {
        // A prefix tree in a non-breadth-first order.
        let tokens = [1, 2, 3, 4, 5, 6];
        let parents = [0, 1, 0, 3, 1, 2];
        let (p, _) = fixed(&tokens, &parents);
        let mut m = reach(vec![p]).unwrap();
        for _ in 0..3 {
            let d = tree(&mut m, 4, 6, 3);
            assert_eq!((&d.tokens[..], &d.parents[..]), (&tokens[..], &parents[..]));
            m.observe(1, &[1, 9]).unwrap();
        }
        // Chains, tree and chain steps.
        let mut m = reach(vec![chain(&[4, 5, 6])]).unwrap();
        let d = tree(&mut m, 4, 8, 2);
        assert_eq!(
            (&d.tokens[..], d.parents.is_empty()),
            (&[4, 5, 6][..], true)
        );
        assert_eq!(chain_of(&mut m, 2).tokens, [4, 5]);
        // A real proposer's tree, a few contexts.
        let cfg = SamplingConfig::greedy();
        let context = [3, 4, 5, 6, 3, 4, 7, 8, 3, 4, 5, 9, 3, 4];
        for (depth, nodes) in [(3, 6), (4, 4), (2, 3), (5, 12)] {
            let mut req = ProposeRequest::new(&context, &cfg, depth);
            req.max_nodes = nodes;
            let mut want = Draft::default();
            PromptLookup::new(1, 3)
                .unwrap()
                .propose_tree(&req, &mut want)
                .unwrap();
            assert!(!want.is_empty());
            let mut m = reach(vec![Box::new(PromptLookup::new(1, 3).unwrap())]).unwrap();
            let mut got = Draft::default();
            m.propose_tree(&req, &mut got).unwrap();
            assert_eq!(got, want, "depth {depth} nodes {nodes}");
            PromptLookup::new(1, 3)
                .unwrap()
                .propose(&req, &mut want)
                .unwrap();
            m.propose(&req, &mut got).unwrap();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn budget_depth_and_branching_are_honoured() {
        // A complete ternary tree of depth 3 (39 nodes), breadth first, from two proposers
        // with different tokens at the leaves.
        let mut tokens = Vec::new();
        let mut parents = Vec::new();
        let mut level = vec![0u32];
        for depth in 0..3 {
            let mut next = Vec::new();
            for &row in &level {
                for c in 0..3 {
                    tokens.push(10 * depth + c);
                    parents.push(row);
                    next.push(tokens.len() as u32);
                }
            }
            level = next;
        }
        let mut leaves = tokens.clone();
        for t in &mut leaves[12..] {
            *t += 100;
        }
        let (a, _) = fixed(&tokens, &parents);
        let (b, _) = fixed(&leaves, &parents);
        let mut m = reach(vec![a, b]).unwrap();
        for (depth, nodes, branch) in [
            (3, 64, usize::MAX),
            (3, 10, usize::MAX),
            (2, 64, usize::MAX),
            (3, 64, 2),
            (3, 7, 1),
            (1, 2, 5),
            (0, 5, 5),
            (3, 0, 5),
        ] {
            let d = tree(&mut m, depth, nodes, branch);
            valid(&d, depth, nodes, branch);
            // Per level: 3 children per node at depths 1 and 2, 6 at depth 3 (both leaf sets).
            let (w, w3) = (3.min(branch), 6.min(branch));
            let levels = [w, w * w, w * w * w3];
            let want = levels[..depth].iter().sum::<usize>().min(nodes);
            assert_eq!(d.len(), want, "{depth} {nodes} {branch}");
            // The top nodes: a full tree is kept level by level (scores fall with depth).
            let depths: Vec<usize> = (0..d.len()).map(|i| d.block().depth(i)).collect();
            assert!(depths.windows(2).all(|w| w[0] <= w[1]), "{depths:?}");
        }
    }

    #[test]
    fn rates_are_learned_with_decay() {
        let mut m = reach(vec![chain(&[1, 2]), chain(&[1, 3])])
            .unwrap()
            .with_decay(0.5)
            .unwrap();
        // Budget 1: only node 1 is drafted, but every candidate is learned from.
        let d = tree(&mut m, 2, 1, 8);
        assert_eq!(d.tokens, [1]);
        m.observe(1, &[1, 2]).unwrap();
        // Depth 1: both tested and accepted; depth 2: both tested, A accepted.
        assert_eq!(m.rate(0, 1), 2.0 / 3.0);
        assert_eq!(m.rate(1, 1), 2.0 / 3.0);
        assert_eq!(m.rate(0, 2), 2.0 / 3.0);
        assert_eq!(m.rate(1, 2), 1.0 / 3.0);
        assert_eq!(m.rate(0, 3), 0.5);
        // Step 2: emitted 1 3: A's depth-2 counts (1, 1) decay to (0.5, 0.5), then (+0, +1).
        tree(&mut m, 2, 1, 8);
        m.observe(1, &[1, 3]).unwrap();
        assert_eq!(m.rate(0, 2), (0.5 + 1.0) / (1.5 + 2.0));
        assert_eq!(m.rate(1, 2), (0.0 + 1.0 + 1.0) / (1.5 + 2.0));
        assert_eq!(m.rate(0, 1), (1.5 + 1.0) / (1.5 + 2.0));
        // A first token off every candidate: depth 1 tested and rejected, nothing deeper.
        tree(&mut m, 2, 1, 8);
        m.observe(0, &[7]).unwrap();
        assert_eq!(m.rate(0, 1), (0.75 + 1.0) / (1.75 + 2.0));
        assert_eq!(m.rate(0, 2), (0.5 + 1.0) / (1.5 + 2.0));
        // An observe without a proposal learns nothing.
        m.observe(0, &[5]).unwrap();
        assert_eq!(m.rate(0, 1), (0.75 + 1.0) / (1.75 + 2.0));
        m.reset_rates();
        assert_eq!(m.rate(0, 1), 0.5);
    }

    #[test]
    fn ranking_follows_the_learned_rates() {
        // B is listed first and wins ties; A is the one that is right.
        let mut m = reach(vec![chain(&[7, 8, 9]), chain(&[1, 2, 3])]).unwrap();
        // At the prior the top 3 by reach: both depth-1 nodes and B's depth-2 node.
        let d = tree(&mut m, 3, 3, 8);
        assert_eq!(
            (&d.tokens[..], &d.parents[..]),
            (&[7, 8, 1][..], &[0, 1, 0][..])
        );
        m.observe(0, &[1]).unwrap();
        let d = tree(&mut m, 3, 4, 8);
        // A's depth 1 node now ranks first, and siblings come best first.
        assert_eq!(d.tokens[0], 1);
        assert_eq!(d.parents[..2], [0, 0]);
        for _ in 0..4 {
            tree(&mut m, 3, 3, 8);
            m.observe(3, &[1, 2, 3, 4]).unwrap();
        }
        assert!(m.rate(1, 3) > 0.6 && m.rate(0, 1) < 0.3);
        assert_eq!(tree(&mut m, 3, 3, 8).tokens, [1, 2, 3]);
        assert_eq!(chain_of(&mut m, 3).tokens, [1, 2, 3]);
        m.observe(3, &[1, 2, 3, 4]).unwrap();
    }

    #[test]
    fn chain_steps_pick_the_longest_expected_path() {
        // At the prior, 3 nodes (0.5 + 0.25 + 0.125) beat 1 (0.5) whatever the order.
        let mut m = reach(vec![chain(&[4]), chain(&[1, 2, 3])]).unwrap();
        let d = chain_of(&mut m, 8);
        assert_eq!(
            (d.tokens.as_slice(), d.parents.is_empty()),
            (&[1, 2, 3][..], true)
        );
        assert_eq!(chain_of(&mut m, 2).tokens, [1, 2]);
        // Learn that 4 is right at depth 1 and the other is wrong.
        for _ in 0..6 {
            chain_of(&mut m, 3);
            m.observe(1, &[4, 0]).unwrap();
        }
        assert_eq!(chain_of(&mut m, 3).tokens, [4]);
        assert!(chain_of(&mut m, 0).is_empty());
    }

    #[test]
    fn each_proposer_is_told_its_own_accepted_count() {
        let (a, la) = fixed(&[1, 2, 3], &[]);
        // B: 1 -> 5, 1 -> 2 -> 3 -> 4 (the matching branch is not the first).
        let (b, lb) = fixed(&[1, 5, 2, 3, 4], &[0, 1, 1, 3, 4]);
        let (c, lc) = fixed(&[9, 2], &[]);
        let mut m = reach(vec![a, b, c]).unwrap();
        m.begin(&[0]).unwrap();
        tree(&mut m, 4, 2, 8);
        // Only two nodes were drafted and accepted; the bonus token 3 is not an accepted draft.
        m.observe(2, &[1, 2, 3]).unwrap();
        tree(&mut m, 4, 16, 8);
        m.observe(4, &[1, 2, 3, 4, 6]).unwrap();
        // A stop cut the step: accepted = emitted.len().
        tree(&mut m, 4, 16, 8);
        m.observe(1, &[1]).unwrap();
        // No proposal pending.
        m.observe(0, &[6]).unwrap();
        m.finish(&[0, 1]);
        let got = |l: &Arc<Mutex<Log>>| {
            let l = l.lock().unwrap();
            assert_eq!((l.begins, l.finishes), (1, 1));
            l.observed.iter().map(|o| o.0).collect::<Vec<_>>()
        };
        assert_eq!(got(&la), [2, 3, 1, 0]);
        assert_eq!(got(&lb), [2, 4, 1, 0]);
        assert_eq!(got(&lc), [0, 0, 0, 0]);
        assert_eq!(la.lock().unwrap().observed[1].1, [1, 2, 3, 4, 6]);
    }

    #[test]
    fn rows_are_forwarded_to_the_proposers_that_ask() {
        let mk = |k| {
            let log = Arc::new(Mutex::new(Log::default()));
            let p: Box<dyn Proposer + Send> = Box::new(Fixed {
                tokens: vec![1],
                parents: vec![],
                row_k: k,
                fail: false,
                log: log.clone(),
            });
            (p, log)
        };
        let (a, la) = mk(2);
        let (b, lb) = mk(0);
        let (c, lc) = mk(4);
        let mut m = reach(vec![a, b, c]).unwrap();
        assert_eq!(m.row_candidates(), 4);
        let mut rows = RowCandidates::default();
        rows.push_row(&[5, 6, 7, 8]);
        rows.push_row(&[9]);
        m.observe_rows(&VerifiedRows {
            inputs: &[0, 1],
            parents: &[],
            candidates: &rows,
            path: &[0],
        })
        .unwrap();
        assert_eq!(la.lock().unwrap().rows, [vec![vec![5, 6], vec![9]]]);
        assert!(lb.lock().unwrap().rows.is_empty());
        assert_eq!(lc.lock().unwrap().rows, [vec![vec![5, 6, 7, 8], vec![9]]]);
        let m = reach(vec![chain(&[1])]).unwrap();
        assert_eq!(m.row_candidates(), 0);
    }

    /// A cost-aware merge over `subs` with fixed costs: a step costs 10 ms plus `per_row`
    /// seconds per verify row; member `costly` (if any) 2 ms per call plus 1 ms per token.
    fn costed(
        subs: Vec<Box<dyn Proposer + Send>>,
        per_row: f64,
        costly: Option<usize>,
    ) -> MergedProposer {
        let mut c = super::super::FixedMergeCosts::new(0.010, per_row).unwrap();
        if let Some(s) = costly {
            c = c.with_member(s, 0.002, 0.001).unwrap();
        }
        MergedProposer::new(subs).unwrap().with_costs(c)
    }

    /// One step against the target's text `truth`: a tree of `nodes` nodes (depth 4), the
    /// accepted path, and `observe` with the correction or bonus token. Returns the draft.
    fn step_against(m: &mut MergedProposer, truth: &[u32], nodes: usize) -> Draft {
        let d = tree(m, 4, nodes, usize::MAX);
        let accepted = own_accepted(&d, truth, truth.len() - 1);
        m.observe(accepted, &truth[..accepted + 1]).unwrap();
        d
    }

    #[test]
    fn a_costly_member_that_is_never_accepted_is_not_asked_but_probed() {
        // A is right and free; B is always wrong and costs 2 ms + 1 ms per token.
        let truth = [1, 2, 3, 4];
        let mut m = costed(vec![chain(&[1, 2, 3]), chain(&[7, 8, 9])], 0.0005, Some(1));
        let mut asked = 0;
        for i in 0..200 {
            let d = step_against(&mut m, &truth, 6 + i % 3);
            assert!(m.was_asked(0));
            if m.was_asked(1) {
                asked += 1;
            } else {
                assert!(!d.tokens.contains(&7), "an unasked member has no nodes");
            }
        }
        // Once per bucket at the prior, then probes every 8, 16, 32, 64 skipped steps.
        assert!((2..=12).contains(&asked), "asked {asked} times");
        let gain = m.marginal_gain(1, Some(3.0));
        assert!(gain < 0.35, "{gain}");
        assert!(m.marginal_gain(0, None) > 2.5);
        // The old rule asks everyone, always.
        let mut r = reach(vec![chain(&[1, 2, 3]), chain(&[7, 8, 9])]).unwrap();
        for _ in 0..20 {
            let d = step_against(&mut r, &truth, 6);
            assert!(r.was_asked(1) && d.tokens.contains(&7));
        }
    }

    #[test]
    fn a_merge_started_from_learned_does_not_call_a_member_that_does_not_pay() {
        let truth = [1, 2, 3, 4];
        // B is always wrong and dearer than a step (20 ms per call against 10 ms), as a draft
        // model's catch-up is: it does not pay even at the prior gain of one token.
        let mk = || {
            let c = super::super::FixedMergeCosts::new(0.010, 0.0005)
                .and_then(|c| c.with_member(1, 0.020, 0.001))
                .unwrap();
            MergedProposer::new(vec![chain(&[1, 2, 3]), chain(&[7, 8, 9])])
                .unwrap()
                .with_costs(c)
        };
        let mut m = mk();
        for i in 0..50 {
            step_against(&mut m, &truth, 6 + i % 3);
        }
        // Through a box, as a server holds its proposers.
        let boxed: Box<dyn Proposer + Send> = Box::new(m);
        let learned = boxed.learned().expect("a cost-aware merge learns");
        assert_eq!(learned.members(), Some(2));
        // Negative control: a fresh merge asks the member it has not timed at its first step.
        let mut fresh = mk();
        step_against(&mut fresh, &truth, 6);
        assert!(fresh.was_asked(1));
        // Started from what the first merge learned, it is not asked until a probe is due.
        let mut carried = mk();
        carried.start_from_learned(&learned).unwrap();
        assert!(carried.rate(0, 2) > 0.8, "the rates carry over");
        let mut asked = Vec::new();
        for i in 0..40 {
            let d = step_against(&mut carried, &truth, 6 + i % 3);
            if carried.was_asked(1) {
                asked.push(i);
            } else {
                assert!(!d.tokens.contains(&7));
            }
        }
        assert!(asked.first().is_none_or(|&i| i >= 7), "{asked:?}");
        assert!(asked.len() <= 3, "{asked:?}");
        // Costs of another configuration are refused; the old rule learns none.
        let mut three = costed(vec![chain(&[1]), chain(&[2]), chain(&[3])], 0.0005, Some(1));
        let e = three.start_from_learned(&learned).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { .. }), "{e}");
        assert!(reach(vec![chain(&[1])]).unwrap().learned().is_none());
    }

    /// Proposes the continuation of `text` from the position the emitted tokens reached.
    struct Follow {
        text: Vec<u32>,
        pos: usize,
    }

    impl Proposer for Follow {
        fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
            draft.clear();
            let end = (self.pos + req.max_draft).min(self.text.len());
            draft
                .tokens
                .extend_from_slice(&self.text[self.pos.min(end)..end]);
            Ok(())
        }
        fn observe(&mut self, _accepted: usize, emitted: &[u32]) -> Result<()> {
            self.pos += emitted.len();
            Ok(())
        }
    }

    /// Chain steps along `text` from `*pos`, of the depths `depths` in turn (each step emits
    /// the accepted drafts and the next token of `text`); returns each step's draft length.
    fn follow_steps(
        m: &mut MergedProposer,
        text: &[u32],
        pos: &mut usize,
        steps: usize,
        depths: &[usize],
    ) -> Vec<usize> {
        let mut lens = Vec::new();
        for i in 0..steps {
            let d = chain_of(m, depths[i % depths.len()]);
            let accepted = d
                .tokens
                .iter()
                .zip(&text[*pos..])
                .take_while(|(a, b)| a == b)
                .count();
            let emitted = &text[*pos..*pos + accepted + 1];
            m.observe(accepted, emitted).unwrap();
            *pos += emitted.len();
            lens.push(d.tokens.len());
        }
        lens
    }

    #[test]
    fn a_merge_whose_rows_are_dear_learns_its_deep_rates_from_later_tokens() {
        // A verify row costs 10 ms on a 2 ms base: two rows cost 1.83 single steps. The member
        // is wrong on the first 60 tokens (its rates fall and the cost rule stops drafting it),
        // then right: only its depth-1 candidate is tested by the plain steps' one token.
        let text: Vec<u32> = (0..1000).map(|i| 10 + i as u32).collect();
        let guess: Vec<u32> = text
            .iter()
            .enumerate()
            .map(|(i, &t)| if i < 60 { t + 1000 } else { t })
            .collect();
        let c = super::super::FixedMergeCosts::new(0.002, 0.010).unwrap();
        let follow = Box::new(Follow {
            text: guess,
            pos: 0,
        });
        let mut m = MergedProposer::new(vec![follow]).unwrap().with_costs(c);
        let mut pos = 0;
        // Depths 1 to 4 in turn at first, so that steps of several row counts are timed.
        follow_steps(&mut m, &text, &mut pos, 8, &[1, 2, 3, 4]);
        let left = 60 - pos;
        let wrong = follow_steps(&mut m, &text, &mut pos, left, &[4]);
        assert!(wrong.iter().rev().take(10).all(|&n| n == 0), "{wrong:?}");
        // Depth 1 was tested and wrong; depth 2 never tested (no depth-1 hit): at the prior.
        assert!(m.rate(0, 1) < 0.2, "{}", m.rate(0, 1));
        // Two plain steps where it is right: the first step's candidates below its emitted
        // token (its shadow) are tested by the second step's token at depth 2, which no
        // drafted node reached.
        let before = m.rate(0, 2);
        let lens = follow_steps(&mut m, &text, &mut pos, 2, &[4]);
        assert_eq!(lens, [0, 0]);
        assert!(m.rate(0, 2) > before, "{} -> {}", before, m.rate(0, 2));
        // It drafts again once its depth-1 rate (decay 0.98: a memory of about 50 steps)
        // pays for a row, and then as deep as pays.
        let lens = follow_steps(&mut m, &text, &mut pos, 150, &[4]);
        assert!(lens[130..].iter().all(|&n| n >= 3), "{lens:?}");
        assert!((1..=4).all(|d| m.rate(0, d) > 0.9));
        // Negative control: shadows never count a miss as a hit: a member that stays wrong
        // keeps its rates low and is not drafted.
        let c = super::super::FixedMergeCosts::new(0.002, 0.010).unwrap();
        let never = Box::new(Follow {
            text: text.iter().map(|t| t + 1000).collect(),
            pos: 0,
        });
        let mut w = MergedProposer::new(vec![never]).unwrap().with_costs(c);
        let mut pos = 0;
        follow_steps(&mut w, &text, &mut pos, 8, &[1, 2, 3, 4]);
        let lens = follow_steps(&mut w, &text, &mut pos, 40, &[4]);
        assert!(lens[10..].iter().all(|&n| n == 0), "{lens:?}");
        assert!(
            w.rate(0, 1) < 0.1 && w.rate(0, 2) <= 0.5,
            "{}",
            w.rate(0, 1)
        );
    }

    #[test]
    fn a_free_member_that_is_never_accepted_loses_its_nodes_to_the_row_cost() {
        let truth = [1, 2, 3, 4];
        // Rows cost 4 ms each against a 10 ms step: B's nodes (reach about 0.02) do not pay.
        let mut m = costed(vec![chain(&[1, 2, 3]), chain(&[7, 8, 9])], 0.004, None);
        let mut last = Draft::default();
        // Budgets of 3 to 6 nodes, so that the step time is seen at several row counts.
        for i in 0..60 {
            last = step_against(&mut m, &truth, 3 + i % 4);
            assert!(m.was_asked(1), "a free member is always asked");
        }
        assert_eq!(last.tokens, [1, 2, 3]);
        // Free rows: every candidate fits the budget and is kept.
        let mut m = costed(vec![chain(&[1, 2, 3]), chain(&[7, 8, 9])], 0.0, None);
        for i in 0..60 {
            last = step_against(&mut m, &truth, 6 + i % 3);
        }
        assert_eq!(last.len(), 6);
        // Rows so dear that no node pays: no draft at all.
        let mut m = costed(vec![chain(&[7, 8, 9])], 1.0, None);
        for i in 0..60 {
            last = step_against(&mut m, &truth, 1 + i % 3);
        }
        assert!(last.is_empty());
    }

    /// Records the row counts of the steps the merge times.
    struct StepRows(Arc<Mutex<Vec<usize>>>);

    impl super::super::MergeCosts for StepRows {
        fn member_secs(&self, _: usize, _: usize, _: std::time::Duration) -> f64 {
            0.0
        }
        fn step_secs(&self, rows: usize, _: std::time::Duration) -> f64 {
            self.0.lock().unwrap().push(rows);
            0.01
        }
    }

    #[test]
    fn a_step_that_feeds_the_prompt_is_not_timed() {
        // Its forward also feeds the prompt (a fused prefill): timing it would price every
        // verify row at a share of the prompt's prefill (a merge on the real model then drafted
        // nothing). Three steps of one request time two intervals; with the first one fused,
        // one. A request's first proposal without a fused prompt (the loop decoded plainly
        // before it) is timed: in a request that drafts on one step only, it is the only one.
        let steps = Arc::new(Mutex::new(Vec::new()));
        let mut m = MergedProposer::new(vec![chain(&[1, 2])])
            .unwrap()
            .with_costs(StepRows(steps.clone()));
        let cfg = SamplingConfig::greedy();
        let mut d = Draft::default();
        let mut want = 0;
        for fused in [3, 0, 3] {
            m.begin(&CTX).unwrap();
            for i in 0..3 {
                let req =
                    ProposeRequest::new(&CTX, &cfg, 2).fused_prompt(if i == 0 { fused } else { 0 });
                m.propose(&req, &mut d).unwrap();
                m.observe(2, &[1, 2, 3]).unwrap();
            }
            want += if fused > 0 { 1 } else { 2 };
            assert_eq!(steps.lock().unwrap().len(), want, "fused {fused}");
        }
    }

    #[test]
    fn plain_steps_are_timed_as_steps_of_one_row() {
        // A request that drafts on one step only (a probe between plain steps) still teaches
        // the merge a step time: each plain step after the request's first, from one observe
        // to the next, as one verify row; the proposal steps as their rows.
        let rows = Arc::new(Mutex::new(Vec::new()));
        let mut m = MergedProposer::new(vec![chain(&[1, 2])])
            .unwrap()
            .with_costs(StepRows(rows.clone()));
        let cfg = SamplingConfig::greedy();
        let mut d = Draft::default();
        for _ in 0..2 {
            m.begin(&CTX).unwrap();
            for step in 0..4 {
                if step == 2 {
                    m.propose(&ProposeRequest::new(&CTX, &cfg, 2), &mut d)
                        .unwrap();
                    m.observe(2, &[1, 2, 3]).unwrap();
                } else {
                    m.observe(0, &[5]).unwrap();
                }
            }
            m.finish(&CTX);
        }
        // Per request: plain steps 1 and 3 (step 0 follows the prompt, which a fused prefill
        // may feed; the proposal step's rest is timed only when the next step proposes too).
        assert_eq!(*rows.lock().unwrap(), [1, 1, 1, 1]);
        // The old rule times nothing.
        let mut r = reach(vec![chain(&[1, 2])]).unwrap();
        r.begin(&CTX).unwrap();
        r.observe(0, &[5]).unwrap();
        r.observe(0, &[5]).unwrap();
        assert!(r.ledger.step_time().is_none());
    }

    #[test]
    fn cost_aware_chains_stop_where_rows_stop_paying() {
        // A is right for two tokens, then wrong.
        let truth = [1, 2, 3, 4, 5];
        let mut m = costed(vec![chain(&[1, 2, 9, 9, 9])], 0.004, None);
        let cfg = SamplingConfig::greedy();
        let mut d = Draft::default();
        for i in 0..80 {
            let req = ProposeRequest::new(&CTX, &cfg, 3 + i % 3);
            m.propose(&req, &mut d).unwrap();
            let accepted = own_accepted(&d, &truth, truth.len() - 1);
            m.observe(accepted, &truth[..accepted + 1]).unwrap();
        }
        assert_eq!(d.tokens, [1, 2]);
    }

    #[test]
    fn a_member_whose_chain_displaces_a_better_one_is_dropped_from_chain_steps() {
        // A's one-token chain is right; B (costly) proposes a longer wrong chain, which wins
        // the chain at the prior's planning rates (expected length 1.50 against 0.64): its gain
        // on the chosen chain is -1 (a candidate-level count would say 0), and it is dropped.
        let truth = [1, 2, 3];
        let mut m = costed(vec![chain(&[1]), chain(&[5, 6, 7, 8])], 0.0, Some(1));
        let cfg = SamplingConfig::greedy();
        let mut d = Draft::default();
        let mut drafts = Vec::new();
        for i in 0..12 {
            let req = ProposeRequest::new(&CTX, &cfg, 4 - i % 2);
            m.propose(&req, &mut d).unwrap();
            drafts.push((d.tokens.clone(), m.was_asked(1)));
            let accepted = own_accepted(&d, &truth, truth.len() - 1);
            m.observe(accepted, &truth[..accepted + 1]).unwrap();
        }
        assert_eq!(drafts[0].0, [5, 6, 7, 8]);
        assert!(m.marginal_gain(1, Some(0.64)) < 0.0);
        // The cost-aware cut has a step time from the second step on, and B's chain is gone
        // from the second or third.
        assert!(drafts[2..].iter().all(|(t, _)| t == &[1]), "{drafts:?}");
        assert!(
            drafts[1..].iter().filter(|(_, b)| *b).count() <= 2,
            "{drafts:?}"
        );
    }

    /// 200 chain steps of `m` (draft bounds 1 and 2 alternating, so that the row cost is seen)
    /// against a target whose next token is 1 on `right_per_mille` of the steps, by a fixed
    /// pseudo-random draw (an alternation would line up with the probe schedule, and every
    /// probe would land on a right or on a wrong step); `each(step, m, draft)` sees each
    /// proposal before it is observed.
    fn against_draw(
        m: &mut MergedProposer,
        right_per_mille: u64,
        mut each: impl FnMut(usize, &MergedProposer, &Draft),
    ) {
        let cfg = SamplingConfig::greedy();
        let mut d = Draft::default();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for i in 0..200 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let right = x % 1000 < right_per_mille;
            let truth: &[u32] = if right { &[1, 2, 3] } else { &[4, 5, 6] };
            let req = ProposeRequest::new(&CTX, &cfg, 1 + (i / 2) % 2);
            m.propose(&req, &mut d).unwrap();
            each(i, m, &d);
            let accepted = own_accepted(&d, truth, truth.len() - 1);
            m.observe(accepted, &truth[..accepted + 1]).unwrap();
        }
    }

    /// Step seconds by verify rows from a table (ms; the last entry for more rows), members
    /// free.
    struct TableCosts(&'static [f64]);

    impl super::super::MergeCosts for TableCosts {
        fn member_secs(&self, _: usize, _: usize, _: std::time::Duration) -> f64 {
            0.0
        }
        fn step_secs(&self, rows: usize, _: std::time::Duration) -> f64 {
            self.0[(rows - 1).min(self.0.len() - 1)] / 1000.0
        }
    }

    /// Drafts the next three tokens of the sequence `100, 101, ...` (the context's length is
    /// the position) on 55 % of the positions, by a fixed hash, and `[7, 7, 7]` on the others.
    struct RightAtSomePositions;

    impl Proposer for RightAtSomePositions {
        fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
            draft.clear();
            let p = req.context.len() as u32;
            let right = p.wrapping_mul(2_654_435_761) % 1000 < 550;
            let next = |j: u32| if right { 100 + p + j } else { 7 };
            draft.tokens.extend((0..3).map(next).take(req.max_draft));
            Ok(())
        }
    }

    /// The lengths of the drafts written on the steps of bound 3 (after the first 40) by a
    /// merge of [`RightAtSomePositions`] decoding the sequence `100, 101, ...` greedily over
    /// 200 steps (bounds 3 down to 0 in turn: the first four steps, drafting the full bound
    /// while the step is not yet timed, time every row count), under the step costs `ms`.
    fn three_token_drafts(ms: &'static [f64]) -> Vec<usize> {
        let mut m = MergedProposer::new(vec![Box::new(RightAtSomePositions)])
            .unwrap()
            .with_costs(TableCosts(ms));
        let cfg = SamplingConfig::greedy();
        let (mut d, mut context, mut lens) = (Draft::default(), vec![100u32], Vec::new());
        for i in 0..200 {
            m.propose(&ProposeRequest::new(&context, &cfg, 3 - i % 4), &mut d)
                .unwrap();
            if i >= 40 && i % 4 == 0 {
                lens.push(d.len());
            }
            let p = context.len() as u32;
            let accepted = d
                .tokens
                .iter()
                .zip(p..)
                .take_while(|&(&t, q)| t == 100 + q)
                .count();
            let emitted: Vec<u32> = (p..=p + accepted as u32).map(|q| 100 + q).collect();
            m.observe(accepted, &emitted).unwrap();
            context.extend(&emitted);
        }
        lens
    }

    #[test]
    fn a_draft_is_priced_at_its_row_count_even_where_more_rows_cost_less() {
        // 4 verify rows cost less than 3 (a CPU's matrix products in tiles of 4 rows). The
        // three-token draft, right on 55 % of the steps, gives about 2.7 tokens in 24 ms
        // (0.11 per ms) against 1 in 10 ms: it pays. At 30 ms (4 rows priced as 3) it would
        // not (0.09 per ms), nor would one or two of its tokens at 20 or 30 ms.
        let tiled = three_token_drafts(&[10.0, 20.0, 30.0, 24.0, 40.0]);
        assert!(tiled.iter().all(|&n| n == 3), "{tiled:?}");
        // Control: 4 rows at 30 ms, the draft is cut.
        let flat = three_token_drafts(&[10.0, 20.0, 30.0, 30.0, 40.0]);
        assert!(flat.iter().all(|&n| n == 0), "{flat:?}");
    }

    /// [`against_draw`] for a merge of an empty member and `[1, 9]` (member 1: 2 ms + 1 ms per
    /// token), rows costing `per_row` each on top of 10 ms. Returns the number of steps at
    /// which member 1 was asked.
    fn half_right_member(per_row: f64, right_per_mille: u64) -> usize {
        let mut m = costed(vec![chain(&[]), chain(&[1, 9])], per_row, Some(1));
        let mut asked = 0;
        against_draw(&mut m, right_per_mille, |_, m, d| {
            if m.was_asked(1) {
                asked += 1;
            } else {
                assert!(d.is_empty(), "an unasked member has no nodes");
            }
        });
        asked
    }

    #[test]
    fn a_member_whose_tokens_do_not_pay_for_its_rows_is_not_asked() {
        // Half a token per step for 3.7 ms: with 8 ms rows, 1.5 tokens in 26 + 3.7 ms (50
        // tokens/s) against 1 in 18 ms (56/s) does not pay, though the call alone would
        // (0.5 token against 3.7 / 18 = 0.2); with free rows it pays (109/s against 100/s).
        let dear = half_right_member(0.008, 500);
        assert!(dear <= 25, "asked {dear} of 200 steps");
        // With free rows, right on 3 steps of 4: 1.75 tokens in 13.7 ms (128/s) against 100/s.
        // (Right on half the steps it would pay by 9 %, within the noise of a gain learned
        // from 50/50 draws: the rule then sits at its threshold.)
        let free = half_right_member(0.0, 750);
        assert!(free >= 180, "asked {free} of 200 steps");
    }

    /// [`against_draw`], right on 3 steps of 4, for a merge of an empty member and `[1, 9]`
    /// (member 1: 2 ms + 1 ms per token) under `costs`. Returns the steps at which member 1
    /// was asked and those, after the first 8, at which its token was kept.
    fn sunk_cost_member(costs: super::super::FixedMergeCosts) -> (usize, usize) {
        let mut m = MergedProposer::new(vec![chain(&[]), chain(&[1, 9])])
            .unwrap()
            .with_costs(costs.with_member(1, 0.002, 0.001).unwrap());
        let (mut asked, mut kept) = (0, 0);
        against_draw(&mut m, 750, |i, m, d| {
            asked += usize::from(m.was_asked(1));
            // The first steps learn the curve (flat while one row count was timed).
            kept += usize::from(i >= 8 && !d.is_empty());
        });
        (asked, kept)
    }

    #[test]
    fn a_members_spent_time_does_not_make_its_own_nodes_pay() {
        // Each verify row costs a whole step (10 ms, none shared: llama.cpp's CPU verify of
        // Gemma 3 270M is about that), so a node right on 3 steps of 4 gives 1.75 tokens in
        // 20 ms against 1 in 10 ms: it never pays. The member's 3-4 ms are spent before the cut
        // whatever it keeps; counted in both sides (1.75 / 24 ms > 1 / 14 ms) they kept it.
        let (asked, kept) =
            sunk_cost_member(super::super::FixedMergeCosts::new(0.0, 0.010).unwrap());
        assert!(asked >= 3, "asked {asked} times");
        assert_eq!(kept, 0, "kept on {kept} of {asked} asked steps");
        // Control: rows of 1 ms on a 10 ms step, where the node pays (1.75 in 12 ms against 1
        // in 11 ms): kept on most steps.
        let (asked, kept) =
            sunk_cost_member(super::super::FixedMergeCosts::new(0.010, 0.001).unwrap());
        assert!((150..=asked).contains(&kept), "kept {kept}, asked {asked}");
    }

    #[test]
    fn a_costly_member_is_asked_only_for_the_depth_its_nodes_pay_for() {
        // B (2 ms + 1 ms per token) is right for two tokens and then wrong; A has nothing.
        // Past depth 2 its reach falls to about 0.1, below what a token of its time costs
        // (1 ms against a 10 ms step): it is asked for 2 or 3 tokens, not the bound of 6.
        let truth = [1, 2, 3, 4, 5, 6, 7];
        let member = || chain(&[1, 2, 9, 9, 9, 9]);
        let mut m = costed(vec![chain(&[]), member()], 0.0005, Some(1));
        let cfg = SamplingConfig::greedy();
        let mut d = Draft::default();
        let mut drafted = Vec::new();
        for i in 0..60 {
            let req = ProposeRequest::new(&CTX, &cfg, 5 + i % 2);
            m.propose(&req, &mut d).unwrap();
            assert!(m.was_asked(1));
            drafted.push(m.sub_drafts[1].len());
            let accepted = own_accepted(&d, &truth, truth.len() - 1);
            m.observe(accepted, &truth[..accepted + 1]).unwrap();
        }
        assert_eq!(drafted[0], 5, "untimed: the full bound");
        assert!(
            drafted[30..].iter().all(|&n| (2..=3).contains(&n)),
            "{drafted:?}"
        );
        assert_eq!(d.tokens, [1, 2]);
        // The old rule asks every member for the full bound.
        let mut r = reach(vec![chain(&[]), member()]).unwrap();
        for i in 0..20 {
            let req = ProposeRequest::new(&CTX, &cfg, 5 + i % 2);
            r.propose(&req, &mut d).unwrap();
            assert_eq!(r.sub_drafts[1].len(), 5 + i % 2);
            let accepted = own_accepted(&d, &truth, truth.len() - 1);
            r.observe(accepted, &truth[..accepted + 1]).unwrap();
        }
    }

    #[test]
    fn cost_aware_choices_are_deterministic_with_fixed_costs() {
        let run = || {
            let subs = vec![chain(&[1, 2, 3]), chain(&[1, 5]), chain(&[7, 8, 9])];
            let mut m = costed(subs, 0.001, Some(2));
            let truth = [1, 2, 5, 6];
            (0..50)
                .map(|i| step_against(&mut m, &truth, 3 + i % 5))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn proposer_errors_propagate() {
        let log = Arc::new(Mutex::new(Log::default()));
        let failing: Box<dyn Proposer + Send> = Box::new(Fixed {
            tokens: vec![1],
            parents: vec![],
            row_k: 0,
            fail: true,
            log,
        });
        let mut m = reach(vec![chain(&[1]), failing]).unwrap();
        let cfg = SamplingConfig::greedy();
        let req = ProposeRequest::new(&CTX, &cfg, 2);
        let mut d = Draft::default();
        let e = m.propose(&req, &mut d).unwrap_err();
        assert_eq!(e.to_string(), "proposer error: fixed failed");
        // A malformed tree names its proposer.
        let (bad, _) = fixed(&[1, 2], &[0, 2]);
        let mut m = reach(vec![chain(&[1]), bad]).unwrap();
        let e = m.propose_tree(&req, &mut d).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::InvalidProposal {
                    fault: ProposalFault::Tree(TreeFault::ParentNotBefore { node: 1, parent: 2 }),
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("Fixed"), "{e}");
        let _ = DraftBlock::chain(&[]);
    }

    /// A draft of up to 12 nodes with random parents (any earlier row) and tokens below 4:
    /// duplicate siblings and any depth allowed.
    fn any_tree() -> impl proptest::strategy::Strategy<Value = (Vec<u32>, Vec<u32>)> {
        use proptest::prelude::*;
        proptest::collection::vec((any::<u32>(), 0u32..4), 0..12).prop_map(|v| {
            let parents = v
                .iter()
                .enumerate()
                .map(|(j, &(r, _))| r % (j as u32 + 1))
                .collect();
            (parents, v.iter().map(|&(_, t)| t).collect())
        })
    }

    proptest::proptest! {
        #[test]
        fn merged_trees_are_valid_and_hold_only_proposed_paths(
            subs in proptest::collection::vec(any_tree(), 1..4),
            depth in 0usize..5,
            nodes in 0usize..20,
            branch in proptest::prop_oneof![1usize..4, proptest::strategy::Just(usize::MAX)],
        ) {
            let boxed = subs
                .iter()
                .map(|(parents, tokens)| fixed(tokens, parents).0)
                .collect();
            let mut m = reach(boxed).unwrap();
            let d = tree(&mut m, depth, nodes, branch);
            valid(&d, depth, nodes, branch);
            // Every candidate path within the depth, over all proposers.
            let mut all = std::collections::BTreeSet::new();
            for (parents, tokens) in &subs {
                let sub = Draft { tokens: tokens.clone(), parents: parents.clone(), ..Draft::default() };
                for p in paths(&sub) {
                    if p.len() <= depth {
                        all.insert(p);
                    }
                }
            }
            let got = paths(&d);
            for p in &got {
                proptest::prop_assert!(all.contains(p), "{p:?} was proposed by nobody");
            }
            // Distinct paths: a prefix tree.
            let distinct: std::collections::BTreeSet<_> = got.iter().collect();
            proptest::prop_assert_eq!(distinct.len(), got.len());
            if branch == usize::MAX {
                // At the prior the score falls with depth only: the shallowest candidates
                // fill the budget.
                proptest::prop_assert_eq!(got.len(), nodes.min(all.len()));
                if let Some(deepest) = got.iter().map(Vec::len).max() {
                    for p in &all {
                        proptest::prop_assert!(p.len() >= deepest || distinct.contains(p));
                    }
                }
            }
            // Siblings best first: at the prior, in order of depth; all nodes in topological
            // order (checked by `valid`).
            let mut chain_req = Draft::default();
            let cfg = SamplingConfig::greedy();
            let req = ProposeRequest::new(&CTX, &cfg, depth);
            m.propose(&req, &mut chain_req).unwrap();
            proptest::prop_assert!(chain_req.parents.is_empty() && chain_req.len() <= depth);
        }
    }
}
