#!/usr/bin/env bash
# Kill -9 a training run mid-step, rerun the same command, and compare its metrics with an uninterrupted run of the
# same recipe and seed, step by step (relative tolerance 1e-6).
#   bash tools/check_kill_resume.sh [OUT_DIR] [STEPS] [SAVE_EVERY] [KILL_AFTER_LOGGED_STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/kill_resume}; STEPS=${2:-12}; SAVE=${3:-5}; KILL_AFTER=${4:-7}
rm -rf "$OUT"; mkdir -p "$OUT"
train() {
  OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 -m megatron_rlvr.cli \
    train configs/demo_cpu.yaml trainer.steps="$STEPS" checkpoint.save_every="$SAVE" trainer.prompts_per_step=8 \
    trainer.eval_every=0 trainer.tensorboard=false trainer.save_hf=false trainer.output_dir="$1"
}
train "$OUT/full" > "$OUT/full.log" 2>&1
setsid bash -c "$(declare -f train); OUT=$OUT STEPS=$STEPS SAVE=$SAVE train $OUT/cut" > "$OUT/cut1.log" 2>&1 &
PID=$!
until [ -f "$OUT/cut/metrics.jsonl" ] && [ "$(wc -l < "$OUT/cut/metrics.jsonl")" -ge "$KILL_AFTER" ]; do
  kill -0 "$PID" 2>/dev/null || { echo "the interrupted run ended before it could be killed"; exit 1; }
  sleep 0.2
done
kill -9 -- -"$PID" 2>/dev/null || true
wait "$PID" 2>/dev/null || true
echo "killed after $(wc -l < "$OUT/cut/metrics.jsonl") logged steps; checkpoints: $(ls "$OUT/cut/checkpoints" | tr '\n' ' ')"
train "$OUT/cut" > "$OUT/cut2.log" 2>&1
echo "rerun of the same command: exit $?"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
load = lambda p: [json.loads(line) for line in open(p)]
full, cut = load(f"{out}/full/metrics.jsonl"), load(f"{out}/cut/metrics.jsonl")
keys = ["reward/mean", "actor/loss", "actor/grad_norm", "loss/entropy", "loss/rank1_prob"]
print("steps in the resumed run's metrics.jsonl:", [m["step"] for m in cut])
bad = 0
for a, b in zip(full, cut):
    same = all(abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(a[k])) for k in keys)
    bad += not same
    print(a["step"], "equal" if same else "DIFFER", {k: (round(a[k], 6), round(b[k], 6)) for k in keys[:3]})
sys.exit(1 if bad or len(full) != len(cut) else 0)
PY
