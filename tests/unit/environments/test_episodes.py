"""The episode runner on a scripted engine and a user-written environment file: token accounting (ids, loss mask,
log-probs, return), the batch collection builds from trajectories, evaluation's records, the config hooks, and an
environment that hangs or crashes killed and counted."""

import pytest
import torch

from megatron_rlvr.actor.packing import sequence_lengths
from megatron_rlvr.config import Config, load_config
from megatron_rlvr.data import PromptItem
from megatron_rlvr.environments import EnvironmentConfig, Problem
from megatron_rlvr.environments.episodes import EpisodeRunner
from megatron_rlvr.environments.glue import TurnGlue
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.runner import EvalRunner
from megatron_rlvr.eval.store import load_records
from megatron_rlvr.experience.collect import assemble, generate, group_of, to_rollouts, verify
from megatron_rlvr.problems.benchmarks import Problem as BenchmarkProblem
from megatron_rlvr.rollout import Completion, RolloutConfig, Sampling
from megatron_rlvr.testing.engines import ScriptedEngineBase
from tests.support.environments.env_helpers import chat_tokenizer, write_user_environment


class TurnEngine(ScriptedEngineBase):
    """Answers "call" (then EOS, the end of turn) until the prompt holds two observations, then "42"; every sampled
    token has log-prob -0.5. Records every prompt it was given."""

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    def generate(self, prompt_token_ids, n, sampling):
        out = []
        for prompt in prompt_token_ids:
            self.prompts.append(list(prompt))
            text = "call" if self.tok.decode(prompt).count("<|im_start|>tool") < 2 else "42"
            ids = self.tok(text, add_special_tokens=False)["input_ids"][: sampling.max_tokens - 1]
            ids.append(self.tok.eos_token_id)
            out.append([Completion(ids, [-0.5] * len(ids), text, "stop") for _ in range(n)])
        return out


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    return write_user_environment(tmp_path_factory.mktemp("env"))


@pytest.fixture(scope="module")
def echo(user_env):
    """One runner (and its worker processes) for the tests that need no special settings."""
    runner, tok = _runner(user_env, max_turns=4)
    yield runner, tok
    runner.close()


def _runner(spec, **kw):
    tok = chat_tokenizer()
    cfg = EnvironmentConfig(name=f"{spec}:Echo", **kw)
    glue = TurnGlue(tok, cfg.observation_role, cfg.observation_tokens, (tok.eos_token_id,))
    return EpisodeRunner(TurnEngine(tok), cfg, glue), tok


def _item(tok, pid="p"):
    text = tok.apply_chat_template([{"role": "user", "content": "6 x 7?"}], tokenize=False, add_generation_prompt=True)
    ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
    return PromptItem(pid, text, ids, answer="42", task="echo")


def _problem(item):
    return Problem(item.id, item.prompt, item.prompt_ids, item.task, item.answer)


def test_a_three_turn_trajectory_trains_its_sampled_tokens_on_the_ids_the_engine_saw(echo):
    runner, tok = echo
    item = _item(tok)
    (group,) = runner.play([_problem(item)], 2, Sampling(max_tokens=200, seed=1))
    c = group[0]
    assert c.episode.turns == 3 and c.episode.env_return == pytest.approx(0.25 + 0.25 + 1.0) and not c.episode.failure
    assert c.finish_reason == "stop" and c.text == "42"
    eos = tok.eos_token_id
    glue = [tok(f"\n<|im_start|>tool\nobs{k}<|endoftext|>\n<|im_start|>assistant\n")["input_ids"] for k in (1, 2)]
    call, answer = tok("call")["input_ids"] + [eos], tok("42")["input_ids"] + [eos]
    assert c.token_ids == call + glue[0] + call + glue[1] + answer  # the template's own text between turns
    assert c.episode.loss_mask == [1] * len(call) + [0] * len(glue[0]) + [1] * len(call) + [0] * len(glue[1]) + [1] * 3
    assert c.logprobs == [-0.5 if m else 0.0 for m in c.episode.loss_mask]
    # each turn continued the running ids exactly: no re-tokenisation of what came before
    prompts = runner.engine.prompts
    assert prompts[-1] == list(item.prompt_ids) + c.token_ids[: -len(answer)]

    batch = to_rollouts([item], [group], torch.zeros(2), pad_id=eos)
    engine_logp = batch.engine_logp
    p = len(item.prompt_ids)
    assert batch.tokens[0, : p + len(c.token_ids)].tolist() == list(item.prompt_ids) + c.token_ids
    mask = torch.tensor(c.episode.loss_mask, dtype=torch.bool)
    assert torch.equal(batch.response_mask[0, p - 1 : p - 1 + len(mask)], mask)
    assert not batch.response_mask[0, : p - 1].any() and not batch.response_mask[0, p - 1 + len(mask) :].any()
    assert torch.equal(engine_logp[0, p - 1 : p - 1 + len(mask)], torch.tensor(c.logprobs))
    # packing plans trajectories by their last trained token: the whole trajectory, environment tokens inside it
    assert sequence_lengths(batch.response_mask)[0] == p + len(c.token_ids)


def test_collection_plays_episodes_and_logs_the_tool_call_rate(echo):
    runner, tok = echo
    item, cfg = _item(tok), Config()
    cfg.rollout = RolloutConfig(group_size=2, max_new_tokens=200)
    (group,) = generate(runner, [item], cfg.rollout, run_seed=0, step=0)  # an EpisodeEngine: play, not generate
    assert [c.episode.turns for c in group] == [3, 3]
    rewards, _ = verify(None, [item], [group])
    groups = [group_of(0, 0, item, group, rewards, cfg)]
    exp = assemble(groups, groups, cfg, pad_id=0, counters={}, rounds=0, refill=False)
    assert exp.metrics["rollout/tool_call_rate"] == 1.0 and exp.metrics["rollout/turns"] == 3.0
    assert exp.rollouts.response_mask.sum().item() == 2 * sum(group[0].episode.loss_mask)


def test_evaluation_plays_episodes_and_records_their_returns_and_turns(echo, tmp_path):
    class EmptyPool:
        def score_batch(self, tasks, responses, references):
            assert not tasks, "the environment's return is the reward; the pool is not asked"
            return [], {}

    runner, tok = echo
    item = _item(tok)
    cfg = EvalConfig(n_samples=2, chunk=2, max_new_tokens=200, benchmarks=["countdown"])
    problems = [BenchmarkProblem("countdown", "c0", item.prompt, "echo", "42")]
    run = EvalRunner(
        runner, lambda text: list(item.prompt_ids), cfg, EmptyPool(), tmp_path / "run", "m", environment="my_env"
    )
    run.run(problems)
    records = list(load_records(tmp_path / "run").values())
    assert [(r["reward"], r["turns"]) for r in records] == [(1.5, 3), (1.5, 3)]
    assert '"environment": "my_env"' in (tmp_path / "run" / "run.json").read_text()


def test_the_budget_counts_environment_tokens_and_cuts_the_trajectory(echo):
    runner, tok = echo
    (group,) = runner.play([_problem(_item(tok))], 1, Sampling(max_tokens=40, seed=1))
    (cut,) = runner.play([_problem(_item(tok))], 1, Sampling(max_tokens=200, seed=1))
    c = group[0]
    # 5 sampled + 38 glue tokens do not fit in 40 after the first turn: cut there, its return so far
    assert len(c.token_ids) <= 40 and c.episode.turns == 1 and c.finish_reason == "length"
    assert c.episode.env_return == 0.25
    assert cut[0].episode.turns == 3  # the same problem with room: three turns


def test_a_hanging_or_crashing_environment_is_killed_and_counted(user_env):
    runner, tok = _runner(user_env, workers=3, call_timeout_s=1.0)
    items = [_item(tok, pid) for pid in ("hang", "ok", "crash", "ok2")]  # "hang" and "ok2" share worker 0
    try:
        groups = runner.play([_problem(i) for i in items], 1, Sampling(max_tokens=200, seed=1))
        again = runner.play([_problem(items[1])], 1, Sampling(max_tokens=200, seed=1))  # replaced workers serve
    finally:
        runner.close()
    failures = [g[0].episode.failure for g in groups]
    assert failures == ["timeout", "", "crash", "lost"]
    assert groups[1][0].episode.env_return == 1.5 and again[0][0].episode.env_return == 1.5

    class NoPool:
        def score_batch(self, *args):
            raise AssertionError("the environment's return is the reward; the pool is not asked")

    rewards, counters = verify(NoPool(), items, groups)
    assert rewards.tolist() == [0.0, 1.5, 0.0, 0.0]
    assert counters == {"env_timeout": 1, "env_crash": 1, "env_lost": 1}


def test_environments_are_named_in_the_config(user_env, tmp_path):
    cfg = load_config(None, [f"environment.name={user_env}:Echo", "environment.max_turns=3"])
    assert cfg.environment.enabled and cfg.environment.max_turns == 3
    assert not load_config(None, []).environment.enabled
    with pytest.raises(ConfigError, match=r"environment.name: .* has no attribute 'Missing'"):
        load_config(None, [f"environment.name={user_env}:Missing"])
    with pytest.raises(ConfigError, match=r"environment.name: .* is a int, not a callable factory"):
        load_config(None, [f"environment.name={user_env}:NOT_CALLABLE"])
    with pytest.raises(ConfigError, match=r"environment.name: file .*nowhere.py not found"):
        load_config(None, [f"environment.name={tmp_path}/nowhere.py:Echo"])
    with pytest.raises(ConfigError, match=r"environment.name: expected one of \['python_tool'\]"):
        load_config(None, ["environment.name=calculator"])
    staleness = ["rollout.placement=separate", "rollout.engine_ranks=1", "rollout.max_staleness=2"]
    with pytest.raises(ConfigError, match="multi-turn trajectories are not streamed"):
        load_config(None, [f"environment.name={user_env}:Echo", *staleness]).validate()
