//! The EAGLE-3 draft head (`speculative-eagle3-head-v1`): file round trip and bad files, the
//! fusion path against a closed-form reference (target rows read `fc3 · [a; b; c]`, drafted
//! rows the head's pre-norm output `w`), bit-identity with an EAGLE-1 head when `fc3` selects
//! one block, batch invariance and trees on a tiny random target, layout checks, and (with
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf`; skipped without it) greedy speculative output
//! with a random EAGLE-3 head equal to plain greedy, chains and trees.

mod common;

use std::sync::Arc;

use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions, TreeDrafts};
use speculative::propose::DraftModelProposer;
use speculative::{DraftBlock, FeatureLayout, TargetFeatures, TargetModel, check_feature_layouts};
use speculative_candle::fast::RandomSpec;
use speculative_candle::fast::head::{
    DraftHead, DraftHeadConfig, DraftHeadWeights, FC3_TENSOR, FEATURE_LAYERS_KEY, HeadFormat,
    HeadTensors, parse_feature_layers,
};
use speculative_candle::{CandleError, FastFormat, FastTarget, FastWeights, default_model_path};

fn tiny(format: FastFormat) -> Arc<FastWeights> {
    FastWeights::random(&RandomSpec::default(), format).unwrap()
}

/// Every residual state of the tiny 2-layer target, as an EAGLE-3 layout.
fn tiny_layout(w: &FastWeights) -> FeatureLayout {
    parse_feature_layers("0,1,2", w.config().hidden_size).unwrap()
}

fn shape(w: &FastWeights) -> DraftHeadConfig {
    let c = w.config();
    DraftHeadConfig {
        hidden_size: c.hidden_size,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: c.head_dim,
        ffn_size: 48,
        subset: 0,
    }
}

fn ids() -> Vec<u32> {
    (0..200).chain(250..260).collect()
}

/// The target's `[n, row_width]` feature rows of `tokens` for `layout`.
fn target_rows(w: &Arc<FastWeights>, layout: &FeatureLayout, tokens: &[u32]) -> Vec<f32> {
    let mut t = FastTarget::new(w.clone())
        .with_feature_layout(layout.clone())
        .unwrap();
    t.prefill(tokens).unwrap();
    t.hidden_states().unwrap().last_hidden().unwrap().to_vec()
}

fn tokens() -> Vec<u32> {
    (0..14).map(|i| (i * 53 + 7) % 301).collect()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("spec-e3-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn eagle3_file_round_trips_and_bad_files_are_refused() {
    let w = tiny(FastFormat::Q8);
    let layout = tiny_layout(&w);
    let t = HeadTensors::random(&shape(&w), Some(&layout), ids(), 0.05, 7).unwrap();
    assert_eq!(t.format(), HeadFormat::Eagle3);
    let dir = tmp("files");
    let path = dir.join("e3.safetensors");
    t.write(&path, false).unwrap();
    let r = HeadTensors::read(&path).unwrap();
    assert_eq!(r, t, "f32 round trip");
    t.write(&path, true).unwrap();
    let hw = DraftHeadWeights::load(&path, w.clone()).unwrap();
    assert_eq!(hw.format(), HeadFormat::Eagle3);
    assert_eq!(hw.feature_layout(), layout);
    let st_bytes = std::fs::read(&path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&st_bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    assert_eq!(meta["format"], "speculative-eagle3-head-v1");
    assert_eq!(meta[FEATURE_LAYERS_KEY], "0,1,2");
    // An EAGLE-1 file stays EAGLE-1.
    let v1 = HeadTensors::random(&shape(&w), None, ids(), 0.05, 7).unwrap();
    v1.write(dir.join("e1.safetensors"), true).unwrap();
    let hw1 = DraftHeadWeights::load(dir.join("e1.safetensors"), w.clone()).unwrap();
    assert_eq!(hw1.format(), HeadFormat::Eagle1);
    // Bad tensors: typed errors.
    let mut bad = t.clone();
    bad.tensors.get_mut(FC3_TENSOR).unwrap().0 = vec![96, 192];
    bad.tensors
        .get_mut(FC3_TENSOR)
        .unwrap()
        .1
        .truncate(96 * 192);
    assert!(matches!(
        DraftHeadWeights::from_tensors(&bad, w.clone()),
        Err(CandleError::Tensor { .. })
    ));
    let mut bad = t.clone();
    bad.metadata.remove(FEATURE_LAYERS_KEY);
    assert!(DraftHeadWeights::from_tensors(&bad, w.clone()).is_err());
    let mut bad = t.clone();
    bad.metadata
        .insert(FEATURE_LAYERS_KEY.into(), "0,1,3".into());
    assert!(
        DraftHeadWeights::from_tensors(&bad, w.clone()).is_err(),
        "past the last layer"
    );
    let mut bad = v1.clone();
    bad.metadata
        .insert(FEATURE_LAYERS_KEY.into(), "0,1,2".into());
    assert!(
        DraftHeadWeights::from_tensors(&bad, w.clone()).is_err(),
        "layers without fc3"
    );
    // A file whose format says EAGLE-3 but holds no fc3.
    let mut lie = std::collections::HashMap::new();
    lie.insert(
        "format".to_string(),
        "speculative-eagle3-head-v1".to_string(),
    );
    let ids_bytes: Vec<u8> = [1u32, 2].iter().flat_map(|x| x.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![2], &ids_bytes).unwrap();
    let bytes = safetensors::serialize(vec![("vocab_ids", view)], Some(lie)).unwrap();
    std::fs::write(dir.join("lie.safetensors"), bytes).unwrap();
    assert!(matches!(
        HeadTensors::read(dir.join("lie.safetensors")),
        Err(CandleError::CorruptModel { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

fn rms_norm(x: &[f32], g: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(g).map(|(v, g)| v * s * g).collect()
}

fn matvec(m: &[f32], x: &[f32]) -> Vec<f32> {
    m.chunks_exact(x.len())
        .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// The head's outputs `w_p` of a head whose attention and MLP add nothing (`wo = 0`,
/// `W_down = 0`): `w_p = u_p = fc [g_{p-1}; e(x_p)] + b`, with `g` the target rows' fc3
/// product for `p - 1 < known`, else the previous `w` (or, with `feed_normed`, EAGLE-1's
/// rule: the previous normed output).
fn reference_w(
    t: &HeadTensors,
    w: &FastWeights,
    toks: &[u32],
    rows: &[f32],
    known: usize,
    feed_normed: bool,
) -> Vec<Vec<f32>> {
    let h = w.config().hidden_size;
    let eps = w.config().rms_eps as f32;
    let (fc, b) = (&t.tensors["fc.weight"].1, &t.tensors["fc.bias"].1);
    let (fc3, g_out) = (&t.tensors[FC3_TENSOR].1, &t.tensors["output_norm.weight"].1);
    let mut out: Vec<Vec<f32>> = Vec::new();
    for (p, &x) in toks.iter().enumerate() {
        let g = match p {
            0 => vec![0.0; h],
            _ if p - 1 < known => matvec(fc3, &rows[(p - 1) * 3 * h..p * 3 * h]),
            _ if feed_normed => rms_norm(&out[p - 1], g_out, eps),
            _ => out[p - 1].clone(),
        };
        let mut e = vec![0.0; h];
        w.embedding_row(x, &mut e).unwrap();
        let input: Vec<f32> = g.into_iter().chain(e).collect();
        let u = matvec(fc, &input)
            .iter()
            .zip(b)
            .map(|(a, b)| a + b)
            .collect();
        out.push(u);
    }
    out
}

/// Largest |difference| between the head's logits over the subset and the reference rows'.
fn logits_gap(head: &[f32], refw: &[Vec<f32>], t: &HeadTensors, w: &FastWeights, p: usize) -> f32 {
    let (h, vocab) = (w.config().hidden_size, w.config().vocab_size);
    let eps = w.config().rms_eps as f32;
    let f = rms_norm(&refw[p], &t.tensors["output_norm.weight"].1, eps);
    let mut row = vec![0.0; h];
    let mut gap = 0f32;
    for &id in &t.vocab_ids {
        w.output_row(id, &mut row).unwrap();
        let want: f32 = row.iter().zip(&f).map(|(a, b)| a * b).sum();
        gap = gap.max((head[p * vocab + id as usize] - want).abs());
    }
    gap
}

#[test]
fn fusion_reads_fc3_of_target_rows_and_w_at_drafted_rows() {
    let w = tiny(FastFormat::F32);
    let layout = tiny_layout(&w);
    let mut t = HeadTensors::random(&shape(&w), Some(&layout), ids(), 0.2, 11).unwrap();
    for zero in ["attn_output.weight", "ffn_down.weight"] {
        t.tensors.get_mut(zero).unwrap().1.fill(0.0);
    }
    let hw = DraftHeadWeights::from_tensors(&t, w.clone()).unwrap();
    let toks = tokens();
    let n = toks.len();
    let known = n - 5;
    let rows = target_rows(&w, &layout, &toks);
    let mut head = DraftHead::new(hw);
    assert_eq!(
        TargetFeatures::hidden_size(&head),
        3 * w.config().hidden_size
    );
    head.set_target_hidden(0, &rows[..known * 3 * w.config().hidden_size])
        .unwrap();
    let mut logits = Vec::new();
    head.forward(&toks, &mut logits).unwrap();
    let eagle3 = reference_w(&t, &w, &toks, &rows, known, false);
    let eagle1_rule = reference_w(&t, &w, &toks, &rows, known, true);
    for p in 0..n {
        let gap = logits_gap(&logits, &eagle3, &t, &w, p);
        assert!(gap < 1e-3, "row {p}: {gap}");
        // Drafted rows past the first read `w`, not the normed output.
        if p > known {
            let other = logits_gap(&logits, &eagle1_rule, &t, &w, p);
            assert!(other > 1e-2, "row {p} also fits EAGLE-1's rule: {other}");
        }
    }
}

#[test]
fn fc3_selecting_the_last_block_equals_an_eagle1_head_on_target_rows() {
    let w = tiny(FastFormat::F32);
    let h = w.config().hidden_size;
    let layout = tiny_layout(&w);
    let mut t3 = HeadTensors::random(&shape(&w), Some(&layout), ids(), 0.1, 5).unwrap();
    let fc3 = &mut t3.tensors.get_mut(FC3_TENSOR).unwrap().1;
    fc3.fill(0.0);
    for i in 0..h {
        fc3[i * 3 * h + 2 * h + i] = 1.0;
    }
    let mut t1 = t3.clone();
    t1.tensors.remove(FC3_TENSOR);
    t1.metadata.remove(FEATURE_LAYERS_KEY);
    let toks = tokens();
    let n = toks.len();
    let known = n - 4;
    let rows = target_rows(&w, &layout, &toks);
    let last: Vec<f32> = rows
        .chunks_exact(3 * h)
        .flat_map(|r| r[2 * h..].to_vec())
        .collect();
    let run = |t: &HeadTensors, feats: &[f32]| {
        let mut m = DraftHead::new(DraftHeadWeights::from_tensors(t, w.clone()).unwrap());
        m.set_target_hidden(0, feats).unwrap();
        let mut l = Vec::new();
        m.forward(&toks, &mut l).unwrap();
        l
    };
    let l3 = run(&t3, &rows[..known * 3 * h]);
    let l1 = run(&t1, &last[..known * h]);
    let vocab = w.config().vocab_size;
    // Rows 0 ..= known read zeros or target rows: the same bits.
    assert!(l3[..(known + 1) * vocab] == l1[..(known + 1) * vocab]);
    // Later rows read w (EAGLE-3) or f^ (EAGLE-1).
    assert!(l3[(known + 1) * vocab..] != l1[(known + 1) * vocab..]);
}

fn tiny_head(seed: u64) -> (Arc<FastWeights>, Arc<DraftHeadWeights>) {
    let w = tiny(FastFormat::Q8);
    let t = HeadTensors::random(&shape(&w), Some(&tiny_layout(&w)), ids(), 0.1, seed).unwrap();
    let hw = DraftHeadWeights::from_tensors(&t, w.clone()).unwrap();
    (w, hw)
}

#[test]
fn eagle3_head_is_batch_invariant_and_trees_equal_chains() {
    let (w, hw) = tiny_head(21);
    let layout = tiny_layout(&w);
    let rw = layout.row_width();
    let toks = tokens();
    let n = toks.len();
    let rows = target_rows(&w, &layout, &toks);
    let known = n - 4;
    let fresh = || {
        let mut m = DraftHead::new(hw.clone());
        m.set_target_hidden(0, &rows[..known * rw]).unwrap();
        m
    };
    let mut all = Vec::new();
    fresh().forward(&toks, &mut all).unwrap();
    let mut m = fresh();
    let mut got = Vec::new();
    for c in toks.chunks(3) {
        let mut l = Vec::new();
        m.forward(c, &mut l).unwrap();
        got.extend(l);
    }
    assert!(got == all, "chunked forward differs");
    // Rows handed over one call at a time project to the same bits.
    let mut m = DraftHead::new(hw.clone());
    for p in 0..known {
        m.set_target_hidden(p, &rows[p * rw..(p + 1) * rw]).unwrap();
    }
    let mut l = Vec::new();
    m.forward(&toks, &mut l).unwrap();
    assert!(l == all, "row-by-row hand-over differs");
    // A tree after the context: each node's logits are its chain's.
    let (ctx, root) = (&toks[..known], toks[known]);
    let nodes = [11u32, 12, 13, 14, 15];
    let parents = [0u32, 0, 1, 1, 3];
    let vocab = w.config().vocab_size;
    let mut m = fresh();
    m.prefill(ctx).unwrap();
    let mut tl = Vec::new();
    m.tree()
        .unwrap()
        .forward_tree(root, &DraftBlock::tree(&nodes, &parents), &mut tl)
        .unwrap();
    for i in 0..nodes.len() {
        let mut path = vec![nodes[i]];
        let mut p = parents[i] as usize;
        while p != 0 {
            path.push(nodes[p - 1]);
            p = parents[p - 1] as usize;
        }
        path.reverse();
        let mut c = fresh();
        c.prefill(ctx).unwrap();
        let chain: Vec<u32> = std::iter::once(root).chain(path).collect();
        let mut cl = Vec::new();
        c.forward(&chain, &mut cl).unwrap();
        assert!(
            tl[(i + 1) * vocab..(i + 2) * vocab] == cl[(chain.len() - 1) * vocab..],
            "node {i}"
        );
    }
    m.tree().unwrap().commit_tree(&[0, 2, 4]).unwrap();
    let mut a = Vec::new();
    m.forward(&[99], &mut a).unwrap();
    let mut c = fresh();
    c.prefill(ctx).unwrap();
    let mut b = Vec::new();
    c.forward(&[root, 11, 13, 15, 99], &mut b).unwrap();
    assert!(a[..] == b[4 * vocab..], "after commit_tree");
}

#[test]
fn layouts_must_match() {
    let (w, hw) = tiny_head(22);
    let h = w.config().hidden_size;
    let layout = tiny_layout(&w);
    assert!(hw.check_target_layout(&layout).is_ok());
    assert!(matches!(
        hw.check_target_layout(&FeatureLayout::final_only(h)),
        Err(CandleError::FeatureLayoutMismatch { .. })
    ));
    let other = parse_feature_layers("0,2,1", h).unwrap();
    assert!(hw.check_target_layout(&other).is_err(), "order matters");
    let mut head = DraftHead::new(hw);
    let e3 = FastTarget::new(w.clone())
        .with_feature_layout(layout)
        .unwrap();
    let plain = FastTarget::new(w.clone());
    let tf = head.target_features().unwrap();
    assert!(check_feature_layouts(e3.hidden_states().unwrap(), &*tf).is_ok());
    assert!(check_feature_layouts(plain.hidden_states().unwrap(), &*tf).is_err());
    // Rows of the final hidden state only: not a whole number of [3h] rows.
    assert!(tf.set_target_hidden(0, &vec![0.0; h]).is_err());
    assert!(tf.set_target_hidden(0, &vec![0.0; 3 * h]).is_ok());
}

/// Greedy output with a random EAGLE-3 head over the real model's EAGLE-3 features equals
/// plain greedy output, chains and trees (the head drafts badly; output must not change).
#[test]
fn greedy_output_with_a_random_eagle3_head_equals_plain_greedy() {
    if !default_model_path().is_file() {
        eprintln!(
            "skipped: no model file at {}",
            default_model_path().display()
        );
        return;
    }
    let w = common::fast_weights();
    let c = w.config();
    let layout = FeatureLayout::eagle3(c.n_layers, c.hidden_size).unwrap();
    let shape = DraftHeadConfig {
        hidden_size: c.hidden_size,
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: c.head_dim,
        ffn_size: 256,
        subset: 0,
    };
    let sub: Vec<u32> = (0..4000).collect();
    let t = HeadTensors::random(&shape, Some(&layout), sub, 0.05, 29).unwrap();
    let hw = DraftHeadWeights::from_tensors(&t, w.clone()).unwrap();
    let eos = common::tokenizer().eos_id();
    let base = GenerationParams::greedy(40)
        .with_stop(StopConditions::eos(eos))
        .unwrap();
    let prompt = common::chat("Write two sentences about the sea.");
    let mut t0 = FastTarget::new(w.clone());
    let plain = Generator::new(&mut t0, speculative::NoProposer)
        .generate(&prompt, &base.clone().with_draft(DraftLength::Off))
        .unwrap();
    let configs = [
        ("chain k=4", base.clone().with_draft(DraftLength::Fixed(4))),
        (
            "tree 12",
            base.clone()
                .with_draft(DraftLength::Fixed(4))
                .with_tree(TreeDrafts::nodes(12)),
        ),
    ];
    for (name, params) in configs {
        let target = FastTarget::new(w.clone())
            .with_feature_layout(layout.clone())
            .unwrap();
        let head = DraftHead::new(hw.clone());
        hw.check_target_layout(&target.hidden_states().unwrap().feature_layout())
            .unwrap();
        let mut g = Generator::new(target, DraftModelProposer::new(head));
        let out = g.generate(&prompt, &params).unwrap();
        assert_eq!(out.tokens, plain.tokens, "{name}");
        assert!(out.metrics.proposed > 0, "{name}: the head drafted");
    }
}
