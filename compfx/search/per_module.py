"""The search over a model planned block by block (``compfx.optimize(..., per_module=(Block, ...))``).

The model comes with its blocks made :class:`~compfx.per_module.PlannedBlock` s
running FP32 (:func:`compfx.per_module.plan_blocks_fp32`, the apply stage's);
:class:`PerModuleEvaluator` switches every plan into those same blocks
(:meth:`~compfx.per_module.PlannedBlock.use_plan`), so the samples train the
user's model as it is wrapped (FSDP2, activation checkpointing) and their
timings include the all-gathers. Applying a plan per block is the apply
stage's; choosing it is the search's.
"""

from __future__ import annotations

import contextlib
from typing import Hashable

import torch.nn as nn

from ..per_module import PlannedBlock
from ..plan import Assignment, Plan
from .evaluator import LocalEvaluator, each_batch

__all__ = ["PerModuleEvaluator"]


class PerModuleEvaluator(LocalEvaluator):
    """:class:`~compfx.search.evaluator.LocalEvaluator` over a model whose blocks are
    :class:`~compfx.per_module.PlannedBlock` s.

    A plan is not a module of its own: it is switched into the model's blocks,
    and the model itself (as the user wrapped it: FSDP2, checkpointing) trains,
    so a step's time includes FSDP2's all-gathers and reduce-scatters.
    """

    def runner(self, plan: Assignment) -> nn.Module:
        """The model, with ``plan`` switched into its blocks."""
        return self.runner_of(self.plan(plan))

    def runner_of(self, plan: Plan) -> nn.Module:
        """:meth:`runner` for a :class:`~compfx.plan.Plan`."""
        categories = {op.key: op.category for op in self.analysis.ops}
        for module in self.model.modules():
            if isinstance(module, PlannedBlock):
                module.use_plan(plan, categories)
        return self.model

    def module(self, plan: Assignment) -> nn.Module:
        return self.runner(plan)

    def module_of(self, plan: Plan) -> nn.Module:
        return self.runner_of(plan)

    def program(self, plan: Assignment) -> Hashable:
        """Every plan is a program of its own (the blocks build their graphs on first use)."""
        return plan

    def specializations(self) -> tuple[int, list]:
        return 1, []

    def _switch(self, plans):
        return lambda j: self.runner(plans[j])  # every plan runs in the same model: switch it in before its step

    def run_epoch(self, plan: Assignment):
        # another sample may have switched the blocks between two batches: switch them back before each
        return each_batch(super().run_epoch(plan), lambda: self._switched_to(plan))

    @contextlib.contextmanager
    def _switched_to(self, plan: Assignment):
        self.runner(plan)
        yield
