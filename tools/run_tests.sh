#!/usr/bin/env bash
# The README's test command: set up .venv/ (made if missing, reused if present), build, check the house rules, and
# run the whole suite. Extra arguments go to pytest (e.g. `bash tools/run_tests.sh tests/algos -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
# The command's own wall time, setup included, printed last whether the tests pass or fail; the exit status stays
# that of the step that ended the command (pytest's, when the tests ran).
START=$SECONDS
wall_time() {
  local status=$? took=$((SECONDS - START))
  printf '[tests] wall time %dm%02ds\n' $((took / 60)) $((took % 60))
  exit $status
}
trap wall_time EXIT
bash tools/env/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The house checks first: seconds each, and a failure names the rule it breaks.
echo "[checks] ruff check, ruff format --check, lint-imports, tools/checks/check_imports.py"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/lint-imports --no-cache
.venv/bin/python tools/checks/check_imports.py
# --timeout is a per-test backstop on top of the worker groups' own hang detection; --durations lists the slowest
# tests, which is where the suite's time goes (the install + tests budget is 30 minutes on 2 cores).
.venv/bin/python -m pytest tests -q -p no:cacheprovider --timeout=1200 --durations=25 "$@"
