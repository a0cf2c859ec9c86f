"""The exact parameter count of one pipeline stage at a tensor-parallel size, as megatron-core builds it (padded
vocabulary included), from the model's shapes (`models.dims.ModelDims`).

Mixture-of-experts models (Qwen3-MoE, docs/moe.md) split a rank's parameters in two: the dense ones (attention,
norms, the router, dense MLP layers, embeddings), cut over TP and replicated over DP x CP, and the experts of its
MoE layers, ``num_experts / ep`` of them on an EP rank, each cut over ETP and replicated over the expert-data-parallel
ranks ((dp x tp x cp) / (ep x etp)). `stage_split` gives both."""

from __future__ import annotations

import functools

from megatron_rlvr.errors import ConfigError
from megatron_rlvr.models.builder import padded_vocab_size
from megatron_rlvr.models.dims import ModelDims


def stage_split(
    dims: ModelDims, tp: int, pp: int, stage: int, divisible_by: int = 128, ep: int = 1, etp: int = 1
) -> tuple[int, int]:
    """(dense, expert) parameters of one rank of pipeline stage ``stage``. Dense: its layers' attention and norms,
    the dense layers' MLPs and the MoE layers' routers, the vocab-sharded embedding on the first stage, the output
    layer on the last (a tied model's last stage keeps its own copy when pp > 1) and the final norm. Expert: the
    ``experts / ep`` local experts of each of its MoE layers, cut over ETP."""
    vocab_rows = padded_vocab_size(dims.vocab, tp, divisible_by) // tp
    moe_layers = dims.moe_layers_of(pp, stage)
    dense_layers = dims.layers // pp - moe_layers
    dense = dense_layers * dims.layer_params(tp) + moe_layers * dims.moe_layer_dense_params(tp)
    if stage == 0:
        dense += vocab_rows * dims.hidden
    if stage == pp - 1:
        dense += dims.hidden  # final norm
        if not dims.tied or pp > 1:
            dense += vocab_rows * dims.hidden
    expert = moe_layers * (dims.experts // ep) * dims.expert_params(etp) if moe_layers else 0
    return dense, expert


def stage_params(
    dims: ModelDims, tp: int, pp: int, stage: int, divisible_by: int = 128, ep: int = 1, etp: int = 1
) -> int:
    """Parameters of one rank of pipeline stage ``stage`` (dense + expert, `stage_split`). Equal to the count of
    megatron-core's build (tests/integration/plan: the meta-device build at TP/PP 1 and 2, and a MoE at EP 2)."""
    return sum(stage_split(dims, tp, pp, stage, divisible_by, ep, etp))


@functools.lru_cache(maxsize=8)
def teacher_dims(hf_dir: str) -> ModelDims:
    """The teacher's shapes from its config.json (or the copy in configs/models/)."""
    from megatron_rlvr.plan.recipe_files import find_hf_config

    hf = find_hf_config(hf_dir)
    if hf is None:
        raise ConfigError(
            f"algo.distill.teacher_hf_dir={hf_dir!r}: no config.json there or in configs/models/; the plan "
            "needs the teacher's shapes"
        )
    try:
        return ModelDims.from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"algo.distill.teacher_hf_dir={hf_dir!r}: config.json lacks a usable shape ({e})") from e
