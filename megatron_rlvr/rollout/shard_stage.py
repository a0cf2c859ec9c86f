"""The "full" staging of a weight sync that holds one engine-TP shard: check the whole stream, keep only the slice
this engine rank loads, hand it to the engine after the stream ended without a problem.

Contract (``rollout.sync_staging: full``): every tensor of the stream is checked whole, as it arrives, by the
engine's `WeightManifest` (name, shape, floating dtype, nothing twice, nothing missing, a tied lm_head equal to the
embedding). Only the slice that engine TP rank ``rank`` of ``tp`` keeps (``bridge/reshard.engine_shard_region``,
vLLM's own partitioning) is copied out of it, into host memory. The stream is always drained (the bridge's export
and the transfer are collectives); a bad stream raises one `WeightSyncError` naming every problem after its end,
before anything is handed to the engine, so the engine stays as it was. Every rank of one engine sees the same
stream and makes the same checks, so they all accept it or all refuse it.

Staged bytes per rank: (the model's bytes / tp) plus the replicated tensors (norms), counted by `StagedShards.nbytes`
and `peak_bytes`; the caller's bucket (the export's, or the transfer's receive buffer) comes on top.

Handing over: `StagedShards.full_tensors` yields the HF tensors whole in shape, for loaders that slice them for their
TP rank themselves (vLLM's ``load_weights``/``reload_weights``): one tensor at a time, the staged slice written into
its place in a zero-filled tensor of the full shape on the engine's device, dropped once the loader has it (at TP 1 the
staged tensor itself). The rows of other ranks are zeros, which that loader never reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from megatron_rlvr.bridge.reshard import engine_shard_region
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.rollout.weight_manifest import WeightManifest

STAGE_DEVICE = torch.device("cpu")  # the staged shards live in host memory: GPU memory is the scarce one at sync


@dataclass
class _Staged:
    name: str
    shard: torch.Tensor
    full_shape: tuple[int, ...]
    region: tuple[int | None, int, int]  # (dim, start, length) of the shard in the full tensor


@dataclass
class StagedShards:
    """One checked stream's shards for one engine rank, in stream order."""

    items: list[_Staged] = field(default_factory=list)
    nbytes: int = 0  # bytes of the staged shards
    peak_bytes: int = 0  # the most staged bytes held at once (the stream's own bucket not included)

    def shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, this rank's slice), as `bridge/reshard.engine_shard` gives it."""
        for item in self.items:
            yield item.name, item.shard

    def full_tensors(self, device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, a tensor of the full HF shape holding this rank's slice in its place, zeros elsewhere) on
        ``device`` (default: where the shards are), one at a time; each staged shard is released as it is handed
        over, so the stage shrinks while the engine loads."""
        device = torch.device(device) if device is not None else STAGE_DEVICE
        while self.items:
            item = self.items.pop(0)
            dim, start, length = item.region
            if dim is None or tuple(item.shard.shape) == item.full_shape:
                yield item.name, item.shard.to(device, non_blocking=False)
            else:
                full = torch.zeros(item.full_shape, dtype=item.shard.dtype, device=device)
                full.narrow(dim, start, length).copy_(item.shard)
                yield item.name, full
            self.nbytes -= _nbytes(item.shard)


class ShardStage:
    """Stages checked streams for engine TP rank ``rank`` of ``tp`` (see the module docstring)."""

    def __init__(self, manifest: WeightManifest, dims: ModelDims, tp: int, rank: int) -> None:
        if not 0 <= rank < tp:
            raise ValueError(f"ShardStage: engine tp rank {rank} is not in [0, {tp})")
        self.manifest, self.dims, self.tp, self.rank = manifest, dims, tp, rank

    def stage(self, weights: Iterable[tuple[str, torch.Tensor]]) -> StagedShards:
        """Check the whole stream and keep this rank's slices (copies: the stream's tensors may be lent views).
        Raises WeightSyncError after draining the stream if any tensor is bad; nothing is kept then."""
        staged = StagedShards()
        for name, tensor in self.manifest.checked(weights):
            region = engine_shard_region(name, tensor.shape, self.dims, self.tp, self.rank)
            dim, start, length = region
            piece = tensor if dim is None else tensor.narrow(dim, start, length)
            copy = torch.empty(piece.shape, dtype=piece.dtype, device=STAGE_DEVICE)
            copy.copy_(piece)
            staged.items.append(_Staged(name, copy, tuple(tensor.shape), region))
            staged.nbytes += _nbytes(copy)
            staged.peak_bytes = max(staged.peak_bytes, staged.nbytes)
        return staged


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
