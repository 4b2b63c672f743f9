#!/usr/bin/env bash
# Regenerates the end-to-end figures of docs/benchmarks.md section 5 and the CPU cost table and
# simulation of docs/simulator.md. Takes about 20 minutes on a 2-core machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
scripts/fetch-model.sh >&2
cargo build --release -q -p spec-bench
BIN=target/release/spec-bench
OUT="${OUT:-docs/results}"
# Greedy: model-free proposers at fixed k and adaptive, every workload kind.
$BIN run --workload docs/workloads/smollm2.jsonl --proposers prompt-lookup,suffix \
    --k 2,4,8,adaptive --reps 2 --warmup 1 --out "$OUT/greedy"
# Token trees (issue 11): trees of 16 nodes (depth k) next to chains of k = 4, 8, 16 and adaptive.
$BIN run --workload docs/workloads/smollm2.jsonl --proposers prompt-lookup,suffix \
    --k 4,8,16,adaptive --tree-nodes 0,16 --reps 2 --warmup 1 --out "$OUT/tree"
# Issue 12: warm a token-recycling table on 200 generic prompts (about 3 minutes), then token
# recycling and the merged tree (prompt lookup + suffix + recycling) beside the best chain, with
# the cost-aware tree policy (adaptive, node budget 16); a fixed large tree (64 nodes); and the
# agentic workload with proposers carried across requests.
$BIN warm-recycling --workload docs/workloads/warmup.jsonl --out "$OUT/recycling-table.bin"
MERGED=merged:prompt-lookup+suffix+recycling
$BIN run --workload docs/workloads/smollm2.jsonl --proposers suffix,recycling,$MERGED \
    --k adaptive --tree-nodes 0,16 --reps 2 --warmup 1 --recycling-table "$OUT/recycling-table.bin" \
    --out "$OUT/issue12"
$BIN run --workload docs/workloads/smollm2.jsonl --proposers $MERGED --k 8 --tree-nodes 64 \
    --reps 1 --warmup 1 --recycling-table "$OUT/recycling-table.bin" --out "$OUT/issue12-fixed64"
$BIN run --workload docs/workloads/agentic.jsonl --carry --proposers suffix,$MERGED \
    --k adaptive:16 --tree-nodes 0,16 --reps 2 --warmup 0 \
    --recycling-table "$OUT/recycling-table.bin" --out "$OUT/agentic"
$BIN replay --workload docs/workloads/smollm2.jsonl --runs "$OUT/issue12/runs.json" \
    --cost docs/cost-tables/cpu-smollm2-fast-q8.json --proposers prompt-lookup,suffix --k 8 \
    --nodes 8,16 --out "$OUT/issue12-replay"
# Sampling (temperature 0.7, top-p 0.9) with the adaptive policy, every workload kind.
$BIN run --workload docs/workloads/smollm2.jsonl --proposers prompt-lookup,suffix \
    --k adaptive --temperature 0.7 --top-p 0.9 --seeds 1 --reps 2 --warmup 1 --out "$OUT/sampled"
# Self-speculative draft: the first 16 of 30 layers as a draft model (LayerSkip-style early exit).
$BIN run --workload docs/workloads/smollm2.jsonl --proposers early-exit:16 \
    --k 2,adaptive:4 --reps 1 --warmup 1 --out "$OUT/early-exit"
# Cost table of this machine and the simulator replaying the greedy runs' prompt-lookup steps.
$BIN cost-table --tokens 1,2,3,5,9,17 --reps 21 --out docs/cost-tables/cpu-smollm2-fast-q8.json
$BIN simulate --cost docs/cost-tables/cpu-smollm2-fast-q8.json --runs "$OUT/greedy/runs.json" \
    --label "prompt-lookup k=8" --out "$OUT/sim-cpu"
# Replay of the greedy outputs through the proposers, and the copy-oracle bound (no model).
$BIN replay --workload docs/workloads/smollm2.jsonl --runs "$OUT/greedy/runs.json" \
    --cost docs/cost-tables/cpu-smollm2-fast-q8.json --k 2,4,8 --out "$OUT/replay"
# The same outputs through the tree drafts (node budgets 8-64) next to chains of the same budget,
# on this machine's cost curve and on the illustrative GPU roofline table (flat c(n)).
$BIN replay --workload docs/workloads/smollm2.jsonl --runs "$OUT/greedy/runs.json" \
    --cost docs/cost-tables/cpu-smollm2-fast-q8.json --k 4,8 --nodes 8,16,32,64 --out "$OUT/replay-tree"
$BIN replay --workload docs/workloads/smollm2.jsonl --runs "$OUT/greedy/runs.json" \
    --cost docs/cost-tables/gpu-roofline-8b.json --k 4,8 --nodes 8,16,32,64 --out "$OUT/replay-tree-gpu"
# The trained EAGLE draft head (issue 19): cost against a target step, then greedy and sampled runs.
cargo bench -p speculative-candle --bench draft_head
$BIN run --workload docs/workloads/smollm2.jsonl \
    --proposers draft-head,merged:draft-head+prompt-lookup+suffix,merged:prompt-lookup+suffix,suffix \
    --k adaptive --tree-nodes 0,16 --reps 1 --warmup 1 --out "$OUT/issue19"
$BIN run --workload docs/workloads/chat.jsonl \
    --proposers draft-head,merged:draft-head+prompt-lookup+suffix,merged:prompt-lookup+suffix \
    --k adaptive --tree-nodes 0,16 --reps 1 --warmup 1 --out "$OUT/issue19-chat"
$BIN run --workload docs/workloads/chat.jsonl --proposers draft-head,merged:prompt-lookup+suffix \
    --k adaptive --tree-nodes 0,16 --temperature 0.7 --top-p 0.9 --seeds 1,2 --reps 1 --warmup 1 \
    --out "$OUT/issue19-sampled"
