#!/usr/bin/env bash
# The GPU proof, in one call on a machine with one NVIDIA GPU (made for the H200 lent here: python 3.12, torch with
# CUDA, nvcc, no network). It installs the carried wheels (.whl/, from tools/gpu_wheels.sh) with pip --no-index, then:
#   1. ops:    builds megatron_rlvr._C for sm_90 only; the op tests on CUDA; HBM bandwidth (the bytes-read bound);
#              the op bench at T=16384, V=151936, fp32 and bf16, against the composite and the logsumexp floor
#   2. actor:  MegatronActor on one rank: a small random Qwen2 on CUDA and on the CPU (same seeds; statistics pass
#              and two CaSP updates, fp32 and bf16, padded and packed) compared within each dtype's tolerance; then
#              a random ~1B Qwen2 in bf16 on CUDA: tokens/s and peak memory per layout
#   3. bridge: export of the ~1B model from CUDA to HF layout: bytes/s, bit-exact against the checkpoint files and
#              against the model's own state dict
# Each stage runs under its own timeout inside one budget (GPU_CHECK_BUDGET_S, default 520 s); a failed stage is
# recorded with its log tail and the next one runs. Every figure lands in $OUT/gpu_check.json (OUT defaults to
# $GPU_CHECK_WORK/out) and a summary table is printed at the end.
#
#   bash tools/gpu_check.sh             # on the GPU machine (the device tool: carry [".whl"], timeout_s 570)
#   bash tools/gpu_check.sh --dry-run   # anywhere: wheels, every script's imports and arguments, no CUDA needed
# GPU_CHECK_ONLY="actor bridge" runs only those groups (ops, actor, bridge): a rerun on a warm machine.
set -uo pipefail  # no -e: a failed stage is recorded and the check goes on
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: tools/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
G=tools/gpu_check
export GPU_CHECK_WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
WORK=$GPU_CHECK_WORK
OUT_DIR=${OUT:-$WORK/out}
BUDGET=${GPU_CHECK_BUDGET_S:-520}
ONLY=${GPU_CHECK_ONLY:-ops actor bridge}
RESERVE=15  # seconds kept for the summary
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET))
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$WORK" "$OUT_DIR"
rm -f "$WORK"/stages.jsonl "$WORK"/*.log "$WORK"/*.json "$WORK"/op_tests.xml "$WORK"/dry_run.txt

wants() { [[ " $ONLY " == *" $1 "* ]]; }

record() {  # record NAME RC SECONDS LIMIT [REASON]
    printf '{"name": "%s", "rc": %d, "seconds": %d, "limit": %d, "reason": "%s"}\n' "$1" "$2" "$3" "$4" "${5:-}" \
        >> "$WORK/stages.jsonl"
}

# stage NAME CAP_S CMD...: CMD under `timeout` (CAP_S, or what is left of the budget), its output to the terminal
# and to $WORK/NAME.log; BG=1 runs it in the background with its output to the log only. In the dry run, a command
# running a script of tools/ goes to the dry-run list (imports and arguments checked by dry_run.py); the rest (pip,
# the build, pytest) is skipped with a message.
stage() {
    local name=$1 cap=$2
    shift 2
    if ((DRY)); then
        local i
        for ((i = 1; i <= $#; i++)); do
            if [[ ${!i} == tools/*.py ]]; then  # one line: the stage, the script, its arguments (tab-separated)
                (IFS=$'\t'; echo "$name"$'\t'"${*:i}") >> "$WORK/dry_run.txt"
                return 0
            fi
        done
        echo "gpu_check --dry-run: skip $name (needs the GPU machine): $*"
        return 0
    fi
    local left=$((DEADLINE - $(date +%s) - RESERVE))
    local limit=$((cap < left ? cap : left))
    if ((limit < 5)); then
        echo "=== gpu_check: $name skipped: the ${BUDGET} s budget is spent ==="
        record "$name" -1 0 0 "budget spent"
        return 1
    fi
    echo "=== gpu_check: $name (limit ${limit} s, $(($(date +%s) - T0)) s in) ==="
    local start rc
    start=$(date +%s)
    if [ "${BG:-0}" = 1 ]; then
        timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
        rc=$?
    else
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
        rc=${PIPESTATUS[0]}
    fi
    record "$name" "$rc" $(($(date +%s) - start)) "$limit"
    echo "=== gpu_check: $name rc=$rc in $(($(date +%s) - start)) s ==="
    return "$rc"
}

# --- 0. the carried wheels -----------------------------------------------------------------------------------
if ((DRY)); then
    # a clean clone (CI) has no .whl/: then only the lock's tags are checked, and the reason is printed
    allow=()
    [ -d .whl ] || { echo "gpu_check --dry-run: .whl/ is absent (git-ignored; tools/gpu_wheels.sh fills it):" \
        "checking the lock's wheel tags only"; allow=(--allow-missing); }
    "$PY" $G/wheels.py --dir .whl "${allow[@]}" || exit 1
else
    "$PY" - <<'PY' || exit 1
import torch
assert torch.cuda.is_available(), "gpu_check: this torch sees no CUDA device"
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
PY
    [ -d .whl ] || { echo "gpu_check: .whl/ is missing: run tools/gpu_wheels.sh here first and carry it (carry [\".whl\"])"; exit 1; }
    SITE=$WORK/site
    stage install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi

# the ~1B checkpoint is written on the CPU while the extension builds
if wants actor || wants bridge; then
    if ((DRY)); then
        stage make_model_1b 240 "$PY" $G/make_model.py --model 1b
    else
        BG=1 stage make_model_1b 240 "$PY" $G/make_model.py --model 1b &
        MODEL_PID=$!
    fi
fi

# --- 1. the op --------------------------------------------------------------------------------------------------
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # sm_90 only: every extra architecture is another compile
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if wants ops || [ ! -f megatron_rlvr/_C.cpython-312-x86_64-linux-gnu.so ]; then
    stage build 330 "$PY" setup.py -q build_ext --inplace
    # torch first: importing it loads libc10, which the extension links against
    ((DRY)) || "$PY" -c "import torch; from megatron_rlvr import _C; assert _C.has_cuda(), 'built without CUDA'; print('gpu_check: extension has its CUDA kernels; CPU kernels:', _C.cpu_isa())"
fi
if wants actor; then  # the CPU half of the comparison runs beside the GPU stages
    if ((DRY)); then
        stage actor_small_cpu 240 env CUDA_VISIBLE_DEVICES= "$PY" $G/actor_check.py --model small --mode compare \
            --device cpu --out "$WORK/actor_small_cpu.json" --tensors "$WORK/actor_small_cpu.pt"
    else
        BG=1 stage actor_small_cpu 240 env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 "$PY" $G/actor_check.py \
            --model small --mode compare --device cpu --out "$WORK/actor_small_cpu.json" \
            --tensors "$WORK/actor_small_cpu.pt" &
        CPU_PID=$!
    fi
fi
if wants ops; then
    stage op_tests 150 "$PY" -m pytest tests/ops/test_token_stats.py -m gpu -q -p no:cacheprovider \
        --junitxml="$WORK/op_tests.xml"
    stage bandwidth 60 "$PY" $G/bandwidth.py --out "$WORK/bandwidth.json"
    stage op_bench 180 "$PY" tools/benches/bench_token_stats.py --device cuda --tp 1 --tokens 16384 --vocab 151936 \
        --dtypes float32,bfloat16 --repeats 5
fi

# --- 2. the actor, 3. the bridge -------------------------------------------------------------------------------
if wants actor || wants bridge; then
    stage pg_probe 60 "$PY" $G/pg_probe.py --out "$WORK/pg_probe.json"
    if ((!DRY)); then
        fallback=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('use_backend') or '')" \
            "$WORK/pg_probe.json" 2>/dev/null)
        if [ -n "$fallback" ]; then
            echo "gpu_check: the library's process group cannot all-reduce every tensor the actor and the bridge" \
                "use (see pg_probe.json); the next stages start it as '$fallback'"
            export GPU_CHECK_PG_BACKEND=$fallback
        fi
    fi
fi
if wants actor; then
    stage actor_small_cuda 150 "$PY" $G/actor_check.py --model small --mode compare --device cuda \
        --out "$WORK/actor_small_cuda.json" --tensors "$WORK/actor_small_cuda.pt"
    ((DRY)) || wait "$CPU_PID"
    stage actor_compare 30 "$PY" $G/compare.py --cuda "$WORK/actor_small_cuda.json" \
        --cpu "$WORK/actor_small_cpu.json" --out "$WORK/actor_compare.json"
fi
if wants actor || wants bridge; then
    ((DRY)) || wait "$MODEL_PID"
fi
if wants actor; then
    # 32 rollouts, prompts of 256, responses of 64..1792 tokens: micro-batches of 4 (padded: [4, 2048] blocks)
    stage actor_1b 240 "$PY" $G/actor_check.py --model 1b --mode throughput --device cuda \
        --layouts padded,packed,packed_budget --sequences 32 --prompt-len 256 --min-response 64 \
        --max-response 1792 --micro-batch-size 4 --lr 1e-4 --out "$WORK/actor_1b.json"
fi
if wants bridge; then
    stage bridge 180 "$PY" $G/bridge_check.py --model 1b --out "$WORK/bridge.json"
fi

# --- the figures ---------------------------------------------------------------------------------------------------
if ((DRY)); then
    stage summary 30 "$PY" $G/summary.py --work "$WORK" --out "$OUT_DIR/gpu_check.json"
    "$PY" $G/dry_run.py "$WORK/dry_run.txt"
    exit $?
fi
"$PY" $G/summary.py --work "$WORK" --out "$OUT_DIR/gpu_check.json" --budget-s "$BUDGET" \
    --total-s $(($(date +%s) - T0))
# every stage's whole log in one file (the device tool returns only the output's tail)
for f in "$WORK"/*.log; do echo "===== $f"; tail -c 1000000 "$f"; done > "$OUT_DIR/gpu_check.log" 2>/dev/null
echo "gpu_check: done in $(($(date +%s) - T0)) s"
