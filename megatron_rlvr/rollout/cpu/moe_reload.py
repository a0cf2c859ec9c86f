"""Two repairs vLLM 0.32 needs to serve a MoE model in process on CPU: its weight reload (`repack_cpu_experts`) and the
expert-parallel group of a kept parallel state (`ensure_ep_group`).

After vLLM's in-place ``reload_weights`` on CPU, the fused-MoE experts must be put back into the layout its CPU
kernel reads.

vLLM 0.32's CPU experts (``CPUUnquantizedExperts`` in vllm.model_executor.layers.fused_moe.experts.cpu_moe)
prepack ``w13_weight`` / ``w2_weight`` into their
grouped-GEMM layout in their ``process_weights_after_loading``; ``UnquantizedFusedMoEMethod._setup_kernel`` calls it
on the first load only (``is_weight_update``), so a reload leaves the checkpoint's plain layout in buffers the kernel
reads as prepacked, and the model computes garbage (measured: max |dlogp| 0.6 against transformers after reloading a
tiny Qwen3-MoE's own weights, 1e-6 before). `repack_cpu_experts` runs that step again on every such layer, which is
what the first load did. Where the CPU experts pad the intermediate size, the reloaded buffers are already padded and
the step would pad again: refused (`CpuMoeReloadError`) rather than computing wrong.
"""

from __future__ import annotations

import torch

from megatron_rlvr.models.dims import ModelDims


class CpuMoeReloadError(RuntimeError):
    """A fused-MoE layer this repair cannot put back (the message names it)."""


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Re-run the CPU experts' weight preparation on every fused-MoE layer of ``model``; returns how many."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    done = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):  # the unquantized CPU experts (x86, Arm, Power)
            continue
        config = experts.moe_config
        if type(experts)._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise CpuMoeReloadError(
                f"{name}: vLLM's CPU experts pad the intermediate size {config.intermediate_size_per_partition}; "
                "a weight reload cannot be repacked for them (choose moe_intermediate_size / engine TP aligned to it)"
            )
        experts.process_weights_after_loading(module)
        done += 1
    return done


def ensure_ep_group(dims: ModelDims) -> None:
    """Give a MoE engine the expert-parallel group vLLM's kept parallel state lacks.

    In-process CPU engines reuse the process's vLLM parallel state (`vllm_process.shutdown_keeping_parallel_state`);
    vLLM creates the EP group only when the first engine's model is a MoE one, so a MoE engine after a dense one in the
    same process fails in its MoE block (``expert parallel group is not initialized``). This builds the one-rank EP
    group vLLM would have built (a TP=1 CPU engine: EP = TP x DP = 1). Call inside the engine's private world."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from vllm.distributed import parallel_state as ps

    if not dims.is_moe or not ps.model_parallel_is_initialized() or ps._EP is not None:
        return
    world = ps.get_world_group()
    hidden = c10d.GroupMember.WORLD if dist.is_initialized() else None
    c10d._update_default_pg(world.device_group)  # vLLM's own (private) world: the new group is made in it
    try:
        backend = dist.get_backend(world.device_group)
        ps._EP = ps.init_model_parallel_group([world.ranks], world.local_rank, backend, group_name="ep")
    finally:
        c10d._update_default_pg(hidden)
