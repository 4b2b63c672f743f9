#!/usr/bin/env bash
# Runs the NEON kernel tests of speculative-candle (`KernelPath::Neon`, `KernelPath::NeonDotprod`)
# for aarch64 under qemu-user emulation on an x86-64 host. Not part of CI or `scripts/test.sh`:
# a release cross build of candle plus the emulated tests takes several minutes.
#
# Needs the aarch64 Rust std (`rustup target add aarch64-unknown-linux-gnu`), the cross linker
# and qemu-user (Debian/Ubuntu: `apt-get install gcc-aarch64-linux-gnu qemu-user`).
#
# Usage: scripts/test-aarch64.sh   (CARGO_TARGET_DIR defaults to target/aarch64)
#
# It runs, with CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc:
#   1. under `qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu` (FEAT_DotProd present):
#        cargo test --release --target aarch64-unknown-linux-gnu -p speculative-candle \
#          --lib fast -- --nocapture
#        cargo test --release --target aarch64-unknown-linux-gnu -p speculative-candle \
#          --test fast -- --skip real_model --nocapture
#      i.e. the `fast` unit tests (every kernel path against the scalar one bit for bit, the
#      activation quantiser, ops) and every test of tests/fast.rs that needs no model file
#      (kernels, random-weight models on every path and thread count); the real-model tests
#      (`real_model_*`, `speculative_greedy_equals_plain_greedy_on_real_model`) are skipped.
#      It checks that `KernelPath::available()` is [Scalar, Neon, NeonDotprod].
#   2. under `-cpu cortex-a53` (Armv8.0, no dot product): the q8 unit tests again, checking
#      that `KernelPath::available()` is [Scalar, Neon] and Neon matches Scalar bit for bit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TARGET=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu
for tool in aarch64-linux-gnu-gcc qemu-aarch64; do
    command -v "$tool" >/dev/null || {
        echo "missing $tool: apt-get install gcc-aarch64-linux-gnu qemu-user" >&2
        exit 1
    }
done
rustup target list --installed | grep -qx "$TARGET" || {
    echo "missing the $TARGET std: rustup target add $TARGET" >&2
    exit 1
}

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/aarch64}"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
mkdir -p "$CARGO_TARGET_DIR"

run() { # run QEMU-CPU LOG-FILE CARGO-TEST-ARGUMENTS...
    local cpu=$1 log=$2
    shift 2
    echo "== qemu-aarch64 -cpu $cpu: cargo test $*" | tee -a "$log"
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu -L $SYSROOT" \
        cargo test --release --target "$TARGET" -p speculative-candle "$@" 2>&1 | tee -a "$log"
}

# 1. A CPU with the dot product: both NEON paths.
MAX_LOG="$CARGO_TARGET_DIR/test-aarch64-cpu-max.log"
: >"$MAX_LOG"
run max "$MAX_LOG" --lib fast -- --nocapture
run max "$MAX_LOG" --test fast -- --skip real_model --nocapture
grep -q 'kernel paths on this CPU: \[Scalar, Neon, NeonDotprod\]' "$MAX_LOG" || {
    echo "FAIL: under -cpu max KernelPath::available() is not [Scalar, Neon, NeonDotprod]" >&2
    exit 1
}

# 2. A CPU without it: the baseline NEON path only.
A53_LOG="$CARGO_TARGET_DIR/test-aarch64-cpu-a53.log"
: >"$A53_LOG"
run cortex-a53 "$A53_LOG" --lib fast::q8 -- --nocapture
grep -q 'kernel paths on this CPU: \[Scalar, Neon\] ' "$A53_LOG" || {
    echo "FAIL: under -cpu cortex-a53 KernelPath::available() is not [Scalar, Neon]" >&2
    exit 1
}

echo "== aarch64 NEON tests passed under qemu-user (logs: $MAX_LOG, $A53_LOG)"
grep -h -e 'kernel paths on this CPU' -e '^test result' "$MAX_LOG" "$A53_LOG"
