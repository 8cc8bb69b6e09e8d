"""Plan rules: precisions written over module paths and op kinds, with written precedence.

A plan lists one precision per op key; a person reviewing it wants "the MLP's
linears in FP8, the attention output in bf16, the head and every norm in FP32".
A :class:`Rule` says that: it selects ops by module path and op kind and gives
them a precision (and, for ``fp8``, a recipe). :meth:`compfx.Plan.from_rules`
builds a plan from rules; :meth:`compfx.Plan.rules` summarises a plan as few
rules that reproduce it exactly (:func:`summarize`).

**Precedence** (as torch.ao's ``QConfigMapping``: global < op type < module
pattern < exact key): the rule of the highest level that selects an op decides
its precision.

=====  ===================  =======================================================================
level  name                 selects, e.g.
=====  ===================  =======================================================================
0      global               every op: ``Rule("follow")``
1      kind                 ops of one kind: ``Rule("fp32", kind="layer_norm")``
2      module               ops issued by matching modules: ``Rule("fp32", module="blocks.*.attn.**")``
3      module+kind          ... of one kind: ``Rule("fp8", module="blocks.*.mlp.*", kind="linear")``
4      module+kind+index    ... the index-th call of that kind: ``Rule("low", module="blocks.*.attn",
                            kind="matmul", index=1)``
5      op key               one op: ``Rule.for_key("lm_head:linear#0", "fp32")``
=====  ===================  =======================================================================

A module pattern is a glob over the dotted module path (``*`` any characters
within one path component, ``**`` any number of whole components, none
included, ``?`` one character; ``""`` is the model itself) or, given as
``module_regex``, a regular expression the whole path must match. Kinds are
compfx's normalised op kinds, as ``compfx analyze`` prints them.

Rules are checked against the ops they are applied to: a rule that selects no
op is refused (a typo, or rules written for another model), and so are two
rules of one level that select one op and disagree; an op no rule selects is
refused unless a base plan gives it its precision.

>>> from compfx.opkey import OpKey
>>> keys = [OpKey("blocks.0.mlp.0", "linear", 0), OpKey("blocks.0.ln", "layer_norm", 0), OpKey("head", "linear", 0)]
>>> rules = [Rule("low"), Rule("fp32", kind="layer_norm"), Rule("fp32", module="head")]
>>> {str(k): str(p) for k, p in resolve_rules(keys, rules)[0].items()}
{'blocks.0.mlp.0:linear#0': 'low', 'blocks.0.ln:layer_norm#0': 'fp32', 'head:linear#0': 'fp32'}
"""

from __future__ import annotations

import functools
import heapq
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .errors import BadInputError, PlanFileError, PlanMismatchError
from .opkey import OpKey
from .vocabulary import Float8Recipe, Precision

__all__ = ["Rule", "LEVELS", "resolve_rules", "deciding_rules", "summarize", "rules_to_list", "rules_from_list",
           "rules_table", "check_file_rules", "glob_regex"]

#: The precedence levels, lowest first: the rule of the highest level that selects an op decides it.
LEVELS = ("global", "kind", "module", "module+kind", "module+kind+index", "op key")
_GLOB_CHARS = frozenset("*?")


@functools.lru_cache(maxsize=4096)
def glob_regex(pattern: str) -> re.Pattern:
    """The regular expression a module-path glob stands for (matched against ``"." + path``, ``""`` for the root).

    >>> [bool(glob_regex("blocks.*.mlp.**").fullmatch("." + p)) for p in ("blocks.0.mlp", "blocks.0.mlp.0", "blocks.0")]
    [True, True, False]
    >>> bool(glob_regex("").fullmatch("")), bool(glob_regex("**").fullmatch(""))
    (True, True)
    """
    if "[" in pattern or "]" in pattern:
        raise BadInputError(f"module pattern {pattern!r}: compfx's globs have '*', '**' and '?' only; use "
                            "module_regex=... for character classes.")
    if pattern == "":
        return re.compile("")
    parts = []
    for component in pattern.split("."):
        if component == "**":
            parts.append(r"(?:\.[^.]+)*")
        elif "**" in component:
            raise BadInputError(f"module pattern {pattern!r}: '**' stands for whole path components, so it must be a "
                                "component of its own (e.g. 'blocks.**'); use '*' within a name.")
        else:
            body = "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in component)
            parts.append(r"\." + body)
    return re.compile("".join(parts))


def _dotted(path: str) -> str:
    return "." + path if path else ""


@dataclass(frozen=True)
class Rule:
    """A precision for the ops a rule selects (see the module docstring for the levels and their precedence).

    >>> Rule("fp8", module="blocks.*.mlp.*", kind="linear").level_name
    'module+kind'
    >>> r = Rule.for_key("head:linear#0", "fp32"); r.level_name, r.matches(OpKey("head", "linear", 0))
    ('op key', True)
    >>> str(Rule("fp8", module="blocks.*.mlp.*", kind="linear"))
    'module blocks.*.mlp.*, kind linear -> fp8 (tensorwise)'
    """

    precision: Precision
    module: str | None = None
    kind: str | None = None
    index: int | None = None
    module_regex: str | None = None
    fp8_recipe: Float8Recipe | None = None

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        set_("precision", Precision.parse(self.precision, "Rule precision"))
        if self.precision is Precision.FP8:
            set_("fp8_recipe", Float8Recipe.parse(self.fp8_recipe or Float8Recipe.TENSORWISE, "Rule fp8_recipe"))
        elif self.fp8_recipe is not None:
            raise BadInputError(f"Rule({self.precision!r}, fp8_recipe={self.fp8_recipe!r}): a recipe says how FP8 ops "
                                "scale; give it only to rules whose precision is 'fp8'.")
        for name in ("module", "kind", "module_regex"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise BadInputError(f"Rule {name}={value!r}; expected a str.")
        if self.module is not None and self.module_regex is not None:
            raise BadInputError("Rule takes module= (a glob) or module_regex= (a regular expression), not both.")
        if self.kind is not None and not self.kind:
            raise BadInputError("Rule kind='' selects nothing; expected an op kind such as 'linear', or no kind.")
        if self.index is not None:
            if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
                raise BadInputError(f"Rule index={self.index!r}; expected a call index (an int >= 0).")
            if self.kind is None or not self.has_module:
                raise BadInputError("Rule index= counts the calls of one kind in one module: give module= (or "
                                    "module_regex=) and kind= with it, e.g. Rule('fp32', module='attn', "
                                    "kind='matmul', index=1).")
        if self.module is not None:
            glob_regex(self.module)  # a bad glob is refused here, not when the rule is first matched
        if self.module_regex is not None:
            try:
                re.compile(self.module_regex)
            except re.error as error:
                raise BadInputError(f"Rule module_regex={self.module_regex!r} is not a regular expression "
                                    f"({error}).") from None

    @classmethod
    def for_key(cls, key: OpKey | str, precision: Precision | str,
                fp8_recipe: Float8Recipe | str | None = None) -> "Rule":
        """The rule for exactly one op (the highest level)."""
        if isinstance(key, str):
            try:
                key = OpKey.parse(key)
            except ValueError as error:
                raise BadInputError(str(error)) from None
        if not isinstance(key, OpKey):
            raise BadInputError(f"Rule.for_key() takes an OpKey or its text ('module:kind#index'); got {key!r}.")
        return cls(precision, module=key.module, kind=key.kind, index=key.index, fp8_recipe=fp8_recipe)

    @property
    def has_module(self) -> bool:
        return self.module is not None or self.module_regex is not None

    @property
    def is_key(self) -> bool:
        """Does the rule name one op key (a literal module path, a kind and an index)?"""
        return self.module is not None and self.index is not None and not _GLOB_CHARS & set(self.module)

    @functools.cached_property
    def level(self) -> int:
        if self.is_key:
            return 5
        if self.has_module:
            return 2 + (self.kind is not None) + (self.index is not None)
        return 1 if self.kind is not None else 0

    @property
    def level_name(self) -> str:
        return LEVELS[self.level]

    def matches(self, key: OpKey) -> bool:
        if self.kind is not None and key.kind != self.kind:
            return False
        if self.index is not None and key.index != self.index:
            return False
        return self.matches_module(key.module)

    def matches_module(self, path: str) -> bool:
        if self.module is not None:
            return glob_regex(self.module).fullmatch(_dotted(path)) is not None
        if self.module_regex is not None:
            return re.fullmatch(self.module_regex, path) is not None
        return True

    def selector(self) -> str:
        """What the rule selects, in words."""
        if self.is_key:
            return f"op {OpKey(self.module, self.kind, self.index)}"
        parts = []
        if self.module is not None:
            parts.append(f"module {self.module or '(the model itself)'}")
        if self.module_regex is not None:
            parts.append(f"module regex {self.module_regex}")
        if self.kind is not None:
            parts.append(f"kind {self.kind}" + (f" #{self.index}" if self.index is not None else ""))
        return ", ".join(parts) or "every op"

    def outcome(self) -> str:
        return f"{self.precision}" + (f" ({self.fp8_recipe})" if self.fp8_recipe else "")

    def __str__(self) -> str:
        return f"{self.selector()} -> {self.outcome()}"

    # -- files ---------------------------------------------------------------
    def to_dict(self) -> dict:
        """The rule as a plan file writes it (only the fields it sets; an op-key rule as ``"key"``)."""
        data: dict = {"precision": str(self.precision)}
        if self.is_key:
            data["key"] = str(OpKey(self.module, self.kind, self.index))
        else:
            data.update({name: getattr(self, name) for name in ("module", "module_regex", "kind", "index")
                         if getattr(self, name) is not None})
        if self.fp8_recipe is not None:
            data["fp8_recipe"] = str(self.fp8_recipe)
        return data

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "rules") -> "Rule":
        """The rule :meth:`to_dict` wrote; anything else is a :class:`~compfx.errors.PlanFileError` naming
        ``source``."""
        fields = {"precision", "key", "module", "module_regex", "kind", "index", "fp8_recipe"}
        if not isinstance(data, Mapping) or "precision" not in data or set(data) - fields:
            extra = sorted(map(str, set(data) - fields)) if isinstance(data, Mapping) else []
            raise PlanFileError(f"{source} has rule {data!r}"
                                + (f" with field(s) {extra} compfx does not write" if extra else "")
                                + f"; expected a mapping with 'precision' and some of {sorted(fields - {'precision'})}"
                                ".")
        try:
            if "key" in data:
                if set(data) - {"precision", "key", "fp8_recipe"}:
                    raise BadInputError("a rule with 'key' names one op: it takes no module, kind or index")
                if not isinstance(data["key"], str) or str(OpKey.parse(data["key"])) != data["key"]:
                    raise BadInputError(f"key {data['key']!r} is not written as compfx writes op keys")
                return cls.for_key(data["key"], data["precision"], data.get("fp8_recipe"))
            return cls(data["precision"], **{name: data[name] for name in data if name != "precision"})
        except (BadInputError, ValueError, TypeError) as error:
            raise PlanFileError(f"{source} has an invalid rule {dict(data)!r}: {error}") from None


def rules_to_list(rules: Iterable[Rule]) -> list[dict]:
    return [rule.to_dict() for rule in rules]


def rules_from_list(value, source: str = "rules") -> tuple[Rule, ...]:
    """The rules of a plan file's ``"rules"`` list."""
    if not isinstance(value, list):
        raise PlanFileError(f"{source} has rules {str(value)[:80]}; expected a list of rules (mappings).")
    return tuple(Rule.from_dict(item, source) for item in value)


def check_file_rules(entries: Mapping[OpKey, Precision], recipe: Float8Recipe | None, rules: Sequence[Rule],
                     source: str) -> None:
    """A plan file's rules next to its ops must reproduce them: the ops are what runs, the rules what people read;
    a :class:`~compfx.errors.PlanFileError` naming ``source`` otherwise."""
    try:
        found, found_recipe = resolve_rules(tuple(entries), rules)
    except (BadInputError, PlanMismatchError) as error:
        raise PlanFileError(f"{source} has rules that do not fit its ops: {error}") from None
    differ = [key for key in entries if found[key] is not entries[key]]
    if differ or (recipe is not None and found_recipe != recipe):
        what = (f"{differ[0]}: the rules give {found[differ[0]]}, the ops {entries[differ[0]]}" if differ else
                f"the rules' FP8 recipe {found_recipe} is not the file's {recipe}")
        raise PlanFileError(f"{source} holds rules that do not reproduce its ops ({len(differ) or 1} op(s), e.g. "
                            f"{what}); the file was edited. Its ops are what runs: remove the 'rules' entry (Plan.save "
                            "writes them again), or remove 'ops', 'fingerprint' and the rest to keep only the rules, "
                            "and load it with Plan.load(path, analysis=...).")


def _checked_rules(rules) -> tuple[Rule, ...]:
    if isinstance(rules, Rule) or isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise BadInputError(f"expected a sequence of compfx Rules; got {type(rules).__name__}.")
    rules = tuple(rules)
    wrong = [r for r in rules if not isinstance(r, Rule)]
    if wrong:
        raise BadInputError(f"expected compfx Rules; got {type(wrong[0]).__name__} {wrong[0]!r}. Write rules as "
                            "Rule('fp32', kind='layer_norm') (from compfx.plan_rules import Rule).")
    return rules


def deciding_rules(keys: Sequence[OpKey], rules: Sequence[Rule]) -> dict[OpKey, Rule]:
    """The rule that decides each op some rule selects (the highest level's); refuses rules that select no op
    and rules of one level that select one op and disagree."""
    rules = _checked_rules(rules)
    matched = [[key for key in keys if rule.matches(key)] for rule in rules]
    unused = [rule for rule, found in zip(rules, matched) if not found]
    if unused:
        raise PlanMismatchError(f"{len(unused)} rule(s) select no op of this model: {'; '.join(map(str, unused[:3]))}. "
                                "Check the module pattern and kind against the model's op keys (compfx analyze "
                                "prints them), or remove the rule.")
    decided: dict[OpKey, Rule] = {}
    for rule, found in zip(rules, matched):
        for key in found:
            other = decided.get(key)
            if other is None or rule.level > other.level:
                decided[key] = rule
            elif rule.level == other.level and rule.outcome() != other.outcome():
                raise BadInputError(f"rules '{other}' and '{rule}' are both at level {rule.level_name} and select "
                                    f"{key}, but disagree; within one level the rules that select an op must agree. "
                                    "Make one of them more specific (add a kind, an index, or name the op key).")
    return decided


def resolve_rules(keys: Sequence[OpKey], rules: Sequence[Rule], *, base: Mapping[OpKey, Precision] | None = None,
                  base_recipe: Float8Recipe | None = None) -> tuple[dict[OpKey, Precision], Float8Recipe | None]:
    """Each op's precision under ``rules`` (ops no rule selects keep ``base``'s), and the FP8 recipe.

    A plan runs one FP8 recipe (``Plan.fp8_recipe``), so rules that give FP8
    ops different recipes are refused, as is an op no rule selects without a base.
    """
    decided = deciding_rules(keys, rules)
    uncovered = [key for key in keys if key not in decided and (base is None or key not in base)]
    if uncovered:
        raise PlanMismatchError(f"no rule selects {len(uncovered)} op(s) (e.g. {', '.join(map(str, uncovered[:3]))}); "
                                "add a global rule such as Rule('follow'), or give a base plan "
                                "(Plan.from_rules(analysis, rules, base=Plan.amp(analysis))).")
    entries = {key: decided[key].precision if key in decided else Precision(base[key]) for key in keys}
    recipes = {decided[key].fp8_recipe for key in keys if key in decided and entries[key] is Precision.FP8}
    if any(entries[key] is Precision.FP8 for key in keys if key not in decided):
        recipes.add(base_recipe or Float8Recipe.TENSORWISE)
    if len(recipes) > 1:
        raise BadInputError(f"these rules give FP8 ops the recipes {sorted(map(str, recipes))}; a compfx plan runs one "
                            "FP8 recipe (plan.fp8_recipe). Give every 'fp8' rule the same fp8_recipe.")
    return entries, next(iter(recipes), None)


def rules_table(keys: Sequence[OpKey], rules: Sequence[Rule], tablefmt: str = "simple") -> str:
    """The rules as a table: level, what each selects, its precision, and how many ops it decides."""
    from tabulate import tabulate

    decided = Counter(deciding_rules(keys, rules).values())
    rows = [[i, rule.level_name, rule.selector(), rule.outcome(), decided[rule]] for i, rule in enumerate(rules)]
    return tabulate(rows, headers=["#", "level", "selects", "precision", "decides"], tablefmt=tablefmt)


# -- a plan as few rules ----------------------------------------------------------------------


def summarize(entries: Mapping[OpKey, Precision], fp8_recipe: Float8Recipe | str | None = None) -> tuple[Rule, ...]:
    """Few rules that reproduce ``entries`` exactly (what :meth:`compfx.Plan.rules` returns).

    A repeated block makes its ops' keys differ only in the block's number
    (``blocks.3.mlp.0:linear#0``), so the ops are grouped into *slots*: their
    module path with each all-digit component a ``*`` (``blocks.*.mlp.0``),
    kind and index. Rules are then chosen level by level, lowest first, each
    the candidate that saves the most rules still needed at the levels above
    (a rule per slot whose ops agree, an op-key rule per op left over),
    trying each precision as the global one; a rule the others make redundant
    is dropped. It is a greedy choice, so not a proven minimum, but exact by
    construction, and a plan tied by block gives as many rules for 8 blocks as
    for 2.

    >>> keys = [OpKey(f"blocks.{i}.{m}", "linear", 0) for i in range(8) for m in ("mlp", "attn")]
    >>> entries = {k: Precision.FP32 if k.module.endswith("attn") else Precision.LOW for k in keys}
    >>> [str(r) for r in summarize(entries)]
    ['every op -> low', 'module blocks.*.attn -> fp32']
    """
    if not entries:
        return ()
    recipe = Float8Recipe.parse(fp8_recipe, "fp8_recipe") if fp8_recipe is not None else None
    problem = _Problem(tuple(entries), tuple(Precision(p) for p in entries.values()), recipe)
    counts = Counter(problem.target)
    candidates = [_Summary(problem, precision).rules() for precision, _ in counts.most_common()]
    return min(candidates, key=len)


def _slot_path(path: str) -> str:
    """``blocks.3.mlp.0`` -> ``blocks.*.mlp.*``: a module path with its all-digit components generalised."""
    return ".".join("*" if part.isdigit() else part for part in path.split(".")) if path else ""


def _module_patterns(slot_paths: Iterable[str]) -> list[str]:
    """Candidate module globs: each slot path, and each of its proper prefixes' subtrees (``blocks.*.mlp.**``)."""
    patterns = []
    for path in slot_paths:
        parts = path.split(".") if path else []
        patterns.append(path)
        patterns += [".".join(parts[:n] + ["**"]) for n in range(1, len(parts))]
    return list(dict.fromkeys(patterns))


@dataclass
class _Problem:
    """The plan to summarise, indexed: op i has key ``keys[i]`` and precision ``target[i]``."""

    keys: tuple[OpKey, ...]
    target: tuple[Precision, ...]
    recipe: Float8Recipe | None

    def __post_init__(self):
        self.slot_of = [(_slot_path(k.module), k.kind, k.index) for k in self.keys]
        slots: dict[tuple, list[int]] = defaultdict(list)
        for i, slot in enumerate(self.slot_of):
            slots[slot].append(i)
        self.slots = dict(slots)
        self.ops_of_module: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(self.keys):
            self.ops_of_module[key.module].append(i)

    def rule(self, precision: Precision, **selector) -> Rule:
        return Rule(precision, fp8_recipe=self.recipe if precision is Precision.FP8 else None, **selector)

    def candidates(self, level: int) -> list[tuple[Rule, tuple[int, ...]]]:
        """Every rule of ``level`` worth trying, with the ops it selects: one per precision its ops have."""
        groups: dict[tuple, tuple[int, ...]] = {}
        if level == 1:
            by_kind = defaultdict(list)
            for i, key in enumerate(self.keys):
                by_kind[key.kind].append(i)
            groups = {(("kind", kind),): tuple(ops) for kind, ops in by_kind.items()}
        elif level in (2, 3):
            modules = list(self.ops_of_module)
            for pattern in _module_patterns(dict.fromkeys(s[0] for s in self.slots)):
                regex = glob_regex(pattern)
                ops = [i for m in modules if regex.fullmatch(_dotted(m)) for i in self.ops_of_module[m]]
                if level == 2:
                    groups[(("module", pattern),)] = tuple(ops)
                    continue
                by_kind = defaultdict(list)
                for i in ops:
                    by_kind[self.keys[i].kind].append(i)
                groups.update({(("module", pattern), ("kind", kind)): tuple(found) for kind, found in by_kind.items()})
        elif level == 4:
            for path, kind, index in self.slots:
                if "*" in path:
                    regex = glob_regex(path)
                    ops = [i for i in self.ops_of_module_matching(regex) if self.keys[i].kind == kind
                           and self.keys[i].index == index]
                    groups[(("module", path), ("kind", kind), ("index", index))] = tuple(ops)
        return [(self.rule(precision, **dict(selector)), ops) for selector, ops in groups.items()
                for precision in dict.fromkeys(self.target[i] for i in ops)]

    def ops_of_module_matching(self, regex: re.Pattern) -> list[int]:
        return [i for m, ops in self.ops_of_module.items() if regex.fullmatch(_dotted(m)) for i in ops]


class _Summary:
    """One greedy summary of a :class:`_Problem`, with ``precision`` as the global rule."""

    def __init__(self, problem: _Problem, precision: Precision):
        self.problem = problem
        self.current = [precision] * len(problem.keys)
        self.chosen: list[tuple[Rule, tuple[int, ...]]] = [(problem.rule(precision), tuple(range(len(problem.keys))))]

    def rules(self) -> tuple[Rule, ...]:
        for level in (1, 2, 3, 4):
            self._choose(level)
        target = self.problem.target
        self.chosen += [(self.problem.rule(target[i], module=k.module, kind=k.kind, index=k.index), (i,))
                        for i, k in enumerate(self.problem.keys) if self.current[i] is not target[i]]
        return self._pruned()

    def _slot_cost(self, slot, current) -> int:
        """Rules the levels above still need for one slot: op-key rules for its wrong ops, or a slot rule and
        op-key rules for the ops that disagree with it (a slot without a wildcard is one op: no slot rule)."""
        ops = self.problem.slots[slot]
        target = self.problem.target
        wrong = sum(current(i) is not target[i] for i in ops)
        if wrong == 0 or "*" not in slot[0]:
            return wrong
        return min(wrong, 1 + min(sum(target[i] is not p for i in ops) for p in {target[i] for i in ops}))

    def _gain(self, ops: tuple[int, ...], precision: Precision) -> int:
        """Rules saved above by setting ``ops`` to ``precision``, less this rule."""
        touched = set(ops)
        slots = {self.problem.slot_of[i] for i in ops}
        before = sum(self._slot_cost(s, self.current.__getitem__) for s in slots)
        after = sum(self._slot_cost(s, lambda i: precision if i in touched else self.current[i]) for s in slots)
        return before - after - 1

    def _choose(self, level: int) -> None:
        """Take the rules of ``level`` that save rules above, best first (lazily: a rule's score is worked out
        again when it reaches the top, and taken if it still beats the next one's last score)."""
        candidates = self.problem.candidates(level)
        decided: dict[int, Precision] = {}  # ops a rule of this level selects: another rule of it must agree there
        heap = [(-score[0], -score[1], n) for n, (rule, ops) in enumerate(candidates)
                if (score := self._score(rule, ops, decided)) is not None]
        heapq.heapify(heap)
        while heap:
            _, _, n = heapq.heappop(heap)
            rule, ops = candidates[n]
            score = self._score(rule, ops, decided)
            if score is None:
                continue
            if heap and (-score[0], -score[1]) > heap[0][:2]:  # another may be better now: look again
                heapq.heappush(heap, (-score[0], -score[1], n))
                continue
            self.chosen.append((rule, ops))
            for i in ops:
                self.current[i] = decided[i] = rule.precision

    def _score(self, rule: Rule, ops: tuple[int, ...], decided: Mapping[int, Precision]) -> tuple[int, int] | None:
        """(rules saved above, ops it fixes), or None when the rule is not worth taking or may not be taken.

        A rule that saves as many rules above as it costs is still taken: the lower level reads better, and the
        slot rules the estimate counts on are only made at level 4."""
        if any(decided.get(i, rule.precision) is not rule.precision for i in ops):
            return None
        target = self.problem.target
        fixed = sum(self.current[i] is not rule.precision and target[i] is rule.precision for i in ops)
        if not fixed:
            return None
        gain = self._gain(ops, rule.precision)
        return (gain, fixed) if gain >= 0 else None

    def _pruned(self) -> tuple[Rule, ...]:
        """The chosen rules without those the others make redundant (each tried, highest level first; an op-key
        rule is never redundant: it was made for an op no other rule gives its precision)."""
        chosen = dict(enumerate(self.chosen))
        covering: dict[int, list[int]] = defaultdict(list)  # op -> the chosen rules that select it
        for n, (_, ops) in chosen.items():
            for i in ops:
                covering[i].append(n)
        target = self.problem.target
        for n in sorted((n for n, (rule, _) in chosen.items() if rule.level < 5), key=lambda n: -chosen[n][0].level):
            def decides_right(i: int) -> bool:
                others = [chosen[m][0] for m in covering[i] if m != n and m in chosen]
                return bool(others) and max(others, key=lambda r: r.level).precision is target[i]
            if all(decides_right(i) for i in chosen[n][1]):
                del chosen[n]
        return tuple(sorted((rule for rule, _ in chosen.values()), key=lambda r: r.level))
