"""Scoring the probe set with checkpoints through the actor's own passes, at any TP x PP (x DP) layout.

`ProbeScorer` builds one frozen megatron-core model at the layout (models/builder.py, actor/chunks.py), loads each
checkpoint's weights into it in turn, and runs the probe batch through `ActorPasses` (plan -> packed THD streams ->
megatron-core's pipeline schedule, forward only -> gather to every rank), exactly as the actor's statistics pass
does. On the last pipeline stage the vocab-sharded logits of each micro-batch go to `probe_stats.position_stats`:
the fused op's log-prob, entropy and top-3 over the TP group, and ``E_K`` summed per shard with one all-reduce.

A checkpoint is an HF directory (``config.json`` and safetensors: the base, a run's final ``hf/`` export) or a
megatron dist checkpoint at any TP/PP: a run's ``checkpoints/step-NNNNNN`` (checked against its manifest first, as
a resume would) or a converted one, with its HF config under ``hf/``. Every checkpoint must have the shapes of the
first one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_rlvr.actor.chunks import build_chunks, freeze
from megatron_rlvr.actor.config import ActorConfig
from megatron_rlvr.actor.packing import MicroBatch
from megatron_rlvr.actor.passes import ActorPasses
from megatron_rlvr.actor.router_replay import RouterReplayer
from megatron_rlvr.errors import UserError
from megatron_rlvr.inspection.probe_stats import check_ks, field_names, position_stats
from megatron_rlvr.models.config import ModelConfig
from megatron_rlvr.protocols.handoffs import Sequences
from megatron_rlvr.runtime import distributed


class ProbeCheckpointError(UserError, ValueError):
    """A checkpoint the probe cannot read, or one whose model differs from the others: the message names it."""


def checkpoint_kind(path: str | Path) -> str:
    """``hf`` (config.json + safetensors) or ``dist`` (a megatron dist checkpoint with its HF config under hf/)."""
    path = Path(path)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors*")):
        return "hf"
    if (path / "metadata.json").is_file() and (path / "hf" / "config.json").is_file():
        return "dist"
    raise ProbeCheckpointError(
        f"{path}: neither an HF model directory (config.json + safetensors) nor a megatron dist checkpoint with its "
        "HF config under hf/ (a run's checkpoints/step-NNNNNN)"
    )


def config_dir(path: str | Path) -> Path:
    """Where a checkpoint's HF config.json lies."""
    return Path(path) if checkpoint_kind(path) == "hf" else Path(path) / "hf"


class ProbeScorer:
    """One frozen model at (``tp``, ``pp``) over this world (DP = world / (tp x pp)), loaded with each checkpoint in
    turn. Every method is a collective over the world; call it on every rank with the same arguments. Building it sets
    megatron's parallel state for the layout; ``close`` (or leaving its ``with`` block) tears that down."""

    def __init__(
        self,
        first_checkpoint: str,
        *,
        tp: int = 1,
        pp: int = 1,
        temperature: float = 1.0,
        ks: Sequence[int] = (8, 64),
        max_tokens_per_micro_batch: int = 4096,
        model_cfg: ModelConfig | None = None,
    ) -> None:
        from megatron_rlvr.models import load_hf_config, padded_vocab_size, transformer_config_from_hf
        from megatron_rlvr.models.builder import resolve_use_te
        from megatron_rlvr.models.dims import ModelDims

        if not (math.isfinite(temperature) and temperature > 0):
            raise ProbeCheckpointError(f"--temperature {temperature}: expected a finite number > 0")
        self.ks = check_ks(ks)
        self.model_cfg = model_cfg or ModelConfig()
        self.hf = load_hf_config(config_dir(first_checkpoint))
        self.dims = ModelDims.from_hf(self.hf)
        self.actor_cfg = ActorConfig(tp=tp, pp=pp, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        self.actor_cfg.layout().check(self.dims)  # a layout that does not divide the model: one line
        distributed.initialize_model_parallel(tp, pp, None, seed=0)
        self.tcfg = transformer_config_from_hf(
            self.hf, tp=tp, pp=pp, params_dtype=torch.float32, variable_seq_lengths=pp > 1
        )
        self.use_te = resolve_use_te(self.model_cfg.use_transformer_engine)
        vocab = int(self.hf["vocab_size"])
        divisible_by = self.model_cfg.make_vocab_size_divisible_by
        self.passes = ActorPasses(
            self.actor_cfg,
            self.tcfg,
            vocab_size=vocab,
            local_vocab=padded_vocab_size(vocab, tp, divisible_by) // tp,
            temperature=temperature,
            replay=RouterReplayer("none", self.tcfg),
        )
        self.chunks: list[torch.nn.Module] | None = None

    def __enter__(self) -> ProbeScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the model and megatron's parallel state (and its process groups)."""
        self.chunks = None
        distributed.destroy_model_parallel()

    def load(self, checkpoint: str) -> None:
        """This checkpoint's weights into the model (built on the first call)."""
        from megatron_rlvr import checkpoint as ckpt
        from megatron_rlvr.bridge import load_hf_weights
        from megatron_rlvr.bridge.dist_ckpt import load_dist_checkpoint
        from megatron_rlvr.models import load_hf_config
        from megatron_rlvr.models.dims import ModelDims

        kind = checkpoint_kind(checkpoint)
        dims = ModelDims.from_hf(load_hf_config(config_dir(checkpoint)))
        if dims != self.dims:
            raise ProbeCheckpointError(f"{checkpoint}: a model of other shapes than the first checkpoint's ({dims})")
        if kind == "dist" and (Path(checkpoint) / "manifest.json").is_file():
            ckpt.resolve(Path(checkpoint).parent, str(checkpoint))  # a damaged step names its file, as a resume would
        dist_checkpoint = checkpoint if kind == "dist" else None
        if self.chunks is None:
            self.chunks = freeze(
                build_chunks(
                    self.hf,
                    self.tcfg,
                    vpp=None,
                    use_te=self.use_te,
                    divisible_by=self.model_cfg.make_vocab_size_divisible_by,
                    hf_dir=str(config_dir(checkpoint)) if kind == "dist" else checkpoint,
                    dist_checkpoint=dist_checkpoint,
                )
            )
        elif kind == "dist":
            load_dist_checkpoint(self.chunks, int(self.hf["vocab_size"]), checkpoint)
        else:
            load_hf_weights(self.chunks, checkpoint)

    @torch.no_grad()
    def score(self, batch: Sequences) -> torch.Tensor:
        """Per-position statistics of the loaded model over ``batch``: [B, len(field_names(ks)), S - 1] float32 on
        every rank (position t: the distribution of token t + 1; meaningful where ``batch.response_mask`` is)."""
        from megatron.core import parallel_state as ps

        if self.chunks is None:
            raise RuntimeError("ProbeScorer.score: load a checkpoint first")
        passes, ks = self.passes, self.ks
        n = len(batch)
        extra = -n % ps.get_data_parallel_world_size()  # every DP rank holds as many sequences: repeat row 0, masked
        if extra:
            padded = batch.select(torch.cat([torch.arange(n), torch.zeros(extra, dtype=torch.long)]))
            keep = (torch.arange(n + extra) < n)[:, None]
            batch = dataclasses.replace(padded, response_mask=padded.response_mask & keep)
        plan, micro = passes.plan(batch)
        width = batch.response_mask.shape[1]
        fields = len(field_names(ks))

        def collect(mb: MicroBatch, logits: torch.Tensor):
            stats = position_stats(
                logits,
                mb.targets().to(logits.device),
                ks,
                group=passes.tp_group,
                vocab_start=passes.vocab_start(),
                vocab_size=passes.vocab_size,
                temperature=passes.temperature,
                chunk_tokens=self.actor_cfg.stats_chunk_tokens,
            )
            rows = [stats.logp, stats.entropy, *stats.top_prob.unbind(-1), *stats.distinct.unbind(-1)]
            views = [passes.to_view(r, mb).float() for r in rows]  # each [b, S - 1]
            return torch.zeros(()), {"probe": torch.cat(views, dim=1)}

        outputs = passes.run(micro, collect, forward_only=True, model=self.chunks)
        values = passes.gather([o["probe"] for o in outputs], plan, len(batch), fields * width)
        return values[:n].view(n, fields, width)
