"""``tools/convert.py`` / ``megatron-rlvr convert``: HF safetensors <-> megatron dist checkpoint, and GGUF -> HF,
streaming.

    convert hf-to-mcore --hf-dir DIR --out DIR [--dtype bfloat16] [--overwrite]
    convert mcore-to-hf --mcore-dir DIR --out DIR [--hf-config DIR] [--max-shard-size 5GB] [--overwrite]
    convert gguf-to-hf GGUF_FILE OUT_DIR [--dtype float32] [--max-shard-size 5GB] [--overwrite]

Every direction holds about one tensor at a time (never the model), shows a progress bar per tensor, checks every
input tensor's name and shape before writing anything, and writes into a temporary sibling directory renamed over
the output only when complete: a failed or interrupted conversion leaves the output as it was. ``gguf-to-hf``
dequantizes as transformers' GGUF loader does (``bridge/gguf.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from megatron_rlvr.bridge.dist_ckpt import HF_SUBDIR, checkpoint_sharded_state_dict, save_lazily, write_hf_side_files
from megatron_rlvr.bridge.gguf import GGUFCheckpoint
from megatron_rlvr.bridge.hf_reader import HFCheckpointReader
from megatron_rlvr.bridge.layout import load_shard, to_hf
from megatron_rlvr.bridge.mapping import hf_shapes, mapping_table, megatron_local_shape
from megatron_rlvr.errors import UserError
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.hf_config import load_hf_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConversionError(UserError, ValueError):
    """Bad input for a conversion; the message names the file or tensor."""


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * scale)
    return int(t)


# ---------------------------------------------------------------------------------------------------------------
# Output directory handling


@contextmanager
def _staged_output(out: Path, overwrite: bool) -> Iterator[Path]:
    """A temp dir beside ``out``; renamed to ``out`` on success, removed on any failure (``out`` untouched)."""
    if out.exists() and not overwrite:
        raise ConversionError(f"output {out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _single_process_megatron() -> Iterator[None]:
    import torch.distributed as dist

    from megatron_rlvr.runtime import distributed

    started = not dist.is_initialized()
    saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if started:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConversionError("convert runs as one process; do not launch it with torchrun / WORLD_SIZE > 1")
        # A world of one on a fresh port: a parent's leftover MASTER_PORT may still be bound.
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(distributed.free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    elif dist.get_world_size() != 1:
        raise ConversionError("convert runs in a world of one process")
    distributed.initialize_model_parallel(tp=1, pp=1)
    try:
        yield
    finally:
        distributed.destroy_model_parallel()
        if started:
            if dist.is_initialized():
                dist.destroy_process_group()
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr)


def _meta_model(hf: dict[str, Any], dtype: torch.dtype):
    """The TP=1, PP=1 model on the meta device: megatron's exact state-dict structure, no memory."""
    from megatron_rlvr.models import build_gpt_model, transformer_config_from_hf

    tcfg = transformer_config_from_hf(hf, tp=1, pp=1, params_dtype=dtype, perform_initialization=False)
    with torch.device("meta"):
        return build_gpt_model(hf, tcfg, use_te=False)


def _hf_dtype(hf: dict[str, Any]) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return DTYPES.get(str(name).replace("torch.", ""), torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# HF -> megatron


def hf_to_mcore(hf_dir: Path, out: Path, dtype: torch.dtype | None = None, overwrite: bool = False) -> None:
    hf = load_hf_config(hf_dir)
    dims = ModelDims.from_hf(hf)
    dtype = dtype or _hf_dtype(hf)
    table = {m.megatron: m for m in mapping_table(dims)}
    with HFCheckpointReader(hf_dir) as reader:
        expected = {}
        for m in table.values():
            if m.megatron == "output_layer.weight" and dims.tied:
                continue
            expected.update(zip(m.hf, (tuple(s) for s in hf_shapes(m, dims))))
        reader.check_shapes(expected)  # every tensor present and well-shaped before anything is written

        def produce(name: str, part: int, n_parts: int) -> torch.Tensor:
            m = table[name]
            if m.kind == "vocab":  # stored unpadded (see dist_ckpt)
                source = "model.embed_tokens.weight" if dims.tied else m.hf[0]
                full = reader.read(source)
            else:
                full = load_shard(m, reader.read, dims, 0, 1, megatron_local_shape(m, dims, 1))
            if n_parts > 1:
                full = torch.chunk(full, n_parts, dim=0)[part]
            return full.to(dtype)

        with _staged_output(out, overwrite) as tmp, _single_process_megatron():
            state = checkpoint_sharded_state_dict([_meta_model(hf, dtype)], dims.vocab)
            n = sum(1 for name in state["model"] if not name.endswith("_extra_state"))
            with _progress(n, "hf-to-mcore") as bar:
                save_lazily(state, tmp, produce, on_tensor=lambda name: bar.update(1))
            write_hf_side_files(hf_dir, tmp)


# ---------------------------------------------------------------------------------------------------------------
# megatron -> HF


def mcore_to_hf(
    mcore_dir: Path,
    out: Path,
    hf_config: Path | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
) -> None:
    from megatron_rlvr.bridge.dist_ckpt import DistCheckpointReader
    from megatron_rlvr.bridge.safetensors_writer import plan_shards, write_sharded

    side = Path(hf_config) if hf_config else mcore_dir / HF_SUBDIR
    if not (side / "config.json").is_file():
        raise ConversionError(
            f"{side / 'config.json'}: not found; a checkpoint saved without its HF config needs --hf-config DIR"
        )
    hf = load_hf_config(side)
    dims = ModelDims.from_hf(hf)
    if not (mcore_dir / "metadata.json").is_file():
        raise ConversionError(f"{mcore_dir}: not a megatron dist checkpoint (no metadata.json)")
    with _single_process_megatron():
        try:
            stored = DistCheckpointReader(mcore_dir)
        except Exception as e:
            raise ConversionError(f"{mcore_dir}: cannot read the dist checkpoint metadata: {e}") from e
        model = _meta_model(hf, torch.float32)
        request_of = _requests(checkpoint_sharded_state_dict([model], dims.vocab)["model"], dims)
        table = [m for m in mapping_table(dims) if not (m.megatron == "output_layer.weight" and dims.tied)]
        specs = []
        for m in table:
            key, prefix, prefix_sizes, shape = request_of[m.megatron]
            if key not in stored.keys():  # noqa: SIM118 - a checkpoint index, not a dict
                raise ConversionError(f"{mcore_dir}: tensor {key} (for {m.megatron}) is not in the checkpoint")
            want = prefix_sizes + tuple(shape)
            if m.kind == "vocab" and stored.shape(key)[1:] == want[1:] and stored.shape(key)[0] >= want[0]:
                pass  # megatron's default padded rows (an actor checkpoint): only the first vocab_size are read
            elif stored.shape(key) != want:
                raise ConversionError(
                    f"{mcore_dir}: tensor {key} has shape {list(stored.shape(key))}, expected {list(want)} "
                    f"for {side}/config.json"
                )
            specs += [(n, tuple(s), stored.dtype(key)) for n, s in zip(m.hf, hf_shapes(m, dims))]

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            with _progress(len(table), "mcore-to-hf") as bar:
                for m in table:
                    key, prefix, _, shape = request_of[m.megatron]
                    full = stored.read(key, prefix + (0,) * len(shape), (1,) * len(prefix) + shape).reshape(shape)
                    parts = to_hf(m, full, dims, tp=1)  # views of `full`, which is held anyway
                    # counted before they are handed over: the writer stops pulling after the last tensor, so an
                    # update after the last yield would never run (the bar stopped at 23/24)
                    bar.update(1)
                    yield from parts

        with _staged_output(out, overwrite) as tmp:
            write_sharded(tmp, plan_shards(specs, max_shard_bytes), tensors())
            for f in side.iterdir():
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
            config = json.loads((tmp / "config.json").read_text())
            config["dtype"] = str(specs[0][2]).replace("torch.", "")
            (tmp / "config.json").write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------------------------------------------------
# GGUF -> HF


def gguf_to_hf(
    gguf_file: Path,
    out: Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
) -> None:
    from megatron_rlvr.bridge.safetensors_writer import plan_shards, write_sharded

    source = GGUFCheckpoint(gguf_file)  # every check, metadata only, before the output is touched
    with _staged_output(out, overwrite) as tmp:
        with _progress(len(source.tensors), "gguf-to-hf") as bar:

            def tensors() -> Iterator[tuple[str, torch.Tensor]]:
                for item in source.hf_tensors(dtype):
                    bar.update(1)  # before the hand-over: the writer stops pulling after the last tensor
                    yield item

            write_sharded(tmp, plan_shards(source.tensor_specs(dtype), max_shard_bytes), tensors())
        source.write_side_files(tmp, dtype)


def _requests(
    model_sd: dict[str, Any], dims: ModelDims
) -> dict[str, tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """state-dict name -> (sharded key, offsets of the leading axes the key adds, their sizes, the tensor's shape).

    Leading axes: the layer, where megatron stacks layers under one key (a homogeneous block; a mixed dense/MoE
    pattern keys each layer apart), then the expert (experts of one layer share one key, expert ``e`` at ``e``)."""
    out = {}
    for name, sh in model_sd.items():
        if name.endswith("_extra_state"):
            continue
        shape = tuple(sh.data.shape)
        parts = name.split(".")
        prefix: tuple[int, ...] = ()
        sizes: tuple[int, ...] = ()
        if parts[:2] == ["decoder", "layers"] and not sh.key.startswith(f"decoder.layers.{parts[2]}."):
            prefix, sizes = (int(parts[2]),), (dims.layers,)
        if parts[4:6] == ["experts", "local_experts"]:  # at EP=1 the local index is the global one
            prefix, sizes = prefix + (int(parts[6]),), sizes + (dims.experts,)
        out[name] = (sh.key, prefix, sizes, shape)
    return out


# ---------------------------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron dist checkpoint (reloads at any TP/PP)")
    a.add_argument("--hf-dir", required=True, type=Path)
    a.add_argument("--out", required=True, type=Path)
    a.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the HF config's dtype")
    a.add_argument("--overwrite", action="store_true")
    b = sub.add_parser("mcore-to-hf", help="megatron dist checkpoint -> HF safetensors + index + config")
    b.add_argument("--mcore-dir", required=True, type=Path)
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--hf-config", type=Path, default=None, help=f"HF config dir (default: MCORE_DIR/{HF_SUBDIR})")
    b.add_argument("--max-shard-size", default="5GB")
    b.add_argument("--overwrite", action="store_true")
    g = sub.add_parser("gguf-to-hf", help="GGUF file (llama.cpp) -> HF safetensors + config + tokenizer")
    g.add_argument("gguf_file", type=Path, metavar="GGUF_FILE")
    g.add_argument("out", type=Path, metavar="OUT_DIR")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dequantized to float32, then cast")
    g.add_argument("--max-shard-size", default="5GB")
    g.add_argument("--overwrite", action="store_true")
    for q in (a, b, g):
        q.add_argument("--report-memory", action="store_true", help="print peak RSS growth as JSON at the end")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start_rss = _rss_bytes()
    try:
        if args.direction == "hf-to-mcore":
            hf_to_mcore(args.hf_dir, args.out, DTYPES[args.dtype] if args.dtype else None, args.overwrite)
        elif args.direction == "gguf-to-hf":
            gguf_to_hf(args.gguf_file, args.out, DTYPES[args.dtype], _parse_size(args.max_shard_size), args.overwrite)
        else:
            mcore_to_hf(args.mcore_dir, args.out, args.hf_config, _parse_size(args.max_shard_size), args.overwrite)
    except (UserError, FileNotFoundError) as e:  # ConversionError, HFCheckpointError, GGUFError, a missing model...
        print(f"convert: error: {e}", file=sys.stderr)
        return 2
    if args.report_memory:
        print(json.dumps({"rss_start_bytes": start_rss, "peak_rss_bytes": _peak_rss_bytes()}))
    print(f"convert: wrote {args.out}", file=sys.stderr)
    return 0


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    # VmHWM is this process image's own high-water mark; getrusage's ru_maxrss survives exec and can report the
    # parent's peak instead.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
