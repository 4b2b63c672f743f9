//! `distil::dump_features` on the real model (skipped without
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf`): a dump of two short records has the documented
//! shapes, its feature rows are the target's EAGLE-3 rows (in f16), its embeddings the
//! target's, and `final · output_rows^T` picks the target's greedy next token.

mod common;

use std::collections::HashMap;

use speculative::decode::{GenerationParams, Generator};
use speculative::{FeatureLayout, TargetModel};
use speculative_candle::distil::{
    DumpConfig, LM_HEAD_FILE, TurnRecord, dump_features, feature_file_name,
};
use speculative_candle::{FastTarget, default_model_path};

fn record(prompt: &str, answer: usize) -> TurnRecord {
    let w = common::fast_weights();
    let p = common::chat(prompt);
    let mut t = FastTarget::new(w);
    let out = Generator::new(&mut t, speculative::NoProposer)
        .generate(&p, &GenerationParams::greedy(answer))
        .unwrap();
    TurnRecord {
        conv: 0,
        turn: 0,
        kind: "chat".into(),
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        answer_start: p.len(),
        finish: "length".into(),
        tokens: p.iter().chain(&out.tokens).copied().collect(),
    }
}

/// The f32 values of an f16 or u32 tensor.
fn values(st: &safetensors::SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    let v = match t.dtype() {
        safetensors::Dtype::F16 => t
            .data()
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        safetensors::Dtype::U32 => t
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
            .collect(),
        d => panic!("{name}: {d:?}"),
    };
    (t.shape().to_vec(), v)
}

fn argmax(row: impl Iterator<Item = f32>) -> (usize, f32) {
    row.enumerate().fold(
        (0, f32::NEG_INFINITY),
        |b, (i, v)| if v > b.1 { (i, v) } else { b },
    )
}

#[test]
fn a_dump_of_two_records_has_the_shapes_and_reproduces_the_target() {
    if !default_model_path().is_file() {
        eprintln!(
            "skipped: no model file at {}",
            default_model_path().display()
        );
        return;
    }
    let w = common::fast_weights();
    let c = w.config().clone();
    let (h, vocab) = (c.hidden_size, c.vocab_size);
    let recs = vec![record("Name a river.", 6), record("What is 2 + 2?", 5)];
    let layout = FeatureLayout::eagle3(c.n_layers, h).unwrap();
    let dir = std::env::temp_dir().join(format!("spec-e3dump-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = DumpConfig {
        layout: layout.clone(),
        max_seq_len: 1024,
        seqs_per_file: 2,
        threads: 1,
        limit_files: None,
    };
    let s = dump_features(w.clone(), "m", &recs, &dir, &cfg, &mut |_| {}).unwrap();
    let n: usize = recs.iter().map(|r| r.tokens.len()).sum();
    assert_eq!((s.files_written, s.sequences, s.positions), (1, 2, n));
    let bytes = std::fs::read(dir.join(feature_file_name(0))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (ts, tokens) = values(&st, "tokens");
    assert_eq!(ts, [n]);
    let l0 = recs[0].tokens.len();
    assert_eq!(values(&st, "seq_starts").1, [0.0, l0 as f32, n as f32]);
    let answers = [recs[0].answer_start, l0 + recs[1].answer_start].map(|a| a as f32);
    assert_eq!(values(&st, "answer_starts").1, answers);
    let (fs, feats) = values(&st, "features");
    assert_eq!(fs, [n, 3 * h]);
    let (_, finals) = values(&st, "final");
    let (es, embeds) = values(&st, "embeds");
    assert_eq!(es, [n, h]);
    let head_bytes = std::fs::read(dir.join(LM_HEAD_FILE)).unwrap();
    let hs = safetensors::SafeTensors::deserialize(&head_bytes).unwrap();
    let (os, out_rows) = values(&hs, "output_rows");
    assert_eq!(os, [vocab, h]);
    let meta: HashMap<String, String> = safetensors::SafeTensors::read_metadata(&bytes)
        .unwrap()
        .1
        .metadata()
        .clone()
        .unwrap();
    assert_eq!(meta["feature_layers"], "2,15,27");
    let f16 = |v: f32| half::f16::from_f32(v).to_f32();
    let (mut rows, mut mismatches, mut offset) = (0, 0, 0);
    for r in &recs {
        let len = r.tokens.len();
        assert_eq!(
            tokens[offset..offset + len],
            r.tokens.iter().map(|&t| t as f32).collect::<Vec<_>>()[..]
        );
        // The target's rows and logits of the record.
        let mut t = FastTarget::new(w.clone())
            .with_feature_layout(layout.clone())
            .unwrap();
        let mut logits = Vec::new();
        t.forward(&r.tokens, &mut logits).unwrap();
        let want = t.hidden_states().unwrap().last_hidden().unwrap();
        let got = &feats[offset * 3 * h..(offset + len) * 3 * h];
        assert!(want.iter().zip(got).all(|(a, b)| f16(*a) == *b), "features");
        let mut e = vec![0.0; h];
        w.embedding_row(r.tokens[1], &mut e).unwrap();
        assert!(
            e.iter()
                .zip(&embeds[(offset + 1) * h..])
                .all(|(a, b)| f16(*a) == *b)
        );
        for p in 0..len {
            let fin = &finals[(offset + p) * h..(offset + p + 1) * h];
            let scores = out_rows
                .chunks_exact(h)
                .map(|o| o.iter().zip(fin).map(|(a, b)| a * b).sum::<f32>());
            let (best, top) = argmax(scores);
            let (greedy, _) = argmax(logits[p * vocab..(p + 1) * vocab].iter().copied());
            rows += 1;
            if best != greedy {
                // f16 rounding may flip a near tie only.
                let o = &out_rows[greedy * h..(greedy + 1) * h];
                let s: f32 = o.iter().zip(fin).map(|(a, b)| a * b).sum();
                assert!(
                    top - s < 0.05,
                    "row {p}: {best} vs greedy {greedy} ({top} vs {s})"
                );
                mismatches += 1;
            }
        }
        offset += len;
    }
    assert!(
        mismatches * 50 <= rows,
        "{mismatches} of {rows} rows differ"
    );
    // Resumable: a second run skips the file and writes nothing.
    let s = dump_features(w, "m", &recs, &dir, &cfg, &mut |_| {}).unwrap();
    assert_eq!((s.files_written, s.files_skipped), (0, 1));
    let _ = std::fs::remove_dir_all(&dir);
}
