"""FP8 on the compiled path: the benchmark's smoke run, and the compiled search's FP8 acceptance test.

FP8 is emulated on this CPU (torchao's ``emulate=True``), so its seconds mean nothing: the search ranks plans by
:func:`compfx.costmodel.roofline_cost`, an H100's roofline, while the CPU trains them and the loss guard judges
their losses.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.costmodel import roofline_cost
from compfx.vocabulary import Precision, SampleStatus, Stage

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

COMPILED_SEARCH = "compile" in {f.name for f in dataclasses.fields(compfx.SearchConfig)}


def test_the_fp8_compiled_benchmark_smoke_run_trains_every_contender(tmp_path):
    from benchmarks import fp8_compiled

    assert fp8_compiled.main(["--smoke", "--out", str(tmp_path)]) == 0
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    result = json.loads((folder / "fp8_compiled.json").read_text())
    assert result["times_mean_nothing"] is True and "mean nothing" in (folder / "fp8_compiled.md").read_text()
    rows = result["rows"]
    measured = {name for name, row in rows.items() if "step_ms" in row}
    assert {"bf16 AMP (compiled)", "torchao float8 (all linears) (compiled)", "torchao float8 (auto filter) (compiled)",
            "compfx (plan searched eager) (compiled)"} <= measured
    assert all(rows[name]["steps_timed"] == result["rounds"] * result["steps_per_round"] for name in measured)
    assert rows["torchao float8 (all linears) (compiled)"]["fp8_linears"] == result["linears"]
    assert rows["torchao float8 (auto filter) (compiled)"]["fp8_linears"] == result["auto_filter_fp8_linears"]
    assert "agrees_with_auto_filter" in rows["compfx (plan searched eager) (compiled)"]
    compiled_row = rows["compfx (plan searched compiled) (compiled)"]
    if COMPILED_SEARCH:
        assert "step_ms" in compiled_row and "plan" in compiled_row
    else:
        assert compiled_row == {"status": "not available: this compfx's SearchConfig has no compile field"}


# -- the acceptance test of FP8 on the compiled path ---------------------------------------------------

WIDE, NARROW, ROWS = 4096, 512, 16


class MassiveAndWide(nn.Module):
    """Two large GEMMs, where FP8 pays on an H100's roofline, and a small one, where bf16 does. ``sensitive`` sees
    rows of massive activations (as attention-sink tokens have); ``large`` sees them only after a LayerNorm.
    Tensorwise FP8 scales a tensor by its largest value, so ``sensitive``'s ordinary rows flush to zero in FP8,
    while bf16 (an exponent per element) keeps them."""

    def __init__(self):
        super().__init__()
        self.sensitive, self.norm, self.large = nn.Linear(WIDE, WIDE), nn.LayerNorm(WIDE), nn.Linear(WIDE, WIDE)
        self.small = nn.Linear(WIDE, NARROW)

    def forward(self, x):
        return self.small(torch.relu(self.large(self.norm(self.sensitive(x)))))


def massive_batches(teacher: nn.Module, n: int = 2) -> list:
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        x = torch.randn(ROWS, WIDE, generator=g)
        x[0] = 1e6  # 448 / 1e6 * |x| is below half e4m3's smallest subnormal for every other row
        with torch.no_grad():
            batches.append((x, teacher(x) + 0.1 * torch.randn(ROWS, NARROW, generator=g)))
    return batches


def scored_rows(output, batch):
    return nn.functional.mse_loss(output[1:], batch[-1][1:])  # row 0 is the massive one, not scored


def _roofline_at_gpu_scale(model: nn.Module):
    """The roofline of the model as a GPU trains it, 4096 tokens a batch: shapes alone, on the meta device. Its
    ops are keyed as the search's analysis (of the CPU's 16 rows) keys them, so it prices the search's plans."""
    meta = copy.deepcopy(model).to("meta")
    return roofline_cost(compfx.analyze(meta, torch.empty(4096, WIDE, device="meta"), fp8=True, verify=False))


@pytest.mark.skipif(not COMPILED_SEARCH, reason="the compiled search is not built yet: SearchConfig has no compile "
                    "field; this test runs once SearchConfig(compile=...) exists")
def test_the_compiled_search_keeps_fp8_on_large_gemms_bf16_on_small_ones_and_the_guard_rejects_fp8_on_outliers():
    torch.manual_seed(0)
    model = MassiveAndWide()
    loader = massive_batches(copy.deepcopy(model))
    cost = _roofline_at_gpu_scale(model)
    # margin 0, no duels: the cheaper plan on the roofline wins (CoMP's rule), and only the guard can stop it
    config = compfx.SearchConfig(fp8=True, fp8_recipe="tensorwise", compile=_compile_setting("aot_eager"),
                                 cost_fn=cost, margin=0.0, rounds=0, progress=False, warmup=0, repeats=1,
                                 stage2_budget=4, stage2_check_batches=1, cache_plan=False)
    result = compfx.optimize(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                             loss_fn=scored_rows, low_dtype=torch.bfloat16, config=config)
    a, plan = result.analysis, result.plan
    key = {op.key.module: op.key for op in a.ops if op.kind == "linear"}
    # the roofline prices FP8 cheapest for both large GEMMs: only the guard can keep it off `sensitive`
    amp = compfx.Plan.amp(a)
    for name in ("sensitive", "large"):
        assert cost(amp.with_precisions({key[name]: Precision.FP8}), 0.0) < cost(amp, 0.0)
    assert plan[key["large"]] is Precision.FP8 and plan[key["small"]] is Precision.LOW
    assert plan[key["sensitive"]] in (Precision.LOW, Precision.FP32)
    position = [op.key for op in a.ops].index(key["sensitive"])
    tried = [r for r in result.log.samples(Stage.STAGE1) if r.plan[position] == Precision.FP8.code and r.loss]
    assert tried and all(r.status is SampleStatus.REJECTED for r in tried)
    assert min(r.loss for r in tried) > config.threshold * result.loss0  # the loss diverged beyond the guard's bar


def _compile_setting(inner: str):
    from benchmarks.fp8_compiled import compile_setting

    setting, why = compile_setting(inner)
    assert setting is not None, why
    return setting
