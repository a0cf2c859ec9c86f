"""models/lora.py on megatron-core's linears: a column-parallel then a row-parallel linear with adapters, at TP = 2
with and without sequence parallelism (the actor cannot run sequence parallelism on CPU: megatron's torch norm refuses
it), against the same two layers in float64 on whole tensors: the output, the input's gradient and every adapter
half's gradient (after ``reduce_partial_grads``); with the adapters off, the base alone; and the one-line refusals."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.models.lora import LoraError, check_spec

pytestmark = pytest.mark.dist

S, B, H, F, R, SCALE_ALPHA = 8, 2, 16, 24, 4, 8.0


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


def _two_linears(sp: bool):
    """(output, input grad, {half: grad}, output with the adapters off) on this rank, and the reference's."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rlvr.models.lora import (
        A_NAME,
        B_NAME,
        AdapterSpec,
        AdapterSwitch,
        adapters_off,
        install,
        reduce_partial_grads,
        shard_of,
    )
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=2, seed=3):
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=2,
            tensor_model_parallel_size=2,
            sequence_parallel=sp,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
        )
        init = torch.nn.init.zeros_
        block = torch.nn.Module()
        block.linear_fc1 = ColumnParallelLinear(H, F, config=cfg, init_method=init, bias=False, gather_output=False)
        block.linear_fc2 = RowParallelLinear(
            F, H, config=cfg, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=False
        )
        block.requires_grad_(False)
        switch = AdapterSwitch()
        spec = AdapterSpec(rank=R, alpha=SCALE_ALPHA)
        adapters = {a.name: a for a in install([block], spec, switch)}
        full = {
            "w1": _full(1, F, H),
            "w2": _full(2, H, F),
            "fc1.A": _full(3, R, H),
            "fc1.B": _full(4, F, R),
            "fc2.A": _full(5, R, F),
            "fc2.B": _full(6, H, R),
            "x": _full(7, S, B, H),
            "g": _full(8, S, B, H),
        }
        rank = torch.distributed.get_rank()
        with torch.no_grad():
            block.linear_fc1.weight.copy_(full["w1"].chunk(2, 0)[rank])
            block.linear_fc2.weight.copy_(full["w2"].chunk(2, 1)[rank])
            for short in ("fc1", "fc2"):
                a = adapters[f"linear_{short}"]
                for half in (A_NAME, B_NAME):
                    getattr(a.module, half).copy_(shard_of(a, half, full[f"{short}.{half[-1]}"]))
        x = (full["x"].chunk(2, 0)[rank] if sp else full["x"]).clone().requires_grad_(True)
        g = full["g"].chunk(2, 0)[rank] if sp else full["g"]

        def forward():
            y, _ = block.linear_fc1(x)
            out, _ = block.linear_fc2(y)
            return out

        out = forward()
        (out * g).sum().backward()
        reduce_partial_grads(list(adapters.values()), lambda p: p.grad)
        grads = {
            f"{s}.{h[-1]}": getattr(adapters[f"linear_{s}"].module, h).grad.clone()
            for s in ("fc1", "fc2")
            for h in (A_NAME, B_NAME)
        }
        with torch.no_grad(), adapters_off(switch):
            base_out = forward()

        # the reference: whole tensors, float64
        ref = {k: v.double().requires_grad_(k not in ("w1", "w2", "g")) for k, v in full.items()}
        scale = SCALE_ALPHA / R
        y = ref["x"] @ ref["w1"].T + scale * (ref["x"] @ ref["fc1.A"].T) @ ref["fc1.B"].T
        ref_out = y @ ref["w2"].T + scale * (y @ ref["fc2.A"].T) @ ref["fc2.B"].T
        (ref_out * ref["g"]).sum().backward()
        ref_base = (ref["x"] @ ref["w1"].T) @ ref["w2"].T
        mine = lambda t: t.chunk(2, 0)[rank] if sp else t  # noqa: E731
        expect = {
            "out": mine(ref_out.detach()),
            "base": mine(ref_base.detach()),
            "x": mine(ref["x"].grad),
            "fc1.A": ref["fc1.A"].grad,
            "fc1.B": ref["fc1.B"].grad.chunk(2, 0)[rank],
            "fc2.A": ref["fc2.A"].grad.chunk(2, 1)[rank],
            "fc2.B": ref["fc2.B"].grad,
        }
        got = {"out": out.detach(), "base": base_out, "x": x.grad} | grads
        return {k: (got[k].double() - expect[k]).abs().max().item() / expect[k].abs().max().item() for k in expect}


@pytest.mark.parametrize("sp", [False, True])
def test_adapters_on_parallel_linears_match_whole_tensors(workers2, sp):
    for rank, errors in enumerate(workers2.run(_two_linears, sp)):
        print(f"SP={sp} rank {rank}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        assert max(errors.values()) <= 1e-6, errors


@pytest.mark.parametrize(
    "kwargs,says",
    [
        (dict(rank=0, alpha=1.0, dropout=0.0, targets=["linear_qkv"]), "rank=0: expected an integer >= 1"),
        (dict(rank=2, alpha=1.0, dropout=0.0, targets=["q_proj"]), "unknown ['q_proj']"),
        (dict(rank=2, alpha=0.0, dropout=0.0, targets=["linear_qkv"]), "alpha=0.0: expected > 0"),
        (dict(rank=2, alpha=1.0, dropout=1.0, targets=["linear_qkv"]), "dropout=1.0: expected in [0, 1)"),
        (dict(rank=2, alpha=1.0, dropout=0.0, targets=[]), "unknown empty list"),
    ],
)
def test_bad_settings_get_one_line(kwargs, says):
    with pytest.raises(LoraError) as e:
        check_spec(**kwargs)
    assert says in str(e.value) and "\n" not in str(e.value)
