"""`megatron-rlvr` command line: train | eval | convert | demo | candidates | toy-tree | probe | plan | data | ckpt |
config.

Each subcommand imports its implementation lazily, so `megatron-rlvr --help` is instant and a failure in one
component never breaks the others' commands.

Global flags, before the command: ``--debug`` (tracebacks for user errors; also MEGATRON_RLVR_DEBUG=1) and
``--verbose`` (vLLM / megatron-core INFO and WARNING lines on the console; also MEGATRON_RLVR_VERBOSE=1). A
`UserError` raised anywhere in a command prints one line ``error: ...`` and exits 2 (see runtime/console.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from megatron_rlvr.errors import UserError

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("megatron_rlvr.trainer", "main", "train with a YAML recipe and key=value overrides (under torchrun)"),
    "eval": ("megatron_rlvr.eval.command", "main", "large-K pass@k evaluation of one or more HF models"),
    "convert": ("megatron_rlvr.bridge.convert", "main", "convert checkpoints: hf-to-mcore | mcore-to-hf | gguf-to-hf"),
    "demo": ("megatron_rlvr.demo.command", "main", "the CPU demo: CaSP on the countdown task, then a pass@k report"),
    "candidates": (
        "megatron_rlvr.inspection.candidates",
        "main",
        "per response token, the top-N candidates of one or more models as one heatmap (PNG)",
    ),
    "toy-tree": (
        "megatron_rlvr.inspection.toy_tree",
        "main",
        "the didactic tree MDP: GRPO vs entropy bonus vs CaSP (fixed and adaptive candidates)",
    ),
    "probe": (
        "megatron_rlvr.inspection.probe",
        "main",
        "a fixed probe: score base-model responses teacher-forced with each checkpoint (rank-1, entropy, ...)",
    ),
    "plan": ("megatron_rlvr.plan.command", "main", "per-GPU memory of a recipe's layout, before it is queued"),
    "estimate": (
        "megatron_rlvr.recipes.estimate",
        "main",
        "an eval recipe's samples, tokens, time and interval width, before it is queued",
    ),
    "data": ("megatron_rlvr.data.prepare", "main", "data prepare NAME: training sets from the public releases"),
    "ckpt": ("megatron_rlvr.checkpoint.command", "main", "ckpt verify DIR: check a checkpoint's recorded checksums"),
    "config": ("megatron_rlvr.config.explain", "main", "config explain KEY: a config key's doc, default and limits"),
}


def _resolve(name: str) -> Callable[[list[str]], int]:
    module_name, attr, _ = _COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module_name or module_name.startswith(e.name + ".")):
            raise SystemExit(f"megatron-rlvr {name}: not available in this build ({module_name} is missing)") from e
        raise
    return getattr(module, attr)


_GLOBAL_FLAGS = ("--debug", "--verbose")


def main(argv: list[str] | None = None, resolve: Callable[[str], Callable[[list[str]], int]] = _resolve) -> int:
    """Run one subcommand; ``resolve`` maps its name to its implementation (default: the lazy import above)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from megatron_rlvr.runtime import console

    console.quiet_import_warnings()
    parser = argparse.ArgumentParser(
        prog="megatron-rlvr",
        description="RLVR training on megatron-core with CaSP.",
        epilog="Run `megatron-rlvr COMMAND --help` for a command's options.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors [$MEGATRON_RLVR_DEBUG]")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM / megatron-core INFO and WARNING lines [$MEGATRON_RLVR_VERBOSE]",
    )
    parser.add_argument(
        "command", choices=sorted(_COMMANDS), help="; ".join(f"{k}: {v[2]}" for k, v in _COMMANDS.items())
    )
    flags = []
    while argv and argv[0] in _GLOBAL_FLAGS:
        flags.append(argv.pop(0))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(flags + argv[:1])
    # before the command imports vLLM (it reads its logging settings at import)
    console.configure_environment(debug=args.debug, verbose=args.verbose)
    console.setup_console(name=args.command)
    try:
        return int(resolve(args.command)(argv[1:]) or 0)
    except UserError as e:
        return console.report_user_error(e)


if __name__ == "__main__":
    sys.exit(main())
