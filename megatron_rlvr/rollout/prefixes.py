"""Outer prefixes: part of each group continues a weaker model's partial answer (docs/algorithms.md, "Outer prefixes").

`PrefixedEngine(target, weak, fraction, cut, decode=...)` is a `RolloutEngine`. For each prompt and its ``n``
samples, ``k = round(fraction * n)`` (halves round up) samples are prefixed, the other ``n - k`` are the target's
plain samples (same call, same seed as without the wrapper). A prefixed sample:

1. the weak engine answers the prompt (``k`` answers per prompt, the call's sampling, a seed derived from its seed);
2. the answer is cut after ``p = floor(u * L)`` tokens, ``u`` uniform in ``cut`` (seeded from the call's seed, the
   prompt's position and the sample index: deterministic, like the engines' own sampling, so a resumed run draws
   the same prefixes), ``L`` its length without the token that ended it (EOS, or the token that completed a stop
   string), so a prefix never holds an EOS or a whole stop string. The cut moves left while the prefix's text ends in
   a split character or in the start of a stop string: no stop string spans the seam (the target engine sees only
   its own text when it looks for one) and the text below equals decoding the whole. ``p <= max_tokens - 1``: the
   target writes at least one token. A short answer can give ``p = 0`` (a plain sample, ``prefix_len = 0``);
3. the target continues from prompt + prefix with budget ``max_tokens - p`` (prompt + response stays within what
   the plain samples may use). Continuations sharing a budget go in one call, each call seeded from the call's seed
   and its budget.

The result carries ``token_ids = prefix + continuation``, ``logprobs`` likewise (the prefix's from the weak engine),
``text = decode(prefix) + continuation text``, the continuation's ``finish_reason`` and ``prefix_len = p``; the
prefixed samples come last in their group. The prefix is context: experience.to_rollouts masks it out of the loss.

Weights, sleep and wake go to the target only: the weak model is frozen. `without_prefixes(engine)` is the target
alone, for what measures the model itself (validation, PBA's base evidence).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlvr.models.hf_config import read_hf_config
from megatron_rlvr.models.tokenizer_check import TokenizerMismatch, check_same_tokenizer
from megatron_rlvr.rollout.base import Completion, RolloutEngine, Sampling

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


def prefixed_count(fraction: float, n: int) -> int:
    """Samples of a group of ``n`` that start from a weak prefix: round(fraction * n), halves up (Python's round
    would give 0 for 0.25 * 2)."""
    return min(n, int(math.floor(fraction * n + 0.5)))


def derived_seed(seed: int | None, tag: str) -> int | None:
    """A seed for one part of a call (weak answers, cuts, one continuation budget), a function of the call's seed."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}/{tag}".encode()).digest()[:4], "big") % 2**31


class PrefixedEngine:
    """The target engine, with a ``fraction`` share of each group continuing a weak engine's cut answer."""

    def __init__(
        self,
        target: RolloutEngine,
        weak: RolloutEngine,
        fraction: float,
        cut: Sequence[float],
        *,
        decode: Callable[[list[int]], str],
    ) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"rollout.prefix_fraction: expected a share in [0, 1], got {fraction!r}")
        if len(cut) != 2 or not 0 <= cut[0] <= cut[1] <= 1:
            raise ValueError(f"rollout.prefix_cut: expected a range [lo, hi] with 0 <= lo <= hi <= 1, got {cut!r}")
        self.target, self.weak = target, weak
        self.fraction, self.cut = float(fraction), (float(cut[0]), float(cut[1]))
        self.decode = decode

    # ---------------------------------------------------------------------------------------------- generate

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        k = prefixed_count(self.fraction, n)
        plain = self.target.generate(prompt_token_ids, n - k, sampling) if k < n else [[] for _ in prompt_token_ids]
        if k == 0:
            return plain
        weak_sampling = replace(sampling, seed=derived_seed(sampling.seed, "weak"))
        answers = self.weak.generate(prompt_token_ids, k, weak_sampling)
        cut_seed = derived_seed(sampling.seed, "cut")
        # (prompt index, sample index) -> (prefix ids, prefix log-probs, prefix text)
        prefixes: dict[tuple[int, int], tuple[list[int], list[float], str]] = {}
        for i, group in enumerate(answers):
            for j, answer in enumerate(group):
                rng = random.Random(f"{cut_seed}/{i}/{j}") if cut_seed is not None else random.Random()
                p = self._cut(answer, rng.uniform(*self.cut), sampling)
                prefixes[i, j] = (answer.token_ids[:p], answer.logprobs[:p], self.decode(answer.token_ids[:p]))
        by_budget: dict[int, list[tuple[int, int]]] = {}
        for (i, j), (ids, _, _) in prefixes.items():
            by_budget.setdefault(sampling.max_tokens - len(ids), []).append((i, j))
        continued: dict[tuple[int, int], Completion] = {}
        for budget in sorted(by_budget):
            keys = by_budget[budget]
            call = replace(
                sampling,
                max_tokens=budget,
                seed=derived_seed(sampling.seed, f"continue/{budget}"),
                min_tokens=max(0, sampling.min_tokens - (sampling.max_tokens - budget)),
            )
            outs = self.target.generate([list(prompt_token_ids[i]) + prefixes[i, j][0] for i, j in keys], 1, call)
            for key, out in zip(keys, outs):
                continued[key] = out[0]
        result = []
        for i, group in enumerate(plain):
            group = list(group)
            for j in range(k):
                ids, logprobs, text = prefixes[i, j]
                c = continued[i, j]
                group.append(
                    Completion(
                        token_ids=ids + list(c.token_ids),
                        logprobs=(logprobs + list(c.logprobs)) if sampling.logprobs else [],
                        text=text + c.text,
                        finish_reason=c.finish_reason,
                        prefix_len=len(ids),
                    )
                )
            result.append(group)
        return result

    def _cut(self, answer: Completion, u: float, sampling: Sampling) -> int:
        """Prefix length for one weak answer at cut fraction ``u`` (see the module doc)."""
        ids = answer.token_ids
        length = len(ids) - 1 if answer.finish_reason == "stop" and ids else len(ids)
        p = min(int(math.floor(u * length)), sampling.max_tokens - 1)
        while p > 0 and not self._clean(self.decode(ids[:p]), sampling.stop):
            p -= 1
        return max(p, 0)

    @staticmethod
    def _clean(text: str, stops: Sequence[str]) -> bool:
        """A prefix text the target can continue as is: no split character, no stop string, whole or begun."""
        if text.endswith("\ufffd"):
            return False
        return not any(stop in text or any(text.endswith(stop[:m]) for m in range(1, len(stop))) for stop in stops)

    # ---------------------------------------------------------------------------------------------- the rest

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], lent: bool = False) -> None:
        self.target.update_weights(weights, lent=lent)

    def sleep(self) -> None:
        self.target.sleep()

    def wake(self) -> None:
        self.target.wake()

    @property
    def ranks_per_engine(self) -> int | None:
        return self.target.ranks_per_engine

    @property
    def alive(self) -> bool:
        """False when either engine died (the trainer then rebuilds both through make_engine)."""
        return self.target.alive and self.weak.alive

    def close(self) -> None:
        for engine in (self.target, self.weak):
            engine.close()


def without_prefixes(engine: RolloutEngine) -> RolloutEngine:
    """The engine that samples the model itself: a PrefixedEngine's target, any other engine as it is. Validation,
    PBA's base evidence and the engine ranks' answers to the actor go through it; prefixes are for training only."""
    return engine.target if isinstance(engine, PrefixedEngine) else engine


def check_prefix_model(model_dir: str | Path, prefix_model: str | Path) -> PreTrainedTokenizerBase:
    """The target's tokenizer, after checking that ``prefix_model`` reads token ids the same way (the one tokenizer
    check, models/tokenizer_check.py) and has as many embedding rows; only ids travel between the two engines."""
    tokenizer = check_same_tokenizer("rollout.prefix_model", prefix_model, model_dir)
    sizes = [read_hf_config(d).get("vocab_size") for d in (model_dir, prefix_model)]
    if sizes[0] != sizes[1]:
        raise TokenizerMismatch(
            f"rollout.prefix_model={str(prefix_model)!r}: config vocab_size {sizes[1]} vs the model's {sizes[0]}; "
            "the two engines must have the same embedding rows"
        )
    return tokenizer
