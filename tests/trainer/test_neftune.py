"""ddpkit.trainer.neftune: Transformers' neftune_noise_alpha. The noise has the bits of Transformers' hook for the same
random state; the Trainer adds it while training only (evaluation and the model after train() see clean
embeddings), and a model without input embeddings is refused by name."""

from __future__ import annotations

import pytest
import torch

from ddpkit.errors import ArgumentError
from ddpkit.trainer.neftune import input_embeddings, noisy_embeddings
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, trainer_args


def gpt2():
    import transformers

    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_the_noise_has_the_bits_of_transformers_hook():
    from transformers.integrations.neftune import neftune_post_forward_hook

    model, ids = gpt2(), torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    embeddings = input_embeddings(model)
    clean = embeddings(ids)
    with noisy_embeddings(model, 5.0):
        torch.manual_seed(2)
        ours = embeddings(ids)
        embeddings.eval()
        assert torch.equal(embeddings(ids), clean)  # evaluation: no noise
        embeddings.train()
    embeddings.neftune_noise_alpha = 5.0
    handle = embeddings.register_forward_hook(neftune_post_forward_hook)
    torch.manual_seed(2)
    theirs = embeddings(ids)
    handle.remove()
    assert torch.equal(ours, theirs) and not torch.equal(ours, clean)
    bound = 5.0 / (7 * 16) ** 0.5
    assert (ours - clean).abs().max() <= bound and (ours - clean).abs().max() > bound / 2
    assert torch.equal(embeddings(ids), clean) and not embeddings._forward_hooks  # gone after the block


def test_the_trainer_trains_with_noisy_embeddings_and_leaves_them_clean(tmp_path, local_world):
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (8, 8), generator=g)]
    found = {}
    for alpha in (None, 5.0):
        model = gpt2()
        args = trainer_args(tmp_path / str(alpha), max_steps=3, per_device_train_batch_size=4,
                            neftune_noise_alpha=alpha)
        trainer = Trainer(model, args, train_dataset=data, eval_dataset=data)
        trainer.train()
        assert not input_embeddings(model)._forward_hooks
        found[alpha] = ([p.detach().clone() for p in model.parameters()], trainer.evaluate()["eval_loss"],
                        trainer.evaluate()["eval_loss"])
    assert any(not torch.equal(a, b) for a, b in zip(found[None][0], found[5.0][0]))  # the noise trained it
    assert found[5.0][1] == found[5.0][2]  # evaluation is deterministic: no noise there
    with pytest.raises(ArgumentError, match="neftune_noise_alpha: needs the model's input embeddings"):
        Trainer(Classifier(), trainer_args(tmp_path / "plain", neftune_noise_alpha=5.0),
                train_dataset=classification_data(8)).train()
