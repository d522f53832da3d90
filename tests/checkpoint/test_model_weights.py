"""ddpkit.checkpoint.model_weights: a model's weights to one safetensors file and back, tied weights once, views of one buffer too."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from ddpkit.checkpoint.model_weights import load_weights_file, save_weights_file


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mid, self.out = nn.Embedding(5, 3), nn.Linear(3, 3), nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight  # one tensor, two names
        self.register_buffer("scale", torch.arange(3.0))
        self.empty = nn.Parameter(torch.empty(0))  # no memory: never "tied" to another empty tensor
        self.other_empty = nn.Parameter(torch.empty(0, 2))


def _flatten(model):
    """Every parameter made a view of one flat buffer, as parameters_as_bucket_view does; the buffer."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    at = 0
    for p in params:
        view = flat[at:at + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        at += p.numel()
    return flat


def _keys_and_metadata(path):
    with safe_open(path, "pt") as f:
        return sorted(f.keys()), f.metadata()


def test_tied_weights_are_stored_as_safetensors_save_model_stores_them_and_load_either_way(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
    save_weights_file(model, ours)
    save_model(model, theirs)
    assert _keys_and_metadata(ours) == _keys_and_metadata(theirs)
    assert _keys_and_metadata(ours)[1] == {"out.weight": "embed.weight"}
    for path, load in ((ours, load_model), (theirs, load_weights_file)):
        torch.manual_seed(1)
        fresh = Tied()
        missing, unexpected = load(fresh, path)
        assert not missing and not unexpected
        assert fresh.out.weight is fresh.embed.weight
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_views_of_one_buffer_are_saved_and_loaded_back_into_the_views(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    _flatten(model)
    path = str(tmp_path / "flat.safetensors")
    with pytest.raises(RuntimeError, match="None is covering the entire storage"):
        save_model(model, str(tmp_path / "refused.safetensors"))  # what this module is for
    save_weights_file(model, path)
    assert _keys_and_metadata(path)[1] == {"out.weight": "embed.weight"}
    torch.manual_seed(1)
    fresh = Tied()
    flat = _flatten(fresh)
    before = flat.clone()
    assert load_weights_file(fresh, path) == ([], [])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert not torch.equal(flat, before) and torch.equal(fresh.mid.weight.detach().reshape(-1),
                                                         flat[15:24]), "loaded in place: still views of the buffer"
    plain = Tied()
    load_weights_file(plain, path)  # and into a model of separate tensors
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_missing_unexpected_and_misshapen_weights_are_named(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_weights_file(nn.Linear(3, 2), path)
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "0.bias", "0.weight"\n.*'
                                           'Unexpected key\\(s\\) in state_dict: "bias", "weight"'):
        load_weights_file(nn.Sequential(nn.Linear(3, 2)), path)
    assert load_weights_file(nn.Sequential(nn.Linear(3, 2)), path, strict=False) == (
        ["0.bias", "0.weight"], ["bias", "weight"])
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_weights_file(nn.Linear(4, 2), path)
