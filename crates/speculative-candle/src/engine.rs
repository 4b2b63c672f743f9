//! What the model instances of this crate ([`crate::CandleTarget`], [`crate::FastTarget`],
//! [`crate::fast::DraftHead`]) share as engines of [`speculative`]: the checks of a forward's
//! tokens and of a tree block, and one implementation of the traits [`speculative::TargetModel`],
//! [`speculative::TreeTarget`] and [`speculative::HiddenStates`] over the private trait
//! [`Engine`] ([`target_glue!`]).
//!
//! Below both forwards (`crate::model`, `crate::fast`): imports neither.

use speculative::{DraftBlock, TreeLimits};

use crate::error::{CandleError, Result};
use crate::gguf::LlamaConfig;
use crate::tree;

/// Default of [`FastTarget::max_tree_nodes`](speculative::TreeTarget::max_tree_nodes) (and of
/// the other model instances of this crate).
pub const DEFAULT_MAX_TREE_NODES: usize = 64;

/// Validates `tokens` appended after `seq_len` positions of a model of `cfg` (every forward of
/// the crate: [`crate::FastTarget`], [`crate::FastBatch`], the draft head and
/// [`crate::CandleTarget`]).
///
/// # Errors
/// [`CandleError::InvalidArgument`] while a tree forward is `pending` or for no tokens,
/// [`CandleError::TokenOutOfVocab`] for an id `>= vocab_size`, [`CandleError::ContextOverflow`]
/// when `seq_len + n > context_length`.
pub(crate) fn check_append(
    cfg: &LlamaConfig,
    pending: bool,
    seq_len: usize,
    tokens: &[u32],
) -> Result<()> {
    let n = tokens.len();
    if pending {
        return Err(tree::pending_error());
    }
    if n == 0 {
        return Err(CandleError::InvalidArgument(
            "forward needs at least one token".into(),
        ));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(CandleError::TokenOutOfVocab {
            token: t,
            vocab_size: cfg.vocab_size,
        });
    }
    if seq_len + n > cfg.context_length {
        return Err(CandleError::ContextOverflow {
            seq_len,
            added: n,
            max_context: cfg.context_length,
        });
    }
    Ok(())
}

/// Checks a tree forward's `block` with [`DraftBlock::validate`] against a `vocab`-id
/// vocabulary and at most `max_nodes` nodes (any sibling scheme: the forwards do not read it).
///
/// # Errors
/// [`speculative::Error::InvalidTree`].
pub(crate) fn check_tree(
    vocab: usize,
    max_nodes: usize,
    block: &DraftBlock<'_>,
) -> speculative::Result<()> {
    block
        .validate(&TreeLimits::target(vocab, max_nodes))
        .map_err(speculative::Error::InvalidTree)
}

/// A model instance of this crate as [`target_glue!`] sees it: one sequence with a KV cache
/// and the forwards of the crate's error type. [`target_glue!`] turns it into the
/// [`speculative`] traits; each method is the engine's own, the shared checks and conversions
/// are the macro's.
pub(crate) trait Engine {
    /// The hyper-parameters of the model whose vocabulary and context the sequence uses.
    fn model_config(&self) -> &LlamaConfig;

    /// Positions held ([`speculative::TargetModel::seq_len`]).
    fn positions(&self) -> usize;

    /// Most nodes of one tree forward; 0 turns tree support off.
    fn tree_capacity(&self) -> usize;

    /// Appends `tokens` and writes their `[n, vocab]` logits into `logits` (empty on entry).
    fn append_logits(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> Result<()>;

    /// Appends `tokens` without logits.
    fn append_prefill(&mut self, tokens: &[u32]) -> Result<()>;

    /// Drops every position at index `>= len` (a pending tree as the engine documents).
    fn truncate_positions(&mut self, len: usize) -> Result<()>;

    /// Appends the root and the nodes of `block` (already [`check_tree`]ed) as a tree forward,
    /// writing `[n + 1, vocab]` logits into `logits` (empty on entry); the tree is pending
    /// afterwards. On error the sequence is unchanged.
    fn append_tree(
        &mut self,
        root: u32,
        block: &DraftBlock<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()>;

    /// [`speculative::TreeTarget::commit_tree`].
    fn commit_path(&mut self, path: &[u32]) -> speculative::Result<()>;

    /// The feature layout and the `[n, row_width]` rows of the last call when the engine hands
    /// over other states than the final hidden state ([`speculative::HiddenStates`] then
    /// reports them); `None` (the default): the final hidden states of the macro's field.
    fn features(&self) -> Option<(&speculative::FeatureLayout, &[f32])> {
        None
    }
}

/// Implements [`speculative::TargetModel`] and [`speculative::TreeTarget`] for a type that
/// implements [`Engine`]; with `hidden_states = field`, also [`speculative::HiddenStates`] (the
/// model's hidden size and the `[n, hidden]` final hidden states of the last forward in
/// `self.field`, a `Vec<f32>` empty before the first) offered by `TargetModel::hidden_states`;
/// with
/// `target_features`, `TargetModel::target_features` offers the type's own
/// [`speculative::TargetFeatures`] implementation.
macro_rules! target_glue {
    ($t:ty, hidden_states = $field:ident $(, { $($extra:item)* })?) => {
        $crate::engine::target_glue!(@model $t {
            fn hidden_states(&self) -> Option<&dyn speculative::HiddenStates> {
                Some(self)
            }
            $($($extra)*)?
        });
        $crate::engine::target_glue!(@tree $t);
        impl speculative::HiddenStates for $t {
            fn hidden_size(&self) -> usize {
                match $crate::engine::Engine::features(self) {
                    Some((layout, _)) => layout.row_width(),
                    None => $crate::engine::Engine::model_config(self).hidden_size,
                }
            }

            fn last_hidden(&self) -> Option<&[f32]> {
                let rows = match $crate::engine::Engine::features(self) {
                    Some((_, rows)) => rows,
                    None => &self.$field,
                };
                if rows.is_empty() { None } else { Some(rows) }
            }

            fn feature_layout(&self) -> speculative::FeatureLayout {
                match $crate::engine::Engine::features(self) {
                    Some((layout, _)) => layout.clone(),
                    None => speculative::FeatureLayout::final_only(
                        $crate::engine::Engine::model_config(self).hidden_size,
                    ),
                }
            }
        }
    };
    ($t:ty, target_features) => {
        $crate::engine::target_glue!(@model $t {
            fn target_features(&mut self) -> Option<&mut dyn speculative::TargetFeatures> {
                Some(self)
            }
        });
        $crate::engine::target_glue!(@tree $t);
    };
    (@model $t:ty { $($extra:item)* }) => {
        impl speculative::TargetModel for $t {
            fn vocab_size(&self) -> usize {
                $crate::engine::Engine::model_config(self).vocab_size
            }

            fn max_context(&self) -> usize {
                $crate::engine::Engine::model_config(self).context_length
            }

            fn seq_len(&self) -> usize {
                $crate::engine::Engine::positions(self)
            }

            fn forward(&mut self, tokens: &[u32], logits: &mut Vec<f32>) -> speculative::Result<()> {
                logits.clear();
                Ok($crate::engine::Engine::append_logits(self, tokens, logits)?)
            }

            fn truncate(&mut self, len: usize) -> speculative::Result<()> {
                Ok($crate::engine::Engine::truncate_positions(self, len)?)
            }

            fn prefill(&mut self, tokens: &[u32]) -> speculative::Result<()> {
                Ok($crate::engine::Engine::append_prefill(self, tokens)?)
            }

            fn tree(&mut self) -> Option<&mut dyn speculative::TreeTarget> {
                if $crate::engine::Engine::tree_capacity(self) == 0 {
                    None
                } else {
                    Some(self)
                }
            }

            $($extra)*
        }
    };
    (@tree $t:ty) => {
        impl speculative::TreeTarget for $t {
            fn max_tree_nodes(&self) -> usize {
                $crate::engine::Engine::tree_capacity(self)
            }

            #[doc = concat!(
                "See [`speculative::TreeTarget::forward_tree`] and the \"Token trees\" section ",
                "of [`", stringify!($t), "`]. The block is checked with ",
                "[`speculative::DraftBlock::validate`] against the vocabulary and ",
                "[`speculative::TreeTarget::max_tree_nodes`] (any sibling scheme is accepted: ",
                "the forward does not read them).\n\n",
                "# Errors\n",
                "[`speculative::Error::InvalidTree`] for an invalid block; ",
                "[`speculative::Error::Model`] (source [`crate::CandleError`]) for a root ",
                "outside the vocabulary, `seq_len + n + 1 > context_length`, a tree forward ",
                "not yet committed or a failed tensor operation. On error the sequence is ",
                "unchanged."
            )]
            fn forward_tree(
                &mut self,
                root: u32,
                block: &speculative::DraftBlock<'_>,
                logits: &mut Vec<f32>,
            ) -> speculative::Result<()> {
                let vocab = $crate::engine::Engine::model_config(self).vocab_size;
                let max_nodes = $crate::engine::Engine::tree_capacity(self);
                $crate::engine::check_tree(vocab, max_nodes, block)?;
                logits.clear();
                Ok($crate::engine::Engine::append_tree(self, root, block, logits)?)
            }

            /// See [`speculative::TreeTarget::commit_tree`].
            ///
            /// # Errors
            /// [`speculative::Error::TargetContract`] when no tree forward is pending or `path`
            /// is not a path of its block (the tree stays pending); [`speculative::Error::Model`]
            /// when copying the kept entries fails (the tree is then dropped and the sequence
            /// ends with the root).
            fn commit_tree(&mut self, path: &[u32]) -> speculative::Result<()> {
                $crate::engine::Engine::commit_path(self, path)
            }
        }
    };
}

pub(crate) use target_glue;
