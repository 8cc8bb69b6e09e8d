"""Search a mixed-precision plan on every rank of a torchrun job, then train with DDP.

    torchrun --nproc_per_node=2 examples/torchrun_search.py              # one plan for all ranks
    torchrun --nproc_per_node=2 examples/torchrun_search.py --per-device --memory-budget 500000 --budget-ranks 1
    python examples/torchrun_search.py                                    # one process, no torch.distributed

Each rank searches on its own shard (DistributedSampler). compfx agrees every
measurement across ranks (mean loss, slowest rank's time), so all ranks reach
the same plan; with ``--per-device`` each rank gets its own plan (QSync's
allocator) within its ``--memory-budget`` (activation bytes per step). The
returned module is then wrapped in DistributedDataParallel and trained. Uses
NCCL and one GPU per rank when CUDA is available, else gloo on CPU.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from compfx import SearchConfig, optimize


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-device", action="store_true", help="let ranks hold different plans")
    parser.add_argument("--memory-budget", type=int, default=None,
                        help="limit on activation bytes saved per step, on the ranks in --budget-ranks")
    parser.add_argument("--budget-ranks", type=int, nargs="*", default=None,
                        help="ranks that have the --memory-budget (default: all), e.g. 1 for one small device")
    parser.add_argument("--search-batches", type=int, default=4, help="batches per Stage-1 epoch on each rank")
    parser.add_argument("--epochs", type=int, default=2, help="DDP training epochs after the search")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--log-dir", default=None, help="write search.rank<r>.jsonl search logs here")
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


def synthetic_data(samples: int = 4096, features: int = 32, classes: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(0)  # the same dataset on every rank; the sampler shards it
    x = torch.randn(samples, features, generator=g)
    y = (x[:, :classes] + 0.5 * torch.randn(samples, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(features: int = 32, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.LayerNorm(256), nn.Linear(256, classes))


def cross_entropy(output, batch):
    return F.cross_entropy(output, batch[-1])


def main(argv=None) -> dict:
    args = parse_args(argv)
    started_here, rank, device = setup()
    try:
        torch.manual_seed(0)  # the same initial model on every rank (compfx and DDP broadcast rank 0's anyway)
        model = make_model().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = synthetic_data()
        sampler = DistributedSampler(data, drop_last=True) if dist.is_initialized() else None
        loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None,
                            drop_last=True)
        # the search walks its batches many times: a short list of this rank's shard, the same length on every rank
        search_batches = [batch for _, batch in zip(range(args.search_batches), loader)]
        limited = args.budget_ranks is None or rank in args.budget_ranks
        config = SearchConfig(progress=rank == 0, per_device=args.per_device,
                              memory_budget=args.memory_budget if limited else None,
                              stage1_budget=16, stage2_budget=8, repeats=3)
        log = os.path.join(args.log_dir, f"search.rank{rank}.jsonl") if args.log_dir else None
        result = optimize(model, search_batches, loss_fn=cross_entropy, optimizer=optimizer, config=config, log=log)
        plan = result.plan.bitstring(result.analysis)
        print(f"[rank {rank}] plan {plan}")
        if rank == 0:
            print(result.report())
        # result.module runs the plan and shares the model's Parameters: the optimizer keeps training it
        trained = DistributedDataParallel(result.module) if dist.is_initialized() else result.module
        loss = train(trained, optimizer, loader, sampler, args.epochs, device)
        print(f"[rank {rank}] final training loss {loss:.4f}")
        return {"rank": rank, "plan": plan, "loss": loss}
    finally:
        if started_here:
            dist.destroy_process_group()


def train(module: nn.Module, optimizer, loader, sampler, epochs: int, device: torch.device) -> float:
    loss = torch.tensor(float("nan"))
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(module(x), y)
            loss.backward()
            optimizer.step()
    return float(loss.detach())


if __name__ == "__main__":
    main()
