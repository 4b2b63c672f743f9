"""The EAGLE-3 head (Li et al. 2025) and its training-time-test forward, in JAX.

Parameters are a dict keyed by the tensor names of the head file (`speculative_candle::fast::
head`), every matrix row-major `[out, in]` (`y = x @ W.T`):
`fc3.weight [h, k h]` (`k` feature layers, 3 by default), `fc.weight [h, 2h]` (input
`[g; e(x)]`, fused feature first),
`fc.bias [h]`, `attn_norm.weight [h]`, `attn_q.weight [nh d, h]`, `attn_k.weight [nkv d, h]`,
`attn_v.weight [nkv d, h]`, `attn_output.weight [h, nh d]`, `ffn_norm.weight [h]`,
`ffn_gate.weight [f, h]`, `ffn_up.weight [f, h]`, `ffn_down.weight [h, f]`,
`output_norm.weight [h]`. RoPE rotates ADJACENT pairs `(2i, 2i + 1)` of each head vector with
angle `pos / theta^(2i / d)`, as `fast::forward::rope` does on the GGUF's (llama.cpp-permuted)
weights; queries are scaled by `1 / sqrt(d)`; RMSNorm is `x / sqrt(mean(x^2) + eps) * w`.

Training-time test, unrolled `T` steps, in "chain" form: row `i` of step `t` (0-based here) is
draft `t + 1` of a chain whose first draft is position `pos_i`, i.e. it sits at position
`pos_i + t`, reads the true token `x_{i+t}`, reads `g` = the head's own pre-norm output `w` of
row `i` at step `t - 1` (step 0: `fc3(F_{i-1})`, the teacher features), and is scored against the
target's distribution at row `i + t`. Its attention sees step 0's keys of rows `j <= i` of its
own sequence (computed from teacher features, as the head's cache holds them at inference) and
the keys of row `i` itself at steps `1..t` (the rest of its own chain): EAGLE-3's tree-style
mask, exactly, no simplification. Gradients flow through the fed-forward `w` across steps.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np

MATRICES = ("fc3.weight", "fc.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
            "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
NORMS = ("attn_norm.weight", "ffn_norm.weight", "output_norm.weight")
LAYER_FROM_TARGET = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                     "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                     "ffn_down.weight")


def shapes(c):
    """Tensor name -> shape for the config dict `c` (h, nh, nkv, d, ffn, optional k = 3)."""
    h, q, kv, f = c["h"], c["nh"] * c["d"], c["nkv"] * c["d"], c["ffn"]
    return {"fc3.weight": (h, c.get("k", 3) * h), "fc.weight": (h, 2 * h), "fc.bias": (h,),
            "attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
            "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,),
            "ffn_gate.weight": (f, h), "ffn_up.weight": (f, h), "ffn_down.weight": (h, f),
            "output_norm.weight": (h,)}


def init(c, seed, target=None):
    """Initial parameters (f32 numpy). Random: normal(0, 0.02) matrices, the residual
    projections (`attn_output`, `ffn_down`) scaled by 1/sqrt(2), zero bias, unit norms (the
    v1 trainer's recipe), from `np.random.default_rng(seed)` in name order. `target` (name ->
    array, optional) overrides any of `LAYER_FROM_TARGET` (a decoder layer of the target) and
    `output_norm.weight` (the target's final norm)."""
    rng = np.random.default_rng(seed)
    p = {}
    for name, shape in sorted(shapes(c).items()):
        if name in MATRICES:
            std = 0.02 / math.sqrt(2) if name in ("attn_output.weight", "ffn_down.weight") else 0.02
            p[name] = (rng.standard_normal(shape) * std).astype(np.float32)
        elif name == "fc.bias":
            p[name] = np.zeros(shape, np.float32)
        else:
            p[name] = np.ones(shape, np.float32)
    for name, value in (target or {}).items():
        if p[name].shape != value.shape:
            raise ValueError(f"{name}: target shape {value.shape}, head {p[name].shape}")
        p[name] = np.asarray(value, np.float32)
    return p


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def rope(x, pos, d, theta):
    """Rotates adjacent pairs of `x` (`[..., L, heads, d]`) by the angles of `pos` (`[..., L]`)."""
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = pos.astype(jnp.float32)[..., None] * inv
    cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).reshape(x.shape)


def shift(x, t):
    """`x` (`[R, L, ...]`) moved `t` rows up along L, zero-filled at the end."""
    if t == 0:
        return x
    pad = [(0, 0), (0, t)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, t:], pad)


def _attend(q, k0, v0, ks, vs, mask0):
    """Attention of step queries `q` (`[R, L, nkv, grp, d]`, roped and scaled) over step 0's keys
    `k0`/`v0` (`[R, L, nkv, d]`, where `mask0` `[R, L, L]` allows) and the row's own keys of the
    later steps `ks`/`vs` (lists of `[R, L, nkv, d]`). Returns `[R, L, nkv, grp, d]`."""
    s0 = jnp.einsum("rikgd,rjkd->rkgij", q, k0)
    s0 = jnp.where(mask0[:, None, None], s0, -1e30)
    diag = [jnp.einsum("rikgd,rikd->rkgi", q, k)[..., None] for k in ks]
    s = jnp.concatenate([s0] + diag, -1)
    p = jax.nn.softmax(s, -1)
    L = k0.shape[1]
    o = jnp.einsum("rkgij,rjkd->rikgd", p[..., :L], v0)
    for j, v in enumerate(vs):
        o = o + jnp.einsum("rkgi,rikd->rikgd", p[..., L + j], v)
    return o


def unrolled(params, batch, c, T):
    """The `T` steps' pre-norm outputs `w` (list of `[R, L, h]`) of the training-time test on a
    packed batch (`data.Packer.empty` layout)."""
    R, L = batch["seg"].shape
    nh, nkv, d, eps = c["nh"], c["nkv"], c["d"], c["eps"]
    seg = batch["seg"]
    ii = jnp.arange(L)
    mask0 = (seg[:, :, None] == seg[:, None, :]) & (ii[None, :, None] >= ii[None, None, :])
    mask0 = mask0 | (ii[:, None] == ii[None, :])[None]
    emb = batch["emb"].astype(jnp.float32)
    g = batch["feat_prev"].astype(jnp.float32) @ params["fc3.weight"].T
    k0 = v0 = None
    ks, vs, outs = [], [], []
    for t in range(T):
        u = jnp.concatenate([g, shift(emb, t)], -1) @ params["fc.weight"].T + params["fc.bias"]
        a = rms(u, params["attn_norm.weight"], eps)
        pos = batch["pos"] + t
        q = rope((a @ params["attn_q.weight"].T).reshape(R, L, nh, d), pos, d, c["theta"])
        k = rope((a @ params["attn_k.weight"].T).reshape(R, L, nkv, d), pos, d, c["theta"])
        v = (a @ params["attn_v.weight"].T).reshape(R, L, nkv, d)
        q = (q / math.sqrt(d)).reshape(R, L, nkv, nh // nkv, d)
        if t == 0:
            k0, v0 = k, v
        else:
            ks.append(k)
            vs.append(v)
        o = _attend(q, k0, v0, ks, vs, mask0).reshape(R, L, nh * d)
        x = u + o @ params["attn_output.weight"].T
        a2 = rms(x, params["ffn_norm.weight"], eps)
        ff = jax.nn.silu(a2 @ params["ffn_gate.weight"].T) * (a2 @ params["ffn_up.weight"].T)
        g = x + ff @ params["ffn_down.weight"].T
        outs.append(g)
    return outs


def valid(batch, t):
    """`[R, L]` f32: rows whose step-`t` draft (position `pos + t`) is in the same sequence and
    counts in the loss."""
    seg = batch["seg"]
    same = (shift(seg, t) == seg) & (seg > 0)
    return (same & shift(batch["lmask"], t)).astype(jnp.float32)


def losses(params, batch, head_rows, c, T):
    """Per-step cross-entropies `[T]` (nats, mean over each step's valid rows) of the head's
    distribution over the subset against the target's, i.e. the target's full-vocabulary
    softmax restricted to the subset and renormalised, which is the softmax of the target's
    logits over the subset rows `head_rows` (`[|S|, h]`)."""
    fin = batch["final"].astype(jnp.float32)
    logp_t = jax.lax.stop_gradient(jax.nn.log_softmax(fin @ head_rows.T, -1))
    out = []
    for t, w in enumerate(unrolled(params, batch, c, T)):
        f = rms(w, params["output_norm.weight"], c["eps"])
        logq = jax.nn.log_softmax(f @ head_rows.T, -1)
        m = valid(batch, t)
        ce = -(jnp.exp(shift(logp_t, t)) * logq).sum(-1)
        out.append((ce * m).sum() / jnp.maximum(m.sum(), 1.0))
    return jnp.stack(out)


def accuracy_counts(params, batch, head_rows, ids, target_id, c, T):
    """`(top1 [T], top3 [T], count [T])` hit counts by draft position: the head's best (best three)
    subset id equals the target's argmax `target_id` (`[R, L]` int32, over the full vocabulary),
    on each step's valid rows (`ids`: `[|S|]` int32 vocabulary ids of the subset rows)."""
    top1, top3, count = [], [], []
    for t, w in enumerate(unrolled(params, batch, c, T)):
        f = rms(w, params["output_norm.weight"], c["eps"])
        _, best = jax.lax.top_k(f @ head_rows.T, 3)
        best = ids[best]
        want = shift(target_id, t)[..., None]
        m = valid(batch, t)
        top1.append(((best[..., 0] == want[..., 0]) * m).sum())
        top3.append(((best == want).any(-1) * m).sum())
        count.append(m.sum())
    return jnp.stack(top1), jnp.stack(top3), jnp.stack(count)
