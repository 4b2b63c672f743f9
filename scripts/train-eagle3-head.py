#!/usr/bin/env python3
"""Trains an EAGLE-3 draft head (Li et al. 2025) for SmolLM2-135M-Instruct in JAX on the CPU,
from the feature dump of `train_draft_head dump-features` (issue 29), and exports it in the
`speculative-eagle3-head-v1` safetensors format that `speculative_candle::fast::head` loads.

The head: fc3 `[h, 3h]` fuses the target's Residual(2), Residual(15), Residual(27) states (or
the `k` layers named by the dump's `feature_layers`: fc3 `[h, k h]`), fc
`[h, 2h]` fuses that with the token embedding, one decoder layer of the target's shape (GQA 9/3
heads of 64, MLP 1536, the target's RoPE theta and RMSNorm eps), a final RMSNorm and the target's
output rows of the FR-Spec subset. Loss: cross-entropy against the target's distribution over
the subset (its full softmax restricted and renormalised), answer rows only, over a training-time
test of `--ttt` unrolled drafting steps weighted `--decay`^(t-1). Details in scripts/eagle3/ and
crates/speculative-candle/heads/README.md.

Usage (run under `nice -n 19`; `--threads` pins XLA to that many cores):
  train-eagle3-head.py --synthetic DIR                       # write a synthetic dump
  train-eagle3-head.py --data DIR --out HEAD.safetensors [--ckpt-dir CK] [--log LOG.jsonl]
                       [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --init-layer 29]
  train-eagle3-head.py --ci-check [--record]                 # CI loss check (a few seconds)
  train-eagle3-head.py --bench-step 5                        # seconds per step, random data
"""
import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CI_JSON = os.path.join(HERE, "..", "crates", "speculative-candle", "heads", "ci-losses-eagle3.json")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--data", help="feature-dump directory (features-*.safetensors, lm_head.safetensors)")
    a("--out", help="head file to export (safetensors, f16)")
    a("--synthetic", metavar="DIR", help="write a synthetic dump of the Rust format to DIR, exit")
    a("--synthetic-seqs", type=int, default=64)
    a("--synthetic-vocab", type=int, default=4096)
    a("--synthetic-h", type=int, default=576)
    a("--ci-check", action="store_true", help="3 fixed-seed steps on synthetic data vs the record")
    a("--record", action="store_true", help="with --ci-check: write the record instead")
    a("--bench-step", type=int, metavar="N", help="time N steps on synthetic data and exit")
    a("--ckpt-dir", help="checkpoint directory (resumed from when it holds one)")
    a("--ckpt-every", type=int, default=100)
    a("--stop-at", type=int, help="stop after this step (checkpointed), to resume later")
    a("--log", help="append JSON lines here (also printed)")
    a("--gguf", help="the target's GGUF: RoPE theta and RMS eps from it, output_norm init")
    a("--init-layer", type=int, help="initialise the decoder layer from this target layer (--gguf)")
    a("--theta", type=float, help="RoPE theta (default: the GGUF's, else 100000, SmolLM2's)")
    a("--eps", type=float, help="RMSNorm eps (default: the GGUF's, else 1e-5)")
    a("--seed", type=int, default=29)
    a("--ttt", type=int, default=5, help="unrolled training-time-test steps (>= 1)")
    a("--decay", type=float, default=0.8, help="loss weight of step t is decay^(t-1)")
    a("--subset", type=int, default=8192, help="FR-Spec subset size")
    a("--steps", type=int, default=2000)
    a("--lr", type=float, default=1e-3)
    a("--warmup", type=int, default=100)
    a("--clip", type=float, default=0.5)
    a("--weight-decay", type=float, default=0.0)
    a("--rows", type=int, default=4, help="packed rows per batch")
    a("--length", type=int, default=512, help="positions per packed row")
    a("--val-every", type=int, default=20, help="hold out every N-th sequence")
    a("--heads", type=int, default=9)
    a("--kv-heads", type=int, default=3)
    a("--head-dim", type=int, default=64)
    a("--ffn", type=int, default=1536)
    a("--threads", type=int, help="CPU cores for XLA (sets the process's CPU affinity)")
    args = p.parse_args(argv)
    if args.ttt < 1 or args.heads % args.kv_heads or args.head_dim % 2:
        p.error("need --ttt >= 1, --heads a multiple of --kv-heads, an even --head-dim")
    if not (args.ci_check or args.synthetic or args.bench_step) and not (args.data and args.out):
        p.error("give --data and --out (or --synthetic / --ci-check / --bench-step)")
    return args


def pin_threads(n):
    """XLA's CPU thread pools size themselves from the CPU affinity, so pin before importing
    jax; also turn off Eigen's multi-threading when one core is asked for."""
    if n:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:n]))
        if n == 1:
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                       + " --xla_cpu_multi_thread_eigen=false").strip()


def settings_of(args, dump, theta, eps):
    return {"seed": args.seed, "h": dump.h, "k": dump.k, "feature_layers": dump.feature_layers,
            "nh": args.heads, "nkv": args.kv_heads,
            "d": args.head_dim, "ffn": args.ffn, "eps": eps, "theta": theta, "ttt": args.ttt,
            "decay": args.decay, "lr": args.lr, "warmup": args.warmup, "steps": args.steps,
            "clip": args.clip, "weight_decay": args.weight_decay, "rows": args.rows,
            "length": args.length, "subset": args.subset, "val_every": args.val_every,
            "init_layer": args.init_layer, "ckpt_every": args.ckpt_every,
            "n_seqs": len(dump.seqs)}


def target_init(args, h):
    """`(tensors, theta, eps)` from the GGUF: output_norm (and layer `--init-layer`)."""
    theta, eps = args.theta or 100000.0, args.eps or 1e-5
    if not args.gguf:
        if args.init_layer is not None:
            sys.exit("--init-layer needs --gguf")
        return {}, theta, eps
    from eagle3 import gguf, model
    g = gguf.Gguf(args.gguf)
    theta, eps = args.theta or g.rope_theta(), args.eps or g.rms_eps()
    out = {"output_norm.weight": g.tensor("output_norm.weight")}
    if args.init_layer is not None:
        for name in model.LAYER_FROM_TARGET:
            out[name] = g.tensor(f"blk.{args.init_layer}.{name}")
    if out["output_norm.weight"].shape != (h,):
        sys.exit(f"{args.gguf}: hidden size {out['output_norm.weight'].shape}, data {h}")
    return out, theta, eps


def main(argv=None):
    args = parse(argv if argv is not None else sys.argv[1:])
    pin_threads(args.threads)
    sys.path.insert(0, HERE)
    from eagle3 import data
    if args.synthetic:
        data.write_synthetic(args.synthetic, h=args.synthetic_h, vocab=args.synthetic_vocab,
                             seqs=args.synthetic_seqs, seed=args.seed)
        print(f"wrote a synthetic dump to {args.synthetic}")
        return 0
    from eagle3 import model, trainer
    if args.ci_check:
        with tempfile.TemporaryDirectory() as tmp:
            return trainer.ci_check(CI_JSON, args.record, tmp)
    with tempfile.TemporaryDirectory() as tmp:
        if args.bench_step:
            args.data = data.write_synthetic(os.path.join(tmp, "bench"), vocab=16384,
                                             seqs=2 * args.rows * (args.bench_step + 2),
                                             min_len=args.length // 2, max_len=args.length,
                                             seed=args.seed)
            args.steps, args.val_every = args.bench_step + 1, 0
        dump = data.Dump(args.data)
        tinit, theta, eps = target_init(args, dump.h)
        s = settings_of(args, dump, theta, eps)
        p0 = model.init(trainer.model_config(s), s["seed"], tinit)
        params, ids, head_rows, val_idx, _ = trainer.train(
            s, dump, p0, args.ckpt_dir, args.log, args.stop_at)
        if args.bench_step or (args.stop_at and args.stop_at < s["steps"]):
            return 0
        ev = trainer.evaluate(params, dump, val_idx, ids, head_rows, s)
        trainer.log({"validation": ev, "subset": len(ids), "train_sequences":
                     int(len(dump.seqs) - len(val_idx))}, open(args.log, "a") if args.log else None)
        trainer.export(args.out, params, ids, s,
                       {"validation": json.dumps(ev)} if ev else None)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
