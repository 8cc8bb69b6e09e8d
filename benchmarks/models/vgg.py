"""VGG16 (Simonyan & Zisserman 2014) at CIFAR's 32x32 and ImageNet's 224x224.

Configuration "D" (13 convolutions, 3 linears), no BatchNorm as in the original
and torchvision's ``vgg16``. At 32x32 the classifier sees a 1x1 grid (CIFAR ports
use one 512-wide hidden layer; we keep the paper's three linears for both).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .alexnet import digits_batches, image_example_batch
from .spec import ModelSpec, cross_entropy

__all__ = ["VGG16", "VGG16_CIFAR", "VGG16_IMAGENET"]

_PAPER_STAGES = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))
_SMALL_STAGES = ((4, 2), (8, 2), (16, 3), (16, 3), (16, 3))
_SMALL_STAGES_224 = ((2, 2), (4, 2), (8, 3), (8, 3), (8, 3))  # 224x224 in bf16 on a CPU is slow


class VGG16(nn.Module):
    def __init__(self, stages=_PAPER_STAGES, hidden: int = 4096, num_classes: int = 1000,
                 image_size: int = 224, dropout: float = 0.5):
        super().__init__()
        layers, in_channels = [], 3
        for width, convs in stages:
            for _ in range(convs):
                layers += [nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(inplace=True)]
                in_channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        grid = 7 if image_size >= 64 else image_size // 32
        self.pool = nn.AdaptiveAvgPool2d(grid)
        self.classifier = nn.Sequential(
            nn.Linear(in_channels * grid * grid, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def _build(config) -> VGG16:
    return VGG16(config["stages"], config["hidden"], config["num_classes"], config["image_size"])


def _spec(name: str, image_size: int, num_classes: int, dataset: str, small_batch: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        description=f"VGG16, {image_size}x{image_size} input ({dataset} shape)",
        configs={
            "small": dict(stages=_SMALL_STAGES if image_size < 64 else _SMALL_STAGES_224, hidden=64, num_classes=10, image_size=image_size,
                          batch_size=small_batch),
            # The paper trains VGG16 with batch size 128.
            "paper": dict(stages=_PAPER_STAGES, hidden=4096, num_classes=num_classes, image_size=image_size,
                          batch_size=128),
        },
        build=_build, example_batch=image_example_batch, real_batches=digits_batches, loss_fn=cross_entropy,
        paper_rows={"paper": ("Vgg16", dataset)},
        real_data=f"sklearn digits resized to {image_size}x{image_size}",
    )


VGG16_CIFAR = _spec("vgg16_cifar", 32, 100, "CIFAR-100", 4)
VGG16_IMAGENET = _spec("vgg16_imagenet", 224, 1000, "ImageNet", 1)
