"""Worker-side code of the separate-placement tests: an actor at (TP, PP) on its own ranks, a CPU vLLM engine on an
engine rank of its own, the weights sent through the experience source's protocol (rollout/transfer.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.integration.rollout.sync_workers import _actor_logit_scale, _actor_logprobs, _change_weights


class _ExportingActor:
    """The one method of MegatronActor the experience source calls when it sends weights."""

    def __init__(self, chunks, hf) -> None:
        self.chunks, self.hf = chunks, hf

    def engine_weights(self, bucket_bytes: int, lend: bool = False):
        from megatron_rlvr.bridge import export_hf_weights

        return export_hf_weights(self.chunks, self.hf, bucket_bytes=bucket_bytes, lend=lend)


def separate_sync_and_compare(
    hf_dir: str, tp: int, pp: int, seqs: list[list[int]], bucket_bytes: int, ep: int = 1
) -> dict:
    """Split the world (last rank: the engine), send the actor's weights twice (a change between), and return each
    side's log-probs of ``seqs`` after each transfer. ``ep``: the actor's expert-parallel size (a MoE model; ETP 1)."""
    from megatron_rlvr.experience.engine_ranks import EngineRanksSource
    from megatron_rlvr.rollout import RolloutConfig
    from megatron_rlvr.runtime import distributed
    from megatron_rlvr.runtime import roles as roles_mod

    roles = roles_mod.split_roles(1, timeout_s=300)
    engine = None
    rollout = RolloutConfig(max_model_len=256, kv_cache_memory_bytes=32 << 20, bucket_bytes=bucket_bytes)
    try:
        if roles.is_engine:
            from megatron_rlvr.rollout import make_engine
            from megatron_rlvr.rollout.transfer import WeightReceiver, load_weights

            engine = make_engine(hf_dir, rollout)
            receiver = WeightReceiver(roles.cross, engine_tp=1, engine_tp_rank=0, dims=None, shard=False)
            rounds = []
            while (command := roles_mod.broadcast_object(roles.cross_objects)).kind != "stop":
                assert command.kind == "weights", command
                version = load_weights(engine, receiver)
                rounds.append({"version": version, "logp": [torch.tensor(x) for x in engine.prompt_logprobs(seqs)]})
            return {"role": "engine", "rounds": rounds}
        from tests.integration.models.mp_helpers import build_chunks

        hf, chunks = build_chunks(hf_dir, tp, pp, ep=ep, etp=1 if ep > 1 else None)
        for chunk in chunks:
            chunk.eval()  # forward passes only (docs/moe.md: MoE at TP > 1 runs in eval mode on CPU)
        cfg = SimpleNamespace(trainer=SimpleNamespace(steps=2), rollout=rollout)
        source = EngineRanksSource(cfg, roles, _ExportingActor(chunks, hf), None, None, 0, start_step=0)
        rounds = [
            {
                "logp": _actor_logprobs(chunks, seqs, hf["vocab_size"]),
                "scale": _actor_logit_scale(chunks, seqs, hf["vocab_size"]),
                "transfer": source.take_transfer_metrics(),
            }
        ]
        _change_weights(chunks)
        source._ensure_weights(1)  # what after_update does when the next step samples with the new weights
        rounds.append(
            {
                "logp": _actor_logprobs(chunks, seqs, hf["vocab_size"]),
                "scale": _actor_logit_scale(chunks, seqs, hf["vocab_size"]),
                "transfer": source.take_transfer_metrics(),
            }
        )
        source.close()
        return {"role": "actor", "rounds": rounds}
    except BaseException:
        import traceback

        traceback.print_exc()  # the peers then fail on the broken split; this names the cause
        raise
    finally:
        if engine is not None:
            engine.close()
        if not roles.is_engine:
            distributed.destroy_model_parallel()
        roles_mod.unsplit_roles()
