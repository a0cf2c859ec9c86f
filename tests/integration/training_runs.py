"""The tiny training runs the loop's tests share: the run's config (a random tiny Qwen2, 4 samples a group, 6 new
tokens), one run in a worker group's ranks (with the loop's `Parts` a test replaces), one with the order of the
engine's and the actor's calls recorded, and the metrics a resumed run must repeat exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rlvr.trainer import Parts


def make_tiny_model(directory: Path) -> str:
    """The loop tests' model: a random tiny Qwen2 written as a HF checkpoint under ``directory``."""
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", directory, seed=5))


COMPARED = ("reward/mean", "actor/loss", "actor/grad_norm", "loss/entropy", "loss/rank1_prob")


def run_config(hf_dir: str, out_dir: str, tp: int, pp: int, steps: int, extra: list[str] = ()):  # noqa: B006
    from megatron_rlvr.config import load_config

    return load_config(
        None,
        [
            f"model.hf_dir={hf_dir}",
            f"actor.tp={tp}",
            f"actor.pp={pp}",
            "actor.micro_batch_size=4",
            "actor.lr=1e-3",
            "algo.loss.kind=entropy_bonus",
            "algo.loss.beta=0.05",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "rollout.max_model_len=64",
            "rollout.kv_cache_memory_bytes=16777216",
            "data.max_prompt_tokens=48",
            "reward.workers=1",
            "data.demo_train_problems=64",
            f"trainer.steps={steps}",
            "trainer.prompts_per_step=2",
            "trainer.tensorboard=false",
            f"trainer.output_dir={out_dir}",
            *extra,
        ],
    )


def train(
    hf_dir: str,
    out_dir: str,
    tp: int,
    pp: int,
    steps: int,
    extra: list[str] = (),  # noqa: B006
    parts: Callable[[], Parts] | None = None,
):
    """The run, in this rank; ``parts`` (an importable function, called in the rank) gives the loop's replaced
    components."""
    from megatron_rlvr import trainer
    from megatron_rlvr.runtime import distributed

    try:
        return trainer.train(run_config(hf_dir, out_dir, tp, pp, steps, extra), parts() if parts else trainer.Parts())
    finally:
        distributed.destroy_model_parallel()


def train_recording_calls(hf_dir: str, out_dir: str, tp: int, pp: int, steps: int, extra: list[str]):
    """train, with the order of the engine's and the actor's calls recorded."""
    from megatron_rlvr.testing.loop_fakes import RecordingEngine, recording_actor, wrapped_engines
    from megatron_rlvr.trainer import Parts

    calls: list[str] = []
    parts = Parts(engine=wrapped_engines(lambda e: RecordingEngine(e, calls)), actor=recording_actor(calls))
    return train(hf_dir, out_dir, tp, pp, steps, extra, lambda: parts), calls
