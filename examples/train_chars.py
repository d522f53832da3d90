"""A small character-level transformer trained on the Python standard library's own source, with accumulation.

    torchrun --nproc_per_node=2 examples/train_chars.py                           # 2 processes x 4 micro-batches
    torchrun --nproc_per_node=2 examples/train_chars.py --gradient_checkpointing  # recompute activations
    python examples/train_chars.py --max_steps 50 --gradient_accumulation_steps 8 # one process, same global batch
    python examples/train_chars.py --help                                         # every flag

The text is every ``*.py`` file directly in the standard library's folder (it exists wherever Python does), read
as bytes, so the vocabulary is the 256 byte values. The loss starts near ln(256) = 5.5 and falls below 2.5 within
the default 200 steps; the script prints a sample of generated code at the end.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddpkit import ArgumentParser, TrainingArguments, destroy_process_group
from ddpkit.trainer.trainer import Trainer, set_seed

DEFAULTS = dict(output_dir="chars_output", per_device_train_batch_size=16, per_device_eval_batch_size=32,
                gradient_accumulation_steps=4, learning_rate=2e-3, weight_decay=0.1, adam_beta2=0.95,
                max_steps=200, warmup_steps=20, lr_scheduler_type="cosine", logging_steps=10, eval_strategy="steps",
                eval_steps=100, save_steps=100, save_total_limit=2, ddp_find_unused_parameters=False)


@dataclasses.dataclass
class ModelArguments:
    block_size: int = dataclasses.field(default=64, metadata={"help": "Characters of context per sample."})
    d_model: int = dataclasses.field(default=128, metadata={"help": "Width of the transformer."})
    layers: int = dataclasses.field(default=2, metadata={"help": "Transformer blocks."})
    heads: int = dataclasses.field(default=4, metadata={"help": "Attention heads per block."})
    text_bytes: int = dataclasses.field(default=2_000_000, metadata={"help": "Bytes of source text to use."})


class CharTransformer(nn.Module):
    def __init__(self, block_size: int, d_model: int, layers: int, heads: int, vocab: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(block_size, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        self.checkpointing = True

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=x.device)
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, mask, None, True, use_reentrant=False)
            else:
                x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(x))
        out = {"logits": logits}
        if labels is not None:
            # Given the step's item count (the Trainer passes it), the loss is this batch's share of the step's mean,
            # as Transformers models do; without it, the plain mean over this batch's tokens.
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            out["loss"] = loss / (num_items_in_batch if num_items_in_batch is not None else labels.numel())
        return out

    @torch.no_grad()
    def generate(self, prompt: bytes, length: int, block_size: int, temperature: float = 0.8) -> bytes:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        generator = torch.Generator().manual_seed(0)
        for _ in range(length):
            logits = self(ids[:, -block_size:])["logits"][0, -1] / temperature
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=generator)[None]], dim=1)
        return bytes(ids[0].tolist())


def stdlib_text(limit: int) -> bytes:
    folder = os.path.dirname(os.__file__)
    chunks, size = [], 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and size < limit:
            with open(os.path.join(folder, name), "rb") as f:
                chunks.append(f.read())
            size += len(chunks[-1])
    return b"".join(chunks)[:limit]


class Chunks(torch.utils.data.Dataset):
    """Non-overlapping windows of block_size + 1 bytes: input the first block_size, label the next byte of each."""

    def __init__(self, data: torch.Tensor, block_size: int):
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        piece = self.data[i * self.block_size:(i + 1) * self.block_size + 1]
        return {"input_ids": piece[:-1], "labels": piece[1:]}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = ArgumentParser((ModelArguments, TrainingArguments), description=__doc__.split("\n")[0])
    parser.set_defaults(**DEFAULTS)
    margs, args = parser.parse_args_into_dataclasses(argv)
    set_seed(args.seed)
    data = torch.tensor(list(stdlib_text(margs.text_bytes)), dtype=torch.long)
    split = int(len(data) * 0.95)
    train, test = Chunks(data[:split], margs.block_size), Chunks(data[split:], margs.block_size)
    model = CharTransformer(margs.block_size, margs.d_model, margs.layers, margs.heads)
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=test)
    result = trainer.train()
    if trainer.state.should_stop:  # SIGTERM or Ctrl-C: the checkpoint is written; this is not a finished run
        if trainer.world.is_main:
            print(f"stopped at step {result.global_step} of {trainer.state.max_steps}; continue with "
                  f"--resume_from_checkpoint true --output_dir {args.output_dir}")
        destroy_process_group()
        return result.metrics
    # The last step was evaluated already unless the flags turned evaluation off: evaluating again repeats it.
    metrics = trainer.state.evaluation_at(result.global_step) or trainer.evaluate()
    trainer.save_model()
    if trainer.world.is_main:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(f"train loss {losses[0]:.3f} -> {losses[-1]:.3f} over {result.global_step} steps "
              f"({result.metrics['train_runtime']:.0f} s); eval loss {metrics['eval_loss']:.3f}")
        model.eval()
        sample = model.generate(b"def ", 200, margs.block_size)
        print(sample.decode("utf-8", errors="replace"))
    destroy_process_group()
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
