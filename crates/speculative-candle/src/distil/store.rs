//! The append-only token store of [`super`]: shards of JSON lines and a manifest.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::DistilError;

/// The manifest's format tag.
pub const MANIFEST_FORMAT: &str = "speculative-distil-tokens/1";

/// The manifest file's name in the output directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// One answered turn: the token ids the target saw and wrote.
///
/// `tokens[..answer_start]` is the chat-templated prompt (the conversation's earlier turns,
/// with the target's own earlier answers as the assistant messages, then this turn's user
/// message and the assistant header); `tokens[answer_start..]` is the target's answer, as
/// generated (ending with the EOS id when `finish == "eos"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    /// The conversation's index in the input file (0-based).
    pub conv: u64,
    /// The turn's index in the conversation (0-based).
    pub turn: u32,
    /// The conversation's kind ("chat", "code", ...), from the input file.
    pub kind: String,
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
    /// Top-p of the sampled answers (1 for greedy).
    pub top_p: f32,
    /// The seed of this answer ([`super::turn_seed`]).
    pub seed: u64,
    /// Where the answer starts in `tokens`.
    pub answer_start: usize,
    /// Why the answer ended ([`speculative::decode::FinishReason`]'s `Display`).
    pub finish: String,
    /// Prompt and answer token ids.
    pub tokens: Vec<u32>,
}

impl TurnRecord {
    /// Tokens of the answer.
    pub fn answer_len(&self) -> usize {
        self.tokens.len() - self.answer_start.min(self.tokens.len())
    }
}

/// What a dataset depends on: a run with other settings must not append to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataIdentity {
    /// The model file's name and size in bytes.
    pub model: String,
    /// Size of the model file, in bytes.
    pub model_bytes: u64,
    /// FNV-1a 64 of the conversations file, as 16 hex digits.
    pub conversations_hash: String,
    /// Conversations in the input file.
    pub conversations: u64,
    /// Longest answer, in tokens.
    pub max_tokens: usize,
    /// Base seed of the sampled answers.
    pub seed: u64,
    /// Conversations per shard (the last shard may hold fewer).
    pub shard_conversations: u64,
}

/// One shard file: consecutive conversations `first_conv ..` in order, one [`TurnRecord`] a
/// line, every turn of a conversation before the next conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// File name in the output directory.
    pub file: String,
    /// Its first conversation.
    pub first_conv: u64,
    /// Conversations written to it (complete, every turn).
    pub conversations: u64,
    /// Turn records written.
    pub turns: u64,
    /// Bytes of the complete records (anything after is a partly written record, dropped on
    /// resume).
    pub bytes: u64,
    /// Answer tokens in it.
    pub answer_tokens: u64,
    /// Tokens in it (prompts and answers).
    pub tokens: u64,
}

/// `manifest.json`: what the data depends on and what is written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: String,
    /// What the data depends on.
    pub identity: DataIdentity,
    /// The shards, in conversation order.
    pub shards: Vec<ShardInfo>,
    /// Seconds spent generating, over every run.
    pub generate_seconds: f64,
}

impl Manifest {
    /// Conversations written (complete).
    pub fn conversations_done(&self) -> u64 {
        self.shards.iter().map(|s| s.conversations).sum()
    }

    /// Answer tokens written.
    pub fn answer_tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.answer_tokens).sum()
    }

    /// Turn records written.
    pub fn turns(&self) -> u64 {
        self.shards.iter().map(|s| s.turns).sum()
    }
}

/// FNV-1a 64 of `bytes` (identifies the conversations file in the manifest; not a
/// cryptographic hash).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Writes conversations in order into the shards of a directory and keeps its manifest.
///
/// Crash safety: a conversation's records are appended and flushed, then the manifest is
/// rewritten (temporary file and rename). [`TokenStore::open`] truncates the last shard to
/// the bytes its manifest records, so a record written after the last manifest update is
/// dropped and written again, identical, by the resumed run.
#[derive(Debug)]
pub struct TokenStore {
    dir: PathBuf,
    manifest: Manifest,
    file: Option<File>,
}

impl TokenStore {
    /// Opens `dir` (created if missing): a fresh manifest for `identity`, or the existing one,
    /// with its last shard cut back to its complete records.
    ///
    /// # Errors
    /// [`DistilError::Mismatch`] when `dir` holds a manifest of another identity or format;
    /// I/O and JSON errors.
    pub fn open(dir: &Path, identity: DataIdentity) -> Result<Self, DistilError> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(MANIFEST_FILE);
        let manifest = if path.exists() {
            let m: Manifest = serde_json::from_slice(&std::fs::read(&path)?)?;
            if m.format != MANIFEST_FORMAT || m.identity != identity {
                return Err(DistilError::Mismatch(format!(
                    "{} was written with other settings: {:?}, this run {:?}",
                    path.display(),
                    m.identity,
                    identity
                )));
            }
            m
        } else {
            Manifest {
                format: MANIFEST_FORMAT.into(),
                identity,
                shards: Vec::new(),
                generate_seconds: 0.0,
            }
        };
        if let Some(last) = manifest.shards.last() {
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(dir.join(&last.file))?;
            f.set_len(last.bytes)?;
        }
        Ok(TokenStore {
            dir: dir.to_path_buf(),
            manifest,
            file: None,
        })
    }

    /// The manifest as written so far.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The next conversation to write.
    pub fn next_conv(&self) -> u64 {
        self.manifest.conversations_done()
    }

    /// Appends the records of conversation [`TokenStore::next_conv`] (every turn, in order)
    /// and updates the manifest; `seconds` is added to its generation time.
    ///
    /// # Errors
    /// [`DistilError::BadInput`] when the records are not of that conversation; I/O and JSON
    /// errors.
    pub fn append(&mut self, records: &[TurnRecord], seconds: f64) -> Result<(), DistilError> {
        let conv = self.next_conv();
        if records.is_empty() || records.iter().any(|r| r.conv != conv) {
            return Err(DistilError::BadInput(format!(
                "records appended out of order (expected conversation {conv})"
            )));
        }
        let per = self.manifest.identity.shard_conversations.max(1);
        let needs_new = self
            .manifest
            .shards
            .last()
            .is_none_or(|s| s.conversations >= per);
        if needs_new {
            let index = self.manifest.shards.len();
            self.manifest.shards.push(ShardInfo {
                file: format!("shard-{index:05}.jsonl"),
                first_conv: conv,
                conversations: 0,
                turns: 0,
                bytes: 0,
                answer_tokens: 0,
                tokens: 0,
            });
            self.file = None;
        }
        let mut text = String::new();
        for r in records {
            text.push_str(&serde_json::to_string(r)?);
            text.push('\n');
        }
        let shard = self.manifest.shards.last_mut().expect("a shard was pushed");
        if self.file.is_none() {
            let f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join(&shard.file))?;
            self.file = Some(f);
        }
        let f = self.file.as_mut().expect("opened above");
        f.write_all(text.as_bytes())?;
        f.flush()?;
        shard.conversations += 1;
        shard.turns += records.len() as u64;
        shard.bytes += text.len() as u64;
        shard.answer_tokens += records.iter().map(|r| r.answer_len() as u64).sum::<u64>();
        shard.tokens += records.iter().map(|r| r.tokens.len() as u64).sum::<u64>();
        self.manifest.generate_seconds += seconds;
        self.write_manifest()
    }

    fn write_manifest(&self) -> Result<(), DistilError> {
        let tmp = self.dir.join(format!("{MANIFEST_FILE}.tmp"));
        std::fs::write(&tmp, serde_json::to_string_pretty(&self.manifest)? + "\n")?;
        std::fs::rename(&tmp, self.dir.join(MANIFEST_FILE))?;
        Ok(())
    }
}

/// Reads every complete record of the dataset in `dir`, in conversation order (the bytes
/// after a shard's recorded length are ignored).
///
/// # Errors
/// I/O and JSON errors.
pub fn read_records(dir: &Path) -> Result<(Manifest, Vec<TurnRecord>), DistilError> {
    let m: Manifest = serde_json::from_slice(&std::fs::read(dir.join(MANIFEST_FILE))?)?;
    let mut out = Vec::new();
    for s in &m.shards {
        let mut left = s.bytes;
        let mut r = BufReader::new(File::open(dir.join(&s.file))?);
        let mut line = String::new();
        while left > 0 {
            line.clear();
            let n = r.read_line(&mut line)? as u64;
            if n == 0 || n > left {
                break;
            }
            left -= n;
            out.push(serde_json::from_str(line.trim_end())?);
        }
    }
    Ok((m, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(per: u64) -> DataIdentity {
        DataIdentity {
            model: "m.gguf".into(),
            model_bytes: 3,
            conversations_hash: format!("{:016x}", fnv1a64(b"x")),
            conversations: 10,
            max_tokens: 8,
            seed: 1,
            shard_conversations: per,
        }
    }

    fn rec(conv: u64, turn: u32, n: usize) -> TurnRecord {
        TurnRecord {
            conv,
            turn,
            kind: "chat".into(),
            temperature: 0.7,
            top_p: 0.9,
            seed: conv * 10 + u64::from(turn),
            answer_start: 2,
            finish: "eos".into(),
            tokens: (0..n as u32).collect(),
        }
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("distil-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn shards_roll_over_and_read_back_in_order() {
        let d = tmp("roll");
        let mut s = TokenStore::open(&d, identity(2)).unwrap();
        for c in 0..5 {
            s.append(&[rec(c, 0, 5), rec(c, 1, 7)], 1.0).unwrap();
        }
        assert_eq!(s.manifest().shards.len(), 3);
        assert_eq!(s.manifest().answer_tokens(), 5 * (3 + 5));
        let (m, recs) = read_records(&d).unwrap();
        assert_eq!(m.conversations_done(), 5);
        assert_eq!(recs.len(), 10);
        assert_eq!(recs[9], rec(4, 1, 7));
        assert!(s.append(&[rec(7, 0, 3)], 0.0).is_err(), "out of order");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn resume_drops_a_partial_record_and_continues_identically() {
        let (a, b) = (tmp("whole"), tmp("resumed"));
        let mut whole = TokenStore::open(&a, identity(3)).unwrap();
        for c in 0..4 {
            whole.append(&[rec(c, 0, 4 + c as usize)], 0.0).unwrap();
        }
        let mut first = TokenStore::open(&b, identity(3)).unwrap();
        for c in 0..2 {
            first.append(&[rec(c, 0, 4 + c as usize)], 0.0).unwrap();
        }
        drop(first);
        // A record written after the last manifest update (a kill mid-conversation).
        let mut f = OpenOptions::new()
            .append(true)
            .open(b.join("shard-00000.jsonl"))
            .unwrap();
        f.write_all(b"{\"conv\": 2, \"tur").unwrap();
        drop(f);
        let mut again = TokenStore::open(&b, identity(3)).unwrap();
        assert_eq!(again.next_conv(), 2);
        for c in 2..4 {
            again.append(&[rec(c, 0, 4 + c as usize)], 0.0).unwrap();
        }
        for file in ["shard-00000.jsonl", "shard-00001.jsonl"] {
            assert_eq!(
                std::fs::read(a.join(file)).unwrap(),
                std::fs::read(b.join(file)).unwrap()
            );
        }
        assert_eq!(whole.manifest().shards, again.manifest().shards);
        assert!(matches!(
            TokenStore::open(&b, identity(4)),
            Err(DistilError::Mismatch(_))
        ));
        std::fs::remove_dir_all(&a).unwrap();
        std::fs::remove_dir_all(&b).unwrap();
    }
}
