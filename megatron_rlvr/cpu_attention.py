"""Core attention over packed (THD) sequences without Transformer Engine: what the demo and the tests run on CPU.

megatron-core 0.16's local ``DotProductAttention.forward`` asserts ``packed_seq_params is None``; Transformer
Engine's attention takes the THD layout but needs CUDA. ``PackedDotProductAttention`` is the local attention for
everything else: a batch without ``packed_seq_params`` goes to megatron's own code unchanged, and a packed one runs
that same code once per sequence (``cu_seqlens`` bounds each), so attention never crosses a sequence boundary and
each sequence costs its own length squared, not the stream's. The layer-spec builder (models/builder.py) picks it
in place of ``DotProductAttention``; no model file knows about it.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor


class PackedDotProductAttention(DotProductAttention):
    """megatron's local DotProductAttention, plus the ``thd`` layout: query [T, heads, d], key/value
    [T, groups, d], causal within each ``cu_seqlens_q`` segment; returns [T, heads * d] like TE's."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type=None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedDotProductAttention: qkv_format {packed_seq_params.qkv_format!r}; expected 'thd'")
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_q, cu_kv):
            raise ValueError("PackedDotProductAttention: self-attention needs cu_seqlens_kv == cu_seqlens_q")
        bounds = cu_q.tolist()
        if bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the stream holds {query.shape[0]} tokens")
        outputs = []
        masks: dict[int, Tensor] = {}
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            n = end - start
            if n not in masks:  # True = masked, as megatron's attention_mask_func expects
                masks[n] = torch.triu(torch.ones(n, n, dtype=torch.bool, device=query.device), diagonal=1)[None, None]
            # [n, heads, d] -> [n, b=1, heads, d]: megatron's sbhd layout, one sequence per call
            out = super().forward(
                query[start:end].unsqueeze(1), key[start:end].unsqueeze(1), value[start:end].unsqueeze(1), masks[n],
                attn_mask_type, attention_bias,
            )
            outputs.append(out.squeeze(1))
        return torch.cat(outputs, dim=0)
