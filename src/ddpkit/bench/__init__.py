"""`ddpkit bench` (`python -m ddpkit.bench`): step time of ddpkit's DDP and ZeRO against torch's, interleaved in one
run (`runner`, `zero`), one rank's timing (`rank`), the workloads (`workloads`), memory (`zero_memory`) and the
table (`report`).

May import: every package but ddpkit.cli.
"""
