//! `LlamaTarget` and `LlamaBatchTarget` against the engine traits' contract, on the real
//! SmolLM2 GGUF (scripts/fetch-model.sh).
//!
//! llama.cpp's logits for a row may differ in the last bits with the number of rows in the call
//! (see the crate docs), so comparisons across calls of different sizes allow [`TOL`] in logit
//! units (the model's logits span about 30); a wrong KV cache or position moves them by whole
//! units (checked by the negative controls below).

mod common;

use common::{argmax, chat, engine, llama_error, max_diff};
use speculative::{BatchTarget, SlotChunk, SlotInput, TargetModel};
use speculative_llama::{
    ChatTurn, LlamaBatchTarget, LlamaConfig, LlamaEngine, LlamaError, ModelOptions,
};

/// Largest allowed logit difference between calls of different row counts.
const TOL: f32 = 0.05;

/// A chunk appending `tokens` to `slot` with their logits.
fn chain_of(slot: usize, tokens: &[u32]) -> SlotChunk<'_> {
    SlotChunk {
        slot,
        input: SlotInput::Chain(tokens),
    }
}

/// A chunk appending `tokens` to `slot` without logits.
fn prefill_of(slot: usize, tokens: &[u32]) -> SlotChunk<'_> {
    SlotChunk {
        slot,
        input: SlotInput::Prefill(tokens),
    }
}

fn prompt() -> Vec<u32> {
    chat("Rewrite in the past tense: the cat sits on the mat and watches the birds.")
}

#[test]
fn tokenizer_and_chat_template_come_from_the_gguf() {
    let e = engine();
    assert_eq!(e.vocab_size(), 49_152);
    assert_eq!(e.eos_id(), 2);
    assert!(e.eog_ids().contains(&2));
    let text = e
        .apply_chat_template(&[ChatTurn::user("Hi")], true)
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = e.encode(&text).unwrap();
    // Control tokens are parsed as single ids (SmolLM2: <|im_start|> = 1, <|im_end|> = 2).
    assert_eq!(ids[0], 1);
    assert!(ids.contains(&2));
    assert_eq!(e.decode(&ids, false).unwrap(), text);
    assert_eq!(e.decode(&ids, true).unwrap(), "user\nHi\nassistant\n");
    let s = "Grüße, 世界! 🎉 x = 1.25";
    assert_eq!(e.decode(&e.encode(s).unwrap(), true).unwrap(), s);
    assert_eq!(e.token_bytes(2).unwrap(), b"<|im_end|>");
    assert!(matches!(
        e.decode(&[49_152], true),
        Err(LlamaError::TokenOutOfVocab { token: 49_152, .. })
    ));
}

#[test]
fn forward_equals_prefill_then_forward() {
    let e = engine();
    let p = prompt();
    let n = p.len();
    let mut t = e.target(&LlamaConfig::default()).unwrap();
    let mut all = Vec::new();
    t.forward(&p, &mut all).unwrap();
    assert_eq!(all.len(), n * e.vocab_size());
    assert_eq!(t.seq_len(), n);

    let mut split = Vec::new();
    t.truncate(0).unwrap();
    t.prefill(&p[..n - 3]).unwrap();
    assert_eq!(t.seq_len(), n - 3);
    t.forward(&p[n - 3..], &mut split).unwrap();
    assert_eq!(t.seq_len(), n);
    let tail = &all[(n - 3) * e.vocab_size()..];
    let d = max_diff(tail, &split);
    assert!(
        d <= TOL,
        "prefill + forward differs from one forward by {d}"
    );
    for r in 0..3 {
        let v = e.vocab_size();
        assert_eq!(
            argmax(&tail[r * v..(r + 1) * v]),
            argmax(&split[r * v..(r + 1) * v])
        );
    }

    // Negative control: the same tokens at other positions (a missing prefill token) give
    // clearly different logits, so the tolerance above can tell a wrong cache apart.
    let mut shifted = Vec::new();
    t.truncate(0).unwrap();
    t.prefill(&p[1..n - 3]).unwrap();
    t.forward(&p[n - 3..], &mut shifted).unwrap();
    assert!(max_diff(tail, &shifted) > 20.0 * TOL);
}

#[test]
fn truncate_then_forward_equals_a_fresh_forward() {
    let e = engine();
    let p = prompt();
    let n = p.len();
    let cont = [330u32, 1690, 28, 260];
    let mut fresh_t = e.target(&LlamaConfig::default()).unwrap();
    fresh_t.prefill(&p).unwrap();
    let mut fresh = Vec::new();
    fresh_t.forward(&cont, &mut fresh).unwrap();

    let mut t = e.target(&LlamaConfig::default()).unwrap();
    t.prefill(&p).unwrap();
    let mut junk = Vec::new();
    t.forward(&[17, 18, 19, 20, 21, 22], &mut junk).unwrap();
    assert_eq!(t.seq_len(), n + 6);
    t.truncate(n).unwrap();
    assert_eq!(t.seq_len(), n);
    let mut again = Vec::new();
    t.forward(&cont, &mut again).unwrap();
    let d = max_diff(&fresh, &again);
    assert!(
        d <= TOL,
        "forward after a rollback differs from a fresh one by {d}"
    );
    // Rolled back further, into the prompt, and appended again.
    t.truncate(n - 2).unwrap();
    t.forward(&p[n - 2..], &mut junk).unwrap();
    t.forward(&cont, &mut again).unwrap();
    assert!(max_diff(&fresh, &again) <= TOL);

    // Negative control: without the rollback the drafts stay in the cache.
    let mut stale = Vec::new();
    let mut s = e.target(&LlamaConfig::default()).unwrap();
    s.prefill(&p).unwrap();
    s.forward(&[17, 18, 19, 20, 21, 22], &mut junk).unwrap();
    s.forward(&cont, &mut stale).unwrap();
    assert!(max_diff(&fresh, &stale) > 20.0 * TOL);
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let e = engine();
    let mut t = e.target(&LlamaConfig::default().with_context(64)).unwrap();
    assert_eq!(t.max_context(), 64);
    let mut logits = Vec::new();
    t.forward(&[1, 2, 3], &mut logits).unwrap();

    let err = t
        .forward(&(0..62).collect::<Vec<u32>>(), &mut logits)
        .unwrap_err();
    assert!(matches!(
        llama_error(&err),
        LlamaError::ContextOverflow {
            seq_len: 3,
            added: 62,
            max_context: 64,
            ..
        }
    ));
    let err = t.prefill(&[5, 49_152]).unwrap_err();
    assert!(matches!(
        llama_error(&err),
        LlamaError::TokenOutOfVocab {
            token: 49_152,
            vocab_size: 49_152
        }
    ));
    let err = t.forward(&[], &mut logits).unwrap_err();
    assert!(matches!(llama_error(&err), LlamaError::Empty));
    let err = t.truncate(4).unwrap_err();
    assert!(matches!(
        llama_error(&err),
        LlamaError::TruncateBeyond {
            len: 4,
            seq_len: 3,
            ..
        }
    ));
    assert_eq!(t.seq_len(), 3);
    // Exactly up to the context is fine.
    t.forward(&(10..71).collect::<Vec<u32>>(), &mut logits)
        .unwrap();
    assert_eq!(t.seq_len(), 64);
    assert_eq!(logits.len(), 61 * e.vocab_size());

    // Appends longer than one llama_decode are split and still return every row.
    let mut small = e
        .target(&LlamaConfig::default().with_batch_tokens(4))
        .unwrap();
    let mut whole = e.target(&LlamaConfig::default()).unwrap();
    let p = prompt();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    small.forward(&p, &mut a).unwrap();
    whole.forward(&p, &mut b).unwrap();
    assert_eq!(a.len(), b.len());
    assert!(max_diff(&a, &b) <= TOL);

    for bad in [
        LlamaConfig::default().with_context(0),
        LlamaConfig::default().with_threads(0),
        LlamaConfig::default().with_batch_tokens(0),
    ] {
        assert!(matches!(e.target(&bad), Err(LlamaError::Config { .. })));
    }
    assert!(matches!(
        LlamaEngine::load("no/such/model.gguf", &ModelOptions::default()),
        Err(LlamaError::Load { .. })
    ));
}

#[test]
fn batch_target_matches_single_sequences() {
    let e = engine();
    let v = e.vocab_size();
    let cfg = LlamaConfig::default().with_slots(3).with_context(256);
    let mut b = LlamaBatchTarget::new(e, &cfg).unwrap();
    assert_eq!(
        (b.max_slots(), b.max_context(), b.max_tree_nodes()),
        (3, 256, 0)
    );
    let p = prompt();
    let q: Vec<u32> = e
        .encode("Once upon a time, in a small village by the sea,")
        .unwrap();
    let mut logits = Vec::new();
    // Slot 0 prefills p, slot 2 runs q as a chain, in one call.
    b.forward_batch(&[prefill_of(0, &p), chain_of(2, &q)], &mut logits)
        .unwrap();
    assert_eq!(logits.len(), q.len() * v);
    assert_eq!(
        (
            b.seq_len(0).unwrap(),
            b.seq_len(1).unwrap(),
            b.seq_len(2).unwrap()
        ),
        (p.len(), 0, q.len())
    );
    let mut single = e.target(&LlamaConfig::default()).unwrap();
    let mut want = Vec::new();
    single.forward(&q, &mut want).unwrap();
    assert!(max_diff(&logits, &want) <= TOL);

    // A verify chain on slot 0 next to a chain on slot 1, then rollback of slot 0.
    let chain = [330u32, 1690, 28];
    b.forward_batch(&[chain_of(1, &q[..4]), chain_of(0, &chain)], &mut logits)
        .unwrap();
    assert_eq!(logits.len(), 7 * v);
    // Slot 1's rows first (call order), then slot 0's; with a cache per sequence (the default)
    // each equals its sequence alone, bit for bit.
    let mut alone = e.target(&LlamaConfig::default()).unwrap();
    let mut want1 = Vec::new();
    alone.forward(&q[..4], &mut want1).unwrap();
    assert!(
        logits[..4 * v] == want1[..],
        "slot 1's rows differ from slot 1 alone"
    );
    single.truncate(0).unwrap();
    single.prefill(&p).unwrap();
    single.forward(&chain, &mut want).unwrap();
    assert!(
        logits[4 * v..] == want[..],
        "slot 0's rows differ from slot 0 alone"
    );
    b.truncate(0, p.len()).unwrap();
    assert_eq!(b.seq_len(0).unwrap(), p.len());
    b.forward_batch(&[chain_of(0, &chain)], &mut logits)
        .unwrap();
    assert!(max_diff(&logits, &want) <= TOL);

    // Slot errors, refused trees, too many rows and an overflow leave every slot as it was.
    let lens = |b: &LlamaBatchTarget| (0..3).map(|s| b.seq_len(s).unwrap()).collect::<Vec<_>>();
    let before = lens(&b);
    for bad in [
        vec![chain_of(3, &chain)],
        vec![chain_of(1, &chain), chain_of(1, &chain)],
    ] {
        assert!(matches!(
            b.forward_batch(&bad, &mut logits),
            Err(speculative::Error::InvalidSlot { .. })
        ));
    }
    let long: Vec<u32> = (0..250).collect();
    let err = b
        .forward_batch(&[chain_of(1, &chain), prefill_of(0, &long)], &mut logits)
        .unwrap_err();
    assert!(matches!(
        llama_error(&err),
        LlamaError::ContextOverflow { seq: 0, .. }
    ));
    assert_eq!(lens(&b), before);
    let tree = [5u32, 6];
    let err = b
        .forward_batch(
            &[
                chain_of(1, &chain),
                SlotChunk {
                    slot: 2,
                    input: SlotInput::Tree {
                        root: 7,
                        block: speculative::DraftBlock::chain(&tree),
                    },
                },
            ],
            &mut logits,
        )
        .unwrap_err();
    assert!(matches!(err, speculative::Error::TargetContract { .. }));
    let wide: Vec<u32> = (0..513).collect();
    let err = b
        .forward_batch(&[prefill_of(1, &wide)], &mut logits)
        .unwrap_err();
    assert!(err.to_string().contains("max_batch_tokens"), "{err}");
    assert_eq!(lens(&b), before);
    assert!(matches!(
        b.seq_len(3),
        Err(speculative::Error::InvalidSlot { .. })
    ));
    assert!(matches!(
        b.truncate(5, 0),
        Err(speculative::Error::InvalidSlot { .. })
    ));
    assert!(b.commit_tree(0, &[]).is_err());
    b.release(0).unwrap();
    assert_eq!(b.seq_len(0).unwrap(), 0);
    // A released slot starts again from nothing.
    b.forward_batch(&[chain_of(0, &q)], &mut logits).unwrap();
    single.truncate(0).unwrap();
    single.forward(&q, &mut want).unwrap();
    assert!(max_diff(&logits, &want) <= TOL);
}

#[test]
fn every_slot_holds_exactly_its_context() {
    let e = engine();
    // 100 is not a multiple of llama.cpp's padding (256): the adapter's limit is the one that
    // counts, in both cache layouts.
    for unified in [false, true] {
        let cfg = LlamaConfig::default()
            .with_slots(3)
            .with_context(100)
            .with_unified_kv(unified);
        let mut b = LlamaBatchTarget::new(e, &cfg).unwrap();
        let full: Vec<u32> = (0..100).map(|i| 300 + i).collect();
        let mut logits = Vec::new();
        // In pieces of 20 rows (llama.cpp's rows stay batch-invariant up to 48 rows a call).
        for piece in full.chunks(20) {
            for slot in 0..3 {
                let c = SlotChunk {
                    slot,
                    input: SlotInput::Prefill(piece),
                };
                b.forward_batch(&[c], &mut logits).unwrap();
            }
        }
        for slot in 0..3 {
            assert_eq!(b.seq_len(slot).unwrap(), 100);
            let err = b
                .forward_batch(
                    &[SlotChunk {
                        slot,
                        input: SlotInput::Chain(&[1]),
                    }],
                    &mut logits,
                )
                .unwrap_err();
            assert!(matches!(
                llama_error(&err),
                LlamaError::ContextOverflow {
                    seq_len: 100,
                    added: 1,
                    max_context: 100,
                    ..
                }
            ));
        }
        // A rollback makes room again, and the slot's next row sees its whole context.
        b.truncate(1, 99).unwrap();
        b.forward_batch(&[chain_of(1, &full[99..])], &mut logits)
            .unwrap();
        let mut t = e.target(&LlamaConfig::default().with_context(100)).unwrap();
        for piece in full[..99].chunks(20) {
            t.prefill(piece).unwrap();
        }
        let mut want = Vec::new();
        t.forward(&full[99..], &mut want).unwrap();
        let d = max_diff(&logits, &want);
        if unified {
            assert!(d <= TOL, "unified: {d}");
        } else {
            assert!(
                logits == want,
                "a cache per sequence: slot 1's row differs by {d}"
            );
        }
    }
}

#[test]
fn a_requantized_copy_loads_and_agrees_with_the_source() {
    let e = engine();
    let dir = std::env::temp_dir().join(format!("speculative-llama-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("m.gguf");
    std::fs::copy(speculative_llama::default_model_path(), &src).unwrap();
    let path =
        speculative_llama::quantized_copy(&src, speculative_llama::Quantization::Q8_0, 2).unwrap();
    assert_eq!(path, dir.join("m.requant-q8_0.gguf"));
    // Made once: a second call reuses the file.
    let made = std::fs::metadata(&path).unwrap().modified().unwrap();
    let again =
        speculative_llama::quantized_copy(&src, speculative_llama::Quantization::Q8_0, 2).unwrap();
    assert_eq!(std::fs::metadata(&again).unwrap().modified().unwrap(), made);
    let q8 = LlamaEngine::load(&path, &ModelOptions::default()).unwrap();
    assert_eq!(q8.vocab_size(), e.vocab_size());
    let p = prompt();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    e.target(&LlamaConfig::default())
        .unwrap()
        .forward(&p, &mut a)
        .unwrap();
    q8.target(&LlamaConfig::default())
        .unwrap()
        .forward(&p, &mut b)
        .unwrap();
    // Another model (8-bit re-quantization of the 4-bit weights): the same predictions, close
    // logits.
    let v = e.vocab_size();
    let agree = (0..p.len())
        .filter(|&r| argmax(&a[r * v..(r + 1) * v]) == argmax(&b[r * v..(r + 1) * v]))
        .count();
    assert!(agree * 10 >= p.len() * 9, "{agree} of {}", p.len());
    assert!(matches!(
        speculative_llama::quantize(
            &dir.join("missing.gguf"),
            &dir.join("out.gguf"),
            speculative_llama::Quantization::Q4_0,
            1
        ),
        Err(LlamaError::Load { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Prefix copy between slots (`llama_memory_seq_cp`): after copying slot 0's first `k`
/// positions into slot 1 (which held something else), a chain on slot 1 gives the logits of a
/// single sequence that prefilled the same `k` tokens, for a cache per sequence (whole-buffer
/// copy) and a unified cache (shared cells); slot 0 is unchanged; bad copies are refused.
#[test]
fn a_copied_prefix_continues_like_a_fresh_prefill() {
    let e = engine();
    let p = prompt();
    let k = p.len() - 4;
    let chain = [330u32, 1690, 28];
    let mut single = e.target(&LlamaConfig::default()).unwrap();
    single.prefill(&p[..k]).unwrap();
    let mut want = Vec::new();
    single.forward(&chain, &mut want).unwrap();
    for unified in [false, true] {
        let cfg = LlamaConfig::default()
            .with_slots(3)
            .with_context(256)
            .with_unified_kv(unified);
        let mut b = LlamaBatchTarget::new(e, &cfg).unwrap();
        assert!(b.can_copy_prefix());
        let mut logits = Vec::new();
        b.forward_batch(&[prefill_of(0, &p), prefill_of(1, &p[..5])], &mut logits)
            .unwrap();
        b.copy_prefix(0, 1, k).unwrap();
        assert_eq!((b.seq_len(0).unwrap(), b.seq_len(1).unwrap()), (p.len(), k));
        b.forward_batch(&[chain_of(1, &chain)], &mut logits)
            .unwrap();
        assert!(max_diff(&logits, &want) <= TOL, "unified {unified}");
        let v = e.vocab_size();
        for r in 0..chain.len() {
            assert_eq!(
                argmax(&logits[r * v..(r + 1) * v]),
                argmax(&want[r * v..(r + 1) * v])
            );
        }
        // Slot 0 still holds its prompt: its next row follows the whole prompt.
        b.truncate(0, p.len() - 1).unwrap();
        b.forward_batch(&[chain_of(0, &p[p.len() - 1..])], &mut logits)
            .unwrap();
        let mut whole = e.target(&LlamaConfig::default()).unwrap();
        let mut w = Vec::new();
        whole.forward(&p, &mut w).unwrap();
        assert!(max_diff(&logits, &w[(p.len() - 1) * v..]) <= TOL);
        assert!(b.copy_prefix(0, 0, 1).is_err());
        assert!(b.copy_prefix(0, 2, p.len() + 1).is_err());
        assert!(matches!(
            b.copy_prefix(0, 3, 1),
            Err(speculative::Error::InvalidSlot { .. })
        ));
        assert_eq!(b.seq_len(2).unwrap(), 0);
    }
}
