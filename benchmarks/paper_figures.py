"""The CoMP paper's own figures, quoted for the rows our benchmarks match.

Source: the CoMP paper (/work/shared/seeds/*comp-paper.txt), Sect. 4:

* Table 4: time per epoch (s) on A100 and RTX 4090, CV and NLP models;
* Table 5: time per epoch (ms) of the GNNs on the same GPUs (stored here in seconds);
* Table 6: peak GPU memory (MB); the paper does not say on which of the two GPUs;
* Table 7: top-1 accuracy (%) after 100 epochs; F1 for BERT-base; for the GAN,
  the discriminator's accuracy, where 50% is best.

Modes are FP32, AMP (PyTorch autocast + GradScaler) and CoMP (the paper's method,
our "compfx" mode). ``None`` where the paper has no figure (e.g. the RTX 4090 ran
out of memory on GAT/Reddit). Setups differ from ours (PyTorch 2.3.1, DGL for
the GNNs, real CIFAR-100/ImageNet/MNIST/Cora/Reddit/SQuAD, 100 epochs).

>>> paper_figures("AlexNet", "CIFAR-100", "compfx")["time_a100_s"]
3.65
>>> paper_figures("GAT", "Reddit", "fp32")["time_rtx4090_s"] is None  # OOM on the RTX 4090
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

__all__ = ["PaperRow", "PAPER_ROWS", "paper_figures", "PAPER_MODE"]

PAPER_MODE = {"fp32": "FP32", "amp": "AMP", "compfx": "CoMP"}
_Triple = tuple  # (FP32, AMP, CoMP)


@dataclass(frozen=True)
class PaperRow:
    model: str
    dataset: str
    time_a100_s: _Triple | None
    time_rtx4090_s: _Triple | None
    peak_memory_mb: _Triple | None
    accuracy_pct: _Triple | None
    accuracy_kind: str = "top-1 accuracy"
    source: str = "Tables 4, 6, 7"


def _ms(*values):
    return tuple(None if v is None else round(v / 1000, 8) for v in values)


_ROWS = [
    PaperRow("AlexNet", "CIFAR-100", (4.54, 3.84, 3.65), (2.17, 2.15, 2.09), (797.80, 485.31, 340.64),
             (61.97, 61.90, 62.55)),
    PaperRow("AlexNet", "ImageNet", (1363.08, 1345.41, 1340.06), (1383.36, 1340.39, 1329.90),
             (1698.54, 1463.80, 1084.58), (63.37, 62.07, 62.78)),
    PaperRow("Vgg16", "CIFAR-100", (8.32, 5.08, 4.42), (3.89, 2.53, 2.29), (1227.38, 813.91, 578.46),
             (70.04, 70.88, 70.12)),
    PaperRow("Vgg16", "ImageNet", (4346.02, 2895.72, 2792.61), (3671.21, 2287.73, 2281.51),
             (17201.88, 10368.68, 9430.84), (72.40, 72.37, 72.36)),
    PaperRow("GAN", "MNIST", (11.77, 11.71, 11.51), (3.56, 3.52, 3.29), (37.77, 37.77, 27.65),
             (49.95, 49.95, 48.79), "discriminator accuracy (50% is best)"),
    PaperRow("GAN", "ImageNet", (2014.56, 1804.22, 1825.80), (1398.75, 1299.09, 1303.87), (613.26, 613.26, 462.14),
             (49.91, 49.95, 49.95), "discriminator accuracy (50% is best)"),
    PaperRow("BERT-base", "SQuADv2.0", (1.53, 0.83, 0.80), (1.37, 0.93, 0.90), (4997.26, 3910.80, 3724.78),
             (88.50, 88.20, 88.00), "F1 score"),
    PaperRow("GCN", "Cora", _ms(0.68, 0.71, 0.68), _ms(0.30, 0.31, 0.29), (54.41, 56.83, 54.38),
             (79.50, 79.50, 79.60), source="Tables 5, 6, 7"),
    PaperRow("GAT", "Cora", _ms(1.03, 1.12, 1.02), _ms(0.55, 0.53, 0.55), (130.04, 108.48, 108.48),
             (82.20, 81.20, 81.90), source="Tables 5, 6, 7"),
    PaperRow("GCN", "Reddit", _ms(8.27, 7.82, 7.79), _ms(5.37, 4.38, 4.90), (6709.75, 6709.75, 6709.75),
             (94.31, 94.30, 94.27), source="Tables 5, 6, 7"),
    PaperRow("GAT", "Reddit", _ms(186.16, 155.50, 155.21), _ms(None, 71.11, 70.76), (26620.03, 16025.70, 16001.81),
             (78.34, 77.02, 77.02), source="Tables 5, 6, 7"),
]

PAPER_ROWS: Mapping[tuple[str, str], PaperRow] = {(row.model, row.dataset): row for row in _ROWS}


def _pick(triple, mode: str):
    return None if triple is None else triple[("fp32", "amp", "compfx").index(mode)]


def paper_figures(model: str, dataset: str, mode: str) -> dict | None:
    """The paper's figures for one (model, dataset) row in one of our modes; None if the paper has no row."""
    row = PAPER_ROWS.get((model, dataset))
    if row is None or mode not in PAPER_MODE:
        return None
    return {
        "paper_row": f"{model} / {dataset} ({PAPER_MODE[mode]})",
        "time_a100_s": _pick(row.time_a100_s, mode),
        "time_rtx4090_s": _pick(row.time_rtx4090_s, mode),
        "peak_memory_mb": _pick(row.peak_memory_mb, mode),
        "accuracy_pct": _pick(row.accuracy_pct, mode),
        "accuracy_kind": row.accuracy_kind,
        "source": row.source,
    }
