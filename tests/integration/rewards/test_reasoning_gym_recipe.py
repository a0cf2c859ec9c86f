"""configs/reasoning_gym_cpu.yaml trains: its header's `data prepare reasoning-gym` command writes the rows, and two
training steps on 2 gloo processes score every response with reasoning-gym's countdown score_answer in the reward
workers (counted under reward/verifier/reasoning_gym:countdown, no errors, timeouts or crashes)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from megatron_rlvr.data.prepare import main as data_main

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "configs" / "reasoning_gym_cpu.yaml"
PROMPTS, GROUP = 4, 4


def header_prepare_command() -> list[str]:
    """The `megatron-rlvr data prepare ...` command of the recipe's header comment, as arguments."""
    lines, taking = [], False
    for line in RECIPE.read_text().splitlines():
        text = line.lstrip("#").strip()
        taking = taking or text.startswith("megatron-rlvr data prepare")
        if taking:
            lines.append(text.rstrip("\\").strip())
            if not text.endswith("\\"):
                break
    args = shlex.split(" ".join(lines))
    assert args[:2] == ["megatron-rlvr", "data"], args
    return args[2:]


def _train_two_steps(data_path: str, out_dir: str):
    from megatron_rlvr.config import load_config
    from megatron_rlvr.runtime import distributed
    from megatron_rlvr.trainer import train

    cfg = load_config(
        RECIPE,
        [
            f"model.hf_dir={ROOT / 'megatron_rlvr' / 'demo' / 'model'}",
            f"data.path={data_path}",
            f"trainer.output_dir={out_dir}",
            "trainer.steps=2",
            f"trainer.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}",
            "checkpoint.save_every=0",
            "trainer.tensorboard=false",
            "trainer.save_hf=false",
        ],
    )
    try:
        return train(cfg)
    finally:
        distributed.destroy_model_parallel()


def test_the_recipe_trains_two_steps_on_a_reasoning_gym_task(workers2, tmp_path):
    args = header_prepare_command()
    data = tmp_path / "train.jsonl"
    args[args.index("--out") + 1] = str(data)
    args[args.index("--size") + 1] = "64"  # the recipe's 512, fewer for the test
    assert data_main(args) == 0
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert rows and {r["task"] for r in rows} == {"reasoning_gym:countdown"}
    assert all(len(r["answer"]["metadata"]["numbers"]) == 3 for r in rows)
    histories = workers2.run(_train_two_steps, str(data), str(tmp_path / "run"), timeout_s=900)
    history = histories[0]
    assert [len(h) for h in histories] == [2, 2]
    for metrics in history:
        assert metrics["reward/verifier/reasoning_gym:countdown"] == PROMPTS * GROUP  # every response, both ranks
        assert metrics["reward/errors"] == metrics["reward/timeouts"] == metrics["reward/crashes"] == 0
        assert 0.01 - 1e-6 <= metrics["reward/mean"] <= 1.0  # score_answer gives any answer 0.01 at least
        assert metrics["response/tokens_trained"] > 0
    print(
        "reasoning_gym_cpu, 2 steps:",
        [{k: round(v, 4) for k, v in m.items() if k.startswith("reward/")} for m in history],
    )
