"""ddpkit._utils.atomic: a file is replaced whole or not at all, by every writer that goes through it."""

import json
import os
import subprocess
import sys
import threading

import pytest

from ddpkit._utils import atomic
from ddpkit.checkpoint import files as checkpoint
from ddpkit.distributed import error_file
from ddpkit.trainer.reporting import Reporter


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    with pytest.raises(ValueError):
        with atomic.replacing(str(path)) as f:
            f.write("half a fi")
            raise ValueError("the writer failed")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]
    with atomic.replacing(str(path), durable=True) as f:
        f.write("new é")
    assert path.read_text(encoding="utf-8") == "new é" and os.listdir(tmp_path) == ["state.json"]


def test_a_failed_rename_names_the_target_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()  # a folder where the file should go: the rename fails after the whole file was written
    for write in (lambda: checkpoint.write_json(str(target), {"a": 1}),
                  lambda: error_file.write_error_file(str(tmp_path / "missing" / "error.json"), {"a": 1})):
        with pytest.raises(OSError) as raised:
            write()
        assert raised.value.filename in (str(target), str(tmp_path / "missing" / "error.json"))
    assert sorted(os.listdir(tmp_path)) == ["taken"] and os.listdir(target) == []


def test_writers_of_one_path_never_share_a_temporary(tmp_path):
    """Two threads (or a rank and its launcher) replacing one file: each writes its own temporary, so the file
    ends as one writer's whole content, never a mix, and no temporary is left."""
    path = str(tmp_path / "shared.json")
    contents = [{"writer": w, "filler": "x" * 200_000} for w in range(4)]
    threads = [threading.Thread(target=lambda c=c: [checkpoint.write_json(path, c) for _ in range(5)])
               for c in contents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert json.load(open(path)) in contents and os.listdir(tmp_path) == ["shared.json"]
    assert atomic.temporary_name(path) != atomic.temporary_name(path)


def test_durable_writes_fsync_the_file_and_its_folder(tmp_path, monkeypatch):
    synced = []
    real = atomic.fsync_path
    monkeypatch.setattr(atomic, "fsync_path", lambda p: (synced.append(p), real(p)))
    checkpoint.write_json(str(tmp_path / "a.json"), [1])
    assert len(synced) == 2 and synced[1] == str(tmp_path) and synced[0].startswith(str(tmp_path / "a.json.tmp-"))
    Reporter(str(tmp_path), [], is_main=True)._start_metrics([{"loss": 1.0, "step": 1}], continues=False)
    assert synced[-1] == str(tmp_path) and (tmp_path / "metrics.jsonl").read_text() == '{"loss": 1.0, "step": 1}\n'
    synced.clear()
    with atomic.replacing(str(tmp_path / "b.txt")) as f:  # not durable: no fsync
        f.write("b")
    assert synced == []


def test_a_killed_writers_temporary_is_swept_and_a_live_ones_kept(tmp_path):
    """Each temporary has a name of its own, so one a kill left behind stays for good unless swept: remove_stale
    (run by the output_dir's owner at the start and at each save) removes those whose writer is gone."""
    from ddpkit.checkpoint.folders import remove_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"metrics.jsonl.tmp-{dead.pid}-0123abcd"
    live = tmp_path / f"metrics.jsonl.tmp-{os.getpid()}-0123abcd"  # this process writes it now
    other = tmp_path / f"trainer_state.json.tmp-{os.getppid()}-89abcdef"  # a live process's
    kept = [tmp_path / "metrics.jsonl", tmp_path / "notes.tmp-12-x", tmp_path / f"data.tmp-{dead.pid}-0123abc"]
    for path in [gone, live, other, *kept]:
        path.write_text("x")
    assert remove_stale(str(tmp_path)) == [str(gone)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in [live, other, *kept])
