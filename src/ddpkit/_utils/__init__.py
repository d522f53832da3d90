"""Small helpers every layer may use: files written whole (`atomic`), what /proc says of processes and a process
that dies with its parent (`procfs`), raising across threads and warning at the user's line (`raising`).

May import: ddpkit.errors only.
"""
