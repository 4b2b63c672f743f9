//! The proposers of `--proposer`, and the grammar-forced drafts in front of them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// The proposer `a.proposer` names on `engine` (a target of `vocab` ids), wrapped in
/// [`ForcedDrafts`] under a grammar `mask` unless `--no-forced-drafts` or `--proposer none`.
///
/// # Errors
/// A proposer's configuration or load error; `draft-head` / `head-merged` off the fast backend.
pub fn build(
    a: &Args,
    engine: &Engine,
    vocab: usize,
    mask: Option<&Arc<GrammarMask>>,
) -> Result<Box<dyn Proposer>, DynError> {
    let proposer = base(a, engine, vocab)?;
    Ok(match mask {
        Some(m) if !a.no_forced_drafts && a.proposer != ProposerKind::None => {
            Box::new(ForcedDrafts::new(m.clone(), proposer))
        }
        _ => proposer,
    })
}

/// The proposer of `a.proposer` alone.
fn base(a: &Args, engine: &Engine, vocab: usize) -> Result<Box<dyn Proposer>, DynError> {
    let table = a.recycling_table.as_deref();
    let head = || head_proposer(a.draft_head.clone(), engine.fast_weights.as_ref());
    Ok(match a.proposer {
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
        ProposerKind::None => Box::new(NoProposer),
    })
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
