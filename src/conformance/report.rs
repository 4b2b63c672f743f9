//! What the checks return: one [`CheckResult`] per check and input, gathered in a [`Report`]
//! with the measurements ([`Invariance`], [`Fit`]) taken on the way.

use std::fmt;

/// How one check came out.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// The engine did what the contract says.
    Passed,
    /// The engine broke the contract: what the check expected and what it got.
    Failed {
        /// What the contract asks for (a value, a length, `Ok`, `Err`).
        expected: String,
        /// What the engine did.
        got: String,
    },
    /// A difference the configuration allows (for example a changed greedy token on an engine
    /// that does not claim batch invariance, [`crate::conformance::Tolerance::Abs`]): reported
    /// so that the engine's author reads it, not counted as a failure.
    Tolerated {
        /// What an exact engine would give.
        expected: String,
        /// What the engine gave.
        got: String,
        /// Why it is allowed.
        why: &'static str,
    },
    /// The check did not apply (an optional ability the engine does not offer, a context too
    /// long to fill, an earlier failure the check depends on).
    Skipped {
        /// Why.
        reason: String,
    },
}

/// One check on one input.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CheckResult {
    /// The check's name, `family.check` (the list is in [`crate::conformance`]'s docs).
    pub check: &'static str,
    /// The input it ran on (which prompt, split, slot, tree or case), in words.
    pub input: String,
    /// The result.
    pub outcome: Outcome,
}

impl CheckResult {
    /// `true` unless the outcome is [`Outcome::Failed`].
    pub fn passed(&self) -> bool {
        !matches!(self.outcome, Outcome::Failed { .. })
    }
}

impl fmt::Display for CheckResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            Outcome::Passed => write!(f, "pass  {} [{}]", self.check, self.input),
            Outcome::Failed { expected, got } => write!(
                f,
                "FAIL  {} [{}]\n        expected: {expected}\n        got:      {got}",
                self.check, self.input
            ),
            Outcome::Tolerated { expected, got, why } => write!(
                f,
                "note  {} [{}] ({why})\n        exact:    {expected}\n        got:      {got}",
                self.check, self.input
            ),
            Outcome::Skipped { reason } => {
                write!(f, "skip  {} [{}]: {reason}", self.check, self.input)
            }
        }
    }
}

/// Batch invariance as a measurement: the same positions' logits from one call of
/// `k + 1` rows and from single-row calls ([`crate::conformance::check_invariance`]).
///
/// When `argmax_changes` is 0 on every prompt the engine's greedy speculative output equals its
/// plain greedy output on those prompts (the loop only compares argmaxes); each changed row is a
/// place where the two may part.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct Invariance {
    /// Rows per multi-row call (`k + 1`).
    pub chunk: usize,
    /// Rows compared (every prompt position after the first).
    pub rows: usize,
    /// Rows whose logits are bit-identical in both.
    pub identical_rows: usize,
    /// Rows whose argmax (ties to the lowest id) differs.
    pub argmax_changes: usize,
    /// The largest absolute logit difference over every compared entry.
    pub max_abs_diff: f32,
}

impl fmt::Display for Invariance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "batch invariance ({}-row calls vs single rows): {} rows, {} bit-identical, {} argmax \
             changes, largest |logit difference| {:e}",
            self.chunk, self.rows, self.identical_rows, self.argmax_changes, self.max_abs_diff
        )
    }
}

/// A goodness-of-fit test of observed first tokens against the engine's own exact
/// distribution ([`crate::conformance::check_lossless`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Fit {
    /// Which check ran it (`lossless.sampled` or `lossless.negative_control`).
    pub check: &'static str,
    /// Generations counted.
    pub samples: usize,
    /// Pearson's statistic over the cells of expected count `>= 5`.
    pub statistic: f64,
    /// Its degrees of freedom.
    pub df: usize,
    /// The test's p-value (see [`crate::conformance::ALPHA`] for how it is combined).
    pub p_value: f64,
    /// Observations in cells of probability 0 (each makes the p-value 0).
    pub impossible: u64,
}

impl fmt::Display for Fit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} samples, chi2 = {:.2} (df {}), p = {:.3e}, {} impossible",
            self.check, self.samples, self.statistic, self.df, self.p_value, self.impossible
        )
    }
}

/// Every check of one family run on one engine, with its measurements.
///
/// [`Report::assert_passed`] is the one place the kit panics: in a test, it fails with the
/// whole report (Display) when a check failed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Report {
    family: &'static str,
    subject: String,
    checks: Vec<CheckResult>,
    invariance: Option<Invariance>,
    fits: Vec<Fit>,
}

impl Report {
    pub(crate) fn new(family: &'static str, subject: &str) -> Self {
        Report {
            family,
            subject: subject.to_string(),
            ..Default::default()
        }
    }

    pub(crate) fn push(&mut self, check: &'static str, input: impl Into<String>, o: Outcome) {
        self.checks.push(CheckResult {
            check,
            input: input.into(),
            outcome: o,
        });
    }

    pub(crate) fn set_invariance(&mut self, inv: Invariance) {
        self.invariance = Some(inv);
    }

    pub(crate) fn push_fit(&mut self, fit: Fit) {
        self.fits.push(fit);
    }

    /// Appends another report's checks and measurements (its family and subject are dropped).
    pub fn merge(&mut self, other: Report) {
        self.checks.extend(other.checks);
        self.fits.extend(other.fits);
        if other.invariance.is_some() {
            self.invariance = other.invariance;
        }
    }

    /// The family (`TargetModel`, `TreeTarget`, ...).
    pub fn family(&self) -> &'static str {
        self.family
    }

    /// The engine checked (its type name).
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Every check, in the order run.
    pub fn checks(&self) -> &[CheckResult] {
        &self.checks
    }

    /// The failed checks.
    pub fn failures(&self) -> impl Iterator<Item = &CheckResult> {
        self.checks.iter().filter(|c| !c.passed())
    }

    /// The checks named `check` (every input).
    pub fn named<'a>(&'a self, check: &'a str) -> impl Iterator<Item = &'a CheckResult> + 'a {
        self.checks.iter().filter(move |c| c.check == check)
    }

    /// `true` when the check named `check` ran and failed on some input.
    pub fn failed(&self, check: &str) -> bool {
        self.named(check).any(|c| !c.passed())
    }

    /// `true` when no check failed ([`Outcome::Tolerated`] and [`Outcome::Skipped`] pass).
    pub fn passed(&self) -> bool {
        self.failures().next().is_none()
    }

    /// The batch invariance measurement, when the family took one.
    pub fn invariance(&self) -> Option<&Invariance> {
        self.invariance.as_ref()
    }

    /// The goodness-of-fit tests run.
    pub fn fits(&self) -> &[Fit] {
        &self.fits
    }

    /// Panics with the whole report when a check failed.
    ///
    /// # Panics
    /// When [`Report::passed`] is `false`; the message is the report's Display.
    #[track_caller]
    pub fn assert_passed(&self) {
        if !self.passed() {
            panic!("conformance checks failed\n{self}");
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failed = self.failures().count();
        writeln!(
            f,
            "{} conformance of {}: {} checks, {} failed",
            self.family,
            self.subject,
            self.checks.len(),
            failed
        )?;
        for c in &self.checks {
            writeln!(f, "  {c}")?;
        }
        if let Some(inv) = &self.invariance {
            writeln!(f, "  {inv}")?;
        }
        for fit in &self.fits {
            writeln!(f, "  {fit}")?;
        }
        Ok(())
    }
}
