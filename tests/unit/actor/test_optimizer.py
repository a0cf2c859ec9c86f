"""The LR schedule's checkpoint state: loading it puts the schedule at the saved step and learning rate whether the
actor is fresh or has trained since (megatron-core's own load adds the saved count to the current one)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.actor.optimizer import load_schedule


def _schedule():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="linear",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


@pytest.mark.parametrize("steps_since", [0, 4], ids=["fresh", "trained-since"])
def test_a_loaded_schedule_is_at_the_saved_step(steps_since):
    optimizer, scheduler = _schedule()
    scheduler.step(increment=3)
    saved, saved_lr = scheduler.state_dict(), optimizer.param_groups[0]["lr"]
    target_optimizer, target = _schedule()
    target.step(increment=steps_since)
    load_schedule(target, dict(saved))
    assert target.state_dict() == saved and target_optimizer.param_groups[0]["lr"] == saved_lr == pytest.approx(0.8875)
