"""Trainer of an EAGLE-3 draft head for SmolLM2-135M-Instruct in JAX (issue 29).

Modules: `stio` (safetensors files read as memory maps, written with metadata), `gguf` (the
target's GGUF metadata and the few tensor types SmolLM2 uses), `data` (feature-dump files, the
FR-Spec subset, packed batches, a synthetic dump), `model` (the head and its training-time-test
forward), `trainer` (optimiser, checkpoints, evaluation, export, the CI loss check). The command
line is `scripts/train-eagle3-head.py`; the model and the data format are specified in
crates/speculative-candle/heads/README.md and `speculative_candle::fast::head`.
"""
