"""Models, data and comparisons the tests share.

The engine's small models each have a way to make a global batch and a per-shard loss: `loss(model, batch,
rank)` is the loss of one rank's shard; a rank-dependent model may branch on `rank`. The single-process truth
for N ranks is the mean over ranks of the shard losses, computed in one process. The Trainer's tests use
`Classifier`/`Tagger` with `classification_data`/`token_data` and `trainer_args`.
"""

from __future__ import annotations

import hashlib
import io
import re
import struct
import zipfile
from typing import Any

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


def save_and_load(obj: Any, weights_only: bool = False) -> Any:
    """`obj` through torch.save and torch.load in memory."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=weights_only)


def fingerprint(module: "torch.nn.Module", buffers: bool = False) -> str:
    """A hash of the parameters (and buffers: they differ between ranks after a forward, until the next)."""
    digest = hashlib.sha256()
    for name, tensor in list(module.named_parameters()) + (list(module.named_buffers()) if buffers else []):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def grads_of(module: "torch.nn.Module") -> dict[str, Any]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def assert_close_grads(got: dict, want: dict, what: str, tol: float = 1e-5) -> None:
    for name in want:
        g, w = got[name], want[name]
        if w is None or g is None:
            assert g is None and w is None, f"{what}: {name} grad None mismatch (got {g is None}, want {w is None})"
            continue
        err = (g - w).abs().max().item()
        assert err <= tol, f"{what}: {name} differs from single-process truth by {err:.3g}"


# -- checkpoints: a small model, its optimizer and schedule, saved by one process -----------------------------------
def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    net[2].weight = nn.Parameter(torch.randn(3, 8))
    return net


def trained_parts(seed: int = 0):
    """small_model after 3 AdamW steps under a LambdaLR schedule: (model, optimizer, scheduler)."""
    model = small_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def save_small(out, step, model, opt=None, sched=None, limit=None, state=None) -> str:
    """ddpkit.checkpoint.files.save_checkpoint in a world of one; the checkpoint's path."""
    from ddpkit.checkpoint import files as checkpoint
    from ddpkit.distributed.comm import Comm
    from ddpkit.distributed.env import single_process_env

    return checkpoint.save_checkpoint(str(out), step, model=model, optimizer=opt, scheduler=sched,
                                      trainer_state=state or {"global_step": step, "log_history": []},
                                      sampler_state={"epoch": 1, "seed": 3, "consumed": 40}, comm=Comm(),
                                      world=single_process_env(), save_total_limit=limit)


def flip_inside(file: str) -> None:
    """Change bytes inside a file's data, keeping its size and its structure: the first tensor's bytes of a
    safetensors file, the first storage record of a torch zip archive, a digit of a JSON file."""
    with open(file, "rb") as f:
        data = bytearray(f.read())
    if file.endswith(".json"):
        at = re.search(rb"\d", data).start()
        data[at] = ord("7") if data[at] != ord("7") else ord("3")
    else:
        if file.endswith(".safetensors"):
            (length,) = struct.unpack("<Q", data[:8])
            at = 8 + length  # the tensors' bytes follow the header
        else:
            with zipfile.ZipFile(file) as archive:
                record = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size >= 4)
            # A zip record's local header: 30 bytes with the name's and the extra field's lengths at 26, then both.
            name, extra = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
            at = record.header_offset + 30 + name + extra
        data[at:at + 4] = bytes(b ^ 0xFF for b in data[at:at + 4])
    with open(file, "r+b") as f:
        f.write(data)


# -- the Trainer's test models and data ----------------------------------------------------------------------------
class Classifier(nn.Module):
    def __init__(self, d_in=6, hidden=16, classes=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Dropout(0.2), nn.Linear(hidden, classes))

    def forward(self, x, labels=None, idx=None):
        logits = self.net(x)
        return {"loss": None if labels is None else F.cross_entropy(logits, labels), "logits": logits}


class Tagger(nn.Module):
    """Per-token classification: padding (label -100) changes nothing, so any batching gives the same sum."""

    def __init__(self, vocab=11, dim=8, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100),
                "logits": logits}


def classification_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return [{"x": x[i], "labels": y[i], "idx": torch.tensor(i)} for i in range(n)]


def token_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 9, (), generator=g))
        ids = torch.randint(1, 11, (length,), generator=g)
        out.append({"input_ids": ids, "labels": ids % 4})
    return out


def pad_collate(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])] = s["input_ids"]
        labels[row, :len(s["labels"])] = s["labels"]
    return {"input_ids": ids, "labels": labels}


class FixedShards(torch.utils.data.Sampler):
    """Rank r reads exactly shards[r]: ranks with different numbers of batches."""

    def __init__(self, shards, rank):
        self.indices, self.epoch, self.consumed = shards[rank], 0, 0

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def state_dict(self):
        return {"epoch": self.epoch, "seed": 0, "consumed": self.consumed}

    def load_state_dict(self, state):
        self.epoch, self.consumed = state["epoch"], state["consumed"]


def trainer_args(out, **kw):
    """TrainingArguments for the small test runs: logs every step, saves nothing, constant learning rate, on the
    CPU (the worlds are gloo's; on a machine with GPUs the Trainer would otherwise pin one per rank)."""
    from ddpkit.args.training_args import TrainingArguments

    base = dict(output_dir=str(out), learning_rate=0.05, logging_steps=1, save_strategy="no", disable_tqdm=True,
                seed=7, ddp_timeout=60, lr_scheduler_type="constant", use_cpu=True)
    return TrainingArguments(**{**base, **kw})


def params_of(model):
    """Parameters as numpy arrays: tensors cannot travel back from a rank through spawn's queue."""
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def accuracy(pred):
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean()),
            "n": float(len(pred.label_ids))}
