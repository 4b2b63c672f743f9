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
