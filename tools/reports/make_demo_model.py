"""Build the demo's tokenizer and tiny Qwen2 model, warm-started by supervised training on correct countdown answers.

    python tools/reports/make_demo_model.py [--out megatron_rlvr/demo/model] [--seed 0] [--steps 300]
    python tools/reports/make_demo_model.py --init-from DIR --out DIR2 --seed 1 ...   # continue SFT from a checkpoint
    python tools/reports/make_demo_model.py --weak     # the weaker prefix model (megatron_rlvr/demo/weak_model)

``--weak`` builds the demo's weaker model for outer prefixes (``rollout.prefix_model``): the demo model's tokenizer
(``--tokenizer-from``), two small layers and a short training, written to megatron_rlvr/demo/weak_model; any flag
given beside it overrides its preset.

The defaults rebuild the first stage of the committed model; its training_info.json records every stage's arguments
(``continued_from`` holds the earlier stage's record) and the measured base pass@1 / pass@64.

Writes an HF checkpoint (config.json, model.safetensors, tokenizer files, generation_config.json) that both
transformers and vLLM load, plus training_info.json with the settings and the base model's measured pass@k.
Plain torch + transformers on CPU; seeded, so a rerun on the same machine gives the same files.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from megatron_rlvr.demo.sampling import measure_pass_at_k
from megatron_rlvr.tasks import countdown as task

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
ALPHABET = list("0123456789+-*/() ->:\n")


def build_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on the task text, laid out exactly as transformers' Qwen2Tokenizer rebuilds
    it: AutoTokenizer (and so vLLM) forces that class on a qwen2 checkpoint and keeps only vocab and merges from
    tokenizer.json, so any other pre-tokenizer would be silently replaced on load. Its regex splits digits one by
    one, which keeps arithmetic learnable."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(
        models.BPE(
            unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = sorted({piece for ch in ALPHABET for piece, _ in byte_level.pre_tokenize_str(ch)})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, EOS, UNK], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left", model_max_length=128
    )


def reload_tokenizer(out: Path, built, texts: list[str]):
    """The tokenizer as every consumer will see it (AutoTokenizer on the saved dir), checked against the built one."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(out)
    for text in texts:
        want = built(text, add_special_tokens=False)["input_ids"]
        got = loaded(text, add_special_tokens=False)["input_ids"]
        if got != want or loaded.decode(got) != text:
            raise RuntimeError(f"saved tokenizer differs from the trained one on {text!r}: {got} vs {want}")
    if loaded.eos_token_id != built.eos_token_id or loaded.pad_token_id != built.pad_token_id:
        raise RuntimeError("saved tokenizer's special tokens differ from the trained one's")
    return loaded


def build_model(vocab_size: int, layers: int, hidden: int, intermediate: int, tokenizer, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,  # head_dim 32: the smallest vLLM's CPU attention supports
        num_key_value_heads=max(2, hidden // 64),
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def training_examples(problems: list[task.CountdownProblem], per_problem: int, rng: random.Random):
    """(prompt, answer) pairs: several different correct answers per problem, so the base model is diverse."""
    out = []
    for p in problems:
        sols = task.solutions(p.numbers, p.target, cap=32)
        for answer in rng.sample(sols, min(per_problem, len(sols))):
            out.append((p.prompt, answer))
    rng.shuffle(out)
    return out


def encode(tokenizer, examples: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels; the loss covers the answer and its EOS only."""
    rows = []
    for prompt, answer in examples:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p, a))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    return ids, labels


def train(model, ids: torch.Tensor, labels: torch.Tensor, steps: int, batch: int, lr: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    start = time.time()
    for step in range(steps):
        idx = torch.randint(0, ids.shape[0], (batch,), generator=gen)
        x, y = ids[idx], labels[idx]
        width = int((x != 0).sum(1).max())  # pad id 0: trim the all-pad tail of this batch
        x, y = x[:, :width], y[:, :width]
        out = model(input_ids=x, attention_mask=(x != 0).long(), labels=y)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {out.loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    model.eval()


DEMO = Path(__file__).resolve().parents[2] / "megatron_rlvr/demo"
# ours: a model that solves some countdown prompts (its prefixes are plausible starts) but clearly fewer than the
# demo model; measured figures in its training_info.json
WEAK_PRESET = dict(
    out=str(DEMO / "weak_model"),
    tokenizer_from=str(DEMO / "model"),
    layers=2,
    hidden=64,
    intermediate=128,
    steps=300,
    batch=64,
    train_problems=1000,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEMO / "model"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-problems", type=int, default=2500)
    ap.add_argument("--answers-per-problem", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--tokenizer-vocab", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--init-from", default="", help="continue SFT from this checkpoint (its tokenizer and shape)")
    ap.add_argument(
        "--tokenizer-from",
        default="",
        help="a new model (the shape flags) with this checkpoint's tokenizer and vocabulary size",
    )
    ap.add_argument("--weak", action="store_true", help="preset for the weaker prefix model (see the module doc)")
    ap.add_argument("--eval-seed", type=int, default=0, help="seed of the eval problems the base model is measured on")
    ap.add_argument("--eval-problems", type=int, default=32)
    ap.add_argument("--eval-samples", type=int, default=64)
    args = ap.parse_args(argv)
    if args.weak:  # the preset replaces the defaults only: flags given on the command line still win
        ap.set_defaults(**WEAK_PRESET)
        args = ap.parse_args(argv)
    if args.init_from and args.tokenizer_from:
        ap.error("--init-from and --tokenizer-from exclude each other (a continued model keeps its own tokenizer)")

    # One intra-op thread: on a shared 2-core machine, OpenMP threads spin against other jobs and run 3-10x slower.
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()
    problems = task.generate(args.seed, args.train_problems, "train")
    examples = training_examples(problems, args.answers_per_problem, rng)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = None
    if args.init_from:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.init_from)
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        vocab = model.config.vocab_size
        # the shape comes from the checkpoint: record that, not the (ignored) shape flags
        args.layers, args.hidden = model.config.num_hidden_layers, model.config.hidden_size
        args.intermediate = model.config.intermediate_size
        info_path = Path(args.init_from) / "training_info.json"
        previous = json.loads(info_path.read_text()) if info_path.is_file() else None
    elif args.tokenizer_from:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_from)
        # the donor's embedding rows, not len(tokenizer): token ids must index both models alike
        vocab = json.loads((Path(args.tokenizer_from) / "config.json").read_text())["vocab_size"]
        model = build_model(vocab, args.layers, args.hidden, args.intermediate, tokenizer, args.seed)
    else:
        # Prompts and answers apart: the actor feeds prompt ids then generated ids, so no merge may span the seam.
        texts = [t for pair in examples[:5000] for t in pair]
        tokenizer = build_tokenizer(texts, args.tokenizer_vocab)
        vocab = 8 * math.ceil(len(tokenizer) / 8)  # padded: a multiple of 8 (and so of TP=2)
        model = build_model(vocab, args.layers, args.hidden, args.intermediate, tokenizer, args.seed)
        model.config.save_pretrained(out)  # AutoTokenizer picks the tokenizer class from config.json's model_type
        tokenizer.save_pretrained(out)
        tokenizer = reload_tokenizer(out, tokenizer, texts[:2000] + [p + a for p, a in examples[:500]])
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{len(problems)} problems, {len(examples)} answers, tokenizer {len(tokenizer)} -> vocab {vocab}, "
        f"{n_params / 1e6:.2f}M parameters ({time.time() - t0:.0f}s)",
        flush=True,
    )

    ids, labels = encode(tokenizer, examples)
    train(model, ids, labels, args.steps, args.batch, args.lr, args.seed)

    eval_problems = task.generate(args.eval_seed, args.eval_problems, "eval")
    torch.manual_seed(args.seed + 1)
    results = measure_pass_at_k(model, tokenizer, eval_problems, args.eval_samples, temperature=1.0)
    print(json.dumps(results["summary"]), flush=True)

    model.generation_config.do_sample = True
    model.generation_config.temperature = 1.0
    model.generation_config.max_new_tokens = 32
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    info = {
        "args": vars(args) | {"out": None, "tokenizer_from": _portable(args.tokenizer_from)},
        "parameters": n_params,
        "vocab_size": vocab,
        "base_eval": results["summary"],
        "seconds": round(time.time() - t0),
        "continued_from": previous,
    }
    (out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"wrote {out} in {time.time() - t0:.0f}s", flush=True)
    return 0


def _portable(path: str) -> str:
    """A path inside the repository as relative to its root (what a record committed with the model can name)."""
    root = DEMO.parent.parent
    resolved = Path(path).resolve() if path else None
    return str(resolved.relative_to(root)) if resolved and resolved.is_relative_to(root) else path


if __name__ == "__main__":
    sys.exit(main())
