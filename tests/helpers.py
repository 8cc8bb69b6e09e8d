"""Small pieces the tests share: losses, a deterministic cost, seeded batches, the warnings compfx causes.

The tiny models stay in their test files: each is shaped for what its tests
check (an op that overflows, one that fails in low precision, a norm layer...).
"""

from __future__ import annotations

import contextlib
import sysconfig
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

#: SearchConfig fields for the exact CoMP search (no cost model: every candidate is measured)
EXACT = {"predictor": False}


def ce(output, batch):
    """Cross-entropy of logits against the batch's last item (the labels)."""
    return F.cross_entropy(output, batch[-1])


def nll(output, batch):
    """Negative log-likelihood of log-probabilities against the batch's last item."""
    return F.nll_loss(output, batch[-1])


def fp32_op_count(plan, seconds):
    """A device where low precision always pays: fewer FP32 ops is cheaper (constant in the seconds)."""
    return float(sum(p == "fp32" for p in plan.values()))


def batches(n, *shapes, classes=3, seed=0):
    """``n`` seeded batches ``(inputs..., labels)``: one random input per shape, labels for the first dim."""
    g = torch.Generator().manual_seed(seed)
    return [(*(torch.randn(*s, generator=g) for s in shapes), torch.randint(0, classes, (shapes[0][0],), generator=g))
            for _ in range(n)]


def forward_and_grads(module, model, inputs):
    """Output and parameter gradients of ``module`` (which shares ``model``'s parameters)."""
    model.zero_grad(set_to_none=True)
    out = module(*inputs)
    out.float().square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def seeded_grads(module, kwargs, *, autocast_dtype=None):
    """Output and parameter grads of one seeded forward and backward (a fixed weighting of the output),
    under ``torch.autocast("cpu", dtype=autocast_dtype)`` when given: how the fidelity tests compare a plan
    with autocast. ``kwargs`` are the keyword arguments of ``module``'s forward."""
    for param in module.parameters():
        param.grad = None
    torch.manual_seed(1234)
    if autocast_dtype is None:
        out = module(**kwargs)
    else:
        with torch.autocast("cpu", dtype=autocast_dtype):
            out = module(**kwargs)
    out = out if isinstance(out, torch.Tensor) else out["logits"]
    (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    # an OptimizedModule (torch.compile) names its model's parameters "_orig_mod.<name>"
    return out.detach(), {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in module.named_parameters()
                          if p.grad is not None}


def assert_bitwise(reference, planned):
    """Two :func:`seeded_grads` results are the same numbers: output (and its dtype) and every parameter grad."""
    (expected, expected_grads), (out, grads) = reference, planned
    assert out.dtype == expected.dtype and torch.equal(out, expected), (
        f"outputs differ: {out.dtype} against {expected.dtype}, by up to "
        f"{(out.float() - expected.float()).abs().max().item():.3g}")
    assert sorted(grads) == sorted(expected_grads)
    differ = [name for name, grad in expected_grads.items() if not torch.equal(grads[name], grad)]
    assert not differ, f"grads differ from autocast's on {len(differ)} of {len(grads)} parameters: {differ[:5]}"


def assert_matches_apply(compiled, model, plan, analysis, inputs, tol):
    """``compiled`` gives the outputs and parameter grads of ``compfx.apply(model, plan)``, within ``tol``."""
    from compfx.planned_module import apply

    out, grads = forward_and_grads(compiled, model, inputs)
    ref_out, ref_grads = forward_and_grads(apply(model, plan, analysis=analysis), model, inputs)
    torch.testing.assert_close(out, ref_out, **tol)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol, msg=lambda m: f"grad of {name}: {m}")


def free_port() -> int:
    """A TCP port nothing listens on now (for a gloo process group's rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(rank_main, world: int, out_dir, timeout_s: float) -> list[dict]:
    """Run ``rank_main(rank, world, port, out_dir)`` in ``world`` spawned processes; each writes
    ``out_dir/<rank>.json``. Returns those results; every process is gone when this returns."""
    import json
    import pathlib
    import time

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=rank_main, args=(r, world, port, str(out_dir)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    assert not hung, f"{len(hung)} rank(s) still running after {timeout_s}s (a collective mismatch?)"
    files = [pathlib.Path(out_dir) / f"{r}.json" for r in range(world)]
    assert all(f.exists() for f in files), f"a rank died without results (exit codes {[p.exitcode for p in procs]})"
    results = [json.loads(f.read_text()) for f in files]
    for r, result in enumerate(results):
        assert "setup" not in result, f"rank {r} could not join the process group:\n{result['setup']['error']}"
    return results


def run_scenarios(rank: int, world: int, port: int, out_dir, scenarios: dict, *, timeout_s: float) -> None:
    """On one spawned rank: join a gloo group, run each of ``scenarios`` (name -> fn(rank, world)), and write
    ``out_dir/<rank>.json`` (each scenario's result or traceback; ``setup`` when the group could not start)."""
    import json
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share this machine's cores
    results = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        for name, scenario in scenarios.items():
            try:
                results[name] = scenario(rank, world)
            except BaseException:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()  # a scenario that failed on one rank only must not shift the next one's collectives
    except BaseException:
        results["setup"] = {"error": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(results, f)
        if dist.is_initialized():
            dist.destroy_process_group()



def _owner_of(filename: str) -> str:
    """Whose code a stack frame runs: "compfx" (its modules, and the graphs it generates), "library" (Python's
    standard library, torch, typing_extensions: code that passes its caller's warning on), or "other"."""
    import compfx
    import compfx.passes
    import typing_extensions

    if filename.startswith("<eval_with_key"):
        return "compfx"
    if filename.startswith("<"):
        return "library"
    path = str(Path(filename).resolve())
    ours = (Path(compfx.__file__).parent, Path(compfx.passes.__file__).parent)
    libraries = (Path(sysconfig.get_paths()["stdlib"]), Path(torch.__file__).parent, Path(typing_extensions.__file__))
    if path.startswith(tuple(str(p.resolve()) for p in ours)):
        return "compfx"
    return "library" if path.startswith(tuple(str(p.resolve()) for p in libraries)) else "other"


def compfx_warning_origin(stack: list[traceback.FrameSummary]) -> str | None:
    """Where compfx caused a warning, or None: the innermost frame of ``stack`` (the warning's) that is not library
    code decides (compfx deep-copying a graph that makes torch warn is compfx's; a model's own warning is not).
    A warning raised while a module is being imported is that module's, whoever imported it (Inductor imports
    ``torch.utils.mkldnn`` on first use, which warns about torch's own ``torch.jit.script_method``)."""
    for frame in reversed(stack):
        if frame.filename.startswith("<frozen importlib"):
            return None
        owner = _owner_of(frame.filename)
        if owner == "compfx":
            return f"{frame.filename}:{frame.lineno}"
        if owner == "other":
            return None
    return None


@contextlib.contextmanager
def warnings_from_compfx():
    """Collect every warning compfx's own code causes (each time, as 'always' would show it, with where compfx
    caused it); the others pass silently."""
    found: list[str] = []

    def collect(message, category, filename, lineno, file=None, line=None):
        origin = compfx_warning_origin(traceback.extract_stack()[:-1])
        if origin is not None:
            found.append(f"{category.__name__}: {message} ({filename}:{lineno}, caused at {origin})")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = collect
        yield found


def _torchao_skip():
    from compfx.float8 import torchao_missing

    missing = torchao_missing()
    return pytest.mark.skipif(missing is not None, reason=f"{missing}: FP8 needs it (pip install compfx[fp8])")


#: Mark for tests that run FP8 ops (torchao's float8 training); they skip, saying why, where torchao is missing.
needs_torchao = _torchao_skip()
