//! The programs in `examples/` run and print what they claim.
//!
//! Each example keeps its logic in `pub fn run(out: &mut dyn Write)`, which asserts the facts it
//! prints (a failed check panics, so the example exits non-zero). Two checks per example:
//!
//! 1. In process: the example's source is compiled into this test as a module, `run` is called
//!    and its report must hold the key lines listed below (a line may be given by its start). This needs nothing built beforehand,
//!    so it also runs under `cargo test --test examples`.
//! 2. As a process: the example binary that `cargo test` builds (without a target filter) sits in
//!    `target/<profile>/examples/`, next to this test's `deps/` folder. When it is there and newer
//!    than every source it is built from, it is run: it must exit 0 and print exactly the same
//!    report. A missing or out-of-date binary (a filtered `cargo test`) is reported and skipped;
//!    scripts/test.sh also runs every example with `cargo run --example`.

use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

#[allow(dead_code)] // the example's `main`
#[path = "../examples/verify_logits.rs"]
mod verify_logits;

#[allow(dead_code)]
#[path = "../examples/custom_engine.rs"]
mod custom_engine;

#[allow(dead_code)]
#[path = "../examples/batch_verify.rs"]
mod batch_verify;

#[allow(dead_code)]
#[path = "../examples/custom_proposer.rs"]
mod custom_proposer;

type Run = fn(&mut dyn Write) -> Result<(), Box<dyn Error>>;

/// Runs `run` in process and checks that the report has a line starting with each of
/// `key_lines` (most are whole lines); then runs
/// the built example binary when it is present and up to date, and checks it prints the same.
fn check(name: &str, run: Run, key_lines: &[&str]) {
    let mut buf = Vec::new();
    run(&mut buf).unwrap_or_else(|e| panic!("example {name} failed: {e}"));
    let report = String::from_utf8(buf).expect("UTF-8 report");
    for key in key_lines {
        assert!(
            report.lines().any(|l| l.starts_with(key)),
            "example {name}: line {key:?} missing from its report:\n{report}"
        );
    }
    match built_example(name) {
        Ok(bin) => {
            let out = Command::new(&bin)
                .output()
                .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
            assert!(
                out.status.success(),
                "example {name} exited with {}:\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                report,
                "example {name}: the binary's output differs from the in-process report"
            );
        }
        Err(why) => eprintln!("example {name}: process check skipped: {why}"),
    }
}

/// The example binary built by `cargo test`, if it exists and is newer than its sources.
fn built_example(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // target/<profile>/deps/examples-<hash> -> target/<profile>/examples/<name>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("no profile directory above the test executable")?;
    let bin = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let built = modified(&bin).map_err(|_| {
        format!(
            "{} not built (`cargo test` without a target filter builds it)",
            bin.display()
        )
    })?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources = vec![
        root.join("Cargo.toml"),
        root.join("examples").join(format!("{name}.rs")),
    ];
    collect_rs(&root.join("src"), &mut sources);
    for src in &sources {
        if modified(src).is_ok_and(|m| m > built) {
            return Err(format!(
                "{} is older than {} (rebuild with `cargo build --examples`)",
                bin.display(),
                src.display()
            ));
        }
    }
    Ok(bin)
}

fn modified(path: &Path) -> std::io::Result<SystemTime> {
    std::fs::metadata(path)?.modified()
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_rs(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn verify_logits_example() {
    check(
        "verify_logits",
        verify_logits::run,
        &[
            "greedy: accepted 1 of 3, emitted [on the], Rejected { index: 1 }",
            "every sampled token equals plain sampling's token at its position and seed",
            "dense q given as probabilities or as raw draft logits: identical results",
        ],
    );
}

#[test]
fn custom_engine_example() {
    check(
        "custom_engine",
        custom_engine::run,
        &[
            "text: \" saw the cat. the cat sat on the mat. the dog saw the \"",
            "finish: stop_string, 58 tokens, 15 target forwards",
            "without min_tokens: finish stop_string, 13 tokens, text \" saw the \"",
            "greedy speculative output equals plain greedy output: 58 tokens, 15 vs 58 forwards",
        ],
    );
}

#[test]
fn batch_verify_example() {
    check(
        "batch_verify",
        batch_verify::run,
        &[
            "seq 0 (greedy; seed 1, k = 3): accepted 2, emitted [6, 29, 20], Rejected { index: 2 }",
            "seq 4 (repetition penalty, bad context; seed 5): error: ",
            "each result equals verifying the sequence alone, in either batch order",
        ],
    );
}

#[test]
fn custom_proposer_example() {
    check(
        "custom_proposer",
        custom_proposer::run,
        &[
            "proposer: bigram",
            "sampled output equals plain sampling with the same seed at every draft length",
            "direct proposal after [1, 2, 3, 1, 2]: [3, 1, 2, 3]",
        ],
    );
}
