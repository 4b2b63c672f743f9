//! Self-distilled training data at scale: the target answers many conversations through the
//! batch loop ([`BatchGenerator`] over [`FastBatch`]), and the token ids are stored, resumably,
//! in append-only shards ([`store`]).
//!
//! - **Input**: conversations, one JSON object a line (`scripts/make-eagle3-conversations.py`
//!   writes them): `{"conv": i, "kind": "chat", "temperature": 0.7, "top_p": 0.9, "turns":
//!   ["first user message", "follow-up", ...]}` ([`Conversation`]).
//! - **Turns**: turn `t`'s prompt is the chat template over the user messages `0 ..= t` with
//!   the target's own decoded answers `0 .. t` as the assistant messages; the answer is
//!   sampled with the conversation's temperature and top-p and the seed [`turn_seed`]`(seed,
//!   conv, t)`, so every answer depends only on its conversation, turn and the base seed.
//! - **Output**: [`TurnRecord`]s (token ids of prompt and answer, the answer start, sampling,
//!   seed, finish reason) in conversation order; no hidden states (training recomputes them
//!   with a batched prefill of each stored sequence).
//! - **Lossless speed-up**: greedy answers from the batch loop are bit-identical to a
//!   [`speculative::decode::Generator`] alone (batch-invariant logits), and sampled ones too
//!   because prompt-lookup drafts are point masses (C15), so neither the batch size, the
//!   proposer ([`Drafting`]) nor the thread count changes a bit of the data, and a killed run
//!   restarted on the same directory ([`TokenStore::open`]) writes the same files.
//! - **Features for training** ([`dump`]): a prefill of each stored sequence writes the
//!   target's multi-layer features, final hidden states and embeddings to safetensors files
//!   (`train_draft_head dump-features`).

pub mod dump;
pub mod store;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::Deserialize;
use speculative::decode::{
    BatchConfig, BatchGenerator, BatchRequest, DraftLength, GenerationParams, RequestId,
    StopConditions,
};
use speculative::propose::PromptLookup;
use speculative::{NoProposer, SamplingConfig};

use crate::fast::{FastBatch, FastWeights};
use crate::{ChatMessage, GgufTokenizer};
pub use dump::{
    DUMP_MANIFEST, DumpConfig, DumpIdentity, DumpSummary, FEATURES_FORMAT, LM_HEAD_FILE,
    dump_features, feature_file_name, write_output_rows,
};
pub use store::{
    DataIdentity, MANIFEST_FILE, Manifest, ShardInfo, TokenStore, TurnRecord, fnv1a64, read_records,
};

/// Errors of data generation.
#[derive(Debug, thiserror::Error)]
pub enum DistilError {
    /// Reading or writing the files.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// A malformed JSON line or manifest.
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
    /// The output directory holds data written with other settings.
    #[error("{0}")]
    Mismatch(String),
    /// Bad input (a conversation without turns, records out of order, ...).
    #[error("{0}")]
    BadInput(String),
    /// The model, tokenizer or template failed.
    #[error(transparent)]
    Candle(#[from] crate::CandleError),
    /// The decoding loop failed.
    #[error(transparent)]
    Decode(#[from] speculative::Error),
}

/// One conversation of the input file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Conversation {
    /// Its index (must equal its line index among the non-empty lines).
    pub conv: u64,
    /// Its kind ("chat", "code", "rewrite", ...), copied into the records.
    #[serde(default)]
    pub kind: String,
    /// Sampling temperature of every answer (0 = greedy).
    pub temperature: f32,
    /// Top-p of the sampled answers (ignored when greedy).
    #[serde(default = "one")]
    pub top_p: f32,
    /// The user messages, one per turn (at least one).
    pub turns: Vec<String>,
}

fn one() -> f32 {
    1.0
}

/// Parses the conversations file (JSON lines, [`Conversation`]).
///
/// # Errors
/// [`DistilError::Json`] for a malformed line; [`DistilError::BadInput`] for a conversation
/// without turns or whose `conv` is not its index.
pub fn parse_conversations(text: &str) -> Result<Vec<Conversation>, DistilError> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let c: Conversation = serde_json::from_str(line)?;
        if c.turns.is_empty() || c.conv != out.len() as u64 {
            return Err(DistilError::BadInput(format!(
                "conversation {} (line {}): no turns, or conv is not its index",
                c.conv,
                out.len()
            )));
        }
        out.push(c);
    }
    Ok(out)
}

/// The seed of turn `turn` of conversation `conv`: `seed · 1,000,003 + conv · 16 + turn`
/// (wrapping; at most 16 turns a conversation keep the seeds distinct).
pub fn turn_seed(seed: u64, conv: u64, turn: u32) -> u64 {
    seed.wrapping_mul(1_000_003)
        .wrapping_add(conv.wrapping_mul(16))
        .wrapping_add(u64::from(turn))
}

/// How the batch loop drafts (lossless either way: the data do not depend on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drafting {
    /// Plain decoding, one token per sequence per step.
    Off,
    /// Prompt lookup (`PromptLookup::new(min_n, max_n)`) with the adaptive draft length chosen
    /// for the whole batch by the goodput policy.
    PromptLookup {
        /// Shortest n-gram matched.
        min_n: usize,
        /// Longest n-gram matched.
        max_n: usize,
    },
}

/// Settings of [`generate_tokens`].
#[derive(Debug, Clone)]
pub struct DistilConfig {
    /// Longest answer, in tokens (part of the data's identity).
    pub max_tokens: usize,
    /// Base seed of the answers (part of the data's identity).
    pub seed: u64,
    /// Conversations per shard (part of the data's identity).
    pub shard_conversations: u64,
    /// Slots of the [`FastBatch`] (sequences per forward).
    pub slots: usize,
    /// Matmul threads ([`FastBatch::with_threads`]).
    pub threads: usize,
    /// Rows per forward ([`BatchConfig::max_batch_tokens`]).
    pub max_batch_tokens: usize,
    /// How the loop drafts.
    pub drafting: Drafting,
    /// Stop after this many conversations in this run (all when `None`).
    pub limit: Option<u64>,
    /// Seconds between progress lines.
    pub progress_secs: f64,
}

/// What a run of [`generate_tokens`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DistilSummary {
    /// Conversations written by this run.
    pub conversations: u64,
    /// Answer tokens written by this run.
    pub answer_tokens: u64,
    /// Wall seconds of this run.
    pub seconds: f64,
}

/// A conversation in flight: its records so far and the decoded answers (the history).
struct Live {
    records: Vec<TurnRecord>,
    answers: Vec<String>,
}

/// Shared state of a run.
struct Ctx<'a> {
    tok: &'a GgufTokenizer,
    convs: &'a [Conversation],
    cfg: &'a DistilConfig,
}

impl Ctx<'_> {
    /// The chat-templated prompt of the next turn of `conv` given its answers so far.
    fn prompt(&self, conv: &Conversation, answers: &[String]) -> Result<Vec<u32>, DistilError> {
        let mut msgs = Vec::with_capacity(2 * answers.len() + 1);
        for (u, a) in conv.turns.iter().zip(answers) {
            msgs.push(ChatMessage::user(u.clone()));
            msgs.push(ChatMessage::assistant(a.clone()));
        }
        msgs.push(ChatMessage::user(conv.turns[answers.len()].clone()));
        let text = self.tok.apply_chat_template(&msgs)?;
        Ok(self.tok.encode(&text)?)
    }

    /// The request of turn `turn` of `conv` with prompt `prompt`.
    fn request(
        &self,
        conv: &Conversation,
        turn: u32,
        prompt: Vec<u32>,
    ) -> Result<BatchRequest, DistilError> {
        let greedy = conv.temperature == 0.0;
        let sampling = SamplingConfig::builder()
            .temperature(conv.temperature)
            .top_p(if greedy { 1.0 } else { conv.top_p })
            .build()?;
        let b = GenerationParams::builder()
            .sampling(sampling)
            .seed(turn_seed(self.cfg.seed, conv.conv, turn))
            .max_new_tokens(self.cfg.max_tokens)
            .stop(StopConditions::eos(self.tok.eos_id()));
        let req = match self.cfg.drafting {
            Drafting::Off => {
                let params = b.draft(DraftLength::Off).build()?;
                BatchRequest::new(prompt, params, NoProposer)
            }
            Drafting::PromptLookup { min_n, max_n } => {
                let params = b.draft(DraftLength::Adaptive(Default::default())).build()?;
                BatchRequest::new(prompt, params, PromptLookup::new(min_n, max_n)?)
            }
        };
        Ok(req.with_conversation(conv.conv))
    }
}

/// The data's identity for `model` and the conversations file's bytes.
///
/// # Errors
/// I/O errors reading the model file's size.
pub fn identity(
    model: &Path,
    conversations_bytes: &[u8],
    conversations: u64,
    cfg: &DistilConfig,
) -> Result<DataIdentity, DistilError> {
    Ok(DataIdentity {
        model: model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        model_bytes: std::fs::metadata(model)?.len(),
        conversations_hash: format!("{:016x}", fnv1a64(conversations_bytes)),
        conversations,
        max_tokens: cfg.max_tokens,
        seed: cfg.seed,
        shard_conversations: cfg.shard_conversations,
    })
}

/// Answers the conversations not yet in `store` (from [`TokenStore::next_conv`] on, at most
/// [`DistilConfig::limit`] of them) with the batch loop and appends them in order. At most
/// `2 · slots` conversations are in flight; a finished conversation waits until every earlier
/// one is written. `log` receives a progress line every [`DistilConfig::progress_secs`].
///
/// # Errors
/// A failed forward, template or tokenizer call, or a request that ended with an error
/// ([`DistilError::Decode`]); I/O errors of the store. What was written before stays valid.
pub fn generate_tokens(
    weights: Arc<FastWeights>,
    tok: &GgufTokenizer,
    convs: &[Conversation],
    store: &mut TokenStore,
    cfg: &DistilConfig,
    log: &mut dyn FnMut(&str),
) -> Result<DistilSummary, DistilError> {
    let ctx = Ctx { tok, convs, cfg };
    let target = FastBatch::new(weights, cfg.slots.max(1))?
        .with_threads(cfg.threads)
        .with_max_batch_tokens(cfg.max_batch_tokens.max(1));
    let bcfg = BatchConfig::default().with_max_batch_tokens(cfg.max_batch_tokens.max(1));
    let mut batch = BatchGenerator::with_config(target, bcfg)?;
    let start = store.next_conv();
    let end = cfg
        .limit
        .map_or(convs.len() as u64, |l| start.saturating_add(l))
        .min(convs.len() as u64);
    let mut run = Run {
        next_submit: start,
        live: BTreeMap::new(),
        ids: HashMap::new(),
        done: BTreeMap::new(),
        t0: Instant::now(),
        last_write: Instant::now(),
        last_log: Instant::now(),
        answer_tokens: 0,
        written: 0,
    };
    while store.next_conv() < end {
        run.fill(&ctx, &mut batch, end, 2 * cfg.slots.max(1))?;
        batch.step()?;
        for f in batch.take_finished() {
            run.finished(&ctx, &mut batch, f)?;
        }
        run.write_ready(store)?;
        if run.last_log.elapsed().as_secs_f64() >= cfg.progress_secs {
            run.last_log = Instant::now();
            log(&run.progress(store, end, batch.metrics().emitted));
        }
    }
    Ok(DistilSummary {
        conversations: run.written,
        answer_tokens: run.answer_tokens,
        seconds: run.t0.elapsed().as_secs_f64(),
    })
}

/// The bookkeeping of one [`generate_tokens`] run.
struct Run {
    next_submit: u64,
    live: BTreeMap<u64, Live>,
    /// Request -> (conversation, turn, prompt length).
    ids: HashMap<RequestId, (u64, u32, Vec<u32>)>,
    /// Finished conversations waiting for the earlier ones.
    done: BTreeMap<u64, Vec<TurnRecord>>,
    t0: Instant,
    last_write: Instant,
    last_log: Instant,
    answer_tokens: u64,
    written: u64,
}

impl Run {
    /// Starts conversations until `in_flight` are live or done-but-unwritten.
    fn fill(
        &mut self,
        ctx: &Ctx<'_>,
        batch: &mut BatchGenerator<FastBatch>,
        end: u64,
        in_flight: usize,
    ) -> Result<(), DistilError> {
        while self.next_submit < end && self.live.len() + self.done.len() < in_flight {
            let c = self.next_submit;
            self.next_submit += 1;
            self.live.insert(
                c,
                Live {
                    records: Vec::new(),
                    answers: Vec::new(),
                },
            );
            self.submit(ctx, batch, c)?;
        }
        Ok(())
    }

    /// Submits the next turn of live conversation `c`.
    fn submit(
        &mut self,
        ctx: &Ctx<'_>,
        batch: &mut BatchGenerator<FastBatch>,
        c: u64,
    ) -> Result<(), DistilError> {
        let conv = &ctx.convs[c as usize];
        let live = &self.live[&c];
        let turn = live.answers.len() as u32;
        let prompt = ctx.prompt(conv, &live.answers)?;
        let req = ctx.request(conv, turn, prompt.clone())?;
        let id = batch.submit(req)?;
        self.ids.insert(id, (c, turn, prompt));
        Ok(())
    }

    /// Records a finished request and submits the conversation's next turn, if any.
    fn finished(
        &mut self,
        ctx: &Ctx<'_>,
        batch: &mut BatchGenerator<FastBatch>,
        f: speculative::decode::Finished,
    ) -> Result<(), DistilError> {
        let Some((c, turn, prompt)) = self.ids.remove(&f.id) else {
            return Ok(());
        };
        let g = f.result.map_err(|e| e.error)?;
        let conv = &ctx.convs[c as usize];
        let answer = ctx.tok.decode(&g.tokens, true)?;
        let mut tokens = prompt;
        let answer_start = tokens.len();
        tokens.extend_from_slice(&g.tokens);
        let live = self.live.get_mut(&c).expect("a live conversation");
        live.records.push(TurnRecord {
            conv: c,
            turn,
            kind: conv.kind.clone(),
            temperature: conv.temperature,
            top_p: if conv.temperature == 0.0 {
                1.0
            } else {
                conv.top_p
            },
            seed: turn_seed(ctx.cfg.seed, c, turn),
            answer_start,
            finish: g.finish.to_string(),
            tokens,
        });
        live.answers.push(answer);
        if live.answers.len() < conv.turns.len() {
            return self.submit(ctx, batch, c);
        }
        let live = self.live.remove(&c).expect("a live conversation");
        self.done.insert(c, live.records);
        Ok(())
    }

    /// Appends every finished conversation whose predecessors are written.
    fn write_ready(&mut self, store: &mut TokenStore) -> Result<(), DistilError> {
        while let Some(recs) = self.done.remove(&store.next_conv()) {
            let secs = self.last_write.elapsed().as_secs_f64();
            self.last_write = Instant::now();
            store.append(&recs, secs)?;
            self.answer_tokens += recs.iter().map(|r| r.answer_len() as u64).sum::<u64>();
            self.written += 1;
        }
        Ok(())
    }

    /// A progress line: conversations and answer tokens written, and this run's rate of
    /// generated answer tokens (`emitted`, written or still in flight).
    fn progress(&self, store: &TokenStore, end: u64, emitted: u64) -> String {
        let secs = self.t0.elapsed().as_secs_f64();
        let m = store.manifest();
        format!(
            "{:.0} s: conversations {}/{end} ({} turns), answer tokens {} written in all; this run {} generated, {:.1} answer tokens/s",
            secs,
            m.conversations_done(),
            m.turns(),
            m.answer_tokens(),
            emitted,
            emitted as f64 / secs.max(1e-9),
        )
    }
}
