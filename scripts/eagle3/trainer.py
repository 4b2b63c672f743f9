"""Optimiser, training loop, resumable checkpoints, evaluation, export and the CI loss check.

Everything is a function of the settings and the data: the initialisation from `seed`, the
batch order from the packer's cursor (a shuffled permutation per epoch, seeded by
`[seed, epoch]`, windows of long sequences seeded by `[seed, epoch, sequence, 7]`); nothing
else draws random numbers. A checkpoint holds the parameters, AdamW's state (its step count
drives the schedule), the step and the cursor, so a resumed run computes the same bits as an
uninterrupted one (same machine and JAX build).
"""
import functools
import glob
import json
import math
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import data, model, stio

HEAD_FORMAT = "speculative-eagle3-head-v1"
# Settings a checkpoint must agree with to be resumed (they change the computed bits).
FINGERPRINT = ("seed", "h", "k", "feature_layers", "nh", "nkv", "d", "ffn", "eps", "theta",
               "ttt", "decay", "lr",
               "warmup", "steps", "clip", "weight_decay", "rows", "length", "subset",
               "val_every", "init_layer", "n_seqs")


def peak_rss_mb():
    """Peak resident memory of this process so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def schedule(s):
    """Learning rate by optimiser step: linear warm-up over `warmup` steps to `lr`, then cosine
    to 10 % of it at `steps` (the v1 trainer's `lr_at`)."""
    lr, warm, steps = s["lr"], max(s["warmup"], 1), s["steps"]

    def f(count):
        count = jnp.asarray(count, jnp.float32)
        x = jnp.clip((count - warm) / max(steps - warm, 1), 0.0, 1.0)
        cos = lr * (0.1 + 0.45 * (1.0 + jnp.cos(math.pi * x)))
        return jnp.where(count < warm, lr * (count + 1) / warm, cos)
    return f


def optimiser(s):
    """Global-norm clipping to `clip`, then AdamW (beta 0.9 / 0.95, eps 1e-8) on `schedule`."""
    return optax.chain(optax.clip_by_global_norm(s["clip"]),
                       optax.adamw(schedule(s), b1=0.9, b2=0.95, eps=1e-8,
                                   weight_decay=s["weight_decay"]))


def model_config(s):
    return dict({k: s[k] for k in ("h", "nh", "nkv", "d", "ffn", "eps", "theta")}, k=s.get("k", 3))


def make_step(s):
    """The jit-compiled optimiser step `(params, opt_state, batch, head_rows) -> (params,
    opt_state, loss, ce [T], grad_norm)`, the parameters and optimiser state donated (updated in
    place): loss = sum_t decay^t CE_t (EAGLE-3's weighting;
    decay 1 weights the steps equally). Compiled once: every batch has the same shape."""
    c, T, opt = model_config(s), s["ttt"], optimiser(s)
    weights = jnp.asarray([s["decay"] ** t for t in range(T)], jnp.float32)

    def total(p, batch, head_rows):
        ce = model.losses(p, batch, head_rows, c, T)
        return (ce * weights).sum(), ce

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch, head_rows):
        (loss, ce), grads = jax.value_and_grad(total, has_aux=True)(params, batch, head_rows)
        gn = optax.tree.norm(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, ce, gn
    return step, opt


def save_checkpoint(directory, step, params, opt_state, cursor, settings, keep=2):
    """Writes `ckpt-STEP.npz` (every leaf of `(params, opt_state)` in tree order) and
    `ckpt-STEP.json` (step, cursor, settings), then `latest.json`; keeps the last `keep`."""
    os.makedirs(directory, exist_ok=True)
    leaves = jax.tree_util.tree_leaves(jax.device_get((params, opt_state)))
    base = os.path.join(directory, f"ckpt-{step:08d}")
    with open(base + ".npz.tmp", "wb") as f:
        np.savez(f, **{f"l{i:05d}": np.asarray(x) for i, x in enumerate(leaves)})
    os.replace(base + ".npz.tmp", base + ".npz")
    meta = {"step": step, "cursor": list(cursor), "settings": settings}
    for path, obj in ((base + ".json", meta), (os.path.join(directory, "latest.json"),
                                               {"checkpoint": os.path.basename(base)})):
        with open(path + ".tmp", "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)
    for old in sorted(glob.glob(os.path.join(directory, "ckpt-*.npz")))[:-keep]:
        for p in (old, old[:-4] + ".json"):
            if os.path.exists(p):
                os.remove(p)


def load_checkpoint(directory, params, opt_state, settings):
    """`(step, cursor, params, opt_state)` of the latest checkpoint in `directory`, or None when
    there is none. The tree structure comes from `params`/`opt_state` (fresh ones). Raises
    ValueError when the checkpoint's fingerprint settings differ or its leaves do not fit."""
    latest = os.path.join(directory, "latest.json")
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        base = os.path.join(directory, json.load(f)["checkpoint"])
    with open(base + ".json") as f:
        meta = json.load(f)
    diff = {k: (meta["settings"].get(k), settings.get(k)) for k in FINGERPRINT
            if meta["settings"].get(k) != settings.get(k)}
    if diff:
        raise ValueError(f"{base}: checkpoint settings differ (saved, now): {diff}")
    leaves, tree = jax.tree_util.tree_flatten((params, opt_state))
    with np.load(base + ".npz") as z:
        saved = [z[f"l{i:05d}"] for i in range(len(z.files))]
    if len(saved) != len(leaves) or any(np.shape(a) != np.shape(b) for a, b in zip(saved, leaves)):
        raise ValueError(f"{base}: checkpoint leaves do not match the model")
    saved = [jnp.asarray(a, dtype=jnp.asarray(b).dtype) for a, b in zip(saved, leaves)]
    p, o = jax.tree_util.tree_unflatten(tree, saved)
    return meta["step"], tuple(meta["cursor"]), p, o


def target_argmax(lm_rows, lm_ids):
    """A jitted `final [R, L, h] -> [R, L] int32`: the target's greedy token (argmax of
    `final · output_rows^T`, in chunks of 256 rows), mapped through `lm_ids` for a subset dump."""
    ids = None if lm_ids is None else jnp.asarray(lm_ids, jnp.int32)

    @jax.jit
    def f(final, rows):
        R, L, h = final.shape
        x = final.astype(jnp.float32).reshape(-1, 256, h)
        best = jax.lax.map(lambda xc: jnp.argmax(xc @ rows.T, -1).astype(jnp.int32), x)
        best = best.reshape(R, L)
        return best if ids is None else ids[best]
    return f


def evaluate(params, dump, val_idx, vocab_ids, head_rows, s):
    """Validation top-1 / top-3 by draft position `1..T` on the held-out sequences (the unrolled
    training-time-test forward, true tokens, the head's own `w` fed forward), against the
    target's greedy token, plus the subset's coverage of their answer tokens."""
    if len(val_idx) == 0:
        return None
    c, T = model_config(s), s["ttt"]
    if (s["rows"] * s["length"]) % 256:
        raise ValueError("rows * length must be a multiple of 256 for evaluation")
    rows = jnp.asarray(np.asarray(dump.lm_rows, np.float32))
    am = target_argmax(rows, dump.lm_ids)
    ids = jnp.asarray(vocab_ids.astype(np.int32))
    acc = jax.jit(lambda p, b, hr, tid: model.accuracy_counts(p, b, hr, ids, tid, c, T))
    packer = data.Packer(dump, val_idx, s["rows"], s["length"], s["seed"], shuffle=False)
    tot = np.zeros((3, T))
    while (b := packer.next()) is not None:
        tid = am(b["final"], rows)
        tot += np.asarray(jax.device_get(acc(params, b, head_rows, tid)))
    n = np.maximum(tot[2], 1)
    ans = dump.answer_tokens(val_idx)
    return {"top1": [round(x, 4) for x in tot[0] / n], "top3": [round(x, 4) for x in tot[1] / n],
            "positions": [int(x) for x in tot[2]],
            "subset_coverage": round(float(np.isin(ans, vocab_ids).mean()), 4) if len(ans) else None}


def export(path, params, vocab_ids, settings, extra=None):
    """Writes the head file: f16 tensors named as in `speculative_candle::fast::head` (v1's plus
    `fc3.weight [h, k h]`), `vocab_ids [|S|] u32`, metadata `format`, `feature_layers` (the
    dump's, settings key `feature_layers`, default "2,15,27") and the
    training settings. Raises ValueError for a value that is not finite in f16."""
    tensors = {}
    for name, v in jax.device_get(params).items():
        v = np.asarray(v, np.float32)
        if not np.all(np.isfinite(v)) or np.abs(v).max() > 65504.0:
            raise ValueError(f"tensor {name} has a value that is not finite in f16")
        tensors[name] = v.astype(np.float16)
    tensors["vocab_ids"] = np.asarray(vocab_ids, np.uint32)
    meta = {"format": HEAD_FORMAT,
            "feature_layers": settings.get("feature_layers", data.DEFAULT_LAYERS),
            "training": json.dumps(settings, sort_keys=True)}
    meta.update({f"train.{k}": v for k, v in settings.items()})
    meta.update(extra or {})
    stio.write(path, tensors, meta)


def log(line, fh):
    text = json.dumps(line, sort_keys=True)
    print(text, flush=True)
    if fh:
        fh.write(text + "\n")
        fh.flush()


def train(s, dump, init_params, ckpt_dir=None, log_path=None, stop_at=None):
    """Trains per the settings `s` on `dump` from `init_params` (numpy dict), resuming from
    `ckpt_dir` when it holds a checkpoint; stops at `stop_at` (default `s["steps"]`). Returns
    `(params, vocab_ids, head_rows, val_idx, losses)` with `losses` the total loss per step
    of this run."""
    train_idx, val_idx = dump.split(s["val_every"])
    vocab_ids = data.fr_spec_subset(dump, train_idx, s["subset"])
    rows = np.asarray(dump.lm_rows, np.float32)
    sub = vocab_ids if dump.lm_ids is None else np.arange(len(vocab_ids))
    head_rows = jnp.asarray(rows[sub])
    step_fn, opt = make_step(s)
    params = {k: jnp.asarray(v) for k, v in init_params.items()}
    opt_state = opt.init(params)
    packer = data.Packer(dump, train_idx, s["rows"], s["length"], s["seed"])
    start = 0
    if ckpt_dir:
        got = load_checkpoint(ckpt_dir, params, opt_state, s)
        if got:
            start, packer.cursor, params, opt_state = got
    fh = open(log_path, "a") if log_path else None
    lr_of = schedule(s)
    end, out = min(stop_at or s["steps"], s["steps"]), []
    for step in range(start, end):
        t0 = time.time()
        b = packer.next()
        t1, c1 = time.time(), time.process_time()
        params, opt_state, loss, ce, gn = step_fn(params, opt_state, b, head_rows)
        loss = float(loss)
        t2, c2 = time.time(), time.process_time()
        out.append(loss)
        log({"step": step + 1, "loss": round(loss, 6), "ce": [round(float(x), 5) for x in ce],
             "lr": float(lr_of(step)), "grad_norm": round(float(gn), 5),
             "step_s": round(t2 - t1, 4), "step_cpu_s": round(c2 - c1, 4), "data_s": round(t1 - t0, 4),
             "steps_per_s": round(1.0 / max(t2 - t0, 1e-9), 4),
             "positions": int(b["lmask"].sum()), "peak_rss_mb": round(peak_rss_mb(), 1)}, fh)
        done = step + 1
        if ckpt_dir and (done % s["ckpt_every"] == 0 or done == end):
            save_checkpoint(ckpt_dir, done, params, opt_state, packer.cursor, s)
    if fh:
        fh.close()
    return params, vocab_ids, head_rows, val_idx, out


CI_SETTINGS = {"seed": 29, "h": 64, "nh": 9, "nkv": 3, "d": 16, "ffn": 128, "eps": 1e-5,
               "theta": 100000.0, "ttt": 5, "decay": 0.8, "lr": 1e-3, "warmup": 2, "steps": 3,
               "clip": 0.5, "weight_decay": 0.0, "rows": 2, "length": 128, "subset": 256,
               "val_every": 8, "init_layer": None, "ckpt_every": 1000}
CI_DATA = {"h": 64, "vocab": 512, "seqs": 24, "files": 2, "min_len": 16, "max_len": 100, "seed": 3}


def ci_check(record_path, record, tmp):
    """Trains 3 steps on a fixed synthetic dump and compares the losses with `record_path`
    (relative tolerance from the file); with `record`, writes it instead. Returns the exit code."""
    dump = data.Dump(data.write_synthetic(os.path.join(tmp, "ci-data"), **CI_DATA))
    s = dict(CI_SETTINGS, n_seqs=len(dump.seqs), k=dump.k, feature_layers=dump.feature_layers)
    p0 = model.init(model_config(s), s["seed"])
    losses = train(s, dump, p0)[4]
    print(json.dumps({"ci_losses": losses}))
    if record:
        with open(record_path, "w") as f:
            json.dump({"losses": losses, "rel_tolerance": 1e-3, "jax": jax.__version__,
                       "optax": optax.__version__, "settings": CI_SETTINGS, "data": CI_DATA},
                      f, indent=1, sort_keys=True)
            f.write("\n")
        return 0
    with open(record_path) as f:
        want = json.load(f)
    tol = want["rel_tolerance"]
    bad = [(a, b) for a, b in zip(losses, want["losses"]) if abs(a - b) > tol * abs(b)]
    if bad or len(losses) != len(want["losses"]):
        print(f"ci-check FAILED: losses {losses}, recorded {want['losses']} (rel tol {tol})",
              file=sys.stderr)
        return 1
    print(f"ci-check ok: {len(losses)} losses within {tol} of {record_path}")
    return 0
