"""Built-in example models for the CLI demo and the docs."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["mlp", "cnn"]


def mlp(in_features: int = 64, hidden: int = 128, classes: int = 10) -> nn.Module:
    """A two-layer MLP classifier."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 single-channel images (scikit-learn digits)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x):
        return self.head(self.features(x)).log_softmax(-1)


def cnn(classes: int = 10) -> nn.Module:
    return DigitsCNN(classes)
