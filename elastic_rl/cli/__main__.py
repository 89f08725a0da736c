"""`python -m elastic_rl.cli ARGS`: `erl ARGS`, for subprocesses started with the current interpreter."""

import sys

from elastic_rl.cli.main import main

sys.exit(main())
