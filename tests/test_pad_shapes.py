"""Tensor Core shape padding, "can we" and "how": the analyzer's pad_eligible, padding in the plan, the pad_shapes pass.

The pass must be invisible but for speed: outputs and gradients equal the unpadded op's within the op's own
accumulation-order tolerance (passes/pad_shapes.py's docstring), the Parameters, optimizer and state_dict are the
model's, and an op that already meets the rule is never padded.
"""

from __future__ import annotations

import copy
import importlib
import math
import pickle

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import compfx
from compfx.planned_module import PlannedModule, apply
from compfx.errors import PlanFileError, PlanMismatchError
from compfx.opkey import OpKey
from compfx.passes import pad_shapes
from compfx.passes.pad_shapes import PAD_META, PADDED_META
from compfx.tensor_cores import pad_eligible

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

pad_shapes_module = importlib.import_module("compfx.passes.pad_shapes")  # the package's name is the function

ACCUMULATION_EPS = torch.finfo(torch.float32).eps  # CPU kernels accumulate fp32, bf16 and fp16 products in fp32


# -- the ops under test: one bilinear op each, so |op|(|a|, |b|) bounds its rounding ---------------------------

class Matmul(nn.Module):
    def __init__(self, weight_shape):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*weight_shape))

    def forward(self, x):
        return x @ self.weight


class Mm(Matmul):
    def forward(self, x):
        return torch.mm(x, self.weight)


class Bmm(Matmul):
    def forward(self, x):
        return torch.bmm(x, self.weight)


# name: (module factory, input shape, inner length bound k: the longest sum of products forward or backward, padded)
OPS = {
    "linear": (lambda: nn.Linear(30, 1001), (5, 30), 1008),
    "linear_3d_rows": (lambda: nn.Linear(10, 13), (3, 5, 10), 16),
    "linear_fit_rows_no_bias": (lambda: nn.Linear(12, 20, bias=False), (8, 12), 24),
    "matmul_batched": (lambda: Matmul((3, 9, 7)), (3, 5, 9), 16),
    "mm": (lambda: Mm((9, 7)), (5, 9), 16),
    "bmm": (lambda: Bmm((2, 9, 12)), (2, 6, 9), 16),
    "conv1d": (lambda: nn.Conv1d(3, 10, 3), (2, 3, 9), 16 * 3 + 2 * 7),
    "conv2d": (lambda: nn.Conv2d(3, 10, 3, padding=1), (2, 3, 6, 6), 16 * 9 + 2 * 36),
    "conv2d_no_bias_out_only": (lambda: nn.Conv2d(8, 6, 3, bias=False), (2, 8, 5, 5), 8 * 9 + 2 * 9),
    "conv3d": (lambda: nn.Conv3d(5, 4, 2), (1, 5, 3, 3, 3), 8 * 8 + 8),
}


def _setup(name: str, seed: int = 0):
    factory, shape, k = OPS[name]
    torch.manual_seed(seed)
    model = factory()
    x = torch.randn(*shape)
    return model, x, k


def _outputs_and_grads(module, model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """The output, then the gradients of the input and of every parameter (``module`` runs ``model``'s)."""
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad)
    results = [out.detach(), x.grad]
    results += [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return results


def _absolute_bounds(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """sum |a_i| |b_i| for every output and gradient element: the op run on absolute values, in float64.

    The op is bilinear in (input, weight) and linear in the bias, so the gradients of <|grad|, |op|(|x|, |w|)>
    are the absolute-value sums of the backward products too.
    """
    absolute = copy.deepcopy(model).double()
    with torch.no_grad():
        for p in absolute.parameters():
            p.abs_()
    return _outputs_and_grads(absolute, absolute, x.double().abs(), grad.double().abs())


def _within_tolerance(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, k: int,
                      output_dtype: torch.dtype) -> bool:
    """|actual - expected| <= k * eps * bound (any two summation orders) + one rounding of a low output dtype."""
    rounding = torch.finfo(output_dtype).eps * expected.double().abs() if output_dtype != torch.float32 else 0
    allowed = k * ACCUMULATION_EPS * bound + rounding + 1e-30
    return bool(((actual.double() - expected.double()).abs() <= allowed).all())


def _check_padded_matches(name: str, precision: str) -> tuple[fx.GraphModule, list, list]:
    model, x, k = _setup(name)
    analysis = compfx.analyze(model, x)
    base = compfx.Plan.uniform(analysis, precision)
    padded_plan = base.with_padding([op.key for op in analysis.ops if op.pad_eligible], analysis=analysis)
    assert padded_plan.padded, f"{name} should be pad-eligible"
    padded, unpadded = apply(model, padded_plan, analysis=analysis), apply(model, base, analysis=analysis)
    grad = torch.randn_like(model(x))
    actual = _outputs_and_grads(padded, model, x, grad)
    expected = _outputs_and_grads(unpadded, model, x, grad)
    bounds = _absolute_bounds(model, x, grad)
    dtype = analysis.low_dtype if precision == "low" else torch.float32
    for what, a, e, b in zip(["output", "input grad", *[n for n, _ in model.named_parameters()]], actual, expected,
                             bounds):
        assert a.shape == e.shape and a.dtype == e.dtype, what
        assert _within_tolerance(a, e, b, k, dtype), f"{name} {precision}: {what} differs by " \
                                                     f"{(a - e).abs().max():.3g}"
    return padded.graph_module, actual, expected


@pytest.mark.parametrize("precision", ["fp32", "low"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_padded_op_gives_the_unpadded_outputs_and_grads_within_accumulation_tolerance(name, precision):
    padded, _, _ = _check_padded_matches(name, precision)
    inserted = [n for n in padded.graph.nodes if n.meta.get(PAD_META)]
    assert inserted and any(n.target is torch.nn.functional.pad for n in inserted)
    assert padded.meta[PADDED_META] == tuple(k for k in padded.meta["compfx_plan"].padded)


def test_the_tolerance_check_catches_padding_that_is_not_zeros(monkeypatch):
    """The check above can fail: pad with ones instead of zeros and it does."""
    def ones(widths):
        return pad_shapes_module._Step("call_function", torch.nn.functional.pad, (tuple(widths), "constant", 1.0))

    monkeypatch.setattr(pad_shapes_module, "_pad", ones)
    with pytest.raises(AssertionError, match="differs by"):
        _check_padded_matches("linear", "fp32")


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 20), k=st.integers(1, 20), lead=st.sampled_from([(), (2,), (2, 3)]))
def test_padded_linear_at_random_shapes(m, n, k, lead):
    torch.manual_seed(m * 400 + n * 20 + k)
    model, x = nn.Linear(k, n), torch.randn(*lead, m, k)
    analysis = compfx.analyze(model, x)
    [op] = analysis.ops
    rows = math.prod(lead) * m
    assert op.pad_eligible == any(d % 8 for d in (rows, n, k))
    if not op.pad_eligible:
        return
    plan = compfx.Plan.fp32(analysis).with_padding([op.key], analysis=analysis)
    grad = torch.randn(*lead, m, n)
    actual = _outputs_and_grads(apply(model, plan, analysis=analysis), model, x, grad)
    expected = _outputs_and_grads(model, model, x, grad)
    inner = max(-(-d // 8) * 8 for d in (rows, n, k))
    for a, e, b in zip(actual, expected, _absolute_bounds(model, x, grad)):
        assert _within_tolerance(a, e, b, inner, torch.float32)


# -- what the pass inserts ------------------------------------------------------------------------------------

class _Actual(fx.Interpreter):
    """Runs the graph and keeps each node's real output."""

    def run_node(self, n):
        value = super().run_node(n)
        self.seen[n] = value
        return value


def test_inserted_nodes_carry_the_ops_metadata_and_true_values():
    linear, x, _ = _setup("linear_3d_rows")
    model = nn.Sequential(linear)  # a submodule: its op has a module stack to copy
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.amp(analysis).with_padding([analysis.ops[0].key], analysis=analysis)
    gm = apply(model, plan, analysis=analysis).graph_module
    op = next(n for n in gm.graph.nodes if n.meta.get("compfx_key") == analysis.ops[0].key)
    assert "nn_module_stack" in op.meta
    interpreter = _Actual(gm)
    interpreter.seen = {}
    interpreter.run(x)
    inserted = [n for n in gm.graph.nodes if n.meta.get(PAD_META)]
    assert [n.target for n in inserted] == ["reshape", torch.nn.functional.pad, torch.nn.functional.pad,
                                            torch.nn.functional.pad, "narrow", "narrow", "contiguous", "reshape"]
    for node in inserted:
        assert node.meta["nn_module_stack"] == op.meta["nn_module_stack"]
        assert node.meta.get("stack_trace") == op.meta.get("stack_trace")
        real = interpreter.seen[node]
        for recorded in (node.meta["val"], node.meta["tensor_meta"]):
            assert tuple(recorded.shape) == tuple(real.shape) and recorded.dtype == real.dtype, node.name
    assert [n.meta[PAD_META] for n in inserted] == ["operand"] * 4 + ["result"] * 4
    assert tuple(op.meta["val"].shape) == (16, 16)  # the op itself now computes the padded tile
    assert tuple(inserted[-1].meta["val"].shape) == (3, 5, 13)  # what its consumers see: the unpadded shape


def test_parameters_optimizer_and_state_dict_are_the_models_own():
    model, x, _ = _setup("conv2d")
    reference = copy.deepcopy(model)
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.amp(analysis).with_padding([analysis.ops[0].key], analysis=analysis)
    planned = PlannedModule(model, plan, analysis=analysis)
    assert [(k, v.shape, v.dtype) for k, v in planned.state_dict().items()] == \
        [(k, v.shape, v.dtype) for k, v in model.state_dict().items()]
    assert planned.get_parameter("weight") is model.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    planned(x).square().mean().backward()
    assert model.weight.grad.shape == model.weight.shape and model.bias.grad.shape == model.bias.shape
    optimizer.step()
    assert model.weight.shape == reference.weight.shape and not torch.equal(model.weight, reference.weight)
    assert [len(g["params"]) for g in optimizer.state_dict()["param_groups"]] == [2]
    reference.load_state_dict(planned.state_dict())  # a checkpoint of the planned module loads into the model


def test_diagnose_compares_a_padded_op_as_the_model_sees_it():
    model, x = nn.Sequential(nn.Linear(16, 10), nn.Linear(10, 3)), torch.randn(5, 16)
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.amp(analysis).with_padding([op.key for op in analysis.ops], analysis=analysis)
    diagnosis = compfx.diagnose(PlannedModule(model, plan, analysis=analysis), x)
    for op in analysis.ops:  # sliced back, each output and gradient pairs with the FP32 shadow's
        row = diagnosis.row(op.key)
        assert 0 < row.error < 2e-2 and row.grad_error is not None and row.grad_error < 2e-2, row


def test_an_op_that_already_meets_the_rule_is_never_padded():
    model, x = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 10)), torch.randn(8, 16)
    analysis = compfx.analyze(model, x)
    fit, unfit = analysis.ops[0], analysis.ops[2]
    assert not fit.pad_eligible and fit.pad_reason == "dims are multiples of 8 already" and unfit.pad_eligible
    with pytest.raises(PlanMismatchError, match="pads 1 op.*0:linear#0: dims are multiples of 8 already"):
        compfx.Plan.amp(analysis).with_padding([fit.key], analysis=analysis)
    unchecked = compfx.Plan.amp(analysis).with_padding([fit.key, unfit.key])  # no analysis to check against here
    with pytest.raises(PlanMismatchError, match="pad_eligible"):
        apply(model, unchecked, analysis=analysis)  # ... so apply refuses it
    gm = pad_shapes(compfx.capture(model, x), [fit.key])  # and the pass itself leaves a fitting op alone
    assert not any(n.meta.get(PAD_META) for n in gm.graph.nodes) and gm.meta[PADDED_META] == ()


def test_a_new_input_signature_is_padded_for_its_own_shapes():
    model, x = nn.Linear(16, 10), torch.randn(5, 16)  # rows 5 and out_features 10 miss the rule
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.fp32(analysis).with_padding([analysis.ops[0].key], analysis=analysis)
    planned = PlannedModule(model, plan, analysis=analysis)
    for batch in (5, 8):  # at 8 rows only out_features is padded
        y = torch.randn(batch, 16)
        torch.testing.assert_close(planned(y), model(y))
    pads = {}
    for graph in planned._graphs.values():
        [x_node] = [n for n in graph.graph.nodes if n.op == "placeholder"]
        pads[tuple(x_node.meta["val"].shape)] = [n.args[1] for n in graph.graph.nodes
                                                 if n.target is torch.nn.functional.pad]
    assert pads == {(5, 16): [(0, 0, 0, 3), (0, 0, 0, 6), (0, 6)], (8, 16): [(0, 0, 0, 6), (0, 6)]}


# -- the analyzer: can it be padded? ---------------------------------------------------------------------------

class MatVec(nn.Module):
    def forward(self, a, v):
        return a @ v


@pytest.mark.parametrize("kind, category, shapes, groups, expected", [
    ("linear", "whitelist", [(64, 768), (50257, 768)], 1, (True, "out_features 50257 -> 50264")),
    ("linear", "whitelist", [(2, 7, 768), (768, 768)], 1, (True, "input rows 14 -> 16")),
    ("linear", "whitelist", [(64, 768), (1000, 768)], 1, (False, "dims are multiples of 8 already")),
    ("conv2d", "whitelist", [(8, 3, 32, 32), (64, 3, 7, 7)], 1, (True, "in_channels 3 -> 8")),
    ("conv2d", "whitelist", [(8, 6, 32, 32), (6, 3, 3, 3)], 2, (False, "grouped convolution (groups=2): its "
                                                                       "channels are not padded")),
    ("matmul", "whitelist", [(5, 9), (9,)], 1, (False, "a 1-D operand (a matrix-vector product): nothing to pad "
                                                       "into a Tensor Core tile")),
    ("addmm", "whitelist", [(7,), (5, 9), (9, 7)], 1, (False, "no padding rule for addmm (only linear, matmul, mm, "
                                                              "bmm and conv1d/2d/3d are padded)")),
    ("softmax", "blacklist", [(5, 9)], 1, (False, "only whitelist ops run low on Tensor Cores")),
])
def test_pad_eligible(kind, category, shapes, groups, expected):
    assert pad_eligible(kind, category, shapes, groups=groups) == expected


def test_leaf_module_calls_are_not_pad_eligible_and_the_table_says_what_padding_changes():
    model = nn.Sequential(nn.Linear(16, 10), nn.ReLU(), nn.Linear(10, 4))
    leafy = compfx.analyze(model, torch.randn(8, 16), leaf_modules=(nn.Linear,))
    assert [(op.pad_eligible, op.pad_reason) for op in leafy.ops if op.kind == "linear"] == \
        [(False, "a leaf module call: its weight is not a graph input the pass can pad")] * 2
    analysis = compfx.analyze(model, torch.randn(8, 16))
    plan = compfx.Plan.amp(analysis).with_padding([analysis.ops[0].key], analysis=analysis)
    table = analysis.table(plan).splitlines()
    assert "pad" in table[0] and "padded: out_features 10 -> 16" in table[2] and "in_features 10 -> 16" in table[4]
    assert "padded:" not in table[4] and "2 would meet the rule if padded" in analysis.summary()


# -- padding in the plan and its file ---------------------------------------------------------------------------

def _padded_plan():
    model, x = nn.Sequential(nn.Linear(16, 10), nn.ReLU(), nn.Linear(10, 4)), torch.randn(8, 16)
    analysis = compfx.analyze(model, x)
    keys = [op.key for op in analysis.ops if op.pad_eligible]
    return model, x, analysis, compfx.Plan.amp(analysis).with_padding(keys, analysis=analysis)


def test_a_padded_plan_saves_loads_and_applies(tmp_path):
    model, x, analysis, plan = _padded_plan()
    plan.save(tmp_path / "plan.json")
    loaded = compfx.Plan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.padded == plan.padded and len(loaded.padded) == 2
    assert plan.to_dict()["padded"] == ["0:linear#0", "2:linear#0"]
    gm = apply(model, loaded, analysis=analysis).graph_module
    assert set(gm.meta[PADDED_META]) == plan.padded
    torch.testing.assert_close(gm(x), apply(model, plan, analysis=analysis)(x))
    assert pickle.loads(pickle.dumps(plan)).padded == plan.padded


def test_plan_files_without_padding_still_load_and_bad_padding_is_a_plan_file_error(tmp_path):
    _, _, analysis, plan = _padded_plan()
    old = {k: v for k, v in plan.to_dict().items() if k != "padded"}  # what compfx wrote before padding existed
    assert compfx.Plan.from_dict(old).padded == frozenset() and compfx.Plan.from_dict(old) == plan.with_padding(())
    for bad, match in [("0:linear#0", "expected a list of op keys"), (["9:linear#0"], "not in this plan"),
                       ([3], "expected a list of op keys")]:
        with pytest.raises(PlanFileError, match=match):
            compfx.Plan.from_dict({**old, "padded": bad}, source="plan file x.json")


def test_with_padding_refuses_keys_it_cannot_pad_and_padding_is_part_of_equality():
    _, _, analysis, plan = _padded_plan()
    assert plan != plan.with_padding(()) and hash(plan) != hash(plan.with_padding(()))
    assert plan.with_precisions({analysis.ops[1].key: "fp32"}).padded == plan.padded
    with pytest.raises(PlanMismatchError, match="not in this plan"):
        plan.with_padding([OpKey.parse("other:linear#0")])
    with pytest.raises(PlanMismatchError, match="at 'fp8'"):
        plan.with_precisions({analysis.ops[0].key: "fp8"})
    with pytest.raises(PlanMismatchError, match="collection of OpKeys"):
        plan.with_padding(analysis.ops[0].key)
    assert "2 padded" in repr(plan)
