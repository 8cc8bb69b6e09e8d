"""Command line: ``python -m compfx analyze|demo ...``.

Every mistake on the command line ends with one ``compfx: error: ...`` line
(or argparse's usage message) and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch
import torch.nn as nn

from .errors import BadInputError, CompfxError

__all__ = ["main"]


def _load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise BadInputError(f"model spec {spec!r} needs the form MODULE:FACTORY, e.g. compfx.examples:mlp")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as error:  # noqa: BLE001 - ImportError, AttributeError, or the module's own import failing
        raise BadInputError(f"could not load {spec!r}: {type(error).__name__}: {error}") from error
    if not callable(factory):
        raise BadInputError(f"{spec!r} is a {type(factory).__name__}, not a factory; expected a function or class "
                            "that takes no arguments and returns an nn.Module, e.g. compfx.examples:cnn.")
    return factory


def _build_model(spec: str) -> nn.Module:
    factory = _load_factory(spec)
    try:
        model = factory()
    except Exception as error:  # noqa: BLE001 - the user's factory
        raise BadInputError(f"{spec}() failed ({type(error).__name__}: {error}); expected a factory that takes no "
                            "arguments and returns an nn.Module.") from error
    if not isinstance(model, nn.Module):
        raise BadInputError(f"{spec}() returned a {type(model).__name__}, not an nn.Module; expected a factory that "
                            "returns the model, e.g. compfx.examples:cnn.")
    return model


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 8,3,32,32") from error
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 8,3,32,32 (positive sizes)")
    return shape


def _capability(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(d) for d in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability like 8,0 (major,minor)") from error
    if major < 0 or minor < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability like 8,0 (major,minor)")
    return major, minor


def _cmd_analyze(args) -> int:
    from .analyze import analyze

    model = _build_model(args.model)
    inputs = tuple(torch.randn(*shape) for shape in args.input_shape)
    low_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}[args.low_dtype]
    analysis = analyze(model, inputs, device=args.device, low_dtype=low_dtype, capability=args.capability)
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
    p.add_argument("--capability", type=_capability, default=None,
                   help="CUDA compute capability to assume, e.g. 8,0")
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
