"""Sample answers to countdown problems from an HF model (plain transformers, CPU) and score them.

Used by tools/reports/make_demo_model.py to measure the base model and by the demo tests; the trainer's own rollouts go
through vLLM, not through here.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rlvr.tasks import countdown as task


@torch.no_grad()
def sample_answers(
    model, tokenizer, prompts: list[str], n: int, temperature: float = 1.0, max_new_tokens: int = 32, batch: int = 512
) -> list[list[str]]:
    """``n`` sampled completions per prompt (special tokens stripped), in prompt order."""
    flat = [p for p in prompts for _ in range(n)]
    texts: list[str] = []
    tokenizer.padding_side = "left"  # generation continues from the right edge of every prompt
    for start in range(0, len(flat), batch):
        chunk = flat[start : start + batch]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts.extend(tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]


def measure_pass_at_k(
    model, tokenizer, problems: list[task.CountdownProblem], n: int, temperature: float = 1.0
) -> dict[str, Any]:
    """Per-sample results plus pass@1 (mean success rate) and pass@n (share of problems solved at least once)."""
    answers = sample_answers(model, tokenizer, [p.prompt for p in problems], n, temperature)
    samples = []
    solved, rates, distinct = 0, [], []
    for p, responses in zip(problems, answers):
        rewards = [1.0 if task.check_solution(r, p.numbers, p.target) else 0.0 for r in responses]
        samples.extend(
            {"prompt_id": p.id, "sample": i, "response": r, "reward": w}
            for i, (r, w) in enumerate(zip(responses, rewards))
        )
        rates.append(sum(rewards) / n)
        solved += any(rewards)
        distinct.append(len({r.split("\n", 1)[0].strip() for r, w in zip(responses, rewards) if w > 0}))
    summary = {
        "problems": len(problems),
        "samples_per_problem": n,
        "pass@1": round(sum(rates) / len(rates), 4),
        f"pass@{n}": round(solved / len(problems), 4),
        "mean_distinct_correct": round(sum(distinct) / len(distinct), 2),
    }
    return {"samples": samples, "summary": summary}
