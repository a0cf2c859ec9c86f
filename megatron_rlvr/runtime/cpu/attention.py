"""Core attention over packed (THD) sequences without Transformer Engine: what the demo and the tests run on CPU.

megatron-core 0.16's local ``DotProductAttention.forward`` asserts ``packed_seq_params is None``; Transformer
Engine's attention takes the THD layout but needs CUDA. ``PackedDotProductAttention`` is the local attention for
everything else: a batch without ``packed_seq_params`` goes to megatron's own code unchanged, and a packed one runs
that same code on blocks of whole sequences with a block-diagonal causal mask (``cu_seqlens`` bounds each
sequence), so attention never crosses a sequence boundary. Short sequences share a block of up to BLOCK_TOKENS
(one call, not one per rollout; the spec's ``block_tokens`` param, ``model.packed_attention_block_tokens``, sets
another bound); a longer sequence is a block alone and costs its own length squared, not the
stream's. The layer-spec builder (models/builder.py) picks it in place of ``DotProductAttention``; no model file
knows about it.

Under context parallelism (``context_parallel_size > 1``, which megatron's local attention refuses at construction)
a packed stream is this CP rank's share, and the work goes to ``cp_attention.context_parallel_attention`` (K/V
all-gathered over the CP group, local queries against the causal part of their sequence).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

BLOCK_TOKENS = 256  # the default bound of a block of short sequences (model.packed_attention_block_tokens)


class PackedDotProductAttention(DotProductAttention):
    """megatron's local DotProductAttention, plus the ``thd`` layout: query [T, heads, d], key/value
    [T, groups, d], causal within each ``cu_seqlens_q`` segment; returns [T, heads * d] like TE's."""

    def __init__(self, config, *args, block_tokens: int = BLOCK_TOKENS, **kwargs) -> None:
        if block_tokens < 1:
            raise ValueError(f"PackedDotProductAttention: block_tokens={block_tokens}; expected at least 1")
        cp_size = config.context_parallel_size
        if cp_size > 1:  # megatron's __init__ asserts cp == 1 (its dense math is ours per call, CP or not)
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, **kwargs)
        self.block_tokens = block_tokens
        self.cp_size = cp_size
        pg_collection = kwargs.get("pg_collection")
        self.cp_group = getattr(pg_collection, "cp", None)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedDotProductAttention: qkv_format {packed_seq_params.qkv_format!r}; expected 'thd'")
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_q, cu_kv):
            raise ValueError("PackedDotProductAttention: self-attention needs cu_seqlens_kv == cu_seqlens_q")
        if self.cp_size > 1:
            return self._context_parallel(query, key, value, cu_q, attn_mask_type)
        bounds = cu_q.tolist()
        if bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the stream holds {query.shape[0]} tokens")
        outputs = []
        for start, end, segments in _blocks(bounds, self.block_tokens):
            # True = masked, as megatron's attention_mask_func expects: later tokens and other sequences
            seg = torch.repeat_interleave(
                torch.arange(len(segments), device=query.device), torch.tensor(segments, device=query.device)
            )
            n = end - start
            mask = (seg[:, None] != seg[None, :]) | torch.ones(n, n, dtype=torch.bool, device=query.device).triu(1)
            # [n, heads, d] -> [n, b=1, heads, d]: megatron's sbhd layout, one block of whole sequences per call
            out = super().forward(
                query[start:end].unsqueeze(1),
                key[start:end].unsqueeze(1),
                value[start:end].unsqueeze(1),
                mask[None, None],
                attn_mask_type,
                attention_bias,
            )
            outputs.append(out.squeeze(1))
        return torch.cat(outputs, dim=0)

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor, cu: Tensor, attn_mask_type) -> Tensor:
        from megatron.core import parallel_state

        from megatron_rlvr.runtime.cpu.cp_attention import context_parallel_attention

        def dense(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
            out = super(PackedDotProductAttention, self).forward(
                q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), mask[None, None], attn_mask_type, None
            )
            return out.squeeze(1)

        group = self.cp_group if self.cp_group is not None else parallel_state.get_context_parallel_group()
        return context_parallel_attention(query, key, value, cu, group, dense, self.block_tokens)


def _blocks(bounds: list[int], block_tokens: int = BLOCK_TOKENS) -> list[tuple[int, int, list[int]]]:
    """Consecutive sequences grouped into blocks of at most ``block_tokens`` tokens (a longer sequence is a block of its
    own): one dense call per block keeps the per-call overhead of many short rollouts off the CPU, while the dense
    cost stays near each sequence's own length squared for long ones."""
    blocks: list[tuple[int, int, list[int]]] = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        if blocks and end - blocks[-1][0] <= block_tokens:
            first, _, segments = blocks[-1]
            blocks[-1] = (first, end, segments + [end - start])
        else:
            blocks.append((start, end, [end - start]))
    return blocks
