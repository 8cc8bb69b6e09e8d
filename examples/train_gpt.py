"""nanoGPT-style character model on the Python standard library's own source: FP32, AMP and compfx, side by side.

    python examples/train_gpt.py --tiny            # CPU, well under a minute
    python examples/train_gpt.py --device cuda     # GPT-2-small scale (12 layers, 768 wide, 1024 tokens)

It searches a plan with compfx.optimize on the first batches, then trains the same
initial model three times for the same steps on the same batches: FP32,
AMP (torch.autocast, plus GradScaler for fp16) and compfx's plan, and prints
tokens per second and the last loss of each. On a CPU without bf16 units
low precision is slow, so compfx keeps FP32 where it costs time; the
speed-ups of mixed precision need a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sysconfig
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 128  # ASCII characters
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


TINY = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd), CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.Sequential(*(Block(config) for _ in range(config.n_layer)))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.wte(idx) + self.wpe(positions))
        return self.lm_head(self.ln_f(x))


def lm_loss(logits, batch):
    """Next-character cross-entropy; ``batch`` is ``(inputs, targets)``."""
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), batch[-1].view(-1))


def stdlib_text(max_chars: int) -> str:
    """Source text that ships with Python: the standard library's own modules, ASCII only."""
    folder = sysconfig.get_paths()["stdlib"]
    text = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8", errors="ignore") as file:
                text.append(file.read())
        if sum(map(len, text)) >= max_chars:
            break
    return "".join(text).encode("ascii", errors="ignore").decode()[:max_chars]


def batches(text: str, count: int, batch_size: int, block_size: int, device, seed: int = 0) -> list:
    data = torch.tensor([ord(c) for c in text], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([data[s:s + block_size] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
        out.append((x.to(device), y.to(device)))
    return out


def train(model, optimizer, data, *, autocast_dtype=None, scaler=None) -> tuple[float, float]:
    """Train on ``data``; (tokens per second, last loss). The nanoGPT loop: autocast + GradScaler for AMP."""
    device = data[0][0].device
    tokens, start, loss = 0, None, torch.tensor(float("nan"))
    for step, batch in enumerate(data):
        if step == 1:  # the first step warms up (allocations, a planned module's capture)
            _sync(device)
            start, tokens = time.perf_counter(), 0
        context = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                   else contextlib.nullcontext())
        with context:
            loss = lm_loss(model(batch[0]), batch)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        tokens += batch[0].numel()
    _sync(device)
    return tokens / (time.perf_counter() - start), loss.item()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and a few steps: a CPU run in seconds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run")
    parser.add_argument("--search-batches", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--log", default=None, help="write the search log here (compfx report LOG prints it)")
    args = parser.parse_args(argv)
    config = TINY if args.tiny else GPTConfig()
    steps = args.steps or (8 if args.tiny else 200)
    search_batches = args.search_batches or (2 if args.tiny else 16)
    batch_size = args.batch_size or (8 if args.tiny else 12)
    device = torch.device(args.device)
    low_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    if args.tiny:
        torch.set_num_threads(min(2, torch.get_num_threads()))

    text = stdlib_text(100_000 if args.tiny else 20_000_000)
    search_data = batches(text, search_batches, batch_size, config.block_size, device, seed=1)
    train_data = batches(text, steps, batch_size, config.block_size, device, seed=2)
    torch.manual_seed(0)
    initial = GPT(config).to(device)
    print(f"GPT: {config.n_layer} layers, {config.n_embd} wide, {config.block_size} tokens, "
          f"{sum(p.numel() for p in initial.parameters()) / 1e6:.2f} M parameters; {len(text):,} characters of "
          f"stdlib source; {device}")

    model = copy.deepcopy(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    search = compfx.SearchConfig(progress=not args.tiny, keep_search_training=False,
                                 **({"repeats": 1, "warmup": 0, "stage1_budget": 4, "stage2_budget": 2,
                                     "predictor": "off"} if args.tiny else {}))
    result = compfx.optimize(model, search_data, optimizer=optimizer, loss_fn=lm_loss, low_dtype=low_dtype,
                             config=search, log=args.log)
    plan = result.plan.bitstring(result.analysis)
    print(f"compfx plan {plan} ('0' {low_dtype}, '1' fp32, 'f' follow), searched in {result.search_seconds:.1f} s")

    rows = []
    for name in ("fp32", "amp", "compfx"):
        run_model = model if name == "compfx" else copy.deepcopy(initial)
        run_optimizer = optimizer if name == "compfx" else torch.optim.AdamW(run_model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(device.type) if name == "amp" and low_dtype == torch.float16 else None
        tokens_per_s, loss = train(result.module if name == "compfx" else run_model, run_optimizer, train_data,
                                   autocast_dtype=low_dtype if name == "amp" else None, scaler=scaler)
        rows.append((name, tokens_per_s, loss))
    fp32_speed = rows[0][1]
    print(f"{'run':8} {'tokens/s':>12} {'x FP32':>8} {'last loss':>10}")
    for name, tokens_per_s, loss in rows:
        print(f"{name:8} {tokens_per_s:12,.0f} {tokens_per_s / fp32_speed:8.2f} {loss:10.4f}")
    if not all(math.isfinite(loss) for _, _, loss in rows):
        raise SystemExit("a run's loss is not finite")


if __name__ == "__main__":
    main()
