"""LoRA on the Megatron actor (actor.lora, docs/lora.md), on 2 gloo ranks, fp32:

- with B = 0 at init the policy's log-probs equal the base's bit for bit, the reference (the base with the adapters
  off) equals a separate frozen copy, and after updates every base parameter is bit-identical while the adapters
  moved; DDP and the optimizer hold the adapters alone;
- adapters filled from one HF-layout draw give the same loss and adapter gradients (in HF layout) at TP = 2, PP = 2,
  PP = 2 with VPP = 2, and CP = 2 as at TP = PP = 1 (DP = 2), relative <= 1e-5; on the tiny Qwen3-MoE at EP = 2 as at EP = 1, the experts'
  adapters included; and at the 32B recipe's layout, TP = 2 x DP = 2 with the distributed optimizer (four ranks),
  and the tiny Qwen3-MoE at expert TP = 2 (TP = 1 x DP = 4, ETP = 2: an expert-DP of 2), as at TP = DP = 1. (Sequence parallelism cannot run in the CPU actor: megatron's torch norm refuses it; the
  adapters' SP path is checked on the linears themselves, tests/integration/models/test_lora.py.)
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.integration.actor.lora_workers import (
    REL,
    adapters_hf,
    batch,
    build,
    fill_from_hf_layout,
    gather_sharded_grads,
    grads_hf,
    local_grads,
    update,
    whole_grads,
)

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("lora_qwen"), seed=3))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("lora_moe") / "moe", seed=51))


def _init_and_freeze(hf_dir: str, tp: int):
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, seed=11):
        plain = build(hf_dir, tp=tp, lora=False, kl_coef=0.1)
        b = batch(plain.vocab_size)
        base_logp, copy_ref = plain.compute_old_logp(b), plain.compute_ref_logp(b)
    with model_parallel(tp=tp, seed=11):
        actor = build(hf_dir, tp=tp, kl_coef=0.1, dist_opt=True)
        assert actor.reference is None and actor.has_reference  # the reference is free: no second copy
        base = {n: p.detach().clone() for c in actor.model_chunks for n, p in c.named_parameters() if "lora_" not in n}
        first = actor.compute_old_logp(b)
        ref_logp = actor.compute_ref_logp(b)
        trained = {id(p) for c in actor.model_chunks for p in c.parameters() if p.requires_grad}
        adapters = {id(p) for p in actor.lora.parameters()}
        adapter_numel = sum(p.numel() for p in actor.lora.parameters())
        optimizer_numel = sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"])
        before = adapters_hf(actor)
        for _ in range(2):
            update(actor, b, first, ref_logp)
        after = adapters_hf(actor)
        same_base = all(
            torch.equal(p, base[n]) for c in actor.model_chunks for n, p in c.named_parameters() if "lora_" not in n
        )
        frozen = all(
            not p.requires_grad for c in actor.model_chunks for n, p in c.named_parameters() if "lora_" not in n
        )
        return dict(
            base_logp=base_logp,
            copy_ref=copy_ref,
            first=first,
            ref=ref_logp,
            ref_after=actor.compute_ref_logp(b),
            new=actor.compute_old_logp(b),
            same_base=same_base,
            frozen=frozen,
            trains_adapters_only=trained == adapters,
            adapter_numel=adapter_numel,
            optimizer_numel=optimizer_numel,
            b_moved=max((after[n] - before[n]).abs().max().item() for n in before if "lora_B" in n),
        )


@pytest.mark.parametrize("tp", [1, 2])
def test_init_is_the_base_the_base_stays_and_the_reference_is_free(workers2, tiny_qwen, tp):
    ranks = workers2.run(_init_and_freeze, tiny_qwen, tp)
    out = ranks[0]
    assert torch.equal(out["first"], out["base_logp"])  # B = 0: the base, bit for bit
    # the adapters off: the numbers of a separate frozen copy and of the trainable base policy, bit for bit
    assert torch.equal(out["ref"], out["copy_ref"])
    assert torch.equal(out["ref"], out["base_logp"])
    assert torch.equal(out["ref_after"], out["ref"])  # the reference does not move with the adapters
    assert out["same_base"] and out["frozen"] and out["trains_adapters_only"]
    # the distributed optimizer shards the adapters (and nothing else) over DP = 2 / tp ranks
    dp = 2 // tp
    held = sum(r["optimizer_numel"] for r in ranks) / tp
    assert out["adapter_numel"] <= held <= out["adapter_numel"] + 64 * dp
    assert max(r["optimizer_numel"] for r in ranks) < out["adapter_numel"] or dp == 1
    assert out["b_moved"] > 0
    mask = batch(10).response_mask
    assert (out["new"] - out["first"]).abs()[mask].max() > 1e-4  # the policy moved


def _loss_and_grads(hf_dir: str, tp: int, pp: int, sp: bool, vpp: int | None = None, cp: int = 1):
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp, seed=11):
        actor = build(hf_dir, tp=tp, pp=pp, sp=sp, vpp=vpp, cp=cp)
        fill_from_hf_layout(actor)
        b = batch(actor.vocab_size)
        old_logp = actor.compute_old_logp(b)
        metrics = update(actor, b, old_logp)
        return metrics["actor/loss"], metrics["actor/grad_norm"], grads_hf(actor), old_logp


@pytest.fixture(scope="module")
def single(workers2, tiny_qwen):
    return workers2.run(_loss_and_grads, tiny_qwen, 1, 1, False)[0]


@pytest.mark.parametrize("tp,pp,vpp,cp", [(2, 1, None, 1), (1, 2, None, 1), (1, 2, 2, 1), (1, 1, None, 2)])
def test_loss_and_adapter_gradients_match_tp1(workers2, tiny_qwen, single, tp, pp, vpp, cp):
    loss1, norm1, grads1, old1 = single
    loss, norm, grads, old = workers2.run(_loss_and_grads, tiny_qwen, tp, pp, False, vpp, cp)[0]
    torch.testing.assert_close(old, old1, rtol=0, atol=1e-5)
    assert loss == pytest.approx(loss1, rel=REL)
    assert norm == pytest.approx(norm1, rel=REL)
    assert sorted(grads) == sorted(grads1) and len(grads) == 4 * 7 * 2  # 4 layers x 7 HF modules x (A, B)
    worst = max(((grads[n] - grads1[n]).abs().max() / grads1[n].abs().max()).item() for n in grads)
    print(f"TP={tp} PP={pp} VPP={vpp} CP={cp}: loss {loss:.8g} vs {loss1:.8g}, worst adapter-gradient rel {worst:.2e}")
    assert worst <= REL
    assert min(g.abs().max().item() for g in grads1.values()) > 0  # every adapter half has a gradient


def _moe_numbers(hf_dir: str, ep: int):
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=1, pp=1, seed=11, ep=ep, etp=1):
        actor = build(hf_dir, ep=ep, pack_sequences=True)
        assert any(a.expert for a in actor.lora.adapters)
        b = batch(actor.vocab_size)
        with torch.no_grad():
            for a in actor.lora.adapters:  # B from a draw per global name: the same adapters at any EP
                stem = actor.lora.names[id(a.module)]
                g = torch.Generator().manual_seed(zlib.crc32(stem.encode()))
                a.B.copy_(torch.randn(a.B.shape, generator=g) * 0.05)
        metrics = update(actor, b, actor.compute_old_logp(b))
        return metrics["actor/loss"], local_grads(actor)


def test_moe_adapters_at_ep2_match_ep1(workers2, tiny_moe):
    (loss1, g1), _ = workers2.run(_moe_numbers, tiny_moe, 1)
    (loss2, g2a), (_, g2b) = workers2.run(_moe_numbers, tiny_moe, 2)
    assert loss2 == pytest.approx(loss1, rel=REL)
    g2 = g2a | g2b  # each EP rank holds half the experts
    assert sorted(g2) == sorted(g1) and any(".experts." in n for n in g1)
    worst = max(((g2[n] - g1[n]).abs().max() / g1[n].abs().max().clamp_min(1e-30)).item() for n in g1)
    print(f"EP=2 vs EP=1: loss {loss2:.8g} vs {loss1:.8g}, worst adapter-gradient rel {worst:.2e}")
    assert worst <= REL


def _recipe_layout_numbers(hf_dir: str, tp: int, etp: int):
    """One update of adapters filled from one HF-layout draw, under the distributed optimizer: the statistics pass's
    log-probs, the loss, the gradient norm and every adapter's whole gradient (whole_grads)."""
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=1, seed=11, ep=1, etp=etp):
        actor = build(hf_dir, tp=tp, etp=etp, dist_opt=True, pack_sequences=True)
        fill_from_hf_layout(actor)
        b = batch(actor.vocab_size)
        old_logp = actor.compute_old_logp(b)
        metrics = update(actor, b, old_logp)
        gather_sharded_grads(actor)
        return old_logp, metrics["actor/loss"], metrics["actor/grad_norm"], whole_grads(actor)


def _dense_and_moe(dense_dir: str, moe_dir: str, tp: int, etp: int):
    """The dense model at TP = tp and the MoE at TP = 1 (at TP > 1 megatron wants sequence parallelism for an MoE,
    which the CPU actor cannot run), ETP = etp."""
    return {
        "dense": _recipe_layout_numbers(dense_dir, tp, 1),
        "moe": _recipe_layout_numbers(moe_dir, 1, etp),
    }


@pytest.fixture(scope="module")
def workers1():
    from megatron_rlvr.testing.workers import WorkerGroup

    with WorkerGroup(1, timeout_s=600) as group:
        yield group


def test_recipe_layout_and_expert_tp2_match_one_rank(workers1, workers4, tiny_qwen, tiny_moe):
    """The 32B LoRA recipe's layout (configs/qwen2.5-32b_math-l3to5_casp_lora.yaml: TP = 2 x DP = 4, the distributed
    optimizer) at TP = 2 x DP = 2: the DP reduce-scatter leaves each rank one shard of the adapters' reduced gradient,
    and the whole halves' partial sums (models/lora.reduce_partial_grads) are then summed over TP in that buffer. And
    the MoE's experts at ETP = 2 (B of linear_fc1 split over ETP, gate and up per shard; A of linear_fc2 split, its
    partial sums over ETP), at TP = 1 x DP = 4 with the experts' gradients reduce-scattered over an expert-DP of 2.

    Bounds, as for every layout of this file: log-probs within 1e-5 absolute, gradients and their norm within
    REL = 1e-5 relative (to each tensor's largest entry). The splits reorder fp32 sums; the longest is the
    vocabulary's 1001 logits in the log-partition (hidden 128, FFN 256 / 64, 31 tokens in each weight gradient, 4
    ranks), whose rounding for terms of mixed sign is about sqrt(1001) x 2^-24 ~ 2e-6 relative (1001 x 2^-24 = 6e-5 is
    the worst case, which such sums do not reach). Measured on the Xeon: 1.3e-6 (dense) and 3.7e-6 (MoE) for the
    gradients. The loss itself is no check of the model: at the first update (ratio 1) GRPO's value is -sum(A) / N."""
    four = workers4.run(_dense_and_moe, tiny_qwen, tiny_moe, 2, 2, timeout_s=600)
    one = workers1.run(_dense_and_moe, tiny_qwen, tiny_moe, 1, 1, timeout_s=600)[0]
    for model in ("dense", "moe"):
        old1, loss1, norm1, grads1 = one[model]
        # every adapter half has a gradient, but a routed expert no token reached (0 at every layout, then)
        idle = [n for n, g in grads1.items() if not g.abs().max() > 0]
        assert all(".experts." in n for n in idle) and len(idle) < len(grads1) / 4, idle
        scale = {n: g.abs().max().clamp_min(1e-30) for n, g in grads1.items()}
        for old, loss, norm, grads in (rank[model] for rank in four):  # every rank: its own gathered copy
            assert sorted(grads) == sorted(grads1)
            worst = max(((grads[n] - grads1[n]).abs().max() / scale[n]).item() for n in grads)
            print(
                f"{model} at 4 ranks vs 1: grad norm {norm:.8g} vs {norm1:.8g}, worst adapter-gradient rel "
                f"{worst:.2e}, log-probs {(old - old1).abs().max().item():.2e}"
            )
            torch.testing.assert_close(old, old1, rtol=0, atol=1e-5)
            assert loss == pytest.approx(loss1, rel=REL)
            assert norm == pytest.approx(norm1, rel=REL)
            assert worst <= REL
    assert any(".experts." in n for n in one["moe"][3])
