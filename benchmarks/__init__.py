"""Benchmarks for compfx: the CoMP paper's models, data and a runner.

Run from the repository root::

    python -m benchmarks.run --models alexnet_cifar gcn --config small --epochs 1 --batches 4

Layout: ``models/`` (one file per model family, a registry in ``models/__init__``),
``data.py`` (synthetic and packaged real data), ``modes.py`` (FP32 / AMP / compfx),
``memory.py``, ``casts.py`` and ``flops.py`` (what each row measures), ``harness.py`` (one model in
one mode), ``report.py`` (JSON + markdown), ``paper_figures.py`` and ``run.py`` (CLI).

The GPU suite (``python -m benchmarks.gpu_suite``, one command on any machine with a CUDA GPU): ``gpu_env.py`` (the
device and a matmul probe), ``gpu_bench.py`` (the rows and the workers that measure them),
``timebox.py`` (subprocesses stopped at a deadline), ``gpu_report.py`` (markdown, summary lines, the
README section), ``gpu_readme.py`` (rewrites the README's GPU section from the JSON).

The single-purpose benchmarks (``decisions``, ``search_cost``, ``verify_cost``, ``capture_speed``, ``fidelity``,
``guard_cost``, ...) write JSON under ``results/``; ``docs_tables.py`` rewrites the tables of README.md and
docs/*.md from it.
"""
