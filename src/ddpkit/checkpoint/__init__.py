"""Checkpoints: the files of one (`files`: written atomically by rank 0, loaded without unpickling code), the
checkpoints of an output_dir (`folders`), whether one is whole (`integrity`), the model's weights as
safetensors (`model_weights`), sharded optimizer state (`sharded`), every random generator (`rng_state`), which
checkpoint a run resumes from (`resume`), which run wrote each (`run_ids`) and one run at a time per output_dir
(`output_lock`).

May import: ddpkit.args, ddpkit.world, ddpkit.zero, ddpkit.distributed, ddpkit._utils, ddpkit.errors.
"""

from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint
from ddpkit.checkpoint.folders import find_latest_checkpoint

__all__ = ["find_latest_checkpoint", "load_checkpoint", "save_checkpoint"]
