"""Which implementation of the shard pass runs: a CUDA kernel, the C++ CPU kernel, or the torch reference.

`resolve(device, requested, top_n)` picks one. "auto" (the default) means the CUDA kernel for CUDA tensors and the
C++ kernel for CPU tensors; when the extension `megatron_rlvr._C` is missing (or was built without CUDA) the
reference runs and a one-line warning says so, once. The environment variable MEGATRON_RLVR_TOKEN_STATS_IMPL
(auto | reference | cpp | cuda | cuda-scalar | cuda-vector) overrides the default, e.g. to test the fallback.

CUDA has two kernels of one contract: "scalar" (one element per load, the top-N merged in N rounds of block argmax;
the first to pass on a GPU) and "vector" (128-bit loads, the top-N merged in registers; written to run at the bound
of reading the logits once). "cuda" means CUDA_KERNEL, the default, until a GPU run passes the vector kernel's tests
and bench. Every implementation writes the same records (records.py) and the same gradient, through
`shard_forward` / `shard_backward`.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

from megatron_rlvr.ops import reference

CUDA_KERNELS = ("scalar", "vector")
CUDA_KERNEL = "scalar"  # what "cuda" and "auto" run on CUDA tensors
IMPLEMENTATIONS = ("auto", "reference", "cpp", "cuda") + tuple(f"cuda-{k}" for k in CUDA_KERNELS)
ENV_VAR = "MEGATRON_RLVR_TOKEN_STATS_IMPL"
CUDA_MAX_TOP_N = 32  # the CUDA kernels keep the per-thread top-N in registers

_warned: set[str] = set()


def _load_extension() -> tuple[ModuleType | None, str]:
    try:
        from megatron_rlvr import _C
    except ImportError as exc:
        return None, str(exc)
    return _C, ""


_C, _C_IMPORT_ERROR = _load_extension()


def extension() -> ModuleType | None:
    """The compiled extension, or None when it is not built."""
    return _C


def reset_warnings() -> None:
    """Forget which one-line warnings were given: the next occurrence of each warns again."""
    _warned.clear()


def warn_once(message: str, stacklevel: int = 4, key: str | None = None) -> None:
    """One line, once per process per `key` (default: the message); these would fire on every step otherwise."""
    key = message if key is None else key
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def resolve(device: torch.device, requested: str | None, top_n: int, extension: ModuleType | None = _C) -> str:
    """The implementation that will run: "reference", "cpp", "cuda-scalar" or "cuda-vector". ``extension``: the
    compiled kernels to choose from (default: `megatron_rlvr._C` as this process imported it; None, as where it is
    not built)."""
    choice = requested or os.environ.get(ENV_VAR, "auto") or "auto"
    if choice not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: expected one of {IMPLEMENTATIONS} (argument or ${ENV_VAR}), got {choice!r}")
    if choice == "reference":
        return choice
    if choice == "cpp" and device.type != "cpu":
        raise ValueError(f"implementation 'cpp' runs on CPU tensors; the logits are on {device}")
    if choice.startswith("cuda") and device.type != "cuda":
        raise ValueError(f"implementation {choice!r} runs on CUDA tensors; the logits are on {device}")
    kernel = choice if choice.startswith("cuda-") else f"cuda-{CUDA_KERNEL}"
    wanted = kernel if device.type == "cuda" else "cpp" if device.type == "cpu" else None
    if wanted is None:
        warn_once(f"vocab_parallel_token_stats: no kernel for device {device.type}; using the torch reference")
        return "reference"
    if extension is None:
        if choice != "auto":
            why = f": {_C_IMPORT_ERROR}" if _C_IMPORT_ERROR else ""
            raise RuntimeError(f"implementation {choice!r} requested but megatron_rlvr._C is missing{why}")
        warn_once(
            "vocab_parallel_token_stats: megatron_rlvr._C is not built (pip install -e . builds it); using the "
            "slower torch reference"
        )
        return "reference"
    if wanted == kernel and not extension.has_cuda():
        if choice != "auto":
            raise RuntimeError(f"implementation {choice!r} requested but megatron_rlvr._C was built without CUDA")
        warn_once("vocab_parallel_token_stats: megatron_rlvr._C was built without CUDA; using the torch reference")
        return "reference"
    if wanted == kernel and top_n > CUDA_MAX_TOP_N:
        warn_once(f"vocab_parallel_token_stats: top_n > {CUDA_MAX_TOP_N} has no CUDA kernel; using the reference")
        return "reference"
    return wanted


def _cuda_kernel(impl: str) -> str:
    """The extension's name of the CUDA kernel ``impl`` runs ("cpp" passes the default, which CPU tensors ignore)."""
    return impl.removeprefix("cuda-") if impl.startswith("cuda-") else CUDA_KERNEL


def shard_forward(
    impl: str,
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    records: torch.Tensor,
    *,
    top_n: int,
    vocab_start: int,
    n_valid: int,
    inv_temperature: float,
    chunk_tokens: int | None,
) -> None:
    """Fill records [T, 4+2N] (float64) for logits [T, V_local] (contiguous) and target_ids [T] (int64)."""
    if impl == "reference":
        reference.shard_records(
            logits,
            target_ids,
            records,
            top_n=top_n,
            vocab_start=vocab_start,
            n_valid=n_valid,
            inv_temperature=inv_temperature,
            chunk_tokens=chunk_tokens,
        )
    else:
        _C.token_stats_forward(
            logits, target_ids, records, top_n, vocab_start, n_valid, inv_temperature, _cuda_kernel(impl)
        )


def shard_backward(
    impl: str,
    logits: torch.Tensor,
    grad_out: torch.Tensor,
    target_ids: torch.Tensor,
    topn_ids: torch.Tensor,
    logz: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
    grad_topn: torch.Tensor,
    *,
    vocab_start: int,
    n_valid: int,
    inv_temperature: float,
    chunk_tokens: int | None,
) -> None:
    """Write dL/dlogits into grad_out [T, V_local] (may alias logits); small inputs in the statistics' dtype."""
    if impl == "reference":
        reference.shard_backward(
            logits,
            grad_out,
            target_ids,
            topn_ids,
            logz,
            entropy,
            grad_logp,
            grad_entropy,
            grad_topn,
            vocab_start=vocab_start,
            n_valid=n_valid,
            inv_temperature=inv_temperature,
            chunk_tokens=chunk_tokens,
        )
    else:
        _C.token_stats_backward(
            logits,
            grad_out,
            target_ids,
            topn_ids,
            logz,
            entropy,
            grad_logp,
            grad_entropy,
            grad_topn,
            vocab_start,
            n_valid,
            inv_temperature,
            _cuda_kernel(impl),
        )
