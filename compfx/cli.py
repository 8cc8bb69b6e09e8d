"""Command line: ``python -m compfx analyze|search|report|plan show|demo ...``.

Every mistake on the command line ends with one ``compfx: error: ...`` line
(or argparse's usage message) and exit code 2, never a traceback, and is
found before any work: numbers are checked where they are parsed (an input
shape too large to allocate, ``--classes 0``, a negative ``--lr``, a seed
``torch.manual_seed`` does not take, an impossible ``--capability``), output
paths before the search starts, and a factory that raises, or calls
``sys.exit``, is reported as the factory's failure.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .graph_capture import normalize_example_inputs
from .errors import BadInputError, CompfxError
from .state import torch_rng_preserved
from .vocabulary import dtype_name

__all__ = ["main"]


_LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}  # --low-dtype
#: Most elements of one --input-shape tensor: 2**31 float32s are 8 GiB, and many kernels index with 32 bits.
MAX_INPUT_ELEMENTS = 1 << 31
#: The seeds torch.manual_seed (and torch.Generator) accept.
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


def _import_user_module(name: str):
    """Import the user's module (``mymodels`` of ``mymodels:gpt``) from the current folder too, as
    ``python -m compfx`` does: the installed ``compfx`` command's path starts at its own folder instead."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def _load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise BadInputError(f"model spec {spec!r} needs the form MODULE:FACTORY, e.g. compfx.examples:mlp")
    try:
        factory = getattr(_import_user_module(module_name), attr)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - ImportError, AttributeError, the module's own import
        raise BadInputError(f"could not load {spec!r}: {_one_line(error)}") from error
    if not callable(factory):
        raise BadInputError(f"{spec!r} is a {type(factory).__name__}, not a factory; expected a function or class "
                            "that takes no arguments and returns an nn.Module, e.g. compfx.examples:cnn.")
    return factory


def _build_model(spec: str) -> nn.Module:
    factory = _load_factory(spec)
    try:
        model = factory()
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's factory (sys.exit() included)
        raise BadInputError(f"{spec}() failed ({_one_line(error)}); expected a factory that takes no "
                            "arguments and returns an nn.Module.") from error
    if not isinstance(model, nn.Module):
        raise BadInputError(f"{spec}() returned a {type(model).__name__}, not an nn.Module; expected a factory that "
                            "returns the model, e.g. compfx.examples:cnn.")
    return model


# -- --inputs: the model's example inputs, from the user's function ------------------------

def _add_input_options(parser: argparse.ArgumentParser, *, required: bool, when: str = "") -> None:
    """``--input-shape`` (random float tensors) or ``--inputs`` (the user's function), one of them."""
    given = parser.add_mutually_exclusive_group(required=required)
    given.add_argument("--input-shape", type=_shape, action="append", default=None,
                       help=f"{when}shape of one positional input, e.g. 8,3,32,32 (repeat for several inputs): random "
                            "float tensors; --inputs for token ids or keyword inputs")
    given.add_argument("--inputs", metavar="MODULE:FUNCTION", default=None,
                       help=f"{when}a function returning the model's example inputs: a tensor, a tuple of positional "
                            "inputs, or a dict of keyword arguments (a token model's input_ids, ...)")


def _one_line(error: BaseException) -> str:
    """What went wrong, on one line (the user's exception text may span several)."""
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r})"
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _inputs_function(spec: str):
    """The function ``--inputs MODULE:FUNCTION`` names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise BadInputError(f"--inputs {spec!r}; expected MODULE:FUNCTION, a function that takes no arguments and "
                            "returns the model's inputs, e.g. --inputs mymodels:example_inputs.")
    try:
        function = getattr(_import_user_module(module_name), attr)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - ImportError, AttributeError, the module's own import
        raise BadInputError(f"--inputs {spec}: could not load it ({_one_line(error)}).") from error
    if not callable(function):
        raise BadInputError(f"--inputs {spec} is not a function (its type is {type(function).__name__}); expected a "
                            "function that takes no arguments and returns the model's inputs.")
    return function


def _call_inputs_function(spec: str, function):
    """``function()``, checked to be what ``compfx.analyze`` takes as example inputs."""
    try:
        inputs = function()
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's function
        raise BadInputError(f"--inputs {spec}() failed ({_one_line(error)}); expected a function that takes no "
                            "arguments and returns the model's inputs.") from error
    valid = (isinstance(inputs, torch.Tensor) or (isinstance(inputs, (tuple, list)) and len(inputs) > 0)
             or (isinstance(inputs, dict) and len(inputs) > 0 and all(isinstance(k, str) for k in inputs)))
    if not valid:
        raise BadInputError(f"--inputs {spec}() returned {_describe(inputs)}; expected the model's inputs: a "
                            "tensor, a tuple of positional inputs, or a dict of keyword arguments (string keys).")
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves(inputs)):
        raise BadInputError(f"--inputs {spec}() returned tensors on the meta device (shapes, no values); compfx runs "
                            "the model on its inputs. Return real tensors (e.g. torch.randint(...) on the CPU).")
    return inputs


def _describe(value) -> str:
    if isinstance(value, (tuple, list, dict)) and not value:
        return f"an empty {type(value).__name__}"
    if isinstance(value, dict):
        return "a dict with non-string keys"
    return f"a {type(value).__name__}"


def _example_inputs(args, seed: int = 0):
    """The model's inputs: ``--inputs``' function's (torch seeded with ``seed`` for it), else random float tensors
    of each ``--input-shape``."""
    if args.inputs is None:
        generator = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(*shape, generator=generator) for shape in args.input_shape)
    function = _inputs_function(args.inputs)
    with torch_rng_preserved():
        torch.manual_seed(seed)
        return _call_inputs_function(args.inputs, function)


def _batch_of(inputs):
    """A batch that :func:`~compfx.batches.split_batch` reads back as exactly ``inputs`` (a tuple batch's
    last item is its target, so positional inputs get an empty one)."""
    args, kwargs = normalize_example_inputs(inputs)
    if args and kwargs:
        raise BadInputError("--inputs gave positional and keyword inputs; diagnose runs one batch, which holds "
                            "either: return a dict of keyword arguments, or a tuple of positional inputs.")
    return dict(kwargs) if kwargs else (*args, None)


def _search_batches(args) -> list:
    """``search --inputs``: the function called ``--batches`` times, torch seeded with ``--seed + i`` before call
    ``i`` (a function that draws random tokens gives different batches, the same in every run)."""
    function = _inputs_function(args.inputs)
    batches = []
    with torch_rng_preserved():
        for i in range(args.batches):
            torch.manual_seed(args.seed + i)
            batch = _call_inputs_function(args.inputs, function)
            if isinstance(batch, (tuple, list)) and len(batch) > 1:
                raise BadInputError(f"search --inputs {args.inputs}() returned a tuple of {len(batch)} inputs, but a "
                                    "search reads a tuple batch as (inputs..., target); return a dict of keyword "
                                    "arguments (with the labels, for a model that returns its own .loss), or give "
                                    "(inputs..., target) batches with --data MODULE:FACTORY.")
            batches.append(batch)
    return batches


def _check_search_data(args) -> None:
    """Exactly one source of batches; the named losses need a target, which --inputs batches have not."""
    given = [flag for flag, value in (("--data", args.data), ("--inputs", args.inputs),
                                      ("--input-shape", args.input_shape)) if value is not None]
    if len(given) != 1:
        what = {0: "no batches to search on", 2: f"got {' and '.join(given)}, not both"}.get(
            len(given), f"got {', '.join(given)}")
        raise BadInputError(f"{what}; give one of --data MODULE:FACTORY (your batches), --inputs MODULE:FUNCTION "
                            "(the model's inputs, for a model that returns its own loss) or --input-shape S "
                            "--classes C (synthetic classification batches).")
    if args.input_shape is not None and args.batches * math.prod(args.input_shape) > MAX_INPUT_ELEMENTS:
        raise BadInputError(f"--batches {args.batches} of --input-shape {','.join(map(str, args.input_shape))} are "
                            f"{args.batches * math.prod(args.input_shape):,} elements, more than the "
                            f"{MAX_INPUT_ELEMENTS:,} the synthetic batches may hold; give fewer or smaller batches.")
    if args.inputs is not None and args.loss in _NAMED_LOSSES:
        raise BadInputError(f"--loss {args.loss} takes the target from an (inputs, target) batch, and --inputs gives "
                            "the model's inputs only; use --loss model (the output's .loss) or --loss "
                            "MODULE:FUNCTION(output, batch), or give (inputs, target) batches with --data.")


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 8,3,32,32") from error
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 8,3,32,32 (positive sizes)")
    if math.prod(shape) > MAX_INPUT_ELEMENTS:  # checked before anything is allocated
        raise argparse.ArgumentTypeError(f"{text!r} has {math.prod(shape):,} elements, more than the {MAX_INPUT_ELEMENTS:,} "
                                         "an example input may have; give the shape of one real batch, e.g. 8,3,32,32")
    return shape


def _capability(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(d) for d in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability like 8,0 (major,minor)") from error
    if not (1 <= major <= 20 and 0 <= minor <= 9):  # CUDA's run from 1.0; 12.x is the newest today
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability like 8,0 (major 1-20, minor 0-9)")
    return major, minor


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from error


def _positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number (1 or more)")
    return value


#: The most batches ``search --batches`` makes: every Stage-1 sample trains one epoch of them, and they are all
#: made (and held) before the search starts.
MAX_BATCHES = 10_000


def _batch_count(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_BATCHES:
        raise argparse.ArgumentTypeError(f"{text!r} batches: more than the {MAX_BATCHES:,} a search's synthetic epoch "
                                         "may have (each Stage-1 sample trains one epoch of them); give a few "
                                         "batches, e.g. 8, or your loader with --data")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from error
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive finite number, e.g. 0.01")
    return value


def _seed(text: str) -> int:
    value = _whole_number(text)
    if not _SEED_RANGE[0] <= value <= _SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is outside what torch.manual_seed takes "
                                         f"([{_SEED_RANGE[0]}, {_SEED_RANGE[1]}])")
    return value


def _cmd_analyze(args) -> int:
    from .analysis import analyze

    model = _build_model(args.model)
    inputs = _example_inputs(args)
    low_dtype = _LOW_DTYPES[args.low_dtype]
    analysis = analyze(model, inputs, device=args.device, low_dtype=low_dtype, capability=args.capability)
    print(analysis.table())
    print(analysis.summary())
    return 0


# -- search, report, plan show -------------------------------------------------------

#: losses ``--loss`` names: torch.nn.functional's, with the batch's last item as the target
_NAMED_LOSSES = ("cross_entropy", "nll_loss", "mse_loss")


def _loss_fn(spec: str | None, synthetic: bool):
    """``--loss``: a named loss, ``model`` (the output's own ``.loss``) or MODULE:FUNCTION(output, batch)."""
    spec = spec or ("cross_entropy" if synthetic else "model")
    if spec == "model":
        return None
    if spec in _NAMED_LOSSES:
        function = getattr(torch.nn.functional, spec)
        return lambda output, batch: function(output, batch[-1])
    if ":" not in spec:
        raise BadInputError(f"--loss {spec!r}; expected one of {', '.join(_NAMED_LOSSES)}, model (the output's own "
                            ".loss), or MODULE:FUNCTION taking (output, batch).")
    return _load_factory(spec)


def _sample_loader(args):
    """The batches to search on: the ``--data`` factory's, ``--inputs``' or ``--batches`` synthetic ones."""
    if args.inputs is not None:
        return _search_batches(args)
    if args.data is None:
        generator = torch.Generator().manual_seed(args.seed)
        return [(torch.randn(*args.input_shape, generator=generator),
                 torch.randint(0, args.classes, (args.input_shape[0],), generator=generator))
                for _ in range(args.batches)]
    factory = _load_factory(args.data)
    try:
        return factory()
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's factory (sys.exit() included)
        raise BadInputError(f"{args.data}() failed ({_one_line(error)}); expected a factory that takes "
                            "no arguments and returns the batches (a list or a DataLoader).") from error


def _check_output_paths(args) -> None:
    """Refuse, before the search (which may take minutes), a --log or --plan it could not write at the end."""
    from .files import check_writable
    from .plan_file import is_plan_file
    from .search.log import SearchLog

    SearchLog.check_path(args.log)
    if args.plan is not None:
        if args.log is not None and _same_file(args.plan, args.log):
            raise BadInputError(f"--plan {args.plan} and --log {args.log} name the same file: the plan written at the "
                                "end would replace the search's log. Pass two paths, e.g. --log search.jsonl "
                                "--plan plan.json.")
        check_writable(args.plan, "plan file", replaces=is_plan_file, hint="Pass another --plan.")


def _same_file(a: str, b: str) -> bool:
    """Do two paths name one file (the same path spelled otherwise, or a link to it), existing or not?"""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _cmd_search(args) -> int:
    from .optimization import optimize
    from .search.config import SearchConfig

    _check_search_data(args)
    if args.input_shape is not None and args.classes is None:
        raise BadInputError("--input-shape needs --classes C: synthetic batches are (inputs, class index) pairs.")
    config = SearchConfig(threshold=args.threshold, seed=args.seed, progress=not args.no_progress)  # checks them
    _check_output_paths(args)
    model = _build_model(args.model)
    loss_fn = _loss_fn(args.loss, synthetic=args.input_shape is not None)
    loader = _sample_loader(args)
    optimizer = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[args.optimizer](model.parameters(), lr=args.lr)
    result = optimize(model, loader, optimizer=optimizer, loss_fn=loss_fn, low_dtype=_LOW_DTYPES[args.low_dtype],
                      config=config, log=args.log)
    print(result.report())
    if args.plan is not None:
        result.plan.save(args.plan)
        print(f"plan written to {args.plan}")
    if args.log is not None:
        print(f"search log written to {args.log} (compfx report {args.log} prints this report again)")
    return 0


def _cmd_report(args) -> int:
    from .report import render_log_report

    print(render_log_report(args.log))
    return 0


def _plan_to_show(args):
    """The plan file ``compfx plan show`` prints, and the model's analysis with ``--model`` (a file of rules alone
    becomes that model's plan)."""
    from .analysis import analyze
    from .files import checked_path, read_json
    from .plan import MAX_PLAN_BYTES, Plan

    data = read_json(checked_path(args.plan, "plan file"), "plan file", max_bytes=MAX_PLAN_BYTES)
    source = f"plan file {args.plan}"
    if args.model is None:
        return Plan.from_dict(data, source), None
    if not args.input_shape and args.inputs is None:
        raise BadInputError("--model needs --input-shape or --inputs (the model is captured on those inputs to "
                            "check the plan against it), e.g. --input-shape 8,1,8,8.")
    low = data.get("low_dtype") if isinstance(data, dict) else None  # the model is analysed for the plan's low dtype
    low_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(low)
    analysis = analyze(_build_model(args.model), _example_inputs(args), low_dtype=low_dtype)
    plan = Plan.from_dict(data, source, analysis=analysis)
    plan.validate(analysis)  # a PlanMismatchError says how the plan and the model differ
    return plan, analysis


def _cmd_plan_show(args) -> int:
    from tabulate import tabulate

    from .plan_rules import rules_table

    plan, analysis = _plan_to_show(args)
    counts = ", ".join(f"{sum(p == precision for p in plan.values())} {precision}"
                       for precision in sorted({str(p) for p in plan.values()}))
    print(f"plan file      {args.plan}\nlow dtype      {dtype_name(plan.low_dtype)}\n"
          f"fingerprint    {plan.fingerprint}\nops            {len(plan)} ({counts})\n")
    rules = plan.rules()
    print(f"as {len(rules)} rule(s) (the highest level that selects an op decides it: global < kind < module < "
          f"module+kind < module+kind+index < op key)\n{rules_table(tuple(plan), rules)}\n")
    if analysis is None:
        print(tabulate([[i, str(key), precision] for i, (key, precision) in enumerate(plan.items())],
                       headers=["#", "op key", "precision"]))
    else:
        print(analysis.table(precisions=plan))
        print(f"\nthe plan matches {args.model}; CoMP string {plan.bitstring(analysis)} ('0' "
              f"{dtype_name(plan.low_dtype)}, '1' fp32, 'f' follow)")
    return 0


def _add_search_parsers(sub) -> None:
    p = sub.add_parser("search", help="search a precision plan for a model (compfx.optimize) and print its report")
    p.add_argument("model", help="MODULE:FACTORY returning an nn.Module, e.g. compfx.examples:cnn")
    p.add_argument("--data", metavar="LOADER_FACTORY", default=None,
                   help="MODULE:FACTORY returning the batches to search on (a list of batches or a DataLoader)")
    p.add_argument("--input-shape", type=_shape, default=None,
                   help="synthetic data instead of --data: the input batch's shape, e.g. 32,1,8,8")
    p.add_argument("--inputs", metavar="MODULE:FUNCTION", default=None,
                   help="instead of --data: a function returning one batch of the model's inputs, as for analyze: a "
                        "dict of keyword arguments (a token model's input_ids and labels, so that it returns its "
                        "own .loss) or a tensor; called --batches times, torch seeded with --seed + i before call i; "
                        "the loss is the output's .loss, or --loss MODULE:FUNCTION(output, batch)")
    p.add_argument("--classes", type=_positive_int, default=None, help="synthetic data: number of classes of the targets")
    p.add_argument("--batches", type=_batch_count, default=8,
                   help="synthetic data or --inputs: number of batches (default 8)")
    p.add_argument("--loss", default=None,
                   help=f"{', '.join(_NAMED_LOSSES)}, model (the output's .loss) or MODULE:FUNCTION(output, batch); "
                        "default cross_entropy for synthetic data, model with --data or --inputs")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--lr", type=_positive_float, default=0.01)
    p.add_argument("--low-dtype", choices=["fp16", "bf16"], default=None)
    p.add_argument("--threshold", type=float, default=1.01, help="loss guard: x FP32's loss (default 1.01)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--log", default=None, help="write the search log (JSON Lines) here, for compfx report")
    p.add_argument("--plan", default=None, help="write the chosen plan (JSON) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_search)
    p = sub.add_parser("report", help="print the report of a finished search from its log")
    p.add_argument("log", help="the search log, e.g. written by compfx search --log F or optimize(log=F)")
    p.set_defaults(func=_cmd_report)
    p = sub.add_parser("plan", help="plan files")
    show = p.add_subparsers(dest="plan_command", required=True).add_parser(
        "show", help="print a plan file (with --model: against the model's analysis)")
    show.add_argument("plan", help="a plan file, e.g. written by compfx search --plan F or Plan.save")
    show.add_argument("--model", default=None, help="MODULE:FACTORY: check the plan against this model")
    _add_input_options(show, required=False, when="with --model: ")
    show.set_defaults(func=_cmd_plan_show)


def _cmd_diagnose(args) -> int:
    from .diagnosis import diagnose
    from .plan import Plan

    model = _build_model(args.model)
    plan = Plan.load(args.plan) if args.plan else None
    inputs = _example_inputs(args, args.seed)
    low_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}[args.low_dtype]
    print(diagnose(model, _batch_of(inputs), plan=plan, low_dtype=low_dtype))
    return 0


def _add_diagnose_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="per-op overflow, underflow and error of a plan against FP32, on random inputs")
    p.add_argument("model", help="MODULE:FACTORY returning an nn.Module, e.g. compfx.examples:cnn")
    _add_input_options(p, required=True)
    p.add_argument("--plan", default=None, help="a plan file (default: what autocast does, Plan.amp)")
    p.add_argument("--low-dtype", choices=["fp16", "bf16"], default=None, help="without --plan (default: the device's)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs (torch's, for --inputs)")
    p.set_defaults(func=_cmd_diagnose)


def _cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compfx", description="Convergence-aware operator-wise mixed precision.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("analyze", help="classify each op of a model and check Tensor Core eligibility")
    p.add_argument("model", help="MODULE:FACTORY returning an nn.Module, e.g. compfx.examples:cnn")
    _add_input_options(p, required=True)
    p.add_argument("--device", default=None, help="target device (default: the model's)")
    p.add_argument("--low-dtype", choices=["fp16", "bf16"], default=None)
    p.add_argument("--capability", type=_capability, default=None,
                   help="CUDA compute capability to assume, e.g. 8,0")
    p.set_defaults(func=_cmd_analyze)
    _add_search_parsers(sub)
    _add_diagnose_parser(sub)
    p = sub.add_parser("demo", help="run compfx on the built-in example (a CNN on scikit-learn digits)")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CompfxError as error:
        print(f"compfx: error: {' '.join(str(error).split())}", file=sys.stderr)  # one line, whatever it quotes
        return 2
