//! The conformance kit (`speculative::conformance`) on the toy engines of `test_util`, and on
//! deliberately broken engines that the kit must report, by check name.
#![cfg(feature = "conformance")]

use speculative::conformance::{self, KitConfig, Outcome, Report};
use speculative::test_util::{RecurrentToy, ToyFeatureDraft, ToyModel, ToyRnn};
use speculative::{
    DraftBlock, PerSlot, PromptLookup, PromptLookupConfig, Result, Rollback, RollbackMode,
    RowStates, StateSnapshot, SuffixConfig, SuffixProposer, TargetModel, TreeTarget,
};

const PROMPTS: &[&[u32]] = &[&[1, 2, 3, 4, 5, 6, 7], &[9, 8, 9, 8, 9], &[3, 0]];

fn rnn() -> ToyRnn {
    ToyRnn::new(12, 6, 3.0, 1)
}

/// A recurrent toy with hidden states, trees of up to 8 nodes and a 64-token context.
fn rnn_target() -> ToyModel {
    rnn().target(64).with_tree(8)
}

fn markov() -> ToyModel {
    ToyModel::markov(16, 2, 2.0, 7).with_tree(6)
}

fn feature_draft() -> ToyFeatureDraft {
    ToyFeatureDraft::new(rnn(), 64).with_tree(4)
}

fn per_slot() -> PerSlot<ToyModel> {
    PerSlot::new((0..3).map(|_| rnn_target()).collect()).unwrap()
}

// Every family of the macro on the toys.
speculative::conformance_tests!(kit_rnn, rnn_target, PROMPTS);
speculative::conformance_tests!(kit_markov, markov, PROMPTS);
const C10_PROMPTS: &[&[u32]] = &[&[1, 2, 3, 4, 5, 6], &[6, 0, 6], &[3, 0]];
speculative::conformance_tests!(kit_c10, ToyModel::c10, C10_PROMPTS);
speculative::conformance_tests!(kit_feature_draft, feature_draft, PROMPTS);
speculative::conformance_tests!(batch kit_per_slot, per_slot, PROMPTS);

#[test]
fn proposers_pass() {
    let cfg = KitConfig::default();
    let pl = || PromptLookup::from_config(PromptLookupConfig::default()).unwrap();
    conformance::check_proposer(pl, PROMPTS, 12, &cfg).assert_passed();
    let sx = || SuffixProposer::new(SuffixConfig::default()).unwrap();
    conformance::check_proposer(sx, PROMPTS, 12, &cfg).assert_passed();
    let dm = || speculative::DraftModelProposer::new(rnn_target());
    let r = conformance::check_proposer(dm, PROMPTS, 12, &cfg);
    println!("{r}");
    r.assert_passed();
}

#[test]
fn lossless_with_prompt_lookup() {
    let cfg = KitConfig::builder().samples(1000).build().unwrap();
    let pl = || PromptLookup::new(1, 3).unwrap();
    let r = conformance::check_lossless_with(rnn_target, pl, PROMPTS, &cfg);
    println!("{r}");
    r.assert_passed();
    assert_eq!(r.fits().len(), 2);
}

/// A toy whose truncate keeps the sequence length it is told but not the tokens' effect: it
/// forgets only the count, so the next rows read the dropped tokens.
struct NoRollback(ToyModel, usize);

impl TargetModel for NoRollback {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn seq_len(&self) -> usize {
        self.1
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.0.forward(tokens, logits)?;
        self.1 += tokens.len();
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.1 {
            return Err(speculative::Error::model("beyond"));
        }
        if len == 0 {
            self.0.truncate(0)?;
        }
        self.1 = len;
        Ok(())
    }
}

#[test]
fn kit_reports_a_truncate_that_does_not_roll_back() {
    let r = conformance::check_target(|| NoRollback(markov(), 0), PROMPTS, &KitConfig::default());
    println!("{r}");
    assert!(!r.passed());
    assert!(r.failed("target.truncate"), "{r}");
    assert!(!r.failed("target.shape"), "{r}");
    assert!(r.to_string().contains("FAIL  target.truncate"), "{r}");
}

/// A toy whose tree forward gets the last node's row wrong.
struct WrongTreeRow(ToyModel);

impl TargetModel for WrongTreeRow {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn seq_len(&self) -> usize {
        self.0.seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.0.forward(tokens, logits)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.0.truncate(len)
    }
    fn tree(&mut self) -> Option<&mut dyn TreeTarget> {
        Some(self)
    }
}

impl TreeTarget for WrongTreeRow {
    fn max_tree_nodes(&self) -> usize {
        6
    }
    fn forward_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        self.0.tree().unwrap().forward_tree(root, block, logits)?;
        if let Some(x) = logits.last_mut() {
            *x += 0.5;
        }
        Ok(())
    }
    fn commit_tree(&mut self, path: &[u32]) -> Result<()> {
        self.0.tree().unwrap().commit_tree(path)
    }
}

#[test]
fn kit_reports_a_wrong_tree_row() {
    let r = conformance::check_tree(|| WrongTreeRow(markov()), PROMPTS, &KitConfig::default());
    println!("{r}");
    assert!(r.failed("tree.rows"), "{r}");
    assert!(!r.failed("tree.commit"), "{r}");
    let fail = r.named("tree.rows").find(|c| !c.passed()).unwrap();
    match &fail.outcome {
        Outcome::Failed { expected, .. } => assert!(expected.contains("node 5"), "{expected}"),
        o => panic!("{o:?}"),
    }
}

#[test]
fn reports_are_typed_and_readable() {
    let r: Report = conformance::check_tree(ToyModel::c10, PROMPTS, &KitConfig::default());
    assert!(r.passed());
    assert!(matches!(r.checks()[0].outcome, Outcome::Skipped { .. }));
    assert!(r.to_string().contains("skip  tree.support"));
}

/// A toy whose rows depend on the number of rows in the call (not batch invariant, far beyond
/// any tolerance): calls of several rows add 2 to token 0's logit.
struct CallSizeDependent(ToyModel);

impl TargetModel for CallSizeDependent {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn seq_len(&self) -> usize {
        self.0.seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.0.forward(tokens, logits)?;
        if tokens.len() > 1 {
            let v = self.vocab_size();
            logits.iter_mut().step_by(v).for_each(|x| *x += 2.0);
        }
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.0.truncate(len)
    }
}

#[test]
fn kit_reports_logits_that_depend_on_the_call_size() {
    let make = || CallSizeDependent(markov());
    let cfg = KitConfig::default();
    let r = conformance::check_target(make, PROMPTS, &cfg);
    assert!(r.failed("target.pieces"), "{r}");
    let r = conformance::check_invariance(make, PROMPTS, &cfg);
    assert!(r.failed("invariance.rows"), "{r}");
    assert!(r.invariance().unwrap().identical_rows < r.invariance().unwrap().rows);
    // The loop verifies multi-row calls: the first tokens no longer follow single-row sampling.
    let r = conformance::check_lossless(make, PROMPTS, &cfg);
    println!("{r}");
    assert!(r.failed("lossless.sampled"), "{r}");
    assert!(!r.failed("lossless.negative_control"), "{r}");
}

/// A toy whose logits are overwritten: `-inf` for the upper half of the vocabulary (a restricted
/// output, allowed), or NaN / a row of only `-inf` (never allowed).
struct Poisoned(ToyModel, f32, bool);

impl TargetModel for Poisoned {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn seq_len(&self) -> usize {
        self.0.seq_len()
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.0.forward(tokens, logits)?;
        let v = self.vocab_size();
        let from = if self.2 { 0 } else { v / 2 };
        for row in logits.chunks_mut(v) {
            row[from..].iter_mut().for_each(|x| *x = self.1);
        }
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.0.truncate(len)
    }
}

#[test]
fn banned_tokens_pass_but_nan_and_empty_rows_fail_the_shape_check() {
    let cfg = KitConfig::default();
    let banned = conformance::check_target(
        || Poisoned(markov(), f32::NEG_INFINITY, false),
        PROMPTS,
        &cfg,
    );
    assert!(!banned.failed("target.shape"), "{banned}");
    for (x, whole) in [
        (f32::NAN, false),
        (f32::INFINITY, false),
        (f32::NEG_INFINITY, true),
    ] {
        let r = conformance::check_target(|| Poisoned(markov(), x, whole), PROMPTS, &cfg);
        assert!(r.failed("target.shape"), "{x} {whole}: {r}");
    }
}

// ---- targets whose state cannot be truncated ----

fn recurrent_snapshot() -> RecurrentToy {
    RecurrentToy::snapshot(rnn(), 64)
}

fn recurrent_rows() -> RecurrentToy {
    RecurrentToy::row_states(rnn(), 64)
}

fn recurrent_per_slot() -> PerSlot<RecurrentToy> {
    PerSlot::new((0..3).map(|_| recurrent_rows()).collect()).unwrap()
}

// Every family on both modes of the recurrent toy (the loop checks drive them with a recurrent
// draft model of the engine itself), and the batch family on PerSlot over it.
speculative::conformance_tests!(kit_recurrent_snapshot, recurrent_snapshot, PROMPTS);
speculative::conformance_tests!(kit_recurrent_rows, recurrent_rows, PROMPTS);
speculative::conformance_tests!(batch kit_recurrent_per_slot, recurrent_per_slot, PROMPTS);

#[test]
fn the_rollback_family_runs_its_checks_on_both_modes_and_skips_others() {
    let cfg = KitConfig::default();
    for (r, mode_check) in [
        (
            conformance::check_rollback(recurrent_snapshot, PROMPTS, &cfg),
            "rollback.snapshot",
        ),
        (
            conformance::check_rollback(recurrent_rows, PROMPTS, &cfg),
            "rollback.rows",
        ),
    ] {
        r.assert_passed();
        for check in ["rollback.truncate", mode_check, "rollback.errors"] {
            assert!(
                r.named(check).any(|c| c.outcome == Outcome::Passed),
                "{check}: {r}"
            );
        }
    }
    let r = conformance::check_rollback(markov, PROMPTS, &cfg);
    assert!(matches!(
        r.named("rollback.offered").next().map(|c| &c.outcome),
        Some(Outcome::Skipped { .. })
    ));
}

/// A recurrent toy whose rollback lies: restore keeps the current state (snapshot mode), or
/// keep_rows keeps every row (row states), while the lengths say otherwise.
struct LyingRollback(RecurrentToy, usize);

impl TargetModel for LyingRollback {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn seq_len(&self) -> usize {
        self.0.seq_len() - self.1
    }
    fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()> {
        self.0.forward(tokens, logits)
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.0.prefill(tokens)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.1 = 0;
        self.0.truncate(len)
    }
    fn rollback(&mut self) -> Option<Rollback<'_>> {
        Some(match self.0.mode() {
            RollbackMode::Snapshot => Rollback::Snapshot(self),
            _ => Rollback::RowStates(self),
        })
    }
}

impl StateSnapshot for LyingRollback {
    fn save_state(&mut self) -> Result<()> {
        self.0.save_state()
    }
    fn restore_state(&mut self) -> Result<()> {
        // Claims the saved length, keeps the state.
        let before = self.0.seq_len();
        let mut probe = self.0.clone();
        probe.restore_state()?;
        self.1 += before - probe.seq_len();
        Ok(())
    }
}

impl RowStates for LyingRollback {
    fn pending_rows(&self) -> usize {
        self.0.pending_rows()
    }
    fn keep_rows(&mut self, rows: usize) -> Result<()> {
        let all = self.0.pending_rows();
        if rows > all {
            return self.0.keep_rows(rows);
        }
        self.1 += all - rows;
        self.0.keep_rows(all)
    }
}

#[test]
fn kit_reports_a_rollback_that_does_not_roll_back() {
    let cfg = KitConfig::default();
    let r = conformance::check_rollback(|| LyingRollback(recurrent_snapshot(), 0), PROMPTS, &cfg);
    assert!(r.failed("rollback.snapshot"), "{r}");
    let r = conformance::check_rollback(|| LyingRollback(recurrent_rows(), 0), PROMPTS, &cfg);
    assert!(r.failed("rollback.rows"), "{r}");
}
