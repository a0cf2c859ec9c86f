"""`ParallelLayout`: how the actor's model is cut over ranks (TP, PP, VPP, CP, EP, ETP, sequence parallelism, packed
streams), and the one statement of what makes a layout valid for a model and a world (`ParallelLayout.problems`).

The run config (`Config.validate`, so `train`, `plan` and the launchers), the actor and the model builder all call
`problems` / `check`, so the same bad layout gets the same one-line message everywhere. Each message names the key,
what was expected and, where one exists, the fix: the sizes that would divide, or the nearest layout that fits.

``prefix`` is how the sizes are named in messages: ``actor.`` for a run config, empty for the builder's own
arguments (``tp=2``). ``training`` adds what only a training step needs (megatron-core's MoE layer asserts sequence
parallelism at TP > 1 in training, not in a forward-only pass).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_rlvr.errors import ConfigError
from megatron_rlvr.models.dims import ModelDims


class LayoutError(ConfigError):
    """A parallel layout that does not fit the model or the ranks; the message names the key and the fix."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values))


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel sizes of one model replica and the switches that constrain them (plain data)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages per rank (the interleaved schedule)
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    pack_sequences: bool = True

    @property
    def model_parallel(self) -> int:
        """Ranks one replica spans (before data parallelism): tp * pp * cp."""
        return self.tp * self.pp * self.cp

    def check(
        self,
        dims: ModelDims | None = None,
        world: int | None = None,
        *,
        prefix: str = "actor.",
        training: bool = True,
        world_name: str | None = None,
    ) -> None:
        """Raise `LayoutError` with the first of `problems`."""
        found = self.problems(dims, world, prefix=prefix, training=training, world_name=world_name)
        if found:
            raise LayoutError(found[0])

    def problems(
        self,
        dims: ModelDims | None = None,
        world: int | None = None,
        *,
        prefix: str = "actor.",
        training: bool = True,
        world_name: str | None = None,
    ) -> list[str]:
        """Every reason this layout cannot run ``dims`` (None: not known yet) on ``world`` ranks (None: not known),
        one line each, most basic first. ``world_name`` says what the world is, for the message (default: "the
        world size N")."""
        found = self._own_problems(prefix)
        if found:  # sizes below 1 make every later rule meaningless
            return found
        if dims is not None:
            found += self._model_problems(dims, prefix)
        if world is not None:
            found += self._world_problems(dims, world, prefix, world_name or f"the world size {world}")
        if training and dims is not None and dims.is_moe and self.tp > 1 and not self.sequence_parallel:
            found.append(  # megatron-core's MoE layer asserts it in training
                f"{prefix}sequence_parallel: must be true for a mixture-of-experts model at {prefix}tp={self.tp}; "
                f"set {prefix}sequence_parallel=true (or {prefix}tp=1)"
            )
        return found

    # ------------------------------------------------------------------------------------------------------------
    def _own_problems(self, p: str) -> list[str]:
        found = [f"{p}{key}: must be >= 1, got {value}" for key, value in self._sizes().items() if value < 1]
        if found:
            return found
        if self.sequence_parallel and self.tp < 2:
            found.append(f"{p}sequence_parallel: needs {p}tp >= 2; set {p}sequence_parallel=false")
        if self.cp > 1 and not self.pack_sequences:
            found.append(
                f"{p}cp > 1 needs {p}pack_sequences=true: context parallelism splits packed streams (or set {p}cp=1)"
            )
        if self.vpp is not None and self.pp < 2:
            found.append(
                f"{p}vpp: virtual pipeline stages need {p}pp >= 2, got pp={self.pp}; set {p}vpp=null or {p}pp >= 2"
            )
        if self.vpp is not None and not self.pack_sequences:
            # the interleaved schedule exchanges one activation shape: packed streams are padded to it, [b, S] blocks
            # of varying b are not (actor/passes.py)
            found.append(f"{p}vpp: the interleaved schedule needs {p}pack_sequences=true")
        return found

    def _sizes(self) -> dict[str, int]:
        sizes = {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "etp": self.etp}
        if self.vpp is not None:
            sizes["vpp"] = self.vpp
        return sizes

    def _model_problems(self, dims: ModelDims, p: str) -> list[str]:
        found = []
        heads = {"num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads}
        bad = [f"{name}={n}" for name, n in heads.items() if n % self.tp]
        if bad:
            would = divisors(math.gcd(dims.heads, dims.kv_heads))
            found.append(
                f"{p}tp={self.tp} must divide the model's {' and '.join(bad)}; TPs that would: {_listed(would)}"
            )
        stages = self.pp * (self.vpp or 1)
        if dims.layers % stages:
            name = f"{p}pp * {p}vpp = {stages}" if self.vpp else f"{p}pp={self.pp}"
            vpp = self.vpp or 1
            would = [q for q in divisors(dims.layers) if dims.layers % (q * vpp) == 0 and (q >= 2 or not self.vpp)]
            found.append(
                f"{name} must divide the model's num_hidden_layers={dims.layers}; "
                f"{p}pp that would{f' at {p}vpp={vpp}' if self.vpp else ''}: {_listed(would)}"
            )
        if not dims.is_moe:
            if self.ep > 1 or self.etp > 1:
                found.append(
                    f"{p}ep={self.ep}, {p}etp={self.etp}: expert parallelism needs a mixture-of-experts model, and "
                    f"this is a dense model; set {p}ep=1 {p}etp=1"
                )
            return found
        if dims.experts % self.ep:
            found.append(
                f"{p}ep={self.ep} must divide the model's num_experts={dims.experts}; EPs that would: "
                f"{_listed(divisors(dims.experts))}"
            )
        if dims.expert_ffn % self.etp:
            found.append(
                f"{p}etp={self.etp} must divide the model's moe_intermediate_size={dims.expert_ffn}; ETPs that would: "
                f"{_listed([d for d in divisors(dims.expert_ffn) if d <= 64])}"
            )
        return found

    def _world_problems(self, dims: ModelDims | None, world: int, p: str, world_name: str) -> list[str]:
        if world % self.model_parallel:
            if self.cp > 1:
                sizes = f"{p}tp * {p}pp * {p}cp = {self.tp} * {self.pp} * {self.cp} = {self.model_parallel}"
            else:
                sizes = f"{p}tp * {p}pp = {self.tp} * {self.pp} = {self.model_parallel}"
            nearest = self.nearest(dims, world)
            fix = ""
            if nearest is not None:
                changed = [f"{p}{k}={v}" for k, v in nearest._sizes().items() if v != self._sizes().get(k)]
                if nearest.sequence_parallel != self.sequence_parallel:
                    changed.append(f"{p}sequence_parallel={str(nearest.sequence_parallel).lower()}")
                fix = f"; nearest layout that fits: {' '.join(changed)}"
            return [f"{sizes} must divide {world_name}{fix}"]
        dp_cp_tp = world // self.pp
        if dp_cp_tp % (self.ep * self.etp):
            return [
                f"{p}ep * {p}etp = {self.ep} * {self.etp} must divide dp * cp * tp = {dp_cp_tp} ({world_name} / "
                f"{p}pp {self.pp}); EP x ETP that would: {_listed(divisors(dp_cp_tp))}"
            ]
        return []

    def nearest(self, dims: ModelDims | None, world: int) -> ParallelLayout | None:
        """The valid layout on ``world`` ranks closest to this one (TP, PP and CP changed by the fewest doublings;
        EP, ETP and VPP kept), or None when there is none."""
        best: tuple[float, int, ParallelLayout] | None = None
        for tp in divisors(world):
            for pp in divisors(world // tp):
                for cp in divisors(world // (tp * pp)):
                    sp = self.sequence_parallel and tp > 1
                    if dims is not None and dims.is_moe and tp > 1:
                        sp = True
                    candidate = dataclasses.replace(self, tp=tp, pp=pp, cp=cp, sequence_parallel=sp)
                    if candidate.problems(dims, world, prefix=""):
                        continue
                    cost = sum(abs(math.log2(a / b)) for a, b in ((tp, self.tp), (pp, self.pp), (cp, self.cp)))
                    key = (cost, tp * pp * cp, candidate)
                    if best is None or key[:2] < best[:2]:
                        best = key
        return best[2] if best else None
