"""Variable batch and sequence shapes: one plan, one graph per input signature, the same op keys in each.

Recorded and dynamo-captured graphs hold their inputs' sizes as constants;
``PlannedModule`` (what ``optimize`` returns) captures a new signature once and
rewrites it from the same OpKey-keyed plan. A bare graph called with other
shapes says which input and dimension differ, and what to do.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import compfx
from compfx.planned_module import PlannedModule, SignatureCaptures
from compfx.graph_capture import capture, input_signature
from compfx.errors import BadInputError
from compfx.search.sampling import FairSampler
from zoo import make

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

transformers = pytest.importorskip("transformers")


def tiny_bert():
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                     problem_type="single_label_classification")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).train()


def tiny_gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


MODELS = {"bert": tiny_bert, "gpt2": tiny_gpt2}


def tokens(name: str, batch: int, length: int, generator: torch.Generator) -> dict:
    ids = torch.randint(1, 64, (batch, length), generator=generator)
    labels = ids if name == "gpt2" else torch.randint(0, 3, (batch,), generator=generator)
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sequence_length_varying_per_batch_passes_the_search_and_post_training(name):
    model = MODELS[name]()
    g = torch.Generator().manual_seed(0)
    loader = [tokens(name, 4, length, g) for length in (8, 12, 8, 6, 12)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = compfx.optimize(model, loader, optimizer=optimizer, config=compfx.SearchConfig(
        progress=False, warmup=0, repeats=1, stage1_budget=2, stage2_budget=2, stage2_check_batches=1,
        cache_plan=False))
    assert math.isfinite(result.loss0)
    assert "input signatures: 3" in result.report()
    for length in (10, 16):
        optimizer.zero_grad(set_to_none=True)
        loss = result.module(**tokens(name, 3, length, g)).loss
        loss.backward()
        optimizer.step()
        assert math.isfinite(float(loss.detach()))
    keys = result.analysis.keys
    for graph in result.module.graphs.values():  # one plan, keyed the same at every shape
        assert tuple(n.meta["compfx_key"] for n in compfx.graph_capture.op_nodes(graph)) == keys


def test_a_recorded_graph_at_another_shape_names_the_input_and_dimension():
    model = tiny_bert()
    g = torch.Generator().manual_seed(0)
    analysis = compfx.analyze(model, tokens("bert", 4, 8, g))
    assert analysis.capture_method == "record"
    graph = compfx.apply(model, compfx.Plan.fp32(analysis), analysis=analysis).graph_module  # one signature's
    with pytest.raises(BadInputError, match=r"input_ids has size 3 in dimension 0 \(the batch\).*PlannedModule"):
        graph(**tokens("bert", 3, 8, g))
    with pytest.raises(BadInputError, match=r"input_ids has size 12 in dimension 1 \(the sequence"):
        graph(**tokens("bert", 4, 12, g))
    with pytest.raises(BadInputError, match="input_ids is torch.int32"):
        graph(input_ids=torch.ones(4, 8, dtype=torch.int32), labels=torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("method", ["symbolic", "record", "dynamo"])
def test_fp32_plan_matches_eager_at_every_shape_and_mode(method):
    model, (x,) = make("encoder_sdpa")
    analysis = compfx.analyze(model, x, method=method)
    assert analysis.capture_method == method
    planned = PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)
    for shape in ((2, 8, 16), (3, 5, 16), (1, 8, 16)):
        inputs = torch.randn(*shape)
        torch.manual_seed(0)
        got = planned(inputs)
        torch.manual_seed(0)
        assert torch.equal(got, model(inputs)), shape
    planned.eval()
    model.eval()
    inputs = torch.randn(3, 5, 16)
    assert torch.equal(planned(inputs), model(inputs))
    assert [s.training for s in planned.specializations] == [True, True, False]
    assert all(s.capture_seconds > 0 for s in planned.specializations)


def test_op_keys_are_the_same_at_every_sequence_length():
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    keys = [[str(n.meta["compfx_key"]) for n in compfx.graph_capture.op_nodes(capture(model, tokens("gpt2", b, s, g)))]
            for b, s in ((4, 8), (1, 3), (3, 17))]
    assert keys[0] == keys[1] == keys[2]


def test_a_signature_whose_ops_differ_runs_the_plan_where_it_fits_and_says_so(caplog):
    model, (x,) = make("shape_branch")  # 4-d inputs are pooled first, 2-d inputs are not
    analysis = compfx.analyze(model, x)
    planned = PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)
    flat = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="compfx"):
        assert torch.equal(planned(flat), model(flat))
    (special,) = planned.specializations
    assert special.missing == 1 and special.unplanned == ()
    assert "the model lacks 1 op(s) the plan names" in caplog.text
    assert "does not name" not in caplog.text  # says only what is the case, not "runs 0 op(s) the plan does not name"


def test_planned_module_shares_the_models_tensors_and_captures_each_signature_once():
    model, (x,) = make("mlp")
    analysis = compfx.analyze(model, x)
    captures = SignatureCaptures(model, analysis)
    first = PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis, captures=captures)
    second = PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis, captures=captures)
    assert first.state_dict().keys() == model.state_dict().keys()
    assert all(p is q for p, q in zip(first.parameters(), model.parameters()))
    other = torch.randn(7, 16)
    assert first.specialize((other,), {}) is first.specialize((torch.randn(7, 16),), {}), "one graph per signature"
    second(other)
    assert first.specializations[0].capture_seconds > 0 and second.specializations[0].capture_seconds == 0
    assert len(captures) == 2 and len(first.specializations) == len(second.specializations) == 1


def test_the_sampler_specialises_before_the_timed_step():
    events = []

    class Recording(torch.nn.Linear):
        def specialize(self, args, kwargs):
            events.append(("specialize", tuple(args[0].shape)))

        def forward(self, x):
            events.append(("forward", tuple(x.shape)))
            return super().forward(x)

    model = Recording(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randn(8, 1)), (torch.randn(3, 4), torch.randn(3, 1))]
    sampler = FairSampler(model, opt, loader, lambda out, b: torch.nn.functional.mse_loss(out, b[-1]), device="cpu")
    list(sampler.epoch(model))
    assert events == [("specialize", (8, 4)), ("forward", (8, 4)), ("specialize", (3, 4)), ("forward", (3, 4))]


def test_signatures_differ_by_shape_dtype_structure_and_mode():
    x = torch.zeros(2, 3)
    base = input_signature((x,), {}, True)
    assert base == input_signature((torch.ones(2, 3),), {}, True)
    assert base != input_signature((x.double(),), {}, True)
    assert base != input_signature((x,), {}, False)
    assert base != input_signature((), {"x": x}, True)
    assert input_signature((), {"a": x, "b": x}, True) == input_signature((), {"b": x, "a": x}, True)
    assert input_signature(([x, x],), {"flag": True}, True) != input_signature(([x, x],), {"flag": False}, True)


class ReadsAValueForOneRow(torch.nn.Module):
    """Reads a tensor's value into Python for a batch of one row (recorded graphs cannot hold that)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = torch.Tensor.matmul(x, torch.ones(4, 4))  # symbolic tracing cannot follow this: recorded
        if x.shape[0] == 1:
            y = y * float(y.sum())
        return self.fc(y)


def test_a_signature_that_cannot_be_captured_says_which_and_stops_the_search():
    model = ReadsAValueForOneRow()
    analysis = compfx.analyze(model, torch.randn(4, 4))
    assert analysis.capture_method == "record"
    planned = PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)
    with pytest.raises(compfx.CaptureError, match=r"inputs 1x4 \(train mode\) are a new input signature.*record"):
        planned(torch.randn(1, 4))
    loader = [(torch.randn(4, 4), torch.randn(4, 2)), (torch.randn(1, 4), torch.randn(1, 2))]
    with pytest.raises(compfx.CaptureError, match="new input signature"):
        compfx.optimize(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[-1]),
                        config=compfx.SearchConfig(progress=False, cache_plan=False))
