//! Prefix reuse in `spec-bench serve`: the reuse modes a load runs in, a batch target wrapper
//! that hides prefix copy, and the report of what reuse saved (prompt tokens reused and
//! prefilled per request, TTFT, throughput, speculative against plain decoding in each mode)
//! with the check that greedy outputs are the same with reuse on and off.
//!
//! A mode is a [`speculative::decode::BatchGenerator`] setting: reuse off
//! (`with_prefix_reuse(false)`: every request prefills its whole prompt), reuse on without
//! prefix copy (a request keeps what its slot's cache holds: its conversation's earlier turns,
//! or a shared system prompt the slot's previous request left), and reuse on with prefix copy
//! (also copies the longest shared prefix from another slot, [`BatchTarget::copy_prefix`], so
//! a system prompt shared by every request is prefilled once per load, not once per slot).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use speculative::{BatchRollback, BatchTarget, SlotChunk};

use crate::error::{BenchError, Result};
use crate::serve::{Cell, CellSummary, Load, ServeMode};

/// How a load's [`speculative::decode::BatchGenerator`] treats cached prefixes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ReuseMode {
    /// Prefix reuse off: every request prefills its whole prompt.
    Off,
    /// Reuse on, but the target's prefix copy hidden ([`NoPrefixCopy`]): a request reuses only
    /// what the cache of the slot it takes holds.
    NoCopy,
    /// Reuse on with prefix copy when the target offers it (the `BatchGenerator` default).
    #[default]
    On,
}

impl ReuseMode {
    /// Parses a comma-separated list of `on`, `off`, `no-copy` and `both` (= `off,on`), in
    /// the order given, duplicates dropped.
    ///
    /// # Errors
    /// [`BenchError::Invalid`] for anything else or an empty list.
    pub fn parse_list(s: &str) -> Result<Vec<Self>> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim) {
            let modes: &[ReuseMode] = match part {
                "on" => &[ReuseMode::On],
                "off" => &[ReuseMode::Off],
                "no-copy" => &[ReuseMode::NoCopy],
                "both" => &[ReuseMode::Off, ReuseMode::On],
                other => {
                    return Err(BenchError::Invalid {
                        what: "--prefix-reuse",
                        reason: format!("{other} (expected on, off, no-copy or both)"),
                    });
                }
            };
            for m in modes {
                if !out.contains(m) {
                    out.push(*m);
                }
            }
        }
        if out.is_empty() {
            return Err(BenchError::Invalid {
                what: "--prefix-reuse",
                reason: "no mode".into(),
            });
        }
        Ok(out)
    }

    /// `reuse off`, `reuse on, no copy` or `reuse on`.
    pub fn label(&self) -> &'static str {
        match self {
            ReuseMode::Off => "reuse off",
            ReuseMode::NoCopy => "reuse on, no copy",
            ReuseMode::On => "reuse on",
        }
    }

    /// The `BatchGenerator::with_prefix_reuse` setting.
    pub fn reuse(&self) -> bool {
        !matches!(self, ReuseMode::Off)
    }
}

/// A batch target with its prefix copy hidden (`can_copy_prefix` is `false`); everything else
/// is `B`'s. For measuring what [`BatchTarget::copy_prefix`] saves.
#[derive(Debug)]
pub struct NoPrefixCopy<B>(pub B);

impl<B: BatchTarget> BatchTarget for NoPrefixCopy<B> {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn max_slots(&self) -> usize {
        self.0.max_slots()
    }
    fn max_batch_tokens(&self) -> usize {
        self.0.max_batch_tokens()
    }
    fn max_tree_nodes(&self) -> usize {
        self.0.max_tree_nodes()
    }
    fn seq_len(&self, slot: usize) -> speculative::Result<usize> {
        self.0.seq_len(slot)
    }
    fn forward_batch(
        &mut self,
        chunks: &[SlotChunk<'_>],
        logits: &mut Vec<f32>,
    ) -> speculative::Result<()> {
        self.0.forward_batch(chunks, logits)
    }
    fn truncate(&mut self, slot: usize, len: usize) -> speculative::Result<()> {
        self.0.truncate(slot, len)
    }
    fn commit_tree(&mut self, slot: usize, path: &[u32]) -> speculative::Result<()> {
        self.0.commit_tree(slot, path)
    }
    fn release(&mut self, slot: usize) -> speculative::Result<()> {
        self.0.release(slot)
    }
    fn rollback(&mut self) -> Option<BatchRollback<'_>> {
        self.0.rollback()
    }
}

/// Greedy outputs of one (mode, load) with reuse on against reuse off.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReuseCheck {
    /// The mode.
    pub mode: ServeMode,
    /// The load.
    pub load: Load,
    /// The reuse-on mode compared ([`ReuseMode::On`] or [`ReuseMode::NoCopy`]).
    pub reuse: ReuseMode,
    /// Requests that ended without error in both cells.
    pub compared: usize,
    /// Of which with the same tokens.
    pub identical: usize,
}

/// For every cell with reuse on (with or without copy) whose (mode, load) also ran with reuse
/// off: how many requests' outputs are identical (request by request index, error-free
/// requests only). Empty when no reuse-off cell ran.
pub fn reuse_checks(cells: &[Cell]) -> Vec<ReuseCheck> {
    let mut out = Vec::new();
    for on in cells.iter().filter(|c| c.summary.reuse.reuse()) {
        let s = &on.summary;
        let Some(off) = cells.iter().find(|c| {
            c.summary.reuse == ReuseMode::Off
                && c.summary.mode == s.mode
                && c.summary.load == s.load
        }) else {
            continue;
        };
        let reference: BTreeMap<usize, &Vec<u32>> = off
            .run
            .records
            .iter()
            .filter(|r| r.error.is_none())
            .map(|r| (r.index, &r.tokens))
            .collect();
        let pairs: Vec<bool> = on
            .run
            .records
            .iter()
            .filter(|r| r.error.is_none())
            .filter_map(|r| reference.get(&r.index).map(|t| **t == r.tokens))
            .collect();
        out.push(ReuseCheck {
            mode: s.mode,
            load: s.load,
            reuse: s.reuse,
            compared: pairs.len(),
            identical: pairs.iter().filter(|&&x| x).count(),
        });
    }
    out
}

/// One line for the report: the identity check's totals, or why it did not run.
pub fn reuse_check_line(checks: &[ReuseCheck]) -> String {
    if checks.is_empty() {
        return "Greedy outputs with prefix reuse on against off: not checked (only one reuse mode ran; `--prefix-reuse both` checks it).".into();
    }
    let compared: usize = checks.iter().map(|c| c.compared).sum();
    let identical: usize = checks.iter().map(|c| c.identical).sum();
    let verdict = if compared == identical {
        "identical"
    } else {
        "DIFFERENT"
    };
    format!(
        "Greedy outputs with prefix reuse on against off (checked in every run, request by request, over {} (mode, load) pairs): {identical} of {compared} requests identical ({verdict}).",
        checks.len()
    )
}

/// Per cell: reuse mode, throughput, TTFT, prompt tokens per request, prefilled tokens per
/// request, the reused share, prefill rows and prefix copies.
pub fn reuse_markdown(cells: &[CellSummary]) -> String {
    let mut s = String::from(
        "| reuse | mode | load | tok/s | TTFT p50/p99 ms | prompt tok/request | prefilled tok/request | reused % | prefill rows | prefix copies (tokens) |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for c in cells {
        let n = c.requests.max(1) as f64;
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.0}/{:.0} | {:.1} | {:.1} | {:.1} | {} | {} ({}) |\n",
            c.reuse.label(),
            c.mode.label(),
            c.load.label(),
            c.tokens_per_s,
            c.ttft_p50_s * 1e3,
            c.ttft_p99_s * 1e3,
            c.prompt_tokens as f64 / n,
            c.prompt_prefilled as f64 / n,
            c.reused_share() * 100.0,
            c.prefill_rows,
            c.prefix_copies,
            c.prefix_copied_tokens,
        ));
    }
    s
}

/// Throughput of every speculative mode over plain decoding's at the same load and reuse mode
/// (the fair comparison: both sides with the same reuse), and each mode's throughput with reuse
/// on over its throughput with reuse off at the same load.
pub fn speedup_markdown(cells: &[CellSummary]) -> String {
    let tput = |m: ServeMode, l: Load, r: ReuseMode| {
        cells
            .iter()
            .find(|c| c.mode == m && c.load == l && c.reuse == r)
            .map(|c| c.tokens_per_s)
    };
    let mut keys: Vec<(Load, ReuseMode)> = Vec::new();
    let mut modes: Vec<ServeMode> = Vec::new();
    for c in cells {
        if !keys.contains(&(c.load, c.reuse)) {
            keys.push((c.load, c.reuse));
        }
        if c.mode.speculative() && !modes.contains(&c.mode) {
            modes.push(c.mode);
        }
    }
    let mut s = String::from("| load | reuse | plain tok/s |");
    for m in &modes {
        s.push_str(&format!(" {} / plain |", m.label()));
    }
    s.push_str(" plain: reuse / off |");
    for m in &modes {
        s.push_str(&format!(" {}: reuse / off |", m.label()));
    }
    s.push_str(&format!(
        "\n|---|---|---|{}\n",
        "---|".repeat(2 * modes.len() + 1)
    ));
    let x = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!(" {:.2}x |", a / b),
        _ => " - |".into(),
    };
    for &(l, r) in &keys {
        let plain = tput(ServeMode::Plain, l, r);
        let p = plain.map_or("-".into(), |v| format!("{v:.1}"));
        s.push_str(&format!("| {} | {} | {p} |", l.label(), r.label()));
        for &m in &modes {
            s.push_str(&x(tput(m, l, r), plain));
        }
        let off = |m| {
            (r != ReuseMode::Off)
                .then(|| tput(m, l, ReuseMode::Off))
                .flatten()
        };
        s.push_str(&x(plain, off(ServeMode::Plain)));
        for &m in &modes {
            s.push_str(&x(tput(m, l, r), off(m)));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_in_order_without_duplicates() {
        assert_eq!(ReuseMode::parse_list("on").unwrap(), vec![ReuseMode::On]);
        assert_eq!(
            ReuseMode::parse_list("both").unwrap(),
            vec![ReuseMode::Off, ReuseMode::On]
        );
        assert_eq!(
            ReuseMode::parse_list("off, no-copy,on,both").unwrap(),
            vec![ReuseMode::Off, ReuseMode::NoCopy, ReuseMode::On]
        );
        assert!(ReuseMode::parse_list("sometimes").is_err());
        assert!(!ReuseMode::Off.reuse() && ReuseMode::NoCopy.reuse());
    }

    #[test]
    fn the_check_line_says_whether_it_ran_and_what_it_found() {
        assert!(reuse_check_line(&[]).contains("not checked"));
        let c = |identical| ReuseCheck {
            mode: ServeMode::Plain,
            load: Load::Closed(8),
            reuse: ReuseMode::On,
            compared: 4,
            identical,
        };
        let l = reuse_check_line(&[c(4), c(4)]);
        assert!(l.contains("8 of 8 requests identical (identical)"), "{l}");
        assert!(reuse_check_line(&[c(4), c(3)]).contains("7 of 8 requests identical (DIFFERENT)"));
    }
}
