"""The search space: what the search knows about each op, by position in ``analysis.ops``.

The stages see no model, only this: each op's category, Tensor Core
eligibility, FP8 eligibility (empty: FP8 not searched) and group label (ops with equal labels cost the same and may
share one decision when the space must shrink), and, with ``SearchConfig(tie_blocks=True)``, its tie (the same op
in every repeat of a block: always one decision, :mod:`compfx.search.tied_blocks`). Plans are
:class:`~compfx.plan.Assignment` s over these positions.

>>> from compfx.vocabulary import Category as C
>>> space = SearchSpace((C.WHITELIST, C.OTHER, C.BLACKLIST), (False, False, False), ("lin", "relu", "exp"))
>>> space.stage1_positions, space.adjustable, str(space.fp32_plan), str(space.amp_plan)
((0, 2), (0, 2), '111', '0f1')
>>> fp8 = SearchSpace((C.WHITELIST, C.OTHER, C.BLACKLIST), (True, False, False), ("lin", "relu", "exp"),
...                   fp8_eligible=(True, False, False))
>>> fp8.searched, [tuple(map(str, fp8.levels(i))) for i in fp8.searched]
((0, 2), [('fp8', 'low'), ('low', 'fp32')])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Hashable, Iterable

from ..errors import SearchError
from ..plan import AMP_PRECISION, Assignment
from ..vocabulary import Category, Precision
from .tied_blocks import block_ties

__all__ = ["SearchSpace"]


@dataclass(frozen=True)
class SearchSpace:
    """Per op, in graph order: category, Tensor Core and FP8 eligibility, group label, and a name for notes.

    ``fp8_eligible`` is empty unless the search tries FP8 (``SearchConfig(fp8=True)``).
    """

    categories: tuple[Category, ...]
    tc_eligible: tuple[bool, ...]
    groups: tuple[Hashable, ...]
    names: tuple[str, ...] = ()
    fp8_eligible: tuple[bool, ...] = ()
    #: Ops the search may not change (pinned by the model): each keeps autocast's precision for its category.
    fixed: tuple[bool, ...] = ()
    #: Per op, its tie (ops with one tie share one Stage-1 decision; None: decides alone), and the repeat of its block
    #: it lies in (None outside repeated blocks); both empty unless ties are searched (``tie_blocks``).
    ties: tuple[Hashable, ...] = ()
    repeats: tuple[int | None, ...] = ()

    def __post_init__(self):
        n = len(self.categories)
        if len(self.tc_eligible) != n or len(self.groups) != n or (self.names and len(self.names) != n) \
                or (self.fp8_eligible and len(self.fp8_eligible) != n) or (self.fixed and len(self.fixed) != n) \
                or (self.ties and len(self.ties) != n) or (self.repeats and len(self.repeats) != n):
            raise SearchError("SearchSpace fields must all have one entry per op")
        try:
            object.__setattr__(self, "categories", tuple(map(Category, self.categories)))
        except ValueError as error:
            raise SearchError(f"unknown op category ({error}); expected whitelist, blacklist or other") from None

    @classmethod
    def from_analysis(cls, analysis, *, fp8: bool = False, search_pinned: bool = False,
                      tie_blocks: bool = False) -> "SearchSpace":
        """Group label = op kind + input shapes: such ops cost the same and usually behave alike.

        ``fp8``: also try FP8 where the analysis marks an op ``fp8_eligible``.
        An op the model pins to FP32 (``OpInfo.pinned``) is, to the search, a
        blacklist op fixed at FP32 (a Stage-1 op, so Stage 2 leaves it too),
        unless ``search_pinned``. ``tie_blocks``: the same op of every repeat of
        a block is one decision (:func:`~compfx.search.tied_blocks.block_ties`).
        """
        fixed = tuple(getattr(op, "pinned", False) and not search_pinned for op in analysis.ops)
        # as text: dynamo graphs may hold symbolic (unhashable) sizes
        groups = tuple(f"{op.kind}{list(map(list, op.input_shapes))}" for op in analysis.ops)
        ties, repeats = block_ties([op.key for op in analysis.ops], groups) if tie_blocks else ((), ())
        return cls(
            categories=tuple(Category.BLACKLIST if pin else op.category for op, pin in zip(analysis.ops, fixed)),
            tc_eligible=tuple(op.tc_eligible for op in analysis.ops),
            groups=groups,
            names=tuple(str(op.key) for op in analysis.ops),
            fp8_eligible=tuple(op.fp8_eligible and not pin for op, pin in zip(analysis.ops, fixed)) if fp8 else (),
            fixed=fixed, ties=ties, repeats=repeats,
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
        return tuple(i for i, c in enumerate(self.categories) if not (self.fixed and self.fixed[i])
                     and (c is Category.BLACKLIST or (c is Category.WHITELIST and not self.tc_eligible[i])))

    def fp8_at(self, i: int) -> bool:
        """Does Stage 1 try FP8 for op ``i``? (whitelist and blacklist ops that can run it)."""
        return bool(self.fp8_eligible) and self.fp8_eligible[i] and self.categories[i] is not Category.OTHER

    def levels(self, i: int) -> tuple[Precision, ...]:
        """The precisions Stage 1 tries for op ``i``, fastest first.

        Adjustable ops try low and FP32; a Tensor-Core whitelist op is fixed low
        (CoMP); an op that can run FP8 tries it too, as a third level.
        """
        levels = (Precision.LOW, Precision.FP32) if i in self._adjustable_set else (AMP_PRECISION[self.categories[i]],)
        return (Precision.FP8, *levels) if self.fp8_at(i) else levels

    @cached_property
    def _adjustable_set(self) -> frozenset:
        return frozenset(self.adjustable)

    @property
    def searched(self) -> tuple[int, ...]:
        """Ops Stage 1 tries at more than one precision: the adjustable ones, and those that can run FP8."""
        return tuple(i for i in range(len(self)) if i in self._adjustable_set or self.fp8_at(i))

    @cached_property
    def decisions(self) -> tuple[tuple[int, ...], ...]:
        """Stage 1's decisions: the searched ops, each alone, except that ops with one tie (and the same levels)
        share one; in order of first appearance.

        >>> from compfx.vocabulary import Category as C
        >>> space = SearchSpace((C.BLACKLIST,) * 3, (False,) * 3, ("ln",) * 3, ties=("b.*.ln", None, "b.*.ln"))
        >>> space.decisions
        ((0, 2), (1,))
        """
        decisions: dict[Hashable, list[int]] = {}
        for i in self.searched:
            tie = self.ties[i] if self.ties else None
            decisions.setdefault(("op", i) if tie is None else ("tie", tie, self.levels(i)), []).append(i)
        return tuple(tuple(members) for members in decisions.values())

    @property
    def decision_groups(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """The decisions grouped by their ops' group label (the same kind and input shapes), in order of first
        appearance: the decisions that share one when the space must shrink."""
        groups: dict[Hashable, list[tuple[int, ...]]] = {}
        for decision in self.decisions:
            groups.setdefault(self.groups[decision[0]], []).append(decision)
        return tuple(tuple(group) for group in groups.values())

    def plan_count(self, groups: Iterable[Iterable[int]]) -> int:
        """How many Stage-1 plans ``groups`` of ops (each sharing one decision) make."""
        return math.prod(len(self.levels(next(iter(g)))) for g in groups)

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
