"""Stage 2's verdict: the small model's actor run on CUDA against the same run on the CPU (same seeds, same batch).

For every (dtype, layout) both ran: the per-token log-probs of the statistics pass before and after the two
updates, and each update's loss and gradient norm, within a tolerance of the dtype (``|a - b| <= atol + rtol *
|b|``, b the CPU figure; bf16's rtol is torch.testing's 1.6e-2). Also, on each device, packed against padded. A run
with a KL reference (a frozen copy, or LoRA's base) also compares the reference's log-probs, a forward (judged in
bf16 too), and requires that the reference did not move during the updates, on either device.

What bf16 is judged on: the forward before any update (the log-probs) and the first update (its loss, and its
gradient norm, which sums the whole backward), within bf16's tolerance. What follows the first Adam step is recorded,
not judged: that step moves every weight by about lr whatever its gradient's size, so an element near zero whose sign
bf16 rounding flips moves the other way, and the devices round differently (cuBLAS may reduce bf16 products in
reduced precision, the CPU accumulates them in fp32). No tolerance bounds that: the first GPU run saw the devices
0.33 apart in log-prob two updates later, CUDA's bf16 run 0.33 from its fp32 run and the CPU's 0.14. The record
holds the gap and each device's distance from its own fp32 run.

    python tools/gpu_check/compare.py --cuda small_cuda.json --cpu small_cpu.json --out compare.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# (rtol, atol) per dtype: log-probs (about -8 for this vocabulary) and the scalars (loss, gradient norm)
TOLERANCES = {
    "float32": {"logp": (1.3e-4, 1e-4), "scalar": (1e-4, 1e-5)},
    "bfloat16": {"logp": (1.6e-2, 1e-2), "scalar": (1.6e-2, 1e-3)},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cuda", type=Path, required=True, help="actor_check.py's JSON of the CUDA run")
    p.add_argument("--cpu", type=Path, required=True, help="actor_check.py's JSON of the CPU run")
    p.add_argument("--out", type=Path, required=True)
    return p


def preflight(args: argparse.Namespace) -> list[str]:
    import torch  # noqa: F401

    return []


def _within(a: float, b: float, tol: tuple[float, float]) -> bool:
    return abs(a - b) <= tol[1] + tol[0] * abs(b)


def tensor_verdict(a, b, tol: tuple[float, float]) -> dict[str, Any]:
    """Max abs difference and whether every element is within the tolerance (a, b: 1-D float tensors)."""
    import torch

    if a.shape != b.shape:
        return {"ok": False, "reason": f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"}
    diff = (a - b).abs()
    return {
        "ok": bool((diff <= tol[1] + tol[0] * b.abs()).all()) and bool(torch.isfinite(a).all()),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
    }


def bf16_drift(cuda: dict[str, Any], cpu: dict[str, Any], cuda_t: dict, cpu_t: dict, layout: str) -> dict | None:
    """How far each device's bf16 run lies from its own fp32 run after the updates (one layout): the record."""
    bf16, fp32 = f"bfloat16/{layout}", f"float32/{layout}"
    pairs = {"cuda": (cuda, cuda_t), "cpu": (cpu, cpu_t)}
    if not all(figures["runs"].get(k, {}).get("status") == "ok" for figures, _ in pairs.values() for k in (bf16, fp32)):
        return None
    return {
        device: {
            "logp_after_max_abs": float((t[bf16]["after"] - t[fp32]["after"]).abs().max()),
            "grad_norms": [
                (low.get("actor/grad_norm"), high.get("actor/grad_norm"))
                for low, high in zip(figures["runs"][bf16]["updates"], figures["runs"][fp32]["updates"])
            ],
        }
        for device, (figures, t) in pairs.items()
    }


def compare(cuda: dict[str, Any], cpu: dict[str, Any], cuda_t: dict, cpu_t: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"tolerances": TOLERANCES, "runs": {}, "packed_vs_padded": {}}
    for key, run in cuda["runs"].items():
        other = cpu["runs"].get(key, {})
        if run.get("status") != "ok" or other.get("status") != "ok":
            out["runs"][key] = {
                "ok": None,
                "reason": f"not run on both: cuda {run.get('status')}, cpu {other.get('status')}",
            }
            continue
        dtype, layout = key.split("/")
        tol = TOLERANCES[dtype]
        verdict: dict[str, Any] = {
            "logp_before": tensor_verdict(cuda_t[key]["before"], cpu_t[key]["before"], tol["logp"]),
            "logp_after": tensor_verdict(cuda_t[key]["after"], cpu_t[key]["after"], tol["logp"]),
            "updates": [],
        }
        if "ref" in cuda_t[key] or "ref" in cpu_t[key]:
            verdict["ref_logp"] = (
                tensor_verdict(cuda_t[key]["ref"], cpu_t[key]["ref"], tol["logp"])
                if "ref" in cuda_t[key] and "ref" in cpu_t[key]
                else {"ok": False, "reason": "a reference on one device only"}
            )
            moved = {"cuda": run.get("ref_moved_max_abs"), "cpu": other.get("ref_moved_max_abs")}
            verdict["ref_frozen"] = {"ok": all(m == 0.0 for m in moved.values()), "moved_max_abs": moved}
        judge_all = dtype != "bfloat16"  # bf16: judged up to the first Adam step (the module's doc says why)
        if not judge_all:
            verdict["logp_after"]["judged"] = False
            verdict["bf16_vs_fp32"] = bf16_drift(cuda, cpu, cuda_t, cpu_t, layout)
        for i, (a, b) in enumerate(zip(run["updates"], other["updates"])):
            figures = {
                name: {"cuda": a[name], "cpu": b[name], "ok": _within(a[name], b[name], tol["scalar"])}
                for name in ("actor/loss", "actor/grad_norm")
                if name in a and name in b
            }
            if not (judge_all or i == 0):
                for figure in figures.values():
                    figure["judged"] = False
            verdict["updates"].append(figures)
        every = [verdict["logp_before"], verdict["logp_after"], *(v for u in verdict["updates"] for v in u.values())]
        every += [verdict[k] for k in ("ref_logp", "ref_frozen") if k in verdict]
        checks = [v["ok"] for v in every if v.get("judged", True)]
        verdict["ok"] = all(checks) and len(run["updates"]) == len(other["updates"]) > 0
        out["runs"][key] = verdict
    for device, figures, t in (("cuda", cuda, cuda_t), ("cpu", cpu, cpu_t)):
        for dtype in TOLERANCES:
            a, b = f"{dtype}/packed", f"{dtype}/padded"
            if figures["runs"].get(a, {}).get("status") == "ok" and figures["runs"].get(b, {}).get("status") == "ok":
                out["packed_vs_padded"][f"{device}/{dtype}"] = tensor_verdict(
                    t[a]["before"], t[b]["before"], TOLERANCES[dtype]["logp"]
                )
    verdicts = [v["ok"] for v in out["runs"].values() if v["ok"] is not None]
    verdicts += [v["ok"] for v in out["packed_vs_padded"].values()]
    out["ok"] = bool(verdicts) and all(verdicts)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    missing = [
        f"{p} (its stage left no figures: see its status and log)" for p in (args.cuda, args.cpu) if not p.is_file()
    ]
    if missing:
        common.write_json(args.out, {"ok": False, "reason": "missing: " + "; ".join(missing)})
        print(f"compare: nothing to compare, missing {missing}", file=sys.stderr)
        return 1
    cuda, cpu = json.loads(args.cuda.read_text()), json.loads(args.cpu.read_text())
    result = compare(cuda, cpu, torch.load(cuda["tensors"]), torch.load(cpu["tensors"]))
    common.write_json(args.out, result)
    print(f"compare: {'ok' if result['ok'] else 'MISMATCH'} ({args.out})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
