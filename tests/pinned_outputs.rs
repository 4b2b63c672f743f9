//! Pinned outputs: the exact tokens, finish reasons, texts and step counts of a few seeded
//! generations of the toy models, through [`Generator`] and through [`BatchGenerator`] over
//! [`PerSlot`] (greedy and sampled; chains, sampled-draft chains, point-mass and sampled trees;
//! adaptive draft lengths and tree shapes under [`FixedCosts`]; stop strings with a
//! detokenizer, EOS and a floor; hidden-state features).
//!
//! The values were computed once, before the decoding loops were rebuilt on one per-sequence
//! state machine (issue 27), and must never change: a seeded request gives the same tokens
//! whatever the internals of the loop. Set `PIN_PRINT=1` to print the current values in the
//! form written below (to pin a new case).

mod common;

use common::text::ByteVocab;
use speculative::decode::{
    AdaptiveConfig, BatchGenerator, BatchRequest, DraftLength, FinishReason, FixedCosts,
    Generation, GenerationParams, Generator, StopConditions, TreeDrafts,
};
use speculative::propose::{
    DraftModelProposer, DraftTreeConfig, PromptLookup, SuffixConfig, SuffixProposer,
};
use speculative::test_util::{ToyFeatureDraft, ToyModel, ToyRnn};
use speculative::{PerSlot, Proposer, SamplingConfig};

const VOCAB: usize = 12;

/// One pinned generation: tokens, finish, text, and `[proposed, accepted, emitted,
/// target_calls, tree_steps]` of its metrics.
struct Pin {
    tokens: &'static [u32],
    finish: FinishReason,
    text: Option<&'static str>,
    counts: [usize; 5],
}

fn counts(g: &Generation) -> [usize; 5] {
    let m = &g.metrics;
    [
        m.proposed,
        m.accepted,
        m.emitted,
        m.target_calls,
        m.tree_steps,
    ]
}

fn check(name: &str, got: &Generation, want: &Pin) {
    if std::env::var_os("PIN_PRINT").is_some() {
        println!(
            "// {name}\nPin {{\n    tokens: &{:?},\n    finish: FinishReason::{:?},\n    text: {:?},\n    counts: {:?},\n}},",
            got.tokens,
            got.finish,
            got.text,
            counts(got)
        );
        return;
    }
    assert_eq!(got.tokens, want.tokens, "{name}: tokens");
    assert_eq!(got.finish, want.finish, "{name}: finish");
    assert_eq!(got.text.as_deref(), want.text, "{name}: text");
    assert_eq!(counts(got), want.counts, "{name}: metrics counts");
}

fn target() -> ToyModel {
    ToyModel::markov(VOCAB, 2, 2.5, 7).with_tree(16)
}

fn sampling() -> SamplingConfig {
    SamplingConfig::builder()
        .temperature(0.9)
        .top_k(8)
        .build()
        .unwrap()
}

fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((j * 7 + i * 3 + j / 3) % VOCAB) as u32)
        .collect()
}

/// Byte-level pieces of the toy vocabulary: letters, a space, a two-byte character split over
/// two tokens.
fn vocab() -> ByteVocab {
    let mut pieces: Vec<Vec<u8>> = ["a", "b", "c", " ", "ab", "ba", "cc", "."]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
    let e = "é".as_bytes();
    pieces.push(vec![e[0]]);
    pieces.push(vec![e[1]]);
    pieces.push(b"d".to_vec());
    pieces.push(b"ca".to_vec());
    ByteVocab::new(pieces)
}

fn draft_model() -> DraftModelProposer<ToyModel> {
    DraftModelProposer::new(ToyModel::markov(VOCAB, 2, 2.5, 9).with_tree(16))
        .with_tree_config(DraftTreeConfig::default().with_beam(2).with_children(3))
        .unwrap()
}

fn costs() -> FixedCosts {
    FixedCosts::linear(0.004, 0.0005).unwrap()
}

/// A case of the mix: prompt, parameters, proposer, whether it has a detokenizer.
struct Case {
    name: &'static str,
    prompt: Vec<u32>,
    params: GenerationParams,
    proposer: fn() -> Box<dyn Proposer + Send>,
    text: bool,
}

fn cases() -> Vec<Case> {
    let adaptive = DraftLength::Adaptive(AdaptiveConfig::default());
    // "d." ends the greedy case (a stop string), "aca" the sampled tree case.
    let stops = StopConditions::eos(5)
        .with_stop_sequence(vec![10, 10])
        .with_stop_string("d.")
        .with_stop_string("é");
    vec![
        Case {
            name: "greedy prompt lookup chain",
            prompt: prompt(0, 20),
            params: GenerationParams::greedy(40).with_draft(DraftLength::Fixed(4)),
            proposer: || Box::new(PromptLookup::new(1, 4).unwrap()),
            text: false,
        },
        Case {
            name: "sampled draft-model chain (dense q)",
            prompt: prompt(1, 9),
            params: GenerationParams::sampled(sampling(), 5, 40).with_draft(DraftLength::Fixed(3)),
            proposer: || Box::new(draft_model()),
            text: false,
        },
        Case {
            name: "sampled suffix tree (point masses)",
            prompt: prompt(2, 30),
            params: GenerationParams::sampled(sampling(), 6, 40)
                .with_draft(DraftLength::Fixed(3))
                .with_tree(TreeDrafts::nodes(8)),
            proposer: || Box::new(SuffixProposer::new(SuffixConfig::default()).unwrap()),
            text: false,
        },
        Case {
            name: "sampled draft-model tree (dense q)",
            prompt: prompt(3, 12),
            params: GenerationParams::sampled(sampling(), 7, 40)
                .with_draft(DraftLength::Fixed(3))
                .with_tree(TreeDrafts::nodes(10)),
            proposer: || Box::new(draft_model()),
            text: false,
        },
        Case {
            name: "adaptive chain, fixed costs",
            prompt: prompt(4, 17),
            params: GenerationParams::sampled(sampling(), 8, 48).with_draft(adaptive.clone()),
            proposer: || Box::new(PromptLookup::new(1, 4).unwrap()),
            text: false,
        },
        Case {
            name: "adaptive tree shape, fixed costs",
            prompt: prompt(5, 6),
            params: GenerationParams::sampled(sampling(), 9, 48)
                .with_draft(adaptive.clone())
                .with_tree(TreeDrafts::nodes(12)),
            proposer: || Box::new(draft_model()),
            text: false,
        },
        Case {
            name: "greedy stops with text and a floor",
            prompt: prompt(6, 5),
            params: GenerationParams::greedy(60)
                .with_min_tokens(3)
                .unwrap()
                .with_stop(stops.clone())
                .unwrap(),
            proposer: || Box::new(PromptLookup::new(1, 3).unwrap()),
            text: true,
        },
        Case {
            name: "sampled stop strings in trees",
            prompt: prompt(7, 14),
            params: GenerationParams::sampled(sampling(), 10, 60)
                .with_min_tokens(2)
                .unwrap()
                .with_stop(
                    StopConditions::eos(7)
                        .with_stop_sequence(vec![10, 10])
                        .with_stop_string("aca")
                        .with_stop_string("é")
                        .include_stop_string(true),
                )
                .unwrap()
                .with_draft(DraftLength::Fixed(3))
                .with_tree(TreeDrafts::nodes(8)),
            proposer: || Box::new(draft_model()),
            text: true,
        },
        Case {
            name: "sampled one-token prompt, drafts off",
            prompt: vec![3],
            params: GenerationParams::sampled(sampling(), 11, 12).with_draft(DraftLength::Off),
            proposer: || Box::new(PromptLookup::new(1, 3).unwrap()),
            text: true,
        },
    ]
}

const GENERATOR: &[Pin] = &[
    // greedy prompt lookup chain
    Pin {
        tokens: &[
            2, 9, 8, 10, 7, 11, 4, 2, 1, 10, 11, 9, 8, 10, 7, 11, 4, 2, 1, 10, 11, 9, 8, 10, 7, 11,
            4, 2, 1, 10, 11, 9, 8, 10, 7, 11, 4, 2, 1, 10,
        ],
        finish: FinishReason::MaxTokens,
        text: Some("c��d.caabcbdca��d.caabcbdca��d.caabcbdca��d.caabcbd"),
        counts: [66, 23, 40, 17, 0],
    },
    // sampled draft-model chain (dense q)
    Pin {
        tokens: &[
            7, 3, 9, 3, 7, 2, 9, 8, 4, 4, 6, 5, 10, 7, 11, 1, 11, 7, 3, 2, 7, 8, 4, 4, 2, 1, 8, 7,
            6, 1, 7, 1, 2, 6, 3, 7, 2, 9, 8, 9,
        ],
        finish: FinishReason::MaxTokens,
        text: Some(". � .c��ababccbad.cabca. c.�ababcb�.ccb.bccc .c�é"),
        counts: [81, 11, 40, 29, 0],
    },
    // sampled suffix tree (point masses)
    Pin {
        tokens: &[
            9, 8, 9, 0, 7, 2, 9, 8, 5, 4, 4, 10, 9, 2, 0, 6, 6, 4, 11, 1, 11, 7, 6, 11, 1, 3, 10,
            0, 7, 2, 9, 10, 6, 1, 5, 4, 11, 6, 8, 4,
        ],
        finish: FinishReason::MaxTokens,
        text: Some("�éa.c��baababd�caccccabcabca.cccab da.c�dccbbaabcacc�ab"),
        counts: [151, 13, 40, 27, 20],
    },
    // sampled draft-model tree (dense q)
    Pin {
        tokens: &[
            1, 3, 10, 2, 2, 11, 0, 7, 2, 8, 1, 9, 1, 2, 6, 3, 6, 6, 4, 11, 1, 3, 10, 2, 1, 1, 8, 4,
            4, 5, 8, 6, 11, 7, 6, 11, 7, 6, 11, 0,
        ],
        finish: FinishReason::MaxTokens,
        text: Some("b dcccaa.c�b�bccc ccccabcab dcbb�ababba�ccca.ccca.cccaa"),
        counts: [282, 10, 40, 30, 29],
    },
    // adaptive chain, fixed costs
    Pin {
        tokens: &[
            8, 11, 5, 7, 6, 1, 9, 1, 11, 11, 9, 8, 2, 3, 4, 10, 10, 9, 6, 0, 4, 7, 5, 8, 1, 9, 1,
            9, 3, 7, 2, 9, 8, 4, 4, 2, 1, 8, 7, 6, 1, 7, 10, 9, 8, 4, 4, 2,
        ],
        finish: FinishReason::MaxTokens,
        text: Some("�caba.ccb�bcaca��c abdd�ccaab.ba�b�b� .c��ababcb�.ccb.d��ababc"),
        counts: [21, 0, 48, 48, 0],
    },
    // adaptive tree shape, fixed costs
    Pin {
        tokens: &[
            0, 4, 10, 1, 6, 7, 10, 11, 9, 0, 7, 2, 9, 8, 10, 9, 8, 2, 3, 4, 10, 3, 8, 4, 4, 5, 8,
            1, 8, 11, 5, 6, 8, 9, 8, 9, 3, 7, 2, 9, 8, 4, 4, 10, 3, 5, 0, 5,
        ],
        finish: FinishReason::MaxTokens,
        text: Some("aabdbcc.dca�a.c��d��c abd �ababba�b�cabaccéé .c��ababd baaba"),
        counts: [10, 1, 48, 47, 4],
    },
    // greedy stops with text and a floor
    Pin {
        tokens: &[1, 11, 11, 9, 8, 10, 7],
        finish: FinishReason::StopString,
        text: Some("bcaca��"),
        counts: [11, 0, 7, 7, 0],
    },
    // sampled stop strings in trees
    Pin {
        tokens: &[1, 9, 1, 11, 11],
        finish: FinishReason::StopString,
        text: Some("b�bcaca"),
        counts: [16, 3, 5, 2, 2],
    },
    // sampled one-token prompt, drafts off
    Pin {
        tokens: &[6, 6, 4, 11, 1, 11, 11, 9, 8, 10, 2, 2],
        finish: FinishReason::MaxTokens,
        text: Some("ccccabcabcaca��dcc"),
        counts: [0, 0, 12, 12, 0],
    },
];

const BATCH: &[Pin] = &[
    // greedy prompt lookup chain
    Pin {
        tokens: &[
            2, 9, 8, 10, 7, 11, 4, 2, 1, 10, 11, 9, 8, 10, 7, 11, 4, 2, 1, 10, 11, 9, 8, 10, 7, 11,
            4, 2, 1, 10, 11, 9, 8, 10, 7, 11, 4, 2, 1, 10,
        ],
        finish: FinishReason::MaxTokens,
        text: None,
        counts: [66, 23, 40, 17, 0],
    },
    // sampled draft-model chain (dense q)
    Pin {
        tokens: &[
            7, 3, 9, 3, 7, 2, 9, 8, 4, 4, 6, 5, 10, 7, 11, 1, 11, 7, 3, 2, 7, 8, 4, 4, 2, 1, 8, 7,
            6, 1, 7, 1, 2, 6, 3, 7, 2, 9, 8, 9,
        ],
        finish: FinishReason::MaxTokens,
        text: None,
        counts: [81, 11, 40, 29, 0],
    },
    // sampled suffix tree (point masses)
    Pin {
        tokens: &[
            9, 8, 9, 0, 7, 2, 9, 8, 5, 4, 4, 10, 9, 2, 0, 6, 6, 4, 11, 1, 11, 7, 6, 11, 1, 3, 10,
            0, 7, 2, 9, 10, 6, 1, 5, 4, 11, 6, 8, 4,
        ],
        finish: FinishReason::MaxTokens,
        text: None,
        counts: [151, 13, 40, 27, 20],
    },
    // sampled draft-model tree (dense q)
    Pin {
        tokens: &[
            1, 3, 10, 2, 2, 11, 0, 7, 2, 8, 1, 9, 1, 2, 6, 3, 6, 6, 4, 11, 1, 3, 10, 2, 1, 1, 8, 4,
            4, 5, 8, 6, 11, 7, 6, 11, 7, 6, 11, 0,
        ],
        finish: FinishReason::MaxTokens,
        text: None,
        counts: [282, 10, 40, 30, 29],
    },
    // adaptive chain, fixed costs
    Pin {
        tokens: &[
            8, 11, 5, 7, 6, 1, 9, 1, 11, 11, 9, 8, 2, 3, 4, 10, 10, 9, 6, 0, 4, 7, 5, 8, 1, 9, 1,
            9, 3, 7, 2, 9, 8, 4, 4, 2, 1, 8, 7, 6, 1, 7, 10, 9, 8, 4, 4, 2,
        ],
        finish: FinishReason::MaxTokens,
        text: None,
        counts: [11, 0, 48, 48, 0],
    },
    // adaptive tree shape, fixed costs
    Pin {
        tokens: &[
            0, 4, 10, 1, 2, 6, 3, 7, 2, 3, 4, 7, 3, 2, 3, 4, 10, 3, 5, 7, 6, 4, 11, 1, 11, 11, 9,
            5, 5, 10, 5, 1, 7, 10, 11, 9, 4, 7, 1, 6, 7, 11, 4, 11, 1, 3, 10, 10,
        ],
        finish: FinishReason::MaxTokens,
        text: None,
        counts: [23, 6, 48, 42, 0],
    },
    // greedy stops with text and a floor
    Pin {
        tokens: &[1, 11, 11, 9, 8, 10, 7],
        finish: FinishReason::StopString,
        text: Some("bcaca��"),
        counts: [11, 0, 7, 7, 0],
    },
    // sampled stop strings in trees
    Pin {
        tokens: &[1, 9, 1, 11, 11],
        finish: FinishReason::StopString,
        text: Some("b�bcaca"),
        counts: [16, 3, 5, 2, 2],
    },
    // sampled one-token prompt, drafts off
    Pin {
        tokens: &[6, 6, 4, 11, 1, 11, 11, 9, 8, 10, 2, 2],
        finish: FinishReason::MaxTokens,
        text: Some("ccccabcabcaca��dcc"),
        counts: [0, 0, 12, 12, 0],
    },
];

#[test]
fn generator_outputs_are_pinned() {
    // The pins (tokens and counts) are of the loop without the fused prefill; with it (the
    // default) the tokens are the same (checked below), but the adaptive policy learns no
    // forward cost from a fused step, which can change its later draft lengths.
    let mut g = Generator::new(target(), (cases()[0].proposer)())
        .with_costs(costs())
        .with_detokenizer(vocab())
        .with_fused_prefill(false);
    let mut fused = Generator::new(target(), (cases()[0].proposer)())
        .with_costs(costs())
        .with_detokenizer(vocab());
    let print = std::env::var_os("PIN_PRINT").is_some();
    for (i, c) in cases().into_iter().enumerate() {
        *g.proposer_mut() = (c.proposer)();
        *fused.proposer_mut() = (c.proposer)();
        // One generator for every case (its detokenizer tracks the text of each).
        let out = g.generate(&c.prompt, &c.params).unwrap();
        let out_fused = fused.generate(&c.prompt, &c.params).unwrap();
        assert_eq!(out_fused.tokens, out.tokens, "{}: fused prefill", c.name);
        assert_eq!(out_fused.text, out.text, "{}: fused prefill", c.name);
        let want = GENERATOR.get(i).unwrap_or(&Pin {
            tokens: &[],
            finish: FinishReason::Error,
            text: None,
            counts: [0; 5],
        });
        if !print {
            assert!(i < GENERATOR.len(), "case {i} is not pinned");
        }
        check(c.name, &out, want);
    }
}

#[test]
fn batch_outputs_are_pinned() {
    let slots = PerSlot::new((0..4).map(|_| target()).collect()).unwrap();
    // The pins (tokens and counts) are of the loop without prefix reuse; with it (the
    // default) a request that finds its prompt in a free slot prefills less, which changes the
    // steps and so the adaptive requests' draft lengths: the tokens are the same (checked
    // below) except where they depend on the draft lengths (dense-q drafts under the adaptive
    // policy; C15 makes only point-mass drafts independent of the draft length).
    let mut batch = BatchGenerator::new(slots)
        .with_costs(costs())
        .with_prefix_reuse(false);
    let mut ids = Vec::new();
    for c in cases() {
        let mut r = BatchRequest::new(c.prompt, c.params, (c.proposer)());
        if c.text {
            r = r.with_detokenizer(Box::new(vocab()));
        }
        ids.push((batch.submit(r).unwrap(), c.name));
    }
    let done = batch.run().unwrap();
    let print = std::env::var_os("PIN_PRINT").is_some();
    for (i, (id, name)) in ids.iter().enumerate() {
        let f = done.iter().find(|f| f.id == *id).unwrap();
        let out = f.result.as_ref().unwrap();
        let want = BATCH.get(i).unwrap_or(&Pin {
            tokens: &[],
            finish: FinishReason::Error,
            text: None,
            counts: [0; 5],
        });
        if !print {
            assert!(i < BATCH.len(), "case {i} is not pinned");
        }
        check(name, out, want);
    }
    let m = batch.metrics();
    if print {
        println!(
            "// batch metrics: [{}, {}, {}, {}, {}]",
            m.steps, m.rows, m.prefill_rows, m.draft_rows, m.emitted
        );
    } else {
        assert_eq!(
            [m.steps, m.rows, m.prefill_rows, m.draft_rows, m.emitted],
            BATCH_METRICS,
            "batch metrics"
        );
    }
}

/// With prefix reuse on, the batch's tokens are still the pinned ones.
#[test]
fn batch_tokens_are_pinned_with_prefix_reuse() {
    let slots = PerSlot::new((0..4).map(|_| target()).collect()).unwrap();
    let mut batch = BatchGenerator::new(slots).with_costs(costs());
    let mut ids = Vec::new();
    for c in cases() {
        let mut r = BatchRequest::new(c.prompt, c.params, (c.proposer)());
        if c.text {
            r = r.with_detokenizer(Box::new(vocab()));
        }
        ids.push((batch.submit(r).unwrap(), c.name));
    }
    let done = batch.run().unwrap();
    let mut checked = 0;
    for (i, (id, name)) in ids.iter().enumerate() {
        let f = done.iter().find(|f| f.id == *id).unwrap();
        let out = f.result.as_ref().unwrap();
        // A dense-q draft under the adaptive policy: its tokens follow its draft lengths.
        if *name == "adaptive tree shape, fixed costs" {
            continue;
        }
        checked += 1;
        assert_eq!(
            out.tokens, BATCH[i].tokens,
            "{name}: tokens with prefix reuse"
        );
        assert_eq!(
            out.text.as_deref(),
            BATCH[i].text,
            "{name}: text with prefix reuse"
        );
    }
    assert_eq!(checked, BATCH.len() - 1);
}

/// `[steps, rows, prefill_rows, draft_rows, emitted]` of the batch.
const BATCH_METRICS: [u64; 5] = [71, 960, 105, 641, 280];

/// Hidden-state features (the loop keeps the target's hidden rows for the proposer): a toy
/// recurrent target with a feature-conditioned draft model, chains and trees.
#[test]
fn feature_draft_outputs_are_pinned() {
    let rnn = ToyRnn::new(VOCAB, 6, 3.0, 21);
    let head = |tree: bool| {
        let m = ToyFeatureDraft::new(rnn.perturbed(0.3, 99), 1 << 16);
        let m = if tree { m.with_tree(32) } else { m };
        DraftModelProposer::new(m)
            .with_tree_config(DraftTreeConfig::default().with_beam(3).with_children(3))
            .unwrap()
    };
    let print = std::env::var_os("PIN_PRINT").is_some();
    for (i, tree) in [false, true].into_iter().enumerate() {
        let mut g = Generator::new(rnn.target(1 << 16).with_tree(32), head(tree));
        let mut params = GenerationParams::sampled(sampling(), 12 + i as u64, 40)
            .with_draft(DraftLength::Fixed(3));
        if tree {
            params = params.with_tree(TreeDrafts::nodes(9));
        }
        let out = g.generate(&prompt(8 + i, 10), &params).unwrap();
        let want = FEATURES.get(i).unwrap_or(&Pin {
            tokens: &[],
            finish: FinishReason::Error,
            text: None,
            counts: [0; 5],
        });
        if !print {
            assert!(i < FEATURES.len(), "case {i} is not pinned");
        }
        check(
            if tree {
                "features, tree"
            } else {
                "features, chain"
            },
            &out,
            want,
        );
    }
}

const FEATURES: &[Pin] = &[
    // features, chain
    Pin {
        tokens: &[
            5, 7, 8, 3, 5, 2, 1, 1, 6, 5, 5, 3, 5, 2, 4, 9, 6, 5, 8, 3, 8, 2, 1, 10, 6, 10, 8, 10,
            5, 10, 6, 10, 10, 11, 10, 11, 4, 0, 11, 0,
        ],
        finish: FinishReason::MaxTokens,
        text: None,
        counts: [53, 22, 40, 18, 0],
    },
    // features, tree
    Pin {
        tokens: &[
            9, 5, 3, 6, 5, 3, 8, 3, 5, 3, 6, 5, 5, 2, 1, 3, 1, 5, 3, 3, 6, 5, 5, 2, 6, 5, 10, 5, 2,
            1, 8, 3, 3, 6, 5, 5, 2, 1, 6, 5,
        ],
        finish: FinishReason::MaxTokens,
        text: None,
        counts: [120, 26, 40, 14, 14],
    },
];
