"""The demo behind ``python -m compfx demo``: search a plan for the built-in CNN on scikit-learn digits, then train.

scikit-learn ships the digits data set (1797 8x8 images), so nothing is
downloaded. The run takes well under a minute on a laptop CPU.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import BadInputError
from .examples import cnn
from .optimization import optimize
from .search import SearchConfig, SearchResult

__all__ = ["digits_batches", "run_demo"]


def digits_batches(batch_size: int = 64, seed: int = 0) -> tuple[list, list]:
    """Train and test batches ``(images [B,1,8,8] in [0,1], labels)`` of scikit-learn's digits, shuffled once."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise BadInputError("the demo's data set (digits) ships with scikit-learn, which is not installed; "
                            "run: pip install scikit-learn") from error

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    split = int(0.8 * len(labels))

    def chunk(x, y):
        return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(y) - batch_size + 1, batch_size)]

    return chunk(images[:split], labels[:split]), chunk(images[split:], labels[split:])


def _nll(output, batch):
    return F.nll_loss(output, batch[-1])  # the CNN returns log-probabilities


@torch.no_grad()
def _accuracy(module: nn.Module, batches: list) -> float:
    """Test accuracy of ``module`` in eval mode (BatchNorm's running statistics); its mode is put back after.

    A planned module runs in the model's mode at each call, so eval mode is its own input signature: captured
    once, at the first evaluation, and kept."""
    training = module.training
    module.eval()
    try:
        hits = sum((module(x).argmax(-1) == y).sum().item() for x, y in batches)
    finally:
        module.train(training)
    return hits / sum(len(y) for _, y in batches)


def run_demo(epochs: int = 3, sample_batches: int = 20, batch_size: int = 64, seed: int = 0, log=None,
             progress: bool = True, threads: int | None = 1, print_fn: Callable[[str], None] = print) -> SearchResult:
    """Analyse, search and post-train the digits CNN; print each step. Returns the search's result.

    The search samples the first ``sample_batches`` training batches (its
    "sample loader"); post-training then runs ``epochs`` full epochs with the
    chosen plan, on the same optimizer, and reports test accuracy after each.
    ``threads`` sets torch's intra-op threads for the run (restored after): this
    model is so small that one thread is fastest, and steadier to time on a busy CPU.

    >>> result = run_demo(epochs=1, sample_batches=4, progress=False, print_fn=lambda line: None)
    >>> set(result.plan.values()) <= {"follow", "fp32", "low"}
    True
    """
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(epochs, sample_batches, batch_size, seed, log, progress, print_fn)
    finally:
        torch.set_num_threads(previous_threads)


def _run(epochs, sample_batches, batch_size, seed, log, progress, print_fn) -> SearchResult:
    torch.manual_seed(seed)
    train, test = digits_batches(batch_size, seed)
    model = cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    config = SearchConfig(seed=seed, progress=progress)
    result = optimize(model, train[:sample_batches], loss_fn=_nll, optimizer=optimizer, config=config, log=log)
    fast = result.module
    print_fn(result.analysis.table())
    print_fn(result.analysis.summary())
    print_fn("")
    print_fn(result.report())
    print_fn("")
    print_fn(f"post-training with the chosen plan ({epochs} epochs of {len(train)} batches):")
    for epoch in range(1, epochs + 1):
        losses = []
        for x, y in train:
            optimizer.zero_grad(set_to_none=True)
            loss = _nll(fast(x), (x, y))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        print_fn(f"  epoch {epoch}: train loss {sum(losses) / len(losses):.4f}, "
                 f"test accuracy {_accuracy(fast, test):.3f}")
    return result
