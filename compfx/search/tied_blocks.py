"""Plans tied across the repeats of a block: ``SearchConfig(tie_blocks=True)``.

A model that repeats one block (``blocks.0``, ``blocks.1``, ... with the same
ops at the same shapes) gives Stage 1 one decision per op of *every* block:
its candidates grow with depth. Tied, the same op of every repeat
(``blocks.*.attn.qkv:linear#0``) is one decision, so Stage 1 searches a block,
not a model. The literature finds precision most sensitive in the first and
last blocks (which torchtitan and Megatron keep in BF16 by position); so once
the tied search is done, :func:`untie_end_blocks` tries each tied decision in
the first and in the last block on its own, under the same guard and decision
rule, keeping a change only when it gives a new incumbent; Stage 1 keeps the
budget those trials need (:func:`end_candidates`). Every count here depends on
the block, not on how many times it repeats.

:func:`block_ties` finds the repeats from the op keys alone (the stages see
no model): the ops under ``<container>.<i>.``, where the repeats hold the
same ops (the same keys below the repeat, kinds and input shapes).
"""

from __future__ import annotations

from typing import Hashable, Sequence

from ..opkey import OpKey
from ..vocabulary import Stage
from .outcome import Reporter, note

__all__ = ["BlockTie", "block_ties", "end_candidates", "untie_end_blocks"]

#: (container path, the op's key below the repeat, which block of the container): the same op in every repeat of a
#: block
BlockTie = tuple[str, OpKey, int]


def block_ties(keys: Sequence[OpKey], shapes: Sequence[Hashable]) -> tuple[tuple[BlockTie | None, ...],
                                                                              tuple[int | None, ...]]:
    """Per op: its tie (None outside repeated blocks) and the index of the repeat it lies in, among its block's.

    A repeat is ``<container>.<integer>`` at the first integer part of an op's
    module path; the repeats of one container that hold the same ops (keys
    below the repeat, and ``shapes``, one per op: ops that are tied must cost
    the same) are repeats of one block, tied when there are two or more. So
    an ``nn.Sequential`` of an embedding, blocks and a head ties its blocks.

    >>> keys = [OpKey("wte", "embedding", 0), OpKey("h.0.fc", "linear", 0), OpKey("h.0", "add", 0),
    ...         OpKey("h.1.fc", "linear", 0), OpKey("h.1", "add", 0), OpKey("head", "linear", 0)]
    >>> ties, repeats = block_ties(keys, ["e", "l", "a", "l", "a", "h"])
    >>> [None if t is None else f"{t[0]}.*.{t[1]}" for t in ties], repeats
    ([None, 'h.*.fc:linear#0', 'h.*.:add#0', 'h.*.fc:linear#0', 'h.*.:add#0', None], (None, 0, 0, 1, 1, None))
    """
    found = [_repeat_of(key) for key in keys]
    contents: dict[tuple[str, int], list] = {}
    for (container, index, below), shape in zip(found, shapes):
        if container is not None:
            contents.setdefault((container, index), []).append(repr((below, shape)))
    families: dict[tuple, list[int]] = {}  # (container, what a repeat holds) -> its repeats, in order
    for (container, index), ops in sorted(contents.items()):
        families.setdefault((container, tuple(sorted(ops))), []).append(index)
    place = {(container, index): (number, position)  # which block of its container, which repeat of it
             for number, ((container, _), indices) in enumerate(families.items()) if len(indices) >= 2
             for position, index in enumerate(indices)}
    ties, repeats = [], []
    for container, index, below in found:
        number, position = place.get((container, index), (None, None))
        ties.append(None if number is None else (container, below, number))
        repeats.append(position)
    return tuple(ties), tuple(repeats)


def _repeat_of(key: OpKey) -> tuple[str | None, int | None, OpKey | None]:
    """(container, repeat index, key below the repeat) of the first integer part of the op's module path."""
    parts = key.module.split(".") if key.module else []
    for position, part in enumerate(parts):
        if part.isdigit():
            below = OpKey(".".join(parts[position + 1:]), key.kind, key.index)
            return ".".join(parts[:position]), int(part), below
    return None, None, None


def end_candidates(space) -> int:
    """How many plans :func:`untie_end_blocks` tries at most: each tied decision's other levels, in the first and in
    the last repeat. Stage 1 keeps that much of its budget for them."""
    return sum(2 * (len(space.levels(unit[0])) - 1) for unit in space.decisions if len(unit) > 1)


def untie_end_blocks(space, search, budget: int, report: Reporter | None) -> None:
    """Try each tied decision at its other levels in the first repeat alone, then in the last repeat alone, from
    the incumbent; keep a change that gives a new incumbent (``search.try_plan``: the same guard and decision
    rule). Stops when ``budget`` is spent."""
    units = [unit for unit in space.decisions if len(unit) > 1]
    ends = [_end(space, unit, first) for first in (True, False) for unit in units]
    if not ends or search.best is None:
        return
    note(report, Stage.STAGE1, f"{len(units)} decision(s) were tied across the repeats of a block: each is tried "
         "on its own in the first and in the last repeat", untied=[[space.name(i) for i in m] for m in ends])
    current = search.best.plan
    for members in ends:
        for level in space.levels(members[0]):
            if level is current[members[0]]:
                continue
            if budget - (len(search.samples) - 1) <= 0:
                note(report, Stage.STAGE1, f"stage1_budget={budget} spent before every end repeat was tried on its "
                     "own")
                return
            candidate = current.replaced(members, level)
            if search.try_plan(candidate):
                current = candidate


def _end(space, unit: Sequence[int], first: bool) -> tuple[int, ...]:
    """The members of a tied decision in its first (or last) repeat."""
    repeats = [space.repeats[i] for i in unit]
    end = min(repeats) if first else max(repeats)
    return tuple(i for i, repeat in zip(unit, repeats) if repeat == end)
