"""`ddpkit launch`: the error file and real launches with deadlines (the plan, pure, is test_launch_plan.py).

Every launch here runs tests/scripts/train_tiny.py. A launch costs seconds of torch imports, so each one checks
several things. Every process is started in its own session and reaped in a finally block; the workers also
die with their launcher (PR_SET_PDEATHSIG in the script).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from helpers.world import DEADLINE_S, LAUNCH, clean_env, communicate_all, free_port, reap, run, start

REMAKE = ["--remake", "4"]  # train_tiny.py makes its process group again this many times
from ddpkit.distributed import error_file
from ddpkit.launch import failure_report as summary
from ddpkit.launch import options as launch_plan

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "train_tiny.py")
def params(out_dir: Path) -> dict[int, list]:
    return {int(p.stem[4:]): json.loads(p.read_text())["params"] for p in sorted(out_dir.glob("rank*.json"))}


def assert_close(a, b, tol=1e-5):
    flat_a = [x for row in a for x in row]
    flat_b = [x for row in b for x in row]
    assert len(flat_a) == len(flat_b)
    assert max(abs(x - y) for x, y in zip(flat_a, flat_b, strict=True)) <= tol


# ---------------------------------------------------------------------------------------------------------
# The error file and the summary
# ---------------------------------------------------------------------------------------------------------


def test_excepthook_writes_torchelastic_error_file(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / "error.json"
    monkeypatch.setenv(error_file.ERROR_FILE_VAR, str(path))
    seen = []
    hook = error_file._excepthook(lambda *exc_info: seen.append(exc_info))
    try:
        raise KeyError("missing")
    except KeyError as exc:
        hook(type(exc), exc, exc.__traceback__)
    assert seen and seen[0][0] is KeyError  # the previous hook still prints the traceback
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))  # torchelastic's reader
    assert failure.message["message"] == "KeyError: 'missing'"
    assert "raise KeyError" in summary._traceback(failure)
    assert not error_file.write_error_file(str(path), {"other": 1})  # @record's file (the same error) is kept


# ---------------------------------------------------------------------------------------------------------
# One script under every launcher
# ---------------------------------------------------------------------------------------------------------


def _slurm_run(out: Path) -> types.SimpleNamespace:
    """Two tasks as `srun --ntasks 2` would start them: only SLURM_* variables, no launcher."""
    port = free_port()
    began = time.monotonic()
    procs = [start([sys.executable, SCRIPT, "--out", str(out), *REMAKE],
                   clean_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                             SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="4242", SLURM_NODELIST="localhost",
                             SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            reap(p)
    return types.SimpleNamespace(rc=max(p.returncode for p in procs), out="".join(o for o, _ in outs),
                                 err="".join(e for _, e in outs), wall=time.monotonic() - began)


@pytest.fixture(scope="module")
def compat_runs(tmp_path_factory):
    """The same training under ddpkit launch, torchrun, accelerate, SLURM variables and plain python."""
    root = tmp_path_factory.mktemp("compat")
    (root / "tmp").mkdir()
    tmp_env = clean_env(TMPDIR=str(root / "tmp"))  # torchrun's own log directories go there, not into /tmp
    runs = {
        "ddpkit": lambda: run([*LAUNCH, "--nproc-per-node", "2", "--log-dir", str(root / "logs"), SCRIPT,
                               "--out", str(root / "ddpkit"), "--print-env", *REMAKE]),
        # explicit free ports: torchrun and accelerate both default to 29500, and runs overlap two at a time
        "torchrun": lambda: run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(free_port()), SCRIPT, "--out", str(root / "torchrun"),
                                 *REMAKE],
                                tmp_env),
        "slurm": lambda: _slurm_run(root / "slurm"),
        "python": lambda: run([sys.executable, SCRIPT, "--out", str(root / "python")]),
    }
    if shutil.which("accelerate"):
        runs["accelerate"] = lambda: run(["accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
                                          "no", "--main_process_port", str(free_port()), SCRIPT, "--out",
                                          str(root / "accelerate")], tmp_env)
    # two at a time: each run is mostly torch imports, and a CI runner has at least two cores
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(fn) for name, fn in runs.items()}
        results = {name: f.result() for name, f in futures.items()}
    for name, result in results.items():
        assert result.rc == 0, f"{name} failed ({result.rc}):\n{result.out}\n{result.err}"
    return root, results


def test_ddpkit_launch_gives_torchrun_environment_prefixed_output_and_rank_files(compat_runs):
    root, results = compat_runs
    out = results["ddpkit"].out
    envs = {}
    for line in out.splitlines():
        match = re.match(r"\[rank(\d)\]: ENV (.*)", line)
        if match:
            # raw_decode: a C++ warning the worker printed to stderr at the same moment may share the line
            envs[int(match.group(1))] = json.JSONDecoder().raw_decode(match.group(2))[0]
    assert sorted(envs) == [0, 1], out
    for rank, env in envs.items():
        assert (env["RANK"], env["LOCAL_RANK"], env["ROLE_RANK"]) == (str(rank),) * 3
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["ROLE_WORLD_SIZE"]) == ("2", "2", "2")
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["ROLE_NAME"]) == ("0", "1", "default")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == envs[0]["TORCHELASTIC_RUN_ID"]
        assert env["TORCHELASTIC_ERROR_FILE"] == str(root / "logs" / f"rank{rank}.error.json")
        assert env["OMP_NUM_THREADS"] == str(max(1, launch_plan.cpu_cores() // 2))
        assert env["store_listen"] == ["0100007F"]  # the store listens on 127.0.0.1 and nowhere else
        assert f"[rank{rank}]: to stderr from rank {rank}" in out  # stderr too, prefixed, on the console
        log = (root / "logs" / f"rank{rank}.log").read_text()  # one file per rank: stdout and stderr
        assert f"to stderr from rank {rank}" in log and f"done rank {rank} of 2" in log and "[rank" not in log


def test_a_process_group_made_again_meets_its_own_peers_only(compat_runs):
    """The store of torchrun's (and ddpkit launch's) agent outlives a process group, and so may rank 0's
    TCPStore under SLURM variables: a group made again must not read the keys the one before left there. It
    did: a loop of destroy and init timed out in its second or third round."""
    _, results = compat_runs
    for name in ("ddpkit", "torchrun", "slurm"):
        out = results[name].out
        for time_ in range(1, int(REMAKE[1]) + 1):
            for rank in range(2):
                assert f"remade {time_}: rank {rank} sums 3" in out, (name, out)


def test_every_launcher_ends_with_the_same_parameters(compat_runs):
    root, results = compat_runs
    reference = params(root / "ddpkit")
    assert sorted(reference) == [0, 1] and reference[0] == reference[1]  # replicas agree
    for name in ("torchrun", "accelerate", "slurm"):
        if name not in results:
            continue  # accelerate not installed here; it is in the dev extras, so CI runs it
        assert params(root / name) == reference, name  # the same 2-rank arithmetic, bit for bit
    # one process on the whole batch: the same trajectory up to float rounding of the gradient average
    assert_close(params(root / "python")[0], reference[0])


# ---------------------------------------------------------------------------------------------------------
# Failures, restarts, signals
# ---------------------------------------------------------------------------------------------------------


def test_a_busy_master_port_is_named_with_what_to_do():
    """Node 0's store on a port in use: torchelastic's EADDRINUSE traceback before (launch review)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run([*LAUNCH, "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                      "--nproc-per-node", "1", "-m", "json.tool", os.devnull], timeout=60)
    assert result.rc == 1, result.err
    assert f"cannot listen on port {port} of this host: something else uses it. Pick another --master-port" \
        in result.err and "Traceback" not in result.err, result.err


def test_worker_exception_is_root_cause_and_stops_the_others_fast(tmp_path):
    result = run([*LAUNCH, "--nproc-per-node", "2", SCRIPT, "--steps", "1000", "--fail-rank", "1",
                  "--fail-step", "3"])
    assert result.rc == 1
    failed_at = float(re.search(r"FAILING rank 1 at ([\d.]+)", result.out).group(1))
    # torchelastic logs when it signals the survivors: "W1130 22:31:15.389000 <pid> ... closing signal SIGTERM"
    logged = re.search(r"^W(\d{4} [\d:.]+) .*closing signal SIGTERM", result.err, re.M).group(1)
    stopped_at = datetime.datetime.strptime(f"{time.localtime(failed_at).tm_year}{logged}",
                                            "%Y%m%d %H:%M:%S.%f").timestamp()
    print(f"worker failure -> others signalled: {stopped_at - failed_at:.2f} s, "
          f"-> launcher exit: {result.ended - failed_at:.2f} s")
    assert stopped_at - failed_at < 5.0, result.err  # rank 0 was still training: stopped, not left to time out
    assert result.ended - failed_at < 15.0, result.err
    summary = result.err[result.err.index("ddpkit launch: the job failed"):]
    assert "root cause: rank 1" in summary and "exited with code 1" in summary
    assert "ValueError: rank 1 fails on purpose at step 3" in summary and "Traceback" in summary
    assert "rank 0 " in summary  # named after the root cause, however it ended


def test_restart_after_failure_then_signal_death_is_named(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # attempt 0: rank 1 raises; with one restart, attempt 1 runs clean and ends like an undisturbed run
        restarted = pool.submit(run, [*LAUNCH, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir",
                                      str(tmp_path / "logs"), SCRIPT, "--fail-rank", "1", "--fail-attempts", "1",
                                      "--out", str(tmp_path / "restarted")])
        # a worker killed by a signal: no traceback, the signal by name
        killed = pool.submit(run, [*LAUNCH, "--nproc-per-node", "2", SCRIPT, "--steps", "1000", "--fail-rank", "0",
                                   "--fail-how", "sigkill"])
        ok, killed = restarted.result(), killed.result()
    assert ok.rc == 0, ok.err
    assert "fails on purpose" in (tmp_path / "logs" / "rank1.log").read_text()
    assert "done rank 1 of 2" in (tmp_path / "logs" / "rank1.restart1.log").read_text()
    got = params(tmp_path / "restarted")
    assert sorted(got) == [0, 1] and got[0] == got[1]
    assert killed.rc == 1
    assert "root cause: rank 0" in killed.err and "killed by SIGKILL (signal 9)" in killed.err, killed.err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_reach_workers_and_the_grace_period_bounds_the_wait(sig):
    grace_s = 2  # whole seconds: torchrun's --shutdown-timeout is an int
    # under SIGTERM the workers ignore it (a checkpoint that takes too long): killed after the grace period
    ignore = ["--ignore-term"] if sig == signal.SIGTERM else []
    proc = start([*LAUNCH, "--nproc-per-node", "2", "--shutdown-timeout", str(grace_s), SCRIPT,
                  "--wait-for-signal", *ignore])
    try:
        ready, deadline = [], time.monotonic() + DEADLINE_S
        while len(ready) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if " ready pid " in line:
                ready.append(int(line.split()[-1]))
        assert len(ready) == 2, proc.stderr.read() if proc.poll() is not None else "workers never got ready"
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=grace_s + 30)
        waited = time.monotonic() - sent
    finally:
        reap(proc)
    assert proc.returncode == 128 + sig, err
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank} got {sig.name}" in out
    if ignore:
        assert grace_s <= waited < grace_s + 10, waited  # SIGKILL came after the grace period, not later
    for pid in ready:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _listening(port: int) -> bool:
    """Whether a TCP socket listens on `port` (read from /proc: connecting would disturb the store there)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fp:
            rows = [row.split() for row in fp.read().splitlines()[1:]]
        if any(f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port for f in rows):  # 0A: LISTEN
            return True
    return False


@pytest.mark.parametrize("rdzv, sig", [("static", signal.SIGTERM), ("static", signal.SIGINT),
                                       ("c10d", signal.SIGTERM), ("c10d", signal.SIGINT)])
def test_a_signal_during_the_rendezvous_leaves_no_temporary_folder(tmp_path, rdzv, sig):
    """Node 0 of two waits for a node that never comes. SIGTERM there ended the launcher at once (its default
    action: no handler runs while torch's TCPStore waits in C++), leaving its ddpkit-launch-* folder in TMPDIR;
    a Ctrl-C (SIGINT) in the static rendezvous went unheard until it timed out. Both end it within seconds."""
    port = free_port()
    how = (["--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port)] if rdzv == "static" else
           ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lone"])
    proc = start([*LAUNCH, "--nnodes", "2", *how, "--nproc-per-node", "1", "-m", "json.tool", os.devnull],
                 clean_env(TMPDIR=str(tmp_path)))
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not _listening(port):  # node 0's store is up: the launcher waits in the rendezvous
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        reap(proc)
    assert proc.returncode in (-sig, 128 + sig), err
    assert os.listdir(tmp_path) == [], err


# ---------------------------------------------------------------------------------------------------------
# Two nodes in two network namespaces
# ---------------------------------------------------------------------------------------------------------


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _cannot_make_namespaces() -> str | None:
    if not shutil.which("ip"):
        return "`ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"ddpkprobe{os.getpid()}"
    made = _sh("ip", "netns", "add", probe)
    _sh("ip", "netns", "del", probe)
    return None if made.returncode == 0 else f"`ip netns add` failed: {made.stderr.strip()}"


@pytest.fixture
def two_namespaces():
    """ns0 (10.77.0.1) and ns1 (10.77.0.2), joined by a veth pair; removed, with their processes, after."""
    why = _cannot_make_namespaces()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the two-node test: {why}")
        pytest.skip(why)
    tag = os.getpid() % 100000
    nodes = [(f"ddpk{tag}n{i}", f"dk{tag}v{i}", f"10.77.0.{i + 1}") for i in range(2)]
    try:
        for ns, _, _ in nodes:
            assert _sh("ip", "netns", "add", ns).returncode == 0
        made = _sh("ip", "link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        assert made.returncode == 0, made.stderr
        for ns, dev, addr in nodes:
            for cmd in (("link", "set", dev, "netns", ns), ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                        ("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")):
                done = _sh("ip", *cmd)
                assert done.returncode == 0, done.stderr
        yield nodes
    finally:
        for ns, _, _ in nodes:
            pids = _sh("ip", "netns", "pids", ns).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "del", ns)  # takes the veth pair with it
        _sh("ip", "link", "del", nodes[0][1])  # in case it never moved into a namespace


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_nodes_two_processes_end_with_identical_replicas(two_namespaces, rdzv, tmp_path, compat_runs):
    port = 29531 if rdzv == "static" else 29541  # not the port the other case's store just left
    procs = []
    try:
        for node, (ns, dev, addr) in enumerate(two_namespaces):
            if rdzv == "static":
                how = ["--node-rank", str(node), "--master-addr", "10.77.0.1", "--master-port", str(port)]
            else:  # neither address matches the namespaces' host name: say which node hosts the store
                how = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"10.77.0.1:{port}", "--rdzv-id", "job",
                       "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", addr]
            # gloo binds the address of the host name, loopback inside these namespaces: name the veth instead
            env = clean_env(GLOO_SOCKET_IFNAME=dev)
            procs.append(start(["ip", "netns", "exec", ns, *LAUNCH, "--nnodes", "2", "--nproc-per-node", "2",
                                *how, SCRIPT, "--out", str(tmp_path)], env))
        outs = [communicate_all(procs, p, DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            reap(p)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{out}\n{err}"
    got = params(tmp_path)
    assert sorted(got) == [0, 1, 2, 3] and all(got[r] == got[0] for r in got)
    # 4 ranks share the same global batch: the 2-rank trajectory up to rounding
    root, _ = compat_runs
    assert_close(got[0], params(root / "ddpkit")[0])
