"""megatron-core on CPU over gloo: a GPTModel (RMSNorm, SwiGLU, GQA, RoPE, qkv bias) gives the same loss and
gradient norm at every (TP, PP) layout; the distributed optimizer steps; dist checkpoints round-trip exactly."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytestmark = pytest.mark.dist

VOCAB, SEQ, GLOBAL_BATCH = 96, 12, 4


def _transformer_config():
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bf16=False,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
        sequence_parallel=False,
    )


def _build_model():
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=_transformer_config(),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def _wrap_ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    # the schedules call this after the last backward: DP reduce(-scatter) of grads, tied-embedding sync across PP
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def _global_batch():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)


def _train_step(ddp_model, optimizer):
    """One forward/backward over this DP rank's slice of the global batch, one sequence per micro-batch."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    tokens = _global_batch().chunk(dp)[dp_rank]
    position_ids = torch.arange(SEQ).unsqueeze(0)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch[:, :-1], position_ids, attention_mask=None, labels=batch[:, 1:])

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return output, loss_func

    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(tokens.split(1)),
        model=[ddp_model],
        num_microbatches=len(tokens),
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    local = torch.tensor(
        [sum(float(x["loss"]) for x in losses), float(len(losses))] if losses else [0.0, 0.0], dtype=torch.float64
    )
    torch.distributed.all_reduce(local)  # only last-stage ranks contribute; counts make it the global mean
    _, grad_norm, _ = optimizer.step()
    return float(local[0] / local[1]), float(grad_norm)


def _make_optimizer(ddp_model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1e9, bf16=False)
    return get_megatron_optimizer(cfg, [ddp_model])


def _save_reference(ckpt_dir: str) -> None:
    """At (TP, PP) = (1, 1) build the model from a fixed seed and write it as a dist checkpoint."""
    from megatron.core import dist_checkpointing

    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=1, pp=1, seed=99):
        model = _build_model()
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)


def _loss_and_grad_norm_after_load(ckpt_dir: str, tp: int, pp: int) -> tuple[float, float, float]:
    from megatron.core import dist_checkpointing

    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, seed=5):
        model = _build_model()
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
        ddp_model = _wrap_ddp(model)
        optimizer = _make_optimizer(ddp_model)
        loss, grad_norm = _train_step(ddp_model, optimizer)
        # The step moved the weights: a second forward's loss must change identically on every layout.
        loss_after, _ = _train_step(ddp_model, optimizer)
        return loss, grad_norm, loss_after


def _roundtrip(ckpt_dir: str, tp: int, pp: int) -> bool:
    """Save at (tp, pp) after an update, load into a fresh model at the same layout: every tensor identical."""
    from megatron.core import dist_checkpointing

    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, seed=3):
        model = _build_model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
        torch.distributed.barrier()
        fresh = _build_model()
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt_dir))
        saved, loaded = model.state_dict(), fresh.state_dict()
        tensors = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
        assert tensors and sorted(tensors) == sorted(k for k, v in loaded.items() if isinstance(v, torch.Tensor))
        return all(torch.equal(saved[k], loaded[k]) for k in tensors)


def _shared_tmpdir() -> str:
    path = tempfile.mkdtemp(prefix="mrlvr-dist-")
    os.chmod(path, 0o777)
    return path


@pytest.fixture(scope="module")
def reference_ckpt(workers4):
    ckpt = os.path.join(_shared_tmpdir(), "ref")
    os.makedirs(ckpt)
    workers4.run(_save_reference, ckpt)
    return ckpt


@pytest.fixture(scope="module")
def reference_result(workers4, reference_ckpt):
    return workers4.run(_loss_and_grad_norm_after_load, reference_ckpt, 1, 1)[0]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_gpt_loss_and_grad_norm_match_across_layouts(workers4, reference_ckpt, reference_result, tp, pp):
    results = workers4.run(_loss_and_grad_norm_after_load, reference_ckpt, tp, pp)
    loss, grad_norm, loss_after = results[0]
    ref_loss, ref_norm, ref_after = reference_result
    assert all(r == results[0] for r in results), "ranks disagree on the global loss/grad norm"
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert grad_norm == pytest.approx(ref_norm, rel=1e-4)
    assert grad_norm > 0
    # the distributed optimizer took the same step everywhere
    assert loss_after == pytest.approx(ref_after, rel=1e-4, abs=1e-5)
    assert loss_after != pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize("tp,pp", [(2, 2)])
def test_dist_checkpoint_roundtrip_is_exact(workers4, tp, pp):
    ckpt = os.path.join(_shared_tmpdir(), "rt")
    os.makedirs(ckpt)
    assert all(workers4.run(_roundtrip, ckpt, tp, pp))


def test_cpu_shims_are_only_applied_without_cuda():
    from megatron_rlvr.runtime import distributed

    assert distributed.apply_cpu_shims() is (not torch.cuda.is_available())
