"""The fused token-statistics op in one process (TP = 1): values and gradients against the dense oracle for every
implementation and dtype, gradcheck in fp64, ties, N = 0, T = 0, temperature, padding, in-place backward without a
[T, V] allocation, the fallback warning and input validation. Multi-process TP is in test_token_stats_dist.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rlvr.ops import backends, reference, vocab_parallel_token_stats
from megatron_rlvr.testing.rounding import fp32_token_stat_bound
from tests.integration.ops.cases import Case, compare_to_oracle, loss_of, make_case, upstream_grads

IMPLS = ["reference"] + (["cpp"] if backends.extension() is not None else [])


def value_bound(result: dict) -> float:
    """The op and the dense oracle are two fp32 evaluations of the same statistics (their reductions over the vocab
    in different orders: blocks of 1024 columns and an online softmax against one pass): the bound of
    megatron_rlvr/testing/rounding.py for statistics of given logits. bf16 inputs are exact in fp32, so it holds for
    them as well."""
    return fp32_token_stat_bound(result["vocab"], result["max_abs_logit"])


def case_bound(case: Case, temperature: float) -> float:
    """`value_bound` for two implementations run on ``case`` at ``temperature`` (its real columns' largest logit)."""
    real = case.logits[:, : case.vocab_size].float()
    return fp32_token_stat_bound(case.vocab_size, real.abs().max().item() / temperature)


def check(result: dict, logits_dtype: torch.dtype) -> None:
    bound = value_bound(result)
    assert result["logp"] <= bound, (bound, result)
    assert result["entropy"] <= bound, (bound, result)
    assert result["topn_logp"] <= bound, (bound, result)
    assert result["ids_equal"], result
    assert result["padding_grad_zero"], result
    # fp32: a gradient entry is p_j = exp(log-prob) (its relative error the value bound) times weights that keep it
    # within the gradient's scale. bf16 gradients are rounded to bf16 (8 bits of mantissa): relative to that scale too
    scale = max(result["grad_scale"], 1e-3)
    grad_tol = bound * max(scale, 1.0) if logits_dtype == torch.float32 else 8e-3 * scale
    assert result["grad"] <= grad_tol, result


def test_cpp_extension_is_built():
    """The C++ kernel is what runs by default on CPU; a missing build must not pass silently here."""
    assert backends.extension() is not None, "megatron_rlvr._C is not built: pip install -e . builds it"
    assert backends.resolve(torch.device("cpu"), None, 3) == "cpp"
    assert backends.extension().cpu_isa() in ("avx512", "avx2", "generic")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_dense_oracle(impl, dtype, temperature):
    # 2100 columns: several 1024-column blocks plus a tail; 3 padding columns at the end
    case = make_case(9, 2100, 2097, dtype, seed=1)
    check(compare_to_oracle(case, 3, temperature=temperature, implementation=impl), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_resolve_to_lower_id(impl, dtype):
    case = make_case(12, 300, 290, dtype, seed=2, ties=True)
    result = compare_to_oracle(case, 5, implementation=impl)
    check(result, dtype)
    stats = vocab_parallel_token_stats(case.logits, case.targets, 5, vocab_size=290, implementation=impl)
    for row_ids, row_logits in zip(stats.topn_ids, case.logits):
        best = row_logits[:290].max()
        expected = torch.nonzero(row_logits[:290] == best).flatten()[:5]  # the lowest ids holding the max
        assert torch.equal(row_ids[: len(expected)], expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_top_n_zero_and_no_tokens(impl):
    check(compare_to_oracle(make_case(5, 40, 40, torch.float32, seed=3), 0, implementation=impl), torch.float32)
    empty = torch.zeros(0, 40, requires_grad=True)
    stats = vocab_parallel_token_stats(empty, torch.zeros(0, dtype=torch.long), 3, implementation=impl)
    assert stats.logp.shape == (0,) and stats.topn_ids.shape == (0, 3) and stats.topn_logp.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss_of(stats, upstream_grads(0, 3, torch.float32, 0)), empty)
    assert grad.shape == (0, 40)


@pytest.mark.parametrize("impl", IMPLS)
def test_leading_dims_and_large_top_n(impl):
    case = make_case(6, 64, 61, torch.float32, seed=4)
    stats = vocab_parallel_token_stats(
        case.logits.view(2, 3, 64), case.targets.view(2, 3), 61, vocab_size=61, implementation=impl
    )
    dense = reference.dense_token_stats(case.logits, case.targets, 61, vocab_size=61)
    assert stats.logp.shape == (2, 3) and stats.topn_ids.shape == (2, 3, 61)
    assert torch.equal(stats.topn_ids.view(6, 61), dense.topn_ids)
    bound = fp32_token_stat_bound(61, case.logits[:, :61].abs().max().item())
    torch.testing.assert_close(stats.topn_logp.view(6, 61), dense.topn_logp, atol=bound, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradcheck_float64(impl):
    case = make_case(4, 23, 21, torch.float64, seed=5)
    logits = case.logits.clone().requires_grad_()

    def fn(x):
        stats = vocab_parallel_token_stats(x, case.targets, 3, vocab_size=21, temperature=0.8, implementation=impl)
        return stats.logp, stats.entropy, stats.topn_logp

    assert torch.autograd.gradcheck(fn, (logits,))


class _LargeAllocations(TorchDispatchMode):
    """Records new buffers of at least `threshold` elements that ops create (how a [T, V] buffer would show);
    views and in-place results share an input's storage and are not counted."""

    def __init__(self, threshold: int):
        super().__init__()
        self.threshold, self.sizes = threshold, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        known = {a.untyped_storage().data_ptr() for a in inputs}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, torch.Tensor)
                and t.numel() >= self.threshold
                and t.untyped_storage().data_ptr() not in known
            ):
                self.sizes.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_same_gradient_no_buffer(impl, dtype):
    num_tokens, vocab = 16, 257
    case = make_case(num_tokens, vocab, 250, dtype, seed=6)
    weights = upstream_grads(num_tokens, 3, torch.float32, seed=6)
    grads, allocations = {}, {}
    for inplace in (False, True):
        leaf = case.logits.clone().requires_grad_()
        logits = leaf * 1  # a non-leaf buffer, as the output layer's logits are
        stats = vocab_parallel_token_stats(
            logits, case.targets, 3, vocab_size=250, inplace_backward=inplace, chunk_tokens=4, implementation=impl
        )
        loss = loss_of(stats, weights)
        with _LargeAllocations(num_tokens * vocab) as tracker:
            (grads[inplace],) = torch.autograd.grad(loss, logits)
        allocations[inplace] = tracker.sizes
        if inplace:
            assert grads[inplace].data_ptr() == logits.data_ptr()
    assert allocations[False], "the tracker must see the out-of-place gradient buffer (else it proves nothing)"
    assert allocations[True] == [], allocations[True]
    assert torch.equal(grads[True], grads[False])


def test_inplace_backward_twice_raises():
    logits = make_case(3, 30, 30, torch.float32, seed=8).logits.requires_grad_() * 1
    stats = vocab_parallel_token_stats(logits, torch.tensor([1, 2, 3]), 2, inplace_backward=True)
    loss = stats.logp.sum()
    torch.autograd.grad(loss, logits, retain_graph=True)
    with pytest.raises(RuntimeError, match="already holds a gradient"):
        torch.autograd.grad(loss, logits)


def test_fallback_to_reference_warns_once(monkeypatch):
    """Where the extension is not built (``extension=None``), "auto" runs the reference and says so once."""
    backends.reset_warnings()
    cpu = torch.device("cpu")
    with pytest.warns(RuntimeWarning, match="not built.*torch reference") as record:
        chosen = [backends.resolve(cpu, None, 2, extension=None) for _ in range(2)]
    assert chosen == ["reference", "reference"]
    assert len([w for w in record if "not built" in str(w.message)]) == 1
    monkeypatch.setenv(backends.ENV_VAR, "cpp")
    with pytest.raises(RuntimeError, match="_C is missing"):
        backends.resolve(cpu, None, 2, extension=None)


def test_env_var_forces_reference(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "reference")
    assert backends.resolve(torch.device("cpu"), None, 3) == "reference"
    monkeypatch.setenv(backends.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="implementation"):
        backends.resolve(torch.device("cpu"), None, 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_ids=torch.tensor([0, 1, 40])), "target_ids: expected ids in \\[0, 40\\)"),
        (dict(target_ids=torch.tensor([0, 1])), "target_ids: expected shape"),
        (dict(target_ids=torch.tensor([0.0, 1.0, 2.0])), "target_ids: expected an integer"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_n=-1), "top_n"),
        (dict(top_n=41), "top_n: 41 exceeds"),
        (dict(vocab_size=45), "vocab_size"),
        (dict(vocab_start=40), "vocab_start: the shards must tile"),
        (dict(logits=torch.zeros(3, 40, dtype=torch.float16)), "logits: expected dtype"),
    ],
)
def test_bad_input_is_named(kwargs, message):
    args = dict(logits=torch.zeros(3, 40), target_ids=torch.tensor([0, 1, 2]), top_n=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        vocab_parallel_token_stats(args.pop("logits"), args.pop("target_ids"), args.pop("top_n"), **args)


def test_cuda_kernels_are_named_and_need_cuda_tensors():
    assert backends.IMPLEMENTATIONS[-2:] == ("cuda-scalar", "cuda-vector")
    for name in ("cuda", "cuda-scalar", "cuda-vector"):
        with pytest.raises(ValueError, match="runs on CUDA tensors"):
            backends.resolve(torch.device("cpu"), name, 3)


@pytest.mark.skipif(backends.extension() is None, reason="needs megatron_rlvr._C")
def test_extension_refuses_an_unknown_cuda_kernel():
    case = make_case(2, 16, 16, torch.float32, seed=14)
    records = torch.empty(2, 4 + 2 * 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="cuda_kernel: expected 'scalar' or 'vector'"):
        backends.extension().token_stats_forward(case.logits, case.targets, records, 3, 0, 16, 1.0, "fast")


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
CUDA_IMPLS = [f"cuda-{kernel}" for kernel in backends.CUDA_KERNELS]


@pytest.mark.gpu
@gpu
def test_cuda_default_kernel():
    assert backends.resolve(torch.device("cuda"), None, 3) == f"cuda-{backends.CUDA_KERNEL}"
    assert backends.resolve(torch.device("cuda"), "cuda", 3) == f"cuda-{backends.CUDA_KERNEL}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("impl", CUDA_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_kernel_matches_oracle(impl, dtype, ties, inplace):
    # rows of 5001 columns: each row starts at another offset from a 16-byte boundary; 11 padding columns
    case = make_case(33, 5001, 4990, dtype, seed=10, ties=ties)
    check(
        compare_to_oracle(case, 3, temperature=0.7, implementation=impl, inplace_backward=inplace, device="cuda"),
        dtype,
    )
    check(compare_to_oracle(case, 0, implementation=impl, device="cuda"), dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("impl", CUDA_IMPLS)
@pytest.mark.parametrize("top_n", [1, 4, 5, 8, 9, 16, 17, 32])
def test_cuda_kernel_every_top_n(impl, top_n):
    """Every list size the kernels are compiled for (the vector kernel's: 4, 8, 16, 32), at its edges."""
    case = make_case(6, 900, 893, torch.float32, seed=15)
    check(compare_to_oracle(case, top_n, temperature=1.3, implementation=impl, device="cuda"), torch.float32)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` one element past an allocation's start: no 16-byte aligned row start at all."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_vector_kernel_on_misaligned_buffers(dtype, inplace):
    """Logits whose rows never start on a vector boundary; out of place, the gradient buffer's alignment differs
    from theirs (the backward then goes one element at a time); in place, it is theirs."""
    case = make_case(9, 2048, 2040, dtype, seed=16)
    targets = case.targets.cuda()
    weights = tuple(w.cuda() for w in upstream_grads(9, 3, torch.float32, seed=16))
    grads, stats = {}, {}
    for impl in ("reference", "cuda-vector"):
        leaf = case.logits.cuda().requires_grad_()
        logits = _misaligned(leaf * 1) if impl == "cuda-vector" else leaf * 1
        assert impl != "cuda-vector" or logits.data_ptr() % 16 != 0
        stats[impl] = vocab_parallel_token_stats(
            logits, targets, 3, vocab_size=2040, temperature=0.8, inplace_backward=inplace, implementation=impl
        )
        (grads[impl],) = torch.autograd.grad(loss_of(stats[impl], weights), leaf)
    ours, ref = stats["cuda-vector"], stats["reference"]
    assert torch.equal(ours.topn_ids, ref.topn_ids)
    for a, b in zip(ours[:3], ref[:3]):
        torch.testing.assert_close(a, b, atol=case_bound(case, 0.8), rtol=0)
    scale = grads["reference"].abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 8e-3 * scale
    torch.testing.assert_close(grads["cuda-vector"].float(), grads["reference"].float(), atol=tol, rtol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_vector_kernel_matches_scalar_at_full_vocabulary(dtype):
    """Qwen2.5's padded vocabulary (151936 columns, 151643 real): the two CUDA kernels give the same ids, and values
    within fp32 rounding of the sums; both meet the oracle."""
    case = make_case(48, 151936, 151643, dtype, seed=17)
    for impl in CUDA_IMPLS:
        check(compare_to_oracle(case, 3, temperature=0.9, implementation=impl, device="cuda"), dtype)
    logits, targets = case.logits.cuda(), case.targets.cuda()
    scalar, vector = (
        vocab_parallel_token_stats(logits, targets, 3, vocab_size=151643, temperature=0.9, implementation=impl)
        for impl in CUDA_IMPLS
    )
    assert torch.equal(scalar.topn_ids, vector.topn_ids)
    for a, b in zip(scalar[:3], vector[:3]):  # each sums ~600 terms a thread in fp32: about 1.5e-6 from fp64 here
        torch.testing.assert_close(a, b, atol=case_bound(case, 0.9), rtol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("impl", CUDA_IMPLS)
def test_cuda_gradcheck_and_empty(impl):
    case = make_case(4, 23, 21, torch.float64, seed=11)
    logits = case.logits.cuda().requires_grad_()
    targets = case.targets.cuda()
    fn = lambda x: tuple(vocab_parallel_token_stats(x, targets, 3, vocab_size=21, implementation=impl)[:3])  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits,))
    empty = vocab_parallel_token_stats(
        torch.zeros(0, 7, device="cuda"), torch.zeros(0, dtype=torch.long, device="cuda"), 2, implementation=impl
    )
    assert empty.topn_ids.shape == (0, 2)


def test_inplace_backward_fails_loudly_when_another_node_saved_the_logits():
    leaf = make_case(4, 30, 30, torch.float32, seed=12).logits.requires_grad_()
    logits = torch.tanh(leaf)  # tanh saves its output for its own backward
    stats = vocab_parallel_token_stats(logits, torch.tensor([1, 2, 3, 4]), 2, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stats.logp.sum().backward()


_ISA_SCRIPT = """
import json, torch
from tests.integration.ops.cases import compare_to_oracle, make_case
from megatron_rlvr.ops import backends
out = {"isa": backends.extension().cpu_isa(), "results": []}
for dtype in (torch.float32, torch.bfloat16):
    for ties in (False, True):
        case = make_case(7, 2100, 2090, dtype, seed=13, ties=ties)
        out["results"].append((str(dtype), compare_to_oracle(case, 3, temperature=0.9, implementation="cpp")))
print(json.dumps(out))
"""


@pytest.mark.skipif(backends.extension() is None, reason="needs megatron_rlvr._C")
@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_every_cpu_instruction_set_matches_oracle(isa):
    """The AVX2 and baseline builds of the row kernels (the default run uses the widest the CPU has)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "MEGATRON_RLVR_CPU_ISA": isa, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT], cwd=repo, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if out["isa"] != isa and isa == "avx2":
        pytest.skip("this CPU has no AVX2 (the kernels fell back to the baseline build)")
    assert out["isa"] == isa
    for dtype_name, result in out["results"]:
        check(result, getattr(torch, dtype_name.split(".")[-1]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_minus_inf_logits(impl, dtype):
    """-inf logits (masked tokens) have p = 0: finite entropy and gradients, -inf log-probs where sampled."""
    logits = make_case(6, 2100, 2090, torch.float64, seed=14).logits
    logits[:, ::3] = -float("inf")
    logits[0, :2090] = -float("inf")
    logits[0, [5, 7]] = 1.0  # a row with two live tokens: the other top-N slots hold -inf, ties -> lower ids
    targets = make_case(6, 2100, 2090, torch.float64, seed=14).targets
    targets[1] = 3  # a masked token was sampled
    result = compare_to_oracle(Case(logits.to(dtype), targets, 2090), 4, implementation=impl)
    check(result, dtype)


def test_non_contiguous_logits_warn_about_the_copy():
    backends.reset_warnings()
    logits = make_case(8, 40, 40, torch.float32, seed=15).logits.view(2, 4, 40)
    targets = torch.zeros(2, 3, dtype=torch.long)
    with pytest.warns(RuntimeWarning, match="not contiguous, so they are copied"):
        stats = vocab_parallel_token_stats(logits[:, :-1], targets, 2)
    dense = reference.dense_token_stats(logits[:, :-1], targets, 2)
    torch.testing.assert_close(
        stats.logp, dense.logp, atol=fp32_token_stat_bound(40, logits.abs().max().item()), rtol=0
    )
