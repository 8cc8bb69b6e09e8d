"""Train one benchmark model in one mode and measure it: the body of the runner.

A run is: build the model (seeded), load the batches onto the device, for
compfx search a plan with ``compfx.optimize`` (timed: search overhead) or take
the plan it is given, wrap in ``torch.compile`` if asked (compfx through
``compfx.compile_with_plan``, so the plan's casts go in before AOT autograd), one
measured step (saved-for-backward bytes, also the warm-up), then ``epochs`` timed
epochs, then evaluation. The result is one row (a dict) for the report.

>>> from benchmarks.models import get_spec
>>> row = run_benchmark(get_spec("gcn"), "small", "fp32", RunOptions(epochs=1, batches=1, count_casts=False))
>>> row["status"], row["saved_bytes"] > 0
('ok', True)
"""

from __future__ import annotations

import statistics
import sys
import traceback
from dataclasses import asdict, dataclass, field
from typing import Mapping

import torch
import torch.nn as nn

from compfx.measure import CLOCKS, settle_host_allocator, synchronize, timed
from compfx.vocabulary import default_low_dtype as _auto_low_dtype
from compfx.vocabulary import dtype_name

from .casts import count_forward_casts, count_graph_casts
from .memory import peak_memory_bytes, reset_peak_memory, saved_storages
from .models.spec import ModelSpec
from .modes import Precision, compfx_status, load_compfx, precision_for, search_config

__all__ = ["RunOptions", "run_benchmark", "load_batches", "evaluate", "resolve_device", "default_low_dtype",
           "options_dict"]

_EVAL_BATCHES = 4


@dataclass(frozen=True)
class RunOptions:
    device: str = "cpu"
    low_dtype: str = "auto"  # auto: fp16 on CUDA, bf16 on CPU (as compfx.analyze defaults)
    epochs: int = 1
    batches: int = 10  # batches per epoch (full-graph models: always one)
    data: str = "real"  # "real" for accuracy, "synthetic" for speed at the paper's shapes
    compile: bool = False
    seed: int = 0
    count_casts: bool = True
    search: Mapping = field(default_factory=dict)  # SearchConfig overrides, e.g. {"stage1_budget": 8}
    # "wall", or "cpu": process CPU time, which a shared machine's other jobs do not inflate; it is the
    # step's cost only on one CPU thread, so it needs device "cpu" and threads=1
    clock: str = "wall"
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    compile_backend: str = "inductor"  # torch.compile's backend; compfx rows: compile_with_plan's inner backend
    # compfx mode: a plan per searched network (Plan.to_dict(), e.g. a row's "plans") to run instead of searching
    plans: Mapping = field(default_factory=dict)

    def __post_init__(self):
        if self.data not in ("real", "synthetic"):
            raise ValueError(f"data={self.data!r}; expected 'real' or 'synthetic'")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock={self.clock!r}; expected one of {sorted(CLOCKS)}")
        if self.clock == "cpu" and (self.threads != 1 or resolve_device(self.device).type != "cpu"):
            raise ValueError("clock='cpu' times one CPU thread: use it with device 'cpu' and threads=1")
        if self.epochs < 1 or self.batches < 1:
            raise ValueError(f"epochs={self.epochs}, batches={self.batches}; both must be at least 1")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def default_low_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    named = {"fp16": torch.float16, "bf16": torch.bfloat16}
    if name != "auto":
        return named[name]
    return _auto_low_dtype(device)


def _to_device(batch, device: torch.device):
    return tuple(part.to(device) for part in batch)


def load_batches(spec: ModelSpec, config, options: RunOptions, split: str, device: torch.device) -> list:
    """Batches for one epoch (train) or for evaluation, already on ``device``."""
    count = options.batches if split == "train" else _EVAL_BATCHES
    if options.data == "synthetic":
        generator = torch.Generator().manual_seed(options.seed + (split == "eval"))
        count = 1 if spec.full_batch else count
        batches = [spec.example_batch(config, config["batch_size"], generator) for _ in range(count)]
    else:
        batches = spec.real_batches(config, config["batch_size"], count, split, options.seed)
    return [_to_device(batch, device) for batch in batches]


def evaluate(spec: ModelSpec, model: nn.Module, batches: list) -> float:
    """Mean metric over eval batches, in FP32 and eval mode, on the weights the mode trained.

    Every mode's networks share the model's Parameters, so scoring the eager
    FP32 model compares what training achieved, not inference precision.
    """
    was_training = model.training
    model.eval()
    with torch.no_grad():
        scores = [spec.metric(spec.evaluate_forward(model, batch), batch) for batch in batches]
    model.train(was_training)
    return statistics.fmean(scores)


def _run_epoch(spec, nets, optimizers, batches, precision: Precision, device, clock: str) -> tuple[float, float]:
    read_clock = CLOCKS[clock]
    synchronize(device)
    start = read_clock()
    losses = [spec.train_step(spec, nets, optimizers, batch, precision) for batch in batches]
    synchronize(device)
    seconds = read_clock() - start
    return seconds, float(torch.stack(losses).float().mean())  # one device sync per epoch, not per step


def _search(spec, nets, optimizers, batches, device, low_dtype, overrides: Mapping,
            clock: str = "wall") -> tuple[float, dict, dict]:
    """Run compfx.optimize on each search target; swap the searched networks in.

    Returns (seconds, the chosen Plan per network, search figures per network).
    """
    optimize, config_class = load_compfx()
    config = search_config(config_class, **{"progress": False, **overrides})
    plans, figures = {}, {}
    read_clock = CLOCKS[clock]
    synchronize(device)
    start = read_clock()
    for target in spec.search_targets(spec, nets, optimizers, batches):  # the nets are on ``device`` already
        result = optimize(nets[target.net], target.batches, loss_fn=target.loss_fn,
                          optimizer=optimizers[target.optimizer], low_dtype=low_dtype, config=config)
        nets[target.net] = result.module
        plans[target.net] = result.plan
        figures[target.net] = _search_figures(result)
    synchronize(device)
    return read_clock() - start, plans, figures


def _given_plans(spec, nets, optimizers, batches, plans: Mapping) -> dict:
    """Apply the given plans (``Plan.to_dict()`` per network) instead of searching; the Plans by network."""
    import compfx

    applied = {}
    for target in spec.search_targets(spec, nets, optimizers, batches):
        if target.net not in plans:
            raise KeyError(f"no plan given for network {target.net!r}; plans are given for {sorted(plans)}")
        plan = compfx.Plan.from_dict(plans[target.net], source=f"the plan given for {target.net!r}")
        inputs = tuple(target.batches[0][:-1])
        nets[target.net] = compfx.apply(nets[target.net], plan, inputs)
        applied[target.net] = plan
    return applied


def _compiled(nets: dict, originals: dict, plans: Mapping, backend: str) -> dict:
    """Every network under ``torch.compile``; a planned one through ``compfx.compile_with_plan`` on the original
    module, so its casts go in before AOT autograd and Inductor keeps them."""
    from compfx.backend import compile_with_plan

    return {name: compile_with_plan(originals[name], plans[name], inner=backend) if name in plans
            else torch.compile(net, backend=backend) for name, net in nets.items()}


def _backend_records(nets: dict) -> dict:
    """What compfx's compile backend did (graphs compiled, ops its plan did not name); {} without that backend."""
    records = [record for net in nets.values() for record in getattr(getattr(net, "compfx_backend", None),
                                                                        "records", ())]
    if not records:
        return {}
    return {"compiled_graphs": len(records), "compiled_unplanned_ops": sum(len(r.unplanned) for r in records)}


def _search_figures(result) -> dict:
    """What the search cost (in FP32 epochs of its loader) and how well the cost model predicted what it measured."""
    from compfx.report import predicted_records, prediction_error

    return {"search_fp32_epochs": result.search_seconds / result.fp32_epoch_seconds,
            "predictor_error_pct": prediction_error(result.log),
            "predictor_candidates": len(predicted_records(result.log))}


def _plan_summary(plan) -> dict:
    """How many ops the plan runs at each precision, e.g. ``{"low": 3, "fp32": 1, "follow": 4}``."""
    counts = {"low": 0, "fp32": 0, "follow": 0}
    for precision in plan.values():
        counts[str(precision)] += 1  # plain text keys: the row is written as JSON
    return counts


def _cast_counts(spec, nets, batch, precision: Precision, mode: str) -> dict:
    counts = {"casts_forward": sum(count_forward_casts(module, inputs, precision.autocast)
                                   for module, inputs in spec.cast_forwards(nets, batch))}
    if mode == "compfx":
        per_net = [count_graph_casts(module) for module in nets.values()]
        counts["casts_graph"] = sum(count for count, _ in per_net)
        counts["casts_graph_counter"] = per_net[0][1] if per_net else None
    return counts


def _measured_step(spec, nets, optimizers, batch, precision, model, device) -> dict:
    """One training step with saved-tensor hooks on (also the warm-up step before timing, and the step that
    compiles under ``torch.compile``: its seconds are ``first_step_s``)."""
    owned = [*model.parameters(), *model.buffers()]
    with saved_storages(owned) as saved:
        _, seconds = timed(lambda: spec.train_step(spec, nets, optimizers, batch, precision), device)
    return {"saved_bytes": saved.total_bytes, "saved_parameter_bytes": saved.resident_bytes,
            "saved_activation_bytes": saved.activation_bytes, "first_step_s": seconds}


def _train_and_measure(spec, config_name, mode, options, device, low_dtype) -> dict:
    config = spec.config(config_name)
    torch.manual_seed(options.seed)
    model = spec.build(config).to(device)
    nets, optimizers = spec.make_nets(model), spec.make_optimizers(model, config)
    train, held_out = (load_batches(spec, config, options, split, device) for split in ("train", "eval"))
    precision = precision_for(mode, device, low_dtype)
    row: dict = {"batches_per_epoch": len(train)}
    search_seconds, originals, plans = 0.0, dict(nets), {}
    if mode == "compfx" and options.plans:
        plans = _given_plans(spec, nets, optimizers, train, options.plans)
    elif mode == "compfx":
        search_seconds, plans, row["search"] = _search(spec, nets, optimizers, train, device, low_dtype,
                                                       options.search, options.clock)
    if plans:
        row["plan"] = {net: _plan_summary(plan) for net, plan in plans.items()}
        row["plans"] = {net: plan.to_dict() for net, plan in plans.items()}
    if options.count_casts:
        row.update(_cast_counts(spec, nets, train[0], precision, mode))
    if options.compile:
        nets = _compiled(nets, originals, plans, options.compile_backend)
    row.update(_measured_step(spec, nets, optimizers, train[0], precision, model, device))
    row.update(_backend_records(nets))
    reset_peak_memory(device)
    epochs = [_run_epoch(spec, nets, optimizers, train, precision, device, options.clock)
              for _ in range(options.epochs)]
    epoch_seconds = [seconds for seconds, _ in epochs]
    # The first epoch can still include compilation and allocator warm-up; report the median of the rest.
    steady = epoch_seconds[1:] or epoch_seconds
    training_seconds = sum(epoch_seconds)
    row.update(
        epoch_seconds=epoch_seconds, time_per_epoch_s=statistics.median(steady),
        final_train_loss=epochs[-1][1], peak_memory_bytes=peak_memory_bytes(device),
        metric_name=spec.metric_name, metric=evaluate(spec, model, held_out),
    )
    if "search" in row:
        row.update(search_s=search_seconds, search_share=search_seconds / (search_seconds + training_seconds))
    return row


def run_benchmark(spec: ModelSpec, config_name: str, mode: str, options: RunOptions) -> dict:
    """Train ``spec`` at ``config_name`` in ``mode``; a row of measurements (never raises for a model).

    The host allocator is settled before the first mode trains (:func:`compfx.measure.settle_host_allocator`),
    as compfx's search settles it: every mode of the process then trains under the same allocator.
    """
    device = resolve_device(options.device)
    settle_host_allocator(device)
    low_dtype = default_low_dtype(device, options.low_dtype)
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    row = {"model": spec.name, "config": config_name, "mode": mode, "compiled": options.compile,
           "data": options.data if options.data == "synthetic" else f"real: {spec.real_data}",
           "device": str(device), "low_dtype": dtype_name(low_dtype), "epochs": options.epochs}
    if mode == "compfx":
        status = compfx_status()
        if status != "available":
            return {**row, "status": status}
    try:
        row.update(_train_and_measure(spec, config_name, mode, options, device, low_dtype))
    except Exception as error:  # one failing model must not lose the others' rows
        traceback.print_exc(file=sys.stderr)
        return {**row, "status": "error", "error": f"{type(error).__name__}: {error}"[:500]}
    return {**row, "status": "ok"}


def options_dict(options: RunOptions) -> dict:
    return asdict(options)
