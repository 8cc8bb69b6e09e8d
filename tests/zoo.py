"""A zoo of small models shared by the tests: name -> (factory, example inputs).

Each entry is tiny so the whole suite stays fast on a 2-core CPU.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.head(torch.flatten(x, 1))


class EncoderBlock(nn.Module):
    """Transformer encoder block; attention by hand (matmul/softmax) or with SDPA."""

    def __init__(self, dim: int = 16, heads: int = 2, sdpa: bool = False):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, 4 * dim)
        self.ff2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.0)

    def attention(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
            out = torch.matmul(scores.softmax(dim=-1), v)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.drop(self.attention(self.ln1(x)))
        return x + self.drop(self.ff2(F.gelu(self.ff1(self.ln2(x)))))


class MHAModel(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.out = nn.Linear(dim, 4)

    def forward(self, x):
        y, _ = self.attn(x, x, x)
        return self.out(y)


class NativeMHA(nn.Module):
    """nn.MultiheadAttention's fused fast path, ``torch._native_multi_head_attention``, which has no derivative.
    ``weights=True`` returns its (output, weights) tuple whole, as the fast path does; otherwise the output alone."""

    def __init__(self, weights: bool = True):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.weights = weights

    def forward(self, x):
        m = self.mha
        out = torch._native_multi_head_attention(x, x, x, 16, 2, m.in_proj_weight, m.in_proj_bias,
                                                 m.out_proj.weight, m.out_proj.bias, None, self.weights, True, 1)
        return out if self.weights else out[0]


class EmbedGRU(nn.Module):
    def __init__(self, vocab: int = 20, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        y, _ = self.gru(self.embed(ids))
        return self.head(y)


class ShapeBranch(nn.Module):
    """Branches on its input: 4-d inputs are pooled first, 2-d inputs go straight to the head."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        if x.dim() == 4:
            x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        if x.shape[-1] > 4:
            x = torch.sigmoid(self.fc(x))
        return self.head(x)


def _ids(*shape, high=20):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(0))


def _randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


#: name -> (model factory, example-inputs factory)
ZOO = {
    "mlp": (MLP, lambda: (_randn(4, 16),)),
    "cnn": (CNN, lambda: (_randn(2, 3, 16, 16),)),
    "encoder_matmul": (lambda: EncoderBlock(sdpa=False), lambda: (_randn(2, 8, 16),)),
    "encoder_sdpa": (lambda: EncoderBlock(sdpa=True), lambda: (_randn(2, 8, 16),)),
    "mha": (MHAModel, lambda: (_randn(2, 8, 16),)),
    "embed_gru": (EmbedGRU, lambda: (_ids(2, 6),)),
    "shape_branch": (ShapeBranch, lambda: (_randn(2, 8, 4, 4),)),
}


def make(name: str, seed: int = 0):
    """A fresh zoo model (seeded weights) and its example inputs."""
    factory, inputs = ZOO[name]
    torch.manual_seed(seed)
    return factory(), inputs()
