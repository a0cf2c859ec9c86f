"""What both placements build the same way, so that an engine rank and a colocated rank agree: this rank's rollout
engine (its seed and dtype; with ``environment.name``, an episode runner around it) and the prompt stream (tokenizer, prompts, the resumable loader)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rlvr.config import Config
from megatron_rlvr.data import LoadStats, PromptItem, PromptLoader, load_items
from megatron_rlvr.environments.episodes import EpisodeRunner
from megatron_rlvr.environments.glue import TurnGlue
from megatron_rlvr.problems.prompt_encoding import stop_ids
from megatron_rlvr.rollout import RolloutEngine, make_engine


def make_rollout_engine(cfg: Config, rank: int) -> RolloutEngine:
    """The engine of ``rank``; the ranks of one engine's TP group share its seed. Under the chat template (training
    or validation prompts) it stops at the template's end of turn, which ends the response the actor trains on."""
    seed = cfg.trainer.seed + rank // cfg.rollout.tp
    lora = cfg.actor.lora  # sync=adapters: the engine serves the actor's adapter on its base, one per sync
    adapter = lora.spec() if lora is not None and lora.sync == "adapters" else None
    dtype = "bfloat16" if cfg.actor.bf16 else "float32"
    stops = chat_stop_ids(cfg)
    engine = make_engine(cfg.model.hf_dir, cfg.rollout, seed=seed, dtype=dtype, adapter=adapter, stop_token_ids=stops)
    return episode_runner(engine, cfg, stops) if cfg.environment.enabled else engine


# What builds a rank's engine: `make_rollout_engine`, or what a caller of the loop puts in its place
EngineFactory = Callable[[Config, int], RolloutEngine]


def episode_runner(engine: RolloutEngine, cfg: Config, end_of_turn_ids: tuple[int, ...]) -> EpisodeRunner:
    """``engine`` playing multi-turn trajectories against ``environment.name`` (docs/multi-turn.md), with the
    observations in the model's own chat template."""
    from transformers import AutoTokenizer

    e = cfg.environment
    glue = TurnGlue(
        AutoTokenizer.from_pretrained(cfg.model.hf_dir), e.observation_role, e.observation_tokens, end_of_turn_ids
    )
    return EpisodeRunner(engine, e, glue, cfg.reward)


def chat_stop_ids(cfg: Config) -> tuple[int, ...]:
    """The chat template's end-of-turn id when training or validation prompts use the template, else ()."""
    return stop_ids(cfg.model.hf_dir, cfg.data.chat_template or cfg.eval.chat_template)


@dataclass
class PromptStream:
    """The training prompts of a run and the loader that draws them, identical on every rank that builds it."""

    tokenizer: Any
    pad_id: int
    items: list[PromptItem]
    stats: LoadStats  # rows read, bad rows skipped, prompts over data.max_prompt_tokens
    loader: PromptLoader


def prompt_stream(cfg: Config) -> PromptStream:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    items, stats = load_items(cfg.data, tokenizer, "train")
    loader = PromptLoader(items, cfg.trainer.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    return PromptStream(tokenizer, pad_id, items, stats, loader)
