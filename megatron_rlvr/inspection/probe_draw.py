"""Drawing the fixed probe set from the base model (`megatron-rlvr probe draw`): ``n`` samples per held-out prompt
through the rollout engine, verified by the reward pool, the scored rows kept (probe_set.py), and the base's forking
positions marked.

Prompts are drawn in blocks; each block's samples go to ``<out>.blocks/block-NNNNN.json`` as soon as they are
verified, so a killed draw resumes with the blocks that are missing (the same seeds, the same samples). A block's
seed derives from (seed, block) as the eval's requests do (eval/runner.py), and the engine seeds each prompt by its
position, so a sample depends only on where it sits. The forking positions come from the base's entropy at every
response position, scored teacher-forced by transformers on the CPU through the probe's own statistics
(probe_stats.py, one process) and cut per response at CaSP's quantile ``tau_q`` (algos/token_masks.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_rlvr.algos.token_masks import high_entropy_mask
from megatron_rlvr.inspection.probe_set import ProbePrompt, ProbeSet, ProbeSetError, rows_of
from megatron_rlvr.inspection.probe_stats import position_stats

if TYPE_CHECKING:
    from megatron_rlvr.eval.api import EngineFactory


@dataclass
class DrawSettings:
    benchmark: str = "reasoning_gym"
    data_dir: str = "data"
    limit: int = 128  # prompts (the benchmark file's first ones)
    n: int = 64  # samples per prompt
    keep: int = 4  # the first `keep` samples of each prompt are probe rows
    rare_max: int = 4  # a prompt solved in 1..rare_max of n gives its correct samples as rare rows
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    max_model_len: int = 256
    chat_template: bool = True
    system_prompt: str | None = None
    answer: str = "last_number"
    seed: int = 4321
    tau_q: float = 0.8  # the base's forking positions: entropy above this per-response quantile
    block_prompts: int = 16  # prompts per engine request and per resumable block

    def check(self) -> None:
        for name in ("limit", "n", "keep", "rare_max", "max_new_tokens", "block_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProbeSetError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {value!r}")
        if self.keep > self.n:
            raise ProbeSetError(f"--keep {self.keep}: more than --n {self.n} samples per prompt")
        if not 0 <= self.tau_q < 1:
            raise ProbeSetError(f"--tau-q {self.tau_q}: expected a quantile in [0, 1)")
        if not self.temperature > 0:
            raise ProbeSetError(f"--temperature {self.temperature}: expected > 0")

    def sampling_key(self) -> dict[str, Any]:
        """What a stored block must share with this draw to be reused (everything that changes its samples)."""
        return {k: v for k, v in asdict(self).items() if k not in ("limit", "keep", "rare_max", "tau_q", "data_dir")}


def _block_path(blocks: Path, index: int) -> Path:
    return blocks / f"block-{index:05d}.json"


def _read_block(path: Path, settings: DrawSettings, ids: list[str]) -> list[dict] | None:
    """A stored block's per-prompt samples, or None when absent; a block of other settings or prompts is refused."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("settings") != settings.sampling_key() or data.get("ids") != ids:
        raise ProbeSetError(
            f"{path}: drawn with other settings or prompts than this draw; remove {path.parent} or give another --out"
        )
    return data["samples"]


def _write_block(path: Path, settings: DrawSettings, ids: list[str], samples: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"settings": settings.sampling_key(), "ids": ids, "samples": samples}) + "\n")
    os.replace(tmp, path)


def draw(
    model_dir: str, settings: DrawSettings, out: str | os.PathLike, engine_factory: EngineFactory | None = None
) -> ProbeSet:
    """Draw (or resume) the probe set of ``model_dir`` and save it to ``out``; returns it. ``engine_factory`` makes
    the model's engine (default: vLLM, as `megatron-rlvr eval` samples), started only when a block is missing."""
    from megatron_rlvr.eval.api import hf_encoder_factory, vllm_engine_factory
    from megatron_rlvr.eval.config import EvalConfig
    from megatron_rlvr.eval.runner import request_seed
    from megatron_rlvr.problems.benchmarks import load_benchmark
    from megatron_rlvr.rewards.config import RewardConfig
    from megatron_rlvr.rewards.pool import RewardPool
    from megatron_rlvr.rollout.base import Sampling

    settings.check()
    if not (Path(model_dir) / "config.json").is_file():
        raise ProbeSetError(f"--model {model_dir}: not an HF model directory (no config.json)")
    problems = load_benchmark(settings.benchmark, settings.data_dir, settings.limit)
    eval_cfg = EvalConfig(
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed,
        chat_template=settings.chat_template,
        system_prompt=settings.system_prompt,
    )
    encode = hf_encoder_factory(model_dir, eval_cfg)
    out = Path(out)
    blocks = out.with_name(out.name + ".blocks")
    engine = None
    per_prompt: list[dict] = []
    with RewardPool(RewardConfig(workers=1, answer=settings.answer)) as pool:  # type: ignore[arg-type]
        try:
            for b, start in enumerate(range(0, len(problems), settings.block_prompts)):
                block = problems[start : start + settings.block_prompts]
                ids = [p.problem_id for p in block]
                samples = _read_block(_block_path(blocks, b), settings, ids)
                if samples is None:
                    if engine is None:
                        factory = engine_factory or vllm_engine_factory(settings.max_model_len)
                        engine = factory(model_dir, eval_cfg)
                    prompt_ids = [encode(p.prompt) for p in block]
                    sampling = Sampling(
                        temperature=settings.temperature,
                        top_p=settings.top_p,
                        max_tokens=settings.max_new_tokens,
                        seed=request_seed(settings.seed, "probe", b, 0),
                        logprobs=False,
                    )
                    completions = engine.generate(prompt_ids, settings.n, sampling)
                    flat = [(p, c) for p, drawn in zip(block, completions) for c in drawn]
                    rewards, _ = pool.score_batch(
                        [p.task for p, _ in flat], [c.text for _, c in flat], [p.reference for p, _ in flat]
                    )
                    samples = []
                    for j, (ids_p, drawn) in enumerate(zip(prompt_ids, completions)):
                        got = rewards[j * settings.n : (j + 1) * settings.n]
                        samples.append(
                            {"prompt_ids": ids_p, "ids": [list(c.token_ids) for c in drawn], "rewards": list(got)}
                        )
                    _write_block(_block_path(blocks, b), settings, ids, samples)
                    print(f"[probe draw] block {b}: {len(block)} prompts x {settings.n} samples", flush=True)
                per_prompt.extend(samples)
        finally:
            if engine is not None:
                engine.close()
    prompts, rows = [], []
    for i, (problem, drawn) in enumerate(zip(problems, per_prompt)):
        correct = sum(1 for r in drawn["rewards"] if r >= 1.0)
        prompt = ProbePrompt(problem.problem_id, problem.prompt, list(drawn["prompt_ids"]), settings.n, correct)
        prompts.append(prompt)
        rows.extend(rows_of(i, prompt, list(zip(drawn["ids"], drawn["rewards"])), settings.keep, settings.rare_max))
    probe_set = ProbeSet(str(Path(model_dir).resolve()), asdict(settings), prompts, rows)
    mark_forking(probe_set, model_dir, settings.tau_q, settings.temperature)
    probe_set.save(out)
    return probe_set


@torch.no_grad()
def base_entropy(model_dir: str, probe_set: ProbeSet, rows: Sequence[int], temperature: float) -> list[torch.Tensor]:
    """The base's entropy at every response position of ``rows`` (transformers on the CPU, float32 weights; the
    probe's statistics with one process holding the whole vocabulary)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = int(model.config.vocab_size)
    out = []
    for r in rows:
        row = probe_set.rows[r]
        prompt = probe_set.prompts[row.prompt].prompt_ids
        ids = torch.tensor([prompt + row.ids])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : ids.shape[1] - 1, :vocab].float().contiguous()
        stats = position_stats(logits, torch.tensor(row.ids), (1,), vocab_size=vocab, temperature=temperature)
        out.append(stats.entropy)
    return out


def mark_forking(probe_set: ProbeSet, model_dir: str, tau_q: float, temperature: float) -> None:
    """Set each probe row's ``forking`` positions: entropy above the per-response quantile ``tau_q`` under the
    base (CaSP's own mask, algos/token_masks.high_entropy_mask)."""
    rows = [i for i, r in enumerate(probe_set.rows) if r.probe]
    entropies = base_entropy(model_dir, probe_set, rows, temperature)
    for i, entropy in zip(rows, entropies):
        mask = high_entropy_mask(entropy[None], torch.ones(1, len(entropy), dtype=torch.bool), tau_q)[0]
        probe_set.rows[i].forking = [int(j) for j in mask.nonzero().flatten()]
