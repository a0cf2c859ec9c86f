"""The didactic tree through the real loss code: the qualitative result of the CaSP paper's Section 4.3."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rlvr.algos.toy_tree import Tree, evaluate, main


def test_tree_layout_and_evaluation():
    tree = Tree()
    start = tree.leaf_probs(tree.initial_logits())
    assert start.sum().item() == pytest.approx(1.0)
    assert int(tree.rewarding().sum()) == 6
    # The start policy's top candidates are the plausible branches: root top-2 and each subtree's top-3.
    probs = torch.softmax(tree.initial_logits(), dim=-1)
    assert probs[0].topk(2).indices.sort().values.tolist() == [0, 1]
    assert all(probs[1 + a].topk(3).indices.sort().values.tolist() == [0, 1, 2] for a in range(2))
    result = evaluate(tree, tree.initial_logits())
    assert result["modes"] == 6 and 0.3 < result["accuracy"] < 0.6
    one_leaf = torch.full((tree.num_nodes, tree.branching), -50.0, dtype=torch.float64)
    one_leaf[0, 1] = one_leaf[2, 0] = 50.0
    assert evaluate(tree, one_leaf) == {"accuracy": pytest.approx(1.0), "modes": 1, "entropy": pytest.approx(0.0, abs=1e-6)}


def _run(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    return json.loads(last_line)


@pytest.mark.slow
def test_casp_keeps_all_modes_where_grpo_collapses(capsys, tmp_path):
    plot = tmp_path / "tree.png"
    results = _run(capsys, "--steps", "300", "--plot", str(plot))
    assert set(results) == {"grpo", "entropy_bonus", "casp"}
    assert plot.stat().st_size > 10_000
    for grpo, bonus, casp in zip(results["grpo"], results["entropy_bonus"], results["casp"]):
        assert set(casp) == {"seed", "accuracy", "modes", "entropy"}
        assert grpo["modes"] < casp["modes"] == 6, (grpo, casp)
        assert casp["accuracy"] >= 0.95, casp
        assert bonus["modes"] > grpo["modes"], (bonus, grpo)
        assert casp["entropy"] > grpo["entropy"]


@pytest.mark.slow
def test_a_strong_entropy_bonus_keeps_modes_by_leaking_mass(capsys, tmp_path):
    results = _run(capsys, "--steps", "300", "--seeds", "0", "--beta", "1.0", "--plot", str(tmp_path / "t.png"))
    (bonus,), (casp,) = results["entropy_bonus"], results["casp"]
    assert bonus["modes"] == 6 and bonus["accuracy"] < 0.7 < casp["accuracy"]
