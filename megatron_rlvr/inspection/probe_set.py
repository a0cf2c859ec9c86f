"""The fixed probe set: held-out prompts with responses the base model sampled, drawn once and saved, which every
checkpoint of the CaSP mechanism study is scored on teacher-forced (docs/casp-mechanism.md).

A `ProbeSet` holds, per prompt, its token ids and how many of the base's ``n`` samples were correct, and a list of
scored rows (prompt + one sampled response, the ids exactly as the engine sampled them):

- **probe rows**: the first ``keep`` samples of every prompt, whatever their reward: an unbiased draw of the base's
  own responses, where every token statistic is taken; ``forking`` lists the positions of each such response that
  are among the base's highest-entropy share (the per-response quantile ``tau_q`` of CaSP's mask, algos/token_masks);
- **rare rows**: every correct sample of a prompt the base solved in 1..``rare_max`` of ``n``: its rare correct
  answers, whose log-probability each checkpoint is asked for.

A sample can be both. The file is JSON (``save`` / ``load``), written atomically; ``digest`` names its content, and
every score file records the digest of the set it scored.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_rlvr.errors import UserError
from megatron_rlvr.protocols.handoffs import Sequences

PROBE_SET_FORMAT = "megatron-rlvr probe set 1"


class ProbeSetError(UserError, ValueError):
    """A probe-set file that is missing, malformed or not what a command expected: the message names it."""


@dataclass
class ProbePrompt:
    id: str
    prompt: str  # the problem's text (before the chat template)
    prompt_ids: list[int]  # what the model was given
    n: int  # samples the base drew
    correct: int  # of them correct


@dataclass
class ProbeRow:
    prompt: int  # index into ProbeSet.prompts
    sample: int  # which of the prompt's n samples
    ids: list[int]  # the response's token ids as the engine sampled them (its end-of-turn token included)
    reward: float
    probe: bool  # among the first `keep` samples: token statistics are taken on it
    rare: bool  # a correct sample of a prompt solved in 1..rare_max of n
    forking: list[int] = field(default_factory=list)  # response positions in the base's highest-entropy share


@dataclass
class ProbeSet:
    model: str  # the base model that drew the responses
    settings: dict[str, Any]  # how they were drawn (n, keep, rare_max, sampling, data, tau_q, ...)
    prompts: list[ProbePrompt]
    rows: list[ProbeRow]

    def digest(self) -> str:
        """sha256 of the prompts and rows (ids, rewards, roles, forking positions): what a score file names."""
        payload = json.dumps([[asdict(p) for p in self.prompts], [asdict(r) for r in self.rows]], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def batch(self, pad_id: int) -> Sequences:
        """Every row as one right-padded batch (prompt + response); ``response_mask[b, t]``: token t + 1 of row b is
        a response token, so statistic t of the actor's passes is that token's."""
        seqs = [self.prompts[r.prompt].prompt_ids + r.ids for r in self.rows]
        width = max(len(s) for s in seqs)
        tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
        for b, (row, seq) in enumerate(zip(self.rows, seqs)):
            tokens[b, : len(seq)] = torch.tensor(seq)
            start = len(self.prompts[row.prompt].prompt_ids) - 1
            mask[b, start : start + len(row.ids)] = True
        return Sequences(tokens=tokens, response_mask=mask)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROBE_SET_FORMAT,
            "model": self.model,
            "settings": self.settings,
            "digest": self.digest(),
            "prompts": [asdict(p) for p in self.prompts],
            "rows": [asdict(r) for r in self.rows],
        }

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")
        os.replace(tmp, path)
        return path


def from_json(data: Mapping[str, Any], where: str) -> ProbeSet:
    """A `ProbeSet` from its JSON form, or a ProbeSetError naming ``where`` and the first field that is wrong."""
    if not isinstance(data, Mapping) or data.get("format") != PROBE_SET_FORMAT:
        raise ProbeSetError(f'{where}: not a probe set (expected "format": {PROBE_SET_FORMAT!r})')
    try:
        prompts = [ProbePrompt(**p) for p in data["prompts"]]
        rows = [ProbeRow(**r) for r in data["rows"]]
        probe_set = ProbeSet(str(data["model"]), dict(data["settings"]), prompts, rows)
    except (KeyError, TypeError) as e:
        raise ProbeSetError(f"{where}: a field is missing or unexpected ({type(e).__name__}: {e})") from None
    for i, row in enumerate(rows):
        if not 0 <= row.prompt < len(prompts):
            raise ProbeSetError(f"{where}: rows[{i}].prompt = {row.prompt}, expected 0..{len(prompts) - 1}")
        if not row.ids:
            raise ProbeSetError(f"{where}: rows[{i}] has an empty response")
        if any(not 0 <= j < len(row.ids) for j in row.forking):
            raise ProbeSetError(f"{where}: rows[{i}].forking holds a position outside its {len(row.ids)} tokens")
    if not any(r.probe for r in rows):
        raise ProbeSetError(f"{where}: no probe rows")
    recorded = data.get("digest")
    if recorded is not None and recorded != probe_set.digest():
        raise ProbeSetError(f"{where}: its content does not match its digest {recorded} (edited or damaged)")
    return probe_set


def load(path: str | os.PathLike) -> ProbeSet:
    path = Path(path)
    if not path.is_file():
        raise ProbeSetError(f"{path}: no such probe set; draw one with `megatron-rlvr probe draw ... --out {path}`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProbeSetError(f"{path}: not JSON ({e})") from None
    return from_json(data, str(path))


def rows_of(prompt_index: int, prompt: ProbePrompt, samples: list[tuple[list[int], float]], keep: int, rare_max: int):
    """The scored rows of one prompt from its samples ((ids, reward) in sample order): the first ``keep``, and every
    correct one when the prompt was solved in 1..``rare_max`` of them."""
    rare = 1 <= prompt.correct <= rare_max
    out = []
    for s, (ids, reward) in enumerate(samples):
        is_probe, is_rare = s < keep, rare and reward >= 1.0
        if (is_probe or is_rare) and ids:
            out.append(ProbeRow(prompt_index, s, list(ids), float(reward), is_probe, is_rare))
    return out
