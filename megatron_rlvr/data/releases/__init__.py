"""Readers of the public training-set releases: a record as released -> one row of the prompt files `data/` reads.

Each release module defines a converter ``(record, options) -> Prepared`` (raising `Skip` with a reason for a
record that cannot be used: no answer, a level not asked for, a test format the verifiers do not run) and a
`Release` naming it with the layout it reads. `get_release` maps the names of ``megatron-rlvr data prepare NAME``
(`RELEASE_NAMES`) to them.
"""

from __future__ import annotations

from megatron_rlvr.data.releases import code, math, synlogic
from megatron_rlvr.data.releases.base import (
    Options,
    Prepared,
    Release,
    Skip,
    chat_text,
    content_id,
    first,
    normalize,
)

RELEASES: dict[str, Release] = {
    r.name: r for r in (math.MATH, math.GSM8K, math.DAPO, synlogic.SYNLOGIC, code.DEEPCODER, code.LIVECODEBENCH)
}
RELEASE_NAMES = tuple(RELEASES)


def get_release(name: str) -> Release:
    return RELEASES[name]


__all__ = [
    "RELEASES",
    "RELEASE_NAMES",
    "Options",
    "Prepared",
    "Release",
    "Skip",
    "chat_text",
    "content_id",
    "first",
    "get_release",
    "normalize",
]
