"""Small pieces the optimize-level tests share: losses, a deterministic cost, seeded batches.

The tiny models stay in their test files: each is shaped for what its tests
check (an op that overflows, one that fails in low precision, a norm layer...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: SearchConfig fields for the exact CoMP search (no cost model: every candidate is measured)
EXACT = {"predictor": "off"}


def ce(output, batch):
    """Cross-entropy of logits against the batch's last item (the labels)."""
    return F.cross_entropy(output, batch[-1])


def nll(output, batch):
    """Negative log-likelihood of log-probabilities against the batch's last item."""
    return F.nll_loss(output, batch[-1])


def fp32_op_count(plan, seconds):
    """A device where low precision always pays: fewer FP32 ops is cheaper (constant in the seconds)."""
    return float(sum(p == "fp32" for p in plan.values()))


def batches(n, *shapes, classes=3, seed=0):
    """``n`` seeded batches ``(inputs..., labels)``: one random input per shape, labels for the first dim."""
    g = torch.Generator().manual_seed(seed)
    return [(*(torch.randn(*s, generator=g) for s in shapes), torch.randint(0, classes, (shapes[0][0],), generator=g))
            for _ in range(n)]
