"""Training arguments with the Transformers names: `TrainingArguments` (`training_args`), the command line
(`parser`), the Transformers fields ddpkit has not (`transformers_only`), what a script reads off the arguments
about its process (`process`) and the checks of every field (`validation`).

May import: ddpkit.world, ddpkit.distributed, ddpkit._utils, ddpkit.errors.
"""

from ddpkit.args.parser import ArgumentParser, parse_args
from ddpkit.args.training_args import TrainingArguments

__all__ = ["ArgumentParser", "TrainingArguments", "parse_args"]
