"""n = 1024 eval of the demo's tiny countdown model through the real vLLM engine (CPU), killed midway and resumed.

Uses ``megatron_rlvr/demo/model`` (committed by the demo), or the directory in ``MEGATRON_RLVR_DEMO_MODEL``.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MODEL = Path(os.environ.get("MEGATRON_RLVR_DEMO_MODEL", REPO / "megatron_rlvr" / "demo" / "model"))
N, CHUNK, PROBLEMS = 1024, 256, 3

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason=f"no tiny demo model at {MODEL}"),
]


def eval_command(data_dir: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatron_rlvr.eval.command",
        "--model",
        str(MODEL),
        "--benchmarks",
        "countdown",
        "--data-dir",
        str(data_dir),
        "--n",
        str(N),
        "--chunk",
        str(CHUNK),
        "--max-new-tokens",
        "24",
        "--max-model-len",
        "128",
        "--workers",
        "1",
        "--out",
        str(out),
    ]


def stored_lines(out: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in out.glob("*/samples/shard-*.jsonl"))


@pytest.mark.timeout(1800)
def test_n1024_eval_killed_midway_resumes_to_the_same_table(tmp_path):
    from megatron_rlvr.tasks import countdown as task

    data = tmp_path / "data"
    data.mkdir()
    with open(data / "countdown.jsonl", "w") as f:
        for p in task.generate(0, PROBLEMS, "eval"):
            f.write(json.dumps({"id": p.id, "numbers": list(p.numbers), "target": p.target}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    # the uninterrupted run goes beside the killed and the resumed one: each eval is one busy process, and the
    # machine has two cores
    whole_log = tmp_path / "whole.log"
    with open(whole_log, "w") as log:
        whole = subprocess.Popen(eval_command(data, tmp_path / "whole"), env=env, stdout=log, stderr=log)
    try:
        out = tmp_path / "resumed"
        killed = subprocess.Popen(
            eval_command(data, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 900
            while stored_lines(out) < CHUNK and time.monotonic() < deadline and killed.poll() is None:
                time.sleep(0.5)
            killed.send_signal(signal.SIGKILL)
        finally:
            killed.wait()
        partial = stored_lines(out)
        assert CHUNK <= partial < PROBLEMS * N, partial

        resumed = subprocess.run(eval_command(data, out), env=env, capture_output=True, text=True, timeout=1200)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        whole.wait(timeout=1200)
    finally:
        if whole.poll() is None:
            whole.kill()
            whole.wait()
    assert whole.returncode == 0, whole_log.read_text()[-3000:]
    print(whole_log.read_text())
    assert (out / "table.csv").read_text() == (tmp_path / "whole" / "table.csv").read_text()
    records = [json.loads(line) for p in out.glob("*/samples/shard-*.jsonl") for line in p.read_text().splitlines()]
    keys = {(r["benchmark"], r["problem_id"], r["sample"]) for r in records}
    assert len(records) == len(keys) == PROBLEMS * N

    # stronger than the table: every redrawn chunk reproduced the uninterrupted run's texts (per-chunk seeds)
    def texts(root):
        return {
            (r["problem_id"], r["sample"]): r["text"]
            for p in root.glob("*/samples/shard-*.jsonl")
            for r in map(json.loads, p.read_text().splitlines())
        }

    assert texts(out) == texts(tmp_path / "whole")
    print(f"killed after {partial} stored samples; resumed table == uninterrupted table")
