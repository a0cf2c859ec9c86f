"""Config loading: YAML + dotted overrides, and one test per class of bad input asserting the message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlvr.config import Config, dump_config, load_config
from megatron_rlvr.errors import ConfigError, UserError
from megatron_rlvr.models.dims import ModelDims

REPO = Path(__file__).resolve().parents[1]


def _dims(**shape) -> ModelDims:
    """A model's shapes for the layout rules: 8 heads, 2 KV heads, 4 layers unless given."""
    base = dict(hidden=64, ffn=128, layers=4, heads=8, kv_heads=2, head_dim=8, vocab=100, tied=False, qkv_bias=False)
    return ModelDims(**(base | shape))


def _write(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_are_typed(tmp_path):
    path = _write(tmp_path, "actor:\n  tp: 2\nalgo:\n  loss: grpo\n")
    cfg = load_config(path, ["algo.alpha=0.05", "actor.pp=1", 'rollout.stop=["\\n"]', "checkpoint.resume=null"])
    assert cfg.actor.tp == 2 and cfg.algo.loss == "grpo"
    assert cfg.algo.alpha == 0.05 and isinstance(cfg.algo.alpha, float)
    assert cfg.rollout.stop == ["\n"]
    assert cfg.checkpoint.resume is None
    # an int given for a float field is accepted and converted
    assert isinstance(load_config(None, ["algo.alpha=1"]).algo.alpha, float)


def test_dump_then_load_roundtrips(tmp_path):
    cfg = load_config(None, ["actor.tp=2", "algo.top_n=5"])
    again = load_config(_write(tmp_path, dump_config(cfg)))
    assert again == cfg


def test_unknown_key_names_key_and_allowed(tmp_path):
    with pytest.raises(
        ConfigError, match=r"algo\.alhpa: unknown key; did you mean algo\.alpha\? allowed keys: .*alpha"
    ):
        load_config(None, ["algo.alhpa=0.1"])
    with pytest.raises(ConfigError, match=r"^actorr: unknown key; did you mean actor\? allowed keys: actor, algo"):
        load_config(_write(tmp_path, "actorr:\n  tp: 2\n"))


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"actor\.tp: expected int, got 'two'"):
        load_config(None, ["actor.tp=two"])
    with pytest.raises(ConfigError, match=r"actor\.sequence_parallel: expected bool \(true/false\), got 3"):
        load_config(None, ["actor.sequence_parallel=3"])
    with pytest.raises(ConfigError, match=r"algo\.loss: got 'ppo'; allowed values: 'grpo', 'casp'"):
        load_config(None, ["algo.loss=ppo"])
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
    import dataclasses

    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
            yield from _config_fields(f.type, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.name


def test_every_config_key_is_read_by_the_package():
    """A key that nothing reads changes nothing: each leaf of Config must be read (``.name`` or ``getattr(x,
    "name"``) somewhere in the package outside the modules that define the config dataclasses."""
    import re
    import typing
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "megatron_rlvr"
    sources = "\n".join(p.read_text() for p in package.rglob("*.py") if p.name != "config.py")
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
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "vllm" else object())
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
