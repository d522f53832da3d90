"""Every public exception of ddpkit, so that every layer may raise them and every user may catch them by one
import. This module imports nothing (of ddpkit, of torch).

    ArgumentError           a training argument is invalid or contradicts another (`field` names it)
    LaunchError             the launcher's environment does not describe a usable world
    CheckpointError         a checkpoint is incomplete or corrupt, or could not be written
    OutputDirBusy           another run holds the output_dir
    ReplicaDivergenceError  the replicas are no longer identical across ranks
    StallError, DeadlockError, PeerFailedError, PeerLeftError, PeerVanishedError: what the stall inspector
                            raises when a collective cannot complete (ddpkit.doctor)
"""

from __future__ import annotations


class StallError(RuntimeError):
    """A collective timed out; the message says which ranks did not arrive and what they were doing."""


class PeerFailedError(RuntimeError):
    """Another rank of the job failed; raised in this rank's main thread."""


class DeadlockError(StallError):
    """Every rank is blocked in collectives that can never complete (an order mismatch, or a rank that left);
    the message names what each rank called and from which line."""


class PeerLeftError(RuntimeError):
    """A rank left the process group (it exited without an error, or destroyed the group) while this rank
    still needed it; the message names that rank and the last collective it took part in."""


class PeerVanishedError(PeerLeftError):
    """A rank's process ended without telling the others of an error or that it left (os._exit, a signal such
    as SIGKILL, the out-of-memory killer), or the store its host kept went with it, while this rank still needed
    it; the message names it and where it was.
    Not counted among EXPLAINING_ERRORS: a rank killed by a signal is its own root cause, and the launcher
    names it; so is one that exited with code 0 while the others still ran (ddpkit.launch.failure_report), with this error's
    account of where it was printed after it."""


# The names of the errors that explain a failure rather than suffer it: the launcher's root-cause logic counts
# a traceback that ends in one of them as the cause, even though it also quotes the peer's closed connection.
EXPLAINING_ERRORS = ("DeadlockError", "PeerLeftError")


class ArgumentError(ValueError):
    """A training argument is invalid or contradicts another; `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class LaunchError(RuntimeError):
    """The environment the launcher gave does not describe a usable world."""


class ReplicaDivergenceError(RuntimeError):
    """The replicas of the model are no longer identical across ranks."""


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or corrupt, or could not be written; the message names the file."""


class OutputDirBusy(RuntimeError):
    """Another run holds the output_dir's lock."""
