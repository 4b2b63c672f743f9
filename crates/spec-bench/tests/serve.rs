//! The serving driver on a toy batch target (`PerSlot` over `ToyModel`): the closed loop keeps
//! exactly C requests in flight and completes every request, the open loop completes every
//! request, greedy outputs agree across modes and loads, and the report survives a JSON round
//! trip; conversation turns wait for their previous turn and reuse its slot's cache, a shared
//! system prompt is copied between slots, and greedy outputs are equal with prefix reuse on and
//! off (with a negative control). No timing assertions.

use spec_bench::serve::{
    Cell, Load, ServeMode, ServeReport, ServeRequest, Turn, concurrency_markdown,
    cost_table_from_steps, drive, drive_conversations, mark_mismatches, markdown, plots,
    prediction_markdown, predictions, repeat_requests, summarize,
};
use spec_bench::serve_reuse::{
    NoPrefixCopy, ReuseMode, reuse_check_line, reuse_checks, reuse_markdown, speedup_markdown,
};
use speculative::decode::{BatchConfig, BatchGenerator, BatchRequest};
use speculative::propose::PromptLookup;
use speculative::test_util::ToyModel;
use speculative::{NoProposer, PerSlot, Proposer};

/// `ToyModel::c10`: next token = (sum(prefix) * 31 + len(prefix)) mod 7, so greedy outputs
/// depend on the whole prefix.
const VOCAB: usize = 7;

fn target(slots: usize) -> PerSlot<ToyModel> {
    PerSlot::new((0..slots).map(|_| ToyModel::c10()).collect()).unwrap()
}

/// Requests of different prompt and output lengths.
fn requests(n: usize) -> Vec<ServeRequest> {
    let base: Vec<ServeRequest> = (0..5)
        .map(|i| ServeRequest {
            index: 0,
            source: i,
            kind: if i % 2 == 0 { "a".into() } else { "b".into() },
            prompt: (0..(6 + 7 * i))
                .map(|j| ((j * 5 + i) % VOCAB) as u32)
                .collect(),
            max_tokens: 3 + 4 * i,
            turn: None,
        })
        .collect();
    repeat_requests(&base, n)
}

fn make(mode: ServeMode) -> impl FnMut(&ServeRequest) -> spec_bench::Result<BatchRequest> {
    move |r: &ServeRequest| {
        let p: Box<dyn Proposer + Send> = if mode.speculative() {
            Box::new(PromptLookup::new(1, 3)?)
        } else {
            Box::new(NoProposer)
        };
        // No EOS: every request runs to its max_tokens.
        Ok(BatchRequest::new(
            r.prompt.clone(),
            mode.params(r.max_tokens, &[]),
            p,
        ))
    }
}

fn cell(mode: ServeMode, load: Load, slots: usize, reqs: &[ServeRequest]) -> Cell {
    let mut g = BatchGenerator::with_config(target(slots), BatchConfig::default()).unwrap();
    let run = drive(&mut g, reqs, &load, &mut make(mode)).unwrap();
    Cell {
        summary: summarize(mode, load, &run, None),
        run,
    }
}

#[test]
fn repeat_cycles_the_workload() {
    let r = requests(12);
    assert_eq!(r.len(), 12);
    assert!(
        r.iter()
            .enumerate()
            .all(|(i, x)| x.index == i && x.source == i % 5)
    );
    assert_eq!(r[7].prompt, r[2].prompt);
    assert!(repeat_requests(&[], 3).is_empty());
}

#[test]
fn closed_loop_keeps_exactly_c_in_flight_and_completes_every_request() {
    let reqs = requests(13);
    for c in [1, 2, 3, 4, 8] {
        let cell = cell(ServeMode::Plain, Load::Closed(c), 8, &reqs);
        let run = &cell.run;
        assert!(!run.steps.is_empty());
        for s in &run.steps {
            assert_eq!(s.in_flight, c.min(s.unfinished), "C={c}: {s:?}");
            assert!(s.sequences <= c);
        }
        // The first step sees all 13 unfinished; the count only goes down.
        assert_eq!(run.steps[0].unfinished, 13);
        assert!(
            run.steps
                .windows(2)
                .all(|w| w[1].unfinished <= w[0].unfinished)
        );
        assert_eq!(run.records.len(), 13);
        for (i, r) in run.records.iter().enumerate() {
            assert_eq!(r.index, i);
            assert_eq!(r.error, None);
            assert_eq!(r.tokens.len(), reqs[i].max_tokens, "request {i}");
            let streamed: usize = r.chunks.iter().map(|c| c.1).sum();
            assert_eq!(streamed, r.tokens.len());
            assert!(r.ttft().is_some());
        }
        assert_eq!(
            cell.summary.generated_tokens,
            reqs.iter().map(|r| r.max_tokens).sum::<usize>()
        );
    }
    // Concurrency 0 is refused.
    let mut g = BatchGenerator::with_config(target(2), BatchConfig::default()).unwrap();
    assert!(drive(&mut g, &reqs, &Load::Closed(0), &mut make(ServeMode::Plain)).is_err());
}

#[test]
fn open_loop_completes_every_request() {
    let reqs = requests(9);
    let cell = cell(
        ServeMode::Fixed(3),
        Load::Open {
            rate: 5000.0,
            seed: 3,
        },
        4,
        &reqs,
    );
    assert_eq!(cell.run.records.len(), 9);
    for (r, q) in cell.run.records.iter().zip(&reqs) {
        assert_eq!(r.error, None);
        assert_eq!(r.tokens.len(), q.max_tokens);
        assert!(r.submit_s >= r.arrival_s);
    }
    // Never more in flight than submitted-and-unfinished.
    assert!(cell.run.steps.iter().all(|s| s.in_flight <= s.unfinished));
}

#[test]
fn greedy_outputs_agree_across_modes_and_loads_and_a_changed_output_is_caught() {
    let reqs = requests(10);
    let mut cells = vec![
        cell(ServeMode::Plain, Load::Closed(1), 4, &reqs),
        cell(ServeMode::Plain, Load::Closed(4), 4, &reqs),
        cell(ServeMode::Fixed(3), Load::Closed(2), 4, &reqs),
        cell(ServeMode::Goodput(4), Load::Closed(4), 4, &reqs),
    ];
    assert_eq!(mark_mismatches(&mut cells), 0);
    // Negative control: one token changed in one request of one cell.
    let t = &mut cells[2].run.records[6].tokens[0];
    *t = (*t + 1) % VOCAB as u32;
    assert_eq!(mark_mismatches(&mut cells), 1);
    assert_eq!(cells[2].summary.mismatches, vec![6]);
}

#[test]
fn report_round_trips_through_json_and_renders() {
    let reqs = requests(8);
    let mut cells = Vec::new();
    for mode in [ServeMode::Plain, ServeMode::Fixed(2)] {
        for c in [1, 2, 4] {
            cells.push(cell(mode, Load::Closed(c), 4, &reqs));
        }
    }
    cells.push(cell(
        ServeMode::Plain,
        Load::Open {
            rate: 1000.0,
            seed: 1,
        },
        4,
        &reqs,
    ));
    let mismatches = mark_mismatches(&mut cells);
    let steps: Vec<_> = cells
        .iter()
        .flat_map(|c| c.run.steps.iter().copied())
        .collect();
    let table = cost_table_from_steps(&steps, "toy").unwrap();
    let preds = predictions(&cells, &table, &BatchConfig::default());
    // Closed-loop loads only; speculative ones carry a speed-up against plain.
    assert_eq!(preds.len(), 6);
    assert!(preds.iter().all(|p| p.predicted_tokens_per_s > 0.0));
    assert!(
        preds
            .iter()
            .filter(|p| p.mode.speculative())
            .all(|p| p.measured_speedup.is_some() && p.predicted_speedup.is_some())
    );
    let report = ServeReport {
        source: "toy".into(),
        cells: cells.iter().map(|c| c.summary.clone()).collect(),
        cost_rows: table,
        predictions: preds.clone(),
        mismatches,
        reuse_checks: vec![],
    };
    let text = serde_json::to_string(&report).unwrap();
    let back: ServeReport = serde_json::from_str(&text).unwrap();
    assert_eq!(back, report);
    let cells_text = serde_json::to_string(&cells).unwrap();
    let cells_back: Vec<Cell> = serde_json::from_str(&cells_text).unwrap();
    assert_eq!(cells_back, cells);
    let md = markdown(&report.cells);
    assert_eq!(md.lines().count(), 2 + cells.len());
    assert!(md.contains("| fixed k=2 | closed C=4 |") && md.contains("open 1000/s"));
    let cm = concurrency_markdown(&report.cells);
    assert_eq!(cm.lines().count(), 2 + 3, "{cm}");
    assert!(
        cm.contains("| 4 |") && cm.contains("fixed k=2 / plain"),
        "{cm}"
    );
    let pm = prediction_markdown(&preds);
    assert!(pm.contains("Predicted within 15% of measured"));
    let dir = std::env::temp_dir().join(format!("spec-bench-serve-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    plots(&dir, &report.cells).unwrap();
    for f in ["serve_throughput.svg", "serve_p99.svg"] {
        let svg = std::fs::read_to_string(dir.join(f)).unwrap();
        assert!(svg.contains("<svg") && svg.contains("plain"), "{f}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A 3-turn conversation per session, `sessions` sessions, interleaved in the workload order
/// of docs/workloads/agentic.jsonl (one session's turns after another's).
fn conversation(sessions: usize) -> Vec<ServeRequest> {
    let base: Vec<ServeRequest> = (0..sessions * 3)
        .map(|i| ServeRequest {
            index: 0,
            source: i,
            kind: "conv".into(),
            prompt: Vec::new(),
            max_tokens: 4 + i % 3,
            turn: Some(Turn {
                session: format!("s{}", i / 3),
                message: format!("{} {} {}", i % VOCAB, (i * 3) % VOCAB, (i + 5) % VOCAB),
            }),
        })
        .collect();
    repeat_requests(&base, base.len())
}

/// The toy's "chat template": a shared 20-token system prefix, then every earlier turn's message
/// and output, then the new message (tokens written as numbers).
fn toy_prompt(turns: &[(String, Vec<u32>)], message: &str) -> spec_bench::Result<Vec<u32>> {
    let words = |m: &str| -> Vec<u32> { m.split(' ').map(|w| w.parse().unwrap()).collect() };
    let mut p: Vec<u32> = (0..20).map(|j| (j * 3 % VOCAB) as u32).collect();
    for (m, out) in turns {
        p.extend(words(m));
        p.extend(out);
    }
    p.extend(words(message));
    Ok(p)
}

fn reuse_cell(
    mode: ServeMode,
    load: Load,
    reuse: ReuseMode,
    slots: usize,
    reqs: &[ServeRequest],
) -> Cell {
    let config = BatchConfig::default();
    let mut make = make(mode);
    let mut build = toy_prompt;
    let run = if reuse == ReuseMode::NoCopy {
        let mut g = BatchGenerator::with_config(NoPrefixCopy(target(slots)), config).unwrap();
        drive_conversations(&mut g, reqs, &load, &mut make, &mut build).unwrap()
    } else {
        let mut g = BatchGenerator::with_config(target(slots), config)
            .unwrap()
            .with_prefix_reuse(reuse.reuse());
        drive_conversations(&mut g, reqs, &load, &mut make, &mut build).unwrap()
    };
    let mut summary = summarize(mode, load, &run, None);
    summary.reuse = reuse;
    Cell { summary, run }
}

#[test]
fn a_turn_waits_for_its_previous_turn_and_lands_in_its_slot_cache() {
    let reqs = conversation(3);
    for load in [
        Load::Closed(3),
        Load::Open {
            rate: 5000.0,
            seed: 2,
        },
    ] {
        let c = reuse_cell(ServeMode::Fixed(2), load, ReuseMode::On, 3, &reqs);
        let rs = &c.run.records;
        for (i, r) in rs.iter().enumerate() {
            assert_eq!(r.error, None, "{load:?} request {i}");
            assert_eq!(r.prompt_reused + r.prompt_prefilled, r.prompt_tokens);
            if i % 3 == 0 {
                assert_eq!(r.prompt_tokens, 23, "a first turn: system + message");
                continue;
            }
            let prev = &rs[i - 1];
            // Submitted after the previous turn ended, its prompt the conversation so far.
            assert!(r.submit_s >= prev.end_s, "{load:?} request {i}");
            assert_eq!(r.prompt_tokens, prev.prompt_tokens + prev.tokens.len() + 3);
            // The slot kept the previous prompt and its output but the last token.
            assert!(
                r.prompt_reused >= prev.prompt_tokens + prev.tokens.len() - 1,
                "{load:?} request {i}: {} reused",
                r.prompt_reused
            );
        }
    }
    // `drive` has no prompt builder: every turn is recorded with that error.
    let mut g = BatchGenerator::with_config(target(2), BatchConfig::default()).unwrap();
    let run = drive(&mut g, &reqs, &Load::Closed(1), &mut make(ServeMode::Plain)).unwrap();
    assert!(run.records.iter().all(|r| {
        r.error
            .as_deref()
            .is_some_and(|e| e.contains("prompt builder"))
    }));
}

#[test]
fn greedy_outputs_equal_with_reuse_on_and_off_and_a_changed_output_is_caught() {
    let reqs = conversation(2);
    let mut cells = Vec::new();
    for reuse in [ReuseMode::Off, ReuseMode::NoCopy, ReuseMode::On] {
        for mode in [ServeMode::Plain, ServeMode::Fixed(3)] {
            cells.push(reuse_cell(mode, Load::Closed(2), reuse, 2, &reqs));
        }
    }
    assert_eq!(mark_mismatches(&mut cells), 0);
    let checks = reuse_checks(&cells);
    // Two reuse-on modes x two modes, each against its reuse-off twin.
    assert_eq!(checks.len(), 4);
    assert!(checks.iter().all(|c| c.compared == 6 && c.identical == 6));
    assert!(reuse_check_line(&checks).contains("24 of 24 requests identical (identical)"));
    let off = &cells[0].summary;
    let on = &cells[4].summary;
    assert_eq!(off.prompt_reused, 0);
    assert!(on.prompt_reused > 0 && on.prompt_prefilled < off.prompt_prefilled);
    // Negative control: one changed token in a reuse-on cell.
    let t = &mut cells[5].run.records[4].tokens[0];
    *t = (*t + 1) % VOCAB as u32;
    let checks = reuse_checks(&cells);
    assert!(reuse_check_line(&checks).contains("23 of 24 requests identical (DIFFERENT)"));
}

#[test]
fn a_shared_system_prompt_is_copied_between_slots_at_concurrency_8() {
    // 16 stand-alone requests with one 40-token system prefix and their own 3-token question.
    let system: Vec<u32> = (0..40).map(|j| ((j * 5 + 1) % VOCAB) as u32).collect();
    let base: Vec<ServeRequest> = (0..16)
        .map(|i| ServeRequest {
            index: 0,
            source: i,
            kind: "chat".into(),
            prompt: system
                .iter()
                .copied()
                .chain([(i % VOCAB) as u32, (i / VOCAB) as u32, 3])
                .collect(),
            max_tokens: 5,
            turn: None,
        })
        .collect();
    let reqs = repeat_requests(&base, 16);
    let run = |reuse| reuse_cell(ServeMode::Plain, Load::Closed(8), reuse, 8, &reqs);
    let (off, no_copy, on) = (
        run(ReuseMode::Off),
        run(ReuseMode::NoCopy),
        run(ReuseMode::On),
    );
    // Off: every request prefills its 42 prompt rows (the last token goes with decoding).
    assert_eq!(off.summary.prefill_rows, 16 * 42);
    assert_eq!(off.summary.prefix_copies, 0);
    // No copy: the second wave reuses the system prompt its slot's first request left.
    assert_eq!(no_copy.summary.prefix_copies, 0);
    // (the question's first token may match the slot's earlier question too).
    let rows = no_copy.summary.prefill_rows;
    assert!((8 * 42 + 8..=8 * 42 + 8 * 2).contains(&rows), "{rows}");
    // Copy: the first request prefills the system prompt; the 7 others of the first wave
    // wait for that prefill and copy it, the second wave keeps it: it is prefilled once.
    assert!(on.summary.prefix_copies >= 7, "{:?}", on.summary);
    let rows = on.summary.prefill_rows;
    assert!((42 + 15..=42 + 15 * 2).contains(&rows), "{rows}");
    let mut cells = vec![off, no_copy, on];
    assert_eq!(mark_mismatches(&mut cells), 0);
    let md = reuse_markdown(&cells.iter().map(|c| c.summary.clone()).collect::<Vec<_>>());
    assert_eq!(md.lines().count(), 2 + 3);
    assert!(
        md.contains("| reuse on, no copy | plain | closed C=8 |"),
        "{md}"
    );
    let sm = speedup_markdown(&cells.iter().map(|c| c.summary.clone()).collect::<Vec<_>>());
    assert!(
        sm.contains("| closed C=8 | reuse on |") && sm.contains("x |"),
        "{sm}"
    );
}
