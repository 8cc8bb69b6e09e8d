"""CompfxCallback in the Hugging Face Trainer: tiny BERT and GPT-2 from configs, 12 steps on the CPU, a plan in
output_dir, and a resumed run that loads the plan from its checkpoint instead of searching again."""

import collections
import math
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import compfx  # noqa: E402
import safetensors.torch  # noqa: E402  (transformers' own dependency)
import compfx.integrations.planned_training as planned_training  # noqa: E402
from compfx.errors import BadInputError  # noqa: E402
from compfx.integrations.transformers import LOG_FILE, PLAN_FILE, CompfxCallback  # noqa: E402
from tests.quick import quick_config  # noqa: E402

VOCAB, SEQ = 64, 16


def _bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=SEQ, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB,
                                                                n_positions=SEQ))


def _dataset(kind: str, n: int = 48) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids if kind == "gpt2" else ids[0] % 3})
    return rows


MODELS = {"bert": _bert, "gpt2": _gpt2}
#: the submodules each model's forward runs: its base model and head, planned in place while training
REGIONS = {"bert": ["bert", "dropout", "classifier"], "gpt2": ["transformer", "lm_head"]}
FAST_SEARCH = quick_config(stage1_budget=4, stage2_budget=2)


class Spy(transformers.TrainerCallback):
    """Placed around CompfxCallback: the RNG before and after it, and every call of each planned region."""

    def __init__(self, compfx_callback=None):
        self.compfx_callback, self.rng, self.planned_calls = compfx_callback, None, collections.Counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self.rng = torch.get_rng_state()
        if self.compfx_callback is not None:
            for path, block in self.compfx_callback.run.blocks.items():
                block.register_forward_pre_hook(lambda module, inputs, path=path: self.planned_calls.update([path]))


def _trainer(kind, output_dir, callback, spies=(), **overrides):
    torch.manual_seed(0)
    settings = dict(output_dir=str(output_dir), max_steps=12, per_device_train_batch_size=4, save_steps=6,
                    logging_steps=1, report_to=[], use_cpu=True, learning_rate=1e-3, disable_tqdm=True, seed=0)
    args = transformers.TrainingArguments(**{**settings, **overrides})
    before, after = spies or (Spy(), Spy(callback))
    return transformers.Trainer(model=MODELS[kind](), args=args, train_dataset=_dataset(kind),
                                callbacks=[before, callback, after]), before, after


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_trainer_trains_with_the_plan_and_resumes_without_searching(kind, tmp_path, monkeypatch, one_thread):
    callback = CompfxCallback(search_batches=3, config=FAST_SEARCH)
    trainer, before, after = _trainer(kind, tmp_path, callback)
    children, keys = dict(trainer.model.named_children()), list(trainer.model.state_dict())
    started = time.perf_counter()
    metrics = trainer.train().metrics
    whole = time.perf_counter() - started

    losses = _losses(trainer)
    assert len(losses) == 12 and all(math.isfinite(loss) for loss in losses)
    assert callback.searched is True
    # the search is reported apart from the training: the trainer's runtime and rates are the training's alone
    search = metrics["compfx_search_runtime"]
    assert search >= callback.run.result.search_seconds > 0 and metrics["train_runtime"] + search <= whole
    assert metrics["train_steps_per_second"] == pytest.approx(12 / metrics["train_runtime"], rel=0.01)
    assert trainer.state.log_history[-1]["compfx_search_runtime"] == search
    # the summary line quotes the report's comparison, in its words
    assert callback.run.result.step_comparison.speedup("fp32") in callback.run.summary()
    assert callback.run.regions == REGIONS[kind]
    assert after.planned_calls == {path: 12 for path in REGIONS[kind]}  # every training step ran the planned regions
    assert torch.equal(before.rng, after.rng)  # taking the search batches and searching left the RNG as it was
    assert compfx.Plan.load(tmp_path / PLAN_FILE) == callback.run.plan
    assert compfx.Plan.load(tmp_path / "checkpoint-6" / PLAN_FILE) == callback.run.plan
    assert (tmp_path / LOG_FILE).stat().st_size > 0
    assert any(entry.get("compfx_searched") == 1.0 for entry in trainer.state.log_history)
    # the checkpoint (save_pretrained while the regions were planned) holds the model's own keys
    assert set(safetensors.torch.load_file(tmp_path / "checkpoint-6" / "model.safetensors")) <= set(keys)
    # after training the model holds its own submodules again, the same objects, and patches nothing
    assert dict(trainer.model.named_children()) == children and callback.run.blocks == {}
    assert all(a is b for a, b in zip(trainer.model.children(), children.values()))
    assert list(trainer.model.state_dict()) == keys and "forward" not in vars(trainer.model)

    searches = []
    real_optimize = planned_training.optimize
    monkeypatch.setattr(planned_training, "optimize", lambda *a, **k: searches.append(1) or real_optimize(*a, **k))
    resumed_callback = CompfxCallback(search_batches=3, config=FAST_SEARCH)  # a new process: new model, new trainer
    resumed, _, spy = _trainer(kind, tmp_path, resumed_callback)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))

    assert searches == [] and resumed_callback.searched is False
    assert resumed_callback.run.source == str(tmp_path / "checkpoint-6" / PLAN_FILE)
    assert resumed_callback.run.plan == callback.run.plan
    assert spy.planned_calls == {path: 6 for path in REGIONS[kind]}
    # steps 7-12 of the resumed run are the uninterrupted run's: same plan, same state, the search left no trace
    torch.testing.assert_close(_losses(resumed)[6:], losses[6:])


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_autocast_flags_are_refused_naming_the_flag(flag, tmp_path):
    with pytest.raises(BadInputError, match=f"turn off {flag}"):
        _trainer("gpt2", tmp_path, CompfxCallback(config=FAST_SEARCH), **{flag: True})


def test_a_given_plan_of_another_model_is_refused(tmp_path):
    other = torch.nn.Sequential(torch.nn.Linear(4, 2))
    wrong = compfx.Plan.fp32(compfx.analyze(other, torch.randn(2, 4)))
    trainer, _, _ = _trainer("gpt2", tmp_path, CompfxCallback(plan=wrong, config=FAST_SEARCH))
    children = list(trainer.model.children())
    with pytest.raises(compfx.PlanMismatchError):
        trainer.train()
    assert all(a is b for a, b in zip(trainer.model.children(), children, strict=True))


def test_search_batches_must_be_a_positive_int():
    with pytest.raises(BadInputError, match="search_batches=0"):
        CompfxCallback(search_batches=0)


def test_after_an_exception_in_training_restore_puts_the_models_own_submodules_back(tmp_path):
    class Failing(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("a bug in a callback")

    callback = CompfxCallback(search_batches=2, config=FAST_SEARCH)
    trainer, _, _ = _trainer("gpt2", tmp_path, callback, max_steps=4)
    trainer.add_callback(Failing())
    children = list(trainer.model.children())
    with pytest.raises(RuntimeError, match="a bug in a callback"):
        trainer.train()
    # the Trainer has no event for an exception: the regions stay planned until restore() (or the next train())
    assert set(callback.run.blocks) == {"transformer", "lm_head"}
    callback.restore()
    assert all(a is b for a, b in zip(trainer.model.children(), children, strict=True))


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_with_label_smoothing_the_search_judges_the_smoothed_loss_the_trainer_trains(kind, tmp_path, monkeypatch):
    """The trainer trains LabelSmoother's loss of the logits (labels shifted for a causal LM), not output.loss."""
    seen = []
    real_plan_model = compfx.integrations.transformers.plan_model
    monkeypatch.setattr(compfx.integrations.transformers, "plan_model",
                        lambda model, batches, **kw: seen.append((model, batches, kw["loss_fn"]))
                        or real_plan_model(model, batches, **kw))
    trainer, _, _ = _trainer(kind, tmp_path, CompfxCallback(search_batches=2, config=FAST_SEARCH), max_steps=2,
                             label_smoothing_factor=0.1)
    trainer.train()
    (model, batches, loss_fn), = seen
    batch = batches[0]
    with torch.no_grad():
        output = model(**batch)
        logits, labels = output.logits, batch["labels"]
        if kind == "gpt2":  # a causal LM: the trainer shifts the labels
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        log_probs = -torch.log_softmax(logits, -1)
        nll = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1).mean()
        expected = 0.9 * nll + 0.1 * log_probs.mean()  # what smoothing 0.1 trains
        torch.testing.assert_close(loss_fn(output, batch), expected)
        assert not torch.allclose(loss_fn(output, batch), output.loss)
