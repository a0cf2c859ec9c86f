"""Candidate matrices (the CaSP paper's Appendix G): per response token, each model's top-N candidates and their
probabilities, models side by side on the same tokens, as one heatmap PNG plus the numbers as JSON.

    megatron-rlvr candidates --model BASE TRAINED --prompt "9 7 6 9 -> 18:" [--response TEXT] --out cand.png
    megatron-rlvr candidates --model BASE --benchmark data/math500.jsonl --row 3 --json cand.json

Without ``--response`` the first model samples one (deterministic for a given ``--seed``). The statistics come from
the project's token-statistics op (`vocab_parallel_token_stats`: ids >= the config's vocab_size excluded, ties to
the lower id), over softmax(logits / temperature) of a plain transformers model on CPU: an inspection tool, no
Megatron. Prompts are encoded as `megatron-rlvr eval` encodes them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_rlvr.errors import UserError
from megatron_rlvr.models.tokenizer_check import check_same_tokenizer


class CandidatesError(UserError, ValueError):
    """Bad input to `megatron-rlvr candidates`: the message names the argument and what was expected."""


@dataclass
class TokenCandidates:
    id: int  # the response token
    text: str
    prob: float  # its probability under this model
    rank: int | None  # its rank among this model's top-N (1-based), None when outside
    entropy: float
    candidates: list[dict[str, Any]] = field(default_factory=list)  # [{id, text, prob}], rank 1 first


@dataclass
class CandidateMatrix:
    label: str
    model_dir: str
    tokens: list[TokenCandidates]


def token_text(tokenizer, token_id: int) -> str:
    """A token as readers should see it in a cell: spaces as '·', newlines as '\\n', ids outside the tokenizer named."""
    text = tokenizer.decode([token_id]) if token_id < len(tokenizer) else ""
    if not text:
        return f"<{token_id}>"
    return text.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t").replace("$", r"\$")


def load_model(model_dir: str):
    """(model in eval mode, float32 on CPU; tokenizer) of an HF directory, or a CandidatesError naming it."""
    if not (Path(model_dir) / "config.json").is_file():
        raise CandidatesError(f"--model {model_dir}: not an HF model directory (no config.json)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a console tool: no "Loading weights" bars between its lines
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tokenizer


def _vocab_size(model) -> int:
    return int(model.config.vocab_size)


def _context_limit(model) -> int | None:
    value = getattr(model.config, "max_position_embeddings", None)
    return int(value) if value else None


def sample_response(
    model,
    tokenizer,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    stop: Sequence[str] = (),
) -> list[int]:
    """One sampled response (token ids, without the EOS or the token that completes a stop string)."""
    import torch

    limit = _context_limit(model)
    if limit is not None:
        max_new_tokens = min(max_new_tokens, limit - len(prompt_ids))
    generator = torch.Generator().manual_seed(seed)
    eos = {int(i) for i in ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}
    eos |= {int(i) for i in _as_list(getattr(model.generation_config, "eos_token_id", None))}
    vocab = _vocab_size(model)
    response: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(prompt_ids)]), use_cache=True)
        for _ in range(max_new_tokens):
            probs = torch.softmax(out.logits[0, -1, :vocab].float() / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            if token in eos:
                break
            response.append(token)
            if stop and any(s in tokenizer.decode(response) for s in stop):
                response.pop()
                break
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return response


def _as_list(value: Any) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def candidate_matrix(
    model,
    tokenizer,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    *,
    top_n: int,
    temperature: float = 1.0,
    label: str = "",
    model_dir: str = "",
) -> CandidateMatrix:
    """Per response token: this model's top-N candidates (the op's order), the token's probability, rank, entropy."""
    import torch

    from megatron_rlvr.ops import vocab_parallel_token_stats

    ids = list(prompt_ids) + list(response_ids)
    limit = _context_limit(model)
    if limit is not None and len(ids) > limit:
        raise CandidatesError(
            f"prompt + response: {len(ids)} tokens, more than {model_dir or label}'s {limit} positions"
        )
    vocab = _vocab_size(model)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, len(prompt_ids) - 1 : len(ids) - 1].float().contiguous()
        stats = vocab_parallel_token_stats(
            logits, torch.tensor(list(response_ids)), min(top_n, vocab), vocab_size=vocab, temperature=temperature
        )
    tokens = []
    for t, token in enumerate(response_ids):
        top_ids = [int(i) for i in stats.topn_ids[t]]
        top_probs = [math.exp(float(lp)) for lp in stats.topn_logp[t]]
        tokens.append(
            TokenCandidates(
                id=int(token),
                text=token_text(tokenizer, int(token)),
                prob=math.exp(float(stats.logp[t])),
                rank=top_ids.index(int(token)) + 1 if int(token) in top_ids else None,
                entropy=float(stats.entropy[t]),
                candidates=[{"id": i, "text": token_text(tokenizer, i), "prob": p} for i, p in zip(top_ids, top_probs)],
            )
        )
    return CandidateMatrix(label=label, model_dir=model_dir, tokens=tokens)


def render(matrices: Sequence[CandidateMatrix], path: str | os.PathLike, title: str = "", max_rows: int = 64) -> Path:
    """One PNG: a panel per model (columns = ranks 1..N, rows = response tokens, colour = probability), each cell
    annotated with the candidate's text and probability; the response's own token is outlined in red."""
    import numpy as np

    from megatron_rlvr.monitor.plots import pyplot

    plt = pyplot()
    from matplotlib.patches import Rectangle

    rows = min(len(matrices[0].tokens), max_rows)
    top_n = max(len(tok.candidates) for m in matrices for tok in m.tokens)
    if rows < len(matrices[0].tokens):
        title = f"{title} (first {rows} of {len(matrices[0].tokens)} response tokens)".strip()
    fig, axes = plt.subplots(
        1,
        len(matrices),
        squeeze=False,
        sharey=True,
        figsize=(len(matrices) * (1.05 * top_n + 0.4) + 1.8, 0.3 * rows + 1.6),
    )
    image = None
    for ax, m in zip(axes[0], matrices):
        probs = np.full((rows, top_n), np.nan)
        for t, tok in enumerate(m.tokens[:rows]):
            for n, cand in enumerate(tok.candidates):
                probs[t, n] = cand["prob"]
                ax.text(
                    n,
                    t,
                    f"{cand['text']} {cand['prob']:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if cand["prob"] > 0.6 else "white",
                )
                if cand["id"] == tok.id:
                    ax.add_patch(Rectangle((n - 0.5, t - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
        image = ax.imshow(probs, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_xticks(range(top_n), [f"#{n + 1}" for n in range(top_n)], fontsize=8)
        ax.xaxis.tick_top()
        ax.set_title(m.label, fontsize=9)
    axes[0][0].set_yticks(range(rows), [f"{tok.text}" for tok in matrices[0].tokens[:rows]], fontsize=8)
    axes[0][0].set_ylabel("response token")
    fig.colorbar(image, ax=list(axes[0]), fraction=0.04, pad=0.02, label="probability")
    if title:
        fig.suptitle(title, fontsize=9, y=1.0 + 0.35 / fig.get_figheight())  # above the panels' own titles
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def build(
    models: Sequence[str],
    prompt: str,
    *,
    response: str | None = None,
    labels: Sequence[str] | None = None,
    top_n: int = 5,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    seed: int = 0,
    chat_template: bool = False,
) -> dict[str, Any]:
    """Load the models, encode the prompt, sample (or tokenize) the response, compute every model's matrix.

    Returns {prompt, response, prompt_ids, response_ids, ..., "matrices": [CandidateMatrix]}.
    """
    if not models:
        raise CandidatesError("--model: give at least one HF model directory")
    if not prompt or not prompt.strip():
        raise CandidatesError("--prompt: empty; give the prompt text (or --benchmark FILE --row N)")
    if top_n < 1:
        raise CandidatesError(f"--top-n: expected an integer >= 1, got {top_n}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise CandidatesError(f"--temperature: expected a finite number > 0, got {temperature}")
    if response is None and max_new_tokens < 1:
        raise CandidatesError(f"--max-new-tokens: expected an integer >= 1, got {max_new_tokens}")
    for model_dir in models:  # every directory checked before any model loads
        if not (Path(model_dir) / "config.json").is_file():
            raise CandidatesError(f"--model {model_dir}: not an HF model directory (no config.json)")
    if labels is None:
        from megatron_rlvr.eval.api import model_tags

        labels = model_tags(models)
    loaded = [load_model(m) for m in models]
    for model_dir, (_, tokenizer) in zip(models[1:], loaded[1:]):  # candidates are compared token by token
        check_same_tokenizer(
            "--model", model_dir, models[0], reference_name=models[0], tokenizers=(loaded[0][1], tokenizer)
        )
    from megatron_rlvr.eval.api import hf_encoder_factory
    from megatron_rlvr.eval.config import EvalConfig

    prompt_ids = hf_encoder_factory(models[0], EvalConfig(chat_template=chat_template))(prompt)
    if not prompt_ids:
        raise CandidatesError(f"--prompt {prompt!r}: encodes to no tokens with {models[0]}'s tokenizer")
    model, tokenizer = loaded[0]
    if response is None:
        response_ids = sample_response(
            model, tokenizer, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, stop=stop
        )
        if not response_ids:
            raise CandidatesError(f"{models[0]} answered with an empty response (seed {seed}); try another --seed")
    else:
        response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
        if not response_ids:
            raise CandidatesError(f"--response {response!r}: encodes to no tokens with {models[0]}'s tokenizer")
    matrices = [
        candidate_matrix(
            m,
            tok,
            prompt_ids,
            response_ids,
            top_n=top_n,
            temperature=temperature,
            label=label,
            model_dir=str(Path(d).resolve()),
        )
        for (m, tok), label, d in zip(loaded, labels, models)
    ]
    return {
        "prompt": prompt,
        "response": tokenizer.decode(response_ids),
        "sampled": response is None,
        "seed": seed if response is None else None,
        "temperature": temperature,
        "top_n": top_n,
        "prompt_ids": list(prompt_ids),
        "response_ids": response_ids,
        "matrices": matrices,
    }


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in result.items() if k != "matrices"}, "models": [asdict(m) for m in result["matrices"]]}


def _benchmark_of_file(path: Path) -> tuple[str, Path] | None:
    """(benchmark name, its --data-dir) of a file named as `eval` looks benchmarks up, e.g. data/math500/test.jsonl."""
    from megatron_rlvr.problems.benchmarks import BENCHMARKS

    if path.suffix not in (".jsonl", ".parquet"):
        return None
    stem = path.with_suffix("").parts
    for name, spec in BENCHMARKS.items():
        for f in spec.files:
            parts = Path(f).parts
            if len(stem) >= len(parts) and stem[len(stem) - len(parts) :] == parts:
                return name, Path(*stem[: len(stem) - len(parts)])
    return None


def benchmark_prompt(benchmark: str, row: int, data_dir: str = "data") -> str:
    """The prompt of row ``row`` (0-based) of a benchmark, given as a file (its layout found from its name, as under
    `eval --data-dir`) or as a benchmark name under ``data_dir``; loaded by the eval's own loaders."""
    from megatron_rlvr.problems.benchmarks import BENCHMARKS, load_benchmark

    if row < 0:
        raise CandidatesError(f"--row: expected an index >= 0, got {row}")
    path = Path(benchmark)
    if path.is_file():
        found = _benchmark_of_file(path)
        if found is None:
            names = sorted(f"{f}.jsonl" for spec in BENCHMARKS.values() for f in spec.files)
            raise CandidatesError(
                f"--benchmark {benchmark}: not a benchmark file name; expected one of {', '.join(names)}"
            )
        name, data_dir = found
    elif benchmark in BENCHMARKS:
        name = benchmark
    else:
        raise CandidatesError(
            f"--benchmark {benchmark}: no such file, and not a benchmark name ({', '.join(sorted(BENCHMARKS))})"
        )
    problems = load_benchmark(name, data_dir, limit=row + 1)
    if row >= len(problems):
        raise CandidatesError(f"--row {row}: benchmark {name} under {data_dir} has {len(problems)} rows")
    return problems[row].prompt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rlvr candidates", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", nargs="+", required=True, help="HF model directories sharing one tokenizer; the first samples"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text (encoded as `megatron-rlvr eval` encodes it)")
    source.add_argument("--benchmark", help="a benchmark file (e.g. data/math500.jsonl) or name under --data-dir")
    parser.add_argument("--row", type=int, default=0, help="with --benchmark: the row (0-based)")
    parser.add_argument("--data-dir", default="data", help="with --benchmark NAME: where its file lies")
    parser.add_argument("--response", help="score this response instead of sampling one from the first model")
    parser.add_argument("--top-n", type=int, default=5, help="candidates per token (columns per model)")
    parser.add_argument("--temperature", type=float, default=1.0, help="of sampling and of the shown probabilities")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--stop", nargs="*", default=[], help="stop strings of the sampled response")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same response)")
    parser.add_argument(
        "--chat-template", action="store_true", help="wrap the prompt with the tokenizer's chat template"
    )
    parser.add_argument("--label", nargs="+", help="a name per model (default: the directories' distinct tails)")
    parser.add_argument("--max-rows", type=int, default=64, help="response tokens drawn (the JSON has all)")
    parser.add_argument("--out", default="candidates.png", help="the heatmap PNG")
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.label is not None and len(args.label) != len(args.model):
        raise CandidatesError(f"--label: {len(args.label)} names for {len(args.model)} models")
    prompt = args.prompt if args.prompt is not None else benchmark_prompt(args.benchmark, args.row, args.data_dir)
    result = build(
        args.model,
        prompt,
        response=args.response,
        labels=args.label,
        top_n=args.top_n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        seed=args.seed,
        chat_template=args.chat_template,
    )
    png = render(
        result["matrices"],
        args.out,
        title=f"prompt {prompt[:60]!r} -> response {result['response'][:60]!r}",
        max_rows=args.max_rows,
    )
    print(f"candidates: {png}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(to_json(result), indent=1) + "\n")
        print(f"numbers: {args.json}")
    return 0
