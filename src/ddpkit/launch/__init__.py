"""`ddpkit launch`: start the workers of a job on torch.distributed.elastic (`launcher`), with torchrun's flags
(`options`) and rendezvous (`rendezvous`); every rank's output on one console (`console`) and, when the job
fails, the root cause first (`failure_report`).

May import: ddpkit.timeline (its request), ddpkit.distributed, ddpkit._utils, ddpkit.errors.
"""
