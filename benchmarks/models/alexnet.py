"""AlexNet (Krizhevsky et al. 2012) at CIFAR's 32x32 and ImageNet's 224x224.

The 224 version is torchvision's layout (11x11/4 stem, adaptive 6x6 pool). The
32 version keeps the five convolutions and three linears but uses a 3x3 stride-1
stem and 2x2 pools, as CIFAR ports of AlexNet do. No BatchNorm, as in the original.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import data
from .spec import ModelSpec, cross_entropy

__all__ = ["AlexNet", "ALEXNET_CIFAR", "ALEXNET_IMAGENET"]

_PAPER_CHANNELS = (64, 192, 384, 256, 256)
_SMALL_CHANNELS = (8, 16, 24, 16, 16)


class AlexNet(nn.Module):
    def __init__(self, channels=_PAPER_CHANNELS, hidden: int = 4096, num_classes: int = 1000,
                 image_size: int = 224, dropout: float = 0.5):
        super().__init__()
        c1, c2, c3, c4, c5 = channels
        imagenet = image_size >= 64
        stem = nn.Conv2d(3, c1, 11, stride=4, padding=2) if imagenet else nn.Conv2d(3, c1, 3, padding=1)
        pool = (lambda: nn.MaxPool2d(3, 2)) if imagenet else (lambda: nn.MaxPool2d(2))
        self.features = nn.Sequential(
            stem, nn.ReLU(inplace=True), pool(),
            nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(inplace=True), pool(),
            nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c4, c5, 3, padding=1), nn.ReLU(inplace=True), pool(),
        )
        grid = 6 if imagenet else image_size // 8
        self.pool = nn.AdaptiveAvgPool2d(grid)
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(c5 * grid * grid, hidden), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def _build(config) -> AlexNet:
    return AlexNet(config["channels"], config["hidden"], config["num_classes"], config["image_size"])


def image_example_batch(config, batch_size: int, generator: torch.Generator):
    """Random images and labels at the config's shape (shared by the image classifiers)."""
    size = config["image_size"]
    images = torch.randn(batch_size, 3, size, size, generator=generator)
    return images, torch.randint(0, config["num_classes"], (batch_size,), generator=generator)


def digits_batches(config, batch_size: int, n_batches: int, split: str, seed: int):
    """scikit-learn digits resized to the config's input (shared by the image classifiers)."""
    images, labels = data.digits(split, seed)
    return data.image_batches(images, labels, batch_size, n_batches, seed, config["image_size"], 3)


def _spec(name: str, image_size: int, num_classes: int, paper_batch: int, dataset: str) -> ModelSpec:
    return ModelSpec(
        name=name,
        description=f"AlexNet, {image_size}x{image_size} input ({dataset} shape)",
        configs={
            "small": dict(channels=_SMALL_CHANNELS, hidden=64, num_classes=10, image_size=image_size,
                          batch_size=4 if image_size < 64 else 2),
            "paper": dict(channels=_PAPER_CHANNELS, hidden=4096, num_classes=num_classes, image_size=image_size,
                          batch_size=paper_batch),
        },
        build=_build, example_batch=image_example_batch, real_batches=digits_batches, loss_fn=cross_entropy,
        paper_rows={"paper": ("AlexNet", dataset)},
        real_data=f"sklearn digits resized to {image_size}x{image_size}",
    )


# The paper trains AlexNet with batch size 156 on CIFAR-100 and ImageNet.
ALEXNET_CIFAR = _spec("alexnet_cifar", 32, 100, 156, "CIFAR-100")
ALEXNET_IMAGENET = _spec("alexnet_imagenet", 224, 1000, 156, "ImageNet")
