"""LoRA adapters on megatron-core's column- and row-parallel linears: ``y = W x + (alpha / r) B A x``, the base W
frozen, A [r, in] and B [out, r] trained. The one home of the adapters' layout: which linears carry one, how A and B
are sharded, their parameter names, and how the forward joins the base's collectives.

Sharding follows the base weight (docs/lora.md):

- **column-parallel** (``linear_qkv``, ``linear_fc1``, an expert's ``linear_fc1``; W split along its rows): B is split
  like W's rows, ``[out / tp, r]`` in Megatron's row order (interleaved q/k/v groups, ``[gate_r; up_r]``); A is whole
  on every rank. The adapter reads the layer's input as the base does: without sequence parallelism one
  ``copy_to_tensor_model_parallel_region`` feeds both, so the base's and the adapter's input gradients are summed by
  the one all-reduce the base did alone; with sequence parallelism the adapter runs ``A`` on this rank's rows and
  gathers the ``[tokens, r]`` result (r / hidden of the base's gather).
- **row-parallel** (``linear_proj``, ``linear_fc2``, an expert's ``linear_fc2``; W split along its columns): A is split
  like W's columns, ``[r, in / tp]``; B is whole. The adapter's partial sum is added to the base's partial output
  before the layer's existing all-reduce (reduce-scatter under sequence parallelism): no collective of its own.
- **experts** (``explicit_expert_comm``: the dispatcher moves tokens over EP / ETP and reduces them) use the expert
  tensor-parallel group in place of TP and never communicate themselves.

The half that is whole on every rank (A of a column linear, B of a row linear) gets a partial gradient on each rank
of the group that splits the base (TP, or ETP for an expert): ``reduce_partial_grads`` sums it once per step, after
the DDP reduction. With ``adapters_off`` (a shared ``AdapterSwitch``) every adapted layer computes its base alone: the
base model, which is what the KL reference is (no second copy of the weights).

Covered: megatron-core's local layer spec (``model.use_transformer_engine: off`` on GPU; the CPU default).
Transformer Engine's fused linears are refused by name (``check_covered``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rlvr.models.family import UnsupportedModelError

# What actor.lora.targets may name: the linears' own megatron-core names, and ``experts`` for every routed expert's
# linear_fc1 and linear_fc2 (the router and the embeddings carry no adapter).
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts")
COLUMN_LINEARS = ("linear_qkv", "linear_fc1")  # W split along its rows (output features)
ROW_LINEARS = ("linear_proj", "linear_fc2")  # W split along its columns (input features)
A_NAME, B_NAME = "lora_A", "lora_B"  # parameter names on the adapted linear: ``<linear>.lora_A``, ``<linear>.lora_B``


class LoraError(UnsupportedModelError):
    """A LoRA setting the adapters cannot honour (rank, targets, a layer type); the message names the key."""


@dataclass(frozen=True)
class AdapterSpec:
    """What every adapter of a model shares: rank r, alpha (the update is scaled by alpha / r), the dropout on the
    adapter's input, and the linears that carry one (names from ``TARGETS``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_spec(rank: int, alpha: float, dropout: float, targets: list[str] | tuple[str, ...]) -> None:
    """One line for a bad setting (the config's ranges; the layers themselves are checked at install)."""
    if rank < 1:
        raise LoraError(f"actor.lora.rank={rank}: expected an integer >= 1 (0 = no adapters: set actor.lora=null)")
    if alpha <= 0:
        raise LoraError(f"actor.lora.alpha={alpha}: expected > 0 (the update is scaled by alpha / rank)")
    if not 0 <= dropout < 1:
        raise LoraError(f"actor.lora.dropout={dropout}: expected in [0, 1)")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise LoraError(
            f"actor.lora.targets={list(targets)}: unknown {unknown or 'empty list'}; expected some of {list(TARGETS)}"
        )


class AdapterSwitch:
    """On by default; ``adapters_off`` turns every adapter that shares it off for a pass (the base model)."""

    def __init__(self) -> None:
        self.on = True


@contextmanager
def adapters_off(switch: AdapterSwitch) -> Iterator[None]:
    """Every adapted layer computes its base alone inside the block: the model the adapters were installed on."""
    was, switch.on = switch.on, False
    try:
        yield
    finally:
        switch.on = was


@dataclass(frozen=True)
class Adapter:
    """One adapted linear on this rank: its chunk-local module name, whether it is column- or row-parallel, an
    expert's or not, and the group that splits it (TP, or ETP for an expert; None: not split)."""

    name: str  # the linear's name inside its chunk (``decoder.layers.0.mlp.linear_fc1``)
    module: torch.nn.Module
    column: bool
    expert: bool

    @property
    def A(self) -> torch.nn.Parameter:  # noqa: N802 - the paper's name
        return getattr(self.module, A_NAME)

    @property
    def B(self) -> torch.nn.Parameter:  # noqa: N802
        return getattr(self.module, B_NAME)

    @property
    def group(self):
        return self.module.tp_group

    @property
    def split_half(self) -> str:
        """The half split like the base weight (the other is whole on every rank of ``group``)."""
        return B_NAME if self.column else A_NAME


def split_dim(column: bool, half: str) -> int | None:
    """The dimension along which ``half`` is split over the base's group (None: whole on every rank)."""
    if column:
        return 0 if half == B_NAME else None
    return 1 if half == A_NAME else None


def target_of(module_name: str) -> str | None:
    """The ``TARGETS`` entry a linear's name falls under (None: not an adaptable linear)."""
    last = module_name.rsplit(".", 1)[-1]
    if last not in COLUMN_LINEARS + ROW_LINEARS:
        return None
    return "experts" if ".experts." in f".{module_name}" else last


def check_covered(chunks: list[torch.nn.Module], spec: AdapterSpec) -> None:
    """LoRA covers megatron-core's local ColumnParallelLinear / RowParallelLinear; one line for any other layer among
    the targets (Transformer Engine's fused linears, a grouped-GEMM expert layer), and for targets that match no
    layer of this model."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    found = set()
    for chunk in chunks:
        for name, module in chunk.named_modules():
            target = target_of(name)
            if target is None or target not in spec.targets:
                continue
            column = name.rsplit(".", 1)[-1] in COLUMN_LINEARS
            expected = ColumnParallelLinear if column else RowParallelLinear
            if type(module) is not expected:
                raise LoraError(
                    f"actor.lora: {name} is a {type(module).__name__}; the adapters cover megatron-core's "
                    f"{expected.__name__} (the local layer spec): set model.use_transformer_engine=off, or drop "
                    f"{target!r} from actor.lora.targets"
                )
            found.add(target)
    if not found:
        raise LoraError(
            f"actor.lora.targets={list(spec.targets)}: no layer of this model matches; this model has "
            "linear_qkv, linear_proj, linear_fc1, linear_fc2 (and experts when it is a mixture of experts)"
        )


def install(chunks: list[torch.nn.Module], spec: AdapterSpec, switch: AdapterSwitch) -> list[Adapter]:
    """Register A and B (uninitialised: ``init_adapters`` fills them) on every targeted linear of ``chunks`` and
    route its forward through the adapter. The base parameters are left as they are (the caller freezes them)."""
    check_covered(chunks, spec)
    adapters = []
    for chunk in chunks:
        for name, module in list(chunk.named_modules()):
            target = target_of(name)
            if target is None or target not in spec.targets:
                continue
            adapters.append(_attach(name, module, spec, switch, column=name.rsplit(".", 1)[-1] in COLUMN_LINEARS))
    return adapters


def _attach(name: str, lin: torch.nn.Module, spec: AdapterSpec, switch: AdapterSwitch, *, column: bool) -> Adapter:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    weight = lin.weight
    out, inp = weight.shape  # this rank's shard
    a = torch.nn.Parameter(torch.empty(spec.rank, inp, dtype=weight.dtype, device=weight.device))
    b = torch.nn.Parameter(torch.empty(out, spec.rank, dtype=weight.dtype, device=weight.device))
    split = b if column else a
    set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)  # counted once per shard in norms
    expert = bool(getattr(lin, "is_expert", False))
    if expert:
        _count_once_over_etp(a if column else b, lin.tp_group)
    for p in (a, b):
        if expert:
            p.allreduce = False  # megatron's mark of an expert parameter: reduced over the expert-data-parallel group
    lin.register_parameter(A_NAME, a)
    lin.register_parameter(B_NAME, b)
    original = lin._forward_impl
    lin._forward_impl = (_column_forward if column else _row_forward)(lin, original, spec, switch)
    return Adapter(name, lin, column, expert)


def _count_once_over_etp(whole: torch.nn.Parameter, group) -> None:
    """megatron's gradient norm counts a parameter that is not ``tensor_model_parallel`` on dense-TP rank 0 only (as a
    replica over TP), with every parameter of the expert optimizer too. An expert adapter's whole half is a replica
    over its ETP group instead: counted that way it was summed once per ETP rank at TP = 1 (a norm 0.9% high at
    ETP = 2 on the tiny MoE) and dropped by every TP rank but 0 at TP > 1. So it counts on ETP rank 0 (every dense-TP
    rank) and is ``shared`` (never counted) on the other ETP ranks: once per expert, as the norm and clipping need."""
    if group is None or group.rank() == 0:
        whole.tensor_model_parallel = True
    else:
        whole.shared = True


def _adapter_input(lin, spec: AdapterSpec, x: torch.Tensor) -> torch.Tensor:
    """``dropout(x) A^T``: [tokens, r]."""
    if spec.dropout and lin.training:
        x = torch.nn.functional.dropout(x, spec.dropout)
    return torch.matmul(x, getattr(lin, A_NAME).t())


def _adapter_output(lin, spec: AdapterSpec, h: torch.Tensor) -> torch.Tensor:
    return torch.matmul(h, getattr(lin, B_NAME).t()) * spec.scale


def _column_forward(lin, original: Callable, spec: AdapterSpec, switch: AdapterSwitch) -> Callable:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    def forward_impl(input: torch.Tensor, weight: torch.Tensor, **kw: Any) -> torch.Tensor:  # noqa: A002
        if not switch.on:
            return original(input=input, weight=weight, **kw)
        group = kw["tp_group"]
        if kw["allreduce_dgrad"]:
            # TP > 1 without sequence parallelism: one identity whose backward all-reduces the input gradient of
            # the base and the adapter together, in place of the base's own all-reduce of its part
            x = copy_to_tensor_model_parallel_region(input, group=group)
            base = original(input=x, weight=weight, **(kw | {"allreduce_dgrad": False}))
            h = _adapter_input(lin, spec, x)
        elif kw["sequence_parallel"]:
            # this rank's rows through A, then the [tokens, r] rows of every rank (backward: reduce-scatter)
            base = original(input=input, weight=weight, **kw)
            h = gather_from_sequence_parallel_region(_adapter_input(lin, spec, input), True, group)
        else:  # TP = 1, or an expert: the dispatcher gathers the tokens and reduces their gradients
            base = original(input=input, weight=weight, **kw)
            h = _adapter_input(lin, spec, input)
        return base + _adapter_output(lin, spec, h)

    return forward_impl


def _row_forward(lin, original: Callable, spec: AdapterSpec, switch: AdapterSwitch) -> Callable:
    def forward_impl(input: torch.Tensor, weight: torch.Tensor, **kw: Any) -> torch.Tensor:  # noqa: A002
        base = original(input=input, weight=weight, **kw)
        if not switch.on:
            return base
        # a partial sum over the group, like the base's: the layer's all-reduce / reduce-scatter adds both
        return base + _adapter_output(lin, spec, _adapter_input(lin, spec, input))

    return forward_impl


def full_shape(adapter: Adapter, half: str) -> tuple[int, int]:
    """The half's shape over the whole group (Megatron's order along the split dimension)."""
    p = getattr(adapter.module, half)
    dim = split_dim(adapter.column, half)
    size = adapter.group.size() if adapter.group is not None else 1
    shape = list(p.shape)
    if dim is not None:
        shape[dim] *= size
    return tuple(shape)


def shard_of(adapter: Adapter, half: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole-group tensor ``full`` of ``half`` (a view)."""
    dim = split_dim(adapter.column, half)
    if dim is None or adapter.group is None or adapter.group.size() == 1:
        return full
    n = full.shape[dim] // adapter.group.size()
    return full.narrow(dim, adapter.group.rank() * n, n)


@torch.no_grad()
def init_adapters(adapters: list[Adapter], global_name: Callable[[Adapter], str], seed: int) -> None:
    """PEFT's default init, the same at every layout: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with
    a = sqrt(5)) drawn whole from a generator seeded by the linear's global name, and this rank's part kept; B = 0,
    so the first forward is the base's, bit for bit."""
    for adapter in adapters:
        shape = full_shape(adapter, A_NAME)
        g = torch.Generator().manual_seed(_name_seed(seed, global_name(adapter)))
        bound = 1.0 / math.sqrt(shape[1])
        full = torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=g)
        adapter.A.copy_(shard_of(adapter, A_NAME, full))
        adapter.B.zero_()


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def reduce_partial_grads(adapters: list[Adapter], grad_of: Callable[[torch.nn.Parameter], torch.Tensor | None]) -> None:
    """Sum the gradient of each adapter's whole half over the group that splits its base (see the module
    docstring): one coalesced all-reduce per group. ``grad_of`` reads a parameter's gradient buffer (DDP's
    ``main_grad``)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_group: dict[Any, list[torch.Tensor]] = {}
    for adapter in adapters:
        if adapter.group is None or adapter.group.size() == 1:
            continue
        whole = adapter.A if adapter.column else adapter.B
        grad = grad_of(whole)
        if grad is not None:
            by_group.setdefault(adapter.group, []).append(grad)
    for group, grads in by_group.items():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)
