"""Feature-dump files, the FR-Spec subset, packed batches and a synthetic dump.

A dump directory holds `features-NNNNN.safetensors` files (the Rust `train_draft_head
dump-features`, spec in crates/speculative-candle/heads/README.md) with `tokens [N] u32`,
`seq_starts [S+1] u32`, `answer_starts [S] u32` (absolute row of each sequence's first answer
token), `features [N, k h] f16` (the `k` states named by the metadata `feature_layers`,
Residual indices, default "2,15,27", concatenated),
`final [N, h] f16` (the target's final normed hidden states) and `embeds [N, h] f16`, plus
`lm_head.safetensors` with `output_rows [V, h]` (the target's output rows; or, in a dump that
chose the subset, `output_rows [|S|, h]` with `vocab_ids [|S|] u32`). A file's metadata
`format`, when present, must be `speculative-eagle3-features-v1`.

Row `p` of a sequence trains the head to predict the target's distribution at row `p` (the
next token's), reading the fused feature of `p - 1` and the embedding of `x_p`; a row counts in
the loss when the token after it is an answer token (`answer_start <= p + 1 < len`).
"""
import glob
import os

import numpy as np

from . import stio

FEATURE_TENSORS = ("tokens", "seq_starts", "answer_starts", "features", "final", "embeds")
FEATURES_FORMAT = "speculative-eagle3-features-v1"
DEFAULT_LAYERS = "2,15,27"


class Dump:
    """All sequences of a dump directory, memory-mapped. `seqs` is an int64 array `[S, 4]` of
    (file, first row, end row, answer start row) in file order; `h` the hidden size, `k` the
    number of feature layers and `feature_layers` their metadata string; `lm_rows`
    the output rows (f16 memmap), `lm_ids` their vocabulary ids (None: rows are the full vocab).
    Raises ValueError for a missing or inconsistent file."""

    def __init__(self, directory):
        paths = sorted(glob.glob(os.path.join(directory, "features-*.safetensors")))
        if not paths:
            raise ValueError(f"{directory}: no features-*.safetensors files")
        self.files, seqs = [], []
        self.h = self.k = self.feature_layers = None
        for fi, path in enumerate(paths):
            t, meta = stio.read(path)
            missing = [k for k in FEATURE_TENSORS if k not in t]
            if missing:
                raise ValueError(f"{path}: missing tensors {missing}")
            if meta.get("format", FEATURES_FORMAT) != FEATURES_FORMAT:
                raise ValueError(f"{path}: format {meta['format']!r}, want {FEATURES_FORMAT!r}")
            n, h = t["final"].shape
            layers = meta.get("feature_layers", DEFAULT_LAYERS)
            k = len(layers.split(","))
            self.h, self.k = self.h or h, self.k or k
            self.feature_layers = self.feature_layers or layers
            if layers != self.feature_layers:
                raise ValueError(f"{path}: feature_layers {layers!r}, other files {self.feature_layers!r}")
            starts, ans = np.asarray(t["seq_starts"], np.int64), np.asarray(t["answer_starts"], np.int64)
            if (t["features"].shape != (n, k * h) or t["embeds"].shape != (n, h)
                    or t["tokens"].shape != (n,) or h != self.h or starts[-1] != n
                    or len(ans) != len(starts) - 1 or np.any(np.diff(starts) <= 0)
                    or np.any(ans < starts[:-1]) or np.any(ans > starts[1:])):
                raise ValueError(f"{path}: inconsistent shapes or offsets")
            self.files.append(t)
            seqs.append(np.stack([np.full(len(ans), fi), starts[:-1], starts[1:], ans], 1))
        self.seqs = np.concatenate(seqs).astype(np.int64)
        lm, _ = stio.read(os.path.join(directory, "lm_head.safetensors"))
        if "output_rows" not in lm or lm["output_rows"].shape[1] != self.h:
            raise ValueError(f"{directory}/lm_head.safetensors: no output_rows [V, {self.h}]")
        self.lm_rows = lm["output_rows"]
        self.lm_ids = np.asarray(lm["vocab_ids"], np.int64) if "vocab_ids" in lm else None

    def split(self, val_every):
        """(train, validation) sequence indices: every `val_every`-th sequence (index % val_every
        == val_every - 1) is held out; sequences with no answer row are dropped."""
        s = self.seqs
        useful = np.nonzero(s[:, 3] < s[:, 2])[0]
        held = (useful % val_every) == (val_every - 1) if val_every > 0 else np.zeros(len(useful), bool)
        return useful[~held], useful[held]

    def answer_tokens(self, idx):
        """The answer tokens of sequences `idx`, concatenated (int64)."""
        out = [np.asarray(self.files[f]["tokens"][a:e]) for f, _, e, a in self.seqs[idx]]
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def fr_spec_subset(dump, train_idx, size):
    """The FR-Spec subset (Zhao et al. 2025): the `size` most frequent answer tokens of the
    training sequences, most frequent first (ties by lower id), filled with the lowest unseen ids
    when fewer distinct tokens occur; capped at the vocabulary. With a dump that fixed its
    subset (`lm_ids`), that subset. Returns uint32 `[|S|]`."""
    if dump.lm_ids is not None:
        return dump.lm_ids.astype(np.uint32)
    vocab = dump.lm_rows.shape[0]
    counts = np.bincount(dump.answer_tokens(train_idx), minlength=vocab)[:vocab]
    order = np.lexsort((np.arange(vocab), -counts))
    return order[:min(size, vocab)].astype(np.uint32)


def window(seq, max_len, rng_key):
    """`(start, length)` of the rows of `seq` (a `Dump.seqs` row) that go into a batch: the whole
    sequence when it fits `max_len`, else a `max_len` window starting at a position drawn
    (stateless, from `rng_key`) between the row before the first answer token and the end."""
    _, s, e, a = (int(v) for v in seq)
    n = e - s
    if n <= max_len:
        return 0, n
    lo = min(max(a - s - 1, 0), n - max_len)
    off = int(np.random.default_rng(rng_key).integers(0, n - max_len - lo + 1))
    return lo + off, max_len


class Packer:
    """Packs sequences into batches of `rows` rows of `length` positions, in a shuffled order per
    epoch (`np.random.default_rng([seed, epoch])`), with a cursor `(epoch, pos)` that fully
    determines the next batch (checkpointed for a bit-exact resume). `shuffle=False` walks
    `idx` once in order (validation)."""

    def __init__(self, dump, idx, rows, length, seed, shuffle=True):
        self.dump, self.idx, self.rows, self.length = dump, np.asarray(idx), rows, length
        self.seed, self.shuffle = seed, shuffle
        self.cursor = (0, 0)
        self._perm_epoch, self._perm = None, None

    def _order(self, epoch):
        if self._perm_epoch != epoch:
            self._perm_epoch = epoch
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(self.idx)
                          if self.shuffle else self.idx)
        return self._perm

    def next(self):
        """The next batch (`Packer.empty` layout), or None after one pass when not shuffling."""
        epoch, pos = self.cursor
        if not self.shuffle and pos >= len(self.idx):
            return None
        b, r, fill = self.empty(), 0, 0
        seg = 0
        while True:
            order = self._order(epoch)
            if pos >= len(order):
                if not self.shuffle:
                    break
                epoch, pos = epoch + 1, 0
                continue
            si = int(order[pos])
            start, n = window(self.dump.seqs[si], self.length, [self.seed, epoch, si, 7])
            if fill + n > self.length:
                r, fill = r + 1, 0
                if r == self.rows:
                    break
            seg += 1
            self._place(b, r, fill, si, start, n, seg)
            fill += n
            pos += 1
        self.cursor = (epoch, pos)
        return b

    def empty(self):
        """Zeroed batch arrays: `feat_prev [R, L, k h]` f16 (features of the previous position, 0
        at a sequence's position 0), `emb [R, L, h]` f16, `final [R, L, h]` f16, `pos [R, L]`
        int32 (position in the sequence), `seg [R, L]` int32 (0 = padding, else a sequence id
        unique in the batch), `lmask [R, L]` bool (rows that count in the loss)."""
        h, shape = self.dump.h, (self.rows, self.length)
        return {"feat_prev": np.zeros(shape + (self.dump.k * h,), np.float16),
                "emb": np.zeros(shape + (h,), np.float16),
                "final": np.zeros(shape + (h,), np.float16),
                "pos": np.zeros(shape, np.int32), "seg": np.zeros(shape, np.int32),
                "lmask": np.zeros(shape, bool)}

    def _place(self, b, r, fill, si, start, n, seg):
        f, s, e, a = (int(v) for v in self.dump.seqs[si])
        t = self.dump.files[f]
        lo, sl = s + start, slice(fill, fill + n)
        if start == 0:
            b["feat_prev"][r, fill + 1:fill + n] = t["features"][lo:lo + n - 1]
        else:
            b["feat_prev"][r, sl] = t["features"][lo - 1:lo + n - 1]
        b["emb"][r, sl] = t["embeds"][lo:lo + n]
        b["final"][r, sl] = t["final"][lo:lo + n]
        p = np.arange(start, start + n)
        b["pos"][r, sl] = p
        b["seg"][r, sl] = seg
        b["lmask"][r, sl] = (p + 1 >= a - s) & (p + 1 < e - s)


def write_synthetic(directory, *, h=576, vocab=2048, seqs=48, files=2, min_len=24, max_len=160,
                    seed=0):
    """Writes a synthetic dump of exactly the Rust format to `directory` (for tests and the CI
    check): a random embedding table (tied output rows), tokens from a random chain (each token
    has a preferred successor, taken 70 % of the time), target final states pointing at the
    preferred successor (so the head has something to learn), features = noisy functions of the
    embeddings and the final states; the Rust dump's metadata (`format`, `feature_layers`
    "2,15,27", `first_record`, `records`). Deterministic in `seed`. Returns `directory`."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    table = (rng.standard_normal((vocab, h)) / np.sqrt(h) * 4).astype(np.float32)
    succ = rng.integers(0, vocab, vocab)
    mix = (rng.standard_normal((h, h)) / np.sqrt(h)).astype(np.float32)
    per = -(-seqs // files)
    for fi in range(files):
        toks, starts, answers = [], [0], []
        count = min(per, seqs - fi * per)
        for _ in range(count):
            n = int(rng.integers(min_len, max_len + 1))
            x = [int(rng.integers(0, vocab))]
            for _ in range(n - 1):
                x.append(int(succ[x[-1]]) if rng.random() < 0.7 else int(rng.integers(0, vocab)))
            answers.append(starts[-1] + int(rng.integers(1, n // 2 + 1)))
            starts.append(starts[-1] + n)
            toks.extend(x)
        toks = np.asarray(toks, np.int64)
        emb = table[toks]
        fin = table[succ[toks]] * 3 + 0.5 * rng.standard_normal((len(toks), h)).astype(np.float32)
        fin /= np.sqrt((fin * fin).mean(-1, keepdims=True) + 1e-5)
        a = emb + 0.1 * rng.standard_normal(emb.shape).astype(np.float32)
        feats = np.concatenate([a, np.tanh(a @ mix), fin + 0.1 * rng.standard_normal(fin.shape)], 1)
        stio.write(os.path.join(directory, f"features-{fi:05d}.safetensors"), {
            "tokens": toks.astype(np.uint32), "seq_starts": np.asarray(starts, np.uint32),
            "answer_starts": np.asarray(answers, np.uint32),
            "features": feats.astype(np.float16), "final": fin.astype(np.float16),
            "embeds": emb.astype(np.float16)}, {
            "format": FEATURES_FORMAT, "feature_layers": DEFAULT_LAYERS,
            "first_record": fi * per, "records": count})
    stio.write(os.path.join(directory, "lm_head.safetensors"),
               {"output_rows": table.astype(np.float16)}, {"format": "speculative-output-rows-v1"})
    return directory
