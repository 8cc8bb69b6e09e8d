"""Built-in example models for the CLI demo and the docs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["mlp", "cnn", "drifting", "gpt"]


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


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(width), _Attention(width, heads), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A nanoGPT-style decoder whose GEMMs are ``nn.Linear`` s (what torchao's float8 conversion swaps): token ids
    ``(batch, length)`` in, logits over ``vocab`` tokens out."""

    def __init__(self, layers: int = 2, width: int = 32, heads: int = 2, length: int = 16, vocab: int = 64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.Sequential(*(_Block(width, heads) for _ in range(layers)))
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.lm_head(self.ln_f(self.blocks(x)))


def gpt(layers: int = 2, **sizes) -> nn.Module:
    """A tiny GPT (:class:`TinyGPT`): every dim a multiple of 16, so its linears can run FP8.

    >>> gpt(layers=2)(torch.randint(0, 64, (2, 16))).shape
    torch.Size([2, 16, 64])
    """
    return TinyGPT(layers, **sizes)
