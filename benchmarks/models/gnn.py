"""GCN (Kipf & Welling 2016) and GAT (Velickovic et al. 2017) on a dense adjacency, in pure torch.

Both take ``(features (N, F), adjacency (N, N))``; the adjacency is the
normalised one from benchmarks/data.py (GCN multiplies by it, GAT uses its
non-zero pattern as the attention mask). Full-batch training: one step per epoch,
as in the paper's Cora runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import data
from .spec import ModelSpec, cross_entropy

__all__ = ["GCN", "GAT", "GCN_SPEC", "GAT_SPEC"]


class GraphConv(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x, adjacency):
        return torch.matmul(adjacency, self.linear(x))


class GCN(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_classes: int, dropout: float = 0.5):
        super().__init__()
        self.conv1, self.conv2 = GraphConv(in_features, hidden), GraphConv(hidden, num_classes)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, adjacency):
        x = F.relu(self.conv1(self.drop(x), adjacency))
        return self.conv2(self.drop(x), adjacency)


class GraphAttention(nn.Module):
    """Multi-head graph attention: e_ij = LeakyReLU(a_src.h_i + a_dst.h_j), softmax over neighbours j."""

    def __init__(self, in_features: int, out_features: int, heads: int):
        super().__init__()
        self.heads, self.out_features = heads, out_features
        self.linear = nn.Linear(in_features, heads * out_features, bias=False)
        self.att_src = nn.Parameter(torch.randn(heads, 1, out_features) * 0.1)
        self.att_dst = nn.Parameter(torch.randn(heads, 1, out_features) * 0.1)
        self.bias = nn.Parameter(torch.zeros(heads * out_features))

    def forward(self, x, adjacency):
        n = x.shape[0]
        h = self.linear(x).reshape(n, self.heads, self.out_features).transpose(0, 1)  # (H, N, F)
        score_src = (h * self.att_src).sum(-1)  # (H, N)
        score_dst = (h * self.att_dst).sum(-1)
        scores = F.leaky_relu(score_src.unsqueeze(2) + score_dst.unsqueeze(1), 0.2)  # (H, N, N)
        scores = scores.masked_fill(adjacency.unsqueeze(0) == 0, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), h)  # (H, N, F)
        return out.transpose(0, 1).reshape(n, self.heads * self.out_features) + self.bias


class GAT(nn.Module):
    def __init__(self, in_features: int, hidden: int, heads: int, num_classes: int, dropout: float = 0.6):
        super().__init__()
        self.att1 = GraphAttention(in_features, hidden, heads)
        self.att2 = GraphAttention(hidden * heads, num_classes, 1)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, adjacency):
        x = F.elu(self.att1(self.drop(x), adjacency))
        return self.att2(self.drop(x), adjacency)


def _graph(config, seed: int) -> data.Graph:
    if config.get("real_graph") == "karate":
        return data.karate_graph(config["in_features"], seed)
    return data.block_model_graph(config["num_nodes"], config["num_classes"], config["in_features"], seed)


def _example_batch(config, batch_size: int, generator: torch.Generator):
    """A random graph at the config's size (seeded block model with random labels' centroids)."""
    graph = data.block_model_graph(config["num_nodes"], config["num_classes"], config["in_features"],
                                   seed=int(generator.initial_seed()))
    return data.graph_batch(graph, "train")


def _real_batches(config, batch_size: int, n_batches: int, split: str, seed: int):
    return [data.graph_batch(_graph(config, seed), split)]


# Cora's shape: 2,708 nodes, 1,433 features, 7 classes; karate club: 34 members, 2 clubs.
_SMALL = dict(num_nodes=34, in_features=34, num_classes=2, real_graph="karate", batch_size=1, lr=1e-2)
_CORA = dict(num_nodes=2708, in_features=1433, num_classes=7, real_graph="block_model", batch_size=1, lr=5e-3)
_REAL_DATA = "karate club from networkx (small); seeded block model at Cora's size (paper)"

GCN_SPEC = ModelSpec(
    name="gcn",
    description="2-layer GCN on a dense normalised adjacency",
    configs={"small": dict(_SMALL, hidden=16), "paper": dict(_CORA, hidden=16)},
    build=lambda c: GCN(c["in_features"], c["hidden"], c["num_classes"]),
    example_batch=_example_batch, real_batches=_real_batches, loss_fn=cross_entropy,
    full_batch=True, paper_rows={"paper": ("GCN", "Cora")}, real_data=_REAL_DATA,
)

GAT_SPEC = ModelSpec(
    name="gat",
    description="2-layer GAT on a dense adjacency mask",
    configs={"small": dict(_SMALL, hidden=8, heads=2), "paper": dict(_CORA, hidden=8, heads=8)},
    build=lambda c: GAT(c["in_features"], c["hidden"], c["heads"], c["num_classes"]),
    example_batch=_example_batch, real_batches=_real_batches, loss_fn=cross_entropy,
    full_batch=True, paper_rows={"paper": ("GAT", "Cora")}, real_data=_REAL_DATA,
)
