"""`python -m ddpkit.bench ...`: the same as `ddpkit bench ...`."""

import sys

from ddpkit.bench.runner import main

sys.exit(main())
