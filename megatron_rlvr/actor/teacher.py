"""The distillation teacher on the actor ranks: built beside the KL reference, frozen, scored with the fused op.

``build_teacher(passes, model_cfg, algo_cfg, ...)`` returns a ``Teacher`` (or None under ``algo.distill.kind: none``):
- ``teacher``: the model of ``algo.distill.teacher_hf_dir`` (any size, the same tokenizer as the student: checked),
  built at the actor's TP/PP/VPP/CP like the reference, no optimizer, no grad, eval mode;
- ``self``: the frozen initial policy (the reference's chunks when the actor has a reference, else a copy built the
  same way) reading a privileged context: ``algo.distill.template`` with the item's reference answer, put
  before the whole sequence (prompt + response).
- ``crpo``: the same frozen initial policy, its privileged context being a correct response of the row's own group
  (``CorrectResponseContext``: its token ids in the template's ``{answer}``), scored on its top-K
  (``algo.distill.crpo.top_k``, capped at the vocabulary); its `ContextGroups` say which rows form a group and whether
  it had a correct response. With ``algo.distill.crpo.teacher: ema`` the teacher is a copy of
  its own that follows the policy after every optimizer step (``Teacher.follow``), and its weights are part of the
  actor's checkpointed state (``sharded_state`` / ``load_state``).

``Teacher.scores(rollouts, items, mini_batches)`` runs ONE forward-only pass of the teacher over the rollouts
(planned mini-batch by mini-batch, packed and scheduled by the actor's own `ActorPasses`, as the update runs the
student) and returns its `TeacherScores`: ``logp`` [B, S - 1], ``topn_ids`` [B, S - 1, N] and ``topn_logits``
[B, S - 1, N] (the teacher's logits / temperature at its top-N ids), every rank, in the student's layout, with
CRPO's `ContextGroups`. Under ``self`` the pass runs on (prefix + prompt + response) streams with their own lengths:
row i is shifted by its prefix length k_i, its response mask too, and the scores come back at ``t + k_i`` -> ``t``, so
the teacher scores exactly the student's response tokens.

``student_logits_at(passes, logits, mb, ids)`` is the student's side of the top-N forward KL inside the update's loss:
its logits / temperature at the teacher's ids (ops.given_ids), in the padded view the losses read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from megatron_rlvr.actor.chunks import build_chunks, freeze
from megatron_rlvr.actor.packing import MicroBatch, mini_batch_rows
from megatron_rlvr.actor.passes import ActorPasses
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.algos.distill import TeacherScores
from megatron_rlvr.data import PromptItem
from megatron_rlvr.errors import UserError
from megatron_rlvr.models.tokenizer_check import check_same_tokenizer
from megatron_rlvr.ops import vocab_parallel_token_stats
from megatron_rlvr.ops.given_ids import logits_at_ids
from megatron_rlvr.protocols.handoffs import ContextGroups, Rollouts, Sequences

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rlvr.models.config import ModelConfig


EMA_KEY = "crpo_teacher"  # the EMA teacher's checkpoint keys: crpo_teacher0, crpo_teacher1, ... (one per chunk)


def reference_text(item: PromptItem) -> str:
    """The privileged context's answer of a prompt: its reference answer (a string or number, or a dict's
    ``solution`` / ``answer``); for the embedded countdown task, whose reference is (numbers, target), a solution
    expression of the task's own solver. One-line UserError when there is none."""
    answer = item.answer
    if isinstance(answer, dict):
        for key in ("solution", "answer"):
            if isinstance(answer.get(key), (str, int, float)) and str(answer[key]).strip():
                return str(answer[key])
        if item.task == "countdown":
            from megatron_rlvr.tasks.countdown import reference_solution

            if (found := reference_solution(answer)) is not None:
                return found
    elif isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    elif isinstance(answer, str) and answer.strip():
        return answer
    raise UserError(
        f"algo.distill.kind=self: prompt {item.id!r} has no reference answer to put in "
        f"algo.distill.template (its answer is {answer!r})"
    )


class PrivilegedContext:
    """Token ids of ``template.format(answer=reference_text(item))`` per prompt (cached by prompt id)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str) -> None:
        self.tokenizer, self.template = tokenizer, template
        self._ids: dict[str, list[int]] = {}

    def ids(self, item: PromptItem) -> list[int]:
        if item.id not in self._ids:
            text = self.template.format(answer=reference_text(item))
            self._ids[item.id] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._ids[item.id]


class CorrectResponseContext:
    """CRPO's privileged prefixes: ``template`` with a correct response of the row's group (its sampled token ids,
    exactly) in place of ``{answer}``. Row i of a group uses the next correct response after it (cyclically) other
    than itself, itself when it is the group's only correct one; a group without a correct response (no reward
    ``>= correct_reward``) has no context: its rows are scored without a prefix and its CRPO term is 0."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str, correct_reward: float) -> None:
        marker = "\x00"
        parts = template.format(answer=marker).split(marker)
        self.parts = [list(tokenizer(part, add_special_tokens=False)["input_ids"]) for part in parts]
        self.correct_reward = correct_reward

    def prefixes(self, batch: Rollouts, group_size: int) -> tuple[list[list[int]], ContextGroups]:
        """(each row's prefix, each row's group and whether its group has a correct response)."""
        if tuple(batch.rewards.shape) != (len(batch),):
            raise ValueError(
                f"rollouts.rewards: algo.distill.kind=crpo needs the rewards [B] = [{len(batch)}] to choose each row's "
                "correct response"
            )
        correct = (batch.rewards >= self.correct_reward).tolist()
        group = torch.arange(len(batch)) // group_size
        context = torch.zeros(len(batch), dtype=torch.bool)
        prefixes: list[list[int]] = []
        for i in range(len(batch)):
            first = int(group[i]) * group_size
            members = [j for j in range(first, first + group_size) if correct[j]]
            others = [j for j in members if j != i]
            if not members:
                prefixes.append([])
                continue
            context[i] = True
            j = next((j for j in others if j > i), others[0]) if others else i
            response = batch.tokens[j, 1:][batch.response_mask[j].to(torch.bool)].tolist()
            prefix = list(self.parts[0])
            for part in self.parts[1:]:
                prefix += response + part
            prefixes.append(prefix)
        return prefixes, ContextGroups(group=group, has_context=context)


def privileged_batch(
    batch: Sequences, prefixes: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[Sequences, torch.Tensor]:
    """(prefix_i + tokens_i rows with the response mask shifted by k_i = len(prefix_i), the shifts k [B])."""
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
    return Sequences(tokens=tokens, response_mask=mask), shifts


def realign(values: torch.Tensor, shifts: torch.Tensor, width: int) -> torch.Tensor:
    """Privileged-layout values [B, S' - 1, ...] -> the student's [B, width, ...]: out[i, t] = values[i, t + k_i]."""
    index = torch.arange(width)[None, :] + shifts[:, None]
    index = index.view(index.shape + (1,) * (values.dim() - 2)).expand(-1, -1, *values.shape[2:])
    return values.gather(1, index)


class Teacher:
    """A frozen model scored on the student's batches through the student's own passes (``passes``)."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        local_vocab: int,
        cfg: AlgoConfig,
        context: PrivilegedContext | CorrectResponseContext | None,
        passes: ActorPasses,
    ) -> None:
        self.chunks, self.local_vocab, self.cfg, self.context, self.passes = chunks, local_vocab, cfg, context, passes
        # the teacher's top-N: distill_top_n, or CRPO's support (top-K; at most the vocabulary: then all of it)
        self.top_n = min(cfg.distill.crpo.top_k, passes.vocab_size) if cfg.distill.kind == "crpo" else cfg.distill.top_n

    @property
    def follows(self) -> bool:
        """Whether the teacher is CRPO's EMA of the policy (state to follow and to checkpoint) rather than frozen."""
        return self.cfg.distill.kind == "crpo" and self.cfg.distill.crpo.teacher == "ema"

    @torch.no_grad()
    def follow(self, policy: Sequence[torch.nn.Module]) -> None:
        """After an optimizer step: ``teacher = decay * teacher + (1 - decay) * policy``, parameter by parameter
        (the same chunks, built alike: names must match). Nothing unless ``follows``."""
        if not self.follows:
            return
        decay = self.cfg.distill.crpo.ema_decay
        for mine, theirs in zip(self.chunks, policy, strict=True):
            pairs = zip(mine.named_parameters(), theirs.named_parameters(), strict=True)
            for (name, t), (other, p) in pairs:
                if name != other:
                    raise RuntimeError(
                        f"Teacher.follow: parameter {name!r} of the teacher meets the policy's {other!r}"
                    )
                t.mul_(decay).add_(p.detach().to(t.dtype), alpha=1 - decay)

    def sharded_state(self) -> dict[str, Any]:
        """The EMA teacher's chunks as megatron sharded state under their own keys ({} unless ``follows``)."""
        if not self.follows:
            return {}
        return {f"{EMA_KEY}{i}": c.sharded_state_dict(prefix=f"{EMA_KEY}{i}.") for i, c in enumerate(self.chunks)}

    def load_state(self, loaded: Mapping[str, Any]) -> None:
        """Restore the EMA teacher's chunks from a loaded ``sharded_state`` (nothing unless ``follows``)."""
        if not self.follows:
            return
        for i, chunk in enumerate(self.chunks):
            prefix = f"{EMA_KEY}{i}."
            chunk.load_state_dict({k[len(prefix) :]: v for k, v in loaded[f"{EMA_KEY}{i}"].items()})

    def scores(
        self, batch: Rollouts, items: Sequence[PromptItem], mini_batches: int = 1
    ) -> tuple[TeacherScores, ContextGroups | None]:
        """The teacher's scores of ``batch`` (rows in (prompt, sample) order over ``items``; 0 off the response
        mask), each of the update's ``mini_batches`` planned on its own as the update plans it
        (ActorPasses.per_token), and CRPO's context groups (None for the other teachers)."""
        scored = Sequences(tokens=batch.tokens, response_mask=batch.response_mask)  # a teacher's routing is its own
        shifts, groups = None, None
        if self.context is not None:
            per_item = len(batch) // max(len(items), 1)
            if per_item * len(items) != len(batch):
                raise ValueError(f"items: {len(items)} prompts do not divide the batch's {len(batch)} sequences")
            if isinstance(self.context, CorrectResponseContext):
                prefixes, groups = self.context.prefixes(batch, per_item)
            else:
                prefixes = [self.context.ids(item) for item in items for _ in range(per_item)]
            scored, shifts = privileged_batch(batch, prefixes)
        scores = self.score(scored, mini_batches)
        if shifts is not None:
            width = batch.response_mask.shape[1]
            scores = TeacherScores(
                *(realign(t, shifts, width) for t in (scores.logp, scores.topn_ids, scores.topn_logits))
            )
        keep = batch.response_mask.to(torch.bool)  # prompt and padding positions: 0, as their statistics are
        masked = TeacherScores(
            torch.where(keep, scores.logp, torch.zeros_like(scores.logp)),
            torch.where(keep[..., None], scores.topn_ids, torch.zeros_like(scores.topn_ids)),
            torch.where(keep[..., None], scores.topn_logits, torch.zeros_like(scores.topn_logits)),
        )
        return masked, groups

    @torch.no_grad()
    def score(self, batch: Sequences, mini_batches: int = 1) -> TeacherScores:
        """One forward-only pass of the teacher's chunks over ``batch``, mini-batch by mini-batch (each planned on its
        own, as the update plans it): its scores in ``batch``'s own layout."""
        passes = self.passes
        for m in self.chunks:
            m.eval()
        n = self.top_n
        width = batch.response_mask.shape[1]
        start = passes.vocab_start(self.local_vocab)

        def collect(mb: MicroBatch, logits: torch.Tensor):
            stats = vocab_parallel_token_stats(
                logits,
                mb.targets().to(logits.device),
                n,
                group=passes.tp_group,
                vocab_start=start,
                vocab_size=passes.vocab_size,
                temperature=passes.temperature,
                chunk_tokens=passes.cfg.stats_chunk_tokens,
            )
            _, at = logits_at_ids(
                logits, stats.topn_ids, vocab_start=start, temperature=passes.temperature, group=passes.tp_group
            )
            fields = [passes.to_view(f, mb) for f in (stats.logp, stats.topn_ids.float(), at)]
            rows = fields[0].shape[0]
            return torch.zeros(()), {"teacher": torch.cat([f.reshape(rows, -1).float() for f in fields], dim=1)}

        parts = []
        for rows in mini_batch_rows(len(batch), mini_batches):
            part = batch.select(rows)
            plan, micro = passes.plan(part)
            outputs = passes.run(micro, collect, forward_only=True, model=self.chunks)
            parts.append(passes.gather([o["teacher"] for o in outputs], plan, len(part), width * (1 + 2 * n)))
        values = torch.cat(parts)
        b = len(batch)
        logp = values[:, :width]
        ids = values[:, width : width * (1 + n)].reshape(b, width, n).round().long()
        at = values[:, width * (1 + n) :].reshape(b, width, n)
        return TeacherScores(logp, ids, at)


def student_logits_at(
    passes: ActorPasses, logits: torch.Tensor, mb: MicroBatch, teacher_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits alias for the fused op, the student's logits / temperature at ``teacher_ids`` [b, S - 1, N] in the
    padded view). Call it before the op on the same logits (see ops.given_ids: the gradient is added in place)."""
    ids = teacher_ids.to(logits.device)
    if mb.packed is None:  # position S - 1 has no statistic: any id there (0) is dropped below
        ids = torch.cat([ids, torch.zeros_like(ids[:, :1])], dim=1)
    else:
        ids = mb.packed.to_stream(ids)[None]  # this (CP) rank's stream positions
    alias, at = logits_at_ids(
        logits, ids, vocab_start=passes.vocab_start(), temperature=passes.temperature, group=passes.tp_group
    )
    return alias, passes.to_view(at, mb)


def teacher_chunks(
    passes: ActorPasses,
    teacher_dir: str,
    divisible_by: int,
    use_te: bool | None,
    core_attention: str = "auto",
    attention_block_tokens: int | None = None,
) -> tuple[list[torch.nn.Module], int]:
    """The teacher's chunks at the actor's layout (its own HF config) with its HF weights, and its local vocab."""
    from megatron_rlvr.models import load_hf_config, padded_vocab_size, transformer_config_from_hf
    from megatron_rlvr.models.dims import ModelDims

    a = passes.cfg
    hf = load_hf_config(teacher_dir)
    if int(hf["vocab_size"]) < passes.vocab_size:
        raise UserError(
            f"algo.distill.teacher_hf_dir={teacher_dir!r}: vocab_size {hf['vocab_size']} is smaller than the "
            f"student's {passes.vocab_size}"
        )
    problems = a.layout().problems(ModelDims.from_hf(hf), training=False)
    if problems:
        raise UserError(
            f"algo.distill.teacher_hf_dir={teacher_dir!r}: the actor's layout does not fit it: {problems[0]}"
        )
    tcfg = transformer_config_from_hf(
        hf,
        tp=a.tp,
        pp=a.pp,
        vpp=a.vpp,
        params_dtype=passes.tcfg.params_dtype,
        sequence_parallel=a.sequence_parallel,
        recompute=a.recompute,
        variable_seq_lengths=passes.tcfg.variable_seq_lengths,
        cp=a.cp,
    )
    chunks = build_chunks(
        hf,
        tcfg,
        vpp=a.vpp,
        use_te=use_te,
        divisible_by=divisible_by,
        hf_dir=teacher_dir,
        core_attention=core_attention,
        attention_block_tokens=attention_block_tokens,
    )
    return chunks, padded_vocab_size(int(hf["vocab_size"]), a.tp, divisible_by) // a.tp


def build_teacher(
    passes: ActorPasses,
    model_cfg: ModelConfig,
    cfg: AlgoConfig,
    *,
    use_te: bool | None,
    initial_policy: Callable[[], list[torch.nn.Module]],
    fresh_policy: Callable[[], list[torch.nn.Module]],
) -> Teacher | None:
    """The teacher of ``algo.distill.kind`` on this rank (frozen), or None under ``none``. ``initial_policy`` gives the
    frozen initial policy's chunks under ``self`` and ``crpo`` (``fresh_policy``: a copy of its own, for CRPO's EMA
    teacher, which moves) (the reference's when the actor has one: the same weights)."""
    if cfg.distill.kind == "none":
        return None
    context = None
    if cfg.distill.kind == "teacher":
        check_same_tokenizer("algo.distill.teacher_hf_dir", cfg.distill.teacher_hf_dir, model_cfg.hf_dir)
        chunks, local_vocab = teacher_chunks(
            passes,
            cfg.distill.teacher_hf_dir,
            model_cfg.make_vocab_size_divisible_by,
            use_te,
            model_cfg.core_attention,
            model_cfg.packed_attention_block_tokens,
        )
    else:
        from transformers import AutoTokenizer

        ema = cfg.distill.kind == "crpo" and cfg.distill.crpo.teacher == "ema"
        chunks, local_vocab = (fresh_policy() if ema else initial_policy()), passes.local_vocab
        tokenizer = AutoTokenizer.from_pretrained(model_cfg.hf_dir)
        if cfg.distill.kind == "crpo":
            context = CorrectResponseContext(tokenizer, cfg.distill.template, cfg.distill.crpo.correct_reward)
        else:
            context = PrivilegedContext(tokenizer, cfg.distill.template)
    return Teacher(freeze(chunks), local_vocab, cfg, context, passes)
