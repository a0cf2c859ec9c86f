"""The plan's arithmetic against measured bytes: real MegatronActors at small layouts on CPU (gloo workers).

For each layout (TP, PP, with or without the distributed optimizer and the frozen reference; with ``--moe`` a random
Qwen3-MoE and the expert-parallel size too; ``loraR``: LoRA adapters of rank R on a frozen base, docs/lora.md) every
rank builds the actor on a random Qwen2, runs the statistics pass and two updates, and reports the bytes of its parameters, of DDP's
grad buffer, of the optimizer state (Adam moments + main params that are not the model's own tensors), of the
reference, and the peak anonymous resident memory during an update (the second: the optimizer state exists) above
what the process held before the actor was built, with glibc told to return every freed tensor at once. Each is
printed beside `megatron_rlvr.plan.memory`'s prediction for that rank's pipeline stage.

    OMP_NUM_THREADS=1 python tools/benches/measure_memory.py                # the small model, 4 layouts, 2 ranks each
    python tools/benches/measure_memory.py --layouts 1,1,dist,ref 2,1,local --world 2 --markdown
    OMP_NUM_THREADS=1 python tools/benches/measure_memory.py --moe --markdown   # the small Qwen3-MoE at EP=1 and EP=2

    python tools/benches/measure_memory.py --layouts 1,1,dist,ref,lora8 2,1,dist,ref,lora8 --markdown   # LoRA, rank 8
    python tools/benches/measure_memory.py --host "configs/demo_cpu.yaml trainer.steps=2"   # host memory of a whole run

CPU runs fp32 without TE: weights 4 B, main grads 4 B, Adam 8 B (fp32 params are their own main params), unfused
attention. The same functions give the GPU plan with bf16 (2 B weights + 4 B fp32 main params).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rlvr.testing.configs import algo_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# A random Qwen2 big enough that allocator noise (tens of MB) is small against what is measured (~1 GB a rank).
SMALL_QWEN = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)
DEFAULT_LAYOUTS = ("1,1,dist", "1,1,local,ref", "2,1,dist,ref", "1,2,dist")
# A random Qwen3-MoE of the same scale: 8 experts, top-2, every layer MoE but one (mlp_only_layers), the experts
# about half the parameters, so EP=2 visibly halves them.
SMALL_MOE = dict(  # overrides of testing/tiny_models.py's qwen3_moe (its expert count, top-k and layer pattern)
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)
# TP > 1 with experts needs sequence parallelism in training, which the CPU spec's norm refuses (docs/moe.md)
MOE_LAYOUTS = ("1,1,dist", "1,1,dist,ep2", "1,1,local,ref,ep2", "1,2,dist")


@dataclass(frozen=True)
class Case:
    """One measured layout: (TP, PP), distributed optimizer or not, reference or not, and the batch shape."""

    tp: int
    pp: int
    distributed_optimizer: bool = True
    reference: bool = False
    micro_batch_size: int = 2
    seq_len: int = 512
    sequences: int = 4  # one mini-batch
    ep: int = 1  # expert-parallel size (a MoE model)
    lora: int = 0  # LoRA rank (0: full fine-tuning)

    @classmethod
    def parse(cls, text: str, **kw) -> Case:
        parts = text.split(",")
        flags = set(parts[2:])
        eps = [int(f[2:]) for f in flags if f.startswith("ep") and f[2:].isdigit()]
        ranks = [int(f[4:]) for f in flags if f.startswith("lora") and f[4:].isdigit()]
        unknown = flags - {"dist", "local", "ref"} - {f"ep{e}" for e in eps} - {f"lora{r}" for r in ranks}
        if len(parts) < 2 or unknown:
            raise SystemExit(f"--layouts {text!r}: expected TP,PP[,dist|local][,ref][,epN][,loraR]")
        flags_kw = dict(ep=max(eps or [1]), lora=max(ranks or [0]))
        return cls(int(parts[0]), int(parts[1]), "local" not in flags, "ref" in flags, **flags_kw, **kw)

    @property
    def label(self) -> str:
        return (
            f"TP={self.tp} PP={self.pp}{f' EP={self.ep}' if self.ep > 1 else ''} "
            f"{'dist-opt' if self.distributed_optimizer else 'local-opt'}{' +ref' if self.reference else ''}"
            f"{f' LoRA r={self.lora}' if self.lora else ''}"
        )


def config_of(case: Case, hf_dir: str, world: int):
    """The run Config of a case (CPU: fp32), as the plan reads it."""
    from megatron_rlvr.actor.config import ActorConfig, LoraConfig
    from megatron_rlvr.config import Config, TrainerConfig
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.rollout.config import RolloutConfig

    return Config(
        model=ModelConfig(hf_dir=hf_dir),
        actor=ActorConfig(
            tp=case.tp,
            pp=case.pp,
            micro_batch_size=case.micro_batch_size,
            ep=case.ep,
            lr=1e-4,
            use_distributed_optimizer=case.distributed_optimizer,
            lora=LoraConfig(rank=case.lora, alpha=32.0) if case.lora else None,
        ),
        algo=algo_config({"loss.kind": "casp", "kl.coef": 0.05 if case.reference else 0.0}),
        rollout=RolloutConfig(max_model_len=case.seq_len, max_new_tokens=case.seq_len // 2, group_size=case.sequences),
        trainer=TrainerConfig(prompts_per_step=1, mini_batches_per_step=1),
    )


def predicted(case: Case, hf_dir: str, world: int) -> list[dict[str, int]]:
    """The plan's bytes for each rank (by its pipeline stage): static components and the update's peak."""
    from megatron_rlvr.models import load_hf_config
    from megatron_rlvr.models.dims import ModelDims
    from megatron_rlvr.plan.memory import Layout, actor_rank_plan

    dims = ModelDims.from_hf(load_hf_config(hf_dir))
    lay = Layout.from_config(config_of(case, hf_dir, world), world, gpu=False)
    out = []
    for rank in range(world):
        stage = rank // (world // case.pp)  # megatron orders ranks TP-fastest, then DP, then PP
        plan = actor_rank_plan(dims, lay, stage, gpu_memory=0)
        c = plan.components
        out.append(
            {
                "weights": c["actor_weights"] + c["adapters"],
                "grads": c["actor_grads"],
                "optimizer": c["optimizer"],
                "reference": c["reference"],
                "update_peak": plan.phases["update"],
                "stage": stage,
            }
        )
    return out


def _rss_anon() -> int:
    """Anonymous resident bytes of this process (file-backed pages, e.g. mmapped safetensors, excluded)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so RSS counts live memory
    except OSError:
        pass


class PeakSampler:
    """Samples RssAnon every millisecond on a thread while a block runs; torch kernels release the GIL."""

    def __enter__(self) -> PeakSampler:
        self.peak, self._stop = _rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_bytes(actor) -> int:
    """Adam's state tensors plus the main params that do not share storage with a model parameter."""
    import torch

    model_storages = {p.untyped_storage().data_ptr() for c in actor.model_chunks for p in c.parameters()}
    opts = getattr(actor.optimizer, "chained_optimizers", None) or [actor.optimizer]
    total = 0
    for opt in opts:
        inner = opt.optimizer
        for state in inner.state.values():
            total += _bytes(v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
        for group in inner.param_groups:
            total += _bytes(p for p in group["params"] if p.untyped_storage().data_ptr() not in model_storages)
    return total


def measure_rank(case: Case, hf_dir: str, update: bool = True, warm_up: bool = True) -> dict[str, int]:
    """On every rank of a gloo group: build the case's actor, run statistics + one update, return measured bytes.

    ``warm_up``: first the same case on 16-token sequences, thrown away, so the modules megatron imports lazily and
    the kernels' first-use state are in the baseline and not counted as the update's memory."""
    import dataclasses

    import torch

    if warm_up and update:
        measure_rank(dataclasses.replace(case, seq_len=16), hf_dir, update=True, warm_up=False)

    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.protocols import Targets
    from megatron_rlvr.runtime.distributed import model_parallel, world_size
    from megatron_rlvr.testing.handoffs import rollouts

    cfg = config_of(case, hf_dir, world_size())
    _trim()
    base = _rss_anon()
    with model_parallel(tp=case.tp, pp=case.pp, seed=7, ep=case.ep, etp=1):
        actor = MegatronActor(cfg.model, cfg.actor, cfg.algo, temperature=1.0, total_steps=2)
        out = {
            "weights": _bytes(p for c in actor.model_chunks for p in c.parameters()),
            "grads": sum(_bytes([b.grad_data]) for m in actor.model for b in [*m.buffers, *m.expert_parallel_buffers]),
            "reference": _bytes(p for c in actor.reference or [] for p in c.parameters()),
        }
        if update:
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, actor.vocab_size, (case.sequences, case.seq_len), generator=g)
            mask = torch.zeros(case.sequences, case.seq_len - 1, dtype=torch.bool)
            mask[:, case.seq_len // 4 :] = True
            batch, targets = rollouts(tokens, mask), Targets(advantages=torch.linspace(-1, 1, case.sequences))
            # the statistics pass always (as with 2 mini-batches), and a frozen copy's or (LoRA) the base's
            statistics = actor.statistics_pass(batch)
            if actor.has_reference:
                statistics = dataclasses.replace(statistics, ref_logp=actor.compute_ref_logp(batch))
            # The first step creates Adam's state lazily, on top of a heap that glibc has not handed back after the
            # backward (on GPU the caching allocator reuses those blocks): measure the steady state, the second update.
            actor.update(batch, targets, statistics, mini_batches=1)
            _trim()
            with PeakSampler() as sampler:
                actor.update(batch, targets, statistics, mini_batches=1)
            out["update_peak"] = sampler.peak - base
        out["optimizer"] = _optimizer_bytes(actor)
        del actor
    return out


def run(cases: list[Case], hf_dir: str, world: int) -> list[dict]:
    from megatron_rlvr.testing.workers import WorkerGroup

    rows = []
    for case in cases:
        with WorkerGroup(world, timeout_s=1800) as group:  # a fresh group per case: nothing carried over
            measured = group.run(measure_rank, case, hf_dir)
        for rank, (m, p) in enumerate(zip(measured, predicted(case, hf_dir, world))):
            rows.append({"case": case.label, "rank": rank, "stage": p["stage"], "measured": m, "predicted": p})
    return rows


KEYS = ("weights", "grads", "optimizer", "reference", "update_peak")


def table(rows: list[dict], markdown: bool) -> str:
    head = ["layout", "rank"] + [f"{k} pred / meas MB" for k in KEYS]
    lines = []
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append("  ".join(head))
    for r in rows:
        cells = [r["case"], str(r["rank"])]
        for k in KEYS:
            p, m = r["predicted"][k], r["measured"].get(k, 0)
            err = f" ({(p - m) / m * 100:+.1f}%)" if m else ""
            cells.append(f"{p / 1e6:.2f} / {m / 1e6:.2f}{err}")
        lines.append(("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Host memory of a whole CPU training run (--host): plan/host_memory.py against the processes' measured PSS


def host_predicted(config: str, overrides: list[str], world: int):
    """plan/host_memory.py's CPU plan of the run: its components (bytes) and notes (which moment is the peak)."""
    from megatron_rlvr.config import load_config
    from megatron_rlvr.plan.host_memory import host_plan
    from megatron_rlvr.plan.memory import Layout
    from megatron_rlvr.plan.recipe_files import find_hf_config

    cfg = load_config(config, overrides)
    hf = find_hf_config(cfg.model.hf_dir)
    lay = Layout.from_config(cfg, world, gpu=False)
    return host_plan(cfg, hf, lay, world, world, 0)


def _tree_pss(root) -> tuple[int, int]:
    """(PSS summed over ``root`` and its descendants, how many): shared pages (/dev/shm, libraries) counted once."""
    import psutil

    total, count = 0, 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
            count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total, count


def host_measure(config: str, overrides: list[str], world: int, timeout_s: float) -> dict:
    """Run ``torchrun --nproc-per-node world -m megatron_rlvr.cli train config overrides`` and sample the process
    tree's PSS every 0.5 s: the node's host memory as the plan counts it."""
    import subprocess

    import psutil

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world),
        "-m",
        "megatron_rlvr.cli",
        "train",
        config,
        *overrides,
    ]
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:  # a pipe nobody reads while sampling could fill and stall the run
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)
        root, peak, procs = psutil.Process(proc.pid), 0, 0
        while proc.poll() is None and time.monotonic() - started < timeout_s:
            pss, count = _tree_pss(root)
            if pss > peak:
                peak, procs = pss, count
            time.sleep(0.5)
        timed_out = proc.poll() is None
        if timed_out:  # the ranks too, not only torchrun: its session is theirs
            os.killpg(proc.pid, 9)
        rc = proc.wait()
        err.seek(0)
        tail = err.read()[-2000:]
    return {
        "peak_pss": peak,
        "processes": procs,
        "rc": rc,
        "timed_out": timed_out,
        "seconds": time.monotonic() - started,
        "stderr_tail": tail,
    }


def host_main(args) -> int:
    rows = []
    for spec in args.host:
        config, *overrides = spec.split()
        plan = host_predicted(config, overrides, args.world)
        pred = plan.components
        for note in plan.notes:
            print(f"{spec}: plan note: {note}")
        meas = host_measure(config, overrides, args.world, args.timeout)
        if meas["rc"] != 0:
            print(f"{spec}: the run failed (rc {meas['rc']}):\n{meas['stderr_tail']}")
            return 1
        rows.append((spec, pred, meas))
    print(
        f"host memory of CPU training runs ({args.world} ranks): plan/host_memory.py vs the peak PSS of the run's "
        f"process tree (ranks, reward workers), sampled every 0.5 s"
    )
    print("| run | " + " | ".join(f"{k} (pred MB)" for k in rows[0][1]) + " | predicted MB | measured MB | error |")
    print("|---|" + "---|" * (len(rows[0][1]) + 3))
    for spec, pred, meas in rows:
        total = sum(pred.values())
        err = (total - meas["peak_pss"]) / meas["peak_pss"] * 100
        print(
            f"| {spec} | "
            + " | ".join(f"{v / 1e6:.0f}" for v in pred.values())
            + f" | {total / 1e6:.0f} | {meas['peak_pss'] / 1e6:.0f} | {err:+.1f}% |"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--host",
        nargs="+",
        default=None,
        metavar="'CONFIG [key=value ...]'",
        help="host memory mode: run each CPU training config under torchrun and compare its peak PSS "
        "with the plan's host table",
    )
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS), help="TP,PP[,dist|local][,ref] each")
    p.add_argument("--world", type=int, default=2, help="gloo ranks per layout")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--moe", action="store_true", help="the small Qwen3-MoE (default layouts: EP=1 and EP=2)")
    args = p.parse_args(argv)
    if args.host:
        return host_main(args)
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    layouts = list(MOE_LAYOUTS) if args.moe and args.layouts == list(DEFAULT_LAYOUTS) else args.layouts
    cases = [Case.parse(t, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size) for t in layouts]
    arch, shape = ("qwen3_moe", SMALL_MOE) if args.moe else ("qwen2", SMALL_QWEN)
    # The workers (spawned: they inherit this environment) get every allocation of 64 KiB or more from mmap, so a
    # freed tensor leaves the resident set at once: RSS then follows the live bytes, as torch.cuda's
    # max_memory_allocated does on GPU; without it, heap fragmentation put the peak up to 31% above the prediction.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(make_tiny_hf_model(arch, Path(tmp) / "small_model", with_tokenizer=False, **shape))
        rows = run(cases, hf_dir, args.world)
    print(
        f"model: random {arch} {shape}; {args.world} gloo ranks; micro-batch {args.micro_batch_size} x "
        f"{args.seq_len} tokens; fp32 on CPU; MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}"
    )
    print(table(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
