"""Worker-side code of the actor -> engine sync test: an actor at (TP, PP) in a gloo group, rank 0 holding a CPU
vLLM engine, weights streamed through the bridge's export, log-probs of fixed sequences from both sides."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from tests.models.mp_helpers import build_chunks, pipeline_logits


def _actor_logprobs(chunks, seqs: list[list[int]], vocab: int) -> list[torch.Tensor] | None:
    """log p(seq[t] | seq[:t]), t >= 1, per sequence, on the last pipeline stage (None elsewhere)."""
    out = []
    for seq in seqs:  # one sequence at a time (no padding to reason about); every stage runs every forward
        logits = pipeline_logits(chunks, torch.tensor([seq]))
        if logits is not None:
            logp = torch.log_softmax(logits[0, :-1, :vocab].float(), dim=-1)
            out.append(logp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0])
    return out or None


@torch.no_grad()
def _change_weights(chunks) -> None:
    """A deterministic elementwise change of every parameter (same on TP replicas and on the tied copies of the
    embedding on the first and last stages), standing in for an optimizer step."""
    for chunk in chunks:
        for param in chunk.parameters():
            param.add_(0.05 * torch.sin(param * 37.0 + 1.0))


def sync_and_compare(
    hf_dir: str, tp: int, pp: int, seqs: list[list[int]], bucket_bytes: int, lend: bool = False, staging: str = "full"
) -> dict:
    """Two rounds of (export -> rank 0's engine.update_weights -> log-probs on both sides); a weight change between.
    ``lend``: rank 0 takes lent buckets (``update_weights(lent=True)``), the other ranks only serve (receive=False)."""
    from megatron_rlvr.bridge import export_hf_weights
    from megatron_rlvr.runtime import distributed

    engine = None
    try:
        hf, chunks = build_chunks(hf_dir, tp, pp)
        if dist.get_rank() == 0:
            from megatron_rlvr.rollout import RolloutConfig, make_engine

            cfg = RolloutConfig(
                max_model_len=256, kv_cache_memory_bytes=32 << 20, check_sync=True, sync_staging=staging
            )
            engine = make_engine(hf_dir, cfg)
        rounds = []
        for step in range(2):
            if step == 1:
                _change_weights(chunks)
            receive = not lend or dist.get_rank() == 0
            buckets = export_hf_weights(chunks, hf, bucket_bytes=bucket_bytes, receive=receive, lend=lend)
            stream = itertools.chain.from_iterable(buckets)
            if engine is not None:
                engine.update_weights(stream, lent=lend)  # check_sync: also reads the engine's weights back
            else:
                for _ in stream:  # the export is a collective: every rank iterates it to the end
                    pass
            rounds.append(
                {
                    "actor": _actor_logprobs(chunks, seqs, hf["vocab_size"]),
                    "engine": [torch.tensor(x) for x in engine.prompt_logprobs(seqs)] if engine is not None else None,
                }
            )
        return {"rank": dist.get_rank(), "rounds": rounds}
    finally:
        if engine is not None:
            engine.close()
        distributed.destroy_model_parallel()
