//! Errors of the grammar adapter.

/// What can go wrong when building a vocabulary or compiling a grammar.
///
/// Masking itself never fails: [`crate::GrammarMask`] implements [`speculative::TokenMask`],
/// whose `apply` cannot return an error (see the mask's docs for rows the grammar rejects).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GuidanceError {
    /// The token table is unusable: empty, an EOS id outside it, or a special-token flag list
    /// of another length.
    #[error("invalid vocabulary: {0}")]
    Vocabulary(String),
    /// The grammar (JSON schema, Lark grammar or regex) does not compile; llguidance's message.
    #[error("grammar does not compile: {0}")]
    Grammar(String),
    /// A JSON schema file is not JSON.
    #[error("JSON schema is not valid JSON: {0}")]
    SchemaJson(#[from] serde_json::Error),
}

impl From<GuidanceError> for speculative::Error {
    fn from(e: GuidanceError) -> Self {
        speculative::Error::Proposer(Box::new(e))
    }
}
