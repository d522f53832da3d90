"""Every environment variable of ddpkit's own, spelled whole so that a search finds it: `ddpkit launch` sets
them for its workers, and the modules named beside each read them. (torch's and the launchers' variables,
RANK, MASTER_ADDR, SLURM_*, ..., are read by ddpkit.distributed.env alone.)"""

# The launcher's pid, its PID namespace and its run id: a worker stops when its launcher dies
# (ddpkit.distributed.launcher_watch), and a resumed launch finds its own run (ddpkit.checkpoint.run_ids).
LAUNCHER_PID_VAR = "DDPKIT_LAUNCHER_PID"
LAUNCHER_PID_NS_VAR = "DDPKIT_LAUNCHER_PID_NS"
LAUNCHER_RUN_VAR = "DDPKIT_LAUNCHER_RUN_ID"
# How many columns of the launcher's terminal a worker may use, so that a progress bar redraws in place there
# (ddpkit.distributed.terminal.console_columns).
CONSOLE_COLUMNS_VAR = "DDPKIT_CONSOLE_COLUMNS"
# `ddpkit launch --timeline FILE --timeline-steps A:B`: the trace to write and the steps to record
# (ddpkit.timeline.spec encodes and decodes it).
TIMELINE_VAR = "DDPKIT_TIMELINE"
