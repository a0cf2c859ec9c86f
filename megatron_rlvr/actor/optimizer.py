"""The actor's optimizer and LR schedule (megatron-core's Adam, distributed over DP or not), and the repairs their
state needs around a checkpoint load (checkpoint/store.py saves and loads through the actor's `TrainState`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_rlvr.actor.config import ActorConfig

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def build_optimizer(
    model: list[torch.nn.Module], a: ActorConfig, total_steps: int
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Adam over the DDP-wrapped chunks ``model`` and its schedule: warm-up, then ``lr_decay_style`` to ``min_lr``
    over ``total_steps``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=a.lr,
        min_lr=a.min_lr,
        weight_decay=a.weight_decay,
        adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2,
        adam_eps=a.adam_eps,
        clip_grad=a.grad_clip,
        bf16=a.bf16,
        params_dtype=torch.float32,
        use_distributed_optimizer=a.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_cfg, model)
    steps = max(1, total_steps)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if a.lr_warmup_steps else a.lr,
        max_lr=a.lr,
        min_lr=a.min_lr,
        lr_warmup_steps=a.lr_warmup_steps,
        lr_decay_steps=steps,
        lr_decay_style=a.lr_decay_style,
        start_wd=a.weight_decay,
        end_wd=a.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def prepare_for_load(optimizer: MegatronOptimizer) -> None:
    """A fresh distributed optimizer has no Adam state yet, and its state_dict() (used to build the load request)
    needs one: fill it with placeholders first, as megatron's own loading path does."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()


def restore_torch_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Give every parameter its saved Adam step count back, as a tensor of its own.

    With torch's Adam as the inner optimizer (no Transformer Engine or Apex), megatron-core 0.16 saves the step
    count in the param groups, restores it into ONE tensor shared by every parameter's state, and then its
    dp-reshardable parameter-state load copies the load request's placeholder step (1) into that tensor. Resumed
    training would then use the wrong bias correction from the second step on (and a shared step tensor would be
    incremented once per parameter). A no-op for fused optimizers, which keep the step in the param groups only.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param)
                if state is not None and torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def load_schedule(scheduler: OptimizerParamScheduler, state: dict) -> None:
    """Put the LR schedule at the saved ``state``. megatron-core's ``load_state_dict`` advances the schedule by the
    saved step count from wherever it stands, which is the saved position only in a schedule that never stepped; an
    actor that trained before the load would land past it (and on a later learning rate). So the count restarts
    from zero first."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)
