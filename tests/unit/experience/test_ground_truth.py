"""Ground-truth injection (experience/methods/ground_truth.py, docs/algorithms.md "Ground-truth injection"), against
values computed here by hand: G = 4, three policy samples with chosen rewards and the countdown reference scored by
the real verifier; the group advantages over the four; the reference row's tokens, mask, reward and engine log-probs;
the loss's ratio on that row (pi_theta / pi_old, clipped like any sample's); a rejected reference keeps its reward;
``groups: unsolved``; the one-line errors; and the method applied through the transform registry, which the loop
reads without naming it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_rlvr.algos import policy_loss
from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptItem
from megatron_rlvr.errors import ConfigError, UserError
from megatron_rlvr.experience.collect import Experience, to_rollouts
from megatron_rlvr.experience.methods.demonstrations import reference_solution
from megatron_rlvr.experience.methods.ground_truth import GroundTruthInjection
from megatron_rlvr.experience.transforms import Transforms, TransformSetup, enabled, source_config
from megatron_rlvr.ops.token_stats import TokenStats
from megatron_rlvr.protocols import Targets
from megatron_rlvr.rewards.countdown import score_countdown
from megatron_rlvr.rollout import Completion, RolloutConfig
from megatron_rlvr.testing.configs import algo_config, run_config
from tests.unit.experience.reference_fakes import CharTokenizer, CountdownPool

G = 4
EPS = 1e-6  # algo.advantage.eps
SOLVED = PromptItem("cd0", "", (5, 6), {"numbers": [3, 4, 5, 6], "target": 24}, "countdown")
UNSOLVED = PromptItem("cd1", "", (7, 8, 9), {"numbers": [1, 2, 3, 4], "target": 10}, "countdown")
# a row whose stored solution the verifier rejects (3 + 4 is not 24)
WRONG = PromptItem("cd2", "", (5, 6), {"numbers": [3, 4, 5, 6], "target": 24, "solution": "3 + 4"}, "countdown")


def _config(groups: str = "all") -> Config:
    algo = algo_config({"loss.kind": "grpo", "ground_truth.enabled": True, "ground_truth.groups": groups})
    return Config(algo=algo, rollout=RolloutConfig(group_size=G, stop=["\n"]))


def _experience(items: list[PromptItem], rewards: list[list[float]]) -> Experience:
    """G - 1 policy samples per prompt, as the source hands them over (rewards chosen, engine log-probs set)."""
    completions = [
        [Completion([40 + j, 41 + j], [-0.5 - j, -0.25], f"s{j}", "stop") for j in range(G - 1)] for _ in items
    ]
    flat = torch.tensor([r for group in rewards for r in group])
    rollouts = to_rollouts(items, completions, flat, 0)
    return Experience(
        items, completions, rollouts, Targets(advantages=torch.zeros(len(flat))), {}, {"reward/mean": 0.5}
    )


def _group_advantages(rewards: list[float]) -> list[float]:
    """GRPO's advantage, written out: (r - mean) / (Bessel std + eps); 0 for a group of equal rewards."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [0.0 if std == 0 else (r - mean) / (std + EPS) for r in rewards]


def _inject(items, rewards, groups="all"):
    cfg = _config(groups)
    return GroundTruthInjection(cfg, CharTokenizer(), CountdownPool(), pad_id=0)(0, _experience(items, rewards))


def test_the_reference_joins_each_group_scored_and_counted_in_the_advantages():
    out = _inject([SOLVED, UNSOLVED], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert [len(c) for c in out.completions] == [G, G]
    # the rewards: the policy's as given, then the verifier's score of the reference (accepted: 1)
    assert out.rollouts.rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    # by hand: group 1 mean 1/2, std sqrt(1/3); group 2 mean 1/4, std 1/2
    by_hand = [(r - 0.5) / (math.sqrt(1 / 3) + EPS) for r in (1, 0, 0, 1)]
    by_hand += [(r - 0.25) / (0.5 + EPS) for r in (0, 0, 0, 1)]
    assert by_hand == pytest.approx(_group_advantages([1, 0, 0, 1]) + _group_advantages([0, 0, 0, 1]), rel=1e-12)
    assert out.targets.advantages.tolist() == pytest.approx(by_hand, rel=1e-6)
    assert out.targets.advantages[7] == pytest.approx(1.5, rel=1e-5)  # the all-wrong group now has a positive sample
    for i, item in enumerate((SOLVED, UNSOLVED)):
        row = i * G + G - 1
        ids = [ord(c) for c in reference_solution(item) + "\n"]  # ended like the engine's answers: rollout.stop
        prompt = len(item.prompt_ids)
        assert out.completions[i][-1].token_ids == ids
        assert out.rollouts.tokens[row, : prompt + len(ids)].tolist() == list(item.prompt_ids) + ids
        trained = out.rollouts.response_mask[row].nonzero().flatten().tolist()
        assert trained == list(range(prompt - 1, prompt - 1 + len(ids)))  # position t predicts token t + 1
        assert not out.rollouts.engine_logp[row].any()  # no engine sampled it
        # the policy samples are handed on unchanged: tokens, mask and the engine's log-probs
        policy = slice(i * G, i * G + G - 1)
        assert out.rollouts.engine_logp[policy, prompt - 1 : prompt + 1].tolist() == [
            [-0.5 - j, -0.25] for j in range(G - 1)
        ]
        assert out.rollouts.response_mask[policy].sum().item() == 2 * (G - 1)
    assert out.metrics == {
        "reward/mean": 0.5,  # reward/* stays the policy's own
        "ground_truth/injected_frac": 1.0,
        "ground_truth/verified_frac": 1.0,
        "ground_truth/advantage": pytest.approx((by_hand[3] + by_hand[7]) / 2, rel=1e-6),
    }


def _token_stats(logits: torch.Tensor, targets: torch.Tensor) -> TokenStats:
    """The four per-token statistics the loss reads, from full-vocabulary logits (with gradient)."""
    logprobs = torch.log_softmax(logits.clone().requires_grad_(True), -1)
    top = logprobs.topk(3, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return TokenStats(logprobs.gather(-1, targets[..., None])[..., 0], entropy, top.values, top.indices)


def test_the_loss_takes_the_reference_rows_ratio_as_pi_theta_over_pi_old_clipped_like_any_sample():
    out = _inject([SOLVED, UNSOLVED], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    cfg = _config().algo
    targets, mask = out.rollouts.tokens[:, 1:], out.rollouts.response_mask
    logits = torch.randn(*targets.shape, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = out.targets.advantages.double()
    n_tok = float(mask.sum())
    references = [G - 1, 2 * G - 1]

    # exactly on-policy (one mini-batch, no reference model): pi_old is the update's own forward, rho = 1
    stats = _token_stats(logits, targets)
    loss, metrics = policy_loss(stats, None, adv, mask, cfg, target_ids=targets, rollout_logp=out.rollouts.engine_logp)
    (grad,) = torch.autograd.grad(loss, stats.logp)
    by_hand = torch.where(mask, -adv[:, None] / n_tok, torch.zeros_like(grad))  # -A_i rho / N_tok, rho = 1
    torch.testing.assert_close(grad, by_hand, rtol=1e-12, atol=0)
    assert metrics["kl_old"] == 0.0 and metrics["clip_frac"] == 0.0
    assert float(loss.detach()) == pytest.approx(float(-(adv[:, None] * mask).sum() / n_tok), rel=1e-12)

    # the statistics pass's pi_old (several mini-batches): rho_t = exp(logp - old_logp) on the reference rows too;
    # the first reference's rho = e^0.1 stays inside 1 + eps_high, the second's e^0.5 is clipped (A > 0: no gradient)
    stats = _token_stats(logits, targets)
    shift = torch.zeros_like(stats.logp)
    shift[references[0]], shift[references[1]] = 0.1, 0.5
    old_logp = stats.logp.detach() - shift
    loss, metrics = policy_loss(stats, old_logp, adv, mask, cfg, target_ids=targets)
    (grad,) = torch.autograd.grad(loss, stats.logp)
    rho = torch.ones_like(grad)
    rho[references[0]], rho[references[1]] = math.exp(0.1), math.exp(0.5)
    clipped = torch.zeros_like(mask)
    clipped[references[1]] = adv[references[1]] > 0 and math.exp(0.5) > 1 + cfg.loss.eps_high
    by_hand = torch.where(mask & ~clipped, -adv[:, None] * rho / n_tok, torch.zeros_like(grad))
    torch.testing.assert_close(grad, by_hand, rtol=1e-12, atol=0)
    assert clipped[references[1]].all() and not clipped[references[0]].any()
    ref_tokens = mask[references[1]].sum().item()
    assert metrics["clip_frac"] == pytest.approx(ref_tokens / n_tok, rel=1e-12)


def test_a_reference_the_verifier_rejects_keeps_its_reward():
    out = _inject([WRONG, UNSOLVED], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert score_countdown("3 + 4", WRONG.answer) == 0.0
    assert out.completions[0][-1].text == "3 + 4" and out.rollouts.rewards[G - 1] == 0.0
    # a negative sample of its group: mean 1/4, std 1/2
    assert out.targets.advantages[:G].tolist() == pytest.approx([(r - 0.25) / (0.5 + EPS) for r in (1, 0, 0, 0)])
    assert out.rollouts.response_mask[G - 1].any()  # it still trains
    assert out.metrics["ground_truth/verified_frac"] == 0.5  # one of the step's two references was accepted
    assert out.metrics["ground_truth/injected_frac"] == 1.0


def test_unsolved_places_the_reference_only_where_no_policy_sample_is_correct():
    out = _inject([SOLVED, UNSOLVED], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], groups="unsolved")
    # group 1 has a correct sample: the reference's row trains nothing, the three samples' advantages are their own
    # (mean 1/3, Bessel std sqrt(1/3))
    own = [(r - 1 / 3) / (math.sqrt(1 / 3) + EPS) for r in (1, 0, 0)]
    assert out.targets.advantages[:G].tolist() == pytest.approx([*own, 0.0], rel=1e-6)
    assert not out.rollouts.response_mask[G - 1].any() and out.rollouts.response_mask[: G - 1].any()
    # group 2 has none: the reference joins it as with groups: all
    assert out.targets.advantages[G:].tolist() == pytest.approx([(r - 0.25) / (0.5 + EPS) for r in (0, 0, 0, 1)])
    assert out.rollouts.response_mask[2 * G - 1].any()
    assert out.metrics["ground_truth/injected_frac"] == 0.5
    assert out.metrics["ground_truth/advantage"] == pytest.approx(0.75 / (0.5 + EPS), rel=1e-6)
    assert out.metrics["ground_truth/verified_frac"] == 1.0  # both references scored, one injected


def test_a_task_without_a_reference_solution_is_one_line():
    item = PromptItem("m1", "", (1,), "42", "math")
    with pytest.raises(UserError) as raised:
        _inject([item], [[0.0, 0.0, 0.0]])
    message = str(raised.value)
    assert message.startswith("algo.ground_truth: prompt 'm1' (task 'math') has no reference solution to inject")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rollout.group_size": 1}, r"rollout.group_size=1 leaves no policy sample beside the reference; set >= 2$"),
        (
            {"algo.demonstrations": True, "algo.advantage.kind": "reward"},
            r"not with algo.demonstrations, which replaces every response",
        ),
        ({"algo.drop_uniform_groups": True}, r"not with algo.drop_uniform_groups \(dynamic sampling"),
        ({"algo.rollout_correction.kind": "tis"}, r"algo.rollout_correction.kind=tis reads the engine's log-probs"),
    ],
)
def test_what_it_cannot_run_beside_is_one_line_when_the_run_starts(settings, message):
    cfg = run_config({"algo.ground_truth.enabled": True, **settings})
    with pytest.raises(ConfigError, match=rf"^algo.ground_truth.enabled: {message}"):
        source_config(cfg)


def test_beside_armor_the_registry_refuses_two_methods_that_add_samples():
    cfg = run_config({"algo.ground_truth.enabled": True, "algo.loss.kind": "grpo", "algo.armor.anchors": True})
    with pytest.raises(ConfigError, match=r"^algo: armor and ground_truth both add samples of their own"):
        source_config(cfg)


def test_the_loop_applies_it_through_the_registry_without_naming_it():
    trainer = (Path(__file__).resolve().parents[3] / "megatron_rlvr" / "trainer.py").read_text()
    assert "ground_truth" not in trainer and "GroundTruth" not in trainer
    cfg = run_config({"algo.ground_truth.enabled": True, "algo.loss.kind": "grpo", "rollout.group_size": G})
    assert [r.name for r in enabled(cfg)] == ["ground_truth"]
    assert enabled(run_config({"rollout.group_size": G})) == []  # off by default
    assert source_config(cfg).rollout.group_size == G - 1  # the source samples G - 1, the reference is the G-th
    # what the trainer does with the registry (trainer.py: Transforms.build(setup), then run.transforms(step, exp))
    setup = TransformSetup(cfg, None, CountdownPool(), None, [], CharTokenizer(), 0, None, Path("."), 0)
    transforms = Transforms.build(setup)
    assert [type(t) for t in transforms.transforms] == [GroundTruthInjection]
    assert transforms.before(0) == {}
    out = transforms(0, _experience([SOLVED, UNSOLVED], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert out.rollouts.rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert out.metrics["ground_truth/injected_frac"] == 1.0
