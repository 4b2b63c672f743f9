//! The stop-string cases C16, C17 and C18 of `cases/verifier-and-loop-cases.md` (issue 26), on
//! byte-level vocabularies ([`ByteVocab`]), each with and without drafts, each streamed. The
//! property test of the whole text path is `tests/text_reference.rs`.

mod common;

use std::ops::ControlFlow;

use common::text::ByteVocab;
use speculative::decode::{
    DraftLength, FinishReason, Generation, GenerationParams, Generator, StopConditions,
};
use speculative::test_util::ToyModel;
use speculative::{Draft, ProposeRequest, Proposer, Result};

/// A greedy target that emits `script[i % len]` as its `i`-th generated token (prompts of one
/// token).
fn script_target(vocab: usize, script: &'static [u32]) -> ToyModel {
    ToyModel::deterministic(vocab, 256, move |p: &[u32]| {
        script[(p.len() - 1) % script.len()]
    })
}

/// Drafts the script exactly (every draft is accepted unless a stop cuts it).
struct Script(&'static [u32]);

impl Proposer for Script {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let done = req.context.len() - req.prompt_len;
        let next = (0..req.max_draft).map(|d| self.0[(done + d) % self.0.len()]);
        draft.tokens.extend(next);
        Ok(())
    }
}

/// `Off` for `k = 0`, else `Fixed(k)`.
fn draft(k: usize) -> DraftLength {
    if k == 0 {
        DraftLength::Off
    } else {
        DraftLength::Fixed(k)
    }
}

/// Generates from prompt `[0]` with the script as target and proposer; the generation and the
/// concatenation of its streamed text.
fn run(
    vocab: &ByteVocab,
    script: &'static [u32],
    params: &GenerationParams,
) -> (Generation, String) {
    let target = script_target(vocab.len(), script);
    let mut g = Generator::new(target, Script(script)).with_detokenizer(vocab.clone());
    let mut streamed = String::new();
    let out = g
        .generate_stream(&[0], params, |c| {
            streamed.push_str(c.text);
            ControlFlow::Continue(())
        })
        .expect("generation");
    (out, streamed)
}

/// Greedy parameters with `stop`, `min_tokens`, `max_new_tokens` and draft length `k`.
fn params(stop: StopConditions, min_tokens: usize, max_new: usize, k: usize) -> GenerationParams {
    GenerationParams::greedy(max_new)
        .to_builder()
        .min_tokens(min_tokens)
        .stop(stop)
        .draft(draft(k))
        .build()
        .unwrap()
}

/// Stop conditions of the given stop strings.
fn strings(stops: &[&str], include: bool) -> StopConditions {
    let stop = stops
        .iter()
        .fold(StopConditions::default(), |s, &t| s.with_stop_string(t));
    stop.include_stop_string(include)
}

#[test]
fn c16_a_stop_string_below_the_min_tokens_floor_never_stops() {
    static SCRIPT: [u32; 8] = [0, 1, 2, 3, 4, 5, 6, 7];
    let letters = ByteVocab::of_strs(&["a", "b", "c", "d", "e", "f", "g", "h"]);
    for stops in [&["b", "zzzz"][..], &["b"][..]] {
        for k in [0, 4] {
            let p = params(strings(stops, false), 4, 8, k);
            let (out, streamed) = run(&letters, &SCRIPT, &p);
            let what = format!("stops {stops:?}, k = {k}");
            assert_eq!(out.tokens, SCRIPT.to_vec(), "{what}");
            assert_eq!(out.finish, FinishReason::MaxTokens, "{what}");
            assert_eq!(out.text.as_deref(), Some("abcdefgh"), "{what}");
            assert_eq!(streamed, "abcdefgh", "{what}");
        }
    }
}

#[test]
fn c17_a_stop_completed_by_a_token_ending_in_a_partial_character() {
    static SCRIPT: [u32; 4] = [0, 1, 2, 3];
    let pieces = vec![
        b"a".to_vec(),
        b"b\xC3".to_vec(),
        b"\xA9z".to_vec(),
        b"y".to_vec(),
    ];
    let vocab = ByteVocab::new(pieces);
    for k in [0, 3] {
        let (out, streamed) = run(&vocab, &SCRIPT, &params(strings(&["ab"], false), 0, 8, k));
        assert_eq!(out.tokens, vec![0, 1], "k = {k}");
        assert_eq!(out.finish, FinishReason::StopString, "k = {k}");
        assert_eq!(out.text.as_deref(), Some(""), "k = {k}");
        assert_eq!(streamed, "", "k = {k}");
    }
}

#[test]
fn c18_two_stop_strings_inside_one_token_the_earliest_completion_wins() {
    static SCRIPT: [u32; 2] = [0, 1];
    let vocab = ByteVocab::of_strs(&["ab", "cd"]);
    for stops in [["abcd", "bc"], ["bc", "abcd"]] {
        for (include, want) in [(false, "a"), (true, "abc")] {
            for k in [0, 2] {
                let (out, streamed) =
                    run(&vocab, &SCRIPT, &params(strings(&stops, include), 0, 4, k));
                let what = format!("stops {stops:?}, include {include}, k = {k}");
                assert_eq!(out.tokens, vec![0, 1], "{what}");
                assert_eq!(out.finish, FinishReason::StopString, "{what}");
                assert_eq!(out.text.as_deref(), Some(want), "{what}");
                assert_eq!(streamed, want, "{what}");
            }
        }
    }
}
