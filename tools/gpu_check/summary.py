"""The GPU check's last step: every stage's record and figures into one JSON file, and a table on stdout.

gpu_check.sh appends one line per stage to ``<work>/stages.jsonl`` (name, exit status, seconds, limit) and each
stage writes its figures to ``<work>/<stage>.json`` (the op bench: the last line of its log; the op tests: a JUnit
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

LOG_TAIL_LINES = 40


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=common.DEFAULT_WORK)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=int, default=0)
    p.add_argument("--total-s", type=int, default=0)
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
    """The op against the bytes it must move: the forward reads the logits once; the in-place forward+backward
    reads them twice and writes the gradient over them once (3x the logits' bytes)."""
    if not bw:
        return {}
    gbs = bw["read_gb_per_s"] * 1e9
    out = {}
    for dtype, fig in bench.get("by_dtype", {}).items():
        once = fig["logits_bytes"] / gbs
        out[dtype] = {
            "read_once_s": round(once, 5),
            "fwd_over_read_bound": round(fig["ours_fwd"] / once, 2),
            "floor_over_read_bound": round(fig["floor_logsumexp"] / once, 2),
            "fwdbwd_inplace_over_bound": round(fig["ours_fwdbwd_inplace"] / (3 * once), 2),
            "fwd_effective_gb_per_s": round(fig["logits_bytes"] / fig["ours_fwd"] / 1e9, 1),
        }
    return out


def gather(work: Path) -> dict[str, Any]:
    bench = _last_json_line(work / "op_bench.log")
    bw = _json(work / "bandwidth.json")
    result: dict[str, Any] = {
        "stages": stage_records(work),
        "op_tests": junit_counts(work / "op_tests.xml"),
        "bandwidth": bw,
        "op_bench": bench,
        "op_bench_vs_bytes_read": read_bounds(bench, bw) if bench else None,
        "process_group": _json(work / "pg_probe.json"),
        "actor_small_cuda": _json(work / "actor_small_cuda.json"),
        "actor_small_cpu": _json(work / "actor_small_cpu.json"),
        "actor_compare": _json(work / "actor_compare.json"),
        "actor_1b": _json(work / "actor_1b.json"),
        "bridge": _json(work / "bridge.json"),
    }
    env = next(
        (d["env"] for d in (result["actor_1b"], result["bridge"], bw, result["actor_small_cuda"]) if d and "env" in d),
        None,
    )
    result["env"] = env
    return result


def _row(label: str, value: Any) -> None:
    print(f"  {label:44s} {value}")


def print_table(r: dict[str, Any]) -> None:
    env = r.get("env") or {}
    print(
        f"\ngpu_check summary: {env.get('gpu', '?')} torch {env.get('torch', '?')} CUDA {env.get('cuda', '?')} "
        f"megatron-core {env.get('megatron_core', '?')}; {r.get('total_s', '?')} s of a {r.get('budget_s', '?')} s budget"
    )
    print("stages:")
    for name, s in r["stages"].items():
        _row(name, f"{s['status']:8s} {s.get('seconds', 0):5d} s" + (f"  ({s['reason']})" if s.get("reason") else ""))
    if r["op_tests"]:
        _row("op tests on CUDA", r["op_tests"])
    if r["bandwidth"]:
        _row("HBM read / copy GB/s", f"{r['bandwidth']['read_gb_per_s']} / {r['bandwidth']['copy_gb_per_s']}")
    bench = r.get("op_bench") or {}
    for dtype, fig in bench.get("by_dtype", {}).items():
        bound = (r.get("op_bench_vs_bytes_read") or {}).get(dtype, {})
        _row(
            f"op {dtype} fwd s (floor, composite)",
            f"{fig['ours_fwd']} ({fig['floor_logsumexp']}, {fig['composite_fwd']}); "
            f"x floor {fig['fwd_over_floor']}, x read bound {bound.get('fwd_over_read_bound', '?')}",
        )
        _row(
            f"op {dtype} fwd+bwd s (in place, composite)",
            f"{fig['ours_fwdbwd']} ({fig['ours_fwdbwd_inplace']}, {fig['composite_fwdbwd']}); "
            f"speedup {fig['fwdbwd_speedup_vs_composite']}x, in place {fig['fwdbwd_inplace_speedup_vs_composite']}x",
        )
    pg = r.get("process_group") or {}
    if pg:
        _row(
            "process group",
            f"library {pg.get('library_backend')} {pg.get('library')}; stages used "
            f"{pg.get('use_backend') or 'the library backend'}",
        )
    cmp_ = r.get("actor_compare") or {}
    if cmp_.get("reason"):
        _row("actor CUDA vs CPU", cmp_["reason"])
    if cmp_:
        for key, v in cmp_.get("runs", {}).items():
            if v.get("ok") is None:
                _row(f"actor CUDA vs CPU {key}", v.get("reason"))
                continue
            _row(
                f"actor CUDA vs CPU {key}",
                f"{'ok' if v['ok'] else 'MISMATCH'}; max |dlogp| before "
                f"{v['logp_before'].get('max_abs_diff')}, after {v['logp_after'].get('max_abs_diff')}"
                + (
                    f" (not judged after the updates; bf16 vs fp32 there: cuda "
                    f"{v['bf16_vs_fp32']['cuda']['logp_after_max_abs']}, cpu {v['bf16_vs_fp32']['cpu']['logp_after_max_abs']})"
                    if v.get("bf16_vs_fp32")
                    else ""
                ),
            )
        for key, v in cmp_.get("packed_vs_padded", {}).items():
            _row(f"packed vs padded {key}", f"{'ok' if v['ok'] else 'MISMATCH'}; max |dlogp| {v.get('max_abs_diff')}")
    big = r.get("actor_1b") or {}
    if big:
        _row(
            "actor 1B",
            f"{big.get('params', 0) / 1e9:.2f}B params, {big.get('backend')}, op {big.get('impl')}, "
            f"TE {big.get('transformer_engine')}; build {big.get('build_s')} s; "
            f"{big.get('real_tokens')} real of {big.get('padded_tokens')} padded tokens"
            + ("" if big.get("complete") else " (INCOMPLETE: the stage stopped early)"),
        )
        for layout, fig in big.get("layouts", {}).items():
            if fig.get("status") != "ok":
                _row(f"actor 1B {layout}", f"{fig.get('status')}: {fig.get('reason')}")
                continue
            ups = fig.get("updates", [])
            _row(f"actor 1B {layout} stats tok/s, peak GiB", f"{fig['stats_tokens_per_s']}, {fig['stats_peak_gib']}")
            _row(
                f"actor 1B {layout} update tok/s, peak GiB",
                f"{[u['tokens_per_s'] for u in ups]}, {fig.get('update_peak_gib')}; "
                f"loss {[round(u.get('actor/loss', float('nan')), 5) for u in ups]}",
            )
    br = r.get("bridge") or {}
    if "param_devices" in br:
        _row("bridge 1B model's parameters on", br["param_devices"])
    for key, label in (("export_loaded", "vs checkpoint files"), ("export_moved", "vs state dict")):
        fig = br.get(key)
        if fig:
            exact = fig.get("vs_checkpoint_files") or fig.get("vs_state_dict") or {}
            _row(
                f"bridge {key} GB/s, bit-exact {label}",
                f"{fig['gb_per_s']} ({fig['bytes'] / 2**30:.2f} GiB in {fig['seconds']} s, to {fig['yielded_on']}); "
                f"{exact.get('ok')} over {exact.get('compared')} tensors",
            )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = gather(args.work)
    result["budget_s"], result["total_s"] = args.budget_s, args.total_s
    common.write_json(args.out, result)
    print_table(result)
    print(f"\ngpu_check: figures in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
