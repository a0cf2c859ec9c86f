"""What the GPU check's scripts share: the two random Qwen2 models, the process group, timing and the JSON they write.

Each script (actor_check.py, bridge_check.py, bandwidth.py, ...) is one stage of tools/gpu_check.sh: it parses its
arguments with ``build_parser()``, checks what it can without a GPU in ``preflight(args)`` (the dry run calls only
these two), and writes its figures as one JSON object to ``--out``; summary.py gathers them.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

# gpu_check.sh stops a stage that outruns its limit with SIGTERM: every thread's stack goes to the stage's log first,
# so the JSON's log tail says where it hung (an NCCL wait, an import, ...)
faulthandler.register(signal.SIGTERM, chain=True)

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the scripts run from a plain checkout, nothing installed
    sys.path.insert(0, str(REPO))

# A random Qwen2 of ~1.0B parameters (Qwen2.5's vocabulary and head size, tied embeddings like Qwen2.5-0.5B/1.5B):
# embedding 151936 x 2048 = 311M, 16 layers of 44M. Big enough that the GPU, not Python, sets the pace.
MODEL_1B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
# The model both devices run for the CPU-vs-CUDA comparison: small enough for the CPU in seconds, with GQA, q/k/v
# biases, untied embeddings and a vocabulary that is not a multiple of 128 (padding rows in the logits).
MODEL_SMALL: dict[str, Any] = dict(
    vocab_size=4001,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
MODELS = {"1b": MODEL_1B, "small": MODEL_SMALL}
DEFAULT_WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check"))
# Set by gpu_check.sh when the library's own process group cannot run a collective the check needs (pg_probe.py
# says which); the scripts then start the process group with this backend before the library's call, which keeps it.
PG_BACKEND_ENV = "GPU_CHECK_PG_BACKEND"


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of a Qwen2 config (q/k/v biases, RMSNorm weights, tied or untied output layer)."""
    h, f, n, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * f + 2 * h
    return v * h * (1 if cfg["tie_word_embeddings"] else 2) + n * layer + h


def model_dir(name: str, work: Path = DEFAULT_WORK) -> Path:
    """A random HF Qwen2 checkpoint (bf16 safetensors, config.json; no tokenizer: the actor reads token ids only),
    written once per machine: a finished directory holds the marker file ``.complete``."""
    import fcntl
    import shutil

    import torch

    from megatron_rlvr.testing.tiny_models import write_random_hf_checkpoint

    out = work / f"qwen2-{name}"
    work.mkdir(parents=True, exist_ok=True)
    with open(work / f"qwen2-{name}.lock", "w") as lock:  # stages in parallel: one writes, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".complete").is_file():
            shutil.rmtree(out, ignore_errors=True)
            write_random_hf_checkpoint(
                "qwen2", out, dtype=torch.bfloat16, max_shard_size=1 << 30, seed=7, **MODELS[name]
            )
            (out / ".complete").write_text("")
    return out


def init_process_group() -> str:
    """One rank's process group: the library's (nccl with CUDA, else gloo) unless gpu_check.sh set a backend."""
    import torch.distributed as dist

    from megatron_rlvr.runtime import distributed

    backend = os.environ.get(PG_BACKEND_ENV)
    if backend and not dist.is_initialized():
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed.free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(backend=backend)
    distributed.init_process_group()
    return str(dist.get_backend())


class Timer:
    """Wall-clock seconds of a block, the device synchronized on both sides."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.seconds = cuda, 0.0

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def __enter__(self) -> Timer:
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sync()
        self.seconds = time.perf_counter() - self.start


def write_json(path: str | Path, obj: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def environment() -> dict[str, Any]:
    """What ran: torch, CUDA, the GPU, python (the JSON names it beside the figures)."""
    import platform

    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
        }
    try:
        import megatron.core

        env["megatron_core"] = megatron.core.__version__
    except Exception as exc:  # recorded, not fatal: the stage that needs it fails with its own message
        env["megatron_core"] = f"not importable: {exc}"
    return env
