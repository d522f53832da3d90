"""The process group and its collectives: the launcher's environment and the one value that describes the world
(`env`, `DistEnv`), ddpkit's own environment variables (`variables`), the backends (`backends`), meeting the other
ranks through the store (`store`), `Comm`, the only caller of torch.distributed collectives (`comm`, with each
collective's record and observers in `collective` and gloo's point-to-point reduce-scatter in `point_to_point`),
a worker's error file (`error_file`), the terminal its output reaches (`terminal`) and the watch on the launcher
(`launcher_watch`).

May import: ddpkit._utils, ddpkit.errors. Comm knows only a list of observers; it imports none of them.
"""
