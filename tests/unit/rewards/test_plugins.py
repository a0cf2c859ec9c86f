"""Verifier plugins from the config (reward.plugins): a module's and a file's function score in the pool's workers
with the pool's guarantees (a hang is killed at the timeout, an abort is a counted crash, an exception is reward 0
with its message logged), and each bad spec is a one-line error naming its key when the config loads."""

import logging
import time

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.rewards import RewardPool

HELPERS = "tests.unit.rewards.plugin_helpers"
FILE_PLUGIN = '''
def at_most(response, reference):
    """1.0 when the response holds at most `reference` characters."""
    return 1.0 if len(response) <= int(reference) else 0.0
'''


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugins") / "length_plugin.py"
    path.write_text(FILE_PLUGIN)
    return path


@pytest.fixture(scope="module")
def pool(plugin_file):
    overrides = [
        f"reward.plugins.word={HELPERS}:exact_word",
        f"reward.plugins.short={plugin_file}:at_most",
        f"reward.plugins.hang={HELPERS}:hang",
        f"reward.plugins.abort={HELPERS}:abort",
        f"reward.plugins.raises={HELPERS}:raises",
        f"reward.plugins.range={HELPERS}:out_of_range",
        "reward.workers=2",
        "reward.timeout_s=3",
    ]
    cfg = load_config(None, overrides)
    with RewardPool(cfg.reward) as p:
        yield p


def test_a_module_plugin_and_a_file_plugin_score_a_batch(pool):
    tasks = ["word", "short", "word", "short", "math", "word"]
    responses = ["so it is Blue", "abc", "so it is red", "abcdef", "\\boxed{4}", ""]
    references = ["blue", 3, "blue", 3, "4", "blue"]
    rewards, counters = pool.score_batch(tasks, responses, references)
    assert rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert counters["verifier/plugin:word"] == 3 and counters["verifier/plugin:short"] == 2
    assert counters["errors"] == counters["timeouts"] == counters["crashes"] == 0


def test_a_hanging_plugin_is_killed_at_the_timeout_and_counted(pool):
    pids = {w.process.pid for w in pool._workers}
    start = time.monotonic()
    rewards, counters = pool.score_batch(["hang", "word"], ["x", "yes"], [None, "yes"])
    elapsed = time.monotonic() - start
    assert rewards == [0.0, 1.0] and counters["timeouts"] == 1
    assert 3.0 <= elapsed < 30.0, elapsed  # killed at reward.timeout_s (3 s), not left to sleep its hour
    assert len({w.process.pid for w in pool._workers} - pids) == 1  # that worker was replaced
    assert pool.score_batch(["word"], ["yes"], ["yes"])[0] == [1.0]


def test_an_aborting_plugin_is_a_counted_crash_and_the_pool_goes_on(pool):
    rewards, counters = pool.score_batch(
        ["abort", "word", "abort", "short"], ["x", "yes", "y", "ab"], [None, "yes", None, 5]
    )
    assert rewards == [0.0, 1.0, 0.0, 1.0] and counters["crashes"] == 2 and counters["errors"] == 0
    rewards, counters = pool.score_batch(["word"] * 3, ["a", "b", "c"], ["a", "x", "c"])
    assert rewards == [1.0, 0.0, 1.0] and counters["crashes"] == 0


def test_a_raising_plugin_scores_0_with_its_message_in_the_log(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_rlvr.rewards.pool"):
        rewards, counters = pool.score_batch(["raises", "range", "word"], ["oops", "x", "w"], [None, None, "w"])
    assert rewards == [0.0, 0.0, 1.0] and counters["errors"] == 2
    logged = caplog.text
    assert "KeyError" in logged and "plugin bug on 'oops'" in logged
    assert "reward.plugins.range returned 2.0; expected a float in [0, 1]" in logged


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_package.verifiers:score", r"reward\.plugins\.mine: no module named 'no_such_package'"),
        (f"{HELPERS}:missing", rf"reward\.plugins\.mine: {HELPERS} has no attribute 'missing'"),
        (f"{HELPERS}:NOT_A_FUNCTION", r"reward\.plugins\.mine: .*NOT_A_FUNCTION is a int, not a function"),
        (
            f"{HELPERS}:one_argument",
            r"reward\.plugins\.mine: .*one_argument\(response\) cannot be called as "
            r"fn\(response, reference\)",
        ),
        ("plugins/absent.py:score", r"reward\.plugins\.mine: file plugins/absent\.py not found"),
        (
            "just_a_name",
            r"reward\.plugins\.mine: expected 'package\.module:function' or 'FILE\.py:function' \(a path\)",
        ),
    ],
)
def test_each_bad_spec_is_a_one_line_error_naming_the_key(spec, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [f"reward.plugins.mine={spec}"])
    assert "\n" not in str(info.value)


def test_a_file_that_fails_to_import_and_a_taken_task_name_are_errors_naming_the_key(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_dependency\n")
    with pytest.raises(
        ConfigError,
        match=r"reward\.plugins\.mine: importing .*broken\.py failed: "
        r"ModuleNotFoundError: No module named 'no_such_dependency'",
    ):
        load_config(None, [f"reward.plugins.mine={broken}:score"])
    with pytest.raises(ConfigError, match=r"reward\.plugins\.math: 'math' is a built-in verifier's task"):
        load_config(None, [f"reward.plugins.math={HELPERS}:exact_word"])
    with pytest.raises(ConfigError, match=r"reward\.plugins\.reasoning_gym:leg_counting: .*reasoning-gym"):
        load_config(None, [f"reward.plugins.reasoning_gym:leg_counting={HELPERS}:exact_word"])


def test_the_docs_worked_example(tmp_path, monkeypatch):
    """docs/rewards.md's plugin, its row and its config, as written there."""
    import json
    import re
    from pathlib import Path

    from megatron_rlvr.rewards.verifiers import VerifierTable

    doc = (Path(__file__).resolve().parents[3] / "docs" / "rewards.md").read_text()
    section = doc[doc.index("### A worked example") :]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    row = json.loads(re.search(r"```json\n(.*?)```", section, re.DOTALL).group(1))
    (tmp_path / "my_verifiers.py").write_text(code)
    monkeypatch.chdir(tmp_path)  # the docs' spec is relative to the working directory
    cfg = load_config(None, ["reward.plugins.unordered_list=my_verifiers.py:same_items"])
    table = VerifierTable(cfg.reward)
    route = table.route(row["task"], row["answer"])
    assert route == "plugin:unordered_list" and not table.in_process(route)
    responses = ["<answer>Blue, red, green</answer>", "<answer>red, green</answer>", "Blue, red, green"]
    assert [table.score(route, row["task"], r, row["answer"]) for r in responses] == [1.0, 0.0, 0.0]
    assert table.score("logic", "logic", responses[0], row["answer"]) == 0.0  # the string matcher's verdict
