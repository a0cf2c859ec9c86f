"""Same weights, same numbers: a frozen copy of the policy (the KL reference, ARMOR's reset reference, a teacher that
is the student, CRPO's frozen teacher, and LoRA's base with the adapters off) computes exactly what the policy
computes on the same batch, at TP = 2, PP = 2 and DP = 2, through the trainer's own calls (``score`` then
``update``) with two mini-batches.

Exactly means bit for bit, so every bound here is 0: the frozen copy holds the policy's weights bit for bit and runs
the same code on the same micro-batches, so nothing may round differently. With zero advantages the only signal left
is the one between the policy and its copy, which is then 0 exactly: loss 0 and gradient 0 on the first mini-batch,
hence no Adam step (Adam moves a parameter by lr * m / (sqrt(v) + eps), 0 for a gradient of exactly 0; the learning
rate is large so that any noise would move the policy visibly), hence 0 again on the second mini-batch.

What broke it before (each found by this test): at TP = 2 the first layer's GEMM ran folded in the trainable policy
and as per-token GEMVs in a frozen copy (actor/chunks.py, ``same_dispatch``): teacher = student gave a mean gradient
norm of 4.9 over the two mini-batches, the KL's 0.064; at DP = 2 the copies were scored with the whole batch's plan
and the update ran each mini-batch's (other neighbours in each packed stream): gradient norm 2.2e-6, which Adam made
an lr-sized step (the next KL 0.43).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.data import PromptItem
from megatron_rlvr.testing.configs import algo_config

pytestmark = pytest.mark.dist

ROWS, WIDTH, SAMPLES = 8, 12, 2  # 4 prompts x 2 samples; two mini-batches of 2 whole groups
ITEMS = [PromptItem(f"p{i}", "", (1, 2), str(i), "math") for i in range(ROWS // SAMPLES)]
MINI_BATCHES = 2
TEMPLATE = "Answer: {answer}\n"


def _targets(advantages: bool):
    from megatron_rlvr.protocols import Targets

    return Targets(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * 2) if advantages else torch.zeros(ROWS))


def _batch(vocab: int):
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (ROWS, WIDTH), generator=g)
    lengths = [11, 8, 10, 9, 6, 7, 9, 8]  # packed streams of different lengths
    mask = torch.zeros(ROWS, WIDTH - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 2 : n - 1] = True
        tokens[i, n:] = 0
    # CRPO: rewards 0, so no group has a correct response and no row reads a privileged context
    return rollouts(tokens, mask, rewards=torch.zeros(ROWS))


def _actor(hf_dir: str, tp: int, pp: int, algo: dict, lora: bool = False):
    from megatron_rlvr.actor.config import ActorConfig, LoraConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig

    return MegatronActor(
        ModelConfig(hf_dir=hf_dir),
        ActorConfig(tp=tp, pp=pp, micro_batch_size=2, lr=1e-2, lora=LoraConfig(rank=4) if lora else None),
        algo_config({**{"loss.kind": "grpo", **algo}}),
        temperature=0.9,
        total_steps=4,
    )


def _step(actor, batch, advantages: bool = False, mini_batches: int = MINI_BATCHES) -> dict:
    """The trainer's step: score, then update; the metrics and how far the frozen copy's log-probs are from the
    policy's statistics pass (max |difference| over the response tokens)."""
    statistics = actor.score(batch, ITEMS, mini_batches=mini_batches)
    metrics = actor.update(batch, _targets(advantages), statistics, mini_batches=mini_batches)
    mask = batch.response_mask
    copies = {"ref_logp": statistics.ref_logp, "teacher_logp": statistics.teacher and statistics.teacher.logp}
    for name, copy in copies.items():
        if copy is not None:
            metrics[f"{name} - old_logp"] = float((copy - statistics.old_logp)[mask].abs().max())
    return metrics


def same_weights_numbers(hf_dir: str, tp: int, pp: int) -> dict[str, dict]:
    """Every frozen copy's first step(s) at one layout (two ranks: DP = 2 / (tp * pp))."""
    from megatron_rlvr.runtime.distributed import model_parallel

    out = {}
    with model_parallel(tp=tp, pp=pp, seed=11):
        teacher = {
            "distill.kind": "teacher",
            "distill.teacher_hf_dir": hf_dir,
            "distill.only": True,
            "distill.top_n": 3,
        }
        actor = _actor(hf_dir, tp, pp, teacher)
        vocab = actor.vocab_size
        out["teacher = student"] = _step(actor, _batch(vocab), advantages=True)  # distill_only: advantages unused

        crpo = {"distill.kind": "crpo", "distill.template": TEMPLATE, "distill.crpo.top_k": 6}
        out["CRPO frozen teacher"] = _step(_actor(hf_dir, tp, pp, crpo), _batch(vocab))

        actor = _actor(hf_dir, tp, pp, {"kl.coef": 0.1})
        out["KL reference"] = _step(actor, _batch(vocab))
        # the policy did not move: the KL to it is still 0 on a batch whose policy term trains
        out["KL reference, one mini-batch"] = _step(actor, _batch(vocab), advantages=True, mini_batches=1)

        # ARMOR's reference takes the policy's weights after it moved; its only use is the mixed ratio, which is then
        # 1 exactly (loss/kl_old, the k3 estimate of the log-ratio, 0) on the first mini-batch after the reset
        actor = _actor(hf_dir, tp, pp, {"armor.mixed_ratio_share": 0.75})
        moved = _batch(vocab)
        _step(actor, moved, advantages=True, mini_batches=1)
        off = actor.compute_ref_logp(moved) - actor.compute_old_logp(moved)
        out["ARMOR before the reset"] = {"ref_logp - old_logp": float(off[moved.response_mask].abs().max())}
        actor.reset_reference()
        out["ARMOR reset reference"] = _step(actor, _batch(vocab), advantages=True, mini_batches=1)

        out["LoRA base"] = _step(_actor(hf_dir, tp, pp, {"kl.coef": 0.1}, lora=True), _batch(vocab))
    return out


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen"), seed=3))


# what must be exactly 0 in each case (the frozen copy's log-probs against the policy's, and the terms they feed)
DIFFERENCES = ("ref_logp - old_logp", "teacher_logp - old_logp")
ZERO_STEP = ("actor/loss", "actor/grad_norm")  # zero advantages: the frozen copy is the only signal
EXACT = {
    "teacher = student": (*ZERO_STEP, "distill/reverse_kl", "distill/forward_kl_topn"),
    "CRPO frozen teacher": (*ZERO_STEP, "distill/reverse_kl", "distill/forward_kl_topn"),
    "KL reference": (*ZERO_STEP, "loss/kl_ref"),
    "KL reference, one mini-batch": ("loss/kl_ref", "loss/kl_old"),  # the policy term trains; the KL is still 0
    "ARMOR reset reference": ("loss/kl_old",),
    "LoRA base": (*ZERO_STEP, "loss/kl_ref"),
}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_a_frozen_copy_computes_exactly_what_the_policy_computes(workers2, tiny_qwen, tp, pp):
    numbers = workers2.run(same_weights_numbers, tiny_qwen, tp, pp)[-1]  # the last rank: the last pipeline stage
    shown = (*DIFFERENCES, *ZERO_STEP, "loss/kl_ref", "loss/kl_old", "distill/reverse_kl", "distill/forward_kl_topn")
    for case, m in numbers.items():
        print(f"tp={tp} pp={pp} {case}: " + ", ".join(f"{k} {m[k]:.3g}" for k in shown if k in m))
    failures = []
    for case, keys in EXACT.items():
        m = numbers[case]
        exact = {k: m[k] for k in (*DIFFERENCES, *keys) if k in m}
        failures += [f"{case}: {k} = {v!r}" for k, v in exact.items() if v != 0.0]
        if "distill/top1_agreement" in m:
            assert m["distill/top1_agreement"] == 1.0, case
    assert not failures, failures
    assert numbers["ARMOR before the reset"]["ref_logp - old_logp"] > 1e-4  # the reset had something to do
    assert numbers["KL reference, one mini-batch"]["actor/grad_norm"] > 0  # the policy term does train
