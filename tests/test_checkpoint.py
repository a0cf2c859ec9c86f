"""checkpoint.save/load restore the actor exactly: weights, every Adam state tensor (a step count of its own per
parameter), main params and the LR schedule, so the updates after a resume are bit-identical to the live run's."""

from __future__ import annotations

import contextlib
import logging

import pytest

pytestmark = [pytest.mark.dist]


def _batch(seed: int, vocab: int):
    import torch

    from megatron_rlvr.actor import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (8, 12), generator=g)
    mask = torch.zeros(8, 11, dtype=torch.bool)
    mask[:, 5:] = True
    return SequenceBatch(tokens, mask, torch.randn(8, generator=g))


def _update(actor, seed: int) -> dict[str, float]:
    batch = _batch(seed, actor.vocab_size)
    batch.old_logp = actor.compute_old_logp(batch)
    return actor.update(batch, mini_batches=2)


def _optimizer_state(actor) -> dict[str, object]:
    """Every tensor the next optimizer step reads, by a stable name; plus which step tensors are shared."""
    out: dict[str, object] = {}
    step_ids = set()
    for i, opt in enumerate(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            out[f"{i}/{g}/lr"] = group["lr"]
            for p, param in enumerate(group["params"]):
                out[f"{i}/{g}/{p}/main_param"] = param.detach().clone()
                for key, value in inner.state[param].items():
                    out[f"{i}/{g}/{p}/{key}"] = value.detach().clone()
                step_ids.add(id(inner.state[param]["step"]))
    for c, chunk in enumerate(actor.model_chunks):
        for name, param in chunk.named_parameters():
            out[f"model{c}/{name}"] = param.detach().clone()
    out["scheduler"] = actor.scheduler.state_dict()
    out["distinct_step_tensors"] = len(step_ids)
    return out


@contextlib.contextmanager
def _warnings_of(logger_name: str):
    """The messages of the warnings ``logger_name`` (and its children) log inside the block."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler, logger = Collect(logging.WARNING), logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _round_trip(hf_dir: str, ckpt_root: str, tp: int):
    import torch

    from megatron_rlvr import checkpoint, distributed
    from megatron_rlvr.actor import MegatronActor
    from megatron_rlvr.config import load_config

    cfg = load_config(None, [f"model.hf_dir={hf_dir}", f"actor.tp={tp}", "actor.pp=1", "actor.micro_batch_size=2",
                             "actor.lr=1e-3", "actor.lr_warmup_steps=2", "algo.loss=casp"])
    distributed.initialize_model_parallel(tp=tp, pp=1, seed=0)
    try:
        def build() -> MegatronActor:
            return MegatronActor(cfg.model, cfg.actor, cfg.algo, temperature=1.0, total_steps=10)

        live = build()
        for seed in range(2):
            _update(live, seed)
        with _warnings_of("megatron.core.dist_checkpointing") as save_warnings:
            checkpoint.save(ckpt_root, 2, live, {"step": 2})
        restored = build()
        checkpoint.load(checkpoint.resolve(ckpt_root, "latest"), restored)
        before, after = _optimizer_state(live), _optimizer_state(restored)
        differing = sorted(k for k in before if not (
            torch.equal(before[k], after[k]) if torch.is_tensor(before[k]) else before[k] == after[k]))
        next_live = [_update(live, seed) for seed in (5, 6)]
        next_restored = [_update(restored, seed) for seed in (5, 6)]
        return (differing, before["distinct_step_tensors"], after["distinct_step_tensors"], next_live, next_restored,
                save_warnings)
    finally:
        distributed.destroy_model_parallel()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megatron_rlvr.models.tiny import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen"), seed=5))


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_resumed_optimizer_equals_live_one(workers2, tiny_model, tmp_path, tp):
    for differing, live_steps, restored_steps, next_live, next_restored, save_warnings in workers2.run(
        _round_trip, tiny_model, str(tmp_path / "ckpt"), tp
    ):
        assert not [m for m in save_warnings if "incomplete" in m]  # the save starts in an empty directory
        assert differing == []
        assert restored_steps == live_steps  # each parameter counts its own steps, as in the live optimizer
        assert next_restored == next_live  # two more mini-batch updates: every metric bit-identical
