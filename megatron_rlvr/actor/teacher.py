"""The distillation teacher on the actor ranks: built beside the KL reference, frozen, scored with the fused op.

``build_teacher(actor, model_cfg, algo_cfg)`` returns a ``Teacher`` (or None under ``algo.distill: none``):
- ``teacher``: the model of ``algo.teacher_hf_dir`` (any size, the same tokenizer as the student: checked), built at
  the actor's TP/PP/VPP/CP like the reference, no optimizer, no grad, eval mode;
- ``self``: the frozen initial policy (the reference's chunks when the actor has a reference, else a copy built the
  same way) reading a privileged context: ``algo.self_distill_template`` with the item's reference answer, put
  before the whole sequence (prompt + response).

``Teacher.attach(actor, batch, items)`` runs ONE forward-only pass of the teacher over the batch (packed like every
actor pass) and fills ``batch.teacher_logp`` [B, S - 1], ``batch.teacher_ids`` [B, S - 1, N] and
``batch.teacher_logits`` [B, S - 1, N] (the teacher's logits / temperature at its top-N ids), every rank, in the
student's layout. Under ``self`` the pass runs on (prefix + prompt + response) streams with their own lengths: row i
is shifted by its prefix length k_i, its response mask too, and the scores come back at ``t + k_i`` -> ``t``, so the
teacher scores exactly the student's response tokens.

``student_logits_at(actor, logits, mb)`` is the student's side of the top-N forward KL inside the update's loss:
its logits / temperature at the teacher's ids (ops.given_ids), in the padded view the losses read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from megatron_rlvr.actor.context_parallel import stream_to_view
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.algos.distill import TeacherScores
from megatron_rlvr.errors import UserError
from megatron_rlvr.ops import vocab_parallel_token_stats
from megatron_rlvr.ops.given_ids import logits_at_ids

if TYPE_CHECKING:
    from megatron_rlvr.actor.batch import SequenceBatch
    from megatron_rlvr.data import PromptItem
    from megatron_rlvr.models.config import ModelConfig


class ActorPasses(Protocol):
    """What the teacher runs through: the actor's own layout, plan and schedule (megatron_actor.MegatronActor),
    so the teacher's pass is planned, packed and scheduled exactly as the reference's."""

    cfg: Any  # ActorConfig
    tcfg: Any  # megatron-core TransformerConfig
    temperature: float
    vocab_size: int
    local_vocab: int
    reference: list[torch.nn.Module] | None

    def _plan(self, batch: SequenceBatch) -> tuple[Any, list[Any]]: ...

    def _run_schedule(
        self, micro: list[Any], fn: Any, *, forward_only: bool, model: list[torch.nn.Module]
    ) -> list[dict]: ...

    def _to_every_rank(self, rows: list[torch.Tensor], plan: Any, size: int, width: int) -> torch.Tensor: ...

    def _build_chunks(self, model_cfg: ModelConfig) -> list[torch.nn.Module]: ...


def _vocab(hf_dir: str) -> dict[str, int]:
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(hf_dir).get_vocab())


def check_same_tokenizer(student_dir: str, teacher_dir: str) -> None:
    """One-line UserError unless the teacher's tokenizer maps every token to the student's id."""
    if not (Path(teacher_dir) / "config.json").is_file():
        raise UserError(f"algo.teacher_hf_dir={teacher_dir!r}: no config.json there (expected an HF model directory)")
    student, teacher = _vocab(student_dir), _vocab(teacher_dir)
    if student != teacher:
        differ = sum(teacher.get(tok) != i for tok, i in student.items()) + len(set(teacher) - set(student))
        raise UserError(
            f"algo.teacher_hf_dir={teacher_dir!r}: its tokenizer differs from model.hf_dir's "
            f"({differ} tokens differ; {len(teacher)} vs {len(student)} tokens); distillation needs the "
            "student's tokenizer"
        )


def reference_text(item: PromptItem) -> str:
    """The privileged context's answer of a prompt: its reference answer (a string or number, or a dict's
    ``solution`` / ``answer``); for the embedded countdown task, whose reference is (numbers, target), a solution
    expression of the task's own solver. One-line UserError when there is none."""
    answer = item.answer
    if isinstance(answer, dict):
        for key in ("solution", "answer"):
            if isinstance(answer.get(key), (str, int, float)) and str(answer[key]).strip():
                return str(answer[key])
        if item.task == "countdown" and "numbers" in answer and "target" in answer:
            from megatron_rlvr.tasks.countdown import solutions

            found = solutions(tuple(answer["numbers"]), int(answer["target"]))
            if found:
                return found[0]
    elif isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    elif isinstance(answer, str) and answer.strip():
        return answer
    raise UserError(
        f"algo.distill=self: prompt {item.id!r} has no reference answer to put in "
        f"algo.self_distill_template (its answer is {answer!r})"
    )


class PrivilegedContext:
    """Token ids of ``template.format(answer=reference_text(item))`` per prompt (cached by prompt id)."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        self.tokenizer, self.template = tokenizer, template
        self._ids: dict[str, list[int]] = {}

    def ids(self, item: PromptItem) -> list[int]:
        if item.id not in self._ids:
            text = self.template.format(answer=reference_text(item))
            self._ids[item.id] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._ids[item.id]


def privileged_batch(
    batch: SequenceBatch, prefixes: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[SequenceBatch, torch.Tensor]:
    """(prefix_i + tokens_i rows with the response mask shifted by k_i = len(prefix_i), the shifts k [B])."""
    from megatron_rlvr.actor.batch import SequenceBatch

    if len(prefixes) != len(batch):
        raise ValueError(f"prefixes: expected one per sequence ({len(batch)}), got {len(prefixes)}")
    shifts = torch.tensor([len(p) for p in prefixes], dtype=torch.long)
    b, s = batch.tokens.shape
    width = s + int(shifts.max()) if b else s
    tokens = torch.full((b, width), pad_id, dtype=batch.tokens.dtype)
    mask = torch.zeros(b, width - 1, dtype=torch.bool)
    for i, prefix in enumerate(prefixes):
        k = len(prefix)
        tokens[i, :k] = torch.tensor(list(prefix), dtype=batch.tokens.dtype)
        tokens[i, k : k + s] = batch.tokens[i]
        mask[i, k : k + s - 1] = batch.response_mask[i]
    return SequenceBatch(tokens, mask, batch.advantages), shifts


def realign(values: torch.Tensor, shifts: torch.Tensor, width: int) -> torch.Tensor:
    """Privileged-layout values [B, S' - 1, ...] -> the student's [B, width, ...]: out[i, t] = values[i, t + k_i]."""
    index = torch.arange(width)[None, :] + shifts[:, None]
    index = index.view(index.shape + (1,) * (values.dim() - 2)).expand(-1, -1, *values.shape[2:])
    return values.gather(1, index)


class Teacher:
    def __init__(
        self, chunks: list[torch.nn.Module], local_vocab: int, cfg: AlgoConfig, context: PrivilegedContext | None
    ) -> None:
        self.chunks, self.local_vocab, self.cfg, self.context = chunks, local_vocab, cfg, context

    def attach(self, actor: ActorPasses, batch: SequenceBatch, items: Sequence[PromptItem]) -> None:
        """Score ``batch`` (rows in (prompt, sample) order over ``items``) and fill its teacher fields."""
        scored, shifts = batch, None
        if self.context is not None:
            per_item = len(batch) // max(len(items), 1)
            if per_item * len(items) != len(batch):
                raise ValueError(f"items: {len(items)} prompts do not divide the batch's {len(batch)} sequences")
            prefixes = [self.context.ids(item) for item in items for _ in range(per_item)]
            scored, shifts = privileged_batch(batch, prefixes)
        scores = self.score(actor, scored)
        if shifts is not None:
            width = batch.response_mask.shape[1]
            scores = TeacherScores(
                *(realign(t, shifts, width) for t in (scores.logp, scores.topn_ids, scores.topn_logits))
            )
        keep = batch.response_mask.to(torch.bool)  # prompt and padding positions: 0, as their statistics are
        batch.teacher_logp = torch.where(keep, scores.logp, torch.zeros_like(scores.logp))
        batch.teacher_ids = torch.where(keep[..., None], scores.topn_ids, torch.zeros_like(scores.topn_ids))
        batch.teacher_logits = torch.where(keep[..., None], scores.topn_logits, torch.zeros_like(scores.topn_logits))

    @torch.no_grad()
    def score(self, actor: ActorPasses, batch: SequenceBatch) -> TeacherScores:
        """One forward-only pass of the teacher's chunks over ``batch``: its scores in ``batch``'s own layout."""
        from megatron.core import parallel_state as ps

        for m in self.chunks:
            m.eval()
        n = self.cfg.distill_top_n
        plan, micro = actor._plan(batch)
        width = batch.response_mask.shape[1]
        group = ps.get_tensor_model_parallel_group() if actor.cfg.tp > 1 else None
        start = ps.get_tensor_model_parallel_rank() * self.local_vocab

        def collect(mb, logits: torch.Tensor):
            targets = torch.roll(mb.seqs.tokens, shifts=-1, dims=1) if mb.packed is None else mb.packed.targets
            stats = vocab_parallel_token_stats(
                logits,
                targets.to(logits.device),
                n,
                group=group,
                vocab_start=start,
                vocab_size=actor.vocab_size,
                temperature=actor.temperature,
                chunk_tokens=actor.cfg.stats_chunk_tokens,
            )
            _, at = logits_at_ids(logits, stats.topn_ids, vocab_start=start, temperature=actor.temperature, group=group)
            fields = (stats.logp, stats.topn_ids.float(), at)
            if mb.packed is None:
                fields = tuple(f[:, :-1] for f in fields)
            else:
                shape = tuple(mb.seqs.response_mask.shape)
                fields = tuple(stream_to_view(f[0], mb.packed, shape) for f in fields)
            rows = fields[0].shape[0]
            return torch.zeros(()), {"teacher": torch.cat([f.reshape(rows, -1).float() for f in fields], dim=1)}

        outputs = actor._run_schedule(micro, collect, forward_only=True, model=self.chunks)
        values = actor._to_every_rank([o["teacher"] for o in outputs], plan, len(batch), width * (1 + 2 * n))
        b = len(batch)
        logp = values[:, :width]
        ids = values[:, width : width * (1 + n)].reshape(b, width, n).round().long()
        at = values[:, width * (1 + n) :].reshape(b, width, n)
        return TeacherScores(logp, ids, at)


def student_logits_at(
    actor: ActorPasses, logits: torch.Tensor, mb, teacher_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits alias for the fused op, the student's logits / temperature at ``teacher_ids`` [b, S - 1, N] in the
    padded view). Call it before the op on the same logits (see ops.given_ids: the gradient is added in place)."""
    from megatron.core import parallel_state as ps

    ids = teacher_ids.to(logits.device)
    if mb.packed is None:  # position S - 1 has no statistic: any id there (0) is dropped below
        ids = torch.cat([ids, torch.zeros_like(ids[:, :1])], dim=1)
    else:
        ids = mb.packed.to_stream(ids)[None]  # this (CP) rank's stream positions
    alias, at = logits_at_ids(
        logits,
        ids,
        vocab_start=ps.get_tensor_model_parallel_rank() * actor.local_vocab,
        temperature=actor.temperature,
        group=ps.get_tensor_model_parallel_group() if actor.cfg.tp > 1 else None,
    )
    if mb.packed is None:
        return alias, at[:, :-1]
    return alias, stream_to_view(at[0], mb.packed, tuple(mb.seqs.response_mask.shape))


def _teacher_chunks(actor: ActorPasses, teacher_dir: str, divisible: int) -> tuple[list[torch.nn.Module], int]:
    """The teacher's chunks at the actor's layout (its own HF config) with its HF weights, and its local vocab."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.bridge import load_hf_weights
    from megatron_rlvr.models import build_gpt_model, load_hf_config, padded_vocab_size, transformer_config_from_hf

    a = actor.cfg
    hf = load_hf_config(teacher_dir)
    if int(hf["vocab_size"]) < actor.vocab_size:
        raise UserError(
            f"algo.teacher_hf_dir={teacher_dir!r}: vocab_size {hf['vocab_size']} is smaller than the "
            f"student's {actor.vocab_size}"
        )
    heads, kv_heads, layers = (
        int(hf.get(k, 1)) for k in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers")
    )
    if heads % a.tp or kv_heads % a.tp or layers % (a.pp * (a.vpp or 1)):
        raise UserError(
            f"algo.teacher_hf_dir={teacher_dir!r}: {heads} heads / {kv_heads} KV heads / {layers} layers "
            f"do not divide over the actor's TP={a.tp} / PP={a.pp} x VPP={a.vpp or 1}"
        )
    tcfg = transformer_config_from_hf(
        hf,
        tp=a.tp,
        pp=a.pp,
        vpp=a.vpp,
        params_dtype=actor.tcfg.params_dtype,
        sequence_parallel=a.sequence_parallel,
        recompute=a.recompute,
        variable_seq_lengths=actor.tcfg.variable_seq_lengths,
        cp=a.cp,
    )
    chunks = []
    for vp in range(a.vpp or 1):
        vp_stage = vp if a.vpp else None
        chunks.append(
            build_gpt_model(
                hf,
                tcfg,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
                make_vocab_size_divisible_by=divisible,
            )
        )
    load_hf_weights(chunks, teacher_dir)
    return chunks, padded_vocab_size(int(hf["vocab_size"]), a.tp, divisible) // a.tp


def build_teacher(actor: ActorPasses, model_cfg: ModelConfig, cfg: AlgoConfig) -> Teacher | None:
    """The teacher of ``algo.distill`` on this rank (frozen), or None under ``none``."""
    if cfg.distill == "none":
        return None
    context = None
    if cfg.distill == "teacher":
        check_same_tokenizer(model_cfg.hf_dir, cfg.teacher_hf_dir)
        chunks, local_vocab = _teacher_chunks(actor, cfg.teacher_hf_dir, model_cfg.make_vocab_size_divisible_by)
    else:  # the frozen initial policy: the reference itself when there is one (the same weights, never trained)
        from transformers import AutoTokenizer

        chunks = actor.reference if actor.reference is not None else actor._build_chunks(model_cfg)
        local_vocab = actor.local_vocab
        context = PrivilegedContext(AutoTokenizer.from_pretrained(model_cfg.hf_dir), cfg.self_distill_template)
    for c in chunks:
        c.requires_grad_(False)
        c.eval()
    return Teacher(chunks, local_vocab, cfg, context)
