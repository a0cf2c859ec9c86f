"""Metric sinks: one ``log(step, metrics)`` call writes metrics.jsonl, TensorBoard and (when configured) W&B.

metrics.jsonl holds one JSON object per logged step, ``{"step": s, ...}``; non-finite values are written as null so
the file stays strict JSON. Resuming a run at step s drops the lines after s that a killed run left behind, so the
file then equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
HISTOGRAMS_FILE = "histograms.jsonl"


def _plain(value: Any) -> Any:
    """A JSON-safe scalar: floats that are NaN/inf become None; tensors and numpy scalars become Python numbers."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricLogger:
    """Writes each step's metrics to ``output_dir``. Call ``close()`` at the end (or use it as a context manager)."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        resume_step: int | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILE
        self.hist_path = self.output_dir / HISTOGRAMS_FILE
        if resume_step is not None:
            for path in (self.path, self.hist_path):
                drop_after(path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                logger.warning(
                    "trainer.wandb_project=%r but the wandb package is not installed; W&B logging is off", wandb_project
                )
            else:
                self._wandb = wandb.init(
                    project=wandb_project,
                    name=run_name,
                    config=dict(config or {}),
                    dir=str(self.output_dir),
                    resume="allow",
                )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (names -> numbers) for ``step``; flushed at once, so a killed run loses nothing."""
        record = {"step": int(step)}
        record.update({k: _plain(v) for k, v in metrics.items() if k != "step"})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=int(step))

    def log_histogram(
        self,
        step: int,
        name: str,
        values: Sequence[float],
        bins: int = 50,
        value_range: tuple[float, float] | None = None,
    ) -> dict[str, Any]:
        """Histogram of ``values`` (e.g. per-token entropies at an eval step) to histograms.jsonl and TensorBoard."""
        from megatron_rlvr.monitor.dynamics import histogram

        record = {"step": int(step), "name": name, **histogram(values, bins=bins, value_range=value_range)}
        with open(self.hist_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            import numpy as np

            self._tb.add_histogram(name, np.asarray(values, dtype=np.float64), step)
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Histogram(list(values))}, step=int(step))
        return record

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (or histograms.jsonl); a damaged line is an error naming file and line."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                # A run killed mid-write can leave a partial last line; anything else is damage worth naming.
                if not line.endswith("\n"):
                    logger.warning("%s:%d: partial last line ignored", path, line_no)
                    continue
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
    return records


def drop_after(path: Path, step: int) -> None:
    """Rewrite ``path`` keeping only records with step <= ``step`` (atomically: temp file + rename)."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
