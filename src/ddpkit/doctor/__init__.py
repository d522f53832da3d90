"""The stall inspector: which rank, which collective, which line, long before the timeout. `inspector` observes a
Comm and publishes this rank's state in the job's store (`rank_states`); `diagnosis` reasons over every rank's
states (pure); `device_work` sees collectives a device has not completed.

May import: ddpkit.distributed, ddpkit._utils, ddpkit.errors.
"""
