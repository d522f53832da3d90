"""Run a command as the child of a subreaper (Linux's PR_SET_CHILD_SUBREAPER): what is orphaned below it is
re-parented to this process, not to pid 1, as under a container's init or `systemd --user`.

    python tests/scripts/subreaper.py CMD [ARGS...]

Prints `CHILD <pid>` (the command's pid), then `REAPED <pid> <exit status>` for each process it reaps, the
re-parented orphans included; exits once nothing is left to reap, with the command's exit status (as
subprocess gives it: -N for signal N, shown as 128+N).
"""

import ctypes
import os
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36

if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
child = subprocess.Popen(sys.argv[1:])
print(f"CHILD {child.pid}", flush=True)
status = 0
while True:
    try:
        pid, raw = os.wait()
    except ChildProcessError:
        break
    code = os.waitstatus_to_exitcode(raw)
    print(f"REAPED {pid} {code}", flush=True)
    if pid == child.pid:
        status = code if code >= 0 else 128 - code
sys.exit(status)
