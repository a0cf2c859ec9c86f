"""tools/reports/plan_tables.py: docs/plan.md's plan tables, one row per recipe, from `megatron-rlvr plan --json`."""

from __future__ import annotations

import pytest

from tools.reports import plan_tables


def test_every_training_recipe_is_listed_and_no_cpu_or_eval_config():
    names = plan_tables.training_recipes()
    assert "qwen3-30b-a3b_math-l3to5_casp" in names and "qwen2.5-32b_math-16k_casp" in names
    assert not [n for n in names if n.startswith("eval_") or "cpu" in n]


def test_a_recipe_gives_one_row_in_each_table_with_its_layout(capsys):
    assert plan_tables.main(["deepseek-r1-distill-qwen-7b_code-32k_casp"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| deepseek")]
    assert len(rows) == 2
    gpu, host = (row.split(" | ") for row in rows)
    assert gpu[2] == "TP1 PP1 CP4 DP4" and gpu[-1].startswith("yes")
    assert float(host[-2].split(" of ")[0]) > 0


def test_a_recipe_plan_refuses_stops_with_its_message():
    with pytest.raises(SystemExit, match="plan no-such-recipe: exit 2"):
        plan_tables.main(["no-such-recipe"])
