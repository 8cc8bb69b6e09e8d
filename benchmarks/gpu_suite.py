"""One command for a GPU: the environment, the CUDA tests and the paper-scale benchmarks, as JSON and markdown.

::

    python -m benchmarks.gpu_suite [--smoke] [--out ROOT] [--budget-min 8.5]
                                   [--parts env,cuda-tests,fp8-compiled,bench,fp8]
                                   [--merge-from ROOT] [--models ...] [--modes ...] [--no-compile] [--no-padding]
                                   [--retry-failed]

Parts, in this order, each time-boxed in its own subprocess (:mod:`benchmarks.timebox`), so a hung kernel or a
slow compile cannot eat the rest:

1. ``env`` (always runs: it names the device folder and gives the roofline): GPU name, capability, memory,
   torch / CUDA / cuDNN / driver versions, and bf16, fp16 and FP32 matmul TFLOP/s (:mod:`benchmarks.gpu_env`).
2. ``cuda-tests``: ``pytest -m cuda tests`` (``tests/test_cuda.py``: ``Plan.amp`` against CUDA autocast, Tensor
   Core eligibility on the real capability, fp16 sampling with a GradScaler, ``backend="compfx"`` with Inductor,
   a world-size-1 NCCL DDP search, the CUDA RNG left alone); pass / fail counts and the failures.
3. ``fp8-compiled``: the program people train, compiled: bf16 AMP, torchao float8 on every linear and with its
   auto filter, and compfx's plans searched eagerly and searched compiled (``SearchConfig(compile=...)``), all
   under ``torch.compile`` and taking turns on the same batches (:mod:`benchmarks.fp8_compiled`, a decoder of
   width 4096, one block, on a GPU), in what is left of the budget (at most 7 minutes). It runs before the bench rows, which
   a later run can resume; like ``fp8`` it needs torchao and is skipped without it.
4. ``bench``: VGG16-CIFAR, AlexNet-CIFAR, a ResNet-18, BERT-base and a GPT-2-small-shaped decoder in FP32, AMP
   fp16 + GradScaler, AMP bf16 and compfx (searched), eager and under ``torch.compile``: steps/s, peak memory,
   MFU against the probe, the search's cost and share of a 100-epoch run, the plan's casts
   (:mod:`benchmarks.gpu_bench`). Rows are measured model by model, each group in one worker process, and only
   while the budget lasts; a later run with ``--merge-from`` measures the rows still missing. One more row
   (``--no-padding`` leaves it out) trains a GPT with GPT-2's vocabulary of 50,257 under one plan with and
   without Tensor Core shape padding, in turns (:mod:`benchmarks.padding`).
5. ``fp8``: bf16 AMP against torchao float8 (every linear) against compfx's searched FP8 / bf16 / FP32 plan on
   the GPT-shaped decoder (:mod:`benchmarks.fp8`), in what is left of the budget (at most 5 minutes). It needs
   torchao (``pip install compfx[fp8]``); without it the part is "skipped: torchao not installed", which does not
   fail the suite. Off a float8-capable GPU (capability 8.9+) the times are emulation and say so.

If the environment probe fails, the results file records it (``environment.status: failed``, why, the output
tail) under the device's ``nvidia-smi`` name, the other parts still run, and the suite exits 1.

Results go to ``ROOT/<gpu-slug>/`` (default ``benchmarks/results/<gpu-slug>/``): ``gpu-suite.json`` (every
number, every run's environment), ``gpu-suite.md`` and ``cuda-tests.txt``; ``--smoke`` writes
``gpu-suite-smoke.*``, by default under the temp directory. An existing ``gpu-suite.json`` there (or under ``--merge-from ROOT``) is merged:
rows already measured are kept, not run again. The output ends with one line per row.

``--smoke`` runs the same code on the CPU with tiny shapes (two models, ``aot_eager`` instead of Inductor) in
a minute or two; CI runs it (``tests/test_gpu_suite.py``). Its budget and limits count CPU seconds
(:class:`~benchmarks.timebox.CpuClock`), not wall seconds: on a machine loaded by other jobs it takes longer
but no limit comes nearer, so it fails only when a part fails or uses far more CPU than it should.

**On a GPU** (``RUN_COMMANDS`` in :mod:`benchmarks.gpu_report`, also in ``benchmarks/results/README.md``)::

    # from the repository root, on any machine with a CUDA GPU (compfx installed: pip install -e ".[fp8]")
    python -m benchmarks.gpu_suite

then ``python -m benchmarks.gpu_readme`` regenerates the README's GPU section from the results. ``--budget-min``
bounds a run's time; a later run with ``--merge-from`` measures what is left.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from compfx.files import write_json_atomic
from compfx.float8 import torchao_missing

from .gpu_bench import MODES, ROOT, SMOKE_MODELS, SUITE_MODELS, Settings, parse_mode, run_groups, suite_groups
from .gpu_report import FP8_COMPILED_NOTE, FP8_NOTE, markdown, row_line, summary_lines
from .flops import mfu_percent
from .models import MODELS
from .report import slug
from .timebox import CpuClock, run_boxed, tail_of

__all__ = ["PARTS", "parse_args", "main", "load_state", "run_environment", "run_cuda_tests", "run_fp8", "STEM",
           "succeeded"]

PARTS = ("env", "cuda-tests", "fp8-compiled", "bench", "fp8")
STEM = {False: "gpu-suite", True: "gpu-suite-smoke"}
_DEFAULT_ROOT = ROOT / "benchmarks" / "results"
_RESERVE_S = 15  # kept back from the budget for writing the results
#: each part's limit (smoke: CPU seconds on the run's CpuClock; on a GPU: wall seconds)
_ENV_TIMEOUT_S = {False: 180, True: 180}
_TESTS_TIMEOUT_S = {False: 300, True: 180}
_FP8_TIMEOUT_S = {False: 300, True: 180}
_FP8_COMPILED_TIMEOUT_S = {False: 420, True: 180}
#: The FP8 parts: state key -> (benchmark module, its JSON file name, its arguments off smoke, time limits)
_FP8_PARTS = {"fp8": ("benchmarks.fp8", "fp8.json", (), _FP8_TIMEOUT_S),
              "fp8-compiled": ("benchmarks.fp8_compiled", "fp8_compiled.json", ("--size", "wide1"),
                               _FP8_COMPILED_TIMEOUT_S)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, two models: the CI check")
    parser.add_argument("--out", help="results root; a folder per device is made inside (default: "
                                      "benchmarks/results; smoke: a folder in the temp directory)")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="minutes for this run (default 8.5; smoke: 10 minutes of CPU time)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--merge-from", help="results root of an earlier run, e.g. benchmarks/results: its "
                                             "<gpu-slug>/gpu-suite.json is merged when --out has none")
    parser.add_argument("--models", nargs="+", help=f"bench models (default: {' '.join(SUITE_MODELS)})")
    parser.add_argument("--modes", nargs="+", default=list(MODES), help=f"bench modes (default: {' '.join(MODES)})")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--no-padding", action="store_true", help="skip the shape-padding row")
    parser.add_argument("--retry-failed", action="store_true", help="run again rows that failed or hit their limit")
    parser.add_argument("--fresh", action="store_true", help="merge nothing: start a new result")
    parser.add_argument("--note", default="", help="free text kept with this run's results, e.g. what was "
                                                   "measured and why")
    args = parser.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    args.models = args.models or list(SMOKE_MODELS if args.smoke else SUITE_MODELS)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    for mode in args.modes:
        try:
            parse_mode(mode)
        except ValueError as error:
            parser.error(str(error))
    if args.out is None:  # a smoke result is never one to commit
        args.out = str(Path(tempfile.gettempdir()) / "compfx-gpu-suite-smoke" if args.smoke else _DEFAULT_ROOT)
    if args.budget_min is None:
        # smoke: about a CPU minute; its budget (in CPU seconds, so a loaded machine does not use it up) only
        # guards against a part that runs away
        args.budget_min = 10.0 if args.smoke else 8.5
    return args


# -- the parts -------------------------------------------------------------------------------

def _subprocess_env(workdir: Path) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "COMPFX_CACHE_DIR": str(workdir / "compfx-cache")}


def run_environment(smoke: bool, workdir: Path, budget_end: float, *,
                    clock: Callable[[], float] = time.time) -> dict:
    """The environment and the matmul probe, from ``python -m benchmarks.gpu_env`` in a time-boxed subprocess.

    When the probe fails, what is known without it (the device's name from ``nvidia-smi``, this process's
    versions) with ``status: "failed"``, why, and the probe's output tail: the results file says so, and the
    other parts still run.
    """
    out = workdir / "env.json"
    end = min(budget_end, clock() + _ENV_TIMEOUT_S[smoke])
    boxed = run_boxed([sys.executable, "-m", "benchmarks.gpu_env", "--out", str(out), *(["--smoke"] if smoke else [])],
                      log_path=workdir / "env.log", deadline=lambda: end, env=_subprocess_env(workdir), cwd=ROOT,
                      clock=clock)
    try:
        if boxed.returncode == 0:
            return {**json.loads(out.read_text()), "status": "ok"}
    except (OSError, ValueError):
        pass
    why = "timed out" if boxed.timed_out else f"exited with code {boxed.returncode}"
    return {**_environment_without_probe(smoke), "status": "failed", "why": f"the environment probe {why}",
            "output_tail": boxed.tail(3000)}


def _environment_without_probe(smoke: bool) -> dict:
    """The device's name and the versions, read without initialising CUDA here (the probe's failure may be CUDA's)."""
    import platform

    import torch

    from compfx.measure import hardware_name

    name = hardware_name("cpu") if smoke else None
    if name is None:
        try:
            found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=20)
            name = found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            name = None
    return {"device_type": "cpu" if smoke else "cuda", "device_name": name or "unknown CUDA device",
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}


def _junit_counts(path: Path) -> dict:
    """Counts and failures from pytest's JUnit XML (an empty dict when it was not written)."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failures = []
    for case in root.iter("testcase"):
        for outcome in ("failure", "error"):
            found = case.find(outcome)
            if found is not None:
                failures.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                                 "message": (found.get("message") or "")[:500]})
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"],
            "failures": failures}


def run_cuda_tests(smoke: bool, workdir: Path, log_path: Path, budget_end: float, *,
                   clock: Callable[[], float] = time.time) -> dict:
    """``pytest -m cuda`` in a time-boxed subprocess; its output goes to ``log_path``."""
    paths = ["tests/test_cuda.py"] if smoke else ["tests"]  # smoke: no GPU, so only the skips are checked
    xml = workdir / "cuda-tests.xml"
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", *paths, "-q", "-rfEs", "-p", "no:cacheprovider",
            f"--junitxml={xml}"]
    log_path.unlink(missing_ok=True)
    end = min(budget_end, clock() + _TESTS_TIMEOUT_S[smoke])
    boxed = run_boxed(argv, log_path=log_path, deadline=lambda: end, env=_subprocess_env(workdir), cwd=ROOT,
                      clock=clock)
    counts = _junit_counts(xml)
    if boxed.timed_out:
        status = "timeout"
    elif not counts:
        status = "error"
    else:
        status = "passed" if counts["failed"] == counts["errors"] == 0 and boxed.returncode in (0, 5) else "failed"
    return {"status": status, "returncode": boxed.returncode, "seconds": boxed.seconds,
            "command": "pytest -m cuda " + " ".join(paths), **counts,
            **({} if counts else {"output_tail": tail_of(log_path, 3000)})}


def run_fp8(smoke: bool, workdir: Path, log_path: Path, budget_end: float, part: str = "fp8", *,
            clock: Callable[[], float] = time.time) -> dict:
    """An FP8 part (``fp8``: :mod:`benchmarks.fp8`; ``fp8-compiled``: :mod:`benchmarks.fp8_compiled`) in a
    time-boxed subprocess; its JSON, or why there is none.

    Without torchao the part is ``skipped`` (not a failure: FP8 is an optional extra, ``compfx[fp8]``).
    """
    missing = torchao_missing()
    if missing:
        return {"status": "skipped", "why": missing}
    module, json_name, full_args, limits = _FP8_PARTS[part]
    out = workdir / part
    argv = [sys.executable, "-m", module, "--out", str(out), *(["--smoke"] if smoke else full_args)]
    end = min(budget_end, clock() + limits[smoke])
    if end - clock() < 30:
        return {"status": "not measured", "why": f"no budget left in this run; run --parts {part}"}
    boxed = run_boxed(argv, log_path=log_path, deadline=lambda: end, env=_subprocess_env(workdir), cwd=ROOT,
                      clock=clock)
    found = sorted(out.glob(f"*/{json_name}"))
    if boxed.returncode == 0 and found:
        return {"status": "ok", "seconds": boxed.seconds, **json.loads(found[0].read_text())}
    return {"status": "timeout" if boxed.timed_out else "failed", "why": "see the output tail",
            "seconds": boxed.seconds, "output_tail": tail_of(log_path, 2000)}


# -- the results file ------------------------------------------------------------------------

def load_state(path: Path, *, device_name: str, smoke: bool) -> dict | None:
    """An earlier run's results for this device, or None (with a note why an existing file is not used)."""
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    if state.get("device_name") != device_name or bool(state.get("smoke")) != smoke:
        print(f"not merging {path}: it was measured on {state.get('device_name')!r} (smoke={state.get('smoke')}), "
              f"this run is on {device_name!r} (smoke={smoke})", file=sys.stderr)
        return None
    return state


def _git_commit() -> str | None:
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None if found.returncode == 0 else None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class _Results:
    """The merged state of every run for one device, written to disk after every change."""

    def __init__(self, folder: Path, state: dict, smoke: bool):
        self.folder, self.state, self.smoke = folder, state, smoke
        self.json_path = folder / f"{STEM[smoke]}.json"
        self.markdown_path = folder / f"{STEM[smoke]}.md"

    @property
    def run(self) -> dict:
        return self.state["runs"][-1]

    @property
    def rows(self) -> dict:
        return self.state["bench"]["rows"]

    def record_row(self, row: dict) -> None:
        probe = (self.run["environment"].get("matmul_probe") or {}).get("bfloat16") or {}
        row = {**row, "run": self.run["run"], "measured": _now()}
        row["mfu_pct"] = mfu_percent(flops_per_step=row.get("flops_per_step"), steps_per_s=row.get("steps_per_s"),
                                     peak_tflops=probe.get("tflops"))
        self.rows[row["id"]] = row
        self.write()
        print("  " + row_line(self.rows, row), flush=True)  # as it is measured: a run cut short still shows it

    def write(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.json_path, self.state)
        self.markdown_path.write_text(markdown(self.state))


def _start_state(args, env: dict, merged: dict | None, settings: Settings) -> dict:
    state = merged or {"suite": "benchmarks.gpu_suite", "format": 1, "smoke": args.smoke,
                       "device_name": env["device_name"], "slug": slug(env["device_name"]), "runs": [],
                       "bench": {"rows": {}}}
    state["environment"] = env
    state["bench"]["settings"] = asdict(settings)
    for key, note in (("fp8", FP8_NOTE), ("fp8_compiled", FP8_COMPILED_NOTE)):
        if not state.get(key):  # an earlier run's FP8 part, measured or failed, stands until a run of the part
            state[key] = {"status": "not measured", "why": note}
    state["runs"].append({"run": len(state["runs"]) + 1, "started": _now(), "argv": sys.argv[1:],
                          "parts": args.parts, "budget_min": args.budget_min, "commit": _git_commit(),
                          "note": args.note, "settings": asdict(settings), "environment": env})
    return state


def main(argv=None) -> int:
    args = parse_args(argv)
    clock = CpuClock() if args.smoke else time.time  # smoke: CPU work only, so limits in CPU seconds hold under load
    start, wall_start = clock(), time.time()
    budget_end = start + 60 * args.budget_min - _RESERVE_S
    settings = Settings.for_run(args.smoke)
    with tempfile.TemporaryDirectory(prefix="compfx-gpu-suite-") as scratch:
        workdir = Path(scratch)
        env = run_environment(args.smoke, workdir, budget_end, clock=clock)
        folder = Path(args.out) / slug(env["device_name"])
        merged = None
        if not args.fresh:
            sources = [folder] + ([Path(args.merge_from) / folder.name] if args.merge_from else [])
            merged = next((state for source in sources if (state := load_state(
                source / f"{STEM[args.smoke]}.json", device_name=env["device_name"], smoke=args.smoke))), None)
        results = _Results(folder, _start_state(args, env, merged, settings), args.smoke)
        results.write()
        print(summary_lines(results.state)[0], flush=True)
        if "cuda-tests" in args.parts:
            print("cuda tests: running pytest -m cuda ...", flush=True)
            results.state["cuda_tests"] = {**run_cuda_tests(args.smoke, workdir, folder / "cuda-tests.txt",
                                                            budget_end, clock=clock), "run": results.run["run"]}
            results.write()
        _run_fp8_part(args, results, workdir, budget_end, "fp8-compiled",
                      "fp8-compiled: bf16 AMP, torchao float8 and compfx's plans searched eager and compiled ...", clock)
        left = []
        if "bench" in args.parts:
            groups = suite_groups(args.models, args.modes, compiled=not args.no_compile, smoke=args.smoke,
                                  padding=not args.no_padding)
            left = run_groups(groups, settings, rows=results.rows, budget_end=budget_end, workdir=workdir,
                              record=results.record_row, retry_failed=args.retry_failed,
                              log=lambda line: print(line, flush=True), clock=clock)
        _run_fp8_part(args, results, workdir, budget_end, "fp8", "fp8: bf16 AMP, torchao float8 and compfx FP8 plans ...",
                      clock)
        results.run.update(finished=_now(), seconds=time.time() - wall_start, left=left)
        results.write()
    print("\n".join(["", f"== {results.json_path} and {results.markdown_path.name}", *summary_lines(results.state)]))
    if left:
        print(f"left for a later run ({len(left)}): " + "; ".join(left))
    return 0 if succeeded(results.state, args.parts) else 1


def _run_fp8_part(args, results: _Results, workdir: Path, budget_end: float, part: str, announce: str,
                  clock: Callable[[], float]) -> None:
    """Run an FP8 part if asked and not yet measured (or ``--retry-failed``); record it under its state key."""
    key = part.replace("-", "_")
    if part not in args.parts or (results.state[key].get("status") == "ok" and not args.retry_failed):
        return
    print(announce, flush=True)
    log_path = results.folder / f"{key}.txt"
    results.state[key] = {**run_fp8(args.smoke, workdir, log_path, budget_end, part, clock=clock),
                          "run": results.run["run"]}
    results.write()


def succeeded(state: dict, parts) -> bool:
    """Did every part this run ran succeed? An FP8 part skipped for want of torchao is no failure.

    >>> skipped = {"status": "skipped"}
    >>> succeeded({"environment": {"status": "ok"}, "bench": {"rows": {}}, "fp8": skipped, "fp8_compiled": skipped},
    ...           PARTS)
    True
    >>> succeeded({"environment": {"status": "failed"}, "bench": {"rows": {}}}, ["env"])
    False
    """
    env_ok = (state.get("environment") or {}).get("status", "ok") == "ok"
    tests_ok = (state.get("cuda_tests") or {}).get("status", "passed") == "passed"
    rows_ok = all(row.get("status") == "ok" for row in ((state.get("bench") or {}).get("rows") or {}).values())
    fp8_ok = all(part not in parts or (state.get(part.replace("-", "_")) or {}).get("status") in ("ok", "skipped")
                 for part in _FP8_PARTS)
    return env_ok and tests_ok and rows_ok and fp8_ok


if __name__ == "__main__":
    sys.exit(main())
