"""The models `ddpkit bench` times, each with one rank's fixed batch and its loss.

Batch sizes are per rank, chosen (empirically, 2 CPU cores) so that a step takes a few to a few tens of ms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Few large matrices: all-reduce bandwidth dominates the DDP cost."""

    def __init__(self, width: int = 512, hidden: int = 2048, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


class Transformer(nn.Module):
    """A small causal language model: a few dozen tensors of mixed sizes."""

    def __init__(self, vocab: int = 2000, d_model: int = 128, heads: int = 4, layers: int = 2, length: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(length, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.out(self.norm(self.blocks(h, mask=mask, is_causal=True)))


class CNN(nn.Module):
    """Convolutions with BatchNorm: both wrappers broadcast the running statistics at every forward."""

    def __init__(self, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        for c_in, c_out in ((3, 32), (32, 64), (64, 128)):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                       nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(128, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class ManySmall(nn.Module):
    """500 tiny tensors and little arithmetic, so what each wrapper spends per parameter is what shows."""

    def __init__(self, layers: int = 250, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))  # weight + bias each

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, one rank's fixed batch for it, and its loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    about: str


def _classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _next_token(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _regress(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _tokens(g: torch.Generator, n: int = 8, length: int = 64, vocab: int = 2000):
    seq = torch.randint(0, vocab, (n, length + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload(MLP, lambda g: (torch.randn(32, 512, generator=g), torch.randint(0, 10, (32,), generator=g)),
                    _classify, "4 linear layers, ~6.3M parameters, batch 32"),
    "transformer": Workload(Transformer, _tokens, _next_token, "2 encoder layers, d_model 128, 8 x 64 tokens"),
    "cnn": Workload(CNN, lambda g: (torch.randn(16, 3, 32, 32, generator=g),
                                    torch.randint(0, 10, (16,), generator=g)),
                    _classify, "3 conv+BatchNorm blocks, 16 images 32x32"),
    "many-small": Workload(ManySmall, lambda g: (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)),
                           _regress, "250 linear 16x16 layers = 500 tensors, batch 8"),
}
