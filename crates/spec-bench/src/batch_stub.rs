//! TEMPORARY stand-in for `speculative::decode::BatchGenerator` (being written on main) with the
//! same signatures: plain greedy decoding over a [`BatchTarget`], draft lengths ignored. Deleted
//! once the real API lands.
#![allow(missing_docs, dead_code)]

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use speculative::decode::{
    Detokenizer, FinishReason, Generation, GenerationError, GenerationParams, Metrics, StepStats,
    StreamChunk,
};
use speculative::{BatchTarget, Proposer, Result, SlotChunk, SlotInput};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

type StreamFn = Box<dyn FnMut(StreamChunk<'_>) -> ControlFlow<()> + Send>;

pub struct BatchRequest {
    prompt: Vec<u32>,
    params: GenerationParams,
    _proposer: Box<dyn Proposer + Send>,
    stream: Option<StreamFn>,
}

impl BatchRequest {
    pub fn new(
        prompt: Vec<u32>,
        params: GenerationParams,
        proposer: Box<dyn Proposer + Send>,
    ) -> Self {
        BatchRequest {
            prompt,
            params,
            _proposer: proposer,
            stream: None,
        }
    }
    pub fn with_detokenizer(self, _d: Box<dyn Detokenizer + Send>) -> Self {
        self
    }
    pub fn with_stream(
        mut self,
        f: impl FnMut(StreamChunk<'_>) -> ControlFlow<()> + Send + 'static,
    ) -> Self {
        self.stream = Some(Box::new(f));
        self
    }
}

#[derive(Debug, Clone, Default)]
pub struct GoodputConfig {}

#[derive(Debug, Clone)]
pub struct BatchConfig {
    pub max_batch_tokens: usize,
    pub prefill_chunk: usize,
    pub goodput: GoodputConfig,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_batch_tokens: 512,
            prefill_chunk: 128,
            goodput: GoodputConfig::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct BatchStepStats {
    pub sequences: usize,
    pub rows: usize,
    pub prefill_rows: usize,
    pub draft_rows: usize,
    pub emitted: usize,
    pub finished: usize,
    pub forward_time: Duration,
    pub step_time: Duration,
}

#[derive(Debug, Clone, Default)]
pub struct BatchMetrics {
    pub steps: u64,
    pub rows: u64,
    pub emitted: u64,
    pub forward_time: Duration,
    pub step_time: Duration,
}

#[derive(Debug)]
pub struct Finished {
    pub id: RequestId,
    pub result: std::result::Result<Generation, GenerationError>,
}

struct Active {
    id: RequestId,
    slot: usize,
    req: BatchRequest,
    prefilled: bool,
    out: Vec<u32>,
    last: u32,
}

pub struct BatchGenerator<B> {
    target: B,
    config: BatchConfig,
    next: u64,
    waiting: Vec<(RequestId, BatchRequest)>,
    active: Vec<Active>,
    finished: Vec<Finished>,
    metrics: BatchMetrics,
    logits: Vec<f32>,
    curve: Vec<(usize, f64)>,
}

impl<B: BatchTarget> BatchGenerator<B> {
    pub fn new(target: B) -> Self {
        BatchGenerator {
            target,
            config: BatchConfig::default(),
            next: 0,
            waiting: Vec::new(),
            active: Vec::new(),
            finished: Vec::new(),
            metrics: BatchMetrics::default(),
            logits: Vec::new(),
            curve: Vec::new(),
        }
    }
    pub fn with_config(target: B, config: BatchConfig) -> Result<Self> {
        let mut g = Self::new(target);
        g.config = config;
        Ok(g)
    }
    pub fn submit(&mut self, req: BatchRequest) -> Result<RequestId> {
        let id = RequestId(self.next);
        self.next += 1;
        self.waiting.push((id, req));
        Ok(id)
    }
    pub fn cancel(&mut self, _id: RequestId) -> bool {
        false
    }
    pub fn step(&mut self) -> Result<BatchStepStats> {
        let start = Instant::now();
        while self.active.len() < self.target.max_slots() && !self.waiting.is_empty() {
            let (id, req) = self.waiting.remove(0);
            let slot = (0..self.target.max_slots())
                .find(|s| !self.active.iter().any(|a| a.slot == *s))
                .unwrap_or(0);
            self.target.truncate(slot, 0)?;
            let last = *req.prompt.last().unwrap_or(&0);
            self.active.push(Active {
                id,
                slot,
                req,
                prefilled: false,
                out: Vec::new(),
                last,
            });
        }
        let mut st = BatchStepStats {
            sequences: self.active.len(),
            ..Default::default()
        };
        let chunks: Vec<SlotChunk<'_>> = self
            .active
            .iter()
            .flat_map(|a| {
                let mut v = Vec::new();
                if !a.prefilled && a.req.prompt.len() > 1 {
                    let p = &a.req.prompt[..a.req.prompt.len() - 1];
                    v.push(SlotChunk {
                        slot: a.slot,
                        input: SlotInput::Prefill(p),
                    });
                }
                v.push(SlotChunk {
                    slot: a.slot,
                    input: SlotInput::Chain(std::slice::from_ref(&a.last)),
                });
                v
            })
            .collect();
        // PerSlot runs chunks in order, so one slot twice (prefill then chain) works there.
        let mut logits = std::mem::take(&mut self.logits);
        logits.clear();
        let f0 = Instant::now();
        for c in &chunks {
            let mut l = Vec::new();
            self.target.forward_batch(std::slice::from_ref(c), &mut l)?;
            logits.extend(l);
        }
        let ft = f0.elapsed();
        st.rows = chunks.iter().map(|c| c.input.rows()).sum();
        st.prefill_rows = st.rows - self.active.len();
        let v = self.target.vocab_size();
        let mut done = Vec::new();
        for (i, a) in self.active.iter_mut().enumerate() {
            a.prefilled = true;
            let row = &logits[i * v..(i + 1) * v];
            let mut best = 0;
            for (t, &x) in row.iter().enumerate() {
                if x > row[best] {
                    best = t;
                }
            }
            let t = best as u32;
            a.out.push(t);
            a.last = t;
            st.emitted += 1;
            if let Some(s) = a.req.stream.as_mut() {
                let _ = s(StreamChunk {
                    tokens: std::slice::from_ref(&t),
                    logprobs: None,
                    text: "",
                    step: StepStats::default(),
                });
            }
            let eos = a.req.params.stop.eos.contains(&t);
            if eos || a.out.len() >= a.req.params.max_new_tokens {
                done.push((
                    i,
                    if eos {
                        FinishReason::Eos
                    } else {
                        FinishReason::MaxTokens
                    },
                ));
            }
        }
        self.logits = logits;
        for (i, why) in done.into_iter().rev() {
            let a = self.active.remove(i);
            self.target.release(a.slot)?;
            let metrics = Metrics {
                emitted: a.out.len(),
                target_calls: a.out.len(),
                no_draft_steps: a.out.len(),
                ..Default::default()
            };
            self.finished.push(Finished {
                id: a.id,
                result: Ok(Generation {
                    tokens: a.out,
                    finish: why,
                    metrics,
                    logprobs: None,
                    text: None,
                }),
            });
            st.finished += 1;
        }
        st.forward_time = ft;
        st.step_time = start.elapsed();
        self.curve.push((st.rows, ft.as_secs_f64()));
        self.metrics.steps += 1;
        self.metrics.rows += st.rows as u64;
        self.metrics.emitted += st.emitted as u64;
        self.metrics.forward_time += ft;
        self.metrics.step_time += st.step_time;
        Ok(st)
    }
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }
    pub fn run(&mut self) -> Result<Vec<Finished>> {
        while !self.is_idle() {
            self.step()?;
        }
        Ok(self.take_finished())
    }
    pub fn is_idle(&self) -> bool {
        self.active.is_empty() && self.waiting.is_empty()
    }
    pub fn active(&self) -> usize {
        self.active.len()
    }
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn metrics(&self) -> &BatchMetrics {
        &self.metrics
    }
    pub fn cost_curve(&self) -> Vec<(usize, f64)> {
        self.curve.clone()
    }
    pub fn into_target(self) -> B {
        self.target
    }
}
