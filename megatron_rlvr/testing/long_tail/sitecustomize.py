"""A workload hook for benchmarks and tests of fully asynchronous training (docs/async.md): with this directory on
PYTHONPATH and MEGATRON_RLVR_LONG_TAIL="MEDIAN,SIGMA" set, every prompt's answers are exactly L tokens long, L drawn
per prompt from a log-normal distribution (median MEDIAN tokens, log-space spread SIGMA) by the prompt's sampling seed
and cut to the answer budget (rollout.max_new_tokens). The demo model ends most answers after ~8 tokens; this gives
the long tail of reasoning responses instead. It sets vLLM's min_tokens = max_tokens = L where `rollout.vllm_stream.
request_params` builds a prompt's sampling parameters (the step path's `generate` and the stream both build them
there), so a prompt gets the same L in every mode. Nothing else changes; the engine's log-probs are then those of the
distribution without EOS before L (vLLM's processed log-probs), as with rollout.min_new_tokens.

"MEDIAN,SIGMA,DELAY" also makes every engine step (vLLM's `LLMEngine.step`, which the stream calls once per step and
`LLM.generate` in a loop) take DELAY seconds longer, whatever its batch. Tests use it as a forced slow engine, so
that weight updates land while responses are in flight however fast the machine is (on an idle machine the demo
model finishes its answers before the trainer's next update). The benchmark uses it to give the engine a GPU's cost
shape: a decode step of a large model on a GPU is bound by reading the weights, so it costs nearly the same for 1
sequence as for 256, while a CPU step of the tiny demo model costs in proportion to its batch."""

import math
import os
import random
import sys
import time

from megatron_rlvr.testing.import_hooks import patch_after_import

_SPEC = os.environ.get("MEGATRON_RLVR_LONG_TAIL", "")
_MODULE = "megatron_rlvr.rollout.vllm_stream"


def length(seed: int, budget: int, median: float, sigma: float) -> int:
    return max(1, min(budget, int(round(random.Random(seed).lognormvariate(math.log(median), sigma)))))


def _long_tailed(request_params, median: float, sigma: float):
    def with_length(sampling, *, n, seed, **options):
        params = request_params(sampling, n=n, seed=seed, **options)
        if seed is not None:
            params.min_tokens = params.max_tokens = length(seed, sampling.max_tokens, median, sigma)
        return params

    return with_length


def _slowed(step, delay: float):
    def slow_step(self):
        time.sleep(delay)
        return step(self)

    return slow_step


def _patch(module, median: float, sigma: float, delay: float) -> None:
    module.request_params = _long_tailed(module.request_params, median, sigma)
    if delay > 0:
        from vllm.v1.engine.llm_engine import LLMEngine

        LLMEngine.step = _slowed(LLMEngine.step, delay)
    print(
        f"[long-tail] answers of log-normal length: median {median:g} tokens, sigma {sigma:g}; "
        f"{delay:g} s added to each engine step",
        file=sys.stderr,
        flush=True,
    )


if _SPEC:
    _median, _sigma, _delay = ([float(x) for x in _SPEC.split(",")] + [0.0])[:3]
    patch_after_import(_MODULE, lambda module: _patch(module, _median, _sigma, _delay))
