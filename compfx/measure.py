"""How compfx times things, and what it records about the machine a time was taken on.

CUDA kernels run asynchronously, so a timer read without
``torch.cuda.synchronize`` measures only the launch. Every timing here
synchronises the device before starting and before stopping the clock.

Two ways to time, for two jobs:

* a training step (the search, the benchmarks): :func:`timed` once, or
  :func:`time_repeats` after warm-up, reporting the median, robust to the odd
  slow step (allocator growth, a background process) that a mean would absorb;
  several steps compared with each other: :func:`time_interleaved`, which lets
  them take turns, round after round, so that drift on a busy machine hits
  them alike and each round's timings can be compared pair by pair;
* one op or one cast in isolation (the cost model): :func:`time_fastest`,
  blocks of :func:`time_calls` reporting the minimum, the least disturbed
  sample, since other processes only ever add time.

Any of these reads one of :data:`CLOCKS`. A cached timing is only valid on the
machine it was taken on: :func:`device_name` and :func:`environment_key` say
which, and cache keys include them. It is also only valid under the
conditions it was taken in: a timing taken while other jobs loaded the machine
is too high for a later, quiet run (and the reverse). :func:`measure_conditions`
times a small reference kernel (:func:`reference_seconds`) next to each batch
of cached timings; :meth:`Conditions.differ` compares that record with the
reference timed now, and the cost model measures again when they disagree.

>>> seconds = time_fastest(lambda: sum(range(100)), device="cpu", repeats=2)
>>> seconds > 0, environment_key(device="cpu", clock="wall")["clock"]
(True, 'wall')
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence, TypeVar

import torch

from .errors import BadInputError

__all__ = ["synchronize", "timed", "Timing", "time_repeats", "time_interleaved", "interleaved_order", "median_interval", "PhaseClock", "CLOCKS", "check_clock", "time_calls",
           "time_fastest",
           "device_name", "hardware_name", "environment_key", "Conditions", "measure_conditions", "reference_seconds",
           "REFERENCE_TOLERANCE", "fp32_math", "describe_fp32_math", "long_lived_objects_frozen",
           "settle_host_allocator"]

T = TypeVar("T")


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued kernels on ``device`` (a no-op on CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
    elif device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.synchronize(device)
    elif device.type == "mps" and torch.backends.mps.is_available():
        torch.mps.synchronize()


def timed(fn: Callable[[], T], device: torch.device | str | None) -> tuple[T, float]:
    """Run ``fn()`` once; return its result and the synchronised wall seconds it took.

    >>> result, seconds = timed(lambda: sum(range(10)), "cpu")
    >>> result, seconds >= 0
    (45, True)
    """
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one step, in seconds."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def time_repeats(step: Callable[[int], T], *, warmup: int, repeats: int,
                 device: torch.device | str | None, after: Callable[[T], object] | None = None) -> Timing:
    """Call ``step(i)`` ``warmup`` times untimed, then ``repeats`` times timed (:func:`time_interleaved` of one step).

    Warm-up absorbs one-off costs (allocator growth, kernel selection, lazy
    optimizer state) that a steady training run does not pay. ``after(result)``
    runs untimed after every call (e.g. a check of the step's gradients that a
    training loop would not make).

    >>> time_repeats(lambda i: None, warmup=1, repeats=3, device="cpu").median >= 0
    True
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; expected at least 1 timed repeat")
    [seconds] = time_interleaved([step], rounds=repeats, warmup=warmup, device=device,
                                 after=None if after is None else lambda j, result: after(result))
    return Timing(tuple(seconds))


def interleaved_order(count: int, round_index: int) -> list[int]:
    """Which of ``count`` steps runs when in round ``round_index``: rotated each round (for two: AB, BA, AB, ...).

    >>> [interleaved_order(2, r) for r in range(3)], interleaved_order(3, 1)
    ([[0, 1], [1, 0], [0, 1]], [1, 2, 0])
    """
    shift = round_index % count
    return [(i + shift) % count for i in range(count)]


def time_interleaved(steps: Sequence[Callable[[int], T]], *, rounds: int, warmup: int,
                     device: torch.device | str | None, before: Callable[[int], object] | None = None,
                     after: Callable[[int, T], object] | None = None) -> list[list[float]]:
    """Seconds of ``steps[j](i)`` in each round ``i``: the steps take turns, the order rotating every round.

    Each step is called ``warmup`` times untimed first (on rounds ``0..warmup-1``'s
    inputs), so every one is warm when timing starts. In round ``i`` every step
    runs once, on the same ``i`` (the same batch), in the order
    ``i mod n, i+1 mod n, ...`` (for two steps: AB, BA, AB, ...): a step that
    always ran second would pay, or gain, whatever its predecessor leaves behind
    (caches, allocator state). ``before(j)`` runs untimed before each call of
    ``steps[j]`` (e.g. switching a plan in), and ``after(j, result)`` untimed
    after it (e.g. checking what it computed). Returns one list of ``rounds``
    seconds per step.

    >>> times = time_interleaved([lambda i: None, lambda i: sum(range(100))], rounds=3, warmup=1, device="cpu")
    >>> [len(row) for row in times]
    [3, 3]
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds}, warmup={warmup}; expected at least one round and warmup >= 0")
    def call(j: int, i: int, timing: bool) -> float:
        if before is not None:
            before(j)
        result, seconds = timed(lambda: steps[j](i), device) if timing else (steps[j](i), 0.0)
        if after is not None:
            after(j, result)
        return seconds

    count = len(steps)
    for i in range(warmup):
        for j in range(count):
            call(j, i, timing=False)
    seconds: list[list[float]] = [[] for _ in steps]
    for i in range(rounds):
        for j in interleaved_order(count, i):
            seconds[j].append(call(j, warmup + i, timing=True))
    return seconds


def _binomial_tail(n: int, k: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def median_interval(values: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """A distribution-free interval of the median of ``values``: ``(low, high, coverage)``.

    The narrowest pair of order statistics ``x(k) <= median <= x(n-k+1)``
    whose coverage ``1 - 2 P(Binomial(n, 1/2) < k)`` is at least
    ``confidence``. With too few values for that, the full range and its
    (lower) coverage.

    >>> median_interval([3, 1, 2, 5, 4, 7, 6], 0.95)
    (1, 7, 0.984375)
    >>> low, high, coverage = median_interval(range(1, 22), 0.95)
    >>> low, high, round(coverage, 3)
    (6, 16, 0.973)
    """
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise BadInputError("median_interval() needs at least one value")
    k = 1
    while k < (n + 1) // 2 and 1 - 2 * _binomial_tail(n, k) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], 1 - 2 * _binomial_tail(n, k - 1)


@contextlib.contextmanager
def long_lived_objects_frozen():
    """The objects the process holds now left out of garbage collection until the block ends (``gc.freeze``).

    A search makes FX graphs and FakeTensors by the hundred thousand, enough
    to set off full collections, and a full collection walks every object the
    process holds: with transformers imported, 400,000 objects and about 0.2 s
    on a 2-core EPYC, a fifth of a tiny GPT-2's first search. One that lands in
    a timed step distorts it too. Frozen, a collection walks the block's own
    objects only. Everything frozen is unfrozen afterwards, whatever happens:
    objects a process froze itself before the block are given back to the
    collector with the rest (``gc.get_freeze_count`` cannot tell them from
    those Python 3.12 keeps there).

    >>> import gc
    >>> before = gc.get_freeze_count()
    >>> with long_lived_objects_frozen():
    ...     frozen = gc.get_freeze_count() > before
    >>> frozen, gc.get_freeze_count() <= before
    (True, True)
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


#: What :func:`settle_host_allocator` frees: just under glibc's cap on its dynamic mmap threshold on a 64-bit
#: host (DEFAULT_MMAP_THRESHOLD_MAX, 4 MiB x sizeof(long) = 32 MiB), so that freeing it raises the threshold.
HOST_SETTLING_BYTES = 31 * 2**20

_host_allocator_settled = False


def settle_host_allocator(device: torch.device | str | None) -> bool:
    """Before a CPU search under glibc: free one large buffer, so that the heap keeps the memory of freed tensors.

    glibc's malloc gives freed memory at the top of its heap back to the
    operating system once it exceeds a trim threshold. The threshold starts at
    128 KiB and grows (up to 64 MiB) only when the program frees a large
    buffer that malloc had mapped on its own. A model whose activations are a
    few MiB each frees nothing that large: after every step it may give its
    activations back and page them in again in the next. On a batch-128 CNN
    on a 2-core EPYC that was up to 3,000 page faults and 5 ms of a 14 ms FP32
    step, in some phases of a process and not in others, as the heap's layout
    had it; the search's timings, and the report's speed-ups, then depended on
    where in the process they were taken.

    Allocating and freeing one buffer of 31 MiB raises both thresholds by
    glibc's own rule, as freeing any such buffer does (a model with a larger
    activation raises them itself in its first step): the steps' timings
    hold, and training after the search runs under the same allocator as the
    search timed. The cost: up to 64 MiB of freed memory stays with the
    process instead of going back to the system. Once per process; only for
    the CPU and glibc (where ``MALLOC_TRIM_THRESHOLD_`` or ``mallopt`` fixed
    the thresholds, glibc keeps them, and this changes nothing). True when it
    did it now.

    >>> isinstance(settle_host_allocator("cpu"), bool), settle_host_allocator("meta")
    (True, False)
    """
    global _host_allocator_settled
    if _host_allocator_settled or torch.device(device or "cpu").type != "cpu":
        return False
    _host_allocator_settled = True  # asked once per process: the C library does not change
    if platform.libc_ver()[0] != "glibc":  # elsewhere libc_ver may scan the interpreter's binary
        return False
    buffer = torch.empty(HOST_SETTLING_BYTES, dtype=torch.uint8)  # mapped, never touched: no pages are faulted in
    del buffer
    return True


class PhaseClock:
    """Wall seconds spent in named phases of a long call, each second counted in exactly one phase.

    Phases nest: time inside an inner phase is the inner phase's, not its
    parent's, so the parts add up to the time measured (what a search's cost
    breakdown needs: a rewrite done while pricing a plan is a rewrite). Not
    synchronised: the work inside a phase synchronises the device where it times.

    >>> clock = PhaseClock()
    >>> with clock.phase("outer"):
    ...     with clock.phase("inner"):
    ...         pass
    >>> sorted(clock.seconds), all(s >= 0 for s in clock.seconds.values())
    (['inner', 'outer'], True)
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._open: list[list] = []  # [name, start, seconds spent in nested phases]

    def phase(self, name: str):
        """A context manager: the time inside it (less its nested phases) is added to ``seconds[name]``."""
        return _Phase(self, name)

    def add(self, name: str, seconds: float) -> None:
        """Move ``seconds`` measured elsewhere into ``name``, out of the phase that was open when they were spent."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def move(self, seconds: float, *, source: str, target: str) -> None:
        """Count ``seconds`` already counted in ``source`` in ``target`` instead (never below zero in ``source``)."""
        seconds = min(seconds, self.seconds.get(source, 0.0))
        self.seconds[source] = self.seconds.get(source, 0.0) - seconds
        self.add(target, seconds)


class _Phase:
    def __init__(self, clock: PhaseClock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        self.clock._open.append([self.name, time.perf_counter(), 0.0])
        return self

    def __exit__(self, *exc):
        name, start, nested = self.clock._open.pop()
        elapsed = time.perf_counter() - start
        self.clock.add(name, elapsed - nested)
        if self.clock._open:
            self.clock._open[-1][2] += elapsed
        return False


# -- one op in isolation ---------------------------------------------------------------

#: Clocks a timing can read. "cpu" (process CPU time) ignores time the process
#: spends preempted, which makes timings on a busy machine usable; it equals
#: wall time only for one CPU thread (torch.set_num_threads(1)).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def check_clock(clock: str, *, device: torch.device | str) -> Callable[[], float]:
    """The reader of ``clock`` (a name in :data:`CLOCKS`), refused when it cannot time work on ``device``.

    >>> check_clock("wall", device="cpu") is CLOCKS["wall"]
    True
    >>> check_clock("sundial", device="cpu")
    Traceback (most recent call last):
    ...
    compfx.errors.BadInputError: clock='sundial'; expected one of ['cpu', 'wall'].
    """
    if clock not in CLOCKS:
        raise BadInputError(f"clock={clock!r}; expected one of {sorted(CLOCKS)}.")
    device = torch.device(device)
    if clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise BadInputError(f"clock='cpu' measures one CPU thread; this run has device {device} and "
                            f"{torch.get_num_threads()} threads. Use clock='wall', or torch.set_num_threads(1) on CPU.")
    return CLOCKS[clock]


def time_calls(step: Callable[[], object], number: int = 1, *, device: torch.device | str,
               clock: str = "wall") -> float:
    """Mean seconds of ``number`` back-to-back calls of ``step()``, synchronising ``device`` on both sides.

    Not ``torch.utils.benchmark.Timer.timeit``: it runs hidden warm-up calls
    first, which triples the cost of timing an op that takes tens of milliseconds.

    >>> time_calls(lambda: None, 10, device="cpu") >= 0
    True
    """
    read_clock = check_clock(clock, device=device)
    if number < 1:
        raise BadInputError(f"number={number}; expected at least 1 call to time.")
    synchronize(device)
    start = read_clock()
    for _ in range(number):
        step()
    synchronize(device)
    return (read_clock() - start) / number


def time_fastest(step: Callable[[], object], *, device: torch.device | str, repeats: int = 3, warmup: int = 1,
                 block_s: float = 5e-4, budget_s: float = 5e-3, clock: str = "wall") -> float:
    """Seconds of one call of ``step()``: timed warm-up calls, then up to ``repeats`` timed blocks; the fastest wins.

    A block repeats the call until it lasts about ``block_s``, so calls far
    shorter than the clock's resolution still time well. A call slower than
    ``budget_s`` (low precision on a CPU) gets one more call after its warm-up:
    at that length, one-off setup is a small share of the first call, and more
    calls would cost more than the search they save. The minimum is the least
    disturbed sample: other processes only ever add time.

    >>> time_fastest(lambda: sum(range(100)), device="cpu", repeats=2, block_s=1e-4) > 0
    True
    """
    if repeats < 1 or warmup < 0:
        raise BadInputError(f"repeats={repeats}, warmup={warmup}; expected repeats >= 1 and warmup >= 0.")
    check_clock(clock, device=device)
    last = 0.0
    for _ in range(max(warmup, 1)):  # the first call pays one-off setup (kernel selection, allocation)
        last = time_calls(step, device=device, clock=clock)
    if last >= budget_s:
        return min(last, time_calls(step, device=device, clock=clock))
    number = max(1, int(block_s / max(last, 1e-9)))
    samples, spent = [], 0.0
    while len(samples) < repeats and (spent < budget_s or not samples):
        samples.append(time_calls(step, number, device=device, clock=clock))
        spent += samples[-1] * number
    return min(samples)


# -- what a timing was taken on --------------------------------------------------------

def device_name(device: torch.device | str) -> str:
    """Name of the hardware a timing was taken on: the GPU model, or the CPU model, architecture and thread count.

    CPU timings depend on the thread count, so it is part of the name.

    >>> device_name("cpu").startswith("cpu:")
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{hardware_name(device)}"
    return f"cpu:{hardware_name(device)}:{platform.machine()}:threads={torch.get_num_threads()}"


def hardware_name(device: torch.device | str) -> str:
    """The GPU's name, or the CPU's model (from /proc/cpuinfo, else ``platform``): for reports and folder names.

    >>> isinstance(hardware_name("cpu"), str)
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_model()


def environment_key(*, device: torch.device | str, clock: str) -> dict:
    """What makes a cached timing stale besides what was timed: the clock, the device and the torch version.

    >>> sorted(environment_key(device="cpu", clock="wall"))
    ['clock', 'device', 'torch']
    """
    return {"clock": clock, "device": device_name(device), "torch": torch.__version__}


# -- what "FP32" computes in ------------------------------------------------------------------

#: Where each op family's FP32 precision setting lives, innermost first (PyTorch 2.9+): a setting of "none"
#: defers to the next. cuBLAS matmuls, cuDNN convolutions, and oneDNN's on a CPU.
_FP32_SETTINGS = {
    "cuda": {"matmul": ("cuda.matmul",), "convolution": ("cudnn.conv", "cudnn")},
    "cpu": {"matmul": ("mkldnn.matmul", "mkldnn"), "convolution": ("mkldnn.conv", "mkldnn")},
}


def _backend(path: str):
    module = torch.backends
    for part in path.split("."):
        module = getattr(module, part)
    return module


def fp32_math(device: torch.device | str) -> dict[str, str]:
    """What FP32 matmuls and convolutions compute in on ``device`` now: ``"ieee"`` (true FP32), ``"tf32"``, ``"bf16"``.

    Read from PyTorch's settings (``torch.backends.cuda.matmul.fp32_precision``,
    ``torch.backends.cudnn.conv.fp32_precision``, oneDNN's on a CPU), never set:
    compfx runs FP32 ops as the user's settings say. PyTorch's defaults on CUDA
    are IEEE matmuls and **TF32 convolutions**, so an "FP32" baseline with
    convolutions is not true FP32 unless the user says so.

    >>> fp32_math("cpu")
    {'matmul': 'ieee', 'convolution': 'ieee'}
    """
    device = torch.device(device)
    found = {}
    for family, paths in _FP32_SETTINGS.get(device.type, {}).items():
        values = [getattr(_backend(path), "fp32_precision", "none") for path in paths]
        values.append(getattr(torch.backends, "fp32_precision", "none"))
        found[family] = next((value for value in values if value != "none"), "ieee")
    return found


def describe_fp32_math(math_: Mapping[str, str]) -> str:
    """``fp32_math`` in words, for reports.

    >>> describe_fp32_math({"matmul": "ieee", "convolution": "tf32"})
    'FP32 matmuls in IEEE FP32, FP32 convolutions in TF32'
    """
    names = {"ieee": "IEEE FP32", "tf32": "TF32", "bf16": "bf16 (oneDNN)"}
    return ", ".join(f"FP32 {family}s in {names.get(value, value)}" for family, value in math_.items()) or "IEEE FP32"


# -- the conditions a timing was taken under ---------------------------------------------

#: Cached timings are measured again when the reference kernel, timed now, is more than this factor faster or
#: slower than when they were taken. Wide enough for the noise of a shared machine (the same kernel times
#: within about 1.3x of itself here), narrow enough for what load does: profiles cached on a loaded 2-core
#: machine were 10-35x too high, and their reference kernel with them.
REFERENCE_TOLERANCE = 2.0
#: Side of the square FP32 matrices of the reference kernel, ``relu(a @ b + c)``: a GEMM (compute) and two
#: pointwise ops (memory), as in the ops the cost model profiles; about 1 ms on one CPU thread.
REFERENCE_SIZE = 192


def reference_seconds(*, device: torch.device | str, clock: str = "wall", repeats: int = 7) -> float:
    """Seconds of the reference kernel (``relu(a @ b + c)``, FP32, :data:`REFERENCE_SIZE` square) on ``device``.

    Timed like the cost model's profiles (:func:`time_fastest`, same clock), so
    whatever inflates their timings -- other jobs, a throttled clock, fewer
    threads -- inflates it alike. Its inputs come from a private generator:
    the caller's RNG is untouched.

    >>> reference_seconds(device="cpu", repeats=1) > 0
    True
    """
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, generator=generator).to(device) for _ in range(3))

    def kernel():
        return torch.relu(torch.addmm(c, a, b))

    # the first calls in a process run about 1.5x slow (lazy initialisation, cold caches): not a condition
    time_calls(kernel, 8, device=device, clock=clock)
    return time_fastest(kernel, device=device, repeats=repeats, warmup=1, block_s=1e-3, budget_s=1e-2, clock=clock)


@dataclass(frozen=True)
class Conditions:
    """What the machine was like when timings were taken: the reference kernel's seconds, the load.

    ``reference_s`` decides (:meth:`differ`); ``load`` (the 1-minute load
    average per CPU, None where the OS has none) and ``taken_at`` (Unix time)
    are recorded to explain a decision.

    >>> quiet, busy = Conditions(1e-3, load=0.1), Conditions(2.5e-2, load=3.0)
    >>> quiet.differ(quiet) is None, busy.differ(quiet)
    (True, 'the reference kernel took 25x its time now when these timings were taken (load 3.00 per CPU then, 0.10 now)')
    """

    reference_s: float
    load: float | None = None
    taken_at: float = 0.0

    def differ(self, now: "Conditions", tolerance: float = REFERENCE_TOLERANCE) -> str | None:
        """Why timings taken under these conditions do not hold ``now`` (None: they hold)."""
        ratio = self.reference_s / now.reference_s
        if 1.0 / tolerance <= ratio <= tolerance:
            return None
        loads = ""
        if self.load is not None and now.load is not None:
            loads = f" (load {self.load:.2f} per CPU then, {now.load:.2f} now)"
        return f"the reference kernel took {ratio:.3g}x its time now when these timings were taken{loads}"

    def to_dict(self) -> dict:
        return {"reference_s": self.reference_s, "load": self.load, "taken_at": self.taken_at}

    @classmethod
    def from_dict(cls, data) -> "Conditions | None":
        """The conditions a cache entry recorded; None when it recorded none (or damaged ones)."""
        if not isinstance(data, Mapping):
            return None
        reference, load, taken_at = data.get("reference_s"), data.get("load"), data.get("taken_at", 0.0)
        if not _positive_finite(reference) or not (load is None or _finite(load)) or not _finite(taken_at):
            return None
        return cls(float(reference), None if load is None else float(load), float(taken_at))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_finite(value) -> bool:
    return _finite(value) and value > 0


def measure_conditions(*, device: torch.device | str, clock: str = "wall") -> Conditions:
    """The conditions now: the reference kernel timed on ``device`` with ``clock``, and the load average.

    >>> measure_conditions(device="cpu").reference_s > 0
    True
    """
    return Conditions(reference_seconds(device=device, clock=clock), _load_per_cpu(), time.time())


def _load_per_cpu() -> float | None:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):  # not on Windows
        return None


@functools.cache  # a process runs on one CPU model; /proc/cpuinfo was read for every profile entry's key
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
