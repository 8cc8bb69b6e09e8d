"""Benchmarks for compfx: the CoMP paper's models, data and a runner.

Run from the repository root::

    python -m benchmarks.run --models alexnet_cifar gcn --config small --epochs 1 --batches 4

Layout: ``models/`` (one file per model family, a registry in ``models/__init__``),
``data.py`` (synthetic and packaged real data), ``modes.py`` (FP32 / AMP / compfx),
``memory.py`` and ``casts.py`` (what each row measures), ``harness.py`` (one model in
one mode), ``report.py`` (JSON + markdown), ``paper_figures.py`` and ``run.py`` (CLI).
"""
