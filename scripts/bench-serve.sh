#!/usr/bin/env bash
# Regenerates the serving figures of docs/benchmarks.md "Many sequences at once (issue 13)" and
# the "past a batch of 8" answer of docs/simulator.md: `spec-bench serve` on SmolLM2-135M, fast
# Q8 backend, 1 thread. Plain batched decoding, speculative with fixed k = 4 and the goodput
# policy (k <= 8) run in the same process over the same requests; closed loop at concurrency
# 1, 2, 4, 8, 16 and an open loop of Poisson arrivals. Each invocation also writes the measured
# cost table c(rows), the simulator's predicted throughput per concurrency against the measured
# one (serve.md, "Simulated against measured") and a 2-D cost table for `spec-bench simulate`.
# Takes about 30-40 minutes on a 2-core machine; run it on an otherwise idle machine (the
# simulator comparison is only as good as the forward times are steady).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
scripts/fetch-model.sh >&2
cargo build --release -q -p spec-bench
BIN="${CARGO_TARGET_DIR:-target}/release/spec-bench"
OUT="${OUT:-docs/results}"
REQUESTS="${REQUESTS:-32}"
COMMON=(--threads 1 --proposer merged:prompt-lookup+suffix --modes plain,fixed:4,goodput:8
    --concurrency 1,2,4,8,16 --requests "$REQUESTS" --max-tokens 128 --seed 0 --prefix-reuse on)
# The rewrite + code-edit mix (speculation should pay: outputs copy the prompt).
$BIN serve --workload docs/workloads/smollm2.jsonl --kinds rewrite,code-edit "${COMMON[@]}" \
    --rate 1,4 --out "$OUT/serve-rewrite-code"
# Chat (little to copy: the goodput policy must back off to plain decoding).
$BIN serve --workload docs/workloads/chat.jsonl "${COMMON[@]}" --rate 1,4 --out "$OUT/serve-chat"
# The simulator's batch grid from the rewrite + code-edit run's measured cost table, at that
# run's acceptance as an i.i.d. rate: the a with (1 - a^5) / (1 - a) = the fixed k = 4 mean
# accepted length of serve.md (2.11 on 2026-12-01: a = 0.55; its raw acceptance rate, 0.41,
# ignores that accepted copies come in runs).
$BIN simulate --cost "$OUT/serve-rewrite-code/cost-table.json" --acceptance "${ACCEPTANCE:-0.55}" \
    --out "$OUT/serve-rewrite-code/sim"
