"""What several test files share: free ports, a launcher's environment scrubbed of foreign variables, reaping a
launched process group, and `run_world`, which runs a function on N gloo ranks with a deadline.

    results = run_world(check_something, world_size=2, args=(seed,))
    proc = subprocess.Popen([...], env=clean_env(OMP_NUM_THREADS="1"), start_new_session=True)
    ...
    reap(proc)                                      # in a finally block: SIGTERM, then SIGKILL to its session

`run_world`: `fn(world, *args)` runs on every rank after `ddpkit.init_process_group(backend="gloo")`; `world` is
the `DistEnv`. Its return value (picklable) comes back in rank order. If any rank raises, the others are killed
and the test fails with that rank's traceback; if the deadline passes, every rank is killed and the test fails
naming the ranks that had not finished. No process or port outlives the call.

Test files import these by name (`from conftest import run_world`); tests/spawn.py re-exports run_world for
the files that still import it from there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import io
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
import zipfile
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

# Variables a surrounding launcher (or CI under SLURM) may have set; every launch in the tests starts without them.
FOREIGN_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_.*|MASTER_ADDR|"
                          r"MASTER_PORT|TORCHELASTIC_.*|SLURM_.*|PET_.*|OMPI_.*|PMI_.*|OMP_NUM_THREADS|"
                          r"GLOO_SOCKET_IFNAME|ACCELERATE_.*)$")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without FOREIGN_VARS, plus `extra`: what a launch in a test starts with."""
    env = {k: v for k, v in os.environ.items() if not FOREIGN_VARS.match(k)}
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reap(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a process started with start_new_session=True the way a user would (SIGTERM to its session, which a
    launcher forwards to its workers), then SIGKILL what is left of the session, and wait for it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# -- run_world: N gloo ranks in forked processes ------------------------------------------------------------------
DEFAULT_DEADLINE_S = 120.0


def _rank_main(fn, rank, world_size, port, args, env, results, collective_timeout_s, backend, stall_seconds):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)  # ranks share two cores; more threads per rank only contend
    import ddpkit

    try:
        world = ddpkit.init_process_group(backend=backend, timeout=collective_timeout_s,
                                          device_type="cuda" if backend == "nccl" else "cpu",
                                          stall_seconds=stall_seconds)
        try:
            value = fn(world, *args)
        finally:
            ddpkit.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_world(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), env: dict | None = None,
              deadline_s: float = DEFAULT_DEADLINE_S, collective_timeout_s: float = 60.0,
              expect_errors: bool = False, backend: str = "gloo", start_method: str | None = None,
              stall_seconds: float | None = None) -> list[Any]:
    """Results of `fn(world, *args)` on each rank, in rank order. expect_errors=True returns the per-rank
    outcome instead of failing: ("ok", value) or ("error", text)."""
    # fork starts a rank in a fraction of a second (torch is already imported); spawn is for CUDA.
    method = start_method or os.environ.get("DDPKIT_TEST_START_METHOD", "fork")
    ctx = mp.get_context(method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, rank, world_size, port, args, env or {}, results, collective_timeout_s,
                               backend, stall_seconds))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(outcomes) < world_size:
            left = end - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(f"ranks {missing} did not finish within {deadline_s:.0f} s; "
                                   f"finished: {sorted(outcomes)}")
            try:
                rank, status, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
                if dead and results.empty():
                    time.sleep(0.2)  # a result may still be in flight through the pipe
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RuntimeError(f"ranks died without a result (exit codes {codes})")
                continue
            outcomes[rank] = (status, value)
            if status == "error" and not expect_errors:
                raise AssertionError(f"rank {rank} failed:\n{value}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outcomes) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        results.join_thread()
    if expect_errors:
        return [outcomes[r] for r in range(world_size)]
    return [outcomes[r][1] for r in range(world_size)]


# -- comparing models: what the DDP and ZeRO tests check against single-process truth -----------------------------
def two_at_a_time(runs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each run (a launch that keeps its own deadline) on one of two threads; by name, its finished future, whose
    result() raises the run's failure in the test that reads it. Launches spend much of their time importing on
    one core, so a second one fills the other."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(fn) for name, fn in runs.items()}
    return futures  # all done: leaving the pool waited for them


def stay_until(path: str, limit_s: float = 60.0) -> None:
    """Sleep until `path` exists (another rank says it is done), for at most `limit_s`: a rank that must not
    join a collective stays up without a fixed sleep (gone earlier, it would close the connection its peer
    waits on)."""
    end = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def save_and_load(obj: Any, weights_only: bool = False) -> Any:
    """`obj` through torch.save and torch.load in memory."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=weights_only)


def fingerprint(module: "torch.nn.Module", buffers: bool = False) -> str:
    """A hash of the parameters (and buffers: they differ between ranks after a forward, until the next)."""
    digest = hashlib.sha256()
    for name, tensor in list(module.named_parameters()) + (list(module.named_buffers()) if buffers else []):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def grads_of(module: "torch.nn.Module") -> dict[str, Any]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def assert_close_grads(got: dict, want: dict, what: str, tol: float = 1e-5) -> None:
    for name in want:
        g, w = got[name], want[name]
        if w is None or g is None:
            assert g is None and w is None, f"{what}: {name} grad None mismatch (got {g is None}, want {w is None})"
            continue
        err = (g - w).abs().max().item()
        assert err <= tol, f"{what}: {name} differs from single-process truth by {err:.3g}"


# -- checkpoints: a small model, its optimizer and schedule, saved by one process -----------------------------------
def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    net[2].weight = nn.Parameter(torch.randn(3, 8))
    return net


def trained_parts(seed: int = 0):
    """small_model after 3 AdamW steps under a LambdaLR schedule: (model, optimizer, scheduler)."""
    model = small_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def save_small(out, step, model, opt=None, sched=None, limit=None, state=None) -> str:
    """ddpkit.checkpoint.save_checkpoint in a world of one; the checkpoint's path."""
    from ddpkit import checkpoint
    from ddpkit.comm import Comm
    from ddpkit.env import single_process_env

    return checkpoint.save_checkpoint(str(out), step, model=model, optimizer=opt, scheduler=sched,
                                      trainer_state=state or {"global_step": step, "log_history": []},
                                      sampler_state={"epoch": 1, "seed": 3, "consumed": 40}, comm=Comm(),
                                      world=single_process_env(), save_total_limit=limit)


def flip_inside(file: str) -> None:
    """Change bytes inside a file's data, keeping its size and its structure: the first tensor's bytes of a
    safetensors file, the first storage record of a torch zip archive, a digit of a JSON file."""
    with open(file, "rb") as f:
        data = bytearray(f.read())
    if file.endswith(".json"):
        at = re.search(rb"\d", data).start()
        data[at] = ord("7") if data[at] != ord("7") else ord("3")
    else:
        if file.endswith(".safetensors"):
            (length,) = struct.unpack("<Q", data[:8])
            at = 8 + length  # the tensors' bytes follow the header
        else:
            with zipfile.ZipFile(file) as archive:
                record = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size >= 4)
            # A zip record's local header: 30 bytes with the name's and the extra field's lengths at 26, then both.
            name, extra = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
            at = record.header_offset + 30 + name + extra
        data[at:at + 4] = bytes(b ^ 0xFF for b in data[at:at + 4])
    with open(file, "r+b") as f:
        f.write(data)



# -- the Trainer's test models and data ----------------------------------------------------------------------------
class Classifier(nn.Module):
    def __init__(self, d_in=6, hidden=16, classes=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Dropout(0.2), nn.Linear(hidden, classes))

    def forward(self, x, labels=None, idx=None):
        logits = self.net(x)
        return {"loss": None if labels is None else F.cross_entropy(logits, labels), "logits": logits}


class Tagger(nn.Module):
    """Per-token classification: padding (label -100) changes nothing, so any batching gives the same sum."""

    def __init__(self, vocab=11, dim=8, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100),
                "logits": logits}


def classification_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return [{"x": x[i], "labels": y[i], "idx": torch.tensor(i)} for i in range(n)]


def token_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 9, (), generator=g))
        ids = torch.randint(1, 11, (length,), generator=g)
        out.append({"input_ids": ids, "labels": ids % 4})
    return out


def pad_collate(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])] = s["input_ids"]
        labels[row, :len(s["labels"])] = s["labels"]
    return {"input_ids": ids, "labels": labels}


class FixedShards(torch.utils.data.Sampler):
    """Rank r reads exactly shards[r]: ranks with different numbers of batches."""

    def __init__(self, shards, rank):
        self.indices, self.epoch, self.consumed = shards[rank], 0, 0

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def state_dict(self):
        return {"epoch": self.epoch, "seed": 0, "consumed": self.consumed}

    def load_state_dict(self, state):
        self.epoch, self.consumed = state["epoch"], state["consumed"]


def trainer_args(out, **kw):
    """TrainingArguments for the small test runs: logs every step, saves nothing, constant learning rate, on the
    CPU (the worlds are gloo's; on a machine with GPUs the Trainer would otherwise pin one per rank)."""
    from ddpkit.args import TrainingArguments

    base = dict(output_dir=str(out), learning_rate=0.05, logging_steps=1, save_strategy="no", disable_tqdm=True,
                seed=7, ddp_timeout=60, lr_scheduler_type="constant", use_cpu=True)
    return TrainingArguments(**{**base, **kw})


def params_of(model):
    """Parameters as numpy arrays: tensors cannot travel back from a rank through spawn's queue."""
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def accuracy(pred):
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean()),
            "n": float(len(pred.label_ids))}


@pytest.fixture
def local_world():
    """In-process trainers make a world of one; tear it down so later forked ranks start clean."""
    import ddpkit

    yield
    ddpkit.destroy_process_group()


def communicate_all(procs: list, proc: subprocess.Popen, deadline_s: float) -> tuple[str, str]:
    """proc's output once it ends; past the deadline, whether each process still runs (and what) and its output so
    far, in the failure (a two-node launch that did not end once said nothing of which node, nor why)."""
    try:
        return proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        states = [_still_running(other) for other in procs]  # which one hung, and what it left running
        for other in procs:
            other.kill()
        seen = "\n----\n".join(f"[{state}]\n{out}\n{err}" for state, (out, err) in
                                zip(states, (other.communicate() for other in procs)))
        pytest.fail(f"did not end within {deadline_s} s; each process's state and output so far:\n{seen}")


def _still_running(proc: subprocess.Popen) -> str:
    """`proc`'s exit status, or that it still runs, with every process under it (pid and command line)."""
    if proc.poll() is not None:
        return f"pid {proc.pid} exited with {proc.returncode}"
    from ddpkit.procfs import descendants

    found = []
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            found.append(f"{pid}: {f.read().replace(bytes(1), b' ').decode(errors='replace')[:160]}")
    return "still running: " + "; ".join(found)


def run_pair(tmp_path, text: str, deadline_s: float = 60) -> list[tuple[int, str, str, float]]:
    """Run `text` as ranks 0 and 1 of a world (plain processes, no launcher); (exit status, stdout, stderr,
    unix time it ended) per rank. Every process is reaped."""
    script = tmp_path / "pair.py"
    script.write_text(text)
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            env.pop("TORCHELASTIC_ERROR_FILE", None)
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        results = []
        end = time.monotonic() + deadline_s
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, end - time.monotonic()))
            results.append((proc.returncode, out, err, time.time()))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
