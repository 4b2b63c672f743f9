//! The loop cases C19 (draft rows ban what target rows ban before `min_tokens`) and C20
//! (requests without a seed draw their own) of `cases/verifier-and-loop-cases.md` (issue 26).

use speculative::decode::{
    BatchGenerator, BatchRequest, DraftLength, Generation, GenerationParams, Generator, SeedSource,
    StopConditions,
};
use speculative::propose::{DraftModelProposer, PromptLookup};
use speculative::test_util::ToyModel;
use speculative::{Draft, PerSlot, ProposeRequest, Proposer, Result, SamplingConfig};

const VOCAB: usize = 8;

/// The C19 target (and, identical, its draft model): token 2 is likely everywhere.
fn c19_model() -> ToyModel {
    ToyModel::markov(VOCAB, 2, 2.0, 19)
}

/// A draft model that forgets the request's banned ids: what the proposer request carried
/// before case C19 was fixed (only the EOS ids were banned on draft rows).
struct ForgetsBans<P>(P);

impl<P: Proposer> Proposer for ForgetsBans<P> {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        let mut r = *req;
        r.suppress = req.eos;
        self.0.propose(&r, draft)
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.0.begin(prompt)
    }

    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.0.observe(accepted, emitted)
    }
}

/// C19's request: temperature 1, `min_tokens = max_new_tokens = 40`, k = 4, seeded.
fn c19_params(stop: StopConditions, seed: u64) -> GenerationParams {
    GenerationParams::sampled(SamplingConfig::sampling(1.0).unwrap(), seed, 40)
        .to_builder()
        .min_tokens(40)
        .stop(stop)
        .draft(DraftLength::Fixed(4))
        .build()
        .unwrap()
}

/// Proposed and accepted drafts of C19's request over several seeds.
fn c19_acceptance(stop: &StopConditions, forget: bool) -> (usize, usize) {
    let (mut proposed, mut accepted) = (0, 0);
    for seed in 0..8 {
        let draft = DraftModelProposer::new(c19_model());
        let params = c19_params(stop.clone(), seed);
        let out = if forget {
            Generator::new(c19_model(), ForgetsBans(draft)).generate(&[1, 3], &params)
        } else {
            Generator::new(c19_model(), draft).generate(&[1, 3], &params)
        }
        .unwrap();
        assert_eq!(out.tokens.len(), 40);
        assert!(
            !out.tokens.contains(&2),
            "a banned id was emitted: {:?}",
            out.tokens
        );
        proposed += out.metrics.proposed;
        accepted += out.metrics.accepted;
    }
    (proposed, accepted)
}

#[test]
fn c19_before_min_tokens_draft_rows_ban_what_target_rows_ban() {
    // q = p on every row, so every draft is accepted: with EOS id 2, and (the case) with the
    // single-token stop sequence [2] and no EOS.
    let eos = StopConditions::eos(2);
    let seq = StopConditions::default().with_stop_sequence(vec![2]);
    for stop in [&eos, &seq] {
        let (proposed, accepted) = c19_acceptance(stop, false);
        assert!(proposed > 50);
        assert_eq!(accepted, proposed, "{stop:?}");
    }
    // Negative control: a draft model that bans only the EOS ids rejects drafts of id 2 (the
    // target row bans it), so the same check fails.
    let (proposed, accepted) = c19_acceptance(&seq, true);
    assert!(accepted < proposed, "{accepted} of {proposed}");
}

/// A flat target: sampled outputs of two seeds differ with overwhelming probability.
fn c20_model() -> ToyModel {
    ToyModel::markov(16, 1, 0.3, 20)
}

/// A sampled request of 32 tokens without a seed (temperature 1, prompt lookup drafts).
fn unseeded() -> GenerationParams {
    GenerationParams::builder()
        .sampling(SamplingConfig::sampling(1.0).unwrap())
        .max_new_tokens(32)
        .seed(None)
        .build()
        .unwrap()
}

const PROMPT: [u32; 6] = [1, 2, 3, 1, 2, 3];

/// The output of `params` on a fresh generator.
fn alone(params: &GenerationParams) -> Generation {
    let mut g = Generator::new(c20_model(), PromptLookup::new(1, 4).unwrap());
    g.generate(&PROMPT, params).unwrap()
}

#[test]
fn c20_requests_without_a_seed_draw_their_own_one_after_the_other() {
    let mut g = Generator::new(c20_model(), PromptLookup::new(1, 4).unwrap());
    let a = g.generate(&PROMPT, &unseeded()).unwrap();
    let b = g.generate(&PROMPT, &unseeded()).unwrap();
    assert_ne!(a.seed, b.seed);
    assert_ne!(a.tokens, b.tokens);
    // The reported seed reproduces each output exactly.
    for out in [&a, &b] {
        let again = alone(&unseeded().with_seed(out.seed));
        assert_eq!((again.tokens, again.seed), (out.tokens.clone(), out.seed));
    }
}

#[test]
fn c20_requests_without_a_seed_draw_their_own_in_one_batch() {
    let mut batch = BatchGenerator::new(PerSlot::new(vec![c20_model(), c20_model()]).unwrap());
    for _ in 0..2 {
        let proposer = PromptLookup::new(1, 4).unwrap();
        batch
            .submit(BatchRequest::new(PROMPT.to_vec(), unseeded(), proposer))
            .unwrap();
    }
    let done = batch.run().unwrap();
    let outs: Vec<Generation> = done.into_iter().map(|f| f.result.unwrap()).collect();
    assert_eq!(outs.len(), 2);
    assert_ne!(outs[0].seed, outs[1].seed);
    assert_ne!(outs[0].tokens, outs[1].tokens);
    for out in &outs {
        assert_eq!(alone(&unseeded().with_seed(out.seed)).tokens, out.tokens);
    }
}

#[test]
fn c20_a_seeded_source_gives_reproducible_fresh_seeds() {
    let run = || {
        let mut g = Generator::new(c20_model(), PromptLookup::new(1, 4).unwrap())
            .with_seed_source(SeedSource::seeded(11));
        let a = g.generate(&PROMPT, &unseeded()).unwrap();
        let b = g.generate(&PROMPT, &unseeded()).unwrap();
        (a.seed, a.tokens, b.seed, b.tokens)
    };
    let (first, second) = (run(), run());
    assert_eq!(first, second);
    assert_ne!(first.0, first.2);
    // A request with a seed never draws one.
    let mut g = Generator::new(c20_model(), PromptLookup::new(1, 4).unwrap())
        .with_seed_source(SeedSource::seeded(11));
    let seeded = g.generate(&PROMPT, &unseeded().with_seed(5)).unwrap();
    assert_eq!(seeded.seed, 5);
    let next = g.generate(&PROMPT, &unseeded()).unwrap();
    assert_eq!(next.seed, first.0);
}
