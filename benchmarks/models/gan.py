"""The paper's GAN at MNIST's 28x28: a DCGAN-style generator and discriminator, two optimizers.

``GAN.forward(z)`` returns ``(discriminator logits on G(z), G(z))``, so one
forward serves the generator's step and hands the fakes to the discriminator's
step. The step trains the generator first, then the discriminator on real images
and the detached fakes (one G forward per step; the same order in every mode).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import data
from .spec import ModelSpec, SearchTarget

__all__ = ["Generator", "Discriminator", "GAN", "GAN_MNIST"]


class Generator(nn.Module):
    def __init__(self, latent: int, width: int):
        super().__init__()
        self.width = width
        self.project = nn.Linear(latent, 2 * width * 7 * 7)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 4, 2, 1)  # 7 -> 14
        self.up2 = nn.ConvTranspose2d(width, 1, 4, 2, 1)  # 14 -> 28

    def forward(self, z):
        x = F.relu(self.project(z)).reshape(z.shape[0], 2 * self.width, 7, 7)
        return torch.tanh(self.up2(F.relu(self.up1(x))))


class Discriminator(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 4, 2, 1)  # 28 -> 14
        self.conv2 = nn.Conv2d(width, 2 * width, 4, 2, 1)  # 14 -> 7
        self.head = nn.Linear(2 * width * 7 * 7, 1)

    def forward(self, images):
        x = F.leaky_relu(self.conv2(F.leaky_relu(self.conv1(images), 0.2)), 0.2)
        return self.head(torch.flatten(x, 1))


class GAN(nn.Module):
    def __init__(self, latent: int, width: int):
        super().__init__()
        self.generator = Generator(latent, width)
        self.discriminator = Discriminator(width)

    def forward(self, z):
        fake = self.generator(z)
        return self.discriminator(fake), fake


def _bce(logits: torch.Tensor, real: bool) -> torch.Tensor:
    logits = logits.float()
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, float(real)))


def generator_loss(output, batch) -> torch.Tensor:
    """Non-saturating generator loss: the discriminator should call the fakes real."""
    return _bce(output[0], True)


def discriminator_loss(output, batch) -> torch.Tensor:
    """Discriminator-only batches are ``(images, is_real)``."""
    return F.binary_cross_entropy_with_logits(output.float(), batch[-1])


def _nets(model: GAN):
    return {"stack": model, "discriminator": model.discriminator}


def _optimizers(model: GAN, config):
    adam = lambda module: torch.optim.Adam(module.parameters(), lr=config.get("lr", 2e-4), betas=(0.5, 0.999))
    return {"generator": adam(model.generator), "discriminator": adam(model.discriminator)}


def _train_step(spec, nets, optimizers, batch, precision) -> torch.Tensor:
    z, real = batch
    g_opt, d_opt = optimizers["generator"], optimizers["discriminator"]
    g_opt.zero_grad(set_to_none=True)
    with precision.autocast():
        fake_logits, fake = nets["stack"](z)
        g_loss = generator_loss((fake_logits, fake), batch)
    precision.backward(g_loss)
    precision.step(g_opt)
    d_opt.zero_grad(set_to_none=True)  # drop what g_loss left in the discriminator's grads
    with precision.autocast():
        d_loss = (_bce(nets["discriminator"](real), True) + _bce(nets["discriminator"](fake.detach()), False)) / 2
    precision.backward(d_loss)
    precision.step(d_opt)
    precision.update()
    return d_loss.detach()


def _discriminator_batches(nets, batches):
    """``(real + fake images, is_real)`` batches for searching the discriminator alone."""
    out = []
    with torch.no_grad():
        for z, real in batches:
            fake = nets["stack"].generator(z)  # called before any search: still the eager GAN
            is_real = torch.cat([torch.ones(len(real), 1), torch.zeros(len(fake), 1)]).to(real.device)
            out.append((torch.cat([real, fake]), is_real))
    return out


def _search_targets(spec, nets, optimizers, batches):
    """Two searches: generator+discriminator stack with G's optimizer, then the discriminator alone."""
    d_batches = _discriminator_batches(nets, batches)
    return [SearchTarget("stack", "generator", batches, generator_loss),
            SearchTarget("discriminator", "discriminator", d_batches, discriminator_loss)]


def _cast_forwards(nets, batch):
    z, real = batch
    return [(nets["stack"], (z,)), (nets["discriminator"], (real,))]


def _evaluate_forward(model: GAN, batch):
    z, real = batch
    return model.discriminator(real), model.discriminator(model.generator(z))


def discriminator_accuracy(output, batch) -> float:
    """How often D tells real (logit > 0) from fake; the paper reads 50% as the ideal."""
    real_logits, fake_logits = output
    right = torch.cat([real_logits > 0, fake_logits <= 0])
    return float(right.float().mean())


def _example_batch(config, batch_size: int, generator: torch.Generator):
    z = torch.randn(batch_size, config["latent"], generator=generator)
    return z, torch.rand(batch_size, 1, 28, 28, generator=generator) * 2 - 1


def _real_batches(config, batch_size: int, n_batches: int, split: str, seed: int):
    images, labels = data.digits(split, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(len(real), config["latent"], generator=gen), real)
            for real, _ in data.image_batches(images, labels, batch_size, n_batches, seed, 28, 1)]


GAN_MNIST = ModelSpec(
    name="gan_mnist",
    description="DCGAN-style GAN at 28x28 (MNIST shape); generator + discriminator, two Adams",
    configs={
        "small": dict(latent=16, width=8, batch_size=8, lr=2e-4),
        "paper": dict(latent=100, width=64, batch_size=156, lr=2e-4),  # the paper's batch size for GAN
    },
    build=lambda c: GAN(c["latent"], c["width"]),
    example_batch=_example_batch, real_batches=_real_batches, loss_fn=generator_loss,
    metric_name="discriminator_accuracy", metric=discriminator_accuracy,
    paper_rows={"paper": ("GAN", "MNIST")},
    real_data="sklearn digits resized to 28x28",
    make_nets=_nets, make_optimizers=_optimizers, train_step=_train_step,
    search_targets=_search_targets, cast_forwards=_cast_forwards, evaluate_forward=_evaluate_forward,
)
