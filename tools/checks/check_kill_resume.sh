#!/usr/bin/env bash
# Interrupt a training run mid-step, rerun the same command, and compare its metrics with an uninterrupted run of
# the same recipe and seed, step by step (relative tolerance 1e-6).
#   bash tools/checks/check_kill_resume.sh [--mode MODE] [OUT_DIR] [STEPS] [SAVE_EVERY] [KILL_AFTER_LOGGED_STEPS] [key=value ...]
# MODE:
#   kill9    (default) kill -9 the whole run; the rerun resumes from the last periodic checkpoint
#   sigterm  SIGTERM to every rank: each finishes its step, a checkpoint of that step is written, the run exits 0
#            (the launcher was not signalled), and the rerun continues from that very step
#   sigterm-all  SIGTERM to torchrun and the ranks together, as Slurm signals the processes of a job step (their
#            verifier workers left out): the ranks get it twice (directly and forwarded by torchrun) and must count
#            it once; torchrun itself exits 1 after forwarding a signal (torch elastic re-raises it), the ranks 0
#   damage   kill -9 (by default after 11 logged steps: two checkpoints), then truncate the newest checkpoint's
#            largest shard: the rerun must name the file, fall back to the previous checkpoint and still match
# key=value arguments are passed to both runs (e.g. algo.drop_uniform_groups=true). PYTHON overrides the interpreter,
# NPROC the number of processes (default 2: the recipe's actor TP=2, or actor.tp=1 beside one engine rank with
# rollout.placement=separate rollout.engine_ranks=1; with rollout.max_staleness=1 a checkpoint also holds the
# rollout sampled ahead, so a kill at any point resumes to the same steps).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=kill9; POS=(); OVERRIDES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) MODE=$2; shift 2 ;;
    --mode=*) MODE=${1#--mode=}; shift ;;
    *=*) OVERRIDES+=("$1"); shift ;;
    *) POS+=("$1"); shift ;;
  esac
done
case "$MODE" in kill9|sigterm|sigterm-all|damage) ;; *) echo "--mode $MODE: expected kill9, sigterm, sigterm-all or damage"; exit 2 ;; esac
DEFAULT_KILL=7; [ "$MODE" = damage ] && DEFAULT_KILL=11
OUT=${POS[0]:-/tmp/kill_resume}; STEPS=${POS[1]:-12}; SAVE=${POS[2]:-5}; KILL_AFTER=${POS[3]:-$DEFAULT_KILL}
PYTHON=${PYTHON:-.venv/bin/python}; NPROC=${NPROC:-2}
rm -rf "$OUT"; mkdir -p "$OUT"
# torchrun gives its workers this long to exit after forwarding a signal, before SIGKILL (default 30 s)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600
train() {
  OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" -m megatron_rlvr.cli \
    train configs/demo_cpu.yaml trainer.steps="$STEPS" checkpoint.save_every="$SAVE" trainer.prompts_per_step=8 \
    trainer.eval_every=0 trainer.tensorboard=false trainer.save_hf=false trainer.output_dir="$1" \
    ${OVERRIDES[@]+"${OVERRIDES[@]}"}
}
# torchrun starts each rank in a session of its own: signalling the run's process group misses the ranks
descendants() { local c; for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }
logged() { [ -f "$OUT/cut/metrics.jsonl" ] && wc -l < "$OUT/cut/metrics.jsonl" || echo 0; }
train "$OUT/full" > "$OUT/full.log" 2>&1
setsid bash -c "$(declare -f train); $(declare -p OVERRIDES); PYTHON=$PYTHON NPROC=$NPROC OUT=$OUT STEPS=$STEPS SAVE=$SAVE \
  train $OUT/cut" > "$OUT/cut1.log" 2>&1 &
PID=$!
until [ "$(logged)" -ge "$KILL_AFTER" ]; do
  kill -0 "$PID" 2>/dev/null || { echo "the interrupted run ended before it could be interrupted"; exit 1; }
  sleep 0.2
done
case "$MODE" in
  kill9|damage)
    kill -9 "$PID" $(descendants "$PID") 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    while pgrep -f "trainer.output_dir=$OUT/cut( |$)" > /dev/null; do sleep 0.2; done
    echo "killed after $(logged) logged steps; checkpoints: $(ls "$OUT/cut/checkpoints" | tr '\n' ' ')" ;;
  sigterm|sigterm-all)
    LAUNCHER=$(pgrep -g "$PID" -f "^[^ ]*python[^ ]* -m torch.distributed.run" | head -1)
    RANKS=$(pgrep -P "$LAUNCHER" | tr '\n' ' ')
    if [ "$MODE" = sigterm ]; then kill -TERM $RANKS; else kill -TERM "$LAUNCHER" $RANKS; fi
    echo "SIGTERM ($MODE) after $(logged) logged steps, to $([ "$MODE" = sigterm-all ] && echo "torchrun $LAUNCHER and ")ranks $RANKS"
    set +e; wait "$PID"; STATUS=$?; set -e
    echo "the signalled run exited with status $STATUS after $(logged) logged steps; checkpoints: $(ls "$OUT/cut/checkpoints" | tr '\n' ' ')"
    grep -o "\[preempt\].*" "$OUT/cut1.log" || true
    STOPPED=$(grep -c "stopped after step $(logged) with its checkpoint" "$OUT/cut1.log" || true)
    [ "$STOPPED" -ge 1 ] || { echo "FAIL: no '[preempt] ... stopped after step $(logged)' line in $OUT/cut1.log"; exit 1; }
    [ -d "$OUT/cut/checkpoints/step-$(printf %06d "$(logged)")" ] || { echo "FAIL: no checkpoint of the stop step"; exit 1; }
    if [ "$MODE" = sigterm ] && [ "$STATUS" -ne 0 ]; then echo "FAIL: the signalled run exited $STATUS, expected 0"; exit 1; fi ;;
esac
if [ "$MODE" = damage ]; then
  LATEST=$(cat "$OUT/cut/checkpoints/latest")
  SHARD=$(ls -S "$OUT/cut/checkpoints/$LATEST"/*.distcp | head -1)
  truncate -s $(( $(stat -c %s "$SHARD") / 2 )) "$SHARD"
  echo "truncated $SHARD to half its size"
fi
set +e; train "$OUT/cut" > "$OUT/cut2.log" 2>&1; STATUS=$?; set -e
echo "rerun of the same command: exit $STATUS"
grep -o "\[checkpoint\].*" "$OUT/cut2.log" || true
[ "$STATUS" -eq 0 ] || { tail -20 "$OUT/cut2.log"; exit 1; }
"$PYTHON" - "$OUT" <<'PY'
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
