"""Branches on a random draw (layer drop): a setting that fixes the outcome does not block capture, and the draw
stays in the graph; a setting that lets it vary is refused, naming the setting.

Some transformers releases (5.17 among them) run ``if torch.rand([]) < self.layerdrop`` in training even when
``layerdrop`` is 0; later ones guard the draw with ``layerdrop > 0``. ``_LayerDrop`` below is the unguarded form,
so these tests hold whichever transformers is installed; ``tests/test_real_models.py`` trains BART and Whisper
in train mode on the installed one.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import compfx
from compfx.graph_capture.draws import fixed_outcome
from compfx.errors import CaptureError

COMPARISONS = [operator.lt, operator.le, operator.gt, operator.ge]
#: The tracers that follow the model's Python: both must write a draw down, not run it once at capture.
TRACERS = ["symbolic", "record"]


@pytest.mark.parametrize("comparison, bound, outcome", [
    (operator.lt, 0.0, False), (operator.lt, -1, False), (operator.lt, 1.0, True), (operator.lt, 0.1, None),
    (operator.le, 0.0, None), (operator.le, -0.5, False), (operator.le, 1.0, True),
    (operator.gt, 0.0, None), (operator.gt, -0.1, True), (operator.gt, 1.0, False),
    (operator.ge, 0.0, True), (operator.ge, 1.0, False), (operator.ge, 0.999, None),
    (operator.lt, float("nan"), False),
    (operator.le, -1e-300, None),  # -0.0 in float32: a draw of exactly 0 is <= it
    (operator.lt, 1e-300, False),  # 0.0 in float32
])
def test_the_outcome_of_comparing_a_uniform_draw(comparison, bound, outcome):
    assert fixed_outcome(comparison, bound) is outcome


@settings(max_examples=200, deadline=None)
@given(comparison=st.sampled_from(COMPARISONS), bound=st.floats(-2, 2) | st.sampled_from([0.0, 1.0, -0.0]),
       seed=st.integers(0, 2 ** 31 - 1), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_a_fixed_outcome_is_what_every_draw_gives(comparison, bound, seed, dtype):
    outcome = fixed_outcome(comparison, bound, dtype)
    draws = torch.rand(4096, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    largest = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)) if dtype != \
        torch.bfloat16 else torch.tensor(1 - 2 ** -8, dtype=dtype)
    draws = torch.cat([draws, torch.tensor([0.0], dtype=dtype), largest.reshape(1)])  # the ends torch.rand can return
    results = comparison(draws, bound)
    if outcome is not None:
        assert bool((results == outcome).all())


class _LayerDrop(nn.Module):
    """Layer drop as transformers 5.17 writes it: the draw runs in training whatever ``layerdrop`` is."""

    def __init__(self, layerdrop: float):
        super().__init__()
        self.layerdrop = layerdrop
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.dropout = nn.Dropout(0.3)

    def forward(self, x):
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = self.dropout(torch.relu(layer(x)))
        return x


def _draws(gm) -> int:
    return sum(node.target is torch.rand for node in gm.graph.nodes)


@pytest.mark.parametrize("method", TRACERS)
def test_layer_drop_at_zero_captures_in_train_mode_and_keeps_the_draws(method):
    gm = compfx.capture(_LayerDrop(0.0).train(), torch.randn(4, 16), method=method)  # as Hugging Face models are
    assert _draws(gm) == 3  # each draw advances the generator, as in eager
    assert sum(node.target is torch._C._nn.linear for node in gm.graph.nodes) == 3  # no layer dropped


@pytest.mark.parametrize("method", TRACERS)
def test_layer_drop_at_zero_trains_bitwise_like_eager_dropout_masks_included(method):
    model = _LayerDrop(0.0).train()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 16)
    analysis = compfx.analyze(model, x, method=method)
    planned = compfx.apply(model, compfx.Plan.fp32(analysis), analysis=analysis)
    torch.manual_seed(0)
    got = planned(x)
    torch.manual_seed(0)
    want = eager(x)  # the draws come before each dropout: without them in the graph, the masks would differ
    assert torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("method", TRACERS)
def test_layer_drop_at_one_drops_every_layer(method):
    gm = compfx.capture(_LayerDrop(1.0).train(), torch.randn(4, 16), method=method)
    assert _draws(gm) == 3 and not any(node.target is torch._C._nn.linear for node in gm.graph.nodes)


@pytest.mark.parametrize("method", [*TRACERS, "auto"])
def test_layer_drop_that_varies_is_refused_naming_the_setting(method):
    """Taken once at capture, the branch would drop the same layers on every step (or none): never silently."""
    with pytest.raises(CaptureError, match=r"random draw at .*test_random_branches.py.*layerdrop, now 0\.1"):
        compfx.capture(_LayerDrop(0.1).train(), torch.randn(4, 16), method=method)


@pytest.mark.parametrize("method", TRACERS)
def test_eval_mode_draws_nothing(method):
    gm = compfx.capture(_LayerDrop(0.1).eval(), torch.randn(4, 16), method=method)
    assert _draws(gm) == 0


class _Noise(nn.Module):
    """Noise drawn in forward from a factory, with no input among its arguments."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x) + 0.1 * torch.randn(16)


@pytest.mark.parametrize("method", TRACERS)
def test_noise_from_a_factory_is_drawn_on_every_call_as_in_eager(method):
    """Run once at capture, the draw would be a constant of the graph: the same noise on every step."""
    model, x = _Noise(), torch.randn(4, 16)
    planned = compfx.apply(model, compfx.Plan.fp32(compfx.analyze(model, x, method=method)),
                           analysis=compfx.analyze(model, x, method=method))
    assert any(node.target is torch.randn for node in planned.graph_module.graph.nodes)
    torch.manual_seed(1)
    first = planned(x)
    second = planned(x)
    torch.manual_seed(1)
    assert not torch.equal(first, second) and torch.equal(first, model(x))


@pytest.mark.parametrize("method", TRACERS)
def test_a_branch_on_a_draw_compared_with_a_tensor_is_refused_as_any_value_branch(method):
    class Noisy(nn.Module):
        def forward(self, x):
            if torch.rand([]) < x.mean():  # the outcome depends on data, not on a setting
                return x
            return -x

    with pytest.raises(CaptureError, match="branches on tensor values"):
        compfx.capture(Noisy(), torch.randn(4, 16), method=method)


def test_hugging_face_layer_drop_that_varies_is_refused_naming_the_setting():
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, encoder_layerdrop=0.1)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).train()
    ids = torch.randint(1, 64, (2, 8))
    with pytest.raises(CaptureError, match=r"modeling_bart\.py.*layerdrop, now 0\.1.*encoder_layerdrop=0"):
        compfx.analyze(model, {"input_ids": ids, "labels": ids})
