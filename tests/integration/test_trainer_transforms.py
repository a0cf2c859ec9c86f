"""An algorithm plugs into the loop through the experience-transform registry (experience/transforms.py), and the
loop hands each step's experience on without writing into it: a toy transform registered from here, with nothing
in trainer.py naming it, zeroes every advantage and adds a metric; a real 2-step run on 2 ranks applies it (the
metric is logged, and GRPO's loss and gradient are exactly 0), and no tensor of any step's rollouts or targets was
written after the transform handed them over (statistics, update, weight sync, logging)."""

from __future__ import annotations

import dataclasses

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]


class ZeroAdvantages:
    """The toy transform: every advantage 0, a ``toy/applied`` metric; it keeps what it handed over."""

    def __init__(self) -> None:
        self.handed: list = []  # (experience, the version counters of its tensors when handed over)

    def before(self, step: int) -> dict[str, float]:
        return {"toy/before": float(step)}

    def __call__(self, step: int, experience):
        import torch

        from megatron_rlvr.testing.handoffs import versions

        targets = dataclasses.replace(experience.targets, advantages=torch.zeros_like(experience.targets.advantages))
        out = dataclasses.replace(experience, targets=targets, metrics=experience.metrics | {"toy/applied": 1.0})
        self.handed.append((out, versions(out.rollouts, out.targets)))
        return out


def _train_with_toy_transform(hf_dir: str, out_dir: str):
    from megatron_rlvr.config import load_config
    from megatron_rlvr.experience.transforms import registered
    from megatron_rlvr.runtime import distributed
    from megatron_rlvr.testing.handoffs import assert_untouched
    from megatron_rlvr.trainer import train

    toy = ZeroAdvantages()
    cfg = load_config(
        None,
        [
            f"model.hf_dir={hf_dir}",
            "actor.tp=2",
            "actor.micro_batch_size=4",
            "algo.loss.kind=grpo",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "rollout.max_model_len=64",
            "rollout.kv_cache_memory_bytes=16777216",
            "data.max_prompt_tokens=48",
            "data.demo_train_problems=64",
            "reward.workers=1",
            "trainer.steps=2",
            "trainer.prompts_per_step=2",
            "trainer.tensorboard=false",
            "trainer.save_hf=false",
            f"trainer.output_dir={out_dir}",
        ],
    )
    try:
        with registered("toy", lambda setup: toy, enabled=lambda cfg: True):
            history = train(cfg)
    finally:
        distributed.destroy_model_parallel()
    for experience, handed in toy.handed:
        assert_untouched(handed, experience.rollouts, experience.targets)  # raises naming what was written
    return history, len(toy.handed)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen"), seed=5))


def test_a_registered_transform_is_applied_and_nothing_is_written_into_what_it_hands_over(
    workers2, tiny_model, tmp_path
):
    source = (__import__("pathlib").Path(__file__).resolve().parents[2] / "megatron_rlvr" / "trainer.py").read_text()
    assert "toy" not in source and "ZeroAdvantages" not in source  # the loop does not know it
    for history, handed in workers2.run(_train_with_toy_transform, tiny_model, str(tmp_path / "run"), timeout_s=900):
        assert handed == 2 and [m["step"] for m in history] == [1, 2]
        for m in history:
            assert m["toy/applied"] == 1.0 and m["toy/before"] == m["step"] - 1
            assert m["response/tokens_trained"] > 0  # the step trained tokens, with every advantage 0:
            assert m["actor/loss"] == 0.0 and m["actor/grad_norm"] == 0.0
