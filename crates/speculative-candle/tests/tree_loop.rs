//! Token-tree speculative decoding on the real model (needs
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf`; run `scripts/fetch-model.sh` first): greedy output
//! with tree drafts from both model-free proposers, from their merge, from Token Recycling
//! (chains and trees) and from a draft model growing EAGLE-2 style trees equals plain greedy
//! decoding token for token.

mod common;

use common::{chat, fast_weights, tokenizer};

use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions, TreeDrafts};
use speculative::propose::{
    DraftModelProposer, MergedProposer, PromptLookup, RecyclingConfig, SuffixConfig,
    SuffixProposer, TokenRecycling,
};
use speculative::{Proposer, TargetModel};
use speculative_candle::FastTarget;

const PROMPTS: [&str; 3] = [
    "Rewrite this sentence in the passive voice: The committee approved the budget, the \
     committee rejected the plan, and the committee postponed the vote.",
    "Here is a function:\nfn add(a: i32, b: i32) -> i32 { a + b }\nRename it to sum and add a \
     doc comment; show the whole function.",
    "What is a good way to learn to play the guitar?",
];

#[test]
fn tree_drafts_give_plain_greedy_output_on_the_real_model() {
    let w = fast_weights();
    let eos = tokenizer().eos_id();
    let params = GenerationParams::greedy(64)
        .with_draft(DraftLength::Fixed(8))
        .with_tree(TreeDrafts::nodes(16))
        .with_stop(StopConditions::eos(eos))
        .unwrap();
    let plain_params = params
        .clone()
        .with_draft(DraftLength::Off)
        .with_tree(TreeDrafts::nodes(0));
    let mut tree_steps = [0usize; 2];
    for q in PROMPTS {
        let prompt = chat(q);
        let mut plain = Generator::new(FastTarget::new(w.clone()), speculative::NoProposer);
        let want = plain.generate(&prompt, &plain_params).unwrap().tokens;
        let proposers: [Box<dyn Proposer>; 2] = [
            Box::new(PromptLookup::new(1, 4).unwrap()),
            Box::new(SuffixProposer::new(SuffixConfig::default()).unwrap()),
        ];
        for (i, p) in proposers.into_iter().enumerate() {
            let target = FastTarget::new(w.clone());
            let mut g = Generator::new(target, p);
            let out = g.generate(&prompt, &params).unwrap();
            let m = &out.metrics;
            println!(
                "{} on {q:?}: {} calls, {} tree steps ({:.1} nodes, depth {:.1}), mean accepted \
                 length {:.2}",
                g.proposer().name(),
                m.target_calls,
                m.tree_steps,
                m.mean_tree_nodes(),
                m.mean_tree_depth(),
                m.mean_accepted_length()
            );
            assert_eq!(
                out.tokens,
                want,
                "{} tree output differs for {q:?}",
                g.proposer().name()
            );
            // The cache holds the prompt and every emitted token but the last.
            assert_eq!(g.target().seq_len(), prompt.len() + out.tokens.len() - 1);
            tree_steps[i] += m.tree_steps;
        }
    }
    assert!(
        tree_steps.iter().all(|&n| n > 0),
        "both proposers must have drafted trees: {tree_steps:?}"
    );
}

#[test]
fn a_merged_tree_gives_plain_greedy_output_on_the_real_model() {
    // Prompt lookup + suffix merged into one tree per step (MergedProposer), one prompt.
    let w = fast_weights();
    let eos = tokenizer().eos_id();
    let params = GenerationParams::greedy(40)
        .with_draft(DraftLength::Fixed(6))
        .with_tree(TreeDrafts::nodes(12))
        .with_stop(StopConditions::eos(eos))
        .unwrap();
    let plain_params = params
        .clone()
        .with_draft(DraftLength::Off)
        .with_tree(TreeDrafts::nodes(0));
    let prompt = chat(PROMPTS[0]);
    let mut plain = Generator::new(FastTarget::new(w.clone()), speculative::NoProposer);
    let want = plain.generate(&prompt, &plain_params).unwrap().tokens;
    let merged = MergedProposer::new(vec![
        Box::new(PromptLookup::new(1, 4).unwrap()),
        Box::new(SuffixProposer::new(SuffixConfig::default()).unwrap()),
    ])
    .unwrap();
    let mut g = Generator::new(FastTarget::new(w), merged);
    let out = g.generate(&prompt, &params).unwrap();
    let m = &out.metrics;
    println!(
        "merged: {} calls, {} tree steps ({:.1} nodes), mean accepted length {:.2}",
        m.target_calls,
        m.tree_steps,
        m.mean_tree_nodes(),
        m.mean_accepted_length()
    );
    assert_eq!(out.tokens, want, "merged tree output differs");
    assert_eq!(g.target().seq_len(), prompt.len() + out.tokens.len() - 1);
    assert!(m.accepted > 0, "the merge drafted nothing accepted");
}

#[test]
fn recycling_gives_plain_greedy_output_on_the_real_model() {
    let w = fast_weights();
    let eos = tokenizer().eos_id();
    let prompt = chat(PROMPTS[0]);
    let chain = GenerationParams::greedy(40)
        .with_draft(DraftLength::Fixed(4))
        .with_stop(StopConditions::eos(eos))
        .unwrap();
    let plain_params = chain.clone().with_draft(DraftLength::Off);
    let want = Generator::new(FastTarget::new(w.clone()), speculative::NoProposer)
        .generate(&prompt, &plain_params)
        .unwrap()
        .tokens;
    let vocab = FastTarget::new(w.clone()).vocab_size();
    let p = TokenRecycling::new(vocab, RecyclingConfig::default()).unwrap();
    // One proposer for both runs: the tree run starts from the table the chain run left.
    let mut g = Generator::new(FastTarget::new(w.clone()), p);
    for params in [chain.clone(), chain.with_tree(TreeDrafts::nodes(16))] {
        let out = g.generate(&prompt, &params).unwrap();
        let m = &out.metrics;
        println!(
            "recycling, tree nodes {}: {} calls, {} tree steps, {} of {} drafts accepted, table \
             {} rows",
            params.tree().node_budget(),
            m.target_calls,
            m.tree_steps,
            m.accepted,
            m.proposed,
            g.proposer().filled_rows()
        );
        assert_eq!(
            out.tokens,
            want,
            "tree nodes {}",
            params.tree().node_budget()
        );
        assert_eq!(g.target().seq_len(), prompt.len() + out.tokens.len() - 1);
        assert!(m.proposed > 0);
        if params.tree().node_budget() > 0 {
            assert!(m.tree_steps > 0);
        }
    }
}

#[test]
fn draft_model_trees_give_plain_greedy_output_on_the_real_model() {
    // The model is its own draft (a tree-capable FastTarget): a short run that exercises the
    // draft's tree forwards, its KV rollback and commit, and the target's tree verification.
    let w = fast_weights();
    let prompt = chat(PROMPTS[2]);
    let params = GenerationParams::greedy(30)
        .with_draft(DraftLength::Fixed(4))
        .with_tree(TreeDrafts::nodes(12))
        .with_stop(StopConditions::eos(tokenizer().eos_id()))
        .unwrap();
    let plain_params = params
        .clone()
        .with_draft(DraftLength::Off)
        .with_tree(TreeDrafts::nodes(0));
    let mut plain = Generator::new(FastTarget::new(w.clone()), speculative::NoProposer);
    let want = plain.generate(&prompt, &plain_params).unwrap().tokens;
    let draft = DraftModelProposer::new(FastTarget::new(w.clone()));
    let mut g = Generator::new(FastTarget::new(w.clone()), draft);
    let out = g.generate(&prompt, &params).unwrap();
    let m = &out.metrics;
    println!(
        "draft-model trees: {} calls, {} tree steps ({:.1} nodes, depth {:.1}), mean accepted \
         length {:.2}",
        m.target_calls,
        m.tree_steps,
        m.mean_tree_nodes(),
        m.mean_tree_depth(),
        m.mean_accepted_length()
    );
    assert_eq!(out.tokens, want);
    assert!(m.tree_steps > 0, "no tree was drafted");
    assert_eq!(g.target().seq_len(), prompt.len() + out.tokens.len() - 1);
}
