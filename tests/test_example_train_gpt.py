"""`python examples/train_gpt.py --tiny`: the nanoGPT-style example searches a plan and trains FP32, AMP and compfx."""

import math
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def test_train_gpt_tiny_runs_and_reports_three_runs(tmp_path):
    log = tmp_path / "search.jsonl"
    root = str(EXAMPLE.parent.parent)  # this checkout's compfx, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--tiny", "--log", str(log)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("compfx plan ") for line in lines)
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] in (["fp32"], ["amp"], ["compfx"])}
    assert set(rows) == {"fp32", "amp", "compfx"}
    for tokens_per_s, ratio, loss in rows.values():
        assert float(tokens_per_s.replace(",", "")) > 0 and math.isfinite(float(loss))
    assert rows["fp32"][1] == "1.00" and log.stat().st_size > 0
