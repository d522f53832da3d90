"""`ddpkit timeline FILE [--json OUT] [--png OUT]` (ddpkit.timeline.cli): the summary reprinted, drawn and
written, and its outputs checked before any work and written whole."""

from __future__ import annotations

import argparse
import json
import sys
from unittest import mock

from ddpkit import cli
from ddpkit.timeline import cli as timeline_cli
from helpers.traces import hand_trace


def test_cli_reprints_the_summary_and_draws(tmp_path, capsys, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(hand_trace()))
    assert cli.main(["timeline", str(path), "--png", str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "bucket 0: rank 1 last" in out
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "s.json").read_text())["buckets"][0]["last_rank"] == 1
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert cli.main(["timeline", str(path), "--png", str(tmp_path / "t.png")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert timeline_cli.main(argparse.Namespace(file=str(tmp_path / "bad.json"), png=None, json=None)) == 2


def test_cli_outputs_are_checked_first_and_written_whole(tmp_path, capsys, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(hand_trace()))
    for option, target in (("--json", tmp_path), ("--png", tmp_path / "missing" / "s.png")):
        assert cli.main(["timeline", str(path), option, str(target)]) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and err.startswith(f"ddpkit timeline: {option} ") and out == ""
    # An output on the trace itself, or both outputs on one file: refused before anything is written
    both = ["--json", str(tmp_path / "o"), "--png", str(tmp_path / "o")]
    for argv in (["--json", str(path)], ["--png", str(path)], both):
        assert cli.main(["timeline", str(path), *argv]) == 2
        assert "the same file" in capsys.readouterr().err
    assert json.loads(path.read_text()) == hand_trace()
    monkeypatch.setattr(timeline_cli, "output_path_problem", lambda out: None)  # as if made after the check:
    (tmp_path / "s.png").mkdir()  # the picture is drawn whole into a temporary, whose rename fails
    assert cli.main(["timeline", str(path), "--png", str(tmp_path / "s.png")]) == 2
    assert capsys.readouterr().err == f"ddpkit timeline: cannot write {tmp_path / 's.png'}: Is a directory\n"
    (tmp_path / "s.json").write_text("old")
    monkeypatch.setattr("ddpkit.timeline.trace.json.dump", mock.Mock(side_effect=OSError(28, "No space left")))
    assert cli.main(["timeline", str(path), "--json", str(tmp_path / "s.json")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.png", "t.json"]  # no temporary left
    assert (tmp_path / "s.json").read_text() == "old"
