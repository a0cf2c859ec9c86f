"""`megatron-rlvr data prepare NAME --src PATH --out FILE.jsonl`: a training set from a public release as downloaded.

    megatron-rlvr data prepare math --src MATH --levels 3-5 --out /data/math_l3to5/train.jsonl
    megatron-rlvr data prepare gsm8k --src gsm8k --add math --add-src MATH --levels 1 --out /data/gsm8k_math_l1/train.jsonl
    megatron-rlvr data prepare dapo-math-17k --src DAPO-Math-17k --out /data/dapo/train.jsonl --check-against data
    megatron-rlvr data prepare synlogic --src SynLogic --out /data/synlogic/train.jsonl
    megatron-rlvr data prepare deepcoder --src DeepCoder-Preview-Dataset/lcbv5 --out /data/deepcoder/train.jsonl
    megatron-rlvr data prepare reasoning-gym --tasks leg_counting,countdown --size 1000 --seed 1 --out /data/rg/train.jsonl
    megatron-rlvr data prepare countdown --out data/countdown.jsonl [--split eval] [--count N]   (data/countdown_split.py)

Output rows are what `data/` reads: ``{"id", "problem", "answer", "task", "source"}`` (``problem`` carries the
answer-format instruction the eval uses, unless --no-instruction). Records that cannot be used (no answer, a level
not asked for, a test format the verifiers cannot run) are counted by reason and skipped, or with --strict stop the
command with an error naming the row. A problem whose normalized text repeats is kept once. --check-against DIR
reports training problems found in the eval benchmarks under DIR (the eval's --data-dir); --drop-overlap drops them.

reasoning-gym is generated, not read (no --src): --size rows of each of --tasks from --seed (--config NAME.KEY=VALUE
sets a field of a task's config), scored by each task's own score_answer (see data/releases/reasoning_gym.py).
A small task space repeats questions across seeds: --disjoint-from FILE drops the rows whose question is one of a
prepared file's (the held-out set), by exact text.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlvr.data.releases import RELEASE_NAMES, Options, Release, Skip, content_id, get_release, normalize
from megatron_rlvr.data.releases.files import read_records, release_files
from megatron_rlvr.data.sources import DataError

REASONING_GYM = "reasoning-gym"


@dataclass
class Report:
    read: int = 0
    kept: int = 0
    duplicates: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    first_skipped: dict[str, str] = field(default_factory=dict)  # reason -> "where"
    overlap: list[tuple[str, str]] = field(default_factory=list)  # (row id, benchmark problem)
    dropped: int = 0


def parse_levels(text: str) -> frozenset[int]:
    """ "3-5" -> {3, 4, 5}; "1" -> {1}; "1,3" -> {1, 3}."""
    levels: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            levels.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise DataError(f"--levels {text!r}: expected a level or a range of MATH levels, e.g. 3-5 or 1") from None
    if not levels or not levels <= set(range(1, 6)):
        raise DataError(f"--levels {text!r}: MATH levels are 1 to 5")
    return frozenset(levels)


def convert_release(
    release: Release, src: str, split: str, options: Options, strict: bool, report: Report, seen: set[str]
) -> list[dict]:
    rows = []
    for path in release_files(src, split):
        for where, record in read_records(path):
            report.read += 1
            try:
                prepared = release.convert(record, options)
            except Skip as e:
                if strict:
                    raise DataError(
                        f"{where}: {release.name} row skipped: {e} (expected layout: {release.layout})"
                    ) from None
                report.skipped[str(e)] += 1
                report.first_skipped.setdefault(str(e), where)
                continue
            key = normalize(prepared.problem)
            if key in seen:
                report.duplicates += 1
                continue
            seen.add(key)
            rows.append(
                {
                    "id": f"{release.name}-{prepared.id}"
                    if prepared.id
                    else content_id(release.name, prepared.problem),
                    "problem": prepared.prompt or prepared.problem,
                    "answer": prepared.answer,
                    "task": prepared.task,
                    "source": release.name,
                    "_text": prepared.problem,
                }
            )
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rlvr data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser(
        "prepare",
        help="a training set from a public release",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", choices=RELEASE_NAMES + (REASONING_GYM,), help="the release")
    p.add_argument("--src", default=None, help="the release as downloaded: its directory or one data file")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--split", default="train", help="which files of the release (default: train)")
    p.add_argument("--levels", default=None, help="MATH levels to keep, e.g. 3-5 or 1 (math, and --add math)")
    p.add_argument("--add", choices=RELEASE_NAMES, default=None, help="a second release to append (gsm8k: --add math)")
    p.add_argument("--add-src", default=None, help="the --add release's directory or file")
    p.add_argument("--check-against", default=None, metavar="DIR", help="the eval's --data-dir: report overlap")
    p.add_argument("--drop-overlap", action="store_true", help="with --check-against: drop the overlapping problems")
    p.add_argument("--strict", action="store_true", help="stop at the first unusable row instead of skipping it")
    p.add_argument("--no-instruction", action="store_true", help="keep the problem text as released")
    g = p.add_argument_group("reasoning-gym (generated: no --src)")
    g.add_argument("--tasks", default=None, help="reasoning-gym dataset names, comma-separated")
    g.add_argument("--size", type=int, default=None, help="rows per task")
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the generators' seed (the same seed, the same rows; most "
        "tasks draw entry i from seed + i, so sets meant to be disjoint need seeds --size apart)",
    )
    g.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="a field of task NAME's reasoning-gym config (repeatable)",
    )
    g.add_argument(
        "--disjoint-from",
        action="append",
        default=[],
        metavar="FILE",
        help="a prepared reasoning-gym file (e.g. the held-out set): drop rows whose question is one of its "
        "questions, exact text (repeatable)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None and argv[:2] == ["prepare", "countdown"]:  # generated by the demo task: no release to read
        from megatron_rlvr.data.countdown_split import main as countdown_main

        return countdown_main(argv[2:])
    args = build_parser().parse_args(argv)
    gym_flags = [f"--{k}" for k in ("tasks", "size", "seed") if getattr(args, k) is not None]
    gym_flags += ["--config"] if args.config else []
    if args.name == REASONING_GYM:
        return _prepare_reasoning_gym(args)
    if gym_flags:
        raise DataError(f"{', '.join(gym_flags)}: only with `data prepare {REASONING_GYM}`")
    if not args.src:
        raise DataError(f"--src: give the {args.name} release's directory or one of its data files")
    release = get_release(args.name)
    extra = get_release(args.add) if args.add else None
    if args.add and not args.add_src:
        raise DataError(f"--add {args.add}: give that release's directory with --add-src")
    if args.add_src and not args.add:
        raise DataError("--add-src: only with --add NAME")
    if args.levels and not (release.uses_levels or (extra and extra.uses_levels)):
        raise DataError(
            f"--levels: only the math release has levels (this command prepares {args.name}"
            f"{' + ' + args.add if args.add else ''})"
        )
    if args.drop_overlap and not args.check_against:
        raise DataError("--drop-overlap: needs --check-against DIR")
    levels = parse_levels(args.levels) if args.levels else None
    index = None
    if args.check_against:
        from megatron_rlvr.data.overlap import load_benchmark_index

        index, benchmarks = load_benchmark_index(args.check_against)
    report, seen = Report(), set()
    parts = [(release, args.src)] + ([(extra, args.add_src)] if extra else [])
    rows = []
    for part, src in parts:
        options = Options(levels=levels if part.uses_levels else None, instruction=not args.no_instruction)
        rows += convert_release(part, src, args.split, options, args.strict, report, seen)
    if index is not None:
        kept = []
        for row in rows:
            hit = index.find(row["_text"])
            if hit is not None:
                report.overlap.append((row["id"], hit))
                if args.drop_overlap:
                    report.dropped += 1
                    continue
            kept.append(row)
        rows = kept
    if not rows:
        raise DataError(f"{args.name} from {args.src}: no usable rows ({_summary(report)})")
    report.kept = len(rows)
    for row in rows:
        row.pop("_text")
    out = _write(rows, args.out)
    print(f"{args.name}{' + ' + args.add if args.add else ''}: {_summary(report)}; wrote {report.kept} rows to {out}")
    if index is not None:
        names = Counter(hit.split("/", 1)[0] for _, hit in report.overlap)
        shown = "; ".join(f"{rid} = {hit}" for rid, hit in report.overlap[:3])
        action = "dropped" if args.drop_overlap else "kept (--drop-overlap drops them)"
        print(
            f"overlap with {', '.join(benchmarks)} under {args.check_against}: {len(report.overlap)} training "
            f"problems {dict(names) if names else ''} {action}{'; e.g. ' + shown if shown else ''}"
        )
    return 0


def _write(rows: list[dict], path: str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out


def _prepare_reasoning_gym(args: argparse.Namespace) -> int:
    from megatron_rlvr.data.releases import reasoning_gym as gym

    if args.disjoint_from and args.tasks is None:
        raise DataError("--disjoint-from: only with reasoning-gym")
    for flag, value in (
        ("--src", args.src),
        ("--add", args.add),
        ("--levels", args.levels),
        ("--check-against", args.check_against),
    ):
        if value:
            raise DataError(f"{flag}: not with {REASONING_GYM} (its rows are generated: --tasks, --size, --seed)")
    missing = [f"--{k}" for k in ("tasks", "size", "seed") if getattr(args, k) is None]
    if missing:
        raise DataError(f"{REASONING_GYM}: give {', '.join(missing)} (e.g. --tasks leg_counting --size 1000 --seed 1)")
    tasks = gym.parse_tasks(args.tasks)
    report = gym.GymReport()
    held_out = gym.questions_of(args.disjoint_from)
    rows = gym.generate_rows(
        tasks, args.size, args.seed, gym.parse_config(args.config, tasks), not args.no_instruction, report, held_out
    )
    if not rows:
        raise DataError(f"{REASONING_GYM} {','.join(tasks)}: no usable rows ({gym.summary(report)})")
    out = _write(rows, args.out)
    print(
        f"{REASONING_GYM} {','.join(tasks)} (seed {args.seed}): {gym.summary(report)}; wrote {len(rows)} rows to {out}"
    )
    return 0


def _summary(report: Report) -> str:
    parts = [f"read {report.read} records"]
    for reason, count in report.skipped.most_common():
        parts.append(f"skipped {count}: {reason} (first: {report.first_skipped[reason]})")
    if report.duplicates:
        parts.append(f"{report.duplicates} repeated problems kept once")
    if report.dropped:
        parts.append(f"{report.dropped} dropped as found in the eval benchmarks")
    return "; ".join(parts)
