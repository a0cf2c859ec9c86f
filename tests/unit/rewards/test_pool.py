"""RewardPool: every item gets a reward in order; timeouts, crashes and errors are counted, never stall or drop."""

import pytest

from megatron_rlvr.errors import ConfigError
from megatron_rlvr.rewards import RewardConfig, RewardPool, score
from tests.unit.rewards import pool_helpers


@pytest.fixture(scope="module")
def pool():
    extra = {"hang": pool_helpers.hang, "die": pool_helpers.die, "boom": pool_helpers.boom, "echo": pool_helpers.echo}
    with RewardPool(RewardConfig(workers=2, timeout_s=4.0), extra_scorers=extra) as p:
        yield p


def test_mixed_batch_keeps_order_and_counts_failures(pool):
    tasks = ["math", "hang", "die", "boom", "echo", "countdown", "logic", "math", "echo"]
    responses = ["\\boxed{2}", "", "", "", "a", "1+1", "So the answer is (B).", "\\boxed{3}", "b"]
    references = ["2", None, None, None, "a", {"numbers": [1, 1], "target": 2}, "(B)", "2", "a"]
    rewards, counters = pool.score_batch(tasks, responses, references)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert counters == {
        "items": 9,
        "timeouts": 1,
        "crashes": 1,
        "errors": 1,
        "verifier/math": 2,
        "verifier/extra:hang": 1,
        "verifier/extra:die": 1,
        "verifier/extra:boom": 1,
        "verifier/extra:echo": 2,
        "verifier/countdown": 1,
        "verifier/logic": 1,
    }
    assert any("verifier bug" in e for e in pool.last_errors)
    # the replaced workers serve the next batch
    rewards, counters = pool.score_batch(["math"] * 3, ["\\boxed{1}", "\\boxed{2}", "x"], ["1", "2", "3"])
    assert rewards == [1.0, 1.0, 0.0] and counters["timeouts"] == counters["crashes"] == 0


def test_pool_agrees_with_in_process_score(pool):
    cases = [
        ("math", "\\boxed{\\frac{1}{2}}", "0.5"),
        ("logic", "the answer is True", "False"),
        ("countdown", "3*8", {"numbers": [3, 8], "target": 24}),
        ("math", "answer is 7", "7"),
    ]
    rewards, _ = pool.score_batch(*zip(*cases))
    assert rewards == [score(*case) for case in cases] == [1.0, 0.0, 1.0, 1.0]


def test_bad_input_is_a_clear_error(pool):
    with pytest.raises(ValueError, match="item 1: countdown reference"):
        pool.score_batch(["math", "countdown"], ["1", "1"], ["1", {"numbers": [1]}])
    with pytest.raises(ValueError, match="unknown"):
        pool.score_batch(["poetry"], ["x"], ["y"])
    with pytest.raises(ValueError, match="differ in length"):
        pool.score_batch(["math"], ["1", "2"], ["1"])


def test_a_refused_sandbox_stops_the_pool_instead_of_scoring_0():
    from megatron_rlvr.rewards.sandbox import SandboxUnavailableError

    p = RewardPool(RewardConfig(workers=1), extra_scorers={"refuse": pool_helpers.refuse})
    with pytest.raises(SandboxUnavailableError, match="no isolation can be had here"):
        p.score_batch(["countdown", "refuse"], ["1+1", "x"], [{"numbers": [1, 1], "target": 2}, None])
    with pytest.raises(RuntimeError, match="closed"):
        p.score_batch(["countdown"], ["1+1"], [{"numbers": [1, 1], "target": 2}])


def test_closed_pool_refuses_work():
    p = RewardPool(RewardConfig(workers=1))
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.score_batch(["math"], ["1"], ["1"])


def test_workers_that_cannot_start_are_an_error_not_a_respawn_loop():
    # 16 MB of address space is too little to import sympy: every worker dies while starting
    p = RewardPool(RewardConfig(workers=1, worker_memory_mb=16))
    with pytest.raises(RuntimeError, match="died while starting"):
        p.score_batch(["math"], ["\\boxed{1}"], ["1"])
    p.close()


def test_the_pool_refuses_workers_whose_sandbox_budgets_do_not_fit_in_memory():
    # checked before any worker starts: 4 programs of 1 TB each cannot all hold their budgets on any machine here
    with pytest.raises(ConfigError, match=r"reward\.workers \(4\).*reward\.code_memory_mb.*available memory"):
        RewardPool(RewardConfig(workers=4, code_memory_mb=1 << 20))
    with pytest.raises(ValueError, match="reward.code_tmpfs_mb"):
        RewardPool(RewardConfig(workers=1, code_tmpfs_mb=0))
