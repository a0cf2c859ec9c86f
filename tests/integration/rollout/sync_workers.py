"""Worker-side code of the actor -> engine sync test: an actor at (TP, PP) in a gloo group, rank 0 holding a CPU
vLLM engine, weights streamed through the bridge's export, log-probs of fixed sequences from both sides."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from tests.integration.models.mp_helpers import build_chunks, pipeline_logits


def _actor_logprobs(chunks, seqs: list[list[int]], vocab: int) -> list[torch.Tensor] | None:
    """log p(seq[t] | seq[:t]), t >= 1, per sequence, on the last pipeline stage (None elsewhere)."""
    out = []
    for seq in seqs:  # one sequence at a time (no padding to reason about); every stage runs every forward
        logits = pipeline_logits(chunks, torch.tensor([seq]))
        if logits is not None:
            logp = torch.log_softmax(logits[0, :-1, :vocab].float(), dim=-1)
            out.append(logp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0])
    return out or None


@torch.no_grad()
def _actor_logit_scale(chunks, seqs: list[list[int]], vocab: int) -> float | None:
    """max |logit| over ``seqs``' positions on the last pipeline stage (None elsewhere): the size the fp32 bound of a
    log-prob comparison scales with (megatron_rlvr/testing/rounding.py)."""
    scales = []
    for seq in seqs:
        logits = pipeline_logits(chunks, torch.tensor([seq]))
        if logits is not None:
            scales.append(logits[0, :, :vocab].float().abs().max().item())
    return max(scales) if scales else None


@torch.no_grad()
def _change_weights(chunks) -> None:
    """A deterministic elementwise change of every parameter (same on TP replicas and on the tied copies of the
    embedding on the first and last stages), standing in for an optimizer step."""
    for chunk in chunks:
        for param in chunk.parameters():
            param.add_(0.05 * torch.sin(param * 37.0 + 1.0))


def sync_and_compare(
    hf_dir: str,
    tp: int,
    pp: int,
    seqs: list[list[int]],
    bucket_bytes: int,
    lend: bool = False,
    staging: str = "full",
    ep: int = 1,
    etp: int | None = None,
) -> dict:
    """Two rounds of (export -> rank 0's engine.update_weights -> log-probs on both sides); a weight change between.
    ``lend``: rank 0 takes lent buckets (``update_weights(lent=True)``), the other ranks only serve (receive=False).
    ``ep``/``etp``: the actor's expert layout (a MoE model)."""
    from megatron_rlvr.bridge import export_hf_weights
    from megatron_rlvr.runtime import distributed

    engine = None
    try:
        hf, chunks = build_chunks(hf_dir, tp, pp, ep=ep, etp=etp)
        for chunk in chunks:
            chunk.eval()  # forward passes only (MoE at TP > 1 runs only in eval mode on CPU, docs/moe.md)
        if dist.get_rank() == 0:
            from megatron_rlvr.models.dims import ModelDims
            from megatron_rlvr.rollout import RolloutConfig, make_engine
            from megatron_rlvr.rollout.readback import unreadable

            cfg = RolloutConfig(  # check_sync reads the weights back: not possible for experts (readback.unreadable)
                max_model_len=256,
                kv_cache_memory_bytes=32 << 20,
                check_sync=unreadable(ModelDims.from_hf(hf)) is None,
                sync_staging=staging,
            )
            engine = make_engine(hf_dir, cfg)
        rounds = []
        for step in range(2):
            if step == 1:
                _change_weights(chunks)
            receive = not lend or dist.get_rank() == 0
            buckets = export_hf_weights(chunks, hf, bucket_bytes=bucket_bytes, receive=receive, lend=lend)
            stream = itertools.chain.from_iterable(buckets)
            if engine is not None:
                engine.update_weights(stream, lent=lend)  # check_sync: also reads the engine's weights back
            else:
                for _ in stream:  # the export is a collective: every rank iterates it to the end
                    pass
            rounds.append(
                {
                    "actor": _actor_logprobs(chunks, seqs, hf["vocab_size"]),
                    "scale": _actor_logit_scale(chunks, seqs, hf["vocab_size"]),
                    "engine": [torch.tensor(x) for x in engine.prompt_logprobs(seqs)] if engine is not None else None,
                }
            )
        return {"rank": dist.get_rank(), "rounds": rounds}
    finally:
        if engine is not None:
            engine.close()
        distributed.destroy_model_parallel()


def adopted_syncs_keep_the_guarantee(hf_dir: str, seqs: list[list[int]], bucket_bytes: int) -> dict:
    """TP=2, rank 0's engine adopts lent tensors (``full`` staging). After a good sync, a lent stream with a wrong shape
    in its last tensor is refused and an export drained with no engine both leave the engine's log-probs bit-identical
    (the export wrote the slot the engine does not hold); with both slots held the export lends nothing; a good sync
    after that gives the actor's log-probs, the engine then holding the other slot."""
    from megatron_rlvr.bridge import export_hf_weights
    from megatron_rlvr.bridge.lent_slots import LentSlot, hold_lent_slot, lent_slot_of, release_lent_slot
    from megatron_rlvr.rollout import RolloutConfig, WeightSyncError, make_engine
    from megatron_rlvr.runtime import distributed

    engine = None
    out: dict = {"rank": dist.get_rank()}
    try:
        hf, chunks = build_chunks(hf_dir, 2, 1)
        rank0 = dist.get_rank() == 0
        if rank0:
            cfg = RolloutConfig(max_model_len=256, kv_cache_memory_bytes=32 << 20, sync_staging="full")
            engine = make_engine(hf_dir, cfg)

        def stream(bad: bool = False):
            items = itertools.chain.from_iterable(
                export_hf_weights(chunks, hf, bucket_bytes=bucket_bytes, receive=rank0, lend=True)
            )
            items = list(items) if not rank0 else items
            last = None
            for item in items:
                if last is not None:
                    yield last
                last = item
            if last is not None:
                yield (last[0], last[1][:-1]) if bad else last

        def sync(bad: bool = False) -> str:
            if engine is None:
                for _ in stream():
                    pass
                return "served"
            try:
                engine.update_weights(stream(bad), lent=True)
            except WeightSyncError as e:
                return f"refused: {str(e).splitlines()[0]}"
            return "ok"

        def engine_logprobs():
            return [torch.tensor(x) for x in engine.prompt_logprobs(seqs)] if engine is not None else None

        out["first"] = sync()
        first = engine_logprobs()
        out["holding_after_first"] = sorted(s.index for s in engine._direct._holding) if engine else None
        _change_weights(chunks)
        out["bad"] = sync(bad=True)
        after_bad = engine_logprobs()
        for _ in itertools.chain.from_iterable(export_hf_weights(chunks, hf, bucket_bytes=bucket_bytes, lend=True)):
            pass  # every rank receiving (lent where possible), no engine: writes the free slot
        after_export = engine_logprobs()
        if engine is not None:
            out["bit_identical_after_bad"] = all(torch.equal(a, b) for a, b in zip(first, after_bad))
            out["bit_identical_after_export"] = all(torch.equal(a, b) for a, b in zip(first, after_export))
            out["alive"] = engine.generate is not None and len(engine.prompt_logprobs(seqs[:1])) == 1
        # Both slots held on rank 0 (its engine holds one; a stand-in the other): nothing is lent, on any rank.
        plan = chunks[0]._megatron_rlvr_export_plan
        extra = LentSlot(id(plan.lend_exchange), 1 - out["holding_after_first"][0]) if rank0 else None
        if extra is not None:
            hold_lent_slot(extra)
        lent_any = False
        for bucket in export_hf_weights(chunks, hf, bucket_bytes=bucket_bytes, lend=True):
            lent_any = lent_any or any(lent_slot_of(t) is not None for _, t in bucket)
        if extra is not None:
            release_lent_slot(extra)
        out["lent_with_both_held"] = lent_any
        out["good"] = sync()
        out["holding_after_good"] = sorted(s.index for s in engine._direct._holding) if engine else None
        out["engine"] = engine_logprobs()
        out["actor"] = _actor_logprobs(chunks, seqs, hf["vocab_size"])
        out["scale"] = _actor_logit_scale(chunks, seqs, hf["vocab_size"])
        return out
    finally:
        if engine is not None:
            engine.close()
        distributed.destroy_model_parallel()
