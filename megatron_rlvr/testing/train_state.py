"""An actor's whole training state as plain tensors by stable names: what a checkpoint round trip must restore
(tests/integration/checkpoint, and the real model's layout tour)."""

from __future__ import annotations


def train_state(actor) -> dict[str, object]:
    """Every tensor the next optimizer step reads, by a stable name; plus which step tensors are shared."""
    out: dict[str, object] = {}
    step_ids = set()
    for i, opt in enumerate(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            out[f"{i}/{g}/lr"] = group["lr"]
            for p, param in enumerate(group["params"]):
                out[f"{i}/{g}/{p}/main_param"] = param.detach().clone()
                for key, value in inner.state[param].items():
                    out[f"{i}/{g}/{p}/{key}"] = value.detach().clone()
                step_ids.add(id(inner.state[param]["step"]))
    for c, chunk in enumerate(actor.model_chunks):
        for name, param in chunk.named_parameters():
            out[f"model{c}/{name}"] = param.detach().clone()
    out["scheduler"] = actor.scheduler.state_dict()
    out["distinct_step_tensors"] = len(step_ids)
    return out
