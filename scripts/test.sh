#!/usr/bin/env bash
# Runs every test of the workspace: fetches the real model first (idempotent), then the unit,
# integration, property, statistical and doc tests of `speculative` and `speculative-candle`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# candle is fastest single-threaded on small CPUs (see crates/speculative-candle/README.md).
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
scripts/fetch-model.sh
# Unit, integration, property and statistical tests, examples built, doc tests run.
cargo test --workspace
