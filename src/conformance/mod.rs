//! A conformance kit for engines (feature `conformance`): does an engine meet the contract that
//! the traits of [`crate::model`] document, and do this engine, a proposer and our loop together
//! decode losslessly?
//!
//! An engine author calls the kit from their own tests with a constructor of the engine and a
//! few prompts. Each family of checks returns a [`Report`]: one [`CheckResult`] per check and
//! input (the check's name, the input, expected vs got), plus measurements; the checks never
//! panic, [`Report::assert_passed`] does, with the whole report. The macro
//! [`conformance_tests!`](crate::conformance_tests) writes one `#[test]` per family:
//!
//! ```
//! // tests/conformance.rs of your engine's crate, with
//! // speculative = { version = "0.1", features = ["conformance"] } in [dev-dependencies].
//! use speculative::test_util::ToyModel; // stands for your engine here
//!
//! fn engine() -> ToyModel {
//!     ToyModel::markov(16, 2, 2.0, 7).with_tree(8) // a fresh engine, empty sequence
//! }
//! const PROMPTS: &[&[u32]] = &[&[1, 2, 3, 4, 5], &[9, 8, 7]];
//!
//! // One #[test] per family: target_model, batch_invariance, tree_target, hidden_states,
//! // target_features, lossless.
//! speculative::conformance_tests!(my_engine, engine, PROMPTS);
//! # fn main() {
//! #     // (a doc test does not run the generated #[test]s: run one family here)
//! #     speculative::conformance::check_target(engine, PROMPTS, &Default::default()).assert_passed();
//! # }
//! ```
//!
//! With a tolerance and fewer samples (an engine that is not batch invariant, a real model on
//! a CPU), and a family called directly, its report read by the test:
//!
//! ```
//! use speculative::conformance::{KitConfig, Tolerance, check_invariance};
//! use speculative::test_util::ToyModel;
//!
//! let cfg = KitConfig::builder().tolerance(Tolerance::Abs(1e-3)).samples(300).build()?;
//! let report = check_invariance(ToyModel::c10, &[vec![1u32, 2, 3, 4]], &cfg);
//! assert_eq!(report.invariance().unwrap().argmax_changes, 0);
//! report.assert_passed();
//! # Ok::<(), speculative::Error>(())
//! ```
//!
//! # Families and checks
//!
//! Every function takes `make: FnMut() -> Engine` (each call returns a fresh engine with an
//! empty sequence; engines sharing weights are cheap to make) and prompts (each at least 2
//! tokens, ids below the vocabulary, 8 tokens of room below `max_context`; otherwise
//! `kit.prompts` fails). "Equal" means within [`KitConfig`]'s [`Tolerance`] on every logit.
//!
//! - [`check_target`], [`TargetModel`](crate::TargetModel):
//!   `target.shape` (a fresh engine holds 0 tokens; forward appends `n` and gives `[n, vocab]`
//!   logits without NaN or `+inf`, `-inf` banning a token, each row with a finite logit), `target.pieces` (forward in two calls and one token per call equal one
//!   call), `target.prefill` (prefill of `n - 1` tokens, also after a forward, then forward of
//!   the last equals one call), `target.truncate` (truncate to the length is a no-op; truncate
//!   then forward equals a fresh forward, also after rejected tokens; truncate(0) restarts; for a
//!   target that cannot truncate only the no-op and the restart, see `rollback.truncate`),
//!   `target.errors` (an empty forward or prefill changes nothing; an id `>= vocab_size`, alone
//!   or after a valid id, is refused by forward and prefill; truncate beyond the length is
//!   refused; each leaves the sequence as it was, shown by the rows of the rest of the prompt),
//!   `target.max_context` (the engine holds exactly `max_context` tokens: filled to it in
//!   chunks, one more token, by forward or prefill, and a chunk crossing it are refused without
//!   change; skipped when `max_context` exceeds [`KitConfigBuilder::context_budget`]).
//! - [`check_invariance`]: batch invariance measured ([`Invariance`]): every prompt position
//!   scored in single-row calls and in calls of `k + 1` rows; check `invariance.rows` fails
//!   unless bit-identical under [`Tolerance::Exact`] and is [`Outcome::Tolerated`] with the
//!   counts otherwise (greedy speculative output may then part from plain greedy output where
//!   an argmax changed).
//! - [`check_tree`], [`TreeTarget`](crate::TreeTarget) (skipped when [`TargetModel::tree`](
//!   crate::TargetModel::tree) is `None`): `tree.rows` (each of a branching tree's node rows,
//!   and the root's, equals the chain logits of its path, `seq_len` grows by nodes + 1),
//!   `tree.commit` (after `commit_tree(path)` for a deep path, a one-node path and the empty
//!   path the length is `seq_len + 1 + path.len()` and the next forward equals a chain's),
//!   `tree.truncate` (truncate undoes an uncommitted tree), `tree.invalid` (a parent not before
//!   its node, an id outside the vocabulary, more than `max_tree_nodes` nodes, duplicate
//!   deterministic siblings are refused with [`Error::InvalidTree`],
//!   an out-of-vocab root and an overflowing tree are refused, each without change; commit
//!   without a pending tree or of a non-path is refused).
//! - [`check_hidden`], [`HiddenStates`](crate::HiddenStates) (skipped when not offered):
//!   `hidden.layout` ([`HiddenStates::feature_layout`](crate::HiddenStates::feature_layout)'s
//!   `row_width()` is `hidden_size()`: the rows hold the layers the engine claims, concatenated),
//!   `hidden.shape` (`[n, hidden_size]` finite rows after forward, prefill and tree forward),
//!   `hidden.rollback` (after rejected tokens and a truncation, the next row equals a fresh
//!   forward's; skipped for targets that cannot truncate),
//!   `hidden.rows` (a position's row does not depend on the call that computed it: one call,
//!   pieces and prefill + forward agree; a tree node's row equals its path's chain row). That a
//!   row holds the layers its layout names (by default the final hidden state before the
//!   output head) is the engine's to prove: the kit sees no weights.
//! - [`check_features`], [`TargetFeatures`](crate::TargetFeatures) of a feature-conditioned
//!   draft model (skipped when not offered), with synthetic features: `features.set` (held
//!   length and the sequence's truncation to `start + 1`), `features.errors` (start past the
//!   held length and a ragged row buffer are refused with
//!   [`Error::ShapeMismatch`] without change), `features.truncate`
//!   (truncate keeps the held features), `features.causal` (a changed feature of position `j`
//!   changes no row at positions `<= j` and changes the row at `j + 1`), `features.replace`
//!   (replacing features from `start` gives the rows of a fresh model with the new features).
//! - [`check_batch`], [`BatchTarget`](crate::BatchTarget): `batch.shape`, `batch.interleaved`
//!   (each slot's rows equal the slot run alone, with prefill and chain chunks of several
//!   slots mixed in one call, in several orders), `batch.tree` (tree chunks beside chains,
//!   commit), `batch.errors` (a call with a bad chunk, a slot out of range or listed twice,
//!   and truncate beyond a slot's length change no slot), `batch.release` (a released slot is
//!   empty and, reused, gives the rows of a fresh one).
//! - [`check_proposer`], [`Proposer`](crate::Proposer): `proposer.limits` (at most `max_draft`
//!   tokens, ids in the vocabulary, q rows `[k, q_vocab]` that are distributions with mass on
//!   the drafted token), `proposer.tree` (trees within node, depth and branch limits),
//!   `proposer.eos` (no token after an EOS id), `proposer.new_request` and `proposer.rollback`
//!   (used directly on another prompt or on a shorter context, a valid draft, or
//!   [`Error::StaleProposerState`]; a draft different from a
//!   fresh proposer's is [`Outcome::Tolerated`], fine for proposers that learn across requests).
//! - [`check_lossless`] / [`check_lossless_with`], this engine + a proposer +
//!   [`decode::Generator`](crate::decode::Generator): `lossless.greedy` (greedy output
//!   identical to plain greedy decoding, with a draft model made of the engine itself at a
//!   flatter temperature, with random drafts, with tree drafts when the engine has trees, and
//!   with your proposer), `lossless.sampled` (the first two emitted tokens of
//!   [`KitConfigBuilder::samples`] seeded generations against their exact law computed from the
//!   engine's own single-row logits: temperature 1, top-k [`KitConfigBuilder::top_k`]; see
//!   [`ALPHA`]), `lossless.negative_control` (the same test on a proposer that lies about its
//!   q must fail, or the test had no power on this engine and prompt, which fails too).
//!
//! - [`check_rollback`], a target whose state cannot be truncated ([`TargetModel::rollback`](
//!   crate::TargetModel::rollback); skipped as `rollback.offered` when it is `None`):
//!   `rollback.truncate` (`truncate(seq_len)` changes nothing, a middle truncation either works
//!   or is refused with [`Error::StateRollback`] without change, `truncate(0)` restarts);
//!   snapshot mode: `rollback.snapshot` (save, six other tokens by forward and prefill, restore
//!   equals never advanced, after a forward and after a prefill; a second restore too); row
//!   states: `rollback.rows` (after a prefill of half the prompt, a forward of `i` prompt tokens
//!   and 3 others, `keep_rows(i)` leaves the state after the first `i` rows, for every `i`, also
//!   over two forwards; `pending_rows` counts the rows since the commit point and is 0 after
//!   `keep_rows`); `rollback.errors` (restore without a snapshot or after `truncate(0)`,
//!   `keep_rows` beyond the pending rows: refused with [`Error::StateRollback`], nothing
//!   changed). The loop with such a target is checked by [`check_lossless`] like any other's.
//!
//! # What a pass proves
//!
//! The checks are tests on the prompts given, not proofs: a pass says the engine met every rule
//! above on those inputs. Use prompts of a few lengths (one near the engine's chunk or block
//! sizes) and a small `max_context` if the engine can be built with one, so the context limit
//! is tested.

mod batch;
mod features;
mod hidden;
mod invariance;
mod lossless;
mod proposer;
mod report;
mod rollback;
mod stats;
mod target;
mod tree;
mod util;

use std::fmt;

pub use batch::check_batch;
pub use features::check_features;
pub use hidden::check_hidden;
pub use invariance::check_invariance;
pub use lossless::{check_lossless, check_lossless_with};
pub use proposer::check_proposer;
pub use report::{CheckResult, Fit, Invariance, Outcome, Report};
pub use rollback::check_rollback;
pub use target::check_target;
pub use tree::check_tree;

use crate::error::{Error, Result};

/// Significance of the statistical checks: `lossless.sampled` passes when its p-value is
/// `>= ALPHA`, `lossless.negative_control` when its p-value is `< ALPHA`.
///
/// The p-value combines, by Bonferroni (twice the smaller), Pearson's chi-square over the cells
/// (pairs of first two tokens) of expected count `>= 5` and a Poisson upper tail for the pooled
/// cells of smaller expected count; one observation in a cell of probability 0 makes it 0. The
/// seeds are fixed (`0..samples`), so a run is reproducible: a correct engine fails with
/// probability about `ALPHA` over the choice of seeds, and then always on those seeds (change
/// [`KitConfigBuilder::seed`] to see whether it was chance).
pub const ALPHA: f64 = 1e-3;

/// How close two computations of the same logits must be.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Tolerance {
    /// Bit for bit: the engine claims batch invariance (a row's arithmetic does not depend on
    /// the other rows of the call). Greedy speculative output must then equal plain greedy.
    Exact,
    /// Absolute difference per logit at most this (`>= 0`, finite). Differences in greedy
    /// output are reported as [`Outcome::Tolerated`].
    Abs(f32),
}

impl fmt::Display for Tolerance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tolerance::Exact => f.write_str("bit for bit"),
            Tolerance::Abs(t) => write!(f, "{t:e}"),
        }
    }
}

/// Settings of the kit. The [`Default`] suits toy and small engines: [`Tolerance::Exact`],
/// draft length 4, 16 greedy tokens, 2000 samples, top-k 3, seed 0, context budget 4096.
#[derive(Debug, Clone, PartialEq)]
pub struct KitConfig {
    tolerance: Tolerance,
    draft_len: usize,
    greedy_tokens: usize,
    samples: usize,
    top_k: usize,
    seed: u64,
    context_budget: usize,
}

impl Default for KitConfig {
    fn default() -> Self {
        KitConfig {
            tolerance: Tolerance::Exact,
            draft_len: 4,
            greedy_tokens: 16,
            samples: 2000,
            top_k: 3,
            seed: 0,
            context_budget: 4096,
        }
    }
}

impl KitConfig {
    /// A builder starting from the default.
    pub fn builder() -> KitConfigBuilder {
        KitConfigBuilder(KitConfig::default())
    }

    /// The tolerance of logit comparisons.
    pub fn tolerance(&self) -> Tolerance {
        self.tolerance
    }

    /// Draft length `k` of the loop checks and of the invariance measurement (`k + 1` rows).
    pub fn draft_len(&self) -> usize {
        self.draft_len
    }

    /// Tokens generated per greedy identity check.
    pub fn greedy_tokens(&self) -> usize {
        self.greedy_tokens
    }

    /// Generations of the statistical check (and of its negative control).
    pub fn samples(&self) -> usize {
        self.samples
    }

    /// Top-k of the statistical check.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// First seed of the statistical check (seeds `seed .. seed + samples`).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The largest `max_context` the kit fills to test the context limit.
    pub fn context_budget(&self) -> usize {
        self.context_budget
    }
}

/// Builder of [`KitConfig`]; [`KitConfigBuilder::build`] validates.
#[derive(Debug, Clone)]
pub struct KitConfigBuilder(KitConfig);

impl KitConfigBuilder {
    /// Sets the tolerance (default [`Tolerance::Exact`]).
    pub fn tolerance(mut self, t: Tolerance) -> Self {
        self.0.tolerance = t;
        self
    }

    /// Sets the draft length `k` (default 4, `>= 1`).
    pub fn draft_len(mut self, k: usize) -> Self {
        self.0.draft_len = k;
        self
    }

    /// Sets the tokens per greedy identity run (default 16, `>= 1`).
    pub fn greedy_tokens(mut self, n: usize) -> Self {
        self.0.greedy_tokens = n;
        self
    }

    /// Sets the generations of the statistical check (default 2000, `>= 20`). Each costs a
    /// prefill of the first prompt and one or two verify forwards (and the draft model's
    /// work); a few hundred suffice to catch a wrong verifier, fewer see only gross errors.
    pub fn samples(mut self, n: usize) -> Self {
        self.0.samples = n;
        self
    }

    /// Sets the top-k of the statistical check (default 3, `2 ..= 16`): it has at most
    /// `top_k^2` cells.
    pub fn top_k(mut self, k: usize) -> Self {
        self.0.top_k = k;
        self
    }

    /// Sets the first seed of the statistical check (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.0.seed = seed;
        self
    }

    /// Sets the largest `max_context` the kit fills (default 4096 tokens).
    pub fn context_budget(mut self, n: usize) -> Self {
        self.0.context_budget = n;
        self
    }

    /// The configuration.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a negative or non-finite [`Tolerance::Abs`], a draft length
    /// or greedy token count of 0, fewer than 20 samples, a top-k outside `2 ..= 16`.
    pub fn build(self) -> Result<KitConfig> {
        let c = self.0;
        let bad = |field, value: String, reason| {
            Err(Error::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        if let Tolerance::Abs(t) = c.tolerance
            && !(t.is_finite() && t >= 0.0)
        {
            return bad("tolerance", t.to_string(), "finite and >= 0");
        }
        if c.draft_len == 0 {
            return bad("draft_len", "0".into(), ">= 1");
        }
        if c.greedy_tokens == 0 {
            return bad("greedy_tokens", "0".into(), ">= 1");
        }
        if c.samples < 20 {
            return bad("samples", c.samples.to_string(), ">= 20");
        }
        if !(2..=16).contains(&c.top_k) {
            return bad("top_k", c.top_k.to_string(), "2 ..= 16");
        }
        Ok(c)
    }
}

/// One `#[test]` per check family for an engine, in a module named `$name`.
///
/// - `conformance_tests!(name, make, prompts)` and `conformance_tests!(name, make, prompts,
///   config)`: for a [`TargetModel`](crate::TargetModel), tests `target_model`,
///   `batch_invariance`, `tree_target`, `hidden_states`, `target_features`, `lossless` and
///   `rollback` ([`check_target`], [`check_invariance`], [`check_tree`], [`check_hidden`],
///   [`check_features`], [`check_lossless`], [`check_rollback`]; families the engine does not
///   offer pass as skipped).
/// - `conformance_tests!(batch name, make, prompts)` and with `config`: for a
///   [`BatchTarget`](crate::BatchTarget), test `batch_target` ([`check_batch`]).
///
/// `make` is an expression callable with no argument that returns a fresh engine (a function
/// name or a closure), `prompts` an expression of type `&[P]` with `P: AsRef<[u32]>`, `config`
/// a [`KitConfig`]; all three are evaluated inside the generated module, which imports the
/// calling module's items (`use super::*`). Each test prints its report and panics with it
/// when a check failed ([`Report::assert_passed`]).
#[macro_export]
macro_rules! conformance_tests {
    (batch $name:ident, $make:expr, $prompts:expr $(,)?) => {
        $crate::conformance_tests!(batch $name, $make, $prompts, $crate::conformance::KitConfig::default());
    };
    (batch $name:ident, $make:expr, $prompts:expr, $cfg:expr $(,)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            #[test]
            fn batch_target() {
                let r = $crate::conformance::check_batch($make, $prompts, &$cfg);
                println!("{r}");
                r.assert_passed();
            }
        }
    };
    ($name:ident, $make:expr, $prompts:expr $(,)?) => {
        $crate::conformance_tests!($name, $make, $prompts, $crate::conformance::KitConfig::default());
    };
    ($name:ident, $make:expr, $prompts:expr, $cfg:expr $(,)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_tests!(@one target_model, check_target, $make, $prompts, $cfg);
            $crate::conformance_tests!(@one batch_invariance, check_invariance, $make, $prompts, $cfg);
            $crate::conformance_tests!(@one tree_target, check_tree, $make, $prompts, $cfg);
            $crate::conformance_tests!(@one hidden_states, check_hidden, $make, $prompts, $cfg);
            $crate::conformance_tests!(@one target_features, check_features, $make, $prompts, $cfg);
            $crate::conformance_tests!(@one lossless, check_lossless, $make, $prompts, $cfg);
            $crate::conformance_tests!(@one rollback, check_rollback, $make, $prompts, $cfg);
        }
    };
    (@one $test:ident, $check:ident, $make:expr, $prompts:expr, $cfg:expr) => {
        #[test]
        fn $test() {
            let r = $crate::conformance::$check($make, $prompts, &$cfg);
            println!("{r}");
            r.assert_passed();
        }
    };
}
