"""Small models for the engine tests, each with a way to make a global batch and a per-shard loss.

`loss(model, batch, rank)` is the loss of one rank's shard; a rank-dependent model may branch on `rank`. The
single-process truth for N ranks is the mean over ranks of the shard losses, computed in one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, hidden: int = 32, d_out: int = 5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, d_out))

    def forward(self, x):
        return self.net(x)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class TinyTransformer(nn.Module):
    """A causal language model whose output projection shares the embedding's weight."""

    def __init__(self, vocab: int = 17, d_model: int = 16, heads: int = 2, length: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(length, d_model) * 0.02)
        self.block = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=32, dropout=0.0,
                                                batch_first=True)
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.out(self.norm(self.block(h, src_mask=mask, is_causal=True)))


class Branchy(nn.Module):
    """A shared trunk, a branch only rank 0 takes, a branch only some iterations take and a head never used."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.rank0_branch = nn.Linear(8, 8)
        self.late_branch = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, rank: int = 0, step: int = 0):
        h = torch.tanh(self.trunk(x))
        if rank == 0:
            h = h + torch.tanh(self.rank0_branch(h))
        if step >= 1:
            h = h * torch.sigmoid(self.late_branch(h))
        return self.head(h)


def make(name: str) -> nn.Module:
    return {"mlp": MLP, "convbn": ConvBN, "transformer": TinyTransformer, "branchy": Branchy}[name]()


def batch(name: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)
    if name == "convbn":
        return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    if name == "transformer":
        tokens = torch.randint(0, 17, (n, 7), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    if name == "branchy":
        return torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)
    raise KeyError(name)


def micro(name: str, step: int, micro: int, world_size: int, shard: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's `shard` samples of micro-batch `micro` of step `step`: one batch of shard * world_size cut in
    rank order, so that the ranks together hold what one process trains on."""
    x, y = batch(name, shard * world_size, seed=100 * step + micro)
    return [(x[r * shard:(r + 1) * shard], y[r * shard:(r + 1) * shard]) for r in range(world_size)]


def loss(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    if name == "branchy":
        return F.cross_entropy(model(x, rank=rank, step=step), y)
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def truth_step(name, ref, x, y, world_size, step, shard):
    """One process on the whole batch, backward: the mean over ranks of the shard losses (rank r's shard is
    samples r*shard .. (r+1)*shard)."""
    total = sum(loss(name, ref, x[r * shard:(r + 1) * shard], y[r * shard:(r + 1) * shard], r, step)
                for r in range(world_size))
    (total / world_size).backward()
