"""`VLLMStream`: a vLLM engine driven one engine step at a time (vLLM 0.32's ``LLMEngine.add_request`` / ``step`` /
``abort_request``), the `StreamingEngine` protocol (base.py) that fully asynchronous training runs on
(docs/async.md).

Between two steps nothing runs inside the engine, so new weights can go in there (`VLLMEngine.update_weights`) while
responses are in flight: they continue with the new weights. That is vLLM's "keep" mode of
``pause_generation``, without a pause: the in-process engine only computes inside ``step``. The KV cache of the
tokens before the update stays as the older weights computed it, unless `refresh_kv` drops it: every running
request is then preempted and vLLM recomputes its prompt and generated tokens with the new weights at its next step
(``reset_prefix_cache(reset_running_requests=True)``; the request keeps its sampled tokens, log-probs and random
generator), and the prefix cache is emptied. Either way each token's log-prob is the one of the distribution it was
sampled from; with `refresh_kv` that distribution is exactly the new weights' given the whole prefix.

A request is one prompt with ``n`` responses (vLLM fans it out into n children seeded ``seed + j``, exactly as
``LLM.generate`` does, so a group streamed alone is the group ``generate`` samples). Output is vLLM's DELTA kind:
each step reports only the tokens it sampled, which is what lets the caller tag every token with the weights that
produced it. `request_params` is the one place a `Sampling` becomes vLLM's SamplingParams (generate uses it too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rlvr.rollout.base import Progress, Sampling


def request_params(
    sampling: Sampling, *, n: int, seed: int | None, delta: bool = False, stop_token_ids: tuple[int, ...] = ()
) -> Any:
    """vLLM's SamplingParams for ``n`` responses to one prompt with ``sampling`` and the prompt's own ``seed``;
    ``delta``: each step reports only its new tokens (streaming); ``stop_token_ids``: the engine's own stops (a chat
    template's end of turn), kept as a response's last token."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0 if sampling.top_k in (-1, 0) else sampling.top_k,
        max_tokens=sampling.max_tokens,
        min_tokens=sampling.min_tokens,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(stop_token_ids) or None,
        seed=seed,
        logprobs=0 if sampling.logprobs else None,  # 0 = only the sampled token's log-prob
        output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE,
    )


class VLLMStream:
    """The engine's requests in flight, advanced one engine step at a time (see the module doc). Made by
    `VLLMEngine.stream`; ``fail`` turns an exception inside vLLM into the engine's death (EngineDiedError)."""

    def __init__(
        self,
        llm: Any,
        vocab: int,
        max_model_len: int,
        fail: Callable[[str, BaseException], Exception],
        stop_token_ids: tuple[int, ...] = (),
    ):
        self._engine = llm.llm_engine
        self._stop_token_ids = stop_token_ids
        self._vocab, self._max_model_len, self._fail = vocab, max_model_len, fail
        self._requests: dict[str, int] = {}  # key -> responses still running

    def submit(self, key: str, prompt_token_ids: list[int], n: int, sampling: Sampling) -> None:
        """Start ``n`` responses to one prompt under ``key`` (unique among the requests in flight); ``sampling.seed``
        seeds the first response, ``seed + j`` the j-th."""
        if key in self._requests:
            raise ValueError(f"stream.submit: request {key!r} is in flight already")
        if not prompt_token_ids or any(not 0 <= t < self._vocab for t in prompt_token_ids):
            raise ValueError(f"stream.submit: request {key!r}: empty prompt or ids outside [0, {self._vocab})")
        if len(prompt_token_ids) + sampling.max_tokens > self._max_model_len:
            raise ValueError(
                f"stream.submit: request {key!r} has {len(prompt_token_ids)} tokens; with max_tokens="
                f"{sampling.max_tokens} that exceeds rollout.max_model_len={self._max_model_len}"
            )
        params = request_params(sampling, n=n, seed=sampling.seed, delta=True, stop_token_ids=self._stop_token_ids)
        try:
            self._engine.add_request(key, {"prompt_token_ids": list(prompt_token_ids)}, params)
        except Exception as e:
            raise self._fail("stream.submit", e) from e
        self._requests[key] = n

    def step(self) -> list[Progress]:
        """One engine step (nothing when no request is in flight): what it sampled, per response."""
        if not self._requests:
            return []
        try:
            outputs = self._engine.step()
        except Exception as e:
            raise self._fail("stream.step", e) from e
        news = []
        for out in outputs:
            for c in out.outputs:
                logprobs = [step[tok].logprob for step, tok in zip(c.logprobs or [], c.token_ids)]
                if c.logprobs is not None and len(logprobs) != len(c.token_ids):
                    raise RuntimeError(f"vLLM reported {len(logprobs)} log-probs for {len(c.token_ids)} tokens")
                if c.finish_reason not in (None, "stop", "length"):
                    raise RuntimeError(f"vLLM finished a response with reason {c.finish_reason!r}")
                news.append(Progress(out.request_id, c.index, list(c.token_ids), logprobs, c.text, c.finish_reason))
                if c.finish_reason is not None:
                    self._requests[out.request_id] -= 1
                    if not self._requests[out.request_id]:
                        del self._requests[out.request_id]
        return news

    def in_flight(self) -> int:
        """Requests (prompts) with a response still running."""
        return len(self._requests)

    def refresh_kv(self) -> None:
        """Recompute the KV cache of every running request with the weights now loaded (at its next step), and empty
        the prefix cache: call after `VLLMEngine.update_weights` (see the module doc)."""
        try:
            self._engine.reset_prefix_cache(reset_running_requests=True)
        except Exception as e:
            raise self._fail("stream.refresh_kv", e) from e

    def cancel(self) -> None:
        """Abort every request in flight (what they sampled so far is the caller's)."""
        if self._requests:
            self._engine.abort_request(list(self._requests))
            self._requests.clear()
