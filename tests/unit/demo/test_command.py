"""`megatron-rlvr demo` around training and evaluation: --seed reaches training only (the eval's seeds are fixed),
and the report gets a base-vs-trained candidate matrix on a prompt the trained model answers correctly."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_rlvr.config import dump_config, load_config
from megatron_rlvr.demo import MODEL_DIR, command
from megatron_rlvr.errors import UserError


def _rows(pid: str, rewards: list[float], right: str = "9-7+6*3", wrong: str = "1+1") -> list[dict]:
    return [
        {"prompt_id": pid, "sample": i, "response": right if r else wrong, "reward": r} for i, r in enumerate(rewards)
    ]


class FakeRun(dict):
    """What the fake stages saw; `main` runs the demo with them (and no log file)."""

    def main(self, argv: list[str]) -> int:
        return command.main(argv, train=self.train, evaluate=self.evaluate, log_file=False)


@pytest.fixture
def fake_run():
    """The demo with training and vLLM evaluation replaced: training copies the base model, evaluation returns
    fixed samples on the first 4 prompts of the real eval split."""
    calls = FakeRun()

    def train(out, overrides, nproc, stopped):
        calls["overrides"] = list(overrides)
        shutil.copytree(MODEL_DIR, out / "train" / "hf")
        (out / "train" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.2}) + "\n")
        (out / "train" / "config.yaml").write_text(dump_config(load_config(command.RECIPE, overrides)))
        return 0

    def evaluate(out, models, n, prompts, environment=None):
        calls["models"] = dict(models)
        command.write_eval_split(out / "eval_data", 4, seed=1234)
        ids = [json.loads(line)["id"] for line in (out / "eval_data" / "countdown.jsonl").read_text().splitlines()]
        calls["ids"] = ids
        base = (
            _rows(ids[0], [1, 0, 0, 0])
            + _rows(ids[1], [0, 0, 0, 0])
            + _rows(ids[2], [0, 0, 0, 0])
            + _rows(ids[3], [0] * 4)
        )
        trained = (
            _rows(ids[0], [1, 1, 0, 0])
            + _rows(ids[1], [0, 0, 1, 1], right="9*(7-6)+9")
            + _rows(ids[2], [0, 1, 1, 1], right="6*3")
            + _rows(ids[3], [0] * 4)
        )
        return dict(zip(models, (base, trained)))

    calls.train, calls.evaluate = train, evaluate
    return calls


def test_seed_goes_to_training_and_the_report_has_a_candidate_matrix(tmp_path, fake_run):
    out = tmp_path / "demo"
    assert (
        fake_run.main(["--out", str(out), "--seed", "7", "--eval-n", "4", "--eval-prompts", "4", "trainer.steps=2"])
        == 0
    )
    assert fake_run["overrides"][-2:] == ["trainer.steps=2", "trainer.seed=7"]
    report = out / "report"
    md = (report / "report.md").read_text()
    assert "## Candidate matrix" in md and "![candidates](candidates.png)" in md
    assert "- trained 2 steps of 16 prompts x 8 samples (algo.loss.kind=casp, seed 7;" in md
    assert "evaluated on 4 held-out prompts x 4 samples (eval seed 1234)" in md
    assert "the tables in README.md and docs/demo.md are other runs of the same command" in md
    assert (report / "candidates.png").read_bytes()[:4] == b"\x89PNG"
    # the prompt where the trained model gains most on the base (3 vs 0), and its first correct answer
    chosen = json.loads((report / "results.json").read_text())["candidates"]
    assert (
        chosen["prompt_id"] == fake_run["ids"][2] and chosen["response"] == "6*3" and chosen["path"] == "candidates.png"
    )
    numbers = json.loads((report / "candidates.json").read_text())
    assert [m["label"] for m in numbers["models"]] == ["base", "trained (casp)"]
    assert numbers["response"] == "6*3" and numbers["top_n"] == command.CANDIDATES_TOP_N


def test_a_user_error_in_training_ends_the_demo_with_exit_2_and_a_failure_names_its_status(tmp_path):
    status = {}
    stages = dict(
        train=lambda out, overrides, nproc, stopped: status["rc"],
        evaluate=lambda *a, **k: pytest.fail("no evaluation after a failed training"),
        log_file=False,
    )
    status["rc"] = 2  # the training command has printed its one line
    assert command.main(["--out", str(tmp_path / "a")], **stages) == 2
    status["rc"] = 1
    with pytest.raises(SystemExit, match="training failed with exit status 1"):
        command.main(["--out", str(tmp_path / "b")], **stages)


def test_bad_overrides_and_nproc_fail_before_anything_is_written(tmp_path):
    with pytest.raises(UserError, match="trainer.stpes: unknown key; did you mean trainer.steps"):
        command.main(["--out", str(tmp_path / "a"), "trainer.stpes=3"])
    with pytest.raises(UserError, match="must divide the world size 3; nearest layout that fits"):
        command.main(["--out", str(tmp_path / "b"), "--nproc", "3"])
    assert not list(tmp_path.iterdir())


def test_seed_and_a_trainer_seed_override_conflict(tmp_path, fake_run):
    with pytest.raises(UserError, match="--seed and trainer.seed"):
        fake_run.main(["--out", str(tmp_path), "--seed", "1", "trainer.seed=2"])


def test_the_evaluation_does_not_depend_on_the_training_seed(tmp_path):
    seen = []

    class Stop(Exception):
        pass

    def evaluate(paths, cfg, *a, **k):
        seen.append((cfg.seed, (tmp_path / "eval_data" / "countdown.jsonl").read_text()))
        raise Stop

    with pytest.raises(Stop):
        command.evaluate_models(tmp_path, {"base": MODEL_DIR}, 4, 8, evaluate=evaluate)
    assert seen[0][0] == command.EVAL_SEED
    from megatron_rlvr.config import load_config
    from megatron_rlvr.tasks.countdown import generate

    ids = [json.loads(line)["id"] for line in seen[0][1].splitlines()]
    assert ids == [p.id for p in generate(load_config(command.RECIPE).data.seed, 8, "eval")]
