"""Worker-side helpers for the model and bridge tests: build a model at a (TP, PP) layout in a WorkerGroup rank
and run a forward pass through the pipeline by hand (point-to-point send of the hidden states), returning the
full-vocab logits gathered over TP on the last stage."""

from __future__ import annotations

import torch
import torch.distributed as dist


def build_chunks(
    hf_dir: str,
    tp: int,
    pp: int,
    seed: int = 1234,
    load: bool = True,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
):
    """initialize_model_parallel(tp, pp, vpp, ep, etp) and this rank's model chunks (HF weights loaded when
    ``load``)."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.bridge import load_hf_weights
    from megatron_rlvr.models import build_gpt_model, load_hf_config, transformer_config_from_hf
    from megatron_rlvr.runtime import distributed

    distributed.initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=seed, ep=ep, etp=etp)
    hf = load_hf_config(hf_dir)
    tcfg = transformer_config_from_hf(hf, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        chunks.append(
            build_gpt_model(
                hf,
                tcfg,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
            )
        )
    if load:
        load_hf_weights(chunks, hf_dir)
    return hf, chunks


@torch.no_grad()
def pipeline_logits(chunks, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab (padded) logits [b, s, Vp] on the last stage's ranks, None elsewhere. Causal mask only: with
    right padding the valid positions never attend to padding."""
    from megatron.core import parallel_state as ps

    (model,) = chunks
    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
    # An explicit mask: megatron's default causal mask is allocated with device="cuda" (not shimmed on CPU).
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(s, b, model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(input_ids, position_ids, attention_mask=mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    tp_group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, out.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def hf_logits(hf_dir: str, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    mask = (torch.arange(input_ids.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=mask).logits


def varied_batch(vocab: int, lengths: list[int], seed: int = 0) -> torch.Tensor:
    """Right-padded batch of random token ids with the given lengths (padding id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
    return ids


def max_valid_diff(a: torch.Tensor, b: torch.Tensor, lengths: list[int], vocab: int) -> float:
    return max((a[i, :n, :vocab] - b[i, :n, :vocab]).abs().max().item() for i, n in enumerate(lengths))


def max_log_prob_rel_diff(a: torch.Tensor, b: torch.Tensor, lengths: list[int], vocab: int) -> float:
    """Max relative difference of the next-token log-probs of each valid position's actual next token (what the
    losses read), between full-vocab logits ``a`` (padded) and ``b``."""
    worst = 0.0
    for i, n in enumerate(lengths):
        la = torch.log_softmax(a[i, : n - 1, :vocab].double(), -1)
        lb = torch.log_softmax(b[i, : n - 1, :vocab].double(), -1)
        # every vocabulary entry, not only the sampled one: a wrong row anywhere shows up
        worst = max(worst, ((la - lb).abs() / lb.abs().clamp_min(1e-12)).max().item())
    return worst
