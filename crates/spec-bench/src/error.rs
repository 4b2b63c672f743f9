//! Errors of the harness.

/// Errors returned by `spec-bench`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A workload line is malformed (`line` is 1-based; 0 means the whole file).
    #[error("workload line {line}: {reason}")]
    Workload {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A cost table or trace for the simulator is malformed.
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// Which input.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// File I/O failed.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Decoding failed.
    #[error(transparent)]
    Decode(#[from] speculative::Error),
    /// The model adapter failed.
    #[error(transparent)]
    Model(#[from] speculative_candle::CandleError),
    /// A plot could not be drawn.
    #[error("plot {path}: {reason}")]
    Plot {
        /// Output path.
        path: String,
        /// Why.
        reason: String,
    },
}

/// `Result` with [`BenchError`].
pub type Result<T, E = BenchError> = std::result::Result<T, E>;
