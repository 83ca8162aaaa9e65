"""``python -m loom`` (what torchrun/srun run on every rank)."""

import sys

from loom.cli import main

sys.exit(main())
