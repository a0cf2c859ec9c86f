#!/usr/bin/env bash
# The GPU proof, in one call on a machine with one NVIDIA GPU (made for the H200 lent here: python 3.12, torch with
# CUDA, nvcc, no network). It installs the carried wheels (.whl/, from tools/gpu_wheels.sh) with pip --no-index, then
# runs these groups of stages, in this order:
#   ops:      builds megatron_rlvr._C for sm_90 only; the CUDA tests (both kernels of the op; SDPA under flash);
#             HBM bandwidth (the bytes-read bound); the op bench at T=16384, V=151936, fp32 and bf16: the default
#             (scalar) kernel and the vector one side by side, against the composite and the logsumexp floor
#   actor:    MegatronActor on one rank: a small random Qwen2 on CUDA (SDPA attention) and on the CPU (unfused; same
#             seeds; statistics pass and two CaSP updates, fp32 and bf16, padded and packed) compared within each
#             dtype's tolerance; then a random ~1B Qwen2 in bf16 on CUDA: tokens/s, MFU and peak memory per layout,
#             with SDPA and again with megatron's unfused attention
#   drift:    the small model's CUDA half again with cuBLAS's reduced-precision bf16 sums off, against the same CPU
#             half: is that why CUDA's bf16 drifts further from fp32 than the CPU's?
#   variants: one CaSP update with a KL reference, on CUDA and on the CPU: LoRA (rank 8; the reference is the base)
#             and full fine-tuning with a frozen reference copy; the reference must not move
#   bridge:   export of the ~1B model from CUDA to HF layout: bytes/s, bit-exact against the checkpoint files and
#             against the model's own state dict
# Each stage runs under its own timeout inside one budget (GPU_CHECK_BUDGET_S, default 450 s); a failed stage is
# recorded with its log tail and the next one runs. Every figure lands in $OUT/gpu_check.json (OUT defaults to
# $GPU_CHECK_WORK/out) and a summary table is printed at the end.
#
#   bash tools/gpu_check.sh             # on the GPU machine (the device tool: carry [".whl"], timeout_s 480)
#   bash tools/gpu_check.sh --dry-run   # anywhere: wheels, every script's imports and arguments, no CUDA needed
# GPU_CHECK_ONLY="actor bridge" runs only those groups: a rerun on a warm machine.
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
BUDGET=${GPU_CHECK_BUDGET_S:-450}
ONLY=${GPU_CHECK_ONLY:-ops actor drift variants bridge}
RESERVE=15  # seconds kept for the summary
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET))
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$WORK" "$OUT_DIR"
rm -f "$WORK"/stages.jsonl "$WORK"/*.log "$WORK"/*.json "$WORK"/*.xml "$WORK"/dry_run.txt

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
MODEL_PID=""
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
# The CPU halves of the comparisons run beside the GPU stages, in two background chains of 4 threads each.
G_SMALL=("$PY" $G/actor_check.py --model small --mode compare)
G_VARIANT=(--dtypes float32,bfloat16 --layouts packed --steps 1 --kl-coef 0.1)  # one CaSP update with a KL term
G_LORA=(--lora-rank 8)
cpu_half() {  # cpu_half NAME ARGS...: a CPU run of actor_check (its stage NAME), the GPU hidden
    local name=$1
    shift
    if ((DRY)); then
        stage "$name" 240 env CUDA_VISIBLE_DEVICES= "${G_SMALL[@]}" --device cpu "$@" \
            --out "$WORK/$name.json" --tensors "$WORK/$name.pt"
    else
        BG=1 stage "$name" 240 env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 "${G_SMALL[@]}" --device cpu "$@" \
            --out "$WORK/$name.json" --tensors "$WORK/$name.pt"
    fi
}
cuda_half() {  # cuda_half NAME ARGS...: the same on CUDA
    local name=$1
    shift
    stage "$name" 150 "${G_SMALL[@]}" --device cuda "$@" --out "$WORK/$name.json" --tensors "$WORK/$name.pt"
}
compare_halves() {  # compare_halves NAME CUDA_RUN CPU_RUN
    stage "$1" 30 "$PY" $G/compare.py --cuda "$WORK/$2.json" --cpu "$WORK/$3.json" --out "$WORK/$1.json"
}
in_background() {  # runs "$@" in the background (in the dry run, in place); its pid in BG_PID
    if ((DRY)); then "$@"; BG_PID=""; else "$@" & BG_PID=$!; fi
}
cpu_variants() {
    cpu_half actor_lora_cpu "${G_VARIANT[@]}" "${G_LORA[@]}"
    cpu_half actor_reference_cpu "${G_VARIANT[@]}"
}
CPU_PID="" VARIANTS_PID=""
if wants actor || wants drift; then
    in_background cpu_half actor_small_cpu
    CPU_PID=$BG_PID
fi
if wants variants; then
    in_background cpu_variants
    VARIANTS_PID=$BG_PID
fi
wait_for() { ((DRY)) || [ -z "$1" ] || wait "$1" 2>/dev/null; }  # a second wait on one pid is harmless

if wants ops; then
    stage gpu_tests 150 "$PY" -m pytest tests/integration/ops/test_token_stats.py tests/integration/models/test_sdpa_attention.py -m gpu -q \
        -p no:cacheprovider --junitxml="$WORK/gpu_tests.xml"
    stage bandwidth 60 "$PY" $G/bandwidth.py --out "$WORK/bandwidth.json"
    # the vector kernel is timed beside the default only once its tests passed: a kernel that faults would take the
    # whole bench (and its figures of the default kernel) down with it
    ALSO=(--also cuda-vector)
    if ((!DRY)) && ! "$PY" $G/summary.py --work "$WORK" --out /dev/null --passed-tests vector >/dev/null 2>&1; then
        echo "gpu_check: the vector kernel did not pass its CUDA tests (gpu_tests.xml): the bench times the default only"
        ALSO=()
    fi
    stage op_bench 180 "$PY" tools/benches/bench_token_stats.py --device cuda --tp 1 --tokens 16384 --vocab 151936 \
        --dtypes float32,bfloat16 --repeats 5 "${ALSO[@]}"
fi

# --- the actor, its bf16 drift, LoRA and the reference, the bridge ------------------------------------------------
if wants actor || wants drift || wants variants || wants bridge; then
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
    cuda_half actor_small_cuda
    wait_for "$CPU_PID"
    compare_halves actor_compare actor_small_cuda actor_small_cpu
    wait_for "$MODEL_PID"
    # 32 rollouts, prompts of 256, responses of 64..1792 tokens: micro-batches of 4 (padded: [4, 2048] blocks)
    G_1B=("$PY" $G/actor_check.py --model 1b --mode throughput --device cuda --sequences 32 --prompt-len 256
        --min-response 64 --max-response 1792 --micro-batch-size 4 --lr 1e-4)
    stage actor_1b 240 "${G_1B[@]}" --layouts padded,packed,packed_budget --out "$WORK/actor_1b.json"
    stage actor_1b_unfused 180 "${G_1B[@]}" --core-attention unfused --layouts padded,packed \
        --out "$WORK/actor_1b_unfused.json"
fi
if wants drift; then
    cuda_half actor_small_cuda_fp32sum --no-reduced-precision-bf16
    wait_for "$CPU_PID"
    compare_halves actor_compare_fp32sum actor_small_cuda_fp32sum actor_small_cpu
fi
if wants variants; then
    cuda_half actor_lora_cuda "${G_VARIANT[@]}" "${G_LORA[@]}"
    cuda_half actor_reference_cuda "${G_VARIANT[@]}"
    wait_for "$VARIANTS_PID"
    compare_halves actor_compare_lora actor_lora_cuda actor_lora_cpu
    compare_halves actor_compare_reference actor_reference_cuda actor_reference_cpu
fi
if wants bridge; then
    wait_for "$MODEL_PID"
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
