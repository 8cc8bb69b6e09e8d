"""Registry of benchmark models: name -> :class:`~benchmarks.models.spec.ModelSpec`.

>>> from benchmarks.models import MODELS, get_spec
>>> sorted(MODELS)[:3]
['alexnet_cifar', 'alexnet_imagenet', 'bert_squad']
>>> get_spec("gcn").configs["paper"]["num_nodes"]
2708
"""

from __future__ import annotations

from .alexnet import ALEXNET_CIFAR, ALEXNET_IMAGENET
from .bert import BERT_SQUAD
from .gan import GAN_MNIST
from .gnn import GAT_SPEC, GCN_SPEC
from .gpt import GPT_SPEC
from .resnet import RESNET
from .spec import ModelSpec, SearchTarget
from .vgg import VGG16_CIFAR, VGG16_IMAGENET

__all__ = ["MODELS", "get_spec", "ModelSpec", "SearchTarget"]

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ALEXNET_CIFAR, ALEXNET_IMAGENET, VGG16_CIFAR, VGG16_IMAGENET, GAN_MNIST, BERT_SQUAD,
    GCN_SPEC, GAT_SPEC, RESNET, GPT_SPEC,
)}


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise KeyError(f"unknown benchmark model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name]
