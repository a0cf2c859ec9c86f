"""Helpers for tests and CPU benchmarks: gloo worker groups with hard timeouts (workers.py), tiny random HF
checkpoints made locally, nothing downloaded (tiny_models.py), and tiny GGUF files written from them the way
llama.cpp writes its own (tiny_gguf.py). Nothing in the training path imports this package."""
