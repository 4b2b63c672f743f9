"""The target's GGUF file: metadata and the tensor types SmolLM2-135M-Instruct.Q4_1 uses (F32,
F16, Q4_1, Q8_0), dequantised to f32 row-major `[rows, cols]` (GGUF lists dims inner first, so
`[ne0, ne1]` is `ne1` rows of `ne0`), the same layout as `speculative_candle::gguf`."""
import struct

import numpy as np

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
# ggml type -> (elements per block, bytes per block)
_BLOCKS = {0: (1, 4), 1: (1, 2), 3: (32, 20), 8: (32, 34)}


class Gguf:
    """A parsed GGUF file: `meta` (key -> value, arrays as lists) and
    `tensor(name)`. Raises ValueError for a file that is not GGUF v2/v3."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            self._f = f
            if f.read(4) != b"GGUF":
                raise ValueError(f"{path}: not a GGUF file")
            version, n_tensors, n_kv = self._r("I"), self._r("Q"), self._r("Q")
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version}")
            self.meta = {}
            for _ in range(n_kv):
                key = self._str()
                self.meta[key] = self._value(self._r("I"))
            self.tensors = {}
            for _ in range(n_tensors):
                name = self._str()
                dims = [self._r("Q") for _ in range(self._r("I"))]
                self.tensors[name] = (dims, self._r("I"), self._r("Q"))
            align = int(self.meta.get("general.alignment", 32))
            pos = f.tell()
            self._data = pos + (-pos) % align
        del self._f

    def _r(self, fmt):
        fmt = "<" + fmt
        return struct.unpack(fmt, self._f.read(struct.calcsize(fmt)))[0]

    def _str(self):
        return self._f.read(self._r("Q")).decode("utf-8", "replace")

    def _value(self, t):
        if t == 8:
            return self._str()
        if t == 9:
            at, n = self._r("I"), self._r("Q")
            return [self._value(at) for _ in range(n)]
        return self._r(_SCALAR[t])

    def arch(self):
        """The `general.architecture` prefix of the model keys (`llama`)."""
        return self.meta.get("general.architecture", "llama")

    def rope_theta(self):
        """`<arch>.rope.freq_base` (default 10000, as `gguf::LlamaConfig`)."""
        return float(self.meta.get(f"{self.arch()}.rope.freq_base", 10000.0))

    def rms_eps(self):
        """`<arch>.attention.layer_norm_rms_epsilon` (default 1e-5)."""
        return float(self.meta.get(f"{self.arch()}.attention.layer_norm_rms_epsilon", 1e-5))

    def tensor(self, name):
        """The tensor `name` as f32, `[ne1, ne0]` for a matrix, `[ne0]` for a vector.
        Raises KeyError when absent, ValueError for an unsupported type."""
        dims, t, off = self.tensors[name]
        if t not in _BLOCKS:
            raise ValueError(f"{name}: unsupported ggml type {t}")
        n = int(np.prod(dims))
        per, nbytes = _BLOCKS[t]
        raw = np.fromfile(self.path, np.uint8, count=n // per * nbytes, offset=self._data + off)
        if t == 0:
            x = raw.view(np.float32).copy()
        elif t == 1:
            x = raw.view(np.float16).astype(np.float32)
        elif t == 3:  # Q4_1: f16 scale d, f16 min m, 16 bytes of nibbles (low = 0..15, high = 16..31)
            b = raw.reshape(-1, 20)
            d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
            m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
            q = b[:, 4:]
            nib = np.concatenate([q & 0xF, q >> 4], axis=1).astype(np.float32)
            x = (nib * d + m).reshape(-1)
        else:  # Q8_0: f16 scale d, 32 int8
            b = raw.reshape(-1, 34)
            d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
            x = (b[:, 2:].view(np.int8).astype(np.float32) * d).reshape(-1)
        return x.reshape(tuple(reversed(dims)))
