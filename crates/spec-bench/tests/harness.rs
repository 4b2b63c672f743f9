//! The harness on a toy target: figures are consistent, outputs are written, the simulator
//! reproduces the closed form.

use spec_bench::matrix::{Matrix, PreparedRequest, run_matrix};
use spec_bench::report::{aggregate, markdown, sim_markdown, sim_plot, standard_plots, write_json};
use spec_bench::run::{ConfigSpec, DraftSpec, RunRecord, inter_token_latencies};
use spec_bench::sim::{AcceptanceModel, CostTable, simulate};
use speculative::Proposer;
use speculative::propose::{PromptLookup, SuffixConfig, SuffixProposer};
use speculative::test_util::ToyModel;

fn factory(name: &str) -> spec_bench::Result<Box<dyn Proposer>> {
    Ok(match name {
        "prompt-lookup" => Box::new(PromptLookup::new(1, 3)?),
        "suffix" => Box::new(SuffixProposer::new(SuffixConfig::default())?),
        other => panic!("unknown proposer {other}"),
    })
}

fn records() -> Vec<RunRecord> {
    let mut target = ToyModel::markov(16, 1, 3.0, 4).with_tree(16);
    let requests: Vec<PreparedRequest> = (0..3)
        .map(|i| PreparedRequest {
            kind: if i == 0 { "code".into() } else { "chat".into() },
            prompt: (0..40).map(|j| ((j * 5 + i) % 16) as u32).collect(),
            max_tokens: 24,
            turn: None,
            grammar: None,
        })
        .collect();
    let mut configs = Vec::new();
    for p in ["prompt-lookup", "suffix"] {
        for d in [
            DraftSpec::Fixed(2),
            DraftSpec::Fixed(4),
            DraftSpec::Adaptive(6),
        ] {
            configs.push(ConfigSpec {
                proposer: p.into(),
                draft: d,
                temperature: 0.0,
                top_p: 1.0,
                seed: 0,
                tree_nodes: 0,
                tree_branch: 0,
            });
        }
        // A tree of 8 nodes of depth 4, at most 2 children per node, beside the chains.
        configs.push(ConfigSpec {
            proposer: p.into(),
            draft: DraftSpec::Fixed(4),
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            tree_nodes: 8,
            tree_branch: 2,
        });
    }
    configs.push(ConfigSpec {
        proposer: "prompt-lookup".into(),
        draft: DraftSpec::Fixed(3),
        temperature: 0.8,
        top_p: 0.9,
        seed: 1,
        tree_nodes: 0,
        tree_branch: 0,
    });
    let matrix = Matrix {
        configs,
        warmup: 1,
        reps: 2,
        carry: false,
        carry_costs: false,
        forced_drafts: false,
        prefix_reuse: Vec::new(),
        fused_prefill: true,
    };
    let mut n = 0;
    let out = run_matrix(
        None,
        &mut target,
        &mut factory,
        &requests,
        &[],
        &matrix,
        &mut |_, _| unreachable!("no conversation turns"),
        &mut |_| n += 1,
    )
    .unwrap();
    assert_eq!(
        out.len(),
        3 * 2 * (9 + 2),
        "9 speculative configs + 2 baselines per request and rep"
    );
    assert!(n >= out.len());
    out
}

#[test]
fn figures_are_consistent() {
    let recs = records();
    for r in &recs {
        let emitted: usize = r.steps.iter().map(|s| s.emitted).sum();
        assert_eq!(emitted, r.tokens.len(), "emitted tokens = sum of steps");
        assert_eq!(r.tokens.len(), 24);
        assert_eq!(r.itl_s.len(), r.tokens.len() - 1);
        // The ITLs sum to the last chunk's arrival minus the first's (`itl_from_arrivals`),
        // which the end of the run follows on the same clock: at most the decode time, by any
        // margin (no bound on the gap, which a loaded machine can stretch).
        let itl_sum: f64 = r.itl_s.iter().sum();
        assert!(
            (0.0..=r.e2e_s - r.ttft_s + 1e-9).contains(&itl_sum),
            "ITL sum {itl_sum} vs decode time {}",
            r.e2e_s - r.ttft_s
        );
        assert!(r.ttft_s <= r.e2e_s);
        let proposed: usize = r.steps.iter().map(|s| s.k).sum();
        let accepted: usize = r.steps.iter().map(|s| s.accepted).sum();
        if proposed > 0 {
            assert!((r.acceptance_rate - accepted as f64 / proposed as f64).abs() < 1e-12);
        }
        assert!(
            (r.mean_accepted_length - r.tokens.len() as f64 / r.steps.len() as f64).abs() < 1e-12
        );
        if let Some(c) = &r.config {
            assert!(r.speedup.is_some());
            if c.temperature == 0.0 {
                assert_eq!(r.greedy_identical, Some(true), "{}", r.label);
            }
        }
    }
    let aggs = aggregate(&recs);
    let md = markdown(&aggs);
    assert!(md.contains("| code | plain |"));
    assert!(md.contains("prompt-lookup k=4 t=0 p=1 s=0"));
    let dir = std::env::temp_dir().join(format!("spec-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    standard_plots(&dir, &recs, &aggs).unwrap();
    for f in [
        "acceptance_by_position.svg",
        "speedup_vs_k.svg",
        "itl_cdf.svg",
    ] {
        let s = std::fs::read_to_string(dir.join(f)).unwrap();
        assert!(s.starts_with("<svg") && s.contains("polyline"), "{f}");
    }
    write_json(&dir.join("runs.json"), &recs).unwrap();
    let back: Vec<RunRecord> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("runs.json")).unwrap()).unwrap();
    assert_eq!(back, recs);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn itl_from_arrivals() {
    let itl = inter_token_latencies(&[(0.5, 3), (0.7, 1), (1.0, 2)]);
    assert_eq!(itl.len(), 5);
    assert!((itl.iter().sum::<f64>() - 0.5).abs() < 1e-12);
    assert_eq!(itl[0], 0.0);
}

#[test]
fn simulator_reproduces_closed_form_and_replays_traces() {
    let table = CostTable::from_json(
        r#"{"source": "flat", "batch": [1, 256], "tokens": [1, 9], "cost": [[1, 1], [1, 1]]}"#,
    )
    .unwrap();
    for a in [0.2, 0.5, 0.8] {
        let r = simulate(&table, &AcceptanceModel::Constant(a), &[1, 8, 256], 8);
        for c in &r.grid {
            let want = (1.0 - f64::powi(a, c.k as i32 + 1)) / (1.0 - a);
            assert!((c.speedup - want).abs() < 1e-12);
        }
    }
    // A long synthetic trace with i.i.d. acceptance a approaches the closed form.
    let a: f64 = 0.6;
    let mut s = 1u64;
    let steps: Vec<spec_bench::run::StepRecord> = (0..200_000)
        .map(|i| {
            let mut acc = 0;
            while acc < 8 {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                if ((s >> 11) as f64 / (1u64 << 53) as f64) < a {
                    acc += 1
                } else {
                    break;
                }
            }
            spec_bench::run::StepRecord {
                position: i,
                k: 8,
                accepted: acc,
                emitted: acc + 1,
                tree_depth: None,
            }
        })
        .collect();
    let m = AcceptanceModel::Trace(steps);
    for k in 0..=8 {
        let want = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
        assert!((m.expected_tokens(k) - want).abs() < 0.02, "k={k}");
    }
    let r = simulate(&table, &m, &[1, 2], 8);
    assert!(sim_markdown(&r).contains("| 1 |"));
    let p = std::env::temp_dir().join(format!("sim-{}.svg", std::process::id()));
    sim_plot(&p, &r).unwrap();
    std::fs::remove_file(p).ok();
}

/// Tokens of a test message: its bytes modulo the toy vocabulary.
fn toks(s: &str) -> Vec<u32> {
    s.bytes().map(|b| (b % 16) as u32).collect()
}

#[test]
fn conversations_resubmit_their_own_outputs_and_carry_keeps_the_suffix_corpus() {
    let mut target = ToyModel::markov(16, 1, 3.0, 4).with_tree(16);
    // Two identical stand-alone requests, then a conversation of two turns.
    let plain = |p: &str| PreparedRequest {
        kind: "rewrite".into(),
        prompt: toks(p),
        max_tokens: 20,
        turn: None,
        grammar: None,
    };
    let turn = |m: &str| PreparedRequest {
        kind: "agentic".into(),
        prompt: Vec::new(),
        max_tokens: 20,
        turn: Some(spec_bench::matrix::Turn {
            session: "s".into(),
            message: m.into(),
        }),
        grammar: None,
    };
    let requests = vec![
        plain("the same prompt, twice over"),
        plain("the same prompt, twice over"),
        turn("first turn of the talk"),
        turn("and the second turn"),
    ];
    let configs = vec![ConfigSpec {
        proposer: "suffix".into(),
        draft: DraftSpec::Fixed(4),
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        tree_nodes: 0,
        tree_branch: 0,
    }];
    let mut built: Vec<(usize, Vec<u32>)> = Vec::new();
    let mut run = |carry: bool, built: &mut Vec<(usize, Vec<u32>)>| {
        let mut build = |turns: &[(String, Vec<u32>)], msg: &str| {
            let mut p = Vec::new();
            for (u, reply) in turns {
                p.extend(toks(u));
                p.extend_from_slice(reply);
            }
            p.extend(toks(msg));
            built.push((turns.len(), p.clone()));
            Ok(p)
        };
        run_matrix(
            None,
            &mut target,
            &mut factory,
            &requests,
            &[],
            &Matrix {
                configs: configs.clone(),
                warmup: 0,
                reps: 1,
                carry,
                carry_costs: carry,
                forced_drafts: false,
                prefix_reuse: Vec::new(),
                fused_prefill: true,
            },
            &mut build,
            &mut |_| {},
        )
        .unwrap()
    };
    let fresh = run(false, &mut built);
    let carried = run(true, &mut built);
    for recs in [&fresh, &carried] {
        assert_eq!(recs.len(), 4 * 2);
        for r in recs.iter().filter(|r| r.config.is_some()) {
            assert_eq!(r.greedy_identical, Some(true));
            assert!(r.decode_speedup.is_some() && r.speedup.is_some());
        }
        // The second turn's prompt holds the first turn's message and output.
        let t1 = recs
            .iter()
            .find(|r| r.request == 2 && r.config.is_none())
            .unwrap();
        let t2 = recs
            .iter()
            .find(|r| r.request == 3 && r.config.is_none())
            .unwrap();
        assert_eq!(
            t2.prompt_tokens,
            t1.prompt_tokens + t1.tokens.len() + toks("and the second turn").len()
        );
    }
    // Every lane (baseline and configuration) built its own second turn from one earlier turn.
    assert_eq!(built.iter().filter(|(n, _)| *n == 1).count(), 2 * 2);
    // With carry, the repeated request is drafted from the first one's output in the corpus.
    let acc = |recs: &[RunRecord]| {
        recs.iter()
            .find(|r| r.request == 1 && r.config.is_some())
            .unwrap()
            .mean_accepted_length
    };
    assert!(
        acc(&carried) > acc(&fresh) + 1.0,
        "carried {} vs fresh {}",
        acc(&carried),
        acc(&fresh)
    );
}

#[test]
fn constrained_requests_follow_their_grammar_in_every_run() {
    use speculative_guidance::{Grammar, Vocabulary};
    // Tokens 0..15 are the letters `a`..`o`, 15 is EOS; grammar `(ab|c)+`.
    let bytes: Vec<Vec<u8>> = (0u8..16)
        .map(|i| {
            if i == 15 {
                b"<eos>".to_vec()
            } else {
                vec![b'a' + i]
            }
        })
        .collect();
    let special = (0..16).map(|i| i == 15).collect();
    let vocab = Vocabulary::greedy(bytes, special, 15).unwrap();
    let mut target = ToyModel::markov(16, 1, 3.0, 4).with_tree(16);
    let requests: Vec<PreparedRequest> = (0..2)
        .map(|i| PreparedRequest {
            kind: "structured".into(),
            prompt: (0..20).map(|j| ((j * 3 + i) % 15) as u32).collect(),
            max_tokens: 16,
            turn: None,
            grammar: Some(Grammar::Regex("(ab|c)+".into())),
        })
        .collect();
    let configs: Vec<ConfigSpec> = [(0, 0.0), (8, 0.0), (0, 0.8)]
        .into_iter()
        .map(|(tree_nodes, temperature)| ConfigSpec {
            proposer: "prompt-lookup".into(),
            draft: DraftSpec::Fixed(4),
            temperature,
            top_p: 1.0,
            seed: 0,
            tree_nodes,
            tree_branch: 0,
        })
        .collect();
    let out = run_matrix(
        Some(&vocab),
        &mut target,
        &mut factory,
        &requests,
        &[15],
        &Matrix {
            configs,
            warmup: 0,
            reps: 1,
            carry: false,
            carry_costs: false,
            forced_drafts: true,
            prefix_reuse: Vec::new(),
            fused_prefill: true,
        },
        &mut |_, _| unreachable!("no conversation turns"),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(out.len(), 2 * (3 + 2));
    for r in &out {
        // `(ab|c)+`: a is always followed by b, b always follows a; EOS only at the end.
        let t = &r.tokens;
        for (i, &x) in t.iter().enumerate() {
            assert!(
                x <= 2 || (x == 15 && i + 1 == t.len()),
                "{}: {t:?}",
                r.label
            );
            if x == 0 && i + 1 < t.len() {
                assert_eq!(t[i + 1], 1, "{}: {t:?}", r.label);
            }
            if x == 1 {
                assert!(i > 0 && t[i - 1] == 0, "{}: {t:?}", r.label);
            }
        }
        if r.greedy_identical.is_some() {
            assert_eq!(r.greedy_identical, Some(true), "{}", r.label);
        }
    }
}

/// Wraps a merge and logs the member count of every `start_from_learned` it is given.
struct CostSpy {
    inner: speculative::MergedProposer,
    log: std::sync::Arc<std::sync::Mutex<Vec<Option<usize>>>>,
}

impl Proposer for CostSpy {
    fn propose(
        &mut self,
        req: &speculative::ProposeRequest<'_>,
        draft: &mut speculative::Draft,
    ) -> speculative::Result<()> {
        self.inner.propose(req, draft)
    }
    fn observe(&mut self, accepted: usize, emitted: &[u32]) -> speculative::Result<()> {
        self.inner.observe(accepted, emitted)
    }
    fn begin(&mut self, prompt: &[u32]) -> speculative::Result<()> {
        self.inner.begin(prompt)
    }
    fn learned(&self) -> Option<speculative::propose::Learned> {
        self.inner.learned()
    }
    fn start_from_learned(
        &mut self,
        costs: &speculative::propose::Learned,
    ) -> speculative::Result<()> {
        self.log.lock().unwrap().push(costs.members());
        self.inner.start_from_learned(costs)
    }
}

#[test]
fn carried_costs_start_every_later_proposer_from_the_merges_learned() {
    let mut target = ToyModel::markov(16, 1, 3.0, 4);
    let requests: Vec<PreparedRequest> = (0..2)
        .map(|i| PreparedRequest {
            kind: "chat".into(),
            prompt: (0..30).map(|j| ((j * 3 + i) % 16) as u32).collect(),
            max_tokens: 12,
            turn: None,
            grammar: None,
        })
        .collect();
    let configs = vec![ConfigSpec {
        proposer: "merged".into(),
        draft: DraftSpec::Fixed(3),
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        tree_nodes: 0,
        tree_branch: 0,
    }];
    let mut run = |carry_costs: bool| {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut f = |_: &str| -> spec_bench::Result<Box<dyn Proposer>> {
            let members: Vec<Box<dyn Proposer + Send>> = vec![
                Box::new(PromptLookup::new(1, 3)?),
                Box::new(SuffixProposer::new(SuffixConfig::default())?),
            ];
            Ok(Box::new(CostSpy {
                inner: speculative::MergedProposer::new(members)?,
                log: log.clone(),
            }))
        };
        let matrix = Matrix {
            configs: configs.clone(),
            warmup: 1,
            reps: 2,
            carry: false,
            carry_costs,
            forced_drafts: false,
            prefix_reuse: Vec::new(),
            fused_prefill: true,
        };
        let out = run_matrix(
            None,
            &mut target,
            &mut f,
            &requests,
            &[],
            &matrix,
            &mut |_, _| unreachable!("no conversation turns"),
            &mut |_| {},
        )
        .unwrap();
        assert!(out.iter().all(|r| r.greedy_identical != Some(false)));
        log.lock().unwrap().clone()
    };
    // One warm-up run, then 2 requests x 2 repetitions, each with a fresh proposer: every one
    // after the warm-up's starts from the merge's costs (2 members).
    assert_eq!(run(true), vec![Some(2); 4]);
    // Negative control: without carried costs no proposer is started from any.
    assert!(run(false).is_empty());
}
