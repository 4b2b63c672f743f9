//! The proposers of `--proposer`, and the grammar-forced drafts in front of them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use spec_bench::draft_model::{DraftModel, TargetText};
use speculative::propose::{
    DraftModelProposer, MergedProposer, PromptLookup, RecyclingConfig, SuffixConfig,
    SuffixProposer, TokenRecycling, TreeTemplate,
};
use speculative::{NoProposer, Proposer};
use speculative_candle::default_head_path;
use speculative_candle::fast::FastWeights;
use speculative_candle::fast::head::{DraftHead, DraftHeadWeights};
use speculative_guidance::{ForcedDrafts, GrammarMask};

use crate::args::{Args, ProposerKind};
use crate::engines::{DynError, Engine};

/// The target a proposer drafts for: its engine, its logits width, and (for `--draft-model`)
/// its GGUF file and text side.
pub struct TargetSide<'a> {
    /// The loaded engine.
    pub engine: &'a Engine,
    /// Logits per position.
    pub vocab: usize,
    /// The target's GGUF file.
    pub path: &'a Path,
    /// The target's tokenizer, chat template and vocabulary bytes.
    pub text: &'a TargetText,
}

/// The proposer `a.proposer()` names for `target`, wrapped in [`ForcedDrafts`] under a grammar
/// `mask` unless `--no-forced-drafts` or `--proposer none`.
///
/// # Errors
/// A proposer's configuration or load error; `draft-head` / `head-merged` off the fast backend;
/// `draft-model` / `draft-merged` without `--draft-model`.
pub fn build(
    a: &Args,
    target: &TargetSide<'_>,
    mask: Option<&Arc<GrammarMask>>,
) -> Result<Box<dyn Proposer>, DynError> {
    let proposer = base(a, target)?;
    Ok(match mask {
        Some(m) if !a.no_forced_drafts && a.proposer() != ProposerKind::None => {
            Box::new(ForcedDrafts::new(m.clone(), proposer))
        }
        _ => proposer,
    })
}

/// The proposer of `a.proposer()` alone.
fn base(a: &Args, target: &TargetSide<'_>) -> Result<Box<dyn Proposer>, DynError> {
    let (engine, vocab) = (target.engine, target.vocab);
    let table = a.recycling_table.as_deref();
    let head = || head_proposer(a.draft_head.clone(), engine.fast_weights.as_ref());
    Ok(match a.proposer() {
        ProposerKind::PromptLookup => Box::new(PromptLookup::new(1, 4)?),
        ProposerKind::Suffix => Box::new(SuffixProposer::new(SuffixConfig::default())?),
        ProposerKind::EarlyExit => Box::new(DraftModelProposer::new((engine.draft_for)(Some(
            a.exit_layers,
        ))?)),
        ProposerKind::SameModel => Box::new(DraftModelProposer::new((engine.draft_for)(None)?)),
        ProposerKind::Recycling => Box::new(recycling(vocab, table)?),
        ProposerKind::Merged => Box::new(MergedProposer::new(vec![
            Box::new(PromptLookup::new(1, 4)?),
            Box::new(SuffixProposer::new(SuffixConfig::default())?),
            Box::new(recycling(vocab, table)?),
        ])?),
        ProposerKind::DraftHead => Box::new(head()?),
        ProposerKind::HeadMerged => Box::new(MergedProposer::new(vec![
            Box::new(head()?),
            Box::new(PromptLookup::new(1, 4)?),
            Box::new(SuffixProposer::new(SuffixConfig::default())?),
        ])?),
        ProposerKind::DraftModel => draft_model(a, target)?,
        ProposerKind::DraftMerged => Box::new(MergedProposer::new(vec![
            draft_model(a, target)?,
            Box::new(PromptLookup::new(1, 4)?),
            Box::new(SuffixProposer::new(SuffixConfig::default())?),
        ])?),
        ProposerKind::None => Box::new(NoProposer),
    })
}

/// The `--draft-model` GGUF as a draft for `target`, paired by vocabulary
/// ([`DraftModel::load`]): prints the pairing and the mode this run uses to stderr.
fn draft_model(a: &Args, target: &TargetSide<'_>) -> Result<Box<dyn Proposer + Send>, DynError> {
    let file = a
        .draft_model
        .as_deref()
        .ok_or("--proposer draft-model / draft-merged needs --draft-model FILE")?;
    let pieces = target.text.pieces(target.path)?;
    let d = DraftModel::load(file, a.threads, &pieces, target.vocab, target.text)
        .map_err(|e| format!("--draft-model {}: {e}", file.display()))?;
    eprintln!("{}", d.note());
    let mode = match (d.map().is_some(), a.temperature > 0.0) {
        (false, _) => "DraftModelProposer (token drafts of the same vocabulary)",
        (true, false) => {
            "CrossVocabProposer, re-tokenising greedy mode (SLEM: the draft's text re-encoded with the target's tokenizer)"
        }
        (true, true) => {
            "CrossVocabProposer, TLI (the draft's distribution restricted to the shared tokens, verified by speculative sampling)"
        }
    };
    eprintln!("draft model mode of this run: {mode}");
    Ok(d.proposer()?)
}

/// The draft-head proposer (weights `path`, default the shipped head) over the fast backend's
/// weights `w`.
fn head_proposer(
    path: Option<PathBuf>,
    w: Option<&Arc<FastWeights>>,
) -> Result<DraftModelProposer<DraftHead>, DynError> {
    let w = w.ok_or("--proposer draft-head needs --backend fast")?;
    let path = path.unwrap_or_else(default_head_path);
    let hw =
        DraftHeadWeights::load(&path, w.clone()).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(DraftModelProposer::new(DraftHead::new(hw)))
}

/// A token-recycling proposer over `vocab` ids, with the table of `table` when given.
/// The table keeps the `top_k` it was warmed with; its vocabulary must be the target's.
fn recycling(vocab: usize, table: Option<&Path>) -> Result<TokenRecycling, DynError> {
    let Some(path) = table else {
        return Ok(TokenRecycling::new(vocab, RecyclingConfig::default())?);
    };
    let mut file = std::io::BufReader::new(std::fs::File::open(path)?);
    let r = TokenRecycling::load(&mut file, TreeTemplate::default())?;
    if r.vocab_size() != vocab {
        return Err(format!(
            "{}: a table for {} token ids, the model has {vocab}",
            path.display(),
            r.vocab_size()
        )
        .into());
    }
    Ok(r)
}
