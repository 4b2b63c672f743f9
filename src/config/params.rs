//! [`GenerationParams`] as the whole flat object: its one conversion each way between it and
//! [`RequestConfig`], and its serde implementations through it.

use serde::de::{self, Deserializer};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::RequestConfig;
use crate::decode::{GenerationParams, TreeDrafts};
use crate::error::{Error, Result};

impl RequestConfig {
    /// The generation parameters of every field: [`RequestConfig::sampling_config`],
    /// [`RequestConfig::stop_conditions`], [`RequestConfig::draft_length`], and `seed`,
    /// `max_new_tokens`, `min_tokens`, `tree_nodes`, `tree_branch` (absent: [`GenerationParams::default`]'s). No cancel
    /// flag.
    ///
    /// # Errors
    /// The errors of the three conversions above, and [`Error::InvalidConfig`] naming
    /// `min_tokens` when it exceeds `max_new_tokens`.
    pub fn generation_params(&self) -> Result<GenerationParams> {
        let d = GenerationParams::default();
        let max_new_tokens = self.max_new_tokens.unwrap_or(d.max_new_tokens);
        let min_tokens = self.min_tokens.unwrap_or(d.min_tokens);
        if min_tokens > max_new_tokens {
            return Err(Error::config(
                "min_tokens",
                min_tokens,
                "must not exceed max_new_tokens",
            ));
        }
        Ok(GenerationParams {
            sampling: self.sampling_config()?,
            seed: self.seed,
            max_new_tokens,
            min_tokens,
            stop: self.stop_conditions()?,
            draft: self.draft_length()?,
            tree: TreeDrafts::nodes(self.tree_nodes.unwrap_or(d.tree.node_budget()))
                .with_branch(self.tree_branch.unwrap_or(d.tree.branch())),
            cancel: None,
        })
    }

    /// Every field of `params` except the cancel flag (and the sampling mask).
    pub fn from_params(params: &GenerationParams) -> Self {
        let GenerationParams {
            sampling,
            seed,
            max_new_tokens,
            min_tokens,
            stop,
            draft,
            tree,
            cancel: _,
        } = params;
        RequestConfig {
            seed: *seed,
            tree_nodes: Some(tree.node_budget()),
            tree_branch: Some(tree.branch()),
            max_new_tokens: Some(*max_new_tokens),
            min_tokens: Some(*min_tokens),
            ..RequestConfig::from_sampling(sampling)
                .merge(RequestConfig::from_stop(stop))
                .merge(RequestConfig::from_draft(draft))
        }
    }
}

impl TryFrom<&RequestConfig> for GenerationParams {
    type Error = Error;
    /// [`RequestConfig::generation_params`].
    fn try_from(r: &RequestConfig) -> Result<Self> {
        r.generation_params()
    }
}

impl From<&GenerationParams> for RequestConfig {
    /// [`RequestConfig::from_params`].
    fn from(p: &GenerationParams) -> Self {
        RequestConfig::from_params(p)
    }
}

impl Serialize for GenerationParams {
    /// [`RequestConfig::from_params`]: one flat object; the cancel flag and the mask are not
    /// written.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RequestConfig::from_params(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for GenerationParams {
    /// Every field of the module docs' table, validated as [`RequestConfig::generation_params`].
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <RequestConfig as Deserialize>::deserialize(d)?
            .generation_params()
            .map_err(de::Error::custom)
    }
}
