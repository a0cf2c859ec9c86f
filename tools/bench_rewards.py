"""Throughput of the verifiers on this machine: items/s of the math pool (and of the other tasks, for scale).

    python tools/bench_rewards.py [--items 2000] [--workers 1 2]

Math items are realistic responses (a few hundred characters of reasoning, then a final answer in one of the
extraction forms) against gold answers in varied forms, half equivalent. Prints one line per setting and the ratio
of the pool to one in-process verifier. Numbers, not assertions: the tests never time anything.
"""

from __future__ import annotations

import argparse
import random
import time

from megatron_rlvr.rewards import RewardConfig, RewardPool, score

GOLDS = ["\\frac{1}{2}", "0.75", "12", "2\\sqrt{2}", "[1,3)", "\\{1,2\\}", "x^2+1", "50\\%", "-7", "\\pi/4"]
RIGHT = ["\\boxed{0.5}", "the answer is 3/4", "\\boxed{12}", "\\boxed{\\sqrt{8}}", "\\boxed{[1, 3)}", "\\boxed{\\{2,1\\}}",
         "\\boxed{1+x^2}", "\\boxed{0.5}", "Answer: -7", "\\boxed{\\frac{\\pi}{4}}"]
WRONG = ["\\boxed{0.4}", "the answer is 2/3", "so 13", "\\boxed{\\sqrt{7}}", "\\boxed{(1, 3)}", "\\boxed{\\{1\\}}",
         "\\boxed{x^2-1}", "\\boxed{5}", "Answer: 7", "\\boxed{\\pi}"]


def make_items(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    responses, golds = [], []
    for _ in range(count):
        i = rng.randrange(len(GOLDS))
        reasoning = " ".join(rng.choice(["Let", "x", "=", "3", "then", "we", "get", "2x+1", "so"]) for _ in range(80))
        responses.append(f"{reasoning}\n{(RIGHT if rng.random() < 0.5 else WRONG)[i]}")
        golds.append(GOLDS[i])
    return responses, golds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    responses, golds = make_items(args.items)

    score("math", responses[0], golds[0])  # import sympy/math-verify outside the timed region
    start = time.perf_counter()
    base_rewards = [score("math", r, g) for r, g in zip(responses, golds)]
    base = args.items / (time.perf_counter() - start)
    print(f"math, in-process (1 thread, no pool): {base:8.1f} items/s  (accuracy of the set {sum(base_rewards) / len(base_rewards):.3f})")

    for workers in args.workers:
        with RewardPool(RewardConfig(workers=workers)) as pool:
            pool.score_batch(["math"] * workers * 4, responses[: workers * 4], golds[: workers * 4])  # warm the workers
            start = time.perf_counter()
            rewards, counters = pool.score_batch(["math"] * args.items, responses, golds)
            rate = args.items / (time.perf_counter() - start)
        assert rewards == base_rewards, "the pool disagrees with in-process scoring"
        print(f"math, RewardPool workers={workers}:       {rate:8.1f} items/s  ratio to in-process {rate / base:.2f}  counters {counters}")

    count = 20000
    refs = [{"numbers": [3, 5, 7, 7], "target": 24}] * count
    start = time.perf_counter()
    for i in range(count):
        score("countdown", "(7-5)*(7+5)" if i % 2 else "3*(7+7-5)-3", refs[i])
    print(f"countdown, in-process:                 {count / (time.perf_counter() - start):8.1f} items/s")

    reference = {"io": [{"input": "3\n", "output": "6\n"}]}
    start = time.perf_counter()
    for _ in range(20):
        score("code", "print(2 * int(input()))", reference)
    print(f"code, 1 stdin case per item, serial:   {20 / (time.perf_counter() - start):8.1f} items/s")
    reference = {"io": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(20)]}
    start = time.perf_counter()
    for _ in range(5):
        score("code", "print(2 * int(input()))", reference)
    print(f"code, 20 stdin cases per item, serial: {5 / (time.perf_counter() - start):8.1f} items/s (one sandbox per item)")


if __name__ == "__main__":
    main()
