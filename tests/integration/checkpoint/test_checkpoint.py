"""checkpoint.save/load restore the actor exactly: weights, every Adam state tensor (a step count of its own per
parameter), main params and the LR schedule, so the updates after a resume are bit-identical to the live run's.

Every checkpoint records the size and CRC-32 of each of its files (every rank's): resuming from "latest" names a
missing, truncated or changed file and falls back to the previous checkpoint, and `megatron-rlvr ckpt verify`
runs the same check alone. The damage is done to checkpoints written by the real save at TP=2."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist]


def _batch(seed: int, vocab: int):
    import torch

    from megatron_rlvr.protocols import Targets
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (8, 12), generator=g)
    mask = torch.zeros(8, 11, dtype=torch.bool)
    mask[:, 5:] = True
    return rollouts(tokens, mask), Targets(advantages=torch.randn(8, generator=g))


def _update(actor, seed: int) -> dict[str, float]:
    batch, targets = _batch(seed, actor.vocab_size)
    return actor.update(batch, targets, actor.statistics_pass(batch), mini_batches=2)


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


@contextlib.contextmanager
def _actors(hf_dir: str, tp: int, *overrides: str):
    """Inside megatron's parallel state at (tp, pp=1): a function building a fresh actor of the test's recipe."""
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.config import load_config
    from megatron_rlvr.runtime import distributed

    cfg = load_config(
        None,
        [
            f"model.hf_dir={hf_dir}",
            f"actor.tp={tp}",
            "actor.pp=1",
            "actor.micro_batch_size=2",
            "actor.lr=1e-3",
            "algo.loss.kind=casp",
            *overrides,
        ],
    )
    distributed.initialize_model_parallel(tp=tp, pp=1, seed=0)
    try:
        yield lambda: MegatronActor(cfg.model, cfg.actor, cfg.algo, temperature=1.0, total_steps=10)
    finally:
        distributed.destroy_model_parallel()


def _round_trip(hf_dir: str, ckpt_root: str, tp: int):
    import torch

    from megatron_rlvr import checkpoint
    from megatron_rlvr.testing.train_state import train_state

    with _actors(hf_dir, tp, "actor.lr_warmup_steps=2") as build:
        live = build()
        for seed in range(2):
            _update(live, seed)
        with _warnings_of("megatron.core.dist_checkpointing") as save_warnings:
            checkpoint.save(ckpt_root, 2, live, {"step": 2})
        restored = build()
        checkpoint.load(checkpoint.resolve(ckpt_root, "latest"), restored)
        before, after = train_state(live), train_state(restored)
        differing = sorted(
            k
            for k in before
            if not (torch.equal(before[k], after[k]) if torch.is_tensor(before[k]) else before[k] == after[k])
        )
        next_live = [_update(live, seed) for seed in (5, 6)]
        next_restored = [_update(restored, seed) for seed in (5, 6)]
        return (
            differing,
            before["distinct_step_tensors"],
            after["distinct_step_tensors"],
            next_live,
            next_restored,
            save_warnings,
        )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

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


# ---------------------------------------------------------------------------------------------------------------
# Damaged checkpoints: each file recorded, each kind of damage named, the previous checkpoint used instead


def _params(actor) -> list:
    return [p.detach().clone() for chunk in actor.model_chunks for p in chunk.parameters()]


def _two_saves(hf_dir: str, ckpt_root: str):
    """One update, save step 1; another, save step 2 (TP=2). Returns this rank's weights at step 1."""
    from megatron_rlvr import checkpoint

    with _actors(hf_dir, 2) as build:
        actor = build()
        _update(actor, 0)
        checkpoint.save(ckpt_root, 1, actor, {"step": 1}, keep_last=2)
        at_step_one = _params(actor)
        _update(actor, 1)
        checkpoint.save(ckpt_root, 2, actor, {"step": 2}, keep_last=2)
        return at_step_one


def _resume_latest(hf_dir: str, ckpt_root: str):
    """What every rank resolves "latest" to, and the weights loaded from it."""
    from megatron_rlvr import checkpoint

    with _actors(hf_dir, 2) as build:
        actor = build()
        path = checkpoint.resolve(ckpt_root, "latest")
        state = checkpoint.load(path, actor)
        return path.name, state["step"], _params(actor)


@pytest.fixture(scope="module")
def saved(workers2, tiny_model, tmp_path_factory):
    """A checkpoints root with step-000001 and step-000002, and each rank's weights at step 1."""
    root = tmp_path_factory.mktemp("saved") / "checkpoints"
    return root, workers2.run(_two_saves, tiny_model, str(root))


@pytest.fixture
def root(saved, tmp_path) -> Path:
    """A fresh copy of the saved root, to damage."""
    copy = tmp_path / "checkpoints"
    shutil.copytree(saved[0], copy)
    return copy


def _largest_shard(ckpt: Path) -> Path:
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _truncate(path: Path) -> str:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "(truncated)"


def _delete(path: Path) -> str:
    path.unlink()
    return "missing"


def _flip_byte(path: Path) -> str:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return "content changed"


def test_manifest_is_the_last_file_and_covers_every_ranks_files(saved):
    root = saved[0]
    assert (root / "latest").read_text().strip() == "step-000002"
    for step in ("step-000001", "step-000002"):
        ckpt = root / step
        manifest = json.loads((ckpt / "manifest.json").read_text())
        on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {"manifest.json"}
        assert set(manifest["files"]) == on_disk
        assert {"rng/rank-00000.pt", "rng/rank-00001.pt", "trainer_state.json"} <= on_disk
        assert len([f for f in on_disk if f.endswith(".distcp")]) >= 2  # both TP ranks' shards
        for name, entry in manifest["files"].items():
            assert entry["size"] == (ckpt / name).stat().st_size
        assert (
            max(p.stat().st_mtime_ns for p in ckpt.rglob("*") if p.is_file())
            == (ckpt / "manifest.json").stat().st_mtime_ns
        )


@pytest.mark.parametrize(
    "damage, target",
    [
        (_truncate, _largest_shard),
        (_delete, lambda c: c / "rng" / "rank-00001.pt"),
        (_flip_byte, _largest_shard),
        (_delete, lambda c: c / "manifest.json"),
    ],
    ids=["truncated-shard", "missing-file", "flipped-byte", "no-manifest"],
)
def test_damaged_latest_names_the_file_and_falls_back(root, capsys, damage, target):
    from megatron_rlvr import checkpoint

    victim = target(root / "step-000002")
    reason = damage(victim)
    resolved = checkpoint.resolve(root, "latest")
    err = capsys.readouterr().err
    if victim.name == "manifest.json":  # an old checkpoint (before manifests): used, with a warning
        assert resolved == root / "step-000002"
        assert "no manifest.json" in err and "unverified" in err
        return
    assert resolved == root / "step-000001"
    name = victim.relative_to(root / "step-000002").as_posix()
    assert f"DAMAGED {root / 'step-000002'}: {name}: " in err and reason in err
    assert "falling back to the previous checkpoint" in err and f"resuming from {root / 'step-000001'}" in err


def test_no_usable_checkpoint_is_a_clear_error(root):
    from megatron_rlvr import checkpoint

    shard = _largest_shard(root / "step-000002")
    _truncate(shard)
    _delete(root / "step-000001" / "trainer_state.json")
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.resolve(root, "latest")
    message = str(e.value)
    assert f"no usable checkpoint in {root}" in message
    assert f"step-000002: {shard.name}: size " in message
    assert "step-000001: trainer_state.json: missing" in message


def test_a_named_damaged_checkpoint_is_not_replaced_by_another(root):
    from megatron_rlvr import checkpoint

    _flip_byte(root / "step-000001" / "trainer_state.json")
    with pytest.raises(checkpoint.CheckpointError, match=r"trainer_state.json: crc32 .*\(content changed\)"):
        checkpoint.resolve(root, str(root / "step-000001"))


def test_latest_pointing_at_a_deleted_checkpoint_falls_back(root, capsys):
    from megatron_rlvr import checkpoint

    shutil.rmtree(root / "step-000002")
    assert checkpoint.resolve(root, "latest") == root / "step-000001"
    assert "step-000002: .: the checkpoint directory is missing" in capsys.readouterr().err


def test_ckpt_verify_command(root, capsys):
    from megatron_rlvr.checkpoint import command as checkpoint

    assert checkpoint.main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 2 and "would resume from step-000002" in out
    shard = _largest_shard(root / "step-000002")
    _truncate(shard)
    assert checkpoint.main(["verify", str(root / "step-000002")]) == 1
    assert f"DAMAGED {root / 'step-000002'}: {shard.name}: size" in capsys.readouterr().out
    assert checkpoint.main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"OK {root / 'step-000001'}" in out and "would resume from step-000001" in out
    assert checkpoint.main(["verify", str(root.parent)]) == 2  # neither a checkpoint nor a root of them
    assert "neither a checkpoint" in capsys.readouterr().err


def test_every_rank_falls_back_and_loads_the_previous_checkpoint(workers2, tiny_model, saved, root):
    import torch

    _truncate(_largest_shard(root / "step-000002"))
    for rank, (name, step, params) in enumerate(workers2.run(_resume_latest, tiny_model, str(root))):
        assert (name, step) == ("step-000001", 1)
        assert all(torch.equal(a, b) for a, b in zip(params, saved[1][rank], strict=True))
