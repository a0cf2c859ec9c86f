"""The plan's terms of a teacher pass (``algo.distill.kind``: teacher, self or crpo; actor/teacher.py): the top-N the
teacher's pass runs the fused op with, and the scores it gathers to every rank.

The teacher's weights themselves are counted with the actor's (actor_terms.teacher_bytes): a model of its own shapes
(``teacher``) or one more copy of the student (``self``, ``crpo``).
"""

from __future__ import annotations

from megatron_rlvr.algos.config import AlgoConfig


def teacher_top_n(algo: AlgoConfig) -> int:
    """The N of the teacher's top-N ids (0: no teacher pass): ``algo.distill.crpo.top_k`` under crpo, else
    distill_top_n."""
    return {"none": 0, "crpo": algo.distill.crpo.top_k}.get(algo.distill.kind, algo.distill.top_n)


def teacher_scores_bytes(vocab: int, top_n: int, step_sequences: int, seq_len: int) -> int:
    """The teacher's gathered scores of the whole step on every rank: its log-prob, top-N ids and logits, (1 + 2N)
    float32 values per position, this rank's rows and the all-gathered batch (a bound: 2 copies)."""
    if not top_n:
        return 0
    return 2 * step_sequences * seq_len * (1 + 2 * min(top_n, vocab)) * 4
