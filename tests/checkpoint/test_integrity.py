"""Checkpoint integrity (ddpkit.checkpoint.integrity): every file's CRC-32 in the completion marker catches a corruption that
keeps the file's size and structure, which sizes alone let through to the loader; markers without checksums (an
older ddpkit's format 1) and folders without a marker still load."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint import folders
from ddpkit.checkpoint import integrity
from helpers.models import flip_inside, save_small, small_model, trained_parts

# Files whose data a disk error could flip unnoticed: tensors' bytes, and JSON that still parses.
CORRUPTIBLE = ("model.safetensors", "optimizer.pt", "rng_state_0.pth", "trainer_state.json", "sampler_state.json")


def _optimizer():
    return torch.optim.AdamW(small_model().parameters())


def test_a_same_size_corruption_fails_its_checksum_and_older_markers_still_load(tmp_path):
    model, opt, sched = trained_parts()
    for name in CORRUPTIBLE:
        out = tmp_path / name
        good = save_small(out, 1, model, opt, sched)
        bad = save_small(out, 2, model, opt, sched)
        marker = integrity.read_marker(bad)
        assert marker["format"] == 2 and marker["step"] == 2 and set(marker["crc32"]) == set(marker["files"])
        file = os.path.join(bad, name)
        size = os.path.getsize(file)
        flip_inside(file)
        assert os.path.getsize(file) == size
        wrong = integrity.problems(bad)
        assert len(wrong) == 1 and wrong[0].startswith(f"{name} fails its checksum"), (name, wrong)
        with pytest.raises(ckpt.CheckpointError, match=f"checkpoint-2 cannot be loaded: {re.escape(name)} fails "
                                                       "its checksum"):
            ckpt.load_checkpoint(bad, model=small_model(), optimizer=_optimizer(), scheduler=sched)
        with pytest.warns(RuntimeWarning, match=rf"corrupt checkpoint \S*checkpoint-2: {re.escape(name)} fails its "
                                                r"checksum .*resuming from \S*checkpoint-1"):
            assert folders.find_latest_checkpoint(str(out)) == good
    # Back-compat: a marker of sizes only (format 1, what ddpkit wrote before checksums) and no marker at all (an
    # even older ddpkit's checkpoint-<step>) still load; a format-2 marker must have every file's checksum.
    shutil.rmtree(bad)

    def loads() -> None:
        fresh, fresh_opt = small_model(seed=5), _optimizer()
        assert integrity.problems(good) == [] and folders.find_latest_checkpoint(str(tmp_path / name)) == good
        assert ckpt.load_checkpoint(good, model=fresh, optimizer=fresh_opt).step == 1
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))

    names = [n for n in os.listdir(good) if n != integrity.MARKER_FILE]
    older = integrity.manifest(good, names, 1)
    assert older["format"] == 1 and "crc32" not in older
    ckpt.write_json(os.path.join(good, integrity.MARKER_FILE), older)
    loads()
    os.remove(os.path.join(good, integrity.MARKER_FILE))
    loads()
    partial = integrity.manifest(good, names, 1, crc32={n: 0 for n in names})
    partial["crc32"].pop("model.safetensors")
    ckpt.write_json(os.path.join(good, integrity.MARKER_FILE), partial)
    assert integrity.problems(good) == [
        "checkpoint_complete.json cannot be read (format 2 without a checksum for every file)"]


def test_a_quota_or_a_full_disk_in_the_writers_own_words_is_named(tmp_path):
    from ddpkit.checkpoint.integrity import write_failure

    for words in ("Disk quota exceeded (os error 122)", "No space left on device (os error 28)"):
        assert write_failure(RuntimeError(words), str(tmp_path)).startswith("no space left on device: "), words
    assert write_failure(RuntimeError("something else"), str(tmp_path)) == "RuntimeError: something else"
