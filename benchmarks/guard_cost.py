"""What compfx.Guard costs when nothing goes wrong, as a fraction of a training step.

The digits CNN (``compfx.examples.cnn``) trains under ``Plan.amp`` in rounds;
each round times one step of every setting back to back on the same batch, so
machine load hits them alike, and the median over rounds is compared with the
unguarded step of the same rounds::

    python -m benchmarks.guard_cost --out benchmarks/results/cpu

Settings: the finite check every step (``check_every=1``, the default) and
every 10 steps; the FP32 shadow comparison every step and every 50 steps.
Writes ``guard_cost.json`` and ``guard_cost.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import compfx
from compfx.planned_module import PlannedModule
from compfx.examples import cnn
from compfx.files import write_json_atomic
from compfx.measure import timed

from . import data

__all__ = ["SETTINGS", "measure", "main"]

#: name -> Guard arguments (None: no guard, the optimizer steps itself)
SETTINGS = {"no guard": None, "check every step": {"check_every": 1}, "check every 10": {"check_every": 10},
            "shadow every step": {"shadow_every": 1}, "shadow every 50": {"shadow_every": 50}}


def measure(rounds: int = 60, batch_size: int = 64, low_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Median seconds per training step of each setting, and its overhead over the unguarded step."""
    images, labels = data.digits("train")
    batch = (images[:batch_size], labels[:batch_size])
    setups = {}
    for name, arguments in SETTINGS.items():
        torch.manual_seed(0)
        model = cnn()
        analysis = compfx.analyze(model, batch[0], low_dtype=low_dtype)
        planned = PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        guard = compfx.Guard(planned, **arguments) if arguments is not None else None
        setups[name] = (planned, optimizer, guard)

    def step(planned, optimizer, guard):
        optimizer.zero_grad(set_to_none=True)
        loss = F.nll_loss(planned(batch[0]), batch[1])
        loss.backward()
        if guard is None:
            optimizer.step()
        else:
            guard.step(optimizer, loss)

    for setup in setups.values():  # warm-up: first-call costs
        for _ in range(3):
            step(*setup)
    seconds = {name: [] for name in setups}
    for _ in range(rounds):
        for name, setup in setups.items():
            seconds[name].append(timed(lambda: step(*setup), torch.device("cpu"))[1])
    base = statistics.median(seconds["no guard"])
    rows = {}
    for name, values in seconds.items():
        median = statistics.median(values)
        rows[name] = {"median_step_seconds": median, "overhead_fraction": median / base - 1.0}
    return {"model": "digits_cnn", "plan": "Plan.amp", "low_dtype": str(low_dtype).replace("torch.", ""),
            "batch_size": batch_size, "rounds": rounds, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "settings": rows}


def markdown(results: dict) -> str:
    lines = [f"Digits CNN under Plan.amp ({results['low_dtype']}), batch {results['batch_size']}, "
             f"{results['rounds']} interleaved rounds, {results['threads']} thread(s); median step time, overhead "
             "against the unguarded step of the same rounds.", "",
             "| setting | median step | overhead |", "|---|---|---|"]
    for name, row in results["settings"].items():
        lines.append(f"| {name} | {row['median_step_seconds'] * 1e3:.2f} ms | {row['overhead_fraction']:+.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "guard_cost.json", results, "guard cost results")
    (out / "guard_cost.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
