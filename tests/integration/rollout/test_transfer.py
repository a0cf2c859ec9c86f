"""Weight transfer to engine ranks of their own, in a 3-member gloo group (the sender and two engine ranks at engine
TP 2): each engine rank gets its shards bit for bit, versions in order, over a group built from a store or one of
the world's; messages and buffers stay within the bucket bound (one larger tensor goes alone); a receiver that dies
makes the sender raise within the timeout naming it, a sender that dies makes the receivers raise naming it, a
member that never answers is named after the timeout; no process is left behind."""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import time

import psutil
import pytest
import torch

from megatron_rlvr.runtime.ports import free_port
from megatron_rlvr.testing.workers import WorkerGroup

pytestmark = pytest.mark.dist

TIMEOUT_S = 4.0
SLACK_S = 3.0  # a loaded 2-core machine: how much later than its deadline an error may surface
ENGINE_TP = 2


@pytest.fixture(scope="module")
def workers3():
    with WorkerGroup(3, timeout_s=120) as group:
        yield group


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("transfer") / "qwen2", seed=5, num_hidden_layers=2))


def _model(hf_dir: str, only: str | None = None):
    from megatron_rlvr.bridge import HFCheckpointReader
    from megatron_rlvr.models import load_hf_config
    from megatron_rlvr.models.dims import ModelDims

    with HFCheckpointReader(hf_dir) as reader:
        ref = {n: reader.read(n) for n in reader.names() if only is None or only in n}
    return ref, ModelDims.from_hf(load_hf_config(hf_dir))


def _weights(ref: dict[str, torch.Tensor], version: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the actor holds at ``version``: every version differs in every tensor."""
    return {n: (t + version).to(dtype) for n, t in ref.items()}


def _dtype_of(version: int) -> torch.dtype:
    return torch.bfloat16 if version % 2 == 0 else torch.float32  # mixed: both dtypes cross the wire


def _buckets(weights: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out, size = [[]], 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    return out


def _store_group(port: int, member: int, timeout_s: float):
    """A group of its own, not registered with the default world (built from a store)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 3, member == 0, timeout=datetime.timedelta(seconds=60))
    return dist.ProcessGroupGloo(dist.PrefixStore("weights", store), member, 3, datetime.timedelta(seconds=timeout_s))


def _engine_receives(
    group, hf_dir: str, versions: int, shard: bool = True, die_after: int | None = None, only: str | None = None
) -> dict:
    """Receive ``versions`` transfers and compare each tensor with what the sender held; ``die_after``: exit the
    process after that many tensors of the second transfer."""
    from megatron_rlvr.bridge.reshard import engine_shard
    from megatron_rlvr.rollout.transfer import WeightReceiver

    ref, dims = _model(hf_dir, only)
    member = group.rank()
    rx = WeightReceiver(
        group, engine_tp=ENGINE_TP, engine_tp_rank=member - 1, dims=dims, shard=shard, timeout_s=TIMEOUT_S
    )
    got_versions, problems, buffers = [], [], []
    for i in range(versions):
        version, stream = rx.receive()
        got_versions.append(version)
        want, seen = _weights(ref, version, _dtype_of(version)), set()
        for n, (name, t) in enumerate(stream):
            if die_after is not None and i == 1 and n == die_after:
                os._exit(1)
            expected = engine_shard(name, want[name], dims, ENGINE_TP, member - 1) if shard else want[name]
            if t.dtype != expected.dtype or not torch.equal(t, expected):
                problems.append(f"version {version}: {name} differs")
            seen.add(name)
        if seen != set(ref):
            problems.append(f"version {version}: names differ by {sorted(seen ^ set(ref))}")
        buffers.append(rx.buffer_bytes)
    return {"versions": got_versions, "problems": problems, "buffer_bytes": buffers}


def _sender_sends(
    group,
    hf_dir: str,
    versions: list[int],
    bucket_bytes: int,
    die_in: int | None = None,
    whole: list[bool] | None = None,
    only: str | None = None,
) -> dict:
    """Send each version in buckets of ``bucket_bytes`` (or, where ``whole``, as one bucket the sender must cut);
    ``die_in``: exit the process after the first bucket of that version."""
    from megatron_rlvr.rollout.transfer import WeightSender

    ref, _ = _model(hf_dir, only)
    tx = WeightSender(group, timeout_s=TIMEOUT_S, bucket_bytes=bucket_bytes)
    stats = []
    for i, version in enumerate(versions):
        weights = _weights(ref, version, _dtype_of(version))
        buckets = [list(weights.items())] if whole and whole[i] else _buckets(weights, bucket_bytes)

        def stream(buckets=buckets, version=version):
            for k, bucket in enumerate(buckets):
                if k == 1 and version == die_in:
                    os._exit(1)
                yield bucket

        stats.append(tx.send(stream(), version))
        stats[-1]["buffer_bytes"] = tx.buffer_bytes
    try:
        tx.send([], versions[-1])
        stale = None
    except ValueError as e:  # refused before anything is sent: the group stays usable
        stale = str(e)
    sizes = [sum(t.numel() * t.element_size() for t in _weights(ref, v, _dtype_of(v)).values()) for v in versions]
    return {"stats": stats, "stale_error": stale, "bytes": sizes}


def _timed(fn, *args, **kwargs) -> dict:
    """``fn``'s result, or the TransferError it raised, with the seconds it took."""
    from megatron_rlvr.rollout.transfer import TransferError

    start = time.monotonic()
    try:
        return {"result": fn(*args, **kwargs), "error": None, "seconds": time.monotonic() - start}
    except TransferError as e:
        return {"result": None, "error": str(e), "seconds": time.monotonic() - start}


def _member_main(port: int, member: int, hf_dir: str, job: dict) -> None:
    """A transfer-group member in a process of its own, so that it can die (a worker's death would end the test)."""
    from megatron_rlvr.testing.workers import _die_with_parent

    _die_with_parent()
    torch.set_num_threads(1)
    group = _store_group(port, member, TIMEOUT_S)
    if member == 0:
        _sender_sends(group, hf_dir, [1, 2], 150_000, die_in=job.get("die_in"))
    else:
        _engine_receives(group, hf_dir, 2, die_after=job.get("die_after"))
    os._exit(0)


def _run_member(port: int, hf_dir: str, jobs: dict[int, dict], world: bool = False) -> dict:
    """On WorkerGroup rank m: play transfer-group member m as ``jobs[m]`` says; report the outcome and the children
    left behind."""
    import torch.distributed as dist

    member = dist.get_rank()
    job = jobs.get(member, {})
    out: dict = {}
    if job.get("child"):
        child = mp.get_context("spawn").Process(target=_member_main, args=(port, member, hf_dir, job))
        child.start()
        child.join(60)
        out["child_exit"] = child.exitcode
    else:
        group = (
            dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
            if world
            else _store_group(port, member, TIMEOUT_S)
        )
        if member == 0:
            out.update(
                _timed(
                    _sender_sends,
                    group,
                    hf_dir,
                    job.get("versions", [1, 2]),
                    job.get("bucket_bytes", 150_000),
                    whole=job.get("whole"),
                    only=job.get("only"),
                )
            )
        elif job.get("silent_after") is not None:
            out.update(_timed(_engine_receives, group, hf_dir, job["silent_after"], shard=job.get("shard", True)))
            time.sleep(TIMEOUT_S + SLACK_S)  # holds the group open and answers nothing
        else:
            out.update(
                _timed(
                    _engine_receives,
                    group,
                    hf_dir,
                    job.get("versions", 2),
                    shard=job.get("shard", True),
                    only=job.get("only"),
                )
            )
    out["children_left"] = [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    return out


def _no_orphans(results) -> None:
    for member, r in enumerate(results):
        assert r["children_left"] == [], f"member {member} left processes behind: {r['children_left']}"


@pytest.mark.parametrize("world", [False, True], ids=["store_group", "world_group"])
def test_every_engine_rank_gets_its_shards_bit_equal_and_versions_in_order(workers3, hf_dir, world):
    jobs = {0: {"versions": [1, 2, 5]}, 1: {"versions": 3}, 2: {"versions": 3}}
    results = workers3.run(_run_member, free_port(), hf_dir, jobs, world)
    sender = results[0]
    assert sender["error"] is None, sender["error"]
    for member in (1, 2):
        r = results[member]
        assert r["error"] is None, f"member {member}: {r['error']}"
        assert r["result"]["versions"] == [1, 2, 5]
        assert r["result"]["problems"] == [], f"member {member}: {r['result']['problems'][:5]}"
    out = sender["result"]
    for stats, nbytes in zip(out["stats"], out["bytes"]):
        assert stats["transfer/bytes"] == nbytes and stats["transfer/seconds"] > 0  # once, not once per engine rank
    assert "version 5 after version 5" in out["stale_error"]
    _no_orphans(results)


def test_messages_and_buffers_stay_within_the_bucket_bound(workers3, hf_dir):
    bound = 150_000
    ref, _ = _model(hf_dir)
    layers = {n: t for n, t in ref.items() if ".layers." in n}
    largest = max(t.numel() * 4 for t in ref.values())
    assert max(t.numel() * 4 for t in layers.values()) <= bound < largest  # the model exercises both rules
    # one bucket holding everything: the sender cuts it to the bound; the vocabulary tensors go alone, over it
    jobs = {
        0: {"versions": [1], "bucket_bytes": bound, "whole": [True]},
        1: {"versions": 1, "shard": False},
        2: {"versions": 1, "shard": False},
    }
    results = workers3.run(_run_member, free_port(), hf_dir, jobs)
    assert results[0]["error"] is None, results[0]["error"]
    (stats,) = results[0]["result"]["stats"]
    total = sum(t.numel() * 4 for t in ref.values())
    assert stats["transfer/max_bucket_bytes"] == largest
    vocab = sum(t.numel() * 4 for n, t in ref.items() if n not in layers and t.numel() * 4 > bound)
    assert stats["transfer/buckets"] >= math.ceil((total - vocab) / bound) + 2  # each vocabulary tensor alone
    meta_slack = 16 << 10  # the metadata and the alignment of each dtype's run
    assert stats["buffer_bytes"] <= 2 * (largest + meta_slack)
    for member in (1, 2):
        r = results[member]
        assert r["error"] is None and r["result"]["problems"] == [], f"member {member}: {r}"
        assert r["result"]["buffer_bytes"][0] <= largest + meta_slack
    # without the vocabulary tensors every message is within the bound, and so is each engine rank's buffer
    for member in (0, 1, 2):
        jobs[member]["only"] = ".layers."
    results = workers3.run(_run_member, free_port(), hf_dir, jobs)
    assert results[0]["error"] is None, results[0]["error"]
    (stats,) = results[0]["result"]["stats"]
    assert stats["transfer/max_bucket_bytes"] <= bound
    assert stats["transfer/buckets"] >= math.ceil(sum(t.numel() * 4 for t in layers.values()) / bound) > 1
    for member in (1, 2):
        r = results[member]
        assert r["error"] is None and r["result"]["problems"] == [], f"member {member}: {r}"
        assert r["result"]["buffer_bytes"][0] <= bound + meta_slack
    _no_orphans(results)


def test_a_receiver_that_dies_makes_the_sender_raise_naming_it(workers3, hf_dir):
    jobs = {0: {"versions": [1, 2]}, 1: {"versions": 2}, 2: {"child": True, "die_after": 1}}
    sender, engine, dead = workers3.run(_run_member, free_port(), hf_dir, jobs)
    assert dead["child_exit"] == 1
    assert sender["error"] is not None and "member 2 (an engine rank" in sender["error"], sender
    assert sender["seconds"] < TIMEOUT_S + SLACK_S
    # the surviving engine rank is told the sender stopped, within its own deadline
    assert engine["error"] is not None and "member 0 (the sender" in engine["error"], engine
    assert engine["seconds"] < 2 * TIMEOUT_S + SLACK_S
    _no_orphans([sender, engine, dead])


def test_a_sender_that_dies_makes_every_engine_rank_raise_naming_it(workers3, hf_dir):
    jobs = {0: {"child": True, "die_in": 2}, 1: {"versions": 2}, 2: {"versions": 2}}
    results = workers3.run(_run_member, free_port(), hf_dir, jobs)
    assert results[0]["child_exit"] == 1
    for member in (1, 2):
        r = results[member]
        assert r["error"] is not None and "member 0 (the sender" in r["error"], f"member {member}: {r}"
        assert r["seconds"] < TIMEOUT_S + SLACK_S
    _no_orphans(results)


def test_a_member_that_never_answers_is_named_after_the_timeout(workers3, hf_dir):
    jobs = {0: {"versions": [1, 2]}, 1: {"versions": 2}, 2: {"silent_after": 1}}
    sender, engine, silent = workers3.run(_run_member, free_port(), hf_dir, jobs)
    assert silent["error"] is None and silent["result"]["versions"] == [1]
    assert sender["error"] is not None and "member 2 (an engine rank" in sender["error"], sender
    assert TIMEOUT_S - 0.5 <= sender["seconds"] < TIMEOUT_S + SLACK_S
    assert engine["error"] is not None and "member 0 (the sender" in engine["error"], engine
    _no_orphans([sender, engine, silent])
