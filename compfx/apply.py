"""Final stage: turn a model and a :class:`~compfx.plan.Plan` into a mixed-precision GraphModule.

The result is an ordinary ``torch.fx.GraphModule`` that shares the model's
``nn.Parameter`` and buffer objects (they stay FP32: master weights), so an
optimizer built on ``model.parameters()`` keeps working, and whose
``state_dict()`` has the same keys and dtypes as the model's, so checkpoints
load into either.
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch.fx as fx
import torch.nn as nn

from .analyze import Analysis, analyze
from .errors import BadInputError, PlanMismatchError
from .passes import apply_precisions
from .plan import Plan
from .vocabulary import dtype_name

__all__ = ["apply"]


def apply(
    model: nn.Module,
    plan: Plan,
    example_inputs=None,
    *,
    analysis: Analysis | None = None,
    restore_output_dtypes: bool = True,
    leaf_modules: Iterable[type | str] = (),
) -> fx.GraphModule:
    """Return ``model`` rewritten to run each op at the precision ``plan`` gives it.

    Give either ``example_inputs`` (the model is captured and analysed) or the
    ``analysis`` the plan was made from (its graph is copied, never changed).
    The plan is validated first, so a plan for another model (other keys, another
    fingerprint or another low dtype than the analysis) raises
    :class:`~compfx.errors.PlanMismatchError` and nothing is applied. Outputs
    come back in the dtypes the model returns unless ``restore_output_dtypes``
    is False. Like the capture, the graph is specialised to the model's
    train/eval mode at capture time.

    >>> import torch, compfx
    >>> from compfx.apply import apply
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> gm = apply(model, compfx.Plan.from_bitstring(a, "0f1"), analysis=a)
    >>> gm(torch.randn(3, 4)).dtype, gm.get_parameter("0.weight") is model[0].weight
    (torch.float32, True)
    """
    if not isinstance(model, nn.Module):
        raise BadInputError(f"apply() takes an nn.Module; got {type(model).__name__}.")
    if not isinstance(plan, Plan):
        raise BadInputError(f"apply() takes a compfx.Plan; got {type(plan).__name__}. Build one with "
                            "Plan.amp(analysis), Plan.from_bitstring(...) or Plan.load(path).")
    if analysis is None:
        if example_inputs is None:
            raise BadInputError("apply() needs example_inputs to capture the model, or analysis=<the Analysis "
                                "the plan was made from>.")
        analysis = analyze(model, example_inputs, low_dtype=plan.low_dtype, leaf_modules=leaf_modules)
    plan.validate(analysis)
    if plan.low_dtype != analysis.low_dtype:
        raise PlanMismatchError(
            f"the plan runs 'low' ops in {dtype_name(plan.low_dtype)}, but the analysis was made for "
            f"{dtype_name(analysis.low_dtype)} (its Tensor Core eligibility depends on it); expected the same low "
            f"dtype. Analyse the model with low_dtype=torch.{dtype_name(plan.low_dtype)}, or search again for "
            f"{dtype_name(analysis.low_dtype)}.")
    source = analysis.graph_module
    _check_same_parameters(source, model)
    gm = fx.GraphModule(source, copy.deepcopy(source.graph), class_name=type(model).__name__ + "Mixed")
    categories = {op.key: op.category for op in analysis.ops}
    apply_precisions(gm, plan, low_dtype=plan.low_dtype, categories=categories, restore_outputs=restore_output_dtypes)
    _mirror_state(gm, model)
    gm.train(model.training)
    gm.meta.update(compfx_plan=plan, compfx_capture_method=analysis.capture_method)
    return gm


def _check_same_parameters(source: fx.GraphModule, model: nn.Module) -> None:
    """The analysis must come from this model object, or the result would train another model's weights."""
    own = {id(p) for p in model.parameters()}
    foreign = [name for name, p in source.named_parameters() if id(p) not in own]
    if foreign:
        raise BadInputError(
            f"the analysis was captured from another model object (its parameter {foreign[0]!r} is not one of "
            "this model's). Pass the analysis made from this model, or example_inputs instead of analysis=."
        )


def _mirror_state(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm`` every parameter and buffer of ``model`` under the same names (same objects).

    The graph registers only what it reads; checkpoints need the rest too
    (e.g. BatchNorm's ``num_batches_tracked``). Buffers the graph holds that are
    not in the model's state dict (constants) become non-persistent.
    """
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                _owner(gm, module_name).register_parameter(name, param)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                persistent = name not in module._non_persistent_buffers_set
                _owner(gm, module_name).register_buffer(name, buffer, persistent=persistent)
    model_keys = set(model.state_dict())
    for module_name, module in gm.named_modules(remove_duplicate=False):
        for name in list(module._buffers):
            full = f"{module_name}.{name}" if module_name else name
            if full not in model_keys:
                module._non_persistent_buffers_set.add(name)


def _owner(root: nn.Module, path: str) -> nn.Module:
    """The submodule at ``path``, creating empty containers on the way (as GraphModule does)."""
    module = root
    for part in path.split(".") if path else ():
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module
