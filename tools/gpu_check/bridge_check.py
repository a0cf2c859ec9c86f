"""Stage 3 of the GPU check: the bridge exports the ~1B random Qwen2 from CUDA tensors to HF names and layouts.

One rank, TP = PP = 1, bf16, the actor's own model builder and loader. Two exports, each timed (bytes/s over the
HF tensors it yields) and checked bit for bit:
  1. right after loading the HF checkpoint: the export must give back the checkpoint's own tensors (load, then
     export, is the identity);
  2. after every parameter was moved by random noise on the GPU: the export must equal the model's own state dict
     re-laid out here, by code written apart from the bridge's (q/k/v out of megatron's per-group rows, gate/up out
     of fc1, the vocabulary padding cut off).

    python tools/gpu_check/bridge_check.py --model 1b --out /tmp/bridge.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(common.MODELS), default="1b")
    p.add_argument("--bucket-mib", type=int, default=256, help="export bucket size")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--work", type=Path, default=common.DEFAULT_WORK)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--allow-cpu", action="store_true", help="run without CUDA (to test this script itself)")
    return p


def preflight(args: argparse.Namespace) -> list[str]:
    if args.bucket_mib < 1:
        raise SystemExit(f"bridge_check: --bucket-mib must be >= 1, got {args.bucket_mib}")
    import safetensors.torch  # noqa: F401

    from megatron_rlvr.bridge import export_hf_weights, load_hf_weights  # noqa: F401
    from megatron_rlvr.models import build_gpt_model, load_hf_config, transformer_config_from_hf  # noqa: F401

    return []


def hf_from_state_dict(state: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """The HF tensors of a TP = PP = 1 Qwen2 GPTModel's state dict (local or TE layer names), written apart from the
    bridge's mapping so that the check does not grade the bridge by itself."""
    nq, ng = hf["num_attention_heads"], hf["num_key_value_heads"]
    d = hf.get("head_dim") or hf["hidden_size"] // nq
    per_group = nq // ng
    out: dict[str, Any] = {}
    suffix = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    for name, t in state.items():
        if name.endswith("_extra_state"):
            continue
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[: hf["vocab_size"]]
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t[: hf["vocab_size"]]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif name.startswith("decoder.layers."):
            layer, rest = name[len("decoder.layers.") :].split(".", 1)
            prefix = f"model.layers.{layer}."
            if rest in suffix:
                out[prefix + suffix[rest]] = t
            elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                kind = rest.rsplit(".", 1)[1]
                rows = t.reshape(ng, (per_group + 2) * d, *t.shape[1:])  # per group: its q heads, then k, then v
                out[prefix + f"self_attn.q_proj.{kind}"] = rows[:, : per_group * d].reshape(nq * d, *t.shape[1:])
                out[prefix + f"self_attn.k_proj.{kind}"] = rows[:, per_group * d : (per_group + 1) * d].reshape(
                    ng * d, *t.shape[1:]
                )
                out[prefix + f"self_attn.v_proj.{kind}"] = rows[:, (per_group + 1) * d :].reshape(ng * d, *t.shape[1:])
            elif rest == "mlp.linear_fc1.weight":
                gate, up = t.chunk(2, dim=0)
                out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
            else:
                raise KeyError(f"bridge_check: no HF name known for {name}")
        else:
            raise KeyError(f"bridge_check: no HF name known for {name}")
    return out


def timed_export(model, hf: dict[str, Any], bucket_bytes: int, cuda: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every HF tensor the bridge yields (its own buffers, as it yields them), and the export's figures."""
    from megatron_rlvr.bridge import export_hf_weights

    got: dict[str, Any] = {}
    timer = common.Timer(cuda)
    with timer:
        for bucket in export_hf_weights([model], hf, bucket_bytes=bucket_bytes, include_lm_head=False):
            got.update(bucket)
    nbytes = sum(t.numel() * t.element_size() for t in got.values())
    devices = sorted({str(t.device) for t in got.values()})
    return got, {
        "seconds": round(timer.seconds, 4),
        "bytes": nbytes,
        "gb_per_s": round(nbytes / timer.seconds / 1e9, 3),
        "tensors": len(got),
        "yielded_on": devices,
    }


def bit_exact(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """Same names, shapes and values, bit for bit (in the wider dtype of the two, where the narrower one's values are
    exact). A dtype that differs is listed apart: megatron's local RMSNorm keeps its weight in fp32 in a bf16 model."""
    import torch

    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    common_names = sorted(set(got) & set(want))

    def same(a, b) -> bool:
        if a.shape != b.shape:
            return False
        a, b = a.cpu(), b.cpu()
        wide = torch.promote_types(a.dtype, b.dtype)  # bf16 -> fp32 is exact
        return torch.equal(a.to(wide), b.to(wide))

    differ = [n for n in common_names if not same(got[n], want[n])]
    dtypes = sorted({f"{got[n].dtype} for {want[n].dtype}" for n in common_names if got[n].dtype != want[n].dtype})
    return {
        "ok": not (missing or extra or differ),
        "compared": len(common_names),
        "missing": missing[:5],
        "unexpected": extra[:5],
        "differ": differ[:5],
        "n_differ": len(differ),
        "dtype_differs": dtypes,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    preflight(args)
    import torch
    from safetensors import safe_open

    from megatron_rlvr.bridge import load_hf_weights
    from megatron_rlvr.models import build_gpt_model, load_hf_config, transformer_config_from_hf
    from megatron_rlvr.runtime.distributed import model_parallel

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        raise SystemExit("bridge_check: needs CUDA (it checks the export from CUDA tensors)")
    backend = common.init_process_group()
    result: dict[str, Any] = {"env": common.environment(), "backend": backend, "model": args.model}
    timer = common.Timer(cuda=False)
    with timer:
        hf_dir = common.model_dir(args.model, args.work)
    result["model_dir_s"] = round(timer.seconds, 2)
    hf = load_hf_config(hf_dir)
    bucket = args.bucket_mib << 20
    with model_parallel(tp=1, pp=1, seed=args.seed):
        tcfg = transformer_config_from_hf(hf, params_dtype=torch.bfloat16)
        model = build_gpt_model(hf, tcfg)
        with common.Timer(cuda) as t:
            load_hf_weights([model], hf_dir)
        result["load_s"] = round(t.seconds, 3)
        result["param_device"] = str(next(model.parameters()).device)
        result["param_devices"] = sorted({str(p.device) for p in model.parameters()})

        got, result["export_loaded"] = timed_export(model, hf, bucket, cuda)
        files: dict[str, Any] = {}
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                files |= {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 - safe_open is not a dict
        result["export_loaded"]["vs_checkpoint_files"] = bit_exact(got, files)
        del got

        # the moves are drawn on the CPU: one generator serves parameters wherever each one lives
        gen = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.01).to(p.device, p.dtype))
        got, result["export_moved"] = timed_export(model, hf, bucket, cuda)
        want = hf_from_state_dict(model.state_dict(), hf)
        result["export_moved"]["vs_state_dict"] = bit_exact(got, want)
        result["export_moved"]["moved_from_files"] = sum(not torch.equal(got[n], files[n]) for n in files if n in got)
    result["ok"] = bool(
        result["param_devices"] == [result["param_device"]]  # no weight left behind on another device
        and result["export_loaded"]["vs_checkpoint_files"]["ok"]
        and result["export_moved"]["vs_state_dict"]["ok"]
        and result["export_moved"]["moved_from_files"]
    )
    common.write_json(args.out, result)
    print(f"bridge_check: {'ok' if result['ok'] else 'MISMATCH'}; wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
