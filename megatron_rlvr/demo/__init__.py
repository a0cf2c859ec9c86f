"""The embedded demo: the countdown task (task.py), its committed tiny Qwen2 model and tokenizer (model/, built by
tools/make_demo_model.py), HF-side sampling for quick measurements (sampling.py) and the report writer (report.py).
"""

from pathlib import Path

MODEL_DIR = str(Path(__file__).resolve().parent / "model")  # HF checkpoint: config, safetensors, tokenizer

__all__ = ["MODEL_DIR"]
