"""A ResNet-18-style CNN for CIFAR (He et al. 2016): 3x3 stem, four stages of basic blocks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .alexnet import digits_batches, image_example_batch
from .spec import ModelSpec, cross_entropy

__all__ = ["ResNet", "BasicBlock", "RESNET"]


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks=(2, 2, 2, 2), widths=(64, 128, 256, 512), num_classes: int = 100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages, in_channels = [], widths[0]
        for index, (count, width) in enumerate(zip(blocks, widths)):
            for block in range(count):
                stride = 2 if index > 0 and block == 0 else 1
                stages.append(BasicBlock(in_channels, width, stride))
                in_channels = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


RESNET = ModelSpec(
    name="resnet",
    description="ResNet-18-style CNN, 32x32 input (not in the CoMP paper)",
    configs={
        "small": dict(blocks=(1, 1, 1, 1), widths=(8, 16, 16, 32), num_classes=10, image_size=32, batch_size=4),
        "paper": dict(blocks=(2, 2, 2, 2), widths=(64, 128, 256, 512), num_classes=100, image_size=32,
                      batch_size=128),
    },
    build=lambda config: ResNet(config["blocks"], config["widths"], config["num_classes"]),
    example_batch=image_example_batch, real_batches=digits_batches, loss_fn=cross_entropy,
    real_data="sklearn digits resized to 32x32",
)
