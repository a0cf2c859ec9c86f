"""The wings talk through declared interfaces: nothing outside the actor's module touches its private attributes, the
loop's `Run` is typed with protocols (no `Any`), and `MegatronActor` has every member of the protocols it is given as."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ACTOR_MODULE = ROOT / "megatron_rlvr" / "actor" / "megatron_actor.py"
SCANNED = ("megatron_rlvr", "tools", "launch", "tests")


def _private_names_of_the_actor() -> set[str]:
    """Every ``_name`` the actor class defines: its methods and the attributes it assigns on ``self``."""
    tree = ast.parse(ACTOR_MODULE.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MegatronActor"]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    for node in ast.walk(cls):
        on_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        if on_self and node.attr.startswith("_") and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if not n.startswith("__")}


def _private_uses(path: Path, names: set[str]) -> list[str]:
    """``x.<name>`` for a name in ``names`` where ``x`` is not ``self``: a reach into another object's insides."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if isinstance(node, ast.Attribute) and node.attr in names and not own:
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            found.append(f"{where}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_outside_the_actor_touches_its_private_attributes():
    names = _private_names_of_the_actor()
    assert {"_rescore", "_all_finite"} <= names  # the scan sees the class
    found = []
    for top in SCANNED:
        for path in (ROOT / top).rglob("*.py"):
            if path != ACTOR_MODULE and "__pycache__" not in path.parts:
                found += _private_uses(path, names)
    assert not found, "private attributes of the actor used outside its module:\n" + "\n".join(found)


def test_the_scan_sees_a_reach_into_the_actor(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(actor):\n    return actor._rescore([])\n\n\ndef g(self):\n    return self._rescore([])\n")
    assert _private_uses(bad, {"_rescore"}) == [f"{bad}:2: ._rescore"]


def test_the_loops_run_has_no_any_field_and_its_types_resolve():
    from typing import get_type_hints

    from tqdm import tqdm

    from megatron_rlvr import trainer
    from megatron_rlvr.experience.collect import Experience
    from megatron_rlvr.experience.source import ExperienceSource
    from megatron_rlvr.experience.transforms import Transforms
    from megatron_rlvr.monitor import MetricLogger
    from megatron_rlvr.runtime.roles import Roles

    fields = dataclasses.fields(trainer.Run)
    assert [f.name for f in fields if "Any" in str(f.type)] == []
    names = vars(trainer) | {
        "tqdm": tqdm,
        "Experience": Experience,
        "ExperienceSource": ExperienceSource,
        "Transforms": Transforms,
        "MetricLogger": MetricLogger,
        "Roles": Roles,
    }
    hints = get_type_hints(trainer.Run, globalns=names)
    assert hints["actor"].__name__ == "Actor" and hints["source"] is ExperienceSource
    assert hints["transforms"] is Transforms


def _protocol_members(protocol: type) -> dict[str, inspect.Signature]:
    members = {}
    for base in reversed(protocol.__mro__):
        if base is object or not getattr(base, "_is_protocol", False):
            continue
        for name, value in vars(base).items():
            if inspect.isfunction(value) and not name.startswith("_"):
                members[name] = inspect.signature(value)
    return members


def test_the_megatron_actor_has_every_member_of_the_actor_protocol_with_its_parameters():
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.protocols import Actor

    members = _protocol_members(Actor)
    assert {"score", "update", "export_weights", "sharded_state_dict", "compute_entropy"} <= set(members)
    for name, wanted in members.items():
        have = inspect.signature(getattr(MegatronActor, name))
        assert list(have.parameters) == list(wanted.parameters), (name, have, wanted)
        for param in wanted.parameters.values():
            assert have.parameters[param.name].kind == param.kind, (name, param.name)
