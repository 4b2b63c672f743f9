//! llama.cpp's vocabulary as bytes ([`LlamaEngine::vocab_pieces`]), its tokenizer as a
//! [`BytesEncoder`] ([`LlamaEngine::bytes_encoder`]), and [`CrossVocabProposer`] drafting for a
//! [`speculative_llama::LlamaTarget`].
//!
//! - SmolLM2 (CI has it): 17 control tokens, the encoder spells exactly its input and agrees
//!   with `encode` on plain text; SmolLM2 drafting for SmolLM2 through the cross-vocabulary
//!   proposer (the map is the identity) keeps plain greedy output in both modes.
//! - Gemma 3 270M (optional, `scripts/fetch-gemma.sh`, Gemma Terms of Use; skipped with a
//!   printed reason when absent): SentencePiece bytes, its EOS set and chat template, and the
//!   real cross-vocabulary pair, SmolLM2 drafting for Gemma: plain greedy output up to a near
//!   tie (llama.cpp is not batch-invariant on Gemma's Q4_K_M file: measured, a verify row can
//!   differ from the row decoded alone).

mod common;

use std::sync::Arc;

use speculative::conformance::{self, KitConfig, Tolerance};
use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions};
use speculative::propose::{
    BytesEncoder, CrossVocabMode, CrossVocabProposer, SpecialRole, VocabMap, VocabPieces,
};
use speculative::{NoProposer, TargetModel};
use speculative_llama::{ChatTurn, LlamaConfig, LlamaEngine, ModelOptions};

fn gemma() -> Option<LlamaEngine> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/gemma-3-270m-q4_k_m.gguf");
    if !p.is_file() {
        println!(
            "skipped: {} is absent (scripts/fetch-gemma.sh fetches it; Gemma Terms of Use)",
            p.display()
        );
        return None;
    }
    Some(LlamaEngine::load(&p, &ModelOptions::default()).unwrap())
}

fn spell(p: &VocabPieces, ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&t| p.pieces[t as usize].clone())
        .collect()
}

/// The encoder's output spells its input, on plain text, control texts and cut characters.
fn check_encoder(e: &LlamaEngine, p: &VocabPieces) {
    let enc = e.bytes_encoder();
    let text = "def mean(xs):\n    return sum(xs) / len(xs)  # 12345 café 🦀";
    let ids = enc.encode_bytes(text.as_bytes()).unwrap();
    assert_eq!(spell(p, &ids), text.as_bytes());
    let ids = enc.encode_bytes(b"<end_of_turn><|im_end|> ok").unwrap();
    assert!(ids.iter().all(|&t| !p.is_special(t)));
    assert_eq!(spell(p, &ids), b"<end_of_turn><|im_end|> ok");
    for cut in [&text.as_bytes()[..text.len() - 2], &"é🦀".as_bytes()[1..5]] {
        let ids = enc.encode_bytes(cut).unwrap();
        assert_eq!(spell(p, &ids), cut);
    }
}

#[test]
fn smollm2_pieces_and_encoder() {
    let e = common::engine();
    let p = e.vocab_pieces();
    assert_eq!(p.len(), 49_152);
    assert_eq!(p.special.len(), 17);
    assert_eq!(p.special[2], (2, b"<|im_end|>".to_vec()));
    assert_eq!(p.pieces[17], b"!");
    check_encoder(e, &p);
    // Plain text: the same ids as the engine's own encoding (SmolLM2 adds no BOS).
    let text = "The cat sat on the mat, 42 times.";
    let enc = e.bytes_encoder();
    assert_eq!(
        enc.encode_bytes(text.as_bytes()).unwrap(),
        e.encode(text).unwrap()
    );
}

/// Speculative greedy output `got` against plain greedy output `want` on a target that is not
/// batch-invariant (llama.cpp on Gemma 3's Q4_K_M file: a row verified among k + 1 rows need
/// not carry the logits of the row decoded alone): equal up to a first difference, if any,
/// where the two tokens are nearly tied in plain decoding's row (both greedy decodings of the
/// model with different rounding). A loop or map bug would emit a token far from the top.
fn near_tie_at_first_difference(
    target: &LlamaEngine,
    cfg: &LlamaConfig,
    prompt: &[u32],
    want: &[u32],
    got: &[u32],
) {
    let Some(i) = (0..want.len().max(got.len())).find(|&i| want.get(i) != got.get(i)) else {
        return;
    };
    let (Some(&w), Some(&g)) = (want.get(i), got.get(i)) else {
        panic!("one output is a prefix of the other: {want:?} vs {got:?}");
    };
    let mut t = target.target(cfg).unwrap();
    let ctx: Vec<u32> = prompt.iter().chain(&want[..i]).copied().collect();
    t.prefill(&ctx[..ctx.len() - 1]).unwrap();
    let mut row = Vec::new();
    t.forward(&ctx[ctx.len() - 1..], &mut row).unwrap();
    let gap = row[w as usize] - row[g as usize];
    let above = row.iter().filter(|&&x| x > row[g as usize]).count();
    println!("first difference at {i}: plain {w}, speculative {g}, logit gap {gap:.4}");
    assert!(
        gap.abs() < 0.5 && above <= 2,
        "gap {gap}, {above} tokens above"
    );
}

/// Greedy output of `target` with the cross-vocabulary draft equals plain greedy output, both
/// modes (`exact`; else up to a near tie, see [`near_tie_at_first_difference`]); returns
/// (accepted, proposed) of the re-tokenising run of each prompt.
fn greedy_identity(
    target: &LlamaEngine,
    draft: &LlamaEngine,
    prompts: &[&str],
    new_tokens: usize,
    exact: bool,
) -> Vec<(usize, usize)> {
    let (dp, tp) = (draft.vocab_pieces(), target.vocab_pieces());
    let map = Arc::new(VocabMap::from_pieces(&dp, &tp).build().unwrap());
    let (denc, tenc): (Arc<dyn BytesEncoder>, Arc<dyn BytesEncoder>) = (
        Arc::new(draft.bytes_encoder()),
        Arc::new(target.bytes_encoder()),
    );
    let stop = target
        .eog_ids()
        .iter()
        .fold(StopConditions::default(), |s, &t| s.with_eos(t));
    let params = GenerationParams::greedy(new_tokens)
        .with_stop(stop)
        .expect("EOS ids alone are valid stop conditions");
    let cfg = LlamaConfig::default().with_context(1024);
    let mut plain = Generator::new(target.target(&cfg).unwrap(), NoProposer);
    let mut out = Vec::new();
    for text in prompts {
        let p = target
            .encode(
                &target
                    .apply_chat_template(&[ChatTurn::user(*text)], true)
                    .unwrap(),
            )
            .unwrap();
        let want = plain
            .generate(&p, &params.clone().with_draft(DraftLength::Off))
            .unwrap();
        for retok in [true, false] {
            let d = draft.target(&cfg).unwrap();
            let prop = if retok {
                CrossVocabProposer::retokenizing(d, map.clone(), denc.clone(), tenc.clone())
            } else {
                CrossVocabProposer::tli(d, map.clone(), denc.clone())
            }
            .unwrap();
            let mut g = Generator::new(target.target(&cfg).unwrap(), prop);
            let got = g
                .generate(&p, &params.clone().with_draft(DraftLength::Fixed(4)))
                .unwrap();
            if exact {
                assert_eq!(
                    got.tokens, want.tokens,
                    "retokenizing {retok}, prompt {text:?}"
                );
            } else {
                near_tie_at_first_difference(target, &cfg, &p, &want.tokens, &got.tokens);
            }
            let mode = if retok {
                CrossVocabMode::Retokenize
            } else {
                CrossVocabMode::Tli
            };
            assert_eq!(g.proposer().last_mode(), Some(mode));
            if retok {
                out.push((got.metrics.accepted, got.metrics.proposed));
            }
        }
    }
    out
}

#[test]
fn smollm2_drafting_for_itself_through_the_map_keeps_greedy_output() {
    let e = common::engine();
    let p = e.vocab_pieces();
    let map = VocabMap::from_pieces(&p, &p).build().unwrap();
    assert!((17..p.len() as u32).all(|t| map.to_target(t) == Some(t)));
    assert_eq!(map.special_pairs(), &[(0, 0), (1, 1), (2, 2)]);
    let prompts = [
        "Rewrite in the past tense: The shop opens at nine. The baker sells bread.",
        "Give me two tips for writing clear emails.",
    ];
    for (acc, prop) in greedy_identity(e, e, &prompts, 32, true) {
        // The same model drafts: nearly every draft is accepted.
        assert!(acc * 10 >= prop * 8, "accepted {acc} of {prop}");
    }
}

#[test]
fn gemma_pieces_eos_set_and_chat_template() {
    let Some(g) = gemma() else { return };
    let p = g.vocab_pieces();
    assert_eq!(p.len(), 262_144);
    assert_eq!(p.pieces[236_743], b" ");
    assert_eq!(p.pieces[248], b"\n", "<0x0A> is the newline byte");
    assert_eq!(p.pieces[108], b"\n\n");
    assert_eq!(
        p.roles(),
        vec![
            (SpecialRole::Bos, 2),
            (SpecialRole::Eos, 1),
            (SpecialRole::TurnStart, 105),
            (SpecialRole::TurnEnd, 106)
        ]
    );
    for t in [1, 106] {
        assert!(g.eog_ids().contains(&t), "{:?} lacks {t}", g.eog_ids());
    }
    let chat = g
        .apply_chat_template(&[ChatTurn::system("Be brief."), ChatTurn::user("Hi")], true)
        .unwrap();
    assert_eq!(
        chat,
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = g.encode(&chat).unwrap();
    assert_eq!(&ids[..2], &[2, 105], "<bos> then <start_of_turn>");
    check_encoder(&g, &p);
}

#[test]
fn smollm2_drafting_for_gemma_keeps_greedy_output() {
    let Some(g) = gemma() else { return };
    let prompts = ["Rewrite in the past tense: The shop opens at nine. The baker sells bread."];
    // Exact in a build without weight repacking (this repository's); see
    // `gemma_rows_are_batch_invariant_without_weight_repacking`.
    let exact = !speculative_llama::cpu_weight_repacking().unwrap();
    for (acc, prop) in greedy_identity(&g, common::engine(), &prompts, 24, exact) {
        println!("SmolLM2 -> Gemma 3, re-tokenising: accepted {acc} of {prop} draft tokens");
    }
}

/// The conformance kit's batch-invariance measurement on Gemma 3's Q4_K_M file: in a build
/// without weight repacking (`GGML_CPU_REPACK=OFF`, this repository's `.cargo/config.toml`)
/// every row of a 5-row call is bit-identical to the row decoded alone; in a build with it
/// (llama.cpp's default) the repacked Q4_K GEMM of 4-row groups rounds unlike the GEMV of single
/// rows, and rows differ (the negative control: the measurement can fail).
#[test]
fn gemma_rows_are_batch_invariant_without_weight_repacking() {
    let Some(g) = gemma() else { return };
    let text = g
        .apply_chat_template(
            &[ChatTurn::user("Rewrite in the past tense: the cat sits.")],
            true,
        )
        .unwrap();
    let prompts = vec![g.encode(&text).unwrap(), vec![2, 105, 2364, 107, 818]];
    let cfg = KitConfig::builder()
        .tolerance(Tolerance::Exact)
        .draft_len(4)
        .build()
        .unwrap();
    let make = || g.target(&LlamaConfig::default().with_context(256)).unwrap();
    let r = conformance::check_invariance(make, &prompts, &cfg);
    let m = *r.invariance().expect("measured");
    println!("{m}");
    if speculative_llama::cpu_weight_repacking().unwrap() {
        assert!(
            m.identical_rows < m.rows,
            "repacked weights, yet invariant: {m}"
        );
    } else {
        r.assert_passed();
        assert_eq!((m.identical_rows, m.argmax_changes), (m.rows, 0));
    }
}
