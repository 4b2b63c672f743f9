//! The input fusion of a [`DraftHead`](super::head::DraftHead): what its row at position `p`
//! reads as the feature of position `p - 1`, by file format.
//!
//! - [`HeadFormat::Eagle1`] (`speculative-eagle-head-v1`, EAGLE, Li et al. 2024): the
//!   target's final hidden state `f_{p-1}` (`[h]`), or the head's own normed prediction
//!   `f^_{p-1}` at a drafted position.
//! - [`HeadFormat::Eagle3`] (`speculative-eagle3-head-v1`, EAGLE-3, Li et al. 2025, section
//!   3.2): `g_{p-1} = W_fc3 [a_{p-1}; b_{p-1}; c_{p-1}]` (`fc3.weight [h, k h]`, no bias), the
//!   projection of the target's feature row (`[k h]`: the `k` states of the file's
//!   `feature_layers`, [`FeatureLayout`]) when the target ran `p - 1`, or the head's own
//!   decoder-layer output before the final norm `w_{p-1}` at a drafted position; zeros at
//!   `p = 0`.
//!
//! The projection runs once per target row, when the row is handed over
//! ([`DraftHead::set_features`](super::head::DraftHead::set_features)), so the head keeps `[h]`
//! per held position in both formats and the rest of the forward is shared.

use speculative::{FeatureLayer, FeatureLayout};

use super::forward::{Exec, FastWeights, Matrix};
use super::head::{DraftHeadConfig, HEAD_TENSORS, HeadTensors};
use crate::error::{CandleError, Result};
use crate::train::SplitMix;

/// The value of the `format` metadata key of an EAGLE-3 draft-head file.
pub const HEAD3_FORMAT: &str = "speculative-eagle3-head-v1";

/// Name of the fusion matrix of an EAGLE-3 head file, `[h, k h]` (`k` feature layers).
pub const FC3_TENSOR: &str = "fc3.weight";

/// Metadata key of an EAGLE-3 head file naming its feature layers: comma-separated
/// `Residual` indices in row order (`"2,15,27"` for [`FeatureLayout::eagle3`]`(30, 576)`).
pub const FEATURE_LAYERS_KEY: &str = "feature_layers";

/// The two head file formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadFormat {
    /// `speculative-eagle-head-v1`: reads the target's final hidden state.
    Eagle1,
    /// `speculative-eagle3-head-v1`: reads `fc3` over the target's multi-layer feature rows.
    Eagle3,
}

impl HeadFormat {
    /// The `format` metadata value.
    pub fn name(self) -> &'static str {
        match self {
            HeadFormat::Eagle1 => super::head::HEAD_FORMAT,
            HeadFormat::Eagle3 => HEAD3_FORMAT,
        }
    }

    /// The format of a `format` metadata value, `None` for an unknown one.
    pub fn parse(name: &str) -> Option<Self> {
        [HeadFormat::Eagle1, HeadFormat::Eagle3]
            .into_iter()
            .find(|f| f.name() == name)
    }
}

/// Parses a [`FEATURE_LAYERS_KEY`] value (`"2,15,27"`) into a layout of `Residual` states
/// of `width` floats each.
///
/// # Errors
/// [`CandleError::InvalidArgument`] for a value that is not a comma-separated list of
/// distinct indices, or `width == 0`.
pub fn parse_feature_layers(value: &str, width: usize) -> Result<FeatureLayout> {
    let layers = value
        .split(',')
        .map(|s| s.trim().parse::<usize>().map(FeatureLayer::Residual))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| {
            CandleError::InvalidArgument(format!("`{FEATURE_LAYERS_KEY}` = {value:?}: {e}"))
        })?;
    FeatureLayout::new(layers, width).map_err(|e| {
        CandleError::InvalidArgument(format!("`{FEATURE_LAYERS_KEY}` = {value:?}: {e}"))
    })
}

/// The [`FEATURE_LAYERS_KEY`] value of `layout` (its `Residual` indices, comma-separated).
///
/// # Errors
/// [`CandleError::InvalidArgument`] when `layout` holds a state other than `Residual(i)`.
pub fn format_feature_layers(layout: &FeatureLayout) -> Result<String> {
    let mut out = Vec::with_capacity(layout.layers().len());
    for l in layout.layers() {
        match l {
            FeatureLayer::Residual(i) => out.push(i.to_string()),
            other => {
                return Err(CandleError::InvalidArgument(format!(
                    "an EAGLE-3 head file names Residual layers only, not {other}"
                )));
            }
        }
    }
    Ok(out.join(","))
}

/// A head's input fusion (module docs), built from its tensors.
#[derive(Debug)]
pub(crate) enum Fusion {
    /// EAGLE-1: feature rows are `[h]` and fed as they are; drafted positions feed `f^`.
    Last,
    /// EAGLE-3: feature rows are `[k h]`, projected by `fc3` (`[h, k h]`); drafted positions
    /// feed the decoder layer's output before the final norm.
    Layers {
        /// The layers a feature row holds.
        layout: FeatureLayout,
        /// `[h, k h]`.
        fc3: Matrix,
    },
}

impl Fusion {
    /// The fusion of `t` for `target`: [`Fusion::Layers`] when `t` holds [`FC3_TENSOR`].
    ///
    /// # Errors
    /// [`CandleError::Tensor`] for an `fc3.weight` of another shape than `[h, k h]`;
    /// [`CandleError::InvalidArgument`] for a missing or malformed [`FEATURE_LAYERS_KEY`]
    /// (with or without `fc3`), or a layer past the target's last.
    pub(crate) fn from_tensors(t: &HeadTensors, target: &FastWeights) -> Result<Self> {
        let h = target.config.hidden_size;
        let layers = t.metadata.get(FEATURE_LAYERS_KEY);
        if !t.tensors.contains_key(FC3_TENSOR) {
            return match layers {
                None => Ok(Fusion::Last),
                Some(v) => Err(CandleError::InvalidArgument(format!(
                    "`{FEATURE_LAYERS_KEY}` = {v:?} without `{FC3_TENSOR}`"
                ))),
            };
        }
        let value = layers.ok_or_else(|| {
            CandleError::InvalidArgument(format!(
                "`{FC3_TENSOR}` without the metadata `{FEATURE_LAYERS_KEY}`"
            ))
        })?;
        let layout = parse_feature_layers(value, h)?;
        layout
            .check_layers(target.config.n_layers)
            .map_err(|e| CandleError::InvalidArgument(e.to_string()))?;
        let k = layout.row_width();
        let fc3 = Matrix::from_f32(h, k, t.get(FC3_TENSOR, &[h, k])?, target.format)?;
        Ok(Fusion::Layers { layout, fc3 })
    }

    /// The layout of the feature rows the head reads (`[Final]` for EAGLE-1).
    pub(crate) fn layout(&self, h: usize) -> FeatureLayout {
        match self {
            Fusion::Last => FeatureLayout::final_only(h),
            Fusion::Layers { layout, .. } => layout.clone(),
        }
    }

    /// `true` when drafted positions feed the normed prediction `f^` (EAGLE-1), `false` when
    /// they feed the pre-norm output `w` (EAGLE-3).
    pub(crate) fn feeds_normed(&self) -> bool {
        matches!(self, Fusion::Last)
    }

    /// The `[n, h]` input features of the target feature rows `rows` (`[n, row_width]`):
    /// `rows` themselves for EAGLE-1, `fc3 · row` for EAGLE-3 (computed into `scratch`).
    pub(crate) fn project<'a>(
        &self,
        rows: &'a [f32],
        scratch: &'a mut Vec<f32>,
        exec: &mut Exec,
    ) -> Result<&'a [f32]> {
        match self {
            Fusion::Last => Ok(rows),
            Fusion::Layers { fc3, .. } => {
                scratch.clear();
                if !rows.is_empty() {
                    fc3.matmul(rows, scratch, exec)?;
                }
                Ok(scratch)
            }
        }
    }

    /// Bytes of the fusion's own matrix.
    pub(crate) fn memory_bytes(&self) -> usize {
        match self {
            Fusion::Last => 0,
            Fusion::Layers { fc3, .. } => fc3.memory_bytes(),
        }
    }
}

impl HeadTensors {
    /// The format these tensors are written in: [`HeadFormat::Eagle3`] when they hold
    /// [`FC3_TENSOR`], else [`HeadFormat::Eagle1`].
    pub fn format(&self) -> HeadFormat {
        if self.tensors.contains_key(FC3_TENSOR) {
            HeadFormat::Eagle3
        } else {
            HeadFormat::Eagle1
        }
    }

    /// Tensors of a head of shape `config` (`config.subset` is ignored: the subset is
    /// `vocab_ids`) with weights drawn from `N(0, std²)` and norm weights `1 + N(0, std²)`,
    /// seeded by `seed`; `std = 0` gives zero weights and unit norms. With `feature_layers`
    /// (`Residual` layers only, width `config.hidden_size`) the head is an EAGLE-3 head: it
    /// also holds `fc3.weight [h, k h]` and the metadata [`FEATURE_LAYERS_KEY`]. For tests and
    /// as a training start.
    ///
    /// # Errors
    /// [`CandleError::InvalidArgument`] for a `feature_layers` layout holding another state
    /// than `Residual(i)` or of another width than `config.hidden_size`.
    pub fn random(
        config: &DraftHeadConfig,
        feature_layers: Option<&FeatureLayout>,
        vocab_ids: Vec<u32>,
        std: f32,
        seed: u64,
    ) -> Result<Self> {
        let c = config;
        let (h, d, f) = (c.hidden_size, c.head_dim, c.ffn_size);
        let (q, kv) = (c.n_heads * d, c.n_kv_heads * d);
        let shapes: [Vec<usize>; 12] = [
            vec![h, 2 * h],
            vec![h],
            vec![h],
            vec![q, h],
            vec![kv, h],
            vec![kv, h],
            vec![h, q],
            vec![h],
            vec![f, h],
            vec![f, h],
            vec![h, f],
            vec![h],
        ];
        let mut rng = SplitMix::new(seed);
        let mut t = HeadTensors {
            vocab_ids,
            ..HeadTensors::default()
        };
        let mut draw = |name: &str, shape: Vec<usize>| {
            let one = if name.ends_with("norm.weight") {
                1.0
            } else {
                0.0
            };
            let n = shape.iter().product();
            let v = (0..n)
                .map(|_| one + std * rng.normal() as f32)
                .collect::<Vec<_>>();
            (name.to_string(), (shape, v))
        };
        let mut all: Vec<_> = HEAD_TENSORS
            .iter()
            .zip(shapes)
            .map(|(name, s)| draw(name, s))
            .collect();
        if let Some(layout) = feature_layers {
            if layout.width() != h {
                return Err(CandleError::InvalidArgument(format!(
                    "feature layout width {} is not the hidden size {h}",
                    layout.width()
                )));
            }
            let value = format_feature_layers(layout)?;
            t.metadata.insert(FEATURE_LAYERS_KEY.into(), value);
            all.push(draw(FC3_TENSOR, vec![h, layout.row_width()]));
        }
        t.tensors.extend(all);
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feature_layers_round_trip_and_bad_values() {
        let l = FeatureLayout::eagle3(30, 576).unwrap();
        let s = format_feature_layers(&l).unwrap();
        assert_eq!(s, "2,15,27");
        assert_eq!(parse_feature_layers(&s, 576).unwrap(), l);
        assert_eq!(parse_feature_layers(" 2, 15 ,27", 576).unwrap(), l);
        for bad in ["", "2,,3", "a", "2,2", "-1"] {
            assert!(parse_feature_layers(bad, 576).is_err(), "{bad:?}");
        }
        assert!(parse_feature_layers("1", 0).is_err());
        assert!(format_feature_layers(&FeatureLayout::final_only(8)).is_err());
    }

    #[test]
    fn format_names() {
        for f in [HeadFormat::Eagle1, HeadFormat::Eagle3] {
            assert_eq!(HeadFormat::parse(f.name()), Some(f));
        }
        assert_eq!(HeadFormat::parse("x"), None);
    }

    #[test]
    fn random_tensors_have_the_shapes_and_the_format() {
        let c = DraftHeadConfig {
            hidden_size: 8,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            ffn_size: 12,
            subset: 0,
        };
        let v1 = HeadTensors::random(&c, None, vec![1, 2], 0.1, 3).unwrap();
        assert_eq!(v1.format(), HeadFormat::Eagle1);
        assert_eq!(v1.config(8, 4).unwrap().n_heads, 2);
        let l = parse_feature_layers("0,1,2", 8).unwrap();
        let v2 = HeadTensors::random(&c, Some(&l), vec![1, 2], 0.0, 3).unwrap();
        assert_eq!(v2.format(), HeadFormat::Eagle3);
        assert_eq!(v2.get(FC3_TENSOR, &[8, 24]).unwrap(), &[0.0; 192][..]);
        assert_eq!(v2.get("ffn_norm.weight", &[8]).unwrap(), &[1.0; 8][..]);
        assert_eq!(v2.metadata[FEATURE_LAYERS_KEY], "0,1,2");
        let narrow = parse_feature_layers("0", 4).unwrap();
        assert!(HeadTensors::random(&c, Some(&narrow), vec![], 0.1, 3).is_err());
    }
}
