"""The GPU check's CUDA-vs-CPU verdict (tools/gpu_check/compare.py) on synthetic runs: fp32 judged before and after
the updates; bf16 judged on the forward and the first update, what follows the first Adam step only recorded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

CHECK = Path(__file__).resolve().parents[3] / "tools" / "gpu_check"
FP32_AFTER = torch.tensor([-8.0, -7.9, -8.1, -8.2, -7.8, -8.0])
BEFORE = torch.full((6,), -8.0)


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("gpu_check_test_compare", CHECK / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # it puts its own folder on sys.path for its sibling common.py
    return module.compare


def _device(bf16_after=FP32_AFTER, bf16_before=BEFORE, bf16_grad_norms=(1.9, 0.80), fp32_after=FP32_AFTER):
    """One device's figures and tensors, both dtypes, padded layout (fp32: grad norms 1.9 and 0.80)."""
    runs, tensors = {}, {}
    for dtype, before, after, norms in (
        ("float32", BEFORE, fp32_after, (1.9, 0.80)),
        ("bfloat16", bf16_before, bf16_after, bf16_grad_norms),
    ):
        updates = [{"actor/loss": loss, "actor/grad_norm": norm} for loss, norm in zip((-0.24, -0.33), norms)]
        runs[f"{dtype}/padded"] = {"status": "ok", "updates": updates}
        tensors[f"{dtype}/padded"] = {"before": before.clone(), "after": after}
    return {"runs": runs}, tensors


def _verdict(compare, cuda, cpu):
    return compare(cuda[0], cpu[0], cuda[1], cpu[1])


def test_bf16_after_the_first_adam_step_is_recorded_not_judged(compare):
    # 0.25 apart in log-prob after the updates and 4% apart in the second grad norm: both beyond bf16's tolerance
    cuda = _device(FP32_AFTER + torch.tensor([0.0, 0.05, 0.1, 0.0, -0.1, 0.0]), bf16_grad_norms=(1.9, 0.84))
    cpu = _device(FP32_AFTER + torch.tensor([0.0, 0.3, -0.1, 0.0, 0.05, 0.0]), bf16_grad_norms=(1.9, 0.81))
    verdict = _verdict(compare, cuda, cpu)
    bf16 = verdict["runs"]["bfloat16/padded"]
    assert not bf16["logp_after"]["ok"] and bf16["logp_after"]["judged"] is False
    assert not bf16["updates"][1]["actor/grad_norm"]["ok"] and bf16["updates"][1]["actor/grad_norm"]["judged"] is False
    assert bf16["bf16_vs_fp32"]["cuda"]["logp_after_max_abs"] == pytest.approx(0.1, abs=1e-6)
    assert bf16["bf16_vs_fp32"]["cpu"]["logp_after_max_abs"] == pytest.approx(0.3, abs=1e-6)
    assert bf16["bf16_vs_fp32"]["cuda"]["grad_norms"][1] == (0.84, 0.80)
    assert bf16["ok"] and verdict["ok"]


@pytest.mark.parametrize(
    "fault",
    [
        {"bf16_before": BEFORE + torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0])},  # a wrong forward
        {"bf16_grad_norms": (2.1, 0.80)},  # a wrong backward: the first update's gradient 10% off
    ],
    ids=["forward", "first_update"],
)
def test_a_bf16_fault_before_the_first_step_is_a_mismatch(compare, fault):
    verdict = _verdict(compare, _device(**fault), _device())
    assert not verdict["runs"]["bfloat16/padded"]["ok"] and not verdict["ok"]


def test_fp32_is_judged_after_the_updates_too(compare):
    verdict = _verdict(compare, _device(fp32_after=FP32_AFTER + 5e-3), _device())  # beyond 1e-4 + 1.3e-4 x 8
    fp32 = verdict["runs"]["float32/padded"]
    assert not fp32["logp_after"]["ok"] and "judged" not in fp32["logp_after"]
    assert "bf16_vs_fp32" not in fp32 and not verdict["ok"]


def _with_reference(device, ref: torch.Tensor, moved: float):
    """A device's runs as a KL run writes them: the reference's log-probs, and how far it moved in the updates."""
    figures, tensors = device
    for key in figures["runs"]:
        figures["runs"][key]["ref_moved_max_abs"] = moved
        tensors[key]["ref"] = ref.clone()
    return figures, tensors


@pytest.mark.parametrize(
    "cuda_ref, cuda_moved, failing",
    [
        (BEFORE, 0.0, None),
        (BEFORE + torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0, 0.0]), 0.0, "ref_logp"),
        (BEFORE, 1e-3, "ref_frozen"),
    ],
    ids=["same_and_frozen", "reference_differs", "reference_moved"],
)
def test_a_reference_is_compared_and_must_stay_frozen(compare, cuda_ref, cuda_moved, failing):
    verdict = _verdict(
        compare, _with_reference(_device(), cuda_ref, cuda_moved), _with_reference(_device(), BEFORE, 0.0)
    )
    for run in verdict["runs"].values():  # bf16 too: the reference's log-probs are a forward
        assert {k: run[k]["ok"] for k in ("ref_logp", "ref_frozen")} == {
            k: k != failing for k in ("ref_logp", "ref_frozen")
        }
        assert run["ok"] == (failing is None)
    assert verdict["ok"] == (failing is None)
