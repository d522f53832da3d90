"""`ddpkit launch`: start the workers of a data-parallel job, on torch.distributed.elastic (torchrun's engine).

    ddpkit launch --nproc-per-node 2 train.py --lr 3e-4      # one node, 2 workers, store on loopback only
    ddpkit launch --nproc-per-node auto -m mypkg.train        # one worker per GPU, else per CPU core
    # two nodes, static rendezvous: run on each node, with its own --node-rank
    ddpkit launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 4 train.py
    # two nodes, elastic c10d rendezvous: the same line on every node
    ddpkit launch --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7 train.py

Flags (parsed by torchrun's own parser), their PET_* variables and the workers' environment (RANK, LOCAL_RANK,
WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR/PORT, TORCHELASTIC_*) are torchrun's. Starting, rendezvous, restarts
and error files are torchelastic's own; ddpkit adds, each in its own module:
  1. the plan: flags resolved into one `LaunchPlan` (ddpkit.launch.options; pure, unit-tested without processes);
  2. a single node by default, its store on a free loopback port, a fresh one for every restart
     (ddpkit.launch.rendezvous);
  3. output: each worker's stdout and stderr merged into one file per rank, forwarded live with a rank prefix
     (ddpkit.launch.console), a progress bar's carriage returns included, so that it redraws in place in a terminal;
  4. the summary: the root cause first, with its traceback (recorded by `ddpkit.errors` in the worker), the
     signal that killed a worker by name, a rank that exited with code 0 while the others still ran (which
     torchelastic does not count as failed), and the tail of its output when no traceback was recorded
     (ddpkit.launch.failure_report);
  5. --timeline FILE [--timeline-steps A:B]: every rank's steps in one Chrome trace, handed to the workers as
     DDPKIT_TIMELINE (ddpkit.timeline).
Signals: SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to the launcher are forwarded to every worker, which then
has --shutdown-timeout seconds to exit before SIGKILL. When a worker fails, torchelastic sends SIGTERM to the
others at once (and SIGKILL after its own fixed 30 s). Before the workers start (during the rendezvous) the
signals keep their default action (SIGINT: Python's KeyboardInterrupt under c10d, the OS's under the static
rendezvous, which waits in C++ where no Python handler runs), and the launcher leaves nothing behind
then: the temporary folder of the workers' output is made when they first start. Each worker learns the
launcher's pid (DDPKIT_LAUNCHER_PID, read by ddpkit.distributed.env), by which it stops when the launcher is killed
(ddpkit.distributed.launcher_watch).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import threading

from ddpkit.launch.failure_report import failure_summary
from ddpkit.launch.options import LaunchPlan, add_ddpkit_flags, plan_launch, torchrun_parser
from ddpkit.launch.rendezvous import rendezvous_handler

# torch (and torchelastic) are imported inside the functions that start processes (and torchrun's parser where
# flags are parsed), so that the plan's unit tests stay fast.


def _rank_logs(log_dir: str | None, tail, signals: str):
    """torchelastic LogsSpecs: per rank, one file with stdout and stderr, followed by `tail`; error files.
    `signals`: those that end the launcher once the workers start (comma-separated names)."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RankLogs(LogsSpecs):
        def __init__(self):
            self.owned = log_dir is None  # a temporary directory, made when the workers first start
            super().__init__(log_dir=None if self.owned else os.path.abspath(log_dir))
            if not self.owned:
                os.makedirs(self.root_log_dir, exist_ok=True)
            self.files: dict[int, str] = {}  # global rank -> output file of the latest attempt

        @property
        def root_log_dir(self) -> str:
            return str(self._root_log_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            if self._root_log_dir is None:
                # Not before: a signal during the rendezvous ends the launcher at once (its default action; a
                # handler would not even run while torch's TCPStore waits in C++), which must leave nothing
                # behind. From here torchelastic's own handlers (installed next, as it starts the workers) and
                # ours until then end the launcher through `run`'s cleanup instead.
                _signals_end_the_launcher(signals)
                self._root_log_dir = tempfile.mkdtemp(prefix="ddpkit-launch-")
            dest = LogsDest()
            for local_rank, env in envs.items():
                rank, attempt = int(env["RANK"]), int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                stem = os.path.join(self.root_log_dir, f"rank{rank}" + (f".restart{attempt}" if attempt else ""))
                error_file = stem + ".error.json"
                for stale in (error_file, stem + ".log"):  # from an earlier run in the same --log-dir: not ours
                    if os.path.exists(stale):  # (the tail below must not forward the old output)
                        os.remove(stale)
                env["TORCHELASTIC_ERROR_FILE"] = error_file
                # Not torchelastic's tee, which forwards whole lines only: our tail forwards a bar's redraws.
                dest.stdouts[local_rank] = stem + ".log"
                dest.stderrs[local_rank] = ""  # merged into stdout by the worker's wrapper
                dest.error_files[local_rank] = error_file
                self.files[rank] = stem + ".log"
                tail.follow(rank, stem + ".log")
            return dest

        def cleanup(self) -> None:
            if self.owned and self._root_log_dir is not None:
                shutil.rmtree(self.root_log_dir, ignore_errors=True)

    return RankLogs()


def _signals_end_the_launcher(names: str) -> None:
    """The signals named (comma-separated) raise torchelastic's SignalException, as its handlers do: `run` then
    stops the workers (if any started) and cleans up."""
    from torch.distributed.elastic.multiprocessing import SignalException

    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; torchelastic then sets none either

    def handler(signum, frame):
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    for name in filter(None, (part.strip() for part in names.split(","))):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), handler)


def _ctrl_c_ends_a_static_rendezvous(plan: LaunchPlan) -> None:
    """The static rendezvous waits in C++ (torch's TCPStore) for the other nodes, where Python's Ctrl-C handler
    never runs: a Ctrl-C went unheard until the rendezvous timed out (900 s). Until the workers start (the
    handlers of _signals_end_the_launcher, then torchelastic's, replace this) it ends the launcher at once, as
    SIGTERM does; nothing is there to clean up yet. (c10d's rendezvous waits in Python: its KeyboardInterrupt
    goes through `run`'s cleanup, which tells the other nodes.)"""
    if plan.rdzv_backend == "static" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _exited_early(agent) -> dict:
    """The workers of the last attempt that exited with code 0 before torchelastic saw the first failure, by
    global rank, as failures of code 0: torchelastic reports non-zero exits only, so a rank that left mid-job
    (sys.exit(0), os._exit(0) in a library) was missing from the summary, which blamed the peers that lost it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    context = getattr(agent, "_pcontext", None)
    # torchelastic's own record: the local ranks still running when it saw the first failure (it stopped them).
    running = getattr(context, "_running_local_ranks", None)
    handlers = getattr(context, "subprocess_handlers", None) or {}
    found = {}
    for worker in agent.get_worker_group().workers:
        handler = handlers.get(worker.local_rank)
        if running is not None and worker.local_rank not in running and handler and handler.proc.returncode == 0:
            found[worker.global_rank] = ProcessFailure(local_rank=worker.local_rank, pid=handler.proc.pid,
                                                       exitcode=0, error_file=context.error_files[worker.local_rank])
    return found


# `sh -c 'exec "$@" 2>&1'`: the worker's stderr joins its stdout, so one file per rank keeps both in order; exec
# leaves the worker's pid, signals and exit status as they would be without the wrapper.
MERGE_STDERR = ("/bin/sh", "-c", 'exec "$@" 2>&1', "ddpkit-worker")


def run(plan: LaunchPlan) -> int:
    """Run the job; the exit status: 0, 1 when a worker failed, 128+N when the launcher got signal N."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import SignalException

    from ddpkit.launch.console import Console, Tail

    console = Console(sys.stdout)
    _export_to_workers(plan, console)
    _ctrl_c_ends_a_static_rendezvous(plan)
    tail = Tail(console)
    logs = _rank_logs(plan.log_dir, tail, plan.signals)
    handler = None
    shutdown_rdzv = True
    try:
        handler = rendezvous_handler(plan)
        master_addr = master_port = None
        if plan.rdzv_backend == "static":  # otherwise the rendezvous says, per attempt
            master_addr, master_port = handler.master_addr, handler.master_port
        spec = WorkerSpec(role=plan.role, local_world_size=plan.nproc_per_node, entrypoint=MERGE_STDERR[0],
                          args=(*MERGE_STDERR[1:], *plan.command), rdzv_handler=handler,
                          max_restarts=plan.max_restarts, monitor_interval=plan.monitor_interval,
                          master_addr=master_addr, master_port=master_port, local_addr=plan.local_addr)
        agent = LocalElasticAgent(spec, logs_specs=logs, start_method=plan.start_method,
                                  shutdown_timeout=plan.shutdown_timeout)
        result = agent.run()
        tail.stop()  # every line of the workers first, then the summary
        if result is not None and result.is_failed():
            failures = {**_exited_early(agent), **result.failures}  # in the order they were seen
            print(failure_summary(failures, logs.files, logs.root_log_dir if not logs.owned else None),
                  file=sys.stderr, flush=True)
            return 1
        return 0
    except DistNetworkError as exc:  # node 0's store could not listen (static rendezvous: torchelastic's own)
        if "EADDRINUSE" not in str(exc):
            raise
        tail.stop()
        print(_port_in_use(str(exc)), file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        tail.stop()
        # torchelastic has already forwarded the signal and waited out the grace period. Leave the
        # rendezvous of a multi-node job open: its other nodes may still re-form it.
        shutdown_rdzv = plan.rdzv_backend == "loopback"
        print(f"ddpkit launch: stopped by {exc.sigval.name}; the workers were sent {exc.sigval.name}",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        try:
            tail.stop()  # again, harmless: for an error that escaped the agent
            if handler is not None and shutdown_rdzv:
                handler.shutdown()
        finally:
            logs.cleanup()  # also when a second signal interrupts the shutdown


def _export_to_workers(plan: LaunchPlan, console) -> None:
    """Into the launcher's environment, which the workers inherit (torchelastic copies os.environ into each): the
    plan's additions, who their launcher is, the console's width; and the signals the process context forwards."""
    from ddpkit._utils.procfs import pid_namespace
    from ddpkit.distributed.variables import CONSOLE_COLUMNS_VAR, LAUNCHER_PID_NS_VAR, LAUNCHER_PID_VAR, LAUNCHER_RUN_VAR
    from ddpkit.launch.console import PREFIX

    os.environ.update(plan.worker_env)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = plan.signals
    # This launcher (ddpkit.distributed.launcher_watch), not an outer one whose values it inherited.
    os.environ.update({LAUNCHER_PID_VAR: str(os.getpid()), LAUNCHER_PID_NS_VAR: pid_namespace() or "",
                       LAUNCHER_RUN_VAR: plan.run_id})
    if console.terminal and CONSOLE_COLUMNS_VAR not in os.environ:
        # What is left of the row after the prefix: a bar that fits redraws in place, one that wrapped could not.
        os.environ[CONSOLE_COLUMNS_VAR] = str(max(20, console.columns - len(PREFIX.format(rank=0)) - 2))


def _port_in_use(error: str) -> str:
    port = re.search(r"port: (\d+)", error)
    return (f"ddpkit launch: the rendezvous store cannot listen on port {port.group(1) if port else '?'} of this "
            "host: something else uses it. Pick another --master-port (or leave it out on one node), or stop what "
            "holds it (ss -ltnp)")


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register `launch` on the CLI's subparsers; the command runs `main(args)`."""
    # torchrun's flags, from its own parser; "resolve": its -h stands in for the one add_parser makes.
    parser = subparsers.add_parser(
        "launch", help="start a data-parallel job (torchrun's flags)", parents=[torchrun_parser()],
        conflict_handler="resolve", description=__doc__.split("\n\n")[0],
        epilog="Every option may also come from PET_<OPTION>, as under torchrun (e.g. PET_NPROC_PER_NODE=2).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ddpkit_flags(parser)
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    try:
        plan = plan_launch(args)
    except ValueError as exc:
        print(f"ddpkit launch: {exc}", file=sys.stderr)
        return 2
    return run(plan)


__all__ = ["LaunchPlan", "add_subcommand", "main", "plan_launch", "run"]
