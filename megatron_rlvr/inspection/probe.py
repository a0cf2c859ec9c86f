"""`megatron-rlvr probe`: a fixed probe of the candidate support, the same tokens for every checkpoint
(docs/casp-mechanism.md).

    megatron-rlvr probe draw --model BASE --data-dir DIR [--limit 128] [--n 64] [--keep 4] --out PROBE.json
    megatron-rlvr probe score --probe-set PROBE.json --checkpoint A [B ...] [--label a b ...] --out DIR
                              [--tp 1] [--pp 1] [--nproc-per-node N] [--ks 8 64] [--figure PNG]
    megatron-rlvr probe figure --scores DIR/a.json [DIR/b.json ...] --out PNG

``draw`` samples the base's responses to held-out prompts once and saves them with the base's forking positions
(probe_draw.py). ``score`` scores that set teacher-forced with each checkpoint (an HF directory or a megatron dist
checkpoint, e.g. a run's ``checkpoints/step-NNNNNN``) through the actor's passes at any TP x PP
(probe_scoring.py), and writes ``DIR/<label>.json`` per checkpoint (probe_summary.py): a rerun skips the
checkpoints whose file is current. ``figure`` draws the statistics of scores files over checkpoints.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from megatron_rlvr.errors import UserError
from megatron_rlvr.runtime import distributed


class ProbeArgumentError(UserError, ValueError):
    """A bad argument to `megatron-rlvr probe`: the message names it."""


def _draw(args: argparse.Namespace) -> int:
    from megatron_rlvr.inspection.probe_draw import DrawSettings, draw

    settings = DrawSettings(
        benchmark=args.benchmark,
        data_dir=args.data_dir,
        limit=args.limit,
        n=args.n,
        keep=args.keep,
        rare_max=args.rare_max,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        system_prompt=args.system_prompt,
        answer=args.answer,
        seed=args.seed,
        tau_q=args.tau_q,
        block_prompts=args.block_prompts,
    )
    started = time.monotonic()
    probe_set = draw(args.model, settings, args.out)
    rows = probe_set.rows
    probe_tokens = sum(len(r.ids) for r in rows if r.probe)
    forking = sum(len(r.forking) for r in rows)
    rare_prompts = sum(1 for p in probe_set.prompts if 1 <= p.correct <= settings.rare_max)
    print(
        f"probe set: {len(probe_set.prompts)} prompts, {sum(r.probe for r in rows)} probe responses "
        f"({probe_tokens} tokens, {forking} forking), {sum(r.rare for r in rows)} rare correct responses of "
        f"{rare_prompts} prompts; pass@1 of the base {sum(p.correct for p in probe_set.prompts) / (settings.n * len(probe_set.prompts)):.3f}; "
        f"{time.monotonic() - started:.0f} s -> {args.out} (digest {probe_set.digest()})",
        flush=True,
    )
    return 0


def _labels(args: argparse.Namespace) -> list[str]:
    if args.label is None:
        from megatron_rlvr.eval.api import model_tags

        return model_tags(args.checkpoint)
    if len(args.label) != len(args.checkpoint):
        raise ProbeArgumentError(f"--label: {len(args.label)} names for {len(args.checkpoint)} checkpoints")
    if len(set(args.label)) != len(args.label):
        raise ProbeArgumentError(f"--label: names must be distinct, got {args.label}")
    return list(args.label)


def _score(args: argparse.Namespace, argv: list[str]) -> int:
    if args.nproc_per_node is not None:
        return _start_ranks(args, argv)
    from megatron_rlvr.inspection import probe_set as probe_sets
    from megatron_rlvr.inspection.probe_scoring import ProbeScorer, checkpoint_kind
    from megatron_rlvr.inspection.probe_stats import check_ks
    from megatron_rlvr.inspection.probe_summary import is_current, load_scores, scores_json, summarize, write_scores

    probe_set = probe_sets.load(args.probe_set)
    labels = _labels(args)
    try:
        ks = check_ks(args.ks)
    except ValueError as e:
        raise ProbeArgumentError(f"--ks: {e}") from None
    for checkpoint in args.checkpoint:
        checkpoint_kind(checkpoint)  # every checkpoint readable before any model is built
    out = Path(args.out)
    settings = {"ks": list(ks), "temperature": args.temperature}
    todo = [
        (c, label)
        for c, label in zip(args.checkpoint, labels)
        if args.overwrite or not is_current(out / f"{label}.json", probe_set.digest(), settings)
    ]
    rank0 = os.environ.get("RANK", "0") == "0"  # before any process group: torchrun says which rank this is
    if todo:
        with ProbeScorer(
            todo[0][0],
            tp=args.tp,
            pp=args.pp,
            temperature=args.temperature,
            ks=ks,
            max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
        ) as scorer:
            batch = probe_set.batch(pad_id=0)  # packed streams end at each row's last token: the pad is never read
            rank0 = distributed.rank() == 0
            for checkpoint, label in todo:
                started = time.monotonic()
                scorer.load(checkpoint)
                loaded = time.monotonic()
                values = scorer.score(batch)
                seconds = {"load": round(loaded - started, 2), "score": round(time.monotonic() - loaded, 2)}
                if rank0:
                    summary = summarize(probe_set, values, ks)
                    layout = {"tp": args.tp, "pp": args.pp, "world": distributed.world_size()}
                    payload = scores_json(label, checkpoint, probe_set, summary, settings)
                    payload |= {"layout": layout, "seconds": seconds}
                    write_scores(out / f"{label}.json", payload)
                    means = summary["means"]
                    print(
                        f"[probe] {label}: rank-1 {means['all']['rank1']:.4f} (forking {means['forking']['rank1']:.4f}), "
                        f"entropy {means['all']['entropy']:.4f} (forking {means['forking']['entropy']:.4f}), "
                        f"E[distinct@{ks[0]}] {means['all'][f'distinct@{ks[0]}']:.3f}; "
                        f"load {seconds['load']:.1f} s, score {seconds['score']:.1f} s",
                        flush=True,
                    )
    if rank0:
        skipped = len(args.checkpoint) - len(todo)
        if skipped:
            print(f"[probe] {skipped} checkpoint(s) already scored in {out}", flush=True)
        if args.figure:
            from megatron_rlvr.inspection.probe_figure import render

            render([load_scores(out / f"{label}.json") for label in labels], args.figure)
            print(f"[probe] figure: {args.figure}", flush=True)
    return 0


def _start_ranks(args: argparse.Namespace, argv: list[str]) -> int:
    """`probe score --nproc-per-node N`: the same command on N ranks of this machine (torchrun --standalone)."""
    from megatron_rlvr.runtime.console import torchrun

    if "RANK" in os.environ:
        raise ProbeArgumentError("--nproc-per-node: this process is already a rank of a world (RANK is set)")
    if args.nproc_per_node < 1:
        raise ProbeArgumentError(f"--nproc-per-node: expected >= 1, got {args.nproc_per_node}")
    if args.nproc_per_node % (args.tp * args.pp):
        raise ProbeArgumentError(
            f"--nproc-per-node {args.nproc_per_node}: not a multiple of --tp x --pp = {args.tp * args.pp}"
        )
    rest, skip = [], False
    for arg in argv[1:]:  # the score arguments less --nproc-per-node N (or =N)
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            rest.append(arg)
    return torchrun(
        ["--standalone", f"--nproc-per-node={args.nproc_per_node}", "-m", "megatron_rlvr.cli", "probe", "score", *rest]
    )


def _figure(args: argparse.Namespace) -> int:
    from megatron_rlvr.inspection.probe_figure import render
    from megatron_rlvr.inspection.probe_summary import load_scores

    scores = [load_scores(p) for p in args.scores]
    if len({s["probe_set"] for s in scores}) > 1:
        raise ProbeArgumentError("--scores: the files score different probe sets; give files of one probe set")
    print(f"figure: {render(scores, args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rlvr probe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    d = sub.add_parser("draw", help="draw the probe set from the base model (once)")
    d.add_argument("--model", required=True, help="the base model's HF directory")
    d.add_argument("--benchmark", default="reasoning_gym", help="the held-out prompts' benchmark (eval's names)")
    d.add_argument("--data-dir", required=True, help="where the benchmark's file lies (as eval --data-dir)")
    d.add_argument("--limit", type=int, default=128, help="prompts: the file's first ones")
    d.add_argument("--n", type=int, default=64, help="samples per prompt")
    d.add_argument("--keep", type=int, default=4, help="the first KEEP samples of each prompt are probe responses")
    d.add_argument("--rare-max", type=int, default=4, help="prompts solved in 1..RARE_MAX of n give rare responses")
    d.add_argument("--temperature", type=float, default=1.0)
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.add_argument("--max-model-len", type=int, default=256)
    d.add_argument("--chat-template", action="store_true", help="wrap prompts in the tokenizer's chat template")
    d.add_argument("--system-prompt", default=None)
    d.add_argument("--answer", default="last_number", choices=["tagged", "last_number", "boxed"])
    d.add_argument("--seed", type=int, default=4321)
    d.add_argument("--tau-q", type=float, default=0.8, help="forking positions: entropy above this quantile")
    d.add_argument("--block-prompts", type=int, default=16, help="prompts per engine request and resumable block")
    d.add_argument("--out", required=True, help="the probe set (JSON)")
    s = sub.add_parser("score", help="score the probe set with checkpoints (teacher-forced)")
    s.add_argument("--probe-set", required=True)
    s.add_argument("--checkpoint", nargs="+", required=True, help="HF directories or megatron dist checkpoints")
    s.add_argument("--label", nargs="+", help="a name per checkpoint (its scores file's name)")
    s.add_argument("--out", required=True, help="directory of the scores files")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--pp", type=int, default=1)
    s.add_argument("--nproc-per-node", type=int, default=None, help="start N ranks on this machine (torchrun)")
    s.add_argument("--ks", type=int, nargs="+", default=[8, 64], help="K of E[distinct tokens in K draws]")
    s.add_argument("--temperature", type=float, default=1.0, help="of the scored distributions (the sampling's)")
    s.add_argument("--max-tokens-per-micro-batch", type=int, default=4096)
    s.add_argument("--overwrite", action="store_true", help="score again checkpoints that have a current file")
    s.add_argument("--figure", help="also draw the checkpoints' statistics into this PNG")
    f = sub.add_parser("figure", help="draw scores files' statistics over checkpoints")
    f.add_argument("--scores", nargs="+", required=True)
    f.add_argument("--out", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.action == "draw":
        return _draw(args)
    if args.action == "score":
        return _score(args, argv)
    return _figure(args)
