"""ZeRO: `ZeroRedundancyOptimizer` (`optimizer`), a drop-in for torch's class of that name, stage 1 by itself and
stage 2 with `DistributedDataParallel(zero_stage=2)`; its units at run time (`unit`), the local optimizer of a
shard (`local_optimizer`) and optimizer state between shards and torch's whole format (`optimizer_state`).

May import: ddpkit.engine, ddpkit.distributed, ddpkit._utils, ddpkit.errors.
"""
