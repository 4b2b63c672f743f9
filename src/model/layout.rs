//! [`FeatureLayout`]: which of a target's hidden states its feature rows hold, in what order.

use std::ops::Range;

use crate::error::{Error, Result};

/// One hidden state of a decoder-only target, a block of a feature row
/// ([`FeatureLayout`]).
///
/// Layers are counted from 0 in a target of `n_layers` decoder layers; each state is
/// `[width]` floats (the model's hidden size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FeatureLayer {
    /// The residual stream entering decoder layer `i` (`0 ..= n_layers`): `Residual(0)` is the
    /// token embedding, `Residual(i)` the output of layer `i - 1` (before any norm), and
    /// `Residual(n_layers)` the last layer's output before the final norm. This is the index
    /// EAGLE-3 implementations use for their "auxiliary hidden states" (the state captured
    /// before running layer `i`); their default low / middle / high choice is
    /// `Residual(2)`, `Residual(n_layers / 2)`, `Residual(n_layers - 3)`
    /// ([`FeatureLayout::eagle3`]).
    Residual(usize),
    /// The final hidden state: after the last norm, before the output head. What
    /// [`HiddenStates::last_hidden`](crate::HiddenStates::last_hidden) holds by default, and
    /// what EAGLE-1/2 and Medusa heads read.
    Final,
}

impl std::fmt::Display for FeatureLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FeatureLayer::Residual(i) => write!(f, "residual {i}"),
            FeatureLayer::Final => f.write_str("final"),
        }
    }
}

/// The layout of a target's feature rows: the hidden states each row holds, concatenated in
/// this order, each `width` floats.
///
/// A target's [`HiddenStates::last_hidden`](crate::HiddenStates::last_hidden) rows are
/// `[n, row_width]` with `row_width = layers.len() · width`
/// (= [`HiddenStates::hidden_size`](crate::HiddenStates::hidden_size)): row `r` is the row of
/// the `r`-th appended position, and its columns `j · width .. (j + 1) · width` hold
/// `layers[j]` of that position ([`FeatureLayout::block`]). The decoding loop keeps these rows
/// per context position unchanged ([`ProposeRequest::target_hidden_rows`](
/// crate::ProposeRequest::target_hidden_rows)), and [`crate::propose::DraftModelProposer`]
/// hands them to the draft's [`TargetFeatures`](crate::TargetFeatures), so a head that reads
/// fused low / middle / high layers (EAGLE-3, Li et al. 2025, section 3.2: the three states are
/// concatenated and projected back to `width` by one linear layer) gets the feature of position
/// `p` as one `[3 · width]` row. A draft and its target must agree on the layout
/// ([`TargetFeatures::feature_layout`](crate::TargetFeatures::feature_layout)); the default of
/// both traits is [`FeatureLayout::final_only`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FeatureLayout {
    layers: Vec<FeatureLayer>,
    width: usize,
}

impl FeatureLayout {
    /// A layout of `layers` (in row order), each `width` floats.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for no layer, a layer listed twice, or `width == 0`.
    pub fn new(layers: Vec<FeatureLayer>, width: usize) -> Result<Self> {
        if layers.is_empty() {
            return Err(Error::config("layers", "[]", "a layout needs a layer"));
        }
        if width == 0 {
            return Err(Error::config("width", 0, "must be > 0"));
        }
        for (i, l) in layers.iter().enumerate() {
            if layers[..i].contains(l) {
                return Err(Error::config("layers", l, "a layer is listed twice"));
            }
        }
        Ok(FeatureLayout { layers, width })
    }

    /// The final hidden state only (`[Final]`): the default layout.
    pub fn final_only(width: usize) -> Self {
        FeatureLayout {
            layers: vec![FeatureLayer::Final],
            width,
        }
    }

    /// EAGLE-3's default low / middle / high states of a target of `n_layers` layers:
    /// `Residual(2)`, `Residual(n_layers / 2)`, `Residual(n_layers - 3)` (SmolLM2-135M, 30
    /// layers: 2, 15, 27).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for `n_layers < 6` (the three would not be distinct) or
    /// `width == 0`.
    pub fn eagle3(n_layers: usize, width: usize) -> Result<Self> {
        if n_layers < 6 {
            return Err(Error::config(
                "n_layers",
                n_layers,
                "EAGLE-3's default needs >= 6",
            ));
        }
        let l = [2, n_layers / 2, n_layers - 3].map(FeatureLayer::Residual);
        Self::new(l.to_vec(), width)
    }

    /// The hidden states of a row, in order.
    pub fn layers(&self) -> &[FeatureLayer] {
        &self.layers
    }

    /// Floats per hidden state.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Floats per row: `layers().len() · width()`.
    pub fn row_width(&self) -> usize {
        self.layers.len() * self.width
    }

    /// The columns of `layers()[j]` in a row, `j · width .. (j + 1) · width` (`None` for `j`
    /// out of range).
    pub fn block(&self, j: usize) -> Option<Range<usize>> {
        (j < self.layers.len()).then(|| j * self.width..(j + 1) * self.width)
    }

    /// The index of `layer` in a row, if present.
    pub fn position(&self, layer: FeatureLayer) -> Option<usize> {
        self.layers.iter().position(|&l| l == layer)
    }

    /// `true` for [`FeatureLayout::final_only`].
    pub fn is_final_only(&self) -> bool {
        self.layers == [FeatureLayer::Final]
    }

    /// Checks that a target of `n_layers` layers has every layer of this layout
    /// (`Residual(i)` with `i <= n_layers`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first layer out of range.
    pub fn check_layers(&self, n_layers: usize) -> Result<()> {
        match self
            .layers
            .iter()
            .find(|l| matches!(l, FeatureLayer::Residual(i) if *i > n_layers))
        {
            Some(l) => Err(Error::config(
                "layers",
                l,
                "past the target's last layer (Residual(i) needs i <= n_layers)",
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_concatenate_the_layers_in_order() {
        let l = FeatureLayout::eagle3(30, 576).unwrap();
        assert_eq!(
            l.layers(),
            [2, 15, 27].map(FeatureLayer::Residual).as_slice()
        );
        assert_eq!(l.row_width(), 3 * 576);
        assert_eq!(l.block(1), Some(576..1152));
        assert_eq!(l.block(3), None);
        assert_eq!(l.position(FeatureLayer::Residual(27)), Some(2));
        assert!(l.check_layers(30).is_ok());
        assert!(l.check_layers(26).is_err());
        assert!(!l.is_final_only());
        assert!(FeatureLayout::final_only(8).is_final_only());
    }

    #[test]
    fn bad_layouts_are_refused() {
        use FeatureLayer::*;
        assert!(FeatureLayout::new(vec![], 4).is_err());
        assert!(FeatureLayout::new(vec![Final], 0).is_err());
        assert!(FeatureLayout::new(vec![Residual(1), Final, Residual(1)], 4).is_err());
        assert!(FeatureLayout::eagle3(5, 4).is_err());
        assert!(FeatureLayout::new(vec![Residual(0), Final], 4).is_ok());
    }
}
