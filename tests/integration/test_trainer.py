"""The training loop end to end on CPU: 2 steps at (TP, PP) = (2, 1) and (1, 2) with vLLM rollouts; the engine's
log-probs reach the rollout correction; a dead engine is rebuilt; non-finite steps are skipped and stop the run; a
failed checkpoint write leaves the previous intact; algo.kl.coef > 0 trains against the frozen reference and logs the
KL to it; a teacher that is the student gives 0 exactly through the loop. Each replaced component is a fake passed
in the loop's `Parts` (megatron_rlvr/testing/loop_fakes.py). A resumed run's equality to an uninterrupted one is
tests/integration/test_resume.py's table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.integration.training_runs import make_tiny_model, train, train_recording_calls

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]


def _engine_logp_shifted(hf_dir: str, out_dir: str, shift: float, extra: list[str]):
    """train (1 step) with every log-prob the engine reports lowered by ``shift``: rho = exp(shift) on every token."""
    from megatron_rlvr.testing.loop_fakes import ShiftedLogprobsEngine, wrapped_engines
    from megatron_rlvr.trainer import Parts

    parts = Parts(engine=wrapped_engines(lambda engine: ShiftedLogprobsEngine(engine, shift)))
    return train(hf_dir, out_dir, 2, 1, 1, extra, lambda: parts)


def _engine_dies_at_step_two(hf_dir: str, out_dir: str):
    """Rank 1's engine is closed (dead) just before the second step's rollout; the run must still finish."""
    from megatron_rlvr.testing.loop_fakes import engine_closed_before
    from megatron_rlvr.trainer import Parts

    steps_collected: list[int] = []
    parts = Parts(collect=engine_closed_before(1, 1, steps_collected))
    return train(hf_dir, out_dir, 2, 1, 2, [], lambda: parts), steps_collected


def _nonfinite_losses(hf_dir: str, out_dir: str):
    """Every loss is NaN (NaN advantages): each step must be skipped on every rank (weights untouched) and the run
    must stop once more than actor.max_nonfinite_in_a_row steps in a row were skipped."""
    from megatron_rlvr import trainer
    from megatron_rlvr.testing.loop_fakes import nonfinite_actor

    seen: list[tuple[float, bool]] = []
    parts = trainer.Parts(actor=nonfinite_actor(seen))
    try:
        train(hf_dir, out_dir, 2, 1, 5, ["actor.max_nonfinite_in_a_row=2"], lambda: parts)
    except trainer.NonFiniteError as e:
        return str(e), seen
    return None, seen


def _failing_checkpoint(hf_dir: str, out_dir: str):
    """Train 2 steps saving every step, with the disk 'full' on the second save."""
    from megatron_rlvr.checkpoint import CheckpointError
    from megatron_rlvr.testing.loop_fakes import FailingShardWriter
    from megatron_rlvr.trainer import Parts

    parts = Parts(checkpoint_writer=FailingShardWriter(fail_at=2))
    try:
        train(hf_dir, out_dir, 2, 1, 2, ["checkpoint.save_every=1"], lambda: parts)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen"))


_VALIDATION = ["trainer.eval_every=2", "eval.n_samples=2", "eval.limit=3", "eval.max_new_tokens=6"]


# the (1, 2) run also trains with the KL term to the frozen reference: the PP layout, where its log-probs are broadcast
@pytest.mark.parametrize("tp,pp,kl_coef", [(2, 1, 0.0), (1, 2, 0.1)])
def test_two_steps_end_to_end(workers2, tiny_model, tmp_path, tp, pp, kl_coef):
    runs = workers2.run(
        train_recording_calls,
        tiny_model,
        str(tmp_path / "run"),
        tp,
        pp,
        2,
        [*_VALIDATION, f"algo.kl.coef={kl_coef}"],
        timeout_s=900,
    )
    histories = [history for history, _ in runs]
    assert [len(h) for h in histories] == [2, 2]
    # the engine sleeps (on GPU: frees its memory for the actor) after every sampling, before any update
    start = ["update_weights", "generate", "sleep"]  # first sync, validation of the base model
    step = ["generate", "sleep", "update", "update_weights"]
    assert runs[0][1] == start + step + step + ["generate", "sleep"]  # eval_every=2: validation after step 2
    for metrics in histories[0]:
        assert 0.0 <= metrics["reward/mean"] <= 1.0
        assert metrics["response/tokens_trained"] > 0
        assert metrics["actor/grad_norm"] >= 0
    untimed = [[{k: v for k, v in m.items() if not k.startswith("time/")} for m in h] for h in histories]
    assert untimed[0] == untimed[1]  # every rank reports the same step metrics
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    # a random model earns no reward: the entropy bonus is what moves it, so the gradient must not vanish
    assert histories[0][0]["actor/grad_norm"] > 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf") is not None
    _assert_validated_before_and_at_step_two(tmp_path / "run", histories[0])
    if kl_coef:
        _assert_kl_to_reference_logged(tmp_path / "run", histories[0])
    else:  # no reference model, no KL metric
        assert all("loss/kl_ref" not in m for m in histories[0])


def _assert_kl_to_reference_logged(run_dir: Path, history: list[dict]) -> None:
    """The reference's log-probs reached the loss at every step; the KL to it is 0 until the policy moves."""
    import math

    from megatron_rlvr.monitor import read_metrics

    assert history[0]["loss/kl_ref"] == 0.0  # step 1: the policy is the reference, bit for bit
    assert history[1]["loss/kl_ref"] > 0 and math.isfinite(history[1]["loss/kl_ref"])
    logged = read_metrics(run_dir / "metrics.jsonl")
    assert [m["loss/kl_ref"] for m in logged if "loss/kl_ref" in m] == [m["loss/kl_ref"] for m in history]


def _assert_validated_before_and_at_step_two(run_dir: Path, history: list[dict]) -> None:
    """eval_every=2: validation of the base model (step 0) and at step 2, each with its entropy histogram."""
    import math

    from megatron_rlvr.monitor import read_metrics

    assert "val/pass@1" not in history[0] and {"val/pass@1", "val/pass@2", "time/eval"} <= history[1].keys()
    logged = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in logged if "val/pass@1" in m] == [0, 2]
    for m in (m for m in logged if "val/pass@1" in m):
        assert 0.0 <= m["val/pass@1"] <= m["val/pass@2"] <= 1.0
        assert m["val/reward_mean"] == pytest.approx(m["val/pass@1"])  # 0/1 rewards: the mean is pass@1
        assert math.log(1) < m["val/entropy"] <= math.log(1001)  # a random model over a 1001-token vocabulary
    hists = read_metrics(run_dir / "histograms.jsonl")
    assert [(h["step"], h["name"]) for h in hists] == [(0, "val/entropy"), (2, "val/entropy")]
    assert all(sum(h["counts"]) > 0 for h in hists)


def test_a_teacher_that_is_the_student_gives_zero_through_the_loop(workers2, tiny_model, tmp_path):
    """The trainer's own step at TP = 2 with two mini-batches, the teacher the student's own weights (distillation
    alone) and the KL term to the frozen reference: the first step's loss, gradient norm, KL and distillation
    signals are 0 exactly (not noise that Adam would turn into an lr-sized step before the second mini-batch).
    tests/integration/actor/test_same_weights.py covers PP = 2, DP = 2 and the other frozen copies."""
    extra = [
        "trainer.mini_batches_per_step=2",
        "algo.loss.kind=grpo",  # no entropy bonus: the teacher and the reference are the only signals
        "algo.distill.kind=teacher",
        f"algo.distill.teacher_hf_dir={tiny_model}",
        "algo.distill.only=true",
        "algo.kl.coef=0.1",
    ]
    (step,) = workers2.run(train, tiny_model, str(tmp_path / "run"), 2, 1, 1, extra, timeout_s=900)[0]
    keys = ("actor/loss", "actor/grad_norm", "loss/kl_ref", "distill/reverse_kl", "distill/forward_kl_topn")
    print("step 1 through the loop: " + ", ".join(f"{k} {step[k]:.3g}" for k in keys))
    assert {k: step[k] for k in keys} == dict.fromkeys(keys, 0.0)
    assert step["distill/top1_agreement"] == 1.0 and step["response/tokens_trained"] > 0


@pytest.mark.parametrize(
    "kind,shift,weight,dropped",
    [("tis", 0.0, 1.0, 0.0), ("tis", 1.0, 2.0, 1.0), ("icepop", 0.5, math.exp(0.5), 0.0), ("mis", 1.0, 0.0, 1.0)],
)
def test_rollout_correction_reads_the_engine_log_probs(workers2, tiny_model, tmp_path, kind, shift, weight, dropped):
    """The engine's log-probs reach the loss: shifted by s, every token's rho is e^s (e^1 > C = 2: truncated to 2 by
    tis, outside mis's band [0.5, 2]; e^0.5 inside icepop's, kept as is); unshifted, the fp32 CPU engine agrees with
    the actor, so tis is the identity."""
    history = workers2.run(
        _engine_logp_shifted,
        tiny_model,
        str(tmp_path / "rc"),
        shift,
        [f"algo.rollout_correction.kind={kind}"],
        timeout_s=900,
    )[0]
    key = "rollout_correction/clipped_frac" if kind == "tis" else "rollout_correction/masked_frac"
    assert history[0]["rollout_correction/weight_mean"] == pytest.approx(weight, abs=1e-4)
    assert history[0][key] == dropped
    assert history[0]["rollout/logp_mismatch"] == pytest.approx(shift, abs=1e-4)
    assert not any(k.startswith("loss/rollout_correction") for k in history[0])


def test_dead_engine_is_rebuilt_and_training_goes_on(workers2, tiny_model, tmp_path):
    (history, calls), (other_history, other_calls) = workers2.run(
        _engine_dies_at_step_two, tiny_model, str(tmp_path / "dies"), timeout_s=900
    )
    assert calls == other_calls == [0, 1, 1]  # step 1 was collected twice: once failing on every rank, once after
    assert [m["step"] for m in history] == [1, 2]
    assert history[1]["rollout/logp_mismatch"] < 1e-4  # the rebuilt engine holds the actor's weights


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(workers2, tiny_model, tmp_path):
    for error, seen in workers2.run(_nonfinite_losses, tiny_model, str(tmp_path / "nan"), timeout_s=900):
        assert error and "3 steps in a row had a non-finite loss or gradient" in error and "stopping at step 2" in error
        assert seen == [(1.0, True)] * 3  # skipped, weights untouched, three times, then the stop


def test_failed_checkpoint_keeps_previous(workers2, tiny_model, tmp_path):
    out = tmp_path / "disk"
    errors = workers2.run(_failing_checkpoint, tiny_model, str(out), timeout_s=900)
    assert errors[0] and "No space left on device" in errors[0] and "previous checkpoints are intact" in errors[0]
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert (root / "step-000001" / "trainer_state.json").is_file()
