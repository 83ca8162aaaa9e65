"""``python -m loom`` (what torchrun/srun run on every rank)."""

from loom.cli import run

run()
