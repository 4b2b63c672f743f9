//! `speculative_candle::distil` on the real model: a run stopped part-way and resumed writes the
//! files of an uninterrupted run (with another slot count and drafting), and every record is
//! the chat-templated conversation so far followed by the target's answer.

mod common;

use std::path::{Path, PathBuf};

use common::{fast_weights, model_path, tokenizer};
use speculative_candle::ChatMessage;
use speculative_candle::distil::{
    self, DistilConfig, Drafting, TokenStore, parse_conversations, read_records,
};

const CONVS: &str = r#"{"conv": 0, "kind": "chat", "temperature": 0.0, "top_p": 1.0, "turns": ["Name a colour.", "Why?"]}
{"conv": 1, "kind": "code", "temperature": 0.7, "top_p": 0.9, "turns": ["Write a Python function that adds two numbers."]}
{"conv": 2, "kind": "chat", "temperature": 1.0, "top_p": 0.95, "turns": ["Say hello.", "Again.", "Once more."]}
"#;

fn config(slots: usize, drafting: Drafting, limit: Option<u64>) -> DistilConfig {
    DistilConfig {
        max_tokens: 6,
        seed: 5,
        shard_conversations: 2,
        slots,
        threads: 1,
        max_batch_tokens: 256,
        drafting,
        limit,
        progress_secs: 1e9,
    }
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("distil-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn run(out: &Path, cfg: &DistilConfig) -> u64 {
    let convs = parse_conversations(CONVS).unwrap();
    let id = distil::identity(&model_path(), CONVS.as_bytes(), convs.len() as u64, cfg).unwrap();
    let mut store = TokenStore::open(out, id).unwrap();
    let s = distil::generate_tokens(
        fast_weights(),
        tokenizer(),
        &convs,
        &mut store,
        cfg,
        &mut |_| {},
    )
    .unwrap();
    s.conversations
}

#[test]
fn a_resumed_run_writes_the_files_of_an_uninterrupted_one() {
    let (a, b) = (dir("whole"), dir("resumed"));
    assert_eq!(run(&a, &config(4, Drafting::Off, None)), 3);
    let lookup = Drafting::PromptLookup { min_n: 1, max_n: 3 };
    assert_eq!(run(&b, &config(1, lookup, Some(1))), 1);
    assert_eq!(run(&b, &config(2, lookup, None)), 2);
    for f in ["shard-00000.jsonl", "shard-00001.jsonl"] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f}"
        );
    }
    let (m, recs) = read_records(&a).unwrap();
    assert_eq!((m.conversations_done(), m.turns()), (3, 6));
    assert_eq!(run(&a, &config(4, Drafting::Off, None)), 0, "nothing left");
    // Each record: the template over the earlier turns (the target's own answers as the
    // assistant messages) and this turn, then the answer.
    let tok = tokenizer();
    let mut msgs = Vec::new();
    for r in recs.iter().filter(|r| r.conv == 2) {
        msgs.push(ChatMessage::user(
            ["Say hello.", "Again.", "Once more."][r.turn as usize],
        ));
        let prompt = tok
            .encode(&tok.apply_chat_template(&msgs).unwrap())
            .unwrap();
        assert_eq!(r.tokens[..r.answer_start], prompt[..]);
        assert!(r.answer_len() >= 1 && r.answer_len() <= 6);
        assert_eq!((r.temperature, r.top_p), (1.0, 0.95));
        let answer = tok.decode(&r.tokens[r.answer_start..], true).unwrap();
        msgs.push(ChatMessage::assistant(answer));
    }
    assert_eq!(msgs.len(), 6);
    // Another seed is another dataset: the store refuses to mix them.
    let convs = parse_conversations(CONVS).unwrap();
    let mut other = config(4, Drafting::Off, None);
    other.seed = 6;
    let id = distil::identity(&model_path(), CONVS.as_bytes(), convs.len() as u64, &other);
    assert!(TokenStore::open(&a, id.unwrap()).is_err());
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}
