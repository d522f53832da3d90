"""The checkpoints in an output_dir: finding them (the newest whole one, one run's), retiring old ones, and
sweeping what killed saves left behind. One checkpoint's files are ddpkit.checkpoint's.

    list_checkpoints("out")                       # ["out/checkpoint-2", "out/checkpoint-10"], oldest first
    find_latest_checkpoint("out", run=run_id)     # the newest whole one of that training run (ddpkit.checkpoint.run_ids)
    rotate_checkpoints("out", 3, keep=(...), run=run_id)

A checkpoint folder is ``checkpoint-<step>``, finished once its completion marker exists (ddpkit.checkpoint.integrity); the
marker names the training run that wrote it, so that a run retires only its own checkpoints and resumes only from
its own (ddpkit.checkpoint.run_ids).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
import warnings

from ddpkit._utils.atomic import fsync_path, left_behind
from ddpkit.checkpoint.integrity import MARKER_FILE, problems, read_marker
from ddpkit.errors import CheckpointError

PREFIX = "checkpoint"
TRAINER_STATE_FILE = "trainer_state.json"
DDPKIT_STATE_FILE = "ddpkit_state.json"  # the progress fields Transformers' TrainerState has not
_NAME = re.compile(rf"^{PREFIX}-(\d+)$")
_ASIDE = re.compile(rf"^{PREFIX}-(\d+)\.run-(.+)$")  # aside_name's
_TMP = re.compile(rf"^\.tmp-{PREFIX}-(\d+)-[0-9a-f]+$")  # a save's folder until published (ddpkit.checkpoint)


def aside_name(path: str, run: str | None) -> str:
    """Where a save of another run renames run `run`'s checkpoint `path` to keep it: ``checkpoint-<step>.run-<id>``
    (no longer a checkpoint-<step> name, so neither found as the newest nor rotated; it loads when named)."""
    return f"{os.path.normpath(path)}.run-{run or 'earlier'}"


def checkpoint_step(path: str) -> int | None:
    """The step of a finished checkpoint folder, or None for anything else (temporary folders included).

    Finished: its completion marker exists (an older ddpkit's folders, which have none, count when their
    trainer_state.json does; `problems` then tells whether they are whole)."""
    match = _NAME.match(os.path.basename(os.path.normpath(path)))
    if match is None:
        return None
    if not os.path.isfile(os.path.join(path, MARKER_FILE)) and not os.path.isfile(
            os.path.join(path, TRAINER_STATE_FILE)):
        return None
    return int(match.group(1))


def checkpoint_run(path: str) -> str | None:
    """The id of the training run that wrote a checkpoint (its marker's "run"); None for an older ddpkit's, or an
    unreadable marker (`problems` names that)."""
    try:
        marker = read_marker(path)
    except CheckpointError:
        return None
    return None if marker is None else marker.get("run")


def list_checkpoints(output_dir: str, run: str | None = None, renamed: bool = False,
                     until: int | None = None) -> list[str]:
    """Finished checkpoints in output_dir, oldest (lowest step) first; with `run`, only that run's, and with
    `renamed` too, also those of its that another run's save renamed aside (aside_name); until: none past it."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        step = checkpoint_step(path)
        if step is not None and (run is None or checkpoint_run(path) == run):
            found.append((step, path))
        aside = _ASIDE.match(name) if renamed and run is not None else None
        if aside is not None and aside.group(2) == run and os.path.isfile(os.path.join(path, MARKER_FILE)):
            found.append((int(aside.group(1)), path))
    return [path for step, path in sorted(found) if until is None or step <= until]


def latest_valid_checkpoint(output_dir: str, run: str | None = None, renamed: bool = False,
                            until: int | None = None) -> tuple[str | None, list[tuple[str, list[str]]]]:
    """The newest checkpoint in output_dir (of `run`, if given; `renamed`, `until`: list_checkpoints') that is
    whole, and the newer ones skipped with what is wrong."""
    skipped = []
    for path in reversed(list_checkpoints(output_dir, run, renamed, until)):
        wrong = problems(path)
        if not wrong:
            return path, skipped
        skipped.append((path, wrong))
    return None, skipped


def find_latest_checkpoint(output_dir: str, run: str | None = None, renamed: bool = False,
                           until: int | None = None) -> str | None:
    """The newest whole checkpoint in output_dir (of `run`, if given; `renamed`, `until`: list_checkpoints';
    None: there is none); a newer corrupt one is skipped with a warning that names what is wrong with it."""
    path, skipped = latest_valid_checkpoint(output_dir, run, renamed, until)
    for bad, wrong in skipped:
        warnings.warn(f"skipping the corrupt checkpoint {bad}: {'; '.join(wrong)}"
                      + (f"; resuming from {path}" if path else ""), RuntimeWarning, stacklevel=2)
    return path


def remove_stale(output_dir: str) -> list[str]:
    """Delete what killed saves and rotations left behind; the paths removed.

    That is hidden temporary and trash folders, checkpoint-<step> folders that hold neither a completion marker
    nor a trainer_state.json (empty ones, or what an older ddpkit's rotation left half-deleted), and the
    temporaries of whole-file writes whose writer was killed (ddpkit._utils.atomic: metrics.jsonl's, say). A whole
    temporary folder whose checkpoint-<step> name is free is published first (_finish_publishing). Call it
    only while this run owns output_dir (see ddpkit.checkpoint.output_lock): another run's temporary folder would go too."""
    if not os.path.isdir(output_dir):
        return []
    _finish_publishing(output_dir)
    removed = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        debris = name.startswith((f".tmp-{PREFIX}-", f".trash-{PREFIX}-")) or (
            _NAME.match(name) is not None and os.path.isdir(path) and checkpoint_step(path) is None)
        if debris:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif left_behind(path):
            with contextlib.suppress(OSError):
                os.remove(path)
            removed.append(path)
    return removed


def _finish_publishing(output_dir: str) -> list[str]:
    """Publish what a kill interrupted between a save's two renames: a whole temporary checkpoint-<step> folder
    (its marker written, every file as the marker says) whose final name is free. Re-saving a step moves the
    older folder aside before the new one takes its name; a kill in between leaves only the hidden folders, which
    remove_stale would delete, both. The newer is published instead (the older then goes as debris). Returns the
    checkpoints published."""
    candidates: dict[int, list[tuple[float, str]]] = {}
    for name in os.listdir(output_dir):
        match = _TMP.match(name)
        path = os.path.join(output_dir, name)
        if match is not None and os.path.isdir(path):
            candidates.setdefault(int(match.group(1)), []).append((os.path.getmtime(path), path))
    published = []
    for step, found in candidates.items():
        final = os.path.join(output_dir, f"{PREFIX}-{step}")
        if os.path.exists(final):
            continue
        for _, path in sorted(found, reverse=True):  # the newest whole one, if two saves were killed so
            if _whole(path, step):
                os.replace(path, final)
                fsync_path(output_dir)
                published.append(final)
                break
    return published


def _whole(path: str, step: int) -> bool:
    """Whether a temporary checkpoint folder is finished: a marker for `step`, and every file it lists intact."""
    try:
        marker = read_marker(path)
    except CheckpointError:
        return False
    return marker is not None and marker.get("step") == step and not problems(path)


def rotate_checkpoints(output_dir: str, save_total_limit: int | None, keep: str | tuple[str, ...] | None = None,
                       run: str | None = None, until: int | None = None) -> list[str]:
    """Delete the oldest checkpoints so that save_total_limit remain, never those in `keep` (they count towards
    the limit, as the best checkpoint does in Transformers: a limit of 2 with the best one old keeps it and the
    newest); the deleted paths. One that cannot be deleted stays, with a warning (Transformers ignores it). run:
    count and delete only that run's (another run's are not this one's to delete: ddpkit.checkpoint.run_ids). until: neither
    count nor delete those past that step (a restarted script's first train() call must leave its run's
    checkpoints that a later call, which continued the run, saved)."""
    if save_total_limit is None:
        return []
    kept = {os.path.abspath(k) for k in ((keep,) if isinstance(keep, str) else (keep or ()))}
    found = list_checkpoints(output_dir, run, until=until)
    others = [p for p in found if os.path.abspath(p) not in kept]
    budget = max(0, save_total_limit - (len(found) - len(others)))  # what the limit leaves for the unprotected
    doomed, retired = others[:max(0, len(others) - budget)], []
    for path in doomed:
        try:
            _retire(path)
            retired.append(path)
        except OSError as exc:  # the new checkpoint is whole: an old one that stays is no reason to stop the run
            warnings.warn(f"could not delete the old checkpoint {path} for save_total_limit ({exc}); it stays: "
                          "delete it by hand", RuntimeWarning, stacklevel=2)
    return retired


def _retire(path: str) -> None:
    """Delete a checkpoint folder so that no kill leaves it half there: it stops being a checkpoint (a hidden
    name) in one rename before any file goes; an interrupted delete leaves only a .trash- folder, which
    remove_stale finds later."""
    parent = os.path.dirname(os.path.abspath(path))
    trash = os.path.join(parent, f".trash-{os.path.basename(os.path.normpath(path))}-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    fsync_path(parent)
    shutil.rmtree(trash, ignore_errors=True)


__all__ = ["DDPKIT_STATE_FILE", "PREFIX", "TRAINER_STATE_FILE", "aside_name", "checkpoint_run", "checkpoint_step",
           "find_latest_checkpoint", "fsync_path", "latest_valid_checkpoint", "list_checkpoints", "remove_stale",
           "rotate_checkpoints"]
