"""Monitoring: metric sinks (metrics.jsonl, TensorBoard, W&B), candidate dynamics (rank-k probabilities and entropy
over steps, entropy histograms) and PNG plots. Plotting imports matplotlib only when called.
"""

from megatron_rlvr.monitor.dynamics import candidate_dynamics, histogram, series
from megatron_rlvr.monitor.sinks import METRICS_FILE, MetricLogger, read_metrics

__all__ = ["METRICS_FILE", "MetricLogger", "candidate_dynamics", "histogram", "read_metrics", "series"]
