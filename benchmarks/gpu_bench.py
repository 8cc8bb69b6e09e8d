"""The GPU suite's paper-scale benchmarks: which rows there are, how one is measured, and the workers that measure them.

A row is one model in one mode, eager or under ``torch.compile`` (``+compile``):

* ``fp32``; ``amp-fp16`` (autocast + GradScaler); ``amp-bf16`` (autocast);
* ``compfx-fp16``: ``compfx.optimize`` searches a plan on the row's batches
  (the search is timed), then the planned module trains with the same
  optimizer and a GradScaler. Its ``+compile`` row runs the plan that the eager
  row found through ``compfx.compile_with_plan(model, plan, inner="inductor")``
  and searches nothing.

Each row is :func:`benchmarks.harness.run_benchmark` at the model's paper config
on synthetic data (paper batch sizes): one warm-up step (that compiles, under
``torch.compile``), then epochs of ``batches`` steps, each epoch timed with the
device synchronised at both ends; the first epoch is dropped and the median of
the rest is the step time. Peak memory is ``torch.cuda.max_memory_allocated``
over the timed epochs. The rows add steps/s, the step's FLOPs
(:mod:`benchmarks.flops`) and, for compfx, the search's share of a 100-epoch run
on the model's real training set (:data:`EPOCH_DATA`).

Rows run in groups, one model eager or compiled, each group in one worker
process (``python -m benchmarks.gpu_bench --worker``) that measures its rows one
after the other, so a model's modes are measured side by side; each row has a
time limit (:mod:`benchmarks.timebox` kills the worker and the next worker
carries on with the group's remaining rows). A group runs as many of its rows,
in order, as its estimated cost lets fit in the time left; the rest are left for
the next run.

The padding row (``padding=True``: :data:`PADDING_TASK`) is one model with an unfit
shape, GPT-2's vocabulary of 50,257, trained under one plan with and without
Tensor Core shape padding, in turns, by :mod:`benchmarks.padding`; its
``padding`` entry holds both timings and the verdict.

>>> [task.id for task in suite_groups(["gpt"], ["fp32", "compfx-fp16"], compiled=True)[1]]
['gpt/fp32+compile', 'gpt/compfx-fp16+compile']
>>> [task.id for task in suite_groups(["gpt"], ["fp32"], compiled=False, padding=True)[-1]]
['gpt_vocab50257/padding-fp16']
>>> parse_mode("amp-bf16")
('amp', 'bf16')
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["SUITE_MODELS", "SMOKE_MODELS", "MODES", "EPOCH_DATA", "Task", "Settings", "parse_mode", "suite_groups",
           "needs_run", "run_groups", "measure_row", "worker_main", "PADDING_TASK"]

SUITE_MODELS = ("alexnet_cifar", "vgg16_cifar", "resnet", "bert_squad", "gpt")
SMOKE_MODELS = ("alexnet_cifar", "bert_squad")  # one CNN, one transformer: the smoke run must stay well under a minute
MODES = ("fp32", "amp-fp16", "amp-bf16", "compfx-fp16")
_TRANSFORMERS = ("bert_squad", "gpt")

#: The real training set a 100-epoch run would go through, per model: (name, examples). CIFAR-100 and SQuAD v2.0
#: are the CoMP paper's; the GPT row has no paper counterpart, so WikiText-103's training split (about 103M tokens,
#: 100,807 windows of 1,024) stands in as the yardstick.
EPOCH_DATA = {
    "alexnet_cifar": ("CIFAR-100 train", 50_000),
    "vgg16_cifar": ("CIFAR-100 train", 50_000),
    "resnet": ("CIFAR-100 train", 50_000),
    "bert_squad": ("SQuAD v2.0 train", 130_319),
    "gpt": ("WikiText-103 train, 1,024-token windows", 100_807),
}
RUN_EPOCHS = 100  # the run the search cost is a share of

ROOT = Path(__file__).resolve().parent.parent


def parse_mode(label: str) -> tuple[str, str]:
    """``"amp-fp16"`` -> ``("amp", "fp16")``; ``"fp32"`` -> ``("fp32", "auto")``."""
    mode, _, low = label.partition("-")
    if mode not in ("fp32", "amp", "compfx", "padding") or (mode != "fp32" and low not in ("fp16", "bf16")):
        raise ValueError(f"mode {label!r}; expected fp32, amp-fp16, amp-bf16, compfx-fp16, compfx-bf16 (or the "
                         "padding row's padding-fp16)")
    return mode, low or "auto"


@dataclass(frozen=True)
class Task:
    """One row to measure."""

    model: str
    mode: str  # a label: fp32, amp-fp16, amp-bf16, compfx-fp16, compfx-bf16
    compiled: bool = False

    @property
    def id(self) -> str:
        return f"{self.model}/{self.mode}{'+compile' if self.compiled else ''}"

    @property
    def kind(self) -> str:
        """What dominates its cost: "compile", "search" (eager compfx), "padding" (the padding row) or "eager"."""
        if self.compiled:
            return "compile"
        if self.mode.startswith("padding"):
            return "padding"
        return "search" if self.mode.startswith("compfx") else "eager"

    @property
    def eager_twin(self) -> str:
        """The id of the same row without ``torch.compile`` (a compiled compfx row runs its plan)."""
        return f"{self.model}/{self.mode}"


@dataclass(frozen=True)
class Settings:
    """How every row of one suite run is measured."""

    smoke: bool = False
    config: str = "paper"
    device: str = "cuda"
    batches: int = 10  # steps per timed epoch (the search's loader too)
    epochs: int = 4  # the first is dropped: warm-up
    compile_backend: str = "inductor"
    count_casts: bool = True
    search: dict = field(default_factory=lambda: {"progress": False})
    row_limit_s: float | None = None  # one limit for every row instead of the limits by kind below

    @classmethod
    def for_run(cls, smoke: bool) -> "Settings":
        if not smoke:
            return cls()
        # CPU, tiny shapes; aot_eager instead of Inductor (a CPU Inductor compile takes tens of seconds)
        return cls(smoke=True, config="small", device="cpu", batches=2, epochs=2, compile_backend="aot_eager",
                   search={"progress": False, "stage1_budget": 1, "stage2_budget": 1, "repeats": 1, "warmup": 0,
                           "stage2_check_batches": 0})

    def estimate_s(self, task: Task | None) -> float:
        """A guess of a row's seconds (``None``: a worker's start), to decide what fits; not a measurement."""
        if self.smoke:
            return {None: 5.0, "eager": 1.0, "search": 3.0, "compile": 4.0, "padding": 8.0}[task and task.kind]
        if task is None:
            return 25.0  # Python, torch, the CUDA context, the FLOP count
        transformer = task.model in _TRANSFORMERS  # BERT-base and GPT-2 small: longer searches and compiles
        return {"eager": 15.0, "search": 180.0 if transformer else 60.0,
                "compile": 120.0 if transformer else 60.0, "padding": 60.0}[task.kind]

    def timeout_s(self, task: Task) -> float:
        """A row's own limit: past it the row is stopped and recorded as a timeout."""
        if self.row_limit_s is not None:
            return self.row_limit_s
        if self.smoke:  # CPU seconds on the smoke run's clock (a shared CI machine slows a row, not its clock)
            return 300.0
        return {"eager": 180.0, "search": 480.0, "compile": 360.0, "padding": 240.0}[task.kind]


#: The padding row: GPT-2's vocabulary (50,257, not a multiple of 8) under one plan, with and without padding.
PADDING_TASK = Task("gpt_vocab50257", "padding-fp16")


def suite_groups(models: Iterable[str], modes: Iterable[str], *, compiled: bool = True,
                 smoke: bool = False, padding: bool = False) -> list[list[Task]]:
    """Every model's eager group, (``padding``) the padding row's, then (``compiled``) every model's compiled
    group, in that order.

    ``smoke`` keeps the CI run short: one group of every eager row, the padding row and the first model's
    compiled FP32 and compfx rows (each worker's start costs seconds of imports on a small CPU).
    """
    models, modes = list(models), list(modes)
    eager = [[Task(model, mode) for mode in modes] for model in models] + ([[PADDING_TASK]] if padding else [])
    built = [[Task(model, mode, compiled=True) for mode in modes] for model in models] if compiled else []
    if smoke:  # one worker: every eager row, then the first model's compiled FP32 and compfx rows
        return [[task for group in eager + built[:1] for task in group
                 if not task.compiled or task.mode == "fp32" or task.mode.startswith("compfx")]]
    return eager + built


def needs_run(row: dict | None, *, retry_failed: bool = False) -> bool:
    """A row runs unless it is measured already; one stopped by a run's budget runs again, a failed one only
    when asked (it would most likely fail again).

    >>> needs_run(None), needs_run({"status": "ok"}), needs_run({"status": "timeout", "stopped_by": "budget"})
    (True, False, True)
    >>> needs_run({"status": "error"}), needs_run({"status": "error"}, retry_failed=True)
    (False, True)
    """
    if row is None:
        return True
    if row.get("status") == "ok":
        return False
    if row.get("status") == "timeout" and row.get("stopped_by") == "budget":
        return True
    return retry_failed


# -- the parent: groups of rows in time-boxed workers ------------------------------------------

def _read_events(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line the worker is still writing
            break
    return events


class _Watch:
    """Follows a worker's events file: records each row the moment it is written (a run stopped from outside
    keeps every row finished before), and knows which row is running since when."""

    def __init__(self, events_file: Path, record: Callable[[dict], None], clock: Callable[[], float] = time.time):
        self.events_file, self.record, self.clock = events_file, record, clock
        self.seen, self.finished, self.running = 0, set(), None  # running: (id, start on the clock) or None
        self.last = clock()  # the worker's launch, then its latest event (as seen here, within a poll)

    def poll(self) -> None:
        events = _read_events(self.events_file)
        for event in events[self.seen:]:
            self.last = self.clock()
            if event.get("event") == "start":
                self.running = (event["id"], self.last)
            elif event.get("event") == "row":
                self.finished.add(event["id"])
                self.running = None
                self.record(event["row"])
        self.seen = len(events)


def _run_worker(tasks: list[Task], plans: dict, settings: Settings, *, budget_end: float, workdir: Path,
                record: Callable[[dict], None], log: Callable[[str], None],
                clock: Callable[[], float] = time.time) -> list[Task]:
    """Run ``tasks`` in one worker until it ends or is stopped; record each finished row. Returns the tasks that
    did not start (the caller starts another worker for them)."""
    from .timebox import CpuClock, run_boxed, tail_of

    workdir.mkdir(parents=True, exist_ok=True)
    stem = f"{tasks[0].id.replace('/', '_').replace('+', '_')}-{time.time_ns()}"
    task_file, events_file, log_file = (workdir / f"{stem}.{ext}" for ext in ("tasks.json", "events.jsonl", "log"))
    task_file.write_text(json.dumps({"settings": asdict(settings),
                                     "tasks": [{**asdict(t), "plans": plans.get(t.id)} for t in tasks]}))
    launched = clock()
    limits = {task.id: settings.timeout_s(task) for task in tasks}
    watch = _Watch(events_file, record, clock)

    def deadline() -> float:
        watch.poll()
        if watch.running is None:  # starting up, or ending: a worker's start, generously
            return min(budget_end, watch.last + 4 * settings.estimate_s(None) + 60)
        row_id, started = watch.running
        return min(budget_end, started + limits[row_id])

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "COMPFX_CACHE_DIR": str(workdir / "compfx-cache")}  # starts empty in every suite run
    boxed = run_boxed([sys.executable, "-m", "benchmarks.gpu_bench", "--worker", str(task_file), str(events_file)],
                      log_path=log_file, deadline=deadline, env=env, cwd=ROOT, clock=clock)
    watch.poll()
    unfinished = [task for task in tasks if task.id not in watch.finished]
    if watch.running is None and not boxed.timed_out and boxed.returncode == 0:
        return unfinished
    if not unfinished:
        return []
    # the row that was running, or, if the worker died before its first row, the first one (so no loop spins)
    broken = next(task for task in unfinished if watch.running is None or task.id == watch.running[0])
    since = watch.running[1] if watch.running else launched
    if boxed.timed_out:
        stopped_by = "budget" if clock() >= budget_end - 1 else "row limit"
        unit = "CPU s" if isinstance(clock, CpuClock) else "s"
        status = {"status": "timeout", "stopped_by": stopped_by,
                  "error": f"stopped after {clock() - since:.3g} {unit} ({stopped_by}; a row may take "
                           f"{limits[broken.id]:.3g} {unit})"}
    else:
        status = {"status": "error", "error": f"the worker exited with code {boxed.returncode} during this row"}
    record({"id": broken.id, "model": broken.model, "mode_label": broken.mode, "compiled": broken.compiled,
            **status, "log_tail": tail_of(log_file, 3000)})
    log(f"  {broken.id}: {status['status']} ({status['error']})")
    return [task for task in unfinished if task is not broken]


def run_groups(groups: list[list[Task]], settings: Settings, *, rows: dict, budget_end: float, workdir: Path,
               record: Callable[[dict], None], retry_failed: bool = False,
               log: Callable[[str], None] = print, clock: Callable[[], float] = time.time) -> list[str]:
    """Measure every row of ``groups`` that :func:`needs_run`, group by group, while the budget lasts.

    ``rows`` holds the rows measured so far (by id, from earlier runs too); ``record(row)`` receives each new
    row as soon as it is measured. Returns the ids left for a later run, each with the reason. ``budget_end``
    and the rows' limits are read on ``clock`` (the smoke run's counts CPU seconds).
    """
    left = []
    for group in groups:
        pending = [task for task in group if needs_run(rows.get(task.id), retry_failed=retry_failed)]
        plans = {}
        for task in list(pending):
            if task.compiled and task.mode.startswith("compfx"):
                twin = rows.get(task.eager_twin) or {}
                if twin.get("status") == "ok" and twin.get("plans"):
                    plans[task.id] = twin["plans"]
                elif not any(other.id == task.eager_twin for other in pending):  # else the worker hands it on
                    pending.remove(task)
                    left.append(f"{task.id}: waits for the plan of {task.eager_twin}")
        fits, estimate = _fitting(pending, settings, budget_end, clock)
        left.extend(f"{task.id}: over this run's budget (estimate {settings.estimate_s(task):.0f} s)"
                    for task in pending[len(fits):])
        if not fits:
            continue
        log(f"bench: {', '.join(task.id for task in fits)} (estimate {estimate:.0f} s)")
        while fits and clock() < budget_end:
            fits = _run_worker(fits, plans, settings, budget_end=budget_end, workdir=workdir, record=record, log=log,
                               clock=clock)
        left.extend(f"{task.id}: over this run's budget" for task in fits)
    return left


def _fitting(pending: list[Task], settings: Settings, budget_end: float,
             clock: Callable[[], float] = time.time) -> tuple[list[Task], float]:
    """The longest head of ``pending`` whose estimate fits the time left (a group larger than a whole run
    still runs, a few rows per run), and that estimate."""
    estimate, fits = settings.estimate_s(None), []
    for task in pending:
        if clock() + estimate + settings.estimate_s(task) > budget_end:
            break
        estimate += settings.estimate_s(task)
        fits.append(task)
    return fits, estimate


# -- the worker: measures rows one after the other -----------------------------------------------

_flops_cache: dict[tuple[str, str, str], int | None] = {}


def _flops(spec, settings: Settings) -> int | None:
    from .flops import training_step_flops

    key = (spec.name, settings.config, settings.device)
    if key not in _flops_cache:
        try:
            _flops_cache[key] = training_step_flops(spec, spec.config(settings.config), settings.device)
        except Exception as error:  # the row is still worth having without its FLOPs
            print(f"FLOP count of {spec.name} failed: {type(error).__name__}: {error}", file=sys.stderr)
            _flops_cache[key] = None
        _release_memory()
    return _flops_cache[key]


def _release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _allocated_bytes(device: str) -> int | None:
    import torch

    return torch.cuda.memory_allocated() if device.startswith("cuda") and torch.cuda.is_available() else None


def measure_row(task: Task, settings: Settings, plans: dict | None = None) -> dict:
    """Measure one row (in this process); see the module docstring for what it measures."""
    import torch

    from .harness import RunOptions, run_benchmark
    from .models import get_spec

    mode, low_dtype = parse_mode(task.mode)
    if mode == "padding":
        return _padding_row(task, settings, low_dtype)
    spec = get_spec(task.model)
    config = spec.config(settings.config)
    flops = _flops(spec, settings)
    torch._dynamo.reset()
    allocated_before = _allocated_bytes(settings.device)
    options = RunOptions(device=settings.device, low_dtype=low_dtype, epochs=settings.epochs,
                         batches=settings.batches, data="synthetic", compile=task.compiled,
                         count_casts=settings.count_casts, search=settings.search,
                         compile_backend=settings.compile_backend, plans=plans or {})
    start = time.time()
    row = run_benchmark(spec, settings.config, mode, options)
    row.update(id=task.id, mode_label=task.mode, row_seconds=time.time() - start, batch_size=config["batch_size"],
               flops_per_step=flops, allocated_before_row_bytes=allocated_before)
    if row["status"] == "ok":
        step_s = row["time_per_epoch_s"] / row["batches_per_epoch"]
        row.update(step_s=step_s, steps_per_s=1.0 / step_s)
    if row.get("search_s") is not None and row.get("step_s"):
        data, examples = EPOCH_DATA.get(task.model, ("unknown", None))
        if examples:
            epoch_steps = math.ceil(examples / config["batch_size"])
            run_s = RUN_EPOCHS * epoch_steps * row["step_s"]
            row.update(epoch_data=data, epoch_examples=examples, epoch_steps=epoch_steps,
                       search_share_100_epochs=row["search_s"] / (row["search_s"] + run_s))
    torch._dynamo.reset()
    _release_memory()
    return row


def _padding_row(task: Task, settings: Settings, low_dtype: str) -> dict:
    """The padding row (:mod:`benchmarks.padding`): its step is the padded plan's; ``padding`` holds both."""
    from .padding import run

    start = time.time()
    result = run(smoke=settings.smoke, device=settings.device, low=low_dtype,
                 rounds=2 if settings.smoke else 5, steps=settings.batches)
    step_s = result["padded_median_ms"] / 1e3
    _release_memory()
    return {"id": task.id, "model": task.model, "mode_label": task.mode, "compiled": False, "status": "ok",
            "config": settings.config, "device": settings.device, "low_dtype": low_dtype,
            "batch_size": result["model"]["batch_size"], "step_s": step_s, "steps_per_s": 1.0 / step_s,
            "row_seconds": time.time() - start, "padding": result}


def worker_main(task_file: str, events_file: str) -> int:
    """Measure the rows in ``task_file``; append a ``start`` event before each and a ``row`` event after it."""
    spec = json.loads(Path(task_file).read_text())
    settings = Settings(**spec["settings"])

    def emit(event: dict) -> None:
        with open(events_file, "a") as handle:
            handle.write(json.dumps(event, default=str) + "\n")

    found: dict[str, dict] = {}  # plans searched in this worker, by row id, for the compiled rows that follow
    for item in spec["tasks"]:
        plans = item.pop("plans", None)
        task = Task(**item)
        emit({"event": "start", "id": task.id, "time": time.time()})
        print(f"== {task.id}", flush=True)
        try:
            if task.compiled and task.mode.startswith("compfx") and not plans:
                plans = found.get(task.eager_twin)
                if not plans:
                    raise RuntimeError(f"no plan for {task.id}: {task.eager_twin} found none")
            row = measure_row(task, settings, plans)
            if row.get("status") == "ok" and row.get("plans") and not task.compiled:
                found[task.id] = row["plans"]
        except Exception as error:  # run_benchmark reports a model's own failures; this is anything else
            traceback.print_exc()
            row = {"id": task.id, "model": task.model, "mode_label": task.mode, "compiled": task.compiled,
                   "status": "error", "error": f"{type(error).__name__}: {error}"[:500]}
        emit({"event": "row", "id": task.id, "row": row})
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench",
                                     description="the GPU suite's worker (run by benchmarks.gpu_suite)")
    parser.add_argument("--worker", nargs=2, metavar=("TASKS_JSON", "EVENTS_JSONL"), required=True)
    args = parser.parse_args(argv)
    return worker_main(*args.worker)


if __name__ == "__main__":
    sys.exit(main())
