"""ddpkit.trainer.loader_workers: the Trainer's data-loader workers are out of the stop's way and die with their rank.

Each test runs a rank as a script of its own (a process whose signals we send), with a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from ddpkit._utils.procfs import process_ended
from helpers.world import clean_env


def _run(tmp_path, source: str, timeout: float = 60) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)


STUCK = """
import os, sys, time
import torch
from ddpkit.trainer.loader_workers import SparedLoader

class Stuck(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        print("WORKER", os.getpid(), flush=True)
        time.sleep(120)  # a read that hangs (a network file system): torch's watch of the parent never looks
        return i

next(iter(SparedLoader(Stuck(), num_workers=1)))
"""


def test_a_loader_worker_is_out_of_the_stops_reach_and_dies_with_its_rank(tmp_path):
    """With dataloader_num_workers the Trainer's loader workers leave the rank's process group (the stop is the
    rank's), and die with the rank, even blocked in a sample: out of the group, the launcher's SIGKILL of it
    missed them, and they outlived the launcher."""
    script = tmp_path / "loader.py"
    script.write_text(STUCK)
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True)
    worker = None
    try:
        worker = int(rank.stdout.readline().split()[1])
        assert os.getpgid(worker) == worker != os.getpgid(rank.pid)
        os.killpg(rank.pid, signal.SIGTERM)  # the launcher's stop, to the rank's group: the rank (no handler) ends
        rank.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not process_ended(worker):
            time.sleep(0.1)
        assert process_ended(worker), "the loader worker outlived its rank"
    finally:
        rank.kill()
        rank.wait()
        if worker is not None and not process_ended(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_rank_with_loader_workers_exits_when_it_raises(tmp_path):
    """The rank's own SIGTERM still ends its workers: at exit, multiprocessing ends the loader's live workers
    with it (an iterator held by the traceback, persistent workers), and a rank whose workers ignored it waited
    for them for ever."""
    done = _run(tmp_path, """
        import torch
        from ddpkit.trainer.loader_workers import SparedLoader

        batches = iter(SparedLoader(list(range(64)), num_workers=2, persistent_workers=True))
        next(batches)
        raise RuntimeError("the step failed")
    """)
    assert done.returncode == 1 and "the step failed" in done.stderr, done.stderr


SIGNALLED = """
    import os, signal, subprocess, time
    import torch
    from ddpkit.trainer.loader_workers import SparedLoader

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            time.sleep(0.2)
            child = os.fork()  # a process the worker forks has SIGTERM and SIGINT back, not its own children
            if child == 0:
                wrong = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []) or \\
                    signal.getsignal(signal.SIGINT) is signal.SIG_IGN
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # its own choice, which its children keep
                grandchild = os.fork()
                if grandchild == 0:
                    os._exit(signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
                os._exit(wrong or os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1]))
            return -1 if os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) else i

    if __name__ == "__main__":
        loader = SparedLoader(Slow(), num_workers=2, persistent_workers=True, multiprocessing_context="fork")
        batches = iter(loader)
        got = [next(batches)]
        for worker in batches._workers:  # from another process: the rank's own SIGTERM ends them
            subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)
            subprocess.run(["kill", "-INT", str(worker.pid)], check=True)
        time.sleep(0.5)
        got += list(batches)
        print("GOT", sorted(int(b) for b in got), flush=True)
"""


def test_a_loader_worker_signalled_by_another_than_its_rank_goes_on(tmp_path):
    """SLURM signals every process of a job step: a worker's SIGTERM or SIGINT from anyone but its rank is the
    rank's to act on (its stop, one checkpoint). It killed the worker, and the rank's next batch raised. At exit,
    multiprocessing's SIGTERM ends the persistent workers and waits for them."""
    done = _run(tmp_path, SIGNALLED, timeout=120)
    assert done.returncode == 0 and "GOT [0, 1, 2, 3, 4, 5]" in done.stdout, (done.stdout, done.stderr)


class _Tagged:
    tag = 0

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.tag * 100 + i


def _tag(worker_id):
    from torch.utils.data import get_worker_info

    get_worker_info().dataset.tag = 1


def test_workers_are_born_with_sigterm_blocked():
    """From its fork to its worker_init_fn (15-20 ms) a worker had torch's handler, and an outside SIGTERM then
    killed it: workers are forked with SIGTERM blocked in the forking thread (which the rank gets back)."""
    import multiprocessing.context as mp_context

    from ddpkit.trainer.loader_workers import SparedLoader

    masks = []

    class Recording(mp_context.ForkProcess):
        def start(self):
            masks.append(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))
            super().start()

    class Context(mp_context.ForkContext):
        Process = Recording

    loader = SparedLoader(_Tagged(), batch_size=4, num_workers=2, multiprocessing_context=Context(),
                          worker_init_fn=_tag)  # the caller's worker_init_fn runs too, after ddpkit's
    assert [b.tolist() for b in loader] == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert masks == [True, True]
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_worker_whose_rank_died_before_it_started_ends():
    """A worker reaching its worker_init_fn after its rank died (re-parented) ended nowhere: torch's watch of its
    parent took the new one. One whose parent lives but is not the rank (a forkserver's) goes on, as before."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    call = ("import os, sys; from ddpkit.trainer.loader_workers import spared_by_the_stop; "
            "spared_by_the_stop(0, rank=int(sys.argv[1])); print('ON')")
    ended = subprocess.run([sys.executable, "-c", call, str(dead.pid)], env=clean_env(), capture_output=True,
                           text=True, timeout=60)
    alive = subprocess.run([sys.executable, "-c", call, "1"], env=clean_env(), capture_output=True, text=True,
                           timeout=60)
    assert (ended.returncode, ended.stdout) == (1, ""), ended.stderr
    assert (alive.returncode, alive.stdout) == (0, "ON\n"), alive.stderr
