"""Data for the benchmarks: nothing is downloaded.

* Speed figures use synthetic tensors at the paper's shapes (each model spec's
  ``example_batch``).
* Accuracy figures use real data that ships with an installed package:

  - images: scikit-learn's digits (1,797 8x8 greyscale digits), resized to the
    model's input size and repeated over its channels;
  - text: the source code of a few standard-library modules, as ASCII
    characters (vocabulary 128), for a character-level LM and a span-extraction
    task shaped like SQuAD;
  - graphs: networkx's karate club (34 nodes, 2 clubs), or a seeded stochastic
    block model at Cora's size.

Every batch is a tuple ``(inputs..., target)``, the batch format that
``compfx.optimize`` documents. Splits are fixed by a seed.

>>> images, labels = digits(split="train")
>>> [tuple(x.shape) for x, y in image_batches(images, labels, batch_size=4, n_batches=2, size=32, channels=3)]
[(4, 3, 32, 32), (4, 3, 32, 32)]
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

__all__ = [
    "Batch", "digits", "resize_images", "image_batches", "stdlib_text", "encode_ascii", "char_lm_batches",
    "span_qa_batches", "Graph", "karate_graph", "block_model_graph", "graph_batch",
    "VOCAB_SIZE", "IGNORE_INDEX",
]

Batch = tuple  # (inputs..., target)
VOCAB_SIZE = 128  # ASCII
IGNORE_INDEX = -100  # cross_entropy's default: nodes outside a split carry no loss
_SEP, _PAD = 1, 0  # control characters that do not occur in source text
_TEXT_MODULES = ("textwrap", "string", "difflib", "argparse", "json.decoder", "fractions")


def _split_indices(n: int, split: str, seed: int, train_share: float = 0.8) -> torch.Tensor:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cut = int(n * train_share)
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}; expected 'train' or 'eval'")
    return order[:cut] if split == "train" else order[cut:]


# -- images -------------------------------------------------------------------
@lru_cache(maxsize=4)  # the runner asks for the same split once per mode; callers index (copy), never mutate
def digits(split: str = "train", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits: ``(N, 1, 8, 8)`` float images in [-1, 1] and their labels (0-9)."""
    from sklearn.datasets import load_digits  # ships its data with the wheel

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    index = _split_indices(len(labels), split, seed)
    return (images[index] - 0.5) / 0.5, labels[index]  # [-1, 1]: the range a tanh generator produces too


def resize_images(images: torch.Tensor, size: int, channels: int) -> torch.Tensor:
    """Bilinear resize to ``size`` x ``size`` and repeat the grey channel ``channels`` times."""
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return images.expand(-1, channels, -1, -1).contiguous()


def image_batches(images: torch.Tensor, labels: torch.Tensor, batch_size: int, n_batches: int | None = None,
                  seed: int = 0, size: int | None = None, channels: int = 1) -> list[Batch]:
    """Shuffled ``(images, labels)`` batches, each resized to ``size`` (resizing per batch keeps 224x224
    data small); the last partial batch is dropped (fixed shapes)."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    starts = range(0, len(labels) - batch_size + 1, batch_size)[:n_batches]
    resize = (lambda x: resize_images(x, size, channels)) if size else (lambda x: x)
    return [(resize(images[order[i:i + batch_size]]), labels[order[i:i + batch_size]]) for i in starts]


# -- text ---------------------------------------------------------------------
@lru_cache(maxsize=4)
def stdlib_text(modules: tuple[str, ...] = _TEXT_MODULES) -> str:
    """Source text of a few standard-library modules (ships with every Python)."""
    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in modules)


def encode_ascii(text: str) -> torch.Tensor:
    """Characters -> ids in ``[0, 128)``; anything else becomes ``'?'``."""
    data = text.encode("ascii", errors="replace")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def _text_split(tokens: torch.Tensor, split: str) -> torch.Tensor:
    # Contiguous split (last 10% held out) so eval windows never overlap training ones.
    cut = int(len(tokens) * 0.9)
    return tokens[:cut] if split == "train" else tokens[cut:]


def _window_starts(n_tokens: int, window: int, count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, n_tokens - window, (count,), generator=torch.Generator().manual_seed(seed))


def char_lm_batches(seq_len: int, batch_size: int, n_batches: int, split: str = "train",
                    seed: int = 0) -> list[Batch]:
    """Next-character prediction on :func:`stdlib_text`: ``(ids, next_ids)``, both ``(B, T)``."""
    tokens = _text_split(encode_ascii(stdlib_text()), split)
    starts = _window_starts(len(tokens), seq_len + 1, n_batches * batch_size, seed)
    windows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
    return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous())
            for chunk in windows.split(batch_size)]


def span_qa_batches(seq_len: int, batch_size: int, n_batches: int, split: str = "train", seed: int = 0,
                    question_len: int = 8) -> list[Batch]:
    """Extractive QA shaped like SQuAD: find where the question's text occurs in the context.

    Input ids are ``question (padded) + [SEP] + context``; the target is ``(B, 2)``
    holding the answer's start and end positions in the input.
    """
    tokens = _text_split(encode_ascii(stdlib_text()), split)
    context_len = seq_len - question_len - 1
    gen = torch.Generator().manual_seed(seed)
    starts = _window_starts(len(tokens), context_len, n_batches * batch_size, seed)
    rows, targets = [], []
    for start in starts.tolist():
        context = tokens[start:start + context_len]
        length = int(torch.randint(4, question_len + 1, (1,), generator=gen))
        offset = int(torch.randint(0, context_len - length + 1, (1,), generator=gen))
        question = torch.full((question_len,), _PAD, dtype=torch.long)
        question[:length] = context[offset:offset + length]
        rows.append(torch.cat([question, torch.tensor([_SEP]), context]))
        first = question_len + 1 + offset
        targets.append(torch.tensor([first, first + length - 1]))
    ids, spans = torch.stack(rows), torch.stack(targets)
    return list(zip(ids.split(batch_size), spans.split(batch_size)))


# -- graphs -------------------------------------------------------------------
@dataclass(frozen=True)
class Graph:
    """Node features, normalised dense adjacency (self loops included), labels, split."""

    features: torch.Tensor  # (N, F)
    adjacency: torch.Tensor  # (N, N), D^-1/2 (A + I) D^-1/2 as in Kipf & Welling
    labels: torch.Tensor  # (N,)
    train_mask: torch.Tensor  # (N,) bool

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1


def _normalised_adjacency(adjacency: torch.Tensor) -> torch.Tensor:
    with_loops = ((adjacency + torch.eye(len(adjacency))) > 0).float()
    inv_sqrt_degree = with_loops.sum(1).rsqrt()
    return inv_sqrt_degree[:, None] * with_loops * inv_sqrt_degree[None, :]


def _train_mask(n: int, seed: int, share: float) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[_split_indices(n, "train", seed, share)] = True
    return mask


def karate_graph(num_features: int = 34, seed: int = 0) -> Graph:
    """Zachary's karate club from networkx: predict each member's club; one-hot node features."""
    import networkx as nx  # ships the graph with the package

    g = nx.karate_club_graph()
    n = g.number_of_nodes()
    adjacency = torch.tensor(nx.to_numpy_array(g, nodelist=range(n)) > 0, dtype=torch.float32)
    labels = torch.tensor([0 if g.nodes[i]["club"] == "Mr. Hi" else 1 for i in range(n)])
    features = torch.zeros(n, num_features)
    features[torch.arange(n), torch.arange(n) % num_features] = 1.0
    return Graph(features, _normalised_adjacency(adjacency), labels, _train_mask(n, seed, 0.5))


def block_model_graph(num_nodes: int, num_classes: int, num_features: int, seed: int = 0,
                      mean_degree_in: float = 3.0, mean_degree_out: float = 1.0) -> Graph:
    """Seeded stochastic block model: one block per class; features are noisy class centroids.

    Cora-like by default (mean degree ~4). The centroids are weak, so the graph helps.
    """
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_nodes) % num_classes
    block_size = num_nodes / num_classes
    same = labels[:, None] == labels[None, :]
    p = torch.where(same, mean_degree_in / block_size, mean_degree_out / num_nodes)
    upper = torch.triu((torch.rand(num_nodes, num_nodes, generator=gen) < p).float(), diagonal=1)
    centroids = torch.randn(num_classes, num_features, generator=gen) * 0.5
    features = centroids[labels] + torch.randn(num_nodes, num_features, generator=gen)
    return Graph(features, _normalised_adjacency(upper + upper.T), labels, _train_mask(num_nodes, seed, 0.3))


def graph_batch(graph: Graph, split: str = "train") -> Batch:
    """Full-graph batch ``(features, adjacency, target)``; nodes outside ``split`` are ignored."""
    in_split = graph.train_mask if split == "train" else ~graph.train_mask
    target = torch.where(in_split, graph.labels, torch.full_like(graph.labels, IGNORE_INDEX))
    return graph.features, graph.adjacency, target
