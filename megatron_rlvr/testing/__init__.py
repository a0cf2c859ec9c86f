"""Helpers for tests and CPU benchmarks: gloo worker groups with hard timeouts (workers.py) and tiny random HF
checkpoints made locally, nothing downloaded (tiny_models.py). Nothing in the training path imports this package."""
