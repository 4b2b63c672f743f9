//! The command line of `speculate`.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use speculative::decode::{AdaptiveConfig, DraftLength};

/// `--proposer`.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum ProposerKind {
    /// n-gram match against the prompt and the generated text.
    PromptLookup,
    /// Suffix tree over the sequence and earlier generations (SuffixDecoding).
    Suffix,
    /// The first `--exit-layers` layers of the target as a draft model (LayerSkip-style).
    EarlyExit,
    /// The target itself as the draft model (every draft is accepted in greedy mode).
    SameModel,
    /// Token Recycling: the target's own top candidates from earlier verify rows, drafted along
    /// a tree template (load a warmed table with --recycling-table).
    Recycling,
    /// Prompt lookup, suffix and token recycling merged into one tree per step.
    Merged,
    /// The EAGLE draft head on the target's hidden states (--draft-head; fast backend).
    DraftHead,
    /// The draft head, prompt lookup and suffix merged into one tree per step.
    HeadMerged,
    /// The GGUF of --draft-model as the draft model, on our fast forward: the same tokenizer
    /// as the target -> token drafts (`DraftModelProposer`); another tokenizer ->
    /// `CrossVocabProposer` (re-tokenised drafts for greedy runs, TLI for sampled ones).
    /// The default proposer when --draft-model is given.
    DraftModel,
    /// The --draft-model draft, prompt lookup and suffix merged into one tree per step.
    DraftMerged,
    /// No speculation.
    None,
}

/// `--format`.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum Format {
    /// 8-bit weights and activations (fast, approximate).
    Q8,
    /// Weights dequantised to f32 (the exact model of the file).
    F32,
}

/// `--backend` / `--engine`.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum Backend {
    /// Our multi-row, batch-invariant int8 / f32 forward (`speculative_candle::fast`).
    Fast,
    /// The forward on candle's stock quantised matmul.
    Candle,
    /// llama.cpp through `speculative-llama` (build `speculate` with `--features llama`); the
    /// GGUF file as stored, `--format` does not apply.
    Llama,
}

/// Speculative decoding on a real GGUF model.
#[derive(Parser, Debug)]
#[command(version, about)]
pub struct Args {
    /// The prompt; `-` reads standard input.
    #[arg(long, conflicts_with = "prompt_file")]
    pub prompt: Option<String>,
    /// A file holding the prompt.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Optional system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Do not apply the chat template.
    #[arg(long)]
    pub raw: bool,
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf or $SPECULATIVE_MODEL).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Forward implementation (`--engine` is the same option).
    #[arg(long, alias = "engine", value_enum, default_value = "fast")]
    pub backend: Backend,
    /// Weight format.
    #[arg(long, value_enum, default_value = "q8")]
    pub format: Format,
    /// Threads for the fast backend's matmuls and llama.cpp (1 or 2; see the
    /// speculative-candle README).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Proposer (default: prompt-lookup, or draft-model with --draft-model).
    #[arg(long, value_enum)]
    pub proposer: Option<ProposerKind>,
    /// Any GGUF as the draft model (on the fast forward, Q8 weights, --threads threads), same
    /// tokenizer as the target or not; the run prints which mode it uses.
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// A token-recycling table written by `spec-bench warm-recycling`, for `recycling` and
    /// `merged` (default: an empty table, filled as the generation runs).
    #[arg(long)]
    pub recycling_table: Option<PathBuf>,
    /// Layers of the early-exit draft.
    #[arg(long, default_value_t = 8)]
    pub exit_layers: usize,
    /// Draft-head weights for --proposer draft-head / head-merged (default: the shipped head).
    #[arg(long)]
    pub draft_head: Option<PathBuf>,
    /// Draft length: an integer, or `adaptive` / `adaptive:MAX`. With --tree-nodes, the depth of
    /// the tree.
    #[arg(long, default_value = "4", value_parser = draft_length)]
    pub k: DraftLength,
    /// Node budget of tree drafts (0 = chains): every step verifies a token tree of at most this
    /// many nodes in one forward (the fast backend; the candle backend falls back to chains).
    #[arg(long, default_value_t = 0)]
    pub tree_nodes: usize,
    /// Branching limit of tree drafts: at most this many children per node (0 = none).
    #[arg(long, default_value_t = 0)]
    pub tree_branch: usize,
    /// Temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the random stream (default: a fresh one, printed when sampling, so that the run
    /// can be repeated).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Minimum new tokens before EOS or a stop may end the generation.
    #[arg(long, default_value_t = 0)]
    pub min_tokens: usize,
    /// Stop string (repeatable): the generation ends when the text contains it, even across
    /// tokens; the stop string itself is not printed.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Constrain the output to this JSON schema (structured output through llguidance; the
    /// generation ends where the JSON does).
    #[arg(long, conflicts_with = "grammar")]
    pub json_schema: Option<PathBuf>,
    /// Constrain the output to this Lark grammar.
    #[arg(long)]
    pub grammar: Option<PathBuf>,
    /// Under --json-schema / --grammar, do not draft the grammar-forced tokens in front of the
    /// proposer's drafts.
    #[arg(long)]
    pub no_forced_drafts: bool,
    /// Also decode plainly and print the speed-up.
    #[arg(long)]
    pub compare: bool,
    /// Do not stream the text: show a progress bar and print the text at the end.
    #[arg(long)]
    pub quiet: bool,
    /// Interactive multi-turn chat: every line of standard input is a user turn (`\` at the
    /// end of a line continues it), answered in the chat template over the whole conversation
    /// (the model's own answers included), streamed to standard output; the conversation's
    /// cache is kept across turns (prefix reuse), and each turn's reused / prefilled prompt
    /// tokens and speed go to standard error.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_file", "raw", "compare", "quiet", "json_schema", "grammar"])]
    pub chat: bool,
}

impl Args {
    /// The proposer of the run: `--proposer`, else `draft-model` with `--draft-model`, else
    /// `prompt-lookup`.
    pub fn proposer(&self) -> ProposerKind {
        match (self.proposer, &self.draft_model) {
            (Some(p), _) => p,
            (None, Some(_)) => ProposerKind::DraftModel,
            (None, None) => ProposerKind::PromptLookup,
        }
    }
}

/// Parses `--k` (checked by clap before the model loads): an integer, `adaptive` (at most 8
/// draft tokens) or `adaptive:MAX`.
///
/// # Errors
/// A message naming the value for anything else.
pub fn draft_length(s: &str) -> Result<DraftLength, String> {
    let bad = || format!("{s}: expected an integer or adaptive[:MAX]");
    if let Some(rest) = s.strip_prefix("adaptive") {
        let max_draft = match rest.strip_prefix(':') {
            Some(m) => m.parse().map_err(|_| bad())?,
            None if rest.is_empty() => 8,
            None => return Err(bad()),
        };
        return Ok(DraftLength::Adaptive(
            AdaptiveConfig::default().with_max_draft(max_draft),
        ));
    }
    Ok(DraftLength::Fixed(s.parse().map_err(|_| bad())?))
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn command_is_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn draft_lengths() {
        assert_eq!(draft_length("3").unwrap(), DraftLength::Fixed(3));
        let DraftLength::Adaptive(c) = draft_length("adaptive").unwrap() else {
            panic!("adaptive expected")
        };
        assert_eq!(c.max_draft, 8);
        let DraftLength::Adaptive(c) = draft_length("adaptive:5").unwrap() else {
            panic!("adaptive expected")
        };
        assert_eq!(c.max_draft, 5);
        for bad in ["", "x", "adaptive5", "adaptive:", "adaptive:x", "-1"] {
            assert!(draft_length(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn defaults_and_options() {
        let a = Args::try_parse_from(["speculate", "--prompt", "hi"]).unwrap();
        assert_eq!(a.backend, Backend::Fast);
        assert_eq!(a.format, Format::Q8);
        assert_eq!(a.proposer(), ProposerKind::PromptLookup);
        assert_eq!(a.k, DraftLength::Fixed(4));
        assert_eq!((a.max_tokens, a.threads, a.temperature), (128, 1, 0.0));
        let a = Args::try_parse_from([
            "speculate",
            "--engine",
            "llama",
            "--proposer",
            "head-merged",
            "--k",
            "adaptive:6",
            "--stop",
            "a",
            "--stop",
            "b",
        ])
        .unwrap();
        assert_eq!(a.backend, Backend::Llama);
        assert_eq!(a.proposer(), ProposerKind::HeadMerged);
        let d = Args::try_parse_from(["speculate", "--draft-model", "d.gguf"]).unwrap();
        assert_eq!(d.proposer(), ProposerKind::DraftModel);
        let d = [
            "speculate",
            "--draft-model",
            "d",
            "--proposer",
            "draft-merged",
        ];
        let d = Args::try_parse_from(d).unwrap();
        assert_eq!(d.proposer(), ProposerKind::DraftMerged);
        assert_eq!(a.stop, ["a", "b"]);
        let conflict = ["speculate", "--prompt", "p", "--prompt-file", "f"];
        assert!(Args::try_parse_from(conflict).is_err());
        let conflict = ["speculate", "--json-schema", "s", "--grammar", "g"];
        assert!(Args::try_parse_from(conflict).is_err());
        assert!(Args::try_parse_from(["speculate", "--k", "many"]).is_err());
        assert!(Args::try_parse_from(["speculate", "--chat"]).unwrap().chat);
        for other in ["--compare", "--raw", "--quiet"] {
            assert!(
                Args::try_parse_from(["speculate", "--chat", other]).is_err(),
                "{other}"
            );
        }
        assert!(Args::try_parse_from(["speculate", "--chat", "--prompt", "p"]).is_err());
    }
}
