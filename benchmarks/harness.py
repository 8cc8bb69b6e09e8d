"""Train one benchmark model in the modes asked for, the modes taking turns, and measure them: the runner's body.

Each mode is first prepared, one after the other (:func:`prepare_mode`): build the model (seeded), load the
batches onto the device, for compfx search a plan with ``compfx.optimize`` (timed: search overhead) or take the
plan it is given, count casts, wrap in ``torch.compile`` if asked (compfx through ``compfx.compile_with_plan``, so
the plan's casts go in before AOT autograd), one measured step (saved-for-backward bytes, also the warm-up).

Then the modes take turns (:func:`train_in_turns`): for each of ``epochs`` epochs and each batch, every prepared
mode runs one training step on that batch, timed on its own, the order rotating each batch. Trained one after
the other, the modes would meet the machine at different times (compfx's epoch always last, after its search),
and drift of a shared machine between them would read as a difference between the modes. Taking turns, drift
hits them alike, and the steps on one batch can be compared pair by pair: a row's ``time_vs_fp32`` is the median
of its per-batch ratios to FP32's step, with a 95% interval. Each mode keeps its own random state
(:class:`RandomState`), so it draws what it would draw trained alone (dropout). Last, each mode is evaluated and
its row (a dict) for the report is made (:func:`finish_row`).

>>> from benchmarks.models import get_spec
>>> options = RunOptions(epochs=1, batches=1, count_casts=False)
>>> fp32, amp = run_modes(get_spec("gcn"), "small", ["fp32", "amp"], options)
>>> fp32["status"], amp["status"], fp32["saved_bytes"] > 0, amp["modes_in_turns"]
('ok', 'ok', True, ['fp32', 'amp'])
>>> ratio = amp["time_vs_fp32"]
>>> ratio["low"] <= ratio["median"] <= ratio["high"]
True
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import traceback
from dataclasses import asdict, dataclass, field
from typing import Iterator, Mapping

import torch
import torch.nn as nn

from compfx.measure import CLOCKS, interleaved_order, median_interval, settle_host_allocator, synchronize, timed
from compfx.state import cuda_devices
from compfx.vocabulary import default_low_dtype as _auto_low_dtype
from compfx.vocabulary import dtype_name

from .casts import count_forward_casts, count_graph_casts
from .memory import allocated_bytes, peak_memory_bytes, reset_peak_memory, saved_storages
from .models.spec import ModelSpec
from .modes import Precision, compfx_status, load_compfx, precision_for, search_config

__all__ = ["RunOptions", "run_benchmark", "run_modes", "step_ratio_interval", "prepare_mode", "train_in_turns", "finish_row", "PreparedMode",
           "RandomState", "load_batches", "evaluate", "resolve_device", "default_low_dtype", "options_dict"]

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
    from compfx.compile_backend import compile_with_plan

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


# -- one mode's random generators ------------------------------------------------------------------
@dataclass
class RandomState:
    """One mode's torch generators: the CPU one, and the CUDA one of the device when it trains on CUDA.

    Modes taking turns share the process's generators; each keeps its own state here and swaps it in around its
    steps (:meth:`in_use`), so that it draws the same random numbers (dropout masks, a GAN's noise) as if it
    trained alone, and the modes stay comparable with runs of one mode.
    """

    device: torch.device
    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]

    @classmethod
    def current(cls, device: torch.device) -> "RandomState":
        """The generators' state now."""
        return cls(device, torch.get_rng_state(), {index: torch.cuda.get_rng_state(index)
                                                   for index in cuda_devices(device)})

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for index, state in self.cuda.items():
            torch.cuda.set_rng_state(state, index)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Draw from this state in the body, and keep where the body left it for the next time."""
        self.restore()
        try:
            yield
        finally:
            now = RandomState.current(self.device)
            self.cpu, self.cuda = now.cpu, now.cuda


# -- preparing a mode ---------------------------------------------------------------------------------
@dataclass
class PreparedMode:
    """A mode ready to train: its networks, optimizers and batches, what preparing it measured, and, once it
    has taken its turns, its step seconds and epoch losses."""

    mode: str
    row: dict  # what preparing measured: plan, casts, the measured step
    model: nn.Module
    nets: dict
    optimizers: dict
    precision: Precision
    train: list
    held_out: list
    random: RandomState  # as a run of this mode alone has it when its epochs begin
    search_seconds: float = 0.0
    resident_bytes: int | None = None  # what the mode keeps on the GPU between its steps (None off GPU)
    step_seconds: list[list[float]] = field(default_factory=list)  # per epoch, per batch
    epoch_losses: list[float] = field(default_factory=list)
    step_losses: list[torch.Tensor] = field(default_factory=list)  # of the epoch under way
    step_peak_bytes: int = 0  # the most any step allocated above what was allocated when it began
    error: str | None = None  # why it stopped taking turns

    def fail(self, error: Exception) -> None:
        traceback.print_exception(error, file=sys.stderr)
        self.error = _error_text(error)


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def _held_bytes(device: torch.device) -> int | None:
    """Bytes allocated on a GPU by live objects only (unreachable cycles collected first); None off GPU."""
    if device.type != "cuda":
        return None
    gc.collect()
    return allocated_bytes(device)


def prepare_mode(spec: ModelSpec, config_name: str, mode: str, options: RunOptions, device: torch.device,
                 low_dtype: torch.dtype) -> PreparedMode:
    """Build, search or apply plans, count casts, compile if asked, and take the measured step (the warm-up)."""
    held_before = _held_bytes(device)
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
    held_after = _held_bytes(device)
    return PreparedMode(mode, row, model, nets, optimizers, precision, train, held_out,
                        RandomState.current(device), search_seconds,
                        None if held_before is None else held_after - held_before)


# -- the modes taking turns -----------------------------------------------------------------------------
def _timed_step(spec: ModelSpec, prepared: PreparedMode, batch, device: torch.device, read_clock) -> float:
    """One training step of ``prepared`` on ``batch``, synchronised before and after; its seconds."""
    reset_peak_memory(device)
    start_bytes = allocated_bytes(device)
    synchronize(device)
    start = read_clock()
    loss = spec.train_step(spec, prepared.nets, prepared.optimizers, batch, prepared.precision)
    synchronize(device)
    seconds = read_clock() - start
    if start_bytes is not None:
        prepared.step_peak_bytes = max(prepared.step_peak_bytes, peak_memory_bytes(device) - start_bytes)
    prepared.step_losses.append(loss)  # read once per epoch: no extra device sync per step
    return seconds


def _take_turn(spec: ModelSpec, prepared: PreparedMode, batch_index: int, device: torch.device,
               read_clock) -> None:
    """``prepared``'s step on its batch ``batch_index``, drawing from its own random state; a failure ends its
    turns (its row says why) and the other modes go on."""
    try:
        with prepared.random.in_use():
            seconds = _timed_step(spec, prepared, prepared.train[batch_index], device, read_clock)
    except Exception as error:  # one failing mode must not lose the others' rows
        prepared.fail(error)
        return
    prepared.step_seconds[-1].append(seconds)


def _end_epoch(prepared: PreparedMode) -> None:
    losses, prepared.step_losses = prepared.step_losses, []
    prepared.epoch_losses.append(float(torch.stack(losses).float().mean()))


def train_in_turns(spec: ModelSpec, modes: list[PreparedMode], epochs: int, device: torch.device,
                   clock: str = "wall") -> None:
    """Train ``modes`` for ``epochs`` epochs taking turns: per batch, one step of each, in rotating order.

    In turn ``t`` (counted over every batch of every epoch) the modes still training run in the order
    :func:`compfx.measure.interleaved_order` gives (``t mod n, t+1 mod n, ...``), so none always comes first and
    pays, or gains, what the step before it leaves behind (caches, allocator state). Each step is timed on its
    own with ``CLOCKS[clock]``; the results go into each mode's ``step_seconds`` and ``epoch_losses``.
    """
    read_clock = CLOCKS[clock]
    batches = len(modes[0].train) if modes else 0  # the same spec, config and options: the same batch count
    turn = 0
    for _ in range(epochs):
        for prepared in modes:
            prepared.step_seconds.append([])
        for batch_index in range(batches):
            training = [prepared for prepared in modes if prepared.error is None]
            for position in interleaved_order(len(training), turn) if training else ():
                _take_turn(spec, training[position], batch_index, device, read_clock)
            turn += 1
        for prepared in modes:
            if prepared.error is None:
                _end_epoch(prepared)


# -- each mode's row ----------------------------------------------------------------------------------
def _steady(per_epoch: list) -> list:
    """The epochs after the first (it can still include compilation and allocator warm-up), or the only one."""
    return per_epoch[1:] or per_epoch


def step_ratio_interval(steps: list[list[float]], other_steps: list[list[float]]) -> dict:
    """Median and 95% interval (:func:`compfx.measure.median_interval`) of the per-batch ratios of ``steps`` to
    ``other_steps`` (another mode's, FP32's for ``time_vs_fp32``) on the same batch of the same epoch, over the
    steady epochs.

    >>> step_ratio_interval([[1.0, 1.1, 0.9]], [[2.0, 2.0, 2.0]])["median"]  # one epoch: it is the steady one
    0.5
    """
    ratios = [mine / theirs for epoch, other_epoch in zip(_steady(steps), _steady(other_steps))
              for mine, theirs in zip(epoch, other_epoch)]
    low, high, coverage = median_interval(ratios, 0.95)
    return {"median": statistics.median(ratios), "low": low, "high": high, "coverage": coverage,
            "pairs": len(ratios)}


def _peak_memory(prepared: PreparedMode) -> int | None:
    """A mode's GPU peak as if it trained alone: what it keeps on the GPU plus the most its steps allocated on
    top; the device-wide peak would also hold the other modes' tensors."""
    if prepared.resident_bytes is None:
        return None
    return prepared.resident_bytes + prepared.step_peak_bytes


def finish_row(spec: ModelSpec, prepared: PreparedMode, fp32_steps: list[list[float]] | None) -> dict:
    """The measurements of a mode that took its turns: epoch and step times, their spread (against FP32's steps
    where FP32 trained too), the last epoch's loss, peak memory, the metric, the search's share."""
    row = dict(prepared.row)
    epoch_seconds = [sum(steps) for steps in prepared.step_seconds]
    steady_steps = [seconds for steps in _steady(prepared.step_seconds) for seconds in steps]
    with prepared.random.in_use():  # evaluated where a run of this mode alone would be
        metric = evaluate(spec, prepared.model, prepared.held_out)
    row.update(
        epoch_seconds=epoch_seconds, time_per_epoch_s=statistics.median(_steady(epoch_seconds)),
        step_seconds=prepared.step_seconds, step_median_s=statistics.median(steady_steps),
        final_train_loss=prepared.epoch_losses[-1], peak_memory_bytes=_peak_memory(prepared),
        metric_name=spec.metric_name, metric=metric,
    )
    if fp32_steps is not None and prepared.mode != "fp32":
        row["time_vs_fp32"] = step_ratio_interval(prepared.step_seconds, fp32_steps)
    if "search" in row:
        search_seconds = prepared.search_seconds
        row.update(search_s=search_seconds, search_share=search_seconds / (search_seconds + sum(epoch_seconds)))
    return row


# -- the runner's entry points ------------------------------------------------------------------------
def _row_identity(spec: ModelSpec, config_name: str, mode: str, options: RunOptions, device: torch.device,
                  low_dtype: torch.dtype) -> dict:
    return {"model": spec.name, "config": config_name, "mode": mode, "compiled": options.compile,
            "data": options.data if options.data == "synthetic" else f"real: {spec.real_data}",
            "device": str(device), "low_dtype": dtype_name(low_dtype), "epochs": options.epochs}


def _error_row(identity: dict, error: str) -> dict:
    return {**identity, "status": "error", "error": error}


def run_modes(spec: ModelSpec, config_name: str, modes: list[str], options: RunOptions) -> list[dict]:
    """Train ``spec`` at ``config_name`` in each of ``modes``, taking turns; one row per mode, in that order.

    Never raises for a model: a mode that fails (while prepared, training or evaluated) gets an error row and
    the others go on. The host allocator is settled first (:func:`compfx.measure.settle_host_allocator`), as
    compfx's search settles it: every mode then trains under the same allocator.
    """
    device = resolve_device(options.device)
    settle_host_allocator(device)
    low_dtype = default_low_dtype(device, options.low_dtype)
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    identities = [_row_identity(spec, config_name, mode, options, device, low_dtype) for mode in modes]
    rows: list[dict | None] = [None] * len(modes)
    prepared: dict[int, PreparedMode] = {}
    for index, mode in enumerate(modes):
        status = compfx_status() if mode == "compfx" else "available"
        if status != "available":
            rows[index] = {**identities[index], "status": status}
            continue
        try:
            prepared[index] = prepare_mode(spec, config_name, mode, options, device, low_dtype)
        except Exception as error:  # one failing mode must not lose the others' rows
            traceback.print_exception(error, file=sys.stderr)
            rows[index] = _error_row(identities[index], _error_text(error))
    train_in_turns(spec, list(prepared.values()), options.epochs, device, options.clock)
    trained = {index: each for index, each in prepared.items() if each.error is None}
    fp32_steps = next((each.step_seconds for each in trained.values() if each.mode == "fp32"), None)
    in_turns = [each.mode for each in prepared.values()]
    for index, each in prepared.items():
        rows[index] = _finished_row(spec, each, fp32_steps, identities[index], in_turns)
    return rows


def _finished_row(spec: ModelSpec, prepared: PreparedMode, fp32_steps, identity: dict, in_turns: list) -> dict:
    if prepared.error is not None:
        return _error_row(identity, prepared.error)
    try:
        row = finish_row(spec, prepared, fp32_steps)
    except Exception as error:  # one failing mode must not lose the others' rows
        traceback.print_exception(error, file=sys.stderr)
        return _error_row(identity, _error_text(error))
    return {**identity, **row, "modes_in_turns": in_turns, "status": "ok"}


def run_benchmark(spec: ModelSpec, config_name: str, mode: str, options: RunOptions) -> dict:
    """Train ``spec`` at ``config_name`` in ``mode`` alone (:func:`run_modes` with one mode); its row."""
    return run_modes(spec, config_name, [mode], options)[0]

def options_dict(options: RunOptions) -> dict:
    return asdict(options)
