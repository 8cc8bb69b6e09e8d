"""The ``torch.compile`` settings of a planned program, defined once: :class:`CompileOptions`.

Three places read them, so that the program a search measures is the program
that trains:

* :func:`compfx.compile_with_plan` compiles a model with a plan under them,
* a compiled search (``SearchConfig(compile=CompileOptions(...))``) measures
  every plan as ``compile_with_plan(model, plan)`` trains it, under them,
* a plan chosen by a compiled search records them (``plan.compile_options``,
  the plan file's ``"compile"`` entry), and ``compile_with_plan(model, plan)``
  and ``torch.compile(model, backend="compfx")`` run that plan under them.

A plan file holds them as JSON, so every setting is a name or a JSON value: the
inner backend is named (a registered ``torch.compile`` backend), and Inductor's
config patches are strings, numbers, booleans or None.

>>> options = CompileOptions(inner="aot_eager", dynamic=False)
>>> options.describe()
"inner='aot_eager', dynamic=False"
>>> CompileOptions.from_dict(options.to_dict()) == options
True
>>> CompileOptions.of(True) == CompileOptions(), CompileOptions.of(False)
(True, None)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from .errors import BadInputError, PlanFileError

__all__ = ["CompileOptions", "MODES", "INNER_BACKENDS", "REGIONS_AUTO", "check_inner", "given_settings",
           "program_settings", "graph_settings", "regions_setting", "name_of", "dynamic_now", "own_recompiles"]

#: ``torch.compile``'s modes (:func:`torch._inductor.list_mode_options`); each is a set of Inductor config patches.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: Inner backends compfx knows by name; any other registered dynamo backend name works too.
INNER_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class CompileOptions:
    """How a planned program is compiled: ``torch.compile``'s settings and the compfx backend's own.

    * ``inner``: the backend that compiles the planned graphs (``"inductor"``,
      ``"aot_eager"``, ``"eager"`` or any other registered backend name).
    * ``mode``: ``torch.compile``'s mode (one of :data:`MODES`, or None); Inductor only.
    * ``dynamic``, ``fullgraph``: as ``torch.compile`` takes them.
    * ``inductor_options``: Inductor config patches (JSON values); Inductor only.
    * ``emulate_precision_casts``: Inductor keeps the rounding of a plan's casts
      inside fused kernels (see docs/compile.md); True, as the backend's default.
    * ``regions``: None compiles the model as one graph; ``"auto"`` compiles
      each of its repeated blocks as a region of its own, one graph per block
      plan (:mod:`compfx.compile_regions`), so that the compile time of a plan
      stays about the same as the model gets deeper; block classes, or their
      names (``"Block"`` or ``"my_model.Block"``), name the regions.

    Frozen and hashable; ``inductor_options`` is kept as sorted ``(name, value)``
    pairs (:attr:`inductor_patches` gives them as a dict). Checked when built:

    >>> CompileOptions(mode="fast")
    Traceback (most recent call last):
    ...
    compfx.errors.BadInputError: CompileOptions(mode='fast'); expected None or one of ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs').
    """

    inner: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    inductor_options: Mapping[str, object] | tuple = ()
    emulate_precision_casts: bool = True
    regions: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.inner, str) or not self.inner:
            raise BadInputError(f"CompileOptions(inner={self.inner!r}); expected the name of a registered "
                                "torch.compile backend, e.g. 'inductor' or 'aot_eager' (a plan records it by name).")
        if self.mode is not None and self.mode not in MODES:
            raise BadInputError(f"CompileOptions(mode={self.mode!r}); expected None or one of {MODES}.")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise BadInputError(f"CompileOptions(dynamic={self.dynamic!r}); expected None, True or False.")
        for name in ("fullgraph", "emulate_precision_casts"):
            if not isinstance(getattr(self, name), bool):
                raise BadInputError(f"CompileOptions({name}={getattr(self, name)!r}); expected True or False.")
        object.__setattr__(self, "inductor_options", _patches(self.inductor_options))
        object.__setattr__(self, "regions", regions_setting(self.regions))
        if (self.mode is not None or self.inductor_options) and self.inner != "inductor":
            given = "mode" if self.mode is not None else "inductor_options"
            raise BadInputError(f"CompileOptions({given}=...) configures Inductor, but inner={self.inner!r}; "
                                "pass it only with inner='inductor'.")

    @classmethod
    def of(cls, value, where: str = "compile") -> "CompileOptions | None":
        """``value`` as options: True is the defaults (Inductor), False and None are eager (None)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise BadInputError(f"{where}={value!r}; expected None or False (eager), True (torch.compile with "
                            "Inductor) or a compfx.CompileOptions(...).")

    @property
    def inductor_patches(self) -> dict[str, object]:
        """``inductor_options`` as a dict of Inductor config patches."""
        return dict(self.inductor_options)

    def check_available(self) -> None:
        """Refuse, now, an inner backend this process cannot run (not registered with ``torch.compile``)."""
        check_inner(self.inner, self.inductor_patches, self.mode)

    def describe(self) -> str:
        """``inner``, and every other setting that differs from the defaults, as ``name=value``."""
        default, parts = CompileOptions(), [f"inner={self.inner!r}"]
        for name in ("mode", "dynamic", "fullgraph", "inductor_options", "emulate_precision_casts", "regions"):
            if getattr(self, name) != getattr(default, name):
                parts.append(f"{name}={self._shown(name)!r}")
        return ", ".join(parts)

    def differences(self, other: "CompileOptions") -> list[str]:
        """``"name: mine -> other's"`` for every setting in which ``other`` differs from these."""
        return [f"{f.name}: {self._shown(f.name)!r} -> {other._shown(f.name)!r}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def _shown(self, name: str):
        return self.inductor_patches if name == "inductor_options" else getattr(self, name)

    def to_dict(self) -> dict:
        """JSON values (a plan file's ``"compile"`` entry). ``regions`` only when set: a plan compiled whole is
        written as before regions existed, so that every compfx that reads plan files reads it."""
        return {"inner": self.inner, "mode": self.mode, "dynamic": self.dynamic, "fullgraph": self.fullgraph,
                "inductor_options": self.inductor_patches, "emulate_precision_casts": self.emulate_precision_casts,
                **({"regions": self.regions if isinstance(self.regions, str) else list(self.regions)}
                   if self.regions is not None else {})}

    @classmethod
    def from_dict(cls, data, source: str = "compile options") -> "CompileOptions":
        """The options :meth:`to_dict` wrote; anything else is a :class:`~compfx.errors.PlanFileError`."""
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, Mapping) or not set(data) <= known:
            raise PlanFileError(f"{source} has compile {str(data)[:80]}; expected what compfx writes there (a mapping "
                                f"of {sorted(known)}). Fix the file or search again.")
        try:
            return cls(**dict(data))
        except (BadInputError, TypeError) as error:
            raise PlanFileError(f"{source} has bad compile options: {error}") from None


def _patches(value) -> tuple[tuple[str, object], ...]:
    """Inductor config patches as sorted ``(name, value)`` pairs of JSON values."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple(sorted((name, option) for name, option in items))
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or not all(isinstance(name, str) and _json_scalar(option) for name, option in pairs):
        raise BadInputError(f"CompileOptions(inductor_options={value!r}); expected a dict of Inductor config names to "
                            "strings, numbers, booleans or None (a plan file records them), e.g. "
                            "{'max_autotune': True}.")
    return pairs


#: ``regions="auto"``: compile each of the model's repeated blocks as a region (:mod:`compfx.compile_regions`).
REGIONS_AUTO = "auto"


def regions_setting(regions) -> str | tuple[str, ...] | None:
    """``regions`` as a plan records it: None (the whole model as one graph; False says the same), ``"auto"``, or
    the names of block classes (a class is named by its module and qualified name).

    >>> regions_setting("auto"), regions_setting([torch.nn.TransformerEncoderLayer, "Block"])
    ('auto', ('torch.nn.modules.transformer.TransformerEncoderLayer', 'Block'))
    """
    if regions is None or regions is False:
        return None  # the whole model as one graph
    if regions == REGIONS_AUTO:
        return regions
    names = (regions,) if isinstance(regions, (str, type)) else regions
    try:
        names = tuple(f"{n.__module__}.{n.__qualname__}" if isinstance(n, type) else n for n in names)
    except TypeError:
        names = ()
    if not names or not all(isinstance(n, str) and n for n in names):
        raise BadInputError(f"regions={regions!r}; expected None (the whole model as one graph), {REGIONS_AUTO!r} "
                            "(each repeated block a region) or the block classes, or their names, e.g. "
                            "regions=(Block,).")
    return names


def _json_scalar(value) -> bool:
    return value is None or isinstance(value, (str, bool)) or (isinstance(value, numbers.Real)
                                                               and value == value and abs(value) != float("inf"))


# -- the compfx backend's settings: given, else a plan's recorded ones --------------------------------------------

def check_inner(inner: str | Callable, inductor_options=None, mode: str | None = None) -> None:
    """Refuse an inner backend that cannot work now, not at the first call (and Inductor's settings for another)."""
    if callable(inner):
        _check_backend_signature(inner)
    elif not isinstance(inner, str):
        raise BadInputError(f"inner={inner!r}; expected a backend name such as {INNER_BACKENDS} or a callable.")
    elif inner not in torch._dynamo.list_backends(exclude_tags=()):
        raise BadInputError(f"inner={inner!r} is not a registered torch.compile backend; expected one of "
                            f"{INNER_BACKENDS}, another name from torch._dynamo.list_backends(), or a callable.")
    if inductor_options is not None and (not isinstance(inductor_options, Mapping)
                                         or not all(isinstance(k, str) for k in inductor_options)):
        raise BadInputError(f"inductor_options={inductor_options!r}; expected a mapping of Inductor config names to "
                            "values, e.g. {'max_autotune': True}, or None.")
    if inductor_options and inner != "inductor":
        raise BadInputError(f"inductor_options {sorted(inductor_options)} are Inductor config patches, but "
                            f"inner={inner!r}; pass them only with inner='inductor'.")
    if inductor_options:
        from torch._inductor import config  # imported only when options are given: it is not small

        unknown = sorted(set(inductor_options) - set(config.get_config_copy()))
        if unknown:
            raise BadInputError(f"inductor_options names {unknown[:3]}, which are not Inductor config options "
                                f"(torch._inductor.config); expected names such as 'max_autotune' or "
                                "'triton.cudagraphs'. Check the spelling against this torch release's config.")
    if mode is not None and inner != "inductor":
        raise BadInputError(f"mode={mode!r} is torch.compile's mode of Inductor, but inner={inner!r}; pass it only "
                            "with inner='inductor'.")


def _check_backend_signature(inner: Callable) -> None:
    """A callable inner backend takes (graph module, example inputs), as torch.compile calls a backend."""
    try:
        inspect.signature(inner).bind(None, None)
    except TypeError:
        raise BadInputError(f"inner={name_of(inner)!r} cannot be called as inner(gm, example_inputs), as "
                            "torch.compile calls a backend; expected a backend callable taking the graph module and "
                            "its example inputs and returning a callable.") from None
    except ValueError:  # no signature to read (a builtin): take it as one
        pass


def given_settings(inner, mode, inductor_options, emulate_precision_casts) -> dict:
    """The compfx backend's settings given explicitly (not None), checked; Inductor's own imply ``inner="inductor"``.

    >>> given_settings(None, None, {"max_autotune": True}, None)
    {'inductor_options': {'max_autotune': True}, 'inner': 'inductor'}
    """
    given = {name: value for name, value in (("inner", inner), ("mode", mode), ("inductor_options", inductor_options),
                                             ("emulate_precision_casts", emulate_precision_casts)) if value is not None}
    if ("mode" in given or "inductor_options" in given) and "inner" not in given:
        given["inner"] = "inductor"
    if "inner" in given:
        check_inner(given["inner"], inductor_options, mode)
    if mode is not None and mode not in MODES:
        raise BadInputError(f"mode={mode!r}; expected None or one of {MODES}.")
    if inductor_options is not None:
        given["inductor_options"] = dict(inductor_options)
    if "emulate_precision_casts" in given and not isinstance(emulate_precision_casts, bool):
        raise BadInputError(f"emulate_precision_casts={emulate_precision_casts!r}; expected True, False or None.")
    return given


def program_settings(options: "CompileOptions | None", **settings) -> dict:
    """The compile settings given to :func:`~compfx.compile_backend.compile_with_plan`: those given one by one
    (not None), or all of ``options``' (not both). ``dynamic`` and ``fullgraph`` are checked here, as
    ``torch.compile`` would take a string for True; the backend checks the rest.

    >>> program_settings(None, inner="aot_eager", mode=None, dynamic=False)
    {'inner': 'aot_eager', 'dynamic': False}
    """
    dynamic, fullgraph = settings.get("dynamic"), settings.get("fullgraph")
    if settings.get("regions") not in (None, False):  # block classes are kept as given: the model's are matched
        regions_setting(settings["regions"])
    if dynamic is not None and not isinstance(dynamic, bool):
        raise BadInputError(f"dynamic={dynamic!r}; expected None (torch.compile decides), True or False.")
    if fullgraph is not None and not isinstance(fullgraph, bool):
        raise BadInputError(f"fullgraph={fullgraph!r}; expected True or False (a string such as 'no' would be "
                            "taken as True).")
    given = {name: value for name, value in settings.items() if value is not None}
    if options is None:
        return given
    if given:
        raise BadInputError(f"compile_with_plan got options= and {sorted(given)}; pass the settings either as "
                            "options=CompileOptions(...) or one by one, not both.")
    if not isinstance(options, CompileOptions):
        raise BadInputError(f"options={options!r}; expected a compfx.CompileOptions or None.")
    return {**options.to_dict(), "regions": options.regions}


def graph_settings(recorded: "CompileOptions | None", given: Mapping[str, object]) -> tuple[dict, list[str]]:
    """The settings the compfx backend compiles one graph under: those ``given`` to it, else those its plan
    ``recorded`` (a compiled search measured the plan under them), else the defaults, with ``dynamic`` as dynamo
    compiles now; and, as ``"name: recorded -> used"``, where they differ from the recorded ones. ``fullgraph`` and
    ``regions`` are not a graph's (they decide which graphs there are).

    >>> settings, differences = graph_settings(CompileOptions(inner="aot_eager", regions="auto"), {"inner": "eager"})
    >>> settings["inner"], "regions" in settings, differences
    ('eager', False, ["inner: 'aot_eager' -> 'eager'"])
    """
    settings = {**(recorded or CompileOptions()).to_dict(), **given, "dynamic": dynamic_now()}
    for name in ("fullgraph", "regions"):
        settings.pop(name, None)
    if settings["inner"] != "inductor":  # the recorded Inductor settings do not apply to another inner backend
        settings.update(mode=None, inductor_options={})
    differences = [] if recorded is None else [
        f"{name}: {name_of(value)!r} -> {name_of(settings[name])!r}"
        for name, value in recorded.to_dict().items() if name in settings and value != settings[name]]
    return settings, differences


def name_of(inner):
    """A backend's name for records and messages: the name itself, or a callable's ``__name__``."""
    return getattr(inner, "__name__", type(inner).__name__) if callable(inner) else inner


def dynamic_now() -> bool | None:
    """``torch.compile``'s ``dynamic`` as dynamo compiles now (its ``dynamic=`` sets these two settings)."""
    config = torch._dynamo.config
    if not config.assume_static_by_default:
        return True
    return None if config.automatic_dynamic_shapes else False


@functools.cache
def own_recompiles() -> dict:
    """``torch.compile``'s ``isolate_recompiles=True`` where this torch has it (2.13 does): one program's
    recompiles then never count against another's of the same model (a search compiles one per plan)."""
    return {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
