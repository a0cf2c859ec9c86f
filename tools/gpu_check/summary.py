"""The GPU check's last step: every stage's record and figures into one JSON file, and a table on stdout (table.py).

gpu_check.sh appends one line per stage to ``<work>/stages.jsonl`` (name, exit status, seconds, limit) and each
stage writes its figures to ``<work>/<stage>.json`` (the op bench: the last line of its log; the GPU tests: a JUnit
file). A stage that failed or ran out of time keeps the tail of its log in the JSON, so one call tells what broke.

    python tools/gpu_check/summary.py --work /tmp/gpu_check --out $OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import table  # noqa: E402

LOG_TAIL_LINES = 40


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=common.DEFAULT_WORK)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=int, default=0)
    p.add_argument("--total-s", type=int, default=0)
    p.add_argument(
        "--passed-tests",
        metavar="WORD",
        help="only say, by the exit status, whether the GPU tests whose names hold WORD all ran and passed",
    )
    return p


def preflight(args: argparse.Namespace) -> list[str]:
    return []


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_json_line(path: Path) -> dict[str, Any] | None:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def stage_records(work: Path) -> dict[str, dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    try:
        lines = (work / "stages.jsonl").read_text().splitlines()
    except OSError:
        return records
    for line in lines:
        r = json.loads(line)
        rc = r["rc"]
        status = "skipped" if rc < 0 else "ok" if rc == 0 else "timeout" if rc in (124, 137) else "failed"
        r["status"] = status
        if status in ("failed", "timeout"):
            r["log_tail"] = _tail(work / f"{r['name']}.log")
        records[r["name"]] = r
    return records


def tests_passed(path: Path, word: str) -> bool:
    """Whether the JUnit file lists tests whose names hold ``word`` and every one of them passed."""
    try:
        cases = [c for c in ET.parse(path).getroot().iter("testcase") if word in c.get("name", "")]
    except (OSError, ET.ParseError):
        return False
    return bool(cases) and all(c.find(kind) is None for c in cases for kind in ("failure", "error", "skipped"))


def junit_counts(path: Path) -> dict[str, int] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for key in counts:
            counts[key] += int(s.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def read_bounds(bench: dict[str, Any], bw: dict[str, Any] | None) -> dict[str, Any]:
    """Each implementation of the op against the bytes it must move: the forward reads the logits once; the
    forward+backward reads them twice and writes the gradient once (3x the logits' bytes), in place or not.
    Keyed by dtype, then implementation ("ours": the default one; then bench_token_stats' --also ones)."""
    if not bw:
        return {}
    gbs = bw["read_gb_per_s"] * 1e9
    out: dict[str, Any] = {}
    for dtype, fig in bench.get("by_dtype", {}).items():
        once = fig["logits_bytes"] / gbs
        out[dtype] = {"read_once_s": round(once, 5), "floor_over_read_bound": round(fig["floor_logsumexp"] / once, 2)}
        names = {"ours": bench.get("impl"), **bench.get("also", {})}
        for prefix, impl in names.items():
            out[dtype][prefix] = {
                "impl": impl,
                "fwd_over_read_bound": round(fig[f"{prefix}_fwd"] / once, 2),
                "fwdbwd_over_bound": round(fig[f"{prefix}_fwdbwd"] / (3 * once), 2),
                "fwdbwd_inplace_over_bound": round(fig[f"{prefix}_fwdbwd_inplace"] / (3 * once), 2),
                "fwd_effective_gb_per_s": round(fig["logits_bytes"] / fig[f"{prefix}_fwd"] / 1e9, 1),
            }
    return out


def _mean_update_rate(fig: dict[str, Any]) -> float | None:
    rates = [u["tokens_per_s"] for u in fig.get("updates", []) if u.get("tokens_per_s")]
    return sum(rates) / len(rates) if rates else None


def attention_speedups(sdpa: dict[str, Any] | None, unfused: dict[str, Any] | None) -> dict[str, float]:
    """Per layout both 1B runs have: SDPA's mean update tokens/s over the unfused attention's."""
    out = {}
    for layout, fig in ((sdpa or {}).get("layouts") or {}).items():
        other = ((unfused or {}).get("layouts") or {}).get(layout)
        a, b = _mean_update_rate(fig), _mean_update_rate(other or {})
        if a and b:
            out[layout] = round(a / b, 3)
    return out


def bf16_drift(default: dict[str, Any] | None, fp32_sums: dict[str, Any] | None) -> dict[str, Any]:
    """Per layout: how far the bf16 run's log-probs lie from its own fp32 run's after the updates, on CUDA with
    cuBLAS's default (reduced-precision) bf16 sums, on CUDA with fp32 sums, and on the CPU."""
    out: dict[str, Any] = {}
    for name, cmp_ in (("cuda", default), ("cuda_fp32_sums", fp32_sums)):
        for key, run in ((cmp_ or {}).get("runs") or {}).items():
            drift = run.get("bf16_vs_fp32")
            if drift:
                layout = key.split("/")[1]
                out.setdefault(layout, {})[name] = drift["cuda"]["logp_after_max_abs"]
                out[layout]["cpu"] = drift["cpu"]["logp_after_max_abs"]  # the same CPU half in both
    order = ("cuda", "cuda_fp32_sums", "cpu")
    return {layout: {k: d[k] for k in order if k in d} for layout, d in out.items()}


def gather(work: Path) -> dict[str, Any]:
    bench = _last_json_line(work / "op_bench.log")
    bw = _json(work / "bandwidth.json")
    result: dict[str, Any] = {
        "stages": stage_records(work),
        "gpu_tests": junit_counts(work / "gpu_tests.xml"),
        "bandwidth": bw,
        "op_bench": bench,
        "op_bench_vs_bytes_read": read_bounds(bench, bw) if bench else None,
        "process_group": _json(work / "pg_probe.json"),
        "actor_small_cuda": _json(work / "actor_small_cuda.json"),
        "actor_small_cpu": _json(work / "actor_small_cpu.json"),
        "actor_compare": _json(work / "actor_compare.json"),
        "actor_1b": _json(work / "actor_1b.json"),
        "actor_1b_unfused": _json(work / "actor_1b_unfused.json"),
        "actor_compare_fp32sum": _json(work / "actor_compare_fp32sum.json"),
        "actor_compare_lora": _json(work / "actor_compare_lora.json"),
        "actor_compare_reference": _json(work / "actor_compare_reference.json"),
        "bridge": _json(work / "bridge.json"),
    }
    result["sdpa_over_unfused"] = attention_speedups(result["actor_1b"], result["actor_1b_unfused"])
    result["bf16_drift"] = bf16_drift(result["actor_compare"], result["actor_compare_fp32sum"])
    env = next(
        (d["env"] for d in (result["actor_1b"], result["bridge"], bw, result["actor_small_cuda"]) if d and "env" in d),
        None,
    )
    result["env"] = env
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.passed_tests:
        return 0 if tests_passed(args.work / "gpu_tests.xml", args.passed_tests) else 1
    result = gather(args.work)
    result["budget_s"], result["total_s"] = args.budget_s, args.total_s
    common.write_json(args.out, result)
    table.print_table(result)
    print(f"\ngpu_check: figures in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
