//! Soak test (issue 16): 10,000 greedy generations through ONE [`Generator`] whose
//! [`SuffixProposer`] keeps a shared corpus of earlier generations (default [`SuffixConfig`]:
//! 65,536 corpus tokens, depth 24), over a toy Markov target with seeded, varied prompts.
//!
//! It checks that memory stays within the bound documented on [`SuffixProposer`] ("Memory bound
//! and eviction") once the corpus has been filled and evicted many times over, that the
//! structural bounds hold (corpus tokens, corpus trie nodes), and that sampled generations still
//! equal plain greedy decoding. It prints peak RSS, corpus size and throughput.
//!
//! Ignored by default (about a minute in release mode); run it with `scripts/soak.sh`, or
//! `cargo test --release --test soak -- --ignored --nocapture`. `SOAK_GENERATIONS=N` changes the
//! number of generations (the check that RSS stops growing needs at least 6,000). Linux only for the RSS figures
//! (`VmHWM` / `VmRSS` in `/proc/self/status`); elsewhere they are skipped with a message.

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use speculative::NoProposer;
use speculative::decode::{GenerationParams, Generator};
use speculative::propose::{SuffixConfig, SuffixProposer};
use speculative::test_util::ToyModel;

const GENERATIONS: usize = 10_000;
/// Each generation asks for a seeded number of new tokens in this range (greedy, no EOS, so it
/// generates exactly that many). Long enough that the corpus trie approaches its node bound
/// (a generation of `n` tokens adds up to `n * max_depth - max_depth * (max_depth - 1) / 2`
/// nodes).
const NEW_TOKENS: std::ops::RangeInclusive<usize> = 32..=256;
const VOCAB: usize = 256;
/// Markov order of the toy target: greedy text is a pseudo-random walk on `VOCAB^ORDER` states,
/// so unrelated prompts give nearly distinct texts (the corpus trie's worst case).
const ORDER: usize = 4;
/// Prompts that end with one of these tails continue the same way (the target reads only the
/// last `ORDER` tokens), so the corpus has something to draft from.
const HOT_TAILS: usize = 16;
/// Bytes per node of the corpus bound at the peak, documented on `SuffixProposer` ("Memory
/// bound and eviction": "105 bytes per node of the bound at the peak", about 160 MiB for the
/// default bound of `1 + 65,536 * 24` nodes). Where it comes from, at the node bound `N`:
/// - the node vector grows by doubling: at most `2^21 * 24` B = 48 MiB;
/// - the edge map (`HashMap<u64, u32>`, 17 B per bucket) keeps at most 7/8 of its power-of-two
///   buckets full, and under the corpus's steady insert/evict churn it grows once the live
///   entries exceed half of that (its deleted-entry markers use up the spare room; it rehashes
///   in place only below half): `2^22` buckets = 68 MiB for `N`, plus the old `2^21`-bucket
///   table (34 MiB) while it grows;
/// - the free list keeps 4 B per freed node (at most 8 MiB).
///
/// That is about 158 MiB at the peak (and 110 MiB after it).
const DOC_BYTES_PER_NODE: usize = 105;
/// Peak RSS may grow by at most this multiple of the documented bound: a small allowance for
/// the allocator, the request trie and the generator's buffers.
const RSS_FACTOR_OVER_DOC: f64 = 1.1;
/// After the corpus is full and its node vector and edge map have reached their final capacity
/// (by generation 3,000 here), peak RSS must not keep growing: at most this much from then to
/// the end (a leak of 1 byte per generated token would exceed it).
const MAX_STEADY_GROWTH_KIB: u64 = 4 * 1024;
/// The generation after which peak RSS must stay flat; checked when the run is at least twice
/// as long.
const STEADY_FROM: usize = 3000;

/// A `kB` field of `/proc/self/status` (`VmHWM`, `VmRSS`), or `None` off Linux.
fn status_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Resets `VmHWM` to the current RSS (Linux 4.0+; ignored where not permitted).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn prompt(rng: &mut StdRng, tails: &[Vec<u32>]) -> Vec<u32> {
    let len = rng.random_range(8..=48);
    let mut p: Vec<u32> = (0..len)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect();
    if rng.random_bool(0.1) {
        p.extend_from_slice(&tails[rng.random_range(0..tails.len())]);
    }
    p
}

#[test]
#[ignore = "soak: about a minute in release mode; run scripts/soak.sh"]
fn ten_thousand_generations_one_generator_shared_suffix_corpus() {
    let generations = std::env::var("SOAK_GENERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(GENERATIONS);
    let target = ToyModel::markov(VOCAB, ORDER, 3.0, 0x50A4);
    let cfg = SuffixConfig::default();
    let node_bound = 1 + cfg.max_corpus_tokens * cfg.max_depth;
    let byte_bound = node_bound * DOC_BYTES_PER_NODE;
    let mut generator = Generator::new(target.clone(), SuffixProposer::new(cfg.clone()).unwrap());
    let mut plain = Generator::new(target, NoProposer);

    let mut rng = StdRng::seed_from_u64(16);
    let tails: Vec<Vec<u32>> = (0..HOT_TAILS)
        .map(|_| {
            (0..ORDER + 2)
                .map(|_| rng.random_range(0..VOCAB as u32))
                .collect()
        })
        .collect();

    reset_peak_rss();
    let rss_before = status_kib("VmRSS");
    let steady_at = STEADY_FROM;
    let mut peak_at_steady = None;
    let (mut proposed, mut accepted, mut emitted, mut max_nodes) = (0, 0, 0, 0);
    let start = Instant::now();
    println!(
        "{:>6} {:>9} {:>9} {:>13} {:>13} {:>9} {:>9}",
        "gen", "VmHWM MiB", "VmRSS MiB", "corpus tokens", "corpus nodes", "corpus gens", "accept"
    );
    for i in 1..=generations {
        let p = prompt(&mut rng, &tails);
        let params = GenerationParams::greedy(rng.random_range(NEW_TOKENS));
        let out = generator.generate(&p, &params).unwrap();
        assert_eq!(out.tokens.len(), params.max_new_tokens(), "generation {i}");
        proposed += out.metrics.proposed;
        accepted += out.metrics.accepted;
        emitted += out.tokens.len();

        let s = generator.proposer();
        let (_, corpus_nodes) = s.node_counts();
        max_nodes = max_nodes.max(corpus_nodes);
        assert!(s.corpus_tokens() <= cfg.max_corpus_tokens, "generation {i}");
        assert!(
            corpus_nodes <= node_bound,
            "generation {i}: {corpus_nodes} nodes"
        );
        if i % 1000 == 0 {
            // The shared state has not corrupted the output: equal to plain greedy decoding.
            let reference = plain.generate(&p, &params).unwrap();
            assert_eq!(out.tokens, reference.tokens, "generation {i}");
        }
        if i == steady_at {
            peak_at_steady = status_kib("VmHWM");
        }
        if i % 1000 == 0 || i == generations {
            let mib =
                |k: Option<u64>| k.map_or("-".into(), |k| format!("{:.1}", k as f64 / 1024.0));
            println!(
                "{i:>6} {:>9} {:>9} {:>13} {:>13} {:>9} {:>9.3}",
                mib(status_kib("VmHWM")),
                mib(status_kib("VmRSS")),
                s.corpus_tokens(),
                corpus_nodes,
                s.corpus_generations(),
                accepted as f64 / proposed.max(1) as f64,
            );
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let s = generator.proposer();
    let peak = status_kib("VmHWM");
    let rss_end = status_kib("VmRSS");
    println!(
        "soak: {generations} generations of {NEW_TOKENS:?} new tokens ({emitted} in all), one \
         Generator, SuffixConfig::default()"
    );
    println!(
        "soak: {secs:.1} s, {:.0} generations/s, {:.0} tokens/s",
        generations as f64 / secs,
        emitted as f64 / secs
    );
    println!(
        "soak: corpus {} tokens in {} generations, {} trie nodes (max {max_nodes}; bound {node_bound})",
        s.corpus_tokens(),
        s.corpus_generations(),
        s.node_counts().1
    );
    println!(
        "soak: acceptance {:.3} ({accepted} / {proposed} drafts)",
        accepted as f64 / proposed.max(1) as f64
    );
    // Once more was generated than the corpus holds, it stays nearly full: whole generations,
    // the oldest evicted, so less than one generation short of the bound.
    if emitted > cfg.max_corpus_tokens {
        assert!(s.corpus_tokens() > cfg.max_corpus_tokens - NEW_TOKENS.end());
    }
    assert!(accepted > 0, "the corpus never produced an accepted draft");

    let (Some(before), Some(peak)) = (rss_before, peak) else {
        println!("soak: no /proc/self/status here; RSS not checked");
        return;
    };
    let growth = peak.saturating_sub(before);
    let allowed = (byte_bound as f64 * RSS_FACTOR_OVER_DOC / 1024.0) as u64;
    println!(
        "soak: RSS before {:.1} MiB, at the end {:.1} MiB, peak {:.1} MiB (growth {:.1} MiB); \
         documented corpus bound {node_bound} nodes x {DOC_BYTES_PER_NODE} B = {:.1} MiB, \
         allowed growth {:.1} MiB",
        before as f64 / 1024.0,
        rss_end.unwrap_or(0) as f64 / 1024.0,
        peak as f64 / 1024.0,
        growth as f64 / 1024.0,
        byte_bound as f64 / 1048576.0,
        allowed as f64 / 1024.0,
    );
    println!(
        "soak: per corpus trie node (max {max_nodes}): {:.0} B at the peak, {:.0} B at the end",
        growth as f64 * 1024.0 / max_nodes as f64,
        rss_end.unwrap_or(0).saturating_sub(before) as f64 * 1024.0 / s.node_counts().1 as f64,
    );
    assert!(
        growth <= allowed,
        "peak RSS grew by {growth} KiB, more than {RSS_FACTOR_OVER_DOC} x the documented bound \
         ({allowed} KiB)"
    );
    if generations >= 2 * STEADY_FROM {
        let steady = peak_at_steady.expect("VmHWM was readable before");
        println!(
            "soak: peak RSS at generation {steady_at}: {:.1} MiB; growth since: {} KiB",
            steady as f64 / 1024.0,
            peak.saturating_sub(steady)
        );
        assert!(
            peak.saturating_sub(steady) <= MAX_STEADY_GROWTH_KIB,
            "peak RSS kept growing after the corpus was full: {steady} KiB at generation \
             {steady_at}, {peak} KiB at the end"
        );
    }
}
