"""The GPU check's summary table: summary.py's JSON object as rows of label and value, one section per stage group
(the op, the actor's CUDA-vs-CPU comparisons, the 1B model's throughput per attention, the bridge)."""

from __future__ import annotations

from typing import Any


def _row(label: str, value: Any) -> None:
    print(f"  {label:48s} {value}")


def _ok(verdict: dict[str, Any]) -> str:
    return "ok" if verdict.get("ok") else "MISMATCH"


def print_ops(r: dict[str, Any]) -> None:
    if r.get("gpu_tests"):
        _row("GPU tests (op kernels, SDPA under flash)", r["gpu_tests"])
    if r.get("bandwidth"):
        _row("HBM read / copy GB/s", f"{r['bandwidth']['read_gb_per_s']} / {r['bandwidth']['copy_gb_per_s']}")
    bench = r.get("op_bench") or {}
    bounds = r.get("op_bench_vs_bytes_read") or {}
    for dtype, fig in bench.get("by_dtype", {}).items():
        _row(
            f"op {dtype} floor, composite fwd / fwd+bwd s",
            f"{fig['floor_logsumexp']}; {fig['composite_fwd']} / {fig['composite_fwdbwd']}",
        )
        for prefix, impl in {"ours": bench.get("impl"), **bench.get("also", {})}.items():
            bound = bounds.get(dtype, {}).get(prefix, {})
            _row(
                f"op {dtype} {impl}: fwd, fwd+bwd (in place) s",
                f"{fig[f'{prefix}_fwd']}, {fig[f'{prefix}_fwdbwd']} ({fig[f'{prefix}_fwdbwd_inplace']}); x read bound "
                f"{bound.get('fwd_over_read_bound', '?')}, {bound.get('fwdbwd_over_bound', '?')} "
                f"({bound.get('fwdbwd_inplace_over_bound', '?')})",
            )
        for prefix, impl in bench.get("also", {}).items():
            _row(
                f"op {dtype} {impl} over {bench.get('impl')}",
                f"{fig[f'{prefix}_fwd_speedup_vs_ours']}x fwd, {fig[f'{prefix}_fwdbwd_speedup_vs_ours']}x fwd+bwd, "
                f"{fig[f'{prefix}_fwdbwd_inplace_speedup_vs_ours']}x in place",
            )


def print_compare(name: str, cmp_: dict[str, Any] | None) -> None:
    """One CUDA-vs-CPU verdict of compare.py: per (dtype, layout), then packed against padded per device."""
    if not cmp_:
        return
    if cmp_.get("reason"):
        _row(name, cmp_["reason"])
    for key, v in cmp_.get("runs", {}).items():
        if v.get("ok") is None:
            _row(f"{name} {key}", v.get("reason"))
            continue
        text = (
            f"{_ok(v)}; max |dlogp| before {v['logp_before'].get('max_abs_diff')}, after "
            f"{v['logp_after'].get('max_abs_diff')}"
        )
        if v.get("ref_logp"):
            text += (
                f"; reference {_ok(v['ref_logp'])} ({v['ref_logp'].get('max_abs_diff')}), frozen {_ok(v['ref_frozen'])}"
            )
        drift = v.get("bf16_vs_fp32")
        if drift:
            text += (
                f" (not judged after the updates; bf16 vs fp32 there: cuda {drift['cuda']['logp_after_max_abs']}, "
                f"cpu {drift['cpu']['logp_after_max_abs']})"
            )
        _row(f"{name} {key}", text)
    for key, v in cmp_.get("packed_vs_padded", {}).items():
        _row(f"{name} packed vs padded {key}", f"{_ok(v)}; max |dlogp| {v.get('max_abs_diff')}")


def print_throughput(name: str, big: dict[str, Any] | None) -> None:
    """The 1B actor's figures of one attention: per layout the statistics pass and the updates."""
    if not big:
        return
    _row(
        name,
        f"{big.get('params', 0) / 1e9:.2f}B params, attention {big.get('attention')}, {big.get('backend')}, op "
        f"{big.get('impl')}, TE {big.get('transformer_engine')}; build {big.get('build_s')} s; "
        f"{big.get('real_tokens')} real of {big.get('padded_tokens')} padded tokens"
        + ("" if big.get("complete") else " (INCOMPLETE: the stage stopped early)"),
    )
    for layout, fig in big.get("layouts", {}).items():
        if fig.get("status") != "ok":
            _row(f"{name} {layout}", f"{fig.get('status')}: {fig.get('reason')}")
            continue
        ups = fig.get("updates", [])
        _row(f"{name} {layout} stats tok/s, peak GiB", f"{fig['stats_tokens_per_s']}, {fig['stats_peak_gib']}")
        _row(
            f"{name} {layout} update tok/s, MFU, peak GiB",
            f"{[u['tokens_per_s'] for u in ups]}, {[u.get('mfu') for u in ups]}, {fig.get('update_peak_gib')}; "
            f"loss {[round(u.get('actor/loss', float('nan')), 5) for u in ups]}",
        )


def print_bridge(br: dict[str, Any] | None) -> None:
    br = br or {}
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


def print_table(r: dict[str, Any]) -> None:
    env = r.get("env") or {}
    print(
        f"\ngpu_check summary: {env.get('gpu', '?')} torch {env.get('torch', '?')} CUDA {env.get('cuda', '?')} "
        f"megatron-core {env.get('megatron_core', '?')}; {r.get('total_s', '?')} s of a {r.get('budget_s', '?')} s budget"
    )
    print("stages:")
    for name, s in r["stages"].items():
        _row(name, f"{s['status']:8s} {s.get('seconds', 0):5d} s" + (f"  ({s['reason']})" if s.get("reason") else ""))
    print_ops(r)
    pg = r.get("process_group") or {}
    if pg:
        _row(
            "process group",
            f"library {pg.get('library_backend')} {pg.get('library')}; stages used "
            f"{pg.get('use_backend') or 'the library backend'}",
        )
    print_compare("actor CUDA vs CPU", r.get("actor_compare"))
    print_compare("fp32-sum bf16 CUDA vs CPU", r.get("actor_compare_fp32sum"))
    print_compare("LoRA r8 + KL CUDA vs CPU", r.get("actor_compare_lora"))
    print_compare("frozen reference + KL CUDA vs CPU", r.get("actor_compare_reference"))
    for layout, drift in (r.get("bf16_drift") or {}).items():
        _row(f"bf16 from fp32 after the updates, {layout}", ", ".join(f"{k} {v:.4g}" for k, v in drift.items()))
    print_throughput("actor 1B", r.get("actor_1b"))
    print_throughput("actor 1B unfused", r.get("actor_1b_unfused"))
    for layout, ratio in (r.get("sdpa_over_unfused") or {}).items():
        _row(f"actor 1B {layout} update tok/s, SDPA over unfused", f"{ratio}x")
    print_bridge(r.get("bridge"))
