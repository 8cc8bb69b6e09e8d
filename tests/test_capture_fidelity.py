"""Capture fidelity: a captured graph trains what the model trains, or compfx refuses it.

The graph is verified against eager at capture (outputs, every gradient, the tensors saved for backward);
custom autograd Functions run as themselves; checkpointed regions stay checkpointed; a capture error names
the real blocker.
"""

import copy
import random
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

import compfx
from compfx.graph_capture import capture
from compfx.graph_capture.checkpoints import CHECKPOINT_META, CheckpointedGraph, checkpointed_nodes
from compfx.graph_capture.functions import FunctionCall
from compfx.graph_capture.verify import SAVED_TENSOR_SLACK, VERIFICATION_META, verify_capture
from compfx.cast_policy import AutocastRegion, is_cast
from compfx.errors import CaptureError
from compfx.opkey import KEY_META
from compfx.vocabulary import Precision
from zoo import NativeMHA

from tests.helpers import assert_bitwise, seeded_grads

TRACERS = ["symbolic", "record"]


# -- models ---------------------------------------------------------------------------------------

class ScaledSquare(torch.autograd.Function):
    """A fused activation written as a Function: forward under no-grad, its own backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return scale * x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * ctx.scale * x * grad, None


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.down(ScaledSquare.apply(self.up(x), 0.5))


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class CheckpointedMLP(nn.Module):
    """Four blocks, each run through torch.utils.checkpoint."""

    def __init__(self, use_reentrant=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 4)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


class GradientHook(nn.Module):
    """Scales the gradient flowing into ``up`` with a hook on an intermediate tensor: no graph records that."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.up(x)
        if h.requires_grad:
            h.register_hook(lambda grad: grad * 2)
        return self.down(torch.relu(h))


class TensorCheck(nn.Module):
    """Code that asks isinstance(x, torch.Tensor): a symbolic proxy is not one, so symbolic tracing takes the
    other branch and its graph computes something else; a recorded FakeTensor is one."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        scale = 1.0 if isinstance(x, torch.Tensor) else 0.5
        return self.fc(x) * scale


class LossBranch(nn.Module):
    """Symbolic tracing fails early (a Python float of a size); the real blocker is the loss's value branch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, labels):
        h = self.fc(x) / torch.tensor([float(x.size(-1))]).sqrt()  # SYMBOLIC-FAILS
        loss = F.cross_entropy(h, labels)
        if loss.item() > 100.0:  # THE-BLOCKER
            loss = loss / 2
        return loss


class PlusMinusEps(torch.autograd.Function):
    """Adds +-1e-3 at random (Python's RNG, which no fork replays): a kernel whose bits vary run to run."""

    @staticmethod
    def forward(ctx, x):
        signs = torch.tensor([random.choice((-1.0, 1.0)) for _ in range(x.numel())]).view_as(x)
        return x + 1e-3 * signs

    @staticmethod
    def backward(ctx, grad):
        return grad


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 32)

    def forward(self, x):
        return PlusMinusEps.apply(self.fc(x))


def _grads(model):
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def _train_step(module, inputs, probe):
    """One forward and backward from a fixed output gradient; the gradients it gave."""
    for p in module.parameters():
        p.grad = None
    out = module(*inputs)
    out.backward(probe)
    return out.detach()


def _assert_grads_bitwise(model, eager_grads):
    for name, p in model.named_parameters():
        expected = eager_grads[name]
        assert (p.grad is None) == (expected is None), name
        if expected is not None:
            torch.testing.assert_close(p.grad, expected, rtol=0, atol=0, msg=name)


class _CountMatmuls(TorchDispatchMode):
    """How many addmm/mm kernels ran: a checkpointed block runs its linears again in backward."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _saved_requiring_grad(fn) -> int:
    count = [0]

    def pack(tensor):
        count[0] += tensor.requires_grad
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return count[0], out


# -- custom autograd Functions ----------------------------------------------------------------------

@pytest.mark.parametrize("method", TRACERS)
def test_a_custom_function_runs_as_itself_and_every_gradient_matches_eager(method):
    torch.manual_seed(0)
    model, x = WithFunction(), torch.randn(4, 8)
    probe = torch.randn(4, 4)
    eager_out = _train_step(model, (x,), probe)
    eager = _grads(model)
    analysis = compfx.analyze(model, x, method=method)
    calls = [n for n in analysis.graph_module.graph.nodes if isinstance(n.target, FunctionCall)]
    assert len(calls) == 1 and calls[0].target.function is ScaledSquare
    assert str(calls[0].meta[KEY_META]) == ":scaled_square#0"  # one op of the plan, keyed like any other
    assert analysis.verification.exact and analysis.verification.faithful
    planned = compfx.apply(model, compfx.Plan.fp32(analysis), analysis=analysis)
    torch.testing.assert_close(_train_step(planned, (x,), probe), eager_out, rtol=0, atol=0)
    _assert_grads_bitwise(model, eager)  # up.weight and up.bias included: a traced-through Function leaves them None


class ProjectThenSquare(torch.autograd.Function):
    """A fused projection: a matmul inside forward, which eager AMP runs under the caller's autocast."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (x @ w) ** 2

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        inner = 2 * (x @ w) * grad
        return inner @ w.T, x.T @ inner


class WithProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.w, self.down = nn.Linear(8, 16), nn.Parameter(torch.randn(16, 16) / 4), nn.Linear(16, 4)

    def forward(self, x):
        return self.down(ProjectThenSquare.apply(self.up(x), self.w))


def test_a_custom_function_planned_low_runs_under_autocast_as_in_eager_amp():
    torch.manual_seed(0)
    model, x = WithFunction(), torch.randn(4, 8)
    analysis = compfx.analyze(model, x, low_dtype=torch.bfloat16)
    (op,) = [op for op in analysis.ops if op.kind == "scaled_square"]
    assert op.category == "whitelist"  # whatever the class is called: AMP runs it under autocast
    plan = compfx.Plan.from_assignment(analysis, [Precision.LOW if o.key == op.key else Precision.FP32
                                                  for o in analysis.ops])
    planned = compfx.apply(model, plan, analysis=analysis)
    assert sum(isinstance(m, AutocastRegion) for m in planned.graph_module.modules()) == 1
    planned(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_amps_plan_of_a_custom_function_with_a_matmul_inside_is_autocast_bitwise():
    torch.manual_seed(0)
    model, kwargs = WithProjection(), {"x": torch.randn(4, 8)}
    analysis = compfx.analyze(model, kwargs, low_dtype=torch.bfloat16)
    gm = compfx.apply(model, compfx.Plan.amp(analysis), analysis=analysis, restore_output_dtypes=False)
    assert_bitwise(seeded_grads(model, kwargs, autocast_dtype=torch.bfloat16), seeded_grads(gm, kwargs))


# -- activation checkpointing -----------------------------------------------------------------------

def _all_low(analysis):
    return compfx.Plan.uniform(analysis, Precision.LOW)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("method", TRACERS)
def test_checkpointed_regions_stay_checkpointed_and_recompute(method, use_reentrant):
    torch.manual_seed(0)
    model = CheckpointedMLP(use_reentrant)
    x = torch.randn(8, 16, requires_grad=use_reentrant)  # reentrant checkpointing needs an input that needs grad
    probe = torch.randn(8, 4)
    eager_saved, _ = _saved_requiring_grad(lambda: model(x))
    with _CountMatmuls() as eager_kernels:
        eager_out = _train_step(model, (x,), probe)
    eager = _grads(model)

    analysis = compfx.analyze(model, x, method=method, low_dtype=torch.bfloat16)
    assert analysis.capture_method == method
    assert len(checkpointed_nodes(analysis.graph_module.graph)) == 4
    assert {op.key.module for op in analysis.ops} >= {f"blocks.{i}.fc1" for i in range(4)}  # the plan covers them
    planned = compfx.apply(model, compfx.Plan.fp32(analysis), analysis=analysis)
    saved, _ = _saved_requiring_grad(lambda: planned(x))
    assert saved <= eager_saved + SAVED_TENSOR_SLACK  # inlined, every activation would be saved (19 vs 4)
    with _CountMatmuls() as planned_kernels:
        out = _train_step(planned, (x,), probe)
    assert planned_kernels.count == eager_kernels.count  # the blocks' linears run again in backward, as in eager
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    _assert_grads_bitwise(model, eager)

    low = compfx.apply(model, _all_low(analysis), analysis=analysis).graph_module
    regions = checkpointed_nodes(low.graph)
    inside = {node for nodes in regions.values() for node in nodes}
    casts = [n for n in low.graph.nodes if is_cast(n) and all(u in inside for u in n.users)]
    assert casts and all(cast in inside for cast in casts)  # the plan's casts are recomputed with their ops
    low_saved, _ = _saved_requiring_grad(lambda: low(x))
    assert low_saved <= eager_saved + SAVED_TENSOR_SLACK
    low(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_planned_graph_keeps_its_regions_whatever_copy_of_the_graph_the_passes_rewrote():
    torch.manual_seed(0)
    model, x = CheckpointedMLP(), torch.randn(8, 16)
    analysis = compfx.analyze(model, x)
    plain = copy.deepcopy(analysis.graph_module.graph)
    plain.__class__ = torch.fx.Graph  # a copy made as fx.Graph copies: the nodes keep their regions, the class is lost
    analysis.graph_module.graph = plain
    eager_saved, _ = _saved_requiring_grad(lambda: model(x))
    planned = compfx.apply(model, _all_low(analysis), analysis=analysis).graph_module
    assert isinstance(planned.graph, CheckpointedGraph)
    saved, _ = _saved_requiring_grad(lambda: planned(x))
    assert saved <= eager_saved + SAVED_TENSOR_SLACK


class _UnfitBlock(nn.Module):
    """Widths that miss the Tensor Core rule (12, 20), so the linears are pad-eligible."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 20), nn.Linear(20, 12)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class _CheckpointedUnfit(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_UnfitBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def test_padding_sits_inside_the_checkpointed_region_of_its_op():
    """The padding pass's pads and slices are recomputed with their op: a region split by them would save more."""
    torch.manual_seed(0)
    model, x = _CheckpointedUnfit(), torch.randn(8, 12)
    analysis = compfx.analyze(model, x, low_dtype=torch.bfloat16)
    eligible = [op.key for op in analysis.ops if op.pad_eligible]
    assert len(eligible) == 4
    plan = _all_low(analysis).with_padding(eligible, analysis=analysis)
    unpadded = compfx.apply(model, _all_low(analysis), analysis=analysis).graph_module
    padded = compfx.apply(model, plan, analysis=analysis).graph_module
    inside = {node for nodes in checkpointed_nodes(padded.graph).values() for node in nodes}
    pads = [n for n in padded.graph.nodes if n.meta.get("compfx_pad")]
    assert pads and all(n in inside for n in pads)
    unpadded_saved, _ = _saved_requiring_grad(lambda: unpadded(x))
    padded_saved, _ = _saved_requiring_grad(lambda: padded(x))
    assert padded_saved == unpadded_saved


def test_reentrant_checkpointing_keeps_its_no_gradient_pitfall_as_eager_does():
    """use_reentrant=True with inputs that need no gradient gives the blocks' parameters none, in eager and so in
    the graph: the graph trains what the model trains, not what it was meant to."""
    torch.manual_seed(0)
    model, x = CheckpointedMLP(use_reentrant=True), torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that no input requires grad
        analysis = compfx.analyze(model, x)
        assert analysis.verification.exact
        compfx.apply(model, compfx.Plan.fp32(analysis), analysis=analysis)(x).sum().backward()
    assert model.blocks[0].fc1.weight.grad is None and model.head.weight.grad is not None


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hugging_face_gradient_checkpointing_is_kept(use_reentrant):
    """Llama's rotary embedding runs under no_grad just before the first checkpointed layer: the region is still
    entered with autograd on, as in eager."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    analysis = compfx.analyze(model, {"input_ids": ids, "labels": ids})
    assert len(checkpointed_nodes(analysis.graph_module.graph)) == 2
    assert analysis.verification.exact  # regions entered under no_grad: 44 tensors saved, or a loss without gradient


class ComposableCheckpointed(nn.Module):
    """torch.distributed's composable checkpoint(module): hooks, no checkpoint() call in forward."""

    def __init__(self):
        super().__init__()
        from torch.distributed._composable import checkpoint as checkpoint_module

        self.blocks = nn.ModuleList(checkpoint_module(Block()) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("method", TRACERS)
def test_composable_checkpointing_is_kept_too(method):
    torch.manual_seed(0)
    model, x = ComposableCheckpointed(), torch.randn(8, 16)
    analysis = compfx.analyze(model, x, method=method)
    assert len(checkpointed_nodes(analysis.graph_module.graph)) == 3 and analysis.verification.exact
    eager_saved, _ = _saved_requiring_grad(lambda: model(x))
    saved, _ = _saved_requiring_grad(lambda: compfx.apply(model, compfx.Plan.fp32(analysis), analysis=analysis)(x))
    assert saved <= eager_saved + SAVED_TENSOR_SLACK


def test_a_graph_that_drops_checkpointing_is_not_faithful():
    torch.manual_seed(0)
    model, x = CheckpointedMLP(), torch.randn(8, 16)
    graph = copy.deepcopy(capture(model, x, method="symbolic").graph)
    graph.__class__ = torch.fx.Graph  # what symbolic tracing gave before: every op inlined, none recomputed
    for node in graph.nodes:
        node.meta.pop(CHECKPOINT_META, None)
    inlined = torch.fx.GraphModule(model, graph)
    result = verify_capture(model, inlined, (x,), {}, method="symbolic")
    assert not result.faithful and "saves" in result.mismatch and "checkpoint" in result.mismatch
    assert result.saved_graph > result.saved_eager + SAVED_TENSOR_SLACK


# -- verification ------------------------------------------------------------------------------------

def test_a_model_whose_gradients_no_graph_records_is_refused_not_trained():
    torch.manual_seed(0)
    model, x = GradientHook(), torch.randn(4, 8)
    with pytest.raises(CaptureError) as info:
        compfx.analyze(model, x)
    message = str(info.value)
    assert "'up.weight'" in message and "would train differently" in message
    assert "tried symbolic, record, dynamo" in message and "\n" not in message

    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(2)]
    with pytest.raises(CaptureError):
        compfx.optimize(model, loader, optimizer=optimizer, loss_fn=lambda out, b: F.cross_entropy(out, b[-1]),
                        config=compfx.SearchConfig(progress=False))
    for name, p in model.named_parameters():  # refused, not trained
        assert torch.equal(p, before[name]) and p.grad is None


def test_verify_false_is_the_opt_out():
    torch.manual_seed(0)
    model, x = GradientHook(), torch.randn(4, 8)
    analysis = compfx.analyze(model, x, verify=False)
    assert analysis.verification is None and analysis.capture_method == "record"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(2)]
    result = compfx.optimize(model, loader, optimizer=optimizer, loss_fn=lambda out, b: F.cross_entropy(out, b[-1]),
                             config=compfx.SearchConfig(progress=False, verify_capture=False, repeats=1,
                                                        stage1_budget=1, stage2_budget=1))
    assert result.analysis.verification is None


def test_an_unfaithful_tracer_is_passed_over_for_a_faithful_one():
    torch.manual_seed(0)
    model, x = TensorCheck(), torch.randn(4, 8)
    assert not torch.equal(capture(model, x)(x), model(x))  # unverified, symbolic took the other branch
    analysis = compfx.analyze(model, x)
    assert analysis.capture_method == "record" and analysis.verification.exact
    torch.testing.assert_close(analysis.graph_module(x), model(x), rtol=0, atol=0)
    with pytest.raises(CaptureError, match=r"symbolic graph would train differently.*output differs"):
        compfx.analyze(model, x, method="symbolic")


def test_the_verification_is_charged_to_the_capture_phase():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(2)]
    result = compfx.optimize(model, loader, optimizer=optimizer, loss_fn=lambda out, b: F.cross_entropy(out, b[-1]),
                             config=compfx.SearchConfig(progress=False, repeats=1, stage1_budget=1,
                                                        stage2_budget=1))
    verification = result.analysis.verification
    assert verification.exact and verification.seconds > 0
    assert result.cost_breakdown["capture"] >= verification.seconds


class _Patterns(nn.Module):
    """Dropout (RNG replayed), batch norm (buffers), index_add / scatter_add, tied weights, an input that needs grad."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids, extra):
        h = self.drop(self.bn(self.embed(ids) + extra))
        pooled = torch.zeros(2, 8).index_add(0, ids % 2, h)
        spread = torch.zeros(2, 8).scatter_add(0, (ids % 2).unsqueeze(1).expand(-1, 8), h)
        return self.out(pooled + spread)


@pytest.mark.parametrize("method", ["symbolic", "record", "dynamo"])
def test_dropout_batch_norm_scatter_and_tied_weights_verify_bitwise(method):
    torch.manual_seed(0)
    model = _Patterns().train()
    inputs = (torch.tensor([1, 2, 3, 4, 5, 6]), torch.randn(6, 8, requires_grad=True))
    analysis = compfx.analyze(model, inputs, method=method)
    verification = analysis.verification
    assert verification.exact and verification.mismatch is None and not verification.notes
    assert verification.gradients == 3 and verification.saved_graph == verification.saved_eager


def test_the_verification_leaves_the_users_state_alone():
    torch.manual_seed(0)
    model = _Patterns().train()
    model.bn.eval()
    model.out.weight.grad = torch.full_like(model.out.weight, 3.0)
    model.bn.weight.requires_grad_(False)
    inputs = (torch.tensor([1, 2, 3, 4, 5, 6]), torch.randn(6, 8, requires_grad=True))
    grad = model.out.weight.grad
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
    rng = torch.get_rng_state()
    deterministic = torch.are_deterministic_algorithms_enabled()
    compfx.analyze(model, inputs)
    assert model.out.weight.grad is grad and torch.equal(grad, torch.full_like(grad, 3.0))
    assert model.bn.bias.grad is None and inputs[1].grad is None
    assert not model.bn.weight.requires_grad and model.bn.bias.requires_grad
    assert model.training and not model.bn.training
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())
    assert all(torch.equal(p, parameters[name]) for name, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.are_deterministic_algorithms_enabled() == deterministic


def test_an_eager_model_that_does_not_reproduce_itself_is_reported_not_passed_silently():
    random.seed(0)
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(4, 8)
    with pytest.warns(UserWarning, match="does not reproduce itself"):
        analysis = compfx.analyze(model, x)
    verification = analysis.verification
    assert verification.faithful and not verification.exact and not verification.code_path
    assert "within twice that spread, not bitwise" in verification.notes[0] and "output" in verification.notes[0]


def test_a_model_without_backward_is_verified_forward_only_and_says_so():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="only the forward was compared"):
        analysis = compfx.analyze(NativeMHA(weights=False).eval(), torch.randn(2, 5, 16))  # no backward at all
    verification = analysis.verification
    assert verification.faithful and verification.gradients == 0
    assert "derivative for aten::_native_multi_head_attention is not implemented" in verification.notes[0]


# -- capture errors ----------------------------------------------------------------------------------

def test_the_capture_error_leads_with_the_blocker_of_the_tracer_that_got_furthest():
    inputs = (torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(CaptureError) as info:
        capture(LossBranch(), inputs)
    message = str(info.value)
    assert "\n" not in message
    assert "(tried symbolic, record, dynamo)" in message
    lead, _, others = message.partition("Other tracers:")
    assert "THE-BLOCKER" in lead and "loss.item() > 100.0" in lead  # the line of the data-dependent branch
    assert "SYMBOLIC-FAILS" not in lead and "SYMBOLIC-FAILS" in others  # the first tracer's early failure comes after


# -- per-module regions and the callbacks --------------------------------------------------------------

class HookedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = GradientHook()

    def forward(self, x):
        return self.inner(x)


class TwoBlocks(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.first, self.second = block(), nn.Linear(4, 4)

    def forward(self, x):
        return self.second(self.first(x))


class CheckedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = TensorCheck()

    def forward(self, x):
        return self.inner(x)


def test_per_module_regions_are_verified_and_keep_the_tracer_that_passed():
    from compfx.regions import analyze_regions

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    with pytest.raises(CaptureError, match="'inner.up.weight'"):
        analyze_regions(TwoBlocks(HookedBlock), x, HookedBlock)

    model = TwoBlocks(CheckedBlock)
    expected = model(x)
    analysis = analyze_regions(model, x, CheckedBlock)
    compfx.plan_blocks(model, compfx.Plan.fp32(analysis), analysis=analysis, blocks=CheckedBlock)
    assert model.first.method == "record"  # the block's graph is captured again with the tracer that passed
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_the_callbacks_plan_refuses_a_region_no_graph_records():
    from compfx.integrations.planned_training import plan_model

    torch.manual_seed(0)
    model = TwoBlocks(HookedBlock)
    batches = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError, match="would train differently"):
        plan_model(model, batches, optimizer=optimizer, loss_fn=lambda out, b: F.cross_entropy(out, b[-1]),
                   config=compfx.SearchConfig(progress=False))
    assert type(model.first) is HookedBlock  # put back


class _CompiledPath(nn.Module):
    """Code that differs under torch.compile, as transformers' does: the same sum in another order, or (``scale``)
    another computation."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.proj, self.scale = nn.Linear(64, 64), scale

    def forward(self, x):
        h = self.proj(x)
        if self.on_the_other_path(h):
            return (h.flip(-1).cumsum(-1).flip(-1)[..., 0] * self.scale).sum()
        return h.sum(-1).sum()

    @staticmethod
    def on_the_other_path(h) -> bool:
        return torch.compiler.is_compiling()


def test_a_dynamo_graph_of_the_compiled_code_path_is_kept_within_the_bound_and_says_so():
    torch.manual_seed(0)
    model, x = _CompiledPath(), torch.randn(32, 64)
    with pytest.warns(UserWarning, match="torch.compile code path"):
        analysis = compfx.analyze(model, x, method="dynamo")
    verification = analysis.graph_module.meta[VERIFICATION_META]
    assert verification.faithful and not verification.exact and verification.code_path
    assert any("torch.compile code path" in note for note in verification.notes)


class _FakeTensorPath(_CompiledPath):
    """Code that differs on FakeTensors, as transformers' does (its is_tracing reads a FakeTensor as tracing)."""

    @staticmethod
    def on_the_other_path(h) -> bool:
        return isinstance(h, FakeTensor)


def test_a_recorded_graph_of_the_fake_tensor_code_path_is_kept_within_the_bound_and_says_so():
    torch.manual_seed(0)
    model, x = _FakeTensorPath(), torch.randn(32, 64)
    with pytest.warns(UserWarning, match="code path the model takes on FakeTensors"):
        analysis = compfx.analyze(model, x, method="record")  # kept, not refused (auto would hand it to dynamo)
    verification = analysis.graph_module.meta[VERIFICATION_META]
    assert verification.faithful and not verification.exact and verification.code_path
    amp = compfx.apply(model, compfx.Plan.amp(analysis), analysis=analysis).graph_module
    assert any("recorded on FakeTensors" in note for note in amp.meta["compfx_fidelity_notes"])
    fp32 = compfx.apply(model, compfx.Plan.fp32(analysis), analysis=analysis)
    assert fp32.graph_module.meta["compfx_fidelity_notes"] == []
    with pytest.raises(CaptureError, match="beyond"):
        compfx.analyze(_FakeTensorPath(scale=1.01), x, method="record")


def test_a_dynamo_graph_that_computes_something_else_is_refused():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="beyond"):
        compfx.analyze(_CompiledPath(scale=1.01), torch.randn(32, 64), method="dynamo")


# -- state a graph would keep, or freeze, between calls ---------------------------------------------

class ScatterIntoFreshZeros(nn.Module):
    """A GNN's aggregation: messages summed into a tensor forward makes afresh on each call."""

    def __init__(self):
        super().__init__()
        self.message = nn.Linear(8, 8)

    def forward(self, x, index):
        return torch.zeros(3, 8).index_add_(0, index, self.message(x))


class ReassignedRunningMean(nn.Module):
    """Keeps a running mean by reassigning its buffer, which a graph cannot replay."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("running", torch.zeros(4))

    def forward(self, x):
        y = self.fc(x)
        self.running = 0.9 * self.running + 0.1 * y.detach().mean(0)
        return y * self.running.sigmoid()


class NumpyNoise(nn.Module):
    """Adds feature noise drawn with numpy: a draw outside torch's RNG, anew on each call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        import numpy as np

        return self.fc(x) + 0.1 * torch.from_numpy(np.random.rand(6)).float()


def test_a_symbolic_graph_that_writes_a_constant_on_each_call_is_refused_and_another_tracer_kept():
    model, x, index = ScatterIntoFreshZeros(), torch.randn(5, 8), torch.tensor([0, 2, 1, 0, 2])
    symbolic = capture(model, (x, index), method="symbolic", verify=False)  # torch.zeros(3, 8) is a constant there
    verification = verify_capture(model, symbolic, (x, index), {}, method="symbolic")
    assert not verification.faithful and "second call" in verification.mismatch
    assert not [name for name in vars(model) if "constant" in name]  # fx's tracer left none on the model
    a = compfx.analyze(model, (x, index))
    gm = compfx.apply(model, compfx.Plan.fp32(a), analysis=a)
    expected = model(x, index)
    for _ in range(2):  # each call starts from zeros, as eager's does, and backward runs every time
        out = gm(x, index)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        out.sum().backward()


def test_a_reassigned_buffer_is_refused_and_left_as_it_was():
    model, x = ReassignedRunningMean(), torch.randn(3, 4)
    buffer = model.running
    with pytest.raises(CaptureError, match="assigns new tensors to running") as raised:
        compfx.analyze(model, x)
    assert "dynamo" in str(raised.value)  # dynamo too: its graph would hold the first update's value for ever
    assert str(raised.value).count("assigns new tensors") == 1 and "failed the same way" in str(raised.value)
    assert model.running is buffer and torch.equal(buffer, torch.zeros(4))


def test_a_draw_outside_torchs_rng_is_refused_not_frozen_into_the_graph():
    model, x = NumpyNoise(), torch.randn(2, 6)
    symbolic = capture(model, x, method="symbolic", verify=False)
    verification = verify_capture(model, symbolic, (x,), {}, method="symbolic")
    assert not verification.faithful and "outside torch's random generator" in verification.mismatch
    with pytest.raises(CaptureError, match="outside torch's random generator"):
        compfx.analyze(model, x)


class _ReorderedGradient(torch.autograd.Function):
    """Identity forward; its backward rounds differently on each call, as CUDA's atomic adds (attention's and an
    embedding's gradients) sum in another order on each run."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _ReorderedGradient.calls += 1
        return grad * (1 + _ReorderedGradient.calls * 1e-6)


class VaryingBackward(nn.Module):
    """The same forward on every call, a backward that is not: what eager training on a GPU looks like."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return _ReorderedGradient.apply(self.fc(x))


def test_a_backward_that_varies_run_to_run_is_no_frozen_draw():
    model, x = VaryingBackward(), torch.randn(2, 6)
    graph = capture(model, x, method="symbolic", verify=False)
    verification = verify_capture(model, graph, (x,), {}, method="symbolic")
    assert verification.faithful, verification.mismatch
    assert not verification.exact and any("does not reproduce itself" in note for note in verification.notes)


def test_numpy_in_forward_a_scalar_is_a_number_an_array_a_clear_error():
    import numpy as np

    class Scaled(nn.Module):
        def __init__(self, table=None):
            super().__init__()
            self.fc, self.table = nn.Linear(4, 4), table

        def forward(self, x):
            y = self.fc(x) * np.float64(0.5)
            return y if self.table is None else y * y.new_tensor(self.table)

    x = torch.randn(2, 4)
    assert compfx.analyze(Scaled(), x, method="record").verification.exact
    with pytest.raises(CaptureError, match=r"passes a numpy ndarray to torch at .*y.new_tensor\(self.table\)") as raised:
        compfx.analyze(Scaled(np.arange(4, dtype=np.float32)), x, method="record")
    assert "NameError" not in str(raised.value)
