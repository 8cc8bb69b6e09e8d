"""compfx as a torch.compile backend: registration, plan matching on dynamo graphs, caches, training.

Most tests use inner="aot_eager" (AOT autograd without Inductor's slow CPU
compiles); the Inductor tests are kept to two small models.
"""

from __future__ import annotations

import copy
import logging
import random
import warnings

import pytest
import torch
import torch.nn as nn

import compfx
from compfx import cache
from compfx.planned_module import apply
from compfx.compile_backend import backend, compfx_backend, compile_with_plan, registered_backend
from compfx.errors import BadInputError, PlanFileError
from compfx.opkey import OpKey
from compfx.passes import count_casts

from tests.helpers import assert_matches_apply, forward_and_grads
from zoo import make

BF16_TOL = dict(rtol=2e-2, atol=2e-2)  # bf16 has 8 bits of mantissa: eps 7.8e-3
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
# AOT autograd decomposes some composite ops (nn.GRU) into other kernels: same casts, other bf16 rounding.
AOT_LOW_TOL = dict(rtol=1.6e-2, atol=1e-4)


def aot_tolerance(plan) -> dict:
    return AOT_LOW_TOL if "low" in plan.values() else FP32_TOL


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # each test compiles from scratch, on an empty plan cache


def random_plan(analysis, seed: int) -> compfx.Plan:
    rng = random.Random(seed)
    return compfx.Plan.from_bitstring(analysis, "".join(rng.choice("01f") for _ in analysis.ops))


def assert_records_follow_plan(records, plan, low_dtype):
    """Every planned op ran at the plan's precision; the records cover the plan exactly once per op."""
    expected = {"low": low_dtype, "fp32": torch.float32}
    for record in records:
        for key, precision in record.precisions.items():
            assert precision == plan.get(key, "follow"), key
            if precision in expected:
                assert record.compute_dtypes[key] == expected[precision], f"{key} ran in {record.compute_dtypes[key]}"


# ---------------------------------------------------------------------------
# registration and arguments


def test_compfx_is_a_registered_dynamo_backend():
    assert "compfx" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("compfx") is compfx_backend


def test_backend_rejects_arguments_that_do_not_fit():
    model, x = make("mlp")
    plan = compfx.Plan.amp(compfx.analyze(model, x))
    with pytest.raises(BadInputError, match="Inductor config patches"):
        backend(plan, inner="aot_eager", inductor_options={"max_autotune": True})
    with pytest.raises(TypeError):  # Inductor options are not backend options
        backend(plan, inner="inductor", max_autotune=True)
    with pytest.raises(BadInputError, match="not a registered torch.compile backend"):
        backend(plan, inner="nonexistent")
    with pytest.raises(BadInputError, match="plan was made for"):
        backend(plan, low_dtype=torch.float16)
    with pytest.raises(BadInputError, match="expected a Plan"):
        backend(plan={"not": "a plan"})
    with pytest.raises(PlanFileError, match="does not exist"):
        backend("/nonexistent/plan.json")


def test_plan_path_is_loaded(tmp_path):
    model, x = make("mlp")
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.from_bitstring(analysis, "1f0")
    plan.save(tmp_path / "plan.json")
    compiled_backend = backend(str(tmp_path / "plan.json"), inner="aot_eager")
    assert compiled_backend.plan == plan
    torch.compile(model, backend=compiled_backend)(*x)
    assert_records_follow_plan(compiled_backend.records, plan, analysis.low_dtype)


# ---------------------------------------------------------------------------
# matching eager compfx.apply under AOT autograd


MODELS = ["mlp", "cnn", "encoder_matmul", "encoder_sdpa", "embed_gru"]


@pytest.mark.parametrize("plan_kind", ["amp", "random"])
@pytest.mark.parametrize("name", MODELS)
def test_aot_eager_matches_apply_in_outputs_and_gradients(name, plan_kind):
    model, x = make(name)
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.amp(analysis) if plan_kind == "amp" else random_plan(analysis, seed=len(name))
    compiled_backend = backend(plan, inner="aot_eager")
    # Without allow_rnn dynamo graph-breaks around nn.GRU and runs it eagerly, outside the plan.
    with torch._dynamo.config.patch(allow_rnn=True):
        compiled = torch.compile(model, backend=compiled_backend)
        assert_matches_apply(compiled, model, plan, analysis, x, aot_tolerance(plan))
    (record,) = compiled_backend.records  # no graph break: one graph holds the whole model
    assert set(record.precisions) == set(plan) and not record.unplanned
    assert_records_follow_plan(compiled_backend.records, plan, analysis.low_dtype)


# ---------------------------------------------------------------------------
# graph breaks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # dynamo starts a frame inside this submodule
        return torch.relu(self.b(x))


class BrokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.block(x))
        print("", end="")  # graph break in the model's own forward: ':relu' is counted across graphs
        x = torch.relu(x) * 2
        return self.head(x).log_softmax(-1)


def train(compiled, model, x, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = -compiled(x)[:, 0].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_graph_breaks_train_and_every_op_gets_the_plan_precision():
    torch.manual_seed(0)
    model, x = BrokenModel(), torch.randn(4, 8)
    analysis = compfx.analyze(model, x)
    plan = random_plan(analysis, seed=3).with_precisions({OpKey("", "relu", 1): "low", OpKey("", "relu", 0): "fp32"})
    before = [p.detach().clone() for p in model.parameters()]
    compiled = compile_with_plan(model, plan, inner="aot_eager")
    losses = train(compiled, model, x)
    records = compiled.compfx_backend.records
    assert len(records) >= 3 and all(torch.isfinite(torch.tensor(losses)))
    assert not any(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    seen = [key for record in records for key in record.precisions]
    assert sorted(seen) == sorted(plan), "each op of the model is in exactly one graph, under its full key"
    assert not any(record.unplanned for record in records)
    assert_records_follow_plan(records, plan, analysis.low_dtype)


def test_ops_without_plan_entry_follow_and_are_logged_once(caplog):
    torch.manual_seed(0)
    model, x = BrokenModel(), torch.randn(4, 8)
    plan = compfx.Plan.uniform(compfx.analyze(model, x), "fp32")
    compiled_backend = backend(plan, inner="aot_eager")  # no model=: the submodule frame's keys are relative
    with caplog.at_level(logging.INFO, logger="compfx"):
        train(torch.compile(model, backend=compiled_backend), model, x, steps=2)
    unplanned = [key for record in compiled_backend.records for key in record.unplanned]
    assert OpKey("a", "linear", 0) in unplanned
    assert all(record.precisions[key] == "follow" for record in compiled_backend.records for key in record.unplanned)
    assert sum("no entry in the plan" in message for message in caplog.messages) == 1


class CheckpointedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def block(self, x):
        return self.b(torch.relu(self.a(x)))

    def forward(self, x):
        x = self.pre(x)
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False) + x


class TwoCheckpointedBlocks(nn.Module):
    """A block checkpointed twice, non-reentrant, as a training loop with activation checkpointing writes it."""

    def __init__(self):
        super().__init__()
        self.pre, self.blocks, self.head = nn.Linear(8, 8), nn.ModuleList([CheckpointedBlock() for _ in range(2)]), \
            nn.Linear(8, 4)

    def forward(self, x):
        x = self.pre(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x).log_softmax(-1)


def _inner_seeing(handed: list):
    """An inner backend that keeps each graph the compfx backend hands it, then compiles it with aot_eager."""
    from torch._dynamo import lookup_backend

    def inner(gm, example_inputs):
        handed.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    return inner


def _checkpointed_bodies(gm) -> list:
    return [getattr(gm, n.args[0].target) for n in gm.graph.nodes
            if n.target is torch.ops.higher_order.tag_activation_checkpoint]


def test_a_checkpointed_region_runs_the_plan_and_stays_checkpointed(caplog):
    """Dynamo passes each checkpointed region as a subgraph; the backend plans its ops, keyed as apply keys them,
    and hands the inner backend the regions again, the plan's casts inside them."""
    torch.manual_seed(0)
    model, x = TwoCheckpointedBlocks(), torch.randn(4, 8)
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.uniform(analysis, "low").with_precisions({OpKey("blocks.1", "relu", 0): "fp32"})
    handed: list = []
    compiled_backend = backend(plan, inner=_inner_seeing(handed), model=model)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="compfx"):
        losses = train(torch.compile(model, backend=compiled_backend), model, x)
    (record,) = compiled_backend.records
    assert set(record.precisions) == set(plan) and not record.unplanned  # the regions' ops included
    assert_records_follow_plan(compiled_backend.records, plan, analysis.low_dtype)
    assert record.compute_dtypes[OpKey("blocks.1.a", "linear", 0)] == torch.bfloat16
    assert not [m for m in caplog.messages if "subgraph" in m]  # nothing left unplanned to warn about
    bodies = _checkpointed_bodies(handed[0])
    assert len(bodies) == 2 and all(count_casts(body) >= 4 for body in bodies)  # x and a's, b's weights and biases
    expected = train(apply(reference, plan, analysis=compfx.analyze(reference, x)), reference, x)
    torch.testing.assert_close(losses, expected, **FP32_TOL)


def test_hugging_face_gradient_checkpointing_runs_the_plan_under_torch_compile():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    model.gradient_checkpointing_enable()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    analysis = compfx.analyze(model, batch)
    plan = compfx.Plan.amp(analysis)
    handed: list = []
    compiled_backend = backend(plan, inner=_inner_seeing(handed), model=model)
    compiled = torch.compile(model, backend=compiled_backend)
    planned = apply(reference, plan, analysis=compfx.analyze(reference, batch))
    losses, expected = [], []
    for module, owner, out in ((compiled, model, losses), (planned, reference, expected)):
        optimizer = torch.optim.SGD(owner.parameters(), lr=0.1)
        for _ in range(2):
            loss = module(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
    torch.testing.assert_close(losses, expected, **FP32_TOL)
    records = compiled_backend.records
    assert not any(record.unplanned for record in records)
    assert_records_follow_plan(records, plan, analysis.low_dtype)
    planned_keys = {key for record in records for key in record.precisions}
    assert {OpKey(f"transformer.h.{i}.mlp.c_fc", "addmm", 0) for i in range(2)} <= planned_keys
    bodies = [body for gm in handed for body in _checkpointed_bodies(gm)]
    assert len(bodies) == 2 and all(count_casts(body) for body in bodies)


# ---------------------------------------------------------------------------
# plan sources and caching


def test_default_plan_is_amp_and_logged(caplog):
    model, x = make("encoder_sdpa")
    analysis = compfx.analyze(model, x)
    compiled_backend = backend(None, inner="aot_eager")
    with caplog.at_level(logging.INFO, logger="compfx"):
        torch.compile(model, backend=compiled_backend)(*x)
        torch.compile(model, backend=compiled_backend)(*x)
    assert dict(compiled_backend.records[0].precisions) == dict(compfx.Plan.amp(analysis))
    assert sum("default AMP-equivalent plan" in message for message in caplog.messages) == 1


def test_cached_plan_is_found_by_fingerprint():
    model, x = make("mlp")
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.from_bitstring(analysis, "1f1")
    path = cache.save_plan(plan)
    assert path.parent == cache.default_cache_dir() and path.is_file()
    assert cache.find_plan(analysis.fingerprint, low_dtype=analysis.low_dtype) == plan
    assert cache.find_plan(analysis.fingerprint) == plan
    assert cache.find_plan(analysis.fingerprint, low_dtype=torch.float16) is None
    compiled_backend = backend(None, inner="aot_eager")
    torch.compile(model, backend=compiled_backend)(*x)
    (record,) = compiled_backend.records
    assert record.origin == "cache" and record.plan_source.startswith("the plan cache")
    assert dict(record.precisions) == dict(plan)


def test_cache_dir_argument_wins_over_environment_and_damaged_files_are_skipped(tmp_path, caplog):
    model, x = make("mlp")
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.fp32(analysis)
    folder = tmp_path / "mine"
    cache.save_plan(plan, cache_dir=folder)
    assert cache.find_plan(analysis.fingerprint) is None  # the environment's folder is empty
    cache.plan_path(analysis.fingerprint, analysis.low_dtype, cache_dir=folder).write_text("{ truncated")
    with caplog.at_level(logging.WARNING, logger="compfx"):
        assert cache.find_plan(analysis.fingerprint, low_dtype=analysis.low_dtype, cache_dir=folder) is None
    assert any("damaged cached plan" in message for message in caplog.messages)


def test_a_new_plan_recompiles_with_the_new_precisions():
    model, x = make("encoder_matmul")
    analysis = compfx.analyze(model, x)
    first, second = compfx.Plan.amp(analysis), compfx.Plan.fp32(analysis)
    backend_a, backend_b = backend(first, inner="aot_eager"), backend(second, inner="aot_eager")
    compiled_a = torch.compile(model, backend=backend_a)
    out_a = compiled_a(*x)
    out_b = torch.compile(model, backend=backend_b)(*x)
    assert len(backend_a.records) == 1 and len(backend_b.records) == 1, "dynamo compiled again for the new backend"
    assert_records_follow_plan(backend_b.records, second, analysis.low_dtype)
    assert not torch.equal(out_a, out_b)
    torch.testing.assert_close(out_b, model(*x), **FP32_TOL)  # the all-FP32 plan is the model itself
    torch.testing.assert_close(compiled_a(*x), out_a)  # and the first compile still runs the first plan


# ---------------------------------------------------------------------------
# Hugging Face


def test_tiny_bert_trains_under_the_backend():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3)
    model = transformers.BertForSequenceClassification(config)
    ids, labels = torch.randint(0, 64, (2, 8)), torch.tensor([0, 2])
    analysis = compfx.analyze(model, {"input_ids": ids, "labels": labels})
    compiled = compile_with_plan(model, None, inner="aot_eager")  # Inductor would take minutes on this CPU
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = compiled(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    records = compiled.compfx_backend.records
    assert set(records[0].precisions) == set(analysis.keys), "the whole-model capture and dynamo key ops alike"
    assert_records_follow_plan(records, compfx.Plan.amp(analysis), analysis.low_dtype)


# ---------------------------------------------------------------------------
# Inductor (slow on this CPU: two small models, compiled modules reused)


@pytest.fixture(scope="module")
def mlp_under_registered_backend(tmp_path_factory):
    """``backend="compfx"`` on the MLP with an empty plan cache: the default plan, then Inductor."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cache.CACHE_DIR_ENV, str(tmp_path_factory.mktemp("empty-cache")))
        model, x = make("mlp")
        analysis = compfx.analyze(model, x)
        compiled = torch.compile(model, backend="compfx")
        out, grads = forward_and_grads(compiled, model, x)
        yield model, x, analysis, out, grads


def test_registered_backend_matches_apply_through_inductor(mlp_under_registered_backend):
    model, x, analysis, out, grads = mlp_under_registered_backend
    amp = compfx.Plan.amp(analysis)
    ref_out, ref_grads = forward_and_grads(apply(model, amp, analysis=analysis), model, x)
    torch.testing.assert_close(out, ref_out, **BF16_TOL)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **BF16_TOL)
    assert dict(registered_backend().records[-1].precisions) == dict(amp)


def test_inductor_with_a_new_plan_never_reuses_the_old_kernels(mlp_under_registered_backend):
    model, x, analysis, amp_out, _ = mlp_under_registered_backend
    plan = compfx.Plan.fp32(analysis)
    out, _ = forward_and_grads(torch.compile(model, backend=backend(plan, inner="inductor")), model, x)
    torch.testing.assert_close(out, model(*x).detach(), **FP32_TOL)
    assert not torch.allclose(out, amp_out, rtol=0, atol=1e-4), "bf16 results would mean a stale compiled graph"


def test_inductor_matches_apply_with_a_random_plan():
    model, x = make("encoder_sdpa")
    analysis = compfx.analyze(model, x)
    plan = random_plan(analysis, seed=11)
    compiled = torch.compile(model, backend=backend(plan, inner="inductor"))
    assert_matches_apply(compiled, model, plan, analysis, x, BF16_TOL)


class _LSTMTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_compile_with_plan_warns_when_dynamo_hands_it_no_graph():
    """Dynamo runs an nn.LSTM eagerly unless allow_rnn is set: no graph, no plan; compfx says so once."""
    model, x = _LSTMTagger(), torch.randn(2, 3, 4)
    plan = compfx.Plan.fp32(compfx.analyze(model, x))
    torch._dynamo.reset()
    compiled = compile_with_plan(model, plan, inner="eager")
    with pytest.warns(UserWarning, match="no graph for _LSTMTagger.*allow_rnn"):
        compiled(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled(x)  # once only
    assert not compiled.compfx_backend.records and "allow_rnn" in compiled.compfx_backend.report()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        compiled = compile_with_plan(model, plan, inner="eager")
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            compiled(x)
    assert compiled.compfx_backend.records
