"""Worker-side code of the streamed-generation test: an actor's model chunks (TP ranks in a gloo group) and, on rank 0,
a CPU vLLM engine driven one step at a time (rollout/vllm_stream.py); the weights change while two responses are in
flight, and both sides' log-probs of each version are returned."""

from __future__ import annotations

import itertools

import torch.distributed as dist

from tests.integration.rollout.sync_workers import _actor_logit_scale, _actor_logprobs, _change_weights


def _sync(engine, chunks, hf) -> None:
    from megatron_rlvr.bridge import export_hf_weights

    stream = itertools.chain.from_iterable(export_hf_weights(chunks, hf, bucket_bytes=1 << 20))
    if engine is not None:
        engine.update_weights(stream)
    else:
        for _ in stream:  # the export is a collective
            pass


def _shared(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def versions_across_an_update(hf_dir: str, tp: int, prompt: list[int], steps_before: int, recompute: bool) -> dict:
    """Stream 2 responses to ``prompt``; after ``steps_before`` engine steps the actor's weights change and go into
    the engine in flight (``recompute``: then refresh_kv). Returns each response's tokens, engine log-probs and
    versions, the actor's log-probs of the sequence under the old weights (the tokens before the update) and
    the new ones (all tokens), and the largest logit the actor saw (the fp32 bound's scale)."""
    from megatron_rlvr.rollout import RolloutConfig, Sampling, make_engine
    from megatron_rlvr.runtime import distributed
    from tests.integration.models.mp_helpers import build_chunks

    engine = None
    try:
        hf, chunks = build_chunks(hf_dir, tp, 1)
        for chunk in chunks:
            chunk.eval()
        if dist.get_rank() == 0:
            cfg = RolloutConfig(max_model_len=256, kv_cache_memory_bytes=32 << 20, max_staleness=2)
            engine = make_engine(hf_dir, cfg)
        _sync(engine, chunks, hf)
        responses = [{"tokens": [], "logprobs": [], "versions": []} for _ in range(2)]

        def run(version: int, steps: int | None) -> None:
            stream = engine.stream()
            for _ in itertools.count() if steps is None else range(steps):
                if not stream.in_flight():
                    return
                for news in stream.step():
                    r = responses[news.index]
                    r["tokens"] += news.token_ids
                    r["logprobs"] += news.logprobs
                    r["versions"] += [version] * len(news.token_ids)

        if engine is not None:
            engine.stream().submit("a", prompt, 2, Sampling(temperature=1.0, max_tokens=24, seed=5))
            run(0, steps_before)
        before = _shared([r["tokens"][:] for r in responses] if engine is not None else None)
        old = _actor_logprobs(chunks, [prompt + t for t in before], hf["vocab_size"])
        scales = [_actor_logit_scale(chunks, [prompt + t for t in before], hf["vocab_size"])]
        _change_weights(chunks)  # an update of the actor while the responses are in flight
        _sync(engine, chunks, hf)
        if engine is not None:
            if recompute:
                engine.stream().refresh_kv()
            run(1, None)
        responses = _shared(responses if engine is not None else None)
        new = _actor_logprobs(chunks, [prompt + r["tokens"] for r in responses], hf["vocab_size"])
        scales.append(_actor_logit_scale(chunks, [prompt + r["tokens"] for r in responses], hf["vocab_size"]))
        scale = None if scales[0] is None else max(scales)
        return {"rank": dist.get_rank(), "responses": responses, "old": old, "new": new, "scale": scale}
    finally:
        if engine is not None:
            engine.close()
        distributed.destroy_model_parallel()
