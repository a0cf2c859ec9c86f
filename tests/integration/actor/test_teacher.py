"""The distillation teacher on the actor ranks (teacher.py): a teacher's scores, and self-distillation's scores on the
(privileged prompt + response) streams, equal a plain HF forward at the response positions, packed or not, at TP 1
and 2 and at CP 2 (context parallelism); the teacher's tokenizer and the reference answer are checked with one-line
errors. (A teacher equal to the student gives exactly zero signals and a zero gradient through the whole update at
TP = 2, PP = 2 and DP = 2: tests/integration/actor/test_same_weights.py.)"""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.data import PromptItem
from megatron_rlvr.errors import UserError
from megatron_rlvr.testing.configs import algo_config

TEMPERATURE = 0.9
TEMPLATE = "Answer: {answer}\n"
ITEMS = [PromptItem("p0", "", (1, 2), "12", "math"), PromptItem("p1", "", (1, 2), "a much longer answer", "math")]


def flat_targets():
    from megatron_rlvr.protocols import Targets

    return Targets(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))


def distill_batch(vocab: int, seed: int = 0, rewards: list[float] | None = None):
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(seed)
    b, s = 4, 10
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    lengths = torch.tensor([10, 7, 9, 5])
    mask = torch.zeros(b, s - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 2 : n - 1] = True
        tokens[i, n:] = 0
    return rollouts(tokens, mask, rewards=None if rewards is None else torch.tensor(rewards))


def teacher_actor(hf_dir: str, tp: int, algo: dict, pack: bool = True, cp: int = 1):
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig

    return MegatronActor(
        ModelConfig(hf_dir=hf_dir),
        ActorConfig(tp=tp, cp=cp, micro_batch_size=2, lr=1e-3, pack_sequences=pack),
        algo_config({**{"loss.kind": "grpo", "distill.top_n": 4, **algo}}),
        temperature=TEMPERATURE,
        total_steps=2,
    )


def teacher_scores(hf_dir: str, teacher_dir: str, tp: int, mode: str, pack: bool, cp: int = 1):
    """The teacher's scores of the batch, and the metrics of one update with them (at TP x CP)."""
    from megatron_rlvr.runtime.distributed import model_parallel

    algo = (
        {"distill.kind": "teacher", "distill.teacher_hf_dir": teacher_dir}
        if mode == "teacher"
        else {"distill.kind": "self", "distill.template": TEMPLATE}
    )
    with model_parallel(tp=tp, pp=1, seed=11, cp=cp):
        actor = teacher_actor(hf_dir, tp, algo, pack, cp)
        batch = distill_batch(actor.vocab_size)
        statistics = actor.score(batch, ITEMS, mini_batches=1)
        metrics = actor.update(batch, flat_targets(), statistics, mini_batches=1)
        teacher = statistics.teacher
        return teacher.logp, teacher.topn_ids, teacher.topn_logits, metrics


def plain_forward(hf_dir: str, prefixes: list[list[int]]):
    """An HF forward of each (prefix + sequence) row alone: per student position t of a response token, the
    log-prob of token t + 1 and the logits / temperature at position k + t (k = the prefix's length)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    batch = distill_batch(model.config.vocab_size)
    rows = []
    with torch.no_grad():
        for i, prefix in enumerate(prefixes):
            ids = torch.tensor([list(prefix) + batch.tokens[i].tolist()])
            rows.append((len(prefix), model(ids).logits[0].double() / TEMPERATURE))
    return batch, rows


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("student"), seed=3))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("teacher"), seed=4))


def _check_against_plain_forward(hf_dir: str, prefixes, results, single_dp_rank: bool) -> None:
    batch, rows = plain_forward(hf_dir, prefixes)
    for logp, ids, logits, metrics in results:
        checked = 0
        for i, (k, row) in enumerate(rows):
            for t in torch.nonzero(batch.response_mask[i]).flatten().tolist():
                logprobs = torch.log_softmax(row[k + t], -1)
                assert float(logp[i, t]) == pytest.approx(float(logprobs[batch.tokens[i, t + 1]]), abs=2e-5)
                top = torch.sort(logprobs, descending=True, stable=True).indices[:4]
                assert ids[i, t].tolist() == top.tolist(), (i, t)
                torch.testing.assert_close(logits[i, t].double(), row[k + t, top], atol=2e-5, rtol=1e-5)
                checked += 1
            assert float(logp[i][~batch.response_mask[i]].abs().sum()) == 0.0  # nothing off the response tokens
        assert checked == int(batch.response_mask.sum())
        if single_dp_rank:  # (with DP > 1 the logged mean is the mean of the ranks' token means, like every metric)
            mean = float(logp[batch.response_mask].double().mean())
            assert metrics["distill/teacher_logp"] == pytest.approx(mean, abs=1e-5)


@pytest.mark.dist
@pytest.mark.parametrize("tp, pack, cp", [(1, True, 1), (2, True, 1), (2, False, 1), (1, True, 2)])
def test_teacher_scores_equal_a_plain_forward_of_the_teacher(workers2, student, other_model, tp, pack, cp):
    results = workers2.run(teacher_scores, student, other_model, tp, "teacher", pack, cp)
    _check_against_plain_forward(other_model, [[]] * 4, results, single_dp_rank=tp * cp == 2)


@pytest.mark.dist
@pytest.mark.parametrize("tp, pack, cp", [(1, True, 1), (2, True, 1), (1, False, 1), (1, True, 2)])
def test_self_distillation_scores_the_response_under_the_privileged_prompt(workers2, student, tp, pack, cp):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(student)
    prefixes = [
        tokenizer(TEMPLATE.format(answer=item.answer), add_special_tokens=False)["input_ids"]
        for item in ITEMS
        for _ in range(2)
    ]
    assert len(prefixes[0]) != len(prefixes[2])  # rows shift by different lengths
    results = workers2.run(teacher_scores, student, student, tp, "self", pack, cp)
    _check_against_plain_forward(student, prefixes, results, single_dp_rank=tp * cp == 2)


def test_privileged_rows_shift_the_response_and_realign_exactly():
    from megatron_rlvr.actor.teacher import privileged_batch, realign

    batch = distill_batch(50)
    prefixes = [[7], [7], [8, 9, 10], [8, 9, 10]]
    privileged, shifts = privileged_batch(batch, prefixes)
    assert shifts.tolist() == [1, 1, 3, 3]
    for i, prefix in enumerate(prefixes):
        k = len(prefix)
        assert privileged.tokens[i, :k].tolist() == prefix
        assert torch.equal(privileged.tokens[i, k : k + 10], batch.tokens[i])
        assert torch.equal(privileged.response_mask[i, k : k + 9], batch.response_mask[i])
        assert not privileged.response_mask[i, :k].any()
    # a value computed at privileged position p = t + k comes back at student position t
    positions = torch.arange(privileged.response_mask.shape[1], dtype=torch.float32).expand(4, -1)
    back = realign(positions, shifts, batch.response_mask.shape[1])
    assert torch.equal(back, torch.arange(9.0)[None] + shifts[:, None].float())
    wide = realign(positions[..., None].expand(-1, -1, 3), shifts, 9)
    assert torch.equal(wide[..., 2], back)


def test_a_teacher_with_another_tokenizer_is_one_line_naming_the_key(student, tmp_path):
    import shutil

    from megatron_rlvr.models.tokenizer_check import check_same_tokenizer as check

    def check_same_tokenizer(student_dir, teacher_dir):
        return check("algo.distill.teacher_hf_dir", teacher_dir, student_dir)

    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    check_same_tokenizer(student, student)  # the same tokenizer passes
    other = make_tiny_hf_model("qwen2", tmp_path / "other", seed=5, with_tokenizer=False)
    demo = __import__("pathlib").Path(__file__).resolve().parents[3] / "megatron_rlvr" / "demo" / "model"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, other / name)
    with pytest.raises(UserError) as e:
        check_same_tokenizer(student, str(other))
    message = str(e.value)
    assert message.startswith(f"algo.distill.teacher_hf_dir={str(other)!r}: its tokenizer differs from model.hf_dir's")
    assert "\n" not in message
    with pytest.raises(UserError, match="algo.distill.teacher_hf_dir=.*no config.json"):
        check_same_tokenizer(student, str(tmp_path / "missing"))


@pytest.mark.parametrize("answer", [None, "", "  ", {"numbers": [1, 2]}, []])
def test_a_missing_reference_answer_under_self_is_one_line(answer):
    from megatron_rlvr.actor.teacher import reference_text

    item = PromptItem("row-7", "2+2=", (1,), answer, "math")
    with pytest.raises(UserError) as e:
        reference_text(item)
    assert str(e.value).startswith(
        "algo.distill.kind=self: prompt 'row-7' has no reference answer"
    ) and "\n" not in str(e.value)


def test_reference_answers_of_strings_numbers_and_the_countdown_task():
    from megatron_rlvr.actor.teacher import reference_text
    from megatron_rlvr.tasks.countdown import check_solution

    assert reference_text(PromptItem("a", "", (1,), "42", "math")) == "42"
    assert reference_text(PromptItem("b", "", (1,), 7, "math")) == "7"
    assert reference_text(PromptItem("c", "", (1,), {"solution": "x = 3"}, "math")) == "x = 3"
    reference = {"numbers": [3, 7, 4, 9], "target": 31}
    solution = reference_text(PromptItem("d", "", (1,), reference, "countdown"))
    assert check_solution(solution, reference["numbers"], reference["target"])


def test_a_teacher_whose_heads_do_not_divide_the_actor_tp_is_one_line(other_model):
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.passes import ActorPasses
    from megatron_rlvr.actor.teacher import teacher_chunks

    passes = ActorPasses(ActorConfig(tp=3), None, vocab_size=1, local_vocab=1, temperature=1.0, replay=None)
    with pytest.raises(UserError) as e:
        teacher_chunks(passes, other_model, 128, use_te=None)
    message = str(e.value)
    assert message.startswith(f"algo.distill.teacher_hf_dir={other_model!r}: the actor's layout does not fit it: "), (
        message
    )
    assert "actor.tp=3 must divide the model's" in message and "\n" not in message
