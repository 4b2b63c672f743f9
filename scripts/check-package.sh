#!/usr/bin/env bash
# Checks what `cargo package` would publish: for every publishable crate of the workspace (every
# member without `publish = false`), each file of `cargo package --list` must match a pattern of
# scripts/package-allowlist-<crate>.txt, and each pattern without a wildcard (a file every
# package must ship, such as the licences) must be listed. Exits non-zero on any difference.
# Allow-list format: one bash glob per line (`*` also matches `/`), `#` starts a comment.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
status=0
checked=0
for manifest in Cargo.toml crates/*/Cargo.toml; do
    # The package name is the first `name = "..."` after the `[package]` header.
    name="$(sed -n '/^\[package\]/,/^\[/{s/^name *= *"\([^"]*\)".*/\1/p}' "$manifest" | head -n 1)"
    [ -n "$name" ] || continue
    if sed -n '/^\[package\]/,/^\[/p' "$manifest" | grep -q '^publish *= *false'; then
        continue
    fi
    allow="scripts/package-allowlist-$name.txt"
    if [ ! -f "$allow" ]; then
        echo "check-package: $name is publishable but $allow is missing" >&2
        status=1
        continue
    fi
    mapfile -t patterns < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$allow")
    mapfile -t files < <(cargo package -p "$name" --list --allow-dirty --quiet)
    if [ "${#files[@]}" -eq 0 ]; then
        echo "check-package: cargo package --list gave no files for $name" >&2
        status=1
        continue
    fi
    for f in "${files[@]}"; do
        ok=0
        for p in "${patterns[@]}"; do
            # shellcheck disable=SC2053 # $p is a glob on purpose
            if [[ "$f" == $p ]]; then
                ok=1
                break
            fi
        done
        if [ "$ok" -eq 0 ]; then
            echo "check-package: $name would publish $f, which $allow does not allow" >&2
            status=1
        fi
    done
    for p in "${patterns[@]}"; do
        case "$p" in
            *[\*\?\[]*) ;;
            *)
                if ! printf '%s\n' "${files[@]}" | grep -qxF -- "$p"; then
                    echo "check-package: $name does not ship $p (required by $allow)" >&2
                    status=1
                fi
                ;;
        esac
    done
    echo "check-package: $name: ${#files[@]} files checked against $allow"
    checked=$((checked + 1))
done
if [ "$checked" -eq 0 ] && [ "$status" -eq 0 ]; then
    echo "check-package: no publishable crate found" >&2
    status=1
fi
exit "$status"
