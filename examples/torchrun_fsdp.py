"""Search a mixed-precision plan on a model sharded with FSDP2 (``fully_shard`` per block), then train it.

    torchrun --nproc_per_node=2 examples/torchrun_fsdp.py     # gloo on CPU; NCCL, one GPU per rank, when CUDA is there
    python examples/torchrun_fsdp.py                          # one process, no sharding

The order matters: the blocks are planned first (``compfx.plan_blocks(...,
blocks=(Block,))`` replaces each block in the model by a PlannedBlock
holding the same Parameters), then ``fully_shard`` goes on each block and on
the root, as for any FSDP2 model, then ``compfx.optimize(model, ...,
per_module=(Block,))`` searches on the sharded model itself: each sample
trains it, all-gathers included, and the ranks agree on every measurement
(mean loss, slowest rank's time), so they reach one plan. The model keeps
training in the same structure afterwards.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import compfx


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search-batches", type=int, default=4, help="batches per Stage-1 epoch on each rank")
    parser.add_argument("--steps", type=int, default=20, help="training steps after the search")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2)
    return parser.parse_args(argv)


def setup() -> tuple[bool, int, torch.device]:
    """Join the torchrun job if launched by torchrun (or already joined); returns (we_initialised, rank, device)."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    started_here = launched and not dist.is_initialized()
    if started_here:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return started_here, rank, device


class Block(nn.Module):
    """A pre-norm MLP block: the unit that FSDP2 shards and compfx plans."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, features: int = 32, width: int = 64, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(count: int, batch_size: int, rank: int, device: torch.device, features: int = 32, classes: int = 10):
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, as a DistributedSampler would give
    out = []
    for _ in range(count):
        x = torch.randn(batch_size, features, generator=g)
        out.append((x.to(device), x[:, :classes].argmax(dim=1).to(device)))
    return out


def cross_entropy(output, batch):
    return F.cross_entropy(output, batch[-1])


def main(argv=None) -> dict:
    args = parse_args(argv)
    started_here, rank, device = setup()
    try:
        torch.manual_seed(0)  # the same initial model on every rank
        model = Net(width=args.width, blocks=args.blocks).to(device)
        search_batches = batches(args.search_batches, args.batch_size, rank, device)
        # 1. plan the blocks (FP32 to start with): each becomes a PlannedBlock in place, holding the same Parameters
        analysis = compfx.analyze(model, search_batches[0][0])
        compfx.plan_blocks(model, compfx.Plan.fp32(analysis), analysis=analysis, blocks=(Block,))
        # 2. shard as for any FSDP2 model: each block, then the root
        if dist.is_initialized():
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # 3. search on the sharded model; every rank reaches the same plan
        config = compfx.SearchConfig(progress=rank == 0, stage1_budget=8, stage2_budget=4, repeats=2, warmup=1,
                                     cache_plan=False)
        result = compfx.optimize(model, search_batches, loss_fn=cross_entropy, optimizer=optimizer, config=config,
                                 per_module=(Block,))
        plan = result.plan.bitstring(result.analysis)
        print(f"[rank {rank}] plan {plan}")
        # 4. train: result.module is the model itself, its blocks running the plan, still sharded
        loss = train(result.module, optimizer, batches(args.steps, args.batch_size, rank, device))
        print(f"[rank {rank}] final training loss {loss:.4f}")
        return {"rank": rank, "plan": plan, "loss": loss, "same_model": result.module is model}
    finally:
        if started_here:
            dist.destroy_process_group()


def train(module: nn.Module, optimizer, data) -> float:
    loss = torch.tensor(float("nan"))
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        optimizer.step()
    return float(loss.detach())


if __name__ == "__main__":
    main()
