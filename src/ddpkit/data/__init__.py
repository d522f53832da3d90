"""Samplers: every sample once per epoch over the ranks, resumable mid-epoch onto any number of replicas
(`sampler`), and grouped by length (`length_sampler`).

May import: ddpkit._utils, ddpkit.errors (they need no process group).
"""
