#!/usr/bin/env bash
# The README's test command: set up .venv/ (made if missing, reused if present), build, and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --timeout is a per-test backstop on top of the worker groups' own hang detection.
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --timeout=1200 "$@"
