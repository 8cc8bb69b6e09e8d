"""What the CoMP search costs, and whether its plan holds up, on this machine (a benchmark, not a test).

Runs ``compfx.optimize`` with the default cost (measured time) on a CNN with
six adjustable ops (six convs/linears, no Tensor Cores on a CPU: 64 Stage-1
plans) and a 20-batch sample loader, then reports

* the search cost in FP32 epochs of the sample loader (search wall time /
  wall time of the FP32 baseline epoch);
* the search cost as a fraction of exhaustive CoMP, where every Stage-1 plan
  runs its whole epoch. A pruned sample's full epoch is estimated from its own
  measured per-batch time (seconds so far / batches run x batches per epoch);
  ``--validate`` also runs the search without pruning and reports the measured figure;
* the chosen plan's median step time against FP32 and AMP (same batches).

It does so twice: with the cost model (``predictor=True``, profiling on a cold
profile cache counted in the search time, then once more on the warm cache)
and without it (``predictor=False``: the exact search, which picks the plan
exhaustive CoMP picks). The predictor's plan is then timed against the exact
plan, interleaved on the same batches (target: within 5%; when both searches
chose the same plan it is within by definition, and the timing shows the
machine's noise), and its search cost
is compared with the target of 5 FP32 epochs.

It also measures the search's fixed costs (``--cases``): for the demo's
digits CNN, a 13-op CNN with a 20-batch loader and a tiny Hugging Face BERT,
each in a fresh process, the whole ``optimize()`` call with a cold profile
cache and then again with the same cache warm, in FP32 epochs of the sample
loader (the model's own eager FP32 epoch, timed in the same process before and
after the searches), split into the parts of ``SearchResult.cost_breakdown``
(capture, profiling, rewrites, samples, step comparison, other).

Run from the repository root::

    python -m benchmarks.search_cost            # writes benchmarks/results/<device>/search_cost.json
    python -m benchmarks.search_cost --cases demo,cnn13,bert --no-exactness   # the fixed-cost cases only
    python -m benchmarks.search_cost --cases readme,gpt2 --no-exactness       # the README example, a tiny GPT-2
    python -m benchmarks.search_cost --cases trivial --no-exactness           # the floor: a one-layer model
    python -m benchmarks.search_cost --trainer --repeat 3 --log /tmp/trainer.jsonl
        # the Trainer callback's search on a tiny GPT-2 in FP32 epochs, three fresh processes: each run, their
        # median and range under the JSON's "trainer" key (the other keys kept); each run's search log kept
        # (/tmp/trainer-0.jsonl, ...: ``compfx report`` prints one)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx.report
from compfx import SearchConfig, SearchResult, optimize
from compfx.cache import CACHE_DIR_ENV
from compfx.files import write_json_atomic
from compfx.measure import settle_host_allocator
from compfx.search.log import STOPPED_EARLY, SearchLog

__all__ = ["SixOpCNN", "sample_loader", "exhaustive_estimate", "step_time_ratio", "run"]


class SixOpCNN(nn.Module):
    """Four convs and two linears: six whitelist ops, none Tensor-Core-eligible on a CPU."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, classes))

    def forward(self, x):
        return self.head(self.features(x))


def sample_loader(batches: int = 20, batch_size: int = 32, seed: int = 0) -> list:
    """Synthetic 16x16 RGB images whose class shifts the mean: learnable, so the loss moves."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        labels = torch.randint(0, 10, (batch_size,), generator=g)
        images = torch.randn(batch_size, 3, 16, 16, generator=g) + labels.view(-1, 1, 1, 1) * 0.1
        out.append((images, labels))
    return out


def _ce(output, batch):
    return F.cross_entropy(output, batch[-1])


def exhaustive_estimate(log: SearchLog, batches_per_epoch: int) -> dict:
    """Wall seconds of the search's samples as run, and as exhaustive CoMP would have run them."""
    ran = exhaustive = 0.0
    for record in log.samples():
        if record.stage not in ("stage1", "stage2", "check"):
            continue  # "compare" timings are for the report, not part of the search
        ran += record.duration
        exhaustive += record.duration
        if record.stage == "stage1" and record.status == "pruned" and record.batches:
            full_epoch = record.seconds / record.batches * batches_per_epoch
            exhaustive += full_epoch - record.seconds
    return {"sampling_seconds": ran, "exhaustive_sampling_seconds": exhaustive}


def _search(loader, config: SearchConfig, seed: int) -> tuple[SearchResult, torch.optim.Optimizer, float]:
    torch.manual_seed(seed)
    model = SixOpCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = time.perf_counter()
    result = optimize(model, loader, loss_fn=_ce, optimizer=optimizer, config=config)
    return result, optimizer, time.perf_counter() - start


def _train_step(module, optimizer, batch) -> None:
    optimizer.zero_grad(set_to_none=True)
    _ce(module(batch[0]), batch).backward()
    optimizer.step()


def step_time_ratio(first, second, loader, rounds: int = 5, steps: int = 10) -> dict:
    """Median training-step time of two (module, optimizer) pairs, taking turns round after round."""
    times = {0: [], 1: []}
    for module, optimizer in (first, second):
        for batch in loader[:3]:  # warm-up
            _train_step(module, optimizer, batch)
    for _ in range(rounds):
        for index, (module, optimizer) in enumerate((first, second)):
            per_step = []
            for batch in loader[:steps]:
                start = time.perf_counter()
                _train_step(module, optimizer, batch)
                per_step.append(time.perf_counter() - start)
            times[index].append(statistics.median(per_step))
    a, b = statistics.median(times[0]), statistics.median(times[1])
    return {"first_step_seconds": a, "second_step_seconds": b, "ratio": a / b}


def _figures(result: SearchResult, wall: float, batches: int) -> dict:
    """What one search cost and chose."""
    cost = exhaustive_estimate(result.log, batches)
    fp32_epoch = result.fp32_epoch_seconds
    steps = result.step_seconds
    stage1 = result.log.samples("stage1")
    baseline = stage1[0].extra
    return {
        "stage1_mode": result.stage1_mode,
        "stage1_samples": len(stage1),
        "stage1_pruned": sum(r.status == "pruned" for r in stage1),
        "stage1_skipped": sum(r.status == "skipped" for r in stage1),
        "profiles_measured": baseline.get("profiles_measured"),
        "profiles_reused": baseline.get("profiles_reused"),
        "predictor_build_seconds": baseline.get("predictor_build_seconds"),
        "predictor_median_abs_error_pct": compfx.report.prediction_error(result.log),
        # over the few candidates this search measured, many stopped after 3 batches: a noisy figure;
        # benchmarks/predictor_accuracy.py measures the predictor's accuracy properly
        "predictor_error_candidates": len(compfx.report.predicted_records(result.log)),
        "stage1_stopped_early": sum(bool(r.extra.get(STOPPED_EARLY)) for r in stage1),
        "same_program_notes": sum("same_as" in r.extra for r in result.log.notes()),
        "stage2_candidates": len(result.log.samples("stage2")),
        "chosen_plan": result.plan.bitstring(result.analysis),
        "fp32_epoch_seconds": fp32_epoch,
        "search_seconds": result.search_seconds,
        "optimize_wall_seconds": wall,  # + capture and analysis
        "search_cost_fp32_epochs": result.search_seconds / fp32_epoch,
        "sampling_seconds": cost["sampling_seconds"],
        "exhaustive_sampling_seconds_estimated": cost["exhaustive_sampling_seconds"],
        "fraction_of_exhaustive_estimated": cost["sampling_seconds"] / cost["exhaustive_sampling_seconds"],
        "exhaustive_cost_fp32_epochs_estimated": cost["exhaustive_sampling_seconds"] / fp32_epoch,
        "step_seconds": steps,
        "chosen_vs_fp32_step_ratio": steps["chosen"] / steps["fp32"],
        "chosen_within_5pct_of_fp32": steps["chosen"] <= 1.05 * steps["fp32"],
        "chosen_vs_amp_step_ratio": steps["chosen"] / steps["amp"],
    }


def run(batches: int = 20, seed: int = 0, threads: int | None = 1, validate: bool = False) -> dict:
    if threads:
        torch.set_num_threads(threads)
    loader = sample_loader(batches, seed=seed)
    exact, exact_opt, exact_wall = _search(loader, SearchConfig(seed=seed, progress=False, predictor=False), seed)
    guided_config = SearchConfig(seed=seed, progress=False, predictor=True)
    # COMPFX_CACHE_DIR at a fresh directory: a cold profile cache, then the same cache warm
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {CACHE_DIR_ENV: cache}):
        guided, guided_opt, guided_wall = _search(loader, guided_config, seed)
        warm, _, warm_wall = _search(loader, guided_config, seed)
    analysis = exact.analysis
    steps = step_time_ratio((guided.module, guided_opt), (exact.module, exact_opt), loader)
    same_plan = guided.plan == exact.plan  # then the timing below only measures the machine's noise
    cold = _figures(guided, guided_wall, batches)
    result = {
        "device": str(analysis.device),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": "SixOpCNN (4 conv + 2 linear, 16x16x3 inputs, batch 32)",
        "adjustable_ops": len(analysis.stage1_adjustable),
        "sample_batches": batches,
        "predictor_off": _figures(exact, exact_wall, batches),
        "predictor_on_cold_cache": cold,
        "predictor_on_warm_cache": _figures(warm, warm_wall, batches),
        "predictor_plan_step_seconds": steps["first_step_seconds"],
        "exact_plan_step_seconds": steps["second_step_seconds"],
        "predictor_vs_exact_plan_step_ratio": steps["ratio"],
        "predictor_plan_is_exact_plan": same_plan,
        "predictor_plan_within_5pct_of_exact": same_plan or steps["ratio"] <= 1.05,
        "predictor_search_within_5_fp32_epochs": cold["search_cost_fp32_epochs"] <= 5.0,
    }
    if validate:
        unpruned, _, _ = _search(loader, SearchConfig(seed=seed, progress=False, prune=False, predictor=False), seed)
        measured = exhaustive_estimate(unpruned.log, batches)["sampling_seconds"]
        result["exhaustive_sampling_seconds_measured"] = measured
        result["fraction_of_exhaustive_measured"] = (
            result["predictor_off"]["sampling_seconds"] / measured)
        result["unpruned_chosen_plan"] = unpruned.plan.bitstring(unpruned.analysis)
    return result


# -- fixed costs: the whole optimize() call, cold and warm, by part ------------------------------

class ThirteenOpCNN(nn.Module):
    """Three convs, two BatchNorms, five ReLU/pool ops, flatten and two linears: 13 ops on 3x16x16 images."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(32 * 4 * 4, 64), nn.Linear(64, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.conv3(x))
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def _digits_case():
    from compfx.demo import _nll, digits_batches
    from compfx.examples import cnn

    model = cnn()
    return model, digits_batches(64, 0)[0][:20], _nll, torch.optim.Adam(model.parameters(), lr=2e-3)


def _cnn13_case():
    model = ThirteenOpCNN()
    loader = sample_loader(20, batch_size=16)
    return model, loader, _ce, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _bert_case():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64, num_labels=4)
    model = BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)
    loader = [{"input_ids": torch.randint(0, 512, (8, 32), generator=g),
               "labels": torch.randint(0, 4, (8,), generator=g)} for _ in range(20)]
    return model, loader, None, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _readme_case():
    """The README's first example: the digits CNN on 8 random batches of 32 8x8 images (seed 0)."""
    from compfx.examples import cnn

    model = cnn()
    loader = [(torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))) for _ in range(8)]
    return model, loader, lambda out, batch: F.nll_loss(out, batch[-1]), torch.optim.SGD(model.parameters(), lr=0.1)


def tiny_gpt2(layers: int = 2, hidden: int = 64, vocab: int = 256, positions: int = 64):
    """A tiny Hugging Face GPT-2 (GPT2LMHeadModel), built from its config: no download."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=2, vocab_size=vocab,
                                      n_positions=positions, bos_token_id=0, eos_token_id=0))


def gpt2_batches(count: int = 9, batch_size: int = 8, tokens: int = 32, vocab: int = 256, seed: int = 0) -> list:
    """Language-model batches of random tokens (labels = inputs, as the model shifts them itself)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch_size, tokens), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _gpt2_case():
    model = tiny_gpt2()
    return model, gpt2_batches(), None, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _trivial_case():
    """The floor: one linear layer on 4 batches of 8x8 inputs -- what any search pays (the process's one-off costs,
    the capture and its check, the baseline, the report's comparison), whatever the model."""
    model = nn.Linear(8, 4)
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]
    return model, loader, _ce, torch.optim.SGD(model.parameters(), lr=0.1)


CASES = {
    "readme": ("the README's first example (compfx.examples.cnn, 8 batches of 32 random 8x8 images)", _readme_case),
    "gpt2": ("tiny HF GPT2LMHeadModel (2 layers, hidden 64), 9 batches of 8x32 tokens", _gpt2_case),
    "demo": ("the demo's digits CNN (compfx.examples.cnn), 20 batches of 64 8x8 images", _digits_case),
    "cnn13": ("ThirteenOpCNN, 20 batches of 16 3x16x16 images", _cnn13_case),
    "bert": ("tiny HF BertForSequenceClassification (2 layers, hidden 64), 20 batches of 8x32 tokens", _bert_case),
    "trivial": ("the floor: one nn.Linear(8, 4), 4 batches of 8 inputs", _trivial_case),
}


def _eager_fp32_epoch(model, loader, loss_fn, optimizer, repeats: int = 3) -> float:
    """Median seconds of one eager FP32 epoch over ``loader``; model and optimizer restored afterwards."""
    state = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            if isinstance(batch, dict):
                loss = model(**batch).loss
            else:
                loss = loss_fn(model(batch[0]), batch)
            loss.backward()
            optimizer.step()
        seconds.append(time.perf_counter() - start)
    model.load_state_dict(state[0])
    optimizer.load_state_dict(state[1])
    return statistics.median(seconds)


#: The searches of one case, in order, in one fresh process, and the profile-cache folder each uses
#: (the warm search reuses the folder the cold one filled).
RUNS = (("first_in_process", "first"), ("cold_cache", "second"), ("warm_cache", "second"))


def run_case(name: str, seed: int = 0) -> dict:
    """One case in this process: three searches, each against the model's eager FP32 epoch.

    ``first_in_process`` is the process's first search, on an empty profile cache: it also pays what the
    process pays once (torch's first FakeTensor and dispatcher calls, lazy imports). ``cold_cache`` is a
    search on an empty profile cache in a process that has searched before; ``warm_cache`` reuses its cache.
    """
    description, build = CASES[name]
    settle_host_allocator("cpu")  # the eager epochs before the first search time under the allocator it leaves
    epochs, runs = [], {}
    with tempfile.TemporaryDirectory() as caches:
        for run_name, cache in RUNS:
            torch.manual_seed(seed)
            model, loader, loss_fn, optimizer = build()
            if not epochs:
                epochs.append(_eager_fp32_epoch(model, loader, loss_fn, optimizer))
            with mock.patch.dict(os.environ, {CACHE_DIR_ENV: os.path.join(caches, cache)}):
                result = optimize(model, loader, loss_fn=loss_fn, optimizer=optimizer,
                                  config=SearchConfig(seed=seed, progress=False))
            epochs.append(_eager_fp32_epoch(model, loader, loss_fn, optimizer))  # between searches: drift shows
            runs[run_name] = {
                "search_seconds": result.search_seconds,
                # what the search pays whatever it samples: everything but the samples themselves
                "fixed_seconds": result.search_seconds - result.cost_breakdown.get("samples", 0.0),
                "breakdown_seconds": result.cost_breakdown,
                "chosen_plan": result.plan.bitstring(result.analysis),
                "ops": len(result.analysis.ops),
                "capture_method": result.analysis.capture_method,
                **_profiles_counted(result),
            }
    epoch = statistics.median(epochs)
    for run in runs.values():
        run["cost_fp32_epochs"] = run["search_seconds"] / epoch
        run["breakdown_fp32_epochs"] = {k: v / epoch for k, v in run["breakdown_seconds"].items()}
    rows = {"fp32_epoch_seconds": epoch, "fp32_epochs_measured": epochs, **runs}
    return {"case": name, "description": description, "batches": len(loader), **rows}


def _profiles_counted(result: SearchResult) -> dict:
    """How many op profiles the search measured and read from the cache (its calibration record says)."""
    calibration = next((r.extra for r in result.log.samples("stage1") if r.extra.get("calibration")), {})
    return {"profiles_measured": calibration.get("profiles_measured"),
            "profiles_reused": calibration.get("profiles_reused")}


def run_cases(names: list[str], seed: int = 0, threads: int | None = 1) -> dict:
    """Each case in a fresh process, so that its cold run pays what a user's first search pays."""
    out = {}
    for name in names:
        command = [sys.executable, "-m", "benchmarks.search_cost", "--case", name, "--seed", str(seed),
                   "--threads", str(threads or 0)]
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              cwd=Path(__file__).resolve().parent.parent)
        if done.returncode != 0:
            raise RuntimeError(f"case {name} failed:\n{done.stderr[-3000:]}")
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


# -- the Trainer callback: what its search costs ---------------------------------------------------

def run_trainer(steps: int = 20, search_batches: int = 9, batch_size: int = 8, seed: int = 0,
                log: str | os.PathLike | None = None) -> dict:
    """A tiny GPT-2 in the Hugging Face ``Trainer`` with ``CompfxCallback``: the search in FP32 epochs, and the
    trainer's throughput with and without it.

    The FP32 epoch is the model's own eager FP32 epoch over the ``search_batches`` batches the callback
    searches on (same batch size), timed in this process before the run (median of three, the model and
    optimizer restored). The search's seconds are the callback's ``optimize()`` call. ``log``: where to keep
    the callback's search log (``compfx report`` prints it; otherwise it goes with the trainer's output folder).
    """
    from transformers import Trainer, TrainingArguments

    from compfx.integrations.transformers import CompfxCallback

    settle_host_allocator("cpu")  # the eager epoch before the search times under the allocator the search leaves
    torch.manual_seed(seed)
    model = tiny_gpt2()
    batches = gpt2_batches(search_batches, batch_size, seed=seed)
    epoch = _eager_fp32_epoch(model, batches, None, torch.optim.AdamW(model.parameters(), lr=1e-3))
    rows = [{"input_ids": ids, "labels": ids.clone()} for batch in gpt2_batches(steps, batch_size, seed=seed + 1)
            for ids in batch["input_ids"]]
    callback = CompfxCallback(search_batches=search_batches, config=SearchConfig(seed=seed, progress=False))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch_size,
                                 report_to=[], use_cpu=True, learning_rate=1e-3, disable_tqdm=True, seed=seed,
                                 save_strategy="no", logging_steps=steps)
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
        metrics = trainer.train().metrics
        if log is not None:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(out) / "compfx-search.jsonl", log)
    result = callback.run.result
    return {"model": "tiny GPT2LMHeadModel (2 layers, hidden 64), batches of 8x32 tokens",
            "search_batches": search_batches, "steps": steps, "fp32_epoch_seconds": epoch,
            "search_seconds": result.search_seconds, "search_cost_fp32_epochs": result.search_seconds / epoch,
            "breakdown_seconds": result.cost_breakdown, "samples": result.samples_run,
            # of those, the plans that trained or were timed (the rest the cost model skipped, or a duplicate)
            "measured_samples": sum(r.status != "skipped" and bool(r.batches or r.seconds)
                                    for r in result.log.samples() if r.stage in ("stage1", "stage2")),
            "chosen_plan": result.plan.bitstring(result.analysis), "trainer_metrics": metrics,
            "target_fp32_epochs": TRAINER_TARGET_FP32_EPOCHS,
            "within_target": result.search_seconds / epoch <= TRAINER_TARGET_FP32_EPOCHS,
            **({"log": str(log)} if log is not None else {})}


#: what the Trainer callback's search on the tiny GPT-2 may cost, in FP32 epochs of its search batches
TRAINER_TARGET_FP32_EPOCHS = 10.0


def _trainer_run_in_fresh_process(seed: int, log: str | None, threads: int | None) -> dict:
    """:func:`run_trainer` in a new Python process; its figures."""
    command = [sys.executable, "-m", "benchmarks.search_cost", "--trainer-run", "--seed", str(seed),
               "--threads", str(threads or 0)] + (["--log", log] if log is not None else [])
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        raise RuntimeError(f"trainer run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _numbered(log: str | None, index: int, repeat: int) -> str | None:
    """The log path of run ``index``: ``log`` itself for one run, else ``name-<index>.jsonl`` beside it."""
    if log is None or repeat == 1:
        return log
    path = Path(log)
    return str(path.with_name(f"{path.stem}-{index}{path.suffix or '.jsonl'}"))


def run_trainer_repeated(repeat: int, seed: int = 0, log: str | None = None, threads: int | None = 1) -> dict:
    """``repeat`` Trainer runs, each in a fresh process (each pays a first search's one-off costs, as a user's
    job does), and their median and range of the search cost in FP32 epochs and of the samples run."""
    runs = []
    for index in range(repeat):
        path = _numbered(log, index, repeat)
        run = _trainer_run_in_fresh_process(seed, path, threads)
        runs.append(run)
        print(f"run {index}: {run['search_cost_fp32_epochs']:.3g} FP32 epochs, {run['samples']} samples "
              f"({run.get('measured_samples', '?')} measured), "
              f"plan {run['chosen_plan']}" + (f", log {path}" if path else ""), flush=True)
    costs = [run["search_cost_fp32_epochs"] for run in runs]
    samples = [run["samples"] for run in runs]
    return {"model": runs[0]["model"], "repeat": repeat, "target_fp32_epochs": TRAINER_TARGET_FP32_EPOCHS,
            "search_cost_fp32_epochs_median": statistics.median(costs),
            "search_cost_fp32_epochs_range": [min(costs), max(costs)],
            "samples_median": statistics.median(samples), "samples_range": [min(samples), max(samples)],
            "measured_samples_range": [min(run.get("measured_samples", 0) for run in runs),
                                       max(run.get("measured_samples", 0) for run in runs)],
            "runs_within_target": sum(cost <= TRAINER_TARGET_FP32_EPOCHS for cost in costs),
            "chosen_plans": sorted({run["chosen_plan"] for run in runs}), "runs": runs}


PARTS = ("capture", "profiling", "rewrites", "samples", "step comparison", "other")


def cases_table(cases: dict) -> str:
    """Markdown: per case and search, the cost in FP32 epochs and its parts (FP32 epochs too)."""
    lines = ["| case | FP32 epoch | search | cost (FP32 epochs) | " + " | ".join(PARTS) + " | plan |",
             "|" + "---|" * (5 + len(PARTS))]
    for name, row in cases.items():
        for run_name, _ in RUNS:
            run = row[run_name]
            by_part = [f"{run['breakdown_fp32_epochs'].get(p, 0.0):.2f}" for p in PARTS]
            lines.append(f"| {name} | {row['fp32_epoch_seconds'] * 1e3:.0f} ms | {run_name.replace('_', ' ')} | "
                         f"**{run['cost_fp32_epochs']:.2f}** | " + " | ".join(by_part) + f" | `{run['chosen_plan']}` |")
    return "\n".join(lines)


def trainer_table(trainer: dict) -> str:
    """Markdown: each Trainer-callback run's search cost in FP32 epochs, by part, then the median and range."""
    lines = ["| run | FP32 epoch | search | cost (FP32 epochs) | " + " | ".join(PARTS) + " | plans measured | plan |",
             "|" + "---|" * (6 + len(PARTS))]
    for i, run in enumerate(trainer["runs"]):
        epoch = run["fp32_epoch_seconds"]
        by_part = [f"{run['breakdown_seconds'].get(p, 0.0) / epoch:.2f}" for p in PARTS]
        cost = f"{run['search_seconds']:.2f} s | **{run['search_cost_fp32_epochs']:.1f}**"
        lines.append(f"| {i} | {epoch * 1e3:.0f} ms | {cost} | " + " | ".join(by_part)
                     + f" | {run['measured_samples']} | `{run['chosen_plan']}` |")
    low, high = trainer["search_cost_fp32_epochs_range"]
    median = trainer["search_cost_fp32_epochs_median"]
    lines.append(f"\nMedian **{median:.1f}** FP32 epochs ({low:.1f}-{high:.1f}) over {trainer['repeat']} runs; "
                 f"{trainer['runs_within_target']} of {trainer['repeat']} within "
                 f"{trainer['target_fp32_epochs']:g}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20, help="batches in the sample loader")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--validate", action="store_true", help="also run without pruning and measure it")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>/search_cost.json)")
    parser.add_argument("--cases", default="demo,cnn13,bert",
                        help=f"fixed-cost cases, comma-separated, from {sorted(CASES)} ('' for none)")
    parser.add_argument("--no-exactness", action="store_true",
                        help="skip the six-op CNN's exact-vs-predictor searches")
    parser.add_argument("--trainer", action="store_true",
                        help="only the Hugging Face Trainer callback's search on a tiny GPT-2, in FP32 epochs "
                             "(written under the JSON's 'trainer' key, the other keys kept)")
    parser.add_argument("--repeat", type=int, default=3, help="--trainer: runs, each in a fresh process")
    parser.add_argument("--log", default=None,
                        help="--trainer: keep each run's search log here (NAME-<run>.jsonl for several runs)")
    parser.add_argument("--trainer-run", action="store_true", help=argparse.SUPPRESS)  # one run, JSON on stdout
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)  # one case, JSON on stdout
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.case:
        print(json.dumps(run_case(args.case, args.seed)))
        return 0
    if args.trainer_run:
        print(json.dumps(run_trainer(seed=args.seed, log=args.log), default=str))
        return 0
    if args.trainer:
        if args.repeat < 1:
            parser.error(f"--repeat {args.repeat}: expected at least 1 run")
        figures = run_trainer_repeated(args.repeat, args.seed, args.log, args.threads or None)
        for key, value in figures.items():
            if key != "runs":
                print(f"{key:36s} {value:.4g}" if isinstance(value, float) else f"{key:36s} {value}")
        out = Path(args.out or Path(__file__).parent / "results" / "cpu" / "search_cost.json")
        _merge_json(out, {"trainer": figures})
        print(f"wrote {out}")
        return 0
    result = {} if args.no_exactness else run(args.batches, args.seed, args.threads or None, args.validate)
    names = [n for n in args.cases.split(",") if n]
    if names:
        result["fixed_cost_cases"] = run_cases(names, args.seed, args.threads or None)
        result.setdefault("device", "cpu")
        print(cases_table(result["fixed_cost_cases"]))
    for key, value in result.items():
        if key == "fixed_cost_cases":
            continue  # printed as a table above
        if isinstance(value, dict) and key.startswith("predictor_o"):
            print(key)
            for name, figure in value.items():
                print(f"  {name:38s} {figure:.4g}" if isinstance(figure, float) else f"  {name:38s} {figure}")
        else:
            print(f"{key:40s} {value:.4g}" if isinstance(value, float) else f"{key:40s} {value}")
    out = Path(args.out or Path(__file__).parent / "results" / torch.device(result["device"]).type / "search_cost.json")
    if args.no_exactness:  # keep the exactness figures of an earlier full run
        _merge_json(out, result)
    else:
        trainer = json.loads(out.read_text()).get("trainer") if out.exists() else None
        write_json_atomic(out, {**result, **({"trainer": trainer} if trainer is not None else {})})
    print(f"wrote {out}")
    return 0


def _merge_json(out: Path, figures: dict) -> None:
    """Write ``figures`` into the JSON at ``out``, keeping its other keys."""
    write_json_atomic(out, {**(json.loads(out.read_text()) if out.exists() else {}), **figures})


if __name__ == "__main__":
    raise SystemExit(main())
