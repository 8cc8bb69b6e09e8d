"""SearchConfig(tie_blocks=True): the same op of every repeat of a block is one Stage-1 decision, then the first and
the last repeat are tried on their own; Stage 1's candidates do not grow with depth.

Stage 1 runs on fake epochs here (compfx.search.evaluator.FunctionEvaluator): a device where every FP32 op costs a
second, and a loss that one op of the first block cannot take in low precision. No training, no timing.
"""

from __future__ import annotations

import pytest
import torch

import compfx
from compfx.opkey import OpKey
from compfx.search.config import SearchConfig
from compfx.search.evaluator import FunctionEvaluator
from compfx.search.space import SearchSpace
from compfx.search.stage1 import run_stage1
from compfx.search.tied_blocks import block_ties
from compfx.vocabulary import Precision

from tests.helpers import fp32_op_count
from tests.tiny_gpt import lm_loss, tiny_gpt, token_batches

#: the op whose low precision the fake loss cannot take, in the first block only
SENSITIVE = "blocks.0.attn.qkv:linear#0"


def K(text: str) -> OpKey:
    module, _, rest = text.rpartition(":")
    kind, _, index = rest.partition("#")
    return OpKey(module, kind, int(index))


@pytest.mark.parametrize("keys, tied", [
    (["h.0.fc:linear#0", "h.0:add#0", "h.1.fc:linear#0", "h.1:add#0"], [True] * 4),
    (["h.0.mlp.0:linear#0", "h.1.mlp.0:linear#0", "h.2.mlp.0:linear#0"], [True] * 3),  # numbers inside a block too
    (["h.0.fc:linear#0", "h.1.fc:linear#0", "h.1:add#0"], [False] * 3),  # a repeat with another op
    (["h.0.fc:linear#0", "h.2.fc:linear#0"], [True] * 2),  # repeats 0 and 2 (1 is another module)
    (["0:embedding#0", "1.fc:linear#0", "2.fc:linear#0", "3:linear#0"], [False, True, True, False]),  # a Sequential
    (["h.0.fc:linear#0", "head:linear#0"], [False] * 2),  # one repeat is no repetition
])
def test_ties_are_the_same_op_in_every_repeat_of_a_block(keys, tied):
    ties, repeats = block_ties([K(k) for k in keys], ["same shape"] * len(keys))
    assert [t is not None for t in ties] == tied
    assert all((r is not None) == t for r, t in zip(repeats, tied))


def test_ops_of_other_shapes_are_not_tied():
    keys = [K("h.0.fc:linear#0"), K("h.1.fc:linear#0")]
    assert block_ties(keys, ["linear[[2, 8]]", "linear[[2, 16]]"]) == ((None, None), (None, None))
    # two blocks in one container (two widths, twice each): each tied across its own repeats only
    ties, repeats = block_ties([K(f"h.{i}.fc:linear#0") for i in range(4)], ["narrow", "narrow", "wide", "wide"])
    assert ties[0] == ties[1] != ties[2] == ties[3] and repeats == (0, 1, 0, 1)


def fake_run_epoch(space):
    """Epochs on a device where each FP32 op costs a second; the first block's qkv linear breaks the loss if low."""
    sensitive = space.names.index(SENSITIVE)

    def run_epoch(plan):
        loss = 5.0 if plan[sensitive] is Precision.LOW else 1.0
        for _ in range(3):
            yield loss, 1.0 + str(plan).count("1")  # (loss, seconds)
    return run_epoch


def stage1_of(layers: int, tie_blocks: bool, budget: int = 64):
    analysis = compfx.analyze(tiny_gpt(layers), token_batches(1)[0][0], verify=False)
    space = SearchSpace.from_analysis(analysis, tie_blocks=tie_blocks)
    result = run_stage1(space, FunctionEvaluator(run_epoch=fake_run_epoch(space)), budget=budget)
    return analysis, space, result


def test_tied_blocks_give_stage1_the_same_candidates_at_every_depth():
    counts, untied = {}, {}
    for layers in (2, 4, 8, 16):
        analysis, space, result = stage1_of(layers, tie_blocks=True)
        counts[layers] = (len(space.decisions), len(result.samples))
        untied[layers] = len(stage1_of(layers, tie_blocks=False, budget=256)[2].samples)
        plan = compfx.Plan.from_assignment(analysis, result.best.plan)
        assert compfx.Plan.from_dict(plan.to_dict()) == plan  # a plan of the whole model
        plan.validate(analysis)
        assert len(plan.rules()) <= 6 and compfx.Plan.from_rules(analysis, plan.rules()) == plan
        # the tied search kept the first block's qkv FP32 in every block; the last block alone then went low
        qkv = {key: plan[key] for key in plan if key.module.endswith("attn.qkv")}
        assert qkv[K(f"blocks.{layers - 1}.attn.qkv:linear#0")] == "low"
        assert all(qkv[K(f"blocks.{i}.attn.qkv:linear#0")] == "fp32" for i in range(layers - 1))
    assert len(set(counts.values())) == 1, f"(decisions, Stage-1 samples) by depth: {counts}"
    assert untied[2] < untied[4] < untied[8] < untied[16], f"untied, Stage 1 grows with depth: {untied}"


def test_without_ties_stage1_is_unchanged():
    _, space, _ = stage1_of(2, tie_blocks=False)
    assert space.decisions == tuple((i,) for i in space.searched) and not space.ties


def test_a_search_with_tied_blocks_trains_and_notes_the_end_repeats():
    model = tiny_gpt(3)
    config = SearchConfig(tie_blocks=True, cost_fn=fp32_op_count, predictor="off", progress=False, warmup=0,
                          repeats=1, rounds=0, stage1_budget=24, stage2_budget=2, stage2_check_batches=1,
                          threshold=10.0, cache_plan=False)
    result = compfx.optimize(model, token_batches(2), loss_fn=lm_loss,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.01), config=config)
    notes = [record for record in result.log.records if "tied across the repeats" in str(record)]
    assert notes, "Stage 1 tried the tied decisions in the end repeats"
    assert compfx.Plan.from_dict(result.plan.to_dict()) == result.plan
