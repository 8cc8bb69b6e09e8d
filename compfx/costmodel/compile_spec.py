"""What a compiled program is compiled with, and one piece of it compiled alike: the cost model's side of compile.

A compiled search trains every plan as ``compfx.compile_with_plan(model, plan, inner=..., ...)`` runs it. The cost
model profiles ops the same way (:mod:`compfx.costmodel.compiled_profile`): each under ``torch.compile`` with the
same inner backend and Inductor options, so that what fusion and the scaling of FP8 cost is in the profile.
:class:`CompileSpec` holds those options and is part of every compiled profile's cache key.

>>> spec = CompileSpec.of({"inner": "aot_eager"})
>>> spec.key()
{'inner': 'aot_eager', 'inductor_options': {}, 'dynamic': None, 'emulate_precision_casts': True}
>>> import torch
>>> with spec.compiled(torch.nn.functional.relu) as relu:
...     relu(torch.tensor([-1.0, 2.0]))
tensor([0., 2.])
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Mapping

import torch

from ..errors import BadInputError

__all__ = ["CompileSpec"]

_FIELDS = ("inner", "inductor_options", "dynamic", "emulate_precision_casts")


@dataclass(frozen=True)
class CompileSpec:
    """The options a compiled program is built with, as :func:`compfx.compile_with_plan` takes them.

    * ``inner``: the backend compfx hands each rewritten graph to (``"inductor"``, ``"aot_eager"``, ...);
    * ``inductor_options``: Inductor config patches, ``(name, value)`` pairs (only with ``inner="inductor"``);
    * ``dynamic``: ``torch.compile``'s (None: its default, static shapes first);
    * ``emulate_precision_casts``: the Inductor patch the compfx backend sets by default, so that low-precision
      elementwise math rounds where eager rounds.
    """

    inner: str = "inductor"
    inductor_options: tuple[tuple[str, Any], ...] = ()
    dynamic: bool | None = None
    emulate_precision_casts: bool = True

    def __post_init__(self):
        inner = self.inner
        if not isinstance(inner, str) or not inner:
            raise BadInputError(f"CompileSpec(inner={inner!r}); expected the name of a torch.compile backend, "
                                "e.g. 'inductor' or 'aot_eager'.")
        options = self.inductor_options
        if isinstance(options, Mapping):
            options = tuple(options.items())
        object.__setattr__(self, "inductor_options", tuple(sorted((str(k), v) for k, v in options)))
        if self.inductor_options and inner != "inductor":
            raise BadInputError(f"CompileSpec: inductor_options {[k for k, _ in self.inductor_options]} are Inductor "
                                f"config patches, but inner={inner!r}; pass them only with inner='inductor'.")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise BadInputError(f"CompileSpec(dynamic={self.dynamic!r}); expected None, True or False.")

    @classmethod
    def of(cls, options) -> "CompileSpec | None":
        """The spec of ``options``: None (run eagerly: None), True (compfx's defaults), a backend name, a mapping
        of the fields, or any object that has them as attributes (the search's compile settings). A callable
        ``inner`` is named by its qualified name (profiles of it are keyed by that name).

        >>> CompileSpec.of(None), CompileSpec.of(True).inner, CompileSpec.of("aot_eager").inner
        (None, 'inductor', 'aot_eager')
        """
        if options is None or options is False:
            return None
        if isinstance(options, CompileSpec):
            return options
        if options is True:
            return cls()
        if isinstance(options, str):
            return cls(inner=options)
        if isinstance(options, Mapping):
            unknown = set(options) - set(_FIELDS)
            if unknown:
                raise BadInputError(f"compile options {sorted(unknown)} are not known; expected some of {_FIELDS}.")
            found = dict(options)
        else:
            found = {name: getattr(options, name) for name in _FIELDS if hasattr(options, name)}
            if "inner" not in found:
                raise BadInputError(f"compiled={options!r}; expected None, True, a backend name, a mapping or an "
                                    f"object with the fields {_FIELDS} (at least 'inner').")
        if "inner" in found and callable(found["inner"]):
            inner = found["inner"]
            name = getattr(inner, "__qualname__", type(inner).__name__)
            found["inner"] = f"{getattr(inner, '__module__', '?')}.{name}"
        if found.get("inductor_options") is None:
            found.pop("inductor_options", None)
        return cls(**found)

    def key(self) -> dict:
        """The spec as JSON values: part of the cache key of everything measured under it."""
        def plain(value):
            try:
                return json.loads(json.dumps(value))
            except (TypeError, ValueError):
                return repr(value)

        return {"inner": self.inner, "inductor_options": {k: plain(v) for k, v in self.inductor_options},
                "dynamic": self.dynamic, "emulate_precision_casts": self.emulate_precision_casts}

    def compile_kwargs(self) -> dict:
        """What ``torch.compile`` takes to compile as the compfx backend would hand its graphs to ``inner``."""
        kwargs: dict[str, Any] = {"backend": self.inner, "dynamic": self.dynamic}
        if self.inner == "inductor":  # the compfx backend's patches: emulate_precision_casts first, then the user's
            kwargs["options"] = {"emulate_precision_casts": self.emulate_precision_casts, **dict(self.inductor_options)}
        return kwargs

    @contextlib.contextmanager
    def compiled(self, call: Callable, **overrides) -> Iterator[Callable]:
        """``call`` under ``torch.compile`` with this spec (``overrides`` replace its ``torch.compile`` arguments),
        forgotten on exit.

        Every piece compiled here runs through one wrapper function, whose dynamo cache is reset on exit: pieces
        profiled one after another would otherwise pile up as recompiles of that one function, until dynamo's
        recompile limit made it run them eagerly.
        """
        def compiled_piece(*args, **kwargs):
            return call(*args, **kwargs)

        try:
            yield torch.compile(compiled_piece, **{**self.compile_kwargs(), **overrides})
        finally:
            torch._dynamo.reset_code(compiled_piece.__code__)

    def __str__(self) -> str:
        options = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                            if getattr(self, f.name) != f.default)
        return f"compiled ({options or 'inductor'})"
