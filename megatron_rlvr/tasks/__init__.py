"""Synthetic tasks shared by data (prompt generation), rewards (their verifiers' format) and eval (benchmarks):
today the countdown task of the demo (countdown.py)."""
