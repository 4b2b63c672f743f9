#!/usr/bin/env bash
# Self-distils the EAGLE draft head shipped in crates/speculative-candle/heads/ for the bundled
# SmolLM2-135M-Instruct (speculative_candle::train documents the recipe). Deterministic: the
# prompts, the answers (seeded) and the training (seed 19) are the same on every run, and the
# thread count does not change a bit of the data.
#
#   scripts/train-draft-head.sh [WORKDIR]      (default WORKDIR: target/draft-head)
#
# Environment: PROMPTS (default 1600), MAX_TOKENS (160), STEPS (see below), THREADS (2).
# Measured on the 2-core machine: see crates/speculative-candle/heads/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-target/draft-head}
PROMPTS=${PROMPTS:-1600}
MAX_TOKENS=${MAX_TOKENS:-160}
STEPS=${STEPS:-900}
THREADS=${THREADS:-2}
SEED=${SEED:-19}
HEADS=crates/speculative-candle/heads
OUT=${OUT:-$HEADS/smollm2-135m-instruct-eagle.safetensors}
mkdir -p "$WORK"
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || scripts/fetch-model.sh

cargo build --release -p speculative-candle --example train_draft_head
BIN=target/release/examples/train_draft_head
start=$(date +%s)

# 1. Prompts of our own writing (1600 written; the first $PROMPTS answered).
python3 scripts/make-train-prompts.py "$WORK/prompts.jsonl" 1600

# 2. The target answers them (greedy, greedy, T=0.7, T=1.0 in turn; top-p 0.95) and its final
#    hidden states are recorded.
"$BIN" generate --prompts "$WORK/prompts.jsonl" --limit "$PROMPTS" --max-tokens "$MAX_TOKENS" \
  --threads "$THREADS" --out "$WORK/data.bin"

# 3. Training (candle's CPU matmuls on $THREADS threads; glibc keeps freed tensors instead of
#    unmapping them, which halves the time spent in page faults).
RAYON_NUM_THREADS=$THREADS CANDLE_NUM_THREADS=$THREADS \
MALLOC_MMAP_THRESHOLD_=17179869184 MALLOC_TRIM_THRESHOLD_=17179869184 \
  "$BIN" train --data "$WORK/data.bin" --steps "$STEPS" --seed "$SEED" \
  --out "$OUT" --log "${OUT%.safetensors}.json"

sha256sum "$OUT" | awk '{print $1}' > "$OUT.sha256"
echo "total $(( $(date +%s) - start )) s; wrote $OUT ($(stat -c %s "$OUT") bytes), $OUT.sha256"
