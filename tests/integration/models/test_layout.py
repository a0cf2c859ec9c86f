"""The parallel layout's rules (models/layout.py): one message per bad layout, naming the key and the fix, and the
same message whichever entry point meets it (`train`, `plan`, the builder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.layout import LayoutError, ParallelLayout

ROOT = Path(__file__).resolve().parents[3]
# SmolLM2-135M's attention: 9 heads, 3 KV heads, 30 layers
SMOL = ModelDims(
    hidden=576, ffn=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152, tied=True, qkv_bias=False
)
MOE = ModelDims(
    hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256, tied=False, qkv_bias=False,
    experts=8, experts_per_token=2, expert_ffn=32, moe_pattern=(1, 1),
)  # fmt: skip


def test_heads_that_do_not_divide_name_the_tps_that_would():
    assert ParallelLayout(tp=2).problems(SMOL, 2) == [
        "actor.tp=2 must divide the model's num_attention_heads=9 and num_key_value_heads=3; TPs that would: 1, 3"
    ]
    assert ParallelLayout(tp=3, pp=2).problems(SMOL, 6) == []


def test_a_world_that_does_not_divide_names_the_nearest_layout_that_fits():
    (message,) = ParallelLayout(tp=3, pp=2).problems(SMOL, 4)
    assert (
        message == "actor.tp * actor.pp = 3 * 2 = 6 must divide the world size 4; nearest layout that fits: actor.tp=1"
    )
    assert ParallelLayout(tp=3).nearest(SMOL, 9) == ParallelLayout(tp=3)
    assert ParallelLayout(tp=2, pp=2).nearest(None, 3) in (ParallelLayout(tp=1, pp=3), ParallelLayout(tp=3, pp=1))


def test_the_builder_prefix_and_forward_only_rules():
    with pytest.raises(LayoutError, match=r"^tp=2 must divide the model's num_attention_heads=9"):
        ParallelLayout(tp=2).check(SMOL, prefix="", training=False)
    ParallelLayout(tp=2).check(MOE, prefix="", training=False)  # forward only: MoE at TP 2 without SP runs
    with pytest.raises(LayoutError, match=r"^actor\.sequence_parallel: must be true for a mixture-of-experts model"):
        ParallelLayout(tp=2).check(MOE)


def _train_error(hf_dir: str, overrides: list[str]) -> str | None:
    """`train` on this 2-rank world with the demo recipe: the one-line error it stops with, or None."""
    from megatron_rlvr.config import load_config
    from megatron_rlvr.errors import UserError
    from megatron_rlvr.trainer import train

    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", [f"model.hf_dir={hf_dir}", *overrides])
    try:
        train(cfg)
    except UserError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_moe_at_tp_2_without_sequence_parallel_is_the_same_line_through_train_and_plan(workers2, tmp_path, capsys):
    from megatron_rlvr.plan.command import main as plan
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3_moe", tmp_path / "moe", with_tokenizer=False))
    capsys.readouterr()  # the model writer's progress bar
    overrides = ["actor.tp=2", "actor.sequence_parallel=false"]
    from_train = workers2.run(_train_error, hf_dir, overrides)
    assert from_train[0] == from_train[1] and from_train[0] is not None
    assert from_train[0].startswith(
        "actor.sequence_parallel: must be true for a mixture-of-experts model at actor.tp=2"
    )
    code = plan([str(ROOT / "configs" / "demo_cpu.yaml"), f"model.hf_dir={hf_dir}", *overrides, "--gpus-per-node", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err == f"error: {from_train[0]}\n"
