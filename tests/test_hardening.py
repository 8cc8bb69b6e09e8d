"""Hardening: hostile and damaged files, bad inputs, resume side effects, the plan cache end to end.

The table ``CASES`` holds every bad input we know of, plus the path
traversal, cache and tamper cases: each must raise its ``CompfxError`` subclass
with a message that says what to do, and leave the caller's model, optimizer
and RNG exactly as they were. The other tests cover what is not an exception:
files skipped with one warning and rewritten, quiet stderr, the plan the
compile backend ran, stale profiles measured again, the RNG after resume.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import math
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx import cache
from compfx.planned_module import apply
from compfx.compile_backend import backend, compile_with_plan, registered_backend
from compfx.cli import main
from compfx.costmodel import SearchPredictor, fit_cast_cost, profile_ops
from compfx.errors import (BadInputError, CacheKeyError, CompfxError, FileWriteError, LogIntegrityError,
                           PlanFileError, PlanMismatchError)
from compfx.measure import Conditions
from compfx.plan import Plan
from compfx.search import FunctionEvaluator, SearchConfig, SearchSpace, run_stage1
from compfx.search.log import DIGEST, SearchLog
from compfx.planned_module import PlannedModule
from compfx.state import restore_state, snapshot_state
from test_reliability import Tiny
from tests.helpers import nll

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

backend_module = importlib.import_module("compfx.compile_backend")

QUICK = dict(progress=False, warmup=0, repeats=1, stage2_check_batches=1, predictor=False)


class Other(nn.Module):
    """Another model: none of its op keys is Tiny's."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 3), nn.ReLU())

    def forward(self, x):
        return self.encoder(x)


class Ctx:
    """A model with Adam state, its loader and analysis, and a folder, as each case gets them."""

    def __init__(self, tmp_path: Path):
        torch.manual_seed(0)
        self.model = Tiny()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(0)
        self.loader = [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(2)]
        self.model(self.loader[0][0]).sum().backward()
        self.opt.step()  # optimizer state exists: it must stay bitwise
        self.opt.zero_grad()
        self.x = self.loader[0][0]
        self.analysis = compfx.analyze(self.model, self.x)
        self.tmp = tmp_path
        # made here, before the case measures the RNG: building models and inputs draws from it
        self.other_model = Other()
        self.other_plan = Plan.amp(compfx.analyze(self.other_model, self.x))
        self.meta_model = Tiny().to("meta")
        self.wrong_x = torch.randn(6, 5)

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def plan_file(self, name: str = "plan.json", **changes) -> Path:
        return self.file(name, json.dumps({**Plan.amp(self.analysis).to_dict(), **changes}))

    def optimize(self, loader=None, config=None, **kwargs):
        kwargs.setdefault("loss_fn", nll)
        return compfx.optimize(self.model, self.loader if loader is None else loader, optimizer=self.opt,
                               config=config or SearchConfig(**QUICK, cache_dir=self.tmp / "cache"), **kwargs)


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
                           config=SearchConfig(**QUICK, cache_dir=c.tmp / "cache"))


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
                           config=SearchConfig(**QUICK))


def _nan_cost(c: Ctx):
    return c.optimize(config=SearchConfig(**QUICK, cost_fn=lambda plan, seconds: math.nan, cache_plan=False))


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
    c.optimize(log=path, config=SearchConfig(**QUICK, keep_search_training=False, cache_plan=False))
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
                      config=SearchConfig(**QUICK, keep_search_training=False, cache_plan=False))


CASES = {  # name -> (call(ctx), error class, words the message must hold)
    # section 6, raw errors
    "plan file binary": (lambda c: Plan.load(c.file("p.json", b"\xff\xfe\x00\x81garbage")), PlanFileError,
                         "not UTF-8"),
    "plan file huge integer": (lambda c: Plan.load(c.file("p.json", '{"version": ' + "9" * 5000 + "}")),
                               PlanFileError, "Delete it"),
    "plan file nested deeply": (lambda c: Plan.load(c.file("p.json", "[" * 100_000 + "]" * 100_000)),
                                PlanFileError, "nested too deeply"),
    "plan save into a folder": (lambda c: Plan.amp(c.analysis).save(c.tmp), FileWriteError, "not a folder"),
    "plan save under a file": (lambda c: Plan.amp(c.analysis).save(c.file("f", "x") / "plan.json"),
                               FileWriteError, "could not write"),
    "device tpu9": (lambda c: compfx.analyze(c.model, c.x, device="tpu9"), BadInputError, "e.g. 'cpu'"),
    "optimize config dict": (lambda c: c.optimize(config={"threshold": 1.0}), BadInputError, "SearchConfig("),
    "optimize log is a folder": (lambda c: c.optimize(log=c.tmp), FileWriteError, "Pass another log="),
    "optimize log under a file": (lambda c: c.optimize(log=c.file("f", "x") / "log.jsonl"), FileWriteError,
                                  "Pass another log="),
    "analyze a string": (lambda c: compfx.analyze("model", c.x), BadInputError, "nn.Module"),
    "analyze string capability": (lambda c: compfx.analyze(c.model, c.x, device="cuda", capability="8,0"),
                                  BadInputError, "(8, 0)"),
    "bitstring None": (lambda c: Plan.from_bitstring(c.analysis, None), PlanMismatchError, "'0f1'"),
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
    "plan save None": (lambda c: Plan.amp(c.analysis).save(None), BadInputError, "not a path"),
    "plan load NUL in path": (lambda c: Plan.load(str(c.tmp / "p\0.json")), BadInputError, "NUL"),
    "plan save NUL in path": (lambda c: Plan.amp(c.analysis).save(str(c.tmp / "p\0.json")), BadInputError, "NUL"),
    "optimize log /dev/null": (lambda c: c.optimize(log="/dev/null"), FileWriteError, "not a file compfx can write"),
    "optimize log a symlink": (_symlinked_log, FileWriteError, "symbolic link"),
    "optimize log over a file of the user's": (lambda c: c.optimize(log=c.file("notes.txt", "mine")),
                                               FileWriteError, "does not overwrite it"),
    "plan save over a file of the user's": (lambda c: Plan.amp(c.analysis).save(c.file("notes.json", '{"a": 1}')),
                                            FileWriteError, "does not overwrite it"),
    "COMPFX_CACHE_DIR ~nouser": (lambda c: _with_env(cache.CACHE_DIR_ENV, "~nouser_compfx/c",
                                                     lambda: c.optimize(config=SearchConfig(**QUICK))),
                                 CacheKeyError, "cannot be expanded"),
    "cache_dir with NUL": (lambda c: c.optimize(config=SearchConfig(**QUICK, cache_dir="a\0b")), CacheKeyError,
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
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_a_compfx_error_that_names_the_fix_and_changes_nothing(tmp_path, name, capfd):
    call, error_class, words = CASES[name]
    c = Ctx(tmp_path)
    before = snapshot_state(c.model, c.opt)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    with pytest.raises(error_class) as caught:
        call(c)
    error = caught.value
    assert isinstance(error, CompfxError) and words in str(error), str(error)
    first = str(error).splitlines()[0]
    assert not any(marker in first for marker in ("Traceback", "While executing", 'File "')) and len(first) < 700
    assert before.matches(), "the model or optimizer changed"
    assert torch.equal(torch.get_rng_state(), rng), "the caller's RNG changed"
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in c.model.parameters())
    assert "Traceback" not in capfd.readouterr().err  # nothing dumped to stderr on the way
    assert not (tmp_path.parent / "outside").exists()


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


# -- the plan cache end to end ---------------------------------------------------------

class Prodding(nn.Module):
    """A blacklisted op (prod), so a search that favours low precision picks a plan AMP would not."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc(x)
        return self.head(h * torch.prod(torch.sigmoid(h) + 0.5, dim=-1, keepdim=True))


def fewer_fp32_ops(plan, seconds):
    """A device where low precision always pays (deterministic)."""
    return float(sum(p == "fp32" for p in plan.values()))


def test_torch_compile_after_optimize_runs_the_searched_plan(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(backend_module, "_registered", None)  # a fresh backend="compfx" for this test
    torch.manual_seed(0)
    model = Prodding()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
    result = compfx.optimize(model, loader, optimizer=opt, loss_fn=lambda out, b: F.cross_entropy(out, b[-1]),
                             config=SearchConfig(**QUICK, threshold=2.0, cost_fn=fewer_fp32_ops))
    assert result.plan != Plan.amp(result.analysis), "the test needs a searched plan that is not the default"
    assert result.plan_path == cache.plan_path(result.analysis.fingerprint, result.analysis.low_dtype)
    assert f"saved to {result.plan_path}" in result.report()
    assert any(f"saved to {result.plan_path}" in note.reason for note in result.log.notes())

    torch._dynamo.reset()
    registered = registered_backend()
    monkeypatch.setattr(registered, "inner", "aot_eager")  # Inductor compiles slowly on this CPU
    torch.compile(Other(), backend="compfx")(torch.randn(2, 4))  # another model first, as in a real process
    copied = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="compfx"):
        out = torch.compile(copied, backend="compfx")(loader[0][0])
    record = registered.records[-1]
    assert (record.origin, record.plan_fingerprint, record.plan_path) == (
        "cache", result.analysis.fingerprint, str(result.plan_path))
    assert dict(record.precisions) == dict(result.plan) and not record.unplanned
    expected = {"low": result.analysis.low_dtype, "fp32": torch.float32}
    assert all(record.compute_dtypes[k] == expected[p] for k, p in result.plan.items() if p in expected)
    assert f"cache plan {result.analysis.fingerprint} from {result.plan_path}" in registered.report()
    ran = [m for m in caplog.messages if f"runs plan {result.analysis.fingerprint} from the plan cache" in m]
    assert len(ran) == 1 and f"({result.plan_path}, searched " in ran[0]  # once, at INFO: file, when, device, torch
    assert f"on cpu, under torch {torch.__version__}" in ran[0]
    torch.testing.assert_close(out, result.module(loader[0][0]), rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()


def test_opting_out_leaves_the_cache_alone(tmp_path):
    c = Ctx(tmp_path)
    result = c.optimize(config=SearchConfig(**QUICK, cache_plan=False, cache_dir=tmp_path / "cache"))
    assert result.plan_path is None and "cache_plan=False" in result.report()
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.json"))


def test_an_unwritable_cache_warns_and_the_search_still_returns_its_plan(tmp_path, caplog):
    c = Ctx(tmp_path)
    blocked = c.file("blocked", "a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="compfx"):
        result = c.optimize(config=SearchConfig(**QUICK, cache_dir=blocked))
    assert result.plan_path is None and "not saved" in result.report()
    assert any("not saved to the plan cache" in m for m in caplog.messages)


# -- damaged, racing and hostile cache files ---------------------------------------------

def _saved(tmp_path) -> tuple[Ctx, Path, Path]:
    c = Ctx(tmp_path)
    folder = tmp_path / "cache"
    return c, folder, cache.save_plan(Plan.amp(c.analysis), cache_dir=folder)


@pytest.mark.parametrize("damage", ["binary", "nested", "truncated", "oversized", "another plan", "a folder"])
def test_a_damaged_cached_plan_is_skipped_with_one_warning_and_rewritten(tmp_path, caplog, damage):
    c, folder, path = _saved(tmp_path)
    if damage == "binary":
        path.write_bytes(b"\x00\xff" * 64)
    elif damage == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "truncated":
        path.write_text('{"format": "compfx-pl')
    elif damage == "oversized":
        path.unlink()
        with open(path, "wb") as handle:
            handle.truncate(40 << 20)
    elif damage == "another plan":  # a valid plan under the wrong name: not this model's
        path.write_text(json.dumps({**Plan.amp(c.analysis).to_dict(), "fingerprint": "fedcba9876543210"}))
    else:
        path.unlink()
        path.mkdir()
    with caplog.at_level(logging.WARNING, logger="compfx"):
        for _ in range(3):
            assert cache.find_plan(c.analysis.fingerprint, low_dtype=c.analysis.low_dtype, cache_dir=folder) is None
            assert cache.find_plan(c.analysis.fingerprint, cache_dir=folder) is None
    assert sum("ignoring damaged cached plan" in m for m in caplog.messages) == 1
    if damage == "a folder":
        path.rmdir()
    cache.save_plan(Plan.amp(c.analysis), cache_dir=folder)  # searched again: rewritten
    assert cache.find_plan(c.analysis.fingerprint, low_dtype=c.analysis.low_dtype, cache_dir=folder) \
        == Plan.amp(c.analysis)


def test_a_link_out_of_the_cache_folder_is_not_followed(tmp_path, caplog):
    c, folder, path = _saved(tmp_path)
    outside = tmp_path / "outside.json"
    outside.write_text(path.read_text())
    path.unlink()
    path.symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="compfx"):
        assert cache.find_plan(c.analysis.fingerprint, low_dtype=c.analysis.low_dtype, cache_dir=folder) is None
        assert cache.find_plan(c.analysis.fingerprint, cache_dir=folder) is None
    assert sum("outside the cache folder" in m for m in caplog.messages) == 1
    with pytest.raises(CacheKeyError, match="outside the cache folder"):
        cache.plan_path(c.analysis.fingerprint, c.analysis.low_dtype, cache_dir=folder)


def test_files_deleted_between_listing_and_reading_are_skipped_silently(tmp_path, monkeypatch, caplog):
    c, folder, path = _saved(tmp_path)
    gone = f"{c.analysis.fingerprint}-float16.json"  # listed, then deleted by another process before it is read
    listdir = os.listdir
    monkeypatch.setattr(cache.os, "listdir", lambda where: [gone, *listdir(where)])
    real_stat = Path.stat

    def stat_then_vanish(self, *args, **kwargs):  # the other file vanishes after its stat, before its read
        result = real_stat(self, *args, **kwargs)
        if self.name == path.name and vanish:
            self.unlink()
        return result

    vanish = False
    with caplog.at_level(logging.WARNING, logger="compfx"):
        assert cache.find_plan(c.analysis.fingerprint, cache_dir=folder) == Plan.amp(c.analysis)
        vanish = True
        monkeypatch.setattr(Path, "stat", stat_then_vanish)
        assert cache.find_plan(c.analysis.fingerprint, cache_dir=folder) is None
    assert not caplog.messages


def test_lookups_while_another_thread_saves_and_deletes_never_raise(tmp_path):
    c, folder, _ = _saved(tmp_path)
    plans = [Plan(dict(Plan.amp(c.analysis)), low_dtype=c.analysis.low_dtype, fingerprint=f"{i:016x}")
             for i in range(8)]
    stop, errors = threading.Event(), []

    def churn():
        while not stop.is_set():
            for plan in plans:
                cache.plan_path(plan.fingerprint, plan.low_dtype, cache_dir=folder).unlink(missing_ok=True)
                cache.save_plan(plan, cache_dir=folder)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(200):
            try:
                cache.find_plan(c.analysis.fingerprint, cache_dir=folder)
                cache.find_plan(plans[0].fingerprint, cache_dir=folder)
            except Exception as error:  # noqa: BLE001 - the test collects what escaped
                errors.append(error)
    finally:
        stop.set()
        thread.join()
    assert not errors


def test_temp_files_of_killed_writers_are_removed_and_only_those(tmp_path):
    folder = tmp_path / "cache"
    (folder / "profiles").mkdir(parents=True)
    old_plan = folder / ".0123456789abcdef-bfloat16.json.k1ll3d_x.tmp"
    old_entry = folder / "profiles" / f".{'a' * 32}.json.abcd1234.tmp"
    fresh = folder / ".0123456789abcdef-float16.json.abcd1234.tmp"  # a writer may still be renaming it
    foreign = [folder / ".notes.json.abcd1234.tmp", folder / "mine.tmp", folder / "profiles" / ".x.json.abcd1234.tmp"]
    for path in (old_plan, old_entry, fresh, *foreign):
        path.write_text("{")
    for path in (old_plan, old_entry, *foreign):
        os.utime(path, (0, 0))
    c = Ctx(tmp_path)
    cache.save_plan(Plan.amp(c.analysis), cache_dir=folder)
    profile_ops(c.analysis, cache_dir=folder, repeats=1, conditions=Conditions(1e-3))
    assert not old_plan.exists() and not old_entry.exists()
    assert fresh.exists() and all(path.exists() for path in foreign)


# -- profiles measured under other conditions ----------------------------------------------

def _entries(folder: Path, fmt: str = "compfx-op-profile") -> list[Path]:
    return [p for p in (folder / "profiles").glob("*.json") if json.loads(p.read_text())["format"] == fmt]


def test_profiles_cached_on_a_loaded_machine_are_measured_again(tmp_path):
    """The issue's case: profiles taken while other jobs loaded the machine, 20x too slow, and the reference
    kernel timed with them just as slow; the next search, on a quiet machine, must not trust them."""
    c = Ctx(tmp_path)
    quiet = Conditions(reference_s=1e-3, load=0.1)
    first = profile_ops(c.analysis, cache_dir=tmp_path, repeats=1, conditions=quiet)
    loaded = []
    for path in _entries(tmp_path):  # rewrite them as a loaded machine would have written them
        data = json.loads(path.read_text())
        data.update(seconds=data["seconds"] * 20 + 1.0, conditions={"reference_s": 0.02, "load": 3.0})
        loaded.append(data["seconds"])
        path.write_text(json.dumps(data))
    again = profile_ops(c.analysis, cache_dir=tmp_path, repeats=1, conditions=quiet)
    assert (again.reused, again.stale, again.measured) == (0, len(loaded), len(loaded))
    assert "20x" in again.stale_reason and "load 3.00 per CPU then" in again.stale_reason
    assert all(p.fp32_s < 1.0 and p.low_s < 1.0 for p in again.values()), "a loaded timing was used"
    rewritten = [json.loads(p.read_text()) for p in _entries(tmp_path)]
    assert all(e["conditions"]["reference_s"] == 1e-3 and e["seconds"] < 1.0 for e in rewritten)
    assert set(first) == set(again)


@pytest.mark.parametrize("recorded, trusted", [
    ({"reference_s": 1.2e-3, "load": 0.5}, True),  # the same machine, a little noise: reused
    ({"reference_s": 0.4e-3, "load": 0.0}, False),  # taken on a faster (or quieter) machine than now
    (None, False),  # written before compfx recorded conditions
    ({"reference_s": "fast"}, False),  # damaged
])
def test_cached_profiles_are_trusted_only_under_like_conditions(tmp_path, recorded, trusted):
    c = Ctx(tmp_path)
    now = Conditions(reference_s=1e-3)
    profile_ops(c.analysis, cache_dir=tmp_path, repeats=1, conditions=now)
    for path in _entries(tmp_path):
        data = json.loads(path.read_text())
        if recorded is None:
            data.pop("conditions")
        else:
            data["conditions"] = recorded
        path.write_text(json.dumps(data))
    again = profile_ops(c.analysis, cache_dir=tmp_path, repeats=1, conditions=now)
    n = 2 * len(c.analysis.ops)
    assert (again.reused, again.stale) == ((n, 0) if trusted else (0, n))


def test_a_damaged_profile_entry_is_measured_again_not_fatal(tmp_path, caplog):
    c = Ctx(tmp_path)
    now = Conditions(reference_s=1e-3)
    profile_ops(c.analysis, cache_dir=tmp_path, repeats=1, conditions=now)
    victims = _entries(tmp_path)[:3]
    data = json.loads(victims[0].read_text())
    victims[0].write_text(json.dumps({**data, "seconds": "fast"}))  # valid JSON, wrong content
    victims[1].write_bytes(b"\x00\xff\xfe")
    victims[2].write_text("[" * 100_000 + "]" * 100_000)
    with caplog.at_level(logging.WARNING, logger="compfx"):
        again = SearchPredictor.build(c.analysis, cache_dir=tmp_path, repeats=1, conditions=now)
    assert again.profiles.measured == 3 and again.profiles.reused == 2 * len(c.analysis.ops) - 3
    assert sum("ignoring damaged cache entry" in m for m in caplog.messages) == 3
    assert all(isinstance(json.loads(v.read_text())["seconds"], float) for v in victims)  # rewritten


def test_cast_fits_follow_the_same_rule(tmp_path):
    pairs = [(torch.float32, torch.bfloat16)]
    sizes = (256, 4096)
    fit_cast_cost(device="cpu", pairs=pairs, sizes=sizes, cache_dir=tmp_path, conditions=Conditions(1e-3))
    [entry] = _entries(tmp_path, "compfx-cast-cost")
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "alpha": 5.0, "conditions": {"reference_s": 0.05}}))
    cost = fit_cast_cost(device="cpu", pairs=pairs, sizes=sizes, cache_dir=tmp_path, conditions=Conditions(1e-3))
    assert cost.coefficients[pairs[0]][0] != 5.0 and json.loads(entry.read_text())["alpha"] != 5.0


# -- resume and interrupts leave the caller's RNG alone --------------------------------------

def _rng():
    return torch.get_rng_state()


def test_resume_leaves_the_callers_rng_untouched(tmp_path):
    c = Ctx(tmp_path)
    path = tmp_path / "search.jsonl"
    c.optimize(log=path, config=SearchConfig(**QUICK, cache_plan=False))  # the winner's epoch is retrained
    c = Ctx(tmp_path)
    torch.manual_seed(99)
    rng = _rng()
    result = c.optimize(log=path, resume=True, config=SearchConfig(**QUICK, cache_plan=False))
    assert any(r.reason == "resumed" for r in result.log.notes())
    assert torch.equal(_rng(), rng)


@pytest.mark.parametrize("at", [1, 3, 6])  # in a replayed sample's retraining, a live sample, the comparison
def test_an_interrupted_resume_restores_model_optimizer_and_rng(tmp_path, at):
    c = Ctx(tmp_path)
    path = tmp_path / "search.jsonl"
    c.optimize(log=path, config=SearchConfig(**QUICK, cache_plan=False))
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3]) + "\n")  # as if killed after two samples
    c = Ctx(tmp_path)
    before = snapshot_state(c.model, c.opt)
    calls = []

    def interrupting(output, batch):
        calls.append(1)
        if len(calls) == 1 + at:  # call 1 is the input check
            raise KeyboardInterrupt
        return nll(output, batch)

    torch.manual_seed(7)
    rng = _rng()
    with pytest.raises(KeyboardInterrupt):
        c.optimize(log=path, resume=True, loss_fn=interrupting, config=SearchConfig(**QUICK, cache_plan=False))
    assert len(calls) == 1 + at
    assert before.matches() and torch.equal(_rng(), rng)


@pytest.mark.skipif(not hasattr(torch.cuda, "_lazy_seed_tracker") or torch.cuda.is_initialized(),
                    reason="needs torch's lazy CUDA seeding (CUDA not initialised yet)")
def test_a_search_on_the_cpu_queues_no_cuda_seed(tmp_path):
    """torch.manual_seed, called inside the search, would queue a seed for every CUDA device that fork_rng
    cannot undo: a caller who seeded CUDA (lazily) would find that seed replaced once CUDA starts."""
    tracker = torch.cuda._lazy_seed_tracker
    c = Ctx(tmp_path)
    torch.manual_seed(31)  # the caller's seed, queued for CUDA
    queued = tracker.get_calls()
    c.optimize(config=SearchConfig(**QUICK, cache_plan=False))
    assert tracker.get_calls() == queued


# -- quiet stderr, costs in their units ----------------------------------------------------

class Inverting(nn.Module):
    """linalg.inv raises for bfloat16, inside the rewritten graph: those plans fail in the sample."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        m = self.fc(x).reshape(-1, 2, 2) + 3 * torch.eye(2)
        return self.head(torch.linalg.inv(m).reshape(-1, 4))


def test_failing_samples_print_no_torch_fx_traceback_and_the_log_keeps_the_reason(capfd):
    torch.manual_seed(0)
    model = Inverting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
    result = compfx.optimize(model, loader, optimizer=opt, loss_fn=lambda out, b: F.cross_entropy(out, b[-1]),
                             config=SearchConfig(**QUICK, cache_plan=False))
    failed = [r for r in result.log.samples() if r.status == "error"]
    assert failed and all("linalg.inv" in r.reason for r in failed)
    err = capfd.readouterr().err
    assert "eval_with_key" not in err and "Traceback" not in err and "linalg" not in err


def test_skipped_plans_are_priced_in_the_cost_functions_units():
    space = SearchSpace(("whitelist",) * 2, (False,) * 2, (0, 1))

    def run_epoch(plan):
        for _ in range(2):
            yield 1.0, 0.5

    def units(plan, seconds):  # e.g. dollars: 10 a second, plus 1 per FP32 op
        return 10 * seconds + str(plan).count("1")

    records = []
    predicted = {"11": 1.0, "00": 0.5, "01": 9.0, "10": 0.3}  # "01" cannot beat AMP's "00"; "10" might
    run_stage1(space, FunctionEvaluator(run_epoch=run_epoch, cost=units), predict=lambda p: predicted[str(p)],
               report=records.append)
    skipped = [r.reason for r in records if r.status == "skipped"]
    assert skipped and all("in cost_fn's units" in r and " s " not in r for r in skipped)
