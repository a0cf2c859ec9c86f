"""The experience-transform registry (experience/transforms.py): the methods' modules register themselves without a
list to edit, the run's config enables them, they apply in stage order, the source samples what they leave it, and
two that add samples of their own are refused in one line."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlvr.errors import ConfigError
from megatron_rlvr.experience.transforms import Transforms, enabled, registered, registrations, source_config
from megatron_rlvr.testing.configs import run_config


def test_every_module_of_the_methods_package_registers_itself():
    names = {r.name: r for r in registrations()}
    assert {"armor", "demonstrations", "pba"} <= set(names)
    assert names["armor"].reserved_samples == 1 and names["pba"].stage == "targets"
    assert enabled(run_config()) == []
    cfg = run_config({"algo.kl.pba.enabled": True, "algo.demonstrations": True, "algo.advantage.kind": "reward"})
    assert [r.name for r in enabled(cfg)] == ["demonstrations", "pba"]  # what changes the rollouts, then weights


def test_the_source_samples_what_the_transforms_leave_it():
    cfg = run_config({"algo.loss.kind": "grpo", "algo.armor.anchors": True, "rollout.group_size": 8})
    assert source_config(cfg).rollout.group_size == 7 and cfg.rollout.group_size == 8
    plain = run_config()
    assert source_config(plain) is plain


class _Mark:
    def __init__(self, name: str, seen: list) -> None:
        self.name, self.seen = name, seen

    def before(self, step: int) -> dict[str, float]:
        return {f"{self.name}/before": float(step)}

    def __call__(self, step: int, experience):
        self.seen.append(self.name)
        return dataclasses.replace(experience, metrics=experience.metrics | {f"{self.name}/step": float(step)})


def test_transforms_apply_in_order_and_a_registration_ends_with_its_block():
    seen: list[str] = []
    with (
        registered("zz_weigh", lambda s: _Mark("zz_weigh", seen), enabled=lambda c: True, stage="targets"),
        registered("zz_add", lambda s: _Mark("zz_add", seen), enabled=lambda c: True),
    ):
        names = [r.name for r in enabled(run_config())]
        assert names == ["zz_add", "zz_weigh"]
        transforms = Transforms([r.build(None) for r in enabled(run_config())])  # the builders ignore their setup
        assert transforms.before(3) == {"zz_add/before": 3.0, "zz_weigh/before": 3.0}

        @dataclasses.dataclass(frozen=True)
        class Exp:
            metrics: dict

        out = transforms(3, Exp({}))
        assert seen == ["zz_add", "zz_weigh"] and out.metrics == {"zz_add/step": 3.0, "zz_weigh/step": 3.0}
    assert {"zz_add", "zz_weigh"}.isdisjoint(r.name for r in registrations())


def test_two_transforms_that_add_samples_are_one_line():
    cfg = run_config({"algo.loss.kind": "grpo", "algo.armor.anchors": True})
    with (
        registered("zz_inject", lambda s: None, enabled=lambda c: True, reserved_samples=1),
        pytest.raises(ConfigError, match=r"^algo: armor and zz_inject both add samples of their own"),
    ):
        source_config(cfg)


def test_a_methods_own_check_is_one_line_when_the_run_starts():
    def refuse_correction(cfg) -> str | None:
        kind = cfg.algo.rollout_correction.kind
        return f"algo.rollout_correction.kind={kind}: not with zz_strict" if kind != "none" else None

    with registered("zz_strict", lambda s: None, enabled=lambda c: True, check=refuse_correction):
        assert [r.name for r in enabled(run_config())] == ["zz_strict"]
        with pytest.raises(ConfigError, match=r"^algo.rollout_correction.kind=tis: not with zz_strict$"):
            source_config(run_config({"algo.rollout_correction.kind": "tis"}))
