"""The GPU suite's results as text: the markdown file, the one-line-per-row summary, and the README's GPU section.

Everything here is computed from the suite's JSON (:mod:`benchmarks.gpu_suite`),
nothing is typed by hand. Ratios compare rows of one model and one kind
(eager with eager, compiled with compiled): steps/s over FP32's and over AMP
fp16's.

>>> state = {"device_name": "Some GPU", "bench": {"rows": {
...     "m/fp32": {"id": "m/fp32", "model": "m", "mode_label": "fp32", "compiled": False, "status": "ok",
...                "steps_per_s": 10.0, "run": 1},
...     "m/amp-fp16": {"id": "m/amp-fp16", "model": "m", "mode_label": "amp-fp16", "compiled": False,
...                    "status": "ok", "steps_per_s": 25.0, "run": 1}}}}
>>> for line in summary_lines(state)[-2:]: print(line)
m/fp32                          ok          10.00 steps/s  1.00x FP32  peak      - MB  MFU     -
m/amp-fp16                      ok          25.00 steps/s  2.50x FP32  peak      - MB  MFU     -
"""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from compfx.measure import describe_fp32_math

__all__ = ["ratios", "markdown", "summary_lines", "row_line", "readme_section", "device_results", "NO_GPU_YET",
           "RUN_COMMANDS", "FP8_NOTE", "FP8_COMPILED_NOTE", "fp8_text", "fp8_compiled_text", "fp8_summary",
           "padding_text"]

_MB = 1024 * 1024

FP8_NOTE = ("Not measured in this run. The part compares bf16 AMP, torchao float8 (every linear) and compfx's "
            "searched FP8 / bf16 / FP32 plan on the GPT-shaped decoder (`benchmarks/fp8.py`); it needs torchao "
            "(`pip install compfx[fp8]`).")

FP8_COMPILED_NOTE = ("Not measured in this run. The part trains bf16 AMP, torchao float8 (every linear, and its "
                     "auto filter) and compfx's plans searched eager and searched compiled, all under "
                     "`torch.compile` (`benchmarks/fp8_compiled.py`); it needs torchao (`pip install compfx[fp8]`).")

#: How to measure a GPU (kept in one place: the README, the results README and the suite's docstring say the same).
RUN_COMMANDS = """\
# from the repository root, on any machine with a CUDA GPU (compfx installed: pip install -e ".[fp8]")
python -m benchmarks.gpu_suite"""

NO_GPU_YET = ("**No GPU has been measured yet.** The suite (`python -m benchmarks.gpu_suite`) has only run as its CPU "
              "smoke test. To measure a GPU:")


def _fmt(value, spec: str, missing: str = "") -> str:
    return missing if value is None else format(value, spec)


def _kind_rows(rows: dict, model: str, compiled: bool) -> dict[str, dict]:
    return {row.get("mode_label"): row for row in rows.values()
            if row.get("model") == model and bool(row.get("compiled")) == compiled and row.get("status") == "ok"}


def ratios(rows: dict, row: dict) -> dict:
    """steps/s of ``row`` over FP32's and AMP fp16's of the same model and kind, and over its own eager twin."""
    same = _kind_rows(rows, row.get("model"), bool(row.get("compiled")))
    eager = _kind_rows(rows, row.get("model"), False)
    mine = row.get("steps_per_s")

    def over(other):
        base = (other or {}).get("steps_per_s")
        return mine / base if mine and base else None

    return {"vs_fp32": over(same.get("fp32")), "vs_amp_fp16": over(same.get("amp-fp16")),
            "vs_eager": over(eager.get(row.get("mode_label"))) if row.get("compiled") else None}


_MODE_ORDER = ("fp32", "amp-fp16", "amp-bf16", "compfx-fp16", "compfx-bf16")


def _ordered(rows: dict) -> list[dict]:
    """Eager rows, then compiled ones; models in the order they were first measured; modes in the suite's order."""
    models = list(dict.fromkeys(row.get("model") for row in rows.values()))

    def mode_index(row):
        label = row.get("mode_label")
        return _MODE_ORDER.index(label) if label in _MODE_ORDER else len(_MODE_ORDER)

    return sorted(rows.values(), key=lambda r: (bool(r.get("compiled")), models.index(r.get("model")), mode_index(r)))


def _casts(row: dict) -> str:
    if row.get("casts_graph") is not None:
        return str(row["casts_graph"])
    return "" if row.get("casts_forward") is None else str(row["casts_forward"])


def _status(row: dict) -> str:
    return row.get("status", "") if row.get("status") == "ok" else f"{row.get('status')}: {row.get('error', '')}"[:80]


def summary_lines(state: dict) -> list[str]:
    """One line per row (and a line each for the environment and the CUDA tests): what a short output tail shows."""
    lines = []
    env = state.get("environment") or {}
    probe = (env.get("matmul_probe") or {}).get("bfloat16") or {}
    if env.get("status") == "failed":
        lines.append(f"device: {env.get('device_name')}, torch {env.get('torch')}, CUDA {env.get('cuda')}: "
                     f"FAILED: {env.get('why')} (its output tail is in the results file)")
    elif env:
        lines.append(f"device: {env.get('device_name')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
                     f"bf16 matmul probe {_fmt(probe.get('tflops'), '.4g', '?')} TFLOP/s")
    tests = state.get("cuda_tests")
    if tests:
        lines.append(f"cuda tests: {tests.get('status')}: {tests.get('passed', 0)} passed, {tests.get('failed', 0)} "
                     f"failed, {tests.get('errors', 0)} errors, {tests.get('skipped', 0)} skipped "
                     f"({_fmt(tests.get('seconds'), '.0f', '?')} s)")
    for key in ("fp8_compiled", "fp8"):
        part = state.get(key) or {}
        if part.get("status") not in (None, "not measured"):
            lines.append(f"{key.replace('_', '-')}: {part['status']}"
                         + ("" if part["status"] == "ok" else f": {part.get('why', '')}"))
    rows = (state.get("bench") or {}).get("rows") or {}
    lines.extend(row_line(rows, row) for row in _ordered(rows))
    return lines


def row_line(rows: dict, row: dict) -> str:
    """One row in one line: status, steps/s, the ratio to FP32 of its kind, peak memory, MFU (or the error)."""
    ratio = ratios(rows, row)
    peak = row.get("peak_memory_bytes")
    return (f"{row.get('id', ''):34s} {row.get('status', ''):8s} {_fmt(row.get('steps_per_s'), '9.2f', '-'):>9} "
            f"steps/s  {_fmt(ratio['vs_fp32'], '.2f', '-'):>4}x FP32  peak "
            f"{_fmt(None if peak is None else peak / _MB, '6.0f', '-'):>6} MB  MFU {_fmt(row.get('mfu_pct'), '5.1f', '-'):>5}"
            + ("" if row.get("status") == "ok" else f"  {row.get('error', '')[:60]}"))


def _environment_text(env: dict) -> str:
    if not env:
        return "Environment: not recorded."
    if env.get("status") == "failed":
        return (f"{env.get('device_name')}: torch {env.get('torch')}, CUDA {env.get('cuda')}, Python "
                f"{env.get('python')}. **The environment probe failed** ({env.get('why')}): no matmul rates, so no "
                f"MFU. Its output ends:\n\n```text\n{(env.get('output_tail') or '').strip()[-1500:]}\n```")
    parts = [f"torch {env.get('torch')}", f"CUDA {env.get('cuda')}", f"Python {env.get('python')}"]
    if env.get("capability"):
        parts.insert(0, f"compute capability {'.'.join(map(str, env['capability']))}, "
                        f"{env.get('multiprocessors')} SMs, {_fmt((env.get('memory_bytes') or 0) / 2 ** 30, '.0f')} GiB, "
                        f"driver {env.get('driver')}, cuDNN {env.get('cudnn')}")
    if env.get("fp32_math"):  # what the "fp32" rows computed in: the process's settings, never changed
        parts.append(f"\"fp32\" here: {describe_fp32_math(env['fp32_math'])}")
    elif env.get("matmul_allow_tf32") is not None:  # results recorded before fp32_math
        parts.append(f"TF32 matmul {'on' if env['matmul_allow_tf32'] else 'off'}, "
                     f"TF32 cuDNN {'on' if env.get('cudnn_allow_tf32') else 'off'} (PyTorch's defaults)")
    probe = env.get("matmul_probe") or {}
    rates = ", ".join(f"{name} {_fmt(rate.get('tflops'), '.4g', 'failed')}" for name, rate in probe.items())
    size = next((rate.get("n") for rate in probe.values() if rate.get("n")), "?")
    return (f"{env.get('device_name')}: " + "; ".join(parts) + ".\n\n"
            f"Matmul probe (random {size}x{size} matrices, median of timed blocks, TFLOP/s): {rates}.")


def _tests_text(tests: dict | None) -> str:
    if not tests:
        return "CUDA tests: not run."
    text = (f"CUDA tests (`{tests.get('command')}`): **{tests.get('status')}**, {tests.get('passed', 0)} passed, "
            f"{tests.get('failed', 0)} failed, {tests.get('errors', 0)} errors, {tests.get('skipped', 0)} skipped "
            f"in {_fmt(tests.get('seconds'), '.0f', '?')} s (output: `cuda-tests.txt`).")
    failures = tests.get("failures") or []
    return text + "".join(f"\n- {f.get('test')}: {f.get('message', '')[:200]}" for f in failures)


def _rows_table(rows: dict) -> str:
    lines = []
    for row in _ordered(rows):
        ratio = ratios(rows, row)
        peak = row.get("peak_memory_bytes")
        lines.append([row.get("model"), row.get("mode_label", "") + ("+compile" if row.get("compiled") else ""),
                      _fmt(row.get("steps_per_s"), ".2f"), _fmt(row.get("step_s") and 1e3 * row["step_s"], ".1f"),
                      _fmt(ratio["vs_fp32"], ".2f"), _fmt(ratio["vs_amp_fp16"], ".2f"), _fmt(ratio["vs_eager"], ".2f"),
                      _fmt(None if peak is None else peak / _MB, ".0f"), _fmt(row.get("mfu_pct"), ".1f"),
                      _fmt(row.get("first_step_s"), ".1f"), _casts(row), row.get("run", ""), _status(row)])
    headers = ["model", "mode", "steps/s", "ms/step", "x FP32", "x AMP fp16", "x eager", "peak MB", "MFU %",
               "first step s", "casts", "run", "status"]
    return tabulate(lines, headers=headers, tablefmt="github", disable_numparse=True)


def _plan_text(row: dict) -> str:
    return ", ".join(f"{counts.get('low', 0)}/{counts.get('fp32', 0)}/{counts.get('follow', 0)}"
                     for counts in (row.get("plan") or {}).values())


def _search_table(rows: dict) -> str:
    lines = []
    for row in _ordered(rows):
        if row.get("search_s") is None:
            continue
        figures = next(iter((row.get("search") or {}).values()), {})
        share = row.get("search_share_100_epochs")
        lines.append([row.get("model"), row.get("mode_label"), _fmt(row.get("search_s"), ".1f"),
                      _fmt(figures.get("search_fp32_epochs"), ".1f"), _fmt(share and 100 * share, ".2f"),
                      f"{row.get('epoch_data', '')} ({row.get('epoch_steps', '?')} steps/epoch)",
                      _plan_text(row), _casts(row), _fmt(figures.get("predictor_error_pct"), ".1f")])
    headers = ["model", "mode", "search s", "search / FP32 loader epoch", "% of a 100-epoch run", "epoch of",
               "plan low/fp32/follow", "casts in plan", "predictor error %"]
    return tabulate(lines, headers=headers, tablefmt="github", disable_numparse=True)


def _timed_epochs(settings: dict) -> str:
    count = max(1, settings.get("epochs", 2) - 1)
    return f"{count} epoch{'s' if count > 1 else ''}"


def markdown(state: dict) -> str:
    """The suite's markdown file: environment, CUDA tests, every row, the searches, FP8, what is left."""
    bench = state.get("bench") or {}
    rows, settings = bench.get("rows") or {}, bench.get("settings") or {}
    runs = state.get("runs") or []
    left = (runs[-1].get("left") if runs else None) or []
    smoke = " (smoke run: CPU, tiny shapes; these numbers mean nothing)" if state.get("smoke") else ""
    return "\n".join([
        f"# GPU suite: {state.get('device_name')}{smoke}",
        "",
        f"Written by `python -m benchmarks.gpu_suite` from `gpu-suite.json` ({len(runs)} run(s); every figure is "
        "measured there, none typed).",
        "",
        _environment_text(state.get("environment") or {}),
        "",
        _tests_text(state.get("cuda_tests")),
        "",
        "## Training steps",
        "",
        f"Config `{settings.get('config')}` on synthetic data at the config's batch sizes (the paper's, for "
        f"`paper`). ms/step: the median of {_timed_epochs(settings)} of {settings.get('batches')} steps after one "
        "warm-up epoch "
        "(and one first step, which compiles under torch.compile), each epoch timed with the device synchronised "
        "at both ends. Peak MB: `torch.cuda.max_memory_allocated` over the timed epochs. x FP32 / x AMP fp16: "
        "steps/s over those rows' of the same model and kind (eager or compiled), measured one after the other in "
        "one worker process; x eager: a compiled row over its eager twin. MFU: counted FLOPs of forward and "
        "backward (`benchmarks/flops.py`) x steps/s over the bf16 matmul probe. casts: casts in the compfx plan's "
        "graph, or in one traced forward under autocast. run: the suite run that measured the row.",
        "",
        _rows_table(rows) if rows else "No rows measured.",
        "",
        "## compfx search",
        "",
        "search s: wall time of `compfx.optimize` on the row's batches (its plan and profile cache starts empty in "
        "each suite run; a model's first search profiles every op). search / FP32 "
        "loader epoch: the search's time in FP32 epochs of those batches. % of a 100-epoch run: search s over "
        "search s plus 100 epochs of the named training set at the compfx row's step time.",
        "",
        _search_table(rows) if any(r.get("search_s") is not None for r in rows.values()) else "No search measured.",
        "",
        "## Shape padding",
        "",
        padding_text(rows),
        "",
        "## FP8, compiled",
        "",
        fp8_compiled_text(state.get("fp8_compiled")),
        "",
        "## FP8",
        "",
        fp8_text(state.get("fp8")),
        "",
        "## Left for a later run",
        "",
        "\n".join(f"- {item}" for item in left) if left else "Nothing: every selected row was measured.",
        "",
    ])


def padding_text(rows: dict) -> str:
    """The padding row (``benchmarks/padding.py``): one plan with and without Tensor Core shape padding."""
    found = [row for row in _ordered(rows) if row.get("padding")]
    if not found:
        failed = [row for row in rows.values() if str(row.get("mode_label", "")).startswith("padding")]
        return f"{failed[0]['status']}: {failed[0].get('error', '')}" if failed else "Not measured in this run."
    from .padding import markdown as padding_markdown  # the benchmark's own table, not a second one

    return "\n\n".join(padding_markdown(row["padding"]).split("\n", 1)[1].strip() for row in found)


def fp8_text(fp8: dict | None) -> str:
    """The FP8 part: its table (from ``benchmarks/fp8.py``'s JSON), or why it was not measured."""
    fp8 = fp8 or {}
    if fp8.get("status") != "ok":
        why = fp8.get("why") or FP8_NOTE
        return why if fp8.get("status") in (None, "not measured") else f"{fp8['status']}: {why}"
    from .fp8 import markdown as fp8_markdown  # the benchmark's own table, not a second one

    return fp8_markdown(fp8).split("\n", 1)[1].strip()  # its title is this section's heading


def fp8_compiled_text(part: dict | None) -> str:
    """The compiled FP8 part: its tables (from ``benchmarks/fp8_compiled.py``'s JSON), or why it was not measured."""
    part = part or {}
    if part.get("status") != "ok":
        why = part.get("why") or FP8_COMPILED_NOTE
        return why if part.get("status") in (None, "not measured") else f"{part['status']}: {why}"
    from .fp8_compiled import markdown as fp8_compiled_markdown  # the benchmark's own tables

    return fp8_compiled_markdown(part).split("\n", 1)[1].strip()


def _against_amp(row: dict, amp: dict) -> str:
    """A contender's step against bf16 AMP's compiled step: the ratio, or "no measurable difference" where the
    spreads of their rounds overlap (noise could explain the ratio)."""
    ratio = amp["step_ms"] / row["step_ms"]
    if row["step_ms_min"] <= amp["step_ms_max"] and amp["step_ms_min"] <= row["step_ms_max"]:
        return f"no measurable difference ({ratio:.2f}x)"
    return f"{ratio:.2f}x"


def fp8_summary(state: dict) -> str:
    """The FP8 parts in one short table for the README (their full tables are in ``gpu-suite.md``): each
    contender's step in ms (fastest - slowest round) and against bf16 AMP compiled, taken in one interleaved run.

    >>> amp = {"how": "compiled (inductor)", "step_ms": 10.0, "step_ms_min": 9.9, "step_ms_max": 10.1}
    >>> fp8 = {"how": "compiled (inductor)", "step_ms": 8.0, "step_ms_min": 7.9, "step_ms_max": 8.1}
    >>> part = {"status": "ok", "model": {"layers": 1, "dim": 4096}, "native_fp8": True,
    ...         "rows": {"bf16 AMP (compiled)": amp, "torchao float8 (all linears) (compiled)": fp8}}
    >>> print(fp8_summary({"fp8_compiled": part}))
    FP8 (`benchmarks/fp8_compiled.py`, `benchmarks/fp8.py`; every contender compiled unless it says eager):
    <BLANKLINE>
    | benchmark | contender | step ms (fastest - slowest) | vs bf16 AMP compiled |
    |---|---|---|---|
    | compiled searches, GPT 1 x 4096 | torchao float8 (all linears) | 8.00 (7.90 - 8.10) | 1.25x |
    | searched plan | not measured | | |
    """
    lines = ["FP8 (`benchmarks/fp8_compiled.py`, `benchmarks/fp8.py`; every contender compiled unless it says eager):",
             "", "| benchmark | contender | step ms (fastest - slowest) | vs bf16 AMP compiled |", "|---|---|---|---|"]
    for key, title in (("fp8_compiled", "compiled searches"), ("fp8", "searched plan")):
        part = state.get(key) or {}
        if part.get("status") != "ok":
            lines.append(f"| {title} | {part.get('status', 'not measured')} | | |")
            continue
        model = part["model"]
        amp = part["rows"]["bf16 AMP (compiled)"]
        for name, row in part["rows"].items():
            if "step_ms" not in row or row is amp:
                continue
            label = name.removesuffix(" (compiled)")
            lines.append(f"| {title}, GPT {model['layers']} x {model['dim']} | {label} | {row['step_ms']:.2f} "
                         f"({row['step_ms_min']:.2f} - {row['step_ms_max']:.2f}) | {_against_amp(row, amp)} |")
    return "\n".join(lines)


# -- the README's section ------------------------------------------------------------------------

def device_results(results_root: str | Path) -> list[tuple[Path, dict]]:
    """``(folder, state)`` of every committed full (not smoke) suite result under ``results_root``, by folder name."""
    import json

    found = []
    for path in sorted(Path(results_root).glob("*/gpu-suite.json")):
        state = json.loads(path.read_text())
        if not state.get("smoke"):
            found.append((path.parent, state))
    return found


def _readme_table(rows: dict, compiled: bool) -> str:
    models = list(dict.fromkeys(row.get("model") for row in _ordered(rows) if bool(row.get("compiled")) == compiled))
    lines = []
    for model in models:
        modes = _kind_rows(rows, model, compiled)
        fp32, amp, amp_bf16, ours = (modes.get(m, {}) for m in ("fp32", "amp-fp16", "amp-bf16", "compfx-fp16"))
        ratio = ratios(rows, ours) if ours else {}
        peaks = " / ".join(_fmt(r.get("peak_memory_bytes") and r["peak_memory_bytes"] / _MB, ".0f", "-")
                           for r in (fp32, amp, ours))
        share = ours.get("search_share_100_epochs")
        lines.append([model, _fmt(fp32.get("steps_per_s"), ".2f", "-"), _fmt(amp.get("steps_per_s"), ".2f", "-"),
                      _fmt(amp_bf16.get("steps_per_s"), ".2f", "-"), _fmt(ours.get("steps_per_s"), ".2f", "-"),
                      _fmt(ratio.get("vs_fp32"), ".2f", "-"), _fmt(ratio.get("vs_amp_fp16"), ".2f", "-"), peaks,
                      _fmt(ours.get("mfu_pct"), ".1f", "-"), _fmt(share and 100 * share, ".2f", "-")])
    headers = ["model", "FP32 steps/s", "AMP fp16", "AMP bf16", "compfx", "compfx x FP32", "compfx x AMP fp16",
               "peak MB FP32 / AMP fp16 / compfx", "compfx MFU %", "search % of 100 epochs"]
    return tabulate(lines, headers=headers, tablefmt="github", disable_numparse=True)


def readme_section(results_root: str | Path, *, relative_to: str | Path | None = None) -> str:
    """The text between the README's ``gpu-results`` markers, generated from the committed suite results."""
    found = device_results(results_root)
    heading = ["### GPU results (generated by `python -m benchmarks.gpu_readme` from the suite's JSON)", ""]
    if not found:
        return "\n".join([*heading, NO_GPU_YET, "", "```bash", RUN_COMMANDS, "```", "",
                          "It is time-boxed (`--budget-min`, 8.5 minutes by default) and resumable (a later run with "
                          "`--merge-from benchmarks/results` measures only the rows left), and writes "
                          "`benchmarks/results/<gpu-slug>/`; `benchmarks/results/README.md` says what each part "
                          "measures."])
    parts = heading
    for folder, state in found:
        rows = (state.get("bench") or {}).get("rows") or {}
        where = folder.relative_to(relative_to) if relative_to else folder
        tests = state.get("cuda_tests") or {}
        about = [f"**{state.get('device_name')}** (`{where}/gpu-suite.md` has every row, the searches and the "
                 f"environment; {len(state.get('runs') or [])} suite run(s)).", _environment_text(
                     state.get("environment") or {}),
                 f"CUDA tests: {tests.get('status', 'not run')}, {tests.get('passed', 0)} passed, "
                 f"{tests.get('failed', 0)} failed, {tests.get('skipped', 0)} skipped."]
        parts += [" ".join(about),
                  "",
                  "Eager training steps (synthetic data, paper batch sizes; x: steps/s ratios measured side by side "
                  "in one worker process):",
                  "",
                  _readme_table(rows, compiled=False)]
        if any(row.get("compiled") and row.get("status") == "ok" for row in rows.values()):
            parts += ["", "Under `torch.compile` (Inductor; compfx through `compfx.compile_with_plan`):", "",
                      _readme_table(rows, compiled=True)]
        if any(row.get("padding") for row in rows.values()):
            parts += ["", "Shape padding (one plan with and without padding, in turns):", "", padding_text(rows)]
        parts += ["", fp8_summary(state), ""]
    parts += ["To measure another GPU:", "", "```bash", RUN_COMMANDS, "```"]
    return "\n".join(parts).rstrip("\n")
