"""The tiny GPT the plan-rules, export and training-stack tests share (:class:`compfx.examples.TinyGPT`: nanoGPT-style,
its GEMMs ``nn.Linear`` s, which torchao's float8 conversion swaps), with its loss and batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compfx.examples import TinyGPT

VOCAB = 64


def lm_loss(logits, batch):
    """Next-token cross-entropy; ``batch`` is ``(tokens, targets)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[-1].reshape(-1))


def token_batches(count: int, batch: int = 2, length: int = 16, seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (batch, length + 1), generator=generator) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def tiny_gpt(layers: int = 2, seed: int = 0, **sizes) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(layers, **sizes)
