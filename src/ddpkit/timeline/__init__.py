"""The timeline: where every rank's step goes, and how much communication hides behind compute. The engine and
the Trainer record through `record`; `recorder` observes a Comm and writes the trace; `clock` aligns the ranks'
clocks, `trace` merges them into one Chrome trace, `summary` reads it (pure), `spec` is the launcher's request
and `cli` the `ddpkit timeline` command.

May import: ddpkit.distributed, ddpkit._utils, ddpkit.errors.
"""
