"""This rank's model chunks with their initial weights: the policy's, the frozen reference's and a teacher's are all
built here, one `GPTModel` per virtual pipeline stage (megatron-core's layer spec from models/builder.py), filled
from an HF checkpoint (bridge.load_hf_weights) or a megatron dist checkpoint (bridge/dist_ckpt.py).

Chunks with the same weights compute the same numbers bit for bit, trained or frozen (``same_dispatch``): a frozen
copy's log-probs are then exactly the policy's, so a KL to it or a teacher that is the student is 0, not noise that
Adam turns into an lr-sized step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


def build_chunks(
    hf: Mapping[str, Any],
    tcfg: TransformerConfig,
    *,
    vpp: int | None,
    use_te: bool | None,
    divisible_by: int,
    hf_dir: str,
    dist_checkpoint: str | None = None,
    core_attention: str = "auto",
    attention_block_tokens: int | None = None,
) -> list[torch.nn.Module]:
    """The chunks of the model ``hf`` describes at ``tcfg``'s layout, with the weights of ``dist_checkpoint`` when
    given (any TP/PP), else those of the HF checkpoint ``hf_dir``. Needs megatron's parallel state."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.bridge import load_hf_weights
    from megatron_rlvr.models import build_gpt_model

    chunks = []
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        chunks.append(
            same_dispatch(
                build_gpt_model(
                    hf,
                    tcfg,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    vp_stage=vp_stage,
                    use_te=use_te,
                    make_vocab_size_divisible_by=divisible_by,
                    core_attention=core_attention,
                    attention_block_tokens=attention_block_tokens,
                )
            )
        )
    if dist_checkpoint:
        from megatron_rlvr.bridge.dist_ckpt import load_dist_checkpoint

        load_dist_checkpoint(chunks, hf["vocab_size"], dist_checkpoint)
    else:
        load_hf_weights(chunks, hf_dir)
    return chunks


def freeze(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """No grad, eval mode: a model that is scored, never trained (the reference, a teacher)."""
    for c in chunks:
        c.requires_grad_(False)
        c.eval()
    return chunks


def same_dispatch(chunk: torch.nn.Module) -> torch.nn.Module:
    """Give the chunk's embedding output the strides of a freshly allocated tensor (a view, no copy).

    megatron's embedding turns [b, s, h] into [s, b, h] with ``transpose(0, 1).contiguous()``, which copies nothing
    when b = 1 (every packed stream): the result keeps the stride s * h on its size-1 batch dimension. torch.matmul
    folds a [s, b, h] input into one [s * b, h] GEMM only when its strides allow that without a copy, or when the
    weight requires grad; otherwise it runs a batched GEMM of b = 1 rows per sequence position. So the first layer's
    linear_qkv ran one GEMM in the policy (trainable weights) and s small ones in a frozen copy of it (the KL
    reference, a teacher, LoRA's frozen base), which round differently: log-probs 1e-6 apart at TP = 2 from
    bit-identical weights. With canonical strides both fold, whatever requires grad."""
    embedding = getattr(chunk, "embedding", None)  # only the first pipeline stage has one
    if embedding is not None:
        embedding.register_forward_hook(_canonical_strides)
    return chunk


def _canonical_strides(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output.view(output.shape)
