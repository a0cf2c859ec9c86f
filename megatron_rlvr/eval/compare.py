"""`megatron-rlvr eval compare RUN_A RUN_B`: is model B's pass@k different from model A's on the same problems?

    megatron-rlvr eval compare outputs/eval/base outputs/eval/trained [--out DIR] [--resamples 2000] [--interval-seed 0]

RUN_A and RUN_B are eval run directories (``<eval --out>/<model tag>``) or their ``results.json``. Per benchmark and
k: both pass@k with their intervals and the difference B - A with a paired bootstrap interval (the same resampled
problems for both). Per benchmark: the problems one model solved at least once in its n samples and the other did
not, with an exact two-sided sign test on those discordant problems. Writes compare.md, compare.json and one
compare_<benchmark>.png (both curves with bands over the difference with its band, log-k axis) into ``--out``.

The runs must share the problems (ids, and texts where both files record a digest), n, and the sampling settings
(`SAMPLING_FIELDS`); otherwise a one-line `CompareMismatch` names the first field that differs. The eval seed may
differ: it changes which samples were drawn, not what they estimate.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.band_plot import plot_bands
from megatron_rlvr.eval.bootstrap import Interval, IntervalSpec, bootstrap_pass_at_k, paired_difference, sign_test
from megatron_rlvr.eval.report import k_values
from megatron_rlvr.eval.results import BenchmarkCounts, RunCounts, load_run

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "max_new_tokens",
    "stop",
    "chat_template",
    "system_prompt",
    "prompt_format",
    "answer",
)
DISCORDANT_LISTED = 20  # problem ids listed per side in compare.md (compare.json holds them all)


class CompareMismatch(UserError, ValueError):
    """The two runs did not sample the same problems the same way: a paired comparison would mean nothing."""


def _preview(ids: Sequence[str]) -> str:
    shown = ", ".join(repr(i) for i in list(ids)[:3])
    return shown + (", ..." if len(ids) > 3 else "")


def check_comparable(a: RunCounts, b: RunCounts) -> None:
    """Raise CompareMismatch naming the first field in which the runs differ."""
    where = f"eval compare {a.source} {b.source}"
    for key in SAMPLING_FIELDS:
        if a.settings.get(key) != b.settings.get(key):
            raise CompareMismatch(
                f"{where}: the runs differ in {key} (A: {a.settings.get(key)!r}, B: "
                f"{b.settings.get(key)!r}); compare runs sampled with the same settings"
            )
    if set(a.benchmarks) != set(b.benchmarks):
        raise CompareMismatch(
            f"{where}: the runs differ in benchmarks (A: {sorted(a.benchmarks)}, B: {sorted(b.benchmarks)})"
        )
    for bench in a.benchmarks:
        ca, cb = a.benchmarks[bench], b.benchmarks[bench]
        only_a = [p for p in ca.problem_ids if p not in set(cb.problem_ids)]
        only_b = [p for p in cb.problem_ids if p not in set(ca.problem_ids)]
        if only_a or only_b:
            sides = [
                f"{len(ids)} only in {side}: {_preview(ids)}" for side, ids in (("A", only_a), ("B", only_b)) if ids
            ]
            raise CompareMismatch(
                f"{where}: the runs differ in problems of {bench} ({'; '.join(sides)}); compare runs over the same "
                "problems: the same benchmark files and --limit"
            )
        if ca.digest and cb.digest and ca.digest != cb.digest:
            raise CompareMismatch(
                f"{where}: the runs differ in problems of {bench}: the same ids with other prompt "
                "texts or references (digest)"
            )
        na, nb = ca.samples_per_problem(f"{a.source} ({bench})"), cb.samples_per_problem(f"{b.source} ({bench})")
        if na != nb:
            raise CompareMismatch(
                f"{where}: the runs differ in n on {bench} (A: {na} samples per problem, B: {nb}); "
                f"rerun the smaller with --n {max(na, nb)}"
            )


def _aligned(ca: BenchmarkCounts, cb: BenchmarkCounts) -> tuple[np.ndarray, np.ndarray]:
    """B's (n, c) in A's problem order."""
    index = {pid: i for i, pid in enumerate(cb.problem_ids)}
    order = np.array([index[pid] for pid in ca.problem_ids], dtype=np.int64)
    return cb.n[order], cb.c[order]


def compare_runs(a: RunCounts, b: RunCounts, spec: IntervalSpec = IntervalSpec()) -> dict[str, Any]:
    """Per benchmark: ks, both curves with intervals, the paired difference, the discordant problems, the sign test."""
    check_comparable(a, b)
    out: dict[str, Any] = {}
    for bench, ca in a.benchmarks.items():
        cb = b.benchmarks[bench]
        ks = k_values(ca.samples_per_problem(str(a.source)))
        nb, cbc = _aligned(ca, cb)
        solved_a, solved_b = ca.c > 0, cbc > 0
        a_only = [pid for pid, x, y in zip(ca.problem_ids, solved_a, solved_b) if x and not y]
        b_only = [pid for pid, x, y in zip(ca.problem_ids, solved_a, solved_b) if y and not x]
        out[bench] = {
            "ks": ks,
            "problems": len(ca.problem_ids),
            "n": int(ca.n[0]),
            "a": bootstrap_pass_at_k(ca.n, ca.c, ks, spec, stream=bench),
            "b": bootstrap_pass_at_k(cb.n, cb.c, ks, spec, stream=bench),
            "difference": paired_difference(ca.n, ca.c, nb, cbc, ks, spec, stream=bench),
            "solved_both": int(np.sum(solved_a & solved_b)),
            "solved_neither": int(np.sum(~solved_a & ~solved_b)),
            "a_only": a_only,
            "b_only": b_only,
            "sign_test_p": sign_test(len(a_only), len(b_only)),
        }
    return out


def _pct(iv: Interval, signed: bool = False) -> str:
    fmt = "+.1f" if signed else ".1f"
    return f"{100 * iv.estimate:{fmt}} [{100 * iv.low:{fmt}}, {100 * iv.high:{fmt}}]"


def markdown(
    result: dict[str, Any],
    a: RunCounts,
    b: RunCounts,
    spec: IntervalSpec,
    pngs: Sequence[Path] = (),
    labels: tuple[str, str] = ("A", "B"),
) -> str:
    level = f"{100 * spec.level:g}%"
    lines = [f"A ({labels[0]}): `{a.source}` ({a.model})", f"B ({labels[1]}): `{b.source}` ({b.model})", ""]
    if a.settings.get("seed") != b.settings.get("seed"):
        lines += [
            f"The eval seeds differ (A {a.settings.get('seed')}, B {b.settings.get('seed')}): other draws of the "
            "same sampling distribution; the comparison holds.",
            "",
        ]
    lines += [
        f"| benchmark | k | A pass@k [{level}] | B pass@k [{level}] | B - A [{level}, paired] | separated |",
        "|---|---|---|---|---|---|",
    ]
    for bench, r in result.items():
        for k in r["ks"]:
            d = r["difference"][k]
            separated = "yes" if d.low > 0 or d.high < 0 else "no"
            lines.append(f"| {bench} | {k} | {_pct(r['a'][k])} | {_pct(r['b'][k])} | {_pct(d, True)} | {separated} |")
    lines += [
        "",
        "pass@k in percent (unbiased estimator averaged over problems) with percentile-bootstrap intervals "
        f"over problems ({spec.resamples} resamples, seed {spec.seed}); the difference resamples the same "
        "problems for both runs. separated: its interval excludes 0.",
        "",
        "| benchmark | problems | n | solved by both | A only | B only | neither | sign test p (two-sided, exact) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for bench, r in result.items():
        lines.append(
            f"| {bench} | {r['problems']} | {r['n']} | {r['solved_both']} | {len(r['a_only'])} | "
            f"{len(r['b_only'])} | {r['solved_neither']} | {r['sign_test_p']:.3g} |"
        )
    lines += [
        "",
        "solved: at least one correct sample of n. The sign test asks whether the discordant problems "
        "(solved by one run only) split unevenly beyond chance.",
    ]
    for bench, r in result.items():
        for side in ("a_only", "b_only"):
            ids = r[side]
            if ids:
                more = f" and {len(ids) - DISCORDANT_LISTED} more" if len(ids) > DISCORDANT_LISTED else ""
                lines.append(
                    f"- {bench}, solved by {side[0].upper()} only: "
                    + ", ".join(f"`{i}`" for i in ids[:DISCORDANT_LISTED])
                    + more
                )
    if pngs:
        lines += [""] + [f"![{p.stem}]({p.name})" for p in pngs]
    return "\n".join(lines) + "\n"


def to_json(result: dict[str, Any], a: RunCounts, b: RunCounts, spec: IntervalSpec) -> dict[str, Any]:
    def curve(ivs: dict[int, Interval]) -> dict[str, dict]:
        return {str(k): iv.to_json() for k, iv in ivs.items()}

    return {
        "a": {"source": str(a.source), "model": a.model},
        "b": {"source": str(b.source), "model": b.model},
        "intervals": spec.to_json(),
        "benchmarks": {
            bench: {
                **{k: v for k, v in r.items() if k not in ("a", "b", "difference")},
                "a": curve(r["a"]),
                "b": curve(r["b"]),
                "difference": curve(r["difference"]),
            }
            for bench, r in result.items()
        },
    }


def write_comparison(
    a: RunCounts,
    b: RunCounts,
    out_dir: str | Path,
    spec: IntervalSpec = IntervalSpec(),
    labels: tuple[str, str] = ("A", "B"),
) -> tuple[str, list[Path]]:
    """compare.md, compare.json and the PNGs in ``out_dir``; returns (the markdown, the files written)."""
    result = compare_runs(a, b, spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for bench, r in result.items():
        pngs.append(
            plot_bands(
                {labels[0]: r["a"], labels[1]: r["b"]},
                out / f"compare_{bench.replace('/', '_')}.png",
                f"{bench}: {labels[1]} vs {labels[0]}",
                spec.level,
                difference=r["difference"],
                difference_label=f"{labels[1]} - {labels[0]}",
            )
        )
    text = markdown(result, a, b, spec, pngs, labels)
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps(to_json(result, a, b, spec), indent=1) + "\n")
    return text, [out / "compare.md", out / "compare.json", *pngs]


def _label(run: RunCounts) -> str:
    return Path(run.model).name or run.source.name


def main(argv: list[str] | None = None) -> int:
    from megatron_rlvr.runtime.console import report_user_error

    parser = argparse.ArgumentParser(prog="megatron-rlvr eval compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run_a", metavar="RUN_A", help="eval run directory (<eval --out>/<model tag>) or its results.json"
    )
    parser.add_argument("run_b", metavar="RUN_B", help="the other run, on the same problems, n and sampling settings")
    parser.add_argument("--out", help="output directory (default: compare-<A>-vs-<B> beside RUN_A)")
    parser.add_argument("--labels", nargs=2, metavar=("A", "B"), help="names of the runs in the table's plot")
    parser.add_argument("--resamples", type=int, default=IntervalSpec().resamples, help="bootstrap resamples")
    parser.add_argument("--level", type=float, default=IntervalSpec().level, help="confidence level of the intervals")
    parser.add_argument(
        "--interval-seed", type=int, default=IntervalSpec().seed, help="bootstrap seed (same seed, same intervals)"
    )
    args = parser.parse_args(argv)
    try:
        spec = IntervalSpec(args.resamples, args.level, args.interval_seed)
        a, b = load_run(args.run_a), load_run(args.run_b)
        labels = tuple(args.labels) if args.labels else (_label(a), _label(b))
        if labels[0] == labels[1]:
            labels = ("A: " + labels[0], "B: " + labels[1])
        dir_a, dir_b = (Path(p).parent if Path(p).is_file() else Path(p) for p in (args.run_a, args.run_b))
        out = Path(args.out) if args.out else dir_a.parent / f"compare-{dir_a.name}-vs-{dir_b.name}"
        text, written = write_comparison(a, b, out, spec, labels)
    except UserError as exc:
        return report_user_error(exc)
    print(text, end="")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
