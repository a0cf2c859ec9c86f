"""Process groups, megatron-core parallel state and seeding (the split into actor and engine roles builds on it in
`roles`).

On GPU machines this is a thin layer: NCCL process group, `parallel_state.initialize_model_parallel`, megatron's
CUDA RNG tracker. On machines without CUDA (the demo and the tests) it applies `runtime.cpu.shims` first, the one
place that makes megatron-core run on CPU.
"""

from __future__ import annotations

import datetime
import os
import random
import types
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlvr.runtime.cpu.shims import apply_cpu_shims
from megatron_rlvr.runtime.ports import free_port

# ---------------------------------------------------------------------------------------------------------------
# Process groups and megatron parallel state


def backend() -> str:
    # NCCL carries CUDA tensors only; the small CPU flags (finite checks, metric all-reduces) go through gloo
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(timeout_s: float = 600.0) -> None:
    """Initialize torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), once."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:  # a plain single process: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(backend=backend(), timeout=datetime.timedelta(seconds=timeout_s))


def initialize_model_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    seed: int = 1234,
    ep: int = 1,
    etp: int | None = None,
    cp: int = 1,
) -> None:
    """Set megatron-core's parallel state (TP x CP x PP x DP over the current world) and seed every RNG.

    The data-parallel size is world_size / (tp * cp * pp); ``cp`` context-parallel ranks split every sequence
    (docs/context-parallel.md), and gradients reduce over DP x CP. Experts (MoE layers) are laid out separately over
    the same ranks: ``ep`` expert-parallel ranks times ``etp`` expert-tensor-parallel ranks (None: etp = tp) must
    divide dp * cp * tp. Safe to call again with another layout after `destroy_model_parallel()`.
    """
    init_process_group()
    apply_cpu_shims()
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(f"tp * pp * cp = {tp} * {pp} * {cp} must divide the world size {world}")
    if (world // pp) % (ep * (etp or tp)) != 0:
        raise ValueError(f"ep * etp = {ep} * {etp or tp} must divide dp * cp * tp = {world // pp}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    set_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down megatron's parallel state AND the process groups it created: megatron only drops its references,
    and every gloo group keeps three threads alive, so a long-lived worker (the test harness, a notebook) that
    builds models again and again piled up thousands of threads and slowed to a crawl."""
    from megatron.core import parallel_state

    groups = _megatron_groups(parallel_state)
    parallel_state.destroy_model_parallel()
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except ValueError:  # already gone (destroyed elsewhere, or the default group was torn down first)
            pass


def _megatron_groups(module: types.ModuleType) -> list[Any]:
    """The subgroups held by megatron's parallel_state globals (bare, or in lists / tuples / dicts), once each."""
    world = dist.group.WORLD if dist.is_initialized() else None
    found: dict[int, Any] = {}
    for value in vars(module).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, dist.ProcessGroup) and item is not world:
                found[id(item)] = item
    return list(found.values())


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch identically on every rank, and megatron's model-parallel RNG streams
    (different per TP rank where megatron wants it, e.g. dropout inside TP regions)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        # model_parallel_cuda_manual_seed moves the CPU generator on CPU (its "CUDA" RNG is the CPU one):
        # reseed so that code after set_seed sees the same stream whatever the parallel layout.
        torch.manual_seed(seed)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class model_parallel:  # noqa: N801 - used as a context manager, reads like a statement
    """``with model_parallel(tp=2, pp=1): ...`` — parallel state for the block, torn down afterwards (tests, tools)."""

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        vpp: int | None = None,
        seed: int = 1234,
        ep: int = 1,
        etp: int | None = None,
        cp: int = 1,
    ) -> None:
        self.layout = dict(tp=tp, pp=pp, vpp=vpp, seed=seed, ep=ep, etp=etp, cp=cp)

    def __enter__(self) -> model_parallel:
        initialize_model_parallel(**self.layout)
        return self

    def __exit__(self, *exc: Any) -> None:
        destroy_model_parallel()
