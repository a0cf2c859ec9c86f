#!/usr/bin/env bash
# GPU check of the fused token-statistics op, for a machine with an NVIDIA GPU and a CUDA build of torch (it
# installs nothing): builds megatron_rlvr._C with its CUDA kernels for this GPU only, runs the op tests on the GPU
# (CUDA kernel vs the dense torch oracle), then the benchmark at T=16384, V=151936, TP=1 in fp32 and bf16.
# Prints its figures; about 5 minutes. Usage: tools/gpu_check.sh   (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
start=$(date +%s)

"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "gpu_check: this torch sees no CUDA device"
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
PY
command -v nvcc >/dev/null || { echo "gpu_check: nvcc is not on PATH (needed to build the CUDA kernels)"; exit 1; }

# Only this GPU's architecture: a full TORCH_CUDA_ARCH_LIST build would take most of the time budget.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
echo "gpu_check: building megatron_rlvr._C for sm ${TORCH_CUDA_ARCH_LIST}"
"$PY" setup.py -q build_ext --inplace > /tmp/gpu_check_build.log 2>&1 || { tail -50 /tmp/gpu_check_build.log; exit 1; }
"$PY" -c "from megatron_rlvr import _C; assert _C.has_cuda(), 'built without CUDA'; print('gpu_check: extension built with CUDA kernels; CPU kernels use', _C.cpu_isa())"
echo "gpu_check: build took $(( $(date +%s) - start )) s"

echo "gpu_check: op tests on the GPU (CUDA kernel vs the dense oracle) and on the CPU"
timeout 300 "$PY" -m pytest tests/ops/test_token_stats.py -q -p no:cacheprovider -x

echo "gpu_check: benchmark T=16384 V=151936 TP=1"
timeout 600 "$PY" tools/bench_token_stats.py --device cuda --tp 1 --tokens 16384 --vocab 151936 --repeats 5
echo "gpu_check: done in $(( $(date +%s) - start )) s"
