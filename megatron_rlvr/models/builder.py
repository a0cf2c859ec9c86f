"""HF config -> megatron-core ``TransformerConfig`` and ``GPTModel`` (TE's spec when installed, else the local spec).

The attention a build runs is one decision, `attention_choice`: TE's spec ("te") where TE is usable; else the local
(pure torch) spec with one of two core attentions in place of megatron's ``DotProductAttention`` (which asserts
``packed_seq_params is None``): "sdpa" (``models.sdpa_attention.SdpaAttention``, torch's fused kernels; the default on
a GPU) or "unfused" (``runtime.cpu.attention.PackedDotProductAttention``, megatron's own math per block of whole
sequences; the default on the CPU, and under context parallelism). All three take packed (THD) sequences.

The vocabulary is padded here, once, by :func:`padded_vocab_size`; the token-statistics op and the actor use the
same function so every component agrees on which ids are padding.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.family import UnsupportedModelError, head_dim, num_kv_heads, rope_settings
from megatron_rlvr.models.hf_config import family_of
from megatron_rlvr.models.layout import ParallelLayout

DEFAULT_VOCAB_DIVISIBLE_BY = 128
logger = logging.getLogger(__name__)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's convention: rows padded up to a multiple of ``divisible_by * tp`` (ids >= vocab_size are padding)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # an installed but broken TE (no CUDA) counts as absent
        return False
    return torch.cuda.is_available()


CORE_ATTENTIONS = ("auto", "sdpa", "unfused")
ATTENTION_NAMES = {
    "te": "Transformer Engine's fused attention",
    "sdpa": "torch scaled_dot_product_attention",
    "unfused": "megatron's unfused attention (the score matrix)",
}


def attention_choice(use_te: bool, core_attention: str = "auto", *, cuda: bool, cp: int = 1) -> str:
    """The attention a build runs: "te" (TE's spec), or the local spec's "sdpa" or "unfused" core attention.

    ``core_attention`` (``model.core_attention``) picks the local spec's: "auto" means SDPA on a GPU and unfused on
    the CPU (where the tests compare every layout against it) or under context parallelism (the unfused packed
    attention runs its own; SDPA has none). TE's spec has its own attention, so it takes "auto" only.
    """
    if core_attention not in CORE_ATTENTIONS:
        raise UnsupportedModelError(f"model.core_attention={core_attention!r}: expected one of {CORE_ATTENTIONS}")
    if use_te:
        if core_attention != "auto":
            raise UnsupportedModelError(
                f"model.core_attention={core_attention}: picks the local spec's attention, but Transformer Engine's "
                "spec runs (it has its own); set model.use_transformer_engine=off to run it"
            )
        return "te"
    if core_attention == "sdpa" and cp > 1:
        raise UnsupportedModelError(
            f"model.core_attention=sdpa: context parallelism (actor.cp={cp}) needs TE's attention or the unfused "
            "packed attention (model.core_attention=unfused or auto)"
        )
    if core_attention == "auto":
        return "sdpa" if cuda and cp == 1 else "unfused"
    return core_attention


def resolve_use_te(setting: str) -> bool | None:
    """``model.use_transformer_engine`` -> the ``use_te`` of `layer_spec` (None: whatever is installed)."""
    if setting == "auto":
        return None
    if setting == "on" and not transformer_engine_available():
        raise UnsupportedModelError(
            "model.use_transformer_engine=on: transformer_engine is not importable here; "
            "install it (the NVIDIA container has it) or set auto/off"
        )
    return setting == "on"


def transformer_config_from_hf(
    hf: Mapping[str, Any],
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute: str = "none",
    ep: int = 1,
    etp: int | None = None,
    moe_aux_loss_coeff: float = 0.0,
    cp: int = 1,
    cp_comm_type: str = "p2p",
    **megatron_overrides: Any,
):
    """The megatron-core ``TransformerConfig`` reproducing ``hf``'s math, with the given parallel layout.

    ``recompute``: ``"none"``, ``"selective"`` (core attention) or ``"full"`` (every layer, uniform).
    ``ep`` / ``etp``: expert parallel and expert tensor parallel sizes (``etp`` None: megatron's default, = tp).
    ``moe_aux_loss_coeff`` > 0 adds megatron's router load-balancing loss (an MoE model's own math has none).
    ``cp``: context-parallel size (docs/context-parallel.md); on GPU the TE spec's attention runs TE's CP attention
    with ``cp_comm_type`` ("p2p", "all_gather", "a2a" or "a2a+p2p"), on CPU the local spec's packed attention does
    its own (runtime/cpu/cp_attention.py).
    ``megatron_overrides`` are passed to ``TransformerConfig`` last (e.g. ``variable_seq_lengths=True``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    family = family_of(hf)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}; expected 'none', 'selective' or 'full'")
    dims = ModelDims.from_hf(hf)
    # the layout's rules (models/layout.py), for a forward pass: a training step adds its own (the actor checks them)
    expert_tp = etp or (tp if dims.is_moe else 1)  # None: megatron-core's default, the TP size
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=expert_tp, sequence_parallel=sequence_parallel)
    layout.check(dims, prefix="", training=False)
    family_kwargs = family.megatron_kwargs(hf)
    experts = family_kwargs.get("num_moe_experts")
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=num_kv_heads(hf),
        kv_channels=head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Fusions are CUDA kernels; the unfused paths compute the same math.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not on_gpu,
    )
    kwargs.update(family_kwargs)
    if cp > 1:
        kwargs.update(cp_comm_type=cp_comm_type)
    if experts and moe_aux_loss_coeff:
        kwargs.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe_aux_loss_coeff)
    if recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    elif recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if vpp:
        # The interleaved schedule's steady state sends to the previous and the next stage in one exchange. At PP=2
        # those are one rank, and megatron-core's batched exchange posts both sends (and both receives) in one fixed
        # order, so the two are matched crosswise: activations arrive as gradients. Its unbatched exchange orders
        # them by rank parity and runs one direction on another group (what Megatron-LM's training sets too).
        kwargs.update(batch_p2p_comm=False, overlap_p2p_comm=True)
    if megatron_overrides.get("variable_seq_lengths"):
        # TransformerConfig rejects its default MoE dispatcher (allgather) with variable lengths even in a dense
        # model, which has no experts to dispatch: name the one it accepts.
        kwargs.update(moe_token_dispatcher_type="alltoall")
    kwargs.update(megatron_overrides)
    return TransformerConfig(**kwargs)


def layer_spec(
    use_te: bool | None = None,
    tcfg=None,
    vp_stage: int | None = None,
    core_attention: str = "auto",
    block_tokens: int | None = None,
):
    """Transformer Engine spec when TE is usable, else megatron-core's local (pure torch) spec with a core attention
    that also takes packed sequences: SDPA or the unfused one (`attention_choice`), whose blocks of short sequences
    hold at most ``block_tokens`` tokens (``model.packed_attention_block_tokens``; None: its default).

    ``tcfg`` adds what the model's config asks for: q/k norms (``qk_layernorm``) and, with experts, megatron's
    per-layer block spec (``moe_layer_freq`` picks a dense or an MoE layer for each index; this stage's slice).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if use_te is None:
        use_te = transformer_engine_available()
    cp = tcfg.context_parallel_size if tcfg is not None else 1
    attention = attention_choice(use_te, core_attention, cuda=torch.cuda.is_available(), cp=cp)
    _log_attention_once(attention)
    qk_layernorm = bool(tcfg is not None and tcfg.qk_layernorm)
    if tcfg is not None and tcfg.num_moe_experts:
        block = get_gpt_decoder_block_spec(
            tcfg, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
        )
        for spec in block.layer_specs if not use_te else ():
            _set_core_attention(spec, attention, block_tokens)
        return block
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    _set_core_attention(spec, attention, block_tokens)
    return spec


def _set_core_attention(spec, attention: str, block_tokens: int | None) -> None:
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_rlvr.models.sdpa_attention import SdpaAttention
    from megatron_rlvr.runtime.cpu.attention import PackedDotProductAttention

    core = SdpaAttention if attention == "sdpa" else PackedDotProductAttention
    if core is PackedDotProductAttention and block_tokens is not None:
        core = ModuleSpec(module=core, params={"block_tokens": block_tokens})
    spec.submodules.self_attention.submodules.core_attention = core


_logged_attention: set[str] = set()


def reset_attention_log() -> None:
    """Forget which attentions were logged: the next layer spec of each logs its line again."""
    _logged_attention.clear()


def _log_attention_once(attention: str) -> None:
    """The attention in the run's log, once per process and kind (every chunk, the reference and a teacher build
    a spec)."""
    if attention not in _logged_attention:
        _logged_attention.add(attention)
        logger.info("layer spec: %s (%s)", "TE" if attention == "te" else "local", ATTENTION_NAMES[attention])


def build_gpt_model(
    hf: Mapping[str, Any],
    tcfg,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    use_te: bool | None = None,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    core_attention: str = "auto",
    attention_block_tokens: int | None = None,
):
    """One megatron-core ``GPTModel`` chunk for this rank (pipeline stage / virtual stage ``vp_stage``).

    Needs megatron's parallel_state initialized (``megatron_rlvr.runtime.distributed.initialize_model_parallel``).
    Weights are randomly initialized; fill them with ``megatron_rlvr.bridge.load_hf_weights``.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    rope = rope_settings(hf)
    llama3 = rope["rope_type"] == "llama3"
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=layer_spec(use_te, tcfg, vp_stage, core_attention, attention_block_tokens),
        vocab_size=padded_vocab_size(hf["vocab_size"], tcfg.tensor_model_parallel_size, make_vocab_size_divisible_by),
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # logits stay vocab-sharded: the token-statistics op consumes the shards
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=float(rope["rope_theta"]),
        rope_scaling=llama3,
        rope_scaling_factor=float(rope["factor"]) if llama3 else 8.0,
        vp_stage=vp_stage,
    )
    if not tcfg.use_cpu_initialization:
        # Megatron's layers allocate on the current GPU, but a norm without TE or Apex is torch's own module, made
        # on the CPU: the first GPU run found its weights there in a chunk no DDP buffer adopts (the GPU check's
        # bridge model; the reference and a teacher are built the same way). Megatron-LM's get_model moves each chunk.
        model.cuda(torch.cuda.current_device())
    return model
