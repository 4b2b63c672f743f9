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
# tests/examples.rs calls each example of examples/ in process and checks its key lines, and
# runs the example binaries this command built (exit status 0, same output).
# (crates/speculative-llama builds llama.cpp with cmake: scripts/test-llama.sh tests it.)
cargo test --workspace --exclude speculative-llama

# Every example of the core crate, run as a user runs it (`cargo run --example NAME`); each
# asserts what it prints and exits non-zero when a check fails. The `test` profile reuses the
# build above instead of compiling the crate again without optimisation.
for example in examples/*.rs; do
    name="$(basename "$example" .rs)"
    echo "example $name"
    cargo run --quiet -p speculative --profile test --example "$name" >/dev/null
done

# GPU backends: lints of the `wgpu` and `cuda` builds (cudarc loads CUDA at run time, so the
# `cuda` build needs no CUDA here), then tests/gpu.rs: the wgpu backend on any Vulkan / Metal /
# DX12 adapter (Mesa's software Vulkan driver lavapipe in CI), compared with the CPU verifier.
# Without an adapter the tests print why and skip, unless SPECULATIVE_REQUIRE_WGPU=1 (set by
# .ci/run).
cargo clippy -p speculative --all-targets --features wgpu -- -D warnings
cargo clippy -p speculative --all-targets --features cuda -- -D warnings
cargo test -p speculative --features wgpu --lib --test gpu

# The `serde` feature (configs from HF / vLLM JSON): lints, the unit tests, tests/serde_config.rs,
# and the doc tests that use it (the `config` module's and the README's).
cargo clippy -p speculative --all-targets --features serde -- -D warnings
cargo test -p speculative --features serde --lib --test serde_config
cargo test -p speculative --features serde --doc -- config ReadmeDoctests
scripts/check-package.sh  # published files of each crate against scripts/package-allowlist-*.txt
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --exclude speculative-llama --no-deps  # docs build without a warning (broken links included)
# The conformance kit (`conformance` feature; tests/conformance.rs ran above, in `cargo test`,
# which turns the feature on through the dev-dependency): its lints and docs as a user builds it.
cargo clippy -p speculative --all-targets --features conformance,test-util -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc -p speculative --features conformance --no-deps
