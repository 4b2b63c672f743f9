#!/usr/bin/env bash
# GPU check of the `cuda` (and `wgpu`) backends, in one script that finishes in under 8 minutes.
#
# On a machine with cargo:   scripts/gpu-check.sh            (builds with --features cuda,wgpu)
# For a GPU machine without a Rust toolchain (the `run` tool's H200 image lists CUDA 13, nvcc
# and PyTorch but no cargo, and cannot reach crates.io): build the two x86-64 binaries here first,
#   scripts/gpu-check.sh --prepare        # writes .gpu-bin/ (git-ignored through .git/info/exclude)
# then in one `run` call with carry [".gpu-bin"] and timeout_s 540:
#   scripts/gpu-check.sh
#
# What it verifies (results, logs and the bench table under $OUT, or target/gpu-check):
# 1. the CUDA tests of tests/gpu.rs with SPECULATIVE_REQUIRE_CUDA=1 and SPECULATIVE_REQUIRE_NVRTC=1,
#    so they cannot skip: the kernel compiles with the machine's NVRTC and loads; random batches
#    (vocab up to 49,152, ragged k, mixed configurations) give the CPU's tokens on >= 99.9% of the
#    sequences and log-probabilities within 1e-4; the CPU's errors; the chi-square distribution
#    test and its negative control;
# 2. the wgpu tests on whatever Vulkan driver the machine has (they skip without one);
# 3. benches/gpu.rs on CUDA (SPECULATIVE_BENCH_BACKENDS=cuda,wgpu adds wgpu): verify / read-once for
#    batch 1, 16, 64, 256, k = 4, 8, vocab 49,152 and 151,936, greedy and top-p.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="$ROOT/.gpu-bin"
FEATURES="cuda,wgpu"

if [[ "${1:-}" == "--prepare" ]]; then
    set -e
    grep -qx '/.gpu-bin/' .git/info/exclude 2>/dev/null || echo '/.gpu-bin/' >> .git/info/exclude
    mkdir -p "$BIN"
    exe() { python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1"; }
    t=$(cargo test -p speculative --features "$FEATURES" --test gpu --no-run --message-format=json | exe gpu)
    b=$(cargo bench -p speculative --features "$FEATURES" --bench gpu --no-run --message-format=json | exe gpu)
    cp "$t" "$BIN/gpu-tests"
    cp "$b" "$BIN/gpu-bench"
    strip "$BIN"/gpu-* 2>/dev/null || true
    ls -la "$BIN"
    echo "now: run(command='scripts/gpu-check.sh', carry=['.gpu-bin'], timeout_s=540)"
    exit 0
fi

OUT="${OUT:-$ROOT/target/gpu-check}"
mkdir -p "$OUT"
export CARGO_TERM_COLOR=never
START=$(date +%s)
note() { echo "== [$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/summary.txt"; }

# libcuda comes with the driver; NVRTC from the toolkit or from the nvidia-cuda-nvrtc wheel.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, c, "lib") for p in nvidia.__path__ for c in ("cu13", "cuda_nvrtc")))' 2>/dev/null); do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then
        export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        note "NVRTC from $d"
        break
    fi
done
(nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv) \
    > "$OUT/nvidia-smi.txt" 2>&1 || true
cat "$OUT/nvidia-smi.txt"

if command -v cargo >/dev/null 2>&1; then
    note "building with cargo (--features $FEATURES)"
    TESTS=(cargo test -p speculative --features "$FEATURES" --test gpu --)
    BENCH=(cargo bench -p speculative --features "$FEATURES" --bench gpu --)
else
    [[ -x "$BIN/gpu-tests" && -x "$BIN/gpu-bench" ]] || {
        echo "no cargo and no prebuilt binaries: run scripts/gpu-check.sh --prepare and carry .gpu-bin"
        exit 2
    }
    note "using the prebuilt binaries in .gpu-bin"
    TESTS=("$BIN/gpu-tests")
    BENCH=("$BIN/gpu-bench" --bench)
fi

status=0
note "CUDA tests (cannot skip)"
SPECULATIVE_REQUIRE_CUDA=1 SPECULATIVE_REQUIRE_NVRTC=1 timeout 240 "${TESTS[@]}" \
    --nocapture --test-threads 1 cuda 2>&1 | tee "$OUT/test-cuda.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || { status=1; note "CUDA tests FAILED"; }
note "wgpu tests (skip without a Vulkan driver)"
timeout 120 "${TESTS[@]}" --nocapture --test-threads 1 wgpu 2>&1 | tee "$OUT/test-wgpu.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || { status=1; note "wgpu tests FAILED"; }
note "GPU bench"
# CUDA only by default (the full grid of both backends may not fit the time budget).
OUT="$OUT" SPECULATIVE_BENCH_BACKENDS="${SPECULATIVE_BENCH_BACKENDS:-cuda}" timeout 300 \
    "${BENCH[@]}" 2>&1 | tee "$OUT/bench.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || { status=1; note "bench FAILED or timed out"; }
note "done, status $status (results in $OUT)"
exit $status
