#!/usr/bin/env python3
"""Seconds per training step of the one-layer draft head in JAX on the CPU, the same model,
loss and optimiser as `train_draft_head bench-step --unroll 1` (speculative_candle::train):
fc [2h -> h] over (feature, embedding), one decoder layer (9 query / 3 key-value heads of 64,
RoPE, causal attention, SwiGLU MLP 1536), RMSNorms, SmoothL1 feature regression + 0.1 x
cross-entropy against the target's distribution over an 8,192-row frozen output subset, AdamW
with gradient clipping. Random data (the cost does not depend on the values). For comparing
training libraries on this machine (crates/speculative-candle/heads/README.md); not used in CI.

Usage: XLA_FLAGS="--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2" \
       bench-head-step-jax.py [STEPS] [SEQS] [LEN]        (default 5 8 256)
"""
import sys
import time

import jax
import jax.numpy as jnp
import optax

H, NH, NKV, D, FFN, SUB, VOCAB, EPS = 576, 9, 3, 64, 1536, 8192, 49152, 1e-5


def init(key):
    ks = jax.random.split(key, 8)
    n = lambda k, shape: jax.random.normal(k, shape, jnp.float32) * 0.02
    return {
        "fc_w": n(ks[0], (H, 2 * H)), "fc_b": jnp.zeros(H),
        "attn_norm": jnp.ones(H), "ffn_norm": jnp.ones(H), "out_norm": jnp.ones(H),
        "wq": n(ks[1], (NH * D, H)), "wk": n(ks[2], (NKV * D, H)), "wv": n(ks[3], (NKV * D, H)),
        "wo": n(ks[4], (H, NH * D)), "wg": n(ks[5], (FFN, H)), "wu": n(ks[6], (FFN, H)),
        "wd": n(ks[7], (H, FFN)),
    }


def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * w


def rope(x, cos, sin):
    a, b = x[..., : D // 2], x[..., D // 2:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def forward(p, feat, emb, cos, sin, mask):
    b, t, _ = feat.shape
    u = jnp.concatenate([feat, emb], -1) @ p["fc_w"].T + p["fc_b"]
    a = rms(u, p["attn_norm"])
    q = (a @ p["wq"].T).reshape(b, t, NH, D).transpose(0, 2, 1, 3)
    k = (a @ p["wk"].T).reshape(b, t, NKV, D).transpose(0, 2, 1, 3)
    v = (a @ p["wv"].T).reshape(b, t, NKV, D).transpose(0, 2, 1, 3)
    q, k = rope(q, cos, sin) / jnp.sqrt(D), rope(k, cos, sin)
    k, v = jnp.repeat(k, NH // NKV, 1), jnp.repeat(v, NH // NKV, 1)
    att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) + mask, -1)
    o = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, NH * D)
    v1 = u + o @ p["wo"].T
    a2 = rms(v1, p["ffn_norm"])
    w = v1 + (jax.nn.silu(a2 @ p["wg"].T) * (a2 @ p["wu"].T)) @ p["wd"].T
    return rms(w, p["out_norm"])


def loss_fn(p, batch, head, cos, sin, mask):
    feat_in, emb, feat_out, lmask = batch
    pred = forward(p, feat_in, emb, cos, sin, mask)
    n = jnp.maximum(lmask.sum(), 1.0)
    d = jnp.abs(pred - feat_out)
    sl1 = jnp.where(d < 1.0, 0.5 * d * d, d - 0.5).sum(-1)
    reg = (sl1 * lmask).sum() / (n * H)
    target_p = jax.nn.softmax(jax.lax.stop_gradient(feat_out @ head.T), -1)
    logp = jax.nn.log_softmax(pred @ head.T, -1)
    ce = -((target_p * logp).sum(-1) * lmask).sum() / n
    return reg + 0.1 * ce


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    t = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    params = init(k1)
    table = jax.random.normal(k2, (VOCAB, H)) * 0.02
    head = jax.random.normal(k3, (SUB, H)) * 0.02
    tokens = jax.random.randint(k4, (seqs, t), 0, VOCAB)
    feats = jax.random.normal(k5, (seqs, t + 1, H))
    batch = (feats[:, :-1], table[tokens], feats[:, 1:], jnp.ones((seqs, t)))
    inv = 1.0 / (10000.0 ** (jnp.arange(0, D, 2) / D))
    ang = jnp.arange(t)[:, None] * inv[None]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    mask = jnp.where(jnp.tril(jnp.ones((t, t))) > 0, 0.0, -1e9)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.0))
    state = opt.init(params)

    # The data are arguments, not constants of the compiled step (XLA would fold them).
    @jax.jit
    def step(params, state, batch, head, cos, sin, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, head, cos, sin, mask)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    t0 = time.time()
    params, state, loss = step(params, state, batch, head, cos, sin, mask)
    loss.block_until_ready()
    compile_s = time.time() - t0
    times = []
    for _ in range(steps):
        t0 = time.time()
        params, state, loss = step(params, state, batch, head, cos, sin, mask)
        loss.block_until_ready()
        times.append(time.time() - t0)
    times.sort()
    print(f"jax {jax.__version__}: {seqs * t} positions per step: median {times[len(times) // 2]:.3f} s "
          f"per step (min {times[0]:.3f}, max {times[-1]:.3f}, {steps} steps; first step with "
          f"compilation {compile_s:.1f} s)")


if __name__ == "__main__":
    main()
