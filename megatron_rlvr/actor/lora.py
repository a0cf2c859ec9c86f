"""The actor's LoRA (``actor.lora``, docs/lora.md): adapters on the policy's chunks, the base frozen, and what the
actor does differently because of them.

- **Training.** The base parameters are frozen before DDP wraps the chunks, so DDP's grad buffers and the optimizer
  (distributed or not) hold the adapters alone. After DDP's reduction, each adapter's half that is whole on every
  rank of its base's group gets its partial gradients summed (models/lora.reduce_partial_grads), inside megatron's
  ``finalize_model_grads_func``, so the norm, clipping and the non-finite check see the final gradient.
- **The reference, for free.** ``base()`` turns every adapter off: the KL reference (and PBA's anchor) is the policy's
  own chunks with the adapters off, the base they were installed on; no second copy of the weights.
- **Checkpoints** (``sharded_state``, the actor's `protocols.TrainState`): the adapters alone, keyed by the global
  name of their linear, sharded over the group that splits the base, plus the optimizer's state of them and the
  identity of the base they need (its ``config.json`` and weight files' sizes): a resume onto another base is
  refused in one line.
- **Weights out**: ``lora_scale`` for the bridge's merged export; ``export_adapter`` for the adapter alone in PEFT's
  names (bridge/peft.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from megatron_rlvr.actor.config import LoraConfig
from megatron_rlvr.models.lora import (
    A_NAME,
    B_NAME,
    Adapter,
    AdapterSwitch,
    LoraError,
    adapters_off,
    init_adapters,
    install,
    reduce_partial_grads,
    split_dim,
)

STATE_KEY = "lora"  # the adapters' part of the actor's sharded state


class LoraPolicy:
    """The adapters on this rank's policy chunks (installed at construction; the base is frozen first)."""

    def __init__(
        self, chunks: list[torch.nn.Module], cfg: LoraConfig, hf_dir: str, dist_checkpoint: str | None = None
    ) -> None:
        from megatron_rlvr.bridge.local_params import global_named_params

        self.cfg, self.spec = cfg, cfg.spec()
        for chunk in chunks:
            chunk.requires_grad_(False)  # before DDP: its buffers and the optimizer then hold the adapters alone
        self.switch = AdapterSwitch()
        self.adapters: list[Adapter] = install(chunks, self.spec, self.switch)
        by_id = {id(p): name for name, p in global_named_params(chunks).items()}
        # the global name of each adapted linear (decoder.layers.{global i}..., experts by global index)
        self.names = {id(a.module): by_id[id(a.A)][: -len(A_NAME) - 1] for a in self.adapters}
        init_adapters(self.adapters, lambda a: self.names[id(a.module)], cfg.seed)
        self.hf_dir = hf_dir
        self.base_identity = base_identity(hf_dir, dist_checkpoint or hf_dir)

    @property
    def scale(self) -> float:
        return self.spec.scale

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for a in self.adapters:
            yield a.A
            yield a.B

    def base(self) -> AbstractContextManager[None]:
        """Every adapter off inside the block: the chunks compute the base model (the KL reference)."""
        return adapters_off(self.switch)

    def finalize_grads(self, finalize: Callable[..., Any]) -> Callable[..., Any]:
        """megatron's ``finalize_model_grads`` followed by the sum of the adapters' partial gradients."""

        def finalize_then_sum(*args: Any, **kwargs: Any) -> Any:
            out = finalize(*args, **kwargs)
            reduce_partial_grads(self.adapters, lambda p: getattr(p, "main_grad", None))
            return out

        return finalize_then_sum

    # --- weights out ----------------------------------------------------------------------------------------------
    def export_adapter(
        self, chunks: list[torch.nn.Module], hf: Mapping[str, Any], bucket_bytes: int
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The adapters alone in PEFT's names (bridge/adapter_export.py; a collective over the model-parallel group)."""
        from megatron_rlvr.bridge.adapter_export import export_adapter

        return export_adapter(chunks, hf, bucket_bytes)

    def adapter_config(self, hf: Mapping[str, Any]) -> dict[str, Any] | None:
        """PEFT's ``adapter_config.json`` of these adapters on the base ``model.hf_dir``; None when the routed
        experts carry adapters (their PEFT layout is not checked here: the merged model is their export)."""
        from megatron_rlvr.bridge.peft import adapter_config, target_modules
        from megatron_rlvr.models.dims import ModelDims

        dims = ModelDims.from_hf(hf)
        if dims.experts and "experts" in self.spec.targets:  # the same answer on every rank (a collective follows)
            return None
        return adapter_config(self.spec, target_modules(dims, self.spec), self.hf_dir)

    # --- checkpoints --------------------------------------------------------------------------------------------
    def sharded_state(self) -> dict[str, Any]:
        """The adapters as megatron ShardedTensors (each saved once: by DP rank 0 of its replicas, and of a half
        whole on every rank of its base's group, by that group's rank 0) and the base's identity."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        state: dict[str, Any] = {}
        for a in self.adapters:
            dp_rank = (
                ps.get_expert_data_parallel_rank()
                if a.expert
                else ps.get_data_parallel_rank(with_context_parallel=True)
            )
            rank, size = (a.group.rank(), a.group.size()) if a.group is not None else (0, 1)
            for half in (A_NAME, B_NAME):
                dim = split_dim(a.column, half)
                key = f"{STATE_KEY}.{self.names[id(a.module)]}.{half}"
                offsets = [(dim, rank, size)] if dim is not None and size > 1 else []
                replica = (0, 0 if offsets else rank, dp_rank)
                state[key] = ShardedTensor.from_rank_offsets(key, getattr(a.module, half), *offsets, replica_id=replica)
        state[f"{STATE_KEY}.base"] = ShardedObject(
            f"{STATE_KEY}.base", self.base_identity, (1,), (0,), replica_id=torch.distributed.get_rank()
        )
        return state

    @torch.no_grad()
    def load_sharded_state(self, loaded: Mapping[str, Any]) -> None:
        saved = loaded[f"{STATE_KEY}.base"]
        if saved["fingerprint"] != self.base_identity["fingerprint"]:
            raise LoraError(
                f"checkpoint: its LoRA adapters were trained on the base {saved['hf_dir']} (fingerprint "
                f"{saved['fingerprint'][:12]}), not on model.hf_dir={self.base_identity['hf_dir']} (fingerprint "
                f"{self.base_identity['fingerprint'][:12]}); set model.hf_dir to the base they need"
            )
        for a in self.adapters:
            for half in (A_NAME, B_NAME):
                getattr(a.module, half).copy_(loaded[f"{STATE_KEY}.{self.names[id(a.module)]}.{half}"])


def base_identity(hf_dir: str, weights_dir: str) -> dict[str, str]:
    """What names the base a set of adapters needs: its directory and a fingerprint of its ``config.json`` and the
    names and sizes of its weight files (an HF checkpoint's, or the megatron dist checkpoint ``model.load`` names):
    cheap at any size, and a different model or a re-saved one differs."""
    h = hashlib.sha256()
    config = Path(hf_dir) / "config.json"
    h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode() if config.is_file() else b"")
    weights = Path(weights_dir)
    for f in sorted([*weights.glob("*.safetensors"), *weights.glob("*.distcp")]):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return {"hf_dir": str(Path(weights_dir).resolve()), "fingerprint": h.hexdigest()}
