"""The CaSP mechanism study on SmolLM2-135M-Instruct (docs/casp-mechanism.md), run or resumed step by step.

    .venv/bin/python tools/experiments/casp_mechanism.py status [--results results/casp-mechanism]
    .venv/bin/python tools/experiments/casp_mechanism.py run    [--results results/casp-mechanism] [--only STAGE ...]
                                                                 [--keep-checkpoints] [--smoke]
    .venv/bin/python tools/experiments/casp_mechanism.py report [--results results/casp-mechanism]

``run`` walks the stages in order and skips every one whose result is there: the model conversion, the three
data files, the probe set, the base's probe and evaluation, then per seed pair GRPO's and CaSP's training (32
steps, a checkpoint every 8), their probes at steps 8..32 and their evaluations, then PSR's and NSR's training and
probes (one seed each) and last their evaluations.
Each stage is one `megatron-rlvr` command (printed before it starts), itself resumable: a training run resumes from
its last checkpoint, an evaluation from its last stored request, the probe draw from its last block, and a probe
run skips the checkpoints it scored. A session that ends mid-stage loses at most that stage's unfinished part;
rerun the same command. Small results (probe scores, eval results, training metrics, the probe set, each stage's
wall time in ``timing.jsonl``) go under ``--results`` (committed); samples, checkpoints and the model under
``--work`` (default: outputs/<results folder name>, ignored by git). Intermediate training checkpoints are deleted
once their probe is scored, unless ``--keep-checkpoints`` (2.1 GB each).

``--smoke`` runs the same stages at toy size (2 steps of 4 prompts x 4 answers, a probe of 4 prompts, an
evaluation of 4 problems x 4 samples) into results/casp-mechanism-smoke under outputs/: the check that every stage
works end to end, not a result. ``report`` builds the tables and figures from the results folder alone
(megatron_rlvr/inspection/mechanism_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_rlvr.inspection.mechanism_design import BASE, SINGLE_ARMS, Design, probe_label  # noqa: E402

MODEL = "outputs/models/smollm2-135m-instruct"  # the float32 conversion of the installed GGUF file
RECIPE = "configs/smollm2-135m-instruct_arithmetic_{loss}_cpu.yaml"  # psr and nsr: the GRPO recipe with algo.loss.kind
GYM = [
    "--tasks", "basic_arithmetic", "--no-instruction",
    "--config", "basic_arithmetic.min_terms=2", "--config", "basic_arithmetic.max_terms=2",
    "--config", "basic_arithmetic.min_digits=1", "--config", "basic_arithmetic.max_digits=1",
]  # fmt: skip
SAMPLING = ["--chat-template", "--answer", "last_number", "--max-new-tokens", "48"]  # the recipes' rollout settings
NPROC = 2  # both cores: the recipes' TP=1 x DP=2, and the probe at DP=2
SMOKE = Design(
    seeds=(1,),
    steps=2,
    probe_every=1,
    pass_ks=(1, 2, 4),
    eval_problems=4,
    eval_samples=4,
    probe_prompts=4,
    probe_samples=8,
    probe_keep=2,
    extra={"train": ["trainer.prompts_per_step=4", "rollout.group_size=4"]},
)


@dataclass
class Stage:
    name: str
    done: Callable[[], bool]
    run: Callable[[], None]


class Experiment:
    def __init__(self, results: Path, work: Path, design: Design, keep_checkpoints: bool) -> None:
        self.results, self.work, self.design, self.keep = results, work, design, keep_checkpoints
        self.data = work / "data"

    # --- commands ---------------------------------------------------------------------------------------------
    def sh(self, argv: list[str], threads: int) -> None:
        """One command, echoed; its output goes to the console; a failure stops the driver (rerun resumes)."""
        print(f"$ {shlex.join(argv)}", flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        subprocess.run(argv, cwd=REPO, env=env, check=True)

    def cli(self, *args: str, threads: int = 1) -> None:
        self.sh([sys.executable, "-m", "megatron_rlvr.cli", *args], threads)

    def timed(self, stage: Stage) -> None:
        started = time.monotonic()
        stage.run()
        if not stage.done():  # a training stopped by a signal exits 0 (so Slurm requeues it) with its run unfinished
            raise SystemExit(
                f"[casp-mechanism] {stage.name}: its command ended before the stage was done; rerun resumes it"
            )
        record = {"stage": stage.name, "seconds": round(time.monotonic() - started, 1), "at": time.strftime("%FT%T")}
        with open(self.results / "timing.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[casp-mechanism] {stage.name}: {record['seconds']:.0f} s", flush=True)

    # --- stages -----------------------------------------------------------------------------------------------
    def stages(self) -> list[Stage]:
        d = self.design
        out = [
            Stage("model", lambda: (REPO / MODEL / "config.json").is_file(), self.convert),
            Stage("data", lambda: (REPO / self.data / "train.jsonl").is_file(), self.prepare),
            Stage("probe-set", lambda: (self.results / "probe_set.json").is_file(), self.draw),
            Stage("probe base", lambda: (self.results / "probe" / f"{BASE}.json").is_file(),
                  lambda: self.probe([(REPO / MODEL, BASE)])),
            Stage("eval base", lambda: (self.results / "eval" / f"{BASE}.json").is_file(),
                  lambda: self.evaluate(REPO / MODEL, BASE)),
        ]  # fmt: skip
        train = {run: Stage(f"train {run}", lambda run=run: self.trained(run), lambda run=run: self.train(run))
                 for _, _, run in d.runs()}  # fmt: skip
        probe = {run: Stage(f"probe {run}", lambda run=run: self.probed(run), lambda run=run: self.probe_run(run))
                 for _, _, run in d.runs()}  # fmt: skip
        evaluate = {
            run: Stage(f"eval {run}", lambda run=run: (self.results / "eval" / f"{run}.json").is_file(),
                       lambda run=run: self.evaluate(self.run_dir(run) / "hf", run))
            for _, _, run in d.runs()
        }  # fmt: skip
        # a seed pair at a time, all of it (both trainings, their probes, their evaluations): each finished pair is a
        # result; then PSR and NSR, whose evaluations come last (their claim is the probe's)
        for _, names in d.paired_runs():
            pair = list(names.values())
            out += [train[r] for r in pair] + [probe[r] for r in pair] + [evaluate[r] for r in pair]
        singles = [run for arm, _, run in d.runs() if arm in SINGLE_ARMS]
        out += [stage[r] for r in singles for stage in (train, probe)] + [evaluate[r] for r in singles]
        return out

    def convert(self) -> None:
        from megatron_rlvr.bridge.packaged import packaged_file

        self.cli("convert", "gguf-to-hf", str(packaged_file()), MODEL, threads=2)

    def prepare(self) -> None:
        d, data = self.design, str(self.data)
        eval_file, probe_file = f"{data}/eval/reasoning_gym.jsonl", f"{data}/probe/reasoning_gym.jsonl"
        # sizes above what is used: repeated questions are kept once (about 7% here)
        self.cli("data", "prepare", "reasoning-gym", *GYM, "--size", str(d.eval_problems + 32), "--seed", "100000",
                 "--out", eval_file)  # fmt: skip
        self.cli("data", "prepare", "reasoning-gym", *GYM, "--size", str(d.probe_prompts + 32), "--seed", "200000",
                 "--disjoint-from", eval_file, "--out", probe_file)  # fmt: skip
        self.cli("data", "prepare", "reasoning-gym", *GYM, "--size", "2000", "--seed", "1", "--disjoint-from",
                 eval_file, "--disjoint-from", probe_file, "--out", f"{data}/train.jsonl")  # fmt: skip

    def draw(self) -> None:
        d = self.design
        self.cli("probe", "draw", "--model", MODEL, "--data-dir", f"{self.data}/probe", "--limit", str(d.probe_prompts),
                 "--n", str(d.probe_samples), "--keep", str(d.probe_keep), "--chat-template",
                 "--max-new-tokens", "48", "--out", str(self.results / "probe_set.json"), threads=2)  # fmt: skip

    def run_dir(self, run: str) -> Path:
        return self.work / "runs" / run

    def exported(self, run: str) -> bool:
        """The run reached its last step: its HF export is written (a run stopped by a signal has none yet)."""
        return (self.run_dir(run) / "hf" / "config.json").is_file()

    def trained(self, run: str) -> bool:
        return self.exported(run) and (self.results / "runs" / run).is_dir()

    def train(self, run: str) -> None:
        d = self.design
        arm, seed = run.split("-s")
        recipe = RECIPE.format(loss="grpo" if arm in ("psr", "nsr") else arm)
        overrides = [
            f"trainer.seed={seed}",
            f"trainer.steps={d.steps}",
            f"trainer.output_dir={self.run_dir(run)}",
            f"data.path={self.data}/train.jsonl",
            f"model.hf_dir={MODEL}",
            f"checkpoint.save_every={d.probe_every}",
            "checkpoint.keep_last=0",  # every probed step stays until its probe is scored
            *d.extra.get("train", []),
            *([f"algo.loss.kind={arm}"] if arm in ("psr", "nsr") else []),
        ]
        self.cli("train", "--nproc-per-node", str(NPROC), recipe, *overrides)
        if not self.exported(run):
            return  # stopped early: the committed results hold finished runs only, and the driver stops on it
        (self.results / "runs" / run).mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.run_dir(run) / "metrics.jsonl", self.results / "runs" / run / "metrics.jsonl")

    def checkpoints(self, run: str) -> list[tuple[Path, str]]:
        """(checkpoint, probe label) of every probed step after 0; the last step is the HF export."""
        d, root = self.design, self.run_dir(run)
        steps = [s for s in d.probe_steps() if s > 0]
        return [
            (root / "hf" if s == d.steps else root / "checkpoints" / f"step-{s:06d}", probe_label(run, s))
            for s in steps
        ]

    def probed(self, run: str) -> bool:
        return all((self.results / "probe" / f"{label}.json").is_file() for _, label in self.checkpoints(run))

    def probe(self, checkpoints: list[tuple[Path, str]]) -> None:
        self.cli("probe", "score", "--nproc-per-node", str(NPROC), "--probe-set", str(self.results / "probe_set.json"),
                 "--checkpoint", *(str(c) for c, _ in checkpoints), "--label", *(label for _, label in checkpoints),
                 "--ks", *(str(k) for k in self.design.ks), "--out", str(self.results / "probe"))  # fmt: skip

    def probe_run(self, run: str) -> None:
        self.probe(self.checkpoints(run))
        if not self.keep:
            shutil.rmtree(self.run_dir(run) / "checkpoints", ignore_errors=True)

    def evaluate(self, model: Path, label: str) -> None:
        d = self.design
        per_request = max(1, 1024 // d.eval_samples) * d.eval_samples  # ~1,000 samples a request: a kill loses < 1
        self.cli("eval", "--model", str(model), "--label", label, "--benchmarks", "reasoning_gym",
                 "--data-dir", f"{self.data}/eval", "--limit", str(d.eval_problems), "--n", str(d.eval_samples),
                 "--chunk", str(d.eval_samples), "--request-samples", str(per_request), *SAMPLING,
                 "--max-model-len", "256", "--workers", "1", "--out", str(self.work / "eval"), threads=2)  # fmt: skip
        (self.results / "eval").mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.work / "eval" / label / "results.json", self.results / "eval" / f"{label}.json")

    # --- the fixed record ---------------------------------------------------------------------------------------
    def record(self) -> None:
        """experiment.json: the design, written once; a results folder of another design is refused."""
        path = self.results / "experiment.json"
        payload = {
            "design": self.design.to_json(),
            "model": MODEL,
            "recipe": RECIPE,
            "data": GYM,
            "work": str(self.work),
        }
        if path.is_file():
            recorded = json.loads(path.read_text())
            if recorded.get("design") != json.loads(json.dumps(payload["design"])):
                sys.exit(f"error: {path} records another design; use another --results folder")
            return
        self.results.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["status", "run", "report"])
    parser.add_argument("--results", default=None, help="the committed results folder (default results/casp-mechanism)")
    parser.add_argument("--work", default=None, help="samples, checkpoints, data (default outputs/<results name>)")
    parser.add_argument("--only", nargs="+", default=None, help="run only stages whose name starts with one of these")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the training checkpoints once probed")
    parser.add_argument("--smoke", action="store_true", help="the same stages at toy size, into outputs/")
    args = parser.parse_args(argv)
    design = SMOKE if args.smoke else Design()
    default = "outputs/casp-mechanism-smoke/results" if args.smoke else "results/casp-mechanism"
    results = Path(args.results or default).resolve()
    work = Path(args.work or f"outputs/{results.name if not args.smoke else 'casp-mechanism-smoke'}").resolve()
    if args.action == "report":
        from megatron_rlvr.inspection.mechanism_report import write_report

        for path in write_report(results):
            print(f"wrote {path}")
        return 0
    exp = Experiment(results, work, design, args.keep_checkpoints)
    stages = [s for s in exp.stages() if not args.only or any(s.name.startswith(o) for o in args.only)]
    if args.action == "status":
        for s in stages:
            print(f"{'done   ' if s.done() else 'pending'}  {s.name}")
        return 0
    exp.record()
    for stage in stages:
        if stage.done():
            print(f"[casp-mechanism] {stage.name}: done", flush=True)
            continue
        print(f"[casp-mechanism] {stage.name} ...", flush=True)
        exp.timed(stage)
    print(f"[casp-mechanism] every stage done; tables and figures: {sys.argv[0]} report --results {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
