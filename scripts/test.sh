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

# The default build (no feature at all: the tests above turn on the dev-dependency features
# `test-util`, `half`, `conformance` and `serde`), as a user's `cargo add speculative` builds it.
cargo check -p speculative --lib

# GPU backends: lints of the `wgpu` and `cuda` builds, each alone (the library) and together with
# every test, bench and example (cudarc loads CUDA at run time, so the `cuda` build needs no CUDA
# here), then tests/gpu.rs: the wgpu backend on any Vulkan / Metal / DX12 adapter (Mesa's software
# Vulkan driver lavapipe in CI), compared with the CPU verifier. Without an adapter the tests print
# why and skip, unless SPECULATIVE_REQUIRE_WGPU=1 (set by .ci/run).
cargo clippy -p speculative --lib --features wgpu -- -D warnings
cargo clippy -p speculative --lib --features cuda -- -D warnings
cargo clippy -p speculative --all-targets --features wgpu,cuda -- -D warnings
cargo test -p speculative --features wgpu --lib --test gpu

# The `serde` feature (configs from HF / vLLM JSON) and the `conformance` kit are dev-dependency
# features of the core crate, so `cargo test` above ran tests/serde_config.rs, tests/conformance.rs,
# their unit tests and their doc tests (the `config` module's and the README's), and .ci/run's
# clippy linted them. The library alone with `serde`:
cargo clippy -p speculative --lib --features serde -- -D warnings
scripts/check-package.sh  # published files of each crate against scripts/package-allowlist-*.txt
# Docs build without a warning (broken links included), the optional modules included.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --exclude speculative-llama --no-deps \
    --features speculative/conformance,speculative/serde
