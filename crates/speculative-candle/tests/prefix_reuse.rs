//! Prefix reuse on the shipped engines (issue 30): after a generation keeps the cached prefix
//! of a new prompt and prefills only the rest, the logits are bit-identical to a fresh prefill
//! of the same prompt (FastTarget and CandleTarget Q8_0 are batch-invariant), greedy multi-turn
//! chats give the same tokens with reuse on and off, and FastBatch's prefix copy between slots
//! gives the bits of a fresh prefill. The fused prefill (`TargetModel::forward_tail`: the prompt
//! tokens left to prefill and the first verify rows in one forward) gives the bits of a prefill
//! followed by the verify forward, and fused chats equal plain greedy. Needs `models/SmolLM2-135M-Instruct.Q4_1.gguf` (run
//! `scripts/fetch-model.sh`), except the random-weight FastBatch test.

mod common;

use std::sync::Arc;

use speculative::decode::{BatchGenerator, BatchRequest, DraftLength, GenerationParams, Generator};
use speculative::propose::PromptLookup;
use speculative::{BatchTarget, HiddenStates, NoProposer, SlotChunk, SlotInput, TargetModel};
use speculative_candle::fast::RandomSpec;
use speculative_candle::{
    CandleTarget, FastBatch, FastFormat, FastTarget, FastWeights, WeightFormat,
};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The template's tokens that close the assistant's turn and open a new user turn.
fn next_turn(question: &str) -> Vec<u32> {
    let text =
        format!("<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n");
    common::tokenizer().encode(&text).unwrap()
}

const QUESTIONS: [&str; 3] = [
    "Name three colours of the rainbow.",
    "Which of them is the warmest?",
    "Write one sentence about it.",
];

fn params(n: usize) -> GenerationParams {
    GenerationParams::greedy(n).with_draft(DraftLength::Fixed(3))
}

/// A three-turn greedy chat on `g`; returns each turn's tokens and reused prompt tokens.
fn chat<T: TargetModel>(g: &mut Generator<T, PromptLookup>) -> Vec<(Vec<u32>, usize)> {
    let mut ctx = common::chat(QUESTIONS[0]);
    let mut out = Vec::new();
    for (t, q) in QUESTIONS.iter().enumerate() {
        if t > 0 {
            ctx.extend(next_turn(q));
        }
        let g = g.generate(&ctx, &params(12)).unwrap();
        ctx.extend(&g.tokens);
        out.push((g.tokens, g.metrics.prompt_tokens_reused));
    }
    out
}

/// After a first generation, a longer prompt sharing its prefix: the reused cache plus the last
/// token's forward gives the logits of a fresh prefill of the prompt, bit for bit. (`g` runs
/// without the fused prefill, so that its session prefills before the first step.)
fn logits_after_reuse<T: TargetModel>(mut g: Generator<T, NoProposer>, mut fresh: T) {
    let first = common::chat(QUESTIONS[0]);
    let out = g.generate(&first, &params(8)).unwrap();
    let prompt: Vec<u32> = first
        .iter()
        .chain(&out.tokens)
        .copied()
        .chain(next_turn(QUESTIONS[1]))
        .collect();
    let p = params(8);
    let s = g.session(&prompt, &p).unwrap();
    assert_eq!(
        s.metrics().prompt_tokens_reused,
        first.len() + out.tokens.len() - 1
    );

    let (n, last) = (prompt.len(), prompt[prompt.len() - 1]);
    let mut reused = Vec::new();
    g.target_mut().forward(&[last], &mut reused).unwrap();
    fresh.prefill(&prompt[..n - 1]).unwrap();
    let mut want = Vec::new();
    fresh.forward(&[last], &mut want).unwrap();
    assert_eq!(bits(&reused), bits(&want));
}

#[test]
fn fast_target_logits_after_reuse_equal_a_fresh_prefill_and_chats_do_not_change() {
    let w = common::fast_weights();
    logits_after_reuse(
        Generator::new(FastTarget::new(w.clone()), NoProposer).with_fused_prefill(false),
        FastTarget::new(w.clone()),
    );
    let pl = || PromptLookup::new(1, 3).unwrap();
    let on = chat(&mut Generator::new(FastTarget::new(w.clone()), pl()));
    let off = chat(&mut Generator::new(FastTarget::new(w), pl()).with_prefix_reuse(false));
    let tokens = |v: &[(Vec<u32>, usize)]| v.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&on), tokens(&off));
    assert!(on[1].1 > 0 && on[2].1 > on[1].1);
    assert!(off.iter().all(|t| t.1 == 0));
}

#[test]
fn candle_target_logits_after_reuse_equal_a_fresh_prefill() {
    let w = common::weights(WeightFormat::Q8_0);
    logits_after_reuse(
        Generator::new(CandleTarget::new(w.clone()), NoProposer).with_fused_prefill(false),
        CandleTarget::new(w),
    );
}

#[test]
fn fast_batch_prefix_copy_gives_the_bits_of_a_fresh_prefill() {
    let w: Arc<FastWeights> = FastWeights::random(&RandomSpec::default(), FastFormat::Q8).unwrap();
    let vocab = w.config().vocab_size as u32;
    let prefix: Vec<u32> = (0..30).map(|i| (i * 37 + 5) % vocab).collect();
    let chain = [3, 9, 27];
    let mut b = FastBatch::new(w.clone(), 3).unwrap();
    assert!(b.can_copy_prefix());
    let mut logits = Vec::new();
    b.forward_batch(
        &[SlotChunk {
            slot: 2,
            input: SlotInput::Prefill(&prefix),
        }],
        &mut logits,
    )
    .unwrap();
    // Slot 0 held something else; the copy replaces it.
    b.forward_batch(
        &[SlotChunk {
            slot: 0,
            input: SlotInput::Prefill(&[1, 2, 3, 4, 5]),
        }],
        &mut logits,
    )
    .unwrap();
    b.copy_prefix(2, 0, 20).unwrap();
    assert_eq!(b.seq_len(0).unwrap(), 20);
    assert_eq!(b.seq_len(2).unwrap(), 30);
    b.forward_batch(
        &[SlotChunk {
            slot: 0,
            input: SlotInput::Chain(&chain),
        }],
        &mut logits,
    )
    .unwrap();
    let mut fresh = FastTarget::new(w);
    fresh.prefill(&prefix[..20]).unwrap();
    let mut want = Vec::new();
    fresh.forward(&chain, &mut want).unwrap();
    assert_eq!(bits(&logits), bits(&want));
    assert_eq!(b.kv_snapshot(0), Some(fresh.kv_snapshot()));
    // Bad copies are refused and change nothing.
    assert!(b.copy_prefix(2, 2, 5).is_err());
    assert!(b.copy_prefix(2, 1, 31).is_err());
    assert!(b.copy_prefix(2, 3, 1).is_err());
    assert_eq!(b.seq_len(1).unwrap(), 0);
}

#[test]
fn fast_batch_shares_a_system_prompt_without_changing_outputs() {
    let w = common::fast_weights();
    let tok = common::tokenizer();
    let system = "You are a helpful assistant who answers in one short sentence.";
    let prompt = |q: &str| {
        let text = tok
            .apply_chat_template(&[
                speculative_candle::ChatMessage::system(system),
                speculative_candle::ChatMessage::user(q),
            ])
            .unwrap();
        tok.encode(&text).unwrap()
    };
    let run = |reuse: bool| {
        let mut b =
            BatchGenerator::new(FastBatch::new(w.clone(), 2).unwrap()).with_prefix_reuse(reuse);
        let mut out = Vec::new();
        for q in QUESTIONS {
            let req = BatchRequest::new(prompt(q), params(6), PromptLookup::new(1, 3).unwrap());
            b.submit(req).unwrap();
            for f in b.run().unwrap() {
                let g = f.result.unwrap();
                out.push((g.tokens, g.metrics.prompt_tokens_reused));
            }
        }
        (out, b.metrics().prefix_copies)
    };
    let (on, copies) = run(true);
    let (off, _) = run(false);
    let tokens = |v: &[(Vec<u32>, usize)]| v.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&on), tokens(&off));
    assert!(copies >= 1, "{copies}");
    assert!(on[1].1 > 10 && on[2].1 > 10, "{on:?}");
}

/// A multi-turn greedy chat on `g` with request `p`; returns each turn's tokens and the prompt
/// tokens fed in the first verify forward.
fn chat_with<T: TargetModel, P: speculative::Proposer>(
    g: &mut Generator<T, P>,
    p: &GenerationParams,
) -> Vec<(Vec<u32>, usize)> {
    let mut ctx = common::chat(QUESTIONS[0]);
    let mut out = Vec::new();
    for (t, q) in QUESTIONS.iter().enumerate() {
        if t > 0 {
            ctx.extend(next_turn(q));
        }
        let g = g.generate(&ctx, p).unwrap();
        ctx.extend(&g.tokens);
        out.push((g.tokens, g.metrics.prompt_tokens_fused));
    }
    out
}

#[test]
fn fast_target_fused_prefill_gives_the_bits_of_a_prefill_then_a_forward() {
    let w = common::fast_weights();
    let prompt = common::chat(QUESTIONS[0]);
    let drafts = [28, 1070, 314, 253];
    for reused in [0, 5] {
        let (mut a, mut b) = (FastTarget::new(w.clone()), FastTarget::new(w.clone()));
        if reused > 0 {
            a.prefill(&prompt[..reused]).unwrap();
            b.prefill(&prompt[..reused]).unwrap();
        }
        let feed: Vec<u32> = prompt[reused..].iter().chain(&drafts).copied().collect();
        let rows = drafts.len() + 1;
        let head = feed.len() - rows;
        let (mut la, mut lb) = (Vec::new(), Vec::new());
        a.forward_tail(&feed, rows, &mut la).unwrap();
        b.prefill(&feed[..head]).unwrap();
        b.forward(&feed[head..], &mut lb).unwrap();
        assert_eq!(bits(&la), bits(&lb), "reused {reused}");
        assert_eq!(a.seq_len(), b.seq_len());
        assert_eq!(a.kv_snapshot(), b.kv_snapshot());
        // Every appended row's hidden state is kept; the verify rows' equal the forward's.
        let (ha, hb) = (a.last_hidden().unwrap(), b.last_hidden().unwrap());
        assert_eq!(ha.len(), feed.len() * hb.len() / rows);
        assert_eq!(bits(&ha[head * hb.len() / rows..]), bits(hb));
        // Refused row counts change nothing.
        for bad in [0, feed.len() + 1] {
            assert!(a.forward_tail(&feed, bad, &mut la).is_err());
            assert_eq!(a.seq_len(), b.seq_len());
        }
    }
}

#[test]
fn fast_target_chats_with_the_fused_prefill_equal_plain_greedy() {
    use speculative::decode::{AdaptiveConfig, TreeDrafts};
    use speculative::propose::{SuffixConfig, SuffixProposer};
    let w = common::fast_weights();
    let plain = chat_with(
        &mut Generator::new(FastTarget::new(w.clone()), NoProposer)
            .with_prefix_reuse(false)
            .with_fused_prefill(false),
        &GenerationParams::greedy(12),
    );
    let tokens = |v: &[(Vec<u32>, usize)]| v.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
    // Plain decoding fuses its prefill too.
    let fused_plain = chat_with(
        &mut Generator::new(FastTarget::new(w.clone()), NoProposer),
        &GenerationParams::greedy(12),
    );
    assert_eq!(tokens(&fused_plain), tokens(&plain));
    let adaptive = DraftLength::Adaptive(AdaptiveConfig::default().with_max_draft(8));
    for nodes in [0, 8] {
        let p = GenerationParams::greedy(12)
            .with_draft(adaptive.clone())
            .with_tree(TreeDrafts::nodes(nodes));
        let suffix = SuffixProposer::new(SuffixConfig::default()).unwrap();
        let on = chat_with(&mut Generator::new(FastTarget::new(w.clone()), suffix), &p);
        assert_eq!(tokens(&on), tokens(&plain), "tree nodes {nodes}");
        // Every turn fed its new tokens in the first verify forward (turn 0: the whole
        // prompt but its last token).
        assert!(on.iter().all(|t| t.1 > 0), "{on:?}");
    }
}
