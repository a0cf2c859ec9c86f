"""The plan names the attention the actor will build (models.builder.attention_choice) and counts score matrices
for the unfused one only: TE's fused attention by default on a GPU cluster, torch's SDPA with TE off, megatron's
unfused attention when asked for (model.core_attention=unfused)."""

from __future__ import annotations

from megatron_rlvr.plan.command import describe_layout, load_plan_inputs, make_plan

RECIPE = "qwen2.5-32b_math-l3to5_casp"


def _plan(*overrides: str):
    # no recompute: the score matrices an unfused attention saves are then held (selective recompute drops them)
    cfg, hf, _ = load_plan_inputs(RECIPE, ['actor.recompute="none"', *overrides], 4, 8)
    return make_plan(cfg, hf, 4)


def test_the_plan_names_the_attention_and_counts_scores_for_the_unfused_one_only():
    te, sdpa = _plan(), _plan('model.use_transformer_engine="off"')
    unfused = _plan('model.use_transformer_engine="off"', 'model.core_attention="unfused"')
    assert (te.layout.attention, sdpa.layout.attention, unfused.layout.attention) == ("te", "sdpa", "unfused")
    assert "attention: Transformer Engine's fused attention" in describe_layout(te.layout)
    assert "attention: torch scaled_dot_product_attention" in describe_layout(sdpa.layout)
    activations = [p.worst.components["activations"] for p in (te, sdpa, unfused)]
    assert activations[0] == activations[1] < activations[2], activations
