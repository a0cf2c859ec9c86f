"""Core attention on torch's ``scaled_dot_product_attention`` (SDPA): the local layer spec's attention on a GPU
without Transformer Engine.

megatron-core's local ``DotProductAttention`` is unfused: it forms the [b, heads, s, s] score matrix and runs a
separate softmax, which bounds a GPU run without TE (the image the GPU check ran on has neither TE nor Apex). SDPA
picks a fused kernel by itself: flash or memory-efficient attention on CUDA (bf16/fp16), a tiled kernel or the math
path on the CPU. ``SdpaAttention`` keeps megatron's contract, so the layer spec swaps it in and nothing else knows:

- **sbhd** (a right-padded block): query [s, b, heads, d], key/value [s, b, groups, d] -> [s, b, heads * d].
  Under the layer's causal mask type the attention is causal and the mask argument is not read, as in TE's
  attention: right padding needs nothing beyond causality (the padded positions' outputs are never scored). Any
  other mask type applies the mask (True = masked, megatron's convention).
- **thd** (a packed stream, ``packed_seq_params``): query [t, heads, d] -> [t, heads * d], one causal SDPA call per
  sequence of ``cu_seqlens``, so attention never crosses a sequence boundary. The bounds are read on the host once
  per layer (a device sync per layer on a GPU).

Query groups share their key/value heads through SDPA's ``enable_gqa``. The scale is megatron's (1/sqrt(d), or
``config.softmax_scale``), and dropout is ``attention_dropout`` in training. Refused at construction: context
parallelism (TE's CP attention, or the unfused packed attention, runs it), sliding windows and softmax offsets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from megatron_rlvr.models.family import UnsupportedModelError


class SdpaAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` (its constructor: heads per partition, the scale, dropout) with the
    forward on ``torch.nn.functional.scaled_dot_product_attention``, for the sbhd and the thd layout."""

    def __init__(self, config, *args, **kwargs) -> None:
        if config.context_parallel_size > 1:
            raise UnsupportedModelError(
                f"SDPA attention: context parallelism (actor.cp={config.context_parallel_size}) needs TE's attention "
                "or the unfused packed attention (model.core_attention=unfused)"
            )
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise UnsupportedModelError(
                f"SDPA attention: window_size={config.window_size}, softmax_type={config.softmax_type!r}: only full "
                "causal attention with a plain softmax; use model.core_attention=unfused"
            )
        super().__init__(config, *args, **kwargs)
        # megatron divides its scale by the layer number under query-key layer scaling and its softmax multiplies
        # it back: the scores see softmax_scale * coeff
        coeff = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        self.sdpa_scale = self.softmax_scale * coeff

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SdpaAttention: attention_bias is not supported (nor is it by DotProductAttention)")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None if causal or attention_mask is None else ~attention_mask  # SDPA: True = may attend
        out = self._sdpa(q, k, v, causal=causal, mask=allowed)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams) -> Tensor:
        if params.qkv_format != "thd":
            raise ValueError(f"SdpaAttention: qkv_format {params.qkv_format!r}; expected 'thd'")
        cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
        if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q, cu_kv):
            raise ValueError("SdpaAttention: self-attention needs cu_seqlens_kv == cu_seqlens_q")
        bounds = cu_q.tolist()
        if bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the stream holds {query.shape[0]} tokens")
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            # [n, h, d] -> [1, h, n, d]: one sequence, causal within itself
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            outputs.append(self._sdpa(q, k, v, causal=True, mask=None)[0].transpose(0, 1))
        if not outputs:
            return query.new_zeros(query.shape[0], query.shape[1] * value.shape[2])
        return torch.cat(outputs, dim=0).reshape(query.shape[0], -1)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, mask: Tensor | None) -> Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.attention_dropout.p if self.training else 0.0,
            is_causal=causal and mask is None,
            scale=self.sdpa_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
