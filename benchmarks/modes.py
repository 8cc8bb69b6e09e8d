"""The three ways a model is trained: FP32, AMP (autocast + GradScaler), compfx (search + plan).

>>> import torch
>>> amp = precision_for("amp", torch.device("cpu"), torch.bfloat16)
>>> amp.autocast_dtype, amp.scaler is None  # bf16 needs no loss scaling
(torch.bfloat16, True)
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

__all__ = ["MODES", "Precision", "precision_for", "compfx_status", "load_compfx", "search_config"]

MODES = ("fp32", "amp", "compfx")


@dataclass
class Precision:
    """What a mode changes in a training step: autocast around the forward, loss scaling around backward."""

    mode: str
    device_type: str
    autocast_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None

    def autocast(self) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        if self.scaler:
            self.scaler.update()


def precision_for(mode: str, device: torch.device, low_dtype: torch.dtype) -> Precision:
    """FP32: nothing. AMP: autocast to ``low_dtype``. compfx: the plan's casts are in the graph.

    fp16 gets a GradScaler in AMP and compfx (its range needs it); bf16 does not.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    scaler = torch.amp.GradScaler(device.type) if mode != "fp32" and low_dtype == torch.float16 else None
    return Precision(mode, device.type, low_dtype if mode == "amp" else None, scaler)


def load_compfx():
    """``(optimize, SearchConfig)`` from compfx; ImportError or AttributeError when this checkout lacks them.

    ``optimize`` returns a :class:`compfx.SearchResult`; its ``module`` runs the chosen plan.
    """
    import compfx

    return compfx.optimize, compfx.SearchConfig


def compfx_status() -> str:
    """"available", or "not available: <why>" (the runner reports it rather than crashing)."""
    try:
        optimize, config = load_compfx()
    except (ImportError, AttributeError) as error:
        return f"not available: {type(error).__name__}: {error}"
    return "available" if callable(optimize) else "not available: compfx.optimize is not callable"


def search_config(config_class, **wanted):
    """A SearchConfig with those of ``wanted`` that the class has (its fields are still settling)."""
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    return config_class(**{name: value for name, value in wanted.items() if name in names and value is not None})
