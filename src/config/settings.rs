//! The settings of the adaptive policy and the proposers, [`AdaptiveConfig`], [`SuffixConfig`]
//! and [`PromptLookupConfig`]: their serde forms are their own fields, derived on the types with
//! `#[serde(remote = "Self", default, deny_unknown_fields)]` (absent fields take the type's
//! default), and every load is checked by the type's `validate`.

use super::keys::named_serde;
use crate::decode::AdaptiveConfig;
use crate::error::Error;
use crate::propose::{PromptLookupConfig, SuffixConfig};

named_serde!(AdaptiveConfig, &[], AdaptiveConfig::validate);

named_serde!(
    SuffixConfig,
    &[("suffix_decoding_max_tree_depth", "max_depth")],
    SuffixConfig::validate
);

named_serde!(
    PromptLookupConfig,
    &[
        ("min_n", "prompt_lookup_min"),
        ("max_n", "prompt_lookup_max")
    ],
    check_prompt_lookup
);

/// [`PromptLookupConfig::validate`], its errors prefixed with vLLM's name of the field.
fn check_prompt_lookup(c: &PromptLookupConfig) -> Result<(), String> {
    c.validate().map_err(|e| match &e {
        Error::InvalidConfig { field: "min_n", .. } => format!("prompt_lookup_min: {e}"),
        Error::InvalidConfig { field: "max_n", .. } => format!("prompt_lookup_max: {e}"),
        _ => e.to_string(),
    })
}
