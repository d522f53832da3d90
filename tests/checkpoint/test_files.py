"""Checkpoints: round trip, safe loading, rotation, every rank's RNG, and atomicity under SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint import folders
from ddpkit.checkpoint import integrity, rng_state
from ddpkit.distributed.comm import Comm
from helpers.models import save_small, small_model, trained_parts
from helpers.world import run_world


def test_round_trip_restores_everything(tmp_path):
    model, opt, sched = trained_parts()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_small(tmp_path, 3, model, opt, sched)
    expected = (random.random(), np.random.rand(), torch.rand(2))
    assert os.path.basename(path) == "checkpoint-3"
    assert sorted(os.listdir(path)) == ["checkpoint_complete.json", "model.safetensors", "optimizer.pt",
                                        "rng_state.pth", "rng_state_0.pth", "sampler_state.json", "scheduler.pt",
                                        "trainer_state.json"]

    fresh, fresh_opt, fresh_sched = trained_parts(seed=9)
    loaded = ckpt.load_checkpoint(folders.find_latest_checkpoint(str(tmp_path)), model=fresh, optimizer=fresh_opt,
                                  scheduler=fresh_sched)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert fresh_sched.last_epoch == sched.last_epoch == 3
    assert loaded.step == 3 and loaded.trainer_state["global_step"] == 3 and loaded.saved_world_size == 1
    assert loaded.sampler_state == {"epoch": 1, "seed": 3, "consumed": 40}
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    rng_state.set_rng_state(loaded.rng_state)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(2), expected[2])


def test_the_optimizer_state_is_read_onto_the_cpu_whatever_the_training_device(tmp_path):
    """torch's Optimizer.load_state_dict moves each state to its parameter's device but leaves Adam's `step` where
    the file was read to: read onto a GPU it would cost host syncs at every step. (meta stands in for a GPU.)"""
    import types

    model, opt, sched = trained_parts()
    path = save_small(tmp_path, 3, model, opt, sched)
    fresh, fresh_opt, _ = trained_parts(seed=9)
    ckpt.load_checkpoint(path, optimizer=fresh_opt, world=types.SimpleNamespace(device=torch.device("meta"), rank=0))
    assert {state["step"].device.type for state in fresh_opt.state.values()} == {"cpu"}


def _remark(path: str) -> None:
    """Rewrite a checkpoint's completion marker for the files as they are now."""
    names = [n for n in os.listdir(path) if n != integrity.MARKER_FILE]
    ckpt.write_json(os.path.join(path, integrity.MARKER_FILE), integrity.manifest(path, names, 0))


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_loading_never_unpickles_code(tmp_path, monkeypatch):
    model, opt, sched = trained_parts()
    path = save_small(tmp_path, 1, model, opt, sched)
    monkeypatch.chdir(tmp_path)
    # The attacker rewrites the completion marker too, so the files pass the size checks and reach the loader.
    torch.save({"state": {}, "param_groups": [], "evil": _Payload()}, os.path.join(path, "optimizer.pt"))
    _remark(path)
    with pytest.raises(ckpt.CheckpointError, match="optimizer.pt") as caught:
        ckpt.load_checkpoint(path, model=small_model(), optimizer=torch.optim.AdamW(small_model().parameters()))
    assert isinstance(caught.value.__cause__, pickle.UnpicklingError)
    torch.save({"state": {}, "param_groups": [], "evil": _Payload()}, os.path.join(path, "scheduler.pt"))
    _remark(path)
    with pytest.raises(ckpt.CheckpointError, match="scheduler.pt") as caught:
        ckpt.load_checkpoint(path, scheduler=sched)
    assert isinstance(caught.value.__cause__, pickle.UnpicklingError)
    assert not os.path.exists(tmp_path / "pwned")


def test_rotation_and_resave(tmp_path):
    model = small_model()
    for step in (1, 2, 3, 4):
        save_small(tmp_path, step, model, limit=2)
    assert [os.path.basename(p) for p in folders.list_checkpoints(str(tmp_path))] == ["checkpoint-3", "checkpoint-4"]
    save_small(tmp_path, 4, model, limit=2, state={"global_step": 4, "again": True})  # a second save of one step
    assert ckpt.load_checkpoint(str(tmp_path / "checkpoint-4")).trainer_state["again"] is True
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-4"]
    with pytest.raises(FileNotFoundError):
        ckpt.load_checkpoint(str(tmp_path / "checkpoint-9"))


def test_a_checkpoint_renamed_by_hand_loads_when_named_and_is_never_found_or_rotated(tmp_path):
    model, opt, sched = trained_parts()
    out = tmp_path / "out"
    save_small(out, 1, model, opt, sched)
    save_small(out, 500, model, opt, sched)
    save_small(out, 7, model, state={"log_history": []})  # no global_step: the step is the marker's
    os.rename(out / "checkpoint-500", tmp_path / "best_run")  # mv out/checkpoint-500 best_run
    os.rename(out / "checkpoint-7", out / "kept")
    fresh, fresh_opt, fresh_sched = trained_parts(seed=9)
    loaded = ckpt.load_checkpoint(str(tmp_path / "best_run"), model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert loaded.step == 500 and loaded.trainer_state["global_step"] == 500 and fresh_sched.last_epoch == 3
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    assert ckpt.load_checkpoint(str(out / "kept") + "/").step == 7
    # Finding, listing, sweeping and rotation go by the checkpoint-<step> name only.
    assert folders.list_checkpoints(str(out)) == [str(out / "checkpoint-1")]
    assert folders.find_latest_checkpoint(str(out)) == str(out / "checkpoint-1")
    save_small(out, 2, model, limit=1)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "kept"]
    # Without a completion marker (an older ddpkit's folder) a renamed folder cannot be told from any other.
    os.remove(tmp_path / "best_run" / integrity.MARKER_FILE)
    with pytest.raises(FileNotFoundError, match="best_run is not a finished checkpoint folder"):
        ckpt.load_checkpoint(str(tmp_path / "best_run"), model=small_model())


def _killed_save(out: str, ready: str) -> None:
    model = small_model()
    save_small(out, 1, model)

    def stalled_write(*args, **kwargs):
        open(ready, "w").close()  # weights and optimizer are written: tell the parent, then hang until killed
        time.sleep(600)

    ckpt.write_json = stalled_write  # in this child process only
    big = torch.nn.Linear(256, 256)
    save_small(out, 2, big, torch.optim.SGD(big.parameters(), lr=0.1))


def test_save_killed_with_sigkill_leaves_previous_checkpoint(tmp_path):
    ready = str(tmp_path / "ready")
    out = tmp_path / "out"
    proc = mp.get_context("fork").Process(target=_killed_save, args=(str(out), ready), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            assert time.monotonic() < deadline and proc.is_alive(), "the save never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == -signal.SIGKILL
    leftovers = [n for n in os.listdir(out) if n.startswith(".tmp-checkpoint-2")]
    assert leftovers, os.listdir(out)
    assert not os.path.exists(out / "checkpoint-2")
    latest = folders.find_latest_checkpoint(str(out))
    assert os.path.basename(latest) == "checkpoint-1"
    model = small_model(seed=5)
    ckpt.load_checkpoint(latest, model=model)
    assert torch.equal(model[0].weight, small_model()[0].weight)
    save_small(out, 3, model)  # the next save sweeps the half-written folder away
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-3"]


def _resave_killed_between_renames(out: str) -> None:
    """Re-save checkpoint-10 and die (as kill -9 would: no cleanup) right after the old one was moved aside."""
    real = os.replace

    def replace(src, dst):
        real(src, dst)
        if os.path.basename(dst).startswith(".trash-checkpoint-10"):
            os._exit(137)

    os.replace = replace
    save_small(out, 10, small_model(seed=2), state={"global_step": 10, "again": True})


def test_a_resave_killed_between_its_two_renames_loses_neither_checkpoint(tmp_path):
    """Re-saving a step moves the older folder aside, then renames the new one into place: a kill in between
    leaves only hidden folders. The next start publishes the whole new one instead of sweeping both away."""
    out = str(tmp_path / "out")
    save_small(out, 10, small_model())
    proc = mp.get_context("fork").Process(target=_resave_killed_between_renames, args=(out,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 137
    assert not os.path.exists(os.path.join(out, "checkpoint-10"))
    assert sorted(n[:len(".trash-")] for n in os.listdir(out)) == [".tmp-ch", ".trash-"]
    folders.remove_stale(out)  # what claiming the output_dir at the next start does
    assert os.listdir(out) == ["checkpoint-10"]
    assert ckpt.load_checkpoint(os.path.join(out, "checkpoint-10")).trainer_state["again"] is True
    # A temporary folder that is not whole (its marker not yet written, or a file short) is never published.
    for broken in ("marker", "short"):
        path = save_small(tmp_path / broken, 3, small_model())
        tmp = os.path.join(os.path.dirname(path), ".tmp-checkpoint-3-0123abcd")
        os.replace(path, tmp)
        if broken == "marker":
            os.remove(os.path.join(tmp, integrity.MARKER_FILE))
        else:
            with open(os.path.join(tmp, "model.safetensors"), "r+b") as f:
                f.truncate(100)
        assert folders.remove_stale(str(tmp_path / broken)) == [tmp]
        assert os.listdir(tmp_path / broken) == []


def _ranks_save_and_load(world, out: str):
    model = small_model()
    torch.manual_seed(100 + world.rank)
    random.seed(world.rank)
    np.random.seed(world.rank)
    comm = Comm()
    # A write that fails on rank 0 raises on every rank instead of leaving the others at the barrier.
    blocker = os.path.join(out, "blocked")
    if world.is_main:
        os.makedirs(out, exist_ok=True)
        open(blocker, "w").close()
    comm.barrier()
    try:
        ckpt.save_checkpoint(blocker, 1, model=model, trainer_state={}, comm=comm, world=world)
        failed = None
    except RuntimeError as exc:
        failed = str(exc)
    state_before = ckpt.rng_state()
    path = ckpt.save_checkpoint(out, 2, model=model, trainer_state={"global_step": 2}, comm=comm, world=world,
                                sampler_state={"epoch": 0, "seed": 0, "consumed": 8})
    expected = torch.rand(3)
    torch.manual_seed(0)
    loaded = ckpt.load_checkpoint(path, model=small_model(seed=7), world=world)
    rng_state.set_rng_state(loaded.rng_state)
    return failed, torch.equal(torch.rand(3), expected), loaded.saved_world_size, \
        torch.equal(loaded.rng_state["cpu"], state_before["cpu"]), sorted(os.listdir(path))


def test_every_rank_rng_is_saved_and_errors_reach_all_ranks(tmp_path):
    results = run_world(_ranks_save_and_load, world_size=2, args=(str(tmp_path),), deadline_s=90)
    for failed, same_stream, saved_world, same_state, files in results:
        assert failed is not None and "rank 0 could not write" in failed
        assert same_stream and same_state and saved_world == 2
        assert "rng_state_0.pth" in files and "rng_state_1.pth" in files
    with ckpt.numpy_allowed():
        zero = torch.load(tmp_path / "checkpoint-2" / "rng_state_0.pth", weights_only=True)
        one = torch.load(tmp_path / "checkpoint-2" / "rng_state_1.pth", weights_only=True)
    assert not torch.equal(zero["cpu"], one["cpu"])


# -- kills, corruption and a full disk, done from outside -------------------------------------------------------

def _save_forever(out: str, started: str) -> None:
    """Save, rotate, save: checkpoints of a model large enough that a kill lands inside a write or a rotation."""
    torch.set_num_threads(1)  # a forked child must not enter the OpenMP pool the parent started
    big = torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.Linear(384, 384))
    opt = torch.optim.AdamW(big.parameters())
    big(torch.randn(2, 384)).sum().backward()
    opt.step()
    first = len(folders.list_checkpoints(out)) + 1000 * int(time.time() % 1000)
    for step in range(first, first + 10_000):
        save_small(out, step, big, opt, limit=1)
        if not os.path.exists(started):
            open(started, "w").close()


def test_sigkill_at_random_moments_leaves_only_loadable_checkpoints(tmp_path):
    """20 kill -9s of a process that saves with rotation: every checkpoint left loads, debris is swept."""
    rng = random.Random(0)
    out = str(tmp_path / "out")
    debris_seen = 0
    for attempt in range(20):
        started = str(tmp_path / f"started-{attempt}")
        proc = mp.get_context("fork").Process(target=_save_forever, args=(out, started), daemon=True)
        proc.start()
        deadline = time.monotonic() + 60
        while not os.path.exists(started):  # imports and the first step take a while; then saves run back to back
            assert proc.is_alive() and time.monotonic() < deadline, f"attempt {attempt}: the saver never saved"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL, f"attempt {attempt}: the saver ended by itself"
        names = os.listdir(out) if os.path.isdir(out) else []
        debris_seen += any(n.startswith((".tmp-", ".trash-")) for n in names)
        for path in folders.list_checkpoints(out):
            assert integrity.problems(path) == [], f"attempt {attempt}: {path} is unloadable"
            ckpt.load_checkpoint(path, model=torch.nn.Sequential(torch.nn.Linear(384, 384),
                                                                 torch.nn.Linear(384, 384)))
        folders.remove_stale(out)
        assert not [n for n in os.listdir(out) if n.startswith(".")], os.listdir(out)
    assert debris_seen > 0, "no kill landed inside a save: the test did not test anything"


def test_corrupt_files_are_named_and_resume_skips_to_the_newest_whole_checkpoint(tmp_path):
    def newest(tamper) -> tuple[str, list[str]]:
        out = tmp_path / tamper.__name__
        model, opt, sched = trained_parts()
        save_small(out, 1, model, opt, sched)
        bad = save_small(out, 2, model, opt, sched)
        tamper(bad)
        with pytest.raises(ckpt.CheckpointError) as caught:
            ckpt.load_checkpoint(bad, model=small_model(), optimizer=torch.optim.AdamW(small_model().parameters()))
        with pytest.warns(RuntimeWarning, match="skipping the corrupt checkpoint") as warned:
            found = folders.find_latest_checkpoint(str(out))
        assert os.path.basename(found) == "checkpoint-1"
        return str(caught.value), [str(w.message) for w in warned]

    def truncate(name, keep=0.5):
        def cut(path):
            file = os.path.join(path, name)
            size = os.path.getsize(file)
            with open(file, "r+b") as f:
                f.truncate(int(size * keep))
        cut.__name__ = f"truncate_{name}"
        return cut

    def delete(name):
        def remove(path):
            os.remove(os.path.join(path, name))
        remove.__name__ = f"delete_{name}"
        return remove

    def scramble_model(path):  # the same size, garbage in the header
        file = os.path.join(path, "model.safetensors")
        with open(file, "r+b") as f:
            f.write(b"\xff" * 16)

    cases = [(truncate("model.safetensors"), "model.safetensors", "truncated"),
             (truncate("optimizer.pt"), "optimizer.pt", "truncated"),
             (truncate("trainer_state.json", 0.9), "trainer_state.json", "truncated"),
             (delete("trainer_state.json"), "trainer_state.json", "missing"),
             (delete("optimizer.pt"), "optimizer.pt", "missing"),
             (scramble_model, "model.safetensors", "truncated")]
    for tamper, name, word in cases:
        error, warnings_ = newest(tamper)
        assert name in error and word in error and "checkpoint-2" in error, error
        assert any(name in w and "checkpoint-2" in w for w in warnings_), warnings_


def test_a_checkpoint_saved_without_an_optimizer_says_so_when_one_is_loaded(tmp_path):
    path = save_small(tmp_path, 1, small_model())
    with pytest.raises(ckpt.CheckpointError, match="optimizer.pt is missing"):
        ckpt.load_checkpoint(path, optimizer=torch.optim.SGD(small_model().parameters(), lr=0.1))


def test_another_optimizers_state_is_refused_when_loaded_not_at_the_first_step(tmp_path):
    """torch's load_state_dict takes an AdamW state into an SGD (the sizes fit): the first step then raised
    KeyError 'momentum' inside torch. The checkpoint names what the state lacks instead."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    path = save_small(tmp_path, 1, model, opt)
    with pytest.raises(ckpt.CheckpointError, match="another optimizer than this SGD: its param groups lack "
                                                   "dampening, momentum"):
        ckpt.load_checkpoint(path, optimizer=torch.optim.SGD(small_model().parameters(), lr=0.1))
    again = torch.optim.AdamW(small_model().parameters(), foreach=False)  # flags may differ, hyperparameters fit
    ckpt.load_checkpoint(path, optimizer=again)
    assert again.state_dict()["state"][0]["step"] == 1


@pytest.fixture
def small_disk(tmp_path):
    """A 1.6 MB file system of its own (tmpfs; needs root, as CI has)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_named_and_the_older_checkpoint_kept(small_disk):
    model = torch.nn.Linear(500, 500)  # 1 MB of weights: one checkpoint fits, a second does not
    first = save_small(small_disk, 1, model, limit=1)
    with pytest.raises(ckpt.CheckpointError) as caught:
        save_small(small_disk, 2, model, limit=1)
    message = str(caught.value)
    assert "no space left on device" in message and str(small_disk) in message, message
    assert "enforce fail" not in message
    assert sorted(os.listdir(small_disk)) == ["checkpoint-1"], "debris or a lost checkpoint"
    ckpt.load_checkpoint(first, model=torch.nn.Linear(500, 500))
