"""What the console shows: one line per user error, our own progress, and third-party chatter only when asked.

- A `UserError` (a config key, a data row, a file, a checkpoint, a model) prints ``error: <message>`` on stderr and
  the command exits 2, without a traceback; ``--debug`` or ``MEGATRON_RLVR_DEBUG=1`` adds the traceback. Under
  torchrun the first rank of a node to meet one prints the line (it claims a marker file beside the ranks' error
  files; the others stay silent), and every rank writes it to torchrun's error file (``TORCHELASTIC_ERROR_FILE``),
  so torchrun's failure report names it instead of "To enable traceback see ...". `torchrun` below is torchrun that
  then exits 2 without its report.
- vLLM, megatron-core, torch and transformers log INFO/WARNING lines (and Python warnings) on every step; they go to
  a log file only (``<run dir>/logs/<command>[-rank<r>].log``, where the command has a run directory) and reach the
  console from ERROR up. ``--verbose`` or ``MEGATRON_RLVR_VERBOSE=1`` shows them all. Until a command names its run
  directory (`attach_log_file`), records wait in memory; ``MEGATRON_RLVR_LOG_DIR`` names it for child processes.

The settings travel to child processes (torchrun ranks, vLLM workers) as environment variables: vLLM reads
``VLLM_CONFIGURE_LOGGING`` when it is imported, so `configure_environment` runs before any command imports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.handlers
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

DEBUG_ENV = "MEGATRON_RLVR_DEBUG"
VERBOSE_ENV = "MEGATRON_RLVR_VERBOSE"
LOG_DIR_ENV = "MEGATRON_RLVR_LOG_DIR"
# loggers whose INFO/WARNING lines stay off the console by default (prefixes of logger names)
THIRD_PARTY = ("vllm", "megatron.core", "torch", "transformers", "py.warnings", "nemo_run", "urllib3", "filelock")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MEMORY_RECORDS = 20_000  # records kept until the run directory is known (older ones are dropped)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def debug_enabled() -> bool:
    return _flag(DEBUG_ENV)


def verbose_enabled() -> bool:
    return _flag(VERBOSE_ENV)


def quiet_import_warnings() -> None:
    """Keep off the console what megatron-core announces once per process at import on a machine without optional
    GPU libraries (Apex, Transformer Engine missing; cuda_graph_scope). Call before it is imported."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope).*")


def configure_environment(debug: bool = False, verbose: bool = False) -> None:
    """Record --debug/--verbose for this process and its children; keep vLLM from installing its own console
    handler (its records then reach ours and are filtered). Call before vLLM is imported."""
    if debug:
        os.environ[DEBUG_ENV] = "1"
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    if not verbose_enabled():
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


class _ConsoleFilter(logging.Filter):
    """Third-party records below ERROR stay off the console (unless verbose); so do our own INFO lines on ranks
    other than 0 (every rank logs the same progress)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or verbose_enabled():
            return True
        if any(record.name == p or record.name.startswith(p + ".") for p in THIRD_PARTY):
            return False
        return record.levelno >= logging.WARNING or os.environ.get("RANK", "0") == "0"


class _Memory(logging.handlers.BufferingHandler):
    """Holds records until a log file is attached; drops the oldest beyond its capacity."""

    def shouldFlush(self, record: logging.LogRecord) -> bool:  # noqa: N802 - logging's API
        if len(self.buffer) > self.capacity:
            del self.buffer[: len(self.buffer) - self.capacity]
        return False


_state: dict[str, logging.Handler | None] = {"console": None, "memory": None, "file": None}
_names = {"command": "megatron-rlvr"}  # the log file's name: the command that set up the console


def setup_console(log_dir: str | Path | None = None, name: str | None = None) -> None:
    """Route logging: filtered console handler on stderr, everything at INFO to the log file (or memory until one
    is attached). Idempotent; ``log_dir`` (or $MEGATRON_RLVR_LOG_DIR) attaches the file at once."""
    configure_environment()
    if name:
        _names["command"] = name
    root = logging.getLogger()
    if _state["console"] is None:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(_FORMAT))
        console.addFilter(_ConsoleFilter())
        memory = _Memory(_MEMORY_RECORDS)
        for handler in list(root.handlers):  # a basicConfig made earlier would print everything twice
            root.removeHandler(handler)
        root.addHandler(console)
        root.addHandler(memory)
        root.setLevel(logging.INFO)
        logging.captureWarnings(True)
        _state["console"], _state["memory"] = console, memory
    directory = log_dir or os.environ.get(LOG_DIR_ENV)
    if directory:
        attach_log_file(directory, name)


def has_log_file() -> bool:
    return _state["file"] is not None


def attach_log_file(log_dir: str | Path, name: str | None = None) -> Path:
    """Send every record (and those held so far) to ``<log_dir>/logs/<name>[-rank<r>].log``; children inherit
    ``log_dir`` through $MEGATRON_RLVR_LOG_DIR. Returns the file's path."""
    if _state["console"] is None:
        setup_console()
    rank = os.environ.get("RANK")
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in (name or _names["command"]))
    path = Path(log_dir) / "logs" / (f"{name}-rank{rank}.log" if rank is not None else f"{name}.log")
    current = _state["file"]
    if isinstance(current, logging.FileHandler) and Path(current.baseFilename) == path.resolve():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    root = logging.getLogger()
    memory = _state["memory"]
    if memory is not None:
        for record in memory.buffer:
            handler.handle(record)
        memory.buffer.clear()
        root.removeHandler(memory)
        _state["memory"] = None
    if current is not None:
        root.removeHandler(current)
        current.close()
    root.addHandler(handler)
    _state["file"] = handler
    os.environ[LOG_DIR_ENV] = str(Path(log_dir))
    return path


_REPORTED_MARKER = "megatron-rlvr-user-error"  # in the directory of one torchrun attempt's per-rank error files


def _first_to_report() -> bool:
    """Whether this process prints its user error: always outside torchrun; under torchrun the first local rank to
    claim the attempt's marker file (torchrun keeps each rank's error file in ``<attempt dir>/<local rank>/``), so
    the rank that met the error first says it and the ranks failing after it (or on the same input) stay silent.
    Where that layout is not found, rank 0 alone."""
    rank = os.environ.get("RANK")
    if rank is None:
        return True
    error_file = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", ""))
    if error_file.name and error_file.parent.name == os.environ.get("LOCAL_RANK"):
        try:
            os.close(os.open(error_file.parent.parent / _REPORTED_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False
        except OSError:
            pass
    return int(rank) == 0


def report_user_error(exc: BaseException) -> int:
    """Print ``error: <message>`` once (the first rank to meet it), tell torchrun, return the exit status 2."""
    message = f"error: {exc}"
    if debug_enabled():
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if _first_to_report():
        print(message, file=sys.stderr, flush=True)
    _write_error_file(message)
    return 2


def _write_error_file(message: str) -> None:
    """Leave ``message`` where torchrun (or another launcher) looks for a process's error: $TORCHELASTIC_ERROR_FILE."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # whole or absent, never empty: nemo-run's local scheduler parses this file on every poll of a running task,
        # and met it truncated (opened, not yet written) in a traceback printed above the user's line
        tmp = f"{error_file}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
            os.replace(tmp, error_file)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            # the launcher then reports the exit status alone


def torchrun(argv: list[str]) -> int:
    """torchrun (same arguments), exiting 2 without its failure report when every failed rank failed on a user error
    (a rank has printed the line): what ``megatron-rlvr train --nproc-per-node N`` runs, and
    ``python -m megatron_rlvr.runtime.console --nproc-per-node 2 -m megatron_rlvr.cli train ...``. The agent's own
    log lines ("Sending process ... closing signal", "failed (exitcode: 2)") stay off the console unless --verbose.

    SIGTERM, SIGINT and SIGUSR1 are not torchrun's to handle here: a `StopRelay` passes them on to the ranks and
    waits for the checkpoint of the step in flight (runtime/stop_relay.py); the exit status is then the ranks' (0),
    or 128 + the signal when a second signal or $MEGATRON_RLVR_STOP_TIMEOUT stopped them first. Any other failure
    keeps torchrun's report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from megatron_rlvr.runtime.stop_relay import STOP_SIGNALS, StoppedBeforeStart, StopRelay

    if not verbose_enabled():
        for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
            agent_log = logging.getLogger(name)
            agent_log.addHandler(logging.NullHandler())
            agent_log.propagate = False
    args = get_args_parser().parse_args(argv)
    ours = {s.name for s in STOP_SIGNALS}
    # the agent registers a handler for each signal it is told to handle: left to it, ours would be replaced
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() not in ours)
    with StopRelay.installed() as relay:
        try:
            run(args)
        except StoppedBeforeStart as e:
            print(f"[launch] {e}: nothing to stop", file=sys.stderr, flush=True)
            return 128 + e.signum
        except ChildFailedError as e:
            if relay.forced:  # the ranks were stopped at once: the relay said so, torchrun's report adds nothing
                return relay.exit_status
            stopped = _stopped_by_signal(e, relay.signum)
            if stopped:
                print(f"[launch] {stopped}", file=sys.stderr, flush=True)
                return relay.exit_status
            return _user_error_status(e)
    return 0


def _stopped_by_signal(error, signum: int) -> str | None:
    """What to say when a stop request (``signum``) ended ranks that could not take it as one (outside a training
    step: still importing, or an eval): every failed rank died of the signal sent to it. None otherwise."""
    if not signum:
        return None
    from megatron_rlvr.runtime.stop_relay import TO_RANKS

    sent = TO_RANKS[signal.Signals(signum)]
    if not all(f.exitcode in (-sent, 128 + sent) for f in error.failures.values()):
        return None
    return (
        f"{signal.Signals(signum).name}: the ranks ended on it (outside a training step there is nothing to checkpoint)"
    )


def _user_error_status(e) -> int:
    """2 (the line was said, by a rank) when every failed rank failed on a user error or was stopped after the first
    did; else torchrun's report (the exception again)."""

    def user_error(failure) -> bool:
        return isinstance(failure.message, str) and failure.message.startswith("error: ")

    # The first rank to fail is the root cause; torchrun then SIGTERMs the others, which may not have reached
    # the same error yet: those count as collateral, anything else keeps the report.
    _, first = e.get_first_failure()
    terminated = -signal.SIGTERM
    if user_error(first) and all(user_error(f) or f.exitcode == terminated for f in e.failures.values()):
        _write_error_file(first.message)  # for whoever started this process (a nemo-run local job)
        return 2
    raise e


if __name__ == "__main__":
    sys.exit(torchrun(sys.argv[1:]))
