"""compfx's own code causes no warning on a Hugging Face model, whatever it does with it (the README's examples:
tests/test_readme.py), and warns only about what is the case. The test settings hide FutureWarning and
DeprecationWarning; these tests see every one."""

from __future__ import annotations

import logging
import shutil
import warnings

import pytest
import torch
import torch.nn as nn

import compfx
from compfx import cache
from compfx.compile_backend import backend
from compfx.graph_capture import capture
from compfx.graph_capture.nodes import copy_graph
from compfx.report import render_log_report

from tests.helpers import warnings_from_compfx

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

VOCAB = 64
CHEAP = compfx.SearchConfig(progress=False, warmup=0, repeats=1, stage1_budget=3, stage2_budget=2,
                            stage2_check_batches=1, predictor=False)


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def tokens(length: int, seed: int) -> dict:
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def test_a_hugging_face_model_gets_no_warning_from_compfx(tmp_path):
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = [tokens(8, seed) for seed in range(3)]
    with warnings_from_compfx() as warned:
        result = compfx.optimize(model, loader, optimizer=optimizer, config=CHEAP, log=tmp_path / "search.jsonl")
        render_log_report(tmp_path / "search.jsonl")
        planned = result.module
        planned(**tokens(12, 3)).loss.backward()  # a new sequence length: captured and planned again
        result.plan.save(tmp_path / "plan.json")
        plan = compfx.Plan.load(tmp_path / "plan.json")
        compfx.diagnose(model, tokens(8, 4), plan=plan)
        guard = compfx.Guard(planned)
        loss = planned(**tokens(8, 5)).loss
        loss.backward()
        guard.step(optimizer, loss)
        compfx.apply(model, plan, tokens(8, 6))(**tokens(8, 6))
        torch.compile(model, backend=backend(plan, inner="eager"))(**tokens(8, 7)).loss.backward()
    assert warned == []


def test_the_warning_collector_sees_compfx_warnings_and_only_those():
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings_from_compfx() as warned:
        warnings.warn("the user's own warning")  # this file is not compfx's
        capture(model, torch.randn(2, 4), method="record", leaf_modules=[nn.Linear])  # compfx: "leaf_modules is ignored"
    assert len(warned) == 1 and "leaf_modules is ignored" in warned[0] and "compfx/graph_capture" in warned[0]


def test_copying_a_recorded_graph_builds_no_deprecated_tree_spec():
    model, batch = tiny_gpt2(), tokens(8, 0)
    gm = capture(model, batch, method="record")  # its generated code unpacks (args, kwargs) by an input spec
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copied = copy_graph(gm.graph)
    assert [str(w.message) for w in caught] == []
    assert copied.python_code("self").src == gm.graph.python_code("self").src
    assert [n.meta.get("compfx_key") for n in copied.nodes] == [n.meta.get("compfx_key") for n in gm.graph.nodes]


def test_a_valid_plan_for_another_low_dtype_in_the_cache_is_not_called_damaged(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    analysis = compfx.analyze(model, torch.randn(3, 4), low_dtype=torch.float16)
    plan = compfx.Plan.amp(analysis)
    path = cache.save_plan(plan, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="compfx"):
        assert cache.find_plan_covering(list(plan), low_dtype=torch.bfloat16, cache_dir=tmp_path) is None
        assert cache.find_plan(analysis.fingerprint, low_dtype=torch.bfloat16, cache_dir=tmp_path) is None
        assert cache.find_plan_covering(list(plan), low_dtype=torch.float16, cache_dir=tmp_path) == plan
        assert cache.find_plan_covering(list(plan), cache_dir=tmp_path) == plan
    assert caplog.messages == []
    # a file whose content contradicts its own name is damaged; the warning says what it holds
    shutil.copy(path, tmp_path / f"{'0' * 16}-float16.json")
    with caplog.at_level(logging.WARNING, logger="compfx"):
        assert cache.find_plan("0" * 16, cache_dir=tmp_path) is None
    (message,) = caplog.messages
    assert f"it holds the plan of {analysis.fingerprint}-float16.json, not of its own name" in message
