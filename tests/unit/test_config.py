"""Config loading: YAML + dotted overrides, and one test per class of bad input asserting the message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_rlvr.config import Config, dump_config, load_config
from megatron_rlvr.errors import ConfigError, UserError
from megatron_rlvr.models.dims import ModelDims

REPO = Path(__file__).resolve().parents[2]


def _dims(**shape) -> ModelDims:
    """A model's shapes for the layout rules: 8 heads, 2 KV heads, 4 layers unless given."""
    base = dict(hidden=64, ffn=128, layers=4, heads=8, kv_heads=2, head_dim=8, vocab=100, tied=False, qkv_bias=False)
    return ModelDims(**(base | shape))


def _write(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_are_typed(tmp_path):
    path = _write(tmp_path, "actor:\n  tp: 2\nalgo:\n  loss:\n    kind: grpo\n")
    cfg = load_config(path, ["algo.loss.alpha=0.05", "actor.pp=1", 'rollout.stop=["\\n"]', "checkpoint.resume=null"])
    assert cfg.actor.tp == 2 and cfg.algo.loss.kind == "grpo"
    assert cfg.algo.loss.alpha == 0.05 and isinstance(cfg.algo.loss.alpha, float)
    assert cfg.rollout.stop == ["\n"]
    assert cfg.checkpoint.resume is None
    # an int given for a float field is accepted and converted
    assert isinstance(load_config(None, ["algo.loss.alpha=1"]).algo.loss.alpha, float)


def test_dump_then_load_roundtrips(tmp_path):
    cfg = load_config(None, ["actor.tp=2", "algo.loss.top_n=5"])
    again = load_config(_write(tmp_path, dump_config(cfg)))
    assert again == cfg


def test_unknown_key_names_key_and_allowed(tmp_path):
    with pytest.raises(
        ConfigError, match=r"algo\.loss\.alhpa: unknown key; did you mean algo\.loss\.alpha\? allowed keys: .*alpha"
    ):
        load_config(None, ["algo.loss.alhpa=0.1"])
    with pytest.raises(ConfigError, match=r"^actorr: unknown key; did you mean actor\? allowed keys: actor, algo"):
        load_config(_write(tmp_path, "actorr:\n  tp: 2\n"))


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"actor\.tp: expected int, got 'two'"):
        load_config(None, ["actor.tp=two"])
    with pytest.raises(ConfigError, match=r"actor\.sequence_parallel: expected bool \(true/false\), got 3"):
        load_config(None, ["actor.sequence_parallel=3"])
    with pytest.raises(ConfigError, match=r"algo\.loss\.kind: got 'ppo'; allowed values: 'grpo', 'casp'"):
        load_config(None, ["algo.loss.kind=ppo"])
    with pytest.raises(ConfigError, match=r"actor: expected a mapping of keys, got int"):
        load_config(None, ["actor=3"])


def test_bad_parallel_sizes_name_the_constraint():
    with pytest.raises(
        ConfigError,
        match=r"^actor\.tp \* actor\.pp = 2 \* 2 = 4 must divide the world size 2; nearest layout that fits: "
        r"actor\.tp=1$",
    ):
        load_config(None, ["actor.tp=2", "actor.pp=2"]).validate(world_size=2)
    with pytest.raises(
        ConfigError, match=r"^actor\.tp=4 must divide the model's num_key_value_heads=2; TPs that would: 1, 2$"
    ):
        load_config(None, ["actor.tp=4"]).validate(world_size=4, dims=_dims())
    with pytest.raises(
        ConfigError, match=r"^actor\.tp=2 must divide the model's num_attention_heads=9 and num_key_value_heads=3; TPs"
    ):
        load_config(None, ["actor.tp=2"]).validate(world_size=2, dims=_dims(heads=9, kv_heads=3))
    with pytest.raises(
        ConfigError, match=r"^actor\.pp=3 must divide the model's num_hidden_layers=4; actor\.pp that would: 1, 2, 4$"
    ):
        load_config(None, ["actor.pp=3"]).validate(world_size=3, dims=_dims())
    with pytest.raises(ConfigError, match=r"^actor\.pp \* actor\.vpp = 6 must divide the model's num_hidden_layers=4"):
        load_config(None, ["actor.pp=3", "actor.vpp=2"]).validate(world_size=3, dims=_dims())
    with pytest.raises(ConfigError, match=r"actor\.tp: must be >= 1, got 0"):
        load_config(None, ["actor.tp=0"]).validate(world_size=1)
    with pytest.raises(ConfigError, match=r"actor\.vpp: virtual pipeline stages need actor\.pp >= 2"):
        load_config(None, ["actor.vpp=2"]).validate(world_size=1)
    with pytest.raises(ConfigError, match=r"actor\.vpp: the interleaved schedule needs actor\.pack_sequences=true"):
        load_config(None, ["actor.pp=2", "actor.vpp=2", "actor.pack_sequences=false"]).validate(world_size=2)


def test_bad_context_parallel_layouts_name_the_keys():
    bad = [
        (["actor.cp=2"], 3, r"^actor\.tp \* actor\.pp \* actor\.cp = 1 \* 1 \* 2 = 2 must divide the world size 3; "),
        (["actor.cp=2", "actor.tp=2"], 2, r"actor\.tp \* actor\.pp \* actor\.cp = 2 \* 1 \* 2 = 4 must divide"),
        (["actor.cp=2", "actor.pack_sequences=false"], 2, r"^actor\.cp > 1 needs actor\.pack_sequences=true"),
        (["actor.cp=0"], 1, r"^actor\.cp: must be >= 1, got 0$"),
        # megatron-core forms expert groups over world / pp = dp * cp * tp ranks
        (["actor.cp=2", "actor.ep=8"], 4, r"actor\.ep \* actor\.etp = 8 \* 1 must divide dp \* cp \* tp = 4"),
        (
            ["actor.cp=2", "rollout.placement=separate", "rollout.engine_ranks=1"],
            4,
            r"actor\.tp \* actor\.pp \* actor\.cp = 1 \* 1 \* 2 = 2 must divide the actor's ranks: world size 4",
        ),
    ]
    for overrides, world, message in bad:
        with pytest.raises(ConfigError, match=message) as e:
            load_config(None, overrides).validate(world_size=world)
        assert "\n" not in str(e.value)
    load_config(None, ["actor.cp=2", "actor.ep=4"]).validate(world_size=4)  # ep over dp * cp: allowed
    load_config(None, ["actor.cp=2", "actor.tp=2"]).validate(world_size=8)


def test_routing_replay_needs_experts_and_under_rollout_the_engines_routing():
    with pytest.raises(ConfigError, match=r"^actor\.router_replay=rollout replays the engine's routing: set rollout\."):
        load_config(None, ["actor.router_replay=rollout"]).validate(world_size=1)
    with pytest.raises(
        ConfigError, match=r"^actor\.router_replay=train: set for a dense model \(no num_experts\); set"
    ):
        load_config(None, ["actor.router_replay=train"]).validate(world_size=1, dims=_dims())
    moe = _dims(experts=8, experts_per_token=2, expert_ffn=32, moe_pattern=(1, 1, 1, 1))
    load_config(None, ["actor.router_replay=rollout", "rollout.return_routed_experts=true"]).validate(
        world_size=2, dims=moe
    )


def test_prompt_plus_answer_must_fit_the_engine_context():
    with pytest.raises(
        ConfigError,
        match=r"rollout\.max_new_tokens=100 \+ data\.max_prompt_tokens=50 exceeds "
        r"rollout\.max_model_len=128",
    ):
        load_config(
            None, ["rollout.max_new_tokens=100", "data.max_prompt_tokens=50", "rollout.max_model_len=128"]
        ).validate()
    validation = [
        "trainer.eval_every=5",
        "eval.max_new_tokens=100",
        "data.max_prompt_tokens=50",
        "rollout.max_new_tokens=8",
        "rollout.max_model_len=128",
    ]
    with pytest.raises(ConfigError, match=r"eval\.max_new_tokens=100 .* \(validation: trainer\.eval_every > 0\)"):
        load_config(None, validation).validate()
    load_config(None, [*validation, "trainer.eval_every=0"]).validate()  # no validation: its budget is not used


def test_bad_files_and_overrides_name_the_thing(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*missing\.yaml: not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_config(_write(tmp_path, "actor: [unclosed\n"))
    with pytest.raises(ConfigError, match=r"expected a mapping of sections, got list"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match=r"override 'actor\.tp': expected KEY=VALUE"):
        load_config(None, ["actor.tp"])
    with pytest.raises(ConfigError, match=r"override 'actor\.tp\.x=1': tp is a value, not a section"):
        load_config(None, ["actor.tp=2", "actor.tp.x=1"])


def test_differences_name_every_changed_key():
    from megatron_rlvr.config import differences, to_dict

    old = json.loads(json.dumps(to_dict(load_config(None, ["rollout.stop=[a]"]))))  # as a checkpoint keeps it
    new = to_dict(load_config(None, ["rollout.stop=[a]", "actor.lr=0.5", "trainer.steps=20"]))
    assert differences(old, new) == ["actor.lr: 1e-06 -> 0.5", "trainer.steps: 10 -> 20"]
    assert differences(old, old) == []


def test_a_stored_config_without_a_key_added_since_reads_it_at_its_default():
    """A checkpoint written before a knob existed ran without it: resuming it under the knob's default is no change,
    and setting the knob is one."""
    from megatron_rlvr.config import differences, to_dict, upgraded

    stored = json.loads(json.dumps(to_dict(load_config(None))))
    del stored["algo"]["armor"], stored["algo"]["mask_truncated"]  # as a run written before them keeps it
    assert differences(stored, to_dict(load_config(None)))  # read as it is, the missing keys differ
    assert differences(upgraded(stored), to_dict(load_config(None))) == []
    changed = to_dict(load_config(None, ["algo.mask_truncated=true"]))
    assert differences(upgraded(stored), changed) == ["algo.mask_truncated: False -> True"]


def test_defaults_validate():
    assert Config().validate(world_size=1)


def test_an_unknown_key_names_the_nearest_known_one():
    with pytest.raises(ConfigError, match=r"^actor\.tpp: unknown key; did you mean actor\.tp\? allowed keys: "):
        load_config(None, ["actor.tpp=2"])
    with pytest.raises(ConfigError, match=r"^algo\.zzz: unknown key; allowed keys: "):  # nothing near: no guess
        load_config(None, ["algo.zzz=1"])


def test_a_removed_key_names_its_replacement(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.dtype: removed; set actor\.bf16 .*eval\.dtype"):
        load_config(_write(tmp_path, "model:\n  hf_dir: x\n  dtype: bfloat16\n"))
    with pytest.raises(ConfigError, match=r"^trainer\.off_policy_steps: removed; set rollout\.max_staleness \(0: "):
        load_config(None, ["trainer.off_policy_steps=1"])


def _config_fields(cls, prefix=""):
    """(dotted key, field name) of every leaf under section ``cls`` (sections, and ``X | None`` ones, recursed)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        section = next(
            (t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)), None
        )
        if section is not None:
            yield from _config_fields(section, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.name


def test_every_config_key_is_read_by_the_package():
    """A key that nothing reads changes nothing: each leaf of Config must be read (``.name`` or ``getattr(x,
    "name"``) somewhere in the package outside the modules that define the config dataclasses."""
    import re
    import typing
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "megatron_rlvr"
    sources = "\n".join(
        p.read_text() for p in package.rglob("*.py") if p.name != "config.py" and p.parent.name != "config"
    )
    unread = []
    for section, cls in typing.get_type_hints(Config).items():
        for key, name in _config_fields(cls, f"{section}."):
            if not re.search(rf"\.{name}\b|getattr\([^)]*[\"']{name}[\"']", sources):
                unread.append(key)
    assert not unread, f"config keys nothing reads: {unread}"


def test_preflight_names_the_missing_input_and_its_fix(tmp_path, monkeypatch):
    demo = ["model.hf_dir=megatron_rlvr/demo/model"]
    monkeypatch.chdir(REPO)
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", demo)
    assert cfg.preflight(2) is cfg
    with pytest.raises(ConfigError, match=r"must divide the world size 3; nearest layout that fits: actor.tp=1"):
        cfg.preflight(3)
    cases = {
        f"model.hf_dir={tmp_path}": rf"model.hf_dir={tmp_path}: not an HF model directory .*`megatron-rlvr convert",
        "model.hf_dir=nowhere": r"model.hf_dir=nowhere \(relative to .*\): not an HF model directory",
        f"model.load={tmp_path / 'ckpt'}": r"model.load=.*: not found; .*megatron-rlvr convert hf-to-mcore",
        f"data.path={tmp_path / 'x.jsonl'}": r"data.path: dataset file .*x.jsonl: not found; write it with "
        r"`megatron-rlvr data prepare NAME ... --out .*x.jsonl`",
    }
    for override, message in cases.items():
        with pytest.raises(UserError, match=message):
            load_config(REPO / "configs" / "demo_cpu.yaml", [override]).check_inputs()
    monkeypatch.setitem(sys.modules, "vllm", None)  # as where it is not installed: find_spec and imports fail
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm: the vllm package is not installed; pip install"):
        cfg.check_inputs()


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["rollout.check_sync=true"], "rollout.check_sync=true reads weights back"),
        (
            ["rollout.placement=separate", "rollout.engine_ranks=1", "rollout.max_staleness=2"],
            "actor.lora.sync=adapters with rollout.max_staleness=2: responses in flight cannot change adapter",
        ),
    ],
)
def test_served_adapters_refuse_what_the_engines_cannot_do(overrides, says):
    lora = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.sync=adapters"]
    with pytest.raises(ConfigError) as e:
        load_config(None, lora + overrides).validate(world_size=3, dims=_dims())
    assert says in str(e.value) and "\n" not in str(e.value)
    load_config(None, [*lora[:2], "actor.lora.sync=merged", *overrides]).validate(world_size=3, dims=_dims())


# ---------------------------------------------------------------------------------------------------------------
# Declared fields, the old keys, explain


def test_every_field_declares_its_doc():
    """Each key's doc is the field's own (megatron_rlvr/settings.py), what `megatron-rlvr config explain` prints."""
    import dataclasses
    import typing

    from megatron_rlvr.settings import doc_of

    def undocumented(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not doc_of(f):
                yield prefix + f.name
            section = next(
                (t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)), None
            )
            if section is not None:
                yield from undocumented(section, f"{prefix}{f.name}.")

    assert list(undocumented(Config, "")) == []


def test_limits_are_checked_once_by_the_loader_naming_the_key():
    cases = {
        "algo.loss.alpha=1.5": r"^algo\.loss\.alpha: expected in \[0, 1\], got 1\.5$",
        "algo.distill.crpo.tau=0": r"^algo\.distill\.crpo\.tau: expected > 0, finite, got 0$",
        "rollout.top_p=0": r"^rollout\.top_p: expected in \(0, 1\], got 0$",
        "rollout.prefix_cut=[0.8, 0.2]": r"^rollout\.prefix_cut: expected a range \[lo, hi\] with 0 <= lo <= hi <= 1",
        "environment.observation_role=''": r"^environment\.observation_role: expected a chat role such as 'tool'",
        "actor.micro_batch_size=0": r"^actor\.micro_batch_size: expected >= 1, got 0$",
        "reward.overlong_penalty=-1": r"^reward\.overlong_penalty: expected >= 0, got -1$",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    # a dataclass built in code is its author's: nothing checks it there (the loader is the one place)
    from megatron_rlvr.algos.config import LossConfig

    assert LossConfig(alpha=1.5).alpha == 1.5


def test_derived_facts_are_read_only_properties():
    """Nothing the loader returns is changed after it: ARMOR's share and the reference are read, not stored."""
    cfg = load_config(None, ["algo.loss.kind=grpo", "algo.armor.anchors=true", "rollout.group_size=8"])
    assert cfg.algo.armor.mixed_ratio_share is None  # what the recipe said
    assert cfg.algo.mixed_ratio_share(cfg.rollout.group_size) == 7 / 8 and cfg.algo.needs_reference
    assert not load_config(None, ["algo.kl.coef=0"]).algo.needs_reference
    pba = load_config(None, ["algo.kl.pba.enabled=true"]).algo
    assert (
        pba.needs_reference
        and not load_config(None, ["algo.kl.pba.enabled=true", "algo.kl.pba.coef=0"]).algo.needs_reference
    )


def test_an_old_key_fails_with_one_line_naming_the_new_one(tmp_path):
    from megatron_rlvr.config.renamed import BECAME_SECTIONS, RENAMED

    for old, new in RENAMED.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{old}=1"])
        assert str(e.value) == f"{old}: renamed; set {new}", old
    for old, new in BECAME_SECTIONS.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{old}=x"])
        assert str(e.value) == f"{old}: now a section; set {new} (e.g. {new}=x)", old
    # a recipe written before the split: its first old key, in YAML too; an override on top of it
    recipe = _write(tmp_path, "algo:\n  loss: casp\n  alpha: 0.1\n")
    with pytest.raises(ConfigError, match=r"^algo\.alpha: renamed; set algo\.loss\.alpha$"):
        load_config(recipe)
    with pytest.raises(
        ConfigError, match=r"^algo\.loss: now a section; set algo\.loss\.kind \(e\.g\. algo\.loss\.kind=casp\)$"
    ):
        load_config(_write(tmp_path, "algo:\n  loss: casp\n"), ["algo.loss.kind=grpo"])


OLD_RUN_CONFIG = REPO / "tests" / "unit" / "configs" / "data" / "flat_algo_config.yaml"


def test_a_run_config_with_flat_algo_keys_resumes_with_todays_keys():
    """A checkpoint stores its run's config (`to_dict`); one written before algo split into sections is read with
    today's keys (`upgraded`), so resuming it compares like with like: no difference for the same settings, and a
    real change is named by its new key. Loading that old file as a recipe is the one line naming the new key."""
    import yaml

    from megatron_rlvr.config import differences, to_dict, upgraded

    old = yaml.safe_load(OLD_RUN_CONFIG.read_text())
    overrides = [
        "trainer.steps=2",
        "trainer.eval_every=0",
        "checkpoint.save_every=0",
        "trainer.save_hf=false",
        "trainer.tensorboard=false",
        "data.demo_train_problems=64",
        "trainer.output_dir=outputs/old_demo",
    ]
    now = load_config(REPO / "configs" / "demo_cpu.yaml", overrides)
    assert "alpha" in old["algo"] and differences(old, to_dict(now))  # the flat keys differ as they are
    assert differences(upgraded(old), to_dict(now)) == []
    changed = load_config(REPO / "configs" / "demo_cpu.yaml", [*overrides, "algo.loss.alpha=0.3"])
    assert differences(upgraded(old), to_dict(changed)) == ["algo.loss.alpha: 0.2 -> 0.3"]
    with pytest.raises(ConfigError, match=r"^algo\.adv_eps: renamed; set algo\.advantage\.eps$"):  # its first old key
        load_config(OLD_RUN_CONFIG)


def test_config_explain_prints_doc_default_and_limits(capsys):
    from megatron_rlvr.cli import main

    assert main(["config", "explain", "algo.distill.crpo.tau"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "algo.distill.crpo.tau: float = 1.0"
    assert out[1] == "  limits: > 0, finite"
    assert out[2] == "  The temperature of the contrast's softmax over sim."
    assert main(["config", "explain", "algo.kl.pba.min_correct"]) == 0
    assert "  checked with: algo.kl.pba.base_samples" in capsys.readouterr().out.splitlines()
    assert main(["config", "explain", "algo.distill.crpo"]) == 0  # a section: one line per field
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("algo.distill.crpo: CRPO's knobs")
    assert "  algo.distill.crpo.tau = 1.0; > 0, finite" in lines
    assert "  algo.distill.crpo.teacher = 'frozen'; one of 'frozen' | 'ema'" in lines
    assert main(["config", "explain", "algo.crpo_tau"]) == 2  # an old key: what to set instead
    assert capsys.readouterr().err.strip() == "error: algo.crpo_tau: renamed; set algo.distill.crpo.tau"
    assert main(["config", "explain", "algo.distil"]) == 2
    assert "algo.distil: unknown key; did you mean algo.distill?" in capsys.readouterr().err
