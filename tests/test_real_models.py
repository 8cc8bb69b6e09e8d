"""Hugging Face models as users build them: default configs (``use_cache`` on), tiny sizes, real loaders.

Each model is built from a config (hidden 32, 2 layers; no download). The
search runs on a loader whose last batch is ragged, then the returned module
trains at two other batch sizes; every loss is finite, and the user's config
object is unchanged. The recorded graph computes what eager computes, KV
cache updates included, and returns ``None`` for the cache, so ``Plan.fp32``
reproduces eager training bit for bit; ``torch.compile(backend=compfx.backend(...))`` runs.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import compfx
from compfx.search.log import SampleStatus
from tests.helpers import fp32_op_count

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

HIDDEN, LAYERS, VOCAB, SEQ = 32, 2, 64, 8
DECODER = dict(intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=64, vocab_size=VOCAB, hidden_size=HIDDEN)


def _configs():
    t = transformers
    seq2seq = dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)
    return {
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=2,
                                                 n_positions=64, bos_token_id=0, eos_token_id=0)),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**DECODER)),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**DECODER)),
        "t5": (t.T5ForConditionalGeneration, t.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=64,
                                                        num_layers=LAYERS, num_heads=2, decoder_start_token_id=0)),
        "bart": (t.BartForConditionalGeneration, t.BartConfig(max_position_embeddings=64, **seq2seq)),
        "vit": (t.ViTForImageClassification, t.ViTConfig(image_size=16, patch_size=4, hidden_size=HIDDEN,
                                                         num_hidden_layers=LAYERS, num_attention_heads=2,
                                                         intermediate_size=64, num_labels=3,
                                                         problem_type="single_label_classification")),
        "whisper": (t.WhisperForConditionalGeneration, t.WhisperConfig(
            num_mel_bins=8, max_source_positions=16, max_target_positions=32, decoder_start_token_id=1,
            pad_token_id=0, **seq2seq)),
    }


MODEL_NAMES = ["gpt2", "llama", "qwen2", "t5", "bart", "vit", "whisper"]


def build(name: str):
    """The model (training mode, seeded) and its config object."""
    cls, config = _configs()[name]
    torch.manual_seed(0)
    return cls(config).train(), config


def batch(name: str, size: int, generator: torch.Generator, seq: int = SEQ) -> dict:
    """One batch of keyword arguments, labels included (the model computes its own loss)."""
    def ids():
        return torch.randint(1, VOCAB, (size, seq), generator=generator)

    if name in ("gpt2", "llama", "qwen2"):
        tokens = ids()
        return {"input_ids": tokens, "labels": tokens}
    if name in ("t5", "bart"):
        return {"input_ids": ids(), "labels": ids()}
    if name == "vit":
        return {"pixel_values": torch.randn(size, 3, 16, 16, generator=generator),
                "labels": torch.randint(0, 3, (size,), generator=generator)}
    return {"input_features": torch.randn(size, 8, 32, generator=generator), "labels": ids()}


#: a short search: the point here is that it runs on real models and loaders, not what it picks
FAST = compfx.SearchConfig(progress=False, warmup=0, repeats=1, stage1_budget=2, stage2_budget=2,
                           stage2_check_batches=1, cache_plan=False)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_search_with_a_ragged_last_batch_then_training_at_other_batch_sizes(name):
    model, config = build(name)
    config_before = copy.deepcopy(config.to_dict())
    assert getattr(config, "use_cache", True), "the default config keeps the KV cache on"
    g = torch.Generator().manual_seed(0)
    loader = [batch(name, 4, g), batch(name, 4, g), batch(name, 3, g)]  # drop_last=False: the last one is short
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = compfx.optimize(model, loader, optimizer=optimizer, config=FAST)

    assert result.analysis.capture_method == "record"
    assert math.isfinite(result.loss0)
    measured = [r for r in result.log.samples() if r.status in (SampleStatus.ACCEPTED, SampleStatus.REJECTED)]
    assert measured and all(math.isfinite(r.loss) for r in measured if r.loss is not None)
    assert not [r for r in result.log.samples() if r.status is SampleStatus.ERROR and r.plan == "1" * len(r.plan)]
    assert "input signatures: 2" in result.report()

    losses = []
    for size in (2, 5):
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            loss = result.module(**batch(name, size, g)).loss
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    assert all(math.isfinite(loss) for loss in losses), losses
    # the ragged batch's capture is shared with the search (the chosen plan's module may not have met it itself)
    assert len(result.module.captures) == 4 and len(result.module.graphs) >= 3
    assert config.to_dict() == config_before, "compfx must not change the user's config"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fp32_plan_trains_bitwise_like_eager_with_the_cache_left_on(name):
    model, _ = build(name)
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    inputs = batch(name, 4, g)
    analysis = compfx.analyze(model, inputs)
    planned = compfx.apply(model, compfx.Plan.fp32(analysis), analysis=analysis)
    torch.manual_seed(0)  # dropout draws the same masks in both
    got = planned(**inputs)
    torch.manual_seed(0)
    want = eager(**inputs)  # use_cache left at the config's default
    assert torch.equal(got.loss, want.loss) and torch.equal(got.logits, want.logits)
    assert getattr(got, "past_key_values", None) is None
    got.loss.backward()
    want.loss.backward()
    for (key, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), key


@pytest.mark.parametrize("use_cache", [None, True, False])
def test_the_kv_cache_is_computed_as_in_eager_and_returned_as_none(use_cache):
    model, config = build("gpt2")
    inputs = batch("gpt2", 2, torch.Generator().manual_seed(0))
    if use_cache is not None:
        inputs["use_cache"] = use_cache
    gm = compfx.capture(model, inputs)
    torch.manual_seed(0)
    got = gm(**inputs)
    torch.manual_seed(0)
    want = model(**inputs)
    assert got.past_key_values is None and (want.past_key_values is None) == (use_cache is False)
    assert torch.equal(got.logits, want.logits)
    assert config.use_cache is True


def test_torch_compile_with_the_compfx_backend_runs_a_default_config_llama():
    model, _ = build("llama")
    inputs = batch("llama", 4, torch.Generator().manual_seed(0))
    plan = compfx.Plan.amp(compfx.analyze(model, inputs))
    torch._dynamo.reset()
    backend = compfx.backend(plan, inner="eager", model=model)
    out = torch.compile(model, backend=backend)(**inputs)
    out.loss.backward()
    assert math.isfinite(float(out.loss.detach()))
    assert backend.records and all(not r.unplanned for r in backend.records)


# -- Stage 2 on mixture-of-experts decoders and Gemma 3 -------------------------------------------------------

def _long_segment_models():
    t = transformers
    moe = dict(num_local_experts=4, num_experts_per_tok=2)
    return {
        "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(**moe, **DECODER)),
        "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(head_dim=16, **DECODER)),
    }


@pytest.mark.parametrize("name", ["mixtral", "gemma3"])
def test_stage2_prices_no_more_plans_than_its_budget_on_moe_and_gemma3(name, monkeypatch):
    """Between the embedding and the first projection lie a dozen "other" ops (2**n plans): Stage 2 builds and
    prices only what ``stage2_budget`` could time, and the report names the segment it did not enumerate."""
    from compfx.costmodel import SearchPredictor
    from compfx.plan import Assignment
    from compfx.search import SearchSpace, stage2_segments
    from compfx.search.log import SEGMENT_NOT_ENUMERATED

    priced = set()
    step_lower_bound = SearchPredictor.step_lower_bound
    monkeypatch.setattr(SearchPredictor, "step_lower_bound",
                        lambda self, plan: priced.add(str(plan)) or step_lower_bound(self, plan))
    cls, config = _long_segment_models()[name]
    torch.manual_seed(0)
    model = cls(config).train()
    g = torch.Generator().manual_seed(0)
    loader = [batch("llama", 2, g) for _ in range(2)]
    budget = 4
    result = compfx.optimize(model, loader, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                             config=dataclasses.replace(FAST, stage2_budget=budget, rounds=0, cost_fn=fp32_op_count))

    space = SearchSpace.from_analysis(result.analysis)
    segments = stage2_segments(space, Assignment.parse(result.stage1_plan.bitstring(result.analysis)))
    assert max(len(s.inner) for s in segments) >= 10
    assert len(priced) <= 1 + (budget - 1) * len(segments), len(priced)  # the winner, then no more than 3 a segment
    partial = [r.extra[SEGMENT_NOT_ENUMERATED] for r in result.log.notes() if SEGMENT_NOT_ENUMERATED in r.extra]
    named = {tuple(s["segment"]) for s in partial}  # a long segment's 2**n plans never fit the budget
    assert named >= {(s.start, s.end) for s in segments if 2 ** len(s.inner) > budget - 1} and named
    assert len(result.log.samples("stage2")) <= budget
    assert "not enumerated fully" in result.report() and f"of 2^{partial[0]['ops']} plans" in result.report()
