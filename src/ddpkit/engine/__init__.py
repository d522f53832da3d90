"""The DDP engine: `DistributedDataParallel` (`ddp`, with its constructor's checks in `checks`, what its forward
does with inputs and outputs in `forward_io`, and the rest of torch's surface in `torch_surface`), the reducer
and its backward hooks (`reducer`, `backward_pass`), gradient buckets (`buckets`), how a bucket is reduced
(`reductions`, `comm_hooks`), uneven inputs (`join`), and the gradient side of sharding that
`DistributedDataParallel(zero_stage=2)` plugs into the reducer: which rank owns which elements (`partition`),
the reduce-scatter into shards (`sharded_grads`) and parameters still being gathered (`params_in_flight`).

May import: ddpkit.timeline (its recording API), ddpkit.distributed, ddpkit.data, ddpkit._utils, ddpkit.errors.
The engine knows no optimizer and no Trainer.
"""
