"""A deterministic `RolloutEngine` for the eval tests, and a script that runs an eval with it in a subprocess.

Completions depend only on (sampling.seed, the prompt's position in the call, prompt ids, sample index) — never on
call order or on the prompts after it — like `VLLMEngine`, which seeds each prompt of a call by its position.
``FAKE_ENGINE_KILL_AT=N`` SIGKILLs the process at its N-th generate call (a crash mid-run);
``FAKE_ENGINE_LOG=path`` appends one line per generate call (to count what a resumed run redraws).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path

from megatron_rlvr.rollout.base import Completion, Sampling
from megatron_rlvr.testing.engines import ScriptedEngineBase


class FakeEngine(ScriptedEngineBase):
    def __init__(self, skill: float = 0.3):
        self.skill = skill  # probability of a correct-looking answer for "easy" prompts
        self.calls = 0
        self.prompts_per_call: list[int] = []

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        self.calls += 1
        self.prompts_per_call.append(len(prompt_token_ids))
        if os.environ.get("FAKE_ENGINE_KILL_AT") and self.calls >= int(os.environ["FAKE_ENGINE_KILL_AT"]):
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("FAKE_ENGINE_LOG"):
            with open(os.environ["FAKE_ENGINE_LOG"], "a") as f:
                f.write(f"{sampling.seed} {n} {len(prompt_token_ids)}\n")
        out = []
        for position, prompt in enumerate(prompt_token_ids):
            completions = []
            for i in range(n):
                rng = random.Random(f"{sampling.seed}/{position}/{prompt}/{i}")
                # math prompts: guess a digit, biased toward the prompt's own answer digit with prob. skill
                text = f"The answer is \\boxed{{{rng.randint(0, 9)}}}." if rng.random() > self.skill else "\\boxed{1}"
                if len(prompt) < 40:  # countdown prompts are short: answer with an expression
                    text = rng.choice(["1+2", "2*3", "9-1", "3*3", "(1+2)*3"]) + "\nbecause"
                tokens = [rng.randrange(100) for _ in range(rng.randint(1, 8))]
                completions.append(Completion(token_ids=tokens, logprobs=[], text=text, finish_reason="stop"))
            out.append(completions)
        return out


def encode(text: str) -> list[int]:
    return [ord(ch) % 97 for ch in text]


def main(argv: list[str]) -> int:
    """fake_engine.py DATA_DIR OUT N CHUNK [REQUEST_SAMPLES]: evaluate two fake models on math500 + countdown."""
    from megatron_rlvr.eval.api import evaluate
    from megatron_rlvr.eval.config import EvalConfig
    from megatron_rlvr.rewards.config import RewardConfig

    data_dir, out, n, chunk = argv[0], argv[1], int(argv[2]), int(argv[3])
    request_samples = int(argv[4]) if len(argv) > 4 else EvalConfig().request_samples
    cfg = EvalConfig(
        n_samples=n,
        chunk=chunk,
        benchmarks=["math500", "countdown"],
        data_dir=data_dir,
        output_dir=out,
        request_samples=request_samples,
    )
    skills = {"weak": 0.1, "strong": 0.6}
    evaluate(
        [os.path.join(out, "models", name) for name in skills],
        cfg,
        RewardConfig(workers=1),
        engine_factory=lambda model, c: FakeEngine(skills[os.path.basename(model)]),
        encoder_factory=lambda model, c: encode,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def write_data(data_dir: Path) -> None:
    """The eval tests' benchmark files: three math500 problems and two countdown ones."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        {"unique_id": f"p{i}", "problem": f"What is {i} times one, written as a single digit number?", "answer": str(i)}
        for i in (1, 2, 7)
    ]
    (data_dir / "math500.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [{"id": "c0", "numbers": [1, 2, 3], "target": 9}, {"id": "c1", "numbers": [2, 3], "target": 6}]
    (data_dir / "countdown.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
