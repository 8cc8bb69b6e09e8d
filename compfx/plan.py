"""Stage 3 of the pipeline: a precision plan, one :class:`~compfx.vocabulary.Precision` per operator.

Three forms of one plan:

* :class:`Plan`: OpKey -> Precision, for one model (its fingerprint) and one
  low dtype. What ``apply``, the backend and plan files take.
* :class:`Assignment`: one Precision per op of ``analysis.ops``, by position.
  What the search works on: its stages cut the model into segments by position.
* the CoMP plan string, ``str(assignment)``: one character per op ('0' low,
  '1' FP32, 'f' follow, '8' FP8; see :attr:`Precision.code`). A view for logs and
  reports, and :meth:`Plan.from_bitstring`.

A plan with ``fp8`` ops also carries how they scale (``plan.fp8_recipe``, a
:class:`~compfx.vocabulary.Float8Recipe`); its file says so too. A plan built
from an analysis knows the device type it was made for (``plan.device_type``).
A plan a compiled search chose records the ``torch.compile`` settings its
program was measured under (``plan.compile_options``, a
:class:`~compfx.compile_options.CompileOptions`; None: measured eagerly, or
not searched), and its file holds them (``"compile"``, absent in files of
eager searches and of older compfx); :func:`compfx.compile_with_plan` runs
it under them.

**Plan files have one reading** (:meth:`Plan.from_dict`): a key named twice in
one object, an op key that is not written the one way compfx writes it
(``"0:linear#00"``, digits that are not ASCII) and a top-level key compfx does
not write are refused with a :class:`~compfx.errors.PlanFileError` naming them.
Where the file says it was written by another torch release, or for another
device type than the model it is applied to, the plan still applies (op keys
and casts do not depend on either) and a warning says that its precisions were
measured elsewhere, so a search on this setup may choose differently. (The
compile backend's plan cache is stricter: it never runs a cached plan searched on
another device type; see :mod:`compfx.compile_backend`.)

A plan can be written and read as rules over module paths and op kinds
(:meth:`Plan.from_rules`, :meth:`Plan.rules`; :mod:`compfx.plan_rules`), and a
plan file holds those rules next to its ops (version 2), or rules alone
(:meth:`Plan.load` with the model's analysis). Its FP8 linears export to
torchao's float8 conversion (:meth:`Plan.torchao_filter`;
:mod:`compfx.plan_export`).

A plan may also pad ops (``plan.padded``, set with :meth:`Plan.with_padding`):
those ops run with their unfit dims zero-padded to the Tensor Core multiple
(:mod:`compfx.passes.pad_shapes`). Only ops the analysis marks
``pad_eligible`` can be padded; padding changes no precision.
"""

from __future__ import annotations

import os
import warnings
from types import MappingProxyType
from typing import Iterable, Iterator, Mapping

import torch

from .compile_options import CompileOptions
from .errors import PlanFileError, PlanMismatchError
from .files import checked_path, read_json, write_json_atomic
from .opkey import OpKey
from .plan_file import (FINGERPRINT_PATTERN, FORMAT, MAX_PLAN_BYTES, OPTIONAL_KEYS_OF_VERSION, PLAN_VERSION,
                        REQUIRED_KEYS, check_op_keys, check_search_record, check_torch_version, is_device_type,
                        is_plan_file, padded_from_file)
from .plan_rules import Rule, check_file_rules, resolve_rules, rules_from_list, rules_to_list, summarize
from .vocabulary import LOW_DTYPES, Category, Float8Recipe, Precision, check_low_dtype, dtype_from_name, dtype_name

__all__ = ["Plan", "Assignment", "AMP_PRECISION", "PLAN_VERSION", "MAX_PLAN_BYTES", "FINGERPRINT_PATTERN"]

#: What ``torch.autocast`` does with each category: its lists run low or FP32, the rest follow.
AMP_PRECISION = MappingProxyType({Category.WHITELIST: Precision.LOW, Category.BLACKLIST: Precision.FP32,
                                  Category.OTHER: Precision.FOLLOW})


class Assignment(tuple):
    """One :class:`Precision` per op, by position in ``analysis.ops``: the search's form of a plan.

    ``str()`` is the CoMP plan string.

    >>> a = Assignment.parse("0f1")
    >>> a[0] is Precision.LOW, str(a), str(a.replaced([1], Precision.LOW))
    (True, '0f1', '001')
    """

    __slots__ = ()

    def __new__(cls, precisions: Iterable = ()):
        return super().__new__(cls, tuple(map(Precision, precisions)))

    @classmethod
    def parse(cls, code: str) -> "Assignment":
        """The assignment a CoMP plan string spells; :class:`PlanMismatchError` on other characters."""
        if not isinstance(code, str):
            raise PlanMismatchError(f"a plan string must be a str like '0f1'; got {type(code).__name__}.")
        bad = sorted(set(code) - set(Precision.codes()))
        if bad:
            raise PlanMismatchError(f"plan string {code!r} contains {bad}; expected only '0' (low), '1' (fp32), "
                                    "'f' (follow) or '8' (fp8).")
        return cls(Precision.from_code(c) for c in code)

    def replaced(self, positions: Iterable[int], precision) -> "Assignment":
        """A copy with the ops at ``positions`` set to ``precision``."""
        chosen = list(self)
        for i in positions:
            chosen[i] = precision
        return Assignment(chosen)

    def __str__(self) -> str:
        return "".join(p.code for p in self)

    def __repr__(self) -> str:
        return f"Assignment({str(self)!r})"


class Plan(Mapping[OpKey, Precision]):
    """Immutable mapping OpKey -> :class:`Precision` for one model (its fingerprint) and one low dtype.

    Build one from an analysis (:meth:`fp32`, :meth:`amp`, :meth:`uniform`,
    :meth:`from_bitstring`, :meth:`from_assignment`, :meth:`from_rules`), from a file
    (:meth:`load`), or take ``compfx.optimize(...).plan``; the constructor
    itself is for plans read from elsewhere. Plans are equal when their
    precisions, low dtype, fingerprint, FP8 recipe and padding are.

    Args:
        entries: op key -> precision (``"low"``, ``"fp32"``, ``"follow"``, ``"fp8"`` or a :class:`Precision`).
        low_dtype: what "low" means: ``torch.bfloat16`` or ``torch.float16``.
        fingerprint: the fingerprint of the model's analysis (``analysis.fingerprint``).
        fp8_recipe: how its ``fp8`` ops scale (default ``"tensorwise"``); None in a plan without ``fp8`` ops.
        padded: the ops padded to the Tensor Core multiple (:meth:`with_padding`).
        device_type: the device type it was made for (``"cpu"``, ``"cuda"``), or None.
        parameter_shapes: the shapes of the parameters it was searched on (:meth:`with_parameter_shapes`).
        compile_options: the ``torch.compile`` settings a compiled search measured it under
            (:class:`~compfx.compile_options.CompileOptions`), or None: searched eagerly.

    Raises:
        PlanMismatchError: a key that is not an OpKey, an unknown precision, low dtype or device type, or a
            fingerprint that is not one compfx makes.

    Example::

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> a = compfx.analyze(model, torch.randn(3, 4))
        >>> compfx.Plan.amp(a).bitstring(a)
        '0f0'
        >>> compfx.Plan.from_bitstring(a, "101").bitstring(a)
        '101'
    """

    __slots__ = ("_entries", "low_dtype", "fingerprint", "fp8_recipe", "padded", "device_type", "parameter_shapes",
                 "compile_options")

    def __init__(self, entries: Mapping[OpKey, Precision | str], *, low_dtype: torch.dtype, fingerprint: str,
                 fp8_recipe: Float8Recipe | str | None = None, padded: Iterable[OpKey] = (),
                 device_type: str | None = None, parameter_shapes: Iterable[Iterable[int]] | None = None,
                 compile_options: CompileOptions | None = None):
        checked = {}
        for key, precision in entries.items():
            if not isinstance(key, OpKey):
                raise PlanMismatchError(f"plan key {key!r} is not an OpKey")
            try:
                checked[key] = Precision(precision)
            except ValueError:
                raise PlanMismatchError(f"precision {precision!r} for {key} is unknown; expected one of "
                                        f"{[p.value for p in Precision]}") from None
        check_low_dtype(low_dtype, error=PlanMismatchError)
        if not isinstance(fingerprint, str) or not FINGERPRINT_PATTERN.fullmatch(fingerprint):
            raise PlanMismatchError(f"plan fingerprint {fingerprint!r} is not one compfx makes (16 lowercase hex "
                                    "digits); expected the fingerprint of the model's analysis (analysis.fingerprint).")
        object.__setattr__(self, "_entries", MappingProxyType(checked))
        object.__setattr__(self, "low_dtype", low_dtype)
        object.__setattr__(self, "fingerprint", fingerprint)
        recipe = None
        if any(p is Precision.FP8 for p in checked.values()):  # a recipe only means something with FP8 ops
            recipe = Float8Recipe.parse(fp8_recipe or Float8Recipe.TENSORWISE, "fp8_recipe")
        object.__setattr__(self, "fp8_recipe", recipe)
        object.__setattr__(self, "padded", _checked_padding(padded, checked))
        if device_type is not None and not is_device_type(device_type):
            raise PlanMismatchError(f"device_type={device_type!r}; expected a torch device type such as 'cpu' or "
                                    "'cuda', or None.")
        # where it was made for (metadata: plans equal in their precisions are equal, wherever they were made)
        object.__setattr__(self, "device_type", device_type)
        # what it was searched for: the shapes of the model's parameters (compfx.analysis.parameter_shapes); op keys
        # name layers, not widths, so this tells the model a plan file was searched on from the same layers resized
        object.__setattr__(self, "parameter_shapes", _checked_shapes(parameter_shapes))
        # how the search that chose it measured its program (metadata too: None, eagerly)
        if compile_options is not None and not isinstance(compile_options, CompileOptions):
            raise PlanMismatchError(f"compile_options={compile_options!r}; expected a compfx.CompileOptions or None.")
        object.__setattr__(self, "compile_options", compile_options)

    def __setattr__(self, name, value):
        raise AttributeError("Plan is immutable; use plan.with_precisions(...)")

    # Immutable, so a copy is the plan itself: modules holding one (a PlannedModule, the compile backend) are
    # deep-copied by users (EMA copies) and by libraries (Lightning deep-copies torch.compile's arguments).
    def __copy__(self) -> "Plan":
        return self

    def __deepcopy__(self, memo) -> "Plan":
        return self

    def __reduce__(self):  # pickling (spawned workers): the entries as a plain dict
        return (_rebuilt_plan, (dict(self._entries), self.low_dtype, self.fingerprint, self.fp8_recipe, self.padded,
                                self.device_type, self.parameter_shapes, self.compile_options))

    # -- Mapping -------------------------------------------------------------
    def __getitem__(self, key: OpKey) -> Precision:
        return self._entries[key]

    def __iter__(self) -> Iterator[OpKey]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (dict(self._entries) == dict(other._entries) and self.low_dtype == other.low_dtype
                and self.fingerprint == other.fingerprint and self.fp8_recipe == other.fp8_recipe
                and self.padded == other.padded)

    def __hash__(self) -> int:
        return hash((frozenset(self._entries.items()), self.low_dtype, self.fingerprint, self.fp8_recipe,
                     self.padded))

    def __repr__(self) -> str:
        counts = ", ".join(f"{sum(v is p for v in self._entries.values())} {p}" for p in Precision)
        recipe = f", fp8_recipe={self.fp8_recipe}" if self.fp8_recipe else ""
        padded = f", {len(self.padded)} padded" if self.padded else ""
        return f"Plan({len(self)} ops: {counts}{padded}; low_dtype={dtype_name(self.low_dtype)}{recipe})"

    # -- constructors --------------------------------------------------------
    @classmethod
    def uniform(cls, analysis, precision: Precision | str, *, fp8_recipe: Float8Recipe | str | None = None) -> "Plan":
        """Every op of ``analysis`` at one ``precision`` (``"low"``, ``"fp32"``, ``"follow"`` or ``"fp8"``, with
        ``fp8_recipe``).

        >>> import torch, compfx
        >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(3, 4))
        >>> compfx.Plan.uniform(a, "low").bitstring(a)
        '00'
        """
        return cls({op.key: precision for op in analysis.ops}, low_dtype=analysis.low_dtype,
                   fingerprint=analysis.fingerprint, fp8_recipe=fp8_recipe, device_type=analysis.device.type)

    @classmethod
    def fp32(cls, analysis) -> "Plan":
        """Every op of ``analysis`` in FP32: the original model, bit for bit.

        >>> import torch, compfx
        >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(3, 4))
        >>> compfx.Plan.fp32(a).bitstring(a)
        '11'
        """
        return cls.uniform(analysis, Precision.FP32)

    @classmethod
    def amp(cls, analysis) -> "Plan":
        """What ``torch.autocast`` does: whitelist low, blacklist FP32, the rest follow; FP32 for the ops the
        model pins in its own ``autocast(enabled=False)`` blocks (``OpInfo.pinned``), where autocast casts nothing.

        >>> import torch, compfx
        >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(3, 4))
        >>> compfx.Plan.amp(a).bitstring(a)  # the linear low (autocast's whitelist), the relu follows its input
        '0f'
        """
        return cls({op.key: Precision.FP32 if getattr(op, "pinned", False) else AMP_PRECISION[op.category]
                    for op in analysis.ops}, low_dtype=analysis.low_dtype, fingerprint=analysis.fingerprint,
                   device_type=analysis.device.type)

    @classmethod
    def from_assignment(cls, analysis, assignment: Iterable, *,
                        fp8_recipe: Float8Recipe | str | None = None) -> "Plan":
        """The plan that gives ``analysis.ops[i]`` the precision ``assignment[i]``.

        Raises:
            PlanMismatchError: not one precision per op.

        >>> import torch, compfx
        >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(3, 4))
        >>> compfx.Plan.from_assignment(a, ["low", "follow"]).bitstring(a)
        '0f'
        """
        assignment = Assignment(assignment)
        if len(assignment) != len(analysis.ops):
            raise PlanMismatchError(
                f"the plan has {len(assignment)} precisions, but the model has {len(analysis.ops)} ops; "
                "expected one per op of analysis.ops."
            )
        return cls({op.key: p for op, p in zip(analysis.ops, assignment)}, low_dtype=analysis.low_dtype,
                   fingerprint=analysis.fingerprint, fp8_recipe=fp8_recipe, device_type=analysis.device.type)

    @classmethod
    def from_bitstring(cls, analysis, bits: str, *, fp8_recipe: Float8Recipe | str | None = None) -> "Plan":
        """CoMP's string form: one character per ``analysis.ops`` entry ('0' low, '1' FP32, 'f' follow, '8' FP8).

        Raises:
            PlanMismatchError: not one character per op, or one that is none of these.

        >>> import torch, compfx
        >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(3, 4))
        >>> compfx.Plan.from_bitstring(a, "1f")[compfx.OpKey("0", "linear", 0)]
        <Precision.FP32: 'fp32'>
        """
        if isinstance(bits, str) and len(bits) != len(analysis.ops):
            raise PlanMismatchError(
                f"bitstring has length {len(bits)}, but the model has {len(analysis.ops)} ops; "
                "expected one character per op of analysis.ops."
            )
        plan = cls.from_assignment(analysis, Assignment.parse(bits), fp8_recipe=fp8_recipe)
        plan._check_fp8(analysis)  # an '8' where the analysis marked no op FP8-eligible: refused now, not at apply
        return plan

    @classmethod
    def from_rules(cls, analysis, rules: Iterable[Rule], *, base: "Plan | None" = None) -> "Plan":
        """The plan ``rules`` give ``analysis.ops``: the rule of the highest level that selects an op decides it
        (global < kind < module pattern < exact op key: :mod:`compfx.plan_rules`); ops no rule selects keep
        ``base``'s precision.

        A rule that selects no op or two rules of one level that disagree on
        an op are refused, as is an op without a precision (no rule selects
        it, and there is no ``base``).

        >>> import torch, compfx
        >>> from compfx.plan_rules import Rule
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> a = compfx.analyze(model, torch.randn(3, 4))
        >>> rules = [Rule("follow"), Rule("low", kind="linear"), Rule("fp32", module="2")]
        >>> compfx.Plan.from_rules(a, rules).bitstring(a)
        '0f1'
        """
        if base is not None and not isinstance(base, Plan):
            raise PlanMismatchError(f"base is a {type(base).__name__}; expected a compfx.Plan, e.g. "
                                    "Plan.amp(analysis).")
        entries, recipe = resolve_rules(analysis.keys, rules, base=base, base_recipe=getattr(base, "fp8_recipe", None))
        return cls(entries, low_dtype=analysis.low_dtype, fingerprint=analysis.fingerprint, fp8_recipe=recipe,
                   device_type=analysis.device.type)

    def rules(self) -> tuple[Rule, ...]:
        """Few rules that reproduce this plan's precisions exactly (:func:`compfx.plan_rules.summarize`), so that
        ``Plan.from_rules(analysis, plan.rules()) == plan`` for an unpadded plan (padding is not a precision).

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> a = compfx.analyze(model, torch.randn(3, 4))
        >>> [str(rule) for rule in compfx.Plan.amp(a).rules()]
        ['every op -> low', 'kind relu -> follow']
        """
        return summarize(self._entries, self.fp8_recipe)

    def torchao_filter(self, *, strict: bool = True):
        """torchao's ``module_filter_fn(module, fqn)`` for ``convert_to_float8_training``: True for exactly the
        ``nn.Linear`` modules this plan runs in FP8 (:func:`compfx.plan_export.torchao_filter`, which says what
        torchao's conversion cannot express).

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        >>> analysis = compfx.analyze(model, torch.randn(16, 32), fp8=True)
        >>> keep = compfx.Plan.from_bitstring(analysis, "8f1").torchao_filter()
        >>> keep(model[0], "0"), keep(model[2], "2")
        (True, False)
        """
        from .plan_export import torchao_filter

        return torchao_filter(self, self.fp8_recipe, strict=strict)

    def with_precisions(self, updates: Mapping[OpKey, Precision | str]) -> "Plan":
        """A copy with some ops changed; every updated key must already be in the plan."""
        unknown = [str(k) for k in updates if k not in self._entries]
        if unknown:
            raise PlanMismatchError(f"with_precisions() got keys not in this plan: {unknown[:5]}")
        return Plan({**self._entries, **updates}, low_dtype=self.low_dtype, fingerprint=self.fingerprint,
                    fp8_recipe=self.fp8_recipe, padded=self.padded, device_type=self.device_type,
                    parameter_shapes=self.parameter_shapes, compile_options=self.compile_options)

    def with_parameter_shapes(self, shapes: Iterable[Iterable[int]] | None) -> "Plan":
        """A copy that records the shapes of the parameters of the model it was searched on
        (:func:`compfx.analysis.parameter_shapes`; a search's chosen plan records them), so that
        :func:`compfx.apply` can say when a plan file meets the same layers at other widths.

        >>> import torch, compfx
        >>> from compfx.analysis import parameter_shapes
        >>> a = compfx.analyze(torch.nn.Linear(4, 8), torch.randn(2, 4))
        >>> compfx.Plan.amp(a).with_parameter_shapes(parameter_shapes(a.graph_module)).parameter_shapes
        ((8,), (8, 4))
        """
        return Plan(self._entries, low_dtype=self.low_dtype, fingerprint=self.fingerprint, fp8_recipe=self.fp8_recipe,
                    padded=self.padded, device_type=self.device_type, parameter_shapes=shapes,
                    compile_options=self.compile_options)

    def with_compile_options(self, options: CompileOptions | None) -> "Plan":
        """A copy that records the ``torch.compile`` settings its program was measured under (None: eagerly); what a
        compiled search's plans carry, and what :func:`compfx.compile_with_plan` then compiles the plan with.

        >>> import torch, compfx
        >>> a = compfx.analyze(torch.nn.Linear(4, 8), torch.randn(2, 4))
        >>> compfx.Plan.amp(a).with_compile_options(compfx.CompileOptions(inner="aot_eager")).compile_options.inner
        'aot_eager'
        """
        return Plan(self._entries, low_dtype=self.low_dtype, fingerprint=self.fingerprint, fp8_recipe=self.fp8_recipe,
                    padded=self.padded, device_type=self.device_type, parameter_shapes=self.parameter_shapes,
                    compile_options=options)

    def with_padding(self, keys: Iterable[OpKey], *, analysis=None) -> "Plan":
        """A copy that pads exactly the ops ``keys`` (``with_padding(())``: none); precisions are unchanged.

        Every key must be in the plan and not at ``fp8`` (the float8 path has
        its own shape rule). Given the ``analysis``, each op must be
        ``pad_eligible`` there too; :meth:`validate` (which :func:`compfx.apply`
        and :class:`~compfx.planned_module.PlannedModule` call) checks that in any case.
        A refused key is a :class:`~compfx.errors.PlanMismatchError`.

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 10), torch.nn.ReLU(), torch.nn.Linear(10, 16))
        >>> a = compfx.analyze(model, torch.randn(8, 16))
        >>> [str(op.key) for op in a.ops if op.pad_eligible]
        ['0:linear#0', '2:linear#0']
        >>> plan = compfx.Plan.amp(a).with_padding([a.ops[0].key], analysis=a)
        >>> sorted(map(str, plan.padded))
        ['0:linear#0']
        """
        plan = Plan(self._entries, low_dtype=self.low_dtype, fingerprint=self.fingerprint,
                    fp8_recipe=self.fp8_recipe, padded=keys, device_type=self.device_type,
                    parameter_shapes=self.parameter_shapes, compile_options=self.compile_options)
        if analysis is not None:
            plan._check_padding(analysis)
        return plan

    # -- views ---------------------------------------------------------------
    def assignment(self, analysis) -> Assignment:
        """This plan by position in ``analysis.ops`` (validated against the analysis first)."""
        self.validate(analysis)
        return Assignment(self._entries[op.key] for op in analysis.ops)

    def bitstring(self, analysis) -> str:
        """CoMP's string form over ``analysis.ops``."""
        return str(self.assignment(analysis))

    def validate(self, analysis) -> None:
        """Raise :class:`PlanMismatchError` unless this plan covers exactly ``analysis.ops``.

        The fingerprint must be the analysis's too: a plan whose keys match
        but whose fingerprint does not was edited or built for another model.
        (:func:`compfx.apply` also checks the low dtype.)
        """
        expected = set(analysis.keys)
        missing = [str(k) for k in analysis.keys if k not in self._entries]
        unknown = [str(k) for k in self._entries if k not in expected]
        if missing or unknown:
            detail = []
            if unknown:
                detail.append(f"{len(unknown)} key(s) the model does not have (e.g. {unknown[:3]})")
            if missing:
                detail.append(f"no precision for {len(missing)} of the model's ops (e.g. {missing[:3]})")
            raise PlanMismatchError(
                "this plan does not match the model: " + "; ".join(detail) + ". It was probably made for "
                f"another model (plan fingerprint {self.fingerprint}, model {analysis.fingerprint}); "
                "run the search again or build the plan from this model's analysis."
            )
        if self.fingerprint != analysis.fingerprint:
            raise PlanMismatchError(
                f"this plan's fingerprint {self.fingerprint!r} is not the model's ({analysis.fingerprint!r}), although "
                "its op keys match: it was edited, or made for another model. Build the plan from this model's "
                "analysis (Plan.from_bitstring(analysis, ...)), or search again."
            )
        self._check_fp8(analysis)
        self._check_padding(analysis)
        device = getattr(analysis, "device", None)  # a log's analysis (compfx report) has no device
        if self.device_type is not None and device is not None and self.device_type != device.type:
            warnings.warn(f"this plan was made for {self.device_type} and runs on {device.type}: its "
                          "precisions apply, but they were chosen by measurements there; search again on this "
                          "device (compfx.optimize) to choose by measurements here.", UserWarning, stacklevel=3)

    def _check_padding(self, analysis) -> None:
        """Refuse padding an op the analysis did not mark ``pad_eligible`` (it meets the rule, or cannot be padded)."""
        infos = {op.key: op for op in analysis.ops}
        refused = [infos[key] for key in sorted(self.padded, key=str) if key in infos and not infos[key].pad_eligible]
        if refused:
            detail = "; ".join(f"{op.key}: {op.pad_reason or 'not analysed for padding'}" for op in refused[:3])
            raise PlanMismatchError(
                f"this plan pads {len(refused)} op(s) that padding cannot help ({detail}). Pad only ops the analysis "
                "marks pad_eligible: plan.with_padding([op.key for op in analysis.ops if op.pad_eligible]).")

    def _check_fp8(self, analysis) -> None:
        """Refuse ``fp8`` on an op the analysis did not mark FP8-eligible (:mod:`compfx.float8`)."""
        refused = [op for op in analysis.ops if self._entries[op.key] is Precision.FP8 and not op.fp8_eligible]
        if refused:
            detail = "; ".join(f"{op.key}: {op.fp8_reason}" for op in refused[:3])
            raise PlanMismatchError(
                f"this plan gives 'fp8' to {len(refused)} op(s) that cannot run FP8 ({detail}). Give them 'low' "
                "or 'fp32'" + ("" if analysis.fp8 else ", or analyse the model with analyze(..., fp8=True) so that "
                               "eligible ops are marked") + ".")

    # -- files ---------------------------------------------------------------
    def to_dict(self, *, rules: bool = False) -> dict:
        """The plan as its file holds it; with ``rules``, also :meth:`rules` (for people reading the file)."""
        return {
            "format": FORMAT,
            "version": 3 if self.compile_options is not None else 2 if rules else 1,  # the lowest that holds it
            "low_dtype": dtype_name(self.low_dtype),
            "fingerprint": self.fingerprint,
            "torch_version": str(torch.__version__),  # a plain str: TorchVersion does not unpickle under weights_only
            **({"device_type": self.device_type} if self.device_type else {}),
            "ops": {str(k): str(v) for k, v in self._entries.items()},
            **({"fp8_recipe": str(self.fp8_recipe)} if self.fp8_recipe else {}),
            **({"padded": sorted(map(str, self.padded))} if self.padded else {}),
            **({"parameter_shapes": [list(shape) for shape in self.parameter_shapes]}
               if self.parameter_shapes is not None else {}),
            **({"rules": rules_to_list(self.rules())} if rules else {}),
            **({"compile": self.compile_options.to_dict()} if self.compile_options is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "plan", *, analysis=None) -> "Plan":
        """The plan a :meth:`to_dict` mapping describes; anything else is a :class:`PlanFileError` naming ``source``.

        A file may hold ``rules`` (:mod:`compfx.plan_rules`): next to ``ops``
        they must reproduce them exactly; without ``ops`` (rules written by
        hand) the plan is built from them for the model of ``analysis``
        (:meth:`from_rules`), which must then be given.

        Checked before use: the format and ``version``, no top-level key compfx
        does not write, ``low_dtype`` among :data:`~compfx.vocabulary.LOW_DTYPES`'
        names, ``fingerprint`` a string, ``ops`` a mapping of op keys, each
        written as compfx writes it (``str(OpKey)``), to precisions;
        ``torch_version`` and ``device_type`` strings (another torch release
        than this one's is warned about: the plan applies, its measurements were
        taken there), ``searched`` and ``replaced`` what the plan cache writes,
        ``padded`` a list of op keys written the same way, ``compile`` what
        :meth:`~compfx.compile_options.CompileOptions.to_dict` writes.
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise PlanFileError(f"{source} is not a compfx plan (no '\"format\": \"{FORMAT}\"' entry).")
        version = data.get("version")
        if type(version) is not int or version not in OPTIONAL_KEYS_OF_VERSION:
            raise PlanFileError(f"{source} has version {version!r}; this compfx reads plan version 1 to version "
                                f"{PLAN_VERSION}. Search again with this compfx (or use the compfx that wrote it).")
        optional = OPTIONAL_KEYS_OF_VERSION[version]
        unknown = sorted(map(str, set(data) - set(REQUIRED_KEYS) - set(optional)))
        if unknown:
            raise PlanFileError(f"{source} has top-level key(s) {unknown} that compfx does not write in a version "
                                f"{version} file (it holds {list(REQUIRED_KEYS)} and may hold {list(optional)}); it "
                                "was edited, or written by another tool. Remove them, or search again.")
        if "rules" in data and "ops" not in data:
            return _plan_of_rules_file(data, source, analysis)
        low = data.get("low_dtype")
        names = [dtype_name(d) for d in LOW_DTYPES]
        if not isinstance(low, str) or low not in names:
            raise PlanFileError(f"{source} has low_dtype {low!r}; expected one of {names}. Fix the file or search "
                                "again.")
        fingerprint = data.get("fingerprint")
        if not isinstance(fingerprint, str) or not FINGERPRINT_PATTERN.fullmatch(fingerprint):
            raise PlanFileError(f"{source} has fingerprint {fingerprint!r}; expected the model's fingerprint, 16 "
                                "lowercase hex digits (analysis.fingerprint). Fix the file or search again.")
        ops = data.get("ops")
        if not isinstance(ops, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ops.items()):
            raise PlanFileError(f"{source} has no 'ops' mapping of op keys to precisions (strings); it is damaged. "
                                "Search again.")
        check_op_keys(ops, source)
        device_type = data.get("device_type")
        if device_type is not None and not is_device_type(device_type):
            raise PlanFileError(f"{source} has device_type {device_type!r}; expected a torch device type such as "
                                "'cpu' or 'cuda'. Fix the file or search again.")
        for name in ("searched", "replaced"):
            check_search_record(data.get(name), name, source)
        shapes = data.get("parameter_shapes")
        if shapes is not None and not (isinstance(shapes, list) and all(
                isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) for shape in shapes)):
            raise PlanFileError(f"{source} has parameter_shapes {str(shapes)[:80]}; expected a list of shapes (lists "
                                "of sizes), as the plan cache writes it. Fix the file or search again.")
        check_torch_version(data.get("torch_version"), source)
        try:
            entries = {OpKey.parse(k): v for k, v in ops.items()}
            recipe = data.get("fp8_recipe")
            if recipe is not None and recipe not in {r.value for r in Float8Recipe}:
                raise PlanFileError(f"{source} has fp8_recipe {recipe!r}; expected one of "
                                    f"{[r.value for r in Float8Recipe]}. Fix the file or search again.")
            compiled = data.get("compile")
            plan = cls(entries, low_dtype=dtype_from_name(low), fingerprint=fingerprint, fp8_recipe=recipe,
                       padded=padded_from_file(data.get("padded", []), source), device_type=device_type,
                       parameter_shapes=shapes,
                       compile_options=None if compiled is None else CompileOptions.from_dict(compiled, source))
            if "rules" in data:
                check_file_rules(plan, plan.fp8_recipe, rules_from_list(data["rules"], source), source)
            return plan
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            if isinstance(error, PlanMismatchError):
                raise PlanFileError(f"{source} holds an invalid plan: {error}") from error
            raise PlanFileError(f"{source} is a damaged compfx plan ({type(error).__name__}: {error}).") from error

    def save(self, path: str | os.PathLike, *, rules: bool = True) -> None:
        """Write the plan as JSON, atomically; :class:`~compfx.errors.FileWriteError` when it cannot be written.

        With ``rules`` (the default) the file also holds :meth:`rules`, the
        plan as few rules a person reviewing it can read (``compfx plan show``
        prints them); a file without them is read by older compfx releases too.

        It replaces an existing plan file, never another file: a path that
        holds something else (not a compfx plan), a symbolic link, a FIFO or a
        device is refused and left as it was.
        """
        write_json_atomic(path, self.to_dict(rules=rules), "plan file", replaces=is_plan_file)

    @classmethod
    def load(cls, path: str | os.PathLike, *, analysis=None) -> "Plan":
        """Read a plan written by :meth:`save`, or a file of rules alone (then for the model of ``analysis``). A
        plan of ops is checked against a model when applied.

        Args:
            path: the plan file.
            analysis: the model's :class:`~compfx.analysis.Analysis`, needed only for a file of rules alone.

        Returns:
            Plan: the plan, with the metadata the file carries (fingerprint, low dtype, device type, torch
            release, parameter shapes, compile options).

        Raises:
            PlanFileError: a missing, oversized (over :data:`MAX_PLAN_BYTES`, checked before reading), binary,
                corrupt or invalid file, or a path that is not a regular file (a FIFO is refused, not waited on);
                a file of rules alone without ``analysis``.
            PlanMismatchError: a file of rules alone for another low dtype than ``analysis``'s.
            BadInputError: a path that is not one (None, a NUL character).

        >>> import torch, compfx, tempfile, os
        >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(3, 4))
        >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
        >>> compfx.Plan.amp(a).save(path)
        >>> compfx.Plan.load(path) == compfx.Plan.amp(a)
        True
        """
        data = read_json(checked_path(path, "plan file"), "plan file", max_bytes=MAX_PLAN_BYTES)
        return cls.from_dict(data, source=f"plan file {os.fspath(path)}", analysis=analysis)


def _plan_of_rules_file(data: Mapping, source: str, analysis) -> Plan:
    """The plan a file of rules alone (no ``ops``) gives the model of ``analysis``."""
    rules = rules_from_list(data["rules"], source)
    if analysis is None:
        raise PlanFileError(f"{source} holds rules only, not one precision per op: they become a plan for one model. "
                            "Load it with Plan.load(path, analysis=compfx.analyze(model, example_inputs)).")
    low = data.get("low_dtype")
    if low is not None and low != dtype_name(analysis.low_dtype):
        raise PlanMismatchError(f"{source} runs 'low' ops in {low}, but the analysis was made for "
                                f"{dtype_name(analysis.low_dtype)}; analyse the model with low_dtype=torch.{low}.")
    for name in ("fingerprint", "padded", "searched", "replaced", "parameter_shapes", "fp8_recipe"):
        if name in data:
            raise PlanFileError(f"{source} holds rules without ops, and {name!r}, which only a plan of ops has; "
                                "remove it (the rules' FP8 recipe goes in each 'fp8' rule).")
    return Plan.from_rules(analysis, rules)


def _checked_padding(keys: Iterable[OpKey], entries: Mapping[OpKey, Precision]) -> frozenset:
    """``keys`` as a frozenset, each an op of the plan that is not at ``fp8``; :class:`PlanMismatchError` otherwise."""
    if isinstance(keys, (str, OpKey)):
        raise PlanMismatchError(f"padded={keys!r}; expected a collection of OpKeys, e.g. [analysis.ops[0].key].")
    padded = frozenset(keys)
    wrong = [k for k in padded if not isinstance(k, OpKey)]
    if wrong:
        raise PlanMismatchError(f"padded holds {wrong[0]!r}, which is not an OpKey")
    unknown = sorted(str(k) for k in padded if k not in entries)
    if unknown:
        raise PlanMismatchError(f"padded names op(s) not in this plan: {unknown[:5]}")
    fp8 = sorted(str(k) for k in padded if entries[k] is Precision.FP8)
    if fp8:
        raise PlanMismatchError(f"padded names op(s) at 'fp8': {fp8[:5]}; the float8 path needs dims divisible by 16 "
                                "and is not padded. Give them 'low' to pad them, or leave them unpadded.")
    return padded


def _rebuilt_plan(entries, low_dtype, fingerprint, fp8_recipe, padded=(), device_type=None,
                  parameter_shapes=None, compile_options=None) -> Plan:
    """A pickled :class:`Plan` again (see ``Plan.__reduce__``)."""
    return Plan(entries, low_dtype=low_dtype, fingerprint=fingerprint, fp8_recipe=fp8_recipe, padded=padded,
                device_type=device_type, parameter_shapes=parameter_shapes, compile_options=compile_options)


def _checked_shapes(shapes) -> tuple[tuple[int, ...], ...] | None:
    """``shapes`` as a tuple of shapes (each a tuple of sizes), or None; a :class:`PlanMismatchError` otherwise."""
    if shapes is None:
        return None
    try:
        checked = tuple(tuple(shape) for shape in shapes)
    except TypeError:
        checked = None
    if checked is None or not all(type(d) is int and d >= 0 for shape in checked for d in shape):
        raise PlanMismatchError(f"parameter_shapes={str(shapes)[:80]}; expected shapes (sequences of sizes), as "
                                "compfx.analysis.parameter_shapes gives them, or None.")
    return checked
