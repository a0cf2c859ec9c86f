"""How far apart fp32 rounding alone may put two computations of the same log-probabilities: the bound that every
engine-vs-actor, engine-vs-reference and cross-layout comparison in the tests asserts.

The claim such a test makes is "these are the same function of the same weights, evaluated in fp32". The two sides
run different kernels: vLLM's CPU kernels and megatron-core's torch ops, oneDNN's GEMMs and ATen's, a TP-split GEMM
and a whole one, a decode step and a prefill, AVX-512/AMX blocking on an Intel Xeon and AVX2 blocking on an AMD
EPYC (the two CPUs of this project's machines). They add the same terms in different orders, so their results differ
by rounding, and the bound has to follow from that, not from what one CPU happened to give.

Derivation. fp32 rounds each operation to within a relative ``u = 2**-24`` (the unit roundoff, half of
``torch.finfo(torch.float32).eps``). A log-prob ``lp = z_y - logsumexp(z)`` over ``V`` logits ``z`` ends a chain of
reductions; per decoder layer: the input RMSNorm (``hidden`` terms), the q/k/v projection (``hidden``), q/k norms
(``head_dim``, Qwen3), the attention score (``head_dim``), the softmax's sum and the weighted sum of values (``S``
each, the sequence's length), the output projection (``heads * head_dim``), the MLP's RMSNorm (``hidden``), gate/up
(``hidden``) and down (``ffn``; in a MoE layer the router (``hidden``, then ``experts``), an expert's down
(``expert_ffn``) and the sum over the ``experts_per_token``); then the final RMSNorm and the output layer
(``hidden`` each) and the log-sum-exp (``V``). Call ``D`` the sum of these lengths (`reduction_depth`). Rounding
errors of a reduction accumulate like a random walk (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd
ed., section 3.5: the error of a sum of n terms is typically ``sqrt(n) u`` times their magnitude, at worst ``n u``),
and RMSNorm keeps the relative error of each layer's output what its reductions made it, so the relative error at
the logits is about ``u sqrt(D)``. The terms of the final difference are ``z_y`` and ``logsumexp(z)``, at most
``M = max|z| + ln V`` in size. One fp32 evaluation is then off by about ``u sqrt(D) M``, and two evaluations whose
rounding errors are independent differ by ``sqrt(2)`` times that:

    bound = sqrt(implementations) * u * sqrt(D) * (max|z| + ln V)

It is an estimate of the scale, with every term taken at its largest (``M`` for every rounding error, every
reduction at gain 1), not a tail bound over tokens. Measured on the tiny test models (4 layers, hidden 128, V 1001,
``max|z|`` about 2.5: ``D`` about 5,200 at 31 positions, bound 6.5e-5; 7.7e-5 at 316): the engine and the actor
differ by at most 9.5e-7 on an AVX-512 Xeon and 1.43e-6 on an AVX2 EPYC (tests/integration/rollout/test_vllm_stream.py), two
vLLM-CPU evaluations (decode vs prefill) by 1.9e-6, and transformers in fp32 lies within 1.4e-6 of itself in fp64:
40x or more below the bound. On SmolLM2-135M (30 layers, V 49,152; bound about 1e-3) the actor and transformers
differ by 2.7e-5 and the engine and the actor by 3.3e-5 (docs/real-model.md): again 40x below. A wrong weight, a
stale KV block or a mis-mapped layer moves log-probs by 1e-2 to 1 on the tiny models, far above it.

Where two computations must agree bit for bit (the same kernels on the same inputs in the same order: a weight read
back, a batch rebuilt, a loss on equal batches), the tests say so and assert 0, not this bound.
"""

from __future__ import annotations

import math
from pathlib import Path

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.hf_config import read_hf_config

UNIT_ROUNDOFF_FP32 = 2.0**-24


def reduction_depth(dims: ModelDims, seq_len: int) -> int:
    """``D`` of the module doc: the summed lengths of the reductions on the path from the tokens to one log-prob."""
    attention = dims.hidden + dims.hidden + dims.head_dim + 2 * seq_len + dims.heads * dims.head_dim
    if dims.qk_norm:
        attention += dims.head_dim
    dense = dims.hidden + dims.hidden + dims.ffn
    moe = dims.hidden + dims.hidden + dims.experts + dims.expert_ffn + dims.experts_per_token
    pattern = dims.moe_pattern or (0,) * dims.layers
    layers = sum(attention + (moe if is_moe else dense) for is_moe in pattern)
    return layers + 2 * dims.hidden + dims.vocab


def fp32_logprob_bound(dims: ModelDims, seq_len: int, max_abs_logit: float, implementations: int = 2) -> float:
    """How far apart ``implementations`` fp32 evaluations of a log-prob of a model of ``dims`` may lie from rounding
    alone (the module doc's derivation): positions up to ``seq_len``, logits up to ``max_abs_logit`` in size
    (temperature applied). ``implementations=1``: one fp32 evaluation against an exact (fp64) one."""
    return _bound(reduction_depth(dims, seq_len), max_abs_logit, dims.vocab, implementations)


def fp32_logit_bound(dims: ModelDims, seq_len: int, max_abs_logit: float, implementations: int = 2) -> float:
    """The same for the logits themselves: the chain stops at the output layer (no log-sum-exp), and the logits'
    own size is the magnitude."""
    depth = reduction_depth(dims, seq_len) - dims.vocab
    return math.sqrt(implementations) * UNIT_ROUNDOFF_FP32 * math.sqrt(depth) * max_abs_logit


def model_logprob_bound(model_dir: str | Path, seq_len: int, max_abs_logit: float, implementations: int = 2) -> float:
    """`fp32_logprob_bound` for the model in an HF directory."""
    dims = ModelDims.from_hf(read_hf_config(str(model_dir)))
    return fp32_logprob_bound(dims, seq_len, max_abs_logit, implementations)


def fp32_token_stat_bound(vocab: int, max_abs_logit: float, implementations: int = 2) -> float:
    """The same for statistics computed from given logits (log-prob, entropy, top-N log-probs over ``vocab`` ids):
    only the log-sum-exp and the entropy's sum reduce, over ``vocab`` terms each."""
    return _bound(2 * vocab, max_abs_logit, vocab, implementations)


def fp32_sum_bound(terms: int, magnitude: float, implementations: int = 2) -> float:
    """The same for one reduction of ``terms`` terms of size up to ``magnitude`` (a merged LoRA weight
    ``W + s B A``: rank + 1 terms)."""
    if terms < 1 or implementations < 1 or not magnitude >= 0:
        raise ValueError(
            f"fp32_sum_bound: expected terms, implementations >= 1, magnitude >= 0, got {terms}, "
            f"{implementations}, {magnitude}"
        )
    return math.sqrt(implementations) * UNIT_ROUNDOFF_FP32 * math.sqrt(terms) * magnitude


def _bound(depth: int, max_abs_logit: float, vocab: int, implementations: int) -> float:
    if depth < 1 or vocab < 1 or implementations < 1 or not max_abs_logit >= 0:
        raise ValueError(
            f"fp32 bound: expected depth, vocab, implementations >= 1 and max_abs_logit >= 0, got {depth}, {vocab}, "
            f"{implementations}, {max_abs_logit}"
        )
    magnitude = max_abs_logit + math.log(vocab)
    return math.sqrt(implementations) * UNIT_ROUNDOFF_FP32 * math.sqrt(depth) * magnitude
