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
//! ```ignore
//! let vocab = Vocabulary::new(token_bytes, special, eos, tokenize)?;
//! let mask = Arc::new(GrammarMask::json_schema(&vocab, &schema, prompt.len())?);
//! let cfg = SamplingConfig::builder().mask(mask.clone()).build()?;
//! let mut g = Generator::new(target, ForcedDrafts::new(mask, PromptLookup::new(1, 3)?));
//! let out = g.generate(&prompt, &GenerationParams { sampling: cfg,
//!     stop: StopConditions::eos(eos), ..Default::default() })?;
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
