"""FP8 where it pays, compiled: torchao's float8 (every linear, and its auto filter) against compfx's plans.

::

    python -m benchmarks.fp8_compiled [--smoke] [--size gpt2|wide] [--out ROOT]

One GPT-style decoder, trained every way under ``torch.compile``, from the same weights, each with its own AdamW,
the k-th step of each on the same batch:

* **bf16 AMP**: ``torch.autocast(dtype=torch.bfloat16)``, compiled;
* **torchao float8, every linear**: ``convert_to_float8_training`` (tensorwise), under bf16 autocast, compiled
  (torchao's own recipe: eager float8 leaves its scaling unfused);
* **torchao float8, auto filter**: the same, converting only the linears that torchao's
  ``torchao.float8._auto_filter_for_recipe("tensorwise", filter_fqns=[])`` picks by its size rules (taken from H100
  microbenchmarks; dims not multiples of 16, or below its thresholds, stay bf16);
* **compfx, plan searched eager**: ``compfx.optimize(..., SearchConfig(fp8=True))``, which times the plans
  eagerly, then the plan trained through ``compfx.compile_with_plan``;
* **compfx, plan searched compiled**: the same with ``SearchConfig(fp8=True, compile=...)``, which times the plans
  as they train compiled; where this compfx has no ``compile`` field the row says "not available".

Each compfx row says which linears its plan runs in FP8 and how that compares with torchao's auto filter.

The contenders take turns as in :mod:`benchmarks.fp8` (:func:`benchmarks.fp8.take_turns`): untimed warm-up steps
(which compile), then rounds in a rotated order, each a timed window of steps per contender; a row's step time is
its median window, with the fastest and slowest beside it.

Float8 GEMMs need a GPU of compute capability 8.9+ (H100). Anywhere else torchao emulates them in high precision
(``Float8LinearConfig(emulate=True)``): the script still runs, on tiny shapes with ``aot_eager``, to show that every
path trains, and says that its times mean nothing; there compfx's searches rank plans by
:func:`compfx.costmodel.roofline_cost` (an H100's roofline), since the emulated seconds say nothing about FP8.
``--size wide`` (GPU) trains a decoder of width 4096, where the GEMMs are large enough for FP8 to pay. Results:
``ROOT/<device>/fp8_compiled.json`` and ``fp8_compiled.md``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from typing import Callable

import torch
import torch.nn as nn

import compfx
from compfx.compile_backend import compile_with_plan
from compfx.costmodel import roofline_cost
from compfx.errors import CompfxError
from compfx.float8 import fp8_runs_natively, require_torchao
from compfx.vocabulary import Precision, dtype_name

from . import fp8
from .models.gpt import GPT

__all__ = ["run", "main", "markdown", "compile_setting", "SIZES"]

#: (model config, batch size, batches, rounds, steps per round) by size; "smoke" runs anywhere in seconds
SIZES = {
    "gpt2": (dict(vocab=50304, seq_len=1024, dim=768, heads=12, layers=12), 8, 8, 5, 8),
    "wide": (dict(vocab=8192, seq_len=1024, dim=4096, heads=32, layers=2), 2, 8, 5, 4),
    "smoke": (dict(vocab=64, seq_len=16, dim=32, heads=2, layers=1), 16, 2, 2, 1),
}
_WARMUP_STEPS = {"smoke": 1}  # else benchmarks.fp8's
#: The searches: as benchmarks.fp8's on a GPU; in smoke mode the least that runs both stages
_SEARCH = dict(stage1_budget=16, stage2_budget=4, warmup=1, repeats=2)
_SMOKE_SEARCH = dict(stage1_budget=2, stage2_budget=1, warmup=0, repeats=1, rounds=0, stage2_check_batches=0,
                     predictor="off", verify_capture=False)
RECIPE = "tensorwise"


def compile_setting(inner: str):
    """What ``SearchConfig(compile=...)`` takes to train with ``inner``, or ``(None, why not)`` when this compfx
    has no compiled search. The field's own type is tried first (a settings class beside ``SearchConfig``), then a
    mapping, the backend name and ``True``.

    >>> setting, why = compile_setting("aot_eager")
    >>> (setting is None) == bool(why)
    True
    """
    names = {f.name for f in dataclasses.fields(compfx.SearchConfig)}
    if "compile" not in names:
        return None, "not available: this compfx's SearchConfig has no compile field"
    from compfx.search import config as search_config

    forms = [cls(inner=inner) for cls in (getattr(compfx, "CompileOptions", None),
                                          getattr(search_config, "CompileOptions", None)) if cls is not None]
    refusals = []
    for form in [*forms, {"inner": inner}, inner, True]:
        try:
            compfx.SearchConfig(compile=form)
            return form, ""
        except (CompfxError, TypeError, ValueError) as error:
            refusals.append(f"{form!r}: {error}")
    return None, "not available: SearchConfig(compile=...) refused " + "; ".join(refusals)


def _float8_linears(model: nn.Module) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]


def _auto_filter_fqns(model: nn.Module, float8) -> list[str]:
    """The linears torchao's auto filter would convert (it is experimental: ``_auto_filter_for_recipe``)."""
    keep = float8._auto_filter_for_recipe(RECIPE, filter_fqns=[])
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and keep(module, name)]


def _search(base: GPT, batches: list, config: compfx.SearchConfig, cost_fn: Callable | None):
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if cost_fn is not None:
        config = dataclasses.replace(config, cost_fn=cost_fn)
    result = compfx.optimize(model, batches, optimizer=optimizer, loss_fn=fp8.gpt_loss, low_dtype=torch.bfloat16,
                             config=config)
    model.load_state_dict(base.state_dict())  # the same start as the others (the search trained it)
    return model, result


def _plan_row(result, auto_fqns: list[str], linears: list[str]) -> dict:
    plan = result.plan
    fp8_linears = sorted({key.module for key, p in plan.items() if p is Precision.FP8 and key.kind == "linear"})
    agree = sum((name in fp8_linears) == (name in auto_fqns) for name in linears)
    counts = {str(p): sum(v is p for v in plan.values()) for p in set(plan.values())}
    return {"plan": plan.bitstring(result.analysis), "precisions": counts, "fp8_recipe": str(plan.fp8_recipe),
            "low_dtype": dtype_name(plan.low_dtype), "search_s": result.search_seconds, "fp8_linears": fp8_linears,
            "agrees_with_auto_filter": f"{agree} of {len(linears)} linears"}


def run(*, smoke: bool = False, size: str = "gpt2", device: str | None = None) -> dict:
    """Measure the contenders; returns the result dict (what ``fp8_compiled.json`` holds).

    >>> result = run(smoke=True)  # doctest: +SKIP
    """
    float8 = require_torchao()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    native = fp8_runs_natively(device)
    size = "smoke" if smoke or not native else size
    config, batch_size, n_batches, rounds, steps = SIZES[size]
    batches = fp8.batches_of(config, batch_size, n_batches, device)
    backend, compiled = fp8.compiler_of(native and not smoke)
    torch.manual_seed(0)
    base = GPT(**config).to(device)
    linears = [name for name, module in base.named_modules() if isinstance(module, nn.Linear)]
    auto_fqns = _auto_filter_fqns(base, float8)
    how = f"compiled ({backend})"

    contenders, extra, unavailable = [], {}, {}
    model = copy.deepcopy(base)
    contenders.append(fp8.Contender("bf16 AMP", how, compiled(model), model, True, batches))
    emulated = dict(emulate=not native)
    model = float8.convert_to_float8_training(copy.deepcopy(base), config=float8.Float8LinearConfig(**emulated))
    contenders.append(fp8.Contender("torchao float8 (all linears)", how, compiled(model), model, True, batches))
    extra[contenders[-1].name] = {"fp8_linears": _float8_linears(model)}
    model = float8.convert_to_float8_training(copy.deepcopy(base), config=float8.Float8LinearConfig(**emulated),
                                              module_filter_fn=float8._auto_filter_for_recipe(RECIPE, filter_fqns=[]))
    contenders.append(fp8.Contender("torchao float8 (auto filter)", how, compiled(model), model, True, batches))
    extra[contenders[-1].name] = {"fp8_linears": _float8_linears(model)}

    search = compfx.SearchConfig(fp8=True, fp8_recipe=RECIPE, progress=False, cache_plan=False,
                                 **(_SMOKE_SEARCH if size == "smoke" else _SEARCH))
    cost_fn = None if native else roofline_cost(compfx.analyze(base, batches[0][0], low_dtype=torch.bfloat16,
                                                               fp8=True, verify=False))
    setting, why = compile_setting(backend)
    searches = [("compfx (plan searched eager)", search, "")]
    searches.append(("compfx (plan searched compiled)", dataclasses.replace(search, compile=setting) if setting
                     is not None else None, why))
    for name, config_, missing in searches:
        if config_ is None:
            unavailable[name] = missing
            continue
        model, result = _search(base, batches, config_, cost_fn)
        contenders.append(fp8.Contender(name, f"{how}, compile_with_plan", compile_with_plan(model, result.plan,
                                        inner=backend), model, False, batches))
        extra[name] = _plan_row(result, auto_fqns, linears)

    fp8.take_turns(contenders, rounds=rounds, steps=steps, device=device,
                   warmup_steps=_WARMUP_STEPS.get(size, fp8.WARMUP_STEPS))
    rows = {f"{c.name} (compiled)": {**c.row(), **extra.get(c.name, {})} for c in contenders}
    rows.update({f"{name} (compiled)": {"status": why} for name, why in unavailable.items()})
    return {"benchmark": "benchmarks.fp8_compiled", "device": compfx.measure.device_name(device), "native_fp8": native,
            "model": {"name": "gpt", "size": size, **config, "batch_size": batch_size}, "rounds": rounds,
            "steps_per_round": steps, "compiler": backend, "fp8_recipe": RECIPE,
            "auto_filter_fp8_linears": auto_fqns, "linears": linears,
            "searched_by": "measured seconds" if native else "roofline_cost (an H100's roofline)",
            "torch": torch.__version__, "torchao": getattr(sys.modules.get("torchao"), "__version__", "?"),
            "times_mean_nothing": not native,
            "note": ("float8 GEMMs run natively" if native else
                     "no float8 GEMMs on this device: torchao emulates them in high precision, so these times "
                     "mean nothing; the run only shows that each path trains, and compfx's searches rank plans "
                     "on an H100's roofline"),
            "rows": rows}


def markdown(result: dict) -> str:
    """The result as a table (:func:`benchmarks.fp8.markdown`'s), then each row's FP8 linears and the rows that
    could not run."""
    measured = {name: row for name, row in result["rows"].items() if "step_ms" in row}
    lines = [fp8.markdown({**result, "rows": measured}, title="FP8, compiled,").rstrip("\n"), "",
             f"torchao's auto filter ({result['fp8_recipe']}) converts {len(result['auto_filter_fp8_linears'])} of "
             f"{len(result['linears'])} linears; compfx's searches ranked plans by {result['searched_by']}.", "",
             "| contender | FP8 linears | vs torchao's auto filter |", "|---|---|---|"]
    for name, row in result["rows"].items():
        if "fp8_linears" in row:
            shown = ", ".join(row["fp8_linears"][:6]) + (" ..." if len(row["fp8_linears"]) > 6 else "")
            lines.append(f"| {name.rsplit(' (', 1)[0]} | {len(row['fp8_linears'])}: {shown or 'none'} | "
                         f"{row.get('agrees_with_auto_filter', '')} |")
        elif "status" in row:
            lines.append(f"| {name.rsplit(' (', 1)[0]} | {row['status']} | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, whatever the device (seconds on a CPU)")
    parser.add_argument("--size", choices=("gpt2", "wide"), default="gpt2", help="the decoder on a GPU")
    parser.add_argument("--out", default=str(fp8.RESULTS_ROOT), help="results root (a <device> folder is made in it)")
    args = parser.parse_args(argv)
    result = run(smoke=args.smoke, size=args.size)
    folder = fp8.results_folder(args.out)
    (folder / "fp8_compiled.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / "fp8_compiled.md").write_text(markdown(result))
    print(markdown(result))
    print(f"written to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
