//! Training features of a token store for an EAGLE-3 head (`train_draft_head dump-features`):
//! a prefill of each stored sequence on a [`FastTarget`] with the head's feature layers plus
//! the final hidden state, written batch by batch to safetensors files a trainer in another
//! language (JAX) reads.
//!
//! # Files
//!
//! `features-00000.safetensors`, `features-00001.safetensors`, ...: file `i` holds the records
//! `i · seqs_per_file .. (i + 1) · seqs_per_file` of the store, in store order, each cut to its
//! first `max_seq_len` tokens (a record with no answer token left is skipped). Tensors (`N`
//! positions of the file's `S` sequences, `h` the hidden size, `k` the feature layers):
//!
//! - `tokens [N]` u32: the sequences' token ids, concatenated;
//! - `seq_starts [S + 1]` u32: offsets of the sequences in `tokens` (`seq_starts[S] = N`);
//! - `answer_starts [S]` u32: absolute index (in `tokens`) of each sequence's first answer
//!   token;
//! - `features [N, k h]` f16: the target's states of the layout's layers, concatenated
//!   (row `p` is the target row whose input was `tokens[p]`; [`speculative::FeatureLayout`]);
//! - `final [N, h]` f16: the target's final hidden state (after the last norm) of the same
//!   rows, so `final · E^T` are the target's logits of the next token;
//! - `embeds [N, h]` f16: the target's embedding of `tokens[p]`.
//!
//! Metadata: `format` = [`FEATURES_FORMAT`], `feature_layers`, `first_record`, `records`.
//! [`LM_HEAD_FILE`] holds `output_rows [V, h]` f16: the target's full output head, dequantised
//! (tied to the embedding in SmolLM2). [`DUMP_MANIFEST`] records the settings.
//!
//! **Deterministic and resumable.** The fast forward is batch invariant and each file depends
//! only on its records and the settings, so a file is the same bits however the run is split;
//! files are written to a temporary name and renamed, and a run skips the files that exist
//! (after checking that [`DUMP_MANIFEST`] holds the same settings).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use speculative::{FeatureLayer, FeatureLayout, TargetModel};

use super::{DistilError, TurnRecord};
use crate::fast::head::format_feature_layers;
use crate::fast::{FastTarget, FastWeights};

/// The `format` metadata value of a features file.
pub const FEATURES_FORMAT: &str = "speculative-eagle3-features-v1";

/// File name of the target's output rows in the output directory.
pub const LM_HEAD_FILE: &str = "lm_head.safetensors";

/// File name of the dump's settings in the output directory.
pub const DUMP_MANIFEST: &str = "features.json";

/// Settings of [`dump_features`].
#[derive(Debug, Clone, PartialEq)]
pub struct DumpConfig {
    /// The feature layers (`Residual` states of the target's hidden size), e.g.
    /// [`FeatureLayout::eagle3`]`(30, 576)`.
    pub layout: FeatureLayout,
    /// Tokens kept of each record (its first ones), `>= 1`.
    pub max_seq_len: usize,
    /// Records per file, `>= 1`.
    pub seqs_per_file: usize,
    /// Matmul threads of the target ([`FastTarget::with_threads`]).
    pub threads: usize,
    /// Stop after writing this many files in this run (`None`: all).
    pub limit_files: Option<usize>,
}

/// What one [`dump_features`] run did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DumpSummary {
    /// Files written by this run.
    pub files_written: usize,
    /// Files that existed and were skipped.
    pub files_skipped: usize,
    /// Sequences written by this run.
    pub sequences: usize,
    /// Positions written by this run.
    pub positions: usize,
    /// Wall-clock seconds of this run.
    pub seconds: f64,
}

/// The settings a dump directory was written with ([`DUMP_MANIFEST`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpIdentity {
    /// [`FEATURES_FORMAT`].
    pub format: String,
    /// Model file name (no directory).
    pub model: String,
    /// The feature layers, as in a head file's `feature_layers`.
    pub feature_layers: String,
    /// [`DumpConfig::max_seq_len`].
    pub max_seq_len: usize,
    /// [`DumpConfig::seqs_per_file`].
    pub seqs_per_file: usize,
    /// Records of the token store.
    pub records: usize,
}

/// The name of features file `i` (`features-00000.safetensors`).
pub fn feature_file_name(i: usize) -> String {
    format!("features-{i:05}.safetensors")
}

/// Writes the features files of `records` into `out` (module docs), skipping those that
/// exist, and [`LM_HEAD_FILE`] when absent; `progress` gets a line per file.
///
/// # Errors
/// [`DistilError::BadInput`] for a zero `max_seq_len` or `seqs_per_file`, a layout with a
/// state other than `Residual(i)` or past the target's layers, or a record whose answer
/// start is past its tokens; [`DistilError::Mismatch`] when `out` holds a dump of other
/// settings; [`DistilError::Candle`] for a failed forward; [`DistilError::Io`].
pub fn dump_features(
    weights: Arc<FastWeights>,
    model_name: &str,
    records: &[TurnRecord],
    out: &Path,
    cfg: &DumpConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<DumpSummary, DistilError> {
    let t0 = Instant::now();
    let id = check_settings(model_name, records.len(), cfg)?;
    std::fs::create_dir_all(out)?;
    open_manifest(out, &id)?;
    if !out.join(LM_HEAD_FILE).exists() {
        write_output_rows(&weights, &out.join(LM_HEAD_FILE))?;
    }
    let mut target = prefill_target(weights, &cfg.layout, cfg.threads)?;
    let mut sum = DumpSummary::default();
    for (i, chunk) in records.chunks(cfg.seqs_per_file).enumerate() {
        if cfg.limit_files.is_some_and(|l| sum.files_written >= l) {
            break;
        }
        let path = out.join(feature_file_name(i));
        if path.exists() {
            sum.files_skipped += 1;
            continue;
        }
        let first = i * cfg.seqs_per_file;
        let batch = dump_batch(&mut target, chunk, cfg)?;
        batch.write(&path, &id.feature_layers, first, chunk.len())?;
        sum.files_written += 1;
        sum.sequences += batch.answer_starts.len();
        sum.positions += batch.tokens.len();
        progress(&format!(
            "{}: {} sequences, {} positions ({:.0} s)",
            path.display(),
            batch.answer_starts.len(),
            batch.tokens.len(),
            t0.elapsed().as_secs_f64()
        ));
    }
    sum.seconds = t0.elapsed().as_secs_f64();
    Ok(sum)
}

/// The identity of a dump of `records` records with `cfg`, checking the settings.
fn check_settings(
    model: &str,
    records: usize,
    cfg: &DumpConfig,
) -> Result<DumpIdentity, DistilError> {
    if cfg.max_seq_len == 0 || cfg.seqs_per_file == 0 {
        return Err(DistilError::BadInput(
            "--max-seq-len and --seqs-per-file must be >= 1".into(),
        ));
    }
    let feature_layers =
        format_feature_layers(&cfg.layout).map_err(|e| DistilError::BadInput(e.to_string()))?;
    Ok(DumpIdentity {
        format: FEATURES_FORMAT.into(),
        model: model.into(),
        feature_layers,
        max_seq_len: cfg.max_seq_len,
        seqs_per_file: cfg.seqs_per_file,
        records,
    })
}

/// Writes [`DUMP_MANIFEST`] into `out`, or checks that the one there is `id`.
fn open_manifest(out: &Path, id: &DumpIdentity) -> Result<(), DistilError> {
    let path = out.join(DUMP_MANIFEST);
    if path.exists() {
        let have: DumpIdentity = serde_json::from_slice(&std::fs::read(&path)?)?;
        if &have != id {
            return Err(DistilError::Mismatch(format!(
                "{} holds a dump of other settings: {have:?}, asked for {id:?}",
                out.display()
            )));
        }
        return Ok(());
    }
    std::fs::write(&path, serde_json::to_string_pretty(id)? + "\n")?;
    Ok(())
}

/// A target handing over `layout`'s states followed by the final hidden state.
fn prefill_target(
    weights: Arc<FastWeights>,
    layout: &FeatureLayout,
    threads: usize,
) -> Result<FastTarget, DistilError> {
    let mut layers = layout.layers().to_vec();
    layers.push(FeatureLayer::Final);
    let with_final = FeatureLayout::new(layers, layout.width())
        .map_err(|e| DistilError::BadInput(e.to_string()))?;
    let t = FastTarget::new(weights)
        .with_threads(threads)
        .with_feature_layout(with_final)
        .map_err(|e| DistilError::BadInput(e.to_string()))?;
    Ok(t)
}

/// The tensors of one features file (module docs), values as f16 bits.
#[derive(Debug, Default)]
struct Batch {
    tokens: Vec<u32>,
    seq_starts: Vec<u32>,
    answer_starts: Vec<u32>,
    features: Vec<u16>,
    finals: Vec<u16>,
    embeds: Vec<u16>,
    /// `(k h, h)`.
    widths: (usize, usize),
}

fn f16_bits(v: &[f32], out: &mut Vec<u16>) {
    out.extend(v.iter().map(|&x| half::f16::from_f32(x).to_bits()));
}

/// Prefills each record of `chunk` (cut to `max_seq_len`) and collects its rows.
fn dump_batch(
    target: &mut FastTarget,
    chunk: &[TurnRecord],
    cfg: &DumpConfig,
) -> Result<Batch, DistilError> {
    let h = cfg.layout.width();
    let kh = cfg.layout.row_width();
    let mut b = Batch {
        seq_starts: vec![0],
        widths: (kh, h),
        ..Batch::default()
    };
    let mut embed = vec![0f32; h];
    for r in chunk {
        if r.answer_start > r.tokens.len() {
            return Err(DistilError::BadInput(format!(
                "record (conv {}, turn {}): answer start {} past its {} tokens",
                r.conv,
                r.turn,
                r.answer_start,
                r.tokens.len()
            )));
        }
        let toks = &r.tokens[..r.tokens.len().min(cfg.max_seq_len)];
        if r.answer_start >= toks.len() {
            continue;
        }
        target.truncate(0)?;
        target.prefill(toks)?;
        let rows = target
            .hidden_states()
            .and_then(|s| s.last_hidden())
            .ok_or_else(|| DistilError::BadInput("the target handed over no rows".into()))?;
        let base = b.tokens.len();
        for (row, &t) in rows.chunks_exact(kh + h).zip(toks) {
            f16_bits(&row[..kh], &mut b.features);
            f16_bits(&row[kh..], &mut b.finals);
            target.weights().embedding_row(t, &mut embed)?;
            f16_bits(&embed, &mut b.embeds);
        }
        b.tokens.extend_from_slice(toks);
        b.answer_starts.push((base + r.answer_start) as u32);
        b.seq_starts.push(b.tokens.len() as u32);
    }
    Ok(b)
}

impl Batch {
    /// Writes the file (to `path` + `.tmp`, then renamed).
    fn write(
        &self,
        path: &Path,
        layers: &str,
        first: usize,
        records: usize,
    ) -> Result<(), DistilError> {
        let (n, (kh, h)) = (self.tokens.len(), self.widths);
        let u32s = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let f16s = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let tensors = vec![
            ("tokens", U32, vec![n], u32s(&self.tokens)),
            (
                "seq_starts",
                U32,
                vec![self.seq_starts.len()],
                u32s(&self.seq_starts),
            ),
            (
                "answer_starts",
                U32,
                vec![self.answer_starts.len()],
                u32s(&self.answer_starts),
            ),
            ("features", F16, vec![n, kh], f16s(&self.features)),
            ("final", F16, vec![n, h], f16s(&self.finals)),
            ("embeds", F16, vec![n, h], f16s(&self.embeds)),
        ];
        let meta = [
            ("format", FEATURES_FORMAT.to_string()),
            ("feature_layers", layers.to_string()),
            ("first_record", first.to_string()),
            ("records", records.to_string()),
        ];
        write_safetensors(path, &tensors, &meta)
    }
}

use safetensors::tensor::Dtype::{F16, U32};

/// Writes `tensors` (name, dtype, shape, little-endian bytes) and `meta` to `path` through a
/// temporary file renamed at the end.
fn write_safetensors(
    path: &Path,
    tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)],
    meta: &[(&str, String)],
) -> Result<(), DistilError> {
    let bad = |e: String| DistilError::BadInput(format!("{}: {e}", path.display()));
    let mut views = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, bytes) in tensors {
        let v = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
            .map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        views.push((name.to_string(), v));
    }
    let meta = meta
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect::<std::collections::HashMap<_, _>>();
    let bytes = crate::st::serialize(views, meta).map_err(bad)?;
    let tmp = path.with_extension("safetensors.tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Writes [`LM_HEAD_FILE`]-style `output_rows [V, h]` f16 (the target's output head rows,
/// dequantised) to `path`.
///
/// # Errors
/// [`DistilError::Io`]; [`DistilError::BadInput`] when a row does not fit f16.
pub fn write_output_rows(weights: &FastWeights, path: &Path) -> Result<(), DistilError> {
    let c = weights.config();
    let (v, h) = (c.vocab_size, c.hidden_size);
    let mut row = vec![0f32; h];
    let mut bits = Vec::with_capacity(v * h);
    for id in 0..v {
        weights.output_row(id as u32, &mut row)?;
        f16_bits(&row, &mut bits);
    }
    let bytes = bits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let meta = [("format", "speculative-output-rows-v1".to_string())];
    write_safetensors(path, &[("output_rows", F16, vec![v, h], bytes)], &meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fast::{FastFormat, RandomSpec};

    fn record(tokens: Vec<u32>, answer_start: usize) -> TurnRecord {
        TurnRecord {
            conv: 0,
            turn: 0,
            kind: "chat".into(),
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            answer_start,
            finish: "length".into(),
            tokens,
        }
    }

    fn cfg(layout: FeatureLayout) -> DumpConfig {
        DumpConfig {
            layout,
            max_seq_len: 12,
            seqs_per_file: 2,
            threads: 1,
            limit_files: None,
        }
    }

    #[test]
    fn tiny_dump_is_resumable_and_checks_its_settings() {
        let w = FastWeights::random(&RandomSpec::default(), FastFormat::Q8).unwrap();
        let h = w.config().hidden_size;
        let layout = crate::fast::head::parse_feature_layers("0,1,2", h).unwrap();
        let recs: Vec<_> = (0..5u32)
            .map(|i| record((0..10 + i).map(|t| (t * 7 + i) % 301).collect(), 4))
            .chain([record(vec![1, 2, 3], 3)])
            .collect();
        let dir = std::env::temp_dir().join(format!("spec-dump-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut c = cfg(layout.clone());
        c.limit_files = Some(1);
        let mut lines = Vec::new();
        let s = dump_features(w.clone(), "m", &recs, &dir, &c, &mut |l| {
            lines.push(l.to_string())
        })
        .unwrap();
        assert_eq!((s.files_written, s.files_skipped, s.sequences), (1, 0, 2));
        let first = std::fs::read(dir.join(feature_file_name(0))).unwrap();
        c.limit_files = None;
        let s = dump_features(w.clone(), "m", &recs, &dir, &c, &mut |_| {}).unwrap();
        assert_eq!((s.files_written, s.files_skipped), (2, 1));
        // The last file's second record has no answer token: skipped.
        let last = std::fs::read(dir.join(feature_file_name(2))).unwrap();
        let st = safetensors::SafeTensors::deserialize(&last).unwrap();
        assert_eq!(st.tensor("answer_starts").unwrap().shape(), &[1]);
        assert_eq!(st.tensor("features").unwrap().shape(), &[12, 3 * h]);
        // A fresh directory gives the same bits.
        let again = dir.join("again");
        dump_features(w.clone(), "m", &recs, &again, &c, &mut |_| {}).unwrap();
        assert_eq!(
            std::fs::read(again.join(feature_file_name(0))).unwrap(),
            first
        );
        // Other settings on the same directory: refused.
        let mut other = cfg(layout);
        other.max_seq_len = 11;
        assert!(matches!(
            dump_features(w, "m", &recs, &dir, &other, &mut |_| {}),
            Err(DistilError::Mismatch(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
