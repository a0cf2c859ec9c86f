"""The ONLY place that makes megatron-core run on CPU over gloo.

megatron-core 0.16 still assumes CUDA in a few places (``torch.cuda.current_device()``, the CUDA RNG tracker,
``device="cuda"`` literals, ``Tensor.cuda()``); `apply_cpu_shims()` routes each of them to the CPU. Every shim names
the call sites it serves, is applied only when CUDA is absent, and no other module of this project knows about any
of them (runtime/distributed.py calls `apply_cpu_shims` before it builds megatron's parallel state).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch

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

        def record_event(self, *_args: Any) -> _CpuCudaModule._NullStream:
            return self  # an event that is already complete: its synchronize() returns at once

    Stream = _NullStream

    @staticmethod
    def current_stream(*_args: Any, **_kwargs: Any) -> _CpuCudaModule._NullStream:
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
    # MoEAlltoAllTokenDispatcher: a class-level torch.cuda.Stream() for its device-to-host copies, and the event it
    # records there (docs/moe.md)
    "megatron.core.transformer.moe.token_dispatcher": "MoE all-to-all dispatcher streams",
    # save_to_aux_losses_tracker: per-layer loss values on device="cuda"
    "megatron.core.transformer.moe.moe_utils": "MoE auxiliary-loss tracker",
    # Router.gating: moves a CPU-initialized router weight to torch.cuda.current_device() on first use
    "megatron.core.transformer.moe.router": "MoE router weight placement",
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
    from megatron_rlvr.runtime.cpu.moe import apply_moe_shims

    apply_moe_shims()
    _SHIMS_APPLIED = True
    return True
