"""The CPU demo: `megatron-rlvr demo` (command.py) trains the shipped tiny Qwen2 model (model/, built by
tools/reports/make_demo_model.py; weak_model/ is a weaker one for outer prefixes) on the countdown task (tasks/countdown.py),
evaluates base and trained model and writes a report (report.py); `demo report --runs` tabulates several runs
(multi_run.py); sampling.py samples with plain transformers for quick measurements.
"""

from pathlib import Path

MODEL_DIR = str(Path(__file__).resolve().parent / "model")  # HF checkpoint: config, safetensors, tokenizer
REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "demo_cpu.yaml"  # the demo's training recipe, what multi-run overrides are measured against

__all__ = ["MODEL_DIR", "RECIPE", "REPO"]
