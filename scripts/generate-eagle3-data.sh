#!/usr/bin/env bash
# Self-distilled EAGLE-3 training data (issue 29): writes our 12,000 conversations
# (scripts/make-eagle3-conversations.py) and has the target answer them through the batch loop
# (`train_draft_head generate-tokens`, speculative_candle::distil). Resumable: run it again on
# the same DIR and it continues where it stopped, writing the files an uninterrupted run writes
# (tests/distil.rs). Runs at the lowest CPU priority so it yields to builds and benchmarks.
#
# Usage: scripts/generate-eagle3-data.sh DIR        (DIR: the data folder; keep it out of git)
# Progress: DIR/gen.log; the job's pid: DIR/gen.pid. Needs about 4 hours of a quiet 2-core
# machine for 2,000,000 answer tokens (crates/speculative-candle/heads/README.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:?usage: scripts/generate-eagle3-data.sh DIR}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
cd "$ROOT"
scripts/fetch-model.sh
[[ -f "$DIR/conversations.jsonl" ]] || python3 scripts/make-eagle3-conversations.py "$DIR/conversations.jsonl"
cargo build --release -p speculative-candle --example train_draft_head
BIN="$ROOT/target/release/examples/train_draft_head"
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
cd "$DIR"
RAYON_NUM_THREADS=2 nohup nice -n 19 "$BIN" --model "$MODEL" generate-tokens \
    --conversations conversations.jsonl --out tokens --max-tokens 256 --seed 29 \
    --shard-conversations 500 --slots 32 --threads 2 --lookup --progress-secs 300 \
    >> gen.log 2>&1 &
echo $! > gen.pid
echo "generating into $DIR/tokens (pid $(cat gen.pid), log $DIR/gen.log)"
