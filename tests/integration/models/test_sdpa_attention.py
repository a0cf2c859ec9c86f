"""The local spec with SDPA core attention (models/sdpa_attention.py) computes what the local spec with megatron's
unfused attention computes: on CPU in fp32, at TP=2 (two query heads and one key/value group per rank, so SDPA's
grouped-query path runs), for a right-padded batch and for the same sequences packed into one THD stream, the loss
and every parameter's gradient agree; and how the builder chooses between the attentions (`attention_choice`)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.models.builder import attention_choice
from megatron_rlvr.models.family import UnsupportedModelError
from tests.integration.models.mp_helpers import varied_batch

LENGTHS = [7, 19, 1, 12]
# fp32: the two attentions order their sums differently, nothing else differs
TOL = 2e-5


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("sdpa"), seed=5, with_tokenizer=False))


def _run(model, ids: torch.Tensor, weights: torch.Tensor, packed: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(loss, the valid positions' logits [T, V/tp] in sequence order, {parameter: grad}) of one forward+backward;
    the loss weighs every valid position's logits shard with ``weights`` [T, V/tp]."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model.zero_grad(set_to_none=True)
    if packed:
        tokens = torch.cat([ids[i, :n] for i, n in enumerate(LENGTHS)])[None]
        positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS)
        )
        logits = model(tokens, positions, attention_mask=None, packed_seq_params=params)[0]
    else:
        b, s = ids.shape
        positions = torch.arange(s).unsqueeze(0).expand(b, -1)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
        out = model(ids, positions, attention_mask=causal)
        logits = torch.cat([out[i, :n] for i, n in enumerate(LENGTHS)])
    loss = (logits * weights).sum()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logits.detach(), grads


def _compare_worker(hf_dir: str, tp: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rlvr.bridge import load_hf_weights
    from megatron_rlvr.models import build_gpt_model, load_hf_config, padded_vocab_size, transformer_config_from_hf
    from megatron_rlvr.models.sdpa_attention import SdpaAttention
    from megatron_rlvr.runtime import distributed
    from megatron_rlvr.runtime.cpu.attention import PackedDotProductAttention

    distributed.initialize_model_parallel(tp=tp, seed=3)
    try:
        hf = load_hf_config(hf_dir)
        tcfg = transformer_config_from_hf(hf, tp=tp)
        ids = varied_batch(hf["vocab_size"], LENGTHS, seed=2)
        gen = torch.Generator().manual_seed(100 + ps.get_tensor_model_parallel_rank())
        weights = torch.randn(sum(LENGTHS), padded_vocab_size(hf["vocab_size"], tp) // tp, generator=gen)
        runs, kinds = {}, {}
        for attention in ("unfused", "sdpa"):
            model = build_gpt_model(hf, tcfg, core_attention=attention)
            load_hf_weights([model], hf_dir)
            kinds[attention] = type(model.decoder.layers[0].self_attention.core_attention)
            for packed in (False, True):
                runs[attention, packed] = _run(model, ids, weights, packed)

        def worst(a, b) -> dict:
            loss_a, logits_a, grads_a = a
            loss_b, logits_b, grads_b = b
            assert grads_a.keys() == grads_b.keys() and grads_a
            return {
                "loss": abs(loss_a - loss_b).item() / max(abs(loss_b).item(), 1.0),
                "logits": (logits_a - logits_b).abs().max().item(),
                "grads": max(
                    ((grads_a[k] - grads_b[k]).abs().max() / grads_b[k].abs().max().clamp_min(1e-6)).item()
                    for k in grads_a
                ),
                "params": len(grads_a),
            }

        return {
            "kinds": {k: v.__name__ for k, v in kinds.items()},
            "padded": worst(runs["sdpa", False], runs["unfused", False]),
            "packed": worst(runs["sdpa", True], runs["unfused", True]),
            "sdpa_packed_vs_padded": worst(runs["sdpa", True], runs["sdpa", False]),
            "expected": {"unfused": PackedDotProductAttention.__name__, "sdpa": SdpaAttention.__name__},
        }
    finally:
        distributed.destroy_model_parallel()


@pytest.mark.dist
def test_sdpa_spec_equals_unfused_spec_padded_and_packed(workers2, tiny_qwen2):
    for rank_result in workers2.run(_compare_worker, tiny_qwen2, 2):
        assert rank_result["kinds"] == rank_result["expected"]
        for layout in ("padded", "packed", "sdpa_packed_vs_padded"):
            diff = rank_result[layout]
            print(layout, diff)
            assert diff["params"] >= 30, diff  # every layer's weights have a gradient to compare
            assert diff["loss"] <= TOL and diff["logits"] <= TOL and diff["grads"] <= TOL, (layout, diff)


def test_attention_choice():
    assert attention_choice(True, cuda=True) == "te"
    assert attention_choice(False, cuda=True) == "sdpa"
    assert attention_choice(False, cuda=False) == "unfused"  # the CPU keeps the attention its tests compare against
    assert attention_choice(False, cuda=True, cp=2) == "unfused"  # SDPA has no context parallelism
    assert attention_choice(False, "sdpa", cuda=False) == "sdpa"
    assert attention_choice(False, "unfused", cuda=True) == "unfused"
    with pytest.raises(UnsupportedModelError, match="use_transformer_engine=off"):
        attention_choice(True, "sdpa", cuda=True)
    with pytest.raises(UnsupportedModelError, match="context parallelism"):
        attention_choice(False, "sdpa", cuda=True, cp=2)
    with pytest.raises(UnsupportedModelError, match="expected one of"):
        attention_choice(False, "flash", cuda=True)


def _attention(heads: int, groups: int, head_dim: int, dtype: torch.dtype, device: str):
    """An SdpaAttention of one TP rank, built without a process group (a stand-in collection of TP size 1)."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rlvr.models.sdpa_attention import SdpaAttention

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    tp1 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return SdpaAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=tp1).to(device)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_attention_runs_flash_on_cuda_in_bf16(packed):
    """The 1B check model's attention (16 query heads, 2 key/value groups, head size 128) in bf16 under torch's flash
    backend alone, which raises if flash cannot serve the call (the layout, GQA, the backward): the speed the GPU
    check measures is flash's. Forward and backward agree with the math backend in fp32."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, groups, d, lengths = 16, 2, 128, [300, 1, 731, 17]
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = sum(lengths)
    shapes = (
        [(t, heads, d), (t, groups, d), (t, groups, d)] if packed else [(512, 2, h, d) for h in (heads, groups, groups)]
    )
    qkv32 = [torch.randn(s, generator=gen, device="cuda") for s in shapes]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu) if packed else None
    grads, outs = {}, {}
    for backend, dtype in ((SDPBackend.FLASH_ATTENTION, torch.bfloat16), (SDPBackend.MATH, torch.float32)):
        attention = _attention(heads, groups, d, dtype, "cuda")
        qkv = [x.to(dtype).requires_grad_() for x in qkv32]
        with sdpa_kernel([backend]):
            out = attention(*qkv, None, packed_seq_params=params)
            out.float().square().sum().backward()
        outs[backend] = out.float()
        grads[backend] = [x.grad.float() for x in qkv]
    torch.testing.assert_close(outs[SDPBackend.FLASH_ATTENTION], outs[SDPBackend.MATH], atol=2e-2, rtol=2e-2)
    for a, b in zip(grads[SDPBackend.FLASH_ATTENTION], grads[SDPBackend.MATH]):
        torch.testing.assert_close(a, b, atol=5e-2 * b.abs().max().item(), rtol=0)


def test_the_choice_is_logged_once(caplog):
    from megatron_rlvr.models import builder

    builder.reset_attention_log()
    with caplog.at_level("INFO", logger="megatron_rlvr.models.builder"):
        for _ in range(2):  # the policy's chunk, then the reference's: one line
            spec = builder.layer_spec(use_te=False, core_attention="sdpa")
    assert spec.submodules.self_attention.submodules.core_attention.__name__ == "SdpaAttention"
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rlvr.models.builder"]
    assert lines == ["layer spec: local (torch scaled_dot_product_attention)"]
