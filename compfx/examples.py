"""Built-in example models for the CLI demo and the docs."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["mlp", "cnn", "drifting"]


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


class Drifting(nn.Module):
    """A softmax written out by hand, ``exp(fc(x) * gain)`` normalised, then a linear head.

    ``gain`` is a buffer the training loop can grow to make activations drift:
    with ``fc``'s outputs about 1-3 in size, ``exp`` leaves fp16's range
    (65504, at 11.1) once ``gain`` passes about 6, and FP32's only past about 45.
    """

    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 4):
        super().__init__()
        self.fc, self.head = nn.Linear(features, hidden), nn.Linear(hidden, classes)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x):
        e = torch.exp(self.fc(x) * self.gain)
        return self.head(e / e.sum(-1, keepdim=True))


def drifting() -> nn.Module:
    return Drifting()
