"""Command line: ``python -m compfx analyze|demo ...``."""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from .errors import CompfxError

__all__ = ["main"]


def _load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise CompfxError(f"model spec {spec!r} needs the form MODULE:FACTORY, e.g. compfx.examples:mlp")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise CompfxError(f"could not load {spec!r}: {error}") from error


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 8,3,32,32") from error


def _cmd_analyze(args) -> int:
    from .analyze import analyze

    model = _load_factory(args.model)()
    inputs = tuple(torch.randn(*shape) for shape in args.input_shape)
    low_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}[args.low_dtype]
    capability = _shape(args.capability) if args.capability else None
    analysis = analyze(model, inputs, device=args.device, low_dtype=low_dtype, capability=capability)
    print(analysis.table())
    print(analysis.summary())
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compfx", description="Convergence-aware operator-wise mixed precision.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("analyze", help="classify each op of a model and check Tensor Core eligibility")
    p.add_argument("model", help="MODULE:FACTORY returning an nn.Module, e.g. compfx.examples:cnn")
    p.add_argument("--input-shape", type=_shape, action="append", required=True,
                   help="shape of one positional input, e.g. 8,3,32,32 (repeat for several inputs)")
    p.add_argument("--device", default=None, help="target device (default: the model's)")
    p.add_argument("--low-dtype", choices=["fp16", "bf16"], default=None)
    p.add_argument("--capability", default=None, help="CUDA compute capability to assume, e.g. 8,0")
    p.set_defaults(func=_cmd_analyze)
    p = sub.add_parser("demo", help="run compfx on the built-in example (a CNN on scikit-learn digits)")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CompfxError as error:
        print(f"compfx: error: {error}", file=sys.stderr)
        return 2
