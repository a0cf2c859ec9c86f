"""Routing replay for mixture-of-experts actors (``actor.router_replay``; docs/routing-replay.md).

Contract. `RouterReplayer` puts a `_LayerReplay` in place of megatron-core's ``RouterReplay`` on every ``TopKRouter``
of the chunks it is given (the policy's and the frozen reference's; a teacher's chunks are never given, so they
route freely). Each stands for one MoE layer of the whole model: its index among the model's MoE layers (the
batch's ``L`` axis), found from the router's global layer number, so a pipeline stage or virtual chunk serves
only the layers it holds. Megatron's own per-layer instances are dropped from its global list: that list is in
instantiation order across every model built in the process, which says nothing about which chunk a router is in.

Per pass (``pass_over``) one action holds for every micro-batch:

- ``record`` (``train``, the statistics pass): each layer's own top-k of every token is kept and, after the pass,
  handed back as the pass's `Recorded.routed_experts` [B, S, L, k] (every rank, every layer: the ranks' shares are
  merged with one all-reduce MAX over the world, -1 where no rank routed a position, i.e. padding), which the
  statistics carry to every later pass;
- ``replay``: the batch's ``routed_experts`` are given to the routers; a token whose ids are -1 (padding, positions
  the engine did not route) takes the router's own choice; the gate values are the router's own scores at the
  replayed experts (megatron's REPLAY_FORWARD math);
- ``free``: the router's own top-k.

The ids follow the tokens of each micro-batch (``micro_batch``, around the model call): into the packed stream by
``PackedLayout.gather``, or the padded block's [S, b] order, then this rank's sequence-parallel slice; the router
sees exactly those tokens. Micro-batching and DP balancing select rows of the `Sequences`, which carry them.

Metrics (``metrics``), summed over the world between two calls: ``moe/routing_mismatch``, the share of (real token,
MoE layer) pairs whose top-k set from the policy's own router differs from the replayed one, over the policy's
replaying passes; ``moe/logp_mismatch_replay`` / ``moe/logp_mismatch_no_replay``, the mean |log-prob - target| over
response tokens of the update's first micro-batch (``compare_logp``), with the replayed routing and in one extra
no-grad forward without it, at the same weights; the target is the engine's log-probs (``rollout``) or the
statistics pass's (``train``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from megatron_rlvr.actor.packing import MicroBatch, PackedLayout, sequence_lengths
from megatron_rlvr.actor.rows import TrainingRows
from megatron_rlvr.errors import UserError

if TYPE_CHECKING:
    from megatron_rlvr.protocols.handoffs import Sequences

Action = Literal["free", "record", "replay"]
# the policy's log-probs [b, S - 1] of the given micro-batches, forward only (the last pipeline stage; [] elsewhere)
Rescore = Callable[[list[MicroBatch]], list[torch.Tensor]]


class RouterReplayError(UserError, ValueError):
    """actor.router_replay cannot run as asked: a dense model, a layout it does not follow, ids of the wrong shape."""


def moe_layer_indices(tcfg: Any) -> list[int]:
    """0-based global indices of the model's MoE layers, in order (megatron-core's ``moe_layer_freq`` rule)."""
    freq = tcfg.moe_layer_freq
    if isinstance(freq, int):
        return [i for i in range(tcfg.num_layers) if i % freq == 0]
    return [i for i, moe in enumerate(freq) if moe]


class _LayerReplay:
    """One MoE layer's router hook: megatron's ``router_replay`` duck type (``get_replay_topk``)."""

    def __init__(self, moe_index: int) -> None:
        self.moe_index = moe_index
        self.action: Action = "free"
        self.target: torch.Tensor | None = None  # [tokens, k] expert ids, -1: the router's own choice
        self.own: torch.Tensor | None = None  # the router's own top-k of the last forward
        self.chosen: torch.Tensor | None = None  # what the last forward routed to

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.own = self.chosen = own
        if self.action != "replay" or self.target is None:
            return values, own
        target = self.target.to(device=scores.device, dtype=own.dtype)
        if target.shape != own.shape:
            raise RouterReplayError(
                f"actor.router_replay: MoE layer {self.moe_index} routes {tuple(own.shape)} [tokens, top_k] here but "
                f"was given {tuple(target.shape)} expert ids (Sequences.routed_experts does not follow this layout)"
            )
        self.chosen = torch.where(target[:, :1] >= 0, target, own)
        return scores.gather(1, self.chosen), self.chosen


@dataclass
class _Chunk:
    hooks: list[_LayerReplay]
    policy: bool  # the trained model (counted in the metrics), not the frozen reference


@dataclass
class Recorded:
    """What a recording pass recorded, set when the pass ends: the routing of every row (None: nothing recorded)."""

    routed_experts: torch.Tensor | None = None


@dataclass
class _Pass:
    action: Action
    kind: str
    rows: list[list[int]]  # this rank's micro-batches: their rows of the pass's batch
    store: torch.Tensor | None  # [B, S, L, k] int32, -1 where this rank routed nothing
    seen: dict[int, int] = field(default_factory=dict)  # micro-batches each chunk has run


class RouterReplayer:
    """The actor's routing replay: ``mode`` is ``actor.router_replay``; ``none`` makes every method a no-op."""

    def __init__(self, mode: str, tcfg: Any) -> None:
        self.mode = mode
        self.capture = False  # tests: keep every policy pass's routing (`captured`, [B, S, L, k] per pass)
        self.captured: list[torch.Tensor] = []
        self._chunks: dict[int, _Chunk] = {}
        self._pass: _Pass | None = None
        # the update's first micro-batches and (last pipeline stage) their replayed log-probs, for compare_logp
        self._noted: list[tuple[MicroBatch, torch.Tensor | None]] = []
        self._sums = torch.zeros(5, dtype=torch.float64)  # differing pairs, pairs, |dlogp| replay, no replay, tokens
        self._routing: torch.Tensor | None = None  # the first two, on the routers' device
        if mode == "none":
            return
        if not tcfg.num_moe_experts:
            raise RouterReplayError(
                f"actor.router_replay={mode} needs a mixture-of-experts model; this one is dense (no experts)"
            )
        if tcfg.recompute_granularity == "full" and tcfg.pipeline_model_parallel_size > 1:
            # the pipeline's backward recomputes a micro-batch after later ones ran forward; the hooks hold one
            raise RouterReplayError(
                f"actor.router_replay={mode} with actor.recompute=full needs actor.pp = 1 (the recomputed forward "
                "would replay another micro-batch's experts)"
            )
        tcfg.moe_enable_routing_replay = True
        self.layers = moe_layer_indices(tcfg)
        self.topk = int(tcfg.moe_router_topk)
        self.num_experts = int(tcfg.num_moe_experts)
        self.tp = int(tcfg.tensor_model_parallel_size) if tcfg.sequence_parallel else 1
        self._compared = int(tcfg.pipeline_model_parallel_size) if tcfg.virtual_pipeline_model_parallel_size else 1

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def install(self, policy: Sequence[torch.nn.Module], reference: Sequence[torch.nn.Module] | None) -> None:
        """Hook every router of this rank's chunks of the policy and of the frozen reference (None: none)."""
        if not self.enabled:
            return
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        chunks = [(chunk, True) for chunk in policy] + [(chunk, False) for chunk in reference or []]
        for chunk, is_policy in chunks:
            hooks = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if module.router_replay in RouterReplay.global_router_replay_instances:
                        RouterReplay.global_router_replay_instances.remove(module.router_replay)
                    module.router_replay = _LayerReplay(self.layers.index(module.layer_number - 1))
                    hooks.append(module.router_replay)
            self._chunks[id(chunk)] = _Chunk(hooks, is_policy)

    # ------------------------------------------------------------------------------------------------------------
    @contextmanager
    def pass_over(
        self,
        batch: Sequences,
        plan: Sequence[Sequence[Sequence[int]]],
        kind: str,
        rescore: Rescore | None = None,
    ):
        """One actor pass over ``batch`` as planned (``plan[dp rank]``: this rank's micro-batches' rows); ``kind``
        is ``statistics`` (compute_old_logp), ``update`` or ``other`` (reference, entropy). ``train``: the statistics
        pass records, every pass after it replays; ``rollout``: every pass replays the engine's ids, which the
        statistics pass and the update must have. An update given ``rescore`` then runs ``compare_logp``. Yields
        the pass's `Recorded`, whose routing is there once the pass ends."""
        recorded = Recorded()
        if not self.enabled:
            yield recorded
            return
        from megatron.core import parallel_state as ps

        if self.mode == "train" and kind == "statistics":
            action: Action = "record"
        elif batch.routed_experts is None:
            if self.mode == "rollout" and kind != "other":
                raise RouterReplayError(
                    "actor.router_replay=rollout: the batch carries no routed_experts (the rollout engine returned none)"
                )
            action = "free"
        else:
            self._check_shape(batch)
            action = "replay"
        store = None
        if action == "record" or self.capture:
            b, s = batch.tokens.shape
            store = torch.full((b, s, len(self.layers), self.topk), -1, dtype=torch.int32)
        mine = [list(rows) for rows in plan[ps.get_data_parallel_rank()]]
        self._pass, self._noted = _Pass(action, kind, mine, store), []
        try:
            yield recorded
        finally:
            done, self._pass = self._pass, None
        if done.store is not None:
            routed = self._merge(done.store)
            if action == "record":
                recorded.routed_experts = routed
            if self.capture:
                self.captured.append(routed)
        if rescore is not None:
            self.compare_logp(rescore)

    def forward(
        self, model: torch.nn.Module, mb: MicroBatch, forward: Callable[[torch.nn.Module, MicroBatch], torch.Tensor]
    ) -> torch.Tensor:
        """``forward(model, mb)``, the model call of one micro-batch, inside `micro_batch`."""
        with self.micro_batch(model, mb):
            return forward(model, mb)

    @contextmanager
    def micro_batch(self, model: torch.nn.Module, mb: MicroBatch) -> Iterator[None]:
        """Around one model call on micro-batch ``mb``: its rows ``mb.seqs``, run as the stream ``mb.packed`` or
        (None) as the padded block."""
        seqs, packed = mb.seqs, mb.packed
        while hasattr(model, "module"):  # DDP (and any other wrapper) around the chunk the hooks were put on
            model = model.module
        chunk = self._chunks.get(id(model))
        p = self._pass
        if chunk is None or p is None:  # (a chunk without MoE layers still takes part: it notes the micro-batch)
            yield
            return
        if p.action == "replay":
            local = self._to_local(seqs.routed_experts.long() + 1, packed) - 1  # [tokens here, L, k], -1 unknown
            for hook in chunk.hooks:
                hook.target = local[:, hook.moe_index]
        for hook in chunk.hooks:
            hook.action = p.action
        yield
        index = p.seen.get(id(chunk), 0)
        p.seen[id(chunk)] = index + 1
        if chunk.policy and p.action == "replay":
            self._count_mismatch(chunk, seqs, packed)
            noted = any(m is mb for m, _ in self._noted)
            if p.kind == "update" and not noted and len(self._noted) < self._compared:
                self._noted.append((mb, None))  # on every stage: compare_logp runs a pipeline schedule
        if p.store is not None and chunk.policy:
            self._keep(chunk, p.store, p.rows[index], seqs, packed)

    # ------------------------------------------------------------------------------------------------------------
    def note_logp(self, mb: MicroBatch, logp: torch.Tensor) -> None:
        """The update's log-probs of micro-batch ``mb`` (its forward replayed); the first ones are kept for
        ``compare_logp`` (one; ``pp`` under the interleaved schedule, which runs micro-batches ``pp`` at a time)."""
        for i, (m, _) in enumerate(self._noted):
            if m is mb:
                self._noted[i] = (mb, logp.detach().float().clone())

    def compare_logp(self, rescore: Rescore) -> None:
        """After an update's schedule (``pass_over(..., rescore=)``), before its optimizer step: the noted
        micro-batches again through ``rescore`` (the policy's forward), no grad, routing freely; both log-probs
        against the target (the engine's under ``rollout``, the statistics pass's under ``train``). Runs on every
        rank (a pipeline schedule) when the update replayed."""
        noted, self._noted = self._noted, []
        if not noted:
            return
        self._pass = _Pass("free", "other", [], None)
        try:
            with torch.no_grad():
                rescored = rescore([mb for mb, _ in noted])
        finally:
            self._pass = None
        for (mb, replayed), logp in zip(noted, rescored):  # the last pipeline stage only: [] elsewhere
            seqs = mb.seqs
            if replayed is None or not isinstance(seqs, TrainingRows):
                continue
            target = seqs.engine_logp if self.mode == "rollout" and seqs.engine_logp is not None else seqs.old_logp
            if target is None:
                continue
            mask = seqs.response_mask.to(replayed.device).float()
            target = target.to(replayed.device).float()
            self._sums[2] += float(((replayed - target).abs() * mask).sum())
            self._sums[3] += float(((logp.to(replayed.device) - target).abs() * mask).sum())
            self._sums[4] += float(mask.sum())

    def metrics(self) -> dict[str, float]:
        """The metrics since the last call (a collective: every rank calls it)."""
        if not self.enabled:
            return {}
        sums = self._sums.clone()
        if self._routing is not None:
            sums[:2] += self._routing.cpu()
        self._sums.zero_()
        self._routing = None
        if dist.is_initialized():
            from megatron_rlvr.runtime import distributed

            reduced = sums.to(distributed.device())
            dist.all_reduce(reduced)
            sums = reduced.cpu()
        out = {}
        if sums[1] > 0:
            out["moe/routing_mismatch"] = float(sums[0] / sums[1])
        if sums[4] > 0:
            out["moe/logp_mismatch_replay"] = float(sums[2] / sums[4])
            out["moe/logp_mismatch_no_replay"] = float(sums[3] / sums[4])
        return out

    # ------------------------------------------------------------------------------------------------------------
    def _check_shape(self, batch: Sequences) -> None:
        b, s = batch.tokens.shape
        want = (b, s, len(self.layers), self.topk)
        routed = batch.routed_experts
        if tuple(routed.shape) != want or routed.dtype.is_floating_point or routed.dtype == torch.bool:
            raise RouterReplayError(
                f"Sequences.routed_experts: expected integer expert ids of shape {list(want)} [B, S, MoE layers, "
                f"top_k] for actor.router_replay={self.mode}, got {routed.dtype} {list(routed.shape)}"
            )
        if bool((routed >= self.num_experts).any()) or bool((routed < -1).any()):
            raise RouterReplayError(
                f"Sequences.routed_experts: expert ids must lie in 0..{self.num_experts - 1} (-1: not routed)"
            )

    def _sp_slice(self, values: torch.Tensor) -> torch.Tensor:
        """[s, b, ...] -> this rank's sequence-parallel share of s (what its routers see)."""
        if self.tp == 1:
            return values
        from megatron.core import parallel_state as ps

        return values.chunk(self.tp)[ps.get_tensor_model_parallel_rank()]

    def _to_local(self, values: torch.Tensor, packed: PackedLayout | None) -> torch.Tensor:
        """A per-token field of the micro-batch's padded block [b, S, ...] -> the router's token order [n, ...]
        (zeros where a stream position is padding)."""
        ordered = packed.gather(values).unsqueeze(1) if packed is not None else values.transpose(0, 1)
        return self._sp_slice(ordered).flatten(0, 1)

    def _real(self, seqs: Sequences, packed: PackedLayout | None) -> torch.Tensor:
        lengths = torch.tensor(sequence_lengths(seqs.response_mask))
        real = torch.arange(seqs.tokens.shape[1])[None, :] < lengths[:, None]
        return self._to_local(real, packed)

    def _count_mismatch(self, chunk: _Chunk, seqs: Sequences, packed: PackedLayout | None) -> None:
        """Counted where the router ran (no host sync per layer: the counts stay on its device until `metrics`)."""
        real = None
        for hook in chunk.hooks:
            if hook.own is None:
                continue
            own, chosen = hook.own, hook.chosen
            if real is None:
                real = self._real(seqs, packed).to(own.device)
            counted = real & (hook.target.to(own.device)[:, 0] >= 0)
            differs = (own.sort(dim=-1).values != chosen.sort(dim=-1).values).any(dim=-1)
            counts = torch.stack([(differs & counted).sum(), counted.sum()]).double()
            self._routing = counts if self._routing is None else self._routing + counts

    def _keep(self, chunk: _Chunk, store: torch.Tensor, rows: list[int], seqs: Sequences, packed) -> None:
        """Put the micro-batch's routing (this chunk's layers, this rank's tokens) into ``store`` at its rows."""
        b, s = seqs.tokens.shape
        full_len = packed.num_tokens if packed is not None else s
        width = 1 if packed is not None else b
        ordered = torch.full((full_len, width, len(self.layers), self.topk), -1, dtype=torch.int32)
        for hook in chunk.hooks:
            if hook.chosen is None:
                continue
            mine = hook.chosen.cpu().to(torch.int32).view(-1, width, self.topk)
            start = 0
            if self.tp > 1:
                from megatron.core import parallel_state as ps

                start = ps.get_tensor_model_parallel_rank() * mine.shape[0]
            ordered[start : start + mine.shape[0], :, hook.moe_index] = mine
        if packed is not None:
            padded = torch.full((b, s, len(self.layers), self.topk), -1, dtype=torch.int32)
            real = packed.token_rows >= 0
            padded[packed.token_rows[real], packed.token_cols[real]] = ordered[real, 0]
        else:
            padded = ordered.transpose(0, 1)
        index = torch.tensor(rows)
        store[index] = torch.maximum(store[index], padded)

    def _merge(self, store: torch.Tensor) -> torch.Tensor:
        """Every rank's share (rows by DP, layers by PP, tokens by SP) -> the whole [B, S, L, k] on every rank."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            from megatron_rlvr.runtime import distributed

            merged = store.to(distributed.device())
            dist.all_reduce(merged, op=dist.ReduceOp.MAX)
            store = merged.cpu()
        return store.to(torch.int16 if self.num_experts < 2**15 else torch.int32)
