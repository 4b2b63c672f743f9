//! `speculate --chat`: a multi-turn conversation on standard input, the way a person tries a
//! local model.
//!
//! Each line of standard input is one user turn (a line ending in `\` continues the turn on the
//! next line; blank lines are skipped; end of input ends the chat). Every turn's prompt is the
//! model's chat template over the whole conversation: the `--system` message, the earlier user
//! turns and the model's own answers, then the new turn. The answer streams to standard output
//! (one line per answer). One [`Generator`] serves the whole conversation with prefix reuse on
//! (its default), so a turn prefills only what is new since the previous answer: the per-turn
//! line on standard error gives the prompt's reused and prefilled tokens, the time to the first
//! token and the speed.

use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;
use std::time::Instant;

use speculative::decode::{Generation, Generator};
use speculative_candle::{ChatMessage, default_model_path};

use crate::args::Args;
use crate::engines::{self, DynError, Engine};
use crate::proposers::{self, TargetSide};
use crate::run::{TextDetokenizer, generation_params, print_loaded, target_text};

/// Runs the chat: loads the model once, then answers every turn read from standard input.
///
/// # Errors
/// Load, tokenizer, configuration and generation errors (a conversation that outgrows the
/// model's context is the target's context error), and errors reading standard input.
pub fn chat(a: &Args) -> Result<(), DynError> {
    let path = a.model.clone().unwrap_or_else(default_model_path);
    let t0 = Instant::now();
    let engine = engines::load(a, &path)?;
    let tok = target_text(a, &path)?;
    print_loaded(a, &path, t0);
    let params = generation_params(a, &tok, None)?;
    let side = TargetSide {
        engine: &engine,
        vocab: engine.target.vocab_size(),
        path: &path,
        text: &tok,
    };
    let proposer = proposers::build(a, &side, None)?;
    let Engine { mut target, .. } = engine;
    let mut g =
        Generator::new(&mut *target, proposer).with_detokenizer(TextDetokenizer(tok.clone()));
    let mut history: Vec<ChatMessage> = a.system.iter().map(ChatMessage::system).collect();
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    if interactive {
        eprintln!("(chat: one line per turn, `\\` at the end of a line continues it; Ctrl-D ends)");
    }
    let mut lines = stdin.lock().lines();
    let mut turn = 0;
    loop {
        if interactive {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let Some(message) = read_turn(&mut lines)? else {
            break;
        };
        turn += 1;
        history.push(ChatMessage::user(message));
        let prompt = tok.encode(&tok.chat(&history)?)?;
        let start = Instant::now();
        let mut first: Option<f64> = None;
        let mut out = std::io::stdout();
        let r = g.generate_stream(&prompt, &params, |chunk| {
            first.get_or_insert_with(|| start.elapsed().as_secs_f64());
            let _ = out.write_all(chunk.text.as_bytes());
            let _ = out.flush();
            ControlFlow::Continue(())
        })?;
        println!();
        turn_report(turn, &r, first);
        let answer = match r.text {
            Some(t) => t,
            None => tok.decode(&r.tokens, true)?,
        };
        history.push(ChatMessage::assistant(answer.trim().to_string()));
    }
    Ok(())
}

/// The next user turn: the next non-blank line, joined with the following lines while a line
/// ends in `\` (the backslash dropped, a newline kept). `None` at the end of input.
///
/// # Errors
/// Errors reading the input.
pub fn read_turn(
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
) -> std::io::Result<Option<String>> {
    let mut turn = String::new();
    for line in lines {
        let line = line?;
        match line.strip_suffix('\\') {
            Some(part) => {
                turn.push_str(part);
                turn.push('\n');
            }
            None => {
                turn.push_str(&line);
                if !turn.trim().is_empty() {
                    return Ok(Some(turn.trim().to_string()));
                }
                turn.clear();
            }
        }
    }
    Ok((!turn.trim().is_empty()).then(|| turn.trim().to_string()))
}

/// The per-turn line on standard error: the prompt's reused and prefilled tokens, TTFT, the
/// speed and the acceptance.
fn turn_report(turn: usize, r: &Generation, first_s: Option<f64>) {
    let m = &r.metrics;
    eprintln!(
        "[turn {turn}] prompt {} tokens: {} reused, {} prefilled ({:.0}% reused); TTFT {:.0} ms; {} tokens ({}) in {:.2} s: {:.1} tokens/s end to end, {:.1} decode tokens/s; acceptance rate {:.3}, mean accepted length {:.2}",
        m.prompt_tokens_reused + m.prompt_tokens_prefilled,
        m.prompt_tokens_reused,
        m.prompt_tokens_prefilled,
        m.prompt_reuse_share() * 100.0,
        first_s.unwrap_or(0.0) * 1e3,
        r.tokens.len(),
        r.finish,
        m.total_time.as_secs_f64(),
        m.tokens_per_second(),
        m.decode_tokens_per_second(),
        m.acceptance_rate(),
        m.mean_accepted_length(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turns(input: &str) -> Vec<String> {
        let mut lines = input.lines().map(|l| Ok(l.to_string()));
        let mut out = Vec::new();
        while let Some(t) = read_turn(&mut lines).unwrap() {
            out.push(t);
        }
        out
    }

    #[test]
    fn one_line_per_turn_with_continuations_and_blank_lines_skipped() {
        assert_eq!(turns("hi\n\n  \nthere\n"), ["hi", "there"]);
        assert_eq!(turns("a \\\nb\\\nc\nd"), ["a \nb\nc", "d"]);
        // A continuation at the end of input is still a turn.
        assert_eq!(turns("x\\"), ["x"]);
        assert!(turns("\n\n").is_empty());
    }
}
