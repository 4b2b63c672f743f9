"""Safetensors files as numpy memory maps (so a multi-GB feature dump costs no RAM until rows
are gathered) and a writer with string metadata."""
import json
import os
import struct

import numpy as np

DTYPES = {
    "F16": np.float16, "F32": np.float32, "F64": np.float64, "U32": np.uint32,
    "I32": np.int32, "I64": np.int64, "U8": np.uint8, "I8": np.int8, "U16": np.uint16,
}


def read(path):
    """`(tensors, metadata)` of a safetensors file: name -> read-only np.memmap view with the
    stored dtype and shape, and the `__metadata__` dict (empty when absent).
    Raises ValueError for a malformed header or an unsupported dtype."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{path}: bad safetensors header length {n}")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    raw = np.memmap(path, dtype=np.uint8, mode="r") if size > base else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        dt = DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape)) if shape else 1
        if hi - lo != count * np.dtype(dt).itemsize or base + hi > size:
            raise ValueError(f"{path}: tensor {name} has inconsistent offsets")
        out[name] = raw[base + lo:base + hi].view(dt).reshape(shape)
    return out, meta


def write(path, tensors, metadata=None):
    """Writes `tensors` (name -> numpy array) and `metadata` (str -> str) to `path` with the
    reference `safetensors` writer, atomically (a temporary file renamed)."""
    from safetensors.numpy import save_file

    tmp = f"{path}.tmp"
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(arrays, tmp, metadata={str(k): str(v) for k, v in (metadata or {}).items()})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
