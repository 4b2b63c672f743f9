//! Proposers against the loop's contract: case C13 (heads see the real last token), drafts that
//! end at EOS (the proposer side of case C11), names, and stale state across requests.

use std::sync::Arc;

use speculative::decode::{DraftLength, FinishReason, GenerationParams, Generator, StopConditions};
use speculative::propose::{
    DraftModelProposer, HeadsProposer, PromptLookup, RecyclingConfig, SuffixConfig, SuffixProposer,
    TokenRecycling,
};
use speculative::test_util::{HeadsConditioning, OneHotHidden, ToyHeads, ToyModel};
use speculative::{Draft, NoProposer, ProposeRequest, Proposer, Result, SamplingConfig};

/// Records every draft of the wrapped proposer.
struct Recorder<P> {
    inner: P,
    drafts: Vec<Vec<u32>>,
}

impl<P: Proposer> Proposer for Recorder<P> {
    fn propose(&mut self, req: &ProposeRequest<'_>, draft: &mut Draft) -> Result<()> {
        self.inner.propose(req, draft)?;
        self.drafts.push(draft.tokens.clone());
        Ok(())
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> Result<()> {
        self.inner.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.inner.begin(prompt)
    }
    fn finish(&mut self, sequence: &[u32]) {
        self.inner.finish(sequence)
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

/// The target of case C13: next(t) = (3t + 1) mod 8.
fn c13_next(t: u32) -> u32 {
    (3 * t + 1) % 8
}

fn c13_target() -> OneHotHidden<ToyModel> {
    OneHotHidden::new(ToyModel::deterministic(8, 4096, |p: &[u32]| {
        c13_next(p[p.len() - 1])
    }))
}

/// `(hidden, last_token, position)` as recorded by [`ToyHeads`].
type HeadsCall = (Vec<f32>, u32, usize);

/// Runs case C13's generation and returns (tokens, first draft, proposed, accepted, first
/// heads input).
fn c13_run(
    prompt: &[u32],
    conditioning: HeadsConditioning,
) -> (Vec<u32>, Vec<u32>, usize, usize, HeadsCall) {
    let heads = HeadsProposer::new(ToyHeads::new(8, 3, conditioning, c13_next));
    let mut g = Generator::new(
        c13_target(),
        Recorder {
            inner: heads,
            drafts: Vec::new(),
        },
    );
    let params = GenerationParams::greedy(40).with_draft(DraftLength::Fixed(3));
    let out = g.generate(prompt, &params).unwrap();
    let rec = g.proposer();
    (
        out.tokens,
        rec.drafts[0].clone(),
        out.metrics.proposed,
        out.metrics.accepted,
        rec.inner.heads().inputs[0].clone(),
    )
}

#[test]
fn c13_heads_see_the_real_last_token() {
    let chain = |mut t: u32| -> Vec<u32> {
        (0..40)
            .map(|_| {
                t = c13_next(t);
                t
            })
            .collect()
    };
    let one_hot_5: Vec<f32> = (0..8).map(|v| if v == 5 { 1.0 } else { 0.0 }).collect();

    // Prompt [5, 2]: 2 is not the model's own prediction after 5 (that is 0).
    let (tokens, first, proposed, accepted, input) = c13_run(&[5, 2], HeadsConditioning::LastToken);
    assert_eq!(tokens, chain(2));
    assert_eq!(first, [7, 6, 3], "continues from the real last token 2");
    // The heads got the hidden state of the row that predicted 2 (input 5), the token 2 and
    // the position of the first draft.
    assert_eq!(input, (one_hot_5.clone(), 2, 2));
    assert_eq!(proposed, 30);
    assert_eq!(accepted, proposed, "every draft is accepted");

    // Prompt [5, 0]: the last token is the model's own prediction; the same acceptance.
    let (tokens, first, proposed, accepted, input) = c13_run(&[5, 0], HeadsConditioning::LastToken);
    assert_eq!(tokens, chain(0));
    assert_eq!(first, [1, 4, 5]);
    assert_eq!(input, (one_hot_5, 0, 2));
    assert_eq!((proposed, accepted), (30, 30));

    // Negative control: heads that ignore the last token continue from the model's guess
    // after 5 on prompt [5, 2] and lose the first block (the fault of case C13).
    let (tokens, first, proposed, accepted, _) = c13_run(&[5, 2], HeadsConditioning::HiddenOnly);
    assert_eq!(tokens, chain(2), "the output is right either way");
    assert_eq!(first, [1, 4, 5]);
    assert!(accepted < proposed, "{accepted} of {proposed}");
}

/// Case C11's caller mask: after prompt [0, 0], only 1, then 2, then 3 (the EOS) are allowed,
/// and nothing at all once 3 has been generated.
fn c11_config(temperature: f32) -> SamplingConfig {
    let mask = |prefix: &[u32], logits: &mut [f32]| {
        let generated = &prefix[2.min(prefix.len())..];
        let allowed = if generated.contains(&3) {
            None
        } else {
            Some(generated.len() as u32 + 1)
        };
        for (t, x) in logits.iter_mut().enumerate() {
            if Some(t as u32) != allowed {
                *x = f32::NEG_INFINITY;
            }
        }
    };
    SamplingConfig::builder()
        .temperature(temperature)
        .mask(Arc::new(mask))
        .build()
        .unwrap()
}

/// A draft model whose greedy continuation after [0, 0] is [1, 2, 3, 1, 2, ...].
fn c11_draft_model() -> ToyModel {
    ToyModel::deterministic(8, 4096, |p: &[u32]| {
        (p.len() as u32).saturating_sub(2) % 3 + 1
    })
}

#[test]
fn c11_draft_model_drafts_up_to_eos_and_stops_there() {
    let ctx = [0u32, 0];
    for temperature in [0.0, 1.0] {
        let cfg = c11_config(temperature);
        let mut req = ProposeRequest::new(&ctx, &cfg, 5).prompt_len(2);
        // Negative control: without the EOS the proposer feeds the end token and asks the
        // mask about the row after it (which allows nothing: the draft then just ends).
        let mut p = DraftModelProposer::new(c11_draft_model());
        let mut d = Draft::default();
        p.propose(&req, &mut d).unwrap();
        assert_eq!(d.tokens, [1, 2, 3], "temperature {temperature}");
        assert_eq!(p.model().tokens(), &[0, 0, 1, 2, 3]);

        req.eos = &[3];
        let mut p = DraftModelProposer::new(c11_draft_model());
        let mut d = Draft::default();
        p.propose(&req, &mut d).unwrap();
        assert_eq!(d.tokens, [1, 2, 3], "temperature {temperature}");
        if temperature > 0.0 {
            // q rows only for the three drafts, each a point mass under the mask.
            let q = d.q.as_ref().unwrap();
            assert_eq!((q.len(), d.q_vocab), (3 * 8, 8));
            for (row, &t) in d.tokens.iter().enumerate() {
                assert_eq!(q[row * 8 + t as usize], 1.0);
            }
        } else {
            assert!(d.q.is_none());
        }
        // The draft model fed the context and the two drafts before the EOS, nothing after.
        assert_eq!(p.model().tokens(), &[0, 0, 1, 2]);
    }
}

/// The same through the loop: the draft is cut at its EOS and no target row after it is
/// processed (the loop's C11 fix, a chain whose final draft ends, `DraftBlock::with_ends`).
#[test]
fn c11_draft_model_in_the_loop_ends_at_eos() {
    let target = ToyModel::deterministic(8, 4096, |p: &[u32]| {
        (p.len() as u32).saturating_sub(2) % 3 + 1
    });
    let mut g = Generator::new(target, DraftModelProposer::new(c11_draft_model()));
    let params = GenerationParams::greedy(20)
        .to_builder()
        .sampling(c11_config(0.0))
        .stop(StopConditions::eos(3))
        .draft(DraftLength::Fixed(5))
        .build()
        .unwrap();
    let out = g.generate(&[0, 0], &params).unwrap();
    assert_eq!(out.tokens, [1, 2, 3]);
    assert_eq!(out.finish, FinishReason::Eos);
}

/// The shipped proposers, fresh, each with the same small corpus where it has one.
fn shipped() -> Vec<Box<dyn Proposer>> {
    let mut suffix = SuffixProposer::new(SuffixConfig::default()).unwrap();
    suffix.add_to_corpus(&[1, 2, 3, 4, 5, 6]);
    // A warm table (model knowledge, kept across requests by design): the same in every copy.
    let mut recycling = TokenRecycling::new(7, RecyclingConfig::default()).unwrap();
    for t in 0..7u32 {
        recycling.set_successors(t, &[(t * 3 + 1) % 7, (t + 6) % 7]);
    }
    vec![
        Box::new(PromptLookup::new(1, 3).unwrap()),
        Box::new(suffix),
        Box::new(DraftModelProposer::new(ToyModel::c10())),
        Box::new(HeadsProposer::new(ToyHeads::new(
            7,
            3,
            HeadsConditioning::LastToken,
            |t| (t * 2 + 1) % 7,
        ))),
        Box::new(recycling),
        Box::new(NoProposer),
    ]
}

#[test]
fn shipped_proposers_have_short_names() {
    let names: Vec<&str> = shipped().iter().map(|p| p.name()).collect();
    assert_eq!(
        names,
        [
            "prompt-lookup",
            "suffix",
            "draft-model",
            "heads",
            "recycling",
            "none"
        ]
    );
    // Forwarded through references too.
    let mut p = PromptLookup::new(1, 2).unwrap();
    let r: &mut dyn Proposer = &mut p;
    assert_eq!(r.name(), "prompt-lookup");
}

/// `steps` proposals on growing prefixes of `seq` (starting at `start` tokens), returning the
/// drafts.
fn drive(p: &mut dyn Proposer, seq: &[u32], start: usize, cfg: &SamplingConfig) -> Vec<Draft> {
    let hidden: Vec<f32> = (0..7).map(|v| if v == 1 { 1.0 } else { 0.0 }).collect();
    (start..=seq.len())
        .map(|n| {
            let req = ProposeRequest::new(&seq[..n], cfg, 4)
                .seed(9)
                .target_hidden(Some(&hidden))
                .eos(&[6]);
            let mut d = Draft::default();
            p.propose(&req, &mut d).unwrap();
            d
        })
        .collect()
}

#[test]
fn stale_state_every_shipped_proposer_serves_request_b_as_a_fresh_one() {
    // Request A, then B used directly (no begin): B has A's length at its first call and A's
    // tokens at the ends and at every power-of-two distance from the end, and differs only in
    // positions 100..160. Then a B that shrinks below A.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let a: Vec<u32> = (0..320)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 6) as u32
        })
        .collect();
    let mut b = a.clone();
    for (i, t) in b.iter_mut().enumerate().take(160).skip(100) {
        *t = (*t + 1 + (i as u32 % 4)) % 6;
    }
    for cfg in [
        SamplingConfig::greedy(),
        SamplingConfig::builder().temperature(0.8).build().unwrap(),
    ] {
        for (i, mut p) in shipped().into_iter().enumerate() {
            drive(&mut *p, &a[..300], 250, &cfg);
            let got = drive(&mut *p, &b, 300, &cfg);
            let mut fresh = shipped().swap_remove(i);
            assert_eq!(got, drive(&mut *fresh, &b, 300, &cfg), "{}", p.name());
            let got = drive(&mut *p, &b[..120], 110, &cfg);
            let mut fresh = shipped().swap_remove(i);
            assert_eq!(
                got,
                drive(&mut *fresh, &b[..120], 110, &cfg),
                "{}",
                p.name()
            );
            // No draft holds a token after an EOS.
            for d in &got {
                if let Some(j) = d.tokens.iter().position(|&t| t == 6) {
                    assert_eq!(j + 1, d.tokens.len(), "{}", p.name());
                }
            }
        }
    }
}
