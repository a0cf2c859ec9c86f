"""Agreement of our countdown verifier with reasoning-gym's countdown scorer, both through the project's own path.

    python tools/benches/countdown_agreement.py [--problems 300] [--seed 0] [--workers 2]

The problems are reasoning-gym's countdown entries as `megatron-rlvr data prepare reasoning-gym --tasks countdown`
writes them (its default config: 4 to 6 numbers of 1..100, targets 100..999). Each gets 5 answers: the gold
expression and four corruptions (the first number literal + 1; the first operator swapped, + with - and * with /;
" + 1" appended; "= <target>" appended). Every answer is scored twice by one RewardPool: as task
``reasoning_gym:countdown`` with the row's reference (score_answer in the workers) and as task ``countdown`` with
``{"numbers", "target"}`` from the row's metadata (our demo verifier). Correct means a reward of 1.0 (as pass@k
counts; reasoning-gym's 0.01 and 0.05 partial credits are not correct). Prints the agreement by answer kind, the
disagreements grouped by cause, a few examples, and one JSON line. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

KINDS = ("gold", "number+1", "operator", "plus one", "= target")
_SWAP = {"+": "-", "-": "+", "*": "/", "/": "*"}


def corruptions(gold: str, target: int) -> list[str]:
    """The four wrong answers of one gold expression (see the module docstring)."""
    number = re.search(r"\d+", gold)
    bumped = gold[: number.start()] + str(int(number.group()) + 1) + gold[number.end() :] if number else gold + "1"
    operator = re.search(r"(?<=[\d)\s])[-+*/]", gold)  # a binary operator: after a digit, ")" or a space
    swapped = gold[: operator.start()] + _SWAP[operator.group()] + gold[operator.end() :] if operator else gold + "*2"
    return [bumped, swapped, f"{gold} + 1", f"{gold} = {target}"]


def cause(answer: str, ours: bool, theirs: bool) -> str:
    if re.match(r"^\s*-", answer) or re.search(r"[(*/+-]\s*-", answer):
        return "unary minus"
    if ours and not theirs:
        return "accepted by ours only"
    return "accepted by reasoning-gym only"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)

    from megatron_rlvr.data.prepare import main as data_main
    from megatron_rlvr.rewards import RewardConfig, RewardPool

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "countdown.jsonl"
        data_main(
            [
                "prepare",
                "reasoning-gym",
                "--tasks",
                "countdown",
                "--size",
                str(args.problems),
                "--seed",
                str(args.seed),
                "--out",
                str(out),
            ]
        )
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    answers, kinds, gym_refs, our_refs = [], [], [], []
    for row in rows:
        reference, meta = row["answer"], row["answer"]["metadata"]
        for kind, answer in zip(KINDS, [reference["answer"], *corruptions(reference["answer"], meta["target"])]):
            answers.append(answer)
            kinds.append(kind)
            gym_refs.append(reference)
            our_refs.append({"numbers": list(meta["numbers"]), "target": int(meta["target"])})
    n = len(answers)
    with RewardPool(RewardConfig(workers=args.workers)) as pool:
        theirs, gym_counters = pool.score_batch(["reasoning_gym:countdown"] * n, answers, gym_refs)
        ours, our_counters = pool.score_batch(["countdown"] * n, answers, our_refs)
    failures = {k: gym_counters[k] + our_counters[k] for k in ("timeouts", "crashes", "errors")}
    agree = Counter()
    disagreements: list[tuple[str, str, float, float]] = []
    for answer, kind, a, b in zip(answers, kinds, ours, theirs):
        if (a >= 1.0) == (b >= 1.0):
            agree[kind] += 1
        else:
            disagreements.append((kind, answer, a, b))
    per_kind = Counter(kinds)
    print(f"{len(rows)} reasoning-gym countdown problems (seed {args.seed}), {n} answers, scored through RewardPool")
    for kind in KINDS:
        print(f"  {kind:10s} agree {agree[kind]:5d} of {per_kind[kind]:5d}")
    total = sum(agree.values())
    print(f"  all        agree {total:5d} of {n:5d} ({100 * total / n:.2f}%); pool failures {failures}")
    causes = Counter(cause(answer, a >= 1, b >= 1) for _, answer, a, b in disagreements)
    print(f"disagreements by cause: {dict(causes)}")
    for kind, answer, a, b in disagreements[:5]:
        print(f"  {kind}: {answer!r}: ours {a:g}, reasoning-gym {b:g}")
    print(
        json.dumps(
            {
                "problems": len(rows),
                "seed": args.seed,
                "answers": n,
                "agree": total,
                "disagree": len(disagreements),
                "by_kind": {k: [agree[k], per_kind[k]] for k in KINDS},
                "causes": dict(causes),
                "pool_failures": failures,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
