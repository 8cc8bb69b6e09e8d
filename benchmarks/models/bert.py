"""A BERT-base-style encoder with a SQuAD-style QA head (start/end logits over the sequence).

Post-LayerNorm encoder layers with attention written out (linear, matmul,
softmax, matmul), as in BERT; the QA head is one linear to two logits per token.
The model returns ``(B, 2, T)``: start and end logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import data
from .gpt import init_transformer_weights
from .spec import ModelSpec

__all__ = ["BertQA", "BERT_SQUAD", "span_loss", "exact_match"]


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ff: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.attn_out = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ff1, self.ff2 = nn.Linear(dim, ff), nn.Linear(ff, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def _split_heads(self, x):
        b, t, d = x.shape
        return x.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self._split_heads(self.query(x)), self._split_heads(self.key(x)), self._split_heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        context = torch.matmul(self.drop(scores.softmax(dim=-1)), v).transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.drop(self.attn_out(context)))
        return self.ln2(x + self.drop(self.ff2(F.gelu(self.ff1(x)))))


class BertQA(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, heads: int, layers: int, ff: int, dropout: float = 0.1):
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq_len, dim)
        self.ln = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.Sequential(*[EncoderLayer(dim, heads, ff, dropout) for _ in range(layers)])
        self.qa = nn.Linear(dim, 2)
        init_transformer_weights(self)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.ln(self.token(ids) + self.position(positions)))
        return self.qa(self.layers(x)).transpose(1, 2)  # (B, 2, T): start and end logits


def span_loss(output: torch.Tensor, batch) -> torch.Tensor:
    """Mean of the start and end cross-entropies, as in BERT's SQuAD fine-tuning."""
    spans, logits = batch[-1], output.float()
    return (F.cross_entropy(logits[:, 0], spans[:, 0]) + F.cross_entropy(logits[:, 1], spans[:, 1])) / 2


def exact_match(output: torch.Tensor, batch) -> float:
    """Share of questions whose predicted start AND end are both right."""
    return float((output.argmax(-1) == batch[-1]).all(-1).float().mean())


def _example_batch(config, batch_size: int, generator: torch.Generator):
    ids = torch.randint(0, config["vocab"], (batch_size, config["seq_len"]), generator=generator)
    starts = torch.randint(0, config["seq_len"] - 8, (batch_size,), generator=generator)
    return ids, torch.stack([starts, starts + 7], dim=1)


def _real_batches(config, batch_size: int, n_batches: int, split: str, seed: int):
    return data.span_qa_batches(config["seq_len"], batch_size, n_batches, split, seed)


BERT_SQUAD = ModelSpec(
    name="bert_squad",
    description="BERT-base-style encoder with a QA head, SQuAD-shaped inputs",
    configs={
        "small": dict(vocab=data.VOCAB_SIZE, seq_len=48, dim=32, heads=2, layers=2, ff=64, dropout=0.0,
                      batch_size=4, lr=1e-3),
        # BERT-base: 12 layers, 768 wide, 12 heads; SQuAD's usual 384-token window; the paper's batch 16.
        "paper": dict(vocab=30522, seq_len=384, dim=768, heads=12, layers=12, ff=3072, dropout=0.1,
                      batch_size=16, lr=3e-5),
    },
    build=lambda c: BertQA(c["vocab"], c["seq_len"], c["dim"], c["heads"], c["layers"], c["ff"], c["dropout"]),
    example_batch=_example_batch, real_batches=_real_batches, loss_fn=span_loss,
    metric_name="exact_match", metric=exact_match,
    paper_rows={"paper": ("BERT-base", "SQuADv2.0")},
    real_data="span extraction on Python stdlib source text (question = a substring of the context)",
)
