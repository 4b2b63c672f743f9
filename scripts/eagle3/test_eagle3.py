"""Tests of the EAGLE-3 trainer (a few seconds each on the CPU, tiny shapes):

  cd scripts && nice -n 19 /work/venv-jax/bin/python -m unittest eagle3.test_eagle3

- the synthetic dump has exactly the Rust dump's tensors, dtypes and shapes;
- the training-time-test forward equals a plain sequential simulation of drafting (a causal
  one-layer forward over the sequence, re-run once per drafted position, the head's own `w`
  fed forward): the tree-style mask is exact and packed sequences do not see each other;
- RoPE rotates adjacent pairs, as `fast::forward::rope`;
- 6 steps straight and 3 steps + checkpoint + resume + 3 steps give bit-identical parameters;
- the exported file has the tensor names of `HEAD_TENSORS` (read from head.rs) plus
  `fc3.weight`, f16, `vocab_ids` u32 and the format metadata.
"""
import math
import os
import re
import tempfile
import unittest

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from . import data, model, trainer

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SMALL = {"h": 64, "vocab": 512, "seqs": 12, "files": 2, "min_len": 10, "max_len": 60, "seed": 5}
SET = dict(trainer.CI_SETTINGS, rows=2, length=128, steps=6, ttt=4, val_every=0)


def small_dump(tmp):
    return data.Dump(data.write_synthetic(os.path.join(tmp, "d"), **SMALL))


def ref_rope(x, pos, theta):
    """`x [n, heads, d]` rotated as `fast::forward::rope`: pair (2i, 2i+1), angle pos/theta^(2i/d)."""
    n, _, d = x.shape
    out = np.array(x, np.float64)
    for p in range(n):
        for i in range(d // 2):
            a = pos[p] / theta ** (2 * i / d)
            x0, x1 = x[p, :, 2 * i].astype(np.float64), x[p, :, 2 * i + 1].astype(np.float64)
            out[p, :, 2 * i] = x0 * math.cos(a) - x1 * math.sin(a)
            out[p, :, 2 * i + 1] = x0 * math.sin(a) + x1 * math.cos(a)
    return out


def plain_layer(p, c, g, emb, pos):
    """The head's decoder layer over one sequence (`g`, `emb` `[n, h]`), causal: `w [n, h]`."""
    P = {k: np.asarray(v, np.float64) for k, v in p.items()}
    nh, nkv, d, eps = c["nh"], c["nkv"], c["d"], c["eps"]
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    u = np.concatenate([g, emb], -1) @ P["fc.weight"].T + P["fc.bias"]
    a = rms(u, P["attn_norm.weight"])
    n = len(u)
    q = ref_rope((a @ P["attn_q.weight"].T).reshape(n, nh, d), pos, c["theta"]) / math.sqrt(d)
    k = ref_rope((a @ P["attn_k.weight"].T).reshape(n, nkv, d), pos, c["theta"])
    v = (a @ P["attn_v.weight"].T).reshape(n, nkv, d)
    o = np.zeros((n, nh, d))
    for hd in range(nh):
        kv = hd // (nh // nkv)
        s = q[:, hd] @ k[:, kv].T + np.triu(np.full((n, n), -np.inf), 1)
        e = np.exp(s - s.max(-1, keepdims=True))
        o[:, hd] = (e / e.sum(-1, keepdims=True)) @ v[:, kv]
    x = u + o.reshape(n, nh * d) @ P["attn_output.weight"].T
    a2 = rms(x, P["ffn_norm.weight"])
    gate = a2 @ P["ffn_gate.weight"].T
    return x + ((gate / (1 + np.exp(-gate))) * (a2 @ P["ffn_up.weight"].T)) @ P["ffn_down.weight"].T


class Eagle3Test(unittest.TestCase):
    def test_synthetic_dump_has_the_rust_format(self):
        with tempfile.TemporaryDirectory() as tmp:
            d = data.write_synthetic(os.path.join(tmp, "d"), **SMALL)
            n_total = 0
            for i in range(2):
                with safe_open(os.path.join(d, f"features-{i:05d}.safetensors"), "np") as f:
                    t = {k: f.get_tensor(k) for k in f.keys()}
                self.assertEqual(sorted(t), sorted(data.FEATURE_TENSORS))
                n, s = len(t["tokens"]), len(t["answer_starts"])
                want = {"tokens": ((n,), np.uint32), "seq_starts": ((s + 1,), np.uint32),
                        "answer_starts": ((s,), np.uint32), "features": ((n, 192), np.float16),
                        "final": ((n, 64), np.float16), "embeds": ((n, 64), np.float16)}
                for k, (shape, dt) in want.items():
                    self.assertEqual((t[k].shape, t[k].dtype), (shape, dt), k)
                self.assertEqual((t["seq_starts"][0], t["seq_starts"][-1]), (0, n))
                n_total += s
            with safe_open(os.path.join(d, "lm_head.safetensors"), "np") as f:
                self.assertEqual(f.get_tensor("output_rows").shape, (512, 64))
            self.assertEqual(n_total, 12)

    def test_rope_rotates_adjacent_pairs(self):
        x = np.random.default_rng(1).standard_normal((7, 3, 16)).astype(np.float32)
        pos = np.arange(7) * 5
        got = np.asarray(model.rope(jnp.asarray(x), jnp.asarray(pos), 16, 100000.0))
        np.testing.assert_allclose(got, ref_rope(x, pos, 100000.0), rtol=1e-5, atol=1e-5)

    def test_training_time_test_equals_sequential_drafting(self):
        T = 3
        with tempfile.TemporaryDirectory() as tmp:
            dump = small_dump(tmp)
            c = trainer.model_config(SET)
            p = model.init(c, 7)
            rng = np.random.default_rng(2)  # non-trivial norms and bias
            for k in ("fc.bias", "attn_norm.weight", "ffn_norm.weight"):
                p[k] = p[k] + 0.3 * rng.standard_normal(p[k].shape).astype(np.float32)
            for k in model.MATRICES:
                p[k] = p[k] * 5
            b = data.Packer(dump, np.arange(len(dump.seqs)), 2, 128, 0).next()
            outs = [np.asarray(w) for w in model.unrolled(p, b, c, T)]
            checked = 0
            for r in range(2):
                for sg in np.unique(b["seg"][r])[1:3]:  # two packed sequences per row
                    rows = np.nonzero(b["seg"][r] == sg)[0]
                    f32 = lambda a: np.asarray(a[r, rows], np.float64)
                    g0 = f32(b["feat_prev"]) @ np.asarray(p["fc3.weight"], np.float64).T
                    emb, pos = f32(b["emb"]), b["pos"][r, rows]
                    for i in (0, 1, len(rows) // 2):
                        g, w = g0[:i + 1].copy(), None
                        for t in range(min(T, len(rows) - i)):
                            w = plain_layer(p, c, g, emb[:i + t + 1], pos[:i + t + 1])[-1]
                            np.testing.assert_allclose(outs[t][r, rows[i]], w, rtol=2e-3, atol=2e-3)
                            g = np.concatenate([g, w[None]])
                            checked += 1
            self.assertGreater(checked, 20)

    def test_resume_is_bit_exact(self):
        with tempfile.TemporaryDirectory() as tmp:
            dump = small_dump(tmp)
            s = dict(SET, n_seqs=len(dump.seqs))
            p0 = model.init(trainer.model_config(s), s["seed"])
            straight = trainer.train(s, dump, p0)[0]
            ck = os.path.join(tmp, "ck")
            first = trainer.train(s, dump, p0, ckpt_dir=ck, stop_at=3)[4]
            self.assertEqual(len(first), 3)
            resumed, _, _, _, second = trainer.train(s, dump, p0, ckpt_dir=ck)
            self.assertEqual(len(second), 3)
            for k in straight:
                self.assertTrue(np.array_equal(np.asarray(straight[k]), np.asarray(resumed[k])), k)
            with self.assertRaises(ValueError):
                trainer.train(dict(s, lr=2e-3), dump, p0, ckpt_dir=ck)

    def test_export_has_the_head_tensors(self):
        with open(os.path.join(REPO, "crates/speculative-candle/src/fast/head.rs")) as f:
            src = f.read()
        block = re.search(r"HEAD_TENSORS: \[&str; \d+\] = \[(.*?)\];", src, re.S).group(1)
        names = re.findall(r'"([^"]+)"', block)
        self.assertEqual(len(names), 12)
        c = trainer.model_config(trainer.CI_SETTINGS)
        p = model.init(c, 1)
        ids = np.arange(300, 0, -1).astype(np.uint32)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "head.safetensors")
            trainer.export(path, p, ids, trainer.CI_SETTINGS)
            with safe_open(path, "np") as f:
                meta, keys = f.metadata(), set(f.keys())
                self.assertEqual(keys, set(names) | {"fc3.weight", "vocab_ids"})
                for k in keys - {"vocab_ids"}:
                    self.assertEqual(f.get_tensor(k).dtype, np.float16, k)
                    self.assertEqual(f.get_tensor(k).shape, model.shapes(c)[k], k)
                self.assertEqual(f.get_tensor("fc3.weight").shape, (64, 192))
                v = f.get_tensor("vocab_ids")
                self.assertEqual(v.dtype, np.uint32)
                self.assertTrue(np.array_equal(v, ids))
            self.assertEqual(meta["format"], "speculative-eagle3-head-v1")
            self.assertEqual(meta["feature_layers"], "2,15,27")

    def test_fr_spec_subset_is_most_frequent_answer_tokens(self):
        with tempfile.TemporaryDirectory() as tmp:
            dump = small_dump(tmp)
            idx = np.arange(len(dump.seqs))
            ids = data.fr_spec_subset(dump, idx, 50)
            counts = np.bincount(dump.answer_tokens(idx), minlength=512)
            self.assertEqual(len(set(ids.tolist())), 50)
            self.assertTrue(np.all(np.diff(counts[ids]) <= 0))
            self.assertGreaterEqual(counts[ids].min(), np.sort(counts)[::-1][49])


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    unittest.main()
