"""Engine-TP shards of exported weights: for actors at (TP, PP) = (1,1), (2,1), (1,2), (4,1) the export cut into each
engine rank's shard at engine TP 1, 2, 4 equals an independent slicing of the HF checkpoint bit for bit, and the
shards put back together (one copy of each replicated kv head) give the full tensors; the partitioning is the one
vLLM's own weight loaders apply; a TP vLLM cannot split and a tensor of the wrong shape are refused naming it."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megatron_rlvr.bridge.reshard import ReshardError, engine_shard, engine_tp_problems, rule_of
from megatron_rlvr.models.dims import ModelDims
from tests.integration.models.mp_helpers import build_chunks

ENGINE_TPS = (1, 2, 4)
BUCKET_BYTES = 100_000

# "gqa": 8 heads over 2 kv heads (engine TP 4 replicates each kv head twice), qkv bias, untied, vocab 1001 (no TP
# divides it). "tied": 8 heads over 4 kv heads (the actor can run at TP 4), tied embeddings, a 40-token vocabulary
# (vLLM pads it to 64: at engine TP 4 the last rank holds no row of it).
MODELS = {
    "gqa": ("qwen2", dict(seed=11, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_hidden_layers=2)),
    "tied": (
        "llama",
        dict(seed=12, num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_hidden_layers=2, vocab_size=40),
    ),
    # Qwen3-MoE: 8 experts (moe_intermediate_size 64), layer 1 dense, q/k norms, router; 4 heads over 2 kv heads
    "moe": ("qwen3_moe", dict(seed=13)),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_reshard")
    return {key: str(make_tiny_hf_model(arch, root / key, **kw)) for key, (arch, kw) in MODELS.items()}


def _dims(hf_dir: str) -> ModelDims:
    from megatron_rlvr.models import load_hf_config

    return ModelDims.from_hf(load_hf_config(hf_dir))


def _hf_reference(hf_dir: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as an engine must receive them (a tied model's lm_head is the embedding)."""
    from megatron_rlvr.bridge import HFCheckpointReader

    with HFCheckpointReader(hf_dir) as reader:
        ref = {n: reader.read(n) for n in reader.names()}
    ref.setdefault("lm_head.weight", ref["model.embed_tokens.weight"])
    return ref


def reference_slice(name: str, full: torch.Tensor, dims: ModelDims, tp: int, rank: int) -> torch.Tensor:
    """An engine rank's shard written another way than ``engine_shard`` (whole heads, chunks, explicit padding)."""
    d = dims.head_dim
    if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):  # norms, q/k norms, the MoE router
        return full
    if ".q_proj." in name:
        return full.unflatten(0, (dims.heads, d)).chunk(tp)[rank].flatten(0, 1)
    if ".k_proj." in name or ".v_proj." in name:
        heads = full.unflatten(0, (dims.kv_heads, d))
        part = heads.chunk(tp)[rank] if tp <= dims.kv_heads else heads[rank * dims.kv_heads // tp][None]
        return part.flatten(0, 1)
    if ".gate_proj." in name or ".up_proj." in name:
        return full.chunk(tp, dim=0)[rank]
    if ".o_proj." in name or ".down_proj." in name:
        return full.chunk(tp, dim=1)[rank]
    padded = F.pad(full, (0, 0, 0, (-full.shape[0]) % 64))
    rows = padded.shape[0] // tp
    return padded.chunk(tp)[rank][: max(0, min(rows, full.shape[0] - rank * rows))]


def reassemble(name: str, shards: list[torch.Tensor], dims: ModelDims) -> torch.Tensor:
    """The full tensor from every rank's shard: the split dim concatenated, one copy of each replicated kv head."""
    rule, tp = rule_of(name), len(shards)
    if rule in ("replicated", "qk_norm", "router"):
        assert all(torch.equal(s, shards[0]) for s in shards), f"{name}: replicated shards differ"
        return shards[0]
    if rule == "kv" and tp > dims.kv_heads:
        replicas = tp // dims.kv_heads
        for r, s in enumerate(shards):
            assert torch.equal(s, shards[r - r % replicas]), f"{name}: replicas of one kv head differ"
        shards = shards[::replicas]
    return torch.cat(shards, dim=1 if rule in ("o", "down", "expert_down") else 0)


def _reshard_worker(hf_dir: str, tp: int, pp: int, engine_tps: tuple[int, ...], bucket_bytes: int, ep: int = 1) -> dict:
    """Export at (tp, pp, ep), cut every tensor for each engine TP on arrival (as an engine rank would) and compare."""
    from megatron_rlvr.bridge import export_hf_weights
    from megatron_rlvr.runtime import distributed

    try:
        hf, chunks = build_chunks(hf_dir, tp, pp, ep=ep, etp=1 if ep > 1 else None)
        dims, ref = _dims(hf_dir), _hf_reference(hf_dir)
        problems, seen = [], set()
        stats = {"empty_vocab_shards": 0, "replicated_kv": 0, "shards": 0}
        for bucket in export_hf_weights(chunks, hf, bucket_bytes=bucket_bytes):
            for name, t in bucket:
                seen.add(name)
                if not torch.equal(t, ref[name]):
                    problems.append(f"{name}: exported tensor differs from the checkpoint")
                for e in engine_tps:
                    shards = [engine_shard(name, t, dims, e, r) for r in range(e)]
                    for r, s in enumerate(shards):
                        want = reference_slice(name, ref[name], dims, e, r)
                        stats["shards"] += 1
                        stats["empty_vocab_shards"] += s.numel() == 0
                        if s.dtype != want.dtype or not torch.equal(s, want):
                            problems.append(
                                f"{name} e={e} rank {r}: shape {list(s.shape)} != {list(want.shape)} or values differ"
                            )
                    stats["replicated_kv"] += rule_of(name) == "kv" and e > dims.kv_heads
                    if not torch.equal(reassemble(name, shards, dims), t):
                        problems.append(f"{name} e={e}: the shards do not reassemble to the full tensor")
        missing = sorted(set(ref) - seen)
        return {"problems": problems + [f"{n}: never exported" for n in missing], **stats}
    finally:
        distributed.destroy_model_parallel()


@pytest.mark.dist
@pytest.mark.parametrize(
    "model,tp,pp,ep",
    [
        ("gqa", 1, 1, 1),
        ("gqa", 2, 1, 1),
        ("gqa", 1, 2, 1),
        ("tied", 1, 2, 1),
        ("tied", 2, 1, 1),
        ("tied", 4, 1, 1),
        ("moe", 1, 1, 4),  # experts from their four EP owners
        ("moe", 2, 1, 2),
    ],
)
def test_engine_shards_of_the_export_equal_the_sliced_checkpoint(workers4, tiny_models, model, tp, pp, ep):
    results = workers4.run(_reshard_worker, tiny_models[model], tp, pp, ENGINE_TPS, BUCKET_BYTES, ep)
    dims = _dims(tiny_models[model])
    for rank, r in enumerate(results):
        assert r["problems"] == [], f"rank {rank}: {r['problems'][:5]}"
        assert r["shards"] > 0
        # the cases the models were chosen for did occur
        assert (r["replicated_kv"] > 0) == (dims.kv_heads < max(ENGINE_TPS)), f"rank {rank}: kv replication"
        assert (r["empty_vocab_shards"] > 0) == (model == "tied"), f"rank {rank}: empty vocabulary shards"


def _vllm_layers(monkeypatch, dims: ModelDims, tp: int, rank: int):
    """vLLM's own parallel layers as engine TP rank ``rank`` of ``tp`` builds them (the TP group stubbed)."""
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    monkeypatch.setattr(ps, "get_tp_group", lambda: types.SimpleNamespace(rank_in_group=rank, world_size=tp))
    kw = dict(params_dtype=torch.float32)
    with set_current_vllm_config(VllmConfig()):
        return types.SimpleNamespace(
            qkv=QKVParallelLinear(dims.hidden, dims.head_dim, dims.heads, dims.kv_heads, bias=True, **kw),
            o=RowParallelLinear(dims.heads * dims.head_dim, dims.hidden, bias=False, **kw),
            gate_up=MergedColumnParallelLinear(dims.hidden, [dims.ffn] * 2, bias=False, **kw),
            down=RowParallelLinear(dims.ffn, dims.hidden, bias=False, **kw),
            embed=VocabParallelEmbedding(dims.vocab, dims.hidden, **kw),
            lm_head=ParallelLMHead(dims.vocab, dims.hidden, **kw),
        )


@pytest.mark.parametrize("model", ["gqa", "tied"])  # the MoE model's experts: the next test
@pytest.mark.parametrize("tp", ENGINE_TPS)
def test_engine_shard_is_what_vllms_weight_loaders_keep(monkeypatch, tiny_models, model, tp):
    """Load the checkpoint through vLLM's QKV/merged/row/vocab loaders at each rank and compare what they kept."""
    pytest.importorskip("vllm")
    dims, ref = _dims(tiny_models[model]), _hf_reference(tiny_models[model])
    p = "model.layers.0."
    for rank in range(tp):
        layers = _vllm_layers(monkeypatch, dims, tp, rank)
        weights, biases = [], []
        for part in ("q", "k", "v"):
            rows = (dims.heads if part == "q" else dims.kv_heads) * dims.head_dim
            for kind, param, kept in (("weight", layers.qkv.weight, weights), ("bias", layers.qkv.bias, biases)):
                name = f"{p}self_attn.{part}_proj.{kind}"
                full = ref[name] if name in ref else torch.randn(rows)  # llama has no qkv bias: vLLM's rule still
                layers.qkv.weight_loader(param, full, part)
                kept.append(engine_shard(name, full, dims, tp, rank))
        assert torch.equal(layers.qkv.weight, torch.cat(weights)), f"qkv weight tp={tp} rank {rank}"
        assert torch.equal(layers.qkv.bias, torch.cat(biases)), f"qkv bias tp={tp} rank {rank}"
        for i, part in enumerate(("gate", "up")):
            layers.gate_up.weight_loader(layers.gate_up.weight, ref[f"{p}mlp.{part}_proj.weight"], i)
        want = torch.cat(
            [
                engine_shard(f"{p}mlp.{g}_proj.weight", ref[f"{p}mlp.{g}_proj.weight"], dims, tp, rank)
                for g in ("gate", "up")
            ]
        )
        assert torch.equal(layers.gate_up.weight, want), f"gate_up tp={tp} rank {rank}"
        for layer, name in ((layers.o, f"{p}self_attn.o_proj.weight"), (layers.down, f"{p}mlp.down_proj.weight")):
            layer.weight_loader(layer.weight, ref[name])
            assert torch.equal(layer.weight, engine_shard(name, ref[name], dims, tp, rank)), f"{name} tp={tp}"
        for layer, name in ((layers.embed, "model.embed_tokens.weight"), (layers.lm_head, "lm_head.weight")):
            layer.weight_loader(layer.weight, ref[name])
            shard = engine_shard(name, ref[name], dims, tp, rank)
            rows = shard.shape[0]
            assert torch.equal(layer.weight[:rows], shard), f"{name} tp={tp} rank {rank}"
            assert not layer.weight[rows:].any(), f"{name}: vLLM's padding rows beyond the shard are not zero"


def test_a_tp_vllm_cannot_split_is_refused_naming_the_tensor_and_sizes():
    dims = ModelDims(
        hidden=128, heads=8, kv_heads=2, head_dim=16, ffn=256, vocab=1001, layers=2, tied=False, qkv_bias=True
    )
    with pytest.raises(ReshardError, match=r"q_proj\.weight: engine tp=3 does not divide its 8 attention heads"):
        engine_shard("model.layers.1.self_attn.q_proj.weight", torch.zeros(128, 128), dims, 3, 0)
    with pytest.raises(ReshardError, match=r"k_proj\.bias: engine tp=3 is not a multiple of its 2 kv heads"):
        engine_shard("model.layers.0.self_attn.k_proj.bias", torch.zeros(32), dims, 3, 0)
    with pytest.raises(ReshardError, match=r"lm_head\.weight: engine tp=3 .* padding of 1001 to 1024"):
        engine_shard("lm_head.weight", torch.zeros(1001, 128), dims, 3, 0)
    with pytest.raises(ReshardError, match=r"down_proj\.weight: shape \[128, 200\], expected 256 columns"):
        engine_shard("model.layers.0.mlp.down_proj.weight", torch.zeros(128, 200), dims, 2, 0)
    with pytest.raises(ReshardError, match=r"model\.layers\.0\.rotary_emb\.inv_freq: no engine partitioning rule"):
        engine_shard("model.layers.0.rotary_emb.inv_freq", torch.zeros(8), dims, 2, 0)
    with pytest.raises(ReshardError, match=r"rank 2 is not in \[0, 2\)"):
        engine_shard("model.norm.weight", torch.zeros(128), dims, 2, 2)
    assert engine_tp_problems(dims, 4) == [] and engine_tp_problems(dims, 8) == []
    assert len(engine_tp_problems(dims, 3)) == 4  # heads, kv heads, intermediate size, padded vocabulary


def _fused_moe_loader(tp: int):
    """vLLM's RoutedExperts loader methods on a stand-in layer at MoE TP ``tp`` (they read only these attributes)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    config = types.SimpleNamespace(is_act_and_mul=True, moe_parallel_config=types.SimpleNamespace(tp_size=tp))
    return types.SimpleNamespace(
        moe_config=config,
        _get_hidden_dim=RoutedExperts._get_hidden_dim,
        _narrow_expert_data_for_padding=RoutedExperts._narrow_expert_data_for_padding,
    )


@pytest.mark.parametrize("tp", ENGINE_TPS)
def test_expert_shards_are_what_vllms_fused_moe_loader_keeps(tiny_models, tp):
    """Every expert of one MoE layer through vLLM 0.32's own fused-MoE loading (its checkpoint-name mapping, then
    ``RoutedExperts._load_w13`` / ``_load_w2`` into w13 [E, 2 * ffn/tp, H] and w2 [E, H, ffn/tp]) at each engine TP
    rank equals ``engine_shard``'s slices; vLLM's expert-parallel placement (``determine_expert_map``) equals
    ``expert_ranks``, and under ``ep=True`` a rank keeps its experts whole and nothing of the others."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from megatron_rlvr.bridge.reshard import expert_ranks

    dims, ref = _dims(tiny_models["moe"]), _hf_reference(tiny_models["moe"])
    layer = f"model.layers.{dims.moe_layers[0]}.mlp."
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", dims.experts)
    assert {m[3] for m in mapping} == {"w1", "w2", "w3"} and len(mapping) == 3 * dims.experts
    n, H, E = dims.expert_ffn // tp, dims.hidden, dims.experts
    for rank in range(tp):
        loader = _fused_moe_loader(tp)
        w13, w2 = torch.full((E, 2 * n, H), float("nan")), torch.full((E, H, n), float("nan"))
        for _, weight_name, expert, shard_id in mapping:  # weight_name: "experts.{e}.gate_proj."
            full = ref[f"{layer}{weight_name}weight"]
            if shard_id == "w2":
                RoutedExperts._load_w2(loader, expert_data=w2[expert], shard_dim=1, loaded_weight=full, tp_rank=rank)
            else:
                RoutedExperts._load_w13(
                    loader, expert_data=w13[expert], shard_dim=0, shard_id=shard_id, loaded_weight=full, tp_rank=rank
                )
        for e in range(E):
            name = f"{layer}experts.{e}."
            gate, up, down = (ref[f"{name}{p}_proj.weight"] for p in ("gate", "up", "down"))
            want13 = torch.cat(
                [engine_shard(f"{name}{p}_proj.weight", t, dims, tp, rank) for p, t in (("gate", gate), ("up", up))]
            )
            assert torch.equal(w13[e], want13), f"w13 expert {e} tp={tp} rank {rank}"
            assert torch.equal(w2[e], engine_shard(f"{name}down_proj.weight", down, dims, tp, rank)), f"w2 expert {e}"
    for ep in (2, 3, 4):  # 3: uneven, the first ranks hold one more
        for rank in range(ep):
            _, expert_map, _ = determine_expert_map(ep, rank, E)
            held = [e for e in range(E) if expert_map[e] >= 0]
            assert held == list(expert_ranks(E, ep)[rank]), f"ep={ep} rank {rank}"
            for e in range(E):
                name = f"{layer}experts.{e}.down_proj.weight"
                shard = engine_shard(name, ref[name], dims, ep, rank, ep=True)
                assert torch.equal(shard, ref[name]) if e in held else shard.numel() == 0, f"ep={ep} expert {e}"
    router = f"{layer}gate.weight"
    assert all(torch.equal(engine_shard(router, ref[router], dims, tp, r), ref[router]) for r in range(tp))


def test_an_expert_layout_vllm_cannot_split_is_refused_naming_it(tiny_models):
    dims = _dims(tiny_models["moe"])  # 8 experts, moe_intermediate_size 64
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    with pytest.raises(ReshardError, match=r"up_proj\.weight: engine tp=3 does not divide its 64 moe_intermediate"):
        engine_shard(name, torch.zeros(64, dims.hidden), dims, 3, 0)
    with pytest.raises(ReshardError, match=r"experts\.3\.up_proj\.weight: shape \[32, 128\], expected 64 rows"):
        engine_shard(name, torch.zeros(32, dims.hidden), dims, 2, 0)
    assert any("greater than the 8 experts" in p for p in engine_tp_problems(dims, 16))
    assert any("experts' intermediate size 64" in p for p in engine_tp_problems(dims, 3))
    assert not any("intermediate size 64" in p for p in engine_tp_problems(dims, 3, ep=True))
