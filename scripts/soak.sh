#!/usr/bin/env bash
# Soak test (issue 16): 10,000 greedy generations through one `Generator` with a shared
# `SuffixProposer` corpus (default config) over a toy Markov target, in release mode. Prints a
# table every 1,000 generations (peak and current RSS, corpus tokens / trie nodes / generations,
# acceptance), then the totals: time, generations/s, tokens/s, peak RSS against the documented
# bound. Fails when peak RSS exceeds the allowance in tests/soak.rs or keeps growing once the
# corpus is full.
#
# Usage: scripts/soak.sh                      (10,000 generations, about a minute)
#        SOAK_GENERATIONS=2000 scripts/soak.sh (a shorter run)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
echo "soak: $(uname -srm), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')"
# --test-threads=1: the test reads the whole process's RSS.
cargo test --release -p speculative --test soak -- --ignored --nocapture --test-threads=1
