//! The EAGLE draft head on the real model (needs `models/SmolLM2-135M-Instruct.Q4_1.gguf`;
//! run `scripts/fetch-model.sh` first): batch invariance of its forward (one call against
//! several, trees against chains), the feature hand-over, the shipped weights' checksum, the
//! training script's first losses from a fixed seed, and greedy speculative output with the
//! head (chains and EAGLE-2 trees, alone and merged) equal to plain greedy output.

mod common;

use common::{chat, fast_weights, tokenizer};

use std::collections::BTreeMap;
use std::sync::Arc;

use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions, TreeDrafts};
use speculative::propose::{
    DraftModelProposer, MergedProposer, PromptLookup, SuffixConfig, SuffixProposer,
};
use speculative::{DraftBlock, HiddenStates, Proposer, TargetFeatures, TargetModel};
use speculative_candle::fast::head::{DraftHead, DraftHeadWeights, HEAD_TENSORS, HeadTensors};
use speculative_candle::train::{
    Dataset, SplitMix, TrainConfig, Trainer, feature_rms, record_features,
};
use speculative_candle::{FastTarget, default_head_path};

/// A head with random weights (std 0.05) over the 2,000 lowest ids plus some high ones.
fn random_head(seed: u64) -> Arc<DraftHeadWeights> {
    let w = fast_weights();
    let c = w.config();
    let (h, d) = (c.hidden_size, c.head_dim);
    let (nh, nkv, f) = (4, 2, 256);
    let mut rng = SplitMix::new(seed);
    let mut t = HeadTensors::default();
    let shapes: [(&str, Vec<usize>); 12] = [
        ("fc.weight", vec![h, 2 * h]),
        ("fc.bias", vec![h]),
        ("attn_norm.weight", vec![h]),
        ("attn_q.weight", vec![nh * d, h]),
        ("attn_k.weight", vec![nkv * d, h]),
        ("attn_v.weight", vec![nkv * d, h]),
        ("attn_output.weight", vec![h, nh * d]),
        ("ffn_norm.weight", vec![h]),
        ("ffn_gate.weight", vec![f, h]),
        ("ffn_up.weight", vec![f, h]),
        ("ffn_down.weight", vec![h, f]),
        ("output_norm.weight", vec![h]),
    ];
    for (name, shape) in shapes {
        let n: usize = shape.iter().product();
        let norm = name.ends_with("norm.weight");
        let v = (0..n)
            .map(|_| {
                if norm {
                    1.0 + 0.1 * rng.normal() as f32
                } else {
                    0.05 * rng.normal() as f32
                }
            })
            .collect();
        t.tensors.insert(name.into(), (shape, v));
    }
    t.vocab_ids = (0..2000).chain(40_000..40_100).collect();
    DraftHeadWeights::from_tensors(&t, w).expect("random head")
}

fn features_of(tokens: &[u32]) -> Vec<f32> {
    let mut t = FastTarget::new(fast_weights());
    record_features(&mut t, tokens).unwrap()
}

#[test]
fn head_forward_is_batch_invariant_with_target_and_predicted_features() {
    let hw = random_head(1);
    let h = hw.config().hidden_size;
    let tokens = chat("Name three rivers in Europe.");
    let feats = features_of(&tokens);
    let n = tokens.len();
    // Features known for the first n - 4 positions: the last rows read predicted features.
    let known = n - 4;
    let mut one = DraftHead::new(hw.clone());
    one.set_target_hidden(0, &feats[..known * h]).unwrap();
    let mut all = Vec::new();
    one.forward(&tokens, &mut all).unwrap();
    let vocab = one.vocab_size();
    assert_eq!(all.len(), n * vocab);
    // Token by token, and in uneven chunks: the same bits.
    for chunks in [vec![1; n], vec![5, 1, 7, n - 13]] {
        let mut m = DraftHead::new(hw.clone());
        m.set_target_hidden(0, &feats[..known * h]).unwrap();
        let mut got = Vec::new();
        let mut at = 0;
        for c in chunks {
            let mut l = Vec::new();
            m.forward(&tokens[at..at + c], &mut l).unwrap();
            got.extend(l);
            at += c;
        }
        assert!(got == all, "chunked forward differs");
    }
    // Outside the subset: -inf; inside: finite.
    assert!(
        all[..vocab][2000..40_000]
            .iter()
            .all(|&x| x == f32::NEG_INFINITY)
    );
    assert!(all[..vocab][..2000].iter().all(|x| x.is_finite()));
}

#[test]
fn head_tree_rows_equal_chain_rows_of_their_paths() {
    let hw = random_head(2);
    let h = hw.config().hidden_size;
    let tokens = chat("Describe a rainy day in two sentences.");
    let feats = features_of(&tokens);
    let n = tokens.len();
    // Context: all but the last token; the root is the last token.
    let ctx = &tokens[..n - 1];
    let root = tokens[n - 1];
    let nodes = [11u32, 12, 13, 14, 15, 16, 17];
    let parents = [0u32, 0, 1, 1, 3, 2, 6];
    let block = DraftBlock::tree(&nodes, &parents);
    let mut m = DraftHead::new(hw.clone());
    m.set_target_hidden(0, &feats[..(n - 1) * h]).unwrap();
    m.prefill(ctx).unwrap();
    let mut tree_logits = Vec::new();
    m.tree()
        .unwrap()
        .forward_tree(root, &block, &mut tree_logits)
        .unwrap();
    let vocab = m.vocab_size();
    for (i, _) in nodes.iter().enumerate() {
        // The path of node i.
        let mut path = vec![nodes[i]];
        let mut p = parents[i] as usize;
        while p != 0 {
            path.push(nodes[p - 1]);
            p = parents[p - 1] as usize;
        }
        path.reverse();
        let mut c = DraftHead::new(hw.clone());
        c.set_target_hidden(0, &feats[..(n - 1) * h]).unwrap();
        c.prefill(ctx).unwrap();
        let mut chain = vec![root];
        chain.extend(&path);
        let mut l = Vec::new();
        c.forward(&chain, &mut l).unwrap();
        let last = &l[(chain.len() - 1) * vocab..];
        assert!(
            &tree_logits[(i + 1) * vocab..(i + 2) * vocab] == last,
            "node {i} differs from its chain"
        );
    }
    // Commit a path: the next forward equals the chain's.
    m.tree().unwrap().commit_tree(&[0, 2, 4]).unwrap();
    assert_eq!(m.seq_len(), n + 3);
    let mut a = Vec::new();
    m.forward(&[99], &mut a).unwrap();
    let mut c = DraftHead::new(hw);
    c.set_target_hidden(0, &feats[..(n - 1) * h]).unwrap();
    c.prefill(ctx).unwrap();
    let mut b = Vec::new();
    c.forward(&[root, 11, 13, 15, 99], &mut b).unwrap();
    assert!(a[..] == b[4 * vocab..], "after commit_tree");
}

#[test]
fn setting_features_drops_rows_built_on_predictions() {
    let hw = random_head(3);
    let h = hw.config().hidden_size;
    let tokens = chat("Count to five.");
    let feats = features_of(&tokens);
    let n = tokens.len();
    let mut m = DraftHead::new(hw.clone());
    m.set_target_hidden(0, &feats[..(n - 3) * h]).unwrap();
    m.prefill(&tokens).unwrap();
    assert_eq!(m.target_hidden_len(), n - 3);
    // More features arrive from position n - 3: rows past n - 2 read predictions and go.
    m.set_target_hidden(n - 3, &feats[(n - 3) * h..(n - 1) * h])
        .unwrap();
    assert_eq!(m.seq_len(), n - 2);
    assert_eq!(m.target_hidden_len(), n - 1);
    let mut a = Vec::new();
    m.forward(&tokens[n - 2..], &mut a).unwrap();
    let mut c = DraftHead::new(hw);
    c.set_target_hidden(0, &feats[..(n - 1) * h]).unwrap();
    let mut b = Vec::new();
    c.forward(&tokens, &mut b).unwrap();
    let vocab = c.vocab_size();
    assert!(a[..] == b[(n - 2) * vocab..]);
    // Bad input: a gap, a ragged row.
    assert!(m.set_target_hidden(n, &feats[..h]).is_err());
    assert!(m.set_target_hidden(0, &feats[..h - 1]).is_err());
}

#[test]
fn head_file_round_trip_and_bad_files() {
    let hw = random_head(4);
    let _ = hw;
    let dir = std::env::temp_dir().join(format!("spec-head-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("h.safetensors");
    let mut t = HeadTensors::default();
    t.tensors
        .insert("fc.bias".into(), (vec![3], vec![1.0, -2.5, 0.333]));
    t.vocab_ids = vec![5, 7];
    t.metadata = BTreeMap::from([("seed".to_string(), "9".to_string())]);
    t.write(&path, true).unwrap();
    let r = HeadTensors::read(&path).unwrap();
    assert_eq!(r.vocab_ids, vec![5, 7]);
    assert_eq!(r.metadata.get("seed").map(String::as_str), Some("9"));
    let v = &r.tensors["fc.bias"].1;
    assert!((v[2] - 0.333).abs() < 1e-3 && v[1] == -2.5);
    // Missing tensors: a typed error, not a panic.
    assert!(DraftHeadWeights::from_tensors(&r, fast_weights()).is_err());
    std::fs::write(dir.join("bad.safetensors"), b"not a file").unwrap();
    assert!(HeadTensors::read(dir.join("bad.safetensors")).is_err());
    assert!(HeadTensors::read(dir.join("missing.safetensors")).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// sha256 of the shipped head, as recorded next to it.
#[test]
fn shipped_head_matches_its_checksum_and_loads() {
    use sha2::Digest;
    let path = default_head_path();
    let bytes = std::fs::read(&path).expect("the shipped head");
    let sum = format!("{:x}", sha2::Sha256::digest(&bytes));
    let want = std::fs::read_to_string(path.with_extension("safetensors.sha256")).unwrap();
    assert_eq!(sum, want.split_whitespace().next().unwrap());
    assert!(bytes.len() <= 16 << 20, "{} bytes", bytes.len());
    let hw = DraftHeadWeights::load(&path, fast_weights()).unwrap();
    assert_eq!(hw.config().hidden_size, 576);
    assert!(hw.vocab_ids().len() >= 1024);
    // Every tensor is stored in f16.
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for name in HEAD_TENSORS {
        assert_eq!(
            st.tensor(name).unwrap().dtype(),
            safetensors::Dtype::F16,
            "{name}"
        );
    }
}

/// The training script's settings on a small, fixed dataset: the first losses are those
/// recorded in `heads/ci-losses.json` (regenerate with `SPECULATIVE_RECORD_LOSSES=1`).
#[test]
fn training_first_steps_reproduce_the_committed_losses() {
    let w = fast_weights();
    let mut target = FastTarget::new(w.clone());
    let prompts = [
        "Tell me about the sea.",
        "Write a Python function that adds two numbers.",
        "Rewrite in the past tense: I walk to school.",
        "What is two plus three?",
    ];
    let eos = tokenizer().eos_id();
    let mut data = Dataset {
        hidden: w.config().hidden_size,
        seqs: Vec::new(),
    };
    for p in prompts {
        let prompt = chat(p);
        let params = GenerationParams::greedy(24)
            .with_stop(StopConditions::eos(eos))
            .unwrap();
        let out = Generator::new(&mut target, speculative::NoProposer)
            .generate(&prompt, &params)
            .unwrap();
        let mut tokens = prompt.clone();
        tokens.extend(&out.tokens);
        let f = record_features(&mut target, &tokens).unwrap();
        data.seqs.push(speculative_candle::train::Sequence {
            prompt_len: prompt.len(),
            temperature: 0.0,
            features: f.iter().map(|&x| half::f16::from_f32(x)).collect(),
            tokens,
        });
    }
    let mut counts = vec![0u64; w.config().vocab_size];
    for s in &data.seqs {
        for &t in &s.tokens {
            counts[t as usize] += 1;
        }
    }
    let ids = speculative_candle::fast::head::frequency_ranked(&counts, 512);
    let cfg = TrainConfig {
        steps: 3,
        batch_tokens: 256,
        ffn_size: 256,
        ..TrainConfig::default()
    };
    let mut tr = Trainer::new(cfg, w, ids).unwrap();
    tr.set_feature_rms(feature_rms(&data, 10));
    let mut pool: Vec<usize> = (0..data.seqs.len()).collect();
    let mut cursor = 0;
    let mut losses = Vec::new();
    for _ in 0..3 {
        let idx = tr.next_batch(&data, &mut pool, &mut cursor);
        losses.push(tr.step(&data, &idx).unwrap().total);
    }
    assert!(losses.iter().all(|l| l.is_finite()));
    let path = default_head_path().with_file_name("ci-losses.json");
    if std::env::var_os("SPECULATIVE_RECORD_LOSSES").is_some() {
        std::fs::write(&path, serde_json::to_string(&losses).unwrap() + "\n").unwrap();
        return;
    }
    let want: Vec<f64> =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("ci-losses.json")).unwrap();
    assert_eq!(want.len(), losses.len());
    for (g, w) in losses.iter().zip(&want) {
        assert!(
            (g - w).abs() <= 1e-4 * w.abs().max(1.0),
            "losses {losses:?}, committed {want:?}"
        );
    }
    // Training moves the loss.
    assert!(losses[2] < losses[0], "{losses:?}");
}

const PROMPTS: [&str; 3] = [
    "What is a good way to learn to play the guitar?",
    "Write a short story about a lost umbrella.",
    "Rewrite this sentence in the passive voice: The committee approved the budget, the \
     committee rejected the plan, and the committee postponed the vote.",
];

fn head_proposer() -> DraftModelProposer<DraftHead> {
    let hw = DraftHeadWeights::load(default_head_path(), fast_weights()).expect("shipped head");
    DraftModelProposer::new(DraftHead::new(hw))
}

#[test]
fn greedy_output_with_the_head_equals_plain_greedy() {
    let w = fast_weights();
    let eos = tokenizer().eos_id();
    let base = GenerationParams::greedy(64)
        .with_stop(StopConditions::eos(eos))
        .unwrap();
    let mut accepted = 0;
    for q in PROMPTS {
        let prompt = chat(q);
        let mut t = FastTarget::new(w.clone());
        let plain = Generator::new(&mut t, speculative::NoProposer)
            .generate(&prompt, &base.clone().with_draft(DraftLength::Off))
            .unwrap();
        let configs: [(&str, GenerationParams); 3] = [
            ("chain k=4", base.clone().with_draft(DraftLength::Fixed(4))),
            (
                "tree 16",
                base.clone()
                    .with_draft(DraftLength::Fixed(6))
                    .with_tree(TreeDrafts::nodes(16)),
            ),
            (
                "adaptive",
                base.clone()
                    .with_draft(DraftLength::Adaptive(Default::default())),
            ),
        ];
        for (name, params) in configs {
            let mut t = FastTarget::new(w.clone());
            let out = Generator::new(&mut t, head_proposer())
                .generate(&prompt, &params)
                .unwrap();
            assert_eq!(out.tokens, plain.tokens, "{name}: {q}");
            accepted += out.metrics.accepted;
        }
        // Merged with the model-free proposers.
        let merged: Box<dyn Proposer + Send> = Box::new(
            MergedProposer::new(vec![
                Box::new(head_proposer()),
                Box::new(PromptLookup::new(1, 4).unwrap()),
                Box::new(SuffixProposer::new(SuffixConfig::default()).unwrap()),
            ])
            .unwrap(),
        );
        let mut t = FastTarget::new(w.clone());
        let params = base
            .clone()
            .with_draft(DraftLength::Fixed(6))
            .with_tree(TreeDrafts::nodes(24));
        let out = Generator::new(&mut t, merged)
            .generate(&prompt, &params)
            .unwrap();
        assert_eq!(out.tokens, plain.tokens, "merged: {q}");
    }
    // The trained head predicts: a random head would accept next to nothing.
    assert!(accepted > 100, "accepted {accepted}");
    let _ = HiddenStates::hidden_size(&FastTarget::new(w));
}
