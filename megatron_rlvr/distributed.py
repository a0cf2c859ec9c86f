"""Process groups, megatron-core parallel state and seeding (the split into actor and engine roles builds on it in
`roles`); and the ONLY place that makes megatron-core run on CPU.

On GPU machines this is a thin layer: NCCL process group, `parallel_state.initialize_model_parallel`, megatron's
CUDA RNG tracker. On machines without CUDA (the demo and the tests), megatron-core 0.16 still assumes CUDA in a
few places; `apply_cpu_shims()` routes each of them to the CPU. Every shim names the call sites it serves, is
applied only when CUDA is absent, and no other module of this project knows about any of them.
"""

from __future__ import annotations

import datetime
import functools
import os
import random
import sys
import types
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

_SHIMS_APPLIED = False


# ---------------------------------------------------------------------------------------------------------------
# CPU shims


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, an int index, a cuda torch.device) to the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _with_cpu_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _CpuCudaModule(types.ModuleType):
    """Stands in for ``torch.cuda`` inside selected megatron modules: devices are the CPU, RNG is the CPU RNG."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*_args: Any, **_kwargs: Any) -> None:
        return None

    @staticmethod
    def is_available() -> bool:
        return False

    # megatron's RNG tracker keeps one generator state per named stream and swaps it in and out of "the CUDA
    # generator"; on CPU the CPU default generator plays that role.
    get_rng_state = staticmethod(lambda *a, **k: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *a, **k: torch.set_rng_state(state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))
    manual_seed_all = staticmethod(lambda seed: torch.manual_seed(seed))

    class _NullStream:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def wait_stream(self, *_args: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

    Stream = _NullStream

    @staticmethod
    def current_stream(*_args: Any, **_kwargs: Any) -> "_CpuCudaModule._NullStream":
        return _CpuCudaModule._NullStream()

    @staticmethod
    def stream(*_args: Any, **_kwargs: Any):
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def nvtx_range_push(*_args: Any, **_kwargs: Any) -> None:
        return None

    @staticmethod
    def nvtx_range_pop(*_args: Any, **_kwargs: Any) -> None:
        return None


class _CpuTorchModule(types.ModuleType):
    """Stands in for ``torch`` inside selected megatron modules: tensor factories called with a literal
    ``device="cuda"`` (or ``torch.cuda.current_device()``) allocate on the CPU; everything else is real torch."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like", "rand")

    def __init__(self) -> None:
        super().__init__("torch")
        for name in self._FACTORIES:
            setattr(self, name, _with_cpu_device(getattr(torch, name)))
        self.cuda = _CpuCudaModule()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# The megatron-core modules whose code allocates with device="cuda" / torch.cuda.current_device() or calls
# torch.cuda.synchronize / CUDA RNG functions on paths we use. Each entry names what it serves.
_MODULES_ON_CPU_TORCH = {
    # forward_backward_no_pipelining / _with_interleaving: `total_num_tokens = torch.zeros(..., device="cuda")`
    "megatron.core.pipeline_parallel.schedules": "token counter in every schedule",
    # _communicate: shape/recv buffers on torch.cuda.current_device(), torch.cuda.synchronize() after p2p ops
    "megatron.core.pipeline_parallel.p2p_communication": "pipeline send/recv buffers",
    # MegatronOptimizer: found_inf / _scale_one / _dummy_overflow_buf tensors on device='cuda'
    "megatron.core.optimizer.optimizer": "optimizer bookkeeping scalars",
    # DistributedOptimizer: shard buffers on torch.cuda.current_device(), state gather to 'cuda'
    "megatron.core.optimizer.distrib_optimizer": "distributed optimizer buffers",
    # get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 / count_zeros_fp32: norm scalars on device='cuda'
    "megatron.core.optimizer.clip_grads": "gradient norm and clipping",
    # ConstantGradScaler etc.: scale tensors on device='cuda'
    "megatron.core.optimizer.grad_scaler": "loss scale",
    # VocabParallelEmbedding / ColumnParallelLinear weight init and sequence-parallel gather buffers
    "megatron.core.tensor_parallel.layers": "tensor-parallel layer buffers",
    # _gather_along_first_dim / _reduce_scatter_along_first_dim buffers on torch.cuda.current_device()
    "megatron.core.tensor_parallel.mappings": "tensor-parallel collectives",
    # broadcast_data: sizes and flattened data moved to 'cuda'
    "megatron.core.tensor_parallel.data": "batch broadcast",
    # CudaRNGStatesTracker.add/fork and model_parallel_cuda_manual_seed use torch.cuda RNG state
    "megatron.core.tensor_parallel.random": "the model-parallel RNG tracker",
    # barrier paths call torch.cuda.synchronize()
    "megatron.core.parallel_state": "barriers",
    # FullyParallelSaveStrategyWrapper and the async/sync save paths call torch.cuda.synchronize / current_device
    "megatron.core.dist_checkpointing.strategies.fully_parallel": "dist checkpoint save",
    "megatron.core.dist_checkpointing.strategies.torch": "dist checkpoint save",
    "megatron.core.dist_checkpointing.strategies.async_utils": "dist checkpoint save",
    # FileSystemWriterAsync.preload_tensors: torch.cuda.synchronize() before staging tensors for writing
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "dist checkpoint save",
    "megatron.core.dist_checkpointing.exchange_utils": "dist checkpoint exchange buffers",
    # save_state_dict_async_finalize: failure flag all-reduced from torch.cuda.current_device()
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "dist checkpoint finalize",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict": "dist checkpoint state staging",
    "megatron.core.dist_checkpointing.serialization": "dist checkpoint load/save",
    "megatron.core.dist_checkpointing.validation": "dist checkpoint validation",
    # DistributedDataParallel / ParamAndGradBuffer: grad buffers on torch.cuda.current_device()
    "megatron.core.distributed.distributed_data_parallel": "DDP grad buffers",
    "megatron.core.distributed.param_and_grad_buffer": "DDP grad buffers",
    "megatron.core.distributed.finalize_model_grads": "grad all-reduce scalars",
    # RotaryEmbedding: inv_freq on torch.cuda.current_device()
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "rotary inverse frequencies",
    "megatron.core.models.common.embeddings.rope_utils": "rotary embedding application",
    # GPTModel / LanguageModule helpers that touch torch.cuda
    "megatron.core.models.common.language_module.language_module": "shared embedding all-reduce",
    "megatron.core.utils": "misc helpers (get_model_config, nvtx, memory buffers)",
    "megatron.core.tensor_parallel.utils": "split/gather helpers' buffers",
    "megatron.core.pipeline_parallel.utils": "schedule helpers (streams, nvtx)",
    "megatron.core.models.gpt.gpt_model": "GPTModel forward helpers",
    "megatron.core.transformer.attention": "attention buffers",
    "megatron.core.transformer.dot_product_attention": "attention mask/softmax buffers",
    "megatron.core.transformer.module": "fp16/bf16 module conversions",
    "megatron.core.transformer.transformer_layer": "layer helpers",
    "megatron.core.transformer.utils": "sharded state dict helpers",
    # RerunStateMachine.should_run_forward_backward / validate_result: flags on torch.cuda.current_device()
    "megatron.core.rerun_state_machine": "the rerun/fault-injection state machine in every schedule",
    "megatron.core.timers": "timers' synchronize calls",
    "megatron.core.transformer.transformer_block": "activation buffers",
}


def _is_megatron_caller(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    return frame is not None and frame.f_globals.get("__name__", "").startswith("megatron.core")


def _shim_tensor_methods() -> None:
    # DistributedOptimizer._build_model_and_main_param_groups, Float16OptimizerWithFloat16Params and
    # clip_grads.get_grad_norm_fp32 check `param.type() == 'torch.cuda.FloatTensor'`; optimizer state loading calls
    # `.cuda()`. Only megatron-core callers see CUDA type names / a no-op `.cuda()`; everyone else gets torch's.
    original_type = torch.Tensor.type
    original_cuda = torch.Tensor.cuda

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original_type(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu" and _is_megatron_caller():
            return result.replace("torch.", "torch.cuda.", 1)
        return result

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_megatron_caller():
            return self
        return original_cuda(self, *args, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    torch.Tensor.cuda = cuda  # type: ignore[method-assign]


def _shim_rng_state_setter() -> None:
    # tensor_parallel.random._set_cuda_rng_state indexes torch.cuda.default_generators (empty on CPU) inside a lazy
    # CUDA callback; CudaRNGStatesTracker.fork and checkpointed recomputation call it.
    from megatron.core.tensor_parallel import random as mrandom

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    mrandom._set_cuda_rng_state = set_state
    mrandom._get_cuda_rng_state = get_state


def apply_cpu_shims() -> bool:
    """Make megatron-core run on CPU over gloo. No-op when CUDA is present; idempotent. Returns whether applied."""
    global _SHIMS_APPLIED
    if torch.cuda.is_available():
        return False
    if _SHIMS_APPLIED:
        return True
    import importlib

    cpu_torch = _CpuTorchModule()
    for name in _MODULES_ON_CPU_TORCH:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module that moved in another megatron-core version: nothing to shim there
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = cpu_torch
    _shim_rng_state_setter()
    _shim_tensor_methods()
    _SHIMS_APPLIED = True
    return True


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


def free_port() -> int:
    """A TCP port free on the loopback interface right now (for a rendezvous on this machine)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_model_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    """Set megatron-core's parallel state (TP x PP x DP over the current world) and seed every RNG.

    The data-parallel size is world_size / (tp * pp). Safe to call again with another layout after
    `destroy_model_parallel()`.
    """
    init_process_group()
    apply_cpu_shims()
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(f"tp * pp = {tp} * {pp} must divide the world size {world}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
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

    def __init__(self, tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
        self.tp, self.pp, self.vpp, self.seed = tp, pp, vpp, seed

    def __enter__(self) -> "model_parallel":
        initialize_model_parallel(self.tp, self.pp, self.vpp, self.seed)
        return self

    def __exit__(self, *exc: Any) -> None:
        destroy_model_parallel()
