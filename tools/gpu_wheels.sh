#!/usr/bin/env bash
# Fetch, on a machine that reaches PyPI, the wheels tools/gpu_check.sh installs on the GPU machine (which reaches
# nothing): exactly the files of tools/gpu_check/wheels.lock (python 3.12, x86-64 Linux), checked against their
# sha256, into .whl/ (git-ignored; the device call carries it: carry [".whl"]). Replaces .whl/ as a whole, so no
# stale second version travels. Usage: tools/gpu_wheels.sh   (PYTHON=... picks the pip; default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
lock=tools/gpu_check/wheels.lock
tmp=$(mktemp -d .whl.tmp.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

grep -v '^\s*#' "$lock" | while read -r req file sha; do
    [ -n "$req" ] || continue
    echo "gpu_wheels: $req"
    # --no-deps: the lock names every wheel the image lacks; pip would otherwise pull torch and friends
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$tmp" "$req"
    [ -f "$tmp/$file" ] || { echo "gpu_wheels: pip fetched $(ls "$tmp") for $req, the lock says $file" >&2; exit 1; }
    got=$(sha256sum "$tmp/$file" | cut -d' ' -f1)
    [ "$got" = "$sha" ] || { echo "gpu_wheels: $file has sha256 $got, the lock says $sha" >&2; exit 1; }
done

rm -rf .whl
mv "$tmp" .whl
trap - EXIT
"$PY" tools/gpu_check/wheels.py --dir .whl
echo "gpu_wheels: .whl/ holds $(du -sh .whl | cut -f1) (the device call carries at most 64 MiB with the tree)"
