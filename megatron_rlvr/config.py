"""Typed run configuration: plain dataclasses, loaded from YAML with dotted command-line overrides.

Each section's dataclass lives beside the code it configures (``megatron_rlvr/<package>/config.py``) and holds
plain data only; this module composes them into :class:`Config`, converts YAML/CLI values into those types with
errors that name the key and what was expected, and checks the cross-section constraints (parallel sizes against
the world size, model shapes against TP).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_rlvr.actor.config import ActorConfig
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.checkpoint.config import CheckpointConfig
from megatron_rlvr.data.config import DataConfig
from megatron_rlvr.environments.config import EnvironmentConfig
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.models.config import ModelConfig
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rollout.config import RolloutConfig


@dataclass
class TrainerConfig:
    """The loop: how many steps, prompts per step, and where outputs go."""

    steps: int = 10
    prompts_per_step: int = 8
    mini_batches_per_step: int = 1
    seed: int = 1234
    output_dir: str = "outputs/run"
    log_every: int = 1  # write metrics (metrics.jsonl, TensorBoard, W&B) every N steps, and the last step always
    eval_every: int = 0  # validate before training, every N steps and after the last (0 = never); see validation.py
    tensorboard: bool = True
    wandb_project: str | None = None
    save_hf: bool = True  # write the final weights as an HF checkpoint to <output_dir>/hf


@dataclass
class ClusterConfig:
    """The machines a recipe targets, as `megatron-rlvr plan` checks them (plan/host_memory.py)."""

    # host (CPU) memory of one node in GB; the plan refuses a layout whose node total does not fit. 0 = not checked.
    # The H200 recipes assume a DGX H200 node: 2 TB (2000 GB) of system memory.
    host_memory_gb: float = 0.0

    def __post_init__(self) -> None:
        if self.host_memory_gb < 0:
            raise ValueError(f"cluster.host_memory_gb: expected >= 0 (0: not checked), got {self.host_memory_gb!r}")


@dataclass
class Config:
    """The whole run. Every knob has a default; a YAML recipe and CLI overrides change some of them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)  # multi-turn (docs/multi-turn.md)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        algo, g = self.algo, self.rollout.group_size
        if algo.anchor_rollout and algo.mixed_ratio_share is None:  # ARMOR's a: the on-policy share of each group
            if g < 2:
                raise ConfigError(
                    f"algo.anchor_rollout: rollout.group_size={g} leaves no policy sample beside the anchor; set >= 2"
                )
            algo.mixed_ratio_share = (g - 1) / g

    def validate(self, world_size: int | None = None, dims: ModelDims | None = None) -> Config:
        """Cross-section checks against the world size and the model's shapes (``dims``), when known. The parallel
        layout's own rules are `ParallelLayout.problems` (models/layout.py), the same the actor and the builder run."""
        a = self.actor
        if a.micro_batch_size < 1:
            raise ConfigError(f"actor.micro_batch_size: must be >= 1, got {a.micro_batch_size}")
        if a.max_tokens_per_micro_batch < 0:
            raise ConfigError(
                f"actor.max_tokens_per_micro_batch: must be >= 0 (0 = micro_batch_size sequences), got "
                f"{a.max_tokens_per_micro_batch}"
            )
        self._validate_placement(world_size)
        actors, world_name = self.actor_world(world_size)
        a.layout().check(dims, actors, world_name=world_name)
        self._validate_experts(dims)
        self._validate_lora(dims)
        self._validate_anchors()
        if self.algo.distill == "crpo" and self.algo.crpo_teacher == "ema" and a.lora is not None:
            raise ConfigError("algo.crpo_teacher=ema: not with actor.lora (the EMA follows full weights); use frozen")
        budgets = [("rollout.max_new_tokens", self.rollout.max_new_tokens, "")]
        if self.trainer.eval_every:
            budgets.append(("eval.max_new_tokens", self.eval.max_new_tokens, " (validation: trainer.eval_every > 0)"))
        for key, new_tokens, why in budgets:
            if self.data.max_prompt_tokens + new_tokens > self.rollout.max_model_len:
                raise ConfigError(
                    f"{key}={new_tokens} + data.max_prompt_tokens={self.data.max_prompt_tokens} exceeds "
                    f"rollout.max_model_len={self.rollout.max_model_len}{why}: the longest prompt could not be "
                    f"answered; raise rollout.max_model_len to {self.data.max_prompt_tokens + new_tokens} or lower "
                    f"{key}"
                )
        r = self.reward
        if not 0 <= r.overlong_buffer < self.rollout.max_new_tokens:
            raise ConfigError(
                f"reward.overlong_buffer: expected 0 (off) or a buffer L_c < rollout.max_new_tokens = "
                f"{self.rollout.max_new_tokens} tokens, got {r.overlong_buffer}"
            )
        if not r.overlong_penalty >= 0:
            raise ConfigError(f"reward.overlong_penalty: expected >= 0, got {r.overlong_penalty}")
        if self.trainer.prompts_per_step % self.trainer.mini_batches_per_step != 0:
            raise ConfigError(
                f"trainer.mini_batches_per_step={self.trainer.mini_batches_per_step} must divide "
                f"trainer.prompts_per_step={self.trainer.prompts_per_step}"
            )
        return self

    def check_inputs(self) -> Config:
        """What a run reads is on this machine: the packages it imports for its settings, the model directories
        (their config.json), a megatron checkpoint to load, the training and eval prompts. Run where the ranks will
        run, before any of them starts (`megatron-rlvr train --nproc-per-node`, the demo, the local launchers): a
        missing file or package then costs one line instead of a started job. Each error names the key and the fix
        (what writes the file, what installs the package)."""
        import importlib.util

        from megatron_rlvr.data.sources import missing_dataset
        from megatron_rlvr.models.hf_config import config_path

        packages = [("rollout.engine=vllm", "vllm", "pip install -e '.[cpu]' (CPU) or '.[gpu]' (GPU)")]
        if self.trainer.tensorboard:
            packages.append(
                ("trainer.tensorboard=true", "tensorboard", "pip install tensorboard, or trainer.tensorboard=false")
            )
        for setting, package, install in packages:
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"{setting}: the {package} package is not installed; {install}")

        def where(path: str) -> str:
            return path if Path(path).is_absolute() else f"{path} (relative to {Path.cwd()})"

        models = [("model.hf_dir", self.model.hf_dir), ("rollout.prefix_model", self.rollout.prefix_model or "")]
        if self.algo.distill == "teacher":
            models.append(("algo.teacher_hf_dir", self.algo.teacher_hf_dir))
        for key, directory in models:
            if key == "model.hf_dir" and not directory:
                raise ConfigError("model.hf_dir: empty; give the HF model directory to train, e.g. model.hf_dir=DIR")
            if directory and not config_path(directory).is_file():
                raise ConfigError(
                    f"{key}={where(directory)}: not an HF model directory (no config.json); download the model "
                    "there, or write one with `megatron-rlvr convert mcore-to-hf|gguf-to-hf` (docs/checkpoints.md)"
                )
        if self.model.load and not Path(self.model.load).exists():
            raise ConfigError(
                f"model.load={where(self.model.load)}: not found; give a megatron checkpoint directory "
                "(`megatron-rlvr convert hf-to-mcore` writes one), or drop model.load to start from model.hf_dir"
            )
        for key, path in (("data.path", self.data.path), ("data.eval_path", self.data.eval_path)):
            if path and not Path(path).is_file():
                raise missing_dataset(path, key)
        return self

    def preflight(self, world_size: int) -> Config:
        """All that can be checked before a rank builds anything: `check_inputs`, then `validate` against the world
        size and the shapes in model.hf_dir's config.json. The trainer runs it on every rank, and
        `megatron-rlvr train --nproc-per-node N` once before it starts the ranks."""
        from megatron_rlvr.models.hf_config import load_hf_config

        self.check_inputs()
        return self.validate(world_size, ModelDims.from_hf(load_hf_config(self.model.hf_dir)))

    def _validate_lora(self, dims: ModelDims | None) -> None:
        """actor.lora (docs/lora.md): what the engines can serve of it; the adapters' own ranges are LoraConfig's."""
        lora = self.actor.lora
        if lora is None or lora.sync != "adapters":
            return
        if dims is not None and dims.experts and "experts" in lora.targets:
            raise ConfigError(
                "actor.lora.sync=adapters: the routed experts' adapters are not served (vLLM's fused-experts LoRA was "
                "not checked here); set actor.lora.sync=merged or drop 'experts' from actor.lora.targets"
            )
        if self.rollout.check_sync:
            raise ConfigError("rollout.check_sync=true reads weights back; with actor.lora.sync=adapters set it false")
        if self.rollout.max_staleness >= 2:  # a response in flight keeps the adapter it started with
            raise ConfigError(
                f"actor.lora.sync=adapters with rollout.max_staleness={self.rollout.max_staleness}: responses in flight "
                "cannot change adapter between engine steps; set actor.lora.sync=merged (or rollout.max_staleness<=1)"
            )

    def _validate_anchors(self) -> None:
        """ARMOR (docs/algorithms.md, "ARMOR"): its reference is a frozen copy that the actor resets to the policy."""
        algo = self.algo
        if algo.mixed_ratio_share is None and not algo.anchor_rollout:
            return
        if self.actor.lora is not None:
            raise ConfigError(
                "algo.anchor_rollout / algo.mixed_ratio_share: ARMOR needs a reference model it can reset to the "
                "policy, and under actor.lora the reference is the base with the adapters off; drop actor.lora"
            )
        if algo.anchor_rollout and self.rollout.placement != "colocated":
            raise ConfigError(
                "algo.anchor_rollout: the anchors are drawn from the colocated engines while they hold the reference's "
                f"weights; rollout.placement={self.rollout.placement!r} is not supported: set colocated"
            )
        if algo.anchor_rollout and self.actor.router_replay == "rollout":
            raise ConfigError(
                "algo.anchor_rollout: the anchors carry no engine routing to replay; set actor.router_replay=train "
                "or none"
            )
        if algo.anchor_rollout and algo.drop_uniform_groups:
            raise ConfigError(
                "algo.anchor_rollout: ARMOR's prompt filter already drops groups whose policy rewards are all equal, "
                "without refilling; set algo.drop_uniform_groups=false"
            )

    def actor_world(self, world_size: int | None) -> tuple[int | None, str | None]:
        """(the ranks the actor runs on, how messages name them): the world, less the engine ranks under separate
        placement."""
        if world_size is None or self.rollout.placement != "separate":
            return world_size, None
        actors = world_size - self.rollout.engine_ranks
        return actors, (
            f"the actor's ranks: world size {world_size} - rollout.engine_ranks {self.rollout.engine_ranks} = {actors}"
        )

    def _validate_experts(self, dims: ModelDims | None) -> None:
        """Mixture-of-experts settings that are not the layout's (docs/moe.md)."""
        a = self.actor
        if a.moe_aux_loss_coeff < 0:
            raise ConfigError(f"actor.moe_aux_loss_coeff: must be >= 0, got {a.moe_aux_loss_coeff}")
        if a.router_replay == "rollout" and not self.rollout.return_routed_experts:
            raise ConfigError(
                "actor.router_replay=rollout replays the engine's routing: set rollout.return_routed_experts=true so "
                "the engines return it"
            )
        if dims is None or dims.is_moe:
            return
        if a.moe_aux_loss_coeff:
            raise ConfigError(
                f"actor.moe_aux_loss_coeff={a.moe_aux_loss_coeff}: set for a dense model (no num_experts in its "
                "config); set actor.moe_aux_loss_coeff=0"
            )
        if a.router_replay != "none":
            raise ConfigError(
                f"actor.router_replay={a.router_replay}: set for a dense model (no num_experts); "
                "set actor.router_replay=none"
            )

    def _validate_placement(self, world_size: int | None) -> None:
        """Separate placement, one-step-off and fully asynchronous training (docs/separate-placement.md,
        docs/async.md); the actor's share of the world is the layout's (`actor_world`)."""
        r, k = self.rollout, self.rollout.max_staleness
        if k and r.placement != "separate":
            raise ConfigError(
                f"rollout.max_staleness={k} needs rollout.placement=separate (with rollout.engine_ranks > 0): "
                "colocated engines share the actor's devices and cannot generate during an update"
            )
        if k >= 2:  # the engines stream: a response may span weight versions (docs/async.md)
            if self.environment.enabled:
                raise ConfigError(
                    f"environment.name={self.environment.name} with rollout.max_staleness={k}: multi-turn "
                    "trajectories are not streamed; set rollout.max_staleness <= 1 or environment.name=''"
                )
            if r.prefix_model:
                raise ConfigError(
                    f"rollout.prefix_model with rollout.max_staleness={k}: outer prefixes are not streamed; "
                    "set rollout.max_staleness <= 1 or rollout.prefix_model=null"
                )
            if self.actor.router_replay == "rollout":
                raise ConfigError(
                    f"actor.router_replay=rollout with rollout.max_staleness={k}: a streamed response's routing "
                    "spans weight versions; set actor.router_replay=train (the statistics pass's routing) or none"
                )
        if r.placement != "separate":
            return
        if r.engine_ranks % r.tp != 0:
            raise ConfigError(
                f"rollout.engine_ranks={r.engine_ranks} must be a multiple of rollout.tp={r.tp} "
                f"(each engine spans rollout.tp engine ranks)"
            )
        if world_size is not None and r.engine_ranks >= world_size:
            raise ConfigError(
                f"rollout.engine_ranks={r.engine_ranks} must be less than the world size {world_size}: "
                "the other ranks are the actor"
            )

    def warnings(self) -> list[str]:
        """Settings that run but probably not as meant; the trainer prints them at start."""
        out = []
        k = self.rollout.max_staleness
        if k and self.algo.rollout_correction == "none":
            out.append(
                f"rollout.max_staleness={k} with algo.rollout_correction=none: the loss's old log-probs are the "
                f"current weights' (the proximal policy), and nothing corrects for the responses having been sampled "
                f"by weights up to {k} update(s) older; set algo.rollout_correction (e.g. tis) for decoupled PPO's "
                "off-policy weight exp(old_logp - engine_logp) (docs/algorithms.md, 'Rollout correction')"
            )
        return out


# ---------------------------------------------------------------------------------------------------------------
# Typed construction from plain data

# Keys that existed once and changed nothing, or moved: a recipe that still sets one is told what to set instead.
REMOVED_KEYS: dict[str, str] = {
    "model.dtype": "actor.bf16 (true: bf16 compute; the rollout engines serve in the same dtype) and, for "
    "evaluation, eval.dtype",
    "trainer.off_policy_steps": "rollout.max_staleness (0: on-policy, 1: one-step-off, k >= 2: fully asynchronous; "
    "docs/async.md)",
}


def from_dict(cls: type, data: Mapping[str, Any] | None, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from nested plain data, checking every key and value type."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or '<root>'}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = _join(prefix, unknown[0])
        if key in REMOVED_KEYS:
            raise ConfigError(f"{key}: removed; set {REMOVED_KEYS[key]}")
        near = difflib.get_close_matches(unknown[0], fields, n=1, cutoff=0.6)
        hint = f"did you mean {_join(prefix, near[0])}? " if near else ""
        raise ConfigError(f"{key}: unknown key; {hint}allowed keys: {', '.join(sorted(fields))}")
    kwargs = {name: _convert(hints[name], value, _join(prefix, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own range checks (__post_init__) name their key already
        raise ConfigError(str(e)) from e


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``"key: old -> new"`` for every dotted key whose value differs between two ``to_dict`` trees."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b, name = old.get(key), new.get(key), _join(prefix, key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += differences(a, b, name)
        elif _plain(a) != _plain(b):  # a tree read back from JSON has lists where the dataclasses had tuples
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(option, value, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1 and isinstance(value, Mapping):  # one section type, optional: its own error names the key
            raise ConfigError(errors[0])
        raise ConfigError(f"{key}: expected {' or '.join(_describe(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: got {value!r}; allowed values: {', '.join(repr(a) for a in args)}")
    if origin in (list, Sequence, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_tp,) = args[:1] or (Any,)
        return [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected str, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {_describe(tp)}")


# ---------------------------------------------------------------------------------------------------------------
# YAML + dotted overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"actor.tp=2"`` -> (["actor", "tp"], 2); the value is read as YAML (numbers, bools, null, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. actor.tp=2")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: the key must be dotted names, e.g. algo.alpha=0.05")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML recipe (or nothing: all defaults), apply ``key=value`` overrides, and type-check it all."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found; give a YAML recipe, e.g. configs/demo_cpu.yaml")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, overrides)
    cfg = from_dict(Config, data)
    from megatron_rlvr.rewards.verifiers import check_config  # reward.plugins, reward.synlogic_dir: imported once here

    check_config(cfg.reward)
    if cfg.environment.enabled:
        from megatron_rlvr.environments.loading import check_environment

        if cfg.rollout.prefix_model:
            raise ConfigError(
                f"environment.name={cfg.environment.name} with rollout.prefix_model: outer prefixes are single-turn; "
                "set rollout.prefix_model=null or environment.name=''"
            )
        check_environment(cfg.environment)
    return cfg


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
