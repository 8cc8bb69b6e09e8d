"""Benchmark runner: each model in FP32, AMP and compfx (and, with --compile, the same under torch.compile).

From the repository root::

    python -m benchmarks.run --models all --config small --epochs 1 --batches 4 --modes fp32 amp
    python -m benchmarks.run --models alexnet_cifar vgg16_cifar --config paper --data synthetic --device auto

Per model (and per eager or compiled pass) the modes take turns (:func:`benchmarks.harness.run_modes`): each is
prepared (compfx searches), then for every batch each mode trains one step on it, timed on its own, in an order
that rotates each batch. Trained one after the other, drift of a shared machine between the modes (compfx's
epoch always came last, after its search) would read as a difference between them; taking turns, it hits them
alike, and each row's ``time_vs_fp32`` gives its per-batch step ratio to FP32 with a 95% interval.

Writes ``benchmarks/results/<device-name>/<config>-<data>[-compile].json`` and ``.md``
and prints the markdown table. compfx mode needs ``compfx.optimize``; while it is
missing, its rows say "not available" and the rest still run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from compfx.vocabulary import dtype_name

from .harness import RunOptions, default_low_dtype, options_dict, resolve_device, run_modes
from .models import MODELS, get_spec
from .modes import MODES, compfx_status
from .report import attach_paper_figures, device_name, markdown_table, plot_results, write_results

__all__ = ["main", "parse_args", "run_all", "TIMING"]

_DEFAULT_OUT = Path(__file__).resolve().parent / "results"
#: how the rows' times were taken, for the results' meta
TIMING = "modes in turns: one step each per batch, the order rotating each batch, each step timed on its own"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["all"], help=f"'all' or some of: {', '.join(MODELS)}")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--config", default="small", help="config size: small or paper")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1 ...")
    parser.add_argument("--low-dtype", default="auto", choices=["auto", "fp16", "bf16"],
                        help="AMP/compfx low precision; auto = fp16 on CUDA, bf16 on CPU")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batches", type=int, default=10, help="batches per epoch (GNNs: one full-graph batch)")
    parser.add_argument("--data", default="real", choices=["real", "synthetic"],
                        help="real: packaged datasets (accuracy); synthetic: random tensors at the config's shapes")
    parser.add_argument("--compile", action="store_true", help="also run every mode under torch.compile")
    parser.add_argument("--no-casts", action="store_true", help="skip cast counting (tracing paper-size models)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stage1-budget", type=int, help="compfx SearchConfig.stage1_budget (default: compfx's)")
    parser.add_argument("--stage2-budget", type=int, help="compfx SearchConfig.stage2_budget (default: compfx's)")
    parser.add_argument("--search-repeats", type=int, help="compfx SearchConfig.repeats (default: compfx's)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall time, or process CPU time (--device cpu --threads 1 only): other jobs on a shared "
                             "machine do not inflate it")
    parser.add_argument("--out", default=str(_DEFAULT_OUT), help="results root (a device folder is made inside)")
    parser.add_argument("--plot", action="store_true", help="also save a time/memory plot (needs matplotlib)")
    args = parser.parse_args(argv)
    args.models = list(MODELS) if args.models == ["all"] else args.models
    for name in args.models:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        if args.config not in get_spec(name).configs:
            parser.error(f"model {name!r} has no config {args.config!r}; it has {sorted(get_spec(name).configs)}")
    return args


def _search_overrides(args: argparse.Namespace) -> dict:
    return {"stage1_budget": args.stage1_budget, "stage2_budget": args.stage2_budget, "repeats": args.search_repeats}


def _options(args: argparse.Namespace, compiled: bool) -> RunOptions:
    return RunOptions(device=args.device, low_dtype=args.low_dtype, epochs=args.epochs, batches=args.batches,
                      data=args.data, compile=compiled, seed=args.seed, count_casts=not args.no_casts,
                      search=_search_overrides(args), clock=args.clock, threads=args.threads)


def run_all(args: argparse.Namespace, log=print) -> list[dict]:
    """Every (model, mode, eager/compiled) row, in that order; a model's modes take turns (:func:`run_modes`)."""
    rows = []
    for compiled in ([False, True] if args.compile else [False]):
        options = _options(args, compiled)
        for name in args.models:
            for row in run_modes(get_spec(name), args.config, args.modes, options):
                log(f"{name:16s} {row['mode'] + ('+compile' if compiled else ''):16s} {row['status']:10s} "
                    f"{row.get('time_per_epoch_s', float('nan')):.4f} s/epoch", file=sys.stderr)
                rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    rows = [attach_paper_figures(row) for row in run_all(args)]
    meta = {
        "device": str(device), "device_name": device_name(device), "torch": torch.__version__,
        "config": args.config, "data": args.data, "epochs": args.epochs, "batches": args.batches,
        "low_dtype": dtype_name(default_low_dtype(device, args.low_dtype)),
        "compfx": compfx_status(), "argv": sys.argv[1:] if argv is None else list(argv),
        "options": options_dict(_options(args, args.compile)),
        "threads": torch.get_num_threads(), "timing": TIMING,
    }
    stem = f"{args.config}-{args.data}" + ("-compile" if args.compile else "")
    paths = write_results(rows, meta, args.out, stem)
    print(markdown_table(rows))
    print(f"\nwrote {paths['json']} and {paths['markdown']}")
    if args.plot:
        plot = plot_results(rows, paths["json"].with_suffix(".png"))
        print(f"wrote {plot}" if plot else "no plot: matplotlib is not installed (pip install -e '.[bench]')")
    return 0 if all(row["status"] in ("ok",) or row["status"].startswith("not available") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
