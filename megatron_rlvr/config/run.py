"""The run config: every section's dataclass composed into `Config`, with the checks of a run before it starts.

Each section's dataclass lives beside the code it configures (``megatron_rlvr/<package>/config.py``) and declares its
fields' docs and limits (megatron_rlvr/settings.py); the loader (loader.py) reads YAML and overrides into them and
checks those limits; the rules between fields are one table (rules.py), run at load and, against the world size and
the model's shapes, by `Config.validate`. Derived facts are properties of the section they derive from
(`AlgoConfig.needs_reference`, `AlgoConfig.mixed_ratio_share`), never stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_rlvr.actor.config import ActorConfig
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.checkpoint.config import CheckpointConfig
from megatron_rlvr.config import rules
from megatron_rlvr.config.sections import ClusterConfig, TrainerConfig
from megatron_rlvr.data.config import DataConfig
from megatron_rlvr.environments.config import EnvironmentConfig
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.models.config import ModelConfig
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rollout.config import RolloutConfig
from megatron_rlvr.settings import setting


@dataclass
class Config:
    """The whole run. Every knob has a default; a YAML recipe and CLI overrides change some of them."""

    model: ModelConfig = setting(factory=ModelConfig, doc="The actor's model: its HF directory or a dist checkpoint.")
    actor: ActorConfig = setting(factory=ActorConfig, doc="The Megatron actor: layout, optimizer, memory knobs.")
    algo: AlgoConfig = setting(factory=AlgoConfig, doc="Advantages, the loss and the methods around it.")
    rollout: RolloutConfig = setting(factory=RolloutConfig, doc="The rollout engines and sampling.")
    reward: RewardConfig = setting(factory=RewardConfig, doc="The verifiers and their pool.")
    environment: EnvironmentConfig = setting(factory=EnvironmentConfig, doc="Multi-turn rollouts (docs/multi-turn.md).")
    data: DataConfig = setting(factory=DataConfig, doc="The prompt dataset.")
    trainer: TrainerConfig = setting(factory=TrainerConfig, doc="The loop.")
    checkpoint: CheckpointConfig = setting(factory=CheckpointConfig, doc="Checkpointing and resume.")
    eval: EvalConfig = setting(factory=EvalConfig, doc="Validation's and large-K evaluation's sampling.")
    cluster: ClusterConfig = setting(factory=ClusterConfig, doc="The machines a recipe targets.")

    def validate(self, world_size: int | None = None, dims: ModelDims | None = None) -> Config:
        """The rules that need the world size and the model's shapes (``dims``), when known (rules.py, ``validate``
        phase); the parallel layout's own rules are `ParallelLayout.problems` (models/layout.py), the same the actor
        and the builder run."""
        rules.check(self, "validate", rules.Context(world_size, dims))
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
        for wanted, package, install in packages:
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"{wanted}: the {package} package is not installed; {install}")

        def where(path: str) -> str:
            return path if Path(path).is_absolute() else f"{path} (relative to {Path.cwd()})"

        models = [("model.hf_dir", self.model.hf_dir), ("rollout.prefix_model", self.rollout.prefix_model or "")]
        if self.algo.distill.kind == "teacher":
            models.append(("algo.distill.teacher_hf_dir", self.algo.distill.teacher_hf_dir))
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

    def actor_world(self, world_size: int | None) -> tuple[int | None, str | None]:
        """(the ranks the actor runs on, how messages name them): the world, less the engine ranks under separate
        placement."""
        if world_size is None or self.rollout.placement != "separate":
            return world_size, None
        actors = world_size - self.rollout.engine_ranks
        return actors, (
            f"the actor's ranks: world size {world_size} - rollout.engine_ranks {self.rollout.engine_ranks} = {actors}"
        )

    def warnings(self) -> list[str]:
        """Settings that run but probably not as meant; the trainer prints them at start."""
        out = []
        k = self.rollout.max_staleness
        if k and self.algo.rollout_correction.kind == "none":
            out.append(
                f"rollout.max_staleness={k} with algo.rollout_correction.kind=none: the loss's old log-probs are the "
                f"current weights' (the proximal policy), and nothing corrects for the responses having been sampled "
                f"by weights up to {k} update(s) older; set algo.rollout_correction.kind (e.g. tis) for decoupled "
                "PPO's "
                "off-policy weight exp(old_logp - engine_logp) (docs/algorithms.md, 'Rollout correction')"
            )
        return out
