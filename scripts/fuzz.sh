#!/usr/bin/env bash
# Long fuzzing campaign: runs the properties of tests/fuzz.rs (every public entry point of the
# core crate: verifier single and batch, row processing, TokenDist, the configuration builder,
# the top-k / top-p / min-p helpers, the random stream, every proposer), tests/fuzz_loop.rs
# (the decoding loop with rogue proposers and poisoned targets) and tests/text_reference.rs (the
# whole text path against its brute-force reference, alone and batched) with many cases each,
# prints the number of cases tried, and exits non-zero when a property fails.
#
# Usage: scripts/fuzz.sh [TEST-NAME-FILTER]
#   FUZZ_CASES          cases per property (default 100000; `cargo test` alone runs 256)
#   PROPTEST_RNG_SEED   fixes proptest's generator to reproduce a run (random by default)
# A failure prints the property's name and its minimal (shrunk) input.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export FUZZ_CASES="${FUZZ_CASES:-100000}"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"

log="$(mktemp)"
trap 'rm -f "$log"' EXIT

start=$(date +%s)
status=0
cargo test -p speculative --test fuzz -- --nocapture "$@" 2>&1 | tee "$log" || status=$?
# The loop property runs exactly FUZZ_CASES cases when it passes (it rejects no input).
if cargo test -p speculative --test fuzz_loop -- "$@" 2>&1 | tee -a "$log" | grep -q '^test result: ok. 1 passed'; then
  echo "fuzz loop: ${FUZZ_CASES} cases" | tee -a "$log"
elif grep -q 'the_loop_never_panics' "$log"; then
  echo "fuzz loop: ${FUZZ_CASES} cases (FAILED)" | tee -a "$log"
  status=1
fi
# The text reference property prints its own "fuzz text_reference: <n> cases" line.
text_property=the_loop_matches_the_text_reference
if [ $# -eq 0 ] || [[ "$text_property" == *"$1"* ]]; then
  cargo test -p speculative --test text_reference -- --exact "$text_property" --nocapture 2>&1 \
    | tee -a "$log" || status=$?
fi
elapsed=$(( $(date +%s) - start ))

# Each property prints "fuzz <name>: <n> cases" (passed) or "fuzz <name>: <n> cases (FAILED)".
lines="$(grep -Eo 'fuzz [a-z_]+: [0-9]+ cases( \(FAILED\))?' "$log" || true)"
total=$(printf '%s\n' "$lines" | awk 'NF >= 3 { s += $3 } END { print s + 0 }')
passed=$(printf '%s\n' "$lines" | grep -c ' cases$' || true)
failed=$(printf '%s\n' "$lines" | grep -c '(FAILED)$' || true)
echo
echo "fuzz.sh: ${total} cases tried in all (FUZZ_CASES=${FUZZ_CASES} per property):" \
  "${passed} properties passed, ${failed} failed, ${elapsed} s"
if [ "$status" -eq 0 ] && [ "$passed" -eq 0 ]; then
  echo "fuzz.sh: no property ran" >&2
  exit 1
fi
exit "$status"
