"""Each misuse is a CompfxError that names the fix, before any work, and changes nothing; what was silently
accepted is refused; what would hang is refused or bounded.

The table ``CASES`` holds every bad input that one call shows: each must raise its ``CompfxError`` subclass
with a message that says what to do (a short first line, no traceback in it), and leave the caller's model,
optimizer, RNG and files as they were. The tests after it cover what needs more than one call to show (a
file's reading, a warning and a result, a process that would otherwise block, the command line's exit code),
one test per case, parametrized where cases share a shape; where a refusal is new, a comment says what happened
before: a raw error from inside torch or Python, a search that would not end, or nothing at all.
What a refused or failed search leaves of the user's state is in ``tests/test_state_kept.py``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn as nn

import compfx
from compfx import cache
from compfx.cli import main
from compfx.compile_backend import backend, compile_with_plan
from compfx.errors import (BadInputError, CacheKeyError, CompfxError, FileWriteError, LogIntegrityError,
                           PlanFileError, PlanMismatchError)
from compfx.graph_capture import capture
from compfx.plan import Plan
from compfx.planned_module import PlannedModule, apply
from compfx.search import SearchConfig
from compfx.search import sampling
from compfx.search.log import DIGEST, SearchLog
from compfx.state import restore_state, snapshot_state
from tests.helpers import batches, ce, nll
from tests.quick import quick_config
from tests.test_state_kept import SEARCH, Net, Other, Tiny, search, setup, tiny_analysis

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

#: over tests.quick's: the smallest search with both stages
CHEAP = dict(stage1_budget=2, stage2_budget=1, stage2_check_batches=1, predictor=False, cache_plan=False)


# -- what a case gets, and what its calls need ----------------------------------------------------------

def _unseeded(make: Callable):
    """``make()`` with the RNG it draws from put back: made on a case's first use, inside the RNG it measures."""
    with torch.random.fork_rng(devices=[]):
        return make()


@functools.cache
def other_model() -> nn.Module:
    """Another model: none of its op keys is Tiny's (shared by the cases; none of them changes it)."""
    return _unseeded(Other)


@functools.cache
def other_plan() -> Plan:
    """AMP's plan of the other model: a valid plan, of another fingerprint."""
    return Plan.amp(compfx.analyze(other_model(), torch.ones(6, 4)))


@functools.cache
def meta_model() -> nn.Module:
    """A Tiny on the meta device: shapes, no values."""
    return _unseeded(lambda: Tiny().to("meta"))


class Ctx:
    """What a case gets: a Tiny with Adam state, its loader and a folder, made for each case (cheap). The model's
    own analysis is captured on first use, by the cases that apply a plan to it; the plans, the other models and a
    Tiny's analysis for bitstrings come from caches the cases share: a case that only reads a file captures
    nothing."""

    def __init__(self, tmp_path: Path):
        self.model, self.opt, self.loader = setup()
        self.x = self.loader[0][0]
        self.tmp = tmp_path
        self.wrong_x = torch.zeros(6, 5)

    @functools.cached_property
    def analysis(self) -> compfx.Analysis:
        """This model's analysis (apply and the guard check that it is this model object's)."""
        return compfx.analyze(self.model, self.x)

    @property
    def tiny_analysis(self) -> compfx.Analysis:
        """A Tiny's analysis, shared: for plans and bitstrings, never applied to a model."""
        return tiny_analysis()

    @property
    def amp_plan(self) -> Plan:
        """AMP's plan of a Tiny (of any Tiny: a plan names op keys, not weights)."""
        return Plan.amp(tiny_analysis())

    other_model = property(lambda self: other_model())
    other_plan = property(lambda self: other_plan())
    meta_model = property(lambda self: meta_model())

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def plan_file(self, name: str = "plan.json", **changes) -> Path:
        return self.file(name, json.dumps({**self.amp_plan.to_dict(), **changes}))

    def optimize(self, loader=None, config=None, **kwargs):
        kwargs.setdefault("loss_fn", nll)
        kwargs.setdefault("optimizer", self.opt)
        return compfx.optimize(self.model, self.loader if loader is None else loader,
                               config=config or quick_config(**SEARCH, cache_dir=self.tmp / "cache"), **kwargs)


def _compile_foreign(c: Ctx):
    """An explicit plan of another model given to backend(): the refusal reaches the caller as itself."""
    torch._dynamo.reset()
    try:
        torch.compile(c.model, backend=backend(c.other_plan, inner="eager"))(c.x)
    finally:
        torch._dynamo.reset()


def _with_env(name: str, value: str, call):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return call()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


class _IterRaisesStopIteration:
    def __iter__(self):
        raise StopIteration


def _emptied_optimizer(c: Ctx):
    c.opt.param_groups[0]["params"], kept = [], c.opt.param_groups[0]["params"]
    try:
        return c.optimize()
    finally:
        c.opt.param_groups[0]["params"] = kept


def _closure_optimizer(c: Ctx):
    """LBFGS steps only with a closure; the search failed in its FP32 epoch, after the capture."""
    lbfgs = torch.optim.LBFGS(c.model.parameters())
    return compfx.optimize(c.model, c.loader, optimizer=lbfgs, loss_fn=nll,
                           config=quick_config(**SEARCH, cache_dir=c.tmp / "cache"))


def _guard(c: Ctx, **settings):
    return compfx.Guard(PlannedModule(c.model, Plan.amp(c.analysis), analysis=c.analysis), **settings)


def _guard_step_twice(c: Ctx):
    guard = _guard(c)
    loss = guard.planned(c.x).sum()
    loss.backward()
    before = snapshot_state(c.model, c.opt)
    guard.step(c.opt, loss)
    restore_state(before)  # undo the first, legitimate step: the case is about the second
    try:
        guard.step(c.opt, loss)  # no new backward
    finally:
        c.model.zero_grad(set_to_none=True)


def _guard_foreign_optimizer(c: Ctx):
    guard = _guard(c)
    guard.planned(c.x).sum().backward()
    try:
        guard.step(torch.optim.SGD(c.other_model.parameters(), lr=0.1), torch.tensor(1.0))
    finally:
        c.model.zero_grad(set_to_none=True)


def _guard_bad_state(c: Ctx):
    guard = _guard(c)
    state = {**guard.state_dict(), "plan": Plan.fp32(c.analysis).to_dict(), "steps": "x"}
    try:
        guard.load_state_dict(state)
    finally:
        assert guard.plan == Plan.amp(c.analysis), "the module's plan was replaced before the state was refused"


def _lightning_load_none(c: Ctx):
    from compfx.integrations.lightning import CompfxCallback

    CompfxCallback().load_state_dict(None)


def _symlinked_log(c: Ctx):
    target = c.file("notes.txt", "the user's notes")
    (c.tmp / "log.jsonl").symlink_to(target)
    try:
        return c.optimize(log=c.tmp / "log.jsonl")
    finally:
        assert target.read_text() == "the user's notes"


def _meta(c: Ctx):
    model = c.meta_model
    return compfx.optimize(model, c.loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nll,
                           config=quick_config(**SEARCH))


def _nan_cost(c: Ctx):
    return c.optimize(config=quick_config(**SEARCH, cost_fn=lambda plan, seconds: math.nan, cache_plan=False))


def _sparse(c: Ctx, name: str, size: int) -> Path:
    path = c.tmp / name
    with open(path, "wb") as handle:
        handle.truncate(size)  # a sparse file: its size without its bytes on disk
    return path


def _save_crafted(c: Ctx, fingerprint: str):
    """A plan file whose fingerprint names a path: loading it is refused already (it names no model), so it never
    reaches the cache, which would refuse it too."""
    plan = Plan.load(c.plan_file(fingerprint=fingerprint))
    return cache.save_plan(plan, cache_dir=c.tmp / "cache")


# -- a finished search's log, and its tampered copies ----------------------------------

def _logged(c: Ctx) -> Path:
    path = c.tmp / "search.jsonl"
    before = snapshot_state(c.model, c.opt)
    c.optimize(log=path, config=quick_config(**SEARCH, keep_search_training=False, cache_plan=False))
    assert before.matches()
    return path


def _tampered(c: Ctx, change) -> Path:
    path = _logged(c)
    lines = path.read_text().splitlines()
    change(lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def _scale_losses(lines):  # the attack: losses scaled, the JSON still valid
    for i, line in enumerate(lines):
        data = json.loads(line)
        if isinstance(data.get("loss"), float):
            data["loss"] *= 10
            lines[i] = json.dumps(data)


def _strip_digests(lines):  # a log as compfx wrote it before digests
    lines[:] = [json.dumps({k: v for k, v in json.loads(line).items() if k != DIGEST}) for line in lines]


def _swap(lines):
    lines[1], lines[2] = lines[2], lines[1]


def _resume(c: Ctx, path: Path):
    return c.optimize(log=path, resume=True,
                      config=quick_config(**SEARCH, keep_search_training=False, cache_plan=False))


def _spread(model):
    model.fc2.to("meta")
    return model


# -- the table -----------------------------------------------------------------------------

class Case(NamedTuple):
    call: Callable[[Ctx], object]
    error: type[CompfxError]
    words: str  # the message must hold them
    chained: bool | None = None  # the error is raised from the exception it explains (None: not checked)
    keeps_model: bool = True  # False: the case itself moves the model (to show what is refused)


CASES = {name: Case(*case) for name, case in {  # name -> (call(ctx), error class, words[, chained[, keeps_model]])
    # section 6, raw errors
    "plan file binary": (lambda c: Plan.load(c.file("p.json", b"\xff\xfe\x00\x81garbage")), PlanFileError,
                         "not UTF-8"),
    "plan file huge integer": (lambda c: Plan.load(c.file("p.json", '{"version": ' + "9" * 5000 + "}")),
                               PlanFileError, "Delete it"),
    "plan file nested deeply": (lambda c: Plan.load(c.file("p.json", "[" * 100_000 + "]" * 100_000)),
                                PlanFileError, "nested too deeply"),
    "plan save into a folder": (lambda c: c.amp_plan.save(c.tmp), FileWriteError, "not a folder"),
    "plan save under a file": (lambda c: c.amp_plan.save(c.file("f", "x") / "plan.json"),
                               FileWriteError, "could not write"),
    "device tpu9": (lambda c: compfx.analyze(c.model, c.x, device="tpu9"), BadInputError, "e.g. 'cpu'"),
    "optimize config dict": (lambda c: c.optimize(config={"threshold": 1.0}), BadInputError, "SearchConfig("),
    "optimize log is a folder": (lambda c: c.optimize(log=c.tmp), FileWriteError, "Pass another log="),
    "optimize log under a file": (lambda c: c.optimize(log=c.file("f", "x") / "log.jsonl"), FileWriteError,
                                  "Pass another log="),
    "analyze a string": (lambda c: compfx.analyze("model", c.x), BadInputError, "nn.Module"),
    "analyze string capability": (lambda c: compfx.analyze(c.model, c.x, device="cuda", capability="8,0"),
                                  BadInputError, "(8, 0)"),
    "bitstring None": (lambda c: Plan.from_bitstring(c.tiny_analysis, None), PlanMismatchError, "'0f1'"),
    "log line a JSON list": (lambda c: SearchLog.read(c.file("log.jsonl", "[1, 2]\n")), PlanFileError,
                             "JSON list"),
    "backend inner nonexistent": (lambda c: backend(inner="nonexistent"), BadInputError, "list_backends"),
    # section 6, accepted silently
    "threshold True": (lambda c: SearchConfig(threshold=True), BadInputError, "threshold=True"),
    "prune 'no'": (lambda c: SearchConfig(prune="no"), BadInputError, "True or False"),
    "keep_search_training 'no'": (lambda c: SearchConfig(keep_search_training="no"), BadInputError, "True or False"),
    "progress 'no'": (lambda c: SearchConfig(progress="no"), BadInputError, "True or False"),
    "seed 2**70": (lambda c: SearchConfig(seed=2 ** 70), BadInputError, "torch.manual_seed"),
    "cost_fn NaN": (_nan_cost, BadInputError, "Fix cost_fn"),
    "plan of another fingerprint": (
        lambda c: apply(c.model, Plan(dict(Plan.amp(c.analysis)), low_dtype=c.analysis.low_dtype,
                                      fingerprint="0123456789abcdef"), analysis=c.analysis),
        PlanMismatchError, "Build the plan from this model's analysis"),
    "plan of another low dtype": (
        lambda c: apply(c.model, Plan(dict(Plan.amp(c.analysis)), low_dtype=torch.float16,
                                      fingerprint=c.analysis.fingerprint), analysis=c.analysis),
        PlanMismatchError, "low_dtype=torch.float16"),
    "backend plan of another model": (_compile_foreign, PlanMismatchError, "Pass this model's plan"),
    "compile_with_plan of another model": (
        lambda c: compile_with_plan(c.model, c.other_plan, inner="eager"),
        PlanMismatchError, "Pass this model's plan"),
    "plan file fingerprint null": (lambda c: Plan.load(c.plan_file(fingerprint=None)), PlanFileError,
                                   "fingerprint None"),
    "plan file version 99": (lambda c: Plan.load(c.plan_file(version=99)), PlanFileError, "plan version 1"),
    "plan file of 40 MB": (lambda c: Plan.load(_sparse(c, "big.json", 40 << 20)), PlanFileError,
                           "more than the"),
    # section 6, thin or misleading messages
    "loader [None, None]": (lambda c: c.optimize(loader=[None, None]), BadInputError, "NoneType"),
    "meta-device model": (_meta, BadInputError, "to_empty"),
    "plan file float64": (lambda c: Plan.load(c.plan_file(low_dtype="float64")), PlanFileError,
                          "'float64'; expected one of ['float16', 'bfloat16']"),
    "wrong input shape": (lambda c: compfx.analyze(c.model, c.wrong_x), BadInputError,
                          "Give example inputs that forward() accepts"),
    # path traversal
    "cache fingerprint ../outside": (lambda c: _save_crafted(c, "../outside/pwned"), PlanFileError,
                                     "16 lowercase hex digits"),
    "cache fingerprint absolute": (lambda c: _save_crafted(c, str(c.tmp / "abs")), PlanFileError,
                                   "16 lowercase hex digits"),
    "cache lookup ../outside": (lambda c: cache.find_plan("../x", cache_dir=c.tmp), CacheKeyError, "16 hex digits"),
    "cache_dir not a path": (lambda c: cache.find_plan("0123456789abcdef", cache_dir=3), CacheKeyError,
                             "folder path"),
    # tampered logs
    "resume scaled losses": (lambda c: _resume(c, _tampered(c, _scale_losses)), LogIntegrityError,
                             "line 1 does not match its digest"),
    "resume reordered lines": (lambda c: _resume(c, _tampered(c, _swap)), LogIntegrityError, "line 2"),
    "resume log without digests": (lambda c: _resume(c, _tampered(c, _strip_digests)), LogIntegrityError,
                                   "without resume=True"),
    "read log with one line dropped": (lambda c: SearchLog.read(_tampered(c, lambda lines: lines.pop(1))),
                                       LogIntegrityError, "line 2"),
    # paths that are not paths, files that are not regular, links
    "plan load None": (lambda c: Plan.load(None), BadInputError, "not a path"),
    "plan save None": (lambda c: c.amp_plan.save(None), BadInputError, "not a path"),
    "plan load NUL in path": (lambda c: Plan.load(str(c.tmp / "p\0.json")), BadInputError, "NUL"),
    "plan save NUL in path": (lambda c: c.amp_plan.save(str(c.tmp / "p\0.json")), BadInputError, "NUL"),
    "optimize log /dev/null": (lambda c: c.optimize(log="/dev/null"), FileWriteError, "not a file compfx can write"),
    "optimize log a symlink": (_symlinked_log, FileWriteError, "symbolic link"),
    "optimize log over a file of the user's": (lambda c: c.optimize(log=c.file("notes.txt", "mine")),
                                               FileWriteError, "does not overwrite it"),
    "plan save over a file of the user's": (lambda c: c.amp_plan.save(c.file("notes.json", '{"a": 1}')),
                                            FileWriteError, "does not overwrite it"),
    "COMPFX_CACHE_DIR ~nouser": (lambda c: _with_env(cache.CACHE_DIR_ENV, "~nouser_compfx/c",
                                                     lambda: c.optimize(config=quick_config(**SEARCH))),
                                 CacheKeyError, "cannot be expanded"),
    "cache_dir with NUL": (lambda c: c.optimize(config=quick_config(**SEARCH, cache_dir="a\0b")), CacheKeyError,
                           "NUL"),
    # loaders and optimizers
    "loader __iter__ raises StopIteration": (lambda c: c.optimize(loader=_IterRaisesStopIteration()), BadInputError,
                                             "__iter__ raised StopIteration"),
    "loss_fn detaching the output": (lambda c: c.optimize(loss_fn=lambda out, b: nll(out.detach(), b)),
                                     BadInputError, "does not require grad"),
    "optimizer with its parameters emptied": (_emptied_optimizer, BadInputError, "holds no parameters"),
    "optimizer stepping only with a closure": (_closure_optimizer, BadInputError, "needs a closure"),
    "diagnose a meta-device model": (lambda c: compfx.diagnose(c.meta_model, c.x), BadInputError, "meta device"),
    "diagnose integer batches": (lambda c: compfx.diagnose(c.model, torch.ones(6, 4, dtype=torch.long)),
                                 BadInputError, "before diagnose"),
    "lightning load_state_dict(None)": (_lightning_load_none, PlanFileError, "expected the mapping"),
    # the guard's use
    "guard drift_threshold True": (lambda c: _guard(c, drift_threshold=True), BadInputError, "not a bool"),
    "guard min_scale NaN": (lambda c: _guard(c, min_scale=math.nan), BadInputError, "min_scale=nan"),
    "guard step without a new backward": (_guard_step_twice, BadInputError, "without a backward"),
    "guard step with another model's optimizer": (_guard_foreign_optimizer, BadInputError, "not the guarded"),
    "guard state with a bad counter": (_guard_bad_state, PlanFileError, "expected counts"),
    # the entry points' arguments, with whether the error chains the one it explains
    "capture not a module": (lambda c: capture("model", c.x), BadInputError, "nn.Module", False),
    "capture bad method": (lambda c: capture(c.model, c.x, method="jit"), BadInputError, "method", False),
    "analyze int8": (lambda c: compfx.analyze(c.model, c.x, low_dtype=torch.int8), BadInputError, "low_dtype",
                     False),
    "apply not a plan": (lambda c: apply(c.model, "0101"), BadInputError, "Plan", False),
    "apply without inputs": (lambda c: apply(c.model, Plan.fp32(c.analysis)), BadInputError, "example_inputs",
                             False),
    "bitstring bad letter": (lambda c: Plan.from_bitstring(c.tiny_analysis, "x" * 9), PlanMismatchError,
                             "bitstring", False),
    "bitstring wrong length": (lambda c: Plan.from_bitstring(c.tiny_analysis, "01"), PlanMismatchError, "", False),
    "plan file missing": (lambda c: Plan.load(c.tmp / "nope.json"), PlanFileError, "does not exist", True),
    "plan file corrupt": (lambda c: Plan.load(c.file("plan.json", '{"format": ')), PlanFileError, "plan.json", True),
    "plan file not a plan": (lambda c: Plan.load(c.file("plan.json", '{"a": 1}')), PlanFileError,
                             "not a compfx plan", False),
    "log file corrupt": (lambda c: SearchLog.read(c.file("plan.json", '{"x": 1}\n{"stage": 1}\n')), PlanFileError,
                         "line 1", True),
    "optimize empty loader": (lambda c: c.optimize(loader=[]), BadInputError, "no batches", False),
    "optimize batch of wrong type": (lambda c: c.optimize(loader=["text"] * 2), BadInputError, "str", False),
    "optimize batch of wrong shape": (lambda c: c.optimize(loader=[(c.wrong_x, c.loader[0][1])]), BadInputError,
                                      "first batch", True),
    "optimize non-scalar loss": (lambda c: c.optimize(loss_fn=lambda out, b: out), BadInputError, "scalar", False),
    "optimize loss_fn raises": (lambda c: c.optimize(loss_fn=lambda out, b: out[99]), BadInputError,
                                "loss_fn failed", True),
    "optimize no loss at all": (lambda c: c.optimize(loss_fn=None), BadInputError, "without a loss", False),
    "optimizer of another model": (lambda c: c.optimize(optimizer=torch.optim.SGD(c.other_model.parameters(), 0.1)),
                                   BadInputError, "not this model's", False),
    "optimizer not an optimizer": (lambda c: c.optimize(optimizer="adam"), BadInputError, "Optimizer", False),
    "one-shot iterator": (lambda c: c.optimize(loader=iter(c.loader)), BadInputError, "iterator", False),
    "model on two devices": (lambda c: c.optimize(optimizer=torch.optim.SGD(_spread(c.model).parameters(), 0.1)),
                             BadInputError, "spread", False, False),
    "config threshold": (lambda c: SearchConfig(threshold=0.5), BadInputError, "threshold", False),
    "resume without log": (lambda c: c.optimize(resume=True), PlanFileError, "log=", False),
}.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_a_compfx_error_that_names_the_fix_and_changes_nothing(tmp_path, name, capfd):
    case = CASES[name]
    c = Ctx(tmp_path)
    before = snapshot_state(c.model, c.opt)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    with pytest.raises(case.error) as caught:
        case.call(c)
    error = caught.value
    assert isinstance(error, CompfxError) and case.words in str(error), str(error)
    first = str(error).splitlines()[0]
    assert not any(marker in first for marker in ("Traceback", "While executing", 'File "')), first
    assert len(first) < 600, first
    if case.chained is not None:
        assert (error.__cause__ is not None) == case.chained, error.__cause__
    if case.keeps_model:
        assert before.matches(), "the model or optimizer changed"
        assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in c.model.parameters())
    assert torch.equal(torch.get_rng_state(), rng), "the caller's RNG changed"
    assert "Traceback" not in capfd.readouterr().err  # nothing dumped to stderr on the way
    assert not (tmp_path.parent / "outside").exists()


# -- refusals that need more than one call to show, one test each -----------------------------

def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.fixture
def planned():
    model = mlp()
    analysis = compfx.analyze(model, torch.randn(4, 8))
    return model, PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis)


# -- compile_with_plan: checked before torch.compile ----------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"dynamic": "yes"}, "dynamic='yes'; expected None"),  # before: torch.compile took it without a word
    ({"fullgraph": "no"}, "fullgraph='no'; expected True or False"),  # before: 'no' is truthy: fullgraph=True
    ({"inductor_options": "fast"}, "expected a mapping of Inductor config names"),  # before: TypeError
    ({"inductor_options": {"no_such_option": 1}}, "not Inductor config options"),  # before: at the first call
], ids=["dynamic", "fullgraph", "inductor options not a mapping", "unknown inductor option"])
def test_compile_with_plan_refuses_bad_options_before_compiling(planned, kwargs, words):
    model, module = planned
    with pytest.raises(BadInputError, match=words):
        compile_with_plan(model, module.plan, **kwargs)


def _raises(gm, example_inputs):
    raise RuntimeError("my backend is broken")


def _returns_none(gm, example_inputs):
    return None


@pytest.mark.parametrize("inner, words", [(_raises, "raised RuntimeError: my backend is broken"),
                                          (_returns_none, "returned NoneType, not a callable")],
                         ids=["raises", "returns None"])
def test_an_inner_backend_that_fails_is_a_compfx_error_naming_it(planned, inner, words, fresh_dynamo):
    # before: torch._dynamo's BackendCompilerFailed, from deep inside dynamo
    model, module = planned
    compiled = compile_with_plan(model, module.plan, inner=inner)
    with pytest.raises(BadInputError, match=f"inner backend '{inner.__name__}' {words}.*inner='inductor'"):
        compiled(torch.randn(4, 8))


def test_an_inner_backend_that_cannot_be_called_as_one_is_refused_at_once(planned):
    model, module = planned
    with pytest.raises(BadInputError, match="cannot be called as inner\\(gm, example_inputs\\)"):
        compile_with_plan(model, module.plan, inner=lambda: None)


# -- the guard ------------------------------------------------------------------------------------

def _backward(module):
    loss = module(torch.randn(4, 8)).square().mean()
    loss.backward()
    return loss


def test_guard_step_refuses_an_optimizer_that_needs_a_closure(planned):
    # before: TypeError from inside LBFGS.step
    model, module = planned
    guard = compfx.Guard(module)
    loss = _backward(module)
    with pytest.raises(BadInputError, match="LBFGS, whose step\\(\\) needs a closure"):
        guard.step(torch.optim.LBFGS(model.parameters()), loss)


def test_guard_step_refuses_a_batch_its_loss_fn_cannot_take_and_takes_no_step(planned):
    # before: the loss function's own TypeError, raised inside the shadow comparison
    model, module = planned
    guard = compfx.Guard(module, shadow_every=1, loss_fn=ce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = _backward(module)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BadInputError, match="batch loss_fn cannot take"):
        guard.step(optimizer, loss, batch="garbage")
    assert guard.steps == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert guard.step(optimizer, loss, batch=(None, torch.randint(0, 3, (4,)))) is True  # the same step, retried


def test_guard_refuses_the_grad_scaler_class_for_an_object(planned):
    # before: accepted (the class has the methods), failing at the first step
    with pytest.raises(BadInputError, match="the class GradScaler"):
        compfx.Guard(planned[1], scaler=torch.amp.GradScaler)


def test_a_second_guard_on_one_module_is_refused_until_the_first_is_removed(planned):
    # before: two guards each repaired the plan and stepped the optimizer
    first = compfx.Guard(planned[1])
    with pytest.raises(BadInputError, match="already has a compfx.Guard"):
        compfx.Guard(planned[1])
    first.remove()
    assert compfx.Guard(planned[1]).steps == 0


def test_a_guard_state_repairing_an_op_the_model_lacks_is_refused(planned):
    # before: loaded, its repair record naming an op of another model
    guard = compfx.Guard(planned[1])
    state = guard.state_dict()
    state["repairs"] = [{"key": "9:linear#0", "step": 3, "reason": "non-finite loss", "was": "low"}]
    with pytest.raises(PlanMismatchError, match="9:linear#0"):
        guard.load_state_dict(state)
    assert guard.repairs == []


def test_guard_step_with_one_optimizer_over_the_planned_module_and_an_unplanned_head(planned):
    # before: refused ("parameter(s) that are not the guarded module's"), though it is an ordinary setup
    model, module = planned
    head = nn.Linear(3, 2)
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    guard = compfx.Guard(module)
    before = head.weight.detach().clone()
    loss = head(module(torch.randn(4, 8))).square().mean()
    loss.backward()
    assert guard.step(optimizer, loss) is True
    assert not torch.equal(before, head.weight) and guard.steps == 1
    with pytest.raises(BadInputError, match="only parameters that are not the guarded module's"):
        guard.step(torch.optim.SGD(head.parameters(), lr=0.1), loss)


def test_a_guard_refuses_a_second_step_on_one_backward_and_steps_after_the_next():
    torch.manual_seed(0)
    model = Net()
    analysis = compfx.analyze(model, torch.randn(2, 4))
    fast = PlannedModule(model, Plan.amp(analysis), analysis=analysis)
    guard, optimizer = compfx.Guard(fast), torch.optim.SGD(model.parameters(), lr=0.1)
    loss = fast(torch.randn(2, 4)).sum()
    loss.backward()
    assert guard.step(optimizer, loss) is True
    stepped = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BadInputError, match="without a backward since the last step"):
        guard.step(optimizer, loss)
    assert guard.steps == 1 and all(torch.equal(a, b) for a, b in zip(stepped, model.parameters()))
    optimizer.zero_grad()
    loss = fast(torch.randn(2, 4)).sum()
    loss.backward()
    assert guard.step(optimizer, loss) is True and guard.steps == 2
    emptied = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    emptied.param_groups[0]["params"] = []
    with pytest.raises(BadInputError, match="holding no parameters"):
        guard.step(emptied, loss)


# -- the command line ------------------------------------------------------------------------------

def meta_inputs():
    """``--inputs`` for the CLI tests: token ids on the meta device (shapes, no values)."""
    return torch.zeros(4, 64, device="meta")


def _cli_exit(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusal
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, words", [
    (["search", "compfx.examples:mlp", "--inputs", "tests.test_refusals:meta_inputs", "--loss",
      "tests.test_refusals:mean_loss"], "meta device"),  # before: a raw error from inside the search
    (["search", "compfx.examples:mlp", "--input-shape", "4,64", "--classes", "10", "--batches", "1000000000"],
     "more than the 10,000"),  # before: std::bad_alloc after two minutes
    (["search", "compfx.examples:mlp", "--input-shape", "4096,64", "--classes", "10", "--batches", "10000"],
     "synthetic batches may hold"),
], ids=["inputs on meta", "a billion batches", "batches too large together"])
def test_cli_search_refuses_inputs_it_cannot_run_with_one_line(argv, words, capsys):
    assert words in _cli_exit(argv, capsys)


def mean_loss(output, batch):
    return output.float().mean()


def meta_batches():
    """``--data`` for the CLI tests: (inputs, target) batches on the meta device."""
    return [(torch.zeros(4, 64, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"))] * 2


def test_cli_search_refuses_batches_on_meta_from_a_data_factory(capsys):
    # before: a raw error from moving the batch ("Cannot copy out of meta tensor")
    err = _cli_exit(["search", "compfx.examples:mlp", "--data", "tests.test_refusals:meta_batches"], capsys)
    assert "meta device" in err and "real tensors" in err


@pytest.mark.parametrize("argv, says", [
    (["compfx.examples:__doc__"], "not a factory"),  # an attribute that is not callable
    (["compfx.examples:cnn", "--device", "tpu9"], "not a device torch knows"),
    (["compfx.examples:cnn", "--capability", "8,x"], "not a compute capability"),
    (["builtins:str"], "returned a str, not an nn.Module"),  # a factory returning a non-module
    (["builtins:int"], "returned a int, not an nn.Module"),  # ... and one returning an int
    (["json:dumps"], "takes no arguments"),  # a factory that needs arguments
])
def test_cli_mistakes_exit_2_with_one_clear_line(capsys, argv, says):
    try:
        code = main(["analyze", argv[0], "--input-shape", "8,1,8,8", *argv[1:]])
    except SystemExit as exit_:  # argparse's own refusal of a malformed option
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err


def exits_7():
    """A model factory that calls sys.exit(7) (the CLI must report it, not exit 7 silently)."""
    sys.exit(7)


@pytest.mark.parametrize("extra, says", [
    (["--input-shape", "100000,100000,100000", "--classes", "3"], "elements"),
    (["--input-shape", "8,1,8,8", "--classes", "0"], "positive whole number"),
    (["--input-shape", "8,1,8,8", "--classes", "3", "--lr=-1"], "positive finite number"),
    (["--input-shape", "8,1,8,8", "--classes", "3", "--seed", str(2 ** 70)], "torch.manual_seed"),
    (["--input-shape", "8,1,8,8", "--classes", "3", "--threshold", "nan"], "threshold=nan"),
])
def test_cli_search_refuses_bad_numbers_with_one_line(capsys, extra, says):
    assert says in _cli_exit(["search", "compfx.examples:cnn", *extra], capsys)


def test_cli_refuses_a_factory_calling_sys_exit_and_an_absurd_capability(capsys):
    err = _cli_exit(["analyze", "tests.test_refusals:exits_7", "--input-shape", "2,4"], capsys)
    assert "sys.exit(7)" in err
    assert "major 1-20" in _cli_exit(
        ["analyze", "compfx.examples:cnn", "--input-shape", "8,1,8,8", "--capability", "99,99"], capsys)


@pytest.mark.parametrize("flag", ["--plan", "--log"])
def test_cli_search_refuses_an_unwritable_output_before_the_search(tmp_path, capsys, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    other = "--log" if flag == "--plan" else "--plan"
    written = tmp_path / ("search.jsonl" if other == "--log" else "plan.json")
    err = _cli_exit(["search", "compfx.examples:cnn", "--input-shape", "8,1,8,8", "--classes", "3",
                                "--no-progress", flag, str(blocker / "out"), other, str(written)], capsys)
    assert str(blocker / "out") in err and not written.exists(), "the search ran before the path was checked"


def test_cli_search_refuses_a_plan_path_holding_a_file_of_the_users(tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    err = _cli_exit(["search", "compfx.examples:cnn", "--input-shape", "8,1,8,8", "--classes", "3",
                                "--no-progress", "--plan", str(notes)], capsys)
    assert "does not overwrite it" in err and notes.read_text() == '{"mine": true}'


# -- the search's settings and arguments ------------------------------------------------------------

@pytest.mark.parametrize("name", ["repeats", "warmup"])
def test_search_config_refuses_step_counts_that_would_not_end(name):
    # before: SearchConfig(rounds=10**9) was accepted, and the search ran for ever
    settings = {"decision": compfx.DecisionRule(rounds=10 ** 9)} if name == "rounds" else {name: 10 ** 9}
    with pytest.raises(BadInputError, match=f"{name}=1000000000.*(at most 1000 |\\[.*, 1000\\])"):
        compfx.SearchConfig(**settings)


def test_search_config_refuses_duels_that_would_not_end():
    with pytest.raises(BadInputError, match="rounds=1000000000.*at most 1000"):
        compfx.SearchConfig(decision=compfx.DecisionRule(rounds=10 ** 9))


class ReturnsText(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        self.fc(x)
        return "done"


_OTHER = nn.Linear(8, 3)

LOSSES_NOT_TIED = {  # model, loss_fn: each loss requires grad, and none reaches the model's parameters
    "another model's output": (mlp, lambda out, batch: ce(_OTHER(batch[0]), batch)),
    "a leaf tensor made from a float": (mlp, lambda out, batch: torch.tensor(ce(out, batch).item(), requires_grad=True)),
    "a forward returning a string": (ReturnsText, lambda out, batch: _OTHER(batch[0]).sum() * len(out)),
}


@pytest.mark.parametrize("make, loss_fn", LOSSES_NOT_TIED.values(), ids=LOSSES_NOT_TIED.keys())
def test_a_loss_that_does_not_reach_the_models_parameters_is_refused(make, loss_fn):
    # before: accepted; the search trained nothing and compared plans on a loss they cannot change
    model = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BadInputError, match="does not depend on the model's parameters"):
        compfx.optimize(model, batches(2, (4, 8)), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        loss_fn=loss_fn, config=quick_config(**CHEAP))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class SwapsItsLayer(nn.Module):
    """Replaces its layer whenever a batch of ``swap_at`` rows comes (a ragged last batch: mid-search)."""

    def __init__(self, swap_at: int | None):
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.swap_at = swap_at

    def forward(self, x):
        if self.swap_at is None or x.shape[0] == self.swap_at:
            self.fc = nn.Linear(8, 3)
        return self.fc(x)


@pytest.mark.parametrize("swap_at, loader", [(None, batches(2, (4, 8))),
                                              (3, batches(2, (4, 8)) + batches(1, (3, 8)))],
                         ids=["at every call", "mid-search, at a ragged batch"])
def test_a_forward_that_replaces_a_layer_is_refused_and_the_layer_put_back(swap_at, loader):
    # before: accepted; the optimizer trained a layer the model no longer held
    model = SwapsItsLayer(swap_at)
    layer = model.fc
    with pytest.raises(CompfxError, match="replace[sd]* submodules"):
        compfx.optimize(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=ce,
                        config=quick_config(**CHEAP))
    assert model.fc is layer


# -- plans and analyses -----------------------------------------------------------------------------

def test_an_fp8_bitstring_on_an_analysis_without_fp8_is_refused_at_once():
    # before: Plan.from_bitstring(a, "8f0") built a plan that failed only when applied
    analysis = compfx.analyze(mlp(), torch.randn(4, 8))
    with pytest.raises(PlanMismatchError, match="cannot run FP8.*analyze\\(..., fp8=True\\)"):
        compfx.Plan.from_bitstring(analysis, "8f0")


@pytest.mark.parametrize("fingerprint", ["../outside", "0123", "0123456789ABCDEF", "/tmp/0123456789abcdef"])
def test_a_fingerprint_that_is_not_16_hex_digits_is_refused(fingerprint, tmp_path):
    # before: accepted, and "../outside" named a path outside the cache when the plan was cached
    analysis = compfx.analyze(mlp(), torch.randn(4, 8))
    with pytest.raises(PlanMismatchError, match="16 lowercase hex digits"):
        compfx.Plan(dict(compfx.Plan.amp(analysis)), low_dtype=analysis.low_dtype, fingerprint=fingerprint)
    data = {**compfx.Plan.amp(analysis).to_dict(), "fingerprint": fingerprint}
    path = tmp_path / "plan.json"
    path.write_text(__import__("json").dumps(data))
    with pytest.raises(PlanFileError, match="16 lowercase hex digits"):
        compfx.Plan.load(path)


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a GPU of index 7")
def test_analyze_for_a_cuda_device_this_process_cannot_see_needs_its_capability():
    # before: accepted; the Tensor Core and FP8 rules then read no capability, without a word
    with pytest.raises(BadInputError, match="'cuda:7' is not a device this process can see.*capability="):
        compfx.analyze(mlp(), torch.randn(4, 8), device="cuda:7")
    assert compfx.analyze(mlp(), torch.randn(4, 8), device="cuda:7", capability=(8, 0)).device.index == 7


def test_resume_refuses_a_cost_fn_lambda_swapped_for_another(tmp_path):
    # before: both lambdas were recorded as '<lambda>', so the resumed search replayed the other cost's samples
    log = tmp_path / "search.jsonl"

    def run(cost_fn, resume):
        model = mlp()
        return compfx.optimize(model, batches(2, (4, 8)), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               loss_fn=ce, config=quick_config(**CHEAP, cost_fn=cost_fn), log=log,
                               resume=resume)

    run(lambda plan, seconds: seconds, resume=False)
    assert run(lambda plan, seconds: seconds, resume=True).plan is not None  # the same function resumes
    with pytest.raises(PlanMismatchError, match="cost_fn"):
        run(lambda plan, seconds: 2 * seconds, resume=True)


def test_a_planned_modules_missing_arguments_and_other_checkpoints_are_compfx_errors():
    """PlannedModule(model=None), (analysis=None) and load_state_dict of other shapes: tests/test_model_changes.py."""
    model = mlp()
    analysis = compfx.analyze(model, torch.randn(4, 8))
    with pytest.raises(BadInputError):
        PlannedModule(None, compfx.Plan.amp(analysis), analysis=analysis)
    with pytest.raises(BadInputError):
        PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis).load_state_dict(mlp().state_dict() | {
            "0.weight": torch.zeros(2, 2)})


# -- plan files have one reading ------------------------------------------------------

@pytest.fixture(scope="module")
def plan_dict():
    """A Net's AMP plan as a dict, its analysis and the model, shared by the tests of plan files (none changes them)."""
    model = Net()
    analysis = compfx.analyze(model, torch.randn(2, 4))
    return Plan.amp(analysis).to_dict(), analysis, model


def _raw(d: dict, **replace: str) -> str:
    """``d`` as JSON text with some members' text replaced (to write what json.dumps cannot: duplicate keys)."""
    text = json.dumps(d)
    for old, new in replace.items():
        text = text.replace(old, new, 1)
    return text


@pytest.mark.parametrize("damage, named", [
    ("duplicate op key", "'0'"), ("duplicate fingerprint", "'fingerprint'"), ("duplicate low_dtype", "'low_dtype'"),
    ("zero-padded index", "fc:linear#00"), ("Arabic-Indic digit", "fc:linear#\u0660"),
    ("fullwidth digit", "fc:linear#\uff10"), ("unknown top-level key", "'tuned_by'"),
    ("torch_version not a string", "torch_version 2"), ("device_type unknown", "device_type 'tpu9'"),
    ("searched not a record", "searched"),
])
def test_a_plan_file_with_more_than_one_reading_is_refused_naming_what(tmp_path, plan_dict, damage, named):
    data, analysis, model = plan_dict
    ops = data["ops"]
    if damage == "duplicate op key":
        text = _raw(data, **{'"fc:linear#0": "low"': '"fc:linear#0": "fp32", "fc:linear#0": "low"'})
        named = "'fc:linear#0'"
    elif damage == "duplicate fingerprint":
        text = _raw(data, **{'"fingerprint"': '"fingerprint": "0123456789abcdef", "fingerprint"'})
    elif damage == "duplicate low_dtype":
        text = _raw(data, **{'"low_dtype"': '"low_dtype": "float16", "low_dtype"'})
    elif damage in ("zero-padded index", "Arabic-Indic digit", "fullwidth digit"):
        text = json.dumps({**data, "ops": {**{k: v for k, v in ops.items() if k != "fc:linear#0"}, named: "fp32"}},
                          ensure_ascii=False)
    elif damage == "unknown top-level key":
        text = json.dumps({**data, "tuned_by": "someone"})
    elif damage == "torch_version not a string":
        text = json.dumps({**data, "torch_version": 2})
    elif damage == "device_type unknown":
        text = json.dumps({**data, "device_type": "tpu9"})
    else:
        text = json.dumps({**data, "searched": {"at": 5}})
    path = tmp_path / "plan.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PlanFileError) as caught:
        Plan.load(path)
    assert named in str(caught.value) and str(path) in str(caught.value)


def test_a_plan_of_another_torch_release_loads_with_a_warning(tmp_path, plan_dict):
    data, analysis, model = plan_dict
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**data, "torch_version": "1.13.1"}))
    with pytest.warns(UserWarning, match="written under torch 1.13.1; this is torch"):
        plan = Plan.load(path)
    assert plan == Plan.amp(analysis)


def test_a_plan_file_written_before_these_checks_still_loads_without_a_warning(tmp_path, plan_dict, recwarn):
    data, analysis, model = plan_dict
    old = {k: data[k] for k in ("format", "version", "low_dtype", "fingerprint", "torch_version", "ops")}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(old, indent=2))
    plan = Plan.load(path)
    assert plan == Plan.amp(analysis) and plan.device_type is None
    apply(model, plan, torch.randn(2, 4))
    assert not [w for w in recwarn if issubclass(w.category, UserWarning) and "plan" in str(w.message)]


def test_a_plan_made_for_another_device_type_applies_with_a_warning(tmp_path, plan_dict):
    data, analysis, model = plan_dict
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**data, "device_type": "cuda"}))
    plan = Plan.load(path)
    assert plan.device_type == "cuda" and plan == Plan.amp(analysis)
    with pytest.warns(UserWarning, match="made for cuda and runs on cpu"):
        apply(model, plan, analysis=analysis)


def test_a_search_log_line_naming_a_key_twice_is_refused(tmp_path):
    path = tmp_path / "search.jsonl"
    search(Net(), log=path)
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace('"status":', '"status": "accepted", "status":', 1)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PlanFileError, match="line 2 is damaged .*duplicate key 'status'"):
        SearchLog.read(path)


# -- loaders that never end, or lie about their length; files that block -----------------------

@pytest.fixture
def no_hang():
    """Fail a test that blocks (a FIFO opened for reading waits for a writer) instead of hanging the suite."""
    def interrupt(signum, frame):
        raise TimeoutError("blocked for 20 s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_an_endless_loader_gives_bounded_epochs(monkeypatch, no_hang):
    def endless():
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)

    class Stream:  # no len(): like a DataLoader over an IterableDataset
        def __iter__(self):
            return endless()

    monkeypatch.setattr(sampling, "MAX_EPOCH_BATCHES", 3)
    with pytest.warns(UserWarning, match="at most its first 3"):
        result = search(Net(), loader=Stream())
    stage1 = [r for r in result.log.samples() if r.stage == "stage1" and r.status == "accepted"]
    assert stage1 and all(r.batches == 3 for r in stage1)


def test_a_loader_longer_than_its_len_gives_len_batches():
    class Lying:
        def __iter__(self):
            return iter(batches(5, (6, 4)))

        def __len__(self):
            return 2

    result = search(Net(), loader=Lying())
    assert all(r.batches == 2 for r in result.log.samples() if r.stage == "stage1" and r.status == "accepted")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize("what", ["Plan.load", "SearchLog.read", "optimize(log=)", "compfx report", "compfx plan show",
                                  "Guard(log=)"])
def test_a_fifo_without_a_writer_is_refused_not_waited_on(tmp_path, no_hang, capsys, what):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    model = Net()
    if what.startswith("compfx "):
        assert main([*what.split()[1:], str(fifo)]) == 2
        assert "FIFO" in capsys.readouterr().err
        return
    with pytest.raises((PlanFileError, FileWriteError), match="FIFO"):
        if what == "Plan.load":
            Plan.load(fifo)
        elif what == "SearchLog.read":
            SearchLog.read(fifo)
        elif what == "optimize(log=)":
            search(model, log=fifo)
        else:
            analysis = compfx.analyze(model, torch.randn(2, 4))
            compfx.Guard(PlannedModule(model, Plan.amp(analysis), analysis=analysis), log=fifo)
