"""Context parallelism through the real training loop (docs/context-parallel.md): the demo recipe
(configs/demo_cpu.yaml) at actor.cp=2 actor.tp=1, whose first step equals actor.cp=1 (loss and grad norm, relative
1e-4). The tiny model's run at actor.cp=2 with vLLM rollouts, the KL reference and checkpoints, resumed, is the "cp"
row of tests/integration/test_resume_layouts.py."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


def _demo_first_step(out_dir: str, cp: int) -> dict[str, float]:
    from megatron_rlvr.config import load_config
    from megatron_rlvr.runtime import distributed
    from megatron_rlvr.trainer import train

    cfg = load_config(
        str(DEMO),
        [
            f"actor.cp={cp}",
            "actor.tp=1",
            "trainer.steps=1",
            "trainer.eval_every=0",
            "trainer.tensorboard=false",
            "trainer.save_hf=false",
            "checkpoint.save_every=0",
            f"trainer.output_dir={out_dir}",
        ],
    )
    try:
        return train(cfg)[0]
    finally:
        distributed.destroy_model_parallel()


def test_demo_recipe_at_cp2_first_step_equals_cp1(workers2, tmp_path):
    cp2 = workers2.run(_demo_first_step, str(tmp_path / "cp2"), 2, timeout_s=900)[0]
    cp1 = workers2.run(_demo_first_step, str(tmp_path / "cp1"), 1, timeout_s=900)[0]
    print({k: (cp2[k], cp1[k]) for k in ("actor/loss", "actor/grad_norm", "reward/mean")})
    assert cp2["reward/mean"] == cp1["reward/mean"]  # the same rollouts: the engines need no CP
    for key in ("actor/loss", "actor/grad_norm"):
        assert cp2[key] == pytest.approx(cp1[key], rel=1e-4), key
