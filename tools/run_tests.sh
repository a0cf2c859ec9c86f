#!/usr/bin/env bash
# The README's test command: set up .venv/ (made if missing, reused if present), build, check the house rules, and
# run the whole suite on both cores. `--tier unit|integration|system` (repeatable) runs one tier of the suite
# (tests/tiers.py); `--tier unit` is the quick loop. Other arguments go to pytest (e.g. `bash tools/run_tests.sh
# tests/unit/algos -x`). MEGATRON_RLVR_TEST_WORKERS sets the number of xdist workers (default 3 on the machine's 2
# cores, see below; 0 runs everything in pytest's own process).
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
ARGS=()
TIERS=
while [ $# -gt 0 ]; do
  case $1 in
    --tier) [ $# -ge 2 ] || { echo "error: --tier needs one of unit, integration, system" >&2; exit 2; }
      ARGS+=("--tier" "$2"); TIERS+=" $2"; shift 2 ;;
    --tier=*) ARGS+=("--tier" "${1#--tier=}"); TIERS+=" ${1#--tier=}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
# On a fresh machine the local Slurm cluster's Debian packages (for the system tier's `slurm` tests) install beside
# the Python stack: apt-get mostly waits on the network and the disk, and the first `slurm` test would wait for it.
SLURM_INSTALL=
SLURM_LOG=${TMPDIR:-/tmp}/megatron-rlvr-slurm-install.log
if [ "$(id -u)" -eq 0 ] && command -v apt-get > /dev/null && { [ -z "$TIERS" ] || [[ " $TIERS " == *" system "* ]]; }; then
  bash tools/env/slurm_cluster.sh install > "$SLURM_LOG" 2>&1 &
  SLURM_INSTALL=$!
fi
bash tools/env/setup_env.sh
if [ -n "$SLURM_INSTALL" ] && ! wait "$SLURM_INSTALL"; then
  echo "[setup] the Slurm packages did not install; the slurm tests will start the cluster and say why. Its log:"
  tail -5 "$SLURM_LOG"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The house checks first: seconds each, and a failure names the rule it breaks.
echo "[checks] ruff check, ruff format --check, lint-imports, tools/checks/check_imports.py"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/lint-imports --no-cache
.venv/bin/python tools/checks/check_imports.py
# Three xdist workers on two cores: much of the suite waits (on its subprocesses' imports, torchrun's grace, Slurm's
# queue, a stalled rank), and a third worker's tests fill those waits: the whole command took 17m25s-19m25s against
# 21m20s-22m02s with two (docs/development.md). tests/parallel.py keeps each file (and the tests sharing the Slurm
# cluster or the converted real model) in one worker and sends the longest first. --timeout is a per-test backstop on
# top of the worker groups' own hang detection; --durations lists the slowest tests, and the summary the time per
# tier (the install + tests budget is 30 minutes on 2 cores).
# the whole of tests/, unless the arguments name a part of it
TARGET=(tests)
for arg in ${ARGS[@]+"${ARGS[@]}"}; do case $arg in tests/*) TARGET=() ;; esac; done
.venv/bin/python -m pytest ${TARGET[@]+"${TARGET[@]}"} -q -p no:cacheprovider -n "${MEGATRON_RLVR_TEST_WORKERS:-3}" --dist loadgroup \
  --timeout=1200 --durations=25 ${ARGS[@]+"${ARGS[@]}"}
