"""`ActorPasses`: how every pass of the actor runs a batch through a model's chunks: plan -> schedule -> gather.

The policy's statistics and update passes, the frozen reference's, the distillation teacher's and routing replay's
comparison pass all run through one `ActorPasses`, so they plan, pack and schedule a batch identically:

- ``plan(batch)``: sequences split over DP ranks with about equal token counts (packing.py), micro-batches of
  ``micro_batch_size`` sequences or under ``max_tokens_per_micro_batch`` real tokens, the same micro-batch count on
  every DP rank; with ``pack_sequences`` each micro-batch becomes one THD stream (this CP rank's share of it).
- ``run(micro, loss_fn, forward_only=, model=)``: megatron-core's pipeline schedule over ``model``'s chunks (the
  DDP-wrapped policy, or bare frozen chunks), ``loss_fn(micro_batch, logits)`` on the last stage.
- ``gather(rows, plan, size, width)``: per-sequence rows of this rank's micro-batches -> the whole batch on every rank.
- ``token_stats(logits, mb)``: the fused op's per-token statistics in the padded [b, S - 1] view the losses read,
  whether the micro-batch ran packed or not; ``to_view`` is that last step alone.

Packed streams: with ``actor.vpp`` (the interleaved schedule) every stream of a pass is padded to one length, since
megatron-core's interleaved shape exchange at PP=2 would otherwise swap the two directions' shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch

from megatron_rlvr.actor.config import ActorConfig
from megatron_rlvr.actor.context_parallel import packed_seq_params, padding_fraction, stream_to_view
from megatron_rlvr.actor.gathering import to_every_rank
from megatron_rlvr.actor.packing import (
    MicroBatch,
    Plan,
    cp_padded_length,
    mini_batch_rows,
    pack,
    plan_micro_batches,
    sequence_lengths,
    stream_tokens,
)
from megatron_rlvr.actor.router_replay import RouterReplayer
from megatron_rlvr.ops import TokenStats, vocab_parallel_token_stats
from megatron_rlvr.protocols.handoffs import Sequences
from megatron_rlvr.runtime import distributed

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

MONITOR_TOP_N = 3  # rank-1/2/3 probabilities are always reported, whatever the loss's top_n


# loss_fn(micro_batch, logits) -> (loss, metrics): megatron-core's forward_step contract, bound to a micro-batch
LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class ActorPasses:
    """plan -> schedule -> gather for one actor layout. ``vocab_size`` is the policy's true vocabulary, ``local_vocab``
    its padded shard per TP rank; ``temperature`` the sampling temperature every statistic is taken at."""

    def __init__(
        self,
        cfg: ActorConfig,
        tcfg: TransformerConfig,
        *,
        vocab_size: int,
        local_vocab: int,
        temperature: float,
        replay: RouterReplayer,
    ) -> None:
        self.cfg, self.tcfg, self.replay = cfg, tcfg, replay
        self.vocab_size, self.local_vocab, self.temperature = vocab_size, local_vocab, temperature
        self.last_cp_padding = 0.0  # the last planned batch's CP padding share (actor/cp_padding)

    # --- the vocab-parallel group the fused op reduces over ---------------------------------------------------
    @property
    def tp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group() if self.cfg.tp > 1 else None

    def vocab_start(self, local_vocab: int | None = None) -> int:
        """The first global id of this TP rank's logits shard (``local_vocab``: another model's shard, a teacher's)."""
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() * (local_vocab or self.local_vocab)

    # --- plan ------------------------------------------------------------------------------------------------
    def plan(self, batch: Sequences) -> tuple[Plan, list[MicroBatch]]:
        """The batch's plan over all DP ranks (the same on every rank) and this rank's micro-batches."""
        from megatron.core import parallel_state as ps

        lengths = sequence_lengths(batch.response_mask)
        cp = self.cfg.cp
        # budgets and the DP balance count the tokens each CP rank holds: 1 / cp of each (padded) sequence
        per_rank = [cp_padded_length(n, cp) // cp for n in lengths]
        plan = plan_micro_batches(
            per_rank,
            ps.get_data_parallel_world_size(),
            micro_batch_size=self.cfg.micro_batch_size,
            max_tokens=self.cfg.max_tokens_per_micro_batch,
            count_multiple=self.cfg.pp if self.cfg.vpp else 1,
        )
        # sequence parallelism splits the stream's tokens over the TP ranks: a multiple of tp
        multiple = self.cfg.tp if self.cfg.sequence_parallel else 1
        mine = plan[ps.get_data_parallel_rank()]
        total = None  # the stream's own length, rounded up to the multiple
        if self.cfg.vpp:  # one shape for every micro-batch; the same on every PP stage
            total = max(stream_tokens([lengths[i] for i in rows], multiple, cp) for rows in mine)
        cp_rank = ps.get_context_parallel_rank() if cp > 1 else 0
        micro = []
        for rows in mine:
            seqs = batch.select(torch.tensor(rows))
            packed = None
            if self.cfg.pack_sequences:
                packed = pack(seqs.tokens, [lengths[i] for i in rows], multiple, total, cp=cp, cp_rank=cp_rank)
            micro.append(MicroBatch(seqs, packed))
        self.last_cp_padding = padding_fraction(lengths, cp)
        return plan, micro

    # --- schedule --------------------------------------------------------------------------------------------
    def forward(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """One chunk's forward on one micro-batch: the packed stream, or the padded block with a causal mask."""
        device = distributed.device()
        if mb.packed is not None:
            p = mb.packed
            params = packed_seq_params(p, device)
            return model(p.tokens.to(device), p.position_ids.to(device), attention_mask=None, packed_seq_params=params)
        tokens = mb.seqs.tokens.to(device)
        b, s = tokens.shape
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
        return model(tokens, position_ids, attention_mask=causal)

    def run(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn, *, forward_only: bool, model: list[torch.nn.Module]
    ) -> list[dict[str, torch.Tensor]]:
        """Megatron's pipeline schedule over ``model``'s chunks: the DDP-wrapped policy, or bare frozen chunks
        (forward only). Micro-batches differ in shape; under PP the stages exchange each one's shape first
        (``variable_seq_lengths``), so the schedule's seq_length / micro_batch_size (the first one's) are nominal.
        Returns the metrics dicts of the last pipeline stage ([] elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[MicroBatch], chunk: torch.nn.Module):
            mb = next(data_iterator)
            return self.replay.forward(chunk, mb, self.forward), partial(loss_fn, mb)  # replay follows mb's tokens

        first = micro_batches[0]
        # the whole stream's length: the schedule divides it by cp (and by tp under sequence parallelism) itself
        seq_length, micro_batch_size = (first.packed.stream_total, 1) if first.packed else first.seqs.tokens.shape[::-1]
        data = [iter(micro_batches) for _ in model] if len(model) > 1 else iter(micro_batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model if len(model) > 1 else model[0],
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    # --- gather ----------------------------------------------------------------------------------------------
    def gather(self, rows: list[torch.Tensor], plan: Plan, size: int, width: int) -> torch.Tensor:
        """Per-sequence rows [n, width] of this rank's micro-batches, in plan order (last stage; [] elsewhere) ->
        the whole batch [size, width] in its own order, on every rank, on the CPU (gathering.py)."""
        return to_every_rank(rows, plan, size, width)

    # --- the fused op on one micro-batch -----------------------------------------------------------------------
    def to_view(self, values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Per-position op outputs over the model's tokens ([b, S, ...] padded, or [1, T, ...] packed) -> the padded
        view [b, S - 1, ...] the losses read (position t predicts token t + 1; 0 at packed padding)."""
        if mb.packed is None:
            return values[:, :-1]
        return stream_to_view(values[0], mb.packed, tuple(mb.seqs.response_mask.shape))

    def token_stats(
        self, logits: torch.Tensor, mb: MicroBatch, top_n: int, inplace_backward: bool = False
    ) -> TokenStats:
        """Statistics at positions 0..S-2 of the padded view, with the ``top_n`` candidates (at least the
        ``MONITOR_TOP_N`` every step reports). The op runs on the whole contiguous logits (the padded block, or the
        packed stream) with each position's target beside it, so no [T, V/tp] copy is made and the backward may
        write the gradient into the logits buffer itself."""
        stats = vocab_parallel_token_stats(
            logits,
            mb.targets().to(logits.device),
            max(top_n, MONITOR_TOP_N),
            group=self.tp_group,
            vocab_start=self.vocab_start(),
            vocab_size=self.vocab_size,
            temperature=self.temperature,
            chunk_tokens=self.cfg.stats_chunk_tokens,
            inplace_backward=inplace_backward,
        )
        return TokenStats(*(self.to_view(t, mb) for t in stats))

    @torch.no_grad()
    def per_token(
        self,
        batch: Sequences,
        field: str,
        model: list[torch.nn.Module],
        kind: str,
        top_n: int = MONITOR_TOP_N,
        mini_batches: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One per-token statistic of the fused op over the whole batch through ``model``'s chunks, no grad,
        gathered to every rank [B, S - 1], and the routing the pass recorded (routing replay's ``record``; else
        None). ``kind`` is routing replay's name of the pass (``statistics`` for the
        policy's behaviour log-probs, else ``other``). Positions past a sequence's last response token are padding:
        0 when packed (nothing computes them), whatever the padded block gives otherwise.

        Each of the update's ``mini_batches`` (packing.mini_batch_rows) is planned on its own, as the update plans
        it: a row is computed in the same micro-batch and stream as in the update's forward, so the numbers of a
        frozen copy with the policy's weights are the update's bit for bit (another plan packs other neighbours into
        the stream, and the GEMMs round differently)."""
        for m in model:
            m.eval()
        parts = [batch.select(rows) for rows in mini_batch_rows(len(batch), mini_batches)]
        values, routed = [], []
        for part in parts:
            plan, micro = self.plan(part)

            def collect(mb: MicroBatch, logits: torch.Tensor):
                return torch.zeros(()), {field: getattr(self.token_stats(logits, mb, top_n), field).float()}

            with self.replay.pass_over(part, plan, kind) as recorded:
                outputs = self.run(micro, collect, forward_only=True, model=model)
            values.append(self.gather([o[field] for o in outputs], plan, len(part), batch.response_mask.shape[1]))
            routed.append(recorded.routed_experts)
        recorded_all = torch.cat(routed) if all(r is not None for r in routed) else None
        return torch.cat(values), recorded_all
