"""A nanoGPT-style decoder whose GEMMs are ``nn.Linear`` s (torchao's float8 conversion swaps those), small enough for
the CPU: the model the plan-rules, export and training-stack tests share."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(width), Attention(width, heads), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2, width: int = 32, heads: int = 2, length: int = 16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(length, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.lm_head(self.ln_f(self.blocks(x)))


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
