"""The search space: what the search knows about each op, by position in ``analysis.ops``.

The stages see no model, only this: each op's category, Tensor Core
eligibility and group label (ops with equal labels cost the same and may
share one decision when the space must shrink). Plans are
:class:`~compfx.plan.Assignment` s over these positions.

>>> from compfx.vocabulary import Category as C
>>> space = SearchSpace((C.WHITELIST, C.OTHER, C.BLACKLIST), (False, False, False), ("lin", "relu", "exp"))
>>> space.stage1_positions, space.adjustable, str(space.fp32_plan), str(space.amp_plan)
((0, 2), (0, 2), '111', '0f1')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from ..errors import SearchError
from ..plan import AMP_PRECISION, Assignment
from ..vocabulary import Category, Precision

__all__ = ["SearchSpace"]


@dataclass(frozen=True)
class SearchSpace:
    """Per op, in graph order: category, Tensor Core eligibility, group label, and a name for notes."""

    categories: tuple[Category, ...]
    tc_eligible: tuple[bool, ...]
    groups: tuple[Hashable, ...]
    names: tuple[str, ...] = ()

    def __post_init__(self):
        n = len(self.categories)
        if len(self.tc_eligible) != n or len(self.groups) != n or (self.names and len(self.names) != n):
            raise SearchError("SearchSpace fields must all have one entry per op")
        try:
            object.__setattr__(self, "categories", tuple(map(Category, self.categories)))
        except ValueError as error:
            raise SearchError(f"unknown op category ({error}); expected whitelist, blacklist or other") from None

    @classmethod
    def from_analysis(cls, analysis) -> "SearchSpace":
        """Group label = op kind + input shapes: such ops cost the same and usually behave alike."""
        return cls(
            categories=tuple(op.category for op in analysis.ops),
            tc_eligible=tuple(op.tc_eligible for op in analysis.ops),
            # as text: dynamo graphs may hold symbolic (unhashable) sizes
            groups=tuple(f"{op.kind}{list(map(list, op.input_shapes))}" for op in analysis.ops),
            names=tuple(str(op.key) for op in analysis.ops),
        )

    def __len__(self) -> int:
        return len(self.categories)

    @property
    def stage1_positions(self) -> tuple[int, ...]:
        """CoMP's Stage1_OP_list: whitelist and blacklist ops."""
        return tuple(i for i, c in enumerate(self.categories) if c is not Category.OTHER)

    @property
    def adjustable(self) -> tuple[int, ...]:
        """Stage-1 ops tried at both precisions: blacklist, and whitelist without Tensor Cores."""
        return tuple(i for i, c in enumerate(self.categories)
                     if c is Category.BLACKLIST or (c is Category.WHITELIST and not self.tc_eligible[i]))

    @property
    def fp32_plan(self) -> Assignment:
        return Assignment([Precision.FP32] * len(self))

    @property
    def amp_plan(self) -> Assignment:
        """What autocast does: its lists low and FP32, the rest follow."""
        return Assignment(AMP_PRECISION[c] for c in self.categories)

    def name(self, i: int) -> str:
        return self.names[i] if self.names else f"op{i}"

    def groups_of(self, positions) -> list[tuple[int, ...]]:
        """``positions`` grouped by label, in order of first appearance."""
        groups: dict[Hashable, list[int]] = {}
        for i in positions:
            groups.setdefault(self.groups[i], []).append(i)
        return [tuple(members) for members in groups.values()]

    def check(self, plan: Assignment) -> Assignment:
        """``plan`` when it has one precision per op; otherwise :class:`SearchError`."""
        if len(plan) != len(self):
            raise SearchError(f"plan {plan} has {len(plan)} precisions for {len(self)} ops")
        return plan
