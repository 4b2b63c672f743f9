//! Tokenizer, chat template and streaming detokenizer built from the GGUF metadata (need
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf`; run `scripts/fetch-model.sh` first).

mod common;

use common::tokenizer;
use speculative_candle::{CandleError, ChatMessage};

const SAMPLES: &[&str] = &[
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces, trailing spaces   \n\ttabs and\r\nnewlines\n\n",
    "Café, naïve, façade, Straße, Ærøskøbing, São Paulo, Zürich",
    "Emoji: 🦀🚀👍🏽 and a family 👨‍👩‍👧‍👦",
    "中文分词测试：北京是中国的首都。日本語のテキスト。한국어 문장",
    "Mixed: x²+y²=z², ∀ε>0 ∃δ, →←, «quotes» “curly”",
    "<|im_start|>user\nHi<|im_end|>\n",
    "",
];

#[test]
fn round_trip_is_exact() {
    let tok = tokenizer();
    for s in SAMPLES {
        let ids = tok.encode(s).unwrap();
        let back = tok.decode(&ids, false).unwrap();
        assert_eq!(&back, s, "round trip of {s:?} via {ids:?}");
        // The `tokenizers` decoder agrees with ours.
        let theirs = tok.tokenizer().decode(&ids, false).unwrap();
        assert_eq!(&theirs, s);
    }
}

#[test]
fn known_encodings() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 49_152);
    assert_eq!(tok.eos_id(), 2);
    // Digits are split one by one.
    let ids = tok.encode("2024").unwrap();
    assert_eq!(ids.len(), 4, "{ids:?}");
    // Control tokens are single ids and are special.
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    let ids = tok.encode("<|im_start|>user").unwrap();
    assert_eq!(ids[0], im_start);
    assert!(tok.is_special(im_start));
    assert!(!tok.is_special(ids[1]));
    assert_eq!(tok.decode(&ids, true).unwrap(), "user");
    assert!(matches!(
        tok.decode(&[u32::MAX], false),
        Err(CandleError::TokenOutOfVocab { .. })
    ));
}

#[test]
fn chat_template_renders_chatml() {
    let tok = tokenizer();
    let text = tok
        .apply_chat_template(&[ChatMessage::user("What is the capital of France?")])
        .unwrap();
    println!("{text}");
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let text = tok
        .apply_chat_template(&[
            ChatMessage::system("Be brief."),
            ChatMessage::user("Hi"),
            ChatMessage::assistant("Hello!"),
            ChatMessage::user("Bye"),
        ])
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn stream_decoder_yields_whole_characters() {
    let tok = tokenizer();
    for s in SAMPLES {
        let ids = tok.encode(s).unwrap();
        let mut dec = tok.stream(false);
        let mut out = String::new();
        for &id in &ids {
            let piece = dec.push(id).unwrap();
            // Every piece is valid UTF-8 by type; none contains a replacement character.
            assert!(!piece.contains('\u{FFFD}'), "{piece:?} in {s:?}");
            out.push_str(&piece);
        }
        assert_eq!(dec.pending_bytes(), 0);
        out.push_str(&dec.finish());
        assert_eq!(&out, s);
    }
    // A character split across tokens: the crab emoji is 4 bytes; find its tokens.
    let ids = tok.encode("🦀").unwrap();
    println!("🦀 -> {ids:?}");
    let mut dec = tok.stream(false);
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.push(dec.push(id).unwrap());
    }
    assert_eq!(pieces.concat(), "🦀");
    if ids.len() > 1 {
        assert!(
            pieces[..ids.len() - 1].iter().all(String::is_empty),
            "{pieces:?}"
        );
    }
    // Cut in the middle: finish() flushes a replacement character.
    if ids.len() > 1 {
        let mut dec = tok.stream(false);
        assert_eq!(dec.push(ids[0]).unwrap(), "");
        assert!(dec.pending_bytes() > 0);
        assert_eq!(dec.finish(), "\u{FFFD}");
    }
    // Special tokens can be skipped.
    let ids = tok.encode("<|im_end|>ok").unwrap();
    let mut dec = tok.stream(true);
    let text: String = ids.iter().map(|&id| dec.push(id).unwrap()).collect();
    assert_eq!(text, "ok");
}

// ---------------------------------------------------------------------------------------------
// `speculative::decode::Detokenizer` (the hook for stop strings and text streaming).
// ---------------------------------------------------------------------------------------------

mod detokenizer {
    use std::sync::Arc;

    use proptest::prelude::*;
    use speculative::decode::{Detokenizer, GenerationParams, Generator};
    use speculative::{NoProposer, TargetModel};
    use speculative_candle::{
        CandleTarget, ChatMessage, GgufDetokenizer, GgufTokenizer, WeightFormat,
    };

    use super::common;

    /// Decodes `ids` as the loop does: at each token, decode the window `ids[prefix..n]` and keep
    /// the part after the decode of `ids[prefix..read]` (the text already emitted from the
    /// window), but only once the window does not end in U+FFFD (an incomplete character); then
    /// slide the window. At the end the rest is flushed. Returns the text, the emitted pieces and
    /// how many times a token left an incomplete character behind (the loop had to wait).
    fn incremental(det: &dyn Detokenizer, ids: &[u32]) -> (String, Vec<String>, usize) {
        let (mut prefix, mut read) = (0, 0);
        let (mut out, mut pieces, mut waits) = (String::new(), Vec::new(), 0);
        for n in 1..=ids.len() {
            let before = det.decode(&ids[prefix..read]).unwrap();
            let now = det.decode(&ids[prefix..n]).unwrap();
            assert!(
                now.starts_with(&before),
                "window {prefix}..{n}: {now:?} does not extend {before:?}"
            );
            if now.ends_with('\u{FFFD}') {
                waits += 1;
            } else if now.len() > before.len() {
                let piece = now[before.len()..].to_string();
                out.push_str(&piece);
                pieces.push(piece);
                (prefix, read) = (read, n);
            }
        }
        let before = det.decode(&ids[prefix..read]).unwrap();
        let now = det.decode(&ids[prefix..]).unwrap();
        out.push_str(&now[before.len()..]);
        (out, pieces, waits)
    }

    /// A long text with accented letters, CJK, Hangul, emoji (with skin tones and ZWJ
    /// sequences), mathematical symbols and control tokens.
    fn long_text() -> String {
        let mut text = String::new();
        for round in 0..4 {
            for s in super::SAMPLES {
                text.push_str(s);
                text.push_str(&format!(" [{round}] "));
            }
            text.push_str(
                "Ελληνικά και русский текст, עברית, العربية, हिन्दी, ไทย. 🇫🇷🇯🇵 🏳️‍🌈 👩🏾‍🔬 \
                 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝒽𝑒𝓁𝓁𝑜 — ½ ¾ € £ ¥ ©®™ … 「引用」『二重』【括弧】 ﾊﾝｶｸ カタカナ\n",
            );
        }
        text
    }

    fn check_incremental(det: &dyn Detokenizer, ids: &[u32], full: &str) -> usize {
        let (text, pieces, waits) = incremental(det, ids);
        assert_eq!(text, full);
        if !full.contains('\u{FFFD}') {
            for p in &pieces {
                assert!(
                    !p.contains('\u{FFFD}'),
                    "piece {p:?} has a replacement character"
                );
            }
        }
        waits
    }

    #[test]
    fn incremental_window_equals_full_decode_on_a_long_multilingual_text() {
        let tok = common::tokenizer();
        let text = long_text();
        let ids = tok.encode(&text).unwrap();
        assert!(ids.len() > 1000, "{} tokens", ids.len());
        // Control tokens are skipped by the implementation on `GgufTokenizer`...
        let full = Detokenizer::decode(tok, &ids).unwrap();
        assert_eq!(full, tok.decode(&ids, true).unwrap());
        assert_eq!(
            full,
            text.replace("<|im_start|>", "").replace("<|im_end|>", "")
        );
        let waits = check_incremental(tok, &ids, &full);
        // Multi-byte characters were split across tokens many times (emoji, CJK, ...).
        assert!(waits >= 50, "only {waits} tokens ended inside a character");
        // ... and kept by `GgufDetokenizer` with `skip_special = false`.
        let raw = GgufDetokenizer::new(Arc::new(tok.clone()), false);
        assert!(!raw.skip_special());
        let full_raw = raw.decode(&ids).unwrap();
        assert_eq!(full_raw, text);
        check_incremental(&raw, &ids, &full_raw);
        let skipping = GgufDetokenizer::new(raw.tokenizer().clone(), true);
        assert_eq!(skipping.decode(&ids).unwrap(), full);
    }

    #[test]
    fn split_characters_come_out_as_replacement_until_complete() {
        let tok = common::tokenizer();
        for s in ["🦀", "👨‍👩‍👧‍👦", "é", "北京", "𝔘"] {
            let ids = tok.encode(s).unwrap();
            let full = Detokenizer::decode(tok, &ids).unwrap();
            assert_eq!(full, s);
            let mut split = false;
            for n in 1..ids.len() {
                let part = Detokenizer::decode(tok, &ids[..n]).unwrap();
                // Complete characters so far, then at most one U+FFFD for the cut one.
                let body = part.strip_suffix('\u{FFFD}').unwrap_or(&part);
                split |= body.len() < part.len();
                assert!(s.starts_with(body), "{part:?} is not a prefix of {s:?}");
            }
            if s == "🦀" {
                assert!(
                    ids.len() > 1 && split,
                    "🦀 -> {ids:?} was expected to be split"
                );
            }
        }
    }

    #[test]
    fn any_window_on_character_boundaries_decodes_to_its_part_of_the_full_text() {
        let tok = common::tokenizer();
        let text = long_text();
        let ids = tok.encode(&text).unwrap();
        // Byte offset of each token boundary in the full (raw) text.
        let mut ends = vec![0usize];
        for &id in &ids {
            ends.push(ends.last().unwrap() + tok.token_bytes(id).unwrap().len());
        }
        let raw = GgufDetokenizer::new(Arc::new(tok.clone()), false);
        let mut checked = 0;
        for a in (0..ids.len()).step_by(7) {
            for b in [a + 1, a + 2, a + 5, a + 17, a + 64] {
                let (Some(&sa), Some(&sb)) = (ends.get(a), ends.get(b)) else {
                    continue;
                };
                if text.is_char_boundary(sa) && text.is_char_boundary(sb) {
                    assert_eq!(raw.decode(&ids[a..b]).unwrap(), text[sa..sb]);
                    checked += 1;
                }
            }
        }
        assert!(checked > 500, "{checked}");
    }

    #[test]
    fn out_of_vocabulary_ids_are_typed_errors() {
        let tok = common::tokenizer();
        let vocab = tok.vocab_size();
        for bad in [vocab as u32, u32::MAX] {
            let err = Detokenizer::decode(tok, &[1, bad]).unwrap_err();
            assert!(
                matches!(
                    err,
                    speculative::Error::TokenOutOfVocab { token, vocab_size, .. }
                        if token == bad && vocab_size == vocab
                ),
                "{err:?}"
            );
        }
        assert_eq!(Detokenizer::decode(tok, &[]).unwrap(), "");
    }

    #[test]
    fn implementations_are_send_sync_and_boxable() {
        fn check<D: Detokenizer + Send + Sync + Clone + 'static>() {}
        check::<GgufTokenizer>();
        check::<GgufDetokenizer>();
        let tok = Arc::new(common::tokenizer().clone());
        let boxed: Vec<Box<dyn Detokenizer>> = vec![
            Box::new(tok.clone()),
            Box::new(GgufDetokenizer::new(tok.clone(), true)),
        ];
        let ids = tok.encode("ok").unwrap();
        for d in &boxed {
            assert_eq!(d.decode(&ids).unwrap(), "ok");
        }
    }

    /// A text the real model generated (greedy, 160 tokens), decoded incrementally.
    #[test]
    fn incremental_window_equals_full_decode_on_generated_text() {
        let tok = common::tokenizer();
        let prompt = tok
            .apply_chat_template(&[ChatMessage::user(
                "Say good morning in French, Spanish, German, Chinese, Japanese, Korean and \
                 Greek, and add a few emoji.",
            )])
            .unwrap();
        let prompt = tok.encode(&prompt).unwrap();
        let mut target = CandleTarget::new(common::weights(WeightFormat::Q8_0));
        let out = Generator::new(&mut target as &mut dyn TargetModel, NoProposer)
            .generate(&prompt, &GenerationParams::greedy(160))
            .unwrap();
        let full = Detokenizer::decode(tok, &out.tokens).unwrap();
        println!("{full}");
        assert_eq!(full, tok.decode(&out.tokens, true).unwrap());
        let waits = check_incremental(tok, &out.tokens, &full);
        println!(
            "{} tokens, {waits} ended inside a character",
            out.tokens.len()
        );
        let raw = GgufDetokenizer::new(Arc::new(tok.clone()), false);
        let full_raw = raw.decode(&out.tokens).unwrap();
        check_incremental(&raw, &out.tokens, &full_raw);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Arbitrary ids (byte soup: invalid UTF-8, split characters, control tokens): the
        /// incremental window still reproduces the full decode exactly.
        #[test]
        fn incremental_window_equals_full_decode_on_arbitrary_ids(
            ids in proptest::collection::vec(0u32..49_152, 0..96),
            skip in any::<bool>(),
        ) {
            let tok = common::tokenizer();
            let det = GgufDetokenizer::new(Arc::new(tok.clone()), skip);
            let full = det.decode(&ids).unwrap();
            prop_assert_eq!(&full, &tok.decode(&ids, skip).unwrap());
            let (text, _, _) = incremental(&det, &ids);
            prop_assert_eq!(text, full);
        }

        /// Ids drawn from the tokens of multi-byte characters (the last bytes of UTF-8
        /// sequences are common), so split characters are the rule.
        #[test]
        fn incremental_window_equals_full_decode_on_multibyte_tokens(
            picks in proptest::collection::vec(any::<prop::sample::Index>(), 0..128),
        ) {
            let tok = common::tokenizer();
            let pool = multibyte_pool(tok);
            let ids: Vec<u32> = picks.iter().map(|i| pool[i.index(pool.len())]).collect();
            let full = Detokenizer::decode(tok, &ids).unwrap();
            let (text, _, _) = incremental(tok, &ids);
            prop_assert_eq!(text, full);
        }
    }

    /// The tokens of a multilingual text whose bytes are not all ASCII.
    fn multibyte_pool(tok: &GgufTokenizer) -> Vec<u32> {
        let mut pool: Vec<u32> = tok
            .encode(&long_text())
            .unwrap()
            .into_iter()
            .filter(|&id| tok.token_bytes(id).is_some_and(|b| !b.is_ascii()))
            .collect();
        pool.sort_unstable();
        pool.dedup();
        assert!(pool.len() > 50, "{}", pool.len());
        pool
    }
}
