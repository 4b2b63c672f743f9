//! `speculate`: generate text with speculative decoding on a real GGUF model, on the CPU.
//!
//! ```text
//! scripts/fetch-model.sh
//! cargo run --release -p speculate -- \
//!     --prompt "Rewrite this sentence in the passive voice: the cat chased the mouse." \
//!     --proposer prompt-lookup --k 4 --compare
//! ```
//!
//! The prompt comes from `--prompt`, `--prompt-file`, or standard input (`--prompt -`). The chat
//! template stored in the GGUF is applied unless `--raw`. The text streams as it is verified;
//! then the run's figures are printed: tokens per second, acceptance rate, mean accepted length
//! and acceptance per draft position. With `--compare` the same prompt is also decoded plainly,
//! and the speed-up and (for greedy runs) whether both outputs are identical are printed.
//!
//! Engines: the candle adapter's fast forward (default) or its candle forward
//! (crate `speculative-candle`), or llama.cpp (`--engine llama`, crate `speculative-llama`,
//! built with `--features llama`).
//!
//! Structured output: `--json-schema FILE` or `--grammar FILE` (Lark) constrain every target and
//! draft row with the grammar (crate `speculative-guidance`), and the tokens the grammar forces
//! are drafted in front of the proposer's draft (`--no-forced-drafts` turns that off).
//!
//! Chat: `--chat` reads one user turn per line of standard input and answers each in the chat
//! template over the whole conversation, keeping the conversation's cache across turns (prefix
//! reuse); per-turn reused / prefilled prompt tokens and speed go to standard error:
//!
//! ```text
//! printf 'Name three colours.\nNow in French.\n' | \
//!     cargo run --release -p speculate -- --chat --proposer suffix --k adaptive
//! ```
//!
//! Modules: [`args`] (the command line), [`engines`] (the target and its draft models),
//! [`proposers`] (the `--proposer` choices), [`run`] (prompt, generation and report), [`chat`]
//! (the multi-turn chat).

mod args;
mod chat;
mod engines;
mod proposers;
mod run;

use clap::Parser;

fn main() {
    let a = args::Args::parse();
    let r = if a.chat { chat::chat(&a) } else { run::run(&a) };
    if let Err(e) = r {
        eprintln!("speculate: error: {e}");
        std::process::exit(1);
    }
}
