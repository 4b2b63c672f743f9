//! The `speculate` binary run as a user runs it: its exit status and the lines it prints.
//!
//! The runs on the real model (SmolLM2-135M, fetched by `scripts/fetch-model.sh`) are greedy
//! and short (16 new tokens; about a second each in the `test` profile).

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs `speculate` with `args` (on the model of `speculative_candle::default_model_path`).
fn speculate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_speculate"))
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("speculate runs")
}

fn model() -> String {
    let p: PathBuf = speculative_candle::default_model_path();
    assert!(
        p.is_file(),
        "model file {} is missing: run `scripts/fetch-model.sh` from the repository root \
         (or set SPECULATIVE_MODEL)",
        p.display()
    );
    p.display().to_string()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn empty_prompt_fails_before_loading() {
    let out = speculate(&["--prompt", "  ", "--model", "/nonexistent.gguf"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("speculate: error: the prompt is empty"));
}

#[test]
fn missing_model_is_an_error() {
    let out = speculate(&["--prompt", "hi", "--model", "/nonexistent.gguf"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("/nonexistent.gguf"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bad_option_is_a_usage_error() {
    let out = speculate(&["--k", "many"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("expected an integer or adaptive[:MAX]"));
}

/// Greedy prompt lookup on the fast backend, compared with plain decoding in the same run.
#[test]
fn greedy_compare_is_identical() {
    let m = model();
    let out = speculate(&[
        "--model",
        &m,
        "--prompt",
        "Repeat exactly: the cat sat on the mat.",
        "--max-tokens",
        "16",
        "--compare",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, text(&out.stderr));
    for line in [
        "[speculative] ",
        "[plain] ",
        "speed-up",
        "greedy outputs identical: yes",
    ] {
        assert!(stdout.contains(line), "no `{line}` in\n{stdout}");
    }
}

/// A tree draft from the shipped draft head, the stop string and `--quiet`.
#[test]
fn draft_head_tree_with_stop() {
    let m = model();
    let out = speculate(&[
        "--model",
        &m,
        "--prompt",
        "Count from one to ten in words.",
        "--proposer",
        "draft-head",
        "--tree-nodes",
        "8",
        "--max-tokens",
        "16",
        "--stop",
        "2. 2",
        "--quiet",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, text(&out.stderr));
    // The greedy answer starts "1. 1\n2. 2\n3. 3"; the text ends before the stop string.
    assert!(stdout.starts_with("1. 1\n"), "{stdout}");
    assert!(!stdout.contains("2. 2"), "stop string printed:\n{stdout}");
    assert!(stdout.contains("(stop_string)"), "{stdout}");
    assert!(stdout.contains("tree steps"), "{stdout}");
}

#[cfg(not(feature = "llama"))]
#[test]
fn llama_engine_needs_the_feature() {
    let out = speculate(&["--prompt", "hi", "--engine", "llama"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("--features llama"));
}

/// `--draft-model` with the target's own file: the same tokenizer, so token drafts
/// (`DraftModelProposer`); greedy output equal to plain decoding.
#[test]
fn draft_model_same_tokenizer() {
    let m = model();
    let out = speculate(&[
        "--model",
        &m,
        "--draft-model",
        &m,
        "--prompt",
        "Repeat exactly: the cat sat on the mat.",
        "--max-tokens",
        "16",
        "--compare",
    ]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("same tokenizer as the target"), "{stderr}");
    assert!(
        stderr.contains("mode of this run: DraftModelProposer"),
        "{stderr}"
    );
    assert!(stderr.contains("proposer DraftModel"), "{stderr}");
    assert!(stdout.contains("greedy outputs identical: yes"), "{stdout}");
    // The same model drafts: every draft is accepted.
    assert!(stdout.contains("acceptance rate 1.000"), "{stdout}");
}

#[test]
fn draft_model_proposer_needs_the_file() {
    let out = speculate(&["--prompt", "hi", "--proposer", "draft-model"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("needs --draft-model FILE"));
    let out = speculate(&["--prompt", "hi", "--draft-model", "/nonexistent.gguf"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("/nonexistent.gguf"));
}

/// Gemma 3 270M (optional: `scripts/fetch-gemma.sh`, Gemma Terms of Use) on llama.cpp, drafted
/// by SmolLM2 with its other tokenizer: the cross-vocabulary modes, greedy (re-tokenising,
/// identical to plain greedy) and sampled (TLI).
#[cfg(feature = "llama")]
#[test]
fn draft_model_other_tokenizer_on_gemma() {
    let gemma = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/gemma-3-270m-q4_k_m.gguf");
    if !gemma.is_file() {
        println!(
            "skipped: {} is absent (scripts/fetch-gemma.sh fetches it; Gemma Terms of Use)",
            gemma.display()
        );
        return;
    }
    let (g, d) = (gemma.display().to_string(), model());
    let base = [
        "--engine",
        "llama",
        "--model",
        &g,
        "--draft-model",
        &d,
        "--max-tokens",
        "24",
        "--prompt",
        "Rewrite in the past tense: The shop opens at nine. The baker sells bread.",
        "--compare",
    ];
    let out = speculate(&base);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("another tokenizer"), "{stderr}");
    assert!(stderr.contains("re-tokenising greedy mode"), "{stderr}");
    assert!(stdout.contains("greedy outputs identical: yes"), "{stdout}");
    let sampled: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--temperature", "0.7", "--seed", "3"])
        .collect();
    let out = speculate(&sampled);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("mode of this run: CrossVocabProposer, TLI"),
        "{stderr}"
    );
    assert!(
        stdout.contains("[speculative] ") && stdout.contains("acceptance rate"),
        "{stdout}"
    );
}

/// Runs `speculate` with `args`, writing `input` to its standard input.
fn speculate_stdin(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_speculate"))
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("speculate runs");
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(input.as_bytes())
        .expect("stdin written");
    child.wait_with_output().expect("speculate ends")
}

/// `(prompt tokens, reused, prefilled)` of the `[turn n]` line of `stderr`.
fn turn_line(stderr: &str, n: usize) -> (usize, usize, usize) {
    let line = stderr
        .lines()
        .find(|l| l.starts_with(&format!("[turn {n}] prompt ")))
        .unwrap_or_else(|| panic!("no [turn {n}] line in\n{stderr}"));
    let num = |after: &str, before: &str| -> usize {
        let rest = &line[line.find(after).expect(after) + after.len()..];
        rest[..rest.find(before).expect(before)]
            .trim()
            .parse()
            .unwrap()
    };
    (
        num("prompt ", " tokens:"),
        num("tokens: ", " reused"),
        num("reused, ", " prefilled"),
    )
}

/// Two chat turns on piped standard input (one line each, a blank line between them skipped):
/// two streamed answers, and turn 2 reuses at least turn 1's whole prompt from the cache.
#[test]
fn chat_keeps_the_conversation_cache_across_turns() {
    let m = model();
    let out = speculate_stdin(
        &[
            "--model",
            &m,
            "--chat",
            "--system",
            "You are brief.",
            "--proposer",
            "suffix",
            "--max-tokens",
            "12",
        ],
        "Name three colours.\n\nNow name three animals.\n",
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.lines().filter(|l| !l.trim().is_empty()).count(),
        2,
        "{stdout}"
    );
    let (p1, r1, f1) = turn_line(&stderr, 1);
    let (p2, r2, f2) = turn_line(&stderr, 2);
    assert_eq!((r1, f1), (0, p1), "turn 1 starts from an empty cache");
    assert_eq!(r2 + f2, p2);
    assert!(
        r2 >= p1,
        "turn 2 reused {r2} of {p2} tokens, turn 1's prompt was {p1}\n{stderr}"
    );
    assert!(p2 > p1 + 3 && f2 < p2 - p1, "{stderr}");
    assert!(!stderr.contains("[turn 3]"));
}
