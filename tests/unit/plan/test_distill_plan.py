"""The plan counts the distillation teacher: a teacher twice the student's size (a Qwen2.5-14B shape for the 7B
recipe) adds its own weights at the actor's TP/PP to every phase, ``self`` adds a copy of the student unless the
reference is one, and a teacher that does not fit is a one-line problem naming algo.distill.teacher_hf_dir."""

from __future__ import annotations

import json

import pytest

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan import command
from megatron_rlvr.plan.memory import GB
from megatron_rlvr.plan.recipe_files import MODEL_CONFIGS_DIR, find_hf_config
from megatron_rlvr.plan.stage_params import stage_params

RECIPE = "qwen2.5-7b_synlogic_casp"  # actor TP=2, bf16


@pytest.fixture(scope="module")
def teacher_14b(tmp_path_factory) -> str:
    """Qwen2.5-14B's shape (hidden 5120, 48 layers, ffn 13824, 40 heads, 8 KV heads): 1.94x the 7B's parameters."""
    hf = find_hf_config(str(MODEL_CONFIGS_DIR / "Qwen2.5-7B"))
    hf.update(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8
    )
    out = tmp_path_factory.mktemp("teacher14b")
    (out / "config.json").write_text(json.dumps(hf))
    return str(out)


def _plan(capsys, *overrides: str) -> tuple[int, dict]:
    code = command.main([RECIPE, *overrides, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_teacher_twice_the_students_size_is_counted_in_every_phase(capsys, teacher_14b):
    _, alone = _plan(capsys)
    code, plan = _plan(capsys, "algo.distill.kind=teacher", f"algo.distill.teacher_hf_dir={teacher_14b}")
    student = ModelDims.from_hf(find_hf_config(str(MODEL_CONFIGS_DIR / "Qwen2.5-7B")))
    teacher = ModelDims.from_hf(json.loads(open(f"{teacher_14b}/config.json").read()))
    assert 1.9 < teacher.hf_params() / student.hf_params() < 2.0
    expected = stage_params(teacher, 2, 1, 0) * 2 / GB  # bf16 at the actor's TP = 2
    assert plan["components"]["teacher_gb"] == pytest.approx(expected, abs=0.01)
    assert plan["components"]["teacher_gb"] == pytest.approx(2 * plan["components"]["actor_weights_gb"], rel=0.04)
    for phase in ("rollout", "update", "sync"):
        assert plan["phases"][phase] == pytest.approx(alone["phases"][phase] + expected, abs=0.02), phase
    assert plan["phases"]["statistics"] >= alone["phases"]["statistics"] + expected - 0.02
    assert code == 0 and plan["fits"] and plan["problems"] == []


def test_self_distillation_holds_one_copy_of_the_student_shared_with_the_reference(capsys):
    _, plain = _plan(capsys, "algo.distill.kind=self")
    assert plain["components"]["teacher_gb"] == plain["components"]["actor_weights_gb"]
    _, with_kl = _plan(capsys, "algo.distill.kind=self", "algo.kl.coef=0.1")
    assert with_kl["components"]["teacher_gb"] == 0.0
    assert with_kl["components"]["reference_gb"] == with_kl["components"]["actor_weights_gb"]


def test_a_teacher_that_does_not_fit_is_a_problem_naming_the_key(capsys, teacher_14b):
    _, student_alone = _plan(capsys, "actor.tp=1", "actor.sequence_parallel=false")
    assert student_alone["fits"]  # the student alone fits at TP = 1: the teacher is what breaks it
    code, plan = _plan(
        capsys,
        "actor.tp=1",
        "actor.sequence_parallel=false",
        "algo.distill.kind=teacher",
        f"algo.distill.teacher_hf_dir={teacher_14b}",
    )
    assert code == 3 and not plan["fits"]
    (problem,) = plan["problems"]
    assert problem.startswith(f"algo.distill.teacher_hf_dir={teacher_14b!r}: the teacher's weights, 29.5 GB per GPU")
    assert "\n" not in problem


def test_a_teacher_directory_without_config_is_one_line_and_exit_2(capsys, tmp_path):
    assert command.main([RECIPE, "algo.distill.kind=teacher", f"algo.distill.teacher_hf_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "algo.distill.teacher_hf_dir=" in err and "no config.json" in err and err.count("\n") == 1


def test_crpo_holds_the_student_copy_and_its_top_k_scores_in_the_statistics_phase(capsys):
    _, alone = _plan(capsys)
    _, plan = _plan(capsys, "algo.distill.kind=crpo", "algo.distill.crpo.top_k=100")
    assert plan["components"]["teacher_gb"] == plan["components"]["actor_weights_gb"]
    scores = plan["components"]["teacher_scores_gb"]
    _, fewer = _plan(capsys, "algo.distill.kind=crpo", "algo.distill.crpo.top_k=10")
    # (1 + 2K) float32 values per position: K = 100 is 201 / 21 of K = 10's
    assert scores == pytest.approx(fewer["components"]["teacher_scores_gb"] * 201 / 21, rel=0.01)
    assert scores > 0 and alone["components"].get("teacher_scores_gb", 0.0) == 0.0
    assert plan["phases"]["statistics"] >= alone["phases"]["statistics"] + scores - 0.02


def test_crpo_ema_teacher_is_a_copy_of_its_own_beside_the_reference(capsys):
    _, frozen = _plan(capsys, "algo.distill.kind=crpo", "algo.kl.coef=0.1")
    _, ema = _plan(capsys, "algo.distill.kind=crpo", "algo.kl.coef=0.1", "algo.distill.crpo.teacher=ema")
    assert frozen["components"]["teacher_gb"] == 0.0  # the frozen teacher is the reference
    assert ema["components"]["teacher_gb"] == ema["components"]["reference_gb"] > 0
