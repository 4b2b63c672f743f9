//! The vocabulary bytes of real GGUF files ([`GgufVocab`]) and the byte encoder of the GGUF
//! tokenizer ([`GgufTokenizer::bytes_encoder`]), and a [`CrossVocabProposer`] on the real model.
//!
//! - SmolLM2 (CI has it): [`GgufVocab`]'s pieces equal the tokenizer's own token bytes, the
//!   specials are its 17 control tokens; the byte encoder spells exactly its input (control
//!   texts as plain text, cuts inside UTF-8 characters) and agrees with `encode` on plain text;
//!   SmolLM2 drafting for SmolLM2 through [`CrossVocabProposer`] (the map is the identity)
//!   gives plain greedy output in both modes, and accepts drafts.
//! - Gemma 3 270M (optional, `scripts/fetch-gemma.sh`; skipped with a printed reason when
//!   absent): the SentencePiece vocabulary's bytes and the SmolLM2 -> Gemma map.

mod common;

use std::sync::Arc;

use speculative::decode::{DraftLength, GenerationParams, Generator};
use speculative::propose::{
    BytesEncoder, CrossVocabMode, CrossVocabProposer, SpecialRole, VocabMap,
};
use speculative::{NoProposer, TargetModel};
use speculative_candle::{FastTarget, GgufVocab, GgufVocabKind};

fn gemma_path() -> Option<std::path::PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/gemma-3-270m-q4_k_m.gguf");
    if p.is_file() {
        Some(p)
    } else {
        println!(
            "skipped: {} is absent (scripts/fetch-gemma.sh fetches it; Gemma Terms of Use)",
            p.display()
        );
        None
    }
}

#[test]
fn smollm2_vocab_bytes_match_the_tokenizer() {
    let tok = common::tokenizer();
    let v = GgufVocab::load(common::model_path()).unwrap();
    assert_eq!(v.kind(), GgufVocabKind::ByteLevelBpe);
    assert_eq!(v.len(), tok.vocab_size());
    for id in 0..v.len() as u32 {
        if tok.is_special(id) {
            assert!(v.pieces().is_special(id));
            assert!(v.pieces().pieces[id as usize].is_empty());
        } else {
            assert_eq!(
                Some(v.pieces().pieces[id as usize].as_slice()),
                tok.token_bytes(id)
            );
        }
    }
    assert_eq!(v.pieces().special.len(), 17);
    let roles = v.pieces().roles();
    assert_eq!(
        roles,
        vec![
            (SpecialRole::Eos, 0),
            (SpecialRole::TurnStart, 1),
            (SpecialRole::TurnEnd, 2)
        ]
    );
}

#[test]
fn smollm2_bytes_encoder_spells_its_input() {
    let tok = common::tokenizer();
    let enc = tok.bytes_encoder();
    let spell = |ids: &[u32]| -> Vec<u8> {
        ids.iter()
            .flat_map(|&t| tok.token_bytes(t).unwrap().to_vec())
            .collect()
    };
    let text = "def mean(xs):\n    return sum(xs) / len(xs)  # 12345 café 🦀";
    let ids = enc.encode_bytes(text.as_bytes()).unwrap();
    assert_eq!(ids, tok.encode(text).unwrap());
    assert_eq!(spell(&ids), text.as_bytes());
    // A control token's text is plain text for the encoder, never the control token.
    let ids = enc.encode_bytes(b"<|im_end|> done").unwrap();
    assert!(ids.iter().all(|&t| !tok.is_special(t)));
    assert_eq!(spell(&ids), b"<|im_end|> done");
    // Cuts inside a character: "é" is C3 A9, the crab F0 9F A6 80.
    for cut in [&text.as_bytes()[..text.len() - 2], &"é🦀".as_bytes()[1..5]] {
        let ids = enc.encode_bytes(cut).unwrap();
        assert_eq!(spell(&ids), cut);
    }
    assert!(enc.encode_bytes(b"").unwrap().is_empty());
}

/// SmolLM2 drafting for SmolLM2 through the cross-vocabulary proposer: the map is the identity
/// on the ordinary tokens, and greedy output equals plain greedy decoding in both modes.
#[test]
fn identity_pair_through_cross_vocab_keeps_greedy_output() {
    let tok = common::tokenizer();
    let v = GgufVocab::load(common::model_path()).unwrap();
    let map = Arc::new(
        VocabMap::from_pieces(v.pieces(), v.pieces())
            .build()
            .unwrap(),
    );
    assert_eq!(map.intersection_len(), v.len() - 17 + 3);
    assert!((17..v.len() as u32).all(|t| map.to_target(t) == Some(t)));
    assert_eq!(map.special_pairs(), &[(0, 0), (1, 1), (2, 2)]);
    let enc: Arc<dyn BytesEncoder> = Arc::new(tok.bytes_encoder());
    let w = common::fast_weights();
    let params = GenerationParams::greedy(40)
        .with_stop(speculative::decode::StopConditions::default().with_eos(tok.eos_id()))
        .expect("valid stop conditions");
    let prompts = [
        "Rewrite in the past tense: The shop opens at nine. The baker sells bread.",
        "Rename `n` to `count`:\n\ndef f(n):\n    return n + 1",
    ];
    let mut target = FastTarget::new(w.clone());
    for text in prompts {
        let p = common::chat(text);
        let want = Generator::new(&mut target as &mut dyn TargetModel, NoProposer)
            .generate(&p, &params.clone().with_draft(DraftLength::Off))
            .unwrap();
        for retok in [false, true] {
            let draft = FastTarget::new(w.clone());
            let prop = if retok {
                CrossVocabProposer::retokenizing(draft, map.clone(), enc.clone(), enc.clone())
            } else {
                CrossVocabProposer::tli(draft, map.clone(), enc.clone())
            }
            .unwrap();
            let mut g = Generator::new(&mut target as &mut dyn TargetModel, prop);
            let got = g
                .generate(&p, &params.clone().with_draft(DraftLength::Fixed(4)))
                .unwrap();
            assert_eq!(
                got.tokens, want.tokens,
                "retokenizing {retok}, prompt {text:?}"
            );
            // The same model drafts: nearly every draft is accepted.
            let m = &got.metrics;
            assert!(
                m.accepted * 10 >= m.proposed * 8,
                "accepted {} of {}",
                m.accepted,
                m.proposed
            );
            let mode = g.proposer().last_mode();
            let want_mode = if retok {
                CrossVocabMode::Retokenize
            } else {
                CrossVocabMode::Tli
            };
            assert_eq!(mode, Some(want_mode));
        }
    }
}

#[test]
fn gemma_sentencepiece_bytes_and_the_smollm2_map() {
    let Some(path) = gemma_path() else { return };
    let g = GgufVocab::load(&path).unwrap();
    assert_eq!(g.kind(), GgufVocabKind::SentencePiece);
    assert_eq!(g.len(), 262_144);
    let p = g.pieces();
    // `▁` is a space, `<0x0A>` (id 248) the newline byte, `\n\n` (108) user-defined.
    assert_eq!(p.pieces[236_743], b" ");
    assert_eq!(p.pieces[248], b"\n");
    assert_eq!(p.pieces[108], b"\n\n");
    assert!(p.is_special(1) && p.is_special(105) && p.is_special(106));
    assert_eq!(
        p.roles(),
        vec![
            (SpecialRole::Bos, 2),
            (SpecialRole::Eos, 1),
            (SpecialRole::TurnStart, 105),
            (SpecialRole::TurnEnd, 106)
        ]
    );
    let s = GgufVocab::load(common::model_path()).unwrap();
    let map = VocabMap::from_pieces(s.pieces(), g.pieces())
        .build()
        .unwrap();
    assert_eq!(map.special_pairs(), &[(0, 1), (1, 105), (2, 106)]);
    assert_eq!(map.to_draft(2), None, "<bos> has no SmolLM2 counterpart");
    println!(
        "SmolLM2 -> Gemma 3: intersection {} of {} target / {} draft tokens ({} draft ids mapped)",
        map.intersection_len(),
        map.target_vocab_size(),
        map.draft_vocab_size(),
        map.mapped_draft_len()
    );
    assert!(map.intersection_len() > 10_000);
}
