"""The plan against what megatron-core really allocates, on CPU gloo ranks.

Parameter counts per rank of the paper models (the meta-device build of the recipe tests) at TP/PP 1 and 2, and the
measured bytes of weights, DDP's grad buffer, optimizer state and the frozen reference of a real MegatronActor after
one update at (TP, PP) = (1, 1), (2, 1), (1, 2), with and without the distributed optimizer and the reference, and
with LoRA adapters (the frozen base's weights and the adapters', their grads and optimizer state alone, no reference).
The update's peak memory is compared by tools/benches/measure_memory.py (docs/plan.md), not here: it needs a bigger model to rise
above allocator noise."""

from __future__ import annotations

import dataclasses

import pytest

from tools.benches.measure_memory import Case, measure_rank, predicted

pytestmark = pytest.mark.dist

META_MODELS = ["Qwen2.5-7B", "Llama-3.2-3B-Instruct"]  # untied GQA with qkv bias; tied without biases


def _meta_stage_counts(models: list[str], tp: int, pp: int) -> dict[str, int]:
    """This rank's parameter count of each model built on the meta device at (tp, pp)."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_rlvr.models import build_gpt_model, load_hf_config, transformer_config_from_hf
    from megatron_rlvr.plan.recipe_files import MODEL_CONFIGS_DIR
    from megatron_rlvr.runtime import distributed

    counts = {}
    with distributed.model_parallel(tp=tp, pp=pp):
        for model in models:
            hf = load_hf_config(MODEL_CONFIGS_DIR / model)
            tcfg = transformer_config_from_hf(
                hf, tp=tp, pp=pp, params_dtype=torch.bfloat16, perform_initialization=False
            )
            with torch.device("meta"):
                gpt = build_gpt_model(
                    hf, tcfg, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
                )
            counts[model] = sum(p.numel() for p in gpt.parameters())
        counts["stage"] = ps.get_pipeline_model_parallel_rank()
    return counts


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_stage_params_equal_the_meta_device_build(workers2, tp, pp):
    from megatron_rlvr.models.dims import ModelDims
    from megatron_rlvr.plan.recipe_files import MODEL_CONFIGS_DIR, find_hf_config
    from megatron_rlvr.plan.stage_params import stage_params

    for counts in workers2.run(_meta_stage_counts, META_MODELS, tp, pp, timeout_s=600):
        for model in META_MODELS:
            dims = ModelDims.from_hf(find_hf_config(str(MODEL_CONFIGS_DIR / model)))
            assert stage_params(dims, tp, pp, counts["stage"]) == counts[model], (model, tp, pp, counts["stage"])


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen"), with_tokenizer=False))


CASES = [
    Case(1, 1, distributed_optimizer=True),
    Case(2, 1, distributed_optimizer=True, reference=True),
    Case(1, 2, distributed_optimizer=False, reference=True, micro_batch_size=1),
    # LoRA (docs/lora.md): the base frozen, grads and optimizer of the adapters alone, the reference free
    Case(2, 1, distributed_optimizer=True, reference=True, lora=4),
    Case(1, 2, distributed_optimizer=False, reference=True, micro_batch_size=1, lora=4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label.replace(" ", "_"))
def test_predicted_bytes_equal_the_measured_actor(workers2, tiny_qwen, case):
    case = dataclasses.replace(case, seq_len=16)
    measured = workers2.run(measure_rank, case, tiny_qwen, warm_up=False)
    for rank, (m, p) in enumerate(zip(measured, predicted(case, tiny_qwen, 2))):
        assert p["weights"] == m["weights"] and p["reference"] == m["reference"], (rank, p, m)
        # DDP's grad buffer pads every parameter's start to 64 values under the distributed optimizer
        assert m["grads"] >= p["grads"] and m["grads"] == pytest.approx(p["grads"], rel=0.02), (rank, p, m)
        assert m["optimizer"] == pytest.approx(p["optimizer"], rel=0.02), (rank, p, m)
        if not case.distributed_optimizer:
            assert (m["grads"], m["optimizer"]) == (p["grads"], p["optimizer"]), "no padding without it"
        assert (m["reference"] > 0) == (case.reference and not case.lora)  # LoRA's reference is the base: no copy
