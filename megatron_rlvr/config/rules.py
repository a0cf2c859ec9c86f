"""The rules between configuration fields, in one table: every constraint that one field's declared limits cannot say
(a field against another, a section against another, the layout against the world size and the model's shapes).

A rule is a function of the run's `Config` and, where known, the world size and the model's shapes (`Context`); it
returns the one-line message of a broken rule (a `ConfigError` naming the key), None when the rule holds, or raises
a wing's own `UserError` (the layout's, the adapters'). ``load`` rules run when a recipe loads (`load_config`),
``validate`` rules when the run is checked against its world and model (`Config.validate`). The table is in the
order the rules are checked: the first broken one is the error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from megatron_rlvr.actor.config import ActorConfig
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.config.sections import TrainerConfig
from megatron_rlvr.data.config import DataConfig
from megatron_rlvr.environments.config import EnvironmentConfig
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rollout.config import RolloutConfig


class RunSections(Protocol):
    """What the rules read of the run's config (run.py's `Config`)."""

    actor: ActorConfig
    algo: AlgoConfig
    rollout: RolloutConfig
    reward: RewardConfig
    environment: EnvironmentConfig
    data: DataConfig
    trainer: TrainerConfig
    eval: EvalConfig

    def actor_world(self, world_size: int | None) -> tuple[int | None, str | None]: ...


@dataclass(frozen=True)
class Context:
    world_size: int | None = None  # the torchrun world, when known
    dims: ModelDims | None = None  # the model's shapes, when known


Check = Callable[[RunSections, Context], "str | None"]


@dataclass(frozen=True)
class Rule:
    keys: tuple[str, ...]  # the fields it relates (what `megatron-rlvr config explain` lists beside a key)
    check: Check
    phase: Literal["load", "validate"] = "load"


def _expected(key: str, value: object, expected: str) -> str:
    return f"{key}: expected {expected}, got {value!r}"


# --- algo ---------------------------------------------------------------------------------------------------------


def _distill_only(cfg: RunSections, _: Context) -> str | None:
    d = cfg.algo.distill
    if d.only and d.kind == "none":
        return _expected(
            "algo.distill.only", d.only, "false under algo.distill.kind=none (there is no teacher to distill from)"
        )
    if d.only and d.kind == "crpo":
        return _expected(
            "algo.distill.only",
            d.only,
            "false under algo.distill.kind=crpo (CRPO is added to the RL loss: algo.distill.crpo.coef)",
        )
    return None


def _teacher_dir(cfg: RunSections, _: Context) -> str | None:
    d = cfg.algo.distill
    if d.kind == "teacher" and not d.teacher_hf_dir:
        return _expected(
            "algo.distill.teacher_hf_dir", d.teacher_hf_dir, "the teacher's HF model directory under kind=teacher"
        )
    return None


def _pba_counts(cfg: RunSections, _: Context) -> str | None:
    pba = cfg.algo.kl.pba
    if pba.min_correct > pba.base_samples:
        return _expected(
            "algo.kl.pba.min_correct", pba.min_correct, f"in [0, algo.kl.pba.base_samples={pba.base_samples}]"
        )
    return None


def _demonstrations(cfg: RunSections, _: Context) -> str | None:
    algo = cfg.algo
    if algo.demonstrations and algo.advantage.kind == "group":
        return _expected(
            "algo.advantage.kind",
            algo.advantage.kind,
            "'reward' or 'signed_reward' under algo.demonstrations (a group of one demonstration has group "
            "advantages 0)",
        )
    if algo.demonstrations and algo.armor.anchors:
        return _expected(
            "algo.demonstrations", True, "false under algo.armor.anchors (the anchors join policy samples)"
        )
    return None


def _armor_alone(cfg: RunSections, _: Context) -> str | None:
    """ARMOR's reference is reset to the policy: the mixed ratio must be its only use."""
    algo = cfg.algo
    if not algo.mixes_ratio:
        return None
    for key, value, off in (
        ("algo.kl.coef", algo.kl.coef, 0.0),
        ("algo.kl.pba.enabled", algo.kl.pba.enabled, False),
        ("algo.distill.kind", algo.distill.kind, "none"),
        ("algo.rollout_correction.kind", algo.rollout_correction.kind, "none"),
    ):
        if value != off:
            return _expected(
                key,
                value,
                f"{off!r} under ARMOR (algo.armor.anchors / algo.armor.mixed_ratio_share): its reference is reset "
                "to the policy, and the mixed ratio is its only use of it",
            )
    return None


def _anchor_group(cfg: RunSections, _: Context) -> str | None:
    g = cfg.rollout.group_size
    if cfg.algo.armor.anchors and cfg.algo.armor.mixed_ratio_share is None and g < 2:
        return f"algo.armor.anchors: rollout.group_size={g} leaves no policy sample beside the anchor; set >= 2"
    return None


def _anchors_placement(cfg: RunSections, _: Context) -> str | None:
    """ARMOR (docs/algorithms.md, "ARMOR"): its reference is a frozen copy that the actor resets to the policy."""
    algo = cfg.algo
    if not algo.mixes_ratio:
        return None
    if cfg.actor.lora is not None:
        return (
            "algo.armor.anchors / algo.armor.mixed_ratio_share: ARMOR needs a reference model it can reset to the "
            "policy, and under actor.lora the reference is the base with the adapters off; drop actor.lora"
        )
    if algo.armor.anchors and cfg.rollout.placement != "colocated":
        return (
            "algo.armor.anchors: the anchors are drawn from the colocated engines while they hold the reference's "
            f"weights; rollout.placement={cfg.rollout.placement!r} is not supported: set colocated"
        )
    if algo.armor.anchors and cfg.actor.router_replay == "rollout":
        return (
            "algo.armor.anchors: the anchors carry no engine routing to replay; set actor.router_replay=train or none"
        )
    if algo.armor.anchors and algo.drop_uniform_groups:
        return (
            "algo.armor.anchors: ARMOR's prompt filter already drops groups whose policy rewards are all equal, "
            "without refilling; set algo.drop_uniform_groups=false"
        )
    return None


def _ema_teacher(cfg: RunSections, _: Context) -> str | None:
    d = cfg.algo.distill
    if d.kind == "crpo" and d.crpo.teacher == "ema" and cfg.actor.lora is not None:
        return "algo.distill.crpo.teacher=ema: not with actor.lora (the EMA follows full weights); use frozen"
    return None


# --- rollout, data, reward, environment -----------------------------------------------------------------------------


def _min_new_tokens(cfg: RunSections, _: Context) -> str | None:
    r = cfg.rollout
    if r.min_new_tokens > r.max_new_tokens:
        return _expected("rollout.min_new_tokens", r.min_new_tokens, f"0 .. rollout.max_new_tokens={r.max_new_tokens}")
    return None


def _engine_ranks(cfg: RunSections, _: Context) -> str | None:
    r = cfg.rollout
    if (r.placement == "separate") != (r.engine_ranks > 0):
        return (
            "rollout.engine_ranks: expected >= 1 with placement 'separate' and 0 with 'colocated', "
            f"got {r.engine_ranks!r} with {r.placement!r}"
        )
    return None


def _system_prompt(cfg: RunSections, _: Context) -> str | None:
    if cfg.data.system_prompt is not None and not cfg.data.chat_template:
        return (
            "data.system_prompt: a system turn needs the chat template; set data.chat_template=true, or "
            "data.system_prompt=null for a raw prompt"
        )
    return None


def _lora_spec(cfg: RunSections, _: Context) -> str | None:
    from megatron_rlvr.models.lora import check_spec

    lora = cfg.actor.lora
    if lora is not None:
        check_spec(lora.rank, lora.alpha, lora.dropout, lora.targets)  # the adapters' own limits (models/lora.py)
    return None


def _verifiers(cfg: RunSections, _: Context) -> str | None:
    from megatron_rlvr.rewards.verifiers import check_config  # reward.plugins, reward.synlogic_dir: imported here

    check_config(cfg.reward)
    return None


def _environment(cfg: RunSections, _: Context) -> str | None:
    if not cfg.environment.enabled:
        return None
    if cfg.rollout.prefix_model:
        return (
            f"environment.name={cfg.environment.name} with rollout.prefix_model: outer prefixes are single-turn; "
            "set rollout.prefix_model=null or environment.name=''"
        )
    from megatron_rlvr.environments.loading import check_environment

    check_environment(cfg.environment)
    return None


# --- the world, the layout, the model --------------------------------------------------------------------------------


def _max_staleness(cfg: RunSections, _: Context) -> str | None:
    """One-step-off and fully asynchronous training (docs/separate-placement.md, docs/async.md)."""
    r, k = cfg.rollout, cfg.rollout.max_staleness
    if k and r.placement != "separate":
        return (
            f"rollout.max_staleness={k} needs rollout.placement=separate (with rollout.engine_ranks > 0): "
            "colocated engines share the actor's devices and cannot generate during an update"
        )
    if k < 2:
        return None
    if cfg.environment.enabled:
        return (
            f"environment.name={cfg.environment.name} with rollout.max_staleness={k}: multi-turn "
            "trajectories are not streamed; set rollout.max_staleness <= 1 or environment.name=''"
        )
    if r.prefix_model:
        return (
            f"rollout.prefix_model with rollout.max_staleness={k}: outer prefixes are not streamed; "
            "set rollout.max_staleness <= 1 or rollout.prefix_model=null"
        )
    if cfg.actor.router_replay == "rollout":
        return (
            f"actor.router_replay=rollout with rollout.max_staleness={k}: a streamed response's routing "
            "spans weight versions; set actor.router_replay=train (the statistics pass's routing) or none"
        )
    return None


def _separate_placement(cfg: RunSections, ctx: Context) -> str | None:
    r = cfg.rollout
    if r.placement != "separate":
        return None
    if r.engine_ranks % r.tp != 0:
        return (
            f"rollout.engine_ranks={r.engine_ranks} must be a multiple of rollout.tp={r.tp} "
            f"(each engine spans rollout.tp engine ranks)"
        )
    if ctx.world_size is not None and r.engine_ranks >= ctx.world_size:
        return (
            f"rollout.engine_ranks={r.engine_ranks} must be less than the world size {ctx.world_size}: "
            "the other ranks are the actor"
        )
    return None


def _layout(cfg: RunSections, ctx: Context) -> str | None:
    """The parallel layout's own rules (models/layout.py), the same the actor and the builder run."""
    actors, world_name = cfg.actor_world(ctx.world_size)
    cfg.actor.layout().check(ctx.dims, actors, world_name=world_name)
    return None


def _experts(cfg: RunSections, ctx: Context) -> str | None:
    """Mixture-of-experts settings that are not the layout's (docs/moe.md)."""
    a = cfg.actor
    if a.router_replay == "rollout" and not cfg.rollout.return_routed_experts:
        return (
            "actor.router_replay=rollout replays the engine's routing: set rollout.return_routed_experts=true so "
            "the engines return it"
        )
    if ctx.dims is None or ctx.dims.is_moe:
        return None
    if a.moe_aux_loss_coeff:
        return (
            f"actor.moe_aux_loss_coeff={a.moe_aux_loss_coeff}: set for a dense model (no num_experts in its "
            "config); set actor.moe_aux_loss_coeff=0"
        )
    if a.router_replay != "none":
        return (
            f"actor.router_replay={a.router_replay}: set for a dense model (no num_experts); "
            "set actor.router_replay=none"
        )
    return None


def _lora_sync(cfg: RunSections, ctx: Context) -> str | None:
    """actor.lora (docs/lora.md): what the engines can serve of it."""
    lora = cfg.actor.lora
    if lora is None or lora.sync != "adapters":
        return None
    if ctx.dims is not None and ctx.dims.experts and "experts" in lora.targets:
        return (
            "actor.lora.sync=adapters: the routed experts' adapters are not served (vLLM's fused-experts LoRA was "
            "not checked here); set actor.lora.sync=merged or drop 'experts' from actor.lora.targets"
        )
    if cfg.rollout.check_sync:
        return "rollout.check_sync=true reads weights back; with actor.lora.sync=adapters set it false"
    if cfg.rollout.max_staleness >= 2:  # a response in flight keeps the adapter it started with
        return (
            f"actor.lora.sync=adapters with rollout.max_staleness={cfg.rollout.max_staleness}: responses in flight "
            "cannot change adapter between engine steps; set actor.lora.sync=merged (or rollout.max_staleness<=1)"
        )
    return None


def _token_budgets(cfg: RunSections, _: Context) -> str | None:
    budgets = [("rollout.max_new_tokens", cfg.rollout.max_new_tokens, "")]
    if cfg.trainer.eval_every:
        budgets.append(("eval.max_new_tokens", cfg.eval.max_new_tokens, " (validation: trainer.eval_every > 0)"))
    prompt, limit = cfg.data.max_prompt_tokens, cfg.rollout.max_model_len
    for key, new_tokens, why in budgets:
        if prompt + new_tokens > limit:
            return (
                f"{key}={new_tokens} + data.max_prompt_tokens={prompt} exceeds rollout.max_model_len={limit}{why}: "
                f"the longest prompt could not be answered; raise rollout.max_model_len to {prompt + new_tokens} or "
                f"lower {key}"
            )
    return None


def _overlong_buffer(cfg: RunSections, _: Context) -> str | None:
    r = cfg.reward
    if not r.overlong_buffer < cfg.rollout.max_new_tokens:
        return (
            f"reward.overlong_buffer: expected 0 (off) or a buffer L_c < rollout.max_new_tokens = "
            f"{cfg.rollout.max_new_tokens} tokens, got {r.overlong_buffer}"
        )
    return None


def _mini_batches(cfg: RunSections, _: Context) -> str | None:
    t = cfg.trainer
    if t.prompts_per_step % t.mini_batches_per_step != 0:
        return (
            f"trainer.mini_batches_per_step={t.mini_batches_per_step} must divide "
            f"trainer.prompts_per_step={t.prompts_per_step}"
        )
    return None


RULES: tuple[Rule, ...] = (
    Rule(("algo.distill.only", "algo.distill.kind"), _distill_only),
    Rule(("algo.distill.teacher_hf_dir", "algo.distill.kind"), _teacher_dir),
    Rule(("algo.kl.pba.min_correct", "algo.kl.pba.base_samples"), _pba_counts),
    Rule(("algo.demonstrations", "algo.advantage.kind", "algo.armor.anchors"), _demonstrations),
    Rule(
        ("algo.armor", "algo.kl.coef", "algo.kl.pba.enabled", "algo.distill.kind", "algo.rollout_correction.kind"),
        _armor_alone,
    ),
    Rule(("algo.armor.anchors", "rollout.group_size"), _anchor_group),
    Rule(("rollout.min_new_tokens", "rollout.max_new_tokens"), _min_new_tokens),
    Rule(("rollout.engine_ranks", "rollout.placement"), _engine_ranks),
    Rule(("data.system_prompt", "data.chat_template"), _system_prompt),
    Rule(("actor.lora",), _lora_spec),
    Rule(("reward.plugins", "reward.synlogic_dir"), _verifiers),
    Rule(("environment.name", "rollout.prefix_model"), _environment),
    Rule(
        (
            "rollout.max_staleness",
            "rollout.placement",
            "environment.name",
            "rollout.prefix_model",
            "actor.router_replay",
        ),
        _max_staleness,
        "validate",
    ),
    Rule(("rollout.engine_ranks", "rollout.tp"), _separate_placement, "validate"),
    Rule(("actor.tp", "actor.pp", "actor.vpp", "actor.cp", "actor.ep", "actor.etp"), _layout, "validate"),
    Rule(("actor.router_replay", "actor.moe_aux_loss_coeff", "rollout.return_routed_experts"), _experts, "validate"),
    Rule(("actor.lora.sync", "rollout.check_sync", "rollout.max_staleness"), _lora_sync, "validate"),
    Rule(("algo.armor", "actor.lora", "rollout.placement", "actor.router_replay"), _anchors_placement, "validate"),
    Rule(("algo.distill.crpo.teacher", "actor.lora"), _ema_teacher, "validate"),
    Rule(
        ("rollout.max_new_tokens", "eval.max_new_tokens", "data.max_prompt_tokens", "rollout.max_model_len"),
        _token_budgets,
        "validate",
    ),
    Rule(("reward.overlong_buffer", "rollout.max_new_tokens"), _overlong_buffer, "validate"),
    Rule(("trainer.mini_batches_per_step", "trainer.prompts_per_step"), _mini_batches, "validate"),
)


def check(cfg: RunSections, phase: Literal["load", "validate"], context: Context = Context()) -> None:
    """Raise the first broken rule of ``phase`` as a one-line error."""
    for rule in RULES:
        if rule.phase == phase:
            message = rule.check(cfg, context)
            if message is not None:
                raise ConfigError(message)


def rules_of(key: str) -> list[Rule]:
    """The rules that relate ``key`` (or a field inside it)."""
    return [r for r in RULES if any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in r.keys)]
