#!/usr/bin/env bash
# The llama.cpp adapter (crates/speculative-llama) and the `llama` features of spec-bench and
# the `speculate` command (crates/speculate). Building llama-cpp-sys-2 compiles llama.cpp from source with cmake
# (needs cmake, a C++ compiler and libclang; about 4-8 minutes per cargo profile on 2 cores), so
# it runs apart from scripts/test.sh. Every step uses the `test` profile, so llama.cpp is
# compiled once (each profile has its own build of it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "test-llama: $tool is missing (apt-get install cmake g++ libclang-dev)" >&2; exit 1; }
done
scripts/fetch-model.sh
P=(--profile test)
cargo clippy "${P[@]}" -p speculative-llama --all-targets -- -D warnings
cargo clippy "${P[@]}" -p spec-bench -p speculate \
    --features spec-bench/llama,speculate/llama --all-targets -- -D warnings
# Contract tests, greedy identity and batch invariance on the real GGUF; the doc tests.
cargo test "${P[@]}" -p speculative-llama
# spec-bench's tests with the engine compiled in, then both engines in one run and one cost
# table on a two-request workload (the binaries exit non-zero on any failure).
cargo test "${P[@]}" -p spec-bench --features llama
bench() { cargo run "${P[@]}" -q -p spec-bench --features llama -- "$@"; }
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
sed -n '1p;6p' docs/workloads/smollm2.jsonl | sed 's/"max_tokens": [0-9]*/"max_tokens": 32/' > "$OUT/w.jsonl"
bench run --workload "$OUT/w.jsonl" --backend fast,llama --proposers prompt-lookup --k 4 \
    --reps 1 --warmup 0 --out "$OUT/run" > "$OUT/run.md"
grep -q "llama: prompt-lookup" "$OUT/run.md"
bench cost-table --backend fast,llama --batch 1 --tokens 1,2 --reps 1 --prefix 16 \
    --out "$OUT/cost.json" > "$OUT/cost.md"
test -s "$OUT/cost-llama.json" && test -s "$OUT/cost-fast.json"
# The speculate command on llama.cpp (greedy, compared with plain decoding in the same run).
cargo run "${P[@]}" -q -p speculate --features llama -- \
    --engine llama --prompt "Repeat exactly: the cat sat on the mat." --max-tokens 24 --compare \
    > "$OUT/speculate.txt"
grep -q "greedy outputs identical: yes" "$OUT/speculate.txt"
RUSTDOCFLAGS="-D warnings" cargo doc "${P[@]}" -p speculative-llama --no-deps
