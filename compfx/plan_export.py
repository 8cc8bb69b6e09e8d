"""A plan's FP8 linears, exported to the FP8 runtimes people already train with: torchao, torchtitan, accelerate.

compfx runs a whole plan with its own rewriter (:func:`compfx.apply`): every op
at its own precision. torchao's ``convert_to_float8_training``, torchtitan's
float8 converter and accelerate's ``mixed_precision="fp8"`` (which calls
torchao) do one thing: they swap ``nn.Linear`` modules for torchao's
``Float8Linear``. What they take from a plan is therefore which linears run
FP8, and one recipe:

* :func:`torchao_filter`: ``module_filter_fn(module, fqn)`` for
  ``convert_to_float8_training``, and accelerate's
  ``AORecipeKwargs(module_filter_func=...)``
  (:mod:`compfx.integrations.accelerate` builds those);
* :func:`torchtitan_float8`: torchtitan's float8 config fields, its
  ``filter_fqns`` exclude list included.

What these targets cannot express, and each export says (``not_expressed``):

* FP8 on an op that is not an ``nn.Linear`` module's call (a ``matmul`` with a
  weight, ``F.linear`` in a module's own forward): they swap modules, not ops;
* a linear module called more than once with FP8 on some calls only: the
  module is converted whole;
* the plan's other choices (low, FP32 or follow per op): everything they do not
  convert runs in one precision of theirs (autocast, FSDP's parameter dtype);
* a recipe per op: one ``Float8LinearConfig`` per conversion (a compfx plan
  holds one recipe too, ``plan.fp8_recipe``).

FP8 ops of the first two kinds make an export fail (:class:`~compfx.errors.PlanExportError`)
unless ``strict=False``; the third is only said. compfx's own rewriter stays the
way to run the whole plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch.nn as nn

from .errors import PlanExportError
from .opkey import OpKey
from .vocabulary import Float8Recipe, Precision

__all__ = ["TorchaoFilter", "torchao_filter", "TorchtitanFloat8", "torchtitan_float8", "float8_linear_fqns"]


def float8_linear_fqns(entries: Mapping[OpKey, Precision]) -> tuple[frozenset[str], list[str], list[str]]:
    """The module paths of the linears a plan runs FP8, the FP8 ops torchao's conversion cannot take (why, each),
    and what else of the plan it leaves out (notes)."""
    by_module: dict[str, list[tuple[OpKey, Precision]]] = {}
    for key, precision in entries.items():
        if key.kind == "linear":
            by_module.setdefault(key.module, []).append((key, precision))
    fqns, refused = set(), []
    for module, calls in by_module.items():
        fp8 = [key for key, precision in calls if precision is Precision.FP8]
        if fp8 and len(fp8) < len(calls):
            others = [f"{key} ({precision})" for key, precision in calls if precision is not Precision.FP8]
            refused.append(f"{fp8[0]} runs FP8 but {', '.join(others[:2])} of the same module does not: the module "
                           "converts whole")
        elif fp8:
            fqns.add(module)
    refused += [f"{key} is a {key.kind}, not an nn.Linear module's call: torchao converts modules"
                for key, precision in entries.items() if precision is Precision.FP8 and key.kind != "linear"]
    others = sum(precision is not Precision.FP8 for precision in entries.values())
    notes = [f"the plan's other {others} op(s) (low, fp32, follow) stay compfx's: the target runs them in one "
             "precision of its own"] if others else []
    return frozenset(fqns), refused, notes


def _raise_or_note(refused: list[str], notes: list[str], strict: bool, target: str) -> tuple[str, ...]:
    if refused and strict:
        raise PlanExportError(f"{target} cannot express {len(refused)} FP8 choice(s) of this plan: "
                              f"{'; '.join(refused[:3])}. Run the plan with compfx.apply (its own rewriter runs every "
                              "op at its precision), or export with strict=False to leave them out.")
    return tuple(refused + notes)


class TorchaoFilter:
    """torchao's ``module_filter_fn(module, fqn)``: True for exactly the ``nn.Linear`` modules (by FQN, relative to
    the model the plan was made for) that the plan runs in FP8.

    ``fqns`` are those modules, ``recipe`` the plan's FP8 recipe (the
    ``Float8LinearConfig`` to convert with: :func:`compfx.float8.float8_config`),
    ``not_expressed`` what of the plan torchao's conversion leaves out.

    >>> from compfx.vocabulary import Precision
    >>> plan = {OpKey("mlp.fc", "linear", 0): Precision.FP8, OpKey("head", "linear", 0): Precision.FP32}
    >>> keep = torchao_filter(plan, "tensorwise")
    >>> keep(nn.Linear(32, 32), "mlp.fc"), keep(nn.Linear(32, 32), "head"), sorted(keep.fqns)
    (True, False, ['mlp.fc'])
    """

    def __init__(self, fqns: frozenset[str], recipe: Float8Recipe | None, not_expressed: tuple[str, ...]):
        self.fqns, self.recipe, self.not_expressed = fqns, recipe, not_expressed

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fqn in self.fqns

    def check(self, model: nn.Module) -> None:
        """Refuse, before converting ``model``, FP8 modules that are not ``nn.Linear`` s of it (another model's
        plan, or a module whose linear torchao cannot swap)."""
        modules = dict(model.named_modules())
        missing = sorted(fqn for fqn in self.fqns if not isinstance(modules.get(fqn), nn.Linear))
        if missing:
            raise PlanExportError(f"the plan runs {missing[:3]} in FP8, but {type(model).__name__} has no nn.Linear "
                                  "there; torchao's conversion would leave them as they are. Export the plan made "
                                  "for this model, or run it with compfx.apply.")

    def __repr__(self) -> str:
        return f"TorchaoFilter({len(self.fqns)} linear(s) in FP8, recipe={self.recipe})"


def torchao_filter(entries: Mapping[OpKey, Precision], recipe: Float8Recipe | str | None = None, *,
                   strict: bool = True) -> TorchaoFilter:
    """The ``module_filter_fn`` for ``torchao.float8.convert_to_float8_training`` that converts exactly the
    plan's FP8 linears (what :meth:`compfx.Plan.torchao_filter` returns); see the module docstring for what it
    cannot express, refused unless ``strict`` is False."""
    fqns, refused, notes = float8_linear_fqns(entries)
    not_expressed = _raise_or_note(refused, notes, strict, "torchao's convert_to_float8_training")
    recipe = Float8Recipe.parse(recipe, "fp8_recipe") if recipe is not None and fqns else None
    return TorchaoFilter(fqns, recipe, not_expressed)


@dataclass(frozen=True)
class TorchtitanFloat8:
    """torchtitan's float8 converter settings for a plan: ``recipe_name`` and ``filter_fqns`` (its exclude list:
    a linear whose FQN contains one of them as a substring stays as it is; one with a dim not a multiple of 16
    is skipped by torchtitan anyway), and what the plan asks that torchtitan cannot express."""

    recipe_name: str
    filter_fqns: tuple[str, ...]
    not_expressed: tuple[str, ...] = ()

    def toml(self) -> str:
        """The fields as a torchtitan TOML job config holds them (its ``quantize.linear.float8`` converter)."""
        names = ", ".join(f'"{name}"' for name in self.filter_fqns)
        return ('[model]\nconverters = ["quantize.linear.float8"]\n\n[quantize.linear.float8]\n'
                f'recipe_name = "{self.recipe_name}"\nfilter_fqns = [{names}]\n')


#: torchtitan's float8 filter skips a linear with a weight dim that is not a multiple of this (its own copy of the
#: float8 GEMMs' alignment rule, :data:`compfx.float8.FP8_MULTIPLE`; this module mirrors torchtitan's code)
_TORCHTITAN_MULTIPLE = 16


def _torchtitan_converts(fqn: str, module: nn.Module, filter_fqns) -> bool:
    """torchtitan's float8 ``module_filter_fn``: an ``nn.Linear`` with both weight dims multiples of 16 whose FQN
    contains none of ``filter_fqns``."""
    return (isinstance(module, nn.Linear) and all(d % _TORCHTITAN_MULTIPLE == 0 for d in module.weight.shape)
            and not any(name in fqn for name in filter_fqns))


def torchtitan_float8(entries: Mapping[OpKey, Precision], recipe: Float8Recipe | str | None, model: nn.Module, *,
                      strict: bool = True) -> TorchtitanFloat8:
    """torchtitan's float8 settings that convert exactly the plan's FP8 linears of ``model``.

    torchtitan converts every eligible linear except those its
    ``filter_fqns`` name, by substring; the list is made short (shared name
    endings such as ``"attn.proj"`` stand for every block's) and checked against
    every linear of ``model``. A linear it cannot leave out without leaving out
    an FP8 one too (its FQN inside theirs) is a :class:`~compfx.errors.PlanExportError`.

    >>> from compfx.vocabulary import Precision
    >>> model = nn.ModuleDict({"fc": nn.Linear(32, 32), "proj": nn.Linear(32, 32)})
    >>> torchtitan_float8({OpKey("fc", "linear", 0): Precision.FP8, OpKey("proj", "linear", 0): Precision.LOW},
    ...                   "rowwise", model, strict=False).filter_fqns
    ('proj',)
    """
    fqns, refused, notes = float8_linear_fqns(entries)
    not_expressed = _raise_or_note(refused, notes, strict, "torchtitan's float8 converter")
    TorchaoFilter(fqns, None, ()).check(model)
    linears = {fqn: m for fqn, m in model.named_modules() if _torchtitan_converts(fqn, m, ())}
    excluded = [fqn for fqn in linears if fqn not in fqns]
    names = _exclusions(excluded, [fqn for fqn in linears if fqn in fqns])
    converts = {fqn for fqn, m in linears.items() if _torchtitan_converts(fqn, m, names)}
    if converts != set(fqns):
        raise PlanExportError(f"torchtitan's filter_fqns match by substring, so it cannot convert exactly this plan's "
                              f"FP8 linears (it would get {sorted(converts ^ set(fqns))[:3]} wrong: each name is "
                              "inside another's); convert with compfx.plan_export.torchao_filter instead (it matches "
                              "names exactly).")
    recipe = Float8Recipe.parse(recipe or Float8Recipe.TENSORWISE, "fp8_recipe")
    return TorchtitanFloat8(str(recipe), tuple(names), not_expressed)


def _exclusions(excluded: list[str], kept: list[str]) -> list[str]:
    """Few strings such that every FQN of ``excluded`` contains one and no FQN of ``kept`` does: the dotted name
    endings of the excluded (``attn.proj`` for every block's), chosen greedily by how many they cover."""
    candidates = {}
    for fqn in excluded:
        parts = fqn.split(".")
        for start in range(len(parts)):
            name = ".".join(parts[start:])
            if name not in candidates and not any(name in other for other in kept):
                candidates[name] = {f for f in excluded if name in f}
    chosen, left = [], set(excluded)
    while left:
        usable = [name for name in candidates if candidates[name] & left]
        if not usable:
            break  # an FQN contained in a kept one: the caller finds it converted and refuses
        best = max(usable, key=lambda name: (len(candidates[name] & left), len(name)))
        chosen.append(best)
        left -= candidates[best]
    return sorted(chosen)
