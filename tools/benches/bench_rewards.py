"""Throughput of the verifiers on this machine: items/s of the math pool (and of the other tasks, for scale).

    python tools/benches/bench_rewards.py [--items 2000] [--workers 1 2] [--only math|code]

Math items are realistic responses (a few hundred characters of reasoning, then a final answer in one of the
extraction forms) against gold answers in varied forms, half equivalent. Prints one line per setting and the ratio
of the pool to one in-process verifier. Code items are timed per sandboxed program under each containment this
machine can apply (the one in force, then weaker ones: rlimits instead of the memory cgroup, the user namespace a
non-root user gets, no namespaces), in interleaved rounds so that load from other processes hits all alike, with
the ratio of each to the one in force.
Numbers, not assertions: the tests never time anything.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import resource
import statistics
import time

from megatron_rlvr.rewards import RewardConfig, RewardPool, sandbox, score

ACCEPT_ALL = RewardConfig(sandbox_accept_rlimits_only=True)  # the no-namespaces rounds run, as a comparison
GOLDS = ["\\frac{1}{2}", "0.75", "12", "2\\sqrt{2}", "[1,3)", "\\{1,2\\}", "x^2+1", "50\\%", "-7", "\\pi/4"]
RIGHT = [
    "\\boxed{0.5}",
    "the answer is 3/4",
    "\\boxed{12}",
    "\\boxed{\\sqrt{8}}",
    "\\boxed{[1, 3)}",
    "\\boxed{\\{2,1\\}}",
    "\\boxed{1+x^2}",
    "\\boxed{0.5}",
    "Answer: -7",
    "\\boxed{\\frac{\\pi}{4}}",
]
WRONG = [
    "\\boxed{0.4}",
    "the answer is 2/3",
    "so 13",
    "\\boxed{\\sqrt{7}}",
    "\\boxed{(1, 3)}",
    "\\boxed{\\{1\\}}",
    "\\boxed{x^2-1}",
    "\\boxed{5}",
    "Answer: 7",
    "\\boxed{\\pi}",
]


def make_items(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    responses, golds = [], []
    for _ in range(count):
        i = rng.randrange(len(GOLDS))
        reasoning = " ".join(rng.choice(["Let", "x", "=", "3", "then", "we", "get", "2x+1", "so"]) for _ in range(80))
        responses.append(f"{reasoning}\n{(RIGHT if rng.random() < 0.5 else WRONG)[i]}")
        golds.append(GOLDS[i])
    return responses, golds


def _containment(mode: str):
    """Run the sandbox as it is ("in force"), or with one part of its containment taken away, for comparison."""
    return {
        "in force": contextlib.nullcontext(),
        "rlimits": sandbox.use_containment(memory="rlimits"),
        "user-namespaces": sandbox.use_containment("user-namespaces"),
        "no-namespaces": sandbox.use_containment("none", memory="rlimits"),
    }[mode]


def _cpu_s() -> float:
    """CPU seconds of this process and of every process it waited for (the sandboxes: launcher, init, program)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench_code(rounds: int, per_round: int) -> None:
    """Wall and CPU per code item; CPU (user + sys, kernel work of the mounts and cgroups included) is the figure
    that holds on a loaded machine, where wall time mostly measures the other processes."""
    info = sandbox.sandbox_info()
    print(info.describe(sandbox.SandboxLimits()))
    modes = ["in force"]
    if info.memory == "cgroup":
        modes.append("rlimits")
    if info.isolation == "namespaces":  # root: what a non-root user gets instead, and nothing
        modes.append("user-namespaces")
    if info.isolated:
        modes.append("no-namespaces")
    for cases in (1, 20):
        reference = {"io": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(cases)]}
        wall: dict[str, list[float]] = {mode: [] for mode in modes}
        cpu: dict[str, list[float]] = {mode: [] for mode in modes}
        for round_ in range(rounds + 1):  # round 0 warms the caches and is not counted
            for mode in modes:
                with _containment(mode):
                    cpu0, start = _cpu_s(), time.perf_counter()
                    for _ in range(per_round):
                        assert score("code", "print(2 * int(input()))", reference, ACCEPT_ALL) == 1.0
                    if round_:
                        wall[mode].append((time.perf_counter() - start) / per_round * 1000)
                        cpu[mode].append((_cpu_s() - cpu0) / per_round * 1000)
        base_wall, base_cpu = statistics.median(wall[modes[0]]), statistics.median(cpu[modes[0]])
        for mode in modes:
            w, c = statistics.median(wall[mode]), statistics.median(cpu[mode])
            print(
                f"code, {cases:2d} stdin case(s) per item, {mode:15s}: wall {w:7.1f} ms, CPU {c:6.1f} ms per item "
                f"(medians of {rounds} rounds of {per_round}); ratio to in force: wall {w / base_wall:.2f}, "
                f"CPU {c / base_cpu:.2f}"
            )


def bench_math(args: argparse.Namespace) -> None:
    responses, golds = make_items(args.items)
    score("math", responses[0], golds[0])  # import sympy/math-verify outside the timed region
    start = time.perf_counter()
    base_rewards = [score("math", r, g) for r, g in zip(responses, golds)]
    base = args.items / (time.perf_counter() - start)
    print(
        f"math, in-process (1 thread, no pool): {base:8.1f} items/s  (accuracy of the set {sum(base_rewards) / len(base_rewards):.3f})"
    )

    for workers in args.workers:
        with RewardPool(RewardConfig(workers=workers)) as pool:
            pool.score_batch(["math"] * workers * 4, responses[: workers * 4], golds[: workers * 4])  # warm the workers
            start = time.perf_counter()
            rewards, counters = pool.score_batch(["math"] * args.items, responses, golds)
            rate = args.items / (time.perf_counter() - start)
        assert rewards == base_rewards, "the pool disagrees with in-process scoring"
        print(
            f"math, RewardPool workers={workers}:       {rate:8.1f} items/s  ratio to in-process {rate / base:.2f}  counters {counters}"
        )

    count = 20000
    refs = [{"numbers": [3, 5, 7, 7], "target": 24}] * count
    start = time.perf_counter()
    for i in range(count):
        score("countdown", "(7-5)*(7+5)" if i % 2 else "3*(7+7-5)-3", refs[i])
    print(f"countdown, in-process:                 {count / (time.perf_counter() - start):8.1f} items/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--only", choices=["math", "code"], default=None)
    parser.add_argument("--code-rounds", type=int, default=5)
    parser.add_argument("--code-per-round", type=int, default=4)
    args = parser.parse_args()
    if args.only != "code":
        bench_math(args)
    if args.only != "math":
        bench_code(args.code_rounds, args.code_per_round)


if __name__ == "__main__":
    main()
