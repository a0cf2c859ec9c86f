"""This rank's model chunks with their initial weights: the policy's, the frozen reference's and a teacher's are all
built here, one `GPTModel` per virtual pipeline stage (megatron-core's layer spec from models/builder.py), filled
from an HF checkpoint (bridge.load_hf_weights) or a megatron dist checkpoint (bridge/dist_ckpt.py)."""

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
            build_gpt_model(
                hf,
                tcfg,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
                use_te=use_te,
                make_vocab_size_divisible_by=divisible_by,
                core_attention=core_attention,
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
