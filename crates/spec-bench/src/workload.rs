//! JSONL workloads: one request per line.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{BenchError, Result};

/// One request of a workload.
///
/// A line looks like `{"prompt": "Rewrite ...", "kind": "rewrite", "max_tokens": 128}`;
/// `kind` (default `"default"`) groups requests in the aggregates and `max_tokens` (default: the
/// run's `--max-tokens`) caps the output in tokens. Requests with the same `session` are the
/// turns of one conversation, in file order: each turn is sent as the whole conversation so far
/// (earlier turns' prompts as user messages, the outputs generated for them as assistant
/// messages) followed by its own prompt, as an agent or a chat client resubmits it (see
/// `spec_bench::matrix::Turn`). `json_schema` (a schema object) or `grammar` (Lark text)
/// constrain the output (structured output, `kind` `structured` in docs/workloads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// The user message (the chat template is applied by the runner for instruct models).
    pub prompt: String,
    /// Workload kind, for per-kind aggregates.
    #[serde(default = "default_kind")]
    pub kind: String,
    /// Maximum new tokens for this request.
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Conversation name: requests that share it are turns of one conversation.
    #[serde(default)]
    pub session: Option<String>,
    /// A JSON schema the output must follow (structured output; `spec-bench run` constrains
    /// every run of the request, baseline included).
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
    /// A Lark grammar the output must follow (instead of `json_schema`).
    #[serde(default)]
    pub grammar: Option<String>,
}

fn default_kind() -> String {
    "default".into()
}

/// Parses a JSONL workload. Blank lines and lines starting with `#` are skipped.
///
/// # Errors
/// [`BenchError::Workload`] naming the 1-based line number for malformed JSON, an unknown field,
/// an empty prompt or `max_tokens = 0`; [`BenchError::Workload`] at line 0 for an empty workload.
pub fn parse(text: &str) -> Result<Vec<Request>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let r: Request = serde_json::from_str(t).map_err(|e| BenchError::Workload {
            line: line_no,
            reason: e.to_string(),
        })?;
        if r.prompt.trim().is_empty() {
            return Err(BenchError::Workload {
                line: line_no,
                reason: "empty prompt".into(),
            });
        }
        if r.max_tokens == Some(0) {
            return Err(BenchError::Workload {
                line: line_no,
                reason: "max_tokens must be >= 1".into(),
            });
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err(BenchError::Workload {
            line: 0,
            reason: "the workload has no request".into(),
        });
    }
    Ok(out)
}

/// Reads and parses a JSONL workload file.
///
/// # Errors
/// [`BenchError::Io`] when the file cannot be read, else as [`parse`].
pub fn load(path: &Path) -> Result<Vec<Request>> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::Io {
        path: path.display().to_string(),
        source: e,
    })?;
    parse(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_defaults() {
        let w = parse("{\"prompt\": \"hi\"}\n\n# comment\n{\"prompt\": \"x\", \"kind\": \"code\", \"max_tokens\": 9}\n").unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!(w[0].kind, "default");
        assert_eq!(w[1].max_tokens, Some(9));
        assert_eq!(w[1].session, None);
        let w = parse("{\"prompt\": \"a\", \"session\": \"s1\"}").unwrap();
        assert_eq!(w[0].session.as_deref(), Some("s1"));
        assert_eq!((&w[0].json_schema, &w[0].grammar), (&None, &None));
        let w = parse(
            "{\"prompt\": \"a\", \"json_schema\": {\"type\": \"object\"}}\n{\"prompt\": \"b\", \"grammar\": \"start: /x+/\"}",
        )
        .unwrap();
        assert_eq!(
            w[0].json_schema,
            Some(serde_json::json!({"type": "object"}))
        );
        assert_eq!(w[1].grammar.as_deref(), Some("start: /x+/"));
    }

    #[test]
    fn the_structured_workload_parses_and_every_schema_compiles() {
        let w = load(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/workloads/structured.jsonl"
        )))
        .unwrap();
        assert_eq!(w.len(), 15);
        // A toy vocabulary of single bytes is enough to compile the grammars.
        let bytes: Vec<Vec<u8>> = (0u8..128)
            .map(|b| vec![b])
            .chain([b"<eos>".to_vec()])
            .collect();
        let special = (0..129).map(|i| i == 128).collect();
        let v = speculative_guidance::Vocabulary::greedy(bytes, special, 128).unwrap();
        for r in &w {
            assert_eq!(r.kind, "structured");
            let schema = r.json_schema.as_ref().expect("a schema per request");
            speculative_guidance::GrammarMask::json_schema(&v, schema, 0).unwrap();
        }
    }

    #[test]
    fn errors_name_the_line() {
        let e = parse("{\"prompt\": \"a\"}\n{\"prompt\": 3}\n").unwrap_err();
        assert!(matches!(e, BenchError::Workload { line: 2, .. }), "{e}");
        let e = parse("{\"prompt\": \"a\"}\n\n{\"prompt\": \"b\", \"extra\": 1}").unwrap_err();
        assert!(matches!(e, BenchError::Workload { line: 3, .. }), "{e}");
        let e = parse("{\"prompt\": \"  \"}").unwrap_err();
        assert!(matches!(e, BenchError::Workload { line: 1, .. }));
        let e = parse("{\"prompt\": \"a\", \"max_tokens\": 0}").unwrap_err();
        assert!(matches!(e, BenchError::Workload { line: 1, .. }));
        assert!(matches!(
            parse("\n# only\n"),
            Err(BenchError::Workload { line: 0, .. })
        ));
        assert!(e.to_string().contains("line 1"));
    }
}
