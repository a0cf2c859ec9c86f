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

A response never reads KV that other weights computed for another request (prefix_cache.py): each vLLM request
carries the prefix-cache salt of the weights loaded when it was added, and a response that has not sampled a token
when new weights arrive (waiting in vLLM's queue for KV space, or part-way through a chunked prefill) is restarted
under the new salt before the next step, with the same seed, so it samples what it would have sampled had it been
added after the update. Only a response that already sampled keeps reading its own older KV (the "keep" above).

A request is one prompt with ``n`` responses, added to vLLM as ``n`` requests of one response each, the j-th seeded
``seed + j``: exactly the children ``LLM.generate`` fans a request of ``n`` out into (vLLM's parallel sampling), so a
group streamed alone is the group ``generate`` samples, and each response can be restarted alone. Output is vLLM's
DELTA kind: each step reports only the tokens it sampled, which is what lets the caller tag every token with the
weights that produced it. `request_params` is the one place a `Sampling` becomes vLLM's SamplingParams (generate
uses it too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rlvr.rollout.base import PrefixCacheCounts, Progress, Sampling
from megatron_rlvr.rollout.prefix_cache import WeightEpoch


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


@dataclass
class _Response:
    """One response of a request in flight: what it takes to add it to vLLM again under new weights."""

    key: str  # the caller's request
    index: int  # which of its responses
    prompt: list[int]
    params: Any  # vLLM's SamplingParams of this response alone
    loads: int = 0  # the weight load whose prefix-cache namespace it was added in
    started: bool = False  # it sampled a token: it holds KV of its own and is never restarted


class VLLMStream:
    """The engine's requests in flight, advanced one engine step at a time (see the module doc). Made by
    `VLLMEngine.stream`, which shares its `WeightEpoch`; ``fail`` turns an exception inside vLLM into the engine's
    death (EngineDiedError)."""

    def __init__(
        self,
        llm: Any,
        vocab: int,
        max_model_len: int,
        fail: Callable[[str, BaseException], Exception],
        epoch: WeightEpoch,
        stop_token_ids: tuple[int, ...] = (),
    ):
        self._engine = llm.llm_engine
        self._stop_token_ids = stop_token_ids
        self._vocab, self._max_model_len, self._fail = vocab, max_model_len, fail
        self._epoch = epoch
        self._requests: dict[str, int] = {}  # key -> responses still running
        self._live: dict[str, _Response] = {}  # vLLM request id -> response
        self._added = 0  # vLLM request ids are never reused: a restarted response gets a new one
        self._counts = PrefixCacheCounts()

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
        for j in range(n):
            self._add(_Response(key, j, list(prompt_token_ids), _alone(params, j)))
        self._requests[key] = n

    def _add(self, response: _Response) -> None:
        request_id = f"{response.key}#{response.index}#{self._added}"
        self._added += 1
        response.loads = self._epoch.loads
        try:
            self._engine.add_request(request_id, self._epoch.prompt(response.prompt), response.params)
        except Exception as e:
            raise self._fail("stream.submit", e) from e
        self._live[request_id] = response

    def _restart_unstarted(self) -> None:
        """Responses added under older weights that have not sampled yet start again under the current ones."""
        stale = [rid for rid, r in self._live.items() if not r.started and r.loads != self._epoch.loads]
        if not stale:
            return
        try:
            self._engine.abort_request(stale)
        except Exception as e:
            raise self._fail("stream.step", e) from e
        for rid in stale:
            self._add(self._live.pop(rid))

    def step(self) -> list[Progress]:
        """One engine step (nothing when no request is in flight): what it sampled, per response."""
        if not self._requests:
            return []
        self._restart_unstarted()
        try:
            outputs = self._engine.step()
        except Exception as e:
            raise self._fail("stream.step", e) from e
        news = []
        for out in outputs:
            response = self._live[out.request_id]
            for c in out.outputs:
                logprobs = [step[tok].logprob for step, tok in zip(c.logprobs or [], c.token_ids)]
                if c.logprobs is not None and len(logprobs) != len(c.token_ids):
                    raise RuntimeError(f"vLLM reported {len(logprobs)} log-probs for {len(c.token_ids)} tokens")
                if c.finish_reason not in (None, "stop", "length"):
                    raise RuntimeError(f"vLLM finished a response with reason {c.finish_reason!r}")
                if not response.started and (c.token_ids or c.finish_reason):
                    response.started = True
                    self._counts.add(PrefixCacheCounts(len(response.prompt), out.num_cached_tokens or 0))
                news.append(
                    Progress(response.key, response.index, list(c.token_ids), logprobs, c.text, c.finish_reason)
                )
                if c.finish_reason is not None:
                    del self._live[out.request_id]
                    self._requests[response.key] -= 1
                    if not self._requests[response.key]:
                        del self._requests[response.key]
        return news

    def in_flight(self) -> int:
        """Requests (prompts) with a response still running."""
        return len(self._requests)

    def refresh_kv(self) -> None:
        """Recompute the KV cache of every running request with the weights now loaded (at its next step), and empty
        the prefix cache: call after `VLLMEngine.update_weights` (see the module doc)."""
        try:
            emptied = self._engine.reset_prefix_cache(reset_running_requests=True)
        except Exception as e:
            raise self._fail("stream.refresh_kv", e) from e
        if not emptied:  # with every running request preempted no block is in use; anything else is a vLLM change
            raise RuntimeError("stream.refresh_kv: vLLM kept its prefix cache after preempting the running requests")

    def cancel(self) -> None:
        """Abort every request in flight (what they sampled so far is the caller's)."""
        if self._live:
            self._engine.abort_request(list(self._live))
        self._live.clear()
        self._requests.clear()

    def take_prefix_cache_counts(self) -> PrefixCacheCounts:
        """Prompt tokens of the responses that started since the last call, and how many came from cached blocks."""
        counts, self._counts = self._counts, PrefixCacheCounts()
        return counts


def _alone(params: Any, index: int) -> Any:
    """Response ``index`` of a request of ``params.n`` as a request of its own: vLLM's parallel sampling's child (one
    response, seed + index)."""
    child = copy.copy(params)
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child
