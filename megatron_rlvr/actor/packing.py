"""Which sequences go to which data-parallel rank and micro-batch, and how a micro-batch is packed end to end.

Pure index arithmetic over sequence lengths: every rank holds the whole mini-batch, so every rank computes the same
plan without communicating. A step's batch is first cut into its mini-batches (``mini_batch_rows``: consecutive
rows, one optimizer step each); every pass that scores rows for an update plans them within the same mini-batch, so
a row meets the same neighbours in every pass. The plan of a mini-batch:
- splits a mini-batch over the DP ranks with equal sequence counts and about equal token counts (greedy
  longest-first: each sequence goes to the rank with the fewest tokens that still has room);
- cuts each rank's share into micro-batches, either ``micro_batch_size`` sequences each or, with a token budget,
  by first-fit-decreasing under the budget; a sequence longer than the budget gets a micro-batch of its own;
- gives every DP rank the same number of micro-batches (the pipeline schedule and the gradient all-reduce need
  that) by splitting the most populous micro-batches of ranks that have fewer.

A `MicroBatch` is one of this rank's micro-batches: its rows of the mini-batch and, packed, its stream.
``pack`` lays a micro-batch out as one THD stream (sequences end to end, positions restarting at 0, ``cu_seqlens``
bounding each sequence) and ``unpack`` puts per-token values of that stream back into the right-padded view.

Context parallelism (``cp > 1``, docs/context-parallel.md): every sequence is padded at its end to a multiple of
2 * cp and cut into 2 * cp chunks; CP rank r keeps chunks r and 2 * cp - 1 - r (megatron's load-balanced causal
split). The layout then holds rank r's own stream (``tokens``, ``targets``, ``position_ids`` with the true
positions, ``token_rows`` / ``token_cols``: ``gather`` follows tokens into this rank's stream), while ``cu_seqlens``
and ``max_seqlen`` stay those of the whole padded stream, which is what megatron-core's THD RoPE
(``rope_utils._apply_rotary_pos_emb_thd`` divides each length by cp) and Transformer Engine's CP attention expect.
``unpack`` reads values in the CP-gathered order (every rank's stream, rank after rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rlvr.protocols.handoffs import Sequences

Plan = list[list[list[int]]]  # [dp rank][micro-batch] -> indices into the mini-batch


def mini_batch_rows(size: int, mini_batches: int) -> list[slice]:
    """The rows of each of a batch's ``mini_batches`` mini-batches: consecutive, in order, equal when the count
    divides ``size`` (the trainer's batches: whole groups), else the first ones one row shorter. Every row is in one."""
    if mini_batches < 1:
        raise ValueError(f"mini_batches: expected >= 1, got {mini_batches}")
    if size < mini_batches:
        raise ValueError(f"a batch of {size} sequences cannot fill {mini_batches} mini-batches")
    bounds = [i * size // mini_batches for i in range(mini_batches + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def sequence_lengths(response_mask: torch.Tensor) -> list[int]:
    """Tokens of each right-padded sequence that matter: up to its last response token (mask position t marks token
    t + 1). Positions after it are padding and, under a causal mask, change nothing before them. A sequence without
    response tokens counts as length 1 (no statistic of it enters any loss)."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask: expected [B, S - 1], got shape {tuple(response_mask.shape)}")
    width = response_mask.shape[1]
    positions = torch.arange(1, width + 1).expand_as(response_mask)
    last = torch.where(response_mask.bool(), positions, torch.zeros_like(positions)).amax(dim=1)
    return [int(n) + 1 for n in last]  # last response position t (1-based: t + 1) -> length t + 2


def balanced_split(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices per part: equal counts, token sums balanced greedily longest-first; each part in ascending order."""
    if parts < 1:
        raise ValueError(f"parts: expected >= 1, got {parts}")
    if len(lengths) % parts:
        raise ValueError(f"a mini-batch of {len(lengths)} sequences does not split over data-parallel size {parts}")
    room = len(lengths) // parts
    tokens, members = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        part = min((p for p in range(parts) if len(members[p]) < room), key=lambda p: (tokens[p], p))
        tokens[part] += lengths[i]
        members[part].append(i)
    return [sorted(m) for m in members]


def budget_micro_batches(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing under ``max_tokens`` real tokens per micro-batch; an over-long sequence sits alone."""
    bins: list[list[int]] = []
    load: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, used in enumerate(load):
            if used + lengths[i] <= max_tokens:
                bins[b].append(i)
                load[b] += lengths[i]
                break
        else:
            bins.append([i])
            load.append(lengths[i])
    return [sorted(b) for b in bins]


def _split_to(bins: list[list[int]], count: int, lengths: Sequence[int]) -> list[list[int]]:
    """Split the most populous micro-batches until there are ``count``; splitting only lowers each one's tokens."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        b = max(range(len(bins)), key=lambda k: (len(bins[k]), sum(lengths[i] for i in bins[k])))
        if len(bins[b]) < 2:
            raise ValueError(f"cannot make {count} non-empty micro-batches of {sum(map(len, bins))} sequences")
        members = bins.pop(b)
        half = len(members) // 2
        bins += [members[:half], members[half:]]
    return sorted(bins)


def cp_padded_length(n: int, cp: int) -> int:
    """A sequence's length in the stream under context parallelism: padded at its end to a multiple of 2 * cp."""
    return n if cp == 1 else -(-n // (2 * cp)) * 2 * cp


def stream_tokens(lengths: Sequence[int], multiple: int = 1, cp: int = 1) -> int:
    """Tokens of the whole stream ``pack`` builds (before the split over CP ranks), its tail rounded to the
    multiple; each CP rank holds 1 / cp of it."""
    unit = multiple if cp == 1 else 2 * cp * multiple
    return -(-sum(cp_padded_length(n, cp) for n in lengths) // unit) * unit


def plan_micro_batches(
    lengths: Sequence[int], dp: int, *, micro_batch_size: int, max_tokens: int = 0, count_multiple: int = 1
) -> Plan:
    """The whole mini-batch's plan: ``plan[r]`` is DP rank r's micro-batches, the same count on every rank.

    ``max_tokens > 0``: micro-batches by real-token budget (``micro_batch_size`` unused), their count rounded up to
    a multiple of ``count_multiple`` (megatron's interleaved schedule wants a multiple of PP); else
    ``micro_batch_size`` sequences each, in the rank's (ascending) order."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: expected >= 1, got {micro_batch_size}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"sequence lengths must be >= 1, got {min(lengths)}")
    shares = balanced_split(lengths, dp)
    if max_tokens <= 0:
        return [[share[i : i + micro_batch_size] for i in range(0, len(share), micro_batch_size)] for share in shares]
    per_rank = [budget_micro_batches(share, lengths, max_tokens) for share in shares]
    count = -(-max(len(bins) for bins in per_rank) // count_multiple) * count_multiple
    if count > len(shares[0]):
        raise ValueError(
            f"{len(shares[0])} sequences per data-parallel rank cannot fill {count} micro-batches (a multiple of "
            f"{count_multiple}, the pipeline size under virtual pipelining): give each step more sequences"
        )
    return [_split_to(bins, count, lengths) for bins in per_rank]


@dataclass
class PackedLayout:
    """One micro-batch as a THD stream: the model's input (this CP rank's share), and where each statistic goes back
    to. Without context parallelism (cp = 1) the rank's stream is the whole stream."""

    tokens: torch.Tensor  # [1, T] int64: this rank's stream
    targets: torch.Tensor  # [1, T]: the next token of the same sequence; 0 at last positions and the padding
    position_ids: torch.Tensor  # [1, T]: the true position of each token within its sequence
    cu_seqlens: torch.Tensor  # [segments + 1] int32 of the whole stream; a tail of padding is a segment of its own
    max_seqlen: int  # of the whole stream
    # the statistic at position src[k] of the CP-gathered stream belongs at [rows[k], cols[k]] of the [b, S - 1] view
    rows: torch.Tensor
    cols: torch.Tensor
    src: torch.Tensor
    real_tokens: int  # real tokens of the whole stream (no padding)
    # where every position of this rank's stream comes from in the right-padded [b, S] block; -1 at padding
    token_rows: torch.Tensor  # [T]
    token_cols: torch.Tensor  # [T]
    has_target: torch.Tensor  # [T] bool: the position has a statistic (a next token in its sequence)
    cp: int = 1
    stream_total: int = 0  # tokens of the whole stream (= T at cp = 1)

    @property
    def num_tokens(self) -> int:
        """Tokens of this rank's stream."""
        return int(self.tokens.shape[1])

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """A per-token field of the padded block [b, S, ...] -> this rank's stream order [T, ...], zeros at padding:
        how anything that travels with the tokens (e.g. MoE routing for replay) follows them into the stream."""
        real = self.token_rows >= 0
        out = values.new_zeros((self.num_tokens,) + tuple(values.shape[2:]))
        out[real] = values[self.token_rows[real], self.token_cols[real]]
        return out

    def to_stream(self, values: torch.Tensor) -> torch.Tensor:
        """Per-statistic values of the [b, S - 1, ...] view -> this rank's stream [T, ...] (zeros where no statistic
        is): the inverse of ``unpack`` on this rank's own positions."""
        device = values.device
        out = values.new_zeros((self.num_tokens,) + tuple(values.shape[2:]))
        at = self.has_target.to(device)
        out[at] = values[self.token_rows.to(device)[at], self.token_cols.to(device)[at]]
        return out


@dataclass
class MicroBatch:
    """One micro-batch of this rank: its rows of the mini-batch (the padded view the losses read) and, when packed,
    the THD stream the model runs on."""

    seqs: Sequences  # the pass's own row type (the update's: TrainingRows)
    packed: PackedLayout | None

    def targets(self) -> torch.Tensor:
        """The token each position predicts, aligned with the model's logits (a dummy at each sequence's end)."""
        return torch.roll(self.seqs.tokens, shifts=-1, dims=1) if self.packed is None else self.packed.targets


def context_parallel_index(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Positions of the whole stream CP rank ``rank`` holds, in its stream's order: of every segment (a multiple of
    2 * cp long), chunks ``rank`` and ``2 * cp - 1 - rank`` of its 2 * cp equal chunks."""
    pieces = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def pack(
    tokens: torch.Tensor,
    lengths: Sequence[int],
    multiple: int = 1,
    total: int | None = None,
    *,
    cp: int = 1,
    cp_rank: int = 0,
) -> PackedLayout:
    """Sequences ``tokens[i, :lengths[i]]`` end to end, padded at the tail to a multiple of ``multiple`` tokens per
    rank (e.g. the TP size under sequence parallelism), or to exactly ``total`` tokens of the whole stream when given
    (one stream shape for every micro-batch). Position t of a sequence predicts its token t + 1. ``cp > 1``: each
    sequence padded to a multiple of 2 * cp, and the layout is CP rank ``cp_rank``'s share (see the module doc)."""
    if tokens.dim() != 2 or tokens.shape[0] != len(lengths):
        raise ValueError(f"tokens: expected [{len(lengths)}, S], got shape {tuple(tokens.shape)}")
    if any(n < 1 or n > tokens.shape[1] for n in lengths):
        raise ValueError(f"lengths: expected 1..{tokens.shape[1]} each, got {list(lengths)}")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank}: expected 0..{cp - 1}")
    unit = multiple if cp == 1 else 2 * cp * multiple
    lens = torch.tensor(list(lengths), dtype=torch.long)
    seg_lens = torch.tensor([cp_padded_length(n, cp) for n in lengths], dtype=torch.long)
    real, padded = int(lens.sum()), int(seg_lens.sum())
    pad = -padded % unit if total is None else total - padded
    if pad < 0 or (padded + pad) % unit:
        raise ValueError(f"total={total}: expected a multiple of {unit} of at least the {padded} tokens packed")
    segments = seg_lens if not pad else torch.cat([seg_lens, torch.tensor([pad])])
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(segments, 0)
    count = padded + pad
    starts = cu[:-1].long()
    seg_of = torch.repeat_interleave(torch.arange(len(segments)), segments)
    position = torch.arange(count) - starts[seg_of]
    real_in_segment = torch.cat([lens, torch.zeros(len(segments) - len(lens), dtype=torch.long)])
    is_real = position < real_in_segment[seg_of]  # padding: each sequence's end under CP, and the tail segment
    rows = torch.full((count,), -1, dtype=torch.long)
    rows[is_real] = seg_of[is_real]
    flat = torch.zeros(count, dtype=tokens.dtype)
    flat[is_real] = tokens[rows[is_real], position[is_real]]
    # the next token of the same sequence, where there is one (not at a sequence's last position)
    has_next = torch.zeros(count, dtype=torch.bool)
    has_next[is_real] = position[is_real] < lens[rows[is_real]] - 1
    targets = torch.zeros_like(flat)
    src = has_next.nonzero().squeeze(1)
    targets[src] = flat[src + 1]
    token_cols = torch.where(is_real, position, torch.full_like(position, -1))
    mine = torch.arange(count)
    src_in_gathered = src
    if cp > 1:  # this rank's share; the statistics come back rank after rank (the CP all-gather's order)
        order = torch.cat([context_parallel_index(cu, cp, r) for r in range(cp)])
        where = torch.empty(count, dtype=torch.long)
        where[order] = torch.arange(count)
        src_in_gathered = where[src]
        mine = context_parallel_index(cu, cp, cp_rank)
    return PackedLayout(
        tokens=flat[mine][None],
        targets=targets[mine][None],
        position_ids=position[mine][None],
        cu_seqlens=cu,
        max_seqlen=int(segments.max()),
        rows=rows[src],
        cols=position[src],
        src=src_in_gathered,
        real_tokens=real,
        token_rows=rows[mine],
        token_cols=token_cols[mine],
        has_target=has_next[mine],
        cp=cp,
        stream_total=count,
    )


def unpack(values: torch.Tensor, layout: PackedLayout, shape: tuple[int, int]) -> torch.Tensor:
    """Per-token values of the whole stream [T, ...] (under CP: every rank's stream, gathered rank after rank) ->
    the right-padded view [b, S - 1, ...] (zeros where no statistic is); differentiable, so a loss on the padded
    view sends its gradient back into the stream."""
    device = values.device
    out = values.new_zeros(shape + tuple(values.shape[1:]))
    return out.index_put((layout.rows.to(device), layout.cols.to(device)), values[layout.src.to(device)])
