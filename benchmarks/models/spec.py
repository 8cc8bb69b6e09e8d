"""What a benchmark model is: :class:`ModelSpec`, plus the default supervised training step.

A spec knows how to build the model for a config, make synthetic and real
batches ``(inputs..., target)``, compute the loss and the evaluation metric, and
how to train it. Most models use the defaults below (one network, one AdamW
optimizer, ``loss_fn(model(*inputs), batch)``); the GAN overrides the networks,
optimizers, step and search targets.

>>> from benchmarks.models import MODELS
>>> spec = MODELS["alexnet_cifar"]
>>> model = spec.build(spec.configs["small"])
>>> batch = spec.example_batch(spec.configs["small"], 2, torch.Generator().manual_seed(0))
>>> spec.loss_fn(model(*batch[:-1]), batch).ndim
0
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "ModelSpec", "SearchTarget", "Precision", "single_network", "adamw", "supervised_step",
    "supervised_search_targets", "supervised_cast_forwards", "top1_accuracy", "negative_loss", "cross_entropy",
]

Config = Mapping[str, Any]
Batch = tuple
Nets = dict[str, nn.Module]
Optimizers = dict[str, torch.optim.Optimizer]


class Precision(Protocol):
    """How a mode runs the numerics of a step (see benchmarks/modes.py)."""

    def autocast(self) -> AbstractContextManager: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def update(self) -> None: ...


@dataclass(frozen=True)
class SearchTarget:
    """One ``compfx.optimize`` call: which network to search, with what optimizer, data and loss."""

    net: str
    optimizer: str
    batches: list
    loss_fn: Callable[[Any, Batch], torch.Tensor]


# -- defaults for one supervised network --------------------------------------
def single_network(model: nn.Module) -> Nets:
    return {"model": model}


def adamw(model: nn.Module, config: Config) -> Optimizers:
    return {"model": torch.optim.AdamW(model.parameters(), lr=config.get("lr", 1e-3))}


def supervised_step(spec: "ModelSpec", nets: Nets, optimizers: Optimizers, batch: Batch,
                    precision: Precision) -> torch.Tensor:
    """Forward under the mode's autocast, loss, (scaled) backward, optimizer step."""
    optimizer = optimizers["model"]
    optimizer.zero_grad(set_to_none=True)
    with precision.autocast():
        loss = spec.loss_fn(nets["model"](*batch[:-1]), batch)
    precision.backward(loss)
    precision.step(optimizer)
    precision.update()
    return loss.detach()


def supervised_search_targets(spec: "ModelSpec", nets: Nets, optimizers: Optimizers,
                              batches: list) -> list[SearchTarget]:
    return [SearchTarget("model", "model", batches, spec.loss_fn)]


def supervised_cast_forwards(nets: Nets, batch: Batch) -> list[tuple[nn.Module, tuple]]:
    """The (module, inputs) forwards whose casts are counted for the AMP/compfx comparison."""
    return [(nets["model"], tuple(batch[:-1]))]


def top1_accuracy(output: torch.Tensor, batch: Batch) -> float:
    """Share of targets (ignoring ``-100``) whose argmax class is right."""
    target = batch[-1]
    keep = target != -100
    return float((output.argmax(-1)[keep] == target[keep]).float().mean())


def negative_loss(spec: "ModelSpec") -> Callable[[Any, Batch], float]:
    return lambda output, batch: float(spec.loss_fn(output, batch))


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: ``build(config)``, ``example_batch(config, batch_size, generator)``,
    ``loss_fn(output, batch)``, and the config sizes in ``configs`` (at least "small" and "paper").

    ``real_batches(config, batch_size, n_batches, split, seed)`` returns real data batches
    (see benchmarks/data.py); ``metric(output, batch)`` scores one eval batch
    (``metric_name`` says what it is; higher is better unless it is a loss).
    ``paper_rows`` maps a config name to the (model, dataset) row of the CoMP paper's tables.
    """

    name: str
    description: str
    configs: Mapping[str, Config]
    build: Callable[[Config], nn.Module]
    example_batch: Callable[[Config, int, torch.Generator], Batch]
    real_batches: Callable[[Config, int, int, str, int], list]
    loss_fn: Callable[[Any, Batch], torch.Tensor]
    metric_name: str = "top1_accuracy"
    metric: Callable[[Any, Batch], float] = top1_accuracy
    full_batch: bool = False  # one batch is the whole dataset (GNNs): an epoch is one step
    paper_rows: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    real_data: str = ""  # what real_batches reads, for the report
    make_nets: Callable[[nn.Module], Nets] = single_network
    make_optimizers: Callable[[nn.Module, Config], Optimizers] = adamw
    train_step: Callable[..., torch.Tensor] = supervised_step
    search_targets: Callable[..., list[SearchTarget]] = supervised_search_targets
    cast_forwards: Callable[[Nets, Batch], list] = supervised_cast_forwards
    evaluate_forward: Callable[[nn.Module, Batch], Any] = lambda model, batch: model(*batch[:-1])

    def __post_init__(self):
        missing = {"small", "paper"} - set(self.configs)
        if missing:
            raise ValueError(f"model {self.name!r} lacks configs {sorted(missing)}; every model needs small and paper")
        for config_name, config in self.configs.items():
            if "batch_size" not in config:
                raise ValueError(f"model {self.name!r} config {config_name!r} has no batch_size")

    def config(self, name: str) -> Config:
        if name not in self.configs:
            raise KeyError(f"model {self.name!r} has no config {name!r}; it has {sorted(self.configs)}")
        return self.configs[name]


def cross_entropy(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Classification loss over the last dim; works for (B, C) and (B, T, C) outputs."""
    target = batch[-1]
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))
