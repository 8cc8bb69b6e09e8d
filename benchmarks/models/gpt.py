"""A GPT-style decoder (nanoGPT layout): pre-LayerNorm blocks, causal SDPA, GELU MLP, tied head."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import data
from .spec import ModelSpec, cross_entropy

__all__ = ["GPT", "GPT_SPEC", "init_transformer_weights"]


def init_transformer_weights(module: nn.Module) -> None:
    """N(0, 0.02) for linears and embeddings, zero biases (BERT and GPT-2 both do this)."""
    for child in module.modules():
        if isinstance(child, (nn.Linear, nn.Embedding)):
            nn.init.normal_(child.weight, std=0.02)
        if isinstance(child, nn.Linear) and child.bias is not None:
            nn.init.zeros_(child.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq_len, dim)
        self.blocks = nn.Sequential(*[DecoderBlock(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.token.weight  # weight tying, as GPT-2 does
        init_transformer_weights(self)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.token(ids) + self.position(positions)
        return self.head(self.ln(self.blocks(x)))


def _example_batch(config, batch_size: int, generator: torch.Generator):
    ids = torch.randint(0, config["vocab"], (batch_size, config["seq_len"] + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _real_batches(config, batch_size: int, n_batches: int, split: str, seed: int):
    return data.char_lm_batches(config["seq_len"], batch_size, n_batches, split, seed)


GPT_SPEC = ModelSpec(
    name="gpt",
    description="GPT-style decoder; paper config = GPT-2 small size (not in the CoMP paper)",
    configs={
        "small": dict(vocab=data.VOCAB_SIZE, seq_len=32, dim=32, heads=2, layers=2, batch_size=4, lr=3e-3),
        "paper": dict(vocab=50304, seq_len=1024, dim=768, heads=12, layers=12, batch_size=8, lr=6e-4),
    },
    build=lambda c: GPT(c["vocab"], c["seq_len"], c["dim"], c["heads"], c["layers"]),
    example_batch=_example_batch, real_batches=_real_batches, loss_fn=cross_entropy,
    metric_name="next_char_accuracy",
    real_data="character LM on Python stdlib source text",
)
