"""The sections of the run config that belong to no wing below it: the loop's own (``trainer``) and the machines a
recipe targets (``cluster``)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlvr.settings import setting


@dataclass
class TrainerConfig:
    """The loop: how many steps, prompts per step, and where outputs go."""

    steps: int = setting(10, "Training steps (optimizer steps are steps x mini_batches_per_step).", ge=0)
    prompts_per_step: int = setting(8, "Prompts per step; each gets rollout.group_size responses.", ge=1)
    mini_batches_per_step: int = setting(
        1, "Optimizer steps per training step, each on a slice of whole groups (must divide prompts_per_step).", ge=1
    )
    seed: int = setting(1234, "The run's seed: initial weights' draws, sampling seeds (with the step), the data order.")
    output_dir: str = setting("outputs/run", "Where metrics, checkpoints, logs and the final HF export go.")
    log_every: int = setting(
        1, "Write metrics (metrics.jsonl, TensorBoard, W&B) every N steps, and the last step always.", ge=1
    )
    eval_every: int = setting(
        0, "Validate before training, every N steps and after the last (0 = never; experience/validation.py).", ge=0
    )
    tensorboard: bool = setting(True, "Write TensorBoard event files beside metrics.jsonl.")
    wandb_project: str | None = setting(None, "Log to this Weights & Biases project too (null = no W&B).")
    save_hf: bool = setting(True, "Write the final weights as an HF checkpoint to <output_dir>/hf.")


@dataclass
class ClusterConfig:
    """The machines a recipe targets, as `megatron-rlvr plan` checks them (plan/host_memory.py)."""

    host_memory_gb: float = setting(
        0.0,
        "Host (CPU) memory of one node in GB; the plan refuses a layout whose node total does not fit (0 = not "
        "checked). The H200 recipes assume a DGX H200 node: 2 TB (2000 GB) of system memory.",
        ge=0,
    )
