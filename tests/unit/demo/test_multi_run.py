"""`megatron-rlvr demo report --runs ...`: finished demo folders -> one table, grouped by algo + recipe overrides,
mean and (min-max) over seeds, prompts gained / lost against each run's base; bad folders named."""

from __future__ import annotations

import pytest

from megatron_rlvr.config import dump_config, load_config
from megatron_rlvr.demo import command, multi_run
from megatron_rlvr.demo.report import write_report
from megatron_rlvr.errors import UserError


def _samples(correct: dict[str, int], n: int = 4) -> list[dict]:
    return [
        {"prompt_id": pid, "sample": i, "response": f"{i}+{pid}", "reward": float(i < c)}
        for pid, c in correct.items()
        for i in range(n)
    ]


BASE = {"a": 1, "b": 0, "c": 2, "d": 0}


def _run(root, name, trained: dict[str, int], overrides: list[str] | None):
    out = root / name
    write_report(out / "report", {"base": _samples(BASE), "trained (x)": _samples(trained)})
    if overrides is not None:
        (out / "train").mkdir(parents=True)
        cfg = load_config(
            command.RECIPE, [f"trainer.output_dir={out / 'train'}", f"model.hf_dir={out / 'base'}", *overrides]
        )
        (out / "train" / "config.yaml").write_text(dump_config(cfg))
    return out


@pytest.fixture
def runs(tmp_path):
    return [
        # casp without KL, seeds 1 and 2 (correct samples of 4 per prompt; the base solves a and c)
        _run(tmp_path, "casp1", {"a": 2, "b": 1, "c": 0, "d": 0}, ["algo.kl.coef=0", "trainer.seed=1"]),
        _run(tmp_path, "casp2", {"a": 4, "b": 0, "c": 1, "d": 0}, ["algo.kl.coef=0", "trainer.seed=2"]),
        _run(
            tmp_path,
            "grpo1",
            {"a": 4, "b": 4, "c": 4, "d": 1},
            ["algo.loss.kind=grpo", "algo.kl.coef=0", "trainer.seed=1"],
        ),
    ]


def _row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_groups_by_algo_and_overrides_with_mean_and_range_over_seeds(runs, tmp_path, capsys):
    assert multi_run.main(["--runs", *map(str, runs), "--out", str(tmp_path / "t.md")]) == 0
    text = capsys.readouterr().out
    assert (tmp_path / "t.md").read_text() == text
    header = _row(text, "model")
    assert header[:4] == ["model", "runs", "seeds", "pass@1"] and header[-4:] == [
        "distinct correct",
        "solved",
        "gained vs base",
        "lost vs base",
    ]
    casp = dict(zip(header, _row(text, "casp, algo.kl.coef=0")))
    # pass@1: run 1 = (2+1)/16, run 2 = (4+1)/16 -> mean 25.0, range 18.8-31.2
    assert casp["runs"] == "2" and casp["seeds"] == "1,2" and casp["pass@1"] == "25.0 (18.8-31.2)"
    assert casp["pass@4"] == "50.0"  # both runs solve 2 of 4 prompts: no range
    # base solves {a, c}; run 1 solves {a, b}: +1 -1; run 2 solves {a, c}: +0 -0
    assert (casp["solved"], casp["gained vs base"], casp["lost vs base"]) == ("2", "0.5 (0-1)", "0.5 (0-1)")
    grpo = dict(zip(header, _row(text, "grpo, algo.kl.coef=0")))
    assert (
        grpo["pass@1"] == "81.2"
        and grpo["solved"] == "4"
        and grpo["gained vs base"] == "2"
        and grpo["lost vs base"] == "0"
    )
    base = dict(zip(header, _row(text, "base")))
    assert base["runs"] == "3" and base["pass@1"] == "18.8" and base["solved"] == "2"  # the same base in every run


def test_group_by_algo_only_and_runs_without_a_config(runs, tmp_path):
    text = multi_run.table([multi_run.read_run(r) for r in runs], ["algo"])
    assert _row(text, "casp")[1] == "2" and _row(text, "grpo")[1] == "1"
    bare = _run(tmp_path, "bare", BASE, None)  # no train/config.yaml: the report's own label
    assert _row(multi_run.table([multi_run.read_run(bare)]), "trained (x)")[3] == "18.8"


def test_a_folder_that_is_not_a_finished_run_is_named(tmp_path):
    with pytest.raises(UserError, match=rf"--runs {tmp_path / 'x'}: no finished demo run \(no report/results.json\)"):
        multi_run.read_run(tmp_path / "x")
    (tmp_path / "y" / "report").mkdir(parents=True)
    (tmp_path / "y" / "report" / "results.json").write_text("{}")
    with pytest.raises(UserError, match="expected report.py's results.json"):
        multi_run.read_run(tmp_path / "y")


def test_demo_command_dispatches_report(runs, capsys):
    assert command.main(["report", "--runs", str(runs[0]), "--group-by", "algo"]) == 0
    assert "| casp | 1 | 1 |" in capsys.readouterr().out


def test_interval_table_gives_each_group_its_interval_and_paired_differences(runs):
    import numpy as np

    from megatron_rlvr.eval.bootstrap import IntervalSpec, bootstrap_values, per_problem_pass_at_k

    stats = [multi_run.read_run(r) for r in runs]
    spec = IntervalSpec(resamples=300)
    text = multi_run.interval_table(stats, ["algo"], ks=[1, 4], spec=spec)
    order = ["a", "b", "c", "d"]

    def values(correct: dict[str, int]):
        return per_problem_pass_at_k(np.full(4, 4), np.array([correct[p] for p in order]), [1, 4])

    casp = (values({"a": 2, "b": 1, "c": 0, "d": 0}) + values({"a": 4, "b": 0, "c": 1, "d": 0})) / 2
    grpo, base = values({"a": 4, "b": 4, "c": 4, "d": 1}), values(BASE)
    own = bootstrap_values(casp, [1, 4], spec, "countdown")
    vs_base = bootstrap_values(casp - base, [1, 4], spec, "countdown/paired")
    grpo_vs_casp = bootstrap_values(grpo - casp, [1, 4], spec, "countdown/paired")
    rows = {
        (r[0], r[2]): r
        for r in (_cells(line) for line in text.splitlines() if line.startswith("| ") and "---" not in line)
    }
    assert rows[("casp", "1")][3] == multi_run._iv(own[1]) and rows[("casp", "1")][4] == multi_run._iv(vs_base[1], True)
    assert rows[("casp", "1")][1] == "2" and rows[("casp", "1")][5] == "-"
    assert rows[("grpo", "4")][5] == multi_run._iv(grpo_vs_casp[4], True)
    assert rows[("base", "1")][3].startswith("18.8 [")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_interval_table_refuses_runs_on_other_prompts_or_n(runs, tmp_path):
    other = tmp_path / "other"
    write_report(
        other / "report",
        {"base": _samples({"a": 1, "b": 0, "c": 2, "e": 0}), "trained (x)": _samples({"a": 1, "b": 0, "c": 2, "e": 0})},
    )
    with pytest.raises(UserError, match=r"evaluated on other prompts than .* \(e.g. \['d', 'e'\]\)"):
        multi_run.interval_table([multi_run.read_run(runs[0]), multi_run.read_run(other)])
    short = tmp_path / "short"
    write_report(short / "report", {"base": _samples(BASE, n=2), "trained (x)": _samples(BASE, n=2)})
    with pytest.raises(UserError, match=r"drew n = \[2\] samples per prompt"):
        multi_run.interval_table([multi_run.read_run(runs[0]), multi_run.read_run(short)])
