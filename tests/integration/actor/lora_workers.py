"""Worker-side helpers of the LoRA actor tests (run on gloo worker ranks): build a LoRA actor at a layout, fill its
adapters from one HF-layout draw (the same adapters at every layout), and read adapters or their gradients back in
HF layout through the adapter export."""

from __future__ import annotations

import zlib

import torch

from megatron_rlvr.testing.configs import algo_config

REL = 1e-5


def batch(vocab: int, seed: int = 0):
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(seed)
    b, s = 4, 10
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    lengths = torch.tensor([10, 7, 9, 5])
    mask = torch.zeros(b, s - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 2 : n - 1] = True
        tokens[i, n:] = 0
    return rollouts(tokens, mask)


def update(actor, rollouts, old_logp: torch.Tensor, ref_logp: torch.Tensor | None = None) -> dict[str, float]:
    """One update on ``rollouts`` with the advantages [1, -1, 0.5, -0.5] and the given statistics."""
    from megatron_rlvr.protocols import Statistics, Targets

    targets = Targets(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    return actor.update(rollouts, targets, Statistics(old_logp=old_logp, ref_logp=ref_logp), mini_batches=1)


def build(
    hf_dir: str,
    *,
    tp=1,
    pp=1,
    ep=1,
    etp=1,
    sp=False,
    lora=True,
    kl_coef=0.0,
    dist_opt=False,
    rank=4,
    sync="merged",
    temperature=0.9,
    micro_batch_size=2,
    **actor_kw,
):
    from megatron_rlvr.actor.config import ActorConfig, LoraConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig

    cfg = ActorConfig(
        tp=tp,
        pp=pp,
        ep=ep,
        etp=etp,
        sequence_parallel=sp,
        micro_batch_size=micro_batch_size,
        lr=1e-3,
        grad_clip=0.0,
        use_distributed_optimizer=dist_opt,
        lora=LoraConfig(rank=rank, alpha=2.0 * rank, sync=sync) if lora else None,
        **actor_kw,
    )
    return MegatronActor(
        ModelConfig(hf_dir=hf_dir),
        cfg,
        algo_config({"loss.kind": "grpo", "kl.coef": kl_coef}),
        temperature=temperature,
        total_steps=4,
    )


def _mapping_of(actor, stem: str):
    from megatron_rlvr.bridge.mapping import mapping_table
    from megatron_rlvr.models.dims import ModelDims

    dims = ModelDims.from_hf(actor.hf)
    return next(m for m in mapping_table(dims) if m.megatron == f"{stem}.weight"), dims


def _draw(name: str, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * 0.05


@torch.no_grad()
def fill_from_hf_layout(actor, seed: int = 5) -> None:
    """Set every adapter from tensors drawn in HF layout (per HF module, PEFT's view), cut to this rank's shard the
    way the bridge loads a base weight: the same adapted model at any layout."""
    from megatron_rlvr.bridge.layout import load_shard
    from megatron_rlvr.bridge.mapping import hf_shapes
    from megatron_rlvr.models.lora import A_NAME, B_NAME, shard_of

    for a in actor.lora.adapters:
        stem = actor.lora.names[id(a.module)]
        m, dims = _mapping_of(actor, stem)
        shapes = hf_shapes(m, dims)
        r = a.A.shape[0]
        a_full = _draw(f"{stem}.A", (r, shapes[0][1]), seed)
        b_hf = {h: _draw(f"{h}.B", (s[0], r), seed) for h, s in zip(m.hf, shapes)}
        if a.column:
            size = a.group.size() if a.group is not None else 1
            rank = a.group.rank() if a.group is not None else 0
            read = lambda h, dim, start, stop: b_hf[h] if dim is None else b_hf[h].narrow(dim, start, stop - start)  # noqa: E731
            a.A.copy_(a_full)
            a.B.copy_(load_shard(m, read, dims, rank, size, tuple(a.B.shape)))
        else:
            a.A.copy_(shard_of(a, A_NAME, a_full))
            a.B.copy_(b_hf[m.hf[0]])
        assert a.A.shape == getattr(a.module, A_NAME).shape and a.B.shape == getattr(a.module, B_NAME).shape


def adapters_hf(actor) -> dict[str, torch.Tensor]:
    """Every adapter in PEFT's names and layout, on every rank (the adapter export)."""
    return {
        n: t.clone() for bucket in actor.lora.export_adapter(actor.model_chunks, actor.hf, 1 << 20) for n, t in bucket
    }


@torch.no_grad()
def grads_hf(actor) -> dict[str, torch.Tensor]:
    """The adapters' gradients (DDP's main_grad after the last update) in PEFT's names and layout: swapped into the
    parameters for one adapter export, then swapped back."""
    params = list(actor.lora.parameters())
    kept = [p.detach().clone() for p in params]
    for p in params:
        p.copy_(p.main_grad)
    try:
        return adapters_hf(actor)
    finally:
        for p, k in zip(params, kept):
            p.copy_(k)


def local_grads(actor) -> dict[str, torch.Tensor]:
    """{global name of the half: its gradient} of the adapters on this rank (TP = ETP = 1: every half whole)."""
    from megatron_rlvr.models.lora import A_NAME, B_NAME

    out = {}
    for a in actor.lora.adapters:
        stem = actor.lora.names[id(a.module)]
        for half in (A_NAME, B_NAME):
            out[f"{stem}.{half}"] = getattr(a.module, half).main_grad.clone()
    return out


@torch.no_grad()
def gather_sharded_grads(actor) -> None:
    """Under the distributed optimizer each DP rank's grad buffer holds the reduced gradient only in its own shard of
    every bucket (the reduce-scatter's output; the rest is its own partial sums): all-gather the shards over the
    optimizer's DP group, so every ``main_grad`` is the gradient the optimizer stepped with, whole. Nothing without
    it (the buffer was all-reduced)."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for ddp in actor.model:
        for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            if not group.ddp_config.use_distributed_optimizer:
                continue
            size, rank = (
                group.intra_distributed_optimizer_instance_size,
                group.intra_distributed_optimizer_instance_rank,
            )
            for bucket in group.buckets:
                mine = shard_buffer(bucket.grad_data, size)[rank].clone()
                dist.all_gather_into_tensor(
                    bucket.grad_data, mine, group=group.intra_distributed_optimizer_instance_group
                )


@torch.no_grad()
def whole_grads(actor) -> dict[str, torch.Tensor]:
    """{global name of the linear + half: its gradient, whole and in HF row order} on every rank, for a layout with
    PP = EP = 1 (every rank holds every adapter, routed experts' included): the split half gathered over the group
    that splits its base (TP, or ETP for an expert) and a split B re-laid out like the base weight's HF rows
    (de-interleaved q/k/v, gate apart from up), so the same tensor at any TP / ETP / DP."""
    import torch.distributed as dist

    from megatron_rlvr.bridge.layout import to_hf
    from megatron_rlvr.models.lora import A_NAME, B_NAME, split_dim

    out = {}
    for a in actor.lora.adapters:
        stem = actor.lora.names[id(a.module)]
        m, dims = _mapping_of(actor, stem)
        size = a.group.size() if a.group is not None else 1
        for half in (A_NAME, B_NAME):
            grad = getattr(a.module, half).main_grad
            dim = split_dim(a.column, half)
            if dim is not None and size > 1:
                parts = [torch.empty_like(grad) for _ in range(size)]
                dist.all_gather(parts, grad.contiguous(), group=a.group)
                grad = torch.cat(parts, dim=dim)
            if half == B_NAME and len(m.hf) > 1:  # rows of several HF weights: in their order, each whole
                grad = torch.cat([t for _, t in to_hf(m, grad, dims, size)], dim=0)
            out[f"{stem}.{half}"] = grad.clone()
    return out
