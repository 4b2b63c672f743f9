//! Structured output under speculative decoding: [llguidance] grammars (JSON schema, Lark,
//! regex) as the [`speculative::TokenMask`] of every target and draft row, rolled back with the
//! verifier's decisions, and the tokens a grammar forces as free drafts.
//!
//! - [`Vocabulary`]: the model's token table and tokenizer, as llguidance needs them (once per
//!   model).
//! - [`GrammarMask`]: per request; put it in the request's [`speculative::SamplingConfig`]
//!   (`SamplingConfig::builder().mask(mask)`). Target and draft rows at the same prefix get the
//!   same allowed set (computed once), so verification stays lossless: the law of the constrained
//!   output with speculation is the law of plain constrained sampling.
//! - [`ForcedDrafts`]: a [`speculative::Proposer`] wrapper that drafts the grammar-forced tokens
//!   before another proposer's draft (chains) or as the trunk of its tree.
//!
//! On a toy vocabulary and target (with a real model, build the [`Vocabulary`] from its
//! tokenizer, see [`Vocabulary::with_tokenizer`]):
//!
//! ```
//! use std::sync::Arc;
//! use speculative::decode::{DraftLength, GenerationParams, Generator, StopConditions};
//! use speculative::propose::PromptLookup;
//! use speculative::SamplingConfig;
//! use speculative_guidance::{ForcedDrafts, GrammarMask, Vocabulary};
//!
//! // Tokens `{`, `}`, `a`, `b` and the EOS token (special).
//! let toks = ["{", "}", "a", "b", "<eos>"];
//! let bytes = toks.iter().map(|t| t.as_bytes().to_vec()).collect();
//! let vocab = Vocabulary::greedy(bytes, (0..5).map(|i| i == 4).collect(), 4)?;
//! let prompt = [0u32, 2, 3, 1, 0, 2];
//! // One mask per request: the grammar starts after the prompt.
//! let mask = Arc::new(GrammarMask::regex(&vocab, r"\{(ab)+\}", prompt.len())?);
//! let params = GenerationParams::builder()
//!     .sampling(SamplingConfig::builder().mask(mask.clone()).build()?)
//!     .max_new_tokens(12)
//!     .draft(DraftLength::Fixed(4))
//!     .stop(StopConditions::eos(4))
//!     .build()?;
//! let target = speculative::test_util::ToyModel::markov(5, 2, 1.0, 7);
//! let mut g = Generator::new(target, ForcedDrafts::new(mask, PromptLookup::new(1, 3)?));
//! let out = g.generate(&prompt, &params)?;
//! // `{` is forced first, and every `a` is followed by `b`.
//! assert_eq!(out.tokens[0], 0);
//! assert!(out.tokens.windows(2).all(|w| w[0] != 2 || w[1] == 3));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The grammar starts at the first generated token ([`GrammarMask::new`]'s `prompt_len`), and
//! when it is complete only EOS is allowed, so a generation that stops at EOS ends exactly
//! where the grammar does.
//!
//! [llguidance]: https://github.com/guidance-ai/llguidance

mod error;
mod forced;
mod mask;
mod vocab;

pub use error::GuidanceError;
pub use forced::{ForcedDrafts, MAX_BRANCHES, MAX_CHOICES};
pub use mask::{Grammar, GrammarMask, GrammarState};
pub use vocab::{TokenizeFn, Vocabulary};
