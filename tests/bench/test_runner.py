"""The benchmark's plumbing: the summary and options as plain functions, then one tiny end-to-end run.

No timing is asserted anywhere: the machine is shared and noisy, and the benchmark exists to measure it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from ddpkit.bench import runner as bench


def test_round_order_rotates_so_each_variant_runs_first_once():
    orders = [bench.round_order(r) for r in range(3)]
    assert orders == [["ddpkit", "torch", "bare"], ["torch", "bare", "ddpkit"], ["bare", "ddpkit", "torch"]]
    assert {order[0] for order in orders} == set(bench.VARIANTS)
    assert bench.round_order(3) == orders[0]


def test_summary_ratio_is_median_of_per_round_ratios():
    # Rounds in seconds; round 1 is slow for everyone (a noisy neighbour), which per-round ratios cancel.
    steps = {"ddpkit": [[0.011, 0.010, 0.012], [0.022, 0.020, 0.024]],
             "torch": [[0.010, 0.010, 0.010], [0.020, 0.020, 0.020]],
             "bare": [[0.005, 0.005, 0.005], [0.010, 0.010, 0.010]]}
    cpu = {v: [[t / 2 for t in block] for block in blocks] for v, blocks in steps.items()}
    row = bench.summarise(2, "mlp", {"params": 10, "tensors": 2, "wall": steps, "cpu": cpu})
    assert row["round_median_ms"]["ddpkit"] == pytest.approx([11.0, 22.0])
    assert row["median_ms"]["torch"] == pytest.approx(15.0)  # median of all six steps
    ratio = row["ratios"]["ddpkit/torch"]
    assert ratio["rounds"] == pytest.approx([1.1, 1.1])
    assert (ratio["median"], ratio["min"], ratio["max"]) == pytest.approx((1.1, 1.1, 1.1))
    assert row["ratios"]["ddpkit/bare"]["median"] == pytest.approx(2.2)
    assert row["cpu_median_ms"]["torch"] == pytest.approx(7.5)
    assert row["cpu_ratios"]["ddpkit/torch"]["median"] == pytest.approx(1.1)


@pytest.mark.parametrize("bad", [{"steps": 0}, {"repeats": 0}, {"world_size": 0}, {"threads": 0},
                                 {"warmup": -1}, {"bucket_cap_mb": 0.0}, {"models": ("resnet",)},
                                 {"models": ()}, {"timeout_s": 0}])
def test_config_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        bench.BenchConfig(**bad)


def test_world_sizes():
    assert bench.BenchConfig(world_size=3).world_sizes == [3, 1]
    assert bench.BenchConfig(world_size=3, single=False).world_sizes == [3]
    assert bench.BenchConfig(world_size=1).world_sizes == [1]


# Each case: the options, the one out of range, and the range the error must state. The tiny rest keeps a
# regression (an option accepted after all) from starting a full-size run.
OUT_OF_RANGE = [(["--zero", "--repeats", "0"], "--repeats", "an integer >= 1"),
                (["--zero", "--steps", "0"], "--steps", "an integer >= 1"),
                (["--zero", "--world-size", "0"], "--world-size", "an integer >= 1"),
                (["--zero", "--world-size", "-2"], "--world-size", "an integer >= 1"),
                (["--zero", "--repeats", "-1"], "--repeats", "an integer >= 1"),
                (["--zero", "--warmup", "-1"], "--warmup", "an integer >= 0"),
                (["--zero", "--timeout", "0"], "--timeout", "a finite number > 0"),
                (["--steps", "0"], "--steps", "an integer >= 1"),
                (["--repeats", "-3"], "--repeats", "an integer >= 1"),
                (["--world-size", "0"], "--world-size", "an integer >= 1"),
                (["--warmup", "-1"], "--warmup", "an integer >= 0"),
                (["--threads", "0"], "--threads", "an integer >= 1"),
                (["--bucket-cap-mb", "0"], "--bucket-cap-mb", "a finite number > 0"),
                (["--timeout", "nan"], "--timeout", "a finite number > 0"),
                (["--world-size", "two"], "--world-size", "an integer >= 1"),
                (["--seed", "-1"], "--seed", "an integer >= 0")]


@pytest.mark.parametrize("argv, option, allowed", OUT_OF_RANGE, ids=[" ".join(c[0]) for c in OUT_OF_RANGE])
def test_out_of_range_option_exits_with_usage(argv, option, allowed, capsys):
    tiny = ["--models", "mlp", "--steps", "1", "--warmup", "0", "--repeats", "1", "--world-size", "1"]
    with pytest.raises(SystemExit) as exc:
        bench.main(tiny + argv)  # the last of a repeated option wins
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and f"error: argument {option}: must be {allowed}, got " in err, err


def test_seed_beyond_torchs_range_is_refused_before_starting_ranks(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--seed", str(bench.SEED_LIMIT), "--models", "mlp"])
    assert exc.value.code == 2 and f"seed must be an integer in [0, {bench.SEED_LIMIT})" in capsys.readouterr().err


@pytest.mark.parametrize("quiet", [False, True], ids=["progress", "quiet"])
def test_zero_smoke_writes_json_and_only_its_own_lines(tmp_path, quiet):
    """One tiny round of every variant: the table, --json with every rank's figures, a progress line per model
    unless --quiet, and nothing else on stderr (the memory profiler's C++ side prints at each start and stop)."""
    from ddpkit.bench import zero as bench_zero

    path = tmp_path / "zero.json"
    done = subprocess.run([sys.executable, "-m", "ddpkit.bench", "--zero", "--models", "transformer", "--repeats",
                           "1", "--steps", "1", "--warmup", "0", "--timeout", "240", "--json", str(path),
                           *(["--quiet"] if quiet else [])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("transformer")] == \
        list(bench_zero.VARIANTS)
    assert done.stderr == ("" if quiet else done.stderr.splitlines()[0] + "\n"), done.stderr
    assert quiet or re.fullmatch(r"\[bench --zero\] transformer: measured in \d+ s\n", done.stderr), done.stderr
    report = json.loads(path.read_text())
    assert report["options"]["repeats"] == 1 and report["variants"] == list(bench_zero.VARIANTS)
    assert len(report["per_rank"]) == 2
    for rank in report["per_rank"]:
        assert set(rank["transformer"]["times"]) == set(bench_zero.VARIANTS)
        assert all(rank["transformer"]["state_bytes"][v] > 0 for v in bench_zero.VARIANTS)


def test_zero_run_rejects_nonsense_before_starting_ranks():
    from ddpkit.bench import zero as bench_zero

    for bad in ({"steps": 0}, {"repeats": 0}, {"world_size": 0}, {"warmup": -1}):
        with pytest.raises(ValueError, match="must be >= "):
            bench_zero.run(["mlp"], **bad)


def test_smoke_two_ranks_and_one(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = bench.main(["--world-size", "2", "--models", "many-small", "--steps", "2", "--warmup", "1",
                       "--repeats", "2", "--timeout", "240", "--quiet", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    rows = report["results"]
    assert [(r["world_size"], r["model"]) for r in rows] == [(2, "many-small"), (1, "many-small")]
    for row in rows:
        assert row["tensors"] == 500
        assert set(row["median_ms"]) == set(bench.VARIANTS)
        for variant in bench.VARIANTS:
            assert len(row["step_ms"][variant]) == 2 and all(len(block) == 2 for block in row["step_ms"][variant])
            assert math.isfinite(row["median_ms"][variant]) and row["median_ms"][variant] > 0
        assert set(row["ratios"]) == set(row["cpu_ratios"]) == {"ddpkit/torch", "ddpkit/bare"}
        for ratio in [*row["ratios"].values(), *row["cpu_ratios"].values()]:
            values = [ratio["median"], ratio["min"], ratio["max"], *ratio["rounds"]]
            assert all(math.isfinite(v) and v > 0 for v in values), ratio
            assert ratio["min"] <= ratio["median"] <= ratio["max"]
    out = capsys.readouterr().out
    assert "ddpkit/torch" in out and out.count("many-small") == 2


def test_smoke_inspector_and_timeline_on_against_off(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = bench.main(["--world-size", "2", "--no-single", "--models", "many-small", "--steps", "2", "--warmup",
                       "1", "--repeats", "2", "--timeout", "240", "--quiet", "--inspector", "--timeline", "--json",
                       str(path)])
    assert code == 0
    (row,) = json.loads(path.read_text())["results"]
    assert set(row["median_ms"]) == {*bench.VARIANTS, "inspected", "timeline"}
    for variant in ("inspected", "timeline"):
        ratio = row["cpu_ratios"][f"{variant}/ddpkit"]
        assert all(math.isfinite(v) and v > 0 for v in ratio["rounds"]), ratio
    out = capsys.readouterr().out
    assert "stall inspector on vs off" in out and "timeline on vs off" in out


@pytest.mark.parametrize("argv", [["--no-single", "--quiet"], ["--zero"]], ids=["plain", "zero"])
def test_deadline_stops_every_rank(argv, capsys):
    import multiprocessing

    code = bench.main(["--world-size", "2", "--models", "many-small", "--timeout", "0.5", *argv])
    assert code == 1
    err = capsys.readouterr().err
    assert "deadline" in err and "raise it with --timeout" in err and "Traceback" not in err, err
    assert multiprocessing.active_children() == []


def test_cli_hands_bench_its_arguments(capsys):
    from ddpkit import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "usage: ddpkit bench" in capsys.readouterr().out


def test_help_describes_zero(capsys):
    """`ddpkit bench --help` says what --zero compares, with which optimizer, and what its table holds;
    `ddpkit bench --zero --help` (or argparse's abbreviation --ze) lists every variant and its own options."""
    from ddpkit import cli
    from ddpkit.bench import zero as bench_zero

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help to the terminal's width
    for words in ("--zero", "AdamW", "ddpkit's ZeroRedundancyOptimizer (stage 1)", "DDP(zero_stage=2) (stage 2)",
                  "torch's ZeroRedundancyOptimizer", "FSDP2", "one row per model and variant",
                  "median step time (ms), its ratio to torch's DDP [min-max over rounds]",
                  "optimizer-state, gradient and peak tensor memory", "ddpkit bench --zero --help"):
        assert words in out, words
    for argv in (["--zero", "--help"], ["--ze", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["bench", *argv])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: ddpkit bench --zero") and "--timeout" in out and "--threads" not in out
        assert all(f"\n    {variant} " in out for variant in bench_zero.VARIANTS), out


def test_smoke_compiled_variants(tmp_path):
    """--compile: every variant torch.compile'd (aot_eager here: it compiles in seconds), interleaved as ever."""
    path = tmp_path / "bench.json"
    code = bench.main(["--world-size", "2", "--no-single", "--models", "mlp", "--steps", "2", "--warmup", "1",
                       "--repeats", "2", "--timeout", "240", "--quiet", "--compile", "aot_eager", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    assert report["environment"]["compile"] == "aot_eager" and report["config"]["compile"] == "aot_eager"
    (row,) = report["results"]
    assert set(row["median_ms"]) == set(bench.VARIANTS)
    assert all(math.isfinite(r) and r > 0 for r in row["ratios"]["ddpkit/torch"]["rounds"])


@pytest.mark.parametrize("bad", [{"compile": "no-such-backend"}, {"compile": "inductor", "warmup": 0}])
def test_compile_options_rejected(bad):
    with pytest.raises(ValueError, match="backend|warm-up"):
        bench.BenchConfig(**bad)


def test_bench_memory_figures_count_what_they_say():
    """bench --zero's peak: the high-water mark of live tensor bytes allocated inside the run; its gradient
    bytes: each storage once, however many .grad views it backs."""
    from ddpkit.bench.zero_memory import grad_bytes, peak_bytes

    mib = 1 << 20

    def step(held):
        scratch = torch.ones(2 * mib // 4)  # freed at the end of the step: counts only while it lives
        held.append(scratch[: mib // 4].clone())

    # build: 1 MiB; step 1: + 2 scratch + 1 kept (4), down to 2; step 2: + 2 + 1 = 5 MiB at the peak.
    peak = peak_bytes(lambda: [torch.zeros(mib // 4)], step, 2)
    assert 5 * mib <= peak <= 5 * mib + 4096, peak
    layer = nn.Linear(4, 4)
    flat = torch.zeros(20)
    layer.weight.grad, layer.bias.grad = flat[:16].view(4, 4), flat[16:]
    assert grad_bytes(layer) == 80
    layer.bias.grad = torch.zeros(4)
    assert grad_bytes(layer) == 96


# -- a signal to the running bench: it and every rank end, the ranks' ports are free (Linux: reads /proc) ----------
def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and _stat(int(entry))[1] == str(pid):
                found.append(int(entry))
    return found


def _stat(pid: int) -> list[str]:
    """(state, ppid, ...) of /proc/PID/stat, after the command name (which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def _alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def _is_rank(pid: int) -> bool:  # multiprocessing's spawned children, not its resource tracker
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
        return b"spawn_main" in fh.read()
    return False


def _listening_ports(pids: list[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").rstrip("]"))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for fields in (line.split() for line in fh.readlines()[1:]):
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not holding the port
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks and their ports in /proc")
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
@pytest.mark.parametrize("zero", [True, False], ids=["zero", "plain"])
def test_signal_ends_bench_and_every_rank(tmp_path, zero, how):
    """SIGTERM to the bench (a scheduler, `kill`), or Ctrl-C to its terminal's process group, ends it within
    seconds with one line and exit code 130, and ends every rank: none survives and no port stays held."""
    src = os.path.dirname(os.path.dirname(os.path.dirname(bench.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "ddpkit.bench", *(["--zero"] if zero else ["--no-single"]), "--models", "mlp",
            "--steps", "1", "--warmup", "0", "--repeats", "100000"]  # ends by the signal (or its default deadline)
    err_path = tmp_path / "stderr"  # a file, not a pipe: a surviving rank would hold a pipe open
    with open(err_path, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline, ports = time.monotonic() + 120, set()
        while len(ranks) < 2 or not ports:  # both ranks started, rank 0's store listening: the world is up
            assert proc.poll() is None, f"the bench ended before the signal:\n{err_path.read_text()}"
            assert time.monotonic() < deadline, "the ranks did not start within 120 s"
            time.sleep(0.2)
            ranks = [pid for pid in _children(proc.pid) if _is_rank(pid)]
            ports = _listening_ports(ranks)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the ranks get it too
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        time.sleep(0.5)  # an orphaned rank would still be running now; a stopped one was joined by the bench
        survivors, held = [pid for pid in ranks if _alive(pid)], [p for p in ports if not _port_is_free(p)]
        text = err_path.read_text()
        assert (code, survivors, held) == (130, [], []), f"exit code, live ranks, held ports; stderr:\n{text}"
        assert text.strip().endswith("interrupted; every rank was stopped") and "Traceback" not in text, text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the bench's session: the bench, its ranks, its resource tracker
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_ranks_are_deaf_to_ctrl_c_from_their_start():
    """A Ctrl-C while a rank was still importing (before its main ignored SIGINT) printed its KeyboardInterrupt
    traceback; the ranks now start with SIGINT ignored, which exec keeps."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(30,), daemon=True)
    try:
        with bench._ranks_start_deaf_to_ctrl_c():
            proc.start()
        with open(f"/proc/{proc.pid}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1)), "SIGINT not ignored in the starting rank"
        assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # the parent's Ctrl-C is back
    finally:
        proc.kill()
        proc.join(timeout=30)
