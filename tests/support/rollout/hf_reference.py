"""HF transformers fp32 reference for engine tests: log-probs of fixed sequences, perturbed state dicts."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(model_dir: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_token_logprobs(model: torch.nn.Module, seq: list[int], start: int = 1, temperature: float = 1.0) -> torch.Tensor:
    """log p(seq[t] | seq[:t]) for t >= start, from logits / temperature."""
    logits = model(torch.tensor([seq])).logits[0].float() / temperature
    logp = torch.log_softmax(logits[start - 1 : len(seq) - 1], dim=-1)
    return logp.gather(1, torch.tensor(seq[start:])[:, None])[:, 0]


@torch.no_grad()
def hf_logprob_bound(model: torch.nn.Module, seqs: list[list[int]], temperature: float = 1.0) -> float:
    """The fp32 bound of comparing another implementation's log-probs of ``seqs`` with this model's
    (megatron_rlvr/testing/rounding.py), at the largest logit / temperature this model gives them."""
    from megatron_rlvr.models.dims import ModelDims
    from megatron_rlvr.testing.rounding import fp32_logprob_bound

    scale = max(model(torch.tensor([s])).logits.abs().max().item() for s in seqs) / temperature
    return fp32_logprob_bound(ModelDims.from_hf(model.config.to_dict()), max(map(len, seqs)), scale)


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every HF name the engine loads, lm_head included (for tied models it is the embedding's tensor)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    sd["lm_head.weight"] = model.get_output_embeddings().weight.detach().clone()
    return sd


def perturbed(
    sd: dict[str, torch.Tensor], seed: int, scale: float = 0.05, tied: bool = False
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def load_into_hf(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(sd[name])
        if "lm_head.weight" in sd and not model.config.tie_word_embeddings:
            model.lm_head.weight.copy_(sd["lm_head.weight"])


@torch.no_grad()
def hf_router_topk(model: torch.nn.Module, seq: list[int], top_k: int) -> torch.Tensor:
    """[tokens, MoE layers, top_k] the experts transformers' Qwen3-MoE router picks for each token of ``seq`` (as a
    set per token: sorted ids), from ``output_router_logits``."""
    out = model(torch.tensor([seq]), output_router_logits=True)
    picks = [logits.view(len(seq), -1).topk(top_k, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits]
    return torch.stack(picks, dim=1)
