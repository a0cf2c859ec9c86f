"""The CPU shims megatron-core 0.16's MoE layers need beyond `shims` (applied by `shims.apply_cpu_shims`).

- ``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, but the name is bound only when
  Transformer Engine imports: without TE the router's forward raises NameError. Binding it to None selects the
  function's own torch matmul path (the fp32 router logits, the same math).
- ``MoEAlltoAllTokenDispatcher`` turns its all-to-all split sizes into numpy arrays with
  ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA tensors: on CPU the splits stay
  tensors and gloo's ``all_to_all_single`` refuses them. The dispatcher's copy converts CPU tensors too.
- Under expert tensor parallelism (``actor.etp > 1``) the dispatcher gathers every ETP rank's routed tokens with
  ``mappings._gather_along_first_dim(..., output_split_sizes=...)``, each rank's count its own, through
  ``torch.distributed.all_gather`` of a list of differently sized tensors, which gloo refuses ("invalid tensor
  size"; its reduce_scatter takes uneven splits). The gather pads every rank's rows to the largest count, gathers
  equal blocks and cuts each back: the same rows in the same order.
"""

from __future__ import annotations

from typing import Any


def apply_moe_shims() -> None:
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    mappings._gather_along_first_dim = _uneven_gather_on_gloo(mappings._gather_along_first_dim)

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        import torch

        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def _uneven_gather_on_gloo(original: Any) -> Any:
    """``mappings._gather_along_first_dim`` that also gathers uneven ``output_split_sizes`` over gloo."""
    import torch
    import torch.distributed as dist

    def gather(input_: Any, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1 or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        most = max(output_split_sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        blocks = input_.new_empty((group.size() * most, *input_.shape[1:]))
        dist.all_gather_into_tensor(blocks, padded, group=group)
        return torch.cat([blocks[r * most : r * most + n] for r, n in enumerate(output_split_sizes)])

    return gather
