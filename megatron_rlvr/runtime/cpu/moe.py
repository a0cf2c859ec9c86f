"""The CPU shims megatron-core 0.16's MoE layers need beyond `shims` (applied by `shims.apply_cpu_shims`).

- ``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, but the name is bound only when
  Transformer Engine imports: without TE the router's forward raises NameError. Binding it to None selects the
  function's own torch matmul path (the fp32 router logits, the same math).
- ``MoEAlltoAllTokenDispatcher`` turns its all-to-all split sizes into numpy arrays with
  ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA tensors: on CPU the splits stay
  tensors and gloo's ``all_to_all_single`` refuses them. The dispatcher's copy converts CPU tensors too.
"""

from __future__ import annotations

from typing import Any


def apply_moe_shims() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        import torch

        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
