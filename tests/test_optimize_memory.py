"""What optimize() leaves behind: the user's gradients as they were, and no tensor beyond what training needs.

Storages are counted through the garbage collector: every real tensor it can
reach (FakeTensors and meta tensors hold no data and are left out), keyed by
storage address. A tensor that only C++ holds still has its Python object
kept alive with it, so an autograd graph kept by a reference cycle through C++
(which ``gc.collect()`` cannot break) is counted too. The model's tensors all
have shapes no other tensor here has, so a leaked storage names itself.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

import compfx
from compfx import SearchConfig, optimize
from compfx.integrations.planned_training import plan_model
from tests.helpers import ce, fp32_op_count

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

BATCH = 24
FAST = dict(progress=False, warmup=1, repeats=2, stage2_check_batches=2, cost_fn=fp32_op_count)


class Distinct(nn.Module):
    """An MLP whose every parameter and activation has a shape of its own."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(12, 56), nn.Linear(56, 88), nn.Linear(88, 5)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


#: what a leaked storage of each shape is, for the failure message
NAMES = {(BATCH, 12): "a batch's inputs", (BATCH, 56): "fc1's activation", (BATCH, 88): "fc2's activation",
         (BATCH, 5): "the logits", (56, 12): "fc1.weight", (88, 56): "fc2.weight", (5, 88): "head.weight",
         (12, 56): "fc1.weight transposed", (56, 88): "fc2.weight transposed", (88, 5): "head.weight transposed",
         (56,): "fc1.bias", (88,): "fc2.bias", (5,): "head.bias"}


def setup(seed: int = 0):
    torch.manual_seed(seed)
    model = Distinct()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # momentum: optimizer state of its own
    g = torch.Generator().manual_seed(seed)
    loader = [(torch.randn(BATCH, 12, generator=g), torch.randint(0, 5, (BATCH,), generator=g)) for _ in range(4)]
    return model, opt, loader


def live_storages() -> dict[int, str]:
    """Every storage with data that a live tensor uses: address -> what it is (shape, dtype, a name)."""
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or isinstance(obj, FakeTensor) or obj.device.type == "meta":
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            continue
        if storage.nbytes() and storage.data_ptr():
            shape = tuple(obj.shape)
            found[storage.data_ptr()] = (f"{storage.nbytes()} bytes {shape} {str(obj.dtype).removeprefix('torch.')}"
                                         f" ({NAMES.get(shape, 'unnamed')})")
    return found


def training_storages(*modules: nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """Addresses of what training needs: parameters, buffers, gradients, the optimizer's state."""
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors}


def left_behind(before: dict[int, str], *modules: nn.Module, optimizer) -> list[str]:
    """Storages alive now that were not before and that training does not need."""
    return new_storages(before, needed=training_storages(*modules, optimizer=optimizer))


def new_storages(before: dict[int, str], needed: set[int] = frozenset()) -> list[str]:
    return sorted(what for address, what in live_storages().items() if address not in before and address not in needed)


def leaked(storages: list[str]) -> str:
    return f"{len(storages)} storages left referenced:\n" + "\n".join(storages)


# -- the user's gradients --------------------------------------------------------------------------

def _user_grads(model: nn.Module, kind: str) -> None:
    for index, param in enumerate(model.parameters()):
        if kind == "tensors" or (kind == "mixed" and index % 2):
            param.grad = torch.full_like(param, 0.25 + index)  # values no training step makes
        else:
            param.grad = None


@pytest.mark.parametrize("kind, keep", [("none", True), ("tensors", True), ("mixed", True), ("mixed", False)])
def test_optimize_leaves_the_users_gradients_as_they_were(kind, keep):
    model, opt, loader = setup()
    _user_grads(model, kind)
    before = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    optimize(model, loader, loss_fn=ce, optimizer=opt, config=SearchConfig(keep_search_training=keep, **FAST))
    for name, param in model.named_parameters():
        if before[name] is None:
            assert param.grad is None, f"{name}.grad was None before optimize() and is a tensor after it"
        else:
            torch.testing.assert_close(param.grad, before[name], rtol=0, atol=0, msg=f"{name}.grad changed")


# -- memory left referenced --------------------------------------------------------------------------

def test_optimize_keeps_nothing_beyond_training_state_while_the_result_is_kept():
    """With the result kept (as users keep ``result.module``), the live storages beyond the model's Parameters,
    buffers, the optimizer's state and the planned module's own tensors are none at all: the planned MLP runs from
    the model's own Parameters, and every low-precision copy it makes is made per forward and freed with it. (Before
    the fix, every plan whose saved-activation bytes the search measured kept its forward's autograd graph: the
    inputs, fc1's and fc2's activations, and the bf16 copies of the weights.)"""
    model, opt, loader = setup()
    opt.zero_grad(set_to_none=True)
    before = live_storages()
    result = optimize(model, loader, loss_fn=ce, optimizer=opt, config=SearchConfig(**FAST))
    assert result.plan.low_dtype == torch.bfloat16 and "low" in {str(p) for p in result.plan.values()}
    assert not (kept := left_behind(before, model, result.module, optimizer=opt)), leaked(kept)
    assert result.module(loader[0][0]).shape == (BATCH, 5)  # the result still works: nothing it needs was freed


def test_optimize_keeps_nothing_once_the_result_is_deleted():
    model, opt, loader = setup()
    opt.zero_grad(set_to_none=True)
    before = live_storages()
    result = optimize(model, loader, loss_fn=ce, optimizer=opt, config=SearchConfig(keep_search_training=False,
                                                                                    **FAST))
    del result
    assert not (kept := left_behind(before, model, optimizer=opt)), leaked(kept)
    assert not opt.state  # keep_search_training=False: the optimizer as it was, before its first step


def test_the_callbacks_search_keeps_nothing_beyond_training_state():
    """The Trainer and Lightning callbacks keep their :class:`PlannedRun` (and its search result) for the whole
    training: it must hold no tensor of the search."""
    model, opt, loader = setup()
    before = live_storages()
    run = plan_model(model, loader, optimizer=opt, loss_fn=ce, config=SearchConfig(**FAST))
    assert run.searched
    assert not (kept := left_behind(before, model, optimizer=opt)), leaked(kept)
    assert all(p.grad is None for p in model.parameters())
    run.restore()


# -- the two measurements that kept graphs ---------------------------------------------------------------

def test_measuring_saved_activations_keeps_no_graph():
    model, _, loader = setup()
    before = live_storages()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 weight copies, saved by the linears
        assert compfx.saved_activation_bytes(model, (loader[0][0],)) > 0
    assert not (kept := new_storages(before)), leaked(kept)


def test_verifying_a_capture_keeps_no_graph():
    model, _, loader = setup()
    before = live_storages()
    graph = compfx.capture(model, loader[0][0], verify=True)  # forward-only replays: no backward frees their graphs
    del graph
    assert not (kept := new_storages(before)), leaked(kept)
