"""CompfxAccelerate: a tiny GPT-2 trains with compfx's plan through accelerate on the CPU, in one process and under
``accelerate launch`` with two processes (gloo), resumes from ``save_state`` without a search, hands a plan's FP8
linears to accelerate's torchao backend, and refuses two precision policies at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import compfx  # noqa: E402
import compfx.integrations.planned_training as planned_training  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from compfx.errors import BadInputError  # noqa: E402
from compfx.integrations.accelerate import PLAN_FILE, CompfxAccelerate  # noqa: E402
from compfx.per_module import PlannedBlock  # noqa: E402
from compfx.regions import analyze_regions  # noqa: E402
from compfx.plan_rules import Rule  # noqa: E402
from tests.helpers import free_port  # noqa: E402
from tests.quick import quick_config  # noqa: E402
from tiny_gpt import lm_loss, tiny_gpt, token_batches  # noqa: E402

VOCAB, SEQ = 64, 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_SEARCH = quick_config(stage1_budget=4, stage2_budget=2)


@pytest.fixture(autouse=True)
def fresh_accelerator_state(one_thread):
    """accelerate keeps one state per process; each test builds its own Accelerator."""
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def gpt2(seed: int = 0):
    """Without dropout: a resumed loop's new data iterator draws from the RNG (DataLoader's base seed), so dropout
    masks after a resume would differ from an uninterrupted run's whatever compfx does."""
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def loader(n: int = 48):
    generator = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (n, SEQ), generator=generator)]
    return torch.utils.data.DataLoader(rows, batch_size=4)


def train(accelerator, model, optimizer, batches, steps: int, save_at: int | None = None, folder=None) -> list[float]:
    losses = []
    for step, batch in enumerate(batches):
        if step == steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if save_at is not None and step + 1 == save_at:
            accelerator.save_state(folder)
    return losses


def test_a_tiny_gpt2_trains_with_the_plan_and_resumes_from_save_state_without_searching(tmp_path, monkeypatch):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = gpt2()
    planner = CompfxAccelerate(search_batches=3, config=FAST_SEARCH, log=tmp_path / "search.jsonl")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, optimizer, batches = planner.prepare(accelerator, model, optimizer, loader())
    assert planner.searched is True and (tmp_path / "search.jsonl").exists()
    assert {type(model.transformer), type(model.lm_head)} == {PlannedBlock}  # the plan runs in the model itself
    losses = train(accelerator, prepared, optimizer, batches, 12, save_at=6, folder=tmp_path / "ckpt")
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert compfx.Plan.load(tmp_path / "ckpt" / PLAN_FILE) == planner.plan

    AcceleratorState._reset_state(True)
    monkeypatch.setattr(planned_training, "optimize", lambda *a, **k: pytest.fail("a resumed run searched"))
    accelerator = Accelerator(cpu=True)
    resumed = gpt2(seed=1)  # other initial weights: load_state brings the checkpoint's back
    again = CompfxAccelerate(search_batches=3, config=FAST_SEARCH)
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    prepared, optimizer, batches = again.prepare(accelerator, resumed, optimizer, loader(),
                                                 resume_from=tmp_path / "ckpt")
    accelerator.load_state(tmp_path / "ckpt")
    assert again.searched is False and again.plan == planner.plan
    later = train(accelerator, prepared, optimizer, accelerator.skip_first_batches(batches, 6), 6)
    torch.testing.assert_close(later, losses[6:])  # the resumed steps are the uninterrupted run's


def test_fp8_linears_go_to_accelerates_torchao_backend(tmp_path):
    pytest.importorskip("torchao.float8")
    from accelerate import Accelerator
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_gpt(2)
    analysis = compfx.analyze(model, token_batches(1)[0][0], fp8=True)
    plan = compfx.Plan.from_rules(analysis, [Rule("low"), Rule("fp8", module="blocks.*.mlp.*", kind="linear")])
    planner = CompfxAccelerate(plan=plan)
    accelerator = Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[planner.ao_recipe_kwargs()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = planner.prepare(accelerator, model, optimizer, token_batches(2))[:2]
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {key.module for key, p in plan.items() if p == "fp8"} and len(converted) == 4
    assert not any(isinstance(m, PlannedBlock) for m in model.modules())  # compfx rewrites nothing here
    assert any("stay compfx's" in note for note in planner.filter.not_expressed)
    for batch in token_batches(2):
        loss = lm_loss(prepared(batch[0]), batch)
        accelerator.backward(loss)
        optimizer.step()
        assert torch.isfinite(loss)
    accelerator.save_state(tmp_path / "ckpt")
    assert compfx.Plan.load(tmp_path / "ckpt" / PLAN_FILE) == plan


@pytest.mark.parametrize("settings, words", [
    (dict(mixed_precision="bf16"), "runs the whole model under autocast"),
    (dict(mixed_precision="fp8"), "give it the plan's"),  # accelerate's own FP8 filter
    (dict(dynamo_backend="eager"), "dynamo plugin"),
])
def test_two_precision_policies_at_once_are_refused(settings, words):
    pytest.importorskip("torchao.float8")
    from accelerate import Accelerator

    model = gpt2()
    planner = CompfxAccelerate(config=FAST_SEARCH)
    accelerator = Accelerator(cpu=True, **settings)
    with pytest.raises(BadInputError, match=words):
        planner.prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), loader())
    assert not any(isinstance(m, PlannedBlock) for m in model.modules())  # nothing of the model changed


def test_a_prepared_model_or_a_resume_without_a_plan_is_refused(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(BadInputError, match=f"holds no {PLAN_FILE}"):
        CompfxAccelerate().prepare(accelerator, model, optimizer, loader(), resume_from=tmp_path)
    any_plan = compfx.Plan.fp32(compfx.analyze(torch.nn.Linear(2, 2), torch.randn(1, 2)))
    with pytest.raises(BadInputError, match="give one"):
        CompfxAccelerate(plan=any_plan).prepare(accelerator, model, optimizer, loader(), resume_from=tmp_path)
    prepared = accelerator.prepare(model)
    with pytest.raises(BadInputError, match="before accelerate wraps it"):
        CompfxAccelerate().prepare(accelerator, prepared, optimizer, loader())


SCRIPT = """
import json, os, sys
import torch, transformers
from accelerate import Accelerator
from compfx.integrations.accelerate import CompfxAccelerate

torch.set_num_threads(1)
out, plan = sys.argv[1], sys.argv[2]
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=4)
planner = CompfxAccelerate(plan=plan)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
prepared, optimizer, batches = planner.prepare(accelerator, model, optimizer, loader)
losses = []
for batch in batches:
    loss = prepared(**batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
accelerator.save_state(os.path.join(out, "ckpt"))
result = {"world": accelerator.num_processes, "backend": torch.distributed.get_backend(), "losses": losses,
          "checksum": sum(float(p.double().sum()) for p in model.parameters()), "ddp": type(prepared).__name__,
          "planned": sorted(planner.run.blocks)}
with open(os.path.join(out, f"{accelerator.process_index}.json"), "w") as f:
    json.dump(result, f)
"""


def test_two_processes_under_accelerate_launch_train_with_the_plan(tmp_path):
    model = gpt2()
    batch = next(iter(loader()))
    plan = compfx.Plan.amp(analyze_regions(model, batch, (type(model.transformer), type(model.lm_head))))
    plan.save(tmp_path / "plan.json")
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    # accelerate launch's torchrun launcher (--multi_gpu) starts the processes; Accelerator(cpu=True) in the script
    # makes them a MULTI_CPU run over gloo (--cpu alone would start one process)
    launch = subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                               "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                               "--main_process_port", str(free_port()), str(tmp_path / "train.py"), str(tmp_path),
                               str(tmp_path / "plan.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
                              start_new_session=True)  # its own process group: the ranks go with it on a timeout
    try:
        _, stderr = launch.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.communicate()
        pytest.fail("accelerate launch with 2 processes ran for more than 600 s")
    assert launch.returncode == 0, stderr[-3000:]
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 and r["backend"] == "gloo" and r["ddp"] == "DistributedDataParallel" for r in ranks)
    assert all(r["planned"] == ["lm_head", "transformer"] and len(r["losses"]) == 2 for r in ranks)
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own shard of the data
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)  # and DDP kept them in step
    assert compfx.Plan.load(tmp_path / "ckpt" / PLAN_FILE) == plan
